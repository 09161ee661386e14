/* GPU tests of the CUDA optimizer kernels (kernels/adam.cu) against the CPU reference
 * (kernels/adam.c), bit for bit. Exits 77 (skipped) where no GPU can run them.
 *
 * Written to be run for the first time by someone else: every check says what differs, where,
 * with the inputs of the element, and the whole suite runs in one go (each section prints a line).
 *
 *   convert   the device conversions (adam.cuh) against zd__f16_to_f32 / zd__f32_to_bf16: all
 *             65536 f16 and bf16 inputs, f32 -> bf16 at every exponent around the rounding ties,
 *             specials and 16M random floats;
 *   errors    the launchers' argument checks;
 *   step      zd__cuda_adam_step against zd__adam_step_ref after every step: every grad dtype x
 *             param output (f32/bf16/none), every length 0..300 plus large ones (up to more tiles
 *             than the grid, so blocks stride), random segments (gaps, boundaries anywhere,
 *             mixed AdamW/Adam groups with and without weight decay), special grads (inf, NaN,
 *             subnormal, max), subnormal moments, several steps with a changing lr, device
 *             arrays aligned (vector path) or shifted off 16 bytes, together or each its own way
 *             (scalar path), groups inline or in a device array (and more than
 * ZD__CUDA_GROUPS_INLINE); variants  the same for every update formula (zd_update_t: torch
 * 1.13's, 2.x's CPU formula, its three CUDA paths), with and without maximize, and all of them in
 * one shard. Whole buffers are compared, with guard elements on both sides, so
 * padding and guards must keep their sentinel bits; stats     zd__cuda_grad_stats: per-block sums
 * bitwise equal to zd__grad_stats_ref, total bitwise equal to zd__grad_stats_sum (pairwise by
 * levels), non-finite count, accumulation over ranges, tags, the record sealed with its check
 * word; sizes up to more blocks than the grid, block counts at the tree's chunk edges (2048 block
 * sums) and several chunks (test_decide_cuda adds the tree's second level); pipeline  a step as
 * the CUDA backend runs it: the
 * statistics of two ranges into one record, the record back to the host, the host's decision, the
 * update; loss scaling with overflow steps and clipping, against the CPU step's logic; huge one
 * range of more than 2^32 elements with segments around 2^32 (64-bit indices in the tile table, the
 * update and the statistics); needs 9 GiB of device memory, and says it is skipped without them.
 * The shards meant to make blocks stride are sized from the GPU's SM count and checked to stride
 * (zd__cuda_layout_grids). The last line gives the max abs/rel difference over everything (0)
 * and how many f32 NaN outputs differed only in payload.
 * A NaN result may differ in payload and sign (the GPU produces the canonical NaN): f32 outputs
 * compare equal when both are NaN; bf16 outputs (NaN -> 0x7fc0 on both sides) compare bitwise.
 */
#include <cuda_runtime.h>

#include "adam.cuh"
#include "gpu_check.h"
#include "group.h"
#include "step_decide.h"

#define GUARD     24 /* sentinel elements on each side of a range (a multiple of 8) */
#define NGROUPS   5
#define MAX_SHIFT 16

static cudaStream_t stream;

/* A group with these fields and zerod's defaults for the others (no positional initializer:
 * zd_group_t may grow). */
static zd_group_t group_of(double lr, double beta1, double beta2, double eps, double wd,
                           zd_optimizer_t optimizer) {
  zd_group_t g = zd__group_default();
  g.lr = lr;
  g.beta1 = beta1;
  g.beta2 = beta2;
  g.eps = eps;
  g.weight_decay = wd;
  g.optimizer = optimizer;
  return g;
}

/* lr, beta1, beta2, eps, weight_decay, optimizer: both optimizers, with and without decay. */
static const zd_group_t hps[NGROUPS] = {
    group_of(1e-3, 0.9, 0.999, 1e-8, 0.01, ZD_ADAMW), group_of(3e-4, 0.9, 0.95, 1e-8, 0, ZD_ADAMW),
    group_of(1e-2, 0.8, 0.99, 1e-6, 0.1, ZD_ADAM),    group_of(5e-4, 0.9, 0.999, 1e-8, 0, ZD_ADAM),
    group_of(0.1, 0.5, 0.6, 1e-3, 0.5, ZD_ADAMW),
};

static size_t dtype_size(int t) {
  return t == ZD_F32 ? 4 : t ? 2 : 0;
}

static const char *dtype_name(int t) {
  return t == ZD_F32 ? "f32" : t == ZD_BF16 ? "bf16" : t == ZD_F16 ? "f16" : "none";
}

static float to_f32(const void *buf, int t, uint64_t i) {
  if (t == ZD_F32) return ((const float *)buf)[i];
  uint16_t h = ((const uint16_t *)buf)[i];
  return t == ZD_BF16 ? zd__bf16_to_f32(h) : zd__f16_to_f32(h);
}

static uint32_t raw_bits(const void *buf, int t, uint64_t i) {
  return t == ZD_F32 ? ((const uint32_t *)buf)[i] : ((const uint16_t *)buf)[i];
}

/* f32 outputs that differed from the reference only as NaN payload or sign (accepted). */
static uint64_t nan_only_diffs;

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  CHECK_MSG(p, "out of host memory (%zu bytes)", bytes);
  return p;
}

static void *dmalloc(size_t bytes) {
  void *p = NULL;
  CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 16));
  return p;
}

static void h2d(void *dst, const void *src, size_t bytes) {
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
}

static void d2h(void *dst, const void *src, size_t bytes) {
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

static void sync_stream(void) {
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

/* ---- conversions ------------------------------------------------------------------------- */

__global__ void convert16_kernel(uint32_t *from_f16, uint32_t *from_bf16) {
  uint32_t h = blockIdx.x * blockDim.x + threadIdx.x;
  if (h < 65536) {
    from_f16[h] = __float_as_uint(zd__dev_f16_to_f32((uint16_t)h));
    from_bf16[h] = __float_as_uint(zd__dev_bf16_to_f32((uint16_t)h));
  }
}

__global__ void to_bf16_kernel(const uint32_t *in, uint16_t *out, uint64_t n) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    out[i] = zd__dev_f32_to_bf16(__uint_as_float(in[i]));
}

static void test_convert(void) {
  uint32_t *d16 = (uint32_t *)dmalloc(2 * 65536 * 4), *h16 = (uint32_t *)xmalloc(2 * 65536 * 4);
  convert16_kernel<<<256, 256, 0, stream>>>(d16, d16 + 65536);
  CUDA_CHECK(cudaGetLastError());
  d2h(h16, d16, 2 * 65536 * 4);
  for (uint32_t h = 0; h < 65536; h++) {
    uint32_t want = f2u(zd__f16_to_f32((uint16_t)h));
    CHECK_MSG(h16[h] == want, "f16 %04x: device gives %08x, zd__f16_to_f32 %08x", h, h16[h], want);
    want = f2u(zd__bf16_to_f32((uint16_t)h));
    CHECK_MSG(h16[65536 + h] == want, "bf16 %04x: device gives %08x, host %08x", h, h16[65536 + h],
              want);
  }
  /* f32 -> bf16: every sign and exponent with the low half at and around the tie, odd and even
   * upper halves, then specials and random bits. */
  static const uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff};
  static const uint32_t specials[] = {0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001,
                                      0xff800001, 0x7fbfffff, 0x7fffffff, 0xffffffff, 0x7f7fffff,
                                      0xff7fffff, 0x00000000, 0x80000000, 0x00000001, 0x807fffff,
                                      0x00008000, 0x00018000, 0x7f7f8000, 0x7f7f7fff};
  const uint64_t nstruct = 512 * 4 * 6, nspecial = sizeof specials / sizeof specials[0];
  const uint64_t n = nstruct + nspecial + (1u << 24);
  uint32_t *in = (uint32_t *)xmalloc(n * 4);
  uint64_t k = 0;
  for (uint32_t se = 0; se < 512; se++)
    for (uint32_t up = 0; up < 4; up++)
      for (uint32_t lo = 0; lo < 6; lo++) {
        uint32_t upper = up == 0   ? 0
                         : up == 1 ? 1
                         : up == 2 ? 0x7e
                                   : 0x7f; /* mantissa bits 22..16 */
        in[k++] = (se << 23) | (upper << 16) | lows[lo];
      }
  for (uint64_t i = 0; i < nspecial; i++) in[k++] = specials[i];
  while (k < n) in[k++] = (uint32_t)zd_test_rnd();
  uint32_t *din = (uint32_t *)dmalloc(n * 4);
  uint16_t *dout = (uint16_t *)dmalloc(n * 2), *out = (uint16_t *)xmalloc(n * 2);
  h2d(din, in, n * 4);
  to_bf16_kernel<<<1024, 256, 0, stream>>>(din, dout, n);
  CUDA_CHECK(cudaGetLastError());
  d2h(out, dout, n * 2);
  for (uint64_t i = 0; i < n; i++) {
    uint16_t want = zd__f32_to_bf16(u2f(in[i]));
    CHECK_MSG(out[i] == want, "f32 %08x -> bf16: device gives %04x, zd__f32_to_bf16 %04x", in[i],
              out[i], want);
  }
  CUDA_CHECK(cudaFree(d16));
  CUDA_CHECK(cudaFree(din));
  CUDA_CHECK(cudaFree(dout));
  free(h16);
  free(in);
  free(out);
  printf("convert: all f16 and bf16 inputs, %llu f32 -> bf16 inputs match the host conversions\n",
         (unsigned long long)n);
}

