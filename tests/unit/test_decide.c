/* The step decision (kernels/step_decide.h) and the order of the statistics' sum (kernels/adam.h):
 *   decide    zd__step_decide against daemon/step/step.c's decision restated below with its own
 *             copy of Megatron's scaler update, over random configurations and long trajectories
 *             (overflows, hysteresis, growth, clipping on and off, inf and NaN sums, world sizes,
 *             mean or sum), bit for bit;
 *   tree      zd__grad_stats_sum, and kernels/adam.cu's tree emulated step for step, against the
 *             level-by-level definition of adam.h, written out literally, on sizes 0..300,
 *             around powers of two and the GPU's chunks (2048, 2049, 131073, two levels of
 *             chunks) and random ones, bit for bit;
 *   check     the record's check word: every one of its bits matters, and a receive buffer
 *             filled with 0xFF (or zeros) never reads as a record;
 *   records   zd__step_decide_records against step.c's agree() restated, over worlds with torn,
 *             poisoned, disagreeing, abandoned and checkpointing records: the same verdict, the
 *             same rank named, the same sums and decision.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adam.h"
#include "check.h"
#include "hash.h"
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

/* ---- tree ---------------------------------------------------------------------------------- */

/* adam.h's definition, level by level, literally: x'[i] = x[2i] + x[2i+1], or x[2i] when 2i+1 is
 * past the end, until one value remains. */
static double levels_sum(const double *x, uint64_t n) {
  if (n == 0) return 0.0;
  double *v = malloc(n * sizeof *v);
  CHECK(v);
  memcpy(v, x, n * sizeof *v);
  while (n > 1) {
    uint64_t half = (n + 1) / 2;
    for (uint64_t i = 0; i < half; i++) v[i] = 2 * i + 1 < n ? v[2 * i] + v[2 * i + 1] : v[2 * i];
    n = half;
  }
  double s = v[0];
  free(v);
  return s;
}

/* Block sums as the statistics make them: non-negative, of many magnitudes (so that the order of
 * the adds shows in the bits), sometimes 0, inf or NaN. */
static double random_block_sum(void) {
  uint64_t r = rnd_below(200);
  if (r == 0) return INFINITY;
  if (r == 1) return NAN;
  if (r < 10) return 0.0;
  return ldexp(1.0 + rnd_unit(), (int)rnd_below(80) - 40);
}

/* kernels/adam.cu's block_tree and its launches, step for step on the host (256 threads of 8
 * values, __shfl_down_sync as lane l reading lane l + o, thread 0 over the 8 warps; chunks of
 * 2048 per level until at most 2048 remain): the index arithmetic of the GPU's order, checked
 * where it can run. */
#define GPU_THREADS 256
#define GPU_PER     8
#define GPU_CHUNK   (GPU_THREADS * GPU_PER)

static double gpu_block_tree(const double *x, uint64_t m) {
  double warp_sum[GPU_THREADS / 32];
  for (unsigned w = 0; w < GPU_THREADS / 32; w++) {
    double lane_s[32];
    for (unsigned lane = 0; lane < 32; lane++) {
      const uint64_t base = (uint64_t)(32 * w + lane) * GPU_PER;
      double v[GPU_PER];
      for (int j = 0; j < GPU_PER; j++) v[j] = base + j < m ? x[base + j] : 0.0;
      for (int h = 1; h < GPU_PER; h *= 2)
        for (int j = 0; j < GPU_PER; j += 2 * h)
          if (base + j + h < m) v[j] = v[j] + v[j + h];
      lane_s[lane] = v[0];
    }
    for (unsigned o = 1; o < 32; o *= 2) {
      double r[32];
      for (unsigned lane = 0; lane < 32; lane++) r[lane] = lane_s[lane + o < 32 ? lane + o : lane];
      for (unsigned lane = 0; lane < 32; lane++) {
        const uint64_t base = (uint64_t)(32 * w + lane) * GPU_PER;
        if ((lane & (2 * o - 1)) == 0 && base + (uint64_t)o * GPU_PER < m)
          lane_s[lane] = lane_s[lane] + r[lane];
      }
    }
    warp_sum[w] = lane_s[0];
  }
  for (int h = 1; h < GPU_THREADS / 32; h *= 2)
    for (int j = 0; j < GPU_THREADS / 32; j += 2 * h)
      if ((uint64_t)(j + h) * 32 * GPU_PER < m) warp_sum[j] = warp_sum[j] + warp_sum[j + h];
  return warp_sum[0];
}

