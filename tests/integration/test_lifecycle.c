/* zerod's life around its clients: command line (--help, --version, bad flags), start with no
 * configuration at all, one client per rank, trainers started together with ZD_ANY_RANK getting
 * a rank each, state held across clients (clean and abrupt disconnects, a different model
 * refused unless replaced, a grown model registered with ZD_REGISTER_GROW), SIGTERM while steps are
 * in flight: they complete, the socket file is removed and zerod exits 0 with its loop closed, and
 * the busy poll after replies ending. */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "harness.h"
#include "mlp.h"
#include "zerod/zerod.h"

static const zd_group_t groups[2] = {
    {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01},
    {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0}};

static void test_command_line(void) {
  const char *out;
  CHECK_INT_EQ(zdt_run((const char *[]){"--help", NULL}, &out), 0);
  const char *expect[] = {"Usage: zerod",
                          "--socket",
                          "ZEROD_SOCKET",
                          "--allowed_uids",
                          "--max_frame_bytes",
                          "--kernel_isa",
                          "--local_ranks",
                          "--world_size",
                          "--control_address",
                          "--collective_timeout_ms",
                          "--log_level",
                          "--config",
                          "0660"};
  for (size_t i = 0; i < sizeof expect / sizeof expect[0]; i++) CHECK_CONTAINS(out, expect[i]);
  CHECK_INT_EQ(zdt_run((const char *[]){"--version", NULL}, &out), 0);
  CHECK_CONTAINS(out, "zerod " ZD_VERSION_STRING);
  CHECK_INT_EQ(zdt_run((const char *[]){"--threads", "many", NULL}, &out), 2);
  CHECK_CONTAINS(out, "threads");
  CHECK_INT_EQ(zdt_run((const char *[]){"--no-such-setting", "1", NULL}, &out), 2);
  CHECK_CONTAINS(out, "no-such-setting");
  printf("  command line: --help, --version, bad flags\n");
}

static zd_client_t *connect_register(const char *socket, const zd_param_t *params, int rank,
                                     unsigned flags, int expect) {
  zd_client_t *c;
  int rc = zd_connect(socket, rank, 0, &c);
  CHECK_MSG(rc == ZD_OK, "connect: %s", zd_last_error());
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = params;
  desc.nparams = MLP_NPARAMS;
  desc.groups = groups;
  desc.ngroups = 2;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  desc.flags = flags;
  CHECK_INT_EQ(zd_layout(c, &desc), ZD_OK);
  float *p = zd_param_buffer(c, NULL);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(c, (size_t)i, &info);
    for (uint64_t k = 0; k < info.numel; k++) p[info.offset + k] = 0.01f * (float)(k % 7);
  }
  rc = zd_register(c);
  CHECK_MSG(rc == expect, "register returned %s (%s), expected %s", zd_err_name(rc),
            zd_last_error(), zd_err_name(expect));
  if (rc != ZD_OK) {
    zd_close(c);
    return NULL;
  }
  return c;
}

static void fill_grads(zd_client_t *c, float value) {
  size_t bytes;
  float *g = zd_grad_buffer(c, &bytes);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(c, (size_t)i, &info);
    for (uint64_t k = 0; k < info.numel; k++) g[info.offset + k] = value;
  }
}

static void steps(zd_client_t *c, int n, uint64_t first) {
  for (int i = 0; i < n; i++) {
    zd_step_result_t r = ZD_STEP_RESULT_INIT;
    fill_grads(c, 0.1f * (float)(i + 1));
    CHECK_MSG(zd_step(c, NULL, &r) == ZD_OK, "step: %s", zd_last_error());
    CHECK_U64_EQ(r.step, first + (uint64_t)i + 1);
  }
}

