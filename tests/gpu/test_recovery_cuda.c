/* Recovery through a real zerod running its CUDA backend at world size 1, with device buffers
 * shared through CUDA IPC: what a trainer sees when zerod or the trainer itself dies.
 *
 * Every run trains the example MLP with libzerod's device buffers (f32 or bf16 working params,
 * an AdamW and an Adam group, an lr schedule, several buckets) to TOTAL steps, and its parameters
 * at the end must be bitwise equal to those of an uninterrupted run on the same zerod binary
 * (gradients are a function of the parameters and the step, so a lost or doubled step shows).
 *
 * (a) Checkpoints from device memory (with amsgrad: four state arrays): checkpoint_every_steps (the
 * snapshot queued after a step, copied to pinned memory on a side stream while the next steps run)
 * and zd_checkpoint; zerod SIGKILLed after the periodic checkpoint of step 12 is complete; a new
 * zerod with
 *     --resume latest loads step 12 into device memory, and another with --resume of the
 *     checkpoint zd_checkpoint took at step 10; both go on to TOTAL.
 * (b) A trainer process with device buffers SIGKILLed: between two steps; in the middle of a step
 *     (some buckets scattered, the step not sent); and with its step request in flight (zerod
 *     may or may not have applied it when it finds the client gone). Each time zerod must stay
 *     healthy, and a restarted trainer (this process) must resume at the step zerod holds
 *     (the one the dead trainer reached, or one more when its step in flight was applied) and
 *     reach the uninterrupted run's parameters.
 * The trainers that die are this program run again (/proc/self/exe --trainer ...), so that CUDA
 * is initialised in a fresh process (it does not survive fork()), and they SIGKILL themselves at
 * the exact point.
 *
 * (c) State snapshots (state_dir on the CUDA backend: state_dir_mode snapshot): every 4 steps the
 *     state is copied off device memory into pinned staging and written to state_dir by a writer
 *     thread; zerod SIGKILLed at step 10, a new zerod on the same state_dir restores the snapshot
 *     of step 8 into device memory and the run reaches the uninterrupted one's parameters.
 *
 * Without a usable GPU the same runs go against zerods running the CPU backend with host buffers
 * (the rehearsal of the test's logic), and the test then exits 77 (skipped). 1 on failure.
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <math.h>
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

#define TOTAL 20
#define MAXN  (MLP_HIDDEN * MLP_IN)

/* Device buffers and a CUDA zerod, or in the rehearsal host buffers and a CPU zerod. */
static zd_memory_t memory = ZD_MEMORY_CUDA;
static const char *backend = "cuda";
/* Group 1 (Adam) with amsgrad: the model then has four state arrays (max_exp_avg_sq). */
static int amsgrad;

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ---- a trainer ------------------------------------------------------------------------------ */

typedef struct trainer {
  zd_client_t *c;
  zd_dtype_t pdt, gdt;
  void *pbuf, *gbuf; /* device memory, or host shared memory in the rehearsal */
  size_t pbytes, gbytes;
  uint8_t *hp, *hg; /* pinned host copies of the device buffers (the buffers themselves on host) */
  uint64_t step;    /* steps applied, as zerod said at register */
  int resumed;
} trainer_t;

static void groups_at(uint64_t step, zd_group_t out[2]) {
  out[0] = (zd_group_t){.lr = 3e-3 * (0.55 + 0.45 * cos(3.14159265358979 * (double)step / TOTAL)),
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
                        .optimizer = ZD_ADAM,
                        .amsgrad = amsgrad};
}

