/* State snapshots into state_dir (state_dir_mode = snapshot): the decision, the snapshot, its
 * writer thread and the recovery from the files (snapshot.h). */
#include "snapshot.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "clock.h"
#include "comm.h"
#include "compute.h"
#include "log.h"
#include "snapfile.h"

/* A local rank's staging and writer. The worker writes the staging and hdr only while busy is 0,
 * the writer reads them while it is 1. */
typedef struct writer {
  pthread_t thread;
  int started;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  int busy, stop;
  uint32_t local_rank;
  const zd__compute_ops_t *ops; /* fence_wait, fence_free, host_free: any thread */
  void *staging;                /* host_alloc'd (pinned with CUDA), cap bytes */
  size_t cap;
  int poisoned; /* a copy into staging did not finish: leak it, never reuse it */
  void *fence;
  zd__snapfile_hdr_t hdr;
  /* the worker's only */
  uint64_t last_take_ms, due_step;
  /* status (lock) */
  uint64_t taken, skipped, failures, step, unix_ms, bytes, last_stall_us, last_write_ms;
  char error[200];
} writer_t;

static struct {
  zd__snapshot_settings_t set;
  char dir[3800];
  writer_t *w;
  uint32_t nw;
} S;

int zd__snapshot_enabled(void) {
  return S.w != NULL;
}

static void path_of(char *out, size_t len, uint32_t rank, uint32_t world_size, const char *suffix) {
  snprintf(out, len, "%s/snapshot-rank%u-of-%u.zdbuddy%s", S.dir, rank, world_size, suffix);
}

/* ---- the decision and the snapshot ---------------------------------------------------------- */

int zd__snapshot_wants(const zd__step_ctx_t *ctx, uint64_t step) {
  if (!S.w || ctx->local_rank >= S.nw) return 0;
  writer_t *w = &S.w[ctx->local_rank];
  int out = 0;
  if (S.set.every_steps && step % S.set.every_steps == 0) out |= ZD__SNAPSHOT_WANT;
  if (S.set.every_s && zd__now_ms() - w->last_take_ms >= (uint64_t)S.set.every_s * 1000u)
    out |= ZD__SNAPSHOT_WANT;
  pthread_mutex_lock(&w->lock);
  if (w->busy) out |= ZD__SNAPSHOT_BUSY;
  pthread_mutex_unlock(&w->lock);
  return out;
}

void zd__snapshot_agreed(const zd__step_ctx_t *ctx, uint64_t step, int asked, int busy) {
  if (!S.w || ctx->local_rank >= S.nw) return;
  writer_t *w = &S.w[ctx->local_rank];
  w->due_step = asked && !busy ? step : 0;
  if (asked && busy) {
    /* A period (state_snapshot_every_s) starts again at a skip: one skip per period is counted
     * and logged while a write runs long, not one per step. */
    w->last_take_ms = zd__now_ms();
    pthread_mutex_lock(&w->lock);
    w->skipped++;
    pthread_mutex_unlock(&w->lock);
    ZD_LOG_WARN("rank %u: state snapshot of step %" PRIu64
                " skipped on every rank: a rank's previous snapshot is still being written",
                ctx->rank, step);
  }
}

static void fail(writer_t *w, const char *what, const char *msg, uint64_t step) {
  pthread_mutex_lock(&w->lock);
  w->failures++;
  snprintf(w->error, sizeof w->error, "step %" PRIu64 ": %s: %.150s", step, what, msg);
  pthread_mutex_unlock(&w->lock);
  ZD_LOG_ERROR("rank %u: state snapshot: %s", S.set.first_rank + w->local_rank, w->error);
}

static uint32_t state_arrays(const zd__model_t *m, float **arrays) {
  uint32_t count = 0;
  for (int i = 0; i < ZD__NSTATES; i++)
    if (m->states & ZD__STATE_BIT(i)) arrays[count++] = m->shard.state[i];
  return count;
}

