/* Checkpoint files on disk (checkpoint_format.h): the rank files (safetensors), the manifest
 * (JSON, by jansson), their checksums (XXH3), atomic writes, resharding loads, listing, retention
 * and export. Kept apart from the daemon so that zeroctl and the tests read checkpoints offline
 * with the same code that writes them. */
#include "checkpoint_format.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "dtype.h"
#include "group.h"

/* safetensors stores tensors little-endian; the arrays are written as they lie in memory. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
               "checkpoints assume a little-endian host");

#define CHUNK         (8u << 20)   /* bytes per write and per read: large, for throughput */
#define MAX_SHARD_HDR (1u << 20)   /* a rank file's header is a few hundred bytes */
#define MAX_MANIFEST  (1ull << 31) /* a million parameters take about 100 MB */
#define MERGE_GAP     (1u << 16)   /* elements of padding a load reads through to merge two runs */
#define JSON_FLAGS    (JSON_COMPACT | JSON_REAL_PRECISION(17))
#define SHARD_FORMAT  "zerod-shard"
#define EXPORT_FORMAT "zerod-export"
#define F32_BYTES     4u
#define NTENSORS      3

/* amsgrad's max_exp_avg_sq is a fourth tensor, in the files of a model that has it (the manifest's
 * max_exp_avg_sq says so): checkpoints without it keep their three. */
#define MAX_TENSORS 4
static const char *const tensor_names[MAX_TENSORS] = {"master", "exp_avg", "exp_avg_sq",
                                                      "max_exp_avg_sq"};

/* ---- system helpers -------------------------------------------------------------------------- */

static int write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len) {
    ssize_t w = write(fd, p, len);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    p += w;
    len -= (size_t)w;
  }
  return 0;
}

