/* End-to-end training through a real zerod running its CUDA backend at world size 1 (NCCL, one
 * rank), with device buffers shared through CUDA IPC.
 *
 * 1. The example MLP trained for 120 steps through zerod and, in this process, with the scalar
 *    reference kernel; after every step every working parameter read back from the device must be
 *    bitwise equal to the reference's master (rounded to the working dtype). f32 and bf16 working
 *    params; f32, bf16 and f16 gradients; AdamW and Adam groups; an lr schedule; several buckets;
 *    a client that disconnects at step 60 and reattaches (zerod resumes: its master weights are
 *    written into the new client's buffer). Two runs use a stream of their own (zd_set_stream)
 *    and queue the gradients' upload on it without any host synchronisation, once behind a
 *    50 ms host callback: zerod's stream must wait on the client's "grads ready" event, or it
 *    steps with the previous step's gradients and the comparison fails.
 * 2. Pipelined requests (per-bucket scatters, a step without scatter and gather, per-bucket
 *    gathers, waited for in reverse order) on three streams: each bucket's gradients are uploaded
 *    on another stream, behind host callbacks of 100 and 300 ms on some steps, and the client
 *    switches streams between requests while they are in flight: each request's own "grads
 *    ready" slot must cover its own stream's work. On other steps zerod is held 200 ms by the
 *    first scatter while the client sends the rest, the step and the gathers behind a host
 *    callback on their stream that waits for the reply of an earlier scatter: zerod's wait for
 *    that scatter must cover its own request's record only (the ring of event pairs), or it
 *    deadlocks until the callback gives up (10 s) and the test fails.
 * 3. Clipping and loss scaling (the statistics, the step record all-gathered by NCCL, the host
 *    decision), in lockstep against a zerod running its CPU backend on the same gradients: every
 *    step's result (applied, grad_norm, loss_scale, clip_coef, bit for bit) and every parameter
 *    must be equal; overflows are injected (skipped steps, scale backoff).
 * 4. The library's CUDA manners: the buffers' alignment; the caller's CUDA context is given back
 *    (a thread with none still has none: no context created on GPU 0 behind the trainer's back;
 *    with 2 GPUs, the current device stays the caller's); a stream of another GPU, and requests
 *    on a stream being captured into a graph, are refused.
 * 5. Bad device buffers with real IPC handles: a param or grad buffer smaller than the layout, a
 *    buffer on another GPU (with 2 GPUs or more).
 * 6. Checkpoints from the GPU: 30 steps, zd_checkpoint (the shard copied from device memory),
 *    two steps more, zerod SIGKILLed; a new zerod with --resume latest loads the checkpoint into
 *    device memory, the reattached client's buffer holds the reference's parameters of step 30,
 *    and ten more steps stay bitwise equal to the reference.
 * Every failure prints the step, the parameter and both values.
 *
 * Without a usable GPU, 1-3 run against zerods running the CPU backend with host buffers (what
 * can run without a GPU: the test's own reference, request sequences and comparisons), and the
 * test then exits 77 (skipped).
 */
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
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
#include "layout.h"
#include "mlp.h"
#include "zerod.pb-c.h"
#include "gpu_check.h"
#include "zerod/zerod.h"

#define STEPS       120
#define REATTACH_AT 60
#define PIPE_STEPS  16
#define MAXN        (MLP_HIDDEN * MLP_IN)

/* What the "device" trainers get: device buffers and a CUDA zerod, or, without a GPU, host
 * buffers and a CPU zerod (the rehearsal of the test's logic). */
static zd_memory_t dev_memory = ZD_MEMORY_CUDA;
static const char *dev_backend = "cuda";

/* ---- a trainer on device buffers ------------------------------------------------------------ */

typedef struct trainer {
  zd_client_t *c;
  zd_memory_t memory;
  zd_dtype_t pdt, gdt;
  void *pbuf, *gbuf; /* device (ZD_MEMORY_CUDA) or host shared memory */
  size_t pbytes, gbytes;
  uint8_t *hp, *hg;    /* pinned staging of the device buffers */
  cudaStream_t stream; /* NULL: the legacy default stream */
  int delay_ms;        /* a host callback on the stream before the gradients' upload */
} trainer_t;

