/* The multi-rank CUDA step on one GPU: a real zerod with `--backend cuda --local_ranks W
 * --world_size W --ranks_per_gpu W` (the in-process group communicator: reduce-scatter into
 * device shards, the step records' all-gather, the commit point, the all-gather of parameters),
 * and W trainers (threads of this process) with libzerod's device buffers.
 *
 * 1. W = 2 and 4, fp32 and bf16 (params and gradients), the example MLP in several buckets, clipped
 *    on every other step: every trainer is fed the same gradients g, and a one-rank CUDA zerod
 *    (NCCL) is fed g too; with grad_mean, after every step every parameter of every trainer must
 *    be bitwise equal to the one-rank run's, and so must applied, grad_norm and clip_coef. The
 *    gradients are dyadic with at most 8 significant bits, so that every sum of squares is exact
 *    in double whatever its order (the statistics are summed per rank, then across ranks) and
 *    the comparison tests the reduction and the update, not the order of a norm's additions.
 *    Once with zd_step doing everything, once per bucket (scatters in descending order, a step
 *    without scatter and gather, gathers).
 * 2. A trainer killed mid-step at W = 2: rank 1's trainer (another process) scatters the
 *    highest bucket and is SIGKILLed; rank 0's trainer scatters the rest and steps: zerod stands
 *    in for the dead trainer, and rank 0 gets ZD_EABORTED (the step abandoned on every rank)
 *    well within the collective timeout. Then rank 0's trainer and a new one for rank 1 both
 *    reattach (resuming the model), the step, retried, is applied on both, and no rank is
 *    degraded.
 *
 * Without a usable GPU only the configuration refusals run (they need none), and the test exits
 * 77 (skipped).
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "adam_cuda.h"
#include "check.h"
#include "dtype_ref.h"
#include "harness.h"
#include "mlp.h"
#include "gpu_check.h"
#include "zerod/zerod.h"

#define STEPS       8
#define MAXW        4
#define MAXN        (MLP_HIDDEN * MLP_IN)
#define ABORT_MAX_S 10.0 /* half the collective timeout of the kill test's zerod */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- a trainer on device buffers ------------------------------------------------------------ */

typedef struct trainer {
  const char *socket;
  int rank;
  zd_dtype_t pdt, gdt;
  double max_norm;
  int replace; /* register a new model (collective at W > 1); 0: reattach */
  zd_client_t *c;
  void *pbuf, *gbuf; /* device */
  size_t pbytes, gbytes;
  uint8_t *hp, *hg;    /* pinned staging */
  cudaStream_t stream; /* the trainer's own, non-blocking: the W trainers of this process must
                          not order each other's work through the legacy default stream */
  uint32_t nbuckets;
  int resumed;
} trainer_t;

static void groups_of(zd_group_t out[2]) {
  out[0] = (zd_group_t){.lr = 3e-3,
                        .beta1 = 0.9,
                        .beta2 = 0.999,
                        .eps = 1e-8,
                        .weight_decay = 0.01,
                        .optimizer = ZD_ADAMW};
  out[1] = (zd_group_t){.lr = 1e-3,
                        .beta1 = 0.8,
                        .beta2 = 0.99,
                        .eps = 1e-6,
                        .weight_decay = 0.1,
                        .optimizer = ZD_ADAM};
}

