/* Client buffers: the param and grad buffers a client creates and zerod uses in place, so that
 * gradients and parameters never cross the socket, and the form in which every job sees them
 * (zd__buffers_t).
 *
 * Host memory (CPU backend): shared-memory files (memfds passed with SCM_RIGHTS) that zerod maps.
 * A buffer is accepted only if it is a regular shared-memory file at least as large as the layout
 * needs and sealed against shrinking (F_SEAL_SHRINK): a client that truncated a mapped buffer
 * would otherwise crash zerod with SIGBUS in the middle of a step.
 *
 * Device memory (CUDA backend, shm_cuda.c): cudaMalloc'd buffers the client exports with
 * cudaIpcGetMemHandle and zerod opens on the rank's GPU (cudaIpcOpenMemHandle), checked to be on
 * that GPU and at least as large as the layout needs (the allocation's real extent, from the
 * driver, not the client's word); and the client's ring of IPC event pairs that order its
 * stream and the rank's (cudaIpcOpenEventHandle, ZD__EVENT_SLOTS pairs). A handle must be the
 * base of its allocation (there is no offset field): CUDA exports a whole allocation, and the
 * opened pointer is its base. Opened by the loop thread at register, with the rank's device made
 * current; closed at detach, when no job of the session is left, unless the rank's stream may
 * still have work on them (buffers.c, zd__buffers_release). In a build without CUDA the open
 * functions refuse with ZD_EBACKEND.
 */
#ifndef ZD_DAEMON_SHM_H
#define ZD_DAEMON_SHM_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "frame.h"
#include "zerod/zerod.h"

enum { ZD__SHM_NONE = 0, ZD__SHM_HOST = 1, ZD__SHM_CUDA = 2 };

typedef struct zd__shm {
  void *addr;   /* host: the mapping; CUDA: the device pointer opened from the handle */
  size_t bytes; /* host: the file's size; CUDA: bytes of the allocation from addr on */
  int kind;     /* ZD__SHM_NONE (zeroed: nothing held), ZD__SHM_HOST, ZD__SHM_CUDA */
  int device;   /* ZD__SHM_CUDA: the GPU it was opened on */
} zd__shm_t;

/* Checks fd and maps it read-write, whole, at `colour` (ZD__COLOUR_PARAMS or ZD__COLOUR_GRADS of
 * placement.h: one per buffer a step streams, so that the mappings never start at the same address
 * modulo a large power of two). `what` names the buffer in messages ("grad buffer"). Does not take
 * ownership of fd. Errors: ZD_EBUFFER (not a sealed regular file, too small), or a system error. */
int zd__shm_map(int fd, size_t needed, unsigned colour, const char *what, zd__shm_t *out,
                zd__err_t *err);

/* Unmaps (host) or closes (CUDA); accepts a zeroed zd__shm_t. For CUDA the GPU work using the
 * buffer must be complete. */
void zd__shm_unmap(zd__shm_t *shm);

#define ZD__CUDA_IPC_HANDLE_BYTES 64 /* cudaIpcMemHandle_t, cudaIpcEventHandle_t */

/* Opens a cudaIpcMemHandle_t (handle, len bytes) on `device` (made current on the calling
 * thread) and checks that the memory is on that device and has at least `needed` bytes from the
 * opened address. Errors: ZD_EBUFFER (a handle of the wrong size, one CUDA cannot open, memory on
 * another GPU, too small; the message names the buffer and the expected value), ZD_EBACKEND
 * (no CUDA in this build). */
int zd__shm_open_cuda(int device, const void *handle, size_t len, size_t needed, const char *what,
                      zd__shm_t *out, zd__err_t *err);

/* Opens a cudaIpcEventHandle_t on `device`: *event is a cudaEvent_t. Errors as above. */
int zd__shm_open_event(int device, const void *handle, size_t len, const char *what, void **event,
                       zd__err_t *err);

/* Closes a buffer of zd__shm_open_cuda (zd__shm_unmap calls it). */
void zd__shm_close_cuda(zd__shm_t *shm);

/* Destroys an event from zd__shm_open_event; accepts NULL. */
void zd__shm_close_event(int device, void *event);

/* A client's buffers, as every job on them sees them; owned by its session (transport/buffers.h),
 * alive while the session has jobs in flight.
 * Host buffers are mapped memfds; CUDA buffers are device memory opened from the client's IPC
 * handles on the rank's device (above), with the client's ring of IPC event pairs that order its
 * stream and the rank's, one pair per request it may have outstanding: a job with event slot k
 * makes the rank's stream wait on grads_ready[k] before it touches the buffers, and records
 * params_ready[k] after its work (docs/protocol.md, "CUDA buffers"). */
typedef struct zd__buffers {
  zd__shm_t params;
  zd__shm_t grads;
  zd_dtype_t param_dtype;
  zd_dtype_t grad_dtype;
  int device;                          /* CUDA device of the buffers and events; -1: host memory */
  void *grads_ready[ZD__EVENT_SLOTS];  /* cudaEvent_t opened from the client's handles; NULL with
                                          host buffers */
  void *params_ready[ZD__EVENT_SLOTS]; /* likewise */
  /* Set (atomically, by the loop thread: zd__buffers_client_gone) once the client's connection
   * ended without a bye: its process may be gone, and with it, for CUDA IPC, the memory and
   * events these buffers name. A job that begins later queues nothing on them (compute.h,
   * begin and finish); read with __atomic_load_n. */
  int client_gone;
} zd__buffers_t;

#endif /* ZD_DAEMON_SHM_H */
