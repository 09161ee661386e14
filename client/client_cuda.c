/* libzerod's device buffers (ZD_MEMORY_CUDA) and pinned host buffers (ZD_MEMORY_HOST_PINNED: the
 * host buffers of client_register.c, page-locked here with cudaHostRegister for a model on a GPU
 * trained by a CPU zerod), built only with CUDA. Device buffers: the param and grad buffers
 * are cudaMalloc'd on the rank's GPU and travel as CUDA IPC handles in the register request, with
 * a ring of ZD__EVENT_SLOTS pairs of IPC events that order the trainer's stream and zerod's, one
 * pair per outstanding request: a request takes a free slot k, records "grads ready" k on the
 * trainer's stream before it is sent, and once its reply is in the stream waits on "params ready"
 * k, which zerod recorded after the request's work; the slot is free again after that. Each wait
 * of either side thus covers exactly its own request.
 *
 * The CUDA runtime is linked statically (and its symbols kept private), so that a CUDA build of
 * libzerod loads on machines without a GPU or driver and serves host buffers there; this file is
 * reached only for device or pinned buffers (and zd_cuda_device()), so nothing else touches CUDA.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <cudaTypedefs.h> /* driver entry points' types (cuCtxGetCurrent): no libcuda link */
#include <cuda_runtime_api.h>

#include "client_internal.h"
#include "cuda_error.h"
#include "gpu.h"

/* A failed CUDA call: ZD_EBACKEND (-ENOMEM when out of device memory) with what and CUDA's word. */
static int cuda_fail(cudaError_t e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int cuda_fail(cudaError_t e, const char *fmt, ...) {
  char what[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  (void)cudaGetLastError();
  zd__err_t err;
  int code = zd__cuda_errf(&err, e, what);
  return zd__fail(code, "%s", err.msg);
}

/* Why CUDA cannot run in this process at all, or ZD_OK with the device count; `what` names what
 * needs it ("device buffers"). */
static int cuda_devices(const char *what, int *count) {
  *count = 0;
  cudaError_t e = cudaGetDeviceCount(count);
  if (e == cudaSuccess && *count > 0) return ZD_OK;
  int drv = 0;
  (void)cudaDriverGetVersion(&drv);
  (void)cudaGetLastError();
  if (e == cudaErrorInsufficientDriver && drv == 0)
    return zd__fail(ZD_EBACKEND,
                    "%s need CUDA, but no NVIDIA driver is loaded in this "
                    "process's machine (cudaGetDeviceCount: %s)",
                    what, cudaGetErrorString(e));
  if (e == cudaErrorInsufficientDriver)
    return zd__fail(ZD_EBACKEND,
                    "%s need CUDA, but the NVIDIA driver supports CUDA %d.%d "
                    "and libzerod's CUDA runtime is %d.%d: it needs a driver of CUDA %d or newer "
                    "(cudaGetDeviceCount: %s)",
                    what, drv / 1000, drv % 1000 / 10, CUDART_VERSION / 1000,
                    CUDART_VERSION % 1000 / 10, CUDART_VERSION / 1000, cudaGetErrorString(e));
  if (e == cudaSuccess || e == cudaErrorNoDevice)
    return zd__fail(ZD_EBACKEND, "%s need CUDA, but no CUDA device is visible", what);
  return cuda_fail(e, "%s need CUDA, which cannot start: cudaGetDeviceCount", what);
}

static int device_uuid(int device, uint8_t uuid[16]) {
  struct cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return cuda_fail(e, "cudaGetDeviceProperties(%d)", device);
  memcpy(uuid, prop.uuid.bytes, 16);
  return ZD_OK;
}

/* Every CUDA call of the library runs with the buffers' GPU current and gives the caller back the
 * context it had, through the driver (cuCtxGetCurrent/cuCtxSetCurrent, found at run time so that
 * libzerod never links libcuda). The runtime alone cannot do it: on a thread with no current
 * context cudaGetDevice answers 0, and "restoring" that with cudaSetDevice(0) would create a
 * context on GPU 0 (hundreds of MiB) in a trainer of another GPU, and leave it current on the
 * trainer's thread. The library's own objects live in the primary context of the buffers' GPU,
 * the one the runtimes of CUDA frameworks (PyTorch) use, whatever context the caller had. */
static pthread_once_t ctx_once = PTHREAD_ONCE_INIT;
static PFN_cuCtxGetCurrent_v4000 ctx_get;
static PFN_cuCtxSetCurrent_v4000 ctx_set;

static void find_ctx_fns(void) {
  void *get = NULL, *set = NULL;
  enum cudaDriverEntryPointQueryResult qg = cudaDriverEntryPointSymbolNotFound, qs = qg;
  if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get, 12000, cudaEnableDefault, &qg) ==
          cudaSuccess &&
      qg == cudaDriverEntryPointSuccess &&
      cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &set, 12000, cudaEnableDefault, &qs) ==
          cudaSuccess &&
      qs == cudaDriverEntryPointSuccess) {
    ctx_get = (PFN_cuCtxGetCurrent_v4000)get;
    ctx_set = (PFN_cuCtxSetCurrent_v4000)set;
  }
  (void)cudaGetLastError();
}

