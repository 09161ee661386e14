/* libFuzzer harness of the layout (common/layout.c): building one from a parameter list, the
 * segments of each rank's slices, and the parameter table ranks exchange (serialize, parse).
 *
 * The first input byte picks the mode. Mode 0 parses the rest as a parameter table, as a rank
 * parses a peer's (not NUL-terminated, right before an inaccessible page); a table that parses and
 * builds must serialize to one that parses to the same list. Otherwise the rest encodes the
 * world size, bucket size, number of groups and a parameter list (names, shapes and groups may be
 * invalid: zd__layout_build must refuse them with a message). A layout that builds is checked
 * against the placement rule (layout.h), and its table must parse back to the same list.
 */
#include <string.h>

#include "fuzz.h"
#include "layout.h"

#define MAX_PARAMS 64

/* The parameter lists must be the same: names, shapes, groups. */
static void check_same_list(const zd_param_t *a, const zd_param_t *b, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) {
    FUZZ_CHECK(strcmp(a[i].name, b[i].name) == 0, "parameter %u: name '%s' vs '%s'", i, a[i].name,
               b[i].name);
    FUZZ_CHECK(a[i].ndim == b[i].ndim, "parameter %u: ndim %u vs %u", i, a[i].ndim, b[i].ndim);
    for (uint32_t d = 0; d < a[i].ndim; d++)
      FUZZ_CHECK(a[i].shape[d] == b[i].shape[d], "parameter %u: dim %u is %llu vs %llu", i, d,
                 (unsigned long long)a[i].shape[d], (unsigned long long)b[i].shape[d]);
    FUZZ_CHECK(a[i].group == b[i].group, "parameter %u: group %u vs %u", i, a[i].group, b[i].group);
  }
}

/* Serializes l, parses the table back (from a copy of its exact size) and checks that the list
 * is l's: zd__layout_serialize -> zd__layout_parse is the identity. */
static void check_table_round_trip(const zd__layout_t *l) {
  char *table = NULL;
  size_t len = 0;
  FUZZ_CHECK(zd__layout_serialize(l, &table, &len) == 0, "serialize failed");
  char *copy = malloc(len ? len : 1);
  FUZZ_CHECK(copy, "out of memory");
  memcpy(copy, table, len);
  zd_param_t *params = NULL;
  uint32_t n = 0;
  int rc = zd__layout_parse(copy, len, &params, &n);
  FUZZ_CHECK(rc == 0, "the table of a layout does not parse (%d): %.*s", rc, (int)len, table);
  FUZZ_CHECK(n == l->nparams, "the table holds %u parameters; the layout %u", n, l->nparams);
  zd_param_t *mine = calloc(l->nparams, sizeof *mine);
  FUZZ_CHECK(mine, "out of memory");
  for (uint32_t i = 0; i < l->nparams; i++) {
    mine[i].name = l->params[i].name;
    mine[i].ndim = l->params[i].ndim;
    memcpy(mine[i].shape, l->params[i].shape, sizeof mine[i].shape);
    mine[i].group = l->params[i].group;
  }
  check_same_list(mine, params, n);
  /* The same list builds the same layout (what describe_mismatch in daemon/step relies on). */
  zd__layout_t *again = NULL;
  rc = zd__layout_build(params, n, UINT32_MAX, l->world_size, l->bucket_elems, &again, NULL);
  FUZZ_CHECK(rc == 0, "a parsed table does not build (%d)", rc);
  char diff[512];
  FUZZ_CHECK(zd__layout_diff(l, again, diff, sizeof diff) == 0 && again->hash == l->hash,
             "the layout of a parsed table differs: %s", diff);
  zd__layout_free(again);
  free(mine);
  free(params);
  free(copy);
  free(table);
}

