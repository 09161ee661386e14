/* libzerod's binary interface beyond its function signatures: the structures that grow and the
 * table of constants.
 *
 * Every public structure that may gain fields carries its size, and every array of structures its
 * element size (zerod.h, "A growing ABI"; docs/abi.md): the functions here check a size the caller
 * gives, read a caller's structure or array over the defaults (the fields beyond its size keep
 * them), and write the library's structure into the caller's up to its size. The rest of libzerod
 * works on full-size copies and never sees a caller's size. zd_constants() is the table of the
 * headers' integer constants that bindings read instead of copying them (tests/lint checks that it
 * names every one).
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"
#include "group.h"

/* The end of a field: a structure of at least this size holds it. */
#define END_OF(type, field) (offsetof(type, field) + sizeof(((type *)0)->field))

/* The smallest size of each structure the caller fills: the end of its last required field. */
#define MIN_MODEL_DESC  END_OF(zd_model_desc_t, grad_dtype)
#define MIN_STEP_OPTS   END_OF(zd_step_opts_t, group_size)
#define MIN_GROUP       ZD__GROUP_MIN_SIZE
#define MIN_PARAM       sizeof(zd_param_t)
#define MIN_LOSS_SCALER sizeof(zd_loss_scaler_t)
/* The library fills the others: any size that holds `size` itself. */
#define MIN_FILLED sizeof(size_t)

_Static_assert(MIN_MODEL_DESC % _Alignof(zd_model_desc_t) == 0, "zd_model_desc_t minimum");
_Static_assert(MIN_STEP_OPTS % _Alignof(zd_step_opts_t) == 0, "zd_step_opts_t minimum");
_Static_assert(MIN_GROUP % _Alignof(zd_group_t) == 0, "zd_group_t minimum");
/* zerod.h promises sizes in steps of 8: every versioned structure is 8-aligned. */
_Static_assert(_Alignof(zd_model_desc_t) == 8 && _Alignof(zd_step_opts_t) == 8 &&
                   _Alignof(zd_group_t) == 8 && _Alignof(zd_param_t) == 8 &&
                   _Alignof(zd_loss_scaler_t) == 8 && _Alignof(zd_info_t) == 8 &&
                   _Alignof(zd_param_info_t) == 8 && _Alignof(zd_bucket_info_t) == 8 &&
                   _Alignof(zd_step_result_t) == 8,
               "a versioned structure that is not 8-aligned");

/* ZD_OK when `size`, which the caller gives as `what`, is one this library takes for a structure
 * of min..max bytes; -EINVAL otherwise, with a message that says how to set it (`how`). */
static int check_size(const char *what, size_t size, size_t min, size_t max, const char *how) {
  if (size >= min && size <= max && size % 8 == 0) return ZD_OK;
  if (size > max)
    return zd__fail(-EINVAL,
                    "%s is %zu; this libzerod (%s) takes %zu to %zu bytes: the caller was built "
                    "against a newer zerod.h, which needs a libzerod at least as new",
                    what, size, ZD_VERSION_STRING, min, max);
  return zd__fail(-EINVAL,
                  "%s is %zu; this libzerod (%s) takes %zu to %zu bytes in steps of 8 (%s)", what,
                  size, ZD_VERSION_STRING, min, max, how);
}

/* Reads n elements of `size` bytes (checked) from `in` into `out`, whose elements hold the
 * defaults: each element's fields within `size` replace them. */
static void read_array(void *out, size_t out_size, const void *in, size_t size, size_t n) {
  for (size_t i = 0; i < n; i++)
    memcpy((char *)out + i * out_size, (const char *)in + i * size, size);
}

int zd__read_model_desc(const zd_model_desc_t *in, zd_model_desc_t *out) {
  *out = (zd_model_desc_t){0};
  int rc = check_size("zd_model_desc_t.size", in->size, MIN_MODEL_DESC, sizeof *out,
                      "initialise it with ZD_MODEL_DESC_INIT");
  if (rc) return rc;
  memcpy(out, in, in->size);
  out->size = sizeof *out;
  if ((rc = check_size("zd_model_desc_t.param_size", out->param_size, MIN_PARAM, sizeof(zd_param_t),
                       "sizeof(zd_param_t); ZD_MODEL_DESC_INIT sets it")) ||
      (rc = check_size("zd_model_desc_t.group_size", out->group_size, MIN_GROUP, sizeof(zd_group_t),
                       "sizeof(zd_group_t); ZD_MODEL_DESC_INIT sets it")))
    return rc;
  return ZD_OK;
}

int zd__read_step_opts(const zd_step_opts_t *in, zd_step_opts_t *out) {
  *out = (zd_step_opts_t){.size = sizeof *out, .group_size = sizeof(zd_group_t)};
  if (!in) return ZD_OK;
  int rc = check_size("zd_step_opts_t.size", in->size, MIN_STEP_OPTS, sizeof *out,
                      "initialise it with ZD_STEP_OPTS_INIT");
  if (rc) return rc;
  memcpy(out, in, in->size);
  out->size = sizeof *out;
  if (out->groups)
    rc = check_size("zd_step_opts_t.group_size", out->group_size, MIN_GROUP, sizeof(zd_group_t),
                    "sizeof(zd_group_t); ZD_STEP_OPTS_INIT sets it");
  return rc;
}

