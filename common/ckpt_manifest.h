/* The manifest of a checkpoint: <step directory>/manifest.json, written last, so that a checkpoint
 * is complete exactly when its manifest exists, parses, and every rank file it lists has its size
 * and checksum (checkpoint_format.h).
 *
 * It holds the step, the world and layout the checkpoint was written at (parameter table, bucket
 * size, hash), the groups, dtypes, clipping and loss-scaler state, which optional state arrays the
 * rank files hold (each as "<name>": true, by common/state.h's table), and each rank file's size
 * and XXH3 checksum. It names no topology a reader must
 * share: the layout it rebuilds is the writer's, which the resharding load maps from. JSON is
 * built and parsed with jansson only, so that other tools read it; a parameter group's JSON (every
 * field of zd_group_t by its C name) is the same in exports and imports, and is built here.
 *
 * Errors: ZD_OK or a negative code with a message naming the file and the field. -ENOENT: no
 * manifest (an incomplete checkpoint); -EBADMSG: a manifest that is not what it must be;
 * ZD_EVERSION: a format version this build does not read; -EINVAL: a manifest that could not be
 * read back; other -errno values from the system. No state is kept between calls.
 */
#ifndef ZD_COMMON_CKPT_MANIFEST_H
#define ZD_COMMON_CKPT_MANIFEST_H

#include <stdint.h>

#include "ckpt_shard.h"
#include "error.h"
#include "layout.h"
#include "state.h"
#include "zerod/zerod.h"

#define ZD__CKPT_VERSION  1
#define ZD__CKPT_MANIFEST "manifest.json"

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
  zd__states_t states;    /* the arrays every rank file holds: zd__states_always() and those
                             the model's optimizers kept */
  uint64_t created_ms;    /* unix time, milliseconds */
  zd__ckpt_file_t *files; /* owned, likewise; files[r] is rank r's */
  uint32_t nfiles;
  /* Per parameter (the layout's order): the steps that skipped it (no gradient), so that its own
   * step count (torch's state['step']) is step - lags[i]; written as the parameter's
   * "steps_behind" where nonzero. NULL: every parameter at step (also what a manifest without the
   * field reads as). Owned by the manifest that zd__ckpt_read_manifest returns. */
  uint64_t *lags;
} zd__ckpt_manifest_t;

/* Writes dir/manifest.json atomically: the last step of a checkpoint, once every rank file is
 * written (m->files: files[r] is rank r's, one per rank of the layout's world). The parameter
 * table, world size, bucket size and layout hash are taken from m->layout, which must be the layout
 * the shards were written with (m's own fields of those names are ignored); the version written is
 * ZD__CKPT_VERSION; created_ms 0 means now. Doubles are written with 17 significant digits: they
 * read back bit for bit. Fsyncs the file, dir and dir's parent: the checkpoint is durable on
 * return. -EINVAL for a manifest that could not be read back (a non-finite double, an invalid group
 * or dtype, a name that is not UTF-8, a file list that is not one file per rank, states without
 * an array every model has). */
int zd__ckpt_write_manifest(const char *dir, const zd__ckpt_manifest_t *m, zd__err_t *err);

/* Reads dir/manifest.json and validates it: the format version, every field present and of its
 * type, dtypes and groups valid, one file per rank of world_size with its expected name, and the
 * layout rebuilt from the parameter table hashing to layout_hash with the offsets listed. *out is
 * allocated (zd__ckpt_manifest_free). -ENOENT when there is no manifest: the checkpoint is not
 * complete. Does not look at the rank files (zd__ckpt_verify does). */
int zd__ckpt_read_manifest(const char *dir, zd__ckpt_manifest_t **out, zd__err_t *err);

/* Frees a manifest from zd__ckpt_read_manifest; accepts NULL. */
void zd__ckpt_manifest_free(zd__ckpt_manifest_t *m);

/* A 64-bit hash as the manifest writes it: 16 lowercase hex digits. */
void zd__ckpt_hex64(uint64_t v, char buf[17]);

/* Group g as a JSON object (jansson's json_t; json_decref), every field of zd_group_t by its C
 * name; NULL when out of memory. */
struct json_t *zd__ckpt_group_json(const zd_group_t *g);

/* Reads group `index` of file `path` from its JSON object o into *g and validates it: -EBADMSG
 * naming path and the field for a missing field or one of the wrong type, a field this build does
 * not know, or an invalid value. A field that came later than the first version may be missing
 * and takes its default. */
int zd__ckpt_group_read(const char *path, struct json_t *o, uint32_t index, zd_group_t *g,
                        zd__err_t *err);

#endif /* ZD_COMMON_CKPT_MANIFEST_H */
