/* The daemon's state, loop, start-up and shutdown (daemon.h). */
#include "daemon.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "adam.h"
#include "checkpoint.h"
#include "checkpoint_format.h"
#include "clock.h"
#include "comm.h"
#include "control.h"
#include "grpc_unary.h"
#include "liveness.h"
#include "log.h"
#include "metrics.h"
#include "server.h"
#include "session.h"
#include "world.h"
#ifdef ZD_HAVE_CUDA
#include "adam_cuda.h"
#include "cuda_check.h"
#endif

struct zd__daemon {
  uv_loop_t loop;
  const zd__config_t *cfg;
  uint32_t world_size;
  uint64_t bucket_elems;
  int isa; /* zd__isa_t of the CPU kernels */
  zd__pool_t *pool;
  zd__backend_t backend;
  /* Why the CUDA backend is not used when it was not asked for ("" when it is, or was refused
   * by configuration): for the start-up log and the status. */
  char backend_note[ZD__ERR_MSG_MAX];
  zd__gpu_info_t *gpus; /* CUDA backend: the GPU of each local rank (local rank i: device i) */
  zd__world_t world;    /* how ranks join a multi-rank world */
  uint32_t nranks;
  zd__rank_t **ranks;

  zd__sessions_t *sessions;    /* the clients, and which one holds each local rank */
  zd__server_t *server;        /* the listening socket */
  zd__control_t *control;      /* gRPC control service; NULL once stopped */
  struct zd__liveness *peers;  /* the heartbeat of the other nodes; NULL in a one-node world */
  struct zd__metrics *metrics; /* Prometheus endpoint (metrics.h); NULL when off or stopped */
  zd__ckptr_t *ckpt;           /* checkpoints (checkpoint.h); outlives the ranks */
  uv_timer_t ckpt_timer;       /* checkpoint_every_seconds */

  uv_timer_t shutdown_timer; /* aborts collectives that hold a shutdown too long */
  uv_signal_t sigterm;
  uv_signal_t sigint;
  uv_async_t done_async;
  pthread_mutex_t done_lock;
  zd__job_t *done_head; /* finished jobs from the workers, in completion order */
  zd__job_t *done_tail;
  int shutting_down;
  int handles_closed;
  uint64_t busy_until_ns; /* the loop polls without sleeping until then (uv_hrtime) */
  int polling;            /* the loop's current pass did not sleep (busy_until_ns) */

  uv_signal_t sighup;
  uv_timer_t summary_timer; /* the connection summary (connection_summary) */
  uint64_t summary_clients; /* clients_total at the last summary */
  uint64_t summary_dropped; /* connections_dropped at the last summary */
  uv_timer_t notify_timer;  /* systemd: WATCHDOG=1 and STATUS= (notify_systemd) */
  int watchdog;             /* the unit has WatchdogSec: send WATCHDOG=1 too */

  /* zeroctl drain (zd__daemon_drain): one at a time */
  struct {
    int active;
    int force;
    int want_ckpt;       /* a checkpoint was asked for (else: forced with nothing to save) */
    uint64_t after_step; /* the newest step when it began: the drain's checkpoint is later */
    uint64_t failures;   /* the checkpointer's counts when it began */
    uint64_t completed;
    uint64_t deadline_ms; /* zd__now_ms() */
    uint32_t wait_ms;
    char by[160];
    char no_ckpt[ZD__ERR_MSG_MAX]; /* forced without a checkpoint to take: why */
    zd__drain_done_fn done;
    void *done_arg;
  } drain;
  uv_timer_t drain_timer; /* watches the drain's checkpoint */

  uint64_t start_us;
};

/* systemd's readiness protocol (Type=notify): one datagram to $NOTIFY_SOCKET; nothing without it.
 */
static void sd_notify(const char *state) {
  const char *path = getenv("NOTIFY_SOCKET");
  if (!path || (path[0] != '/' && path[0] != '@')) return;
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  size_t len = strlen(path);
  if (len >= sizeof addr.sun_path) return;
  memcpy(addr.sun_path, path, len);
  if (path[0] == '@') addr.sun_path[0] = '\0'; /* abstract namespace */
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&addr,
         (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len));
  close(fd);
}

/* Worker thread: hand a finished job to the loop. */
static void job_done(void *ctx, zd__job_t *job) {
  zd__daemon_t *d = ctx;
  if (job->session) zd__session_answer_early(job); /* the client need not wait for the loop */
  job->next = NULL;
  pthread_mutex_lock(&d->done_lock);
  if (d->done_tail)
    d->done_tail->next = job;
  else
    d->done_head = job;
  d->done_tail = job;
  pthread_mutex_unlock(&d->done_lock);
  uv_async_send(&d->done_async);
}

