/* Checkpoint files: what a checkpoint directory holds on disk, written so that a crash at any
 * moment leaves either the previous complete checkpoint or a new complete one, and read back at any
 * world size (docs/design.md, "Durability and recovery").
 *
 * A checkpoint is the directory <root>/step-<step, %012llu>/ with one safetensors file per rank,
 * rank-<r %05u>-of-<W %05u>.safetensors (F32 tensors "master", "exp_avg" and "exp_avg_sq", and
 * "max_exp_avg_sq" for a model with amsgrad, each of the rank's shard elements, padding included;
 * __metadata__ format "zerod-shard", version, rank, world_size, step), and manifest.json, written
 * last: the step, the world and layout it was written at (parameter table, bucket size, hash), the
 * groups, dtypes, clipping and loss-scaler state, and each rank file's size and XXH3 checksum.
 * Every file is written under a ".tmp" name, fsynced, renamed and the directory fsynced, so a
 * checkpoint is complete exactly when its manifest exists, parses, and every file it lists has its
 * size and checksum.
 *
 * The manifest names no topology that a reader must share: zd__ckpt_load_shard fills a rank's
 * arrays for any world size and bucket size from the writer's layout. JSON is built and parsed
 * with jansson only, checksums are xxHash's XXH3_64bits only, so that other tools can check them.
 *
 * Errors: every function returns ZD_OK or a negative code with a message in err naming the file
 * and what was expected. -ENOENT: no manifest (an incomplete checkpoint) or no checkpoint at all;
 * -EBADMSG: a file whose content is not what it must be (malformed manifest, wrong size or
 * checksum, bad safetensors header); ZD_EVERSION: a format version this build does not read;
 * ZD_ELAYOUT: a parameter table that differs from the one asked for; other -errno values from the
 * system. None of these functions keeps state between calls: they are thread-safe as long as two
 * threads do not write the same file.
 */
#ifndef ZD_COMMON_CHECKPOINT_FORMAT_H
#define ZD_COMMON_CHECKPOINT_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "layout.h"
#include "zerod/zerod.h"

#define ZD__CKPT_VERSION  1
#define ZD__CKPT_MANIFEST "manifest.json"

/* One rank file as the manifest lists it. */
typedef struct zd__ckpt_file {
  char name[64]; /* rank-00001-of-00002.safetensors: no path */
  uint32_t rank;
  uint64_t bytes;
  uint64_t xxh3; /* XXH3_64bits of the whole file */
} zd__ckpt_file_t;

/* The dynamic loss scaler: its configuration and where it stands. */
typedef struct zd__ckpt_scaler {
  int enabled;
  zd_loss_scaler_t cfg;
  double scale;
  uint32_t growth_tracker, hysteresis_tracker;
} zd__ckpt_scaler_t;

typedef struct zd__ckpt_manifest {
  uint32_t version; /* ZD__CKPT_VERSION */
  uint64_t step, steps_skipped;
  uint32_t world_size;   /* the writer's */
  uint64_t bucket_elems; /* the writer's */
  uint64_t layout_hash;
  zd__layout_t *layout; /* owned by the manifest that zd__ckpt_read_manifest returns; the writer's
                           layout, rebuilt from the parameter table, world_size and bucket_elems */
  zd_group_t *groups;   /* owned, likewise */
  uint32_t ngroups;
  zd_dtype_t param_dtype, grad_dtype;
  double max_grad_norm;
  int grad_mean; /* 1: gradients averaged over the world (ZD_GRAD_MEAN); 0: summed */
  zd__ckpt_scaler_t scaler;
  int max_exp_avg_sq;     /* every rank file has the fourth tensor (amsgrad); 0 when absent */
  uint64_t created_ms;    /* unix time, milliseconds */
  zd__ckpt_file_t *files; /* owned, likewise; files[r] is rank r's */
  uint32_t nfiles;
} zd__ckpt_manifest_t;

/* One rank's optimizer state, as its shard arrays (elems = the layout's shard_elems). */
typedef struct zd__ckpt_shard {
  uint32_t rank, world_size;
  uint64_t step, elems;
  const float *master, *exp_avg, *exp_avg_sq;
  const float *max_exp_avg_sq; /* amsgrad's, or NULL: the model has none */
} zd__ckpt_shard_t;

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
 */
