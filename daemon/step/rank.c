/* Local ranks (rank.h): the worker thread, its job queue, and the stats snapshot the loop reads. */
#include "rank.h"

#include <errno.h>
#include <stdarg.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "adam.h"
#include "buddy.h"
#include "checkpoint.h"
#include "clock.h"
#include "compute.h"
#include "log.h"
#include "pool.h"
#include "resize.h"
#include "snapshot.h"
#include "step.h"
#include "world.h"
#include "world_record.h"

struct zd__rank {
  zd__rank_env_t env;
  zd__world_t world; /* env.world's copy (has_world): a live resize changes its world size */
  int has_world;
  atomic_uint resize_want; /* zd__rank_request_resize: the size asked for (0: none) */
  uint32_t resize_agreed;  /* worker: the size the ranks agreed on at the last step (0: none) */
  zd__resize_image_t *resize_image; /* worker: the whole model, held across a resize */
  int left;                         /* worker: a resize left this rank outside the world */
  char resized[ZD__ERR_MSG_MAX];    /* worker: why a trainer must register again ("": no resize) */
  char resize_stale[64]; /* worker: the instance the resize left, until the new one forms */
  uint32_t resize_from;  /* worker: the resize in progress, for status */
  int resize_forming;    /* under lock: re-forming the world after a resize (resize_form) */
  uint32_t resize_lost;  /* under lock: 1 + the rank whose loss was last reported meanwhile */
  uint64_t resize_step, resize_t0;
  int device; /* CUDA backend: the rank's CUDA device (env.gpu's); -1: the CPU backend */
  zd__step_ctx_t ctx;
  pthread_t thread;
  pthread_mutex_t lock; /* queue and stop */
  pthread_cond_t cond;
  zd__job_t *head, *tail;
  int stop;
  int busy;             /* under lock: a job is running (on the worker or inline) */
  atomic_int inline_ok; /* the model is small enough to step on the loop thread */
  atomic_int cancel;    /* shutdown: stop waiting for peers (bootstrap, barriers) */
  int standing_in;      /* under lock: a ZD__JOB_STAND_IN is running */
  int peer_failed;      /* under lock: the heartbeat found a peer dead (wakes an idle worker) */
  uint64_t lost_ms;     /* worker: when the last heal began (0: none since the last recovery) */
  atomic_int attach_abandoned; /* the client of the registration in progress left */
  zd__model_t *model;          /* the thread running a job only */
  pthread_mutex_t stats_lock;
  zd__rank_stats_t stats;
  zd__shard_range_t *ranges; /* under stats_lock: the model's shard, for status */
  uint32_t nranges;
  /* Jobs answered whose work a finish_early left running on the stream (cuda_step fast), in the
   * order they ran: done once the worker has seen it complete (settle). Worker thread only. */
  zd__job_t *settling_head, *settling_tail;
};

void zd__job_free(zd__job_t *job) {
  if (!job) return;
  if (job->type == ZD__JOB_ATTACH) zd__model_spec_free(job->in.spec);
  if (job->type == ZD__JOB_STEP) {
    free(job->in.step.groups);
    free(job->in.step.absent);
  }
  free(job->next_groups);
  free(job);
}

/* The shard ranges of the model's layout (stats_lock held). Rebuilt only when the layout
 * changed; out of memory leaves none, which status shows as an empty shard. */
static void publish_ranges(zd__rank_t *r, const zd__model_t *m) {
  const zd__layout_t *l = m ? m->layout : NULL;
  if (l && r->stats.has_model && r->stats.layout_hash == l->hash && r->nranges == l->nbuckets)
    return;
  free(r->ranges);
  r->ranges = NULL;
  r->nranges = 0;
  if (!l || !(r->ranges = calloc(l->nbuckets ? l->nbuckets : 1, sizeof *r->ranges))) return;
  for (uint32_t b = 0; b < l->nbuckets; b++) {
    const zd__bucket_t *bk = &l->buckets[b];
    uint64_t begin = bk->offset + (uint64_t)r->env.rank * bk->shard_elems;
    r->ranges[b] = (zd__shard_range_t){.bucket = b, .begin = begin, .end = begin + bk->shard_elems};
  }
  r->nranges = l->nbuckets;
}

/* CPUs a step of the rank's model may leave idle, for the reply: a client looks for the reply
 * without sleeping only while one is (libzerod). The CPU backend's kernel runs each bucket on
 * up to every CPU, and the other local ranks may be stepping at the same time (a one-thread
 * update runs on its worker, outside the pool's turns); the CUDA backend's runs on the GPU. */
static uint32_t step_idle_cpus(const zd__rank_t *r) {
  unsigned cpus = zd__pool_cpus(r->env.pool), busy = 0;
  if (r->device < 0 && r->model) {
    const zd__layout_t *l = r->model->layout;
    uint64_t most = 0;
    for (uint32_t b = 0; b < l->nbuckets; b++)
      if (l->buckets[b].shard_elems > most) most = l->buckets[b].shard_elems;
    busy = zd__compute_cpu_update_threads(r->env.pool, most);
    if (busy < r->env.local_ranks) busy = r->env.local_ranks;
  }
  return busy < cpus ? cpus - busy : 0;
}

/* Refreshes the snapshot after a job; takes the model's numbers as they are now. */
static void publish(zd__rank_t *r, const zd__job_t *job) {
  const zd__model_t *m = r->model;
  /* overlap_update: jobs run on the worker, where a step waits for the speculation thread. */
  atomic_store(&r->inline_ok, m && r->env.world_size == 1 && r->device < 0 &&
                                  !r->env.overlap_update &&
                                  m->layout->shard_elems <= ZD__INLINE_MAX_ELEMS);
  zd__compute_t *c = r->ctx.compute;
  zd__phase_times_t times;
  int have_times = c && c->ops->phase_times;
  if (have_times) c->ops->phase_times(c, &times);
  pthread_mutex_lock(&r->stats_lock);
  publish_ranges(r, m);
  zd__rank_stats_t *s = &r->stats;
  s->has_model = m != NULL;
  s->resize_agreed = r->resize_agreed;
  if (m) {
    s->nparams = m->layout->nparams;
    s->nbuckets = m->layout->nbuckets;
    s->layout_hash = m->layout->hash;
    s->total_elems = m->layout->total_elems;
    s->shard_elems = m->layout->shard_elems;
    s->states = m->states;
    s->grad_shard_bytes = m->shard.grad_shard ? m->layout->shard_elems * sizeof(float) : 0;
    s->param_dtype = m->shard.param_dtype;
    s->grad_dtype = m->grad_dtype;
    s->step = m->step;
    s->steps_skipped = m->steps_skipped;
    s->loss_scale = m->scaler.scale;
    s->scatter_us = m->scatter_us;
    s->update_us = m->update_us;
    s->gather_us = m->gather_us;
    s->collective_bytes = m->collective_bytes;
    s->collective_us = m->collective_us;
    s->state_sets = m->sets[1][ZD__STATE_MASTER] ? 2 : 1;
    s->committed_set = m->committed.set;
    s->spec_committed = m->spec_committed;
    s->params_lagging = m->nlagging;
    s->spec_recomputed = m->spec_recomputed;
    if (m->file) {
      snprintf(s->state_path, sizeof s->state_path, "%s", zd__state_file_path(m->file));
      s->state_committed_step = zd__state_file_committed_step(m->file);
    }
  }
  if (!m) s->state_path[0] = '\0';
  if (have_times) s->gpu_times = times;
  if (job->type == ZD__JOB_STEP && job->code == ZD_OK) {
    s->last_grad_norm = job->out.step.grad_norm;
    s->last_clip_coef = job->out.step.clip_coef;
    s->last_step_us = job->out.step.duration_us;
    s->total_step_us += job->out.step.duration_us;
    s->steps_run++;
    static const uint64_t bounds[ZD__STEP_HIST_BUCKETS] = ZD__STEP_HIST_BOUNDS_US;
    uint32_t h = 0;
    while (h < ZD__STEP_HIST_BUCKETS && job->out.step.duration_us > bounds[h]) h++;
    s->step_hist[h]++;
  }
  if (job->type == ZD__JOB_SCATTER && job->code == ZD_OK) s->scatters++;
  if (job->type == ZD__JOB_GATHER && job->code == ZD_OK) s->gathers++;
  /* A failed collective breaks the communicator for good, and a failure of the device leaves its
   * state in doubt (as does a device decision the host disagrees with: ZD_EINTERNAL): the rank is
   * degraded. (A registration barrier that timed out, or a peer that
   * refused a step, leaves the communicator healthy: not degraded.) */
  /* The first failure is the reason: a job refused because the rank was degraded already must not
   * wrap it again ("rank 0 is degraded: rank 0 is degraded: ..."). */
  if (job->code && job->code != ZD_EDEGRADED &&
      (job->code == ZD_EBACKEND || job->code == ZD_EINTERNAL || zd__comm_failed(r->ctx.comm))) {
    if (s->health != ZD__HEALTH_DEGRADED) ZD_LOG_ERROR("rank degraded: %s", job->err.msg);
    s->health = ZD__HEALTH_DEGRADED;
    snprintf(s->degraded_reason, sizeof s->degraded_reason, "%s", job->err.msg);
  }
  pthread_mutex_unlock(&r->stats_lock);
}