static void sleep_cb(void *arg) {
  int ms = *(const int *)arg;
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void groups_at(int step, int steps, zd_group_t out[2]) {
  out[0] = (zd_group_t){.lr = 3e-3 * (0.55 + 0.45 * cos(3.14159265358979 * step / steps)),
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

typedef struct options {
  zd_dtype_t pdt, gdt;
  int steps;
  double max_grad_norm;
  zd_loss_scaler_t scaler;
} options_t;

/* Connects, lays out, writes the initial values (unless resuming) and registers. */
static void attach(trainer_t *t, const char *socket, zd_memory_t memory, const options_t *o,
                   int step, int expect_resumed, cudaStream_t stream, int delay_ms) {
  memset(t, 0, sizeof *t);
  t->memory = memory;
  t->pdt = o->pdt;
  t->gdt = o->gdt;
  t->stream = stream;
  t->delay_ms = delay_ms;
  CHECK_MSG(zd_connect(socket, ZD_ANY_RANK, 0, &t->c) == ZD_OK, "connect: %s", zd_last_error());
  int device = 0;
  if (memory == ZD_MEMORY_CUDA)
    CHECK_MSG(zd_cuda_device(t->c, &device) == ZD_OK, "zd_cuda_device: %s", zd_last_error());
  zd_group_t groups[2];
  groups_at(step, o->steps, groups);
  zd_model_desc_t desc = zdt_mlp_desc(groups, 2);
  desc.param_dtype = o->pdt;
  desc.grad_dtype = o->gdt;
  desc.grad_reduce = ZD_GRAD_MEAN;
  desc.max_grad_norm = o->max_grad_norm;
  desc.loss_scaler = o->scaler.enabled ? &o->scaler : NULL;
  desc.flags = expect_resumed ? 0 : ZD_REGISTER_REPLACE; /* daemons are reused */
  desc.memory = memory;
  desc.device = device;
  CHECK_MSG(zd_layout(t->c, &desc) == ZD_OK, "layout: %s", zd_last_error());
  t->pbuf = zd_param_buffer(t->c, &t->pbytes);
  t->gbuf = zd_grad_buffer(t->c, &t->gbytes);
  /* The daemon's kernels load 16 bytes at a time from every parameter and every shard. */
  CHECK_MSG((uintptr_t)t->pbuf % 256 == 0 && (uintptr_t)t->gbuf % 256 == 0,
            "buffers at %p and %p: not 256-byte aligned", t->pbuf, t->gbuf);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    CHECK_INT_EQ(zd_param_info(t->c, (size_t)i, &info), ZD_OK);
    CHECK_MSG(info.offset % 64 == 0, "%s at element %llu: not a multiple of 64", info.name,
              (unsigned long long)info.offset);
  }
  if (memory == ZD_MEMORY_CUDA) {
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaMallocHost((void **)&t->hp, t->pbytes));
    CUDA_CHECK(cudaMallocHost((void **)&t->hg, t->gbytes));
    memset(t->hp, 0, t->pbytes);
    memset(t->hg, 0, t->gbytes);
    if (stream) CHECK_MSG(zd_set_stream(t->c, stream) == ZD_OK, "%s", zd_last_error());
  } else {
    t->hp = t->pbuf;
    t->hg = t->gbuf;
  }
  if (!expect_resumed) {
    float init[MLP_NPARAMS][MAXN];
    float *p[MLP_NPARAMS] = {init[0], init[1], init[2], init[3]};
    mlp_init(p, 42);
    for (int i = 0; i < MLP_NPARAMS; i++) {
      zd_param_info_t info = ZD_PARAM_INFO_INIT;
      CHECK_INT_EQ(zd_param_info(t->c, (size_t)i, &info), ZD_OK);
      for (uint64_t k = 0; k < info.numel; k++)
        zdt_store(t->hp, o->pdt, info.offset + k, init[i][k]);
    }
    if (memory == ZD_MEMORY_CUDA && stream) /* on the stream, unsynchronised: ordered by the
                                               grads-ready record of the register */
      CUDA_CHECK(cudaMemcpyAsync(t->pbuf, t->hp, t->pbytes, cudaMemcpyHostToDevice, stream));
    else if (memory == ZD_MEMORY_CUDA)
      CUDA_CHECK(cudaMemcpy(t->pbuf, t->hp, t->pbytes, cudaMemcpyHostToDevice));
  }
  CHECK_MSG(zd_register(t->c) == ZD_OK, "register: %s", zd_last_error());
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(t->c, &info);
  CHECK_INT_EQ(info.resumed, expect_resumed);
  CHECK_U64_EQ(info.step, (uint64_t)step);
  CHECK_MSG(info.nbuckets >= 2, "bucket_elems 256 should give several buckets, got %u",
            info.nbuckets);
}

static void detach(trainer_t *t) {
  if (t->memory == ZD_MEMORY_CUDA) {
    if (t->stream) CUDA_CHECK(cudaStreamSynchronize(t->stream));
    CUDA_CHECK(cudaFreeHost(t->hp));
    CUDA_CHECK(cudaFreeHost(t->hg));
  }
  zd_close(t->c);
  t->c = NULL;
}

/* The param buffer into t->hp (after the last reply: ordered by the params-ready event). */
static void fetch_params(trainer_t *t) {
  if (t->memory != ZD_MEMORY_CUDA) return;
  if (t->stream) {
    CUDA_CHECK(cudaMemcpyAsync(t->hp, t->pbuf, t->pbytes, cudaMemcpyDeviceToHost, t->stream));
    CUDA_CHECK(cudaStreamSynchronize(t->stream));
  } else {
    CUDA_CHECK(cudaMemcpy(t->hp, t->pbuf, t->pbytes, cudaMemcpyDeviceToHost));
  }
}

/* Elements [off, off + n) of t->hg into the grad buffer, queued on `stream` without waiting (a
 * user stream; NULL: a synchronous copy), behind a host callback of *delay_ms when not 0. */
static void push_range(trainer_t *t, cudaStream_t stream, int *delay_ms, uint64_t off, uint64_t n) {
  if (t->memory != ZD_MEMORY_CUDA) return;
  size_t sz = zd_dtype_size(t->gdt);
  void *dst = (uint8_t *)t->gbuf + off * sz;
  const void *src = t->hg + off * sz;
  if (stream) {
    if (delay_ms && *delay_ms) CUDA_CHECK(cudaLaunchHostFunc(stream, sleep_cb, delay_ms));
    CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sz, cudaMemcpyHostToDevice, stream));
  } else {
    CUDA_CHECK(cudaMemcpy(dst, src, n * sz, cudaMemcpyHostToDevice));
  }
}

/* t->hg into the grad buffer, on the trainer's stream. */
static void push_grads(trainer_t *t) {
  push_range(t, t->stream, &t->delay_ms, 0, t->gbytes / zd_dtype_size(t->gdt));
}

/* Gradients of the batch of `step` at the parameters in t->hp, times scale, into t->hg. */
static float make_grads(trainer_t *t, int step, double scale, int poison) {
  float work[MLP_NPARAMS][MAXN], grad[MLP_NPARAMS][MAXN];
  float *p[MLP_NPARAMS], *g[MLP_NPARAMS];
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(t->c, (size_t)i, &info);
    p[i] = work[i];
    g[i] = grad[i];
    for (uint64_t k = 0; k < info.numel; k++) work[i][k] = zdt_load(t->hp, t->pdt, info.offset + k);
  }
  float loss = mlp_loss_grad((const float *const *)p, g, (uint64_t)step, 0);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(t->c, (size_t)i, &info);
    for (uint64_t k = 0; k < info.numel; k++)
      zdt_store(t->hg, t->gdt, info.offset + k, (float)(grad[i][k] * scale));
  }
  if (poison) { /* an overflow in the middle of fc1.weight */
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(t->c, 0, &info);
    zdt_store(t->hg, t->gdt, info.offset + 77, INFINITY);
  }
  return loss;
}

