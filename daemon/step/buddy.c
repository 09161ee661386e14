/* Buddy copies: the snapshots and their senders, the copies this node holds for its wards (in
 * memory or in state_dir's files), and the agreement that restores a rank that came back empty
 * from its buddy's copy (buddy.h). */
#include "buddy.h"

#include <dirent.h>
#include <stddef.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "clock.h"
#include "comm.h"
#include "grpc_unary.h"
#include "log.h"
#include "rendezvous.h"
#include "snapfile.h"

#define PIECE_BYTES (1u << 20) /* one BuddyPut/BuddyGet message's data */
#define CALL_MS     5000
#define DOMAIN_KEY  "buddy/domain/"
#define COPIED_KEY  "buddy/copied/" /* + rank: the step of its newest complete copy */

/* What a snapshot or a copy is of. Its data: the state arrays the model has (states, in role
 * order, shard_elems floats each), then nlags uint64s, the model's per-parameter step lags of
 * that commit (zd__model_t.lag, layout order; nlags is 0 when no parameter lags, else the model's
 * parameter count); bytes in all. */
typedef struct meta {
  uint32_t rank, world_size, states, nlags;
  uint64_t layout_hash, step, steps_skipped, shard_elems, bytes;
  int scaler_enabled;
  double scale;
  uint32_t growth_tracker, hysteresis_tracker;
  uint64_t taken_unix_ms;
  uint64_t checksum; /* XXH3-64 of the data (set by the sender; 0 in a snapshot) */
} meta_t;

typedef struct snap {
  meta_t meta;
  uint8_t *data;
  size_t cap;
  int valid;
} snap_t;

/* A local rank's snapshots and sender. snap[sent] is the copy complete at the buddy (-1: none),
 * snap[sending] the one being sent (-1: none); the worker writes only a snapshot that is neither
 * (after_step) and reads them (resume), the sender reads snap[sending]. */
typedef struct sender {
  pthread_t thread;
  int started;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  snap_t snap[2];
  int sent, sending;
  int stop;
  uint32_t local_rank;
  /* the worker's only: when it last took a snapshot (zd__now_ms), the step agreed for a copy */
  uint64_t last_take_ms, due_step;
  /* status (lock) */
  uint64_t copies, skipped, failures;
  uint64_t copy_step, copy_unix_ms, last_send_ms, last_snapshot_us;
  char holder[256];
  char error[256];
} sender_t;

/* Where a held copy's bytes are: malloc'd (fd -1), or a file of state_dir, mapped whole, its
 * data after a header of HDR_BYTES (fd open, holding the file's flock). */
typedef struct region {
  uint8_t *map;
  size_t len;
  int fd;
} region_t;

#define HDR_BYTES ZD__SNAPFILE_HDR_BYTES

/* A ward's copy held here: the complete one and the one being received. */
typedef struct held {
  meta_t meta, pmeta;
  region_t cur, part;
  uint64_t received;
  uint64_t complete_unix_ms;
  char from[256];
  int has;
} held_t;

static struct {
  zd__buddy_settings_t set;
  char domain[256], rendezvous[512], token[512], address[512], state_dir[3800];
  sender_t *senders;
  uint32_t nsenders;
  pthread_mutex_t store_lock;
  held_t *held;
  uint32_t nheld;
  /* Every node lost at once (zd__buddy_resume; store_lock): how many local ranks found the world
   * empty while the store recorded their copies, the newest such copy's step, and the step the
   * world continued from (the first step agreed after it, less one; lost_pending until then). */
  uint32_t lost_ranks;
  uint64_t lost_copy_step, lost_from_step;
  atomic_int lost_pending;
  /* The world's size now: set.world_size at start, then each live resize's (zd__buddy_resized).
   * Holders are chosen among the nodes below it. */
  atomic_uint world_size;
} B = {.store_lock = PTHREAD_MUTEX_INITIALIZER};

/* ---- the snapshot --------------------------------------------------------------------------- */

/* The bytes of a copy's state arrays, and of the whole copy with nlags lags after them. */
static uint64_t arrays_bytes(uint32_t states, uint64_t shard_elems) {
  return zd__snapfile_arrays_bytes(states, shard_elems);
}
static uint64_t copy_bytes(uint32_t states, uint64_t shard_elems, uint64_t nlags) {
  return zd__snapfile_data_bytes(states, shard_elems, nlags);
}

/* A snapshot's or copy's lags (NULL: every parameter at its step), and the key that names them
 * in the recovery's offers: 0 for none, else their XXH3-64 (never 0). */
static const uint64_t *snap_lags(const snap_t *sn) {
  return sn->meta.nlags
             ? (const uint64_t *)(sn->data + arrays_bytes(sn->meta.states, sn->meta.shard_elems))
             : NULL;
}
static uint64_t lags_key(const uint64_t *lags, uint64_t n) {
  int any = 0;
  for (uint64_t i = 0; lags && i < n && !any; i++) any = lags[i] != 0;
  if (!any) return 0;
  uint64_t h = XXH3_64bits(lags, n * sizeof *lags);
  return h ? h : 1;
}

static void meta_of(const zd__step_ctx_t *ctx, const zd__model_t *m, meta_t *out) {
  *out = (meta_t){.rank = ctx->rank,
                  .world_size = ctx->world_size,
                  .states = m->states,
                  .nlags = m->nlagging ? m->layout->nparams : 0,
                  .layout_hash = m->layout->hash,
                  .step = m->step,
                  .steps_skipped = m->steps_skipped,
                  .shard_elems = m->layout->shard_elems,
                  .scaler_enabled = m->scaler.enabled,
                  .scale = m->scaler.scale,
                  .growth_tracker = m->scaler.growth_tracker,
                  .hysteresis_tracker = m->scaler.hysteresis_tracker,
                  .taken_unix_ms = zd__unix_ms()};
  out->bytes = copy_bytes(m->states, out->shard_elems, out->nlags);
}

int zd__buddy_wants(const zd__step_ctx_t *ctx) {
  if (!B.senders || ctx->local_rank >= B.nsenders) return 0;
  sender_t *s = &B.senders[ctx->local_rank];
  int out = 0;
  if (B.set.every_s && zd__now_ms() - s->last_take_ms >= (uint64_t)B.set.every_s * 1000u)
    out |= ZD__BUDDY_WANT;
  pthread_mutex_lock(&s->lock);
  if (s->sending >= 0) out |= ZD__BUDDY_BUSY;
  pthread_mutex_unlock(&s->lock);
  return out;
}

void zd__buddy_agreed(const zd__step_ctx_t *ctx, uint64_t step, int asked, int busy) {
  if (!B.senders || ctx->local_rank >= B.nsenders) return;
  if (atomic_load(&B.lost_pending)) {
    pthread_mutex_lock(&B.store_lock);
    if (B.lost_pending) B.lost_from_step = step - 1;
    B.lost_pending = 0;
    pthread_mutex_unlock(&B.store_lock);
  }
  sender_t *s = &B.senders[ctx->local_rank];
  int due = asked || (B.set.every_steps && step % B.set.every_steps == 0);
  s->due_step = due && !busy ? step : 0;
  if (due && busy) {
    pthread_mutex_lock(&s->lock);
    s->skipped++;
    pthread_mutex_unlock(&s->lock);
    ZD_LOG_WARN("rank %u: buddy copy of step %" PRIu64
                " skipped on every rank: a rank's previous copy is still being sent",
                ctx->rank, step);
  }
}