/* ---- shards ------------------------------------------------------------------------------- */

enum { A_MASTER, A_EXP_AVG, A_EXP_AVG_SQ, A_GRAD, A_PARAM, A_COUNT };
static const char *array_names[A_COUNT] = {"master", "exp_avg", "exp_avg_sq", "grad", "param"};

typedef struct shard {
  uint64_t n;
  zd__segment_t *segs;
  uint32_t nsegs;
  unsigned char *covered; /* n flags */
  int gdt, pdt;           /* pdt 0: no param output */
  uint32_t ngroups;
  float grad_scale;
  int specials;            /* per mille of grads drawn from the special values */
  int state_specials;      /* per mille of p, m, v drawn from subnormals and extremes */
  unsigned shift[A_COUNT]; /* elements off the 16-byte alignment of each device array */
  int groups_mode;         /* 0: inline; 1: d_groups filled by zd__cuda_groups_upload */
  int must_stride;         /* more tiles (statistics blocks) than one pass of the grid covers */
  char desc[320];
} shard_t;

static void add_segment(shard_t *sh, zd__segment_t s, uint32_t *cap) {
  if (sh->nsegs == *cap) {
    *cap = *cap ? 2 * *cap : 64;
    sh->segs = (zd__segment_t *)realloc(sh->segs, *cap * sizeof *sh->segs);
    CHECK_MSG(sh->segs, "out of host memory (%u segments)", *cap);
  }
  sh->segs[sh->nsegs++] = s;
}

/* Random segments over [0, n): gaps of any size (often none), lengths from 1 up (some 0), groups
 * mixed. */
static void make_segments(shard_t *sh) {
  uint32_t cap = 0;
  sh->segs = NULL;
  sh->covered = (unsigned char *)calloc(sh->n + 1, 1);
  CHECK(sh->covered);
  sh->nsegs = 0;
  uint64_t pos = rnd_below(3) == 0 ? rnd_below(5) : 0;
  uint64_t maxlen = sh->n < 64 ? 8 : sh->n < 4096 ? sh->n / 4 : sh->n / 8;
  while (pos < sh->n) {
    uint64_t len = 1 + (rnd_below(4) == 0 ? rnd_below(20) : rnd_below(maxlen + 1));
    if (len > sh->n - pos) len = sh->n - pos;
    if (rnd_below(50) == 0) { /* an empty segment now and then */
      zd__segment_t e = {pos, 0, (uint32_t)rnd_below(sh->ngroups)};
      add_segment(sh, e, &cap);
    }
    zd__segment_t s = {pos, len, (uint32_t)rnd_below(sh->ngroups)};
    add_segment(sh, s, &cap);
    for (uint64_t i = pos; i < pos + len; i++) sh->covered[i] = 1;
    pos += len;
    uint64_t r = rnd_below(8);
    pos += r < 4 ? 0 : r < 7 ? 1 + rnd_below(17) : 1 + rnd_below(sh->n / 8 + 1);
  }
}

static void shard_free(shard_t *sh) {
  free(sh->segs);
  free(sh->covered);
}

static int segment_of(const shard_t *sh, uint64_t i) {
  for (uint32_t s = 0; s < sh->nsegs; s++)
    if (i >= sh->segs[s].offset && i < sh->segs[s].offset + sh->segs[s].length) return (int)s;
  return -1;
}

/* Grads of one step over the range. specials (per mille) come from zeros, subnormals,
 * infinities, NaNs and extremes of the grad's own dtype. */
static void make_grads(void *g, int gdt, uint64_t n, int specials) {
  static const uint32_t sp32[] = {0x00000000, 0x80000000, 0x00000001, 0x807fffff, 0x00012345,
                                  0x7f800000, 0xff800000, 0x7fc00000, 0xffc12345, 0x7f800001,
                                  0x7f7fffff, 0x00800000, 0x3f800000};
  static const uint16_t sp16[] = {0x0000, 0x8000, 0x0001, 0x83ff, 0x0155, 0x7c00, 0xfc00,
                                  0x7e00, 0xfe3b, 0x7c01, 0x7bff, 0x0400, 0x3c00};
  static const uint16_t spbf[] = {0x0000, 0x8000, 0x0001, 0x807f, 0x0012, 0x7f80, 0xff80,
                                  0x7fc0, 0xffc1, 0x7f81, 0x7f7f, 0x0080, 0x3f80};
  const size_t nsp = sizeof sp32 / sizeof sp32[0];
  for (uint64_t i = 0; i < n; i++) {
    int special = (int)rnd_below(1000) < specials;
    float x = rnd_unit() * ldexpf(1.0f, -(int)rnd_below(12));
    uint32_t u = f2u(x);
    if (gdt == ZD_F32) {
      ((float *)g)[i] = special ? u2f(sp32[rnd_below(nsp)]) : x;
    } else if (gdt == ZD_BF16) {
      ((uint16_t *)g)[i] = special ? spbf[rnd_below(nsp)] : (uint16_t)(u >> 16);
    } else {
      uint16_t h = (uint16_t)(((u >> 16) & 0x8000) | ((5 + rnd_below(20)) << 10) | rnd_below(1024));
      ((uint16_t *)g)[i] = special ? sp16[rnd_below(nsp)] : h;
    }
  }
}

/* Host and device copies of every array of a shard, each with GUARD sentinel elements either
 * side of the range. */
typedef struct state {
  void *host[A_COUNT];   /* n + 2*GUARD elements each */
  void *dalloc[A_COUNT]; /* device allocations */
  void *dbase[A_COUNT];  /* dalloc + shift: where the guarded buffer starts */
  size_t esize[A_COUNT];
  uint64_t total; /* n + 2*GUARD */
} state_t;

static void *range_host(const state_t *s, int k) {
  return (char *)s->host[k] + GUARD * s->esize[k];
}
static void *range_dev(const state_t *s, int k) {
  return (char *)s->dbase[k] + GUARD * s->esize[k];
}

static void state_init(state_t *s, const shard_t *sh) {
  memset(s, 0, sizeof *s);
  s->total = sh->n + 2 * GUARD;
  for (int k = 0; k < A_COUNT; k++) {
    s->esize[k] = k < A_GRAD ? 4 : k == A_GRAD ? dtype_size(sh->gdt) : dtype_size(sh->pdt);
    if (!s->esize[k]) continue;
    size_t bytes = s->total * s->esize[k];
    s->host[k] = xmalloc(bytes);
    /* Sentinels everywhere: signalling-NaN bits that any arithmetic would change. */
    for (uint64_t j = 0; j < bytes / 2; j++)
      ((uint16_t *)s->host[k])[j] = (uint16_t)(0x7f81 + (j * 2654435761u >> 20) % 0x3e);
    s->dalloc[k] = dmalloc(bytes + MAX_SHIFT * s->esize[k]);
    s->dbase[k] = (char *)s->dalloc[k] + sh->shift[k] * s->esize[k];
  }
  static const uint32_t sub[] = {0x00000001, 0x00400000, 0x007fffff, 0x80000001, 0x00800000,
                                 0x80012345, 0x7f7fffff, 0x00000000, 0x80000000};
  const size_t nsub = sizeof sub / sizeof sub[0];
  for (uint64_t i = 0; i < sh->n; i++) {
    if (!sh->covered[i]) continue;
    float *p = (float *)range_host(s, A_MASTER), *m = (float *)range_host(s, A_EXP_AVG),
          *v = (float *)range_host(s, A_EXP_AVG_SQ);
    p[i] = rnd_unit();
    m[i] = rnd_unit() * 1e-2f;
    v[i] = fabsf(rnd_unit()) * 1e-4f;
    if ((int)rnd_below(1000) < sh->state_specials) p[i] = u2f(sub[rnd_below(nsub)]);
    if ((int)rnd_below(1000) < sh->state_specials) m[i] = u2f(sub[rnd_below(nsub)]);
    if ((int)rnd_below(1000) < sh->state_specials) v[i] = u2f(sub[rnd_below(nsub)] & 0x7fffffffu);
  }
  for (int k = 0; k < A_COUNT; k++)
    if (s->esize[k]) h2d(s->dbase[k], s->host[k], s->total * s->esize[k]);
}

