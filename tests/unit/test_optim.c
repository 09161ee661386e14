/* Unit tests of the optimizers' table (kernels/optim.h) and its kernels other than Adam's
 * (test_adam.c tests those).
 *
 * Each optimizer's scalar reference is pinned to torch by golden steps computed with torch 1.13.1
 * (torch.optim.SGD's default implementation; its formula is the same in 2.x: kernels/sgd.c).
 * Every wide path this CPU runs is then compared with the reference bit for bit on random shards
 * (segments with gaps, groups with different hyperparameters and optimizers, every grad dtype x
 * param output, steps 1 and later), through the table's update (zd__optim_impl), in place and
 * out of place (the overlapped update's mode, whose other set must come out whole). For groups
 * that are all AdamW/Adam the table's update must equal zd__adam_impl's bit for bit. Inputs come
 * from a fixed-seed PRNG, so a failure reproduces.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "group.h"
#include "optim.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t next_u32(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (uint32_t)(rng >> 16);
}
static float uniform(float lo, float hi) {
  return lo + (hi - lo) * (float)(next_u32() & 0xffffff) / (float)0x1000000;
}

/* ---- golden: torch 1.13.1 ------------------------------------------------------------------ */

/* p = [1, -2, 0.5, 3], grad (t+1) * [0.25, -0.125, 1.5, -3] at step t = 0, 1, 2; the params' bits
 * after each step (tests/unit: the generating script is in the comment of each case). */
static void golden_run(const char *what, zd_group_t hp, const uint32_t want[3][4]) {
  float master[4] = {1.0f, -2.0f, 0.5f, 3.0f}, buf[4] = {0}, zeros[4] = {0}, sum[4] = {0};
  float sq[4] = {0}, gavg[4] = {0};
  float exp_avg[4] = {0}, exp_avg_sq[4] = {0};
  const float g0[4] = {0.25f, -0.125f, 1.5f, -3.0f};
  zd__segment_t seg = {.offset = 0, .length = 4, .group = 0};
  for (int t = 0; t < 3; t++) {
    float grad[4];
    for (int i = 0; i < 4; i++) grad[i] = g0[i] * (float)(t + 1);
    zd__adam_group_t c;
    zd__adam_group_init(&c, &hp, (uint64_t)t + 1);
    zd__adam_args_t a = {.grad = grad,
                         .grad_dtype = ZD_F32,
                         .grad_scale = 1.0f,
                         .segs = &seg,
                         .nsegs = 1,
                         .groups = &c};
    a.state[ZD__STATE_MASTER] = master;
    a.state[ZD__STATE_EXP_AVG] = exp_avg;
    a.state[ZD__STATE_EXP_AVG_SQ] = exp_avg_sq;
    a.state[ZD__STATE_MOMENTUM_BUFFER] = hp.momentum != 0 ? buf : NULL;
    a.state[ZD__STATE_SUM] = hp.optimizer == ZD_ADAGRAD ? sum : NULL;
    a.state[ZD__STATE_SQUARE_AVG] = hp.optimizer == ZD_RMSPROP ? sq : NULL;
    a.state[ZD__STATE_GRAD_AVG] = hp.optimizer == ZD_RMSPROP && hp.centered ? gavg : NULL;
    zd__optim_impl(ZD__ISA_SCALAR)(&a, 0, 4);
    for (int i = 0; i < 4; i++)
      CHECK_MSG(f2u(master[i]) == want[t][i], "%s: step %d element %d: %08x, torch %08x", what,
                t + 1, i, f2u(master[i]), want[t][i]);
  }
  if (hp.optimizer != ZD_LION) CHECK(!memcmp(exp_avg, zeros, sizeof zeros));
  CHECK(!memcmp(exp_avg_sq, zeros, sizeof zeros));
}

/* lion_pytorch.Lion 0.2.5 (torch 2.15), golden_run's p and grads:
 *   p = torch.tensor([1.0, -2.0, 0.5, 3.0], requires_grad=True); opt = Lion([p], **kw)
 *   for t in range(3): p.grad = torch.tensor([0.25, -0.125, 1.5, -3.0]) * (t + 1); opt.step() */
