/* gRPC control service (proto/control.proto): node status, checkpoint requests and drain, the
 * rendezvous key-value store (served by the node that hosts global rank 0), the node registry
 * behind `zeroctl status --world`, and grpc.health.v1.Health/Check for Kubernetes probes.
 *
 * Threading: one thread blocks in grpc_completion_queue_next() and hands every completion to the
 * loop thread (uv_async_send); the loop thread runs the handlers and starts every gRPC batch, so
 * the state the handlers read is the loop's, as everywhere else. KvWait requests that cannot be
 * answered yet wait on the loop (a timer each) until a KvSet satisfies them.
 *
 * Serving gRPC is grpc_server.h's and keeping the store kvstore.h's; this module gives them the
 * methods and their meaning. The service starts before the node's ranks exist (they need its
 * address, and on rank 0's node its store, to join the world); it serves them once
 * zd__control_serve names them.
 */
#ifndef ZD_DAEMON_CONTROL_H
#define ZD_DAEMON_CONTROL_H

#include <stdint.h>
#include <uv.h>

#include "backend.h"
#include "checkpoint.h"
#include "config.h"
#include "drain.h"
#include "error.h"
#include "rank.h"
#include "session.h"

typedef struct zd__control zd__control_t;

/* What the service needs from the start; everything outlives it. */
typedef struct zd__control_env {
  uv_loop_t *loop;
  const zd__config_t *cfg;
  const zd__backend_t *backend;
  uint64_t start_us; /* zd__now_us() when zerod started, for the uptime */
} zd__control_env_t;

/* Starts serving env->cfg->control_address ("host:port" or "unix:/path"). The rendezvous store and
 * Nodes are served when this node hosts global rank 0. Errors: the address cannot be bound, TLS
 * files that do not load, a non-local address without TLS or control_insecure. */
int zd__control_start(const zd__control_env_t *env, zd__control_t **out, zd__err_t *err);

/* The node the service reports on and acts for, once it exists: its local ranks, their clients,
 * the checkpointer and the drain (all outlive the service). Until then Status lists no rank,
 * Checkpoint and Drain are refused, and readiness fails. */
void zd__control_serve(zd__control_t *c, const zd__ranks_t *ranks, const zd__sessions_t *sessions,
                       zd__ckptr_t *ckpt, zd__drain_t *drain);

/* Begins shutdown from the loop thread: cancels pending calls, shuts the server down, and
 * calls done(ctx) on the loop thread once the completion-queue thread has been joined and every
 * handle of the control service is closed. */
void zd__control_stop(zd__control_t *c, void (*done)(void *ctx), void *ctx);

/* The control token the store's calls need ("" when control_token_file is not set), for this
 * node's own rendezvous client. */
const char *zd__control_token(const zd__control_t *c);

/* The address actually bound (a "host:0" address gets its port), for logs and the node
 * registry. */
const char *zd__control_address(const zd__control_t *c);

#endif /* ZD_DAEMON_CONTROL_H */