/* Bytes read (fewer than len only at the end of the file), or -errno. */
static ssize_t pread_all(int fd, void *buf, size_t len, uint64_t off) {
  char *p = buf;
  size_t done = 0;
  while (done < len) {
    ssize_t r = pread(fd, p + done, len - done, (off_t)(off + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (r == 0) break;
    done += (size_t)r;
  }
  return (ssize_t)done;
}

static int join(char *buf, size_t len, const char *dir, const char *name) {
  int n = snprintf(buf, len, "%s/%s", dir, name);
  return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

/* The rename of a file into dir is durable only once dir itself is fsynced. */
static int fsync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -errno;
  int rc = fsync(fd) ? -errno : 0;
  close(fd);
  return rc;
}

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static double mono_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- atomic files: written as <path>.tmp, fsynced, renamed, directory fsynced ---------------- */

typedef struct afile {
  int fd;
  char path[PATH_MAX];
  char tmp[PATH_MAX];
  XXH3_state_t *xxh;
  uint64_t bytes;
} afile_t;

static int afile_open(afile_t *f, const char *path, zd__err_t *err) {
  f->fd = -1;
  f->bytes = 0;
  f->xxh = NULL;
  int n = snprintf(f->path, sizeof f->path, "%s", path);
  int m = snprintf(f->tmp, sizeof f->tmp, "%s.tmp", path);
  if (n < 0 || (size_t)n >= sizeof f->path || m < 0 || (size_t)m >= sizeof f->tmp)
    return zd__errf(err, -ENAMETOOLONG, "%s: path too long", path);
  f->xxh = XXH3_createState();
  if (!f->xxh || XXH3_64bits_reset(f->xxh) != XXH_OK) {
    XXH3_freeState(f->xxh);
    f->xxh = NULL;
    return zd__errf(err, -ENOMEM, "%s: out of memory for the checksum state", path);
  }
  f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f->fd < 0) {
    int rc = -errno;
    XXH3_freeState(f->xxh);
    f->xxh = NULL;
    return zd__errf(err, rc, "cannot create %s: %s", f->tmp, strerror(-rc));
  }
  return ZD_OK;
}

static int afile_write(afile_t *f, const void *p, size_t n, zd__err_t *err) {
  int rc = write_all(f->fd, p, n);
  if (rc) return zd__errf(err, rc, "cannot write %s: %s", f->tmp, strerror(-rc));
  XXH3_64bits_update(f->xxh, p, n);
  f->bytes += n;
  return ZD_OK;
}

/* Removes the temporary file; accepts a file that failed to open. */
static void afile_abort(afile_t *f) {
  if (f->fd >= 0) {
    close(f->fd);
    unlink(f->tmp);
  }
  f->fd = -1;
  XXH3_freeState(f->xxh);
  f->xxh = NULL;
}

/* fsync, rename over path, fsync the directory; *xxh3 (may be NULL) receives the checksum. */
static int afile_commit(afile_t *f, uint64_t *xxh3, zd__err_t *err) {
  int rc = 0;
  if (fsync(f->fd)) {
    rc = -errno;
    zd__errf(err, rc, "cannot fsync %s: %s", f->tmp, strerror(-rc));
    goto fail;
  }
  if (close(f->fd)) {
    rc = -errno;
    f->fd = -1;
    unlink(f->tmp);
    zd__errf(err, rc, "cannot close %s: %s", f->tmp, strerror(-rc));
    goto fail;
  }
  f->fd = -1;
  if (rename(f->tmp, f->path)) {
    rc = -errno;
    unlink(f->tmp);
    zd__errf(err, rc, "cannot rename %s to %s: %s", f->tmp, f->path, strerror(-rc));
    goto fail;
  }
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s", f->path);
  char *slash = strrchr(dir, '/');
  if (!slash)
    snprintf(dir, sizeof dir, ".");
  else if (slash == dir)
    dir[1] = '\0';
  else
    *slash = '\0';
  if ((rc = fsync_dir(dir))) {
    zd__errf(err, rc, "cannot fsync directory %s: %s", dir, strerror(-rc));
    goto fail;
  }
  if (xxh3) *xxh3 = XXH3_64bits_digest(f->xxh);
  XXH3_freeState(f->xxh);
  f->xxh = NULL;
  return ZD_OK;
fail:
  afile_abort(f);
  return rc;
}

/* ---- safetensors headers --------------------------------------------------------------------- */

static json_t *tensor_entry(const uint64_t *shape, uint32_t ndim, uint64_t begin, uint64_t end) {
  json_t *t = json_object(), *s = json_array();
  for (uint32_t d = 0; d < ndim; d++) json_array_append_new(s, json_integer((json_int_t)shape[d]));
  json_object_set_new(t, "dtype", json_string("F32"));
  json_object_set_new(t, "shape", s);
  json_object_set_new(t, "data_offsets", json_pack("[I, I]", (json_int_t)begin, (json_int_t)end));
  return t;
}

/* The 8-byte little-endian length and the JSON header, padded with spaces so that the data starts
 * at a multiple of 8. *out is allocated (free()). */
static int header_bytes(const json_t *hdr, char **out, size_t *len) {
  char *text = json_dumps(hdr, JSON_FLAGS);
  if (!text) return -ENOMEM;
  size_t n = strlen(text), padded = (n + 7) / 8 * 8;
  char *buf = malloc(8 + padded);
  if (!buf) {
    free(text);
    return -ENOMEM;
  }
  for (int i = 0; i < 8; i++) buf[i] = (char)((uint64_t)padded >> (8 * i));
  memcpy(buf + 8, text, n);
  memset(buf + 8 + n, ' ', padded - n);
  free(text);
  *out = buf;
  *len = 8 + padded;
  return 0;
}

/* Where a rank file's three tensors are: data_start plus each tensor's offset, in bytes. */
typedef struct shard_hdr {
  uint64_t data_start;
  uint64_t off[MAX_TENSORS];
} shard_hdr_t;

static int meta_is(json_t *meta, const char *key, const char *want) {
  const char *v = json_string_value(json_object_get(meta, key));
  return v && strcmp(v, want) == 0;
}

/* Reads the header of the safetensors file open as fd (file_bytes long; messages name it `name`):
 * *hdr (json_decref) is its JSON object, *data_start the offset of the data. -EBADMSG for a file
 * whose header length is not 2 to max_bytes bytes within the file, or whose header is not a JSON
 * object (duplicate keys refused); -ENOMEM; -errno from pread. Rank files and imports share it. */
static int read_st_header(int fd, const char *name, uint64_t file_bytes, uint64_t max_bytes,
                          json_t **hdr, uint64_t *data_start, zd__err_t *err) {
  *hdr = NULL;
  unsigned char lenb[8];
  ssize_t r = pread_all(fd, lenb, 8, 0);
  if (r < 0) return zd__errf(err, (int)r, "%s: cannot read: %s", name, strerror((int)-r));
  uint64_t n = 0;
  for (int i = 0; r == 8 && i < 8; i++) n |= (uint64_t)lenb[i] << (8 * i);
  /* "{}" is the shortest header */
  if (r < 8 || n < 2 || n > max_bytes || 8 + n > file_bytes)
    return zd__errf(err, -EBADMSG,
                    "%s: not a safetensors file (%" PRIu64 " bytes, header length %" PRIu64
                    "; expected a header of 2 to %" PRIu64 " bytes within the file)",
                    name, file_bytes, n, max_bytes);
  char *text = malloc(n);
  if (!text) return zd__errf(err, -ENOMEM, "%s: out of memory for its header", name);
  r = pread_all(fd, text, n, 8);
  json_error_t jerr;
  json_t *j = r == (ssize_t)n ? json_loadb(text, n, JSON_REJECT_DUPLICATES, &jerr) : NULL;
  free(text);
  if (r < 0) return zd__errf(err, (int)r, "%s: cannot read: %s", name, strerror((int)-r));
  if (!json_is_object(j)) {
    const char *why = !j && r == (ssize_t)n ? jerr.text : NULL; /* the parser's, if it failed */
    json_decref(j);
    return zd__errf(err, -EBADMSG, "%s: the safetensors header is not a JSON object%s%s", name,
                    why ? ": " : "", why ? why : "");
  }
  *hdr = j;
  *data_start = 8 + n;
  return 0;
}

/* Reads and checks the header of rank file `name` (open as fd, file_bytes long): the ntensors (3,
 * or 4 with max_exp_avg_sq) F32 tensors of elems elements filling the data exactly, metadata
 * naming this rank, world and step. */
static int read_shard_header(int fd, const char *name, uint64_t file_bytes, uint32_t rank,
                             uint32_t world_size, uint64_t step, uint64_t elems, int ntensors,
                             shard_hdr_t *h, zd__err_t *err) {
  json_t *hdr;
  int rc = read_st_header(fd, name, file_bytes, MAX_SHARD_HDR, &hdr, &h->data_start, err);
  if (rc) return rc;
  char want[32];
  json_t *meta = json_object_get(hdr, "__metadata__");
  if (!json_is_object(meta) || !meta_is(meta, "format", SHARD_FORMAT) ||
      !meta_is(meta, "version", "1")) {
    rc = zd__errf(err, -EBADMSG, "%s: metadata is not format \"" SHARD_FORMAT "\" version \"1\"",
                  name);
    goto exit;
  }
  const char *keys[3] = {"rank", "world_size", "step"};
  uint64_t vals[3] = {rank, world_size, step};
  for (int k = 0; k < 3; k++) {
    snprintf(want, sizeof want, "%" PRIu64, vals[k]);
    if (!meta_is(meta, keys[k], want)) {
      const char *got = json_string_value(json_object_get(meta, keys[k]));
      rc = zd__errf(err, -EBADMSG, "%s: metadata %s is \"%s\"; expected \"%s\"", name, keys[k],
                    got ? got : "(missing)", want);
      goto exit;
    }
  }
  if (json_object_size(hdr) != 1 + (size_t)ntensors) {
    rc =
        zd__errf(err, -EBADMSG, "%s: %zu tensors; expected %d (master, exp_avg, exp_avg_sq%s)",
                 name, json_object_size(hdr) - 1, ntensors,
                 ntensors > NTENSORS ? ", max_exp_avg_sq: the manifest says the model has it" : "");
    goto exit;
  }
  uint64_t tbytes = elems * F32_BYTES;
  for (int t = 0; t < ntensors; t++) {
    json_t *e = json_object_get(hdr, tensor_names[t]);
    json_t *shape = json_object_get(e, "shape"), *offs = json_object_get(e, "data_offsets");
    json_int_t begin = json_integer_value(json_array_get(offs, 0));
    json_int_t end = json_integer_value(json_array_get(offs, 1));
    if (!json_is_object(e) || !meta_is(e, "dtype", "F32") || json_array_size(shape) != 1 ||
        !json_is_integer(json_array_get(shape, 0)) ||
        (uint64_t)json_integer_value(json_array_get(shape, 0)) != elems ||
        json_array_size(offs) != 2 || begin < 0 || end < begin ||
        (uint64_t)(end - begin) != tbytes || (uint64_t)end > file_bytes - h->data_start) {
      rc = zd__errf(err, -EBADMSG,
                    "%s: tensor \"%s\" is not F32 of shape [%" PRIu64 "] within the file (%" PRIu64
                    " bytes)",
                    name, tensor_names[t], elems, file_bytes);
      goto exit;
    }
    h->off[t] = (uint64_t)begin;
  }
  if (file_bytes != h->data_start + (uint64_t)ntensors * tbytes) {
    rc = zd__errf(err, -EBADMSG,
                  "%s: %" PRIu64 " bytes; expected %" PRIu64 " (header and %d x %" PRIu64
                  " elements)",
                  name, file_bytes, h->data_start + (uint64_t)ntensors * tbytes, ntensors, elems);
    goto exit;
  }
exit:
  json_decref(hdr);
  return rc;
}

/* ---- names ----------------------------------------------------------------------------------- */

int zd__ckpt_dir_name(const char *root, uint64_t step, char *buf, size_t len) {
  int n = snprintf(buf, len, "%s/step-%012llu", root, (unsigned long long)step);
  return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : ZD_OK;
}

void zd__ckpt_file_name(uint32_t rank, uint32_t world_size, char *buf, size_t len) {
  snprintf(buf, len, "rank-%05u-of-%05u.safetensors", rank, world_size);
}

/* ---- writing a rank file --------------------------------------------------------------------- */

int zd__ckpt_write_shard(const char *dir, const zd__ckpt_shard_t *s, uint64_t throttle_bytes_per_s,
                         zd__ckpt_file_t *out, zd__err_t *err) {
  if (s->world_size == 0 || s->rank >= s->world_size)
    return zd__errf(err, -EINVAL, "rank %u of a world of %u", s->rank, s->world_size);
  if (mkdir(dir, 0755) && errno != EEXIST) {
    int rc = -errno;
    return zd__errf(err, rc, "cannot create checkpoint directory %s: %s", dir, strerror(-rc));
  }
  zd__ckpt_file_t file = {.rank = s->rank};
  zd__ckpt_file_name(s->rank, s->world_size, file.name, sizeof file.name);
  char path[PATH_MAX], num[3][24]; /* rank, world_size, step */
  if (join(path, sizeof path, dir, file.name))
    return zd__errf(err, -ENAMETOOLONG, "%s/%s: path too long", dir, file.name);

  json_t *hdr = json_object(), *meta = json_object();
  json_object_set_new(meta, "format", json_string(SHARD_FORMAT));
  json_object_set_new(meta, "version", json_string("1"));
  snprintf(num[0], sizeof num[0], "%u", s->rank);
  snprintf(num[1], sizeof num[1], "%u", s->world_size);
  snprintf(num[2], sizeof num[2], "%" PRIu64, s->step);
  json_object_set_new(meta, "rank", json_string(num[0]));
  json_object_set_new(meta, "world_size", json_string(num[1]));
  json_object_set_new(meta, "step", json_string(num[2]));
  json_object_set_new(hdr, "__metadata__", meta);
  uint64_t tbytes = s->elems * F32_BYTES;
  int ntensors = s->max_exp_avg_sq ? MAX_TENSORS : NTENSORS;
  for (int t = 0; t < ntensors; t++)
    json_object_set_new(
        hdr, tensor_names[t],
        tensor_entry(&s->elems, 1, (uint64_t)t * tbytes, (uint64_t)(t + 1) * tbytes));
  char *head = NULL;
  size_t head_len = 0;
  int rc = header_bytes(hdr, &head, &head_len);
  json_decref(hdr);
  if (rc) return zd__errf(err, rc, "%s: out of memory for the header", path);

  afile_t f;
  if ((rc = afile_open(&f, path, err))) goto exit;
  if ((rc = afile_write(&f, head, head_len, err))) goto fail;
  /* Throttled, smaller chunks (an eighth of a second's worth) so that the pace is even. */
  size_t chunk = CHUNK;
  if (throttle_bytes_per_s && throttle_bytes_per_s / 8 < chunk)
    chunk = throttle_bytes_per_s / 8 > 4096 ? (size_t)(throttle_bytes_per_s / 8) : 4096;
  double start = mono_s();
  const float *arrays[MAX_TENSORS] = {s->master, s->exp_avg, s->exp_avg_sq, s->max_exp_avg_sq};
  for (int t = 0; t < ntensors; t++) {
    const char *p = (const char *)arrays[t];
    for (uint64_t done = 0; done < tbytes;) {
      size_t n = tbytes - done < chunk ? (size_t)(tbytes - done) : chunk;
      if ((rc = afile_write(&f, p + done, n, err))) goto fail;
      done += n;
      if (throttle_bytes_per_s) {
        double ahead = (double)f.bytes / (double)throttle_bytes_per_s - (mono_s() - start);
        if (ahead > 0) {
          struct timespec ts = {(time_t)ahead, (long)((ahead - (double)(time_t)ahead) * 1e9)};
          while (nanosleep(&ts, &ts) && errno == EINTR) {
          }
        }
      }
    }
  }
  file.bytes = f.bytes;
  if ((rc = afile_commit(&f, &file.xxh3, err))) goto exit;
  *out = file;
  goto exit;
fail:
  afile_abort(&f);
exit:
  free(head);
  return rc;
}

/* ---- the manifest: writing ------------------------------------------------------------------- */

static void hex64(uint64_t v, char buf[17]) {
  snprintf(buf, 17, "%016" PRIx64, v);
}

/* Group fields by kind, generated from ZD__GROUP_FIELDS: a new hyperparameter needs nothing here.
 */
#define TO_JSON_DOUBLE(v) json_real(v)
#define TO_JSON_ENUM(v)   json_integer((json_int_t)(v))
#define TO_JSON_BOOL(v)   json_boolean(v)

static json_t *group_json(const zd_group_t *g) {
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

static json_t *param_json(const zd__layout_param_t *p) {
  json_t *shape = json_array();
  for (uint32_t d = 0; d < p->ndim; d++)
    json_array_append_new(shape, json_integer((json_int_t)p->shape[d]));
  return json_pack("{s:s, s:o, s:I, s:I}", "name", p->name, "shape", shape, "group",
                   (json_int_t)p->group, "offset", (json_int_t)p->offset);
}

int zd__ckpt_write_manifest(const char *dir, const zd__ckpt_manifest_t *m, zd__err_t *err) {
  char path[PATH_MAX], hex[17], where[48];
  if (join(path, sizeof path, dir, ZD__CKPT_MANIFEST))
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
    if (json_array_append_new(groups, group_json(&m->groups[g]))) goto oom;
  for (uint32_t i = 0; i < l->nparams; i++) {
    if (json_array_append_new(params, param_json(&l->params[i]))) {
      json_decref(root); /* json_string refuses a name that is not UTF-8 */
      json_decref(groups);
      json_decref(params);
      json_decref(files);
      return zd__errf(err, -EINVAL, "%s: parameter %u '%s': name is not UTF-8 (or out of memory)",
                      path, i, l->params[i].name);
    }
  }
  for (uint32_t r = 0; r < m->nfiles; r++) {
    hex64(m->files[r].xxh3, hex);
    if (json_array_append_new(
            files, json_pack("{s:s, s:I, s:I, s:s}", "name", m->files[r].name, "rank",
                             (json_int_t)r, "bytes", (json_int_t)m->files[r].bytes, "xxh3", hex)))
      goto oom;
  }
  hex64(l->hash, hex);
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
  if (m->max_exp_avg_sq) /* absent in older checkpoints, which do not have it */
    bad |= json_object_set_new(root, "max_exp_avg_sq", json_true());
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
  afile_t f;
  if (!(rc = afile_open(&f, path, err))) {
    size_t n = strlen(text);
    if (!(rc = afile_write(&f, text, n, err)) && !(rc = afile_write(&f, "\n", 1, err)))
      rc = afile_commit(&f, NULL, err);
    else
      afile_abort(&f);
  }
  free(text);
  /* The step directory's own entry too: a prune that trusts this checkpoint must not outlive
   * it. */
  char parent[PATH_MAX];
  snprintf(parent, sizeof parent, "%s/..", dir);
  if (!rc && (rc = fsync_dir(parent)))
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
  ssize_t r = pread_all(fd, buf, (size_t)st.st_size, 0);
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
  if (join(path, sizeof path, dir, ZD__CKPT_MANIFEST))
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
      (rc = get_u64(&r, root, "", "created_ms", INT64_MAX, &created)) ||
      (json_object_get(root, "max_exp_avg_sq") &&
       (rc = get_bool(&r, root, "", "max_exp_avg_sq", &m->max_exp_avg_sq))))
    goto fail;
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
  free(m);
}

/* ---- verification ---------------------------------------------------------------------------- */

/* Opens rank file r of m and checks its size and header (not its checksum). */
static int open_rank_file(const char *dir, const zd__ckpt_manifest_t *m, uint32_t r, int *fd_out,
                          shard_hdr_t *h, zd__err_t *err) {
  const zd__ckpt_file_t *f = &m->files[r];
  char path[PATH_MAX];
  if (join(path, sizeof path, dir, f->name))
    return zd__errf(err, -ENAMETOOLONG, "%s/%s: path too long", dir, f->name);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int rc = -errno;
    return zd__errf(err, rc, "%s: %s", path, strerror(-rc));
  }
  struct stat st;
  int rc = 0;
  if (fstat(fd, &st)) {
    rc = -errno;
    zd__errf(err, rc, "%s: %s", path, strerror(-rc));
  } else if ((uint64_t)st.st_size != f->bytes) {
    rc = zd__errf(err, -EBADMSG, "%s: %lld bytes; expected %" PRIu64, f->name,
                  (long long)st.st_size, f->bytes);
  } else {
    rc = read_shard_header(fd, f->name, f->bytes, r, m->world_size, m->step, m->layout->shard_elems,
                           m->max_exp_avg_sq ? MAX_TENSORS : NTENSORS, h, err);
  }
  if (rc) {
    close(fd);
    return rc;
  }
  *fd_out = fd;
  return 0;
}

