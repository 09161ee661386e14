/* Prometheus metrics (metrics.h): the table from status keys to metric families, the exposition
 * writer, and the HTTP endpoint.
 *
 * The table says, per family, which status section and key feed it and how the value converts;
 * families whose samples carry a rank get rank="N" and local_rank="L". Names follow Prometheus'
 * conventions: a zerod_ prefix, base units (seconds, bytes), _total on counters, _info on
 * constant-1 gauges that carry labels. What the status does not hold is not exported: step times
 * come as the histogram the rank keeps (step_histogram: counts per bucket of
 * ZD__STEP_HIST_BOUNDS_US), the last step and the phase and collective totals; state bytes as
 * master weights and moments together, the gradient shard, and each optional state array of the
 * table (common/state.h) by name.
 *
 * Serving: libmicrohttpd's internal polling thread answers every connection, so a scrape that
 * waits for the loop holds up other scrapes of the same zerod, never the loop. The loop renders
 * in an async callback and hands the text over under a mutex with sequence numbers: a scrape
 * takes only a text rendered after it asked, never one left from a scrape that timed out.
 */
#include "metrics.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "log.h"
#include "rank.h"
#include "state.h"

#define CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* ---- the table ------------------------------------------------------------------------------- */

typedef enum {
  V_NUMBER, /* the value as it is */
  V_MICROS, /* whole microseconds, exported in seconds */
  V_MILLIS, /* whole milliseconds, exported in seconds */
  V_IS,     /* 1 when the value is arg, else 0 */
  V_ISNT,   /* 1 when the value is not arg, else 0 */
  V_ONE,    /* 1: an _info family, whose labels are the information */
} conv_t;

typedef struct family {
  const char *name;
  const char *type; /* "gauge" or "counter" */
  const char *help;
  const char *section; /* "server", "world", "checkpoint", or "rank" for every "rank N" section */
  const char *key;     /* a section without this key gives no sample; NULL: none does */
  conv_t conv;
  const char *arg;    /* V_IS, V_ISNT */
  const char *labels; /* "label=key,...": values of other keys of the section ("" if absent) */
  const char *fixed;  /* a constant label, `name="value"`, or NULL */
} family_t;