/* Connects to t->rank, lays out, writes the initial values (a new model) and registers. */
static void attach(trainer_t *t) {
  CHECK_MSG(zd_connect(t->socket, t->rank, 0, &t->c) == ZD_OK, "rank %d: connect: %s", t->rank,
            zd_last_error());
  int device = 0;
  CHECK_MSG(zd_cuda_device(t->c, &device) == ZD_OK, "zd_cuda_device: %s", zd_last_error());
  zd_group_t groups[2];
  groups_of(groups);
  zd_model_desc_t desc = zdt_mlp_desc(groups, 2);
  desc.param_dtype = t->pdt;
  desc.grad_dtype = t->gdt;
  desc.grad_reduce = ZD_GRAD_MEAN;
  desc.max_grad_norm = t->max_norm;
  desc.flags = t->replace ? ZD_REGISTER_REPLACE : 0;
  desc.memory = ZD_MEMORY_CUDA;
  desc.device = device;
  CHECK_MSG(zd_layout(t->c, &desc) == ZD_OK, "rank %d: layout: %s", t->rank, zd_last_error());
  t->pbuf = zd_param_buffer(t->c, &t->pbytes);
  t->gbuf = zd_grad_buffer(t->c, &t->gbytes);
  CUDA_CHECK(cudaSetDevice(device));
  CUDA_CHECK(cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking));
  CHECK_MSG(zd_set_stream(t->c, t->stream) == ZD_OK, "zd_set_stream: %s", zd_last_error());
  CUDA_CHECK(cudaMallocHost((void **)&t->hp, t->pbytes));
  CUDA_CHECK(cudaMallocHost((void **)&t->hg, t->gbytes));
  memset(t->hp, 0, t->pbytes);
  memset(t->hg, 0, t->gbytes);
  if (t->replace) {
    float init[MLP_NPARAMS][MAXN];
    float *p[MLP_NPARAMS] = {init[0], init[1], init[2], init[3]};
    mlp_init(p, 42);
    for (int i = 0; i < MLP_NPARAMS; i++) {
      zd_param_info_t info = ZD_PARAM_INFO_INIT;
      CHECK_INT_EQ(zd_param_info(t->c, (size_t)i, &info), ZD_OK);
      for (uint64_t k = 0; k < info.numel; k++)
        zdt_store(t->hp, t->pdt, info.offset + k, init[i][k]);
    }
    /* On the stream: ordered before zerod's reads by the register's "grads ready" record. */
    CUDA_CHECK(cudaMemcpyAsync(t->pbuf, t->hp, t->pbytes, cudaMemcpyHostToDevice, t->stream));
  }
  int rc = zd_register(t->c);
  CHECK_MSG(rc == ZD_OK, "rank %d: register: %s: %s", t->rank, zd_err_name(rc), zd_last_error());
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(t->c, &info);
  t->nbuckets = info.nbuckets;
  t->resumed = info.resumed;
  CHECK_MSG(info.nbuckets >= 2, "bucket_elems 256 should give several buckets, got %u",
            info.nbuckets);
}

static void detach(trainer_t *t) {
  CUDA_CHECK(cudaStreamSynchronize(t->stream));
  zd_close(t->c);
  t->c = NULL;
  CUDA_CHECK(cudaStreamDestroy(t->stream));
  CUDA_CHECK(cudaFreeHost(t->hp));
  CUDA_CHECK(cudaFreeHost(t->hg));
}

/* The param buffer into t->hp, on the stream (after the last reply's "params ready"). */
static void fetch_params(trainer_t *t) {
  CUDA_CHECK(cudaMemcpyAsync(t->hp, t->pbuf, t->pbytes, cudaMemcpyDeviceToHost, t->stream));
  CUDA_CHECK(cudaStreamSynchronize(t->stream));
}

/* The gradients g[param][k] (floats, exact in bf16) into t's grad buffer, on the stream (t->hg
 * is rewritten only after the next fetch_params, which waits for the stream). */
static void push_grads(trainer_t *t, float g[MLP_NPARAMS][MAXN]) {
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(t->c, (size_t)i, &info);
    for (uint64_t k = 0; k < info.numel; k++) zdt_store(t->hg, t->gdt, info.offset + k, g[i][k]);
  }
  CUDA_CHECK(cudaMemcpyAsync(t->gbuf, t->hg, t->gbytes, cudaMemcpyHostToDevice, t->stream));
}

/* The batch of `step` at t's parameters, made dyadic: k * q with |k| <= 255 (8 significant bits:
 * exact in bf16, and every square and sum of squares exact in double), then scaled by a power of
 * two so that the norm lies in [2, 4) (clip: max_grad_norm is 1) or [1/4, 1/2). */