void zd__buddy_after_step(const zd__step_ctx_t *ctx, const zd__model_t *m) {
  if (!B.senders || ctx->local_rank >= B.nsenders || !m->step) return;
  sender_t *s = &B.senders[ctx->local_rank];
  int due = s->due_step && s->due_step == m->step;
  if (s->due_step && m->step >= s->due_step) s->due_step = 0;
  if (!due) return;
  pthread_mutex_lock(&s->lock);
  int busy = s->sending >= 0;
  if (busy) s->skipped++;
  int idx = s->sent == 0 ? 1 : 0;
  pthread_mutex_unlock(&s->lock);
  if (busy) {
    ZD_LOG_WARN("rank %u: buddy copy of step %" PRIu64
                " skipped: the previous copy is still being sent",
                ctx->rank, m->step);
    return;
  }
  uint64_t t0 = zd__now_us();
  snap_t *sn = &s->snap[idx];
  meta_t meta;
  meta_of(ctx, m, &meta);
  sn->valid = 0;
  if (sn->cap < meta.bytes) {
    uint8_t *p = realloc(sn->data, meta.bytes);
    if (!p) {
      pthread_mutex_lock(&s->lock);
      s->failures++;
      snprintf(s->error, sizeof s->error, "out of memory for a snapshot of %" PRIu64 " bytes",
               meta.bytes);
      pthread_mutex_unlock(&s->lock);
      return;
    }
    sn->data = p;
    sn->cap = meta.bytes;
  }
  uint64_t off = 0, each = meta.shard_elems * sizeof(float);
  for (int i = 0; i < ZD__NSTATES; i++)
    if (m->states & ZD__STATE_BIT(i)) {
      memcpy(sn->data + off, m->shard.state[i], each);
      off += each;
    }
  if (meta.nlags) memcpy(sn->data + off, m->lag, meta.nlags * sizeof *m->lag);
  sn->meta = meta;
  sn->valid = 1;
  s->last_take_ms = zd__now_ms();
  pthread_mutex_lock(&s->lock);
  s->last_snapshot_us = zd__now_us() - t0;
  s->sending = idx;
  pthread_cond_signal(&s->cond);
  pthread_mutex_unlock(&s->lock);
}

/* ---- the sender ----------------------------------------------------------------------------- */

static int domains_differ(const char *a, const char *b) {
  return !a[0] || !b[0] || strcmp(a, b) != 0;
}

/* This node's failure domain in the store, for the others' choice of buddy. */
static int publish_domain(zd__rdv_t *rdv, zd__err_t *err) {
  char key[64];
  snprintf(key, sizeof key, DOMAIN_KEY "%u", B.set.first_rank);
  size_t len = strlen(B.domain);
  int rc = zd__rdv_set(rdv, key, B.domain, len, CALL_MS, err);
  if (rc == -EEXIST) { /* a restarted zerod: its entry is its own to replace */
    rc = zd__rdv_delete(rdv, key, CALL_MS, err);
    if (!rc) rc = zd__rdv_set(rdv, key, B.domain, len, CALL_MS, err);
  }
  return rc;
}

/* The buddy: the next node after this one in rank order whose domain differs, else the next;
 * among the nodes of the world as it is now (the registry keeps the nodes a live resize left
 * out until they register again elsewhere: they hold no copy). */
static int choose_holder(zd__rdv_t *rdv, char *addr, size_t len, zd__err_t *err) {
  Zerod__V1__NodesReply *rep = NULL;
  int rc = zd__rdv_nodes(rdv, &rep, CALL_MS, err);
  if (rc) return rc;
  const uint32_t w = atomic_load(&B.world_size);
  size_t n = 0, me = SIZE_MAX;
  const Zerod__V1__NodeInfo **nodes = calloc(rep->n_nodes ? rep->n_nodes : 1, sizeof *nodes);
  addr[0] = '\0';
  if (!nodes) {
    rc = zd__errf(err, -ENOMEM, "out of memory listing %zu nodes", rep->n_nodes);
    goto out;
  }
  for (size_t i = 0; i < rep->n_nodes; i++) { /* in rank order (rendezvous.h): keep the world's */
    if (rep->nodes[i]->first_rank >= w) continue;
    if (rep->nodes[i]->first_rank == B.set.first_rank) me = n;
    nodes[n++] = rep->nodes[i];
  }
  if (me == SIZE_MAX || n < 2) {
    rc = zd__errf(err, -EAGAIN, "the node registry lists %s of the world of %u ranks",
                  me == SIZE_MAX ? "not this node yet" : "no other node yet", w);
    goto out;
  }
  size_t fallback = (me + 1) % n;
  for (size_t k = 1; k < n && !addr[0]; k++) {
    const Zerod__V1__NodeInfo *c = nodes[(me + k) % n];
    char key[64];
    snprintf(key, sizeof key, DOMAIN_KEY "%u", c->first_rank);
    void *v = NULL;
    size_t vlen = 0;
    zd__err_t gerr = {0};
    char theirs[256] = "";
    if (zd__rdv_get(rdv, key, &v, &vlen, 200, &gerr) == ZD_OK)
      snprintf(theirs, sizeof theirs, "%.*s", (int)(vlen < 255 ? vlen : 255), (char *)v);
    free(v);
    if (domains_differ(B.domain, theirs)) snprintf(addr, len, "%s", c->control_address);
  }
  if (!addr[0]) {
    snprintf(addr, len, "%s", nodes[fallback]->control_address);
    ZD_LOG_WARN(
        "buddy: every node is in failure domain \"%s\"; copies go to %s, in the same "
        "domain",
        B.domain, addr);
  }
out:
  free(nodes);
  protobuf_c_message_free_unpacked(&rep->base, NULL);
  return rc;
}

static void info_of(const meta_t *m, Zerod__V1__BuddyCopyInfo *info) {
  zerod__v1__buddy_copy_info__init(info);
  info->rank = m->rank;
  info->world_size = m->world_size;
  info->layout_hash = m->layout_hash;
  info->step = m->step;
  info->steps_skipped = m->steps_skipped;
  info->states = m->states;
  info->shard_elems = m->shard_elems;
  info->total_bytes = m->bytes;
  info->has_scaler_enabled = info->has_scale = 1;
  info->has_growth_tracker = info->has_hysteresis_tracker = info->has_taken_unix_ms = 1;
  info->scaler_enabled = m->scaler_enabled;
  info->scale = m->scale;
  info->growth_tracker = m->growth_tracker;
  info->hysteresis_tracker = m->hysteresis_tracker;
  info->taken_unix_ms = m->taken_unix_ms;
  info->has_checksum = 1;
  info->checksum = m->checksum;
  info->has_lag_count = m->nlags != 0;
  info->lag_count = m->nlags;
  info->from_address = B.address;
}

static void meta_from(const Zerod__V1__BuddyCopyInfo *i, meta_t *m) {
  *m = (meta_t){.rank = i->rank,
                .world_size = i->world_size,
                .states = i->states,
                .nlags = i->has_lag_count ? i->lag_count : 0,
                .layout_hash = i->layout_hash,
                .step = i->step,
                .steps_skipped = i->steps_skipped,
                .shard_elems = i->shard_elems,
                .bytes = i->total_bytes,
                .scaler_enabled = i->scaler_enabled,
                .scale = i->scale,
                .growth_tracker = i->growth_tracker,
                .hysteresis_tracker = i->hysteresis_tracker,
                .taken_unix_ms = i->taken_unix_ms,
                .checksum = i->checksum};
}

