/* Unit test of the layout (common/layout.c, docs/design.md): where each parameter lives in the flat
 * buffer, how the buffer is cut into buckets and slices, the segments of each rank's slice, the
 * layout hash and diff, validation errors, the default bucket size, shape formatting and the
 * parameter table ranks exchange (serialized, parsed back, and malformed).
 *
 * Random parameter lists (fixed seed, world sizes 1..8, small bucket sizes so that many buckets
 * occur) are checked against a separate re-implementation of the placement rule and against
 * properties that hold for any correct layout; small cases are checked against hand-computed
 * numbers. On failure the case being checked is printed after the failed assertion.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"
#include "error.h"
#include "layout.h"

#define MAXP 32 /* parameters in a random case */

/* ---- context printed after a failed CHECK (check.h exits; atexit runs) ---- */

static char ctx[512];

static void set_ctx(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void set_ctx(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ctx, sizeof ctx, fmt, ap);
  va_end(ap);
}

static void print_ctx(void) {
  if (ctx[0]) fprintf(stderr, "  while checking: %s\n", ctx);
}

/* ---- deterministic random numbers (xorshift64*) ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545f4914f6cdd1dull;
}

/* Uniform in [lo, hi]. */
static uint64_t rnd_in(uint64_t lo, uint64_t hi) {
  return lo + rnd() % (hi - lo + 1);
}

/* ---- a test case: a parameter list that owns its names ---- */

typedef struct tcase {
  uint32_t n, ngroups, world;
  uint64_t bucket; /* 0: the default */
  char names[MAXP][40];
  zd_param_t p[MAXP];
} tcase_t;

static uint64_t numel_of(const zd_param_t *p) {
  uint64_t n = 1;
  for (uint32_t d = 0; d < p->ndim; d++) n *= p->shape[d];
  return n;
}

static void tcase_fix_names(tcase_t *t) {
  for (uint32_t i = 0; i < t->n; i++) t->p[i].name = t->names[i];
}

static void tcase_copy(tcase_t *dst, const tcase_t *src) {
  *dst = *src;
  tcase_fix_names(dst);
}

static void random_case(tcase_t *t) {
  memset(t, 0, sizeof *t);
  t->n = (uint32_t)rnd_in(1, MAXP);
  t->ngroups = (uint32_t)rnd_in(1, 3);
  t->world = (uint32_t)rnd_in(1, 8);
  uint64_t r = rnd() % 16;
  t->bucket = r == 0 ? 0 : r == 1 ? 1 : rnd_in(1, 3000);
  for (uint32_t i = 0; i < t->n; i++) {
    zd_param_t *p = &t->p[i];
    snprintf(t->names[i], sizeof t->names[i], "layer%u.%s", i, rnd() % 2 ? "weight" : "bias");
    p->group = (uint32_t)rnd_in(0, t->ngroups - 1);
    uint64_t kind = rnd() % 8;
    if (kind == 0) { /* scalar */
      p->ndim = 0;
    } else if (kind == 1) { /* a multiple of ZD__ALIGN: the next parameter is contiguous */
      p->ndim = 1;
      p->shape[0] = ZD__ALIGN * rnd_in(1, 8);
    } else if (kind == 2) { /* empty */
      p->ndim = (uint32_t)rnd_in(1, 3);
      for (uint32_t d = 0; d < p->ndim; d++) p->shape[d] = rnd_in(0, 5);
      p->shape[rnd() % p->ndim] = 0;
    } else {
      p->ndim = (uint32_t)rnd_in(1, 3);
      for (uint32_t d = 0; d < p->ndim; d++) p->shape[d] = rnd_in(1, 16);
    }
  }
  tcase_fix_names(t);
}

static void describe_case(const tcase_t *t, const char *what) {
  int used = snprintf(ctx, sizeof ctx, "%s: W=%u bucket=%llu ngroups=%u n=%u numel=[", what,
                      t->world, (unsigned long long)t->bucket, t->ngroups, t->n);
  for (uint32_t i = 0; i < t->n && used > 0 && (size_t)used < sizeof ctx; i++)
    used += snprintf(ctx + used, sizeof ctx - (size_t)used, "%s%llu/g%u", i ? " " : "",
                     (unsigned long long)numel_of(&t->p[i]), t->p[i].group);
  if (used > 0 && (size_t)used < sizeof ctx) snprintf(ctx + used, sizeof ctx - (size_t)used, "]");
}

static zd__layout_t *build_ok(const tcase_t *t) {
  zd__layout_t *l = NULL;
  zd__err_t err = {0};
  int rc = zd__layout_build(t->p, t->n, t->ngroups, t->world, t->bucket, &l, &err);
  CHECK_MSG(rc == ZD_OK, "zd__layout_build returned %d (%s): %s", rc, zd_err_name(rc), err.msg);
  CHECK(l != NULL);
  return l;
}

/* ---- the placement rule, written again from docs/design.md ---- */

typedef struct ref {
  uint64_t numel[MAXP], offset[MAXP];
  uint32_t bucket[MAXP];
  uint32_t nb;
  uint64_t b_offset[MAXP], b_elems[MAXP];
  uint32_t b_first[MAXP], b_n[MAXP];
  uint64_t total;
} ref_t;

static uint64_t align_up(uint64_t v, uint64_t m) {
  return v % m ? v + (m - v % m) : v;
}

static uint64_t megatron_bucket(uint32_t w) {
  return (uint64_t)w * 1000000 > 40000000 ? (uint64_t)w * 1000000 : 40000000;
}

/* Walks the parameters with an absolute cursor: each starts at the next multiple of 64; a bucket
 * ends after the parameter that brings it to at least `target` elements (or the last parameter),
 * and its end is rounded up to a multiple of 64 * W (an empty bucket still takes 64 * W). */
