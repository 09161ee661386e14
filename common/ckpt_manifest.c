/* The manifest of a checkpoint (ckpt_manifest.h): its JSON, written by jansson and read back
 * with every field checked, and the JSON form of a parameter group that exports and imports share.
 */
#include "ckpt_manifest.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt_file.h"
#include "dtype.h"
#include "group.h"

#define MAX_MANIFEST (1ull << 31) /* a million parameters take about 100 MB */

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ---- the manifest: writing ------------------------------------------------------------------- */

void zd__ckpt_hex64(uint64_t v, char buf[17]) {
  snprintf(buf, 17, "%016" PRIx64, v);
}

/* Group fields by kind, generated from ZD__GROUP_FIELDS: a new hyperparameter needs nothing here.
 */
#define TO_JSON_DOUBLE(v) json_real(v)
#define TO_JSON_ENUM(v)   json_integer((json_int_t)(v))
#define TO_JSON_BOOL(v)   json_boolean(v)

json_t *zd__ckpt_group_json(const zd_group_t *g) {
  json_t *o = json_object();
  int bad = !o;
#define PUT(name, kind, valid, expected, dflt) \
  bad |= json_object_set_new(o, #name, TO_JSON_##kind(g->name)) != 0;
  ZD__GROUP_FIELDS(PUT)
#undef PUT
  if (bad) {
    json_decref(o);
    return NULL;
  }
  return o;
}

static json_t *scaler_json(const zd__ckpt_scaler_t *s) {
  const zd_loss_scaler_t *c = &s->cfg;
  return json_pack("{s:b, s:f, s:I, s:I, s:{s:b, s:f, s:f, s:f, s:I, s:I, s:f}}", "enabled",
                   s->enabled, "scale", s->scale, "growth_tracker", (json_int_t)s->growth_tracker,
                   "hysteresis_tracker", (json_int_t)s->hysteresis_tracker, "config", "enabled",
                   c->enabled, "initial_scale", c->initial_scale, "growth_factor", c->growth_factor,
                   "backoff_factor", c->backoff_factor, "growth_interval",
                   (json_int_t)c->growth_interval, "hysteresis", (json_int_t)c->hysteresis,
                   "min_scale", c->min_scale);
}

static json_t *param_json(const zd__layout_param_t *p, uint64_t lag) {
  json_t *shape = json_array();
  for (uint32_t d = 0; d < p->ndim; d++)
    json_array_append_new(shape, json_integer((json_int_t)p->shape[d]));
  json_t *o = json_pack("{s:s, s:o, s:I, s:I}", "name", p->name, "shape", shape, "group",
                        (json_int_t)p->group, "offset", (json_int_t)p->offset);
  if (o && lag && json_object_set_new(o, "steps_behind", json_integer((json_int_t)lag))) {
    json_decref(o);
    return NULL;
  }
  return o;
}

int zd__ckpt_write_manifest(const char *dir, const zd__ckpt_manifest_t *m, zd__err_t *err) {
  char path[PATH_MAX], hex[17], where[48];
  if (zd__ckpt_join(path, sizeof path, dir, ZD__CKPT_MANIFEST))
    return zd__errf(err, -ENAMETOOLONG, "%s/" ZD__CKPT_MANIFEST ": path too long", dir);
  const zd__layout_t *l = m->layout;
  if (!l) return zd__errf(err, -EINVAL, "%s: no layout to write", path);
  if (m->nfiles != l->world_size)
    return zd__errf(err, -EINVAL, "%s: %u files for a world of %u ranks", path, m->nfiles,
                    l->world_size);
  for (uint32_t r = 0; r < m->nfiles; r++) {
    char want[64];
    zd__ckpt_file_name(r, l->world_size, want, sizeof want);
    if (m->files[r].rank != r || strcmp(m->files[r].name, want) != 0)
      return zd__errf(err, -EINVAL, "%s: file %u is rank %u '%.64s'; expected rank %u '%s'", path,
                      r, m->files[r].rank, m->files[r].name, r, want);
  }
  if (m->ngroups == 0) return zd__errf(err, -EINVAL, "%s: no groups", path);
  for (uint32_t i = 0; i < l->nparams; i++)
    if (l->params[i].group >= m->ngroups)
      return zd__errf(err, -EINVAL, "%s: parameter %u '%s' is in group %u of %u", path, i,
                      l->params[i].name, l->params[i].group, m->ngroups);
  zd__err_t derr;
  if (zd__dtype_check(m->param_dtype, ZD__DTYPE_PARAM, &derr) ||
      zd__dtype_check(m->grad_dtype, ZD__DTYPE_GRAD, &derr))
    return zd__errf(err, -EINVAL, "%s: %s", path, derr.msg);
  for (uint32_t g = 0; g < m->ngroups; g++) {
    zd__err_t gerr;
    snprintf(where, sizeof where, "group %u", g);
    if (zd__group_check(&m->groups[g], where, &gerr))
      return zd__errf(err, -EINVAL, "%s: %s", path, gerr.msg);
  }
  zd__states_t always = zd__states_always(), table = 0;
  for (int a = 0; a < ZD__NSTATES; a++) table |= ZD__STATE_BIT(a);
  for (int a = 0; a < ZD__NSTATES; a++)
    if (always & ZD__STATE_BIT(a) && !(m->states & ZD__STATE_BIT(a)))
      return zd__errf(err, -EINVAL, "%s: states lacks %s, which every rank file holds", path,
                      zd__state_name(a));
  if (m->states & ~table)
    return zd__errf(err, -EINVAL, "%s: states 0x%x names arrays beyond the table's %d", path,
                    (unsigned)m->states, ZD__NSTATES);
  const zd__ckpt_scaler_t *s = &m->scaler;
  const double reals[] = {m->max_grad_norm,      s->scale,
                          s->cfg.initial_scale,  s->cfg.growth_factor,
                          s->cfg.backoff_factor, s->cfg.min_scale};
  for (size_t i = 0; i < sizeof reals / sizeof reals[0]; i++)
    if (!isfinite(reals[i]))
      return zd__errf(err, -EINVAL,
                      "%s: max_grad_norm and the loss scaler's values must be finite; "
                      "one is %g",
                      path, reals[i]);

  int rc = -ENOMEM;
  json_t *root = json_object(), *groups = json_array(), *params = json_array(),
         *files = json_array();
  if (!root || !groups || !params || !files) goto oom;
  for (uint32_t g = 0; g < m->ngroups; g++)
    if (json_array_append_new(groups, zd__ckpt_group_json(&m->groups[g]))) goto oom;
  for (uint32_t i = 0; i < l->nparams; i++) {
    if (json_array_append_new(params, param_json(&l->params[i], m->lags ? m->lags[i] : 0))) {
      json_decref(root); /* json_string refuses a name that is not UTF-8 */
      json_decref(groups);
      json_decref(params);
      json_decref(files);
      return zd__errf(err, -EINVAL, "%s: parameter %u '%s': name is not UTF-8 (or out of memory)",
                      path, i, l->params[i].name);
    }
  }
  for (uint32_t r = 0; r < m->nfiles; r++) {
    zd__ckpt_hex64(m->files[r].xxh3, hex);
    if (json_array_append_new(
            files, json_pack("{s:s, s:I, s:I, s:s}", "name", m->files[r].name, "rank",
                             (json_int_t)r, "bytes", (json_int_t)m->files[r].bytes, "xxh3", hex)))
      goto oom;
  }
  zd__ckpt_hex64(l->hash, hex);
  int bad = 0;
  bad |= json_object_set_new(root, "format", json_string("zerod-checkpoint"));
  bad |= json_object_set_new(root, "format_version", json_integer(ZD__CKPT_VERSION));
  bad |= json_object_set_new(root, "step", json_integer((json_int_t)m->step));
  bad |= json_object_set_new(root, "steps_skipped", json_integer((json_int_t)m->steps_skipped));
  bad |= json_object_set_new(root, "world_size", json_integer(l->world_size));
  bad |= json_object_set_new(root, "bucket_elems", json_integer((json_int_t)l->bucket_elems));
  bad |= json_object_set_new(root, "layout_hash", json_string(hex));
  bad |= json_object_set_new(root, "param_dtype", json_string(zd_dtype_name(m->param_dtype)));
  bad |= json_object_set_new(root, "grad_dtype", json_string(zd_dtype_name(m->grad_dtype)));
  bad |= json_object_set_new(root, "max_grad_norm", json_real(m->max_grad_norm));
  bad |= json_object_set_new(root, "grad_mean", json_boolean(m->grad_mean));
  /* The optimizers' arrays the rank files hold as "<name>": true, the legacy ones (exp_avg,
   * exp_avg_sq) only when they lack them, as "<name>": false; what is not named is what the
   * checkpoints written before the arrays followed the optimizer held (common/state.h). */
  zd__states_t legacy = zd__states_legacy();
  for (int a = 0; a < ZD__NSTATES; a++) {
    zd__states_t bit = ZD__STATE_BIT(a);
    if (always & bit) continue;
    if (m->states & bit && !(legacy & bit))
      bad |= json_object_set_new(root, zd__state_name(a), json_true());
    if (!(m->states & bit) && legacy & bit)
      bad |= json_object_set_new(root, zd__state_name(a), json_false());
  }
  bad |= json_object_set_new(root, "loss_scaler", scaler_json(s));
  bad |= json_object_set_new(root, "groups", groups);
  bad |= json_object_set_new(root, "params", params);
  bad |= json_object_set_new(root, "created_ms",
                             json_integer((json_int_t)(m->created_ms ? m->created_ms : now_ms())));
  bad |= json_object_set_new(root, "files", files);
  groups = params = files = NULL; /* the root owns them now, set or not */
  if (bad) goto oom;
  char *text = json_dumps(root, JSON_REAL_PRECISION(17) | JSON_INDENT(1));
  json_decref(root);
  if (!text) return zd__errf(err, -ENOMEM, "%s: out of memory", path);
  zd__ckpt_afile_t f;
  if (!(rc = zd__ckpt_afile_open(&f, path, err))) {
    size_t n = strlen(text);
    if (!(rc = zd__ckpt_afile_write(&f, text, n, err)) &&
        !(rc = zd__ckpt_afile_write(&f, "\n", 1, err)))
      rc = zd__ckpt_afile_commit(&f, NULL, err);
    else
      zd__ckpt_afile_abort(&f);
  }
  free(text);
  /* The step directory's own entry too: a prune that trusts this checkpoint must not outlive
   * it. */
  char parent[PATH_MAX];
  snprintf(parent, sizeof parent, "%s/..", dir);
  if (!rc && (rc = zd__ckpt_fsync_dir(parent)))
    zd__errf(err, rc, "cannot fsync directory %s: %s", parent, strerror(-rc));
  return rc;
oom:
  json_decref(root);
  json_decref(groups);
  json_decref(params);
  json_decref(files);
  return zd__errf(err, -ENOMEM, "%s: out of memory building the manifest", path);
}

/* ---- the manifest: reading ------------------------------------------------------------------- */

/* Typed field access with messages naming the file, the field and what was expected. */
typedef struct reader {
  const char *path;
  zd__err_t *err;
} reader_t;

static int bad_field(reader_t *r, const char *where, const char *key, const char *expected) {
  return zd__errf(r->err, -EBADMSG, "%s: %s%s%s is missing or not %s", r->path, where,
                  where[0] ? " " : "", key, expected);
}

static int get_u64(reader_t *r, json_t *o, const char *where, const char *key, uint64_t max,
                   uint64_t *v) {
  json_t *j = json_object_get(o, key);
  if (!json_is_integer(j) || json_integer_value(j) < 0 || (uint64_t)json_integer_value(j) > max) {
    char expected[64];
    snprintf(expected, sizeof expected, "an integer in [0, %" PRIu64 "]", max);
    return bad_field(r, where, key, expected);
  }
  *v = (uint64_t)json_integer_value(j);
  return 0;
}

static int get_u32(reader_t *r, json_t *o, const char *where, const char *key, uint32_t *v) {
  uint64_t x;
  int rc = get_u64(r, o, where, key, UINT32_MAX, &x);
  if (!rc) *v = (uint32_t)x;
  return rc;
}

static int get_double(reader_t *r, json_t *o, const char *where, const char *key, double *v) {
  json_t *j = json_object_get(o, key);
  if (!json_is_number(j)) return bad_field(r, where, key, "a number");
  *v = json_number_value(j);
  return 0;
}

static int get_bool(reader_t *r, json_t *o, const char *where, const char *key, int *v) {
  json_t *j = json_object_get(o, key);
  if (!json_is_boolean(j)) return bad_field(r, where, key, "true or false");
  *v = json_is_true(j);
  return 0;
}

static int get_enum(reader_t *r, json_t *o, const char *where, const char *key, int *v) {
  json_t *j = json_object_get(o, key);
  if (!json_is_integer(j) || json_integer_value(j) < INT32_MIN || json_integer_value(j) > INT32_MAX)
    return bad_field(r, where, key, "an integer");
  *v = (int)json_integer_value(j);
  return 0;
}

static int get_hex(reader_t *r, json_t *o, const char *where, const char *key, uint64_t *v) {
  const char *s = json_string_value(json_object_get(o, key));
  if (!s || strlen(s) != 16 || strspn(s, "0123456789abcdef") != 16)
    return bad_field(r, where, key, "16 lowercase hex digits");
  *v = strtoull(s, NULL, 16);
  return 0;
}

static int get_dtype(reader_t *r, json_t *o, const char *key, zd__dtype_use_t use, zd_dtype_t *v) {
  const char *s = json_string_value(json_object_get(o, key));
  static const zd_dtype_t all[] = {
#define ID(id, name, bytes, param, grad) ZD_##id,
      ZD__DTYPES(ID)
#undef ID
  };
  for (size_t i = 0; s && i < sizeof all / sizeof all[0]; i++) {
    if (strcmp(s, zd_dtype_name(all[i])) == 0 && zd__dtype_ok(all[i], use)) {
      *v = all[i];
      return 0;
    }
  }
  return bad_field(r, "", key,
                   use == ZD__DTYPE_PARAM ? "a param dtype name (f32, bf16)"
                                          : "a grad dtype name (f32, bf16, f16)");
}

#define GET_DOUBLE   get_double
#define GET_ENUM     get_enum
#define GET_BOOL     get_bool
#define CTYPE_DOUBLE double
#define CTYPE_ENUM   int
#define CTYPE_BOOL   int
/* The fields after the five doubles came later (as on the wire): a manifest written before one
 * existed lacks it and means its default (e.g. amsgrad off). */
#define OPTIONAL_DOUBLE 0
#define OPTIONAL_ENUM   1
#define OPTIONAL_BOOL   1

static int read_group(reader_t *r, json_t *o, uint32_t index, zd_group_t *g) {
  char where[32];
  snprintf(where, sizeof where, "groups[%u]", index);
  if (!json_is_object(o)) return bad_field(r, "", where, "an object");
  size_t nfields = 0;
  int rc;
#define GET(name, kind, valid, expected, dflt)                \
  if (OPTIONAL_##kind && !json_object_get(o, #name)) {        \
    g->name = dflt;                                           \
  } else {                                                    \
    CTYPE_##kind v = 0;                                       \
    if ((rc = GET_##kind(r, o, where, #name, &v))) return rc; \
    g->name = v;                                              \
    nfields++;                                                \
  }
  ZD__GROUP_FIELDS(GET)
#undef GET
  /* A field this build does not know changes the update: refuse rather than drop it. */
  if (json_object_size(o) != nfields) {
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
      int known = 0;
#define KNOWN(name, kind, valid, expected, dflt) known |= strcmp(key, #name) == 0;
      ZD__GROUP_FIELDS(KNOWN)
#undef KNOWN
      if (!known)
        return zd__errf(r->err, -EBADMSG,
                        "%s: %s has field '%s', unknown to this zerod (written by a newer one?)",
                        r->path, where, key);
    }
  }
  zd__err_t gerr;
  if (zd__group_check(g, where, &gerr))
    return zd__errf(r->err, -EBADMSG, "%s: %s", r->path, gerr.msg);
  return 0;
}

int zd__ckpt_group_read(const char *path, struct json_t *o, uint32_t index, zd_group_t *g,
                        zd__err_t *err) {
  reader_t r = {.path = path, .err = err};
  return read_group(&r, o, index, g);
}

static int read_scaler(reader_t *r, json_t *o, zd__ckpt_scaler_t *s) {
  const char *w = "loss_scaler";
  json_t *c = json_object_get(o, "config");
  if (!json_is_object(o)) return bad_field(r, "", w, "an object");
  if (!json_is_object(c)) return bad_field(r, w, "config", "an object");
  const char *wc = "loss_scaler.config";
  int rc;
  if ((rc = get_bool(r, o, w, "enabled", &s->enabled)) ||
      (rc = get_double(r, o, w, "scale", &s->scale)) ||
      (rc = get_u32(r, o, w, "growth_tracker", &s->growth_tracker)) ||
      (rc = get_u32(r, o, w, "hysteresis_tracker", &s->hysteresis_tracker)) ||
      (rc = get_bool(r, c, wc, "enabled", &s->cfg.enabled)) ||
      (rc = get_double(r, c, wc, "initial_scale", &s->cfg.initial_scale)) ||
      (rc = get_double(r, c, wc, "growth_factor", &s->cfg.growth_factor)) ||
      (rc = get_double(r, c, wc, "backoff_factor", &s->cfg.backoff_factor)) ||
      (rc = get_u32(r, c, wc, "growth_interval", &s->cfg.growth_interval)) ||
      (rc = get_u32(r, c, wc, "hysteresis", &s->cfg.hysteresis)) ||
      (rc = get_double(r, c, wc, "min_scale", &s->cfg.min_scale)))
    return rc;
  return 0;
}

static int read_files(reader_t *r, json_t *arr, zd__ckpt_manifest_t *m) {
  if (!json_is_array(arr) || json_array_size(arr) != m->world_size) {
    char expected[64];
    snprintf(expected, sizeof expected, "an array of %u files (one per rank)", m->world_size);
    return bad_field(r, "", "files", expected);
  }
  m->files = calloc(m->world_size, sizeof *m->files);
  if (!m->files) return zd__errf(r->err, -ENOMEM, "%s: out of memory", r->path);
  m->nfiles = m->world_size;
  for (uint32_t i = 0; i < m->world_size; i++) {
    json_t *o = json_array_get(arr, i);
    char where[32], want[64];
    snprintf(where, sizeof where, "files[%u]", i);
    zd__ckpt_file_t *f = &m->files[i];
    const char *name = json_string_value(json_object_get(o, "name"));
    int rc;
    if ((rc = get_u32(r, o, where, "rank", &f->rank)) ||
        (rc = get_u64(r, o, where, "bytes", INT64_MAX, &f->bytes)) ||
        (rc = get_hex(r, o, where, "xxh3", &f->xxh3)))
      return rc;
    /* Only the name this rank's file must have: a manifest never points outside its directory. */
    zd__ckpt_file_name(i, m->world_size, want, sizeof want);
    if (f->rank != i || !name || strcmp(name, want) != 0)
      return zd__errf(r->err, -EBADMSG, "%s: %s is rank %u '%s'; expected rank %u '%s'", r->path,
                      where, f->rank, name ? name : "(no name)", i, want);
    snprintf(f->name, sizeof f->name, "%s", want);
  }
  return 0;
}

/* Rebuilds the writer's layout from the parameter table; it must hash to layout_hash and put each
 * parameter at the offset listed. */
static int read_layout(reader_t *r, json_t *arr, zd__ckpt_manifest_t *m) {
  size_t n = json_array_size(arr);
  if (!json_is_array(arr) || n == 0 || n > ZD__MAX_PARAMS)
    return bad_field(r, "", "params", "a non-empty array of parameters");
  zd_param_t *params = calloc(n, sizeof *params);
  uint64_t *offsets = calloc(n, sizeof *offsets);
  int rc = 0;
  if (!params || !offsets) {
    rc = zd__errf(r->err, -ENOMEM, "%s: out of memory for %zu parameters", r->path, n);
    goto exit;
  }
  for (size_t i = 0; i < n; i++) {
    json_t *o = json_array_get(arr, i), *shape = json_object_get(o, "shape");
    char where[32];
    snprintf(where, sizeof where, "params[%zu]", i);
    params[i].name = json_string_value(json_object_get(o, "name"));
    if (!params[i].name) {
      rc = bad_field(r, where, "name", "a string");
      goto exit;
    }
    if (!json_is_array(shape) || json_array_size(shape) > ZD_MAX_DIMS) {
      rc = bad_field(r, where, "shape", "an array of at most 8 sizes");
      goto exit;
    }
    params[i].ndim = (uint32_t)json_array_size(shape);
    for (uint32_t d = 0; d < params[i].ndim; d++) {
      json_t *v = json_array_get(shape, d);
      if (!json_is_integer(v) || json_integer_value(v) < 0) {
        rc = bad_field(r, where, "shape", "an array of sizes >= 0");
        goto exit;
      }
      params[i].shape[d] = (uint64_t)json_integer_value(v);
    }
    if ((rc = get_u32(r, o, where, "group", &params[i].group)) ||
        (rc = get_u64(r, o, where, "offset", ZD__MAX_ELEMS, &offsets[i])))
      goto exit;
    if (json_object_get(o, "steps_behind")) { /* optional: absent in older checkpoints */
      if (!m->lags && !(m->lags = calloc(n, sizeof *m->lags))) {
        rc = zd__errf(r->err, -ENOMEM, "%s: out of memory for %zu parameters", r->path, n);
        goto exit;
      }
      if ((rc = get_u64(r, o, where, "steps_behind", m->step, &m->lags[i]))) goto exit;
    }
  }
  zd__err_t lerr;
  if ((rc = zd__layout_build(params, (uint32_t)n, m->ngroups, m->world_size, m->bucket_elems,
                             &m->layout, &lerr))) {
    rc = zd__errf(r->err, -EBADMSG, "%s: parameter table: %s", r->path, lerr.msg);
    goto exit;
  }
  if (m->layout->hash != m->layout_hash) {
    rc = zd__errf(r->err, -EBADMSG,
                  "%s: the parameter table hashes to layout 0x%016" PRIx64
                  "; expected 0x%016" PRIx64 " (layout_hash)",
                  r->path, m->layout->hash, m->layout_hash);
    goto exit;
  }
  for (size_t i = 0; i < n; i++) {
    if (m->layout->params[i].offset != offsets[i]) {
      rc = zd__errf(r->err, -EBADMSG,
                    "%s: params[%zu] '%s' at offset %" PRIu64 "; the layout puts it at %" PRIu64,
                    r->path, i, params[i].name, offsets[i], m->layout->params[i].offset);
      goto exit;
    }
  }
exit:
  free(params);
  free(offsets);
  return rc;
}

/* Reads the whole of a small file (the manifest) into a NUL-terminated buffer. */
static int slurp(const char *path, char **out, size_t *len, zd__err_t *err) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int rc = -errno;
    return zd__errf(err, rc, "%s: %s", path,
                    rc == -ENOENT ? "no manifest: the checkpoint is not complete" : strerror(-rc));
  }
  struct stat st;
  int rc = 0;
  char *buf = NULL;
  if (fstat(fd, &st)) {
    rc = -errno;
    zd__errf(err, rc, "%s: %s", path, strerror(-rc));
    goto exit;
  }
  if ((uint64_t)st.st_size > MAX_MANIFEST) {
    rc = zd__errf(err, -EBADMSG, "%s: %lld bytes; expected at most %llu", path,
                  (long long)st.st_size, (unsigned long long)MAX_MANIFEST);
    goto exit;
  }
  buf = malloc((size_t)st.st_size + 1);
  if (!buf) {
    rc = zd__errf(err, -ENOMEM, "%s: out of memory", path);
    goto exit;
  }
  ssize_t r = zd__ckpt_pread_all(fd, buf, (size_t)st.st_size, 0);
  if (r < 0) {
    rc = zd__errf(err, (int)r, "%s: %s", path, strerror((int)-r));
    goto exit;
  }
  buf[r] = '\0';
  *out = buf;
  *len = (size_t)r;
  buf = NULL;
exit:
  free(buf);
  close(fd);
  return rc;
}

