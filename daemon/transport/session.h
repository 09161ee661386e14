/* Client sessions: one per connection on the local socket (docs/protocol.md), and the set of them
 * (zd__sessions_t): the open sessions, their counters, which session holds each local rank
 * (attach.h, whose table only this module drives), the completion queue through which rank
 * workers hand finished jobs back, and the loop's busy polling after a reply.
 *
 * A session reads frames (24-byte header + protobuf body, with file descriptors riding along a
 * register frame), validates the envelope, dispatches each request through one command table to
 * its handler (requests.c), and writes replies matched by request id. Requests that touch
 * optimizer state become jobs on the attached rank's worker (jobs.c), which answers them. Bad input
 * gets an Error reply naming the problem and the expected value; only a frame that breaks the
 * stream (bad magic, oversized, truncated) closes the connection. The client's buffers are
 * buffers.h's. Loop thread only, but where a function says otherwise.
 */
#ifndef ZD_DAEMON_SESSION_H
#define ZD_DAEMON_SESSION_H

#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "backend.h"
#include "config.h"
#include "error.h"
#include "rank.h"
#include "status.h"

typedef struct zd__session zd__session_t;
typedef struct zd__sessions zd__sessions_t;

/* What the sessions count, for status and the daemon's connection summary. */
typedef struct zd__session_counters {
  uint64_t clients_total;
  uint64_t clients_denied;      /* credentials not allowed */
  uint64_t clients_refused;     /* max_clients or max_clients_per_uid reached */
  uint64_t clients_timed_out;   /* no hello within hello_timeout_ms */
  uint64_t connections_dropped; /* closed by zerod after an error reply (all of the above too) */
  uint64_t requests_total;
  uint64_t requests_polled; /* found by the loop while it polled after a reply (busy_poll_us) */
  uint64_t replies_early;   /* written or queued by a rank worker as its job ended (jobs.c);
                               counted when the loop sees the job end */
  uint64_t errors_total;
  char last_drop[ZD__ERR_MSG_MAX + 64]; /* why the last dropped connection was dropped */
} zd__session_counters_t;

/* What the sessions serve, from the layers below. Everything outlives the set. */
typedef struct zd__sessions_env {
  uv_loop_t *loop;
  const zd__config_t *cfg;
  const zd__backend_t *backend;
  const zd__ranks_t *ranks;       /* the local ranks a hello may name */
  const zd__status_reg_t *status; /* what a STATUS request answers */
  void (*closed)(void *ctx);      /* a session's handles are closed (shutdown waits for all) */
  void *ctx;
} zd__sessions_env_t;

/* The sessions, with a free attachment table of env->ranks->n local ranks. Errors: -ENOMEM, or
 * libuv's (the completion queue's handle). */
int zd__sessions_create(const zd__sessions_env_t *env, zd__sessions_t **out);

/* Shutdown: every session reads no further requests and closes once its jobs in flight have been
 * answered; env->closed is called as each one's handles are closed. */
void zd__sessions_drain(zd__sessions_t *ss);

/* Once no session is open (after zd__sessions_drain): closes the completion queue's handle. */
void zd__sessions_close(zd__sessions_t *ss);

/* Frees the set once the loop has closed its handles; accepts NULL. */
void zd__sessions_destroy(zd__sessions_t *ss);

/* Sessions open now (torn-down ones no longer count). */
uint32_t zd__sessions_open(const zd__sessions_t *ss);

const zd__session_counters_t *zd__sessions_counters(const zd__sessions_t *ss);

/* The session attached (registered) to local rank `local`, or NULL: one that only reserved it at
 * hello is not attached yet. The pointer is for zd__session_pid/name, now. */
const zd__session_t *zd__sessions_attached(const zd__sessions_t *ss, uint32_t local);

/* Registrations are refused from now on (a drain: zerod stops once its checkpoint is complete),
 * the message naming `by`; NULL lets them in again (the drain was given up). */
void zd__sessions_refuse_registers(zd__sessions_t *ss, const char *by);

/* The loop's pass about to run: 1 when it should look for events without sleeping (within
 * busy_poll_us of a reply, with every rank's worker idle: a worker's kernel may need every CPU,
 * and its end wakes the loop anyway). Also notes it, for the requests_polled count. */
int zd__sessions_poll_now(zd__sessions_t *ss);

/* The server section of the status: clients and requests (a zd__status_fn; ctx is the set), and
 * each rank section's attached client. */
void zd__sessions_status(void *ss, zd__status_t *st);

/* Whether the process at the other end of the unix socket fd (its SO_PEERCRED credentials: cred)
 * may use zerod: its uid is in allowed_uids, or its gid or one of its groups in allowed_gids. The
 * client socket and a unix: control address admit the same processes. */
int zd__peer_allowed(const zd__config_t *cfg, int fd, const struct ucred *cred);

/* Takes ownership of fd (a connected, non-blocking Unix socket) and starts serving it. A peer
 * whose credentials are not allowed, or past a connection limit, gets an error reply and is
 * disconnected. Errors: -ENOMEM, or libuv's (fd is closed then too). */
int zd__session_create(zd__sessions_t *ss, int fd, const struct ucred *cred);

/* Who is attached (for status): pid and name of the client. */
pid_t zd__session_pid(const zd__session_t *s);
const char *zd__session_name(const zd__session_t *s);

#endif /* ZD_DAEMON_SESSION_H */
