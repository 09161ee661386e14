/* The AVX2 path of the optimizer kernels (adam.h): 8 elements per vector. AVX2 has no masked
 * 16-bit loads, so a segment's head and tail (fewer than 8 elements) are copied into zeroed
 * 8-element buffers, run through the same vector code, and the covered part copied back: every
 * element goes through one sequence of instructions and nothing outside the segment is touched.
 *
 * Built with -mavx2 -mfma -mf16c and called only through zd__adam_impl / zd__grad_stats_impl once
 * zd__isa_detect() has said the CPU runs it. Bitwise equality with the scalar reference rests on:
 * each intrinsic being one IEEE operation rounded to nearest even, _mm256_fmadd_ps exactly where
 * the reference calls fmaf(), the same operand order, and -ffp-contract=off (GCC's _mm256_mul_ps /
 * _add_ps are plain vector operators it could otherwise fuse). vcvtph2ps converts f16 exactly.
 */
#include <immintrin.h>
#include <string.h>

#include "adam.h"

#define AI        static inline __attribute__((always_inline))
#define VEC_BYTES 32 /* one vector */

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
  __m256 scale, decay, wd, b1, a1, b2, a2, bc2s, nss, eps;
  __m256 lw;    /* TORCH2: lerp_weight */
  __m256 lbase; /* TORCH2: all ones where the lerp starts from g (lerp_from_grad), else zero */
  __m256 neg;   /* TORCH2: the sign bit where the gradient is negated (maximize), else zero */
} consts_t;

/* 8 grads of dtype gdt at g, as f32 (exact for every dtype). */
AI __m256 load_grad(const void *g, int gdt) {
  if (gdt == ZD_F32) return _mm256_loadu_ps(g);
  __m128i h = _mm_loadu_si128(g);
  if (gdt == ZD_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* zd__f32_to_bf16 on 8 lanes: round to nearest even on the bits, NaN -> 0x7fc0. */
AI __m128i f32_to_bf16(__m256 x) {
  __m256i u = _mm256_castps_si256(x);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  /* Every lane is <= 0xffff now, so the unsigned saturating pack just narrows. */
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* zd__sqrt_mkl_ex on 8 lanes. vrsqrtps gives rsqrtss's bits lane by lane (the same table on one
 * CPU); the special lanes take the correctly rounded sqrt, as MKL's scalar path does. */
AI __m256 sqrt_mkl_ex(__m256 x) {
  const __m256 half = _mm256_set1_ps(0.5f);
  __m256 r = _mm256_rsqrt_ps(x);
  __m256 s = _mm256_mul_ps(x, r);
  __m256 h = _mm256_mul_ps(r, half);
  __m256 e = _mm256_sub_ps(half, _mm256_mul_ps(s, h));
  __m256 s1 = _mm256_add_ps(_mm256_mul_ps(s, e), s);
  __m256 h1 = _mm256_add_ps(_mm256_mul_ps(h, e), h);
  __m256 d = _mm256_sub_ps(x, _mm256_mul_ps(s1, s1));
  __m256 y = _mm256_add_ps(_mm256_mul_ps(d, h1), s1);
  __m256i t = _mm256_add_epi32(_mm256_castps_si256(x), _mm256_set1_epi32((int)ZD__MKL_EX_BIAS));
  __m256i special = _mm256_cmpgt_epi32(t, _mm256_set1_epi32(ZD__MKL_EX_LIMIT));
  /* Special lanes are rare in training (a zero second moment): the sqrt only when one is here. */
  if (_mm256_testz_si256(special, special)) return y;
  return _mm256_blendv_ps(y, _mm256_sqrt_ps(x), _mm256_castsi256_ps(special));
}

/* zd__amsgrad_max on 8 lanes, as ATen's Vectorized<float>::maximum: all ones where unordered. */
AI __m256 amsgrad_max(__m256 vmax, __m256 v) {
  return _mm256_or_ps(_mm256_max_ps(vmax, v), _mm256_cmp_ps(vmax, v, _CMP_UNORD_Q));
}

/* The update of 8 consecutive elements; the formula and its order are adam.h's. The dtype,
 * decay, form and nt arguments are constants at every call, so each combination compiles to its
 * own branch-free loop. nt: stream the working params (`out` aligned to the vector). mx: the
 * max_exp_avg_sq elements (read only with amsgrad). */
AI void step8(const float *rp, const float *rm, const float *rv, const float *rx, float *mp,
              float *mm, float *mv, float *mx, const void *gp, void *out, const consts_t *c,
              int gdt, int pdt, int wdm, int form, int nt, int ns) {
  __m256 g = _mm256_mul_ps(load_grad(gp, gdt), c->scale);
  if (FORM_TORCH2(form)) g = _mm256_xor_ps(g, c->neg);
  __m256 p = _mm256_loadu_ps(rp);
  if (wdm == WD_DECAY) p = _mm256_mul_ps(p, c->decay);
  if (wdm == WD_L2) g = _mm256_fmadd_ps(p, c->wd, g);
  __m256 m = _mm256_loadu_ps(rm);
  if (FORM_TORCH2(form))
    m = _mm256_fmadd_ps(c->lw, _mm256_sub_ps(g, m), _mm256_blendv_ps(m, g, c->lbase));
  else
    m = _mm256_fmadd_ps(g, c->a1, _mm256_mul_ps(m, c->b1));
  __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(c->a2, g), g, _mm256_mul_ps(_mm256_loadu_ps(rv), c->b2));
  __m256 s = v;
  if (FORM_AMS(form)) {
    s = amsgrad_max(_mm256_loadu_ps(rx), v);
    if (ns)
      _mm256_stream_ps(mx, s);
    else
      _mm256_storeu_ps(mx, s);
  }
  __m256 sq = FORM_MKL_EX(form) ? sqrt_mkl_ex(s) : _mm256_sqrt_ps(s);
  __m256 d = _mm256_add_ps(_mm256_div_ps(sq, c->bc2s), c->eps);
  p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c->nss, m), d));
  if (ns) { /* out of place: the other set, streamed (run) */
    _mm256_stream_ps(mp, p);
    _mm256_stream_ps(mm, m);
    _mm256_stream_ps(mv, v);
  } else {
    _mm256_storeu_ps(mp, p);
    _mm256_storeu_ps(mm, m);
    _mm256_storeu_ps(mv, v);
  }
  if (pdt == ZD_F32 && nt)
    _mm256_stream_ps(out, p);
  else if (pdt == ZD_F32)
    _mm256_storeu_ps(out, p);
  if (pdt == ZD_BF16 && nt)
    _mm_stream_si128(out, f32_to_bf16(p));
  else if (pdt == ZD_BF16)
    _mm_storeu_si128(out, f32_to_bf16(p));
}