static void test_clients_and_state(void) {
  zdt_daemon_t d;
  zdt_start(&d, NULL);
  zd_client_t *a = connect_register(d.socket, mlp_params, ZD_ANY_RANK, 0, ZD_OK);
  steps(a, 3, 0);

  /* one client per rank */
  zd_client_t *b;
  CHECK_INT_EQ(zd_connect(d.socket, ZD_ANY_RANK, 0, &b), ZD_EBUSY);
  CHECK_CONTAINS(zd_last_error(), "all 1 local ranks have a client attached");
  CHECK_INT_EQ(zd_connect(d.socket, 3, 0, &b), ZD_ERANK);
  CHECK_CONTAINS(zd_last_error(), "local rank 3 does not exist; this zerod hosts local ranks 0..0");
  CHECK_INT_EQ(zd_connect(d.socket, -5, 0, &b), ZD_ERANK); /* not taken for ZD_ANY_RANK */
  CHECK_CONTAINS(zd_last_error(), "local rank -5 is not valid; expected 0..0, or -1 (ZD_ANY_RANK)");
  connect_register(d.socket, mlp_params, 0, 0, ZD_EBUSY);
  CHECK_CONTAINS(zd_last_error(), "local rank 0 is attached to client");
  printf("  second client refused: %s\n", zd_last_error());

  /* a clean bye keeps the state; the next client resumes it */
  const float *pa = zd_param_buffer(a, NULL);
  float before[64];
  memcpy(before, pa, sizeof before);
  zd_close(a);
  zd_client_t *c = connect_register(d.socket, mlp_params, ZD_ANY_RANK, 0, ZD_OK);
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(c, &info);
  CHECK_INT_EQ(info.resumed, 1);
  CHECK_U64_EQ(info.step, 3);
  CHECK(memcmp(zd_param_buffer(c, NULL), before, sizeof before) == 0);
  steps(c, 2, 3);
  zd_close(c);

  /* an abrupt end (the trainer is killed): state kept too */
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    zd_client_t *k = connect_register(d.socket, mlp_params, ZD_ANY_RANK, 0, ZD_OK);
    steps(k, 4, 5);
    kill(getpid(), SIGKILL);
  }
  int status;
  waitpid(pid, &status, 0);
  CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  zd_client_t *e = NULL;
  for (int i = 0; i < 200 && !e; i++) { /* the daemon notices the hang-up asynchronously */
    int rc = zd_connect(d.socket, ZD_ANY_RANK, 0, &e);
    if (rc == ZD_EBUSY) {
      nanosleep(&(struct timespec){.tv_nsec = 10000000}, NULL);
      continue;
    }
    CHECK_MSG(rc == ZD_OK, "connect: %s", zd_last_error());
  }
  CHECK(e);
  zd_close(e);
  e = connect_register(d.socket, mlp_params, ZD_ANY_RANK, 0, ZD_OK);
  zd_get_info(e, &info);
  CHECK_INT_EQ(info.resumed, 1);
  CHECK_U64_EQ(info.step, 9);
  zd_close(e);
  printf("  state kept across a clean bye and a killed client: resumed at step 9\n");

  /* a different model is refused while the state is held, unless replaced */
  zd_param_t other[MLP_NPARAMS];
  memcpy(other, mlp_params, sizeof other);
  other[1].name = "fc1.b";
  connect_register(d.socket, other, ZD_ANY_RANK, 0, ZD_ELAYOUT);
  CHECK_CONTAINS(zd_last_error(), "rank 0 holds a different model (4 parameters");
  CHECK_CONTAINS(zd_last_error(), "step 9");
  CHECK_CONTAINS(zd_last_error(), "parameter 1: 'fc1.bias' [32] group 1 vs 'fc1.b' [32] group 1");
  printf("  different model refused: %s\n", zd_last_error());
  zd_client_t *r = connect_register(d.socket, other, ZD_ANY_RANK, ZD_REGISTER_REPLACE, ZD_OK);
  zd_get_info(r, &info);
  CHECK_INT_EQ(info.resumed, 0);
  CHECK_U64_EQ(info.step, 0);
  zd_close(r);
  zdt_stop(&d, SIGTERM, 0);
}

/* ZD_REGISTER_GROW (add_param_group): a model of the first two parameters trained 3 steps, then
 * the four-parameter model registered with the flag on a new connection: resumed at step 3, the
 * held parameters' values zerod's (not what the client wrote), the new ones the client's; the
 * next step is 4. Refused: with replace, and a registration whose start is not the held model. */
