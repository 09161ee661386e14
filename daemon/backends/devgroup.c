/* The registry and rendezvous of groups of local ranks sharing a GPU (devgroup.h). */
#include "devgroup.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "log.h"

#define JOIN_SLICE_MS 100 /* joining: how often *stop is looked at */

struct zd__group {
  zd__devgroup_t *next; /* in the registry */
  char key[64];
  uint32_t size;
  int device;
  uint32_t refs; /* members holding the group (under registry_lock) */
  zd__devgroup_free_fn free_fn;
  pthread_mutex_t lock; /* everything below */
  pthread_cond_t cond;  /* CLOCK_MONOTONIC */
  uint32_t joined;
  uint8_t present[ZD__DEVGROUP_MAX];
  void *handles[ZD__DEVGROUP_MAX][ZD__DEVGROUP_HANDLES];
  /* The rendezvous in progress: who has arrived, and how many have completed. */
  uint32_t waiting;
  uint8_t here[ZD__DEVGROUP_MAX];
  uint64_t generation;
  zd__devgroup_post_t post[ZD__DEVGROUP_MAX];
  /* Broken: code (non-zero) is set once, after reason. */
  atomic_int code;
  char reason[ZD__ERR_MSG_MAX];
};

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static zd__devgroup_t *registry;

static void vbreak_locked(zd__devgroup_t *g, int code, const char *fmt, va_list ap) {
  if (atomic_load(&g->code)) return; /* the first reason stays */
  vsnprintf(g->reason, sizeof g->reason, fmt, ap);
  atomic_store(&g->code, code ? code : ZD_EPEER);
  ZD_LOG_ERROR("GPU %d: the group communicator of %u ranks is broken: %s", g->device, g->size,
               g->reason);
  pthread_cond_broadcast(&g->cond);
}

