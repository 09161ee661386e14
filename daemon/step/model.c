/* A rank's model (model.h): its creation from a registration, its state arrays by the table,
 * its options, and its end. */
#include "model.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

void zd__model_spec_free(zd__model_spec_t *spec) {
  if (!spec) return;
  zd__layout_free(spec->layout);
  free(spec->groups);
  free(spec);
}

/* The model's state arrays are those its groups need at registration (common/state.h), kept for
 * its life: torch creates an optimizer's state at a parameter's first step (max_exp_avg_sq under
 * amsgrad) and raises KeyError when a group asks for one later, so hyperparameters that need an
 * array the model lacks are refused likewise. */
int zd__model_check_states(const zd__model_t *m, const zd_group_t *groups, const char *what,
                           zd__err_t *err) {
  for (uint32_t i = 0; i < m->shard.ngroups; i++) {
    int lack = zd__states_missing(m->states, &groups[i], 1);
    if (lack >= 0)
      return zd__errf(err, ZD_EHPARAM,
                      "%s: group %u needs the state array %s, but the model was registered "
                      "without it and has none (torch raises KeyError likewise); register with "
                      "replace and that group's options from the start",
                      what, i, zd__state_name((zd__state_t)lack));
  }
  return ZD_OK;
}

void zd__model_free(zd__model_t *m) {
  if (!m) return;
  zd__shard_t *sh = &m->shard;
  zd__compute_t *c = m->compute;
  if (c) {
    c->ops->shard_fini(c, sh);
    for (int k = 0; k < 2 && !m->file; k++) /* a state file's sets are its mapping */
      for (int s = 0; s < ZD__NSTATES; s++) c->ops->release(c, m->sets[k][s], sh->elems);
    c->ops->release(c, sh->grad_shard, sh->elems);
  }
  if (sh->segs)
    for (uint32_t b = 0; b < m->layout->nbuckets; b++) free(sh->segs[b]);
  free(sh->segs);
  free(sh->nsegs);
  free(sh->grad);
  free(sh->grad_dtype);
  free(m->scattered);
  free(m->attempted);
  free(m->ungathered);
  free(m->speculated);
  free(m->spec_sumsq);
  free(m->spec_nonfinite);
  free(m->spec_consts);
  free(m->groups);
  zd__shm_unmap(&m->kept);
  zd__state_file_close(m->file); /* the file stays, for the next zerod */
  zd__layout_free(m->layout);
  free(m);
}

/* Takes the layout and groups of spec. */
int zd__model_create(const zd__step_ctx_t *ctx, zd__model_spec_t *spec, zd__model_t **out,
                     zd__err_t *err) {
  const zd__layout_t *l = spec->layout;
  zd__compute_t *c = ctx->compute;
  zd__model_t *m = calloc(1, sizeof *m);
  if (!m) return zd__errf(err, -ENOMEM, "out of memory");
  zd__shard_t *sh = &m->shard;
  m->layout = spec->layout;
  m->groups = spec->groups;
  *sh = (zd__shard_t){.layout = m->layout,
                      .rank = ctx->rank,
                      .ngroups = spec->ngroups,
                      .elems = l->shard_elems ? l->shard_elems : 1};
  spec->layout = NULL;
  spec->groups = NULL;
  m->compute = c;
  m->states = zd__states_needed(m->groups, sh->ngroups);
  int rc = ZD_OK;
  if (ctx->state_dir) { /* two sets in the file: every update out of place */
    zd__state_file_key_t key = {.layout_hash = l->hash,
                                .world_size = ctx->world_size,
                                .rank = ctx->rank,
                                .shard_elems = sh->elems,
                                .states = m->states};
    rc = zd__state_file_open(ctx->state_dir, &key, !spec->replace, m->sets, &m->file, &m->restored,
                             m->restored_rec, err);
    if (m->restored) {
      const zd__state_rec_t *r = &m->restored_rec[0];
      m->committed = (zd__committed_t){.set = r->set, .step = r->step};
      m->step = r->step;
      m->steps_skipped = r->steps_skipped;
    }
  } else {
    for (int k = 0; k < (ctx->overlap_update ? 2 : 1); k++)
      for (int s = 0; s < ZD__NSTATES && !rc; s++)
        if (m->states & ZD__STATE_BIT(s)) rc = c->ops->alloc(c, sh->elems, &m->sets[k][s], err);
  }
  memcpy(sh->state, m->sets[m->committed.set], sizeof sh->state); /* the committed set */
  if (!rc && ctx->world_size > 1) rc = c->ops->alloc(c, sh->elems, &sh->grad_shard, err);
  if (rc) {
    char cause[ZD__ERR_MSG_MAX];
    snprintf(cause, sizeof cause, "%s", err ? err->msg : "");
    zd__model_free(m);
    return zd__errf(err, rc, "no memory for the state of %" PRIu64 " shard elements (%s): %s",
                    l->shard_elems, c->name, cause);
  }
  uint32_t nb = l->nbuckets;
  sh->segs = calloc(nb, sizeof *sh->segs);
  sh->nsegs = calloc(nb, sizeof *sh->nsegs);
  sh->grad = calloc(nb, sizeof *sh->grad);
  sh->grad_dtype = calloc(nb, sizeof *sh->grad_dtype);
  m->scattered = calloc(nb, 1);
  m->attempted = calloc(nb, 1);
  m->ungathered = calloc(nb, 1);
  m->speculated = calloc(nb, 1);
  m->spec_sumsq = calloc(nb, sizeof *m->spec_sumsq);
  m->spec_nonfinite = calloc(nb, sizeof *m->spec_nonfinite);
  m->spec_cap = sh->ngroups;
  m->spec_consts = calloc(sh->ngroups ? sh->ngroups : 1, sizeof *m->spec_consts);
  if (!sh->segs || !sh->nsegs || !sh->grad || !sh->grad_dtype || !m->scattered || !m->attempted ||
      !m->ungathered || !m->speculated || !m->spec_sumsq || !m->spec_nonfinite || !m->spec_consts) {
    zd__model_free(m);
    return zd__errf(err, -ENOMEM, "out of memory for the state of %" PRIu64 " shard elements",
                    l->shard_elems);
  }
  for (uint32_t b = 0; b < nb; b++) {
    if (zd__layout_segments(l, ctx->rank, b, &sh->segs[b], &sh->nsegs[b]) != 0) {
      zd__model_free(m);
      return zd__errf(err, -ENOMEM, "out of memory for segments");
    }
  }
  rc = c->ops->shard_init(c, sh, ctx->world_size, err);
  if (rc) {
    zd__model_free(m);
    return rc;
  }
  *out = m;
  return ZD_OK;
}

