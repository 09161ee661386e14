/* Which client session holds each local rank: the one table of it, written only here and driven
 * only by session.c; status and control read it through zd__sessions_attached (session.h).
 *
 * A session holds at most one rank, from the moment it gets it until it closes:
 *   - hello with ZD_ANY_RANK reserves the first rank no session holds, in the same loop turn that
 *     answers it, so that trainers started together never get the same rank (and a client gets
 *     ZD_EBUSY at hello, not at register, when every rank is held);
 *   - hello naming a rank reserves it if no session holds it; if one does, the hello still
 *     succeeds and the session competes for the rank at register. Such a reservation is weak:
 *     ZD_ANY_RANK hellos skip the rank, but a register from another session that named the rank
 *     too takes it (a client that names a rank to read the status, or a trainer's hello whose
 *     register has not come yet, must not lock a restarted trainer of that rank out);
 *   - register attaches the session to its rank if it holds it or nobody does, or if both named
 *     it and the holder only reserved it, and is refused (ZD_EBUSY, naming the holder)
 *     otherwise; an attach job that fails leaves the rank reserved for the session, which may
 *     register again;
 *   - the session's end (bye, disconnect, after its jobs in flight) releases the rank.
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

/* hello with ZD_ANY_RANK: reserves for s the lowest rank no session holds and sets *local to it.
 * Returns 0, or -1 when every rank is held (nothing changes). s holds no rank yet. */
int zd__attach_reserve_any(zd__attach_t *a, zd__session_t *s, uint32_t *local);

/* hello naming rank `local`: reserves it for s if no session holds it. Returns 1 if s holds it
 * now, 0 if another session does. s holds no rank yet. */
int zd__attach_reserve(zd__attach_t *a, zd__session_t *s, uint32_t local);

/* The session that keeps s (whose hello named `local` if named) from registering on `local`, or
 * NULL when s may: s holds it, nobody does, or both named it and the holder only reserved it. */
zd__session_t *zd__attach_blocker(const zd__attach_t *a, const zd__session_t *s, uint32_t local,
                                  int named);

/* register: attaches s to `local` unless zd__attach_blocker names a session, which it returns
 * (nothing changes then); NULL on success. */
zd__session_t *zd__attach_take(zd__attach_t *a, zd__session_t *s, uint32_t local, int named);

/* The attach job failed: s, attached to `local`, keeps it reserved. */
void zd__attach_unattach(zd__attach_t *a, const zd__session_t *s, uint32_t local);

/* The session ends: releases `local` if s holds it. Returns 1 if s was attached to it (not only
 * reserved), else 0. */
int zd__attach_release(zd__attach_t *a, const zd__session_t *s, uint32_t local);

/* The session holding `local` (reserved or attached), or NULL; *attached says which. */
zd__session_t *zd__attach_holder(const zd__attach_t *a, uint32_t local, int *attached);

#endif /* ZD_DAEMON_ATTACH_H */