static void break_locked(zd__devgroup_t *g, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void break_locked(zd__devgroup_t *g, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vbreak_locked(g, code, fmt, ap);
  va_end(ap);
}

void zd__devgroup_break(zd__devgroup_t *g, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  pthread_mutex_lock(&g->lock);
  vbreak_locked(g, code, fmt, ap);
  pthread_mutex_unlock(&g->lock);
  va_end(ap);
}

int zd__devgroup_failed(const zd__devgroup_t *g) {
  return atomic_load(&g->code);
}

static int error_locked(zd__devgroup_t *g, zd__err_t *err) {
  int code = atomic_load(&g->code);
  return code ? zd__errf(err, code, "%s", g->reason) : ZD_OK;
}

int zd__devgroup_error(zd__devgroup_t *g, zd__err_t *err) {
  pthread_mutex_lock(&g->lock);
  int rc = error_locked(g, err);
  pthread_mutex_unlock(&g->lock);
  return rc;
}

/* Waits on the group's condition until deadline_ms (zd__now_ms's clock); g->lock held. */
static void wait_until(zd__devgroup_t *g, uint64_t deadline_ms) {
  struct timespec ts;
  uint64_t now = zd__now_ms();
  uint64_t ms = deadline_ms > now ? deadline_ms - now : 0;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  ts.tv_sec += (time_t)(ms / 1000);
  ts.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  pthread_cond_timedwait(&g->cond, &g->lock, &ts);
}

/* The members that have not arrived at the rendezvous in progress, as "1, 3"; g->lock held. */
static void missing(const zd__devgroup_t *g, char *out, size_t len) {
  size_t used = 0;
  out[0] = '\0';
  for (uint32_t r = 0; r < g->size && used < len; r++)
    if (!g->here[r]) used += (size_t)snprintf(out + used, len - used, "%s%u", used ? ", " : "", r);
}

/* A rendezvous of every member. abortable: a break ends the wait (A); otherwise (B) a break
 * shortens it to ZD__DEVGROUP_GRACE_MS. A timeout breaks the group. A member that gives up
 * withdraws from the count; the group is broken by then, so no later rendezvous A completes. */
static int rendezvous(zd__devgroup_t *g, uint32_t me, int abortable, int timeout_ms,
                      const char *what, zd__err_t *err) {
  pthread_mutex_lock(&g->lock);
  if (abortable && atomic_load(&g->code)) {
    int rc = error_locked(g, err);
    pthread_mutex_unlock(&g->lock);
    return rc;
  }
  uint64_t gen = g->generation;
  g->here[me] = 1;
  if (++g->waiting == g->size) {
    g->waiting = 0;
    memset(g->here, 0, sizeof g->here);
    g->generation++;
    pthread_cond_broadcast(&g->cond);
    pthread_mutex_unlock(&g->lock);
    return ZD_OK;
  }
  uint64_t deadline = zd__now_ms() + (uint64_t)timeout_ms;
  int graced = 0;
  while (g->generation == gen) {
    if (atomic_load(&g->code)) {
      if (abortable) break;
      if (!graced) {
        uint64_t grace = zd__now_ms() + ZD__DEVGROUP_GRACE_MS;
        if (grace < deadline) deadline = grace;
        graced = 1;
      }
    }
    if (zd__now_ms() >= deadline) {
      char who[ZD__ERR_MSG_MAX / 4];
      missing(g, who, sizeof who);
      break_locked(g, -ETIMEDOUT,
                   "%s: rank(s) %s of the group did not arrive within %d ms%s: a rank's worker "
                   "is stuck or gone",
                   what, who, graced ? ZD__DEVGROUP_GRACE_MS : timeout_ms,
                   graced ? " after the group broke" : " (collective_timeout_ms)");
      break;
    }
    wait_until(g, deadline);
  }
  int rc = ZD_OK;
  if (g->generation == gen) { /* given up: withdrawn */
    g->here[me] = 0;
    g->waiting--;
    rc = error_locked(g, err);
  }
  pthread_mutex_unlock(&g->lock);
  return rc;
}

int zd__devgroup_meet(zd__devgroup_t *g, uint32_t rank, const zd__devgroup_post_t *p,
                      int timeout_ms, const char *what, zd__err_t *err) {
  pthread_mutex_lock(&g->lock);
  g->post[rank] = *p;
  pthread_mutex_unlock(&g->lock);
  int rc = rendezvous(g, rank, 1, timeout_ms, what, err);
  if (rc) return rc;
  /* Every member reads the same posts, so all of them reach the same verdict. */
  for (uint32_t r = 0; r < g->size; r++) {
    const zd__devgroup_post_t *q = &g->post[r];
    if (q->op == p->op && q->bucket == p->bucket && q->dtype == p->dtype && q->elems == p->elems)
      continue;
    zd__devgroup_break(g, ZD_EPEER,
                       "collectives out of step: rank %u is in %s (op %u, bucket %u, %llu elements "
                       "or bytes, dtype %d), rank %u in op %u, bucket %u (%llu, dtype %d)",
                       rank, what, p->op, p->bucket, (unsigned long long)p->elems, (int)p->dtype, r,
                       q->op, q->bucket, (unsigned long long)q->elems, (int)q->dtype);
    return zd__devgroup_error(g, err);
  }
  return ZD_OK;
}

int zd__devgroup_done(zd__devgroup_t *g, uint32_t rank, int timeout_ms, const char *what,
                      zd__err_t *err) {
  return rendezvous(g, rank, 0, timeout_ms, what, err);
}

const zd__devgroup_post_t *zd__devgroup_post(const zd__devgroup_t *g, uint32_t r) {
  return &g->post[r];
}

void *zd__devgroup_handle(const zd__devgroup_t *g, uint32_t r, int i) {
  return g->handles[r][i];
}

uint32_t zd__devgroup_size(const zd__devgroup_t *g) {
  return g->size;
}

/* ---- joining and leaving --------------------------------------------------------------------- */

/* registry_lock held. */
static void group_free(zd__devgroup_t *g) {
  for (zd__devgroup_t **pp = &registry; *pp; pp = &(*pp)->next)
    if (*pp == g) {
      *pp = g->next;
      break;
    }
  for (uint32_t r = 0; r < g->size; r++)
    for (int i = 0; i < ZD__DEVGROUP_HANDLES; i++)
      if (g->handles[r][i] && g->free_fn) g->free_fn(g->handles[r][i]);
  pthread_cond_destroy(&g->cond);
  pthread_mutex_destroy(&g->lock);
  free(g);
}

void zd__devgroup_leave(zd__devgroup_t *g) {
  if (!g) return;
  pthread_mutex_lock(&registry_lock);
  if (--g->refs == 0) group_free(g);
  pthread_mutex_unlock(&registry_lock);
}

/* The group of `key`, found or made, with the caller counted in. */
static int find_group(const char *key, uint32_t size, int device, zd__devgroup_free_fn free_fn,
                      zd__devgroup_t **out, zd__err_t *err) {
  pthread_mutex_lock(&registry_lock);
  zd__devgroup_t *g = registry;
  while (g && strcmp(g->key, key)) g = g->next;
  if (!g) {
    pthread_condattr_t attr;
    g = calloc(1, sizeof *g);
    if (!g || pthread_condattr_init(&attr)) {
      free(g);
      pthread_mutex_unlock(&registry_lock);
      return zd__errf(err, -ENOMEM, "out of memory for a group communicator");
    }
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&g->cond, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&g->lock, NULL);
    snprintf(g->key, sizeof g->key, "%s", key);
    g->size = size;
    g->device = device;
    g->free_fn = free_fn;
    g->next = registry;
    registry = g;
  }
  int rc = ZD_OK;
  if (g->size != size || g->device != device)
    rc = zd__errf(err, ZD_EINTERNAL,
                  "group communicator %s: %u ranks on GPU %d, joined as one of %u on GPU %d", key,
                  g->size, g->device, size, device);
  else
    g->refs++;
  pthread_mutex_unlock(&registry_lock);
  *out = rc ? NULL : g;
  return rc;
}