static zd_client_t *register_n(const char *socket, const zd_param_t *params, size_t n,
                               unsigned flags, float init, int expect) {
  zd_client_t *c;
  CHECK_MSG(zd_connect(socket, ZD_ANY_RANK, 0, &c) == ZD_OK, "connect: %s", zd_last_error());
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = params;
  desc.nparams = n;
  desc.groups = groups;
  desc.ngroups = 2;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  desc.flags = flags;
  CHECK_INT_EQ(zd_layout(c, &desc), ZD_OK);
  float *p = zd_param_buffer(c, NULL);
  size_t bytes;
  float *g = zd_grad_buffer(c, &bytes);
  for (size_t i = 0; i < n; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(c, i, &info);
    for (uint64_t k = 0; k < info.numel; k++) {
      p[info.offset + k] = init + 0.01f * (float)(k % 7);
      g[info.offset + k] = 0.1f;
    }
  }
  int rc = zd_register(c);
  CHECK_MSG(rc == expect, "register returned %s (%s), expected %s", zd_err_name(rc),
            zd_last_error(), zd_err_name(expect));
  if (rc != ZD_OK) {
    zd_close(c);
    return NULL;
  }
  return c;
}

static void test_grow(void) {
  zdt_daemon_t d;
  zdt_start(&d, NULL);
  zd_client_t *a = register_n(d.socket, mlp_params, 2, 0, 0.f, ZD_OK);
  for (int i = 0; i < 3; i++) {
    zd_step_result_t r = ZD_STEP_RESULT_INIT;
    CHECK_MSG(zd_step(a, NULL, &r) == ZD_OK, "step: %s", zd_last_error());
  }
  zd_param_info_t held[2] = {ZD_PARAM_INFO_INIT, ZD_PARAM_INFO_INIT};
  float want[2][8];
  for (size_t i = 0; i < 2; i++) {
    zd_param_info(a, i, &held[i]);
    memcpy(want[i], (const float *)zd_param_buffer(a, NULL) + held[i].offset, sizeof want[i]);
  }
  zd_close(a);

  register_n(d.socket, mlp_params, 4, ZD_REGISTER_GROW | ZD_REGISTER_REPLACE, 0.f, -EINVAL);
  CHECK_CONTAINS(zd_last_error(), "both replace and grow");
  zd_param_t other[MLP_NPARAMS];
  memcpy(other, mlp_params, sizeof other);
  other[1].name = "fc1.b";
  register_n(d.socket, other, 4, ZD_REGISTER_GROW, 0.f, ZD_ELAYOUT);
  CHECK_CONTAINS(zd_last_error(), "cannot grow the model it holds (2 parameters, step 3)");
  CHECK_CONTAINS(zd_last_error(), "parameter 1: 'fc1.bias' [32] group 1 held vs 'fc1.b'");
  printf("  grow refused: %s\n", zd_last_error());

  zd_client_t *b = register_n(d.socket, mlp_params, 4, ZD_REGISTER_GROW, 5.f, ZD_OK);
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(b, &info);
  CHECK_INT_EQ(info.resumed, 1);
  CHECK_U64_EQ(info.step, 3);
  const float *p = zd_param_buffer(b, NULL);
  for (size_t i = 0; i < 4; i++) {
    zd_param_info_t pi = ZD_PARAM_INFO_INIT;
    zd_param_info(b, i, &pi);
    if (i < 2)
      CHECK_MSG(memcmp(p + pi.offset, want[i], sizeof want[i]) == 0, "param %zu: %g %g vs %g %g", i,
                (double)p[pi.offset], (double)p[pi.offset + 1], (double)want[i][0],
                (double)want[i][1]);
    else
      CHECK(p[pi.offset + 1] == 5.f + 0.01f); /* the client's */
  }
  zd_step_result_t r = ZD_STEP_RESULT_INIT;
  CHECK_MSG(zd_step(b, NULL, &r) == ZD_OK, "step: %s", zd_last_error());
  CHECK_U64_EQ(r.step, 4);
  CHECK(p[0] != want[0][0]);
  zd_close(b);
  printf("  grown from 2 to 4 parameters at step 3: held values kept, step 4 next\n");
  zdt_stop(&d, SIGTERM, 0);
}

/* One trainer of several started at once with ZD_ANY_RANK: every hello is answered before any
 * register is sent, the moment a rank taken only at register would be handed out twice. */
typedef struct any_trainer {
  const char *socket;
  pthread_barrier_t *hellos_done;
  int connect_rc;
  int register_rc;
  uint32_t local_rank;
  char err[512];
  zd_client_t *c;
} any_trainer_t;

