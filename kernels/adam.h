/* AdamW / Adam update of an fp32 master shard, and the gradient statistics a step needs.
 *
 * The scalar reference (zd__adam_step_ref) is the specification; the AVX2 and AVX-512 paths and
 * the CUDA kernel reproduce it bit for bit. Each group names the torch formula it follows
 * (zd_group_t.update, .sqrt_mode): ZD_UPDATE_TORCH113 reproduces torch.optim.AdamW and
 * torch.optim.Adam of torch 1.13 (the single-tensor path) bit for bit on x86-64, checked against
 * Debian's python3-torch 1.13.1; ZD_UPDATE_TORCH2 those of torch 2.x on CPU (the default
 * single-tensor path, which foreach=True equals on CPU), checked against PyPI's 2.6 and 2.15,
 * with ZD_SQRT_MKL_EX where that torch's sqrt is MKL's (docs/torch2/README.md).
 *
 * Per-step constants of a group, computed once on the host in double precision and rounded to
 * float, exactly as torch turns its Python-float hyperparameters into fp32 scalars
 * (zd__adam_group_init):
 *   decay  = (float)(1 - lr * weight_decay)          AdamW
 *   wd     = (float)weight_decay                     Adam
 *   b1 = (float)beta1,  a1 = (float)(1 - beta1)
 *   b2 = (float)beta2,  a2 = (float)(1 - beta2)
 *   bc2s   = (float)sqrt(1 - pow(beta2, t))          t: this step's number, from 1
 *   nss    = (float)(-(lr / (1 - pow(beta1, t))))
 *   e      = (float)eps
 * and with maximize (torch's maximize=True: the update follows -grad), a1 = -a1 and wd = -wd
 * for ZD_UPDATE_TORCH113; ZD_UPDATE_TORCH2 and the CUDA formulas (below) negate the gradient
 * itself. For ZD_UPDATE_TORCH2, _CUDA and _CUDA_FOREACH also the weight of torch's lerp,
 * w = (float)(1 - beta1), as
 *   lerp_weight = w, lerp_from_grad = 0   if w < 0.5
 *   lerp_weight = w - 1 (exact), lerp_from_grad = 1   otherwise
 *
 * Per element, in fp32 with round-to-nearest-even; fma() is one fused multiply-add (one
 * rounding), every other operation rounds on its own (kernels are built with -ffp-contract=off):
 *   g  = to_f32(grad) * grad_scale                   (grad_scale: unscale / mean / clip factor)
 *   TORCH2 with maximize:      g = -g
 *   AdamW, weight_decay != 0:  p = p * decay
 *   Adam,  weight_decay != 0:  g = fma(p, wd, g)
 *   TORCH113:  m = fma(g, a1, m * b1)
 *   TORCH2:    m = fma(lerp_weight, g - m, lerp_from_grad ? g : m)
 *   v  = fma(a2 * g, g, v * b2)
 *   amsgrad:   vmax = MAX(vmax, v), s = vmax;   else s = v
 *   d  = SQRT(s) / bc2s + e                          SQRT: sqrtf, or zd__sqrt_mkl_ex (sqrt_mode.h)
 *   p  = p + (nss * m) / d
 *   param_out = p as f32, or as bf16 rounded to nearest even (NaN -> 0x7fc0, as torch)
 * grad is f32, bf16 (upper half of an f32) or f16 (IEEE binary16, converted exactly); the
 * conversions are common/dtype.h's.
 *
 * torch 2.x on CUDA (ZD_UPDATE_TORCH2_CUDA, _CUDA_FOREACH, _CUDA_FUSED): the formulas of torch's
 * own CUDA kernels, read from its sources (optim/adam.py; aten/src/ATen/native/cuda: Lerp.h,
 * PointwiseOpsKernel.cu, BinaryDivTrueKernel.cu, ForeachPointwiseOp.cu,
 * ForeachBinaryOpScalarList.cu, MaxMinElementwiseKernel.cu, ForeachMinMaxFunctors.cuh,
 * fused_adam_utils.cuh). torch builds them with nvcc's default -fmad=true, so `a + b * c` inside
 * one of its kernels is one fma, while each separate kernel (each torch op) rounds its result to
 * fp32. The constants are those above, plus (zd__adam_group_init):
 *   bc2_rcp = 1.0f / bc2s   (fp32 division)   TORCH2_CUDA: torch's div by a CPU scalar multiplies
 *                                             by its fp32 reciprocal (BinaryDivTrueKernel.cu)
 * and for TORCH2_CUDA_FUSED, whose kernel takes the hyperparameters as C++ doubles:
 *   B1 = beta1, A1 = 1 - beta1, B2 = beta2, A2 = 1 - beta2, E = eps     (doubles)
 *   WD = lr * weight_decay (AdamW) or weight_decay (Adam)              (double)
 *   bc1    = (float)(1 - pow(beta1, t))       the kernel's opmath_t (fp32) bias corrections
 *   bc2s   = (float)sqrt(1 - pow(beta2, t))   (as above)
 *   nss    = -(float)(lr / (double)bc1)       its fp32 step_size, negated (exact)
 * Per element, sqrt_mode ignored (the correctly rounded sqrtf of a GPU), g as above (maximize
 * negates it, as TORCH2):
 *   TORCH2_CUDA and TORCH2_CUDA_FOREACH (the same per-element kernels, one per op, except d):
 *     AdamW, weight_decay != 0:  p = p * decay                   (mul_ / _foreach_mul_)
 *     Adam,  weight_decay != 0:  g = fma(wd, p, g)               (add(alpha=wd): a + alpha * b)
 *     m  = TORCH2's lerp                                         (lerp_ / _foreach_lerp_)
 *     v  = fma(a2, g * g, v * b2)                                (mul_, then addcmul_: a +
 *                                                                 value * (b * c), g*g rounded)
 *     amsgrad:   vmax = MAXC(vmax, v), s = vmax;   else s = v    (maximum / _foreach_maximum_)
 *     TORCH2_CUDA:          d = sqrtf(s) * bc2_rcp + e           (div by a CPU scalar, add_)
 *     TORCH2_CUDA_FOREACH:  d = sqrtf(s) / bc2s + e              (_foreach_div_ by a scalar list
 *                                                                 divides truly; _foreach_add_)
 *     p  = fma(nss, m / d, p)                                    (addcdiv_: a + value * (b / c))
 *   TORCH2_CUDA_FUSED (one kernel, fused_adam_utils.cuh adam_math; double operations marked D,
 *   rounded to double, and (float) rounds a double to fp32 once):
 *     AdamW, weight_decay != 0:  p = (float)fmaD(-WD, p, p)       (param -= lr * wd * param)
 *     Adam,  weight_decay != 0:  g = (float)fmaD(p, WD, g)        (grad += param * wd)
 *     m  = (float)fmaD(B1, m, A1 *D g)                            (beta1 * m + (1 - beta1) * g)
 *     v  = (float)fmaD(B2, v, (A2 *D g) *D g)                     (beta2 * v + (1 - beta2) * g * g)
 *     amsgrad:   vmax = MAXF(vmax, v), s = vmax;   else s = v     (std::max)
 *     d  = (float)((double)(sqrtf(s) / bc2s) +D E)                (fp32 quotient, + eps in double)
 *     p  = p + (nss * m) / d                                      (p -= step_size * m / d, fp32)
 * where MAXC(a, b) = (a is NaN or a > b) ? a : b (torch.maximum's CUDA kernel returns a NaN operand
 * itself) and MAXF(a, b) = a < b ? b : a (std::max: a NaN b leaves a). The fused kernel's two
 * products summed (m, v) are contracted by nvcc into one fma; which of the two products it fuses
 * is the compiler's choice, taken here as LLVM's (the first operand's). Where the two products
 * nearly cancel the choice shows in the fp32 result (an uncontracted form differed from this one
 * in about one element in 10^4 per step of the conformance matrix's emulation):
 * tests/python/test_torch_cuda.py's probe names the form torch's build computes. Its pow() is
 * CUDA's double pow (within 2 ULP of the exact power) where zerod takes the
 * host's: their fp32 bias corrections differ only when 1 - pow lies that close to a rounding
 * boundary of fp32 (never seen; about once in 2^28 steps). The CPU backends run these three
 * formulas through the scalar reference only: they are meant for CUDA parameters.
 *
 * torch 2.x's lerp (aten/src/ATen/native/Lerp.h, vectorised with fma on AVX2 and AVX-512 builds)
 * computes m + w * (g - m) for |w| < 0.5 and g - (g - m) * (1 - w) otherwise; its vector body
 * fuses both into the two fma above. Its scalar tail (the last n % 16 elements of a tensor)
 * computes the second form unfused, which gives the same value except for the sign of a zero
 * result (seen only with beta1 = 0 and a zero gradient): the one known difference from torch 2.x.
 * amsgrad is torch's `torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)` (1.13 and
 * 2.x alike), whose vector body (ATen's Vectorized<float>::maximum, AVX2 and AVX-512) is
 * max_ps(vmax, v) OR-ed with the all-ones mask of the unordered lanes: MAX(a, b) = a > b ? a : b,
 * and 0xffffffff (a NaN) when either is NaN (zd__amsgrad_max). C's fmaxf would drop the NaN.
 * torch's scalar tail returns 0x7fc00000 for a NaN and a for two zeros, so the two differ only in
 * a NaN's bits and, for zeros of opposite signs, in a zero's sign: v is never -0 (its product term
 * is +0 or positive), so only a -0 put into vmax from outside could show it. vmax starts at +0
 * (torch.zeros_like) and exists only where the model has the array (zd__adam_args_t).
 *
 * ZD_UPDATE_TORCH2 negates g for maximize as torch does instead of folding the sign into the
 * constants: folded, the lerp's second form would be -fma(w - 1, x + m, x), whose exact zeros have
 * the other sign than torch's. The negation is exact and costs one xor.
 *
 * ZD_UPDATE_TORCH113's maximize needs no per-element code: negating a1 and wd is torch's negated
 * gradient, exactly. torch computes m = fma(-g, a1, m * b1), and fma(-g, a1, x) == fma(g, -a1, x)
 * (the product's sign is the same, and fma rounds once); v = fma(a2 * -g, -g, v * b2) is v with g
 * (the signs cancel). Adam adds the penalty to the negated gradient: g' = fma(p, wd, -g); zerod's x
 * = fma(p, -wd, g) is -g' (rounding to nearest is symmetric), and m = fma(x, -a1, m * b1), v =
 * fma(a2 * x, x, v * b2) are torch's. One case differs, in the sign of a zero only: when -g and wd
 * * p cancel exactly (two zeros of opposite signs included), g' and x are both +0, so x * -a1 is -0
 * where g' * a1 is +0; if m * b1 is -0 too (which takes an underflow or an earlier -0 moment),
 * torch's m is +0 and zerod's -0 (and, through it, the sign of a parameter that is itself a zero
 * may differ). tests/unit/test_adam.c checks the folding bit for bit, that case included.
 *
 * Gradient statistics (zd__grad_stats_*): the sum of squares of to_f32(grad) (before grad_scale)
 * and the count of non-finite values, over the elements covered by segments. The sum is in double
 * (a float's square is exact in double) in a fixed order that does not depend on the ISA or the
 * number of threads: the range is cut into blocks of ZD__STATS_BLOCK elements (block k covers
 * offsets [k*ZD__STATS_BLOCK, (k+1)*ZD__STATS_BLOCK) of the range); within a block, element i
 * adds its square to lane (i mod 16) in increasing i; the block's sum is the lanes combined as
 * a binary tree: s8[j] = lane[j] + lane[j+8], s4[j] = s8[j] + s8[j+4], s2[j] = s4[j] + s4[j+2],
 * sum = s2[0] + s2[1]. The block sums of a range are then added pairwise by levels
 * (zd__grad_stats_sum): level 0 is the block sums x[0..n); level j+1 has x'[i] = x[2i] + x[2i+1],
 * or x'[i] = x[2i] when 2i+1 is past the level's end; the last level's one value is the range's
 * sum (0.0 for no blocks). Equivalently, the sum of x[lo, lo + 2^j) clipped to n is the sum of
 * its halves when the right half starts before n, else of its left half, so any 2^k consecutive
 * values from a multiple of 2^k are a complete subtree: a GPU may reduce chunks of 2^k on their
 * own and then the chunks' sums by the same rule, with the same bits. The depth is log2(n), not
 * n, so the adds run in parallel. Ranges (a rank's buckets) are added in call order by the
 * caller, ranks in rank order (daemon/step/step.c).
 */
