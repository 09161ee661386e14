/* Checkpointer (checkpoint.h): requests, snapshots, the background writer, the completion of a
 * checkpoint across the world and the resume.
 *
 * Threads: the workers of the local ranks call wants/take/resume; the loop calls request/tick
 * (and gRPC handlers request through the loop); the writer thread waits for each snapshot's copy
 * (the backend's fence) and writes rank files in the order they were snapshotted; the finisher
 * thread (only where global rank 0 lives) waits for every rank's entry and writes the manifest.
 * Everything shared is under `lock`.
 *
 * Every wait is bounded by the checkpoint timeout (the collective timeout): a worker waiting for
 * its rank's previous write, for its own write (zd_checkpoint's wait), for a resume's copy to the
 * GPU; the writer waiting for a snapshot's copy. A copy whose wait timed out may still be running:
 * its staging memory is then poisoned, never freed nor reused (a DMA into freed memory).
 */
#include "checkpoint.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "buddy.h"
#include "snapshot.h"
#include "checkpoint_format.h"
#include "clock.h"
#include "compute.h"
#include "log.h"
#include "model.h"
#include "rendezvous.h"
#include "status.h"
#include "world.h"

#define ENTRY_MAX 256 /* "<name> <bytes> <xxh3 hex>" or "ERR <message>" in the store */

/* One rank's snapshot on its way to disk. */
typedef struct write_job {
  struct write_job *next;
  uint32_t local;
  uint32_t rank;
  uint64_t step;
  uint64_t t0_ms;
  uint64_t generation;           /* the world instance it was taken in (zd__ckptr_world_broke) */
  uint64_t seq;                  /* this daemon's count of snapshots, for a wait on this one */
  char instance[32];             /* W > 1: the world instance's name, which scopes store keys */
  zd__ckpt_manifest_t *manifest; /* global rank 0 only: what the manifest says but the files */
  const zd__compute_ops_t *ops;  /* the backend's, for the fence: static, outlives the rank */
  void *fence;                   /* the snapshot's copy is done once this is (NULL: it is) */
} write_job_t;

/* A local rank's host staging (the backend's host_alloc: pinned with CUDA), for its snapshots and
 * its resumes' loads. Kept across checkpoints; replaced when a model of another size needs it. */
typedef struct slot {
  float *snap; /* the model's state arrays back to back, in table order (packed()) */
  uint64_t elems;
  zd__states_t states;     /* which */
  void (*free_fn)(void *); /* the host_free of the backend that allocated snap */
  int busy;                /* a write of this snapshot is queued or running */
  int poisoned;            /* a copy into or out of snap may still run (a wait for it timed
                              out, or it failed half-queued): snap is never freed nor reused */
  int failed;              /* its last write failed */
  char error[ZD__ERR_MSG_MAX];
  uint64_t finished_seq; /* global rank 0's slot: the last of its snapshots the finisher ended */
  int finished_failed;   /* ... and whether that checkpoint failed */
} slot_t;

struct zd__ckptr {
  zd__ckpt_settings_t set;
  char *dir;
  char *resume;
  int has_world;
  zd__world_t world;
  uint32_t local_ranks;
  atomic_int requested;            /* the next step checkpoints */
  atomic_int cancel;               /* shutdown: waits for the store give up (zd__ckptr_cancel) */
  atomic_uint_fast64_t generation; /* bumped when the world breaks: older checkpoints cannot
                                      complete any more */
  uint64_t last_request_ms;

  pthread_mutex_t lock;
  pthread_cond_t cond; /* queues changed, a write or a checkpoint finished */
  int stop;
  write_job_t *head, *tail;         /* to the writer */
  write_job_t *fin_head, *fin_tail; /* to the finisher */
  slot_t *slots;                    /* per local rank */
  uint64_t seq;                     /* snapshots taken by this daemon's ranks */
  zd__ckpt_stats_t stats;
  pthread_t writer, finisher;
  int have_writer, have_finisher;
  zd__rdv_t *rdv;     /* writer's connection to the store (W > 1) */
  zd__rdv_t *rdv_fin; /* finisher's */
};

/* Where array s is in a host copy of the state arrays `states` of n elements each, back to back in
 * table order (common/state.h); NULL when s is not among them. */
static float *packed(float *host, uint64_t n, zd__states_t states, int s) {
  if (!(states & ZD__STATE_BIT(s))) return NULL;
  uint64_t before = (uint64_t)__builtin_popcount(states & (ZD__STATE_BIT(s) - 1));
  return host + before * n;
}

static void job_free(write_job_t *j) {
  if (!j) return;
  if (j->fence) j->ops->fence_free(j->fence);
  zd__ckpt_manifest_free(j->manifest);
  free(j);
}

static void note_failure(zd__ckptr_t *c, uint64_t step, const char *msg) {
  ZD_LOG_ERROR("checkpoint of step %" PRIu64 " failed: %s", step, msg);
  c->stats.failures++;
  snprintf(c->stats.last_error, sizeof c->stats.last_error, "step %" PRIu64 ": %.440s", step, msg);
}

static int open_store(zd__ckptr_t *c, zd__rdv_t **out, zd__err_t *err) {
  if (*out) return ZD_OK;
  int rc = zd__rdv_open(c->world.rendezvous_address, out, err);
  if (!rc) rc = zd__rdv_set_token(*out, c->world.control_token, err);
  if (rc) {
    zd__rdv_close(*out);
    *out = NULL;
  }
  return rc;
}

/* Scoped by the world instance: a world that re-formed, or rolled back, reaches the same step
 * again under another name. */
static void entry_key(char *buf, size_t len, const write_job_t *j, uint32_t rank) {
  snprintf(buf, len, "ckpt/%s/%" PRIu64 "/%u", j->instance, j->step, rank);
}

/* ---- the writer ------------------------------------------------------------------------------ */

/* Waits (bounded) for the snapshot's copy to reach host memory (compute.h, fence_wait), in slices
 * of a second: a shutdown leaves it DRAIN_MS more at most. Then the fence is released. */
#define DRAIN_MS 10000

