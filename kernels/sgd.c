/* SGD: torch.optim.SGD's update of an fp32 master shard, bit for bit (a row of the optimizers'
 * table, optim.h).
 *
 * torch 1.13 and 2.x compute it alike on CPU parameters: their default implementation there is
 * the single-tensor path (_single_tensor_sgd: 1.13's foreach defaults to False; 2.x's
 * _default_to_fused_or_foreach picks foreach only for CUDA tensors), and its formula is the same
 * in both releases (torch/optim/sgd.py), so SGD needs no update variant: zd_group_t.update and
 * sqrt_mode are ignored. Constants, from the group's doubles as torch turns its Python floats
 * into fp32 scalars (zd__sgd_consts):
 *   wd = (float)weight_decay,  mu = (float)momentum,  dw = (float)(1 - dampening),
 *   nlr = (float)-lr
 * Per element, fp32 with round-to-nearest-even, fmaf() one fused multiply-add (torch's CPU
 * kernels compute add(a, b, alpha) as a + alpha * b, contracted to one fma by its x86-64 build,
 * tail included, as for Adam: adam.h):
 *   g = to_f32(grad) * grad_scale
 *   maximize:                  g = -g                             (-grads[i])
 *   weight_decay != 0:         g = fma(p, wd, g)                  (grad.add(param, alpha=wd))
 *   momentum != 0:
 *     step 1:                  b = g                              (torch.clone(d_p): the buffer
 *                                                                  is None before; no dampening)
 *     later steps:             b = fma(g, dw, b * mu)             (buf.mul_(mu).add_(d_p,
 * alpha=dw)) nesterov:                g = fma(b, mu, g)                  (d_p.add(buf, alpha=mu))
 *     else:                    g = b
 *   p = fma(g, nlr, p)                                            (param.add_(d_p, alpha=-lr))
 *   param_out = p as f32, or bf16 rounded to nearest even (common/dtype.h)
 * "Step 1" is zerod's step number (the model's, zd__adam_group_init's `step`): torch creates the
 * buffer at a parameter's first step with momentum, which for zerod's parameters (all stepped
 * together, a missing gradient as zeros) is the model's first step. A group that turns momentum
 * on later (0 at registration) lacks the array: such a step is refused (common/state.h).
 *
 * Built once per ISA level in the frame of kernels/optim_kernel.h (zd__sgd_step_<isa>; the
 * reference build carries the constants and the table's functions).
 */
#include "optim_kernel.h"

/* One segment's [lo, hi), the formula above. gd, out (0 none, 1 f32, 2 bf16) and mom are
 * constants at each call site, so each combination is its own loop. */
static inline ZD__OPTIM_INLINE void sgd_range(const zd__adam_args_t *a, const zd__adam_group_t *c,
                                              uint64_t lo, uint64_t hi, zd_dtype_t gd, int out,
                                              int mom, int oop) {
  float *master = a->state[ZD__STATE_MASTER];
  float *buf = mom ? a->state[ZD__STATE_MOMENTUM_BUFFER] : NULL;
  /* In place, the loads name the arrays stored to, so that the compiler sees one array (two
   * pointers of equal value would fail its overlap check and run the loop unvectorised). */
  const float *in_master = oop ? zd__adam_src(a, ZD__STATE_MASTER) : master;
  const float *in_buf = mom && oop ? zd__adam_src(a, ZD__STATE_MOMENTUM_BUFFER) : buf;
  const void *grad = a->grad;
  const float scale = a->grad_scale, wd = c->weight_decay, mu = c->momentum;
  const float dw = c->dampening_weight, nlr = c->neg_lr;
  const uint32_t neg = c->negate_grad ? 0x80000000u : 0u;
  const int has_wd = c->has_weight_decay, first = c->momentum_first, nesterov = c->nesterov;
  float *pf = out == 1 ? (float *)a->param : NULL;
  uint16_t *pb = out == 2 ? (uint16_t *)a->param : NULL;
  for (uint64_t i = lo; i < hi; i++) {
    float g = zd__optim_flip(zd__optim_grad(grad, gd, i) * scale, neg);
    float p = in_master[i];
    if (has_wd) g = fmaf(p, wd, g);
    if (mom) {
      float later = fmaf(g, dw, in_buf[i] * mu);
      float b = first ? g : later;
      buf[i] = b;
      g = nesterov ? fmaf(b, mu, g) : b;
    }
    p = fmaf(g, nlr, p);
    master[i] = p;
    if (out == 1) pf[i] = p;
    if (out == 2) pb[i] = zd__f32_to_bf16(p);
  }
}

/* One segment's [lo, hi) with its group's constants c: its flags as constants, one loop per
 * combination (the frame walks the segments: ZD__OPTIM_SEGMENTS). */
static inline ZD__OPTIM_INLINE void sgd_segment(const zd__adam_args_t *a, const zd__adam_group_t *c,
                                                uint64_t lo, uint64_t hi) {
  int mom = c->has_momentum && a->state[ZD__STATE_MOMENTUM_BUFFER];
  if (a->src[ZD__STATE_MASTER]) { /* out of place: every array the kernel writes has a src */
    if (mom)
      ZD__OPTIM_CALL(sgd_range, 1, 1);
    else
      ZD__OPTIM_CALL(sgd_range, 0, 1);
  } else if (mom) {
    ZD__OPTIM_CALL(sgd_range, 1, 0);
  } else {
    ZD__OPTIM_CALL(sgd_range, 0, 0);
  }
}

ZD__OPTIM_SEGMENTS(sgd)

#ifdef ZD_OPTIM_REFERENCE
void zd__sgd_consts(zd__adam_group_t *c, const zd_group_t *hp, uint64_t step) {
  memset(c, 0, sizeof *c); /* padding too, so that equal constants compare equal as bytes */
  c->optimizer = hp->optimizer;
  c->update = (uint8_t)hp->update;
  c->sqrt_mode = (uint8_t)hp->sqrt_mode;
  c->has_weight_decay = hp->weight_decay != 0;
  c->weight_decay = (float)hp->weight_decay;
  c->negate_grad = (uint8_t)(hp->maximize != 0);
  c->momentum = (float)hp->momentum;
  c->dampening_weight = (float)(1 - hp->dampening);
  c->neg_lr = (float)-hp->lr;
  c->has_momentum = hp->momentum != 0;
  c->nesterov = (uint8_t)(hp->nesterov != 0);
  c->momentum_first = step <= 1;
}

zd__states_t zd__sgd_writes(const zd__adam_group_t *c) {
  zd__states_t w = ZD__STATE_BIT(ZD__STATE_MASTER);
  if (c->has_momentum) w |= ZD__STATE_BIT(ZD__STATE_MOMENTUM_BUFFER);
  return w;
}

ZD__OPTIM_IMPL(sgd)
#endif