int zd__ckpt_write_shard(const char *dir, const zd__ckpt_shard_t *shard,
                         uint64_t throttle_bytes_per_s, zd__ckpt_file_t *out, zd__err_t *err);

/* Writes dir/manifest.json atomically: the last step of a checkpoint, once every rank file is
 * written (m->files: files[r] is rank r's, one per rank of the layout's world). The parameter
 * table, world size, bucket size and layout hash are taken from m->layout, which must be the layout
 * the shards were written with (m's own fields of those names are ignored); the version written is
 * ZD__CKPT_VERSION; created_ms 0 means now. Doubles are written with 17 significant digits: they
 * read back bit for bit. Fsyncs the file, dir and dir's parent: the checkpoint is durable on
 * return. -EINVAL for a manifest that could not be read back (a non-finite double, an invalid group
 * or dtype, a name that is not UTF-8, a file list that is not one file per rank). */
int zd__ckpt_write_manifest(const char *dir, const zd__ckpt_manifest_t *m, zd__err_t *err);

/* Reads dir/manifest.json and validates it: the format version, every field present and of its
 * type, dtypes and groups valid, one file per rank of world_size with its expected name, and the
 * layout rebuilt from the parameter table hashing to layout_hash with the offsets listed. *out is
 * allocated (zd__ckpt_manifest_free). -ENOENT when there is no manifest: the checkpoint is not
 * complete. Does not look at the rank files (zd__ckpt_verify does). */
int zd__ckpt_read_manifest(const char *dir, zd__ckpt_manifest_t **out, zd__err_t *err);

/* Frees a manifest from zd__ckpt_read_manifest; accepts NULL. */
void zd__ckpt_manifest_free(zd__ckpt_manifest_t *m);

/* Reads every rank file m lists: its size and XXH3 must be the manifest's ("rank-00001-of-00002.
 * safetensors: 4160 bytes, checksum 0x...; expected 4224 bytes, checksum 0x..."), and its
 * safetensors header must hold the three F32 tensors (four with max_exp_avg_sq: the manifest
 * says which) of that rank's shard elements, with the
 * manifest's rank, world size and step in its metadata. Blocks while it reads every byte. */
int zd__ckpt_verify(const char *dir, const zd__ckpt_manifest_t *m, zd__err_t *err);

/* Fills rank `rank`'s arrays for `layout`, of any world size and bucket size, from the checkpoint
 * in dir (m from zd__ckpt_read_manifest; verify first: this checks sizes and headers, not
 * checksums). layout's parameter table must be the manifest's (names, shapes and groups, in order),
 * else ZD_ELAYOUT naming the first difference. Each array holds layout->shard_elems floats;
 * padding elements are set to 0. Each parameter's element runs are mapped from the new rank's
 * slices to the writer's rank files and read with pread, neighbouring runs merged: a load at the
 * writer's topology is a few large reads per tensor. max_exp_avg_sq: NULL when the model has none
 * (a checkpoint's is then not read); otherwise the checkpoint must have it, else ZD_ECHECKPOINT:
 * torch's load_state_dict leaves such a state without the array and its next step raises, so
 * zerod refuses at once rather than start it at zero. */
int zd__ckpt_load_shard(const char *dir, const zd__ckpt_manifest_t *m, const zd__layout_t *layout,
                        uint32_t rank, float *master, float *exp_avg, float *exp_avg_sq,
                        float *max_exp_avg_sq, zd__err_t *err);

/* The steps of the step-* directories under root, complete or not, newest first. *steps is
 * allocated (free(); NULL when *n is 0). A root that does not exist holds no checkpoint: ZD_OK,
 * *n = 0. */
int zd__ckpt_list(const char *root, uint64_t **steps, size_t *n, zd__err_t *err);

/* Called for each checkpoint zd__ckpt_find_latest passes over, with its directory and why. */
typedef void (*zd__ckpt_reject_fn)(void *ctx, const char *dir, const char *reason);

