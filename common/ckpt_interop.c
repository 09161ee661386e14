/* Exports and imports (ckpt_interop.h): a checkpoint as one safetensors file of whole parameters,
 * and such a file (or a torch optimizer's state) as a checkpoint. */
#include "ckpt_interop.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_file.h"
#include "ckpt_load.h"
#include "ckpt_manifest.h"
#include "ckpt_shard.h"
#include "safetensors.h"
#include "state.h"

#define CHUNK         (8u << 20) /* bytes per read and write of an export */
#define F32_BYTES     ZD__SAFETENSORS_F32_BYTES
#define JSON_FLAGS    ZD__SAFETENSORS_JSON_FLAGS
#define EXPORT_FORMAT "zerod-export"
#define SUFFIX_MAX    48 /* bytes of ".<array name>" and its NUL */

#define SUFFIX_FITS(role, name, always, legacy) \
  _Static_assert(sizeof(name) + 1 <= SUFFIX_MAX, "state array name " name " is too long");
ZD__STATE_ARRAYS(SUFFIX_FITS)
#undef SUFFIX_FITS

/* Parameter param's tensor of array s, in exports and imports: "<param>" for its master weights,
 * "<param>.<name>" for the optimizer's arrays ("embed.weight.exp_avg"). */
static void tensor_name(char *buf, size_t len, const char *param, zd__state_t s) {
  if (s == ZD__STATE_MASTER)
    snprintf(buf, len, "%s", param);
  else
    snprintf(buf, len, "%s.%s", param, zd__state_name(s));
}

/* The tensors of the arrays in set for a parameter called NAME ("NAME, NAME.exp_avg"), for
 * messages. */
static void tensors_of(zd__states_t set, char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  for (int s = 0; s < ZD__NSTATES; s++) {
    char one[SUFFIX_MAX + 8];
    if (!(set & ZD__STATE_BIT(s))) continue;
    tensor_name(one, sizeof one, "NAME", s);
    int n = snprintf(buf + used, len - used, "%s%s", used ? ", " : "", one);
    if (n < 0 || (size_t)n >= len - used) break;
    used += (size_t)n;
  }
}

/* ---- export ---------------------------------------------------------------------------------- */

