/* The gRPC control service of a real zerod, as operators, probes and peer zerods use it: health
 * checks (through the C wrapper and through the zeroctl binary), status after a client trained a
 * few steps (table, --json, --world), the rendezvous store through the rendezvous client (a wait
 * satisfied by a later set from another thread, a wait that times out naming the missing key),
 * the node registry, bad requests, a node that does not host rank 0, a shutdown with a KvWait
 * pending (clean exit, the waiter answered, the control socket removed), and zeroctl against an
 * address where nothing listens.
 *
 * zeroctl runs as a child through posix_spawn, which runs no fork handlers: this process has gRPC
 * threads once the first channel is open. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "control.pb-c.h"
#include "grpc_unary.h"
#include "harness.h"
#include "health.pb-c.h"
#include "mlp.h"
#include "rendezvous.h"
#include "zerod/zerod.h"

#define STEPS   3
#define CALL_MS 5000

extern char **environ;

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static char *read_file(const char *path) {
  FILE *f = fopen(path, "r");
  CHECK_MSG(f, "open %s: %s", path, strerror(errno));
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap);
  CHECK(buf);
  size_t r;
  while ((r = fread(buf + n, 1, cap - n - 1, f)) > 0) {
    n += r;
    if (n + 1 == cap) {
      cap *= 2;
      buf = realloc(buf, cap);
      CHECK(buf);
    }
  }
  buf[n] = '\0';
  fclose(f);
  return buf;
}

/* Runs $ZEROCTL_BIN with args (NULL-terminated); returns its exit status, *out and *err its
 * output (malloc'd). */