static void make_grads(trainer_t *t, int step, int clip, float g[MLP_NPARAMS][MAXN]) {
  float work[MLP_NPARAMS][MAXN];
  float *p[MLP_NPARAMS], *gp[MLP_NPARAMS];
  zd_param_info_t info[MLP_NPARAMS];
  for (int i = 0; i < MLP_NPARAMS; i++) {
    info[i] = (zd_param_info_t)ZD_PARAM_INFO_INIT;
    zd_param_info(t->c, (size_t)i, &info[i]);
    p[i] = work[i];
    gp[i] = g[i];
    for (uint64_t k = 0; k < info[i].numel; k++)
      work[i][k] = zdt_load(t->hp, t->pdt, info[i].offset + k);
  }
  mlp_loss_grad((const float *const *)p, gp, (uint64_t)step, 0);
  float most = 0;
  for (int i = 0; i < MLP_NPARAMS; i++)
    for (uint64_t k = 0; k < info[i].numel; k++) most = fmaxf(most, fabsf(g[i][k]));
  double q = most > 0 ? exp2(ceil(log2(most / 255.0))) : 1.0;
  double sumsq = 0;
  for (int i = 0; i < MLP_NPARAMS; i++)
    for (uint64_t k = 0; k < info[i].numel; k++) {
      double kq = fmax(-255.0, fmin(255.0, nearbyint(g[i][k] / q)));
      g[i][k] = (float)(kq * q);
      sumsq += (double)g[i][k] * g[i][k];
    }
  double norm = sqrt(sumsq), s = 1.0;
  double lo = clip ? 2.0 : 0.25;
  while (norm > 0 && norm * s >= 2 * lo) s *= 0.5;
  while (norm > 0 && norm * s < lo) s *= 2.0;
  for (int i = 0; i < MLP_NPARAMS; i++)
    for (uint64_t k = 0; k < info[i].numel; k++) g[i][k] = (float)(g[i][k] * s);
}

/* One step: zd_step doing everything, or per bucket. */
static int send_step(trainer_t *t, int per_bucket, zd_step_result_t *res) {
  *res = (zd_step_result_t)ZD_STEP_RESULT_INIT;
  if (!per_bucket) return zd_step(t->c, NULL, res);
  for (uint32_t b = t->nbuckets; b-- > 0;) {
    int rc = zd_scatter(t->c, (int)b);
    if (rc) return rc;
  }
  zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
  opts.flags = ZD_STEP_NO_SCATTER | ZD_STEP_NO_GATHER;
  int rc = zd_step(t->c, &opts, res);
  if (rc) return rc;
  for (uint32_t b = 0; b < t->nbuckets; b++)
    if ((rc = zd_gather(t->c, (int)b))) return rc;
  return ZD_OK;
}

typedef struct job {
  trainer_t *t;
  int per_bucket;
  float (*g)[MAXN];
  zd_step_result_t res;
  int rc;
  char msg[512];
} job_t;

static void *attach_main(void *arg) {
  attach(arg);
  return NULL;
}

static void *step_main(void *arg) {
  job_t *j = arg;
  push_grads(j->t, j->g);
  j->rc = send_step(j->t, j->per_bucket, &j->res);
  if (j->rc) snprintf(j->msg, sizeof j->msg, "%s", zd_last_error());
  return NULL;
}

static int bits_equal(double a, double b) {
  return memcmp(&a, &b, sizeof a) == 0 || (isnan(a) && isnan(b));
}

/* ---- 1. W ranks on one GPU against one rank ---------------------------------------------------
 */

