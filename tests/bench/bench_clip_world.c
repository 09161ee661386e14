/* bench_clip_world: what clipping by torch's fp32 total costs a step at world size 2, against
 * clipping by zerod's double norm, in the same run.
 *
 * One zerod of 2 local ranks (CPU backend, AdamW, f32) and two trainer threads, one client each.
 * Per size n a model of n parameters in 7 parameters of unequal sizes (one bucket: the slice
 * boundary falls inside a parameter, so every clipped step with a torch order passes one chain
 * between the ranks) is registered with max_grad_norm 1e-3 (every step clips). The steps alternate
 * clip_norm = double and clip_norm = torch215 (the scatter inside the step), --iters of each after
 * 2 warm-up pairs; each row gives the medians of the step's duration as rank 0's zerod reports it
 * (zd_step_result_t.duration_us: the scatter, the statistics, the norm, the update) and as rank
 * 0's client sees it (the round trip), what the torch order adds, and zerod's fastest step of
 * each (less sensitive to a loaded machine than the median). All times in ms.
 *
 *   bench_clip_world [--zerod PATH] [--min-log2 20] [--max-log2 23] [--iters 9]
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "mempass.h"
#include "zerod/zerod.h"

#define NPARAMS   7
#define MAX_ITERS 64

static void die(const char *what) {
  fprintf(stderr, "bench_clip_world: %s: %s\n", what, zd_last_error());
  exit(1);
}

typedef struct trainer {
  const zdt_daemon_t *d;
  uint64_t n;
  int iters;
  double zerod_s[2][MAX_ITERS], client_s[2][MAX_ITERS]; /* [double, torch215][iteration] */
} trainer_t;

static zd_client_t *attach(const zdt_daemon_t *d, uint64_t n) {
  zd_client_t *c;
  if (zd_connect(d->socket, ZD_ANY_RANK, 0, &c) != ZD_OK) die("connect");
  /* unequal sizes: 3/32, 5/32, ... of n, the rest in the last, none a multiple of 64 */
  zd_param_t p[NPARAMS];
  char names[NPARAMS][16];
  uint64_t left = n;
  for (int i = 0; i < NPARAMS; i++) {
    uint64_t k = i + 1 < NPARAMS ? n / 32 * (uint64_t)(2 * i + 3) / 4 + 13 : left;
    left -= k;
    snprintf(names[i], sizeof names[i], "w%d", i);
    p[i] = (zd_param_t){.name = names[i], .ndim = 1, .shape = {k}, .group = 0};
  }
  zd_group_t g;
  zd_group_init(&g, 1, sizeof g);
  g.weight_decay = 0.01;
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = p;
  desc.nparams = NPARAMS;
  desc.groups = &g;
  desc.ngroups = 1;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  desc.max_grad_norm = 1e-3;
  desc.flags = ZD_REGISTER_REPLACE;
  if (zd_layout(c, &desc) != ZD_OK) die("layout");
  float *w = zd_param_buffer(c, NULL);
  for (uint64_t i = 0; i < n; i++) w[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
  if (zd_register(c) != ZD_OK) die("register");
  float *gr = zd_grad_buffer(c, NULL);
  for (uint64_t i = 0; i < n; i++) gr[i] = (float)((i * 40503u) % 1000) * 1e-5f - 5e-3f;
  return c;
}

static void *run(void *arg) {
  trainer_t *t = arg;
  zd_client_t *c = attach(t->d, t->n);
  for (int it = -2; it < t->iters; it++)
    for (int k = 0; k < 2; k++) {
      zd_step_opts_t o = ZD_STEP_OPTS_INIT;
      o.clip_norm = k ? ZD_CLIP_NORM_TORCH215 : ZD_CLIP_NORM_DOUBLE;
      zd_step_result_t r = ZD_STEP_RESULT_INIT;
      double t0 = zd_bench_now();
      if (zd_step(c, &o, &r) != ZD_OK) die("step");
      double s = zd_bench_now() - t0;
      if (r.clip_coef >= 1.0) {
        fprintf(stderr, "bench_clip_world: the step did not clip (coefficient %g)\n", r.clip_coef);
        exit(1);
      }
      if (it >= 0) {
        t->zerod_s[k][it] = (double)r.duration_us * 1e-6;
        t->client_s[k][it] = s;
      }
    }
  zd_close(c);
  return NULL;
}

int main(int argc, char **argv) {
  int lo = 20, hi = 23, iters = 9;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--zerod") && i + 1 < argc)
      setenv("ZEROD_BIN", argv[++i], 1);
    else if (!strcmp(argv[i], "--min-log2") && i + 1 < argc)
      lo = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--max-log2") && i + 1 < argc)
      hi = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
      iters = atoi(argv[++i]);
    else {
      fprintf(stderr,
              "usage: bench_clip_world [--zerod PATH] [--min-log2 N] [--max-log2 N] "
              "[--iters N]\n");
      return 2;
    }
  }
  if (iters < 1 || iters > MAX_ITERS || lo < 10 || hi > 28 || lo > hi) {
    fprintf(stderr, "bench_clip_world: --iters 1..%d, --min-log2 10.. <= --max-log2 ..28\n",
            MAX_ITERS);
    return 2;
  }
  const char *extra[] = {"--local_ranks", "2", "--log_level", "warn", NULL};
  zdt_daemon_t d;
  zdt_start(&d, extra);
  printf("W=2, one zerod of 2 local ranks, every step clips; medians of %d steps each\n", iters);
  printf("%-10s %12s %12s %9s %12s %12s %9s   %s\n", "params", "zerod dbl", "zerod t215", "+ms",
         "client dbl", "client t215", "+ms", "zerod's fastest step: dbl, t215, +ms");
  for (int l = lo; l <= hi; l++) {
    trainer_t t[2];
    pthread_t th[2];
    for (int r = 0; r < 2; r++) {
      memset(&t[r], 0, sizeof t[r]);
      t[r] = (trainer_t){.d = &d, .n = (uint64_t)1 << l, .iters = iters};
      if (pthread_create(&th[r], NULL, run, &t[r])) die("pthread_create");
    }
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    double m[4], lo4[4];
    double *cols[4] = {t[0].zerod_s[0], t[0].zerod_s[1], t[0].client_s[0], t[0].client_s[1]};
    for (int k = 0; k < 4; k++) {
      lo4[k] = cols[k][0];
      for (int i = 1; i < iters; i++)
        if (cols[k][i] < lo4[k]) lo4[k] = cols[k][i];
      m[k] = zd_bench_median(cols[k], iters) * 1e3;
      lo4[k] *= 1e3;
    }
    printf("2^%-8d %12.3f %12.3f %+9.3f %12.3f %12.3f %+9.3f   min %8.3f %8.3f %+8.3f\n", l, m[0],
           m[1], m[1] - m[0], m[2], m[3], m[3] - m[2], lo4[0], lo4[1], lo4[1] - lo4[0]);
    fflush(stdout);
  }
  zdt_stop(&d, 15, 0);
  return 0;
}