static void sleep_ms(uint64_t ms) {
  struct timespec ts = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Sends sn in pieces, no faster than bytes_per_s. */
static int send_copy(sender_t *s, zd__grpc_channel_t *ch, const snap_t *sn, zd__err_t *err) {
  Zerod__V1__BuddyCopyInfo info;
  info_of(&sn->meta, &info);
  info.checksum = XXH3_64bits(sn->data, sn->meta.bytes); /* on this thread, not the worker */
  uint64_t t0 = zd__now_us(), off = 0, total = sn->meta.bytes;
  int rc = ZD_OK;
  do {
    pthread_mutex_lock(&s->lock);
    int stop = s->stop;
    pthread_mutex_unlock(&s->lock);
    if (stop) return zd__errf(err, -ECANCELED, "zerod is shutting down");
    uint64_t len = total - off < PIECE_BYTES ? total - off : PIECE_BYTES;
    Zerod__V1__BuddyPutRequest req = ZEROD__V1__BUDDY_PUT_REQUEST__INIT;
    req.info = &info;
    req.offset = off;
    req.data.data = sn->data + off;
    req.data.len = len;
    req.has_last = 1;
    req.last = off + len == total;
    ProtobufCMessage *rep = NULL;
    rc = zd__grpc_call(ch, "/zerod.v1.Control/BuddyPut", &req.base,
                       &zerod__v1__buddy_put_reply__descriptor, &rep, CALL_MS, 0, NULL, err);
    if (rep) protobuf_c_message_free_unpacked(rep, NULL);
    off += len;
    if (!rc && B.set.bytes_per_s) {
      uint64_t due_us = t0 + off * 1000000u / B.set.bytes_per_s, now = zd__now_us();
      if (due_us > now) sleep_ms((due_us - now + 999) / 1000);
    }
  } while (!rc && off < total);
  return rc;
}

/* The store records each rank's newest complete copy (COPIED_KEY), so that a world whose every
 * node was lost at once can tell that from a first start where the store outlives the nodes
 * (etcd). Best effort: a failure is logged, the copy stands. */
static int store_outlives_nodes(void) {
  return strncmp(B.rendezvous, "etcd://", 7) == 0;
}

static void record_copied(zd__rdv_t *rdv, const meta_t *m) {
  /* Only on etcd: the built-in store dies with rank 0's node, so it could never tell. */
  if (!store_outlives_nodes()) return;
  char key[64], val[32];
  snprintf(key, sizeof key, COPIED_KEY "%u", m->rank);
  int len = snprintf(val, sizeof val, "%" PRIu64, m->step);
  zd__err_t err = {0};
  int rc = zd__rdv_delete(rdv, key, CALL_MS, &err);
  if (!rc) rc = zd__rdv_set(rdv, key, val, (size_t)len, CALL_MS, &err);
  if (rc)
    ZD_LOG_WARN("rank %u: recording its copy of step %" PRIu64 " in the store: %s", m->rank,
                m->step, err.msg);
}

static void *sender_main(void *arg) {
  sender_t *s = arg;
  zd__rdv_t *rdv = NULL;
  zd__grpc_channel_t *ch = NULL;
  char holder[256] = "";
  int published = 0;
  pthread_mutex_lock(&s->lock);
  for (;;) {
    while (!s->stop && s->sending < 0) pthread_cond_wait(&s->cond, &s->lock);
    if (s->stop) break;
    int idx = s->sending;
    pthread_mutex_unlock(&s->lock);
    zd__err_t err = {0};
    int rc = rdv ? ZD_OK : zd__rdv_open(B.rendezvous, &rdv, &err);
    if (!rc && B.token[0]) rc = zd__rdv_set_token(rdv, B.token, &err);
    if (!rc && !published && s->local_rank == 0) rc = publish_domain(rdv, &err);
    if (!rc) published = 1;
    char addr[256];
    if (!rc) rc = choose_holder(rdv, addr, sizeof addr, &err);
    if (!rc && (!ch || strcmp(addr, holder) != 0)) {
      zd__grpc_channel_close(ch);
      ch = NULL;
      snprintf(holder, sizeof holder, "%s", addr);
      rc = zd__grpc_channel_open(holder, &ch, &err);
      if (!rc && B.token[0]) rc = zd__grpc_channel_set_token(ch, B.token);
    }
    uint64_t t0 = zd__now_ms();
    if (!rc) rc = send_copy(s, ch, &s->snap[idx], &err);
    uint64_t send_ms = zd__now_ms() - t0;
    const meta_t m = s->snap[idx].meta; /* still this thread's: sending is idx */
    pthread_mutex_lock(&s->lock);
    s->sending = -1; /* the worker may snapshot again (into the other buffer) */
    if (!rc) s->sent = idx;
    pthread_mutex_unlock(&s->lock);
    /* Outside s->lock, which the loop thread (status) and the worker (each step) take: a record
     * waits for the store, up to CALL_MS twice. (Under it, rank 0's record in the built-in store,
     * served on that loop, waited for a loop that waited for it: status, the store and the
     * heartbeats stopped for CALL_MS.) Status counts the copy once it is recorded. */
    if (!rc) record_copied(rdv, &m);
    pthread_mutex_lock(&s->lock);
    if (!rc) {
      s->copies++;
      s->copy_step = m.step;
      s->copy_unix_ms = m.taken_unix_ms;
      s->last_send_ms = send_ms;
      snprintf(s->holder, sizeof s->holder, "%s", holder);
      s->error[0] = '\0';
    } else if (rc != -ECANCELED) {
      s->failures++;
      snprintf(s->error, sizeof s->error, "step %" PRIu64 ": %.200s", m.step, err.msg);
      ZD_LOG_WARN("buddy copy of rank %u's step %" PRIu64 " failed: %s", m.rank, m.step, err.msg);
      zd__grpc_channel_close(ch); /* a new connection next time */
      ch = NULL;
    }
  }
  pthread_mutex_unlock(&s->lock);
  zd__grpc_channel_close(ch);
  zd__rdv_close(rdv);
  return NULL;
}

static int load_held(zd__err_t *err);
static void region_free(region_t *r);

int zd__buddy_start(const zd__buddy_settings_t *set, zd__err_t *err) {
  B.set = *set;
  snprintf(B.state_dir, sizeof B.state_dir, "%s", set->state_dir ? set->state_dir : "");
  B.set.state_dir = B.state_dir;
  snprintf(B.domain, sizeof B.domain, "%s", set->domain ? set->domain : "");
  snprintf(B.rendezvous, sizeof B.rendezvous, "%s", set->rendezvous ? set->rendezvous : "");
  snprintf(B.token, sizeof B.token, "%s", set->control_token ? set->control_token : "");
  snprintf(B.address, sizeof B.address, "%s", set->control_address ? set->control_address : "");
  B.set.domain = B.domain;
  B.set.rendezvous = B.rendezvous;
  B.set.control_token = B.token;
  B.set.control_address = B.address;
  atomic_store(&B.world_size, set->world_size);
  if (B.state_dir[0]) {
    int rc = load_held(err);
    if (rc) return rc;
  }
  if ((!set->every_steps && !set->every_s) || set->world_size < 2) return ZD_OK;
  B.senders = calloc(set->local_ranks, sizeof *B.senders);
  if (!B.senders) return zd__errf(err, -ENOMEM, "out of memory for buddy copies");
  B.nsenders = set->local_ranks;
  for (uint32_t i = 0; i < B.nsenders; i++) {
    sender_t *s = &B.senders[i];
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
    s->sent = s->sending = -1;
    s->local_rank = i;
    s->last_take_ms = zd__now_ms();
    int rc = pthread_create(&s->thread, NULL, sender_main, s);
    if (rc)
      return zd__errf(err, -rc, "buddy copies: cannot start a sender thread: %s", strerror(rc));
    s->started = 1;
  }
  char every[96];
  if (set->every_steps && set->every_s)
    snprintf(every, sizeof every, "every %u steps and every %u s", set->every_steps, set->every_s);
  else if (set->every_steps)
    snprintf(every, sizeof every, "every %u steps", set->every_steps);
  else
    snprintf(every, sizeof every, "every %u s", set->every_s);
  ZD_LOG_INFO("buddy copies %s%s%s%s, held for other nodes in %s", every,
              B.domain[0] ? " out of failure domain \"" : "", B.domain, B.domain[0] ? "\"" : "",
              B.state_dir[0] ? B.state_dir : "memory");
  return ZD_OK;
}

void zd__buddy_stop(void) {
  for (uint32_t i = 0; i < B.nsenders; i++) {
    sender_t *s = &B.senders[i];
    if (s->started) {
      pthread_mutex_lock(&s->lock);
      s->stop = 1;
      pthread_cond_signal(&s->cond);
      pthread_mutex_unlock(&s->lock);
      pthread_join(s->thread, NULL);
    }
    free(s->snap[0].data);
    free(s->snap[1].data);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->cond);
  }
  free(B.senders);
  B.senders = NULL;
  B.nsenders = 0;
  pthread_mutex_lock(&B.store_lock);
  for (uint32_t i = 0; i < B.nheld; i++) {
    region_free(&B.held[i].cur);
    region_free(&B.held[i].part);
  }
  free(B.held);
  B.held = NULL;
  B.nheld = 0;
  pthread_mutex_unlock(&B.store_lock);
}

