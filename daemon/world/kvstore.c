/* The rendezvous key-value store (kvstore.h): a sorted array of entries and a list of waits.
 *
 * A world's store holds a few entries per rank, read far more often than written, so a sorted
 * array with binary search is enough. Each pending wait remembers how far through its keys it
 * got; a set advances every wait once, each over keys it has not seen, so a wait never looks at a
 * key twice once it was found and a set costs one lookup per wait.
 */
#include "kvstore.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

typedef struct kv {
  char *key;
  uint8_t *value;
  size_t len;
} kv_t;

struct zd__kv_wait {
  zd__kvstore_t *s;
  const char *const *keys;
  size_t nkeys;
  size_t next_key; /* keys before it were seen */
  uv_timer_t timer;
  zd__kv_wait_cb done;
  zd__kv_closed_cb closed;
  void *arg;
  zd__kv_wait_t *prev, *next;
};

struct zd__kvstore {
  uv_loop_t *loop;
  zd__kvstore_limits_t limits;
  kv_t *kvs; /* sorted by key */
  size_t nkv, kvcap;
  size_t kv_bytes;
  zd__kv_wait_t *waiters; /* newest first */
  uint32_t nwaiters;
  int shut_down;
  char shutdown_why[ZD__ERR_MSG_MAX];
};

zd__kvstore_t *zd__kvstore_new(uv_loop_t *loop, const zd__kvstore_limits_t *limits) {
  zd__kvstore_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->loop = loop;
  s->limits = *limits;
  return s;
}

void zd__kvstore_free(zd__kvstore_t *s) {
  if (!s) return;
  zd_assert(!s->waiters);
  for (size_t i = 0; i < s->nkv; i++) {
    free(s->kvs[i].key);
    free(s->kvs[i].value);
  }
  free(s->kvs);
  free(s);
}

