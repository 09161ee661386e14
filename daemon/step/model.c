/* A rank's model (model.h): its creation from a registration, its state arrays by the table,
 * its options, overlap_update's speculation thread, and its end. */
#include "model.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "log.h"
#include "optim.h"

/* overlap_update's speculation thread: a FIFO of the buckets in flight (model.h), each at most
 * once. Its own thread, so that the worker goes on to the next bucket's reduce-scatter (a
 * collective its peers wait in) while a bucket is updated; the kernel runs on the daemon's pool
 * from here, as the step's does from the worker. */
typedef struct zd__spec {
  zd__model_t *m;
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t work; /* the thread: a bucket queued, or stop */
  pthread_cond_t done; /* waiters: a bucket finished */
  uint32_t *ring;      /* under lock: the queued buckets, ring[head] first */
  uint32_t head, queued;
  uint32_t in_flight;       /* under lock: queued + the one running */
  uint8_t *flying;          /* under lock: per bucket, in flight */
  uint8_t *params;          /* under lock: per bucket in flight, its task is the parameters' write
                               (zd__model_params_async) rather than a speculation */
  uint32_t params_pending;  /* under lock: buckets in flight with that task */
  const zd__buffers_t *buf; /* under lock: where the parameters' writes go */
  uint64_t us;              /* under lock: time spent updating, not yet in update_us */
  int stop;                 /* under lock */
} zd__spec_t;

/* One bucket's speculative update: the committed set into the other, the bucket's statistics
 * with it (the same sums commit_point would take). A failure leaves it unspeculated. */
static int speculate_bucket(zd__model_t *m, uint32_t b) {
  zd__compute_t *c = m->compute;
  float *const *other = m->sets[m->committed.set ^ 1];
  zd__step_record_t rec = {0};
  zd__err_t err = {0};
  int rc = c->ops->update(c, &m->shard, b, NULL, m->spec_consts, m->spec_scale, other, &err);
  if (!rc && m->spec_stats) rc = c->ops->grad_stats(c, &m->shard, b, 1, &rec, &err);
  if (rc) {
    ZD_LOG_WARN("step %" PRIu64 ": no speculative update of bucket %u: %s", m->spec_step, b,
                err.msg);
    return 0;
  }
  m->spec_sumsq[b] = rec.sumsq;
  m->spec_nonfinite[b] = rec.nonfinite;
  return 1;
}

/* One bucket's working parameters from the committed master weights (the commit's write). */
static void params_bucket(zd__model_t *m, uint32_t b, const zd__buffers_t *buf) {
  zd__compute_t *c = m->compute;
  zd__err_t err = {0};
  if (c->ops->params_from_master(c, &m->shard, b, buf, &err) != ZD_OK)
    ZD_LOG_ERROR("step %" PRIu64 ": bucket %u's parameters not written: %s", m->step, b, err.msg);
}

static void *spec_main(void *arg) {
  zd__spec_t *sp = arg;
  uint32_t nb = sp->m->layout->nbuckets;
  pthread_mutex_lock(&sp->lock);
  for (;;) {
    while (!sp->queued && !sp->stop) pthread_cond_wait(&sp->work, &sp->lock);
    if (sp->stop) break;
    uint32_t b = sp->ring[sp->head];
    sp->head = (sp->head + 1) % nb;
    sp->queued--;
    int params = sp->params[b];
    const zd__buffers_t *buf = sp->buf;
    pthread_mutex_unlock(&sp->lock);
    uint64_t t0 = zd__now_us();
    int ok = 0;
    if (params)
      params_bucket(sp->m, b, buf);
    else
      ok = speculate_bucket(sp->m, b);
    uint64_t us = zd__now_us() - t0;
    pthread_mutex_lock(&sp->lock);
    if (!params) sp->m->speculated[b] = (uint8_t)ok;
    if (params) sp->params_pending--;
    sp->flying[b] = sp->params[b] = 0;
    sp->in_flight--;
    sp->us += us;
    pthread_cond_broadcast(&sp->done);
  }
  pthread_mutex_unlock(&sp->lock);
  return NULL;
}