static void test_golden_lion(void) {
  static const uint32_t wd[3][4] = {{0x3f5eb852, 0xbfeb851f, 0x3ec51eb9, 0x4040a3d7},
                                    {0x3f3e703b, 0xbfd7a787, 0x3e8c01a5, 0x404142c4},
                                    {0x3f1f2010, 0xbfc46281, 0x3e293664, 0x4041dcec}};
  static const uint32_t plain[3][4] = {{0x3f7851ec, 0xbffc28f6, 0x3ef0a3d7, 0x4041eb85},
                                       {0x3f70a3d8, 0xbff851ec, 0x3ee147ae, 0x4043d70a},
                                       {0x3f68f5c4, 0xbff47ae2, 0x3ed1eb85, 0x4045c28f}};
  zd_group_t hp = zd__group_default();
  hp.optimizer = ZD_LION;
  hp.lr = 0.1; /* kw: lr=0.1, betas=(0.9, 0.99), weight_decay=0.3 */
  hp.beta1 = 0.9;
  hp.beta2 = 0.99;
  hp.weight_decay = 0.3;
  golden_run("lion weight_decay", hp, wd);
  hp.lr = 0.03; /* kw: lr=0.03, betas=(0.95, 0.98) */
  hp.beta1 = 0.95;
  hp.beta2 = 0.98;
  hp.weight_decay = 0;
  golden_run("lion", hp, plain);
}

static void test_golden(void) {
  zd_group_t hp = zd__group_default();
  hp.optimizer = ZD_SGD;
  hp.lr = 0.1;
  hp.weight_decay = 0.01;
  /* SGD([p], lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01) */
  static const uint32_t damp[3][4] = {{0x3f795810, 0xbffe24dd, 0x3eb2f1aa, 0x4053020c},
                                      {0x3f679bf4, 0xbff95d68, 0xbd6675a5, 0x40833e1e},
                                      {0x3f4628d0, 0xbff084ec, 0xbf538f14, 0x40b43595}};
  hp.momentum = 0.9;
  hp.dampening = 0.1;
  golden_run("momentum, dampening", hp, damp);
  /* SGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True) */
  static const uint32_t nest[3][4] = {{0x3f85d639, 0xc00146dc, 0x3f48b780, 0x401b27bb},
                                      {0x3f943b18, 0xc0049d91, 0x3fbca0bd, 0x3f8462c2},
                                      {0x3fad8118, 0xc00a9ace, 0x402b5757, 0xbfb17a88}};
  hp.dampening = 0;
  hp.nesterov = 1;
  hp.maximize = 1;
  golden_run("nesterov, maximize", hp, nest);
  /* SGD([p], lr=0.1) */
  static const uint32_t plain[3][4] = {{0x3f79999a, 0xbffe6666, 0x3eb33333, 0x40533333},
                                       {0x3f6ccccd, 0xbffb3333, 0x3d4cccca, 0x40799999},
                                       {0x3f59999a, 0xbff66666, 0xbecccccd, 0x40999999}};
  hp.momentum = 0;
  hp.nesterov = 0;
  hp.maximize = 0;
  hp.weight_decay = 0;
  golden_run("plain", hp, plain);
  printf("golden: SGD's reference equals torch 1.13.1 over 3 steps (momentum, nesterov, plain)\n");
  hp = zd__group_default();
  hp.optimizer = ZD_ADAGRAD;
  hp.lr = 0.1;
  hp.eps = 1e-10;
  /* Adagrad([p], lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1) */
  static const uint32_t ada[3][4] = {{0x3f6fbddd, 0xbffaaa39, 0x3ecde4e6, 0x40465d31},
                                     {0x3f5bfc3c, 0xbff2e6f4, 0x3ea0c535, 0x404c07e4},
                                     {0x3f48f852, 0xbfea8844, 0x3e713477, 0x40511074}};
  hp.lr_decay = 0.01;
  hp.weight_decay = 0.01;
  hp.initial_accumulator_value = 0.1;
  golden_run("adagrad", hp, ada);
  /* Adagrad([p], lr=0.1, maximize=True) */
  static const uint32_t ada_max[3][4] = {{0x3f8ccccd, 0xc0066666, 0x3f19999a, 0x4039999a},
                                         {0x3f983fa9, 0xc00c1fd4, 0x3f307f52, 0x4033e02c},
                                         {0x3fa282f2, 0xc0114178, 0x3f4505e4, 0x402ebe88}};
  hp.lr_decay = 0;
  hp.weight_decay = 0;
  hp.initial_accumulator_value = 0;
  hp.maximize = 1;
  golden_run("adagrad maximize", hp, ada_max);
  printf("golden: Adagrad's reference equals torch 1.13.1 over 3 steps\n");
  hp = zd__group_default();
  hp.optimizer = ZD_RMSPROP;
  hp.lr = 0.01;
  /* RMSprop([p], lr=0.01, alpha=0.9, momentum=0.9, centered=True, weight_decay=0.01) */
  static const uint32_t rms[3][4] = {{0x3f777777, 0xbffbbbbc, 0x3eeeeeef, 0x40422222},
                                     {0x3f67c6b1, 0xbff3ec9b, 0x3ecf814c, 0x40461062},
                                     {0x3f521843, 0xbfe92549, 0x3ea40fb4, 0x404b7f81}};
  hp.alpha = 0.9;
  hp.momentum = 0.9;
  hp.centered = 1;
  hp.weight_decay = 0.01;
  golden_run("rmsprop centered momentum", hp, rms);
  /* RMSprop([p], lr=0.01, maximize=True) */
  static const uint32_t rms_max[3][4] = {{0x3f8ccccc, 0xc0066666, 0x3f19999a, 0x4039999a},
                                         {0x3f984297, 0xc00c214c, 0x3f308531, 0x4033deb4},
                                         {0x3fa28b83, 0xc01145c2, 0x3f45170a, 0x402eba3e}};
  hp = zd__group_default();
  hp.optimizer = ZD_RMSPROP;
  hp.lr = 0.01;
  hp.weight_decay = 0;
  hp.maximize = 1;
  golden_run("rmsprop maximize", hp, rms_max);
  printf("golden: RMSprop's reference equals torch 1.13.1 over 3 steps\n");
}

