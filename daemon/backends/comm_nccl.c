/* The NCCL communicator (comm.h): the collectives of the CUDA backend, on device memory, queued on
 * the rank's stream.
 *
 * reduce_scatter and all_gather queue ncclReduceScatter (sum, in the gradients' own dtype) and an
 * in-place ncclAllGather; allgather_device the all-gather of the step record. None of them waits
 * for the GPU: sync does, bounded by collective_timeout_ms (compute_cuda.c calls it where a job
 * waits): by polling an event (cuda_step legacy) or, once the rank gave the communicator its
 * stream's waiter (zd__comm_nccl_set_waiter, cuda_step fast), asleep until the stream wakes it,
 * probing NCCL's asynchronous errors every millisecond (cuda_check.h). At world size 1 the
 * reduce-scatter is no operation at all (the shard is the client's own slice, read in place as on
 * the CPU) and the one-rank all-gathers are NCCL's in-place no-ops.
 *
 * A dead peer must not hang the daemon. The communicator is created non-blocking
 * (ncclConfig_t.blocking = 0): no NCCL call blocks, a call that answers ncclInProgress is polled
 * with ncclCommGetAsyncError until it settles (bounded), and nothing else is queued on the stream
 * meanwhile, as NCCL requires. Waits poll ncclCommGetAsyncError too. On an error or a timeout the
 * communicator is aborted (ncclCommAbort: NCCL's kernels on the stream exit, so it drains), and
 * every later call fails at once with the reason; the rank is then degraded (rank.c).
 *
 * Tearing a communicator down may block in NCCL: ncclCommAbort and ncclCommDestroy are blocking
 * even for a non-blocking communicator, and they synchronise NCCL's internal streams, which follow
 * the rank's stream (NCCL makes its device stream wait on the stream of every launch): work queued
 * behind a wait that never completes (a client's "grads ready" record that never runs, a hung
 * GPU) holds them for good, and NCCL frees its device memory only after that. So they run on a
 * thread of their own (teardown_main), with the rank's device made current there, and the worker
 * waits for that thread at most DRAIN_MS; what it cannot join is left to the process's exit. A
 * healthy communicator is closed at shutdown as NCCL recommends: ncclCommFinalize (polled,
 * bounded) then ncclCommDestroy; ncclCommAbort otherwise.
 */
#include <errno.h>
#include <nccl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "comm.h"
#include "cuda_check.h"
#include "log.h"

#define DRAIN_MS 10000 /* after an abort, how long the stream (or the teardown) may take */

_Static_assert(sizeof(ncclUniqueId) == 128, "the rendezvous carries 128-byte NCCL ids");

/* Staging buffers replaced by a larger pair while the stream was busy: freed once it is idle. */
typedef struct stage {
  struct stage *next;
  void *d, *h; /* device, pinned host */
} stage_t;

typedef struct nccl_comm {
  zd__comm_t base;
  ncclComm_t nccl; /* NULL once handed to the teardown thread */
  int device;
  cudaStream_t stream;       /* the rank's; not owned */
  cudaEvent_t done;          /* recorded by sync */
  zd__cuda_waiter_t *waiter; /* the stream's wake-up (cuda_step fast); not owned; NULL: poll */
  int timeout_ms;
  int code;                   /* non-zero: broken, for the reason below */
  atomic_int abort_requested; /* set from another thread: the waits give up, the comm aborts */
  int abort_code;             /* written before abort_requested is set, read after */
  char abort_why[ZD__ERR_MSG_MAX / 2];
  char reason[ZD__ERR_MSG_MAX];
  void *d_stage, *h_stage; /* allgather_bytes: device and pinned host staging */
  size_t stage_bytes;
  stage_t *retired;
  /* Teardown (ncclCommAbort or ncclCommDestroy) on its own thread; see the top of the file. */
  ncclComm_t closing;
  int closing_destroy;  /* 1: ncclCommDestroy after a finalize, 0: ncclCommAbort */
  int teardown_started; /* a thread to join */
  pthread_t teardown;
  atomic_int teardown_done;
} nccl_comm_t;

static void nap(long us) {
  struct timespec ts = {.tv_sec = 0, .tv_nsec = us * 1000L};
  nanosleep(&ts, NULL);
}

