/* bench_step_cuda: a whole optimizer step through a real zerod running its CUDA backend, against
 * the GPU's memory bandwidth measured in the same run, for each cuda_step setting (legacy: the
 * worker polls an event and the loop answers once the GPU is done; fast: the stream wakes the
 * worker, which answers as soon as the outcome is known). The CUDA counterpart of
 * tests/bench/bench_step.c.
 *
 * For each setting one zerod is started (--cuda_step MODE; --world N adds --ranks_per_gpu N
 * --local_ranks N, N ranks of one zerod on GPU 0, one client thread each). For each size a model
 * of that many fp32 parameters (fp32 gradients, AdamW) is registered with device buffers; a step
 * is timed from before zd_step() to the end of a cudaStreamSynchronize of the client's stream,
 * which waits on zerod's "params ready": the request, zerod's work on the GPU and the reply,
 * whichever ends last (with cuda_step fast the reply usually comes first). Alternating with the
 * steps, a device-to-device cudaMemcpyAsync moves the same bytes (a copy of 16 bytes per
 * parameter reads and writes 32, as the step does: read master, m, v, grad; write master, m, v,
 * param; with clipping the statistics read the gradients once more: 36). %copy is the step's
 * bandwidth as a percentage of the copy's (the copy is timed by CUDA events, device time only).
 * The parts (GPU microseconds per step, rank 0) come from zerod's timing events on its stream
 * (status: cuda_scatter_us_total, cuda_stats_us_total, cuda_update_us_total,
 * cuda_gather_us_total over cuda_steps_timed); stats is statistics, the records' exchange and the
 * decision. Then the round trip of zd_step() on a tiny model, where the cost is the protocol, the
 * hand-offs and the launches, not the bandwidth. One table for every setting, then the round
 * trips. Exits 77 without a usable GPU.
 *
 *   bench_step_cuda [--zerod PATH] [--cuda-step legacy,fast] [--world N] [--min-log2 20]
 *                   [--max-log2 28] [--iters 10] [--tiny-params 1024] [--tiny-iters 2000]
 */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "adam_cuda.h"
#include "harness.h"
#include "gpu_check.h"
#include "zerod/zerod.h"

#define MAX_MODES 2
#define MAX_WORLD 8
#define PARTS     4 /* scatter, stats, update, gather */

static void usage(void) {
  fprintf(stderr,
          "usage: bench_step_cuda [--zerod PATH] [--cuda-step legacy,fast] [--world N] "
          "[--min-log2 N] [--max-log2 N] [--iters N] [--tiny-params N] [--tiny-iters N]\n");
  exit(2);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double percentile(double *v, int n, double q) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  int i = (int)(q * (n - 1) + 0.5);
  return v[i];
}

static void fill_host(float *h, uint64_t n, int grads) {
  for (uint64_t i = 0; i < n; i++)
    h[i] = grads ? (float)((int)(i % 2001) - 1000) * 1e-5f : (float)(i % 97) * 1e-3f;
}

static void die(const char *what) {
  fprintf(stderr, "bench_step_cuda: %s: %s\n", what, zd_last_error());
  exit(1);
}

/* Connects one client (the next free rank) and registers a model of n fp32 parameters; every
 * rank's thread calls it at once (a registration is collective). */
static zd_client_t *attach(const zdt_daemon_t *d, uint64_t n, double max_grad_norm) {
  zd_client_t *c;
  if (zd_connect(d->socket, ZD_ANY_RANK, 0, &c) != ZD_OK) die("connect");
  int dev;
  if (zd_cuda_device(c, &dev) != ZD_OK) die("zd_cuda_device");
  CUDA_CHECK(cudaSetDevice(dev));
  zd_param_t p = {.name = "weights", .ndim = 1, .shape = {n}, .group = 0};
  zd_group_t g;
  zd_group_init(&g, 1, sizeof g);
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = &p;
  desc.nparams = 1;
  desc.groups = &g;
  desc.ngroups = 1;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  desc.max_grad_norm = max_grad_norm;
  desc.flags = ZD_REGISTER_REPLACE;
  desc.memory = ZD_MEMORY_CUDA;
  desc.device = dev;
  if (zd_layout(c, &desc) != ZD_OK) die("layout");
  size_t bytes;
  void *grad = zd_grad_buffer(c, &bytes), *param = zd_param_buffer(c, NULL);
  float *h = malloc(bytes);
  if (!h) exit(1);
  fill_host(h, n, 1);
  CUDA_CHECK(cudaMemcpy(grad, h, bytes, cudaMemcpyHostToDevice));
  fill_host(h, n, 0);
  CUDA_CHECK(cudaMemcpy(param, h, bytes, cudaMemcpyHostToDevice));
  free(h);
  if (zd_register(c) != ZD_OK) die("register");
  return c;
}

