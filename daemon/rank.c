/* Local ranks (rank.h): the worker thread, its job queue, and the stats snapshot the loop reads. */
#include "rank.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adam.h"
#include "log.h"
#include "pool.h"
#include "step.h"

struct zd__rank {
  zd__rank_env_t env;
  zd__step_ctx_t ctx;
  pthread_t thread;
  pthread_mutex_t lock; /* queue and stop */
  pthread_cond_t cond;
  zd__job_t *head, *tail;
  int stop;
  zd__model_t *model; /* worker thread only */
  pthread_mutex_t stats_lock;
  zd__rank_stats_t stats;
};

void zd__model_spec_free(zd__model_spec_t *spec) {
  if (!spec) return;
  zd__layout_free(spec->layout);
  free(spec->groups);
  free(spec);
}

void zd__job_free(zd__job_t *job) {
  if (!job) return;
  if (job->type == ZD__JOB_ATTACH) zd__model_spec_free(job->in.spec);
  if (job->type == ZD__JOB_STEP) free(job->in.step.groups);
  free(job);
}

/* Refreshes the snapshot after a job; takes the model's numbers as they are now. */
static void publish(zd__rank_t *r, const zd__job_t *job) {
  const zd__model_t *m = r->model;
  pthread_mutex_lock(&r->stats_lock);
  zd__rank_stats_t *s = &r->stats;
  s->has_model = m != NULL;
  if (m) {
    s->nparams = m->layout->nparams;
    s->nbuckets = m->layout->nbuckets;
    s->layout_hash = m->layout->hash;
    s->total_elems = m->layout->total_elems;
    s->shard_elems = m->layout->shard_elems;
    s->state_bytes = 3 * m->layout->shard_elems * sizeof(float);
    s->grad_shard_bytes = m->grad_shard ? m->layout->shard_elems * sizeof(float) : 0;
    s->param_dtype = m->param_dtype;
    s->grad_dtype = m->grad_dtype;
    s->step = m->step;
    s->steps_skipped = m->steps_skipped;
    s->loss_scale = m->scaler.scale;
  }
  if (job->type == ZD__JOB_STEP && job->code == ZD_OK) {
    s->last_grad_norm = job->out.step.grad_norm;
    s->last_clip_coef = job->out.step.clip_coef;
    s->last_step_us = job->out.step.duration_us;
    s->total_step_us += job->out.step.duration_us;
    s->steps_run++;
  }
  if (job->type == ZD__JOB_SCATTER && job->code == ZD_OK) s->scatters++;
  if (job->type == ZD__JOB_GATHER && job->code == ZD_OK) s->gathers++;
  /* A failed collective breaks the communicator for good: the rank is degraded. */
  if (job->code == ZD_EPEER || job->code == -ETIMEDOUT) {
    if (s->health != ZD__HEALTH_DEGRADED)
      ZD_LOG_ERROR("rank degraded: %s", job->err.msg);
    s->health = ZD__HEALTH_DEGRADED;
    snprintf(s->degraded_reason, sizeof s->degraded_reason, "%s", job->err.msg);
  }
  pthread_mutex_unlock(&r->stats_lock);
}

static int degraded(zd__rank_t *r, zd__err_t *err) {
  pthread_mutex_lock(&r->stats_lock);
  int bad = r->stats.health == ZD__HEALTH_DEGRADED;
  if (bad) zd__errf(err, ZD_EDEGRADED, "rank %u is degraded: %s", r->env.rank,
                    r->stats.degraded_reason);
  pthread_mutex_unlock(&r->stats_lock);
  return bad ? ZD_EDEGRADED : ZD_OK;
}

