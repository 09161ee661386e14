/* The AVX-512 path of the optimizer kernels (adam.h): 16 elements per vector, heads and tails of
 * each segment piece done by the same code under a lane mask, so every element goes through one
 * sequence of instructions whatever its position.
 *
 * Built with -mavx512f/bw/vl/dq -mfma -mf16c and called only through zd__adam_impl /
 * zd__grad_stats_impl once zd__isa_detect() has said the CPU runs it. Built a second time with
 * -mavx512bf16 and ZD_AVX512_BF16 defined, as zd__adam_step_avx512bf16 (the avx512bf16 level):
 * the same loops, with the bf16 working parameters rounded by one instruction (f32_to_bf16).
 * Bitwise equality with the scalar reference rests on: each intrinsic being one IEEE operation
 * rounded to nearest even, _mm512_fmadd_ps exactly where the reference calls fmaf(), the same
 * operand order, and -ffp-contract=off (GCC's _mm512_mul_ps/_add_ps are plain vector operators it
 * could otherwise fuse). vcvtph2ps converts f16 exactly, as zd__f16_to_f32 does.
 */
#include <immintrin.h>

#include "adam.h"

#define AI        static inline __attribute__((always_inline))
#define VEC_BYTES 64 /* one vector */

/* How weight decay enters the update; the same for a whole segment. */
enum { WD_NONE, WD_DECAY, WD_L2 };
/* Working-parameter output: none, or the dtype written. */
enum { OUT_NONE = 0 };

/* The formula of a group (adam.h): update (TORCH113 or TORCH2) times sqrt mode times amsgrad,
 * one compiled loop each, so that a group without amsgrad streams no fourth array. */
enum { F113 = 0, F113_MKL = 1, F2 = 2, F2_MKL = 3, F_AMS = 4 };
#define FORM_TORCH2(f) ((f)&F2)
#define FORM_MKL_EX(f) ((f)&1)
#define FORM_AMS(f)    ((f)&F_AMS)

typedef struct {
  __m512 scale, decay, wd, b1, a1, b2, a2, bc2s, nss, eps;
  __m512 lw;       /* TORCH2: lerp_weight */
  __mmask16 lbase; /* TORCH2: all lanes where the lerp starts from g (lerp_from_grad), else none */
  __m512i neg;     /* TORCH2: the sign bit where the gradient is negated (maximize), else zero */
} consts_t;

AI __m512 load_f32(const float *p, __mmask16 k, int full) {
  return full ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(k, p);
}

AI void store_f32(float *p, __m512 x, __mmask16 k, int full) {
  if (full)
    _mm512_storeu_ps(p, x);
  else
    _mm512_mask_storeu_ps(p, k, x);
}

/* 16 grads of dtype gdt at g, as f32 (exact for every dtype). Masked-off lanes are not read, so
 * a tail never touches memory past the segment. */
