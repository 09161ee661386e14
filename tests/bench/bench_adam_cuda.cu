/* bench_adam_cuda: throughput of the CUDA optimizer step (kernels/adam.cu) against the GPU's
 * memory bandwidth, measured in the same run.
 *
 * The update streams: per element it reads master, exp_avg, exp_avg_sq and the grad and writes
 * master, exp_avg, exp_avg_sq and the working parameter. Each row times the kernel and a
 * device-to-device cudaMemcpyAsync that moves the same number of bytes (a copy of half of them:
 * it reads and writes each byte once), alternating so that both see the same clocks, and reports
 * medians after warm-up; the last column is the kernel's bandwidth as a percentage of the copy's
 * (the issue's target: at least 90% on H100/H200). The gradient statistics (the per-block pass,
 * the tree over the block sums and the record's seal) are timed too, against the bytes of grad
 * they read. The grid column is the update's (blocks of 256 threads, from the kernel's
 * occupancy: zd__cuda_adam_grid). Segments are model-like: ~1M-element matrices alternating with
 * small vectors, odd lengths so boundaries fall anywhere. Exits 77 without a usable GPU.
 *
 *   bench_adam_cuda [--min-log2 20] [--max-log2 28] [--iters 20] [--warmup 3]
 *                   [--grad f32|bf16|f16] [--param f32|bf16|none]
 */
#include <cuda_runtime.h>

#include "gpu_check.h"
#include "group.h"

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return x < y ? -1 : x > y;
}

static float median(float *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_float);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static size_t dtype_size(int t) {
  return t == ZD_F32 ? 4 : t ? 2 : 0;
}

static const char *dtype_name(int t) {
  return t == ZD_F32 ? "f32" : t == ZD_BF16 ? "bf16" : t == ZD_F16 ? "f16" : "none";
}

/* bench_adam's segments: big matrices alternating with small vectors (no weight decay). */
static uint32_t make_segments(zd__segment_t *segs, uint64_t n) {
  uint32_t ns = 0;
  for (uint64_t pos = 0; pos < n;) {
    uint64_t len = ns % 2 == 0 ? (1u << 20) + 4099 * (ns % 7) + 13 : 1024 + 3 * ns;
    if (len > n - pos) len = n - pos;
    segs[ns].offset = pos;
    segs[ns].length = len;
    segs[ns].group = ns % 2;
    pos += len;
    ns++;
  }
  return ns;
}

__global__ void fill_kernel(float *x, uint64_t n, float base, float step) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    x[i] = base + step * (float)(i % 1021);
}

__global__ void fill16_kernel(uint16_t *x, uint64_t n, uint16_t base) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    x[i] = (uint16_t)(base + i % 61);
}

static void usage(void) {
  fprintf(stderr,
          "usage: bench_adam_cuda [--min-log2 N] [--max-log2 N] [--iters N] [--warmup N]\n"
          "                       [--grad f32|bf16|f16] [--param f32|bf16|none]\n");
  exit(2);
}

static int parse_dtype(const char *s, int allow_none) {
  if (!strcmp(s, "f32")) return ZD_F32;
  if (!strcmp(s, "bf16")) return ZD_BF16;
  if (!strcmp(s, "f16") && !allow_none) return ZD_F16;
  if (!strcmp(s, "none") && allow_none) return 0;
  usage();
  return -1;
}

