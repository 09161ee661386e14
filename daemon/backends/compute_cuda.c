/* The CUDA compute backend (compute.h): a rank's state in device memory, its kernels (kernels/
 * adam_cuda.h, and every optimizer of the table through kernels/optim_cuda.h) queued on the rank's
 * one non-blocking stream, in the order the step logic asks for them.
 *
 * Per job, on the stream: wait for the client's "grads ready" event of the job's event slot
 * (begin); the collectives and kernels of the job; record the slot's "params ready" event
 * (finish). A slot's events belong to one request at a time (the client reuses a slot only after
 * its reply, and every call naming the slot's events is made before the reply), so each wait
 * covers exactly the client's work before that request, never a later request's. The worker
 * thread waits for the GPU at two places only, both bounded and polling the communicator
 * (cuda_step legacy: an event polled, spinning then sleeping; fast: the stream's wake-up,
 * cuda_check.h):
 *   - when the step needs statistics: the statistics kernels write this rank's record in device
 *     memory and NCCL all-gathers the records there. Legacy (gather_records): one copy brings them
 *     to pinned host memory, where step.c checks the agreement and takes the decision, and the
 *     update is queued only after that. Fast (queue_decision, wait_decision): the receive buffer
 *     is poisoned first, a kernel takes the decision from the gathered records, the update kernels
 *     read it (they do nothing unless it says APPLY), and the host waits, once the update is
 *     queued, for the copy of the decision and the records alone, and checks it (step.c).
 *   - finish, before the job's reply: the reply says what happened (applied, norm, scale, or the
 *     peer failure), and the session may release the client's buffers once no job is in flight.
 *     cuda_step fast: a scatter's, a gather's or a step's reply is known once the work is queued
 *     (finish_early): the job returns then, with `busy` left set, and its work is seen complete
 *     later by settle (the worker between jobs), by the next job's wait, or found failed by the
 *     next begin; a failure found so is returned by the next begin (the next reply).
 *
 * Timing (both modes): each step with an update records timing events at the boundaries of its
 * parts (compute.h, zd__phase_times_t) in one of a few sets; a set is read once a later wait or
 * query found its last event complete, and added to the rank's totals (phase_times).
 *
 * A client that left. Its buffers and events are CUDA IPC mappings of another process, which may
 * be dead: what CUDA does with them then is undefined, and a device fault would take every state
 * array on this GPU with it. So once the loop has seen the connection end (zd__buffers_t's
 * client_gone), a job that begins refuses (ZD_ECLOSED) before it queues anything, finish records
 * no "params ready", and the stand-in (step.c) works in scratch memory of its own. What remains
 * undefined is the work queued before zerod knew: a job that began before the connection's end
 * was seen (a window of one loop iteration after the exit, or a job running when the client was
 * killed) has its stream wait on the client's "grads ready", read its gradients and write its
 * parameters. A client records "grads ready" before it sends the request, so that wait is for
 * work the dying process had queued; should it never complete, finish's wait ends at the
 * collective timeout, the communicator is aborted and the rank degraded, the stream counts as
 * stuck (its memory, and the client's mappings, are then never freed: buffers.c) and nothing
 * else is queued there. That is the bound: one rank, at most one job per event slot, the
 * collective timeout.
 *
 * Snapshots (checkpoints) copy the state to pinned host memory on a side stream, after the step's
 * work; the rank's stream waits for that copy (a stream wait), so the next update cannot write
 * the state under it, and the step's reply does not wait for it: the checkpoint writer does
 * (fence_wait).
 *
 * Parameters skipped or stepped at their own step count (presence, step.c's uneven shards): every
 * bucket has a second layout at registration, one segment per parameter (kernels/cuda_plan.h),
 * and such a step uploads the map from each parameter to its constants (or ZD__CUDA_SKIP) before
 * its first bucket; the kernels read it per tile. A step whose parameters are all at the model's
 * step uses the model's layouts and no map, as before.
 *
 * Layouts (tile tables of adam_cuda.h) are built once per bucket at registration, on a separate
 * set-up stream (building one waits for its stream, which must not be the rank's: that one may be
 * waiting for the client). Memory is freed only once the rank's stream has run out (a bounded
 * wait): a stream still busy after a failure (the rank is then degraded) keeps its memory until
 * the process exits, rather than risking cudaFree's unbounded device-wide wait.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adam_cuda.h"
#include "clock.h"
#include "compute.h"
#include "cuda_check.h"
#include "exchange_cuda.h"
#include "cuda_plan.h"
#include "log.h"
#include "optim.h"
#include "optim_cuda.h"

/* The step record is all-gathered as the statistics kernel writes it. */
_Static_assert(sizeof(zd__step_record_t) == sizeof(zd__cuda_stats_t), "record size");
_Static_assert(offsetof(zd__step_record_t, sumsq) == offsetof(zd__cuda_stats_t, sumsq), "sumsq");
_Static_assert(offsetof(zd__step_record_t, nonfinite) == offsetof(zd__cuda_stats_t, nonfinite),
               "nonfinite");
_Static_assert(offsetof(zd__step_record_t, step) == offsetof(zd__cuda_stats_t, tags), "tags");
_Static_assert(ZD__CUDA_TAGS == 3, "step, layout_hash, hparam_hash");
_Static_assert(offsetof(zd__step_record_t, check) == offsetof(zd__cuda_stats_t, check), "check");
_Static_assert(offsetof(zd__step_record_t, check) == ZD__RECORD_CHECKED, "the checked bytes");