/* ---- wide paths against the reference -------------------------------------------------------- */

#define N       5000
#define NGROUPS 4

typedef struct shard {
  float state[ZD__NSTATES][N];
  uint16_t param16[N];
  float param32[N];
} shard_t;

static zd__segment_t segs[64];
static uint32_t nsegs;

/* Segments of random lengths with gaps, each in a random group. */
static void make_segments(void) {
  uint64_t at = 0;
  nsegs = 0;
  while (nsegs < 64) {
    at += next_u32() % 4; /* a gap, sometimes none */
    uint64_t len = 1 + next_u32() % 300;
    if (at + len > N) break;
    segs[nsegs++] = (zd__segment_t){.offset = at, .length = len, .group = next_u32() % NGROUPS};
    at += len;
  }
}

static void fill(shard_t *s, int has_buf) {
  for (int k = 0; k < ZD__NSTATES; k++)
    for (int i = 0; i < N; i++) s->state[k][i] = uniform(-1.0f, 1.0f);
  for (int i = 0; i < N; i++) s->state[ZD__STATE_EXP_AVG_SQ][i] = uniform(0.0f, 1.0f);
  for (int i = 0; i < N; i++) s->state[ZD__STATE_SUM][i] = uniform(0.0f, 1.0f);
  for (int i = 0; i < N; i++) s->state[ZD__STATE_SQUARE_AVG][i] = uniform(0.0f, 1.0f);
  if (!has_buf) memset(s->state[ZD__STATE_MOMENTUM_BUFFER], 0, sizeof s->state[0]);
  memset(s->param16, 0xab, sizeof s->param16);
  memset(s->param32, 0xab, sizeof s->param32);
}

static int has_sum_array, has_sq_array, has_ga_array;

static void args_of(zd__adam_args_t *a, shard_t *s, const shard_t *src, const void *grad,
                    zd_dtype_t gd, zd_dtype_t pd, const zd__adam_group_t *groups, int has_max,
                    int has_buf) {
  memset(a, 0, sizeof *a);
  for (int k = 0; k < ZD__NSTATES; k++) {
    int have = !(
        (k == ZD__STATE_MAX_EXP_AVG_SQ && !has_max) ||
        (k == ZD__STATE_MOMENTUM_BUFFER && !has_buf) || (k == ZD__STATE_SUM && !has_sum_array) ||
        (k == ZD__STATE_SQUARE_AVG && !has_sq_array) || (k == ZD__STATE_GRAD_AVG && !has_ga_array));
    a->state[k] = have ? s->state[k] : NULL;
    a->src[k] = have && src ? src->state[k] : NULL;
  }
  a->grad = grad;
  a->grad_dtype = gd;
  a->param = pd == ZD_BF16 ? (void *)s->param16 : pd == ZD_F32 ? (void *)s->param32 : NULL;
  a->param_dtype = pd ? pd : ZD_F32;
  a->grad_scale = 0.5f;
  a->segs = segs;
  a->nsegs = nsegs;
  a->groups = groups;
}

