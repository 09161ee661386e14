/* The memory pass of the benchmarks: the loads and stores of the AdamW kernel (kernels/adam.h)
 * with no arithmetic, so that a benchmark can print the kernel's speed next to the limit the
 * memory bus sets, measured in the same run. Used by bench_adam (the kernel alone) and bench_step
 * (a whole step through zerod). The pass runs over padded buffers of its own (zd_bench_alloc), so
 * that its number is the bus's limit and not that of some placement: a step over arrays that
 * collide shows as a step below its pass. */
#include "mempass.h"

#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

static size_t dtype_size(zd_dtype_t t) {
  return t == ZD_F32 ? 4 : 2;
}

/* Zero at run time, unknown to the compiler: the pass XORs it into every value it stores, so no
 * load or store can be optimized away (GCC drops the store of a vector just loaded from the same
 * address) and the buffers keep their values. */
static volatile uint32_t pass_key;

/* The kernel's prefetch (adam_avx512.c), SSE: every x86-64 has it. */
static inline void prefetch(const zd__adam_args_t *a, uint64_t i, size_t gsz) {
  uint64_t d = ZD__ADAM_PREFETCH;
  _mm_prefetch((const char *)((uintptr_t)(a->state[ZD__STATE_MASTER] + i) + d * 4), _MM_HINT_T0);
  _mm_prefetch((const char *)((uintptr_t)(a->state[ZD__STATE_EXP_AVG] + i) + d * 4), _MM_HINT_T0);
  _mm_prefetch((const char *)((uintptr_t)(a->state[ZD__STATE_EXP_AVG_SQ] + i) + d * 4),
               _MM_HINT_T0);
  if (a->state[ZD__STATE_MAX_EXP_AVG_SQ])
    _mm_prefetch((const char *)((uintptr_t)(a->state[ZD__STATE_MAX_EXP_AVG_SQ] + i) + d * 4),
                 _MM_HINT_T0);
  _mm_prefetch((const char *)((uintptr_t)a->grad + (i + d) * gsz), _MM_HINT_T0);
}

/* Elements [lo, hi) (multiples of 16): p, m, v, g loaded, p, m, v stored back and the working
 * params stored from p, 64 bytes per f32 stream and 32 per 16-bit stream at a time, exactly the
 * kernel's accesses. Like the kernel, it prefetches ZD__ADAM_PREFETCH elements ahead and streams
 * the working params when the call is large enough (ZD__ADAM_NT_MIN); chunks start on
 * ZD__POOL_STREAM_GRAIN boundaries of page-aligned buffers, so the streaming stores are aligned.
 * Both made the pass faster on the machine this was tuned on; streaming the in-place streams too,
 * unrolling, other prefetch distances, and one stream at a time over tiles of 64..4096 elements
 * were slower. */
__attribute__((target("avx512f"))) static void pass_avx512(const zd__adam_args_t *a, uint64_t lo,
                                                           uint64_t hi) {
  __m512i key = _mm512_set1_epi32((int)pass_key);
  size_t gsz = dtype_size(a->grad_dtype), psz = dtype_size(a->param_dtype);
  int nt = a->param && hi - lo >= ZD__ADAM_NT_MIN;
  for (uint64_t i = lo; i < hi; i += 16) {
    prefetch(a, i, gsz);
    __m512i p = _mm512_loadu_si512(a->state[ZD__STATE_MASTER] + i);
    __m512i m = _mm512_loadu_si512(a->state[ZD__STATE_EXP_AVG] + i);
    __m512i v = _mm512_loadu_si512(a->state[ZD__STATE_EXP_AVG_SQ] + i);
    const char *g = (const char *)a->grad + i * gsz;
    __m512i x = gsz == 4 ? _mm512_loadu_si512(g)
                         : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)g));
    p = _mm512_xor_si512(p, key);
    m = _mm512_xor_si512(m, _mm512_and_si512(x, key));
    v = _mm512_xor_si512(v, key);
    _mm512_storeu_si512(a->state[ZD__STATE_MASTER] + i, p);
    _mm512_storeu_si512(a->state[ZD__STATE_EXP_AVG] + i, m);
    _mm512_storeu_si512(a->state[ZD__STATE_EXP_AVG_SQ] + i, v);
    if (a->state[ZD__STATE_MAX_EXP_AVG_SQ]) /* amsgrad's fifth stream */
      _mm512_storeu_si512(
          a->state[ZD__STATE_MAX_EXP_AVG_SQ] + i,
          _mm512_xor_si512(_mm512_loadu_si512(a->state[ZD__STATE_MAX_EXP_AVG_SQ] + i), key));
    if (!a->param) continue;
    char *out = (char *)a->param + i * psz;
    if (psz == 4 && nt)
      _mm512_stream_si512((__m512i *)out, p);
    else if (psz == 4)
      _mm512_storeu_si512(out, p);
    else if (nt)
      _mm256_stream_si256((__m256i *)out, _mm512_castsi512_si256(p));
    else
      _mm256_storeu_si256((__m256i *)out, _mm512_castsi512_si256(p));
  }
  if (nt) _mm_sfence();
}