static void ref_build(const tcase_t *t, ref_t *r) {
  memset(r, 0, sizeof *r);
  uint64_t target = t->bucket ? t->bucket : megatron_bucket(t->world);
  uint64_t unit = (uint64_t)ZD__ALIGN * t->world, cursor = 0, bstart = 0;
  uint32_t first = 0;
  for (uint32_t i = 0; i < t->n; i++) {
    r->numel[i] = numel_of(&t->p[i]);
    r->offset[i] = align_up(cursor, ZD__ALIGN);
    r->bucket[i] = r->nb;
    cursor = r->offset[i] + r->numel[i];
    if (cursor - bstart >= target || i + 1 == t->n) {
      uint64_t size = align_up(cursor - bstart, unit);
      if (size == 0) size = unit;
      r->b_offset[r->nb] = bstart;
      r->b_elems[r->nb] = size;
      r->b_first[r->nb] = first;
      r->b_n[r->nb] = i + 1 - first;
      r->nb++;
      bstart += size;
      cursor = bstart;
      first = i + 1;
    }
  }
  r->total = bstart;
}

/* ---- checks of one layout ---- */

static void check_against_ref(const tcase_t *t, const zd__layout_t *l) {
  ref_t r;
  ref_build(t, &r);
  CHECK_INT_EQ(l->world_size, t->world);
  CHECK_U64_EQ(l->bucket_elems, t->bucket ? t->bucket : zd__layout_default_bucket_elems(t->world));
  CHECK_INT_EQ(l->nparams, t->n);
  for (uint32_t i = 0; i < t->n; i++) {
    const zd__layout_param_t *p = &l->params[i];
    CHECK_STR_EQ(p->name, t->p[i].name);
    CHECK(p->name != t->p[i].name); /* copied */
    CHECK_INT_EQ(p->ndim, t->p[i].ndim);
    for (uint32_t d = 0; d < p->ndim; d++) CHECK_U64_EQ(p->shape[d], t->p[i].shape[d]);
    CHECK_INT_EQ(p->group, t->p[i].group);
    CHECK_U64_EQ(p->numel, r.numel[i]);
    CHECK_U64_EQ(p->offset, r.offset[i]);
    CHECK_INT_EQ(p->bucket, r.bucket[i]);
  }
  CHECK_INT_EQ(l->nbuckets, r.nb);
  for (uint32_t b = 0; b < r.nb; b++) {
    CHECK_U64_EQ(l->buckets[b].offset, r.b_offset[b]);
    CHECK_U64_EQ(l->buckets[b].elems, r.b_elems[b]);
    CHECK_INT_EQ(l->buckets[b].first_param, r.b_first[b]);
    CHECK_INT_EQ(l->buckets[b].nparams, r.b_n[b]);
  }
  CHECK_U64_EQ(l->total_elems, r.total);
}

/* Properties any correct layout has, whatever the rule's details. */
static void check_properties(const zd__layout_t *l) {
  uint64_t w = l->world_size, unit = ZD__ALIGN * w;
  for (uint32_t i = 0; i < l->nparams; i++) {
    const zd__layout_param_t *p = &l->params[i];
    CHECK_U64_EQ(p->offset % ZD__ALIGN, 0);
    if (i) { /* in order, no overlap */
      const zd__layout_param_t *q = &l->params[i - 1];
      CHECK_INT_GE(p->offset, q->offset + q->numel);
      CHECK_INT_GE(p->bucket, q->bucket);
    }
    CHECK_INT_LT(p->bucket, l->nbuckets);
    const zd__bucket_t *b = &l->buckets[p->bucket];
    CHECK_INT_GE(p->offset, b->offset); /* entirely inside its bucket */
    CHECK_INT_LE(p->offset + p->numel, b->offset + b->elems);
    CHECK_INT_GE(i, b->first_param);
    CHECK_INT_LT(i, b->first_param + b->nparams);
  }
  uint64_t offset = 0, shard_base = 0;
  uint32_t first = 0;
  for (uint32_t k = 0; k < l->nbuckets; k++) {
    const zd__bucket_t *b = &l->buckets[k];
    CHECK_U64_EQ(b->offset, offset); /* buckets tile the buffer */
    CHECK_U64_EQ(b->elems % unit, 0);
    CHECK(b->elems > 0);
    CHECK_U64_EQ(b->shard_elems * w, b->elems);
    CHECK_U64_EQ(b->shard_elems % ZD__ALIGN, 0);
    CHECK_U64_EQ(b->shard_base, shard_base);
    CHECK_INT_EQ(b->first_param, first); /* buckets take the parameters in order, each once */
    CHECK(b->nparams >= 1);
    /* Closed at the first parameter that brings it to bucket_elems; only the last may hold less. */
    const zd__layout_param_t *last = &l->params[b->first_param + b->nparams - 1];
    uint64_t held = last->offset + last->numel - b->offset;
    if (k + 1 < l->nbuckets) CHECK_INT_GE(held, l->bucket_elems);
    if (b->nparams > 1) {
      const zd__layout_param_t *prev = &l->params[b->first_param + b->nparams - 2];
      CHECK_INT_LT(prev->offset + prev->numel - b->offset, l->bucket_elems);
    }
    if (held) { /* less than one 64*W unit of padding; an empty bucket is one unit */
      CHECK_INT_LT(b->elems - held, unit);
    } else {
      CHECK_U64_EQ(b->elems, unit);
    }
    offset += b->elems;
    shard_base += b->shard_elems;
    first += b->nparams;
  }
  CHECK_INT_EQ(first, l->nparams);
  CHECK_U64_EQ(l->total_elems, offset);
  CHECK_U64_EQ(l->shard_elems, shard_base);
  CHECK_U64_EQ(l->shard_elems * w, l->total_elems);
}

/* For every bucket: the segments of all ranks together cover each parameter element exactly once,
 * with its group, and no padding; each rank's list is sorted, disjoint, inside its slice, and
 * merges two same-group runs exactly when they touch. */