/* Timing event sets in flight: a step's set is read some steps later, once found complete. */
#define TIMING_SETS  8
#define TIMING_MARKS 5 /* start, scatter end, statistics end, update end, gather end */

typedef struct timing {
  cudaEvent_t ev[TIMING_MARKS];
  int state; /* 0: free; 1: being recorded by the running job; 2: recorded, not read yet */
} timing_t;

typedef struct cuda_compute {
  zd__compute_t base;
  int device;
  int fast;                  /* cuda_step fast (else legacy) */
  zd__cuda_waiter_t *waiter; /* fast: the stream's wake-up, shared with the communicator */
  cudaEvent_t last;          /* fast: recorded by finish_early after the job's work */
  int deferred;              /* a finish_early left work running that no wait has seen end */
  uint64_t deferred_since_us;
  int failed;        /* that work failed with this code: the next begin says so (then 0) */
  zd__err_t failure; /* ... with this message */
  /* fast, a step with statistics (queue_decision): the decision, in device and pinned host memory
   * (zd__cuda_decision_t; allocated at create, before anything is queued), the event and wake-up
   * generation after its copy, and the decision this job's updates read (NULL: none, they run
   * with their grad_scale) */
  void *d_dec, *h_dec;
  cudaEvent_t decided; /* on the rank's stream, after the decision kernel */
  /* The decision's copies and their wake-up run on a stream of their own, which waits on
   * `decided`: a host function holds every later operation of its stream until it has run, and
   * on the rank's stream that would hold the update kernels for the wake-up's latency. */
  cudaStream_t notify;
  zd__cuda_waiter_t *notify_waiter; /* the wake-up of `notify` (one waiter per stream) */
  cudaEvent_t notified;             /* recorded on `notify` after the host function */
  uint32_t decided_gen;
  const void *decision;
  timing_t timing[TIMING_SETS];
  timing_t *cur; /* the running job's set, or NULL */
  int mark;      /* the next boundary cur records (1..TIMING_MARKS-1) */
  zd__phase_times_t times;
  cudaStream_t stream; /* the rank's: every kernel, copy and collective of its jobs */
  cudaStream_t setup;  /* layout tables at registration */
  cudaStream_t side;   /* snapshots: the state's copy to pinned host memory, off the step's path */
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
  zd__cuda_layout_t **layouts; /* per bucket, from the model's segments */
  /* Steps whose parameters are not all at the model's step (cuda_update): per bucket, a layout
   * of one segment per parameter (group: its index; kernels/cuda_plan.h), the model's segments
   * (a shard with others is such a step's), and the map of such a step, from parameter to
   * constants or ZD__CUDA_SKIP, in host memory (built) and device memory (uploaded). */
  zd__cuda_layout_t **param_layouts;
  zd__segment_t *const *segs;
  uint32_t nparams;
  uint32_t *h_map;
  uint32_t *d_map;
  zd__step_record_t *d_rec;   /* device: this rank's record */
  zd__step_record_t *d_all;   /* device: every rank's */
  zd__step_record_t *h_all;   /* pinned host: every rank's, for the agreement */
  zd__adam_group_t *d_groups; /* device, more groups than travel with a launch */
  uint32_t groups_cap;        /* ... of which d_groups has room for this many */
  uint32_t world_size;
} cuda_shard_t;

/* Before memory is freed: waits (bounded) until no work of the rank is queued or running, since
 * cudaFree waits for the whole device without a bound. A model replaced at registration is freed
 * while the new one's set-up is still queued; that completes. 0 when the stream is stuck (a
 * failure left work that does not complete): the memory is then left to the process's exit. */
static void set_busy(cuda_compute_t *c, int busy) {
  __atomic_store_n(&c->busy, busy, __ATOMIC_RELEASE);
}

/* Set once a rank's stream of this process was found stuck (note_stuck: a wait for it timed
 * out): it may never run out, and cudaFreeHost, which waits for the whole device, could then
 * block for ever. Pinned memory is leaked from then on (cuda_host_free). */
static atomic_int any_stuck;

static void note_stuck(cuda_compute_t *c) {
  c->stuck = 1;
  atomic_store(&any_stuck, 1);
}

/* Whether `stream` has run out, waiting for it at most the timeout. */
static int stream_drained(cuda_compute_t *c, cudaStream_t stream) {
  cudaError_t e = cudaStreamQuery(stream);
  (void)cudaGetLastError();
  if (e != cudaErrorNotReady) return 1; /* idle, or the context failed and nothing will run */
  if (c->stuck) return 0; /* waited in vain once already: do not wait again for each array */
  zd__err_t err = {0};
  e = cudaEventRecord(c->done, stream);
  if (e == cudaSuccess && zd__cuda_event_wait(c->done, c->timeout_ms, NULL, NULL,
                                              "the rank's queued GPU work", &err) == ZD_OK)
    return 1;
  (void)cudaGetLastError();
  note_stuck(c);
  return 0;
}

/* The side stream too: the rank's stream waits for every snapshot it queued, but a snapshot that
 * failed half-way may have left a copy there without that wait. */
static int drained(cuda_compute_t *c) {
  if (!stream_drained(c, c->side) || !stream_drained(c, c->stream)) return 0;
  c->stuck = 0;
  set_busy(c, 0);
  return 1;
}

/* After a failed wait of the communicator (which aborted it and already let the stream drain for
 * a while): a stream that still has work is stuck, and freeing must not wait for it again, up to
 * the collective timeout per array (at shutdown that would hold the exit for as long). */
