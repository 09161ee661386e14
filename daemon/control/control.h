/* gRPC control service (proto/control.proto): node status, the rendezvous key-value
 * store (served by the node that hosts global rank 0), the node registry behind `zeroctl status
 * --world`, and grpc.health.v1.Health/Check for Kubernetes probes.
 *
 * Threading: one thread blocks in grpc_completion_queue_next() and hands every completion to the
 * loop thread (uv_async_send); the loop thread runs the handlers and starts every gRPC batch, so
 * the daemon state the handlers read is the loop's, as everywhere else. KvWait requests that
 * cannot be answered yet wait on the loop (a timer each) until a KvSet satisfies them.
 *
 * Serving gRPC is grpc_server.h's and keeping the store kvstore.h's; this module gives them the
 * methods and their meaning.
 */
#ifndef ZD_DAEMON_CONTROL_H
#define ZD_DAEMON_CONTROL_H

#include "error.h"

struct zd__daemon;
typedef struct zd__control zd__control_t;

/* Starts serving d->cfg->control_address ("host:port" or "unix:/path"). The rendezvous store and
 * Nodes are served when this node hosts global rank 0. Errors: the address cannot be bound. */
int zd__control_start(struct zd__daemon *d, zd__control_t **out, zd__err_t *err);

/* Begins shutdown from the loop thread: cancels pending calls, shuts the server down, and
 * calls done(d) on the loop thread once the completion-queue thread has been joined and every
 * handle of the control service is closed. */
void zd__control_stop(zd__control_t *c, void (*done)(struct zd__daemon *d));

/* The control token the store's calls need ("" when control_token_file is not set), for this
 * node's own rendezvous client. */
const char *zd__control_token(const zd__control_t *c);

/* The address actually bound (a "host:0" address gets its port), for logs and the node
 * registry. */
const char *zd__control_address(const zd__control_t *c);

#endif /* ZD_DAEMON_CONTROL_H */