static void state_free(state_t *s) {
  for (int k = 0; k < A_COUNT; k++) {
    free(s->host[k]);
    if (s->dalloc[k]) CUDA_CHECK(cudaFree(s->dalloc[k]));
  }
}

/* Guarded host buffers of the arrays the kernel writes, as they are on the device. */
typedef struct snapshot {
  void *buf[A_COUNT];
} snapshot_t;

static void snapshot_host(snapshot_t *c, const state_t *s) {
  for (int k = 0; k < A_COUNT; k++) {
    c->buf[k] = NULL;
    if (!s->esize[k]) continue;
    c->buf[k] = xmalloc(s->total * s->esize[k]);
    memcpy(c->buf[k], s->host[k], s->total * s->esize[k]);
  }
}

static void snapshot_dev(snapshot_t *c, const state_t *s) {
  for (int k = 0; k < A_COUNT; k++) {
    c->buf[k] = NULL;
    if (!s->esize[k]) continue;
    c->buf[k] = xmalloc(s->total * s->esize[k]);
    d2h(c->buf[k], s->dbase[k], s->total * s->esize[k]);
  }
}

static void snapshot_free(snapshot_t *c) {
  for (int k = 0; k < A_COUNT; k++) free(c->buf[k]);
}

/* want and got (guarded buffers of array k) must be equal: bitwise, or both NaN for f32. On a
 * difference, prints every detail that helps: the first few elements with their inputs, the
 * number of differences, the max abs/rel difference, then fails. */
static void expect_same(const shard_t *sh, const state_t *s, int k, const void *want,
                        const void *got, const snapshot_t *before, const void *grad_host,
                        const char *when, int step) {
  const int t = k == A_PARAM ? sh->pdt : k == A_GRAD ? sh->gdt : ZD_F32;
  const int strict = k == A_GRAD; /* never written: not even a NaN may change */
  const size_t sz = s->esize[k];
  if (memcmp(want, got, s->total * sz) == 0) return;
  uint64_t bad = 0, nan_only = 0;
  double max_abs = 0, max_rel = 0;
  int shown = 0;
  for (uint64_t j = 0; j < s->total; j++) {
    float w = to_f32(want, t, j), g = to_f32(got, t, j);
    if (raw_bits(want, t, j) == raw_bits(got, t, j)) continue;
    if (!strict && t == ZD_F32 && isnan(w) && isnan(g)) {
      nan_only++;
      continue;
    }
    bad++;
    double d = fabs((double)w - (double)g);
    if (d > max_abs || isnan(d)) max_abs = isnan(d) ? INFINITY : d;
    if (w != 0 && d / fabs((double)w) > max_rel) max_rel = d / fabs((double)w);
    if (shown++ < 6) {
      int64_t i = (int64_t)j - GUARD;
      int seg = i >= 0 && (uint64_t)i < sh->n ? segment_of(sh, (uint64_t)i) : -1;
      fprintf(stderr, "  %s[%lld]%s: want %.9g (%08x), got %.9g (%08x)", array_names[k],
              (long long)i, seg < 0 ? " (padding or guard: must not change)" : "", w,
              raw_bits(want, t, j), g, raw_bits(got, t, j));
      if (seg >= 0) {
        const zd__segment_t *sg = &sh->segs[seg];
        fprintf(stderr,
                "; segment %d [%llu, +%llu) group %u; inputs: grad %.9g (%08x), p %.9g "
                "(%08x), m %.9g (%08x), v %.9g (%08x)",
                seg, (unsigned long long)sg->offset, (unsigned long long)sg->length, sg->group,
                to_f32(grad_host, sh->gdt, (uint64_t)i), raw_bits(grad_host, sh->gdt, (uint64_t)i),
                ((float *)before->buf[A_MASTER])[j], f2u(((float *)before->buf[A_MASTER])[j]),
                ((float *)before->buf[A_EXP_AVG])[j], f2u(((float *)before->buf[A_EXP_AVG])[j]),
                ((float *)before->buf[A_EXP_AVG_SQ])[j],
                f2u(((float *)before->buf[A_EXP_AVG_SQ])[j]));
      }
      fputc('\n', stderr);
    }
  }
  nan_only_diffs += nan_only;
  if (!bad) return;
  fprintf(stderr,
          "step: GPU vs reference, %s, step %d, %s: %s differs in %llu of %llu elements "
          "(guards included); max abs diff %g, max rel diff %g\n",
          sh->desc, step, when, array_names[k], (unsigned long long)bad,
          (unsigned long long)s->total, max_abs, max_rel);
  exit(1);
}

static int expect_vec(const state_t *s, const shard_t *sh) {
  for (int k = 0; k < A_COUNT; k++)
    if (s->esize[k] && ((uintptr_t)range_dev(s, k) & 15u)) return 0;
  (void)sh;
  return 1;
}

static uint64_t cases_vec, cases_scalar, elems_checked;

/* The update formula and maximize of every group (test_variants); -1: hps' (TORCH113, no
 * maximize); ZD__ALL_UPDATES: group k takes formula k % 5 and maximize k / 5 % 2. */
#define ZD__ALL_UPDATES 99
static int variant_update = -1, variant_maximize;

static void group_consts(zd__adam_group_t *groups, uint32_t ngroups, int t) {
  for (uint32_t k = 0; k < ngroups; k++) {
    zd_group_t hp = hps[k % NGROUPS];
    if (variant_update == ZD__ALL_UPDATES) {
      hp.update = (zd_update_t)(k % 5);
      hp.maximize = k / 5 % 2;
    } else if (variant_update >= 0) {
      hp.update = (zd_update_t)variant_update;
      hp.maximize = variant_maximize;
    }
    hp.lr *= (1.0 + 0.25 * t) * (1.0 + 0.01 * (k / NGROUPS)); /* a scheduler; groups differ */
    zd__adam_group_init(&groups[k], &hp, (uint64_t)t);
  }
}

/* One shard through `steps` steps: the reference on the host, the kernel on the device, whole
 * guarded buffers compared after every step. */
