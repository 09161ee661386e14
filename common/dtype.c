/* Element types of the protocol (zd_dtype_t in zerod/zerod.h): sizes and names, shared by the
 * daemon and libzerod. */
#include <stddef.h>

#include "zerod/zerod.h"

size_t zd_dtype_size(zd_dtype_t dtype) {
  switch (dtype) {
    case ZD_F32:
      return 4;
    case ZD_BF16:
    case ZD_F16:
      return 2;
  }
  return 0;
}

const char *zd_dtype_name(zd_dtype_t dtype) {
  switch (dtype) {
    case ZD_F32:
      return "f32";
    case ZD_BF16:
      return "bf16";
    case ZD_F16:
      return "f16";
  }
  return "?";
}
