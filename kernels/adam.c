/* The scalar reference of the optimizer kernels (adam.h), the host-side derivation of a group's
 * per-step constants, and the run-time choice of a wide path.
 *
 * The reference is the specification the AVX2 and AVX-512 paths are tested against bit for bit,
 * so it is written for reading, not speed: one element at a time, each operation of the formula
 * in adam.h on its own line, fmaf() exactly where the formula fuses. This file is built without
 * ISA flags (fmaf is libm's, correctly rounded on any x86-64) and with -ffp-contract=off, so the
 * compiler adds no fusion of its own.
 */
#include "adam.h"

#include "optim.h"

#include <cpuid.h>
#include <math.h>
#include <string.h>

void zd__adam_consts(zd__adam_group_t *c, const zd_group_t *hp, uint64_t step) {
  /* torch computes these from Python floats (doubles) and hands the result to an fp32 kernel as a
   * scalar, so each is derived in double and rounded to float once. */
  double t = (double)step;
  memset(c, 0, sizeof *c); /* padding too, so that equal constants compare equal as bytes */
  c->optimizer = hp->optimizer;
  c->has_weight_decay = hp->weight_decay != 0;
  c->decay = (float)(1 - hp->lr * hp->weight_decay);
  c->weight_decay = (float)hp->weight_decay;
  c->beta1 = (float)hp->beta1;
  c->one_minus_beta1 = (float)(1 - hp->beta1);
  c->beta2 = (float)hp->beta2;
  c->one_minus_beta2 = (float)(1 - hp->beta2);
  c->bias_correction2_sqrt = (float)sqrt(1 - pow(hp->beta2, t));
  c->neg_step_size = (float)(-(hp->lr / (1 - pow(hp->beta1, t))));
  c->eps = (float)hp->eps;
  c->update = (uint8_t)hp->update;
  c->sqrt_mode = (uint8_t)hp->sqrt_mode;
  c->lerp_from_grad = 0;
  c->negate_grad = 0;
  c->amsgrad = (uint8_t)(hp->amsgrad != 0);
  c->lerp_weight = c->one_minus_beta1;
  if (zd__update_is_cuda(hp->update)) c->sqrt_mode = ZD_SQRT_EXACT; /* a GPU's sqrt (adam.h) */
  /* TORCH2_CUDA: torch divides by the CPU scalar bias_correction2_sqrt as a multiplication by
   * opmath_t(1.0) / b, b rounded to fp32 first (BinaryDivTrueKernel.cu). */
  c->bias_correction2_rcp = 1.0f / c->bias_correction2_sqrt;
  if (hp->update == ZD_UPDATE_TORCH2_CUDA_FUSED) {
    /* torch's fused kernel: double hyperparameters; its bias corrections are computed in double
     * and handed to the math as fp32 (opmath_t), its step_size = lr / bc1 rounded to fp32. */
    float bc1 = (float)(1 - pow(hp->beta1, t));
    c->neg_step_size = -(float)(hp->lr / (double)bc1);
    c->beta1_d = hp->beta1;
    c->one_minus_beta1_d = 1 - hp->beta1;
    c->beta2_d = hp->beta2;
    c->one_minus_beta2_d = 1 - hp->beta2;
    c->weight_decay_d = hp->optimizer == ZD_ADAMW ? hp->lr * hp->weight_decay : hp->weight_decay;
    c->eps_d = hp->eps;
    c->negate_grad = (uint8_t)(hp->maximize != 0);
  } else if (hp->update != ZD_UPDATE_TORCH113) {
    /* torch's lerp_ takes the weight as an fp32 scalar and picks its form by |w| < 0.5. */
    if (!(fabsf(c->lerp_weight) < 0.5f)) {
      c->lerp_weight = c->lerp_weight - 1.0f; /* exact: w is in [0.5, 1] */
      c->lerp_from_grad = 1;
    }
    c->negate_grad = (uint8_t)(hp->maximize != 0);
  } else if (hp->maximize) { /* torch's negated gradient, folded into the constants (adam.h) */
    c->one_minus_beta1 = -c->one_minus_beta1;
    c->weight_decay = -c->weight_decay;
  }
}