static double gpu_tree(const double *x, uint64_t m) {
  double *level = NULL;
  while (m > GPU_CHUNK) {
    uint64_t chunks = (m + GPU_CHUNK - 1) / GPU_CHUNK;
    double *next = malloc(chunks * sizeof *next);
    CHECK(next);
    for (uint64_t b = 0; b < chunks; b++) {
      uint64_t lo = b * GPU_CHUNK;
      next[b] = gpu_block_tree(x + lo, m - lo < GPU_CHUNK ? m - lo : GPU_CHUNK);
    }
    free(level);
    x = level = next;
    m = chunks;
  }
  double s = gpu_block_tree(x, m);
  free(level);
  return s;
}

static void test_tree(void) {
  uint64_t sizes[400], nsizes = 0;
  for (uint64_t n = 0; n <= 300; n++) sizes[nsizes++] = n;
  static const uint64_t edges[] = {511,
                                   512,
                                   513,
                                   1023,
                                   1024,
                                   1025,
                                   2047,
                                   2048,
                                   2049,
                                   4095,
                                   4096,
                                   4097,
                                   6143,
                                   131071,
                                   131072,
                                   131073,
                                   2048 * 3 + 1,
                                   1000003,
                                   2048 * 2048 + 1,
                                   2048 * 2049 + 5};
  for (size_t i = 0; i < sizeof edges / sizeof edges[0]; i++) sizes[nsizes++] = edges[i];
  for (int i = 0; i < 40; i++) sizes[nsizes++] = 1 + rnd_below(300000);
  uint64_t differ_serial = 0;
  double *x = malloc((2048 * 2049 + 5) * sizeof *x);
  CHECK(x);
  for (uint64_t k = 0; k < nsizes; k++) {
    uint64_t n = sizes[k];
    int finite = rnd_below(2) == 0; /* half the arrays without inf and NaN: order shows */
    for (uint64_t i = 0; i < n; i++) {
      x[i] = random_block_sum();
      if (finite && !isfinite(x[i])) x[i] = 1.0;
    }
    double want = levels_sum(x, n), got = zd__grad_stats_sum(x, n), gpu = gpu_tree(x, n);
    CHECK_MSG(d2u(want) == d2u(got) || (isnan(want) && isnan(got)),
              "zd__grad_stats_sum of %llu sums: %.17g (%016llx), the levels give %.17g (%016llx)",
              (unsigned long long)n, got, (unsigned long long)d2u(got), want,
              (unsigned long long)d2u(want));
    CHECK_MSG(d2u(want) == d2u(gpu) || (isnan(want) && isnan(gpu)),
              "adam.cu's tree over %llu sums, emulated: %.17g (%016llx), the levels give %.17g "
              "(%016llx)",
              (unsigned long long)n, gpu, (unsigned long long)d2u(gpu), want,
              (unsigned long long)d2u(want));
    double serial = 0.0;
    for (uint64_t i = 0; i < n; i++) serial += x[i];
    differ_serial += d2u(serial) != d2u(got) && !(isnan(serial) && isnan(got));
  }
  free(x);
  /* The test would see another order: most long finite arrays sum to other bits serially. */
  CHECK_MSG(differ_serial > 20, "only %llu of %llu sums differ from the serial order",
            (unsigned long long)differ_serial, (unsigned long long)nsizes);
  printf(
      "tree: %llu sizes (0..300, around 2^k and 2048-chunks, random; up to 2048 * 2049 + 5): "
      "zd__grad_stats_sum and adam.cu's tree (emulated) equal the level-by-level sum (%llu "
      "differ from a serial sum)\n",
      (unsigned long long)nsizes, (unsigned long long)differ_serial);
}

