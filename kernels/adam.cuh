/* Device-side math of the CUDA optimizer kernels: the per-element update of kernels/adam.h and
 * the conversions it needs, written so that nvcc can neither fuse nor approximate anything.
 *
 * Every floating-point operation is an explicit IEEE round-to-nearest intrinsic: __fmaf_rn
 * exactly where adam.h's formula has fma(), __fmul_rn/__fadd_rn/__fsub_rn/__fdiv_rn/__fsqrt_rn for
 * every other operation (a plain `a * b + c` may become an FMA under nvcc's default -fmad=true; the
 * intrinsics are never contracted). Subnormals are kept as long as the file is built without
 * -ftz=true / --use_fast_math (the build passes -ftz=false -fmad=false explicitly). With those,
 * each element's result has exactly the bits of zd__adam_step_ref on x86-64, except that a NaN
 * result may differ in payload and sign (the GPU produces the canonical NaN 0x7fffffff). The
 * formulas of torch 2.x's CUDA paths (ZD_UPDATE_TORCH2_CUDA*) use __fma_rn, __dmul_rn, __dadd_rn
 * and __double2float_rn for the double operations of torch's fused kernel.
 *
 * Shared by kernels/adam.cu and the GPU tests (which check the conversions exhaustively).
 */
#ifndef ZD_KERNELS_ADAM_CUH
#define ZD_KERNELS_ADAM_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "adam_cuda.h"

/* bf16 -> f32: the upper half of a float, exact. */
static __device__ __forceinline__ float zd__dev_bf16_to_f32(uint16_t h) {
  return __uint_as_float((uint32_t)h << 16);
}

/* f32 -> bf16, round to nearest even, any NaN -> 0x7fc0: zd__f32_to_bf16. (Not
 * __float2bfloat16_rn, whose NaN keeps the input's payload.) */
static __device__ __forceinline__ uint16_t zd__dev_f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if (isnan(f)) return 0x7fc0;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* f16 -> f32, exact: zd__f16_to_f32 bit for bit. The hardware conversion is exact for every
 * number; a NaN is rebuilt as the reference does (sign and payload kept, quiet bit set) rather
 * than trusting what cvt.f32.f16 makes of it. */
static __device__ __forceinline__ float zd__dev_f16_to_f32(uint16_t h) {
  if ((h & 0x7c00u) == 0x7c00u && (h & 0x03ffu))
    return __uint_as_float(((uint32_t)(h & 0x8000u) << 16) | 0x7fc00000u |
                           ((uint32_t)(h & 0x03ffu) << 13));
  return __half2float(__ushort_as_half(h));
}

/* to_f32(grad) of adam.h for a grad dtype (a template argument: ZD_F32, ZD_BF16, ZD_F16). */
template <int GDT>
static __device__ __forceinline__ float zd__dev_grad_to_f32(uint16_t h) {
  return GDT == ZD_BF16 ? zd__dev_bf16_to_f32(h) : zd__dev_f16_to_f32(h);
}

/* One group's constants with the flags the update branches on. */
typedef struct zd__dev_group {
  zd__adam_group_t c;
  bool decay;  /* AdamW with weight decay: p = p * decay */
  bool l2;     /* Adam with weight decay: g = fma(p, wd, g) */
  bool torch2; /* ZD_UPDATE_TORCH2: the first moment by lerp */
  bool cuda;   /* ZD_UPDATE_TORCH2_CUDA or _CUDA_FOREACH: torch's unfused CUDA kernels */
  bool fused;  /* ZD_UPDATE_TORCH2_CUDA_FUSED: torch's fused CUDA kernel */
} zd__dev_group_t;

static __device__ __forceinline__ zd__dev_group_t zd__dev_group(const zd__adam_group_t &c) {
  zd__dev_group_t g;
  g.c = c;
  g.decay = c.has_weight_decay && c.optimizer == ZD_ADAMW;
  g.l2 = c.has_weight_decay && c.optimizer == ZD_ADAM;
  g.torch2 = c.update == ZD_UPDATE_TORCH2;
  g.cuda = c.update == ZD_UPDATE_TORCH2_CUDA || c.update == ZD_UPDATE_TORCH2_CUDA_FOREACH;
  g.fused = c.update == ZD_UPDATE_TORCH2_CUDA_FUSED;
  return g;
}

/* zd__amsgrad_max (adam.h): ATen's vectorised torch.maximum, a NaN as all ones. */
static __device__ __forceinline__ float zd__dev_amsgrad_max(float a, float b) {
  if (a != a || b != b) return __uint_as_float(0xffffffffu);
  return a > b ? a : b;
}