static int degraded(zd__rank_t *r, zd__err_t *err) {
  pthread_mutex_lock(&r->stats_lock);
  int bad = r->stats.health == ZD__HEALTH_DEGRADED;
  /* Shutting down with a state_dir (a join or heal that the stop cancelled degrades the rank):
   * the next zerod serves the state, so the trainer registers again there, not gives up. */
  int stopping = bad && r->env.state_dir && atomic_load(&r->cancel);
  if (stopping)
    zd__errf(err, ZD_ECLOSED,
             "rank %u: zerod is stopping (a planned stop); its state_dir keeps the committed "
             "state for the next zerod: register again there (zd_rejoin)",
             r->env.rank);
  else if (bad)
    zd__errf(err, ZD_EDEGRADED, "rank %u is degraded: %s", r->env.rank, r->stats.degraded_reason);
  pthread_mutex_unlock(&r->stats_lock);
  return stopping ? ZD_ECLOSED : bad ? ZD_EDEGRADED : ZD_OK;
}

/* Shutdown aborts a stand-in at once (zd__rank_cancel): nobody waits for its answer, and its
 * peers may never come. */
static void stand_in(zd__rank_t *r, zd__job_t *job) {
  pthread_mutex_lock(&r->lock);
  r->standing_in = !atomic_load(&r->cancel);
  pthread_mutex_unlock(&r->lock);
  /* A model kept across a world that re-formed has no step in flight: its client's last one
   * failed with the old world, and nothing of it is owed to the new one. */
  if (r->standing_in && !r->model->rejoin)
    job->code = zd__model_stand_in(&r->ctx, r->model, job->buffers, job->in.abrupt, &job->out.kept,
                                   &job->err);
  pthread_mutex_lock(&r->lock);
  r->standing_in = 0;
  pthread_mutex_unlock(&r->lock);
}

static void set_health(zd__rank_t *r, zd__health_t health, const char *prefix, const char *reason);
static int can_heal(const zd__rank_t *r);
static void heal(zd__rank_t *r);

/* Status: how a registration that resumed a state (or a heal's re-registration) made it, and how
 * long the rank was without a served state: from the heal's start when the world re-formed, else
 * from the registration's start. */
static void note_recovery(zd__rank_t *r, uint64_t attach_t0, int resumed) {
  const zd__model_t *m = r->model;
  /* not a recovery: a first registration, or a trainer's reattach to the model its rank held */
  if ((!resumed && !r->lost_ms) || (resumed && m->resumed_from == ZD__FROM_HELD)) return;
  const char *how = "none";
  if (resumed && m->resumed_from == ZD__FROM_MODEL) how = "state_dir (kept)";
  if (resumed && m->resumed_from == ZD__FROM_STATE_FILE) how = "state_dir";
  if (resumed && m->resumed_from == ZD__FROM_CHECKPOINT) how = "checkpoint";
  if (resumed && m->resumed_from == ZD__FROM_BUDDY) how = "buddy copy";
  if (resumed && m->resumed_from == ZD__FROM_SNAPSHOT) how = "snapshot";
  uint64_t since = r->lost_ms ? r->lost_ms : attach_t0;
  pthread_mutex_lock(&r->stats_lock);
  snprintf(r->stats.recovery, sizeof r->stats.recovery, "%s", how);
  r->stats.recovery_step = m->step;
  r->stats.recovery_ms = zd__now_ms() - since;
  snprintf(r->stats.recovery_note, sizeof r->stats.recovery_note, "%s",
           resumed && m->resumed_from != ZD__FROM_CHECKPOINT ? "" : m->resume_note);
  pthread_mutex_unlock(&r->stats_lock);
  if (m->resume_note[0] && m->resumed_from != ZD__FROM_STATE_FILE &&
      m->resumed_from != ZD__FROM_MODEL)
    ZD_LOG_WARN(
        "rank %u: the state files were not used (%s); the rank serves step %" PRIu64 " from %s",
        r->env.rank, m->resume_note, m->step,
        m->resumed_from == ZD__FROM_CHECKPOINT ? "the newest checkpoint" : "the client's values");
  r->lost_ms = 0;
}

/* A registration re-forms a broken world at most this often: a peer that keeps crashing makes
 * its trainer fail instead of wait for ever. */
#define ATTACH_REFORMS_MAX 3

/* A registration. Should the world break while it waits for the other ranks (a peer zerod died or
 * was replaced; the heartbeat's verdict ends the wait), the world is re-formed and the
 * registration made again in the new instance, where it resumes the newest checkpoint like every
 * other rank's: to its client, the world just took longer to form. */
static void attach(zd__rank_t *r, zd__job_t *job) {
  zd__err_t *err = &job->err;
  uint64_t t0 = zd__now_ms();
  for (int reforms = 0;; reforms++) {
    int resumed = 0;
    /* zeroctl status shows the load of a checkpoint as its own phase */
    int restoring = !r->model && !job->in.spec->replace &&
                    (r->ctx.resume_latest || zd__ckptr_resumes(r->env.ckpt));
    if (restoring)
      set_health(r, ZD__HEALTH_RESTORING, "",
                 r->ctx.resume_latest ? "the world re-formed: loading the newest checkpoint"
                                      : "loading a checkpoint (resume)");
    job->code = zd__model_attach(&r->ctx, &r->model, job->in.spec, job->buffers, job->event_slot,
                                 &resumed, err);
    if (restoring) set_health(r, ZD__HEALTH_OK, "", "");
    int broke = zd__comm_failed(r->ctx.comm) || zd__world_member_broken(r->ctx.member);
    /* Again only with the spec whole: a model built from it (then dropped by the heal) took its
     * layout and groups. */
    int spec_whole = job->in.spec->layout && (!job->in.spec->ngroups || job->in.spec->groups);
    if (job->code && broke && reforms == ATTACH_REFORMS_MAX) {
      char cause[ZD__ERR_MSG_MAX];
      snprintf(cause, sizeof cause, "%s", err->msg);
      zd__errf(err, job->code, "the world broke %d times while this registration waited; last: %s",
               reforms + 1, cause);
    } else if (job->code && broke && spec_whole && can_heal(r) &&
               !atomic_load(&r->attach_abandoned)) {
      ZD_LOG_WARN(
          "registration: the world broke while it formed (%s); registering again once it "
          "has re-formed",
          err->msg);
      set_health(r, ZD__HEALTH_DEGRADED, "", err->msg);
      heal(r);
      zd__rank_stats_t st;
      zd__rank_stats(r, &st);
      if (st.health == ZD__HEALTH_OK) continue;
    }
    atomic_store(&r->attach_abandoned, 0); /* set for this registration only (its client left
                                              while it was queued or waiting) */
    if (job->code != ZD_OK) return;
    note_recovery(r, t0, resumed);
    const zd__layout_t *l = r->model->layout;
    r->ctx.resume_latest = 0; /* rolled back (or resumed): done */
    pthread_mutex_lock(&r->stats_lock);
    r->stats.resume_pending = 0;
    pthread_mutex_unlock(&r->stats_lock);
    job->out.attach.step = r->model->step;
    job->out.attach.resumed = resumed;
    job->out.attach.loss_scale = r->model->scaler.scale;
    job->out.attach.layout_hash = l->hash;
    job->out.attach.total_elems = l->total_elems;
    job->out.attach.nbuckets = l->nbuckets;
    job->out.attach.shard_elems = l->shard_elems;
    ZD_LOG_INFO("%s model: %u parameters, %" PRIu64 " elements in %u buckets, shard %" PRIu64
                " elements, step %" PRIu64,
                resumed ? "resumed" : "registered", l->nparams, l->total_elems, l->nbuckets,
                l->shard_elems, r->model->step);
    return;
  }
}