/* ---- check words ------------------------------------------------------------------------------
 */

static void seal(zd__cuda_stats_t *r) {
  r->check = zd__record_check(r);
}

static int intact(const zd__cuda_stats_t *r) {
  return r->check == zd__record_check(r);
}

static void random_stats_record(zd__cuda_stats_t *r) {
  memset(r, 0, sizeof *r);
  random_record(&r->sumsq, &r->nonfinite);
  for (int j = 0; j < ZD__CUDA_TAGS; j++) r->tags[j] = zd_test_rnd();
  seal(r);
}

static void test_check(void) {
  CHECK_INT_EQ(sizeof(zd__cuda_stats_t), 48);
  CHECK_INT_EQ(offsetof(zd__cuda_stats_t, check), ZD__RECORD_CHECKED);
  zd__cuda_stats_t r;
  /* A receive buffer poisoned with 0xFF, or zeroed, is not a record. */
  memset(&r, 0xff, sizeof r);
  CHECK_MSG(!intact(&r), "a record of 0xFF bytes passes its check (%016llx)",
            (unsigned long long)zd__record_check(&r));
  memset(&r, 0, sizeof r);
  CHECK_MSG(!intact(&r), "a record of zeros passes its check");
  uint64_t flips = 0;
  for (int t = 0; t < 200; t++) {
    random_stats_record(&r);
    CHECK(intact(&r));
    /* FNV-1a 64 of the 40 bytes, as common/hash.h computes it. */
    CHECK_U64_EQ(r.check, zd__fnv1a(ZD__FNV1A_INIT, &r, ZD__RECORD_CHECKED));
    for (int bit = 0; bit < 8 * (int)sizeof r; bit++) {
      zd__cuda_stats_t b = r;
      ((unsigned char *)&b)[bit / 8] ^= (unsigned char)(1u << (bit % 8));
      CHECK_MSG(!intact(&b), "record %d with bit %d flipped passes its check", t, bit);
      flips++;
    }
    /* Torn: a prefix of this record and the rest of another (or of the 0xFF poison). */
    zd__cuda_stats_t other;
    random_stats_record(&other);
    if (rnd_below(2)) memset(&other, 0xff, sizeof other);
    for (size_t cut = 1; cut < sizeof r; cut++) {
      zd__cuda_stats_t b = r;
      memcpy((char *)&b + cut, (char *)&other + cut, sizeof b - cut);
      if (!memcmp(&b, &r, sizeof b) || !memcmp(&b, &other, sizeof b)) continue; /* whole */
      CHECK_MSG(!intact(&b), "record %d torn at byte %zu passes its check", t, cut);
    }
  }
  printf("check: 0xFF and zero records fail; %llu single-bit flips and every tear fail\n",
         (unsigned long long)flips);
}

/* ---- records --------------------------------------------------------------------------------- */

#define ABANDONED UINT64_MAX
#define CKPT_BIT  (1ull << 62)

enum { AGREED, DAMAGED, ABANDONED_RANK, DIFFERENT };

/* daemon/step/step.c's agree() restated over records whose tags are (step, layout_hash,
 * hparam_hash): which check fails for which rank, the sums in rank order, the checkpoint OR. */
