/* Worlds of several ranks on loopback: real zerods joined through the rendezvous service and Gloo,
 * one client thread per rank training the example MLP on its own data.
 *
 * Against a reference computed in this process: the ranks' gradients reduced in the order the
 * Gloo ring adds them (gloo.h: chunk c sums ranks c+1, c+2, ..., c), the gradient statistics and
 * loss scaler recomputed with the kernels' reference functions in the daemon's order, and the
 * reference AdamW. Every working parameter of every rank must be bitwise equal to the reference
 * after every step, at W=2 (2 zerods x 1 rank; the ring order is then plain a + b, so this is
 * also the same as summing the two ranks' gradients) and at W=4 (2 zerods x 2 ranks; the ring
 * order differs from rank order by rounding, reported as the distance to a rank-order reference).
 * Gradients are averaged over the ranks (the zero value of zd_model_desc_t.grad_reduce), and in
 * one run summed (ZD_GRAD_SUM). Then: memory per rank, clipping and fp16 overflow skips with the
 * loss-scale trajectory, disagreements refused (layout, hyperparameters, a rank that would
 * resume a different state), and a peer killed with SIGKILL: the survivor reports degraded within
 * the collective timeout and keeps serving status. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "adam.h"
#include "check.h"
#include "dtype_ref.h"
#include "harness.h"
#include "layout.h"
#include "mlp.h"
#include "zerod/zerod.h"

#define MAX_RANKS             4
#define COLLECTIVE_TIMEOUT_MS "3000"

typedef struct world {
  uint32_t world_size;
  uint32_t ndaemons;
  zdt_daemon_t daemons[2];
} world_t;

static const char *connect_timeout_ms = "20000"; /* joining a world, and registering */
static const char *collective_timeout_ms = COLLECTIVE_TIMEOUT_MS;

static void start_world(world_t *w, uint32_t world_size, uint32_t ndaemons) {
  w->world_size = world_size;
  w->ndaemons = ndaemons;
  uint32_t per = world_size / ndaemons;
  for (uint32_t i = 0; i < ndaemons; i++) {
    char ws[8], lr[8], fr[8];
    snprintf(ws, sizeof ws, "%u", world_size);
    snprintf(lr, sizeof lr, "%u", per);
    snprintf(fr, sizeof fr, "%u", i * per);
    const char *args[] = {"--world_size",
                          ws,
                          "--local_ranks",
                          lr,
                          "--first_rank",
                          fr,
                          "--collective_timeout_ms",
                          collective_timeout_ms,
                          "--shutdown_timeout_ms",
                          "1000",
                          "--connect_timeout_ms",
                          connect_timeout_ms,
                          "--bucket_elems",
                          "256",
                          "--threads",
                          "1",
                          i ? "--rendezvous_address" : NULL,
                          w->daemons[0].control,
                          NULL};
    zdt_start(&w->daemons[i], args);
  }
}

static void stop_world(world_t *w) {
  for (uint32_t i = w->ndaemons; i-- > 0;) {
    if (!w->daemons[i].pid) { /* killed by the test */
      zdt_stop(&w->daemons[i], 0, 0);
      continue;
    }
    zdt_stop(&w->daemons[i], SIGTERM, 0);
  }
}

static const zdt_daemon_t *daemon_of(const world_t *w, uint32_t rank) {
  return &w->daemons[rank / (w->world_size / w->ndaemons)];
}

/* ---- what one run does ----------------------------------------------------------------------- */

typedef struct run_cfg {
  const char *name;
  zd_dtype_t param_dtype, grad_dtype;
  int steps;
  double max_grad_norm;
  int loss_scaling;
  const int *overflow_steps;    /* steps at which rank 1 puts an inf into its gradient (-1 ends) */
  zd_grad_reduce_t grad_reduce; /* left 0 (ZD_GRAD_MEAN) by most runs: the default must average */
} run_cfg_t;

static const zd_loss_scaler_t scaler_cfg = {.size = sizeof(zd_loss_scaler_t),
                                            .enabled = 1,
                                            .initial_scale = 1024,
                                            .growth_factor = 2,
                                            .backoff_factor = 0.5,
                                            .growth_interval = 10,
                                            .hysteresis = 2,
                                            .min_scale = 1};

static zd_group_t groups_at(int step, zd_group_t g[2]) {
  g[0] = (zd_group_t){.lr = 2e-3 * (1.0 - 0.5 * step / 200.0),
                      .beta1 = 0.9,
                      .beta2 = 0.999,
                      .eps = 1e-8,
                      .weight_decay = 0.01,
                      .optimizer = ZD_ADAMW};
  g[1] = (zd_group_t){.lr = 1e-3,
                      .beta1 = 0.85,
                      .beta2 = 0.99,
                      .eps = 1e-7,
                      .weight_decay = 0.05,
                      .optimizer = ZD_ADAM};
  return g[0];
}

