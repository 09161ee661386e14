/* Element types (dtype.h): the functions generated from the dtype table, shared by the daemon and
 * libzerod (zd_dtype_size and zd_dtype_name are part of the public API), and the exact f16
 * conversion of every optimizer path. */
#include "dtype.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

size_t zd_dtype_size(zd_dtype_t dtype) {
  switch ((int)dtype) {
#define SIZE(id, name, bytes, param, grad) \
  case ZD_##id:                            \
    return bytes;
    ZD__DTYPES(SIZE)
#undef SIZE
  }
  return 0;
}

const char *zd_dtype_name(zd_dtype_t dtype) {
  switch ((int)dtype) {
#define NAME(id, name, bytes, param, grad) \
  case ZD_##id:                            \
    return name;
    ZD__DTYPES(NAME)
#undef NAME
  }
  return "?";
}

int zd__dtype_check(int dtype, zd__dtype_use_t use, zd__err_t *err) {
  if (zd__dtype_ok(dtype, use)) return ZD_OK;
  /* "f32, bf16 or f16": the table's dtypes allowed for this use. */
  static const int all[] = {
#define ID(id, name, bytes, param, grad) ZD_##id,
      ZD__DTYPES(ID)
#undef ID
  };
  const char *ok[sizeof all / sizeof all[0]];
  size_t n = 0;
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (zd__dtype_ok(all[i], use)) ok[n++] = zd_dtype_name((zd_dtype_t)all[i]);
  char expected[64] = "";
  size_t len = 0;
  for (size_t i = 0; i < n && len < sizeof expected; i++)
    len += (size_t)snprintf(expected + len, sizeof expected - len, "%s%s",
                            i == 0       ? ""
                            : i + 1 == n ? " or "
                                         : ", ",
                            ok[i]);
  char known[16] = "";
  if (zd_dtype_size((zd_dtype_t)dtype))
    snprintf(known, sizeof known, " (%s)", zd_dtype_name((zd_dtype_t)dtype));
  return zd__errf(err, ZD_EDTYPE, "%s dtype %d%s not supported; expected %s",
                  use == ZD__DTYPE_PARAM ? "param" : "grad", dtype, known, expected);
}

float zd__f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    /* Inf keeps its sign; NaN keeps sign and payload and comes out quiet, as vcvtph2ps does. */
    bits = sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13); /* rebias 15 -> 127 */
  } else if (mant == 0) {
    bits = sign;
  } else {
    /* Subnormal: mant * 2^-24 is a normal float. Shift the leading one up to the implicit bit,
     * lowering the exponent as we go (an f16 subnormal has the exponent of exp field 1). */
    int e = 1;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      e--;
    }
    bits = sign | ((uint32_t)(e + 112) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