static int spec_start(zd__model_t *m, zd__err_t *err) {
  uint32_t nb = m->layout->nbuckets ? m->layout->nbuckets : 1;
  zd__spec_t *sp = calloc(1, sizeof *sp);
  if (sp) {
    sp->ring = calloc(nb, sizeof *sp->ring);
    sp->flying = calloc(nb, 1);
    sp->params = calloc(nb, 1);
  }
  if (!sp || !sp->ring || !sp->flying || !sp->params) {
    if (sp) free(sp->ring), free(sp->flying), free(sp->params);
    free(sp);
    return zd__errf(err, -ENOMEM, "out of memory for the speculation thread");
  }
  sp->m = m;
  pthread_mutex_init(&sp->lock, NULL);
  pthread_cond_init(&sp->work, NULL);
  pthread_cond_init(&sp->done, NULL);
  int rc = pthread_create(&sp->thread, NULL, spec_main, sp);
  if (rc) {
    pthread_cond_destroy(&sp->done);
    pthread_cond_destroy(&sp->work);
    pthread_mutex_destroy(&sp->lock);
    free(sp->ring);
    free(sp->flying);
    free(sp->params);
    free(sp);
    return zd__errf(err, -rc, "cannot start the speculation thread");
  }
  m->spec = sp;
  return ZD_OK;
}

/* Finishes the bucket running (the queued ones are dropped: the model goes) and joins. */
static void spec_stop(zd__spec_t *sp) {
  if (!sp) return;
  pthread_mutex_lock(&sp->lock);
  sp->stop = 1;
  pthread_cond_signal(&sp->work);
  pthread_mutex_unlock(&sp->lock);
  pthread_join(sp->thread, NULL);
  pthread_cond_destroy(&sp->done);
  pthread_cond_destroy(&sp->work);
  pthread_mutex_destroy(&sp->lock);
  free(sp->ring);
  free(sp->flying);
  free(sp->params);
  free(sp);
}

/* Queues bucket b's task: its speculation, or (buf) its parameters' write. */
static void queue(zd__model_t *m, uint32_t b, const zd__buffers_t *buf) {
  zd__spec_t *sp = m->spec;
  zd_assert(sp && b < m->layout->nbuckets);
  pthread_mutex_lock(&sp->lock);
  zd_assert(!sp->flying[b]);
  sp->flying[b] = 1;
  sp->params[b] = buf != NULL;
  if (buf) sp->buf = buf, sp->params_pending++;
  sp->ring[(sp->head + sp->queued) % m->layout->nbuckets] = b;
  sp->queued++;
  sp->in_flight++;
  pthread_cond_signal(&sp->work);
  pthread_mutex_unlock(&sp->lock);
}

void zd__model_speculate(zd__model_t *m, uint32_t b) {
  queue(m, b, NULL);
}

void zd__model_params_async(zd__model_t *m, uint32_t b, const zd__buffers_t *buf) {
  queue(m, b, buf);
}

void zd__model_spec_wait_bucket(zd__model_t *m, int32_t b) {
  zd__spec_t *sp = m->spec;
  if (!sp) return;
  pthread_mutex_lock(&sp->lock);
  while (b < 0 ? sp->in_flight > 0 : sp->flying[b]) pthread_cond_wait(&sp->done, &sp->lock);
  m->update_us += sp->us;
  sp->us = 0;
  pthread_mutex_unlock(&sp->lock);
}

void zd__model_spec_wait(zd__model_t *m) {
  zd__model_spec_wait_bucket(m, -1);
}

uint32_t zd__model_params_pending(zd__model_t *m) {
  zd__spec_t *sp = m->spec;
  if (!sp) return 0;
  pthread_mutex_lock(&sp->lock);
  uint32_t n = sp->params_pending;
  pthread_mutex_unlock(&sp->lock);
  return n;
}

void zd__model_spec_free(zd__model_spec_t *spec) {
  if (!spec) return;
  zd__layout_free(spec->layout);
  free(spec->groups);
  free(spec);
}

/* The model's state arrays are those its groups keep at registration (kernels/optim.h), kept for
 * its life: torch creates an optimizer's state at a parameter's first step (max_exp_avg_sq under
 * amsgrad) and raises KeyError when a group asks for one later, so hyperparameters that need an
 * array the model lacks are refused likewise. */