/* Rows of one family (same name) are adjacent: a family's samples must be one block. */
static const family_t families[] = {
    {"zerod_info", "gauge", "zerod's version and compute backend (the value is 1)", "server",
     "version", V_ONE, NULL, "version=version,backend=backend,kernel_isa=kernel_isa", NULL},
    {"zerod_uptime_seconds", "gauge", "seconds since zerod started", "server", "uptime_s", V_NUMBER,
     NULL, NULL, NULL},
    {"zerod_kernel_threads", "gauge", "threads running the CPU optimizer kernels", "server",
     "kernel_threads", V_NUMBER, NULL, NULL, NULL},
    {"zerod_clients_connected", "gauge", "clients connected to the local socket", "server",
     "clients_connected", V_NUMBER, NULL, NULL, NULL},
    {"zerod_client_connections_total", "counter", "connections accepted on the local socket",
     "server", "clients_total", V_NUMBER, NULL, NULL, NULL},
    {"zerod_client_connections_denied_total", "counter",
     "connections refused by the socket's uid/gid check", "server", "clients_denied", V_NUMBER,
     NULL, NULL, NULL},
    {"zerod_requests_total", "counter", "requests received on the local socket", "server",
     "requests_total", V_NUMBER, NULL, NULL, NULL},
    {"zerod_requests_polled_total", "counter",
     "requests the loop found while it polled after a reply (busy_poll_us): a wake-up saved each",
     "server", "requests_polled", V_NUMBER, NULL, NULL, NULL},
    {"zerod_replies_early_total", "counter",
     "replies a rank's worker wrote or queued itself as its job ended: a wake-up of the loop saved "
     "each",
     "server", "replies_early", V_NUMBER, NULL, NULL, NULL},
    {"zerod_request_errors_total", "counter", "requests answered with an error", "server",
     "errors_total", V_NUMBER, NULL, NULL, NULL},
    {"zerod_shutting_down", "gauge", "1 once zerod has begun to shut down", "server",
     "shutting_down", V_NUMBER, NULL, NULL, NULL},
    {"zerod_draining", "gauge", "1 while a drain (zeroctl drain) waits for its checkpoint",
     "server", "draining", V_NUMBER, NULL, NULL, NULL},

    {"zerod_world_size", "gauge", "ranks in the whole job", "world", "world_size", V_NUMBER, NULL,
     NULL, NULL},
    {"zerod_local_ranks", "gauge", "ranks served by this zerod", "world", "local_ranks", V_NUMBER,
     NULL, NULL, NULL},
    {"zerod_first_rank", "gauge", "global rank of this zerod's local rank 0", "world", "first_rank",
     V_NUMBER, NULL, NULL, NULL},
    {"zerod_bucket_elements", "gauge", "target elements per gradient bucket", "world",
     "bucket_elems", V_NUMBER, NULL, NULL, NULL},

    {"zerod_rank_healthy", "gauge",
     "1 when the rank is healthy, 0 while it joins its world or once it is degraded", "rank",
     "health", V_IS, "ok", NULL, NULL},
    {"zerod_rank_degraded", "gauge",
     "1 when the rank is degraded (a collective or its device failed: restart the world), with "
     "the reason",
     "rank", "health", V_IS, "degraded", "reason=degraded_reason", NULL},
    {"zerod_rank_client_attached", "gauge", "1 when a trainer is attached to the rank", "rank",
     "client", V_ISNT, "none", NULL, NULL},
    {"zerod_rank_gpu_info", "gauge", "the GPU of the rank, CUDA backend (the value is 1)", "rank",
     "gpu_uuid", V_ONE, NULL, "device=device,gpu=gpu,gpu_uuid=gpu_uuid", NULL},
    {"zerod_rank_model_registered", "gauge", "1 when a model is registered on the rank", "rank",
     "model", V_IS, "registered", NULL, NULL},
    {"zerod_rank_params", "gauge", "parameters (tensors) of the registered model", "rank", "params",
     V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_buckets", "gauge", "gradient buckets of the registered model", "rank", "buckets",
     V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_model_elements", "gauge", "elements of the whole registered model", "rank",
     "total_elems", V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_shard_elements", "gauge", "elements of the model in this rank's shard", "rank",
     "shard_elems", V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_state_bytes", "gauge",
     "bytes the rank holds for its shard, by kind: master_and_moments (every state array the "
     "model has: fp32 master weights and its optimizers' arrays), grad_shard (the reduced "
     "gradients; 0 at world size 1), and each optimizer's state array by its name (exp_avg, "
     "exp_avg_sq, max_exp_avg_sq, momentum_buffer, sum, square_avg, grad_avg); 0 when the "
     "model's optimizers keep none",
     "rank", "state_bytes", V_NUMBER, NULL, NULL, "kind=\"master_and_moments\""},
    {"zerod_rank_state_bytes", NULL, NULL, "rank", "grad_shard_bytes", V_NUMBER, NULL, NULL,
     "kind=\"grad_shard\""},
/* the "<name>_bytes" key of each optimizer's state array (common/state.h); the master weights'
 * row has no key, hence no sample */
#define STATE_BYTES(role, aname, always, legacy) \
  {"zerod_rank_state_bytes",                     \
   NULL,                                         \
   NULL,                                         \
   "rank",                                       \
   (always) ? NULL : aname "_bytes",             \
   V_NUMBER,                                     \
   NULL,                                         \
   NULL,                                         \
   "kind=\"" aname "\""},
    ZD__STATE_ARRAYS(STATE_BYTES)
#undef STATE_BYTES
        {"zerod_rank_step", "gauge",
         "optimizer step of the registered model (torch's state['step'])", "rank", "step", V_NUMBER,
         NULL, NULL, NULL},
    {"zerod_rank_steps_skipped_total", "counter",
     "steps of the registered model skipped for non-finite gradients", "rank", "steps_skipped",
     V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_loss_scale", "gauge", "dynamic loss scale (1 without loss scaling)", "rank",
     "loss_scale", V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_grad_norm", "gauge",
     "global gradient norm of the last step (absent until a step computes one)", "rank",
     "last_grad_norm", V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_clip_coefficient", "gauge", "gradient clipping coefficient of the last step",
     "rank", "last_clip_coef", V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_last_step_duration_seconds", "gauge",
     "duration of the rank's last optimizer step in zerod (0 before the first)", "rank",
     "last_step_us", V_MICROS, NULL, NULL, NULL},
    {"zerod_rank_mean_step_duration_seconds", "gauge",
     "mean duration of the rank's optimizer steps since zerod started (0 before the first)", "rank",
     "mean_step_us", V_MICROS, NULL, NULL, NULL},
    {"zerod_rank_scatters_total", "counter", "gradient reduce-scatters completed by the rank",
     "rank", "scatters", V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_gathers_total", "counter", "parameter all-gathers completed by the rank", "rank",
     "gathers", V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_phase_seconds_total", "counter",
     "host time of each phase of the rank's steps and requests (CUDA: the time to queue it)",
     "rank", "scatter_us", V_MICROS, NULL, NULL, "phase=\"scatter\""},
    {"zerod_rank_phase_seconds_total", NULL, NULL, "rank", "update_us", V_MICROS, NULL, NULL,
     "phase=\"update\""},
    {"zerod_rank_phase_seconds_total", NULL, NULL, "rank", "gather_us", V_MICROS, NULL, NULL,
     "phase=\"gather\""},
    {"zerod_rank_gpu_phase_seconds_total", "counter",
     "GPU time of each part of the rank's steps, from timing events on its stream (CUDA only; "
     "stats: statistics, the records' exchange and the decision)",
     "rank", "cuda_scatter_us_total", V_MICROS, NULL, NULL, "phase=\"scatter\""},
    {"zerod_rank_gpu_phase_seconds_total", NULL, NULL, "rank", "cuda_stats_us_total", V_MICROS,
     NULL, NULL, "phase=\"stats\""},
    {"zerod_rank_gpu_phase_seconds_total", NULL, NULL, "rank", "cuda_update_us_total", V_MICROS,
     NULL, NULL, "phase=\"update\""},
    {"zerod_rank_gpu_phase_seconds_total", NULL, NULL, "rank", "cuda_gather_us_total", V_MICROS,
     NULL, NULL, "phase=\"gather\""},
    {"zerod_rank_collective_bytes_total", "counter",
     "bytes given to the rank's reduce-scatters and all-gathers", "rank", "collective_bytes",
     V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_collective_seconds_total", "counter",
     "time in the rank's reduce-scatters and all-gathers (CUDA: to queue them)", "rank",
     "collective_us", V_MICROS, NULL, NULL, NULL},
    {"zerod_rank_state_file_info", "gauge",
     "state_dir: the file that holds the rank's state (the value is 1)", "rank", "state_file",
     V_ONE, NULL, "path=state_file", NULL},
    {"zerod_rank_state_committed_step", "gauge",
     "state_dir: the step the newest header of the rank's state file commits", "rank",
     "state_committed_step", V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_snapshot_step", "gauge",
     "state_dir_mode = snapshot: the step of the rank's newest state snapshot written", "rank",
     "snapshot_step", V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_snapshot_age_seconds", "gauge",
     "state_dir_mode = snapshot: time since the rank's newest state snapshot was taken", "rank",
     "snapshot_age_ms", V_MILLIS, NULL, NULL, NULL},
    {"zerod_rank_snapshot_bytes", "gauge",
     "state_dir_mode = snapshot: bytes of the rank's newest state snapshot's data", "rank",
     "snapshot_bytes", V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_last_recovery_info", "gauge",
     "how the rank's state last came back (the value is 1): state_dir (a restarted zerod's "
     "file), state_dir (kept) (a survivor's model kept across the world's re-forming), "
     "snapshot (state_dir_mode = snapshot), buddy copy, checkpoint, none (the client's values)",
     "rank", "last_recovery", V_ONE, NULL, "how=last_recovery", NULL},
    {"zerod_rank_last_recovery_step", "gauge", "the step the rank's last recovery served", "rank",
     "last_recovery_step", V_NUMBER, NULL, NULL, NULL},
    {"zerod_rank_last_recovery_seconds", "gauge",
     "time from the loss (the heal's start, else the registration's) to the rank serving its "
     "state again, last recovery",
     "rank", "last_recovery_ms", V_MILLIS, NULL, NULL, NULL},
    {"zerod_checkpoints_total", "counter",
     "checkpoints completed (on rank 0's zerod; elsewhere: this zerod's files written)",
     "checkpoint", "completed", V_NUMBER, NULL, NULL, NULL},
    {"zerod_checkpoint_failures_total", "counter", "checkpoints that failed to be written",
     "checkpoint", "failures", V_NUMBER, NULL, NULL, NULL},
    {"zerod_checkpoint_in_progress", "gauge", "checkpoint files queued or being written",
     "checkpoint", "in_progress", V_NUMBER, NULL, NULL, NULL},
    {"zerod_checkpoint_last_step", "gauge", "step of the last complete checkpoint", "checkpoint",
     "last_step", V_NUMBER, NULL, NULL, NULL},
    {"zerod_checkpoint_age_seconds", "gauge", "seconds since the last complete checkpoint",
     "checkpoint", "last_age_s", V_NUMBER, NULL, NULL, NULL},
    {"zerod_checkpoint_duration_seconds", "gauge",
     "last complete checkpoint: from the snapshot to the manifest", "checkpoint",
     "last_duration_ms", V_MILLIS, NULL, NULL, NULL},
    {"zerod_checkpoint_snapshot_seconds", "gauge",
     "last checkpoint: the stall of its step (copying the shard aside)", "checkpoint",
     "last_snapshot_us", V_MICROS, NULL, NULL, NULL},
    {"zerod_checkpoint_bytes", "gauge", "bytes of the last complete checkpoint", "checkpoint",
     "last_bytes", V_NUMBER, NULL, NULL, NULL},
};
#define NFAMILIES (sizeof families / sizeof families[0])