/* ---- the holder ----------------------------------------------------------------------------- */

/* The header of a held copy's file (snapfile.h). */
typedef zd__snapfile_hdr_t file_hdr_t;

static uint8_t *region_data(const region_t *r) {
  return r->map ? r->map + (r->fd >= 0 ? HDR_BYTES : 0) : NULL;
}

static void region_free(region_t *r) {
  if (r->fd >= 0) {
    if (r->map) munmap(r->map, r->len);
    close(r->fd);
  } else {
    free(r->map);
  }
  *r = (region_t){.fd = -1};
}

static void path_of(char *out, size_t len, uint32_t rank, uint32_t world_size, int part) {
  snprintf(out, len, "%s/buddy-rank%u-of-%u.zdbuddy%s", B.state_dir, rank, world_size,
           part ? ".part" : "");
}

/* Renames a held copy's file aside, for an operator to look at; never deleted. */
static void set_aside(const char *path, const char *why) {
  zd__snapfile_set_aside("buddy copy file", path, why);
}

/* The entry of (rank, world size), made when absent (create); NULL: none (or out of memory).
 * store_lock held (or before the control service serves). */
static held_t *held_of(uint32_t rank, uint32_t world_size, int create) {
  for (uint32_t i = 0; i < B.nheld; i++)
    if (B.held[i].meta.rank == rank && B.held[i].meta.world_size == world_size) return &B.held[i];
  if (!create) return NULL;
  held_t *h = realloc(B.held, (B.nheld + 1) * sizeof *h);
  if (!h) return NULL;
  B.held = h;
  h = &B.held[B.nheld++];
  *h = (held_t){
      .meta = {.rank = rank, .world_size = world_size}, .cur = {.fd = -1}, .part = {.fd = -1}};
  return h;
}

void zd__buddy_resized(uint32_t local_rank, uint32_t world_size) {
  atomic_store(&B.world_size, world_size);
  if (B.senders && local_rank < B.nsenders) { /* this rank's snapshots of the old layout */
    sender_t *s = &B.senders[local_rank];
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < 2; i++)
      if (i != s->sending && s->snap[i].valid && s->snap[i].meta.world_size != world_size) {
        s->snap[i].valid = 0;
        if (s->sent == i) s->sent = -1;
      }
    pthread_mutex_unlock(&s->lock);
  }
  /* The copies held for the old world's ranks: no rank of the new one resumes from them. */
  uint32_t dropped = 0;
  pthread_mutex_lock(&B.store_lock);
  for (uint32_t i = 0; i < B.nheld;) {
    held_t *h = &B.held[i];
    if (h->meta.world_size == world_size) {
      i++;
      continue;
    }
    char path[4096];
    if (h->cur.fd >= 0) {
      path_of(path, sizeof path, h->meta.rank, h->meta.world_size, 0);
      unlink(path);
    }
    if (h->part.fd >= 0) {
      path_of(path, sizeof path, h->meta.rank, h->meta.world_size, 1);
      unlink(path);
    }
    region_free(&h->cur);
    region_free(&h->part);
    B.held[i] = B.held[--B.nheld];
    dropped++;
  }
  pthread_mutex_unlock(&B.store_lock);
  if (dropped)
    ZD_LOG_INFO("buddy: the world is now %u ranks: dropped %u copies held for the old world",
                world_size, dropped);
}

/* A copy larger than this is refused: a peer cannot make this node allocate without bound. */
#define MAX_COPY_BYTES ZD__SNAPFILE_MAX_BYTES
#define MAX_LAGS       ZD__SNAPFILE_MAX_LAGS

/* Loads one held copy's file (start-up, before the control service serves). A file another
 * zerod has open (its flock) is left alone; one that fails the checks is set aside. */
static void load_file(const char *path, uint32_t rank, uint32_t world_size) {
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK); /* a FIFO: no wait */
  if (fd < 0) {
    if (errno == ELOOP)
      set_aside(path, "is a symbolic link");
    else
      ZD_LOG_WARN("buddy copy file %s: %s; not served", path, strerror(errno));
    return;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) { /* another zerod's, sharing this state_dir */
    close(fd);
    return;
  }
  file_hdr_t hdr;
  char why[300];
  if (zd__snapfile_check(fd, rank, world_size, &hdr, why, sizeof why) != 0) {
    close(fd);
    set_aside(path, why);
    return;
  }
  size_t size = (size_t)(HDR_BYTES + hdr.bytes); /* the file's size, as checked */
  void *p = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
  held_t *h = p == MAP_FAILED ? NULL : held_of(rank, world_size, 1);
  if (!h) {
    ZD_LOG_WARN("buddy copy file %s: %s; not served", path,
                p == MAP_FAILED ? strerror(errno) : "out of memory");
    if (p != MAP_FAILED) munmap(p, size);
    close(fd);
    return;
  }
  region_free(&h->cur);
  h->cur = (region_t){.map = p, .len = size, .fd = fd};
  h->meta = (meta_t){.rank = hdr.rank,
                     .world_size = hdr.world_size,
                     .states = hdr.states,
                     .nlags = hdr.nlags,
                     .layout_hash = hdr.layout_hash,
                     .step = hdr.step,
                     .steps_skipped = hdr.steps_skipped,
                     .shard_elems = hdr.shard_elems,
                     .bytes = hdr.bytes,
                     .scaler_enabled = (int)hdr.scaler_enabled,
                     .scale = hdr.scale,
                     .growth_tracker = hdr.growth_tracker,
                     .hysteresis_tracker = hdr.hysteresis_tracker,
                     .taken_unix_ms = hdr.taken_unix_ms,
                     .checksum = hdr.checksum};
  h->has = 1;
  h->complete_unix_ms = hdr.complete_unix_ms;
  snprintf(h->from, sizeof h->from, "%.*s", (int)sizeof hdr.from - 1, hdr.from);
  ZD_LOG_INFO("holds the buddy copy of rank %u (of %u) at step %" PRIu64 ", %" PRIu64
              " bytes, from its state_dir (%s)",
              rank, world_size, hdr.step, hdr.bytes, path);
}

