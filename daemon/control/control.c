/* The gRPC control service (control.h): a completion-queue thread, a table of unary methods run
 * on the loop thread, the rendezvous key-value store with its waiters, and the shutdown sequence.
 *
 * gRPC's completion queue has no descriptor libuv could poll, so one thread blocks in
 * grpc_completion_queue_next() and hands each completed tag to the loop through a locked list and
 * uv_async_send(). Everything else happens on the loop thread: handlers read daemon state there
 * like the rest of the daemon, and every grpc_call_start_batch() is made there. A tag is embedded
 * in the object it completes (a call, or the server's shutdown), so the hand-over allocates
 * nothing; a call object is reference counted by its outstanding batches and its timer.
 *
 * A call's life: a slot per method waits for a new call (request_registered_call); when one
 * arrives the slot is re-armed, the payload is decoded against the method's request type, and
 * the handler answers with one batch (initial metadata, message, status, receive close). KvWait
 * may instead wait on the loop: a uv_timer for its timeout, a separate receive-close batch to
 * learn of a client that gave up, and every KvSet advances the waiters.
 *
 * Shutdown: pending waiters are answered UNAVAILABLE, the server is shut down (calls still being
 * answered are cancelled if they have not finished after a grace period), the queue is shut down
 * and drained by its thread, the thread is joined, the server and queue destroyed and the handles
 * closed; only then is the daemon told.
 */
#include "control.h"

#include <errno.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/log.h>
#include <grpc/support/time.h>
#include <inttypes.h>
#include <math.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <uv.h>

#include "control.pb-c.h"
#include "daemon.h"
#include "grpc_unary.h"
#include "health.pb-c.h"
#include "log.h"
#include "rendezvous.h"
#include "session.h"

#define SLOTS_PER_METHOD  2 /* calls of one method gRPC can hand us without waiting */
#define MAX_KEY_BYTES     1024
#define MAX_VALUE_BYTES   (1u << 20)  /* a rendezvous value: an address, an id; never tensors */
#define MAX_STORE_BYTES   (64u << 20) /* keys and values together */
#define MAX_WAIT_KEYS     65536
#define MAX_WAITERS       4096 /* KvWait calls held at once */
#define SHUTDOWN_GRACE_MS 500  /* calls still running this long after shutdown are cancelled */

/* ---- types --------------------------------------------------------------------------------- */

typedef enum tag_kind { TAG_CALL, TAG_CLOSE, TAG_SHUTDOWN } tag_kind_t;

/* What the queue thread hands to the loop: embedded in its owner, one completion at a time. */
typedef struct tag {
  tag_kind_t kind;
  int ok;           /* the event's success flag */
  struct tag *next; /* in the hand-over list */
} tag_t;

typedef enum call_stage { STAGE_REQUESTED, STAGE_REPLYING } call_stage_t;

typedef struct call call_t;
typedef struct kv kv_t;

/* A handler answers (reply_msg) or defers and returns ZD_OK, or returns an error with err set,
 * which the dispatcher sends as the gRPC status. It may take *req (set it to NULL). */
typedef int (*handler_fn)(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err);

enum { M_ANY = 0, M_RANK0 = 1 /* served only by the node that hosts global rank 0 */ };

typedef struct method {
  const char *path;
  const ProtobufCMessageDescriptor *request;
  handler_fn handler;
  int flags;
  uint32_t max_bytes; /* largest request accepted */
} method_t;

struct call {
  tag_t tag;       /* the new call, then the reply batch */
  tag_t close_tag; /* receive-close of a deferred call */
  zd__control_t *c;
  int method; /* index in the table; -1: a method not in it */
  call_stage_t stage;
  int refs; /* the tag's operation, the close batch, the timer */
  int replied;
  int deferred;
  int cancelled; /* out-parameter of receive-close */
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_call_details details; /* calls of unknown methods */
  grpc_byte_buffer *payload;
  grpc_byte_buffer *reply;
  grpc_slice status_details;
  /* KvWait */
  Zerod__V1__KvWaitRequest *wait;
  size_t next_key; /* keys before it exist; keys are never deleted */
  uv_timer_t timer;
  int waiting;
  call_t *wprev, *wnext;
};

struct kv {
  char *key;
  uint8_t *value;
  size_t len;
};

static int handle_status(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err);
static int handle_nodes(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err);
static int handle_kv_set(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err);
static int handle_kv_get(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err);
static int handle_kv_wait(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err);
static int handle_kv_delete(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err);
static int handle_health(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err);

/* The methods served: path, request type, handler, who serves it, largest request. */
static const method_t methods[] = {
    {"/zerod.v1.Control/Status", &zerod__v1__node_status_request__descriptor, handle_status, M_ANY,
     1024},
    {"/zerod.v1.Control/Nodes", &zerod__v1__nodes_request__descriptor, handle_nodes, M_RANK0, 1024},
    {"/zerod.v1.Control/KvSet", &zerod__v1__kv_set_request__descriptor, handle_kv_set, M_RANK0,
     MAX_VALUE_BYTES + MAX_KEY_BYTES + 64},
    {"/zerod.v1.Control/KvGet", &zerod__v1__kv_get_request__descriptor, handle_kv_get, M_RANK0,
     MAX_KEY_BYTES + 64},
    {"/zerod.v1.Control/KvWait", &zerod__v1__kv_wait_request__descriptor, handle_kv_wait, M_RANK0,
     ZD__GRPC_MAX_MESSAGE},
    {"/zerod.v1.Control/KvDelete", &zerod__v1__kv_delete_request__descriptor, handle_kv_delete,
     M_RANK0, MAX_KEY_BYTES + 64},
    {"/grpc.health.v1.Health/Check", &grpc__health__v1__health_check_request__descriptor,
     handle_health, M_ANY, 1024},
};
#define NMETHODS (sizeof methods / sizeof methods[0])

