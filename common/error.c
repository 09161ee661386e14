/* The error space's names and descriptions (zerod/errors.h) and the message-carrying helper. */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

const char *zd_strerror(int code) {
  switch (code) {
    case ZD_OK:
      return "success";
#define ZD_ERROR_TEXT(name, value, text) \
  case value:                            \
    return text;
      ZD_ERROR_MAP(ZD_ERROR_TEXT)
#undef ZD_ERROR_TEXT
  }
  if (code < 0 && code > -4000) return strerror(-code);
  return "unknown error";
}

const char *zd_err_name(int code) {
  switch (code) {
    case ZD_OK:
      return "ZD_OK";
#define ZD_ERROR_NAME(name, value, text) \
  case value:                            \
    return "ZD_" #name;
      ZD_ERROR_MAP(ZD_ERROR_NAME)
#undef ZD_ERROR_NAME
  }
  if (code < 0 && code > -4000) {
    const char *name = strerrorname_np(-code);
    if (name) return name;
  }
  return "ZD_UNKNOWN";
}

int zd__errf(zd__err_t *err, int code, const char *fmt, ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    err->code = code;
  }
  return code;
}
