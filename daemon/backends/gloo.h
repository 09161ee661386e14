/* C interface of the Gloo shim (gloo_shim.cc): a TCP Gloo context per rank, and the collectives
 * the CPU backend needs. C++ stays behind this header: exceptions are caught in the shim and
 * returned as error codes with a message.
 *
 * The rendezvous goes through a key-value store given as C callbacks (zd__kv_t), so the shim
 * does not depend on how the store is reached (the daemon passes the rendezvous service; tests
 * may pass a directory of files). Reduce-scatter is a ring over unbound buffers: Gloo's own
 * ReduceScatterHalvingDoubling deadlocks a following allgather (../shared/STACK.md).
 *
 * Every collective is bounded by the context timeout: a peer that died gives "Connection closed
 * by peer" at once, a silent one a timeout; either way the context is unusable afterwards
 * (ZD_EPEER or -ETIMEDOUT, with the peer named when known). One thread at a time per context.
 */
#ifndef ZD_DAEMON_GLOO_H
#define ZD_DAEMON_GLOO_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "zerod/zerod.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Key-value store for the rendezvous, used only during zd__gloo_connect (it need not outlive it).
 * get waits until the key exists and returns a malloc'd copy of its value (the shim frees it);
 * wait waits until every key exists. Both return -ETIMEDOUT after timeout_ms. */
typedef struct zd__kv {
  void *ctx;
  int (*set)(void *ctx, const char *key, const void *value, size_t len, zd__err_t *err);
  int (*get)(void *ctx, const char *key, void **value, size_t *len, int timeout_ms, zd__err_t *err);
  int (*wait)(void *ctx, const char *const *keys, size_t nkeys, int timeout_ms, zd__err_t *err);
} zd__kv_t;

typedef struct zd__gloo zd__gloo_t;

typedef struct zd__gloo_opts {
  const zd__kv_t *kv;
  const char *prefix; /* key prefix of this world (fresh per world instance) */
  uint32_t rank;
  uint32_t world_size;
  const char *host;       /* address to listen on and advertise */
  int timeout_ms;         /* per collective */
  int connect_timeout_ms; /* for the full-mesh connection at start */
  /* Each TCP connection of it, once the peer has published its address (0: connect_timeout_ms):
   * a live peer connects in milliseconds, while one that died after publishing would hold the
   * connect for the whole connect_timeout_ms. */
  int pair_timeout_ms;
} zd__gloo_opts_t;

/* Creates this rank's context: listens on opts->host (port chosen by the system), publishes its
 * address under opts->prefix and connects to every other rank. Blocks until all ranks have joined;
 * gives up with -ETIMEDOUT ("connect: rank 1 did not join within 1000 ms ...") when one has not
 * after connect_timeout_ms. ZD_ECONFIG for bad options or a host it cannot listen on, ZD_EPEER
 * when a connection fails. Sets SIGPIPE to SIG_IGN if its disposition is the default (Gloo
 * writes to sockets whose peer may be dead). The prefix must be fresh for each world instance. */
int zd__gloo_connect(const zd__gloo_opts_t *opts, zd__gloo_t **out, zd__err_t *err);
/* Closes the connections (the peers' next collective fails) and frees g. Accepts NULL. */
void zd__gloo_destroy(zd__gloo_t *g);

/* Non-zero once a failure made the context unusable. */
int zd__gloo_failed(const zd__gloo_t *g);

/* From any thread: makes the collective in progress (and every later one) fail at once with code
 * and a message ending in why, and the context unusable (the first abort's reason stays). For
 * shutdowns that cannot wait for a silent peer, and peers found dead by the heartbeat. */
void zd__gloo_abort(zd__gloo_t *g, int code, const char *why);

/* The collectives block until done or failed. Every rank must make the same calls in the same
 * order with the same sizes; a rank that calls something else waits on different message tags and
 * the call fails by timeout instead of mixing data. Each wait for a transfer is bounded by
 * timeout_ms: a call fails within it when a peer stops making progress, and at once when a peer's
 * connection closes. A failed call closes this rank's connections (so its neighbours fail at once
 * too) and leaves g broken: every later call fails immediately with the first failure's code and
 * message. Sizes of 0 are allowed (no data moves, the call still counts in the sequence). */

/* Sum-reduce-scatter: send holds world_size * count elements of dtype (f32, bf16 or f16); recv
 * receives this rank's slice (elements [rank * count, (rank + 1) * count)) summed in fp32 over
 * all ranks. Inputs are converted to fp32 exactly when read; partial sums travel in fp32.
 *
 * The order of additions is fixed (a ring), so results are reproducible and the same whatever the
 * timing: with x_q the value of rank q and indices mod W, chunk c (the slice rank c receives) is
 *     ((x_{c+1} + x_{c+2}) + x_{c+3}) + ... + x_{c+W}        (x_{c+W} = x_c, the owner's own)
 * each + rounding to fp32. For W = 2 that is exactly a + b; at W = 1 it is the conversion to fp32.
 * Scratch memory is bounded (16 MiB per context at most) whatever count is.
 * tag (16 bits used; the bucket) must be the same on every rank for the same call: ranks that
 * name different buckets at the same point of their sequence fail by timeout, never mix data. */
int zd__gloo_reduce_scatter(zd__gloo_t *g, const void *send, zd_dtype_t dtype, float *recv,
                            uint64_t count, uint32_t tag, zd__err_t *err);

/* In-place all-gather: buf holds world_size slices of `bytes` bytes; this rank's is filled. On
 * return every rank's slice is in place. No copy of buf is made. tag as for reduce-scatter. */
int zd__gloo_all_gather(zd__gloo_t *g, void *buf, size_t bytes, uint32_t tag, zd__err_t *err);

/* All-gather of a small record: recv receives world_size * bytes, rank r's record at r * bytes
 * (send may be recv + r * bytes). One round: every rank sends its record to every other. */
int zd__gloo_allgather_bytes(zd__gloo_t *g, const void *send, size_t bytes, void *recv,
                             zd__err_t *err);

#ifdef __cplusplus
}
#endif
#endif /* ZD_DAEMON_GLOO_H */
