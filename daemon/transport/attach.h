/* Which client session holds each local rank: the one table of it, written only here and driven
 * only by session.c; status and control read it through zd__sessions_attached (session.h).
 *
 * A session holds at most one rank: register attaches the session to the rank it named at
 * hello if nobody holds it, and is refused (ZD_EBUSY, naming the holder) otherwise; an attach
 * job that fails, or the session's end (bye, disconnect, after its jobs in flight), releases it.
 * Loop thread only.
 */
#ifndef ZD_DAEMON_ATTACH_H
#define ZD_DAEMON_ATTACH_H

#include <stdint.h>

typedef struct zd__attach zd__attach_t;
typedef struct zd__session zd__session_t;

/* A table of nranks free ranks; NULL when out of memory. */
zd__attach_t *zd__attach_new(uint32_t nranks);
void zd__attach_free(zd__attach_t *a); /* accepts NULL */

/* register: attaches s to `local` if s holds it or no session does, and returns NULL; otherwise
 * returns the session that holds it, and nothing changes. */
zd__session_t *zd__attach_take(zd__attach_t *a, zd__session_t *s, uint32_t local);

/* The attach job failed, or the session ends: releases `local` if s holds it. Returns 1 if s
 * was attached to it, else 0. */
int zd__attach_release(zd__attach_t *a, const zd__session_t *s, uint32_t local);

/* The session holding `local`, or NULL; *attached says whether it is attached. */
zd__session_t *zd__attach_holder(const zd__attach_t *a, uint32_t local, int *attached);

#endif /* ZD_DAEMON_ATTACH_H */
