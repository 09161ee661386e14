/* The CUDA compute backend (compute.h): a rank's state in device memory, its kernels (kernels/
 * adam_cuda.h) queued on the rank's one non-blocking stream, in the order the step logic asks for
 * them.
 *
 * Per job, on the stream: wait for the client's "grads ready" event of the job's event slot
 * (begin); the collectives and kernels of the job; record the slot's "params ready" event
 * (finish). A slot's events belong to one request at a time (the client reuses a slot only after
 * its reply), so each wait covers exactly the client's work before that request, never a later
 * request's. The worker thread waits for the GPU at two places only, both through the
 * communicator's bounded sync (comm.h):
 *   - gather_records, when the step needs statistics: the statistics kernels write this rank's
 *     record in device memory, NCCL all-gathers the records there, and one 40 * W byte copy
 *     brings them to pinned host memory, where step.c checks the agreement and takes the decision.
 *     The update is queued only after that: an abort (a peer died during the all-gather) cannot be
 *     followed by an update computed from a half-gathered record, so a failed step changes nothing.
 *   - finish, before the job's reply: the reply says what happened (applied, norm, scale, or the
 *     peer failure), and the session may release the client's buffers once no job is in flight.
 *
 * Layouts (tile tables of adam_cuda.h) are built once per bucket at registration, on a separate
 * set-up stream (building one waits for its stream, which must not be the rank's: that one may be
 * waiting for the client). Memory is freed only once the rank's stream has run out (a bounded
 * wait): a stream still busy after a failure (the rank is then degraded) keeps its memory until
 * the process exits, rather than risking cudaFree's unbounded device-wide wait.
 */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "adam_cuda.h"
#include "compute.h"
#include "cuda_check.h"
#include "exchange_cuda.h"
#include "log.h"

/* The step record is all-gathered as the statistics kernel writes it. */
_Static_assert(sizeof(zd__step_record_t) == sizeof(zd__cuda_stats_t), "record size");
_Static_assert(offsetof(zd__step_record_t, sumsq) == offsetof(zd__cuda_stats_t, sumsq), "sumsq");
_Static_assert(offsetof(zd__step_record_t, nonfinite) == offsetof(zd__cuda_stats_t, nonfinite),
               "nonfinite");
_Static_assert(offsetof(zd__step_record_t, step) == offsetof(zd__cuda_stats_t, tags), "tags");
_Static_assert(ZD__CUDA_TAGS == 3, "step, layout_hash, hparam_hash");
_Static_assert(offsetof(zd__step_record_t, check) == offsetof(zd__cuda_stats_t, check), "check");
_Static_assert(offsetof(zd__step_record_t, check) == ZD__RECORD_CHECKED, "the checked bytes");

typedef struct cuda_compute {
  zd__compute_t base;
  int device;
  cudaStream_t stream; /* the rank's: every kernel, copy and collective of its jobs */
  cudaStream_t setup;  /* layout tables at registration */
  cudaEvent_t done;    /* before freeing: waits until the stream ran out */
  int timeout_ms;
  int stuck; /* the stream did not run out within timeout_ms: leave memory to the exit */
  /* The stream may have work on the client's buffers: set by begin, cleared when a job's wait
   * saw the stream run out. Written by the worker, read by the loop thread (stream_idle) with
   * atomics, so that the loop thread asks the worker's record, not CUDA: a query could block
   * behind a driver lock that a stuck teardown holds. */
  int busy;
} cuda_compute_t;

typedef struct cuda_shard {
  uint32_t nbuckets;
  zd__cuda_layout_t **layouts; /* per bucket */
  zd__step_record_t *d_rec;    /* device: this rank's record */
  zd__step_record_t *d_all;    /* device: every rank's */
  zd__step_record_t *h_all;    /* pinned host: every rank's, for the agreement */
  zd__adam_group_t *d_groups;  /* device, more groups than travel with a launch */
  uint32_t world_size;
} cuda_shard_t;

