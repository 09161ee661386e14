/* Checkpoint files: what a checkpoint directory holds on disk, written so that a crash at any
 * moment leaves either the previous complete checkpoint or a new complete one, and read back at any
 * world size (docs/design.md, "Checkpoints").
 *
 * A checkpoint is the directory <root>/step-<step, %012llu>/ with one safetensors file per rank,
 * rank-<r %05u>-of-<W %05u>.safetensors (an F32 tensor per state array the model has, named by
 * common/state.h's table: today "master", "exp_avg", "exp_avg_sq", and "max_exp_avg_sq" for a
 * model with amsgrad; each of the rank's shard elements, padding included; __metadata__ format
 * "zerod-shard", version, rank, world_size, step), and manifest.json, written last: the step, the
 * world and layout it was written at (parameter table, bucket size, hash), the groups, dtypes,
 * clipping and loss-scaler state, the optional arrays the rank files hold (each as "<name>": true,
 * today only "max_exp_avg_sq"), and each rank file's size and XXH3 checksum.
 * Every file is written under a ".tmp" name, fsynced, renamed and the directory fsynced, so a
 * checkpoint is complete exactly when its manifest exists, parses, and every file it lists has its
 * size and checksum. JSON is built and parsed with jansson only, checksums are xxHash's
 * XXH3_64bits only, so that other tools can check them.
 *
 * This header is the whole of it for a caller that takes checkpoints or reads them offline (the
 * daemon's checkpointer, zeroctl); each part is a module of its own, which a caller that needs one
 * part includes instead:
 *   ckpt_shard.h     a rank file: its name, its atomic write, its header check
 *   ckpt_manifest.h  the manifest: written last, read back with every field checked
 *   ckpt_load.h      verification, and the resharding load of a rank's shard at any world size
 *   ckpt_root.h      the checkpoints under a root: listing, the newest that loads, retention
 *   ckpt_interop.h   export to one safetensors file of whole parameters, and import from one
 * Below them, ckpt_file.h (whole reads and writes, atomic files) and safetensors.h (the header of
 * a safetensors file) are the modules' own plumbing.
 *
 * Errors, in every module: ZD_OK or a negative code with a message in err naming the file and what
 * was expected. -ENOENT: no manifest (an incomplete checkpoint) or no checkpoint at all; -EBADMSG:
 * a file whose content is not what it must be (malformed manifest, wrong size or checksum, bad
 * safetensors header); ZD_EVERSION: a format version this build does not read; ZD_ELAYOUT: a
 * parameter table that differs from the one asked for; other -errno values from the system. None
 * of these functions keeps state between calls: they are thread-safe as long as two threads do not
 * write the same file.
 */
#ifndef ZD_COMMON_CHECKPOINT_FORMAT_H
#define ZD_COMMON_CHECKPOINT_FORMAT_H

#include "ckpt_interop.h"
#include "ckpt_load.h"
#include "ckpt_manifest.h"
#include "ckpt_root.h"
#include "ckpt_shard.h"

#endif /* ZD_COMMON_CHECKPOINT_FORMAT_H */