static int ref_agree(const zd__cuda_stats_t *all, uint32_t w, uint32_t me, uint32_t *rank,
                     double *sumsq, uint64_t *nonfinite, int *checkpoint) {
  *sumsq = 0;
  *nonfinite = 0;
  *checkpoint = 0;
  for (uint32_t r = 0; r < w; r++)
    if (all[r].check != zd__fnv1a(ZD__FNV1A_INIT, &all[r], 40)) {
      *rank = r;
      return DAMAGED;
    }
  for (uint32_t r = 0; r < w; r++)
    if (all[r].tags[0] == ABANDONED) {
      *rank = r;
      return ABANDONED_RANK;
    }
  const zd__cuda_stats_t *mine = &all[me];
  for (uint32_t r = 0; r < w; r++) {
    if (all[r].tags[1] != mine->tags[1] ||
        (all[r].tags[0] & ~CKPT_BIT) != (mine->tags[0] & ~CKPT_BIT)) {
      *rank = r;
      return DIFFERENT;
    }
    if (all[r].tags[0] & CKPT_BIT) *checkpoint = 1;
    if (all[r].tags[2] != mine->tags[2]) {
      *rank = r;
      return DIFFERENT;
    }
    *sumsq += all[r].sumsq;
    *nonfinite += all[r].nonfinite;
  }
  return AGREED;
}

/* A world's records for step `step`: mostly in agreement; sometimes one or more ranks' records
 * torn, poisoned, with another step, layout or hparam hash, abandoned, or asking for a
 * checkpoint. */
static void random_world(zd__cuda_stats_t *all, uint32_t w, uint64_t step, int need_stats) {
  const uint64_t layout = 0x1234567890abcdefull, hparam = 0xfedcba0987654321ull;
  for (uint32_t r = 0; r < w; r++) {
    memset(&all[r], 0, sizeof all[r]);
    if (need_stats) random_record(&all[r].sumsq, &all[r].nonfinite);
    all[r].tags[0] = step;
    all[r].tags[1] = layout;
    all[r].tags[2] = hparam;
  }
  uint64_t faults = rnd_below(3) == 0 ? 1 + rnd_below(3) : 0;
  for (uint64_t f = 0; f < faults; f++) {
    uint32_t r = (uint32_t)rnd_below(w);
    switch (rnd_below(6)) {
      case 0:
        all[r].tags[0] = ABANDONED;
        break;
      case 1:
        all[r].tags[0] = step + 1 + rnd_below(2);
        break;
      case 2:
        all[r].tags[1] ^= 1ull << rnd_below(64);
        break;
      case 3:
        all[r].tags[2] ^= 1ull << rnd_below(64);
        break;
      default:
        break; /* damaged below */
    }
  }
  for (uint32_t r = 0; r < w; r++) {
    if (rnd_below(4) == 0) all[r].tags[0] |= CKPT_BIT; /* also on an abandoned word: unchanged */
    seal(&all[r]);
  }
  for (uint64_t f = 0; f < faults; f++) {
    if (rnd_below(3)) continue;
    uint32_t r = (uint32_t)rnd_below(w);
    if (rnd_below(2)) {
      memset(&all[r], 0xff, sizeof all[r]); /* the all-gather never wrote it */
    } else {
      size_t cut = 1 + rnd_below(sizeof all[r] - 1);
      memset((char *)&all[r] + cut, 0xff, sizeof all[r] - cut); /* written in part */
    }
  }
}