/* Before memory is freed: waits (bounded) until no work of the rank is queued or running, since
 * cudaFree waits for the whole device without a bound. A model replaced at registration is freed
 * while the new one's set-up is still queued; that completes. 0 when the stream is stuck (a
 * failure left work that does not complete): the memory is then left to the process's exit. */
static void set_busy(cuda_compute_t *c, int busy) {
  __atomic_store_n(&c->busy, busy, __ATOMIC_RELEASE);
}

static int drained(cuda_compute_t *c) {
  cudaError_t e = cudaStreamQuery(c->stream);
  (void)cudaGetLastError();
  if (e != cudaErrorNotReady) { /* idle, or the context failed and nothing will run */
    c->stuck = 0;
    set_busy(c, 0);
    return 1;
  }
  if (c->stuck) return 0; /* waited in vain once already: do not wait again for each array */
  zd__err_t err = {0};
  e = cudaEventRecord(c->done, c->stream);
  if (e == cudaSuccess && zd__cuda_event_wait(c->done, c->timeout_ms, NULL, NULL,
                                              "the rank's queued GPU work", &err) == ZD_OK) {
    set_busy(c, 0);
    return 1;
  }
  (void)cudaGetLastError();
  c->stuck = 1;
  return 0;
}

/* After a failed wait of the communicator (which aborted it and already let the stream drain for
 * a while): a stream that still has work is stuck, and freeing must not wait for it again, up to
 * the collective timeout per array (at shutdown that would hold the exit for as long). */
static void note_failed_wait(cuda_compute_t *c) {
  cudaError_t e = cudaStreamQuery(c->stream);
  (void)cudaGetLastError();
  if (e == cudaErrorNotReady) c->stuck = 1;
  set_busy(c, e == cudaErrorNotReady);
}

static void leak_warning(const cuda_compute_t *c, const char *what) {
  ZD_LOG_WARN("GPU %d: %s not freed: the rank's stream still has work queued after a failure",
              c->device, what);
}

/* ---- state --------------------------------------------------------------------------------- */

static void cuda_release(zd__compute_t *base, float *p, uint64_t n) {
  (void)n;
  cuda_compute_t *c = (cuda_compute_t *)base;
  if (!p) return;
  if (!drained(c)) {
    leak_warning(c, "state array");
    return;
  }
  cudaFree(p);
  (void)cudaGetLastError();
}

static int cuda_alloc(zd__compute_t *base, uint64_t n, float **out, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  size_t bytes = (size_t)n * sizeof(float);
  void *p = NULL;
  ZD_CUDA_TRY(err, cudaMalloc(&p, bytes), "GPU %d: cudaMalloc of %zu bytes of state", c->device,
              bytes);
  cudaError_t e = cudaMemsetAsync(p, 0, bytes, c->stream);
  if (e != cudaSuccess) {
    int rc =
        zd__cuda_fail(err, e, __FILE__, __LINE__, "GPU %d: zeroing %zu bytes", c->device, bytes);
    cuda_release(base, p, n); /* not a bare cudaFree: the stream may be waiting for the client */
    return rc;
  }
  *out = p;
  return ZD_OK;
}

/* A checkpoint's snapshot or a resume: on the rank's stream, after the step's work, then a
 * bounded wait. Pageable host memory: the copy is staged by the driver (a pinned, asynchronous
 * snapshot buffer would shorten the stall; see docs/design.md). */
static int cuda_copy_state(zd__compute_t *base, float *state, float *host, uint64_t n, int to_host,
                           zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  size_t bytes = (size_t)n * sizeof(float);
  ZD_CUDA_TRY(err,
              cudaMemcpyAsync(to_host ? (void *)host : (void *)state,
                              to_host ? (const void *)state : (const void *)host, bytes,
                              to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, c->stream),
              "GPU %d: copying %zu bytes of state %s the host", c->device, bytes,
              to_host ? "to" : "from");
  ZD_CUDA_TRY(err, cudaEventRecord(c->done, c->stream), "GPU %d: recording an event", c->device);
  return zd__cuda_event_wait(c->done, c->timeout_ms, NULL, NULL, "a copy of the state", err);
}

