/* The CUDA update of every optimizer of the table (kernels/optim_cuda.h: zd__cuda_optim_step over
 * a layout) against the scalar reference of the CPU table (zd__optim_impl(ZD__ISA_SCALAR),
 * kernels/optim.h), bit for bit, on every state array, the working parameters and the padding:
 *   1. one model with eleven groups of every family and variant (SGD with dampening, with
 *      nesterov and maximize, without momentum; Adagrad with lr_decay and weight decay; RMSprop
 *      centered with momentum (torch 2's lerp in both its forms, maximize), centered 1.13, plain
 *      with momentum; Lion with weight decay; AdamW; Adam torch 2 with maximize), on random
 *      segments with gaps, steps
 *      1 to 4 (SGD's buffer and Adagrad's sum created at step 1), every grad dtype (f32, bf16,
 *      f16) x param output (f32, bf16, none);
 *   2. presence and per-parameter step counts: a layout of one segment per "parameter" (group:
 *      its index) and a map (zd__cuda_map_upload) that skips some and steps others with the
 *      constants of an earlier step, against the reference over the rebuilt segments step.c
 *      hands the CPU backend (skipped ones left out): skipped parameters untouched in every array;
 *   3. more groups than travel with a launch (d_groups, zd__cuda_groups_upload);
 *   4. the decision on the device: a verdict other than APPLY leaves everything untouched, APPLY
 *      multiplies by its grad_scale (the launch's grad_scale ignored);
 *   5. refusals: sqrt_mode MKL_EX for Adagrad and RMSprop (not for SGD and Lion), a missing array.
 * Exits 77 without a usable GPU. */
#include <cuda_runtime.h>

#include "gpu_check.h"
#include "group.h"
#include "optim.h"
#include "optim_cuda.h"

#define N       50000
#define MAXSEGS 600
#define NG      11

static uint64_t rng = 0x853c49e6748fea9bull;
static float uni(float lo, float hi) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return lo + (hi - lo) * (float)((rng >> 40) & 0xffffff) / (float)0x1000000;
}