/* ---- 1. against the reference kernel --------------------------------------------------------- */

typedef struct reference {
  float master[MLP_NPARAMS][MAXN];
  float m[MLP_NPARAMS][MAXN];
  float v[MLP_NPARAMS][MAXN];
} reference_t;

/* The reference starts from what zerod took (and gathered back): the initial values. */
static void ref_init(reference_t *ref, trainer_t *t) {
  memset(ref, 0, sizeof *ref);
  fetch_params(t);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(t->c, (size_t)i, &info);
    for (uint64_t k = 0; k < info.numel; k++)
      ref->master[i][k] = zdt_load(t->hp, t->pdt, info.offset + k);
  }
}

/* One reference step on the gradients as zerod read them (t->hg). */
static void ref_step(reference_t *ref, const trainer_t *t, const zd_group_t groups[2], int step) {
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(t->c, (size_t)i, &info);
    float gq[MAXN];
    for (uint64_t k = 0; k < info.numel; k++) gq[k] = zdt_load(t->hg, t->gdt, info.offset + k);
    zdt_ref_step(ref->master[i], ref->m[i], ref->v[i], gq, info.numel, &groups[info.group],
                 (uint64_t)step + 1, 1.0f);
  }
}

static void compare_ref(const trainer_t *t, const reference_t *ref, int step) {
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(t->c, (size_t)i, &info);
    for (uint64_t k = 0; k < info.numel; k++) {
      float want = ref->master[i][k];
      if (t->pdt == ZD_BF16) want = zd__bf16_to_f32(zd__f32_to_bf16(want));
      float got = zdt_load(t->hp, t->pdt, info.offset + k);
      uint32_t gb, wb;
      memcpy(&gb, &got, 4);
      memcpy(&wb, &want, 4);
      CHECK_MSG(gb == wb,
                "step %d: %s[%llu] is %.9g (0x%08x) through zerod (%s), %.9g (0x%08x) in the "
                "reference",
                step, info.name, (unsigned long long)k, got, gb, dev_backend, want, wb);
    }
  }
}

static void check_status(zd_client_t *c, int steps) {
  char *status, want[64];
  CHECK_INT_EQ(zd_status(c, &status), ZD_OK);
  snprintf(want, sizeof want, "backend:%s\n", dev_backend);
  CHECK_CONTAINS(status, want);
  snprintf(want, sizeof want, "step:%d\n", steps);
  CHECK_CONTAINS(status, want);
  CHECK_CONTAINS(status, "health:ok\n");
  free(status);
}

static cudaStream_t new_stream(void) {
  cudaStream_t s = NULL;
  if (dev_memory == ZD_MEMORY_CUDA)
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

static void free_stream(cudaStream_t s) {
  if (s) CUDA_CHECK(cudaStreamDestroy(s));
}

static void train_vs_reference(const char *socket, zd_dtype_t pdt, zd_dtype_t gdt, int own_stream,
                               int delay_ms) {
  printf("training %s params, %s grads, %s%s\n", zd_dtype_name(pdt), zd_dtype_name(gdt),
         own_stream ? "own stream" : "default stream",
         delay_ms ? ", gradients queued behind a host callback" : "");
  options_t o = {.pdt = pdt, .gdt = gdt, .steps = STEPS};
  cudaStream_t stream = own_stream ? new_stream() : NULL;
  trainer_t t;
  attach(&t, socket, dev_memory, &o, 0, 0, stream, delay_ms);
  static reference_t ref;
  ref_init(&ref, &t);
  float first = 0, loss = 0;
  for (int step = 0; step < STEPS; step++) {
    if (step == REATTACH_AT) {
      detach(&t);
      attach(&t, socket, dev_memory, &o, step, 1, stream, delay_ms);
      fetch_params(&t);
      compare_ref(&t, &ref, step);
    }
    loss = make_grads(&t, step, 1.0, 0);
    if (step == 0) first = loss;
    push_grads(&t);
    zd_group_t groups[2];
    groups_at(step, STEPS, groups);
    zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
    opts.groups = groups;
    opts.ngroups = 2;
    zd_step_result_t res = ZD_STEP_RESULT_INIT;
    CHECK_MSG(zd_step(t.c, &opts, &res) == ZD_OK, "step %d: %s", step, zd_last_error());
    CHECK_U64_EQ(res.step, (uint64_t)step + 1);
    CHECK_INT_EQ(res.applied, 1);
    CHECK_MSG(isnan(res.grad_norm),
              "step %d: grad_norm %g; expected nan (no statistics at W=1 "
              "without clipping or loss scaling)",
              step, res.grad_norm);
    ref_step(&ref, &t, groups, step);
    fetch_params(&t);
    compare_ref(&t, &ref, step + 1);
  }
  printf("  loss %.6f -> %.6f after %d steps, every parameter bitwise equal to the reference\n",
         first, loss, STEPS);
  CHECK_MSG(loss < first * 0.5f, "loss did not fall: %g -> %g", first, loss);
  check_status(t.c, STEPS);
  detach(&t);
  free_stream(stream);
}

/* ---- 6. checkpoint and resume ------------------------------------------------------------------
 */

static void step_vs_reference(trainer_t *t, reference_t *ref, const options_t *o, int step) {
  make_grads(t, step, 1.0, 0);
  push_grads(t);
  zd_group_t groups[2];
  groups_at(step, o->steps, groups);
  zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
  opts.groups = groups;
  opts.ngroups = 2;
  zd_step_result_t res = ZD_STEP_RESULT_INIT;
  CHECK_MSG(zd_step(t->c, &opts, &res) == ZD_OK, "step %d: %s", step, zd_last_error());
  ref_step(ref, t, groups, step);
  fetch_params(t);
  compare_ref(t, ref, step + 1);
}

static void checkpoint_and_resume(const char *backend) {
  enum { AT = 30, AFTER = 10 };
  printf("checkpoint at step %d on the %s backend, SIGKILL, resume\n", AT, backend);
  char dir[] = "/tmp/zd-gpu-ckpt-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  const char *args[] = {
      "--backend", backend, "--bucket_elems", "256", "--checkpoint-dir", dir, NULL, NULL, NULL};
  zdt_daemon_t d;
  zdt_start(&d, args);
  options_t o = {.pdt = ZD_F32, .gdt = ZD_F32, .steps = STEPS};
  trainer_t t;
  attach(&t, d.socket, dev_memory, &o, 0, 0, NULL, 0);
  static reference_t ref, at;
  ref_init(&ref, &t);
  for (int step = 0; step < AT; step++) step_vs_reference(&t, &ref, &o, step);
  uint64_t cstep = 0;
  char cdir[512];
  CHECK_MSG(zd_checkpoint(t.c, 0, &cstep, cdir, sizeof cdir) == ZD_OK, "zd_checkpoint: %s",
            zd_last_error());
  CHECK_U64_EQ(cstep, AT);
  CHECK_CONTAINS(cdir, dir);
  at = ref;
  for (int step = AT; step < AT + 2; step++) step_vs_reference(&t, &ref, &o, step); /* lost */
  zdt_stop(&d, SIGKILL, 0);
  detach(&t);
  args[6] = "--resume";
  args[7] = "latest";
  zdt_start(&d, args);
  attach(&t, d.socket, dev_memory, &o, AT, 1, NULL, 0); /* resumed, at step AT */
  fetch_params(&t);
  compare_ref(&t, &at, AT);
  for (int step = AT; step < AT + AFTER; step++) step_vs_reference(&t, &at, &o, step);
  CHECK_MSG(zdt_log_contains(&d, "resumed step 30"), "zerod did not log the resume");
  detach(&t);
  zdt_stop(&d, SIGTERM, 0);
  char rm[128];
  snprintf(rm, sizeof rm, "rm -rf %s", dir);
  CHECK_INT_EQ(system(rm), 0);
  printf("  resumed at step %d from %s; %d more steps bitwise equal to the reference\n", AT, cdir,
         AFTER);
}