static int zeroctl(const char *dir, const char *const *args, char **out, char **err) {
  const char *bin = getenv("ZEROCTL_BIN");
  CHECK_MSG(bin && bin[0], "ZEROCTL_BIN is not set (run the tests with meson test)");
  char out_path[128], err_path[128];
  snprintf(out_path, sizeof out_path, "%s/zeroctl.out", dir);
  snprintf(err_path, sizeof err_path, "%s/zeroctl.err", dir);
  const char *argv[32];
  int n = 0;
  argv[n++] = bin;
  for (int i = 0; args[i] && n < 31; i++) argv[n++] = args[i];
  argv[n] = NULL;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&fa, 2, err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid;
  int rc = posix_spawn(&pid, bin, &fa, NULL, (char *const *)argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  CHECK_MSG(rc == 0, "posix_spawn %s: %s", bin, strerror(rc));
  int status;
  CHECK(waitpid(pid, &status, 0) == pid);
  *out = read_file(out_path);
  *err = read_file(err_path);
  unlink(out_path);
  unlink(err_path);
  CHECK_MSG(WIFEXITED(status), "zeroctl died: status 0x%x", status);
  return WEXITSTATUS(status);
}

/* One unary call through the wrapper; returns the gRPC status. */
static int call(const char *address, const char *method, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *desc, ProtobufCMessage **reply, unsigned flags,
                zd__err_t *err) {
  zd__grpc_channel_t *ch;
  CHECK_INT_EQ(zd__grpc_channel_open(address, &ch, err), ZD_OK);
  int status;
  zd__grpc_call(ch, method, req, desc, reply, CALL_MS, flags, &status, err);
  zd__grpc_channel_close(ch);
  return status;
}

static int health(const char *address, const char *service, unsigned flags, zd__err_t *err) {
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  req.service = (char *)service;
  ProtobufCMessage *reply = NULL;
  int status = call(address, "/grpc.health.v1.Health/Check", &req.base,
                    &grpc__health__v1__health_check_response__descriptor, &reply, flags, err);
  if (status != GRPC_STATUS_OK) return -status;
  int serving = ((Grpc__Health__V1__HealthCheckResponse *)reply)->status;
  protobuf_c_message_free_unpacked(reply, NULL);
  return serving;
}

static Zerod__V1__NodeStatus *node_status(const char *address) {
  Zerod__V1__NodeStatusRequest req = ZEROD__V1__NODE_STATUS_REQUEST__INIT;
  ProtobufCMessage *reply = NULL;
  zd__err_t err = {0};
  int status = call(address, "/zerod.v1.Control/Status", &req.base,
                    &zerod__v1__node_status__descriptor, &reply, 0, &err);
  CHECK_MSG(status == GRPC_STATUS_OK, "Status at %s: %s", address, err.msg);
  return (Zerod__V1__NodeStatus *)reply;
}

/* Daemons this test spawned itself: killed if a CHECK fails (exit), so that none outlives the
 * test holding its output pipe. */
static pid_t spawned[8];

static void kill_spawned(void) {
  for (size_t i = 0; i < sizeof spawned / sizeof spawned[0]; i++)
    if (spawned[i] > 0 && kill(spawned[i], 0) == 0) kill(spawned[i], SIGKILL);
}

/* Starts zerod with argv (its stdout and stderr into log) through posix_spawn. */
static pid_t spawn_zerod(const char *const *args, const char *log) {
  const char *argv[32];
  int n = 0;
  argv[n++] = getenv("ZEROD_BIN");
  for (int i = 0; args[i] && n < 31; i++) argv[n++] = args[i];
  argv[n] = NULL;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 2, log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&fa, 2, 1);
  pid_t pid;
  int rc = posix_spawn(&pid, argv[0], &fa, NULL, (char *const *)argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  CHECK_MSG(rc == 0, "posix_spawn %s: %s", argv[0], strerror(rc));
  for (size_t i = 0; i < sizeof spawned / sizeof spawned[0]; i++) {
    if (spawned[i] <= 0 || kill(spawned[i], 0) != 0) {
      spawned[i] = pid;
      break;
    }
  }
  return pid;
}

/* The last line of a log, for messages. */
static void last_line(const char *path, char *buf, size_t len) {
  char *log = read_file(path);
  char *end = log + strlen(log);
  while (end > log && end[-1] == '\n') *--end = '\0';
  char *start = end;
  while (start > log && start[-1] != '\n') start--;
  snprintf(buf, len, "%s", start);
  free(log);
}

/* Waits up to timeout_ms for pid to exit; its wait status, or -1 if it did not. */
static int wait_exit(pid_t pid, int timeout_ms) {
  int status;
  for (int i = 0; i < timeout_ms / 10; i++) {
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    sleep_ms(10);
  }
  return -1;
}

/* ---- health -------------------------------------------------------------------------------- */

static void test_health(const zdt_daemon_t *d) {
  zd__err_t err = {0};
  /* The harness saw the client socket; the control service binds just after it. */
  int st = health(d->control, "", ZD__GRPC_WAIT_FOR_READY, &err);
  CHECK_MSG(st == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING,
            "health of '' at %s: %d (%s)", d->control, st, err.msg);
  CHECK_INT_EQ(health(d->control, "zerod.v1.Control", 0, &err),
               GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
  CHECK_INT_EQ(health(d->control, "zerod.ranks", 0, &err),
               GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
  CHECK_INT_EQ(health(d->control, "no.such.service", 0, &err), -GRPC_STATUS_NOT_FOUND);
  CHECK_INT_EQ(err.code, -ENOENT);
  CHECK_CONTAINS(err.msg, "unknown service 'no.such.service'");

  char *out, *errs;
  const char *a1[] = {"--address", d->control, "health", NULL};
  int rc = zeroctl(d->dir, a1, &out, &errs);
  CHECK_MSG(rc == 0, "zeroctl health: exit %d, stdout '%s', stderr '%s'", rc, out, errs);
  CHECK_CONTAINS(out, "SERVING");
  free(out), free(errs);
  const char *a2[] = {"health", "--service", "zerod.ranks", "--address", d->control, NULL};
  rc = zeroctl(d->dir, a2, &out, &errs);
  CHECK_MSG(rc == 0, "zeroctl health --service zerod.ranks: exit %d, '%s' '%s'", rc, out, errs);
  free(out), free(errs);
  const char *a3[] = {"--address", d->control, "health", "--service", "nope", NULL};
  rc = zeroctl(d->dir, a3, &out, &errs);
  CHECK_INT_EQ(rc, 1);
  CHECK_CONTAINS(errs, "unknown service 'nope'");
  free(out), free(errs);
  printf("  health: SERVING through the wrapper and zeroctl; unknown service NOT_FOUND\n");
}

/* ---- bad requests -------------------------------------------------------------------------- */

static void test_bad_requests(const zdt_daemon_t *d) {
  zd__grpc_channel_t *ch;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__grpc_channel_open(d->control, &ch, &err), ZD_OK);
  void *reply;
  size_t len;
  int status;
  static const uint8_t garbage[] = {0xff, 0xff, 0xff, 0xff, 0x0f};
  int rc = zd__grpc_call_raw(ch, "/zerod.v1.Control/KvSet", garbage, sizeof garbage, &reply, &len,
                             CALL_MS, 0, &status, &err);
  CHECK_INT_EQ(status, GRPC_STATUS_INVALID_ARGUMENT);
  CHECK_INT_EQ(rc, -EINVAL);
  CHECK_CONTAINS(err.msg, "not a valid zerod.v1.KvSetRequest");
  /* A message missing its required fields does not decode either. */
  rc = zd__grpc_call_raw(ch, "/zerod.v1.Control/KvGet", NULL, 0, &reply, &len, CALL_MS, 0, &status,
                         &err);
  CHECK_INT_EQ(status, GRPC_STATUS_INVALID_ARGUMENT);
  rc = zd__grpc_call_raw(ch, "/zerod.v1.Control/NoSuchMethod", NULL, 0, &reply, &len, CALL_MS, 0,
                         &status, &err);
  CHECK_INT_EQ(status, GRPC_STATUS_UNIMPLEMENTED);
  CHECK_CONTAINS(err.msg, "/zerod.v1.Control/NoSuchMethod");
  /* An empty key. */
  Zerod__V1__KvSetRequest set = ZEROD__V1__KV_SET_REQUEST__INIT;
  set.key = (char *)"";
  ProtobufCMessage *r = NULL;
  rc = zd__grpc_call(ch, "/zerod.v1.Control/KvSet", &set.base, &zerod__v1__kv_set_reply__descriptor,
                     &r, CALL_MS, 0, &status, &err);
  CHECK_INT_EQ(status, GRPC_STATUS_INVALID_ARGUMENT);
  CHECK_CONTAINS(err.msg, "keys have 1..");
  zd__grpc_channel_close(ch);
  printf("  bad requests: INVALID_ARGUMENT / UNIMPLEMENTED with messages\n");
}

/* ---- status -------------------------------------------------------------------------------- */

static zd_client_t *train(const zdt_daemon_t *d, int steps) {
  zd_client_t *c;
  CHECK_MSG(zd_connect(d->socket, ZD_ANY_RANK, 0, &c) == ZD_OK, "connect: %s", zd_last_error());
  zd_group_t groups[2] = {
      {.lr = 1e-3,
       .beta1 = 0.9,
       .beta2 = 0.999,
       .eps = 1e-8,
       .weight_decay = 0.01,
       .optimizer = ZD_ADAMW},
      {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .optimizer = ZD_ADAM},
  };
  zd_model_desc_t desc = zdt_mlp_desc(groups, 2);
  desc.max_grad_norm = 1.0;
  CHECK_MSG(zd_layout(c, &desc) == ZD_OK, "layout: %s", zd_last_error());
  float init[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
  float *p[MLP_NPARAMS] = {init[0], init[1], init[2], init[3]};
  mlp_init(p, 7);
  float *buf = zd_param_buffer(c, NULL);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(c, (size_t)i, &info);
    memcpy(buf + info.offset, init[i], info.numel * sizeof(float));
  }
  CHECK_MSG(zd_register(c) == ZD_OK, "register: %s", zd_last_error());
  for (int s = 0; s < steps; s++) {
    float grad[MLP_NPARAMS][MLP_HIDDEN * MLP_IN], *g[MLP_NPARAMS];
    const float *w[MLP_NPARAMS];
    float *gbuf = zd_grad_buffer(c, NULL);
    for (int i = 0; i < MLP_NPARAMS; i++) {
      zd_param_info_t info = ZD_PARAM_INFO_INIT;
      zd_param_info(c, (size_t)i, &info);
      w[i] = buf + info.offset;
      g[i] = grad[i];
    }
    mlp_loss_grad(w, g, (uint64_t)s, 0);
    for (int i = 0; i < MLP_NPARAMS; i++) {
      zd_param_info_t info = ZD_PARAM_INFO_INIT;
      zd_param_info(c, (size_t)i, &info);
      memcpy(gbuf + info.offset, grad[i], info.numel * sizeof(float));
    }
    zd_step_result_t res = ZD_STEP_RESULT_INIT;
    CHECK_MSG(zd_step(c, NULL, &res) == ZD_OK, "step %d: %s", s, zd_last_error());
  }
  return c;
}

static void test_status(const zdt_daemon_t *d) {
  zd_client_t *c = train(d, STEPS);
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(c, &info);

  Zerod__V1__NodeStatus *st = node_status(d->control);
  CHECK_STR_EQ(st->version, ZD_VERSION);
  CHECK_INT_EQ(st->pid, d->pid);
  CHECK_STR_EQ(st->control_address, d->control);
  CHECK_INT_EQ(st->world_size, 1);
  CHECK_INT_EQ(st->first_rank, 0);
  CHECK_INT_EQ(st->n_ranks, 1);
  const Zerod__V1__RankStatus *r = st->ranks[0];
  CHECK_STR_EQ(r->health, "ok");
  CHECK(r->has_model);
  CHECK_U64_EQ(r->step, STEPS);
  CHECK_INT_EQ(r->params, MLP_NPARAMS);
  CHECK_MSG(r->client && strstr(r->client, "test_control"), "client '%s'", r->client);
  CHECK_INT_EQ(r->client_pid, getpid());
  CHECK_U64_EQ(r->shard_elems, info.total_elems); /* world size 1: the shard is everything */
  CHECK_U64_EQ(r->state_bytes, 12 * r->shard_elems);
  CHECK(r->has_last_grad_norm && r->last_grad_norm > 0 && isfinite(r->last_grad_norm));
  CHECK(r->has_last_step_us);
  CHECK_INT_EQ(r->n_shard, info.nbuckets);
  for (uint32_t b = 0; b < info.nbuckets; b++) {
    zd_bucket_info_t bi = ZD_BUCKET_INFO_INIT;
    CHECK_INT_EQ(zd_bucket_info(c, b, &bi), ZD_OK);
    CHECK_INT_EQ(r->shard[b]->bucket, b);
    CHECK_U64_EQ(r->shard[b]->begin, bi.shard_offset);
    CHECK_U64_EQ(r->shard[b]->end, bi.shard_offset + bi.shard_elems);
  }
  char want_state[32];
  snprintf(want_state, sizeof want_state, "%llu (", (unsigned long long)r->state_bytes);
  zerod__v1__node_status__free_unpacked(st, NULL);

  char *out, *err;
  const char *a1[] = {"--address", d->control, "status", NULL};
  int rc = zeroctl(d->dir, a1, &out, &err);
  CHECK_MSG(rc == 0, "zeroctl status: exit %d, stderr '%s'", rc, err);
  printf("%s", out);
  CHECK_CONTAINS(out, "RANK");
  CHECK_CONTAINS(out, d->control);
  CHECK_CONTAINS(out, "test_control");
  CHECK_CONTAINS(out, want_state);
  CHECK_CONTAINS(out, " ok ");
  CHECK_CONTAINS(out, "SHARD ");
  CHECK_CONTAINS(out, " [0,"); /* the shard's first range */
  free(out), free(err);

  const char *a2[] = {"--address", d->control, "status", "--json", NULL};
  rc = zeroctl(d->dir, a2, &out, &err);
  CHECK_MSG(rc == 0, "zeroctl status --json: exit %d, stderr '%s'", rc, err);
  CHECK_CONTAINS(out, "\"rank\": 0");
  CHECK_CONTAINS(out, "\"step\": 3,");
  CHECK_CONTAINS(out, "\"health\": \"ok\"");
  CHECK_CONTAINS(out, "\"world_size\": 1");
  CHECK_CONTAINS(out, "\"shard\": [{\"bucket\": 0, \"begin\": 0, ");
  free(out), free(err);

  /* A single-node world needs no registration for --world. */
  const char *a3[] = {"--address", d->control, "status", "--world", "--json", NULL};
  rc = zeroctl(d->dir, a3, &out, &err);
  CHECK_MSG(rc == 0, "zeroctl status --world: exit %d, stderr '%s'", rc, err);
  CHECK_CONTAINS(out, "\"step\": 3,");
  free(out), free(err);
  zd_close(c);
  printf("  status: step %d, shard and state bytes through Status, zeroctl table and JSON\n",
         STEPS);
}

/* ---- rendezvous ---------------------------------------------------------------------------- */

typedef struct setter {
  const char *address;
  int delay_ms;
} setter_t;

static void *set_later(void *arg) {
  setter_t *s = arg;
  zd__rdv_t *rdv;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__rdv_open(s->address, &rdv, &err), ZD_OK);
  sleep_ms(s->delay_ms);
  int rc = zd__rdv_set(rdv, "late", "value-from-thread", 17, CALL_MS, &err);
  CHECK_MSG(rc == ZD_OK, "set from the thread: %s", err.msg);
  zd__rdv_close(rdv);
  return NULL;
}

static void test_rendezvous(const zdt_daemon_t *d) {
  zd__rdv_t *rdv;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__rdv_open(d->control, &rdv, &err), ZD_OK);
  CHECK_MSG(zd__rdv_set(rdv, "k1", "v1", 2, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  void *value;
  size_t len;
  CHECK_MSG(zd__rdv_get(rdv, "k1", &value, &len, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_INT_EQ(len, 2);
  CHECK(memcmp(value, "v1", 2) == 0);
  free(value);
  /* Keys are written once: the same value again is a retry, another value is refused. */
  CHECK_MSG(zd__rdv_set(rdv, "k1", "v1", 2, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_INT_EQ(zd__rdv_set(rdv, "k1", "v2", 2, CALL_MS, &err), -EEXIST);
  CHECK_CONTAINS(err.msg, "'k1' is already set to another value");
  CHECK_MSG(zd__rdv_get(rdv, "k1", &value, &len, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK(len == 2 && memcmp(value, "v1", 2) == 0);
  free(value);

  /* A wait satisfied by a set from another thread (another channel) 300 ms later. */
  pthread_t t;
  setter_t s = {.address = d->control, .delay_ms = 300};
  double t0 = now_ms();
  CHECK_INT_EQ(pthread_create(&t, NULL, set_later, &s), 0);
  int rc = zd__rdv_get(rdv, "late", &value, &len, CALL_MS, &err);
  double waited = now_ms() - t0;
  CHECK_MSG(rc == ZD_OK, "get 'late': %s", err.msg);
  CHECK_INT_EQ(len, 17);
  CHECK(memcmp(value, "value-from-thread", 17) == 0);
  free(value);
  pthread_join(t, NULL);
  CHECK_MSG(waited >= 250, "waited %.0f ms for a key set after 300 ms", waited);
  CHECK_WITHIN(waited, 3000.0, "a get must wake on the set, not poll nor wait its 5 s timeout");

  /* A wait that times out names what is missing (and not what exists). */
  const char *keys[] = {"k1", "never-set", "late"};
  t0 = now_ms();
  rc = zd__rdv_wait(rdv, keys, 3, 400, &err);
  double timed_out = now_ms() - t0;
  CHECK_INT_EQ(rc, -ETIMEDOUT);
  CHECK_CONTAINS(err.msg, "'never-set'");
  CHECK_CONTAINS(err.msg, d->control);
  CHECK_MSG(!strstr(err.msg, "'k1'") && !strstr(err.msg, "'late'"), "%s", err.msg);
  CHECK_MSG(timed_out >= 380, "a 400 ms wait returned after %.0f ms", timed_out);
  CHECK_WITHIN(timed_out, 3000.0, "a 400 ms wait must end at its own timeout, not the call's 5 s");

  /* KvWait with timeout 0 answers at once. */
  Zerod__V1__KvWaitRequest w = ZEROD__V1__KV_WAIT_REQUEST__INIT;
  char *wkeys[] = {(char *)"late", (char *)"never-set"};
  w.keys = wkeys;
  w.n_keys = 2;
  w.timeout_ms = 0;
  ProtobufCMessage *reply = NULL;
  CHECK_INT_EQ(call(d->control, "/zerod.v1.Control/KvWait", &w.base,
                    &zerod__v1__kv_wait_reply__descriptor, &reply, 0, &err),
               GRPC_STATUS_OK);
  Zerod__V1__KvWaitReply *wr = (Zerod__V1__KvWaitReply *)reply;
  CHECK(!wr->ok);
  CHECK_INT_EQ(wr->n_missing, 1);
  CHECK_STR_EQ(wr->missing[0], "never-set");
  protobuf_c_message_free_unpacked(reply, NULL);

  /* A KvWait whose client gives up (deadline) leaves no waiter behind: the server hears of it. */
  zd__grpc_channel_t *ch;
  CHECK_INT_EQ(zd__grpc_channel_open(d->control, &ch, &err), ZD_OK);
  w.timeout_ms = 60000;
  int status;
  rc = zd__grpc_call(ch, "/zerod.v1.Control/KvWait", &w.base, &zerod__v1__kv_wait_reply__descriptor,
                     &reply, 200, 0, &status, &err);
  CHECK_INT_EQ(status, GRPC_STATUS_DEADLINE_EXCEEDED);
  CHECK_INT_EQ(rc, -ETIMEDOUT);
  zd__grpc_channel_close(ch);
  for (int i = 0; i < 100 && !zdt_log_contains(d, "was cancelled by its client"); i++) sleep_ms(10);
  CHECK_MSG(zdt_log_contains(d, "was cancelled by its client"),
            "the server did not notice the cancelled KvWait");
  zd__rdv_close(rdv);
  printf(
      "  rendezvous: set/get, a wait satisfied %.0f ms later, a 400 ms timeout after %.0f ms "
      "naming the missing key\n",
      waited, timed_out);
}

/* ---- a store that comes up late, or never -------------------------------------------------- */

typedef struct early_get {
  const char *address;
  int rc;
  zd__err_t err;
  double returned_at;
} early_get_t;

static void *get_early(void *arg) {
  early_get_t *g = arg;
  zd__rdv_t *rdv;
  CHECK_INT_EQ(zd__rdv_open(g->address, &rdv, &g->err), ZD_OK);
  void *value = NULL;
  size_t len;
  g->rc = zd__rdv_get(rdv, "early-key", &value, &len, 15000, &g->err);
  g->returned_at = now_ms();
  free(value);
  zd__rdv_close(rdv);
  return NULL;
}

/* A peer asks before rank 0's zerod is up (WAIT_FOR_READY) and gets its key once it is; a store
 * that never comes fails within the timeout naming the address and the key. */
static void test_late_store(const zdt_daemon_t *d) {
  char addr[160], sock[160], logp[160];
  snprintf(addr, sizeof addr, "unix:%s/late-control.sock", d->dir);
  snprintf(sock, sizeof sock, "%s/late.sock", d->dir);
  snprintf(logp, sizeof logp, "%s/late.log", d->dir);
  early_get_t g = {.address = addr, .rc = -1};
  pthread_t t;
  CHECK_INT_EQ(pthread_create(&t, NULL, get_early, &g), 0);
  sleep_ms(500);
  const char *args[] = {"--socket", sock, "--control_address", addr, NULL};
  pid_t pid = spawn_zerod(args, logp);
  zd__rdv_t *rdv;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__rdv_open(addr, &rdv, &err), ZD_OK);
  double t0 = now_ms();
  CHECK_MSG(zd__rdv_set(rdv, "early-key", "x", 1, 10000, &err) == ZD_OK, "%s", err.msg);
  double set_ms = now_ms() - t0;
  zd__rdv_close(rdv);
  pthread_join(t, NULL);
  CHECK_MSG(g.rc == ZD_OK, "a get started before the store: %s", g.err.msg);
  double after_set = g.returned_at - (t0 + set_ms);
  kill(pid, SIGTERM);
  int status = wait_exit(pid, 20000 * zdt_hang_scale());
  CHECK_MSG(status == 0, "the late zerod ended with %s after SIGTERM, expected exit 0",
            status == -1 ? "nothing (still running)" : zdt_status_str(status));
  unlink(logp);

  char dead[160];
  snprintf(dead, sizeof dead, "unix:%s/never-up.sock", d->dir);
  CHECK_INT_EQ(zd__rdv_open(dead, &rdv, &err), ZD_OK);
  void *value;
  size_t len;
  t0 = now_ms();
  int rc = zd__rdv_get(rdv, "some-key", &value, &len, 500, &err);
  double took = now_ms() - t0;
  zd__rdv_close(rdv);
  CHECK_INT_EQ(rc, -ETIMEDOUT);
  CHECK_CONTAINS(err.msg, dead);
  CHECK_CONTAINS(err.msg, "'some-key'");
  CHECK_MSG(took >= 480, "a 500 ms get returned after %.0f ms", took);
  CHECK_WITHIN(took, 3000.0, "a 500 ms get of a dead store must end at its own timeout");
  printf(
      "  late store: a get issued 500 ms before zerod started returned %.0f ms after the set "
      "(set took %.0f ms from spawn); no store: -ETIMEDOUT after %.0f ms: %s\n",
      after_set, set_ms, took, err.msg);
}

/* ---- node registry ------------------------------------------------------------------------- */

static void test_registry(const zdt_daemon_t *d) {
  zd__rdv_t *rdv;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__rdv_open(d->control, &rdv, &err), ZD_OK);
  /* This node registering itself does not list it twice; a node that never comes up (a dead
   * address) is listed, sorted by first rank, and zeroctl --world reports it unreachable. */
  char dead[160];
  snprintf(dead, sizeof dead, "unix:%s/nobody.sock", d->dir);
  CHECK_MSG(zd__rdv_register_node(rdv, 0, 1, d->control, 1, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_MSG(zd__rdv_register_node(rdv, 10, 2, dead, 2, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_MSG(zd__rdv_set(rdv, "node/9", "junk", 4, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  zd__rdv_close(rdv);

  Zerod__V1__NodesRequest req = ZEROD__V1__NODES_REQUEST__INIT;
  ProtobufCMessage *reply = NULL;
  CHECK_INT_EQ(call(d->control, "/zerod.v1.Control/Nodes", &req.base,
                    &zerod__v1__nodes_reply__descriptor, &reply, 0, &err),
               GRPC_STATUS_OK);
  Zerod__V1__NodesReply *nodes = (Zerod__V1__NodesReply *)reply;
  CHECK_INT_EQ(nodes->world_size, 1);
  CHECK_INT_EQ(nodes->n_nodes, 2);
  CHECK_INT_EQ(nodes->nodes[0]->first_rank, 0);
  CHECK_STR_EQ(nodes->nodes[0]->control_address, d->control);
  CHECK_INT_EQ(nodes->nodes[1]->first_rank, 10);
  CHECK_INT_EQ(nodes->nodes[1]->local_ranks, 2);
  protobuf_c_message_free_unpacked(reply, NULL);
  CHECK(zdt_log_contains(d, "registry entry 'node/9'"));

  char *out, *errs;
  const char *a[] = {"--address", d->control, "status", "--world", NULL};
  int rc = zeroctl(d->dir, a, &out, &errs);
  printf("%s", out);
  CHECK_INT_EQ(rc, 1);
  CHECK_CONTAINS(out, "unreachable");
  CHECK_CONTAINS(out, "cannot reach zerod control service at unix:");
  CHECK(strstr(out, "\n   0 ") && strstr(out, "\n  10 ") && strstr(out, "\n  11 "));
  free(out), free(errs);
  printf("  registry: Nodes sorted by first rank; zeroctl --world shows the dead node, exit 1\n");
}

/* ---- a node that does not host rank 0 ------------------------------------------------------ */

typedef struct node_b {
  pid_t pid;
  char control[160];
  char log[160];
} node_b_t;

/* Starts zerod as rank 1 of a world of 2 whose rank 0 never comes and waits for its control
 * service: such a node must serve (status, a clear refusal of store requests) while it waits for
 * its world, so a zerod that exits instead fails the test, with its log. */
static void start_node_b(const zdt_daemon_t *a, node_b_t *b) {
  char sock[160], rdv[160];
  snprintf(sock, sizeof sock, "%s/b.sock", a->dir);
  snprintf(rdv, sizeof rdv, "unix:%s/rank0-never.sock", a->dir);
  snprintf(b->control, sizeof b->control, "unix:%s/b-control.sock", a->dir);
  snprintf(b->log, sizeof b->log, "%s/b.log", a->dir);
  const char *args[] = {"--socket",
                        sock,
                        "--control_address",
                        b->control,
                        "--rendezvous_address",
                        rdv,
                        "--world_size",
                        "2",
                        "--first_rank",
                        "1",
                        "--connect_timeout_ms",
                        "1000",
                        "--log_level",
                        "debug",
                        NULL};
  b->pid = spawn_zerod(args, b->log);
  int limit_ms = 10000 * zdt_hang_scale();
  for (int waited = 0; waited < limit_ms; waited += 10) {
    int status;
    if (waitpid(b->pid, &status, WNOHANG) == b->pid) {
      char *log = read_file(b->log);
      fprintf(stderr, "---- rank-1 zerod log %s ----\n%s---- end of log ----\n", b->log, log);
      free(log);
      CHECK_MSG(0, "zerod as rank 1 of a world of 2 without its rank 0 ended during start-up (%s)",
                zdt_status_str(status));
    }
    struct stat st;
    if (stat(b->control + 5, &st) == 0) return;
    sleep_ms(10);
  }
  kill(b->pid, SIGKILL);
  CHECK_MSG(0, "the rank-1 zerod did not open %s within %d ms", b->control, limit_ms);
}

static void test_not_rank0(const zdt_daemon_t *a, node_b_t *b) {
  zd__err_t err = {0};
  int st = health(b->control, "", ZD__GRPC_WAIT_FOR_READY, &err);
  CHECK_MSG(st == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING,
            "health of the rank-1 node: %d (%s)", st, err.msg);
  Zerod__V1__KvGetRequest get = ZEROD__V1__KV_GET_REQUEST__INIT;
  get.key = (char *)"k";
  ProtobufCMessage *reply = NULL;
  CHECK_INT_EQ(call(b->control, "/zerod.v1.Control/KvGet", &get.base,
                    &zerod__v1__kv_get_reply__descriptor, &reply, 0, &err),
               GRPC_STATUS_FAILED_PRECONDITION);
  CHECK_CONTAINS(err.msg, "rank0-never.sock");
  CHECK_CONTAINS(err.msg, "hosts rank 1 of 2");
  zd__rdv_t *rdv;
  CHECK_INT_EQ(zd__rdv_open(b->control, &rdv, &err), ZD_OK);
  CHECK_INT_EQ(zd__rdv_set(rdv, "k", "v", 1, CALL_MS, &err), ZD_ECONFIG);
  CHECK_CONTAINS(err.msg, "is not rank 0's control service");
  zd__rdv_close(rdv);

  /* zeroctl --world on this node follows its rendezvous_address to the registry, which is down
   * here: a clear error naming it, and exit 1. */
  char *out, *errs;
  const char *w[] = {"--address", b->control, "status", "--world", NULL};
  CHECK_INT_EQ(zeroctl(a->dir, w, &out, &errs), 1);
  CHECK_CONTAINS(errs, "cannot list the nodes of the world (Nodes at unix:");
  CHECK_CONTAINS(errs, "rank0-never.sock");
  free(out), free(errs);

  Zerod__V1__NodeStatus *ns = node_status(b->control);
  CHECK_INT_EQ(ns->first_rank, 1);
  CHECK_INT_EQ(ns->world_size, 2);
  CHECK_INT_EQ(ns->ranks[0]->rank, 1);
  zerod__v1__node_status__free_unpacked(ns, NULL);

  kill(b->pid, SIGTERM);
  int status = wait_exit(b->pid, 20000 * zdt_hang_scale());
  if (status != 0) {
    char line[1024];
    last_line(b->log, line, sizeof line);
    CHECK_MSG(0, "rank-1 zerod ended with %s after SIGTERM, expected exit 0; its log ends with: %s",
              status == -1 ? "nothing (still running)" : zdt_status_str(status), line);
  }
  unlink(b->log);
  printf("  non-rank-0 node: KvGet FAILED_PRECONDITION naming the rendezvous address\n");
}

/* ---- TCP, port 0, and addresses already taken ---------------------------------------------- */

/* c listens on 127.0.0.1:0: it reports the port it got, serves on it, and a second zerod asking
 * for that port, or for a's unix socket, refuses to start instead of sharing or stealing it. */
static void test_tcp(const zdt_daemon_t *a, const zdt_daemon_t *c) {
  char *log = read_file(c->log);
  const char *at = strstr(log, "control service on 127.0.0.1:");
  CHECK_MSG(at, "no 'control service on 127.0.0.1:PORT' line in %s", c->log);
  int port = atoi(at + strlen("control service on 127.0.0.1:"));
  free(log);
  CHECK_MSG(port > 0 && port < 65536, "port %d", port);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  zd__err_t err = {0};
  int st = health(addr, "", ZD__GRPC_WAIT_FOR_READY, &err);
  CHECK_MSG(st == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING,
            "health at %s: %d (%s)", addr, st, err.msg);
  Zerod__V1__NodeStatus *ns = node_status(addr);
  CHECK_STR_EQ(ns->control_address, addr);
  zerod__v1__node_status__free_unpacked(ns, NULL);

  const char *taken[] = {addr, a->control};
  const char *want[] = {"another process is listening on it", "another process is listening"};
  for (int i = 0; i < 2; i++) {
    char sock[160], logp[160];
    snprintf(sock, sizeof sock, "%s/taken%d.sock", a->dir, i);
    snprintf(logp, sizeof logp, "%s/taken%d.log", a->dir, i);
    const char *args[] = {"--socket", sock, "--control_address", taken[i], NULL};
    pid_t pid = spawn_zerod(args, logp);
    int status = wait_exit(pid, 10000 * zdt_hang_scale());
    if (status == -1) kill(pid, SIGKILL), waitpid(pid, &status, 0);
    char *text = read_file(logp);
    CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) != 0,
              "a zerod on the taken address %s ended with %s, expected a refusal (exit 1..255): %s",
              taken[i], zdt_status_str(status), text);
    CHECK_CONTAINS(text, want[i]);
    free(text);
    unlink(logp);
  }
  /* The first node still serves. */
  CHECK_INT_EQ(health(a->control, "", 0, &err),
               GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
  printf("  tcp: 127.0.0.1:0 bound to port %d and reported; taken addresses refused\n", port);
}

/* ---- many waiters at once ------------------------------------------------------------------ */

#define BURST 32

static void *get_burst(void *arg) {
  const char *address = arg;
  zd__rdv_t *rdv;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__rdv_open(address, &rdv, &err), ZD_OK);
  void *value;
  size_t len;
  int rc = zd__rdv_get(rdv, "burst", &value, &len, 10000, &err);
  CHECK_MSG(rc == ZD_OK, "burst get: %s", err.msg);
  CHECK(len == 5 && memcmp(value, "burst", 5) == 0);
  free(value);
  zd__rdv_close(rdv);
  return NULL;
}

static void test_burst(const zdt_daemon_t *d) {
  pthread_t t[BURST];
  for (int i = 0; i < BURST; i++)
    CHECK_INT_EQ(pthread_create(&t[i], NULL, get_burst, (void *)d->control), 0);
  sleep_ms(300);
  zd__rdv_t *rdv;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__rdv_open(d->control, &rdv, &err), ZD_OK);
  double t0 = now_ms();
  CHECK_MSG(zd__rdv_set(rdv, "burst", "burst", 5, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  for (int i = 0; i < BURST; i++) pthread_join(t[i], NULL);
  double took = now_ms() - t0;
  zd__rdv_close(rdv);
  printf("  burst: %d waiters released by one set within %.1f ms\n", BURST, took);
}

/* ---- shutdown ------------------------------------------------------------------------------ */

typedef struct pending_wait {
  const char *address;
  int status;
  zd__err_t err;
  double returned_at;
} pending_wait_t;

static void *wait_forever(void *arg) {
  pending_wait_t *p = arg;
  zd__grpc_channel_t *ch;
  CHECK_INT_EQ(zd__grpc_channel_open(p->address, &ch, &p->err), ZD_OK);
  Zerod__V1__KvWaitRequest w = ZEROD__V1__KV_WAIT_REQUEST__INIT;
  char *keys[] = {(char *)"never-set-either"};
  w.keys = keys;
  w.n_keys = 1;
  w.timeout_ms = 60000;
  ProtobufCMessage *reply = NULL;
  zd__grpc_call(ch, "/zerod.v1.Control/KvWait", &w.base, &zerod__v1__kv_wait_reply__descriptor,
                &reply, 30000, 0, &p->status, &p->err);
  p->returned_at = now_ms();
  if (reply) protobuf_c_message_free_unpacked(reply, NULL);
  zd__grpc_channel_close(ch);
  return NULL;
}

static void test_shutdown(zdt_daemon_t *d) {
  pending_wait_t p = {.address = d->control, .status = -1};
  pthread_t t;
  CHECK_INT_EQ(pthread_create(&t, NULL, wait_forever, &p), 0);
  /* An idle connected channel too: shutdown must not wait for its client to go away. */
  zd__grpc_channel_t *idle;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__grpc_channel_open(d->control, &idle, &err), ZD_OK);
  CHECK_INT_EQ(health(d->control, "", 0, &err),
               GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
  sleep_ms(300); /* the KvWait is pending on the daemon's loop by now */
  double t0 = now_ms();
  zdt_stop(d, SIGTERM, 1); /* exit 0 */
  double exit_ms = now_ms() - t0;
  pthread_join(t, NULL);
  zd__grpc_channel_close(idle);
  CHECK_INT_EQ(p.status, GRPC_STATUS_UNAVAILABLE);
  CHECK_CONTAINS(p.err.msg, "shutting down");
  struct stat st;
  CHECK_MSG(stat(d->control + 5, &st) != 0 && errno == ENOENT, "%s still exists", d->control + 5);
  CHECK_WITHIN(exit_ms, 5000.0,
               "shutdown must answer the KvWait (60 s) at once, not wait for it or the idle "
               "channel up to shutdown_timeout_ms (10 s)");
  printf(
      "  shutdown with a KvWait pending: exit 0 after %.0f ms, the waiter got UNAVAILABLE "
      "(%.0f ms after SIGTERM), control socket removed\n",
      exit_ms, p.returned_at - t0);
}

static void test_dead_address(const char *dir) {
  char addr[160], *out, *err;
  snprintf(addr, sizeof addr, "unix:%s/nothing-here.sock", dir);
  const char *a1[] = {"--address", addr, "status", NULL};
  double t0 = now_ms();
  int rc = zeroctl(dir, a1, &out, &err);
  double took = now_ms() - t0;
  CHECK_INT_EQ(rc, 1);
  char want[200];
  snprintf(want, sizeof want, "cannot reach zerod control service at %s", addr);
  CHECK_CONTAINS(err, want);
  CHECK_WITHIN(took, 3000.0, "zeroctl must fail at once where nothing listens, not wait 5 s");
  free(out), free(err);
  const char *a2[] = {"health", "--timeout-ms", "500", NULL};
  setenv("ZEROD_CONTROL_ADDRESS", "127.0.0.1:1", 1);
  rc = zeroctl(dir, a2, &out, &err);
  unsetenv("ZEROD_CONTROL_ADDRESS");
  CHECK_INT_EQ(rc, 1);
  CHECK_CONTAINS(err, "cannot reach zerod control service at 127.0.0.1:1");
  free(out), free(err);
  const char *a3[] = {"frobnicate", NULL};
  CHECK_INT_EQ(zeroctl(dir, a3, &out, &err), 2);
  CHECK_CONTAINS(err, "unknown command 'frobnicate'");
  free(out), free(err);
  printf("  dead address: zeroctl exits 1 in %.0f ms with a clear error\n", took);
}

int main(void) {
  zdt_daemon_t d;
  atexit(kill_spawned); /* the harness takes down the daemons it started itself */
  const char *args[] = {"--bucket_elems", "256", NULL};
  zdt_start(&d, args); /* forks: before this process starts any gRPC thread */
  zdt_daemon_t c;
  const char *tcp_args[] = {"--control_address", "127.0.0.1:0", NULL}; /* the last flag wins */
  zdt_start(&c, tcp_args);
  node_b_t b = {0};
  start_node_b(&d, &b);

  test_health(&d);
  test_bad_requests(&d);
  test_status(&d);
  test_rendezvous(&d);
  test_not_rank0(&d, &b);
  test_tcp(&d, &c);
  zdt_stop(&c, SIGTERM, 0);
  test_burst(&d);
  test_late_store(&d);
  test_registry(&d);
  test_shutdown(&d);
  test_dead_address(d.dir);
  zdt_stop(&d, SIGTERM, 0); /* zerod is gone: removes the directory */
  printf("test_control: ok\n");
  return 0;
}
