/* What a step decides from its global gradient statistics: skip on overflow (loss scaling),
 * the loss-scaler update, the clip coefficient, and the factor the optimizer kernel multiplies
 * every gradient by. The daemon takes it on the host for both backends (daemon/step/step.c; the
 * CUDA backend reads the ranks' records back first: docs/design.md, "Where the host waits"), so
 * that an update is queued only after every record arrived intact.
 *
 * Plain C, header only. Everything is double as the CPU step computes it (the clip coefficient
 * fp32, as torch computes it), and every operation rounds on its own: the build has
 * -ffp-contract=off, division and sqrt are IEEE-correct, and there is no a*b+c that a compiler
 * could fuse anyway. So two ranks given the same statistics and state take the same decision, bit
 * for bit.
 *
 * The semantics are step.c's: pre_scale = (grad_mean ? 1/world_size : 1) / loss_scale; the
 * norm of the unscaled, averaged gradient is sqrt(sumsq) * pre_scale (NaN when statistics are
 * not gathered); with the scaler on, any non-finite gradient skips the step (parameters,
 * moments and step counter unchanged) and backs the scale off; otherwise, when max_grad_norm >
 * 0, clip_coef = (1 / ((float)norm + 1e-6)) * max_grad_norm in fp32 (torch.nn.utils.
 * clip_grad_norm_'s operations) where that is below 1 or NaN (a NaN or infinite norm: the
 * gradients become NaN or 0, as torch's do); grad_scale = (float)(pre_scale * clip_coef); the
 * step counter advances and the scaler counts a clean step (Megatron's DynamicGradScaler).
 * torch's total norm is an fp32 reduction of fp32 per-tensor norms; zerod's is the double sum of
 * squares above, so the coefficients are equal only where torch's total rounds to zerod's
 * (docs/torch2/README.md, "Clipping": within 4 ULP of torch's, equal in about half the steps).
 * Where the client names a torch build (zd_clip_norm_t) and the CPU backend at world size 1 with
 * fp32 gradients and no scaler computes that build's fp32 total (kernels/grad_norm.h), the
 * caller passes it as cfg->total_norm and the coefficient is torch's bit for bit.
 *
 * The dynamic loss scaler for fp16 gradients has the semantics Megatron-LM and DeepSpeed share.
 * The client multiplies its loss by `scale`; zerod unscales the gradients by 1/scale. A step whose
 * gradients hold an inf or NaN is skipped; after `hysteresis` such steps (not necessarily in a
 * row; the counter refills on growth) the scale is multiplied by backoff_factor, never below
 * min_scale. After growth_interval consecutive clean steps it is multiplied by growth_factor and
 * the hysteresis counter refills. zd__scaler_advance is a pure function of (config, state,
 * found_inf), so every rank of a world computes the same trajectory from the same global
 * found_inf.
 */
#ifndef ZD_KERNELS_STEP_DECIDE_H
#define ZD_KERNELS_STEP_DECIDE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "zerod/zerod.h"

/* The loss scaler's state. */
typedef struct zd__scaler {
  int enabled;
  zd_loss_scaler_t cfg;
  double scale;
  uint32_t growth_tracker;     /* clean steps since the last growth or overflow */
  uint32_t hysteresis_tracker; /* overflows left before the next backoff */
} zd__scaler_t;

/* Starts a scaler from its configuration (NULL or disabled: none, scale 1). */
static inline void zd__scaler_init(zd__scaler_t *s, const zd_loss_scaler_t *cfg) {
  memset(s, 0, sizeof *s);
  s->scale = 1.0;
  if (!cfg || !cfg->enabled) return;
  s->enabled = 1;
  s->cfg = *cfg;
  s->scale = cfg->initial_scale;
  s->hysteresis_tracker = cfg->hysteresis;
}

/* Per-step configuration of the decision (host values; by value into the CUDA kernel). */
typedef struct zd__decide_cfg {
  uint32_t world_size; /* ranks whose gradients were summed */
  int32_t grad_mean;   /* gradients were summed; divide by world_size */
  int32_t need_stats;  /* statistics were gathered (world_size > 1, clipping or loss scaling) */
  int32_t torch_total; /* 1: total_norm is the norm (torch's fp32 total: world size 1, no scaler) */
  double max_grad_norm; /* > 0: clip to this global norm */
  double total_norm;    /* with torch_total: the fp32 norm of the whole gradient */
} zd__decide_cfg_t;

