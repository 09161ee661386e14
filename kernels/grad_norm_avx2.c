/* The AVX2 path of torch's fp32 2-norm order (grad_norm.h), whole and in parts: the 8 lanes are one
 * __m256, which is what torch's kernel is, so one load and one fma (or mul + add) per 8 elements;
 * the lanes and the tail are done as the reference does them. Built with -mavx2 -mfma and
 * -ffp-contract=off, so the mul + add of ZD__NORM_TORCH215 stays two roundings; called only through
 * zd__torch_norm2_impl once zd__isa_detect() has said the CPU runs AVX2. */
#include <immintrin.h>
#include <math.h>

#include "grad_norm.h"

float zd__torch_norm2_avx2(const float *x, uint64_t n, zd__norm_order_t order) {
  if (n == 1 && order != ZD__NORM_TORCH113) return fabsf(x[0]);
  uint64_t nv = n - n % 8, d = 0;
  __m256 acc = _mm256_setzero_ps();
  if (order == ZD__NORM_TORCH215) {
    for (; d < nv; d += 8) {
      __m256 v = _mm256_loadu_ps(x + d);
      acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
  } else {
    for (; d < nv; d += 8) {
      __m256 v = _mm256_loadu_ps(x + d);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  float s = lanes[0];
  for (int j = 1; j < 8; j++) s = s + lanes[j];
  uint64_t m = n - nv, unfused = order == ZD__NORM_TORCH26 ? 0 : 4 * (m / 4);
  for (uint64_t k = 0; k < m; k++) {
    float v = x[nv + k];
    s = k < unfused ? s + v * v : fmaf(v, v, s);
  }
  return sqrtf(s);
}

/* The parts: the elements before the next multiple of 8 one by one, then whole vectors whose lane
 * j is the tensor's lane j, then the rest one by one; past the lanes, as the reference. */
float zd__torch_norm2_part_avx2(zd__norm_state_t *st, const float *x, uint64_t n, uint64_t offset,
                                uint64_t count, float scale, zd__norm_order_t order) {
  uint64_t nv = n - n % 8, end = offset + count, lim = end < nv ? end : nv, i = offset;
  int lane_fma = order != ZD__NORM_TORCH215;
  for (; i < lim && (i & 7); i++) {
    float v = x[i - offset] * scale, *a = &st->acc[i & 7];
    *a = lane_fma ? fmaf(v, v, *a) : *a + v * v;
  }
  if (i + 8 <= lim) {
    __m256 acc = _mm256_loadu_ps(st->acc), s = _mm256_set1_ps(scale);
    if (lane_fma) {
      for (; i + 8 <= lim; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + (i - offset)), s);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
    } else {
      for (; i + 8 <= lim; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + (i - offset)), s);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
      }
    }
    _mm256_storeu_ps(st->acc, acc);
  }
  for (; i < lim; i++) {
    float v = x[i - offset] * scale, *a = &st->acc[i & 7];
    *a = lane_fma ? fmaf(v, v, *a) : *a + v * v;
  }
  return zd__norm_part_tail(st, x, n, offset, end, scale, order);
}