AI __m512 load_grad(const void *g, __mmask16 k, int full, int gdt) {
  if (gdt == ZD_F32) return load_f32(g, k, full);
  __m256i h = full ? _mm256_loadu_si256(g) : _mm256_maskz_loadu_epi16(k, g);
  if (gdt == ZD_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* zd__f32_to_bf16 on 16 lanes: round to nearest even on the bits, NaN -> 0x7fc0. */
AI __m256i f32_to_bf16_bits(__m512 x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

#ifdef ZD_AVX512_BF16
/* The same with vcvtneps2bf16, a quarter of the instructions: in cache, the bits' eight made a
 * bf16-output step 20-25% slower than an f32 one. The instruction rounds to nearest even by the
 * same carry, but takes subnormal inputs as zero and keeps a NaN's sign and payload; a vector
 * holding one of those (vfpclassps: QNaN 0x01, subnormal 0x20, SNaN 0x80) takes the bits' way. */
AI __m256i f32_to_bf16(__m512 x) {
  if (__builtin_expect(_mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80) == 0, 1))
    return (__m256i)_mm512_cvtneps_pbh(x);
  return f32_to_bf16_bits(x);
}
#define ADAM_STEP zd__adam_step_avx512bf16
#else
#define f32_to_bf16 f32_to_bf16_bits
#define ADAM_STEP   zd__adam_step_avx512
#endif

/* zd__sqrt_mkl_ex on 16 lanes. The approximation is vrsqrtps on each 256-bit half, which gives
 * rsqrtss's bits lane by lane; AVX-512's vrsqrt14ps is another approximation and must not stand in
 * for it. The special lanes take the correctly rounded sqrt, as MKL's scalar path does. */
AI __m512 sqrt_mkl_ex(__m512 x) {
  const __m512 half = _mm512_set1_ps(0.5f);
  __m256 r0 = _mm256_rsqrt_ps(_mm512_castps512_ps256(x));
  __m256 r1 = _mm256_rsqrt_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  __m512 r = _mm512_insertf32x8(_mm512_castps256_ps512(r0), r1, 1);
  __m512 s = _mm512_mul_ps(x, r);
  __m512 h = _mm512_mul_ps(r, half);
  __m512 e = _mm512_sub_ps(half, _mm512_mul_ps(s, h));
  __m512 s1 = _mm512_add_ps(_mm512_mul_ps(s, e), s);
  __m512 h1 = _mm512_add_ps(_mm512_mul_ps(h, e), h);
  __m512 d = _mm512_sub_ps(x, _mm512_mul_ps(s1, s1));
  __m512 y = _mm512_add_ps(_mm512_mul_ps(d, h1), s1);
  __m512i t = _mm512_add_epi32(_mm512_castps_si512(x), _mm512_set1_epi32((int)ZD__MKL_EX_BIAS));
  __mmask16 special = _mm512_cmpgt_epi32_mask(t, _mm512_set1_epi32(ZD__MKL_EX_LIMIT));
  /* Special lanes are rare in training (a zero second moment): the sqrt only when one is here. */
  return special ? _mm512_mask_sqrt_ps(y, special, x) : y;
}

/* zd__amsgrad_max on 16 lanes, as ATen's Vectorized<float>::maximum: all ones where unordered. */
AI __m512 amsgrad_max(__m512 vmax, __m512 v) {
  __mmask16 nan = _mm512_cmp_ps_mask(vmax, v, _CMP_UNORD_Q);
  return _mm512_or_ps(_mm512_max_ps(vmax, v),
                      _mm512_castsi512_ps(_mm512_maskz_set1_epi32(nan, -1)));
}

/* The update of 16 consecutive elements; the formula and its order are adam.h's. The dtype,
 * decay, form, full and nt arguments are constants at every call, so each combination compiles
 * to its own branch-free loop. nt: stream the working params (full vectors at an aligned `out`
 * only). mx: the max_exp_avg_sq elements (read only with amsgrad). */
AI void step16(const float *rp, const float *rm, const float *rv, const float *rx, float *mp,
               float *mm, float *mv, float *mx, const void *gp, void *out, const consts_t *c,
               __mmask16 k, int full, int gdt, int pdt, int wdm, int form, int nt, int ns) {
  __m512 g = _mm512_mul_ps(load_grad(gp, k, full, gdt), c->scale);
  if (FORM_TORCH2(form)) g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), c->neg));
  __m512 p = load_f32(rp, k, full);
  if (wdm == WD_DECAY) p = _mm512_mul_ps(p, c->decay);
  if (wdm == WD_L2) g = _mm512_fmadd_ps(p, c->wd, g);
  __m512 m = load_f32(rm, k, full);
  if (FORM_TORCH2(form))
    m = _mm512_fmadd_ps(c->lw, _mm512_sub_ps(g, m), _mm512_mask_mov_ps(m, c->lbase, g));
  else
    m = _mm512_fmadd_ps(g, c->a1, _mm512_mul_ps(m, c->b1));
  __m512 v =
      _mm512_fmadd_ps(_mm512_mul_ps(c->a2, g), g, _mm512_mul_ps(load_f32(rv, k, full), c->b2));
  __m512 s = v;
  if (FORM_AMS(form)) {
    s = amsgrad_max(load_f32(rx, k, full), v);
    if (ns)
      _mm512_stream_ps(mx, s);
    else
      store_f32(mx, s, k, full);
  }
  __m512 sq = FORM_MKL_EX(form) ? sqrt_mkl_ex(s) : _mm512_sqrt_ps(s);
  __m512 d = _mm512_add_ps(_mm512_div_ps(sq, c->bc2s), c->eps);
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c->nss, m), d));
  if (ns) { /* out of place: the other set, streamed (run) */
    _mm512_stream_ps(mp, p);
    _mm512_stream_ps(mm, m);
    _mm512_stream_ps(mv, v);
  } else {
    store_f32(mp, p, k, full);
    store_f32(mm, m, k, full);
    store_f32(mv, v, k, full);
  }
  if (pdt == ZD_F32 && nt)
    _mm512_stream_ps(out, p);
  else if (pdt == ZD_F32)
    store_f32(out, p, k, full);
  if (pdt == ZD_BF16 && nt)
    _mm256_stream_si256(out, f32_to_bf16(p));
  else if (pdt == ZD_BF16 && full)
    _mm256_storeu_si256(out, f32_to_bf16(p));
  else if (pdt == ZD_BF16)
    _mm256_mask_storeu_epi16(out, k, f32_to_bf16(p));
}