static void check_segments(const zd__layout_t *l) {
  for (uint32_t k = 0; k < l->nbuckets; k++) {
    const zd__bucket_t *b = &l->buckets[k];
    int32_t *owner = malloc(b->elems * sizeof *owner);
    uint8_t *seen = calloc(b->elems, 1);
    CHECK(owner && seen);
    for (uint64_t e = 0; e < b->elems; e++) owner[e] = -1;
    for (uint32_t i = 0; i < l->nparams; i++) {
      const zd__layout_param_t *p = &l->params[i];
      for (uint64_t e = 0; e < p->numel; e++) {
        if (p->offset + e < b->offset || p->offset + e >= b->offset + b->elems) continue;
        CHECK_INT_EQ(p->bucket, k);
        CHECK_INT_EQ(owner[p->offset + e - b->offset], -1);
        owner[p->offset + e - b->offset] = (int32_t)i;
      }
    }
    for (uint32_t rank = 0; rank < l->world_size; rank++) {
      zd__segment_t *segs = NULL;
      uint32_t n = 12345;
      set_ctx("segments of rank %u, bucket %u of %u (W=%u)", rank, k, l->nbuckets, l->world_size);
      CHECK_INT_EQ(zd__layout_segments(l, rank, k, &segs, &n), ZD_OK);
      for (uint32_t s = 0; s < n; s++) {
        const zd__segment_t *g = &segs[s];
        CHECK(g->length > 0);
        CHECK_INT_LE(g->offset + g->length, b->shard_elems);
        if (s) {
          const zd__segment_t *h = &segs[s - 1];
          CHECK_INT_LE(h->offset + h->length, g->offset); /* sorted, disjoint */
          if (h->group == g->group) CHECK_INT_LT(h->offset + h->length, g->offset); /* merged */
        }
        for (uint64_t e = 0; e < g->length; e++) {
          uint64_t at = (uint64_t)rank * b->shard_elems + g->offset + e;
          CHECK_MSG(owner[at] >= 0, "segment %u (offset %llu, length %llu) covers padding at %llu",
                    s, (unsigned long long)g->offset, (unsigned long long)g->length,
                    (unsigned long long)at);
          CHECK_INT_EQ(seen[at], 0);
          seen[at] = 1;
          CHECK_INT_EQ(g->group, l->params[owner[at]].group);
        }
      }
      free(segs);
    }
    for (uint64_t e = 0; e < b->elems; e++) {
      if (owner[e] >= 0)
        CHECK_MSG(seen[e], "element %llu of bucket %u (parameter %d) is in no rank's segments",
                  (unsigned long long)e, k, owner[e]);
    }
    free(owner);
    free(seen);
  }
}

/* ---- hash and diff ---- */

/* A copy of t whose names live in other buffers, behind different bytes, and whose shape entries
 * past ndim hold garbage: none of that is part of the layout. */
static uint64_t hash_of_relocated_copy(const tcase_t *t, zd__layout_t **out) {
  zd_param_t *p = malloc(t->n * sizeof *p);
  char *names = malloc((size_t)t->n * 64);
  CHECK(p && names);
  for (uint32_t i = 0; i < t->n; i++) {
    p[i] = t->p[i];
    memset(names + i * 64, 'z', 64);
    snprintf(names + i * 64 + 7, 57, "%s", t->p[i].name);
    p[i].name = names + i * 64 + 7;
    for (uint32_t d = p[i].ndim; d < ZD_MAX_DIMS; d++) p[i].shape[d] = rnd();
  }
  zd__layout_t *l = NULL;
  zd__err_t err;
  CHECK_INT_EQ(zd__layout_build(p, t->n, t->ngroups, t->world, t->bucket, &l, &err), ZD_OK);
  memset(names, 0, (size_t)t->n * 64); /* the layout must not point into the caller's memory */
  free(names);
  free(p);
  *out = l;
  return l->hash;
}

static void fmt_shape(const zd_param_t *p, char *buf, size_t len) {
  size_t used = 0;
  used += (size_t)snprintf(buf, len, "[");
  for (uint32_t d = 0; d < p->ndim; d++)
    used += (size_t)snprintf(buf + used, len - used, d ? ", %llu" : "%llu",
                             (unsigned long long)p->shape[d]);
  snprintf(buf + used, len - used, "]");
}

static void check_diff_names(const zd__layout_t *a, const zd__layout_t *b, uint32_t index,
                             const char *na, const char *nb) {
  char msg[512], want[64];
  CHECK_INT_NE(zd__layout_diff(a, b, msg, sizeof msg), 0);
  snprintf(want, sizeof want, "parameter %u:", index);
  CHECK_CONTAINS(msg, want);
  snprintf(want, sizeof want, "'%s'", na);
  CHECK_CONTAINS(msg, want);
  snprintf(want, sizeof want, "'%s'", nb);
  CHECK_CONTAINS(msg, want);
}

/* Changes one thing that the layout depends on and checks that the hash changes and that diff
 * names the change (the first differing parameter when it is a parameter). */
