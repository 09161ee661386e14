/* bench_step: a whole optimizer step through a real zerod over its socket, against the memory bus.
 *
 * For each size a model of that many parameters is registered with a zerod this program starts
 * (world size 1, AdamW); each row times zd_step() round trips as the client sees them (request,
 * the daemon's kernel over its shard reading the client's gradients from shared memory and
 * writing the working parameters back into it, reply) next to the step's duration as the daemon
 * reports it (the reply's duration_us), and, alternating with them in the same run, a memory pass
 * that moves the same bytes (kernels' loads and stores, no arithmetic: tests/bench/mempass.c) over
 * padded buffers of the same kinds: fp32 state arrays and two memfds. Everything the step touches
 * is allocated and placed by zerod and libzerod themselves, so the table shows what a user gets,
 * collisions of their arrays included. Sizes are powers of two and, next to each, the power of two
 * plus --odd elements (0: none). The last table times the round trip of a step on a tiny model,
 * where the cost is the protocol, not the kernel.
 *
 *   bench_step [--zerod PATH] [--min-log2 16] [--max-log2 25] [--odd 123456] [--iters 10]
 *              [--threads N] [--dtype f32|bf16] [--tiny-params 1024] [--tiny-iters 2000]
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "mempass.h"
#include "zerod/zerod.h"

static void usage(void) {
  fprintf(stderr,
          "usage: bench_step [--zerod PATH] [--min-log2 N] [--max-log2 N] [--odd N] [--iters N]\n"
          "                  [--threads N] [--dtype f32|bf16] [--tiny-params N] "
          "[--tiny-iters N]\n");
  exit(2);
}

/* Values like those of a model in training: random, none zero. On the machine this was written
 * on, memory moves zeros markedly faster than other data, so zeroed or patterned buffers would
 * flatter whatever runs over them; the pass gets data like the daemon's (size_row). */
static uint64_t rng = 0x2545f4914f6cdd1dull;
static float rnd_unit(void) { /* xorshift64, uniform in [-1, 1) */
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (float)((double)(rng >> 40) / (double)(1 << 23) - 1.0);
}

static void fill(void *buf, uint64_t n, zd_dtype_t dt, float scale) {
  for (uint64_t i = 0; i < n; i++) {
    float x = rnd_unit() * scale;
    if (dt == ZD_BF16)
      ((uint16_t *)buf)[i] = zd__f32_to_bf16(x);
    else
      ((float *)buf)[i] = x;
  }
}

static zd_client_t *attach(const zdt_daemon_t *d, uint64_t n, zd_dtype_t dt) {
  zd_client_t *c;
  if (zd_connect(d->socket, ZD_ANY_RANK, 0, &c) != ZD_OK) {
    fprintf(stderr, "bench_step: connect: %s\n", zd_last_error());
    exit(1);
  }
  zd_param_t p = {.name = "weights", .ndim = 1, .shape = {n}, .group = 0};
  zd_group_t g;
  zd_group_init(&g, 1, sizeof g);
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = &p;
  desc.nparams = 1;
  desc.groups = &g;
  desc.ngroups = 1;
  desc.param_dtype = dt;
  desc.grad_dtype = dt;
  desc.flags = ZD_REGISTER_REPLACE;
  if (zd_layout(c, &desc) != ZD_OK) {
    fprintf(stderr, "bench_step: layout of %llu params: %s\n", (unsigned long long)n,
            zd_last_error());
    exit(1);
  }
  fill(zd_param_buffer(c, NULL), n, dt, 1.0f); /* zerod takes its master weights from these */
  if (zd_register(c) != ZD_OK) {
    fprintf(stderr, "bench_step: register %llu params: %s\n", (unsigned long long)n,
            zd_last_error());
    exit(1);
  }
  fill(zd_grad_buffer(c, NULL), n, dt, 1e-2f);
  return c;
}

