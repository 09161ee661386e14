/* Drain (drain.h): its state, the timer that watches the checkpoint (or, with leave, the live
 * resize that takes this node's ranks out of the world), its end. */
#include "drain.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt_manifest.h"
#include "clock.h"
#include "log.h"
#include "rendezvous.h"
#include "world.h"

#define DRAIN_POLL_MS 50

struct zd__drain {
  zd__drain_env_t env;
  uv_timer_t timer; /* watches the drain's checkpoint */
  int shutting_down;
  int active;
  int force;
  int want_ckpt;       /* a checkpoint (leave: the leave) was asked for (else: forced with nothing
                          to save or no model to leave with) */
  uint64_t after_step; /* the newest step when it began: the drain's checkpoint is later */
  uint64_t failures;   /* the checkpointer's counts when it began */
  uint64_t completed;
  uint64_t deadline_ms; /* zd__now_ms() */
  uint32_t wait_ms;
  char by[160];
  char no_ckpt[ZD__ERR_MSG_MAX]; /* forced without a checkpoint to take: why */
  int leave;                     /* drain --leave: a live resize takes this node's ranks out */
  uint32_t leave_to;             /* ... to a world of this many ranks */
  uint64_t *resizes;             /* per local rank: its resizes (zd__rank_stats_t) when it began */
  uint64_t t0_ms;
  zd__drain_done_fn done;
  void *done_arg;
};

int zd__drain_create(const zd__drain_env_t *env, zd__drain_t **out) {
  zd__drain_t *d = calloc(1, sizeof *d);
  if (!d) return -ENOMEM;
  d->env = *env;
  int rc = uv_timer_init(env->loop, &d->timer);
  if (rc) {
    free(d);
    return rc;
  }
  d->timer.data = d;
  *out = d;
  return ZD_OK;
}

static void on_closed(uv_handle_t *h) {
  free(h->data);
}

void zd__drain_close(zd__drain_t *d) {
  if (!d) return;
  free(d->resizes);
  d->resizes = NULL;
  uv_close((uv_handle_t *)&d->timer, on_closed);
}

/* Why this node has no optimizer state to save (returns the error code a drain without force
 * gets), or 0 with *step the newest step of its ranks. */
static int nothing_to_checkpoint(const zd__drain_t *d, uint64_t *step, char *why, size_t len) {
  *step = 0;
  if (!zd__ckptr_enabled(d->env.ckpt)) {
    snprintf(why, len, "checkpoint_dir is not set: there is nowhere to save the optimizer state");
    return ZD_ECONFIG;
  }
  uint32_t models = 0;
  for (uint32_t i = 0; i < d->env.ranks->n; i++) {
    zd__rank_stats_t s;
    zd__rank_stats(d->env.ranks->rank[i], &s);
    if (!s.has_model) continue;
    models++;
    if (s.step > *step) *step = s.step;
  }
  if (models) return 0;
  snprintf(why, len,
           "no model is registered on this zerod's ranks: there is no optimizer state to save");
  return ZD_EORDER;
}

/* Whether the checkpoint in dir is complete: the daemon of global rank 0 counts only checkpoints
 * whose manifest it wrote; elsewhere the count is of this node's files, and the manifest, written
 * by rank 0's node into the shared checkpoint_dir, says the rest. */
static int checkpoint_complete(const zd__drain_t *d, const char *dir) {
  if (d->env.cfg->first_rank == 0) return 1;
  char path[600];
  struct stat st;
  snprintf(path, sizeof path, "%s/%s", dir, ZD__CKPT_MANIFEST);
  return stat(path, &st) == 0;
}

static void drain_end(zd__drain_t *d, zd__drain_result_t *res) {
  uv_timer_stop(&d->timer);
  zd__drain_done_fn done = d->done;
  void *arg = d->done_arg;
  d->done = NULL;
  if (d->leave && !res->left)
    for (uint32_t i = 0; i < d->env.ranks->n; i++) zd__rank_withdraw_resize(d->env.ranks->rank[i]);
  if (res->rc) {
    d->active = 0;
    zd__sessions_refuse_registers(d->env.sessions, NULL);
    ZD_LOG_WARN("drain asked by %s given up, zerod goes on serving: %s", d->by, res->msg);
  }
  if (done) done(arg, res);
  if (!res->rc) d->env.shutdown(d->env.ctx);
}

