/* The daemon (daemon.h): its state, start-up in the order the layers need, the loop, signals,
 * systemd, shutdown. Every other module is created here and handed what it needs of the others;
 * none of them includes this one. */
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
#include "backend.h"
#include "buddy.h"
#include "snapshot.h"
#include "checkpoint.h"
#include "clock.h"
#include "comm.h"
#include "control.h"
#include "drain.h"
#include "grpc_unary.h"
#include "liveness.h"
#include "log.h"
#include "metrics.h"
#include "mps.h"
#include "pool.h"
#include "rank.h"
#include "server.h"
#include "session.h"
#include "state_file.h"
#include "status.h"
#include "world.h"
#include "world_record.h"

/* state_dir_mode resolved for the backend chosen: 1 snapshot (snapshot.h), 0 mapped state files
 * (state_file.h) or no state_dir. */
static int snapshot_mode(const zd__config_t *cfg, zd__backend_kind_t kind) {
  if (!cfg->state_dir[0]) return 0;
  return !strcmp(cfg->state_dir_mode, "snapshot") ||
         (!strcmp(cfg->state_dir_mode, "auto") && kind != ZD__BACKEND_CPU);
}

struct zd__daemon {
  uv_loop_t loop;
  const zd__config_t *cfg;
  zd__backend_t backend;      /* the compute backend, and the CPU kernels' ISA */
  zd__mps_t mps;              /* CUDA: whether the GPUs are shared through MPS */
  zd__pool_t *pool;           /* the CPU kernels' threads */
  zd__world_t world;          /* how ranks join a multi-rank world */
  uint32_t world_size;        /* at start: world_size or a resize's record (take_record) */
  zd__world_record_t record;  /* the record that gave world_size, if has_record */
  int has_record;             /* world_size came from a record */
  zd__ranks_t ranks;          /* the local ranks */
  zd__status_reg_t *status;   /* every module's status writer */
  zd__sessions_t *sessions;   /* the clients, and which one holds each local rank */
  zd__server_t *server;       /* the listening socket */
  zd__control_t *control;     /* gRPC control service; NULL once stopped */
  zd__drain_t *drain;         /* zeroctl drain */
  struct zd__liveness *peers; /* the heartbeat of the other nodes; NULL in a one-node world */
  pthread_mutex_t peers_lock; /* peers and formed, which the ranks' workers use (world_formed) */
  uint64_t *formed;           /* a formation before peers started, for it to apply; or NULL */
  uint32_t formed_size;
  struct zd__metrics *metrics; /* Prometheus endpoint (metrics.h); NULL when off or stopped */
  zd__ckptr_t *ckpt;           /* checkpoints (checkpoint.h); outlives the ranks */
  uv_timer_t ckpt_timer;       /* checkpoint_every_seconds */

  uv_timer_t shutdown_timer; /* aborts collectives that hold a shutdown too long */
  uv_signal_t sigterm;
  uv_signal_t sigint;
  int shutting_down;
  int handles_closed;