static void note_failed_wait(cuda_compute_t *c) {
  cudaError_t e = cudaStreamQuery(c->stream);
  (void)cudaGetLastError();
  if (e == cudaErrorNotReady) note_stuck(c);
  set_busy(c, e == cudaErrorNotReady);
}

static void leak_warning(const cuda_compute_t *c, const char *what) {
  ZD_LOG_WARN("GPU %d: %s not freed: the rank's stream still has work queued after a failure",
              c->device, what);
}

/* ---- timing ---------------------------------------------------------------------------------- */

/* Records boundary `m` of the running job's set (at most once, in order; a later boundary also
 * records the ones the job skipped, as a step without statistics has no statistics part). */
static void timing_mark(cuda_compute_t *c, int m) {
  if (!c->cur) return;
  for (; c->mark <= m; c->mark++)
    if (cudaEventRecord(c->cur->ev[c->mark], c->stream) != cudaSuccess) {
      (void)cudaGetLastError();
      c->cur->state = 0; /* not measured */
      c->cur = NULL;
      return;
    }
}

/* Adds the sets whose last event has completed to the totals: queries only, no wait. */
static void timing_harvest(cuda_compute_t *c) {
  for (int i = 0; i < TIMING_SETS; i++) {
    timing_t *t = &c->timing[i];
    if (t->state != 2) continue;
    cudaError_t e = cudaEventQuery(t->ev[TIMING_MARKS - 1]);
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      continue;
    }
    t->state = 0;
    float ms[TIMING_MARKS - 1];
    int ok = e == cudaSuccess;
    for (int k = 0; ok && k < TIMING_MARKS - 1; k++)
      ok = cudaEventElapsedTime(&ms[k], t->ev[k], t->ev[k + 1]) == cudaSuccess;
    (void)cudaGetLastError();
    if (!ok) continue;
    c->times.steps++;
    c->times.scatter_us += 1e3 * ms[0];
    c->times.stats_us += 1e3 * ms[1];
    c->times.update_us += 1e3 * ms[2];
    c->times.gather_us += 1e3 * ms[3];
  }
}

/* At begin: a free set for this job, or none (every set still in flight: not measured). */
static void timing_start(cuda_compute_t *c) {
  c->cur = NULL;
  timing_harvest(c);
  for (int i = 0; i < TIMING_SETS && !c->cur; i++)
    if (c->timing[i].ev[0] && c->timing[i].state == 0) c->cur = &c->timing[i];
  if (!c->cur) return;
  c->cur->state = 1;
  c->mark = 0;
  timing_mark(c, 0);
}

/* At finish: a step that ran its update is read later; anything else is not counted. */
static void timing_end(cuda_compute_t *c) {
  if (!c->cur) return;
  if (c->mark == TIMING_MARKS - 1) { /* the last update was queued */
    timing_mark(c, TIMING_MARKS - 1);
    if (c->cur) c->cur->state = 2;
  } else {
    c->cur->state = 0;
  }
  c->cur = NULL;
}

static void cuda_phase_times(zd__compute_t *base, zd__phase_times_t *out) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  timing_harvest(c);
  *out = c->times;
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

/* ---- host staging, snapshots and restores ---------------------------------------------------
 *
 * Host staging is pinned (cudaMallocHost): a copy between device and pageable memory is
 * synchronous with the host (the driver stages it), so a wait after it bounds nothing, and a copy
 * queued behind a wait for the client or a hung collective would block the worker for ever.
 * Pinned copies are DMA, queued like any other work, and the waits for them are bounded. */

static int cuda_host_alloc(zd__compute_t *base, size_t bytes, void **out, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  *out = NULL;
  ZD_CUDA_TRY(err, cudaMallocHost(out, bytes ? bytes : 1),
              "GPU %d: cudaMallocHost of %zu bytes of staging for the state", c->device, bytes);
  return ZD_OK;
}

/* cudaFreeHost waits for the whole device: once a wait timed out anywhere in the process (a stream
 * that may never run out), the memory is left to the process's exit instead. */
static void cuda_host_free(void *p) {
  if (!p) return;
  if (atomic_load(&any_stuck)) {
    ZD_LOG_WARN(
        "pinned staging memory at %p not freed: a GPU stream of this zerod did not run "
        "out after a failure, and cudaFreeHost would wait for it",
        p);
    return;
  }
  cudaFreeHost(p);
  (void)cudaGetLastError();
}

/* On the side stream, after everything queued on the rank's stream (the step's update); the
 * rank's stream then waits for the copy: whatever it runs later that writes the state (the next
 * update, an exchange into master, a restore) comes after it, and nothing waits on the host. The
 * fence is the event recorded after the copy; the checkpoint writer waits for it. */
typedef struct fence {
  cudaEvent_t done; /* recorded on the side stream after the copy */
  int device;       /* made current by the thread that waits (the writer's has none) */
} fence_t;

