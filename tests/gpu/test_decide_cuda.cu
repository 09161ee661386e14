/* GPU tests of what a CUDA step does between the gradient statistics and the update
 * (kernels/adam.cu, kernels/decide.cu): the order of the statistics' sum, the record's check word,
 * the decision on the device and the update that takes it. Exits 77 (skipped) where no GPU can run
 * them. Each section prints a line; every check says what differs.
 *
 *   tree      zd__cuda_stats_sum over block sums the test writes (random magnitudes, zeros, inf,
 *             NaN) for block counts around the tree's chunks (2048 sums) and its second level
 *             (2048^2 sums: 2^32 gradients, whose sums alone are on the device), bitwise equal
 *             to zd__grad_stats_sum on the host; accumulation, tags, the record sealed;
 *   seal      zd__cuda_record_seal over records of any bytes: the host's check word;
 *   decide    zd__cuda_step_decide against zd__step_decide_records run on the host over the same
 *             records, over random worlds (torn, 0xFF-poisoned, disagreeing, abandoned and
 *             checkpointing records) along scaler trajectories (overflow, NaN and infinite norms,
 *             clipping, huge and tiny scales, torch's total): the same decision, bit for bit;
 *   update    zd__cuda_adam_step with d_decision, for every grad dtype x param output x
 *             max_exp_avg_sq: APPLY gives the bits of the update with the host's grad_scale;
 *             SKIP, DISAGREE and INVALID leave every array and the params untouched;
 *   grids     the occupancy grids the update and the statistics launch, per variant (printed).
 */
#include <cuda_runtime.h>

#include "gpu_check.h"
#include "group.h"
#include "step_decide.h"

static cudaStream_t stream;

static void *dmalloc(size_t bytes) {
  void *p = NULL;
  CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 16));
  return p;
}

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  CHECK_MSG(p, "out of host memory (%zu bytes)", bytes);
  return p;
}

static void h2d(void *dst, const void *src, size_t bytes) {
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream)); /* src may be reused at once */
}

