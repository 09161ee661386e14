/* Every optimizer of the table through a real zerod running its CUDA backend (device buffers,
 * CUDA IPC, world size 1), in lockstep with a zerod running its CPU backend on the same
 * gradients, with parameters without a gradient (zd_step_opts_t.absent) on some steps: after
 * every step both param buffers must be equal bit for bit, the steps' results too, a parameter
 * absent this step must be left exactly as it was (skipped, not stepped with a zero gradient),
 * and both zerods must count the same lagging parameters (status params_lagging).
 *
 * Runs (the example MLP, groups 0 and 1, 16 steps each): SGD with nesterov and SGD with
 * dampening and maximize; Adagrad twice (lr_decay) with clipping; RMSprop centered with momentum
 * (torch 2) and plain (1.13) with clipping; Lion with AdamW (two kernel families in one model);
 * AdamW with Adam and clipping; SGD with Adagrad. Params f32 or bf16, gradients f32, bf16 or f16.
 * Absence: fc1.bias on odd steps from step 3, fc2.weight on steps 6 to 9 (a frozen layer), fc2.bias
 * at step 11; steps 0 to 2 have every gradient, so that a run with clipping takes the device's
 * decision (cuda_step fast) until the first absence and the host's after it (per-parameter step
 * counts: daemon/step/step.c, device_path_ok); the runs with clipping run again against a CUDA
 * zerod with cuda_step legacy (every step decided on the host).
 *
 * Without a usable GPU the same runs go against two CPU zerods with host buffers (the test's
 * logic), and the test then exits 77 (skipped).
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "adam_cuda.h"
#include "check.h"
#include "dtype_ref.h"
#include "gpu_check.h"
#include "harness.h"
#include "mlp.h"
#include "zerod/zerod.h"

#define STEPS 16
#define MAXN  (MLP_HIDDEN * MLP_IN)

static zd_memory_t dev_memory = ZD_MEMORY_CUDA;
static const char *dev_backend = "cuda";

typedef struct trainer {
  zd_client_t *c;
  zd_memory_t memory;
  zd_dtype_t pdt, gdt;
  void *pbuf, *gbuf;
  size_t pbytes, gbytes;
  uint8_t *hp, *hg; /* pinned staging of device buffers, or the host buffers themselves */
  zd_param_info_t info[MLP_NPARAMS];
} trainer_t;

typedef struct run {
  const char *name;
  zd_group_t groups[2];
  zd_dtype_t pdt, gdt;
  double max_grad_norm;
} run_t;

static void attach(trainer_t *t, const char *socket, zd_memory_t memory, const run_t *r) {
  memset(t, 0, sizeof *t);
  t->memory = memory;
  t->pdt = r->pdt;
  t->gdt = r->gdt;
  CHECK_MSG(zd_connect(socket, ZD_ANY_RANK, 0, &t->c) == ZD_OK, "connect: %s", zd_last_error());
  int device = 0;
  if (memory == ZD_MEMORY_CUDA)
    CHECK_MSG(zd_cuda_device(t->c, &device) == ZD_OK, "zd_cuda_device: %s", zd_last_error());
  zd_model_desc_t desc = zdt_mlp_desc(r->groups, 2);
  desc.param_dtype = r->pdt;
  desc.grad_dtype = r->gdt;
  desc.max_grad_norm = r->max_grad_norm;
  desc.flags = ZD_REGISTER_REPLACE; /* the daemons are reused run after run */
  desc.memory = memory;
  desc.device = device;
  CHECK_MSG(zd_layout(t->c, &desc) == ZD_OK, "layout: %s", zd_last_error());
  t->pbuf = zd_param_buffer(t->c, &t->pbytes);
  t->gbuf = zd_grad_buffer(t->c, &t->gbytes);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    t->info[i] = (zd_param_info_t)ZD_PARAM_INFO_INIT;
    CHECK_INT_EQ(zd_param_info(t->c, (size_t)i, &t->info[i]), ZD_OK);
  }
  if (memory == ZD_MEMORY_CUDA) {
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaMallocHost((void **)&t->hp, t->pbytes));
    CUDA_CHECK(cudaMallocHost((void **)&t->hg, t->gbytes));
    memset(t->hp, 0, t->pbytes);
    memset(t->hg, 0, t->gbytes);
  } else {
    t->hp = t->pbuf;
    t->hg = t->gbuf;
  }
  float init[MLP_NPARAMS][MAXN];
  float *p[MLP_NPARAMS] = {init[0], init[1], init[2], init[3]};
  mlp_init(p, 7);
  for (int i = 0; i < MLP_NPARAMS; i++)
    for (uint64_t k = 0; k < t->info[i].numel; k++)
      zdt_store(t->hp, r->pdt, t->info[i].offset + k, init[i][k]);
  if (memory == ZD_MEMORY_CUDA)
    CUDA_CHECK(cudaMemcpy(t->pbuf, t->hp, t->pbytes, cudaMemcpyHostToDevice));
  CHECK_MSG(zd_register(t->c) == ZD_OK, "register: %s", zd_last_error());
}