static int cuda_snapshot(zd__compute_t *base, float *const *arrays, uint32_t count, uint64_t n,
                         float *host, void **fence, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  size_t bytes = (size_t)n * sizeof(float);
  cudaEvent_t after = NULL, done = NULL;
  int rc = ZD_OK;
  *fence = NULL;
  fence_t *f = malloc(sizeof *f);
  if (!f) return zd__errf(err, -ENOMEM, "out of memory");
  ZD_CUDA_GOTO(err, rc, exit, cudaEventCreateWithFlags(&after, cudaEventDisableTiming),
               "GPU %d: cudaEventCreate", c->device);
  ZD_CUDA_GOTO(err, rc, exit, cudaEventCreateWithFlags(&done, cudaEventDisableTiming),
               "GPU %d: cudaEventCreate", c->device);
  ZD_CUDA_GOTO(err, rc, exit, cudaEventRecord(after, c->stream), "GPU %d: cudaEventRecord",
               c->device);
  ZD_CUDA_GOTO(err, rc, exit, cudaStreamWaitEvent(c->side, after, 0), "GPU %d: cudaStreamWaitEvent",
               c->device);
  for (uint32_t i = 0; i < count; i++)
    ZD_CUDA_GOTO(
        err, rc, exit,
        cudaMemcpyAsync(host + (size_t)i * n, arrays[i], bytes, cudaMemcpyDeviceToHost, c->side),
        "GPU %d: queuing the snapshot's copy of %zu bytes", c->device, bytes);
  ZD_CUDA_GOTO(err, rc, exit, cudaEventRecord(done, c->side), "GPU %d: cudaEventRecord", c->device);
  ZD_CUDA_GOTO(err, rc, exit, cudaStreamWaitEvent(c->stream, done, 0),
               "GPU %d: cudaStreamWaitEvent", c->device);
  *f = (fence_t){.done = done, .device = c->device};
  *fence = f;
  f = NULL;
  done = NULL;
exit:
  /* Destroying an event whose work is still queued is allowed: CUDA releases it once done. */
  if (after) cudaEventDestroy(after);
  if (done) cudaEventDestroy(done);
  (void)cudaGetLastError();
  free(f);
  return rc;
}

/* Any thread (the checkpoint writer's, which makes the fence's device current: harmless there). */
static int cuda_fence_wait(void *fence, int timeout_ms, zd__err_t *err) {
  fence_t *f = fence;
  if (!f) return ZD_OK;
  cudaError_t e = cudaSetDevice(f->device);
  if (e != cudaSuccess)
    return zd__cuda_fail(err, e, __FILE__, __LINE__, "cudaSetDevice(%d)", f->device);
  char what[96];
  snprintf(what, sizeof what, "the snapshot's copy from GPU %d to pinned host memory", f->device);
  /* (A timeout here may be one slice of a longer wait: the checkpointer poisons the staging; a
   * copy that never ends leaves the rank's stream, which waits for it, stuck: note_stuck.) */
  return zd__cuda_event_wait(f->done, timeout_ms, NULL, NULL, what, err);
}

static void cuda_fence_free(void *fence) {
  fence_t *f = fence;
  if (!f) return;
  cudaEventDestroy(f->done);
  (void)cudaGetLastError();
  free(f);
}

/* A resume: on the rank's stream (after the registration's wait for the client's "grads ready"
 * and the new arrays' zeroing), then a wait bounded by timeout_ms. */
static int cuda_restore(zd__compute_t *base, float *const *arrays, uint32_t count, uint64_t n,
                        const float *host, int timeout_ms, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  size_t bytes = (size_t)n * sizeof(float);
  for (uint32_t i = 0; i < count; i++)
    ZD_CUDA_TRY(
        err,
        cudaMemcpyAsync(arrays[i], host + (size_t)i * n, bytes, cudaMemcpyHostToDevice, c->stream),
        "GPU %d: queuing the copy of %zu bytes of a checkpoint's state", c->device, bytes);
  ZD_CUDA_TRY(err, cudaEventRecord(c->done, c->stream), "GPU %d: cudaEventRecord", c->device);
  char what[200];
  snprintf(what, sizeof what,
           "the copy of a checkpoint's %u state arrays (%zu bytes each) to GPU %d (queued after "
           "the registration's wait for its client's grads_ready event)",
           count, bytes, c->device);
  int rc = zd__cuda_event_wait(c->done, timeout_ms, NULL, NULL, what, err);
  if (rc == -ETIMEDOUT) note_stuck(c);
  return rc;
}