/* One try at connecting and registering; 0, or the code of the failure (the client closed). */
static int try_attach(trainer_t *t, const char *socket, int fresh) {
  int rc = zd_connect(socket, 0, 0, &t->c);
  if (rc) return rc;
  int device = 0;
  if (memory == ZD_MEMORY_CUDA)
    CHECK_MSG(zd_cuda_device(t->c, &device) == ZD_OK, "zd_cuda_device: %s", zd_last_error());
  zd_group_t groups[2];
  groups_at(0, groups);
  zd_model_desc_t desc = zdt_mlp_desc(groups, 2);
  desc.param_dtype = t->pdt;
  desc.grad_dtype = t->gdt;
  desc.grad_reduce = ZD_GRAD_MEAN;
  desc.flags = fresh ? ZD_REGISTER_REPLACE : 0;
  desc.memory = memory;
  desc.device = device;
  CHECK_MSG(zd_layout(t->c, &desc) == ZD_OK, "layout: %s", zd_last_error());
  t->pbuf = zd_param_buffer(t->c, &t->pbytes);
  t->gbuf = zd_grad_buffer(t->c, &t->gbytes);
  if (memory == ZD_MEMORY_CUDA) {
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaMallocHost((void **)&t->hp, t->pbytes));
    CUDA_CHECK(cudaMallocHost((void **)&t->hg, t->gbytes));
    memset(t->hg, 0, t->gbytes);
  } else {
    t->hp = t->pbuf;
    t->hg = t->gbuf;
  }
  memset(t->hp, 0, t->pbytes);
  if (fresh) {
    float init[MLP_NPARAMS][MAXN];
    float *p[MLP_NPARAMS] = {init[0], init[1], init[2], init[3]};
    mlp_init(p, 42);
    for (int i = 0; i < MLP_NPARAMS; i++) {
      zd_param_info_t info = ZD_PARAM_INFO_INIT;
      CHECK_INT_EQ(zd_param_info(t->c, (size_t)i, &info), ZD_OK);
      for (uint64_t k = 0; k < info.numel; k++)
        zdt_store(t->hp, t->pdt, info.offset + k, init[i][k]);
    }
    if (memory == ZD_MEMORY_CUDA)
      CUDA_CHECK(cudaMemcpy(t->pbuf, t->hp, t->pbytes, cudaMemcpyHostToDevice));
  }
  rc = zd_register(t->c);
  if (rc) {
    if (memory == ZD_MEMORY_CUDA) {
      CUDA_CHECK(cudaFreeHost(t->hp));
      CUDA_CHECK(cudaFreeHost(t->hg));
    }
    zd_close(t->c);
    t->c = NULL;
    return rc;
  }
  zd_info_t info = ZD_INFO_INIT;
  CHECK_INT_EQ(zd_get_info(t->c, &info), ZD_OK);
  t->step = info.step;
  t->resumed = info.resumed;
  CHECK_MSG(info.nbuckets >= 2, "bucket_elems 256 should give several buckets, got %u",
            info.nbuckets);
  return ZD_OK;
}

/* Attaches, fresh (replace, the initial weights) or resuming what zerod holds. A restarted
 * trainer may come before zerod has released the rank of the one that died: it tries again. */
static void attach(trainer_t *t, const char *socket, zd_dtype_t pdt, zd_dtype_t gdt, int fresh) {
  memset(t, 0, sizeof *t);
  t->pdt = pdt;
  t->gdt = gdt;
  int rc = 0;
  for (int i = 0; i < 300; i++) {
    rc = try_attach(t, socket, fresh);
    if (rc != ZD_EBUSY) break;
    sleep_ms(100);
  }
  CHECK_MSG(rc == ZD_OK, "attach (%s): %s (%s)", fresh ? "fresh" : "resume", zd_err_name(rc),
            zd_last_error());
  CHECK_INT_EQ(t->resumed, !fresh);
}

static void detach(trainer_t *t) {
  if (memory == ZD_MEMORY_CUDA) {
    CUDA_CHECK(cudaFreeHost(t->hp));
    CUDA_CHECK(cudaFreeHost(t->hg));
  }
  zd_close(t->c);
  t->c = NULL;
}

/* The param buffer into t->hp (after a reply: ordered by its "params ready" event, which libzerod
 * made the legacy default stream wait on). */