static void run_job(zd__rank_t *r, zd__job_t *job) {
  zd__err_t *err = &job->err;
  if (r->left) {
    job->code = zd__errf(err, ZD_ERANK, "%s", r->resized);
    return;
  }
  job->code = degraded(r, err);
  if (job->code) return;
  /* overlap_update: a scatter or a gather works beside the buckets in flight; every other job
   * reads or writes what the speculation thread holds meanwhile (model.h). */
  if (r->model && job->type != ZD__JOB_SCATTER && job->type != ZD__JOB_GATHER)
    zd__model_spec_wait(r->model);
  if (job->type == ZD__JOB_STAND_IN) {
    if (r->model) stand_in(r, job);
    return;
  }
  if (job->type != ZD__JOB_ATTACH && !r->model && r->resize_image) {
    job->code = zd__errf(err, ZD_EPEER, "%s", r->resized);
    return;
  }
  if (job->type != ZD__JOB_ATTACH && !r->model) {
    job->code = zd__errf(err, ZD_EORDER, "no model registered on rank %u", r->env.rank);
    return;
  }
  if (job->type != ZD__JOB_ATTACH && r->model->rejoin) {
    job->code = zd__errf(err, ZD_EPEER,
                         "rank %u: the world re-formed after a peer was lost; its model and state "
                         "are kept, and the trainer must register again (every rank does), which "
                         "continues at the newest step every rank holds",
                         r->env.rank);
    return;
  }
  switch (job->type) {
    case ZD__JOB_ATTACH:
      attach(r, job);
      break;
    case ZD__JOB_SCATTER:
      job->code = zd__model_scatter(&r->ctx, r->model, job->buffers, job->event_slot,
                                    job->in.bucket, job->next_groups, err);
      break;
    case ZD__JOB_GATHER:
      job->code =
          zd__model_gather(&r->ctx, r->model, job->buffers, job->event_slot, job->in.bucket, err);
      break;
    case ZD__JOB_STEP:
      job->code = zd__model_step(&r->ctx, r->model, job->buffers, job->event_slot,
                                 job->in.step.groups, job->in.step.scatter, job->in.step.gather,
                                 job->in.step.clip_norm, job->in.step.absent, &job->out.step, err);
      job->out.step.idle_cpus = step_idle_cpus(r);
      break;
    case ZD__JOB_CHECKPOINT:
      job->code =
          zd__model_checkpoint(&r->ctx, r->model, job->in.wait, job->out.checkpoint.dir,
                               sizeof job->out.checkpoint.dir, &job->out.checkpoint.step, err);
      break;
    case ZD__JOB_STAND_IN: /* above */
      break;
  }
}

const char *zd__health_name(zd__health_t health) {
  switch (health) {
    case ZD__HEALTH_OK:
      return "ok";
    case ZD__HEALTH_DEGRADED:
      return "degraded";
    case ZD__HEALTH_CONNECTING:
      return "connecting";
    case ZD__HEALTH_REJOINING:
      return "rejoining";
    case ZD__HEALTH_RESTORING:
      return "restoring";
  }
  return "unknown";
}

static void set_health(zd__rank_t *r, zd__health_t health, const char *prefix, const char *reason) {
  pthread_mutex_lock(&r->stats_lock);
  r->stats.health = health;
  char *out = r->stats.degraded_reason; /* prefix + reason, truncated to fit */
  size_t n = sizeof r->stats.degraded_reason, i = 0;
  for (const char *s = prefix; *s && i + 1 < n; s++) out[i++] = *s;
  for (const char *s = reason; *s && i + 1 < n; s++) out[i++] = *s;
  out[i] = '\0';
  pthread_mutex_unlock(&r->stats_lock);
}

/* cuda_step fast: a new NCCL communicator's waits sleep until the stream wakes them (compute.h),
 * like the backend's own; every communicator the rank takes (at its start, after a heal) gets the
 * waiter before its first wait. */
static void give_waiter(zd__rank_t *r, zd__comm_t *comm) {
#ifdef ZD_HAVE_CUDA
  void *waiter = r->device >= 0 && r->ctx.compute ? zd__compute_cuda_waiter(r->ctx.compute) : NULL;
  if (comm && waiter && !strcmp(comm->backend, "nccl")) zd__comm_nccl_set_waiter(comm, waiter);
  if (comm && waiter && !strcmp(comm->backend, "cuda-group"))
    zd__comm_cuda_group_set_waiter(comm, waiter);
#else
  (void)r;
  (void)comm;
#endif
}

/* The communicator and the compute backend are set under the lock: zd__rank_abort and
 * zd__rank_stream_idle read them from the loop thread. */
static void publish_comm(zd__rank_t *r, zd__comm_t *comm) {
  give_waiter(r, comm);
  pthread_mutex_lock(&r->lock);
  r->ctx.comm = comm;
  pthread_mutex_unlock(&r->lock);
}