/* "rank 3" or "ranks 3..5", for messages. */
static const char *ranks_text(char *buf, size_t len, uint32_t first, uint32_t last) {
  if (first == last)
    snprintf(buf, len, "rank %u", first);
  else
    snprintf(buf, len, "ranks %u..%u", first, last);
  return buf;
}

/* A leave's end: every local rank left (res->left), or why not ("" still under way). *agreed: a
 * step carried the leave, whose resize has not run on every local rank yet (it runs at the
 * trainers' next request and can no longer be withdrawn). */
static void leave_check(zd__drain_t *d, zd__drain_result_t *res, int *agreed, char *why,
                        size_t len) {
  uint32_t left = 0, kept = 0;
  *agreed = 0;
  char detail[ZD__ERR_MSG_MAX] = "";
  zd__rank_stats_t s;
  *why = 0;
  /* Each rank resizes on its own worker: one may have left while another has not yet run it. A
   * rank that took part in a resize since the drain began and did not leave ends the leave. */
  for (uint32_t i = 0; i < d->env.ranks->n; i++) {
    zd__rank_stats(d->env.ranks->rank[i], &s);
    left += s.left != 0;
    *agreed |= s.resize_agreed == d->leave_to;
    if (!s.left && s.resizes > d->resizes[i] && !kept++)
      snprintf(detail, sizeof detail, "%s",
               s.last_resize[0] ? s.last_resize : "a resize kept them");
    /* The world broke before the resize (a peer lost): the leave cannot ride a step now. */
    if (!s.left && s.health != ZD__HEALTH_OK && !kept++)
      snprintf(detail, sizeof detail, "rank %u is %s%s%.300s",
               zd__rank_global(d->env.ranks->rank[i]), zd__health_name(s.health),
               s.degraded_reason[0] ? ": " : "", s.degraded_reason);
    if (s.step > res->step) res->step = s.step;
  }
  if (left == d->env.ranks->n) {
    res->left = 1;
    res->world_size = d->leave_to;
    return;
  }
  if (kept) {
    snprintf(why, len, "this node's ranks did not leave the world: %.400s", detail);
    return;
  }
  if (zd__now_ms() >= d->deadline_ms && *agreed)
    snprintf(why, len,
             "this node's ranks had not left the world within %u ms, but a step carried the "
             "leave (a live resize to %u ranks), which can no longer be withdrawn: they leave at "
             "their trainers' next request",
             d->wait_ms, d->leave_to);
  else if (zd__now_ms() >= d->deadline_ms)
    snprintf(why, len,
             "this node's ranks had not left the world within %u ms (the live resize rides the "
             "next step of every rank, and they leave at their trainers' next request after it: "
             "are the trainers stepping?)",
             d->wait_ms);
}

/* How long taking the node out of the registry may hold the loop (its ranks have left; zerod
 * shuts down next). */
#define DEREGISTER_TIMEOUT_MS 2000

/* The node's entry leaves the node registry: the world goes on without it, and zeroctl status
 * --world would otherwise list it as unreachable for good. Best effort: a failure is logged. */
static void leave_registry(const zd__drain_t *d) {
  const zd__world_t *w = d->env.world;
  if (!w) return;
  zd__err_t err = {0};
  zd__rdv_t *rdv = NULL;
  char key[48];
  snprintf(key, sizeof key, ZD__RDV_NODE_PREFIX "%u", w->first_rank);
  int rc = zd__rdv_open(w->rendezvous_address, &rdv, &err);
  if (!rc) rc = zd__rdv_set_token(rdv, w->control_token, &err);
  if (!rc) rc = zd__rdv_delete(rdv, key, DEREGISTER_TIMEOUT_MS, &err);
  if (rdv) zd__rdv_close(rdv);
  if (rc)
    ZD_LOG_WARN(
        "drain --leave: could not take this node out of the node registry at %s: %s "
        "(zeroctl status --world lists it unreachable until rank 0's zerod restarts)",
        w->rendezvous_address, err.msg);
  else
    ZD_LOG_INFO("drain --leave: this node (registry key %s) left the node registry", key);
}