static void check_mutation(const tcase_t *t, const zd__layout_t *a) {
  tcase_t m;
  tcase_copy(&m, t);
  uint32_t i = (uint32_t)rnd_in(0, t->n - 1), kind = (uint32_t)(rnd() % 8);
  char sa[200], sb[200], msg[512], want[200];
  switch (kind) {
    case 0: /* rename */
      strcat(m.names[i], "~");
      break;
    case 1: /* one dimension, or a scalar becoming [1]: same numel, other shape */
      if (m.p[i].ndim) {
        m.p[i].shape[rnd() % m.p[i].ndim] += 1;
      } else {
        m.p[i].ndim = 1;
        m.p[i].shape[0] = 1;
      }
      break;
    case 2: /* a trailing dimension of 1: same numel, other shape */
      m.p[i].shape[m.p[i].ndim++] = 1;
      break;
    case 3: /* group */
      m.ngroups = t->ngroups + 1;
      m.p[i].group = (t->p[i].group + 1) % m.ngroups;
      break;
    case 4:
      m.world = t->world + 1;
      break;
    case 5:
      m.bucket = t->bucket ? t->bucket + 1 : 12345;
      break;
    case 6: /* one parameter fewer */
      if (t->n == 1) return;
      m.n--;
      break;
    case 7: /* one parameter more */
      if (t->n == MAXP) return;
      snprintf(m.names[m.n], sizeof m.names[m.n], "extra.weight");
      m.p[m.n] = (zd_param_t){.name = m.names[m.n], .ndim = 1, .shape = {7}, .group = 0};
      m.n++;
      break;
  }
  /* A later parameter changed too must not be the one named. */
  if (kind <= 3 && i + 1 < t->n && rnd() % 2) strcat(m.names[t->n - 1], "#");
  set_ctx("mutation %u of parameter %u (W=%u bucket=%llu n=%u)", kind, i, t->world,
          (unsigned long long)t->bucket, t->n);
  zd__layout_t *b = build_ok(&m);
  CHECK(a->hash != b->hash);
  CHECK_INT_NE(zd__layout_diff(b, a, msg, sizeof msg), 0);
  CHECK_INT_NE(zd__layout_diff(a, b, msg, sizeof msg), 0);
  switch (kind) {
    case 0:
      check_diff_names(a, b, i, t->p[i].name, m.p[i].name);
      break;
    case 1:
    case 2:
      check_diff_names(a, b, i, t->p[i].name, m.p[i].name);
      fmt_shape(&t->p[i], sa, sizeof sa);
      fmt_shape(&m.p[i], sb, sizeof sb);
      CHECK_CONTAINS(msg, sa);
      CHECK_CONTAINS(msg, sb);
      break;
    case 3:
      check_diff_names(a, b, i, t->p[i].name, m.p[i].name);
      snprintf(want, sizeof want, "group %u", t->p[i].group);
      CHECK_CONTAINS(msg, want);
      snprintf(want, sizeof want, "group %u", m.p[i].group);
      CHECK_CONTAINS(msg, want);
      break;
    case 4:
      snprintf(want, sizeof want, "world size %u vs %u", t->world, m.world);
      CHECK_CONTAINS(msg, want);
      break;
    case 5:
      CHECK_CONTAINS(msg, "bucket size");
      break;
    case 6:
    case 7: {
      const tcase_t *longer = m.n > t->n ? &m : t;
      uint32_t n = m.n < t->n ? m.n : t->n;
      snprintf(want, sizeof want, "%u vs %u parameters", t->n, m.n);
      CHECK_CONTAINS(msg, want);
      snprintf(want, sizeof want, "parameter %u '%s'", n, longer->p[n].name);
      CHECK_CONTAINS(msg, want);
      break;
    }
  }
  zd__layout_free(b);
}

static void test_random(void) {
  for (int iter = 0; iter < 1500; iter++) {
    tcase_t t;
    random_case(&t);
    char what[32];
    snprintf(what, sizeof what, "random case %d", iter);
    describe_case(&t, what);
    zd__layout_t *l = build_ok(&t);
    check_against_ref(&t, l);
    check_properties(l);
    check_segments(l);

    describe_case(&t, what);
    zd__layout_t *again = build_ok(&t), *moved = NULL;
    CHECK_U64_EQ(again->hash, l->hash);
    CHECK_U64_EQ(hash_of_relocated_copy(&t, &moved), l->hash);
    char msg[256] = "x";
    CHECK_INT_EQ(zd__layout_diff(l, moved, msg, sizeof msg), 0);
    CHECK_STR_EQ(msg, "");
    check_against_ref(&t, moved);
    zd__layout_free(again);
    zd__layout_free(moved);

    check_mutation(&t, l);
    zd__layout_free(l);
  }
  ctx[0] = '\0';
}

/* ---- hand-checked cases ---- */

static void check_seg(const zd__segment_t *s, uint64_t offset, uint64_t length, uint32_t group) {
  CHECK_U64_EQ(s->offset, offset);
  CHECK_U64_EQ(s->length, length);
  CHECK_INT_EQ(s->group, group);
}

