/* Device-side math of the CUDA optimizer kernels: the per-element update of kernels/adam.h and
 * the conversions it needs, written so that nvcc can neither fuse nor approximate anything.
 *
 * Every floating-point operation is an explicit IEEE round-to-nearest intrinsic: __fmaf_rn
 * exactly where adam.h's formula has fma(), __fmul_rn/__fadd_rn/__fsub_rn/__fdiv_rn/__fsqrt_rn for
 * every other operation (a plain `a * b + c` may become an FMA under nvcc's default -fmad=true; the
 * intrinsics are never contracted). Subnormals are kept as long as the file is built without
 * -ftz=true / --use_fast_math (the build passes -ftz=false -fmad=false explicitly). With those,
 * each element's result has exactly the bits of zd__adam_step_ref on x86-64, except that a NaN
 * result may differ in payload and sign (the GPU produces the canonical NaN 0x7fffffff).
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
} zd__dev_group_t;

static __device__ __forceinline__ zd__dev_group_t zd__dev_group(const zd__adam_group_t &c) {
  zd__dev_group_t g;
  g.c = c;
  g.decay = c.has_weight_decay && c.optimizer == ZD_ADAMW;
  g.l2 = c.has_weight_decay && c.optimizer == ZD_ADAM;
  g.torch2 = c.update == ZD_UPDATE_TORCH2;
  return g;
}

/* zd__amsgrad_max (adam.h): ATen's vectorised torch.maximum, a NaN as all ones. */
static __device__ __forceinline__ float zd__dev_amsgrad_max(float a, float b) {
  if (a != a || b != b) return __uint_as_float(0xffffffffu);
  return a > b ? a : b;
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
