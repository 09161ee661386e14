/* Status sections (status.h): the builder, and the daemon's sections, read through the daemon's,
 * the sessions' and the server's accessors. */
#include "checkpoint.h"
#include "status.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "adam.h"
#include "clock.h"
#include "daemon.h"
#include "server.h"
#include "session.h"

typedef struct entry {
  char *key;
  char *value;
} entry_t;

typedef struct section {
  char *name;
  entry_t *entries;
  size_t n, cap;
} section_t;

struct zd__status {
  section_t *sections;
  size_t n, cap;
  size_t total;
  int oom;
};

zd__status_t *zd__status_new(void) {
  return calloc(1, sizeof(zd__status_t));
}

void zd__status_free(zd__status_t *st) {
  if (!st) return;
  for (size_t i = 0; i < st->n; i++) {
    for (size_t j = 0; j < st->sections[i].n; j++) {
      free(st->sections[i].entries[j].key);
      free(st->sections[i].entries[j].value);
    }
    free(st->sections[i].entries);
    free(st->sections[i].name);
  }
  free(st->sections);
  free(st);
}

static int grow(void **arr, size_t *cap, size_t n, size_t size) {
  if (n < *cap) return 0;
  size_t c = *cap ? *cap * 2 : 8;
  void *p = realloc(*arr, c * size);
  if (!p) return -ENOMEM;
  *arr = p;
  *cap = c;
  return 0;
}

int zd__status_section(zd__status_t *st, const char *name) {
  if (grow((void **)&st->sections, &st->cap, st->n, sizeof *st->sections)) goto oom;
  section_t *s = &st->sections[st->n];
  *s = (section_t){.name = strdup(name)};
  if (!s->name) goto oom;
  st->n++;
  return 0;
oom:
  st->oom = 1;
  return -ENOMEM;
}

int zd__status_add(zd__status_t *st, const char *key, const char *fmt, ...) {
  if (st->n == 0) return -EINVAL;
  section_t *s = &st->sections[st->n - 1];
  if (grow((void **)&s->entries, &s->cap, s->n, sizeof *s->entries)) goto oom;
  va_list ap;
  va_start(ap, fmt);
  char *value = NULL;
  int rc = vasprintf(&value, fmt, ap);
  va_end(ap);
  char *k = strdup(key);
  if (rc < 0 || !k) {
    free(k);
    if (rc >= 0) free(value);
    goto oom;
  }
  s->entries[s->n++] = (entry_t){.key = k, .value = value};
  st->total++;
  return 0;
oom:
  st->oom = 1;
  return -ENOMEM;
}

size_t zd__status_nsections(const zd__status_t *st) {
  return st->n;
}
size_t zd__status_nentries(const zd__status_t *st, size_t i) {
  return st->sections[i].n;
}
size_t zd__status_nentries_total(const zd__status_t *st) {
  return st->total;
}
const char *zd__status_section_name(const zd__status_t *st, size_t i) {
  return st->sections[i].name;
}
const char *zd__status_key(const zd__status_t *st, size_t i, size_t j) {
  return st->sections[i].entries[j].key;
}
const char *zd__status_value(const zd__status_t *st, size_t i, size_t j) {
  return st->sections[i].entries[j].value;
}

static void add_config(void *ctx, const char *name, const char *value, const char *source) {
  zd__status_add(ctx, name, "%s (%s)", value, source);
}

