/* Message <-> struct conversions of the local protocol (wire.h): groups from the group table,
 * dtypes from the dtype table, and the loss scaler with its checks. */
#include "wire.h"

#include <math.h>
#include <stdio.h>

#include "dtype.h"
#include "group.h"

#define SAME_DTYPE(id, name, bytes, param, grad) \
  _Static_assert((int)ZEROD__V1__DTYPE__##id == (int)ZD_##id, "wire DType " #id " != ZD_" #id);
ZD__DTYPES(SAME_DTYPE)
_Static_assert((int)ZEROD__V1__OPTIMIZER__ADAMW == (int)ZD_ADAMW, "wire ADAMW != ZD_ADAMW");
_Static_assert((int)ZEROD__V1__OPTIMIZER__ADAM == (int)ZD_ADAM, "wire ADAM != ZD_ADAM");
_Static_assert((int)ZEROD__V1__UPDATE__UPDATE_TORCH113 == (int)ZD_UPDATE_TORCH113,
               "wire UPDATE_TORCH113 != ZD_UPDATE_TORCH113");
_Static_assert((int)ZEROD__V1__UPDATE__UPDATE_TORCH2 == (int)ZD_UPDATE_TORCH2,
               "wire UPDATE_TORCH2 != ZD_UPDATE_TORCH2");
_Static_assert((int)ZEROD__V1__UPDATE__UPDATE_TORCH2_CUDA == (int)ZD_UPDATE_TORCH2_CUDA,
               "wire UPDATE_TORCH2_CUDA != ZD_UPDATE_TORCH2_CUDA");
_Static_assert((int)ZEROD__V1__UPDATE__UPDATE_TORCH2_CUDA_FOREACH ==
                   (int)ZD_UPDATE_TORCH2_CUDA_FOREACH,
               "wire UPDATE_TORCH2_CUDA_FOREACH != ZD_UPDATE_TORCH2_CUDA_FOREACH");
_Static_assert((int)ZEROD__V1__UPDATE__UPDATE_TORCH2_CUDA_FUSED == (int)ZD_UPDATE_TORCH2_CUDA_FUSED,
               "wire UPDATE_TORCH2_CUDA_FUSED != ZD_UPDATE_TORCH2_CUDA_FUSED");
_Static_assert((int)ZEROD__V1__SQRT_MODE__SQRT_EXACT == (int)ZD_SQRT_EXACT,
               "wire SQRT_EXACT != ZD_SQRT_EXACT");
_Static_assert((int)ZEROD__V1__SQRT_MODE__SQRT_MKL_EX == (int)ZD_SQRT_MKL_EX,
               "wire SQRT_MKL_EX != ZD_SQRT_MKL_EX");

/* A kind's value as the wire holds it: a bool is 0 or 1. */
#define WIRE_DOUBLE(x) (x)
#define WIRE_ENUM(x)   (x)
#define WIRE_BOOL(x)   ((x) != 0)

/* Marks every optional field of m present: a sender states every value rather than leaving the
 * receiver to assume a default. */
static void mark_present(ProtobufCMessage *m) {
  const ProtobufCMessageDescriptor *d = m->descriptor;
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    if (f->label == PROTOBUF_C_LABEL_OPTIONAL && f->quantifier_offset)
      *(protobuf_c_boolean *)((char *)m + f->quantifier_offset) = 1;
  }
}

void zd__wire_group_to(Zerod__V1__Group *w, const zd_group_t *g) {
  zerod__v1__group__init(w);
#define TO_WIRE(name, kind, valid, expected, dflt) \
  w->name = (__typeof__(w->name))WIRE_##kind(g->name);
  ZD__GROUP_FIELDS(TO_WIRE)
#undef TO_WIRE
  mark_present(&w->base);
}

int zd__wire_groups_from(zd_group_t *out, Zerod__V1__Group *const *in, size_t n, zd__err_t *err) {
  for (size_t i = 0; i < n; i++) {
    zd_group_t *g = &out[i];
    const Zerod__V1__Group *w = in[i];
#define FROM_WIRE(name, kind, valid, expected, dflt) g->name = (__typeof__(g->name))w->name;
    ZD__GROUP_FIELDS(FROM_WIRE)
#undef FROM_WIRE
    char where[32];
    snprintf(where, sizeof where, "group %zu", i);
    int rc = zd__group_check(g, where, err);
    if (rc) return rc;
  }
  return ZD_OK;
}

Zerod__V1__DType zd__wire_dtype_to(zd_dtype_t dtype) {
  return (Zerod__V1__DType)dtype;
}

zd_dtype_t zd__wire_dtype_from(Zerod__V1__DType dtype) {
  return (zd_dtype_t)dtype;
}

int zd__wire_scaler_from(zd_loss_scaler_t *out, const Zerod__V1__LossScaler *in, zd__err_t *err) {
  *out = (zd_loss_scaler_t){0};
  if (!in) return ZD_OK;
  if (!isfinite(in->initial_scale) || in->initial_scale <= 0)
    return zd__errf(err, ZD_EHPARAM, "loss scaler initial_scale is %g; expected a finite value > 0",
                    in->initial_scale);
  if (!isfinite(in->growth_factor) || in->growth_factor < 1)
    return zd__errf(err, ZD_EHPARAM,
                    "loss scaler growth_factor is %g; expected a finite value >= 1",
                    in->growth_factor);
  if (!(in->backoff_factor > 0 && in->backoff_factor < 1))
    return zd__errf(err, ZD_EHPARAM, "loss scaler backoff_factor is %g; expected a value in (0, 1)",
                    in->backoff_factor);
  if (in->growth_interval < 1 || in->hysteresis < 1)
    return zd__errf(err, ZD_EHPARAM,
                    "loss scaler growth_interval %u and hysteresis %u; both must "
                    "be >= 1",
                    in->growth_interval, in->hysteresis);
  if (!isfinite(in->min_scale) || in->min_scale <= 0)
    return zd__errf(err, ZD_EHPARAM, "loss scaler min_scale is %g; expected a finite value > 0",
                    in->min_scale);
  *out = (zd_loss_scaler_t){.enabled = 1,
                            .initial_scale = in->initial_scale,
                            .growth_factor = in->growth_factor,
                            .backoff_factor = in->backoff_factor,
                            .growth_interval = in->growth_interval,
                            .hysteresis = in->hysteresis,
                            .min_scale = in->min_scale};
  return ZD_OK;
}

Zerod__V1__LossScaler *zd__wire_scaler_to(Zerod__V1__LossScaler *w, const zd_loss_scaler_t *s) {
  if (!s->enabled) return NULL;
  zerod__v1__loss_scaler__init(w);
  w->initial_scale = s->initial_scale;
  w->growth_factor = s->growth_factor;
  w->backoff_factor = s->backoff_factor;
  w->growth_interval = s->growth_interval;
  w->hysteresis = s->hysteresis;
  w->min_scale = s->min_scale;
  return w;
}