/* ---- 2. pipelined requests on several streams ------------------------------------------------ */

/* A host function that holds its stream until the host opens it (at most 10 s, then it gives up
 * and says so). */
typedef struct gate {
  atomic_int open;
  atomic_int timed_out;
} gate_t;

static void gate_cb(void *arg) {
  gate_t *g = arg;
  for (int i = 0; i < 10000 && !atomic_load(&g->open); i++) sleep_ms(1);
  if (!atomic_load(&g->open)) atomic_store(&g->timed_out, 1);
}

static void train_pipelined(const char *socket, zd_dtype_t pdt, zd_dtype_t gdt) {
  printf("pipelined: %s params, %s grads, per-bucket scatters and gathers on 3 streams\n",
         zd_dtype_name(pdt), zd_dtype_name(gdt));
  options_t o = {.pdt = pdt, .gdt = gdt, .steps = PIPE_STEPS};
  cudaStream_t s0 = new_stream(), s1 = new_stream(), s2 = new_stream();
  trainer_t t;
  attach(&t, socket, dev_memory, &o, 0, 0, s2, 0);
  static reference_t ref;
  ref_init(&ref, &t);
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(t.c, &info);
  uint32_t nb = info.nbuckets;
  CHECK_MSG(nb >= 2 && nb <= 16, "%u buckets", nb);
  static gate_t gate; /* read by a host callback later: not on the stack */
  int ngated = 0;
  for (int step = 0; step < PIPE_STEPS; step++) {
    make_grads(&t, step, 1.0, 0);
    /* Slow steps: the last bucket on s2 behind 100 ms, then (20 ms later, when zerod has begun
     * that scatter) bucket 0 on s1 behind 300 ms, the others on s0; the step and the gathers on
     * s2. Each scatter must wait for its own stream's upload, whatever stream the requests after
     * it use, or the step reads a bucket's old gradients.
     * Gated steps (the ring of event pairs): the last bucket on s1 behind 200 ms, the others on
     * s0 without delay, then on s2 a host callback that holds s2 until the host has the reply of
     * bucket 0's scatter, and the step and the gathers on s2 behind it. zerod begins bucket 0's
     * scatter 200 ms late, when the step's and the gathers' records exist: its wait must be on
     * its own request's record only. A wait on a later record (one event for every request)
     * waits for the gate, which waits for that scatter's reply: a deadlock, broken only by the
     * gate's 10 s timeout. */
    int slow = step % 4 == 1, gated = step % 4 == 3;
    static int d_last = 100, d_first = 300, d_gated = 200; /* read by host callbacks later */
    zd_request_t req[64];
    int nreq = 0, bucket0_req = -1;
    for (uint32_t k = 0; k < nb; k++) {
      uint32_t b = k == 0 ? nb - 1 : k - 1; /* the last bucket first, then 0, 1, ... */
      cudaStream_t s;
      int *delay = NULL;
      if (gated) {
        s = b == nb - 1 ? s1 : s0;
        delay = b == nb - 1 ? &d_gated : NULL;
      } else {
        s = b == nb - 1 ? s2 : b == 0 ? s1 : s0;
        delay = !slow ? NULL : b == nb - 1 ? &d_last : b == 0 ? &d_first : NULL;
      }
      zd_bucket_info_t bi = ZD_BUCKET_INFO_INIT;
      CHECK_INT_EQ(zd_bucket_info(t.c, b, &bi), ZD_OK);
      push_range(&t, s, delay, bi.offset, bi.elems);
      if (dev_memory == ZD_MEMORY_CUDA)
        CHECK_MSG(zd_set_stream(t.c, s) == ZD_OK, "zd_set_stream: %s", zd_last_error());
      if (b == 0) bucket0_req = nreq;
      CHECK_MSG(zd_scatter_start(t.c, (int)b, &req[nreq++]) == ZD_OK, "step %d: scatter %u: %s",
                step, b, zd_last_error());
      if (k == 0 && slow) sleep_ms(20);
    }
    if (gated) {
      atomic_store(&gate.open, 0);
      atomic_store(&gate.timed_out, 0);
      if (dev_memory == ZD_MEMORY_CUDA) CUDA_CHECK(cudaLaunchHostFunc(s2, gate_cb, &gate));
    }
    if (dev_memory == ZD_MEMORY_CUDA)
      CHECK_MSG(zd_set_stream(t.c, s2) == ZD_OK, "zd_set_stream: %s", zd_last_error());
    zd_group_t groups[2];
    groups_at(step, PIPE_STEPS, groups);
    zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
    opts.groups = groups;
    opts.ngroups = 2;
    opts.flags = ZD_STEP_NO_SCATTER | ZD_STEP_NO_GATHER;
    int step_req = nreq;
    CHECK_MSG(zd_step_start(t.c, &opts, &req[nreq++]) == ZD_OK, "step %d: %s", step,
              zd_last_error());
    for (int b = (int)nb - 1; b >= 0; b--)
      CHECK_MSG(zd_gather_start(t.c, b, &req[nreq++]) == ZD_OK, "step %d: gather %d: %s", step, b,
                zd_last_error());
    int waited = -1;
    if (gated) { /* bucket 0's scatter first: its reply opens the gate */
      CHECK_MSG(zd_wait(t.c, req[bucket0_req], NULL) == ZD_OK, "step %d: scatter 0: %s", step,
                zd_last_error());
      atomic_store(&gate.open, 1);
      waited = bucket0_req;
    }
    for (int i = nreq - 1; i >= 0; i--) { /* the reverse order of the requests */
      if (i == waited) continue;
      zd_step_result_t res = ZD_STEP_RESULT_INIT;
      int rc = zd_wait(t.c, req[i], &res);
      CHECK_MSG(rc == ZD_OK, "step %d: request %d of %d: %s", step, i, nreq, zd_last_error());
      if (i == step_req) {
        CHECK_U64_EQ(res.step, (uint64_t)step + 1);
        CHECK_INT_EQ(res.applied, 1);
      }
    }
    if (gated) {
      CHECK_MSG(!atomic_load(&gate.timed_out),
                "step %d: the gate on s2 (before the step and the gathers) was not opened within "
                "10 s: zerod's scatter of bucket 0 waited for work queued after that request, "
                "behind the gate (the requests do not have event slots of their own)",
                step);
      ngated++;
    }
    ref_step(&ref, &t, groups, step);
    t.stream = s2; /* the stream of the replies */
    fetch_params(&t);
    compare_ref(&t, &ref, step + 1);
    if (dev_memory == ZD_MEMORY_CUDA) { /* t.hg is rewritten next: its copies must be done */
      CUDA_CHECK(cudaStreamSynchronize(s0));
      CUDA_CHECK(cudaStreamSynchronize(s1));
    }
  }
  printf("  %d steps (%d gated), %u buckets, every parameter bitwise equal to the reference\n",
         PIPE_STEPS, ngated, nb);
  check_status(t.c, PIPE_STEPS);
  detach(&t);
  free_stream(s0);
  free_stream(s1);
  free_stream(s2);
}

