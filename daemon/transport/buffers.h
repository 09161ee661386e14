/* A session's buffers: importing the param and grad buffers a register sends (host memfds, or
 * CUDA IPC handles of device memory with the client's ring of IPC event pairs), the checks on
 * them and on the event slot of each request, and their release.
 *
 * session.c decides when (register, a job queued or done, the session's end); this module knows
 * how, and which CUDA IPC mappings may be closed at all: closing one under work still queued on
 * the rank's stream is undefined behaviour, so such mappings are left open and the client told
 * (docs/protocol.md, "CUDA buffers"). The mapping itself is shm.h's. Loop thread only.
 */
#ifndef ZD_DAEMON_BUFFERS_H
#define ZD_DAEMON_BUFFERS_H

#include <stdint.h>

#include "backend.h"
#include "error.h"
#include "rank.h"
#include "shm.h"
#include "zerod.pb-c.h"

/* Embedded in the session; set up by zd__buffers_init. */
typedef struct zd__session_buffers {
  zd__buffers_t bufs;      /* what the rank's jobs use (zd__job_t.buffers points here) */
  uint64_t slots_inflight; /* CUDA buffers: bit k set while a job of event slot k is in flight
                              (atomic: the worker that answers a job clears its bit, jobs.c) */
  int used;                /* CUDA buffers: a job that may queue work on them was queued */
  int mappings_kept;       /* CUDA IPC handles of this connection were left open (bye says so) */
} zd__session_buffers_t;

/* No buffers. */
void zd__buffers_init(zd__session_buffers_t *sb);

/* Whether the buffers are CUDA device memory (then every request carries an event slot). */
int zd__buffers_cuda(const zd__session_buffers_t *sb);

/* The form of a register's CudaBuffers, checked before anything else about them (before the
 * backend, so that a client learns it from any zerod): every field present with its size, one
 * event handle of each kind per event slot. Errors: ZD_EBUFFER naming the field. */
int zd__buffers_check_cuda_form(const Zerod__V1__CudaBuffers *cb, zd__err_t *err);

/* The event slot of a request (`what`: "register", "step", ...) that lets zerod touch the
 * buffers: with CUDA buffers (cuda) one of the ZD__EVENT_SLOTS that no job in flight uses; with
 * host buffers none (*slot is then 0). has/want: the request's event_slot field. Errors: -EINVAL
 * with a message naming the slot and what is expected. */
int zd__buffers_event_slot(const zd__session_buffers_t *sb, int cuda, const char *what, int has,
                           uint32_t want, uint32_t *slot, zd__err_t *err);

/* Host buffers of a register for local rank `local`: maps fds[0] (params) and fds[1] (grads),
 * sized for spec (fds are not taken). Errors: ZD_EBACKEND (a CUDA zerod), ZD_EBUFFER (fewer than
 * 2 descriptors, shm.h's checks). What was mapped before a failure is released by
 * zd__buffers_release. */
int zd__buffers_map_host(zd__session_buffers_t *sb, const zd__backend_t *backend, uint32_t local,
                         const int *fds, int nfds, const zd__model_spec_t *spec, zd__err_t *err);

/* CUDA buffers of a register (form checked) for local rank `local`: opens the IPC handles of
 * device memory and the event ring on the rank's GPU (shm_cuda.c checks place and size). nfds:
 * the descriptors that came along, which must be none. Errors: ZD_EBACKEND (a CPU zerod),
 * ZD_EBUFFER (another GPU, a handle CUDA refuses, too small). What was opened before a failure is
 * released by zd__buffers_release. */
int zd__buffers_open_cuda(zd__session_buffers_t *sb, const zd__backend_t *backend, uint32_t local,
                          const Zerod__V1__CudaBuffers *cb, int nfds, const zd__model_spec_t *spec,
                          zd__err_t *err);

/* A job on the buffers with event slot `slot` was queued, or is done. */
void zd__buffers_job_queued(zd__session_buffers_t *sb, uint32_t slot);
void zd__buffers_job_done(zd__session_buffers_t *sb, uint32_t slot);

/* The client's connection ended without a bye (its process may be gone): jobs that begin from
 * now on queue nothing on its CUDA buffers or events (shm.h, client_gone). Loop thread. */
void zd__buffers_client_gone(zd__session_buffers_t *sb);

/* Unmaps or closes the buffers and events; no job of the session may be in flight. rank: the
 * rank they were for (NULL if none); session_id: for the log. Returns 1 when it left CUDA IPC
 * mappings open instead, since the rank's stream may still have work on them: they are
 * forgotten (a leak of mappings in zerod; the client keeps its memory, told so by
 * Error/ByeReply.cuda_mappings_kept, and mappings_kept stays set). Mappings no job ever used, or
 * used by jobs whose work has run out, are closed. Leaves no buffers. */
int zd__buffers_release(zd__session_buffers_t *sb, zd__rank_t *rank, uint32_t session_id);

#endif /* ZD_DAEMON_BUFFERS_H */