static void add_rank(zd__status_t *st, const zd__daemon_t *d, uint32_t local) {
  zd__rank_t *r = zd__daemon_rank(d, local);
  zd__rank_stats_t s;
  zd__rank_stats(r, &s);
  char name[32];
  snprintf(name, sizeof name, "rank %u", zd__rank_global(r));
  zd__status_section(st, name);
  zd__status_add(st, "rank", "%u", zd__rank_global(r));
  zd__status_add(st, "local_rank", "%u", local);
  zd__status_add(st, "health", "%s", zd__health_name(s.health));
  const zd__gpu_info_t *g = zd__daemon_gpu(d, local);
  if (g) {
    zd__status_add(st, "device", "%d", g->device);
    zd__status_add(st, "gpu", "%s", g->name);
    zd__status_add(st, "gpu_uuid", "%s", g->uuid_str);
  }
  if (s.health == ZD__HEALTH_DEGRADED || s.health == ZD__HEALTH_REJOINING ||
      s.health == ZD__HEALTH_RESTORING)
    zd__status_add(st, "degraded_reason", "%s", s.degraded_reason);
  const zd__session_t *c = zd__sessions_attached(zd__daemon_sessions(d), local);
  zd__status_add(st, "client", "%s", c ? zd__session_name(c) : "none");
  zd__status_add(st, "client_pid", "%d", c ? (int)zd__session_pid(c) : 0);
  zd__status_add(st, "model", "%s", s.has_model ? "registered" : "none");
  if (!s.has_model) return;
  zd__status_add(st, "params", "%u", s.nparams);
  zd__status_add(st, "buckets", "%u", s.nbuckets);
  zd__status_add(st, "layout_hash", "%016" PRIx64, s.layout_hash);
  zd__status_add(st, "total_elems", "%" PRIu64, s.total_elems);
  zd__status_add(st, "shard_elems", "%" PRIu64, s.shard_elems);
  zd__status_add(st, "state_bytes", "%" PRIu64, s.state_bytes);
  zd__status_add(st, "grad_shard_bytes", "%" PRIu64, s.grad_shard_bytes);
  zd__status_add(st, "max_exp_avg_sq_bytes", "%" PRIu64, s.max_exp_avg_sq_bytes);
  zd__status_add(st, "param_dtype", "%s", zd_dtype_name(s.param_dtype));
  zd__status_add(st, "grad_dtype", "%s", zd_dtype_name(s.grad_dtype));
  zd__status_add(st, "step", "%" PRIu64, s.step);
  zd__status_add(st, "steps_skipped", "%" PRIu64, s.steps_skipped);
  zd__status_add(st, "loss_scale", "%g", s.loss_scale);
  zd__status_add(st, "last_grad_norm", "%g", s.last_grad_norm);
  zd__status_add(st, "last_clip_coef", "%g", s.last_clip_coef);
  zd__status_add(st, "last_step_us", "%" PRIu64, s.last_step_us);
  zd__status_add(st, "mean_step_us", "%" PRIu64, s.steps_run ? s.total_step_us / s.steps_run : 0);
  zd__status_add(st, "scatters", "%" PRIu64, s.scatters);
  zd__status_add(st, "gathers", "%" PRIu64, s.gathers);
  zd__status_add(st, "heals", "%" PRIu64, s.heals);
  zd__status_add(st, "total_step_us", "%" PRIu64, s.total_step_us);
  zd__status_add(st, "scatter_us", "%" PRIu64, s.scatter_us);
  zd__status_add(st, "update_us", "%" PRIu64, s.update_us);
  zd__status_add(st, "gather_us", "%" PRIu64, s.gather_us);
  zd__status_add(st, "collective_bytes", "%" PRIu64, s.collective_bytes);
  zd__status_add(st, "collective_us", "%" PRIu64, s.collective_us);
  /* "count count ..." per bucket of ZD__STEP_HIST_BOUNDS_US, then the longer ones */
  char hist[ZD__STEP_HIST_BUCKETS * 21 + 1];
  size_t used = 0;
  for (uint32_t h = 0; h <= ZD__STEP_HIST_BUCKETS; h++)
    used += (size_t)snprintf(hist + used, sizeof hist - used, "%s%" PRIu64, h ? " " : "",
                             s.step_hist[h]);
  zd__status_add(st, "step_histogram", "%s", hist);
  if (s.resume_pending) zd__status_add(st, "resume_pending", "%s", "newest complete checkpoint");
}