#ifndef ZD_KERNELS_ADAM_H
#define ZD_KERNELS_ADAM_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "dtype.h"
#include "segment.h"
#include "state.h"
#include "sqrt_mode.h"
#include "zerod/zerod.h"

#define ZD__STATS_BLOCK 2048

/* fp32 constants of one group for one step (see above), for every optimizer of the table
 * (kernels/optim.h): zd__adam_group_init fills those of the group's optimizer. */
typedef struct zd__adam_group {
  int optimizer;        /* ZD_ADAMW or ZD_ADAM */
  int has_weight_decay; /* weight_decay != 0: apply decay (AdamW) or wd (Adam) */
  float decay;
  float weight_decay;           /* negated with maximize */
  float beta1, one_minus_beta1; /* one_minus_beta1 negated with maximize */
  float beta2, one_minus_beta2;
  float bias_correction2_sqrt;
  float neg_step_size;
  float eps;
  float lerp_weight;          /* TORCH2 */
  uint8_t update;             /* zd_update_t */
  uint8_t sqrt_mode;          /* zd_sqrt_mode_t */
  uint8_t lerp_from_grad;     /* TORCH2: the lerp's second form (w >= 0.5) */
  uint8_t negate_grad;        /* TORCH2 with maximize */
  uint8_t amsgrad;            /* the denominator takes max_exp_avg_sq */
  float bias_correction2_rcp; /* TORCH2_CUDA: 1.0f / bias_correction2_sqrt, in fp32 */
  /* TORCH2_CUDA_FUSED: the hyperparameters as doubles (B1, A1, B2, A2, WD, E above) */
  double beta1_d, one_minus_beta1_d, beta2_d, one_minus_beta2_d;
  double weight_decay_d; /* lr * weight_decay (AdamW) or weight_decay (Adam) */
  double eps_d;
  /* SGD (kernels/sgd.c; the optimizers' table: kernels/optim.h): weight_decay,
   * has_weight_decay and negate_grad above, and */
  float momentum;         /* (float)momentum */
  float dampening_weight; /* (float)(1 - dampening) */
  float neg_lr;           /* (float)-lr */
  uint8_t has_momentum;   /* momentum != 0 */
  uint8_t nesterov;
  uint8_t momentum_first; /* step 1: the buffer is this step's d_p (torch's clone) */
  /* Adagrad (kernels/adagrad.c): weight_decay, has_weight_decay, negate_grad, eps, sqrt_mode
   * above, and */
  float neg_clr;     /* (float)-(lr / (1 + (step - 1) * lr_decay)) */
  float init_sum;    /* (float)initial_accumulator_value */
  uint8_t sum_first; /* step 1: sum starts at init_sum (torch's full_like) */
  /* RMSprop (kernels/rmsprop.c): weight_decay, has_weight_decay, negate_grad, eps, sqrt_mode,
   * momentum, has_momentum, neg_lr, lerp_weight and lerp_from_grad (TORCH2's grad_avg) above,
   * and */
  float alpha;           /* (float)alpha */
  float one_minus_alpha; /* (float)(1 - alpha) */
  uint8_t centered;
} zd__adam_group_t;