static int wait_fence(zd__ckptr_t *c, write_job_t *j, zd__err_t *err) {
  int rc = ZD_OK;
  uint64_t start = zd__now_ms(), deadline = start + (uint64_t)c->set.timeout_ms;
  int cancelled = 0;
  for (;;) {
    uint64_t now = zd__now_ms();
    if (!cancelled && atomic_load(&c->cancel)) {
      cancelled = 1;
      if (now + DRAIN_MS < deadline) deadline = now + DRAIN_MS;
    }
    int slice = deadline > now ? (int)(deadline - now < 1000 ? deadline - now : 1000) : 0;
    rc = j->ops->fence_wait(j->fence, slice, err);
    if (rc != -ETIMEDOUT || zd__now_ms() >= deadline) break;
  }
  if (rc == -ETIMEDOUT)
    zd__errf(err, -ETIMEDOUT,
             "the snapshot's copy of rank %u's state to host memory did not finish within %" PRIu64
             " ms (the GPU is stuck?); its staging memory is left alone",
             j->rank, zd__now_ms() - start);
  j->ops->fence_free(j->fence);
  j->fence = NULL;
  return rc;
}

/* The world's size now: a live resize changes it (zd__ckptr_set_world_size) while the writer
 * thread reads it. */
static uint32_t world_size_now(const zd__ckptr_t *c) {
  return c->has_world ? __atomic_load_n(&c->world.world_size, __ATOMIC_RELAXED) : 1;
}

static void write_one(zd__ckptr_t *c, write_job_t *j) {
  slot_t *s = &c->slots[j->local];
  zd__err_t err = {0};
  char dir[4096] = "";
  zd__ckpt_file_t file;
  memset(&file, 0, sizeof file);
  /* First the copy: whatever happens next, the staging is reused only once it is done. */
  int rc = j->fence ? wait_fence(c, j, &err) : ZD_OK;
  int poison = rc != ZD_OK;
  if (!rc && zd__ckpt_dir_name(c->dir, j->step, dir, sizeof dir) != 0)
    rc = zd__errf(&err, -ENAMETOOLONG, "checkpoint directory name too long under %s", c->dir);
  if (!rc) {
    zd__ckpt_shard_t shard = {.rank = j->rank,
                              .world_size = world_size_now(c),
                              .step = j->step,
                              .elems = s->elems,
                              .state = {0}};
    for (int i = 0; i < ZD__NSTATES; i++) shard.state[i] = packed(s->snap, s->elems, s->states, i);
    rc = zd__ckpt_write_shard(dir, &shard, c->set.throttle_bytes_per_s, &file, &err);
  }
  if (c->has_world && !j->manifest) { /* tell rank 0, success or not: it must not wait in vain */
    char key[96], entry[ENTRY_MAX];
    entry_key(key, sizeof key, j, j->rank);
    if (rc)
      snprintf(entry, sizeof entry, "ERR rank %u: %.200s", j->rank, err.msg);
    else
      snprintf(entry, sizeof entry, "%s %" PRIu64 " %016" PRIx64, file.name, file.bytes, file.xxh3);
    zd__err_t serr = {0};
    int src = open_store(c, &c->rdv, &serr);
    for (int waited = 0; !src; waited += 1000) { /* in slices: a shutdown does not wait */
      src = zd__rdv_set(c->rdv, key, entry, strlen(entry), 1000, &serr);
      if (src == -EEXIST) { /* the same step of a replaced model: this entry is the news */
        zd__rdv_delete(c->rdv, key, 1000, &serr);
        src = zd__rdv_set(c->rdv, key, entry, strlen(entry), 1000, &serr);
      }
      if (src != -ETIMEDOUT && src != ZD_EPEER) break;
      if (atomic_load(&c->cancel) || atomic_load(&c->generation) != j->generation ||
          waited + 1000 >= c->set.timeout_ms)
        break;
      src = ZD_OK;
    }
    if (src && !rc)
      rc = zd__errf(&err, src, "telling rank 0 that the file is written: %s", serr.msg);
  }
  write_job_t *mine = j->manifest ? NULL : j; /* else the finisher's from the unlock on */
  pthread_mutex_lock(&c->lock);
  s->busy = 0;
  if (poison) s->poisoned = 1; /* the copy may still write it: never freed nor reused */
  s->failed = rc != 0;
  snprintf(s->error, sizeof s->error, "%s", rc ? err.msg : "");
  c->stats.in_progress--;
  if (rc) note_failure(c, j->step, err.msg);
  if (!rc) c->stats.last_bytes = file.bytes;
  if (j->manifest) { /* global rank 0: complete it */
    j->manifest->files[0] = file;
    if (rc) j->manifest->nfiles = 0; /* failed: the finisher only cleans up */
    j->next = NULL;
    if (c->fin_tail)
      c->fin_tail->next = j;
    else
      c->fin_head = j;
    c->fin_tail = j;
  } else if (!c->have_finisher && !rc) { /* no rank 0 here: this daemon's part is done */
    c->stats.completed++;
    c->stats.last_ok_step = j->step;
    c->stats.last_ok_unix_ms = zd__unix_ms();
    c->stats.last_duration_ms = zd__unix_ms() - j->t0_ms;
    c->stats.last_error[0] = '\0';
    snprintf(c->stats.last_dir, sizeof c->stats.last_dir, "%.500s", dir);
  }
  pthread_cond_broadcast(&c->cond);
  pthread_mutex_unlock(&c->lock);
  job_free(mine);
}

static void *writer_main(void *arg) {
  zd__ckptr_t *c = arg;
  pthread_mutex_lock(&c->lock);
  for (;;) {
    while (!c->head && !c->stop) pthread_cond_wait(&c->cond, &c->lock);
    write_job_t *j = c->head;
    if (!j) break; /* stop, and nothing left */
    c->head = j->next;
    if (!c->head) c->tail = NULL;
    pthread_mutex_unlock(&c->lock);
    write_one(c, j);
    pthread_mutex_lock(&c->lock);
  }
  pthread_mutex_unlock(&c->lock);
  return NULL;
}

/* ---- the finisher (daemon of global rank 0) ----------------------------------------------------
 */