/* ---- rendering ------------------------------------------------------------------------------- */

static const char *lookup(const zd__status_t *st, size_t sec, const char *key) {
  for (size_t j = 0; j < zd__status_nentries(st, sec); j++)
    if (!strcmp(zd__status_key(st, sec, j), key)) return zd__status_value(st, sec, j);
  return NULL;
}

static int section_matches(const zd__status_t *st, size_t sec, const char *want) {
  const char *name = zd__status_section_name(st, sec);
  if (!strcmp(want, "rank")) return !strncmp(name, "rank ", 5);
  return !strcmp(name, want);
}

/* A label value as the format wants it: backslash, quote and newline escaped; other control
 * characters, which no label should hold, become spaces. */
static void put_label(FILE *f, int *first, const char *name, const char *value) {
  fprintf(f, "%s%s=\"", *first ? "" : ",", name);
  *first = 0;
  for (const char *c = value ? value : ""; *c; c++) {
    if (*c == '\\' || *c == '"')
      fprintf(f, "\\%c", *c);
    else if (*c == '\n')
      fputs("\\n", f);
    else
      fputc((unsigned char)*c < 0x20 ? ' ' : *c, f);
  }
  fputc('"', f);
}

/* The sample's value as text, or NULL for no sample (not a number, or NaN). */
static const char *sample_value(const family_t *fm, const char *text, char *buf, size_t len) {
  switch (fm->conv) {
    case V_ONE:
      return "1";
    case V_IS:
      return strcmp(text, fm->arg) ? "0" : "1";
    case V_ISNT:
      return strcmp(text, fm->arg) ? "1" : "0";
    case V_MICROS:
    case V_MILLIS: {
      char *end;
      errno = 0;
      unsigned long long v = strtoull(text, &end, 10);
      if (errno || end == text || *end || text[0] == '-') return NULL;
      if (fm->conv == V_MICROS)
        snprintf(buf, len, "%llu.%06llu", v / 1000000u, v % 1000000u);
      else
        snprintf(buf, len, "%llu.%03llu", v / 1000u, v % 1000u);
      return buf;
    }
    case V_NUMBER: {
      char *end;
      double v = strtod(text, &end);
      if (end == text || *end || isnan(v)) return NULL;
      if (isinf(v)) return v > 0 ? "+Inf" : "-Inf";
      return text; /* decimal text as the status wrote it: exact, and in a form Go parses */
    }
  }
  return NULL;
}