int zd__ckpt_read_manifest(const char *dir, zd__ckpt_manifest_t **out, zd__err_t *err) {
  *out = NULL;
  char path[PATH_MAX];
  if (zd__ckpt_join(path, sizeof path, dir, ZD__CKPT_MANIFEST))
    return zd__errf(err, -ENAMETOOLONG, "%s/" ZD__CKPT_MANIFEST ": path too long", dir);
  char *text = NULL;
  size_t len = 0;
  int rc = slurp(path, &text, &len, err);
  if (rc) return rc;
  json_error_t jerr;
  json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
  free(text);
  if (!json_is_object(root)) {
    rc = zd__errf(err, -EBADMSG, "%s: not a JSON object%s%s (line %d)", path, root ? "" : ": ",
                  root ? "" : jerr.text, root ? 0 : jerr.line);
    json_decref(root);
    return rc;
  }
  reader_t r = {.path = path, .err = err};
  zd__ckpt_manifest_t *m = calloc(1, sizeof *m);
  if (!m) {
    json_decref(root);
    return zd__errf(err, -ENOMEM, "%s: out of memory", path);
  }
  const char *format = json_string_value(json_object_get(root, "format"));
  if (!format || strcmp(format, "zerod-checkpoint") != 0) {
    rc = bad_field(&r, "", "format", "\"zerod-checkpoint\"");
    goto fail;
  }
  if ((rc = get_u32(&r, root, "", "format_version", &m->version))) goto fail;
  if (m->version != ZD__CKPT_VERSION) {
    rc = zd__errf(err, ZD_EVERSION, "%s: format_version %u; this zerod reads version %d", path,
                  m->version, ZD__CKPT_VERSION);
    goto fail;
  }
  uint64_t ws = 0, created = 0;
  if ((rc = get_u64(&r, root, "", "step", INT64_MAX, &m->step)) ||
      (rc = get_u64(&r, root, "", "steps_skipped", INT64_MAX, &m->steps_skipped)) ||
      (rc = get_u64(&r, root, "", "world_size", 1u << 24, &ws)) ||
      (rc = get_u64(&r, root, "", "bucket_elems", ZD__MAX_ELEMS, &m->bucket_elems)) ||
      (rc = get_hex(&r, root, "", "layout_hash", &m->layout_hash)) ||
      (rc = get_dtype(&r, root, "param_dtype", ZD__DTYPE_PARAM, &m->param_dtype)) ||
      (rc = get_dtype(&r, root, "grad_dtype", ZD__DTYPE_GRAD, &m->grad_dtype)) ||
      (rc = get_double(&r, root, "", "max_grad_norm", &m->max_grad_norm)) ||
      (rc = get_bool(&r, root, "", "grad_mean", &m->grad_mean)) ||
      (rc = read_scaler(&r, json_object_get(root, "loss_scaler"), &m->scaler)) ||
      (rc = get_u64(&r, root, "", "created_ms", INT64_MAX, &created)))
    goto fail;
  m->states = zd__states_legacy(); /* what a manifest that names no array has */
  for (int a = 0; a < ZD__NSTATES; a++) {
    const char *name = zd__state_name(a);
    int has = 0;
    if (zd__states_always() & ZD__STATE_BIT(a) || !json_object_get(root, name)) continue;
    if ((rc = get_bool(&r, root, "", name, &has))) goto fail;
    m->states = has ? m->states | ZD__STATE_BIT(a) : m->states & ~ZD__STATE_BIT(a);
  }
  if (ws == 0 || m->bucket_elems == 0) {
    rc = zd__errf(err, -EBADMSG,
                  "%s: world_size %" PRIu64 ", bucket_elems %" PRIu64 "; expected both >= 1", path,
                  ws, m->bucket_elems);
    goto fail;
  }
  m->world_size = (uint32_t)ws;
  m->created_ms = created;
  json_t *groups = json_object_get(root, "groups");
  if (!json_is_array(groups) || json_array_size(groups) == 0 ||
      json_array_size(groups) > UINT32_MAX) {
    rc = bad_field(&r, "", "groups", "a non-empty array");
    goto fail;
  }
  m->ngroups = (uint32_t)json_array_size(groups);
  if (!(m->groups = calloc(m->ngroups, sizeof *m->groups))) {
    rc = zd__errf(err, -ENOMEM, "%s: out of memory", path);
    goto fail;
  }
  for (uint32_t g = 0; g < m->ngroups; g++)
    if ((rc = read_group(&r, json_array_get(groups, g), g, &m->groups[g]))) goto fail;
  if ((rc = read_layout(&r, json_object_get(root, "params"), m)) ||
      (rc = read_files(&r, json_object_get(root, "files"), m)))
    goto fail;
  json_decref(root);
  *out = m;
  return ZD_OK;
fail:
  json_decref(root);
  zd__ckpt_manifest_free(m);
  return rc;
}

void zd__ckpt_manifest_free(zd__ckpt_manifest_t *m) {
  if (!m) return;
  zd__layout_free(m->layout);
  free(m->groups);
  free(m->files);
  free(m->lags);
  free(m);
}
