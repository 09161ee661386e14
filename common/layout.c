/* Layout of the flat parameter and gradient buffers (layout.h, docs/design.md). */
#include "layout.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hash.h"

static uint64_t fnv_u64(uint64_t h, uint64_t v) {
  uint8_t le[8];
  for (int i = 0; i < 8; i++) le[i] = (uint8_t)(v >> (8 * i));
  return zd__fnv1a(h, le, sizeof le);
}

static uint64_t round_up(uint64_t v, uint64_t m) {
  return (v + m - 1) / m * m;
}

uint64_t zd__layout_default_bucket_elems(uint32_t world_size) {
  uint64_t per_rank = (uint64_t)world_size * 1000000u;
  return per_rank > 40000000u ? per_rank : 40000000u;
}

void zd__shape_format(const uint64_t *shape, uint32_t ndim, char *buf, size_t len) {
  size_t used = (size_t)snprintf(buf, len, "[");
  for (uint32_t d = 0; d < ndim && used < len; d++)
    used += (size_t)snprintf(buf + used, len - used, "%s%llu", d ? ", " : "",
                             (unsigned long long)shape[d]);
  if (used < len) snprintf(buf + used, len - used, "]");
}

static int name_cmp(const void *a, const void *b) {
  const zd__layout_param_t *const *pa = a, *const *pb = b;
  return strcmp((*pa)->name, (*pb)->name);
}

/* Names must be unique: sort pointers and compare neighbours (O(n log n) for big models). */
static int check_unique_names(zd__layout_t *l, zd__err_t *err) {
  if (l->nparams < 2) return ZD_OK;
  zd__layout_param_t **sorted = malloc(l->nparams * sizeof *sorted);
  if (!sorted)
    return zd__errf(err, -ENOMEM, "out of memory checking %u parameter names", l->nparams);
  for (uint32_t i = 0; i < l->nparams; i++) sorted[i] = &l->params[i];
  qsort(sorted, l->nparams, sizeof *sorted, name_cmp);
  int rc = ZD_OK;
  for (uint32_t i = 1; i < l->nparams; i++) {
    if (strcmp(sorted[i - 1]->name, sorted[i]->name) == 0) {
      rc = zd__errf(err, -EINVAL,
                    "parameter name '%s' is used twice (parameters %ld and %ld); "
                    "names must be unique",
                    sorted[i]->name, (long)(sorted[i - 1] - l->params),
                    (long)(sorted[i] - l->params));
      break;
    }
  }
  free(sorted);
  return rc;
}

static int add_param(zd__layout_param_t *dst, const zd_param_t *src, uint32_t index,
                     uint32_t ngroups, zd__err_t *err) {
  if (!src->name || !src->name[0]) return zd__errf(err, -EINVAL, "parameter %u has no name", index);
  size_t name_len = strnlen(src->name, ZD__MAX_NAME + 1);
  if (name_len > ZD__MAX_NAME)
    return zd__errf(err, -EINVAL, "parameter %u: name is longer than %d bytes", index,
                    ZD__MAX_NAME);
  for (size_t i = 0; i < name_len; i++) /* names travel in messages and parameter tables */
    if ((unsigned char)src->name[i] < 0x20 || src->name[i] == 0x7f)
      return zd__errf(err, -EINVAL,
                      "parameter %u: name has a control character (0x%02x at "
                      "byte %zu); expected printable characters",
                      index, (unsigned char)src->name[i], i);
  if (src->ndim > ZD_MAX_DIMS)
    return zd__errf(err, -EINVAL, "parameter %u '%s' has %u dimensions; at most %d supported",
                    index, src->name, src->ndim, ZD_MAX_DIMS);
  if (src->group >= ngroups)
    return zd__errf(err, ZD_EGROUP, "parameter %u '%s' is in group %u; expected a group below %u",
                    index, src->name, src->group, ngroups);
  uint64_t numel = 1;
  for (uint32_t d = 0; d < src->ndim; d++) {
    if (src->shape[d] > ZD__MAX_ELEMS || (src->shape[d] && numel > ZD__MAX_ELEMS / src->shape[d]))
      return zd__errf(err, -EINVAL, "parameter %u '%s' has more than %llu elements", index,
                      src->name, (unsigned long long)ZD__MAX_ELEMS);
    numel *= src->shape[d];
    dst->shape[d] = src->shape[d];
  }
  dst->name = strndup(src->name, name_len);
  if (!dst->name) return zd__errf(err, -ENOMEM, "out of memory");
  dst->ndim = src->ndim;
  dst->numel = numel;
  dst->group = src->group;
  return ZD_OK;
}