static void detach(trainer_t *t) {
  if (t->memory == ZD_MEMORY_CUDA) {
    CUDA_CHECK(cudaFreeHost(t->hp));
    CUDA_CHECK(cudaFreeHost(t->hg));
  }
  zd_close(t->c);
  t->c = NULL;
}

/* The param buffer into t->hp (after the step's reply: ordered by its params-ready event). */
static void fetch_params(trainer_t *t) {
  if (t->memory == ZD_MEMORY_CUDA)
    CUDA_CHECK(cudaMemcpy(t->hp, t->pbuf, t->pbytes, cudaMemcpyDeviceToHost));
}

static void push_grads(trainer_t *t) {
  if (t->memory == ZD_MEMORY_CUDA)
    CUDA_CHECK(cudaMemcpy(t->gbuf, t->hg, t->gbytes, cudaMemcpyHostToDevice));
}

/* Whether parameter i has no gradient at step `step` (the schedule above). */
static int absent_at(int i, int step) {
  if (i == 1) return step >= 3 && step % 2 == 1;
  if (i == 2) return step >= 6 && step <= 9;
  if (i == 3) return step == 11;
  return 0;
}

/* The gradients of the batch of `step` at the parameters in t->hp into t->hg, zero for the
 * absent ones (as a client zeroes them), and the absent bitmap. */
static void make_grads(trainer_t *t, int step, uint8_t *absent) {
  float work[MLP_NPARAMS][MAXN], grad[MLP_NPARAMS][MAXN];
  float *p[MLP_NPARAMS], *g[MLP_NPARAMS];
  for (int i = 0; i < MLP_NPARAMS; i++) {
    p[i] = work[i];
    g[i] = grad[i];
    for (uint64_t k = 0; k < t->info[i].numel; k++)
      work[i][k] = zdt_load(t->hp, t->pdt, t->info[i].offset + k);
  }
  mlp_loss_grad((const float *const *)p, g, (uint64_t)step, 0);
  *absent = 0;
  for (int i = 0; i < MLP_NPARAMS; i++) {
    int none = absent_at(i, step);
    if (none) *absent |= (uint8_t)(1u << i);
    for (uint64_t k = 0; k < t->info[i].numel; k++)
      zdt_store(t->hg, t->gdt, t->info[i].offset + k, none ? 0.0f : grad[i][k]);
  }
}

static uint64_t dbits(double d) {
  uint64_t u;
  memcpy(&u, &d, sizeof u);
  return u;
}

/* The status line "params_lagging:<n>" of a client's rank. */
static long lagging(zd_client_t *c) {
  char *status;
  CHECK_INT_EQ(zd_status(c, &status), ZD_OK);
  const char *at = strstr(status, "params_lagging:");
  long n = at ? strtol(at + strlen("params_lagging:"), NULL, 10) : -1;
  free(status);
  return n;
}

