/* Client sessions: one per connection on the local socket (docs/protocol.md).
 *
 * A session reads frames (24-byte header + protobuf body, with file descriptors riding along a
 * register frame), validates the envelope, dispatches each request through one command table to
 * its handler, and writes replies matched by request id. Requests that touch optimizer state
 * become jobs on the attached rank's worker; replies to them are sent when the worker hands the
 * job back. Bad input gets an Error reply naming the problem and the expected value; only a frame
 * that breaks the stream (bad magic, oversized, truncated) closes the connection. Loop thread
 * only.
 */
#ifndef ZD_DAEMON_SESSION_H
#define ZD_DAEMON_SESSION_H

#include <sys/socket.h>

#include "daemon.h"
#include "rank.h"

/* Takes ownership of fd (a connected, non-blocking Unix socket) and starts serving it. A peer
 * whose credentials are not allowed gets an error reply and is disconnected. */
int zd__session_create(zd__daemon_t *d, int fd, const struct ucred *cred);

/* A job of this session's came back from its rank worker: reply, account, maybe free. */
void zd__session_job_done(zd__session_t *s, zd__job_t *job);

/* Shutdown: read no further requests; close once the jobs in flight have been answered. */
void zd__session_drain(zd__session_t *s);

/* Next session in the daemon's list. */
zd__session_t *zd__session_next(const zd__session_t *s);

/* Who is attached (for status): pid and name of the client. */
pid_t zd__session_pid(const zd__session_t *s);
const char *zd__session_name(const zd__session_t *s);

#endif /* ZD_DAEMON_SESSION_H */