static void fetch_params(trainer_t *t) {
  if (memory == ZD_MEMORY_CUDA)
    CUDA_CHECK(cudaMemcpy(t->hp, t->pbuf, t->pbytes, cudaMemcpyDeviceToHost));
}

/* Gradients of the batch of t->step at the current parameters, uploaded to the grad buffer. */
static void make_grads(trainer_t *t) {
  fetch_params(t);
  float work[MLP_NPARAMS][MAXN], grad[MLP_NPARAMS][MAXN];
  float *p[MLP_NPARAMS], *g[MLP_NPARAMS];
  zd_param_info_t info[MLP_NPARAMS];
  for (int i = 0; i < MLP_NPARAMS; i++) {
    info[i] = (zd_param_info_t)ZD_PARAM_INFO_INIT;
    CHECK_INT_EQ(zd_param_info(t->c, (size_t)i, &info[i]), ZD_OK);
    p[i] = work[i];
    g[i] = grad[i];
    for (uint64_t k = 0; k < info[i].numel; k++)
      work[i][k] = zdt_load(t->hp, t->pdt, info[i].offset + k);
  }
  mlp_loss_grad((const float *const *)p, g, t->step, 0);
  for (int i = 0; i < MLP_NPARAMS; i++)
    for (uint64_t k = 0; k < info[i].numel; k++)
      zdt_store(t->hg, t->gdt, info[i].offset + k, grad[i][k]);
  if (memory == ZD_MEMORY_CUDA)
    CUDA_CHECK(cudaMemcpy(t->gbuf, t->hg, t->gbytes, cudaMemcpyHostToDevice));
}

static zd_step_opts_t step_opts(const trainer_t *t, zd_group_t groups[2]) {
  groups_at(t->step, groups);
  zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
  opts.groups = groups;
  opts.ngroups = 2;
  return opts;
}

static void train_step(trainer_t *t) {
  make_grads(t);
  zd_group_t groups[2];
  zd_step_opts_t opts = step_opts(t, groups);
  zd_step_result_t res = ZD_STEP_RESULT_INIT;
  CHECK_MSG(zd_step(t->c, &opts, &res) == ZD_OK, "step %llu: %s", (unsigned long long)t->step,
            zd_last_error());
  CHECK_INT_EQ(res.applied, 1);
  CHECK_U64_EQ(res.step, t->step + 1);
  t->step++;
}

static void train_to(trainer_t *t, uint64_t until) {
  while (t->step < until) train_step(t);
}

/* The parameters of the uninterrupted run, and a comparison with them. */
typedef struct params {
  uint8_t bytes[MLP_NPARAMS * MAXN * 4 + 4096];
  size_t len;
} params_t;

static void take_params(trainer_t *t, params_t *out) {
  fetch_params(t);
  CHECK(t->pbytes <= sizeof out->bytes);
  memcpy(out->bytes, t->hp, t->pbytes);
  out->len = t->pbytes;
}

static void compare(trainer_t *t, const params_t *want, const char *what) {
  fetch_params(t);
  CHECK_U64_EQ(t->pbytes, want->len);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    CHECK_INT_EQ(zd_param_info(t->c, (size_t)i, &info), ZD_OK);
    for (uint64_t k = 0; k < info.numel; k++) {
      float got = zdt_load(t->hp, t->pdt, info.offset + k);
      float exp = zdt_load(want->bytes, t->pdt, info.offset + k);
      CHECK_MSG(f2u(got) == f2u(exp),
                "%s: after %d steps %s[%llu] is %.9g (0x%08x); the uninterrupted run has %.9g "
                "(0x%08x)",
                what, TOTAL, info.name, (unsigned long long)k, got, f2u(got), exp, f2u(exp));
    }
  }
  printf("  %s: every parameter bitwise equal to the uninterrupted run after %d steps\n", what,
         TOTAL);
}

static void check_healthy(const zdt_daemon_t *d, trainer_t *t) {
  char *status = NULL;
  CHECK_INT_EQ(zd_status(t->c, &status), ZD_OK);
  if (!strstr(status, "health:ok\n")) zdt_dump_log(d);
  CHECK_CONTAINS(status, "health:ok\n");
  free(status);
}

