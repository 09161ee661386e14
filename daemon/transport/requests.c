/* The command table of the client protocol and its request handlers (hello, register, step,
 * scatter, gather, checkpoint, status, bye): each checks its request, then answers at once or
 * makes a job of it (jobs.c runs and answers it). */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "dtype.h"
#include "log.h"
#include "session_internal.h"
#include "status.h"
#include "wire.h"
#include "zerod.pb-c.h"

static int handle_hello(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                        zd__err_t *err) {
  const zd__sessions_env_t *env = &s->ss->env;
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
  uint32_t nranks = env->ranks->n;
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
  s->rank = env->ranks->rank[local];
  s->state = SESSION_READY;
  uv_timer_stop(&s->hello_timer);
  ZD_LOG_DEBUG("session %u: client '%s' (pid %d, uid %d) for local rank %u (rank %u)", s->id,
               s->name, (int)s->cred.pid, (int)s->cred.uid, local, zd__rank_global(s->rank));

  Zerod__V1__HelloReply rep = ZEROD__V1__HELLO_REPLY__INIT;
  rep.version = ZD_PROTOCOL_VERSION;
  rep.daemon_version = (char *)ZD_VERSION;
  rep.world_size = zd__rank_world_size(s->rank);
  rep.rank = zd__rank_global(s->rank);
  rep.local_rank = local;
  rep.bucket_elems = env->cfg->bucket_elems;
  rep.has_overlap_update = env->cfg->overlap_update != 0;
  rep.overlap_update = env->cfg->overlap_update != 0;
  rep.backend = (char *)zd__backend_name(env->backend->kind);
  const zd__gpu_info_t *gpu = zd__rank_gpu(s->rank);
  if (gpu) { /* CUDA backend: the client checks its buffers' GPU against this one */
    rep.has_device = 1;
    rep.device = gpu->device;
    rep.has_device_uuid = 1;
    rep.device_uuid.data = (uint8_t *)gpu->uuid;
    rep.device_uuid.len = sizeof gpu->uuid;
  }
  zd__session_reply(s, h->type, h->request_id, &rep.base);
exit:
  zerod__v1__hello_request__free_unpacked(req, NULL);
  return rc;
}

