/* Benchmark of torch's fp32 2-norm order (kernels/grad_norm.h) next to a plain read pass over the
 * same buffer: one thread, as torch's kernel runs, since one output means one chain of 8 lanes.
 * Table: elements, the norm's time per order, GB/s, and the read pass's GB/s measured in the same
 * run (the limit). Run by hand: build/tests/bench/bench_grad_norm. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>

#include "grad_norm.h"
#include "mempass.h"

/* Reads every byte once, four independent vectors so the loads, not a dependency, set the pace. */
__attribute__((target("avx2"))) static float read_pass(const float *x, uint64_t n) {
  __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
  for (uint64_t i = 0; i + 32 <= n; i += 32) {
    a = _mm256_or_ps(a, _mm256_loadu_ps(x + i));
    b = _mm256_or_ps(b, _mm256_loadu_ps(x + i + 8));
    c = _mm256_or_ps(c, _mm256_loadu_ps(x + i + 16));
    d = _mm256_or_ps(d, _mm256_loadu_ps(x + i + 24));
  }
  float out[8];
  _mm256_storeu_ps(out, _mm256_or_ps(_mm256_or_ps(a, b), _mm256_or_ps(c, d)));
  return out[0];
}

int main(void) {
  if (zd__isa_detect() < ZD__ISA_AVX2) {
    printf("no AVX2: nothing to measure\n");
    return 0;
  }
  zd__norm_fn norm = zd__torch_norm2_impl(zd__isa_detect());
  static const uint64_t sizes[] = {4096, 65536, 1 << 20, 16 << 20, 64 << 20};
  printf("%12s %12s %12s %12s %12s %12s\n", "elements", "t113_GB/s", "t26_GB/s", "t215_GB/s",
         "read_GB/s", "t215_us");
  volatile float sink = 0;
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    uint64_t n = sizes[s];
    size_t bytes = n * sizeof(float);
    float *x = zd_bench_alloc(bytes, -1);
    for (uint64_t i = 0; i < n; i++) x[i] = (float)(i % 1000) * 1e-3f;
    int reps = (int)(((uint64_t)1 << 28) / bytes) + 3;
    double gbs[4], us = 0;
    double *t = malloc(reps * sizeof *t);
    for (int k = 0; k < 4; k++) {
      for (int r = 0; r < reps; r++) {
        double t0 = zd_bench_now();
        sink += k < 3 ? norm(x, n, (zd__norm_order_t)k) : read_pass(x, n);
        t[r] = zd_bench_now() - t0;
      }
      double med = zd_bench_median(t, reps);
      gbs[k] = bytes / med / 1e9;
      if (k == 2) us = med * 1e6;
    }
    printf("%12llu %12.1f %12.1f %12.1f %12.1f %12.1f\n", (unsigned long long)n, gbs[0], gbs[1],
           gbs[2], gbs[3], us);
    free(t);
    zd_bench_free(x, bytes);
  }
  (void)sink;
  return 0;
}
