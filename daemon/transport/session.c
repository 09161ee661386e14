/* Client sessions (session.h): connections, frame reading, the command table, handlers and
 * replies; the set of sessions with its counters and the rank attachment table it drives. */
#include "session.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attach.h"
#include "buffers.h"
#include "dtype.h"
#include "frame.h"
#include "log.h"
#include "status.h"
#include "step.h"
#include "wire.h"
#include "zerod.pb-c.h"

#define MAX_FDS    8     /* descriptors held per session before a register consumes them */
#define READ_CHUNK 65536 /* bytes read per recvmsg when no frame size is known yet */

typedef enum session_state {
  SESSION_NEW,         /* waiting for hello */
  SESSION_READY,       /* hello done: version agreed, local rank chosen */
  SESSION_REGISTERING, /* attach job in flight */
  SESSION_REGISTERED,  /* model registered: step, scatter, gather allowed */
} session_state_t;

typedef struct out_buf {
  struct out_buf *next;
  size_t len;
  size_t off;
  uint8_t data[];
} out_buf_t;

struct zd__sessions {
  zd__daemon_t *d;
  zd__session_t *head; /* open sessions, linked through the session */
  uint32_t n;
  uint32_t next_id;
  zd__session_counters_t counters;
  zd__attach_t *attach; /* which session holds each local rank; written only through here */
};

struct zd__session {
  zd__sessions_t *ss;
  zd__daemon_t *daemon;
  const zd__config_t *cfg;
  zd__session_t *next, *prev;
  uint32_t id;
  int fd;
  uv_poll_t poll;
  uv_timer_t frame_timer;
  uv_timer_t hello_timer; /* a connection must say hello within hello_timeout_ms */
  int open_handles;       /* poll and timers, until their close callbacks ran */
  struct ucred cred;
  char name[64];
  session_state_t state;
  int named_rank; /* its hello named the rank (a weak reservation: attach.h) */
  int closing;    /* read no more; tear down once idle */
  int rank_wait;  /* a register waits for a departed client's rank (register_waits) */
  uint64_t rank_wait_until_ms;
  int dispatching; /* in process_frames: a job done inline must not re-enter it */
  int torn_down;   /* handles closing */
  int poll_events;

  uint8_t *rbuf; /* received bytes not yet consumed */
  size_t rlen;
  size_t rcap;
  int fds[MAX_FDS]; /* received descriptors, oldest first */
  int nfds;
  out_buf_t *wq_head, *wq_tail;
  size_t wq_bytes; /* replies not yet written: reading stops above max_frame_bytes */

  zd__rank_t *rank; /* from hello on; held in the attachment table, or competed for at register */
  zd__session_buffers_t buf;
  uint32_t nbuckets;
  uint32_t ngroups;
  uint32_t inflight;      /* jobs queued on the rank */
  zd__job_t *pending_bye; /* bye waits for the jobs in flight; holds its request id */
  uint64_t bye_id;
  int bye_pending;
  int stood_in; /* W > 1: its rank was released at its end, and the rank stands in for it */
};

typedef int (*handler_fn)(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                          zd__err_t *err);

enum { CMD_ANY = 0, CMD_NEEDS_HELLO = 1, CMD_NEEDS_MODEL = 2 };

typedef struct command {
  uint16_t type;
  const char *name;
  handler_fn handler;
  int needs;
  uint32_t max_body; /* 0: the configured max_frame_bytes */
} command_t;

static void update_poll(zd__session_t *s);
static void maybe_teardown(zd__session_t *s);
static void stand_in(zd__session_t *s);

/* Whether to take more requests from this client now. Backpressure: a client that pipelines up
 * to max_inflight, or sends without reading its replies (more than max_frame_bytes of them
 * unsent), is not read until it catches up, so it cannot make zerod hold unbounded memory. */
static int accepting(const zd__session_t *s) {
  const zd__config_t *cfg = s->cfg;
  return !s->closing && !s->rank_wait && s->inflight < cfg->max_inflight &&
         s->wq_bytes < cfg->max_frame_bytes;
}
static void process_frames(zd__session_t *s);

/* ---- writing ------------------------------------------------------------------------------- */

static void drop_writes(zd__session_t *s) {
  while (s->wq_head) {
    out_buf_t *b = s->wq_head;
    s->wq_head = b->next;
    free(b);
  }
  s->wq_tail = NULL;
  s->wq_bytes = 0;
}

static void flush(zd__session_t *s) {
  while (s->wq_head) {
    out_buf_t *b = s->wq_head;
    ssize_t n = send(s->fd, b->data + b->off, b->len - b->off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) return;
      ZD_LOG_DEBUG("session %u: write failed: %s", s->id, strerror(errno));
      drop_writes(s);
      s->closing = 1;
      return;
    }
    b->off += (size_t)n;
    if (b->off < b->len) return;
    s->wq_head = b->next;
    if (!s->wq_head) s->wq_tail = NULL;
    s->wq_bytes -= b->len;
    free(b);
  }
}

static void send_frame(zd__session_t *s, uint16_t type, uint64_t id, const ProtobufCMessage *msg) {
  if (s->torn_down) return;
  size_t len = protobuf_c_message_get_packed_size(msg);
  out_buf_t *b = malloc(sizeof *b + ZD__FRAME_HEADER_SIZE + len);
  if (!b) {
    ZD_LOG_ERROR("session %u: out of memory for a %zu-byte reply; closing", s->id, len);
    s->closing = 1;
    return;
  }
  zd__frame_header_t h = {.magic = ZD__FRAME_MAGIC,
                          .version = ZD_PROTOCOL_VERSION,
                          .type = type,
                          .length = (uint32_t)len,
                          .request_id = id};
  zd__frame_encode(&h, b->data);
  protobuf_c_message_pack(msg, b->data + ZD__FRAME_HEADER_SIZE);
  b->len = ZD__FRAME_HEADER_SIZE + len;
  b->off = 0;
  b->next = NULL;
  if (s->wq_tail)
    s->wq_tail->next = b;
  else
    s->wq_head = b;
  s->wq_tail = b;
  s->wq_bytes += b->len;
  flush(s);
}

static void send_reply(zd__session_t *s, uint16_t req_type, uint64_t id,
                       const ProtobufCMessage *msg) {
  send_frame(s, (uint16_t)(req_type | ZD__FRAME_REPLY), id, msg);
}

/* kept: Error.cuda_mappings_kept, which every error answering a register carries (whether zerod
 * still holds IPC handles that register sent; docs/protocol.md); -1 leaves it out. */