/* Builds the model spec of a register request; validates everything that does not need state. */
static int spec_from(zd__session_t *s, const Zerod__V1__RegisterRequest *req,
                     zd__model_spec_t *spec, zd__err_t *err) {
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
  spec->grow = req->grow;
  if (spec->grow && spec->replace)
    return zd__errf(err, -EINVAL,
                    "register with both replace and grow: replace discards the "
                    "state that grow keeps; pass one");
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
  uint32_t world_size = zd__rank_world_size(s->rank);
  uint64_t bucket_elems = s->cfg->bucket_elems;
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

static int handle_register(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                           zd__err_t *err) {
  if (s->state != SESSION_READY) {
    zd__session_close_fds(s);
    return zd__errf(err, ZD_EORDER, "a model is already registered on this connection");
  }
  if (s->ss->refuse_by[0]) {
    zd__session_close_fds(s);
    return zd__errf(err, ZD_ESHUTDOWN,
                    "zerod is draining (zeroctl drain from %s): it shuts down once its checkpoint "
                    "is complete; register with the zerod that replaces it",
                    s->ss->refuse_by);
  }
  Zerod__V1__RegisterRequest *req = zerod__v1__register_request__unpack(NULL, h->length, body);
  if (!req) {
    zd__session_close_fds(s);
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
  const zd__backend_t *backend = s->ss->env.backend;
  rc = req->cuda ? zd__buffers_open_cuda(&s->buf, backend, local, req->cuda, s->nfds, spec, err)
                 : zd__buffers_map_host(&s->buf, backend, local, s->fds, s->nfds, spec, err);
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
  job = zd__job_new(s, ZD__JOB_ATTACH, h);
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
  s->nparams = spec->layout->nparams;
  job->in.spec = spec;
  zd__session_close_fds(s);
  zerod__v1__register_request__free_unpacked(req, NULL);
  s->state = SESSION_REGISTERING;
  zd__job_submit(s, job);
  return ZD_OK;

fail:
  zd__buffers_release(&s->buf, s->rank, s->id);
  zd__model_spec_free(spec);
  zd__session_close_fds(s);
  zerod__v1__register_request__free_unpacked(req, NULL);
  return rc;
}

static int check_bucket(const zd__session_t *s, int32_t bucket, zd__err_t *err) {
  if (bucket < -1 || bucket >= (int32_t)s->nbuckets)
    return zd__errf(err, -EINVAL, "bucket %d does not exist; expected -1 (all) or 0..%u", bucket,
                    s->nbuckets - 1);
  return ZD_OK;
}

/* The groups a step or a scatter carries (n of them: 0, or the model's number), decoded and
 * checked into *out (NULL for none; the caller frees it). */
static int request_groups(const zd__session_t *s, const char *what, Zerod__V1__Group *const *in,
                          size_t n, zd_group_t **out, zd__err_t *err) {
  *out = NULL;
  if (!n) return ZD_OK;
  if (n != s->ngroups)
    return zd__errf(err, ZD_EGROUP, "%s carries %zu groups; the model has %u", what, n, s->ngroups);
  zd_group_t *groups = calloc(n, sizeof *groups);
  if (!groups) return zd__errf(err, -ENOMEM, "out of memory");
  int rc = zd__wire_groups_from(groups, in, n, err);
  if (rc) {
    free(groups);
    return rc;
  }
  *out = groups;
  return ZD_OK;
}

/* A step's bitmap of parameters without a gradient (StepRequest.absent), checked against the
 * registered layout into *out (NULL when the request carries none, or none of its bits is set:
 * the step's common case; the caller frees it). */
static int request_absent(const zd__session_t *s, int has, const ProtobufCBinaryData *in,
                          uint8_t **out, zd__err_t *err) {
  *out = NULL;
  if (!has) return ZD_OK;
  size_t want = ((size_t)s->nparams + 7) / 8;
  if (in->len != want)
    return zd__errf(err, -EINVAL,
                    "step's absent bitmap has %zu bytes; the model has %u parameters, so %zu",
                    in->len, s->nparams, want);
  if (s->nparams % 8 && in->data[want - 1] >> (s->nparams % 8))
    return zd__errf(err, -EINVAL,
                    "step's absent bitmap sets a bit past parameter %u (the model's last)",
                    s->nparams - 1);
  int any = 0;
  for (size_t i = 0; i < want && !any; i++) any = in->data[i] != 0;
  if (!any) return ZD_OK;
  if (!(*out = malloc(want))) return zd__errf(err, -ENOMEM, "out of memory");
  memcpy(*out, in->data, want);
  return ZD_OK;
}

static int handle_step(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                       zd__err_t *err) {
  Zerod__V1__StepRequest *req = zerod__v1__step_request__unpack(NULL, h->length, body);
  if (!req) return zd__errf(err, ZD_EPROTO, "malformed step body (%u bytes)", h->length);
  zd_group_t *groups = NULL;
  uint8_t *absent = NULL;
  int rc = request_groups(s, "step", req->groups, req->n_groups, &groups, err);
  if (rc) goto exit;
  if ((int)req->clip_norm < ZEROD__V1__CLIP_NORM__CLIP_NORM_DOUBLE ||
      (int)req->clip_norm > ZEROD__V1__CLIP_NORM__CLIP_NORM_TORCH215) {
    rc = zd__errf(err, ZD_EHPARAM,
                  "clip_norm is %d; expected 0 (double), 1 (torch 1.13), 2 (torch 2.6) or 3 "
                  "(torch 2.15)",
                  (int)req->clip_norm);
    goto exit;
  }
  rc = request_absent(s, req->has_absent, &req->absent, &absent, err);
  if (rc) goto exit;
  uint32_t slot;
  rc = zd__buffers_event_slot(&s->buf, zd__buffers_cuda(&s->buf), "step", req->has_event_slot,
                              req->event_slot, &slot, err);
  if (rc) goto exit;
  zd__job_t *job = zd__job_new(s, ZD__JOB_STEP, h);
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
  job->in.step.absent = absent;
  groups = NULL;
  absent = NULL;
  zd__job_submit(s, job);
exit:
  free(groups);
  free(absent);
  zerod__v1__step_request__free_unpacked(req, NULL);
  return rc;
}

/* The job of a scatter or gather of `bucket` (-1: all), once its event slot and bucket check;
 * it takes `groups` (a scatter's; NULL: none) when it is queued. */
static int bucket_job(zd__session_t *s, const zd__frame_header_t *h, zd__job_type_t type,
                      const char *what, int32_t bucket, int has_slot, uint32_t slot_in,
                      zd_group_t *groups, zd__err_t *err) {
  uint32_t slot;
  int rc = zd__buffers_event_slot(&s->buf, zd__buffers_cuda(&s->buf), what, has_slot, slot_in,
                                  &slot, err);
  if (!rc) rc = check_bucket(s, bucket, err);
  if (rc) return rc;
  zd__job_t *job = zd__job_new(s, type, h);
  if (!job) return zd__errf(err, -ENOMEM, "out of memory");
  job->event_slot = slot;
  job->in.bucket = bucket;
  job->next_groups = groups;
  zd__job_submit(s, job);
  return ZD_OK;
}

static int handle_scatter(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                          zd__err_t *err) {
  Zerod__V1__ScatterRequest *req = zerod__v1__scatter_request__unpack(NULL, h->length, body);
  if (!req) return zd__errf(err, ZD_EPROTO, "malformed scatter body (%u bytes)", h->length);
  zd_group_t *groups = NULL;
  int rc = request_groups(s, "scatter", req->groups, req->n_groups, &groups, err);
  if (!rc)
    rc = bucket_job(s, h, ZD__JOB_SCATTER, "scatter", req->bucket, req->has_event_slot,
                    req->event_slot, groups, err);
  if (rc) free(groups); /* else the job's */
  zerod__v1__scatter_request__free_unpacked(req, NULL);
  return rc;
}

static int handle_gather(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                         zd__err_t *err) {
  Zerod__V1__GatherRequest *req = zerod__v1__gather_request__unpack(NULL, h->length, body);
  if (!req) return zd__errf(err, ZD_EPROTO, "malformed gather body (%u bytes)", h->length);
  int rc = bucket_job(s, h, ZD__JOB_GATHER, "gather", req->bucket, req->has_event_slot,
                      req->event_slot, NULL, err);
  zerod__v1__gather_request__free_unpacked(req, NULL);
  return rc;
}

static int handle_checkpoint(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                             zd__err_t *err) {
  Zerod__V1__CheckpointRequest *req = zerod__v1__checkpoint_request__unpack(NULL, h->length, body);
  if (!req) return zd__errf(err, ZD_EPROTO, "malformed checkpoint body (%u bytes)", h->length);
  int wait = req->wait;
  zerod__v1__checkpoint_request__free_unpacked(req, NULL);
  zd__job_t *job = zd__job_new(s, ZD__JOB_CHECKPOINT, h);
  if (!job) return zd__errf(err, -ENOMEM, "out of memory");
  job->in.wait = wait;
  zd__job_submit(s, job);
  return ZD_OK;
}

static int handle_status(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                         zd__err_t *err) {
  (void)body;
  zd__status_t *st = zd__status_collect(s->ss->env.status);
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
  zd__session_reply(s, h->type, h->request_id, &rep.base);
exit:
  free(entp);
  free(ents);
  free(secp);
  free(secs);
  zd__status_free(st);
  return rc;
}

static int handle_bye(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                      zd__err_t *err) {
  (void)body, (void)err;
  s->closing = 1; /* read nothing after bye */
  s->bye_pending = 1;
  s->bye_id = h->request_id;
  zd__job_stand_in(s);
  if (s->inflight == 0) zd__session_reply_bye(s, h->request_id);
  return ZD_OK;
}

/* type, handler, what must come first, largest body (0: max_frame_bytes). Names come from the
 * message list (ZD__MSG_MAP, proto/frame.h). */
static const command_t commands[] = {
    {ZD__MSG_HELLO, handle_hello, CMD_ANY, 4096},
    {ZD__MSG_REGISTER, handle_register, CMD_NEEDS_HELLO, 0},
    {ZD__MSG_STEP, handle_step, CMD_NEEDS_MODEL, 1u << 20},
    {ZD__MSG_SCATTER, handle_scatter, CMD_NEEDS_MODEL, 1u << 20},
    {ZD__MSG_GATHER, handle_gather, CMD_NEEDS_MODEL, 64},
    {ZD__MSG_STATUS, handle_status, CMD_ANY, 64},
    {ZD__MSG_BYE, handle_bye, CMD_ANY, 64},
    {ZD__MSG_CHECKPOINT, handle_checkpoint, CMD_NEEDS_MODEL, 64},
};
#define NCOMMANDS (sizeof commands / sizeof commands[0])

const command_t *zd__session_command(uint16_t type) {
  for (size_t i = 0; i < NCOMMANDS; i++)
    if (commands[i].type == type) return &commands[i];
  return NULL;
}

void zd__session_commands(char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  for (size_t i = 0; i < NCOMMANDS && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, "%s%s (%u)", i ? ", " : "",
                             zd__msg_name(commands[i].type), commands[i].type);
}