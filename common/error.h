/* Errors with their messages, as the daemon and libzerod carry them internally.
 *
 * A zd__err_t pairs a code from zerod/errors.h with the message formatted where the problem was
 * found ("grad buffer is 4096 bytes, layout needs 8192 for rank 1"). Functions that can fail with
 * a message take a zd__err_t * and return the code that zd__errf() stored, so a failure path is
 * `return zd__errf(err, ZD_EBUFFER, "...", ...)`. The message reaches the user unchanged: in an
 * Error reply from the daemon, in zd_last_error() in the client.
 */
#ifndef ZD_COMMON_ERROR_H
#define ZD_COMMON_ERROR_H

#include "zerod/errors.h"

#define ZD__ERR_MSG_MAX 512

#ifdef __cplusplus
extern "C" {
#endif

typedef struct zd__err {
  int code;
  char msg[ZD__ERR_MSG_MAX];
} zd__err_t;

/* Stores code and the formatted message in err (which may be NULL) and returns code. */
int zd__errf(zd__err_t *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#ifdef __cplusplus
}
#endif

#endif /* ZD_COMMON_ERROR_H */