struct zd__control {
  zd__daemon_t *d;
  char address[256];   /* as bound: a port 0 replaced */
  char unix_path[108]; /* "" unless a unix: address */
  ino_t unix_inode;
  int serves_kv; /* this node hosts global rank 0 */

  grpc_server *server;
  grpc_completion_queue *cq;
  void *registered[NMETHODS];
  pthread_t thread;
  int thread_started;

  uv_async_t async;
  uv_timer_t grace;
  int open_handles;
  pthread_mutex_t lock; /* the hand-over list and cq_drained */
  tag_t *head, *tail;
  int cq_drained; /* the thread saw GRPC_QUEUE_SHUTDOWN and is exiting */

  tag_t shutdown_tag;
  int stopping;
  int server_down; /* the shutdown tag came back */
  int thread_joined;
  int destroyed;
  uint32_t ncalls; /* call objects alive */
  void (*done)(zd__daemon_t *d);

  kv_t *kvs; /* sorted by key */
  size_t nkv, kvcap;
  size_t kv_bytes;
  call_t *waiters;
  uint32_t nwaiters;
};

/* ---- completion-queue thread ---------------------------------------------------------------- */

static void *cq_main(void *arg) {
  zd__control_t *c = arg;
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(c->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type != GRPC_OP_COMPLETE) continue;
    tag_t *t = ev.tag;
    t->ok = ev.success;
    t->next = NULL;
    pthread_mutex_lock(&c->lock);
    if (c->tail)
      c->tail->next = t;
    else
      c->head = t;
    c->tail = t;
    pthread_mutex_unlock(&c->lock);
    uv_async_send(&c->async);
  }
  pthread_mutex_lock(&c->lock);
  c->cq_drained = 1;
  pthread_mutex_unlock(&c->lock);
  uv_async_send(&c->async);
  return NULL;
}

/* ---- calls --------------------------------------------------------------------------------- */

static void maybe_destroy(zd__control_t *c);

static call_t *call_new(zd__control_t *c, int method) {
  call_t *k = calloc(1, sizeof *k);
  if (!k) return NULL;
  k->tag.kind = TAG_CALL;
  k->close_tag.kind = TAG_CLOSE;
  k->c = c;
  k->method = method;
  k->refs = 1;
  k->status_details = grpc_empty_slice();
  grpc_metadata_array_init(&k->md);
  grpc_call_details_init(&k->details);
  c->ncalls++;
  return k;
}

static void call_unref(call_t *k) {
  if (--k->refs > 0) return;
  zd__control_t *c = k->c;
  if (k->call) grpc_call_unref(k->call);
  grpc_metadata_array_destroy(&k->md);
  grpc_call_details_destroy(&k->details);
  if (k->payload) grpc_byte_buffer_destroy(k->payload);
  if (k->reply) grpc_byte_buffer_destroy(k->reply);
  grpc_slice_unref(k->status_details);
  if (k->wait) zerod__v1__kv_wait_request__free_unpacked(k->wait, NULL);
  free(k);
  c->ncalls--;
  maybe_destroy(c);
}

/* Arms a slot for the next call of method i (-1: any method not in the table). */
static void request_call(zd__control_t *c, int i) {
  call_t *k = call_new(c, i);
  if (!k) {
    ZD_LOG_ERROR("control: out of memory; one slot of %s stays empty",
                 i >= 0 ? methods[i].path : "unknown methods");
    return;
  }
  grpc_call_error e;
  if (i >= 0)
    e = grpc_server_request_registered_call(c->server, c->registered[i], &k->call, &k->deadline,
                                            &k->md, &k->payload, c->cq, c->cq, &k->tag);
  else
    e = grpc_server_request_call(c->server, &k->call, &k->details, &k->md, c->cq, c->cq, &k->tag);
  if (e != GRPC_CALL_OK) {
    ZD_LOG_ERROR("control: cannot wait for calls of %s (grpc_call_error %d)",
                 i >= 0 ? methods[i].path : "unknown methods", (int)e);
    call_unref(k);
  }
}

/* The one batch that ends a call. payload may be NULL (an error status). The call's reference
 * passes from the request to this batch. */
static void send_reply(call_t *k, grpc_status_code status, const char *msg,
                       grpc_byte_buffer *payload) {
  zd_assert(!k->replied);
  k->replied = 1;
  k->stage = STAGE_REPLYING;
  k->reply = payload;
  if (status != GRPC_STATUS_OK) {
    k->status_details = grpc_slice_from_copied_string(msg);
    ZD_LOG_DEBUG("control: %s: %s: %s", k->method >= 0 ? methods[k->method].path : "?",
                 zd__grpc_status_name(status), msg);
  }
  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (payload) {
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = payload;
  }
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = status;
  ops[n++].data.send_status_from_server.status_details =
      status != GRPC_STATUS_OK ? &k->status_details : NULL;
  if (!k->deferred) { /* a deferred call's receive-close is already pending */
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n++].data.recv_close_on_server.cancelled = &k->cancelled;
  }
  grpc_call_error e = grpc_call_start_batch(k->call, ops, n, &k->tag, NULL);
  if (e != GRPC_CALL_OK) {
    ZD_LOG_ERROR("control: cannot send a reply (grpc_call_error %d)", (int)e);
    call_unref(k);
  }
}

static void reply_msg(call_t *k, const ProtobufCMessage *msg) {
  send_reply(k, GRPC_STATUS_OK, NULL, zd__grpc_pack(msg));
}

