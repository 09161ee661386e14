/* RMSprop: torch.optim.RMSprop's update of an fp32 master shard, bit for bit (a row of the
 * optimizers' table, optim.h).
 *
 * torch's default implementation on CPU parameters is the single-tensor path in 1.13 and 2.x
 * (_single_tensor_rmsprop: foreach defaults to False on CPU tensors). The releases differ in the
 * centered average only: 1.13 computes grad_avg.mul_(alpha).add_(grad, alpha=1 - alpha), 2.x
 * grad_avg.lerp_(grad, 1 - alpha); zd_group_t.update picks it (ZD_UPDATE_TORCH113 or
 * ZD_UPDATE_TORCH2, as for Adam's first moment: adam.h), sqrt_mode the sqrt. Constants
 * (zd__rmsprop_consts), from the group's doubles as torch's fp32 scalars:
 *   wd = (float)weight_decay, a = (float)alpha, a1 = (float)(1 - alpha), mu = (float)momentum,
 *   e = (float)eps, nlr = (float)-lr, and TORCH2's lerp weight w = a1 split as adam.h's
 * Per element (fp32, fmaf one fused multiply-add; torch's x86-64 build contracts a + b * c):
 *   g = to_f32(grad) * grad_scale;  maximize: g = -g;  weight_decay != 0: g = fma(p, wd, g)
 *   sq = fma(a1 * g, g, sq * a)                     (square_avg.mul_(a).addcmul_(g, g, value=a1))
 *   centered, TORCH113:  ga = fma(g, a1, ga * a)    (grad_avg.mul_(a).add_(g, alpha=a1))
 *   centered, TORCH2:    ga = fma(w, g - ga, from_grad ? g : ga)   (grad_avg.lerp_(g, a1))
 *   centered:            x = fma(-ga, ga, sq)       (square_avg.addcmul(ga, ga, value=-1))
 *   else:                x = sq
 *   d = SQRT(x) + e                                 (.sqrt(), add_(eps); SQRT per sqrt_mode)
 *   momentum != 0:  b = b * mu + g / d;  p = fma(b, nlr, p)   (buf.mul_(mu).addcdiv_(g, avg);
 *                                                              param.add_(buf, alpha=-lr))
 *   else:           p = p + (nlr * g) / d          (param.addcdiv_(g, avg, value=-lr))
 * square_avg, grad_avg and the buffer start at zero (torch.zeros_like), as zerod allocates them.
 * Built once per ISA level in the frame of kernels/optim_kernel.h.
 */
#include "optim_kernel.h"
#include "sqrt_mode.h"

/* One segment's [lo, hi); gd, out (0 none, 1 f32, 2 bf16), mom, cen, oop and mkl are constants at
 * each call site but rms_mkl's. In place, the loads name the arrays stored to (sgd.c). */
static inline ZD__OPTIM_INLINE void rms_range(const zd__adam_args_t *a, const zd__adam_group_t *c,
                                              uint64_t lo, uint64_t hi, zd_dtype_t gd, int out,
                                              int mom, int cen, int oop, int mkl) {
  float *master = a->state[ZD__STATE_MASTER], *sq = a->state[ZD__STATE_SQUARE_AVG];
  float *buf = mom ? a->state[ZD__STATE_MOMENTUM_BUFFER] : NULL;
  float *ga = cen ? a->state[ZD__STATE_GRAD_AVG] : NULL;
  const float *in_master = oop ? zd__adam_src(a, ZD__STATE_MASTER) : master;
  const float *in_sq = oop ? zd__adam_src(a, ZD__STATE_SQUARE_AVG) : sq;
  const float *in_buf = mom && oop ? zd__adam_src(a, ZD__STATE_MOMENTUM_BUFFER) : buf;
  const float *in_ga = cen && oop ? zd__adam_src(a, ZD__STATE_GRAD_AVG) : ga;
  const void *grad = a->grad;
  const float scale = a->grad_scale, wd = c->weight_decay, al = c->alpha, a1 = c->one_minus_alpha;
  const float mu = c->momentum, e = c->eps, nlr = c->neg_lr, w = c->lerp_weight;
  const uint32_t neg = c->negate_grad ? 0x80000000u : 0u;
  /* Weight decay, the centered average's two forms and the lerp's two bases are picked by masks
   * on the bits, not by branches: gcc does not if-convert a floating-point select, and a loop this
   * size is not unswitched for it (the loop stayed scalar). */
  const uint32_t has_wd = c->has_weight_decay ? ~0u : 0u;
  const uint32_t lerp = c->update == ZD_UPDATE_TORCH2 ? ~0u : 0u;
  const uint32_t from_grad = c->lerp_from_grad ? ~0u : 0u;
  float *pf = out == 1 ? (float *)a->param : NULL;
  uint16_t *pb = out == 2 ? (uint16_t *)a->param : NULL;
  for (uint64_t i = lo; i < hi; i++) {
    float g = zd__optim_flip(zd__optim_grad(grad, gd, i) * scale, neg);
    float p = in_master[i];
    g = zd__optim_pick(has_wd, fmaf(p, wd, g), g);
    float s = fmaf(a1 * g, g, in_sq[i] * al);
    sq[i] = s;
    float x = s;
    if (cen) {
      float m = in_ga[i];
      float m1 = fmaf(g, a1, m * al);
      float m2 = fmaf(w, g - m, zd__optim_pick(from_grad, g, m));
      m = zd__optim_pick(lerp, m2, m1);
      ga[i] = m;
      x = fmaf(-m, m, s);
    }
    float d = (mkl ? zd__sqrt_mkl_ex(x) : sqrtf(x)) + e;
    if (mom) {
      float b = in_buf[i] * mu + g / d;
      buf[i] = b;
      p = fmaf(b, nlr, p);
    } else {
      p = p + (nlr * g) / d;
    }
    master[i] = p;
    if (out == 1) pf[i] = p;
    if (out == 2) pb[i] = zd__f32_to_bf16(p);
  }
}