static void send_error_kept(zd__session_t *s, uint64_t id, int code, const char *msg, int kept) {
  Zerod__V1__Error e = ZEROD__V1__ERROR__INIT;
  e.code = code;
  e.message = (char *)msg;
  e.has_cuda_mappings_kept = kept >= 0;
  e.cuda_mappings_kept = kept > 0;
  s->ss->counters.errors_total++;
  ZD_LOG_DEBUG("session %u: request %" PRIu64 " failed: %s: %s", s->id, id, zd_err_name(code), msg);
  send_frame(s, ZD__MSG_ERROR, id, &e.base);
}

/* A register refused before its job was queued holds nothing: whatever it opened was closed. */
static int kept_if_register(uint16_t type) {
  return type == ZD__MSG_REGISTER ? 0 : -1;
}

/* Refuses the request of header h (which is not a job). */
static void refusef(zd__session_t *s, const zd__frame_header_t *h, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void refusef(zd__session_t *s, const zd__frame_header_t *h, int code, const char *fmt, ...) {
  char msg[ZD__ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  send_error_kept(s, h->request_id, code, msg, kept_if_register(h->type));
}

/* An error after which the stream cannot be trusted: reply, then close once it is written.
 * kept: as for send_error_kept. */
static void fail_stream(zd__session_t *s, uint64_t id, int kept, int code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void fail_stream(zd__session_t *s, uint64_t id, int kept, int code, const char *fmt, ...) {
  char msg[ZD__ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  /* Any local process can cause this as often as it likes: one line per event at debug, and the
   * daemon's summary (connection_summary) counts them at info with the last reason. */
  ZD_LOG_DEBUG("session %u (pid %d): %s; closing the connection", s->id, (int)s->cred.pid, msg);
  zd__session_counters_t *n = &s->ss->counters;
  n->connections_dropped++;
  snprintf(n->last_drop, sizeof n->last_drop, "pid %d uid %d: %s", (int)s->cred.pid,
           (int)s->cred.uid, msg);
  send_error_kept(s, id, code, msg, kept);
  s->rlen = 0;
  s->closing = 1;
}

/* ---- jobs ---------------------------------------------------------------------------------- */

static zd__job_t *job_new(zd__session_t *s, zd__job_type_t type, const zd__frame_header_t *h) {
  zd__job_t *job = calloc(1, sizeof *job);
  if (!job) return NULL;
  job->type = type;
  job->session = s;
  job->request_id = h->request_id;
  job->msg_type = h->type;
  job->buffers = &s->buf.bufs;
  return job;
}

static void submit(zd__session_t *s, zd__job_t *job) {
  /* Inline only with nothing of this session in flight: a job of its that finished on the worker
   * may still wait in the completion queue, and its reply must go out first. */
  int idle = s->inflight == 0;
  s->inflight++;
  zd__buffers_job_queued(&s->buf, job->event_slot); /* CUDA: the slot is taken until it is done */
  if (idle && zd__rank_run_inline(s->rank, job))
    zd__session_job_done(s, job);
  else
    zd__rank_submit(s->rank, job);
}

/* ---- handlers ------------------------------------------------------------------------------ */

static int handle_hello(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                        zd__err_t *err) {
  zd__daemon_t *d = s->daemon;
  if (s->state != SESSION_NEW)
    return zd__errf(err, ZD_EORDER, "hello sent twice; this session is already for local rank %u",
                    zd__rank_local(s->rank));
  Zerod__V1__HelloRequest *req = zerod__v1__hello_request__unpack(NULL, h->length, body);
  if (!req) return zd__errf(err, ZD_EPROTO, "malformed hello body (%u bytes)", h->length);
  int rc = ZD_OK;
  if (req->min_version > ZD_PROTOCOL_VERSION || req->max_version < ZD_PROTOCOL_VERSION) {
    rc = zd__errf(err, ZD_EVERSION, "client speaks protocol versions %u..%u; this zerod speaks %d",
                  req->min_version, req->max_version, ZD_PROTOCOL_VERSION);
    goto exit;
  }
  int32_t want = req->local_rank;
  uint32_t nranks = zd__daemon_nranks(d);
  uint32_t local = 0;
  if (want < -1) {
    rc = zd__errf(err, ZD_ERANK,
                  "local rank %d is not valid; expected 0..%u, or -1 (ZD_ANY_RANK) for the "
                  "first free one",
                  want, nranks - 1);
    goto exit;
  }
  if (want >= 0) {
    if ((uint32_t)want >= nranks) {
      rc = zd__errf(err, ZD_ERANK,
                    "local rank %d does not exist; this zerod hosts local ranks "
                    "0..%u",
                    want, nranks - 1);
      goto exit;
    }
    local = (uint32_t)want;
    s->named_rank = 1;
    /* Held by another session: this one competes for it at register (ZD_EBUSY there). */
    zd__attach_reserve(s->ss->attach, s, local);
  } else if (zd__attach_reserve_any(s->ss->attach, s, &local) != 0) {
    rc = zd__errf(err, ZD_EBUSY,
                  "all %u local ranks have a client attached or reserved (a client holds the "
                  "rank it got at hello until it disconnects)",
                  nranks);
    goto exit;
  }
  if (req->client_name && req->client_name[0])
    snprintf(s->name, sizeof s->name, "%s", req->client_name);
  s->rank = zd__daemon_rank(d, local);
  s->state = SESSION_READY;
  uv_timer_stop(&s->hello_timer);
  ZD_LOG_DEBUG("session %u: client '%s' (pid %d, uid %d) for local rank %u (rank %u)", s->id,
               s->name, (int)s->cred.pid, (int)s->cred.uid, local, zd__rank_global(s->rank));

  Zerod__V1__HelloReply rep = ZEROD__V1__HELLO_REPLY__INIT;
  rep.version = ZD_PROTOCOL_VERSION;
  rep.daemon_version = (char *)ZD_VERSION;
  rep.world_size = zd__daemon_world_size(d);
  rep.rank = zd__rank_global(s->rank);
  rep.local_rank = local;
  rep.bucket_elems = zd__daemon_bucket_elems(d);
  rep.backend = (char *)zd__backend_name(zd__daemon_backend(d));
  const zd__gpu_info_t *gpu = zd__daemon_gpu(d, local);
  if (gpu) { /* CUDA backend: the client checks its buffers' GPU against this one */
    rep.has_device = 1;
    rep.device = gpu->device;
    rep.has_device_uuid = 1;
    rep.device_uuid.data = (uint8_t *)gpu->uuid;
    rep.device_uuid.len = sizeof gpu->uuid;
  }
  send_reply(s, h->type, h->request_id, &rep.base);
exit:
  zerod__v1__hello_request__free_unpacked(req, NULL);
  return rc;
}

/* Builds the model spec of a register request; validates everything that does not need state. */
static int spec_from(zd__session_t *s, const Zerod__V1__RegisterRequest *req,
                     zd__model_spec_t *spec, zd__err_t *err) {
  zd__daemon_t *d = s->daemon;
  spec->param_dtype = zd__wire_dtype_from(req->param_dtype);
  spec->grad_dtype = zd__wire_dtype_from(req->grad_dtype);
  int rc = zd__dtype_check(spec->param_dtype, ZD__DTYPE_PARAM, err);
  if (!rc) rc = zd__dtype_check(spec->grad_dtype, ZD__DTYPE_GRAD, err);
  if (rc) return rc;
  if (req->n_groups == 0)
    return zd__errf(err, ZD_EGROUP, "register carries no parameter groups; expected at least 1");
  spec->groups = calloc(req->n_groups, sizeof *spec->groups);
  if (!spec->groups) return zd__errf(err, -ENOMEM, "out of memory");
  spec->ngroups = (uint32_t)req->n_groups;
  rc = zd__wire_groups_from(spec->groups, req->groups, req->n_groups, err);
  if (rc) return rc;
  if (!isfinite(req->max_grad_norm) || req->max_grad_norm < 0)
    return zd__errf(err, ZD_EHPARAM, "max_grad_norm is %g; expected a finite value >= 0 (0: off)",
                    req->max_grad_norm);
  spec->max_grad_norm = req->max_grad_norm;
  spec->grad_mean = req->grad_mean;
  spec->replace = req->replace;
  rc = zd__wire_scaler_from(&spec->scaler, req->loss_scaler, err);
  if (rc) return rc;
  if (spec->scaler.enabled && spec->grad_dtype != ZD_F16 && spec->grad_dtype != ZD_F32 &&
      spec->grad_dtype != ZD_BF16)
    return zd__errf(err, ZD_EDTYPE, "loss scaling needs f16, bf16 or f32 gradients");

  if (req->n_params == 0 || req->n_params > ZD__MAX_PARAMS)
    return zd__errf(err, -EINVAL, "register carries %zu parameters; expected 1..%u", req->n_params,
                    ZD__MAX_PARAMS);
  zd_param_t *params = calloc(req->n_params, sizeof *params);
  if (!params) return zd__errf(err, -ENOMEM, "out of memory");
  for (size_t i = 0; i < req->n_params && rc == ZD_OK; i++) {
    const Zerod__V1__Param *p = req->params[i];
    if (p->n_shape > ZD_MAX_DIMS) {
      rc = zd__errf(err, -EINVAL, "parameter %zu '%s' has %zu dimensions; at most %d supported", i,
                    p->name, p->n_shape, ZD_MAX_DIMS);
      break;
    }
    params[i].name = p->name;
    params[i].ndim = (uint32_t)p->n_shape;
    if (p->n_shape) /* a scalar's shape is NULL: memcpy from NULL is undefined even for 0 bytes */
      memcpy(params[i].shape, p->shape, p->n_shape * sizeof *p->shape);
    params[i].group = p->group;
  }
  uint32_t world_size = zd__daemon_world_size(d);
  uint64_t bucket_elems = zd__daemon_bucket_elems(d);
  if (rc == ZD_OK)
    rc = zd__layout_build(params, (uint32_t)req->n_params, spec->ngroups, world_size, bucket_elems,
                          &spec->layout, err);
  free(params);
  if (rc) return rc;
  if (spec->layout->hash != req->layout_hash)
    return zd__errf(err, ZD_ELAYOUT,
                    "client's layout hash is %016" PRIx64 ", zerod computes %016" PRIx64
                    " for world size %u and bucket size %" PRIu64
                    "; client and daemon "
                    "disagree on the layout",
                    req->layout_hash, spec->layout->hash, world_size, bucket_elems);
  return ZD_OK;
}

static void close_fds(zd__session_t *s) {
  for (int i = 0; i < s->nfds; i++) close(s->fds[i]);
  s->nfds = 0;
}

static int handle_register(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                           zd__err_t *err) {
  if (s->state != SESSION_READY) {
    close_fds(s);
    return zd__errf(err, ZD_EORDER, "a model is already registered on this connection");
  }
  const char *drain = zd__daemon_draining(s->daemon);
  if (drain) {
    close_fds(s);
    return zd__errf(err, ZD_ESHUTDOWN,
                    "zerod is draining (zeroctl drain from %s): it shuts down once its checkpoint "
                    "is complete; register with the zerod that replaces it",
                    drain);
  }
  Zerod__V1__RegisterRequest *req = zerod__v1__register_request__unpack(NULL, h->length, body);
  if (!req) {
    close_fds(s);
    return zd__errf(err, ZD_EPROTO, "malformed register body (%u bytes)", h->length);
  }
  int rc;
  zd__job_t *job = NULL;
  zd__model_spec_t *spec = calloc(1, sizeof *spec);
  if (!spec) {
    rc = zd__errf(err, -ENOMEM, "out of memory");
    goto fail;
  }
  rc = spec_from(s, req, spec, err);
  if (rc) goto fail;
  if (req->cuda && (rc = zd__buffers_check_cuda_form(req->cuda, err))) goto fail;
  uint32_t slot;
  rc = zd__buffers_event_slot(&s->buf, req->cuda != NULL, "register", req->has_event_slot,
                              req->event_slot, &slot, err);
  if (rc) goto fail;
  uint32_t local = zd__rank_local(s->rank);
  rc = req->cuda ? zd__buffers_open_cuda(&s->buf, s->daemon, local, req->cuda, s->nfds, spec, err)
                 : zd__buffers_map_host(&s->buf, s->daemon, local, s->fds, s->nfds, spec, err);
  if (rc) goto fail;
  int attached;
  zd__session_t *holder = zd__attach_blocker(s->ss->attach, s, local, s->named_rank);
  if (holder) {
    zd__attach_holder(s->ss->attach, local, &attached);
    if (attached)
      rc = zd__errf(err, ZD_EBUSY, "local rank %u is attached to client '%s' (pid %d)", local,
                    holder->name, (int)holder->cred.pid);
    else
      rc = zd__errf(err, ZD_EBUSY,
                    "local rank %u is reserved by client '%s' (pid %d), which said hello for "
                    "it first and holds it until it disconnects",
                    local, holder->name, (int)holder->cred.pid);
    goto fail;
  }
  job = job_new(s, ZD__JOB_ATTACH, h);
  if (!job) {
    rc = zd__errf(err, -ENOMEM, "out of memory");
    goto fail;
  }
  job->event_slot = slot;
  holder = zd__attach_take(s->ss->attach, s, local, s->named_rank);
  zd_assert(!holder);
  s->buf.bufs.param_dtype = spec->param_dtype;
  s->buf.bufs.grad_dtype = spec->grad_dtype;
  s->nbuckets = spec->layout->nbuckets;
  s->ngroups = spec->ngroups;
  job->in.spec = spec;
  close_fds(s);
  zerod__v1__register_request__free_unpacked(req, NULL);
  s->state = SESSION_REGISTERING;
  submit(s, job);
  return ZD_OK;

fail:
  zd__buffers_release(&s->buf, s->rank, s->id);
  zd__model_spec_free(spec);
  close_fds(s);
  zerod__v1__register_request__free_unpacked(req, NULL);
  return rc;
}

static int check_bucket(const zd__session_t *s, int32_t bucket, zd__err_t *err) {
  if (bucket < -1 || bucket >= (int32_t)s->nbuckets)
    return zd__errf(err, -EINVAL, "bucket %d does not exist; expected -1 (all) or 0..%u", bucket,
                    s->nbuckets - 1);
  return ZD_OK;
}

static int handle_step(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                       zd__err_t *err) {
  Zerod__V1__StepRequest *req = zerod__v1__step_request__unpack(NULL, h->length, body);
  if (!req) return zd__errf(err, ZD_EPROTO, "malformed step body (%u bytes)", h->length);
  int rc = ZD_OK;
  zd_group_t *groups = NULL;
  if (req->n_groups) {
    if (req->n_groups != s->ngroups) {
      rc = zd__errf(err, ZD_EGROUP, "step carries %zu groups; the model has %u", req->n_groups,
                    s->ngroups);
      goto exit;
    }
    groups = calloc(req->n_groups, sizeof *groups);
    if (!groups) {
      rc = zd__errf(err, -ENOMEM, "out of memory");
      goto exit;
    }
    rc = zd__wire_groups_from(groups, req->groups, req->n_groups, err);
    if (rc) goto exit;
  }
  if ((int)req->clip_norm < ZEROD__V1__CLIP_NORM__CLIP_NORM_DOUBLE ||
      (int)req->clip_norm > ZEROD__V1__CLIP_NORM__CLIP_NORM_TORCH215) {
    rc = zd__errf(err, ZD_EHPARAM,
                  "clip_norm is %d; expected 0 (double), 1 (torch 1.13), 2 (torch 2.6) or 3 "
                  "(torch 2.15)",
                  (int)req->clip_norm);
    goto exit;
  }
  uint32_t slot;
  rc = zd__buffers_event_slot(&s->buf, zd__buffers_cuda(&s->buf), "step", req->has_event_slot,
                              req->event_slot, &slot, err);
  if (rc) goto exit;
  zd__job_t *job = job_new(s, ZD__JOB_STEP, h);
  if (!job) {
    rc = zd__errf(err, -ENOMEM, "out of memory");
    goto exit;
  }
  job->event_slot = slot;
  job->in.step.groups = groups;
  job->in.step.ngroups = (uint32_t)req->n_groups;
  job->in.step.scatter = req->scatter;
  job->in.step.gather = req->gather;
  job->in.step.clip_norm = (zd_clip_norm_t)req->clip_norm;
  groups = NULL;
  submit(s, job);
exit:
  free(groups);
  zerod__v1__step_request__free_unpacked(req, NULL);
  return rc;
}

static int handle_scatter(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                          zd__err_t *err) {
  Zerod__V1__ScatterRequest *req = zerod__v1__scatter_request__unpack(NULL, h->length, body);
  if (!req) return zd__errf(err, ZD_EPROTO, "malformed scatter body (%u bytes)", h->length);
  int32_t bucket = req->bucket;
  uint32_t slot;
  int rc = zd__buffers_event_slot(&s->buf, zd__buffers_cuda(&s->buf), "scatter",
                                  req->has_event_slot, req->event_slot, &slot, err);
  zerod__v1__scatter_request__free_unpacked(req, NULL);
  if (!rc) rc = check_bucket(s, bucket, err);
  if (rc) return rc;
  zd__job_t *job = job_new(s, ZD__JOB_SCATTER, h);
  if (!job) return zd__errf(err, -ENOMEM, "out of memory");
  job->event_slot = slot;
  job->in.bucket = bucket;
  submit(s, job);
  return ZD_OK;
}

static int handle_gather(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                         zd__err_t *err) {
  Zerod__V1__GatherRequest *req = zerod__v1__gather_request__unpack(NULL, h->length, body);
  if (!req) return zd__errf(err, ZD_EPROTO, "malformed gather body (%u bytes)", h->length);
  int32_t bucket = req->bucket;
  uint32_t slot;
  int rc = zd__buffers_event_slot(&s->buf, zd__buffers_cuda(&s->buf), "gather", req->has_event_slot,
                                  req->event_slot, &slot, err);
  zerod__v1__gather_request__free_unpacked(req, NULL);
  if (!rc) rc = check_bucket(s, bucket, err);
  if (rc) return rc;
  zd__job_t *job = job_new(s, ZD__JOB_GATHER, h);
  if (!job) return zd__errf(err, -ENOMEM, "out of memory");
  job->event_slot = slot;
  job->in.bucket = bucket;
  submit(s, job);
  return ZD_OK;
}

static int handle_checkpoint(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                             zd__err_t *err) {
  Zerod__V1__CheckpointRequest *req = zerod__v1__checkpoint_request__unpack(NULL, h->length, body);
  if (!req) return zd__errf(err, ZD_EPROTO, "malformed checkpoint body (%u bytes)", h->length);
  int wait = req->wait;
  zerod__v1__checkpoint_request__free_unpacked(req, NULL);
  zd__job_t *job = job_new(s, ZD__JOB_CHECKPOINT, h);
  if (!job) return zd__errf(err, -ENOMEM, "out of memory");
  job->in.wait = wait;
  submit(s, job);
  return ZD_OK;
}

static int handle_status(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                         zd__err_t *err) {
  (void)body;
  zd__status_t *st = zd__status_collect(s->daemon);
  if (!st) return zd__errf(err, -ENOMEM, "out of memory");
  size_t nsec = zd__status_nsections(st);
  Zerod__V1__StatusReply rep = ZEROD__V1__STATUS_REPLY__INIT;
  Zerod__V1__StatusSection *secs = calloc(nsec ? nsec : 1, sizeof *secs);
  Zerod__V1__StatusSection **secp = calloc(nsec ? nsec : 1, sizeof *secp);
  size_t nent_all = zd__status_nentries_total(st);
  Zerod__V1__StatusEntry *ents = calloc(nent_all ? nent_all : 1, sizeof *ents);
  Zerod__V1__StatusEntry **entp = calloc(nent_all ? nent_all : 1, sizeof *entp);
  int rc = ZD_OK;
  if (!secs || !secp || !ents || !entp) {
    rc = zd__errf(err, -ENOMEM, "out of memory");
    goto exit;
  }
  size_t e = 0;
  for (size_t i = 0; i < nsec; i++) {
    zerod__v1__status_section__init(&secs[i]);
    secs[i].name = (char *)zd__status_section_name(st, i);
    secs[i].entries = &entp[e];
    size_t n = zd__status_nentries(st, i);
    for (size_t j = 0; j < n; j++, e++) {
      zerod__v1__status_entry__init(&ents[e]);
      ents[e].key = (char *)zd__status_key(st, i, j);
      ents[e].value = (char *)zd__status_value(st, i, j);
      entp[e] = &ents[e];
    }
    secs[i].n_entries = n;
    secp[i] = &secs[i];
  }
  rep.sections = secp;
  rep.n_sections = nsec;
  send_reply(s, h->type, h->request_id, &rep.base);
exit:
  free(entp);
  free(ents);
  free(secp);
  free(secs);
  zd__status_free(st);
  return rc;
}

static void reply_bye(zd__session_t *s, uint64_t id);

static int handle_bye(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                      zd__err_t *err) {
  (void)body, (void)err;
  s->closing = 1; /* read nothing after bye */
  s->bye_pending = 1;
  s->bye_id = h->request_id;
  stand_in(s);
  if (s->inflight == 0) reply_bye(s, h->request_id);
  return ZD_OK;
}

static const command_t commands[] = {
    {ZD__MSG_HELLO, "hello", handle_hello, CMD_ANY, 4096},
    {ZD__MSG_REGISTER, "register", handle_register, CMD_NEEDS_HELLO, 0},
    {ZD__MSG_STEP, "step", handle_step, CMD_NEEDS_MODEL, 1u << 20},
    {ZD__MSG_SCATTER, "scatter", handle_scatter, CMD_NEEDS_MODEL, 64},
    {ZD__MSG_GATHER, "gather", handle_gather, CMD_NEEDS_MODEL, 64},
    {ZD__MSG_STATUS, "status", handle_status, CMD_ANY, 64},
    {ZD__MSG_BYE, "bye", handle_bye, CMD_ANY, 64},
    {ZD__MSG_CHECKPOINT, "checkpoint", handle_checkpoint, CMD_NEEDS_MODEL, 64},
};

static const command_t *find_command(uint16_t type) {
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (commands[i].type == type) return &commands[i];
  return NULL;
}

/* Releases the rank (attached or reserved) and the buffers once nothing uses them. */
static void detach(zd__session_t *s) {
  zd__buffers_release(&s->buf, s->rank, s->id); /* while s->rank still says whose they were */
  if (s->rank) {
    uint32_t local = zd__rank_local(s->rank);
    if (zd__attach_release(s->ss->attach, s, local)) {
      ZD_LOG_INFO("session %u: client '%s' (pid %d) detached from local rank %u", s->id, s->name,
                  (int)s->cred.pid, local);
    }
    s->rank = NULL;
  }
  s->state = SESSION_NEW;
}

static void reply_bye(zd__session_t *s, uint64_t id) {
  detach(s); /* before the reply, so the client can reattach as soon as it reads it */
  s->bye_pending = 0;
  Zerod__V1__ByeReply rep = ZEROD__V1__BYE_REPLY__INIT;
  rep.has_cuda_mappings_kept = 1; /* of this connection: the client frees its memory only if 0 */
  rep.cuda_mappings_kept = s->buf.mappings_kept != 0;
  send_reply(s, ZD__MSG_BYE, id, &rep.base);
}

/* Validates the envelope and runs the command. The handler replies, queues a job, or fails. */
static void dispatch(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body) {
  s->ss->counters.requests_total++;
  zd__err_t err = {0};
  const command_t *cmd = find_command(h->type);
  if (!cmd) {
    refusef(s, h, ZD_ETYPE,
            "unknown message type %u; expected one of hello (1), "
            "register (2), step (3), scatter (4), gather (5), status (6), bye (7), "
            "checkpoint (8)",
            h->type);
    return;
  }
  uint32_t max_body = cmd->max_body ? cmd->max_body : s->cfg->max_frame_bytes;
  if (h->length > max_body) {
    refusef(s, h, ZD_ETOOBIG, "%s body is %u bytes; at most %u expected", cmd->name, h->length,
            max_body);
    return;
  }
  if (zd__daemon_shutting_down(s->daemon)) {
    refusef(s, h, ZD_ESHUTDOWN, "zerod is shutting down; %s refused", cmd->name);
    return;
  }
  if (cmd->needs >= CMD_NEEDS_HELLO && s->state == SESSION_NEW) {
    refusef(s, h, ZD_EORDER, "%s before hello: say hello first", cmd->name);
    return;
  }
  if (cmd->needs >= CMD_NEEDS_MODEL && s->state != SESSION_REGISTERED) {
    refusef(s, h, ZD_EORDER, "%s before register: register a model first", cmd->name);
    return;
  }
  int rc = cmd->handler(s, h, body, &err);
  if (rc)
    send_error_kept(s, h->request_id, rc, err.msg[0] ? err.msg : zd_strerror(rc),
                    kept_if_register(h->type));
}

/* ---- reading ------------------------------------------------------------------------------- */

static void on_frame_timeout(uv_timer_t *t) {
  zd__session_t *s = t->data;
  if (s->rlen == 0) return;
  zd__frame_header_t h = {0};
  size_t want = ZD__FRAME_HEADER_SIZE;
  if (s->rlen >= ZD__FRAME_HEADER_SIZE) {
    zd__frame_decode(s->rbuf, &h);
    want += h.length;
  }
  fail_stream(s, h.request_id, kept_if_register(h.type), ZD_EPROTO,
              "truncated frame: received %zu of %zu bytes within %u ms", s->rlen, want,
              s->cfg->frame_timeout_ms);
  update_poll(s);
  maybe_teardown(s);
}

static void consume(zd__session_t *s, size_t n) {
  memmove(s->rbuf, s->rbuf + n, s->rlen - n);
  s->rlen -= n;
}

/* How long a register waits for a rank whose client has gone (register_waits), and how often it
 * looks again. */
#define RANK_WAIT_MS      3000
#define RANK_WAIT_POLL_MS 20

static void on_rank_wait(uv_timer_t *t) {
  zd__session_t *s = t->data;
  s->rank_wait = 0;
  if (s->closing || s->torn_down) return;
  process_frames(s);
  update_poll(s);
  maybe_teardown(s);
}

/* A register for a rank that another session still holds only because its client's job in
 * flight (typically a registration waiting for the other ranks, which gives up within a second
 * of its client leaving) has not ended: the client is gone, so the rank is about to be free. A
 * trainer restarted at once would otherwise be refused ZD_EBUSY; it waits (reading nothing more)
 * until the rank is free, for at most RANK_WAIT_MS, and is then refused as before. */
static int register_waits(zd__session_t *s) {
  if (!s->rank) return 0;
  zd__session_t *holder =
      zd__attach_blocker(s->ss->attach, s, zd__rank_local(s->rank), s->named_rank);
  uint64_t now = zd__now_ms();
  if (!holder || !holder->closing || holder->inflight == 0 ||
      (s->rank_wait_until_ms && now >= s->rank_wait_until_ms)) {
    s->rank_wait_until_ms = 0;
    return 0;
  }
  if (!s->rank_wait_until_ms) {
    s->rank_wait_until_ms = now + RANK_WAIT_MS;
    ZD_LOG_DEBUG(
        "session %u: register waits for local rank %u, held by session %u (pid %d) "
        "whose client has gone",
        s->id, zd__rank_local(s->rank), holder->id, (int)holder->cred.pid);
  }
  s->rank_wait = 1;
  uv_timer_start(&s->hello_timer, on_rank_wait, RANK_WAIT_POLL_MS, 0); /* idle after hello */
  return 1;
}

static void dispatch_frames(zd__session_t *s) {
  const zd__config_t *cfg = s->cfg;
  while (accepting(s) && s->rlen >= ZD__FRAME_HEADER_SIZE) {
    zd__frame_header_t h;
    if (zd__frame_decode(s->rbuf, &h) != ZD_OK) {
      fail_stream(s, 0, -1, ZD_EPROTO, "garbage frame: magic is 0x%08x, expected 0x%08x ('ZRD1')",
                  h.magic, ZD__FRAME_MAGIC);
      break;
    }
    if (h.length > cfg->max_frame_bytes) {
      fail_stream(s, h.request_id, kept_if_register(h.type), ZD_ETOOBIG,
                  "frame body is %u bytes; max_frame_bytes is %u", h.length, cfg->max_frame_bytes);
      break;
    }
    size_t total = ZD__FRAME_HEADER_SIZE + (size_t)h.length;
    if (s->rlen < total) break;
    if (h.type == ZD__MSG_REGISTER && h.version == ZD_PROTOCOL_VERSION && register_waits(s)) break;
    if (h.version != ZD_PROTOCOL_VERSION) {
      refusef(s, &h, ZD_EVERSION,
              "frame has protocol version %u; this zerod speaks "
              "version %d",
              h.version, ZD_PROTOCOL_VERSION);
    } else if (h.flags != 0) {
      refusef(s, &h, ZD_EPROTO, "frame flags are 0x%x; expected 0", h.flags);
    } else {
      dispatch(s, &h, s->rbuf + ZD__FRAME_HEADER_SIZE);
    }
    if (s->torn_down) return;
    /* The descriptors that came with a register frame belong to it, used or refused: never to a
     * later register that came without any. */
    if (h.type == ZD__MSG_REGISTER) close_fds(s);
    consume(s, total);
  }
}

static void process_frames(zd__session_t *s) {
  s->dispatching = 1;
  dispatch_frames(s);
  s->dispatching = 0;
  if (s->torn_down) return;
  /* A partial frame must complete within frame_timeout_ms, counted while we read: a session held
   * back by backpressure is not the client's delay. */
  if (s->rlen > 0 && accepting(s)) {
    if (!uv_is_active((uv_handle_t *)&s->frame_timer))
      uv_timer_start(&s->frame_timer, on_frame_timeout, s->cfg->frame_timeout_ms, 0);
  } else {
    uv_timer_stop(&s->frame_timer);
  }
}

static int ensure_capacity(zd__session_t *s, size_t need) {
  if (s->rcap - s->rlen >= need) return 0;
  size_t cap = s->rcap ? s->rcap : READ_CHUNK;
  while (cap - s->rlen < need) cap *= 2;
  uint8_t *p = realloc(s->rbuf, cap);
  if (!p) return -ENOMEM;
  s->rbuf = p;
  s->rcap = cap;
  return 0;
}

static void take_fds(zd__session_t *s, struct msghdr *msg) {
  for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    int n = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
    int *fds = (int *)CMSG_DATA(c);
    for (int i = 0; i < n; i++) {
      if (s->nfds < MAX_FDS)
        s->fds[s->nfds++] = fds[i];
      else
        close(fds[i]); /* more than any request needs */
    }
  }
}

static void read_some(zd__session_t *s) {
  for (int round = 0; round < 16 && !s->closing; round++) {
    /* Read the rest of the current frame in one go when its size is known. */
    size_t want = READ_CHUNK;
    if (s->rlen >= ZD__FRAME_HEADER_SIZE) {
      zd__frame_header_t h;
      if (zd__frame_decode(s->rbuf, &h) == ZD_OK && h.length <= s->cfg->max_frame_bytes &&
          ZD__FRAME_HEADER_SIZE + (size_t)h.length > s->rlen + want)
        want = ZD__FRAME_HEADER_SIZE + (size_t)h.length - s->rlen;
    }
    if (ensure_capacity(s, want) != 0) {
      fail_stream(s, 0, -1, -ENOMEM, "out of memory reading a frame");
      return;
    }
    union {
      char buf[CMSG_SPACE(MAX_FDS * sizeof(int))];
      struct cmsghdr align;
    } ctrl;
    struct iovec iov = {.iov_base = s->rbuf + s->rlen, .iov_len = s->rcap - s->rlen};
    struct msghdr msg = {.msg_iov = &iov,
                         .msg_iovlen = 1,
                         .msg_control = ctrl.buf,
                         .msg_controllen = sizeof ctrl.buf};
    ssize_t n = recvmsg(s->fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) return;
      ZD_LOG_DEBUG("session %u: read failed: %s", s->id, strerror(errno));
      drop_writes(s);
      s->closing = 1;
      return;
    }
    take_fds(s, &msg);
    if (msg.msg_flags & MSG_CTRUNC) {
      fail_stream(s, 0, -1, ZD_EPROTO,
                  "too many file descriptors in one message; expected at most %d", MAX_FDS);
      return;
    }
    if (n == 0) {
      if (s->rlen > 0)
        ZD_LOG_WARN(
            "session %u (pid %d): connection closed in the middle of a frame (%zu bytes "
            "received)",
            s->id, (int)s->cred.pid, s->rlen);
      s->closing = 1;
      return;
    }
    s->rlen += (size_t)n;
    process_frames(s);
    if (s->torn_down || !accepting(s)) return;
  }
}

static void on_poll(uv_poll_t *handle, int status, int events) {
  zd__session_t *s = handle->data;
  if (status < 0) {
    drop_writes(s);
    s->closing = 1;
  } else {
    if (events & UV_WRITABLE) {
      flush(s);
      if (!s->closing) process_frames(s); /* frames held back while replies piled up */
    }
    if (events & UV_READABLE) read_some(s);
  }
  update_poll(s);
  maybe_teardown(s);
}

static void update_poll(zd__session_t *s) {
  if (s->torn_down) return;
  int events = 0;
  if (accepting(s)) events |= UV_READABLE;
  if (s->wq_head) events |= UV_WRITABLE;
  if (events == s->poll_events) return;
  s->poll_events = events;
  if (events)
    uv_poll_start(&s->poll, events, on_poll);
  else
    uv_poll_stop(&s->poll);
}

/* ---- lifecycle ----------------------------------------------------------------------------- */

static void on_handle_closed(uv_handle_t *h) {
  zd__session_t *s = h->data;
  if (--s->open_handles > 0) return;
  zd__daemon_t *d = s->daemon;
  free(s->rbuf);
  free(s);
  zd__daemon_session_gone(d);
}

/* The registered client of a rank of a multi-rank world is leaving (docs/design.md, "When a
 * trainer dies"): its rank is free at once for a restarted trainer, and its last job, after those
 * in flight, stands in for it where the world still needs this rank (ZD__JOB_STAND_IN). */
static void stand_in(zd__session_t *s) {
  if (s->closing && s->state == SESSION_REGISTERING && s->rank)
    zd__rank_abandon_attach(s->rank); /* its registration may wait for the others for minutes */
  if (!s->closing || s->state != SESSION_REGISTERED || s->stood_in ||
      zd__rank_world_size(s->rank) < 2 || zd__daemon_shutting_down(s->daemon))
    return;
  /* A rank whose world broke (degraded, or re-forming it: its worker may wait minutes for a
   * restarted peer) has no step left to stand in for, and its model is dropped or frozen: the
   * client leaves at once. */
  zd__rank_stats_t st;
  zd__rank_stats(s->rank, &st);
  if (st.health != ZD__HEALTH_OK) return;
  zd__job_t *job = job_new(s, ZD__JOB_STAND_IN, &(zd__frame_header_t){0});
  if (!job) return; /* then released at the end, as at world size 1 */
  s->stood_in = 1;
  job->in.abrupt = !s->bye_pending;
  zd__attach_release(s->ss->attach, s, zd__rank_local(s->rank));
  ZD_LOG_INFO("session %u: client '%s' (pid %d) %s; local rank %u released", s->id, s->name,
              (int)s->cred.pid, s->bye_pending ? "said bye" : "disconnected",
              zd__rank_local(s->rank));
  s->inflight++;
  zd__rank_submit(s->rank, job);
}

static void maybe_teardown(zd__session_t *s) {
  stand_in(s);
  if (s->torn_down || !s->closing || s->inflight > 0 || s->wq_head) return;
  if (s->bye_pending) {
    reply_bye(s, s->bye_id);
    if (s->wq_head) {
      update_poll(s);
      return;
    }
  }
  s->torn_down = 1;
  detach(s);
  close_fds(s);
  drop_writes(s);
  zd__sessions_t *ss = s->ss;
  if (s->prev)
    s->prev->next = s->next;
  else
    ss->head = s->next;
  if (s->next) s->next->prev = s->prev;
  ss->n--;
  uv_poll_stop(&s->poll);
  uv_timer_stop(&s->frame_timer);
  uv_timer_stop(&s->hello_timer);
  /* The descriptor is closed only after the poll handle: closing the handle removes the
   * descriptor from libuv's epoll set by number, which after a close may already name another
   * thread's file (a checkpoint's, seen by ThreadSanitizer). */
  uv_close((uv_handle_t *)&s->poll, on_handle_closed);
  close(s->fd);
  uv_close((uv_handle_t *)&s->frame_timer, on_handle_closed);
  uv_close((uv_handle_t *)&s->hello_timer, on_handle_closed);
}

/* A connection that has not said hello in time holds a slot of max_clients for nothing: idle
 * connections must not be able to lock trainers out. */
static void on_hello_timeout(uv_timer_t *t) {
  zd__session_t *s = t->data;
  if (s->state != SESSION_NEW || s->closing) return;
  s->ss->counters.clients_timed_out++;
  fail_stream(s, 0, -1, ZD_EPROTO, "no hello within %u ms (hello_timeout_ms); closing",
              s->cfg->hello_timeout_ms);
  update_poll(s);
  maybe_teardown(s);
}

/* Connections of this uid, this one included. */
static uint32_t sessions_of_uid(const zd__sessions_t *ss, uid_t uid) {
  uint32_t n = 0;
  for (const zd__session_t *x = ss->head; x; x = x->next)
    if (!x->closing && x->cred.uid == uid) n++;
  return n;
}

static int gid_allowed(const zd__config_t *cfg, uint32_t gid) {
  for (uint32_t i = 0; i < cfg->allowed_gids.n; i++)
    if (cfg->allowed_gids.ids[i] == gid) return 1;
  return 0;
}

/* The peer's uid, its primary gid, or any of its supplementary groups (SO_PEERGROUPS: a user
 * added to group zerod is allowed without changing its primary group). */
int zd__peer_allowed(const zd__config_t *cfg, int fd, const struct ucred *cred) {
  for (uint32_t i = 0; i < cfg->allowed_uids.n; i++)
    if (cfg->allowed_uids.ids[i] == (uint32_t)cred->uid) return 1;
  if (gid_allowed(cfg, (uint32_t)cred->gid)) return 1;
  if (cfg->allowed_gids.n == 0) return 0;
  gid_t groups[256];
  socklen_t len = sizeof groups;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) != 0) return 0;
  for (size_t i = 0; i < len / sizeof groups[0]; i++)
    if (gid_allowed(cfg, (uint32_t)groups[i])) return 1;
  return 0;
}