static void note_resize(zd__rank_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* How long rank 0 gives the rendezvous store to take the world size record. */
#define RECORD_STORE_MS 2000

/* Joins the world before the first job runs; jobs queued meanwhile wait (or fail as degraded). */
static int can_heal(const zd__rank_t *r);

/* A world instance formed: the heartbeat watches the processes it formed with (rank.h). */
static void tell_formed(const zd__rank_t *r, const zd__world_member_t *member) {
  uint32_t n = __atomic_load_n(&r->env.world_size, __ATOMIC_RELAXED);
  if (!r->env.formed || !member || !n) return;
  uint64_t *inc = malloc(n * sizeof *inc);
  if (!inc) return; /* the heartbeat then goes by the registry alone */
  for (uint32_t i = 0; i < n; i++) inc[i] = zd__world_member_incarnation(member, i);
  r->env.formed(r->env.formed_ctx, inc, n);
  free(inc);
}

/* Rank 0: the world size record into the rendezvous store, for zerods that start again without
 * one in their state_dir (a failure is logged: the state_dirs still hold it). */
static void publish_record(const zd__rank_t *r, const zd__world_record_t *rec) {
  zd__err_t err = {0};
  if (zd__world_record_publish(r->world.rendezvous_address, r->world.control_token, rec,
                               RECORD_STORE_MS, &err))
    ZD_LOG_WARN("world size record (world_size=%u) not stored in the rendezvous store: %s",
                rec->world_size, err.msg);
}

/* A rank beyond the world size that a live resize's record gave at start (env.record): it stays
 * out of the world, as a rank that a resize left, and says why. */
static void stay_out(zd__rank_t *r) {
  const zd__world_record_t *rec = r->env.record;
  r->left = 1;
  pthread_mutex_lock(&r->stats_lock); /* a drain --leave reads it: already out */
  r->stats.left = 1;
  pthread_mutex_unlock(&r->stats_lock);
  snprintf(r->resized, sizeof r->resized,
           "rank %u is outside the world: a live resize after step %" PRIu64
           " made it %u ranks (from %u), which this zerod read from its world size record at "
           "start (world_size_record = use). Stop this trainer and zerod, or register it on a "
           "rank below %u",
           r->env.rank, rec->step, rec->world_size, rec->from, rec->world_size);
  set_health(r, ZD__HEALTH_DEGRADED, "", r->resized);
  note_resize(r, "step %" PRIu64 ": %u -> %u ranks; this rank left (world size record)", rec->step,
              rec->from, rec->world_size);
  ZD_LOG_WARN("%s", r->resized);
}

/* With checkpoints, a rank that could not join keeps trying (a zerod restarted before the others
 * noticed waits for them to re-form the world, which may take longer than one connect timeout);
 * without, it is degraded after the first failure, as a world that cannot heal. */
static void join_world(zd__rank_t *r) {
  zd__err_t err = {0};
  zd__comm_t *comm = NULL;
  zd__world_member_t *member = NULL;
  int rc;
  for (int attempt = 1;; attempt++) {
    rc =
        zd__world_connect(&r->world, r->env.rank, -1, NULL, &r->cancel, NULL, &comm, &member, &err);
    if (rc == ZD_OK || rc == -ECANCELED || !can_heal(r)) break;
    ZD_LOG_WARN("joining the world, attempt %d: %s; trying again", attempt, err.msg);
    for (int i = 0; i < 10 && !atomic_load(&r->cancel); i++) {
      struct timespec ts = {0, 100 * 1000000L};
      nanosleep(&ts, NULL);
    }
  }
  pthread_mutex_lock(&r->lock);
  r->ctx.member = member;
  pthread_mutex_unlock(&r->lock);
  publish_comm(r, comm);
  if (rc == ZD_OK) {
    tell_formed(r, member);
    set_health(r, ZD__HEALTH_OK, "", "");
    if (r->env.record && r->env.rank == 0) publish_record(r, r->env.record);
    return;
  }
  ZD_LOG_ERROR("rank degraded: joining the world failed: %s", err.msg);
  set_health(r, ZD__HEALTH_DEGRADED, "joining the world failed: ", err.msg);
}

static void publish_compute(zd__rank_t *r, zd__compute_t *compute) {
  pthread_mutex_lock(&r->lock);
  r->ctx.compute = compute;
  pthread_mutex_unlock(&r->lock);
}

/* The CUDA backend of the rank, on its worker thread (which keeps the device current): state
 * backend and stream, then the communicator on that stream: NCCL, or, where the world's ranks
 * share this GPU (ranks_per_gpu > 1), the in-process group communicator (world.c chooses). */
static void start_cuda(zd__rank_t *r) {
#ifdef ZD_HAVE_CUDA
  zd__err_t err = {0};
  const zd__world_t *w = &r->world;
  zd__compute_t *compute = NULL;
  int rc = zd__compute_cuda_create(r->device, w->collective_timeout_ms, r->env.cuda_fast, &compute,
                                   &err);
  if (rc == ZD_OK) publish_compute(r, compute);
  if (rc) {
    ZD_LOG_ERROR("rank degraded: the CUDA backend could not start on GPU %d: %s", r->device,
                 err.msg);
    set_health(r, ZD__HEALTH_DEGRADED, "the CUDA backend could not start: ", err.msg);
    return;
  }
  void *stream = zd__compute_cuda_stream(r->ctx.compute);
  zd__comm_t *comm = NULL;
  if (r->env.world_size == 1)
    rc = zd__comm_nccl_create(NULL, 0, 1, r->device, stream, w->connect_timeout_ms,
                              w->collective_timeout_ms, &r->cancel, &comm, &err);
  else {
    zd__world_member_t *member = NULL;
    rc = zd__world_connect(w, r->env.rank, r->device, stream, &r->cancel, NULL, &comm, &member,
                           &err);
    pthread_mutex_lock(&r->lock);
    r->ctx.member = member;
    pthread_mutex_unlock(&r->lock);
    if (rc == ZD_OK) tell_formed(r, member);
  }
  publish_comm(r, comm);
  if (rc == ZD_OK) {
    ZD_LOG_INFO("CUDA backend on GPU %d, %s communicator of %u rank(s) ready", r->device,
                strcmp(comm->backend, "nccl") ? "group" : "NCCL", r->env.world_size);
    set_health(r, ZD__HEALTH_OK, "", "");
    return;
  }
  ZD_LOG_ERROR("rank degraded: %s failed: %s",
               r->env.world_size == 1 ? "creating the NCCL communicator" : "joining the world",
               err.msg);
  set_health(r, ZD__HEALTH_DEGRADED,
             r->env.world_size == 1 ? "creating the NCCL communicator failed: "
                                    : "joining the world failed: ",
             err.msg);
#else
  set_health(r, ZD__HEALTH_DEGRADED, "", "this zerod was built without CUDA");
#endif
}

/* ---- a world that heals ------------------------------------------------------------------- */

/* With checkpoints, a state_dir or state snapshots there is a state to continue from: the world
 * re-forms. */
static int can_heal(const zd__rank_t *r) {
  return r->env.world_size > 1 &&
         (zd__ckptr_enabled(r->env.ckpt) || r->env.state_dir || zd__snapshot_enabled()) &&
         !atomic_load(&r->cancel);
}

/* The communicator failed (a collective found a peer gone, or the heartbeat declared a node
 * dead). With checkpoints, the world re-forms: the broken communicator is released, the rank
 * rejoins a new instance of the world (every surviving rank does the same, and a restarted zerod
 * joins it), and the model is dropped, so that the next registration on every rank resumes the
 * newest complete checkpoint: all ranks roll back to the same step. Without checkpoints there is
 * nothing consistent to roll back to, and the rank stays degraded, as before. The worker waits
 * here (jobs queue behind it) until the world is whole again or zerod shuts down. */
static void heal(zd__rank_t *r) {
  zd__rank_stats_t st;
  zd__rank_stats(r, &st);
  if (st.health != ZD__HEALTH_DEGRADED) { /* only a comm failure the jobs noticed degrades */
    set_health(r, ZD__HEALTH_DEGRADED, "", "a peer was declared dead by the heartbeat");
    zd__rank_stats(r, &st);
  }
  if (!can_heal(r)) return;
  char reason[ZD__ERR_MSG_MAX], stale[64] = "";
  snprintf(reason, sizeof reason, "%s", st.degraded_reason);
  if (r->ctx.member) snprintf(stale, sizeof stale, "%s", zd__world_member_id(r->ctx.member));
  /* state_dir: the model and its file stay; its last step attempt is void (nothing of it was
   * committed here, or the commit stands in the file), and the next registration compares what
   * the files hold with the other ranks' (step.c). Without, the model is dropped and every rank
   * resumes the newest complete checkpoint. */
  int keep = r->model && r->model->file;
  ZD_LOG_WARN("re-forming the world after: %s (%s)", reason,
              keep ? "the model and its state file are kept: the next registration continues at "
                     "the newest step every rank holds"
              : zd__snapshot_enabled()
                  ? "the model is dropped: every rank resumes the newest state snapshot every "
                    "rank holds (else the newest complete checkpoint) at its next registration"
                  : "the model is dropped: every rank resumes the newest complete checkpoint at "
                    "its next registration");
  set_health(r, ZD__HEALTH_REJOINING, "re-forming the world after: ", reason);
  zd__ckptr_world_broke(r->env.ckpt);
  uint64_t t0 = zd__now_ms();
  if (!r->lost_ms) r->lost_ms = t0;
  if (keep) {
    zd__model_t *m = r->model;
    zd__model_spec_wait(m);
    uint32_t nb = m->layout->nbuckets;
    memset(m->scattered, 0, nb);
    memset(m->attempted, 0, nb);
    memset(m->ungathered, 0, nb);
    memset(m->speculated, 0, nb);
    m->has_next_groups = 0;
    m->abandoned = 1;
    m->rejoin = 1;
  } else {
    zd__model_free(r->model);
    r->model = NULL;
  }
  zd__comm_t *old = r->ctx.comm;
  publish_comm(r, NULL);
  zd__comm_destroy(old);
  pthread_mutex_lock(&r->lock); /* zd__rank_peer_dead reads the membership under it */
  zd__world_member_t *gone = r->ctx.member;
  r->ctx.member = NULL;
  pthread_mutex_unlock(&r->lock);
  zd__world_member_free(gone);
  pthread_mutex_lock(&r->stats_lock);
  r->stats.has_model = keep;
  r->stats.resume_pending = !keep;
  pthread_mutex_unlock(&r->stats_lock);
  r->ctx.resume_latest = 1;
  for (int attempt = 1; !atomic_load(&r->cancel); attempt++) {
    zd__err_t err = {0};
    zd__comm_t *comm = NULL;
    zd__world_member_t *member = NULL;
    void *stream = NULL;
#ifdef ZD_HAVE_CUDA
    if (r->device >= 0) stream = zd__compute_cuda_stream(r->ctx.compute);
#endif
    int rc = zd__world_connect(&r->world, r->env.rank, r->device, stream, &r->cancel,
                               stale[0] ? stale : NULL, &comm, &member, &err);
    if (rc == ZD_OK) {
      give_waiter(r, comm);
      pthread_mutex_lock(&r->lock);
      r->peer_failed = 0; /* the heartbeat's verdicts so far were about the old instance; a new
                             one from now on aborts the new communicator and is kept */
      r->ctx.comm = comm;
      r->ctx.member = member;
      pthread_mutex_unlock(&r->lock);
      tell_formed(r, member);
      pthread_mutex_lock(&r->stats_lock);
      r->stats.heals++;
      pthread_mutex_unlock(&r->stats_lock);
      set_health(r, ZD__HEALTH_OK, "", "");
      ZD_LOG_INFO("world re-formed in %" PRIu64 " ms; waiting for the trainers to register (%s)",
                  zd__now_ms() - t0,
                  keep                     ? "the ranks' state files give the step"
                  : zd__snapshot_enabled() ? "they resume the newest state snapshot every rank "
                                             "holds, else the newest complete checkpoint"
                                           : "they resume the newest complete checkpoint");
      return;
    }
    ZD_LOG_WARN("re-forming the world, attempt %d: %s", attempt, err.msg);
    for (int i = 0; i < 10 && !atomic_load(&r->cancel); i++) { /* 1 s, cancellable */
      struct timespec ts = {0, 100 * 1000000L};
      nanosleep(&ts, NULL);
    }
  }
  /* Shut down before the world re-formed: no communicator. The jobs still queued (a trainer's
   * register) must be refused as degraded, not run against a NULL communicator. */
  set_health(r, ZD__HEALTH_DEGRADED, "zerod shut down while re-forming the world after: ", reason);
}

static void peer_lost(zd__rank_t *r) {
  if (r->env.world_size > 1) heal(r);
}

/* ---- jobs answered before their work ended (cuda_step fast) ---------------------------------- */

/* The GPU timing the backend has read so far, for status. */
static void publish_times(zd__rank_t *r) {
  zd__compute_t *c = r->ctx.compute;
  if (!c || !c->ops->phase_times) return;
  zd__phase_times_t times;
  c->ops->phase_times(c, &times);
  pthread_mutex_lock(&r->stats_lock);
  r->stats.gpu_times = times;
  pthread_mutex_unlock(&r->stats_lock);
}

/* Hands every settling job to its done callback, oldest first. */
static void settled(zd__rank_t *r) {
  while (r->settling_head) {
    zd__job_t *job = r->settling_head;
    r->settling_head = job->next;
    if (!r->settling_head) r->settling_tail = NULL;
    job->next = NULL;
    job->done(job);
  }
}

/* Whether the work the settling jobs left on the stream has completed (wait 0: a query; wait 1:
 * the bounded wait); if so, or if it failed (the next job's begin reports that), they are done.
 * Returns 1 while they still wait. */
static int settle(zd__rank_t *r, int wait) {
  zd__compute_t *c = r->ctx.compute;
  if (!r->settling_head) return 0;
  /* overlap_update: a step without its gather is answered before the speculation thread has
   * written its parameters into the client's buffer (model.h): done, so that the session may
   * release the buffer, once those writes have ended. */
  if (r->model && zd__model_params_pending(r->model)) {
    if (!wait) return 1;
    zd__model_spec_wait(r->model);
  }
  zd__err_t err = {0};
  int rc = c && c->ops->settle && r->ctx.comm ? c->ops->settle(c, r->ctx.comm, wait, &err) : 0;
  if (rc == -EAGAIN) return 1;
  if (rc) ZD_LOG_ERROR("the GPU work of a request already answered failed: %s", err.msg);
  publish_times(r); /* the timing events it found complete */
  settled(r);
  return 0;
}

/* A job ran and its stats are published: answer it, and hand it over once its work is done
 * (at once, unless a finish_early left it running), after the jobs that ran before it. */
static void job_ran(zd__rank_t *r, zd__job_t *job) {
  if (job->answer) job->answer(job);
  job->next = NULL;
  if (r->settling_tail)
    r->settling_tail->next = job;
  else
    r->settling_head = job;
  r->settling_tail = job;
  settle(r, 0);
}

/* ---- live resize (resize.h) ----------------------------------------------------------------- */

static void note_resize(zd__rank_t *r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  pthread_mutex_lock(&r->stats_lock);
  vsnprintf(r->stats.last_resize, sizeof r->stats.last_resize, fmt, ap);
  pthread_mutex_unlock(&r->stats_lock);
  va_end(ap);
}

/* A resize committed (the image is taken, the old world is gone): the world size record, in the
 * state_dir of every rank and, from rank 0, in the rendezvous store (world_record.h), so that a
 * zerod that starts again joins the world at its new size. A failure is logged, not fatal: the
 * resize goes on, and a zerod restarted later reads its configured size. */
static void record_resize(zd__rank_t *r, const zd__world_record_t *rec) {
  zd__err_t err = {0};
  char tag[32];
  snprintf(tag, sizeof tag, "rank%u", r->env.rank);
  if (r->env.record_dir && zd__world_record_write(r->env.record_dir, tag, rec, &err))
    ZD_LOG_WARN("live resize: the world size record was not written: %s", err.msg);
  if (r->env.rank == 0) publish_record(r, rec);
  zd__buddy_resized(r->env.local_rank, rec->world_size);
}

/* The ranks agreed at the last step to resize the world (r->resize_agreed); every rank runs this
 * before its next job other than a gather, so that the step's gathers are done. The image is
 * taken over the old world (a failure there, a peer's death, breaks the communicator: the world
 * heals at its old size as after any failure, the model kept); then the old communicator goes,
 * and a rank of the new world re-forms it at the new size, holding the image for its trainer's
 * registration, while a rank beyond it leaves: its trainer's requests fail with ZD_ERANK. */
static void resize_world(zd__rank_t *r) {
  uint32_t to = r->resize_agreed, from = r->env.world_size;
  r->resize_agreed = 0;
  atomic_store(&r->resize_want, 0);
  uint64_t t0 = zd__now_ms(), step = r->model->step;
  zd__err_t err = {0};
  settle(r, 1);
  zd__model_spec_wait(r->model); /* overlap_update: no speculative update runs beside the copy */
  zd__resize_image_t *img = NULL;
  ZD_LOG_INFO("live resize after step %" PRIu64 ": %u -> %u ranks", step, from, to);
  int rc = zd__resize_take(&r->ctx, r->model, to, &img, &err);
  if (rc) {
    ZD_LOG_ERROR("live resize after step %" PRIu64 " (%u -> %u ranks) failed: %s", step, from, to,
                 err.msg);
    note_resize(r, "step %" PRIu64 ": %u -> %u ranks failed: %s (the world stays at %u ranks)",
                step, from, to, err.msg, from);
    pthread_mutex_lock(&r->stats_lock);
    r->stats.resizes++;
    r->stats.resize_agreed = 0;
    pthread_mutex_unlock(&r->stats_lock);
    zd__comm_abort(r->ctx.comm, ZD_EPEER, "a live resize failed");
    return; /* the worker finds the communicator broken and heals */
  }
  zd__model_free(r->model);
  r->model = NULL;
  r->resize_stale[0] = 0;
  if (r->ctx.member)
    snprintf(r->resize_stale, sizeof r->resize_stale, "%s", zd__world_member_id(r->ctx.member));
  zd__comm_t *old = r->ctx.comm;
  publish_comm(r, NULL);
  zd__comm_destroy(old);
  pthread_mutex_lock(&r->lock);
  zd__world_member_t *gone = r->ctx.member;
  r->ctx.member = NULL;
  pthread_mutex_unlock(&r->lock);
  zd__world_member_free(gone);
  /* The record first: once status shows the new size, a zerod started for it finds it. */
  record_resize(r, &(zd__world_record_t){.world_size = to, .from = from, .step = step});
  pthread_mutex_lock(&r->stats_lock);
  r->stats.has_model = 0;
  /* atomic: zd__rank_peer_dead reads it on the heartbeat's thread (verdict_applies) */
  __atomic_store_n(&r->env.world_size, to, __ATOMIC_RELAXED);
  r->ctx.world_size = to;
  r->world.world_size = to;
  r->stats.resizes++;
  r->stats.resize_agreed = 0;
  r->stats.left = r->env.rank >= to;
  pthread_mutex_unlock(&r->stats_lock);
  if (r->env.rank >= to) {
    zd__resize_image_free(img);
    r->left = 1;
    snprintf(r->resized, sizeof r->resized,
             "rank %u left the world: it was resized from %u to %u ranks after step %" PRIu64
             " (zeroctl resize or drain --leave); its shard went to the ranks that stay. Stop "
             "this trainer, or register it on a rank below %u",
             r->env.rank, from, to, step, to);
    set_health(r, ZD__HEALTH_DEGRADED, "", r->resized);
    note_resize(r, "step %" PRIu64 ": %u -> %u ranks in %" PRIu64 " ms; this rank left", step, from,
                to, zd__now_ms() - t0);
    ZD_LOG_WARN("%s", r->resized);
    return;
  }
  zd__ckptr_set_world_size(r->env.ckpt, to);
  r->resize_image = img;
  r->resize_from = from;
  r->resize_step = step;
  r->resize_t0 = t0;
  pthread_mutex_lock(&r->lock);
  r->resize_forming = 1;
  r->resize_lost = 0;
  pthread_mutex_unlock(&r->lock);
  snprintf(r->resized, sizeof r->resized,
           "rank %u: the world was resized from %u to %u ranks after step %" PRIu64
           " (zeroctl resize): register again (every rank of the new world does), which continues "
           "at step %" PRIu64 " with the new layout",
           r->env.rank, from, to, step, step);
  set_health(r, ZD__HEALTH_REJOINING, "re-forming the world after: ", "a live resize");
}

/* The second half of a resize on a rank of the new world, after the job that found it was
 * answered (a grown world waits here for zerods that start after the trainers saw the resize):
 * re-forms the world at the new size. Jobs queue behind it, as behind a heal. */
static void resize_form(zd__rank_t *r) {
  uint32_t to = r->env.world_size;
  zd__err_t err = {0};
  for (int attempt = 1; !atomic_load(&r->cancel); attempt++) {
    zd__comm_t *comm = NULL;
    zd__world_member_t *member = NULL;
    /* A world shrunk to one rank (drain --leave) has nobody to meet: the world-size-1
     * communicator, as a zerod started alone has. */
    int rc =
        to == 1
            ? (zd__comm_local_create(&comm) ? zd__errf(&err, -ENOMEM, "out of memory") : ZD_OK)
            : zd__world_connect(&r->world, r->env.rank, -1, NULL, &r->cancel,
                                r->resize_stale[0] ? r->resize_stale : NULL, &comm, &member, &err);
    if (rc == ZD_OK) {
      give_waiter(r, comm);
      pthread_mutex_lock(&r->lock);
      r->peer_failed = 0;
      r->ctx.comm = comm;
      r->ctx.member = member;
      r->resize_forming = 0;
      pthread_mutex_unlock(&r->lock);
      tell_formed(r, member);
      set_health(r, ZD__HEALTH_OK, "", "");
      note_resize(r, "step %" PRIu64 ": %u -> %u ranks in %" PRIu64 " ms", r->resize_step,
                  r->resize_from, to, zd__now_ms() - r->resize_t0);
      ZD_LOG_INFO("live resize: world of %u ranks formed in %" PRIu64
                  " ms; waiting for the trainers to register",
                  to, zd__now_ms() - r->resize_t0);
      return;
    }
    ZD_LOG_WARN("live resize: forming the world of %u ranks, attempt %d: %s", to, attempt, err.msg);
    for (int i = 0; i < 10 && !atomic_load(&r->cancel); i++) {
      struct timespec ts = {0, 100 * 1000000L};
      nanosleep(&ts, NULL);
    }
  }
  set_health(r, ZD__HEALTH_DEGRADED, "zerod shut down during a live resize", "");
}

int zd__rank_request_resize(zd__rank_t *r, uint32_t world_size, zd__err_t *err) {
  if (r->device >= 0) return zd__errf(err, ZD_EBACKEND, "a live resize needs the CPU backend");
  if (world_size < 1 || world_size > 0xffff)
    return zd__errf(err, ZD_ECONFIG, "world_size %u: a live resize keeps 1 to 65535 ranks",
                    world_size);
  /* the loop's thread: the worker writes both (left under stats_lock, world_size atomically) */
  pthread_mutex_lock(&r->stats_lock);
  int left = r->stats.left;
  pthread_mutex_unlock(&r->stats_lock);
  if (__atomic_load_n(&r->env.world_size, __ATOMIC_RELAXED) < 2 || left)
    return zd__errf(err, ZD_EORDER, "rank %u is not in a multi-rank world", r->env.rank);
  atomic_store(&r->resize_want, world_size);
  return ZD_OK;
}

void zd__rank_withdraw_resize(zd__rank_t *r) {
  atomic_store(&r->resize_want, 0);
}

/* An idle worker with settling jobs looks this often whether their work has completed. */
#define SETTLE_POLL_US 500

static void *worker_main(void *arg) {
  zd__rank_t *r = arg;
  zd__log_set_rank((int)r->env.rank);
  if (r->env.rank >= r->env.world_size)
    stay_out(r);
  else if (r->device >= 0)
    start_cuda(r);
  else if (!r->ctx.comm)
    join_world(r);
  /* A world of one (a leave's) joins nothing that would store the record: its first job does,
   * once the loop that serves the store runs (it does not yet while the daemon starts). */
  int record_pending = r->ctx.comm && r->env.record && r->env.rank == 0;
  pthread_mutex_lock(&r->lock);
  for (;;) {
    while (!r->head && !r->stop && !r->peer_failed) {
      if (!r->settling_head) {
        pthread_cond_wait(&r->cond, &r->lock);
        continue;
      }
      /* Answered jobs whose work still runs: look every SETTLE_POLL_US whether it ran out, so
       * that their sessions may release the client's buffers soon after (rank.h, job->done). */
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += SETTLE_POLL_US * 1000L;
      if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
      }
      pthread_cond_timedwait(&r->cond, &r->lock, &ts);
      pthread_mutex_unlock(&r->lock);
      settle(r, 0);
      pthread_mutex_lock(&r->lock);
    }
    if (r->peer_failed && !r->stop) {
      r->peer_failed = 0;
      pthread_mutex_unlock(&r->lock);
      settle(r, 1); /* before the communicator is released (the abort ends the wait) */
      /* The verdict aborted the communicator; an idle one does not know it failed until a
       * collective runs on it, and a world whose trainers only reattach runs none: heal now. */
      peer_lost(r);
      pthread_mutex_lock(&r->lock);
      continue;
    }
    zd__job_t *job = r->head;
    if (!job) break; /* stop requested and the queue is drained */
    r->head = job->next;
    if (!r->head) r->tail = NULL;
    r->busy = 1;
    pthread_mutex_unlock(&r->lock);
    job->next = NULL;
    if (record_pending) {
      record_pending = 0;
      publish_record(r, r->env.record);
    }
    if (r->resize_agreed && r->model && job->type != ZD__JOB_GATHER &&
        job->type != ZD__JOB_STAND_IN)
      resize_world(r);
    run_job(r, job);
    publish(r, job);
    int broken = r->env.world_size > 1 && zd__comm_failed(r->ctx.comm);
    job_ran(r, job);
    if (r->resize_image && !r->ctx.comm && !broken) resize_form(r); /* jobs queued wait */
    if (broken) settle(r, 1); /* the broken communicator's sync returns at once */
    if (broken) heal(r);      /* jobs queued meanwhile wait for it */
    pthread_mutex_lock(&r->lock);
    r->busy = 0;
  }
  pthread_mutex_unlock(&r->lock);
  settle(r, 1); /* the last answered jobs: bounded */
  /* The state, the communicator and the backend are released by the thread that used them (with
   * CUDA, the one whose current device is the rank's). */
  zd__model_free(r->model);
  r->model = NULL;
  zd__resize_image_free(r->resize_image);
  r->resize_image = NULL;
  zd__comm_t *comm = r->ctx.comm;
  publish_comm(r, NULL);
  zd__comm_destroy(comm);
  zd__world_member_free(r->ctx.member);
  r->ctx.member = NULL;
  zd__compute_t *compute = r->ctx.compute;
  publish_compute(r, NULL);
  zd__compute_destroy(compute);
  return NULL;
}