static void leave_tick(zd__drain_t *d) {
  zd__drain_result_t res = {0};
  char why[ZD__ERR_MSG_MAX];
  int agreed;
  leave_check(d, &res, &agreed, why, sizeof why);
  char mine[48];
  ranks_text(mine, sizeof mine, d->env.cfg->first_rank,
             d->env.cfg->first_rank + d->env.ranks->n - 1);
  if (res.left) {
    ZD_LOG_INFO("drain --leave: %s left the world after step %" PRIu64
                ", which goes on at %u ranks, %" PRIu64 " ms after the request; shutting down",
                mine, res.step, d->leave_to, zd__now_ms() - d->t0_ms);
    leave_registry(d);
    drain_end(d, &res);
    return;
  }
  if (!why[0]) return;
  res.step = 0;
  if (agreed && !d->force) {
    /* Late, but no longer the drain's to give up: answer now, and shut down once they left. */
    if (!d->done) return;
    res.rc = ZD_EORDER;
    snprintf(res.msg, sizeof res.msg,
             "%.380s; this zerod shuts down once they have left (stopping it sooner loses "
             "them as in a crash)",
             why);
    ZD_LOG_WARN("drain --leave: %s; shutting down once they have left", why);
    zd__drain_done_fn done = d->done;
    d->done = NULL;
    done(d->done_arg, &res);
    return;
  }
  if (d->force) {
    res.lost = 1;
    snprintf(res.msg, sizeof res.msg, "%s", why);
    ZD_LOG_WARN(
        "drain --leave --force: shutting down without leaving: %s; the others lose this "
        "node's ranks as in a crash",
        why);
  } else {
    /* not ZD_EPEER, which zeroctl would take for this zerod being unreachable */
    res.rc = ZD_EORDER;
    snprintf(res.msg, sizeof res.msg,
             "%.380s; the drain is given up and this zerod goes on serving (%s stay in the world)",
             why, mine);
  }
  drain_end(d, &res);
}

static void drain_tick(uv_timer_t *t) {
  zd__drain_t *d = t->data;
  zd__drain_result_t res = {0};
  char why[ZD__ERR_MSG_MAX];
  if (d->leave && d->want_ckpt) {
    leave_tick(d);
    return;
  }
  if (!d->want_ckpt) {
    snprintf(res.msg, sizeof res.msg, "%s", d->no_ckpt);
    ZD_LOG_WARN("drain --force: shutting down without a checkpoint: %s", res.msg);
    drain_end(d, &res);
    return;
  }
  zd__ckpt_stats_t s;
  zd__ckptr_stats(d->env.ckpt, &s);
  if (s.failures > d->failures) {
    snprintf(why, sizeof why, "the checkpoint failed: %.400s", s.last_error);
  } else if (s.completed > d->completed && s.last_ok_step > d->after_step &&
             checkpoint_complete(d, s.last_dir)) {
    res.checkpointed = 1;
    res.step = s.last_ok_step;
    snprintf(res.dir, sizeof res.dir, "%s", s.last_dir);
    ZD_LOG_INFO("drain: checkpoint of step %" PRIu64 " complete in %s; shutting down", res.step,
                res.dir);
    drain_end(d, &res);
    return;
  } else if (zd__now_ms() < d->deadline_ms) {
    return;
  } else {
    snprintf(why, sizeof why,
             "no checkpoint was complete within %u ms (it is taken after the next step of every "
             "rank of the world: are the trainers stepping?)",
             d->wait_ms);
  }
  if (d->force) {
    res.lost = 1;
    snprintf(res.msg, sizeof res.msg, "%s", why);
    ZD_LOG_WARN(
        "drain --force: shutting down without a checkpoint: %s; the steps since the last "
        "complete checkpoint are lost",
        why);
  } else {
    /* not -ETIMEDOUT, which the caller would take for its own deadline */
    res.rc = ZD_ECHECKPOINT;
    snprintf(res.msg, sizeof res.msg, "%s", why);
  }
  drain_end(d, &res);
}