static void cuda_shard_fini(zd__compute_t *base, zd__shard_t *s) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  cuda_shard_t *cm = s->cdata;
  if (!cm) return;
  /* A failure of work answered before it ran (settle) was this model's: the model is gone (a heal
   * drops it; a registration that replaces it has already been told at its begin), and the next
   * model's first job, a registration, must not fail with it on every rank. */
  c->failed = 0;
  if (drained(c)) {
    for (uint32_t b = 0; cm->layouts && b < cm->nbuckets; b++)
      zd__cuda_layout_destroy(cm->layouts[b]);
    for (uint32_t b = 0; cm->param_layouts && b < cm->nbuckets; b++)
      zd__cuda_layout_destroy(cm->param_layouts[b]);
    cudaFree(cm->d_map);
    cudaFree(cm->d_rec);
    cudaFree(cm->d_all);
    cudaFree(cm->d_groups);
    (void)cudaGetLastError();
    cuda_host_free(cm->h_all); /* unless another stream of the process is stuck */
  } else {
    leak_warning(c, "shard tables");
  }
  free(cm->layouts);
  free(cm->param_layouts);
  free(cm->h_map);
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
  cm->param_layouts = calloc(l->nbuckets, sizeof *cm->param_layouts);
  cm->segs = s->segs;
  cm->nparams = l->nparams;
  cm->h_map = malloc((l->nparams ? l->nparams : 1) * sizeof *cm->h_map);
  if (!cm->layouts || !cm->param_layouts || !cm->h_map)
    return zd__errf(err, -ENOMEM, "out of memory");
  for (uint32_t b = 0; b < l->nbuckets; b++) {
    int rc = zd__cuda_layout_create(s->segs[b], s->nsegs[b], l->buckets[b].shard_elems, c->setup,
                                    &cm->layouts[b], err);
    if (rc) return rc; /* the caller frees the shard, and with it what was built */
    uint32_t np = l->buckets[b].nparams;
    zd__segment_t *per = malloc((np ? np : 1) * sizeof *per);
    if (!per) return zd__errf(err, -ENOMEM, "out of memory");
    uint32_t n = zd__cuda_param_segments(l, s->rank, b, per);
    rc = zd__cuda_layout_create(per, n, l->buckets[b].shard_elems, c->setup, &cm->param_layouts[b],
                                err);
    free(per);
    if (rc) return rc;
  }
  ZD_CUDA_TRY(err,
              cudaMalloc((void **)&cm->d_map, (l->nparams ? l->nparams : 1) * sizeof(uint32_t)),
              "GPU %d: cudaMalloc of the parameters' map", c->device);
  size_t rec = sizeof(zd__step_record_t);
  ZD_CUDA_TRY(err, cudaMalloc((void **)&cm->d_rec, rec), "GPU %d: cudaMalloc of the record",
              c->device);
  ZD_CUDA_TRY(err, cudaMalloc((void **)&cm->d_all, rec * world_size),
              "GPU %d: cudaMalloc of %u records", c->device, world_size);
  ZD_CUDA_TRY(err, cudaMallocHost((void **)&cm->h_all, rec * world_size),
              "GPU %d: cudaMallocHost of %u records", c->device, world_size);
  /* A step with lagging parameters has up to one set of constants more per parameter
   * (step.c's uneven_build: the groups', then one per (group, step count) a parameter needs). */
  uint32_t cap = s->ngroups + l->nparams;
  if (cap > ZD__CUDA_GROUPS_INLINE) {
    ZD_CUDA_TRY(err, cudaMalloc((void **)&cm->d_groups, cap * sizeof *cm->d_groups),
                "GPU %d: cudaMalloc of %u groups", c->device, cap);
    cm->groups_cap = cap;
  }
  return ZD_OK;
}

/* ---- job edges ------------------------------------------------------------------------------ */

static int cuda_begin(zd__compute_t *base, const zd__buffers_t *buf, uint32_t slot,
                      zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  if (buf->device < 0) return ZD_OK;                           /* host buffers: nothing to order */
  zd_assert(slot < ZD__EVENT_SLOTS && buf->grads_ready[slot]); /* checked by the session */
  if (__atomic_load_n(&buf->client_gone, __ATOMIC_ACQUIRE)) /* shm.h: its IPC memory may be gone */
    return zd__errf(err, ZD_ECLOSED,
                    "the client disconnected before this job began: nothing was done, and its "
                    "CUDA buffers and events were not touched");
  if (c->failed) { /* an earlier job's work failed after its reply: this reply says so */
    int rc = c->failed;
    c->failed = 0;
    *err = c->failure;
    return rc;
  }
  if (c->deferred) { /* an earlier job's work may still run: has it failed? (a query, no wait) */
    cudaError_t q = cudaEventQuery(c->last);
    if (q == cudaSuccess) c->deferred = 0;
    if (q != cudaSuccess && q != cudaErrorNotReady) {
      c->deferred = 0;
      note_failed_wait(c);
      return zd__cuda_fail(err, q, __FILE__, __LINE__,
                           "GPU %d: the work of an earlier request (answered before it ran) failed",
                           c->device);
    }
    (void)cudaGetLastError();
  }
  set_busy(c, 1); /* until a wait sees the stream run out */
  cudaError_t e = cudaStreamWaitEvent(c->stream, (cudaEvent_t)buf->grads_ready[slot], 0);
  if (e == cudaSuccess) {
    timing_start(c);
    return ZD_OK;
  }
  (void)cudaGetLastError();
  return zd__errf(err, ZD_EBUFFER,
                  "GPU %d: cannot wait on the client's grads_ready[%u] event: %s "
                  "(%s); the event must be an IPC event of the buffers' GPU",
                  c->device, slot, cudaGetErrorString(e), cudaGetErrorName(e));
}

