/* CUDA failures in the daemon, and the one way the daemon waits for a GPU.
 *
 * The daemon never aborts on a CUDA error (that is for tests and tools): every runtime call is
 * checked by ZD_CUDA_TRY / ZD_CUDA_GOTO, which log the call with file:line and turn the error
 * into a code and a message in the caller's zd__err_t (-ENOMEM for an allocation that did not
 * fit, ZD_EBACKEND for anything else), as NCCL's CUDACHECK / NCCLCHECKGOTO do.
 *
 * A worker thread never blocks in cudaStreamSynchronize or cudaEventSynchronize, which could wait
 * for ever on a dead peer: zd__cuda_event_wait polls an event with a deadline, calling a probe
 * (the NCCL communicator's asynchronous error) while it waits (cuda_step legacy), and
 * zd__cuda_stream_wait sleeps until the stream itself wakes it (cudaLaunchHostFunc), in slices
 * of a millisecond between which it probes (cuda_step fast).
 *
 * CUDA builds only (compiled with ZD_HAVE_CUDA); cuda_check.c.
 */
#ifndef ZD_DAEMON_CUDA_CHECK_H
#define ZD_DAEMON_CUDA_CHECK_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"

/* Logs "file:line: what: <CUDA error> (<name>)" at error level, stores the same message in err
 * (which may be NULL) and returns -ENOMEM for cudaErrorMemoryAllocation, else ZD_EBACKEND. Clears
 * the runtime's last (non-sticky) error. */
int zd__cuda_fail(zd__err_t *err, cudaError_t e, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* call is a CUDA runtime call; on failure returns from the enclosing function with the code. */
#define ZD_CUDA_TRY(err, call, ...)                                                                \
  do {                                                                                             \
    cudaError_t zd_e_ = (call);                                                                    \
    if (zd_e_ != cudaSuccess) return zd__cuda_fail((err), zd_e_, __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

/* As ZD_CUDA_TRY, but stores the code in rc and jumps to label (one cleanup path). */
#define ZD_CUDA_GOTO(err, rc, label, call, ...)                            \
  do {                                                                     \
    cudaError_t zd_e_ = (call);                                            \
    if (zd_e_ != cudaSuccess) {                                            \
      (rc) = zd__cuda_fail((err), zd_e_, __FILE__, __LINE__, __VA_ARGS__); \
      goto label;                                                          \
    }                                                                      \
  } while (0)

/* Probe called while waiting: ZD_OK to go on waiting, or a failure (code and message) that ends
 * the wait. */
typedef int (*zd__cuda_probe_fn)(void *ctx, zd__err_t *err);

/* Waits until the work before the last record of `event` has completed, at most timeout_ms:
 * spins on cudaEventQuery for the first few tens of microseconds (the common case of a short
 * step), then sleeps in growing slices up to a millisecond, calling probe (may be NULL) between
 * polls. Returns ZD_OK; -ETIMEDOUT with "<what> not complete within N ms"; the probe's failure;
 * or ZD_EBACKEND when the event reports a CUDA error (a kernel fault: the device context is then
 * unusable). Leaves no cudaErrorNotReady latched as the thread's last error. */
int zd__cuda_event_wait(cudaEvent_t event, int timeout_ms, zd__cuda_probe_fn probe, void *ctx,
                        const char *what, zd__err_t *err);

/* A stream's wake-up: a host function queued on the stream (cudaLaunchHostFunc) bumps a counter
 * and wakes a futex; it makes no CUDA call (CUDA forbids it there) and touches nothing but the
 * waiter. One waiter serves one stream, and is used by one thread at a time (the rank's worker).
 * Host functions of one stream run in order, so "the n-th one has run" is a counter reaching n: a
 * wait that timed out and gave up leaves its host function queued, which later bumps the counter
 * for nothing (generation counting, no pointer to the waiting call's stack). */
typedef struct zd__cuda_waiter zd__cuda_waiter_t;

/* Errors: -ENOMEM. */
int zd__cuda_waiter_create(zd__cuda_waiter_t **out, zd__err_t *err);

/* Frees the waiter, unless a host function queued on it has not run yet (its stream is stuck
 * after a failure): then it is left to the process's exit, since that function would write into
 * freed memory. Accepts NULL. */
void zd__cuda_waiter_destroy(zd__cuda_waiter_t *w);

/* Waits until every piece of work queued on `stream` before this call has completed, at most
 * timeout_ms: queues the waiter's host function and then records `event` on the stream, and
 * sleeps on the futex in slices of about a millisecond. Between slices it calls probe (may be
 * NULL) and queries `event`, which also ends the wait if the host function is never called (a
 * stream whose work failed) and reports a CUDA failure. The wake-up costs the host function's
 * latency and a futex wake (microseconds), never a sleep's overshoot. Returns as
 * zd__cuda_event_wait, plus ZD_EBACKEND when the host function cannot be queued. */
int zd__cuda_stream_wait(zd__cuda_waiter_t *w, cudaStream_t stream, cudaEvent_t event,
                         int timeout_ms, zd__cuda_probe_fn probe, void *ctx, const char *what,
                         zd__err_t *err);

/* zd__cuda_stream_wait in two halves, for a wait on a point in the middle of a stream's work:
 * mark queues the host function and records `event` now and sets *gen; wait (later, with more
 * work queued behind the point) waits for that point alone. Errors: as zd__cuda_stream_wait. */
int zd__cuda_waiter_mark(zd__cuda_waiter_t *w, cudaStream_t stream, cudaEvent_t event,
                         uint32_t *gen, const char *what, zd__err_t *err);
int zd__cuda_waiter_wait(zd__cuda_waiter_t *w, uint32_t gen, cudaEvent_t event, int timeout_ms,
                         zd__cuda_probe_fn probe, void *ctx, const char *what, zd__err_t *err);

#endif /* ZD_DAEMON_CUDA_CHECK_H */