int zd__devgroup_join(const char *key, uint32_t rank, uint32_t size, int device,
                      void *const handles[ZD__DEVGROUP_HANDLES], zd__devgroup_free_fn free_fn,
                      int connect_timeout_ms, const atomic_int *stop, zd__devgroup_t **out,
                      zd__err_t *err) {
  zd__devgroup_t *g = NULL;
  int rc = ZD_OK;
  *out = NULL;
  if (size < 2 || size > ZD__DEVGROUP_MAX || rank >= size || strlen(key) >= sizeof g->key) {
    rc = zd__errf(err, -EINVAL, "group communicator: rank %u of %u (2 to %d ranks), key '%s'", rank,
                  size, ZD__DEVGROUP_MAX, key);
    goto fail;
  }
  if ((rc = find_group(key, size, device, free_fn, &g, err))) goto fail;
  pthread_mutex_lock(&g->lock);
  if (g->present[rank]) {
    pthread_mutex_unlock(&g->lock);
    rc = zd__errf(err, ZD_EINTERNAL, "group communicator %s: rank %u joined twice", key, rank);
    zd__devgroup_leave(g);
    g = NULL;
    goto fail;
  }
  g->present[rank] = 1;
  for (int i = 0; i < ZD__DEVGROUP_HANDLES; i++) g->handles[rank][i] = handles ? handles[i] : NULL;
  g->joined++;
  pthread_cond_broadcast(&g->cond);
  uint64_t deadline = zd__now_ms() + (uint64_t)connect_timeout_ms;
  while (g->joined < g->size && !atomic_load(&g->code)) {
    uint64_t now = zd__now_ms();
    if (stop && atomic_load(stop)) {
      break_locked(g, -ECANCELED, "rank %u: joining the group communicator was cancelled", rank);
      break;
    }
    if (now >= deadline) {
      break_locked(g, -ETIMEDOUT,
                   "rank %u: %u of the group's %u ranks joined within %d ms (connect_timeout_ms)",
                   rank, g->joined, g->size, connect_timeout_ms);
      break;
    }
    wait_until(g, now + JOIN_SLICE_MS < deadline ? now + JOIN_SLICE_MS : deadline);
  }
  rc = error_locked(g, err);
  pthread_mutex_unlock(&g->lock);
  if (rc) {
    zd__devgroup_leave(g); /* the handles are the group's now */
    return rc;
  }
  *out = g;
  return ZD_OK;

fail:
  for (int i = 0; handles && free_fn && i < ZD__DEVGROUP_HANDLES; i++)
    if (handles[i]) free_fn(handles[i]);
  return rc;
}