uint32_t zd__segs_find(const zd__segment_t *segs, uint32_t nsegs, uint64_t begin) {
  uint32_t lo = 0, hi = nsegs;
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (segs[mid].offset + segs[mid].length <= begin)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static float grad_at(const void *grad, zd_dtype_t dtype, uint64_t i) {
  switch (dtype) {
    case ZD_BF16:
      return zd__bf16_to_f32(((const uint16_t *)grad)[i]);
    case ZD_F16:
      return zd__f16_to_f32(((const uint16_t *)grad)[i]);
    default:
      return ((const float *)grad)[i];
  }
}

/* TORCH2_CUDA_FUSED's element after the gradient (adam.h): double operations where torch's fused
 * kernel has them (fma: libm's, correctly rounded), each (float) one rounding to fp32. *v is
 * exp_avg_sq in and out, *vmax max_exp_avg_sq (read only with amsgrad). */
static void fused_element(const zd__adam_group_t *c, int decay, int l2, float g, float *p, float *m,
                          float *v, float *vmax) {
  if (decay) *p = (float)fma(-c->weight_decay_d, (double)*p, (double)*p);
  if (l2) g = (float)fma((double)*p, c->weight_decay_d, (double)g);
  *m = (float)fma(c->beta1_d, (double)*m, c->one_minus_beta1_d * (double)g);
  *v = (float)fma(c->beta2_d, (double)*v, (c->one_minus_beta2_d * (double)g) * (double)g);
  float s = *v;
  if (c->amsgrad) s = *vmax = zd__amsgrad_max_fused(*vmax, *v);
  float q = sqrtf(s) / c->bias_correction2_sqrt;
  float d = (float)((double)q + c->eps_d);
  *p = *p + (c->neg_step_size * *m) / d;
}

void zd__adam_step_ref(const zd__adam_args_t *a, uint64_t begin, uint64_t end) {
  float *master = a->state[ZD__STATE_MASTER], *exp_avg = a->state[ZD__STATE_EXP_AVG];
  float *exp_avg_sq = a->state[ZD__STATE_EXP_AVG_SQ], *max_sq = a->state[ZD__STATE_MAX_EXP_AVG_SQ];
  const float *in_master = zd__adam_src(a, ZD__STATE_MASTER);
  const float *in_exp_avg = zd__adam_src(a, ZD__STATE_EXP_AVG);
  const float *in_exp_avg_sq = zd__adam_src(a, ZD__STATE_EXP_AVG_SQ);
  const float *in_max_sq = zd__adam_src(a, ZD__STATE_MAX_EXP_AVG_SQ);
  for (uint32_t s = zd__segs_find(a->segs, a->nsegs, begin); s < a->nsegs; s++) {
    const zd__segment_t *seg = &a->segs[s];
    if (seg->offset >= end) break;
    uint64_t lo = seg->offset > begin ? seg->offset : begin;
    uint64_t hi = seg->offset + seg->length < end ? seg->offset + seg->length : end;
    const zd__adam_group_t *c = &a->groups[seg->group];
    int decay = c->has_weight_decay && c->optimizer == ZD_ADAMW;
    int l2 = c->has_weight_decay && c->optimizer == ZD_ADAM;
    for (uint64_t i = lo; i < hi; i++) {
      float g = grad_at(a->grad, a->grad_dtype, i) * a->grad_scale;
      if (c->negate_grad) g = -g;
      float p = in_master[i];
      float m = in_exp_avg[i], v;
      if (c->update == ZD_UPDATE_TORCH2_CUDA_FUSED) {
        v = in_exp_avg_sq[i];
        float vmax = max_sq ? in_max_sq[i] : 0.0f; /* written back only with amsgrad */
        fused_element(c, decay, l2, g, &p, &m, &v, max_sq ? &vmax : NULL);
        if (c->amsgrad) max_sq[i] = vmax;
      } else if (c->update == ZD_UPDATE_TORCH2_CUDA || c->update == ZD_UPDATE_TORCH2_CUDA_FOREACH) {
        if (decay) p = p * c->decay;
        if (l2) g = fmaf(c->weight_decay, p, g);
        m = fmaf(c->lerp_weight, g - m, c->lerp_from_grad ? g : m);
        float gg = g * g; /* addcmul_'s b * c, rounded */
        v = fmaf(c->one_minus_beta2, gg, in_exp_avg_sq[i] * c->beta2);
        float s = v;
        if (c->amsgrad) s = max_sq[i] = zd__amsgrad_max_cuda(in_max_sq[i], v);
        float d;
        if (c->update == ZD_UPDATE_TORCH2_CUDA)
          d = sqrtf(s) * c->bias_correction2_rcp + c->eps;
        else
          d = sqrtf(s) / c->bias_correction2_sqrt + c->eps;
        p = fmaf(c->neg_step_size, m / d, p);
      } else {
        if (decay) p = p * c->decay;
        if (l2) g = fmaf(p, c->weight_decay, g);
        if (c->update == ZD_UPDATE_TORCH2)
          m = fmaf(c->lerp_weight, g - m, c->lerp_from_grad ? g : m);
        else
          m = fmaf(g, c->one_minus_beta1, m * c->beta1);
        v = fmaf(c->one_minus_beta2 * g, g, in_exp_avg_sq[i] * c->beta2);
        float s = v;
        if (c->amsgrad) s = max_sq[i] = zd__amsgrad_max(in_max_sq[i], v);
        s = c->sqrt_mode == ZD_SQRT_MKL_EX ? zd__sqrt_mkl_ex(s) : sqrtf(s);
        float d = s / c->bias_correction2_sqrt + c->eps;
        p = p + (c->neg_step_size * m) / d;
      }
      master[i] = p;
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
      if (a->param && a->param_dtype == ZD_BF16)
        ((uint16_t *)a->param)[i] = zd__f32_to_bf16(p);
      else if (a->param)
        ((float *)a->param)[i] = p;
    }
  }
}

void zd__grad_stats_ref(const void *grad, zd_dtype_t dtype, const zd__segment_t *segs,
                        uint32_t nsegs, uint64_t n, uint64_t block_begin, uint64_t block_end,
                        double *sums, uint64_t *nonfinite) {
  uint64_t bad = 0;
  for (uint64_t k = block_begin; k < block_end; k++) {
    uint64_t lo = k * ZD__STATS_BLOCK;
    uint64_t hi = lo + ZD__STATS_BLOCK < n ? lo + ZD__STATS_BLOCK : n;
    double lane[16] = {0};
    for (uint32_t s = zd__segs_find(segs, nsegs, lo); s < nsegs && segs[s].offset < hi; s++) {
      uint64_t b = segs[s].offset > lo ? segs[s].offset : lo;
      uint64_t e = segs[s].offset + segs[s].length < hi ? segs[s].offset + segs[s].length : hi;
      for (uint64_t i = b; i < e; i++) {
        float x = grad_at(grad, dtype, i);
        if (!isfinite(x)) bad++;
        lane[i % 16] += (double)x * (double)x; /* exact: a float's square fits a double */
      }
    }
    double s8[8], s4[4], s2[2];
    for (int j = 0; j < 8; j++) s8[j] = lane[j] + lane[j + 8];
    for (int j = 0; j < 4; j++) s4[j] = s8[j] + s8[j + 4];
    for (int j = 0; j < 2; j++) s2[j] = s4[j] + s4[j + 2];
    sums[k - block_begin] = s2[0] + s2[1];
  }
  *nonfinite += bad;
}

/* The level order of adam.h as a binary counter: part[] holds the sums of complete subtrees not
 * yet paired, of 2^lvl[] values each, sizes strictly decreasing; a new value pairs with the
 * subtree on its left while that has its own size, as level by level it would. At the end the
 * subtrees left are n's binary digits, and the levels pair each with everything to its right:
 * fold from the right. Left operand first everywhere (addition commutes anyway). */
double zd__grad_stats_sum(const double *sums, uint64_t nblocks) {
  double part[64];
  unsigned lvl[64];
  int top = 0;
  for (uint64_t k = 0; k < nblocks; k++) {
    double v = sums[k];
    unsigned l = 0;
    for (; top > 0 && lvl[top - 1] == l; l++) v = part[--top] + v;
    part[top] = v;
    lvl[top++] = l;
  }
  if (top == 0) return 0.0;
  double s = part[--top];
  while (top > 0) s = part[--top] + s;
  return s;
}

zd__isa_t zd__isa_detect(void) {
  __builtin_cpu_init();
  /* __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0). */
  int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
  if (!avx2) return ZD__ISA_SCALAR;
  /* adam_avx512.c is also built with -mfma -mf16c, hence the AVX2 level first. */
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")))
    return ZD__ISA_AVX2;
  /* AVX512_BF16: CPUID leaf 7, subleaf 1, EAX bit 5 (asked directly: not every compiler's
   * __builtin_cpu_supports knows the name). Its registers are AVX-512's, checked above. */
  unsigned eax, ebx, ecx, edx;
  int bf16 = __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax >> 5 & 1);
  return bf16 ? ZD__ISA_AVX512BF16 : ZD__ISA_AVX512;
}