static void *any_trainer_main(void *arg) {
  any_trainer_t *t = arg;
  t->connect_rc = zd_connect(t->socket, ZD_ANY_RANK, 0, &t->c);
  if (t->connect_rc == ZD_OK) {
    zd_info_t info = ZD_INFO_INIT;
    zd_get_info(t->c, &info);
    t->local_rank = info.local_rank;
  } else {
    snprintf(t->err, sizeof t->err, "%s", zd_last_error());
  }
  pthread_barrier_wait(t->hellos_done);
  if (t->connect_rc != ZD_OK) return NULL;
  zd_model_desc_t desc = zdt_mlp_desc(groups, 2);
  t->register_rc = zd_layout(t->c, &desc);
  if (t->register_rc == ZD_OK) t->register_rc = zd_register(t->c);
  if (t->register_rc != ZD_OK) snprintf(t->err, sizeof t->err, "%s", zd_last_error());
  return NULL;
}

/* The rank a ZD_ANY_RANK hello gets is held for its client from that hello on: clients started
 * together each get their own, a client beyond the ranks is refused at hello, and a rank goes
 * back to the pool when its client leaves (bye or a killed process). */
static void test_any_rank_at_once(void) {
  enum { N = 4 };
  zdt_daemon_t d;
  /* a world of 4 local ranks: a register waits for all four, at most connect_timeout_ms */
  const char *args[] = {
      "--local_ranks", "4", "--connect_timeout_ms", "5000", "--threads", "1", NULL};
  zdt_start(&d, args);
  pthread_barrier_t hellos_done;
  pthread_barrier_init(&hellos_done, NULL, N);
  any_trainer_t t[N];
  pthread_t th[N];
  for (int i = 0; i < N; i++) {
    t[i] = (any_trainer_t){.socket = d.socket, .hellos_done = &hellos_done};
    pthread_create(&th[i], NULL, any_trainer_main, &t[i]);
  }
  for (int i = 0; i < N; i++) pthread_join(th[i], NULL);
  pthread_barrier_destroy(&hellos_done);
  int seen[N] = {0};
  for (int i = 0; i < N; i++) {
    CHECK_MSG(t[i].connect_rc == ZD_OK, "trainer %d: connect returned %s: %s", i,
              zd_err_name(t[i].connect_rc), t[i].err);
    CHECK_MSG(t[i].register_rc == ZD_OK, "trainer %d (local rank %u): register returned %s: %s", i,
              t[i].local_rank, zd_err_name(t[i].register_rc), t[i].err);
    CHECK_MSG(t[i].local_rank < N && !seen[t[i].local_rank]++,
              "trainer %d got local rank %u, which another trainer has too", i, t[i].local_rank);
  }
  printf("  %d trainers with ZD_ANY_RANK at once: local ranks %u %u %u %u, all registered\n", N,
         t[0].local_rank, t[1].local_rank, t[2].local_rank, t[3].local_rank);

  /* a fifth is refused at hello, not later at register */
  zd_client_t *c;
  CHECK_INT_EQ(zd_connect(d.socket, ZD_ANY_RANK, 0, &c), ZD_EBUSY);
  CHECK_CONTAINS(zd_last_error(), "all 4 local ranks have a client attached");

  /* one leaves (bye): the next ZD_ANY_RANK client gets its rank, and holds it from its hello */
  uint32_t freed = t[2].local_rank;
  zd_close(t[2].c);
  zd_info_t info = ZD_INFO_INIT;
  CHECK_INT_EQ(zd_connect(d.socket, ZD_ANY_RANK, 0, &c), ZD_OK);
  zd_get_info(c, &info);
  CHECK_U64_EQ(info.local_rank, freed);
  zd_client_t *other;
  CHECK_INT_EQ(zd_connect(d.socket, ZD_ANY_RANK, 0, &other), ZD_EBUSY);
  CHECK_CONTAINS(zd_last_error(), "reserved");
  /* a rank named explicitly may be held by another hello: hello works, register is refused */
  CHECK_INT_EQ(zd_connect(d.socket, (int)freed, 0, &other), ZD_OK);
  zd_model_desc_t desc = zdt_mlp_desc(groups, 2);
  CHECK_INT_EQ(zd_layout(other, &desc), ZD_OK);
  CHECK_INT_EQ(zd_register(other), ZD_EBUSY);
  char want[64];
  snprintf(want, sizeof want, "local rank %u is reserved by client", freed);
  CHECK_CONTAINS(zd_last_error(), want);
  zd_close(other);
  zd_close(c);
  printf("  a rank freed by bye went to the next ZD_ANY_RANK hello, which holds it: %s\n", want);

  /* a client killed after its hello: the rank is free again once zerod sees the hang-up */
  int fds[2];
  CHECK(pipe(fds) == 0);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    zd_client_t *k;
    uint32_t got = UINT32_MAX;
    if (zd_connect(d.socket, ZD_ANY_RANK, 0, &k) == ZD_OK) {
      zd_get_info(k, &info);
      got = info.local_rank;
    }
    CHECK(write(fds[1], &got, sizeof got) == (ssize_t)sizeof got);
    kill(getpid(), SIGKILL);
  }
  close(fds[1]);
  uint32_t got = UINT32_MAX;
  CHECK(read(fds[0], &got, sizeof got) == (ssize_t)sizeof got);
  close(fds[0]);
  CHECK_U64_EQ(got, freed);
  int status;
  waitpid(pid, &status, 0);
  c = NULL;
  for (int i = 0; i < 200 && !c; i++) { /* the daemon notices the hang-up asynchronously */
    int rc = zd_connect(d.socket, ZD_ANY_RANK, 0, &c);
    if (rc == ZD_EBUSY) {
      nanosleep(&(struct timespec){.tv_nsec = 10000000}, NULL);
      continue;
    }
    CHECK_MSG(rc == ZD_OK, "connect: %s", zd_last_error());
  }
  CHECK(c);
  zd_get_info(c, &info);
  CHECK_U64_EQ(info.local_rank, freed);
  zd_close(c);

  /* a rank named at hello is skipped by ZD_ANY_RANK hellos too */
  zd_client_t *named;
  CHECK_INT_EQ(zd_connect(d.socket, (int)freed, 0, &named), ZD_OK);
  CHECK_INT_EQ(zd_connect(d.socket, ZD_ANY_RANK, 0, &c), ZD_EBUSY);
  zd_close(named);
  printf("  a killed client's rank and a named one: free again, and held from hello\n");

  for (int i = 0; i < N; i++)
    if (i != 2) zd_close(t[i].c);
  zdt_stop(&d, SIGTERM, 0);
}

