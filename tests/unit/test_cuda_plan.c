/* The host side of the CUDA update (kernels/cuda_plan.h), which runs without a GPU: the families
 * of the optimizers' table the dispatch launches (zd__optim_family_mask), the per-parameter
 * segments of the CUDA backend's second layout (zd__cuda_param_segments) and the map of a step
 * whose parameters are skipped or lag (zd__cuda_param_map), from segments rebuilt as
 * daemon/step/step.c's uneven_build rebuilds them (restated here: one run per parameter, skipped
 * ones left out, adjacent parameters of the same constants merged), on layouts at W=1, 2 and 3
 * with parameters split across ranks' slices. */
#include <string.h>

#include "check.h"
#include "cuda_plan.h"
#include "layout.h"
#include "optim.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t draw(uint32_t n) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (uint32_t)(rng >> 33) % n;
}

static void families(void) {
  uint32_t adam = (1u << ZD_ADAMW) | (1u << ZD_ADAM);
  CHECK_INT_EQ(zd__optim_family_mask(ZD_ADAMW), adam);
  CHECK_INT_EQ(zd__optim_family_mask(ZD_ADAM), adam);
  CHECK_INT_EQ(zd__optim_family_mask(ZD_SGD), 1u << ZD_SGD);
  CHECK_INT_EQ(zd__optim_family_mask(ZD_ADAGRAD), 1u << ZD_ADAGRAD);
  CHECK_INT_EQ(zd__optim_family_mask(ZD_RMSPROP), 1u << ZD_RMSPROP);
  CHECK_INT_EQ(zd__optim_family_mask(ZD_LION), 1u << ZD_LION);
  CHECK_INT_EQ(zd__optim_family_mask(99), 0);
  CHECK_INT_EQ(zd__optim_family_mask(-1), 0);
  /* Every row: its own bit, and exactly the rows whose kernel family has its name. */
  for (int a = 0; a < 32; a++) {
    const char *k = zd__optim_kernel_name(a);
    if (!k) continue;
    uint32_t m = zd__optim_family_mask(a);
    CHECK((m >> a) & 1u);
    for (int b = 0; b < 32; b++) {
      const char *kb = zd__optim_kernel_name(b);
      CHECK_INT_EQ((int)((m >> b) & 1u), kb && !strcmp(k, kb));
    }
  }
}

#define NP 40

static zd__layout_t *layout(uint32_t world, uint64_t bucket_elems, zd_param_t *p,
                            char names[][16]) {
  for (int i = 0; i < NP; i++) {
    snprintf(names[i], 16, "p%d", i);
    p[i] = (zd_param_t){.name = names[i], .ndim = 1, .group = (uint32_t)i % 3};
    p[i].shape[0] = 1 + draw(i % 7 == 0 ? 700 : 90);
  }
  zd__layout_t *l = NULL;
  zd__err_t err = {0};
  int rc = zd__layout_build(p, NP, 3, world, bucket_elems, &l, &err);
  CHECK_MSG(rc == ZD_OK, "zd__layout_build: %s", err.msg);
  return l;
}

/* Parameter i's part of rank's slice of its bucket, relative to the slice: [*s, *e). */
static int part(const zd__layout_t *l, uint32_t rank, uint32_t i, uint64_t *s, uint64_t *e) {
  const zd__layout_param_t *p = &l->params[i];
  const zd__bucket_t *bk = &l->buckets[p->bucket];
  uint64_t lo = bk->offset + (uint64_t)rank * bk->shard_elems, hi = lo + bk->shard_elems;
  uint64_t a = p->offset > lo ? p->offset : lo,
           b = p->offset + p->numel < hi ? p->offset + p->numel : hi;
  *s = a - lo;
  *e = b - lo;
  return a < b;
}

static void per_parameter(const zd__layout_t *l) {
  for (uint32_t r = 0; r < l->world_size; r++)
    for (uint32_t b = 0; b < l->nbuckets; b++) {
      zd__segment_t out[NP + 1];
      uint32_t n = zd__cuda_param_segments(l, r, b, out);
      zd__segment_t *model = NULL;
      uint32_t nm = 0;
      CHECK_INT_EQ(zd__layout_segments(l, r, b, &model, &nm), ZD_OK);
      uint64_t covered = 0, model_covered = 0;
      for (uint32_t k = 0; k < n; k++) {
        uint64_t s, e;
        CHECK(out[k].group < l->nparams);
        CHECK_INT_EQ(l->params[out[k].group].bucket, b);
        CHECK(part(l, r, out[k].group, &s, &e));
        CHECK_U64_EQ(out[k].offset, s);
        CHECK_U64_EQ(out[k].length, e - s);
        if (k) CHECK(out[k].offset >= out[k - 1].offset + out[k - 1].length);
        covered += out[k].length;
      }
      for (uint32_t k = 0; k < nm; k++) model_covered += model[k].length;
      CHECK_U64_EQ(covered, model_covered); /* the same elements as the model's segments */
      /* Every parameter with elements in the slice has its segment. */
      uint32_t want = 0;
      for (uint32_t i = 0; i < l->nparams; i++) {
        uint64_t s, e;
        want += l->params[i].bucket == b && part(l, r, i, &s, &e);
      }
      CHECK_INT_EQ(n, want);
      free(model);
    }
}

