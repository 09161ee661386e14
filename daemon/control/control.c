/* The gRPC control service (control.h): zerod.v1.Control and grpc.health.v1.Health/Check.
 *
 * This file is what the methods mean: their table, handlers that read the daemon's state (on the
 * loop thread, where it lives) or translate rendezvous requests into calls of the key-value
 * store, and the service's start and stop. Serving gRPC is grpc_server.c's; keeping keys, values
 * and waits is kvstore.c's.
 *
 * Nodes and the Kv* methods are served only by the node that hosts global rank 0, which holds the
 * world's rendezvous store; elsewhere they say where that node is. With an etcd rendezvous every
 * node serves Nodes, read from etcd on libuv's thread pool. A KvWait that cannot be
 * answered yet becomes a wait of the store and a deferred call: the store's callback answers it,
 * or the client cancelling it ends the wait. Drain is deferred too, answered when the drain ends
 * (drain.h); a caller that leaves does not end the drain.
 *
 * Stop: the pending waits are answered UNAVAILABLE and the store refuses new ones, then the server
 * shuts down; once it is gone, the store is freed and the daemon told.
 */
#include "control.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "buddy.h"
#include "snapshot.h"
#include "clock.h"
#include "control.pb-c.h"
#include "etcd.h"
#include "grpc_server.h"
#include "grpc_unary.h"
#include "health.pb-c.h"
#include "kvstore.h"
#include "log.h"
#include "rendezvous.h"
#include "token.h"

#define MAX_KEY_BYTES   1024
#define MAX_VALUE_BYTES (1u << 20)  /* a rendezvous value: an address, an id; never tensors */
#define MAX_STORE_BYTES (64u << 20) /* keys and values together */
#define MAX_WAIT_KEYS   65536
#define MAX_WAITERS     4096 /* KvWait calls held at once */

static const zd__kvstore_limits_t kv_limits = {
    .max_key_bytes = MAX_KEY_BYTES,
    .max_value_bytes = MAX_VALUE_BYTES,
    .max_total_bytes = MAX_STORE_BYTES,
    .max_wait_keys = MAX_WAIT_KEYS,
    .max_waiters = MAX_WAITERS,
};

struct zd__control {
  zd__control_env_t env;
  const zd__config_t *cfg;
  /* the node, from zd__control_serve on (NULL before) */
  const zd__ranks_t *ranks;
  const zd__sessions_t *sessions;
  zd__ckptr_t *ckpt;
  zd__drain_t *drain;
  int serves_kv;             /* this node hosts global rank 0 */
  char token[ZD__TOKEN_MAX]; /* control_token_file's token; "": none required */
  uint64_t refused;          /* store calls refused for their token */
  int stopping;
  zd__gsrv_call_t *drain_call; /* the Drain being waited for; NULL once answered or cancelled */
  zd__gsrv_t *server;
  zd__kvstore_t *store;
  void (*done)(void *ctx);
  void *done_ctx;
};

/* A KvWait that waits on the store: owns its request (the store reads its keys) until the wait's
 * close callback, and holds the call until then. */
typedef struct kv_wait {
  zd__control_t *c;
  zd__gsrv_call_t *call;
  Zerod__V1__KvWaitRequest *req;
  zd__kv_wait_t *w;
} kv_wait_t;

/* ---- which node serves what ------------------------------------------------------------------ */

static int not_rank0(zd__control_t *c, const char *what, zd__err_t *err) {
  const zd__config_t *cfg = c->cfg;
  uint32_t first = cfg->first_rank;
  char ranks[48];
  if (cfg->local_ranks > 1)
    snprintf(ranks, sizeof ranks, "ranks %u..%u", first, first + cfg->local_ranks - 1);
  else
    snprintf(ranks, sizeof ranks, "rank %u", first);
  return zd__errf(err, ZD_EORDER,
                  "%s is served by the zerod that hosts rank 0, at %s "
                  "(rendezvous_address); this one hosts %s of %u",
                  what, cfg->rendezvous_address, ranks, cfg->world_size);
}

/* With a control token, the store's calls must carry it ("authorization: Bearer <token>"): they
 * write the world's bootstrap or read its secrets (collective addresses, NCCL's id). A refusal
 * is logged with the peer, never with the token. */
static int token_ok(zd__control_t *c, const zd__gsrv_call_t *k, zd__err_t *err) {
  if (!c->token[0]) return ZD_OK;
  char got[ZD__TOKEN_MAX + 16], peer[128];
  int found = zd__gsrv_call_metadata(k, ZD__GRPC_AUTH_KEY, got, sizeof got);
  const char *why = found <= 0                            ? "no control token"
                    : strncmp(got, "Bearer ", 7) != 0     ? "a malformed authorization"
                    : !zd__token_equal(got + 7, c->token) ? "a wrong control token"
                                                          : NULL;
  if (!why) return ZD_OK;
  zd__gsrv_call_peer(k, peer, sizeof peer);
  c->refused++;
  ZD_LOG_WARN("control: refused %s from %s: %s (%" PRIu64 " refused so far)", zd__gsrv_call_path(k),
              peer, why, c->refused);
  return zd__errf(err, ZD_EDENIED,
                  "%s needs this world's control token (control_token_file): the call came with "
                  "%s",
                  zd__gsrv_call_path(k), why);
}