static void world_vs_one(const char *world_socket, uint32_t w, const char *one_socket,
                         zd_dtype_t dt, int per_bucket) {
  printf("W=%u on one GPU vs W=1, %s, %s\n", w, zd_dtype_name(dt),
         per_bucket ? "per-bucket scatters and gathers" : "zd_step");
  trainer_t one = {
      .socket = one_socket, .rank = 0, .pdt = dt, .gdt = dt, .max_norm = 1.0, .replace = 1};
  trainer_t t[MAXW];
  pthread_t th[MAXW];
  attach(&one);
  for (uint32_t r = 0; r < w; r++) {
    t[r] = (trainer_t){.socket = world_socket,
                       .rank = (int)r,
                       .pdt = dt,
                       .gdt = dt,
                       .max_norm = 1.0,
                       .replace = 1};
    CHECK(pthread_create(&th[r], NULL, attach_main, &t[r]) == 0);
  }
  for (uint32_t r = 0; r < w; r++) pthread_join(th[r], NULL);

  static float g[MLP_NPARAMS][MAXN];
  for (int step = 0; step < STEPS; step++) {
    int clip = step % 2 == 1;
    fetch_params(&one);
    make_grads(&one, step, clip, g);
    job_t ref = {.t = &one, .per_bucket = per_bucket, .g = g};
    step_main(&ref);
    CHECK_MSG(ref.rc == ZD_OK, "W=1 step %d: %s", step, ref.msg);
    CHECK_MSG(clip ? ref.res.clip_coef < 1.0 : ref.res.clip_coef == 1.0,
              "step %d: clip_coef %.9g, expected %s", step, ref.res.clip_coef,
              clip ? "below 1" : "1");
    job_t jobs[MAXW];
    for (uint32_t r = 0; r < w; r++) {
      jobs[r] = (job_t){.t = &t[r], .per_bucket = per_bucket, .g = g};
      CHECK(pthread_create(&th[r], NULL, step_main, &jobs[r]) == 0);
    }
    for (uint32_t r = 0; r < w; r++) pthread_join(th[r], NULL);
    fetch_params(&one);
    for (uint32_t r = 0; r < w; r++) {
      job_t *j = &jobs[r];
      CHECK_MSG(j->rc == ZD_OK, "W=%u rank %u step %d: %s: %s", w, r, step, zd_err_name(j->rc),
                j->msg);
      CHECK_MSG(j->res.applied == ref.res.applied && j->res.step == ref.res.step &&
                    bits_equal(j->res.grad_norm, ref.res.grad_norm) &&
                    bits_equal(j->res.clip_coef, ref.res.clip_coef),
                "W=%u rank %u step %d: applied %d step %llu norm %.17g clip %.17g; W=1: applied "
                "%d step %llu norm %.17g clip %.17g",
                w, r, step, j->res.applied, (unsigned long long)j->res.step, j->res.grad_norm,
                j->res.clip_coef, ref.res.applied, (unsigned long long)ref.res.step,
                ref.res.grad_norm, ref.res.clip_coef);
      fetch_params(&t[r]);
      for (int i = 0; i < MLP_NPARAMS; i++) {
        zd_param_info_t a = ZD_PARAM_INFO_INIT, b = ZD_PARAM_INFO_INIT;
        zd_param_info(one.c, (size_t)i, &a);
        zd_param_info(t[r].c, (size_t)i, &b);
        CHECK_U64_EQ(a.numel, b.numel);
        for (uint64_t k = 0; k < a.numel; k++) {
          float want = zdt_load(one.hp, dt, a.offset + k),
                got = zdt_load(t[r].hp, dt, b.offset + k);
          CHECK_MSG(f2u(want) == f2u(got),
                    "W=%u rank %u step %d: %s[%llu] is %.9g (0x%08x), W=1 has %.9g (0x%08x)", w, r,
                    step, a.name, (unsigned long long)k, got, f2u(got), want, f2u(want));
        }
      }
    }
  }
  for (uint32_t r = 0; r < w; r++) detach(&t[r]);
  detach(&one);
}

/* ---- 2. a trainer killed mid-step ----------------------------------------------------------- */

/* The child trainer (a process of its own, started through exec so that it has its own CUDA
 * context): "victim" registers rank 1 with rank 0 (the parent), steps once, scatters the highest
 * bucket, says so on fd and waits to be killed; "retry" reattaches to rank 1 and steps once. */
static int child_main(const char *socket, const char *mode, int fd) {
  static float g[MLP_NPARAMS][MAXN];
  int victim = !strcmp(mode, "victim");
  trainer_t t = {.socket = socket, .rank = 1, .pdt = ZD_F32, .gdt = ZD_F32, .replace = victim};
  attach(&t);
  fetch_params(&t);
  make_grads(&t, 0, 0, g);
  zd_step_result_t res;
  if (victim) {
    push_grads(&t, g);
    CHECK_MSG(send_step(&t, 0, &res) == ZD_OK, "victim's first step: %s", zd_last_error());
    CHECK_MSG(zd_scatter(t.c, (int)t.nbuckets - 1) == ZD_OK, "victim's scatter: %s",
              zd_last_error());
    CHECK(write(fd, "k", 1) == 1);
    for (;;) pause();
  }
  CHECK_MSG(t.resumed, "the retrying trainer did not resume rank 1's model");
  make_grads(&t, 1, 0, g);
  push_grads(&t, g);
  int rc = send_step(&t, 0, &res);
  CHECK_MSG(rc == ZD_OK, "the retried step on rank 1: %s: %s", zd_err_name(rc), zd_last_error());
  CHECK_INT_EQ(res.applied, 1);
  detach(&t);
  return 0;
}