int zd__ckpt_export(const char *dir, const char *out_path, int moments, zd__err_t *err) {
  zd__ckpt_manifest_t *m = NULL;
  int rc = zd__ckpt_read_manifest(dir, &m, err);
  if (rc) return rc;
  if ((rc = zd__ckpt_verify(dir, m, err))) {
    zd__ckpt_manifest_free(m);
    return rc;
  }
  const zd__layout_t *l = m->layout;
  /* The master weights, or every array the checkpoint has; each over all parameters in turn. */
  zd__states_t states = moments ? m->states : ZD__STATE_BIT(ZD__STATE_MASTER);
  char *head = NULL, *buf = NULL, num[24], hex[17];
  zd__ckpt_reader_t *src = NULL;
  zd__ckpt_afile_t f = {.fd = -1};
  json_t *hdr = json_object(), *meta = json_object(), *pg = json_array(), *groups = json_array();
  rc = -ENOMEM;
  if (!hdr || !meta || !pg || !groups) goto oom;

  uint64_t off = 0;
  for (int t = 0; t < ZD__NSTATES; t++) {
    if (!(states & ZD__STATE_BIT(t))) continue;
    for (uint32_t i = 0; i < l->nparams; i++) {
      const zd__layout_param_t *p = &l->params[i];
      char name[ZD__MAX_NAME + SUFFIX_MAX];
      tensor_name(name, sizeof name, p->name, t);
      if (json_object_get(hdr, name) || !strcmp(name, "__metadata__")) {
        rc = zd__errf(err, -EINVAL, "%s: tensor name '%s' is used twice; cannot export", dir, name);
        goto exit;
      }
      uint64_t bytes = p->numel * F32_BYTES;
      if (json_object_set_new(hdr, name,
                              zd__safetensors_entry(p->shape, p->ndim, off, off + bytes)))
        goto oom;
      off += bytes;
    }
  }
  for (uint32_t i = 0; i < l->nparams; i++)
    json_array_append_new(pg, json_integer(l->params[i].group));
  for (uint32_t g = 0; g < m->ngroups; g++)
    json_array_append_new(groups, zd__ckpt_group_json(&m->groups[g]));
  char *pg_text = json_dumps(pg, JSON_FLAGS), *groups_text = json_dumps(groups, JSON_FLAGS);
  json_object_set_new(meta, "format", json_string("pt"));
  json_object_set_new(meta, "zerod_format", json_string(EXPORT_FORMAT));
  json_object_set_new(meta, "zerod_version", json_string("1"));
  snprintf(num, sizeof num, "%" PRIu64, m->step);
  json_object_set_new(meta, "step", json_string(num));
  snprintf(num, sizeof num, "%" PRIu64, m->steps_skipped);
  json_object_set_new(meta, "steps_skipped", json_string(num));
  snprintf(num, sizeof num, "%u", m->world_size);
  json_object_set_new(meta, "world_size", json_string(num));
  zd__ckpt_hex64(m->layout_hash, hex);
  json_object_set_new(meta, "layout_hash", json_string(hex));
  json_object_set_new(meta, "moments", json_string(moments ? "1" : "0"));
  json_object_set_new(meta, "groups", pg_text && groups_text ? json_string(groups_text) : NULL);
  json_object_set_new(meta, "param_groups", pg_text && groups_text ? json_string(pg_text) : NULL);
  free(pg_text);
  free(groups_text);
  /* Parameters whose own step lags the model's (a manifest's "steps_behind"): "steps_behind", a
   * JSON array of one count per parameter in registration order, only where one is nonzero. */
  size_t nmeta = 10;
  if (m->lags) {
    json_t *lags = json_array();
    for (uint32_t i = 0; lags && i < l->nparams; i++)
      json_array_append_new(lags, json_integer((json_int_t)m->lags[i]));
    char *lags_text = lags ? json_dumps(lags, JSON_FLAGS) : NULL;
    json_decref(lags);
    json_object_set_new(meta, "steps_behind", lags_text ? json_string(lags_text) : NULL);
    free(lags_text);
    nmeta++;
  }
  if (json_object_size(meta) != nmeta || json_object_set_new(hdr, "__metadata__", meta)) {
    meta = NULL;
    goto oom;
  }
  meta = NULL;
  size_t head_len;
  if (zd__safetensors_header_bytes(hdr, &head, &head_len) || !(buf = malloc(CHUNK))) goto oom;
  if ((rc = zd__ckpt_reader_open(dir, m, &src, err))) goto exit;

  if ((rc = zd__ckpt_afile_open(&f, out_path, err))) goto exit;
  if ((rc = zd__ckpt_afile_write(&f, head, head_len, err))) goto exit;
  for (int t = 0; t < ZD__NSTATES; t++) {
    if (!(states & ZD__STATE_BIT(t))) continue;
    for (uint32_t i = 0; i < l->nparams; i++) {
      uint64_t numel = l->params[i].numel;
      for (uint64_t done = 0; done < numel;) {
        uint64_t n = numel - done < CHUNK / F32_BYTES ? numel - done : CHUNK / F32_BYTES;
        if ((rc = zd__ckpt_reader_param(src, t, i, done, n, (float *)buf, err)) ||
            (rc = zd__ckpt_afile_write(&f, buf, n * F32_BYTES, err)))
          goto exit;
        done += n;
      }
    }
  }
  rc = zd__ckpt_afile_commit(&f, NULL, err);
  goto exit;
oom:
  rc = zd__errf(err, -ENOMEM, "%s: out of memory exporting to %s", dir, out_path);
exit:
  if (f.fd >= 0) zd__ckpt_afile_abort(&f);
  zd__ckpt_reader_close(src);
  json_decref(hdr);
  json_decref(meta);
  json_decref(pg);
  json_decref(groups);
  free(buf);
  free(head);
  zd__ckpt_manifest_free(m);
  return rc;
}

/* ---- import ---------------------------------------------------------------------------------- */

