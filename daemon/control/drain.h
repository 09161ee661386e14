/* Drain (zeroctl drain, the control service's Drain call): before maintenance, the node is marked
 * draining (readiness fails, registrations are refused), a checkpoint is requested as zeroctl
 * checkpoint does (taken after the next step of every rank), and once it is complete (its manifest
 * written, by this node or, where rank 0 lives elsewhere, seen in the shared checkpoint_dir) zerod
 * shuts down as on SIGTERM. One drain at a time. Loop thread only.
 *
 * Drain with leave (zeroctl drain --leave) needs no storage: instead of the checkpoint, this
 * node's ranks ask for a live resize (resize.h) to the world without them, W - local_ranks; the
 * resize rides the next step, every rank takes the whole model's image, this node's ranks leave
 * (at their trainers' next request) and the others re-form at the new size and go on from the
 * step reached. Once every local rank has left, the node's entry leaves the node registry (so that
 * zeroctl status --world does not list it as unreachable) and zerod shuts down. The ranks of the
 * new world keep their numbers, so only the node of the highest ranks may leave (first_rank +
 * local_ranks == W): a middle node is refused, as is a node that holds every rank (no world to
 * leave).
 */
#ifndef ZD_DAEMON_DRAIN_H
#define ZD_DAEMON_DRAIN_H

#include <stdint.h>
#include <uv.h>

#include "checkpoint.h"
#include "config.h"
#include "error.h"
#include "rank.h"
#include "session.h"
#include "status.h"

typedef struct zd__drain zd__drain_t;

/* What a drain needs; everything outlives it. */
typedef struct zd__drain_env {
  uv_loop_t *loop;
  const zd__config_t *cfg;
  const zd__ranks_t *ranks;      /* whose models there are to save */
  zd__ckptr_t *ckpt;             /* who saves them */
  zd__sessions_t *sessions;      /* refuse registrations meanwhile */
  const struct zd__world *world; /* leave: whose node registry to leave (NULL: world size 1) */
  void (*shutdown)(void *ctx);   /* the checkpoint is complete: shut down as on SIGTERM */
  void *ctx;
} zd__drain_env_t;

/* How a drain ended. */
typedef struct zd__drain_result {
  int rc;           /* ZD_OK: zerod is shutting down now; else the drain was given up and zerod
                       goes on serving (ZD_ESHUTDOWN: it is shutting down for another reason) */
  int checkpointed; /* a checkpoint of `step` is complete in `dir` */
  int lost;         /* forced without a checkpoint although one was asked for (failed, late),
                       or forced although the leave failed or was late */
  int left;         /* leave: this node's ranks left the world after `step`; it goes on at
                       world_size ranks */
  uint32_t world_size;
  uint64_t step;
  char dir[512];
  char msg[ZD__ERR_MSG_MAX]; /* rc != 0: why; ZD_OK without a checkpoint: why there is none */
} zd__drain_result_t;

typedef void (*zd__drain_done_fn)(void *arg, const zd__drain_result_t *res);

/* Errors: -ENOMEM, or libuv's (the timer). */
int zd__drain_create(const zd__drain_env_t *env, zd__drain_t **out);

/* Closes the timer and frees the drain in its close callback; accepts NULL. */
void zd__drain_close(zd__drain_t *d);

/* Starts a drain asked for by `by` (the caller, for logs and refusals): done(arg, res) runs once
 * it ends, before the shutdown begins; never when this returns an error. wait_ms bounds the wait
 * for the checkpoint (leave: for this node's ranks to have left). force: stop even without a
 * checkpoint (nothing to checkpoint, or it failed or was late; leave: no model to ride, or the
 * leave failed or was late). leave: leave the world through a live resize instead of a
 * checkpoint. Errors: ZD_ECONFIG (no checkpoint_dir) and ZD_EORDER (no model registered),
 * unless force; ZD_EORDER (a drain already in progress; leave: no world to leave, not the node of
 * the highest ranks, the ranks left already), ZD_EBACKEND (leave: the CUDA backend),
 * ZD_ESHUTDOWN. */
int zd__drain_start(zd__drain_t *d, const char *by, uint32_t wait_ms, int force, int leave,
                    zd__drain_done_fn done, void *arg, zd__err_t *err);

/* Who asked for the drain in progress, or NULL when none is. */
const char *zd__drain_by(const zd__drain_t *d);

/* zerod shuts down for another reason: a drain waiting for its checkpoint ends with ZD_ESHUTDOWN
 * (its caller hears it before the service goes), and no drain starts from now on. */
void zd__drain_shutdown(zd__drain_t *d);

/* The server section's draining key (a zd__status_fn; ctx is the drain). */
void zd__drain_status(void *d, zd__status_t *st);

#endif /* ZD_DAEMON_DRAIN_H */