/* The rank's staging of at least bytes (a poisoned one is leaked: compute.h). */
static int staging(writer_t *w, zd__compute_t *c, size_t bytes, zd__err_t *err) {
  if (w->staging && !w->poisoned && w->cap >= bytes) return ZD_OK;
  if (w->staging && !w->poisoned) w->ops->host_free(w->staging);
  w->staging = NULL;
  w->cap = 0;
  w->poisoned = 0;
  w->ops = c->ops;
  void *p = NULL;
  int rc = c->ops->host_alloc(c, bytes ? bytes : 1, &p, err);
  if (rc) return rc;
  w->staging = p;
  w->cap = bytes;
  return ZD_OK;
}

void zd__snapshot_after_step(const zd__step_ctx_t *ctx, const zd__model_t *m) {
  if (!S.w || ctx->local_rank >= S.nw || !m->step) return;
  writer_t *w = &S.w[ctx->local_rank];
  int due = w->due_step && w->due_step == m->step;
  if (w->due_step && m->step >= w->due_step) w->due_step = 0;
  if (!due) return;
  pthread_mutex_lock(&w->lock);
  int busy = w->busy;
  if (busy) w->skipped++;
  pthread_mutex_unlock(&w->lock);
  if (busy) return; /* agreed only when no rank was busy: not reached but by a failed write */
  uint64_t n = m->layout->shard_elems, nlags = m->nlagging ? m->layout->nparams : 0;
  uint64_t abytes = zd__snapfile_arrays_bytes(m->states, n);
  uint64_t bytes = abytes + nlags * sizeof(uint64_t);
  zd__compute_t *c = ctx->compute;
  zd__err_t err = {0};
  int rc = staging(w, c, (size_t)bytes, &err);
  if (rc) {
    fail(w, "no staging", err.msg, m->step);
    return;
  }
  float *arrays[ZD__NSTATES];
  uint32_t count = state_arrays(m, arrays);
  uint64_t t0 = zd__now_us();
  w->fence = NULL;
  rc = c->ops->snapshot(c, arrays, count, n, (float *)w->staging, &w->fence, &err);
  uint64_t stall = zd__now_us() - t0;
  if (rc) {
    w->poisoned = 1; /* compute.h: a copy may have been queued in part */
    fail(w, "the backend's snapshot", err.msg, m->step);
    return;
  }
  if (nlags) memcpy((uint8_t *)w->staging + abytes, m->lag, nlags * sizeof *m->lag);
  w->hdr = (zd__snapfile_hdr_t){.rank = ctx->rank,
                                .world_size = ctx->world_size,
                                .states = m->states,
                                .layout_hash = m->layout->hash,
                                .step = m->step,
                                .steps_skipped = m->steps_skipped,
                                .shard_elems = n,
                                .bytes = bytes,
                                .scaler_enabled = (uint32_t)m->scaler.enabled,
                                .growth_tracker = m->scaler.growth_tracker,
                                .hysteresis_tracker = m->scaler.hysteresis_tracker,
                                .nlags = (uint32_t)nlags,
                                .scale = m->scaler.scale,
                                .taken_unix_ms = zd__unix_ms()};
  snprintf(w->hdr.from, sizeof w->hdr.from, "state snapshot (%s backend)", c->name);
  w->last_take_ms = zd__now_ms();
  pthread_mutex_lock(&w->lock);
  w->last_stall_us = stall;
  w->busy = 1;
  pthread_cond_signal(&w->cond);
  pthread_mutex_unlock(&w->lock);
}

/* ---- the writer ----------------------------------------------------------------------------- */

