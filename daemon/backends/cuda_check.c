/* CUDA failures as codes and messages, the bounded wait, GPU identity (cuda_check.h). */
#include "clock.h"
#include "cuda_check.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

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
