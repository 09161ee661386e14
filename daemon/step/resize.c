/* Live resize (resize.h): the image of a model taken over the old world, and the model built from
 * it in the new one. */
#include "resize.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compute.h"
#include "log.h"

/* How long a snapshot or restore of the state may take (the CPU backend's are done on return). */
#define RESIZE_COPY_TIMEOUT_MS 600000

void zd__resize_image_free(zd__resize_image_t *img) {
  if (!img) return;
  zd__layout_free(img->layout);
  free(img->full);
  free(img->lags);
  free(img);
}

int zd__resize_take(const zd__step_ctx_t *ctx, const zd__model_t *m, uint32_t to,
                    zd__resize_image_t **out, zd__err_t *err) {
  *out = NULL;
  zd__compute_t *c = ctx->compute;
  const uint32_t w = ctx->world_size;
  const uint64_t hs = m->layout->shard_elems;
  float *src[ZD__NSTATES];
  void *mine = NULL, *fence = NULL;
  int stuck = 0; /* a copy that did not finish may still use its host memory: leak it */
  zd__resize_image_t *img = calloc(1, sizeof *img);
  if (!img) return zd__errf(err, -ENOMEM, "out of memory for the resize image");
  img->states = m->states;
  img->count = zd__model_arrays(m, m->states, src);
  img->step = m->step;
  img->steps_skipped = m->steps_skipped;
  img->scaler = m->scaler;
  img->from = w;
  img->to = to;
  img->full = malloc((size_t)img->count * w * (hs ? hs : 1) * sizeof(float));
  img->lags = calloc(m->layout->nparams ? m->layout->nparams : 1, sizeof *img->lags);
  int rc = img->full && img->lags ? zd__model_layout_copy(m->layout, &img->layout, err)
                                  : zd__errf(err, -ENOMEM, "out of memory for the resize image");
  if (!rc)
    rc = c->ops->host_alloc(c, (size_t)img->count * (hs ? hs : 1) * sizeof(float), &mine, err);
  if (rc) goto exit;
  for (uint32_t i = 0; i < m->layout->nparams; i++) img->lags[i] = m->lag[i];
  rc = c->ops->snapshot(c, src, img->count, hs, mine, &fence, err);
  if (!rc) rc = zd__model_snapshot_wait(c, fence, RESIZE_COPY_TIMEOUT_MS, err);
  if (rc) {
    stuck = 1;
    goto exit;
  }
  for (uint32_t k = 0; k < img->count && !rc; k++)
    rc = ctx->comm->ops->allgather_bytes(ctx->comm, (float *)mine + k * hs, hs * sizeof(float),
                                         img->full + (size_t)k * w * hs, err);
exit:
  if (!stuck) c->ops->host_free(mine);
  if (rc) {
    zd__resize_image_free(img);
    return rc;
  }
  *out = img;
  return ZD_OK;
}

int zd__resize_matches(const zd__resize_image_t *img, const zd__layout_t *l, char *buf,
                       size_t len) {
  const zd__layout_t *h = img->layout;
  if (h->nparams != l->nparams) {
    snprintf(buf, len,
             "the world was resized holding a model of %u parameters, the registration has %u",
             h->nparams, l->nparams);
    return 0;
  }
  for (uint32_t i = 0; i < h->nparams; i++) {
    const zd__layout_param_t *a = &h->params[i], *b = &l->params[i];
    int same = strcmp(a->name, b->name) == 0 && a->ndim == b->ndim && a->group == b->group;
    for (uint32_t d = 0; same && d < a->ndim; d++) same = a->shape[d] == b->shape[d];
    if (!same) {
      snprintf(buf, len,
               "parameter %u: '%s' held across the resize, '%s' registered (the registration "
               "after a resize carries the same model)",
               i, a->name, b->name);
      return 0;
    }
  }
  return 1;
}

/* What each rank of the new world tells the others before the transfer. */
typedef struct {
  uint32_t has; /* holds an image */
  uint32_t states;
  uint64_t step, steps_skipped;
  double scale;
  uint32_t growth_tracker, hysteresis_tracker;
  uint32_t scaler_enabled, pad;
} header_t;

