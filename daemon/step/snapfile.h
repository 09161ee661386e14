/* The file of a shard's state copy, shared by buddy copies held in a state_dir (buddy.h,
 * "buddy-rank<R>-of-<W>.zdbuddy") and the state snapshots of state_dir_mode = snapshot
 * (snapshot.h, "snapshot-rank<R>-of-<W>.zdbuddy"): a header of ZD__SNAPFILE_HDR_BYTES, then the
 * data: the state arrays the model has (states, in role order, shard_elems floats each), then
 * nlags uint64 per-parameter step lags (zd__model_t.lag; 0 when no parameter lags). Little-endian,
 * this machine's floats, as state files. The header ends with the XXH3-64 of the bytes before it;
 * checksum is the XXH3-64 of the data.
 *
 * Version 2: the data holds the per-parameter lags after the arrays, nlags in the header. A file
 * of another version is set aside (its reason names both versions). */
#ifndef ZD_STEP_SNAPFILE_H
#define ZD_STEP_SNAPFILE_H

#include <stddef.h>
#include <stdint.h>

#define ZD__SNAPFILE_MAGIC     0x3159444455424458ull /* "XDBUDDY1" */
#define ZD__SNAPFILE_VERSION   2u
#define ZD__SNAPFILE_HDR_BYTES 4096u
/* A copy larger than this is refused: a peer or a file cannot make zerod allocate without bound. */
#define ZD__SNAPFILE_MAX_BYTES (1ull << 40)
#define ZD__SNAPFILE_MAX_LAGS  (1u << 28) /* parameters of a model, far above any layout's */

typedef struct zd__snapfile_hdr {
  uint64_t magic;
  uint32_t version, rank, world_size, states;
  uint64_t layout_hash, step, steps_skipped, shard_elems, bytes;
  uint32_t scaler_enabled, growth_tracker, hysteresis_tracker, nlags;
  double scale;
  uint64_t taken_unix_ms, checksum, complete_unix_ms;
  char from[256];
  uint64_t hdr_sum; /* XXH3-64 of the bytes before it */
} zd__snapfile_hdr_t;
_Static_assert(sizeof(zd__snapfile_hdr_t) <= ZD__SNAPFILE_HDR_BYTES,
               "a copy's header fits before its data");

/* The data's bytes: the arrays of `states` (a mask of common/state.h's roles), then the lags. */
uint64_t zd__snapfile_arrays_bytes(uint32_t states, uint64_t shard_elems);
uint64_t zd__snapfile_data_bytes(uint32_t states, uint64_t shard_elems, uint64_t nlags);

/* Sets magic, version and hdr_sum. */
void zd__snapfile_seal(zd__snapfile_hdr_t *h);

/* Checks the open file fd as the copy of (rank, world_size): a regular file of this user, mode
 * without group or other bits, a whole header of this version whose checksum holds, of that rank
 * and world size, whose size is the header's plus its data. 0 with *h read; else -1 and why
 * (len bytes) says what is wrong. The data's checksum is not read here. */
int zd__snapfile_check(int fd, uint32_t rank, uint32_t world_size, zd__snapfile_hdr_t *h, char *why,
                       size_t len);

/* Renames path aside to "<path>.bad-<unix ms>" with an error log line naming what (e.g. "buddy
 * copy file"), the file and why; never deletes it. */
void zd__snapfile_set_aside(const char *what, const char *path, const char *why);

#endif /* ZD_STEP_SNAPFILE_H */