typedef struct device_scope {
  CUcontext prev; /* the caller's current context; NULL: none */
  int restore;
} device_scope_t;

static int enter_device(int device, device_scope_t *s) {
  s->prev = NULL;
  s->restore = 0;
  pthread_once(&ctx_once, find_ctx_fns);
  if (!ctx_get || !ctx_set)
    return zd__fail(ZD_EBACKEND,
                    "the CUDA driver does not provide cuCtxGetCurrent/cuCtxSetCurrent "
                    "(cudaGetDriverEntryPointByVersion)");
  CUresult r = ctx_get(&s->prev);
  if (r != CUDA_SUCCESS) return zd__fail(ZD_EBACKEND, "cuCtxGetCurrent: CUresult %d", (int)r);
  cudaError_t e = cudaSetDevice(device); /* its primary context, current on this thread */
  if (e != cudaSuccess) return cuda_fail(e, "cudaSetDevice(%d)", device);
  CUcontext now = NULL;
  s->restore = ctx_get(&now) != CUDA_SUCCESS || now != s->prev;
  return ZD_OK;
}

static void leave_device(const device_scope_t *s) {
  if (s->restore) (void)ctx_set(s->prev); /* NULL unbinds: the thread had no context */
}

/* Device memory and events zerod may still have open are never freed: CUDA leaves freeing an
 * exported allocation before every importer closed it undefined (cudaIpcOpenMemHandle), and
 * operations on an imported event after the exporter destroyed it (cudaIpcOpenEventHandle). They
 * are then left allocated until the process exits. Whether zerod has them open is what it said:
 * ByeReply.cuda_mappings_kept, or Error.cuda_mappings_kept for a register it refused; without an
 * answer it may. */
void zd__cuda_release(zd_client_t *c) {
  if (c->memory != ZD_MEMORY_CUDA) return;
  if (!c->exported) {
    device_scope_t ds;
    int entered = enter_device(c->device, &ds) == ZD_OK;
    if (entered) { /* cudaFree waits for the device's work, the trainer's on these buffers too */
      if (c->params) (void)cudaFree(c->params);
      if (c->grads) (void)cudaFree(c->grads);
      for (int k = 0; k < ZD__EVENT_SLOTS; k++) {
        if (c->grads_ready[k]) (void)cudaEventDestroy((cudaEvent_t)c->grads_ready[k]);
        if (c->params_ready[k]) (void)cudaEventDestroy((cudaEvent_t)c->params_ready[k]);
      }
      (void)cudaGetLastError();
      leave_device(&ds);
    }
  }
  c->params = c->grads = NULL;
  memset(c->grads_ready, 0, sizeof c->grads_ready);
  memset(c->params_ready, 0, sizeof c->params_ready);
  c->exported = 0;
  c->kept = 0;
}

/* Rounds an IPC-exported allocation up to 2 MiB: CUDA exports a whole underlying block, which a
 * smaller allocation may share with others of this process. */
static size_t ipc_size(size_t bytes) {
  size_t unit = (size_t)2 << 20;
  return bytes ? (bytes + unit - 1) / unit * unit : unit;
}