static int parse_entry(const char *entry, uint32_t rank, zd__ckpt_file_t *f, zd__err_t *err) {
  if (strncmp(entry, "ERR ", 4) == 0) return zd__errf(err, ZD_ECHECKPOINT, "%s", entry + 4);
  char name[sizeof f->name];
  uint64_t bytes, sum;
  if (sscanf(entry, "%63s %" SCNu64 " %" SCNx64, name, &bytes, &sum) != 3)
    return zd__errf(err, ZD_EPROTO, "rank %u's checkpoint entry is malformed: '%.80s'", rank,
                    entry);
  snprintf(f->name, sizeof f->name, "%s", name);
  f->rank = rank;
  f->bytes = bytes;
  f->xxh3 = sum;
  return ZD_OK;
}

/* Waits for one entry in slices of a second, so that a shutdown or a broken world ends the wait
 * (a rank that died never writes its entry). */
static int wait_entry(zd__ckptr_t *c, const write_job_t *j, const char *key, void **value,
                      size_t *len, zd__err_t *err) {
  for (int waited = 0;; waited += 1000) {
    int rc = zd__rdv_get(c->rdv_fin, key, value, len, 1000, err);
    if (rc != -ETIMEDOUT) return rc;
    if (atomic_load(&c->generation) != j->generation)
      return zd__errf(err, ZD_EPEER, "the world broke while it was written");
    if (atomic_load(&c->cancel)) return zd__errf(err, -ECANCELED, "zerod is shutting down");
    if (waited + 1000 >= c->set.timeout_ms) return rc;
  }
}

/* The other ranks' entries (W > 1), into m->files[1..W-1]. */
static int collect_entries(zd__ckptr_t *c, const write_job_t *j, zd__ckpt_manifest_t *m,
                           zd__err_t *err) {
  uint32_t w = world_size_now(c);
  int rc = open_store(c, &c->rdv_fin, err);
  for (uint32_t r = 1; r < w && !rc; r++) {
    char key[96];
    entry_key(key, sizeof key, j, r);
    void *value = NULL;
    size_t len = 0;
    rc = wait_entry(c, j, key, &value, &len, err);
    if (rc == -ETIMEDOUT)
      rc = zd__errf(err, rc, "rank %u's file was not written within %d ms", r, c->set.timeout_ms);
    if (!rc) {
      char entry[ENTRY_MAX];
      snprintf(entry, sizeof entry, "%.*s", (int)(len < ENTRY_MAX ? len : ENTRY_MAX - 1),
               (const char *)value);
      rc = parse_entry(entry, r, &m->files[r], err);
    }
    free(value);
  }
  return rc;
}

/* The store keeps nothing of a checkpoint that ended, complete or not (best effort). */
static void forget_entries(zd__ckptr_t *c, const write_job_t *j) {
  zd__err_t err = {0};
  if (!c->rdv_fin && open_store(c, &c->rdv_fin, &err)) return;
  for (uint32_t r = 1, w = world_size_now(c); r < w; r++) {
    char key[96];
    entry_key(key, sizeof key, j, r);
    zd__rdv_delete(c->rdv_fin, key, 1000, &err);
  }
}

static void finish_one(zd__ckptr_t *c, write_job_t *j) {
  zd__ckpt_manifest_t *m = j->manifest;
  zd__err_t err = {0};
  char dir[4096];
  zd__ckpt_dir_name(c->dir, m->step, dir, sizeof dir);
  int rc = m->nfiles ? ZD_OK : ZD_ECHECKPOINT; /* rank 0's own file failed: already reported */
  if (!rc && c->has_world) rc = collect_entries(c, j, m, &err);
  if (c->has_world) forget_entries(c, j);
  if (!rc) rc = zd__ckpt_write_manifest(dir, m, &err);
  uint64_t bytes = 0;
  for (uint32_t i = 0; !rc && i < m->nfiles; i++) bytes += m->files[i].bytes;
  zd__err_t perr = {0};
  if (!rc && c->set.keep && zd__ckpt_prune(c->dir, c->set.keep, &perr) != 0)
    ZD_LOG_WARN("checkpoint retention (keep %u) in %s: %s", c->set.keep, c->dir, perr.msg);
  pthread_mutex_lock(&c->lock);
  c->slots[j->local].finished_seq = j->seq;
  c->slots[j->local].finished_failed = rc != 0;
  if (rc && m->nfiles) note_failure(c, m->step, err.msg);
  if (!rc) {
    c->stats.completed++;
    c->stats.last_ok_step = m->step;
    c->stats.last_ok_unix_ms = zd__unix_ms();
    c->stats.last_duration_ms = c->stats.last_ok_unix_ms - j->t0_ms;
    c->stats.last_bytes = bytes;
    c->stats.last_error[0] = '\0';
    snprintf(c->stats.last_dir, sizeof c->stats.last_dir, "%.500s", dir);
    ZD_LOG_INFO("checkpoint of step %" PRIu64 " complete: %s (%" PRIu64 " bytes, %" PRIu64 " ms)",
                m->step, dir, bytes, c->stats.last_duration_ms);
  }
  pthread_cond_broadcast(&c->cond);
  pthread_mutex_unlock(&c->lock);
  job_free(j);
}

static void *finisher_main(void *arg) {
  zd__ckptr_t *c = arg;
  pthread_mutex_lock(&c->lock);
  for (;;) {
    while (!c->fin_head && !(c->stop && !c->head && !c->stats.in_progress))
      pthread_cond_wait(&c->cond, &c->lock);
    write_job_t *j = c->fin_head;
    if (!j) break;
    c->fin_head = j->next;
    if (!c->fin_head) c->fin_tail = NULL;
    pthread_mutex_unlock(&c->lock);
    finish_one(c, j);
    pthread_mutex_lock(&c->lock);
  }
  pthread_mutex_unlock(&c->lock);
  return NULL;
}

/* ---- lifecycle ------------------------------------------------------------------------------- */