static void uninterrupted(const char *socket, zd_dtype_t pdt, zd_dtype_t gdt, params_t *out) {
  trainer_t t;
  attach(&t, socket, pdt, gdt, 1);
  train_to(&t, TOTAL);
  take_params(&t, out);
  detach(&t);
}

/* ---- (b) trainers that die --------------------------------------------------------------------
 */

enum { DIE_BETWEEN = 0, DIE_SCATTERED = 1, DIE_IN_FLIGHT = 2 };
static const char *const die_names[] = {"between two steps", "in the middle of a step",
                                        "with its step request in flight"};

/* The dying trainer (this program, --trainer): attaches (fresh or resuming), trains to step `at`,
 * then dies as `how` says. */
static int trainer_main(int argc, char **argv) {
  CHECK_INT_EQ(argc, 8);
  const char *socket = argv[2];
  int how = atoi(argv[3]);
  uint64_t at = strtoull(argv[4], NULL, 10);
  int fresh = atoi(argv[5]);
  memory = (zd_memory_t)atoi(argv[6]);
  zd_dtype_t pdt = (zd_dtype_t)atoi(argv[7]);
  trainer_t t;
  attach(&t, socket, pdt, pdt, fresh);
  train_to(&t, at);
  make_grads(&t);
  if (how == DIE_SCATTERED) { /* the last bucket, as backward completes it first */
    zd_info_t info = ZD_INFO_INIT;
    CHECK_INT_EQ(zd_get_info(t.c, &info), ZD_OK);
    CHECK_MSG(zd_scatter(t.c, (int)info.nbuckets - 1) == ZD_OK, "scatter: %s", zd_last_error());
    CHECK_MSG(zd_scatter(t.c, (int)info.nbuckets - 2) == ZD_OK, "scatter: %s", zd_last_error());
  } else if (how == DIE_IN_FLIGHT) {
    zd_group_t groups[2];
    zd_step_opts_t opts = step_opts(&t, groups);
    zd_request_t req;
    CHECK_MSG(zd_step_start(t.c, &opts, &req) == ZD_OK, "step_start: %s", zd_last_error());
    /* The request's "grads ready" record has run: zerod's wait on it is for completed work. */
    if (memory == ZD_MEMORY_CUDA) CUDA_CHECK(cudaDeviceSynchronize());
  }
  fflush(stdout);
  raise(SIGKILL); /* holding its device buffers, its connection open */
  return 1;
}

/* Runs a dying trainer to its end (bounded) and checks that it died by its own SIGKILL. */
static void run_dying(const char *socket, int how, uint64_t at, int fresh, zd_dtype_t pdt) {
  char shw[8], sat[24], sfresh[8], smem[8], spdt[8];
  snprintf(shw, sizeof shw, "%d", how);
  snprintf(sat, sizeof sat, "%llu", (unsigned long long)at);
  snprintf(sfresh, sizeof sfresh, "%d", fresh);
  snprintf(smem, sizeof smem, "%d", (int)memory);
  snprintf(spdt, sizeof spdt, "%d", (int)pdt);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    execl("/proc/self/exe", "test_recovery_cuda", "--trainer", socket, shw, sat, sfresh, smem, spdt,
          (char *)NULL);
    _exit(127);
  }
  int status = 0;
  pid_t got = 0;
  for (int i = 0; i < 600 && (got = waitpid(pid, &status, WNOHANG)) == 0; i++) sleep_ms(100);
  if (got == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    CHECK_MSG(0, "the trainer that was to die %s did not within 60 s", die_names[how]);
  }
  CHECK_MSG(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
            "the trainer that was to die %s ended with %s", die_names[how], zdt_status_str(status));
}