/* Bitwise equal, or NaN on both sides. */
static int same(float x, float y) {
  return f2u(x) == f2u(y) || (x != x && y != y);
}

static void compare(const char *what, const shard_t *x, const shard_t *y) {
  for (int k = 0; k < ZD__NSTATES; k++)
    for (int i = 0; i < N; i++)
      CHECK_MSG(same(x->state[k][i], y->state[k][i]), "%s: %s[%d]: %08x vs %08x", what,
                zd__state_name((zd__state_t)k), i, f2u(x->state[k][i]), f2u(y->state[k][i]));
  CHECK_MSG(!memcmp(x->param16, y->param16, sizeof x->param16), "%s: bf16 params differ", what);
  for (int i = 0; i < N; i++)
    CHECK_MSG(same(x->param32[i], y->param32[i]), "%s: param[%d]", what, i);
}

static shard_t sh_ref, sh_isa, sh_src, sh_out;

/* One configuration: groups' hyperparameters from `mix` (0: all SGD; 1: SGD and AdamW/Adam mixed;
 * 2: all AdamW/Adam), step t. */
static void run_case(int mix, uint64_t t, zd_dtype_t gd, zd_dtype_t pd, const zd__isa_t *isas,
                     int nisas) {
  zd__adam_group_t groups[NGROUPS];
  int has_max = 0, has_buf = 0, has_sum = 0, has_sq = 0, has_ga = 0;
  for (int k = 0; k < NGROUPS; k++) {
    zd_group_t hp = zd__group_default();
    int sgd = mix == 0 || (mix == 1 && k % 2 == 0) || (mix == 3 && k == 2);
    int adagrad = mix == 3 && k % 2 == 0 && !sgd;
    int rms = mix == 4 && k != 3;
    int lion = mix == 5 && k != 3;
    hp.optimizer = lion      ? ZD_LION
                   : rms     ? ZD_RMSPROP
                   : adagrad ? ZD_ADAGRAD
                   : sgd     ? ZD_SGD
                             : (k & 2 ? ZD_ADAM : ZD_ADAMW);
    hp.lr = uniform(0.001f, 0.5f);
    hp.weight_decay = k == 1 ? 0 : uniform(0.0f, 0.1f);
    hp.maximize = k == 3;
    if (lion) {
      hp.beta1 = k == 1 ? 0 : uniform(0.8f, 0.99f);
      hp.beta2 = uniform(0.9f, 0.999f);
      hp.weight_decay = k == 2 ? 0 : uniform(0.0f, 1.0f);
    } else if (rms) {
      hp.alpha = k == 1 ? 0.3 : uniform(0.8f, 0.99f); /* 0.3: the lerp's second form */
      hp.momentum = k == 2 ? 0 : uniform(0.5f, 0.95f);
      hp.centered = k != 0;
      hp.update = k == 0 ? ZD_UPDATE_TORCH113 : ZD_UPDATE_TORCH2;
      hp.sqrt_mode = k == 2 && t == 2 ? ZD_SQRT_MKL_EX : ZD_SQRT_EXACT;
      has_buf |= hp.momentum != 0;
      has_sq = 1;
      has_ga |= hp.centered;
    } else if (adagrad) {
      hp.lr_decay = uniform(0.0f, 0.1f);
      hp.initial_accumulator_value = uniform(0.0f, 0.5f);
      hp.eps = 1e-10;
      hp.sqrt_mode = k == 0 && t == 2 ? ZD_SQRT_MKL_EX : ZD_SQRT_EXACT;
      has_sum = 1;
    } else if (sgd) {
      hp.momentum = k == 2 ? 0 : uniform(0.5f, 0.99f);
      hp.dampening = k == 0 ? uniform(0.0f, 0.5f) : 0;
      hp.nesterov = k == 1 || k == 3;
      has_buf |= hp.momentum != 0;
    } else {
      hp.amsgrad = k == 3;
      has_max |= hp.amsgrad;
      hp.update = k == 1 ? ZD_UPDATE_TORCH2 : ZD_UPDATE_TORCH113;
    }
    zd__adam_group_init(&groups[k], &hp, t);
  }
  has_sum_array = has_sum;
  has_sq_array = has_sq;
  has_ga_array = has_ga;
  static float g32[N];
  static uint16_t g16[N];
  for (int i = 0; i < N; i++) {
    g32[i] = uniform(-2.0f, 2.0f);
    if (i % 97 == 0) g32[i] = 0.0f;
    if (i % 89 == 0) g32[i] = -0.0f;
    g16[i] = gd == ZD_BF16 ? zd__f32_to_bf16(g32[i]) : (uint16_t)(next_u32() & 0x3fff);
  }
  const void *grad = gd == ZD_F32 ? (const void *)g32 : (const void *)g16;
  fill(&sh_ref, has_buf);
  sh_isa = sh_ref;
  sh_src = sh_ref;
  zd__adam_args_t a;
  args_of(&a, &sh_ref, NULL, grad, gd, pd, groups, has_max, has_buf);
  zd__optim_impl(ZD__ISA_SCALAR)(&a, 0, N);
  if (mix == 2) { /* the table's update is Adam's for a model of AdamW/Adam groups */
    shard_t *adam = &sh_out;
    *adam = sh_src;
    args_of(&a, adam, NULL, grad, gd, pd, groups, has_max, has_buf);
    zd__adam_impl(ZD__ISA_SCALAR)(&a, 0, N);
    compare("adam through the table", &sh_ref, adam);
  }
  for (int i = 0; i < nisas; i++) {
    char what[96];
    snprintf(what, sizeof what, "%s mix %d step %d grad %s param %s", zd__isa_name(isas[i]), mix,
             (int)t, zd_dtype_name(gd), pd ? zd_dtype_name(pd) : "none");
    sh_isa = sh_src;
    args_of(&a, &sh_isa, NULL, grad, gd, pd, groups, has_max, has_buf);
    uint64_t cut = next_u32() % N; /* two calls: a split anywhere */
    zd__optim_impl(isas[i])(&a, 0, cut);
    zd__optim_impl(isas[i])(&a, cut, N);
    compare(what, &sh_ref, &sh_isa);
    /* Out of place: read sh_src, write sh_out (garbage before), whose covered elements must then
     * equal the in-place result in every array the model has. */
    memset(&sh_out, 0x7f, sizeof sh_out);
    memcpy(sh_out.param16, sh_ref.param16, sizeof sh_out.param16);
    memcpy(sh_out.param32, sh_ref.param32, sizeof sh_out.param32);
    shard_t src_copy = sh_src;
    args_of(&a, &sh_out, &src_copy, grad, gd, pd, groups, has_max, has_buf);
    if (has_max) /* compute_cpu.c copies max_exp_avg_sq first (keeps_max_sq) */
      memcpy(sh_out.state[ZD__STATE_MAX_EXP_AVG_SQ], src_copy.state[ZD__STATE_MAX_EXP_AVG_SQ],
             sizeof sh_out.state[0]);
    zd__optim_impl(isas[i])(&a, 0, N);
    CHECK_MSG(!memcmp(&src_copy, &sh_src, sizeof src_copy), "%s: out of place wrote its source",
              what);
    for (uint32_t s = 0; s < nsegs; s++)
      for (uint64_t e = segs[s].offset; e < segs[s].offset + segs[s].length; e++)
        for (int k = 0; k < ZD__NSTATES; k++) {
          if (!a.state[k]) continue;
          CHECK_MSG(same(sh_out.state[k][e], sh_ref.state[k][e]),
                    "%s out of place: %s[%d]: %08x vs %08x", what, zd__state_name((zd__state_t)k),
                    (int)e, f2u(sh_out.state[k][e]), f2u(sh_ref.state[k][e]));
        }
  }
}