static void run_shard(shard_t *sh, int steps) {
  state_t s;
  state_init(&s, sh);
  int vec = expect_vec(&s, sh);
  snprintf(sh->desc, sizeof sh->desc,
           "n=%llu nsegs=%u grad=%s param=%s groups=%u%s scale=%g shifts=%u,%u,%u,%u,%u (%s "
           "path) specials=%d/%d",
           (unsigned long long)sh->n, sh->nsegs, dtype_name(sh->gdt), dtype_name(sh->pdt),
           sh->ngroups, sh->groups_mode ? " in d_groups" : " inline", sh->grad_scale, sh->shift[0],
           sh->shift[1], sh->shift[2], sh->shift[3], sh->shift[4], vec ? "vector" : "scalar",
           sh->specials, sh->state_specials);
  if (vec)
    cases_vec++;
  else
    cases_scalar++;
  zd__cuda_layout_t *l = NULL;
  ZD_CHECK(zd__cuda_layout_create(sh->segs, sh->nsegs, sh->n, stream, &l, &gpu_err));
  if (sh->must_stride) {
    unsigned grid = 0;
    zd__cuda_layout_grids(l, &grid, NULL);
    CHECK_MSG(zd__cuda_layout_tiles(l) > grid,
              "%s: %llu tiles, grid of %u blocks: the shard is too small to make blocks stride",
              sh->desc, (unsigned long long)zd__cuda_layout_tiles(l), grid);
  }
  zd__adam_group_t *groups = (zd__adam_group_t *)xmalloc(sh->ngroups * sizeof *groups);
  zd__adam_group_t *d_groups = (zd__adam_group_t *)dmalloc(sh->ngroups * sizeof *groups);
  for (int t = 1; t <= steps; t++) {
    group_consts(groups, sh->ngroups, t);
    make_grads(range_host(&s, A_GRAD), sh->gdt, sh->n, sh->specials);
    h2d(s.dbase[A_GRAD], s.host[A_GRAD], s.total * s.esize[A_GRAD]);
    snapshot_t before;
    snapshot_host(&before, &s);

    zd__adam_args_t ra;
    memset(&ra, 0, sizeof ra);
    ra.state[ZD__STATE_MASTER] = (float *)range_host(&s, A_MASTER);
    ra.state[ZD__STATE_EXP_AVG] = (float *)range_host(&s, A_EXP_AVG);
    ra.state[ZD__STATE_EXP_AVG_SQ] = (float *)range_host(&s, A_EXP_AVG_SQ);
    ra.grad = range_host(&s, A_GRAD);
    ra.grad_dtype = (zd_dtype_t)sh->gdt;
    ra.param = sh->pdt ? range_host(&s, A_PARAM) : NULL;
    ra.param_dtype = sh->pdt ? (zd_dtype_t)sh->pdt : ZD_F32;
    ra.grad_scale = sh->grad_scale;
    ra.segs = sh->segs;
    ra.nsegs = sh->nsegs;
    ra.groups = groups;
    zd__adam_step_ref(&ra, 0, sh->n);

    zd__cuda_adam_args_t a;
    memset(&a, 0, sizeof a);
    a.state[ZD__STATE_MASTER] = (float *)range_dev(&s, A_MASTER);
    a.state[ZD__STATE_EXP_AVG] = (float *)range_dev(&s, A_EXP_AVG);
    a.state[ZD__STATE_EXP_AVG_SQ] = (float *)range_dev(&s, A_EXP_AVG_SQ);
    a.grad = range_dev(&s, A_GRAD);
    a.grad_dtype = (zd_dtype_t)sh->gdt;
    a.param = sh->pdt ? range_dev(&s, A_PARAM) : NULL;
    a.param_dtype = sh->pdt ? (zd_dtype_t)sh->pdt : ZD_F32;
    a.grad_scale = sh->grad_scale;
    a.ngroups = sh->ngroups;
    if (sh->groups_mode == 1) {
      ZD_CHECK(zd__cuda_groups_upload(d_groups, groups, sh->ngroups, stream, &gpu_err));
      a.d_groups = d_groups;
    } else {
      a.groups = groups;
    }
    ZD_CHECK(zd__cuda_adam_step(l, &a, stream, &gpu_err));
    sync_stream();
    snapshot_t got;
    snapshot_dev(&got, &s);
    for (int k = 0; k < A_COUNT; k++)
      if (k != A_GRAD && s.esize[k])
        expect_same(sh, &s, k, s.host[k], got.buf[k], &before, range_host(&s, A_GRAD),
                    "after "
                    "the update",
                    t);
    /* The device copy of the grads must be untouched too. */
    expect_same(sh, &s, A_GRAD, s.host[A_GRAD], got.buf[A_GRAD], &before, range_host(&s, A_GRAD),
                "grads (read only)", t);
    snapshot_free(&got);
    snapshot_free(&before);
    elems_checked += sh->n;
  }
  zd__cuda_layout_destroy(l);
  CUDA_CHECK(cudaFree(d_groups));
  free(groups);
  state_free(&s);
}

static const int gdts[3] = {ZD_F32, ZD_BF16, ZD_F16};
static const int pdts[3] = {ZD_F32, ZD_BF16, 0};
static const float scales[5] = {1.0f, 1.0f / 1024, 0.37f, 65536.0f, 3.0e-5f};

/* Multiprocessors of device 0: the kernels' grids grow with it (adam.cu: as many blocks of 256
 * threads per SM as fit, at most 8 for an SM's 2048 threads; each statistics block takes 64
 * statistics blocks per pass), so shards meant to make blocks stride are sized from it, and
 * run_shard / run_stats check that they do. */
static uint64_t sm_count(void) {
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return (uint64_t)sms;
}

/* Random alignment: half the shards fully aligned (vector path), a quarter shifted together,
 * a quarter each array its own way. */
static void random_shifts(shard_t *sh) {
  unsigned r = (unsigned)rnd_below(4), common = (unsigned)rnd_below(MAX_SHIFT);
  for (int k = 0; k < A_COUNT; k++)
    sh->shift[k] = r < 2 ? 0 : r == 2 ? common : (unsigned)rnd_below(MAX_SHIFT);
}

static void random_modes(shard_t *sh) {
  sh->grad_scale = scales[rnd_below(5)];
  sh->groups_mode = (int)rnd_below(2);
  sh->state_specials = rnd_below(4) == 0 ? 20 : 0;
  random_shifts(sh);
}

/* Every update formula (zd_update_t), with and without maximize, through the vector and scalar
 * paths, every grad dtype x param output, special grads included; then all of them at once, one
 * per group (more groups than travel inline, through d_groups). */
static void test_variants(void) {
  static const char *names[5] = {"torch113", "torch2", "torch2_cuda", "torch2_cuda_foreach",
                                 "torch2_cuda_fused"};
  for (int u = 0; u < 5; u++)
    for (int mx = 0; mx < 2; mx++) {
      variant_update = u;
      variant_maximize = mx;
      for (int gi = 0; gi < 3; gi++)
        for (int pi = 0; pi < 3; pi++) {
          shard_t sh;
          memset(&sh, 0, sizeof sh);
          sh.n = 3000 + rnd_below(300);
          sh.gdt = gdts[gi];
          sh.pdt = pdts[pi];
          sh.ngroups = NGROUPS;
          sh.specials = 10;
          random_modes(&sh);
          for (int k = 0; k < A_COUNT; k++) sh.shift[k] = (gi + pi) % 2 ? 3 + k : 0;
          make_segments(&sh);
          run_shard(&sh, 3);
          shard_free(&sh);
        }
      printf("variants: update %s%s: every grad dtype x param output ok\n", names[u],
             mx ? " with maximize" : "");
    }
  variant_update = ZD__ALL_UPDATES;
  shard_t sh;
  memset(&sh, 0, sizeof sh);
  sh.n = 40000;
  sh.gdt = ZD_BF16;
  sh.pdt = ZD_BF16;
  sh.ngroups = ZD__CUDA_GROUPS_INLINE + 11;
  sh.specials = 4;
  random_modes(&sh);
  sh.groups_mode = 1;
  make_segments(&sh);
  run_shard(&sh, 3);
  shard_free(&sh);
  variant_update = -1;
  printf("variants: every formula in one shard, a group each, through d_groups ok\n");
}

static void test_step(void) {
  uint64_t cases = 0;
  for (int gi = 0; gi < 3; gi++)
    for (int pi = 0; pi < 3; pi++)
      for (uint64_t n = 0; n <= 300; n++) {
        shard_t sh;
        memset(&sh, 0, sizeof sh);
        sh.n = n;
        sh.gdt = gdts[gi];
        sh.pdt = pdts[pi];
        sh.ngroups = NGROUPS;
        sh.specials = (int)rnd_below(3) * 40;
        random_modes(&sh);
        make_segments(&sh);
        run_shard(&sh, 2);
        shard_free(&sh);
        cases++;
      }
  printf("step: every length 0..300 x grad dtype x param output: %llu shards ok\n",
         (unsigned long long)cases);

  /* Every mode combination on one mid-sized shape, aligned and not. */
  for (int mode = 0; mode < 2 * 2; mode++) {
    shard_t sh;
    memset(&sh, 0, sizeof sh);
    sh.n = 5000 + rnd_below(100);
    sh.gdt = gdts[mode % 3];
    sh.pdt = pdts[(mode / 3) % 3];
    sh.ngroups = NGROUPS;
    sh.specials = 10;
    random_modes(&sh);
    sh.groups_mode = mode % 2;
    for (int k = 0; k < A_COUNT; k++) sh.shift[k] = mode / 2 ? 3 + k : 0;
    make_segments(&sh);
    run_shard(&sh, 3);
    shard_free(&sh);
    cases++;
  }
  printf("step: every groups mode, vector and scalar paths ok\n");

  /* More groups than travel inline: through d_groups. */
  for (int gi = 0; gi < 3; gi++) {
    shard_t sh;
    memset(&sh, 0, sizeof sh);
    sh.n = 70001;
    sh.gdt = gdts[gi];
    sh.pdt = pdts[gi];
    sh.ngroups = ZD__CUDA_GROUPS_INLINE + 37;
    sh.specials = 2;
    random_modes(&sh);
    sh.groups_mode = 1;
    make_segments(&sh);
    run_shard(&sh, 2);
    shard_free(&sh);
    cases++;
  }
  printf("step: %u groups through d_groups ok\n", ZD__CUDA_GROUPS_INLINE + 37);

  /* Large shards: many tiles, the biggest more than twice as many tiles as the grid has blocks
   * (every block strides). */
  uint64_t stride_n = (2 * 8 * sm_count() + 5) * ZD__CUDA_TILE + 4099;
  const uint64_t large[] = {4099, 65537, 1000003, stride_n > 9000011 ? stride_n : 9000011};
  for (int li = 0; li < 4; li++)
    for (int gi = 0; gi < 3; gi++)
      for (int pi = 0; pi < 3; pi++) {
        if (large[li] > 100000 && gi != pi) continue; /* the biggest only for f32/bf16 pairs */
        shard_t sh;
        memset(&sh, 0, sizeof sh);
        sh.n = large[li];
        sh.gdt = gdts[gi];
        sh.pdt = pdts[pi];
        sh.ngroups = NGROUPS;
        sh.specials = (int)rnd_below(2) * 5;
        random_modes(&sh);
        sh.must_stride = li == 3;
        make_segments(&sh);
        run_shard(&sh, large[li] > 100000 ? 2 : 3);
        shard_free(&sh);
        cases++;
      }
  printf(
      "step: %llu shards, %llu elements (%llu vector path, %llu scalar path), every one "
      "bitwise equal to the reference\n",
      (unsigned long long)cases, (unsigned long long)elems_checked, (unsigned long long)cases_vec,
      (unsigned long long)cases_scalar);
}