static double step_seconds(zd_client_t *c, uint64_t *daemon_us) {
  zd_step_result_t r = ZD_STEP_RESULT_INIT;
  double t0 = zd_bench_now();
  if (zd_step(c, NULL, &r) != ZD_OK) {
    fprintf(stderr, "bench_step: step: %s\n", zd_last_error());
    exit(1);
  }
  *daemon_us = r.duration_us;
  return zd_bench_now() - t0;
}

/* A padded shared buffer for the pass, of the kind the client's buffers are (a memfd). */
static void *pass_shared(size_t bytes) {
  int fd = memfd_create("bench_step", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) {
    fprintf(stderr, "bench_step: memfd: %s\n", strerror(errno));
    exit(1);
  }
  void *p = zd_bench_alloc(bytes, fd);
  close(fd);
  return p;
}

typedef struct {
  zd__pool_t *pool;
  zd__isa_t isa;
  zd_dtype_t dt;
  int iters;
} cfg_t;

static void size_row(const cfg_t *cfg, const zdt_daemon_t *d, uint64_t n) {
  int iters = cfg->iters;
  size_t esz = cfg->dt == ZD_BF16 ? 2 : 4;
  zd_client_t *c = attach(d, n, cfg->dt);
  /* The pass's state: the daemon's master weights (the client's params) and moments of a model
   * some steps into training; its grads and params: copies of the client's. */
  float *master = zd_bench_alloc(n * 4, -1), *m = zd_bench_alloc(n * 4, -1);
  float *v = zd_bench_alloc(n * 4, -1);
  void *grad = pass_shared(n * esz), *param = pass_shared(n * esz);
  memcpy(grad, zd_grad_buffer(c, NULL), n * esz);
  memcpy(param, zd_param_buffer(c, NULL), n * esz);
  for (uint64_t i = 0; i < n; i++) {
    master[i] = cfg->dt == ZD_BF16 ? zd__bf16_to_f32(((uint16_t *)param)[i]) : ((float *)param)[i];
    m[i] = rnd_unit() * 1e-3f;
    v[i] = (rnd_unit() + 1.0f) * 1e-6f;
  }
  zd__segment_t seg = {.offset = 0, .length = n, .group = 0};
  zd__adam_group_t consts;
  zd_group_t g;
  zd_group_init(&g, 1, sizeof g);
  zd__adam_group_init(&consts, &g, 1);
  zd__adam_args_t pass = {.state[ZD__STATE_MASTER] = master,
                          .state[ZD__STATE_EXP_AVG] = m,
                          .state[ZD__STATE_EXP_AVG_SQ] = v,
                          .grad = grad,
                          .grad_dtype = cfg->dt,
                          .param = param,
                          .param_dtype = cfg->dt,
                          .grad_scale = 1.0f,
                          .segs = &seg,
                          .nsegs = 1,
                          .groups = &consts};
  double *ts = calloc((size_t)iters, sizeof *ts), *tp = calloc((size_t)iters, sizeof *tp);
  double *td = calloc((size_t)iters, sizeof *td), *gap = calloc((size_t)iters, sizeof *gap);
  for (int it = 0; it < 3 + iters; it++) {
    uint64_t dus = 0;
    double s = 0, p = 0;
    for (int half = 0; half < 2; half++) {
      /* Each timed operation starts with the other's pool threads asleep (mempass.h). */
      zd_bench_settle();
      if ((it + half) % 2)
        s = step_seconds(c, &dus);
      else
        p = zd_bench_mempass(cfg->pool, cfg->isa, &pass, n);
    }
    if (it >= 3) {
      ts[it - 3] = s;
      tp[it - 3] = p;
      td[it - 3] = (double)dus * 1e-6;
      gap[it - 3] = s - (double)dus * 1e-6;
    }
  }
  double s = zd_bench_median(ts, iters), p = zd_bench_median(tp, iters);
  double dm = zd_bench_median(td, iters), gm = zd_bench_median(gap, iters);
  double bytes = (24.0 + 2.0 * (double)esz) * (double)n;
  printf("  %10llu %10.3f %10.3f %8.0f %9.3f %8.2f %10.3f %10.2f %7.1f%% %7.1f%%\n",
         (unsigned long long)n, s * 1e3, dm * 1e3, gm * 1e6, (double)n / s * 1e-9, bytes / s * 1e-9,
         p * 1e3, bytes / p * 1e-9, 100.0 * p / s, 100.0 * p / dm);
  fflush(stdout);
  zd_close(c);
  free(ts);
  free(tp);
  free(td);
  free(gap);
  zd_bench_free(master, n * 4);
  zd_bench_free(m, n * 4);
  zd_bench_free(v, n * 4);
  zd_bench_free(grad, n * esz);
  zd_bench_free(param, n * esz);
}