int zd__ckptr_create(const zd__ckpt_settings_t *settings, const zd__world_t *world,
                     uint32_t local_ranks, zd__ckptr_t **out, zd__err_t *err) {
  zd__ckptr_t *c = calloc(1, sizeof *c);
  if (!c) return zd__errf(err, -ENOMEM, "out of memory");
  c->set = *settings;
  c->dir = strdup(settings->dir ? settings->dir : "");
  c->resume = strdup(settings->resume ? settings->resume : "");
  c->slots = calloc(local_ranks ? local_ranks : 1, sizeof *c->slots);
  c->local_ranks = local_ranks;
  if (world && world->world_size > 1) {
    c->has_world = 1;
    c->world = *world;
  }
  c->stats.enabled = c->dir && c->dir[0];
  c->last_request_ms = zd__now_ms();
  pthread_mutex_init(&c->lock, NULL);
  pthread_condattr_t attr; /* the bounded waits (wait_idle) count monotonic time */
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&c->cond, &attr);
  pthread_condattr_destroy(&attr);
  if (!c->dir || !c->resume || !c->slots) {
    zd__ckptr_destroy(c);
    return zd__errf(err, -ENOMEM, "out of memory");
  }
  int first = world ? (int)world->first_rank : 0;
  if (c->stats.enabled) {
    if (pthread_create(&c->writer, NULL, writer_main, c) != 0) {
      zd__ckptr_destroy(c);
      return zd__errf(err, -EAGAIN, "cannot start the checkpoint writer thread");
    }
    c->have_writer = 1;
    if (first == 0) { /* global rank 0 lives here: it completes every checkpoint */
      if (pthread_create(&c->finisher, NULL, finisher_main, c) != 0) {
        zd__ckptr_destroy(c);
        return zd__errf(err, -EAGAIN, "cannot start the checkpoint finisher thread");
      }
      c->have_finisher = 1;
    }
  }
  *out = c;
  return ZD_OK;
}

void zd__ckptr_destroy(zd__ckptr_t *c) {
  if (!c) return;
  atomic_store(&c->cancel, 1);
  pthread_mutex_lock(&c->lock);
  c->stop = 1;
  pthread_cond_broadcast(&c->cond);
  pthread_mutex_unlock(&c->lock);
  if (c->have_writer) pthread_join(c->writer, NULL);
  pthread_mutex_lock(&c->lock);
  pthread_cond_broadcast(&c->cond); /* the finisher sees the writer's queue drained */
  pthread_mutex_unlock(&c->lock);
  if (c->have_finisher) pthread_join(c->finisher, NULL);
  while (c->head) {
    write_job_t *j = c->head;
    c->head = j->next;
    job_free(j);
  }
  for (uint32_t i = 0; c->slots && i < c->local_ranks; i++) {
    slot_t *s = &c->slots[i];
    if (s->snap && !s->poisoned) s->free_fn(s->snap);
  }
  free(c->slots);
  zd__rdv_close(c->rdv);
  zd__rdv_close(c->rdv_fin);
  pthread_cond_destroy(&c->cond);
  pthread_mutex_destroy(&c->lock);
  free(c->dir);
  free(c->resume);
  free(c);
}

/* ---- requests -------------------------------------------------------------------------------- */

static int need_dir(const zd__ckptr_t *c, zd__err_t *err) {
  if (c->stats.enabled) return ZD_OK;
  return zd__errf(err, ZD_ECONFIG,
                  "checkpoints are off: set checkpoint_dir (--checkpoint-dir DIR) to take one");
}

void zd__ckptr_cancel(zd__ckptr_t *c) {
  if (c) atomic_store(&c->cancel, 1);
}

void zd__ckptr_set_world_size(zd__ckptr_t *c, uint32_t world_size) {
  if (!c || !c->has_world) return;
  atomic_fetch_add(&c->generation, 1);
  __atomic_store_n(&c->world.world_size, world_size, __ATOMIC_RELAXED);
}

void zd__ckptr_world_broke(zd__ckptr_t *c) {
  if (c) atomic_fetch_add(&c->generation, 1);
}

int zd__ckptr_resumes(const zd__ckptr_t *c) {
  return c && c->resume[0];
}

int zd__ckptr_enabled(const zd__ckptr_t *c) {
  return c && c->stats.enabled;
}

int zd__ckptr_request(zd__ckptr_t *c, zd__err_t *err) {
  int rc = need_dir(c, err);
  if (rc) return rc;
  atomic_store(&c->requested, 1);
  return ZD_OK;
}

void zd__ckptr_tick(zd__ckptr_t *c, uint64_t now_ms) {
  if (!c->stats.enabled || !c->set.every_seconds) return;
  if (now_ms - c->last_request_ms < (uint64_t)c->set.every_seconds * 1000) return;
  c->last_request_ms = now_ms;
  atomic_store(&c->requested, 1);
}

int zd__ckptr_wants(zd__ckptr_t *c, uint64_t step) {
  if (!c || !c->stats.enabled) return 0;
  int want = atomic_exchange(&c->requested, 0);
  return want || (c->set.every_steps && step % c->set.every_steps == 0);
}

/* The manifest's fields but the files (global rank 0's job); its layout is a copy, the model's
 * may be replaced while the files are written. */