int zd__ckpt_verify(const char *dir, const zd__ckpt_manifest_t *m, zd__err_t *err) {
  char *buf = malloc(CHUNK);
  XXH3_state_t *xxh = XXH3_createState();
  int rc = 0;
  if (!buf || !xxh) {
    rc = zd__errf(err, -ENOMEM, "%s: out of memory to verify", dir);
    goto exit;
  }
  for (uint32_t r = 0; r < m->nfiles && !rc; r++) {
    const zd__ckpt_file_t *f = &m->files[r];
    char path[PATH_MAX];
    if (join(path, sizeof path, dir, f->name)) {
      rc = zd__errf(err, -ENAMETOOLONG, "%s/%s: path too long", dir, f->name);
      break;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      rc = -errno;
      zd__errf(err, rc, "%s: %s (expected %" PRIu64 " bytes, checksum 0x%016" PRIx64 ")", path,
               strerror(-rc), f->bytes, f->xxh3);
      break;
    }
    posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    XXH3_64bits_reset(xxh);
    uint64_t bytes = 0;
    for (;;) {
      ssize_t n = pread_all(fd, buf, CHUNK, bytes);
      if (n < 0) {
        rc = zd__errf(err, (int)n, "%s: %s", path, strerror((int)-n));
        break;
      }
      XXH3_64bits_update(xxh, buf, (size_t)n);
      bytes += (uint64_t)n;
      if ((size_t)n < CHUNK) break;
    }
    if (!rc) {
      uint64_t sum = XXH3_64bits_digest(xxh);
      if (bytes != f->bytes || sum != f->xxh3) {
        rc = zd__errf(err, -EBADMSG,
                      "%s: %" PRIu64 " bytes, checksum 0x%016" PRIx64 "; expected %" PRIu64
                      " bytes, checksum 0x%016" PRIx64,
                      f->name, bytes, sum, f->bytes, f->xxh3);
      }
    }
    close(fd);
    if (!rc) {
      int hfd;
      shard_hdr_t h;
      if (!(rc = open_rank_file(dir, m, r, &hfd, &h, err))) close(hfd);
    }
  }
exit:
  XXH3_freeState(xxh);
  free(buf);
  return rc;
}

