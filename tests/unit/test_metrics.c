/* Tests of the Prometheus exposition writer (daemon/control/metrics.c) on status snapshots built
 * by hand: which keys give which samples, unit conversion, labels and their escaping, values that
 * are not numbers, and one HELP/TYPE block per family. The served endpoint, promtool's verdict
 * and the values of a real run are tests/integration/test_metrics.py's.
 */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "metrics.h"
#include "status.h"

static char *render(const zd__status_t *st) {
  char *text = NULL;
  size_t len = 0;
  CHECK_INT_EQ(zd__metrics_render(st, &text, &len), 0);
  CHECK(text != NULL);
  CHECK_U64_EQ(strlen(text), len);
  return text;
}

static int count(const char *text, const char *needle) {
  int n = 0;
  for (const char *p = strstr(text, needle); p; p = strstr(p + 1, needle)) n++;
  return n;
}

#define CHECK_NOT_CONTAINS(haystack, needle) \
  CHECK_MSG(!strstr(haystack, needle), "unexpected \"%s\" in:\n%s", needle, haystack)

static void add_rank(zd__status_t *st, int rank, const char *health, const char *reason,
                     int model) {
  char name[32];
  snprintf(name, sizeof name, "rank %d", rank);
  zd__status_section(st, name);
  zd__status_add(st, "rank", "%d", rank);
  zd__status_add(st, "local_rank", "%d", rank - 4);
  zd__status_add(st, "health", "%s", health);
  if (reason) zd__status_add(st, "degraded_reason", "%s", reason);
  zd__status_add(st, "client", "%s", model ? "trainer-1" : "none");
  zd__status_add(st, "model", "%s", model ? "registered" : "none");
  if (!model) return;
  zd__status_add(st, "state_bytes", "%d", 12 * 1000);
  zd__status_add(st, "grad_shard_bytes", "%d", 4 * 1000);
  zd__status_add(st, "step", "%d", 17);
  zd__status_add(st, "steps_skipped", "%d", 2);
  zd__status_add(st, "loss_scale", "%g", 65536.0);
  zd__status_add(st, "last_grad_norm", "%s", "nan"); /* no norm computed yet */
  zd__status_add(st, "last_clip_coef", "%s", "inf");
  zd__status_add(st, "last_step_us", "%d", 1234567);
  zd__status_add(st, "mean_step_us", "%d", 42);
}