#define TORCH_STATE_FORMAT "zerod-torch-state"
#define MAX_IMPORT_HDR     (1ull << 31) /* an entry of at most 300 bytes per tensor */

/* One tensor of the file being imported. */
typedef struct in_tensor {
  const char *name; /* the header's key: owned by the header */
  size_t order;     /* its place in the header: breaks ties between empty tensors */
  uint32_t ndim;
  uint64_t shape[ZD_MAX_DIMS];
  uint64_t numel;
  uint64_t begin; /* bytes, from the start of the data */
} in_tensor_t;

/* The import's state, freed in one place. */
typedef struct importer {
  const char *path;
  zd__err_t *err;
  int fd;
  uint64_t data_start;
  json_t *hdr, *groups_json, *names_json, *pgroups_json;
  json_t *lags_json; /* metadata "steps_behind" (optional) */
  uint64_t *lags;    /* from it: nparams, or NULL (every parameter at the step) */
  in_tensor_t *tensors;
  size_t ntensors;
  zd_group_t *groups;
  uint32_t ngroups;
  zd_param_t *params;
  uint32_t nparams;
  zd__states_t states;          /* the arrays the file holds, for every parameter */
  const in_tensor_t **by_param; /* nparams x ZD__NSTATES: parameter i's tensor of array s */
  zd__layout_t *layout;
  float *arrays; /* one allocation: state[s] for each array in states */
  float *state[ZD__NSTATES];
} importer_t;

