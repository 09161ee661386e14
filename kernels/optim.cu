/* The CUDA kernels of the optimizers' table other than Adam's (optim_cuda.h): SGD, Adagrad,
 * RMSprop and Lion over a layout's tile table (adam.cu builds it), and the dispatch of a step's
 * groups to the families' launchers.
 *
 * One kernel per family, grad dtype and param output (templates): blocks stride over the tiles,
 * a tile's constants are looked up once (through the step's map where there is one: skipped
 * tiles are not touched), a tile of another family's group is left to that family's kernel, and
 * in a tile each thread takes every blockDim-th element (coalesced). The grid is one wave, as
 * adam.cu's: the kernel's resident blocks per SM (asked once per process, at preload or at the
 * first launch) times the layout's SMs, no more than tiles.
 *
 * Arithmetic: each element's formula is its CPU reference's (sgd.c, adagrad.c, rmsprop.c,
 * lion.c; the line of the reference in the comment beside it), every operation an explicit
 * round-to-nearest intrinsic (adam.cuh): the device computes the host's bits.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "adam.cuh"
#include "cuda_plan.h"
#include "launch.cuh"
#include "optim_cuda.h"

#define OPTIM_THREADS 256

/* The families with a kernel here, by index. */
enum { FAM_SGD = 0, FAM_ADAGRAD = 1, FAM_RMSPROP = 2, FAM_LION = 3, NFAM = 4 };

namespace {

typedef struct optim_kargs {
  float *state[ZD__NSTATES];
  const void *grad;
  void *param;
  const tile_t *tiles;
  uint64_t ntiles;
  float grad_scale;
  uint32_t optimizers;                 /* this family's (never 0 here) */
  const zd__cuda_decision_t *decision; /* NULL: grad_scale; else its verdict and factor */
  const uint32_t *map;                 /* NULL: a tile's group indexes the groups */
  const zd__adam_group_t *d_groups;
  zd__adam_group_t groups[ZD__CUDA_GROUPS_INLINE];
} optim_kargs_t;

template <int GDT>
__device__ __forceinline__ float grad_at(const void *g, uint64_t i) {
  if (GDT == ZD_F32) return __ldg((const float *)g + i);
  return zd__dev_grad_to_f32<GDT>(__ldg((const unsigned short *)g + i));
}

template <int PDT>
__device__ __forceinline__ void param_out(void *param, uint64_t i, float p) {
  if (PDT == ZD_F32) ((float *)param)[i] = p;
  if (PDT == ZD_BF16) ((uint16_t *)param)[i] = zd__dev_f32_to_bf16(p);
}

/* g = to_f32(grad) * grad_scale, negated with maximize (zd__optim_flip: the sign bit). */
template <int GDT>
__device__ __forceinline__ float scaled_grad(const optim_kargs_t &a, uint64_t i, float scale,
                                             bool negate) {
  float g = __fmul_rn(grad_at<GDT>(a.grad, i), scale);
  return negate ? -g : g;
}

/* sgd.c's sgd_range, element i; mom: the group has momentum and the model the buffer. */
template <int GDT>
__device__ __forceinline__ float sgd_one(const optim_kargs_t &a, const zd__adam_group_t &c,
                                         uint64_t i, float scale, bool mom) {
  float *master = a.state[ZD__STATE_MASTER], *buf = a.state[ZD__STATE_MOMENTUM_BUFFER];
  float g = scaled_grad<GDT>(a, i, scale, c.negate_grad);
  float p = master[i];
  if (c.has_weight_decay) g = __fmaf_rn(p, c.weight_decay, g); /* fmaf(p, wd, g) */
  if (mom) {
    /* first ? g : fmaf(g, dw, buf * mu) */
    float b =
        c.momentum_first ? g : __fmaf_rn(g, c.dampening_weight, __fmul_rn(buf[i], c.momentum));
    buf[i] = b;
    g = c.nesterov ? __fmaf_rn(b, c.momentum, g) : b; /* fmaf(b, mu, g) */
  }
  p = __fmaf_rn(g, c.neg_lr, p); /* fmaf(g, nlr, p) */
  master[i] = p;
  return p;
}

/* adagrad.c's adagrad_range, element i (sqrt EXACT: MKL_EX is refused at the launch). */
template <int GDT>
__device__ __forceinline__ float adagrad_one(const optim_kargs_t &a, const zd__adam_group_t &c,
                                             uint64_t i, float scale) {
  float *master = a.state[ZD__STATE_MASTER], *sum = a.state[ZD__STATE_SUM];
  float g = scaled_grad<GDT>(a, i, scale, c.negate_grad);
  float p = master[i];
  if (c.has_weight_decay) g = __fmaf_rn(p, c.weight_decay, g);
  float s = c.sum_first ? c.init_sum : sum[i];
  s = __fmaf_rn(g, g, s);                                  /* fmaf(g, g, s) */
  float d = __fadd_rn(__fsqrt_rn(s), c.eps);               /* sqrtf(s) + e */
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(c.neg_clr, g), d)); /* p + (nclr * g) / d */
  sum[i] = s;
  master[i] = p;
  return p;
}