/* zerod with no configuration: default socket under $XDG_RUNTIME_DIR, found by libzerod too. */
static void test_no_configuration(void) {
  char dir[] = "/tmp/zerod-xdg-XXXXXX";
  CHECK(mkdtemp(dir));
  char sock[128], log[128];
  snprintf(sock, sizeof sock, "%s/zerod.sock", dir);
  snprintf(log, sizeof log, "%s/zerod.log", dir);
  setenv("XDG_RUNTIME_DIR", dir, 1);
  unsetenv("ZEROD_SOCKET");
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    freopen(log, "w", stderr);
    execl(getenv("ZEROD_BIN"), "zerod", (char *)NULL);
    _exit(127);
  }
  zd_client_t *c = NULL;
  for (int i = 0; i < 500 && !c; i++) {
    if (zd_connect(NULL, ZD_ANY_RANK, 0, &c) != ZD_OK) {
      c = NULL;
      nanosleep(&(struct timespec){.tv_nsec = 10000000}, NULL);
    }
  }
  CHECK_MSG(c, "no zerod on the default socket %s: %s", sock, zd_last_error());
  struct stat st;
  CHECK(stat(sock, &st) == 0);
  CHECK_INT_EQ(st.st_mode & 0777, 0660);
  char *status;
  CHECK_INT_EQ(zd_status(c, &status), ZD_OK);
  CHECK_CONTAINS(status, sock);
  CHECK_CONTAINS(status, "socket_mode:0660 (default)");
  free(status);
  zd_close(c);
  kill(pid, SIGTERM);
  int wst;
  waitpid(pid, &wst, 0);
  CHECK_MSG(WIFEXITED(wst) && WEXITSTATUS(wst) == 0, "exit status 0x%x", wst);
  CHECK_INT_EQ(access(sock, F_OK), -1);
  unlink(log);
  rmdir(dir);
  printf("  no configuration: listened on %s (mode 0660), exited 0, socket removed\n", sock);
}