static void test_small_case(void) {
  set_ctx("hand-checked case, W=2, bucket 100");
  /* W=2, bucket 100, units of 64*2 = 128:
   *   a [10] g0      offset   0, bucket 0 holds 10
   *   b [3, 5] g1    offset  64, bucket 0 holds 79
   *   c [200] g0     offset 128, bucket 0 holds 328 >= 100: closed, 384 elems, slices of 192
   *   d [] g0        offset 384, bucket 1 holds 1
   *   e [64] g1      offset 448, bucket 1 holds 128 >= 100: closed, 128 elems, slices of 64 */
  zd_param_t p[] = {
      {.name = "a", .ndim = 1, .shape = {10}, .group = 0},
      {.name = "b", .ndim = 2, .shape = {3, 5}, .group = 1},
      {.name = "c", .ndim = 1, .shape = {200}, .group = 0},
      {.name = "d", .ndim = 0, .group = 0},
      {.name = "e", .ndim = 1, .shape = {64}, .group = 1},
  };
  zd__layout_t *l = NULL;
  zd__err_t err;
  CHECK_INT_EQ(zd__layout_build(p, 5, 2, 2, 100, &l, &err), ZD_OK);
  const uint64_t offsets[] = {0, 64, 128, 384, 448}, numels[] = {10, 15, 200, 1, 64};
  const uint32_t buckets[] = {0, 0, 0, 1, 1};
  for (int i = 0; i < 5; i++) {
    CHECK_U64_EQ(l->params[i].offset, offsets[i]);
    CHECK_U64_EQ(l->params[i].numel, numels[i]);
    CHECK_INT_EQ(l->params[i].bucket, buckets[i]);
  }
  CHECK_INT_EQ(l->nbuckets, 2);
  CHECK_U64_EQ(l->buckets[0].offset, 0);
  CHECK_U64_EQ(l->buckets[0].elems, 384);
  CHECK_U64_EQ(l->buckets[0].shard_elems, 192);
  CHECK_U64_EQ(l->buckets[0].shard_base, 0);
  CHECK_INT_EQ(l->buckets[0].first_param, 0);
  CHECK_INT_EQ(l->buckets[0].nparams, 3);
  CHECK_U64_EQ(l->buckets[1].offset, 384);
  CHECK_U64_EQ(l->buckets[1].elems, 128);
  CHECK_U64_EQ(l->buckets[1].shard_elems, 64);
  CHECK_U64_EQ(l->buckets[1].shard_base, 192);
  CHECK_INT_EQ(l->buckets[1].first_param, 3);
  CHECK_INT_EQ(l->buckets[1].nparams, 2);
  CHECK_U64_EQ(l->total_elems, 512);
  CHECK_U64_EQ(l->shard_elems, 256);

  zd__segment_t *s = NULL;
  uint32_t n = 0;
  /* bucket 0, rank 0 = [0, 192): a, b, the first 64 elements of c */
  CHECK_INT_EQ(zd__layout_segments(l, 0, 0, &s, &n), ZD_OK);
  CHECK_INT_EQ(n, 3);
  check_seg(&s[0], 0, 10, 0);
  check_seg(&s[1], 64, 15, 1);
  check_seg(&s[2], 128, 64, 0);
  free(s);
  /* bucket 0, rank 1 = [192, 384): the other 136 elements of c (c straddles the ranks) */
  CHECK_INT_EQ(zd__layout_segments(l, 1, 0, &s, &n), ZD_OK);
  CHECK_INT_EQ(n, 1);
  check_seg(&s[0], 0, 136, 0);
  free(s);
  /* bucket 1, rank 0 = [384, 448): d */
  CHECK_INT_EQ(zd__layout_segments(l, 0, 1, &s, &n), ZD_OK);
  CHECK_INT_EQ(n, 1);
  check_seg(&s[0], 0, 1, 0);
  free(s);
  /* bucket 1, rank 1 = [448, 512): e */
  CHECK_INT_EQ(zd__layout_segments(l, 1, 1, &s, &n), ZD_OK);
  CHECK_INT_EQ(n, 1);
  check_seg(&s[0], 0, 64, 1);
  free(s);

  /* Clients and peers of different builds compare this hash: a change must be deliberate. The value
   * is FNV-1a 64 of "zerod-layout-1", W, bucket_elems, nparams, then per parameter the name with
   * its NUL, ndim, the dims and the group, each integer as 8 little-endian bytes (computed apart
   * from layout.c). */
  CHECK_U64_EQ(l->hash, 0x90e8b696cef4c055ull);
  zd__layout_free(l);
  ctx[0] = '\0';
}

static void test_merging(void) {
  set_ctx("segment merging, W=1");
  /* p [64] g0 @0, q [64] g0 @64: contiguous, one group: one segment [0, 128).
   * r [10] g1 @128; s [64] g1 @192: same group, a gap of padding: two segments.
   * t [64] g0 @256: touches s but another group: its own segment. */
  zd_param_t p[] = {
      {.name = "p", .ndim = 1, .shape = {64}, .group = 0},
      {.name = "q", .ndim = 2, .shape = {8, 8}, .group = 0},
      {.name = "r", .ndim = 1, .shape = {10}, .group = 1},
      {.name = "s", .ndim = 1, .shape = {64}, .group = 1},
      {.name = "t", .ndim = 1, .shape = {64}, .group = 0},
  };
  zd__layout_t *l = NULL;
  CHECK_INT_EQ(zd__layout_build(p, 5, 2, 1, 0, &l, NULL), ZD_OK);
  CHECK_INT_EQ(l->nbuckets, 1);
  CHECK_U64_EQ(l->total_elems, 320);
  zd__segment_t *s = NULL;
  uint32_t n = 0;
  CHECK_INT_EQ(zd__layout_segments(l, 0, 0, &s, &n), ZD_OK);
  CHECK_INT_EQ(n, 4);
  check_seg(&s[0], 0, 128, 0);
  check_seg(&s[1], 128, 10, 1);
  check_seg(&s[2], 192, 64, 1);
  check_seg(&s[3], 256, 64, 0);
  free(s);
  zd__layout_free(l);

  /* A slice of padding only: W=4, one parameter of 10 elements, slices of 64. */
  set_ctx("padding-only slices, W=4");
  zd_param_t one = {.name = "w", .ndim = 1, .shape = {10}, .group = 0};
  CHECK_INT_EQ(zd__layout_build(&one, 1, 1, 4, 0, &l, NULL), ZD_OK);
  CHECK_U64_EQ(l->total_elems, 256);
  CHECK_U64_EQ(l->shard_elems, 64);
  for (uint32_t r = 0; r < 4; r++) {
    CHECK_INT_EQ(zd__layout_segments(l, r, 0, &s, &n), ZD_OK);
    CHECK_INT_EQ(n, r == 0 ? 1 : 0);
    if (r == 0) check_seg(&s[0], 0, 10, 0);
    free(s);
  }
  zd__layout_free(l);

  /* Zero-element parameters take no room; one that ends the model still gets a bucket. */
  set_ctx("empty parameters, W=2");
  zd_param_t z[] = {
      {.name = "z0", .ndim = 2, .shape = {0, 5}, .group = 1},
      {.name = "x", .ndim = 1, .shape = {3}, .group = 0},
      {.name = "z1", .ndim = 1, .shape = {0}, .group = 1},
  };
  CHECK_INT_EQ(zd__layout_build(z, 3, 2, 2, 3, &l, NULL), ZD_OK);
  CHECK_INT_EQ(l->nbuckets, 2);
  CHECK_U64_EQ(l->params[0].offset, 0);
  CHECK_U64_EQ(l->params[1].offset, 0);
  CHECK_U64_EQ(l->params[2].offset, 128);
  CHECK_U64_EQ(l->buckets[1].elems, 128);
  CHECK_INT_EQ(zd__layout_segments(l, 0, 1, &s, &n), ZD_OK);
  CHECK_INT_EQ(n, 0);
  free(s);
  zd__layout_free(l);
  ctx[0] = '\0';
}