/* rmsprop.c's rms_range, element i; mom, cen: the group's momentum and centered with the model's
 * arrays; lerp: TORCH2's grad_avg. */
template <int GDT>
__device__ __forceinline__ float rmsprop_one(const optim_kargs_t &a, const zd__adam_group_t &c,
                                             uint64_t i, float scale, bool mom, bool cen,
                                             bool lerp) {
  float *master = a.state[ZD__STATE_MASTER], *sq = a.state[ZD__STATE_SQUARE_AVG];
  float g = scaled_grad<GDT>(a, i, scale, c.negate_grad);
  float p = master[i];
  if (c.has_weight_decay) g = __fmaf_rn(p, c.weight_decay, g);
  /* fmaf(a1 * g, g, sq * al) */
  float s = __fmaf_rn(__fmul_rn(c.one_minus_alpha, g), g, __fmul_rn(sq[i], c.alpha));
  sq[i] = s;
  float x = s;
  if (cen) {
    float *ga = a.state[ZD__STATE_GRAD_AVG];
    float m = ga[i];
    if (lerp) /* fmaf(w, g - m, from_grad ? g : m) */
      m = __fmaf_rn(c.lerp_weight, __fsub_rn(g, m), c.lerp_from_grad ? g : m);
    else /* fmaf(g, a1, m * al) */
      m = __fmaf_rn(g, c.one_minus_alpha, __fmul_rn(m, c.alpha));
    ga[i] = m;
    x = __fmaf_rn(-m, m, s); /* fmaf(-m, m, s) */
  }
  float d = __fadd_rn(__fsqrt_rn(x), c.eps); /* sqrtf(x) + e */
  if (mom) {
    float *buf = a.state[ZD__STATE_MOMENTUM_BUFFER];
    float b = __fadd_rn(__fmul_rn(buf[i], c.momentum), __fdiv_rn(g, d)); /* b * mu + g / d */
    buf[i] = b;
    p = __fmaf_rn(b, c.neg_lr, p); /* fmaf(b, nlr, p) */
  } else {
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(c.neg_lr, g), d)); /* p + (nlr * g) / d */
  }
  master[i] = p;
  return p;
}

/* lion.c's lion_range, element i (Lion reads no maximize). */
template <int GDT>
__device__ __forceinline__ float lion_one(const optim_kargs_t &a, const zd__adam_group_t &c,
                                          uint64_t i, float scale) {
  float *master = a.state[ZD__STATE_MASTER], *m = a.state[ZD__STATE_EXP_AVG];
  float g = __fmul_rn(grad_at<GDT>(a.grad, i), scale);
  float p = master[i];
  if (c.has_weight_decay) p = __fmul_rn(p, c.decay); /* p * f */
  float m0 = m[i];
  float u = __fmaf_rn(g, c.one_minus_beta1, __fmul_rn(m0, c.beta1)); /* fmaf(g, a1, m * b1) */
  float s = u > 0.0f ? 1.0f : 0.0f;
  s = u < 0.0f ? -1.0f : s;
  p = __fmaf_rn(s, c.neg_lr, p);                                  /* fmaf(s, nlr, p) */
  m[i] = __fmaf_rn(g, c.one_minus_beta2, __fmul_rn(m0, c.beta2)); /* fmaf(g, a2, m * b2) */
  master[i] = p;
  return p;
}

