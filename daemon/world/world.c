/* World bootstrap (world.h). */
#include "world.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "gloo.h"
#include "log.h"
#include "rendezvous.h"

#define WORLD_KEY "zerod/world"
#define SLICE_MS  1000 /* long waits are cut into slices so that a shutdown can cancel them */
#define FORMING_SLICE_MS \
  250 /* while an instance forms: how often a wait looks whether the instance was given up */

typedef struct kv_ctx {
  zd__rdv_t *rdv;
  atomic_int *stop;
  atomic_int *abandon; /* a barrier's: its caller gave up (NULL: none) */
  atomic_int *broken;  /* a member's: its instance broke (NULL: none; why: broken_why) */
  const char *broken_why;
  /* The instance this rank is joining (NULL: none): its waits give up (ZD_EPEER) once it was given
   * up (forming_gone), which only the store says while no communicator exists yet. */
  const char *forming;
  int timeout_ms; /* a get or wait may last at most this (connect_timeout_ms) */
} kv_ctx_t;

static int cancelled(const kv_ctx_t *k, zd__err_t *err) {
  if (k->abandon && atomic_load(k->abandon))
    return zd__errf(err, -ECANCELED, "cancelled: the client that asked for it left");
  if (k->broken && atomic_load(k->broken))
    return zd__errf(err, ZD_EPEER, "the world instance broke: %s", k->broken_why);
  if (!atomic_load(k->stop)) return ZD_OK;
  return zd__errf(err, -ECANCELED, "cancelled: zerod is shutting down");
}

/* In slices too: with rank 0's node gone the store does not answer, and a shutdown must not wait
 * for the whole timeout. */
static int kv_set(void *ctx, const char *key, const void *value, size_t len, zd__err_t *err) {
  kv_ctx_t *k = ctx;
  for (int waited = 0;; waited += SLICE_MS) {
    int rc = cancelled(k, err);
    if (rc) return rc;
    rc = zd__rdv_set(k->rdv, key, value, len, SLICE_MS, err);
    if (rc != -ETIMEDOUT && rc != ZD_EPEER) return rc;
    if (waited + SLICE_MS >= SLICE_MS * 10) return rc;
  }
}

/* The key a restarted rank sets in an instance that its earlier process had joined
 * (claim_membership): under the instance's membership records, so that it goes with them. */
static void abandoned_key(char *key, size_t len, const char *id) {
  snprintf(key, len, "member/%s/abandoned", id);
}

/* Whether the instance being formed (k->forming) was given up, which no heartbeat can say while
 * it forms (a verdict is about an instance this rank is in, rank.c): the store names another
 * instance (rank 0 named a new one, or rank 0's zerod restarted with an empty store), or a rank
 * whose zerod restarted after joining it marked it. Either way the peers it waits for never come.
 * ZD_EPEER naming why, else ZD_OK (also when the store does not answer: a wait goes on). */
static int forming_gone(kv_ctx_t *k, zd__err_t *err) {
  char key[96];
  void *value = NULL;
  size_t len = 0;
  zd__err_t ignored = {0};
  abandoned_key(key, sizeof key, k->forming);
  if (zd__rdv_get(k->rdv, key, &value, &len, 1, &ignored) == ZD_OK) {
    int rc = zd__errf(err, ZD_EPEER,
                      "world instance %s was given up while it formed: the zerod of rank %.*s "
                      "restarted after joining it",
                      k->forming, (int)(len < 16 ? len : 16), (const char *)value);
    free(value);
    return rc;
  }
  if (zd__rdv_get(k->rdv, WORLD_KEY, &value, &len, 1, &ignored) != ZD_OK) return ZD_OK;
  int rc = ZD_OK;
  if (len != strlen(k->forming) || memcmp(value, k->forming, len) != 0)
    rc = zd__errf(err, ZD_EPEER,
                  "world instance %s was given up while it formed: the store now names "
                  "instance %.*s (rank 0 re-formed the world, or its zerod restarted)",
                  k->forming, (int)(len < 31 ? len : 31), (const char *)value);
  free(value);
  return rc;
}