/* cudaMalloc, not cudaMallocAsync or a memory pool: cudaIpcGetMemHandle exports only cudaMalloc'd
 * memory, from the base of the allocation (which is 256-byte aligned: every parameter and every
 * shard, at multiples of 64 elements, is then aligned for the daemon's 16-byte vector loads). */
int zd__cuda_create_buffers(zd_client_t *c, int device) {
  int count, rc = cuda_devices("device buffers", &count);
  if (rc) return rc;
  if (device < 0 || device >= count)
    return zd__fail(-EINVAL, "zd_model_desc_t.device is %d; this process sees %d CUDA device%s",
                    device, count, count == 1 ? "" : "s");
  uint8_t uuid[16];
  if ((rc = device_uuid(device, uuid))) return rc;
  if (c->has_rank_gpu && memcmp(uuid, c->rank_uuid, sizeof uuid) != 0) {
    char mine[ZD__GPU_UUID_STR], theirs[ZD__GPU_UUID_STR];
    zd__gpu_uuid_str(uuid, mine, sizeof mine);
    zd__gpu_uuid_str(c->rank_uuid, theirs, sizeof theirs);
    return zd__fail(ZD_EBUFFER,
                    "CUDA device %d (%s) is not the GPU of local rank %u, %s (zerod's "
                    "device %d); put the buffers there (zd_cuda_device())",
                    device, mine, c->info.local_rank, theirs, c->rank_device);
  }
  device_scope_t ds;
  if ((rc = enter_device(device, &ds))) return rc;
  c->memory = ZD_MEMORY_CUDA; /* from here zd__cuda_release() undoes what was made */
  c->device = device;
  c->exported = 0;
  c->kept = 0;
  memcpy(c->uuid, uuid, sizeof uuid);
  cudaError_t e;
  cudaEvent_t ev;
  cudaIpcMemHandle_t mh;
  cudaIpcEventHandle_t eh;
  size_t pbytes = ipc_size(c->param_bytes), gbytes = ipc_size(c->grad_bytes);
  if ((e = cudaMalloc(&c->params, pbytes)) != cudaSuccess) {
    c->params = NULL;
    rc = cuda_fail(e, "cudaMalloc of the %zu-byte param buffer (%zu bytes rounded) on device %d",
                   c->param_bytes, pbytes, device);
    goto exit;
  }
  if ((e = cudaMalloc(&c->grads, gbytes)) != cudaSuccess) {
    c->grads = NULL;
    rc = cuda_fail(e, "cudaMalloc of the %zu-byte grad buffer (%zu bytes rounded) on device %d",
                   c->grad_bytes, gbytes, device);
    goto exit;
  }
  /* Zeroed on this thread's legacy default stream, and waited for: the trainer then writes its
   * initial values on any stream it likes (a non-blocking one is not ordered after the memset). */
  if ((e = cudaMemset(c->params, 0, pbytes)) != cudaSuccess) {
    rc = cuda_fail(e, "cudaMemset of the param buffer on device %d", device);
    goto exit;
  }
  if ((e = cudaMemset(c->grads, 0, gbytes)) != cudaSuccess) {
    rc = cuda_fail(e, "cudaMemset of the grad buffer on device %d", device);
    goto exit;
  }
  if ((e = cudaStreamSynchronize(cudaStreamLegacy)) != cudaSuccess) {
    rc = cuda_fail(e, "cudaStreamSynchronize after zeroing the buffers on device %d", device);
    goto exit;
  }
  if ((e = cudaIpcGetMemHandle(&mh, c->params)) != cudaSuccess) {
    rc = cuda_fail(e, "cudaIpcGetMemHandle of the param buffer");
    goto exit;
  }
  memcpy(c->param_handle, &mh, sizeof c->param_handle);
  if ((e = cudaIpcGetMemHandle(&mh, c->grads)) != cudaSuccess) {
    rc = cuda_fail(e, "cudaIpcGetMemHandle of the grad buffer");
    goto exit;
  }
  memcpy(c->grad_handle, &mh, sizeof c->grad_handle);
  for (int i = 0; i < 2 * ZD__EVENT_SLOTS; i++) {
    int k = i % ZD__EVENT_SLOTS, params = i >= ZD__EVENT_SLOTS;
    const char *name = params ? "params-ready" : "grads-ready";
    if ((e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess)) !=
        cudaSuccess) {
      rc = cuda_fail(e,
                     "cudaEventCreateWithFlags(cudaEventDisableTiming | "
                     "cudaEventInterprocess) of %s event %d",
                     name, k);
      goto exit;
    }
    (params ? c->params_ready : c->grads_ready)[k] = ev;
    if ((e = cudaIpcGetEventHandle(&eh, ev)) != cudaSuccess) {
      rc = cuda_fail(e, "cudaIpcGetEventHandle of %s event %d", name, k);
      goto exit;
    }
    memcpy(params ? c->params_ready_handle[k] : c->grads_ready_handle[k], &eh, sizeof eh);
  }
  rc = ZD_OK;