template <int FAM, int GDT, int PDT>
__global__ void __launch_bounds__(OPTIM_THREADS)
    optim_kernel(const __grid_constant__ optim_kargs_t a) {
  float scale = a.grad_scale;
  if (a.decision) { /* written by an earlier kernel of the stream: read once, at the start */
    if (a.decision->verdict != ZD__VERDICT_APPLY) return;
    scale = a.decision->dec.grad_scale;
  }
  const zd__adam_group_t *groups = a.d_groups ? a.d_groups : a.groups;
  for (uint64_t t = blockIdx.x; t < a.ntiles; t += gridDim.x) {
    const tile_t tile = a.tiles[t];
    const uint32_t gi = a.map ? a.map[tile.group] : tile.group;
    if (gi == ZD__CUDA_SKIP) continue; /* a parameter the step skips: left untouched */
    const zd__adam_group_t &c = groups[gi];
    if (!((a.optimizers >> c.optimizer) & 1u)) continue; /* another family's */
    const uint64_t lo = tile.start, hi = lo + tile.len;
    /* The flags of the reference's per-segment dispatch (an array the model lacks: off). */
    const bool mom = c.has_momentum && a.state[ZD__STATE_MOMENTUM_BUFFER];
    const bool cen = c.centered && a.state[ZD__STATE_GRAD_AVG];
    const bool lerp = c.update == ZD_UPDATE_TORCH2;
    for (uint64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      float p;
      if (FAM == FAM_SGD)
        p = sgd_one<GDT>(a, c, i, scale, mom);
      else if (FAM == FAM_ADAGRAD)
        p = adagrad_one<GDT>(a, c, i, scale);
      else if (FAM == FAM_RMSPROP)
        p = rmsprop_one<GDT>(a, c, i, scale, mom, cen, lerp);
      else
        p = lion_one<GDT>(a, c, i, scale);
      param_out<PDT>(a.param, i, p);
    }
  }
}

typedef void (*optim_kernel_fn)(optim_kargs_t);

template <int FAM, int GDT>
optim_kernel_fn kernel_for(int pdt) {
  return pdt == ZD_F32    ? optim_kernel<FAM, GDT, ZD_F32>
         : pdt == ZD_BF16 ? optim_kernel<FAM, GDT, ZD_BF16>
                          : optim_kernel<FAM, GDT, 0>;
}

template <int FAM>
optim_kernel_fn kernel_for(int gdt, int pdt) {
  return gdt == ZD_F32    ? kernel_for<FAM, ZD_F32>(pdt)
         : gdt == ZD_BF16 ? kernel_for<FAM, ZD_BF16>(pdt)
                          : kernel_for<FAM, ZD_F16>(pdt);
}

optim_kernel_fn kernel_of(int fam, int gdt, int pdt) {
  switch (fam) {
    case FAM_SGD:
      return kernel_for<FAM_SGD>(gdt, pdt);
    case FAM_ADAGRAD:
      return kernel_for<FAM_ADAGRAD>(gdt, pdt);
    case FAM_RMSPROP:
      return kernel_for<FAM_RMSPROP>(gdt, pdt);
    default:
      return kernel_for<FAM_LION>(gdt, pdt);
  }
}

int gdt_index(int gdt) {
  return gdt == ZD_F32 ? 0 : gdt == ZD_BF16 ? 1 : 2;
}
int pdt_index(int pdt) {
  return pdt == ZD_F32 ? 0 : pdt == ZD_BF16 ? 1 : 2;
}

/* Resident blocks per SM of each kernel (0: not asked yet), shared by the ranks' threads. */
int per_sm[NFAM][GDT_VARIANTS][PDT_VARIANTS];

cudaError_t occupancy(int fam, int gi, int pi, int *out) {
  static const int gdts[GDT_VARIANTS] = {ZD_F32, ZD_BF16, ZD_F16};
  static const int pdts[PDT_VARIANTS] = {ZD_F32, ZD_BF16, 0};
  int n = __atomic_load_n(&per_sm[fam][gi][pi], __ATOMIC_RELAXED);
  cudaError_t e = cudaSuccess;
  if (!n) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel_of(fam, gdts[gi], pdts[pi]),
                                                      OPTIM_THREADS, 0);
    if (e != cudaSuccess || n < 1) n = 1;
    __atomic_store_n(&per_sm[fam][gi][pi], n, __ATOMIC_RELAXED);
  }
  *out = n;
  return e;
}

unsigned grid_of(const zd__cuda_layout_t *l, int fam, int gdt, int pdt) {
  int n = 1;
  (void)occupancy(fam, gdt_index(gdt), pdt_index(pdt), &n);
  (void)cudaGetLastError();
  uint64_t cap = (uint64_t)n * (uint64_t)(l->sms > 0 ? l->sms : 1);
  uint64_t want = l->ntiles ? l->ntiles : 1;
  return (unsigned)(want < cap ? want : cap);
}

/* Which family of this file steps optimizer (by its row of the table, optim.h): its index, or -1
 * (adam's kernel is adam.cu's; a value with no row). */
int family_of(int optimizer) {
  static const char *const names[NFAM] = {"sgd", "adagrad", "rmsprop", "lion"};
  const char *k = zd__optim_kernel_name(optimizer);
  for (int f = 0; k && f < NFAM; f++)
    if (!strcmp(k, names[f])) return f;
  return -1;
}