int zd__rank_create(const zd__rank_env_t *env, zd__rank_t **out) {
  zd__rank_t *r = calloc(1, sizeof *r);
  if (!r) return -ENOMEM;
  r->env = *env;
  r->ctx = (zd__step_ctx_t){
      .rank = env->rank,
      .local_rank = env->local_rank,
      .world_size = env->world_size,
      .comm = env->comm,
      .ckpt = env->ckpt,
      .overlap_update = env->overlap_update,
      .state_dir = env->state_dir,
  };
  r->ctx.attach_abandoned = &r->attach_abandoned;
  r->ctx.resize_want = &r->resize_want;
  r->ctx.resize_agreed = &r->resize_agreed;
  r->ctx.resize_image = &r->resize_image;
  if (env->world) {
    r->world = *env->world;
    r->has_world = 1;
  }
  r->device = env->gpu ? env->gpu->device : -1;
  if (r->device < 0 && zd__compute_cpu_create(env->pool, env->isa, &r->ctx.compute) != 0) {
    free(r);
    return -ENOMEM;
  }
  r->stats.health = env->comm ? ZD__HEALTH_OK : ZD__HEALTH_CONNECTING;
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
    zd__compute_destroy(r->ctx.compute);
    free(r);
    return -rc;
  }
  *out = r;
  return ZD_OK;
}