/* Index of key, or of where it would go (*found 0). */
static size_t search(const zd__kvstore_t *s, const char *key, int *found) {
  size_t lo = 0, hi = s->nkv;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int cmp = strcmp(s->kvs[mid].key, key);
    if (cmp == 0) {
      *found = 1;
      return mid;
    }
    if (cmp < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  *found = 0;
  return lo;
}

static const kv_t *find(const zd__kvstore_t *s, const char *key) {
  int found;
  size_t i = search(s, key, &found);
  return found ? &s->kvs[i] : NULL;
}

static int check_key(const zd__kvstore_t *s, const char *key, const char *what, zd__err_t *err) {
  size_t n = strlen(key);
  if (n == 0 || n > s->limits.max_key_bytes)
    return zd__errf(err, -EINVAL, "%s: key '%.64s' is %zu bytes; keys have 1..%zu", what, key, n,
                    s->limits.max_key_bytes);
  return ZD_OK;
}

/* Inserts a key that is not in the store at index i. */
static int insert(zd__kvstore_t *s, size_t i, const char *key, const void *value, size_t len,
                  zd__err_t *err) {
  size_t bytes = len + strlen(key) + 1;
  uint8_t *copy = NULL;
  char *k = NULL;
  int rc = ZD_OK;
  if (s->kv_bytes + bytes > s->limits.max_total_bytes) {
    rc = zd__errf(err, -ENOSPC,
                  "the rendezvous store is full (%zu of %zu bytes); cannot set '%s' "
                  "(%zu bytes)",
                  s->kv_bytes, s->limits.max_total_bytes, key, len);
    goto fail;
  }
  if (!(copy = malloc(len ? len : 1)) || !(k = strdup(key))) goto oom;
  if (s->nkv == s->kvcap) {
    size_t cap = s->kvcap ? 2 * s->kvcap : 64;
    kv_t *kvs = realloc(s->kvs, cap * sizeof *kvs);
    if (!kvs) goto oom;
    s->kvs = kvs;
    s->kvcap = cap;
  }
  if (len) memcpy(copy, value, len);
  memmove(&s->kvs[i + 1], &s->kvs[i], (s->nkv - i) * sizeof *s->kvs);
  s->nkv++;
  s->kvs[i] = (kv_t){.key = k, .value = copy, .len = len};
  s->kv_bytes += bytes;
  return ZD_OK;
oom:
  rc = zd__errf(err, -ENOMEM, "out of memory storing '%s' (%zu bytes)", key, len);
fail:
  free(k);
  free(copy);
  return rc;
}

/* ---- waits ----------------------------------------------------------------------------------- */

static void on_timer_closed(uv_handle_t *h) {
  zd__kv_wait_t *w = h->data;
  zd__kv_closed_cb closed = w->closed;
  void *arg = w->arg;
  free(w);
  closed(arg);
}

/* Takes the wait out of the list and closes its timer. */
static void wait_end(zd__kv_wait_t *w) {
  zd__kvstore_t *s = w->s;
  if (w->prev)
    w->prev->next = w->next;
  else
    s->waiters = w->next;
  if (w->next) w->next->prev = w->prev;
  w->prev = w->next = NULL;
  s->nwaiters--;
  uv_close((uv_handle_t *)&w->timer, on_timer_closed);
}

/* Moves past the keys that exist now; whether all do. */
static int advance(const zd__kvstore_t *s, const char *const *keys, size_t nkeys, size_t *next) {
  while (*next < nkeys && find(s, keys[*next])) ++*next;
  return *next == nkeys;
}

static void on_wait_timeout(uv_timer_t *t) {
  zd__kv_wait_t *w = t->data;
  wait_end(w);
  w->done(w->arg, -ETIMEDOUT);
}

int zd__kvstore_wait(zd__kvstore_t *s, const char *const *keys, size_t nkeys, uint64_t timeout_ms,
                     zd__kv_wait_cb done, zd__kv_closed_cb closed, void *arg, zd__kv_wait_t **w,
                     int *ready, const char *what, zd__err_t *err) {
  *w = NULL;
  *ready = 0;
  if (nkeys > s->limits.max_wait_keys)
    return zd__errf(err, -EINVAL, "%s: %zu keys; at most %zu", what, nkeys,
                    s->limits.max_wait_keys);
  for (size_t i = 0; i < nkeys; i++) {
    int rc = check_key(s, keys[i], what, err);
    if (rc) return rc;
  }
  size_t next = 0;
  if (advance(s, keys, nkeys, &next)) {
    *ready = 1;
    return ZD_OK;
  }
  if (s->shut_down) return zd__errf(err, ZD_ESHUTDOWN, "%s", s->shutdown_why);
  if (s->nwaiters >= s->limits.max_waiters)
    return zd__errf(err, -ENOSPC, "%s: %u calls are waiting already; at most %u", what, s->nwaiters,
                    s->limits.max_waiters);
  if (timeout_ms == 0) return ZD_OK;
  zd__kv_wait_t *nw = calloc(1, sizeof *nw);
  if (!nw) return zd__errf(err, -ENOMEM, "%s: out of memory for a wait on %zu keys", what, nkeys);
  *nw = (zd__kv_wait_t){.s = s,
                        .keys = keys,
                        .nkeys = nkeys,
                        .next_key = next,
                        .done = done,
                        .closed = closed,
                        .arg = arg,
                        .next = s->waiters};
  uv_timer_init(s->loop, &nw->timer);
  nw->timer.data = nw;
  uv_timer_start(&nw->timer, on_wait_timeout, timeout_ms, 0);
  if (s->waiters) s->waiters->prev = nw;
  s->waiters = nw;
  s->nwaiters++;
  *w = nw;
  return ZD_OK;
}

void zd__kv_wait_cancel(zd__kv_wait_t *w) {
  wait_end(w);
}

size_t zd__kv_wait_next(const zd__kv_wait_t *w) {
  return w->next_key;
}

uint32_t zd__kvstore_shutdown(zd__kvstore_t *s, const char *why) {
  uint32_t n = s->nwaiters;
  s->shut_down = 1;
  snprintf(s->shutdown_why, sizeof s->shutdown_why, "%s", why);
  while (s->waiters) {
    zd__kv_wait_t *w = s->waiters;
    wait_end(w);
    w->done(w->arg, ZD_ESHUTDOWN);
  }
  return n;
}

/* ---- entries --------------------------------------------------------------------------------- */

int zd__kvstore_set(zd__kvstore_t *s, const char *key, const void *value, size_t len,
                    const char *what, zd__err_t *err) {
  int rc = check_key(s, key, what, err);
  if (rc) return rc;
  if (len > s->limits.max_value_bytes)
    return zd__errf(err, ZD_ETOOBIG, "%s: the value of '%s' is %zu bytes; at most %zu", what, key,
                    len, s->limits.max_value_bytes);
  /* First writer wins: a key of the store names one rank's address or the world's id, written
   * once per world; a different value later is a mistake or an attack, never an update. The same
   * value again is a retry. */
  int found;
  size_t i = search(s, key, &found);
  if (found && (s->kvs[i].len != len || memcmp(s->kvs[i].value, value, len) != 0))
    return zd__errf(err, -EEXIST,
                    "%s: '%s' is already set to another value; rendezvous keys "
                    "are written once (restart the whole world to rejoin it)",
                    what, key);
  if (!found && (rc = insert(s, i, key, value, len, err))) return rc;
  for (zd__kv_wait_t *w = s->waiters, *next; w; w = next) {
    next = w->next;
    if (advance(s, w->keys, w->nkeys, &w->next_key)) {
      wait_end(w);
      w->done(w->arg, ZD_OK);
    }
  }
  return ZD_OK;
}

int zd__kvstore_get(const zd__kvstore_t *s, const char *key, const uint8_t **value, size_t *len,
                    int *found, const char *what, zd__err_t *err) {
  int rc = check_key(s, key, what, err);
  if (rc) return rc;
  const kv_t *e = find(s, key);
  *found = e != NULL;
  if (e) {
    *value = e->value;
    *len = e->len;
  }
  return ZD_OK;
}

int zd__kvstore_has(const zd__kvstore_t *s, const char *key) {
  return find(s, key) != NULL;
}

int zd__kvstore_delete(zd__kvstore_t *s, const char *key, int *found, const char *what,
                       zd__err_t *err) {
  int rc = check_key(s, key, what, err);
  if (rc) return rc;
  size_t i = search(s, key, found);
  if (*found) {
    s->kv_bytes -= s->kvs[i].len + strlen(s->kvs[i].key) + 1;
    free(s->kvs[i].key);
    free(s->kvs[i].value);
    memmove(&s->kvs[i], &s->kvs[i + 1], (s->nkv - i - 1) * sizeof *s->kvs);
    s->nkv--;
  }
  return ZD_OK;
}

size_t zd__kvstore_delete_prefix(zd__kvstore_t *s, const char *prefix) {
  if (!prefix[0]) return 0;
  size_t first, n = zd__kvstore_prefix(s, prefix, &first);
  for (size_t i = first; i < first + n; i++) {
    s->kv_bytes -= s->kvs[i].len + strlen(s->kvs[i].key) + 1;
    free(s->kvs[i].key);
    free(s->kvs[i].value);
  }
  memmove(&s->kvs[first], &s->kvs[first + n], (s->nkv - first - n) * sizeof *s->kvs);
  s->nkv -= n;
  return n;
}

size_t zd__kvstore_prefix(const zd__kvstore_t *s, const char *prefix, size_t *first) {
  const size_t plen = strlen(prefix);
  int found;
  size_t last = *first = search(s, prefix, &found);
  while (last < s->nkv && strncmp(s->kvs[last].key, prefix, plen) == 0) last++;
  return last - *first;
}

void zd__kvstore_entry(const zd__kvstore_t *s, size_t i, const char **key, const uint8_t **value,
                       size_t *len) {
  *key = s->kvs[i].key;
  *value = s->kvs[i].value;
  *len = s->kvs[i].len;
}