static int write_all(int fd, const void *p, size_t len, off_t off) {
  const uint8_t *b = p;
  while (len) {
    ssize_t k = pwrite(fd, b, len, off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return k < 0 ? -errno : -EIO;
    b += k;
    len -= (size_t)k;
    off += k;
  }
  return 0;
}

/* The step a snapshot file's header names: 1 with *step, 0 when there is no readable header
 * (no file, a damaged one: the recovery's checks deal with those). */
static int file_step(const char *path, uint64_t *step) {
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return 0;
  zd__snapfile_hdr_t h;
  int ok = pread(fd, &h, sizeof h, 0) == (ssize_t)sizeof h && h.magic == ZD__SNAPFILE_MAGIC;
  close(fd);
  if (ok) *step = h.step;
  return ok;
}

/* A rank's files of steps after `after` (or at it, with at) belong to a history the world left
 * (a rollback, a checkpoint's resume, a replaced model): kept, a later recovery could take one of
 * them, on every rank that has it, for the same step of the new history (shards of two runs), or
 * the two histories' files could leave the ranks no step in common. Deleted, with a log line. */
static void drop_newer(uint32_t rank, uint32_t world_size, uint64_t after, int at) {
  const char *sfx[2] = {"", ".prev"};
  for (int i = 0; i < 2; i++) {
    char path[4096];
    uint64_t step = 0;
    path_of(path, sizeof path, rank, world_size, sfx[i]);
    if (!file_step(path, &step) || step < after || (step == after && !at)) continue;
    if (unlink(path) == 0)
      ZD_LOG_INFO("rank %u: state snapshot %s (step %" PRIu64
                  ") deleted: of a history the world left at step %" PRIu64,
                  rank, path, step, after);
  }
}

/* Writes the staged snapshot: "<name>.part", then the newest becomes "<name>.prev" and the part
 * the newest (renames: a zerod killed at any instant leaves whole files only). */
static int write_file(writer_t *w, zd__err_t *err) {
  zd__snapfile_hdr_t *h = &w->hdr;
  int rc = w->ops->fence_wait(w->fence, S.set.timeout_ms, err);
  w->ops->fence_free(w->fence);
  w->fence = NULL;
  if (rc) {
    w->poisoned = 1; /* the copy may still write the staging */
    return rc;
  }
  h->checksum = XXH3_64bits(w->staging, h->bytes);
  h->complete_unix_ms = zd__unix_ms();
  zd__snapfile_seal(h);
  char part[4096], path[4096], prev[4096];
  path_of(part, sizeof part, h->rank, h->world_size, ".part");
  path_of(path, sizeof path, h->rank, h->world_size, "");
  path_of(prev, sizeof prev, h->rank, h->world_size, ".prev");
  if (unlink(part) != 0 && errno != ENOENT)
    return zd__errf(err, -errno, "%s: %s", part, strerror(errno));
  int fd = open(part, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return zd__errf(err, -errno, "%s: %s", part, strerror(errno));
  uint8_t head[ZD__SNAPFILE_HDR_BYTES] = {0};
  memcpy(head, h, sizeof *h);
  rc = write_all(fd, head, sizeof head, 0);
  if (!rc) rc = write_all(fd, w->staging, h->bytes, ZD__SNAPFILE_HDR_BYTES);
  /* On disk, the data before the renames (a power loss must not leave both names empty); on a
   * memory file system this costs nothing. */
  if (!rc && fdatasync(fd) != 0) rc = -errno;
  if (close(fd) != 0 && !rc) rc = -errno;
  if (rc) {
    unlink(part);
    return zd__errf(err, rc, "%s: writing %" PRIu64 " bytes: %s", part,
                    (uint64_t)ZD__SNAPFILE_HDR_BYTES + h->bytes, strerror(-rc));
  }
  /* A file of this step or later is of a history the world left (a rollback since): it must not
   * become the .prev beside this one. */
  drop_newer(h->rank, h->world_size, h->step, 1);
  if (rename(path, prev) != 0 && errno != ENOENT)
    return zd__errf(err, -errno, "%s: renaming to %s: %s", path, prev, strerror(errno));
  if (rename(part, path) != 0)
    return zd__errf(err, -errno, "%s: renaming to %s: %s", part, path, strerror(errno));
  int dfd = open(S.dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* the renames, durable */
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return ZD_OK;
}

static void *writer_main(void *arg) {
  writer_t *w = arg;
  pthread_mutex_lock(&w->lock);
  for (;;) {
    while (!w->stop && !w->busy) pthread_cond_wait(&w->cond, &w->lock);
    if (!w->busy) break; /* stop, nothing left to write */
    pthread_mutex_unlock(&w->lock);
    uint64_t t0 = zd__now_ms();
    zd__err_t err = {0};
    int rc = write_file(w, &err);
    uint64_t took = zd__now_ms() - t0;
    if (rc)
      ZD_LOG_ERROR("rank %u: state snapshot of step %" PRIu64 " not written: %s", w->hdr.rank,
                   w->hdr.step, err.msg);
    pthread_mutex_lock(&w->lock);
    if (rc) {
      w->failures++;
      snprintf(w->error, sizeof w->error, "step %" PRIu64 ": %.150s", w->hdr.step, err.msg);
    } else {
      w->taken++;
      w->step = w->hdr.step;
      w->unix_ms = w->hdr.taken_unix_ms;
      w->bytes = w->hdr.bytes;
      w->last_write_ms = took;
      w->error[0] = '\0';
    }
    w->busy = 0;
    pthread_cond_broadcast(&w->cond); /* a resume waiting for this snapshot's file */
  }
  pthread_mutex_unlock(&w->lock);
  return NULL;
}

int zd__snapshot_start(const zd__snapshot_settings_t *set, zd__err_t *err) {
  S.set = *set;
  snprintf(S.dir, sizeof S.dir, "%s", set->dir ? set->dir : "");
  S.set.dir = S.dir;
  if (S.set.timeout_ms <= 0) S.set.timeout_ms = 600000;
  if (!S.dir[0] || (!set->every_steps && !set->every_s)) return ZD_OK;
  S.w = calloc(set->local_ranks, sizeof *S.w);
  if (!S.w) return zd__errf(err, -ENOMEM, "out of memory for state snapshots");
  S.nw = set->local_ranks;
  for (uint32_t i = 0; i < S.nw; i++) {
    writer_t *w = &S.w[i];
    pthread_mutex_init(&w->lock, NULL);
    pthread_condattr_t attr; /* resume's bounded wait for the writer counts monotonic time */
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&w->cond, &attr);
    pthread_condattr_destroy(&attr);
    w->local_rank = i;
    w->last_take_ms = zd__now_ms();
    int rc = pthread_create(&w->thread, NULL, writer_main, w);
    if (rc)
      return zd__errf(err, -rc, "state snapshots: cannot start a writer thread: %s", strerror(rc));
    w->started = 1;
  }
  ZD_LOG_INFO(
      "state snapshots (state_dir_mode = snapshot) every %u steps, every %u s (0: not "
      "by it), into %s",
      set->every_steps, set->every_s, S.dir);
  return ZD_OK;
}

void zd__snapshot_stop(void) {
  for (uint32_t i = 0; i < S.nw; i++) {
    writer_t *w = &S.w[i];
    if (w->started) {
      pthread_mutex_lock(&w->lock);
      w->stop = 1;
      pthread_cond_signal(&w->cond);
      pthread_mutex_unlock(&w->lock);
      pthread_join(w->thread, NULL);
    }
    if (w->staging && !w->poisoned && w->ops) w->ops->host_free(w->staging);
    pthread_mutex_destroy(&w->lock);
    pthread_cond_destroy(&w->cond);
  }
  free(S.w);
  S.w = NULL;
  S.nw = 0;
}

/* ---- the recovery --------------------------------------------------------------------------- */

/* A snapshot file read and checked: mapped whole (read-only). */
typedef struct loaded {
  zd__snapfile_hdr_t hdr;
  uint8_t *map;
  size_t len;
} loaded_t;

static uint64_t lags_key(const uint64_t *lags, uint64_t n) {
  int any = 0;
  for (uint64_t i = 0; lags && i < n && !any; i++) any = lags[i] != 0;
  if (!any) return 0;
  uint64_t h = XXH3_64bits(lags, n * sizeof *lags);
  return h ? h : 1;
}

static const uint64_t *loaded_lags(const loaded_t *f) {
  return f->hdr.nlags
             ? (const uint64_t *)(f->map + ZD__SNAPFILE_HDR_BYTES +
                                  zd__snapfile_arrays_bytes(f->hdr.states, f->hdr.shard_elems))
             : NULL;
}

/* Reads path as rank's snapshot of m's model: 1 when it serves (*out mapped), 0 when there is none
 * or it was set aside (logged). */
static int load(const char *path, const zd__step_ctx_t *ctx, const zd__model_t *m, loaded_t *out) {
  *out = (loaded_t){0};
  /* O_NONBLOCK: a FIFO planted there must not hold the open (zd__snapfile_check refuses it) */
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ELOOP) zd__snapfile_set_aside("state snapshot file", path, "is a symbolic link");
    return 0;
  }
  char why[300];
  zd__snapfile_hdr_t h;
  if (zd__snapfile_check(fd, ctx->rank, ctx->world_size, &h, why, sizeof why) == 0) {
    if (h.layout_hash != m->layout->hash || h.states != m->states ||
        h.shard_elems != m->layout->shard_elems || (h.nlags && h.nlags != m->layout->nparams))
      snprintf(why, sizeof why,
               "of another model (layout hash %016" PRIx64 ", state arrays 0x%x, %" PRIu64
               " shard elements; this model's: %016" PRIx64 ", 0x%x, %" PRIu64 ")",
               h.layout_hash, h.states, h.shard_elems, m->layout->hash, m->states,
               m->layout->shard_elems);
  }
  size_t len = ZD__SNAPFILE_HDR_BYTES + (size_t)h.bytes;
  void *p = MAP_FAILED;
  if (!why[0]) {
    p = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
      snprintf(why, sizeof why, "mmap: %s", strerror(errno));
    else if (XXH3_64bits((uint8_t *)p + ZD__SNAPFILE_HDR_BYTES, h.bytes) != h.checksum)
      snprintf(why, sizeof why, "its data fails its checksum (step %" PRIu64 ")", h.step);
  }
  close(fd);
  if (why[0]) {
    if (p != MAP_FAILED) munmap(p, len);
    zd__snapfile_set_aside("state snapshot file", path, why);
    return 0;
  }
  *out = (loaded_t){.hdr = h, .map = p, .len = len};
  return 1;
}