/* Element i of max_exp_avg_sq; NULL (never formed from a NULL array) without amsgrad. */
AI float *max_at(const zd__adam_args_t *a, uint64_t i, int form) {
  return FORM_AMS(form) ? a->state[ZD__STATE_MAX_EXP_AVG_SQ] + i : NULL;
}

/* ... and where the update reads it (zd__adam_src). */
AI const float *in_max_at(const zd__adam_args_t *a, uint64_t i, int form) {
  return FORM_AMS(form) ? zd__adam_src(a, ZD__STATE_MAX_EXP_AVG_SQ) + i : NULL;
}

/* Prefetches the four input streams (five with amsgrad) ZD__ADAM_PREFETCH elements past element
 * i. The address is formed as an integer: it may lie past the end of the buffers, which a
 * prefetch tolerates. */
AI void prefetch(const zd__adam_args_t *a, uint64_t i, size_t gsz, int form) {
  const float *master = zd__adam_src(a, ZD__STATE_MASTER);
  const float *exp_avg = zd__adam_src(a, ZD__STATE_EXP_AVG);
  const float *exp_avg_sq = zd__adam_src(a, ZD__STATE_EXP_AVG_SQ);
  const float *max_sq = zd__adam_src(a, ZD__STATE_MAX_EXP_AVG_SQ);
  uint64_t d = ZD__ADAM_PREFETCH;
  _mm_prefetch((const char *)((uintptr_t)(master + i) + d * 4), _MM_HINT_T0);
  _mm_prefetch((const char *)((uintptr_t)(exp_avg + i) + d * 4), _MM_HINT_T0);
  _mm_prefetch((const char *)((uintptr_t)(exp_avg_sq + i) + d * 4), _MM_HINT_T0);
  if (FORM_AMS(form)) _mm_prefetch((const char *)((uintptr_t)(max_sq + i) + d * 4), _MM_HINT_T0);
  _mm_prefetch((const char *)((uintptr_t)a->grad + (i + d) * gsz), _MM_HINT_T0);
}

/* Elements [lo, hi) of one segment. A masked head first brings the master pointer to a 64-byte
 * boundary, so with equally aligned buffers (the usual case: page-aligned shards) the main loop
 * neither loads nor stores across cache lines, and the working params can be streamed. */
