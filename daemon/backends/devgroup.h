/* The host half of the group communicator (comm_cuda_group.c): how local ranks of this process
 * that share a GPU find each other and meet for each collective. Plain C with no CUDA, so that
 * the rendezvous, its bounds and its failures are tested without a GPU
 * (tests/unit/test_devgroup.c).
 *
 * A group is the `size` members of one world instance (the key), found in a process-wide registry
 * and refcounted: each member joins it (bounded by connect_timeout_ms, cancelled through *stop)
 * and leaves it; the last one out frees it. Every collective is two rendezvous of all members:
 * zd__devgroup_meet (A) publishes the member's operation and waits until every member has published
 * the same one; zd__devgroup_done (B) waits until every member has finished reading the others'
 * buffers. Between the two a member may read every member's post (zd__devgroup_post): nobody
 * publishes again before B completes.
 *
 * A failure breaks the whole group, and the first reason stays: a member that does not arrive
 * within the timeout (the message names it), an operation that differs from another member's,
 * zd__devgroup_break from any thread (an abort). A broken group ends every wait in A at once and
 * fails every later meet; B, which every member that passed A reaches after non-blocking calls
 * only, waits at most ZD__DEVGROUP_GRACE_MS more after a break, so that no member's buffers go
 * while a peer still reads them. Thread-safe; a member calls meet and done from one thread.
 */
#ifndef ZD_DAEMON_DEVGROUP_H
#define ZD_DAEMON_DEVGROUP_H

#include <stdatomic.h>
#include <stdint.h>

#include "error.h"

#define ZD__DEVGROUP_MAX      64   /* members of one group */
#define ZD__DEVGROUP_GRACE_MS 2000 /* rendezvous B after a break */

typedef struct zd__group zd__devgroup_t;

/* What a member is about to do: every member of a collective must publish equal op, bucket, dtype
 * and elems (src is its own buffer). */
typedef struct zd__devgroup_post {
  uint32_t op;
  uint32_t bucket;
  int32_t dtype;
  uint64_t elems;
  const void *src;
} zd__devgroup_post_t;

/* Per-member objects the group keeps until it is freed (the CUDA events of comm_cuda_group.c):
 * a peer may still use a member's after that member left. */
#define ZD__DEVGROUP_HANDLES 2
typedef void (*zd__devgroup_free_fn)(void *handle);

/* Joins group `key` (at most 63 bytes) as member `rank` of `size` (2..ZD__DEVGROUP_MAX), on
 * `device` (members must agree on size and device), handing over its handles (freed by free_fn,
 * which may be NULL, with the group; also when the join fails), and waits until all `size` members
 * have joined. Errors: -EINVAL, -ENOMEM, -ETIMEDOUT, -ECANCELED (*stop set), ZD_EINTERNAL (the key
 * names a group of another size or device, or the rank has joined it already), or the reason the
 * group broke meanwhile. A join that times out or is cancelled breaks the group: the others
 * give up too. */
int zd__devgroup_join(const char *key, uint32_t rank, uint32_t size, int device,
                      void *const handles[ZD__DEVGROUP_HANDLES], zd__devgroup_free_fn free_fn,
                      int connect_timeout_ms, const atomic_int *stop, zd__devgroup_t **out,
                      zd__err_t *err);

/* Leaves the group (a NULL group is ignored); the last member frees it and every handle. */
void zd__devgroup_leave(zd__devgroup_t *g);

/* Rendezvous A: publishes p and waits until every member has published, at most timeout_ms; then
 * checks that all published the same operation. Errors: the break's code (-ETIMEDOUT with the
 * missing members, ZD_EPEER for different operations, an abort's code) with its message. */
int zd__devgroup_meet(zd__devgroup_t *g, uint32_t rank, const zd__devgroup_post_t *p,
                      int timeout_ms, const char *what, zd__err_t *err);

/* Rendezvous B: waits until every member has come here, at most timeout_ms (ZD__DEVGROUP_GRACE_MS
 * once the group is broken). ZD_OK when all came (even if the group broke meanwhile). */
int zd__devgroup_done(zd__devgroup_t *g, uint32_t rank, int timeout_ms, const char *what,
                      zd__err_t *err);

/* Member r's post of the collective in progress (between meet and done). */
const zd__devgroup_post_t *zd__devgroup_post(const zd__devgroup_t *g, uint32_t r);

/* Member r's handle i (< ZD__DEVGROUP_HANDLES). */
void *zd__devgroup_handle(const zd__devgroup_t *g, uint32_t r, int i);

uint32_t zd__devgroup_size(const zd__devgroup_t *g);

/* Breaks the group (any thread; the first reason stays; code 0 is taken as ZD_EPEER) and wakes
 * every waiting member. */
void zd__devgroup_break(zd__devgroup_t *g, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Non-zero (the code) once broken. */
int zd__devgroup_failed(const zd__devgroup_t *g);

/* The break as an error in err: returns its code (ZD_OK and nothing written when healthy). */
int zd__devgroup_error(zd__devgroup_t *g, zd__err_t *err);

#endif /* ZD_DAEMON_DEVGROUP_H */
