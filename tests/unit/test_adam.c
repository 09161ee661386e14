/* Unit tests of the optimizer kernels (kernels/adam.h).
 *
 * The scalar reference is the specification, pinned to torch by a few golden steps computed with
 * torch.optim.AdamW / Adam 1.13.1 (foreach=False). Every wide path this CPU runs is then compared
 * with the reference bit for bit (memcmp-equal, or NaN on both sides where a NaN is produced) on
 * random shards: segment lists with gaps and boundaries anywhere, groups with different
 * hyperparameters, every grad dtype x param output, special grad values, consecutive steps, and
 * a call split at arbitrary points. Padding and guard elements must keep their sentinel bits.
 * The gradient statistics must be bitwise equal across ISAs and across block splits. All inputs
 * come from a fixed-seed PRNG, so a failure reproduces.
 */
#include <errno.h>
#include <immintrin.h>
#include <math.h>

#include "adam.h"
#include "check.h"

/* ---- helpers ------------------------------------------------------------------------------ */

/* A shard's dtype, or "none" for no param output (pdt 0). */
static const char *dtype_name(zd_dtype_t t) {
  return t ? zd_dtype_name(t) : "none";
}

static float to_f32(const void *buf, zd_dtype_t t, uint64_t i) {
  if (t == ZD_F32) return ((const float *)buf)[i];
  uint16_t h = ((const uint16_t *)buf)[i];
  return t == ZD_BF16 ? zd__bf16_to_f32(h) : zd__f16_to_f32(h);
}

/* Paths under test: every wide ISA this CPU runs. */
static zd__isa_t isas[3];
static int nisas;

/* ---- conversions ------------------------------------------------------------------------- */

__attribute__((target("f16c"))) static float f16c_to_f32(uint16_t h) {
  return _cvtsh_ss(h);
}

static void test_f16(void) {
  static const struct {
    uint16_t h;
    uint32_t f;
  } known[] = {
      {0x0000, 0x00000000}, {0x8000, 0x80000000}, {0x3c00, 0x3f800000},
      {0xc000, 0xc0000000}, {0x7bff, 0x477fe000}, /* 65504 */
      {0x0400, 0x38800000},                       /* smallest normal 2^-14 */
      {0x0001, 0x33800000},                       /* smallest subnormal 2^-24 */
      {0x03ff, 0x387fc000},                       /* largest subnormal */
      {0x8200, 0xb8000000},                       /* -2^-15 */
      {0x7c00, 0x7f800000}, {0xfc00, 0xff800000}, {0x7e00, 0x7fc00000},
      {0x7c01, 0x7fc02000}, /* signalling NaN comes out quiet, payload kept */
      {0xfe01, 0xffc02000},
  };
  for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
    CHECK_MSG(f2u(zd__f16_to_f32(known[i].h)) == known[i].f, "f16 %04x -> %08x, want %08x",
              known[i].h, f2u(zd__f16_to_f32(known[i].h)), known[i].f);
  if (!__builtin_cpu_supports("f16c")) {
    printf("f16: known values ok (no F16C to compare all inputs with)\n");
    return;
  }
  for (uint32_t h = 0; h < 65536; h++) {
    uint32_t want = f2u(f16c_to_f32((uint16_t)h)), got = f2u(zd__f16_to_f32((uint16_t)h));
    CHECK_MSG(want == got, "f16 %04x: zd__f16_to_f32 gives %08x, vcvtph2ps %08x", h, got, want);
  }
  printf("f16: all 65536 inputs match vcvtph2ps\n");
}