/* ---- resharding ------------------------------------------------------------------------------ */

/* A contiguous run of elements: `n` of them at `src` in the writer's rank file `file` (shard
 * element index), to `dst` in the reader's array. */
typedef struct run {
  uint32_t file;
  uint64_t src, dst, n;
} run_t;

typedef struct runs {
  run_t *v;
  size_t n, cap;
} runs_t;

/* Appends a run, merging it into the previous one when they come from the same file with the same
 * distance between them on both sides (the padding between is read too, and zeroed after). */
static int runs_add(runs_t *rs, uint32_t file, uint64_t src, uint64_t dst, uint64_t n) {
  if (rs->n) {
    run_t *last = &rs->v[rs->n - 1];
    uint64_t dst_end = last->dst + last->n, src_end = last->src + last->n;
    if (last->file == file && dst >= dst_end && src >= src_end && dst - dst_end == src - src_end &&
        dst - dst_end <= MERGE_GAP) {
      last->n = dst + n - last->dst;
      return 0;
    }
  }
  if (rs->n == rs->cap) {
    size_t cap = rs->cap ? rs->cap * 2 : 64;
    run_t *v = realloc(rs->v, cap * sizeof *v);
    if (!v) return -ENOMEM;
    rs->v = v;
    rs->cap = cap;
  }
  rs->v[rs->n++] = (run_t){.file = file, .src = src, .dst = dst, .n = n};
  return 0;
}