int main(int argc, char **argv) {
  int min_log2 = 16, max_log2 = 25, tiny_iters = 2000;
  unsigned threads = 0;
  uint64_t tiny_params = 1024, odd = 123456;
  cfg_t cfg = {.dt = ZD_F32, .iters = 10};
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
    else if (!strcmp(o, "--odd"))
      odd = (uint64_t)atoll(v);
    else if (!strcmp(o, "--iters"))
      cfg.iters = atoi(v);
    else if (!strcmp(o, "--threads"))
      threads = (unsigned)atoi(v);
    else if (!strcmp(o, "--dtype") && (!strcmp(v, "f32") || !strcmp(v, "bf16")))
      cfg.dt = !strcmp(v, "bf16") ? ZD_BF16 : ZD_F32;
    else if (!strcmp(o, "--tiny-params"))
      tiny_params = (uint64_t)atoll(v);
    else if (!strcmp(o, "--tiny-iters"))
      tiny_iters = atoi(v);
    else
      usage();
  }
  if (min_log2 < 10 || max_log2 > 30 || min_log2 > max_log2 || cfg.iters < 1 || tiny_iters < 1 ||
      odd % 64)
    usage();
  setenv("ZEROD_BIN", zerod, 1);

  if (zd__pool_create(threads, 1, &cfg.pool) != 0) return 1; /* bound, as zerod's by default */
  char threads_arg[16];
  snprintf(threads_arg, sizeof threads_arg, "%u", zd__pool_size(cfg.pool));
  zdt_daemon_t d;
  const char *args[] = {"--threads", threads_arg, "--log_level", "warn", NULL};
  zdt_start(&d, args);
  cfg.isa = zd__isa_detect();

  const char *dn = cfg.dt == ZD_BF16 ? "bf16" : "f32";
  printf(
      "# bench_step: zd_step() round trips through zerod (%s params and grads, AdamW, world "
      "size 1, %s kernels, %u threads)\n",
      dn, zd__isa_name(cfg.isa), zd__pool_size(cfg.pool));
  printf(
      "# %d bytes moved per param; step: as the client sees it; daemon: the reply's "
      "duration_us; gap: median of their difference\n# pass: the same loads and stores over "
      "padded buffers of this process; medians of %d steps after 3 warm-up\n#\n",
      cfg.dt == ZD_BF16 ? 28 : 32, cfg.iters);
  printf("# %10s %10s %10s %8s %9s %8s %10s %10s %8s %8s\n", "params", "step_ms", "daemon_ms",
         "gap_us", "Gparam/s", "GB/s", "pass_ms", "pass_GB/s", "%pass", "%pass_d");
  for (int lg = min_log2; lg <= max_log2; lg++) {
    size_row(&cfg, &d, 1ull << lg);
    if (odd) size_row(&cfg, &d, (1ull << lg) + odd);
  }

  /* Round trip of a step on a tiny model: protocol and scheduling, not bandwidth. */
  zd_client_t *c = attach(&d, tiny_params, cfg.dt);
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

  zdt_stop(&d, SIGTERM, 0); /* exits 1 unless zerod exits 0 */
  free(rt);
  zd__pool_destroy(cfg.pool);
  return 0;
}