/* Whether this node may leave the world (ZD_OK), and the world it leaves behind; else why not.
 * resizes[i]: local rank i's resizes so far; *none: no model registered (a refusal unless
 * force). */
static int may_leave(const zd__drain_t *d, uint32_t *to, uint64_t *resizes, uint64_t *step,
                     int *none, char *why, size_t len) {
  const zd__ranks_t *rs = d->env.ranks;
  const uint32_t n = rs->n, first = d->env.cfg->first_rank;
  const uint32_t w = zd__rank_world_size(rs->rank[0]);
  uint32_t models = 0, left = 0, sick = n;
  zd__rank_stats_t s;
  char sick_why[ZD__ERR_MSG_MAX] = "";
  *step = 0;
  for (uint32_t i = 0; i < n; i++) {
    zd__rank_stats(rs->rank[i], &s);
    if (s.health != ZD__HEALTH_OK && sick == n) {
      sick = i;
      snprintf(sick_why, sizeof sick_why, "%s%s%.300s", zd__health_name(s.health),
               s.degraded_reason[0] ? ": " : "", s.degraded_reason);
    }
    models += s.has_model != 0;
    left += s.left != 0;
    resizes[i] = s.resizes;
    if (s.step > *step) *step = s.step;
  }
  *none = 0;
  if (left) {
    snprintf(why, len,
             "this node's ranks already left the world (a live resize): there is nothing to hand "
             "over; stop zerod (zeroctl drain --force, or SIGTERM)");
    return ZD_EORDER;
  }
  if (w <= n) {
    snprintf(why, len,
             "there is no world to leave: this zerod holds every rank of the world (%u of %u), so "
             "no other node could take its shards; zeroctl drain without --leave checkpoints the "
             "world and stops zerod",
             n, w);
    return ZD_EORDER;
  }
  if (first + n != w) {
    char mine[48], top[48], above[48];
    snprintf(why, len,
             "this node holds %s of a world of %u: --leave hands over only the highest ranks "
             "(%s here), since a live resize keeps every staying rank's number and %s would have "
             "to be renumbered. Drain the nodes above this one with --leave first (the highest "
             "first), or drain this node without --leave (a checkpoint that the world resumes "
             "from)",
             ranks_text(mine, sizeof mine, first, first + n - 1), w,
             ranks_text(top, sizeof top, w - n, w - 1),
             ranks_text(above, sizeof above, first + n, w - 1));
    return ZD_EORDER;
  }
  *to = w - n;
  if (!models) {
    *none = 1;
    snprintf(why, len,
             "no model is registered on this zerod's ranks: the leave rides the next training "
             "step (the shards go to the other ranks after it), and there is none to ride");
    return ZD_EORDER;
  }
  if (sick < n) {
    snprintf(why, len,
             "rank %u of this node is %.300s; a leave rides a step of a healthy world (wait until "
             "zeroctl status shows every rank ok, or drain without --leave)",
             first + sick, sick_why);
    return ZD_EORDER;
  }
  return ZD_OK;
}

/* Starts the leave (drain.h): every local rank asks for the world without this node. */
static int leave_start(zd__drain_t *d, int force, uint64_t *step, int *none, char *why, size_t len,
                       zd__err_t *err) {
  free(d->resizes);
  d->resizes = calloc(d->env.ranks->n ? d->env.ranks->n : 1, sizeof *d->resizes);
  if (!d->resizes) return zd__errf(err, -ENOMEM, "out of memory");
  int rc = may_leave(d, &d->leave_to, d->resizes, step, none, why, len);
  if (rc && !(*none && force))
    return zd__errf(err, rc, "drain --leave refused: %s%s", why,
                    *none ? " (zeroctl drain --leave --force stops zerod without leaving)" : "");
  if (*none) return ZD_OK;
  for (uint32_t i = 0; !rc && i < d->env.ranks->n; i++)
    rc = zd__rank_request_resize(d->env.ranks->rank[i], d->leave_to, err);
  if (rc)
    for (uint32_t i = 0; i < d->env.ranks->n; i++) zd__rank_withdraw_resize(d->env.ranks->rank[i]);
  return rc;
}