/* SIGTERM with steps in flight on a large model: they complete and are answered. */
static void test_sigterm_in_flight(void) {
  zdt_daemon_t d;
  zdt_start(&d, NULL);
  zd_param_t big = {.name = "big", .ndim = 1, .shape = {1u << 24}, .group = 0};
  zd_client_t *c;
  CHECK_INT_EQ(zd_connect(d.socket, ZD_ANY_RANK, 0, &c), ZD_OK);
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = &big;
  desc.nparams = 1;
  desc.groups = groups;
  desc.ngroups = 1;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  CHECK_INT_EQ(zd_layout(c, &desc), ZD_OK);
  CHECK_INT_EQ(zd_register(c), ZD_OK);
  enum { N = 6 };
  zd_request_t req[N];
  for (int i = 0; i < N; i++) CHECK_INT_EQ(zd_step_start(c, NULL, &req[i]), ZD_OK);
  nanosleep(&(struct timespec){.tv_nsec = 30000000}, NULL); /* all frames read, steps running */
  kill(d.pid, SIGTERM);
  for (int i = 0; i < N; i++) {
    zd_step_result_t r = ZD_STEP_RESULT_INIT;
    int rc = zd_wait(c, req[i], &r);
    CHECK_MSG(rc == ZD_OK, "step %d after SIGTERM: %s", i + 1, zd_last_error());
    CHECK_U64_EQ(r.step, (uint64_t)i + 1);
  }
  zd_close(c);
  zdt_stop(&d, SIGTERM, 1);
  CHECK_INT_EQ(access(d.socket, F_OK), -1);
  CHECK(zdt_log_contains(&d, "shut down cleanly"));
  zdt_stop(&d, 0, 0);
  printf("  SIGTERM with %d steps in flight: all answered, socket removed, exit 0\n", N);
}

/* CPU time of a process so far, in clock ticks (/proc/PID/stat: utime + stime). */
static unsigned long long cpu_ticks(pid_t pid) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  CHECK_MSG(f != NULL, "open %s: %s", path, strerror(errno));
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  const char *p = strrchr(buf, ')'); /* the command name may hold spaces */
  CHECK(p != NULL);
  unsigned long long utime = 0, stime = 0;
  /* after ")": state, then fields 4..13, then utime (14) and stime (15) */
  int got = sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime, &stime);
  CHECK_INT_EQ(got, 2);
  return utime + stime;
}

/* The number `key` of a zerod's status (the first line naming it). */
static unsigned long long status_counter(zd_client_t *c, const char *key) {
  char *status, line[64];
  CHECK_INT_EQ(zd_status(c, &status), ZD_OK);
  snprintf(line, sizeof line, "\n%s:", key);
  const char *p = strstr(status, line);
  CHECK_MSG(p != NULL, "no %s in the status:\n%s", key, status);
  unsigned long long n = strtoull(p + strlen(line), NULL, 10);
  zd_free(status);
  return n;
}

/* The counter `key` once it reaches `target`, or as it is after 5 s: zerod counts some events on
 * its loop thread a little after the client saw them. */
static unsigned long long counter_reaching(zd_client_t *c, const char *key,
                                           unsigned long long target) {
  unsigned long long n = status_counter(c, key);
  for (int tries = 0; tries < 500 && n < target; tries++) {
    nanosleep(&(struct timespec){.tv_nsec = 10000000}, NULL);
    n = status_counter(c, key);
  }
  return n;
}

/* busy_poll_us: a zerod polls for the next request after each reply, but only that long. A client
 * stepping back to back finds it polling (requests_polled counts those requests; none with
 * polling off). Once its client stops, it sleeps: an idle second costs it (almost) no CPU. */