static void put_sample(FILE *f, const zd__status_t *st, size_t sec, const family_t *fm,
                       const char *value) {
  int first = 1;
  fputs(fm->name, f);
  int has_labels = !strcmp(fm->section, "rank") || fm->labels || fm->fixed;
  if (has_labels) fputc('{', f);
  if (!strcmp(fm->section, "rank")) {
    put_label(f, &first, "rank", lookup(st, sec, "rank"));
    put_label(f, &first, "local_rank", lookup(st, sec, "local_rank"));
  }
  for (const char *p = fm->labels; p && *p;) {
    const char *eq = strchr(p, '='), *end = strchr(p, ',');
    if (!end) end = p + strlen(p);
    char name[32], key[32];
    snprintf(name, sizeof name, "%.*s", (int)(eq - p), p);
    snprintf(key, sizeof key, "%.*s", (int)(end - eq - 1), eq + 1);
    put_label(f, &first, name, lookup(st, sec, key));
    p = *end ? end + 1 : end;
  }
  if (fm->fixed) fprintf(f, "%s%s", first ? "" : ",", fm->fixed);
  if (has_labels) fputc('}', f);
  fprintf(f, " %s\n", value);
}

/* zerod_rank_step_duration_seconds, a histogram: the status's "step_histogram" (a count per
 * bucket of ZD__STEP_HIST_BOUNDS_US, then the longer ones) made cumulative, with the steps' total
 * time and count. */