/* One of the three formulas of torch 2.x's CUDA paths (ZD_UPDATE_TORCH2_CUDA*), which the CPU
 * backends compute with the scalar reference only. */
static inline int zd__update_is_cuda(int update) {
  return update == ZD_UPDATE_TORCH2_CUDA || update == ZD_UPDATE_TORCH2_CUDA_FOREACH ||
         update == ZD_UPDATE_TORCH2_CUDA_FUSED;
}

/* MAX of the amsgrad formula above: ATen's vectorised torch.maximum(a, b), a NaN as all ones. */
static inline float zd__amsgrad_max(float a, float b) {
  if (a != a || b != b) {
    uint32_t ones = 0xffffffffu;
    float nan;
    memcpy(&nan, &ones, sizeof nan);
    return nan;
  }
  return a > b ? a : b;
}

/* MAXC of the CUDA formulas above: torch.maximum's CUDA kernel (and _foreach_maximum_'s), a NaN
 * operand returned as it is. */
static inline float zd__amsgrad_max_cuda(float a, float b) {
  return (a != a || a > b) ? a : b;
}

/* MAXF of TORCH2_CUDA_FUSED: std::max(a, b) of torch's fused kernel. */
static inline float zd__amsgrad_max_fused(float a, float b) {
  return a < b ? b : a;
}