/* A ".part" left by a copy in flight when a zerod died: never complete, deleted (unless another
 * zerod sharing the state_dir is writing it: its flock). */
static void drop_part(const char *path) {
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) != 0) {
    close(fd);
    return;
  }
  if (fd >= 0 || errno == ELOOP) {
    if (unlink(path) == 0)
      ZD_LOG_INFO("buddy copy file %s: a copy in flight when zerod stopped; deleted", path);
  }
  if (fd >= 0) close(fd);
}

/* The copies of state_dir's files: this node's wards' (copies of this node's own ranks are
 * another zerod's sharing the directory, and are left alone). */
static int load_held(zd__err_t *err) {
  DIR *d = opendir(B.state_dir);
  if (!d) return zd__errf(err, -errno, "state_dir %s: %s", B.state_dir, strerror(errno));
  struct dirent *e;
  while ((e = readdir(d))) {
    unsigned r, w;
    if (strncmp(e->d_name, "buddy-rank", 10) != 0 ||
        sscanf(e->d_name, "buddy-rank%u-of-%u", &r, &w) != 2)
      continue;
    if (w == B.set.world_size && r >= B.set.first_rank && r - B.set.first_rank < B.set.local_ranks)
      continue;
    char path[4096], want[4096];
    snprintf(path, sizeof path, "%s/%s", B.state_dir, e->d_name);
    path_of(want, sizeof want, r, w, 1);
    if (!strcmp(path, want)) {
      drop_part(path);
      continue;
    }
    path_of(want, sizeof want, r, w, 0);
    if (!strcmp(path, want)) load_file(path, r, w); /* any other name (.bad-*) is not a copy */
  }
  closedir(d);
  return ZD_OK;
}

/* Where a ward's copy from offset 0 is received: memory, or a new "<name>.part" in state_dir,
 * 0600, its bytes reserved (ENOSPC here, not a SIGBUS later), mapped, locked. store_lock held. */
static int part_begin(held_t *h, const meta_t *m, zd__err_t *err) {
  if (!B.state_dir[0]) {
    if (h->part.map && h->part.len == m->bytes) return ZD_OK; /* reused */
    region_free(&h->part);
    if (!(h->part.map = malloc(m->bytes)))
      return zd__errf(err, -ENOMEM, "out of memory for a buddy copy of %" PRIu64 " bytes",
                      m->bytes);
    h->part.len = m->bytes;
    return ZD_OK;
  }
  region_free(&h->part); /* a copy in flight before this one: its file is made anew */
  char path[4096];
  path_of(path, sizeof path, m->rank, m->world_size, 1);
  if (unlink(path) != 0 && errno != ENOENT)
    return zd__errf(err, -errno, "buddy copy file %s: %s", path, strerror(errno));
  size_t len = HDR_BYTES + (size_t)m->bytes;
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return zd__errf(err, -errno, "buddy copy file %s: %s", path, strerror(errno));
  int rc = flock(fd, LOCK_EX | LOCK_NB) != 0 ? -errno : 0;
  if (!rc) rc = -posix_fallocate(fd, 0, (off_t)len);
  void *p = rc ? MAP_FAILED : mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (!rc && p == MAP_FAILED) rc = -errno;
  if (rc) {
    close(fd);
    unlink(path);
    return zd__errf(err, rc, "buddy copy file %s of %zu bytes: %s", path, len, strerror(-rc));
  }
  h->part = (region_t){.map = p, .len = len, .fd = fd};
  return ZD_OK;
}

/* The copy received whole: its file gets its header and replaces the complete one (a rename: a
 * zerod killed at any instant leaves the previous copy or this one, never a mix). */
static int part_commit(held_t *h, const char *from, zd__err_t *err) {
  if (h->part.fd < 0) return ZD_OK;
  const meta_t *m = &h->pmeta;
  file_hdr_t hdr = {.rank = m->rank,
                    .world_size = m->world_size,
                    .states = m->states,
                    .layout_hash = m->layout_hash,
                    .step = m->step,
                    .steps_skipped = m->steps_skipped,
                    .shard_elems = m->shard_elems,
                    .bytes = m->bytes,
                    .scaler_enabled = (uint32_t)m->scaler_enabled,
                    .nlags = m->nlags,
                    .growth_tracker = m->growth_tracker,
                    .hysteresis_tracker = m->hysteresis_tracker,
                    .scale = m->scale,
                    .taken_unix_ms = m->taken_unix_ms,
                    .checksum = m->checksum,
                    .complete_unix_ms = zd__unix_ms()};
  snprintf(hdr.from, sizeof hdr.from, "%s", from);
  zd__snapfile_seal(&hdr);
  memcpy(h->part.map, &hdr, sizeof hdr);
  char part[4096], path[4096];
  path_of(part, sizeof part, m->rank, m->world_size, 1);
  path_of(path, sizeof path, m->rank, m->world_size, 0);
  if (rename(part, path) != 0)
    return zd__errf(err, -errno, "buddy copy file %s: renaming to %s: %s", part, path,
                    strerror(errno));
  return ZD_OK;
}

int zd__buddy_put(const Zerod__V1__BuddyPutRequest *req, uint64_t *received, zd__err_t *err) {
  const Zerod__V1__BuddyCopyInfo *info = req->info;
  uint32_t nlags = info->has_lag_count ? info->lag_count : 0;
  uint64_t want = copy_bytes(info->states, info->shard_elems, nlags);
  if (info->total_bytes != want || !want || want > MAX_COPY_BYTES || nlags > MAX_LAGS ||
      req->offset + req->data.len > want || info->rank >= info->world_size)
    return zd__errf(err, -EINVAL,
                    "buddy copy of rank %u: %" PRIu64 " bytes at %" PRIu64
                    " do not fit a copy of %" PRIu64 " bytes (%" PRIu64 " expected)",
                    info->rank, (uint64_t)req->data.len, req->offset, info->total_bytes, want);
  pthread_mutex_lock(&B.store_lock);
  int rc = ZD_OK;
  held_t *h = held_of(info->rank, info->world_size, 1);
  if (!h) {
    rc = zd__errf(err, -ENOMEM, "out of memory for a buddy copy");
    goto out;
  }
  if (req->offset == 0) {
    meta_t m;
    meta_from(info, &m);
    h->received = 0;
    if ((rc = part_begin(h, &m, err))) {
      h->pmeta = (meta_t){0};
      goto out;
    }
    h->pmeta = m;
  }
  uint8_t *pdata = region_data(&h->part);
  if (!pdata || req->offset != h->received || h->pmeta.step != info->step ||
      h->pmeta.layout_hash != info->layout_hash || h->pmeta.bytes != info->total_bytes) {
    rc = zd__errf(err, ZD_EORDER,
                  "buddy copy of rank %u: a piece at %" PRIu64 " of step %" PRIu64
                  " does not continue the copy in progress (%" PRIu64 " bytes of step %" PRIu64 ")",
                  info->rank, req->offset, info->step, h->received, h->pmeta.step);
    goto out;
  }
  memcpy(pdata + req->offset, req->data.data, req->data.len);
  h->received += req->data.len;
  *received = h->received;
  if (req->has_last && req->last) {
    if (h->received != h->pmeta.bytes) {
      rc =
          zd__errf(err, ZD_EORDER, "buddy copy of rank %u ends at %" PRIu64 " of %" PRIu64 " bytes",
                   info->rank, h->received, h->pmeta.bytes);
      goto out;
    }
    const char *from = info->from_address ? info->from_address : "";
    if ((rc = part_commit(h, from, err))) goto out;
    region_t old = h->cur;
    meta_t oldm = h->meta;
    h->cur = h->part;
    h->meta = h->pmeta;
    if (old.fd >= 0) { /* its file was renamed over */
      region_free(&old);
      h->part = (region_t){.fd = -1};
      h->pmeta = (meta_t){0};
    } else {
      h->part = old; /* reused by the next copy when it has the same size */
      h->pmeta = oldm;
    }
    h->received = 0;
    h->has = 1;
    h->complete_unix_ms = zd__unix_ms();
    snprintf(h->from, sizeof h->from, "%s", from);
  }
out:
  pthread_mutex_unlock(&B.store_lock);
  return rc;
}

