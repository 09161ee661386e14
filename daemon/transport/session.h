/* Client sessions: one per connection on the local socket (docs/protocol.md), and the set of them
 * (zd__sessions_t): the open sessions, their counters, and which session holds each local rank
 * (attach.h, whose table only this module drives).
 *
 * A session reads frames (24-byte header + protobuf body, with file descriptors riding along a
 * register frame), validates the envelope, dispatches each request through one command table to
 * its handler, and writes replies matched by request id. Requests that touch optimizer state
 * become jobs on the attached rank's worker; replies to them are sent when the worker hands the
 * job back. Bad input gets an Error reply naming the problem and the expected value; only a frame
 * that breaks the stream (bad magic, oversized, truncated) closes the connection. The client's
 * buffers are buffers.h's. Loop thread only.
 */
#ifndef ZD_DAEMON_SESSION_H
#define ZD_DAEMON_SESSION_H

#include <stdint.h>
#include <sys/socket.h>

#include "daemon.h"
#include "error.h"
#include "rank.h"

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
  uint64_t replies_early;   /* written or queued by a rank worker as its job ended
                               (zd__session_answer_early); counted when the loop sees the job end */
  uint64_t errors_total;
  char last_drop[ZD__ERR_MSG_MAX + 64]; /* why the last dropped connection was dropped */
} zd__session_counters_t;

/* The sessions of daemon d, with a free attachment table of nranks local ranks. Errors: -ENOMEM. */
int zd__sessions_create(zd__daemon_t *d, uint32_t nranks, zd__sessions_t **out);

/* Frees the set once no session is left (after the daemon's loop has run); accepts NULL. */
void zd__sessions_destroy(zd__sessions_t *ss);

/* Shutdown: every session reads no further requests and closes once its jobs in flight have been
 * answered; zd__daemon_session_gone is called as each one's handles are closed. */
void zd__sessions_drain(zd__sessions_t *ss);

/* Sessions open now (torn-down ones no longer count). */
uint32_t zd__sessions_open(const zd__sessions_t *ss);

const zd__session_counters_t *zd__sessions_counters(const zd__sessions_t *ss);

/* The session attached (registered) to local rank `local`, or NULL: one that only reserved it at
 * hello is not attached yet. The pointer is for zd__session_pid/name, now. */
const zd__session_t *zd__sessions_attached(const zd__sessions_t *ss, uint32_t local);

/* Whether the process at the other end of the unix socket fd (its SO_PEERCRED credentials: cred)
 * may use zerod: its uid is in allowed_uids, or its gid or one of its groups in allowed_gids. The
 * client socket and a unix: control address admit the same processes. */
int zd__peer_allowed(const zd__config_t *cfg, int fd, const struct ucred *cred);

/* Takes ownership of fd (a connected, non-blocking Unix socket) and starts serving it. A peer
 * whose credentials are not allowed, or past a connection limit, gets an error reply and is
 * disconnected. Errors: -ENOMEM, or libuv's (fd is closed then too). */
int zd__session_create(zd__sessions_t *ss, int fd, const struct ucred *cred);

/* Rank worker thread, as a job of a session's finishes: sends its reply at once when nothing of
 * the loop's is needed for it (job->answer_early: a successful step, scatter, gather or checkpoint
 * on host buffers), so that the client need not wait for the loop thread to be woken. Sets
 * job->answered if it did; the loop does the rest in zd__session_job_done. */
void zd__session_answer_early(zd__job_t *job);

/* A job of this session's came back from its rank worker: reply (unless answered early),
 * account, maybe free. */
void zd__session_job_done(zd__session_t *s, zd__job_t *job);

/* Who is attached (for status): pid and name of the client. */
pid_t zd__session_pid(const zd__session_t *s);
const char *zd__session_name(const zd__session_t *s);

#endif /* ZD_DAEMON_SESSION_H */