exit:
  leave_device(&ds);
  return rc;
}

/* Before a request that lets zerod touch the buffers: takes a free event slot (*slot) and
 * records its "grads ready" on the current stream, so that zerod's work for the request comes
 * after everything queued on that stream so far, and after nothing queued later: the slot is this
 * request's alone until its reply is processed, so zerod's wait on it covers exactly this record.
 * Nothing about earlier streams needs carrying over: zerod runs the client's requests in order on
 * one stream, after the records of the earlier requests' own slots. A stream being captured into
 * a CUDA graph is refused: the record would only be captured, not made, and zerod would wait on
 * the slot's previous record. Host buffers: *slot is -1 and nothing happens. On failure no slot
 * is taken. */
int zd__cuda_before_request(zd_client_t *c, int *slot) {
  *slot = -1;
  if (c->memory != ZD_MEMORY_CUDA) return ZD_OK;
  int rc = zd__check_room(c); /* a request may be outstanding per slot: one is free below this */
  if (rc) return rc;
  int k = -1;
  for (uint32_t i = 0; i < ZD__EVENT_SLOTS && k < 0; i++) {
    uint32_t j = (c->next_slot + i) % ZD__EVENT_SLOTS;
    if (!(c->slots_busy & (1ull << j))) k = (int)j;
  }
  if (k < 0) /* more slots taken than requests outstanding: a bug of libzerod */
    return zd__fail(ZD_EINTERNAL, "libzerod: no free event slot with %u of %d requests outstanding",
                    c->npending, ZD__MAX_OUTSTANDING);
  device_scope_t ds;
  if ((rc = enter_device(c->device, &ds))) return rc;
  cudaStream_t s = (cudaStream_t)c->stream;
  enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(s, &capture);
  if (e != cudaSuccess) {
    rc = cuda_fail(e, "cudaStreamIsCapturing of the client's stream");
    goto exit;
  }
  if (capture != cudaStreamCaptureStatusNone) {
    rc = zd__fail(-EINVAL,
                  "the client's CUDA stream is being captured into a graph: zerod's "
                  "requests cannot be captured (send them outside the capture)");
    goto exit;
  }
  if ((e = cudaEventRecord((cudaEvent_t)c->grads_ready[k], s)) != cudaSuccess) {
    rc = cuda_fail(e, "cudaEventRecord of grads-ready event %d on the client's stream", k);
    goto exit;
  }
  c->slots_busy |= 1ull << k;
  c->next_slot = (uint32_t)(k + 1) % ZD__EVENT_SLOTS;
  *slot = k;
exit:
  leave_device(&ds);
  return rc;
}

/* After the reply of the request of event slot `slot` (-1: none): what the current stream does
 * next comes after zerod's work for it, and, zerod's stream being in order, for every earlier
 * request. A request zerod refused before queueing any work has no record of its own: the wait is
 * then on the slot's previous record, a request already waited for, and changes nothing. */
int zd__cuda_after_reply(zd_client_t *c, int slot) {
  if (c->memory != ZD_MEMORY_CUDA || slot < 0) return ZD_OK;
  device_scope_t ds;
  int rc = enter_device(c->device, &ds);
  if (rc) return rc;
  cudaError_t e =
      cudaStreamWaitEvent((cudaStream_t)c->stream, (cudaEvent_t)c->params_ready[slot], 0);
  leave_device(&ds);
  return e == cudaSuccess ? ZD_OK
                          : cuda_fail(e,
                                      "cudaStreamWaitEvent of the client's stream on "
                                      "params-ready event %d",
                                      slot);
}

