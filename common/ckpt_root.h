/* The checkpoints under a root directory: listing the step directories, choosing the newest
 * checkpoint that loads (a resume), and retention (pruning the older ones and crash leftovers).
 *
 * "Newest" means most recently written (the manifest's created_ms), not the highest step: a fresh
 * run in a directory that holds an older run's checkpoints resumes, and keeps, its own.
 *
 * Errors: ZD_OK or a negative code with a message: -ENOENT when there is no checkpoint to choose,
 * -errno from the system. No state is kept between calls; two processes pruning one root at once
 * is not supported.
 */
#ifndef ZD_COMMON_CKPT_ROOT_H
#define ZD_COMMON_CKPT_ROOT_H

#include <stddef.h>
#include <stdint.h>

#include "ckpt_manifest.h"
#include "error.h"
#include "layout.h"

/* The steps of the step-* directories under root, complete or not, newest first. *steps is
 * allocated (free(); NULL when *n is 0). A root that does not exist holds no checkpoint: ZD_OK,
 * *n = 0. */
int zd__ckpt_list(const char *root, uint64_t **steps, size_t *n, zd__err_t *err);

/* Called for each checkpoint zd__ckpt_find_latest passes over, with its directory and why. */
typedef void (*zd__ckpt_reject_fn)(void *ctx, const char *dir, const char *reason);

/* The newest checkpoint under root that is complete, verifies and, when want is not NULL, has
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

#endif /* ZD_COMMON_CKPT_ROOT_H */
