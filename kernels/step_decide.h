/* What a step decides from its global gradient statistics: skip on overflow (loss scaling),
 * the loss-scaler update, the clip coefficient, and the factor the optimizer kernel multiplies
 * every gradient by; and the step record every rank contributes before it (the commit point of
 * daemon/step/step.c), with the check word that tells a record that arrived whole from a torn or
 * poisoned one. The daemon takes the decision on the host (daemon/step/step.c), and the CUDA
 * backend may take it on the device (zd__cuda_step_decide, kernels/adam_cuda.h) from the
 * all-gathered records without reading them back: both run the functions below, so that the
 * host can recompute a device decision from the same records and get the same bits.
 *
 * Plain C, header only, host and device (ZD__HD: __host__ __device__ under nvcc). Everything is
 * double as the CPU step computes it (the clip coefficient fp32, as torch computes it), and every
 * operation rounds on its own: the C build has -ffp-contract=off and the CUDA build -fmad=false
 * -prec-div=true -prec-sqrt=true -ftz=false (meson.build), division and sqrt are IEEE-correct on
 * both (double division and sqrt always are on the GPU), and there is no a*b+c that a compiler
 * could fuse anyway. So two ranks given the same statistics and state take the same decision, bit
 * for bit, on the host or on the device; only a NaN's payload may differ (grad_norm, clip_coef,
 * grad_scale: the GPU makes canonical NaNs), which no consumer reads (a NaN factor makes every
 * updated value NaN either way).
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
 * Where the client names a torch build (zd_clip_norm_t) and the CPU backend (any world size) with
 * fp32 gradients and no scaler computes that build's fp32 total of the unscaled, averaged gradient
 * (kernels/grad_norm.h), the caller passes it as cfg->total_norm and the coefficient is torch's
 * bit for bit.
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

#include "hash.h"
#include "zerod/zerod.h"

#ifdef __CUDACC__
#define ZD__HD __host__ __device__
#else
#define ZD__HD
#endif

/* The loss scaler's state. */
typedef struct zd__scaler {
  int enabled;
  zd_loss_scaler_t cfg;
  double scale;
  uint32_t growth_tracker;     /* clean steps since the last growth or overflow */
  uint32_t hysteresis_tracker; /* overflows left before the next backoff */
} zd__scaler_t;