/* ---- 3. against the CPU backend -------------------------------------------------------------- */

static uint64_t dbits(double d) {
  uint64_t u;
  memcpy(&u, &d, sizeof u);
  return u;
}

static void lockstep(const char *dev_socket, const char *cpu_socket, const options_t *o,
                     const int *poison_steps, int npoison) {
  printf("lockstep with the CPU backend: %s params, %s grads, max_grad_norm %g, loss scaling %s\n",
         zd_dtype_name(o->pdt), zd_dtype_name(o->gdt), o->max_grad_norm,
         o->scaler.enabled ? "on" : "off");
  cudaStream_t stream = new_stream();
  trainer_t g, h;
  attach(&g, dev_socket, dev_memory, o, 0, 0, stream, 0);
  attach(&h, cpu_socket, ZD_MEMORY_HOST, o, 0, 0, NULL, 0);
  double scale = o->scaler.enabled ? o->scaler.initial_scale : 1.0;
  int skipped = 0, clipped = 0;
  for (int step = 0; step < o->steps; step++) {
    fetch_params(&g);
    CHECK_MSG(memcmp(g.hp, h.hp, g.pbytes) == 0, "step %d: the param buffers differ", step);
    int poison = 0;
    for (int i = 0; i < npoison; i++) poison |= poison_steps[i] == step;
    make_grads(&h, step, scale, poison);
    memcpy(g.hg, h.hg, g.gbytes);
    push_grads(&g);
    zd_group_t groups[2];
    groups_at(step, o->steps, groups);
    zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
    opts.groups = groups;
    opts.ngroups = 2;
    zd_step_result_t rg = ZD_STEP_RESULT_INIT, rh = ZD_STEP_RESULT_INIT;
    CHECK_MSG(zd_step(g.c, &opts, &rg) == ZD_OK, "step %d (%s): %s", step, dev_backend,
              zd_last_error());
    CHECK_MSG(zd_step(h.c, &opts, &rh) == ZD_OK, "step %d (CPU): %s", step, zd_last_error());
    CHECK_MSG(rg.step == rh.step && rg.applied == rh.applied,
              "step %d: %s step %llu applied %d, "
              "CPU step %llu applied %d",
              step, dev_backend, (unsigned long long)rg.step, rg.applied,
              (unsigned long long)rh.step, rh.applied);
    CHECK_MSG(dbits(rg.grad_norm) == dbits(rh.grad_norm),
              "step %d: grad_norm %.17g (%s) vs "
              "%.17g (CPU)",
              step, rg.grad_norm, dev_backend, rh.grad_norm);
    CHECK_MSG(
        dbits(rg.loss_scale) == dbits(rh.loss_scale) && dbits(rg.clip_coef) == dbits(rh.clip_coef),
        "step %d: loss_scale %.17g / %.17g, clip_coef %.17g / %.17g (%s / CPU)", step,
        rg.loss_scale, rh.loss_scale, rg.clip_coef, rh.clip_coef, dev_backend);
    CHECK_MSG(!isnan(rg.grad_norm) || !rg.applied, "step %d: no grad_norm with statistics", step);
    if (poison) CHECK_MSG(!rg.applied, "step %d: an inf gradient was applied", step);
    skipped += !rg.applied;
    clipped += rg.clip_coef < 1.0;
    scale = rg.loss_scale;
  }
  fetch_params(&g);
  CHECK_MSG(memcmp(g.hp, h.hp, g.pbytes) == 0, "after %d steps: the param buffers differ",
            o->steps);
  printf(
      "  %d steps equal bit for bit (results and parameters): %d skipped, %d clipped, final "
      "loss scale %g\n",
      o->steps, skipped, clipped, scale);
  if (o->max_grad_norm > 0)
    CHECK_MSG(clipped > 0, "max_grad_norm %g never clipped", o->max_grad_norm);
  if (npoison)
    CHECK_MSG(skipped >= npoison, "%d overflows injected, %d steps skipped", npoison, skipped);
  detach(&g);
  detach(&h);
  free_stream(stream);
}

