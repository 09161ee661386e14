/* The per-ISA frame of an optimizer's kernel file (kernels/<k>.c, a row of the table in
 * kernels/optim.h), in one place, so that a kernel file holds its formula and nothing else.
 *
 * kernels/meson.build builds each kernel file once per CPU instruction set: without ISA flags
 * (the scalar reference, which also carries the file's constants and table functions) and with
 * each wide ISA's flags and -DZD_OPTIM_ISA=<isa>. Every build computes the same formula element
 * by element in the same order, with fmaf() where it fuses and -ffp-contract=off everywhere else,
 * so the wide builds (the compiler's vectorisation of the same loop, fmaf as vfmadd) give the
 * reference's bits; tests/unit/test_optim.c checks each ISA against the reference.
 *
 * A kernel file includes this header and:
 *   - writes `static inline ZD__OPTIM_INLINE void <k>_range(a, c, lo, hi, gd, out, flags...)`,
 *     its update of one segment's [lo, hi) for grad dtype gd and output out (0 none, 1 f32,
 *     2 bf16), loads reading zd__optim_grad() and zd__optim_flip() as it needs;
 *   - writes `static inline ZD__OPTIM_INLINE void <k>_segment(a, c, lo, hi)`, one segment's
 *     [lo, hi) with its group's constants c: ZD__OPTIM_CALL(<k>_range, flags...) with the
 *     segment's flags as constants (one loop per combination);
 *   - writes ZD__OPTIM_SEGMENTS(k), which defines this build's step function
 *     (ZD__OPTIM_STEP(k), optim.h's zd__<k>_step_<isa>): the walk over the segments of
 *     [begin, end), the same for every kernel, calling <k>_segment for each (inlined: the loops
 *     are the kernel's own, as written in place);
 *   - inside #ifdef ZD_OPTIM_REFERENCE, defines zd__<k>_consts and zd__<k>_writes (optim.h) and
 *     writes ZD__OPTIM_IMPL(k), the ISA switch.
 */
#ifndef ZD_KERNELS_OPTIM_KERNEL_H
#define ZD_KERNELS_OPTIM_KERNEL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtype.h"
#include "optim.h"

#ifndef ZD_OPTIM_ISA
#define ZD_OPTIM_ISA       ref
#define ZD_OPTIM_REFERENCE 1
#endif
#define ZD__OPTIM_CAT2(a, b) a##b
#define ZD__OPTIM_CAT(a, b)  ZD__OPTIM_CAT2(a, b)
/* This build's step function of kernel family k: zd__<k>_step_<isa>. */
#define ZD__OPTIM_STEP(k) ZD__OPTIM_CAT(zd__##k##_step_, ZD_OPTIM_ISA)
#define ZD__OPTIM_INLINE  __attribute__((always_inline))

/* The sign bit flipped when mask is 0x80000000: torch's exact negation (maximize). */
static inline float zd__optim_flip(float x, uint32_t mask) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  u ^= mask;
  memcpy(&x, &u, sizeof x);
  return x;
}

/* a where mask is all ones, b where it is 0: a select on the bits, which the loops vectorise
 * (gcc does not if-convert a floating-point ?: on a run-time flag; the loop stays scalar). */
static inline float zd__optim_pick(uint32_t mask, float a, float b) {
  uint32_t ua, ub;
  memcpy(&ua, &a, sizeof ua);
  memcpy(&ub, &b, sizeof ub);
  ua = (ua & mask) | (ub & ~mask);
  memcpy(&a, &ua, sizeof a);
  return a;
}

/* Element i of a gradient of dtype `dtype`, as fp32. */
static inline ZD__OPTIM_INLINE float zd__optim_grad(const void *grad, zd_dtype_t dtype,
                                                    uint64_t i) {
  if (dtype == ZD_BF16) return zd__bf16_to_f32(((const uint16_t *)grad)[i]);
  if (dtype == ZD_F16) return zd__f16_to_f32(((const uint16_t *)grad)[i]);
  return ((const float *)grad)[i];
}

/* RANGE(a, c, lo, hi, gd, out, ...) with the gradient's dtype gd and the output out (0: no
 * working parameters, 1: f32, 2: bf16) as constants: one loop each. a, c, lo and hi are the
 * caller's variables of those names. */
#define ZD__OPTIM_CALL_OUT(RANGE, gd, ...)     \
  do {                                         \
    if (!a->param)                             \
      RANGE(a, c, lo, hi, gd, 0, __VA_ARGS__); \
    else if (a->param_dtype == ZD_BF16)        \
      RANGE(a, c, lo, hi, gd, 2, __VA_ARGS__); \
    else                                       \
      RANGE(a, c, lo, hi, gd, 1, __VA_ARGS__); \
  } while (0)
#define ZD__OPTIM_CALL(RANGE, ...)                     \
  do {                                                 \
    if (a->grad_dtype == ZD_BF16)                      \
      ZD__OPTIM_CALL_OUT(RANGE, ZD_BF16, __VA_ARGS__); \
    else if (a->grad_dtype == ZD_F16)                  \
      ZD__OPTIM_CALL_OUT(RANGE, ZD_F16, __VA_ARGS__);  \
    else                                               \
      ZD__OPTIM_CALL_OUT(RANGE, ZD_F32, __VA_ARGS__);  \
  } while (0)

/* This build's step function of family k: each segment of [begin, end) clipped to it, with its
 * group's constants, to the file's k##_segment (always inlined, so the walk costs what it cost
 * written out in each file). */
#define ZD__OPTIM_SEGMENTS(k)                                                          \
  void ZD__OPTIM_STEP(k)(const zd__adam_args_t *a, uint64_t begin, uint64_t end) {     \
    for (uint32_t s = zd__segs_find(a->segs, a->nsegs, begin); s < a->nsegs; s++) {    \
      const zd__segment_t *seg = &a->segs[s];                                          \
      if (seg->offset >= end) break;                                                   \
      uint64_t lo = seg->offset > begin ? seg->offset : begin;                         \
      uint64_t hi = seg->offset + seg->length < end ? seg->offset + seg->length : end; \
      k##_segment(a, &a->groups[seg->group], lo, hi);                                  \
    }                                                                                  \
  }

/* zd__<k>_impl: family k's update for an ISA (the reference for ZD__ISA_SCALAR). */
#define ZD__OPTIM_IMPL(k)                     \
  zd__adam_fn zd__##k##_impl(zd__isa_t isa) { \
    switch (isa) {                            \
      case ZD__ISA_AVX512BF16:                \
        return zd__##k##_step_avx512bf16;     \
      case ZD__ISA_AVX512:                    \
        return zd__##k##_step_avx512;         \
      case ZD__ISA_AVX2:                      \
        return zd__##k##_step_avx2;           \
      default:                                \
        return zd__##k##_step_ref;            \
    }                                         \
  }

#endif /* ZD_KERNELS_OPTIM_KERNEL_H */