static void lockstep(const char *dev_socket, const char *cpu_socket, const run_t *r) {
  printf("%s: %s params, %s grads, max_grad_norm %g\n", r->name, zd_dtype_name(r->pdt),
         zd_dtype_name(r->gdt), r->max_grad_norm);
  trainer_t g, h;
  attach(&g, dev_socket, dev_memory, r);
  attach(&h, cpu_socket, ZD_MEMORY_HOST, r);
  static uint8_t before[MAXN * 4 * MLP_NPARAMS];
  int skipped = 0;
  for (int step = 0; step < STEPS; step++) {
    fetch_params(&g);
    CHECK_MSG(memcmp(g.hp, h.hp, g.pbytes) == 0, "%s, step %d: the param buffers differ", r->name,
              step);
    CHECK(g.pbytes <= sizeof before);
    memcpy(before, h.hp, h.pbytes);
    uint8_t absent;
    make_grads(&h, step, &absent);
    memcpy(g.hg, h.hg, g.gbytes);
    push_grads(&g);
    zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
    opts.absent = &absent;
    zd_step_result_t rg = ZD_STEP_RESULT_INIT, rh = ZD_STEP_RESULT_INIT;
    CHECK_MSG(zd_step(g.c, &opts, &rg) == ZD_OK, "%s, step %d (%s): %s", r->name, step, dev_backend,
              zd_last_error());
    CHECK_MSG(zd_step(h.c, &opts, &rh) == ZD_OK, "%s, step %d (CPU): %s", r->name, step,
              zd_last_error());
    CHECK_MSG(rg.step == rh.step && rg.applied == rh.applied && rg.applied,
              "%s, step %d: %s step %llu applied %d, CPU step %llu applied %d", r->name, step,
              dev_backend, (unsigned long long)rg.step, rg.applied, (unsigned long long)rh.step,
              rh.applied);
    CHECK_MSG(
        dbits(rg.grad_norm) == dbits(rh.grad_norm) && dbits(rg.clip_coef) == dbits(rh.clip_coef),
        "%s, step %d: grad_norm %.17g / %.17g, clip_coef %.17g / %.17g (%s / CPU)", r->name, step,
        rg.grad_norm, rh.grad_norm, rg.clip_coef, rh.clip_coef, dev_backend);
    /* An absent parameter is skipped: its working parameters exactly as before the step. */
    for (int i = 0; i < MLP_NPARAMS; i++) {
      if (!absent_at(i, step)) continue;
      size_t sz = zd_dtype_size(r->pdt), off = h.info[i].offset * sz;
      CHECK_MSG(memcmp(before + off, h.hp + off, h.info[i].numel * sz) == 0,
                "%s, step %d: %s has no gradient and changed", r->name, step, h.info[i].name);
      skipped++;
    }
  }
  fetch_params(&g);
  CHECK_MSG(memcmp(g.hp, h.hp, g.pbytes) == 0, "%s, after %d steps: the param buffers differ",
            r->name, STEPS);
  long lg = lagging(g.c), lh = lagging(h.c);
  CHECK_MSG(lg == lh && lh == 3, "%s: params_lagging %ld (%s), %ld (CPU); expected 3", r->name, lg,
            dev_backend, lh);
  printf("  %d steps equal bit for bit, %d absent parameters skipped, 3 lagging\n", STEPS, skipped);
  detach(&g);
  detach(&h);
}

static zd_group_t group(zd_optimizer_t opt, double lr, double wd) {
  zd_group_t g;
  CHECK_INT_EQ(zd_group_init(&g, 1, sizeof g), ZD_OK);
  g.optimizer = opt;
  g.lr = lr;
  g.weight_decay = wd;
  return g;
}

static void all_runs(const char *dev_socket, const char *cpu_socket, int clipped_only) {
  run_t r;
  /* SGD: nesterov; dampening and maximize */
  r = (run_t){.name = "sgd", .pdt = ZD_F32, .gdt = ZD_F32};
  r.groups[0] = group(ZD_SGD, 0.05, 0.01);
  r.groups[0].momentum = 0.9, r.groups[0].nesterov = 1;
  r.groups[1] = group(ZD_SGD, 0.02, 0.001);
  r.groups[1].momentum = 0.5, r.groups[1].dampening = 0.2, r.groups[1].maximize = 1;
  if (!clipped_only) lockstep(dev_socket, cpu_socket, &r);
  /* Adagrad, with clipping */
  r = (run_t){.name = "adagrad", .pdt = ZD_BF16, .gdt = ZD_BF16, .max_grad_norm = 0.5};
  r.groups[0] = group(ZD_ADAGRAD, 0.05, 0.01);
  r.groups[0].initial_accumulator_value = 0.1;
  r.groups[1] = group(ZD_ADAGRAD, 0.02, 0);
  r.groups[1].lr_decay = 0.01, r.groups[1].eps = 1e-10;
  lockstep(dev_socket, cpu_socket, &r);
  /* RMSprop: centered with momentum (torch 2), plain (1.13), with clipping */
  r = (run_t){.name = "rmsprop", .pdt = ZD_F32, .gdt = ZD_F16, .max_grad_norm = 1.0};
  r.groups[0] = group(ZD_RMSPROP, 0.01, 0.01);
  r.groups[0].centered = 1, r.groups[0].momentum = 0.9, r.groups[0].update = ZD_UPDATE_TORCH2;
  r.groups[1] = group(ZD_RMSPROP, 0.005, 0);
  r.groups[1].alpha = 0.9;
  lockstep(dev_socket, cpu_socket, &r);
  /* Lion and AdamW in one model */
  r = (run_t){.name = "lion+adamw", .pdt = ZD_BF16, .gdt = ZD_F32};
  r.groups[0] = group(ZD_LION, 1e-3, 0.1);
  r.groups[0].beta1 = 0.9, r.groups[0].beta2 = 0.99;
  r.groups[1] = group(ZD_ADAMW, 3e-3, 0.01);
  if (!clipped_only) lockstep(dev_socket, cpu_socket, &r);
  /* AdamW and Adam, with clipping (their bias corrections per parameter) */
  r = (run_t){.name = "adamw+adam", .pdt = ZD_F32, .gdt = ZD_F32, .max_grad_norm = 0.5};
  r.groups[0] = group(ZD_ADAMW, 3e-3, 0.01);
  r.groups[1] = group(ZD_ADAM, 1e-3, 0.1);
  r.groups[1].update = ZD_UPDATE_TORCH2;
  lockstep(dev_socket, cpu_socket, &r);
  /* SGD and Adagrad in one model */
  r = (run_t){.name = "sgd+adagrad", .pdt = ZD_F32, .gdt = ZD_BF16};
  r.groups[0] = group(ZD_SGD, 0.05, 0.01);
  r.groups[0].momentum = 0.9;
  r.groups[1] = group(ZD_ADAGRAD, 0.05, 0.01);
  if (!clipped_only) lockstep(dev_socket, cpu_socket, &r);
}