/* State the decision reads and advances (the model's). */
typedef struct zd__step_state {
  zd__scaler_t scaler;
  uint64_t step;          /* steps applied */
  uint64_t steps_skipped; /* steps skipped for overflow */
} zd__step_state_t;

/* The outcome of one step's decision. */
typedef struct zd__decision {
  double sumsq;       /* global sum of squares of the (scaled, summed) gradients */
  uint64_t nonfinite; /* global count of non-finite gradients */
  double grad_norm;   /* norm of the true gradient (NaN without statistics) */
  double clip_coef;   /* 1 unless clipped */
  double loss_scale;  /* the scale after this step's update */
  uint64_t step;      /* steps applied, this one included when applied */
  uint64_t steps_skipped;
  float grad_scale; /* factor of every gradient in the update (0 when skipped) */
  int32_t skip;     /* 1: no update at all (overflow) */
  int32_t applied;  /* 1: the update runs */
  int32_t overflow; /* 1: skipped because of non-finite gradients */
} zd__decision_t;

/* One step of the loss scaler (Megatron's DynamicGradScaler.update()). */
static inline void zd__scaler_advance(zd__scaler_t *s, int found_inf) {
  if (!s->enabled) return;
  if (found_inf) {
    s->growth_tracker = 0;
    if (s->hysteresis_tracker > 0) s->hysteresis_tracker--;
    if (s->hysteresis_tracker == 0) {
      double next = s->scale * s->cfg.backoff_factor;
      s->scale = next > s->cfg.min_scale ? next : s->cfg.min_scale;
    }
    return;
  }
  if (++s->growth_tracker == s->cfg.growth_interval) {
    s->growth_tracker = 0;
    s->hysteresis_tracker = s->cfg.hysteresis;
    s->scale *= s->cfg.growth_factor;
  }
}

static inline double zd__decide_nan(void) {
  return (double)NAN;
}

static inline int zd__decide_finite(double x) {
  return isfinite(x) != 0;
}

/* Takes the decision of the step after st->step from the global statistics (ignored when
 * cfg->need_stats is 0) and advances *st. Fills every field of *out. */
static inline void zd__step_decide(const zd__decide_cfg_t *cfg, double sumsq, uint64_t nonfinite,
                                   zd__step_state_t *st, zd__decision_t *out) {
  if (!cfg->need_stats) {
    sumsq = 0;
    nonfinite = 0;
  }
  double pre_scale = (cfg->grad_mean ? 1.0 / cfg->world_size : 1.0) / st->scaler.scale;
  double norm = !cfg->need_stats   ? zd__decide_nan()
                : cfg->torch_total ? cfg->total_norm
                                   : sqrt(sumsq) * pre_scale;
  out->sumsq = sumsq;
  out->nonfinite = nonfinite;
  out->grad_norm = norm;
  out->clip_coef = 1.0;
  out->grad_scale = 0.0f;
  out->overflow = 0;
  if (st->scaler.enabled && nonfinite > 0) {
    zd__scaler_advance(&st->scaler, 1);
    st->steps_skipped++;
    out->skip = 1;
    out->applied = 0;
    out->overflow = 1;
  } else {
    if (cfg->max_grad_norm > 0) {
      /* torch.nn.utils.clip_grad_norm_'s coefficient, in fp32 as torch computes it from its fp32
       * total norm: max_norm / (total + 1e-6) is Tensor.__rtruediv__, a reciprocal times
       * max_norm; clamp(max=1) keeps a NaN. A NaN norm makes every gradient NaN, an infinite
       * one every finite gradient 0 (and the infinite ones NaN), as in torch. */
      float total = (float)norm;
      float coef = (1.0f / (total + (float)1e-6)) * (float)cfg->max_grad_norm;
      if (!(coef >= 1.0f)) out->clip_coef = coef;
    }
    out->grad_scale = (float)(pre_scale * out->clip_coef);
    st->step++;
    zd__scaler_advance(&st->scaler, 0);
    out->skip = 0;
    out->applied = 1;
  }
  out->loss_scale = st->scaler.scale;
  out->step = st->step;
  out->steps_skipped = st->steps_skipped;
}

#endif /* ZD_KERNELS_STEP_DECIDE_H */