/* Records the client's "params ready" of the slot (CUDA buffers). */
static int record_params_ready(cuda_compute_t *c, const zd__buffers_t *buf, uint32_t slot,
                               zd__err_t *err) {
  int rc = ZD_OK;
  timing_end(c);
  c->decision = NULL; /* the job's updates are queued */
  /* Nobody waits on the event of a client that left, which may be gone with its process. */
  if (buf && buf->device >= 0 && !__atomic_load_n(&buf->client_gone, __ATOMIC_ACQUIRE)) {
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
  return rc;
}

static int cuda_finish(zd__compute_t *base, zd__comm_t *comm, const zd__buffers_t *buf,
                       uint32_t slot, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  int rc = record_params_ready(c, buf, slot, err);
  /* A CUDA rank always has its NCCL communicator (even at world size 1), which waits for the
   * stream and polls its own asynchronous errors. */
  zd_assert(comm && comm->ops->sync);
  zd__err_t werr = {0};
  int wrc = comm->ops->sync(comm, &werr);
  c->deferred = 0; /* the wait covered every earlier job's work too */
  if (wrc) {
    note_failed_wait(c);
    *err = werr;
    return wrc;
  }
  set_busy(c, 0); /* everything the job queued has run */
  timing_harvest(c);
  return rc;
}

static int cuda_finish_early(zd__compute_t *base, zd__comm_t *comm, const zd__buffers_t *buf,
                             uint32_t slot, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  /* legacy: today's wait; a broken communicator: its sync drains the stream and says why */
  if (!c->fast || zd__comm_failed(comm)) return cuda_finish(base, comm, buf, slot, err);
  int rc = record_params_ready(c, buf, slot, err);
  cudaError_t e = cudaEventRecord(c->last, c->stream);
  if (e != cudaSuccess) { /* cannot tell when it ends: wait for it now */
    (void)cudaGetLastError();
    return cuda_finish(base, comm, buf, slot, err);
  }
  if (!c->deferred) c->deferred_since_us = zd__now_us();
  c->deferred = 1; /* busy stays set until a wait or settle sees the stream run out */
  return rc;
}

static int cuda_settle(zd__compute_t *base, zd__comm_t *comm, int wait, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  if (!c->deferred) return ZD_OK;
  if (!wait && zd__now_us() - c->deferred_since_us < (uint64_t)c->timeout_ms * 1000u) {
    cudaError_t q = cudaEventQuery(c->last);
    if (q == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return -EAGAIN;
    }
    if (q == cudaSuccess) {
      c->deferred = 0;
      set_busy(c, 0); /* c->last follows everything queued: the stream has run out */
      timing_harvest(c);
      return ZD_OK;
    }
    c->deferred = 0;
    note_failed_wait(c);
    int rc =
        zd__cuda_fail(&c->failure, q, __FILE__, __LINE__,
                      "GPU %d: the work of a request answered before it ran failed", c->device);
    c->failed = rc;
    *err = c->failure;
    return rc;
  }
  /* The communicator's bounded wait, which aborts it on a timeout or an asynchronous error. */
  zd__err_t werr = {0};
  int rc = comm->ops->sync(comm, &werr);
  c->deferred = 0;
  if (rc) {
    note_failed_wait(c);
    c->failed = rc;
    c->failure = werr;
    *err = werr;
    return rc;
  }
  set_busy(c, 0);
  timing_harvest(c);
  return ZD_OK;
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

/* A stand-in's scratch (compute.h): this rank's slice zeroed, then the covered elements written
 * by the exchange kernel, whose conversion (adam.cuh's zd__dev_f32_to_bf16, or the fp32 value) is
 * the update kernel's store_param: the bits the client's buffer would hold. */
static int cuda_slice_params(zd__compute_t *base, const zd__shard_t *s, uint32_t b, void *bucket,
                             zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  const zd__bucket_t *bk = &s->layout->buckets[b];
  size_t bytes = (size_t)bk->shard_elems * zd_dtype_size(s->param_dtype);
  void *slice = (char *)bucket + (size_t)s->rank * bytes;
  ZD_CUDA_TRY(err, cudaMemsetAsync(slice, 0, bytes, c->stream), "GPU %d: zeroing %zu bytes",
              c->device, bytes);
  return zd__cuda_exchange(s->state[ZD__STATE_MASTER] + bk->shard_base, slice, s->param_dtype,
                           s->segs[b], s->nsegs[b], 1, c->stream, err);
}

static int cuda_zero(zd__compute_t *base, void *p, size_t bytes, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  ZD_CUDA_TRY(err, cudaMemsetAsync(p, 0, bytes, c->stream), "GPU %d: zeroing %zu bytes", c->device,
              bytes);
  return ZD_OK;
}

static int cuda_grad_stats(zd__compute_t *base, const zd__shard_t *s, uint32_t b, int first,
                           zd__step_record_t *rec, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  cuda_shard_t *cm = s->cdata;
  /* The first bucket overwrites the record and writes its tags; the others add to it, in bucket
   * order, as the CPU adds bucket after bucket. */
  uint64_t tags[ZD__CUDA_TAGS] = {rec->step, rec->layout_hash, rec->hparam_hash};
  if (first) timing_mark(c, 1); /* the scatter's end */
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
                       float *const *out, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  cuda_shard_t *cm = s->cdata;
  const zd__bucket_t *bk = &s->layout->buckets[b];
  /* One set of state arrays, updated in place: overlap_update is refused at start-up with this
   * backend (daemon.c), so this is a broken invariant's last guard. */
  if (out || !buf)
    return zd__errf(err, ZD_ECONFIG, "the cuda backend updates in place only (overlap_update)");
  /* A shard whose segments are not the model's: a step that skips parameters or steps some at
   * their own step count (step.c, uneven_build). Its segments become the map of the parameters'
   * constants (kernels/cuda_plan.h), uploaded before the first bucket, and every bucket is
   * updated over its per-parameter layout through it. */
  const int uneven = s->segs != cm->segs;
  if (b == 0) timing_mark(c, 2); /* the end of the statistics and the decision (or the scatter) */
  if (uneven && b == 0) {
    int rc = zd__cuda_param_map(s->layout, s->rank, (const zd__segment_t *const *)s->segs, s->nsegs,
                                s->ngroups, cm->h_map, err);
    if (!rc) rc = zd__cuda_map_upload(cm->d_map, cm->h_map, cm->nparams, c->stream, err);
    if (rc) return rc;
  }
  const int dev_groups = s->ngroups > ZD__CUDA_GROUPS_INLINE;
  if (dev_groups && s->ngroups > cm->groups_cap)
    return zd__errf(err, ZD_EINTERNAL, "%u sets of constants, room for %u on the device",
                    s->ngroups, cm->groups_cap);
  if (dev_groups && b == 0) { /* this step's constants, stream-ordered before every bucket */
    int rc = zd__cuda_groups_upload(cm->d_groups, consts, s->ngroups, c->stream, err);
    if (rc) return rc;
  }
  zd__cuda_adam_args_t a = {
      .grad = s->grad[b],
      .grad_dtype = s->grad_dtype[b],
      .param = param_slice(s, buf, b),
      .param_dtype = s->param_dtype,
      .grad_scale = grad_scale,
      .groups = consts, /* the dispatch by optimizer reads them (optim_cuda.h) */
      .d_groups = dev_groups ? cm->d_groups : NULL,
      .ngroups = s->ngroups,
      .d_map = uneven ? cm->d_map : NULL,
      .nmap = cm->nparams,
  };
  for (int i = 0; i < ZD__NSTATES; i++) /* bucket b's part of every array the shard has */
    a.state[i] = s->state[i] ? s->state[i] + bk->shard_base : NULL;
  a.d_decision = c->decision; /* queue_decision's: the update runs only where it says APPLY */
  /* Each kernel family of the optimizers' table that the groups use (kernels/optim_cuda.h). */
  int rc = zd__cuda_optim_step(uneven ? cm->param_layouts[b] : cm->layouts[b], &a, c->stream, err);
  if (!rc && b + 1 == s->layout->nbuckets) timing_mark(c, 3); /* the update's end */
  return rc;
}

/* ---- the decision on the device (cuda_step fast) -------------------------------------------- */

static int cuda_queue_decision(zd__compute_t *base, zd__comm_t *comm, const zd__shard_t *s,
                               const zd__cuda_decide_args_t *a, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  cuda_shard_t *cm = s->cdata;
  if (!comm->ops->allgather_device || !c->notify_waiter || !c->d_dec || !c->h_dec)
    return zd__errf(err, ZD_EINTERNAL, "the decision on the device needs a device communicator");
  size_t rec = sizeof(zd__step_record_t), bytes = rec * cm->world_size;
  /* A record the all-gather does not write whole (a peer failed in it) fails its check word. */
  ZD_CUDA_TRY(err, cudaMemsetAsync(cm->d_all, 0xFF, bytes, c->stream),
              "GPU %d: poisoning the records' receive buffer", c->device);
  int rc = comm->ops->allgather_device(comm, cm->d_rec, rec, cm->d_all, err);
  if (rc) return rc;
  zd__cuda_decide_args_t da = *a;
  da.d_all = (const zd__cuda_stats_t *)cm->d_all;
  rc = zd__cuda_step_decide(&da, c->d_dec, c->stream, err);
  if (rc) return rc;
  /* The copies and the wake-up wait on the rank's stream here, on `notify`; the rank's stream
   * goes on with the update at once. d_dec and d_all are written again only by the next step's
   * decision, which comes after this step's wait for the copies. */
  ZD_CUDA_TRY(err, cudaEventRecord(c->decided, c->stream), "GPU %d: recording an event", c->device);
  ZD_CUDA_TRY(err, cudaStreamWaitEvent(c->notify, c->decided, 0),
              "GPU %d: ordering the decision's copy", c->device);
  ZD_CUDA_TRY(err,
              cudaMemcpyAsync(c->h_dec, c->d_dec, sizeof(zd__cuda_decision_t),
                              cudaMemcpyDeviceToHost, c->notify),
              "GPU %d: copying the decision to the host", c->device);
  ZD_CUDA_TRY(err, cudaMemcpyAsync(cm->h_all, cm->d_all, bytes, cudaMemcpyDeviceToHost, c->notify),
              "GPU %d: copying %zu bytes of step records to the host", c->device, bytes);
  rc = zd__cuda_waiter_mark(c->notify_waiter, c->notify, c->notified, &c->decided_gen,
                            "the step's decision", err);
  if (rc) return rc;
  c->decision = c->d_dec;
  return ZD_OK;
}

static int cuda_wait_decision(zd__compute_t *base, zd__comm_t *comm, const zd__shard_t *s,
                              zd__cuda_decision_t *dec, zd__step_record_t *all, zd__err_t *err) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  cuda_shard_t *cm = s->cdata;
  /* The communicator's failures (NCCL's asynchronous errors; the group's break or an abort),
   * polled every millisecond. */
  zd__cuda_probe_fn probe = !strcmp(comm->backend, "nccl")         ? zd__comm_nccl_probe
                            : !strcmp(comm->backend, "cuda-group") ? zd__comm_cuda_group_probe
                                                                   : NULL;
  zd__err_t werr = {0};
  int rc = zd__cuda_waiter_wait(c->notify_waiter, c->decided_gen, c->notified, c->timeout_ms, probe,
                                comm, "the step's decision", &werr);
  if (rc) {
    /* As sync does on a failed wait: the communicator is aborted (its kernels exit) and the
     * stream drains, bounded; the rank is then degraded. */
    if (rc == -ETIMEDOUT)
      zd__errf(&werr, rc,
               "the step's decision not complete within %d ms (collective_timeout_ms): a peer is "
               "gone or stalled; NCCL communicator aborted",
               c->timeout_ms);
    zd__comm_abort(comm, rc, werr.msg);
    zd__err_t ignored = {0};
    (void)comm->ops->sync(comm, &ignored);
    note_failed_wait(c);
    *err = werr;
    return rc;
  }
  memcpy(dec, c->h_dec, sizeof *dec);
  memcpy(all, cm->h_all, sizeof *all * cm->world_size);
  return ZD_OK;
}

/* Loop thread, between jobs (compute.h): c->device and c->stream are set once at create. */
static int cuda_stream_idle(zd__compute_t *base) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  return !__atomic_load_n(&c->busy, __ATOMIC_ACQUIRE); /* no CUDA call: see busy */
}

