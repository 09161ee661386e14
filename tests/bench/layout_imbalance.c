/* layout_imbalance: what a tensor-aligned layout would cost on GPT-2 small, next to today's.
 *
 * Matrix-wise optimizers (Muon's Newton-Schulz, Adafactor's row and column statistics in torch's
 * order) need each tensor whole on one rank; today's layout (common/layout.h) cuts every bucket
 * into W equal slices, so tensors straddle ranks. docs/design.md ("Layout", "A tensor-aligned
 * layout") designs the alternative; this program measures it. Today's numbers come from the
 * project's own rule: zd__layout_build cuts the buckets and zd__layout_segments gives each rank's
 * elements. The tensor-aligned variants keep today's buckets (the same parameters in the same
 * bucket, so trainers scatter them as now) and choose an owner rank per whole tensor:
 *
 *   elementwise      today: each bucket in W equal slices
 *   tensor-global    every tensor whole, largest first onto the least-loaded rank, buckets ignored
 *   tensor-ordered   the same, bucket by bucket (a bucket's tensors are placed before the next's)
 *   tensor-bucket    each bucket balanced on its own (least bucket load, then least total load)
 *   hybrid-even      the matrix-wise group's tensors whole (as tensor-ordered), the element-wise
 *                    group's tensors of each bucket in W equal slices (today's rule on them)
 *   hybrid-fill      the same matrices, then each bucket's element-wise elements in turn fill
 *                    the least-loaded ranks up to one level (water-filling), in unequal slices
 *
 * GPT-2 small is listed as torch's GPT2LMHeadModel.named_parameters() gives it (148 tensors,
 * 124,439,808 parameters; lm_head.weight is wte.weight, counted once). Group 0 is what Muon steps
 * (the 48 hidden matrices), group 1 what stays element-wise (embeddings, layer norms, biases).
 *
 * Columns, per world size W and layout (bytes: one fp32 array of the shard, as master is; Adam's
 * shard at W > 1 is four such arrays, master, two moments and the reduced gradients; Muon's three):
 *   max/mean/min MiB   the largest, average and smallest rank
 *   max/mean           the imbalance of memory (and of a per-element update's time)
 *   pad%               elements a collective with equal counts per rank adds (each bucket padded
 *                      to W times its largest rank's part), as % of the model
 *   ring_x             a ring reduce-scatter (or all-gather) in lockstep, equal counts padded to
 *                      the largest part: busiest link's elements, over today's ring
 *   chain_x            one pipelined reduce (broadcast) per owner: busiest link's elements (a
 *                      bucket's elements less its smallest rank's part), over today's ring
 *   ns_max_GF          Newton-Schulz GFLOP of the busiest rank (5 iterations, 4m^2n + 2m^3 each
 *                      for an m x n matrix, m <= n): the matrices it owns; elementwise: every
 *                      matrix it holds part of, gathered and orthogonalised whole there
 *   ns/ideal           that over the total divided by W
 *
 *   layout_imbalance [--worlds 2,8,64] [--bucket-elems N]    the table (N 0: zerod's default)
 *   layout_imbalance --check     the assignment's invariants on GPT-2 and on random models,
 *                                W = 1..70; exit 1, naming the first ten failures (suite unit)
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"

#define NS_ITERS 5

typedef enum {
  V_ELEMENTWISE,
  V_TENSOR_GLOBAL,
  V_TENSOR_ORDERED,
  V_TENSOR_BUCKET,
  V_HYBRID_EVEN,
  V_HYBRID_FILL,
  V_COUNT
} variant_t;

static const char *const variant_names[V_COUNT] = {
    "elementwise", "tensor-global", "tensor-ordered", "tensor-bucket", "hybrid-even", "hybrid-fill",
};

/* Who holds what: per (bucket, rank) the model's elements that rank owns, of which `split` in the
 * bucket's element-wise region (the hybrids lay a bucket out as its whole tensors, owner by owner,
 * then its element-wise tensors cut into W slices: a rank's part is two ranges), and per tensor its
 * owner (-1: split element-wise). */
typedef struct {
  uint32_t world, nbuckets, nparams;
  uint64_t *len;   /* [nbuckets * world] */
  uint64_t *split; /* [nbuckets * world] */
  int64_t *owner;  /* [nparams] */
  double *ns_flop; /* [world]: Newton-Schulz work each rank does */
} assign_t;

