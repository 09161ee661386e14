/* State snapshots (state_dir_mode = snapshot; config.h): the CUDA backend's state lives in device
 * memory, which dies with the process, so instead of mapped state files (state_file.h) each rank's
 * committed state is copied every state_snapshot_every_steps steps, and after the first step that
 * ends state_snapshot_every_s seconds after the last snapshot, into a file of state_dir:
 * "snapshot-rank<R>-of-<W>.zdbuddy", buddy copies' file format (snapfile.h), 0600, written as
 * "<name>.part" and renamed over the previous snapshot, which becomes "<name>.prev". Works on the
 * CPU backend too (how it is tested without a GPU).
 *
 * Every rank snapshots the same step: a rank asks for a snapshot by time, or says its previous
 * snapshot is still being written, with bits of its step record (step.c), OR-ed across the ranks
 * as the checkpoint's bit is; an every_steps-th step, or one some rank asked for, is snapshotted
 * by every rank unless some rank is busy, when every rank skips it (counted). The snapshot is the
 * backend's asynchronous snapshot op into pinned host staging (compute.h): the step waits only for
 * the copy to be queued (CUDA) or made (CPU); a writer thread per local rank waits for its fence,
 * checksums the data and writes the file.
 *
 * Recovery (zd__snapshot_resume, from the checkpointer's resume, before buddy copies): a rank reads
 * its snapshot files (the newest and the one before it); one that is corrupt, of another model,
 * world size or format version is renamed aside ("<name>.bad-<unix ms>") with a log line naming
 * the file and why. At world size > 1 the ranks all-gather what each can serve and take the newest
 * step every rank holds (a survivor whose state is newer goes back to it); at world size 1 the
 * newest. The backend's restore op copies it into the state. Where none serves, the checkpoint
 * fallback decides as without snapshots.
 *
 * Threads: the functions but the status writers run on a rank's worker; a writer thread per local
 * rank; a lock per rank. The settings and writers are the process's (one zerod per process). */
#ifndef ZD_STEP_SNAPSHOT_H
#define ZD_STEP_SNAPSHOT_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "model.h"
#include "status.h"

typedef struct zd__snapshot_settings {
  const char *dir;      /* state_dir */
  uint32_t every_steps; /* 0: none by steps */
  uint32_t every_s;     /* 0: none by time */
  uint32_t first_rank, local_ranks, world_size;
  int timeout_ms; /* bounds the writer's wait for a copy and the restore */
} zd__snapshot_settings_t;

/* Starts a writer thread per local rank. Errors: -ENOMEM, a thread that cannot start. Call once,
 * before the workers. */
int zd__snapshot_start(const zd__snapshot_settings_t *s, zd__err_t *err);

/* Stops the writers (a snapshot being written is finished first) and frees the staging. After the
 * workers are joined. */
void zd__snapshot_stop(void);

/* 1 when snapshots are on (zd__snapshot_start ran with a dir). */
int zd__snapshot_enabled(void);

/* The worker, building the record of step `step`: ZD__SNAPSHOT_WANT when this rank asks for a
 * snapshot of it (every_steps says so or every_s have passed), ZD__SNAPSHOT_BUSY when its previous
 * snapshot is still being written. */
#define ZD__SNAPSHOT_WANT 1
#define ZD__SNAPSHOT_BUSY 2
int zd__snapshot_wants(const zd__step_ctx_t *ctx, uint64_t step);

/* The worker, once the records of `step` are agreed (the OR of every rank's bits): every rank takes
 * the same decision. */
void zd__snapshot_agreed(const zd__step_ctx_t *ctx, uint64_t step, int asked, int busy);

/* After the committed step that zd__snapshot_agreed said is due: queues the backend's snapshot of
 * the state into the rank's staging and hands it to the writer. Never fails the step (a failure is
 * logged and in the status). */
void zd__snapshot_after_step(const zd__step_ctx_t *ctx, const zd__model_t *m);

/* The recovery (above): collective at world size > 1 when snapshots are on, a no-op otherwise.
 * *handled: m holds the agreed snapshot's step (resumed_from ZD__FROM_SNAPSHOT); else why (len
 * bytes) says why none served ("": none was there). Errors: the collective's, the backend's
 * restore. */
int zd__snapshot_resume(const zd__step_ctx_t *ctx, zd__model_t *m, int replace, int *handled,
                        char *why, size_t len, zd__err_t *err);

/* The model resumed at `step` from something else (a checkpoint, the state files, the client's
 * values): this rank's snapshot files of later steps are of a history the world left, and are
 * deleted (the worker's thread, after the resume succeeded). */
void zd__snapshot_resumed_elsewhere(const zd__step_ctx_t *ctx, uint64_t step);

/* A local rank's newest snapshot written (has 0: none yet). Any thread. */
typedef struct zd__snapshot_rank_status {
  int has;
  uint64_t step, age_ms, bytes, taken, skipped, failures, last_stall_us, last_write_ms;
  char error[200];
} zd__snapshot_rank_status_t;
void zd__snapshot_rank_status(uint32_t local_rank, zd__snapshot_rank_status_t *out);

/* The "snapshot" status section (zd__status_register; ctx unused). */
void zd__snapshot_status(void *ctx, zd__status_t *st);

#endif /* ZD_STEP_SNAPSHOT_H */