int zd__read_loss_scaler(const zd_loss_scaler_t *in, zd_loss_scaler_t *out) {
  *out = (zd_loss_scaler_t){.size = sizeof *out}; /* disabled */
  if (!in) return ZD_OK;
  int rc = check_size("zd_loss_scaler_t.size", in->size, MIN_LOSS_SCALER, sizeof *out,
                      "initialise it with ZD_LOSS_SCALER_INIT");
  if (rc) return rc;
  memcpy(out, in, in->size);
  out->size = sizeof *out;
  return ZD_OK;
}

void zd__read_groups(zd_group_t *out, const zd_group_t *in, size_t n, size_t group_size) {
  zd_group_t def = zd__group_default();
  for (size_t i = 0; i < n; i++) out[i] = def;
  read_array(out, sizeof *out, in, group_size, n);
}

int zd__read_params(const zd_param_t *in, size_t n, size_t param_size, zd_param_t **out) {
  *out = calloc(n ? n : 1, sizeof **out); /* every field of zd_param_t is required: no defaults */
  if (!*out) return zd__fail(-ENOMEM, "out of memory for %zu parameters", n);
  read_array(*out, sizeof **out, in, param_size, n);
  return ZD_OK;
}

int zd__check_filled(const char *what, size_t size, size_t max, const char *how) {
  return check_size(what, size, MIN_FILLED, max, how);
}

void zd__write_filled(void *out, const void *full) {
  size_t size;
  memcpy(&size, out, sizeof size); /* checked by zd__check_filled() */
  memcpy((char *)out + sizeof size, (const char *)full + sizeof size, size - sizeof size);
}

int zd_group_init(zd_group_t *groups, size_t ngroups, size_t group_size) {
  int rc = check_size("zd_group_init: group_size", group_size, MIN_GROUP, sizeof(zd_group_t),
                      "sizeof(zd_group_t)");
  if (rc) return rc;
  if (!groups && ngroups) return zd__fail(-EINVAL, "zd_group_init: groups is NULL");
  zd_group_t def = zd__group_default();
  for (size_t i = 0; i < ngroups; i++) memcpy((char *)groups + i * group_size, &def, group_size);
  return ZD_OK;
}

/* ---- constants ------------------------------------------------------------------------------ */

#define CONSTANT(name)                    {#name, (int64_t)(name)},
#define ERROR_CONSTANT(name, value, text) {"ZD_" #name, (int64_t)(value)},
#define OPTIMIZER_CONSTANT(name, value)   {"ZD_" #name, (int64_t)(ZD_##name)},

/* Every integer constant of zerod.h and zerod/errors.h, in the headers' order
 * (tests/lint/check_constants.py fails when one is missing or has another value). */
/* clang-format off */
static const zd_constant_t constants[] = {
    /* zerod/errors.h */
    CONSTANT(ZD_OK) ZD_ERROR_MAP(ERROR_CONSTANT)
    /* zerod.h */
    CONSTANT(ZD_VERSION_MAJOR) CONSTANT(ZD_VERSION_MINOR) CONSTANT(ZD_VERSION_PATCH)
    CONSTANT(ZD_PROTOCOL_VERSION) CONSTANT(ZD_MAX_DIMS) CONSTANT(ZD_ALL_BUCKETS)
    CONSTANT(ZD_ANY_RANK)
    CONSTANT(ZD_F32) CONSTANT(ZD_BF16) CONSTANT(ZD_F16)
    ZD_OPTIMIZERS(OPTIMIZER_CONSTANT)
    CONSTANT(ZD_UPDATE_TORCH113) CONSTANT(ZD_UPDATE_TORCH2)
    CONSTANT(ZD_UPDATE_TORCH2_CUDA) CONSTANT(ZD_UPDATE_TORCH2_CUDA_FOREACH)
    CONSTANT(ZD_UPDATE_TORCH2_CUDA_FUSED)
    CONSTANT(ZD_SQRT_EXACT) CONSTANT(ZD_SQRT_MKL_EX)
    CONSTANT(ZD_FIELD_DOUBLE) CONSTANT(ZD_FIELD_ENUM) CONSTANT(ZD_FIELD_BOOL)
    CONSTANT(ZD_MEMORY_HOST) CONSTANT(ZD_MEMORY_CUDA) CONSTANT(ZD_MEMORY_HOST_PINNED)
    CONSTANT(ZD_REGISTER_REPLACE) CONSTANT(ZD_REGISTER_GROW)
    CONSTANT(ZD_GRAD_MEAN) CONSTANT(ZD_GRAD_SUM)
    CONSTANT(ZD_CLIP_NORM_DOUBLE) CONSTANT(ZD_CLIP_NORM_TORCH113) CONSTANT(ZD_CLIP_NORM_TORCH26)
    CONSTANT(ZD_CLIP_NORM_TORCH215)
    CONSTANT(ZD_STEP_NO_SCATTER) CONSTANT(ZD_STEP_NO_GATHER)
    CONSTANT(ZD_CHECKPOINT_NO_WAIT)
};
/* clang-format on */

size_t zd_constants(const zd_constant_t **table, size_t *constant_size) {
  if (table) *table = constants;
  if (constant_size) *constant_size = sizeof(zd_constant_t);
  return sizeof constants / sizeof constants[0];
}