static void lockstep_all(const char *dev_socket, const char *cpu_socket) {
  zd_loss_scaler_t scaler = {.size = sizeof(zd_loss_scaler_t),
                             .enabled = 1,
                             .initial_scale = 65536,
                             .growth_factor = 2,
                             .backoff_factor = 0.5,
                             .growth_interval = 10,
                             .hysteresis = 2,
                             .min_scale = 1};
  const int poison[] = {15, 16, 40};
  options_t o1 = {
      .pdt = ZD_F32, .gdt = ZD_F16, .steps = 80, .max_grad_norm = 0.5, .scaler = scaler};
  lockstep(dev_socket, cpu_socket, &o1, poison, 3);
  options_t o2 = {.pdt = ZD_BF16, .gdt = ZD_F32, .steps = 60, .max_grad_norm = 0.3};
  lockstep(dev_socket, cpu_socket, &o2, NULL, 0);
  options_t o3 = {.pdt = ZD_BF16, .gdt = ZD_BF16, .steps = 40, .scaler = scaler};
  lockstep(dev_socket, cpu_socket, &o3, poison, 1);
}

/* ---- 4. the library's CUDA manners ----------------------------------------------------------- */

static PFN_cuCtxGetCurrent_v4000 ctx_get;

static CUcontext current_ctx(void) {
  CUcontext ctx = (CUcontext)(uintptr_t)1;
  CUresult r = ctx_get(&ctx);
  CHECK_MSG(r == CUDA_SUCCESS, "cuCtxGetCurrent: CUresult %d", (int)r);
  return ctx;
}

/* A thread that never used CUDA: it has no current context, and must have none after libzerod's
 * calls (which record and wait on events). */
static void *bare_thread(void *arg) {
  zd_client_t *c = arg;
  CHECK_MSG(current_ctx() == NULL, "a new thread has a CUDA context");
  CHECK_MSG(zd_gather(c, ZD_ALL_BUCKETS) == ZD_OK, "gather from a bare thread: %s",
            zd_last_error());
  CHECK_MSG(current_ctx() == NULL,
            "libzerod left a CUDA context current on a thread that had none");
  return NULL;
}

static void manners(const char *socket, int ngpus) {
  printf("the caller's CUDA context and streams\n");
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult q;
  CUDA_CHECK(
      cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault, &q));
  CHECK(q == cudaDriverEntryPointSuccess && fn);
  ctx_get = (PFN_cuCtxGetCurrent_v4000)fn;
  options_t o = {.pdt = ZD_F32, .gdt = ZD_F32, .steps = 1};
  trainer_t t;
  attach(&t, socket, ZD_MEMORY_CUDA, &o, 0, 0, NULL, 0);
  pthread_t th;
  CHECK(pthread_create(&th, NULL, bare_thread, t.c) == 0);
  CHECK(pthread_join(th, NULL) == 0);
  printf("  a thread without a CUDA context still has none after a request\n");

  CUDA_CHECK(cudaSetDevice(0));
  CUcontext before = current_ctx();
  CHECK_MSG(zd_gather(t.c, ZD_ALL_BUCKETS) == ZD_OK, "%s", zd_last_error());
  CHECK_MSG(current_ctx() == before, "libzerod changed the caller's current context");

  /* A stream being captured into a graph: the request is refused before it is sent. */
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CHECK_MSG(zd_set_stream(t.c, s) == ZD_OK, "%s", zd_last_error());
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  int rc = zd_gather(t.c, ZD_ALL_BUCKETS);
  cudaGraph_t graph;
  CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CHECK_INT_EQ(rc, -EINVAL);
  CHECK_CONTAINS(zd_last_error(), "captured");
  printf("  request on a capturing stream: %s\n", zd_last_error());
  CHECK_MSG(zd_gather(t.c, ZD_ALL_BUCKETS) == ZD_OK, "after the capture: %s", zd_last_error());
  CHECK_MSG(zd_set_stream(t.c, NULL) == ZD_OK, "%s", zd_last_error());
  CUDA_CHECK(cudaStreamSynchronize(s));
  CUDA_CHECK(cudaStreamDestroy(s));

  if (ngpus >= 2) {
    CUDA_CHECK(cudaSetDevice(1));
    cudaStream_t other;
    CUDA_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
    CHECK_INT_EQ(zd_set_stream(t.c, other), -EINVAL);
    printf("  a stream of GPU 1: %s\n", zd_last_error());
    CUcontext ctx1 = current_ctx();
    CHECK_MSG(zd_gather(t.c, ZD_ALL_BUCKETS) == ZD_OK, "%s", zd_last_error());
    int dev = -1;
    CUDA_CHECK(cudaGetDevice(&dev));
    CHECK_INT_EQ(dev, 1);
    CHECK_MSG(current_ctx() == ctx1, "libzerod changed the caller's context (GPU 1)");
    printf("  the caller's current GPU 1 is kept across a request on GPU 0's buffers\n");
    CUDA_CHECK(cudaStreamDestroy(other));
    CUDA_CHECK(cudaSetDevice(0));
  }
  detach(&t);
}

