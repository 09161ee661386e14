/* The group communicator (comm.h): the collectives of local ranks of this zerod that share one
 * GPU, done inside the process in device memory, without NCCL (which refuses two ranks on one
 * GPU). Every pointer the ranks exchange is valid process-wide on that device: a client's
 * buffers are IPC mappings opened in this process, the state, scratch and step records are
 * cudaMalloc'd here. So a rank's kernels read its peers' buffers directly.
 *
 * The members of one world instance (the key: world.c's instance id) share a group (devgroup.h: the
 * registry, the rendezvous and the failures, host code tested without a GPU); each member
 * creates its communicator on its worker thread and waits (bounded by connect_timeout_ms,
 * cancelled through *stop) until every member has joined. A collective is matched by order, as
 * with NCCL, and checked: members that are in different operations (or buckets, dtypes, sizes)
 * fail instead of mixing unrelated buffers.
 *
 * One collective, on each member's worker thread:
 *   1. record the member's "arrived" event on its stream (after everything queued there so far:
 *      the client's "grads ready" wait, the update that wrote its slice) and publish the
 *      operation and its buffer under the group's lock;
 *   2. rendezvous A: wait until every member has published (bounded by collective_timeout_ms;
 *      a break of the group, an abort from any thread included, ends the wait at once);
 *   3. the member's stream waits on every peer's "arrived" event (cudaStreamWaitEvent: no host
 *      wait) and then pulls: the reduction kernel reads this rank's slice of every peer's
 *      gradients and writes the sum into this rank's scratch; a gather copies every peer's slice
 *      into this rank's own buffer. A member writes only its own memory;
 *   4. record the member's "consumed" event; rendezvous B; the member's stream waits on every
 *      peer's "consumed" event. So the member's stream (and with it its sync, its reply, and the
 *      release of its memory) is ordered after every peer's reads of its buffers: no client
 *      reuses a buffer a peer still reads. Rendezvous B is not ended by a break: every member
 *      that passed A comes to B after non-blocking CUDA calls only; after a break it waits at
 *      most ZD__DEVGROUP_GRACE_MS more.
 * The rendezvous also keep the events' records apart: a member records its events again only
 * after every peer has queued its waits on the earlier records.
 *
 * Failures: a rendezvous that times out (a member's worker is stuck or gone), an abort, a CUDA
 * error, or mismatched operations break the whole group (every member's current and later calls
 * fail with the first reason; the ranks are then degraded and, with checkpoints, re-form the
 * world with a new group). sync waits for the member's stream at most collective_timeout_ms,
 * polling the break. A member whose stream never completes (a client's event that never fires)
 * holds its peers' streams behind their waits on its events: their host threads still return
 * within the timeout, and the streams stay stuck (compute_cuda.c then leaves their memory to the
 * process's exit), as an NCCL kernel waiting for a dead peer would without its abort.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "cuda_check.h"
#include "devgroup.h"
#include "group_cuda.h"
#include "log.h"

#define DRAIN_MS 10000 /* after a failure, how long the stream may take to run out */

_Static_assert(ZD__GROUP_REDUCE_MAX >= ZD__DEVGROUP_MAX, "the kernel reduces every member");

enum { OP_REDUCE_SCATTER = 1, OP_ALL_GATHER, OP_BYTES, OP_RECORDS };
enum { ARRIVED = 0, CONSUMED = 1 }; /* the members' events: group handles */

typedef struct group_comm {
  zd__comm_t base;
  zd__devgroup_t *g;
  int device;
  cudaStream_t stream;       /* the rank's; not owned */
  cudaEvent_t done;          /* recorded by sync */
  zd__cuda_waiter_t *waiter; /* cuda_step fast: the stream's wake-up (not owned); NULL: polling */
  int timeout_ms;
} group_comm_t;

static cudaEvent_t event_of(const group_comm_t *c, uint32_t r, int which) {
  return (cudaEvent_t)zd__devgroup_handle(c->g, r, which);
}

/* A CUDA failure breaks the group (its message: the call, file:line); returns the group's error. */
static int cuda_broke(group_comm_t *c, cudaError_t e, int line, const char *what, const char *call,
                      zd__err_t *err) {
  zd__err_t cerr = {0};
  int code = zd__cuda_fail(&cerr, e, __FILE__, line, "GPU %d: %s: %s", c->device, what, call);
  zd__devgroup_break(c->g, code, "%s", cerr.msg);
  return zd__devgroup_error(c->g, err);
}

