/* bench_overlap: what the optimizer update adds to a trainer's iteration, with overlap_update on
 * and off, next to the trainer's forward + backward alone.
 *
 * Two zerods (world size 1, AdamW, f32), one with overlap_update = 1 and one without, both bound
 * to the last CPU of this process's affinity mask with one kernel thread; this program, the
 * trainer, runs on the first CPU. A model of n parameters in --buckets buckets (one parameter
 * each) is registered with each. Forward + backward is synthetic: a busy loop of --fwd times the
 * update's own time for the forward, then, per bucket in descending order (as backward completes
 * them), a busy loop of --bwd times the update's time divided by the buckets, after which the
 * bucket's scatter is sent without waiting (zd_scatter_start, as zerod.torch's backward hooks
 * do). Then step (ZD_STEP_NO_SCATTER) and wait for it: the iteration's end.
 *
 * The update's time (update_ms) is measured first in the same run: a step of the off zerod after
 * every scatter has completed. Each row gives medians over --iters iterations (after 2 warm-up),
 * the three kinds alternating: fb_ms (forward + backward alone, no zerod), off_ms and on_ms (the
 * whole iteration), and what the update adds to forward + backward in each (+off, +on). The
 * issue's target: +on at most 10% once the update alone is shorter than backward.
 *
 *   bench_overlap [--zerod PATH] [--min-log2 20] [--max-log2 24] [--buckets 8] [--iters 7]
 *                 [--fwd 0.5] [--bwd 1.5,3]
 */
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "mempass.h"
#include "zerod/zerod.h"

#define MAX_BUCKETS 64

static void usage(void) {
  fprintf(stderr,
          "usage: bench_overlap [--zerod PATH] [--min-log2 N] [--max-log2 N] [--buckets N]\n"
          "                     [--iters N] [--fwd X] [--bwd X[,X...]]\n");
  exit(2);
}

static void die(const char *what) {
  fprintf(stderr, "bench_overlap: %s: %s\n", what, zd_last_error());
  exit(1);
}

static void busy(double seconds) {
  double end = zd_bench_now() + seconds;
  while (zd_bench_now() < end) {
  }
}

static zd_client_t *attach(const zdt_daemon_t *d, uint64_t n, int nb) {
  zd_client_t *c;
  if (zd_connect(d->socket, ZD_ANY_RANK, 0, &c) != ZD_OK) die("connect");
  zd_param_t p[MAX_BUCKETS];
  char names[MAX_BUCKETS][16];
  for (int b = 0; b < nb; b++) {
    snprintf(names[b], sizeof names[b], "w%d", b);
    p[b] = (zd_param_t){.name = names[b], .ndim = 1, .shape = {n / (uint64_t)nb}, .group = 0};
  }
  zd_group_t g;
  zd_group_init(&g, 1, sizeof g);
  g.weight_decay = 0.01;
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = p;
  desc.nparams = (size_t)nb;
  desc.groups = &g;
  desc.ngroups = 1;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  desc.flags = ZD_REGISTER_REPLACE;
  if (zd_layout(c, &desc) != ZD_OK) die("layout");
  float *w = zd_param_buffer(c, NULL);
  for (uint64_t i = 0; i < n; i++) w[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
  if (zd_register(c) != ZD_OK) die("register");
  float *gr = zd_grad_buffer(c, NULL);
  for (uint64_t i = 0; i < n; i++) gr[i] = (float)((i * 40503u) % 1000) * 1e-5f - 5e-3f;
  zd_info_t info = ZD_INFO_INIT;
  if (zd_get_info(c, &info) != ZD_OK) die("info");
  if ((int)info.nbuckets != nb) {
    fprintf(stderr, "bench_overlap: %u buckets, expected %d\n", info.nbuckets, nb);
    exit(1);
  }
  return c;
}

static void step(zd_client_t *c) {
  zd_step_opts_t o = ZD_STEP_OPTS_INIT;
  o.flags = ZD_STEP_NO_SCATTER;
  zd_step_result_t r = ZD_STEP_RESULT_INIT;
  if (zd_step(c, &o, &r) != ZD_OK) die("step");
}

/* One iteration; c NULL: forward + backward alone. */
static double iteration(zd_client_t *c, int nb, double fwd, double bwd_bucket) {
  zd_request_t req[MAX_BUCKETS];
  double t0 = zd_bench_now();
  busy(fwd);
  for (int b = nb; b-- > 0;) {
    busy(bwd_bucket);
    if (c && zd_scatter_start(c, b, &req[b]) != ZD_OK) die("scatter");
  }
  if (c) {
    for (int b = nb; b-- > 0;)
      if (zd_wait(c, req[b], NULL) != ZD_OK) die("scatter wait");
    step(c);
  }
  return zd_bench_now() - t0;
}

/* The update alone: a step once every scatter is done. */
static double update_seconds(zd_client_t *c, int nb, int iters) {
  double t[32];
  for (int it = 0; it < iters + 2; it++) {
    for (int b = nb; b-- > 0;)
      if (zd_scatter(c, b) != ZD_OK) die("scatter");
    double t0 = zd_bench_now();
    step(c);
    if (it >= 2) t[it - 2] = zd_bench_now() - t0;
  }
  return zd_bench_median(t, iters);
}

static void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  if (sched_setaffinity(0, sizeof s, &s) != 0) perror("bench_overlap: sched_setaffinity");
}

