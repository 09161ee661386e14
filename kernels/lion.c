/* Lion: the lion-pytorch package's Lion (PyPI lion-pytorch 0.2.5, lion_pytorch/lion_pytorch.py,
 * its default update_fn, not the triton one) on an fp32 master shard, bit for bit (a row of the
 * optimizers' table, optim.h).
 *
 * lion-pytorch steps each parameter with Python floats lr, wd = weight_decay, beta1, beta2:
 *   p.data.mul_(1. - lr * wd)
 *   update = exp_avg.clone().mul_(beta1).add(grad, alpha = 1. - beta1).sgn_()
 *   p.add_(update, alpha = -lr)
 *   exp_avg.mul_(beta2).add_(grad, alpha = 1. - beta2)
 * The scalars are computed in Python (double) and each reaches torch's fp32 CPU kernels rounded
 * to fp32 once, as zd__lion_consts computes them from the group's doubles:
 *   f = (float)(1 - lr * weight_decay), b1 = (float)beta1, a1 = (float)(1 - beta1),
 *   b2 = (float)beta2, a2 = (float)(1 - beta2), nlr = (float)-lr
 * Per element (fp32, fmaf one fused multiply-add: torch's add(x, y, alpha) is x + alpha * y,
 * contracted by its x86-64 build, as for SGD: sgd.c):
 *   g = to_f32(grad) * grad_scale
 *   f != 1:  p = p * f                     (mul_ by 1 changes no bits: skipped)
 *   u = fma(g, a1, m * b1)
 *   s = u > 0 ? 1 : u < 0 ? -1 : 0         (sgn_: ATen's vectorised sign, a NaN as 0)
 *   p = fma(s, nlr, p)                     (s * nlr is exact: p + nlr, p - nlr or p + -0 = p)
 *   m = fma(g, a2, m * b2)
 * exp_avg starts at zero (torch.zeros_like at the first step), as zerod allocates it. Lion keeps
 * no step count and reads no other field (maximize, eps, update and sqrt_mode are ignored; its
 * decoupled_weight_decay=True is refused by zerod.torch.ZeroLion).
 * Built once per ISA level in the frame of kernels/optim_kernel.h.
 */
#include "optim_kernel.h"

/* One segment's [lo, hi); gd, out (0 none, 1 f32, 2 bf16), wd and oop are constants at each call
 * site. In place, the loads name the arrays stored to (sgd.c). */
static inline ZD__OPTIM_INLINE void lion_range(const zd__adam_args_t *a, const zd__adam_group_t *c,
                                               uint64_t lo, uint64_t hi, zd_dtype_t gd, int out,
                                               int wd, int oop) {
  float *master = a->state[ZD__STATE_MASTER], *m = a->state[ZD__STATE_EXP_AVG];
  const float *in_master = oop ? zd__adam_src(a, ZD__STATE_MASTER) : master;
  const float *in_m = oop ? zd__adam_src(a, ZD__STATE_EXP_AVG) : m;
  const void *grad = a->grad;
  const float scale = a->grad_scale, f = c->decay, b1 = c->beta1, a1 = c->one_minus_beta1;
  const float b2 = c->beta2, a2 = c->one_minus_beta2, nlr = c->neg_lr;
  float *pf = out == 1 ? (float *)a->param : NULL;
  uint16_t *pb = out == 2 ? (uint16_t *)a->param : NULL;
  for (uint64_t i = lo; i < hi; i++) {
    float g = zd__optim_grad(grad, gd, i) * scale;
    float p = in_master[i];
    if (wd) p = p * f;
    float m0 = in_m[i];
    float u = fmaf(g, a1, m0 * b1);
    float s = u > 0.0f ? 1.0f : 0.0f;
    s = u < 0.0f ? -1.0f : s;
    p = fmaf(s, nlr, p);
    m[i] = fmaf(g, a2, m0 * b2);
    master[i] = p;
    if (out == 1) pf[i] = p;
    if (out == 2) pb[i] = zd__f32_to_bf16(p);
  }
}

/* One segment's [lo, hi) with its group's constants c: its flags as constants, one loop per
 * combination (the frame walks the segments: ZD__OPTIM_SEGMENTS). */
static inline ZD__OPTIM_INLINE void lion_segment(const zd__adam_args_t *a,
                                                 const zd__adam_group_t *c, uint64_t lo,
                                                 uint64_t hi) {
  if (a->src[ZD__STATE_MASTER]) { /* out of place: every array the kernel writes has a src */
    if (c->has_weight_decay)
      ZD__OPTIM_CALL(lion_range, 1, 1);
    else
      ZD__OPTIM_CALL(lion_range, 0, 1);
  } else if (c->has_weight_decay) {
    ZD__OPTIM_CALL(lion_range, 1, 0);
  } else {
    ZD__OPTIM_CALL(lion_range, 0, 0);
  }
}

ZD__OPTIM_SEGMENTS(lion)

#ifdef ZD_OPTIM_REFERENCE
void zd__lion_consts(zd__adam_group_t *c, const zd_group_t *hp, uint64_t step) {
  (void)step;
  memset(c, 0, sizeof *c); /* padding too, so that equal constants compare equal as bytes */
  c->optimizer = hp->optimizer;
  c->update = (uint8_t)hp->update;
  c->sqrt_mode = (uint8_t)hp->sqrt_mode;
  c->decay = (float)(1.0 - hp->lr * hp->weight_decay);
  c->has_weight_decay = c->decay != 1.0f;
  c->beta1 = (float)hp->beta1;
  c->one_minus_beta1 = (float)(1.0 - hp->beta1);
  c->beta2 = (float)hp->beta2;
  c->one_minus_beta2 = (float)(1.0 - hp->beta2);
  c->neg_lr = (float)-hp->lr;
}

zd__states_t zd__lion_writes(const zd__adam_group_t *c) {
  (void)c;
  return ZD__STATE_BIT(ZD__STATE_MASTER) | ZD__STATE_BIT(ZD__STATE_EXP_AVG);
}

ZD__OPTIM_IMPL(lion)
#endif