/* Elements [i0, i1) of parameter p, bound for dst onwards, as runs of the writer's rank files. */
static int map_param(const zd__layout_t *old, uint32_t p, uint64_t i0, uint64_t i1, uint64_t dst,
                     runs_t *rs) {
  const zd__layout_param_t *op = &old->params[p];
  const zd__bucket_t *ob = &old->buckets[op->bucket];
  for (uint64_t i = i0; i < i1;) {
    uint64_t rel = op->offset + i - ob->offset;
    uint64_t file = rel / ob->shard_elems, pos = rel % ob->shard_elems;
    uint64_t n = ob->shard_elems - pos < i1 - i ? ob->shard_elems - pos : i1 - i;
    if (runs_add(rs, (uint32_t)file, ob->shard_base + pos, dst + (i - i0), n)) return -ENOMEM;
    i += n;
  }
  return 0;
}

/* Whether a and b have the same parameter table (names, shapes, groups, in order); if not, the
 * first difference in buf. World size and bucket size may differ. */
static int same_params(const zd__layout_t *a, const zd__layout_t *b, char *buf, size_t len) {
  uint32_t n = a->nparams < b->nparams ? a->nparams : b->nparams;
  for (uint32_t i = 0; i < n; i++) {
    const zd__layout_param_t *pa = &a->params[i], *pb = &b->params[i];
    char sa[160], sb[160];
    zd__shape_format(pa->shape, pa->ndim, sa, sizeof sa);
    zd__shape_format(pb->shape, pb->ndim, sb, sizeof sb);
    if (strcmp(pa->name, pb->name) != 0 || strcmp(sa, sb) != 0 || pa->group != pb->group) {
      snprintf(buf, len, "parameter %u: '%s' %s group %u in the checkpoint vs '%s' %s group %u", i,
               pa->name, sa, pa->group, pb->name, sb, pb->group);
      return 0;
    }
  }
  if (a->nparams != b->nparams) {
    snprintf(buf, len, "%u parameters in the checkpoint vs %u", a->nparams, b->nparams);
    return 0;
  }
  return 1;
}

/* The writer's rank files, opened as runs first need them. */
typedef struct sources {
  const char *dir;
  const zd__ckpt_manifest_t *m;
  int *fd;
  shard_hdr_t *hdr;
} sources_t;

static int sources_init(sources_t *s, const char *dir, const zd__ckpt_manifest_t *m) {
  s->dir = dir;
  s->m = m;
  s->fd = malloc(m->nfiles * sizeof *s->fd);
  s->hdr = calloc(m->nfiles, sizeof *s->hdr);
  if (!s->fd || !s->hdr) return -ENOMEM;
  for (uint32_t r = 0; r < m->nfiles; r++) s->fd[r] = -1;
  return 0;
}

static int sources_get(sources_t *s, uint32_t r, zd__err_t *err) {
  if (s->fd[r] >= 0) return 0;
  return open_rank_file(s->dir, s->m, r, &s->fd[r], &s->hdr[r], err);
}

static void sources_close(sources_t *s) {
  for (uint32_t r = 0; s->fd && r < s->m->nfiles; r++)
    if (s->fd[r] >= 0) close(s->fd[r]);
  free(s->fd);
  free(s->hdr);
}

/* Reads n elements of tensor t at src of rank file r into dst. */
static int read_elems(sources_t *s, uint32_t r, int t, uint64_t src, uint64_t n, float *dst,
                      zd__err_t *err) {
  int rc = sources_get(s, r, err);
  if (rc) return rc;
  uint64_t off = s->hdr[r].data_start + s->hdr[r].off[t] + src * F32_BYTES;
  ssize_t got = pread_all(s->fd[r], dst, n * F32_BYTES, off);
  if (got < 0)
    return zd__errf(err, (int)got, "%s/%s: %s", s->dir, s->m->files[r].name, strerror((int)-got));
  if ((uint64_t)got != n * F32_BYTES)
    return zd__errf(err, -EBADMSG, "%s/%s: ends at %" PRIu64 " bytes; expected %" PRIu64 " or more",
                    s->dir, s->m->files[r].name, off + (uint64_t)got, off + n * F32_BYTES);
  return 0;
}

int zd__ckpt_load_shard(const char *dir, const zd__ckpt_manifest_t *m, const zd__layout_t *layout,
                        uint32_t rank, float *master, float *exp_avg, float *exp_avg_sq,
                        float *max_exp_avg_sq, zd__err_t *err) {
  char diff[ZD__ERR_MSG_MAX - 128];
  if (!same_params(m->layout, layout, diff, sizeof diff))
    return zd__errf(err, ZD_ELAYOUT, "%s: the model differs from the checkpoint's: %s", dir, diff);
  if (max_exp_avg_sq && !m->max_exp_avg_sq)
    return zd__errf(err, ZD_ECHECKPOINT,
                    "%s: the model has amsgrad but the checkpoint has no max_exp_avg_sq (written "
                    "without amsgrad; torch's load_state_dict would leave the state without it and "
                    "its step raise KeyError): resume without amsgrad, or start afresh",
                    dir);
  if (rank >= layout->world_size)
    return zd__errf(err, -EINVAL, "rank %u of a world of %u", rank, layout->world_size);
  runs_t rs = {0};
  runs_t zero = {0}; /* padding of the new shard: file and src unused */
  sources_t src = {0};
  int rc = -ENOMEM;
  if (sources_init(&src, dir, m)) goto oom;
  uint64_t cursor = 0;
  for (uint32_t b = 0; b < layout->nbuckets; b++) {
    const zd__bucket_t *bk = &layout->buckets[b];
    uint64_t lo = bk->offset + (uint64_t)rank * bk->shard_elems, hi = lo + bk->shard_elems;
    for (uint32_t p = bk->first_param; p < bk->first_param + bk->nparams; p++) {
      const zd__layout_param_t *np = &layout->params[p];
      uint64_t s = np->offset > lo ? np->offset : lo;
      uint64_t e = np->offset + np->numel < hi ? np->offset + np->numel : hi;
      if (s >= e) continue;
      uint64_t dst = bk->shard_base + (s - lo);
      if (dst > cursor && runs_add(&zero, 0, 0, cursor, dst - cursor)) goto oom;
      if (map_param(m->layout, p, s - np->offset, e - np->offset, dst, &rs)) goto oom;
      cursor = dst + (e - s);
    }
  }
  if (layout->shard_elems > cursor && runs_add(&zero, 0, 0, cursor, layout->shard_elems - cursor))
    goto oom;
  float *arrays[MAX_TENSORS] = {master, exp_avg, exp_avg_sq, max_exp_avg_sq};
  for (int t = 0; t < (max_exp_avg_sq ? MAX_TENSORS : NTENSORS); t++) {
    for (size_t i = 0; i < rs.n; i++) {
      const run_t *r = &rs.v[i];
      if ((rc = read_elems(&src, r->file, t, r->src, r->n, arrays[t] + r->dst, err))) goto exit;
    }
    for (size_t i = 0; i < zero.n; i++)
      memset(arrays[t] + zero.v[i].dst, 0, zero.v[i].n * sizeof(float));
  }
  rc = ZD_OK;
  goto exit;
oom:
  rc = zd__errf(err, -ENOMEM, "%s: out of memory planning the load of rank %u", dir, rank);
exit:
  sources_close(&src);
  free(rs.v);
  free(zero.v);
  return rc;
}