static int import_bad(importer_t *im, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int import_bad(importer_t *im, const char *fmt, ...) {
  char what[ZD__ERR_MSG_MAX - 64];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  return zd__errf(im->err, -EBADMSG, "%s: %s", im->path, what);
}

/* A metadata string, or NULL when the key is missing (a present key that is not a string is a
 * malformed file: safetensors metadata holds strings only). */
static int meta_str(importer_t *im, json_t *meta, const char *key, int required, const char **out) {
  json_t *v = json_object_get(meta, key);
  *out = json_string_value(v);
  if ((v && !*out) || (required && !v))
    return import_bad(im, "metadata \"%s\" is %s; expected a string", key,
                      v ? "not a string" : "missing");
  return 0;
}

/* A decimal metadata value (digits only: no sign, no blanks) of at most INT64_MAX. */
static int meta_u64(importer_t *im, json_t *meta, const char *key, int required, uint64_t *out) {
  const char *s;
  int rc = meta_str(im, meta, key, required, &s);
  if (rc || !s) return rc;
  size_t n = strlen(s);
  /* 19 digits never overflow an unsigned long long: only the INT64_MAX bound is left. */
  if (!n || n > 19 || strspn(s, "0123456789") != n || strtoull(s, NULL, 10) > INT64_MAX)
    return import_bad(im, "metadata \"%s\" is \"%.40s\"; expected a decimal integer", key, s);
  *out = (uint64_t)strtoull(s, NULL, 10);
  return 0;
}

/* A metadata value holding JSON text, parsed into *out (owned by im). */
static int meta_json(importer_t *im, json_t *meta, const char *key, int required, json_t **out) {
  const char *s;
  int rc = meta_str(im, meta, key, required, &s);
  if (rc || !s) return rc;
  json_error_t jerr;
  *out = json_loads(s, JSON_REJECT_DUPLICATES, &jerr);
  if (!*out || !json_is_array(*out))
    return import_bad(im, "metadata \"%s\" is not a JSON array%s%s", key, *out ? "" : ": ",
                      *out ? "" : jerr.text);
  return 0;
}

/* Reads the header: the metadata's step, groups and parameter order, and every tensor's entry,
 * checked against the file's size. */
static int import_header(importer_t *im, uint64_t *step, uint64_t *skipped) {
  struct stat st;
  if (fstat(im->fd, &st)) {
    int rc = -errno;
    return zd__errf(im->err, rc, "%s: %s", im->path, strerror(-rc));
  }
  uint64_t file_bytes = (uint64_t)st.st_size;
  int rc = zd__safetensors_read_header(im->fd, im->path, file_bytes, MAX_IMPORT_HDR, &im->hdr,
                                       &im->data_start, im->err);
  if (rc) return rc;
  uint64_t data_bytes = file_bytes - im->data_start;

  json_t *meta = json_object_get(im->hdr, "__metadata__");
  if (!json_is_object(meta)) return import_bad(im, "no __metadata__: not a zerod state file");
  const char *format, *version, *moments;
  if ((rc = meta_str(im, meta, "zerod_format", 1, &format))) return rc;
  int is_export = strcmp(format, EXPORT_FORMAT) == 0;
  if (!is_export && strcmp(format, TORCH_STATE_FORMAT) != 0)
    return import_bad(im,
                      "zerod_format is \"%.40s\"; expected \"" TORCH_STATE_FORMAT
                      "\" or \"" EXPORT_FORMAT "\"",
                      format);
  if ((rc = meta_str(im, meta, "zerod_version", 1, &version))) return rc;
  if (strcmp(version, "1") != 0)
    return zd__errf(im->err, ZD_EVERSION, "%s: zerod_version \"%.40s\"; this zerod reads \"1\"",
                    im->path, version);
  if ((rc = meta_str(im, meta, "moments", is_export, &moments))) return rc;
  if (is_export && strcmp(moments, "1") != 0)
    return import_bad(im, "an export without moments (zeroctl export --moments writes them)");
  *skipped = 0;
  if ((rc = meta_u64(im, meta, "step", 1, step)) ||
      (rc = meta_u64(im, meta, "steps_skipped", 0, skipped)) ||
      (rc = meta_json(im, meta, "groups", 1, &im->groups_json)) ||
      (rc = meta_json(im, meta, "param_groups", 1, &im->pgroups_json)) ||
      (rc = meta_json(im, meta, "params", !is_export, &im->names_json)) ||
      (rc = meta_json(im, meta, "steps_behind", 0, &im->lags_json)))
    return rc;

  im->ntensors = json_object_size(im->hdr) - 1;
  im->tensors = calloc(im->ntensors ? im->ntensors : 1, sizeof *im->tensors);
  if (!im->tensors) return zd__errf(im->err, -ENOMEM, "%s: out of memory", im->path);
  size_t k = 0;
  const char *key;
  json_t *e;
  json_object_foreach(im->hdr, key, e) {
    if (!strcmp(key, "__metadata__")) continue;
    in_tensor_t *t = &im->tensors[k];
    *t = (in_tensor_t){.name = key, .order = k, .numel = 1};
    k++;
    json_t *shape = json_object_get(e, "shape"), *offs = json_object_get(e, "data_offsets");
    json_t *jb = json_array_get(offs, 0), *je = json_array_get(offs, 1);
    if (!json_is_object(e) || !zd__safetensors_str_is(e, "dtype", "F32"))
      return import_bad(im, "tensor \"%.300s\" is not F32 (zerod's state is fp32)", key);
    if (!json_is_array(shape) || json_array_size(shape) > ZD_MAX_DIMS)
      return import_bad(im, "tensor \"%.300s\": shape is not an array of at most %d sizes", key,
                        ZD_MAX_DIMS);
    t->ndim = (uint32_t)json_array_size(shape);
    for (uint32_t d = 0; d < t->ndim; d++) {
      json_t *v = json_array_get(shape, d);
      if (!json_is_integer(v) || json_integer_value(v) < 0 ||
          (uint64_t)json_integer_value(v) > ZD__MAX_ELEMS)
        return import_bad(im, "tensor \"%.300s\": shape[%u] is not a size", key, d);
      t->shape[d] = (uint64_t)json_integer_value(v);
      if (t->shape[d] && t->numel > ZD__MAX_ELEMS / t->shape[d])
        t->numel = ZD__MAX_ELEMS + 1; /* too large: refused below, unless a later size is 0 */
      else
        t->numel *= t->shape[d];
    }
    if (json_array_size(offs) != 2 || !json_is_integer(jb) || !json_is_integer(je) ||
        json_integer_value(jb) < 0 || json_integer_value(je) < json_integer_value(jb) ||
        (uint64_t)json_integer_value(je) > data_bytes || t->numel > ZD__MAX_ELEMS ||
        (uint64_t)(json_integer_value(je) - json_integer_value(jb)) != t->numel * F32_BYTES)
      return import_bad(im,
                        "tensor \"%.300s\": data_offsets are not those of %" PRIu64
                        " F32 elements within the %" PRIu64 " bytes of data",
                        key, t->numel, data_bytes);
    t->begin = (uint64_t)json_integer_value(jb);
  }
  return 0;
}

static int by_data(const void *a, const void *b) {
  const in_tensor_t *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return x->order < y->order ? -1 : x->order > y->order;
}

static const in_tensor_t *find_tensor(const importer_t *im, const char *name) {
  for (size_t k = 0; k < im->ntensors; k++)
    if (!strcmp(im->tensors[k].name, name)) return &im->tensors[k];
  return NULL;
}

static int same_shape(const in_tensor_t *a, const in_tensor_t *b) {
  return a->ndim == b->ndim && !memcmp(a->shape, b->shape, a->ndim * sizeof a->shape[0]);
}

/* The groups, and the parameters in registration order, each with its tensor of every array. */
static int import_params(importer_t *im) {
  size_t ng = json_array_size(im->groups_json);
  if (ng == 0 || ng > UINT32_MAX) return import_bad(im, "metadata \"groups\" is empty");
  im->ngroups = (uint32_t)ng;
  im->groups = calloc(ng, sizeof *im->groups);
  if (!im->groups) return zd__errf(im->err, -ENOMEM, "%s: out of memory", im->path);
  int rc;
  for (uint32_t g = 0; g < im->ngroups; g++)
    if ((rc = zd__ckpt_group_read(im->path, json_array_get(im->groups_json, g), g, &im->groups[g],
                                  im->err)))
      return rc;

  size_t np = json_array_size(im->pgroups_json);
  if (np == 0 || np > ZD__MAX_PARAMS)
    return import_bad(im, "metadata \"param_groups\" lists %zu parameters; expected 1 to %u", np,
                      ZD__MAX_PARAMS);
  if (im->names_json && json_array_size(im->names_json) != np)
    return import_bad(im, "metadata \"params\" names %zu parameters, \"param_groups\" %zu",
                      json_array_size(im->names_json), np);
  im->nparams = (uint32_t)np;
  im->params = calloc(np, sizeof *im->params);
  im->by_param = calloc(np * ZD__NSTATES, sizeof *im->by_param);
  if (!im->params || !im->by_param)
    return zd__errf(im->err, -ENOMEM, "%s: out of memory for %zu parameters", im->path, np);
  /* An export lists no names: its master tensors come first in its data, in registration
   * order (zd__ckpt_export writes them so). */
  in_tensor_t *sorted = NULL;
  if (!im->names_json) {
    sorted = malloc((im->ntensors ? im->ntensors : 1) * sizeof *sorted);
    if (!sorted) return zd__errf(im->err, -ENOMEM, "%s: out of memory", im->path);
    memcpy(sorted, im->tensors, im->ntensors * sizeof *sorted);
    qsort(sorted, im->ntensors, sizeof *sorted, by_data);
  }
  /* The arrays every parameter has: those every model has, and the optional ones the first
   * parameter has (an optional array is for every parameter or none). */
  const char *first = sorted ? (im->ntensors ? sorted[0].name : NULL)
                             : json_string_value(json_array_get(im->names_json, 0));
  char tname[ZD__MAX_NAME + SUFFIX_MAX];
  im->states = zd__states_always();
  for (int t = 0; t < ZD__NSTATES && first && strlen(first) <= ZD__MAX_NAME; t++) {
    tensor_name(tname, sizeof tname, first, t);
    if (find_tensor(im, tname)) im->states |= ZD__STATE_BIT(t);
  }
  int per = __builtin_popcount(im->states);
  if (im->ntensors != (size_t)per * np) {
    char have[256], optional[256];
    tensors_of(im->states, have, sizeof have);
    tensors_of(~im->states, optional, sizeof optional); /* the optional ones it lacks */
    rc = import_bad(im,
                    "%zu tensors for %zu parameters; expected %d per parameter (%s%s%s%s), and "
                    "no other",
                    im->ntensors, np, per, have, optional[0] ? "; or also " : "", optional,
                    optional[0] ? ", each for every parameter or none" : "");
    free(sorted);
    return rc;
  }
  rc = 0;
  for (uint32_t i = 0; i < im->nparams && !rc; i++) {
    const char *name =
        sorted ? sorted[i].name : json_string_value(json_array_get(im->names_json, i));
    json_t *g = json_array_get(im->pgroups_json, i);
    if (!name || !name[0] || strlen(name) > ZD__MAX_NAME) {
      rc =
          import_bad(im, "metadata \"params\"[%u] is not a name of 1 to %d bytes", i, ZD__MAX_NAME);
      break;
    }
    if (!json_is_integer(g) || json_integer_value(g) < 0 ||
        json_integer_value(g) >= (json_int_t)im->ngroups) {
      rc = import_bad(im, "metadata \"param_groups\"[%u] ('%.300s') is not a group of the %u", i,
                      name, im->ngroups);
      break;
    }
    const in_tensor_t **mine = &im->by_param[(size_t)ZD__NSTATES * i];
    for (int t = 0; t < ZD__NSTATES && !rc; t++) {
      if (!(im->states & ZD__STATE_BIT(t))) continue;
      tensor_name(tname, sizeof tname, name, t);
      const in_tensor_t *found = find_tensor(im, tname);
      if (!found)
        rc = import_bad(im, "no tensor \"%.300s\" for parameter '%.300s'", tname, name);
      else if (t != ZD__STATE_MASTER && !same_shape(found, mine[ZD__STATE_MASTER]))
        rc = import_bad(im, "tensor \"%.300s\" is not of its parameter's shape", tname);
      mine[t] = found;
    }
    if (rc) break;
    const in_tensor_t *master = mine[ZD__STATE_MASTER];
    im->params[i] = (zd_param_t){
        .name = master->name, .ndim = master->ndim, .group = (uint32_t)json_integer_value(g)};
    memcpy(im->params[i].shape, master->shape, sizeof master->shape);
  }
  free(sorted);
  return rc;
}

/* Reads every parameter's tensor of each array to where the W=1 layout puts it (padding stays
 * 0). */
static int import_read(importer_t *im) {
  uint64_t n = im->layout->shard_elems, per = (uint64_t)__builtin_popcount(im->states);
  im->arrays = calloc(per * (n ? n : 1), sizeof(float));
  if (!im->arrays)
    return zd__errf(im->err, -ENOMEM, "%s: out of memory for %" PRIu64 " elements", im->path,
                    per * n);
  float *next = im->arrays;
  for (int t = 0; t < ZD__NSTATES; t++) {
    if (!(im->states & ZD__STATE_BIT(t))) continue;
    im->state[t] = next;
    next += n;
  }
  for (uint32_t i = 0; i < im->nparams; i++) {
    const zd__layout_param_t *p = &im->layout->params[i];
    for (int t = 0; t < ZD__NSTATES; t++) {
      if (!im->state[t]) continue;
      const in_tensor_t *src = im->by_param[(size_t)ZD__NSTATES * i + t];
      /* At world size 1 a rank's shard is the flat buffer: a parameter's offset is its index. */
      float *dst = im->state[t] + p->offset;
      uint64_t bytes = p->numel * F32_BYTES;
      ssize_t got = zd__ckpt_pread_all(im->fd, dst, bytes, im->data_start + src->begin);
      if (got < 0) return zd__errf(im->err, (int)got, "%s: %s", im->path, strerror((int)-got));
      if ((uint64_t)got != bytes) return import_bad(im, "ends inside tensor \"%.300s\"", src->name);
    }
  }
  return 0;
}

static int import_write(importer_t *im, const char *root, uint64_t step, uint64_t skipped,
                        char *dir_out, size_t dir_len) {
  zd__err_t *err = im->err;
  if (mkdir(root, 0755) && errno != EEXIST) {
    int rc = -errno;
    return zd__errf(err, rc, "cannot create %s: %s", root, strerror(-rc));
  }
  char dir[PATH_MAX], manifest[PATH_MAX];
  if (zd__ckpt_dir_name(root, step, dir, sizeof dir) ||
      zd__ckpt_join(manifest, sizeof manifest, dir, ZD__CKPT_MANIFEST) || strlen(dir) >= dir_len)
    return zd__errf(err, -ENAMETOOLONG, "%s: path too long", root);
  if (access(manifest, F_OK) == 0)
    return zd__errf(err, -EEXIST,
                    "%s already holds a complete checkpoint of step %" PRIu64
                    "; import into another directory",
                    dir, step);
  if (im->lags_json) { /* each parameter's steps behind the model's step */
    if (json_array_size(im->lags_json) != im->nparams)
      return import_bad(im, "metadata \"steps_behind\" lists %zu parameters; expected %u",
                        json_array_size(im->lags_json), im->nparams);
    if (!(im->lags = calloc(im->nparams, sizeof *im->lags)))
      return zd__errf(err, -ENOMEM, "%s: out of memory", im->path);
    for (uint32_t i = 0; i < im->nparams; i++) {
      json_t *v = json_array_get(im->lags_json, i);
      if (!json_is_integer(v) || json_integer_value(v) < 0 ||
          (uint64_t)json_integer_value(v) > step)
        return import_bad(im, "metadata \"steps_behind\"[%u] is not a count in [0, %" PRIu64 "]", i,
                          step);
      im->lags[i] = (uint64_t)json_integer_value(v);
    }
  }
  uint64_t n = im->layout->shard_elems;
  zd__ckpt_shard_t shard = {.rank = 0, .world_size = 1, .step = step, .elems = n};
  memcpy(shard.state, im->state, sizeof shard.state);
  zd__ckpt_file_t file;
  int rc = zd__ckpt_write_shard(dir, &shard, 0, &file, err);
  if (rc) return rc;
  zd__ckpt_manifest_t m = {.version = ZD__CKPT_VERSION,
                           .step = step,
                           .steps_skipped = skipped,
                           .layout = im->layout,
                           .groups = im->groups,
                           .ngroups = im->ngroups,
                           .param_dtype = ZD_F32,
                           .grad_dtype = ZD_F32,
                           .grad_mean = 1,
                           .states = im->states,
                           .files = &file,
                           .nfiles = 1,
                           .lags = im->lags};
  if ((rc = zd__ckpt_write_manifest(dir, &m, err))) return rc;
  /* Read back through the resume's own path: what was written is what a zerod will load. */
  zd__ckpt_manifest_t *back = NULL;
  if (!(rc = zd__ckpt_read_manifest(dir, &back, err))) rc = zd__ckpt_verify(dir, back, err);
  zd__ckpt_manifest_free(back);
  if (!rc) snprintf(dir_out, dir_len, "%s", dir);
  return rc;
}

int zd__ckpt_import(const char *in_path, const char *root, char *dir_out, size_t dir_len,
                    zd__err_t *err) {
  importer_t im = {.path = in_path, .err = err, .fd = open(in_path, O_RDONLY | O_CLOEXEC)};
  if (im.fd < 0) {
    int rc = -errno;
    return zd__errf(err, rc, "%s: %s", in_path, strerror(-rc));
  }
  uint64_t step = 0, skipped = 0;
  int rc;
  zd__err_t lerr;
  if ((rc = import_header(&im, &step, &skipped)) || (rc = import_params(&im))) goto exit;
  if ((rc = zd__layout_build(im.params, im.nparams, im.ngroups, 1,
                             zd__layout_default_bucket_elems(1), &im.layout, &lerr))) {
    zd__errf(err, rc, "%s: %s", in_path, lerr.msg);
    goto exit;
  }
  if (!(rc = import_read(&im))) rc = import_write(&im, root, step, skipped, dir_out, dir_len);
exit:
  close(im.fd);
  free(im.arrays);
  zd__layout_free(im.layout);
  free(im.by_param);
  free(im.params);
  free(im.groups);
  free(im.tensors);
  json_decref(im.names_json);
  json_decref(im.pgroups_json);
  json_decref(im.lags_json);
  free(im.lags);
  json_decref(im.groups_json);
  json_decref(im.hdr);
  return rc;
}