#define RMS_CEN(mom, oop)                        \
  do {                                           \
    if (cen)                                     \
      ZD__OPTIM_CALL(rms_range, mom, 1, oop, 0); \
    else                                         \
      ZD__OPTIM_CALL(rms_range, mom, 0, oop, 0); \
  } while (0)

/* ZD_SQRT_MKL_EX, whose sqrt has no vector form here: one loop with the flags at run time,
 * element by element (same bits). */
static __attribute__((noinline)) void rms_mkl(const zd__adam_args_t *a, const zd__adam_group_t *c,
                                              uint64_t lo, uint64_t hi, int mom, int cen, int oop) {
  int out = !a->param ? 0 : a->param_dtype == ZD_BF16 ? 2 : 1;
  rms_range(a, c, lo, hi, a->grad_dtype, out, mom, cen, oop, 1);
}

/* One segment's [lo, hi) with its group's constants c: its flags as constants, one loop per
 * combination (the frame walks the segments: ZD__OPTIM_SEGMENTS). */
static inline ZD__OPTIM_INLINE void rmsprop_segment(const zd__adam_args_t *a,
                                                    const zd__adam_group_t *c, uint64_t lo,
                                                    uint64_t hi) {
  int mom = c->has_momentum && a->state[ZD__STATE_MOMENTUM_BUFFER];
  int cen = c->centered && a->state[ZD__STATE_GRAD_AVG];
  if (c->sqrt_mode == ZD_SQRT_MKL_EX) {
    rms_mkl(a, c, lo, hi, mom, cen, a->src[ZD__STATE_MASTER] != NULL);
    return;
  }
  if (a->src[ZD__STATE_MASTER]) { /* out of place: every array the kernel writes has a src */
    if (mom)
      RMS_CEN(1, 1);
    else
      RMS_CEN(0, 1);
  } else if (mom) {
    RMS_CEN(1, 0);
  } else {
    RMS_CEN(0, 0);
  }
}

ZD__OPTIM_SEGMENTS(rmsprop)

#ifdef ZD_OPTIM_REFERENCE
void zd__rmsprop_consts(zd__adam_group_t *c, const zd_group_t *hp, uint64_t step) {
  (void)step;
  memset(c, 0, sizeof *c); /* padding too, so that equal constants compare equal as bytes */
  c->optimizer = hp->optimizer;
  c->update = (uint8_t)hp->update;
  c->sqrt_mode = (uint8_t)hp->sqrt_mode;
  c->has_weight_decay = hp->weight_decay != 0;
  c->weight_decay = (float)hp->weight_decay;
  c->negate_grad = (uint8_t)(hp->maximize != 0);
  c->eps = (float)hp->eps;
  c->alpha = (float)hp->alpha;
  c->one_minus_alpha = (float)(1 - hp->alpha);
  c->momentum = (float)hp->momentum;
  c->has_momentum = hp->momentum != 0;
  c->neg_lr = (float)-hp->lr;
  c->centered = (uint8_t)(hp->centered != 0);
  c->lerp_weight = c->one_minus_alpha; /* torch's lerp_ picks its form by |w| < 0.5 (adam.h) */
  if (!(fabsf(c->lerp_weight) < 0.5f)) {
    c->lerp_weight = c->lerp_weight - 1.0f;
    c->lerp_from_grad = 1;
  }
}

zd__states_t zd__rmsprop_writes(const zd__adam_group_t *c) {
  zd__states_t w = ZD__STATE_BIT(ZD__STATE_MASTER) | ZD__STATE_BIT(ZD__STATE_SQUARE_AVG);
  if (c->has_momentum) w |= ZD__STATE_BIT(ZD__STATE_MOMENTUM_BUFFER);
  if (c->centered) w |= ZD__STATE_BIT(ZD__STATE_GRAD_AVG);
  return w;
}

ZD__OPTIM_IMPL(rmsprop)
#endif
