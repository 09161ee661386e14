/* The control token: a shared secret in a file (control_token_file) that the zerods of one world
 * and the operator's tools hold, and that the control service requires for the calls that change
 * state or read the world's secrets (the rendezvous store: collective addresses, NCCL's id).
 *
 * The file must be a regular file that others cannot access and the group cannot write (0600; 0640
 * for a Kubernetes secret mounted with an fsGroup), owned by the reading user or root; the token is
 * its first line, 16 to ZD__TOKEN_MAX - 1 bytes of printable ASCII without spaces (e.g. `openssl
 * rand -hex 32`). Never logged.
 */
#ifndef ZD_COMMON_TOKEN_H
#define ZD_COMMON_TOKEN_H

#include <stddef.h>

#include "error.h"

#define ZD__TOKEN_MAX 257

/* Reads the token of path into buf (ZD__TOKEN_MAX bytes). Errors: -ENOENT and other -errno
 * (cannot open), ZD_ECONFIG (not a regular file, mode lets group or others in, foreign owner,
 * empty, too short or long, bad characters), each with a message naming the file and the rule. */
int zd__token_load(const char *path, char *buf, zd__err_t *err);

/* Whether the two tokens are equal, in time that does not depend on where they differ. */
int zd__token_equal(const char *a, const char *b);

#endif /* ZD_COMMON_TOKEN_H */