/* ---- errors -------------------------------------------------------------------------------- */

#define EXPECT_RC(expr, want)                                                                  \
  do {                                                                                         \
    memset(&gpu_err, 0, sizeof gpu_err);                                                       \
    int rc_ = (expr);                                                                          \
    CHECK_MSG(rc_ == (want), "%s returned %d (%s: %s), want %d", #expr, rc_, zd_err_name(rc_), \
              gpu_err.msg, (int)(want));                                                       \
    CHECK_MSG(gpu_err.msg[0], "%s: no message", #expr);                                        \
  } while (0)

static void test_errors(void) {
  zd__segment_t segs[2] = {{0, 100, 0}, {100, 50, 2}};
  zd__cuda_layout_t *l = NULL;
  ZD_CHECK(zd__cuda_layout_create(segs, 2, 150, stream, &l, &gpu_err));
  CHECK_INT_EQ(zd__cuda_layout_groups(l), 3);
  CHECK_U64_EQ(zd__cuda_layout_tiles(l), 2);
  CHECK_U64_EQ(zd__cuda_layout_stats_blocks(l), 1);
  CHECK_U64_EQ(zd__cuda_layout_elems(l), 150);
  float *d = (float *)dmalloc(4 * 150 * 4);
  zd__adam_group_t groups[3];
  group_consts(groups, 3, 1);
  zd__cuda_adam_args_t a;
  memset(&a, 0, sizeof a);
  a.state[ZD__STATE_MASTER] = d;
  a.state[ZD__STATE_EXP_AVG] = d + 150;
  a.state[ZD__STATE_EXP_AVG_SQ] = d + 300;
  a.grad = d + 450;
  a.grad_dtype = ZD_F32;
  a.grad_scale = 1;
  a.groups = groups;
  a.ngroups = 3;
  ZD_CHECK(zd__cuda_adam_step(l, &a, stream, &gpu_err));
  EXPECT_RC(zd__cuda_adam_step(l, &a, NULL, &gpu_err), -EINVAL);
  EXPECT_RC(zd__cuda_adam_step(l, &a, cudaStreamLegacy, &gpu_err), -EINVAL);
  a.ngroups = 2;
  EXPECT_RC(zd__cuda_adam_step(l, &a, stream, &gpu_err), -EINVAL);
  a.ngroups = ZD__CUDA_GROUPS_INLINE + 1;
  EXPECT_RC(zd__cuda_adam_step(l, &a, stream, &gpu_err), -EINVAL);
  a.ngroups = 3;
  a.grad_dtype = (zd_dtype_t)7;
  EXPECT_RC(zd__cuda_adam_step(l, &a, stream, &gpu_err), ZD_EDTYPE);
  a.grad_dtype = ZD_F32;
  a.param = d;
  a.param_dtype = ZD_F16;
  EXPECT_RC(zd__cuda_adam_step(l, &a, stream, &gpu_err), ZD_EDTYPE);
  a.param = NULL;
  a.state[ZD__STATE_EXP_AVG] = NULL;
  EXPECT_RC(zd__cuda_adam_step(l, &a, stream, &gpu_err), -EINVAL);
  zd__cuda_stats_t *rec = (zd__cuda_stats_t *)dmalloc(sizeof *rec);
  EXPECT_RC(zd__cuda_grad_stats(l, d, (zd_dtype_t)0, rec, 0, NULL, stream, &gpu_err), ZD_EDTYPE);
  EXPECT_RC(zd__cuda_grad_stats(l, NULL, ZD_F32, rec, 0, NULL, stream, &gpu_err), -EINVAL);
  EXPECT_RC(zd__cuda_grad_stats(l, d, ZD_F32, rec, 0, NULL, cudaStreamLegacy, &gpu_err), -EINVAL);
  EXPECT_RC(zd__cuda_groups_upload((zd__adam_group_t *)d, groups, 3, NULL, &gpu_err), -EINVAL);
  zd__cuda_layout_t *bad = NULL;
  zd__segment_t overlap[2] = {{0, 100, 0}, {99, 10, 0}};
  EXPECT_RC(zd__cuda_layout_create(overlap, 2, 200, stream, &bad, &gpu_err), -EINVAL);
  zd__segment_t past[1] = {{190, 11, 0}};
  EXPECT_RC(zd__cuda_layout_create(past, 1, 200, stream, &bad, &gpu_err), -EINVAL);
  CHECK(bad == NULL);
  sync_stream();
  zd__cuda_layout_destroy(l);
  zd__cuda_layout_destroy(NULL);
  CUDA_CHECK(cudaFree(rec));
  CUDA_CHECK(cudaFree(d));
  printf("errors: bad arguments refused with messages\n");
}

/* ---- statistics ---------------------------------------------------------------------------- */

typedef struct stats_ref {
  double *sums;
  uint64_t nblocks;
  uint64_t nonfinite;
  double total;
} stats_ref_t;

static void stats_reference(const shard_t *sh, const void *g, stats_ref_t *r) {
  r->nblocks = zd__stats_blocks(sh->n);
  r->sums = (double *)xmalloc((r->nblocks + 1) * sizeof(double));
  r->nonfinite = 0;
  zd__grad_stats_ref(g, (zd_dtype_t)sh->gdt, sh->segs, sh->nsegs, sh->n, 0, r->nblocks, r->sums,
                     &r->nonfinite);
  r->total = zd__grad_stats_sum(r->sums, r->nblocks);
}

static int same_double(double a, double b) {
  return d2u(a) == d2u(b) || (isnan(a) && isnan(b));
}

static void compare_blocks(const shard_t *sh, const stats_ref_t *r, const double *got) {
  for (uint64_t k = 0; k < r->nblocks; k++) {
    if (same_double(r->sums[k], got[k])) continue;
    uint64_t bad = 0;
    for (uint64_t j = k; j < r->nblocks; j++) bad += !same_double(r->sums[j], got[j]);
    fprintf(stderr,
            "stats: GPU vs reference, %s: block %llu sum %.17g (%016llx), want %.17g "
            "(%016llx), abs diff %g, rel diff %g; %llu of %llu blocks differ\n",
            sh->desc, (unsigned long long)k, got[k], (unsigned long long)d2u(got[k]), r->sums[k],
            (unsigned long long)d2u(r->sums[k]), fabs(got[k] - r->sums[k]),
            r->sums[k] != 0 ? fabs(got[k] - r->sums[k]) / fabs(r->sums[k]) : 0.0,
            (unsigned long long)bad, (unsigned long long)r->nblocks);
    exit(1);
  }
}

static void run_stats(shard_t *sh) {
  unsigned shift = rnd_below(2) ? 0 : (unsigned)rnd_below(MAX_SHIFT);
  snprintf(sh->desc, sizeof sh->desc, "n=%llu nsegs=%u grad=%s shift=%u specials=%d",
           (unsigned long long)sh->n, sh->nsegs, dtype_name(sh->gdt), shift, sh->specials);
  size_t gsz = dtype_size(sh->gdt);
  void *g = xmalloc((sh->n + 1) * gsz);
  make_grads(g, sh->gdt, sh->n, sh->specials);
  /* Padding holds non-finite values: they must not count. */
  for (uint64_t i = 0; i < sh->n; i++)
    if (!sh->covered[i] && rnd_below(2)) {
      if (sh->gdt == ZD_F32)
        ((uint32_t *)g)[i] = 0x7fc00000u;
      else
        ((uint16_t *)g)[i] = sh->gdt == ZD_BF16 ? 0x7f80 : 0x7c00;
    }
  stats_ref_t r;
  stats_reference(sh, g, &r);
  char *dalloc = (char *)dmalloc((sh->n + MAX_SHIFT) * gsz);
  void *dg = dalloc + shift * gsz;
  h2d(dg, g, sh->n * gsz);
  zd__cuda_layout_t *l = NULL;
  ZD_CHECK(zd__cuda_layout_create(sh->segs, sh->nsegs, sh->n, stream, &l, &gpu_err));
  if (sh->must_stride) {
    uint64_t per_pass = 0;
    zd__cuda_layout_grids(l, NULL, &per_pass);
    CHECK_MSG(r.nblocks > per_pass,
              "%s: %llu statistics blocks, %llu per pass of the grid: too small to make warps "
              "stride",
              sh->desc, (unsigned long long)r.nblocks, (unsigned long long)per_pass);
  }
  zd__cuda_stats_t *drec = (zd__cuda_stats_t *)dmalloc(sizeof *drec), rec;
  CUDA_CHECK(cudaMemsetAsync(drec, 0xff, sizeof *drec, stream)); /* overwritten: accumulate 0 */
  uint64_t tags[ZD__CUDA_TAGS] = {zd_test_rnd(), zd_test_rnd(), zd_test_rnd()};
  ZD_CHECK(zd__cuda_grad_stats(l, dg, (zd_dtype_t)sh->gdt, drec, 0, tags, stream, &gpu_err));
  double *got = (double *)xmalloc((r.nblocks + 1) * sizeof(double));
  if (r.nblocks) d2h(got, zd__cuda_layout_block_sums(l), r.nblocks * sizeof(double));
  d2h(&rec, drec, sizeof rec);
  compare_blocks(sh, &r, got);
  CHECK_MSG(rec.nonfinite == r.nonfinite, "%s: non-finite count %llu, want %llu", sh->desc,
            (unsigned long long)rec.nonfinite, (unsigned long long)r.nonfinite);
  CHECK_MSG(same_double(rec.sumsq, r.total),
            "%s: total %.17g (%016llx), want %.17g (%016llx) "
            "(the block sums agree: the order of their sum differs)",
            sh->desc, rec.sumsq, (unsigned long long)d2u(rec.sumsq), r.total,
            (unsigned long long)d2u(r.total));
  for (int j = 0; j < ZD__CUDA_TAGS; j++) CHECK_U64_EQ(rec.tags[j], tags[j]);
  CHECK_MSG(rec.check == zd__record_check(&rec), "%s: record not sealed (check %016llx)", sh->desc,
            (unsigned long long)rec.check);
  /* Accumulating the same range again: total + total, counts doubled, tags kept with NULL. */
  ZD_CHECK(zd__cuda_grad_stats(l, dg, (zd_dtype_t)sh->gdt, drec, 1, NULL, stream, &gpu_err));
  d2h(&rec, drec, sizeof rec);
  double twice = r.total + r.total;
  CHECK_MSG(same_double(rec.sumsq, twice), "%s: accumulated %.17g, want %.17g", sh->desc, rec.sumsq,
            twice);
  CHECK_U64_EQ(rec.nonfinite, 2 * r.nonfinite);
  for (int j = 0; j < ZD__CUDA_TAGS; j++) CHECK_U64_EQ(rec.tags[j], tags[j]);
  CHECK_MSG(rec.check == zd__record_check(&rec), "%s: accumulated record not sealed", sh->desc);
  zd__cuda_layout_destroy(l);
  CUDA_CHECK(cudaFree(drec));
  CUDA_CHECK(cudaFree(dalloc));
  free(got);
  free(r.sums);
  free(g);
}

static void test_stats(void) {
  uint64_t cases = 0;
  for (int gi = 0; gi < 3; gi++) {
    for (uint64_t n = 0; n <= 300; n += 1 + rnd_below(3)) {
      shard_t sh;
      memset(&sh, 0, sizeof sh);
      sh.n = n;
      sh.gdt = gdts[gi];
      sh.ngroups = NGROUPS;
      sh.specials = (int)rnd_below(3) * 20;
      make_segments(&sh);
      run_stats(&sh);
      shard_free(&sh);
      cases++;
    }
    /* Blocks of every kind; then block counts around the tree's chunks (2048 block sums) and
     * a thread's eight: one chunk exactly, one and a bit, two exactly, and more. */
    static const uint64_t sizes[] = {
        2047,       2048,    2049,        4096 + 7,        16 * 2048,         17 * 2048 - 1,
        65536 + 13, 1000003, 2048 * 2048, 2048 * 2049 + 1, 2048 * 2063 + 100, 2048 * 4096,
        5000011};
    for (size_t li = 0; li < sizeof sizes / sizeof sizes[0]; li++) {
      shard_t sh;
      memset(&sh, 0, sizeof sh);
      sh.n = sizes[li];
      sh.gdt = gdts[gi];
      sh.ngroups = NGROUPS;
      sh.specials = li % 2;
      make_segments(&sh);
      run_stats(&sh);
      shard_free(&sh);
      cases++;
    }
  }
  /* More statistics blocks than the grid covers in one pass (so warps stride): one range with
   * 16-bit grads, a few long segments and gaps. */
  {
    shard_t sh;
    memset(&sh, 0, sizeof sh);
    uint64_t stride_n = 8 * 64 * sm_count() * 3 / 2 * 2048 + 1;
    sh.n = stride_n > 140000001 ? stride_n : 140000001;
    sh.must_stride = 1;
    sh.gdt = ZD_BF16;
    sh.ngroups = NGROUPS;
    sh.specials = 0;
    make_segments(&sh);
    run_stats(&sh);
    shard_free(&sh);
    cases++;
  }
  printf(
      "stats: %llu ranges, block sums and totals bitwise equal to the reference, counts, "
      "accumulation and tags right\n",
      (unsigned long long)cases);
}

/* ---- pipeline ------------------------------------------------------------------------------ */

/* Two ranges (buckets) of one rank at world size 1, with loss scaling and clipping, driven as the
 * daemon's CUDA backend does: per step, stats of both ranges into one record, the record back to
 * the host (the one wait in the middle of a step), the host's decision from it, the update of both
 * ranges. The reference does what daemon/step/step.c does with the reference kernels. */
static void test_pipeline(void) {
  const int nb = 2;
  shard_t sh[2];
  state_t s[2];
  zd__cuda_layout_t *l[2];
  for (int b = 0; b < nb; b++) {
    memset(&sh[b], 0, sizeof sh[b]);
    sh[b].n = b == 0 ? 300007 : 12345;
    sh[b].gdt = b == 0 ? ZD_F16 : ZD_BF16;
    sh[b].pdt = ZD_BF16;
    sh[b].ngroups = NGROUPS;
    make_segments(&sh[b]);
    snprintf(sh[b].desc, sizeof sh[b].desc, "pipeline range %d: n=%llu grad=%s", b,
             (unsigned long long)sh[b].n, dtype_name(sh[b].gdt));
    state_init(&s[b], &sh[b]);
    ZD_CHECK(zd__cuda_layout_create(sh[b].segs, sh[b].nsegs, sh[b].n, stream, &l[b], &gpu_err));
  }
  zd_loss_scaler_t sc;
  memset(&sc, 0, sizeof sc);
  sc.enabled = 1;
  sc.initial_scale = 1024;
  sc.growth_factor = 2;
  sc.backoff_factor = 0.5;
  sc.growth_interval = 3;
  sc.hysteresis = 2;
  sc.min_scale = 1;
  zd__step_state_t hst;
  memset(&hst, 0, sizeof hst);
  zd__scaler_init(&hst.scaler, &sc);
  zd__decide_cfg_t cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.world_size = 1;
  cfg.grad_mean = 1;
  cfg.need_stats = 1;
  zd__cuda_stats_t *drec = (zd__cuda_stats_t *)dmalloc(sizeof *drec);
  int applied = 0, skipped = 0, clipped = 0;
  for (int t = 1; t <= 16; t++) {
    int overflow = t == 3 || t == 4 || t == 9; /* hysteresis 2: the second backs off */
    uint64_t tags[ZD__CUDA_TAGS] = {(uint64_t)t, 0x1234, 0x5678};
    /* Clipping off, never reached, always reached. */
    cfg.max_grad_norm = t % 3 == 0 ? 0.0 : t % 3 == 1 ? 1e30 : 1e-3;
    double sumsq = 0;
    uint64_t nonfinite = 0;
    for (int b = 0; b < nb; b++) {
      void *g = range_host(&s[b], A_GRAD);
      make_grads(g, sh[b].gdt, sh[b].n, 0);
      if (sh[b].gdt != ZD_F32) /* loss-scaled grads: larger magnitudes */
        for (uint64_t i = 0; i < sh[b].n; i++)
          ((uint16_t *)g)[i] += sh[b].gdt == ZD_F16 ? 0x1000 : 0x0500;
      if (overflow && b == t % 2) {
        uint64_t i = sh[b].segs[sh[b].nsegs / 2].offset;
        ((uint16_t *)g)[i] = sh[b].gdt == ZD_F16 ? 0x7c00 : 0x7f80;
      }
      h2d(s[b].dbase[A_GRAD], s[b].host[A_GRAD], s[b].total * s[b].esize[A_GRAD]);
      stats_ref_t r;
      stats_reference(&sh[b], g, &r);
      sumsq += r.total; /* step.c: *sumsq += zd__grad_stats_sum(...) per bucket */
      nonfinite += r.nonfinite;
      free(r.sums);
    }
    /* Host: the CPU step's decision (a world of one: 0 + this rank's record). */
    uint64_t host_step_before = hst.step;
    zd__decision_t hd;
    memset(&hd, 0, sizeof hd);
    zd__step_decide(&cfg, 0.0 + sumsq, nonfinite, &hst, &hd);
    zd__adam_group_t groups[NGROUPS];
    group_consts(groups, NGROUPS, (int)(host_step_before + 1));
    snapshot_t before[2];
    for (int b = 0; b < nb; b++) {
      snapshot_host(&before[b], &s[b]);
      if (!hd.applied) continue;
      zd__adam_args_t ra;
      memset(&ra, 0, sizeof ra);
      ra.state[ZD__STATE_MASTER] = (float *)range_host(&s[b], A_MASTER);
      ra.state[ZD__STATE_EXP_AVG] = (float *)range_host(&s[b], A_EXP_AVG);
      ra.state[ZD__STATE_EXP_AVG_SQ] = (float *)range_host(&s[b], A_EXP_AVG_SQ);
      ra.grad = range_host(&s[b], A_GRAD);
      ra.grad_dtype = (zd_dtype_t)sh[b].gdt;
      ra.param = range_host(&s[b], A_PARAM);
      ra.param_dtype = (zd_dtype_t)sh[b].pdt;
      ra.grad_scale = hd.grad_scale;
      ra.segs = sh[b].segs;
      ra.nsegs = sh[b].nsegs;
      ra.groups = groups;
      zd__adam_step_ref(&ra, 0, sh[b].n);
    }
    /* Device: the statistics, then the record on the host, where the daemon decides: the record
     * must hold the reference's bits, so that the decision is the host's. */
    for (int b = 0; b < nb; b++)
      ZD_CHECK(zd__cuda_grad_stats(l[b], range_dev(&s[b], A_GRAD), (zd_dtype_t)sh[b].gdt, drec,
                                   b > 0, tags, stream, &gpu_err));
    zd__cuda_stats_t rec;
    d2h(&rec, drec, sizeof rec);
    CHECK_MSG(same_double(rec.sumsq, sumsq) && rec.nonfinite == nonfinite &&
                  !memcmp(rec.tags, tags, sizeof tags) && rec.check == zd__record_check(&rec),
              "pipeline step %d: device record sumsq=%.17g nonfinite=%llu tags %llu/%llx/%llx; "
              "host sumsq=%.17g nonfinite=%llu",
              t, rec.sumsq, (unsigned long long)rec.nonfinite, (unsigned long long)rec.tags[0],
              (unsigned long long)rec.tags[1], (unsigned long long)rec.tags[2], sumsq,
              (unsigned long long)nonfinite);
    for (int b = 0; hd.applied && b < nb; b++) {
      zd__cuda_adam_args_t a;
      memset(&a, 0, sizeof a);
      a.state[ZD__STATE_MASTER] = (float *)range_dev(&s[b], A_MASTER);
      a.state[ZD__STATE_EXP_AVG] = (float *)range_dev(&s[b], A_EXP_AVG);
      a.state[ZD__STATE_EXP_AVG_SQ] = (float *)range_dev(&s[b], A_EXP_AVG_SQ);
      a.grad = range_dev(&s[b], A_GRAD);
      a.grad_dtype = (zd_dtype_t)sh[b].gdt;
      a.param = range_dev(&s[b], A_PARAM);
      a.param_dtype = (zd_dtype_t)sh[b].pdt;
      a.grad_scale = hd.grad_scale;
      a.groups = groups;
      a.ngroups = NGROUPS;
      ZD_CHECK(zd__cuda_adam_step(l[b], &a, stream, &gpu_err));
    }
    CHECK_MSG(hd.overflow == overflow, "pipeline step %d: overflow %d, injected %d", t, hd.overflow,
              overflow);
    for (int b = 0; b < nb; b++) {
      snapshot_t got;
      snapshot_dev(&got, &s[b]);
      for (int k = 0; k < A_COUNT; k++)
        if (k != A_GRAD)
          expect_same(&sh[b], &s[b], k, s[b].host[k], got.buf[k], &before[b],
                      range_host(&s[b], A_GRAD),
                      hd.applied ? "pipeline, applied" : "pipeline, skipped", t);
      snapshot_free(&got);
      snapshot_free(&before[b]);
    }
    applied += hd.applied;
    skipped += hd.skip;
    clipped += hd.applied && hd.clip_coef < 1.0;
  }
  CHECK_MSG(skipped == 3 && applied == 13 && clipped >= 3,
            "pipeline: %d applied, %d skipped, "
            "%d clipped; expected 13, 3 and some",
            applied, skipped, clipped);
  for (int b = 0; b < nb; b++) {
    zd__cuda_layout_destroy(l[b]);
    state_free(&s[b]);
    shard_free(&sh[b]);
  }
  CUDA_CHECK(cudaFree(drec));
  printf(
      "pipeline: 16 steps (%d applied, %d clipped, %d skipped for overflow), device records and "
      "updates bitwise equal to the CPU step's\n",
      applied, clipped, skipped);
}

/* ---- past 2^32 elements ------------------------------------------------------------------ */

/* One range of more than 2^32 elements whose segments lie around offset 2^32, so that a 32-bit
 * index anywhere in the layout, the update or the statistics would wrap to the start of the
 * range. The update touches covered elements only: master, moments and params are small windows
 * (with guards), passed to the kernel as range pointers `wlo` elements before them (the kernel
 * never forms an address outside the window). The statistics may read any gradient of the range
 * (adam_cuda.h): the bf16 grads are allocated in full (8 GiB), their padding NaN (it must not
 * count); the test says it is skipped where the device lacks the memory. */
static void *shifted(void *p, uint64_t elems, size_t esize) {
  return (void *)((uintptr_t)p - (uintptr_t)(elems * esize)); /* modular: never dereferenced */
}

static void test_huge(void) {
  /* wlo: a multiple of 8 (the windows keep the vector path's alignment), not of 2048 (statistics
   * blocks straddle the window's edges). */
  const uint64_t wlo = ((uint64_t)1 << 32) - 20008, wn = 45011, n = wlo + wn + 1001;
  const size_t gbytes = n * 2;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < gbytes + ((size_t)1 << 30)) {
    printf("huge: skipped, %.1f GiB of device memory free, %.1f GiB needed\n",
           (double)free_b / (1 << 30), (double)(gbytes + ((size_t)1 << 30)) / (1 << 30));
    return;
  }
  uint16_t *dgrad = (uint16_t *)dmalloc(gbytes);
  CUDA_CHECK(cudaMemsetAsync(dgrad, 0xff, gbytes, stream)); /* bf16 NaN */

  for (int pass = 0; pass < 3; pass++) {
    shard_t sh;
    memset(&sh, 0, sizeof sh);
    sh.n = wn;
    sh.gdt = ZD_BF16;
    sh.pdt = pdts[pass]; /* f32, bf16, none */
    sh.ngroups = NGROUPS;
    sh.specials = 10;
    sh.grad_scale = 0.37f;
    for (int k = 0; k < A_COUNT; k++) sh.shift[k] = k == A_GRAD || pass != 1 ? 0 : 3;
    make_segments(&sh);
    /* The layout's segments: the window's, moved to wlo. */
    zd__segment_t *segs = (zd__segment_t *)xmalloc((sh.nsegs + 1) * sizeof *segs);
    for (uint32_t s = 0; s < sh.nsegs; s++) {
      segs[s] = sh.segs[s];
      segs[s].offset += wlo;
    }
    state_t s;
    state_init(&s, &sh);
    int vec = expect_vec(&s, &sh);
    snprintf(sh.desc, sizeof sh.desc,
             "n=%llu, window [%llu, +%llu) nsegs=%u grad=bf16 param=%s (%s path)",
             (unsigned long long)n, (unsigned long long)wlo, (unsigned long long)wn, sh.nsegs,
             dtype_name(sh.pdt), vec ? "vector" : "scalar");
    zd__cuda_layout_t *l = NULL;
    ZD_CHECK(zd__cuda_layout_create(segs, sh.nsegs, n, stream, &l, &gpu_err));
    zd__adam_group_t groups[NGROUPS];
    for (int t = 1; t <= 2; t++) {
      group_consts(groups, NGROUPS, t);
      make_grads(range_host(&s, A_GRAD), ZD_BF16, wn, sh.specials);
      /* The window's grads with their guards (NaN sentinels) into the full array. */
      h2d(dgrad + wlo - GUARD, s.host[A_GRAD], s.total * 2);
      snapshot_t before;
      snapshot_host(&before, &s);

      /* Statistics: the reference over the blocks the window touches, laid out from the first
       * of them, so that blocks and lanes fall as in the range; every other block is 0. */
      const uint64_t k0 = wlo / ZD__STATS_BLOCK, nblocks = zd__stats_blocks(n);
      const uint64_t k1 = zd__stats_blocks(wlo + wn);
      const uint64_t end = k1 * ZD__STATS_BLOCK < n ? k1 * ZD__STATS_BLOCK : n;
      const uint64_t span = end - k0 * ZD__STATS_BLOCK;
      uint16_t *sg = (uint16_t *)xmalloc(span * 2);
      for (uint64_t i = 0; i < span; i++) sg[i] = 0xffff;
      memcpy(sg + (wlo - k0 * ZD__STATS_BLOCK), range_host(&s, A_GRAD), wn * 2);
      zd__segment_t *ssegs = (zd__segment_t *)xmalloc((sh.nsegs + 1) * sizeof *ssegs);
      for (uint32_t j = 0; j < sh.nsegs; j++) {
        ssegs[j] = segs[j];
        ssegs[j].offset -= k0 * ZD__STATS_BLOCK;
      }
      double *want = (double *)calloc(nblocks, sizeof(double));
      double *got = (double *)xmalloc(nblocks * sizeof(double));
      CHECK(want);
      uint64_t nonfinite = 0;
      zd__grad_stats_ref(sg, ZD_BF16, ssegs, sh.nsegs, span, 0, k1 - k0, want + k0, &nonfinite);
      const double total = zd__grad_stats_sum(want, nblocks);
      zd__cuda_stats_t *drec = (zd__cuda_stats_t *)dmalloc(sizeof *drec), rec;
      ZD_CHECK(zd__cuda_grad_stats(l, dgrad, ZD_BF16, drec, 0, NULL, stream, &gpu_err));
      d2h(got, zd__cuda_layout_block_sums(l), nblocks * sizeof(double));
      d2h(&rec, drec, sizeof rec);
      for (uint64_t k = 0; k < nblocks; k++)
        CHECK_MSG(same_double(got[k], want[k]),
                  "huge, %s, step %d: block %llu sum %.17g (%016llx), want %.17g (%016llx)",
                  sh.desc, t, (unsigned long long)k, got[k], (unsigned long long)d2u(got[k]),
                  want[k], (unsigned long long)d2u(want[k]));
      CHECK_MSG(rec.nonfinite == nonfinite, "huge, %s: non-finite count %llu, want %llu", sh.desc,
                (unsigned long long)rec.nonfinite, (unsigned long long)nonfinite);
      CHECK_MSG(same_double(rec.sumsq, total), "huge, %s: total %.17g, want %.17g", sh.desc,
                rec.sumsq, total);
      CUDA_CHECK(cudaFree(drec));
      free(want);
      free(got);
      free(ssegs);
      free(sg);

      /* The update. */
      zd__adam_args_t ra;
      memset(&ra, 0, sizeof ra);
      ra.state[ZD__STATE_MASTER] = (float *)range_host(&s, A_MASTER);
      ra.state[ZD__STATE_EXP_AVG] = (float *)range_host(&s, A_EXP_AVG);
      ra.state[ZD__STATE_EXP_AVG_SQ] = (float *)range_host(&s, A_EXP_AVG_SQ);
      ra.grad = range_host(&s, A_GRAD);
      ra.grad_dtype = ZD_BF16;
      ra.param = sh.pdt ? range_host(&s, A_PARAM) : NULL;
      ra.param_dtype = sh.pdt ? (zd_dtype_t)sh.pdt : ZD_F32;
      ra.grad_scale = sh.grad_scale;
      ra.segs = sh.segs; /* the window's own offsets: the same elements */
      ra.nsegs = sh.nsegs;
      ra.groups = groups;
      zd__adam_step_ref(&ra, 0, wn);
      zd__cuda_adam_args_t a;
      memset(&a, 0, sizeof a);
      a.state[ZD__STATE_MASTER] = (float *)shifted(range_dev(&s, A_MASTER), wlo, 4);
      a.state[ZD__STATE_EXP_AVG] = (float *)shifted(range_dev(&s, A_EXP_AVG), wlo, 4);
      a.state[ZD__STATE_EXP_AVG_SQ] = (float *)shifted(range_dev(&s, A_EXP_AVG_SQ), wlo, 4);
      a.grad = dgrad;
      a.grad_dtype = ZD_BF16;
      a.param = sh.pdt ? shifted(range_dev(&s, A_PARAM), wlo, s.esize[A_PARAM]) : NULL;
      a.param_dtype = sh.pdt ? (zd_dtype_t)sh.pdt : ZD_F32;
      a.grad_scale = sh.grad_scale;
      a.groups = groups;
      a.ngroups = NGROUPS;
      ZD_CHECK(zd__cuda_adam_step(l, &a, stream, &gpu_err));
      sync_stream();
      snapshot_t after;
      snapshot_dev(&after, &s);
      for (int k = 0; k < A_COUNT; k++)
        if (k != A_GRAD && s.esize[k])
          expect_same(&sh, &s, k, s.host[k], after.buf[k], &before, range_host(&s, A_GRAD),
                      "huge range", t);
      snapshot_free(&after);
      snapshot_free(&before);
      elems_checked += wn;
    }
    zd__cuda_layout_destroy(l);
    state_free(&s);
    free(segs);
    shard_free(&sh);
  }
  CUDA_CHECK(cudaFree(dgrad));
  printf(
      "huge: a range of %llu elements (past 2^32), segments around 2^32: statistics and update "
      "(f32, bf16 and no params; vector and scalar paths) bitwise equal to the reference\n",
      (unsigned long long)n);
}

int main(void) {
  gpu_or_skip("test_adam_cuda");
  zd__err_t perr;
  memset(&perr, 0, sizeof perr);
  if (zd__cuda_kernels_preload(&perr) != ZD_OK) {
    fprintf(stderr, "FAIL: zd__cuda_kernels_preload: %s\n", perr.msg);
    return 1;
  }
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  test_convert();
  test_errors();
  test_stats();
  test_pipeline();
  test_step();
  test_variants();
  test_huge();
  CUDA_CHECK(cudaStreamDestroy(stream));
  printf(
      "all outputs bitwise equal to the reference: max abs diff 0, max rel diff 0 (%llu f32 "
      "NaN outputs differed only in payload or sign, as adam_cuda.h allows)\n",
      (unsigned long long)nan_only_diffs);
  printf("PASS\n");
  return 0;
}
