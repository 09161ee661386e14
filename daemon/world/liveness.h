/* Peer liveness: notices in seconds that another node of the world has stopped answering (a
 * SIGSTOPped or wedged zerod, a hung host, a partition), where a collective alone would wait for
 * collective_timeout_ms (30 minutes by default, since a live peer may legitimately be slow).
 *
 * A thread of its own asks rank 0's node for the node registry (Nodes) and checks every other
 * node's gRPC health service (grpc.health.v1.Health/Check) every heartbeat_ms, from its start.
 * With the built-in store, rank 0's node (whose control service is the rendezvous address) is
 * watched before the registry was read: it serves the registry, so a zerod that started moments
 * before it died could not learn it there. A node that has
 * not answered for peer_timeout_ms is declared dead once: dead(ctx, reason) is called on this
 * thread, and the daemon fails its ranks' collectives with that reason (zd__rank_peer_dead).
 *
 * How a slow peer is told from a dead one: the health service runs on the node's loop and gRPC
 * threads, which no step, collective or kernel occupies, so a node whose ranks are busy (a long
 * step, a checkpoint, a trainer evaluating between steps) still answers within milliseconds; only
 * a node whose whole process or host is stopped, or that the network no longer reaches, stays
 * silent. A node that answers again is watched again (a later silence is reported again). A
 * single-node world has no peer to watch: the thread then only sleeps.
 *
 * Each time a world instance forms, the ranks tell the heartbeat which zerod process every rank's
 * node runs (zd__liveness_formed): a node is then watched as that process, with its silence
 * counted from the formation. Without it, a node whose earlier process was found dead (its
 * verdict given once) and that was restarted, took part in a new instance and died again before
 * this thread read the registry anew (with the built-in store the registry dies with rank 0's
 * node) would never be reported again, and the new instance would wait for it up to
 * collective_timeout_ms.
 */
#ifndef ZD_DAEMON_LIVENESS_H
#define ZD_DAEMON_LIVENESS_H

#include <stdint.h>

#include "error.h"

typedef struct zd__liveness zd__liveness_t;

typedef struct zd__liveness_cfg {
  const char *rendezvous_address; /* rank 0's control service (copied) */
  uint32_t first_rank;            /* this node's, to skip itself in the registry */
  uint32_t heartbeat_ms;          /* between two rounds of checks */
  uint32_t peer_timeout_ms;       /* silence that makes a node dead */
} zd__liveness_cfg_t;

/* What a verdict says about the node's process `incarnation` (0: unknown). */
typedef enum zd__verdict {
  ZD__VERDICT_SILENT,   /* it stopped answering: a world formed with another process ignores it */
  ZD__VERDICT_REPLACED, /* it is the node's process now, not the one a world may have formed
                           with: a world formed with it ignores the verdict */
} zd__verdict_t;

/* Called on the liveness thread, once per node that went silent, or that the registry shows
 * restarted, with a message naming it. */
typedef void (*zd__peer_dead_fn)(void *ctx, uint32_t first_rank, zd__verdict_t verdict,
                                 uint64_t incarnation, const char *reason);

/* Starts the thread. Errors: -ENOMEM, -EAGAIN (no thread). */
int zd__liveness_start(const zd__liveness_cfg_t *cfg, zd__peer_dead_fn dead, void *ctx,
                       zd__liveness_t **out, zd__err_t *err);

/* A world instance formed with these processes: incarnations[r] is global rank r's zerod
 * (0: unknown), for r < world_size. Every node the heartbeat knows is watched from now on as the
 * process its first rank names: a fresh channel for a process it did not know, no verdict given
 * yet, silence counted from now. Does not block: the thread applies it at once. Any thread;
 * accepts a NULL l. */
void zd__liveness_formed(zd__liveness_t *l, const uint64_t *incarnations, uint32_t world_size);

/* Stops and joins the thread (within about one call's deadline) and frees it; accepts NULL.
 * dead() is not called after it returns. */
void zd__liveness_stop(zd__liveness_t *l);

#endif /* ZD_DAEMON_LIVENESS_H */