/* "Newest" below means most recently written (the manifest's created_ms), not the highest step:
 * a fresh run in a directory that holds an older run's checkpoints resumes, and keeps, its own.
 *
 * The newest checkpoint under root that is complete, verifies and, when want is not NULL, has
 * want's parameter table (any world size). Each newer one passed over is reported to reject (may
 * be NULL) before the function returns. *dir_out (malloc'd) and *m_out (zd__ckpt_manifest_free)
 * are set on success. -ENOENT when there is none. Blocks while it verifies: each candidate is read
 * in full. */
int zd__ckpt_find_latest(const char *root, const zd__layout_t *want, zd__ckpt_reject_fn reject,
                         void *ctx, char **dir_out, zd__ckpt_manifest_t **m_out, zd__err_t *err);

/* Retention: keeps the `keep` newest complete checkpoints (those with a manifest that reads) and
 * removes the older complete ones, and the incomplete directories at a lower step than the newest
 * complete one (crash leftovers; never a higher one: it may be being written). keep 0 removes
 * nothing. A manifest is removed first, so a removal cut short leaves an incomplete directory,
 * never a checkpoint that looks complete and is not. */
int zd__ckpt_prune(const char *root, uint32_t keep, zd__err_t *err);

/* Exports the checkpoint in dir (verified first) as one safetensors file at out_path: an F32 tensor
 * per parameter with its name and shape, its master weights; with moments also "<name>.exp_avg" and
 * "<name>.exp_avg_sq", and "<name>.max_exp_avg_sq" when the checkpoint has it (amsgrad). Metadata:
 * format "pt" (what Hugging Face loaders require), zerod_format "zerod-export", step,
 * steps_skipped, world_size, layout_hash, the groups and each parameter's group (JSON strings).
 * Written atomically (.tmp, fsync, rename, fsync of the directory). */
int zd__ckpt_export(const char *dir, const char *out_path, int moments, zd__err_t *err);

/* Imports optimizer state from elsewhere (a torch optimizer, through the Python client's
 * zerod.checkpoint.save_torch_state): reads the safetensors file at in_path and writes a complete
 * checkpoint of world size 1 (default bucket size) under root, which any world size resumes
 * (resharding). root is created if it is missing (its parent must exist); the checkpoint's
 * directory goes into dir_out (dir_len bytes). Blocks for the read, the write and a verification
 * of what was written; holds every parameter's arrays in memory (12 or 16 bytes per element).
 *
 * The file: for each parameter an F32 tensor "<name>" (its fp32 master weights, with its shape),
 * "<name>.exp_avg" and "<name>.exp_avg_sq" (same shape), for every parameter or none also
 * "<name>.max_exp_avg_sq" (amsgrad; the checkpoint then has it), and no other tensor. Metadata
 * (strings, as safetensors requires): zerod_format "zerod-torch-state" or "zerod-export" (a zeroctl
 * export with moments "1": a checkpoint goes back in unchanged), zerod_version "1", step (the Adam
 * steps applied: zerod's next step is step + 1), steps_skipped (optional, default 0), groups (JSON:
 * an array of groups as the manifest writes them: every field of zd_group_t by its C name), params
 * (JSON: the parameter names in registration order; optional in an export, whose master tensors
 * are then taken in the order of their data) and param_groups (JSON: each parameter's group, in
 * that order). The manifest's dtypes are f32, max_grad_norm 0, gradients averaged and no loss
 * scaler: a resume takes those from the registration, not from the checkpoint.
 *
 * Errors: -EBADMSG naming the file and what it lacks (not safetensors, a tensor missing, of
 * another dtype or shape, outside the data, a tensor that is no parameter's, malformed metadata);
 * ZD_EVERSION for a zerod_version other than "1"; -EEXIST when root already holds a complete
 * checkpoint of that step; the layout's errors (-EINVAL, ZD_EGROUP: bad names, groups); the
 * writer's. On an error before the manifest nothing complete is left behind. */
int zd__ckpt_import(const char *in_path, const char *root, char *dir_out, size_t dir_len,
                    zd__err_t *err);

#endif /* ZD_COMMON_CHECKPOINT_FORMAT_H */
