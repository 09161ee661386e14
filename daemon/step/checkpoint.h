/* Checkpointer: when a rank's optimizer state is written to disk, and how it is read back.
 *
 * One per daemon, shared by its local ranks (docs/design.md, "Checkpoints"). The files and their
 * format are common/checkpoint_format's; this module decides when, snapshots, writes in the
 * background and completes a checkpoint across the world:
 *
 *   when     a request (zeroctl or the gRPC Checkpoint call, the checkpoint_every_seconds timer)
 *            sets a flag that the next step's record carries; every rank ORs the flags of all
 *            records, so every rank of the world checkpoints the same step. checkpoint_every_steps
 *            needs no flag (every rank counts the same steps). A client's zd_checkpoint is a job
 *            of its own between steps, which every trainer of the world calls (a collective).
 *   snapshot the worker that ran the step queues a copy of master, exp_avg, exp_avg_sq (and
 *            max_exp_avg_sq) into the rank's host staging (the compute backend's snapshot: from
 *            the GPU an asynchronous copy to pinned memory, stream-ordered before the next
 *            update) and goes on: the step's reply does not wait for the copy, the writer does;
 *            a checkpoint requested while this rank's previous one is still being written waits
 *            for it (at most the timeout), so that every rank writes every checkpoint.
 *   write    a background thread writes the rank's file; with W > 1 its name, size and checksum go
 *            to the rendezvous store under "ckpt/<step>/<rank>" (or the error that stopped it).
 *   complete the daemon of global rank 0 waits for every rank's entry (at most the collective
 *            timeout), writes the manifest last, then applies the retention (checkpoint_keep).
 *   resume   a rank registering a model it does not hold loads the newest complete checkpoint
 *            whose parameter table matches (any world size: resharding), per the resume setting.
 */
#ifndef ZD_DAEMON_CHECKPOINT_H
#define ZD_DAEMON_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "status.h"

struct zd__model;
struct zd__step_ctx;
struct zd__world;

typedef struct zd__ckptr zd__ckptr_t;

typedef struct zd__ckpt_settings {
  const char *dir;        /* checkpoint_dir: the step-* directories go here; "": checkpoints off */
  uint32_t every_steps;   /* 0: no periodic checkpoint by steps */
  uint32_t every_seconds; /* 0: none by time */
  uint32_t keep;          /* complete checkpoints kept; 0: all */
  const char *resume;     /* "": never; "latest": newest matching in dir; else a checkpoint dir */
  uint64_t throttle_bytes_per_s; /* test-only: write no faster (kill trials) */
  int timeout_ms; /* rank 0 waits this long for the other ranks' files; every other wait of the
                     checkpointer (a copy, a previous write) is bounded by it too */
} zd__ckpt_settings_t;

/* What status and metrics show. */
typedef struct zd__ckpt_stats {
  int enabled;
  uint64_t requested; /* checkpoints this daemon's ranks snapshotted */
  uint64_t completed; /* complete ones (manifest written here) or, on a daemon without
                         rank 0, files written */
  uint64_t failures;
  uint64_t last_ok_step; /* valid when completed > 0 */
  uint64_t last_ok_unix_ms;
  uint64_t last_duration_ms; /* snapshot to manifest */
  uint64_t last_bytes;       /* bytes this daemon wrote for it */
  uint64_t last_snapshot_us; /* the stall of the step it was taken at (slowest local rank) */
  uint64_t in_progress;      /* writes queued or running */
  char last_dir[512];
  char last_error[ZD__ERR_MSG_MAX]; /* "" when the last checkpoint succeeded */
  uint64_t resumed_step;            /* step the last resume loaded */
  char resumed_dir[512];            /* "": none */
} zd__ckpt_stats_t;

/* world: NULL at world size 1 (no store to exchange file entries). Starts the writer threads.
 * Errors: -ENOMEM, -EAGAIN. */
int zd__ckptr_create(const zd__ckpt_settings_t *settings, const struct zd__world *world,
                     uint32_t local_ranks, zd__ckptr_t **out, zd__err_t *err);

/* Finishes the writes queued (they are short: the data is in memory), joins the threads and
 * frees everything; accepts NULL. */
void zd__ckptr_destroy(zd__ckptr_t *c);