int zd__buddy_get(const Zerod__V1__BuddyGetRequest *req, Zerod__V1__BuddyGetReply *rep,
                  Zerod__V1__BuddyCopyInfo *info, uint8_t **data, zd__err_t *err) {
  *data = NULL;
  pthread_mutex_lock(&B.store_lock);
  int rc = ZD_OK;
  held_t *h = held_of(req->rank, req->world_size, 0);
  if (!h || !h->has || h->meta.layout_hash != req->layout_hash) goto out;
  info_of(&h->meta, info);
  info->from_address = NULL;
  rep->info = info;
  if (req->max_bytes && req->offset < h->meta.bytes) {
    uint64_t len = h->meta.bytes - req->offset;
    if (len > req->max_bytes) len = req->max_bytes;
    if (len > PIECE_BYTES * 4u) len = PIECE_BYTES * 4u;
    if (!(*data = malloc(len))) {
      rc = zd__errf(err, -ENOMEM, "out of memory");
      goto out;
    }
    memcpy(*data, region_data(&h->cur) + req->offset, len);
    rep->has_data = 1;
    rep->data.data = *data;
    rep->data.len = len;
  }
out:
  pthread_mutex_unlock(&B.store_lock);
  return rc;
}

/* ---- recovery ------------------------------------------------------------------------------- */

/* The newest copy of this rank that another node holds, read whole into *out (data malloc'd);
 * *holder names it. ZD_OK with out->valid 0: none found. */
static int fetch_copy(const zd__step_ctx_t *ctx, const zd__model_t *m, snap_t *out, char *holder,
                      size_t hlen) {
  zd__err_t err = {0};
  zd__rdv_t *rdv = NULL;
  Zerod__V1__NodesReply *nodes = NULL;
  *out = (snap_t){0};
  int rc = zd__rdv_open(B.rendezvous, &rdv, &err);
  if (!rc && B.token[0]) rc = zd__rdv_set_token(rdv, B.token, &err);
  if (!rc) rc = zd__rdv_nodes(rdv, &nodes, CALL_MS, &err);
  if (rc) {
    ZD_LOG_WARN("rank %u: cannot list the nodes to find a buddy copy: %s", ctx->rank, err.msg);
    goto out;
  }
  for (size_t i = 0; i < nodes->n_nodes; i++) {
    const Zerod__V1__NodeInfo *ni = nodes->nodes[i];
    if (ni->first_rank == B.set.first_rank) continue; /* this node holds none of its own */
    zd__grpc_channel_t *ch = NULL;
    if (zd__grpc_channel_open(ni->control_address, &ch, &err)) continue;
    if (B.token[0]) zd__grpc_channel_set_token(ch, B.token);
    snap_t got = {0};
    uint64_t off = 0;
    int crc = ZD_OK;
    do {
      Zerod__V1__BuddyGetRequest req = ZEROD__V1__BUDDY_GET_REQUEST__INIT;
      req.rank = ctx->rank;
      req.world_size = ctx->world_size;
      req.layout_hash = m->layout->hash;
      req.offset = off;
      req.max_bytes = got.data ? 4u * PIECE_BYTES : 0;
      ProtobufCMessage *r = NULL;
      crc = zd__grpc_call(ch, "/zerod.v1.Control/BuddyGet", &req.base,
                          &zerod__v1__buddy_get_reply__descriptor, &r, CALL_MS, 0, NULL, &err);
      Zerod__V1__BuddyGetReply *rep = (Zerod__V1__BuddyGetReply *)r;
      if (!crc && !rep->info) crc = -ENOENT;
      if (!crc && !got.data) { /* the first call: what the copy is */
        meta_from(rep->info, &got.meta);
        uint64_t want = copy_bytes(m->states, m->layout->shard_elems, got.meta.nlags);
        if (got.meta.bytes != want || got.meta.states != m->states ||
            (got.meta.nlags && got.meta.nlags != m->layout->nparams) ||
            (out->valid &&
             got.meta.step + got.meta.steps_skipped <= out->meta.step + out->meta.steps_skipped))
          crc = -ENOENT; /* not this model's, or not newer than one found already */
        else if (!(got.data = malloc(want)))
          crc = -ENOMEM;
      } else if (!crc) {
        if (rep->info->step != got.meta.step || !rep->has_data || !rep->data.len ||
            off + rep->data.len > got.meta.bytes)
          crc = ZD_EORDER; /* the holder took a newer copy meanwhile */
        else {
          memcpy(got.data + off, rep->data.data, rep->data.len);
          off += rep->data.len;
        }
      }
      if (r) protobuf_c_message_free_unpacked(r, NULL);
    } while (!crc && off < got.meta.bytes);
    zd__grpc_channel_close(ch);
    if (!crc && XXH3_64bits(got.data, got.meta.bytes) != got.meta.checksum) {
      crc = ZD_EPROTO;
      snprintf(err.msg, sizeof err.msg, "the copy of step %" PRIu64 " fails its checksum",
               got.meta.step);
    }
    if (crc) {
      if (crc != -ENOENT)
        ZD_LOG_WARN("rank %u: reading the buddy copy held by %s: %s", ctx->rank,
                    ni->control_address, err.msg);
      free(got.data);
      continue;
    }
    free(out->data);
    got.valid = 1;
    *out = got;
    snprintf(holder, hlen, "%s", ni->control_address);
  }
out:
  if (nodes) protobuf_c_message_free_unpacked(&nodes->base, NULL);
  zd__rdv_close(rdv);
  return ZD_OK;
}

/* What a rank can serve, all-gathered. A commit is named by step + steps skipped and its
 * per-parameter lags (lags_key): the ranks' records of one commit hold the same lags (the step
 * records' hash covers them), and a rank that holds other lags for it does not serve it. */
typedef struct commit {
  uint64_t key, lags;
} commit_t;