static void die(const char *what) {
  fprintf(stderr, "layout_imbalance: %s\n", what);
  exit(2);
}

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  if (!p) die("out of memory");
  return p;
}

static uint64_t round_up(uint64_t v, uint64_t m) {
  return (v + m - 1) / m * m;
}

/* ---- the model ------------------------------------------------------------------------------ */

typedef struct {
  zd_param_t *params;
  char (*names)[64];
  uint32_t n, cap;
} model_t;

static void model_add(model_t *m, const char *name, uint32_t group, uint32_t ndim, uint64_t d0,
                      uint64_t d1) {
  if (m->n == m->cap) {
    m->cap = m->cap ? 2 * m->cap : 256;
    m->params = realloc(m->params, m->cap * sizeof *m->params);
    m->names = realloc(m->names, m->cap * sizeof *m->names);
    if (!m->params || !m->names) die("out of memory");
  }
  snprintf(m->names[m->n], sizeof m->names[m->n], "%s", name);
  m->params[m->n] = (zd_param_t){.ndim = ndim, .group = group};
  m->params[m->n].shape[0] = d0;
  m->params[m->n].shape[1] = d1;
  m->n++;
}

/* Names point into m->names, which may move while the list grows: set them at the end. */
static void model_seal(model_t *m) {
  for (uint32_t i = 0; i < m->n; i++) m->params[i].name = m->names[i];
}

static void model_free(model_t *m) {
  free(m->params);
  free(m->names);
}

/* GPT2LMHeadModel (n_embd 768, n_layer 12, n_positions 1024, vocab 50257), in the order of
 * named_parameters(). Its Conv1D weights are [in, out]. */
static void gpt2_small(model_t *m) {
  const uint64_t d = 768, vocab = 50257, ctx = 1024;
  char name[64];
  model_add(m, "transformer.wte.weight", 1, 2, vocab, d);
  model_add(m, "transformer.wpe.weight", 1, 2, ctx, d);
  static const struct {
    const char *name;
    uint32_t group;
    uint64_t rows, cols; /* cols 0: a vector */
  } block[] = {
      {"ln_1.weight", 1, 768, 0},           {"ln_1.bias", 1, 768, 0},
      {"attn.c_attn.weight", 0, 768, 2304}, {"attn.c_attn.bias", 1, 2304, 0},
      {"attn.c_proj.weight", 0, 768, 768},  {"attn.c_proj.bias", 1, 768, 0},
      {"ln_2.weight", 1, 768, 0},           {"ln_2.bias", 1, 768, 0},
      {"mlp.c_fc.weight", 0, 768, 3072},    {"mlp.c_fc.bias", 1, 3072, 0},
      {"mlp.c_proj.weight", 0, 3072, 768},  {"mlp.c_proj.bias", 1, 768, 0},
  };
  for (int l = 0; l < 12; l++)
    for (size_t j = 0; j < sizeof block / sizeof block[0]; j++) {
      snprintf(name, sizeof name, "transformer.h.%d.%s", l, block[j].name);
      model_add(m, name, block[j].group, block[j].cols ? 2 : 1, block[j].rows, block[j].cols);
    }
  model_add(m, "transformer.ln_f.weight", 1, 1, d, 0);
  model_add(m, "transformer.ln_f.bias", 1, 1, d, 0);
  model_seal(m);
}

/* ---- the assignments ------------------------------------------------------------------------ */

/* Newton-Schulz work on a matrix-wise tensor (group 0, two dimensions): per iteration X X^T
 * (2m^2n), the polynomial in it (2m^3) and its product with X (2m^2n). */
static double ns_flop(const zd__layout_param_t *p) {
  if (p->group != 0 || p->ndim != 2) return 0;
  double m = (double)p->shape[0], n = (double)p->shape[1];
  if (m > n) {
    double t = m;
    m = n;
    n = t;
  }
  return NS_ITERS * (4 * m * m * n + 2 * m * m * m);
}

static const zd__layout_t *sort_layout; /* qsort's comparator has no context argument */

/* Largest first; equal sizes in registration order, so the assignment is a pure function. */
static int by_size(const void *a, const void *b) {
  uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
  uint64_t ni = sort_layout->params[i].numel, nj = sort_layout->params[j].numel;
  if (ni != nj) return ni > nj ? -1 : 1;
  return i < j ? -1 : i > j;
}