void zd__rank_destroy(zd__rank_t *r) {
  if (!r) return;
  atomic_store(&r->cancel, 1);
  pthread_mutex_lock(&r->lock);
  r->stop = 1;
  pthread_cond_signal(&r->cond);
  pthread_mutex_unlock(&r->lock);
  pthread_join(r->thread, NULL); /* which released the model, communicator and backend */
  free(r->ranges);
  pthread_mutex_destroy(&r->stats_lock);
  pthread_cond_destroy(&r->cond);
  pthread_mutex_destroy(&r->lock);
  free(r);
}

void zd__rank_abandon_attach(zd__rank_t *r) {
  atomic_store(&r->attach_abandoned, 1);
}

/* How a shutdown fails the collective in progress (r->lock held): without a state_dir the step is
 * lost with zerod (-ECANCELED); with one, the committed state stays in the state file for the next
 * zerod, and ZD_ECLOSED has the trainer register again there (zd_rejoin), as after a crash. */
static void abort_for_shutdown(zd__rank_t *r) {
  if (r->env.state_dir)
    zd__comm_abort(r->ctx.comm, ZD_ECLOSED,
                   "zerod is stopping (a planned stop); its state_dir keeps the committed state "
                   "for the next zerod: register again there (zd_rejoin)");
  else
    zd__comm_abort(r->ctx.comm, -ECANCELED, "zerod is shutting down");
}

