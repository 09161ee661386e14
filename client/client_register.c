/* libzerod's model: zd_layout() (the layout, the client's copy of the description, and zeroed
 * buffers), zd_register() (the register request, which hands the buffers to zerod, and its
 * reply), and the queries on the layout. Host buffers are sealed memfds (the daemon refuses
 * buffers that could shrink under it) passed with SCM_RIGHTS along the register frame; device
 * buffers are client_cuda.c's, and travel in the request as CUDA IPC handles.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "client_internal.h"
#include "dtype.h"
#include "placement.h"
#include "wire.h"

/* ---- buffers and layout -------------------------------------------------------------------- */

/* Mapped at `colour` (placement.h): the trainer streams the two buffers together (its optimizer
 * hook copies grads in while zerod's params are read out), and zerod maps them at the same colours
 * for its step. */
static int create_buffer(const char *name, size_t bytes, unsigned colour, int *fd, void **addr) {
  *fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (*fd < 0) return zd__fail(-errno, "memfd_create(%s): %s", name, strerror(errno));
  if (ftruncate(*fd, (off_t)bytes) != 0 ||
      fcntl(*fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    int e = errno;
    close(*fd);
    *fd = -1;
    return zd__fail(-e, "cannot size %s to %zu bytes: %s", name, bytes, strerror(e));
  }
  int rc = zd__place_fd(*fd, bytes ? bytes : 1, colour, addr);
  if (rc) {
    close(*fd);
    *fd = -1;
    return zd__fail(rc, "cannot map %s (%zu bytes): %s", name, bytes, strerror(-rc));
  }
  return ZD_OK;
}

void zd__release_buffers(zd_client_t *c) {
  if (c->memory == ZD_MEMORY_CUDA) {
    zd__cuda_release(c);
  } else {
    if (c->memory == ZD_MEMORY_HOST_PINNED) zd__cuda_unpin(c);
    zd__place_release(c->params, c->param_bytes);
    zd__place_release(c->grads, c->grad_bytes);
  }
  c->memory = ZD_MEMORY_HOST;
  c->stream = NULL;
  if (c->param_fd >= 0) close(c->param_fd);
  if (c->grad_fd >= 0) close(c->grad_fd);
  c->params = c->grads = NULL;
  c->param_fd = c->grad_fd = -1;
  zd__layout_free(c->layout);
  c->layout = NULL;
  free(c->groups);
  c->groups = NULL;
}

int zd_layout(zd_client_t *c, const zd_model_desc_t *caller_desc) {
  if (!c || !caller_desc) return zd__fail(-EINVAL, "zd_layout: client and desc are required");
  if (c->registered) return zd__fail(ZD_EORDER, "zd_layout after zd_register: the model is fixed");
  zd_model_desc_t full; /* the caller's, by its size, with the defaults of what it lacks */
  zd_loss_scaler_t scaler;
  int rc = zd__read_model_desc(caller_desc, &full);
  if (rc || (rc = zd__read_loss_scaler(full.loss_scaler, &scaler))) return rc;
  const zd_model_desc_t *desc = &full;
  zd__err_t err = {0};
  if (zd__dtype_check(desc->param_dtype, ZD__DTYPE_PARAM, &err) ||
      zd__dtype_check(desc->grad_dtype, ZD__DTYPE_GRAD, &err))
    return zd__fail(err.code, "%s", err.msg);
  if (!desc->groups || desc->ngroups == 0)
    return zd__fail(ZD_EGROUP, "model has no parameter groups; expected at least 1");
  if (desc->ngroups > UINT32_MAX) return zd__fail(-EINVAL, "too many groups");
  if (desc->nparams > ZD__MAX_PARAMS) /* before the copy of the parameters */
    return zd__fail(-EINVAL, "model has %zu parameters; at most %u supported", desc->nparams,
                    ZD__MAX_PARAMS);
  if (!desc->params && desc->nparams)
    return zd__fail(-EINVAL, "zd_model_desc_t.params is NULL; nparams is %zu", desc->nparams);
  if (desc->memory != ZD_MEMORY_HOST && desc->memory != ZD_MEMORY_CUDA &&
      desc->memory != ZD_MEMORY_HOST_PINNED)
    return zd__fail(-EINVAL,
                    "zd_model_desc_t.memory is %d; expected ZD_MEMORY_HOST (0), "
                    "ZD_MEMORY_CUDA (1) or ZD_MEMORY_HOST_PINNED (2)",
                    (int)desc->memory);
  if (desc->grad_reduce != ZD_GRAD_MEAN && desc->grad_reduce != ZD_GRAD_SUM)
    return zd__fail(-EINVAL,
                    "zd_model_desc_t.grad_reduce is %d; expected ZD_GRAD_MEAN (0) or "
                    "ZD_GRAD_SUM (1)",
                    (int)desc->grad_reduce);
  int cuda = desc->memory == ZD_MEMORY_CUDA;
  if (cuda != (strcmp(c->info.backend, "cuda") == 0))
    return zd__fail(
        ZD_EBACKEND,
        cuda ? "zerod runs its %s backend, which takes host buffers only: "
               "device buffers (ZD_MEMORY_CUDA) need a zerod with backend cuda"
             : "zerod runs its %s backend, which takes CUDA device buffers "
               "only: set zd_model_desc_t.memory = ZD_MEMORY_CUDA (the device: zd_cuda_device())",
        c->info.backend);
  if (cuda && !ZD__HAVE_CUDA)
    return zd__fail(ZD_EBACKEND, "this libzerod was built without CUDA: no device buffers");
  int pinned = desc->memory == ZD_MEMORY_HOST_PINNED;
  if (pinned && !ZD__HAVE_CUDA)
    return zd__fail(ZD_EBACKEND,
                    "this libzerod was built without CUDA: it cannot pin host buffers "
                    "(ZD_MEMORY_HOST_PINNED); use ZD_MEMORY_HOST, or a libzerod built with CUDA");
  zd__release_buffers(c);
  zd_param_t *params;
  if ((rc = zd__read_params(desc->params, desc->nparams, desc->param_size, &params))) return rc;
  rc = zd__layout_build(params, (uint32_t)desc->nparams, (uint32_t)desc->ngroups,
                        c->info.world_size, c->info.bucket_elems, &c->layout, &err);
  free(params); /* the layout keeps copies of the names */
  if (rc) return zd__fail(rc, "%s", err.msg);
  c->groups = malloc(desc->ngroups * sizeof *c->groups);
  if (!c->groups) {
    zd__release_buffers(c);
    return zd__fail(-ENOMEM, "out of memory");
  }
  zd__read_groups(c->groups, desc->groups, desc->ngroups, desc->group_size);
  c->ngroups = (uint32_t)desc->ngroups;
  c->param_dtype = desc->param_dtype;
  c->grad_dtype = desc->grad_dtype;
  c->max_grad_norm = desc->max_grad_norm;
  c->grad_reduce = desc->grad_reduce;
  c->loss_scaler = scaler;
  c->flags = desc->flags;
  c->param_bytes = c->layout->total_elems * zd_dtype_size(desc->param_dtype);
  c->grad_bytes = c->layout->total_elems * zd_dtype_size(desc->grad_dtype);
  if (cuda)
    rc = zd__cuda_create_buffers(c, desc->device);
  else if (!(rc = create_buffer("zerod-params", c->param_bytes, ZD__COLOUR_PARAMS, &c->param_fd,
                                &c->params)))
    rc = create_buffer("zerod-grads", c->grad_bytes, ZD__COLOUR_GRADS, &c->grad_fd, &c->grads);
  if (!rc && pinned) rc = zd__cuda_pin(c, desc->device);
  if (rc) {
    zd__release_buffers(c);
    return rc;
  }
  c->info.layout_hash = c->layout->hash;
  c->info.total_elems = c->layout->total_elems;
  c->info.nbuckets = c->layout->nbuckets;
  return ZD_OK;
}

int zd_register(zd_client_t *c) {
  if (!c) return zd__fail(-EINVAL, "zd_register: client is NULL");
  if (!c->layout) return zd__fail(ZD_EORDER, "zd_register before zd_layout");
  if (c->registered) return zd__fail(ZD_EORDER, "model already registered on this client");
  const zd__layout_t *l = c->layout;
  int rc = -ENOMEM;
  Zerod__V1__Param *params = calloc(l->nparams, sizeof *params);
  Zerod__V1__Param **pp = calloc(l->nparams, sizeof *pp);
  Zerod__V1__Group *groups = calloc(c->ngroups, sizeof *groups);
  Zerod__V1__Group **gp = calloc(c->ngroups, sizeof *gp);
  if (!params || !pp || !groups || !gp) {
    zd__fail(rc, "out of memory");
    goto exit;
  }
  for (uint32_t i = 0; i < l->nparams; i++) {
    zerod__v1__param__init(&params[i]);
    params[i].name = l->params[i].name;
    params[i].n_shape = l->params[i].ndim;
    params[i].shape = (uint64_t *)l->params[i].shape;
    params[i].group = l->params[i].group;
    pp[i] = &params[i];
  }
  for (uint32_t g = 0; g < c->ngroups; g++) {
    zd__wire_group_to(&groups[g], &c->groups[g]);
    gp[g] = &groups[g];
  }
  Zerod__V1__RegisterRequest req = ZEROD__V1__REGISTER_REQUEST__INIT;
  Zerod__V1__LossScaler scaler;
  req.n_params = l->nparams;
  req.params = pp;
  req.n_groups = c->ngroups;
  req.groups = gp;
  req.param_dtype = zd__wire_dtype_to(c->param_dtype);
  req.grad_dtype = zd__wire_dtype_to(c->grad_dtype);
  req.layout_hash = l->hash;
  req.has_max_grad_norm = 1;
  req.max_grad_norm = c->max_grad_norm;
  req.has_grad_mean = 1;
  req.grad_mean = c->grad_reduce != ZD_GRAD_SUM; /* the wire keeps its boolean */
  req.has_replace = 1;
  req.replace = (c->flags & ZD_REGISTER_REPLACE) != 0;
  req.has_grow = (c->flags & ZD_REGISTER_GROW) != 0;
  req.grow = req.has_grow;
  req.loss_scaler = zd__wire_scaler_to(&scaler, &c->loss_scaler);
  int fds[2] = {c->param_fd, c->grad_fd}, nfds = 2, slot = -1;
  Zerod__V1__CudaBuffers cb = ZEROD__V1__CUDA_BUFFERS__INIT;
  ProtobufCBinaryData grh[ZD__EVENT_SLOTS], prh[ZD__EVENT_SLOTS];
  if (c->memory == ZD_MEMORY_CUDA) {
    cb.has_device = 1;
    cb.device = c->device;
    cb.has_device_uuid = 1;
    cb.device_uuid = (ProtobufCBinaryData){sizeof c->uuid, c->uuid};
    cb.has_param_handle = 1;
    cb.param_handle = (ProtobufCBinaryData){sizeof c->param_handle, c->param_handle};
    cb.has_grad_handle = 1;
    cb.grad_handle = (ProtobufCBinaryData){sizeof c->grad_handle, c->grad_handle};
    for (int k = 0; k < ZD__EVENT_SLOTS; k++) {
      grh[k] = (ProtobufCBinaryData){sizeof c->grads_ready_handle[k], c->grads_ready_handle[k]};
      prh[k] = (ProtobufCBinaryData){sizeof c->params_ready_handle[k], c->params_ready_handle[k]};
    }
    cb.n_grads_ready = cb.n_params_ready = ZD__EVENT_SLOTS;
    cb.grads_ready = grh;
    cb.params_ready = prh;
    req.cuda = &cb;
    nfds = 0;
    if ((rc = zd__cuda_before_request(c, &slot))) goto exit; /* the initial values come first */
    req.has_event_slot = 1;
    req.event_slot = (uint32_t)slot;
  }
  uint8_t *body = NULL;
  uint32_t len = 0;
  uint64_t id;
  rc = zd__start(c, ZD__MSG_REGISTER, &req.base, fds, nfds, slot, &id);
  if (rc) goto exit; /* not sent whole: zerod opened nothing */
  if (c->memory == ZD_MEMORY_CUDA) c->exported = 1;
  rc = zd__await(c, id, &body, &len, -1);
  zd__pending_t *p = zd__find_pending(c, id);
  int answered = p && p->done;
  if (rc) {
    /* zerod says whether it still holds the handles this register sent (it keeps them only
     * when its stream may still use them); without an answer, or an answer that does not say,
     * it may. No wait on "params ready": zerod's work on the buffers is over if it closed them,
     * and if it kept them that work may never end. */
    if (c->memory == ZD_MEMORY_CUDA) {
      if (answered && p->mappings_kept == 0 && !c->kept)
        c->exported = 0;
      else
        c->kept = 1;
    }
    if (answered) zd__forget_pending(c, p);
    goto exit;
  }
  /* the model zerod wrote comes before the stream's next work */
  int crc = zd__cuda_after_reply(c, slot);
  if (answered) zd__forget_pending(c, p);
  Zerod__V1__RegisterReply *rep = zerod__v1__register_reply__unpack(NULL, len, body);
  free(body);
  if (!rep) {
    rc = zd__fail(ZD_EPROTO, "malformed register reply from zerod");
    goto exit;
  }
  c->info.step = rep->step;
  c->info.resumed = rep->resumed;
  c->info.loss_scale = rep->loss_scale;
  c->registered = 1;
  zerod__v1__register_reply__free_unpacked(rep, NULL);
  rc = crc;
exit:
  free(gp);
  free(groups);
  free(pp);
  free(params);
  return rc;
}

void *zd_param_buffer(zd_client_t *c, size_t *bytes) {
  if (bytes) *bytes = c ? c->param_bytes : 0;
  return c ? c->params : NULL;
}

void *zd_grad_buffer(zd_client_t *c, size_t *bytes) {
  if (bytes) *bytes = c ? c->grad_bytes : 0;
  return c ? c->grads : NULL;
}

int zd_param_info(const zd_client_t *c, size_t index, zd_param_info_t *out) {
  if (!out) return zd__fail(-EINVAL, "zd_param_info: out is NULL");
  int rc = ZD__CHECK_FILLED(out, zd_param_info_t, ZD_PARAM_INFO_INIT);
  if (rc) return rc;
  if (!c || !c->layout || index >= c->layout->nparams)
    return zd__fail(-EINVAL, "parameter %zu does not exist (call zd_layout first; %u parameters)",
                    index, c && c->layout ? c->layout->nparams : 0);
  const zd__layout_param_t *p = &c->layout->params[index];
  zd_param_info_t full = {.name = p->name,
                          .offset = p->offset,
                          .numel = p->numel,
                          .bucket = p->bucket,
                          .group = p->group};
  zd__write_filled(out, &full);
  return ZD_OK;
}

int zd_bucket_info(const zd_client_t *c, size_t index, zd_bucket_info_t *out) {
  if (!out) return zd__fail(-EINVAL, "zd_bucket_info: out is NULL");
  int rc = ZD__CHECK_FILLED(out, zd_bucket_info_t, ZD_BUCKET_INFO_INIT);
  if (rc) return rc;
  if (!c || !c->layout || index >= c->layout->nbuckets)
    return zd__fail(-EINVAL, "bucket %zu does not exist (call zd_layout first; %u buckets)", index,
                    c && c->layout ? c->layout->nbuckets : 0);
  const zd__bucket_t *b = &c->layout->buckets[index];
  zd_bucket_info_t full = {.offset = b->offset,
                           .elems = b->elems,
                           .shard_offset = b->offset + (uint64_t)c->info.rank * b->shard_elems,
                           .shard_elems = b->shard_elems};
  zd__write_filled(out, &full);
  return ZD_OK;
}

int zd_get_info(const zd_client_t *c, zd_info_t *out) {
  if (!c || !out) return zd__fail(-EINVAL, "zd_get_info: client and out are required");
  int rc = ZD__CHECK_FILLED(out, zd_info_t, ZD_INFO_INIT);
  if (rc) return rc;
  zd__write_filled(out, &c->info);
  return ZD_OK;
}

/* ---- device buffers: what does not need CUDA ----------------------------------------------- */

int zd_set_stream(zd_client_t *c, void *stream) {
  if (!c) return zd__fail(-EINVAL, "zd_set_stream: client is NULL");
  if (c->memory != ZD_MEMORY_CUDA)
    return zd__fail(ZD_EORDER,
                    "zd_set_stream: the client has no device buffers (zd_layout with "
                    "ZD_MEMORY_CUDA first)");
  if (stream == c->stream) return ZD_OK;
  int rc = stream ? zd__cuda_check_stream(c, stream) : ZD_OK;
  if (rc) return rc;
  c->stream = stream;
  return ZD_OK;
}

int zd_cuda_device(const zd_client_t *c, int *device) {
  if (!c || !device) return zd__fail(-EINVAL, "zd_cuda_device: client and device are required");
  if (!c->has_rank_gpu)
    return zd__fail(ZD_EBACKEND, "zerod runs the %s backend: local rank %u has no GPU",
                    c->info.backend, c->info.local_rank);
  return zd__cuda_find_device(c, device);
}