/* ---- listing, choosing, pruning -------------------------------------------------------------- */

static int cmp_desc(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? 1 : x > y ? -1 : 0;
}

int zd__ckpt_list(const char *root, uint64_t **steps, size_t *n, zd__err_t *err) {
  *steps = NULL;
  *n = 0;
  DIR *d = opendir(root);
  if (!d) {
    if (errno == ENOENT) return ZD_OK;
    int rc = -errno;
    return zd__errf(err, rc, "cannot list checkpoints in %s: %s", root, strerror(-rc));
  }
  uint64_t *v = NULL;
  size_t cnt = 0, cap = 0;
  int rc = ZD_OK;
  struct dirent *e;
  while ((e = readdir(d))) {
    const char *digits = e->d_name + 5;
    size_t nd = strlen(digits);
    if (strncmp(e->d_name, "step-", 5) != 0 || nd == 0 || nd > 19 ||
        strspn(digits, "0123456789") != nd)
      continue;
    struct stat st;
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) || !S_ISDIR(st.st_mode)) continue;
    if (cnt == cap) {
      cap = cap ? cap * 2 : 16;
      uint64_t *nv = realloc(v, cap * sizeof *nv);
      if (!nv) {
        rc = zd__errf(err, -ENOMEM, "out of memory listing %s", root);
        break;
      }
      v = nv;
    }
    v[cnt++] = strtoull(digits, NULL, 10);
  }
  closedir(d);
  if (rc) {
    free(v);
    return rc;
  }
  if (cnt) qsort(v, cnt, sizeof *v, cmp_desc);
  *steps = v;
  *n = cnt;
  return ZD_OK;
}

/* A checkpoint directory as choosing and pruning see it. */
typedef struct entry {
  uint64_t step;
  uint64_t created_ms; /* the manifest's; 0 when it has none that reads */
  uint64_t mtime_ms;   /* the directory's last change (files created or renamed in it) */
  int complete;        /* a manifest that reads (its files are checked later) */
} entry_t;

/* Most recently completed first: the newest checkpoint is the one written last, not the one with
 * the highest step (a fresh run in a directory that holds an older run's checkpoints must not
 * lose its own to the retention, nor resume the old run's). Then the ones without a readable
 * manifest, highest step first. */
static int cmp_entry(const void *a, const void *b) {
  const entry_t *x = a, *y = b;
  if (x->complete != y->complete) return x->complete ? -1 : 1;
  if (x->complete && x->created_ms != y->created_ms) return x->created_ms < y->created_ms ? 1 : -1;
  return x->step < y->step ? 1 : x->step > y->step ? -1 : 0;
}

static int list_entries(const char *root, entry_t **out, size_t *n, zd__err_t *err) {
  uint64_t *steps;
  int rc = zd__ckpt_list(root, &steps, n, err);
  if (rc) return rc;
  entry_t *v = calloc(*n ? *n : 1, sizeof *v);
  if (!v) {
    free(steps);
    return zd__errf(err, -ENOMEM, "out of memory listing %s", root);
  }
  for (size_t i = 0; i < *n; i++) {
    char dir[PATH_MAX];
    zd__err_t e = {0};
    zd__ckpt_manifest_t *m = NULL;
    v[i].step = steps[i];
    struct stat st;
    if (zd__ckpt_dir_name(root, steps[i], dir, sizeof dir) == 0 && stat(dir, &st) == 0)
      v[i].mtime_ms = (uint64_t)st.st_mtim.tv_sec * 1000 + (uint64_t)st.st_mtim.tv_nsec / 1000000;
    if (zd__ckpt_dir_name(root, steps[i], dir, sizeof dir) == 0 &&
        zd__ckpt_read_manifest(dir, &m, &e) == 0) {
      v[i].complete = 1;
      v[i].created_ms = m->created_ms;
    }
    zd__ckpt_manifest_free(m);
  }
  free(steps);
  if (*n) qsort(v, *n, sizeof *v, cmp_entry);
  *out = v;
  return ZD_OK;
}

int zd__ckpt_find_latest(const char *root, const zd__layout_t *want, zd__ckpt_reject_fn reject,
                         void *ctx, char **dir_out, zd__ckpt_manifest_t **m_out, zd__err_t *err) {
  *dir_out = NULL;
  *m_out = NULL;
  entry_t *entries;
  size_t n;
  int rc = list_entries(root, &entries, &n, err);
  if (rc) return rc;
  size_t passed = 0;
  for (size_t i = 0; i < n; i++) {
    char dir[PATH_MAX], diff[ZD__ERR_MSG_MAX - 64];
    zd__err_t e = {0};
    zd__ckpt_manifest_t *m = NULL;
    if (zd__ckpt_dir_name(root, entries[i].step, dir, sizeof dir)) continue;
    if (!zd__ckpt_read_manifest(dir, &m, &e) && !zd__ckpt_verify(dir, m, &e)) {
      if (!want || same_params(m->layout, want, diff, sizeof diff)) {
        *dir_out = strdup(dir);
        if (!*dir_out) {
          zd__ckpt_manifest_free(m);
          free(entries);
          return zd__errf(err, -ENOMEM, "out of memory");
        }
        *m_out = m;
        free(entries);
        return ZD_OK;
      }
      zd__errf(&e, ZD_ELAYOUT, "the model differs from the checkpoint's: %s", diff);
    }
    zd__ckpt_manifest_free(m);
    passed++;
    if (reject) reject(ctx, dir, e.msg);
  }
  free(entries);
  return zd__errf(err, -ENOENT, "no complete checkpoint under %s (%zu passed over)", root, passed);
}