static int prepare_manifest(const zd__ckptr_t *c, const zd__model_t *m, zd__ckpt_manifest_t **out,
                            zd__err_t *err) {
  const zd__layout_t *l = m->layout;
  uint32_t w = world_size_now(c);
  zd__ckpt_manifest_t *mf = calloc(1, sizeof *mf);
  zd_param_t *params = calloc(l->nparams ? l->nparams : 1, sizeof *params);
  if (mf) mf->groups = malloc(m->shard.ngroups * sizeof *mf->groups);
  if (mf) mf->files = calloc(w, sizeof *mf->files);
  /* parameters whose own step lags the model's (model.h): their "steps_behind" */
  if (mf && m->nlagging && (mf->lags = malloc(l->nparams * sizeof *mf->lags)))
    memcpy(mf->lags, m->lag, l->nparams * sizeof *mf->lags);
  int rc = mf && params && mf->groups && mf->files && (mf->lags || !m->nlagging) ? ZD_OK : -ENOMEM;
  if (rc) zd__errf(err, rc, "out of memory");
  for (uint32_t i = 0; !rc && i < l->nparams; i++) {
    const zd__layout_param_t *p = &l->params[i];
    params[i] = (zd_param_t){.name = p->name, .ndim = p->ndim, .group = p->group};
    memcpy(params[i].shape, p->shape, sizeof p->shape);
  }
  if (!rc)
    rc = zd__layout_build(params, l->nparams, m->shard.ngroups, l->world_size, l->bucket_elems,
                          &mf->layout, err);
  free(params);
  if (rc) {
    zd__ckpt_manifest_free(mf);
    return rc;
  }
  mf->version = ZD__CKPT_VERSION;
  mf->step = m->step;
  mf->steps_skipped = m->steps_skipped;
  mf->world_size = w;
  mf->bucket_elems = l->bucket_elems;
  mf->layout_hash = l->hash;
  memcpy(mf->groups, m->groups, m->shard.ngroups * sizeof *mf->groups);
  mf->ngroups = m->shard.ngroups;
  mf->param_dtype = m->shard.param_dtype;
  mf->grad_dtype = m->grad_dtype;
  mf->max_grad_norm = m->max_grad_norm;
  mf->grad_mean = m->grad_mean;
  mf->scaler = (zd__ckpt_scaler_t){.enabled = m->scaler.enabled,
                                   .cfg = m->scaler.cfg,
                                   .scale = m->scaler.scale,
                                   .growth_tracker = m->scaler.growth_tracker,
                                   .hysteresis_tracker = m->scaler.hysteresis_tracker};
  mf->states = m->states;
  mf->created_ms = zd__unix_ms();
  mf->nfiles = w;
  *out = mf;
  return ZD_OK;
}

/* The model's state arrays in table order, as packed() lays them out in a host copy; returns how
 * many. */
static uint32_t state_arrays(zd__model_t *m, float *arrays[ZD__NSTATES]) {
  uint32_t count = 0;
  for (int s = 0; s < ZD__NSTATES; s++)
    if (m->states & ZD__STATE_BIT(s)) arrays[count++] = m->shard.state[s];
  return count;
}

/* One wait on c->cond (lock held), until deadline_ms (zd__now_ms's monotonic clock, as the
 * condition's) at most. */
static void cond_wait_until(zd__ckptr_t *c, uint64_t deadline_ms) {
  uint64_t now = zd__now_ms();
  if (now >= deadline_ms) return;
  uint64_t until_us = zd__now_us() + 1000u * (deadline_ms - now);
  struct timespec ts = {.tv_sec = (time_t)(until_us / 1000000u),
                        .tv_nsec = (long)(until_us % 1000000u) * 1000L};
  pthread_cond_timedwait(&c->cond, &c->lock, &ts);
}

/* Waits (lock held) until the slot's write is over, at most limit_ms. why, whose: for the message
 * ("snapshot", "the previous"). */
static int wait_idle(zd__ckptr_t *c, slot_t *s, uint32_t rank, int limit_ms, const char *why,
                     const char *whose, zd__err_t *err) {
  uint64_t deadline = zd__now_ms() + (uint64_t)limit_ms;
  while (s->busy && zd__now_ms() < deadline) cond_wait_until(c, deadline);
  if (!s->busy) return ZD_OK;
  return zd__errf(err, -ETIMEDOUT,
                  "%s: %s checkpoint file of rank %u was still being written after %d ms (a slow "
                  "disk, or the copy from the GPU did not finish)",
                  why, whose, rank, limit_ms);
}

/* The slot's staging, sized for m (slot idle, lock not held): kept when it fits, else replaced; a
 * poisoned one is left to the exit (a copy may still use it). */
static int slot_staging(slot_t *s, const zd__step_ctx_t *ctx, zd__model_t *m, zd__err_t *err) {
  uint64_t n = m->layout->shard_elems;
  if (s->snap && !s->poisoned && s->elems == n && s->states == m->states) return ZD_OK;
  if (s->snap && s->poisoned)
    ZD_LOG_WARN("rank %u: checkpoint staging of %" PRIu64
                " bytes left allocated: a copy into it "
                "did not finish",
                ctx->rank, (uint64_t)__builtin_popcount(s->states) * s->elems * sizeof(float));
  else if (s->snap)
    s->free_fn(s->snap);
  s->snap = NULL;
  s->elems = 0;
  s->poisoned = 0;
  zd__compute_t *cp = ctx->compute;
  uint64_t arrays = (uint64_t)__builtin_popcount(m->states);
  void *p = NULL;
  int rc = cp->ops->host_alloc(cp, (size_t)arrays * (n ? n : 1) * sizeof(float), &p, err);
  if (rc) return rc;
  s->snap = p;
  s->free_fn = cp->ops->host_free;
  s->elems = n;
  s->states = m->states;
  return ZD_OK;
}