/* Fewer than 8 elements starting at i, through zero-padded copies (zeros compute harmlessly). */
AI void step_part(const zd__adam_args_t *a, const consts_t *c, uint64_t i, uint64_t r, int gdt,
                  int pdt, int wdm, int form) {
  float *master = a->state[ZD__STATE_MASTER], *exp_avg = a->state[ZD__STATE_EXP_AVG];
  float *exp_avg_sq = a->state[ZD__STATE_EXP_AVG_SQ], *max_sq = a->state[ZD__STATE_MAX_EXP_AVG_SQ];
  size_t gsz = gdt == ZD_F32 ? 4 : 2, psz = pdt == ZD_F32 ? 4 : 2;
  float p[8] = {0}, m[8] = {0}, v[8] = {0}, x[8] = {0}, g[8] = {0}, out[8];
  memcpy(p, zd__adam_src(a, ZD__STATE_MASTER) + i, r * sizeof(float));
  memcpy(m, zd__adam_src(a, ZD__STATE_EXP_AVG) + i, r * sizeof(float));
  memcpy(v, zd__adam_src(a, ZD__STATE_EXP_AVG_SQ) + i, r * sizeof(float));
  if (FORM_AMS(form)) memcpy(x, zd__adam_src(a, ZD__STATE_MAX_EXP_AVG_SQ) + i, r * sizeof(float));
  memcpy(g, (const char *)a->grad + i * gsz, r * gsz);
  step8(p, m, v, x, p, m, v, x, g, out, c, gdt, pdt, wdm, form, 0, 0);
  memcpy(master + i, p, r * sizeof(float));
  memcpy(exp_avg + i, m, r * sizeof(float));
  memcpy(exp_avg_sq + i, v, r * sizeof(float));
  if (FORM_AMS(form)) memcpy(max_sq + i, x, r * sizeof(float));
  if (pdt != OUT_NONE) memcpy((char *)a->param + i * psz, out, r * psz);
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

/* Elements [lo, hi) of one segment. A head first brings the master pointer to a 32-byte boundary,
 * so with equally aligned buffers the main loop's accesses never straddle cache lines, and the
 * working params can be streamed. */
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
  uint64_t head = (uint64_t)(-(uintptr_t)(master + lo) / sizeof(float)) & 7;
  if (head > hi - lo) head = hi - lo;
  if (head) {
    step_part(a, c, i, head, gdt, pdt, wdm, form);
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
  if (nt && (uintptr_t)(out + i * psz) % (8 * psz) == 0) {
    for (; i + 8 <= hi; i += 8) {
      prefetch(a, i, gsz, form);
      step8(in_master + i, in_exp_avg + i, in_exp_avg_sq + i, in_max_at(a, i, form), master + i,
            exp_avg + i, exp_avg_sq + i, max_at(a, i, form), g + i * gsz, out + i * psz, c, gdt,
            pdt, wdm, form, 1, ns);
    }
  }
  for (; i + 8 <= hi; i += 8) {
    prefetch(a, i, gsz, form);
    step8(in_master + i, in_exp_avg + i, in_exp_avg_sq + i, in_max_at(a, i, form), master + i,
          exp_avg + i, exp_avg_sq + i, max_at(a, i, form), g + i * gsz, out + i * psz, c, gdt, pdt,
          wdm, form, 0, ns);
  }
  if (i < hi) step_part(a, c, i, hi - i, gdt, pdt, wdm, form);
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

void zd__adam_step_avx2(const zd__adam_args_t *a, uint64_t begin, uint64_t end) {
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
        .scale = _mm256_set1_ps(a->grad_scale),
        .decay = _mm256_set1_ps(gc->decay),
        .wd = _mm256_set1_ps(gc->weight_decay),
        .b1 = _mm256_set1_ps(gc->beta1),
        .a1 = _mm256_set1_ps(gc->one_minus_beta1),
        .b2 = _mm256_set1_ps(gc->beta2),
        .a2 = _mm256_set1_ps(gc->one_minus_beta2),
        .bc2s = _mm256_set1_ps(gc->bias_correction2_sqrt),
        .nss = _mm256_set1_ps(gc->neg_step_size),
        .eps = _mm256_set1_ps(gc->eps),
        .lw = _mm256_set1_ps(gc->lerp_weight),
        .lbase = _mm256_castsi256_ps(_mm256_set1_epi32(gc->lerp_from_grad ? -1 : 0)),
        .neg = _mm256_castsi256_ps(_mm256_set1_epi32(gc->negate_grad ? INT32_MIN : 0)),
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

/* Squares of 16 f32 values (one lane group, lanes 0..15 of adam.h's order) added to the lanes in
 * acc, and the non-finite ones counted. fmadd equals the reference's add of x*x because the square
 * of a float is exact in double. */
AI void stats16(__m256 x0, __m256 x1, __m256d acc[4], uint64_t *bad) {
  __m256i inf = _mm256_set1_epi32(0x7f800000);
  __m256i e0 = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(x0), inf), inf);
  __m256i e1 = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(x1), inf), inf);
  *bad += (uint64_t)__builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(e0))) +
          (uint64_t)__builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(e1)));
  __m256d d[4] = {
      _mm256_cvtps_pd(_mm256_castps256_ps128(x0)),
      _mm256_cvtps_pd(_mm256_extractf128_ps(x0, 1)),
      _mm256_cvtps_pd(_mm256_castps256_ps128(x1)),
      _mm256_cvtps_pd(_mm256_extractf128_ps(x1, 1)),
  };
  for (int j = 0; j < 4; j++) acc[j] = _mm256_fmadd_pd(d[j], d[j], acc[j]);
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
    __m256d acc[4];
    for (int j = 0; j < 4; j++) acc[j] = _mm256_setzero_pd();
    for (uint32_t s = zd__segs_find(segs, nsegs, lo); s < nsegs && segs[s].offset < hi; s++) {
      uint64_t b = segs[s].offset > lo ? segs[s].offset : lo;
      uint64_t e = segs[s].offset + segs[s].length < hi ? segs[s].offset + segs[s].length : hi;
      /* Lane groups start at multiples of 16 from the range start (blocks do too), so element i
       * sits in lane i % 16. A partial group is converted into a zeroed buffer: its uncovered
       * lanes add +0.0, which leaves a lane unchanged, and count as finite. */
      for (uint64_t j = b & ~(uint64_t)15; j < e; j += 16) {
        _mm_prefetch((const char *)((uintptr_t)g + (j + ZD__ADAM_PREFETCH) * gsz), _MM_HINT_T0);
        if (j >= b && j + 16 <= e) {
          stats16(load_grad(g + j * gsz, gdt), load_grad(g + (j + 8) * gsz, gdt), acc, &bad);
          continue;
        }
        float x[16] = {0};
        for (uint64_t i = j < b ? b : j; i < j + 16 && i < e; i++) {
          const void *gi = g + i * gsz;
          x[i - j] = gdt == ZD_F32   ? *(const float *)gi
                     : gdt == ZD_F16 ? _cvtsh_ss(*(const uint16_t *)gi)
                                     : zd__bf16_to_f32(*(const uint16_t *)gi);
        }
        stats16(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8), acc, &bad);
      }
    }
    __m256d s8a = _mm256_add_pd(acc[0], acc[2]); /* lanes 0..3 + lanes 8..11 */
    __m256d s8b = _mm256_add_pd(acc[1], acc[3]); /* lanes 4..7 + lanes 12..15 */
    __m256d s4 = _mm256_add_pd(s8a, s8b);
    __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    sums[kb - block_begin] = _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
  }
  *nonfinite += bad;
}

void zd__grad_stats_avx2(const void *grad, zd_dtype_t dtype, const zd__segment_t *segs,
                         uint32_t nsegs, uint64_t n, uint64_t block_begin, uint64_t block_end,
                         double *sums, uint64_t *nonfinite) {
  if (dtype == ZD_BF16)
    stats_blocks(grad, ZD_BF16, segs, nsegs, n, block_begin, block_end, sums, nonfinite);
  else if (dtype == ZD_F16)
    stats_blocks(grad, ZD_F16, segs, nsegs, n, block_begin, block_end, sums, nonfinite);
  else
    stats_blocks(grad, ZD_F32, segs, nsegs, n, block_begin, block_end, sums, nonfinite);
}