/* zd__amsgrad_max_cuda (adam.h): torch.maximum's CUDA kernel, a NaN operand returned as it is. */
static __device__ __forceinline__ float zd__dev_amsgrad_max_cuda(float a, float b) {
  return (a != a || a > b) ? a : b;
}

/* TORCH2_CUDA and TORCH2_CUDA_FOREACH after the gradient (adam.h), as zd__adam_step_ref. */
static __device__ __forceinline__ void zd__dev_adam_cuda(float g, const zd__adam_group_t &c,
                                                         bool decay, bool l2, float &p, float &m,
                                                         float &v, float &vmax) {
  if (decay) p = __fmul_rn(p, c.decay);
  if (l2) g = __fmaf_rn(c.weight_decay, p, g);
  m = __fmaf_rn(c.lerp_weight, __fsub_rn(g, m), c.lerp_from_grad ? g : m);
  v = __fmaf_rn(c.one_minus_beta2, __fmul_rn(g, g), __fmul_rn(v, c.beta2));
  float s = v;
  if (c.amsgrad) s = vmax = zd__dev_amsgrad_max_cuda(vmax, v);
  float q = c.update == ZD_UPDATE_TORCH2_CUDA ? __fmul_rn(__fsqrt_rn(s), c.bias_correction2_rcp)
                                              : __fdiv_rn(__fsqrt_rn(s), c.bias_correction2_sqrt);
  float d = __fadd_rn(q, c.eps);
  p = __fmaf_rn(c.neg_step_size, __fdiv_rn(m, d), p);
}

/* TORCH2_CUDA_FUSED after the gradient (adam.h), as zd__adam_step_ref's fused_element: double
 * operations by their _rn intrinsics, __double2float_rn the one rounding to fp32 (float to double
 * is exact). */
static __device__ __forceinline__ void zd__dev_adam_fused(float g, const zd__adam_group_t &c,
                                                          bool decay, bool l2, float &p, float &m,
                                                          float &v, float &vmax) {
  if (decay) p = __double2float_rn(__fma_rn(-c.weight_decay_d, (double)p, (double)p));
  if (l2) g = __double2float_rn(__fma_rn((double)p, c.weight_decay_d, (double)g));
  m = __double2float_rn(__fma_rn(c.beta1_d, (double)m, __dmul_rn(c.one_minus_beta1_d, (double)g)));
  v = __double2float_rn(__fma_rn(c.beta2_d, (double)v,
                                 __dmul_rn(__dmul_rn(c.one_minus_beta2_d, (double)g), (double)g)));
  float s = v;
  if (c.amsgrad) s = vmax = (vmax < v ? v : vmax); /* std::max(vmax, v) */
  float q = __fdiv_rn(__fsqrt_rn(s), c.bias_correction2_sqrt);
  float d = __double2float_rn(__dadd_rn((double)q, c.eps_d));
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(c.neg_step_size, m), d));
}

/* The update of one element, operation for operation as zd__adam_step_ref. The sqrt is the
 * correctly rounded one: a group with ZD_SQRT_MKL_EX (an x86 instruction's approximation) is
 * refused by the launchers before it gets here. vmax (max_exp_avg_sq) is read and written only
 * by a group with amsgrad. */
static __device__ __forceinline__ void zd__dev_adam(float graw, float grad_scale,
                                                    const zd__dev_group_t &k, float &p, float &m,
                                                    float &v, float &vmax) {
  const zd__adam_group_t &c = k.c;
  float g = __fmul_rn(graw, grad_scale);
  if (c.negate_grad) g = -g;
  if (k.cuda) {
    zd__dev_adam_cuda(g, c, k.decay, k.l2, p, m, v, vmax);
    return;
  }
  if (k.fused) {
    zd__dev_adam_fused(g, c, k.decay, k.l2, p, m, v, vmax);
    return;
  }
  if (k.decay) p = __fmul_rn(p, c.decay);
  if (k.l2) g = __fmaf_rn(p, c.weight_decay, g);
  if (k.torch2)
    m = __fmaf_rn(c.lerp_weight, __fsub_rn(g, m), c.lerp_from_grad ? g : m);
  else
    m = __fmaf_rn(g, c.one_minus_beta1, __fmul_rn(m, c.beta1));
  v = __fmaf_rn(__fmul_rn(c.one_minus_beta2, g), g, __fmul_rn(v, c.beta2));
  float s = v;
  if (c.amsgrad) s = vmax = zd__dev_amsgrad_max(vmax, v);
  float d = __fadd_rn(__fdiv_rn(__fsqrt_rn(s), c.bias_correction2_sqrt), c.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(c.neg_step_size, m), d));
}

#endif /* ZD_KERNELS_ADAM_CUH */