int zd__ckptr_take(zd__ckptr_t *c, const zd__step_ctx_t *ctx, zd__model_t *m, int wait, char *dir,
                   size_t len, zd__err_t *err) {
  int rc = need_dir(c, err);
  if (rc) return rc;
  uint32_t local = ctx->local_rank;
  zd_assert(local < c->local_ranks);
  slot_t *s = &c->slots[local];
  write_job_t *j = calloc(1, sizeof *j);
  if (!j) return zd__errf(err, -ENOMEM, "out of memory");
  j->local = local;
  j->rank = ctx->rank;
  j->step = m->step;
  j->t0_ms = zd__unix_ms();
  j->generation = atomic_load(&c->generation);
  if (ctx->member)
    snprintf(j->instance, sizeof j->instance, "%s", zd__world_member_id(ctx->member));
  if (ctx->rank == 0 && (rc = prepare_manifest(c, m, &j->manifest, err)) != 0) {
    job_free(j);
    return rc;
  }
  pthread_mutex_lock(&c->lock);
  /* The previous write of this rank (its staging is reused). */
  rc = wait_idle(c, s, ctx->rank, c->set.timeout_ms, "snapshot", "the previous", err);
  pthread_mutex_unlock(&c->lock);
  if (!rc) rc = slot_staging(s, ctx, m, err);
  if (rc) {
    job_free(j);
    return rc;
  }
  uint64_t t0 = zd__now_us(); /* the stall is queuing the copy, not the wait above (a disk's) */
  zd__compute_t *cp = ctx->compute;
  float *arrays[ZD__NSTATES];
  uint32_t count = state_arrays(m, arrays);
  j->ops = cp->ops;
  rc = cp->ops->snapshot(cp, arrays, count, m->layout->shard_elems, s->snap, &j->fence, err);
  if (rc) {
    s->poisoned = 1; /* compute.h: a copy may have been queued in part */
    job_free(j);
    return rc;
  }
  uint64_t snapshot_us = zd__now_us() - t0;
  pthread_mutex_lock(&c->lock);
  s->busy = 1;
  uint64_t seq = j->seq = ++c->seq;
  c->stats.requested++;
  c->stats.in_progress++;
  c->stats.last_snapshot_us = snapshot_us;
  if (c->tail)
    c->tail->next = j;
  else
    c->head = j;
  c->tail = j;
  pthread_cond_broadcast(&c->cond);
  uint64_t step = m->step;
  if (wait) {
    /* The write waits for the copy (at most the timeout, and DRAIN_MS more at a shutdown) and
     * writes the file, then (global rank 0) the finisher waits for every rank's entry (at most
     * the timeout): this waits as long as they may, and a timeout more for the file itself. */
    rc = wait_idle(c, s, ctx->rank, 2 * c->set.timeout_ms + DRAIN_MS, "checkpoint", "this", err);
    if (!rc && s->failed) rc = zd__errf(err, ZD_ECHECKPOINT, "%s", s->error);
    /* Global rank 0 completes the checkpoint: its own, this snapshot's, not an earlier one of
     * the same step number (a model replaced, a world rolled back). */
    uint64_t deadline = zd__now_ms() + (uint64_t)c->set.timeout_ms + DRAIN_MS;
    while (!rc && ctx->rank == 0 && s->finished_seq < seq && zd__now_ms() < deadline)
      cond_wait_until(c, deadline);
    if (!rc && ctx->rank == 0 && s->finished_seq < seq)
      rc = zd__errf(err, -ETIMEDOUT,
                    "checkpoint of step %" PRIu64
                    ": not completed by global rank 0 (the manifest) "
                    "within %d ms of its file",
                    m->step, c->set.timeout_ms + DRAIN_MS);
    if (!rc && ctx->rank == 0 && s->finished_failed)
      rc = zd__errf(err, ZD_ECHECKPOINT, "%s", c->stats.last_error);
  }
  pthread_mutex_unlock(&c->lock);
  if (dir && len) zd__ckpt_dir_name(c->dir, step, dir, len);
  ZD_LOG_DEBUG("rank %u: snapshot of step %" PRIu64 " taken in %" PRIu64 " us", ctx->rank, step,
               snapshot_us);
  return rc;
}

/* ---- resume ---------------------------------------------------------------------------------- */

static void log_reject(void *ctx, const char *dir, const char *reason) {
  (void)ctx;
  ZD_LOG_WARN("checkpoint %s passed over (falling back to the previous one): %s", dir, reason);
}

/* What a rank loaded, as the ranks compare it. */
#define LOADED_NONE   UINT64_MAX       /* nothing to resume: a fresh start */
#define LOADED_FAILED (UINT64_MAX - 1) /* the load failed: every rank fails the registration */

static void describe_loaded(uint64_t v, char *buf, size_t len) {
  if (v == LOADED_NONE)
    snprintf(buf, len, "no checkpoint");
  else if (v == LOADED_FAILED)
    snprintf(buf, len, "a checkpoint that failed to load");
  else
    snprintf(buf, len, "step %" PRIu64, v);
}

/* Every rank must have loaded the same step (or none); a rank whose load failed fails them all,
 * so that no rank waits for it in a collective. */
static int agree_loaded(const zd__step_ctx_t *ctx, uint64_t mine, zd__err_t *err) {
  uint32_t w = ctx->world_size;
  if (w == 1) return ZD_OK;
  uint64_t *all = calloc(w, sizeof *all);
  if (!all) return zd__errf(err, -ENOMEM, "out of memory");
  int rc = ctx->comm->ops->allgather_bytes(ctx->comm, &mine, sizeof mine, all, err);
  for (uint32_t r = 0; !rc && r < w; r++) {
    if (all[r] == mine) continue;
    char theirs[64], ours[64];
    describe_loaded(all[r], theirs, sizeof theirs);
    describe_loaded(mine, ours, sizeof ours);
    rc = zd__errf(err, ZD_ECHECKPOINT,
                  "resume: rank %u loaded %s, rank %u %s; every rank must see the same "
                  "checkpoints (one checkpoint_dir shared by every node)",
                  r, theirs, ctx->rank, ours);
  }
  free(all);
  return rc;
}

/* What each rank's registration asks of a resume; the ranks compare it first, so that all take the
 * same collective path whatever their settings. */
enum { WANT_NONE = 0, WANT_RESUME = 1, WANT_REPLACE = 2 };

static int agree_wants(const zd__step_ctx_t *ctx, int32_t mine, int *any_resume, zd__err_t *err) {
  *any_resume = mine == WANT_RESUME;
  uint32_t w = ctx->world_size;
  if (w == 1) return ZD_OK;
  int32_t *all = calloc(w, sizeof *all);
  if (!all) return zd__errf(err, -ENOMEM, "out of memory");
  int rc = ctx->comm->ops->allgather_bytes(ctx->comm, &mine, sizeof mine, all, err);
  int resume = -1, replace = -1;
  for (uint32_t r = 0; !rc && r < w; r++) {
    if (all[r] == WANT_RESUME && resume < 0) resume = (int)r;
    if (all[r] == WANT_REPLACE && replace < 0) replace = (int)r;
  }
  if (!rc && resume >= 0 && replace >= 0)
    rc =
        zd__errf(err, ZD_ECHECKPOINT,
                 "rank %d registers with replace (start afresh) while rank %d resumes a checkpoint "
                 "(its resume setting, or the world re-formed): register the same way on every "
                 "rank",
                 replace, resume);
  if (!rc) *any_resume = resume >= 0;
  free(all);
  return rc;
}

