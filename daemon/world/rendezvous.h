/* Rendezvous client: blocking calls to the key-value store of the control service on the node
 * that hosts global rank 0 (control.h), or to etcd when the address is an etcd URL
 * ("etcd://host:port[,host:port...][/job]", etcd.h: the same operations and rules on the keys
 * below the job's prefix, so the world's coordination outlives any node). Rank workers use it to
 * bootstrap their collectives (the Gloo store, NCCL's unique id) and to register this node for
 * `zeroctl status --world`.
 *
 * One zd__rdv_t per thread; calls block for at most their timeout (a wait on a connected store,
 * 0.1 s more for the answer to travel). Calls wait for the store to come up (gRPC WAIT_FOR_READY)
 * and retry a store that went away until the timeout, so peers may start in any order. Errors:
 * -ETIMEDOUT (the message names the keys still missing, or why the store could not be reached),
 * ZD_EPEER (the store answered UNAVAILABLE, e.g. shutting down, until the timeout), ZD_ECONFIG (the
 * address is not the control service of rank 0's node), -EINVAL (a bad key), -ENOMEM.
 */
#ifndef ZD_DAEMON_RENDEZVOUS_H
#define ZD_DAEMON_RENDEZVOUS_H

#include <stddef.h>
#include <stdint.h>

#include "control.pb-c.h"
#include "error.h"

typedef struct zd__rdv zd__rdv_t;

/* address: "host:port" or "unix:/path" of rank 0's control service, or an etcd URL. Does not
 * connect yet. */
int zd__rdv_open(const char *address, zd__rdv_t **out, zd__err_t *err);
void zd__rdv_close(zd__rdv_t *rdv);

/* The store's calls need the world's control token when zerod has a control_token_file: every
 * call from now on carries it (NULL or "": none). Ignored on etcd, which never sees the token.
 * Errors: -ENOMEM. */
int zd__rdv_set_token(zd__rdv_t *rdv, const char *token, zd__err_t *err);

int zd__rdv_set(zd__rdv_t *rdv, const char *key, const void *value, size_t len, int timeout_ms,
                zd__err_t *err);

/* Removes key (absent is fine). */
int zd__rdv_delete(zd__rdv_t *rdv, const char *key, int timeout_ms, zd__err_t *err);

/* Removes every key that begins with prefix: what a world instance that broke had written. */
int zd__rdv_delete_prefix(zd__rdv_t *rdv, const char *prefix, int timeout_ms, zd__err_t *err);

/* Waits until key exists (at most timeout_ms; the store may not be up yet: retried), then
 * returns its value in *value (malloc'd) and *len. */
int zd__rdv_get(zd__rdv_t *rdv, const char *key, void **value, size_t *len, int timeout_ms,
                zd__err_t *err);

/* One look at key, no wait: *found, and when found its value (malloc'd) in *value and *len. The
 * store is still waited for (retried) until timeout_ms, as every call. */
int zd__rdv_lookup(zd__rdv_t *rdv, const char *key, void **value, size_t *len, int *found,
                   int timeout_ms, zd__err_t *err);

/* Waits until every key exists. */
int zd__rdv_wait(zd__rdv_t *rdv, const char *const *keys, size_t nkeys, int timeout_ms,
                 zd__err_t *err);

/* The node registry behind `zeroctl status --world` and Nodes: each node sets
 * ZD__RDV_NODE_PREFIX "<first_rank>" to its NodeInfo (control.proto). */
#define ZD__RDV_NODE_PREFIX "node/"

/* Registers this node (first_rank, local_ranks, the address of its control service, as
 * zd__control_address() reports it), replacing its earlier entry (a restarted zerod). */
int zd__rdv_register_node(zd__rdv_t *rdv, uint32_t first_rank, uint32_t local_ranks,
                          const char *control_address, uint64_t incarnation, int timeout_ms,
                          zd__err_t *err);

/* The node registry (for the heartbeat, liveness.h): the control service's Nodes on the built-in
 * store, the entries under ZD__RDV_NODE_PREFIX on etcd (world_size 0 there), by first rank.
 * *out: free with protobuf_c_message_free_unpacked(&(*out)->base, NULL). One attempt (per etcd
 * endpoint), without waiting for a connection. */
int zd__rdv_nodes(zd__rdv_t *rdv, Zerod__V1__NodesReply **out, int timeout_ms, zd__err_t *err);

#endif /* ZD_DAEMON_RENDEZVOUS_H */