/* The stream waits on every peer's record of event `which`. */
static cudaError_t wait_peers(group_comm_t *c, int which) {
  for (uint32_t r = 0; r < zd__devgroup_size(c->g); r++) {
    if (r == c->base.rank) continue;
    cudaError_t e = cudaStreamWaitEvent(c->stream, event_of(c, r, which), 0);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

/* ---- the operations -------------------------------------------------------------------------- */

/* What every device collective does around its pull (see the top of the file). pull queues this
 * member's reads of its peers' buffers on the stream; it runs only once every member published. */
typedef int (*pull_fn)(group_comm_t *c, const void *arg, zd__err_t *err);

static int device_collective(group_comm_t *c, const zd__devgroup_post_t *p, pull_fn pull,
                             const void *arg, const char *what, zd__err_t *err) {
  uint32_t me = c->base.rank;
  int rc = zd__devgroup_error(c->g, err);
  if (rc) return rc;
  cudaError_t e = cudaEventRecord(event_of(c, me, ARRIVED), c->stream);
  if (e != cudaSuccess) return cuda_broke(c, e, __LINE__, what, "cudaEventRecord", err);
  rc = zd__devgroup_meet(c->g, me, p, c->timeout_ms, what, err);
  if (rc) return rc;
  /* From here on every member comes to rendezvous B, whatever fails on the way. */
  zd__err_t perr = {0};
  int prc = ZD_OK;
  e = wait_peers(c, ARRIVED);
  if (e != cudaSuccess)
    prc = zd__cuda_fail(&perr, e, __FILE__, __LINE__, "GPU %d: %s: waiting on a peer's event",
                        c->device, what);
  if (!prc) prc = pull(c, arg, &perr);
  e = cudaEventRecord(event_of(c, me, CONSUMED), c->stream);
  if (!prc && e != cudaSuccess)
    prc = zd__cuda_fail(&perr, e, __FILE__, __LINE__, "GPU %d: %s: recording an event", c->device,
                        what);
  rc = zd__devgroup_done(c->g, me, c->timeout_ms, what, err);
  if (!rc) {
    e = wait_peers(c, CONSUMED);
    if (!prc && e != cudaSuccess)
      prc = zd__cuda_fail(&perr, e, __FILE__, __LINE__, "GPU %d: %s: waiting on a peer's event",
                          c->device, what);
  }
  if (prc) {
    zd__devgroup_break(c->g, prc, "%s", perr.msg);
    return zd__devgroup_error(c->g, err);
  }
  return rc;
}

typedef struct reduce_arg {
  zd_dtype_t dtype;
  uint64_t shard_elems;
  float *scratch;
} reduce_arg_t;

static int pull_reduce(group_comm_t *c, const void *arg, zd__err_t *err) {
  const reduce_arg_t *a = arg;
  uint32_t n = zd__devgroup_size(c->g);
  const void *src[ZD__GROUP_REDUCE_MAX];
  for (uint32_t r = 0; r < n; r++) src[r] = zd__devgroup_post(c->g, r)->src;
  return zd__cuda_group_reduce(src, n, a->dtype, (uint64_t)c->base.rank * a->shard_elems,
                               a->shard_elems, a->scratch, c->stream, err);
}

static int group_reduce_scatter(zd__comm_t *comm, uint32_t bucket, const void *send,
                                zd_dtype_t dtype, uint64_t shard_elems, float *scratch,
                                const void **shard, zd_dtype_t *shard_dtype, zd__err_t *err) {
  group_comm_t *c = (group_comm_t *)comm;
  if (!scratch)
    return zd__errf(err, ZD_EINTERNAL, "group reduce-scatter of bucket %u without scratch", bucket);
  char what[64];
  snprintf(what, sizeof what, "the reduce-scatter of bucket %u", bucket);
  zd__devgroup_post_t p = {.op = OP_REDUCE_SCATTER,
                           .bucket = bucket,
                           .dtype = (int32_t)dtype,
                           .elems = shard_elems,
                           .src = send};
  reduce_arg_t a = {.dtype = dtype, .shard_elems = shard_elems, .scratch = scratch};
  int rc = device_collective(c, &p, pull_reduce, &a, what, err);
  if (rc) return rc;
  *shard = scratch; /* summed in fp32 (comm.h) */
  *shard_dtype = ZD_F32;
  return ZD_OK;
}

typedef struct gather_arg {
  char *dst;        /* this member's buffer */
  size_t slice;     /* bytes per member */
  int in_place;     /* member r's slice is at r * slice in its buffer (else at its start) */
  int include_self; /* copy this member's own slice too */
} gather_arg_t;

static int pull_gather(group_comm_t *c, const void *arg, zd__err_t *err) {
  const gather_arg_t *a = arg;
  for (uint32_t r = 0; r < zd__devgroup_size(c->g); r++) {
    if (r == c->base.rank && !a->include_self) continue;
    const char *from =
        (const char *)zd__devgroup_post(c->g, r)->src + (a->in_place ? (size_t)r * a->slice : 0);
    ZD_CUDA_TRY(err,
                cudaMemcpyAsync(a->dst + (size_t)r * a->slice, from, a->slice,
                                cudaMemcpyDeviceToDevice, c->stream),
                "GPU %d: copying rank %u's %zu bytes", c->device, r, a->slice);
  }
  return ZD_OK;
}

static int group_all_gather(zd__comm_t *comm, uint32_t bucket, void *buf, zd_dtype_t dtype,
                            uint64_t shard_elems, zd__err_t *err) {
  group_comm_t *c = (group_comm_t *)comm;
  char what[64];
  snprintf(what, sizeof what, "the all-gather of bucket %u", bucket);
  zd__devgroup_post_t p = {.op = OP_ALL_GATHER,
                           .bucket = bucket,
                           .dtype = (int32_t)dtype,
                           .elems = shard_elems,
                           .src = buf};
  gather_arg_t a = {
      .dst = buf, .slice = shard_elems * zd_dtype_size(dtype), .in_place = 1, .include_self = 0};
  return device_collective(c, &p, pull_gather, &a, what, err);
}

static int group_allgather_device(zd__comm_t *comm, const void *send, size_t bytes, void *recv,
                                  zd__err_t *err) {
  group_comm_t *c = (group_comm_t *)comm;
  zd__devgroup_post_t p = {.op = OP_RECORDS, .elems = bytes, .src = send};
  gather_arg_t a = {.dst = recv, .slice = bytes, .in_place = 0, .include_self = 1};
  return device_collective(c, &p, pull_gather, &a, "the all-gather of the step records", err);
}

/* Host records: no stream involved; rendezvous B keeps every member's send alive until the
 * others have copied it. */
static int group_allgather_bytes(zd__comm_t *comm, const void *send, size_t bytes, void *recv,
                                 zd__err_t *err) {
  group_comm_t *c = (group_comm_t *)comm;
  const char *what = "the all-gather of host records";
  int rc = zd__devgroup_error(c->g, err);
  if (rc) return rc;
  zd__devgroup_post_t p = {.op = OP_BYTES, .elems = bytes, .src = send};
  rc = zd__devgroup_meet(c->g, c->base.rank, &p, c->timeout_ms, what, err);
  if (rc) return rc;
  for (uint32_t r = 0; r < zd__devgroup_size(c->g); r++)
    memcpy((char *)recv + (size_t)r * bytes, zd__devgroup_post(c->g, r)->src, bytes);
  return zd__devgroup_done(c->g, c->base.rank, c->timeout_ms, what, err);
}

/* After a failure: lets the stream run out (bounded), so that the memory its queued work uses
 * may be released. */
static void drain(group_comm_t *c) {
  if (cudaEventRecord(c->done, c->stream) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  zd__err_t err = {0};
  if (zd__cuda_event_wait(c->done, DRAIN_MS, NULL, NULL, "draining the stream", &err) != ZD_OK)
    ZD_LOG_WARN("GPU %d: rank %u's stream did not run out after the group broke: %s", c->device,
                c->base.rank, err.msg);
}

/* While waiting for the stream: the group's break. */
static int group_sync(zd__comm_t *comm, zd__err_t *err) {
  group_comm_t *c = (group_comm_t *)comm;
  if (zd__devgroup_failed(c->g)) {
    drain(c);
    return zd__devgroup_error(c->g, err);
  }
  cudaError_t e = cudaEventRecord(c->done, c->stream);
  if (e != cudaSuccess) return cuda_broke(c, e, __LINE__, "sync", "cudaEventRecord", err);
  zd__err_t werr = {0};
  int rc = c->waiter
               ? zd__cuda_stream_wait(c->waiter, c->stream, c->done, c->timeout_ms,
                                      zd__comm_cuda_group_probe, c, "the rank's GPU work", &werr)
               : zd__cuda_event_wait(c->done, c->timeout_ms, zd__comm_cuda_group_probe, c,
                                     "the rank's GPU work", &werr);
  if (rc == ZD_OK) return ZD_OK;
  if (rc == -ETIMEDOUT)
    zd__devgroup_break(c->g, -ETIMEDOUT,
                       "rank %u's GPU work not complete within %d ms (collective_timeout_ms): a "
                       "rank of the group is stuck (its client's work never completed?)",
                       c->base.rank, c->timeout_ms);
  else
    zd__devgroup_break(c->g, rc, "%s", werr.msg);
  drain(c);
  return zd__devgroup_error(c->g, err);
}

void zd__comm_cuda_group_set_waiter(zd__comm_t *comm, void *waiter) {
  ((group_comm_t *)comm)->waiter = waiter;
}

int zd__comm_cuda_group_probe(void *comm, zd__err_t *err) {
  return zd__devgroup_error(((group_comm_t *)comm)->g, err);
}

static int group_failed(const zd__comm_t *comm) {
  return zd__devgroup_failed(((const group_comm_t *)comm)->g) != 0;
}

/* Breaks the whole group: its collectives cannot complete without this member anyway. No CUDA
 * call; the waiting members wake up at once. */
static void group_abort(zd__comm_t *comm, int code, const char *why) {
  group_comm_t *c = (group_comm_t *)comm;
  zd__devgroup_break(c->g, code, "aborted (%s)", why ? why : "no reason given");
}

static void group_destroy(zd__comm_t *comm) {
  group_comm_t *c = (group_comm_t *)comm;
  zd__devgroup_leave(c->g); /* the last member out destroys the events */
  if (c->done) cudaEventDestroy(c->done);
  (void)cudaGetLastError();
  free(c);
}

static const zd__comm_ops_t group_ops = {
    .reduce_scatter = group_reduce_scatter,
    .all_gather = group_all_gather,
    .allgather_bytes = group_allgather_bytes,
    .allgather_device = group_allgather_device,
    .sync = group_sync,
    .failed = group_failed,
    .abort = group_abort,
    .destroy = group_destroy,
};

/* Events are released by CUDA once their records are complete (a peer's late wait included). */
static void free_event(void *ev) {
  cudaEventDestroy((cudaEvent_t)ev);
  (void)cudaGetLastError();
}

int zd__comm_cuda_group_create(const char *key, uint32_t rank, uint32_t size, int device,
                               void *stream, int connect_timeout_ms, int collective_timeout_ms,
                               const atomic_int *stop, zd__comm_t **out, zd__err_t *err) {
  group_comm_t *c = calloc(1, sizeof *c);
  if (!c) return zd__errf(err, -ENOMEM, "out of memory for a group communicator");
  c->base.ops = &group_ops;
  c->base.rank = rank;
  c->base.world_size = size;
  c->base.backend = "cuda-group";
  c->device = device;
  c->stream = (cudaStream_t)stream;
  c->timeout_ms = collective_timeout_ms;
  int rc = ZD_OK;
  cudaEvent_t ev[ZD__DEVGROUP_HANDLES] = {NULL, NULL};
  ZD_CUDA_GOTO(err, rc, fail, cudaSetDevice(device), "cudaSetDevice(%d)", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming),
               "GPU %d: cudaEventCreate", device);
  for (int i = 0; i < ZD__DEVGROUP_HANDLES; i++)
    ZD_CUDA_GOTO(err, rc, fail, cudaEventCreateWithFlags(&ev[i], cudaEventDisableTiming),
                 "GPU %d: cudaEventCreate", device);
  if ((rc = zd__cuda_group_preload(err))) goto fail;
  void *handles[ZD__DEVGROUP_HANDLES] = {ev[ARRIVED], ev[CONSUMED]};
  ev[ARRIVED] = ev[CONSUMED] = NULL; /* the group's from here on, even when the join fails */
  rc = zd__devgroup_join(key, rank, size, device, handles, free_event, connect_timeout_ms, stop,
                         &c->g, err);
  if (rc) goto fail;
  ZD_LOG_INFO("GPU %d: group communicator %s ready: rank %u of %u", device, key, rank, size);
  *out = &c->base;
  return ZD_OK;

fail:
  for (int i = 0; i < ZD__DEVGROUP_HANDLES; i++)
    if (ev[i]) cudaEventDestroy(ev[i]);
  group_destroy(&c->base);
  return rc;
}
