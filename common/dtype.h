/* Element types of the protocol (zd_dtype_t in zerod/zerod.h): every fact about them, in one
 * table, for the daemon, libzerod, the kernels and the tests.
 *
 * The table gives each type its size, its name and what it may hold: the working parameters
 * (zd_model_desc_t.param_dtype) or the gradients (grad_dtype). zd_dtype_size() and
 * zd_dtype_name() (public, zerod.h), the checks below and the wire's dtype conversion
 * (proto/wire.c) are generated from it. The scalar conversions to and from f32 are the ones every
 * optimizer path uses (kernels/adam.h): they are part of the kernels' specification.
 */
#ifndef ZD_COMMON_DTYPE_H
#define ZD_COMMON_DTYPE_H

#include <stdint.h>

#include "error.h"
#include "zerod/zerod.h"

#ifdef __cplusplus
extern "C" {
#endif

/* X(ID, name, bytes, param, grad): ZD_<ID> (the wire's DType <ID> has the same value), its name,
 * its size in bytes, whether it may be the working parameters' dtype, the gradients'. */
#define ZD__DTYPES(X)      \
  X(F32, "f32", 4, 1, 1)   \
  X(BF16, "bf16", 2, 1, 1) \
  X(F16, "f16", 2, 0, 1)

/* What a buffer of that dtype holds. */
typedef enum zd__dtype_use { ZD__DTYPE_PARAM = 0, ZD__DTYPE_GRAD = 1 } zd__dtype_use_t;

/* Whether `dtype` (any integer: a value read off the wire too) may be used for `use`. */
static inline int zd__dtype_ok(int dtype, zd__dtype_use_t use) {
  switch (dtype) {
#define ZD__DTYPE_OK_(id, name, bytes, param, grad) \
  case ZD_##id:                                     \
    return use == ZD__DTYPE_PARAM ? (param) : (grad);
    ZD__DTYPES(ZD__DTYPE_OK_)
#undef ZD__DTYPE_OK_
  }
  return 0;
}

/* ZD_OK if zd__dtype_ok(dtype, use); otherwise ZD_EDTYPE with the message in err, naming the value
 * and the dtypes expected: "param dtype 3 (f16) not supported; expected f32 or bf16". */
int zd__dtype_check(int dtype, zd__dtype_use_t use, zd__err_t *err);

/* bf16 is the upper half of an f32: exact. */
static inline float zd__bf16_to_f32(uint16_t h) {
  union {
    uint32_t u;
    float f;
  } x = {.u = (uint32_t)h << 16};
  return x.f;
}

/* Rounded to nearest even; any NaN becomes 0x7fc0, as torch does. */
static inline uint16_t zd__f32_to_bf16(float f) {
  union {
    float f;
    uint32_t u;
  } x = {.f = f};
  if (f != f) return 0x7fc0;
  return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

/* IEEE binary16 to f32, exact (subnormals included); NaN keeps sign and payload and comes out
 * quiet, as the F16C instruction vcvtph2ps does. */
float zd__f16_to_f32(uint16_t h);

#ifdef __cplusplus
}
#endif

#endif /* ZD_COMMON_DTYPE_H */