/* The rank with the least `key` (then the least `tie`, then the lowest rank). */
static uint32_t least(const uint64_t *key, const uint64_t *tie, uint32_t world) {
  uint32_t best = 0;
  for (uint32_t r = 1; r < world; r++)
    if (key[r] < key[best] || (key[r] == key[best] && tie && tie[r] < tie[best])) best = r;
  return best;
}

/* Tensors of bucket b (all buckets: b = UINT32_MAX) that `take` accepts, largest first. */
static uint32_t pick(const zd__layout_t *l, uint32_t b, int (*take)(const zd__layout_param_t *),
                     uint32_t *idx) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < l->nparams; i++)
    if ((b == UINT32_MAX || l->params[i].bucket == b) && take(&l->params[i])) idx[n++] = i;
  sort_layout = l;
  qsort(idx, n, sizeof *idx, by_size);
  return n;
}

static int take_all(const zd__layout_param_t *p) {
  (void)p;
  return 1;
}
static int take_whole(const zd__layout_param_t *p) {
  return p->group == 0;
}
static int take_split(const zd__layout_param_t *p) {
  return p->group != 0;
}

static void own(assign_t *a, const zd__layout_t *l, uint32_t i, uint32_t r, uint64_t *load) {
  a->owner[i] = r;
  a->len[(uint64_t)l->params[i].bucket * a->world + r] += l->params[i].numel;
  load[r] += l->params[i].numel;
  a->ns_flop[r] += ns_flop(&l->params[i]);
}

/* The element-wise tensors of bucket b in W equal slices: placed from the bucket's start at
 * multiples of ZD__ALIGN, the region padded to ZD__ALIGN * W (the rule of layout.h, applied to
 * these tensors only). */
static void split_even(assign_t *a, const zd__layout_t *l, uint32_t b, uint64_t *load) {
  const uint32_t w = a->world;
  uint64_t used = 0;
  for (uint32_t i = 0; i < l->nparams; i++)
    if (l->params[i].bucket == b && take_split(&l->params[i]))
      used = round_up(used, ZD__ALIGN) + l->params[i].numel;
  uint64_t slice = round_up(used ? used : 1, (uint64_t)ZD__ALIGN * w) / w, off = 0;
  for (uint32_t i = 0; i < l->nparams; i++) {
    const zd__layout_param_t *p = &l->params[i];
    if (p->bucket != b || !take_split(p)) continue;
    off = round_up(off, ZD__ALIGN);
    for (uint32_t r = 0; r < w; r++) {
      uint64_t lo = (uint64_t)r * slice, hi = lo + slice;
      uint64_t s = off > lo ? off : lo, e = off + p->numel < hi ? off + p->numel : hi;
      if (s < e) {
        a->len[(uint64_t)b * w + r] += e - s;
        a->split[(uint64_t)b * w + r] += e - s;
        load[r] += e - s;
      }
    }
    a->owner[i] = -1;
    off += p->numel;
  }
}

/* The element-wise elements of bucket b raise the least-loaded ranks to one level (whole
 * elements; the remainder goes one each to the lowest of those ranks). */
static void split_fill(assign_t *a, const zd__layout_t *l, uint32_t b, uint64_t *load) {
  const uint32_t w = a->world;
  uint64_t e = 0;
  for (uint32_t i = 0; i < l->nparams; i++)
    if (l->params[i].bucket == b && take_split(&l->params[i])) {
      e += l->params[i].numel;
      a->owner[i] = -1;
    }
  uint32_t *order = xcalloc(w, sizeof *order);
  for (uint32_t r = 0; r < w; r++) order[r] = r;
  for (uint32_t r = 1; r < w; r++) /* insertion sort by load, then rank */
    for (uint32_t k = r; k > 0 && load[order[k - 1]] > load[order[k]]; k--) {
      uint32_t t = order[k];
      order[k] = order[k - 1];
      order[k - 1] = t;
    }
  /* The k least-loaded ranks share e and their loads; k grows while the level passes the next. */
  uint32_t k = 1;
  uint64_t sum = load[order[0]];
  while (k < w && (e + sum) / k > load[order[k]]) sum += load[order[k++]];
  uint64_t level = (e + sum) / k, rem = (e + sum) % k;
  for (uint32_t j = 0; j < k; j++) {
    uint32_t r = order[j];
    uint64_t give = level - load[r] + (j < rem);
    a->len[(uint64_t)b * w + r] += give;
    a->split[(uint64_t)b * w + r] += give;
    load[r] += give;
  }
  free(order);
}