/* Methods served by rank 0's node (Nodes, the store) begin with this: other nodes say where it
 * is. */
static int rank0_only(zd__control_t *c, const zd__gsrv_call_t *k, zd__err_t *err) {
  return c->serves_kv ? ZD_OK : not_rank0(c, zd__gsrv_call_path(k), err);
}

/* Methods of the rendezvous store: only members of the world (the token) are served. */
static int store_call(zd__control_t *c, const zd__gsrv_call_t *k, zd__err_t *err) {
  int rc = token_ok(c, k, err);
  return rc ? rc : rank0_only(c, k, err);
}

/* ---- node status and the registry ------------------------------------------------------------ */

typedef struct rank_msg {
  Zerod__V1__RankStatus msg;
  zd__rank_stats_t stats;
  zd__shard_range_t *ranges;
  zd__buddy_rank_status_t buddy; /* buddy copies: the strings the message points to */
  Zerod__V1__ShardRange *shard;
  Zerod__V1__ShardRange **shard_ptrs;
} rank_msg_t;

static int fill_rank(zd__control_t *c, uint32_t i, rank_msg_t *rm, zd__err_t *err) {
  zd__rank_t *r = c->ranks->rank[i];
  Zerod__V1__RankStatus *m = &rm->msg;
  zd__rank_stats_t *s = &rm->stats;
  zerod__v1__rank_status__init(m);
  zd__rank_stats(r, s);
  m->rank = zd__rank_global(r);
  m->local_rank = i;
  m->health = (char *)zd__health_name(s->health);
  if (s->health != ZD__HEALTH_OK) m->degraded_reason = s->degraded_reason;
  const zd__session_t *client = zd__sessions_attached(c->sessions, i);
  if (client) {
    m->client = (char *)zd__session_name(client);
    m->has_client_pid = 1;
    m->client_pid = (int32_t)zd__session_pid(client);
  }
  zd__buddy_rank_status(i, &rm->buddy);
  if (rm->buddy.has_copy) {
    m->has_buddy_copy_step = m->has_buddy_copy_age_ms = 1;
    m->buddy_copy_step = rm->buddy.step;
    m->buddy_copy_age_ms = rm->buddy.age_ms;
    m->buddy_copy_holder = rm->buddy.holder;
  }
  if (rm->buddy.error[0]) m->buddy_copy_error = rm->buddy.error;
  if (s->last_resize[0]) m->last_resize = s->last_resize;
  zd__snapshot_rank_status_t sn;
  zd__snapshot_rank_status(i, &sn);
  if (sn.has) {
    m->has_snapshot_step = m->has_snapshot_age_ms = m->has_snapshot_bytes = 1;
    m->snapshot_step = sn.step;
    m->snapshot_age_ms = sn.age_ms;
    m->snapshot_bytes = sn.bytes;
  }
  m->has_model = s->has_model;
  if (!s->has_model) return ZD_OK;
  m->has_params = m->has_shard_elems = m->has_state_bytes = m->has_grad_shard_bytes = 1;
  m->params = s->nparams;
  m->shard_elems = s->shard_elems;
  m->state_bytes = zd__rank_state_bytes(s->states, s->shard_elems, s->state_sets);
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
  if (s->state_path[0]) {
    m->state_file = s->state_path;
    m->has_state_committed_step = 1;
    m->state_committed_step = s->state_committed_step;
  }
  if (s->recovery[0]) {
    m->last_recovery = s->recovery;
    m->has_last_recovery_step = m->has_last_recovery_ms = 1;
    m->last_recovery_step = s->recovery_step;
    m->last_recovery_ms = s->recovery_ms;
    if (s->recovery_note[0]) m->last_recovery_note = s->recovery_note;
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

static int handle_status(void *ctx, zd__gsrv_call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  (void)req;
  zd__control_t *c = ctx;
  uint32_t n = c->ranks ? c->ranks->n : 0;
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
  st.control_address = (char *)zd__control_address(c);
  st.world_size = n ? zd__rank_world_size(c->ranks->rank[0]) : c->cfg->world_size;
  st.has_configured_world_size = st.world_size != c->cfg->world_size;
  st.configured_world_size = c->cfg->world_size;
  st.first_rank = c->cfg->first_rank;
  st.local_ranks = n;
  st.backend = (char *)zd__backend_name(c->env.backend->kind);
  st.uptime_s = (zd__now_us() - c->env.start_us) / 1000000u;
  st.rendezvous_address = c->cfg->rendezvous_address;
  st.n_ranks = n;
  st.ranks = ptrs;
  Zerod__V1__CheckpointStatus cks = ZEROD__V1__CHECKPOINT_STATUS__INIT;
  zd__ckpt_stats_t s;
  if (c->ckpt) {
    zd__ckptr_stats(c->ckpt, &s);
    cks.enabled = s.enabled;
    cks.completed = s.completed;
    cks.failures = s.failures;
    cks.in_progress = s.in_progress;
    cks.has_last_step = cks.has_last_age_s = s.completed > 0;
    cks.last_step = s.last_ok_step;
    cks.last_dir = s.completed ? s.last_dir : NULL;
    cks.last_age_s = (zd__unix_ms() - s.last_ok_unix_ms) / 1000u;
    cks.last_error = s.last_error[0] ? s.last_error : NULL;
    st.checkpoint = &cks;
  }
  st.has_draining = 1;
  st.draining = c->drain && zd__drain_by(c->drain) != NULL;
  zd__gsrv_reply(k, &st.base);
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

/* A write: the control token, where there is one, as for the store. */
static int handle_checkpoint(void *ctx, zd__gsrv_call_t *k, ProtobufCMessage **req,
                             zd__err_t *err) {
  (void)req;
  zd__control_t *c = ctx;
  zd__ckptr_t *ck = c->ckpt;
  int rc = token_ok(c, k, err);
  if (!rc && !ck) rc = zd__errf(err, ZD_EORDER, "this zerod has no ranks yet");
  if (!rc) rc = zd__ckptr_request(ck, err);
  if (rc) return rc;
  zd__ckpt_stats_t s;
  zd__ckptr_stats(ck, &s);
  char peer[128];
  zd__gsrv_call_peer(k, peer, sizeof peer);
  ZD_LOG_INFO("control: checkpoint requested by %s; taken after the next step", peer);
  Zerod__V1__RequestCheckpointReply rep = ZEROD__V1__REQUEST_CHECKPOINT_REPLY__INIT;
  rep.has_last_step = s.completed > 0;
  rep.last_step = s.last_ok_step;
  zd__gsrv_reply(k, &rep.base);
  return ZD_OK;
}

/* A write, as Checkpoint: every local rank asks, and the ranks agree through the next step. */
static int handle_resize(void *ctx, zd__gsrv_call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  zd__control_t *c = ctx;
  const Zerod__V1__ResizeRequest *q = (const Zerod__V1__ResizeRequest *)*req;
  int rc = token_ok(c, k, err);
  if (!rc && (!c->ranks || !c->ranks->n))
    rc = zd__errf(err, ZD_EORDER, "this zerod has no ranks yet");
  /* One rank is where a drain --leave ends (drain.h), which knows which node goes. */
  if (!rc && q->world_size < 2)
    rc = zd__errf(err, ZD_ECONFIG,
                  "world_size %u: a live resize keeps 2 to 65535 ranks (zeroctl drain --leave "
                  "on the node of the highest ranks leaves a world of one)",
                  q->world_size);
  for (uint32_t i = 0; !rc && i < c->ranks->n; i++)
    rc = zd__rank_request_resize(c->ranks->rank[i], q->world_size, err);
  if (rc) return rc;
  uint32_t from = zd__rank_world_size(c->ranks->rank[0]);
  char peer[128];
  zd__gsrv_call_peer(k, peer, sizeof peer);
  ZD_LOG_INFO("control: live resize from %u to %u ranks requested by %s; done after the next step",
              from, q->world_size, peer);
  Zerod__V1__ResizeReply rep = ZEROD__V1__RESIZE_REPLY__INIT;
  rep.world_size = from;
  zd__gsrv_reply(k, &rep.base);
  return ZD_OK;
}

/* ---- buddy copies ------------------------------------------------------------------------- */

/* Buddy copies carry a rank's model state: the control token where there is one, and without one
 * an authenticated channel (TLS) or a unix: address, as for Drain. */
static int copy_allowed(zd__control_t *c, const zd__gsrv_call_t *k, zd__err_t *err) {
  int rc = token_ok(c, k, err);
  if (rc || c->token[0] || zd__grpc_tls_enabled() || !strncmp(c->cfg->control_address, "unix:", 5))
    return rc;
  c->refused++;
  return zd__errf(err, ZD_EDENIED,
                  "%s carries model state, so over TCP it needs a control token "
                  "(control_token_file) or mutual TLS (tls_cert); this zerod has neither",
                  zd__gsrv_call_path(k));
}

static int handle_buddy_put(void *ctx, zd__gsrv_call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  zd__control_t *c = ctx;
  int rc = copy_allowed(c, k, err);
  if (rc) return rc;
  Zerod__V1__BuddyPutReply rep = ZEROD__V1__BUDDY_PUT_REPLY__INIT;
  rc = zd__buddy_put((Zerod__V1__BuddyPutRequest *)*req, &rep.received, err);
  if (rc) return rc;
  zd__gsrv_reply(k, &rep.base);
  return ZD_OK;
}

static int handle_buddy_get(void *ctx, zd__gsrv_call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  zd__control_t *c = ctx;
  int rc = copy_allowed(c, k, err);
  if (rc) return rc;
  Zerod__V1__BuddyGetReply rep = ZEROD__V1__BUDDY_GET_REPLY__INIT;
  Zerod__V1__BuddyCopyInfo info;
  uint8_t *data = NULL;
  rc = zd__buddy_get((Zerod__V1__BuddyGetRequest *)*req, &rep, &info, &data, err);
  if (!rc) zd__gsrv_reply(k, &rep.base);
  free(data);
  return rc;
}

/* ---- drain ---------------------------------------------------------------------------------- */

#define MAX_DRAIN_WAIT_MS (24u * 3600 * 1000)

static void drain_answer(void *arg, const zd__drain_result_t *r) {
  zd__control_t *c = arg;
  zd__gsrv_call_t *k = c->drain_call;
  c->drain_call = NULL;
  if (!k) return; /* the caller left; the drain went on and the log has its end */
  if (r->rc) {
    zd__gsrv_reply_error(k, zd__grpc_status_of(r->rc), "%s", r->msg);
    return;
  }
  Zerod__V1__DrainReply rep = ZEROD__V1__DRAIN_REPLY__INIT;
  rep.checkpointed = r->checkpointed;
  rep.has_step = r->checkpointed;
  rep.step = r->step;
  rep.dir = r->checkpointed ? (char *)r->dir : NULL;
  rep.no_checkpoint = r->checkpointed ? NULL : (char *)r->msg;
  rep.has_lost = !r->checkpointed;
  rep.lost = r->lost;
  rep.has_left = 1;
  rep.left = r->left;
  rep.has_world_size = rep.has_left_after_step = r->left;
  rep.world_size = r->world_size;
  rep.left_after_step = r->step;
  if (r->left) { /* no checkpoint was wanted: the step is the leave's */
    rep.has_step = 0;
    rep.no_checkpoint = NULL;
    rep.has_lost = 0;
  }
  zd__gsrv_reply(k, &rep.base);
}

static void drain_cancelled(void *arg) {
  zd__control_t *c = arg;
  c->drain_call = NULL;
  ZD_LOG_WARN("control: the caller of Drain left before its answer; the drain goes on");
}

/* Drain stops this zerod, so it is never open to whoever reaches a TCP port: it needs the control
 * token where there is one, and without one an authenticated channel (TLS) or a unix: address
 * (whose file mode, socket_mode, admits only the operator's users). */
static int drain_allowed(zd__control_t *c, const zd__gsrv_call_t *k, zd__err_t *err) {
  int rc = token_ok(c, k, err);
  if (rc || c->token[0] || zd__grpc_tls_enabled() || !strncmp(c->cfg->control_address, "unix:", 5))
    return rc;
  char peer[128];
  zd__gsrv_call_peer(k, peer, sizeof peer);
  c->refused++;
  ZD_LOG_WARN(
      "control: refused %s from %s: no control token is configured on a TCP control "
      "address without TLS (%" PRIu64 " refused so far)",
      zd__gsrv_call_path(k), peer, c->refused);
  return zd__errf(err, ZD_EDENIED,
                  "%s stops zerod, so over TCP it needs a control token (control_token_file) or "
                  "mutual TLS (tls_cert); this zerod has neither: set one, or use a unix: "
                  "control_address",
                  zd__gsrv_call_path(k));
}

static int handle_drain(void *ctx, zd__gsrv_call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  zd__control_t *c = ctx;
  Zerod__V1__DrainRequest *r = (Zerod__V1__DrainRequest *)*req;
  int rc = drain_allowed(c, k, err);
  if (rc) return rc;
  if (!r->wait_ms || r->wait_ms > MAX_DRAIN_WAIT_MS)
    return zd__errf(err, -EINVAL, "Drain: wait_ms is %u; expected 1..%u", r->wait_ms,
                    MAX_DRAIN_WAIT_MS);
  if (!c->drain) return zd__errf(err, ZD_EORDER, "this zerod has no ranks yet");
  const char *by = zd__drain_by(c->drain);
  if (by) return zd__errf(err, ZD_EORDER, "a drain asked by %s is already in progress", by);
  grpc_call_error e = zd__gsrv_defer(k, drain_cancelled, c);
  if (e != GRPC_CALL_OK)
    return zd__errf(err, ZD_EINTERNAL, "Drain: cannot watch the call (grpc_call_error %d)", (int)e);
  char peer[128];
  zd__gsrv_call_peer(k, peer, sizeof peer);
  c->drain_call = k;
  rc = zd__drain_start(c->drain, peer, r->wait_ms, r->has_force && r->force,
                       r->has_leave && r->leave, drain_answer, c, err);
  if (rc) { /* deferred already: answered here */
    c->drain_call = NULL;
    zd__gsrv_reply_error(k, zd__grpc_status_of(rc), "%s", err->msg);
  }
  return ZD_OK;
}

/* A unix: control address admits the processes the client socket admits (allowed_uids and
 * allowed_gids), whatever the socket file's mode. */
static int unix_peer_allowed(void *ctx, int fd, const struct ucred *cred) {
  zd__control_t *c = ctx;
  return zd__peer_allowed(c->cfg, fd, cred);
}

static int cmp_node(const void *a, const void *b) {
  const Zerod__V1__NodeInfo *x = *(Zerod__V1__NodeInfo *const *)a;
  const Zerod__V1__NodeInfo *y = *(Zerod__V1__NodeInfo *const *)b;
  return x->first_rank < y->first_rank ? -1 : x->first_rank > y->first_rank;
}

/* Answers Nodes with the registry's entries (any order; kept by the caller) plus this node, which
 * a single-node world never registers, by first rank. Errors: -ENOMEM (not answered). */
static int reply_nodes(zd__control_t *c, zd__gsrv_call_t *k, Zerod__V1__NodeInfo *const *listed,
                       size_t n, zd__err_t *err) {
  Zerod__V1__NodeInfo **nodes = calloc(n + 1, sizeof *nodes);
  if (!nodes) return zd__errf(err, -ENOMEM, "out of memory listing %zu nodes", n);
  int self_listed = 0;
  for (size_t i = 0; i < n; i++) {
    nodes[i] = listed[i];
    self_listed |= listed[i]->first_rank == c->cfg->first_rank;
  }
  Zerod__V1__NodeInfo self = ZEROD__V1__NODE_INFO__INIT;
  self.first_rank = c->cfg->first_rank;
  self.local_ranks = c->cfg->local_ranks;
  self.control_address = (char *)zd__control_address(c);
  if (!self_listed) nodes[n++] = &self;
  qsort(nodes, n, sizeof *nodes, cmp_node);
  Zerod__V1__NodesReply rep = ZEROD__V1__NODES_REPLY__INIT;
  /* the world as it is now: a live resize changes it (the configuration keeps the start's) */
  rep.world_size =
      c->ranks && c->ranks->n ? zd__rank_world_size(c->ranks->rank[0]) : c->cfg->world_size;
  rep.n_nodes = n;
  rep.nodes = nodes;
  zd__gsrv_reply(k, &rep.base);
  free(nodes);
  return ZD_OK;
}

/* Nodes on etcd: any node reads the registry from etcd, on libuv's thread pool (a blocking call
 * of up to NODES_ETCD_MS that must not hold the loop), and answers on the loop thread. */
#define NODES_ETCD_MS 5000

typedef struct nodes_job {
  uv_work_t work;
  zd__control_t *c;
  zd__gsrv_call_t *call;
  int cancelled;                /* the caller left: not answered */
  Zerod__V1__NodesReply *reply; /* the registry, from the pool thread */
  int rc;
  zd__err_t err;
} nodes_job_t;

static void nodes_read(uv_work_t *w) {
  nodes_job_t *j = w->data;
  zd__rdv_t *rdv = NULL;
  j->rc = zd__rdv_open(j->c->cfg->rendezvous, &rdv, &j->err);
  if (!j->rc) j->rc = zd__rdv_nodes(rdv, &j->reply, NODES_ETCD_MS, &j->err);
  zd__rdv_close(rdv);
}

static void nodes_cancelled(void *arg) {
  ((nodes_job_t *)arg)->cancelled = 1;
}

static void nodes_answer(uv_work_t *w, int status) {
  nodes_job_t *j = w->data;
  Zerod__V1__NodesReply *r = j->reply;
  if (j->cancelled) {
    ZD_LOG_WARN("control: the caller of Nodes left before its answer");
  } else if (status || j->rc) {
    zd__gsrv_reply_error(j->call, zd__grpc_status_of(j->rc ? j->rc : ZD_EINTERNAL),
                         "the node registry on %s: %s", j->c->cfg->rendezvous,
                         j->rc ? j->err.msg : "the read was cancelled");
  } else if (reply_nodes(j->c, j->call, r->nodes, r->n_nodes, &j->err)) {
    zd__gsrv_reply_error(j->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s", j->err.msg);
  }
  if (r) protobuf_c_message_free_unpacked(&r->base, NULL);
  zd__gsrv_call_unref(j->call);
  free(j);
}

static int nodes_on_etcd(zd__control_t *c, zd__gsrv_call_t *k, zd__err_t *err) {
  nodes_job_t *j = calloc(1, sizeof *j);
  if (!j) return zd__errf(err, -ENOMEM, "out of memory reading the node registry");
  j->c = c;
  j->call = k;
  j->work.data = j;
  grpc_call_error e = zd__gsrv_defer(k, nodes_cancelled, j);
  if (e != GRPC_CALL_OK) {
    free(j);
    return zd__errf(err, ZD_EINTERNAL, "Nodes: cannot watch the call (grpc_call_error %d)", (int)e);
  }
  zd__gsrv_call_ref(k);
  int uv = uv_queue_work(c->env.loop, &j->work, nodes_read, nodes_answer);
  if (uv) { /* deferred already: answered here */
    zd__gsrv_reply_error(k, GRPC_STATUS_INTERNAL, "Nodes: cannot queue the registry's read: %s",
                         uv_strerror(uv));
    zd__gsrv_call_unref(k);
    free(j);
  }
  return ZD_OK;
}

/* The registry: every "node/<first_rank>" entry of the rendezvous store (rank 0's node serves
 * it), or of etcd (every node serves it), plus this node. Entries that do not decode are skipped
 * with a warning, not fatal to the listing. */
static int handle_nodes(void *ctx, zd__gsrv_call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  (void)req;
  zd__control_t *c = ctx;
  if (zd__etcd_is_url(c->cfg->rendezvous)) return nodes_on_etcd(c, k, err);
  int rc = rank0_only(c, k, err);
  if (rc) return rc;
  size_t first, count = zd__kvstore_prefix(c->store, ZD__RDV_NODE_PREFIX, &first);
  Zerod__V1__NodeInfo **nodes = calloc(count ? count : 1, sizeof *nodes);
  size_t n = 0;
  if (!nodes) {
    rc = zd__errf(err, -ENOMEM, "out of memory listing %zu nodes", count);
    goto exit;
  }
  for (size_t i = first; i < first + count; i++) {
    const char *key;
    const uint8_t *value;
    size_t len;
    zd__kvstore_entry(c->store, i, &key, &value, &len);
    Zerod__V1__NodeInfo *info = zerod__v1__node_info__unpack(NULL, len, value);
    if (!info) {
      ZD_LOG_WARN("control: registry entry '%s' (%zu bytes) is not a NodeInfo; not listed", key,
                  len);
      continue;
    }
    nodes[n++] = info;
  }
  rc = reply_nodes(c, k, nodes, n, err);
exit:
  for (size_t i = 0; nodes && i < n; i++) zerod__v1__node_info__free_unpacked(nodes[i], NULL);
  free(nodes);
  return rc;
}

/* ---- the rendezvous store -------------------------------------------------------------------- */

static int handle_kv_set(void *ctx, zd__gsrv_call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  zd__control_t *c = ctx;
  Zerod__V1__KvSetRequest *r = (Zerod__V1__KvSetRequest *)*req;
  int rc = store_call(c, k, err);
  if (rc || (rc = zd__kvstore_set(c->store, r->key, r->value.data, r->value.len, "KvSet", err)))
    return rc;
  ZD_LOG_DEBUG("control: rendezvous set '%s' (%zu bytes)", r->key, r->value.len);
  Zerod__V1__KvSetReply rep = ZEROD__V1__KV_SET_REPLY__INIT;
  zd__gsrv_reply(k, &rep.base);
  return ZD_OK;
}

static int handle_kv_delete(void *ctx, zd__gsrv_call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  zd__control_t *c = ctx;
  Zerod__V1__KvDeleteRequest *r = (Zerod__V1__KvDeleteRequest *)*req;
  int found = 0, rc = store_call(c, k, err);
  size_t deleted = 0;
  if (rc) return rc;
  if (r->has_prefix && r->prefix) {
    deleted = zd__kvstore_delete_prefix(c->store, r->key);
    found = deleted > 0;
    ZD_LOG_INFO("control: rendezvous freed %zu key(s) under '%s'", deleted, r->key);
  } else {
    if ((rc = zd__kvstore_delete(c->store, r->key, &found, "KvDelete", err))) return rc;
    if (found) ZD_LOG_DEBUG("control: rendezvous deleted '%s'", r->key);
  }
  Zerod__V1__KvDeleteReply rep = ZEROD__V1__KV_DELETE_REPLY__INIT;
  rep.found = found;
  rep.has_deleted = r->has_prefix && r->prefix;
  rep.deleted = (uint32_t)deleted;
  zd__gsrv_reply(k, &rep.base);
  return ZD_OK;
}

static int handle_kv_get(void *ctx, zd__gsrv_call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  zd__control_t *c = ctx;
  Zerod__V1__KvGetRequest *r = (Zerod__V1__KvGetRequest *)*req;
  Zerod__V1__KvGetReply rep = ZEROD__V1__KV_GET_REPLY__INIT;
  const uint8_t *value;
  size_t len;
  int found, rc = store_call(c, k, err);
  if (rc || (rc = zd__kvstore_get(c->store, r->key, &value, &len, &found, "KvGet", err))) return rc;
  rep.found = found;
  if (found) {
    rep.has_value = 1;
    rep.value.data = (uint8_t *)value;
    rep.value.len = len;
  }
  zd__gsrv_reply(k, &rep.base);
  return ZD_OK;
}

/* ok, or not with the keys still missing from keys[from] on. */
static void reply_wait(zd__control_t *c, zd__gsrv_call_t *k, const Zerod__V1__KvWaitRequest *r,
                       size_t from, int ok) {
  Zerod__V1__KvWaitReply rep = ZEROD__V1__KV_WAIT_REPLY__INIT;
  rep.ok = ok;
  char **missing = NULL;
  if (!ok) {
    missing = malloc((r->n_keys ? r->n_keys : 1) * sizeof *missing);
    if (!missing) {
      zd__gsrv_reply_error(k, GRPC_STATUS_RESOURCE_EXHAUSTED, "zerod is out of memory");
      return;
    }
    for (size_t i = from; i < r->n_keys; i++)
      if (!zd__kvstore_has(c->store, r->keys[i])) missing[rep.n_missing++] = r->keys[i];
    rep.missing = missing;
  }
  zd__gsrv_reply(k, &rep.base);
  free(missing);
}

static void on_wait_done(void *arg, int why) {
  kv_wait_t *kw = arg;
  if (why == ZD_ESHUTDOWN)
    zd__gsrv_reply_error(kw->call, GRPC_STATUS_UNAVAILABLE, "zerod at %s is shutting down",
                         zd__control_address(kw->c));
  else
    reply_wait(kw->c, kw->call, kw->req, zd__kv_wait_next(kw->w), why == ZD_OK);
}

/* The client gave up (deadline, disconnect): the wait ends and no reply is sent. */
static void on_wait_cancelled(void *arg) {
  kv_wait_t *kw = arg;
  ZD_LOG_DEBUG("control: a KvWait for %zu keys was cancelled by its client", kw->req->n_keys);
  zd__kv_wait_cancel(kw->w);
}

static void on_wait_closed(void *arg) {
  kv_wait_t *kw = arg;
  zerod__v1__kv_wait_request__free_unpacked(kw->req, NULL);
  zd__gsrv_call_unref(kw->call);
  free(kw);
}

static int handle_kv_wait(void *ctx, zd__gsrv_call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  zd__control_t *c = ctx;
  Zerod__V1__KvWaitRequest *r = (Zerod__V1__KvWaitRequest *)*req;
  int ready, rc = store_call(c, k, err);
  if (rc) return rc;
  kv_wait_t *kw = calloc(1, sizeof *kw);
  if (!kw) return zd__errf(err, -ENOMEM, "KvWait: out of memory for a wait on %zu keys", r->n_keys);
  *kw = (kv_wait_t){.c = c, .call = k, .req = r};
  rc = zd__kvstore_wait(c->store, (const char *const *)r->keys, r->n_keys, r->timeout_ms,
                        on_wait_done, on_wait_closed, kw, &kw->w, &ready, "KvWait", err);
  if (rc || !kw->w) { /* refused, or answered now */
    free(kw);
    if (!rc) reply_wait(c, k, r, 0, ready);
    return rc;
  }
  *req = NULL;          /* the wait owns the request from here on */
  zd__gsrv_call_ref(k); /* until the wait is closed */
  grpc_call_error e = zd__gsrv_defer(k, on_wait_cancelled, kw);
  if (e != GRPC_CALL_OK) {
    zd__kv_wait_cancel(kw->w);
    return zd__errf(err, ZD_EINTERNAL, "KvWait: cannot watch the call (grpc_call_error %d)",
                    (int)e);
  }
  return ZD_OK;
}

/* ---- health ---------------------------------------------------------------------------------- */

static int handle_health(void *ctx, zd__gsrv_call_t *k, ProtobufCMessage **req, zd__err_t *err) {
  zd__control_t *c = ctx;
  Grpc__Health__V1__HealthCheckRequest *r = (Grpc__Health__V1__HealthCheckRequest *)*req;
  const char *svc = r->service ? r->service : "";
  int serving = !c->stopping;
  if (!strcmp(svc, "zerod.ranks")) {
    /* readiness: the node's ranks exist and are healthy; no new trainer during a drain */
    serving = serving && c->ranks && !(c->drain && zd__drain_by(c->drain));
    for (uint32_t i = 0; serving && i < c->ranks->n; i++) {
      zd__rank_stats_t s;
      zd__rank_stats(c->ranks->rank[i], &s);
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
  zd__gsrv_reply(k, &rep.base);
  return ZD_OK;
}

/* ---- the service ----------------------------------------------------------------------------- */

/* The methods served: path, request type, handler, largest request. Nodes and Kv* answer only on
 * the node that hosts global rank 0 (rank0_only), Nodes on every node with an etcd rendezvous. */
static const zd__gsrv_method_t methods[] = {
    {"/zerod.v1.Control/Status", &zerod__v1__node_status_request__descriptor, handle_status, 1024},
    {"/zerod.v1.Control/Nodes", &zerod__v1__nodes_request__descriptor, handle_nodes, 1024},
    {"/zerod.v1.Control/KvSet", &zerod__v1__kv_set_request__descriptor, handle_kv_set,
     MAX_VALUE_BYTES + MAX_KEY_BYTES + 64},
    {"/zerod.v1.Control/KvGet", &zerod__v1__kv_get_request__descriptor, handle_kv_get,
     MAX_KEY_BYTES + 64},
    {"/zerod.v1.Control/KvWait", &zerod__v1__kv_wait_request__descriptor, handle_kv_wait,
     ZD__GRPC_MAX_MESSAGE},
    {"/zerod.v1.Control/KvDelete", &zerod__v1__kv_delete_request__descriptor, handle_kv_delete,
     MAX_KEY_BYTES + 64},
    {"/zerod.v1.Control/Checkpoint", &zerod__v1__request_checkpoint_request__descriptor,
     handle_checkpoint, 1024},
    {"/zerod.v1.Control/Drain", &zerod__v1__drain_request__descriptor, handle_drain, 1024},
    {"/zerod.v1.Control/Resize", &zerod__v1__resize_request__descriptor, handle_resize, 1024},
    {"/zerod.v1.Control/BuddyPut", &zerod__v1__buddy_put_request__descriptor, handle_buddy_put,
     (1u << 20) + 4096},
    {"/zerod.v1.Control/BuddyGet", &zerod__v1__buddy_get_request__descriptor, handle_buddy_get,
     1024},
    {"/grpc.health.v1.Health/Check", &grpc__health__v1__health_check_request__descriptor,
     handle_health, 1024},
};
#define NMETHODS (sizeof methods / sizeof methods[0])

static void on_server_stopped(void *arg) {
  zd__control_t *c = arg;
  void (*done)(void *) = c->done;
  void *ctx = c->done_ctx;
  zd__kvstore_free(c->store);
  free(c);
  ZD_LOG_INFO("control service stopped");
  if (done) done(ctx);
}

void zd__control_serve(zd__control_t *c, const zd__ranks_t *ranks, const zd__sessions_t *sessions,
                       zd__ckptr_t *ckpt, zd__drain_t *drain) {
  c->ranks = ranks;
  c->sessions = sessions;
  c->ckpt = ckpt;
  c->drain = drain;
}

void zd__control_stop(zd__control_t *c, void (*done)(void *ctx), void *ctx) {
  if (c->stopping) return;
  c->stopping = 1;
  c->done = done;
  c->done_ctx = ctx;
  char why[ZD__ERR_MSG_MAX];
  snprintf(why, sizeof why, "zerod at %s is shutting down", zd__control_address(c));
  uint32_t answered = zd__kvstore_shutdown(c->store, why);
  ZD_LOG_INFO("control: shutting down%s", answered ? "; answered the pending KvWait calls" : "");
  zd__gsrv_stop(c->server, on_server_stopped, c);
}

const char *zd__control_address(const zd__control_t *c) {
  return zd__gsrv_address(c->server);
}

const char *zd__control_token(const zd__control_t *c) {
  return c->token;
}

/* Loopback or a unix: socket: reachable from this host only. */
static int local_address(const char *addr) {
  if (!strncmp(addr, "unix:", 5)) return 1;
  const char *host = addr;
  if (!strncmp(host, "ipv4:", 5) || !strncmp(host, "ipv6:", 5)) host += 5;
  return !strncmp(host, "127.", 4) || !strncmp(host, "localhost:", 10) ||
         !strncmp(host, "[::1]:", 6);
}

int zd__control_start(const zd__control_env_t *env, zd__control_t **out, zd__err_t *err) {
  const zd__config_t *conf = env->cfg;
  const char *addr = conf->control_address;
  *out = NULL;
  /* The node's TLS identity serves this service and every channel the node opens later (the
   * ranks' rendezvous clients, the heartbeat): load it before any of them exists. */
  zd__grpc_tls_files_t tls = {.cert = conf->tls_cert,
                              .key = conf->tls_key,
                              .ca = conf->tls_ca,
                              .cert_name = "tls_cert",
                              .key_name = "tls_key",
                              .ca_name = "tls_ca"};
  int rc = zd__grpc_tls_load(&tls, err);
  if (rc) return rc;
  /* Without TLS anyone who reaches the address can call it: beyond this host only when the
   * operator says so, knowing it. */
  if (!local_address(addr) && !conf->control_insecure && !zd__grpc_tls_enabled())
    return zd__errf(err, ZD_ECONFIG,
                    "control_address %s is reachable from other hosts, and the control service "
                    "has no TLS: set tls_cert, tls_key and tls_ca (mutual TLS), or set "
                    "control_insecure = 1 to serve it anyway (with a control_token_file, on a "
                    "network only the job's nodes reach), or listen on 127.0.0.1 or a unix: "
                    "socket",
                    addr);
  zd__control_t *c = calloc(1, sizeof *c);
  if (!c) return zd__errf(err, -ENOMEM, "out of memory starting the control service");
  c->env = *env;
  c->cfg = conf;
  c->serves_kv = conf->first_rank == 0;
  if (conf->control_token_file[0] &&
      (rc = zd__token_load(conf->control_token_file, c->token, err))) {
    free(c);
    return rc;
  }
  if (!(c->store = zd__kvstore_new(env->loop, &kv_limits))) {
    rc = zd__errf(err, -ENOMEM, "out of memory starting the control service");
    goto fail;
  }
  /* A unix socket is created with the client socket's mode (socket_mode). */
  zd__gsrv_config_t cfg = {.loop = env->loop,
                           .address = addr,
                           .address_name = "control_address",
                           .log_name = "control",
                           .socket_mode = conf->socket_mode,
                           .methods = methods,
                           .nmethods = NMETHODS,
                           .ctx = c,
                           .peer_allowed = unix_peer_allowed};
  if ((rc = zd__gsrv_start(&cfg, &c->server, err))) goto fail;
  ZD_LOG_INFO("control service on %s%s%s (gRPC %s)", zd__control_address(c),
              zd__grpc_tls_enabled() ? ", mutual TLS" : "",
              c->serves_kv ? ", with the rendezvous store" : "", grpc_version_string());
  *out = c;
  return ZD_OK;

fail:
  zd__kvstore_free(c->store);
  free(c);
  return rc;
}
