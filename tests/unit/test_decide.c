/* The step decision (kernels/step_decide.h): zd__step_decide against daemon/step/step.c's decision
 * restated below with its own copy of Megatron's scaler update, over random configurations and
 * long trajectories (overflows, hysteresis, growth, clipping on and off, inf and NaN sums, world
 * sizes, mean or sum), bit for bit. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "step_decide.h"

/* daemon/step/step.c's decision (zd__model_step, between agree() and the update), restated with the
 * daemon's own scaler. If step.c changes, this and step_decide.h change together. */
/* Megatron's DynamicGradScaler.update(), restated independently of step_decide.h. */
static void ref_scaler_update(zd__scaler_t *s, int found_inf) {
  if (!s->enabled) return;
  if (found_inf) {
    s->growth_tracker = 0;
    if (s->hysteresis_tracker > 0) s->hysteresis_tracker--;
    if (s->hysteresis_tracker == 0)
      s->scale = fmax(s->scale * s->cfg.backoff_factor, s->cfg.min_scale);
  } else if (++s->growth_tracker == s->cfg.growth_interval) {
    s->growth_tracker = 0;
    s->hysteresis_tracker = s->cfg.hysteresis;
    s->scale *= s->cfg.growth_factor;
  }
}

static void cpu_step(const zd__decide_cfg_t *cfg, double max_grad_norm, const double *sumsqs,
                     const uint64_t *nonfinites, uint32_t nranks, zd__scaler_t *scaler,
                     uint64_t *step, uint64_t *steps_skipped, zd__decision_t *out) {
  int need_stats = cfg->world_size > 1 || max_grad_norm > 0 || scaler->enabled;
  CHECK_INT_EQ(need_stats, cfg->need_stats);
  double sumsq = 0;
  uint64_t nonfinite = 0;
  for (uint32_t r = 0; r < nranks; r++) { /* agree(): records of ranks with stats or zeros */
    sumsq += need_stats ? sumsqs[r] : 0.0;
    nonfinite += need_stats ? nonfinites[r] : 0;
  }
  double pre_scale = (cfg->grad_mean ? 1.0 / cfg->world_size : 1.0) / scaler->scale;
  double norm = need_stats ? sqrt(sumsq) * pre_scale : NAN;
  memset(out, 0, sizeof *out);
  out->sumsq = sumsq;
  out->nonfinite = nonfinite;
  out->grad_norm = norm;
  out->clip_coef = 1.0;
  if (scaler->enabled && nonfinite > 0) {
    ref_scaler_update(scaler, 1);
    (*steps_skipped)++;
    out->skip = 1;
    out->overflow = 1;
  } else {
    if (max_grad_norm > 0) { /* torch's clip_grad_norm_ coefficient, fp32 */
      float coef = (1.0f / ((float)norm + (float)1e-6)) * (float)max_grad_norm;
      if (!(coef >= 1.0f)) out->clip_coef = coef;
    }
    out->grad_scale = (float)(pre_scale * out->clip_coef);
    *step += 1;
    ref_scaler_update(scaler, 0);
    out->applied = 1;
  }
  out->loss_scale = scaler->scale;
  out->step = *step;
  out->steps_skipped = *steps_skipped;
}

static int same_double(double a, double b) {
  return d2u(a) == d2u(b) || (isnan(a) && isnan(b));
}
static int same_float(float a, float b) {
  return f2u(a) == f2u(b) || (isnan(a) && isnan(b));
}

static void expect_decision(const zd__decision_t *want, const zd__decision_t *got, const char *what,
                            int traj, int t) {
  int ok = want->skip == got->skip && want->applied == got->applied &&
           want->overflow == got->overflow && want->step == got->step &&
           want->steps_skipped == got->steps_skipped && want->nonfinite == got->nonfinite &&
           same_double(want->sumsq, got->sumsq) && same_double(want->grad_norm, got->grad_norm) &&
           same_double(want->clip_coef, got->clip_coef) &&
           same_double(want->loss_scale, got->loss_scale) &&
           same_float(want->grad_scale, got->grad_scale);
  if (ok) return;
  fprintf(stderr,
          "%s, trajectory %d step %d:\n"
          "  want applied=%d skip=%d overflow=%d step=%llu skipped=%llu sumsq=%.17g nonfinite=%llu "
          "norm=%.17g clip=%.17g scale=%.17g factor=%.9g (%08x)\n"
          "  got  applied=%d skip=%d overflow=%d step=%llu skipped=%llu sumsq=%.17g nonfinite=%llu "
          "norm=%.17g clip=%.17g scale=%.17g factor=%.9g (%08x)\n",
          what, traj, t, want->applied, want->skip, want->overflow, (unsigned long long)want->step,
          (unsigned long long)want->steps_skipped, want->sumsq, (unsigned long long)want->nonfinite,
          want->grad_norm, want->clip_coef, want->loss_scale, want->grad_scale,
          f2u(want->grad_scale), got->applied, got->skip, got->overflow,
          (unsigned long long)got->step, (unsigned long long)got->steps_skipped, got->sumsq,
          (unsigned long long)got->nonfinite, got->grad_norm, got->clip_coef, got->loss_scale,
          got->grad_scale, f2u(got->grad_scale));
  exit(1);
}