/* Computes the constants of `hp` for step number `step` (1 for the first step), for hp's
 * optimizer (kernels/optim.c: the table's zd__<k>_consts; zd__adam_consts is AdamW/Adam's). */
void zd__adam_group_init(zd__adam_group_t *c, const zd_group_t *hp, uint64_t step);
void zd__adam_consts(zd__adam_group_t *c, const zd_group_t *hp, uint64_t step);

/* One kernel call: a contiguous range of a shard. All pointers address the start of the range;
 * segment offsets are relative to it. */
typedef struct zd__adam_args {
  /* The shard's state arrays by role (common/state.h): master, exp_avg and exp_avg_sq, and
   * max_exp_avg_sq, NULL when the model has none (required by a group with amsgrad). */
  float *state[ZD__NSTATES];
  /* Where the update reads each state array from: NULL (the common case) reads state[s] and
   * writes it back in place; else the update reads src[s] and writes state[s] (out of place:
   * the overlapped update reads the committed set and writes the other, daemon/step/model.h),
   * with the same bits either way. An array a call does not write (max_exp_avg_sq of a group
   * without amsgrad) is not copied: the caller copies it where it must. */
  const float *src[ZD__NSTATES];
  const void *grad;
  zd_dtype_t grad_dtype;  /* ZD_F32, ZD_BF16, ZD_F16 */
  void *param;            /* working parameters written back; NULL: none */
  zd_dtype_t param_dtype; /* ZD_F32, ZD_BF16 */
  float grad_scale;
  const zd__segment_t *segs;
  uint32_t nsegs;
  const zd__adam_group_t *groups; /* indexed by segment group */
} zd__adam_args_t;