static void unload(loaded_t *f) {
  if (f->map) munmap(f->map, f->len);
  *f = (loaded_t){0};
}

/* What a rank can serve, all-gathered: its files' commits (step + steps skipped, lags key). */
typedef struct offer {
  uint64_t replace, n;
  uint64_t key[2], lags[2];
} offer_t;

static int serves(const offer_t *o, uint64_t key, uint64_t lags) {
  for (uint64_t i = 0; i < o->n; i++)
    if (o->key[i] == key && o->lags[i] == lags) return 1;
  return 0;
}

static int restore(const zd__step_ctx_t *ctx, zd__model_t *m, const loaded_t *f, zd__err_t *err) {
  writer_t *w = &S.w[ctx->local_rank];
  zd__compute_t *c = ctx->compute;
  int rc = staging(w, c, (size_t)f->hdr.bytes, err);
  if (rc) return rc;
  memcpy(w->staging, f->map + ZD__SNAPFILE_HDR_BYTES, f->hdr.bytes);
  if (m->restored) zd__model_forget_restored(m); /* first: it chooses the set written below */
  float *arrays[ZD__NSTATES];
  uint32_t count = state_arrays(m, arrays);
  rc = c->ops->restore(c, arrays, count, m->layout->shard_elems, (const float *)w->staging,
                       S.set.timeout_ms, err);
  if (rc) {
    w->poisoned = 1; /* compute.h: the copy may still read it */
    return rc;
  }
  m->step = f->hdr.step;
  m->steps_skipped = f->hdr.steps_skipped;
  if (f->hdr.scaler_enabled && m->scaler.enabled) {
    m->scaler.scale = f->hdr.scale;
    m->scaler.growth_tracker = f->hdr.growth_tracker;
    m->scaler.hysteresis_tracker = f->hdr.hysteresis_tracker;
  }
  zd__model_set_lags(m, loaded_lags(f));
  zd__model_commit(m, 0);
  m->resumed_from = ZD__FROM_SNAPSHOT;
  return ZD_OK;
}