/* Waits in slices until the keys exist, the overall timeout passes, or a stop is asked for. A
 * store that cannot be reached (rank 0's node restarting) is waited for like a key: the
 * heartbeat's verdict on that node (the member broken), a stop, the timeout, or (while an
 * instance forms) the instance given up ends the wait. */
static int kv_wait(void *ctx, const char *const *keys, size_t nkeys, int timeout_ms,
                   zd__err_t *err) {
  kv_ctx_t *k = ctx;
  if (timeout_ms <= 0 || timeout_ms > k->timeout_ms) timeout_ms = k->timeout_ms;
  int step = k->forming ? FORMING_SLICE_MS : SLICE_MS;
  for (int waited = 0;; waited += step) {
    int rc = cancelled(k, err);
    if (!rc && k->forming && waited) rc = forming_gone(k, err); /* a slice went by */
    if (rc) return rc;
    int slice = timeout_ms - waited < step ? timeout_ms - waited : step;
    rc = zd__rdv_wait(k->rdv, keys, nkeys, slice, err);
    if ((rc != -ETIMEDOUT && rc != ZD_EPEER) || waited + slice >= timeout_ms) return rc;
  }
}

static int kv_get(void *ctx, const char *key, void **value, size_t *len, int timeout_ms,
                  zd__err_t *err) {
  int rc = kv_wait(ctx, &key, 1, timeout_ms, err);
  if (rc) return rc;
  kv_ctx_t *k = ctx;
  return zd__rdv_get(k->rdv, key, value, len, SLICE_MS * 10, err);
}

/* The store keeps nothing of a world instance that broke: its collective addresses, NCCL id and
 * barriers go (best effort: a failure only leaves them until the store's node restarts). */
static void free_instance(const kv_ctx_t *k, const char *stale) {
  static const char *const kinds[] = {"gloo", "nccl", "barrier", "member"};
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
    char prefix[96];
    zd__err_t ignored = {0};
    snprintf(prefix, sizeof prefix, "%s/%s/", kinds[i], stale);
    zd__rdv_delete_prefix(k->rdv, prefix, SLICE_MS, &ignored);
  }
}

/* Records that this process (w->incarnation) is rank `rank` of instance `id`: *fresh = 0 when
 * another incarnation of this rank already was (so the instance is one that broke when this zerod
 * died), else 1. Rank 0 names every instance afresh and needs no record. */
static int claim_membership(kv_ctx_t *k, const zd__world_t *w, const char *id, uint32_t rank,
                            int *fresh, zd__err_t *err) {
  *fresh = 1;
  char key[96], mine[24];
  snprintf(key, sizeof key, "member/%s/%u", id, rank);
  snprintf(mine, sizeof mine, "%016" PRIx64, w->incarnation);
  int rc = zd__rdv_set(k->rdv, key, mine, strlen(mine), SLICE_MS * 10, err);
  if (rc == -EEXIST && rank != 0) { /* the same value again is a retry (ok); another one is an
                                     earlier life (rank 0 names every instance afresh) */
    *fresh = 0;
    return ZD_OK;
  }
  return rc;
}

/* The incarnation of every rank of instance `id` (their membership records, all written before
 * any of them connected the communicator), for telling a restart of a peer that happened before
 * this instance formed from one after it. */
static int read_incarnations(kv_ctx_t *k, const char *id, uint32_t world_size, uint64_t *out,
                             zd__err_t *err) {
  for (uint32_t r = 0; r < world_size; r++) {
    char key[96];
    snprintf(key, sizeof key, "member/%s/%u", id, r);
    void *value = NULL;
    size_t len = 0;
    int rc = kv_get(k, key, &value, &len, SLICE_MS * 10, err);
    if (rc) return rc;
    char text[24];
    snprintf(text, sizeof text, "%.*s", (int)(len < sizeof text ? len : sizeof text - 1),
             (const char *)value);
    free(value);
    out[r] = strtoull(text, NULL, 16);
  }
  return ZD_OK;
}

/* Rank 0 names the world instance; the others learn the name (one other than `stale`: a rank
 * re-forming a broken world must not take the broken instance's name, still in the store until
 * rank 0 names the new one). */