int main(int argc, char **argv) {
  int min_log2 = 20, max_log2 = 24, nb = 8, iters = 7;
  double fwd = 0.5, bwd[8] = {1.5, 3.0};
  int nbwd = 2;
  const char *zerod = getenv("ZEROD_BIN") ? getenv("ZEROD_BIN") : "build/daemon/zerod";
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) usage();
    const char *o = argv[i], *v = argv[i + 1];
    if (!strcmp(o, "--zerod"))
      zerod = v;
    else if (!strcmp(o, "--min-log2"))
      min_log2 = atoi(v);
    else if (!strcmp(o, "--max-log2"))
      max_log2 = atoi(v);
    else if (!strcmp(o, "--buckets"))
      nb = atoi(v);
    else if (!strcmp(o, "--iters"))
      iters = atoi(v);
    else if (!strcmp(o, "--fwd"))
      fwd = atof(v);
    else if (!strcmp(o, "--bwd")) {
      nbwd = 0;
      for (char *s = (char *)v; *s && nbwd < 8; s = strchr(s, ',') ? strchr(s, ',') + 1 : "")
        bwd[nbwd++] = atof(s);
    } else
      usage();
  }
  if (min_log2 < 12 || max_log2 > 28 || min_log2 > max_log2 || nb < 1 || nb > MAX_BUCKETS ||
      iters < 1 || iters > 32 || nbwd < 1)
    usage();
  setenv("ZEROD_BIN", zerod, 1);

  cpu_set_t mask;
  CPU_ZERO(&mask);
  sched_getaffinity(0, sizeof mask, &mask);
  int first = -1, last = -1;
  for (int i = 0; i < CPU_SETSIZE; i++)
    if (CPU_ISSET(i, &mask)) {
      if (first < 0) first = i;
      last = i;
    }
  printf(
      "# bench_overlap: trainer on CPU %d, two zerods (overlap_update 0 and 1) on CPU %d, "
      "1 kernel thread each; AdamW f32, %d buckets; forward %.2fx, backward %s x the update\n",
      first, last, nb, fwd, nbwd > 1 ? "each of" : "");
  printf(
      "# medians of %d iterations after 2 warm-up; +off / +on: what the update adds to "
      "forward + backward\n#\n",
      iters);
  printf("# %10s %6s %10s %10s %10s %10s %8s %8s %8s\n", "params", "bwd/up", "update_ms", "fb_ms",
         "off_ms", "on_ms", "+off", "+on", "on/off");
  for (int lg = min_log2; lg <= max_log2; lg++) {
    uint64_t n = (1ull << lg) / (uint64_t)nb * (uint64_t)nb;
    /* A pair of zerods per size: one parameter per bucket (bucket_elems). They inherit the last
     * CPU; the trainer moves to the first. */
    pin(last);
    char be[32];
    snprintf(be, sizeof be, "%llu", (unsigned long long)(n / (uint64_t)nb));
    zdt_daemon_t off, on;
    const char *off_args[] = {"--threads", "1", "--log_level", "warn", "--bucket_elems", be, NULL};
    const char *on_args[] = {"--threads",        "1", "--log_level", "warn", "--bucket_elems", be,
                             "--overlap_update", "1", NULL};
    zdt_start(&off, off_args);
    zdt_start(&on, on_args);
    pin(first);
    zdt_daemon_t *ds[2] = {&off, &on};
    zd_client_t *cs[2];
    for (int k = 0; k < 2; k++) cs[k] = attach(ds[k], n, nb);
    double up = update_seconds(cs[0], nb, iters);
    for (int bi = 0; bi < nbwd; bi++) {
      double f = fwd * up, bb = bwd[bi] * up / nb;
      double tf[32], toff[32], ton[32];
      for (int it = 0; it < iters + 2; it++) {
        double a = iteration(NULL, nb, f, bb);
        double o = iteration(cs[0], nb, f, bb);
        double p = iteration(cs[1], nb, f, bb);
        if (it >= 2) {
          tf[it - 2] = a;
          toff[it - 2] = o;
          ton[it - 2] = p;
        }
      }
      double mf = zd_bench_median(tf, iters), mo = zd_bench_median(toff, iters);
      double mn = zd_bench_median(ton, iters);
      printf("  %10llu %6.2f %10.3f %10.3f %10.3f %10.3f %7.1f%% %7.1f%% %8.3f\n",
             (unsigned long long)n, bwd[bi], up * 1e3, mf * 1e3, mo * 1e3, mn * 1e3,
             100.0 * (mo - mf) / mf, 100.0 * (mn - mf) / mf, mn / mo);
      fflush(stdout);
    }
    if (getenv("BENCH_OVERLAP_STATUS")) { /* the zerods' own accounting, for a closer look */
      for (int k = 0; k < 2; k++) {
        char *text = NULL;
        if (zd_status(cs[k], &text) == ZD_OK)
          fprintf(stderr, "== %s\n%s\n", k ? "on" : "off", text);
        zd_free(text);
      }
    }
    for (int k = 0; k < 2; k++) zd_close(cs[k]);
    zdt_stop(&off, SIGTERM, 0);
    zdt_stop(&on, SIGTERM, 0);
  }
  return 0;
}