/* One step: the request and, after its reply, the client's stream up to zerod's "params ready"
 * (sync: the GPU's work included; else the round trip alone). */
static double step_seconds(zd_client_t *c, int sync) {
  zd_step_result_t r = ZD_STEP_RESULT_INIT;
  double t0 = now_s();
  if (zd_step(c, NULL, &r) != ZD_OK) die("step");
  if (sync) CUDA_CHECK(cudaStreamSynchronize(NULL)); /* the client's stream: the legacy default */
  return now_s() - t0;
}

typedef struct copier {
  void *src, *dst;
  cudaStream_t s;
  cudaEvent_t a, b;
} copier_t;

static double copy_seconds(const copier_t *cp, size_t bytes) {
  CUDA_CHECK(cudaEventRecord(cp->a, cp->s));
  CUDA_CHECK(cudaMemcpyAsync(cp->dst, cp->src, bytes, cudaMemcpyDeviceToDevice, cp->s));
  CUDA_CHECK(cudaEventRecord(cp->b, cp->s));
  CUDA_CHECK(cudaEventSynchronize(cp->b));
  float ms;
  CUDA_CHECK(cudaEventElapsedTime(&ms, cp->a, cp->b));
  return ms * 1e-3;
}

/* A number of the "# rank <rank>" section of zerod's status (0 when absent). */
static double status_number(const char *text, unsigned rank, const char *key) {
  char sec[32], k[64];
  snprintf(sec, sizeof sec, "# rank %u\n", rank);
  const char *p = strstr(text, sec);
  if (!p) return 0;
  p += strlen(sec);
  const char *end = strstr(p, "\n#");
  snprintf(k, sizeof k, "\n%s:", key);
  const char *q = strstr(p - 1, k);
  if (!q || (end && q > end)) return 0;
  return strtod(q + strlen(k), NULL);
}

/* The GPU parts of rank 0 so far: [steps, scatter, stats, update, gather] microseconds. */
static void gpu_parts(zd_client_t *c, double out[1 + PARTS]) {
  static const char *const keys[1 + PARTS] = {"cuda_steps_timed", "cuda_scatter_us_total",
                                              "cuda_stats_us_total", "cuda_update_us_total",
                                              "cuda_gather_us_total"};
  char *text = NULL;
  if (zd_status(c, &text) != ZD_OK) die("status");
  for (int i = 0; i < 1 + PARTS; i++) out[i] = status_number(text, 0, keys[i]);
  zd_free(text);
}

/* What the ranks' threads share for one size. */
typedef struct run {
  const zdt_daemon_t *d;
  uint64_t n;
  double clip;
  int iters, warmup, sync; /* sync: time to the end of the GPU's work (else the round trip) */
  const copier_t *copier;  /* NULL: no copies */
  pthread_barrier_t bar;
  double *step_s, *copy_s; /* per timed iteration, rank 0's thread */
  double parts[1 + PARTS]; /* per step (GPU microseconds), from rank 0's status */
} run_t;

typedef struct rank_arg {
  run_t *run;
  int idx;
} rank_arg_t;

static void *rank_main(void *arg) {
  rank_arg_t *ra = arg;
  run_t *run = ra->run;
  zd_client_t *c = attach(run->d, run->n, run->clip);
  size_t half = 16 * (size_t)run->n;
  double before[1 + PARTS] = {0}, after[1 + PARTS] = {0};
  for (int it = 0; it < run->warmup + run->iters; it++) {
    int timed = it >= run->warmup, k = it - run->warmup;
    if (ra->idx == 0 && it == run->warmup) gpu_parts(c, before);
    double cp = 0;
    if (ra->idx == 0 && run->copier && it % 2 == 0) cp = copy_seconds(run->copier, half);
    pthread_barrier_wait(&run->bar);
    double st = step_seconds(c, run->sync);
    pthread_barrier_wait(&run->bar); /* every rank's step ended */
    if (ra->idx == 0 && run->copier && it % 2) cp = copy_seconds(run->copier, half);
    if (ra->idx == 0 && timed) {
      run->step_s[k] = st;
      if (run->copy_s) run->copy_s[k] = cp;
    }
  }
  if (ra->idx == 0) {
    gpu_parts(c, after);
    double steps = after[0] - before[0];
    run->parts[0] = steps;
    for (int i = 1; i <= PARTS; i++) run->parts[i] = steps > 0 ? (after[i] - before[i]) / steps : 0;
  }
  pthread_barrier_wait(&run->bar); /* rank 0 read the status before anyone leaves */
  zd_close(c);
  return NULL;
}

