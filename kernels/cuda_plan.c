/* The host side of the CUDA update (cuda_plan.h): the families of the optimizers' table, the
 * per-parameter segments and the map of a step that skips parameters or steps some at their own
 * step count. Plain C: the CPU unit tests run it. */
#include "cuda_plan.h"

#include <string.h>

#include "optim.h"

uint32_t zd__optim_family_mask(int optimizer) {
  const char *k = zd__optim_kernel_name(optimizer);
  uint32_t mask = 0;
  if (!k) return 0;
#define MASK(opt, fam) \
  if (!strcmp(#fam, k)) mask |= 1u << ZD_##opt;
  ZD__OPTIMIZERS(MASK)
#undef MASK
  return mask;
}

/* Parameter p's part [*s, *e) of [lo, hi) (absolute offsets); 0 when it has none. */
static int part(const zd__layout_param_t *p, uint64_t lo, uint64_t hi, uint64_t *s, uint64_t *e) {
  *s = p->offset > lo ? p->offset : lo;
  *e = p->offset + p->numel < hi ? p->offset + p->numel : hi;
  return *s < *e;
}

uint32_t zd__cuda_param_segments(const zd__layout_t *l, uint32_t rank, uint32_t b,
                                 zd__segment_t *out) {
  const zd__bucket_t *bk = &l->buckets[b];
  uint64_t lo = bk->offset + (uint64_t)rank * bk->shard_elems, hi = lo + bk->shard_elems;
  uint32_t n = 0;
  for (uint32_t i = bk->first_param; i < bk->first_param + bk->nparams; i++) {
    uint64_t s, e;
    if (part(&l->params[i], lo, hi, &s, &e))
      out[n++] = (zd__segment_t){.offset = s - lo, .length = e - s, .group = i};
  }
  return n;
}

int zd__cuda_param_map(const zd__layout_t *l, uint32_t rank, const zd__segment_t *const *segs,
                       const uint32_t *nsegs, uint32_t ngroups, uint32_t *map, zd__err_t *err) {
  for (uint32_t i = 0; i < l->nparams; i++) map[i] = ZD__CUDA_SKIP;
  for (uint32_t b = 0; b < l->nbuckets; b++) {
    const zd__bucket_t *bk = &l->buckets[b];
    uint64_t lo = bk->offset + (uint64_t)rank * bk->shard_elems, hi = lo + bk->shard_elems;
    uint32_t k = 0; /* segments and parameters both go in offset order */
    for (uint32_t i = bk->first_param; i < bk->first_param + bk->nparams; i++) {
      uint64_t s, e;
      if (!part(&l->params[i], lo, hi, &s, &e)) continue;
      while (k < nsegs[b] && segs[b][k].offset + segs[b][k].length <= s - lo) k++;
      if (k == nsegs[b] || segs[b][k].offset >= e - lo) continue; /* not covered: skipped */
      const zd__segment_t *g = &segs[b][k];
      if (g->offset > s - lo || g->offset + g->length < e - lo)
        return zd__errf(err, ZD_EINTERNAL,
                        "bucket %u: segment [%llu, +%llu) covers part of parameter %u only", b,
                        (unsigned long long)g->offset, (unsigned long long)g->length, i);
      if (g->group >= ngroups)
        return zd__errf(err, ZD_EINTERNAL,
                        "bucket %u: segment of parameter %u names group %u of %u", b, i, g->group,
                        ngroups);
      map[i] = g->group;
    }
  }
  return ZD_OK;
}