__attribute__((target("avx2"))) static void pass_avx2(const zd__adam_args_t *a, uint64_t lo,
                                                      uint64_t hi) {
  __m256i key = _mm256_set1_epi32((int)pass_key);
  size_t gsz = dtype_size(a->grad_dtype), psz = dtype_size(a->param_dtype);
  int nt = a->param && hi - lo >= ZD__ADAM_NT_MIN;
  for (uint64_t i = lo; i < hi; i += 8) {
    prefetch(a, i, gsz);
    __m256i p = _mm256_loadu_si256((const __m256i *)(a->state[ZD__STATE_MASTER] + i));
    __m256i m = _mm256_loadu_si256((const __m256i *)(a->state[ZD__STATE_EXP_AVG] + i));
    __m256i v = _mm256_loadu_si256((const __m256i *)(a->state[ZD__STATE_EXP_AVG_SQ] + i));
    const char *g = (const char *)a->grad + i * gsz;
    __m256i x = gsz == 4 ? _mm256_loadu_si256((const __m256i *)g)
                         : _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)g));
    p = _mm256_xor_si256(p, key);
    m = _mm256_xor_si256(m, _mm256_and_si256(x, key));
    v = _mm256_xor_si256(v, key);
    _mm256_storeu_si256((__m256i *)(a->state[ZD__STATE_MASTER] + i), p);
    _mm256_storeu_si256((__m256i *)(a->state[ZD__STATE_EXP_AVG] + i), m);
    _mm256_storeu_si256((__m256i *)(a->state[ZD__STATE_EXP_AVG_SQ] + i), v);
    if (a->state[ZD__STATE_MAX_EXP_AVG_SQ]) { /* amsgrad's fifth stream */
      __m256i *q = (__m256i *)(a->state[ZD__STATE_MAX_EXP_AVG_SQ] + i);
      _mm256_storeu_si256(q, _mm256_xor_si256(_mm256_loadu_si256(q), key));
    }
    if (!a->param) continue;
    char *out = (char *)a->param + i * psz;
    if (psz == 4 && nt)
      _mm256_stream_si256((__m256i *)out, p);
    else if (psz == 4)
      _mm256_storeu_si256((__m256i *)out, p);
    else if (nt)
      _mm_stream_si128((__m128i *)out, _mm256_castsi256_si128(p));
    else
      _mm_storeu_si128((__m128i *)out, _mm256_castsi256_si128(p));
  }
  if (nt) _mm_sfence();
}

/* The scalar kernel's pass: plain C with ordinary stores (the reference streams nothing), which
 * the compiler vectorizes to SSE2 as it can. */
static void pass_plain(const zd__adam_args_t *a, uint64_t lo, uint64_t hi) {
  uint32_t key = pass_key;
  uint32_t *p = (uint32_t *)a->state[ZD__STATE_MASTER],
           *m = (uint32_t *)a->state[ZD__STATE_EXP_AVG],
           *v = (uint32_t *)a->state[ZD__STATE_EXP_AVG_SQ];
  for (uint64_t i = lo; i < hi; i++) {
    uint32_t x =
        a->grad_dtype == ZD_F32 ? ((const uint32_t *)a->grad)[i] : ((const uint16_t *)a->grad)[i];
    uint32_t pi = p[i] ^ key;
    p[i] = pi;
    m[i] ^= x & key;
    v[i] ^= key;
    if (a->state[ZD__STATE_MAX_EXP_AVG_SQ])
      ((uint32_t *)a->state[ZD__STATE_MAX_EXP_AVG_SQ])[i] ^= key;
    if (a->param && a->param_dtype == ZD_F32) ((uint32_t *)a->param)[i] = pi;
    if (a->param && a->param_dtype == ZD_BF16) ((uint16_t *)a->param)[i] = (uint16_t)pi;
  }
}

typedef struct pass_run {
  const zd__adam_args_t *args;
  zd__isa_t isa;
} pass_run_t;

static void pass_chunk(void *arg, uint64_t lo, uint64_t hi, unsigned thread) {
  (void)thread;
  const pass_run_t *r = arg;
  if (r->isa >= ZD__ISA_AVX512)
    pass_avx512(r->args, lo, hi);
  else if (r->isa == ZD__ISA_AVX2)
    pass_avx2(r->args, lo, hi);
  else
    pass_plain(r->args, lo, hi);
}

double zd_bench_mempass(zd__pool_t *pool, zd__isa_t isa, const zd__adam_args_t *args, uint64_t n) {
  pass_run_t r = {.args = args, .isa = isa};
  double t0 = zd_bench_now();
  zd__pool_for(pool, n, ZD__POOL_STREAM_GRAIN, ZD__POOL_STREAM_MIN_PER_THREAD, pass_chunk, &r);
  return zd_bench_now() - t0;
}

void zd_bench_settle(void) {
  double until = zd_bench_now() + 200e-6; /* well past the pool's spin (pool.c) */
  while (zd_bench_now() < until) continue;
}

double zd_bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}

double zd_bench_median(double *t, int n) {
  qsort(t, (size_t)n, sizeof *t, cmp_double);
  return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

double zd_bench_percentile(double *t, int n, double q) {
  qsort(t, (size_t)n, sizeof *t, cmp_double);
  int i = (int)(q * (n - 1) + 0.5);
  return t[i < 0 ? 0 : i >= n ? n - 1 : i];
}

void *zd_bench_alloc(size_t bytes, int fd) {
  static unsigned count;
  size_t align = 2u << 20, page = 4096;
  size_t pad = align + (count * (page + (320u << 10))) % align;
  count++;
  bytes = (bytes + page - 1) / page * page;
  char *res = mmap(NULL, bytes + pad + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (res == MAP_FAILED) goto fail;
  char *at = (char *)(((uintptr_t)res + align - 1) & ~(uintptr_t)(align - 1)) + pad;
  void *p = fd < 0 ? mmap(at, bytes, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0)
                   : mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  if (p == MAP_FAILED) goto fail;
  munmap(res, (size_t)(at - res));
  munmap(at + bytes, (size_t)(res + bytes + pad + align - (at + bytes)));
  madvise(p, bytes, MADV_HUGEPAGE);
  return p;
fail:
  fprintf(stderr, "benchmark: cannot map %zu bytes\n", bytes);
  exit(1);
}

void zd_bench_free(void *p, size_t bytes) {
  if (p) munmap(p, bytes);
}