static pid_t spawn_child(const char *socket, const char *mode, int fd) {
  char fdstr[16];
  snprintf(fdstr, sizeof fdstr, "%d", fd);
  fflush(NULL);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    execl("/proc/self/exe", "test_world_cuda", "--child", socket, mode, fdstr, (char *)NULL);
    _exit(127);
  }
  return pid;
}

static void killed_mid_step(void) {
  printf("W=2 on one GPU: rank 1's trainer killed mid-step\n");
  zdt_daemon_t d;
  const char *args[] = {"--backend",
                        "cuda",
                        "--local_ranks",
                        "2",
                        "--world_size",
                        "2",
                        "--ranks_per_gpu",
                        "2",
                        "--bucket_elems",
                        "256",
                        "--collective_timeout_ms",
                        "20000",
                        NULL};
  zdt_start(&d, args);
  int pipefd[2];
  CHECK(pipe(pipefd) == 0);
  pid_t victim = spawn_child(d.socket, "victim", pipefd[1]);
  close(pipefd[1]); /* a victim that fails before it says "k" ends the read below */
  static float g[MLP_NPARAMS][MAXN];
  trainer_t t = {.socket = d.socket, .rank = 0, .pdt = ZD_F32, .gdt = ZD_F32, .replace = 1};
  attach(&t);
  fetch_params(&t);
  make_grads(&t, 0, 0, g);
  push_grads(&t, g);
  zd_step_result_t res;
  CHECK_MSG(send_step(&t, 0, &res) == ZD_OK, "first step: %s", zd_last_error());
  CHECK_MSG(zd_scatter(t.c, (int)t.nbuckets - 1) == ZD_OK, "scatter: %s", zd_last_error());
  char k;
  CHECK_MSG(read(pipefd[0], &k, 1) == 1, "rank 1's trainer failed before its scatter");
  CHECK(kill(victim, SIGKILL) == 0);
  int status;
  CHECK(waitpid(victim, &status, 0) == victim);
  double t0 = now_s();
  int rc = ZD_OK;
  for (uint32_t b = t.nbuckets - 1; b-- > 0 && rc == ZD_OK;) rc = zd_scatter(t.c, (int)b);
  if (rc == ZD_OK) {
    zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
    opts.flags = ZD_STEP_NO_SCATTER;
    rc = zd_step(t.c, &opts, &res);
  }
  double took = now_s() - t0;
  CHECK_MSG(rc == ZD_EABORTED, "rank 0 after rank 1's trainer died: %s (%s), expected ZD_EABORTED",
            zd_err_name(rc), zd_last_error());
  CHECK_CONTAINS(zd_last_error(), "abandoned");
  CHECK_MSG(took < ABORT_MAX_S, "ZD_EABORTED came %.1f s after the kill", took);
  printf("  rank 0 got ZD_EABORTED %.0f ms after the kill\n", took * 1e3);

  /* The world is whole: rank 0's trainer and a new one for rank 1 reattach (with device buffers
   * that is a collective registration: both resume the model at its step) and the step, retried,
   * is applied. */
  detach(&t);
  pid_t retry = spawn_child(d.socket, "retry", -1);
  t.replace = 0;
  attach(&t);
  CHECK_MSG(t.resumed, "rank 0's trainer did not resume its model");
  fetch_params(&t);
  make_grads(&t, 1, 0, g);
  push_grads(&t, g);
  rc = send_step(&t, 0, &res);
  CHECK_MSG(rc == ZD_OK, "the retried step on rank 0: %s: %s", zd_err_name(rc), zd_last_error());
  CHECK_INT_EQ(res.applied, 1);
  CHECK_U64_EQ(res.step, 2);
  CHECK(waitpid(retry, &status, 0) == retry);
  CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the retrying trainer: %s",
            zdt_status_str(status));
  char *st;
  CHECK_INT_EQ(zd_status(t.c, &st), ZD_OK);
  CHECK_MSG(!strstr(st, "health:degraded"), "a rank is degraded:\n%s", st);
  free(st);
  detach(&t);
  close(pipefd[0]);
  zdt_stop(&d, SIGTERM, 0);
}