static void d2h(void *dst, const void *src, size_t bytes) {
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

static int same_double(double a, double b) {
  return d2u(a) == d2u(b) || (isnan(a) && isnan(b));
}

static int intact(const zd__cuda_stats_t *r) {
  return r->check == zd__record_check(r);
}

/* ---- tree ---------------------------------------------------------------------------------- */

static double random_block_sum(void) {
  uint64_t r = rnd_below(1000);
  if (r == 0) return INFINITY;
  if (r == 1) return NAN;
  if (r < 20) return 0.0;
  return ldexp(1.0 + rnd_unit(), (int)rnd_below(80) - 40);
}

/* A range of nblocks statistics blocks that no segment covers: its statistics are all zeros,
 * then the test's own block sums replace them and zd__cuda_stats_sum adds those. */
static void run_tree(uint64_t nblocks, int finite) {
  const uint64_t n = nblocks ? nblocks * ZD__STATS_BLOCK - rnd_below(ZD__STATS_BLOCK) : 0;
  zd__cuda_layout_t *l = NULL;
  ZD_CHECK(zd__cuda_layout_create(NULL, 0, n, stream, &l, &gpu_err));
  CHECK_U64_EQ(zd__cuda_layout_stats_blocks(l), nblocks);
  void *dummy = dmalloc(16); /* no segment: never read */
  zd__cuda_stats_t *drec = (zd__cuda_stats_t *)dmalloc(sizeof *drec), rec;
  ZD_CHECK(zd__cuda_grad_stats(l, dummy, ZD_F32, drec, 0, NULL, stream, &gpu_err));
  double *x = (double *)xmalloc(nblocks * sizeof *x);
  for (uint64_t k = 0; k < nblocks; k++) {
    x[k] = random_block_sum();
    if (finite && !isfinite(x[k])) x[k] = 0.5;
  }
  if (nblocks) h2d(zd__cuda_layout_block_sums(l), x, nblocks * sizeof *x);
  const double want = zd__grad_stats_sum(x, nblocks);
  uint64_t tags[ZD__CUDA_TAGS] = {zd_test_rnd(), zd_test_rnd(), zd_test_rnd()};
  CUDA_CHECK(cudaMemsetAsync(drec, 0xff, sizeof *drec, stream));
  ZD_CHECK(zd__cuda_stats_sum(l, drec, 0, tags, stream, &gpu_err));
  d2h(&rec, drec, sizeof rec);
  CHECK_MSG(same_double(rec.sumsq, want),
            "tree, %llu block sums (%s): device %.17g (%016llx), host %.17g (%016llx)",
            (unsigned long long)nblocks, finite ? "finite" : "with inf and NaN", rec.sumsq,
            (unsigned long long)d2u(rec.sumsq), want, (unsigned long long)d2u(want));
  CHECK_U64_EQ(rec.nonfinite, 0);
  for (int j = 0; j < ZD__CUDA_TAGS; j++) CHECK_U64_EQ(rec.tags[j], tags[j]);
  CHECK_MSG(intact(&rec), "tree, %llu block sums: the record is not sealed (check %016llx)",
            (unsigned long long)nblocks, (unsigned long long)rec.check);
  /* Accumulated: the range added to the record again, tags kept, sealed again. */
  ZD_CHECK(zd__cuda_stats_sum(l, drec, 1, NULL, stream, &gpu_err));
  d2h(&rec, drec, sizeof rec);
  const double twice = want + want;
  CHECK_MSG(same_double(rec.sumsq, twice), "tree, %llu block sums accumulated: %.17g, want %.17g",
            (unsigned long long)nblocks, rec.sumsq, twice);
  for (int j = 0; j < ZD__CUDA_TAGS; j++) CHECK_U64_EQ(rec.tags[j], tags[j]);
  CHECK(intact(&rec));
  zd__cuda_layout_destroy(l);
  CUDA_CHECK(cudaFree(drec));
  CUDA_CHECK(cudaFree(dummy));
  free(x);
}

static void test_tree(void) {
  static const uint64_t counts[] = {0,
                                    1,
                                    2,
                                    3,
                                    7,
                                    8,
                                    9,
                                    255,
                                    256,
                                    257,
                                    2047,
                                    2048,
                                    2049,
                                    4095,
                                    4096,
                                    4097,
                                    6145,
                                    131071,
                                    131072,
                                    131073,
                                    2048 * 2048 - 1,
                                    2048 * 2048,
                                    2048 * 2048 + 1,
                                    2048 * 2049 + 5};
  uint64_t cases = 0;
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
    for (int finite = 0; finite < 2; finite++, cases++) run_tree(counts[i], finite);
  for (int i = 0; i < 20; i++, cases++) run_tree(1 + rnd_below(300000), (int)rnd_below(2));
  printf(
      "tree: %llu ranges of up to %llu block sums (two levels of chunks): device total bitwise "
      "equal to zd__grad_stats_sum, accumulation and tags right, records sealed\n",
      (unsigned long long)cases, (unsigned long long)(2048 * 2049 + 5));
}

/* ---- seal ---------------------------------------------------------------------------------- */

static void test_seal(void) {
  const int n = 64;
  zd__cuda_stats_t *d = (zd__cuda_stats_t *)dmalloc(n * sizeof *d);
  zd__cuda_stats_t h[64], got[64];
  for (int i = 0; i < n; i++)
    for (size_t b = 0; b < sizeof h[i]; b++)
      ((unsigned char *)&h[i])[b] = i == 0 ? 0xff : i == 1 ? 0 : (unsigned char)zd_test_rnd();
  h2d(d, h, sizeof h);
  for (int i = 0; i < n; i++) ZD_CHECK(zd__cuda_record_seal(d + i, stream, &gpu_err));
  d2h(got, d, sizeof got);
  for (int i = 0; i < n; i++) {
    CHECK_MSG(!memcmp(&got[i], &h[i], ZD__RECORD_CHECKED), "seal %d changed the record", i);
    CHECK_MSG(got[i].check == zd__record_check(&h[i]),
              "seal %d: device check %016llx, host %016llx", i, (unsigned long long)got[i].check,
              (unsigned long long)zd__record_check(&h[i]));
  }
  CUDA_CHECK(cudaFree(d));
  printf("seal: %d records (0xFF, zeros, random bytes): device check words are the host's\n", n);
}

/* ---- decide -------------------------------------------------------------------------------- */

#define MAX_RANKS 8
#define ABANDONED UINT64_MAX
#define CKPT_BIT  (1ull << 62)

static void random_config(zd__decide_cfg_t *cfg, zd_loss_scaler_t *sc) {
  static const double norms[] = {0, 0, 1e-3, 0.5, 1.0, 10.0, 1e6};
  static const double scales[] = {1.0, 65536.0, 3.5, 1e30, 1e-30};
  memset(cfg, 0, sizeof *cfg);
  memset(sc, 0, sizeof *sc);
  cfg->world_size = 1 + (uint32_t)rnd_below(MAX_RANKS);
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
  if (cfg->world_size == 1 && !sc->enabled && cfg->max_grad_norm > 0 && rnd_below(3) == 0) {
    cfg->torch_total = 1; /* torch's fp32 total, from the host */
    cfg->total_norm = (double)(float)ldexp(1.0 + rnd_unit(), (int)rnd_below(20) - 10);
  }
}

static void random_stats(double *sumsq, uint64_t *nonfinite) {
  uint64_t r = rnd_below(20);
  *sumsq = r == 0   ? 0.0
           : r == 1 ? 4.9406564584124654e-324
           : r == 2 ? 1e308 /* two of them overflow to inf */
           : r == 3 ? INFINITY
           : r == 4 ? NAN
                    : ldexp(1.0 + rnd_unit(), (int)rnd_below(200) - 100);
  *nonfinite = rnd_below(6) == 0 ? 1 + rnd_below(5) : 0;
  if (r == 3 || r == 4) *nonfinite += 1;
}

/* Records of a world for step `step`, on the host and the device: mostly in agreement, sometimes
 * with faults; a rank whose record the all-gather did not write (or wrote in part) has 0xFF bytes
 * there, written on the device by cudaMemset as zerod poisons its receive buffer. */
static void make_world(zd__cuda_stats_t *all, zd__cuda_stats_t *d_all, uint32_t w, uint64_t step,
                       int need_stats) {
  for (uint32_t r = 0; r < w; r++) {
    memset(&all[r], 0, sizeof all[r]);
    if (need_stats) random_stats(&all[r].sumsq, &all[r].nonfinite);
    all[r].tags[0] = step;
    all[r].tags[1] = 0x1234567890abcdefull;
    all[r].tags[2] = 0xfedcba0987654321ull;
  }
  uint64_t faults = rnd_below(3) == 0 ? 1 + rnd_below(3) : 0;
  for (uint64_t f = 0; f < faults; f++) {
    uint32_t r = (uint32_t)rnd_below(w);
    uint64_t kind = rnd_below(6);
    if (kind == 0) all[r].tags[0] = ABANDONED;
    if (kind == 1) all[r].tags[0] = step + 1 + rnd_below(2);
    if (kind == 2) all[r].tags[1] ^= 1ull << rnd_below(64);
    if (kind == 3) all[r].tags[2] ^= 1ull << rnd_below(64);
  }
  for (uint32_t r = 0; r < w; r++) {
    if (rnd_below(4) == 0) all[r].tags[0] |= CKPT_BIT;
    all[r].check = zd__record_check(&all[r]);
  }
  h2d(d_all, all, w * sizeof *all);
  for (uint64_t f = 0; f < faults; f++) {
    if (rnd_below(3)) continue;
    uint32_t r = (uint32_t)rnd_below(w);
    size_t cut = rnd_below(2) ? 0 : 1 + rnd_below(sizeof all[r] - 1);
    memset((char *)&all[r] + cut, 0xff, sizeof all[r] - cut);
    CUDA_CHECK(cudaMemsetAsync((char *)&d_all[r] + cut, 0xff, sizeof all[r] - cut, stream));
  }
}

static void test_decide(void) {
  zd__cuda_stats_t *d_all = (zd__cuda_stats_t *)dmalloc(MAX_RANKS * sizeof *d_all);
  zd__cuda_decision_t *d_dec = (zd__cuda_decision_t *)dmalloc(sizeof *d_dec);
  uint64_t counts[4] = {0, 0, 0, 0}, cases = 0, nan_norms = 0, clipped = 0;
  for (int traj = 0; traj < 300; traj++) {
    zd__decide_cfg_t cfg;
    zd_loss_scaler_t sc;
    random_config(&cfg, &sc);
    zd__step_state_t st;
    memset(&st, 0, sizeof st);
    zd__scaler_init(&st.scaler, &sc);
    for (int t = 0; t < 100; t++, cases++) {
      zd__cuda_stats_t all[MAX_RANKS];
      make_world(all, d_all, cfg.world_size, st.step + 1, cfg.need_stats);
      zd__cuda_decide_args_t a;
      memset(&a, 0, sizeof a);
      a.d_all = d_all;
      a.world_size = cfg.world_size;
      a.mine = (uint32_t)rnd_below(cfg.world_size);
      a.step_mask = ~CKPT_BIT;
      a.checkpoint_bit = CKPT_BIT;
      a.abandoned = ABANDONED;
      a.cfg = cfg;
      a.st = st;
      CUDA_CHECK(cudaMemsetAsync(d_dec, 0x5a, sizeof *d_dec, stream)); /* all written */
      ZD_CHECK(zd__cuda_step_decide(&a, d_dec, stream, &gpu_err));
      zd__cuda_decision_t got, want;
      d2h(&got, d_dec, sizeof got);
      zd__step_decide_records(&a, all, &want);
      CHECK_MSG(zd__cuda_decision_same(&want, &got),
                "decide, trajectory %d step %d (world %u, rank %u, mean %d, clip %g, scaler %d "
                "scale %g, torch total %d):\n"
                "  device verdict %d rank %d ckpt %d sumsq %.17g nonfinite %llu norm %.17g clip "
                "%.17g factor %.9g (%08x) scale %.17g step %llu skipped %llu growth %u hyst %u\n"
                "  host   verdict %d rank %d ckpt %d sumsq %.17g nonfinite %llu norm %.17g clip "
                "%.17g factor %.9g (%08x) scale %.17g step %llu skipped %llu growth %u hyst %u",
                traj, t, cfg.world_size, a.mine, cfg.grad_mean, cfg.max_grad_norm, sc.enabled,
                st.scaler.scale, cfg.torch_total, got.verdict, got.bad_rank, got.checkpoint,
                got.sumsq, (unsigned long long)got.nonfinite, got.dec.grad_norm, got.dec.clip_coef,
                got.dec.grad_scale, f2u(got.dec.grad_scale), got.st.scaler.scale,
                (unsigned long long)got.st.step, (unsigned long long)got.st.steps_skipped,
                got.st.scaler.growth_tracker, got.st.scaler.hysteresis_tracker, want.verdict,
                want.bad_rank, want.checkpoint, want.sumsq, (unsigned long long)want.nonfinite,
                want.dec.grad_norm, want.dec.clip_coef, want.dec.grad_scale,
                f2u(want.dec.grad_scale), want.st.scaler.scale, (unsigned long long)want.st.step,
                (unsigned long long)want.st.steps_skipped, want.st.scaler.growth_tracker,
                want.st.scaler.hysteresis_tracker);
      counts[got.verdict]++;
      nan_norms += got.verdict == ZD__VERDICT_APPLY && isnan(got.dec.grad_norm) && cfg.need_stats;
      clipped += got.verdict == ZD__VERDICT_APPLY && got.dec.clip_coef < 1.0;
      st = want.st;
    }
  }
  CHECK(counts[ZD__VERDICT_APPLY] > 1000 && counts[ZD__VERDICT_SKIP] > 100 &&
        counts[ZD__VERDICT_DISAGREE] > 500 && counts[ZD__VERDICT_INVALID] > 200 && clipped > 100);
  /* Refused before the launch. */
  zd__cuda_decide_args_t a;
  memset(&a, 0, sizeof a);
  a.d_all = d_all;
  a.world_size = 2;
  a.mine = 2;
  CHECK_INT_EQ(zd__cuda_step_decide(&a, d_dec, stream, NULL), -EINVAL);
  a.mine = 0;
  CHECK_INT_EQ(zd__cuda_step_decide(&a, d_dec, NULL, NULL), -EINVAL);
  CHECK_INT_EQ(zd__cuda_step_decide(&a, NULL, stream, NULL), -EINVAL);
  a.d_all = NULL;
  CHECK_INT_EQ(zd__cuda_step_decide(&a, d_dec, stream, NULL), -EINVAL);
  CUDA_CHECK(cudaFree(d_all));
  CUDA_CHECK(cudaFree(d_dec));
  printf(
      "decide: %llu decisions (%llu applied, %llu of them clipped, %llu with a NaN norm; %llu "
      "skipped, %llu disagreeing, %llu damaged): device equal to the host's, bit for bit\n",
      (unsigned long long)cases, (unsigned long long)counts[ZD__VERDICT_APPLY],
      (unsigned long long)clipped, (unsigned long long)nan_norms,
      (unsigned long long)counts[ZD__VERDICT_SKIP],
      (unsigned long long)counts[ZD__VERDICT_DISAGREE],
      (unsigned long long)counts[ZD__VERDICT_INVALID]);
}

/* ---- update -------------------------------------------------------------------------------- */

enum { U_MASTER, U_EXP_AVG, U_EXP_AVG_SQ, U_MAX, U_GRAD, U_PARAM, U_COUNT };

static size_t dsize(int dt) {
  return dt == ZD_F32 ? 4 : dt ? 2 : 0;
}

/* The records of a world of two whose decision has the given verdict: clipping on (the factor
 * is not 1), the scaler on (an overflow skips). */
static void world_for(int verdict, zd__cuda_stats_t all[2], zd__cuda_decide_args_t *a) {
  memset(a, 0, sizeof *a);
  a->world_size = 2;
  a->mine = 1;
  a->step_mask = ~CKPT_BIT;
  a->checkpoint_bit = CKPT_BIT;
  a->abandoned = ABANDONED;
  a->cfg.world_size = 2;
  a->cfg.grad_mean = 1;
  a->cfg.need_stats = 1;
  a->cfg.max_grad_norm = 0.25;
  zd_loss_scaler_t sc;
  memset(&sc, 0, sizeof sc);
  sc.enabled = 1;
  sc.initial_scale = 1024;
  sc.growth_factor = 2;
  sc.backoff_factor = 0.5;
  sc.growth_interval = 100;
  sc.hysteresis = 1;
  sc.min_scale = 1;
  zd__scaler_init(&a->st.scaler, &sc);
  a->st.step = 6;
  for (int r = 0; r < 2; r++) {
    memset(&all[r], 0, sizeof all[r]);
    all[r].sumsq = 3.0e6 * (1 + r); /* norm sqrt(9e6) / 2048 = 1.46: clipped to 0.25 */
    all[r].nonfinite = verdict == ZD__VERDICT_SKIP && r == 0;
    all[r].tags[0] = 7;
    all[r].tags[1] = 11;
    all[r].tags[2] = verdict == ZD__VERDICT_DISAGREE && r == 0 ? 14 : 13;
    all[r].check = zd__record_check(&all[r]);
  }
  if (verdict == ZD__VERDICT_INVALID) all[0].check ^= 1;
}

static void run_update(int gdt, int pdt, int ams, int verdict) {
  const uint64_t n = 70001;
  const zd__segment_t segs[3] = {{0, 30000, 0}, {30011, 34989, 1}, {65003, n - 65003, 0}};
  const size_t es[U_COUNT] = {4, 4, 4, ams ? 4u : 0u, dsize(gdt), dsize(pdt)};
  void *host[U_COUNT], *dev[2][U_COUNT];
  for (int k = 0; k < U_COUNT; k++) {
    host[k] = xmalloc(n * es[k]);
    for (size_t b = 0; b < n * es[k] / 2; b++) /* NaN bits where nothing must be written */
      ((uint16_t *)host[k])[b] = 0x7f81;
    for (uint64_t i = 0; i < n && es[k]; i++) {
      float x = k == U_EXP_AVG_SQ || k == U_MAX ? 1e-4f * fabsf(rnd_unit()) : rnd_unit();
      if (k == U_GRAD && gdt != ZD_F32)
        ((uint16_t *)host[k])[i] =
            gdt == ZD_BF16 ? zd__f32_to_bf16(x * 1e-2f) : (uint16_t)(0x2000 + rnd_below(0x3000));
      else if (k == U_PARAM)
        continue; /* written by the update */
      else
        ((float *)host[k])[i] = k == U_GRAD ? x * 1e-2f : x;
    }
    for (int c = 0; c < 2; c++) {
      dev[c][k] = es[k] ? dmalloc(n * es[k]) : NULL;
      if (es[k]) h2d(dev[c][k], host[k], n * es[k]);
    }
  }
  zd_group_t hp[2] = {zd__group_default(), zd__group_default()};
  hp[0].lr = 1e-3;
  hp[0].weight_decay = 0.1;
  hp[1].lr = 3e-4;
  hp[1].optimizer = ZD_ADAM;
  hp[1].weight_decay = 0.01;
  hp[1].amsgrad = ams;
  /* every update formula (zd_update_t: torch 1.13's, 2.x's on CPU, its three CUDA paths), with
   * and without maximize, on both groups over the cases */
  static int turn;
  hp[0].update = (zd_update_t)(turn % 5);
  hp[1].update = (zd_update_t)((turn + 2) % 5);
  hp[1].maximize = turn / 5 % 2;
  turn++;
  zd__adam_group_t groups[2];
  for (int g = 0; g < 2; g++) zd__adam_group_init(&groups[g], &hp[g], 7);
  zd__cuda_layout_t *l = NULL;
  ZD_CHECK(zd__cuda_layout_create(segs, 3, n, stream, &l, &gpu_err));

  zd__cuda_stats_t all[2];
  zd__cuda_decide_args_t da;
  world_for(verdict, all, &da);
  zd__cuda_stats_t *d_all = (zd__cuda_stats_t *)dmalloc(sizeof all);
  zd__cuda_decision_t *d_dec = (zd__cuda_decision_t *)dmalloc(sizeof *d_dec), host_dec, dev_dec;
  h2d(d_all, all, sizeof all);
  da.d_all = d_all;
  ZD_CHECK(zd__cuda_step_decide(&da, d_dec, stream, &gpu_err));
  zd__step_decide_records(&da, all, &host_dec);
  d2h(&dev_dec, d_dec, sizeof dev_dec);
  CHECK_MSG(dev_dec.verdict == verdict && host_dec.verdict == verdict,
            "update: wanted verdict %d, the device says %d, the host %d", verdict, dev_dec.verdict,
            host_dec.verdict);
  CHECK(zd__cuda_decision_same(&host_dec, &dev_dec));
  if (verdict == ZD__VERDICT_APPLY)
    CHECK_MSG(host_dec.dec.clip_coef < 1.0 && host_dec.dec.grad_scale != 1.0f,
              "update: the decision does not clip (coef %g)", host_dec.dec.clip_coef);

  for (int c = 0; c < 2; c++) {
    zd__cuda_adam_args_t a;
    memset(&a, 0, sizeof a);
    a.state[ZD__STATE_MASTER] = (float *)dev[c][U_MASTER];
    a.state[ZD__STATE_EXP_AVG] = (float *)dev[c][U_EXP_AVG];
    a.state[ZD__STATE_EXP_AVG_SQ] = (float *)dev[c][U_EXP_AVG_SQ];
    a.state[ZD__STATE_MAX_EXP_AVG_SQ] = (float *)dev[c][U_MAX];
    a.grad = dev[c][U_GRAD];
    a.grad_dtype = (zd_dtype_t)gdt;
    a.param = dev[c][U_PARAM];
    a.param_dtype = pdt ? (zd_dtype_t)pdt : ZD_F32;
    a.groups = groups;
    a.ngroups = 2;
    if (c == 0) { /* the host's decision: updated only when it applies */
      a.grad_scale = host_dec.dec.grad_scale;
      if (verdict == ZD__VERDICT_APPLY) ZD_CHECK(zd__cuda_adam_step(l, &a, stream, &gpu_err));
    } else {                   /* the device's, always queued */
      a.grad_scale = 12345.0f; /* ignored */
      a.d_decision = d_dec;
      ZD_CHECK(zd__cuda_adam_step(l, &a, stream, &gpu_err));
    }
  }
  int changed = 0;
  for (int k = 0; k < U_COUNT; k++) {
    if (!es[k]) continue;
    void *got[2] = {xmalloc(n * es[k]), xmalloc(n * es[k])};
    for (int c = 0; c < 2; c++) d2h(got[c], dev[c][k], n * es[k]);
    CHECK_MSG(!memcmp(got[0], got[1], n * es[k]),
              "update with grad %d, param %d, max_exp_avg_sq %d, verdict %d: array %d differs "
              "between the host's grad_scale and the device's decision",
              gdt, pdt, ams, verdict, k);
    if (verdict != ZD__VERDICT_APPLY || k == U_GRAD)
      CHECK_MSG(!memcmp(got[1], host[k], n * es[k]),
                "update with grad %d, param %d, max_exp_avg_sq %d, verdict %d: array %d changed",
                gdt, pdt, ams, verdict, k);
    changed |= memcmp(got[1], host[k], n * es[k]) != 0;
    free(got[0]);
    free(got[1]);
  }
  CHECK_INT_EQ(changed, verdict == ZD__VERDICT_APPLY);
  zd__cuda_layout_destroy(l);
  CUDA_CHECK(cudaFree(d_all));
  CUDA_CHECK(cudaFree(d_dec));
  for (int k = 0; k < U_COUNT; k++) {
    free(host[k]);
    for (int c = 0; c < 2; c++)
      if (dev[c][k]) CUDA_CHECK(cudaFree(dev[c][k]));
  }
}

static void test_update(void) {
  static const int gdts[3] = {ZD_F32, ZD_BF16, ZD_F16}, pdts[3] = {ZD_F32, ZD_BF16, 0};
  static const int verdicts[4] = {ZD__VERDICT_APPLY, ZD__VERDICT_SKIP, ZD__VERDICT_DISAGREE,
                                  ZD__VERDICT_INVALID};
  int cases = 0;
  for (int g = 0; g < 3; g++)
    for (int p = 0; p < 3; p++)
      for (int x = 0; x < 2; x++)
        for (int v = 0; v < 4; v++, cases++) run_update(gdts[g], pdts[p], x, verdicts[v]);
  printf(
      "update: %d cases (grad dtype x param output x max_exp_avg_sq x verdict, every update "
      "formula): with "
      "d_decision, APPLY is the update with the host's factor bit for bit, SKIP, DISAGREE and "
      "INVALID change nothing\n",
      cases);
}

/* ---- grids --------------------------------------------------------------------------------- */

static void test_grids(void) {
  const uint64_t n = (uint64_t)1 << 28;
  zd__segment_t seg = {0, n, 0};
  zd__cuda_layout_t *l = NULL;
  ZD_CHECK(zd__cuda_layout_create(&seg, 1, n, stream, &l, &gpu_err));
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  static const int gdts[3] = {ZD_F32, ZD_BF16, ZD_F16}, pdts[3] = {ZD_F32, ZD_BF16, 0};
  printf("grids: %d SMs; update blocks of 256 threads at 2^28 elements (%llu tiles):", sms,
         (unsigned long long)zd__cuda_layout_tiles(l));
  for (int g = 0; g < 3; g++)
    for (int p = 0; p < 3; p++)
      for (int x = 0; x < 2; x++) {
        zd__cuda_adam_args_t a;
        memset(&a, 0, sizeof a);
        a.grad_dtype = (zd_dtype_t)gdts[g];
        a.param = pdts[p] ? (void *)&a : NULL; /* only its presence counts */
        a.param_dtype = pdts[p] ? (zd_dtype_t)pdts[p] : ZD_F32;
        a.state[ZD__STATE_MAX_EXP_AVG_SQ] = x ? (float *)&a : NULL;
        unsigned grid = zd__cuda_adam_grid(l, &a);
        CHECK_MSG(grid >= (unsigned)sms && grid % (unsigned)sms == 0,
                  "update grid %u for %d SMs: not a whole number of blocks per SM", grid, sms);
        printf(" %s/%s%s %u",
               gdts[g] == ZD_F32    ? "f32"
               : gdts[g] == ZD_BF16 ? "bf16"
                                    : "f16",
               pdts[p] == ZD_F32    ? "f32"
               : pdts[p] == ZD_BF16 ? "bf16"
                                    : "none",
               x ? "/ams" : "", grid);
      }
  unsigned adam_max = 0;
  uint64_t stats_per_pass = 0;
  zd__cuda_layout_grids(l, &adam_max, &stats_per_pass);
  printf("; largest %u; statistics blocks per pass %llu\n", adam_max,
         (unsigned long long)stats_per_pass);
  zd__cuda_layout_destroy(l);
}

int main(void) {
  gpu_or_skip("test_decide_cuda");
  zd__err_t perr;
  memset(&perr, 0, sizeof perr);
  if (zd__cuda_kernels_preload(&perr) != ZD_OK) {
    fprintf(stderr, "FAIL: zd__cuda_kernels_preload: %s\n", perr.msg);
    return 1;
  }
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  test_grids();
  test_seal();
  test_tree();
  test_decide();
  test_update();
  CUDA_CHECK(cudaStreamDestroy(stream));
  printf("PASS\n");
  return 0;
}
