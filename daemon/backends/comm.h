/* Collectives between the ranks of a world, behind one small interface so that the step logic
 * (step.c) is the same for every backend and world size.
 *
 * Each local rank owns one communicator and calls it from its worker thread only. At world size 1
 * the local communicator does no communication: its reduce-scatter hands back the caller's own
 * gradients as the shard, so the step reads the client's buffer directly with no copy. Multi-rank
 * backends (Gloo on host memory, NCCL on device memory) fill in the same operations. Every
 * operation is bounded by the world's collective timeout; a failure leaves the communicator
 * broken (every later call fails) and returns ZD_EPEER or -ETIMEDOUT with a message that names the
 * peer when it is known.
 *
 * Host communicators (local, Gloo) complete every operation before returning. The device
 * communicators (NCCL, comm_nccl.c; the group of ranks of this process sharing one GPU,
 * comm_cuda_group.c) only queue reduce_scatter, all_gather and allgather_device on the rank's CUDA
 * stream and return; their completion (and failure) is observed by sync, which waits for
 * everything queued on that stream so far, bounded by the collective timeout, and aborts the
 * communicator on an asynchronous error or a timeout. For NCCL, ncclCommAbort (and, at destroy,
 * ncclCommDestroy) may block in NCCL, so they run on a teardown thread of the communicator's
 * own, which the worker waits for only a bounded time (comm_nccl.c). Their allgather_bytes works
 * on host memory and waits by itself (registration only).
 */
#ifndef ZD_DAEMON_COMM_H
#define ZD_DAEMON_COMM_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "zerod/zerod.h"

typedef struct zd__comm zd__comm_t;

typedef struct zd__comm_ops {
  /* Reduce-scatter (sum) of bucket `bucket`: send holds world_size * shard_elems elements of
   * dtype. On return *shard points at this rank's reduced slice (shard_elems elements of
   * *shard_dtype): either scratch (a buffer of shard_elems fp32 elements the caller provides, in
   * the communicator's memory) or, at world size 1, send's own slice. Gloo sums in fp32
   * (*shard_dtype ZD_F32); NCCL sums in dtype itself and leaves the shard in dtype at the start of
   * scratch (docs/design.md: "NCCL reduces in the gradient dtype"). With Gloo, ranks that name
   * different buckets at the same point fail (by timeout) instead of summing unrelated gradients;
   * NCCL matches operations by order only, like any NCCL program. */
  int (*reduce_scatter)(zd__comm_t *comm, uint32_t bucket, const void *send, zd_dtype_t dtype,
                        uint64_t shard_elems, float *scratch, const void **shard,
                        zd_dtype_t *shard_dtype, zd__err_t *err);
  /* All-gather in place of bucket `bucket`: buf holds world_size * shard_elems elements of dtype,
   * this rank's slice already written; on return every slice is. */
  int (*all_gather)(zd__comm_t *comm, uint32_t bucket, void *buf, zd_dtype_t dtype,
                    uint64_t shard_elems, zd__err_t *err);
  /* All-gather of a small record in host memory: recv receives world_size * bytes, rank r's record
   * at r * bytes. Complete on return. */
  int (*allgather_bytes)(zd__comm_t *comm, const void *send, size_t bytes, void *recv,
                         zd__err_t *err);
  /* Device communicators only (NULL for host ones): the all-gather of a small record that is in
   * device memory (send: bytes, recv: world_size * bytes), queued on the stream. */
  int (*allgather_device)(zd__comm_t *comm, const void *send, size_t bytes, void *recv,
                          zd__err_t *err);
  /* Device communicators only (NULL for host ones): waits until everything queued on the
   * communicator's stream so far (its collectives and any kernel or copy queued there by others)
   * has completed, polling the communicator's asynchronous errors, at most the collective timeout.
   * On an error or a timeout the communicator is aborted and broken. A broken communicator still
   * waits (bounded) for the stream to drain, so that the caller may release the memory the queued
   * work used, and then returns the failure that broke it. */
  int (*sync)(zd__comm_t *comm, zd__err_t *err);
  /* Non-zero once a failure made the communicator unusable (NULL: it never fails). */
  int (*failed)(const zd__comm_t *comm);
  /* From any thread: the collective in progress, and every later one, fails soon with `code`
   * and a message ending in `why` (shutdown: -ECANCELED, when a silent peer would hold it for the
   * collective timeout; a peer found dead by the heartbeat: ZD_EPEER). The first abort's reason
   * stays. It only asks: Gloo's waits are interrupted; NCCL's polling waits on the worker see a
   * flag, fail, and hand the communicator to its teardown thread for ncclCommAbort (the caller's
   * thread makes no NCCL or CUDA call). NULL: nothing can block. */
  void (*abort)(zd__comm_t *comm, int code, const char *why);
  void (*destroy)(zd__comm_t *comm);
} zd__comm_ops_t;

struct zd__comm {
  const zd__comm_ops_t *ops;
  uint32_t rank;
  uint32_t world_size;
  const char *backend; /* "local", "gloo", "nccl", "cuda-group" */
};

/* The world-size-1 communicator. */
int zd__comm_local_create(zd__comm_t **out);

/* A Gloo communicator (comm_gloo.c) over TCP on host memory; opts as in gloo.h. Blocks until
 * every rank has joined or opts->connect_timeout_ms passes. */
