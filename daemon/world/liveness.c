/* Peer liveness (liveness.h): the heartbeat thread. */
#include "liveness.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "control.pb-c.h"
#include "etcd.h"
#include "grpc_unary.h"
#include "health.pb-c.h"
#include "log.h"
#include "rendezvous.h"

typedef struct node {
  uint32_t first_rank;
  uint32_t local_ranks;
  char *address;
  zd__grpc_channel_t *channel;
  uint64_t last_ok_ms;  /* last answer (or when the node was first seen) */
  int reported;         /* dead() was called for this silence */
  uint64_t incarnation; /* the zerod process registered for these ranks (0: unknown) */
  int answered;         /* it answered once */
  int seeded;           /* known from the rendezvous address, not (yet) from the registry: its
                           silence counts only after it answered (a node that is not up yet) */
} node_t;

struct zd__liveness {
  zd__liveness_cfg_t cfg;
  char *rendezvous;
  zd__peer_dead_fn dead;
  void *ctx;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int stop;
  node_t *nodes;
  size_t nnodes;
  /* the newest formation not applied yet (mu): the ranks' processes, world_size of them */
  uint64_t *formed;
  uint32_t formed_size;
};

/* One call may take this long: short enough that a round over a few silent nodes stays near the
 * heartbeat, long enough for a loaded but live node to answer. */
static int call_timeout_ms(const zd__liveness_t *l) {
  uint32_t t = l->cfg.peer_timeout_ms / 2;
  if (t > 2000) t = 2000;
  return t < 50 ? 50 : (int)t;
}

static node_t *find_node(zd__liveness_t *l, uint32_t first_rank) {
  for (size_t i = 0; i < l->nnodes; i++)
    if (l->nodes[i].first_rank == first_rank) return &l->nodes[i];
  return NULL;
}

/* A node registered again with another address (a restarted zerod that rejoined the world), or
 * runs another process: watch the address anew, with a fresh timer. Returns 0, or -1 if the old one
 * is still watched (no channel: the next round tries again). */
static int readdress(node_t *nd, const char *address) {
  zd__grpc_channel_t *ch = NULL;
  zd__err_t err = {0};
  char *copy = strdup(address);
  if (!copy || zd__grpc_channel_open(copy, &ch, &err) != ZD_OK) {
    free(copy);
    return -1;
  }
  ZD_LOG_INFO("heartbeat: watching the node of ranks %u..%u anew at %s", nd->first_rank,
              nd->first_rank + nd->local_ranks - 1, copy);
  zd__grpc_channel_close(nd->channel);
  free(nd->address);
  nd->channel = ch;
  nd->address = copy;
  nd->last_ok_ms = zd__now_ms();
  nd->reported = 0;
  return 0;
}

/* The registry's first word on a node: the process it runs now, which the ranks ignore unless
 * their world formed with another one (a restart before this thread first looked). */
static void first_sight(zd__liveness_t *l, const node_t *nd) {
  if (!nd->incarnation) return;
  char reason[ZD__ERR_MSG_MAX];
  snprintf(reason, sizeof reason,
           "node of ranks %u..%u runs another zerod process than the one this world formed "
           "with (restarted, at %.120s)",
           nd->first_rank, nd->first_rank + nd->local_ranks - 1, nd->address);
  l->dead(l->ctx, nd->first_rank, ZD__VERDICT_REPLACED, nd->incarnation, reason);
}

/* Adds the nodes of the registry not known yet, and follows a node that registered again at
 * another address (a zerod restarted elsewhere rejoins the world under the same ranks). */