static void assign(variant_t v, const zd__layout_t *l, assign_t *a) {
  const uint32_t w = l->world_size;
  *a = (assign_t){.world = w, .nbuckets = l->nbuckets, .nparams = l->nparams};
  a->len = xcalloc((size_t)l->nbuckets * w, sizeof *a->len);
  a->split = xcalloc((size_t)l->nbuckets * w, sizeof *a->split);
  a->owner = xcalloc(l->nparams, sizeof *a->owner);
  a->ns_flop = xcalloc(w, sizeof *a->ns_flop);
  uint64_t *load = xcalloc(w, sizeof *load), *bload = xcalloc(w, sizeof *bload);
  uint32_t *idx = xcalloc(l->nparams, sizeof *idx);

  if (v == V_ELEMENTWISE) { /* the project's rule: each rank's segments of each bucket */
    for (uint32_t b = 0; b < l->nbuckets; b++)
      for (uint32_t r = 0; r < w; r++) {
        zd__segment_t *segs;
        uint32_t nsegs;
        if (zd__layout_segments(l, r, b, &segs, &nsegs)) die("out of memory");
        for (uint32_t s = 0; s < nsegs; s++) a->len[(uint64_t)b * w + r] += segs[s].length;
        free(segs);
      }
    /* Newton-Schulz on gathered matrices: every rank holding part of one does it whole. */
    for (uint32_t i = 0; i < l->nparams; i++) {
      const zd__layout_param_t *p = &l->params[i];
      const zd__bucket_t *bk = &l->buckets[p->bucket];
      a->owner[i] = -1;
      for (uint32_t r = 0; r < w; r++) {
        uint64_t lo = bk->offset + (uint64_t)r * bk->shard_elems, hi = lo + bk->shard_elems;
        if (p->offset < hi && p->offset + p->numel > lo) a->ns_flop[r] += ns_flop(p);
      }
    }
  } else if (v == V_TENSOR_GLOBAL) {
    uint32_t n = pick(l, UINT32_MAX, take_all, idx);
    for (uint32_t k = 0; k < n; k++) own(a, l, idx[k], least(load, NULL, w), load);
  } else {
    for (uint32_t b = 0; b < l->nbuckets; b++) {
      if (v == V_HYBRID_EVEN) split_even(a, l, b, load); /* equal for all: place it first */
      uint32_t n =
          pick(l, b, v == V_TENSOR_ORDERED || v == V_TENSOR_BUCKET ? take_all : take_whole, idx);
      memset(bload, 0, w * sizeof *bload);
      for (uint32_t k = 0; k < n; k++) {
        uint32_t r = v == V_TENSOR_BUCKET ? least(bload, load, w) : least(load, NULL, w);
        bload[r] += l->params[idx[k]].numel;
        own(a, l, idx[k], r, load);
      }
    }
    /* Every matrix placed, the element-wise elements level the loads, bucket by bucket. */
    if (v == V_HYBRID_FILL)
      for (uint32_t b = 0; b < l->nbuckets; b++) split_fill(a, l, b, load);
  }
  free(idx);
  free(bload);
  free(load);
}

static void assign_free(assign_t *a) {
  free(a->len);
  free(a->split);
  free(a->owner);
  free(a->ns_flop);
}

/* ---- the measures --------------------------------------------------------------------------- */

typedef struct {
  uint64_t max, min, total;
  double mean;
  uint64_t padded; /* elements of the buffers of equal-count collectives */
  uint64_t ring;   /* busiest link of a lockstep ring, elements */
  uint64_t chain;  /* busiest link of pipelined per-owner reduces, elements */
  double ns_max, ns_total;
} measure_t;

