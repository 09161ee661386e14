/* Functions generated from the group table (group.h), shared by the daemon and libzerod
 * (zd_group_fields is part of the public API, and libzerod's zd_group_init writes
 * zd__group_default), and zd_sqrt, which shows bindings what a group's sqrt_mode computes. */
#include "group.h"

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "hash.h"
#include "sqrt_mode.h"

/* The C type of each kind. */
#define CTYPE_DOUBLE double
#define CTYPE_ENUM   int
#define CTYPE_BOOL   int

/* The table and zd_group_t must agree, field for field: a row naming no field of zd_group_t does
 * not compile; a field of another type, size or place fails here. (A field of zd_group_t with no
 * row cannot be detected in C: the Python binding would miss it, the wire would not carry it.) */
#define SAME_TYPE_DOUBLE(name) \
  __builtin_types_compatible_p(__typeof__(((zd_group_t *)0)->name), double)
#define SAME_TYPE_ENUM(name) (sizeof(((zd_group_t *)0)->name) == sizeof(int))
#define SAME_TYPE_BOOL(name) __builtin_types_compatible_p(__typeof__(((zd_group_t *)0)->name), int)
#define CHECK_TYPE(name, kind, valid, expected, dflt) \
  _Static_assert(SAME_TYPE_##kind(name), "zd_group_t." #name " is not of kind " #kind);
ZD__GROUP_FIELDS(CHECK_TYPE)

struct table_layout {
#define MEMBER(name, kind, valid, expected, dflt) CTYPE_##kind name;
  ZD__GROUP_FIELDS(MEMBER)
};
#define CHECK_PLACE(name, kind, valid, expected, dflt)                              \
  _Static_assert(offsetof(struct table_layout, name) == offsetof(zd_group_t, name), \
                 "zd_group_t." #name " is not where the table's order puts it");
ZD__GROUP_FIELDS(CHECK_PLACE)
_Static_assert(sizeof(struct table_layout) == sizeof(zd_group_t),
               "zd_group_t and the group table differ in size");

zd_group_t zd__group_default(void) {
  zd_group_t g;
  memset(&g, 0, sizeof g);
#define DEFAULT(name, kind, valid, expected, dflt) g.name = dflt;
  ZD__GROUP_FIELDS(DEFAULT)
  return g;
}

static const zd_group_field_t fields[] = {
#define FIELD(name, kind, valid, expected, dflt) \
  {#name, ZD_FIELD_##kind, offsetof(zd_group_t, name), (double)(dflt)},
    ZD__GROUP_FIELDS(FIELD)};

size_t zd_group_fields(const zd_group_field_t **out, size_t *field_size, size_t *group_size) {
  if (out) *out = fields;
  if (field_size) *field_size = sizeof(zd_group_field_t);
  if (group_size) *group_size = sizeof(zd_group_t);
  return sizeof fields / sizeof fields[0];
}

/* Per kind: whether the value is admissible at all, and the message's wording and argument. */
#define FINITE_DOUBLE(v) isfinite(v)
#define FINITE_ENUM(v)   1
#define FINITE_BOOL(v)   1
#define MSG_DOUBLE(name) "%s: " #name " is %g; expected "
#define MSG_ENUM(name)   "%s: " #name " %d unknown; expected "
#define MSG_BOOL(name)   "%s: " #name " is %d; expected "
#define ARG_DOUBLE(v)    (v)
#define ARG_ENUM(v)      (int)(v)
#define ARG_BOOL(v)      (int)(v)

int zd__group_check(const zd_group_t *g, const char *where, zd__err_t *err) {
#define CHECK(name, kind, valid, expected, dflt)                                         \
  {                                                                                      \
    CTYPE_##kind v = g->name;                                                            \
    if (!(FINITE_##kind(v) && (valid)))                                                  \
      return zd__errf(err, ZD_EHPARAM, MSG_##kind(name) expected, where, ARG_##kind(v)); \
  }
  ZD__GROUP_FIELDS(CHECK)
#undef CHECK
  return ZD_OK;
}

static uint64_t hash_double(uint64_t h, double v) {
  return zd__fnv1a(h, &v, sizeof v);
}

static uint64_t hash_int(uint64_t h, int v) {
  int32_t x = (int32_t)v;
  return zd__fnv1a(h, &x, sizeof x);
}

#define HASH_DOUBLE hash_double
#define HASH_ENUM   hash_int
#define HASH_BOOL   hash_int

uint64_t zd__group_hash(uint64_t h, const zd_group_t *g) {
#define HASH(name, kind, valid, expected, dflt) h = HASH_##kind(h, g->name);
  ZD__GROUP_FIELDS(HASH)
#undef HASH
  return h;
}

int zd_sqrt(zd_sqrt_mode_t sqrt_mode, const float *x, float *y, size_t n) {
  if (sqrt_mode != ZD_SQRT_EXACT && sqrt_mode != ZD_SQRT_MKL_EX) return -EINVAL;
  if (n && (!x || !y)) return -EINVAL;
  for (size_t i = 0; i < n; i++)
    y[i] = sqrt_mode == ZD_SQRT_EXACT ? sqrtf(x[i]) : zd__sqrt_mkl_ex(x[i]);
  return ZD_OK;
}