/* Any thread, at the start of a shutdown: the files still queued are written, but their
 * exchanges with the store (which may be going away with rank 0's zerod) give up at once, so
 * that a rank waiting to snapshot, and the shutdown, are not held for a store that is gone.
 * Accepts NULL. */
void zd__ckptr_cancel(zd__ckptr_t *c);

/* A live resize (resize.h) made the world world_size ranks: later checkpoints are of that many
 * ranks (the manifest's size, the entries global rank 0 collects). Called by every rank of the new
 * world after the resize's image was taken, before the world re-forms; a checkpoint still in
 * flight then is given up as when the world breaks. */
void zd__ckptr_set_world_size(zd__ckptr_t *c, uint32_t world_size);

/* Any thread: the world broke (a peer died). A checkpoint still waiting for the other ranks'
 * files gives up at once: a dead rank never writes its file. Accepts NULL. */
void zd__ckptr_world_broke(zd__ckptr_t *c);

/* Whether checkpoint_dir is set (accepts NULL: no). */
int zd__ckptr_enabled(const zd__ckptr_t *c);

/* Whether a registration of a model the rank does not hold may load a checkpoint (the resume
 * setting; accepts NULL: no). */
int zd__ckptr_resumes(const zd__ckptr_t *c);

/* Any thread: the next step of every rank of the world takes a checkpoint. ZD_ECONFIG (message
 * says so) when checkpoint_dir is not set. */
int zd__ckptr_request(zd__ckptr_t *c, zd__err_t *err);

/* Loop thread, about once a second: requests a checkpoint when checkpoint_every_seconds have
 * passed since the last one was requested. */
void zd__ckptr_tick(zd__ckptr_t *c, uint64_t now_ms);

/* The worker of a rank, building the record of step `step`: whether this rank asks for a
 * checkpoint after it (takes the pending request). */
int zd__ckptr_wants(zd__ckptr_t *c, uint64_t step);

/* The worker of a rank, between steps or right after one: queues the snapshot of the model's state
 * (compute.h, snapshot: it does not wait for the copy) and its write. wait: returns only once
 * this rank's file is written and, on the daemon of rank 0, the checkpoint is complete; dir (len
 * bytes) then names it. Every wait is bounded by the timeout. Errors: ZD_ECONFIG (no
 * checkpoint_dir), -ENOMEM, -ETIMEDOUT (the rank's previous write, or with wait this one, not
 * done in time: the message says which), the backend's errors, and with wait the write's error
 * (a copy that did not finish among them). */
int zd__ckptr_take(zd__ckptr_t *c, const struct zd__step_ctx *ctx, struct zd__model *m, int wait,
                   char *dir, size_t len, zd__err_t *err);

/* The worker of a rank registering a model it does not hold (a fresh model m, its arrays zeroed):
 * per the resume setting, loads the newest complete checkpoint whose parameter table matches m's
 * (world size and bucket size may differ); with ctx->resume_latest (the rank healed: every rank
 * of the world rolls back) the newest one even when resume is off. *loaded = 1 and m's state, step,
 * skipped steps and loss-scaler state are the checkpoint's; 0 when resume is off or, with "latest",
 * there is none yet. replace: the registration starts afresh. Collective at world size > 1,
 * whatever this rank wants: the ranks first compare what each registration asks (a rank that
 * resumes makes every rank load the newest checkpoint; resume and replace together are refused),
 * then check that all loaded the same step. Errors:
 * ZD_ECHECKPOINT (an explicit resume directory that does not load, ranks that loaded different
 * steps), -ENOMEM, -ETIMEDOUT (the copy to the state arrays, queued after the registration's
 * wait for its client, did not finish within the timeout; or the rank's previous checkpoint
 * write), the backend's errors. Every wait is bounded: the collectives by the collective
 * timeout, the copy and a previous write by the checkpoint timeout (reading the files is plain
 * file I/O). */
int zd__ckptr_resume(zd__ckptr_t *c, const struct zd__step_ctx *ctx, struct zd__model *m,
                     int replace, int *loaded, zd__err_t *err);

/* Any thread. */
void zd__ckptr_stats(zd__ckptr_t *c, zd__ckpt_stats_t *out);

/* The "checkpoint" section of the status (a zd__status_fn; ctx is the checkpointer). */
void zd__ckptr_status(void *ckptr, zd__status_t *st);

#endif /* ZD_DAEMON_CHECKPOINT_H */
