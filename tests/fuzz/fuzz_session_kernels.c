/* The wide kernel paths, absent from fuzz_session's build: clang 14 refuses kernels/adam.c's
 * __builtin_cpu_supports("f16c"), so the harness compiles adam.c with every CPU feature reported
 * absent (tests/fuzz/meson.build), and zerod there runs its scalar reference kernels, never these.
 * Leaving out adam_avx2.c, grad_norm_avx2.c and adam_avx512.c (both builds) also spares the fuzz
 * build their sanitized compile (clang takes over a quarter of an hour on adam_avx512.c). */
#include "adam.h"
#include "fuzz.h"
#include "grad_norm.h"

void zd__adam_step_avx2(const zd__adam_args_t *a, uint64_t begin, uint64_t end) {
  (void)a, (void)begin, (void)end;
  FUZZ_CHECK(0, "zd__adam_step_avx2 called in a build that reports no AVX2");
}

void zd__adam_step_avx512(const zd__adam_args_t *a, uint64_t begin, uint64_t end) {
  (void)a, (void)begin, (void)end;
  FUZZ_CHECK(0, "zd__adam_step_avx512 called in a build that reports no AVX-512");
}

void zd__adam_step_avx512bf16(const zd__adam_args_t *a, uint64_t begin, uint64_t end) {
  (void)a, (void)begin, (void)end;
  FUZZ_CHECK(0, "zd__adam_step_avx512bf16 called in a build that reports no AVX-512");
}

void zd__grad_stats_avx2(const void *grad, zd_dtype_t dtype, const zd__segment_t *segs,
                         uint32_t nsegs, uint64_t n, uint64_t block_begin, uint64_t block_end,
                         double *sums, uint64_t *nonfinite) {
  (void)grad, (void)dtype, (void)segs, (void)nsegs, (void)n, (void)block_begin, (void)block_end;
  (void)sums, (void)nonfinite;
  FUZZ_CHECK(0, "zd__grad_stats_avx2 called in a build that reports no AVX2");
}

void zd__grad_stats_avx512(const void *grad, zd_dtype_t dtype, const zd__segment_t *segs,
                           uint32_t nsegs, uint64_t n, uint64_t block_begin, uint64_t block_end,
                           double *sums, uint64_t *nonfinite) {
  (void)grad, (void)dtype, (void)segs, (void)nsegs, (void)n, (void)block_begin, (void)block_end;
  (void)sums, (void)nonfinite;
  FUZZ_CHECK(0, "zd__grad_stats_avx512 called in a build that reports no AVX-512");
}

float zd__torch_norm2_avx2(const float *x, uint64_t n, zd__norm_order_t order) {
  (void)x, (void)n, (void)order;
  FUZZ_CHECK(0, "zd__torch_norm2_avx2 called in a build that reports no AVX2");
  return 0;
}

float zd__torch_norm2_part_avx2(zd__norm_state_t *st, const float *x, uint64_t n, uint64_t offset,
                                uint64_t count, float scale, zd__norm_order_t order) {
  (void)st, (void)x, (void)n, (void)offset, (void)count, (void)scale, (void)order;
  FUZZ_CHECK(0, "zd__torch_norm2_part_avx2 called in a build that reports no AVX2");
  return 0;
}