/* A failed NCCL call or asynchronous error: ZD_EPEER when a peer or the network failed, else
 * ZD_EBACKEND (CUDA, or NCCL itself). */
static int nccl_code(ncclResult_t r) {
  return r == ncclRemoteError || r == ncclSystemError ? ZD_EPEER : ZD_EBACKEND;
}

static int broken(const nccl_comm_t *c, zd__err_t *err) {
  return zd__errf(err, c->code, "%s", c->reason);
}

static void *teardown_main(void *arg) {
  nccl_comm_t *c = arg;
  zd__log_set_rank((int)c->base.rank);
  /* The rank's device, current on this thread too (NCCL's teardown also sets it itself). */
  if (cudaSetDevice(c->device) != cudaSuccess) (void)cudaGetLastError();
  ncclResult_t r = c->closing_destroy ? ncclCommDestroy(c->closing) : ncclCommAbort(c->closing);
  if (r != ncclSuccess)
    ZD_LOG_WARN("GPU %d: %s: %s", c->device,
                c->closing_destroy ? "ncclCommDestroy" : "ncclCommAbort", ncclGetErrorString(r));
  atomic_store(&c->teardown_done, 1);
  return NULL;
}

/* Hands the communicator to the teardown thread: ncclCommAbort (destroy 0), which also makes
 * NCCL's kernels on the stream exit, or ncclCommDestroy (destroy 1, after a finalize). The
 * communicator is not used again. */
static void start_teardown(nccl_comm_t *c, int destroy) {
  c->closing = c->nccl;
  c->closing_destroy = destroy;
  c->nccl = NULL;
  if (pthread_create(&c->teardown, NULL, teardown_main, c) == 0) {
    c->teardown_started = 1;
    return;
  }
  ZD_LOG_WARN("GPU %d: no thread for the NCCL teardown; running it on the worker", c->device);
  teardown_main(c);
}

/* Waits at most ms for the teardown thread: 1 once it has finished (or none was started). */
static int teardown_finished(nccl_comm_t *c, int ms) {
  if (!c->teardown_started) return 1;
  uint64_t deadline = zd__now_ms() + (uint64_t)ms;
  long sleep_us = 10;
  while (!atomic_load(&c->teardown_done)) {
    if (zd__now_ms() >= deadline) return 0;
    nap(sleep_us);
    if (sleep_us < 1000) sleep_us *= 2;
  }
  pthread_join(c->teardown, NULL);
  c->teardown_started = 0;
  return 1;
}

/* Aborts the communicator (once) and keeps the reason for every later call. */
static void abort_comm(nccl_comm_t *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void abort_comm(nccl_comm_t *c, int code, const char *fmt, ...) {
  if (!c->code) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->reason, sizeof c->reason, fmt, ap);
    va_end(ap);
    c->code = code;
    ZD_LOG_ERROR("NCCL communicator of rank %u aborted: %s", c->base.rank, c->reason);
  }
  if (c->nccl) start_teardown(c, 0);
}

/* After an NCCL call that returned r: waits (bounded) while it is ncclInProgress, as a
 * non-blocking communicator requires before anything else touches it or its stream. On failure
 * the communicator is aborted. */
static int settle(nccl_comm_t *c, ncclResult_t r, int timeout_ms, const char *what,
                  zd__err_t *err) {
  uint64_t deadline = zd__now_ms() + (uint64_t)timeout_ms;
  long sleep_us = 1;
  while (r == ncclInProgress) {
    if (atomic_load(&c->abort_requested)) {
      abort_comm(c, c->abort_code, "%s: aborted (%s)", what, c->abort_why);
      return broken(c, err);
    }
    if (zd__now_ms() > deadline) {
      abort_comm(c, -ETIMEDOUT,
                 "%s: NCCL still in progress after %d ms (a peer is gone or "
                 "stalled); communicator aborted",
                 what, timeout_ms);
      return broken(c, err);
    }
    nap(sleep_us);
    if (sleep_us < 1000) sleep_us *= 2;
    ncclResult_t q = ncclCommGetAsyncError(c->nccl, &r);
    if (q != ncclSuccess) r = q;
  }
  if (r == ncclSuccess) return ZD_OK;
  abort_comm(c, nccl_code(r), "%s: NCCL %s: %s", what, ncclGetErrorString(r),
             c->nccl ? ncclGetLastError(c->nccl) : "");
  return broken(c, err);
}