static int world_id(const zd__kv_t *kv, uint32_t rank, const char *stale, char *id, size_t idlen,
                    zd__err_t *err) {
  if (rank == 0) {
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r)
      return zd__errf(err, -errno, "getrandom failed: %s", strerror(errno));
    snprintf(id, idlen, "%016" PRIx64, r);
    int rc = kv->set(kv->ctx, WORLD_KEY, id, strlen(id), err);
    if (rc == -EEXIST) { /* re-forming: the broken instance's name is replaced, not kept */
      const kv_ctx_t *k = kv->ctx;
      zd__err_t derr = {0};
      rc = zd__rdv_delete(k->rdv, WORLD_KEY, SLICE_MS * 10, &derr);
      if (rc) *err = derr;
      if (!rc) rc = kv->set(kv->ctx, WORLD_KEY, id, strlen(id), err);
    }
    if (!rc && stale) free_instance(kv->ctx, stale);
    return rc;
  }
  const kv_ctx_t *k = kv->ctx;
  for (int waited = 0;; waited += SLICE_MS / 4) {
    void *value = NULL;
    size_t len = 0;
    int rc = kv->get(kv->ctx, WORLD_KEY, &value, &len, 0, err);
    if (rc) return rc;
    snprintf(id, idlen, "%.*s", (int)(len < idlen ? len : idlen - 1), (const char *)value);
    free(value);
    if (!stale || strcmp(id, stale) != 0) return ZD_OK;
    if ((rc = cancelled(k, err))) return rc;
    if (waited >= k->timeout_ms)
      return zd__errf(err, -ETIMEDOUT,
                      "rank 0 named no new world instance within %d ms (the store still names "
                      "the broken one, %s)",
                      k->timeout_ms, stale);
    struct timespec ts = {0, (SLICE_MS / 4) * 1000000L};
    nanosleep(&ts, NULL);
  }
}

#ifdef ZD_HAVE_CUDA
#define NCCL_ID_BYTES 128 /* sizeof(ncclUniqueId) */

/* Rank 0 creates the NCCL unique id and publishes it under the world id; the others read it. */
static int nccl_connect(const zd__world_t *w, const zd__kv_t *kv, const char *world, uint32_t rank,
                        int device, void *stream, atomic_int *stop, zd__comm_t **out,
                        zd__err_t *err) {
  char key[96], id[NCCL_ID_BYTES];
  snprintf(key, sizeof key, "nccl/%s/id", world);
  int rc;
  if (rank == 0) {
    if ((rc = zd__comm_nccl_unique_id(id, sizeof id, err)) ||
        (rc = kv->set(kv->ctx, key, id, sizeof id, err)))
      return rc;
  } else {
    void *value = NULL;
    size_t len = 0;
    if ((rc = kv->get(kv->ctx, key, &value, &len, 0, err))) return rc;
    if (len != sizeof id) {
      free(value);
      return zd__errf(err, ZD_EPEER, "the NCCL unique id under %s is %zu bytes; expected %zu", key,
                      len, sizeof id);
    }
    memcpy(id, value, sizeof id);
    free(value);
  }
  return zd__comm_nccl_create(id, rank, w->world_size, device, stream, w->connect_timeout_ms,
                              w->collective_timeout_ms, stop, out, err);
}
#endif

struct zd__world_member {
  kv_ctx_t kv;            /* the rendezvous connection, kept for barriers */
  uint64_t *incarnations; /* per global rank: the zerod process it was when the instance formed */
  char id[32];            /* the world instance */
  uint32_t rank;
  uint32_t world_size;
  uint64_t barriers; /* barriers passed: every rank counts the same */
  atomic_int broken; /* zd__world_member_break: set once, after broken_why */
  char broken_why[ZD__ERR_MSG_MAX];
};