static void run_world(run_t *run, int world) {
  pthread_t th[MAX_WORLD];
  rank_arg_t ra[MAX_WORLD];
  pthread_barrier_init(&run->bar, NULL, (unsigned)world);
  for (int i = 0; i < world; i++) {
    ra[i] = (rank_arg_t){.run = run, .idx = i};
    if (pthread_create(&th[i], NULL, rank_main, &ra[i])) {
      fprintf(stderr, "bench_step_cuda: pthread_create failed\n");
      exit(1);
    }
  }
  for (int i = 0; i < world; i++) pthread_join(th[i], NULL);
  pthread_barrier_destroy(&run->bar);
}

static void rows(const char *mode, const zdt_daemon_t *d, int world, int min_log2, int max_log2,
                 int iters, double clip, const copier_t *cp) {
  double *ts = calloc((size_t)iters, sizeof *ts), *tc = calloc((size_t)iters, sizeof *tc);
  for (int lg = min_log2; lg <= max_log2; lg++) {
    run_t run = {.d = d,
                 .n = 1ull << lg,
                 .clip = clip,
                 .iters = iters,
                 .warmup = 3,
                 .sync = 1,
                 .copier = cp,
                 .step_s = ts,
                 .copy_s = tc};
    run_world(&run, world);
    double st = percentile(ts, iters, 0.5), ct = percentile(tc, iters, 0.5);
    double n = (double)run.n, step_bytes = (clip > 0 ? 36.0 : 32.0) * n, copy_bytes = 32.0 * n;
    double step_bw = step_bytes / st, copy_bw = copy_bytes / ct;
    printf("  %-6s %-5s %2d %10llu %9.3f %9.3f %7.1f%% %8.1f %9.1f %8.1f %9.1f %9.1f\n", mode,
           clip > 0 ? "clip" : "plain", world, (unsigned long long)run.n, st * 1e3, ct * 1e3,
           100.0 * step_bw / copy_bw, step_bw * 1e-9, run.parts[1], run.parts[2], run.parts[3],
           run.parts[4]);
    fflush(stdout);
  }
  free(ts);
  free(tc);
}

typedef struct rtt {
  double p50, p99;
} rtt_t;

static rtt_t round_trip(const zdt_daemon_t *d, int world, uint64_t params, int iters) {
  double *rt = calloc((size_t)iters, sizeof *rt);
  run_t run = {.d = d, .n = params, .iters = iters, .warmup = 100, .sync = 0, .step_s = rt};
  run_world(&run, world);
  rtt_t r = {percentile(rt, iters, 0.5) * 1e6, percentile(rt, iters, 0.99) * 1e6};
  free(rt);
  return r;
}

/* Whether this zerod has the setting (its --help lists it). */
static int zerod_has(const char *setting) {
  const char *args[] = {"--help", NULL}, *out = NULL;
  zdt_run(args, &out);
  return out && strstr(out, setting) != NULL;
}

