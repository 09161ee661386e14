/* bench_step: a whole optimizer step through a real zerod over its socket, against the memory bus.
 *
 * For each size a model of that many fp32 parameters is registered with a zerod this program
 * starts; each row times zd_step() round trips as the client sees them (request, the daemon's
 * kernel over its shard reading the client's gradients from shared memory and writing the working
 * parameters back into it, reply) and, alternating with them in the same run, a memory pass that
 * moves the same bytes (kernels' loads and stores, no arithmetic: tests/bench/mempass.c) over
 * buffers of the same kinds: fp32 state arrays of this process and the client's own shared grad
 * and param buffers. The last table times the round trip of a step on a tiny model, where the
 * cost is the protocol, not the kernel.
 *
 *   bench_step [--zerod PATH] [--min-log2 20] [--max-log2 26] [--iters 10] [--threads N]
 *              [--tiny-params 1024] [--tiny-iters 2000]
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"
#include "mempass.h"
#include "zerod/zerod.h"

static void usage(void) {
  fprintf(stderr,
          "usage: bench_step [--zerod PATH] [--min-log2 N] [--max-log2 N] [--iters N] "
          "[--threads N]\n                  [--tiny-params N] [--tiny-iters N]\n");
  exit(2);
}

static zd_client_t *attach(const zdt_daemon_t *d, uint64_t n) {
  zd_client_t *c;
  if (zd_connect(d->socket, ZD_ANY_RANK, 0, &c) != ZD_OK) {
    fprintf(stderr, "bench_step: connect: %s\n", zd_last_error());
    exit(1);
  }
  zd_param_t p = {.name = "weights", .ndim = 1, .shape = {n}, .group = 0};
  zd_group_t g = zd_group_default();
  zd_model_desc_t desc = {.params = &p,
                          .nparams = 1,
                          .groups = &g,
                          .ngroups = 1,
                          .param_dtype = ZD_F32,
                          .grad_dtype = ZD_F32,
                          .flags = ZD_REGISTER_REPLACE};
  if (zd_layout(c, &desc) != ZD_OK || zd_register(c) != ZD_OK) {
    fprintf(stderr, "bench_step: register %llu params: %s\n", (unsigned long long)n,
            zd_last_error());
    exit(1);
  }
  size_t bytes;
  float *grad = zd_grad_buffer(c, &bytes), *param = zd_param_buffer(c, NULL);
  for (uint64_t i = 0; i < n; i++) {
    grad[i] = (float)((int)(i % 2001) - 1000) * 1e-5f;
    param[i] = (float)(i % 97) * 1e-3f;
  }
  return c;
}

static double step_seconds(zd_client_t *c, uint64_t *daemon_us) {
  zd_step_result_t r;
  double t0 = zd_bench_now();
  if (zd_step(c, NULL, &r) != ZD_OK) {
    fprintf(stderr, "bench_step: step: %s\n", zd_last_error());
    exit(1);
  }
  *daemon_us = r.duration_us;
  return zd_bench_now() - t0;
}

int main(int argc, char **argv) {
  int min_log2 = 20, max_log2 = 26, iters = 10, tiny_iters = 2000;
  unsigned threads = 0;
  uint64_t tiny_params = 1024;
  const char *zerod = getenv("ZEROD_BIN") ? getenv("ZEROD_BIN") : "build/daemon/zerod";
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) usage();
    const char *o = argv[i], *v = argv[i + 1];
    if (!strcmp(o, "--zerod"))
      zerod = v;
    else if (!strcmp(o, "--min-log2"))
      min_log2 = atoi(v);
    else if (!strcmp(o, "--max-log2"))
      max_log2 = atoi(v);
    else if (!strcmp(o, "--iters"))
      iters = atoi(v);
    else if (!strcmp(o, "--threads"))
      threads = (unsigned)atoi(v);
    else if (!strcmp(o, "--tiny-params"))
      tiny_params = (uint64_t)atoll(v);
    else if (!strcmp(o, "--tiny-iters"))
      tiny_iters = atoi(v);
    else
      usage();
  }
  if (min_log2 < 10 || max_log2 > 30 || min_log2 > max_log2 || iters < 1 || tiny_iters < 1) usage();
  setenv("ZEROD_BIN", zerod, 1);

  zd__pool_t *pool;
  if (zd__pool_create(threads, &pool) != 0) return 1;
  char threads_arg[16];
  snprintf(threads_arg, sizeof threads_arg, "%u", zd__pool_size(pool));
  zdt_daemon_t d;
  const char *args[] = {"--threads", threads_arg, "--log_level", "warn", NULL};
  zdt_start(&d, args);
  zd__isa_t isa = zd__isa_detect();

  /* The pass's own state arrays, as large as the largest model. */
  uint64_t nmax = 1ull << max_log2;
  float *master = zd_bench_alloc(nmax * 4), *m = zd_bench_alloc(nmax * 4);
  float *v = zd_bench_alloc(nmax * 4);
  memset(master, 0, nmax * 4);
  memset(m, 0, nmax * 4);
  memset(v, 0, nmax * 4);

  printf(
      "# bench_step: zd_step() round trips through zerod (f32 params and grads, AdamW, world "
      "size 1, %s kernels, %u threads)\n",
      zd__isa_name(isa), zd__pool_size(pool));
  printf(
      "# 32 bytes moved per param; pass: the same loads and stores over this process's state "
      "arrays and the client's shared buffers; medians of %d steps after 3 warm-up\n#\n",
      iters);
  printf("# %10s %10s %10s %9s %8s %10s %10s %8s\n", "params", "step_ms", "daemon_ms", "Gparam/s",
         "GB/s", "pass_ms", "pass_GB/s", "%pass");
  double *ts = calloc((size_t)iters, sizeof *ts), *tp = calloc((size_t)iters, sizeof *tp);
  double *td = calloc((size_t)iters, sizeof *td);
  for (int lg = min_log2; lg <= max_log2; lg++) {
    uint64_t n = 1ull << lg;
    zd_client_t *c = attach(&d, n);
    zd__segment_t seg = {.offset = 0, .length = n, .group = 0};
    zd__adam_group_t consts;
    zd_group_t g = zd_group_default();
    zd__adam_group_init(&consts, &g, 1);
    zd__adam_args_t pass = {.master = master,
                            .exp_avg = m,
                            .exp_avg_sq = v,
                            .grad = zd_grad_buffer(c, NULL),
                            .grad_dtype = ZD_F32,
                            .param = zd_param_buffer(c, NULL),
                            .param_dtype = ZD_F32,
                            .grad_scale = 1.0f,
                            .segs = &seg,
                            .nsegs = 1,
                            .groups = &consts};
    for (int it = 0; it < 3 + iters; it++) {
      uint64_t dus;
      double s, p;
      if (it % 2) {
        s = step_seconds(c, &dus);
        p = zd_bench_mempass(pool, isa, &pass, n);
      } else {
        p = zd_bench_mempass(pool, isa, &pass, n);
        s = step_seconds(c, &dus);
      }
      if (it >= 3) {
        ts[it - 3] = s;
        tp[it - 3] = p;
        td[it - 3] = (double)dus * 1e-6;
      }
    }
    double s = zd_bench_median(ts, iters), p = zd_bench_median(tp, iters);
    double dm = zd_bench_median(td, iters), bytes = 32.0 * (double)n;
    printf("  %10llu %10.3f %10.3f %9.3f %8.2f %10.3f %10.2f %7.1f%%\n", (unsigned long long)n,
           s * 1e3, dm * 1e3, (double)n / s * 1e-9, bytes / s * 1e-9, p * 1e3, bytes / p * 1e-9,
           100.0 * p / s);
    fflush(stdout);
    zd_close(c);
  }

  /* Round trip of a step on a tiny model: protocol and scheduling, not bandwidth. */
  zd_client_t *c = attach(&d, tiny_params);
  double *rt = calloc((size_t)tiny_iters, sizeof *rt);
  for (int it = 0; it < 100; it++) {
    uint64_t dus;
    step_seconds(c, &dus);
  }
  for (int it = 0; it < tiny_iters; it++) {
    uint64_t dus;
    rt[it] = step_seconds(c, &dus);
  }
  zd_close(c);
  double p50 = zd_bench_percentile(rt, tiny_iters, 0.5),
         p90 = zd_bench_percentile(rt, tiny_iters, 0.9);
  double p99 = zd_bench_percentile(rt, tiny_iters, 0.99);
  printf("#\n# step round trip, %llu params, %d steps\n", (unsigned long long)tiny_params,
         tiny_iters);
  printf("# %10s %10s %10s %10s\n", "params", "p50_us", "p90_us", "p99_us");
  printf("  %10llu %10.1f %10.1f %10.1f\n", (unsigned long long)tiny_params, p50 * 1e6, p90 * 1e6,
         p99 * 1e6);

  int st = zdt_stop(&d, SIGTERM, 0);
  free(rt);
  free(ts);
  free(tp);
  free(td);
  free(master);
  free(m);
  free(v);
  zd__pool_destroy(pool);
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}