/* ---- configurations refused (no GPU needed) ------------------------------------------------- */

static void refusals(void) {
  const char *output;
  const char *wider[] = {
      "--backend", "cuda", "--local_ranks", "2", "--world_size", "4", "--ranks_per_gpu", "2", NULL};
  CHECK(zdt_run(wider, &output) != 0);
  CHECK_CONTAINS(output,
                 "ranks_per_gpu > 1 needs the whole world in this zerod for now: "
                 "world_size 4, local_ranks 2");
  const char *split[] = {"--backend", "cuda", "--local_ranks", "4", "--ranks_per_gpu", "2", NULL};
  CHECK(zdt_run(split, &output) != 0);
  CHECK_CONTAINS(output, "needs every local rank on one GPU for now");
  const char *more[] = {"--backend", "cuda", "--local_ranks", "2", "--ranks_per_gpu", "3", NULL};
  CHECK(zdt_run(more, &output) != 0);
  CHECK_CONTAINS(output, "ranks_per_gpu=3 (flag) is more than local_ranks=2");
}

static void wait_ready(zdt_daemon_t *d, const char *line) {
  for (int i = 0; i < 3000 && !zdt_log_contains(d, line); i++) usleep(10000);
  CHECK_MSG(zdt_log_contains(d, line), "no \"%s\" within 30 s; see zerod's log", line);
}

int main(int argc, char **argv) {
  if (argc == 5 && !strcmp(argv[1], "--child")) return child_main(argv[2], argv[3], atoi(argv[4]));
  refusals();
  char why[1024];
  if (zd__cuda_available(why, sizeof why) == 0) {
    printf("test_world_cuda: skipped (the configuration refusals passed), CUDA unusable: %s\n",
           why);
    return ZD_TEST_SKIP;
  }
  zdt_daemon_t one, two, four;
  const char *a1[] = {"--backend", "cuda", "--bucket_elems", "256", NULL};
  const char *a2[] = {
      "--backend", "cuda",           "--local_ranks", "2", "--world_size", "2", "--ranks_per_gpu",
      "2",         "--bucket_elems", "256",           NULL};
  const char *a4[] = {
      "--backend", "cuda",           "--local_ranks", "4", "--world_size", "4", "--ranks_per_gpu",
      "4",         "--bucket_elems", "256",           NULL};
  zdt_start(&one, a1);
  zdt_start(&two, a2);
  zdt_start(&four, a4);
  wait_ready(&one, "NCCL communicator of 1 rank(s) ready");
  wait_ready(&two, "group communicator of 2 rank(s) ready");
  wait_ready(&four, "group communicator of 4 rank(s) ready");

  world_vs_one(two.socket, 2, one.socket, ZD_F32, 0);
  world_vs_one(two.socket, 2, one.socket, ZD_BF16, 0);
  world_vs_one(four.socket, 4, one.socket, ZD_F32, 0);
  world_vs_one(four.socket, 4, one.socket, ZD_BF16, 0);
  world_vs_one(two.socket, 2, one.socket, ZD_BF16, 1);
  world_vs_one(four.socket, 4, one.socket, ZD_F32, 1);
  CHECK_MSG(!zdt_log_contains(&two, " ERROR ") && !zdt_log_contains(&four, " ERROR "),
            "a W>1 zerod logged errors");
  zdt_stop(&one, SIGTERM, 0);
  zdt_stop(&two, SIGTERM, 0);
  zdt_stop(&four, SIGTERM, 0);

  killed_mid_step();
  printf("test_world_cuda: ok\n");
  return 0;
}
