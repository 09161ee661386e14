/* Reading a checkpoint's rank files: verification against the manifest, the resharding load of
 * one rank's shard at any world size and bucket size, and reading a parameter's elements (exports).
 *
 * The manifest's layout is the writer's; a reader's layout may differ in world size and bucket
 * size but not in its parameter table. Each parameter's elements are mapped from the reader's
 * slices to (rank file, position) in the writer's layout and read with pread, neighbouring runs
 * merged: a load at the writer's topology is a few large reads per tensor.
 *
 * Errors: ZD_OK or a negative code with a message naming the file: -EBADMSG for a file that is not
 * what the manifest says (size, checksum, header), ZD_ELAYOUT for a parameter table that differs,
 * ZD_ECHECKPOINT for a checkpoint without an array the model has, -errno from the system. No
 * state is kept between calls but a reader's, which one thread uses at a time.
 */
#ifndef ZD_COMMON_CKPT_LOAD_H
#define ZD_COMMON_CKPT_LOAD_H

#include <stddef.h>
#include <stdint.h>

#include "ckpt_manifest.h"
#include "error.h"
#include "layout.h"
#include "state.h"

/* Reads every rank file m lists: its size and XXH3 must be the manifest's ("rank-00001-of-00002.
 * safetensors: 4160 bytes, checksum 0x...; expected 4224 bytes, checksum 0x..."), and its
 * safetensors header must hold one F32 tensor of that rank's shard elements per array in
 * m->states and no other, with the manifest's rank, world size and step in its metadata. Blocks
 * while it reads every byte. */
int zd__ckpt_verify(const char *dir, const zd__ckpt_manifest_t *m, zd__err_t *err);

/* Fills rank `rank`'s arrays for `layout`, of any world size and bucket size, from the checkpoint
 * in dir (m from zd__ckpt_read_manifest; verify first: this checks sizes and headers, not
 * checksums). layout's parameter table must be the manifest's (names, shapes and groups, in order),
 * else ZD_ELAYOUT naming the first difference. state[s] is where array s goes (zd__state_t), of
 * layout->shard_elems floats; padding elements are set to 0. NULL for an array the model lacks
 * (only an optional one may be: -EINVAL otherwise): the checkpoint's is then not read. An array
 * the model has must be in the checkpoint, else ZD_ECHECKPOINT naming it: torch's
 * load_state_dict leaves such a state without the array and its next step raises, so zerod
 * refuses at once rather than start it at zero. */
int zd__ckpt_load_shard(const char *dir, const zd__ckpt_manifest_t *m, const zd__layout_t *layout,
                        uint32_t rank, float *state[ZD__NSTATES], zd__err_t *err);

/* Whether a and b have the same parameter table (names, shapes, groups, in order); if not, the
 * first difference goes into buf. World size and bucket size may differ. */
int zd__ckpt_same_params(const zd__layout_t *a, const zd__layout_t *b, char *buf, size_t len);

/* A checkpoint's rank files, opened as reads first need them (zd__ckpt_reader_close). m must
 * outlive the reader. -ENOMEM. */
typedef struct zd__ckpt_reader zd__ckpt_reader_t;
int zd__ckpt_reader_open(const char *dir, const zd__ckpt_manifest_t *m, zd__ckpt_reader_t **out,
                         zd__err_t *err);

/* Reads elements [first, first + n) of parameter p's array t (one of the manifest's states) into
 * dst, from whichever rank files hold them. Sizes and headers are checked as files are opened;
 * checksums are not (verify first). */
int zd__ckpt_reader_param(zd__ckpt_reader_t *r, zd__state_t t, uint32_t p, uint64_t first,
                          uint64_t n, float *dst, zd__err_t *err);

/* Closes the reader's files and frees it; accepts NULL. */
void zd__ckpt_reader_close(zd__ckpt_reader_t *r);

#endif /* ZD_COMMON_CKPT_LOAD_H */
