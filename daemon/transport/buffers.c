/* A session's buffers (buffers.h): import, checks, release. */
#include "buffers.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "dtype.h"
#include "log.h"
#include "placement.h"

void zd__buffers_init(zd__session_buffers_t *sb) {
  *sb = (zd__session_buffers_t){.bufs.device = -1};
}

int zd__buffers_cuda(const zd__session_buffers_t *sb) {
  return sb->bufs.device >= 0;
}

void zd__buffers_client_gone(zd__session_buffers_t *sb) {
  /* Once: a job that copies the buffers (the stand-in) may read the flag plainly meanwhile. */
  if (!__atomic_load_n(&sb->bufs.client_gone, __ATOMIC_ACQUIRE))
    __atomic_store_n(&sb->bufs.client_gone, 1, __ATOMIC_RELEASE);
}

int zd__buffers_release(zd__session_buffers_t *sb, zd__rank_t *rank, uint32_t session_id) {
  zd__buffers_t *b = &sb->bufs;
  int kept = b->params.kind == ZD__SHM_CUDA && sb->used && rank && !zd__rank_stream_idle(rank);
  if (kept) {
    ZD_LOG_WARN(
        "session %u: local rank %u's stream still has work queued after a failure: "
        "leaving the client's CUDA IPC mappings open (the client is told to keep its "
        "buffers)",
        session_id, zd__rank_local(rank));
    sb->mappings_kept = 1;
  } else {
    zd__shm_unmap(&b->params);
    zd__shm_unmap(&b->grads);
    for (uint32_t k = 0; k < ZD__EVENT_SLOTS; k++) {
      zd__shm_close_event(b->device, b->grads_ready[k]);
      zd__shm_close_event(b->device, b->params_ready[k]);
    }
  }
  *b = (zd__buffers_t){.device = -1};
  sb->used = 0;
  return kept;
}

/* Host buffers: two sealed memfds rode along the frame. */
int zd__buffers_map_host(zd__session_buffers_t *sb, const zd__backend_t *backend, uint32_t local,
                         const int *fds, int nfds, const zd__model_spec_t *spec, zd__err_t *err) {
  if (backend->kind == ZD__BACKEND_CUDA) {
    const zd__gpu_info_t *gpu = zd__backend_gpu(backend, local);
    return zd__errf(err, ZD_EBACKEND,
                    "this zerod runs the CUDA backend (local rank %u on GPU %d, "
                    "%s): register CUDA device buffers (zd_model_desc_t.memory = "
                    "ZD_MEMORY_CUDA); host buffers need a zerod with backend cpu",
                    local, gpu->device, gpu->uuid_str);
  }
  if (nfds < 2)
    return zd__errf(err, ZD_EBUFFER,
                    "register needs 2 file descriptors (param and grad buffers) "
                    "sent with the frame; got %d",
                    nfds);
  uint64_t total = spec->layout->total_elems;
  sb->bufs.device = -1;
  int rc = zd__shm_map(fds[0], total * zd_dtype_size(spec->param_dtype), ZD__COLOUR_PARAMS,
                       "param buffer", &sb->bufs.params, err);
  if (rc) return rc;
  return zd__shm_map(fds[1], total * zd_dtype_size(spec->grad_dtype), ZD__COLOUR_GRADS,
                     "grad buffer", &sb->bufs.grads, err);
}

/* (Handles are not compared with each other: nothing documents that distinct events have
 * byte-distinct handles, and a client that sent one event twice only orders itself too
 * strictly.) */
int zd__buffers_check_cuda_form(const Zerod__V1__CudaBuffers *cb, zd__err_t *err) {
  if (!cb->has_device_uuid || cb->device_uuid.len != 16)
    return zd__errf(err, ZD_EBUFFER,
                    "cuda.device_uuid is %zu bytes; expected 16 "
                    "(cudaDeviceProp.uuid of the buffers' GPU)",
                    cb->has_device_uuid ? cb->device_uuid.len : 0);
  struct {
    const char *name;
    protobuf_c_boolean has;
    ProtobufCBinaryData data;
  } mem[] = {{"cuda.param_handle", cb->has_param_handle, cb->param_handle},
             {"cuda.grad_handle", cb->has_grad_handle, cb->grad_handle}};
  for (size_t i = 0; i < sizeof mem / sizeof mem[0]; i++)
    if (!mem[i].has || mem[i].data.len != ZD__CUDA_IPC_HANDLE_BYTES)
      return zd__errf(err, ZD_EBUFFER, "%s is %zu bytes; expected %d (a CUDA IPC handle)",
                      mem[i].name, mem[i].has ? mem[i].data.len : 0, ZD__CUDA_IPC_HANDLE_BYTES);
  struct {
    const char *name;
    size_t n;
    const ProtobufCBinaryData *h;
  } ev[] = {{"cuda.grads_ready", cb->n_grads_ready, cb->grads_ready},
            {"cuda.params_ready", cb->n_params_ready, cb->params_ready}};
  for (size_t i = 0; i < 2; i++) {
    if (ev[i].n != ZD__EVENT_SLOTS)
      return zd__errf(err, ZD_EBUFFER,
                      "%s carries %zu event handles; expected %d (one per event "
                      "slot 0..%d)",
                      ev[i].name, ev[i].n, ZD__EVENT_SLOTS, ZD__EVENT_SLOTS - 1);
    for (size_t k = 0; k < ev[i].n; k++)
      if (ev[i].h[k].len != ZD__CUDA_IPC_HANDLE_BYTES)
        return zd__errf(err, ZD_EBUFFER,
                        "%s[%zu] is %zu bytes; expected %d (a CUDA IPC event "
                        "handle)",
                        ev[i].name, k, ev[i].h[k].len, ZD__CUDA_IPC_HANDLE_BYTES);
  }
  return ZD_OK;
}