/* Removes a checkpoint directory: the manifest first (durably), so that an interrupted removal
 * leaves an incomplete directory that the next prune takes, never a broken "complete" one. */
static int remove_ckpt(const char *root, const char *dir, zd__err_t *err) {
  char path[PATH_MAX];
  int rc = 0;
  if (join(path, sizeof path, dir, ZD__CKPT_MANIFEST) == 0 && unlink(path) == 0) fsync_dir(dir);
  DIR *d = opendir(dir);
  if (!d) {
    rc = -errno;
    return zd__errf(err, rc, "cannot remove %s: %s", dir, strerror(-rc));
  }
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    if (unlinkat(dirfd(d), e->d_name, 0) && errno != ENOENT) {
      rc = -errno;
      zd__errf(err, rc, "cannot remove %s/%s: %s", dir, e->d_name, strerror(-rc));
      break;
    }
  }
  closedir(d);
  if (!rc && rmdir(dir)) {
    rc = -errno;
    zd__errf(err, rc, "cannot remove %s: %s", dir, strerror(-rc));
  }
  if (!rc) fsync_dir(root);
  return rc;
}

int zd__ckpt_prune(const char *root, uint32_t keep, zd__err_t *err) {
  if (keep == 0) return ZD_OK;
  entry_t *entries;
  size_t n;
  int rc = list_entries(root, &entries, &n, err);
  if (rc) return rc;
  /* The newest complete one (entries[0] when there is one) bounds the leftovers: a directory
   * without a manifest at a higher step may be being written now. */
  uint64_t newest_step = n && entries[0].complete ? entries[0].step : UINT64_MAX;
  uint64_t newest_ms = n && entries[0].complete ? entries[0].created_ms : 0;
  uint32_t kept = 0;
  for (size_t i = 0; i < n && !rc; i++) {
    char dir[PATH_MAX];
    if (zd__ckpt_dir_name(root, entries[i].step, dir, sizeof dir)) continue;
    /* A directory without a manifest is a crash's leftover only when it is below the newest
     * complete step and has not changed since that checkpoint was written; else it may be being
     * written now (by this run, or by a fresh run below an older run's steps). */
    if (entries[i].complete ? kept++ < keep
                            : newest_step == UINT64_MAX || entries[i].step >= newest_step ||
                                  entries[i].mtime_ms >= newest_ms)
      continue;
    rc = remove_ckpt(root, dir, err);
  }
  free(entries);
  return rc;
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
  int ntensors = !moments ? 1 : m->max_exp_avg_sq ? MAX_TENSORS : NTENSORS;
  static const char *const suffix[MAX_TENSORS] = {"", ".exp_avg", ".exp_avg_sq", ".max_exp_avg_sq"};
  char *head = NULL, *buf = NULL, num[24], hex[17];
  runs_t rs = {0};
  sources_t src = {0};
  afile_t f = {.fd = -1};
  json_t *hdr = json_object(), *meta = json_object(), *pg = json_array(), *groups = json_array();
  rc = -ENOMEM;
  if (!hdr || !meta || !pg || !groups) goto oom;

  uint64_t off = 0;
  for (int t = 0; t < ntensors; t++) {
    for (uint32_t i = 0; i < l->nparams; i++) {
      const zd__layout_param_t *p = &l->params[i];
      char name[ZD__MAX_NAME + 16];
      snprintf(name, sizeof name, "%s%s", p->name, suffix[t]);
      if (json_object_get(hdr, name) || !strcmp(name, "__metadata__")) {
        rc = zd__errf(err, -EINVAL, "%s: tensor name '%s' is used twice; cannot export", dir, name);
        goto exit;
      }
      uint64_t bytes = p->numel * F32_BYTES;
      if (json_object_set_new(hdr, name, tensor_entry(p->shape, p->ndim, off, off + bytes)))
        goto oom;
      off += bytes;
    }
  }
  for (uint32_t i = 0; i < l->nparams; i++)
    json_array_append_new(pg, json_integer(l->params[i].group));
  for (uint32_t g = 0; g < m->ngroups; g++)
    json_array_append_new(groups, group_json(&m->groups[g]));
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
  hex64(m->layout_hash, hex);
  json_object_set_new(meta, "layout_hash", json_string(hex));
  json_object_set_new(meta, "moments", json_string(moments ? "1" : "0"));
  json_object_set_new(meta, "groups", pg_text && groups_text ? json_string(groups_text) : NULL);
  json_object_set_new(meta, "param_groups", pg_text && groups_text ? json_string(pg_text) : NULL);
  free(pg_text);
  free(groups_text);
  if (json_object_size(meta) != 10 || json_object_set_new(hdr, "__metadata__", meta)) {
    meta = NULL;
    goto oom;
  }
  meta = NULL;
  size_t head_len;
  if (header_bytes(hdr, &head, &head_len) || !(buf = malloc(CHUNK))) goto oom;
  if (sources_init(&src, dir, m)) goto oom;

  if ((rc = afile_open(&f, out_path, err))) goto exit;
  if ((rc = afile_write(&f, head, head_len, err))) goto exit;
  for (int t = 0; t < ntensors; t++) {
    for (uint32_t i = 0; i < l->nparams; i++) {
      rs.n = 0;
      if (map_param(l, i, 0, l->params[i].numel, 0, &rs)) goto oom;
      for (size_t k = 0; k < rs.n; k++) {
        const run_t *r = &rs.v[k];
        for (uint64_t done = 0; done < r->n;) {
          uint64_t n = r->n - done < CHUNK / F32_BYTES ? r->n - done : CHUNK / F32_BYTES;
          if ((rc = read_elems(&src, r->file, t, r->src + done, n, (float *)buf, err)) ||
              (rc = afile_write(&f, buf, n * F32_BYTES, err)))
            goto exit;
          done += n;
        }
      }
    }
  }
  rc = afile_commit(&f, NULL, err);
  goto exit;
oom:
  rc = zd__errf(err, -ENOMEM, "%s: out of memory exporting to %s", dir, out_path);
exit:
  if (f.fd >= 0) afile_abort(&f);
  sources_close(&src);
  json_decref(hdr);
  json_decref(meta);
  json_decref(pg);
  json_decref(groups);
  free(rs.v);
  free(buf);
  free(head);
  zd__ckpt_manifest_free(m);
  return rc;
}

/* ---- import ---------------------------------------------------------------------------------- */