  uv_signal_t sighup;
  uv_timer_t summary_timer; /* the connection summary (connection_summary) */
  uint64_t summary_clients; /* clients_total at the last summary */
  uint64_t summary_dropped; /* connections_dropped at the last summary */
  uv_timer_t notify_timer;  /* systemd: WATCHDOG=1 and STATUS= (notify_systemd) */
  int watchdog;             /* the unit has WatchdogSec: send WATCHDOG=1 too */

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
  for (uint32_t i = 0; i < d->ranks.n; i++) {
    zd__rank_stats_t s;
    zd__rank_stats(d->ranks.rank[i], &s);
    ok += s.health == ZD__HEALTH_OK;
    degraded += s.health == ZD__HEALTH_DEGRADED;
    if (s.has_model && s.step > step) step = s.step;
  }
  char msg[256];
  snprintf(msg, sizeof msg, "%sSTATUS=%u of %u local rank(s) ok%s, step %" PRIu64,
           d->watchdog ? "WATCHDOG=1\n" : "", ok, d->ranks.n,
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
  pthread_mutex_lock(&d->peers_lock);
  zd__liveness_t *peers = d->peers; /* no worker reaches it from now on */
  d->peers = NULL;
  pthread_mutex_unlock(&d->peers_lock);
  zd__liveness_stop(peers); /* it may call into the ranks */
  uint32_t n = d->ranks.n;
  d->ranks.n = 0; /* nothing finds them from now on */
  for (uint32_t i = 0; i < n; i++) {
    zd__status_unregister(d->status, zd__rank_status, d->ranks.rank[i]);
    zd__rank_destroy(d->ranks.rank[i]);
  }
  zd__status_unregister(d->status, zd__ckptr_status, d->ckpt);
  zd__status_unregister(d->status, zd__state_file_status, d->cfg->state_dir);
  zd__status_unregister(d->status, zd__buddy_status, NULL);
  zd__status_unregister(d->status, zd__snapshot_status, NULL);
  zd__buddy_stop();           /* after the ranks: their workers take the snapshots */
  zd__snapshot_stop();        /* after the ranks: their workers queue the state snapshots */
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

/* The last step of a shutdown: no session, so no job is left anywhere, and the control service
 * is down. */
static void finish(zd__daemon_t *d) {
  if (d->handles_closed || (d->sessions && zd__sessions_open(d->sessions) > 0) || d->control)
    return;
  d->handles_closed = 1;
  stop_ranks(d);
  if (d->sessions) zd__sessions_close(d->sessions); /* the workers are joined: no job comes back */
  zd__drain_close(d->drain);
  d->drain = NULL;
  uv_close((uv_handle_t *)&d->shutdown_timer, NULL);
  uv_close((uv_handle_t *)&d->sigterm, NULL);
  uv_close((uv_handle_t *)&d->sigint, NULL);
  uv_close((uv_handle_t *)&d->sighup, NULL);
  uv_close((uv_handle_t *)&d->summary_timer, NULL);
  uv_close((uv_handle_t *)&d->notify_timer, NULL);
  uv_close((uv_handle_t *)&d->ckpt_timer, NULL);
  /* Closing the handles restored the default action; a repeated signal now must not turn a clean
   * exit into a death by signal. Nothing is left to wait for. */
  signal(SIGTERM, SIG_IGN);
  signal(SIGINT, SIG_IGN);
  signal(SIGHUP, SIG_IGN);
}

static void control_stopped(void *ctx) {
  zd__daemon_t *d = ctx;
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
  for (uint32_t i = 0; i < d->ranks.n; i++) zd__rank_abort(d->ranks.rank[i]);
}

void zd__daemon_shutdown(zd__daemon_t *d) {
  if (d->shutting_down) return;
  d->shutting_down = 1;
  sd_notify("STOPPING=1");
  if (d->drain) zd__drain_shutdown(d->drain); /* its caller hears it before the service goes */
  zd__metrics_stop(&d->metrics);
  if (d->server) zd__server_stop(d->server);
  for (uint32_t i = 0; i < d->ranks.n; i++) zd__rank_cancel(d->ranks.rank[i]); /* no long waits */
  zd__ckptr_cancel(d->ckpt);
  if (d->cfg->shutdown_timeout_ms)
    uv_timer_start(&d->shutdown_timer, on_shutdown_timeout, d->cfg->shutdown_timeout_ms, 0);
  if (d->control) zd__control_stop(d->control, control_stopped, d);
  if (d->sessions) zd__sessions_drain(d->sessions);
  finish(d);
}

/* A session's handles are closed; the last one of a shutdown lets it finish. */
static void session_closed(void *ctx) {
  zd__daemon_t *d = ctx;
  if (d->shutting_down) finish(d);
}

/* Drain's checkpoint is complete. */
static void drained(void *ctx) {
  zd__daemon_shutdown(ctx);
}

/* A rank's world instance formed (rank.h): the heartbeat watches its processes. The ranks'
 * workers may form a world before watch_peers() started the heartbeat: the newest formation is
 * then kept for it (the registry may be gone by the time its thread reads it, with rank 0). */
static void world_formed(void *ctx, const uint64_t *incarnations, uint32_t world_size) {
  zd__daemon_t *d = ctx;
  pthread_mutex_lock(&d->peers_lock);
  if (d->peers) {
    zd__liveness_formed(d->peers, incarnations, world_size); /* does not block */
  } else {
    uint64_t *copy = malloc(world_size * sizeof *copy);
    if (copy) {
      memcpy(copy, incarnations, world_size * sizeof *copy);
      free(d->formed);
      d->formed = copy;
      d->formed_size = world_size;
    }
  }
  pthread_mutex_unlock(&d->peers_lock);
}

/* How long a zerod that starts looks for the world size record in the rendezvous store of rank
 * 0's node, which may not be up yet (then the state_dir's record, or world_size, decides). */
#define RECORD_LOOKUP_MS 1000

/* world_size_record = use: the world size record of the last live resize (world_record.h), the
 * rendezvous store's, else this zerod's state_dir's, replaces the configured world_size. A
 * malformed record stops the start: which size is right cannot be known. */
static int take_record(zd__daemon_t *d, const char *rendezvous, int own_store, zd__err_t *err) {
  const zd__config_t *cfg = d->cfg;
  d->world_size = cfg->world_size;
  if (strcmp(cfg->world_size_record, "use") != 0 || cfg->world_size < 2) return ZD_OK;
  zd__world_record_t file = {0}, store = {0};
  int has_file = 0, has_store = 0, rc;
  if (cfg->state_dir[0]) {
    zd__err_t ferr = {0};
    rc = zd__world_record_read(cfg->state_dir, &file, &ferr);
    if (rc && rc != -ENOENT)
      return zd__errf(err, rc, "%s; fix or remove it, or set world_size_record = ignore", ferr.msg);
    has_file = rc == ZD_OK;
  }
  /* Rank 0's own built-in store is empty at start (it is this process); etcd keeps it. */
  if (!own_store) {
    zd__err_t lerr = {0};
    int malformed = 0;
    rc = zd__world_record_lookup(rendezvous, zd__control_token(d->control), &store, &malformed,
                                 RECORD_LOOKUP_MS, &lerr);
    if (malformed)
      return zd__errf(err, rc, "%s; fix or delete the key, or set world_size_record = ignore",
                      lerr.msg);
    if (rc && rc != -ENOENT)
      ZD_LOG_INFO("world size record: the rendezvous store did not answer (%s); going by %s",
                  lerr.msg, has_file ? "state_dir's record" : "world_size");
    has_store = rc == ZD_OK;
  }
  if (!has_file && !has_store) return ZD_OK;
  if (has_file && has_store &&
      (file.world_size != store.world_size || file.from != store.from || file.step != store.step))
    ZD_LOG_WARN("world size record: the rendezvous store's (world_size=%u from=%u step=%" PRIu64
                ") and state_dir's (world_size=%u from=%u step=%" PRIu64
                ") differ; the store's is taken (rank 0 writes every resize's there)",
                store.world_size, store.from, store.step, file.world_size, file.from, file.step);
  d->record = has_store ? store : file;
  d->has_record = 1;
  const char *src = has_store ? "rendezvous store" : "state_dir";
  d->world_size = d->record.world_size;
  if (d->world_size == cfg->world_size) {
    ZD_LOG_INFO("world size record (%s): a live resize after step %" PRIu64
                " made the world %u ranks, as configured",
                src, d->record.step, d->world_size);
    return ZD_OK;
  }
  ZD_LOG_WARN("world size record (%s): a live resize after step %" PRIu64
              " made the world %u ranks (from %u): this zerod takes %u over the configured "
              "world_size %u%s (world_size_record = ignore keeps the configured size)",
              src, d->record.step, d->world_size, d->record.from, d->world_size, cfg->world_size,
              cfg->first_rank >= d->world_size ? ", and its ranks stay out of the world" : "");
  return ZD_OK;
}

static int create_ranks(zd__daemon_t *d, zd__err_t *err) {
  const zd__config_t *cfg = d->cfg;
  d->ranks.n = 0;
  d->ranks.rank = calloc(cfg->local_ranks, sizeof *d->ranks.rank);
  if (!d->ranks.rank) return zd__errf(err, -ENOMEM, "out of memory");
  /* On rank 0's node the store is our own control service, at the address it actually bound. */
  const char *rendezvous =
      cfg->first_rank == 0 && strcmp(cfg->rendezvous_address, cfg->control_address) == 0
          ? zd__control_address(d->control)
          : cfg->rendezvous_address;
  int trc = take_record(
      d, rendezvous, cfg->first_rank == 0 && !strcmp(rendezvous, zd__control_address(d->control)),
      err);
  if (trc) return trc;
  d->world = (zd__world_t){.world_size = d->world_size,
                           .first_rank = cfg->first_rank,
                           .local_ranks = cfg->local_ranks,
                           .ranks_per_gpu = cfg->ranks_per_gpu,
                           .collective_timeout_ms = (int)cfg->collective_timeout_ms,
                           .connect_timeout_ms = (int)cfg->connect_timeout_ms,
                           .peer_timeout_ms = (int)cfg->peer_timeout_ms};
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
  zd__buddy_settings_t bset = {.every_steps = cfg->buddy_copy_every_steps,
                               .every_s = cfg->buddy_copy_every_s,
                               .state_dir = cfg->state_dir,
                               .bytes_per_s = cfg->buddy_bandwidth_bytes_per_s,
                               .domain = cfg->failure_domain,
                               .rendezvous = d->world.rendezvous_address,
                               .control_token = d->world.control_token,
                               .control_address = d->world.control_address,
                               .first_rank = cfg->first_rank,
                               .local_ranks = cfg->local_ranks,
                               .world_size = d->world_size};
  if ((crc = zd__buddy_start(&bset, err))) return crc;
  int snap = snapshot_mode(cfg, d->backend.kind);
  zd__snapshot_settings_t sset = {.dir = snap ? cfg->state_dir : NULL,
                                  .every_steps = cfg->state_snapshot_every_steps,
                                  .every_s = cfg->state_snapshot_every_s,
                                  .first_rank = cfg->first_rank,
                                  .local_ranks = cfg->local_ranks,
                                  .world_size = d->world_size,
                                  .timeout_ms = (int)cfg->collective_timeout_ms};
  if ((crc = zd__snapshot_start(&sset, err))) return crc;
  for (uint32_t i = 0; i < cfg->local_ranks; i++) {
    /* A one-rank world needs no peers; a larger one is joined by each rank's worker. The CUDA
     * backend's communicator (NCCL, even for one rank) is made by the worker, on its device. */
    zd__comm_t *comm = NULL;
    int rc = d->world_size == 1 && d->backend.kind == ZD__BACKEND_CPU ? zd__comm_local_create(&comm)
                                                                      : ZD_OK;
    if (rc) return zd__errf(err, rc, "cannot create the communicator of local rank %u", i);
    zd__rank_env_t env = {
        .local_rank = i,
        .local_ranks = cfg->local_ranks,
        .rank = cfg->first_rank + i,
        .world_size = d->world_size,
        .comm = comm,
        .world = &d->world,
        .pool = d->pool,
        .ckpt = d->ckpt,
        .isa = d->backend.isa,
        .gpu = zd__backend_gpu(&d->backend, i),
        .cuda_fast = strcmp(cfg->cuda_step, "legacy") != 0,
        .overlap_update = (int)cfg->overlap_update,
        .state_dir = cfg->state_dir[0] && !snap ? cfg->state_dir : NULL, /* mapped mode */
        .record_dir = cfg->state_dir[0] ? cfg->state_dir : NULL,
        .record = d->has_record ? &d->record : NULL,
        .formed = world_formed,
        .formed_ctx = d,
    };
    rc = zd__rank_create(&env, &d->ranks.rank[i]);
    if (rc) {
      zd__comm_destroy(comm);
      return zd__errf(err, rc, "cannot start the worker of local rank %u: %s", i, zd_strerror(rc));
    }
    d->ranks.n++;
  }
  return ZD_OK;
}

/* The heartbeat thread found a node dead: fail the collectives that wait for it, now. */
static void peer_dead(void *ctx, uint32_t first_rank, zd__verdict_t verdict, uint64_t incarnation,
                      const char *reason) {
  zd__daemon_t *d = ctx;
  for (uint32_t i = 0; i < d->ranks.n; i++)
    zd__rank_peer_dead(d->ranks.rank[i], first_rank, verdict, incarnation, reason);
}

/* Other nodes of the world are watched by a heartbeat (liveness.h); a one-node world has none. */
static int watch_peers(zd__daemon_t *d, zd__err_t *err) {
  /* a zerod whose ranks a live resize's record left out is no part of the world */
  if (d->world_size <= d->cfg->local_ranks || d->cfg->first_rank >= d->world_size) return ZD_OK;
  zd__liveness_cfg_t cfg = {.rendezvous_address = d->world.rendezvous_address,
                            .first_rank = d->cfg->first_rank,
                            .heartbeat_ms = d->cfg->heartbeat_ms,
                            .peer_timeout_ms = d->cfg->peer_timeout_ms};
  zd__liveness_t *peers = NULL;
  int rc = zd__liveness_start(&cfg, peer_dead, d, &peers, err);
  pthread_mutex_lock(&d->peers_lock);
  d->peers = peers;
  if (peers && d->formed) zd__liveness_formed(peers, d->formed, d->formed_size);
  free(d->formed);
  d->formed = NULL;
  pthread_mutex_unlock(&d->peers_lock);
  return rc;
}

/* ---- status ---------------------------------------------------------------------------------- */

/* The process's part of the server section, and the world section. */
static void daemon_status(void *ctx, zd__status_t *st) {
  zd__daemon_t *d = ctx;
  const zd__config_t *cfg = d->cfg;
  zd__status_section(st, "server");
  zd__status_add(st, "version", "%s", ZD_VERSION);
  zd__status_add(st, "pid", "%d", (int)getpid());
  zd__status_add(st, "uptime_s", "%" PRIu64, (zd__now_us() - d->start_us) / 1000000u);
  zd__status_add(st, "backend", "%s", zd__backend_name(d->backend.kind));
  if (d->backend.note[0]) zd__status_add(st, "backend_note", "%s", d->backend.note);
  if (d->backend.kind == ZD__BACKEND_CPU) {
    zd__status_add(st, "kernel_isa", "%s", zd__isa_name((zd__isa_t)d->backend.isa));
    zd__status_add(st, "kernel_threads", "%u", zd__pool_size(d->pool));
    zd__status_add(st, "kernel_threads_pinned", "%d", zd__pool_pinned(d->pool));
  } else {
    zd__status_add(st, "state_memory", "%s", "device");
    zd__mps_status(&d->mps, st);
  }
  zd__status_add(st, "shutting_down", "%d", d->shutting_down);
  zd__status_section(st, "world");
  uint32_t w = d->ranks.n ? zd__rank_world_size(d->ranks.rank[0]) : d->world_size;
  zd__status_add(st, "world_size", "%u", w);
  if (w != cfg->world_size) /* a live resize, or its record at start */
    zd__status_add(st, "configured_world_size", "%u", cfg->world_size);
  zd__status_add(st, "local_ranks", "%u", d->ranks.n);
  zd__status_add(st, "first_rank", "%u", cfg->first_rank);
  zd__status_add(st, "bucket_elems", "%" PRIu64, cfg->bucket_elems);
}

static void add_setting(void *ctx, const char *name, const char *value, const char *source) {
  zd__status_add(ctx, name, "%s (%s)", value, source);
}

/* The effective configuration, memcached's `stats settings`. */
static void config_status(void *ctx, zd__status_t *st) {
  zd__status_section(st, "config");
  zd__config_visit(ctx, add_setting, st);
}

/* The status's sections, in the order an operator reads them: server and world, each rank, the
 * checkpoints, the configuration. */
static int register_status(zd__daemon_t *d) {
  int rc = ZD_OK;
  for (uint32_t i = 0; !rc && i < d->ranks.n; i++)
    rc = zd__status_register(d->status, zd__rank_status, d->ranks.rank[i]);
  if (!rc) rc = zd__status_register(d->status, zd__ckptr_status, d->ckpt);
  if (!rc && d->cfg->state_dir[0] && !snapshot_mode(d->cfg, d->backend.kind))
    rc = zd__status_register(d->status, zd__state_file_status, d->cfg->state_dir);
  if (!rc && zd__snapshot_enabled()) rc = zd__status_register(d->status, zd__snapshot_status, NULL);
  if (!rc && (d->cfg->buddy_copy_every_steps || d->cfg->buddy_copy_every_s))
    rc = zd__status_register(d->status, zd__buddy_status, NULL);
  if (!rc) rc = zd__status_register(d->status, zd__sessions_status, d->sessions);
  if (!rc) rc = zd__status_register(d->status, zd__server_status, d->server);
  if (!rc) rc = zd__status_register(d->status, zd__drain_status, d->drain);
  if (!rc) rc = zd__status_register(d->status, config_status, (void *)d->cfg);
  return rc;
}

/* ---- start ----------------------------------------------------------------------------------- */

/* The local socket's side: sessions, the listener, and drain (which refuses registrations). */
static int start_transport(zd__daemon_t *d, zd__err_t *err) {
  zd__sessions_env_t env = {.loop = &d->loop,
                            .cfg = d->cfg,
                            .backend = &d->backend,
                            .ranks = &d->ranks,
                            .status = d->status,
                            .closed = session_closed,
                            .ctx = d};
  int rc = zd__sessions_create(&env, &d->sessions);
  if (rc) return zd__errf(err, rc, "cannot create the sessions: %s", zd_strerror(rc));
  rc = zd__server_start(&d->loop, d->cfg, d->sessions, &d->server, err);
  if (rc) return rc;
  zd__drain_env_t denv = {.loop = &d->loop,
                          .cfg = d->cfg,
                          .ranks = &d->ranks,
                          .ckpt = d->ckpt,
                          .sessions = d->sessions,
                          .world = d->cfg->world_size > 1 ? &d->world : NULL,
                          .shutdown = drained,
                          .ctx = d};
  rc = zd__drain_create(&denv, &d->drain);
  if (rc) return zd__errf(err, rc, "out of memory");
  zd__control_serve(d->control, &d->ranks, d->sessions, d->ckpt, d->drain);
  rc = register_status(d);
  return rc ? zd__errf(err, rc, "out of memory") : ZD_OK;
}

int zd__daemon_create(const zd__config_t *cfg, zd__daemon_t **out, zd__err_t *err) {
  zd__daemon_t *d = calloc(1, sizeof *d);
  if (!d) return zd__errf(err, -ENOMEM, "out of memory");
  d->cfg = cfg;
  d->start_us = zd__now_us();
  int rc = uv_loop_init(&d->loop);
  if (rc) {
    free(d);
    return zd__errf(err, rc, "uv_loop_init: %s", uv_strerror(rc));
  }
  pthread_mutex_init(&d->peers_lock, NULL);
  uv_timer_init(&d->loop, &d->shutdown_timer);
  uv_signal_init(&d->loop, &d->sigterm);
  uv_signal_init(&d->loop, &d->sigint);
  uv_signal_init(&d->loop, &d->sighup);
  uv_timer_init(&d->loop, &d->summary_timer);
  uv_timer_init(&d->loop, &d->notify_timer);
  uv_timer_init(&d->loop, &d->ckpt_timer);
  d->notify_timer.data = d->ckpt_timer.data = d;
  d->sigterm.data = d->sigint.data = d->shutdown_timer.data = d;
  d->sighup.data = d->summary_timer.data = d;

  if (!(d->status = zd__status_reg_new()) || zd__status_register(d->status, daemon_status, d)) {
    rc = zd__errf(err, -ENOMEM, "out of memory");
    goto fail;
  }
  if ((rc = zd__backend_choose(cfg, &d->backend, err))) goto fail;
  if (cfg->overlap_update && d->backend.kind != ZD__BACKEND_CPU) {
    rc = zd__errf(err, ZD_ECONFIG,
                  "overlap_update = 1 needs the cpu backend: the %s backend keeps one set of "
                  "state arrays in device memory and updates it in place at step time; set "
                  "overlap_update = 0 (or backend = cpu)",
                  zd__backend_name(d->backend.kind));
    goto fail;
  }
  if ((cfg->buddy_copy_every_steps || cfg->buddy_copy_every_s) &&
      d->backend.kind != ZD__BACKEND_CPU) {
    rc = zd__errf(err, ZD_ECONFIG,
                  "buddy copies need the cpu backend: the %s backend's state is in device "
                  "memory, which buddy copies do not read yet; set buddy_copy_every_steps = 0 "
                  "and buddy_copy_every_s = 0 (or backend = cpu)",
                  zd__backend_name(d->backend.kind));
    goto fail;
  }
  if (cfg->state_dir[0] && d->backend.kind != ZD__BACKEND_CPU &&
      !strcmp(cfg->state_dir_mode, "mapped")) {
    rc = zd__errf(err, ZD_ECONFIG,
                  "state_dir_mode = mapped needs the cpu backend: the %s backend's state is in "
                  "device memory, which dies with zerod and cannot live in a mapped file; set "
                  "state_dir_mode = snapshot (or auto) with state_snapshot_every_steps, e.g. 100",
                  zd__backend_name(d->backend.kind));
    goto fail;
  }
  int snap = snapshot_mode(cfg, d->backend.kind);
  if (snap && !cfg->state_snapshot_every_steps && !cfg->state_snapshot_every_s) {
    rc = zd__errf(err, ZD_ECONFIG,
                  "state_dir on the %s backend keeps the state as snapshots (state_dir_mode = "
                  "snapshot), and state_snapshot_every_steps and state_snapshot_every_s are both "
                  "0: set one (e.g. state_snapshot_every_steps = 100)",
                  zd__backend_name(d->backend.kind));
    goto fail;
  }
  if (!snap && (cfg->state_snapshot_every_steps || cfg->state_snapshot_every_s)) {
    rc = zd__errf(err, ZD_ECONFIG,
                  "state_snapshot_every_steps=%u / state_snapshot_every_s=%u need state_dir_mode "
                  "= snapshot (state_dir_mode = %s is mapped state files on the %s backend)",
                  cfg->state_snapshot_every_steps, cfg->state_snapshot_every_s, cfg->state_dir_mode,
                  zd__backend_name(d->backend.kind));
    goto fail;
  }
  /* snapshot files are written every N steps, not every step: any file system will do */
  if (cfg->state_dir[0] &&
      (rc = zd__state_dir_check(cfg->state_dir, (int)cfg->state_dir_any_fs || snap, err)))
    goto fail;
  if (d->backend.kind == ZD__BACKEND_CUDA) {
    zd__mps_probe(&d->backend, &d->mps);
    zd__mps_log(&d->mps);
  }
  rc = zd__pool_create(cfg->threads, (int)cfg->pin_threads, &d->pool);
  if (rc) {
    zd__errf(err, rc, "cannot start %u kernel threads: %s", cfg->threads, zd_strerror(rc));
    goto fail;
  }
  /* The control service first: ranks joining a world register its bound address (a ":0" port
   * gets its real number) and, on rank 0's node, need its rendezvous store. */
  zd__control_env_t cenv = {
      .loop = &d->loop, .cfg = cfg, .backend = &d->backend, .start_us = d->start_us};
  if ((rc = zd__control_start(&cenv, &d->control, err))) goto fail;
  if ((rc = zd__metrics_start(&d->loop, cfg->metrics_address, d->status, &d->metrics, err)))
    goto fail;
  if ((rc = create_ranks(d, err)) || (rc = watch_peers(d, err))) goto fail;
  if ((rc = start_transport(d, err))) goto fail;
  uv_signal_start(&d->sigterm, on_signal, SIGTERM);
  uv_signal_start(&d->sigint, on_signal, SIGINT);
  uv_signal_start(&d->sighup, on_sighup, SIGHUP);
  uv_timer_start(&d->summary_timer, connection_summary, SUMMARY_MS, SUMMARY_MS);
  uint64_t period = notify_period_ms(&d->watchdog);
  if (period) uv_timer_start(&d->notify_timer, notify_systemd, period, period);
  if (d->backend.kind == ZD__BACKEND_CUDA && cfg->ranks_per_gpu > 1)
    ZD_LOG_INFO(
        "ready: %u local rank(s) of a world of %u, CUDA backend (%u ranks per GPU, the group "
        "communicator in device memory)",
        d->ranks.n, d->world_size, cfg->ranks_per_gpu);
  else if (d->backend.kind == ZD__BACKEND_CUDA)
    ZD_LOG_INFO(
        "ready: %u local rank(s) of a world of %u, CUDA backend (one GPU per local rank, "
        "NCCL)",
        d->ranks.n, d->world_size);
  else
    ZD_LOG_INFO("ready: %u local rank(s) of a world of %u, CPU backend, %s kernels on %u threads%s",
                d->ranks.n, d->world_size, zd__isa_name((zd__isa_t)d->backend.isa),
                zd__pool_size(d->pool), zd__pool_pinned(d->pool) ? ", each bound to a CPU" : "");
  sd_notify("READY=1");
  *out = d;
  return ZD_OK;

fail:
  zd__daemon_shutdown(d); /* undoes what was set up, through the loop */
  zd__daemon_run(d);
  zd__daemon_destroy(d);
  return rc;
}

int zd__daemon_run(zd__daemon_t *d) {
  /* UV_RUN_DEFAULT, one iteration at a time: within busy_poll_us of a reply the loop looks for
   * events without sleeping, so that a request sent as soon as the reply arrived does not wait
   * for this thread to be woken (about 25 us on a VM; the reply itself takes a few). */
  for (;;) {
    int poll = d->sessions && zd__sessions_poll_now(d->sessions);
    if (!uv_run(&d->loop, poll ? UV_RUN_NOWAIT : UV_RUN_ONCE)) break;
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
  zd__status_reg_free(d->status);
  zd__backend_free(&d->backend);
  free(d->ranks.rank);
  pthread_mutex_destroy(&d->peers_lock);
  free(d->formed);
  free(d);
}

/* ---- for tests ------------------------------------------------------------------------------- */

uv_loop_t *zd__daemon_loop(zd__daemon_t *d) {
  return &d->loop;
}
zd__sessions_t *zd__daemon_sessions(const zd__daemon_t *d) {
  return d->sessions;
}
int zd__daemon_shutting_down(const zd__daemon_t *d) {
  return d->shutting_down;
}