static void cuda_destroy(zd__compute_t *base) {
  cuda_compute_t *c = (cuda_compute_t *)base;
  for (int i = 0; i < TIMING_SETS; i++)
    for (int k = 0; k < TIMING_MARKS; k++)
      if (c->timing[i].ev[k]) cudaEventDestroy(c->timing[i].ev[k]);
  if (c->last) cudaEventDestroy(c->last);
  if (c->decided) cudaEventDestroy(c->decided);
  if (c->notified) cudaEventDestroy(c->notified);
  if (!c->stuck && c->d_dec) cudaFree(c->d_dec); /* the model was freed first: the stream drained */
  if (!c->stuck) cuda_host_free(c->h_dec);       /* unless another stream of the process is stuck */
  if (c->done) cudaEventDestroy(c->done);
  if (c->setup) cudaStreamDestroy(c->setup);
  if (c->side) cudaStreamDestroy(c->side);
  if (c->notify) cudaStreamDestroy(c->notify);
  if (c->stream) cudaStreamDestroy(c->stream); /* returns at once; queued work still completes */
  (void)cudaGetLastError();
  zd__cuda_waiter_destroy(c->waiter); /* kept if a wake-up is still queued */
  zd__cuda_waiter_destroy(c->notify_waiter);
  free(c);
}

