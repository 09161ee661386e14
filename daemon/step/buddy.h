/* Buddy copies (buddy_copy_every_steps, buddy_copy_every_s; CPU backend, world size > 1): every
 * N steps, and after a step once N seconds have passed since the last copy (a flag in the step's
 * record, OR-ed across the ranks as checkpoints' is, so that every rank copies the same step),
 * each rank's committed shard state (the arrays the model has, its step, steps skipped, loss
 * scaler and per-parameter step lags, zd__model_t.lag) is copied on the worker into a snapshot of
 * zerod's memory, which a sender thread per local rank sends in pieces, throttled, to the control
 * service of its buddy: the next node in rank order whose failure_domain differs (the next node at
 * all when none does, with a warning). The buddy holds the newest complete copy of each ward, in
 * its state_dir when it has one (a file per ward, "buddy-rank<R>-of-<W>.zdbuddy", 0600, mapped; the
 * copy being received is
 * "<name>.part" until complete, then renamed over it), else in memory, and answers BuddyGet with
 * it; a zerod restarted with that state_dir serves the copies its files hold.
 *
 * Recovery (zd__buddy_resume, from the checkpointer's resume): when a rank of the world has no
 * usable state file (its zerod came back empty), the ranks all-gather which commits each can
 * serve (a commit named by step + steps skipped and its lags): its state file's records, its own
 * two newest snapshots, and for a rank without a file the newest copy a buddy holds of it (read
 * before the all-gather, so that nothing can fail after it). The world takes the step of the empty
 * ranks' copies when every rank can serve it, each from its file, its snapshot or its copy. When
 * none is common and every empty rank has a copy, the ranks with a file that read none read theirs
 * (a zerod restarted too: its snapshots are gone) and all gather again (every rank decides so from
 * the same offers). Otherwise every rank goes on to the state files' agreement and the checkpoint
 * fallback, and the reason is the model's resume note. When no rank offers anything, a rank
 * whose newest copy the store records ("buddy/copied/<rank>", written by the sender after each
 * copy; kept where the store outlives the nodes: etcd) says every node was lost at once (the
 * note, and the status section).
 *
 * Threads: zd__buddy_after_step and zd__buddy_resume run on a rank's worker (the one writer of
 * its snapshots), the sender threads read the snapshot they send, and the holder's store is
 * called from the control service on the loop; a lock per sender and one for the store. The
 * settings, senders and store are the process's (one zerod per process: tests that run several
 * daemons in one process must leave buddy copies off in all but one). */
#ifndef ZD_STEP_BUDDY_H
#define ZD_STEP_BUDDY_H
#include <stdint.h>
#include "control.pb-c.h"
#include "error.h"
#include "model.h"
#include "status.h"

typedef struct zd__buddy_settings {
  uint32_t every_steps;      /* 0: none by steps (the store still holds copies sent here) */
  uint32_t every_s;          /* 0: none by time */
  const char *state_dir;     /* where the copies held here are kept; NULL or "": memory */
  uint64_t bytes_per_s;      /* 0: no limit */
  const char *domain;        /* failure_domain; "": this node's own */
  const char *rendezvous;    /* where the node registry is (rendezvous.h) */
  const char *control_token; /* sent with every call; "": none */
  const char *control_address;
  uint32_t first_rank, local_ranks, world_size;
} zd__buddy_settings_t;

/* Copies the settings, loads the copies held in state_dir (a file that fails the checks of
 * state_file.h's files, or whose header is damaged, is renamed aside, logged; a ".part" left by a
 * copy in flight is deleted) and starts a sender thread per local rank when every_steps or
 * every_s > 0 and world_size > 1. Errors: -ENOMEM, state_dir unreadable, or a thread that cannot
 * start. Call once, before workers and before the control service serves. */
int zd__buddy_start(const zd__buddy_settings_t *s, zd__err_t *err);

/* A live resize committed on local rank local_rank (its worker): from now on holders are chosen
 * among the nodes of the world of world_size ranks, that rank's snapshots of the old size are
 * dropped (those not being sent), and so are the copies held here for ranks of another size
 * (their files deleted). Any thread; idempotent across the local ranks. */
void zd__buddy_resized(uint32_t local_rank, uint32_t world_size);

/* Stops the senders (a copy in flight is dropped between pieces) and frees snapshots and the
 * copies held. Call after the workers are joined and the control service stopped. */
void zd__buddy_stop(void);

/* The worker of a rank, building the record of the step after m->step: ZD__BUDDY_WANT when
 * this rank asks for a copy of it (every_s have passed since its last snapshot), ZD__BUDDY_BUSY
 * when its previous copy is still being sent (only the worker starts a copy, so a sender idle
 * now is idle after the step). 0 without buddy copies. */
#define ZD__BUDDY_WANT 1
#define ZD__BUDDY_BUSY 2
int zd__buddy_wants(const zd__step_ctx_t *ctx);

/* The worker of a rank, once the records of step `step` are agreed (the OR of every rank's
 * flags): the step is copied when some rank asked or it is an every_steps-th step, unless some
 * rank is busy, when every rank skips it (counted as skipped): every rank takes the same
 * decision, so the ranks' snapshots are of the same steps. */
void zd__buddy_agreed(const zd__step_ctx_t *ctx, uint64_t step, int asked, int busy);

/* After a committed step: at the step zd__buddy_agreed said is due takes a snapshot of the
 * committed state and hands it to the sender, unless the previous copy is still being sent (counted
 * as skipped). On the rank's worker; never fails the step (a failure is logged and in the status).
 */
void zd__buddy_after_step(const zd__step_ctx_t *ctx, const zd__model_t *m);

/* The buddy agreement (above), collective at world size > 1 when copies are on; a no-op
 * otherwise. *handled: the model serves the agreed step (restored, committed, resumed_from
 * ZD__FROM_BUDDY); else why (len bytes) says why no copy served when one was needed ("": none was
 * needed). Errors: the collective's. */
int zd__buddy_resume(const zd__step_ctx_t *ctx, zd__model_t *m, int replace, int *handled,
                     char *why, size_t len, zd__err_t *err);

/* The holder's side, for the control service (loop thread). */
int zd__buddy_put(const Zerod__V1__BuddyPutRequest *req, uint64_t *received, zd__err_t *err);
/* Fills rep from the complete copy held of req's rank; *data (malloc'd, the caller frees it after
 * packing) is the piece asked for. ZD_OK with rep->info NULL: none held. */
int zd__buddy_get(const Zerod__V1__BuddyGetRequest *req, Zerod__V1__BuddyGetReply *rep,
                  Zerod__V1__BuddyCopyInfo *info, uint8_t **data, zd__err_t *err);

/* This local rank's newest copy complete at its buddy. */
typedef struct zd__buddy_rank_status {
  int has_copy;
  uint64_t step;
  uint64_t age_ms;
  char holder[256];
  char error[256];
} zd__buddy_rank_status_t;
void zd__buddy_rank_status(uint32_t local_rank, zd__buddy_rank_status_t *out);

/* The "buddy" status section (zd__status_register; ctx unused). */
void zd__buddy_status(void *ctx, zd__status_t *st);

#endif /* ZD_STEP_BUDDY_H */