/* Shared between the client threads and the reference (main thread), one step at a time. */
typedef struct shared {
  const world_t *world;
  const run_cfg_t *cfg;
  pthread_barrier_t barrier;
  zd_client_t *clients[MAX_RANKS];
  zd_step_result_t results[MAX_RANKS];
  int rc[MAX_RANKS];
  char err[MAX_RANKS][512];
  double scale; /* loss scale the clients multiply their gradients by */
  int step;
} shared_t;

typedef struct thread_arg {
  shared_t *sh;
  uint32_t rank;
} thread_arg_t;

static int overflow_at(const run_cfg_t *cfg, int step) {
  for (int i = 0; cfg->overflow_steps && cfg->overflow_steps[i] >= 0; i++)
    if (cfg->overflow_steps[i] == step) return 1;
  return 0;
}

static zd_client_t *register_rank(const zdt_daemon_t *d, uint32_t local, const run_cfg_t *cfg,
                                  const zd_param_t *params, unsigned flags, int *rc) {
  zd_client_t *c;
  *rc = zd_connect(d->socket, (int)local, 0, &c);
  CHECK_MSG(*rc == ZD_OK, "connect: %s", zd_last_error());
  zd_group_t g[2];
  groups_at(0, g);
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = params;
  desc.nparams = MLP_NPARAMS;
  desc.groups = g;
  desc.ngroups = 2;
  desc.param_dtype = cfg->param_dtype;
  desc.grad_dtype = cfg->grad_dtype;
  desc.max_grad_norm = cfg->max_grad_norm;
  desc.grad_reduce = cfg->grad_reduce;
  desc.flags = flags;
  if (cfg->loss_scaling) desc.loss_scaler = &scaler_cfg;
  CHECK_INT_EQ(zd_layout(c, &desc), ZD_OK);
  float init[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
  float *p[MLP_NPARAMS] = {init[0], init[1], init[2], init[3]};
  mlp_init(p, 11);
  void *buf = zd_param_buffer(c, NULL);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(c, (size_t)i, &info);
    for (uint64_t k = 0; k < info.numel; k++)
      zdt_store(buf, cfg->param_dtype, info.offset + k, init[i][k]);
  }
  *rc = zd_register(c);
  return c;
}