/* The array an update reads state s from (zd__adam_args_t.src). */
static inline const float *zd__adam_src(const zd__adam_args_t *a, zd__state_t s) {
  return a->src[s] ? a->src[s] : a->state[s];
}

/* Instruction sets of the CPU paths, best last. avx512bf16 is the AVX-512 path with its bf16
 * working parameters rounded by vcvtneps2bf16 (same results: adam_avx512.c). */
typedef enum zd__isa {
  ZD__ISA_SCALAR = 0,
  ZD__ISA_AVX2 = 1,
  ZD__ISA_AVX512 = 2,
  ZD__ISA_AVX512BF16 = 3,
} zd__isa_t;
#define ZD__ISA_BEST ZD__ISA_AVX512BF16

/* Best ISA this CPU runs (AVX2 needs AVX2+FMA+F16C; AVX-512 needs F, BW, VL and DQ;
 * avx512bf16 also AVX512_BF16). */
zd__isa_t zd__isa_detect(void);
const char *zd__isa_name(zd__isa_t isa);
/* Parses "auto", "scalar", "avx2", "avx512", "avx512bf16"; -1 if unknown. "auto" gives
 * zd__isa_detect(). */
int zd__isa_parse(const char *name);

/* Updates the covered elements in [begin, end) (offsets in the range; any values, not only
 * multiples of a vector width). Calls on disjoint [begin, end) may run concurrently. */