static measure_t measure(const assign_t *a, const zd__layout_t *l, variant_t v) {
  const uint32_t w = a->world;
  measure_t m = {.min = UINT64_MAX};
  uint64_t *load = xcalloc(w, sizeof *load);
  for (uint32_t b = 0; b < a->nbuckets; b++) {
    const uint64_t *len = &a->len[(uint64_t)b * w], *split = &a->split[(uint64_t)b * w];
    uint64_t wmax = 0, smax = 0, bmin = UINT64_MAX, bsum = 0;
    for (uint32_t r = 0; r < w; r++) {
      load[r] += len[r];
      bsum += len[r];
      if (len[r] - split[r] > wmax) wmax = len[r] - split[r];
      if (split[r] > smax) smax = split[r];
      if (len[r] < bmin) bmin = len[r];
    }
    /* Equal counts: each region of the bucket padded to W times its largest part. Today's
     * collectives move the bucket's padded slices (bucket elems / W per rank). A per-owner chain
     * sends an owner's ranges whatever their number: link r -> r + 1 carries every part but r's. */
    uint64_t part = v == V_ELEMENTWISE ? l->buckets[b].shard_elems : wmax + smax;
    m.padded += (uint64_t)w * part;
    m.ring += (uint64_t)(w - 1) * part;
    m.chain += w > 1 ? bsum - bmin : 0;
  }
  for (uint32_t r = 0; r < w; r++) {
    if (load[r] > m.max) m.max = load[r];
    if (load[r] < m.min) m.min = load[r];
    m.total += load[r];
    if (a->ns_flop[r] > m.ns_max) m.ns_max = a->ns_flop[r];
  }
  for (uint32_t i = 0; i < l->nparams; i++) m.ns_total += ns_flop(&l->params[i]);
  m.mean = (double)m.total / w;
  free(load);
  return m;
}

static double mib(double elems) {
  return elems * 4 / (1024.0 * 1024.0);
}

static int table(const model_t *model, const uint32_t *worlds, uint32_t nworlds,
                 uint64_t bucket_elems) {
  zd__layout_t *one;
  zd__err_t err;
  if (zd__layout_build(model->params, model->n, 2, 1, bucket_elems, &one, &err)) {
    fprintf(stderr, "layout_imbalance: layout: %s\n", err.msg);
    return 1;
  }
  uint64_t total = 0, largest = 0;
  uint32_t li = 0;
  for (uint32_t i = 0; i < one->nparams; i++) {
    total += one->params[i].numel;
    if (one->params[i].numel > largest) largest = one->params[i].numel, li = i;
  }
  printf("# layout_imbalance: GPT-2 small, %u tensors, %" PRIu64
         " parameters; largest %s,\n"
         "#   %" PRIu64 " elements (%.1f%% of the model)\n",
         one->nparams, total, one->params[li].name, largest,
         100.0 * (double)largest / (double)total);
  zd__layout_free(one);
  printf(
      "# MiB: one fp32 array of a rank's shard; ring_x, chain_x: busiest link over today's "
      "ring\n");
  printf("%3s %-14s %7s %8s %7s %8s %7s %6s %7s %9s %8s\n", "W", "layout", "max_MiB", "mean_MiB",
         "min_MiB", "max/mean", "pad%", "ring_x", "chain_x", "ns_max_GF", "ns/ideal");
  for (uint32_t k = 0; k < nworlds; k++) {
    zd__layout_t *l;
    if (zd__layout_build(model->params, model->n, 2, worlds[k], bucket_elems, &l, &err)) {
      fprintf(stderr, "layout_imbalance: layout at W = %u: %s\n", worlds[k], err.msg);
      return 1;
    }
    measure_t today = {0};
    for (variant_t v = 0; v < V_COUNT; v++) {
      assign_t a;
      assign(v, l, &a);
      measure_t m = measure(&a, l, v);
      if (v == V_ELEMENTWISE) today = m;
      double ideal = m.ns_total / worlds[k];
      printf("%3u %-14s %7.1f %8.1f %7.1f %8.2f %7.2f %6.2f %7.2f %9.1f %8.2f\n", worlds[k],
             variant_names[v], mib((double)m.max), mib(m.mean), mib((double)m.min),
             (double)m.max / m.mean, 100.0 * ((double)m.padded / (double)m.total - 1),
             today.ring ? (double)m.ring / (double)today.ring : 0,
             today.ring ? (double)m.chain / (double)today.ring : 0, m.ns_max / 1e9,
             ideal > 0 ? m.ns_max / ideal : 0);
      assign_free(&a);
    }
    printf("#   W = %u: %u buckets of %" PRIu64 " elements; largest tensor / mean rank = %.2f\n",
           worlds[k], l->nbuckets, l->bucket_elems, (double)largest / ((double)total / worlds[k]));
    zd__layout_free(l);
  }
  return 0;
}