int zd__drain_start(zd__drain_t *d, const char *by, uint32_t wait_ms, int force, int leave,
                    zd__drain_done_fn done, void *arg, zd__err_t *err) {
  if (d->shutting_down) return zd__errf(err, ZD_ESHUTDOWN, "zerod is already shutting down");
  if (d->active)
    return zd__errf(err, ZD_EORDER, "a drain asked by %s is already in progress", d->by);
  char why[ZD__ERR_MSG_MAX];
  uint64_t step = 0;
  int none = 0, rc;
  if (leave) {
    rc = leave_start(d, force, &step, &none, why, sizeof why, err);
  } else {
    none = nothing_to_checkpoint(d, &step, why, sizeof why);
    if (none && !force)
      return zd__errf(err, none,
                      "nothing to checkpoint: %s (zeroctl drain --force stops zerod without a "
                      "checkpoint)",
                      why);
    rc = none ? ZD_OK : zd__ckptr_request(d->env.ckpt, err);
  }
  if (rc) return rc;
  d->leave = leave;
  d->t0_ms = zd__now_ms();
  zd__ckpt_stats_t s = {0};
  if (d->env.ckpt) zd__ckptr_stats(d->env.ckpt, &s);
  d->active = 1;
  d->force = force;
  d->want_ckpt = !none;
  d->after_step = step;
  d->failures = s.failures;
  d->completed = s.completed;
  d->wait_ms = wait_ms;
  d->deadline_ms = zd__now_ms() + wait_ms;
  d->done = done;
  d->done_arg = arg;
  snprintf(d->by, sizeof d->by, "%s", by);
  snprintf(d->no_ckpt, sizeof d->no_ckpt, "%s", none ? why : "");
  zd__sessions_refuse_registers(d->env.sessions, by);
  if (none)
    ZD_LOG_WARN("drain asked by %s (--force): %s", by, why);
  else if (leave)
    ZD_LOG_INFO(
        "drain --leave asked by %s: refusing registrations, live resize to %u ranks "
        "requested after step %" PRIu64
        " (%s of %u leave%s); shutting down once they "
        "have left (waiting at most %u ms%s)",
        by, d->leave_to, step,
        ranks_text(why, sizeof why, d->env.cfg->first_rank,
                   d->env.cfg->first_rank + d->env.ranks->n - 1),
        d->leave_to + d->env.ranks->n, d->env.ranks->n == 1 ? "s" : "", wait_ms,
        force ? ", then shutting down anyway" : "");
  else
    ZD_LOG_INFO(
        "drain asked by %s: refusing registrations, checkpoint requested after step "
        "%" PRIu64 "; shutting down once it is complete (waiting at most %u ms%s)",
        by, step, wait_ms, force ? ", then shutting down anyway" : "");
  uv_timer_start(&d->timer, drain_tick, 0, DRAIN_POLL_MS);
  return ZD_OK;
}

const char *zd__drain_by(const zd__drain_t *d) {
  return d->active ? d->by : NULL;
}

void zd__drain_shutdown(zd__drain_t *d) {
  d->shutting_down = 1;
  uv_timer_stop(&d->timer);
  if (!d->done) return;
  zd__drain_result_t res = {.rc = ZD_ESHUTDOWN};
  if (d->leave) /* a step in flight must not carry the leave of a zerod going away */
    for (uint32_t i = 0; i < d->env.ranks->n; i++) zd__rank_withdraw_resize(d->env.ranks->rank[i]);
  snprintf(
      res.msg, sizeof res.msg, "zerod began to shut down for another reason (a signal) before %s",
      d->leave ? "this node's ranks had left the world" : "the drain's checkpoint was complete");
  zd__drain_done_fn done = d->done;
  d->done = NULL;
  done(d->done_arg, &res);
}

void zd__drain_status(void *ctx, zd__status_t *st) {
  const zd__drain_t *d = ctx;
  zd__status_section(st, "server");
  zd__status_add(st, "draining", "%d", d->active);
}
