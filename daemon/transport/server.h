/* The listening Unix socket: created with the configured mode, refusing to take over a socket
 * another zerod still serves, handing each accepted connection with its peer credentials
 * (SO_PEERCRED) to a new session (session.h), and removed at shutdown.
 *
 * One zd__server_t per daemon, created and stopped by daemon.c; it owns the listening descriptor
 * and its poll handle, the socket file (only our own file, by inode, is removed at stop), the
 * start lock (<socket>.lock, held while we run, so that two zerods started at once cannot remove
 * each other's socket), and the timer that resumes accepting after the process ran out of file
 * descriptors. Loop thread only.
 */
#ifndef ZD_DAEMON_SERVER_H
#define ZD_DAEMON_SERVER_H

#include <uv.h>

#include "config.h"
#include "error.h"
#include "status.h"

typedef struct zd__server zd__server_t;
typedef struct zd__sessions zd__sessions_t;

/* Binds and listens on cfg->socket_path (cfg must outlive the server) and hands connections to
 * sessions. Errors with a message, nothing left behind: the socket is served by another zerod or
 * its lock is held, the path is too long or not a socket, bind/listen fail. */
int zd__server_start(uv_loop_t *loop, const zd__config_t *cfg, zd__sessions_t *sessions,
                     zd__server_t **out, zd__err_t *err);

/* Stops accepting, removes the socket file and the lock, and closes the handles through the loop;
 * idempotent. */
void zd__server_stop(zd__server_t *srv);

/* Frees the server once the loop has closed its handles (after zd__server_stop and the loop's
 * run); accepts NULL. */
void zd__server_destroy(zd__server_t *srv);

/* The server section's socket key (a zd__status_fn; ctx is the server). */
void zd__server_status(void *srv, zd__status_t *st);

#endif /* ZD_DAEMON_SERVER_H */
