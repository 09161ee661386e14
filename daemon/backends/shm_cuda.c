/* Client buffers in device memory, through CUDA IPC (shm.h). CUDA builds only.
 *
 * The size check uses the driver's own record of the allocation (cuMemGetAddressRange, reached
 * through cudaGetDriverEntryPointByVersion so that zerod does not link libcuda and still starts on
 * a machine without a driver): a client that registers a buffer smaller than the layout would
 * otherwise have the step kernels write past it, into whatever follows in its process's memory or
 * onto a fault that kills the rank's CUDA context.
 */
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cuda_check.h"
#include "log.h"
#include "shm.h"

_Static_assert(sizeof(cudaIpcMemHandle_t) == ZD__CUDA_IPC_HANDLE_BYTES, "IPC handle size");
_Static_assert(sizeof(cudaIpcEventHandle_t) == ZD__CUDA_IPC_HANDLE_BYTES, "IPC handle size");

static pthread_once_t range_once = PTHREAD_ONCE_INIT;
static PFN_cuMemGetAddressRange_v3020 range_fn;

static void find_range_fn(void) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q) ==
          cudaSuccess &&
      q == cudaDriverEntryPointSuccess)
    range_fn = (PFN_cuMemGetAddressRange_v3020)fn;
  else
    (void)cudaGetLastError();
}

/* A CUDA call that failed because of what the client sent: ZD_EBUFFER, not a failure of ours. */
static int refuse(zd__err_t *err, cudaError_t e, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int refuse(zd__err_t *err, cudaError_t e, const char *fmt, ...) {
  char what[ZD__ERR_MSG_MAX / 2];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  (void)cudaGetLastError();
  return zd__errf(err, ZD_EBUFFER, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

int zd__shm_open_cuda(int device, const void *handle, size_t len, size_t needed, const char *what,
                      zd__shm_t *out, zd__err_t *err) {
  *out = (zd__shm_t){0};
  cudaIpcMemHandle_t h;
  if (len != sizeof h)
    return zd__errf(err, ZD_EBUFFER,
                    "%s: the IPC handle is %zu bytes; expected %zu "
                    "(cudaIpcMemHandle_t)",
                    what, len, sizeof h);
  memcpy(&h, handle, sizeof h);
  ZD_CUDA_TRY(err, cudaSetDevice(device), "cudaSetDevice(%d)", device);
  void *p = NULL;
  cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess)
    return refuse(err, e,
                  "%s: cudaIpcOpenMemHandle on GPU %d failed (expected the handle of "
                  "cudaMalloc'd memory of another process on this GPU)",
                  what, device);
  int rc = ZD_OK;
  struct cudaPointerAttributes a;
  e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    rc = refuse(err, e, "%s: cudaPointerGetAttributes", what);
    goto fail;
  }
  if (a.type != cudaMemoryTypeDevice || a.device != device) {
    rc = zd__errf(err, ZD_EBUFFER,
                  "%s is %s memory of GPU %d; this rank runs on GPU %d (device "
                  "memory of the same GPU expected)",
                  what, a.type == cudaMemoryTypeDevice ? "device" : "non-device", a.device, device);
    goto fail;
  }
  pthread_once(&range_once, find_range_fn);
  if (!range_fn) {
    rc = zd__errf(err, ZD_EBACKEND,
                  "%s: the driver has no cuMemGetAddressRange; cannot check "
                  "the buffer's size",
                  what);
    goto fail;
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult r = range_fn(&base, &size, (CUdeviceptr)(uintptr_t)p);
  if (r != CUDA_SUCCESS) {
    rc = zd__errf(err, ZD_EBUFFER, "%s: cuMemGetAddressRange failed (CUresult %d)", what, (int)r);
    goto fail;
  }
  size_t avail = (size_t)(base + size - (CUdeviceptr)(uintptr_t)p);
  if (avail < needed) {
    rc = zd__errf(err, ZD_EBUFFER, "%s is %zu bytes, layout needs %zu", what, avail, needed);
    goto fail;
  }
  *out = (zd__shm_t){.addr = p, .bytes = avail, .kind = ZD__SHM_CUDA, .device = device};
  return ZD_OK;
fail:
  cudaIpcCloseMemHandle(p);
  (void)cudaGetLastError();
  return rc;
}

void zd__shm_close_cuda(zd__shm_t *shm) {
  if (!shm->addr) return;
  cudaError_t e = cudaSetDevice(shm->device);
  if (e == cudaSuccess) e = cudaIpcCloseMemHandle(shm->addr);
  if (e != cudaSuccess) {
    ZD_LOG_WARN("GPU %d: closing a client buffer: %s (%s)", shm->device, cudaGetErrorString(e),
                cudaGetErrorName(e));
    (void)cudaGetLastError();
  }
}

int zd__shm_open_event(int device, const void *handle, size_t len, const char *what, void **event,
                       zd__err_t *err) {
  *event = NULL;
  cudaIpcEventHandle_t h;
  if (len != sizeof h)
    return zd__errf(err, ZD_EBUFFER,
                    "%s: the IPC handle is %zu bytes; expected %zu "
                    "(cudaIpcEventHandle_t)",
                    what, len, sizeof h);
  memcpy(&h, handle, sizeof h);
  ZD_CUDA_TRY(err, cudaSetDevice(device), "cudaSetDevice(%d)", device);
  cudaEvent_t ev = NULL;
  cudaError_t e = cudaIpcOpenEventHandle(&ev, h);
  if (e != cudaSuccess)
    return refuse(err, e,
                  "%s: cudaIpcOpenEventHandle on GPU %d failed (expected the handle of an "
                  "event created with cudaEventInterprocess | cudaEventDisableTiming on this GPU "
                  "in another process)",
                  what, device);
  *event = ev;
  return ZD_OK;
}

void zd__shm_close_event(int device, void *event) {
  if (!event) return;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaEventDestroy((cudaEvent_t)event);
  if (e != cudaSuccess) {
    ZD_LOG_WARN("GPU %d: closing a client event: %s (%s)", device, cudaGetErrorString(e),
                cudaGetErrorName(e));
    (void)cudaGetLastError();
  }
}