static void format_ids(const zd__idlist_t *ids, char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  for (uint32_t i = 0; i < ids->n && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, "%s%u", i ? ", " : "", ids->ids[i]);
  if (ids->n == 0) snprintf(buf, len, "none");
}

int zd__session_create(zd__sessions_t *ss, int fd, const struct ucred *cred) {
  zd__session_t *s = calloc(1, sizeof *s);
  if (!s) {
    close(fd);
    return -ENOMEM;
  }
  zd__daemon_t *d = ss->d;
  const zd__config_t *cfg = zd__daemon_config(d);
  uv_loop_t *loop = zd__daemon_loop(d);
  s->ss = ss;
  s->daemon = d;
  s->cfg = cfg;
  s->fd = fd;
  s->cred = *cred;
  zd__buffers_init(&s->buf);
  s->id = ++ss->next_id;
  snprintf(s->name, sizeof s->name, "pid %d", (int)cred->pid);
  int rc = uv_poll_init(loop, &s->poll, fd);
  if (rc) {
    close(fd);
    free(s);
    return rc;
  }
  uv_timer_init(loop, &s->frame_timer);
  uv_timer_init(loop, &s->hello_timer);
  s->poll.data = s;
  s->frame_timer.data = s;
  s->hello_timer.data = s;
  s->open_handles = 3;
  s->next = ss->head;
  if (ss->head) ss->head->prev = s;
  ss->head = s;
  ss->n++;
  zd__session_counters_t *n = &ss->counters;
  n->clients_total++;

  if (!zd__peer_allowed(cfg, fd, cred)) {
    char uids[256], gids[256];
    format_ids(&cfg->allowed_uids, uids, sizeof uids);
    format_ids(&cfg->allowed_gids, gids, sizeof gids);
    n->clients_denied++;
    fail_stream(s, 0, -1, ZD_EDENIED,
                "uid %d gid %d (pid %d) is not allowed to use zerod; allowed "
                "uids: %s; allowed gids: %s",
                (int)cred->uid, (int)cred->gid, (int)cred->pid, uids, gids);
  } else if (ss->n > cfg->max_clients) {
    n->clients_refused++;
    fail_stream(s, 0, -1, ZD_EBUSY, "zerod has %u clients connected; max_clients is %u", ss->n - 1,
                cfg->max_clients);
  } else if (sessions_of_uid(ss, cred->uid) > cfg->max_clients_per_uid) {
    n->clients_refused++;
    fail_stream(s, 0, -1, ZD_EBUSY, "uid %d has %u connections to zerod; max_clients_per_uid is %u",
                (int)cred->uid, sessions_of_uid(ss, cred->uid) - 1, cfg->max_clients_per_uid);
  } else {
    ZD_LOG_DEBUG("session %u: connection from pid %d uid %d", s->id, (int)cred->pid,
                 (int)cred->uid);
    uv_timer_start(&s->hello_timer, on_hello_timeout, cfg->hello_timeout_ms, 0);
  }
  update_poll(s);
  maybe_teardown(s);
  return ZD_OK;
}