int zd__snapshot_resume(const zd__step_ctx_t *ctx, zd__model_t *m, int replace, int *handled,
                        char *why, size_t len, zd__err_t *err) {
  *handled = 0;
  why[0] = '\0';
  if (!S.w || ctx->local_rank >= S.nw) return ZD_OK;
  writer_t *w = &S.w[ctx->local_rank];
  w->due_step = 0; /* a snapshot agreed for a step this registration replaces */
  /* A survivor's writer may still be writing its newest snapshot: the files are read once it is
   * done (bounded: a copy stuck on the device leaves it to the files as they are). */
  uint64_t until_us = zd__now_us() + 1000u * (uint64_t)S.set.timeout_ms;
  struct timespec ts = {.tv_sec = (time_t)(until_us / 1000000u),
                        .tv_nsec = (long)(until_us % 1000000u) * 1000L};
  pthread_mutex_lock(&w->lock);
  while (w->busy && pthread_cond_timedwait(&w->cond, &w->lock, &ts) != ETIMEDOUT) {
  }
  int writing = w->busy;
  uint64_t writing_step = w->hdr.step;
  pthread_mutex_unlock(&w->lock);
  /* Still writing (a disk that hangs): its staging and its files are the writer's, so this rank
   * offers nothing and the world falls back to the checkpoint. */
  if (writing)
    ZD_LOG_WARN("rank %u: the state snapshot of step %" PRIu64
                " is still being written after %d ms: this rank offers no snapshot",
                ctx->rank, writing_step, S.set.timeout_ms);
  loaded_t f[2] = {0};
  offer_t mine = {.replace = (uint64_t)replace};
  if (!replace && !writing) {
    char path[4096];
    const char *sfx[2] = {"", ".prev"};
    path_of(path, sizeof path, ctx->rank, ctx->world_size, ".part");
    unlink(path); /* a write cut short by a kill (never read; the writer is idle) */
    for (int i = 0; i < 2; i++) {
      path_of(path, sizeof path, ctx->rank, ctx->world_size, sfx[i]);
      if (!load(path, ctx, m, &f[mine.n])) continue;
      mine.key[mine.n] = f[mine.n].hdr.step + f[mine.n].hdr.steps_skipped;
      mine.lags[mine.n] = lags_key(loaded_lags(&f[mine.n]), f[mine.n].hdr.nlags);
      mine.n++;
    }
  }
  uint32_t world = ctx->world_size;
  offer_t *all = calloc(world, sizeof *all);
  if (!all) {
    unload(&f[0]);
    unload(&f[1]);
    return zd__errf(err, -ENOMEM, "out of memory");
  }
  int rc = ZD_OK;
  if (world > 1)
    rc = ctx->comm->ops->allgather_bytes(ctx->comm, &mine, sizeof mine, all, err);
  else
    all[0] = mine;
  int pick = -1, any = 0, replacing = 0;
  for (uint32_t r = 0; !rc && r < world; r++) {
    any |= all[r].n != 0;
    replacing |= all[r].replace != 0;
  }
  if (!rc && !replacing && !any) snprintf(why, len, "no rank holds a state snapshot yet");
  if (rc || replacing || !any) goto out; /* nothing to serve: the checkpoint decides */
  /* The newest of this rank's commits that every rank serves (every rank picks the same one: the
   * commits are named alike everywhere). */
  for (uint64_t i = 0; i < mine.n; i++) {
    uint32_t q = 0;
    while (q < world && serves(&all[q], mine.key[i], mine.lags[i])) q++;
    if (q == world && (pick < 0 || mine.key[i] > mine.key[pick])) pick = (int)i;
  }
  for (uint32_t r = 0; r < world && !why[0]; r++)
    if (!all[r].n) snprintf(why, len, "rank %u has no usable state snapshot file", r);
  if (pick < 0 && !why[0])
    snprintf(why, len,
             "the ranks' state snapshot files hold no step in common (a snapshot being written "
             "at the loss on some rank)");
  if (why[0]) {
    ZD_LOG_WARN(
        "rank %u: no state snapshot can serve the world: %s; falling back to the "
        "checkpoint",
        ctx->rank, why);
    goto out;
  }
  uint64_t newest = mine.n ? f[0].hdr.step : 0;
  rc = restore(ctx, m, &f[pick], err);
  /* Every rank restored, or none serves: a rank whose restore failed alone would leave the others
   * at the snapshot's step and itself retrying a registration nobody else joins. */
  if (world > 1) {
    int32_t ok = rc == ZD_OK, *oks = calloc(world, sizeof *oks);
    zd__err_t gerr = {0};
    int grc =
        oks ? ctx->comm->ops->allgather_bytes(ctx->comm, &ok, sizeof ok, oks, &gerr) : -ENOMEM;
    for (uint32_t r = 0; !grc && !rc && r < world; r++)
      if (!oks[r])
        rc = zd__errf(err, ZD_EPEER,
                      "rank %u could not restore the state snapshot of step %" PRIu64
                      " that every rank holds (its log says why); register again",
                      r, f[pick].hdr.step);
    if (grc && !rc) rc = zd__errf(err, grc, "%s", oks ? gerr.msg : "out of memory");
    free(oks);
  }
  if (rc) goto out;
  *handled = 1;
  /* This rank's newer files (a survivor's snapshot of a step the others never reached) go: the
   * world continues from this one. (Two files of one step cannot be: a write drops the files of
   * its step and later first.) */
  drop_newer(ctx->rank, ctx->world_size, m->step, 0);
  ZD_LOG_INFO("rank %u resumed step %" PRIu64
              " from its state snapshot (state_dir_mode = snapshot), not from a checkpoint%s",
              ctx->rank, m->step, newest != m->step ? " (the step every rank holds)" : "");
out:
  free(all);
  unload(&f[0]);
  unload(&f[1]);
  return rc;
}

