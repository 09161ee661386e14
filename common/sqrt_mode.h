/* The square roots of zd_sqrt_mode_t, one element at a time: the specification the optimizer
 * kernels follow (kernels/adam.h) and what zd_sqrt() exports to bindings, in one place so that the
 * two cannot drift apart.
 *
 * ZD_SQRT_MKL_EX is MKL's vsSqrt, high-accuracy, SSE4.2 ("EX") kernel, which PyPI's torch wheels
 * call for Tensor.sqrt on x86-64 CPUs that MKL does not dispatch as Intel's (docs/torch2/README.md:
 * disassembled from torch 2.15's libtorch_cpu, reproduced on every positive float). Per element,
 * no fma, each operation rounded to nearest even:
 *   r = rsqrtps(x); s = x * r; h = r * 0.5; e = 0.5 - s * h; s1 = s * e + s; h1 = h * e + h;
 *   d = x - s1 * s1; y = d * h1 + s1
 * except that x < FLT_MIN (zeros, subnormals), x > 0x7f7ff000 (the top of the range, inf, NaN)
 * and negative x take MKL's scalar path, which is correctly rounded. rsqrtps is an approximation
 * whose bits the CPU model decides, so the result is this CPU's: the same instruction must be used
 * everywhere (the wide paths use vrsqrtps, which gives the same bits as rsqrtss on one CPU, never
 * AVX-512's vrsqrt14ps, a different approximation).
 */
#ifndef ZD_COMMON_SQRT_MODE_H
#define ZD_COMMON_SQRT_MODE_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <xmmintrin.h>

/* Bits of x plus ZD__MKL_EX_BIAS, compared as int32_t: greater than ZD__MKL_EX_LIMIT for exactly
 * the special inputs above (MKL's own test: the addition wraps the positive normal range onto the
 * most negative int32 values). */
#define ZD__MKL_EX_BIAS  0x7f800000u
#define ZD__MKL_EX_LIMIT ((int32_t)0xfefff000u)

static inline float zd__sqrt_mkl_ex(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  if ((int32_t)(b + ZD__MKL_EX_BIAS) > ZD__MKL_EX_LIMIT) return sqrtf(x);
  const __m128 half = _mm_set_ss(0.5f);
  __m128 v = _mm_set_ss(x);
  __m128 r = _mm_rsqrt_ss(v);
  __m128 s = _mm_mul_ss(v, r);
  __m128 h = _mm_mul_ss(r, half);
  __m128 e = _mm_sub_ss(half, _mm_mul_ss(s, h));
  __m128 s1 = _mm_add_ss(_mm_mul_ss(s, e), s);
  __m128 h1 = _mm_add_ss(_mm_mul_ss(h, e), h);
  __m128 d = _mm_sub_ss(v, _mm_mul_ss(s1, s1));
  return _mm_cvtss_f32(_mm_add_ss(_mm_mul_ss(d, h1), s1));
}

#endif /* ZD_COMMON_SQRT_MODE_H */