AI void run(const zd__adam_args_t *a, const consts_t *c, uint64_t lo, uint64_t hi, int gdt, int pdt,
            int wdm, int form, int nt) {
  float *master = a->state[ZD__STATE_MASTER], *exp_avg = a->state[ZD__STATE_EXP_AVG];
  float *exp_avg_sq = a->state[ZD__STATE_EXP_AVG_SQ];
  const float *in_master = zd__adam_src(a, ZD__STATE_MASTER);
  const float *in_exp_avg = zd__adam_src(a, ZD__STATE_EXP_AVG);
  const float *in_exp_avg_sq = zd__adam_src(a, ZD__STATE_EXP_AVG_SQ);
  size_t gsz = gdt == ZD_F32 ? 4 : 2, psz = pdt == ZD_F32 ? 4 : 2;
  const char *g = a->grad;
  char *out = a->param;
  uint64_t i = lo;
  uint64_t head = (uint64_t)(-(uintptr_t)(master + lo) / sizeof(float)) & 15;
  if (head > hi - lo) head = hi - lo;
  if (head) {
    __mmask16 k = (__mmask16)((1u << head) - 1);
    step16(in_master + i, in_exp_avg + i, in_exp_avg_sq + i, in_max_at(a, i, form), master + i,
           exp_avg + i, exp_avg_sq + i, max_at(a, i, form), g + i * gsz, out + i * psz, c, k, 0,
           gdt, pdt, wdm, form, 0, 0);
    i += head;
  }
  /* Out of place (zd__adam_args_t.src) the set written is not read by this update: its lines are
   * streamed past the cache (no read for ownership), so that the update moves no more bytes than
   * in place, where a long piece's every array written is aligned to the vector here, as master
   * is after the head. The caller's store fence (ADAM_STEP's end) orders them. */
  int ns = a->src[ZD__STATE_MASTER] && hi - i >= ZD__ADAM_NT_MIN &&
           ((uintptr_t)(master + i) | (uintptr_t)(exp_avg + i) | (uintptr_t)(exp_avg_sq + i) |
            (FORM_AMS(form) ? (uintptr_t)max_at(a, i, form) : 0)) %
                   VEC_BYTES ==
               0;
  if (nt && (uintptr_t)(out + i * psz) % (16 * psz) == 0) {
    for (; i + 16 <= hi; i += 16) {
      prefetch(a, i, gsz, form);
      step16(in_master + i, in_exp_avg + i, in_exp_avg_sq + i, in_max_at(a, i, form), master + i,
             exp_avg + i, exp_avg_sq + i, max_at(a, i, form), g + i * gsz, out + i * psz, c, 0xffff,
             1, gdt, pdt, wdm, form, 1, ns);
    }
  }
  for (; i + 16 <= hi; i += 16) {
    prefetch(a, i, gsz, form);
    step16(in_master + i, in_exp_avg + i, in_exp_avg_sq + i, in_max_at(a, i, form), master + i,
           exp_avg + i, exp_avg_sq + i, max_at(a, i, form), g + i * gsz, out + i * psz, c, 0xffff,
           1, gdt, pdt, wdm, form, 0, ns);
  }
  if (i < hi) {
    __mmask16 k = (__mmask16)((1u << (hi - i)) - 1);
    step16(in_master + i, in_exp_avg + i, in_exp_avg_sq + i, in_max_at(a, i, form), master + i,
           exp_avg + i, exp_avg_sq + i, max_at(a, i, form), g + i * gsz, out + i * psz, c, k, 0,
           gdt, pdt, wdm, form, 0, 0);
  }
}

/* One instantiation of run() per (grad dtype, output, decay, form) so the inner loop has no
 * branches. */