static void test_bf16(void) {
  static const struct {
    uint32_t f;
    uint16_t h;
  } cases[] = {
      {0x3f800000, 0x3f80}, {0x3f808000, 0x3f80}, /* tie, even below: down */
      {0x3f818000, 0x3f82},                       /* tie, odd below: up */
      {0x3f808001, 0x3f81}, {0x3f807fff, 0x3f80}, {0xbf818000, 0xbf82},
      {0x7f7fffff, 0x7f80}, /* max float rounds to inf */
      {0x7f800000, 0x7f80}, {0xff800000, 0xff80}, {0x7fc00000, 0x7fc0},
      {0xffc00001, 0x7fc0}, {0x7f800001, 0x7fc0}, /* any NaN -> 0x7fc0, as torch */
      {0x00008000, 0x0000}, {0x00018000, 0x0002}, {0x80000000, 0x8000},
      {0x007fffff, 0x0080},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    CHECK_MSG(zd__f32_to_bf16(u2f(cases[i].f)) == cases[i].h, "bf16 of %08x: %04x, want %04x",
              cases[i].f, zd__f32_to_bf16(u2f(cases[i].f)), cases[i].h);
  printf("bf16: rounding cases ok\n");
}

static void test_isa(void) {
  zd__isa_t best = zd__isa_detect();
  CHECK_INT_EQ(zd__isa_parse("auto"), best);
  CHECK_INT_EQ(zd__isa_parse("bogus"), -1);
  for (int isa = ZD__ISA_SCALAR; isa <= ZD__ISA_BEST; isa++)
    CHECK_INT_EQ(zd__isa_parse(zd__isa_name((zd__isa_t)isa)), isa);
  CHECK(zd__adam_impl(ZD__ISA_SCALAR) == zd__adam_step_ref);
  for (int isa = ZD__ISA_AVX2; isa <= (int)best; isa++) isas[nisas++] = (zd__isa_t)isa;
  printf("isa: best %s; testing", zd__isa_name(best));
  for (int i = 0; i < nisas; i++) printf(" %s", zd__isa_name(isas[i]));
  printf(nisas ? " against the reference\n" : " nothing but the reference\n");
}

/* ---- golden steps from torch --------------------------------------------------------------- */

/* 20 elements, 5 steps, lr changing every step. Produced by torch 1.13.1:
 *   p = torch.tensor([(i - 8) / 32 for i in range(20)], requires_grad=True)
 *   opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
 *                           foreach=False)   # or torch.optim.Adam(..., weight_decay=0.1)
 *   for t in range(1, 6):
 *     opt.param_groups[0]['lr'] = 1e-3 * (1 + 0.5 * t)
 *     p.grad = torch.tensor([((i * 7 + t * 13) % 17 - 8) / 16 for i in range(20)])
 *     opt.step()
 * and the bits of p, exp_avg, exp_avg_sq printed. */
#define GOLDEN_N 20
static const uint32_t golden_adamw[3][GOLDEN_N] = {
    {0xbe817272, 0xbe619597, 0xbe40fa7c, 0xbe1b88af, 0xbdfeb8e4, 0xbdca0b89, 0xbd66fd20,
     0xbd0f30db, 0x3b1e17c4, 0x3d155172, 0x3d64bafe, 0x3dc8f35f, 0x3dfec234, 0x3e205d3f,
     0x3e41ac26, 0x3e5a49fb, 0x3e81423b, 0x3e8e84da, 0x3e9f2c81, 0x3eaf7a0d},
    {0x3c030553, 0x3c37731a, 0x3cdbdcf0, 0xbd865215, 0x3d13f099, 0x3d0996fb, 0xbd269056,
     0x3d56c41e, 0xbd23ce85, 0xbcc779a4, 0x3d726ca0, 0xbc76eac8, 0xbc9028a2, 0xbc6be37e,
     0x3aa31a60, 0xbcafe1db, 0x3c2c6bd0, 0x3c030553, 0x3c37731a, 0x3cdbdcf0},
    {0x39f56984, 0x39f7252d, 0x39d0974c, 0x3a1733c8, 0x39d8a1b1, 0x3a03e435, 0x39eae455,
     0x39eb34f4, 0x3a03c5d9, 0x39d8ad35, 0x3a174bdc, 0x39d05db6, 0x39f77b07, 0x39f5203a,
     0x39ca6a0d, 0x3a238345, 0x39ca4781, 0x39f56984, 0x39f7252d, 0x39d0974c},
};
static const uint32_t golden_adam[3][GOLDEN_N] = {
    {0xbe810101, 0xbe60efdf, 0xbe402529, 0xbe1b19d7, 0xbdfe02a5, 0xbdc975af, 0xbd666889,
     0xbd0ea8e3, 0x3b1dde86, 0x3d0ed2cb, 0x3d642a11, 0x3dc864d8, 0x3dfddac1, 0x3e1fddfc,
     0x3e40f0ed, 0x3e59d555, 0x3e80e193, 0x3e8e0c71, 0x3e9ebd24, 0x3eaeb6a7},
    {0xbb186da7, 0x3b13794e, 0x3c9cdfcd, 0xbd9344c2, 0x3cfe9ebe, 0x3cf2cc52, 0xbd308606,
     0x3d51452c, 0xbd239c16, 0xbcbcb164, 0x3d7c5b68, 0xbc36370e, 0xbc4da9db, 0xbc02baab,
     0x3c1241ff, 0xbc4f6f02, 0x3caacf42, 0x3c9eff8c, 0x3cc48524, 0x3d2766d6},
    {0x39f3ee8c, 0x39f43cd9, 0x39ccb0b0, 0x3a1d96eb, 0x39d44f75, 0x3a01e050, 0x39ee9f74,
     0x39e95a89, 0x3a03c729, 0x39d79b14, 0x3a19bb82, 0x39ce3a1b, 0x39f59990, 0x39f3d1df,
     0x39ca3d75, 0x3a244e72, 0x39cdbb8d, 0x39fb38b1, 0x39fff777, 0x39dcb7aa},
};

static void test_golden(int optimizer, double wd, const uint32_t want[3][GOLDEN_N]) {
  float p[GOLDEN_N], m[GOLDEN_N] = {0}, v[GOLDEN_N] = {0}, g[GOLDEN_N];
  for (int i = 0; i < GOLDEN_N; i++) p[i] = (float)((i - 8) / 32.0);
  zd__segment_t seg = {.offset = 0, .length = GOLDEN_N, .group = 0};
  for (int t = 1; t <= 5; t++) {
    zd_group_t hp = {.lr = 1e-3 * (1 + 0.5 * t),
                     .beta1 = 0.9,
                     .beta2 = 0.999,
                     .eps = 1e-8,
                     .weight_decay = wd,
                     .optimizer = optimizer};
    zd__adam_group_t c;
    zd__adam_group_init(&c, &hp, (uint64_t)t);
    for (int i = 0; i < GOLDEN_N; i++) g[i] = (float)(((i * 7 + t * 13) % 17 - 8) / 16.0);
    zd__adam_args_t a = {.state[ZD__STATE_MASTER] = p,
                         .state[ZD__STATE_EXP_AVG] = m,
                         .state[ZD__STATE_EXP_AVG_SQ] = v,
                         .grad = g,
                         .grad_dtype = ZD_F32,
                         .grad_scale = 1.0f,
                         .segs = &seg,
                         .nsegs = 1,
                         .groups = &c};
    zd__adam_step_ref(&a, 0, GOLDEN_N);
  }
  const float *got[3] = {p, m, v};
  static const char *names[3] = {"param", "exp_avg", "exp_avg_sq"};
  for (int k = 0; k < 3; k++)
    for (int i = 0; i < GOLDEN_N; i++)
      CHECK_MSG(f2u(got[k][i]) == want[k][i],
                "%s vs torch: %s[%d] = %.9g (%08x), torch %.9g (%08x)",
                optimizer == ZD_ADAMW ? "AdamW" : "Adam", names[k], i, got[k][i], f2u(got[k][i]),
                u2f(want[k][i]), want[k][i]);
}

/* ---- random shards ------------------------------------------------------------------------- */

#define GUARD   24 /* sentinel elements on each side of a range */
#define NGROUPS 10

/* Hyperparameters: both optimizers, with and without weight decay, minimizing and maximizing (the
 * wide paths must match the reference with maximize's negated constants too), beta1 on either side
 * of TORCH2's lerp switch (1 - beta1 < 0.5 or not) and beta1 = 0. run_shard gives each group one of
 * the four formulas (update x sqrt_mode), a different one at each step, and in half of the shards
 * also amsgrad on some steps and off on others (max_exp_avg_sq must then be left alone). */
#define HP(lr_, b1, b2, eps_, wd, opt, max)                                                 \
  {                                                                                         \
    .lr = lr_, .beta1 = b1, .beta2 = b2, .eps = eps_, .weight_decay = wd, .optimizer = opt, \
    .maximize = max                                                                         \
  }
static const zd_group_t hps[NGROUPS] = {
    HP(1e-3, 0.9, 0.999, 1e-8, 0.01, ZD_ADAMW, 0), HP(3e-4, 0.9, 0.95, 1e-8, 0, ZD_ADAMW, 0),
    HP(1e-2, 0.8, 0.99, 1e-6, 0.1, ZD_ADAM, 0),    HP(5e-4, 0.9, 0.999, 1e-8, 0, ZD_ADAM, 0),
    HP(0.1, 0.5, 0.6, 1e-3, 0.5, ZD_ADAMW, 0),     HP(1e-3, 0.9, 0.999, 1e-8, 0.01, ZD_ADAMW, 1),
    HP(1e-2, 0.8, 0.99, 1e-6, 0.1, ZD_ADAM, 1),    HP(5e-4, 0.9, 0.999, 1e-8, 0, ZD_ADAM, 1),
    HP(1e-3, 0.0, 0.0, 1e-8, 0.01, ZD_ADAMW, 1),   HP(1e-3, 0.3, 0.5, 1e-8, 0.5, ZD_ADAM, 0),
};

/* The formula of group k at step t of a shard whose draw is r: every (update, sqrt_mode) of the
 * CPU formulas, the three CUDA formulas (which the wide paths hand to the reference, segment by
 * segment), and amsgrad too when the shard has max_exp_avg_sq (ams). */
static void set_variant(zd_group_t *hp, int k, int t, unsigned r, int ams) {
  unsigned f = ((unsigned)k + (unsigned)t + r) % (ams ? 14 : 7), b = f % 7;
  static const zd_update_t cuda[3] = {ZD_UPDATE_TORCH2_CUDA, ZD_UPDATE_TORCH2_CUDA_FOREACH,
                                      ZD_UPDATE_TORCH2_CUDA_FUSED};
  hp->update = b >= 4 ? cuda[b - 4] : b & 2 ? ZD_UPDATE_TORCH2 : ZD_UPDATE_TORCH113;
  hp->sqrt_mode = b < 4 && (b & 1) ? ZD_SQRT_MKL_EX : ZD_SQRT_EXACT;
  hp->amsgrad = f >= 7;
}

typedef struct {
  uint64_t n;
  zd__segment_t *segs;
  uint32_t nsegs;
  unsigned char *covered; /* n flags */
  zd_dtype_t gdt, pdt;    /* pdt 0: no param output */
  float grad_scale;
  int specials; /* per mille of grads drawn from the special values */
  char desc[160];
} shard_t;

/* Optimizer state of a shard, each array with GUARD elements either side and shifted by `shift`
 * elements off 64-byte alignment, so the wide paths' alignment heads see every phase. */
typedef struct {
  float *buf[4]; /* master, exp_avg, exp_avg_sq, max_exp_avg_sq allocations */
  void *pbuf;
  float *x[4];
  void *param;
} state_t;

/* n elements plus guards and room for the shift, 64-byte aligned. */
static void *guarded_alloc(uint64_t n, size_t size) {
  void *p = aligned_alloc(64, ((n + 2 * GUARD + 16) * size + 63) / 64 * 64);
  CHECK(p);
  return p;
}

static void state_init(state_t *s, const shard_t *sh, unsigned shift) {
  size_t psz = sh->pdt ? zd_dtype_size(sh->pdt) : 0;
  uint64_t total = sh->n + 2 * GUARD + 16;
  for (int k = 0; k < 4; k++) {
    s->buf[k] = guarded_alloc(sh->n, 4);
    s->x[k] = s->buf[k] + GUARD + shift;
    /* Sentinels everywhere (signalling NaN bits a computation would change), then values. */
    for (uint64_t i = 0; i < total; i++)
      s->buf[k][i] = u2f(0x7fa00000u | (uint32_t)(i * 2654435761u >> 11));
    for (uint64_t i = 0; i < sh->n; i++) {
      if (!sh->covered[i]) continue;
      if (k == 0) s->x[k][i] = rnd_unit();
      if (k == 1) s->x[k][i] = rnd_unit() * 1e-2f;
      if (k == 2) s->x[k][i] = fabsf(rnd_unit()) * 1e-4f;
      /* Above or below v (or +0, torch's start), so that both sides of the max are taken. */
      if (k == 3) s->x[k][i] = rnd_below(4) == 0 ? 0.0f : fabsf(rnd_unit()) * 1e-4f;
    }
  }
  s->pbuf = NULL;
  s->param = NULL;
  if (psz) {
    s->pbuf = guarded_alloc(sh->n, psz);
    memset(s->pbuf, 0xa5, total * psz);
    s->param = (char *)s->pbuf + (GUARD + shift) * psz;
  }
}

static void state_copy(state_t *dst, const state_t *src, const shard_t *sh) {
  size_t psz = sh->pdt ? zd_dtype_size(sh->pdt) : 0;
  uint64_t total = sh->n + 2 * GUARD + 16;
  for (int k = 0; k < 4; k++) {
    dst->buf[k] = guarded_alloc(sh->n, 4);
    memcpy(dst->buf[k], src->buf[k], total * 4);
    dst->x[k] = dst->buf[k] + (src->x[k] - src->buf[k]);
  }
  dst->pbuf = dst->param = NULL;
  if (psz) {
    dst->pbuf = guarded_alloc(sh->n, psz);
    memcpy(dst->pbuf, src->pbuf, total * psz);
    dst->param = (char *)dst->pbuf + ((char *)src->param - (char *)src->pbuf);
  }
}

static void state_free(state_t *s) {
  for (int k = 0; k < 4; k++) free(s->buf[k]);
  free(s->pbuf);
}

/* Random segments over [0, n): gaps of any size (often none), lengths from 1 up, groups mixed. */
static void make_segments(shard_t *sh) {
  sh->segs = malloc((sh->n + 1) * sizeof *sh->segs);
  sh->covered = calloc(sh->n + 1, 1);
  CHECK(sh->segs && sh->covered);
  sh->nsegs = 0;
  uint64_t pos = rnd_below(3) == 0 ? rnd_below(5) : 0;
  uint64_t maxlen = sh->n < 64 ? 8 : sh->n < 4096 ? sh->n / 4 : sh->n / 8;
  while (pos < sh->n) {
    uint64_t len = 1 + (rnd_below(4) == 0 ? rnd_below(20) : rnd_below(maxlen + 1));
    if (len > sh->n - pos) len = sh->n - pos;
    sh->segs[sh->nsegs++] =
        (zd__segment_t){.offset = pos, .length = len, .group = (uint32_t)rnd_below(NGROUPS)};
    for (uint64_t i = pos; i < pos + len; i++) sh->covered[i] = 1;
    pos += len;
    uint64_t r = rnd_below(8);
    pos += r < 4 ? 0 : r < 7 ? 1 + rnd_below(17) : 1 + rnd_below(sh->n / 8 + 1);
  }
}

/* Grads of one step. specials (per mille) come from zeros, subnormals, infinities, NaNs and
 * extremes of the grad's own dtype. */
static void make_grads(void *g, const shard_t *sh) {
  static const uint32_t sp32[] = {0x00000000, 0x80000000, 0x00000001, 0x807fffff, 0x00012345,
                                  0x7f800000, 0xff800000, 0x7fc00000, 0xffc12345, 0x7f800001,
                                  0x7f7fffff, 0x00800000, 0x3f800000};
  static const uint16_t sp16[] = {0x0000, 0x8000, 0x0001, 0x83ff, 0x0155, 0x7c00, 0xfc00,
                                  0x7e00, 0xfe3b, 0x7c01, 0x7bff, 0x0400, 0x3c00};
  static const uint16_t spbf[] = {0x0000, 0x8000, 0x0001, 0x807f, 0x0012, 0x7f80, 0xff80,
                                  0x7fc0, 0xffc1, 0x7f81, 0x7f7f, 0x0080, 0x3f80};
  size_t nsp = sizeof sp32 / sizeof sp32[0];
  for (uint64_t i = 0; i < sh->n; i++) {
    int special = (int)rnd_below(1000) < sh->specials;
    /* A spread of magnitudes so the bf16/f16 roundings and the division see varied exponents. */
    float x = rnd_unit() * ldexpf(1.0f, -(int)rnd_below(12));
    uint32_t u = f2u(x);
    if (sh->gdt == ZD_F32) {
      ((float *)g)[i] = special ? u2f(sp32[rnd_below(nsp)]) : x;
    } else if (sh->gdt == ZD_BF16) {
      ((uint16_t *)g)[i] = special ? spbf[rnd_below(nsp)] : (uint16_t)(u >> 16);
    } else {
      /* An f16 with the float's sign, a random mantissa and an exponent in normal range. */
      uint16_t h = (uint16_t)(((u >> 16) & 0x8000) | ((5 + rnd_below(20)) << 10) | rnd_below(1024));
      ((uint16_t *)g)[i] = special ? sp16[rnd_below(nsp)] : h;
    }
  }
}

/* Elements of want and got (of dtype t, count n) must be bitwise equal, or both NaN for f32 (the
 * payload of a NaN may depend on operand order; bf16 output has one NaN, 0x7fc0). */
static void expect_same(const void *want, const void *got, zd_dtype_t t, uint64_t n,
                        const char *isa, const char *what, const shard_t *sh, int step) {
  size_t sz = zd_dtype_size(t);
  if (memcmp(want, got, n * sz) == 0) return;
  uint64_t bad = 0, first = UINT64_MAX;
  double max_abs = 0, max_rel = 0;
  for (uint64_t i = 0; i < n; i++) {
    float w = to_f32(want, t, i), g = to_f32(got, t, i);
    if (memcmp((const char *)want + i * sz, (const char *)got + i * sz, sz) == 0) continue;
    if (t == ZD_F32 && isnan(w) && isnan(g)) continue;
    bad++;
    if (first == UINT64_MAX) first = i;
    double d = fabs((double)w - (double)g);
    if (d > max_abs) max_abs = d;
    if (w != 0 && d / fabs((double)w) > max_rel) max_rel = d / fabs((double)w);
  }
  if (!bad) return;
  int64_t idx = (int64_t)first - GUARD;
  fprintf(stderr,
          "%s vs reference, %s, step %d: %s differs in %llu of %llu elements (buffer index %lld, "
          "want %.9g got %.9g); max abs diff %g, max rel diff %g\n",
          isa, sh->desc, step, what, (unsigned long long)bad, (unsigned long long)n, (long long)idx,
          to_f32(want, t, first), to_f32(got, t, first), max_abs, max_rel);
  exit(1);
}

/* Padding and guards of s must still hold the sentinels of s0. */
static void expect_padding(const state_t *s, const state_t *s0, const shard_t *sh,
                           const char *isa) {
  static const char *names[4] = {"master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  uint64_t total = sh->n + 2 * GUARD + 16;
  for (int k = 0; k < 4; k++) {
    int64_t base = s->x[k] - s->buf[k];
    for (uint64_t j = 0; j < total; j++) {
      int64_t i = (int64_t)j - base;
      if (i >= 0 && (uint64_t)i < sh->n && sh->covered[i]) continue;
      CHECK_MSG(f2u(s->buf[k][j]) == f2u(s0->buf[k][j]),
                "%s, %s: %s element %lld outside the segments changed: %08x -> %08x", isa, sh->desc,
                names[k], (long long)i, f2u(s0->buf[k][j]), f2u(s->buf[k][j]));
    }
  }
  if (!sh->pdt) return;
  size_t psz = zd_dtype_size(sh->pdt);
  int64_t base = ((char *)s->param - (char *)s->pbuf) / (int64_t)psz;
  for (uint64_t j = 0; j < total; j++) {
    int64_t i = (int64_t)j - base;
    if (i >= 0 && (uint64_t)i < sh->n && sh->covered[i]) continue;
    CHECK_MSG(!memcmp((char *)s->pbuf + j * psz, (char *)s0->pbuf + j * psz, psz),
              "%s, %s: param element %lld outside the segments changed", isa, sh->desc,
              (long long)i);
  }
}

static void set_args(zd__adam_args_t *a, const state_t *s, const shard_t *sh, const void *grad,
                     const zd__adam_group_t *groups, int ams) {
  *a = (zd__adam_args_t){.state[ZD__STATE_MASTER] = s->x[0],
                         .state[ZD__STATE_EXP_AVG] = s->x[1],
                         .state[ZD__STATE_EXP_AVG_SQ] = s->x[2],
                         .state[ZD__STATE_MAX_EXP_AVG_SQ] = ams ? s->x[3] : NULL,
                         .grad = grad,
                         .grad_dtype = sh->gdt,
                         .param = s->param,
                         .param_dtype = sh->pdt ? sh->pdt : ZD_F32,
                         .grad_scale = sh->grad_scale,
                         .segs = sh->segs,
                         .nsegs = sh->nsegs,
                         .groups = groups};
}

/* Runs fn over [0, n) as a few calls cut at random points, in a random order. */
static void call_split(zd__adam_fn fn, const zd__adam_args_t *a, uint64_t n) {
  uint64_t cut[6];
  int ncut = (int)rnd_below(5);
  cut[0] = 0;
  for (int i = 1; i <= ncut; i++) cut[i] = rnd_below(n + 1);
  cut[ncut + 1] = n;
  for (int i = 1; i <= ncut; i++) /* insertion sort: tiny */
    for (int j = i; j > 1 && cut[j] < cut[j - 1]; j--) {
      uint64_t t = cut[j];
      cut[j] = cut[j - 1];
      cut[j - 1] = t;
    }
  int backwards = (int)rnd_below(2);
  for (int i = 0; i <= ncut; i++) {
    int k = backwards ? ncut - i : i;
    fn(a, cut[k], cut[k + 1]);
  }
}

static void compare_states(const state_t *want, const state_t *got, const shard_t *sh,
                           const char *isa, int step) {
  static const char *names[4] = {"master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  uint64_t total = sh->n + 2 * GUARD + 16;
  for (int k = 0; k < 4; k++)
    expect_same(want->buf[k], got->buf[k], ZD_F32, total, isa, names[k], sh, step);
  /* amsgrad's max writes one NaN, all ones, on every path (adam.h): bitwise, NaNs included. */
  CHECK_MSG(!memcmp(want->buf[3], got->buf[3], total * 4),
            "%s vs reference, %s, step %d: max_exp_avg_sq differs in a NaN's bits", isa, sh->desc,
            step);
  if (sh->pdt) expect_same(want->pbuf, got->pbuf, sh->pdt, total, isa, "param", sh, step);
}

/* The step of `after` once more, out of place (zd__adam_args_t.src): it reads a copy of the state
 * before the step, which must stay as it was, and writes a set whose covered master, moments and
 * params hold other values; what it writes must equal the in-place result bit for bit. */
static void check_out_of_place(zd__adam_fn fn, const state_t *before, const state_t *after,
                               const shard_t *sh, const void *grad, const zd__adam_group_t *groups,
                               int ams, const char *isa, int step) {
  state_t src, dst;
  state_copy(&src, before, sh);
  state_copy(&dst, before, sh);
  size_t psz = sh->pdt ? zd_dtype_size(sh->pdt) : 0;
  for (uint64_t i = 0; i < sh->n; i++) {
    if (!sh->covered[i]) continue;
    for (int k = 0; k < 3; k++) dst.x[k][i] = u2f(0x7fb00000u | (uint32_t)(i * 40503u >> 9));
    if (psz) memset((char *)dst.param + i * psz, 0x5a, psz);
  }
  zd__adam_args_t a;
  set_args(&a, &dst, sh, grad, groups, ams);
  for (int k = 0; k < 4; k++) a.src[k] = a.state[k] ? src.x[k] : NULL;
  call_split(fn, &a, sh->n);
  char what[64];
  snprintf(what, sizeof what, "%s out of place", isa);
  compare_states(after, &dst, sh, what, step);
  snprintf(what, sizeof what, "%s out of place, its source", isa);
  compare_states(before, &src, sh, what, step);
  state_free(&src);
  state_free(&dst);
}

/* One shard through `steps` steps: the reference in one call per step, each wide path in random
 * splits; states compared after every step. Every path also runs each step out of place. */
static void run_shard(shard_t *sh, int steps) {
  unsigned shift = (unsigned)rnd_below(16), variant = (unsigned)rnd_below(8);
  int ams = (int)rnd_below(2);
  snprintf(sh->desc, sizeof sh->desc, "n=%llu nsegs=%u grad=%s param=%s scale=%g shift=%u ams=%d",
           (unsigned long long)sh->n, sh->nsegs, dtype_name(sh->gdt), dtype_name(sh->pdt),
           sh->grad_scale, shift, ams);
  state_t s0, ref, x[sizeof isas / sizeof isas[0]];
  state_init(&s0, sh, shift);
  state_copy(&ref, &s0, sh);
  for (int i = 0; i < nisas; i++) state_copy(&x[i], &s0, sh);
  void *grad = malloc(sh->n * 4 + 4);
  CHECK(grad);
  for (int t = 1; t <= steps; t++) {
    zd__adam_group_t groups[NGROUPS];
    for (int k = 0; k < NGROUPS; k++) {
      zd_group_t hp = hps[k];
      hp.lr *= 1.0 + 0.25 * t; /* a scheduler: lr changes every step */
      set_variant(&hp, k, t, variant, ams);
      zd__adam_group_init(&groups[k], &hp, (uint64_t)t);
    }
    make_grads(grad, sh);
    zd__adam_args_t a;
    state_t before;
    state_copy(&before, &ref, sh);
    set_args(&a, &ref, sh, grad, groups, ams);
    zd__adam_step_ref(&a, 0, sh->n);
    expect_padding(&ref, &s0, sh, "scalar");
    check_out_of_place(zd__adam_step_ref, &before, &ref, sh, grad, groups, ams, "scalar", t);
    for (int i = 0; i < nisas; i++) {
      set_args(&a, &x[i], sh, grad, groups, ams);
      call_split(zd__adam_impl(isas[i]), &a, sh->n);
      compare_states(&ref, &x[i], sh, zd__isa_name(isas[i]), t);
      expect_padding(&x[i], &s0, sh, zd__isa_name(isas[i]));
      /* x[i] equals ref before the step as after it: the same source. */
      check_out_of_place(zd__adam_impl(isas[i]), &before, &x[i], sh, grad, groups, ams,
                         zd__isa_name(isas[i]), t);
    }
    state_free(&before);
  }
  free(grad);
  state_free(&s0);
  state_free(&ref);
  for (int i = 0; i < nisas; i++) state_free(&x[i]);
}

static void shard_free(shard_t *sh) {
  free(sh->segs);
  free(sh->covered);
}

static const zd_dtype_t gdts[3] = {ZD_F32, ZD_BF16, ZD_F16};
static const zd_dtype_t pdts[3] = {ZD_F32, ZD_BF16, 0};
static const float scales[4] = {1.0f, 1.0f / 1024, 0.37f, 65536.0f};

static void test_step(void) {
  uint64_t cases = 0, elems = 0;
  /* Every length 0..300 for every grad dtype x param output, two steps each. */
  for (int gi = 0; gi < 3; gi++)
    for (int pi = 0; pi < 3; pi++)
      for (uint64_t n = 0; n <= 300; n++) {
        shard_t sh = {.n = n,
                      .gdt = gdts[gi],
                      .pdt = pdts[pi],
                      .grad_scale = scales[rnd_below(4)],
                      .specials = (int)rnd_below(3) * 40};
        make_segments(&sh);
        run_shard(&sh, 2);
        shard_free(&sh);
        cases++;
        elems += n;
      }
  /* A few large shards, several steps each. */
  static const uint64_t large[] = {4099, 65537, 1000003};
  for (int li = 0; li < 3; li++)
    for (int gi = 0; gi < 3; gi++)
      for (int pi = 0; pi < 3; pi++) {
        if (large[li] > 100000 && gi != pi) continue; /* the biggest only for f32/bf16 pairs */
        shard_t sh = {.n = large[li],
                      .gdt = gdts[gi],
                      .pdt = pdts[pi],
                      .grad_scale = scales[rnd_below(4)],
                      .specials = (int)rnd_below(2) * 5};
        make_segments(&sh);
        run_shard(&sh, 3);
        shard_free(&sh);
        cases++;
        elems += large[li];
      }
  printf(
      "step: %llu shards (%llu elements), every path bitwise equal to the reference, "
      "every update x sqrt_mode x amsgrad, in place and out of place\n",
      (unsigned long long)cases, (unsigned long long)elems);
}

/* ---- gradient statistics ------------------------------------------------------------------- */

static void expect_sums(const double *want, const double *got, uint64_t nblocks, const char *isa,
                        const char *desc) {
  for (uint64_t k = 0; k < nblocks; k++) {
    if (memcmp(&want[k], &got[k], sizeof(double)) == 0 || (isnan(want[k]) && isnan(got[k])))
      continue;
    fprintf(stderr, "%s vs reference, %s: block %llu sum %.17g, want %.17g (abs diff %g)\n", isa,
            desc, (unsigned long long)k, got[k], want[k], fabs(got[k] - want[k]));
    exit(1);
  }
}

/* Stats over blocks [0, nblocks) as random pieces, in a random order. */
static void stats_split(zd__stats_fn fn, const void *g, const shard_t *sh, uint64_t nblocks,
                        double *sums, uint64_t *nonfinite) {
  uint64_t b = 0;
  while (b < nblocks) {
    uint64_t e = b + 1 + rnd_below(nblocks - b);
    fn(g, sh->gdt, sh->segs, sh->nsegs, sh->n, b, e, sums + b, nonfinite);
    b = e;
  }
}

static void run_stats(shard_t *sh) {
  snprintf(sh->desc, sizeof sh->desc, "n=%llu nsegs=%u grad=%s", (unsigned long long)sh->n,
           sh->nsegs, dtype_name(sh->gdt));
  uint64_t nblocks = zd__stats_blocks(sh->n);
  void *g = malloc(sh->n * 4 + 4);
  double *want = calloc(nblocks + 1, sizeof(double)), *got = calloc(nblocks + 1, sizeof(double));
  CHECK(g && want && got);
  make_grads(g, sh);
  uint64_t bad = 0, want_bad = 0;
  long double naive = 0;
  for (uint64_t i = 0; i < sh->n; i++) {
    if (!sh->covered[i]) continue;
    float x = to_f32(g, sh->gdt, i);
    if (!isfinite(x)) want_bad++;
    naive += (long double)x * x;
  }
  zd__grad_stats_ref(g, sh->gdt, sh->segs, sh->nsegs, sh->n, 0, nblocks, want, &bad);
  CHECK_U64_EQ(bad, want_bad);
  double total = zd__grad_stats_sum(want, nblocks);
  if (!want_bad)
    CHECK_MSG(fabsl(total - naive) <= 1e-12L * naive, "%s: sum %.17g, naive %.17Lg", sh->desc,
              total, naive);
  /* The reference split over blocks, then each wide path in one call and split. */
  bad = 0;
  stats_split(zd__grad_stats_ref, g, sh, nblocks, got, &bad);
  CHECK_U64_EQ(bad, want_bad);
  expect_sums(want, got, nblocks, "scalar split", sh->desc);
  for (int i = 0; i < nisas; i++) {
    zd__stats_fn fn = zd__grad_stats_impl(isas[i]);
    memset(got, 0, nblocks * sizeof(double));
    bad = 0;
    fn(g, sh->gdt, sh->segs, sh->nsegs, sh->n, 0, nblocks, got, &bad);
    CHECK_U64_EQ(bad, want_bad);
    expect_sums(want, got, nblocks, zd__isa_name(isas[i]), sh->desc);
    memset(got, 0, nblocks * sizeof(double));
    bad = 0;
    stats_split(fn, g, sh, nblocks, got, &bad);
    CHECK_U64_EQ(bad, want_bad);
    expect_sums(want, got, nblocks, zd__isa_name(isas[i]), sh->desc);
  }
  free(g);
  free(want);
  free(got);
}

static void test_stats(void) {
  uint64_t cases = 0;
  for (int gi = 0; gi < 3; gi++) {
    for (uint64_t n = 0; n <= 300; n += 1 + rnd_below(4)) {
      shard_t sh = {.n = n, .gdt = gdts[gi], .specials = (int)rnd_below(3) * 20};
      make_segments(&sh);
      run_stats(&sh);
      shard_free(&sh);
      cases++;
    }
    static const uint64_t large[] = {2048, 2049, 4095, 30011, 250007};
    for (int li = 0; li < 5; li++) {
      shard_t sh = {.n = large[li], .gdt = gdts[gi], .specials = li % 2};
      make_segments(&sh);
      run_stats(&sh);
      shard_free(&sh);
      cases++;
    }
  }
  printf(
      "stats: %llu shards, sums bitwise equal across paths and block splits, nonfinite counts "
      "right\n",
      (unsigned long long)cases);
}

static int same_f32(float a, float b);

static void test_group_init(void) {
  /* The contract: each constant derived in double from the double hyperparameters, then rounded
   * to float once (what torch does with Python floats). */
  zd_group_t hp = {.lr = 3e-4,
                   .beta1 = 0.9,
                   .beta2 = 0.95,
                   .eps = 1e-8,
                   .weight_decay = 0.1,
                   .optimizer = ZD_ADAMW};
  for (uint64_t t = 1; t <= 1000; t *= 10) {
    zd__adam_group_t c;
    zd__adam_group_init(&c, &hp, t);
    CHECK_INT_EQ(c.optimizer, ZD_ADAMW);
    CHECK_INT_EQ(c.has_weight_decay, 1);
    CHECK(c.decay == (float)(1 - 3e-4 * 0.1));
    CHECK(c.one_minus_beta2 == (float)(1 - 0.95));
    CHECK(c.bias_correction2_sqrt == (float)sqrt(1 - pow(0.95, (double)t)));
    CHECK(c.neg_step_size == (float)(-(3e-4 / (1 - pow(0.9, (double)t)))));
  }
  hp.weight_decay = 0;
  zd__adam_group_t c;
  zd__adam_group_init(&c, &hp, 1);
  CHECK_INT_EQ(c.has_weight_decay, 0);
  /* maximize negates exactly two constants (adam.h) and leaves the rest alone. */
  hp.weight_decay = 0.1;
  for (int opt = ZD_ADAMW; opt <= ZD_ADAM; opt++) {
    hp.optimizer = (zd_optimizer_t)opt;
    zd__adam_group_t lo, hi;
    hp.maximize = 0;
    zd__adam_group_init(&lo, &hp, 7);
    hp.maximize = 1;
    zd__adam_group_init(&hi, &hp, 7);
    CHECK(hi.one_minus_beta1 == -lo.one_minus_beta1 && hi.weight_decay == -lo.weight_decay);
    hi.one_minus_beta1 = lo.one_minus_beta1;
    hi.weight_decay = lo.weight_decay;
    CHECK(memcmp(&hi, &lo, sizeof hi) == 0);
  }
  /* TORCH2: the lerp's weight and form from w = (float)(1 - beta1), maximize as a negated
   * gradient with the constants left positive. */
  static const struct {
    double beta1;
    float weight;
    int from_grad;
  } lerps[] = {{0.9, (float)(1 - 0.9), 0},
               {0.5000001, (float)(1 - 0.5000001), 0},
               {0.5, -0.5f, 1},
               {0.3, (float)(1 - 0.3) - 1.0f, 1},
               {0.0, 0.0f, 1}};
  for (size_t i = 0; i < sizeof lerps / sizeof lerps[0]; i++) {
    zd_group_t h2 = hp;
    h2.update = ZD_UPDATE_TORCH2;
    h2.beta1 = lerps[i].beta1;
    h2.maximize = (int)(i % 2);
    zd__adam_group_init(&c, &h2, 3);
    CHECK_MSG(c.lerp_weight == lerps[i].weight && c.lerp_from_grad == lerps[i].from_grad,
              "beta1 %g: lerp weight %.9g from_grad %d; expected %.9g %d", lerps[i].beta1,
              c.lerp_weight, c.lerp_from_grad, lerps[i].weight, lerps[i].from_grad);
    CHECK_INT_EQ(c.negate_grad, h2.maximize);
    CHECK(c.one_minus_beta1 > 0 || h2.beta1 == 0);
    CHECK(c.weight_decay == (float)0.1);
  }
  printf("group_init: ok\n");
}

/* amsgrad's MAX is ATen's vectorised torch.maximum (adam.h), checked against torch 1.13 and 2.15
 * on an AVX2 and an AVX-512 build: max_ps(a, b) (b unless a > b, so the second zero of two) OR-ed
 * with all ones where either is NaN. fmaxf would return the number of a number and a NaN. */
static void test_amsgrad_max(void) {
  static const struct {
    uint32_t a, b, want;
  } cases[] = {
      {0x3f800000, 0x40000000, 0x40000000}, {0x40000000, 0x3f800000, 0x40000000},
      {0x00000000, 0x80000000, 0x80000000}, {0x80000000, 0x00000000, 0x00000000},
      {0x7fc00000, 0x3f800000, 0xffffffff}, {0x3f800000, 0x7fc00000, 0xffffffff},
      {0xffc12345, 0x7f800000, 0xffffffff}, {0x7f800000, 0x7f7fffff, 0x7f800000},
      {0x00000001, 0x00000000, 0x00000001},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    float got = zd__amsgrad_max(u2f(cases[i].a), u2f(cases[i].b));
    CHECK_MSG(f2u(got) == cases[i].want, "amsgrad max(%08x, %08x) = %08x; expected %08x",
              cases[i].a, cases[i].b, f2u(got), cases[i].want);
  }
  printf("amsgrad_max: ok\n");
}

/* ---- sqrt modes ---------------------------------------------------------------------------- */

/* 8 lanes of vrsqrtps against rsqrtss, lane by lane: the wide paths' MKL_EX sqrt rests on the two
 * instructions sharing one table on a CPU. */
__attribute__((target("avx"))) static int rsqrt_lanes_agree(const float *x) {
  float y[8];
  _mm256_storeu_ps(y, _mm256_rsqrt_ps(_mm256_loadu_ps(x)));
  for (int j = 0; j < 8; j++)
    if (f2u(y[j]) != f2u(_mm_cvtss_f32(_mm_rsqrt_ss(_mm_set_ss(x[j]))))) return 0;
  return 1;
}

static void test_sqrt_modes(void) {
  /* Inputs the scalar path takes (correctly rounded) and the edges of the main path. */
  static const uint32_t specials[] = {0x00000000, 0x80000000, 0x00000001, 0x007fffff, 0x7f7ff001,
                                      0x7f7fffff, 0x7f800000, 0x7fc00000, 0xbf800000, 0xff800000};
  for (size_t i = 0; i < sizeof specials / sizeof specials[0]; i++) {
    float x = u2f(specials[i]), y;
    CHECK_INT_EQ(zd_sqrt(ZD_SQRT_MKL_EX, &x, &y, 1), ZD_OK);
    CHECK_MSG(same_f32(y, sqrtf(x)), "MKL_EX sqrt of %08x: %08x, correctly rounded %08x",
              specials[i], f2u(y), f2u(sqrtf(x)));
  }
  float one = 1.0f;
  CHECK_INT_EQ(zd_sqrt((zd_sqrt_mode_t)7, &one, &one, 1), -EINVAL);
  CHECK_INT_EQ(zd_sqrt(ZD_SQRT_EXACT, NULL, &one, 1), -EINVAL);
  /* A sweep of the main path, every 61st positive normal float: MKL_EX within 1 ULP of the
   * correctly rounded sqrt, and vrsqrtps equal to rsqrtss on this CPU (if it has AVX). */
  __builtin_cpu_init();
  int avx = __builtin_cpu_supports("avx");
  uint64_t n = 0, off = 0, lanes_bad = 0;
  float batch[8];
  int nb = 0;
  for (uint32_t u = 0x00800000; u <= 0x7f7ff000; u += 61) {
    float x = u2f(u), e, y;
    CHECK_INT_EQ(zd_sqrt(ZD_SQRT_EXACT, &x, &e, 1), ZD_OK);
    CHECK_INT_EQ(zd_sqrt(ZD_SQRT_MKL_EX, &x, &y, 1), ZD_OK);
    CHECK(f2u(e) == f2u(sqrtf(x)));
    uint32_t d = f2u(y) > f2u(e) ? f2u(y) - f2u(e) : f2u(e) - f2u(y);
    CHECK_MSG(d <= 1, "MKL_EX sqrt of %08x: %08x, %u ULP from %08x", u, f2u(y), d, f2u(e));
    off += d;
    n++;
    batch[nb++] = x;
    if (nb == 8) {
      if (avx && !rsqrt_lanes_agree(batch)) lanes_bad++;
      nb = 0;
    }
  }
  CHECK_MSG(lanes_bad == 0, "vrsqrtps and rsqrtss differ in %llu batches of 8",
            (unsigned long long)lanes_bad);
  printf("sqrt modes: MKL_EX within 1 ULP of sqrt over %llu normal floats (%.2f%% off by 1)%s\n",
         (unsigned long long)n, 100.0 * (double)off / (double)n,
         avx ? ", vrsqrtps == rsqrtss lane by lane" : "");
}

/* ---- maximize ------------------------------------------------------------------------------ */

/* torch's maximize=True spelled out: the gradient negated, then the usual update with the
 * constants of the same group without maximize. What the folded constants must reproduce. */
static void maximize_explicit(float *p, float *m, float *v, const float *grad, float grad_scale,
                              uint64_t n, const zd__adam_group_t *c) {
  int decay = c->has_weight_decay && c->optimizer == ZD_ADAMW;
  int l2 = c->has_weight_decay && c->optimizer == ZD_ADAM;
  for (uint64_t i = 0; i < n; i++) {
    float g = -(grad[i] * grad_scale);
    if (decay) p[i] = p[i] * c->decay;
    if (l2) g = fmaf(p[i], c->weight_decay, g);
    m[i] = fmaf(g, c->one_minus_beta1, m[i] * c->beta1);
    v[i] = fmaf(c->one_minus_beta2 * g, g, v[i] * c->beta2);
    float d = sqrtf(v[i]) / c->bias_correction2_sqrt + c->eps;
    p[i] = p[i] + (c->neg_step_size * m[i]) / d;
  }
}

/* Bitwise equal, or NaN on both sides (negating a NaN flips its sign bit, which fma passes on). */
static int same_f32(float a, float b) {
  return f2u(a) == f2u(b) || (isnan(a) && isnan(b));
}

static void test_maximize(void) {
  enum { N = 4096, STEPS = 4 };
  static float p[2][N], m[2][N], v[2][N], g[N];
  static const zd_group_t cases[] = {
      HP(1e-3, 0.9, 0.999, 1e-8, 0.01, ZD_ADAMW, 1), HP(3e-4, 0.9, 0.95, 1e-8, 0, ZD_ADAMW, 1),
      HP(1e-2, 0.8, 0.99, 1e-6, 0.1, ZD_ADAM, 1),    HP(5e-4, 0.9, 0.999, 1e-8, 0, ZD_ADAM, 1),
      HP(0.1, 0.5, 0.6, 1e-3, 2.5, ZD_ADAM, 1),
  };
  static const uint32_t specials[] = {0x00000000, 0x80000000, 0x00000001, 0x807fffff,
                                      0x7f800000, 0xff800000, 0x7fc00000, 0x7f7fffff};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    for (int i = 0; i < N; i++) {
      p[0][i] = p[1][i] = rnd_unit();
      m[0][i] = m[1][i] = rnd_unit() * 1e-2f;
      v[0][i] = v[1][i] = fabsf(rnd_unit()) * 1e-4f;
    }
    zd__segment_t seg = {.offset = 0, .length = N, .group = 0};
    for (int t = 1; t <= STEPS; t++) {
      for (int i = 0; i < N; i++)
        g[i] = rnd_below(50) == 0 ? u2f(specials[rnd_below(8)])
                                  : rnd_unit() * ldexpf(1.0f, -(int)rnd_below(12));
      float scale = t % 2 ? 1.0f : 0.37f;
      zd_group_t hp = cases[k];
      zd__adam_group_t folded, plain;
      zd__adam_group_init(&folded, &hp, (uint64_t)t);
      hp.maximize = 0;
      zd__adam_group_init(&plain, &hp, (uint64_t)t);
      zd__adam_args_t a = {.state[ZD__STATE_MASTER] = p[0],
                           .state[ZD__STATE_EXP_AVG] = m[0],
                           .state[ZD__STATE_EXP_AVG_SQ] = v[0],
                           .grad = g,
                           .grad_dtype = ZD_F32,
                           .grad_scale = scale,
                           .segs = &seg,
                           .nsegs = 1,
                           .groups = &folded};
      zd__adam_step_ref(&a, 0, N);
      maximize_explicit(p[1], m[1], v[1], g, scale, N, &plain);
      for (int i = 0; i < N; i++)
        CHECK_MSG(
            same_f32(p[0][i], p[1][i]) && same_f32(m[0][i], m[1][i]) && same_f32(v[0][i], v[1][i]),
            "maximize, case %zu, step %d, element %d: folded p %08x m %08x v %08x, negated "
            "grad p %08x m %08x v %08x",
            k, t, i, f2u(p[0][i]), f2u(m[0][i]), f2u(v[0][i]), f2u(p[1][i]), f2u(m[1][i]),
            f2u(v[1][i]));
    }
  }
  /* The one case adam.h documents: Adam's -g and wd * p cancel exactly and m * b1 is -0. torch's
   * first moment is then +0, zerod's -0; everything else is equal. */
  zd_group_t hp = HP(1e-3, 0.5, 0.999, 1e-8, 0.5, ZD_ADAM, 1);
  zd__adam_group_t folded, plain;
  zd__adam_group_init(&folded, &hp, 1);
  hp.maximize = 0;
  zd__adam_group_init(&plain, &hp, 1);
  float p0 = 1.0f, m0 = -0.0f, v0 = 0.0f, g0 = 0.5f, p1 = p0, m1 = m0, v1 = v0;
  zd__segment_t seg = {.offset = 0, .length = 1, .group = 0};
  zd__adam_args_t a = {.state[ZD__STATE_MASTER] = &p0,
                       .state[ZD__STATE_EXP_AVG] = &m0,
                       .state[ZD__STATE_EXP_AVG_SQ] = &v0,
                       .grad = &g0,
                       .grad_dtype = ZD_F32,
                       .grad_scale = 1.0f,
                       .segs = &seg,
                       .nsegs = 1,
                       .groups = &folded};
  zd__adam_step_ref(&a, 0, 1);
  maximize_explicit(&p1, &m1, &v1, &g0, 1.0f, 1, &plain);
  CHECK_MSG(f2u(m0) == 0x80000000u && f2u(m1) == 0, "cancellation: m %08x, negated grad %08x",
            f2u(m0), f2u(m1));
  CHECK(f2u(p0) == f2u(p1) && f2u(v0) == f2u(v1));
  printf(
      "maximize: folded constants equal the negated gradient bit for bit (%zu groups x %d "
      "steps x %d elements; the documented -0 moment checked)\n",
      sizeof cases / sizeof cases[0], STEPS, N);
}

/* bf16 working parameters from every path equal zd__f32_to_bf16 of the master weight, for every
 * sign, exponent and top 7 mantissa bits, each with low halves that tie, sit next to a tie or
 * are random: NaNs of every payload, subnormals, infinities and the overflow to inf included.
 * A step with lr = 0 and zero gradients leaves each weight as it was (p + -0), so the output is
 * the weight's rounding alone; calls cut at random points take the masked, aligned and streaming
 * stores alike. */
static void test_bf16_output(void) {
  enum { LOWS = 8 };
  const uint64_t n = 65536 * LOWS;
  float *x[3];
  for (int k = 0; k < 3; k++) {
    x[k] = aligned_alloc(64, n * sizeof(float));
    CHECK(x[k]);
  }
  float *grad = calloc(n, sizeof(float));
  uint16_t *out = aligned_alloc(64, n * sizeof(uint16_t));
  CHECK(grad && out);
  for (uint64_t i = 0; i < n; i++) {
    uint32_t lows[LOWS] = {0x0000,
                           0x0001,
                           0x7fff,
                           0x8000,
                           0x8001,
                           0xffff,
                           (uint32_t)zd_test_rnd() & 0xffff,
                           (uint32_t)zd_test_rnd() & 0xffff};
    x[0][i] = u2f((uint32_t)(i / LOWS) << 16 | lows[i % LOWS]);
  }
  zd_group_t hp = {.lr = 0, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .optimizer = ZD_ADAMW};
  zd__adam_group_t g;
  zd__adam_group_init(&g, &hp, 1);
  zd__segment_t seg = {.offset = 0, .length = n, .group = 0};
  zd__adam_args_t a = {.state[ZD__STATE_EXP_AVG] = x[1],
                       .state[ZD__STATE_EXP_AVG_SQ] = x[2],
                       .grad = grad,
                       .grad_dtype = ZD_F32,
                       .param = out,
                       .param_dtype = ZD_BF16,
                       .grad_scale = 1.0f,
                       .segs = &seg,
                       .nsegs = 1,
                       .groups = &g};
  float *master = malloc(n * sizeof(float));
  CHECK(master);
  for (int i = -1; i < nisas; i++) {
    zd__adam_fn fn = i < 0 ? zd__adam_step_ref : zd__adam_impl(isas[i]);
    memcpy(master, x[0], n * sizeof(float));
    memset(x[1], 0, n * sizeof(float));
    memset(x[2], 0, n * sizeof(float));
    memset(out, 0xa5, n * sizeof(uint16_t));
    a.state[ZD__STATE_MASTER] = master;
    call_split(fn, &a, n);
    for (uint64_t k = 0; k < n; k++) {
      uint16_t want = zd__f32_to_bf16(x[0][k]);
      CHECK_MSG(out[k] == want, "%s: bf16 of %08x is %04x, want %04x",
                i < 0 ? "scalar" : zd__isa_name(isas[i]), f2u(x[0][k]), out[k], want);
    }
  }
  printf(
      "bf16 output: %llu weights (every sign, exponent and top mantissa) round alike on every "
      "path\n",
      (unsigned long long)n);
  free(master);
  for (int k = 0; k < 3; k++) free(x[k]);
  free(grad);
  free(out);
}

int main(void) {
  test_isa();
  test_bf16_output();
  test_f16();
  test_bf16();
  test_group_init();
  test_amsgrad_max();
  test_sqrt_modes();
  test_maximize();
  test_golden(ZD_ADAMW, 0.01, golden_adamw);
  test_golden(ZD_ADAM, 0.1, golden_adam);
  printf("golden: reference equals torch 1.13.1 AdamW and Adam over 5 steps\n");
  test_step();
  test_stats();
  printf("PASS\n");
  return 0;
}