/* Applies a registration's options to a model (new or resumed). */
void zd__model_configure(zd__model_t *m, const zd__model_spec_t *spec, int keep_scaler) {
  m->shard.param_dtype = spec->param_dtype;
  m->grad_dtype = spec->grad_dtype;
  m->max_grad_norm = spec->max_grad_norm;
  m->grad_mean = spec->grad_mean;
  if (!keep_scaler || m->scaler.enabled != spec->scaler.enabled)
    zd__scaler_init(&m->scaler, &spec->scaler);
  else
    m->scaler.cfg = spec->scaler; /* keep the scale and trackers, take new factors */
}

/* A resumed model starts a fresh run of steps with its new client. */
void zd__model_resume(zd__model_t *m, zd__model_spec_t *spec) {
  free(m->groups);
  m->groups = spec->groups;
  m->shard.ngroups = spec->ngroups;
  spec->groups = NULL;
  zd__model_configure(m, spec, 1);
  memset(m->scattered, 0, m->layout->nbuckets);
  memset(m->attempted, 0, m->layout->nbuckets);
  memset(m->ungathered, 0, m->layout->nbuckets);
  memset(m->speculated, 0, m->layout->nbuckets);
  m->abandoned = 0;
}

void zd__model_commit(zd__model_t *m, int switch_set) {
  if (switch_set) {
    zd_assert(m->sets[1][ZD__STATE_MASTER]); /* two sets: overlap_update */
    m->committed.set ^= 1;
    memcpy(m->shard.state, m->sets[m->committed.set], sizeof m->shard.state);
  }
  m->committed.step = m->step;
  if (m->file) {
    zd__state_rec_t rec = {.set = m->committed.set,
                           .step = m->step,
                           .steps_skipped = m->steps_skipped,
                           .scaler_enabled = m->scaler.enabled,
                           .scale = m->scaler.scale,
                           .growth_tracker = m->scaler.growth_tracker,
                           .hysteresis_tracker = m->scaler.hysteresis_tracker};
    zd__state_file_commit(m->file, &rec);
  }
}

void zd__model_take_record(zd__model_t *m, int i) {
  zd_assert(i >= 0 && i < m->restored);
  const zd__state_rec_t *r = &m->restored_rec[i];
  m->committed.set = r->set;
  m->step = r->step;
  m->steps_skipped = r->steps_skipped;
  if (r->scaler_enabled && m->scaler.enabled) {
    m->scaler.scale = r->scale;
    m->scaler.growth_tracker = r->growth_tracker;
    m->scaler.hysteresis_tracker = r->hysteresis_tracker;
  }
  memcpy(m->shard.state, m->sets[m->committed.set], sizeof m->shard.state);
  zd__model_commit(m, 0); /* the file's newest record is the one served */
  m->restored = 0;
}

void zd__model_forget_restored(zd__model_t *m) {
  zd__state_file_reset(m->file);
  m->committed = (zd__committed_t){0};
  m->step = m->steps_skipped = 0;
  memcpy(m->shard.state, m->sets[0], sizeof m->shard.state);
  m->restored = 0;
}

float *const *zd__model_other_set(const zd__model_t *m) {
  return m->sets[1][ZD__STATE_MASTER] ? m->sets[m->committed.set ^ 1] : NULL;
}