void zd__snapshot_resumed_elsewhere(const zd__step_ctx_t *ctx, uint64_t step) {
  if (!S.w || ctx->local_rank >= S.nw) return;
  writer_t *w = &S.w[ctx->local_rank];
  pthread_mutex_lock(&w->lock);
  int busy = w->busy;
  pthread_mutex_unlock(&w->lock);
  if (!busy) drop_newer(ctx->rank, ctx->world_size, step, 0); /* busy: its write drops them */
}

/* ---- status --------------------------------------------------------------------------------- */

void zd__snapshot_rank_status(uint32_t local_rank, zd__snapshot_rank_status_t *out) {
  *out = (zd__snapshot_rank_status_t){0};
  if (!S.w || local_rank >= S.nw) return;
  writer_t *w = &S.w[local_rank];
  pthread_mutex_lock(&w->lock);
  out->has = w->taken > 0;
  out->step = w->step;
  uint64_t now = zd__unix_ms();
  out->age_ms = now > w->unix_ms ? now - w->unix_ms : 0;
  out->bytes = w->bytes;
  out->taken = w->taken;
  out->skipped = w->skipped;
  out->failures = w->failures;
  out->last_stall_us = w->last_stall_us;
  out->last_write_ms = w->last_write_ms;
  snprintf(out->error, sizeof out->error, "%s", w->error);
  pthread_mutex_unlock(&w->lock);
}