/* ---- errors ---- */

/* Builds p and expects failure with `code`, *out reset to NULL and a message containing each of
 * the NULL-terminated strings after `code`. */
static void expect_error(const zd_param_t *p, uint32_t n, uint32_t ngroups, uint32_t world,
                         uint64_t bucket, int code, ...) {
  zd__layout_t *l = (zd__layout_t *)&l; /* not NULL: the call must reset it */
  zd__err_t err = {.code = 0, .msg = ""};
  int rc = zd__layout_build(p, n, ngroups, world, bucket, &l, &err);
  CHECK_MSG(rc == code, "returned %d (%s), expected %d (%s); message: %s", rc, zd_err_name(rc),
            code, zd_err_name(code), err.msg);
  CHECK(l == NULL);
  CHECK_INT_EQ(err.code, code);
  CHECK(err.msg[0] != '\0');
  va_list ap;
  va_start(ap, code);
  for (const char *s; (s = va_arg(ap, const char *));) CHECK_CONTAINS(err.msg, s);
  va_end(ap);
  /* The same failure without a message buffer. */
  CHECK_INT_EQ(zd__layout_build(p, n, ngroups, world, bucket, &l, NULL), code);
  CHECK(l == NULL);
}

static void test_errors(void) {
  const uint64_t T40 = 1ull << 40;
  zd_param_t p[4] = {
      {.name = "emb.weight", .ndim = 2, .shape = {10, 4}, .group = 0},
      {.name = "fc.weight", .ndim = 2, .shape = {4, 4}, .group = 0},
      {.name = "fc.bias", .ndim = 1, .shape = {4}, .group = 0},
      {.name = "head.weight", .ndim = 1, .shape = {4}, .group = 0},
  };
  zd__layout_t *l = NULL;

  set_ctx("duplicate names");
  char dup[] = "fc.weight"; /* equal text in another buffer */
  p[3].name = dup;
  expect_error(p, 4, 1, 1, 0, -EINVAL, "'fc.weight'", NULL);
  p[3].name = "head.weight";
  CHECK_INT_EQ(zd__layout_build(p, 4, 1, 1, 0, &l, NULL), ZD_OK);
  zd__layout_free(l);

  set_ctx("empty and missing names");
  p[2].name = "";
  expect_error(p, 4, 1, 1, 0, -EINVAL, "parameter 2", NULL);
  p[2].name = NULL;
  expect_error(p, 4, 1, 1, 0, -EINVAL, "parameter 2", NULL);
  p[2].name = "fc.bias";

  set_ctx("name length");
  char name[ZD__MAX_NAME + 2];
  memset(name, 'n', sizeof name - 1);
  name[ZD__MAX_NAME + 1] = '\0';
  p[1].name = name; /* 256 bytes */
  expect_error(p, 4, 1, 1, 0, -EINVAL, "parameter 1", NULL);
  name[ZD__MAX_NAME] = '\0'; /* 255 bytes: allowed */
  CHECK_INT_EQ(zd__layout_build(p, 4, 1, 1, 0, &l, NULL), ZD_OK);
  CHECK_INT_EQ(strlen(l->params[1].name), ZD__MAX_NAME);
  zd__layout_free(l);
  p[1].name = "fc.weight";

  set_ctx("too many dimensions");
  zd_param_t deep = {.name = "deep", .ndim = ZD_MAX_DIMS + 1};
  expect_error(&deep, 1, 1, 1, 0, -EINVAL, "'deep'", NULL);
  deep.ndim = ZD_MAX_DIMS;
  for (int d = 0; d < ZD_MAX_DIMS; d++) deep.shape[d] = 2;
  CHECK_INT_EQ(zd__layout_build(&deep, 1, 1, 1, 0, &l, NULL), ZD_OK);
  CHECK_U64_EQ(l->params[0].numel, 1u << ZD_MAX_DIMS);
  zd__layout_free(l);

  set_ctx("group out of range");
  p[2].group = 7;
  expect_error(p, 4, 3, 1, 0, ZD_EGROUP, "'fc.bias'", "7", "3", NULL);
  p[2].group = 3;
  expect_error(p, 4, 3, 1, 0, ZD_EGROUP, "'fc.bias'", "3", NULL);
  p[2].group = 2;
  CHECK_INT_EQ(zd__layout_build(p, 4, 3, 1, 0, &l, NULL), ZD_OK);
  zd__layout_free(l);
  p[2].group = 0;

  set_ctx("world size 0, no parameters, too many parameters");
  expect_error(p, 4, 1, 0, 0, -EINVAL, "world size", NULL);
  expect_error(p, 0, 1, 1, 0, -EINVAL, NULL);
  expect_error(p, ZD__MAX_PARAMS + 1, 1, 1, 0, -EINVAL, NULL); /* rejected before p is read */

  set_ctx("element count overflow");
  zd_param_t big = {.name = "big", .ndim = 1, .shape = {T40 + 1}};
  expect_error(&big, 1, 1, 1, 0, -EINVAL, "'big'", NULL);
  big = (zd_param_t){.name = "big", .ndim = 2, .shape = {1ull << 21, 1ull << 20}};
  expect_error(&big, 1, 1, 1, 0, -EINVAL, "'big'", NULL);
  big = (zd_param_t){.name = "big", .ndim = 3, .shape = {1ull << 32, 1ull << 32, 1ull << 32}};
  expect_error(&big, 1, 1, 1, 0, -EINVAL, "'big'", NULL); /* 2^96 must not wrap around */
  big = (zd_param_t){.name = "big", .ndim = 2, .shape = {1ull << 63, 2}};
  expect_error(&big, 1, 1, 1, 0, -EINVAL, "'big'", NULL);
  big = (zd_param_t){.name = "big", .ndim = 2, .shape = {1ull << 20, 1ull << 20}};
  CHECK_INT_EQ(zd__layout_build(&big, 1, 1, 1, 0, &l, NULL), ZD_OK); /* exactly 2^40 */
  CHECK_U64_EQ(l->total_elems, T40);
  zd__layout_free(l);
  expect_error(&big, 1, 1, 3, 0, -EINVAL, NULL); /* padded to a multiple of 192: over 2^40 */
  big = (zd_param_t){.name = "big", .ndim = 3, .shape = {0, T40, T40}};
  CHECK_INT_EQ(zd__layout_build(&big, 1, 1, 1, 0, &l, NULL), ZD_OK); /* zero elements */
  CHECK_U64_EQ(l->params[0].numel, 0);
  zd__layout_free(l);
  zd_param_t halves[3] = {
      {.name = "h0", .ndim = 1, .shape = {T40 / 2}},
      {.name = "h1", .ndim = 1, .shape = {T40 / 2}},
      {.name = "h2", .ndim = 1, .shape = {1}},
  };
  CHECK_INT_EQ(zd__layout_build(halves, 2, 1, 8, 0, &l, NULL), ZD_OK);
  CHECK_U64_EQ(l->total_elems, T40);
  CHECK_U64_EQ(l->shard_elems, T40 / 8);
  zd__layout_free(l);
  expect_error(halves, 3, 1, 8, 0, -EINVAL, NULL);
  halves[2].shape[0] = 0;
  expect_error(halves, 3, 1, 8, 1, -EINVAL, NULL); /* its own empty bucket still takes 512 */

  zd__layout_free(NULL);
  ctx[0] = '\0';
}