struct zd__gloo_opts;
int zd__comm_gloo_create(const struct zd__gloo_opts *opts, zd__comm_t **out, zd__err_t *err);

#ifdef ZD_HAVE_CUDA
/* An NCCL communicator (comm_nccl.c) on `device` (the calling thread's current device) whose
 * operations run on `stream` (a cudaStream_t, the rank's). id: the ncclUniqueId (128 bytes) every
 * rank of the world got from rank 0; NULL with world_size 1 (a one-rank communicator, no peers).
 * Initialisation is non-blocking and polled: bounded by connect_timeout_ms and cancelled
 * (-ECANCELED) when *stop becomes non-zero. Every later wait is bounded by collective_timeout_ms.
 * Errors: -ETIMEDOUT, -ECANCELED, ZD_EPEER (NCCL failed: the message says why), ZD_EBACKEND. */
int zd__comm_nccl_create(const void *id, uint32_t rank, uint32_t world_size, int device,
                         void *stream, int connect_timeout_ms, int collective_timeout_ms,
                         const atomic_int *stop, zd__comm_t **out, zd__err_t *err);
/* cuda_step fast: sync sleeps until the rank's stream wakes `waiter` (a zd__cuda_waiter_t of
 * that stream, cuda_check.h, which outlives the communicator) instead of polling an event. Call
 * on the rank's worker before the communicator's first sync. */
void zd__comm_nccl_set_waiter(zd__comm_t *comm, void *waiter);
/* For a wait of the rank's worker on its stream outside sync (a zd__cuda_probe_fn, cuda_check.h;
 * comm: the zd__comm_t): ZD_OK, or the communicator's asynchronous error or a pending abort
 * request (code and message). Aborts nothing: the caller then aborts it and lets sync drain it. */
int zd__comm_nccl_probe(void *comm, zd__err_t *err);
/* A fresh ncclUniqueId (128 bytes) into id: rank 0's part of the bootstrap. */
int zd__comm_nccl_unique_id(void *id, size_t len, zd__err_t *err);
/* A group communicator (comm_cuda_group.c): the `size` ranks of a world that live in this process
 * and share `device` (ranks_per_gpu > 1) reduce and gather among themselves in device memory,
 * without NCCL. Its contract differs from NCCL's in these points:
 *   - reduce_scatter sums in fp32 whatever the gradient dtype (bf16 and fp16 are converted
 *     exactly), as a pairwise tree in rank order ((g0 + g1) + (g2 + g3)); the shard is fp32 in
 *     scratch (*shard_dtype ZD_F32). The bits depend only on the inputs: with a power-of-two
 *     size and equal gradients every addition is an exact doubling, so with grad_mean the step
 *     sees exactly the gradients of one rank (W ranks fed g step as one rank fed g). Sums in fp32
 *     are also more accurate than NCCL's in bf16, and do not overflow where fp16 would;
 *   - every operation checks that all ranks are in the same one (operation, bucket, dtype,
 *     size) and fails with ZD_EPEER if not, where NCCL would mix unrelated buffers;
 *   - allgather_bytes works on host memory alone (no stream, no sync needed);
 *   - a failure (a rank that does not arrive within collective_timeout_ms, an abort from any
 *     thread, a CUDA error) breaks every rank of the group at once, with the first reason.
 * Device operations are queued on `stream` (the rank's cudaStream_t) and complete by sync, as with
 * NCCL; each one meets the other ranks on the host twice (the pointers, then the ordering of
 * their reads: see the file). key names the world instance: the ranks that give the same key
 * form one group (a process-wide registry); each waits until all `size` have joined, at most
 * connect_timeout_ms, cancelled (-ECANCELED) when *stop becomes non-zero. rank < size <= 64.
 * Errors: -ETIMEDOUT, -ECANCELED, -EINVAL, -ENOMEM, ZD_EBACKEND, ZD_EINTERNAL (a key reused for
 * another group, a rank joining twice). */
int zd__comm_cuda_group_create(const char *key, uint32_t rank, uint32_t size, int device,
                               void *stream, int connect_timeout_ms, int collective_timeout_ms,
                               const atomic_int *stop, zd__comm_t **out, zd__err_t *err);
/* cuda_step fast: as zd__comm_nccl_set_waiter, for a group communicator. */
void zd__comm_cuda_group_set_waiter(zd__comm_t *comm, void *waiter);
/* For a wait of the rank's worker on its stream outside sync (a zd__cuda_probe_fn, cuda_check.h;
 * comm: a group communicator): ZD_OK, or the group's failure (a break, an abort) with its message.
 * Changes nothing. */
int zd__comm_cuda_group_probe(void *comm, zd__err_t *err);
#endif

static inline int zd__comm_failed(const zd__comm_t *comm) {
  return comm && comm->ops->failed && comm->ops->failed(comm);
}

static inline void zd__comm_abort(zd__comm_t *comm, int code, const char *why) {
  if (comm && comm->ops->abort) comm->ops->abort(comm, code, why);
}

static inline void zd__comm_destroy(zd__comm_t *comm) {
  if (comm) comm->ops->destroy(comm);
}

#endif /* ZD_DAEMON_COMM_H */
