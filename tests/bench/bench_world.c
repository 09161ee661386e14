/* bench_world: whole-step time of a multi-rank world against a one-rank world.
 *
 * For each world size W (1, 2, 4 by default) it starts one zerod with W local ranks (Gloo over
 * loopback between them), attaches one client thread per rank, registers a model of n fp32
 * parameters and times zd_step() (reduce-scatter, statistics exchange, AdamW on each rank's 1/W
 * shard, all-gather) as rank 0's client sees it, median over the steps after warm-up. The last
 * column is the step time relative to W=1 on the same machine in the same run. On one host all
 * ranks share the cores and the memory bus, so this measures the overhead of the collectives and
 * of the daemon's coordination, not the scaling a real multi-node job would see.
 *
 *   bench_world [--zerod PATH] [--worlds 1,2,4] [--log2 22,24] [--iters 10]
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "mempass.h"
#include "zerod/zerod.h"

#define MAX_WORLD 8
#define WARMUP    3

typedef struct run {
  const zdt_daemon_t *d;
  uint64_t n;
  int iters;
  uint32_t rank;
  pthread_barrier_t *ready;
  double *times; /* rank 0: per step */
  uint64_t daemon_us;
} run_t;

static void die(const char *what) {
  fprintf(stderr, "bench_world: %s: %s\n", what, zd_last_error());
  exit(1);
}

static void *client_main(void *arg) {
  run_t *r = arg;
  zd_client_t *c;
  if (zd_connect(r->d->socket, (int)r->rank, 0, &c) != ZD_OK) die("connect");
  zd_param_t p = {.name = "weights", .ndim = 1, .shape = {r->n}, .group = 0};
  zd_group_t g;
  zd_group_init(&g, 1, sizeof g);
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = &p;
  desc.nparams = 1;
  desc.groups = &g;
  desc.ngroups = 1;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  desc.grad_reduce = ZD_GRAD_MEAN;
  desc.flags = ZD_REGISTER_REPLACE;
  if (zd_layout(c, &desc) != ZD_OK) die("layout");
  float *grad = zd_grad_buffer(c, NULL);
  for (uint64_t i = 0; i < r->n; i++) grad[i] = (float)((int)((i + r->rank) % 2001) - 1000) * 1e-5f;
  if (zd_register(c) != ZD_OK) die("register");
  pthread_barrier_wait(r->ready);
  for (int it = 0; it < WARMUP + r->iters; it++) {
    zd_step_result_t res = ZD_STEP_RESULT_INIT;
    double t0 = zd_bench_now();
    if (zd_step(c, NULL, &res) != ZD_OK) die("step");
    if (it >= WARMUP && r->rank == 0) {
      r->times[it - WARMUP] = zd_bench_now() - t0;
      r->daemon_us += res.duration_us;
    }
  }
  zd_close(c);
  return NULL;
}

static double run_world(uint32_t w, uint64_t n, int iters, double *daemon_ms) {
  char ws[8];
  snprintf(ws, sizeof ws, "%u", w);
  const char *args[] = {"--world_size", ws, "--local_ranks", ws, "--log_level", "warn", NULL};
  zdt_daemon_t d;
  zdt_start(&d, args);
  pthread_barrier_t ready;
  pthread_barrier_init(&ready, NULL, w);
  double *times = calloc((size_t)iters, sizeof *times);
  run_t runs[MAX_WORLD];
  pthread_t threads[MAX_WORLD];
  for (uint32_t q = 0; q < w; q++) {
    runs[q] = (run_t){.d = &d, .n = n, .iters = iters, .rank = q, .ready = &ready, .times = times};
    pthread_create(&threads[q], NULL, client_main, &runs[q]);
  }
  for (uint32_t q = 0; q < w; q++) pthread_join(threads[q], NULL);
  *daemon_ms = (double)runs[0].daemon_us / iters * 1e-3;
  double med = zd_bench_median(times, iters);
  free(times);
  pthread_barrier_destroy(&ready);
  zdt_stop(&d, SIGTERM, 0);
  return med;
}

/* Parses "1,2,4" into out; returns the count. */
static int parse_list(const char *s, int *out, int max) {
  int n = 0;
  for (const char *p = s; *p && n < max;) {
    out[n++] = atoi(p);
    p = strchr(p, ',');
    if (!p) break;
    p++;
  }
  return n;
}

int main(int argc, char **argv) {
  int worlds[8] = {1, 2, 4}, nworlds = 3, sizes[8] = {22, 24}, nsizes = 2, iters = 10;
  const char *zerod = getenv("ZEROD_BIN") ? getenv("ZEROD_BIN") : "build/daemon/zerod";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--zerod"))
      zerod = argv[i + 1];
    else if (!strcmp(argv[i], "--worlds"))
      nworlds = parse_list(argv[i + 1], worlds, 8);
    else if (!strcmp(argv[i], "--log2"))
      nsizes = parse_list(argv[i + 1], sizes, 8);
    else if (!strcmp(argv[i], "--iters"))
      iters = atoi(argv[i + 1]);
    else {
      fprintf(stderr,
              "usage: bench_world [--zerod PATH] [--worlds 1,2,4] [--log2 22,24] "
              "[--iters N]\n");
      return 2;
    }
  }
  setenv("ZEROD_BIN", zerod, 1);
  printf(
      "# bench_world: zd_step() at world size W (one zerod, W local ranks, Gloo on loopback), "
      "f32, AdamW; median of %d steps after %d warm-up\n#\n",
      iters, WARMUP);
  printf("# %10s %5s %12s %10s %12s %10s\n", "params", "W", "shard_elems", "step_ms", "daemon_ms",
         "vs_W=1");
  for (int s = 0; s < nsizes; s++) {
    uint64_t n = 1ull << sizes[s];
    double base = 0;
    for (int k = 0; k < nworlds; k++) {
      uint32_t w = (uint32_t)worlds[k];
      if (w < 1 || w > MAX_WORLD) continue;
      double daemon_ms, t = run_world(w, n, iters, &daemon_ms);
      if (w == 1 || base == 0) base = t;
      printf("  %10llu %5u %12llu %10.3f %12.3f %9.2fx\n", (unsigned long long)n, w,
             (unsigned long long)(n / w), t * 1e3, daemon_ms, t / base);
      fflush(stdout);
    }
  }
  return 0;
}