static void on_jobs_done(uv_async_t *handle) {
  zd__daemon_t *d = handle->data;
  pthread_mutex_lock(&d->done_lock);
  zd__job_t *job = d->done_head;
  d->done_head = d->done_tail = NULL;
  pthread_mutex_unlock(&d->done_lock);
  while (job) {
    zd__job_t *next = job->next;
    zd__session_job_done(job->session, job);
    job = next;
  }
}

static void on_signal(uv_signal_t *handle, int signum) {
  zd__daemon_t *d = handle->data;
  if (d->shutting_down) {
    ZD_LOG_WARN("%s again: still waiting for %u sessions to finish their jobs", strsignal(signum),
                zd__sessions_open(d->sessions));
    return;
  }
  ZD_LOG_INFO("%s: shutting down", strsignal(signum));
  zd__daemon_shutdown(d);
}

/* SIGHUP (a closed terminal, an operator's `systemctl reload`): never fatal, since the optimizer
 * state lives only here. zerod re-reads its configuration the way it was loaded and applies what
 * can change at run time (log_level, and the contents of the TLS files); a changed setting that
 * needs a restart is named in the log.
 * The log is stderr, which journald or the container runtime owns: there is no file to reopen. */
typedef struct setting_values {
  const char *names[ZD__CONFIG_MAX_SETTINGS];
  char *values[ZD__CONFIG_MAX_SETTINGS];
  size_t n;
} setting_values_t;

static void collect_setting(void *ctx, const char *name, const char *value, const char *source) {
  setting_values_t *sv = ctx;
  (void)source;
  if (sv->n < ZD__CONFIG_MAX_SETTINGS) {
    sv->names[sv->n] = name;
    sv->values[sv->n++] = strdup(value);
  }
}

static void reload_config(zd__daemon_t *d) {
  zd__config_t next;
  zd__err_t err = {0};
  int rc = zd__config_load(&next, d->cfg->argc, d->cfg->argv, NULL, &err);
  if (rc != ZD__CONFIG_RUN) {
    ZD_LOG_WARN("SIGHUP: configuration not reloaded, the running one stays: %s",
                rc < 0 ? err.msg : "unexpected --help or --version");
    return;
  }
  setting_values_t before = {0}, after = {0};
  zd__config_visit(d->cfg, collect_setting, &before);
  zd__config_visit(&next, collect_setting, &after);
  int changed = 0;
  for (size_t i = 0; i < before.n && i < after.n; i++) {
    if (!before.values[i] || !after.values[i] || !strcmp(before.values[i], after.values[i]))
      continue;
    changed++;
    if (!strcmp(before.names[i], "log_level")) {
      zd__log_level = zd__log_parse_level(after.values[i]);
      ZD_LOG_WARN("SIGHUP: log_level is now %s (was %s)", after.values[i], before.values[i]);
    } else {
      ZD_LOG_WARN("SIGHUP: %s changed to %s (running with %s until a restart)", before.names[i],
                  after.values[i], before.values[i]);
    }
  }
  if (!changed) ZD_LOG_INFO("SIGHUP: configuration re-read, nothing changed");
  for (size_t i = 0; i < before.n; i++) free(before.values[i]);
  for (size_t i = 0; i < after.n; i++) free(after.values[i]);
  zd__config_free(&next);
}

/* Certificates rotated in place (cert-manager renews them every few weeks): the files of tls_cert,
 * tls_key and tls_ca are read again, and new handshakes and new channels to other zerods use
 * them. A pair that does not check out keeps the running one. */
static void reload_tls(zd__daemon_t *d) {
  const zd__config_t *cfg = d->cfg;
  zd__grpc_tls_files_t files = {.cert = cfg->tls_cert,
                                .key = cfg->tls_key,
                                .ca = cfg->tls_ca,
                                .cert_name = "tls_cert",
                                .key_name = "tls_key",
                                .ca_name = "tls_ca"};
  zd__err_t err = {0};
  int changed = 0;
  if (zd__grpc_tls_reload(&files, &changed, &err) != ZD_OK)
    ZD_LOG_WARN("SIGHUP: TLS certificates not reloaded, the running ones stay: %s", err.msg);
  else if (changed)
    ZD_LOG_WARN("SIGHUP: TLS certificates reloaded from %s, %s and %s: new connections use them",
                cfg->tls_cert, cfg->tls_key, cfg->tls_ca);
}

static void on_sighup(uv_signal_t *handle, int signum) {
  (void)signum;
  reload_config(handle->data);
  reload_tls(handle->data);
}

/* Connections are logged at debug only (any local process can open thousands): this line says at
 * info, at most once a minute and only when something happened, how many came and how many
 * zerod closed, with the last reason. */
#define SUMMARY_MS 60000