/* ---- 5. bad device buffers ------------------------------------------------------------------- */

/* A raw register of one f32 parameter of n elements with real IPC handles of p and g. */
static void raw_register(const char *socket, int device, uint64_t n, void *p, void *g, int expect,
                         const char *substr) {
  struct cudaDeviceProp prop;
  int rank_device = 0; /* zerod's rank 0: device 0 in this process too (same environment) */
  CUDA_CHECK(cudaGetDeviceProperties(&prop, rank_device));
  cudaIpcMemHandle_t ph, gh;
  /* the ring of event pairs, one per event slot: [0..63] grads ready, [64..127] params ready */
  static cudaIpcEventHandle_t eh[2 * ZD__EVENT_SLOTS];
  static cudaEvent_t ev[2 * ZD__EVENT_SLOTS];
  static ProtobufCBinaryData ehd[2 * ZD__EVENT_SLOTS];
  CUDA_CHECK(cudaSetDevice(device));
  CUDA_CHECK(cudaIpcGetMemHandle(&ph, p));
  CUDA_CHECK(cudaIpcGetMemHandle(&gh, g));
  for (int k = 0; k < 2 * ZD__EVENT_SLOTS; k++) {
    CUDA_CHECK(cudaEventCreateWithFlags(&ev[k], cudaEventDisableTiming | cudaEventInterprocess));
    CUDA_CHECK(cudaIpcGetEventHandle(&eh[k], ev[k]));
    ehd[k] = (ProtobufCBinaryData){sizeof eh[k], (uint8_t *)&eh[k]};
  }
  CUDA_CHECK(cudaSetDevice(0));

  zd_param_t param = {.name = "w", .ndim = 1, .shape = {n}, .group = 0};
  zd__layout_t *l = NULL;
  zd__err_t err = {0};
  CHECK_MSG(zd__layout_build(&param, 1, 1, 1, 256, &l, &err) == ZD_OK, "%s", err.msg);
  Zerod__V1__Param wp = ZEROD__V1__PARAM__INIT, *wpp = &wp;
  wp.name = (char *)"w";
  wp.n_shape = 1;
  wp.shape = &n;
  Zerod__V1__Group grp = ZEROD__V1__GROUP__INIT, *gp = &grp;
  grp.lr = 1e-3;
  grp.beta1 = 0.9;
  grp.beta2 = 0.999;
  grp.eps = 1e-8;
  Zerod__V1__CudaBuffers cb = ZEROD__V1__CUDA_BUFFERS__INIT;
  cb.has_device = cb.has_device_uuid = cb.has_param_handle = cb.has_grad_handle = 1;
  cb.device = rank_device;
  cb.device_uuid = (ProtobufCBinaryData){16, (uint8_t *)prop.uuid.bytes};
  cb.param_handle = (ProtobufCBinaryData){sizeof ph, (uint8_t *)&ph};
  cb.grad_handle = (ProtobufCBinaryData){sizeof gh, (uint8_t *)&gh};
  cb.n_grads_ready = cb.n_params_ready = ZD__EVENT_SLOTS;
  cb.grads_ready = ehd;
  cb.params_ready = ehd + ZD__EVENT_SLOTS;
  Zerod__V1__RegisterRequest req = ZEROD__V1__REGISTER_REQUEST__INIT;
  req.n_params = 1;
  req.params = &wpp;
  req.n_groups = 1;
  req.groups = &gp;
  req.param_dtype = ZEROD__V1__DTYPE__F32;
  req.grad_dtype = ZEROD__V1__DTYPE__F32;
  req.layout_hash = l->hash;
  req.has_replace = 1;
  req.replace = 1;
  req.cuda = &cb;
  req.has_event_slot = 1;
  req.event_slot = 0;
  static uint8_t buf[32768];
  CHECK(zerod__v1__register_request__get_packed_size(&req) <= sizeof buf);
  size_t len = zerod__v1__register_request__pack(&req, buf);
  int fd = zdt_raw_connect(socket);
  CHECK(fd >= 0);
  zdt_raw_hello(fd, 1);
  zdt_raw_request(fd, ZD__MSG_REGISTER, 2, buf, (uint32_t)len);
  printf("  %s\n", zdt_expect_error(fd, 2, expect, substr));
  close(fd);
  zd__layout_free(l);
  for (int k = 0; k < 2 * ZD__EVENT_SLOTS; k++) CUDA_CHECK(cudaEventDestroy(ev[k]));
}