int zd__model_check_states(const zd__model_t *m, const zd_group_t *groups, const char *what,
                           zd__err_t *err) {
  for (uint32_t i = 0; i < m->shard.ngroups; i++) {
    int lack = zd__optim_states_missing(m->states, &groups[i], 1);
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
  spec_stop(m->spec);
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
  free(m->next_groups);
  free(m->groups);
  free(m->lag);
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
  m->states = zd__optim_states(m->groups, sh->ngroups);
  int rc = ZD_OK;
  if (ctx->state_dir) { /* two sets in the file: every update out of place */
    zd__state_file_key_t key = {.layout_hash = l->hash,
                                .world_size = ctx->world_size,
                                .rank = ctx->rank,
                                .shard_elems = sh->elems,
                                .states = m->states,
                                .nparams = l->nparams};
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
  m->next_groups = calloc(sh->ngroups ? sh->ngroups : 1, sizeof *m->next_groups);
  m->lag = calloc(l->nparams ? l->nparams : 1, sizeof *m->lag);
  if (m->lag && m->restored) zd__model_set_lags(m, m->restored_rec[0].lags);
  if (!m->lag || !sh->segs || !sh->nsegs || !sh->grad || !sh->grad_dtype || !m->scattered ||
      !m->attempted || !m->ungathered || !m->speculated || !m->spec_sumsq || !m->spec_nonfinite ||
      !m->spec_consts || !m->next_groups) {
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
  if (!rc && ctx->overlap_update) rc = spec_start(m, err);
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
  m->has_next_groups = 0;
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
                           .hysteresis_tracker = m->scaler.hysteresis_tracker,
                           .lags = m->nlagging ? m->lag : NULL};
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
  zd__model_set_lags(m, r->lags); /* copied before the commit below writes a slot's lags */
  memcpy(m->shard.state, m->sets[m->committed.set], sizeof m->shard.state);
  zd__model_commit(m, 0); /* the file's newest record is the one served */
  m->restored = 0;
}

void zd__model_forget_restored(zd__model_t *m) {
  zd__state_file_reset(m->file);
  m->committed = (zd__committed_t){0};
  m->step = m->steps_skipped = 0;
  zd__model_set_lags(m, NULL);
  memcpy(m->shard.state, m->sets[0], sizeof m->shard.state);
  m->restored = 0;
}

void zd__model_set_lags(zd__model_t *m, const uint64_t *lags) {
  uint32_t n = m->layout->nparams;
  m->nlagging = 0;
  for (uint32_t i = 0; i < n; i++) {
    m->lag[i] = lags ? lags[i] : 0;
    m->nlagging += m->lag[i] != 0;
  }
}

float *const *zd__model_other_set(const zd__model_t *m) {
  return m->sets[1][ZD__STATE_MASTER] ? m->sets[m->committed.set ^ 1] : NULL;
}

/* ---- a grown model (add_param_group) -------------------------------------------------------- */

int zd__model_grows(const zd__layout_t *held, const zd__layout_t *grown, char *buf, size_t len) {
  for (uint32_t i = 0; i < held->nparams; i++) {
    const zd__layout_param_t *a = &held->params[i];
    if (i >= grown->nparams) {
      snprintf(buf, len,
               "the rank holds %u parameters, the registration has %u: a grown model keeps "
               "every parameter held, in order, and adds after them",
               held->nparams, grown->nparams);
      return 0;
    }
    const zd__layout_param_t *b = &grown->params[i];
    int same = strcmp(a->name, b->name) == 0 && a->ndim == b->ndim && a->group == b->group;
    for (uint32_t d = 0; same && d < a->ndim; d++) same = a->shape[d] == b->shape[d];
    if (!same) {
      char sa[160], sb[160];
      zd__shape_format(a->shape, a->ndim, sa, sizeof sa);
      zd__shape_format(b->shape, b->ndim, sb, sizeof sb);
      snprintf(buf, len,
               "parameter %u: '%s' %s group %u held vs '%s' %s group %u registered (a grown "
               "model keeps every parameter held, in order, and adds after them)",
               i, a->name, sa, a->group, b->name, sb, b->group);
      return 0;
    }
  }
  if (grown->nparams == held->nparams) {
    snprintf(buf, len, "the registration adds no parameter to the %u held", held->nparams);
    return 0;
  }
  return 1;
}

/* The state arrays of m present in `states`, in table order (the order a snapshot packs them). */
uint32_t zd__model_arrays(const zd__model_t *m, zd__states_t states, float **out) {
  uint32_t n = 0;
  for (int s = 0; s < ZD__NSTATES; s++)
    if (states & ZD__STATE_BIT(s)) out[n++] = m->shard.state[s];
  return n;
}

/* Index of array s among those of `states` in table order. */
uint32_t zd__model_array_index(zd__states_t states, int s) {
  return (uint32_t)__builtin_popcount(states & (ZD__STATE_BIT(s) - 1));
}

/* Copies into `shard` (rank `rank`'s shard of `grown`) every element of the held parameters that
 * slice holds, from `full`: the all-gathered shards of `held` (rank r's at r * shard_elems). */
void zd__model_carry(const zd__layout_t *held, const zd__layout_t *grown, uint32_t rank,
                     const float *full, float *shard) {
  for (uint32_t b = 0; b < grown->nbuckets; b++) {
    const zd__bucket_t *bk = &grown->buckets[b];
    uint64_t lo = bk->offset + (uint64_t)rank * bk->shard_elems, hi = lo + bk->shard_elems;
    for (uint32_t p = bk->first_param; p < bk->first_param + bk->nparams; p++) {
      if (p >= held->nparams) break; /* the new parameters come after the held ones */
      const zd__layout_param_t *np = &grown->params[p], *op = &held->params[p];
      const zd__bucket_t *ob = &held->buckets[op->bucket];
      uint64_t s = np->offset > lo ? np->offset : lo;
      uint64_t e = np->offset + np->numel < hi ? np->offset + np->numel : hi;
      for (uint64_t i = s - np->offset; i < e - np->offset;) {
        /* element i of p in held's layout: which rank's slice of its bucket, and where */
        uint64_t rel = op->offset + i - ob->offset;
        uint64_t owner = rel / ob->shard_elems, pos = rel % ob->shard_elems;
        uint64_t n = ob->shard_elems - pos;
        if (n > e - np->offset - i) n = e - np->offset - i;
        memcpy(shard + bk->shard_base + (np->offset + i - lo),
               full + owner * held->shard_elems + ob->shard_base + pos, n * sizeof(float));
        i += n;
      }
    }
  }
}

/* Waits for a snapshot's copy (compute.h) and frees its fence. */
int zd__model_snapshot_wait(zd__compute_t *c, void *fence, int timeout_ms, zd__err_t *err) {
  int rc = c->ops->fence_wait(fence, timeout_ms, err);
  c->ops->fence_free(fence);
  return rc;
}

/* A copy of layout l, built again from its parameter table (a layout is a pure function of it, the
 * world size and the bucket size): what the carry reads once the held model is gone. */
int zd__model_layout_copy(const zd__layout_t *l, zd__layout_t **out, zd__err_t *err) {
  zd_param_t *ps = calloc(l->nparams ? l->nparams : 1, sizeof *ps);
  if (!ps) return zd__errf(err, -ENOMEM, "out of memory");
  for (uint32_t i = 0; i < l->nparams; i++) {
    ps[i].name = l->params[i].name;
    ps[i].ndim = l->params[i].ndim;
    memcpy(ps[i].shape, l->params[i].shape, sizeof ps[i].shape);
    ps[i].group = l->params[i].group;
  }
  int rc = zd__layout_build(ps, l->nparams, UINT32_MAX, l->world_size, l->bucket_elems, out, err);
  free(ps);
  return rc;
}

int zd__model_grow(const zd__step_ctx_t *ctx, zd__model_t **model, zd__model_spec_t *spec,
                   const zd__buffers_t *buf, int timeout_ms, zd__err_t *err) {
  zd__model_t *held = *model, *m = NULL;
  zd__compute_t *c = ctx->compute;
  const uint32_t w = ctx->world_size;
  const zd__states_t held_states = held->states;
  const uint64_t hs = held->layout->shard_elems;
  const uint64_t step = held->step, skipped = held->steps_skipped;
  const zd__scaler_t scaler = held->scaler;
  float *src[ZD__NSTATES], *dst[ZD__NSTATES];
  const uint32_t count = zd__model_arrays(held, held_states, src);
  zd__layout_t *hl = NULL;
  void *mine = NULL, *stage = NULL, *fence = NULL;
  int stuck = 0; /* a copy that did not finish may still use its host memory: leak it */
  float *full = malloc((size_t)count * w * (hs ? hs : 1) * sizeof(float));
  uint64_t *lags = calloc(spec->layout->nparams, sizeof *lags);
  int rc = full && lags ? zd__model_layout_copy(held->layout, &hl, err)
                        : zd__errf(err, -ENOMEM, "out of memory for the held state");
  if (!rc) rc = c->ops->host_alloc(c, (size_t)count * (hs ? hs : 1) * sizeof(float), &mine, err);
  if (rc) goto exit;
  rc = c->ops->snapshot(c, src, count, hs, mine, &fence, err);
  if (!rc) rc = zd__model_snapshot_wait(c, fence, timeout_ms, err);
  if (rc) {
    stuck = 1;
    goto exit;
  }
  /* Every rank's shards of every array: a held parameter's elements may move to another rank. */
  for (uint32_t k = 0; k < count && !rc; k++)
    rc = ctx->comm->ops->allgather_bytes(ctx->comm, (float *)mine + k * hs, hs * sizeof(float),
                                         full + (size_t)k * w * hs, err);
  if (rc) goto exit;
  for (uint32_t i = 0; i < spec->layout->nparams; i++)
    lags[i] = i < hl->nparams ? held->lag[i] : step; /* a new parameter: its own step is 0 */
  if (ctx->state_dir) { /* the rank's one state file is the held model's mapping until it goes */
    zd__model_free(held);
    *model = held = NULL;
  }
  int replace = spec->replace;
  spec->replace = 1; /* a state file starts afresh for the grown layout */
  rc = zd__model_create(ctx, spec, &m, err);
  spec->replace = replace;
  if (rc) goto exit;
  zd__model_configure(m, spec, 0);
  rc = c->ops->exchange(c, &m->shard, buf, 0, err); /* the client's values: the new parameters' */
  if (rc) goto exit;
  const uint32_t ncount = zd__model_arrays(m, m->states, dst);
  const uint64_t ns = m->layout->shard_elems;
  rc = c->ops->host_alloc(c, (size_t)ncount * (ns ? ns : 1) * sizeof(float), &stage, err);
  if (rc) goto exit;
  fence = NULL;
  rc = c->ops->snapshot(c, dst, ncount, ns, stage, &fence, err);
  if (!rc) rc = zd__model_snapshot_wait(c, fence, timeout_ms, err);
  if (rc) {
    stuck = 1;
    goto exit;
  }
  for (int s = 0; s < ZD__NSTATES; s++)
    if (m->states & held_states & ZD__STATE_BIT(s)) /* else new: zeros (master: the client's) */
      zd__model_carry(hl, m->layout, ctx->rank,
                      full + (size_t)zd__model_array_index(held_states, s) * w * hs,
                      (float *)stage + (size_t)zd__model_array_index(m->states, s) * ns);
  rc = c->ops->restore(c, dst, ncount, ns, stage, timeout_ms, err);
  if (rc) {
    stuck = 1;
    goto exit;
  }
  /* The working parameters from the master weights, as a resume writes them: the held ones are
   * zerod's (whatever the client wrote), the new ones what the client wrote. */
  rc = c->ops->exchange(c, &m->shard, buf, 1, err);
  if (rc) goto exit;
  m->step = step;
  m->steps_skipped = skipped;
  if (scaler.enabled && m->scaler.enabled) {
    m->scaler.scale = scaler.scale;
    m->scaler.growth_tracker = scaler.growth_tracker;
    m->scaler.hysteresis_tracker = scaler.hysteresis_tracker;
  }
  zd__model_set_lags(m, lags);
  zd__model_commit(m, 0); /* the committed record (and the state file's) at the carried step */
  m->resumed_from = ZD__FROM_HELD;
  ZD_LOG_INFO("rank %u: model grown from %u to %u parameters at step %" PRIu64
              " (the held ones keep their state, the new ones start afresh)",
              ctx->rank, hl->nparams, m->layout->nparams, step);
  zd__model_free(held);
  *model = m;
  m = NULL;
exit:
  zd__model_free(m);
  zd__layout_free(hl);
  if (!stuck) {
    c->ops->host_free(mine);
    c->ops->host_free(stage);
  }
  free(full);
  free(lags);
  return rc;
}