/* ---- diff by hand ---- */

static void test_diff(void) {
  set_ctx("zd__layout_diff by hand");
  zd_param_t a[] = {
      {.name = "emb", .ndim = 2, .shape = {100, 16}, .group = 0},
      {.name = "fc2.weight", .ndim = 2, .shape = {32, 16}, .group = 0},
      {.name = "fc2.bias", .ndim = 1, .shape = {16}, .group = 1},
  };
  zd_param_t b[3];
  memcpy(b, a, sizeof a);
  zd__layout_t *la, *lb;
  char msg[256];
  CHECK_INT_EQ(zd__layout_build(a, 3, 2, 2, 0, &la, NULL), ZD_OK);

  b[1].shape[0] = 16, b[1].shape[1] = 32;
  CHECK_INT_EQ(zd__layout_build(b, 3, 2, 2, 0, &lb, NULL), ZD_OK);
  CHECK_U64_EQ(la->total_elems, lb->total_elems); /* same sizes, still a different layout */
  CHECK(la->hash != lb->hash);
  CHECK_INT_EQ(zd__layout_diff(la, lb, msg, sizeof msg), 1);
  CHECK_CONTAINS(msg, "parameter 1:");
  CHECK_CONTAINS(msg, "'fc2.weight'");
  CHECK_CONTAINS(msg, "[32, 16]");
  CHECK_CONTAINS(msg, "[16, 32]");
  zd__layout_free(lb);
  memcpy(b, a, sizeof a);

  /* Small buffers: truncated, still terminated. */
  b[2].group = 0;
  CHECK_INT_EQ(zd__layout_build(b, 3, 2, 2, 0, &lb, NULL), ZD_OK);
  CHECK_INT_EQ(zd__layout_diff(la, lb, msg, 8), 1);
  CHECK_INT_EQ(strlen(msg), 7);
  CHECK_INT_EQ(zd__layout_diff(la, lb, msg, sizeof msg), 1);
  CHECK_CONTAINS(msg, "parameter 2:");
  CHECK_CONTAINS(msg, "'fc2.bias'");
  CHECK_CONTAINS(msg, "group 1");
  CHECK_CONTAINS(msg, "group 0");
  zd__layout_free(lb);
  memcpy(b, a, sizeof a);

  CHECK_INT_EQ(zd__layout_build(a, 3, 2, 4, 0, &lb, NULL), ZD_OK);
  CHECK_INT_EQ(zd__layout_diff(la, lb, msg, sizeof msg), 1);
  CHECK_CONTAINS(msg, "world size 2 vs 4");
  zd__layout_free(lb);

  CHECK_INT_EQ(zd__layout_build(a, 2, 2, 2, 0, &lb, NULL), ZD_OK);
  CHECK_INT_EQ(zd__layout_diff(la, lb, msg, sizeof msg), 1);
  CHECK_CONTAINS(msg, "3 vs 2 parameters");
  CHECK_CONTAINS(msg, "parameter 2 'fc2.bias'");
  CHECK_INT_EQ(zd__layout_diff(lb, la, msg, sizeof msg), 1);
  CHECK_CONTAINS(msg, "2 vs 3 parameters");
  CHECK_CONTAINS(msg, "parameter 2 'fc2.bias'");
  zd__layout_free(lb);

  /* 0 and the default bucket size are the same layout. */
  CHECK_INT_EQ(zd__layout_build(a, 3, 2, 2, zd__layout_default_bucket_elems(2), &lb, NULL), ZD_OK);
  CHECK_INT_EQ(zd__layout_diff(la, lb, msg, sizeof msg), 0);
  CHECK_U64_EQ(la->hash, lb->hash);
  zd__layout_free(lb);
  zd__layout_free(la);
  ctx[0] = '\0';
}

/* ---- shape formatting ---- */

/* Parses text (without its NUL) from just before an inaccessible page, as a table received from
 * a peer: a read past its end faults. */
