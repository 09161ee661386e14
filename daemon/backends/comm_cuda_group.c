/* The group communicator (comm.h): the collectives of local ranks of this zerod that share one
 * GPU, done inside the process in device memory, without NCCL (which refuses two ranks on one
 * GPU). Every pointer the ranks exchange is valid process-wide on that device: a client's
 * buffers are IPC mappings opened in this process, the state, scratch and step records are
 * cudaMalloc'd here. So a rank's kernels read its peers' buffers directly.
 *
 * The members of one world instance (the key: world.c's instance id) share a group object, found
 * in a process-wide registry, refcounted; each member creates its communicator on its worker
 * thread and waits (bounded by connect_timeout_ms, cancelled through *stop) until every member
 * has joined. A collective is matched by order, as with NCCL, and checked: members that are in
 * different operations (or buckets, dtypes, sizes) fail instead of mixing unrelated buffers.
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
 *      most BREAK_GRACE_MS more.
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
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "comm.h"
#include "cuda_check.h"
#include "group_cuda.h"
#include "log.h"

#define DRAIN_MS       10000 /* after a failure, how long the stream may take to run out */
#define BREAK_GRACE_MS 2000  /* rendezvous B after a break: how long the others may take */
#define JOIN_SLICE_MS  100   /* joining: how often *stop is looked at */

typedef enum { OP_REDUCE_SCATTER = 1, OP_ALL_GATHER, OP_BYTES, OP_RECORDS } op_t;

static const char *op_name(op_t op) {
  switch (op) {
    case OP_REDUCE_SCATTER:
      return "reduce-scatter";
    case OP_ALL_GATHER:
      return "all-gather";
    case OP_BYTES:
      return "all-gather of host records";
    case OP_RECORDS:
      return "all-gather of the step records";
  }
  return "?";
}

/* What a member publishes for the collective in progress (under the group's lock). */
typedef struct post {
  op_t op;
  uint32_t bucket;
  zd_dtype_t dtype;
  uint64_t elems;  /* shard elements, or bytes */
  const void *src; /* the member's buffer (device memory; host memory for OP_BYTES) */
} post_t;

typedef struct group {
  struct group *next; /* in the registry */
  char key[64];
  uint32_t size;
  int device;
  pthread_mutex_t lock; /* everything below */
  pthread_cond_t cond;  /* CLOCK_MONOTONIC */
  uint32_t refs;        /* members holding the group (under registry_lock) */
  uint32_t joined;      /* members that have joined */
  uint8_t present[ZD__GROUP_MAX];
  /* The rendezvous in progress: who has arrived, and how many completed so far. */
  uint32_t waiting;
  uint8_t here[ZD__GROUP_MAX];
  uint64_t generation;
  /* Per member: its events (created by the member at join, destroyed with the group, so that a
   * peer's late cudaStreamWaitEvent never meets a destroyed event) and its current post. */
  cudaEvent_t arrived[ZD__GROUP_MAX];
  cudaEvent_t consumed[ZD__GROUP_MAX];
  post_t post[ZD__GROUP_MAX];
  /* Broken: code (non-zero) is set once, after reason. */
  atomic_int code;
  char reason[ZD__ERR_MSG_MAX];
} group_t;

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static group_t *registry;

typedef struct group_comm {
  zd__comm_t base;
  group_t *g;
  int device;
  cudaStream_t stream; /* the rank's; not owned */
  cudaEvent_t done;    /* recorded by sync */
  int timeout_ms;
} group_comm_t;

/* ---- breaking and waiting -------------------------------------------------------------------- */

static void vbreak_locked(group_t *g, int code, const char *fmt, va_list ap) {
  if (atomic_load(&g->code)) return; /* the first reason stays */
  vsnprintf(g->reason, sizeof g->reason, fmt, ap);
  atomic_store(&g->code, code ? code : ZD_EPEER);
  ZD_LOG_ERROR("GPU %d: the group communicator of %u ranks is broken: %s", g->device, g->size,
               g->reason);
  pthread_cond_broadcast(&g->cond);
}