void zd__snapshot_status(void *ctx, zd__status_t *st) {
  (void)ctx;
  zd__status_section(st, "snapshot");
  zd__status_add(st, "state_dir_mode", "snapshot");
  zd__status_add(st, "state_dir", "%s", S.dir);
  zd__status_add(st, "every_steps", "%u", S.set.every_steps);
  zd__status_add(st, "every_s", "%u", S.set.every_s);
  for (uint32_t i = 0; i < S.nw; i++) {
    zd__snapshot_rank_status_t s;
    zd__snapshot_rank_status(i, &s);
    uint32_t r = S.set.first_rank + i;
    char k[64];
#define KEY(name) (snprintf(k, sizeof k, "rank%u_" name, r), k)
    zd__status_add(st, KEY("snapshots"), "%" PRIu64, s.taken);
    zd__status_add(st, KEY("skipped"), "%" PRIu64, s.skipped);
    zd__status_add(st, KEY("failures"), "%" PRIu64, s.failures);
    if (s.has) {
      zd__status_add(st, KEY("snapshot_step"), "%" PRIu64, s.step);
      zd__status_add(st, KEY("snapshot_age_ms"), "%" PRIu64, s.age_ms);
      zd__status_add(st, KEY("snapshot_bytes"), "%" PRIu64, s.bytes);
      zd__status_add(st, KEY("last_stall_us"), "%" PRIu64, s.last_stall_us);
      zd__status_add(st, KEY("last_write_ms"), "%" PRIu64, s.last_write_ms);
    } else {
      zd__status_add(st, KEY("snapshot_step"), "none");
    }
    if (s.error[0]) zd__status_add(st, KEY("snapshot_error"), "%s", s.error);
#undef KEY
  }
}
