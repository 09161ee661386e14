/* The scalar reference of torch's fp32 2-norm order (grad_norm.h), whole and in parts, and the
 * dispatchers. Built with
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

float zd__norm_part_tail(zd__norm_state_t *st, const float *x, uint64_t n, uint64_t offset,
                         uint64_t end, float scale, zd__norm_order_t order) {
  uint64_t nv = n - n % 8;
  if (offset <= nv && (end > nv || end == n)) { /* the lanes end in this part */
    float s = st->acc[0];
    for (int j = 1; j < 8; j++) s = s + st->acc[j];
    st->acc[0] = s;
  }
  uint64_t m = n - nv, unfused = order == ZD__NORM_TORCH26 ? 0 : 4 * (m / 4);
  float s = st->acc[0];
  for (uint64_t i = offset > nv ? offset : nv; i < end; i++) {
    float v = x[i - offset] * scale;
    s = tail_add(s, v, i - nv, unfused);
    if (n == 1) st->acc[1] = v; /* 2.x's norm of one element is |x|: kept for the end */
  }
  if (end > nv) st->acc[0] = s;
  if (end != n) return 0;
  if (n == 1 && order != ZD__NORM_TORCH113) return fabsf(st->acc[1]);
  return sqrtf(s);
}

float zd__torch_norm2_part_ref(zd__norm_state_t *st, const float *x, uint64_t n, uint64_t offset,
                               uint64_t count, float scale, zd__norm_order_t order) {
  uint64_t nv = n - n % 8, end = offset + count, lim = end < nv ? end : nv;
  int lane_fma = order != ZD__NORM_TORCH215;
  for (uint64_t i = offset; i < lim; i++) {
    float v = x[i - offset] * scale, *a = &st->acc[i % 8];
    *a = lane_fma ? fmaf(v, v, *a) : *a + v * v;
  }
  return zd__norm_part_tail(st, x, n, offset, end, scale, order);
}

zd__norm_part_fn zd__torch_norm2_part_impl(zd__isa_t isa) {
  return isa >= ZD__ISA_AVX2 ? zd__torch_norm2_part_avx2 : zd__torch_norm2_part_ref;
}

zd__norm_fn zd__torch_norm2_impl(zd__isa_t isa) {
  return isa >= ZD__ISA_AVX2 ? zd__torch_norm2_avx2 : zd__torch_norm2_ref;
}

float zd__torch_norm2_total(zd__norm_fn fn, const float *norms, uint32_t nparams,
                            const uint8_t *present, zd__norm_order_t order, float *scratch) {
  if (!present) return fn(norms, nparams, order);
  uint32_t k = 0;
  for (uint32_t i = 0; i < nparams; i++)
    if (present[i / 8] >> (i % 8) & 1) scratch[k++] = norms[i];
  return fn(scratch, k, order);
}