/* kept: for a failed attach, whether its buffers' mappings were left open
 * (zd__buffers_release). */
static void reply_job(zd__session_t *s, zd__job_t *job, int kept) {
  if (job->type == ZD__JOB_STAND_IN) return; /* no request: nothing to answer */
  if (job->code != ZD_OK) {
    send_error_kept(s, job->request_id, job->code,
                    job->err.msg[0] ? job->err.msg : zd_strerror(job->code),
                    job->type == ZD__JOB_ATTACH ? kept : -1);
    return;
  }
  switch (job->type) {
    case ZD__JOB_ATTACH: {
      Zerod__V1__RegisterReply rep = ZEROD__V1__REGISTER_REPLY__INIT;
      rep.step = job->out.attach.step;
      rep.resumed = job->out.attach.resumed;
      rep.layout_hash = job->out.attach.layout_hash;
      rep.total_elems = job->out.attach.total_elems;
      rep.nbuckets = job->out.attach.nbuckets;
      rep.shard_elems = job->out.attach.shard_elems;
      rep.loss_scale = job->out.attach.loss_scale;
      send_reply(s, job->msg_type, job->request_id, &rep.base);
      break;
    }
    case ZD__JOB_STEP: {
      Zerod__V1__StepReply rep = ZEROD__V1__STEP_REPLY__INIT;
      rep.step = job->out.step.step;
      rep.applied = job->out.step.applied;
      rep.grad_norm = job->out.step.grad_norm;
      rep.loss_scale = job->out.step.loss_scale;
      rep.clip_coef = job->out.step.clip_coef;
      rep.duration_us = job->out.step.duration_us;
      send_reply(s, job->msg_type, job->request_id, &rep.base);
      break;
    }
    case ZD__JOB_SCATTER: {
      Zerod__V1__ScatterReply rep = ZEROD__V1__SCATTER_REPLY__INIT;
      send_reply(s, job->msg_type, job->request_id, &rep.base);
      break;
    }
    case ZD__JOB_GATHER: {
      Zerod__V1__GatherReply rep = ZEROD__V1__GATHER_REPLY__INIT;
      send_reply(s, job->msg_type, job->request_id, &rep.base);
      break;
    }
    case ZD__JOB_CHECKPOINT: {
      Zerod__V1__CheckpointReply rep = ZEROD__V1__CHECKPOINT_REPLY__INIT;
      rep.step = job->out.checkpoint.step;
      rep.dir = job->out.checkpoint.dir;
      send_reply(s, job->msg_type, job->request_id, &rep.base);
      break;
    }
    case ZD__JOB_STAND_IN: /* returned above */
      break;
  }
}