void zd__rank_cancel(zd__rank_t *r) {
  atomic_store(&r->cancel, 1);
  pthread_mutex_lock(&r->lock);
  if (r->standing_in) abort_for_shutdown(r);
  pthread_mutex_unlock(&r->lock);
}

void zd__rank_abort(zd__rank_t *r) {
  zd__rank_cancel(r);
  pthread_mutex_lock(&r->lock);
  abort_for_shutdown(r);
  pthread_mutex_unlock(&r->lock);
}

/* Whether a verdict is about the instance this rank is in (r->lock held). */
static int verdict_applies(const zd__rank_t *r, uint32_t peer_rank, zd__verdict_t verdict,
                           uint64_t incarnation) {
  if (!incarnation) return 1;   /* a process of unknown identity: assume it is ours */
  if (!r->ctx.member) return 0; /* re-forming: the new instance waits for the new process */
  if (peer_rank >= __atomic_load_n(&r->env.world_size, __ATOMIC_RELAXED))
    return 0; /* a node a live resize left outside */
  uint64_t formed_with = zd__world_member_incarnation(r->ctx.member, peer_rank);
  if (verdict == ZD__VERDICT_REPLACED) return formed_with != incarnation;
  return !formed_with || formed_with == incarnation; /* silent: ours, unless formed with another */
}

/* A peer of the new world died while this rank re-forms it after a live resize (r->lock held):
 * the world waits for that zerod to start again (it finds the world size record); the status
 * and the log say so, once per peer, instead of a silent wait. */
static void lost_while_forming(zd__rank_t *r, uint32_t peer_rank, const char *why) {
  uint32_t w = __atomic_load_n(&r->env.world_size, __ATOMIC_RELAXED);
  if (!r->resize_forming || peer_rank >= w || peer_rank == r->env.rank ||
      r->resize_lost == peer_rank + 1)
    return;
  r->resize_lost = peer_rank + 1;
  char reason[ZD__ERR_MSG_MAX];
  snprintf(reason, sizeof reason,
           "the zerod of rank %u was lost (%s) while the world of %u ranks re-forms after a "
           "live resize; waiting for it to start again (its state_dir or the rendezvous store "
           "gives it the new size)",
           peer_rank, why, w);
  set_health(r, ZD__HEALTH_REJOINING, "re-forming the world after a live resize: ", reason);
  ZD_LOG_WARN("%s", reason);
}

void zd__rank_peer_dead(zd__rank_t *r, uint32_t peer_rank, zd__verdict_t verdict,
                        uint64_t incarnation, const char *why) {
  pthread_mutex_lock(&r->lock);
  if (!r->ctx.member) lost_while_forming(r, peer_rank, why);
  if (!verdict_applies(r, peer_rank, verdict, incarnation)) {
    pthread_mutex_unlock(&r->lock);
    ZD_LOG_DEBUG("heartbeat verdict not about this world instance, ignored: %s", why);
    return;
  }
  zd__comm_abort(r->ctx.comm, ZD_EPEER, why);
  zd__world_member_break(r->ctx.member, why); /* a registration waiting for the others gives up */
  zd__ckptr_world_broke(r->env.ckpt);         /* a checkpoint waiting for the dead node gives up */

  if (r->ctx.comm && !r->peer_failed) {
    r->peer_failed = 1;
    pthread_cond_signal(&r->cond); /* an idle worker degrades and heals at once */
  }
  pthread_mutex_unlock(&r->lock);
}