/* step.c's uneven_build for one rank: skip[i], own[i] (0: at the model's step; else the index of
 * its constants), merged runs. Returns the map it implies. */
static void uneven(const zd__layout_t *l, uint32_t r, const int *skip, const uint32_t *own,
                   zd__segment_t **segs, uint32_t *nsegs, uint32_t *expect) {
  for (uint32_t i = 0; i < l->nparams; i++) expect[i] = ZD__CUDA_SKIP;
  for (uint32_t b = 0; b < l->nbuckets; b++) {
    const zd__bucket_t *bk = &l->buckets[b];
    segs[b] = calloc(bk->nparams + 1, sizeof **segs);
    uint32_t n = 0;
    for (uint32_t i = bk->first_param; i < bk->first_param + bk->nparams; i++) {
      uint64_t s, e;
      if (!part(l, r, i, &s, &e) || skip[i]) continue;
      uint32_t k = own[i] ? own[i] : l->params[i].group;
      expect[i] = k;
      zd__segment_t *prev = n ? &segs[b][n - 1] : NULL;
      if (prev && prev->group == k && prev->offset + prev->length == s)
        prev->length += e - s;
      else
        segs[b][n++] = (zd__segment_t){.offset = s, .length = e - s, .group = k};
    }
    nsegs[b] = n;
  }
}

static void maps(const zd__layout_t *l) {
  uint32_t nb = l->nbuckets, map[NP], expect[NP];
  zd__segment_t *segs[64];
  uint32_t nsegs[64];
  CHECK(nb <= 64);
  for (int trial = 0; trial < 30; trial++) {
    int skip[NP];
    uint32_t own[NP];
    uint32_t nconsts = 3;
    for (uint32_t i = 0; i < NP; i++) {
      skip[i] = trial > 0 && draw(4) == 0; /* trial 0: the model's own segments */
      own[i] = trial > 0 && draw(3) == 0 ? 3 + draw(5) : 0;
      if (own[i] + 1 > nconsts) nconsts = own[i] + 1;
    }
    for (uint32_t r = 0; r < l->world_size; r++) {
      uneven(l, r, skip, own, segs, nsegs, expect);
      zd__err_t err = {0};
      int rc =
          zd__cuda_param_map(l, r, (const zd__segment_t *const *)segs, nsegs, nconsts, map, &err);
      CHECK_MSG(rc == ZD_OK, "trial %d rank %u: %s", trial, r, err.msg);
      for (uint32_t i = 0; i < NP; i++)
        CHECK_MSG(map[i] == expect[i], "trial %d rank %u: parameter %u maps to %u, expected %u",
                  trial, r, i, map[i], expect[i]);
      /* A group the constants do not have, and a segment that covers part of a parameter. */
      for (uint32_t b = 0; b < nb; b++)
        if (nsegs[b]) {
          zd__segment_t keep = segs[b][0];
          segs[b][0].group = nconsts;
          CHECK_INT_EQ(zd__cuda_param_map(l, r, (const zd__segment_t *const *)segs, nsegs, nconsts,
                                          map, &err),
                       ZD_EINTERNAL);
          segs[b][0] = keep;
          if (keep.length > 1) {
            segs[b][0].length--;
            CHECK_INT_EQ(zd__cuda_param_map(l, r, (const zd__segment_t *const *)segs, nsegs,
                                            nconsts, map, &err),
                         ZD_EINTERNAL);
            CHECK_CONTAINS(err.msg, "covers part of parameter");
            segs[b][0] = keep;
          }
          break;
        }
      for (uint32_t b = 0; b < nb; b++) free(segs[b]);
    }
  }
}

int main(void) {
  families();
  static const struct {
    uint32_t world;
    uint64_t bucket;
  } cases[] = {{1, 1000}, {2, 600}, {3, 500}, {3, 100000}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    zd_param_t p[NP];
    char names[NP][16];
    zd__layout_t *l = layout(cases[c].world, cases[c].bucket, p, names);
    per_parameter(l);
    maps(l);
    printf("W=%u, %u buckets: per-parameter segments and maps as step.c builds them\n",
           l->world_size, l->nbuckets);
    zd__layout_free(l);
  }
  printf("test_cuda_plan: ok\n");
  return 0;
}
