/* Element access by dtype for the tests: read and write one element of an f32, bf16 or f16 buffer
 * as a float, with the same conversions as zerod (common/dtype.h). Writing f16 rounds to nearest
 * even; values beyond the f16 range become inf, which the loss-scaling tests rely on. And the
 * reference step the training tests compare zerod with. */
#ifndef ZD_TESTS_DTYPE_REF_H
#define ZD_TESTS_DTYPE_REF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "adam.h"

static inline uint16_t zdt_f32_to_f16(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  uint32_t sign = (x >> 16) & 0x8000u, u = x & 0x7fffffffu;
  if (u >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (u > 0x7f800000u ? 0x200u : 0));
  if (u < 0x38800000u) /* below the smallest normal half: multiples of 2^-24 */
    return (uint16_t)(sign | (uint32_t)nearbyintf(fabsf(f) * 16777216.0f));
  uint32_t r = u + 0xfffu + ((u >> 13) & 1u); /* round the mantissa to 10 bits, ties to even */
  uint32_t e = (r >> 23) - 112u;
  if (e >= 31) return (uint16_t)(sign | 0x7c00u);
  return (uint16_t)(sign | (e << 10) | ((r >> 13) & 0x3ffu));
}

static inline float zdt_load(const void *buf, zd_dtype_t dt, uint64_t i) {
  if (dt == ZD_F32) return ((const float *)buf)[i];
  if (dt == ZD_BF16) return zd__bf16_to_f32(((const uint16_t *)buf)[i]);
  return zd__f16_to_f32(((const uint16_t *)buf)[i]);
}

static inline void zdt_store(void *buf, zd_dtype_t dt, uint64_t i, float v) {
  if (dt == ZD_F32)
    ((float *)buf)[i] = v;
  else if (dt == ZD_BF16)
    ((uint16_t *)buf)[i] = zd__f32_to_bf16(v);
  else
    ((uint16_t *)buf)[i] = zdt_f32_to_f16(v);
}

/* The reference optimizer step of one parameter held in fp32 (master, moments, gradient as zerod
 * read it), with hyperparameters g at step number `step` (from 1): what the tests compare zerod's
 * parameters with. */
static inline void zdt_ref_step(float *master, float *m, float *v, const float *grad, uint64_t n,
                                const zd_group_t *g, uint64_t step, float grad_scale) {
  zd__adam_group_t consts;
  zd__adam_group_init(&consts, g, step);
  zd__segment_t seg = {.offset = 0, .length = n, .group = 0};
  zd__adam_args_t a = {.state[ZD__STATE_MASTER] = master,
                       .state[ZD__STATE_EXP_AVG] = m,
                       .state[ZD__STATE_EXP_AVG_SQ] = v,
                       .grad = grad,
                       .grad_dtype = ZD_F32,
                       .param_dtype = ZD_F32,
                       .grad_scale = grad_scale,
                       .segs = &seg,
                       .nsegs = 1,
                       .groups = &consts};
  zd__adam_step_ref(&a, 0, n);
}

#endif /* ZD_TESTS_DTYPE_REF_H */