#define RUN_SQRT(gdt, pdt, wdm, ams)                         \
  do {                                                       \
    if (form == (F113 | ams))                                \
      run(a, &c, lo, hi, gdt, pdt, wdm, F113 | ams, nt);     \
    else if (form == (F113_MKL | ams))                       \
      run(a, &c, lo, hi, gdt, pdt, wdm, F113_MKL | ams, nt); \
    else if (form == (F2 | ams))                             \
      run(a, &c, lo, hi, gdt, pdt, wdm, F2 | ams, nt);       \
    else                                                     \
      run(a, &c, lo, hi, gdt, pdt, wdm, F2_MKL | ams, nt);   \
  } while (0)
#define RUN_FORM(gdt, pdt, wdm)       \
  do {                                \
    if (FORM_AMS(form))               \
      RUN_SQRT(gdt, pdt, wdm, F_AMS); \
    else                              \
      RUN_SQRT(gdt, pdt, wdm, 0);     \
  } while (0)
#define RUN_WD(gdt, pdt)            \
  do {                              \
    if (wdm == WD_DECAY)            \
      RUN_FORM(gdt, pdt, WD_DECAY); \
    else if (wdm == WD_L2)          \
      RUN_FORM(gdt, pdt, WD_L2);    \
    else                            \
      RUN_FORM(gdt, pdt, WD_NONE);  \
  } while (0)
#define RUN_OUT(gdt)         \
  do {                       \
    if (pdt == ZD_F32)       \
      RUN_WD(gdt, ZD_F32);   \
    else if (pdt == ZD_BF16) \
      RUN_WD(gdt, ZD_BF16);  \
    else                     \
      RUN_WD(gdt, OUT_NONE); \
  } while (0)

void ADAM_STEP(const zd__adam_args_t *a, uint64_t begin, uint64_t end) {
  int pdt = a->param ? (int)a->param_dtype : OUT_NONE;
  int nt = pdt != OUT_NONE && end > begin && end - begin >= ZD__ADAM_NT_MIN;
  for (uint32_t s = zd__segs_find(a->segs, a->nsegs, begin); s < a->nsegs; s++) {
    const zd__segment_t *seg = &a->segs[s];
    if (seg->offset >= end) break;
    uint64_t lo = seg->offset > begin ? seg->offset : begin;
    uint64_t hi = seg->offset + seg->length < end ? seg->offset + seg->length : end;
    const zd__adam_group_t *gc = &a->groups[seg->group];
    if (zd__update_is_cuda(gc->update)) { /* torch's CUDA formulas: the reference only (adam.h) */
      zd__adam_step_ref(a, lo, hi);
      continue;
    }
    int wdm = !gc->has_weight_decay ? WD_NONE : gc->optimizer == ZD_ADAMW ? WD_DECAY : WD_L2;
    int form = (gc->update == ZD_UPDATE_TORCH2 ? F2 : F113) | (gc->sqrt_mode == ZD_SQRT_MKL_EX) |
               (gc->amsgrad ? F_AMS : 0);
    consts_t c = {
        .scale = _mm512_set1_ps(a->grad_scale),
        .decay = _mm512_set1_ps(gc->decay),
        .wd = _mm512_set1_ps(gc->weight_decay),
        .b1 = _mm512_set1_ps(gc->beta1),
        .a1 = _mm512_set1_ps(gc->one_minus_beta1),
        .b2 = _mm512_set1_ps(gc->beta2),
        .a2 = _mm512_set1_ps(gc->one_minus_beta2),
        .bc2s = _mm512_set1_ps(gc->bias_correction2_sqrt),
        .nss = _mm512_set1_ps(gc->neg_step_size),
        .eps = _mm512_set1_ps(gc->eps),
        .lw = _mm512_set1_ps(gc->lerp_weight),
        .lbase = (__mmask16)(gc->lerp_from_grad ? 0xffff : 0),
        .neg = _mm512_set1_epi32(gc->negate_grad ? INT32_MIN : 0),
    };
    if (a->grad_dtype == ZD_BF16)
      RUN_OUT(ZD_BF16);
    else if (a->grad_dtype == ZD_F16)
      RUN_OUT(ZD_F16);
    else
      RUN_OUT(ZD_F32);
  }
  if (nt || a->src[ZD__STATE_MASTER]) /* streamed stores (params; out of place, the state) */
    _mm_sfence();                     /* are weakly ordered: publish them before returning */
}