int main(int argc, char **argv) {
  int min_log2 = 20, max_log2 = 28, iters = 20, warmup = 3, gdt = ZD_F32, pdt = ZD_BF16;
  for (int i = 1; i < argc; i++) {
    const char *opt = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
    if (!val) usage();
    if (!strcmp(opt, "--min-log2"))
      min_log2 = atoi(val);
    else if (!strcmp(opt, "--max-log2"))
      max_log2 = atoi(val);
    else if (!strcmp(opt, "--iters"))
      iters = atoi(val);
    else if (!strcmp(opt, "--warmup"))
      warmup = atoi(val);
    else if (!strcmp(opt, "--grad"))
      gdt = parse_dtype(val, 0);
    else if (!strcmp(opt, "--param"))
      pdt = parse_dtype(val, 1);
    else
      usage();
    i++;
  }
  if (min_log2 < 10 || max_log2 > 32 || min_log2 > max_log2 || iters < 1 || warmup < 0) usage();
  gpu_or_skip("bench_adam_cuda");
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t ev[4];
  for (int i = 0; i < 4; i++) CUDA_CHECK(cudaEventCreate(&ev[i]));

  printf(
      "# grad %s, param %s; bytes per element: read %zu, write %zu; medians of %d runs after "
      "%d warm-up\n",
      dtype_name(gdt), dtype_name(pdt), 12 + dtype_size(gdt), 12 + dtype_size(pdt), iters, warmup);
  printf("# %12s %8s %6s %10s %10s %10s %10s %8s %10s %10s\n", "params", "segs", "grid", "step_us",
         "GB/s", "copy_us", "copy_GB/s", "%copy", "stats_us", "stats_GB/s");
  float *t_step = (float *)malloc(sizeof(float) * (size_t)iters);
  float *t_copy = (float *)malloc(sizeof(float) * (size_t)iters);
  float *t_stats = (float *)malloc(sizeof(float) * (size_t)iters);
  CHECK(t_step && t_copy && t_stats);
  for (int lg = min_log2; lg <= max_log2; lg++) {
    uint64_t n = (uint64_t)1 << lg;
    size_t gsz = dtype_size(gdt), psz = dtype_size(pdt);
    size_t bytes = n * (12 + gsz) + n * (12 + psz);
    size_t copy_bytes = bytes / 2;
    float *p, *m, *v;
    void *g, *param = NULL, *src, *dst;
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (bytes + 2 * copy_bytes + (64u << 20) > free_b) {
      printf("# 2^%d params: %.1f GiB needed, %.1f GiB free: stopping\n", lg,
             (double)(bytes + 2 * copy_bytes) / (1 << 30), (double)free_b / (1 << 30));
      break;
    }
    CUDA_CHECK(cudaMalloc((void **)&p, n * 4));
    CUDA_CHECK(cudaMalloc((void **)&m, n * 4));
    CUDA_CHECK(cudaMalloc((void **)&v, n * 4));
    CUDA_CHECK(cudaMalloc(&g, n * gsz));
    if (psz) CUDA_CHECK(cudaMalloc(&param, n * psz));
    CUDA_CHECK(cudaMalloc(&src, copy_bytes));
    CUDA_CHECK(cudaMalloc(&dst, copy_bytes));
    fill_kernel<<<1024, 256, 0, stream>>>(p, n, -0.5f, 1e-3f);
    fill_kernel<<<1024, 256, 0, stream>>>(m, n, 0.0f, 1e-5f);
    fill_kernel<<<1024, 256, 0, stream>>>(v, n, 1e-6f, 1e-8f);
    if (gdt == ZD_F32)
      fill_kernel<<<1024, 256, 0, stream>>>((float *)g, n, -1e-2f, 2e-5f);
    else
      fill16_kernel<<<1024, 256, 0, stream>>>((uint16_t *)g, n, gdt == ZD_BF16 ? 0x3c00 : 0x2000);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaMemsetAsync(src, 1, copy_bytes, stream));

    zd__segment_t *segs = (zd__segment_t *)malloc((n / 1024 + 2) * sizeof *segs);
    CHECK(segs);
    uint32_t nsegs = make_segments(segs, n);
    zd__cuda_layout_t *l = NULL;
    ZD_CHECK(zd__cuda_layout_create(segs, nsegs, n, stream, &l, &gpu_err));
    zd__adam_group_t groups[2];
    zd_group_t hp[2] = {zd__group_default(), zd__group_default()}; /* AdamW */
    for (int k = 0; k < 2; k++) {
      hp[k].lr = 1e-4;
      hp[k].beta2 = 0.95;
      hp[k].weight_decay = k ? 0 : 0.1;
    }
    zd__adam_group_init(&groups[0], &hp[0], 10);
    zd__adam_group_init(&groups[1], &hp[1], 10);
    zd__cuda_adam_args_t a;
    memset(&a, 0, sizeof a);
    a.state[ZD__STATE_MASTER] = p;
    a.state[ZD__STATE_EXP_AVG] = m;
    a.state[ZD__STATE_EXP_AVG_SQ] = v;
    a.grad = g;
    a.grad_dtype = (zd_dtype_t)gdt;
    a.param = param;
    a.param_dtype = pdt ? (zd_dtype_t)pdt : ZD_F32;
    a.grad_scale = 1.0f / 1024;
    a.groups = groups;
    a.ngroups = 2;
    zd__cuda_stats_t *rec;
    CUDA_CHECK(cudaMalloc((void **)&rec, sizeof *rec));

    for (int it = -warmup; it < iters; it++) {
      CUDA_CHECK(cudaEventRecord(ev[0], stream));
      ZD_CHECK(zd__cuda_adam_step(l, &a, stream, &gpu_err));
      CUDA_CHECK(cudaEventRecord(ev[1], stream));
      CUDA_CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, stream));
      CUDA_CHECK(cudaEventRecord(ev[2], stream));
      ZD_CHECK(zd__cuda_grad_stats(l, g, (zd_dtype_t)gdt, rec, 0, NULL, stream, &gpu_err));
      CUDA_CHECK(cudaEventRecord(ev[3], stream));
      CUDA_CHECK(cudaEventSynchronize(ev[3]));
      if (it < 0) continue;
      CUDA_CHECK(cudaEventElapsedTime(&t_step[it], ev[0], ev[1]));
      CUDA_CHECK(cudaEventElapsedTime(&t_copy[it], ev[1], ev[2]));
      CUDA_CHECK(cudaEventElapsedTime(&t_stats[it], ev[2], ev[3]));
    }
    double step_ms = median(t_step, iters), copy_ms = median(t_copy, iters),
           stats_ms = median(t_stats, iters);
    double step_gbs = (double)bytes / (step_ms * 1e6),
           copy_gbs = 2.0 * copy_bytes / (copy_ms * 1e6);
    printf("  %12llu %8u %6u %10.1f %10.1f %10.1f %10.1f %7.1f%% %10.1f %10.1f\n",
           (unsigned long long)n, nsegs, zd__cuda_adam_grid(l, &a), step_ms * 1e3, step_gbs,
           copy_ms * 1e3, copy_gbs, 100.0 * step_gbs / copy_gbs, stats_ms * 1e3,
           (double)(n * gsz) / (stats_ms * 1e6));
    fflush(stdout);
    zd__cuda_layout_destroy(l);
    free(segs);
    CUDA_CHECK(cudaFree(rec));
    CUDA_CHECK(cudaFree(p));
    CUDA_CHECK(cudaFree(m));
    CUDA_CHECK(cudaFree(v));
    CUDA_CHECK(cudaFree(g));
    if (param) CUDA_CHECK(cudaFree(param));
    CUDA_CHECK(cudaFree(src));
    CUDA_CHECK(cudaFree(dst));
  }
  free(t_step);
  free(t_copy);
  free(t_stats);
  for (int i = 0; i < 4; i++) CUDA_CHECK(cudaEventDestroy(ev[i]));
  CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