static void refresh_nodes(zd__liveness_t *l, zd__rdv_t *rdv) {
  Zerod__V1__NodesReply *rep = NULL;
  zd__err_t err = {0};
  if (zd__rdv_nodes(rdv, &rep, call_timeout_ms(l), &err) != ZD_OK) {
    ZD_LOG_DEBUG("heartbeat: no node registry yet: %s", err.msg);
    return;
  }
  for (size_t i = 0; i < rep->n_nodes; i++) {
    const Zerod__V1__NodeInfo *n = rep->nodes[i];
    if (n->first_rank == l->cfg.first_rank) continue;
    node_t *known = find_node(l, n->first_rank);
    if (known) {
      int seeded = known->seeded; /* the registry's first word on it */
      known->local_ranks = n->local_ranks;
      known->seeded = 0;
      uint64_t inc = n->has_incarnation ? n->incarnation : 0;
      int restarted = inc && known->incarnation && inc != known->incarnation;
      /* a new address, or a new process at the old one: a fresh channel (no reconnect backoff
       * left from the dead process) and a fresh timer */
      int watched = 1;
      if (restarted || strcmp(known->address, n->control_address) != 0)
        watched = readdress(known, n->control_address) == 0;
      /* The timer's silence is the incarnation's: the old one's until the new one is watched. */
      if (inc && watched) known->incarnation = inc;
      if (restarted) {
        char reason[ZD__ERR_MSG_MAX];
        snprintf(reason, sizeof reason,
                 "node of ranks %u..%u restarted (a new zerod process at %.120s)",
                 known->first_rank, known->first_rank + known->local_ranks - 1, known->address);
        ZD_LOG_WARN("heartbeat: %s", reason);
        l->dead(l->ctx, known->first_rank, ZD__VERDICT_REPLACED, inc, reason);
      }
      if (seeded) first_sight(l, known);
      continue;
    }
    node_t *grown = realloc(l->nodes, (l->nnodes + 1) * sizeof *grown);
    if (!grown) break;
    l->nodes = grown;
    node_t *nd = &l->nodes[l->nnodes];
    *nd = (node_t){.first_rank = n->first_rank,
                   .incarnation = n->has_incarnation ? n->incarnation : 0,
                   .local_ranks = n->local_ranks,
                   .address = strdup(n->control_address),
                   .last_ok_ms = zd__now_ms()};
    if (!nd->address || zd__grpc_channel_open(nd->address, &nd->channel, &err) != ZD_OK) {
      free(nd->address);
      break;
    }
    l->nnodes++;
    ZD_LOG_DEBUG("heartbeat: watching node %s (ranks %u..%u)", nd->address, nd->first_rank,
                 nd->first_rank + nd->local_ranks - 1);
    first_sight(l, nd);
  }
  protobuf_c_message_free_unpacked(&rep->base, NULL);
}

static void check_node(zd__liveness_t *l, node_t *n) {
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  req.service = (char *)"";
  ProtobufCMessage *reply = NULL;
  zd__err_t err = {0};
  int rc = zd__grpc_call(n->channel, "/grpc.health.v1.Health/Check", &req.base,
                         &grpc__health__v1__health_check_response__descriptor, &reply,
                         call_timeout_ms(l), 0, NULL, &err);
  if (reply) protobuf_c_message_free_unpacked(reply, NULL);
  uint64_t now = zd__now_ms();
  if (rc == ZD_OK) { /* any answer is life; NOT_SERVING is a node shutting down, still alive */
    if (n->reported) ZD_LOG_WARN("heartbeat: node %s answers again", n->address);
    n->last_ok_ms = now;
    n->reported = 0;
    n->answered = 1;
    return;
  }
  if (n->seeded && !n->answered) n->last_ok_ms = now; /* not up yet: not a silence */
  if (n->reported || now - n->last_ok_ms < l->cfg.peer_timeout_ms) return;
  n->reported = 1;
  char reason[ZD__ERR_MSG_MAX];
  snprintf(reason, sizeof reason,
           "node %.120s (ranks %u..%u) has not answered for %llu ms; peer_timeout_ms is %u: %.100s",
           n->address, n->first_rank, n->first_rank + n->local_ranks - 1,
           (unsigned long long)(now - n->last_ok_ms), l->cfg.peer_timeout_ms, err.msg);
  ZD_LOG_ERROR("heartbeat: %s", reason);
  l->dead(l->ctx, n->first_rank, ZD__VERDICT_SILENT, n->incarnation, reason);
}

/* Sleeps ms unless stopped; returns whether to go on. */
static int pause_ms(zd__liveness_t *l, uint32_t ms) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += ms / 1000;
  until.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&l->mu);
  while (!l->stop && !l->formed && pthread_cond_timedwait(&l->cv, &l->mu, &until) != ETIMEDOUT) {
  }
  int go_on = !l->stop;
  pthread_mutex_unlock(&l->mu);
  return go_on;
}

/* The built-in store lives on the node of rank 0 and its address is that node's control service:
 * that node is watched from the start, before the registry (which it serves) was read, so that its
 * death is seen even when it comes before this thread's first look at the registry (a zerod that
 * joined the world moments ago); the registry then gives its ranks and process. With etcd no node
 * is special: every node comes from the registry. */
static void seed_store_node(zd__liveness_t *l) {
  if (l->cfg.first_rank == 0 || zd__etcd_is_url(l->rendezvous)) return;
  zd__err_t err = {0};
  node_t nd = {.first_rank = 0,
               .local_ranks = 1,
               .address = strdup(l->rendezvous),
               .last_ok_ms = zd__now_ms(),
               .seeded = 1};
  if (!nd.address || !(l->nodes = malloc(sizeof *l->nodes)) ||
      zd__grpc_channel_open(nd.address, &nd.channel, &err) != ZD_OK) {
    free(nd.address);
    free(l->nodes);
    l->nodes = NULL;
    return; /* the registry gives it */
  }
  l->nodes[0] = nd;
  l->nnodes = 1;
}