static void connection_summary(uv_timer_t *t) {
  zd__daemon_t *d = t->data;
  const zd__session_counters_t *n = zd__sessions_counters(d->sessions);
  uint64_t came = n->clients_total - d->summary_clients;
  uint64_t dropped = n->connections_dropped - d->summary_dropped;
  if (!came && !dropped) return;
  if (dropped)
    ZD_LOG_INFO("connections in the last %d s: %" PRIu64 " new, %" PRIu64
                " closed by zerod after an error (totals: %" PRIu64 " denied, %" PRIu64
                " over a limit, %" PRIu64 " without hello); last: %s",
                SUMMARY_MS / 1000, came, dropped, n->clients_denied, n->clients_refused,
                n->clients_timed_out, n->last_drop);
  else
    ZD_LOG_INFO("connections in the last %d s: %" PRIu64 " new, %u open", SUMMARY_MS / 1000, came,
                zd__sessions_open(d->sessions));
  d->summary_clients = n->clients_total;
  d->summary_dropped = n->connections_dropped;
}

/* Under systemd (Type=notify): STATUS= with the step and health of the ranks, for `systemctl
 * status`, and WATCHDOG=1 when the unit has WatchdogSec. Both are sent from the loop, so a loop
 * that hangs stops them and systemd restarts zerod; a rank busy for minutes does not. */
static void notify_systemd(uv_timer_t *t) {
  zd__daemon_t *d = t->data;
  uint32_t ok = 0, degraded = 0;
  uint64_t step = 0;
  for (uint32_t i = 0; i < d->nranks; i++) {
    zd__rank_stats_t s;
    zd__rank_stats(d->ranks[i], &s);
    ok += s.health == ZD__HEALTH_OK;
    degraded += s.health == ZD__HEALTH_DEGRADED;
    if (s.has_model && s.step > step) step = s.step;
  }
  char msg[256];
  snprintf(msg, sizeof msg, "%sSTATUS=%u of %u local rank(s) ok%s, step %" PRIu64,
           d->watchdog ? "WATCHDOG=1\n" : "", ok, d->nranks,
           degraded ? " (degraded: see zeroctl status)" : "", step);
  sd_notify(msg);
}

/* The period of notify_systemd: half the watchdog interval systemd gives (WATCHDOG_USEC, for this
 * process: WATCHDOG_PID), else 10 s for STATUS= alone; 0 outside systemd. *watchdog says which. */
static uint64_t notify_period_ms(int *watchdog) {
  *watchdog = 0;
  if (!getenv("NOTIFY_SOCKET")) return 0;
  const char *usec = getenv("WATCHDOG_USEC"), *pid = getenv("WATCHDOG_PID");
  if (usec && (!pid || strtol(pid, NULL, 10) == (long)getpid())) {
    unsigned long long us = strtoull(usec, NULL, 10);
    if (us >= 2000) {
      *watchdog = 1;
      return us / 2000;
    }
  }
  return 10000;
}

static void stop_ranks(zd__daemon_t *d) {
  zd__liveness_stop(d->peers); /* it may call into the ranks */
  d->peers = NULL;
  for (uint32_t i = 0; i < d->nranks; i++) zd__rank_destroy(d->ranks[i]);
  d->nranks = 0;
  zd__ckptr_destroy(d->ckpt); /* after the ranks: their snapshots are queued, then written */
  d->ckpt = NULL;
}

static void checkpoint_tick(uv_timer_t *t) {
  zd__daemon_t *d = t->data;
  zd__ckptr_tick(d->ckpt, zd__now_ms());
}

static int create_checkpointer(zd__daemon_t *d, zd__err_t *err) {
  const zd__config_t *cfg = d->cfg;
  zd__ckpt_settings_t set = {.dir = cfg->checkpoint_dir,
                             .every_steps = cfg->checkpoint_every_steps,
                             .every_seconds = cfg->checkpoint_every_seconds,
                             .keep = cfg->checkpoint_keep,
                             .resume = cfg->resume,
                             .throttle_bytes_per_s = cfg->checkpoint_throttle_bytes_per_s,
                             .timeout_ms = (int)cfg->collective_timeout_ms};
  if (cfg->checkpoint_dir[0]) {
    struct stat st;
    if (stat(cfg->checkpoint_dir, &st) != 0 || !S_ISDIR(st.st_mode))
      ZD_LOG_WARN("checkpoint_dir %s is not a directory (yet): checkpoints fail until it is",
                  cfg->checkpoint_dir);
  }
  int rc =
      zd__ckptr_create(&set, d->world_size > 1 ? &d->world : NULL, cfg->local_ranks, &d->ckpt, err);
  if (!rc && cfg->checkpoint_dir[0] && cfg->checkpoint_every_seconds)
    uv_timer_start(&d->ckpt_timer, checkpoint_tick, 1000, 1000);
  return rc;
}

/* ---- drain --------------------------------------------------------------------------------- */

#define DRAIN_POLL_MS 50

/* Why this node has no optimizer state to save (returns the error code a drain without force
 * gets), or 0 with *step the newest step of its ranks. */