static void reply_errorf(call_t *k, grpc_status_code status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void reply_errorf(call_t *k, grpc_status_code status, const char *fmt, ...) {
  char msg[ZD__ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  send_reply(k, status, msg, NULL);
}

static int not_rank0(zd__control_t *c, const char *what, zd__err_t *err) {
  const zd__daemon_t *d = c->d;
  uint32_t first = d->cfg->first_rank;
  char ranks[48];
  if (d->nranks > 1)
    snprintf(ranks, sizeof ranks, "ranks %u..%u", first, first + d->nranks - 1);
  else
    snprintf(ranks, sizeof ranks, "rank %u", first);
  return zd__errf(err, ZD_EORDER,
                  "%s is served by the zerod that hosts rank 0, at %s "
                  "(rendezvous_address); this one hosts %s of %u",
                  what, d->cfg->rendezvous_address, ranks, d->world_size);
}

/* Validates the envelope (payload, size, request type, which node) and runs the handler. */
static void dispatch(call_t *k) {
  zd__control_t *c = k->c;
  if (k->method < 0) {
    char name[256];
    size_t n = GRPC_SLICE_LENGTH(k->details.method);
    if (n >= sizeof name) n = sizeof name - 1;
    memcpy(name, GRPC_SLICE_START_PTR(k->details.method), n);
    name[n] = '\0';
    reply_errorf(k, GRPC_STATUS_UNIMPLEMENTED, "zerod does not serve method %s", name);
    return;
  }
  const method_t *m = &methods[k->method];
  zd__err_t err = {0};
  ProtobufCMessage *req = NULL;
  void *data = NULL;
  size_t len = 0;
  int rc;
  if (!k->payload) {
    rc = zd__errf(&err, -EINVAL, "%s: the call carried no request message", m->path);
    goto exit;
  }
  if ((rc = zd__grpc_read(k->payload, &data, &len))) {
    zd__errf(&err, rc, "%s: out of memory reading the request", m->path);
    goto exit;
  }
  if (len > m->max_bytes) {
    rc = zd__errf(&err, ZD_ETOOBIG, "%s: the request is %zu bytes; at most %u are accepted",
                  m->path, len, m->max_bytes);
    goto exit;
  }
  req = protobuf_c_message_unpack(m->request, NULL, len, data);
  if (!req) {
    rc = zd__errf(&err, -EINVAL, "%s: the %zu-byte request is not a valid %s", m->path, len,
                  m->request->name);
    goto exit;
  }
  if ((m->flags & M_RANK0) && !c->serves_kv) {
    rc = not_rank0(c, m->path, &err);
    goto exit;
  }
  rc = m->handler(c, k, &req, &err);
exit:
  if (rc) send_reply(k, zd__grpc_status_of(rc), err.msg, NULL);
  if (req) protobuf_c_message_free_unpacked(req, NULL);
  free(data);
}

/* ---- key-value store ----------------------------------------------------------------------- */

/* Index of key, or of where it would go (*found 0). */
static size_t kv_search(const zd__control_t *c, const char *key, int *found) {
  size_t lo = 0, hi = c->nkv;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int cmp = strcmp(c->kvs[mid].key, key);
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

static const kv_t *kv_find(const zd__control_t *c, const char *key) {
  int found;
  size_t i = kv_search(c, key, &found);
  return found ? &c->kvs[i] : NULL;
}

static int check_key(const char *key, const char *what, zd__err_t *err) {
  size_t n = strlen(key);
  if (n == 0 || n > MAX_KEY_BYTES)
    return zd__errf(err, -EINVAL, "%s: key '%.64s' is %zu bytes; keys have 1..%d", what, key, n,
                    MAX_KEY_BYTES);
  return ZD_OK;
}

static int kv_put(zd__control_t *c, const char *key, const uint8_t *value, size_t len,
                  zd__err_t *err) {
  int found;
  size_t i = kv_search(c, key, &found);
  size_t key_bytes = found ? 0 : strlen(key) + 1;
  size_t old = found ? c->kvs[i].len : 0;
  uint8_t *copy = NULL;
  char *k = NULL;
  int rc = ZD_OK;
  if (c->kv_bytes - old + len + key_bytes > MAX_STORE_BYTES) {
    rc = zd__errf(err, -ENOSPC,
                  "the rendezvous store is full (%zu of %u bytes); cannot set '%s' "
                  "(%zu bytes)",
                  c->kv_bytes, MAX_STORE_BYTES, key, len);
    goto fail;
  }
  if (!(copy = malloc(len ? len : 1)) || (!found && !(k = strdup(key)))) goto oom;
  if (!found && c->nkv == c->kvcap) {
    size_t cap = c->kvcap ? 2 * c->kvcap : 64;
    kv_t *kvs = realloc(c->kvs, cap * sizeof *kvs);
    if (!kvs) goto oom;
    c->kvs = kvs;
    c->kvcap = cap;
  }
  if (len) memcpy(copy, value, len);
  if (found) {
    free(c->kvs[i].value);
  } else {
    memmove(&c->kvs[i + 1], &c->kvs[i], (c->nkv - i) * sizeof *c->kvs);
    c->nkv++;
    c->kvs[i].key = k;
  }
  c->kvs[i].value = copy;
  c->kvs[i].len = len;
  c->kv_bytes = c->kv_bytes - old + len + key_bytes;
  return ZD_OK;
oom:
  rc = zd__errf(err, -ENOMEM, "out of memory storing '%s' (%zu bytes)", key, len);
fail:
  free(k);
  free(copy);
  return rc;
}

static void kv_free_all(zd__control_t *c) {
  for (size_t i = 0; i < c->nkv; i++) {
    free(c->kvs[i].key);
    free(c->kvs[i].value);
  }
  free(c->kvs);
  c->kvs = NULL;
  c->nkv = c->kvcap = c->kv_bytes = 0;
}

/* ---- waiters (KvWait) ---------------------------------------------------------------------- */

static void on_timer_closed(uv_handle_t *h) {
  call_unref(h->data);
}

/* Ends a wait: out of the list, timer closed. The call itself is answered by the caller. */
static void waiter_end(call_t *k) {
  zd__control_t *c = k->c;
  if (!k->waiting) return;
  k->waiting = 0;
  if (k->wprev)
    k->wprev->wnext = k->wnext;
  else
    c->waiters = k->wnext;
  if (k->wnext) k->wnext->wprev = k->wprev;
  k->wprev = k->wnext = NULL;
  c->nwaiters--;
  uv_close((uv_handle_t *)&k->timer, on_timer_closed);
}

/* Moves past the keys that exist now; whether all do. Keys are never deleted, so a waiter never
 * looks at a key twice once it was found: a KvSet costs one lookup per waiter. */
static int wait_advance(const zd__control_t *c, call_t *k) {
  while (k->next_key < k->wait->n_keys && kv_find(c, k->wait->keys[k->next_key])) k->next_key++;
  return k->next_key == k->wait->n_keys;
}

static void reply_wait(call_t *k, int ok) {
  Zerod__V1__KvWaitReply rep = ZEROD__V1__KV_WAIT_REPLY__INIT;
  rep.ok = ok;
  char **missing = NULL;
  if (!ok) {
    missing = malloc((k->wait->n_keys ? k->wait->n_keys : 1) * sizeof *missing);
    if (!missing) {
      send_reply(k, GRPC_STATUS_RESOURCE_EXHAUSTED, "zerod is out of memory", NULL);
      return;
    }
    for (size_t i = k->next_key; i < k->wait->n_keys; i++)
      if (!kv_find(k->c, k->wait->keys[i])) missing[rep.n_missing++] = k->wait->keys[i];
    rep.missing = missing;
  }
  reply_msg(k, &rep.base);
  free(missing);
}

static void on_wait_timeout(uv_timer_t *t) {
  call_t *k = t->data;
  waiter_end(k);
  reply_wait(k, 0);
}

/* The receive-close of a deferred call: a client that cancelled (deadline, disconnect) while
 * its wait was pending ends the wait, and no reply is sent. */
static void on_close_event(call_t *k) {
  if (k->waiting && k->cancelled) {
    ZD_LOG_DEBUG("control: a KvWait for %zu keys was cancelled by its client", k->wait->n_keys);
    waiter_end(k);
    k->replied = 1;
    call_unref(k); /* the reference the reply would have held */
  }
  call_unref(k);
}

/* ---- handlers ------------------------------------------------------------------------------ */

typedef struct rank_msg {
  Zerod__V1__RankStatus msg;
  zd__rank_stats_t stats;
  zd__shard_range_t *ranges;
  Zerod__V1__ShardRange *shard;
  Zerod__V1__ShardRange **shard_ptrs;
} rank_msg_t;

static int fill_rank(zd__control_t *c, uint32_t i, rank_msg_t *rm, zd__err_t *err) {
  zd__daemon_t *d = c->d;
  zd__rank_t *r = d->ranks[i];
  Zerod__V1__RankStatus *m = &rm->msg;
  zd__rank_stats_t *s = &rm->stats;
  zerod__v1__rank_status__init(m);
  zd__rank_stats(r, s);
  m->rank = zd__rank_global(r);
  m->local_rank = i;
  m->health = (char *)zd__health_name(s->health);
  if (s->health != ZD__HEALTH_OK) m->degraded_reason = s->degraded_reason;
  zd__session_t *client = d->attached[i];
  if (client) {
    m->client = (char *)zd__session_name(client);
    m->has_client_pid = 1;
    m->client_pid = (int32_t)zd__session_pid(client);
  }
  m->has_model = s->has_model;
  if (!s->has_model) return ZD_OK;
  m->has_params = m->has_shard_elems = m->has_state_bytes = m->has_grad_shard_bytes = 1;
  m->params = s->nparams;
  m->shard_elems = s->shard_elems;
  m->state_bytes = s->state_bytes;
  m->grad_shard_bytes = s->grad_shard_bytes;
  m->has_step = m->has_steps_skipped = m->has_loss_scale = 1;
  m->step = s->step;
  m->steps_skipped = s->steps_skipped;
  m->loss_scale = s->loss_scale;
  if (!isnan(s->last_grad_norm)) {
    m->has_last_grad_norm = 1;
    m->last_grad_norm = s->last_grad_norm;
  }
  if (s->steps_run) {
    m->has_last_step_us = 1;
    m->last_step_us = s->last_step_us;
  }
  uint32_t n;
  if (zd__rank_shard_ranges(r, &rm->ranges, &n) != 0 ||
      !(rm->shard = calloc(n ? n : 1, sizeof *rm->shard)) ||
      !(rm->shard_ptrs = calloc(n ? n : 1, sizeof *rm->shard_ptrs)))
    return zd__errf(err, -ENOMEM, "out of memory describing the shard of rank %u", m->rank);
  for (uint32_t b = 0; b < n; b++) {
    zerod__v1__shard_range__init(&rm->shard[b]);
    rm->shard[b].bucket = rm->ranges[b].bucket;
    rm->shard[b].begin = rm->ranges[b].begin;
    rm->shard[b].end = rm->ranges[b].end;
    rm->shard_ptrs[b] = &rm->shard[b];
  }
  m->n_shard = n;
  m->shard = rm->shard_ptrs;
  return ZD_OK;
}

static int handle_status(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  (void)req;
  zd__daemon_t *d = c->d;
  uint32_t n = d->nranks;
  rank_msg_t *rms = calloc(n ? n : 1, sizeof *rms);
  Zerod__V1__RankStatus **ptrs = calloc(n ? n : 1, sizeof *ptrs);
  int rc = ZD_OK;
  if (!rms || !ptrs) {
    rc = zd__errf(err, -ENOMEM, "out of memory for the status of %u ranks", n);
    goto exit;
  }
  for (uint32_t i = 0; i < n; i++) {
    if ((rc = fill_rank(c, i, &rms[i], err))) goto exit;
    ptrs[i] = &rms[i].msg;
  }
  Zerod__V1__NodeStatus st = ZEROD__V1__NODE_STATUS__INIT;
  st.version = (char *)ZD_VERSION;
  st.pid = (int32_t)getpid();
  st.control_address = c->address;
  st.world_size = d->world_size;
  st.first_rank = d->cfg->first_rank;
  st.local_ranks = n;
  st.backend = (char *)zd__backend_name(d->backend); /* daemon.c, choose_backend */
  st.uptime_s = (zd__now_us() - d->start_us) / 1000000u;
  st.rendezvous_address = d->cfg->rendezvous_address;
  st.n_ranks = n;
  st.ranks = ptrs;
  reply_msg(k, &st.base);
exit:
  for (uint32_t i = 0; rms && i < n; i++) {
    free(rms[i].ranges);
    free(rms[i].shard);
    free(rms[i].shard_ptrs);
  }
  free(rms);
  free(ptrs);
  return rc;
}

static int cmp_node(const void *a, const void *b) {
  const Zerod__V1__NodeInfo *x = *(Zerod__V1__NodeInfo *const *)a;
  const Zerod__V1__NodeInfo *y = *(Zerod__V1__NodeInfo *const *)b;
  return x->first_rank < y->first_rank ? -1 : x->first_rank > y->first_rank;
}

/* The registry: every "node/<first_rank>" entry, plus this node, which a single-node world never
 * registers. Entries that do not decode are skipped with a warning, not fatal to the listing. */
static int handle_nodes(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  (void)req;
  zd__daemon_t *d = c->d;
  const size_t plen = strlen(ZD__RDV_NODE_PREFIX);
  int found;
  size_t first = kv_search(c, ZD__RDV_NODE_PREFIX, &found), last = first;
  while (last < c->nkv && strncmp(c->kvs[last].key, ZD__RDV_NODE_PREFIX, plen) == 0) last++;
  Zerod__V1__NodeInfo **nodes = calloc(last - first + 1, sizeof *nodes);
  size_t n = 0;
  int rc = ZD_OK, self_listed = 0;
  if (!nodes) {
    rc = zd__errf(err, -ENOMEM, "out of memory listing %zu nodes", last - first);
    goto exit;
  }
  for (size_t i = first; i < last; i++) {
    Zerod__V1__NodeInfo *info = zerod__v1__node_info__unpack(NULL, c->kvs[i].len, c->kvs[i].value);
    if (!info) {
      ZD_LOG_WARN("control: registry entry '%s' (%zu bytes) is not a NodeInfo; not listed",
                  c->kvs[i].key, c->kvs[i].len);
      continue;
    }
    self_listed |= info->first_rank == d->cfg->first_rank;
    nodes[n++] = info;
  }
  Zerod__V1__NodeInfo self = ZEROD__V1__NODE_INFO__INIT;
  self.first_rank = d->cfg->first_rank;
  self.local_ranks = d->nranks;
  self.control_address = c->address;
  if (!self_listed) nodes[n++] = &self;
  qsort(nodes, n, sizeof *nodes, cmp_node);
  Zerod__V1__NodesReply rep = ZEROD__V1__NODES_REPLY__INIT;
  rep.world_size = d->world_size;
  rep.n_nodes = n;
  rep.nodes = nodes;
  reply_msg(k, &rep.base);
exit:
  for (size_t i = 0; nodes && i < n; i++)
    if (nodes[i] != &self) zerod__v1__node_info__free_unpacked(nodes[i], NULL);
  free(nodes);
  return rc;
}

static int handle_kv_set(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  Zerod__V1__KvSetRequest *r = (Zerod__V1__KvSetRequest *)*req;
  int rc = check_key(r->key, "KvSet", err);
  if (rc) return rc;
  if (r->value.len > MAX_VALUE_BYTES)
    return zd__errf(err, ZD_ETOOBIG, "KvSet: the value of '%s' is %zu bytes; at most %u", r->key,
                    r->value.len, MAX_VALUE_BYTES);
  /* First writer wins: a key of the store names one rank's address or the world's id, written
   * once per world; a different value later is a mistake or an attack, never an update. The same
   * value again is a retry. */
  const kv_t *old = kv_find(c, r->key);
  if (old && (old->len != r->value.len || memcmp(old->value, r->value.data, old->len) != 0))
    return zd__errf(err, -EEXIST,
                    "KvSet: '%s' is already set to another value; rendezvous keys "
                    "are written once (restart the whole world to rejoin it)",
                    r->key);
  if (!old && (rc = kv_put(c, r->key, r->value.data, r->value.len, err))) return rc;
  ZD_LOG_DEBUG("control: rendezvous set '%s' (%zu bytes)", r->key, r->value.len);
  for (call_t *w = c->waiters, *next; w; w = next) {
    next = w->wnext;
    if (wait_advance(c, w)) {
      waiter_end(w);
      reply_wait(w, 1);
    }
  }
  Zerod__V1__KvSetReply rep = ZEROD__V1__KV_SET_REPLY__INIT;
  reply_msg(k, &rep.base);
  return ZD_OK;
}

/* Waiters that passed the key keep their place: a key is withdrawn only by a rank that gave up
 * waiting for the others, and whoever saw it before then has raced that rank anyway. */
static int handle_kv_delete(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  Zerod__V1__KvDeleteRequest *r = (Zerod__V1__KvDeleteRequest *)*req;
  int rc = check_key(r->key, "KvDelete", err);
  if (rc) return rc;
  int found;
  size_t i = kv_search(c, r->key, &found);
  if (found) {
    c->kv_bytes -= c->kvs[i].len + strlen(c->kvs[i].key) + 1;
    free(c->kvs[i].key);
    free(c->kvs[i].value);
    memmove(&c->kvs[i], &c->kvs[i + 1], (c->nkv - i - 1) * sizeof *c->kvs);
    c->nkv--;
    ZD_LOG_DEBUG("control: rendezvous deleted '%s'", r->key);
  }
  Zerod__V1__KvDeleteReply rep = ZEROD__V1__KV_DELETE_REPLY__INIT;
  rep.found = found;
  reply_msg(k, &rep.base);
  return ZD_OK;
}

static int handle_kv_get(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  Zerod__V1__KvGetRequest *r = (Zerod__V1__KvGetRequest *)*req;
  int rc = check_key(r->key, "KvGet", err);
  if (rc) return rc;
  const kv_t *e = kv_find(c, r->key);
  Zerod__V1__KvGetReply rep = ZEROD__V1__KV_GET_REPLY__INIT;
  rep.found = e != NULL;
  if (e) {
    rep.has_value = 1;
    rep.value.data = e->value;
    rep.value.len = e->len;
  }
  reply_msg(k, &rep.base);
  return ZD_OK;
}

static int handle_kv_wait(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  Zerod__V1__KvWaitRequest *r = (Zerod__V1__KvWaitRequest *)*req;
  if (r->n_keys > MAX_WAIT_KEYS)
    return zd__errf(err, -EINVAL, "KvWait: %zu keys; at most %d", r->n_keys, MAX_WAIT_KEYS);
  for (size_t i = 0; i < r->n_keys; i++) {
    int rc = check_key(r->keys[i], "KvWait", err);
    if (rc) return rc;
  }
  k->wait = r; /* the call owns the request from here on */
  *req = NULL;
  if (wait_advance(c, k)) {
    reply_wait(k, 1);
    return ZD_OK;
  }
  if (c->stopping) return zd__errf(err, ZD_ESHUTDOWN, "zerod at %s is shutting down", c->address);
  if (c->nwaiters >= MAX_WAITERS)
    return zd__errf(err, -ENOSPC, "KvWait: %u calls are waiting already; at most %d", c->nwaiters,
                    MAX_WAITERS);
  if (r->timeout_ms == 0) {
    reply_wait(k, 0);
    return ZD_OK;
  }
  grpc_op op = {.op = GRPC_OP_RECV_CLOSE_ON_SERVER};
  op.data.recv_close_on_server.cancelled = &k->cancelled;
  grpc_call_error e = grpc_call_start_batch(k->call, &op, 1, &k->close_tag, NULL);
  if (e != GRPC_CALL_OK)
    return zd__errf(err, ZD_EINTERNAL, "KvWait: cannot watch the call (grpc_call_error %d)",
                    (int)e);
  k->deferred = 1;
  k->refs += 2; /* the close batch and the timer */
  uv_timer_init(&c->d->loop, &k->timer);
  k->timer.data = k;
  uv_timer_start(&k->timer, on_wait_timeout, r->timeout_ms, 0);
  k->waiting = 1;
  k->wnext = c->waiters;
  if (c->waiters) c->waiters->wprev = k;
  c->waiters = k;
  c->nwaiters++;
  return ZD_OK;
}

static int handle_health(zd__control_t *c, call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  Grpc__Health__V1__HealthCheckRequest *r = (Grpc__Health__V1__HealthCheckRequest *)*req;
  const char *svc = r->service ? r->service : "";
  zd__daemon_t *d = c->d;
  int serving = !c->stopping && !d->shutting_down;
  if (!strcmp(svc, "zerod.ranks")) {
    for (uint32_t i = 0; i < d->nranks && serving; i++) {
      zd__rank_stats_t s;
      zd__rank_stats(d->ranks[i], &s);
      serving = s.health == ZD__HEALTH_OK;
    }
  } else if (svc[0] && strcmp(svc, "zerod.v1.Control") != 0) {
    return zd__errf(err, -ENOENT,
                    "unknown service '%s'; zerod serves '', 'zerod.v1.Control' and "
                    "'zerod.ranks'",
                    svc);
  }
  Grpc__Health__V1__HealthCheckResponse rep = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  rep.status = serving ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                       : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
  reply_msg(k, &rep.base);
  return ZD_OK;
}

/* ---- the loop side of the queue ------------------------------------------------------------ */

static void on_handle_closed(uv_handle_t *h) {
  zd__control_t *c = h->data;
  if (--c->open_handles > 0) return;
  zd__daemon_t *d = c->d;
  void (*done)(zd__daemon_t *) = c->done;
  pthread_mutex_destroy(&c->lock);
  free(c);
  if (done) done(d);
}

static void remove_unix_socket(zd__control_t *c) {
  struct stat st;
  if (c->unix_path[0] && lstat(c->unix_path, &st) == 0 && st.st_ino == c->unix_inode)
    unlink(c->unix_path);
}

/* The end, once the queue thread is joined and no call object is left. */
static void maybe_destroy(zd__control_t *c) {
  if (!c->thread_joined || c->ncalls > 0 || c->destroyed) return;
  c->destroyed = 1;
  grpc_server_destroy(c->server);
  grpc_completion_queue_destroy(c->cq);
  grpc_shutdown();
  remove_unix_socket(c);
  kv_free_all(c);
  ZD_LOG_INFO("control service stopped");
  uv_close((uv_handle_t *)&c->async, on_handle_closed);
  uv_close((uv_handle_t *)&c->grace, on_handle_closed);
}

static void handle_tag(zd__control_t *c, tag_t *t) {
  switch (t->kind) {
    case TAG_SHUTDOWN:
      c->server_down = 1;
      uv_timer_stop(&c->grace);
      grpc_completion_queue_shutdown(c->cq); /* the thread drains it and exits */
      break;
    case TAG_CLOSE:
      on_close_event((call_t *)((char *)t - offsetof(call_t, close_tag)));
      break;
    case TAG_CALL: {
      call_t *k = (call_t *)t;
      if (k->stage == STAGE_REPLYING || !t->ok) { /* reply sent, or a slot the shutdown ended */
        call_unref(k);
        break;
      }
      if (!c->stopping) request_call(c, k->method);
      dispatch(k);
      break;
    }
  }
}

static void on_async(uv_async_t *h) {
  zd__control_t *c = h->data;
  pthread_mutex_lock(&c->lock);
  tag_t *t = c->head;
  c->head = c->tail = NULL;
  int drained = c->cq_drained;
  pthread_mutex_unlock(&c->lock);
  while (t) {
    tag_t *next = t->next;
    handle_tag(c, t);
    t = next;
  }
  if (drained && !c->thread_joined) {
    pthread_join(c->thread, NULL);
    c->thread_joined = 1;
    maybe_destroy(c);
  }
}

static void on_grace(uv_timer_t *t) {
  zd__control_t *c = t->data;
  if (c->server_down) return;
  ZD_LOG_INFO("control: cancelling the calls still running %d ms into the shutdown",
              SHUTDOWN_GRACE_MS);
  grpc_server_cancel_all_calls(c->server);
}

void zd__control_stop(zd__control_t *c, void (*done)(zd__daemon_t *d)) {
  if (c->stopping) return;
  c->stopping = 1;
  c->done = done;
  uint32_t answered = c->nwaiters;
  while (c->waiters) {
    call_t *k = c->waiters;
    waiter_end(k);
    reply_errorf(k, GRPC_STATUS_UNAVAILABLE, "zerod at %s is shutting down", c->address);
  }
  ZD_LOG_INFO("control: shutting down%s", answered ? "; answered the pending KvWait calls" : "");
  grpc_server_shutdown_and_notify(c->server, c->cq, &c->shutdown_tag);
  uv_timer_start(&c->grace, on_grace, SHUTDOWN_GRACE_MS, 0);
}

const char *zd__control_address(const zd__control_t *c) {
  return c->address;
}

/* ---- start --------------------------------------------------------------------------------- */

/* gRPC's own log lines, into the daemon's log. gRPC filters by GRPC_VERBOSITY (default: errors)
 * before calling this. */
static void grpc_log(gpr_log_func_args *a) {
  if (a->severity == GPR_LOG_SEVERITY_ERROR)
    ZD_LOG_WARN("grpc: %s (%s:%d)", a->message, a->file, a->line);
  else
    ZD_LOG_DEBUG("grpc: %s", a->message);
}

static int unix_in_use(const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  int in_use = connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0;
  close(fd);
  return in_use;
}

/* A unix: address: gRPC would unlink whatever socket is at the path, a live zerod's included,
 * so look first, as server.c does for the client socket. */
static int prepare_unix(zd__control_t *c, const char *addr, zd__err_t *err) {
  const char *path = addr + 5;
  if (strncmp(path, "//", 2) == 0) path += 2; /* unix:///abs/path */
  if (!path[0] || strlen(path) >= sizeof c->unix_path)
    return zd__errf(err, ZD_ECONFIG, "control_address %s: the socket path must have 1..%zu bytes",
                    addr, sizeof c->unix_path - 1);
  snprintf(c->unix_path, sizeof c->unix_path, "%s", path);
  struct stat st;
  if (lstat(path, &st) != 0) return ZD_OK;
  if (!S_ISSOCK(st.st_mode))
    return zd__errf(err, -EEXIST, "control_address %s: %s exists and is not a socket", addr, path);
  if (unix_in_use(path))
    return zd__errf(err, -EADDRINUSE, "control_address %s: another process is listening on %s",
                    addr, path);
  return ZD_OK;
}

/* Why a TCP address could not be bound, found by trying it the way gRPC does (gRPC itself says
 * nothing for an address in use). Called only after gRPC failed, so it races with nothing that
 * matters: at worst the diagnosis is vaguer. */
static void diagnose_tcp(const char *addr, char *why, size_t len) {
  snprintf(why, len, "malformed: expected host:port or unix:/path");
  const char *colon = strrchr(addr, ':');
  if (!colon || !colon[1]) return;
  char host[256];
  snprintf(host, sizeof host, "%.*s", (int)(colon - addr), addr);
  size_t hl = strlen(host);
  if (hl >= 2 && host[0] == '[' && host[hl - 1] == ']') { /* [::1]:7070 */
    memmove(host, host + 1, hl - 2);
    host[hl - 2] = '\0';
  }
  struct addrinfo hints = {
      .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
  struct addrinfo *res = NULL;
  int gai = getaddrinfo(host[0] ? host : NULL, colon + 1, &hints, &res);
  if (gai) {
    snprintf(why, len, "cannot resolve '%s' port '%s': %s", host, colon + 1, gai_strerror(gai));
    return;
  }
  snprintf(why, len, "gRPC refused it; see the grpc line above");
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      int e = errno;
      snprintf(why, len, "%s",
               e == EADDRINUSE      ? "another process is listening on it"
               : e == EADDRNOTAVAIL ? "not an address of this host"
                                    : strerror(e));
      close(fd);
      break;
    }
    close(fd);
  }
  freeaddrinfo(res);
}

/* The address as bound: "host:0" gets the port the kernel chose. */
static void set_bound_address(zd__control_t *c, const char *addr, int port) {
  const char *colon = strrchr(addr, ':');
  if (!c->unix_path[0] && colon && strcmp(colon, ":0") == 0)
    snprintf(c->address, sizeof c->address, "%.*s:%d", (int)(colon - addr), addr, port);
  else
    snprintf(c->address, sizeof c->address, "%s", addr);
}

/* Undoes a start that failed after the server and queue were created. */
static void abort_start(zd__control_t *c) {
  grpc_completion_queue_shutdown(c->cq);
  if (c->thread_started) {
    pthread_join(c->thread, NULL);
  } else {
    while (grpc_completion_queue_next(c->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
  }
  grpc_server_destroy(c->server);
  grpc_completion_queue_destroy(c->cq);
  grpc_shutdown();
  c->done = NULL;
  uv_close((uv_handle_t *)&c->async, on_handle_closed);
  uv_close((uv_handle_t *)&c->grace, on_handle_closed);
}

int zd__control_start(zd__daemon_t *d, zd__control_t **out, zd__err_t *err) {
  const char *addr = d->cfg->control_address;
  *out = NULL;
  zd__control_t *c = calloc(1, sizeof *c);
  if (!c) return zd__errf(err, -ENOMEM, "out of memory starting the control service");
  c->d = d;
  c->serves_kv = d->cfg->first_rank == 0;
  c->shutdown_tag.kind = TAG_SHUTDOWN;
  pthread_mutex_init(&c->lock, NULL);
  int rc = strncmp(addr, "unix:", 5) == 0 ? prepare_unix(c, addr, err) : ZD_OK;
  if (!rc && !addr[0]) rc = zd__errf(err, ZD_ECONFIG, "control_address is empty");
  if (!rc && (rc = uv_async_init(&d->loop, &c->async, on_async)))
    zd__errf(err, rc, "uv_async_init: %s", uv_strerror(rc));
  if (rc) {
    pthread_mutex_destroy(&c->lock);
    free(c);
    return rc;
  }
  uv_timer_init(&d->loop, &c->grace);
  c->async.data = c->grace.data = c;
  c->open_handles = 2;

  gpr_set_log_function(grpc_log);
  grpc_init();
  c->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_arg args[] = {
      {.type = GRPC_ARG_INTEGER,
       .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
       .value.integer = (int)ZD__GRPC_MAX_MESSAGE},
      {.type = GRPC_ARG_INTEGER,
       .key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
       .value.integer = (int)ZD__GRPC_MAX_MESSAGE},
      /* gRPC sets SO_REUSEPORT by default: a second zerod on the same port would silently share
       * the calls instead of failing to start. */
      {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_ALLOW_REUSEPORT, .value.integer = 0},
  };
  grpc_channel_args chargs = {.num_args = sizeof args / sizeof args[0], .args = args};
  c->server = grpc_server_create(&chargs, NULL);
  for (size_t i = 0; i < NMETHODS; i++) {
    c->registered[i] = grpc_server_register_method(c->server, methods[i].path, NULL,
                                                   GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!c->registered[i]) {
      rc = zd__errf(err, ZD_EINTERNAL, "cannot register gRPC method %s", methods[i].path);
      goto fail;
    }
  }
  grpc_server_register_completion_queue(c->server, c->cq, NULL);
  if ((rc = pthread_create(&c->thread, NULL, cq_main, c))) {
    rc = zd__errf(err, -rc, "cannot start the control service's thread: %s", strerror(rc));
    goto fail;
  }
  c->thread_started = 1;

  /* A unix socket is created with the client socket's mode (socket_mode): the umask keeps any
   * wider access from existing even for a moment. */
  mode_t old_mask = 0;
  if (c->unix_path[0]) old_mask = umask(~(mode_t)d->cfg->socket_mode & 0777);
  grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
  int port = grpc_server_add_http2_port(c->server, addr, creds);
  grpc_server_credentials_release(creds);
  if (c->unix_path[0]) umask(old_mask);
  if (port <= 0) {
    char why[256];
    if (c->unix_path[0])
      snprintf(why, sizeof why, "see the grpc line above");
    else
      diagnose_tcp(addr, why, sizeof why);
    rc = zd__errf(err, -EADDRNOTAVAIL, "cannot listen on control_address %s: %s", addr, why);
    goto fail;
  }
  struct stat st;
  if (c->unix_path[0] && lstat(c->unix_path, &st) == 0) c->unix_inode = st.st_ino;
  set_bound_address(c, addr, port);
  grpc_server_start(c->server);
  for (size_t i = 0; i < NMETHODS; i++)
    for (int s = 0; s < SLOTS_PER_METHOD; s++) request_call(c, (int)i);
  request_call(c, -1);
  ZD_LOG_INFO("control service on %s%s (gRPC %s)", c->address,
              c->serves_kv ? ", with the rendezvous store" : "", grpc_version_string());
  *out = c;
  return ZD_OK;

fail:
  abort_start(c);
  return rc;
}