typedef struct offer {
  uint64_t replace;
  uint64_t nfile;
  commit_t file[2];
  uint64_t nsnap;
  commit_t snap[2];
  uint64_t has_copy;
  commit_t copy;
} offer_t;

static int same_commit(commit_t a, commit_t b) {
  return a.key == b.key && a.lags == b.lags;
}

static commit_t commit_of_snap(const snap_t *sn) {
  return (commit_t){.key = sn->meta.step + sn->meta.steps_skipped,
                    .lags = lags_key(snap_lags(sn), sn->meta.nlags)};
}

static int can_serve(const offer_t *o, commit_t c) {
  for (uint64_t i = 0; i < o->nfile; i++)
    if (same_commit(o->file[i], c)) return 1;
  for (uint64_t i = 0; i < o->nsnap; i++)
    if (same_commit(o->snap[i], c)) return 1;
  return o->has_copy && same_commit(o->copy, c);
}

static void restore_from(zd__model_t *m, const snap_t *sn) {
  if (m->restored) zd__model_forget_restored(m);
  uint64_t off = 0, each = m->layout->shard_elems * sizeof(float);
  for (int i = 0; i < ZD__NSTATES; i++)
    if (m->states & ZD__STATE_BIT(i)) {
      memcpy(m->shard.state[i], sn->data + off, each);
      off += each;
    }
  m->step = sn->meta.step;
  m->steps_skipped = sn->meta.steps_skipped;
  if (sn->meta.scaler_enabled && m->scaler.enabled) {
    m->scaler.scale = sn->meta.scale;
    m->scaler.growth_tracker = sn->meta.growth_tracker;
    m->scaler.hysteresis_tracker = sn->meta.hysteresis_tracker;
  }
  zd__model_set_lags(m, snap_lags(sn)); /* that commit's, not the model's newer (or fresh) ones */
  zd__model_commit(m, 0); /* the committed set holds that step now (a state file's header too) */
}

/* The newest commit every rank can serve, among those that a rank without a file offers. */
static int newest_common(const offer_t *all, uint32_t w, commit_t *target) {
  int found = 0;
  for (uint32_t r = 0; r < w; r++) {
    if (all[r].nfile) continue;
    commit_t keys[3] = {all[r].snap[0], all[r].snap[1], all[r].copy};
    uint64_t have[3] = {all[r].nsnap > 0, all[r].nsnap > 1, all[r].has_copy};
    for (int k = 0; k < 3; k++) {
      if (!have[k] || (found && keys[k].key <= target->key)) continue;
      uint32_t q = 0;
      while (q < w && can_serve(&all[q], keys[k])) q++;
      if (q == w) {
        *target = keys[k];
        found = 1;
      }
    }
  }
  return found;
}

/* This rank's copy, read from the node that holds it, into *copy and *mine. */
static void read_copy(const zd__step_ctx_t *ctx, const zd__model_t *m, snap_t *copy, char *holder,
                      size_t hlen, offer_t *mine) {
  uint64_t t0 = zd__now_ms();
  fetch_copy(ctx, m, copy, holder, hlen);
  if (!copy->valid) return;
  mine->has_copy = 1;
  mine->copy = commit_of_snap(copy);
  ZD_LOG_INFO("rank %u read its buddy copy of step %" PRIu64 " (%" PRIu64
              " bytes) from %s in %" PRIu64 " ms",
              ctx->rank, copy->meta.step, copy->meta.bytes, holder, zd__now_ms() - t0);
}

/* No rank holds a state file, a snapshot or a copy: when the store records a copy of this rank
 * (COPIED_KEY, kept by a store that outlived the nodes: etcd), every node was lost at once; why
 * says so, and the buddy status section keeps it. */
static void all_lost(const zd__step_ctx_t *ctx, char *why, size_t len) {
  if (!store_outlives_nodes()) return; /* record_copied wrote nothing */
  zd__err_t err = {0};
  zd__rdv_t *rdv = NULL;
  char key[64];
  snprintf(key, sizeof key, COPIED_KEY "%u", ctx->rank);
  void *v = NULL;
  size_t vlen = 0;
  int rc = zd__rdv_open(B.rendezvous, &rdv, &err);
  if (!rc && B.token[0]) rc = zd__rdv_set_token(rdv, B.token, &err);
  if (!rc) rc = zd__rdv_get(rdv, key, &v, &vlen, 100, &err);
  zd__rdv_close(rdv);
  char val[32] = "";
  if (!rc) snprintf(val, sizeof val, "%.*s", (int)(vlen < 31 ? vlen : 31), (char *)v);
  free(v);
  char *end = NULL;
  uint64_t step = val[0] ? strtoull(val, &end, 10) : 0;
  if (!val[0] || !end || *end) return; /* none recorded: a first start */
  snprintf(why, len,
           "every node was lost at once (ranks 0-%u hold no state file, snapshot or buddy "
           "copy; rank %u's copy of step %" PRIu64 " was lost with its holder)",
           ctx->world_size - 1, ctx->rank, step);
  pthread_mutex_lock(&B.store_lock);
  B.lost_ranks++;
  if (step > B.lost_copy_step) B.lost_copy_step = step;
  B.lost_pending = 1;
  B.lost_from_step = 0;
  pthread_mutex_unlock(&B.store_lock);
}