static void test_records(void) {
  uint64_t counts[4] = {0, 0, 0, 0}, skips = 0, ckpts = 0;
  for (int traj = 0; traj < TRAJ; traj++) {
    zd__decide_cfg_t cfg;
    zd_loss_scaler_t sc;
    random_config(&cfg, &sc);
    zd__step_state_t st;
    memset(&st, 0, sizeof st);
    zd__scaler_init(&st.scaler, &sc);
    for (int t = 0; t < STEPS / 3; t++) {
      zd__cuda_stats_t all[MAX_RANKS];
      uint32_t w = cfg.world_size, me = (uint32_t)rnd_below(w);
      random_world(all, w, st.step + 1, cfg.need_stats);
      zd__cuda_decide_args_t a;
      memset(&a, 0, sizeof a);
      a.world_size = w;
      a.mine = me;
      a.step_mask = ~CKPT_BIT;
      a.checkpoint_bit = CKPT_BIT;
      a.abandoned = ABANDONED;
      a.cfg = cfg;
      a.st = st;
      zd__cuda_decision_t got;
      memset(&got, 0x5a, sizeof got); /* every field must be written */
      zd__step_decide_records(&a, all, &got);

      zd__cuda_decision_t want;
      memset(&want, 0, sizeof want);
      uint32_t rank = 0;
      int checkpoint = 0;
      int v = ref_agree(all, w, me, &rank, &want.sumsq, &want.nonfinite, &checkpoint);
      want.bad_rank = -1;
      want.st = st;
      if (v == DAMAGED) {
        want.verdict = ZD__VERDICT_INVALID;
        want.bad_rank = (int32_t)rank;
        want.sumsq = 0;
        want.nonfinite = 0;
      } else if (v != AGREED) {
        want.verdict = ZD__VERDICT_DISAGREE;
        want.bad_rank = (int32_t)rank;
        want.sumsq = 0;
        want.nonfinite = 0;
      } else {
        zd__step_decide(&cfg, want.sumsq, want.nonfinite, &want.st, &want.dec);
        want.verdict = want.dec.skip ? ZD__VERDICT_SKIP : ZD__VERDICT_APPLY;
        want.checkpoint = checkpoint;
        st = want.st; /* the trajectory goes on from applied and skipped steps */
      }
      CHECK_MSG(zd__cuda_decision_same(&want, &got),
                "trajectory %d step %d, world %u, rank %u: verdict %d rank %d checkpoint %d "
                "sumsq %.17g nonfinite %llu step %llu, want verdict %d rank %d checkpoint %d "
                "sumsq %.17g nonfinite %llu step %llu",
                traj, t, w, me, got.verdict, got.bad_rank, got.checkpoint, got.sumsq,
                (unsigned long long)got.nonfinite, (unsigned long long)got.st.step, want.verdict,
                want.bad_rank, want.checkpoint, want.sumsq, (unsigned long long)want.nonfinite,
                (unsigned long long)want.st.step);
      CHECK_INT_EQ(got.pad, 0);
      if (v == AGREED) expect_decision(&want.dec, &got.dec, "records", traj, t);
      counts[got.verdict]++;
      skips += got.verdict == ZD__VERDICT_SKIP;
      ckpts += got.checkpoint;
    }
  }
  CHECK(counts[ZD__VERDICT_APPLY] > 1000 && counts[ZD__VERDICT_SKIP] > 100 &&
        counts[ZD__VERDICT_DISAGREE] > 500 && counts[ZD__VERDICT_INVALID] > 200 && ckpts > 100);
  /* Arguments outside the world. */
  zd__cuda_decide_args_t a;
  memset(&a, 0, sizeof a);
  zd__cuda_stats_t one;
  random_stats_record(&one);
  zd__cuda_decision_t d;
  a.world_size = 1;
  a.mine = 1;
  zd__step_decide_records(&a, &one, &d);
  CHECK(d.verdict == ZD__VERDICT_INVALID && d.bad_rank == -1);
  a.world_size = 0;
  a.mine = 0;
  zd__step_decide_records(&a, &one, &d);
  CHECK(d.verdict == ZD__VERDICT_INVALID && d.bad_rank == -1);
  printf(
      "records: %llu applied, %llu skipped (%llu of those with a checkpoint), %llu "
      "disagreeing, %llu damaged: zd__step_decide_records equals step.c's agree() and "
      "decision, restated\n",
      (unsigned long long)counts[ZD__VERDICT_APPLY], (unsigned long long)skips,
      (unsigned long long)ckpts, (unsigned long long)counts[ZD__VERDICT_DISAGREE],
      (unsigned long long)counts[ZD__VERDICT_INVALID]);
}

int main(void) {
  test_host();
  test_tree();
  test_check();
  test_records();
  printf("PASS\n");
  return 0;
}