/* The operations both modes share. */
#define CUDA_COMMON_OPS                                                                            \
  .alloc = cuda_alloc, .release = cuda_release, .slice_params = cuda_slice_params,                 \
  .zero = cuda_zero, .host_alloc = cuda_host_alloc, .host_free = cuda_host_free,                   \
  .snapshot = cuda_snapshot, .fence_wait = cuda_fence_wait, .fence_free = cuda_fence_free,         \
  .restore = cuda_restore, .shard_init = cuda_shard_init, .shard_fini = cuda_shard_fini,           \
  .begin = cuda_begin, .finish = cuda_finish, .phase_times = cuda_phase_times,                     \
  .exchange = cuda_exchange, .grad_stats = cuda_grad_stats, .gather_records = cuda_gather_records, \
  .update = cuda_update, .stream_idle = cuda_stream_idle, .destroy = cuda_destroy

/* cuda_step legacy: a job's finish waits for its work, and the host decides. */
static const zd__compute_ops_t cuda_ops = {CUDA_COMMON_OPS};

/* cuda_step fast: the same, with the early finish and the decision on the device. */
static const zd__compute_ops_t cuda_ops_fast = {
    CUDA_COMMON_OPS,
    .finish_early = cuda_finish_early,
    .settle = cuda_settle,
    .queue_decision = cuda_queue_decision,
    .wait_decision = cuda_wait_decision,
};

int zd__compute_cuda_create(int device, int timeout_ms, int fast, zd__compute_t **out,
                            zd__err_t *err) {
  zd__err_t check = {0};
  if (zd__cuda_device_check(device, &check) != ZD_OK)
    return zd__errf(err, ZD_EBACKEND, "%s", check.msg);
  cuda_compute_t *c = calloc(1, sizeof *c);
  if (!c) return zd__errf(err, -ENOMEM, "out of memory");
  c->base.ops = fast ? &cuda_ops_fast : &cuda_ops;
  c->base.name = "cuda";
  c->device = device;
  c->timeout_ms = timeout_ms;
  c->fast = fast;
  int rc = ZD_OK;
  ZD_CUDA_GOTO(err, rc, fail, cudaSetDevice(device), "cudaSetDevice(%d)", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking),
               "GPU %d: cudaStreamCreate", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaStreamCreateWithFlags(&c->setup, cudaStreamNonBlocking),
               "GPU %d: cudaStreamCreate", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking),
               "GPU %d: cudaStreamCreate", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming),
               "GPU %d: cudaEventCreate", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaEventCreateWithFlags(&c->last, cudaEventDisableTiming),
               "GPU %d: cudaEventCreate", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaEventCreateWithFlags(&c->decided, cudaEventDisableTiming),
               "GPU %d: cudaEventCreate", device);
  for (int i = 0; i < TIMING_SETS; i++) /* with timing: the parts of a step (phase_times) */
    for (int k = 0; k < TIMING_MARKS; k++)
      ZD_CUDA_GOTO(err, rc, fail, cudaEventCreateWithFlags(&c->timing[i].ev[k], cudaEventDefault),
                   "GPU %d: cudaEventCreate", device);
  if (fast && (rc = zd__cuda_waiter_create(&c->waiter, err))) goto fail;
  if (fast && (rc = zd__cuda_waiter_create(&c->notify_waiter, err))) goto fail;
  /* fast: the decision's memory, here rather than at the first step, where an allocation would
   * come behind the step's queued work (cudaMallocHost may wait for the device). */
  if (fast) {
    ZD_CUDA_GOTO(err, rc, fail, cudaMalloc(&c->d_dec, sizeof(zd__cuda_decision_t)),
                 "GPU %d: cudaMalloc of the decision", device);
    ZD_CUDA_GOTO(err, rc, fail, cudaMallocHost(&c->h_dec, sizeof(zd__cuda_decision_t)),
                 "GPU %d: cudaMallocHost of the decision", device);
    ZD_CUDA_GOTO(err, rc, fail, cudaStreamCreateWithFlags(&c->notify, cudaStreamNonBlocking),
                 "GPU %d: cudaStreamCreate", device);
    ZD_CUDA_GOTO(err, rc, fail, cudaEventCreateWithFlags(&c->notified, cudaEventDisableTiming),
                 "GPU %d: cudaEventCreate", device);
  }
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

void *zd__compute_cuda_waiter(zd__compute_t *base) {
  return ((cuda_compute_t *)base)->waiter;
}
