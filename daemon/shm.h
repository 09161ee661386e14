/* Client buffers in shared memory: the param and grad buffers a client creates (memfds passed
 * with SCM_RIGHTS) and zerod maps, so that gradients and parameters never cross the socket.
 *
 * A buffer is accepted only if it is a regular shared-memory file at least as large as the layout
 * needs and sealed against shrinking (F_SEAL_SHRINK): a client that truncated a mapped buffer
 * would otherwise crash zerod with SIGBUS in the middle of a step.
 */
#ifndef ZD_DAEMON_SHM_H
#define ZD_DAEMON_SHM_H

#include <stddef.h>

#include "error.h"

typedef struct zd__shm {
  void *addr;
  size_t bytes; /* mapped bytes: the file's size */
} zd__shm_t;

/* Checks fd and maps it read-write. `what` names the buffer in messages ("grad buffer").
 * Does not take ownership of fd. Errors: ZD_EBUFFER (not a sealed regular file, too small), or a
 * system error. */
int zd__shm_map(int fd, size_t needed, const char *what, zd__shm_t *out, zd__err_t *err);

/* Unmaps; accepts a zeroed zd__shm_t. */
void zd__shm_unmap(zd__shm_t *shm);

#endif /* ZD_DAEMON_SHM_H */