/* Closes the bucket that starts at parameter `first` and ends at `used` elements past `offset`. */
static void close_bucket(zd__layout_t *l, uint64_t offset, uint64_t used, uint32_t first,
                         uint32_t end, uint64_t *shard_base) {
  zd__bucket_t *b = &l->buckets[l->nbuckets++];
  b->offset = offset;
  b->elems = round_up(used ? used : 1, (uint64_t)ZD__ALIGN * l->world_size);
  b->shard_elems = b->elems / l->world_size;
  b->shard_base = *shard_base;
  b->first_param = first;
  b->nparams = end - first;
  *shard_base += b->shard_elems;
}

static uint64_t layout_hash(const zd__layout_t *l) {
  uint64_t h = zd__fnv1a(ZD__FNV1A_INIT, "zerod-layout-1", 14);
  h = fnv_u64(h, l->world_size);
  h = fnv_u64(h, l->bucket_elems);
  h = fnv_u64(h, l->nparams);
  for (uint32_t i = 0; i < l->nparams; i++) {
    const zd__layout_param_t *p = &l->params[i];
    h = zd__fnv1a(h, p->name, strlen(p->name) + 1);
    h = fnv_u64(h, p->ndim);
    for (uint32_t d = 0; d < p->ndim; d++) h = fnv_u64(h, p->shape[d]);
    h = fnv_u64(h, p->group);
  }
  return h;
}

int zd__layout_build(const zd_param_t *params, uint32_t nparams, uint32_t ngroups,
                     uint32_t world_size, uint64_t bucket_elems, zd__layout_t **out,
                     zd__err_t *err) {
  *out = NULL;
  if (world_size == 0) return zd__errf(err, -EINVAL, "world size is 0; expected at least 1");
  if (nparams == 0) return zd__errf(err, -EINVAL, "model has no parameters");
  if (nparams > ZD__MAX_PARAMS)
    return zd__errf(err, -EINVAL, "model has %u parameters; at most %u supported", nparams,
                    ZD__MAX_PARAMS);
  if (bucket_elems == 0) bucket_elems = zd__layout_default_bucket_elems(world_size);

  int rc = -ENOMEM;
  zd__layout_t *l = calloc(1, sizeof *l);
  if (!l) return zd__errf(err, rc, "out of memory");
  l->world_size = world_size;
  l->bucket_elems = bucket_elems;
  l->params = calloc(nparams, sizeof *l->params);
  l->buckets = calloc(nparams, sizeof *l->buckets); /* at most one bucket per parameter */
  if (!l->params || !l->buckets) {
    zd__errf(err, rc, "out of memory for a layout of %u parameters", nparams);
    goto fail;
  }

  for (uint32_t i = 0; i < nparams; i++) {
    rc = add_param(&l->params[i], &params[i], i, ngroups, err);
    l->nparams = i + (rc == ZD_OK); /* what zd__layout_free must release */
    if (rc) goto fail;
  }
  rc = check_unique_names(l, err);
  if (rc) goto fail;

  uint64_t bucket_offset = 0, used = 0, shard_base = 0;
  uint32_t first = 0;
  for (uint32_t i = 0; i < nparams; i++) {
    zd__layout_param_t *p = &l->params[i];
    uint64_t start = round_up(used, ZD__ALIGN);
    p->offset = bucket_offset + start;
    p->bucket = l->nbuckets;
    used = start + p->numel;
    if (used >= bucket_elems || i + 1 == nparams) {
      close_bucket(l, bucket_offset, used, first, i + 1, &shard_base);
      bucket_offset += l->buckets[l->nbuckets - 1].elems;
      used = 0;
      first = i + 1;
    }
    if (bucket_offset + used > ZD__MAX_ELEMS) {
      rc = zd__errf(err, -EINVAL, "model has more than %llu elements",
                    (unsigned long long)ZD__MAX_ELEMS);
      goto fail;
    }
  }
  l->total_elems = bucket_offset;
  l->shard_elems = shard_base;
  l->hash = layout_hash(l);
  *out = l;
  return ZD_OK;

fail:
  zd__layout_free(l);
  return rc;
}

void zd__layout_free(zd__layout_t *layout) {
  if (!layout) return;
  for (uint32_t i = 0; i < layout->nparams; i++) free(layout->params[i].name);
  free(layout->params);
  free(layout->buckets);
  free(layout);
}

