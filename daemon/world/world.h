/* World bootstrap: how a local rank joins a multi-rank world (docs/design.md, "Worlds").
 *
 * Runs on the rank's worker thread when the daemon starts. Through the rendezvous store of the
 * node that hosts global rank 0 (rendezvous.h): rank 0 publishes a fresh world id (every
 * collective key of this world instance is prefixed by it, so a restarted world never reads a
 * dead one's keys); each node's local rank 0 registers the node (its control address and ranks)
 * for `zeroctl status --world`; then every rank builds its communicator: with the CPU backend a
 * Gloo one (comm_gloo.c), whose full-mesh connection goes through the same store; with the CUDA
 * backend an NCCL one (comm_nccl.c), whose unique id rank 0 creates and publishes under the world
 * id (key nccl/<world id>/id) for the others to read, or, where the world's ranks all share one
 * GPU of this zerod (ranks_per_gpu), the in-process group communicator (comm_cuda_group.c)
 * keyed by the world id. Waiting for peers is bounded by
 * connect_timeout_ms and can be cancelled (shutdown) through *stop.
 */
#ifndef ZD_DAEMON_WORLD_H
#define ZD_DAEMON_WORLD_H

#include <stdatomic.h>
#include <stdint.h>

#include "comm.h"
#include "error.h"
#include "token.h"

#define ZD__ADDRESS_MAX 256

/* Copies, not pointers: rank workers read them until they are joined, which may be after the
 * control service that bound the address has gone (shutdown, a failed start). */
typedef struct zd__world {
  char rendezvous_address[ZD__ADDRESS_MAX]; /* control service of the node hosting rank 0 */
  char control_address[ZD__ADDRESS_MAX];    /* this node's, for the node registry */
  char collective_host[ZD__ADDRESS_MAX];    /* this node's address for collectives */
  char control_token[ZD__TOKEN_MAX];        /* sent to the store; "": none */
  uint32_t world_size;
  uint32_t first_rank;
  uint32_t local_ranks;
  /* CUDA: > 1: the world is this zerod's ranks on one GPU (config.c), joined by the in-process
   * group communicator instead of NCCL */
  uint32_t ranks_per_gpu;
  uint64_t incarnation; /* random, per zerod process: tells a restarted zerod from its earlier
                           life in the store */
  int collective_timeout_ms;
  int connect_timeout_ms;
  int peer_timeout_ms; /* the heartbeat's: also bounds each TCP connection of a Gloo connect */
} zd__world_t;

/* A rank's membership of its world: its rendezvous connection, for barriers. */
typedef struct zd__world_member zd__world_member_t;

/* Joins global rank `rank` to the world and returns its communicator and membership: Gloo over
 * host memory when device is -1, else NCCL on that CUDA device (the calling thread's current one)
 * queuing its operations on `stream` (a cudaStream_t), or with w->ranks_per_gpu > 1 the group
 * communicator of the world's ranks sharing that device (comm.h), keyed by the world instance.
 * Errors: -ETIMEDOUT (peers did not join within connect_timeout_ms), -ECANCELED (*stop was set),
 * ZD_EPEER, ZD_EBACKEND (a CUDA device in a build without CUDA). stale: NULL at start; when
 * re-forming a world whose communicator broke, the instance that broke (zd__world_member_id of the
 * old membership): rank 0 names a new instance, and the other ranks wait until the store names one
 * other than `stale` instead of joining the dead one. An instance being formed is given up
 * (ZD_EPEER) when the store names another or a rank whose zerod restarted after joining it marks
 * it; a peer that died after publishing its Gloo address fails it after peer_timeout_ms. */
int zd__world_connect(const zd__world_t *w, uint32_t rank, int device, void *stream,
                      atomic_int *stop, const char *stale, zd__comm_t **out,
                      zd__world_member_t **member, zd__err_t *err);

/* The name of the world instance the member joined (rank 0 draws one at each bootstrap). */
const char *zd__world_member_id(const zd__world_member_t *m);

/* The incarnation (zd__world_t.incarnation) of global rank `rank`'s zerod when the instance
 * formed; 0 for NULL or a rank out of range. */
uint64_t zd__world_member_incarnation(const zd__world_member_t *m, uint32_t rank);

/* Waits until every rank of the world has called the barrier `name` as many times as this one,
 * through the rendezvous store: for waits that may last much longer than a collective's timeout
 * (clients registering minutes apart), at most connect_timeout_ms, cancelled (-ECANCELED) when
 * the stop flag given to zd__world_connect is set. No collective is involved: a timeout here
 * leaves the communicator healthy. -ETIMEDOUT names the ranks' keys that did not arrive.
 * abandon (may be NULL): set by another thread when the caller's client has left: the wait ends
 * within a second with -ECANCELED (this rank withdraws from the barrier). After
 * zd__world_member_break it ends likewise, with ZD_EPEER and the reason given there. */
int zd__world_barrier(zd__world_member_t *m, const char *name, atomic_int *abandon, zd__err_t *err);

/* The instance broke (a process it formed with is dead or was replaced): a barrier waiting for
 * its ranks would wait for keys that never come (the store may have died with rank 0's node), so
 * it gives up within a second (zd__world_barrier). The first reason is kept. Any thread, while the
 * member is alive (the caller's lock keeps it so). */
void zd__world_member_break(zd__world_member_t *m, const char *why);

/* Whether zd__world_member_break was called; 0 for NULL. */
int zd__world_member_broken(zd__world_member_t *m);

/* Closes the membership's rendezvous connection; accepts NULL. */
void zd__world_member_free(zd__world_member_t *m);

#endif /* ZD_DAEMON_WORLD_H */