/* The placement rule of layout.h, and the segments of every rank's slice of every bucket. */
static void check_layout(const zd__layout_t *l) {
  uint64_t offset = 0, shard_base = 0;
  uint32_t next_param = 0;
  for (uint32_t b = 0; b < l->nbuckets; b++) {
    const zd__bucket_t *k = &l->buckets[b];
    FUZZ_CHECK(k->offset == offset && k->first_param == next_param && k->nparams > 0,
               "bucket %u does not follow bucket %u", b, b - 1);
    FUZZ_CHECK(k->elems % ((uint64_t)ZD__ALIGN * l->world_size) == 0 &&
                   k->shard_elems * l->world_size == k->elems && k->shard_base == shard_base,
               "bucket %u: %llu elements, slices of %llu", b, (unsigned long long)k->elems,
               (unsigned long long)k->shard_elems);
    uint64_t in_params = 0;
    for (uint32_t i = k->first_param; i < k->first_param + k->nparams; i++) {
      const zd__layout_param_t *p = &l->params[i];
      FUZZ_CHECK(p->bucket == b && p->offset % ZD__ALIGN == 0 && p->offset >= k->offset &&
                     p->offset + p->numel <= k->offset + k->elems,
                 "parameter %u (offset %llu, %llu elements) is not inside bucket %u", i,
                 (unsigned long long)p->offset, (unsigned long long)p->numel, b);
      in_params += p->numel;
    }
    uint64_t in_segments = 0;
    for (uint32_t rank = 0; rank < l->world_size; rank++) {
      zd__segment_t *segs = NULL;
      uint32_t nsegs = 0;
      FUZZ_CHECK(zd__layout_segments(l, rank, b, &segs, &nsegs) == 0, "segments failed");
      for (uint32_t s = 0; s < nsegs; s++) {
        FUZZ_CHECK(segs[s].length > 0 && segs[s].offset + segs[s].length <= k->shard_elems,
                   "rank %u bucket %u: segment %u out of the slice", rank, b, s);
        in_segments += segs[s].length;
      }
      free(segs);
    }
    FUZZ_CHECK(in_segments == in_params, "bucket %u: segments cover %llu elements, parameters %llu",
               b, (unsigned long long)in_segments, (unsigned long long)in_params);
    next_param += k->nparams;
    offset += k->elems;
    shard_base += k->shard_elems;
  }
  FUZZ_CHECK(next_param == l->nparams && offset == l->total_elems && shard_base == l->shard_elems,
             "buckets do not add up to the layout");
}

/* Mode 0: an arbitrary table, as a peer's. */
static void fuzz_parse(const uint8_t *data, size_t size) {
  char *buf = fuzz_guarded_copy(data, size);
  zd_param_t *params = NULL;
  uint32_t n = 0;
  if (zd__layout_parse(buf, size, &params, &n) == 0) {
    zd__layout_t *l = NULL;
    if (zd__layout_build(params, n, UINT32_MAX, 1, 0, &l, NULL) == 0) {
      check_table_round_trip(l);
      zd__layout_free(l);
    }
    free(params);
  }
  fuzz_guarded_free(buf, size);
}

/* A dimension: mostly small, sometimes any 64-bit value (sizes past ZD__MAX_ELEMS, overflow). */
static uint64_t read_dim(fuzz_reader_t *r) {
  uint8_t b = fuzz_u8(r);
  if (b == 0xff) return fuzz_bytes_le(r, 8);
  if (b >= 0xf0) return (uint64_t)1 << (b - 0xf0 + 24);
  return b;
}

/* Otherwise: a parameter list for zd__layout_build. */
static void fuzz_build(uint8_t mode, const uint8_t *data, size_t size) {
  fuzz_reader_t r = {data, size};
  uint32_t world = 1 + mode % 8;
  uint8_t b = fuzz_u8(&r);
  uint64_t bucket = b == 0     ? 0
                    : b < 0xf0 ? (uint64_t)b * ZD__ALIGN
                               : (uint64_t)1 << (b - 0xf0 + 20);
  uint32_t ngroups = fuzz_u8(&r) % 5; /* 0: every group is out of range */
  zd_param_t params[MAX_PARAMS];
  char names[MAX_PARAMS][ZD__MAX_NAME + 2];
  uint32_t n = 0;
  while (r.left && n < MAX_PARAMS) {
    zd_param_t *p = &params[n];
    uint8_t shape = fuzz_u8(&r);
    p->ndim = (shape & 0x0f) % (ZD_MAX_DIMS + 2); /* ZD_MAX_DIMS + 1 is one too many */
    p->group = shape >> 4;
    memset(p->shape, 0, sizeof p->shape);
    for (uint32_t d = 0; d < p->ndim && d < ZD_MAX_DIMS; d++) p->shape[d] = read_dim(&r);
    size_t len, want = fuzz_u8(&r);
    if (want == 0xff) want = ZD__MAX_NAME + 1; /* one byte too long */
    const uint8_t *name = fuzz_take(&r, want, &len);
    memcpy(names[n], name, len);
    names[n][len] = '\0';
    p->name = names[n];
    n++;
  }
  zd__layout_t *l = NULL;
  zd__err_t err = {0};
  int rc = zd__layout_build(params, n, ngroups, world, bucket, &l, &err);
  if (rc) {
    FUZZ_CHECK(!l && err.code == rc && err.msg[0], "a refused list comes with a message");
    return;
  }
  FUZZ_CHECK(l->nparams == n && l->world_size == world, "the layout is of another list");
  check_layout(l);
  check_table_round_trip(l);
  zd__layout_free(l);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!size) return 0;
  if (data[0] == 0)
    fuzz_parse(data + 1, size - 1);
  else
    fuzz_build(data[0], data + 1, size - 1);
  return 0;
}