static void trainers_die(const zdt_daemon_t *d, zd_dtype_t pdt) {
  printf("trainers SIGKILLed while holding %s buffers (%s params and grads)\n",
         memory == ZD_MEMORY_CUDA ? "device" : "host", zd_dtype_name(pdt));
  params_t want;
  uninterrupted(d->socket, pdt, pdt, &want);
  /* One trainer after another on the same model: the first starts it, each resumes its
   * predecessor's, the last (this process) finishes it. */
  static const struct {
    int how;
    uint64_t at;
  } deaths[] = {{DIE_BETWEEN, 4}, {DIE_SCATTERED, 8}, {DIE_IN_FLIGHT, 12}, {DIE_BETWEEN, 15}};
  uint64_t expect = 0;
  for (size_t i = 0; i < sizeof deaths / sizeof deaths[0]; i++) {
    run_dying(d->socket, deaths[i].how, deaths[i].at, i == 0, pdt);
    trainer_t t;
    attach(&t, d->socket, pdt, pdt, 0);
    expect = deaths[i].at;
    int applied = deaths[i].how == DIE_IN_FLIGHT && t.step == expect + 1;
    CHECK_MSG(t.step == expect || applied,
              "a trainer died %s before step %llu; its successor resumed at step %llu",
              die_names[deaths[i].how], (unsigned long long)expect, (unsigned long long)t.step);
    printf("  died %s at step %llu: the next trainer resumed at step %llu%s\n",
           die_names[deaths[i].how], (unsigned long long)expect, (unsigned long long)t.step,
           deaths[i].how == DIE_IN_FLIGHT
               ? (applied ? " (zerod had applied the step in flight)"
                          : " (zerod had not applied the step in flight)")
               : "");
    check_healthy(d, &t);
    if (i + 1 < sizeof deaths / sizeof deaths[0]) {
      /* It steps on, then leaves politely: the next dying trainer resumes from here. */
      if (t.step < deaths[i].at + 1) train_step(&t);
      detach(&t);
      continue;
    }
    train_to(&t, TOTAL);
    compare(&t, &want, "after four trainers died");
    check_healthy(d, &t);
    detach(&t);
  }
}

/* ---- (a) checkpoints from device memory ----------------------------------------------------- */

static void wait_checkpoint(const zdt_daemon_t *d, trainer_t *t, uint64_t step) {
  char want[64];
  snprintf(want, sizeof want, "last_step:%llu\n", (unsigned long long)step);
  for (int i = 0; i < 600; i++) {
    char *status = NULL;
    CHECK_INT_EQ(zd_status(t->c, &status), ZD_OK);
    int done = strstr(status, want) != NULL;
    free(status);
    if (done) return;
    sleep_ms(50);
  }
  zdt_dump_log(d);
  CHECK_MSG(0, "the checkpoint of step %llu was not complete within 30 s",
            (unsigned long long)step);
}

static void start_ready(zdt_daemon_t *d, const char *const *args) {
  zdt_start(d, args);
  if (memory != ZD_MEMORY_CUDA) return;
  for (int i = 0; i < 3000 && !zdt_log_contains(d, "NCCL communicator of 1 rank(s) ready"); i++)
    sleep_ms(10);
  CHECK_MSG(zdt_log_contains(d, "NCCL communicator of 1 rank(s) ready"),
            "the CUDA rank did not come up within 30 s; see zerod's log");
}

static void resume_and_finish(const char *dir, const char *resume, uint64_t expect,
                              const params_t *want, const char *what) {
  const char *args[] = {"--backend", backend,    "--bucket_elems", "256", "--checkpoint-dir",
                        dir,         "--resume", resume,           NULL};
  zdt_daemon_t d;
  start_ready(&d, args);
  trainer_t t;
  attach(&t, d.socket, ZD_F32, ZD_F32, 0);
  CHECK_U64_EQ(t.step, expect);
  train_to(&t, TOTAL);
  compare(&t, want, what);
  check_healthy(&d, &t);
  detach(&t);
  CHECK_MSG(!zdt_log_contains(&d, " ERROR "), "zerod logged errors");
  zdt_stop(&d, SIGTERM, 0);
}

