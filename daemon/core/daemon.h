/* The daemon: the process that owns the libuv loop and everything hanging from it.
 *
 * One zd__daemon_t per process, opaque. It starts the layers below in the order they need each
 * other (the compute backend and kernel pool; the control service, whose address and store the
 * ranks need to join a world; the metrics endpoint; the checkpointer and the local ranks; the
 * heartbeat of the other nodes; the client sessions, the listening socket and drain) and hands
 * each what it needs of the others; none of them knows this module. It also handles signals
 * (SIGTERM/SIGINT: shutdown, SIGHUP: reload), systemd's notifications and the status registry's
 * order.
 *
 * Shutdown (a signal, or the end of a drain): stop accepting and remove the socket, stop reading
 * requests, let the jobs in flight finish and their replies go out, close the sessions, join the
 * rank workers, close every handle; the loop then closes with nothing open.
 */
#ifndef ZD_DAEMON_DAEMON_H
#define ZD_DAEMON_DAEMON_H

#include <uv.h>

#include "config.h"
#include "error.h"
#include "session.h"

typedef struct zd__daemon zd__daemon_t;

/* Sets up everything from cfg (which must outlive the daemon). Errors with a message: socket in
 * use, bad path, an address that cannot be bound, no memory, a backend that cannot run. */
int zd__daemon_create(const zd__config_t *cfg, zd__daemon_t **out, zd__err_t *err);

/* Runs until shutdown completes. Returns 0, or the error of uv_loop_close() if handles leaked. */
int zd__daemon_run(zd__daemon_t *d);

/* Frees what zd__daemon_run left (nothing, after a clean shutdown); accepts NULL. */
void zd__daemon_destroy(zd__daemon_t *d);

/* Starts the shutdown sequence (signals, the end of a drain; idempotent). Loop thread. */
void zd__daemon_shutdown(zd__daemon_t *d);

/* For tests that drive the loop themselves (the session fuzzer): the loop, the sessions, and
 * whether the shutdown has begun. Loop thread. */
uv_loop_t *zd__daemon_loop(zd__daemon_t *d);
zd__sessions_t *zd__daemon_sessions(const zd__daemon_t *d);
int zd__daemon_shutting_down(const zd__daemon_t *d);

#endif /* ZD_DAEMON_DAEMON_H */