static void put_step_histogram(FILE *f, const zd__status_t *st) {
  static const uint64_t bounds[ZD__STEP_HIST_BUCKETS] = ZD__STEP_HIST_BOUNDS_US;
  int head = 0;
  for (size_t sec = 0; sec < zd__status_nsections(st); sec++) {
    if (!section_matches(st, sec, "rank")) continue;
    const char *hist = lookup(st, sec, "step_histogram"), *sum = lookup(st, sec, "total_step_us");
    const char *rank = lookup(st, sec, "rank"), *local = lookup(st, sec, "local_rank");
    if (!hist || !sum || !rank || !local) continue;
    uint64_t counts[ZD__STEP_HIST_BUCKETS + 1], total = 0;
    const char *p = hist;
    int ok = 1;
    for (uint32_t h = 0; h <= ZD__STEP_HIST_BUCKETS && ok; h++) {
      char *end;
      counts[h] = strtoull(p, &end, 10);
      ok = end != p;
      p = end;
      total += counts[h];
    }
    if (!ok) continue;
    if (!head) {
      fputs(
          "# HELP zerod_rank_step_duration_seconds duration of the rank's optimizer steps in "
          "zerod\n# TYPE zerod_rank_step_duration_seconds histogram\n",
          f);
      head = 1;
    }
    uint64_t cum = 0;
    for (uint32_t h = 0; h <= ZD__STEP_HIST_BUCKETS; h++) {
      cum += counts[h];
      char le[32];
      if (h < ZD__STEP_HIST_BUCKETS)
        snprintf(le, sizeof le, "%g", (double)bounds[h] / 1e6);
      else
        snprintf(le, sizeof le, "+Inf");
      fprintf(f,
              "zerod_rank_step_duration_seconds_bucket{rank=\"%s\",local_rank=\"%s\",le=\"%s\"} "
              "%" PRIu64 "\n",
              rank, local, le, cum);
    }
    fprintf(f, "zerod_rank_step_duration_seconds_sum{rank=\"%s\",local_rank=\"%s\"} %.6f\n", rank,
            local, (double)strtoull(sum, NULL, 10) / 1e6);
    fprintf(f,
            "zerod_rank_step_duration_seconds_count{rank=\"%s\",local_rank=\"%s\"} %" PRIu64 "\n",
            rank, local, total);
  }
}

