/* Trains the example MLP through a real zerod for 120 steps and, in this process, with the scalar
 * reference kernel; after every step every working parameter must be bitwise equal. Covers fp32
 * and bf16 working params, fp32/bf16/fp16 gradients, AdamW and Adam groups, an lr schedule, a
 * small bucket size (several buckets), and a client that disconnects halfway and reattaches: the
 * daemon must resume at the same step with the same master weights and moments. A grad_reduce
 * that is neither mean nor sum is refused by zd_layout. */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "adam.h"
#include "check.h"
#include "dtype_ref.h"
#include "harness.h"
#include "mlp.h"
#include "zerod/zerod.h"

#define STEPS       120
#define REATTACH_AT 60

typedef struct reference {
  float master[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
  float m[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
  float v[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
} reference_t;

static zd_group_t groups_at(int step, zd_group_t out[2]) {
  /* group 0: AdamW with a cosine lr schedule; group 1: Adam (L2) with constant lr */
  out[0] = (zd_group_t){.lr = 3e-3 * (0.55 + 0.45 * cos(3.14159265358979 * step / STEPS)),
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
  return out[0];
}

static zd_client_t *attach(const zdt_daemon_t *d, zd_dtype_t pdt, zd_dtype_t gdt, int step,
                           int expect_resumed) {
  zd_client_t *c;
  int rc = zd_connect(d->socket, ZD_ANY_RANK, 0, &c);
  CHECK_MSG(rc == ZD_OK, "connect: %s", zd_last_error());
  zd_group_t groups[2];
  groups_at(step, groups);
  zd_model_desc_t desc = zdt_mlp_desc(groups, 2);
  desc.param_dtype = pdt;
  desc.grad_dtype = gdt;
  desc.grad_reduce = ZD_GRAD_MEAN;
  desc.grad_reduce = (zd_grad_reduce_t)2; /* neither ZD_GRAD_MEAN nor ZD_GRAD_SUM: refused */
  CHECK_INT_EQ(zd_layout(c, &desc), -EINVAL);
  CHECK_CONTAINS(zd_last_error(), "grad_reduce is 2");
  desc.grad_reduce = ZD_GRAD_MEAN;
  rc = zd_layout(c, &desc);
  CHECK_MSG(rc == ZD_OK, "layout: %s", zd_last_error());
  if (!expect_resumed) {
    float init[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
    float *p[MLP_NPARAMS] = {init[0], init[1], init[2], init[3]};
    mlp_init(p, 42);
    void *buf = zd_param_buffer(c, NULL);
    for (int i = 0; i < MLP_NPARAMS; i++) {
      zd_param_info_t info = ZD_PARAM_INFO_INIT;
      CHECK_INT_EQ(zd_param_info(c, (size_t)i, &info), ZD_OK);
      for (uint64_t k = 0; k < info.numel; k++) zdt_store(buf, pdt, info.offset + k, init[i][k]);
    }
  }
  rc = zd_register(c);
  CHECK_MSG(rc == ZD_OK, "register: %s", zd_last_error());
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(c, &info);
  CHECK_INT_EQ(info.resumed, expect_resumed);
  CHECK_U64_EQ(info.step, (uint64_t)step);
  CHECK_MSG(info.nbuckets >= 2, "bucket_elems 256 should give several buckets, got %u",
            info.nbuckets);
  return c;
}

/* Checks zerod's working params against the reference's master rounded to the working dtype. */
static void compare(zd_client_t *c, const reference_t *ref, zd_dtype_t pdt, int step) {
  const void *buf = zd_param_buffer(c, NULL);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(c, (size_t)i, &info);
    for (uint64_t k = 0; k < info.numel; k++) {
      float want = ref->master[i][k];
      if (pdt == ZD_BF16) want = zd__bf16_to_f32(zd__f32_to_bf16(want));
      float got = zdt_load(buf, pdt, info.offset + k);
      uint32_t gb, wb;
      memcpy(&gb, &got, 4);
      memcpy(&wb, &want, 4);
      CHECK_MSG(gb == wb,
                "step %d: %s[%llu] is %.9g (0x%08x) through zerod, %.9g (0x%08x) in the reference",
                step, info.name, (unsigned long long)k, got, gb, want, wb);
    }
  }
}

static void run(zd_dtype_t pdt, zd_dtype_t gdt) {
  printf("training %s params, %s grads\n", zd_dtype_name(pdt), zd_dtype_name(gdt));
  zdt_daemon_t d;
  const char *args[] = {"--bucket_elems", "256", NULL};
  zdt_start(&d, args);
  zd_client_t *c = attach(&d, pdt, gdt, 0, 0);

  static reference_t ref;
  memset(&ref, 0, sizeof ref);
  { /* the reference starts from what zerod took: the initial values in the working dtype */
    const void *buf = zd_param_buffer(c, NULL);
    for (int i = 0; i < MLP_NPARAMS; i++) {
      zd_param_info_t info = ZD_PARAM_INFO_INIT;
      zd_param_info(c, (size_t)i, &info);
      for (uint64_t k = 0; k < info.numel; k++)
        ref.master[i][k] = zdt_load(buf, pdt, info.offset + k);
    }
  }
  float first_loss = 0, loss = 0;
  for (int step = 0; step < STEPS; step++) {
    if (step == REATTACH_AT) {
      zd_close(c);
      c = attach(&d, pdt, gdt, step, 1);
      compare(c, &ref, pdt, step);
    }
    float work[MLP_NPARAMS][MLP_HIDDEN * MLP_IN], grad[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
    float *p[MLP_NPARAMS], *g[MLP_NPARAMS];
    const void *pbuf = zd_param_buffer(c, NULL);
    void *gbuf = zd_grad_buffer(c, NULL);
    for (int i = 0; i < MLP_NPARAMS; i++) {
      zd_param_info_t info = ZD_PARAM_INFO_INIT;
      zd_param_info(c, (size_t)i, &info);
      p[i] = work[i];
      g[i] = grad[i];
      for (uint64_t k = 0; k < info.numel; k++) work[i][k] = zdt_load(pbuf, pdt, info.offset + k);
    }
    loss = mlp_loss_grad((const float *const *)p, g, (uint64_t)step, 0);
    if (step == 0) first_loss = loss;
    for (int i = 0; i < MLP_NPARAMS; i++) {
      zd_param_info_t info = ZD_PARAM_INFO_INIT;
      zd_param_info(c, (size_t)i, &info);
      for (uint64_t k = 0; k < info.numel; k++) zdt_store(gbuf, gdt, info.offset + k, grad[i][k]);
    }

    zd_group_t groups[2];
    groups_at(step, groups);
    zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
    opts.groups = groups;
    opts.ngroups = 2;
    zd_step_result_t res = ZD_STEP_RESULT_INIT;
    int rc = zd_step(c, &opts, &res);
    CHECK_MSG(rc == ZD_OK, "step %d: %s", step, zd_last_error());
    CHECK_U64_EQ(res.step, (uint64_t)step + 1);
    CHECK_INT_EQ(res.applied, 1);

    /* The same step with the reference kernel, on the gradient exactly as zerod read it. */
    for (int i = 0; i < MLP_NPARAMS; i++) {
      zd_param_info_t info = ZD_PARAM_INFO_INIT;
      zd_param_info(c, (size_t)i, &info);
      float gq[MLP_HIDDEN * MLP_IN];
      for (uint64_t k = 0; k < info.numel; k++) gq[k] = zdt_load(gbuf, gdt, info.offset + k);
      zdt_ref_step(ref.master[i], ref.m[i], ref.v[i], gq, info.numel, &groups[info.group],
                   (uint64_t)step + 1, 1.0f);
    }
    compare(c, &ref, pdt, step + 1);
  }
  printf("  loss %.6f -> %.6f after %d steps, every parameter bitwise equal to the reference\n",
         first_loss, loss, STEPS);
  CHECK_MSG(loss < first_loss * 0.5f, "loss did not fall: %g -> %g", first_loss, loss);

  char *status;
  CHECK_INT_EQ(zd_status(c, &status), ZD_OK);
  CHECK_CONTAINS(status, "step:120\n");
  CHECK_CONTAINS(status, "model:registered\n");
  free(status);
  zd_close(c);
  zdt_stop(&d, SIGTERM, 0);
}

/* A large model on many kernel threads: the update is split into one task per thread, and every
 * element must be updated whatever the split (n not a multiple of the tasks' chunks). */
static void run_many_threads(void) {
  enum { N = (1 << 22) + 64, STEPS_BIG = 2 };
  zdt_daemon_t d;
  const char *args[] = {"--threads", "128", NULL};
  zdt_start(&d, args);
  zd_client_t *c;
  CHECK_INT_EQ(zd_connect(d.socket, ZD_ANY_RANK, 0, &c), ZD_OK);
  zd_param_t p = {.name = "w", .ndim = 1, .shape = {N}, .group = 0};
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
  float *param = zd_param_buffer(c, NULL), *grad = zd_grad_buffer(c, NULL);
  float *master = calloc(N, 4), *m = calloc(N, 4), *v = calloc(N, 4);
  CHECK(master && m && v);
  for (uint32_t i = 0; i < N; i++) master[i] = param[i] = (float)(i % 1000) * 1e-3f;
  CHECK_MSG(zd_register(c) == ZD_OK, "register: %s", zd_last_error());
  for (int step = 1; step <= STEPS_BIG; step++) {
    for (uint32_t i = 0; i < N; i++) grad[i] = (float)((int)(i % 777) - 388) * 1e-4f * step;
    CHECK_MSG(zd_step(c, NULL, NULL) == ZD_OK, "step: %s", zd_last_error());
    zdt_ref_step(master, m, v, grad, N, &g, (uint64_t)step, 1.0f);
  }
  for (uint32_t i = 0; i < N; i++)
    CHECK_MSG(memcmp(&param[i], &master[i], 4) == 0,
              "element %u of %u: %.9g through zerod, "
              "%.9g in the reference",
              i, (unsigned)N, param[i], master[i]);
  printf("training %u params on 128 kernel threads: every element bitwise equal\n", (unsigned)N);
  free(master);
  free(m);
  free(v);
  zd_close(c);
  zdt_stop(&d, SIGTERM, 0);
}

int main(void) {
  run_many_threads();
  run(ZD_F32, ZD_F32);
  run(ZD_BF16, ZD_BF16);
  run(ZD_BF16, ZD_F32);
  run(ZD_F32, ZD_F16);
  printf("test_train: ok\n");
  return 0;
}