/* World size > 1 with state_dir (every rank has it, or the collectives part ways): the ranks'
 * state files serve the world only when all of them hold a common commit. A commit is named by
 * step + steps skipped (each committed step adds one to one of them); a rank's file holds its
 * newest commit and, when its other slot is valid, the one before. Ranks are at most one commit
 * apart (a rank commits only after every rank agreed to the step, and no rank reaches the next
 * agreement before every rank committed), and the newer commit's other set is untouched until
 * the next update: the world takes the oldest newest commit, and a rank one ahead goes back to its
 * previous record (*pick = 1). *pick = -1: no common commit (a rank without a usable file, or
 * commits further apart): every rank falls back, and the log says why. */
static int agree_state_files(const zd__step_ctx_t *ctx, zd__model_t *m, int replace, int *pick,
                             zd__err_t *err) {
  uint32_t w = ctx->world_size;
  typedef struct {
    uint64_t n; /* records the rank can serve (0..2) */
    uint64_t key[2];
  } have_t;
  have_t mine = {.n = m->restored && !replace ? (uint64_t)m->restored : 0};
  for (uint64_t i = 0; i < mine.n; i++)
    mine.key[i] = m->restored_rec[i].step + m->restored_rec[i].steps_skipped;
  have_t *all = calloc(w, sizeof *all);
  if (!all) return zd__errf(err, -ENOMEM, "out of memory");
  int rc = ctx->comm->ops->allgather_bytes(ctx->comm, &mine, sizeof mine, all, err);
  if (rc) {
    free(all);
    return rc;
  }
  uint64_t target = UINT64_MAX;
  char why[256] = "";
  for (uint32_t r = 0; r < w && !why[0]; r++) {
    if (!all[r].n)
      snprintf(why, sizeof why, "rank %u has no usable state file (or registers with replace)", r);
    else if (all[r].key[0] < target)
      target = all[r].key[0];
  }
  for (uint32_t r = 0; r < w && !why[0]; r++)
    if (all[r].key[0] != target && !(all[r].n == 2 && all[r].key[1] == target))
      snprintf(why, sizeof why,
               "rank %u's state file holds commit %" PRIu64
               " (step + steps skipped) and not "
               "commit %" PRIu64 ", the newest of another rank",
               r, all[r].key[0], target);
  free(all);
  if (why[0]) {
    *pick = -1;
    snprintf(m->resume_note, sizeof m->resume_note, "%s", why);
    ZD_LOG_WARN(
        "rank %u: the world's state files are not used: %s; falling back to the newest "
        "checkpoint (resume = latest), else a fresh start",
        ctx->rank, why);
    return ZD_OK;
  }
  *pick = mine.key[0] == target ? 0 : 1;
  return ZD_OK;
}