int zd__metrics_render(const zd__status_t *st, char **text, size_t *len) {
  *text = NULL;
  *len = 0;
  FILE *f = open_memstream(text, len);
  if (!f) return -ENOMEM;
  const family_t *head = NULL; /* the row whose HELP and TYPE were written last */
  for (size_t i = 0; i < NFAMILIES; i++) {
    const family_t *fm = &families[i];
    while (!fm->type) fm--; /* a further row of the family above */
    for (size_t sec = 0; sec < zd__status_nsections(st); sec++) {
      if (!section_matches(st, sec, families[i].section)) continue;
      const char *raw = families[i].key ? lookup(st, sec, families[i].key) : NULL;
      char buf[48];
      const char *value = raw ? sample_value(&families[i], raw, buf, sizeof buf) : NULL;
      if (!value) continue;
      if (head != fm) {
        fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", fm->name, fm->help, fm->name, fm->type);
        head = fm;
      }
      put_sample(f, st, sec, &families[i], value);
    }
  }
  put_step_histogram(f, st);
  if (fclose(f) != 0 || !*text) {
    free(*text);
    *text = NULL;
    *len = 0;
    return -ENOMEM;
  }
  return 0;
}

/* ---- serving --------------------------------------------------------------------------------- */

struct zd__metrics {
  const zd__status_reg_t *status;
  struct MHD_Daemon *mhd;
  uv_async_t async; /* a scrape asks the loop to render */
  char address[320];
  char mhd_error[256]; /* libmicrohttpd's last message, for an error at start */

  pthread_mutex_t lock; /* the rest: shared by the loop and the HTTP thread */
  pthread_cond_t rendered_cond;
  uint64_t requested, rendered; /* sequence numbers of scrapes */
  char *text;                   /* the latest rendering, NULL if it failed */
  size_t len;
  int stopping;
};

static void on_closed(uv_handle_t *h) {
  zd__metrics_t *m = h->data;
  free(m->text);
  pthread_cond_destroy(&m->rendered_cond);
  pthread_mutex_destroy(&m->lock);
  free(m);
}

/* Loop thread: renders for every scrape waiting so far. */
static void on_render(uv_async_t *h) {
  zd__metrics_t *m = h->data;
  pthread_mutex_lock(&m->lock);
  uint64_t want = m->requested;
  int todo = want > m->rendered && !m->stopping;
  pthread_mutex_unlock(&m->lock);
  if (!todo) return;
  char *text = NULL;
  size_t len = 0;
  zd__status_t *st = zd__status_collect(m->status);
  if (!st || zd__metrics_render(st, &text, &len) != 0)
    ZD_LOG_WARN("metrics: out of memory rendering the metrics");
  zd__status_free(st);
  pthread_mutex_lock(&m->lock);
  free(m->text);
  m->text = text;
  m->len = len;
  m->rendered = want;
  pthread_cond_broadcast(&m->rendered_cond);
  pthread_mutex_unlock(&m->lock);
}

/* HTTP thread: asks the loop for the text and waits for it. Returns a copy (malloc'd) or NULL with
 * *status the HTTP status to answer. */
