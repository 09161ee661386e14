/* bench_step_cuda: a whole optimizer step through a real zerod running its CUDA backend (world
 * size 1: NCCL's one-rank communicator), against the GPU's memory bandwidth measured in the same
 * run. The CUDA counterpart of tests/bench/bench_step.c.
 *
 * For each size a model of that many fp32 parameters (fp32 gradients, AdamW) is registered with
 * device buffers; each row times zd_step() round trips as the client sees them (request; on the
 * daemon: wait on the client's event, the fused update over the shard reading the client's
 * gradients in place and writing the working parameters into the client's buffer, NCCL's in-place
 * one-rank all-gather, record of the params-ready event, the daemon's bounded wait for its stream;
 * reply; the client's stream waits on the event), and, alternating with them, a device-to-device
 * cudaMemcpyAsync that moves the same bytes (a copy of 16 bytes per parameter reads and writes 32,
 * as the step does: read master, m, v, grad; write master, m, v, param). %copy is the step's
 * bandwidth as a percentage of the copy's. daemon_ms is the time zerod reports for the step.
 * The step is timed on the host (its round trip included), the copy by CUDA events (device time
 * only): at small sizes %copy understates the kernels. A second table times steps with clipping on
 * (statistics, the step record's NCCL all-gather and the one host wait in the middle of a step):
 * the statistics read the gradients once more, 36 bytes a parameter, which its GB/s and %copy
 * count. The last one times the round trip of a step on a tiny model, where the cost is the
 * protocol and the launches, not the bandwidth. Exits 77 without a usable GPU.
 *
 *   bench_step_cuda [--zerod PATH] [--min-log2 20] [--max-log2 28] [--iters 10]
 *                   [--tiny-params 1024] [--tiny-iters 2000]
 */
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "adam_cuda.h"
#include "harness.h"
#include "zerod/zerod.h"

#define CUDA_OK(call)                                                                        \
  do {                                                                                       \
    cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(1);                                                                               \
    }                                                                                        \
  } while (0)