typedef void (*zd__adam_fn)(const zd__adam_args_t *a, uint64_t begin, uint64_t end);
void zd__adam_step_ref(const zd__adam_args_t *a, uint64_t begin, uint64_t end);
/* The implementation for an ISA; an ISA the CPU lacks must not be asked for. */
zd__adam_fn zd__adam_impl(zd__isa_t isa);

/* Writes the sum of squares of blocks [block_begin, block_end) into sums[k - block_begin] and adds
 * their non-finite count to *nonfinite. n: elements in the range. */
typedef void (*zd__stats_fn)(const void *grad, zd_dtype_t dtype, const zd__segment_t *segs,
                             uint32_t nsegs, uint64_t n, uint64_t block_begin, uint64_t block_end,
                             double *sums, uint64_t *nonfinite);
void zd__grad_stats_ref(const void *grad, zd_dtype_t dtype, const zd__segment_t *segs,
                        uint32_t nsegs, uint64_t n, uint64_t block_begin, uint64_t block_end,
                        double *sums, uint64_t *nonfinite);
zd__stats_fn zd__grad_stats_impl(zd__isa_t isa);

/* Blocks in a range of n elements. */
static inline uint64_t zd__stats_blocks(uint64_t n) {
  return (n + ZD__STATS_BLOCK - 1) / ZD__STATS_BLOCK;
}

/* Adds block sums in the fixed order above (pairwise by levels). Allocates nothing. */
double zd__grad_stats_sum(const double *sums, uint64_t nblocks);

/* Internals shared by adam.c and the wide paths (adam_avx2.c, adam_avx512.c), which are built with
 * their ISA's flags and must only be called through zd__adam_impl / zd__grad_stats_impl. */

/* The wide paths write the working parameters with non-temporal (streaming) stores when one call
 * spans at least this many elements: such an output is larger than a core's L2, nothing reads it
 * back during the step, and streaming skips the read-for-ownership of every line it overwrites
 * (about 40% more step throughput at 2^25 params on the machine this was tuned on, bench_adam).
 * Smaller calls keep it in cache. A call that streamed ends with a store fence, so its stores are
 * ordered before whatever the caller does next (e.g. signalling completion). */
#define ZD__ADAM_NT_MIN ((uint64_t)1 << 16)

/* The wide paths' main loops prefetch each input stream this many elements ahead (2 KiB of an f32
 * stream): the hardware prefetchers alone leave the step 7-15% short of the bus on the machine it
 * was tuned on (bench_adam, 2-core Sapphire Rapids VM), and the statistics 20% short. Prefetches
 * past a segment's end are harmless: they never fault and touch only the cache. */
#define ZD__ADAM_PREFETCH 512

/* Index of the first segment that ends after `begin` (nsegs if none): where a call on
 * [begin, end) starts walking the sorted segment list. */
uint32_t zd__segs_find(const zd__segment_t *segs, uint32_t nsegs, uint64_t begin);

void zd__adam_step_avx2(const zd__adam_args_t *a, uint64_t begin, uint64_t end);
void zd__adam_step_avx512(const zd__adam_args_t *a, uint64_t begin, uint64_t end);
void zd__adam_step_avx512bf16(const zd__adam_args_t *a, uint64_t begin, uint64_t end);
void zd__grad_stats_avx2(const void *grad, zd_dtype_t dtype, const zd__segment_t *segs,
                         uint32_t nsegs, uint64_t n, uint64_t block_begin, uint64_t block_end,
                         double *sums, uint64_t *nonfinite);
void zd__grad_stats_avx512(const void *grad, zd_dtype_t dtype, const zd__segment_t *segs,
                           uint32_t nsegs, uint64_t n, uint64_t block_begin, uint64_t block_end,
                           double *sums, uint64_t *nonfinite);

#endif /* ZD_KERNELS_ADAM_H */