/* Starts a scaler from its configuration (NULL or disabled: none, scale 1). Host only. */
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
  uint32_t world_size;  /* ranks whose gradients were summed */
  int32_t grad_mean;    /* gradients were summed; divide by world_size */
  int32_t need_stats;   /* statistics were gathered (world_size > 1, clipping or loss scaling) */
  int32_t torch_total;  /* 1: total_norm is the norm (torch's fp32 total: CPU, f32, no scaler) */
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
ZD__HD static inline void zd__scaler_advance(zd__scaler_t *s, int found_inf) {
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

ZD__HD static inline double zd__decide_nan(void) {
  return (double)NAN;
}

/* Takes the decision of the step after st->step from the global statistics (ignored when
 * cfg->need_stats is 0) and advances *st. Fills every field of *out. */
ZD__HD static inline void zd__step_decide(const zd__decide_cfg_t *cfg, double sumsq,
                                          uint64_t nonfinite, zd__step_state_t *st,
                                          zd__decision_t *out) {
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

/* ---- the step record and the verdict on the records of all ranks ---------------------------- */

#define ZD__CUDA_TAGS 3

/* One rank's step record: what each rank contributes to the step's all-gather (48 bytes, plain
 * data: gather it as bytes, e.g. ncclAllGather of sizeof(zd__cuda_stats_t) ncclUint8). The CUDA
 * statistics kernel writes it in device memory; the daemon's zd__step_record_t
 * (daemon/backends/compute.h) has the same layout. */
typedef struct zd__cuda_stats {
  double sumsq;       /* sum of squares in adam.h's order; ranges added in call order */
  uint64_t nonfinite; /* count of non-finite gradients */
  /* Words every rank must agree on before the update (the daemon's choice: the step word, the
   * layout hash, the hyperparameter hash); the verdict compares them. */
  uint64_t tags[ZD__CUDA_TAGS];
  uint64_t check; /* zd__record_check of the 40 bytes above */
} zd__cuda_stats_t;

/* Bytes of a record that its check word covers: everything before `check`. */
#define ZD__RECORD_CHECKED 40

/* The check word of a record (a zd__cuda_stats_t or a zd__step_record_t): FNV-1a 64
 * (common/hash.h's, restated here for device code) of its first ZD__RECORD_CHECKED bytes. A record
 * whose check word differs from this arrived torn (parts of two writes) or not at all. A receive
 * buffer filled with 0xFF bytes before the all-gather reads as damaged: the check of forty 0xFF
 * bytes is 0x8959e4b6f26c829d, not 0xffffffffffffffff; a zeroed one too (0x40d69e0cf0f65c45 is
 * not 0). tests/unit/test_decide.c checks both. */
ZD__HD static inline uint64_t zd__record_check(const void *rec) {
  const unsigned char *p = (const unsigned char *)rec;
  uint64_t h = ZD__FNV1A_INIT;
  for (int i = 0; i < ZD__RECORD_CHECKED; i++) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

/* What the records of all ranks say about a step. */
typedef enum zd__step_verdict {
  ZD__VERDICT_APPLY = 0,
  ZD__VERDICT_SKIP = 1,     /* overflow: no update, the scaler backs off */
  ZD__VERDICT_DISAGREE = 2, /* a rank's tags differ, or a rank abandoned the step */
  ZD__VERDICT_INVALID = 3,  /* a record failed its check word (torn or poisoned) */
} zd__step_verdict_t;

/* The decision taken from the records of all ranks (zd__step_decide_records). */
typedef struct zd__cuda_decision {
  int32_t verdict;     /* zd__step_verdict_t */
  int32_t bad_rank;    /* DISAGREE/INVALID: the rank at fault that agree() names; else -1 */
  int32_t checkpoint;  /* APPLY/SKIP: some rank's step word had checkpoint_bit set; else 0 */
  int32_t pad;         /* 0 */
  double sumsq;        /* APPLY/SKIP: rank-order sum of the records' sumsq, from 0; else 0 */
  uint64_t nonfinite;  /* APPLY/SKIP: sum of the records' nonfinite; else 0 */
  zd__decision_t dec;  /* APPLY/SKIP: zd__step_decide's output; else every field 0 */
  zd__step_state_t st; /* APPLY/SKIP: the state after it; else the input state */
} zd__cuda_decision_t;

/* The inputs of a decision from records. */
typedef struct zd__cuda_decide_args {
  const zd__cuda_stats_t *d_all; /* device: world_size records, rank r's at r (the kernel's) */
  uint32_t world_size, mine;     /* mine: this rank (whose tags the others must equal) */
  uint64_t step_mask;            /* tags[0] (the step word) compared under this mask */
  uint64_t checkpoint_bit;       /* OR-ed across ranks into ->checkpoint */
  uint64_t abandoned;            /* a step word equal to this (all bits): DISAGREE */
  zd__decide_cfg_t cfg;          /* host copy, passed by value in the launch */
  zd__step_state_t st;           /* host copy, by value */
} zd__cuda_decide_args_t;

/* Every field of a decision 0 (no libc: device code too). */
ZD__HD static inline void zd__decision_clear(zd__decision_t *d) {
  d->sumsq = 0;
  d->nonfinite = 0;
  d->grad_norm = 0;
  d->clip_coef = 0;
  d->loss_scale = 0;
  d->step = 0;
  d->steps_skipped = 0;
  d->grad_scale = 0;
  d->skip = 0;
  d->applied = 0;
  d->overflow = 0;
}

/* The decision of a step from the records of all ranks (all: world_size records, rank r's at r,
 * host or device memory as the caller runs; a->d_all is not read), in daemon/step/step.c agree()'s
 * order of checks, so that both name the same rank:
 *   1. INVALID: the lowest rank whose record fails its check word;
 *   2. DISAGREE: the lowest rank whose step word equals a->abandoned exactly (all 64 bits);
 *   3. DISAGREE: the lowest rank whose tags differ from rank a->mine's (tags[0] under
 *      a->step_mask, the others whole);
 *   4. otherwise sumsq (from 0, rank 0 first) and nonfinite summed over the ranks, checkpoint the
 *      OR of (tags[0] & a->checkpoint_bit) != 0, and zd__step_decide(cfg, sumsq, nonfinite, st):
 *      SKIP when it skips, else APPLY.
 * a->mine outside the world (or world_size 0) is INVALID with bad_rank -1 (the launcher refuses
 * it first). Fills every field of *out. */
ZD__HD static inline void zd__step_decide_records(const zd__cuda_decide_args_t *a,
                                                  const zd__cuda_stats_t *all,
                                                  zd__cuda_decision_t *out) {
  const uint32_t w = a->world_size;
  out->verdict = ZD__VERDICT_APPLY;
  out->bad_rank = -1;
  out->checkpoint = 0;
  out->pad = 0;
  out->sumsq = 0;
  out->nonfinite = 0;
  zd__decision_clear(&out->dec);
  out->st = a->st;
  if (w == 0 || a->mine >= w) {
    out->verdict = ZD__VERDICT_INVALID;
    return;
  }
  for (uint32_t r = 0; r < w; r++)
    if (all[r].check != zd__record_check(&all[r])) {
      out->verdict = ZD__VERDICT_INVALID;
      out->bad_rank = (int32_t)r;
      return;
    }
  for (uint32_t r = 0; r < w; r++)
    if (all[r].tags[0] == a->abandoned) {
      out->verdict = ZD__VERDICT_DISAGREE;
      out->bad_rank = (int32_t)r;
      return;
    }
  const zd__cuda_stats_t *mine = &all[a->mine];
  double sumsq = 0;
  uint64_t nonfinite = 0;
  int32_t checkpoint = 0;
  for (uint32_t r = 0; r < w; r++) {
    int differ = (all[r].tags[0] & a->step_mask) != (mine->tags[0] & a->step_mask);
    for (int j = 1; j < ZD__CUDA_TAGS; j++) differ |= all[r].tags[j] != mine->tags[j];
    if (differ) {
      out->verdict = ZD__VERDICT_DISAGREE;
      out->bad_rank = (int32_t)r;
      return;
    }
    if (all[r].tags[0] & a->checkpoint_bit) checkpoint = 1;
    sumsq += all[r].sumsq;
    nonfinite += all[r].nonfinite;
  }
  zd__step_state_t st = a->st;
  zd__step_decide(&a->cfg, sumsq, nonfinite, &st, &out->dec);
  out->verdict = out->dec.skip ? ZD__VERDICT_SKIP : ZD__VERDICT_APPLY;
  out->checkpoint = checkpoint;
  out->sumsq = sumsq;
  out->nonfinite = nonfinite;
  out->st = st;
}

/* 1 when two decisions are the same, field by field (padding ignored): integers equal, doubles
 * and floats with the same bits or both NaN (see above: a NaN's payload may differ between host
 * and device). For the host to compare the device's decision with its own. Host only. */
static inline int zd__decision_bits_same(double a, double b) {
  uint64_t x, y;
  memcpy(&x, &a, sizeof x);
  memcpy(&y, &b, sizeof y);
  return x == y || (a != a && b != b);
}

static inline int zd__cuda_decision_same(const zd__cuda_decision_t *a,
                                         const zd__cuda_decision_t *b) {
  const zd__decision_t *x = &a->dec, *y = &b->dec;
  const zd__scaler_t *s = &a->st.scaler, *t = &b->st.scaler;
  return a->verdict == b->verdict && a->bad_rank == b->bad_rank && a->checkpoint == b->checkpoint &&
         zd__decision_bits_same(a->sumsq, b->sumsq) && a->nonfinite == b->nonfinite &&
         zd__decision_bits_same(x->sumsq, y->sumsq) && x->nonfinite == y->nonfinite &&
         zd__decision_bits_same(x->grad_norm, y->grad_norm) &&
         zd__decision_bits_same(x->clip_coef, y->clip_coef) &&
         zd__decision_bits_same(x->loss_scale, y->loss_scale) && x->step == y->step &&
         x->steps_skipped == y->steps_skipped &&
         zd__decision_bits_same((double)x->grad_scale, (double)y->grad_scale) &&
         x->skip == y->skip && x->applied == y->applied && x->overflow == y->overflow &&
         s->enabled == t->enabled && zd__decision_bits_same(s->scale, t->scale) &&
         s->growth_tracker == t->growth_tracker && s->hysteresis_tracker == t->hysteresis_tracker &&
         a->st.step == b->st.step && a->st.steps_skipped == b->st.steps_skipped;
}

#endif /* ZD_KERNELS_STEP_DECIDE_H */