void zd__session_job_done(zd__session_t *s, zd__job_t *job) {
  zd_assert(s->inflight > 0);
  s->inflight--;
  zd__buffers_job_done(&s->buf, job->event_slot);
  int kept = 0;
  if (job->type == ZD__JOB_ATTACH) {
    if (job->code == ZD_OK) {
      s->state = SESSION_REGISTERED;
    } else {
      zd__attach_unattach(s->ss->attach, s, zd__rank_local(s->rank)); /* still reserved */
      kept = zd__buffers_release(&s->buf, s->rank, s->id); /* before the answer: it says so */
      if (s->state == SESSION_REGISTERING) s->state = SESSION_READY;
    }
  }
  if (job->type == ZD__JOB_STAND_IN && job->out.kept) /* the rank holds the param buffer now */
    s->buf.bufs.params = (zd__shm_t){0};
  reply_job(s, job, kept);
  zd__job_free(job);
  if (!s->closing && !s->dispatching) process_frames(s); /* frames held back by max_inflight */
  update_poll(s);
  maybe_teardown(s);
}

pid_t zd__session_pid(const zd__session_t *s) {
  return s->cred.pid;
}
const char *zd__session_name(const zd__session_t *s) {
  return s->name;
}

/* ---- the set of sessions ------------------------------------------------------------------- */