static void cuda_shard_fini(zd__compute_t *base, zd__shard_t *s) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  cuda_shard_t *cm = s->cdata;
  if (!cm) return;
  if (drained(c)) {
    for (uint32_t b = 0; cm->layouts && b < cm->nbuckets; b++)
      zd__cuda_layout_destroy(cm->layouts[b]);
    cudaFree(cm->d_rec);
    cudaFree(cm->d_all);
    cudaFree(cm->d_groups);
    cudaFreeHost(cm->h_all);
    (void)cudaGetLastError();
  } else {
    leak_warning(c, "shard tables");
  }
  free(cm->layouts);
  free(cm);
  s->cdata = NULL;
}

static int cuda_shard_init(zd__compute_t *base, zd__shard_t *s, uint32_t world_size,
                           zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  const zd__layout_t *l = s->layout;
  cuda_shard_t *cm = calloc(1, sizeof *cm);
  if (!cm) return zd__errf(err, -ENOMEM, "out of memory");
  s->cdata = cm;
  cm->nbuckets = l->nbuckets;
  cm->world_size = world_size;
  cm->layouts = calloc(l->nbuckets, sizeof *cm->layouts);
  if (!cm->layouts) return zd__errf(err, -ENOMEM, "out of memory");
  for (uint32_t b = 0; b < l->nbuckets; b++) {
    int rc = zd__cuda_layout_create(s->segs[b], s->nsegs[b], l->buckets[b].shard_elems, c->setup,
                                    &cm->layouts[b], err);
    if (rc) return rc; /* the caller frees the shard, and with it what was built */
  }
  size_t rec = sizeof(zd__step_record_t);
  ZD_CUDA_TRY(err, cudaMalloc((void **)&cm->d_rec, rec), "GPU %d: cudaMalloc of the record",
              c->device);
  ZD_CUDA_TRY(err, cudaMalloc((void **)&cm->d_all, rec * world_size),
              "GPU %d: cudaMalloc of %u records", c->device, world_size);
  ZD_CUDA_TRY(err, cudaMallocHost((void **)&cm->h_all, rec * world_size),
              "GPU %d: cudaMallocHost of %u records", c->device, world_size);
  if (s->ngroups > ZD__CUDA_GROUPS_INLINE)
    ZD_CUDA_TRY(err, cudaMalloc((void **)&cm->d_groups, s->ngroups * sizeof *cm->d_groups),
                "GPU %d: cudaMalloc of %u groups", c->device, s->ngroups);
  return ZD_OK;
}

/* ---- job edges ------------------------------------------------------------------------------ */

static int cuda_begin(zd__compute_t *base, const zd__buffers_t *buf, uint32_t slot,
                      zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  if (buf->device < 0) return ZD_OK;                           /* host buffers: nothing to order */
  zd_assert(slot < ZD__EVENT_SLOTS && buf->grads_ready[slot]); /* checked by the session */
  set_busy(c, 1); /* until finish sees the stream run out */
  cudaError_t e = cudaStreamWaitEvent(c->stream, (cudaEvent_t)buf->grads_ready[slot], 0);
  if (e == cudaSuccess) return ZD_OK;
  (void)cudaGetLastError();
  return zd__errf(err, ZD_EBUFFER,
                  "GPU %d: cannot wait on the client's grads_ready[%u] event: %s "
                  "(%s); the event must be an IPC event of the buffers' GPU",
                  c->device, slot, cudaGetErrorString(e), cudaGetErrorName(e));
}