/* docs/protocol.md, "CUDA buffers": the rank's stream waits on a slot's latest record, so a slot
 * shared by two requests in flight would make the first wait for the second's. */
int zd__buffers_event_slot(const zd__session_buffers_t *sb, int cuda, const char *what, int has,
                           uint32_t want, uint32_t *slot, zd__err_t *err) {
  *slot = 0;
  if (!cuda)
    return has ? zd__errf(err, -EINVAL,
                          "%s carries event_slot %u, but this client's buffers are "
                          "host memory: event slots are for CUDA buffers (leave the field out)",
                          what, want)
               : ZD_OK;
  if (!has)
    return zd__errf(err, -EINVAL,
                    "%s carries no event_slot; a client with CUDA buffers names "
                    "one in 0..%d",
                    what, ZD__EVENT_SLOTS - 1);
  if (want >= ZD__EVENT_SLOTS)
    return zd__errf(err, -EINVAL,
                    "%s: event_slot is %u; expected 0..%d (one of the %d event "
                    "pairs sent at register)",
                    what, want, ZD__EVENT_SLOTS - 1, ZD__EVENT_SLOTS);
  if (__atomic_load_n(&sb->slots_inflight, __ATOMIC_ACQUIRE) & (1ull << want))
    return zd__errf(err, -EINVAL,
                    "%s: event_slot %u belongs to a request still in flight; a "
                    "slot is free again once its request's reply has been read",
                    what, want);
  *slot = want;
  return ZD_OK;
}

int zd__buffers_open_cuda(zd__session_buffers_t *sb, const zd__backend_t *backend, uint32_t local,
                          const Zerod__V1__CudaBuffers *cb, int nfds, const zd__model_spec_t *spec,
                          zd__err_t *err) {
  if (backend->kind != ZD__BACKEND_CUDA) {
    const char *note = backend->note;
    return zd__errf(err, ZD_EBACKEND,
                    "this zerod runs the CPU backend (%s): it takes host "
                    "buffers (memfds) only; CUDA device buffers need a zerod with backend cuda on "
                    "the trainer's node",
                    note[0] ? note : "backend cpu");
  }
  if (nfds > 0)
    return zd__errf(err, ZD_EBUFFER,
                    "register with CUDA buffers carries %d file descriptors; "
                    "expected none",
                    nfds);
  const zd__gpu_info_t *gpu = zd__backend_gpu(backend, local);
  if (memcmp(cb->device_uuid.data, gpu->uuid, sizeof gpu->uuid) != 0) {
    char theirs[ZD__GPU_UUID_STR];
    zd__gpu_uuid_str(cb->device_uuid.data, theirs, sizeof theirs);
    return zd__errf(err, ZD_EBUFFER,
                    "the buffers are on the client's CUDA device %d (%s), but "
                    "local rank %u runs on %s (%s, zerod's device %d); put the trainer of local "
                    "rank %u on that GPU",
                    cb->has_device ? cb->device : -1, theirs, local, gpu->uuid_str, gpu->name,
                    gpu->device, local);
  }
  uint64_t total = spec->layout->total_elems;
  zd__buffers_t *b = &sb->bufs;
  b->device = gpu->device;
  int rc =
      zd__shm_open_cuda(gpu->device, cb->param_handle.data, cb->param_handle.len,
                        total * zd_dtype_size(spec->param_dtype), "param buffer", &b->params, err);
  if (!rc)
    rc = zd__shm_open_cuda(gpu->device, cb->grad_handle.data, cb->grad_handle.len,
                           total * zd_dtype_size(spec->grad_dtype), "grad buffer", &b->grads, err);
  for (uint32_t k = 0; k < ZD__EVENT_SLOTS && !rc; k++) {
    char what[48];
    snprintf(what, sizeof what, "grads_ready[%u] event", k);
    rc = zd__shm_open_event(gpu->device, cb->grads_ready[k].data, cb->grads_ready[k].len, what,
                            &b->grads_ready[k], err);
    if (rc) break;
    snprintf(what, sizeof what, "params_ready[%u] event", k);
    rc = zd__shm_open_event(gpu->device, cb->params_ready[k].data, cb->params_ready[k].len, what,
                            &b->params_ready[k], err);
  }
  return rc;
}

void zd__buffers_job_queued(zd__session_buffers_t *sb, uint32_t slot) {
  if (!zd__buffers_cuda(sb)) return; /* host buffers: no slots */
  __atomic_or_fetch(&sb->slots_inflight, 1ull << slot, __ATOMIC_ACQ_REL);
  sb->used = 1;
}

void zd__buffers_job_done(zd__session_buffers_t *sb, uint32_t slot) {
  /* only CUDA buffers' jobs set theirs; a worker that answered a job frees its slot first (jobs.c)
   */
  __atomic_and_fetch(&sb->slots_inflight, ~(1ull << slot), __ATOMIC_ACQ_REL);
}