int zd__world_connect(const zd__world_t *w, uint32_t rank, int device, void *stream,
                      atomic_int *stop, const char *stale, zd__comm_t **out,
                      zd__world_member_t **member, zd__err_t *err) {
  *member = NULL;
#ifndef ZD_HAVE_CUDA
  (void)stream;
  if (device >= 0)
    return zd__errf(err, ZD_EBACKEND, "GPU %d: this zerod was built without CUDA", device);
#endif
  kv_ctx_t k = {.stop = stop, .timeout_ms = w->connect_timeout_ms};
  int rc = zd__rdv_open(w->rendezvous_address, &k.rdv, err);
  if (rc) return rc;
  if ((rc = zd__rdv_set_token(k.rdv, w->control_token, err))) {
    zd__rdv_close(k.rdv);
    return rc;
  }
  zd__kv_t kv = {.ctx = &k, .set = kv_set, .get = kv_get, .wait = kv_wait};
  char id[32], prefix[64];
  ZD_LOG_INFO("%s a world of %u ranks through %s", stale ? "re-forming" : "joining", w->world_size,
              w->rendezvous_address);
  /* Local rank 0 of each node tells the registry where the node's control service is, and which
   * process it is: first, so that the other nodes' heartbeat learns of a restart even while
   * this rank waits below for them to re-form the world. */
  rc = rank == w->first_rank
           ? zd__rdv_register_node(k.rdv, w->first_rank, w->local_ranks, w->control_address,
                                   w->incarnation, SLICE_MS * 10, err)
           : ZD_OK;
  if (!rc) rc = world_id(&kv, rank, stale, id, sizeof id, err);
  /* A zerod restarted before the others noticed finds the instance it was part of still named
   * in the store: it waits for the survivors to name a new one (they re-form the world when they
   * find the old one broken) instead of joining the dead instance. */
  int fresh;
  while (!rc && (rc = claim_membership(&k, w, id, rank, &fresh, err)) == ZD_OK && !fresh) {
    ZD_LOG_INFO(
        "world %s is the one this rank was part of before zerod restarted; waiting for "
        "the other ranks to re-form the world",
        id);
    /* The ranks still forming it wait for the earlier process, which is gone: they give it up
     * (forming_gone) when they see this (first writer wins; best effort, their timeout stays). */
    char key[96], mine[16];
    zd__err_t ignored = {0};
    abandoned_key(key, sizeof key, id);
    snprintf(mine, sizeof mine, "%u", rank);
    zd__rdv_set(k.rdv, key, mine, strlen(mine), SLICE_MS, &ignored);
    char old[32];
    snprintf(old, sizeof old, "%s", id);
    rc = world_id(&kv, rank, old, id, sizeof id, err);
  }
  if (rc) goto exit;
  k.forming = id;

#ifdef ZD_HAVE_CUDA
  if (device >= 0 && w->ranks_per_gpu > 1) {
    rc = zd__comm_cuda_group_create(id, rank, w->world_size, device, stream, w->connect_timeout_ms,
                                    w->collective_timeout_ms, stop, out, err);
    if (rc == ZD_OK)
      ZD_LOG_INFO("joined world %s as rank %u of %u (group communicator on GPU %d)", id, rank,
                  w->world_size, device);
    goto exit;
  }
  if (device >= 0) {
    rc = nccl_connect(w, &kv, id, rank, device, stream, stop, out, err);
    if (rc == ZD_OK)
      ZD_LOG_INFO("joined world %s as rank %u of %u (NCCL on GPU %d)", id, rank, w->world_size,
                  device);
    goto exit;
  }
#endif
  snprintf(prefix, sizeof prefix, "gloo/%s/", id);
  zd__gloo_opts_t opts = {.kv = &kv,
                          .prefix = prefix,
                          .rank = rank,
                          .world_size = w->world_size,
                          .host = w->collective_host,
                          .timeout_ms = w->collective_timeout_ms,
                          .connect_timeout_ms = w->connect_timeout_ms,
                          /* a peer that died after publishing its address, not a slow one */
                          .pair_timeout_ms = w->peer_timeout_ms > 1000 ? w->peer_timeout_ms : 1000};
  rc = zd__comm_gloo_create(&opts, out, err);
  if (rc == ZD_OK) ZD_LOG_INFO("joined world %s as rank %u of %u", id, rank, w->world_size);
exit:;
  uint64_t *incarnations = NULL;
  if (rc == ZD_OK) {
    incarnations = calloc(w->world_size, sizeof *incarnations);
    rc = incarnations ? read_incarnations(&k, id, w->world_size, incarnations, err)
                      : zd__errf(err, -ENOMEM, "out of memory");
    if (rc) {
      zd__comm_destroy(*out);
      *out = NULL;
    }
  }
  if (rc == ZD_OK) {
    zd__world_member_t *m = calloc(1, sizeof *m);
    if (m) {
      *m = (zd__world_member_t){
          .kv = k, .incarnations = incarnations, .rank = rank, .world_size = w->world_size};
      m->kv.forming = NULL; /* formed: the heartbeat's verdicts break it now (broken) */
      snprintf(m->id, sizeof m->id, "%s", id);
      m->kv.broken = &m->broken;
      m->kv.broken_why = m->broken_why;
      *member = m;
      return ZD_OK;
    }
    zd__comm_destroy(*out);
    *out = NULL;
    rc = zd__errf(err, -ENOMEM, "out of memory");
  }
  /* Rank 0 named this instance and it did not form: the next attempt names another, so its keys
   * go now (not at a shutdown, when the store may be going away with this zerod). */
  if (rank == 0 && k.forming && rc != -ECANCELED) free_instance(&k, id);
  free(incarnations);
  zd__rdv_close(k.rdv);
  return rc;
}