static int cuda_finish(zd__compute_t *base, zd__comm_t *comm, const zd__buffers_t *buf,
                       uint32_t slot, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  int rc = ZD_OK;
  if (buf && buf->device >= 0) {
    zd_assert(slot < ZD__EVENT_SLOTS && buf->params_ready[slot]);
    cudaError_t e = cudaEventRecord((cudaEvent_t)buf->params_ready[slot], c->stream);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      rc = zd__errf(err, ZD_EBUFFER,
                    "GPU %d: cannot record the client's params_ready[%u] event: %s "
                    "(%s); the event must be an IPC event of the buffers' GPU",
                    c->device, slot, cudaGetErrorString(e), cudaGetErrorName(e));
    }
  }
  /* A CUDA rank always has its NCCL communicator (even at world size 1), which waits for the
   * stream and polls its own asynchronous errors. */
  zd_assert(comm && comm->ops->sync);
  zd__err_t werr = {0};
  int wrc = comm->ops->sync(comm, &werr);
  if (wrc) {
    note_failed_wait(c);
    *err = werr;
    return wrc;
  }
  set_busy(c, 0); /* everything the job queued has run */
  return rc;
}

/* ---- the pieces of a step ------------------------------------------------------------------- */

/* This rank's slice of bucket b in the client's param buffer. */
static void *param_slice(const zd__shard_t *s, const zd__buffers_t *buf, uint32_t b) {
  const zd__bucket_t *bk = &s->layout->buckets[b];
  uint64_t e = bk->offset + (uint64_t)s->rank * bk->shard_elems;
  return (char *)buf->params.addr + e * zd_dtype_size(s->param_dtype);
}

static int cuda_exchange(zd__compute_t *base, const zd__shard_t *s, const zd__buffers_t *buf,
                         int to_client, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  for (uint32_t b = 0; b < s->layout->nbuckets; b++) {
    int rc = zd__cuda_exchange(s->state[ZD__STATE_MASTER] + s->layout->buckets[b].shard_base,
                               param_slice(s, buf, b), s->param_dtype, s->segs[b], s->nsegs[b],
                               to_client, c->stream, err);
    if (rc) return rc;
  }
  return ZD_OK;
}

static int cuda_grad_stats(zd__compute_t *base, const zd__shard_t *s, uint32_t b, int first,
                           zd__step_record_t *rec, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  cuda_shard_t *cm = s->cdata;
  /* The first bucket overwrites the record and writes its tags; the others add to it, in bucket
   * order, as the CPU adds bucket after bucket. */
  uint64_t tags[ZD__CUDA_TAGS] = {rec->step, rec->layout_hash, rec->hparam_hash};
  return zd__cuda_grad_stats(cm->layouts[b], s->grad[b], s->grad_dtype[b],
                             (zd__cuda_stats_t *)cm->d_rec, !first, first ? tags : NULL, c->stream,
                             err);
}

static int cuda_gather_records(zd__compute_t *base, zd__comm_t *comm, const zd__shard_t *s,
                               const zd__step_record_t *mine, int stats, zd__step_record_t *all,
                               zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  cuda_shard_t *cm = s->cdata;
  /* Without statistics (world size 1, no clipping, no loss scaling) the record is the host's and
   * the one-rank all-gather a copy: no wait at all. */
  if (!stats) return comm->ops->allgather_bytes(comm, mine, sizeof *mine, all, err);
  if (!comm->ops->allgather_device || !comm->ops->sync)
    return zd__errf(err, ZD_EINTERNAL, "the CUDA backend needs a device communicator, not %s",
                    comm->backend);
  size_t bytes = sizeof *mine * cm->world_size;
  int rc = comm->ops->allgather_device(comm, cm->d_rec, sizeof *mine, cm->d_all, err);
  if (rc) return rc;
  ZD_CUDA_TRY(err, cudaMemcpyAsync(cm->h_all, cm->d_all, bytes, cudaMemcpyDeviceToHost, c->stream),
              "GPU %d: copying %zu bytes of step records to the host", c->device, bytes);
  rc = comm->ops->sync(comm, err); /* the one wait in the middle of a step */
  if (rc) {
    note_failed_wait(c);
    return rc;
  }
  memcpy(all, cm->h_all, bytes);
  return ZD_OK;
}