static void expect_state(const zd__step_state_t *want, const zd__step_state_t *got,
                         const char *what, int traj, int t) {
  CHECK_MSG(want->step == got->step && want->steps_skipped == got->steps_skipped &&
                d2u(want->scaler.scale) == d2u(got->scaler.scale) &&
                want->scaler.growth_tracker == got->scaler.growth_tracker &&
                want->scaler.hysteresis_tracker == got->scaler.hysteresis_tracker &&
                want->scaler.enabled == got->scaler.enabled,
            "%s, trajectory %d step %d: state step %llu/%llu skipped %llu/%llu scale %.17g/%.17g "
            "growth %u/%u hysteresis %u/%u (want/got)",
            what, traj, t, (unsigned long long)want->step, (unsigned long long)got->step,
            (unsigned long long)want->steps_skipped, (unsigned long long)got->steps_skipped,
            want->scaler.scale, got->scaler.scale, want->scaler.growth_tracker,
            got->scaler.growth_tracker, want->scaler.hysteresis_tracker,
            got->scaler.hysteresis_tracker);
}

/* A random configuration: world, mean, clipping, scaler. */
static void random_config(zd__decide_cfg_t *cfg, zd_loss_scaler_t *sc) {
  static const double norms[] = {0, 0, 1e-3, 0.5, 1.0, 10.0, 1e6};
  static const double scales[] = {1.0, 65536.0, 3.5, 1e30, 1e-30};
  memset(cfg, 0, sizeof *cfg);
  memset(sc, 0, sizeof *sc);
  cfg->world_size = 1 + (uint32_t)rnd_below(8);
  cfg->grad_mean = (int32_t)rnd_below(2);
  cfg->max_grad_norm = norms[rnd_below(7)];
  sc->enabled = (int)rnd_below(3) != 0;
  sc->initial_scale = scales[rnd_below(5)];
  sc->growth_factor = rnd_below(2) ? 2.0 : 1.5;
  sc->backoff_factor = rnd_below(2) ? 0.5 : 0.25;
  sc->growth_interval = 1 + (uint32_t)rnd_below(5);
  sc->hysteresis = (uint32_t)rnd_below(4);
  sc->min_scale = rnd_below(2) ? 1.0 : 0.0;
  cfg->need_stats = cfg->world_size > 1 || cfg->max_grad_norm > 0 || sc->enabled;
}

/* One rank's statistics of a step: mostly ordinary, sometimes extreme or non-finite. */
static void random_record(double *sumsq, uint64_t *nonfinite) {
  uint64_t r = rnd_below(20);
  *sumsq = r == 0   ? 0.0
           : r == 1 ? 4.9406564584124654e-324
           : r == 2 ? 1e308
           : r == 3 ? INFINITY
           : r == 4 ? NAN
                    : pow(10.0, (double)(int)rnd_below(61) - 30) * (1 + rnd_unit());
  *nonfinite = rnd_below(6) == 0 ? 1 + rnd_below(5) : 0;
  if (r == 3 || r == 4) *nonfinite += 1;
}

#define TRAJ      200
#define STEPS     300
#define MAX_RANKS 8

static void test_host(void) {
  uint64_t skips = 0, applies = 0, clips = 0;
  for (int traj = 0; traj < TRAJ; traj++) {
    zd__decide_cfg_t cfg;
    zd_loss_scaler_t sc;
    random_config(&cfg, &sc);
    zd__step_state_t st;
    memset(&st, 0, sizeof st);
    zd__scaler_init(&st.scaler, &sc);
    zd__scaler_t ref_scaler = st.scaler;
    uint64_t ref_step = 0, ref_skipped = 0;
    for (int t = 0; t < STEPS; t++) {
      double sums[MAX_RANKS];
      uint64_t nonf[MAX_RANKS];
      for (uint32_t r = 0; r < cfg.world_size; r++) random_record(&sums[r], &nonf[r]);
      zd__decision_t want, got;
      cpu_step(&cfg, cfg.max_grad_norm, sums, nonf, cfg.world_size, &ref_scaler, &ref_step,
               &ref_skipped, &want);
      double sumsq = 0;
      uint64_t nonfinite = 0;
      for (uint32_t r = 0; r < cfg.world_size; r++) {
        sumsq += sums[r];
        nonfinite += nonf[r];
      }
      memset(&got, 0, sizeof got);
      zd__step_decide(&cfg, sumsq, nonfinite, &st, &got);
      expect_decision(&want, &got, "zd__step_decide vs step.c's decision restated", traj, t);
      zd__step_state_t ref_state;
      memset(&ref_state, 0, sizeof ref_state);
      ref_state.scaler = ref_scaler;
      ref_state.step = ref_step;
      ref_state.steps_skipped = ref_skipped;
      expect_state(&ref_state, &st, "zd__step_decide vs step.c's decision restated", traj, t);
      skips += got.skip;
      applies += got.applied;
      clips += got.clip_coef < 1.0;
    }
  }
  CHECK(skips > 1000 && applies > 1000 && clips > 1000);
  printf(
      "decide: %d trajectories x %d steps (%llu applied, %llu clipped, %llu skipped): "
      "zd__step_decide equals step.c's decision with Megatron's scaler, restated\n",
      TRAJ, STEPS, (unsigned long long)applies, (unsigned long long)clips,
      (unsigned long long)skips);
}

int main(void) {
  test_host();
  printf("PASS\n");
  return 0;
}