int main(int argc, char **argv) {
  int min_log2 = 20, max_log2 = 28, iters = 10, tiny_iters = 2000, world = 1;
  uint64_t tiny_params = 1024;
  char modes_arg[64] = "legacy,fast";
  const char *zerod = getenv("ZEROD_BIN") ? getenv("ZEROD_BIN") : "build/daemon/zerod";
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) usage();
    const char *o = argv[i], *v = argv[i + 1];
    if (!strcmp(o, "--zerod"))
      zerod = v;
    else if (!strcmp(o, "--cuda-step"))
      snprintf(modes_arg, sizeof modes_arg, "%s", v);
    else if (!strcmp(o, "--world"))
      world = atoi(v);
    else if (!strcmp(o, "--min-log2"))
      min_log2 = atoi(v);
    else if (!strcmp(o, "--max-log2"))
      max_log2 = atoi(v);
    else if (!strcmp(o, "--iters"))
      iters = atoi(v);
    else if (!strcmp(o, "--tiny-params"))
      tiny_params = (uint64_t)atoll(v);
    else if (!strcmp(o, "--tiny-iters"))
      tiny_iters = atoi(v);
    else
      usage();
  }
  if (min_log2 < 10 || max_log2 > 31 || min_log2 > max_log2 || iters < 1 || tiny_iters < 1 ||
      world < 1 || world > MAX_WORLD)
    usage();
  const char *modes[MAX_MODES];
  int nmodes = 0;
  for (char *save = NULL, *m = strtok_r(modes_arg, ",", &save); m; m = strtok_r(NULL, ",", &save)) {
    if ((strcmp(m, "legacy") && strcmp(m, "fast")) || nmodes == MAX_MODES) usage();
    modes[nmodes++] = m;
  }
  if (!nmodes) usage();
  char why[1024];
  if (zd__cuda_available(why, sizeof why) == 0) {
    printf("bench_step_cuda: skipped, CUDA unusable: %s\n", why);
    return 77;
  }
  setenv("ZEROD_BIN", zerod, 1);
  char world_s[16];
  snprintf(world_s, sizeof world_s, "%d", world);
  if (world > 1 && !zerod_has("ranks_per_gpu")) {
    printf("# --world %d: this zerod refuses ranks_per_gpu (no such setting): world size 1\n",
           world);
    world = 1;
  }

  struct cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  CUDA_CHECK(cudaSetDevice(0));
  size_t half = 16 * ((size_t)1 << max_log2);
  copier_t cp;
  CUDA_CHECK(cudaMalloc(&cp.src, half));
  CUDA_CHECK(cudaMalloc(&cp.dst, half));
  CUDA_CHECK(cudaMemset(cp.src, 1, half));
  CUDA_CHECK(cudaDeviceSynchronize()); /* the copies run on a non-blocking stream */
  CUDA_CHECK(cudaStreamCreateWithFlags(&cp.s, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreate(&cp.a));
  CUDA_CHECK(cudaEventCreate(&cp.b));

  printf("# bench_step_cuda: zd_step() through zerod, CUDA backend, world size %d on GPU 0 %s\n",
         world, prop.name);
  printf(
      "# f32 params and grads, AdamW; step: zd_step() until the client's stream has passed "
      "zerod's params-ready; 32 bytes moved per param (36 with clipping); copy: a device-to-device "
      "copy of 16 bytes per param (32 moved); medians of %d steps after 3 warm-up; gpu_*: zerod's "
      "timing events, rank 0, microseconds per step (stats: statistics, records, decision)\n#\n",
      iters);
  printf("# %-6s %-5s %2s %10s %9s %9s %8s %8s %9s %8s %9s %9s\n", "mode", "kind", "W", "params",
         "step_ms", "copy_ms", "%copy", "GB/s", "gpu_scat", "gpu_stat", "gpu_upd", "gpu_gath");
  rtt_t rtt[MAX_MODES];
  for (int m = 0; m < nmodes; m++) {
    zdt_daemon_t d;
    const char *args[] = {"--backend",
                          "cuda",
                          "--log_level",
                          "warn",
                          "--cuda_step",
                          modes[m],
                          world > 1 ? "--ranks_per_gpu" : NULL,
                          world_s,
                          "--local_ranks",
                          world_s,
                          NULL};
    zdt_start(&d, args);
    rows(modes[m], &d, world, min_log2, max_log2, iters, 0, &cp);
    rows(modes[m], &d, world, min_log2, max_log2, iters, 1e9, &cp);
    rtt[m] = round_trip(&d, world, tiny_params, tiny_iters);
    zdt_stop(&d, SIGTERM, 0); /* exits 1 unless zerod exits 0 */
  }
  printf("#\n# zd_step() round trip (the reply, not the GPU's work), %llu params, %d steps\n",
         (unsigned long long)tiny_params, tiny_iters);
  printf("# %-6s %2s %10s %10s %10s\n", "mode", "W", "params", "p50_us", "p99_us");
  for (int m = 0; m < nmodes; m++)
    printf("  %-6s %2d %10llu %10.1f %10.1f\n", modes[m], world, (unsigned long long)tiny_params,
           rtt[m].p50, rtt[m].p99);
  CUDA_CHECK(cudaFree(cp.src));
  CUDA_CHECK(cudaFree(cp.dst));
  return 0;
}
