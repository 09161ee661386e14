/* Adagrad: torch.optim.Adagrad's update of an fp32 master shard, bit for bit (a row of the
 * optimizers' table, optim.h).
 *
 * torch 1.13 and 2.x compute it alike on CPU parameters: the default implementation there is the
 * single-tensor path (_single_tensor_adagrad; foreach defaults to False on CPU tensors in both,
 * fused is off unless asked for) with the same formula in both releases (torch/optim/
 * adagrad.py), so Adagrad needs no update variant; zd_group_t.update is ignored, sqrt_mode is
 * not (the sqrt is torch.sqrt's, as Adam's: adam.h). Constants, from the group's doubles for step
 * number t (from 1) as torch turns its Python floats into fp32 scalars (zd__adagrad_consts):
 *   wd = (float)weight_decay,  e = (float)eps,  s0 = (float)initial_accumulator_value
 *   nclr = (float)-(lr / (1 + (t - 1) * lr_decay))       (clr in double, as Python computes it)
 * Per element, fp32 with round-to-nearest-even, fmaf() one fused multiply-add (torch's x86-64
 * build contracts a + b * c in its CPU kernels, as for Adam: adam.h):
 *   g = to_f32(grad) * grad_scale
 *   maximize:              g = -g                          (-grad)
 *   weight_decay != 0:     g = fma(p, wd, g)               (grad.add(param, alpha=wd))
 *   step 1:                s = s0, else s = sum            (torch.full_like(p, s0) at init)
 *   s = fma(g, g, s)                                       (state_sum.addcmul_(grad, grad,
 * value=1)) d = SQRT(s) + e                                        (state_sum.sqrt().add_(eps);
 * SQRT as adam.h's, per sqrt_mode) p = p + (nclr * g) / d (param.addcdiv_(grad, std, value=-clr))
 *   sum = s; param_out = p as f32 or bf16 (common/dtype.h)
 * "Step 1" is zerod's step number, as for SGD's buffer (sgd.c): zerod allocates `sum` zeroed and
 * the first step starts it at s0, so a checkpoint taken before any step holds zeros where torch's
 * Adagrad (which fills its state at construction) holds s0.
 *
 * Built once per ISA level in the frame of kernels/optim_kernel.h; the reference build carries the
 * constants and the table's functions. SQRT_MKL_EX has no vector form here: groups with it run
 * element by element in every build (same bits).
 */
#include "optim_kernel.h"
#include "sqrt_mode.h"

/* One segment's [lo, hi), the formula above; gd, out (0 none, 1 f32, 2 bf16) and mkl are
 * constants at each call site. */
static inline ZD__OPTIM_INLINE void adagrad_range(const zd__adam_args_t *a,
                                                  const zd__adam_group_t *c, uint64_t lo,
                                                  uint64_t hi, zd_dtype_t gd, int out, int mkl,
                                                  int oop) {
  float *master = a->state[ZD__STATE_MASTER];
  float *sum = a->state[ZD__STATE_SUM];
  /* In place, the loads name the arrays stored to (sgd.c). */
  const float *in_master = oop ? zd__adam_src(a, ZD__STATE_MASTER) : master;
  const float *in_sum = oop ? zd__adam_src(a, ZD__STATE_SUM) : sum;
  const void *grad = a->grad;
  const float scale = a->grad_scale, wd = c->weight_decay, e = c->eps, nclr = c->neg_clr;
  const float s0 = c->init_sum;
  const uint32_t neg = c->negate_grad ? 0x80000000u : 0u;
  const int has_wd = c->has_weight_decay, first = c->sum_first;
  float *pf = out == 1 ? (float *)a->param : NULL;
  uint16_t *pb = out == 2 ? (uint16_t *)a->param : NULL;
  for (uint64_t i = lo; i < hi; i++) {
    float g = zd__optim_flip(zd__optim_grad(grad, gd, i) * scale, neg);
    float p = in_master[i];
    if (has_wd) g = fmaf(p, wd, g);
    float s = first ? s0 : in_sum[i];
    s = fmaf(g, g, s);
    float d = (mkl ? zd__sqrt_mkl_ex(s) : sqrtf(s)) + e;
    p = p + (nclr * g) / d;
    sum[i] = s;
    master[i] = p;
    if (out == 1) pf[i] = p;
    if (out == 2) pb[i] = zd__f32_to_bf16(p);
  }
}

/* One segment's [lo, hi) with its group's constants c: its flags as constants, one loop per
 * combination (the frame walks the segments: ZD__OPTIM_SEGMENTS). */
static inline ZD__OPTIM_INLINE void adagrad_segment(const zd__adam_args_t *a,
                                                    const zd__adam_group_t *c, uint64_t lo,
                                                    uint64_t hi) {
  int mkl = c->sqrt_mode == ZD_SQRT_MKL_EX;
  if (a->src[ZD__STATE_MASTER]) { /* out of place: every array the kernel writes has a src */
    if (mkl)
      ZD__OPTIM_CALL(adagrad_range, 1, 1);
    else
      ZD__OPTIM_CALL(adagrad_range, 0, 1);
  } else if (mkl) {
    ZD__OPTIM_CALL(adagrad_range, 1, 0);
  } else {
    ZD__OPTIM_CALL(adagrad_range, 0, 0);
  }
}

ZD__OPTIM_SEGMENTS(adagrad)

#ifdef ZD_OPTIM_REFERENCE
void zd__adagrad_consts(zd__adam_group_t *c, const zd_group_t *hp, uint64_t step) {
  memset(c, 0, sizeof *c); /* padding too, so that equal constants compare equal as bytes */
  double t = step ? (double)step : 1.0;
  c->optimizer = hp->optimizer;
  c->update = (uint8_t)hp->update;
  c->sqrt_mode = (uint8_t)hp->sqrt_mode;
  c->has_weight_decay = hp->weight_decay != 0;
  c->weight_decay = (float)hp->weight_decay;
  c->negate_grad = (uint8_t)(hp->maximize != 0);
  c->eps = (float)hp->eps;
  double clr = hp->lr / (1 + (t - 1) * hp->lr_decay);
  c->neg_clr = (float)-clr;
  c->init_sum = (float)hp->initial_accumulator_value;
  c->sum_first = step <= 1;
}

zd__states_t zd__adagrad_writes(const zd__adam_group_t *c) {
  (void)c;
  return ZD__STATE_BIT(ZD__STATE_MASTER) | ZD__STATE_BIT(ZD__STATE_SUM);
}

ZD__OPTIM_IMPL(adagrad)
#endif