/* Applies the newest formation (zd__liveness_formed), if one came since the last round. */
static void apply_formed(zd__liveness_t *l) {
  pthread_mutex_lock(&l->mu);
  uint64_t *inc = l->formed;
  uint32_t n = l->formed_size;
  l->formed = NULL;
  pthread_mutex_unlock(&l->mu);
  if (!inc) return;
  uint64_t now = zd__now_ms();
  for (size_t i = 0; i < l->nnodes; i++) {
    node_t *nd = &l->nodes[i];
    if (nd->first_rank >= n || !inc[nd->first_rank]) continue;
    if (inc[nd->first_rank] != nd->incarnation) {
      if (readdress(nd, nd->address) != 0) continue; /* the next formation or round tries again */
      nd->incarnation = inc[nd->first_rank];
    }
    nd->last_ok_ms = now;
    nd->reported = 0;
    nd->seeded = 0; /* it is up: it formed the world with us */
  }
  free(inc);
}

static void *liveness_main(void *arg) {
  zd__liveness_t *l = arg;
  zd__log_set_rank(-1);
  zd__rdv_t *rdv = NULL; /* the built-in store's control service, or etcd */
  zd__err_t err = {0};
  if (zd__rdv_open(l->rendezvous, &rdv, &err) != ZD_OK) {
    ZD_LOG_ERROR("heartbeat: cannot reach the rendezvous service: %s; peers are not watched",
                 err.msg);
    return NULL;
  }
  seed_store_node(l);
  for (int first = 1; first || pause_ms(l, l->cfg.heartbeat_ms); first = 0) {
    refresh_nodes(l, rdv);
    apply_formed(l);
    for (size_t i = 0; i < l->nnodes; i++) {
      pthread_mutex_lock(&l->mu);
      int stop = l->stop;
      pthread_mutex_unlock(&l->mu);
      if (stop) break;
      check_node(l, &l->nodes[i]);
    }
  }
  zd__rdv_close(rdv);
  return NULL;
}

int zd__liveness_start(const zd__liveness_cfg_t *cfg, zd__peer_dead_fn dead, void *ctx,
                       zd__liveness_t **out, zd__err_t *err) {
  zd__liveness_t *l = calloc(1, sizeof *l);
  if (!l) return zd__errf(err, -ENOMEM, "out of memory");
  l->cfg = *cfg;
  l->rendezvous = strdup(cfg->rendezvous_address);
  l->dead = dead;
  l->ctx = ctx;
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->cv, NULL);
  if (!l->rendezvous || pthread_create(&l->thread, NULL, liveness_main, l) != 0) {
    int rc = l->rendezvous ? -EAGAIN : -ENOMEM;
    free(l->rendezvous);
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    free(l);
    return zd__errf(err, rc, "cannot start the heartbeat thread");
  }
  *out = l;
  return ZD_OK;
}

void zd__liveness_formed(zd__liveness_t *l, const uint64_t *incarnations, uint32_t world_size) {
  if (!l || !world_size) return;
  uint64_t *copy = malloc(world_size * sizeof *copy);
  if (!copy) {
    ZD_LOG_WARN(
        "heartbeat: out of memory for the processes of a new world instance; its nodes "
        "are watched as the registry shows them");
    return;
  }
  memcpy(copy, incarnations, world_size * sizeof *copy);
  pthread_mutex_lock(&l->mu);
  free(l->formed);
  l->formed = copy;
  l->formed_size = world_size;
  pthread_cond_signal(&l->cv); /* a round now: the new processes are watched at once */
  pthread_mutex_unlock(&l->mu);
}

void zd__liveness_stop(zd__liveness_t *l) {
  if (!l) return;
  pthread_mutex_lock(&l->mu);
  l->stop = 1;
  pthread_cond_signal(&l->cv);
  pthread_mutex_unlock(&l->mu);
  pthread_join(l->thread, NULL);
  for (size_t i = 0; i < l->nnodes; i++) {
    zd__grpc_channel_close(l->nodes[i].channel);
    free(l->nodes[i].address);
  }
  free(l->nodes);
  free(l->formed);
  free(l->rendezvous);
  pthread_cond_destroy(&l->cv);
  pthread_mutex_destroy(&l->mu);
  free(l);
}