int zd__buddy_resume(const zd__step_ctx_t *ctx, zd__model_t *m, int replace, int *handled,
                     char *why, size_t len, zd__err_t *err) {
  *handled = 0;
  why[0] = '\0';
  if (!B.senders || ctx->world_size < 2) return ZD_OK;
  sender_t *s = &B.senders[ctx->local_rank];
  s->due_step = 0; /* a copy agreed for a step that this registration replaces */
  offer_t mine = {.replace = (uint64_t)replace};
  mine.nfile = m->restored && !replace ? (uint64_t)m->restored : 0;
  for (uint64_t i = 0; i < mine.nfile; i++) {
    const zd__state_rec_t *r = &m->restored_rec[i];
    mine.file[i] = (commit_t){.key = r->step + r->steps_skipped,
                              .lags = lags_key(r->lags, m->layout->nparams)};
  }
  snap_t *snaps[2] = {0};
  for (int i = 0; i < 2; i++) {
    const snap_t *sn = &s->snap[i];
    if (sn->valid && sn->meta.layout_hash == m->layout->hash && sn->meta.states == m->states &&
        sn->meta.rank == ctx->rank && sn->meta.world_size == ctx->world_size) {
      snaps[mine.nsnap] = &s->snap[i];
      mine.snap[mine.nsnap++] = commit_of_snap(sn);
    }
  }
  snap_t copy = {0};
  char holder[256] = "";
  if (!mine.nfile && !replace) read_copy(ctx, m, &copy, holder, sizeof holder, &mine);
  uint32_t w = ctx->world_size;
  offer_t *all = calloc(w, sizeof *all);
  if (!all) {
    free(copy.data);
    return zd__errf(err, -ENOMEM, "out of memory");
  }
  int rc = ctx->comm->ops->allgather_bytes(ctx->comm, &mine, sizeof mine, all, err);
  if (rc) goto out;
  int needed = 0, any_replace = 0;
  for (uint32_t r = 0; r < w; r++) {
    needed |= !all[r].nfile;
    any_replace |= all[r].replace != 0;
  }
  if (!needed || any_replace) goto out; /* the state files' agreement decides */
  commit_t target = {0};
  int found = newest_common(all, w, &target);
  /* None: when every rank without a file has a copy, the ranks with a file that read none (a
   * zerod restarted too: its snapshots are gone, its file holds newer steps than the copies) read
   * theirs, and the ranks gather again. Every rank decides so from the same offers. */
  int again = !found, fetchers = 0;
  for (uint32_t r = 0; r < w; r++) {
    if (!all[r].nfile && !all[r].has_copy && !all[r].nsnap) again = 0;
    fetchers += all[r].nfile && !all[r].has_copy;
  }
  if (again && fetchers) {
    if (mine.nfile && !mine.has_copy) read_copy(ctx, m, &copy, holder, sizeof holder, &mine);
    rc = ctx->comm->ops->allgather_bytes(ctx->comm, &mine, sizeof mine, all, err);
    if (rc) goto out;
    found = newest_common(all, w, &target);
  }
  int evidence = 0;
  for (uint32_t r = 0; r < w; r++) evidence |= all[r].nfile || all[r].nsnap || all[r].has_copy;
  for (uint32_t r = 0; r < w && !found && evidence && !why[0]; r++)
    if (!all[r].nfile && !all[r].has_copy && !all[r].nsnap)
      snprintf(why, len,
               "rank %u has neither a state file nor a buddy copy (its buddy's copy is gone)", r);
  if (!found && evidence && !why[0])
    snprintf(why, len,
             "the ranks' state files, snapshots and buddy copies hold no step in common (a copy "
             "older than another rank's snapshots, a copy in flight at the loss, or a step "
             "whose per-parameter step counts differ between ranks)");
  if (!found && !why[0]) /* every node lost at once, where the store says so; else a first start */
    all_lost(ctx, why, len);
  if (!found && !why[0]) { /* a first start: nothing to serve */
    ZD_LOG_INFO(
        "rank %u: no rank of the world holds a state file, a snapshot or a buddy copy: a "
        "first start, or every node lost at once (nothing to recover from memory)",
        ctx->rank);
    goto out;
  }
  if (why[0]) {
    ZD_LOG_WARN("rank %u: no buddy copy can serve the world: %s", ctx->rank, why);
    goto out;
  }
  /* Every rank serves `target`: its file first (nothing to copy), else its snapshot, else the
   * copy it read. */
  const char *from = NULL;
  for (uint64_t i = 0; i < mine.nfile && !from; i++)
    if (same_commit(mine.file[i], target)) {
      zd__model_take_record(m, (int)i);
      from = "its state file";
    }
  for (uint64_t i = 0; i < mine.nsnap && !from; i++)
    if (same_commit(mine.snap[i], target)) {
      restore_from(m, snaps[i]);
      from = "its own snapshot";
    }
  if (!from) {
    restore_from(m, &copy);
    from = "its buddy's copy";
  }
  m->resumed_from = ZD__FROM_BUDDY;
  int at = !strcmp(from, "its buddy's copy");
  ZD_LOG_INFO("rank %u resumed step %" PRIu64
              " from %s%s%s: the world continues from its buddy "
              "copies, no storage read",
              ctx->rank, m->step, from, at ? " at " : "", at ? holder : "");
  *handled = 1;
out:
  free(all);
  free(copy.data);
  return rc;
}

/* ---- status --------------------------------------------------------------------------------- */

void zd__buddy_rank_status(uint32_t local_rank, zd__buddy_rank_status_t *out) {
  *out = (zd__buddy_rank_status_t){0};
  if (!B.senders || local_rank >= B.nsenders) return;
  sender_t *s = &B.senders[local_rank];
  pthread_mutex_lock(&s->lock);
  out->has_copy = s->copies > 0;
  out->step = s->copy_step;
  uint64_t now = zd__unix_ms();
  out->age_ms = now > s->copy_unix_ms ? now - s->copy_unix_ms : 0;
  snprintf(out->holder, sizeof out->holder, "%s", s->holder);
  snprintf(out->error, sizeof out->error, "%s", s->error);
  pthread_mutex_unlock(&s->lock);
}

void zd__buddy_status(void *ctx, zd__status_t *st) {
  (void)ctx;
  zd__status_section(st, "buddy");
  zd__status_add(st, "every_steps", "%u", B.set.every_steps);
  zd__status_add(st, "every_s", "%u", B.set.every_s);
  zd__status_add(st, "held_in", "%s", B.state_dir[0] ? B.state_dir : "memory");
  zd__status_add(st, "failure_domain", "%s", B.domain);
  pthread_mutex_lock(&B.store_lock);
  if (B.lost_ranks) {
    zd__status_add(st, "all_lost", "every node lost at once (ranks 0-%u)",
                   B.set.world_size ? B.set.world_size - 1 : 0);
    zd__status_add(st, "all_lost_copy_step", "%" PRIu64, B.lost_copy_step);
    if (B.lost_pending)
      zd__status_add(st, "all_lost_continued_from", "pending (the next step's agreement)");
    else
      zd__status_add(st, "all_lost_continued_from", "%" PRIu64, B.lost_from_step);
  }
  pthread_mutex_unlock(&B.store_lock);
  uint64_t now = zd__unix_ms();
  for (uint32_t i = 0; i < B.nsenders; i++) {
    sender_t *s = &B.senders[i];
    uint32_t r = B.set.first_rank + i;
    pthread_mutex_lock(&s->lock);
    char k[64];
#define KEY(name) (snprintf(k, sizeof k, "rank%u_" name, r), k)
    zd__status_add(st, KEY("copies"), "%" PRIu64, s->copies);
    zd__status_add(st, KEY("skipped"), "%" PRIu64, s->skipped);
    zd__status_add(st, KEY("failures"), "%" PRIu64, s->failures);
    if (s->copies) {
      zd__status_add(st, KEY("copy_step"), "%" PRIu64, s->copy_step);
      zd__status_add(st, KEY("copy_age_ms"), "%" PRIu64,
                     now > s->copy_unix_ms ? now - s->copy_unix_ms : 0);
      zd__status_add(st, KEY("copy_holder"), "%s", s->holder);
      zd__status_add(st, KEY("last_send_ms"), "%" PRIu64, s->last_send_ms);
      zd__status_add(st, KEY("last_snapshot_us"), "%" PRIu64, s->last_snapshot_us);
    } else {
      zd__status_add(st, KEY("copy_step"), "none");
    }
    if (s->error[0]) zd__status_add(st, KEY("copy_error"), "%s", s->error);
#undef KEY
    pthread_mutex_unlock(&s->lock);
  }
  pthread_mutex_lock(&B.store_lock);
  for (uint32_t i = 0; i < B.nheld; i++) {
    const held_t *h = &B.held[i];
    if (!h->has) continue;
    char k[64];
    snprintf(k, sizeof k, "held_rank%u_step", h->meta.rank);
    zd__status_add(st, k, "%" PRIu64, h->meta.step);
    snprintf(k, sizeof k, "held_rank%u_age_ms", h->meta.rank);
    zd__status_add(st, k, "%" PRIu64,
                   now > h->meta.taken_unix_ms ? now - h->meta.taken_unix_ms : 0);
    snprintf(k, sizeof k, "held_rank%u_from", h->meta.rank);
    zd__status_add(st, k, "%s", h->from);
    snprintf(k, sizeof k, "held_rank%u_bytes", h->meta.rank);
    zd__status_add(st, k, "%" PRIu64, h->meta.bytes);
  }
  pthread_mutex_unlock(&B.store_lock);
}