static void break_locked(group_t *g, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void break_locked(group_t *g, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vbreak_locked(g, code, fmt, ap);
  va_end(ap);
}

static void break_group(group_t *g, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void break_group(group_t *g, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  pthread_mutex_lock(&g->lock);
  vbreak_locked(g, code, fmt, ap);
  pthread_mutex_unlock(&g->lock);
  va_end(ap);
}

static int broken(group_t *g, zd__err_t *err) {
  pthread_mutex_lock(&g->lock);
  int rc = zd__errf(err, atomic_load(&g->code), "%s", g->reason);
  pthread_mutex_unlock(&g->lock);
  return rc;
}

/* Waits on the group's condition until deadline_ms (zd__now_ms's clock); g->lock held. */
static void wait_until(group_t *g, uint64_t deadline_ms) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t now = zd__now_ms();
  uint64_t ms = deadline_ms > now ? deadline_ms - now : 0;
  ts.tv_sec += (time_t)(ms / 1000);
  ts.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  pthread_cond_timedwait(&g->cond, &g->lock, &ts);
}

/* The members that have not arrived at the rendezvous in progress, as "1, 3"; g->lock held. */
static void missing(const group_t *g, char *out, size_t len) {
  size_t used = 0;
  out[0] = '\0';
  for (uint32_t r = 0; r < g->size && used < len; r++)
    if (!g->here[r]) used += (size_t)snprintf(out + used, len - used, "%s%u", used ? ", " : "", r);
}

/* A rendezvous of every member (see the top of the file). abortable: a break ends the wait
 * (rendezvous A); otherwise (B) a break shortens it to BREAK_GRACE_MS. A timeout breaks the group.
 * A member that gives up withdraws from the count; the group is broken by then, so no later
 * rendezvous A completes. */
static int rendezvous(group_comm_t *c, int abortable, const char *what, zd__err_t *err) {
  group_t *g = c->g;
  uint32_t me = c->base.rank;
  pthread_mutex_lock(&g->lock);
  if (abortable && atomic_load(&g->code)) {
    pthread_mutex_unlock(&g->lock);
    return broken(g, err);
  }
  uint64_t gen = g->generation;
  g->here[me] = 1;
  if (++g->waiting == g->size) {
    g->waiting = 0;
    memset(g->here, 0, sizeof g->here);
    g->generation++;
    pthread_cond_broadcast(&g->cond);
    pthread_mutex_unlock(&g->lock);
    return ZD_OK;
  }
  uint64_t deadline = zd__now_ms() + (uint64_t)c->timeout_ms;
  int graced = 0;
  while (g->generation == gen) {
    if (atomic_load(&g->code)) {
      if (abortable) break;
      if (!graced) {
        uint64_t grace = zd__now_ms() + BREAK_GRACE_MS;
        if (grace < deadline) deadline = grace;
        graced = 1;
      }
    }
    if (zd__now_ms() >= deadline) {
      char who[ZD__ERR_MSG_MAX / 4];
      missing(g, who, sizeof who);
      break_locked(g, -ETIMEDOUT,
                   "%s: rank(s) %s of the group did not arrive within %d ms "
                   "(collective_timeout_ms): a rank's worker is stuck or gone",
                   what, who, c->timeout_ms);
      break;
    }
    wait_until(g, deadline);
  }
  if (g->generation != gen) { /* completed (perhaps while it broke: then B is whole) */
    pthread_mutex_unlock(&g->lock);
    return ZD_OK;
  }
  g->here[me] = 0; /* withdrawn */
  g->waiting--;
  int rc = zd__errf(err, atomic_load(&g->code), "%s", g->reason);
  pthread_mutex_unlock(&g->lock);
  return rc;
}

/* Publishes this member's operation and waits for everyone's (rendezvous A), then checks that
 * every member is in the same one. */
static int meet(group_comm_t *c, const post_t *p, const char *what, zd__err_t *err) {
  group_t *g = c->g;
  pthread_mutex_lock(&g->lock);
  g->post[c->base.rank] = *p;
  pthread_mutex_unlock(&g->lock);
  int rc = rendezvous(c, 1, what, err);
  if (rc) return rc;
  /* Every member reads the same posts, so all of them reach the same verdict here. */
  for (uint32_t r = 0; r < g->size; r++) {
    const post_t *q = &g->post[r];
    if (q->op == p->op && q->bucket == p->bucket && q->dtype == p->dtype && q->elems == p->elems)
      continue;
    break_group(g, ZD_EPEER,
                "collectives out of step: rank %u is in the %s of bucket %u (%llu elements or "
                "bytes, dtype %d), rank %u in the %s of bucket %u (%llu, dtype %d)",
                c->base.rank, op_name(p->op), p->bucket, (unsigned long long)p->elems,
                (int)p->dtype, r, op_name(q->op), q->bucket, (unsigned long long)q->elems,
                (int)q->dtype);
    return broken(g, err);
  }
  return ZD_OK;
}

/* The stream waits on every peer's record of `events` (arrived or consumed). */
static cudaError_t wait_peers(group_comm_t *c, cudaEvent_t *events) {
  for (uint32_t r = 0; r < c->g->size; r++) {
    if (r == c->base.rank) continue;
    cudaError_t e = cudaStreamWaitEvent(c->stream, events[r], 0);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

/* ---- the operations -------------------------------------------------------------------------- */

/* What every device collective does around its pull (see the top of the file). pull queues this
 * member's reads of its peers' buffers on the stream; it runs only once every member published. */
typedef int (*pull_fn)(group_comm_t *c, const void *arg, zd__err_t *err);

static int device_collective(group_comm_t *c, const post_t *p, pull_fn pull, const void *arg,
                             const char *what, zd__err_t *err) {
  group_t *g = c->g;
  uint32_t me = c->base.rank;
  if (atomic_load(&g->code)) return broken(g, err);
  cudaError_t e = cudaEventRecord(g->arrived[me], c->stream);
  if (e != cudaSuccess) {
    zd__err_t cerr = {0};
    zd__cuda_fail(&cerr, e, __FILE__, __LINE__, "GPU %d: %s: recording an event", c->device, what);
    break_group(g, ZD_EBACKEND, "%s", cerr.msg);
    return broken(g, err);
  }
  int rc = meet(c, p, what, err);
  if (rc) return rc;
  /* From here on every member comes to rendezvous B, whatever fails on the way. */
  zd__err_t perr = {0};
  int prc = ZD_OK;
  e = wait_peers(c, g->arrived);
  if (e != cudaSuccess)
    prc = zd__cuda_fail(&perr, e, __FILE__, __LINE__, "GPU %d: %s: waiting on a peer's event",
                        c->device, what);
  if (!prc) prc = pull(c, arg, &perr);
  e = cudaEventRecord(g->consumed[me], c->stream);
  if (!prc && e != cudaSuccess)
    prc = zd__cuda_fail(&perr, e, __FILE__, __LINE__, "GPU %d: %s: recording an event", c->device,
                        what);
  rc = rendezvous(c, 0, what, err);
  if (!rc) {
    e = wait_peers(c, g->consumed);
    if (!prc && e != cudaSuccess)
      prc = zd__cuda_fail(&perr, e, __FILE__, __LINE__, "GPU %d: %s: waiting on a peer's event",
                          c->device, what);
  }
  if (prc) {
    break_group(g, prc, "%s", perr.msg);
    return broken(g, err);
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
  const void *src[ZD__GROUP_MAX];
  for (uint32_t r = 0; r < c->g->size; r++) src[r] = c->g->post[r].src;
  return zd__cuda_group_reduce(src, c->g->size, a->dtype, (uint64_t)c->base.rank * a->shard_elems,
                               a->shard_elems, a->scratch, c->stream, err);
}

static int group_reduce_scatter(zd__comm_t *comm, uint32_t bucket, const void *send,
                                zd_dtype_t dtype, uint64_t shard_elems, float *scratch,
                                const void **shard, zd_dtype_t *shard_dtype, zd__err_t *err) {
  group_comm_t *c = (group_comm_t *)comm;
  if (!scratch)
    return zd__errf(err, ZD_EINTERNAL, "group reduce-scatter of bucket %u without scratch", bucket);
  char what[64];
  snprintf(what, sizeof what, "reduce-scatter of bucket %u", bucket);
  post_t p = {
      .op = OP_REDUCE_SCATTER, .bucket = bucket, .dtype = dtype, .elems = shard_elems, .src = send};
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
  int include_self; /* copy this member's own slice too (from its post) */
} gather_arg_t;

static int pull_gather(group_comm_t *c, const void *arg, zd__err_t *err) {
  const gather_arg_t *a = arg;
  int in_place = c->g->post[c->base.rank].op == OP_ALL_GATHER;
  for (uint32_t r = 0; r < c->g->size; r++) {
    if (r == c->base.rank && !a->include_self) continue;
    /* In place, member r's slice sits at r * slice in its buffer; a record at its start. */
    const char *from = (const char *)c->g->post[r].src + (in_place ? (size_t)r * a->slice : 0);
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
  snprintf(what, sizeof what, "all-gather of bucket %u", bucket);
  post_t p = {
      .op = OP_ALL_GATHER, .bucket = bucket, .dtype = dtype, .elems = shard_elems, .src = buf};
  gather_arg_t a = {.dst = buf, .slice = shard_elems * zd_dtype_size(dtype), .include_self = 0};
  return device_collective(c, &p, pull_gather, &a, what, err);
}

static int group_allgather_device(zd__comm_t *comm, const void *send, size_t bytes, void *recv,
                                  zd__err_t *err) {
  group_comm_t *c = (group_comm_t *)comm;
  post_t p = {.op = OP_RECORDS, .elems = bytes, .src = send};
  gather_arg_t a = {.dst = recv, .slice = bytes, .include_self = 1};
  return device_collective(c, &p, pull_gather, &a, "all-gather of the step records", err);
}

/* Host records: no stream involved; rendezvous B keeps every member's send alive until the
 * others have copied it. */
static int group_allgather_bytes(zd__comm_t *comm, const void *send, size_t bytes, void *recv,
                                 zd__err_t *err) {
  group_comm_t *c = (group_comm_t *)comm;
  group_t *g = c->g;
  const char *what = "all-gather of host records";
  if (atomic_load(&g->code)) return broken(g, err);
  post_t p = {.op = OP_BYTES, .elems = bytes, .src = send};
  int rc = meet(c, &p, what, err);
  if (rc) return rc;
  for (uint32_t r = 0; r < g->size; r++)
    memcpy((char *)recv + (size_t)r * bytes, g->post[r].src, bytes);
  return rendezvous(c, 0, what, err);
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
static int probe(void *ctx, zd__err_t *err) {
  group_comm_t *c = ctx;
  return atomic_load(&c->g->code) ? broken(c->g, err) : ZD_OK;
}

static int group_sync(zd__comm_t *comm, zd__err_t *err) {
  group_comm_t *c = (group_comm_t *)comm;
  group_t *g = c->g;
  if (atomic_load(&g->code)) {
    drain(c);
    return broken(g, err);
  }
  cudaError_t e = cudaEventRecord(c->done, c->stream);
  if (e != cudaSuccess) {
    zd__err_t cerr = {0};
    zd__cuda_fail(&cerr, e, __FILE__, __LINE__, "GPU %d: cudaEventRecord", c->device);
    break_group(g, ZD_EBACKEND, "%s", cerr.msg);
    return broken(g, err);
  }
  zd__err_t werr = {0};
  int rc = zd__cuda_event_wait(c->done, c->timeout_ms, probe, c, "the rank's GPU work", &werr);
  if (rc == ZD_OK) return ZD_OK;
  if (rc == -ETIMEDOUT)
    break_group(g, -ETIMEDOUT,
                "rank %u's GPU work not complete within %d ms (collective_timeout_ms): a rank "
                "of the group is stuck (its client's work never completed?)",
                c->base.rank, c->timeout_ms);
  else
    break_group(g, rc, "%s", werr.msg);
  drain(c);
  return broken(g, err);
}

static int group_failed(const zd__comm_t *comm) {
  return atomic_load(&((const group_comm_t *)comm)->g->code) != 0;
}

/* Breaks the whole group: its collectives cannot complete without this member anyway. No CUDA
 * call; the waiting members wake up at once. */
static void group_abort(zd__comm_t *comm, int code, const char *why) {
  group_comm_t *c = (group_comm_t *)comm;
  break_group(c->g, code, "aborted (%s)", why ? why : "no reason given");
}

/* ---- joining and leaving --------------------------------------------------------------------- */

/* The last member out frees the group and its events (released by CUDA once their records are
 * complete). registry_lock held. */
static void group_free(group_t *g) {
  for (group_t **pp = &registry; *pp; pp = &(*pp)->next)
    if (*pp == g) {
      *pp = g->next;
      break;
    }
  for (uint32_t r = 0; r < g->size; r++) {
    if (g->arrived[r]) cudaEventDestroy(g->arrived[r]);
    if (g->consumed[r]) cudaEventDestroy(g->consumed[r]);
  }
  (void)cudaGetLastError();
  pthread_cond_destroy(&g->cond);
  pthread_mutex_destroy(&g->lock);
  free(g);
}

static void leave(group_comm_t *c) {
  group_t *g = c->g;
  pthread_mutex_lock(&registry_lock);
  if (--g->refs == 0) group_free(g);
  pthread_mutex_unlock(&registry_lock);
  c->g = NULL;
}

static void group_destroy(zd__comm_t *comm) {
  group_comm_t *c = (group_comm_t *)comm;
  if (c->g) leave(c);
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

/* The group of `key`, found or made, with this member counted in (registry_lock taken here). */
static int find_group(const char *key, uint32_t size, int device, group_t **out, zd__err_t *err) {
  pthread_mutex_lock(&registry_lock);
  group_t *g = registry;
  while (g && strcmp(g->key, key)) g = g->next;
  if (!g) {
    g = calloc(1, sizeof *g);
    pthread_condattr_t attr;
    if (!g || pthread_condattr_init(&attr)) {
      free(g);
      pthread_mutex_unlock(&registry_lock);
      return zd__errf(err, -ENOMEM, "out of memory for a group communicator");
    }
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&g->cond, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&g->lock, NULL);
    snprintf(g->key, sizeof g->key, "%s", key);
    g->size = size;
    g->device = device;
    g->next = registry;
    registry = g;
  }
  int rc = ZD_OK;
  if (g->size != size || g->device != device)
    rc = zd__errf(err, ZD_EINTERNAL,
                  "group communicator %s: %u ranks on GPU %d, joined as one of %u on GPU %d", key,
                  g->size, g->device, size, device);
  else
    g->refs++;
  pthread_mutex_unlock(&registry_lock);
  *out = rc ? NULL : g;
  return rc;
}

int zd__comm_cuda_group_create(const char *key, uint32_t rank, uint32_t size, int device,
                               void *stream, int connect_timeout_ms, int collective_timeout_ms,
                               const atomic_int *stop, zd__comm_t **out, zd__err_t *err) {
  if (size < 2 || size > ZD__GROUP_MAX || rank >= size)
    return zd__errf(err, -EINVAL, "group communicator: rank %u of %u (2 to %d ranks)", rank, size,
                    ZD__GROUP_MAX);
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
  cudaEvent_t arrived = NULL, consumed = NULL;
  ZD_CUDA_GOTO(err, rc, fail, cudaSetDevice(device), "cudaSetDevice(%d)", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming),
               "GPU %d: cudaEventCreate", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaEventCreateWithFlags(&arrived, cudaEventDisableTiming),
               "GPU %d: cudaEventCreate", device);
  ZD_CUDA_GOTO(err, rc, fail, cudaEventCreateWithFlags(&consumed, cudaEventDisableTiming),
               "GPU %d: cudaEventCreate", device);
  if ((rc = zd__cuda_group_preload(err))) goto fail;
  if ((rc = find_group(key, size, device, &c->g, err))) goto fail;

  group_t *g = c->g;
  pthread_mutex_lock(&g->lock);
  if (g->present[rank]) {
    pthread_mutex_unlock(&g->lock);
    rc = zd__errf(err, ZD_EINTERNAL, "group communicator %s: rank %u joined twice", key, rank);
    goto fail;
  }
  g->present[rank] = 1;
  g->arrived[rank] = arrived; /* the group's now: destroyed with it */
  g->consumed[rank] = consumed;
  arrived = consumed = NULL;
  g->joined++;
  pthread_cond_broadcast(&g->cond);
  uint64_t deadline = zd__now_ms() + (uint64_t)connect_timeout_ms;
  while (g->joined < g->size && !atomic_load(&g->code)) {
    uint64_t now = zd__now_ms();
    if (stop && atomic_load(stop)) {
      break_locked(g, -ECANCELED,
                   "rank %u: joining the group communicator was cancelled "
                   "(shutdown)",
                   rank);
      break;
    }
    if (now >= deadline) {
      break_locked(g, -ETIMEDOUT,
                   "rank %u: %u of the group's %u ranks joined within %d ms (connect_timeout_ms)",
                   rank, g->joined, g->size, connect_timeout_ms);
      break;
    }
    wait_until(g, now + JOIN_SLICE_MS < deadline ? now + JOIN_SLICE_MS : deadline);
  }
  int code = atomic_load(&g->code);
  pthread_mutex_unlock(&g->lock);
  if (code) {
    rc = broken(g, err);
    goto fail;
  }
  ZD_LOG_INFO("GPU %d: group communicator %s ready: rank %u of %u", device, key, rank, size);
  *out = &c->base;
  return ZD_OK;

fail:
  if (arrived) cudaEventDestroy(arrived);
  if (consumed) cudaEventDestroy(consumed);
  group_destroy(&c->base);
  return rc;
}
