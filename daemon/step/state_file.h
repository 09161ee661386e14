/* A rank's state file (state_dir, config.h): the CPU backend's two sets of state arrays and the
 * committed record (which set, of which step, the loss scaler), in one file on a memory file
 * system, mapped shared, so that the state outlives zerod: a zerod killed at any instant and
 * started again with the same state_dir serves the rank at the last committed step.
 *
 * The file (format version ZD__STATE_FILE_VERSION, little-endian, this machine's floats):
 *
 *   offset 0     header slot 0 (zd__state_slot_t, 128 bytes)
 *   offset 2048  header slot 1
 *   offset 4096  slot 0's lags, then slot 1's: per parameter of the model (layout order) a
 *                uint64 count of the steps applied that skipped it (model.h, lag), each array
 *                at a 4 KiB boundary; read only where its slot says some parameter lags
 *   then         the arrays the model has (common/state.h's table, in table order), set 0's then
 *                set 1's, each shard_elems floats, each starting at a 2 MiB boundary plus its
 *                colour (common/placement.h), so that a step's streams never alias
 *
 * A slot holds magic, version, sequence number, what the file is of (layout hash, world size,
 * rank, shard elements, the arrays, the parameters) and the committed record (with how many
 * parameters lag and the XXH3-64 of its lags array when some do), and ends with the XXH3-64 of
 * the bytes before it. The valid slot (magic, version and both checksums right) with the higher
 * sequence number is the committed one.
 *
 * Crash consistency (a killed process, not a lost machine): an update reads the committed set and
 * writes the other; only after every store of the update is done is the commit's single header
 * write made, into the slot that does not hold the newest record, with the sequence number one
 * higher. A kill before that write leaves the newest record naming the untouched set; a kill
 * during it leaves a slot whose checksum fails, and the other slot, the previous commit, names
 * the set the interrupted commit was to replace, which nothing wrote since (the next update
 * writes it only after this commit). A commit writes its slot's lags before the slot, so a kill
 * between the two leaves the old record of that slot with lags that fail its checksum: that slot
 * is not valid, and it is the commit before the previous one, which no rank needs (ranks are at
 * most one commit apart). The file is a tmpfs page cache: stores that ran are in it
 * whatever happens to the process, so no msync is needed; a reboot loses it all.
 *
 * Used by the rank's worker only (model.c); the status writer reads a few atomics.
 */
#ifndef ZD_DAEMON_STATE_FILE_H
#define ZD_DAEMON_STATE_FILE_H

#include <stdint.h>

#include "error.h"
#include "state.h"
#include "status.h"

/* 2: the lags of parameters skipped by a step (1 had none; a file of version 1 is set aside) */
#define ZD__STATE_FILE_VERSION 2u

/* The committed record. */
typedef struct zd__state_rec {
  uint32_t set; /* 0 or 1 */
  uint64_t step;
  uint64_t steps_skipped;
  int scaler_enabled;
  double scale;
  uint32_t growth_tracker;
  uint32_t hysteresis_tracker;
  /* Per parameter, the steps applied that skipped it (model.h, lag); NULL when none lags. In a
   * record the file gives, it points into the mapping: valid until the next commit. */
  const uint64_t *lags;
} zd__state_rec_t;

/* What a file is of: a file whose valid header says otherwise is another model's. */
typedef struct zd__state_file_key {
  uint64_t layout_hash;
  uint32_t world_size;
  uint32_t rank;
  uint64_t shard_elems;
  zd__states_t states;
  uint32_t nparams; /* the model's parameters: the length of the lags */
} zd__state_file_key_t;

typedef struct zd__state_file zd__state_file_t;

/* Checks state_dir at start-up: it exists (else it is created, 0700), is a directory owned by
 * zerod's user that no other user may enter or write (mode & 077 == 0), and is on tmpfs or ramfs
 * unless any_fs. Errors: ZD_ECONFIG naming the directory and the reason. */
int zd__state_dir_check(const char *dir, int any_fs, zd__err_t *err);

/* Opens the rank's file of key in dir (its name: "rank<R>-of-<W>-<layout hash>.zdstate"), creating
 * it (0600, its size reserved: ENOSPC here, not later) when there is none, and maps it: sets[k][s]
 * is array s of set k for every s in key->states (the others NULL). may_restore: when the file
 * holds a committed record of this key, *restored is the number of records it can serve and
 * rec[0..*restored) are they: rec[0] the newest commit, rec[1] (*restored = 2) the one before it
 * when its slot is valid too, whose set nothing wrote since as long as the model serves neither
 * (a world whose ranks are one commit apart goes back to it: checkpoint.c); otherwise (no file,
 * no record yet, or may_restore 0) the headers are cleared and *restored = 0. A file that cannot be
 * used (another format version, another model, a corrupt header, the wrong size, owner or mode)
 * is renamed aside to "<name>.bad-<unix ms>" with a log line naming the file and why, and a new
 * one is made. Errors: -errno of the file system with a message naming the file. */
int zd__state_file_open(const char *dir, const zd__state_file_key_t *key, int may_restore,
                        float *sets[2][ZD__NSTATES], zd__state_file_t **out, int *restored,
                        zd__state_rec_t *rec, zd__err_t *err);

/* The commit: writes rec (its lags into the slot's array first) into the older header slot,
 * after every store before it (the caller's and those of the threads it joined). */
void zd__state_file_commit(zd__state_file_t *f, const zd__state_rec_t *rec);

/* The records the open file holds now, as zd__state_file_open gives them: rec[0] its newest
 * commit and rec[1] the one before when that slot is still valid. Returns how many (0..2): 0 when
 * nothing was committed since the file was opened or reset. For a model kept across a world that
 * re-formed (rank.c), whose ranks agree again on the step they all hold. */
int zd__state_file_records(const zd__state_file_t *f, zd__state_rec_t rec[2]);

/* Forgets the file's records and zeroes its arrays, as a new file's: for a model that does not
 * take the state it was restored with. */
void zd__state_file_reset(zd__state_file_t *f);

/* The file's path, and the step its newest record commits (0 when none). */
const char *zd__state_file_path(const zd__state_file_t *f);
uint64_t zd__state_file_committed_step(const zd__state_file_t *f);

/* Unmaps the file and closes it; the file stays. Accepts NULL. */
void zd__state_file_close(zd__state_file_t *f);

/* Status writer (ctx: the state_dir string): a "state_file" section with state_dir and, for each
 * open file, its rank's path, committed step and size. */
void zd__state_file_status(void *ctx, zd__status_t *st);

#endif /* ZD_DAEMON_STATE_FILE_H */
