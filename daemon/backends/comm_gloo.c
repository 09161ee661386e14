/* The Gloo communicator (comm.h): the collectives of a multi-rank world on host memory, over the
 * Gloo shim (gloo.h). It only adapts the shim's calls to the communicator's operations: the
 * reduce-scatter sums into the caller's fp32 scratch, which becomes the shard the step reads, and
 * the all-gather works on bytes. Failures keep the shim's code and message (ZD_EPEER or
 * -ETIMEDOUT, naming the operation and the peer), and the shim refuses every later call. */
#include <errno.h>
#include <stdlib.h>

#include "comm.h"
#include "gloo.h"

typedef struct gloo_comm {
  zd__comm_t base;
  zd__gloo_t *gloo;
} gloo_comm_t;

static int gloo_reduce_scatter(zd__comm_t *comm, uint32_t bucket, const void *send,
                               zd_dtype_t dtype, uint64_t shard_elems, float *scratch,
                               const void **shard, zd_dtype_t *shard_dtype, zd__err_t *err) {
  gloo_comm_t *c = (gloo_comm_t *)comm;
  int rc = zd__gloo_reduce_scatter(c->gloo, send, dtype, scratch, shard_elems, bucket, err);
  if (rc) return rc;
  *shard = scratch;
  *shard_dtype = ZD_F32;
  return ZD_OK;
}

static int gloo_all_gather(zd__comm_t *comm, uint32_t bucket, void *buf, zd_dtype_t dtype,
                           uint64_t shard_elems, zd__err_t *err) {
  gloo_comm_t *c = (gloo_comm_t *)comm;
  size_t esize = zd_dtype_size(dtype);
  if (!esize) return zd__errf(err, ZD_EDTYPE, "all-gather: unknown dtype %d", (int)dtype);
  return zd__gloo_all_gather(c->gloo, buf, (size_t)shard_elems * esize, bucket, err);
}

static int gloo_allgather_bytes(zd__comm_t *comm, const void *send, size_t bytes, void *recv,
                                zd__err_t *err) {
  gloo_comm_t *c = (gloo_comm_t *)comm;
  return zd__gloo_allgather_bytes(c->gloo, send, bytes, recv, err);
}

static int gloo_failed(const zd__comm_t *comm) {
  return zd__gloo_failed(((const gloo_comm_t *)comm)->gloo);
}

static void gloo_abort(zd__comm_t *comm, int code, const char *why) {
  zd__gloo_abort(((gloo_comm_t *)comm)->gloo, code, why);
}

static void gloo_destroy(zd__comm_t *comm) {
  gloo_comm_t *c = (gloo_comm_t *)comm;
  zd__gloo_destroy(c->gloo);
  free(c);
}

static const zd__comm_ops_t gloo_ops = {
    .reduce_scatter = gloo_reduce_scatter,
    .all_gather = gloo_all_gather,
    .allgather_bytes = gloo_allgather_bytes,
    .failed = gloo_failed,
    .abort = gloo_abort,
    .destroy = gloo_destroy,
};

int zd__comm_gloo_create(const struct zd__gloo_opts *opts, zd__comm_t **out, zd__err_t *err) {
  gloo_comm_t *c = calloc(1, sizeof *c);
  if (!c) return zd__errf(err, -ENOMEM, "out of memory for a Gloo communicator");
  int rc = zd__gloo_connect(opts, &c->gloo, err);
  if (rc) {
    free(c);
    return rc;
  }
  c->base.ops = &gloo_ops;
  c->base.rank = opts->rank;
  c->base.world_size = opts->world_size;
  c->base.backend = "gloo";
  *out = &c->base;
  return ZD_OK;
}
