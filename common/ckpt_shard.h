/* A checkpoint's rank file: the safetensors file that holds one rank's shard of the optimizer
 * state, how it is named, written and checked. The manifest (ckpt_manifest.h) lists these files;
 * the resharding load (ckpt_load.h) reads them.
 *
 * rank-<r %05u>-of-<W %05u>.safetensors in the step directory <root>/step-<step %012llu>/ holds
 * one F32 tensor per state array the model has (common/state.h: every array that is not optional,
 * and the optional ones its groups need), named by the table ("master", "exp_avg", ...), each of
 * the rank's shard elements (padding included), back to back in the table's order; its
 * __metadata__ is format "zerod-shard", version "1", rank, world_size and step (strings). Which
 * arrays a checkpoint's files hold is the manifest's `states`; nothing here names an array.
 *
 * Errors: ZD_OK or a negative code with a message naming the file: -EBADMSG for a file that is
 * not what it must be, -EINVAL for a shard that cannot be written, -errno from the system.
 */
#ifndef ZD_COMMON_CKPT_SHARD_H
#define ZD_COMMON_CKPT_SHARD_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "state.h"

/* One rank file as the manifest lists it. */
typedef struct zd__ckpt_file {
  char name[64]; /* rank-00001-of-00002.safetensors: no path */
  uint32_t rank;
  uint64_t bytes;
  uint64_t xxh3; /* XXH3_64bits of the whole file */
} zd__ckpt_file_t;

/* One rank's optimizer state, as its shard arrays (elems = the layout's shard_elems). */
typedef struct zd__ckpt_shard {
  uint32_t rank, world_size;
  uint64_t step, elems;
  const float *state[ZD__NSTATES]; /* by zd__state_t; NULL: the model lacks that (optional) one */
} zd__ckpt_shard_t;

/* Where a rank file's tensors are: data_start plus off[s], in bytes, for each array s it holds. */
typedef struct zd__ckpt_shard_hdr {
  uint64_t data_start;
  uint64_t off[ZD__NSTATES];
} zd__ckpt_shard_hdr_t;

/* Writes "<root>/step-%012llu" into buf: ZD_OK, or -ENAMETOOLONG when it does not fit (no
 * message: the caller knows the root). */
int zd__ckpt_dir_name(const char *root, uint64_t step, char *buf, size_t len);

/* rank-<rank %05u>-of-<world_size %05u>.safetensors into buf (at least 64 bytes). */
void zd__ckpt_file_name(uint32_t rank, uint32_t world_size, char *buf, size_t len);

/* Creates dir if it is missing (its parent must exist), writes the shard's rank file atomically and
 * fills *out (name, rank, bytes, xxh3) for the manifest. Blocks for the whole write and the fsyncs;
 * the arrays are written from where they are, in chunks of 4 MiB or more, never copied.
 * throttle_bytes_per_s: 0 writes at full speed; otherwise the writer sleeps so that the file is
 * written no faster, in smaller chunks (a test knob: a kill then lands in the middle of the file).
 * -EINVAL for a rank outside the world, or a NULL array that is not optional. */
int zd__ckpt_write_shard(const char *dir, const zd__ckpt_shard_t *shard,
                         uint64_t throttle_bytes_per_s, zd__ckpt_file_t *out, zd__err_t *err);

/* Opens rank file f in dir and checks it without reading its data: its size must be f->bytes and
 * its header hold exactly the arrays in `states`, F32 tensors of elems elements filling the data,
 * with metadata naming this rank, world and step. On success *fd is open (close()) and *h says
 * where each tensor is. */
int zd__ckpt_shard_open(const char *dir, const zd__ckpt_file_t *f, uint32_t rank,
                        uint32_t world_size, uint64_t step, uint64_t elems, zd__states_t states,
                        int *fd, zd__ckpt_shard_hdr_t *h, zd__err_t *err);

#endif /* ZD_COMMON_CKPT_SHARD_H */