static char *wait_rendering(zd__metrics_t *m, size_t *len, unsigned *status) {
  struct timespec deadline;
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  deadline.tv_sec += ZD__METRICS_RENDER_TIMEOUT_MS / 1000;
  deadline.tv_nsec += (ZD__METRICS_RENDER_TIMEOUT_MS % 1000) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec++;
    deadline.tv_nsec -= 1000000000L;
  }
  char *copy = NULL;
  int rc = 0;
  pthread_mutex_lock(&m->lock);
  uint64_t want = ++m->requested;
  uv_async_send(&m->async);
  while (!m->stopping && m->rendered < want && rc != ETIMEDOUT)
    rc = pthread_cond_timedwait(&m->rendered_cond, &m->lock, &deadline);
  if (m->stopping || m->rendered < want) {
    *status = MHD_HTTP_SERVICE_UNAVAILABLE;
  } else if (!m->text || !(copy = malloc(m->len + 1))) {
    *status = MHD_HTTP_INTERNAL_SERVER_ERROR;
  } else {
    memcpy(copy, m->text, m->len + 1);
    *len = m->len;
    *status = MHD_HTTP_OK;
  }
  int stopping = m->stopping;
  pthread_mutex_unlock(&m->lock);
  if (*status == MHD_HTTP_SERVICE_UNAVAILABLE && !stopping)
    ZD_LOG_WARN("metrics: the loop did not render the metrics within %d ms; scrape answered 503",
                ZD__METRICS_RENDER_TIMEOUT_MS);
  return copy;
}

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned status, char *body, size_t len,
                             const char *content_type) {
  struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
  if (!r) {
    free(body);
    return MHD_NO;
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
  if (status == MHD_HTTP_METHOD_NOT_ALLOWED) MHD_add_response_header(r, "Allow", "GET, HEAD");
  enum MHD_Result ret = MHD_queue_response(conn, status, r);
  MHD_destroy_response(r);
  return ret;
}

static enum MHD_Result reply_text(struct MHD_Connection *conn, unsigned status, const char *msg) {
  char *body = strdup(msg);
  return body ? reply(conn, status, body, strlen(body), "text/plain; charset=utf-8") : MHD_NO;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_size, void **con_cls) {
  (void)version;
  (void)upload_data;
  static int headers_seen;
  zd__metrics_t *m = cls;
  /* The first call has the headers; then come calls with the body, if any, which no method here
   * takes: it is read and dropped, so that it is not taken for the next request. The answer goes
   * with the last call (libmicrohttpd refuses one queued while a body is being read). */
  if (!*con_cls) {
    *con_cls = &headers_seen;
    return MHD_YES;
  }
  if (*upload_size) {
    *upload_size = 0;
    return MHD_YES;
  }
  if (strcmp(method, MHD_HTTP_METHOD_GET) && strcmp(method, MHD_HTTP_METHOD_HEAD))
    return reply_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "zerod's metrics are read with GET\n");
  if (strcmp(url, "/metrics"))
    return reply_text(conn, MHD_HTTP_NOT_FOUND, "zerod serves /metrics only\n");
  size_t len = 0;
  unsigned status;
  char *text = wait_rendering(m, &len, &status);
  if (!text)
    return reply_text(conn, status,
                      status == MHD_HTTP_SERVICE_UNAVAILABLE
                          ? "zerod did not render its metrics in time, or is stopping\n"
                          : "zerod could not render its metrics (out of memory)\n");
  return reply(conn, MHD_HTTP_OK, text, len, CONTENT_TYPE);
}

/* libmicrohttpd's messages (errors only: bind failures, refused connections). */
static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
  zd__metrics_t *m = cls;
  vsnprintf(m->mhd_error, sizeof m->mhd_error, fmt, ap);
  size_t n = strlen(m->mhd_error);
  while (n && (m->mhd_error[n - 1] == '\n' || m->mhd_error[n - 1] == '.')) m->mhd_error[--n] = 0;
  ZD_LOG_WARN("metrics: libmicrohttpd: %s", m->mhd_error);
}

