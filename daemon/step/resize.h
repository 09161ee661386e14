/* Live resize (docs/design.md, "Live resize"): a running world of W ranks becomes one of W' ranks
 * without a checkpoint file. After the step the ranks agreed to resize at (RESIZE_BIT in the step
 * record, step.c), every rank of the old world takes an image of the whole model: its shard of
 * every state array, all-gathered over the old communicator (zd__resize_take), with the step, the
 * steps skipped, the loss scaler and the per-parameter lags. The ranks of the new world keep their
 * image across the world's re-forming at the new size; a rank beyond it leaves. At the first
 * registration in the new world (zd__model_attach) every rank builds its model for the new layout
 * from the image (zd__resize_load): a rank that holds one contributes each array's full new layout,
 * the others -0.0f, to a reduce-scatter whose fp32 sum leaves every rank its new shard bit for bit
 * (x + -0.0f == x for every x), so zerods that joined empty (a grown world) get their shard too;
 * where every rank holds an image (a shrunk world) each takes its shard from its own, no transfer.
 */
#ifndef ZD_STEP_RESIZE_H
#define ZD_STEP_RESIZE_H

#include <stdint.h>

#include "error.h"
#include "layout.h"
#include "model.h"

typedef struct zd__resize_image {
  zd__layout_t *layout; /* the old world's layout (a copy: the model is gone) */
  zd__states_t states;  /* the arrays in full, in table order */
  uint32_t count;
  float *full;    /* count arrays of layout->world_size * layout->shard_elems elements */
  uint64_t *lags; /* layout->nparams */
  uint64_t step, steps_skipped;
  zd__scaler_t scaler;
  uint32_t from, to; /* world sizes */
} zd__resize_image_t;

/* Collective over the old world (every rank, after the same step): the image of m. m is left as
 * it was. Errors: -ENOMEM, the backend's snapshot, the communicator's. */
int zd__resize_take(const zd__step_ctx_t *ctx, const zd__model_t *m, uint32_t to,
                    zd__resize_image_t **out, zd__err_t *err);

/* Whether `l` (a registration's layout in the new world) has the image's parameter table: same
 * names, shapes and groups in order. 0 with the first difference in buf. */
int zd__resize_matches(const zd__resize_image_t *img, const zd__layout_t *l, char *buf, size_t len);

/* Collective over the new world (every rank's first registration after the resize, once the ranks
 * agreed that some rank holds an image): a model for spec whose state is the image's, resharded to
 * this rank's slice of spec's layout; img NULL on a rank that holds none (a zerod that joined a
 * grown world). The client's param buffer slice is written from the master weights, as a resume
 * writes it. Errors: -ENOMEM, the backend's, the communicator's. */
int zd__resize_load(const zd__step_ctx_t *ctx, const zd__resize_image_t *img,
                    zd__model_spec_t *spec, const zd__buffers_t *buf, zd__model_t **out,
                    zd__err_t *err);

void zd__resize_image_free(zd__resize_image_t *img);

#endif /* ZD_STEP_RESIZE_H */