#define TORCH_STATE_FORMAT "zerod-torch-state"
#define MAX_IMPORT_HDR     MAX_MANIFEST /* three entries of at most 300 bytes per parameter */

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
  in_tensor_t *tensors;
  size_t ntensors;
  zd_group_t *groups;
  uint32_t ngroups;
  zd_param_t *params;
  uint32_t nparams;
  int per;                      /* tensors per parameter: 3, or 4 with max_exp_avg_sq */
  const in_tensor_t **by_param; /* nparams x per: master, exp_avg, exp_avg_sq(, max_exp_avg_sq) */
  zd__layout_t *layout;
  float *arrays;
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
  int rc = read_st_header(im->fd, im->path, file_bytes, MAX_IMPORT_HDR, &im->hdr, &im->data_start,
                          im->err);
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
      (rc = meta_json(im, meta, "params", !is_export, &im->names_json)))
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
    if (!json_is_object(e) || !meta_is(e, "dtype", "F32"))
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

/* The groups, and the parameters in registration order, each with its three tensors. */
static int import_params(importer_t *im) {
  reader_t rd = {.path = im->path, .err = im->err};
  size_t ng = json_array_size(im->groups_json);
  if (ng == 0 || ng > UINT32_MAX) return import_bad(im, "metadata \"groups\" is empty");
  im->ngroups = (uint32_t)ng;
  im->groups = calloc(ng, sizeof *im->groups);
  if (!im->groups) return zd__errf(im->err, -ENOMEM, "%s: out of memory", im->path);
  int rc;
  for (uint32_t g = 0; g < im->ngroups; g++)
    if ((rc = read_group(&rd, json_array_get(im->groups_json, g), g, &im->groups[g]))) return rc;

  size_t np = json_array_size(im->pgroups_json);
  if (np == 0 || np > ZD__MAX_PARAMS)
    return import_bad(im, "metadata \"param_groups\" lists %zu parameters; expected 1 to %u", np,
                      ZD__MAX_PARAMS);
  if (im->ntensors != 3 * np && im->ntensors != 4 * np)
    return import_bad(im,
                      "%zu tensors for %zu parameters; expected 3 per parameter (NAME, "
                      "NAME.exp_avg, NAME.exp_avg_sq), or 4 with NAME.max_exp_avg_sq (amsgrad) "
                      "for every one, and no other",
                      im->ntensors, np);
  im->per = im->ntensors == 4 * np ? 4 : 3;
  if (im->names_json && json_array_size(im->names_json) != np)
    return import_bad(im, "metadata \"params\" names %zu parameters, \"param_groups\" %zu",
                      json_array_size(im->names_json), np);
  im->nparams = (uint32_t)np;
  im->params = calloc(np, sizeof *im->params);
  im->by_param = calloc((size_t)im->per * np, sizeof *im->by_param);
  if (!im->params || !im->by_param)
    return zd__errf(im->err, -ENOMEM, "%s: out of memory for %zu parameters", im->path, np);
  /* An export lists no names: its master tensors come first in its data, in registration
   * order (zd__ckpt_export writes them so). */
  in_tensor_t *sorted = NULL;
  if (!im->names_json) {
    sorted = malloc(im->ntensors * sizeof *sorted);
    if (!sorted) return zd__errf(im->err, -ENOMEM, "%s: out of memory", im->path);
    memcpy(sorted, im->tensors, im->ntensors * sizeof *sorted);
    qsort(sorted, im->ntensors, sizeof *sorted, by_data);
  }
  static const char *const suffix[MAX_TENSORS] = {"", ".exp_avg", ".exp_avg_sq", ".max_exp_avg_sq"};
  const int per = im->per;
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
    for (int t = 0; t < per && !rc; t++) {
      char tname[ZD__MAX_NAME + 16];
      snprintf(tname, sizeof tname, "%s%s", name, suffix[t]);
      const in_tensor_t *found = find_tensor(im, tname);
      if (!found)
        rc = import_bad(im, "no tensor \"%.300s\" for parameter '%.300s'", tname, name);
      else if (t > 0 && !same_shape(found, im->by_param[per * i]))
        rc = import_bad(im, "tensor \"%.300s\" is not of its parameter's shape", tname);
      im->by_param[per * i + t] = found;
    }
    if (rc) break;
    const in_tensor_t *master = im->by_param[per * i];
    im->params[i] = (zd_param_t){
        .name = master->name, .ndim = master->ndim, .group = (uint32_t)json_integer_value(g)};
    memcpy(im->params[i].shape, master->shape, sizeof master->shape);
  }
  free(sorted);
  return rc;
}

/* Reads every parameter's three (or four) tensors to where the W=1 layout puts them (padding
 * stays 0). */
static int import_read(importer_t *im) {
  uint64_t n = im->layout->shard_elems;
  im->arrays = calloc((uint64_t)im->per * (n ? n : 1), sizeof(float));
  if (!im->arrays)
    return zd__errf(im->err, -ENOMEM, "%s: out of memory for %" PRIu64 " elements", im->path,
                    (uint64_t)im->per * n);
  for (uint32_t i = 0; i < im->nparams; i++) {
    const zd__layout_param_t *p = &im->layout->params[i];
    for (int t = 0; t < im->per; t++) {
      const in_tensor_t *src = im->by_param[(uint64_t)im->per * i + t];
      /* At world size 1 a rank's shard is the flat buffer: a parameter's offset is its index. */
      float *dst = im->arrays + (uint64_t)t * n + p->offset;
      uint64_t bytes = p->numel * F32_BYTES;
      ssize_t got = pread_all(im->fd, dst, bytes, im->data_start + src->begin);
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
      join(manifest, sizeof manifest, dir, ZD__CKPT_MANIFEST) || strlen(dir) >= dir_len)
    return zd__errf(err, -ENAMETOOLONG, "%s: path too long", root);
  if (access(manifest, F_OK) == 0)
    return zd__errf(err, -EEXIST,
                    "%s already holds a complete checkpoint of step %" PRIu64
                    "; import into another directory",
                    dir, step);
  uint64_t n = im->layout->shard_elems;
  zd__ckpt_shard_t shard = {.rank = 0,
                            .world_size = 1,
                            .step = step,
                            .elems = n,
                            .master = im->arrays,
                            .exp_avg = im->arrays + n,
                            .exp_avg_sq = im->arrays + 2 * n,
                            .max_exp_avg_sq = im->per > 3 ? im->arrays + 3 * n : NULL};
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
                           .max_exp_avg_sq = im->per > 3,
                           .files = &file,
                           .nfiles = 1};
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
  json_decref(im.groups_json);
  json_decref(im.hdr);
  return rc;
}