static int parse_guarded(const char *text, zd_param_t **params, uint32_t *n) {
  size_t len = strlen(text), page = (size_t)sysconf(_SC_PAGESIZE);
  CHECK(len <= page);
  char *map = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(map != MAP_FAILED);
  CHECK_INT_EQ(mprotect(map + page, page, PROT_NONE), 0);
  memcpy(map + page - len, text, len);
  int rc = zd__layout_parse(map + page - len, len, params, n);
  /* The names point into the buffer: keep them for the caller's checks. */
  if (rc == 0)
    for (uint32_t i = 0; i < *n; i++) (*params)[i].name = strdup((*params)[i].name);
  munmap(map, 2 * page);
  return rc;
}

static void test_table(void) {
  set_ctx("zd__layout_serialize and zd__layout_parse");
  zd_param_t a[] = {
      {.name = "emb", .ndim = 2, .shape = {100, 16}, .group = 0},
      {.name = "a name with spaces", .ndim = 0, .group = 1},
      {.name = "fc.bias", .ndim = 1, .shape = {4294967296ull}, .group = 1},
  };
  zd__layout_t *l;
  CHECK_INT_EQ(zd__layout_build(a, 3, 2, 1, 0, &l, NULL), ZD_OK);
  char *table;
  size_t len;
  CHECK_INT_EQ(zd__layout_serialize(l, &table, &len), 0);
  CHECK_STR_EQ(table, "0 2 100 16 3 emb\n1 0 18 a name with spaces\n1 1 4294967296 7 fc.bias\n");
  zd_param_t *p;
  uint32_t n;
  CHECK_INT_EQ(parse_guarded(table, &p, &n), 0);
  CHECK_INT_EQ(n, 3);
  for (uint32_t i = 0; i < n; i++) {
    CHECK_STR_EQ(p[i].name, a[i].name);
    CHECK_INT_EQ(p[i].ndim, a[i].ndim);
    CHECK_INT_EQ(p[i].group, a[i].group);
    for (uint32_t d = 0; d < a[i].ndim; d++) CHECK_U64_EQ(p[i].shape[d], a[i].shape[d]);
    free((char *)p[i].name);
  }
  free(p);
  free(table);
  zd__layout_free(l);

  /* Malformed tables: -EINVAL, without reading past the end (a blank line once made the number
   * reader skip to the end of the buffer and beyond; found by tests/fuzz/fuzz_layout.c). */
  static const char *const bad[] = {
      "0 1 4 1 a\n\n",                  /* a blank line */
      "0 1 4 1 a\n\n1 1 4 1 b\n",       /* a blank line between two parameters */
      "\n0 1 4",                        /* a blank line, then a line cut in a number */
      "0  1 4 1 a\n",                   /* two blanks */
      "+0 1 4 1 a\n",                   /* a sign */
      "0 9 1 1 1 1 1 1 1 1 1 a\n",      /* more than ZD_MAX_DIMS dimensions */
      "0 1 18446744073709551616 1 a\n", /* a dimension past 2^64 - 1 */
      "0 1 4 2 a\n",                    /* the name is shorter than its length */
      "0 1 4 1 ab\n",                   /* or longer */
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    set_ctx("malformed table %zu: \"%s\"", i, bad[i]);
    CHECK_INT_EQ(parse_guarded(bad[i], &p, &n), -EINVAL);
  }
  set_ctx("%s", "");
}

static void test_shape_format(void) {
  set_ctx("zd__shape_format");
  char buf[200];
  const uint64_t s[ZD_MAX_DIMS] = {32, 16, 1, 0, 18446744073709551615ull, 7, 8, 9};
  zd__shape_format(s, 0, buf, sizeof buf);
  CHECK_STR_EQ(buf, "[]");
  zd__shape_format(s, 1, buf, sizeof buf);
  CHECK_STR_EQ(buf, "[32]");
  zd__shape_format(s, 2, buf, sizeof buf);
  CHECK_STR_EQ(buf, "[32, 16]");
  const char *full = "[32, 16, 1, 0, 18446744073709551615, 7, 8, 9]";
  zd__shape_format(s, ZD_MAX_DIMS, buf, sizeof buf);
  CHECK_STR_EQ(buf, full);
  /* Every shorter buffer gets a terminated prefix, and nothing is written past it. */
  for (size_t len = 1; len <= strlen(full) + 1; len++) {
    memset(buf, '#', sizeof buf);
    zd__shape_format(s, ZD_MAX_DIMS, buf, len);
    CHECK_INT_EQ(strlen(buf), len - 1);
    CHECK(strncmp(buf, full, len - 1) == 0);
    CHECK_INT_EQ(buf[len], '#');
  }
  zd__shape_format(s, 2, NULL, 0);
  ctx[0] = '\0';
}

/* ---- default bucket size: Megatron's max(40,000,000, 1,000,000 * W) ---- */

static void test_default_bucket(void) {
  set_ctx("zd__layout_default_bucket_elems");
  CHECK_U64_EQ(zd__layout_default_bucket_elems(1), 40000000);
  CHECK_U64_EQ(zd__layout_default_bucket_elems(8), 40000000);
  CHECK_U64_EQ(zd__layout_default_bucket_elems(39), 40000000);
  CHECK_U64_EQ(zd__layout_default_bucket_elems(40), 40000000);
  CHECK_U64_EQ(zd__layout_default_bucket_elems(41), 41000000);
  CHECK_U64_EQ(zd__layout_default_bucket_elems(1024), 1024000000ull);
  CHECK_U64_EQ(zd__layout_default_bucket_elems(UINT32_MAX), 1000000ull * UINT32_MAX);
  for (uint32_t w = 1; w <= 4096; w++) {
    set_ctx("zd__layout_default_bucket_elems(%u)", w);
    CHECK_U64_EQ(zd__layout_default_bucket_elems(w), megatron_bucket(w));
  }
  ctx[0] = '\0';
}

int main(void) {
  atexit(print_ctx);
  test_shape_format();
  test_small_case();
  test_merging();
  test_errors();
  test_diff();
  test_table();
  test_random();
  test_default_bucket();
  printf("test_layout: ok\n");
  return 0;
}
