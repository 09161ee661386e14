/* The scalar reference of torch's fp32 2-norm order (grad_norm.h) and the dispatcher. Built with
 * -ffp-contract=off: every product and sum below rounds on its own unless written as fmaf. */
#include "grad_norm.h"

#include <math.h>

/* One tail element: the first `unfused` of the tail add a rounded product, the rest an fma. */
static float tail_add(float s, float v, uint64_t k, uint64_t unfused) {
  if (k < unfused) return s + v * v;
  return fmaf(v, v, s);
}

float zd__torch_norm2_ref(const float *x, uint64_t n, zd__norm_order_t order) {
  if (n == 1 && order != ZD__NORM_TORCH113) return fabsf(x[0]);
  int lane_fma = order != ZD__NORM_TORCH215;
  float acc[8] = {0};
  uint64_t nv = n - n % 8, d = 0;
  for (; d < nv; d += 8)
    for (int j = 0; j < 8; j++) {
      float v = x[d + j];
      acc[j] = lane_fma ? fmaf(v, v, acc[j]) : acc[j] + v * v;
    }
  float s = acc[0];
  for (int j = 1; j < 8; j++) s = s + acc[j];
  uint64_t m = n - nv, unfused = order == ZD__NORM_TORCH26 ? 0 : 4 * (m / 4);
  for (uint64_t k = 0; k < m; k++) s = tail_add(s, x[nv + k], k, unfused);
  return sqrtf(s);
}

zd__norm_fn zd__torch_norm2_impl(zd__isa_t isa) {
  return isa >= ZD__ISA_AVX2 ? zd__torch_norm2_avx2 : zd__torch_norm2_ref;
}