static void test_paths(void) {
  zd__isa_t isas[3];
  int nisas = 0;
  zd__isa_t best = zd__isa_detect();
  for (int i = ZD__ISA_AVX2; i <= (int)best; i++) isas[nisas++] = (zd__isa_t)i;
  static const zd_dtype_t gds[] = {ZD_F32, ZD_BF16, ZD_F16};
  static const zd_dtype_t pds[] = {0, ZD_F32, ZD_BF16};
  for (int rep = 0; rep < 3; rep++) {
    make_segments();
    for (int mix = 0; mix < 6; mix++)
      for (uint64_t t = 1; t <= 2; t++)
        for (int g = 0; g < 3; g++)
          for (int p = 0; p < 3; p++) run_case(mix, t, gds[g], pds[p], isas, nisas);
  }
  CHECK(zd__optim_known(ZD_ADAGRAD));
  printf("paths: ");
  for (int i = 0; i < nisas; i++) printf("%s ", zd__isa_name(isas[i]));
  printf(
      "equal the reference bit for bit (SGD, SGD mixed with AdamW/Adam, AdamW/Adam, Adagrad "
      "mixed with both, RMSprop, Lion mixed with AdamW; in place, split, out of place)\n");
}

static void test_table(void) {
  CHECK(zd__optim_known(ZD_ADAMW) && zd__optim_known(ZD_ADAM) && zd__optim_known(ZD_SGD));
  CHECK(!zd__optim_known(99));
  CHECK(!strcmp(zd__optim_kernel_name(ZD_SGD), "sgd"));
  CHECK(!strcmp(zd__optim_kernel_name(ZD_ADAM), "adam"));
  CHECK(!strcmp(zd__optim_kernel_name(ZD_LION), "lion"));
  /* every optimizer the group table admits has a row */
  for (int o = 0; o < 64; o++) {
    zd_group_t g = zd__group_default();
    g.optimizer = (zd_optimizer_t)o;
    zd__err_t err = {0};
    if (zd__group_check(&g, "g", &err) == ZD_OK) CHECK_MSG(zd__optim_known(o), "optimizer %d", o);
  }
  /* each optimizer's arrays are its row's (what its kernel writes), nothing more */
  const zd__states_t M = ZD__STATE_BIT(ZD__STATE_MASTER), EA = ZD__STATE_BIT(ZD__STATE_EXP_AVG),
                     EQ = ZD__STATE_BIT(ZD__STATE_EXP_AVG_SQ),
                     MX = ZD__STATE_BIT(ZD__STATE_MAX_EXP_AVG_SQ),
                     MB = ZD__STATE_BIT(ZD__STATE_MOMENTUM_BUFFER),
                     SU = ZD__STATE_BIT(ZD__STATE_SUM), SQ = ZD__STATE_BIT(ZD__STATE_SQUARE_AVG),
                     GA = ZD__STATE_BIT(ZD__STATE_GRAD_AVG);
  struct {
    zd_optimizer_t opt;
    double momentum;
    int centered, amsgrad;
    zd__states_t want;
  } rows[] = {
      {ZD_ADAMW, 0, 0, 0, M | EA | EQ},
      {ZD_ADAM, 0, 0, 1, M | EA | EQ | MX},
      {ZD_SGD, 0, 0, 0, M},
      {ZD_SGD, 0.9, 0, 0, M | MB},
      {ZD_ADAGRAD, 0, 0, 0, M | SU},
      {ZD_RMSPROP, 0, 0, 0, M | SQ},
      {ZD_RMSPROP, 0.9, 1, 0, M | SQ | MB | GA},
      {ZD_LION, 0, 0, 0, M | EA},
  };
  for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
    zd_group_t g = zd__group_default();
    g.optimizer = rows[r].opt;
    g.momentum = rows[r].momentum;
    g.centered = rows[r].centered;
    g.amsgrad = rows[r].amsgrad;
    CHECK_MSG(zd__optim_states(&g, 1) == rows[r].want, "row %zu (%s): arrays 0x%x, want 0x%x", r,
              zd__optim_kernel_name(g.optimizer), (unsigned)zd__optim_states(&g, 1),
              (unsigned)rows[r].want);
  }
  /* a model's arrays are its groups' union; a group needing one the model lacks is named */
  zd_group_t two[2] = {zd__group_default(), zd__group_default()};
  two[0].optimizer = ZD_SGD;
  two[1].optimizer = ZD_LION;
  CHECK_INT_EQ(zd__optim_states(two, 2), M | EA);
  CHECK_INT_EQ(zd__optim_states_missing(M | EA, two, 2), -1);
  two[0].momentum = 0.9;
  CHECK_INT_EQ(zd__optim_states_missing(M | EA, two, 2), ZD__STATE_MOMENTUM_BUFFER);
  CHECK(!strcmp(zd__state_name(ZD__STATE_MOMENTUM_BUFFER), "momentum_buffer"));
}

int main(void) {
  test_table();
  test_golden();
  test_golden_lion();
  test_paths();
  printf("PASS\n");
  return 0;
}
