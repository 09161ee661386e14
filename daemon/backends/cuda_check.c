/* CUDA failures as codes and messages, the bounded waits, GPU identity (cuda_check.h). */
#include "clock.h"
#include "cuda_check.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cuda_error.h"
#include "log.h"

/* Polls back to back for this long before sleeping: a step's wait is usually this short, and a
 * sleeping thread adds its wake-up latency to every step. */
#define SPIN_US      50
#define MAX_SLEEP_US 1000

int zd__cuda_fail(zd__err_t *err, cudaError_t e, const char *file, int line, const char *fmt, ...) {
  char what[ZD__ERR_MSG_MAX / 2];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  (void)cudaGetLastError(); /* a non-sticky error must not show up again in the next check */
  ZD_LOG_ERROR("%s:%d: %s: %s (%s)", file, line, what, cudaGetErrorString(e), cudaGetErrorName(e));
  return zd__cuda_errf(err, e, what);
}

int zd__cuda_event_wait(cudaEvent_t event, int timeout_ms, zd__cuda_probe_fn probe, void *ctx,
                        const char *what, zd__err_t *err) {
  uint64_t start = zd__now_us(),
           deadline = start + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000u;
  unsigned sleep_us = 2;
  for (;;) {
    cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return ZD_OK;
    if (e != cudaErrorNotReady)
      return zd__cuda_fail(err, e, __FILE__, __LINE__, "GPU work of %s failed", what);
    /* The runtime latches cudaErrorNotReady as this thread's last error (PyTorch's CUDAEvent::query
     * clears it the same way): left there, the next kernel launch's check (cudaGetLastError after
     * <<<>>>, kernels/adam.cu) would report "device not ready" and degrade the rank. */
    (void)cudaGetLastError();
    if (probe) {
      int rc = probe(ctx, err);
      if (rc) return rc;
    }
    uint64_t now = zd__now_us();
    if (now >= deadline)
      return zd__errf(err, -ETIMEDOUT, "%s not complete within %d ms", what, timeout_ms);
    if (now - start < SPIN_US) continue;
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)sleep_us * 1000L};
    nanosleep(&ts, NULL);
    if (sleep_us < MAX_SLEEP_US) sleep_us *= 2;
  }
}

/* ---- the stream's wake-up (cuda_step fast) -----------------------------------------------------
 */

/* How long the waiter sleeps between probes of the communicator and queries of the event. */
#define SLICE_US 1000

struct zd__cuda_waiter {
  uint32_t fired;  /* host functions that have run: the futex word (written by CUDA's thread) */
  uint32_t issued; /* host functions queued (the waiting thread's) */
};

/* CUDA's callback thread: no CUDA call, nothing but the counter and the wake. */
static void CUDART_CB waiter_fire(void *arg) {
  zd__cuda_waiter_t *w = arg;
  __atomic_add_fetch(&w->fired, 1, __ATOMIC_RELEASE);
  syscall(SYS_futex, &w->fired, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

int zd__cuda_waiter_create(zd__cuda_waiter_t **out, zd__err_t *err) {
  zd__cuda_waiter_t *w = calloc(1, sizeof *w);
  if (!w) return zd__errf(err, -ENOMEM, "out of memory");
  *out = w;
  return ZD_OK;
}

void zd__cuda_waiter_destroy(zd__cuda_waiter_t *w) {
  if (!w) return;
  if (__atomic_load_n(&w->fired, __ATOMIC_ACQUIRE) != w->issued) {
    ZD_LOG_WARN("a GPU stream's wake-up is still queued after a failure: left to the exit");
    return;
  }
  free(w);
}

int zd__cuda_waiter_mark(zd__cuda_waiter_t *w, cudaStream_t stream, cudaEvent_t event,
                         uint32_t *gen, const char *what, zd__err_t *err) {
  cudaError_t e = cudaLaunchHostFunc(stream, waiter_fire, w);
  if (e != cudaSuccess)
    return zd__cuda_fail(err, e, __FILE__, __LINE__, "queueing the wake-up after %s", what);
  *gen = ++w->issued;
  e = cudaEventRecord(event, stream);
  if (e != cudaSuccess)
    return zd__cuda_fail(err, e, __FILE__, __LINE__, "recording an event after %s", what);
  return ZD_OK;
}

int zd__cuda_waiter_wait(zd__cuda_waiter_t *w, uint32_t gen, cudaEvent_t event, int timeout_ms,
                         zd__cuda_probe_fn probe, void *ctx, const char *what, zd__err_t *err) {
  uint64_t deadline = zd__now_us() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000u;
  for (;;) {
    uint32_t v = __atomic_load_n(&w->fired, __ATOMIC_ACQUIRE);
    if ((int32_t)(v - gen) >= 0) return ZD_OK; /* everything queued before the mark has run */
    /* The host function may never run (the stream's work failed): the event says so. */
    cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return ZD_OK;
    if (e != cudaErrorNotReady)
      return zd__cuda_fail(err, e, __FILE__, __LINE__, "GPU work of %s failed", what);
    (void)cudaGetLastError(); /* see zd__cuda_event_wait */
    if (probe) {
      int rc = probe(ctx, err);
      if (rc) return rc;
    }
    uint64_t now = zd__now_us();
    if (now >= deadline)
      return zd__errf(err, -ETIMEDOUT, "%s not complete within %d ms", what, timeout_ms);
    uint64_t left = deadline - now, us = left < SLICE_US ? left : SLICE_US;
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)us * 1000L};
    /* Returns at once if the counter moved since v was read (no lost wake-up). */
    syscall(SYS_futex, &w->fired, FUTEX_WAIT_PRIVATE, v, &ts, NULL, 0);
  }
}

int zd__cuda_stream_wait(zd__cuda_waiter_t *w, cudaStream_t stream, cudaEvent_t event,
                         int timeout_ms, zd__cuda_probe_fn probe, void *ctx, const char *what,
                         zd__err_t *err) {
  uint32_t gen;
  int rc = zd__cuda_waiter_mark(w, stream, event, &gen, what, err);
  return rc ? rc : zd__cuda_waiter_wait(w, gen, event, timeout_ms, probe, ctx, what, err);
}