static void checkpoints(const char *plain_socket) {
  printf(
      "checkpoints from %s memory (amsgrad: four state arrays): periodic and zd_checkpoint, "
      "zerod SIGKILLed, resumed\n",
      memory == ZD_MEMORY_CUDA ? "device" : "host");
  amsgrad = 1;
  params_t want;
  uninterrupted(plain_socket, ZD_F32, ZD_F32, &want);
  char dir[] = "/tmp/zd-gpu-recovery-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  const char *args[] = {"--backend",
                        backend,
                        "--bucket_elems",
                        "256",
                        "--checkpoint-dir",
                        dir,
                        "--checkpoint_every_steps",
                        "4",
                        NULL};
  zdt_daemon_t d;
  start_ready(&d, args);
  trainer_t t;
  attach(&t, d.socket, ZD_F32, ZD_F32, 1);
  train_to(&t, 10); /* periodic snapshots after steps 4 and 8, off the steps' replies */
  uint64_t cstep = 0;
  char cdir[512];
  CHECK_MSG(zd_checkpoint(t.c, 0, &cstep, cdir, sizeof cdir) == ZD_OK, "zd_checkpoint: %s",
            zd_last_error());
  CHECK_U64_EQ(cstep, 10);
  train_to(&t, 13); /* the snapshot of step 12 is queued as step 13 runs */
  wait_checkpoint(&d, &t, 12);
  check_healthy(&d, &t);
  CHECK_MSG(!zdt_log_contains(&d, " ERROR "), "zerod logged errors");
  zdt_stop(&d, SIGKILL, 0); /* step 13 is lost */
  detach(&t);
  printf("  checkpoints of steps 4, 8, 12 (periodic) and 10 (%s) taken; zerod SIGKILLed at 13\n",
         cdir);
  resume_and_finish(dir, "latest", 12, &want, "resumed from the periodic checkpoint of step 12");
  resume_and_finish(dir, cdir, 10, &want, "resumed from zd_checkpoint's checkpoint of step 10");
  char rm[128];
  snprintf(rm, sizeof rm, "rm -rf %s", dir);
  CHECK_INT_EQ(system(rm), 0);
  amsgrad = 0;
}

/* ---- (c) state snapshots from device memory ------------------------------------------------- */

/* Until zerod's status holds `want` (a "key:value\n" line), at most 30 s. */
static void wait_status(const zdt_daemon_t *d, trainer_t *t, const char *want) {
  for (int i = 0; i < 600; i++) {
    char *status = NULL;
    CHECK_INT_EQ(zd_status(t->c, &status), ZD_OK);
    int done = strstr(status, want) != NULL;
    free(status);
    if (done) return;
    sleep_ms(50);
  }
  zdt_dump_log(d);
  CHECK_MSG(0, "zerod's status did not say %s within 30 s", want);
}

/* state_dir on the CUDA backend (state_dir_mode auto: snapshot; the rehearsal on the CPU backend
 * names it): snapshots of steps 4 and 8 copied off device memory into pinned staging and written
 * by the writer thread; zerod SIGKILLed at step 10; a new zerod on the same state_dir restores the
 * snapshot of step 8 into device memory, and the run reaches the uninterrupted run's parameters. */
