/* The optimizers' table (optim.h): a group's constants by its optimizer, and the update that
 * hands each run of segments to its optimizer's kernel. */
#include "optim.h"

#include <string.h>

void zd__adam_group_init(zd__adam_group_t *c, const zd_group_t *hp, uint64_t step) {
  switch (hp->optimizer) {
#define CONSTS(opt, k)             \
  case ZD_##opt:                   \
    zd__##k##_consts(c, hp, step); \
    c->optimizer = hp->optimizer;  \
    return;
    ZD__OPTIMIZERS(CONSTS)
#undef CONSTS
  }
  zd__adam_consts(c, hp, step); /* unreachable: zd__group_check admits the table's rows only */
}

int zd__optim_known(int optimizer) {
  return zd__optim_kernel_name(optimizer) != NULL;
}

const char *zd__optim_kernel_name(int optimizer) {
  switch (optimizer) {
#define NAME(opt, k) \
  case ZD_##opt:     \
    return #k;
    ZD__OPTIMIZERS(NAME)
#undef NAME
  }
  return NULL;
}

/* A group's kernel for an ISA and what it writes, by its optimizer's row. Runs of segments are
 * split where the kernel (the function) changes, so rows of one family share a run. */
static zd__adam_fn kernel_fn(int optimizer, zd__isa_t isa) {
  switch (optimizer) {
#define FN(opt, k) \
  case ZD_##opt:   \
    return zd__##k##_impl(isa);
    ZD__OPTIMIZERS(FN)
#undef FN
  }
  return zd__adam_impl(isa);
}

static zd__states_t kernel_writes(int optimizer, const zd__adam_group_t *c) {
  switch (optimizer) {
#define WRITES(opt, k) \
  case ZD_##opt:       \
    return zd__##k##_writes(c);
    ZD__OPTIMIZERS(WRITES)
#undef WRITES
  }
  return 0;
}

zd__states_t zd__optim_writes(const zd__adam_group_t *c) {
  return kernel_writes(c->optimizer, c);
}

zd__states_t zd__optim_group_states(const zd_group_t *g) {
  if (!zd__optim_known(g->optimizer)) return zd__states_always();
  zd__adam_group_t c;
  zd__adam_group_init(&c, g, 1);
  return zd__states_always() | kernel_writes(g->optimizer, &c);
}

zd__states_t zd__optim_states(const zd_group_t *groups, uint32_t ngroups) {
  zd__states_t set = zd__states_always();
  for (uint32_t i = 0; i < ngroups; i++) set |= zd__optim_group_states(&groups[i]);
  return set;
}

int zd__optim_states_missing(zd__states_t have, const zd_group_t *groups, uint32_t ngroups) {
  zd__states_t lack = zd__optim_states(groups, ngroups) & ~have;
  for (int s = 0; s < ZD__NSTATES; s++)
    if (lack & ZD__STATE_BIT(s)) return s;
  return -1;
}

/* Out of place (a->src set), the arrays a segment's kernel leaves alone are copied from src, so
 * that the set written holds the whole state (an array of another optimizer's group, or an
 * optional one this group does not use now). */
static void copy_unwritten(const zd__adam_args_t *a, const zd__segment_t *seg, uint64_t begin,
                           uint64_t end) {
  uint64_t lo = seg->offset > begin ? seg->offset : begin;
  uint64_t hi = seg->offset + seg->length < end ? seg->offset + seg->length : end;
  if (lo >= hi) return;
  const zd__adam_group_t *c = &a->groups[seg->group];
  zd__states_t w = kernel_writes(c->optimizer, c);
  for (int s = 0; s < ZD__NSTATES; s++)
    if (a->src[s] && a->state[s] && !(w & ZD__STATE_BIT(s)) && a->src[s] != a->state[s])
      memcpy(a->state[s] + lo, a->src[s] + lo, (hi - lo) * sizeof(float));
}

static void step_runs(const zd__adam_args_t *a, uint64_t begin, uint64_t end, zd__isa_t isa) {
  int out_of_place = 0;
  for (int s = 0; s < ZD__NSTATES; s++) out_of_place |= a->src[s] != NULL;
  uint32_t s = zd__segs_find(a->segs, a->nsegs, begin);
  while (s < a->nsegs && a->segs[s].offset < end) {
    zd__adam_fn kernel = kernel_fn(a->groups[a->segs[s].group].optimizer, isa);
    uint32_t e = s + 1;
    while (e < a->nsegs && a->segs[e].offset < end &&
           kernel_fn(a->groups[a->segs[e].group].optimizer, isa) == kernel)
      e++;
    const zd__segment_t *last = &a->segs[e - 1];
    uint64_t lo = a->segs[s].offset > begin ? a->segs[s].offset : begin;
    uint64_t hi = last->offset + last->length < end ? last->offset + last->length : end;
    kernel(a, lo, hi);
    if (out_of_place)
      for (uint32_t k = s; k < e; k++) copy_unwritten(a, &a->segs[k], begin, end);
    s = e;
  }
}

#define STEP_ISA(isa)                                                              \
  static void step_##isa(const zd__adam_args_t *a, uint64_t begin, uint64_t end) { \
    step_runs(a, begin, end, isa);                                                 \
  }
STEP_ISA(ZD__ISA_SCALAR)
STEP_ISA(ZD__ISA_AVX2)
STEP_ISA(ZD__ISA_AVX512)
STEP_ISA(ZD__ISA_AVX512BF16)

zd__adam_fn zd__optim_impl(zd__isa_t isa) {
  switch (isa) {
    case ZD__ISA_AVX512BF16:
      return step_ZD__ISA_AVX512BF16;
    case ZD__ISA_AVX512:
      return step_ZD__ISA_AVX512;
    case ZD__ISA_AVX2:
      return step_ZD__ISA_AVX2;
    default:
      return step_ZD__ISA_SCALAR;
  }
}