static ncclDataType_t nccl_type(zd_dtype_t t) {
  switch (t) {
    case ZD_F32:
      return ncclFloat32;
    case ZD_BF16:
      return ncclBfloat16;
    case ZD_F16:
      return ncclFloat16;
  }
  return ncclNumTypes;
}

/* While waiting for the stream: the communicator's asynchronous error. */
static int probe(void *ctx, zd__err_t *err) {
  nccl_comm_t *c = ctx;
  if (atomic_load(&c->abort_requested))
    return zd__errf(err, c->abort_code, "aborted (%s)", c->abort_why);
  ncclResult_t st = ncclSuccess;
  ncclResult_t r = ncclCommGetAsyncError(c->nccl, &st);
  if (r != ncclSuccess) st = r;
  if (st == ncclSuccess || st == ncclInProgress) return ZD_OK;
  return zd__errf(err, nccl_code(st), "NCCL asynchronous error: %s: %s", ncclGetErrorString(st),
                  ncclGetLastError(c->nccl));
}

/* After an abort: lets the stream run out (NCCL's kernels exit), bounded, so that the memory its
 * queued work uses may be released. */
static void drain(nccl_comm_t *c) {
  if (cudaEventRecord(c->done, c->stream) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  zd__err_t err = {0};
  if (zd__cuda_event_wait(c->done, DRAIN_MS, NULL, NULL, "draining the stream", &err) != ZD_OK)
    ZD_LOG_WARN("GPU %d: the rank's stream did not run out after the abort: %s", c->device,
                err.msg);
}

static int nccl_sync(zd__comm_t *comm, zd__err_t *err) {
  nccl_comm_t *c = (nccl_comm_t *)comm;
  if (c->code) {
    drain(c);
    return broken(c, err);
  }
  cudaError_t e = c->waiter ? cudaSuccess : cudaEventRecord(c->done, c->stream);
  if (e != cudaSuccess) {
    zd__err_t cerr = {0};
    zd__cuda_fail(&cerr, e, __FILE__, __LINE__, "GPU %d: cudaEventRecord", c->device);
    abort_comm(c, ZD_EBACKEND, "%s", cerr.msg);
    return broken(c, err);
  }
  zd__err_t werr = {0};
  int rc = c->waiter ? zd__cuda_stream_wait(c->waiter, c->stream, c->done, c->timeout_ms, probe, c,
                                            "the rank's GPU work", &werr)
                     : zd__cuda_event_wait(c->done, c->timeout_ms, probe, c, "the rank's GPU work",
                                           &werr);
  if (rc == ZD_OK) return ZD_OK;
  if (rc == -ETIMEDOUT)
    abort_comm(c, -ETIMEDOUT,
               "GPU work not complete within %d ms (collective_timeout_ms): a "
               "peer is gone or stalled; NCCL communicator aborted",
               c->timeout_ms);
  else
    abort_comm(c, rc, "%s", werr.msg);
  drain(c);
  return broken(c, err);
}

static int nccl_reduce_scatter(zd__comm_t *comm, uint32_t bucket, const void *send,
                               zd_dtype_t dtype, uint64_t shard_elems, float *scratch,
                               const void **shard, zd_dtype_t *shard_dtype, zd__err_t *err) {
  nccl_comm_t *c = (nccl_comm_t *)comm;
  if (c->code) return broken(c, err);
  if (comm->world_size == 1) { /* the client's own gradients are the shard: read in place */
    *shard = send;
    *shard_dtype = dtype;
    return ZD_OK;
  }
  ncclDataType_t t = nccl_type(dtype);
  if (t == ncclNumTypes) return zd__errf(err, ZD_EDTYPE, "reduce-scatter: dtype %d", (int)dtype);
  char what[64];
  snprintf(what, sizeof what, "reduce-scatter of bucket %u", bucket);
  int rc = settle(c, ncclReduceScatter(send, scratch, shard_elems, t, ncclSum, c->nccl, c->stream),
                  c->timeout_ms, what, err);
  if (rc) return rc;
  *shard = scratch; /* shard_elems elements of dtype, at most as many bytes as fp32 */
  *shard_dtype = dtype;
  return ZD_OK;
}

static int nccl_all_gather(zd__comm_t *comm, uint32_t bucket, void *buf, zd_dtype_t dtype,
                           uint64_t shard_elems, zd__err_t *err) {
  nccl_comm_t *c = (nccl_comm_t *)comm;
  if (c->code) return broken(c, err);
  ncclDataType_t t = nccl_type(dtype);
  if (t == ncclNumTypes) return zd__errf(err, ZD_EDTYPE, "all-gather: dtype %d", (int)dtype);
  const char *mine = (const char *)buf + (size_t)comm->rank * shard_elems * zd_dtype_size(dtype);
  char what[64];
  snprintf(what, sizeof what, "all-gather of bucket %u", bucket);
  return settle(c, ncclAllGather(mine, buf, shard_elems, t, c->nccl, c->stream), c->timeout_ms,
                what, err);
}

static int nccl_allgather_device(zd__comm_t *comm, const void *send, size_t bytes, void *recv,
                                 zd__err_t *err) {
  nccl_comm_t *c = (nccl_comm_t *)comm;
  if (c->code) return broken(c, err);
  return settle(c, ncclAllGather(send, recv, bytes, ncclUint8, c->nccl, c->stream), c->timeout_ms,
                "all-gather of the step record", err);
}

/* Frees the retired staging buffers once the stream has nothing queued: cudaFree and cudaFreeHost
 * wait for the whole device, and the stream may be waiting for the client. all: at destroy, the
 * current pair too. */
static void free_stages(nccl_comm_t *c, int all) {
  if (!c->retired && !(all && (c->d_stage || c->h_stage))) return;
  cudaError_t e = cudaStreamQuery(c->stream);
  (void)cudaGetLastError();
  if (e == cudaErrorNotReady) return; /* work still queued after a failure: left to the exit */
  while (c->retired) {
    stage_t *st = c->retired;
    c->retired = st->next;
    cudaFree(st->d);
    cudaFreeHost(st->h);
    free(st);
  }
  if (all) {
    cudaFree(c->d_stage);
    cudaFreeHost(c->h_stage);
    c->d_stage = c->h_stage = NULL;
    c->stage_bytes = 0;
  }
  (void)cudaGetLastError();
}

/* Host records (registration): through pinned and device staging, then a wait. */
static int nccl_allgather_bytes(zd__comm_t *comm, const void *send, size_t bytes, void *recv,
                                zd__err_t *err) {
  nccl_comm_t *c = (nccl_comm_t *)comm;
  if (c->code) return broken(c, err);
  if (comm->world_size == 1) {
    memcpy(recv, send, bytes);
    return ZD_OK;
  }
  size_t total = bytes * comm->world_size, mine = bytes * comm->rank;
  int rc = ZD_OK;
  if (total > c->stage_bytes) {
    /* A registration's stream waits on the client's "grads ready" here: the smaller pair is
     * retired, and freed after this call's bounded wait, not now (free_stages). */
    if (c->d_stage || c->h_stage) {
      stage_t *st = malloc(sizeof *st);
      if (!st) return zd__errf(err, -ENOMEM, "out of memory");
      *st = (stage_t){.next = c->retired, .d = c->d_stage, .h = c->h_stage};
      c->retired = st;
    }
    c->d_stage = c->h_stage = NULL;
    c->stage_bytes = 0;
    ZD_CUDA_TRY(err, cudaMalloc(&c->d_stage, total), "GPU %d: cudaMalloc of %zu staging bytes",
                c->device, total);
    ZD_CUDA_TRY(err, cudaMallocHost(&c->h_stage, total),
                "GPU %d: cudaMallocHost of %zu staging bytes", c->device, total);
    c->stage_bytes = total;
  }
  memcpy((char *)c->h_stage + mine, send, bytes);
  ZD_CUDA_TRY(err,
              cudaMemcpyAsync((char *)c->d_stage + mine, (char *)c->h_stage + mine, bytes,
                              cudaMemcpyHostToDevice, c->stream),
              "GPU %d: copying a record to the device", c->device);
  rc = settle(
      c, ncclAllGather((char *)c->d_stage + mine, c->d_stage, bytes, ncclUint8, c->nccl, c->stream),
      c->timeout_ms, "all-gather of the registration records", err);
  if (rc) return rc;
  ZD_CUDA_TRY(err,
              cudaMemcpyAsync(c->h_stage, c->d_stage, total, cudaMemcpyDeviceToHost, c->stream),
              "GPU %d: copying the records to the host", c->device);
  rc = nccl_sync(comm, err);
  if (rc) return rc;
  memcpy(recv, c->h_stage, total);
  free_stages(c, 0); /* the stream is idle now */
  return ZD_OK;
}

int zd__comm_nccl_probe(void *comm, zd__err_t *err) {
  nccl_comm_t *c = comm;
  if (c->code) return broken(c, err);
  return probe(c, err);
}

void zd__comm_nccl_set_waiter(zd__comm_t *comm, void *waiter) {
  ((nccl_comm_t *)comm)->waiter = waiter;
}

static int nccl_failed(const zd__comm_t *comm) {
  return ((const nccl_comm_t *)comm)->code != 0;
}

/* Only a flag: the worker's waits poll it and abort the communicator themselves (on the teardown
 * thread, start_teardown), so the caller's thread makes no NCCL or CUDA call. */
static void nccl_abort(zd__comm_t *comm, int code, const char *why) {
  nccl_comm_t *c = (nccl_comm_t *)comm;
  static pthread_mutex_t first = PTHREAD_MUTEX_INITIALIZER; /* two aborters: the first wins */
  pthread_mutex_lock(&first);
  if (!atomic_load(&c->abort_requested)) {
    c->abort_code = code;
    snprintf(c->abort_why, sizeof c->abort_why, "%s", why ? why : "aborted");
    atomic_store(&c->abort_requested, 1);
  }
  pthread_mutex_unlock(&first);
}

/* A healthy communicator at shutdown (nothing in flight: every job waited for its work):
 * ncclCommFinalize, polled (it is non-blocking here) for at most DRAIN_MS, then ncclCommDestroy;
 * ncclCommAbort when the finalize fails or does not settle, or the stream still has work. */
static void close_comm(nccl_comm_t *c) {
  cudaError_t e = cudaStreamQuery(c->stream);
  (void)cudaGetLastError();
  if (e == cudaErrorNotReady) {
    ZD_LOG_WARN(
        "GPU %d: the rank's stream still has work at shutdown: aborting the NCCL "
        "communicator",
        c->device);
    start_teardown(c, 0);
    return;
  }
  int limit = c->timeout_ms < DRAIN_MS ? c->timeout_ms : DRAIN_MS;
  uint64_t deadline = zd__now_ms() + (uint64_t)limit;
  ncclResult_t r = ncclCommFinalize(c->nccl);
  while (r == ncclInProgress && zd__now_ms() < deadline && !atomic_load(&c->abort_requested)) {
    nap(1000);
    ncclResult_t q = ncclCommGetAsyncError(c->nccl, &r);
    if (q != ncclSuccess) r = q;
  }
  if (r == ncclSuccess) {
    start_teardown(c, 1);
    return;
  }
  ZD_LOG_WARN("GPU %d: ncclCommFinalize: %s; aborting the NCCL communicator", c->device,
              r == ncclInProgress ? "not complete in time" : ncclGetErrorString(r));
  start_teardown(c, 0);
}

static void nccl_destroy(zd__comm_t *comm) {
  nccl_comm_t *c = (nccl_comm_t *)comm;
  if (c->nccl) close_comm(c);
  if (!teardown_finished(c, DRAIN_MS)) {
    /* Blocked in NCCL (see the top of the file): the thread keeps using c, so c stays. */
    ZD_LOG_WARN(
        "GPU %d: the NCCL %s did not finish within %d ms; leaving it to the process's "
        "exit",
        c->device, c->closing_destroy ? "destroy" : "abort", DRAIN_MS);
    pthread_detach(c->teardown);
    return;
  }
  free_stages(c, 1); /* unless work is still queued after a failure: then left to the exit */
  if (c->done) cudaEventDestroy(c->done);
  (void)cudaGetLastError();
  free(c);
}

static const zd__comm_ops_t nccl_ops = {
    .reduce_scatter = nccl_reduce_scatter,
    .all_gather = nccl_all_gather,
    .allgather_bytes = nccl_allgather_bytes,
    .allgather_device = nccl_allgather_device,
    .sync = nccl_sync,
    .failed = nccl_failed,
    .abort = nccl_abort,
    .destroy = nccl_destroy,
};

int zd__comm_nccl_unique_id(void *id, size_t len, zd__err_t *err) {
  ncclUniqueId uid;
  if (len != sizeof uid)
    return zd__errf(err, -EINVAL, "NCCL unique id: %zu bytes given, %zu needed", len, sizeof uid);
  ncclResult_t r = ncclGetUniqueId(&uid);
  if (r != ncclSuccess)
    return zd__errf(err, nccl_code(r), "ncclGetUniqueId: %s: %s", ncclGetErrorString(r),
                    ncclGetLastError(NULL));
  memcpy(id, &uid, sizeof uid);
  return ZD_OK;
}

int zd__comm_nccl_create(const void *id, uint32_t rank, uint32_t world_size, int device,
                         void *stream, int connect_timeout_ms, int collective_timeout_ms,
                         const atomic_int *stop, zd__comm_t **out, zd__err_t *err) {
  ncclUniqueId uid;
  int rc;
  if (id) {
    memcpy(&uid, id, sizeof uid);
  } else if (world_size != 1) {
    return zd__errf(err, -EINVAL, "an NCCL communicator of %u ranks needs rank 0's unique id",
                    world_size);
  } else if ((rc = zd__comm_nccl_unique_id(&uid, sizeof uid, err))) {
    return rc;
  }
  nccl_comm_t *c = calloc(1, sizeof *c);
  if (!c) return zd__errf(err, -ENOMEM, "out of memory for an NCCL communicator");
  c->base.ops = &nccl_ops;
  c->base.rank = rank;
  c->base.world_size = world_size;
  c->base.backend = "nccl";
  c->device = device;
  c->stream = (cudaStream_t)stream;
  c->timeout_ms = collective_timeout_ms;
  ZD_CUDA_GOTO(err, rc, fail, cudaSetDevice(device), "cudaSetDevice(%d)", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming),
               "GPU %d: cudaEventCreate", device);

  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0; /* every call returns at once; init and abort cannot hang the daemon */
  ncclResult_t r = ncclCommInitRankConfig(&c->nccl, (int)world_size, uid, (int)rank, &cfg);
  uint64_t deadline = zd__now_ms() + (uint64_t)connect_timeout_ms;
  while (r == ncclInProgress) {
    if (stop && atomic_load(stop)) {
      abort_comm(c, -ECANCELED, "creating the NCCL communicator was cancelled (shutdown)");
      goto broken;
    }
    if (zd__now_ms() > deadline) {
      abort_comm(c, -ETIMEDOUT,
                 "NCCL: rank %u of %u: the communicator was not complete within "
                 "%d ms (connect_timeout_ms); are all ranks up, on distinct GPUs, and able to "
                 "reach each other?",
                 rank, world_size, connect_timeout_ms);
      goto broken;
    }
    nap(1000);
    ncclResult_t q = ncclCommGetAsyncError(c->nccl, &r);
    if (q != ncclSuccess) r = q;
  }
  if (r != ncclSuccess) {
    const char *last = c->nccl ? ncclGetLastError(c->nccl) : ncclGetLastError(NULL);
    abort_comm(c, nccl_code(r), "ncclCommInitRankConfig (rank %u of %u, GPU %d): %s: %s", rank,
               world_size, device, ncclGetErrorString(r), last);
    goto broken;
  }
  *out = &c->base;
  return ZD_OK;

broken:
  rc = broken(c, err);
fail:
  if (c->nccl) start_teardown(c, 0);
  if (!teardown_finished(c, DRAIN_MS)) {
    ZD_LOG_WARN(
        "GPU %d: the NCCL abort did not finish within %d ms; leaving it to the "
        "process's exit",
        device, DRAIN_MS);
    pthread_detach(c->teardown);
    return rc; /* the thread keeps using c */
  }
  if (c->done) cudaEventDestroy(c->done);
  (void)cudaGetLastError();
  free(c);
  return rc;
}