static void *dev(size_t bytes) {
  void *p = NULL;
  CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

/* Host and device copies of everything one update touches. */
static float h_state[ZD__NSTATES][N], back[ZD__NSTATES][N], g32[N];
static uint16_t g16[N];
static uint16_t p16[N], p16_back[N];
static float p32[N], p32_back[N];
static float *d_state[ZD__NSTATES];
static void *d_grad, *d_param;
static cudaStream_t stream;

/* The arrays whose values must stay non-negative (a sqrt reads them). */
static int positive(int s) {
  return s == ZD__STATE_EXP_AVG_SQ || s == ZD__STATE_MAX_EXP_AVG_SQ || s == ZD__STATE_SUM ||
         s == ZD__STATE_SQUARE_AVG;
}

static void fill_state(void) {
  for (int s = 0; s < ZD__NSTATES; s++)
    for (int i = 0; i < N; i++)
      h_state[s][i] = positive(s)               ? uni(0, 1)
                      : s == ZD__STATE_GRAD_AVG ? uni(-0.1f, 0.1f)
                                                : uni(-1, 1);
  for (int i = 0; i < N; i++) {
    p32[i] = uni(-1, 1);
    p16[i] = zd__f32_to_bf16(uni(-1, 1));
  }
  for (int s = 0; s < ZD__NSTATES; s++)
    CUDA_CHECK(cudaMemcpy(d_state[s], h_state[s], N * sizeof(float), cudaMemcpyHostToDevice));
}

/* Random gradients of dtype gd into g32/g16 and the device. */
static const void *fill_grad(zd_dtype_t gd) {
  for (int i = 0; i < N; i++) {
    g32[i] = uni(-2, 2);
    g16[i] = gd == ZD_BF16 ? zd__f32_to_bf16(g32[i]) : (uint16_t)((rng >> 20) & 0x3bff);
  }
  const void *grad = gd == ZD_F32 ? (const void *)g32 : (const void *)g16;
  CUDA_CHECK(cudaMemcpy(d_grad, grad, gd == ZD_F32 ? N * 4 : N * 2, cudaMemcpyHostToDevice));
  return grad;
}

/* The working parameters of dtype pd (0: none) into the device, as the host has them. */
static void *push_param(int pd) {
  if (pd == ZD_F32) CUDA_CHECK(cudaMemcpy(d_param, p32, N * 4, cudaMemcpyHostToDevice));
  if (pd == ZD_BF16) CUDA_CHECK(cudaMemcpy(d_param, p16, N * 2, cudaMemcpyHostToDevice));
  return pd == ZD_F32 ? (void *)p32 : pd == ZD_BF16 ? (void *)p16 : NULL;
}

/* Every element of every array and of the param buffer equal to the host's (NaN as NaN). */
static void compare(const char *what, int pd) {
  CUDA_CHECK(cudaStreamSynchronize(stream));
  for (int s = 0; s < ZD__NSTATES; s++) {
    CUDA_CHECK(cudaMemcpy(back[s], d_state[s], N * sizeof(float), cudaMemcpyDeviceToHost));
    for (int i = 0; i < N; i++)
      CHECK_MSG(f2u(back[s][i]) == f2u(h_state[s][i]) ||
                    (back[s][i] != back[s][i] && h_state[s][i] != h_state[s][i]),
                "%s: %s[%d] %08x on the GPU, %08x reference", what, zd__state_name((zd__state_t)s),
                i, f2u(back[s][i]), f2u(h_state[s][i]));
  }
  if (pd == ZD_BF16) {
    CUDA_CHECK(cudaMemcpy(p16_back, d_param, N * 2, cudaMemcpyDeviceToHost));
    for (int i = 0; i < N; i++)
      CHECK_MSG(p16_back[i] == p16[i], "%s: bf16 param[%d] %04x on the GPU, %04x reference", what,
                i, p16_back[i], p16[i]);
  } else if (pd == ZD_F32) {
    CUDA_CHECK(cudaMemcpy(p32_back, d_param, N * 4, cudaMemcpyDeviceToHost));
    for (int i = 0; i < N; i++)
      CHECK_MSG(f2u(p32_back[i]) == f2u(p32[i]),
                "%s: f32 param[%d] %08x on the GPU, %08x reference", what, i, f2u(p32_back[i]),
                f2u(p32[i]));
  }
}

/* Group k of the ten of part 1, with its lr drawn anew. */
static zd_group_t group_of(int k) {
  zd_group_t g = zd__group_default();
  g.lr = uni(0.001f, 0.1f);
  g.weight_decay = uni(0, 0.1f);
  switch (k) {
    case 0: /* SGD, momentum with dampening */
      g.optimizer = ZD_SGD, g.momentum = 0.9, g.dampening = 0.1;
      break;
    case 1: /* SGD, nesterov, maximize */
      g.optimizer = ZD_SGD, g.momentum = 0.8, g.nesterov = 1, g.maximize = 1;
      break;
    case 2: /* SGD without momentum or decay */
      g.optimizer = ZD_SGD, g.weight_decay = 0;
      break;
    case 3: /* Adagrad */
      g.optimizer = ZD_ADAGRAD, g.lr_decay = 0.01, g.initial_accumulator_value = 0.1, g.eps = 1e-10;
      break;
    case 4: /* RMSprop centered, momentum, torch 2's lerp (its first form), maximize */
      g.optimizer = ZD_RMSPROP, g.centered = 1, g.momentum = 0.5, g.update = ZD_UPDATE_TORCH2;
      g.maximize = 1, g.alpha = 0.9;
      break;
    case 5: /* RMSprop centered, torch 1.13's average */
      g.optimizer = ZD_RMSPROP, g.centered = 1, g.alpha = 0.95, g.weight_decay = 0;
      break;
    case 6: /* Lion */
      g.optimizer = ZD_LION, g.beta1 = 0.9, g.beta2 = 0.99;
      break;
    case 7: /* AdamW */
      g.optimizer = ZD_ADAMW;
      break;
    case 8: /* RMSprop centered without momentum, torch 2, alpha 0.3 (the lerp's second form) */
      g.optimizer = ZD_RMSPROP, g.centered = 1, g.alpha = 0.3, g.update = ZD_UPDATE_TORCH2;
      break;
    case 9: /* Adam, torch 2, maximize */
      g.optimizer = ZD_ADAM, g.update = ZD_UPDATE_TORCH2, g.maximize = 1;
      break;
    default: /* RMSprop plain, with momentum (1.13) */
      g.optimizer = ZD_RMSPROP, g.momentum = 0.3;
      break;
  }
  return g;
}

/* The reference's args over host arrays; the device's are the same with device pointers. */
static zd__adam_args_t host_args(const void *grad, zd_dtype_t gd, int pd, const zd__segment_t *segs,
                                 uint32_t nsegs, const zd__adam_group_t *c, float scale) {
  zd__adam_args_t a;
  memset(&a, 0, sizeof a);
  for (int s = 0; s < ZD__NSTATES; s++) a.state[s] = h_state[s];
  a.grad = grad;
  a.grad_dtype = gd;
  a.param = pd == ZD_F32 ? (void *)p32 : pd == ZD_BF16 ? (void *)p16 : NULL;
  a.param_dtype = pd ? (zd_dtype_t)pd : ZD_F32;
  a.grad_scale = scale;
  a.segs = segs;
  a.nsegs = nsegs;
  a.groups = c;
  return a;
}

static zd__cuda_adam_args_t device_args(zd_dtype_t gd, int pd, const zd__adam_group_t *c,
                                        uint32_t ngroups, float scale) {
  zd__cuda_adam_args_t d;
  memset(&d, 0, sizeof d);
  for (int s = 0; s < ZD__NSTATES; s++) d.state[s] = d_state[s];
  d.grad = d_grad;
  d.grad_dtype = gd;
  d.param = pd ? d_param : NULL;
  d.param_dtype = pd ? (zd_dtype_t)pd : ZD_F32;
  d.grad_scale = scale;
  d.groups = c;
  d.ngroups = ngroups;
  return d;
}

static uint32_t random_segments(zd__segment_t *segs, uint32_t groups) {
  uint32_t n = 0;
  for (uint64_t at = 0; n < MAXSEGS;) {
    at += (uint64_t)(uni(0, 4));
    uint64_t len = 1 + (uint64_t)uni(0, 300);
    if (at + len > N) break;
    segs[n] = (zd__segment_t){.offset = at, .length = len, .group = n % groups};
    n++;
    at += len;
  }
  return n;
}

static zd__cuda_layout_t *layout_of(const zd__segment_t *segs, uint32_t n) {
  zd__cuda_layout_t *l = NULL;
  ZD_CHECK(zd__cuda_layout_create(segs, n, N, stream, &l, &gpu_err));
  return l;
}

/* 1. Every family and variant, every dtype. */
static int part_families(void) {
  static zd__segment_t segs[MAXSEGS];
  uint32_t nsegs = random_segments(segs, NG);
  zd__cuda_layout_t *l = layout_of(segs, nsegs);
  static const zd_dtype_t gds[] = {ZD_F32, ZD_BF16, ZD_F16};
  static const int pds[] = {0, ZD_F32, ZD_BF16};
  int cases = 0;
  for (int gi = 0; gi < 3; gi++)
    for (int pi = 0; pi < 3; pi++) {
      fill_state();
      push_param(pds[pi]);
      for (int t = 1; t <= 4; t++) {
        zd__adam_group_t c[NG];
        for (int k = 0; k < NG; k++) {
          zd_group_t hp = group_of(k);
          zd__adam_group_init(&c[k], &hp, (uint64_t)t);
        }
        const void *grad = fill_grad(gds[gi]);
        zd__adam_args_t a = host_args(grad, gds[gi], pds[pi], segs, nsegs, c, 0.5f);
        zd__optim_impl(ZD__ISA_SCALAR)(&a, 0, N);
        zd__cuda_adam_args_t d = device_args(gds[gi], pds[pi], c, NG, 0.5f);
        ZD_CHECK(zd__cuda_optim_step(l, &d, stream, &gpu_err));
        char what[96];
        snprintf(what, sizeof what, "families: grad %s, param %s, step %d", zd_dtype_name(gds[gi]),
                 pds[pi] ? zd_dtype_name((zd_dtype_t)pds[pi]) : "none", t);
        compare(what, pds[pi]);
        cases++;
      }
    }
  zd__cuda_layout_destroy(l);
  return cases;
}

/* 2. A per-parameter layout and a map: skipped parameters, lagging ones. */
static int part_presence(void) {
  static zd__segment_t params[MAXSEGS], uneven[MAXSEGS];
  uint32_t nparams = random_segments(params, NG);
  for (uint32_t k = 0; k < nparams; k++) params[k].group = k; /* the layout's group: its index */
  zd__cuda_layout_t *l = layout_of(params, nparams);
  uint32_t *d_map = (uint32_t *)dev(nparams * sizeof(uint32_t));
  static uint32_t map[MAXSEGS];
  int cases = 0;
  for (int gi = 0; gi < 2; gi++) {
    zd_dtype_t gd = gi ? ZD_BF16 : ZD_F32;
    fill_state();
    push_param(ZD_BF16);
    for (int t = 3; t <= 6; t++) {
      /* groups 0..NG-1 at step t; NG..2NG-1: the same groups at step t - 2 (lagging) */
      zd__adam_group_t c[2 * NG];
      for (int k = 0; k < NG; k++) {
        zd_group_t hp = group_of(k);
        zd__adam_group_init(&c[k], &hp, (uint64_t)t);
        zd__adam_group_init(&c[NG + k], &hp, (uint64_t)t - 2);
      }
      uint32_t nuneven = 0, skipped = 0;
      for (uint32_t k = 0; k < nparams; k++) {
        uint32_t g = k % NG, pick = (uint32_t)(k * 7 + (uint32_t)t) % 5;
        map[k] = pick == 0 ? ZD__CUDA_SKIP : pick == 1 ? NG + g : g;
        if (map[k] == ZD__CUDA_SKIP) {
          skipped++;
          continue;
        }
        uneven[nuneven++] = (zd__segment_t){params[k].offset, params[k].length, map[k]};
      }
      const void *grad = fill_grad(gd);
      zd__adam_args_t a = host_args(grad, gd, ZD_BF16, uneven, nuneven, c, 1.0f);
      zd__optim_impl(ZD__ISA_SCALAR)(&a, 0, N);
      ZD_CHECK(zd__cuda_map_upload(d_map, map, nparams, stream, &gpu_err));
      zd__cuda_adam_args_t d = device_args(gd, ZD_BF16, c, 2 * NG, 1.0f);
      d.d_map = d_map;
      d.nmap = nparams;
      ZD_CHECK(zd__cuda_optim_step(l, &d, stream, &gpu_err));
      char what[96];
      snprintf(what, sizeof what, "presence: grad %s, step %d (%u of %u parameters skipped)",
               zd_dtype_name(gd), t, skipped, nparams);
      compare(what, ZD_BF16);
      CHECK(skipped > 0 && skipped < nparams);
      cases++;
    }
  }
  /* map entries past the layout's parameters are refused */
  zd__cuda_adam_args_t d = device_args(ZD_F32, 0, NULL, 0, 1.0f);
  d.d_map = d_map;
  d.nmap = nparams - 1;
  CHECK_INT_EQ(zd__cuda_optim_step(l, &d, stream, &gpu_err), ZD_OK); /* no groups: nothing runs */
  zd__adam_group_t one;
  zd_group_t hp = group_of(0);
  zd__adam_group_init(&one, &hp, 1);
  d.groups = &one;
  d.ngroups = 1;
  CHECK_INT_EQ(zd__cuda_optim_step(l, &d, stream, &gpu_err), -EINVAL);
  CUDA_CHECK(cudaFree(d_map));
  zd__cuda_layout_destroy(l);
  return cases;
}

/* 3. More groups than travel with a launch. */
static int part_many_groups(void) {
  enum { MANY = ZD__CUDA_GROUPS_INLINE + 9 };
  static zd__segment_t segs[MAXSEGS];
  uint32_t nsegs = random_segments(segs, MANY);
  zd__cuda_layout_t *l = layout_of(segs, nsegs);
  zd__adam_group_t *d_groups = (zd__adam_group_t *)dev(MANY * sizeof(zd__adam_group_t));
  static zd__adam_group_t c[MANY];
  fill_state();
  push_param(ZD_F32);
  for (int t = 1; t <= 2; t++) {
    for (int k = 0; k < MANY; k++) {
      zd_group_t hp = group_of(k % NG);
      zd__adam_group_init(&c[k], &hp, (uint64_t)t);
    }
    const void *grad = fill_grad(ZD_F32);
    zd__adam_args_t a = host_args(grad, ZD_F32, ZD_F32, segs, nsegs, c, 1.0f);
    zd__optim_impl(ZD__ISA_SCALAR)(&a, 0, N);
    ZD_CHECK(zd__cuda_groups_upload(d_groups, c, MANY, stream, &gpu_err));
    zd__cuda_adam_args_t d = device_args(ZD_F32, ZD_F32, c, MANY, 1.0f);
    d.d_groups = d_groups;
    ZD_CHECK(zd__cuda_optim_step(l, &d, stream, &gpu_err));
    compare(t == 1 ? "many groups, step 1" : "many groups, step 2", ZD_F32);
  }
  CUDA_CHECK(cudaFree(d_groups));
  zd__cuda_layout_destroy(l);
  return 2;
}

/* 4. The decision on the device. */
static int part_decision(void) {
  static zd__segment_t segs[MAXSEGS];
  uint32_t nsegs = random_segments(segs, NG);
  zd__cuda_layout_t *l = layout_of(segs, nsegs);
  zd__cuda_decision_t *d_dec = (zd__cuda_decision_t *)dev(sizeof(zd__cuda_decision_t));
  zd__adam_group_t c[NG];
  for (int k = 0; k < NG; k++) {
    zd_group_t hp = group_of(k);
    zd__adam_group_init(&c[k], &hp, 2);
  }
  fill_state();
  push_param(ZD_F32);
  for (int verdict = ZD__VERDICT_APPLY; verdict <= ZD__VERDICT_INVALID; verdict++) {
    zd__cuda_decision_t dec;
    memset(&dec, 0, sizeof dec);
    dec.verdict = verdict;
    dec.dec.grad_scale = 0.25f;
    CUDA_CHECK(cudaMemcpy(d_dec, &dec, sizeof dec, cudaMemcpyHostToDevice));
    const void *grad = fill_grad(ZD_F32);
    if (verdict == ZD__VERDICT_APPLY) {
      zd__adam_args_t a = host_args(grad, ZD_F32, ZD_F32, segs, nsegs, c, 0.25f);
      zd__optim_impl(ZD__ISA_SCALAR)(&a, 0, N);
    }
    zd__cuda_adam_args_t d = device_args(ZD_F32, ZD_F32, c, NG, 7.0f); /* ignored */
    d.d_decision = d_dec;
    ZD_CHECK(zd__cuda_optim_step(l, &d, stream, &gpu_err));
    char what[64];
    snprintf(what, sizeof what, "decision with verdict %d", verdict);
    compare(what, ZD_F32);
  }
  CUDA_CHECK(cudaFree(d_dec));
  zd__cuda_layout_destroy(l);
  return 4;
}

/* 5. What the launchers refuse. */
static void part_refusals(void) {
  zd__segment_t seg = {.offset = 0, .length = 100, .group = 0};
  zd__cuda_layout_t *l = layout_of(&seg, 1);
  for (int k = 0; k < NG; k++) {
    zd_group_t hp = group_of(k);
    hp.sqrt_mode = ZD_SQRT_MKL_EX;
    zd__adam_group_t c;
    zd__adam_group_init(&c, &hp, 1);
    zd__cuda_adam_args_t d = device_args(ZD_F32, 0, &c, 1, 1.0f);
    int want = hp.optimizer == ZD_SGD || hp.optimizer == ZD_LION ? ZD_OK : ZD_EHPARAM;
    CHECK_MSG(zd__cuda_optim_step(l, &d, stream, &gpu_err) == want,
              "group %d (optimizer %s) with sqrt_mode MKL_EX: expected %s", k,
              zd__optim_kernel_name(hp.optimizer), zd_err_name(want));
  }
  zd_group_t hp = group_of(3); /* Adagrad without its sum */
  zd__adam_group_t c;
  zd__adam_group_init(&c, &hp, 1);
  zd__cuda_adam_args_t d = device_args(ZD_F32, 0, &c, 1, 1.0f);
  d.state[ZD__STATE_SUM] = NULL;
  CHECK_INT_EQ(zd__cuda_optim_step(l, &d, stream, &gpu_err), -EINVAL);
  CHECK_CONTAINS(gpu_err.msg, "sum");
  c.optimizer = 99; /* no row */
  d.state[ZD__STATE_SUM] = d_state[ZD__STATE_SUM];
  CHECK_INT_EQ(zd__cuda_optim_step(l, &d, stream, &gpu_err), -EINVAL);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  zd__cuda_layout_destroy(l);
}

int main(void) {
  gpu_or_skip("test_optim_cuda");
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ZD_CHECK(zd__cuda_kernels_preload(&gpu_err));
  for (int s = 0; s < ZD__NSTATES; s++) d_state[s] = (float *)dev(N * sizeof(float));
  d_grad = dev(N * sizeof(float));
  d_param = dev(N * sizeof(float));
  int cases = part_families();
  cases += part_presence();
  cases += part_many_groups();
  cases += part_decision();
  part_refusals();
  printf(
      "PASS: every optimizer of the table on the GPU equals the scalar reference bit for bit (%d "
      "cases: families x dtypes, presence and lags, %d groups, the device decision)\n",
      cases, ZD__CUDA_GROUPS_INLINE + 9);
  return 0;
}