static zdt_daemon_t gd, cd, ld;
static int passed;

static void on_exit_dump(void) {
  if (passed) return;
  if (gd.pid > 0) {
    fprintf(stderr, "test_optim_step_cuda failed; the logs of both zerods follow\n");
    zdt_dump_log(&gd);
    kill(gd.pid, SIGKILL);
  }
  if (cd.pid > 0) {
    zdt_dump_log(&cd);
    kill(cd.pid, SIGKILL);
  }
  if (ld.pid > 0) {
    zdt_dump_log(&ld);
    kill(ld.pid, SIGKILL);
  }
}

int main(void) {
  char why[1024];
  int ngpus = zd__cuda_available(why, sizeof why);
  const char *cargs[] = {"--backend", "cpu", "--bucket_elems", "256", NULL};
  const char *gargs[] = {"--backend", "cuda", "--bucket_elems", "256", NULL};
  if (ngpus == 0) {
    printf("no usable GPU (%s): rehearsing the test's logic against the CPU backend\n", why);
    dev_memory = ZD_MEMORY_HOST;
    dev_backend = "cpu";
  }
  zdt_start(&gd, ngpus ? gargs : cargs);
  zdt_start(&cd, cargs);
  atexit(on_exit_dump);
  if (ngpus) {
    for (int i = 0; i < 3000 && !zdt_log_contains(&gd, "NCCL communicator of 1 rank(s) ready"); i++)
      usleep(10000);
    CHECK_MSG(zdt_log_contains(&gd, "NCCL communicator of 1 rank(s) ready"),
              "the CUDA rank did not come up within 30 s; see zerod's log");
  }
  all_runs(gd.socket, cd.socket, 0);
  CHECK_MSG(!zdt_log_contains(&gd, " ERROR "), "the %s zerod logged errors", dev_backend);
  if (ngpus) { /* the runs with clipping again, every step decided on the host */
    const char *largs[] = {"--backend", "cuda", "--bucket_elems", "256", "--cuda_step",
                           "legacy",    NULL};
    zdt_start(&ld, largs);
    for (int i = 0; i < 3000 && !zdt_log_contains(&ld, "NCCL communicator of 1 rank(s) ready"); i++)
      usleep(10000);
    printf("cuda_step legacy:\n");
    all_runs(ld.socket, cd.socket, 1);
    CHECK_MSG(!zdt_log_contains(&ld, " ERROR "), "the legacy CUDA zerod logged errors");
    zdt_stop(&ld, SIGTERM, 0);
  }
  zdt_stop(&gd, SIGTERM, 0);
  zdt_stop(&cd, SIGTERM, 0);
  passed = 1;
  if (!ngpus) {
    printf("test_optim_step_cuda: skipped (the logic passed on host buffers), CUDA unusable: %s\n",
           why);
    return ZD_TEST_SKIP;
  }
  printf("test_optim_step_cuda: ok\n");
  return 0;
}