const char *zd__isa_name(zd__isa_t isa) {
  switch (isa) {
    case ZD__ISA_SCALAR:
      return "scalar";
    case ZD__ISA_AVX2:
      return "avx2";
    case ZD__ISA_AVX512:
      return "avx512";
    case ZD__ISA_AVX512BF16:
      return "avx512bf16";
  }
  return "unknown";
}

int zd__isa_parse(const char *name) {
  if (strcmp(name, "auto") == 0) return (int)zd__isa_detect();
  for (int isa = ZD__ISA_SCALAR; isa <= ZD__ISA_BEST; isa++)
    if (strcmp(name, zd__isa_name((zd__isa_t)isa)) == 0) return isa;
  return -1;
}

zd__adam_fn zd__adam_impl(zd__isa_t isa) {
  switch (isa) {
    case ZD__ISA_AVX512BF16:
      return zd__adam_step_avx512bf16;
    case ZD__ISA_AVX512:
      return zd__adam_step_avx512;
    case ZD__ISA_AVX2:
      return zd__adam_step_avx2;
    default:
      return zd__adam_step_ref;
  }
}

/* The optimizers' table (optim.h): AdamW/Adam write master, the two moments and, with amsgrad,
 * max_exp_avg_sq. */
zd__states_t zd__adam_writes(const zd__adam_group_t *c) {
  zd__states_t w = ZD__STATE_BIT(ZD__STATE_MASTER) | ZD__STATE_BIT(ZD__STATE_EXP_AVG) |
                   ZD__STATE_BIT(ZD__STATE_EXP_AVG_SQ);
  if (c->amsgrad) w |= ZD__STATE_BIT(ZD__STATE_MAX_EXP_AVG_SQ);
  return w;
}

zd__stats_fn zd__grad_stats_impl(zd__isa_t isa) {
  switch (isa) {
    case ZD__ISA_AVX512BF16: /* the statistics convert no bf16 */
    case ZD__ISA_AVX512:
      return zd__grad_stats_avx512;
    case ZD__ISA_AVX2:
      return zd__grad_stats_avx2;
    default:
      return zd__grad_stats_ref;
  }
}