#ifndef ZD_AVX512_BF16 /* the statistics write no bf16: built once */

/* Squares of 16 grads (one lane group, lanes 0..15 of adam.h's order) added to the lanes in acc,
 * and the non-finite ones among the masked lanes counted. Lanes masked off load as 0 and add
 * +0.0, which leaves a lane unchanged. fmadd equals the reference's add of x*x because the
 * square of a float is exact in double. */
AI void stats16(const void *g, __mmask16 k, int gdt, __m512d acc[2], uint64_t *bad) {
  __m512 x = load_grad(g, k, 0, gdt);
  __m512i expo = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7f800000));
  *bad += (uint64_t)__builtin_popcount(
      _mm512_mask_cmpeq_epi32_mask(k, expo, _mm512_set1_epi32(0x7f800000)));
  __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  acc[0] = _mm512_fmadd_pd(lo, lo, acc[0]);
  acc[1] = _mm512_fmadd_pd(hi, hi, acc[1]);
}

AI void stats_blocks(const void *grad, int gdt, const zd__segment_t *segs, uint32_t nsegs,
                     uint64_t n, uint64_t block_begin, uint64_t block_end, double *sums,
                     uint64_t *nonfinite) {
  const char *g = grad;
  size_t gsz = gdt == ZD_F32 ? 4 : 2;
  uint64_t bad = 0;
  for (uint64_t kb = block_begin; kb < block_end; kb++) {
    uint64_t lo = kb * ZD__STATS_BLOCK;
    uint64_t hi = lo + ZD__STATS_BLOCK < n ? lo + ZD__STATS_BLOCK : n;
    __m512d acc[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
    for (uint32_t s = zd__segs_find(segs, nsegs, lo); s < nsegs && segs[s].offset < hi; s++) {
      uint64_t b = segs[s].offset > lo ? segs[s].offset : lo;
      uint64_t e = segs[s].offset + segs[s].length < hi ? segs[s].offset + segs[s].length : hi;
      /* Lane groups start at multiples of 16 from the range start (blocks do too), so element i
       * sits in lane i % 16; a piece's partial first and last groups are masked. */
      for (uint64_t j = b & ~(uint64_t)15; j < e; j += 16) {
        uint32_t k = 0xffff;
        if (j < b) k &= 0xffffu << (b - j);
        if (j + 16 > e) k &= 0xffffu >> (j + 16 - e);
        _mm_prefetch((const char *)((uintptr_t)g + (j + ZD__ADAM_PREFETCH) * gsz), _MM_HINT_T0);
        stats16(g + j * gsz, (__mmask16)k, gdt, acc, &bad);
      }
    }
    __m512d s8 = _mm512_add_pd(acc[0], acc[1]);
    __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
    __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    sums[kb - block_begin] = _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
  }
  *nonfinite += bad;
}

void zd__grad_stats_avx512(const void *grad, zd_dtype_t dtype, const zd__segment_t *segs,
                           uint32_t nsegs, uint64_t n, uint64_t block_begin, uint64_t block_end,
                           double *sums, uint64_t *nonfinite) {
  if (dtype == ZD_BF16)
    stats_blocks(grad, ZD_BF16, segs, nsegs, n, block_begin, block_end, sums, nonfinite);
  else if (dtype == ZD_F16)
    stats_blocks(grad, ZD_F16, segs, nsegs, n, block_begin, block_end, sums, nonfinite);
  else
    stats_blocks(grad, ZD_F32, segs, nsegs, n, block_begin, block_end, sums, nonfinite);
}
#endif