int zd__resize_load(const zd__step_ctx_t *ctx, const zd__resize_image_t *img,
                    zd__model_spec_t *spec, const zd__buffers_t *buf, zd__model_t **out,
                    zd__err_t *err) {
  *out = NULL;
  zd__compute_t *c = ctx->compute;
  zd__comm_t *comm = ctx->comm;
  const uint32_t w = ctx->world_size;
  const uint32_t np = spec->layout->nparams;
  zd__model_t *m = NULL;
  void *stage = NULL, *fence = NULL;
  float *send = NULL, *scratch = NULL;
  uint64_t *lags = NULL, *all_lags = NULL;
  int stuck = 0;
  header_t mine = {0}, *all = calloc(w, sizeof *all);
  if (img)
    mine = (header_t){.has = 1,
                      .states = img->states,
                      .step = img->step,
                      .steps_skipped = img->steps_skipped,
                      .scale = img->scaler.scale,
                      .growth_tracker = img->scaler.growth_tracker,
                      .hysteresis_tracker = img->scaler.hysteresis_tracker,
                      .scaler_enabled = img->scaler.enabled};
  lags = calloc(np ? np : 1, sizeof *lags);
  all_lags = calloc((size_t)w * (np ? np : 1), sizeof *all_lags);
  int rc = all && lags && all_lags ? ZD_OK : zd__errf(err, -ENOMEM, "out of memory");
  if (rc) goto exit;
  if (img)
    for (uint32_t i = 0; i < np; i++) lags[i] = img->lags[i];
  /* Every rank takes part in every collective below, whatever failed locally before them. */
  rc = comm->ops->allgather_bytes(comm, &mine, sizeof mine, all, err);
  if (!rc) rc = comm->ops->allgather_bytes(comm, lags, (np ? np : 1) * sizeof *lags, all_lags, err);
  if (rc) goto exit;
  uint32_t holder = w, holders = 0;
  for (uint32_t r = 0; r < w; r++) {
    if (all[r].has && holder == w) holder = r;
    holders += all[r].has != 0;
  }
  /* A shrunk world: every rank holds the whole state and takes its shard from its own image. */
  const int local = holders == w;
  if (holder == w) {
    rc = zd__errf(err, ZD_EORDER, "no rank holds the resized world's state");
    goto exit;
  }
  const header_t *h = &all[holder];
  int replace = spec->replace;
  spec->replace = 1; /* a state file starts afresh for the new layout */
  rc = zd__model_create(ctx, spec, &m, err);
  spec->replace = replace;
  if (rc) goto exit;
  zd__model_configure(m, spec, 0);
  rc = c->ops->exchange(c, &m->shard, buf, 0, err);
  if (rc) goto exit;
  float *dst[ZD__NSTATES];
  const uint32_t ncount = zd__model_arrays(m, m->states, dst);
  const uint64_t ns = m->layout->shard_elems;
  rc = c->ops->host_alloc(c, (size_t)ncount * (ns ? ns : 1) * sizeof(float), &stage, err);
  if (!rc) {
    send = malloc((size_t)w * (ns ? ns : 1) * sizeof(float));
    scratch = malloc((ns ? ns : 1) * sizeof(float));
    if (!send || !scratch) rc = zd__errf(err, -ENOMEM, "out of memory for the resize transfer");
  }
  if (rc) goto exit;
  rc = c->ops->snapshot(c, dst, ncount, ns, stage, &fence, err);
  if (!rc) rc = zd__model_snapshot_wait(c, fence, RESIZE_COPY_TIMEOUT_MS, err);
  if (rc) {
    stuck = 1;
    goto exit;
  }
  const zd__states_t common = m->states & (zd__states_t)h->states;
  for (int s = 0; s < ZD__NSTATES && !rc; s++) {
    if (!(common & ZD__STATE_BIT(s))) continue; /* the model's own start (zeros, the client's) */
    float *slot = (float *)stage + (size_t)zd__model_array_index(m->states, s) * ns;
    if (local) {
      memset(slot, 0, ns * sizeof(float));
      zd__model_carry(img->layout, m->layout, ctx->rank,
                      img->full + (size_t)zd__model_array_index(img->states, s) * img->from *
                                      img->layout->shard_elems,
                      slot);
      continue;
    }
    /* The holder writes every rank's new shard of the array; the others add -0.0f, which leaves
     * each value as it is bit for bit (Gloo sums in fp32). */
    if (img && ctx->rank == holder) {
      const float *full = img->full + (size_t)zd__model_array_index(img->states, s) * img->from *
                                          img->layout->shard_elems;
      memset(send, 0, (size_t)w * ns * sizeof(float));
      for (uint32_t r = 0; r < w; r++)
        zd__model_carry(img->layout, m->layout, r, full, send + (size_t)r * ns);
    } else {
      for (uint64_t i = 0; i < (uint64_t)w * ns; i++) send[i] = -0.0f;
    }
    const void *shard = NULL;
    zd_dtype_t sdt = ZD_F32;
    rc = comm->ops->reduce_scatter(comm, (uint32_t)s, send, ZD_F32, ns, scratch, &shard, &sdt, err);
    if (!rc && sdt != ZD_F32)
      rc = zd__errf(err, ZD_EBACKEND, "the resize transfer needs an fp32 reduce-scatter");
    if (!rc) memcpy(slot, shard, ns * sizeof(float));
  }
  if (rc) goto exit;
  rc = c->ops->restore(c, dst, ncount, ns, stage, RESIZE_COPY_TIMEOUT_MS, err);
  if (rc) {
    stuck = 1;
    goto exit;
  }
  rc = c->ops->exchange(c, &m->shard, buf, 1, err);
  if (rc) goto exit;
  m->step = h->step;
  m->steps_skipped = h->steps_skipped;
  if (h->scaler_enabled && m->scaler.enabled) {
    m->scaler.scale = h->scale;
    m->scaler.growth_tracker = h->growth_tracker;
    m->scaler.hysteresis_tracker = h->hysteresis_tracker;
  }
  zd__model_set_lags(m, all_lags + (size_t)holder * (np ? np : 1));
  zd__model_commit(m, 0);
  m->resumed_from = ZD__FROM_RESIZE;
  ZD_LOG_INFO("rank %u of %u: model carried across the resize at step %" PRIu64
              " (%s; rank %u held the whole state)",
              ctx->rank, w, m->step,
              local ? "from this rank's image"
              : img ? "sent from the image"
                    : "joined empty",
              holder);
  *out = m;
  m = NULL;
exit:
  zd__model_free(m);
  if (!stuck) c->ops->host_free(stage);
  free(send);
  free(scratch);
  free(lags);
  free(all_lags);
  free(all);
  return rc;
}