int zd__world_barrier(zd__world_member_t *m, const char *name, atomic_int *abandon,
                      zd__err_t *err) {
  m->kv.abandon = abandon;
  uint64_t epoch = ++m->barriers;
  uint32_t w = m->world_size;
  char mine[128];
  snprintf(mine, sizeof mine, "barrier/%s/%s/%" PRIu64 "/%u", m->id, name, epoch, m->rank);
  int rc = kv_set(&m->kv, mine, "", 0, err);
  if (rc) return rc;
  char(*keys)[128] = calloc(w, sizeof *keys);
  const char **names = calloc(w, sizeof *names);
  if (!keys || !names) {
    rc = zd__errf(err, -ENOMEM, "out of memory");
    goto exit;
  }
  for (uint32_t r = 0; r < w; r++) {
    snprintf(keys[r], sizeof keys[r], "barrier/%s/%s/%" PRIu64 "/%u", m->id, name, epoch, r);
    names[r] = keys[r];
  }
  rc = kv_wait(&m->kv, names, w, m->kv.timeout_ms, err);
  if (rc) {
    /* Given up (timeout, shutdown): withdraw, so that a rank arriving later does not take this
     * one for present, and let the next attempt use the same number, as the others will. */
    zd__err_t ignored; /* briefly: at shutdown the store may be going away with this daemon */
    zd__rdv_delete(m->kv.rdv, mine, rc == -ECANCELED ? 200 : SLICE_MS, &ignored);
    m->barriers--;
  }
  if (rc == -ETIMEDOUT) {
    char cause[ZD__ERR_MSG_MAX];
    snprintf(cause, sizeof cause, "%s", err->msg);
    rc = zd__errf(err, -ETIMEDOUT, "%s: not every rank arrived within %d ms (%s)", name,
                  m->kv.timeout_ms, cause);
  }
exit:
  m->kv.abandon = NULL;
  free(names);
  free(keys);
  return rc;
}

const char *zd__world_member_id(const zd__world_member_t *m) {
  return m->id;
}

uint64_t zd__world_member_incarnation(const zd__world_member_t *m, uint32_t rank) {
  return m && rank < m->world_size ? m->incarnations[rank] : 0;
}

void zd__world_member_break(zd__world_member_t *m, const char *why) {
  if (!m || atomic_load(&m->broken)) return;
  snprintf(m->broken_why, sizeof m->broken_why, "%s", why);
  atomic_store(&m->broken, 1);
}

int zd__world_member_broken(zd__world_member_t *m) {
  return m && atomic_load(&m->broken);
}

void zd__world_member_free(zd__world_member_t *m) {
  if (!m) return;
  zd__rdv_close(m->kv.rdv);
  free(m->incarnations);
  free(m);
}