int zd__rank_run_inline(zd__rank_t *r, zd__job_t *job) {
  /* Jobs that may wait for the disk never run on the loop thread: a checkpoint, and a step when
   * checkpoints are on (its snapshot waits for the rank's previous write). */
  if (!atomic_load(&r->inline_ok) || job->type == ZD__JOB_ATTACH ||
      job->type == ZD__JOB_CHECKPOINT || zd__ckptr_enabled(r->env.ckpt))
    return 0;
  pthread_mutex_lock(&r->lock);
  int idle = !r->head && !r->busy && !r->stop;
  if (idle) r->busy = 1;
  pthread_mutex_unlock(&r->lock);
  if (!idle) return 0;
  job->rank = r;
  run_job(r, job);
  publish(r, job);
  /* Only the loop thread submits jobs, and it was here: nothing was queued meanwhile. */
  pthread_mutex_lock(&r->lock);
  r->busy = 0;
  pthread_mutex_unlock(&r->lock);
  return 1;
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

int zd__rank_cuda_fast(const zd__rank_t *r) {
  return r->device >= 0 && r->env.cuda_fast;
}

int zd__rank_idle(zd__rank_t *r) {
  pthread_mutex_lock(&r->lock);
  int idle = !r->head && !r->busy;
  pthread_mutex_unlock(&r->lock);
  return idle;
}

int zd__rank_stream_idle(zd__rank_t *r) {
  pthread_mutex_lock(&r->lock); /* the backend stays while the lock is held (worker_main) */
  zd__compute_t *c = r->ctx.compute;
  int idle = 1;
  if (r->head)
    idle = 0; /* jobs queued: they may queue work on the stream at any moment */
  else if (c && c->ops->stream_idle)
    idle = c->ops->stream_idle(c);
  pthread_mutex_unlock(&r->lock);
  return idle;
}

void zd__rank_stats(zd__rank_t *r, zd__rank_stats_t *out) {
  pthread_mutex_lock(&r->stats_lock);
  *out = r->stats;
  pthread_mutex_unlock(&r->stats_lock);
}

int zd__rank_shard_ranges(zd__rank_t *r, zd__shard_range_t **out, uint32_t *n) {
  int rc = ZD_OK;
  *out = NULL;
  *n = 0;
  pthread_mutex_lock(&r->stats_lock);
  if (r->nranges) {
    *out = malloc(r->nranges * sizeof **out);
    if (*out) {
      memcpy(*out, r->ranges, r->nranges * sizeof **out);
      *n = r->nranges;
    } else {
      rc = -ENOMEM;
    }
  }
  pthread_mutex_unlock(&r->stats_lock);
  return rc;
}

uint32_t zd__rank_local(const zd__rank_t *r) {
  return r->env.local_rank;
}
uint32_t zd__rank_global(const zd__rank_t *r) {
  return r->env.rank;
}
uint32_t zd__rank_world_size(const zd__rank_t *r) {
  pthread_mutex_lock((pthread_mutex_t *)&r->stats_lock);
  uint32_t w = r->env.world_size;
  pthread_mutex_unlock((pthread_mutex_t *)&r->stats_lock);
  return w;
}
const zd__gpu_info_t *zd__rank_gpu(const zd__rank_t *r) {
  return r->env.gpu;
}

uint64_t zd__rank_state_bytes(zd__states_t states, uint64_t shard_elems, uint32_t sets) {
  return (uint64_t)__builtin_popcount(states) * shard_elems * sizeof(float) * (sets ? sets : 1);
}

void zd__rank_status(void *ctx, zd__status_t *st) {
  zd__rank_t *r = ctx;
  zd__rank_stats_t s;
  zd__rank_stats(r, &s);
  char name[32];
  snprintf(name, sizeof name, "rank %u", r->env.rank);
  zd__status_section(st, name);
  zd__status_add(st, "rank", "%u", r->env.rank);
  zd__status_add(st, "local_rank", "%u", r->env.local_rank);
  zd__status_add(st, "health", "%s", zd__health_name(s.health));
  const zd__gpu_info_t *g = r->env.gpu;
  if (g) {
    zd__status_add(st, "device", "%d", g->device);
    zd__status_add(st, "gpu", "%s", g->name);
    zd__status_add(st, "gpu_uuid", "%s", g->uuid_str);
    zd__status_add(st, "cuda_step", "%s", r->env.cuda_fast ? "fast" : "legacy");
  }
  if (s.health == ZD__HEALTH_DEGRADED || s.health == ZD__HEALTH_REJOINING ||
      s.health == ZD__HEALTH_RESTORING)
    zd__status_add(st, "degraded_reason", "%s", s.degraded_reason);
  zd__status_add(st, "model", "%s", s.has_model ? "registered" : "none");
  if (!s.has_model) return;
  zd__status_add(st, "params", "%u", s.nparams);
  zd__status_add(st, "buckets", "%u", s.nbuckets);
  zd__status_add(st, "layout_hash", "%016" PRIx64, s.layout_hash);
  zd__status_add(st, "total_elems", "%" PRIu64, s.total_elems);
  zd__status_add(st, "shard_elems", "%" PRIu64, s.shard_elems);
  zd__status_add(st, "state_bytes", "%" PRIu64,
                 zd__rank_state_bytes(s.states, s.shard_elems, s.state_sets));
  zd__status_add(st, "grad_shard_bytes", "%" PRIu64, s.grad_shard_bytes);
  /* "<name>_bytes" of each optimizer's state array: 0 when the model lacks it */
#define OPTIONAL_BYTES(role, aname, always, legacy)                                        \
  if (!(always))                                                                           \
    zd__status_add(st, aname "_bytes", "%" PRIu64,                                         \
                   s.states &ZD__STATE_BIT(ZD__STATE_##role)                               \
                       ? s.shard_elems * sizeof(float) * (s.state_sets ? s.state_sets : 1) \
                       : 0);
  ZD__STATE_ARRAYS(OPTIONAL_BYTES)
#undef OPTIONAL_BYTES
  zd__status_add(st, "param_dtype", "%s", zd_dtype_name(s.param_dtype));
  zd__status_add(st, "grad_dtype", "%s", zd_dtype_name(s.grad_dtype));
  zd__status_add(st, "step", "%" PRIu64, s.step);
  zd__status_add(st, "steps_skipped", "%" PRIu64, s.steps_skipped);
  /* parameters skipped in some step (no gradient on any rank), whose own step count is behind */
  zd__status_add(st, "params_lagging", "%u", s.params_lagging);
  zd__status_add(st, "loss_scale", "%g", s.loss_scale);
  zd__status_add(st, "last_grad_norm", "%g", s.last_grad_norm);
  zd__status_add(st, "last_clip_coef", "%g", s.last_clip_coef);
  zd__status_add(st, "last_step_us", "%" PRIu64, s.last_step_us);
  zd__status_add(st, "mean_step_us", "%" PRIu64, s.steps_run ? s.total_step_us / s.steps_run : 0);
  zd__status_add(st, "scatters", "%" PRIu64, s.scatters);
  zd__status_add(st, "gathers", "%" PRIu64, s.gathers);
  /* overlap_update: two sets of the state arrays (state_bytes counts both), the committed one, and
   * what became of the buckets' speculative updates */
  zd__status_add(st, "state_sets", "%u", s.state_sets);
  zd__status_add(st, "committed_set", "%u", s.committed_set);
  zd__status_add(st, "overlap_buckets_committed", "%" PRIu64, s.spec_committed);
  zd__status_add(st, "overlap_buckets_recomputed", "%" PRIu64, s.spec_recomputed);
  zd__status_add(st, "heals", "%" PRIu64, s.heals);
  zd__status_add(st, "total_step_us", "%" PRIu64, s.total_step_us);
  zd__status_add(st, "scatter_us", "%" PRIu64, s.scatter_us);
  zd__status_add(st, "update_us", "%" PRIu64, s.update_us);
  zd__status_add(st, "gather_us", "%" PRIu64, s.gather_us);
  zd__status_add(st, "collective_bytes", "%" PRIu64, s.collective_bytes);
  zd__status_add(st, "collective_us", "%" PRIu64, s.collective_us);
  if (g) { /* the GPU's own clock (timing events): steps counted some time after they ran */
    const zd__phase_times_t *t = &s.gpu_times;
    zd__status_add(st, "cuda_steps_timed", "%" PRIu64, t->steps);
    zd__status_add(st, "cuda_scatter_us_total", "%" PRIu64, (uint64_t)llround(t->scatter_us));
    zd__status_add(st, "cuda_stats_us_total", "%" PRIu64, (uint64_t)llround(t->stats_us));
    zd__status_add(st, "cuda_update_us_total", "%" PRIu64, (uint64_t)llround(t->update_us));
    zd__status_add(st, "cuda_gather_us_total", "%" PRIu64, (uint64_t)llround(t->gather_us));
  }
  /* "count count ..." per bucket of ZD__STEP_HIST_BOUNDS_US, then the longer ones */
  char hist[ZD__STEP_HIST_BUCKETS * 21 + 1];
  size_t used = 0;
  for (uint32_t h = 0; h <= ZD__STEP_HIST_BUCKETS; h++)
    used += (size_t)snprintf(hist + used, sizeof hist - used, "%s%" PRIu64, h ? " " : "",
                             s.step_hist[h]);
  zd__status_add(st, "step_histogram", "%s", hist);
  if (s.resume_pending) zd__status_add(st, "resume_pending", "%s", "newest complete checkpoint");
  if (s.state_path[0]) {
    zd__status_add(st, "state_file", "%s", s.state_path);
    zd__status_add(st, "state_committed_step", "%" PRIu64, s.state_committed_step);
  }
  if (zd__snapshot_enabled()) { /* state_dir_mode = snapshot: the newest snapshot written */
    zd__snapshot_rank_status_t sn;
    zd__snapshot_rank_status(r->env.local_rank, &sn);
    if (sn.has) {
      zd__status_add(st, "snapshot_step", "%" PRIu64, sn.step);
      zd__status_add(st, "snapshot_age_ms", "%" PRIu64, sn.age_ms);
      zd__status_add(st, "snapshot_bytes", "%" PRIu64, sn.bytes);
    } else {
      zd__status_add(st, "snapshot_step", "none");
    }
  }
  if (s.recovery[0]) { /* the last recovery: how, at which step, how long */
    zd__status_add(st, "last_recovery", "%s", s.recovery);
    zd__status_add(st, "last_recovery_step", "%" PRIu64, s.recovery_step);
    zd__status_add(st, "last_recovery_ms", "%" PRIu64, s.recovery_ms);
    if (s.recovery_note[0]) zd__status_add(st, "last_recovery_note", "%s", s.recovery_note);
  }
}