/* "never" rather than 0 for a checkpoint not taken: status and zeroctl show it to operators. */
static void add_checkpoints(zd__status_t *st, zd__daemon_t *d) {
  zd__ckptr_t *c = zd__daemon_checkpointer(d);
  if (!c) return;
  zd__ckpt_stats_t s;
  zd__ckptr_stats(c, &s);
  zd__status_section(st, "checkpoint");
  zd__status_add(st, "enabled", "%d", s.enabled);
  zd__status_add(st, "requested", "%" PRIu64, s.requested);
  zd__status_add(st, "completed", "%" PRIu64, s.completed);
  zd__status_add(st, "failures", "%" PRIu64, s.failures);
  zd__status_add(st, "in_progress", "%" PRIu64, s.in_progress);
  if (s.completed) {
    zd__status_add(st, "last_step", "%" PRIu64, s.last_ok_step);
    zd__status_add(st, "last_dir", "%s", s.last_dir);
    zd__status_add(st, "last_age_s", "%" PRIu64, (zd__unix_ms() - s.last_ok_unix_ms) / 1000u);
    zd__status_add(st, "last_duration_ms", "%" PRIu64, s.last_duration_ms);
    zd__status_add(st, "last_bytes", "%" PRIu64, s.last_bytes);
    zd__status_add(st, "last_snapshot_us", "%" PRIu64, s.last_snapshot_us);
  } else {
    zd__status_add(st, "last_step", "never");
  }
  if (s.last_error[0]) zd__status_add(st, "last_error", "%s", s.last_error);
  if (s.resumed_dir[0]) {
    zd__status_add(st, "resumed_step", "%" PRIu64, s.resumed_step);
    zd__status_add(st, "resumed_dir", "%s", s.resumed_dir);
  }
}

zd__status_t *zd__status_collect(zd__daemon_t *d) {
  const zd__config_t *cfg = zd__daemon_config(d);
  const zd__sessions_t *ss = zd__daemon_sessions(d);
  const zd__session_counters_t *n = zd__sessions_counters(ss);
  zd__backend_t backend = zd__daemon_backend(d);
  const char *note = zd__daemon_backend_note(d);
  zd__status_t *st = zd__status_new();
  if (!st) return NULL;
  zd__status_section(st, "server");
  zd__status_add(st, "version", "%s", ZD_VERSION);
  zd__status_add(st, "pid", "%d", (int)getpid());
  zd__status_add(st, "uptime_s", "%" PRIu64, (zd__now_us() - zd__daemon_start_us(d)) / 1000000u);
  zd__status_add(st, "socket", "%s", zd__server_socket_path(zd__daemon_server(d)));
  zd__status_add(st, "backend", "%s", zd__backend_name(backend));
  if (note[0]) zd__status_add(st, "backend_note", "%s", note);
  if (backend == ZD__BACKEND_CPU) {
    zd__status_add(st, "kernel_isa", "%s", zd__isa_name((zd__isa_t)zd__daemon_isa(d)));
    zd__status_add(st, "kernel_threads", "%u", zd__pool_size(zd__daemon_pool(d)));
    zd__status_add(st, "kernel_threads_pinned", "%d", zd__pool_pinned(zd__daemon_pool(d)));
  } else {
    zd__status_add(st, "state_memory", "%s", "device");
  }
  zd__status_add(st, "clients_connected", "%u", zd__sessions_open(ss));
  zd__status_add(st, "clients_total", "%" PRIu64, n->clients_total);
  zd__status_add(st, "clients_denied", "%" PRIu64, n->clients_denied);
  zd__status_add(st, "requests_total", "%" PRIu64, n->requests_total);
  zd__status_add(st, "requests_polled", "%" PRIu64, n->requests_polled);
  zd__status_add(st, "replies_early", "%" PRIu64, n->replies_early);
  zd__status_add(st, "errors_total", "%" PRIu64, n->errors_total);
  zd__status_add(st, "shutting_down", "%d", zd__daemon_shutting_down(d));
  zd__status_add(st, "draining", "%d", zd__daemon_draining(d) != NULL);
  zd__status_section(st, "world");
  zd__status_add(st, "world_size", "%u", zd__daemon_world_size(d));
  zd__status_add(st, "local_ranks", "%u", zd__daemon_nranks(d));
  zd__status_add(st, "first_rank", "%u", cfg->first_rank);
  zd__status_add(st, "bucket_elems", "%" PRIu64, zd__daemon_bucket_elems(d));
  for (uint32_t i = 0; i < zd__daemon_nranks(d); i++) add_rank(st, d, i);
  add_checkpoints(st, d);
  zd__status_section(st, "config");
  zd__config_visit(cfg, add_config, st);
  if (st->oom) {
    zd__status_free(st);
    return NULL;
  }
  return st;
}