/* The arrays a group of family fam needs (as its CPU reference reads them), the sqrt it has. */
int check_group(int fam, const zd__adam_group_t &c, const zd__cuda_adam_args_t *a, uint32_t k,
                const char *who, zd__err_t *err) {
  float *const *s = a->state;
  const char *need = NULL;
  if (fam == FAM_ADAGRAD && !s[ZD__STATE_SUM]) need = "sum";
  if (fam == FAM_RMSPROP && !s[ZD__STATE_SQUARE_AVG]) need = "square_avg";
  if (fam == FAM_LION && !s[ZD__STATE_EXP_AVG]) need = "exp_avg";
  if (need) return zd__errf(err, -EINVAL, "%s: group %u needs the state array %s", who, k, need);
  if ((fam == FAM_ADAGRAD || fam == FAM_RMSPROP) && c.sqrt_mode != ZD_SQRT_EXACT)
    return zd__errf(err, ZD_EHPARAM,
                    "%s: group %u has sqrt_mode MKL_EX, the rsqrtps approximation of an x86 "
                    "CPU, which a GPU cannot reproduce; expected EXACT",
                    who, k);
  return ZD_OK;
}

/* Family fam's launch (optim_cuda.h's launchers). */
int family_step(int fam, const char *who, const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a,
                cudaStream_t stream, zd__err_t *err) {
  if (!l || !a) return zd__errf(err, -EINVAL, "%s: no layout or no arguments", who);
  int rc = zd__check_stream(stream, who, err);
  if (rc) return rc;
  if (!a->state[ZD__STATE_MASTER] || !a->grad)
    return zd__errf(err, -EINVAL, "%s: master and grad are required", who);
  if (!zd__dtype_ok(a->grad_dtype, ZD__DTYPE_GRAD))
    return zd__errf(err, ZD_EDTYPE, "%s: grad dtype %d; expected f32, bf16 or f16", who,
                    (int)a->grad_dtype);
  if (a->param && !zd__dtype_ok(a->param_dtype, ZD__DTYPE_PARAM))
    return zd__errf(err, ZD_EDTYPE, "%s: param dtype %d; expected f32 or bf16", who,
                    (int)a->param_dtype);
  if (!a->d_map && a->ngroups < l->ngroups)
    return zd__errf(err, -EINVAL, "%s: the segments use %u groups, %u given", who, l->ngroups,
                    a->ngroups);
  if (a->d_map && a->nmap < l->ngroups)
    return zd__errf(err, -EINVAL, "%s: the segments use %u map entries, %u given", who, l->ngroups,
                    a->nmap);
  if (!a->d_groups && a->ngroups > ZD__CUDA_GROUPS_INLINE)
    return zd__errf(err, -EINVAL,
                    "%s: %u groups; at most %d travel with the launch, pass more in d_groups "
                    "(zd__cuda_groups_upload)",
                    who, a->ngroups, ZD__CUDA_GROUPS_INLINE);
  if (!a->groups && a->ngroups)
    return zd__errf(err, -EINVAL, "%s: %u groups but no host groups (the checks read them)", who,
                    a->ngroups);
  uint32_t mine = 0; /* this family's optimizers, from the table */
  for (int opt = 0; opt < 32; opt++)
    if (family_of(opt) == fam) mine |= 1u << opt;
  uint32_t optimizers = a->optimizers ? a->optimizers & mine : mine;
  for (uint32_t k = 0; k < a->ngroups; k++)
    if ((optimizers >> a->groups[k].optimizer) & 1u) {
      rc = check_group(fam, a->groups[k], a, k, who, err);
      if (rc) return rc;
    }
  if (l->ntiles == 0 || !optimizers) return ZD_OK; /* nothing covered, or nothing of its own */

  optim_kargs_t k;
  memset(&k, 0, sizeof k);
  for (int s = 0; s < ZD__NSTATES; s++) k.state[s] = a->state[s];
  k.grad = a->grad;
  k.param = a->param;
  k.tiles = l->d_tiles;
  k.ntiles = l->ntiles;
  k.grad_scale = a->grad_scale;
  k.optimizers = optimizers;
  k.decision = a->d_decision;
  k.map = a->d_map;
  k.d_groups = a->d_groups;
  if (!a->d_groups && a->ngroups) memcpy(k.groups, a->groups, a->ngroups * sizeof *a->groups);
  int pdt = a->param ? (int)a->param_dtype : 0;
  optim_kernel_fn fn = kernel_of(fam, (int)a->grad_dtype, pdt);
  fn<<<grid_of(l, fam, (int)a->grad_dtype, pdt), OPTIM_THREADS, 0, stream>>>(k);
  LAUNCH_CHECK(err, "CUDA optimizer kernel launch");
  return ZD_OK;
}

}  // namespace