static void bad_buffers(const char *socket, int ngpus) {
  printf("bad device buffers\n");
  const uint64_t n = 1u << 20; /* 4 MiB of f32 params and grads; 2 MiB buffers are too small */
  void *small, *big;
  CUDA_CHECK(cudaSetDevice(0));
  CUDA_CHECK(cudaMalloc(&small, 2u << 20));
  CUDA_CHECK(cudaMalloc(&big, 4u << 20));
  raw_register(socket, 0, n, small, big, ZD_EBUFFER,
               "param buffer is 2097152 bytes, layout needs 4194304");
  raw_register(socket, 0, n, big, small, ZD_EBUFFER,
               "grad buffer is 2097152 bytes, layout needs 4194304");
  if (ngpus >= 2) { /* memory of GPU 1 said to be on the rank's GPU 0 */
    void *other;
    CUDA_CHECK(cudaSetDevice(1));
    CUDA_CHECK(cudaMalloc(&other, 4u << 20));
    /* refused when opened (no peer access between the GPUs) or when zerod sees where it is */
    raw_register(socket, 1, n, other, big, ZD_EBUFFER, "GPU 0");
    CUDA_CHECK(cudaFree(other));
    CUDA_CHECK(cudaSetDevice(0));
    /* and through libzerod: the buffers' device is not the rank's */
    zd_client_t *c;
    CHECK_MSG(zd_connect(socket, ZD_ANY_RANK, 0, &c) == ZD_OK, "%s", zd_last_error());
    zd_group_t g[2];
    zd_group_init(g, 2, sizeof g[0]);
    zd_model_desc_t desc = zdt_mlp_desc(g, 2);
    desc.memory = ZD_MEMORY_CUDA;
    desc.device = 1;
    CHECK_INT_EQ(zd_layout(c, &desc), ZD_EBUFFER);
    printf("  zd_layout on device 1: %s\n", zd_last_error());
    zd_close(c);
  } else {
    printf("  (one GPU: a buffer on another GPU is checked with a forged UUID by test_backend)\n");
  }
  CUDA_CHECK(cudaFree(small));
  CUDA_CHECK(cudaFree(big));
}

/* On a failed check: the daemons' logs (CUDA errors are logged there with file:line), and no
 * daemon left behind. */
static zdt_daemon_t gd, cd;
static int passed;

static void on_exit_dump(void) {
  if (passed) return;
  if (gd.pid > 0) {
    fprintf(stderr, "test_train_cuda failed; the logs of both zerods follow\n");
    zdt_dump_log(&gd);
    kill(gd.pid, SIGKILL);
  }
  if (cd.pid > 0) {
    zdt_dump_log(&cd);
    kill(cd.pid, SIGKILL);
  }
}

/* Without a GPU: the same runs against CPU zerods with host buffers, then skipped. */
static void rehearse(const char *why) {
  printf("no usable GPU (%s): rehearsing the test's logic against the CPU backend\n", why);
  dev_memory = ZD_MEMORY_HOST;
  dev_backend = "cpu";
  const char *cargs[] = {"--backend", "cpu", "--bucket_elems", "256", NULL};
  zdt_start(&gd, cargs);
  zdt_start(&cd, cargs);
  atexit(on_exit_dump);
  train_vs_reference(gd.socket, ZD_F32, ZD_F32, 0, 0);
  train_vs_reference(gd.socket, ZD_BF16, ZD_F16, 0, 0);
  train_pipelined(gd.socket, ZD_BF16, ZD_BF16);
  lockstep_all(gd.socket, cd.socket);
  checkpoint_and_resume("cpu");
  zdt_stop(&gd, SIGTERM, 0);
  zdt_stop(&cd, SIGTERM, 0);
  passed = 1;
}

int main(void) {
  char why[1024];
  int ngpus = zd__cuda_available(why, sizeof why);
  if (ngpus == 0) {
    rehearse(why);
    printf("test_train_cuda: skipped (the logic passed on host buffers), CUDA unusable: %s\n", why);
    return ZD_TEST_SKIP;
  }
  struct cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("GPU 0: %s, %d usable GPU(s)\n", prop.name, ngpus);
  const char *gargs[] = {"--backend", "cuda", "--bucket_elems", "256", NULL};
  const char *cargs[] = {"--backend", "cpu", "--bucket_elems", "256", NULL};
  zdt_start(&gd, gargs);
  zdt_start(&cd, cargs);
  atexit(on_exit_dump);
  for (int i = 0; i < 3000 && !zdt_log_contains(&gd, "NCCL communicator of 1 rank(s) ready"); i++)
    usleep(10000);
  CHECK_MSG(zdt_log_contains(&gd, "NCCL communicator of 1 rank(s) ready"),
            "the CUDA rank did not come up within 30 s; see zerod's log");

  train_vs_reference(gd.socket, ZD_F32, ZD_F32, 0, 0);
  train_vs_reference(gd.socket, ZD_BF16, ZD_BF16, 1, 50);
  train_vs_reference(gd.socket, ZD_BF16, ZD_F32, 1, 0);
  train_vs_reference(gd.socket, ZD_F32, ZD_F16, 0, 0);
  train_vs_reference(gd.socket, ZD_BF16, ZD_F16, 1, 0);
  train_pipelined(gd.socket, ZD_BF16, ZD_BF16);
  train_pipelined(gd.socket, ZD_F32, ZD_F16);
  lockstep_all(gd.socket, cd.socket);
  manners(gd.socket, ngpus);
  bad_buffers(gd.socket, ngpus);
  checkpoint_and_resume("cuda");

  char *status;
  zd_client_t *c;
  CHECK_MSG(zd_connect(gd.socket, ZD_ANY_RANK, 0, &c) == ZD_OK, "%s", zd_last_error());
  CHECK_INT_EQ(zd_status(c, &status), ZD_OK);
  CHECK_CONTAINS(status, "health:ok\n"); /* refused registers do not degrade the rank */
  free(status);
  zd_close(c);
  CHECK_MSG(!zdt_log_contains(&gd, " ERROR "), "the CUDA zerod logged errors");
  zdt_stop(&gd, SIGTERM, 1);
  zdt_stop(&cd, SIGTERM, 0);
  passed = 1;
  zdt_stop(&gd, SIGTERM, 0); /* its directory, kept for the log until here */
  printf("test_train_cuda: ok\n");
  return 0;
}