/* ---- the invariants (--check) --------------------------------------------------------------- */

static int failures;

#define CHECK(cond, ...)                             \
  do {                                               \
    if (!(cond)) {                                   \
      if (failures++ < 10) {                         \
        fprintf(stderr, "layout_imbalance: FAIL: "); \
        fprintf(stderr, __VA_ARGS__);                \
        fprintf(stderr, "\n");                       \
      }                                              \
    }                                                \
  } while (0)

/* Every tensor has exactly one owner or is split; every bucket's and the model's elements are
 * conserved; a whole tensor's elements are counted on its owner, in its bucket; greedy placement
 * keeps the busiest rank within the mean plus the largest tensor placed (globally, or per bucket
 * for tensor-bucket); the same input gives the same owners. */
static void check_one(const zd__layout_t *l, variant_t v, const char *what) {
  const uint32_t w = l->world_size;
  assign_t a, again;
  assign(v, l, &a);
  assign(v, l, &again);
  uint64_t *bsum = xcalloc(l->nbuckets, sizeof *bsum),
           *whole = xcalloc((size_t)l->nbuckets * w, sizeof *bsum);
  uint64_t total = 0, largest = 0;
  for (uint32_t i = 0; i < l->nparams; i++) {
    const zd__layout_param_t *p = &l->params[i];
    bsum[p->bucket] += p->numel;
    total += p->numel;
    if (p->numel > largest) largest = p->numel;
    int must_split = v == V_ELEMENTWISE || ((v == V_HYBRID_EVEN || v == V_HYBRID_FILL) && p->group);
    if (must_split) {
      CHECK(a.owner[i] == -1, "%s %s W=%u: tensor %u '%s' has owner %" PRId64 "; expected split",
            what, variant_names[v], w, i, p->name, a.owner[i]);
    } else {
      CHECK(a.owner[i] >= 0 && a.owner[i] < (int64_t)w,
            "%s %s W=%u: tensor %u '%s' has owner %" PRId64 "; expected one of 0..%u", what,
            variant_names[v], w, i, p->name, a.owner[i], w - 1);
      if (a.owner[i] >= 0 && a.owner[i] < (int64_t)w)
        whole[(uint64_t)p->bucket * w + (uint64_t)a.owner[i]] += p->numel;
    }
    CHECK(a.owner[i] == again.owner[i],
          "%s %s W=%u: tensor %u '%s' owned by %" PRId64 ", then by %" PRId64, what,
          variant_names[v], w, i, p->name, a.owner[i], again.owner[i]);
  }
  uint64_t sum = 0, max = 0;
  for (uint32_t b = 0; b < l->nbuckets; b++) {
    uint64_t s = 0, bmax = 0, blargest = 0;
    for (uint32_t r = 0; r < w; r++) {
      uint64_t len = a.len[(uint64_t)b * w + r];
      s += len;
      if (len > bmax) bmax = len;
      uint64_t split = a.split[(uint64_t)b * w + r];
      CHECK(v == V_ELEMENTWISE || (split <= len && len - split == whole[(uint64_t)b * w + r]),
            "%s %s W=%u: rank %u holds %" PRIu64 " elements of bucket %u, %" PRIu64
            " of them split; the tensors it owns there have %" PRIu64,
            what, variant_names[v], w, r, len, b, split, whole[(uint64_t)b * w + r]);
    }
    for (uint32_t i = 0; i < l->nparams; i++)
      if (l->params[i].bucket == b && l->params[i].numel > blargest) blargest = l->params[i].numel;
    CHECK(s == bsum[b],
          "%s %s W=%u: bucket %u: ranks hold %" PRIu64 " elements, its tensors %" PRIu64, what,
          variant_names[v], w, b, s, bsum[b]);
    if (v == V_TENSOR_BUCKET)
      CHECK(bmax * w <= bsum[b] + (uint64_t)w * blargest,
            "%s %s W=%u: bucket %u: busiest rank %" PRIu64 " above mean %" PRIu64
            "/%u + largest %" PRIu64,
            what, variant_names[v], w, b, bmax, bsum[b], w, blargest);
    sum += s;
  }
  for (uint32_t r = 0; r < w; r++) {
    uint64_t load = 0;
    for (uint32_t b = 0; b < l->nbuckets; b++) load += a.len[(uint64_t)b * w + r];
    if (load > max) max = load;
  }
  CHECK(sum == total, "%s %s W=%u: ranks hold %" PRIu64 " elements, the model has %" PRIu64, what,
        variant_names[v], w, sum, total);
  if (v == V_TENSOR_GLOBAL || v == V_TENSOR_ORDERED)
    CHECK(max * w <= total + (uint64_t)w * largest,
          "%s %s W=%u: busiest rank %" PRIu64 " above mean %" PRIu64 "/%u + largest %" PRIu64, what,
          variant_names[v], w, max, total, w, largest);
  free(bsum);
  free(whole);
  assign_free(&a);
  assign_free(&again);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(uint64_t n) { /* xorshift64*, fixed seed: the same models every run */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (rng_state * 0x2545f4914f6cdd1dull) % n;
}

static int check(void) {
  model_t gpt2 = {0};
  gpt2_small(&gpt2);
  for (uint32_t trial = 0; trial < 120; trial++) {
    model_t rm = {0};
    const model_t *m = &gpt2;
    uint64_t bucket = 0;
    if (trial) { /* a random model: a few big tensors among many small, both groups */
      uint32_t n = 1 + (uint32_t)rnd(300);
      char name[64];
      for (uint32_t i = 0; i < n; i++) {
        snprintf(name, sizeof name, "t%u", i);
        uint64_t rows = 1 + rnd(rnd(8) ? 512 : 20000), cols = rnd(3) ? 1 + rnd(4096) : 0;
        model_add(&rm, name, (uint32_t)rnd(2), cols ? 2 : 1, rows, cols);
      }
      model_seal(&rm);
      m = &rm;
      bucket = rnd(4) ? 1 + rnd(20000000) : 0;
    }
    for (uint32_t w = 1; w <= 70; w += trial ? 1 + (uint32_t)rnd(9) : 1) {
      zd__layout_t *l;
      zd__err_t err;
      if (zd__layout_build(m->params, m->n, 2, w, bucket, &l, &err)) {
        fprintf(stderr, "layout_imbalance: layout: %s\n", err.msg);
        return 1;
      }
      char what[32];
      snprintf(what, sizeof what, trial ? "random model %u" : "gpt2", trial);
      for (variant_t v = 0; v < V_COUNT; v++) check_one(l, v, what);
      zd__layout_free(l);
    }
    model_free(&rm);
  }
  model_free(&gpt2);
  if (failures) {
    fprintf(stderr, "layout_imbalance: %d checks failed\n", failures);
    return 1;
  }
  printf(
      "layout_imbalance: every assignment conserves elements, owns each tensor once, stays "
      "within the greedy bound and is deterministic\n");
  return 0;
}

/* ---- main ----------------------------------------------------------------------------------- */

static int usage(void) {
  fprintf(stderr, "usage: layout_imbalance [--worlds 2,8,64] [--bucket-elems N] | --check\n");
  return 2;
}

int main(int argc, char **argv) {
  uint32_t worlds[16] = {2, 8, 64}, nworlds = 3;
  uint64_t bucket_elems = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--check") == 0) return check();
    if (i + 1 >= argc) return usage();
    if (strcmp(argv[i], "--worlds") == 0) {
      nworlds = 0;
      for (char *s = argv[++i], *end; *s && nworlds < 16; s = *end ? end + 1 : end) {
        unsigned long w = strtoul(s, &end, 10);
        if (end == s || w == 0 || w > 100000 || (*end && *end != ',')) return usage();
        worlds[nworlds++] = (uint32_t)w;
      }
    } else if (strcmp(argv[i], "--bucket-elems") == 0) {
      char *end;
      errno = 0;
      bucket_elems = strtoull(argv[++i], &end, 10);
      if (errno || *end) return usage();
    } else {
      return usage();
    }
  }
  model_t gpt2 = {0};
  gpt2_small(&gpt2);
  int rc = table(&gpt2, worlds, nworlds, bucket_elems);
  model_free(&gpt2);
  return rc;
}