static void test_busy_poll_ends(void) {
  const char *const off[] = {"--busy_poll_us", "0", NULL};
  const char *const *configs[] = {NULL, off};
  long hz = sysconf(_SC_CLK_TCK);
  for (int i = 0; i < 2; i++) {
    zdt_daemon_t d;
    zdt_start(&d, configs[i]);
    zd_client_t *c = connect_register(d.socket, mlp_params, ZD_ANY_RANK, 0, ZD_OK);
    /* Back to back: requests arrive while zerod polls (when on). On a loaded machine (tests run
     * side by side) the client is often descheduled past the window: rounds of 200 steps, for up
     * to 10 s, until one was found polling. */
    unsigned long long polled = 0;
    uint64_t done = 0;
    time_t give_up = time(NULL) + 10;
    do {
      steps(c, 200, done);
      done += 200;
      polled = status_counter(c, "requests_polled");
    } while (i == 0 && polled == 0 && time(NULL) < give_up);
    if (i == 0)
      CHECK_MSG(polled > 0, "busy polling on: none of %llu requests was found polling",
                (unsigned long long)done);
    else
      CHECK_MSG(polled == 0, "busy_poll_us 0: %llu requests counted as polled", polled);
    nanosleep(&(struct timespec){.tv_nsec = 100000000}, NULL);
    unsigned long long before = cpu_ticks(d.pid);
    nanosleep(&(struct timespec){.tv_sec = 1}, NULL);
    unsigned long long idle = cpu_ticks(d.pid) - before;
    /* A loop that kept polling would take the whole second (hz ticks). */
    CHECK_MSG(idle * 5 < (unsigned long long)hz,
              "zerod (busy_poll_us %s) used %llu of %ld clock ticks in an idle second",
              i ? "0" : "default", idle, hz);
    steps(c, 3, done); /* and it still answers */
    zd_close(c);
    zdt_stop(&d, SIGTERM, 0);
    printf(
        "  busy_poll_us %s: %llu requests found polling in %llu steps; then %llu CPU ticks in "
        "an idle second\n",
        i ? "0" : "50 (default)", polled, (unsigned long long)done, idle);
  }
}

/* A job that runs on its rank's worker (a model too big to step on the loop thread) is answered
 * by the worker as it ends, without waiting for the loop (daemon/transport/jobs.c): every such
 * reply is counted, comes only once the parameters are written (each step moves every one of
 * them), and pipelined requests, with the loop answering a status among them, all complete. A
 * job that fails is answered by the loop, and so are those after it until then: they complete
 * too. */
static void test_worker_answers(void) {
  zdt_daemon_t d;
  zdt_start(&d, NULL);
  zd_client_t *c;
  CHECK_INT_EQ(zd_connect(d.socket, ZD_ANY_RANK, 0, &c), ZD_OK);
  const uint64_t n = (1u << 21) + 1000; /* above ZD__INLINE_MAX_ELEMS */
  zd_param_t p = {.name = "w", .ndim = 1, .shape = {n}, .group = 0};
  zd_group_t g;
  zd_group_init(&g, 1, sizeof g);
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = &p;
  desc.nparams = 1;
  desc.groups = &g;
  desc.ngroups = 1;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  CHECK_INT_EQ(zd_layout(c, &desc), ZD_OK);
  float *w = zd_param_buffer(c, NULL), *grad = zd_grad_buffer(c, NULL);
  float *before = malloc(n * sizeof *before);
  CHECK(before);
  for (uint64_t k = 0; k < n; k++) w[k] = (float)((int64_t)(k % 2001) - 1000) * 1e-3f;
  CHECK_INT_EQ(zd_register(c), ZD_OK);
  unsigned long long early0 = status_counter(c, "replies_early");
  for (uint64_t k = 0; k < n; k++) grad[k] = 0.5f; /* every parameter must go down each step */
  const int nsteps = 10;
  for (int i = 0; i < nsteps; i++) {
    memcpy(before, w, n * sizeof *w);
    zd_step_result_t r = ZD_STEP_RESULT_INIT;
    CHECK_MSG(zd_step(c, NULL, &r) == ZD_OK, "step: %s", zd_last_error());
    CHECK_U64_EQ(r.step, (uint64_t)i + 1);
    for (uint64_t k = 0; k < n; k++)
      CHECK_MSG(w[k] < before[k], "step %d answered before parameter %llu was written (%g, was %g)",
                i + 1, (unsigned long long)k, w[k], before[k]);
  }
  /* Pipelined: scatter, step without it, gather, with a status answered by the loop between. */
  zd_request_t req[3];
  zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
  opts.flags = ZD_STEP_NO_SCATTER | ZD_STEP_NO_GATHER;
  CHECK_INT_EQ(zd_scatter_start(c, -1, &req[0]), ZD_OK);
  CHECK_INT_EQ(zd_step_start(c, &opts, &req[1]), ZD_OK);
  CHECK_INT_EQ(zd_gather_start(c, -1, &req[2]), ZD_OK);
  CHECK(status_counter(c, "replies_early") >= early0); /* answered by the loop meanwhile */
  zd_step_result_t r = ZD_STEP_RESULT_INIT;
  for (int i = 0; i < 3; i++)
    CHECK_MSG(zd_wait(c, req[i], &r) == ZD_OK, "pipelined request %d: %s", i, zd_last_error());
  CHECK_U64_EQ(r.step, (uint64_t)nsteps + 1);
  /* The loop counts a reply when it sees the job end, which may be after the client read it. */
  unsigned long long early =
      counter_reaching(c, "replies_early", early0 + (unsigned long long)nsteps + 3) - early0;
  CHECK_MSG(early == (unsigned long long)nsteps + 3,
            "%llu replies sent by the worker; expected %d (every step, scatter and gather)", early,
            nsteps + 3);
  /* A step in flight, then a checkpoint that fails on the worker (no checkpoint_dir), then more. */
  CHECK_INT_EQ(zd_step_start(c, NULL, &req[0]), ZD_OK);
  CHECK_INT_EQ(zd_checkpoint(c, 0, NULL, NULL, 0), ZD_ECONFIG);
  CHECK_INT_EQ(zd_step_start(c, NULL, &req[1]), ZD_OK);
  CHECK_INT_EQ(zd_gather_start(c, -1, &req[2]), ZD_OK);
  for (int i = 0; i < 3; i++)
    CHECK_MSG(zd_wait(c, req[i], &r) == ZD_OK, "request %d after a failed one: %s", i,
              zd_last_error());
  CHECK_U64_EQ(r.step, (uint64_t)nsteps + 3);
  /* Once the loop has answered those, the worker answers again. The loop counts the batch's
   * replies as it sees their jobs end, just after the client read them: wait until the count
   * stands still. */
  unsigned long long before_last = status_counter(c, "replies_early"), last;
  for (int tries = 0; tries < 100; tries++) {
    nanosleep(&(struct timespec){.tv_nsec = 20000000}, NULL);
    unsigned long long now = status_counter(c, "replies_early");
    if (now == before_last) break;
    before_last = now;
  }
  CHECK_MSG(zd_step(c, NULL, &r) == ZD_OK, "step: %s", zd_last_error());
  last = counter_reaching(c, "replies_early", before_last + 1) - before_last;
  CHECK_MSG(last == 1, "after a failed request, the worker answered %llu of 1 step", last);
  free(before);
  zd_close(c);
  zdt_stop(&d, SIGTERM, 0);
  printf(
      "  a model on the worker: %llu replies sent by it, each after its parameters were written\n",
      early);
}