static void run_job(zd__rank_t *r, zd__job_t *job) {
  zd__err_t *err = &job->err;
  job->code = degraded(r, err);
  if (job->code) return;
  if (job->type != ZD__JOB_ATTACH && !r->model) {
    job->code = zd__errf(err, ZD_EORDER, "no model registered on rank %u", r->env.rank);
    return;
  }
  switch (job->type) {
    case ZD__JOB_ATTACH: {
      int resumed = 0;
      job->code = zd__model_attach(&r->ctx, &r->model, job->in.spec, job->buffers, &resumed, err);
      if (job->code == ZD_OK) {
        const zd__layout_t *l = r->model->layout;
        job->out.attach.step = r->model->step;
        job->out.attach.resumed = resumed;
        job->out.attach.loss_scale = r->model->scaler.scale;
        job->out.attach.layout_hash = l->hash;
        job->out.attach.total_elems = l->total_elems;
        job->out.attach.nbuckets = l->nbuckets;
        job->out.attach.shard_elems = l->shard_elems;
        ZD_LOG_INFO("%s model: %u parameters, %" PRIu64 " elements in %u buckets, shard %" PRIu64
                    " elements, step %" PRIu64, resumed ? "resumed" : "registered", l->nparams,
                    l->total_elems, l->nbuckets, l->shard_elems, r->model->step);
      }
      break;
    }
    case ZD__JOB_SCATTER:
      job->code = zd__model_scatter(&r->ctx, r->model, job->buffers, job->in.bucket, err);
      break;
    case ZD__JOB_GATHER:
      job->code = zd__model_gather(&r->ctx, r->model, job->buffers, job->in.bucket, err);
      break;
    case ZD__JOB_STEP:
      job->code = zd__model_step(&r->ctx, r->model, job->buffers, job->in.step.groups,
                                 job->in.step.scatter, job->in.step.gather, &job->out.step, err);
      break;
  }
}

static void *worker_main(void *arg) {
  zd__rank_t *r = arg;
  zd__log_set_rank((int)r->env.rank);
  pthread_mutex_lock(&r->lock);
  for (;;) {
    while (!r->head && !r->stop) pthread_cond_wait(&r->cond, &r->lock);
    zd__job_t *job = r->head;
    if (!job) break; /* stop requested and the queue is drained */
    r->head = job->next;
    if (!r->head) r->tail = NULL;
    pthread_mutex_unlock(&r->lock);
    job->next = NULL;
    run_job(r, job);
    publish(r, job);
    r->env.done(r->env.done_ctx, job);
    pthread_mutex_lock(&r->lock);
  }
  pthread_mutex_unlock(&r->lock);
  return NULL;
}

int zd__rank_create(const zd__rank_env_t *env, zd__rank_t **out) {
  zd__rank_t *r = calloc(1, sizeof *r);
  if (!r) return -ENOMEM;
  r->env = *env;
  r->ctx = (zd__step_ctx_t){
      .rank = env->rank,
      .world_size = env->world_size,
      .comm = env->comm,
      .pool = env->pool,
      .adam = zd__adam_impl((zd__isa_t)env->isa),
      .stats = zd__grad_stats_impl((zd__isa_t)env->isa),
  };
  r->stats.loss_scale = 1.0;
  r->stats.last_grad_norm = NAN;
  r->stats.last_clip_coef = 1.0;
  pthread_mutex_init(&r->lock, NULL);
  pthread_cond_init(&r->cond, NULL);
  pthread_mutex_init(&r->stats_lock, NULL);
  int rc = pthread_create(&r->thread, NULL, worker_main, r);
  if (rc) {
    pthread_mutex_destroy(&r->stats_lock);
    pthread_cond_destroy(&r->cond);
    pthread_mutex_destroy(&r->lock);
    free(r);
    return -rc;
  }
  *out = r;
  return ZD_OK;
}

void zd__rank_destroy(zd__rank_t *r) {
  if (!r) return;
  pthread_mutex_lock(&r->lock);
  r->stop = 1;
  pthread_cond_signal(&r->cond);
  pthread_mutex_unlock(&r->lock);
  pthread_join(r->thread, NULL);
  zd__model_free(r->model);
  zd__comm_destroy(r->env.comm);
  pthread_mutex_destroy(&r->stats_lock);
  pthread_cond_destroy(&r->cond);
  pthread_mutex_destroy(&r->lock);
  free(r);
}

void zd__rank_submit(zd__rank_t *r, zd__job_t *job) {
  job->next = NULL;
  job->rank = r;
  pthread_mutex_lock(&r->lock);
  if (r->tail)
    r->tail->next = job;
  else
    r->head = job;
  r->tail = job;
  pthread_cond_signal(&r->cond);
  pthread_mutex_unlock(&r->lock);
}

void zd__rank_stats(zd__rank_t *r, zd__rank_stats_t *out) {
  pthread_mutex_lock(&r->stats_lock);
  *out = r->stats;
  pthread_mutex_unlock(&r->stats_lock);
}

uint32_t zd__rank_local(const zd__rank_t *r) { return r->env.local_rank; }
uint32_t zd__rank_global(const zd__rank_t *r) { return r->env.rank; }
uint32_t zd__rank_world_size(const zd__rank_t *r) { return r->env.world_size; }
uint64_t zd__rank_bucket_elems(const zd__rank_t *r) { return r->env.bucket_elems; }