static int cuda_update(zd__compute_t *base, const zd__shard_t *s, uint32_t b,
                       const zd__buffers_t *buf, const zd__adam_group_t *consts, float grad_scale,
                       zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  cuda_shard_t *cm = s->cdata;
  const zd__bucket_t *bk = &s->layout->buckets[b];
  if (cm->d_groups && b == 0) { /* this step's constants, stream-ordered before every bucket */
    int rc = zd__cuda_groups_upload(cm->d_groups, consts, s->ngroups, c->stream, err);
    if (rc) return rc;
  }
  zd__cuda_adam_args_t a = {
      .grad = s->grad[b],
      .grad_dtype = s->grad_dtype[b],
      .param = param_slice(s, buf, b),
      .param_dtype = s->param_dtype,
      .grad_scale = grad_scale,
      .groups = cm->d_groups ? NULL : consts,
      .d_groups = cm->d_groups,
      .ngroups = s->ngroups,
  };
  for (int i = 0; i < ZD__NSTATES; i++) /* bucket b's part of every array the shard has */
    a.state[i] = s->state[i] ? s->state[i] + bk->shard_base : NULL;
  return zd__cuda_adam_step(cm->layouts[b], &a, c->stream, err);
}

/* Loop thread, between jobs (compute.h): c->device and c->stream are set once at create. */
static int cuda_stream_idle(zd__compute_t *base) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  return !__atomic_load_n(&c->busy, __ATOMIC_ACQUIRE); /* no CUDA call: see busy */
}

static void cuda_destroy(zd__compute_t *base) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  if (c->done) cudaEventDestroy(c->done);
  if (c->setup) cudaStreamDestroy(c->setup);
  if (c->stream) cudaStreamDestroy(c->stream); /* returns at once; queued work still completes */
  (void)cudaGetLastError();
  free(c);
}

static const zd__compute_ops_t cuda_ops = {
    .alloc = cuda_alloc,
    .release = cuda_release,
    .copy_state = cuda_copy_state,
    .shard_init = cuda_shard_init,
    .shard_fini = cuda_shard_fini,
    .begin = cuda_begin,
    .finish = cuda_finish,
    .exchange = cuda_exchange,
    .grad_stats = cuda_grad_stats,
    .gather_records = cuda_gather_records,
    .update = cuda_update,
    .stream_idle = cuda_stream_idle,
    .destroy = cuda_destroy,
};

int zd__compute_cuda_create(int device, int timeout_ms, zd__compute_t **out, zd__err_t *err) {
  zd__err_t check = {0};
  if (zd__cuda_device_check(device, &check) != ZD_OK)
    return zd__errf(err, ZD_EBACKEND, "%s", check.msg);
  cuda_compute_t *c = calloc(1, sizeof *c);
  if (!c) return zd__errf(err, -ENOMEM, "out of memory");
  c->base.ops = &cuda_ops;
  c->base.name = "cuda";
  c->device = device;
  c->timeout_ms = timeout_ms;
  int rc = ZD_OK;
  ZD_CUDA_GOTO(err, rc, fail, cudaSetDevice(device), "cudaSetDevice(%d)", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking),
               "GPU %d: cudaStreamCreate", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaStreamCreateWithFlags(&c->setup, cudaStreamNonBlocking),
               "GPU %d: cudaStreamCreate", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming),
               "GPU %d: cudaEventCreate", device);
  /* Nothing is queued yet: load every kernel the rank launches now, not at its first launch
   * behind a wait for the client or a peer (exchange_cuda.h, adam_cuda.h). */
  if ((rc = zd__cuda_exchange_preload(err))) goto fail;
  if ((rc = zd__cuda_kernels_preload(err))) goto fail;
  *out = &c->base;
  return ZD_OK;
fail:
  cuda_destroy(&c->base);
  return rc;
}

void *zd__compute_cuda_stream(zd__compute_t *base) {
  return ((cuda_compute_t *)base)->stream;
}