int zd__sessions_create(zd__daemon_t *d, uint32_t nranks, zd__sessions_t **out) {
  zd__sessions_t *ss = calloc(1, sizeof *ss);
  if (!ss || !(ss->attach = zd__attach_new(nranks))) {
    free(ss);
    return -ENOMEM;
  }
  ss->d = d;
  *out = ss;
  return ZD_OK;
}

void zd__sessions_destroy(zd__sessions_t *ss) {
  if (!ss) return;
  zd_assert(!ss->head);
  zd__attach_free(ss->attach);
  free(ss);
}

void zd__sessions_drain(zd__sessions_t *ss) {
  zd__session_t *s = ss->head;
  while (s) {
    zd__session_t *next = s->next;
    s->closing = 1;
    update_poll(s);
    maybe_teardown(s); /* may free s */
    s = next;
  }
}

uint32_t zd__sessions_open(const zd__sessions_t *ss) {
  return ss->n;
}

const zd__session_counters_t *zd__sessions_counters(const zd__sessions_t *ss) {
  return &ss->counters;
}

const zd__session_t *zd__sessions_attached(const zd__sessions_t *ss, uint32_t local) {
  int attached;
  const zd__session_t *s = zd__attach_holder(ss->attach, local, &attached);
  return attached ? s : NULL;
}