/* Whether the stream belongs to the buffers' GPU. */
int zd__cuda_check_stream(const zd_client_t *c, void *stream) {
  device_scope_t ds;
  int rc = enter_device(c->device, &ds);
  if (rc) return rc;
  int dev = -1;
  cudaError_t e = cudaStreamGetDevice((cudaStream_t)stream, &dev);
  leave_device(&ds);
  if (e != cudaSuccess) return cuda_fail(e, "zd_set_stream: cudaStreamGetDevice of the stream");
  if (dev != c->device)
    return zd__fail(-EINVAL,
                    "zd_set_stream: the stream is on CUDA device %d; the buffers are on "
                    "device %d",
                    dev, c->device);
  return ZD_OK;
}

int zd__cuda_find_device(const zd_client_t *c, int *device) {
  int count, rc = cuda_devices("device buffers", &count);
  if (rc) return rc;
  for (int d = 0; d < count; d++) {
    uint8_t uuid[16];
    if ((rc = device_uuid(d, uuid))) return rc;
    if (memcmp(uuid, c->rank_uuid, sizeof uuid) == 0) {
      *device = d;
      return ZD_OK;
    }
  }
  char theirs[ZD__GPU_UUID_STR];
  zd__gpu_uuid_str(c->rank_uuid, theirs, sizeof theirs);
  return zd__fail(-ENODEV,
                  "local rank %u runs on %s (zerod's device %d), which this process does not "
                  "see among its %d CUDA devices (CUDA_VISIBLE_DEVICES?)",
                  c->info.local_rank, theirs, c->rank_device, count);
}

/* ---- pinned host buffers (ZD_MEMORY_HOST_PINNED) ------------------------------------------- */

#define PINNED_WHAT "pinned host buffers (ZD_MEMORY_HOST_PINNED)"

/* Portable: the pages are page-locked for every CUDA context of the process, whichever GPU the
 * trainer copies with; registered in the primary context of `device` (the model's GPU), which
 * enter_device() makes current and gives back. A mapping of 0 bytes (an empty model) is not
 * registered. */
int zd__cuda_pin(zd_client_t *c, int device) {
  int count, rc = cuda_devices(PINNED_WHAT, &count);
  if (rc) return rc;
  if (device < 0 || device >= count)
    return zd__fail(-EINVAL, "zd_model_desc_t.device is %d; this process sees %d CUDA device%s",
                    device, count, count == 1 ? "" : "s");
  device_scope_t ds;
  if ((rc = enter_device(device, &ds))) return rc;
  c->memory = ZD_MEMORY_HOST_PINNED; /* from here zd__cuda_unpin() undoes what was made */
  c->device = device;
  c->pinned = 0;
  void *bufs[2] = {c->params, c->grads};
  size_t bytes[2] = {c->param_bytes, c->grad_bytes};
  const char *names[2] = {"param", "grad"};
  for (int i = 0; i < 2; i++) {
    if (!bytes[i]) continue;
    cudaError_t e = cudaHostRegister(bufs[i], bytes[i], cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      rc = cuda_fail(e, "cudaHostRegister(portable) of the %zu-byte %s buffer on device %d",
                     bytes[i], names[i], device);
      break;
    }
    c->pinned |= 1 << i;
  }
  leave_device(&ds);
  return rc;
}

/* The trainer's copies from and to the buffers must be complete: cudaHostUnregister does not wait
 * for them. */
void zd__cuda_unpin(zd_client_t *c) {
  if (c->memory != ZD_MEMORY_HOST_PINNED || !c->pinned) {
    c->pinned = 0;
    return;
  }
  device_scope_t ds;
  if (enter_device(c->device, &ds) == ZD_OK) {
    if (c->pinned & 1) (void)cudaHostUnregister(c->params);
    if (c->pinned & 2) (void)cudaHostUnregister(c->grads);
    (void)cudaGetLastError();
    leave_device(&ds);
  }
  c->pinned = 0;
}