/* pin_threads: on (the default), the kernel threads are bound where zerod may run on enough CPUs
 * (one per thread) and binding is permitted, and the status says so; off, they are not. */
static void test_pinned_threads(void) {
  cpu_set_t set;
  CHECK(sched_getaffinity(0, sizeof set, &set) == 0);
  int permitted = sched_setaffinity(0, sizeof set, &set) == 0; /* a seccomp filter may forbid it */
  const char *const on[] = {"--pin_threads", "1", "--threads", "0", NULL};
  const char *const off[] = {"--pin_threads", "0", "--threads", "0", NULL};
  const char *const *configs[] = {on, off};
  unsigned long long expect[] = {CPU_COUNT(&set) >= 2 && permitted, 0};
  for (int i = 0; i < 2; i++) {
    zdt_daemon_t d;
    zdt_start(&d, configs[i]);
    zd_client_t *c;
    CHECK_INT_EQ(zd_connect(d.socket, ZD_ANY_RANK, 0, &c), ZD_OK);
    unsigned long long pinned = status_counter(c, "kernel_threads_pinned");
    CHECK_MSG(pinned == expect[i], "pin_threads %d on %d CPUs: kernel_threads_pinned %llu", !i,
              CPU_COUNT(&set), pinned);
    zd_close(c);
    zdt_stop(&d, SIGTERM, 0);
  }
  printf("  pin_threads: kernel threads bound with 1 (%d CPUs%s), not with 0\n", CPU_COUNT(&set),
         permitted ? "" : ", binding not permitted here");
}

int main(void) {
  test_command_line();
  test_clients_and_state();
  test_grow();
  test_any_rank_at_once();
  test_no_configuration();
  test_sigterm_in_flight();
  test_busy_poll_ends();
  test_worker_answers();
  test_pinned_threads();
  printf("test_lifecycle: ok\n");
  return 0;
}