int zd__ckptr_resume(zd__ckptr_t *c, const zd__step_ctx_t *ctx, zd__model_t *m, int replace,
                     int *loaded, zd__err_t *err) {
  *loaded = 0;
  m->resumed_from = ZD__FROM_CLIENT;
  m->resume_note[0] = '\0';
  /* state_dir_mode = snapshot: the newest state snapshot every rank holds (snapshot.h). */
  char snap_why[160];
  int handled = 0;
  int rc = zd__snapshot_resume(ctx, m, replace, &handled, snap_why, sizeof snap_why, err);
  if (rc) return rc;
  if (handled) {
    *loaded = 1;
    return ZD_OK;
  }
  /* A rank that came back empty: the world's buddy copies first (buddy.h). */
  char buddy_why[160];
  rc = zd__buddy_resume(ctx, m, replace, &handled, buddy_why, sizeof buddy_why, err);
  if (rc) return rc;
  if (handled) {
    *loaded = 1;
    zd__snapshot_resumed_elsewhere(ctx, m->step);
    return ZD_OK;
  }
  /* The state files' committed steps are newer than any checkpoint. */
  int pick = m->restored && !replace ? 0 : -1;
  rc = ctx->state_dir && ctx->world_size > 1 ? agree_state_files(ctx, m, replace, &pick, err)
                                             : ZD_OK;
  if (rc) return rc;
  if (buddy_why[0]) snprintf(m->resume_note, sizeof m->resume_note, "%s", buddy_why);
  if (snap_why[0]) snprintf(m->resume_note, sizeof m->resume_note, "%s", snap_why);
  if (pick >= 0) {
    uint64_t newest = m->step;
    zd__model_take_record(m, pick);
    *loaded = 1;
    m->resumed_from = ZD__FROM_STATE_FILE;
    ZD_LOG_INFO("rank %u resumed step %" PRIu64
                " from its state file (state_dir), not from a "
                "checkpoint%s",
                ctx->rank, m->step,
                pick ? " (its commit before the newest, the step every rank holds)" : "");
    if (pick)
      ZD_LOG_INFO("rank %u: its newest commit (step %" PRIu64 ") is dropped", ctx->rank, newest);
    zd__snapshot_resumed_elsewhere(ctx, m->step);
    return ZD_OK;
  }
  if (m->restored) zd__model_forget_restored(m); /* a checkpoint or the client's values instead */
  int32_t mine = replace                                     ? WANT_REPLACE
                 : c && (c->resume[0] || ctx->resume_latest) ? WANT_RESUME
                                                             : WANT_NONE;
  int any_resume;
  rc = agree_wants(ctx, mine, &any_resume, err);
  if (!rc && !any_resume) zd__snapshot_resumed_elsewhere(ctx, m->step); /* the client's values */
  if (rc || !any_resume) return rc;
  if (!c) return zd__errf(err, ZD_ECONFIG, "resume: this daemon takes no checkpoints");
  /* Another rank resumes (its resume setting, or a world that re-formed around a zerod restarted
   * without one): this one loads the newest checkpoint too, so that all continue from the same. */
  char *dir = NULL;
  zd__ckpt_manifest_t *mf = NULL;
  if (mine != WANT_RESUME || ctx->resume_latest || strcmp(c->resume, "latest") == 0) {
    if (!c->dir[0])
      rc = zd__errf(err, ZD_ECONFIG, "resume: %s but this zerod has no checkpoint_dir%s%s%s",
                    mine != WANT_RESUME ? "another rank resumes a checkpoint"
                    : c->resume[0]      ? "resume is 'latest'"
                                        : "the world resumes its newest checkpoint after a loss",
                    m->resume_note[0] ? " (nothing else serves: " : "", m->resume_note,
                    m->resume_note[0] ? ")" : "");
    else
      rc = zd__ckpt_find_latest(c->dir, m->layout, log_reject, NULL, &dir, &mf, err);
    if (rc == -ENOENT) {
      ZD_LOG_INFO("resume: no complete checkpoint of this model in %s; starting afresh", c->dir);
      rc = ZD_OK;
    }
  } else {
    dir = strdup(c->resume);
    rc = dir ? zd__ckpt_read_manifest(dir, &mf, err) : zd__errf(err, -ENOMEM, "out of memory");
    if (!rc) rc = zd__ckpt_verify(dir, mf, err);
    if (rc) {
      char cause[ZD__ERR_MSG_MAX];
      snprintf(cause, sizeof cause, "%s", err->msg);
      rc = zd__errf(err, ZD_ECHECKPOINT, "resume %s: %s", c->resume, cause);
    }
  }
  uint64_t n = m->layout->shard_elems;
  if (!rc && mf) { /* loaded into the rank's staging (pinned with CUDA), then copied to the state */
    slot_t *s = &c->slots[ctx->local_rank];
    pthread_mutex_lock(&c->lock);
    rc = wait_idle(c, s, ctx->rank, c->set.timeout_ms, "resume", "the previous", err);
    pthread_mutex_unlock(&c->lock);
    if (!rc) rc = slot_staging(s, ctx, m, err);
    float *state[ZD__NSTATES] = {0};
    for (int i = 0; !rc && i < ZD__NSTATES; i++) state[i] = packed(s->snap, n, m->states, i);
    if (!rc) rc = zd__ckpt_load_shard(dir, mf, m->layout, ctx->rank, state, err);
    float *arrays[ZD__NSTATES];
    uint32_t count = state_arrays(m, arrays);
    if (!rc) {
      rc = ctx->compute->ops->restore(ctx->compute, arrays, count, n, s->snap, c->set.timeout_ms,
                                      err);
      if (rc) s->poisoned = 1; /* compute.h: the copy may still read it */
    }
  }
  uint64_t step = rc ? LOADED_FAILED : mf ? mf->step : LOADED_NONE;
  zd__err_t aerr = {0};
  int arc = agree_loaded(ctx, step, &aerr);
  if (!rc && arc) {
    rc = arc;
    *err = aerr;
  }
  if (!rc && mf) {
    m->step = mf->step;
    m->steps_skipped = mf->steps_skipped;
    /* The same parameter table (the checkpoint was found for this layout, at any world size):
     * each parameter's own step; a checkpoint without them has every one at the model's. */
    zd_assert(mf->layout->nparams == m->layout->nparams);
    zd__model_set_lags(m, mf->lags);
    if (mf->scaler.enabled && m->scaler.enabled) {
      m->scaler.scale = mf->scaler.scale;
      m->scaler.growth_tracker = mf->scaler.growth_tracker;
      m->scaler.hysteresis_tracker = mf->scaler.hysteresis_tracker;
    }
    zd__model_commit(m, 0); /* the committed set holds that step now (a state file's header too) */
    *loaded = 1;
    m->resumed_from = ZD__FROM_CHECKPOINT;
    ZD_LOG_INFO("rank %u resumed step %" PRIu64 " from %s (written at world size %u)", ctx->rank,
                mf->step, dir, mf->world_size);
    pthread_mutex_lock(&c->lock);
    c->stats.resumed_step = mf->step;
    snprintf(c->stats.resumed_dir, sizeof c->stats.resumed_dir, "%.500s", dir);
    pthread_mutex_unlock(&c->lock);
  }
  free(dir);
  zd__ckpt_manifest_free(mf);
  if (!rc) zd__snapshot_resumed_elsewhere(ctx, m->step);
  return rc;
}

void zd__ckptr_stats(zd__ckptr_t *c, zd__ckpt_stats_t *out) {
  pthread_mutex_lock(&c->lock);
  *out = c->stats;
  pthread_mutex_unlock(&c->lock);
}

/* "never" rather than 0 for a checkpoint not taken: status and zeroctl show it to operators. */
void zd__ckptr_status(void *ctx, zd__status_t *st) {
  zd__ckptr_t *c = ctx;
  zd__ckpt_stats_t s;
  zd__ckptr_stats(c, &s);
  zd__status_section(st, "checkpoint");
  zd__status_add(st, "enabled", "%d", s.enabled);
  zd__status_add(st, "requested", "%" PRIu64, s.requested);
  zd__status_add(st, "completed", "%" PRIu64, s.completed);
  zd__status_add(st, "failures", "%" PRIu64, s.failures);
  zd__status_add(st, "in_progress", "%" PRIu64, s.in_progress);
  if (s.completed) {
    zd__status_add(st, "last_step", "%" PRIu64, s.last_ok_step);
    zd__status_add(st, "last_dir", "%s", s.last_dir);
    zd__status_add(st, "last_age_s", "%" PRIu64, (zd__unix_ms() - s.last_ok_unix_ms) / 1000u);
    zd__status_add(st, "last_duration_ms", "%" PRIu64, s.last_duration_ms);
    zd__status_add(st, "last_bytes", "%" PRIu64, s.last_bytes);
    zd__status_add(st, "last_snapshot_us", "%" PRIu64, s.last_snapshot_us);
  } else {
    zd__status_add(st, "last_step", "never");
  }
  if (s.last_error[0]) zd__status_add(st, "last_error", "%s", s.last_error);
  if (s.resumed_dir[0]) {
    zd__status_add(st, "resumed_step", "%" PRIu64, s.resumed_step);
    zd__status_add(st, "resumed_dir", "%s", s.resumed_dir);
  }
}