static void test_full_status(void) {
  zd__status_t *st = zd__status_new();
  CHECK(st != NULL);
  zd__status_section(st, "server");
  zd__status_add(st, "version", "%s", "1.2.3");
  zd__status_add(st, "backend", "%s", "cpu");
  zd__status_add(st, "socket", "%s", "/run/secret/path.sock"); /* never exported */
  zd__status_add(st, "requests_total", "%s", "18446744073709551615");
  zd__status_add(st, "clients_connected", "%s", "not a number");
  zd__status_section(st, "world");
  zd__status_add(st, "world_size", "%d", 8);
  add_rank(st, 4, "ok", NULL, 1);
  add_rank(st, 5, "degraded", "peer \"rank 6\" closed\nthe C:\\ connection", 0);
  zd__status_section(st, "config");
  zd__status_add(st, "control_address", "%s", "10.0.0.1:7070 (flag)");
  CHECK_INT_EQ(zd__status_nsections(st), 5);

  char *t = render(st);
  /* server and world */
  CHECK_CONTAINS(t,
                 "# TYPE zerod_info gauge\nzerod_info{version=\"1.2.3\",backend=\"cpu\","
                 "kernel_isa=\"\"} 1\n");
  CHECK_CONTAINS(t,
                 "# TYPE zerod_requests_total counter\nzerod_requests_total "
                 "18446744073709551615\n");
  CHECK_CONTAINS(t, "\nzerod_world_size 8\n");
  CHECK_NOT_CONTAINS(t, "zerod_clients_connected"); /* not a number: no sample, no header */
  CHECK_NOT_CONTAINS(t, "secret");
  CHECK_NOT_CONTAINS(t, "10.0.0.1");
  CHECK_NOT_CONTAINS(t, "trainer-1");
  /* ranks: labels, health and the degraded reason escaped */
  CHECK_CONTAINS(t, "zerod_rank_healthy{rank=\"4\",local_rank=\"0\"} 1\n");
  CHECK_CONTAINS(t, "zerod_rank_healthy{rank=\"5\",local_rank=\"1\"} 0\n");
  CHECK_CONTAINS(t, "zerod_rank_degraded{rank=\"4\",local_rank=\"0\",reason=\"\"} 0\n");
  CHECK_CONTAINS(t,
                 "zerod_rank_degraded{rank=\"5\",local_rank=\"1\",reason=\"peer \\\"rank 6\\\" "
                 "closed\\nthe C:\\\\ connection\"} 1\n");
  CHECK_CONTAINS(t, "zerod_rank_client_attached{rank=\"4\",local_rank=\"0\"} 1\n");
  CHECK_CONTAINS(t, "zerod_rank_client_attached{rank=\"5\",local_rank=\"1\"} 0\n");
  CHECK_CONTAINS(t, "zerod_rank_model_registered{rank=\"5\",local_rank=\"1\"} 0\n");
  /* model numbers: only rank 4 has a model */
  CHECK_CONTAINS(t, "zerod_rank_step{rank=\"4\",local_rank=\"0\"} 17\n");
  CHECK_NOT_CONTAINS(t, "zerod_rank_step{rank=\"5\"");
  CHECK_CONTAINS(t, "zerod_rank_steps_skipped_total{rank=\"4\",local_rank=\"0\"} 2\n");
  CHECK_CONTAINS(t, "zerod_rank_loss_scale{rank=\"4\",local_rank=\"0\"} 65536\n");
  CHECK_NOT_CONTAINS(t, "zerod_rank_grad_norm"); /* NaN: no sample */
  CHECK_CONTAINS(t, "zerod_rank_clip_coefficient{rank=\"4\",local_rank=\"0\"} +Inf\n");
  CHECK_CONTAINS(t,
                 "zerod_rank_last_step_duration_seconds{rank=\"4\",local_rank=\"0\"} "
                 "1.234567\n");
  CHECK_CONTAINS(t,
                 "zerod_rank_mean_step_duration_seconds{rank=\"4\",local_rank=\"0\"} "
                 "0.000042\n");
  /* two kinds of state bytes, one family */
  CHECK_INT_EQ(count(t, "# TYPE zerod_rank_state_bytes gauge\n"), 1);
  CHECK_CONTAINS(t,
                 "zerod_rank_state_bytes{rank=\"4\",local_rank=\"0\","
                 "kind=\"master_and_moments\"} 12000\n"
                 "zerod_rank_state_bytes{rank=\"4\",local_rank=\"0\",kind=\"grad_shard\"} "
                 "4000\n");
  CHECK_NOT_CONTAINS(t, "zerod_rank_gpu_info"); /* no gpu_uuid key */
  /* every HELP is followed by its TYPE, and every family has one of each */
  CHECK_INT_EQ(count(t, "# HELP "), count(t, "# TYPE "));
  for (const char *p = strstr(t, "# HELP "); p; p = strstr(p + 1, "# HELP ")) {
    const char *name = p + 7, *sp = strchr(name, ' '), *nl = strchr(p, '\n');
    CHECK(sp && nl);
    CHECK_MSG(!strncmp(nl + 1, "# TYPE ", 7) && !strncmp(nl + 8, name, (size_t)(sp - name)),
              "HELP of %.*s is not followed by its TYPE", (int)(sp - name), name);
  }
  free(t);
  zd__status_free(st);
}

static void test_empty_status(void) {
  zd__status_t *st = zd__status_new();
  CHECK(st != NULL);
  char *t = render(st);
  CHECK_STR_EQ(t, "");
  free(t);
  zd__status_free(st);
}

int main(void) {
  test_full_status();
  test_empty_status();
  printf("metrics: ok\n");
  return 0;
}