static void usage(void) {
  fprintf(stderr,
          "usage: bench_step_cuda [--zerod PATH] [--min-log2 N] [--max-log2 N] "
          "[--iters N] [--tiny-params N] [--tiny-iters N]\n");
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

static zd_client_t *attach(const zdt_daemon_t *d, uint64_t n, double max_grad_norm) {
  zd_client_t *c;
  if (zd_connect(d->socket, ZD_ANY_RANK, 0, &c) != ZD_OK) {
    fprintf(stderr, "bench_step_cuda: connect: %s\n", zd_last_error());
    exit(1);
  }
  int dev;
  if (zd_cuda_device(c, &dev) != ZD_OK) {
    fprintf(stderr, "bench_step_cuda: %s\n", zd_last_error());
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
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  desc.max_grad_norm = max_grad_norm;
  desc.flags = ZD_REGISTER_REPLACE;
  desc.memory = ZD_MEMORY_CUDA;
  desc.device = dev;
  if (zd_layout(c, &desc) != ZD_OK) {
    fprintf(stderr, "bench_step_cuda: layout of %llu params: %s\n", (unsigned long long)n,
            zd_last_error());
    exit(1);
  }
  size_t bytes;
  void *grad = zd_grad_buffer(c, &bytes), *param = zd_param_buffer(c, NULL);
  float *h = malloc(bytes);
  if (!h) exit(1);
  fill_host(h, n, 1);
  CUDA_OK(cudaMemcpy(grad, h, bytes, cudaMemcpyHostToDevice));
  fill_host(h, n, 0);
  CUDA_OK(cudaMemcpy(param, h, bytes, cudaMemcpyHostToDevice));
  free(h);
  if (zd_register(c) != ZD_OK) {
    fprintf(stderr, "bench_step_cuda: register %llu params: %s\n", (unsigned long long)n,
            zd_last_error());
    exit(1);
  }
  return c;
}

static double step_seconds(zd_client_t *c, uint64_t *daemon_us) {
  zd_step_result_t r = ZD_STEP_RESULT_INIT;
  double t0 = now_s();
  if (zd_step(c, NULL, &r) != ZD_OK) {
    fprintf(stderr, "bench_step_cuda: step: %s\n", zd_last_error());
    exit(1);
  }
  *daemon_us = r.duration_us;
  return now_s() - t0;
}

static double copy_seconds(void *dst, const void *src, size_t bytes, cudaStream_t s, cudaEvent_t a,
                           cudaEvent_t b) {
  CUDA_OK(cudaEventRecord(a, s));
  CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
  CUDA_OK(cudaEventRecord(b, s));
  CUDA_OK(cudaEventSynchronize(b));
  float ms;
  CUDA_OK(cudaEventElapsedTime(&ms, a, b));
  return ms * 1e-3;
}

static void table(const zdt_daemon_t *d, int min_log2, int max_log2, int iters, double clip,
                  void *src, void *dst, cudaStream_t s, cudaEvent_t a, cudaEvent_t b) {
  printf("# %s\n", clip > 0 ? "with clipping (statistics, record all-gather, mid-step host wait)"
                            : "plain AdamW (no statistics at world size 1)");
  printf("# %10s %10s %10s %9s %8s %10s %10s %8s\n", "params", "step_ms", "daemon_ms", "Gparam/s",
         "GB/s", "copy_ms", "copy_GB/s", "%copy");
  double *ts = calloc((size_t)iters, sizeof *ts), *tc = calloc((size_t)iters, sizeof *tc);
  double *td = calloc((size_t)iters, sizeof *td);
  for (int lg = min_log2; lg <= max_log2; lg++) {
    uint64_t n = 1ull << lg;
    zd_client_t *c = attach(d, n, clip);
    size_t half = 16 * (size_t)n;
    for (int it = 0; it < 3 + iters; it++) {
      uint64_t dus;
      double st, cp;
      if (it % 2) {
        st = step_seconds(c, &dus);
        cp = copy_seconds(dst, src, half, s, a, b);
      } else {
        cp = copy_seconds(dst, src, half, s, a, b);
        st = step_seconds(c, &dus);
      }
      if (it >= 3) {
        ts[it - 3] = st;
        tc[it - 3] = cp;
        td[it - 3] = (double)dus * 1e-6;
      }
    }
    double st = percentile(ts, iters, 0.5), cp = percentile(tc, iters, 0.5);
    double dm = percentile(td, iters, 0.5);
    double step_bytes = (clip > 0 ? 36.0 : 32.0) * (double)n, copy_bytes = 2.0 * (double)half;
    double step_bw = step_bytes / st, copy_bw = copy_bytes / cp;
    printf("  %10llu %10.3f %10.3f %9.3f %8.1f %10.3f %10.1f %7.1f%%\n", (unsigned long long)n,
           st * 1e3, dm * 1e3, (double)n / st * 1e-9, step_bw * 1e-9, cp * 1e3, copy_bw * 1e-9,
           100.0 * step_bw / copy_bw);
    fflush(stdout);
    zd_close(c);
  }
  free(ts);
  free(tc);
  free(td);
}

int main(int argc, char **argv) {
  int min_log2 = 20, max_log2 = 28, iters = 10, tiny_iters = 2000;
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
    else if (!strcmp(o, "--tiny-params"))
      tiny_params = (uint64_t)atoll(v);
    else if (!strcmp(o, "--tiny-iters"))
      tiny_iters = atoi(v);
    else
      usage();
  }
  if (min_log2 < 10 || max_log2 > 31 || min_log2 > max_log2 || iters < 1 || tiny_iters < 1) usage();
  char why[1024];
  if (zd__cuda_available(why, sizeof why) == 0) {
    printf("bench_step_cuda: skipped, CUDA unusable: %s\n", why);
    return 77;
  }
  setenv("ZEROD_BIN", zerod, 1);
  zdt_daemon_t d;
  const char *args[] = {"--backend", "cuda", "--log_level", "warn", NULL};
  zdt_start(&d, args);

  struct cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  CUDA_OK(cudaSetDevice(0));
  size_t half = 16 * ((size_t)1 << max_log2);
  void *src, *dst;
  CUDA_OK(cudaMalloc(&src, half));
  CUDA_OK(cudaMalloc(&dst, half));
  CUDA_OK(cudaMemset(src, 1, half));
  CUDA_OK(cudaDeviceSynchronize()); /* the copies run on a non-blocking stream */
  cudaStream_t s;
  cudaEvent_t a, b;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));

  printf(
      "# bench_step_cuda: zd_step() round trips through zerod, CUDA backend, world size 1, "
      "GPU 0 %s\n",
      prop.name);
  printf(
      "# f32 params and grads, AdamW; 32 bytes moved per param (36 with statistics); copy: a "
      "device-to-device copy of 16 bytes per param (32 moved); medians of %d steps after 3 "
      "warm-up\n#\n",
      iters);
  table(&d, min_log2, max_log2, iters, 0, src, dst, s, a, b);
  printf("#\n");
  table(&d, min_log2, max_log2, iters, 1e9, src, dst, s, a, b);

  zd_client_t *c = attach(&d, tiny_params, 0);
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
  printf("#\n# step round trip, %llu params, %d steps\n", (unsigned long long)tiny_params,
         tiny_iters);
  printf("# %10s %10s %10s %10s\n", "params", "p50_us", "p90_us", "p99_us");
  printf("  %10llu %10.1f %10.1f %10.1f\n", (unsigned long long)tiny_params,
         percentile(rt, tiny_iters, 0.5) * 1e6, percentile(rt, tiny_iters, 0.9) * 1e6,
         percentile(rt, tiny_iters, 0.99) * 1e6);
  free(rt);
  CUDA_OK(cudaFree(src));
  CUDA_OK(cudaFree(dst));
  zdt_stop(&d, SIGTERM, 0); /* exits 1 unless zerod exits 0 */
  return 0;
}