/* "host:port" or "[v6]:port" into its parts, the port a number up to 65535; 0 or -1. */
static int split_address(const char *address, char *host, size_t hlen, uint16_t *port) {
  const char *colon = strrchr(address, ':');
  if (!colon || colon == address || strlen(colon + 1) > 5 ||
      strspn(colon + 1, "0123456789") != strlen(colon + 1) || !colon[1])
    return -1;
  unsigned long p = strtoul(colon + 1, NULL, 10);
  if (p > 65535) return -1;
  const char *h = address;
  size_t n = (size_t)(colon - address);
  if (h[0] == '[') {
    if (n < 3 || h[n - 1] != ']') return -1;
    h++;
    n -= 2;
  } else if (memchr(h, ':', n)) {
    return -1; /* an IPv6 address needs its brackets */
  }
  if (n >= hlen) return -1;
  memcpy(host, h, n);
  host[n] = 0;
  *port = (uint16_t)p;
  return 0;
}

int zd__metrics_start(uv_loop_t *loop, const char *address, const zd__status_reg_t *status,
                      zd__metrics_t **out, zd__err_t *err) {
  *out = NULL;
  if (!address[0]) return ZD_OK;
  char host[256], service[8];
  uint16_t port;
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV}, *ai = NULL;
  if (split_address(address, host, sizeof host, &port))
    return zd__errf(err, ZD_ECONFIG,
                    "metrics_address '%.200s': expected host:port, e.g. 127.0.0.1:9400 or "
                    "[::1]:9400",
                    address);
  snprintf(service, sizeof service, "%u", (unsigned)port);
  int gai = getaddrinfo(host, service, &hints, &ai);
  if (gai)
    return zd__errf(err, ZD_ECONFIG, "metrics_address '%.200s': %s", address, gai_strerror(gai));

  int rc;
  zd__metrics_t *m = calloc(1, sizeof *m);
  if (!m) {
    freeaddrinfo(ai);
    return zd__errf(err, -ENOMEM, "out of memory starting the metrics endpoint");
  }
  m->status = status;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&m->rendered_cond, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&m->lock, NULL);
  uv_async_init(loop, &m->async, on_render);
  m->async.data = m;

  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
  if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
  /* The logger first, or libmicrohttpd warns that earlier options logged elsewhere. The port
   * argument only names the port in its messages: MHD_OPTION_SOCK_ADDR is the address. */
  m->mhd = MHD_start_daemon(flags, port, NULL, NULL, on_request, m, MHD_OPTION_EXTERNAL_LOGGER,
                            on_mhd_log, m, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                            MHD_OPTION_CONNECTION_LIMIT, 16u, MHD_OPTION_CONNECTION_TIMEOUT, 10u,
                            MHD_OPTION_END);
  freeaddrinfo(ai);
  if (!m->mhd) {
    rc = zd__errf(err, ZD_ECONFIG, "metrics_address '%.200s': cannot serve HTTP there: %s", address,
                  m->mhd_error[0] ? m->mhd_error : "libmicrohttpd could not start");
    goto fail;
  }
  const union MHD_DaemonInfo *info = MHD_get_daemon_info(m->mhd, MHD_DAEMON_INFO_BIND_PORT);
  snprintf(m->address, sizeof m->address, "%s%s%s:%u", strchr(host, ':') ? "[" : "", host,
           strchr(host, ':') ? "]" : "", info ? (unsigned)info->port : 0u);
  ZD_LOG_INFO("metrics on http://%s/metrics (Prometheus text format, libmicrohttpd %s)", m->address,
              MHD_get_version());
  *out = m;
  return ZD_OK;

fail:
  uv_close((uv_handle_t *)&m->async, on_closed);
  return rc;
}

void zd__metrics_stop(zd__metrics_t **pm) {
  zd__metrics_t *m = pm ? *pm : NULL;
  if (!m) return;
  *pm = NULL;
  pthread_mutex_lock(&m->lock);
  m->stopping = 1; /* a scrape waiting for the loop, which is this thread, answers 503 */
  pthread_cond_broadcast(&m->rendered_cond);
  pthread_mutex_unlock(&m->lock);
  MHD_stop_daemon(m->mhd); /* joins the HTTP thread: nothing sends to the async after this */
  uv_close((uv_handle_t *)&m->async, on_closed);
}