int zd__layout_diff(const zd__layout_t *a, const zd__layout_t *b, char *buf, size_t len) {
  if (len == 0) return zd__layout_diff(a, b, (char[1]){0}, 1);
  if (a->world_size != b->world_size) {
    snprintf(buf, len, "world size %u vs %u", a->world_size, b->world_size);
    return 1;
  }
  if (a->bucket_elems != b->bucket_elems) {
    snprintf(buf, len, "bucket size %llu vs %llu elements", (unsigned long long)a->bucket_elems,
             (unsigned long long)b->bucket_elems);
    return 1;
  }
  uint32_t n = a->nparams < b->nparams ? a->nparams : b->nparams;
  for (uint32_t i = 0; i < n; i++) {
    const zd__layout_param_t *pa = &a->params[i], *pb = &b->params[i];
    char sa[160], sb[160];
    zd__shape_format(pa->shape, pa->ndim, sa, sizeof sa);
    zd__shape_format(pb->shape, pb->ndim, sb, sizeof sb);
    if (strcmp(pa->name, pb->name) != 0 || strcmp(sa, sb) != 0 || pa->group != pb->group) {
      snprintf(buf, len, "parameter %u: '%s' %s group %u vs '%s' %s group %u", i, pa->name, sa,
               pa->group, pb->name, sb, pb->group);
      return 1;
    }
  }
  if (a->nparams != b->nparams) {
    const zd__layout_param_t *extra = a->nparams > b->nparams ? &a->params[n] : &b->params[n];
    snprintf(buf, len, "%u vs %u parameters; first extra is parameter %u '%s'", a->nparams,
             b->nparams, n, extra->name);
    return 1;
  }
  buf[0] = '\0';
  return 0;
}

int zd__layout_segments(const zd__layout_t *layout, uint32_t rank, uint32_t bucket,
                        zd__segment_t **segs, uint32_t *nsegs) {
  const zd__bucket_t *b = &layout->buckets[bucket];
  uint64_t lo = b->offset + (uint64_t)rank * b->shard_elems, hi = lo + b->shard_elems;
  zd__segment_t *out = malloc((b->nparams ? b->nparams : 1) * sizeof *out);
  if (!out) return -ENOMEM;
  uint32_t n = 0;
  for (uint32_t i = b->first_param; i < b->first_param + b->nparams; i++) {
    const zd__layout_param_t *p = &layout->params[i];
    uint64_t s = p->offset > lo ? p->offset : lo;
    uint64_t e = p->offset + p->numel < hi ? p->offset + p->numel : hi;
    if (s >= e) continue;
    zd__segment_t *prev = n ? &out[n - 1] : NULL;
    if (prev && prev->group == p->group && prev->offset + prev->length == s - lo) {
      prev->length += e - s; /* adjacent parameters of one group: one segment */
    } else {
      out[n++] = (zd__segment_t){.offset = s - lo, .length = e - s, .group = p->group};
    }
  }
  *segs = out;
  *nsegs = n;
  return ZD_OK;
}

int zd__layout_serialize(const zd__layout_t *layout, char **out, size_t *len) {
  FILE *f = open_memstream(out, len);
  if (!f) return -ENOMEM;
  for (uint32_t i = 0; i < layout->nparams; i++) {
    const zd__layout_param_t *p = &layout->params[i];
    fprintf(f, "%u %u", p->group, p->ndim);
    for (uint32_t d = 0; d < p->ndim; d++) fprintf(f, " %llu", (unsigned long long)p->shape[d]);
    fprintf(f, " %zu %s\n", strlen(p->name), p->name);
  }
  return fclose(f) == 0 ? 0 : -ENOMEM;
}

/* Reads an unsigned decimal number and the space after it, within [*pos, end): the table comes
 * from a peer and need not be NUL-terminated, so strtoull (which reads on to the first non-digit,
 * and skips leading blanks, newlines included) must not see it. */
static int read_u64(char **pos, const char *end, uint64_t *v) {
  char *q = *pos;
  uint64_t x = 0;
  if (q >= end || *q < '0' || *q > '9') return -EINVAL;
  for (; q < end && *q >= '0' && *q <= '9'; q++) {
    unsigned digit = (unsigned)(*q - '0');
    if (x > (UINT64_MAX - digit) / 10) return -EINVAL;
    x = x * 10 + digit;
  }
  if (q >= end || *q != ' ') return -EINVAL;
  *v = x;
  *pos = q + 1;
  return 0;
}

int zd__layout_parse(char *buf, size_t len, zd_param_t **params, uint32_t *nparams) {
  uint32_t n = 0;
  for (size_t i = 0; i < len; i++) n += buf[i] == '\n';
  zd_param_t *out = calloc(n ? n : 1, sizeof *out);
  if (!out) return -ENOMEM;
  char *pos = buf, *end = buf + len;
  for (uint32_t i = 0; i < n; i++) {
    uint64_t group, ndim, namelen;
    if (read_u64(&pos, end, &group) || read_u64(&pos, end, &ndim) || ndim > ZD_MAX_DIMS) goto bad;
    out[i].group = (uint32_t)group;
    out[i].ndim = (uint32_t)ndim;
    for (uint32_t d = 0; d < ndim; d++)
      if (read_u64(&pos, end, &out[i].shape[d])) goto bad;
    if (read_u64(&pos, end, &namelen) || namelen >= (uint64_t)(end - pos) || pos[namelen] != '\n')
      goto bad;
    pos[namelen] = '\0';
    out[i].name = pos;
    pos += namelen + 1;
  }
  *params = out;
  *nparams = n;
  return 0;
bad:
  free(out);
  return -EINVAL;
}