static int nothing_to_checkpoint(zd__daemon_t *d, uint64_t *step, char *why, size_t len) {
  *step = 0;
  if (!zd__ckptr_enabled(d->ckpt)) {
    snprintf(why, len, "checkpoint_dir is not set: there is nowhere to save the optimizer state");
    return ZD_ECONFIG;
  }
  uint32_t models = 0;
  for (uint32_t i = 0; i < d->nranks; i++) {
    zd__rank_stats_t s;
    zd__rank_stats(d->ranks[i], &s);
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
static int checkpoint_complete(const zd__daemon_t *d, const char *dir) {
  if (d->cfg->first_rank == 0) return 1;
  char path[600];
  struct stat st;
  snprintf(path, sizeof path, "%s/%s", dir, ZD__CKPT_MANIFEST);
  return stat(path, &st) == 0;
}

static void drain_end(zd__daemon_t *d, zd__drain_result_t *res) {
  uv_timer_stop(&d->drain_timer);
  zd__drain_done_fn done = d->drain.done;
  void *arg = d->drain.done_arg;
  d->drain.done = NULL;
  if (res->rc) {
    d->drain.active = 0;
    ZD_LOG_WARN("drain asked by %s given up, zerod goes on serving: %s", d->drain.by, res->msg);
  }
  if (done) done(arg, res);
  if (!res->rc) zd__daemon_shutdown(d);
}

static void drain_tick(uv_timer_t *t) {
  zd__daemon_t *d = t->data;
  zd__drain_result_t res = {0};
  char why[ZD__ERR_MSG_MAX];
  if (!d->drain.want_ckpt) {
    snprintf(res.msg, sizeof res.msg, "%s", d->drain.no_ckpt);
    ZD_LOG_WARN("drain --force: shutting down without a checkpoint: %s", res.msg);
    drain_end(d, &res);
    return;
  }
  zd__ckpt_stats_t s;
  zd__ckptr_stats(d->ckpt, &s);
  if (s.failures > d->drain.failures) {
    snprintf(why, sizeof why, "the checkpoint failed: %.400s", s.last_error);
  } else if (s.completed > d->drain.completed && s.last_ok_step > d->drain.after_step &&
             checkpoint_complete(d, s.last_dir)) {
    res.checkpointed = 1;
    res.step = s.last_ok_step;
    snprintf(res.dir, sizeof res.dir, "%s", s.last_dir);
    ZD_LOG_INFO("drain: checkpoint of step %" PRIu64 " complete in %s; shutting down", res.step,
                res.dir);
    drain_end(d, &res);
    return;
  } else if (zd__now_ms() < d->drain.deadline_ms) {
    return;
  } else {
    snprintf(why, sizeof why,
             "no checkpoint was complete within %u ms (it is taken after the next step of every "
             "rank of the world: are the trainers stepping?)",
             d->drain.wait_ms);
  }
  if (d->drain.force) {
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

int zd__daemon_drain(zd__daemon_t *d, const char *by, uint32_t wait_ms, int force,
                     zd__drain_done_fn done, void *arg, zd__err_t *err) {
  if (d->shutting_down) return zd__errf(err, ZD_ESHUTDOWN, "zerod is already shutting down");
  if (d->drain.active)
    return zd__errf(err, ZD_EORDER, "a drain asked by %s is already in progress", d->drain.by);
  char why[ZD__ERR_MSG_MAX];
  uint64_t step;
  int none = nothing_to_checkpoint(d, &step, why, sizeof why);
  if (none && !force)
    return zd__errf(err, none,
                    "nothing to checkpoint: %s (zeroctl drain --force stops zerod without a "
                    "checkpoint)",
                    why);
  int rc = none ? ZD_OK : zd__ckptr_request(d->ckpt, err);
  if (rc) return rc;
  zd__ckpt_stats_t s = {0};
  if (d->ckpt) zd__ckptr_stats(d->ckpt, &s);
  memset(&d->drain, 0, sizeof d->drain);
  d->drain.active = 1;
  d->drain.force = force;
  d->drain.want_ckpt = !none;
  d->drain.after_step = step;
  d->drain.failures = s.failures;
  d->drain.completed = s.completed;
  d->drain.wait_ms = wait_ms;
  d->drain.deadline_ms = zd__now_ms() + wait_ms;
  d->drain.done = done;
  d->drain.done_arg = arg;
  snprintf(d->drain.by, sizeof d->drain.by, "%s", by);
  if (none) snprintf(d->drain.no_ckpt, sizeof d->drain.no_ckpt, "%s", why);
  if (none)
    ZD_LOG_WARN("drain asked by %s (--force): %s", by, why);
  else
    ZD_LOG_INFO(
        "drain asked by %s: refusing registrations, checkpoint requested after step "
        "%" PRIu64 "; shutting down once it is complete (waiting at most %u ms%s)",
        by, step, wait_ms, force ? ", then shutting down anyway" : "");
  uv_timer_start(&d->drain_timer, drain_tick, 0, DRAIN_POLL_MS);
  return ZD_OK;
}

const char *zd__daemon_draining(const zd__daemon_t *d) {
  return d->drain.active ? d->drain.by : NULL;
}

/* The last step of a shutdown: no session, so no job is left anywhere, and the control service
 * is down. */
static void finish(zd__daemon_t *d) {
  if (d->handles_closed || (d->sessions && zd__sessions_open(d->sessions) > 0) || d->control)
    return;
  d->handles_closed = 1;
  stop_ranks(d);
  uv_close((uv_handle_t *)&d->shutdown_timer, NULL);
  uv_close((uv_handle_t *)&d->sigterm, NULL);
  uv_close((uv_handle_t *)&d->sigint, NULL);
  uv_close((uv_handle_t *)&d->sighup, NULL);
  uv_close((uv_handle_t *)&d->summary_timer, NULL);
  uv_close((uv_handle_t *)&d->notify_timer, NULL);
  uv_close((uv_handle_t *)&d->ckpt_timer, NULL);
  uv_close((uv_handle_t *)&d->drain_timer, NULL);
  uv_close((uv_handle_t *)&d->done_async, NULL);
  /* Closing the handles restored the default action; a repeated signal now must not turn a clean
   * exit into a death by signal. Nothing is left to wait for. */
  signal(SIGTERM, SIG_IGN);
  signal(SIGINT, SIG_IGN);
  signal(SIGHUP, SIG_IGN);
}

static void control_stopped(zd__daemon_t *d) {
  d->control = NULL;
  finish(d);
}

/* The jobs in flight did not finish within shutdown_timeout_ms: some collective waits for a peer
 * that stays silent. Abort the collectives; their steps fail, their sessions close. */
static void on_shutdown_timeout(uv_timer_t *t) {
  zd__daemon_t *d = t->data;
  ZD_LOG_WARN(
      "still waiting for %u session(s) %u ms after the shutdown began: aborting the "
      "collectives in progress",
      zd__sessions_open(d->sessions), d->cfg->shutdown_timeout_ms);
  for (uint32_t i = 0; i < d->nranks; i++) zd__rank_abort(d->ranks[i]);
}

void zd__daemon_shutdown(zd__daemon_t *d) {
  if (d->shutting_down) return;
  d->shutting_down = 1;
  sd_notify("STOPPING=1");
  uv_timer_stop(&d->drain_timer);
  if (d->drain
          .done) { /* a signal came first: the drain's caller hears it before the service goes */
    zd__drain_result_t res = {.rc = ZD_ESHUTDOWN};
    snprintf(res.msg, sizeof res.msg,
             "zerod began to shut down for another reason (a signal) before the drain's "
             "checkpoint was complete");
    zd__drain_done_fn done = d->drain.done;
    d->drain.done = NULL;
    done(d->drain.done_arg, &res);
  }
  zd__metrics_stop(&d->metrics);
  if (d->server) zd__server_stop(d->server);
  for (uint32_t i = 0; i < d->nranks; i++) zd__rank_cancel(d->ranks[i]); /* no long waits now */
  zd__ckptr_cancel(d->ckpt);
  if (d->cfg->shutdown_timeout_ms)
    uv_timer_start(&d->shutdown_timer, on_shutdown_timeout, d->cfg->shutdown_timeout_ms, 0);
  if (d->control) zd__control_stop(d->control, control_stopped);
  if (d->sessions) zd__sessions_drain(d->sessions);
  finish(d);
}

void zd__daemon_session_gone(zd__daemon_t *d) {
  if (d->shutting_down) finish(d);
}

static int create_ranks(zd__daemon_t *d, zd__err_t *err) {
  const zd__config_t *cfg = d->cfg;
  d->nranks = 0;
  d->ranks = calloc(cfg->local_ranks, sizeof *d->ranks);
  if (!d->ranks) return zd__errf(err, -ENOMEM, "out of memory");
  /* On rank 0's node the store is our own control service, at the address it actually bound. */
  const char *rendezvous =
      cfg->first_rank == 0 && strcmp(cfg->rendezvous_address, cfg->control_address) == 0
          ? zd__control_address(d->control)
          : cfg->rendezvous_address;
  d->world = (zd__world_t){.world_size = d->world_size,
                           .first_rank = cfg->first_rank,
                           .local_ranks = cfg->local_ranks,
                           .collective_timeout_ms = (int)cfg->collective_timeout_ms,
                           .connect_timeout_ms = (int)cfg->connect_timeout_ms};
  snprintf(d->world.rendezvous_address, sizeof d->world.rendezvous_address, "%s", rendezvous);
  snprintf(d->world.control_address, sizeof d->world.control_address, "%s",
           zd__control_address(d->control));
  snprintf(d->world.collective_host, sizeof d->world.collective_host, "%s", cfg->collective_host);
  snprintf(d->world.control_token, sizeof d->world.control_token, "%s",
           zd__control_token(d->control));
  if (getrandom(&d->world.incarnation, sizeof d->world.incarnation, 0) !=
      (ssize_t)sizeof d->world.incarnation)
    d->world.incarnation = zd__now_us() ^ ((uint64_t)getpid() << 40);
  int crc = create_checkpointer(d, err);
  if (crc) return crc;
  for (uint32_t i = 0; i < cfg->local_ranks; i++) {
    /* A one-rank world needs no peers; a larger one is joined by each rank's worker. The CUDA
     * backend's communicator (NCCL, even for one rank) is made by the worker, on its device. */
    zd__comm_t *comm = NULL;
    int rc =
        d->world_size == 1 && d->backend == ZD__BACKEND_CPU ? zd__comm_local_create(&comm) : ZD_OK;
    if (rc) return zd__errf(err, rc, "cannot create the communicator of local rank %u", i);
    zd__rank_env_t env = {
        .local_rank = i,
        .local_ranks = cfg->local_ranks,
        .rank = cfg->first_rank + i,
        .world_size = d->world_size,
        .bucket_elems = d->bucket_elems,
        .comm = comm,
        .world = &d->world,
        .pool = d->pool,
        .ckpt = d->ckpt,
        .isa = d->isa,
        .device = d->backend == ZD__BACKEND_CUDA ? d->gpus[i].device : -1,
        .done = job_done,
        .done_ctx = d,
    };
    rc = zd__rank_create(&env, &d->ranks[i]);
    if (rc) {
      zd__comm_destroy(comm);
      return zd__errf(err, rc, "cannot start the worker of local rank %u: %s", i, zd_strerror(rc));
    }
    d->nranks++;
  }
  return ZD_OK;
}

/* The heartbeat thread found a node dead: fail the collectives that wait for it, now. */
static void peer_dead(void *ctx, uint32_t first_rank, zd__verdict_t verdict, uint64_t incarnation,
                      const char *reason) {
  zd__daemon_t *d = ctx;
  for (uint32_t i = 0; i < d->nranks; i++)
    zd__rank_peer_dead(d->ranks[i], first_rank, verdict, incarnation, reason);
}

/* Other nodes of the world are watched by a heartbeat (liveness.h); a one-node world has none. */
static int watch_peers(zd__daemon_t *d, zd__err_t *err) {
  if (d->world_size <= d->cfg->local_ranks) return ZD_OK;
  zd__liveness_cfg_t cfg = {.rendezvous_address = d->world.rendezvous_address,
                            .first_rank = d->cfg->first_rank,
                            .heartbeat_ms = d->cfg->heartbeat_ms,
                            .peer_timeout_ms = d->cfg->peer_timeout_ms};
  return zd__liveness_start(&cfg, peer_dead, d, &d->peers, err);
}

static int choose_isa(const zd__config_t *cfg, int *isa, zd__err_t *err) {
  int want = zd__isa_parse(cfg->kernel_isa);
  zd__isa_t best = zd__isa_detect();
  if (want < 0)
    return zd__errf(err, ZD_ECONFIG,
                    "kernel_isa '%s' unknown; expected auto, avx512bf16, avx512, "
                    "avx2 or scalar",
                    cfg->kernel_isa);
  if (want > (int)best)
    return zd__errf(err, ZD_ECONFIG,
                    "kernel_isa %s is not supported by this CPU; the best it "
                    "runs is %s",
                    cfg->kernel_isa, zd__isa_name(best));
  *isa = want;
  return ZD_OK;
}

const char *zd__backend_name(zd__backend_t backend) {
  return backend == ZD__BACKEND_CUDA ? "cuda" : "cpu";
}

/* Whether the CUDA backend can serve every local rank, one GPU each (local rank i on CUDA device
 * i, after CUDA_VISIBLE_DEVICES); if not, why, and whether some GPU is visible at all (which
 * makes a fallback worth a warning rather than a note). Fills d->gpus when it can. */
static int cuda_usable(zd__daemon_t *d, char *why, size_t len, int *visible) {
  *visible = 0;
#ifdef ZD_HAVE_CUDA
  uint32_t n = d->cfg->local_ranks;
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) *visible = 1;
  (void)cudaGetLastError();
  if (zd__cuda_available(why, len) == 0) return 0;
  zd__err_t e = {0};
  for (uint32_t i = 0; i < n; i++) {
    if (zd__cuda_device_check((int)i, &e) != ZD_OK) {
      snprintf(why, len,
               "local rank %u needs GPU %u (one GPU per local rank; local_ranks is %u): "
               "%.150s",
               i, i, n, e.msg);
      return 0;
    }
  }
  d->gpus = calloc(n, sizeof *d->gpus);
  if (!d->gpus) {
    snprintf(why, len, "out of memory");
    return 0;
  }
  for (uint32_t i = 0; i < n; i++) {
    if (zd__cuda_gpu_info((int)i, &d->gpus[i], &e) != ZD_OK) {
      snprintf(why, len, "GPU %u: %.200s", i, e.msg);
      free(d->gpus);
      d->gpus = NULL;
      return 0;
    }
  }
  return 1;
#else
  (void)d;
  snprintf(why, len, "this zerod was built without CUDA");
  return 0;
#endif
}

/* backend cpu, cuda, or auto: CUDA when this build has it and every local rank has a usable GPU,
 * else the CPU backend with one log line saying why not. */
static int choose_backend(zd__daemon_t *d, zd__err_t *err) {
  const char *want = d->cfg->backend;
  d->backend = ZD__BACKEND_CPU;
  if (strcmp(want, "cpu") == 0) return ZD_OK;
  char why[ZD__ERR_MSG_MAX / 2];
  int visible = 0;
  if (cuda_usable(d, why, sizeof why, &visible)) {
    d->backend = ZD__BACKEND_CUDA;
    for (uint32_t i = 0; i < d->cfg->local_ranks; i++)
      ZD_LOG_INFO("local rank %u: GPU %d, %s (%s)", i, d->gpus[i].device, d->gpus[i].name,
                  d->gpus[i].uuid_str);
    return ZD_OK;
  }
  if (strcmp(want, "cuda") == 0)
    return zd__errf(err, ZD_EBACKEND, "backend cuda requested, but %s; use backend cpu or auto",
                    why);
  snprintf(d->backend_note, sizeof d->backend_note, "CUDA not used: %s", why);
  if (visible)
    ZD_LOG_WARN("backend auto: %s; running the CPU backend", d->backend_note);
  else
    ZD_LOG_INFO("backend auto: %s; running the CPU backend", d->backend_note);
  return ZD_OK;
}

int zd__daemon_create(const zd__config_t *cfg, zd__daemon_t **out, zd__err_t *err) {
  zd__daemon_t *d = calloc(1, sizeof *d);
  if (!d) return zd__errf(err, -ENOMEM, "out of memory");
  d->cfg = cfg;
  d->start_us = zd__now_us();
  d->world_size = cfg->world_size ? cfg->world_size : cfg->local_ranks;
  d->bucket_elems = cfg->bucket_elems;
  pthread_mutex_init(&d->done_lock, NULL);
  int rc = uv_loop_init(&d->loop);
  if (rc) {
    pthread_mutex_destroy(&d->done_lock);
    free(d);
    return zd__errf(err, rc, "uv_loop_init: %s", uv_strerror(rc));
  }
  uv_async_init(&d->loop, &d->done_async, on_jobs_done);
  uv_timer_init(&d->loop, &d->shutdown_timer);
  uv_signal_init(&d->loop, &d->sigterm);
  uv_signal_init(&d->loop, &d->sigint);
  uv_signal_init(&d->loop, &d->sighup);
  uv_timer_init(&d->loop, &d->summary_timer);
  uv_timer_init(&d->loop, &d->notify_timer);
  uv_timer_init(&d->loop, &d->ckpt_timer);
  uv_timer_init(&d->loop, &d->drain_timer);
  d->notify_timer.data = d->ckpt_timer.data = d->drain_timer.data = d;
  d->done_async.data = d->sigterm.data = d->sigint.data = d->shutdown_timer.data = d;
  d->sighup.data = d->summary_timer.data = d;

  if ((rc = choose_backend(d, err)) || (rc = choose_isa(cfg, &d->isa, err))) goto fail;
  rc = zd__pool_create(cfg->threads, (int)cfg->pin_threads, &d->pool);
  if (rc) {
    zd__errf(err, rc, "cannot start %u kernel threads: %s", cfg->threads, zd_strerror(rc));
    goto fail;
  }
  /* The control service first: ranks joining a world register its bound address (a ":0" port
   * gets its real number) and, on rank 0's node, need its rendezvous store. */
  if ((rc = zd__control_start(d, &d->control, err))) goto fail;
  if ((rc = zd__metrics_start(&d->loop, cfg->metrics_address, d, &d->metrics, err))) goto fail;
  if ((rc = create_ranks(d, err)) || (rc = watch_peers(d, err))) goto fail;
  if ((rc = zd__sessions_create(d, d->nranks, &d->sessions))) {
    zd__errf(err, rc, "out of memory");
    goto fail;
  }
  if ((rc = zd__server_start(&d->loop, cfg, d->sessions, &d->server, err))) goto fail;
  uv_signal_start(&d->sigterm, on_signal, SIGTERM);
  uv_signal_start(&d->sigint, on_signal, SIGINT);
  uv_signal_start(&d->sighup, on_sighup, SIGHUP);
  uv_timer_start(&d->summary_timer, connection_summary, SUMMARY_MS, SUMMARY_MS);
  uint64_t period = notify_period_ms(&d->watchdog);
  if (period) uv_timer_start(&d->notify_timer, notify_systemd, period, period);
  if (d->backend == ZD__BACKEND_CUDA)
    ZD_LOG_INFO(
        "ready: %u local rank(s) of a world of %u, CUDA backend (one GPU per local rank, "
        "NCCL)",
        d->nranks, d->world_size);
  else
    ZD_LOG_INFO("ready: %u local rank(s) of a world of %u, CPU backend, %s kernels on %u threads%s",
                d->nranks, d->world_size, zd__isa_name((zd__isa_t)d->isa), zd__pool_size(d->pool),
                zd__pool_pinned(d->pool) ? ", each bound to a CPU" : "");
  sd_notify("READY=1");
  *out = d;
  return ZD_OK;

fail:
  zd__daemon_shutdown(d); /* undoes what was set up, through the loop */
  zd__daemon_run(d);
  zd__daemon_destroy(d);
  return rc;
}

void zd__daemon_poll_busily(zd__daemon_t *d) {
  if (!d->cfg->busy_poll_us) return;
  /* Not while a worker runs a job: its kernel may need every CPU, and its end wakes the loop. */
  for (uint32_t i = 0; i < d->nranks; i++)
    if (d->ranks[i] && !zd__rank_idle(d->ranks[i])) return;
  d->busy_until_ns = uv_hrtime() + d->cfg->busy_poll_us * 1000ull;
}

void zd__daemon_stop_polling(zd__daemon_t *d) {
  d->busy_until_ns = 0;
}

int zd__daemon_polling(const zd__daemon_t *d) {
  return d->polling;
}

int zd__daemon_run(zd__daemon_t *d) {
  /* UV_RUN_DEFAULT, one iteration at a time: within busy_poll_us of a reply the loop looks for
   * events without sleeping, so that a request sent as soon as the reply arrived does not wait
   * for this thread to be woken (about 25 us on a VM; the reply itself takes a few). */
  for (;;) {
    d->polling = uv_hrtime() < d->busy_until_ns;
    if (!uv_run(&d->loop, d->polling ? UV_RUN_NOWAIT : UV_RUN_ONCE)) break;
  }
  int rc = uv_loop_close(&d->loop);
  if (rc) ZD_LOG_ERROR("loop closed with handles still open: %s", uv_strerror(rc));
  return rc;
}

void zd__daemon_destroy(zd__daemon_t *d) {
  if (!d) return;
  stop_ranks(d);
  zd__pool_destroy(d->pool);
  zd__server_destroy(d->server);
  zd__sessions_destroy(d->sessions);
  free(d->ranks);
  free(d->gpus);
  pthread_mutex_destroy(&d->done_lock);
  free(d);
}

/* ---- accessors ------------------------------------------------------------------------------ */

uv_loop_t *zd__daemon_loop(zd__daemon_t *d) {
  return &d->loop;
}
const zd__config_t *zd__daemon_config(const zd__daemon_t *d) {
  return d->cfg;
}
zd__ckptr_t *zd__daemon_checkpointer(const zd__daemon_t *d) {
  return d->ckpt;
}
uint32_t zd__daemon_world_size(const zd__daemon_t *d) {
  return d->world_size;
}
uint64_t zd__daemon_bucket_elems(const zd__daemon_t *d) {
  return d->bucket_elems;
}
uint64_t zd__daemon_start_us(const zd__daemon_t *d) {
  return d->start_us;
}
zd__backend_t zd__daemon_backend(const zd__daemon_t *d) {
  return d->backend;
}
const char *zd__daemon_backend_note(const zd__daemon_t *d) {
  return d->backend_note;
}
const zd__gpu_info_t *zd__daemon_gpu(const zd__daemon_t *d, uint32_t local) {
  if (d->backend != ZD__BACKEND_CUDA) return NULL;
  zd_assert(local < d->cfg->local_ranks);
  return &d->gpus[local];
}
int zd__daemon_isa(const zd__daemon_t *d) {
  return d->isa;
}
zd__pool_t *zd__daemon_pool(const zd__daemon_t *d) {
  return d->pool;
}
uint32_t zd__daemon_nranks(const zd__daemon_t *d) {
  return d->nranks;
}
zd__rank_t *zd__daemon_rank(const zd__daemon_t *d, uint32_t local) {
  zd_assert(local < d->nranks);
  return d->ranks[local];
}
int zd__daemon_shutting_down(const zd__daemon_t *d) {
  return d->shutting_down;
}
zd__sessions_t *zd__daemon_sessions(const zd__daemon_t *d) {
  return d->sessions;
}
const zd__server_t *zd__daemon_server(const zd__daemon_t *d) {
  return d->server;
}