static void snapshots(const char *plain_socket) {
  printf(
      "state snapshots from %s memory (amsgrad: four state arrays) every 4 steps, zerod "
      "SIGKILLed, restored\n",
      memory == ZD_MEMORY_CUDA ? "device" : "host");
  amsgrad = 1;
  params_t want;
  uninterrupted(plain_socket, ZD_F32, ZD_F32, &want);
  char dir[] = "/tmp/zd-gpu-snapshot-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  char state[64];
  snprintf(state, sizeof state, "%s/state", dir);
  const char *args[] = {"--backend",
                        backend,
                        "--bucket_elems",
                        "256",
                        "--state_dir",
                        state,
                        "--state_dir_mode",
                        memory == ZD_MEMORY_CUDA ? "auto" : "snapshot",
                        "--state_snapshot_every_steps",
                        "4",
                        NULL};
  zdt_daemon_t d;
  start_ready(&d, args);
  trainer_t t;
  attach(&t, d.socket, ZD_F32, ZD_F32, 1);
  /* Each snapshot written before the next is due: one due while the previous is still written is
   * skipped (on a disk the writer's fdatasync can outlast four steps). */
  train_to(&t, 5);
  wait_status(&d, &t, "snapshot_step:4\n");
  train_to(&t, 10);
  wait_status(&d, &t, "snapshot_step:8\n");
  char *status = NULL;
  CHECK_INT_EQ(zd_status(t.c, &status), ZD_OK);
  const char *stall = strstr(status, "last_stall_us:");
  const char *write = strstr(status, "last_write_ms:");
  printf("  snapshot of step 8 written (step stall %.*s us, writer %.*s ms)\n",
         stall ? (int)strcspn(stall + 14, "\n") : 1, stall ? stall + 14 : "?",
         write ? (int)strcspn(write + 14, "\n") : 1, write ? write + 14 : "?");
  free(status);
  check_healthy(&d, &t);
  CHECK_MSG(!zdt_log_contains(&d, " ERROR "), "zerod logged errors");
  zdt_stop(&d, SIGKILL, 0); /* steps 9 and 10 are lost */
  detach(&t);
  start_ready(&d, args);
  attach(&t, d.socket, ZD_F32, ZD_F32, 0);
  CHECK_U64_EQ(t.step, 8);
  wait_status(&d, &t, "last_recovery:snapshot\n");
  CHECK_MSG(zdt_log_contains(&d, "resumed step 8 from its state snapshot"),
            "zerod did not log the restore from the snapshot");
  train_to(&t, TOTAL);
  compare(&t, &want, "restored from the state snapshot of step 8");
  check_healthy(&d, &t);
  detach(&t);
  CHECK_MSG(!zdt_log_contains(&d, " ERROR "), "zerod logged errors");
  zdt_stop(&d, SIGTERM, 0);
  char rm[128];
  snprintf(rm, sizeof rm, "rm -rf %s", dir);
  CHECK_INT_EQ(system(rm), 0);
  amsgrad = 0;
}

/* ---- main ------------------------------------------------------------------------------------ */

static zdt_daemon_t gd;
static int passed;

static void on_exit_dump(void) {
  if (passed || gd.pid <= 0) return;
  fprintf(stderr, "test_recovery_cuda failed; zerod's log follows\n");
  zdt_dump_log(&gd);
  kill(gd.pid, SIGKILL);
}

static void run_all(void) {
  const char *args[] = {"--backend", backend, "--bucket_elems", "256", NULL};
  start_ready(&gd, args);
  atexit(on_exit_dump);
  trainers_die(&gd, ZD_BF16);
  trainers_die(&gd, ZD_F32);
  checkpoints(gd.socket);
  snapshots(gd.socket);
  CHECK_MSG(!zdt_log_contains(&gd, "rank degraded"), "zerod degraded a rank");
  zdt_stop(&gd, SIGTERM, 0);
  passed = 1;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--trainer") == 0) return trainer_main(argc, argv);
  char why[1024];
  int ngpus = zd__cuda_available(why, sizeof why);
  if (ngpus == 0) {
    printf("no usable GPU (%s): rehearsing the test's logic against the CPU backend\n", why);
    memory = ZD_MEMORY_HOST;
    backend = "cpu";
    run_all();
    printf("test_recovery_cuda: skipped (the logic passed on host buffers), CUDA unusable: %s\n",
           why);
    return ZD_TEST_SKIP;
  }
  struct cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("GPU 0: %s, %d usable GPU(s)\n", prop.name, ngpus);
  run_all();
  printf("test_recovery_cuda: ok\n");
  return 0;
}