static void *client_main(void *arg) {
  thread_arg_t *t = arg;
  shared_t *sh = t->sh;
  const run_cfg_t *cfg = sh->cfg;
  const world_t *w = sh->world;
  uint32_t per = w->world_size / w->ndaemons;
  int rc;
  zd_client_t *c = register_rank(daemon_of(w, t->rank), t->rank % per, cfg, mlp_params, 0, &rc);
  CHECK_MSG(rc == ZD_OK, "rank %u register: %s", t->rank, zd_last_error());
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(c, &info);
  CHECK_U64_EQ(info.rank, t->rank);
  CHECK_U64_EQ(info.world_size, w->world_size);
  sh->clients[t->rank] = c;
  pthread_barrier_wait(&sh->barrier); /* registered */
  for (int step = 0; step < cfg->steps; step++) {
    /* backward on this rank's batch, from this rank's working parameters */
    float work[MLP_NPARAMS][MLP_HIDDEN * MLP_IN], grad[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
    float *p[MLP_NPARAMS], *g[MLP_NPARAMS];
    const void *pb = zd_param_buffer(c, NULL);
    void *gb = zd_grad_buffer(c, NULL);
    for (int i = 0; i < MLP_NPARAMS; i++) {
      zd_param_info_t pi = ZD_PARAM_INFO_INIT;
      zd_param_info(c, (size_t)i, &pi);
      p[i] = work[i];
      g[i] = grad[i];
      for (uint64_t k = 0; k < pi.numel; k++)
        work[i][k] = zdt_load(pb, cfg->param_dtype, pi.offset + k);
    }
    mlp_loss_grad((const float *const *)p, g, (uint64_t)step, t->rank);
    for (int i = 0; i < MLP_NPARAMS; i++) {
      zd_param_info_t pi = ZD_PARAM_INFO_INIT;
      zd_param_info(c, (size_t)i, &pi);
      for (uint64_t k = 0; k < pi.numel; k++)
        zdt_store(gb, cfg->grad_dtype, pi.offset + k, grad[i][k] * (float)sh->scale);
    }
    if (t->rank == 1 && overflow_at(cfg, step)) zdt_store(gb, cfg->grad_dtype, 5, INFINITY);
    pthread_barrier_wait(&sh->barrier); /* gradients written: the reference reads them */
    pthread_barrier_wait(&sh->barrier); /* reference done */
    zd_group_t gr[2];
    groups_at(step, gr);
    zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
    opts.groups = gr;
    opts.ngroups = 2;
    sh->results[t->rank] = (zd_step_result_t)ZD_STEP_RESULT_INIT;
    sh->rc[t->rank] = zd_step(c, &opts, &sh->results[t->rank]);
    snprintf(sh->err[t->rank], sizeof sh->err[t->rank], "%s", zd_last_error());
    pthread_barrier_wait(&sh->barrier); /* stepped: the main thread compares */
    pthread_barrier_wait(&sh->barrier); /* compared */
  }
  return NULL;
}

/* ---- the reference ------------------------------------------------------------------------- */

/* Megatron's DynamicGradScaler.update(), written out independently of daemon/scaler.c. */
typedef struct ref_scaler {
  int enabled;
  double scale;
  int growth_tracker;
  int hysteresis_tracker;
} ref_scaler_t;

static void ref_scaler_update(ref_scaler_t *s, int found_inf) {
  if (!s->enabled) return;
  if (found_inf) {
    s->growth_tracker = 0;
    s->hysteresis_tracker -= 1;
    if (s->hysteresis_tracker <= 0)
      s->scale = fmax(s->scale * scaler_cfg.backoff_factor, scaler_cfg.min_scale);
  } else {
    s->growth_tracker += 1;
    if (s->growth_tracker == (int)scaler_cfg.growth_interval) {
      s->growth_tracker = 0;
      s->hysteresis_tracker = (int)scaler_cfg.hysteresis;
      s->scale *= scaler_cfg.growth_factor;
    }
  }
}

typedef struct reference {
  zd__layout_t *layout;
  uint64_t n;
  float *master, *m, *v;
  float **grads; /* per rank, f32 as the daemon reads them */
  float *reduced;
  ref_scaler_t scaler;
  uint64_t step;
  double max_abs_vs_rank_order;
} reference_t;

static void ref_init(reference_t *r, const run_cfg_t *cfg, uint32_t world_size,
                     zd_client_t *rank0) {
  zd_group_t g[2];
  groups_at(0, g);
  CHECK_INT_EQ(zd__layout_build(mlp_params, MLP_NPARAMS, 2, world_size, 256, &r->layout, NULL),
               ZD_OK);
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(rank0, &info);
  CHECK_U64_EQ(info.layout_hash, r->layout->hash);
  r->n = r->layout->total_elems;
  r->master = calloc(r->n, 4);
  r->m = calloc(r->n, 4);
  r->v = calloc(r->n, 4);
  r->reduced = calloc(r->n, 4);
  r->grads = calloc(world_size, sizeof *r->grads);
  for (uint32_t q = 0; q < world_size; q++) r->grads[q] = calloc(r->n, 4);
  const void *pb = zd_param_buffer(rank0, NULL);
  for (uint64_t e = 0; e < r->n; e++) r->master[e] = zdt_load(pb, cfg->param_dtype, e);
  r->scaler = (ref_scaler_t){.enabled = cfg->loss_scaling,
                             .scale = cfg->loss_scaling ? scaler_cfg.initial_scale : 1.0,
                             .hysteresis_tracker = (int)scaler_cfg.hysteresis};
  r->step = 0;
}

static void ref_free(reference_t *r, uint32_t world_size) {
  for (uint32_t q = 0; q < world_size; q++) free(r->grads[q]);
  free(r->grads);
  free(r->reduced);
  free(r->master);
  free(r->m);
  free(r->v);
  zd__layout_free(r->layout);
}

/* One step of the whole world: ring-order reduction, statistics in the daemon's order, loss
 * scaler, clipping, AdamW/Adam. Fills what the step reply should say. */
static void ref_step(reference_t *r, const run_cfg_t *cfg, uint32_t w, int step,
                     zd_step_result_t *expect) {
  const zd__layout_t *l = r->layout;
  for (uint32_t b = 0; b < l->nbuckets; b++) {
    const zd__bucket_t *bk = &l->buckets[b];
    for (uint64_t pos = 0; pos < bk->elems; pos++) {
      uint32_t c = (uint32_t)(pos / bk->shard_elems);
      uint64_t e = bk->offset + pos;
      float acc = r->grads[(c + 1) % w][e];
      for (uint32_t k = 2; k <= w; k++) acc = acc + r->grads[(c + k) % w][e];
      r->reduced[e] = acc;
      float plain = r->grads[0][e];
      for (uint32_t q = 1; q < w; q++) plain = plain + r->grads[q][e];
      double d = fabs((double)plain - (double)acc);
      if (d > r->max_abs_vs_rank_order && isfinite(d)) r->max_abs_vs_rank_order = d;
    }
  }
  /* sum of squares: rank by rank, bucket by bucket, blocks by levels (step.c, adam.h) */
  double total = 0;
  uint64_t nonfinite = 0;
  for (uint32_t q = 0; q < w; q++) {
    double mine = 0;
    for (uint32_t b = 0; b < l->nbuckets; b++) {
      const zd__bucket_t *bk = &l->buckets[b];
      zd__segment_t *segs;
      uint32_t nsegs;
      CHECK_INT_EQ(zd__layout_segments(l, q, b, &segs, &nsegs), 0);
      uint64_t nb = zd__stats_blocks(bk->shard_elems);
      double *sums = calloc(nb ? nb : 1, sizeof *sums);
      zd__grad_stats_ref(r->reduced + bk->offset + (uint64_t)q * bk->shard_elems, ZD_F32, segs,
                         nsegs, bk->shard_elems, 0, nb, sums, &nonfinite);
      mine += zd__grad_stats_sum(sums, nb);
      free(sums);
      free(segs);
    }
    total += mine;
  }
  double pre_scale = (cfg->grad_reduce == ZD_GRAD_SUM ? 1.0 : 1.0 / w) / r->scaler.scale;
  double norm = sqrt(total) * pre_scale;
  *expect = (zd_step_result_t){.grad_norm = norm, .clip_coef = 1.0};
  if (r->scaler.enabled && nonfinite > 0) {
    ref_scaler_update(&r->scaler, 1);
    expect->step = r->step;
    expect->loss_scale = r->scaler.scale;
    return;
  }
  if (cfg->max_grad_norm > 0) { /* torch's clip_grad_norm_ coefficient, fp32 */
    float coef = (1.0f / ((float)norm + (float)1e-6)) * (float)cfg->max_grad_norm;
    if (!(coef >= 1.0f)) expect->clip_coef = coef;
  }
  zd_group_t g[2];
  groups_at(step, g);
  for (uint32_t i = 0; i < l->nparams; i++) {
    const zd__layout_param_t *p = &l->params[i];
    zdt_ref_step(r->master + p->offset, r->m + p->offset, r->v + p->offset, r->reduced + p->offset,
                 p->numel, &g[p->group], r->step + 1, (float)(pre_scale * expect->clip_coef));
  }
  r->step++;
  ref_scaler_update(&r->scaler, 0);
  expect->applied = 1;
  expect->step = r->step;
  expect->loss_scale = r->scaler.scale;
}

static void compare_params(const reference_t *r, zd_client_t *c, zd_dtype_t pdt, uint32_t rank,
                           int step) {
  const void *pb = zd_param_buffer(c, NULL);
  for (uint32_t i = 0; i < r->layout->nparams; i++) {
    const zd__layout_param_t *p = &r->layout->params[i];
    for (uint64_t k = 0; k < p->numel; k++) {
      float want = r->master[p->offset + k];
      if (pdt == ZD_BF16) want = zd__bf16_to_f32(zd__f32_to_bf16(want));
      float got = zdt_load(pb, pdt, p->offset + k);
      uint32_t gb, wb;
      memcpy(&gb, &got, 4);
      memcpy(&wb, &want, 4);
      CHECK_MSG(gb == wb, "step %d rank %u: %s[%llu] is %.9g through zerod, %.9g in the reference",
                step, rank, p->name, (unsigned long long)k, got, want);
    }
  }
}

/* Trains through the world and checks every rank against the reference after every step. */
static void train(world_t *w, const run_cfg_t *cfg) {
  shared_t sh = {.world = w, .cfg = cfg, .scale = cfg->loss_scaling ? scaler_cfg.initial_scale : 1};
  uint32_t n = w->world_size;
  pthread_barrier_init(&sh.barrier, NULL, n + 1);
  pthread_t threads[MAX_RANKS];
  thread_arg_t args[MAX_RANKS];
  for (uint32_t q = 0; q < n; q++) {
    args[q] = (thread_arg_t){.sh = &sh, .rank = q};
    pthread_create(&threads[q], NULL, client_main, &args[q]);
  }
  pthread_barrier_wait(&sh.barrier); /* registered */
  reference_t ref = {0};
  ref_init(&ref, cfg, n, sh.clients[0]);
  for (uint32_t q = 0; q < n; q++) compare_params(&ref, sh.clients[q], cfg->param_dtype, q, 0);
  int skipped = 0, clipped = 0;
  char trajectory[1024] = "";
  for (int step = 0; step < cfg->steps; step++) {
    pthread_barrier_wait(&sh.barrier); /* gradients written */
    for (uint32_t q = 0; q < n; q++) {
      const void *gb = zd_grad_buffer(sh.clients[q], NULL);
      for (uint64_t e = 0; e < ref.n; e++) ref.grads[q][e] = zdt_load(gb, cfg->grad_dtype, e);
    }
    zd_step_result_t expect = ZD_STEP_RESULT_INIT;
    ref_step(&ref, cfg, n, step, &expect);
    pthread_barrier_wait(&sh.barrier); /* reference done */
    pthread_barrier_wait(&sh.barrier); /* stepped */
    for (uint32_t q = 0; q < n; q++) {
      const zd_step_result_t *got = &sh.results[q];
      CHECK_MSG(sh.rc[q] == ZD_OK, "%s: step %d rank %u: %s", cfg->name, step, q, sh.err[q]);
      CHECK_U64_EQ(got->step, expect.step);
      CHECK_INT_EQ(got->applied, expect.applied);
      CHECK_DBL_EQ(got->loss_scale, expect.loss_scale);
      CHECK_DBL_EQ(got->clip_coef, expect.clip_coef);
      CHECK_MSG(
          got->grad_norm == expect.grad_norm || (isnan(got->grad_norm) && isnan(expect.grad_norm)),
          "step %d rank %u: grad norm %.17g, reference %.17g", step, q, got->grad_norm,
          expect.grad_norm);
      compare_params(&ref, sh.clients[q], cfg->param_dtype, q, step + 1);
    }
    skipped += !expect.applied;
    clipped += expect.clip_coef < 1.0;
    if (cfg->loss_scaling && (step < 3 || !expect.applied || expect.loss_scale != sh.scale)) {
      size_t used = strlen(trajectory);
      snprintf(trajectory + used, sizeof trajectory - used, " %d:%g%s", step + 1, expect.loss_scale,
               expect.applied ? "" : "(skip)");
    }
    sh.scale = expect.loss_scale;
    pthread_barrier_wait(&sh.barrier); /* compared */
  }
  for (uint32_t q = 0; q < n; q++) pthread_join(threads[q], NULL);
  printf(
      "  %s: %d steps, every parameter of all %u ranks bitwise equal to the ring-order "
      "reference",
      cfg->name, cfg->steps, n);
  if (n > 2)
    printf(" (a rank-order sum differs from the ring's by up to %.3g)", ref.max_abs_vs_rank_order);
  if (cfg->max_grad_norm > 0) printf("; %d steps clipped", clipped);
  if (cfg->loss_scaling) printf("; %d skipped; loss scale step:value%s", skipped, trajectory);
  printf("\n");

  /* memory: 12 bytes per shard element of state, plus the fp32 gradient shard */
  char *status;
  CHECK_INT_EQ(zd_status(sh.clients[0], &status), ZD_OK);
  char want[128];
  uint64_t shard = ref.layout->shard_elems;
  snprintf(want, sizeof want, "shard_elems:%llu\nstate_bytes:%llu\ngrad_shard_bytes:%llu\n",
           (unsigned long long)shard, (unsigned long long)(12 * shard),
           (unsigned long long)(4 * shard));
  CHECK_CONTAINS(status, want);
  free(status);
  for (uint32_t q = 0; q < n; q++) zd_close(sh.clients[q]);
  ref_free(&ref, n);
  pthread_barrier_destroy(&sh.barrier);
}

/* ---- disagreements and failures ------------------------------------------------------------ */

typedef struct reg_arg {
  const world_t *w;
  uint32_t rank;
  const zd_param_t *params;
  unsigned flags;
  int rc;
  char err[512];
  zd_client_t *c;
} reg_arg_t;

static void *register_thread(void *arg) {
  reg_arg_t *a = arg;
  run_cfg_t cfg = {.param_dtype = ZD_F32, .grad_dtype = ZD_F32};
  uint32_t per = a->w->world_size / a->w->ndaemons;
  a->c = register_rank(daemon_of(a->w, a->rank), a->rank % per, &cfg, a->params, a->flags, &a->rc);
  snprintf(a->err, sizeof a->err, "%s", zd_last_error());
  return NULL;
}

/* Registers on both ranks of a W=2 world at once; returns the clients (NULL where it failed). */
static void register_both(const world_t *w, const zd_param_t *p1, unsigned flags1, reg_arg_t a[2]) {
  pthread_t t[2];
  for (uint32_t q = 0; q < 2; q++) {
    a[q] = (reg_arg_t){.w = w, .rank = q, .params = q ? p1 : mlp_params, .flags = q ? flags1 : 0};
    pthread_create(&t[q], NULL, register_thread, &a[q]);
  }
  for (uint32_t q = 0; q < 2; q++) pthread_join(t[q], NULL);
}

typedef struct step_arg {
  zd_client_t *c;
  double lr;
  int rc;
  char err[512];
  zd_step_result_t res;
  double seconds;
} step_arg_t;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *step_thread(void *arg) {
  step_arg_t *a = arg;
  zd_group_t g[2];
  groups_at(0, g);
  g[0].lr = a->lr;
  zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
  opts.groups = g;
  opts.ngroups = 2;
  a->res = (zd_step_result_t)ZD_STEP_RESULT_INIT;
  double t0 = now_s();
  a->rc = zd_step(a->c, &opts, &a->res);
  a->seconds = now_s() - t0;
  snprintf(a->err, sizeof a->err, "%s", zd_last_error());
  return NULL;
}

static void step_both(zd_client_t *c[2], double lr1, step_arg_t a[2]) {
  pthread_t t[2];
  for (int q = 0; q < 2; q++) {
    a[q] = (step_arg_t){.c = c[q], .lr = q ? lr1 : 2e-3};
    pthread_create(&t[q], NULL, step_thread, &a[q]);
  }
  for (int q = 0; q < 2; q++) pthread_join(t[q], NULL);
}

static void test_disagreements(void) {
  connect_timeout_ms = "3000"; /* a registration below waits for a rank that never comes */
  world_t w;
  start_world(&w, 2, 2);
  /* a different model on rank 1: both ranks refuse, naming the parameter and the rank */
  zd_param_t other[MLP_NPARAMS];
  memcpy(other, mlp_params, sizeof other);
  other[2].shape[1] = 31;
  reg_arg_t r[2];
  register_both(&w, other, 0, r);
  for (int q = 0; q < 2; q++) {
    CHECK_MSG(r[q].rc == ZD_ELAYOUT, "rank %d: %s (%s)", q, zd_err_name(r[q].rc), r[q].err);
    CHECK_CONTAINS(r[q].err, "ranks registered different models");
    CHECK_CONTAINS(r[q].err, q ? "rank 1 vs rank 0" : "rank 0 vs rank 1");
    CHECK_CONTAINS(r[q].err, "parameter 2");
    CHECK_CONTAINS(r[q].err, "'fc2.weight' [4, 32]");
    CHECK_CONTAINS(r[q].err, "'fc2.weight' [4, 31]");
    zd_close(r[q].c);
  }
  printf("  layout mismatch refused on both ranks: %s\n", r[0].err);

  /* the same model: registered; 3 steps */
  register_both(&w, mlp_params, 0, r);
  zd_client_t *c[2] = {r[0].c, r[1].c};
  for (int q = 0; q < 2; q++) CHECK_MSG(r[q].rc == ZD_OK, "rank %d: %s", q, r[q].err);
  step_arg_t s[2];
  for (int i = 0; i < 3; i++) {
    step_both(c, 2e-3, s);
    for (int q = 0; q < 2; q++) CHECK_MSG(s[q].rc == ZD_OK, "rank %d: %s", q, s[q].err);
  }
  /* hyperparameters that differ between ranks: refused on both, nothing applied */
  step_both(c, 3e-3, s);
  for (int q = 0; q < 2; q++) {
    CHECK_INT_EQ(s[q].rc, ZD_EHPARAM);
    CHECK_CONTAINS(s[q].err, "other hyperparameters");
  }
  printf("  hyperparameters differing between ranks refused: %s\n", s[0].err);
  step_both(c, 2e-3, s);
  for (int q = 0; q < 2; q++) {
    CHECK_MSG(s[q].rc == ZD_OK, "rank %d: %s", q, s[q].err);
    CHECK_U64_EQ(s[q].res.step, 4);
  }
  /* a rank that would start afresh while the other resumes: the resume is its rank's alone
   * (docs/design.md, "When a trainer dies"), so the registration with replace waits for a rank
   * that never comes and gives up, and nothing changes */
  zd_close(c[0]);
  zd_close(c[1]);
  register_both(&w, mlp_params, ZD_REGISTER_REPLACE, r);
  CHECK_MSG(r[0].rc == ZD_OK, "rank 0: %s (%s)", zd_err_name(r[0].rc), r[0].err);
  zd_info_t resumed = ZD_INFO_INIT;
  zd_get_info(r[0].c, &resumed);
  CHECK_INT_EQ(resumed.resumed, 1);
  CHECK_U64_EQ(resumed.step, 4);
  CHECK_MSG(r[1].rc == -ETIMEDOUT, "rank 1: %s (%s)", zd_err_name(r[1].rc), r[1].err);
  CHECK_CONTAINS(r[1].err, "not every rank arrived");
  CHECK_CONTAINS(r[1].err, "resumes alone");
  for (int q = 0; q < 2; q++) zd_close(r[q].c);
  printf("  a rank starting afresh while the other resumes alone: %s\n", r[1].err);
  register_both(&w, mlp_params, 0, r);
  for (int q = 0; q < 2; q++) {
    CHECK_MSG(r[q].rc == ZD_OK, "rank %d: %s", q, r[q].err);
    zd_info_t info = ZD_INFO_INIT;
    zd_get_info(r[q].c, &info);
    CHECK_INT_EQ(info.resumed, 1);
    CHECK_U64_EQ(info.step, 4);
    zd_close(r[q].c);
  }
  stop_world(&w);
  connect_timeout_ms = "20000";
}

/* Trainers start minutes apart in real jobs: a registration waits for the other ranks' clients
 * longer than a collective may take (here 4.5 s against a 3 s collective timeout), and a shutdown
 * does not wait for a registration that still waits. */
static void test_registration_timing(void) {
  world_t w;
  start_world(&w, 2, 2);
  reg_arg_t r[2];
  pthread_t t;
  r[0] = (reg_arg_t){.w = &w, .rank = 0, .params = mlp_params};
  pthread_create(&t, NULL, register_thread, &r[0]);
  nanosleep(&(struct timespec){.tv_sec = 4, .tv_nsec = 500000000}, NULL);
  r[1] = (reg_arg_t){.w = &w, .rank = 1, .params = mlp_params};
  register_thread(&r[1]);
  pthread_join(t, NULL);
  for (int q = 0; q < 2; q++) CHECK_MSG(r[q].rc == ZD_OK, "rank %d: %s", q, r[q].err);
  zd_client_t *c[2] = {r[0].c, r[1].c};
  step_arg_t s[2];
  step_both(c, 2e-3, s);
  for (int q = 0; q < 2; q++) CHECK_MSG(s[q].rc == ZD_OK, "rank %d: %s", q, s[q].err);
  printf(
      "  a client registering 4.5 s after its peer (collective timeout 3 s): registered, "
      "stepped\n");
  zd_close(c[0]);
  zd_close(c[1]);
  stop_world(&w);

  /* SIGTERM while rank 0's registration waits for rank 1's client */
  start_world(&w, 2, 2);
  r[0] = (reg_arg_t){.w = &w, .rank = 0, .params = mlp_params};
  pthread_create(&t, NULL, register_thread, &r[0]);
  nanosleep(&(struct timespec){.tv_nsec = 500000000}, NULL);
  double t0 = now_s();
  zdt_stop(&w.daemons[0], SIGTERM, 1);
  double took = now_s() - t0;
  pthread_join(t, NULL);
  CHECK_WITHIN(took, 10.0,
               "a shutdown must not wait out the registration's connect timeout "
               "(20 s)");
  CHECK_MSG(r[0].rc != ZD_OK, "the waiting registration succeeded without its peer");
  printf(
      "  SIGTERM with a registration waiting: zerod exited 0 in %.2f s; the client got %s: "
      "%s\n",
      took, zd_err_name(r[0].rc), r[0].err);
  zd_close(r[0].c);
  stop_world(&w);
}

/* A registration that gave up (its peer's client never came) leaves nothing behind: the peer
 * registering later waits for a partner again instead of taking the one that left for present,
 * and both registering together then works. connect_timeout_ms bounds the registration wait. */
static void test_registration_gives_up(void) {
  connect_timeout_ms = "1500";
  world_t w;
  start_world(&w, 2, 2);
  reg_arg_t r[2];
  r[0] = (reg_arg_t){.w = &w, .rank = 0, .params = mlp_params};
  register_thread(&r[0]);
  CHECK_MSG(r[0].rc == -ETIMEDOUT, "rank 0 alone: %s: %s", zd_err_name(r[0].rc), r[0].err);
  CHECK_CONTAINS(r[0].err, "not every rank arrived");
  zd_close(r[0].c);
  r[1] = (reg_arg_t){.w = &w, .rank = 1, .params = mlp_params};
  register_thread(&r[1]);
  CHECK_MSG(r[1].rc == -ETIMEDOUT, "rank 1 alone, after rank 0 gave up: %s: %s",
            zd_err_name(r[1].rc), r[1].err);
  zd_close(r[1].c);
  register_both(&w, mlp_params, 0, r);
  for (int q = 0; q < 2; q++) CHECK_MSG(r[q].rc == ZD_OK, "rank %d: %s", q, r[q].err);
  char *status;
  CHECK_INT_EQ(zd_status(r[0].c, &status), ZD_OK);
  CHECK_CONTAINS(status, "health:ok\n");
  free(status);
  for (int q = 0; q < 2; q++) zd_close(r[q].c);
  printf(
      "  registrations that gave up one after the other leave the world healthy; together they "
      "register\n");
  stop_world(&w);
  connect_timeout_ms = "20000";
}

/* SIGTERM while a step waits in a collective for a peer that stays silent (its client does not
 * step): after shutdown_timeout_ms (1 s here) the collective is aborted and zerod exits, instead of
 * waiting out the collective timeout (60 s here). */
static void test_shutdown_aborts(void) {
  collective_timeout_ms = "60000";
  world_t w;
  start_world(&w, 2, 2);
  reg_arg_t r[2];
  register_both(&w, mlp_params, 0, r);
  for (int q = 0; q < 2; q++) CHECK_MSG(r[q].rc == ZD_OK, "rank %d: %s", q, r[q].err);
  step_arg_t s = {.c = r[0].c, .lr = 2e-3};
  pthread_t t;
  pthread_create(&t, NULL, step_thread, &s);
  nanosleep(&(struct timespec){.tv_nsec = 300000000}, NULL);
  double t0 = now_s();
  zdt_stop(&w.daemons[0], SIGTERM, 1);
  double took = now_s() - t0;
  pthread_join(t, NULL);
  CHECK_WITHIN(took, 10.0,
               "the collective must be aborted after shutdown_timeout_ms (1 s), "
               "not after the collective timeout (60 s)");
  CHECK_INT_EQ(s.rc, -ECANCELED);
  CHECK_CONTAINS(s.err, "aborted (zerod is shutting down)");
  printf(
      "  SIGTERM with a step waiting for a silent peer: aborted after the shutdown timeout, "
      "zerod exited 0 in %.2f s; the client got %s\n",
      took, zd_err_name(s.rc));
  zd_close(r[0].c);
  zd_close(r[1].c);
  stop_world(&w);
  collective_timeout_ms = COLLECTIVE_TIMEOUT_MS;
}

static void test_peer_killed(void) {
  world_t w;
  start_world(&w, 2, 2);
  reg_arg_t r[2];
  register_both(&w, mlp_params, 0, r);
  zd_client_t *c[2] = {r[0].c, r[1].c};
  for (int q = 0; q < 2; q++) CHECK_MSG(r[q].rc == ZD_OK, "rank %d: %s", q, r[q].err);
  step_arg_t s[2];
  for (int i = 0; i < 5; i++) step_both(c, 2e-3, s);
  zdt_stop(&w.daemons[1], SIGKILL, 1); /* killed: the directory goes with stop_world */
  /* rank 0 steps alone: its collective fails, within the timeout, with a clear error */
  s[0] = (step_arg_t){.c = c[0], .lr = 2e-3};
  step_thread(&s[0]);
  CHECK_MSG(s[0].rc == ZD_EPEER || s[0].rc == -ETIMEDOUT, "step with a dead peer: %s: %s",
            zd_err_name(s[0].rc), s[0].err);
  CHECK_WITHIN(s[0].seconds, 10.0,
               "a dead peer fails the step by the collective timeout "
               "(3 s) at the latest, not a hang");
  printf("  peer killed: rank 0's step failed in %.2f s: %s\n", s[0].seconds, s[0].err);
  /* degraded, still serving status; later steps fail at once */
  char *status;
  CHECK_INT_EQ(zd_status(c[0], &status), ZD_OK);
  CHECK_CONTAINS(status, "health:degraded\n");
  CHECK_CONTAINS(status, "degraded_reason:");
  free(status);
  step_thread(&s[0]);
  CHECK_INT_EQ(s[0].rc, ZD_EDEGRADED);
  CHECK_WITHIN(s[0].seconds, 2.0,
               "a degraded rank answers at once, without trying the "
               "collective again (3 s timeout)");
  zd_close(c[0]);
  zd_close(c[1]); /* its zerod is gone: the bye fails, the client is freed */
  stop_world(&w); /* the survivor still shuts down cleanly */
}

int main(void) {
  world_t w;
  start_world(&w, 2, 2);
  run_cfg_t f32 = {.name = "W=2 (2 zerods x 1 rank), f32",
                   .param_dtype = ZD_F32,
                   .grad_dtype = ZD_F32,
                   .steps = 120};
  train(&w, &f32);
  run_cfg_t bf16 = {.name = "W=2, bf16 params and grads",
                    .param_dtype = ZD_BF16,
                    .grad_dtype = ZD_BF16,
                    .steps = 60};
  stop_world(&w);
  start_world(&w, 2, 2);
  train(&w, &bf16);
  stop_world(&w);

  start_world(&w, 2, 2);
  static const int overflows[] = {14, 15, 31, 50, 51, 52, -1};
  run_cfg_t scaled = {.name = "W=2, fp16 grads, loss scaling, clipping at 0.05",
                      .param_dtype = ZD_F32,
                      .grad_dtype = ZD_F16,
                      .steps = 80,
                      .max_grad_norm = 0.05,
                      .loss_scaling = 1,
                      .overflow_steps = overflows};
  train(&w, &scaled);
  stop_world(&w);

  start_world(&w, 2, 2);
  run_cfg_t sum = {.name = "W=2, f32, gradients summed (ZD_GRAD_SUM)",
                   .param_dtype = ZD_F32,
                   .grad_dtype = ZD_F32,
                   .steps = 30,
                   .grad_reduce = ZD_GRAD_SUM};
  train(&w, &sum);
  stop_world(&w);

  start_world(&w, 4, 2);
  run_cfg_t w4 = {.name = "W=4 (2 zerods x 2 ranks), f32",
                  .param_dtype = ZD_F32,
                  .grad_dtype = ZD_F32,
                  .steps = 100};
  train(&w, &w4);
  stop_world(&w);

  test_disagreements();
  test_registration_timing();
  test_registration_gives_up();
  test_shutdown_aborts();
  test_peer_killed();
  printf("test_world: ok\n");
  return 0;
}