extern "C" int zd__cuda_sgd_step(const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a,
                                 cudaStream_t stream, zd__err_t *err) {
  return family_step(FAM_SGD, "CUDA sgd", l, a, stream, err);
}

extern "C" int zd__cuda_adagrad_step(const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a,
                                     cudaStream_t stream, zd__err_t *err) {
  return family_step(FAM_ADAGRAD, "CUDA adagrad", l, a, stream, err);
}

extern "C" int zd__cuda_rmsprop_step(const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a,
                                     cudaStream_t stream, zd__err_t *err) {
  return family_step(FAM_RMSPROP, "CUDA rmsprop", l, a, stream, err);
}

extern "C" int zd__cuda_lion_step(const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a,
                                  cudaStream_t stream, zd__err_t *err) {
  return family_step(FAM_LION, "CUDA lion", l, a, stream, err);
}

/* A row's launcher, by the table. */
static zd__cuda_step_fn launcher(int optimizer) {
  switch (optimizer) {
#define FN(opt, k) \
  case ZD_##opt:   \
    return zd__cuda_##k##_step;
    ZD__OPTIMIZERS(FN)
#undef FN
  }
  return NULL;
}

extern "C" int zd__cuda_optim_step(const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a,
                                   cudaStream_t stream, zd__err_t *err) {
  if (!l || !a) return zd__errf(err, -EINVAL, "CUDA update: no layout or no arguments");
  if (a->ngroups && !a->groups)
    return zd__errf(err, -EINVAL, "CUDA update: %u groups but no host groups to dispatch by",
                    a->ngroups);
  uint32_t done = 0; /* the optimizers whose family was launched */
  for (uint32_t k = 0; k < a->ngroups; k++) {
    int opt = a->groups[k].optimizer;
    if (opt < 0 || opt >= 32 || !zd__optim_kernel_name(opt))
      return zd__errf(err, -EINVAL, "CUDA update: group %u has optimizer %d, which the table lacks",
                      k, opt);
    if (!launcher(opt))
      return zd__errf(err, ZD_EBACKEND,
                      "CUDA update: group %u has optimizer %s, which has no CUDA kernel yet "
                      "(its family in kernels/optim.cu); use the CPU backend",
                      k, zd__optim_kernel_name(opt));
    if ((done >> opt) & 1u) continue;
    uint32_t mask = zd__optim_family_mask(opt);
    zd__cuda_adam_args_t f = *a;
    f.optimizers = mask;
    int rc = launcher(opt)(l, &f, stream, err);
    if (rc) return rc;
    done |= mask;
  }
  return ZD_OK;
}

extern "C" unsigned zd__cuda_optim_grid(const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a,
                                        int optimizer) {
  int fam = family_of(optimizer);
  if (fam < 0 || !zd__dtype_ok(a->grad_dtype, ZD__DTYPE_GRAD)) return 0;
  if (a->param && !zd__dtype_ok(a->param_dtype, ZD__DTYPE_PARAM)) return 0;
  return grid_of(l, fam, (int)a->grad_dtype, a->param ? (int)a->param_dtype : 0);
}

template <int FAM>
static cudaError_t load_family() {
  static const int gdts[GDT_VARIANTS] = {ZD_F32, ZD_BF16, ZD_F16};
  static const int pdts[PDT_VARIANTS] = {ZD_F32, ZD_BF16, 0};
  for (int g = 0; g < GDT_VARIANTS; g++)
    for (int p = 0; p < PDT_VARIANTS; p++) {
      cudaFuncAttributes attr;
      cudaError_t e = cudaFuncGetAttributes(&attr, kernel_for<FAM>(gdts[g], pdts[p]));
      int n;
      if (e == cudaSuccess) e = occupancy(FAM, g, p, &n);
      if (e != cudaSuccess) return e;
    }
  return cudaSuccess;
}

cudaError_t zd__cuda_optim_preload(void) {
  cudaError_t e = load_family<FAM_SGD>();
  if (e == cudaSuccess) e = load_family<FAM_ADAGRAD>();
  if (e == cudaSuccess) e = load_family<FAM_RMSPROP>();
  if (e == cudaSuccess) e = load_family<FAM_LION>();
  return e;
}
