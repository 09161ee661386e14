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
 */
#ifndef ZD_DAEMON_COMM_H
#define ZD_DAEMON_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "zerod/zerod.h"

typedef struct zd__comm zd__comm_t;

typedef struct zd__comm_ops {
  /* Reduce-scatter (sum) of bucket `bucket`: send holds world_size * shard_elems elements of
   * dtype. On return *shard points at this rank's reduced slice (shard_elems elements of
   * *shard_dtype): either scratch (an fp32 buffer of shard_elems elements the caller provides)
   * or, at world size 1, send's own slice. Ranks that name different buckets at the same point
   * fail (by timeout) instead of summing unrelated gradients. */
  int (*reduce_scatter)(zd__comm_t *comm, uint32_t bucket, const void *send, zd_dtype_t dtype,
                        uint64_t shard_elems, float *scratch, const void **shard,
                        zd_dtype_t *shard_dtype, zd__err_t *err);
  /* All-gather in place of bucket `bucket`: buf holds world_size * shard_elems elements of dtype,
   * this rank's slice already written; on return every slice is. */
  int (*all_gather)(zd__comm_t *comm, uint32_t bucket, void *buf, zd_dtype_t dtype,
                    uint64_t shard_elems, zd__err_t *err);
  /* All-gather of a small record: recv receives world_size * bytes, rank r's record at r * bytes. */
  int (*allgather_bytes)(zd__comm_t *comm, const void *send, size_t bytes, void *recv,
                         zd__err_t *err);
  void (*destroy)(zd__comm_t *comm);
} zd__comm_ops_t;

struct zd__comm {
  const zd__comm_ops_t *ops;
  uint32_t rank;
  uint32_t world_size;
  const char *backend; /* "local", "gloo", "nccl" */
};

/* The world-size-1 communicator. */
int zd__comm_local_create(zd__comm_t **out);

/* A Gloo communicator (comm_gloo.c) over TCP on host memory; opts as in gloo.h. Blocks until
 * every rank has joined or opts->connect_timeout_ms passes. */
struct zd__gloo_opts;
int zd__comm_gloo_create(const struct zd__gloo_opts *opts, zd__comm_t **out, zd__err_t *err);

static inline void zd__comm_destroy(zd__comm_t *comm) {
  if (comm) comm->ops->destroy(comm);
}

#endif /* ZD_DAEMON_COMM_H */
