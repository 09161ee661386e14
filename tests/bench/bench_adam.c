/* bench_adam: throughput of the CPU optimizer step (kernels/adam.h) against the memory bus.
 *
 * The step is a streaming kernel: per element it reads master, exp_avg, exp_avg_sq and the grad
 * and writes master, exp_avg, exp_avg_sq and the working parameter, so its limit is the memory
 * bandwidth the cores can draw. Each row therefore also times a memory pass that moves the same
 * bytes over the same buffers, split the same way over the same pool, with the same vector width,
 * prefetching and kind of stores, but no arithmetic; the last column is the kernel's speed as a
 * percentage of that pass (100% = the bus is the only limit). Kernel and pass runs alternate so
 * both see the same machine state, and the table shows medians after warm-up, like nccl-tests'
 * algbw table.
 *
 *   bench_adam [--min-log2 20] [--max-log2 26] [--threads N] [--isa auto|scalar|avx2|avx512]
 *              [--iters 20] [--warmup 3] [--grad f32|bf16|f16] [--param f32|bf16|none]
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "adam.h"
#include "pool.h"

#define CHUNK 64 /* elements: tasks start on multiples of this (a cache line of every stream) */

typedef struct {
  zd__adam_args_t args;
  zd__adam_fn kernel;
  zd__isa_t isa;
  uint64_t n;
  int run_pass; /* this run: the memory pass instead of the kernel */
} bench_t;

/* Zero at run time, unknown to the compiler: the pass XORs it into every value it stores, so no
 * load or store can be optimized away (GCC drops the store of a vector just loaded from the same
 * address) and the buffers keep their values. */
static volatile uint32_t pass_key;

static size_t dtype_size(zd_dtype_t t) {
  return t == ZD_F32 ? 4 : 2;
}

static const char *dtype_name(int t) {
  return t == ZD_F32 ? "f32" : t == ZD_BF16 ? "bf16" : t == ZD_F16 ? "f16" : "none";
}

/* ---- the memory pass ----------------------------------------------------------------------- */

/* The kernel's prefetch (adam_avx512.c), SSE: every x86-64 has it. */
static inline void prefetch(const zd__adam_args_t *a, uint64_t i, size_t gsz) {
  uint64_t d = ZD__ADAM_PREFETCH;
  _mm_prefetch((const char *)((uintptr_t)(a->master + i) + d * 4), _MM_HINT_T0);
  _mm_prefetch((const char *)((uintptr_t)(a->exp_avg + i) + d * 4), _MM_HINT_T0);
  _mm_prefetch((const char *)((uintptr_t)(a->exp_avg_sq + i) + d * 4), _MM_HINT_T0);
  _mm_prefetch((const char *)((uintptr_t)a->grad + (i + d) * gsz), _MM_HINT_T0);
}

/* Elements [lo, hi) (multiples of 16): p, m, v, g loaded, p, m, v stored back and the working
 * params stored from p, 64 bytes per f32 stream and 32 per 16-bit stream at a time, exactly the
 * kernel's accesses. Like the kernel, it prefetches ZD__ADAM_PREFETCH elements ahead and streams
 * the working params when the call is large enough (ZD__ADAM_NT_MIN); tasks start on 64-element
 * boundaries of 2 MiB-aligned buffers, so the streaming stores are aligned. Both made the pass
 * faster on the machine this was tuned on; streaming the in-place streams too, unrolling, other
 * prefetch distances, and one stream at a time over tiles of 64..4096 elements were slower. */
__attribute__((target("avx512f"))) static void pass_avx512(const bench_t *b, uint64_t lo,
                                                           uint64_t hi) {
  const zd__adam_args_t *a = &b->args;
  __m512i key = _mm512_set1_epi32((int)pass_key);
  size_t gsz = dtype_size(a->grad_dtype), psz = dtype_size(a->param_dtype);
  int nt = a->param && hi - lo >= ZD__ADAM_NT_MIN;
  for (uint64_t i = lo; i < hi; i += 16) {
    prefetch(a, i, gsz);
    __m512i p = _mm512_loadu_si512(a->master + i);
    __m512i m = _mm512_loadu_si512(a->exp_avg + i);
    __m512i v = _mm512_loadu_si512(a->exp_avg_sq + i);
    const char *g = (const char *)a->grad + i * gsz;
    __m512i x = gsz == 4 ? _mm512_loadu_si512(g)
                         : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)g));
    p = _mm512_xor_si512(p, key);
    m = _mm512_xor_si512(m, _mm512_and_si512(x, key));
    v = _mm512_xor_si512(v, key);
    _mm512_storeu_si512(a->master + i, p);
    _mm512_storeu_si512(a->exp_avg + i, m);
    _mm512_storeu_si512(a->exp_avg_sq + i, v);
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

__attribute__((target("avx2"))) static void pass_avx2(const bench_t *b, uint64_t lo, uint64_t hi) {
  const zd__adam_args_t *a = &b->args;
  __m256i key = _mm256_set1_epi32((int)pass_key);
  size_t gsz = dtype_size(a->grad_dtype), psz = dtype_size(a->param_dtype);
  int nt = a->param && hi - lo >= ZD__ADAM_NT_MIN;
  for (uint64_t i = lo; i < hi; i += 8) {
    prefetch(a, i, gsz);
    __m256i p = _mm256_loadu_si256((const __m256i *)(a->master + i));
    __m256i m = _mm256_loadu_si256((const __m256i *)(a->exp_avg + i));
    __m256i v = _mm256_loadu_si256((const __m256i *)(a->exp_avg_sq + i));
    const char *g = (const char *)a->grad + i * gsz;
    __m256i x = gsz == 4 ? _mm256_loadu_si256((const __m256i *)g)
                         : _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)g));
    p = _mm256_xor_si256(p, key);
    m = _mm256_xor_si256(m, _mm256_and_si256(x, key));
    v = _mm256_xor_si256(v, key);
    _mm256_storeu_si256((__m256i *)(a->master + i), p);
    _mm256_storeu_si256((__m256i *)(a->exp_avg + i), m);
    _mm256_storeu_si256((__m256i *)(a->exp_avg_sq + i), v);
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
static void pass_plain(const bench_t *b, uint64_t lo, uint64_t hi) {
  const zd__adam_args_t *a = &b->args;
  uint32_t key = pass_key;
  uint32_t *p = (uint32_t *)a->master, *m = (uint32_t *)a->exp_avg, *v = (uint32_t *)a->exp_avg_sq;
  for (uint64_t i = lo; i < hi; i++) {
    uint32_t x =
        a->grad_dtype == ZD_F32 ? ((const uint32_t *)a->grad)[i] : ((const uint16_t *)a->grad)[i];
    uint32_t pi = p[i] ^ key;
    p[i] = pi;
    m[i] ^= x & key;
    v[i] ^= key;
    if (a->param && a->param_dtype == ZD_F32) ((uint32_t *)a->param)[i] = pi;
    if (a->param && a->param_dtype == ZD_BF16) ((uint16_t *)a->param)[i] = (uint16_t)pi;
  }
}

/* ---- runs ---------------------------------------------------------------------------------- */

static void task(void *arg, unsigned t, unsigned ntasks) {
  const bench_t *b = arg;
  uint64_t per = (b->n / CHUNK + ntasks - 1) / ntasks * CHUNK;
  uint64_t lo = t * per, hi = lo + per < b->n ? lo + per : b->n;
  if (lo >= hi) return;
  if (!b->run_pass)
    b->kernel(&b->args, lo, hi);
  else if (b->isa == ZD__ISA_AVX512)
    pass_avx512(b, lo, hi);
  else if (b->isa == ZD__ISA_AVX2)
    pass_avx2(b, lo, hi);
  else
    pass_plain(b, lo, hi);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double timed_run(zd__pool_t *pool, bench_t *b, int run_pass) {
  b->run_pass = run_pass;
  double t0 = now_s();
  zd__pool_run(pool, zd__pool_size(pool), task, b);
  return now_s() - t0;
}

static int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}

static double median(double *t, int n) {
  qsort(t, (size_t)n, sizeof *t, cmp_double);
  return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

/* Large shard buffers on 2 MiB boundaries with transparent huge pages asked for, as the daemon
 * maps its shards: TLB misses are not what is being measured. */
static void *alloc_buf(size_t bytes) {
  size_t align = 2u << 20;
  bytes = (bytes + align - 1) / align * align;
  void *p = aligned_alloc(align, bytes);
  if (!p) {
    fprintf(stderr, "bench_adam: cannot allocate %zu bytes\n", bytes);
    exit(1);
  }
  madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

static uint64_t rng = 0x2545f4914f6cdd1dull;
static float rnd_unit(void) { /* xorshift64, uniform in [-1, 1) */
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (float)((double)(rng >> 40) / (double)(1 << 23) - 1.0);
}

/* Segments of a model-like shard: weight matrices of about a million elements alternating with
 * small bias/norm vectors (no weight decay), odd lengths so that segment boundaries fall anywhere,
 * covering the whole range (so every element's bytes are moved). */
static uint32_t make_segments(zd__segment_t *segs, uint64_t n) {
  uint32_t ns = 0;
  for (uint64_t pos = 0; pos < n;) {
    uint64_t len = ns % 2 == 0 ? (1u << 20) + 4099 * (ns % 7) + 13 : 1024 + 3 * ns;
    if (len > n - pos) len = n - pos;
    segs[ns] = (zd__segment_t){.offset = pos, .length = len, .group = ns % 2};
    pos += len;
    ns++;
  }
  return ns;
}

static void usage(void) {
  fprintf(stderr,
          "usage: bench_adam [--min-log2 N] [--max-log2 N] [--threads N] [--isa NAME]\n"
          "                  [--iters N] [--warmup N] [--grad f32|bf16|f16] "
          "[--param f32|bf16|none]\n");
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
  int min_log2 = 20, max_log2 = 26, iters = 20, warmup = 3;
  unsigned nthreads = 0;
  const char *isa_name = "auto";
  int gdt = ZD_F32, pdt = ZD_F32;
  for (int i = 1; i < argc; i++) {
    const char *opt = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
    if (!val) usage();
    if (!strcmp(opt, "--min-log2"))
      min_log2 = atoi(val);
    else if (!strcmp(opt, "--max-log2"))
      max_log2 = atoi(val);
    else if (!strcmp(opt, "--threads"))
      nthreads = (unsigned)atoi(val);
    else if (!strcmp(opt, "--isa"))
      isa_name = val;
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
  if (min_log2 < 6 || max_log2 > 34 || min_log2 > max_log2 || iters < 1 || warmup < 0) usage();
  int isa = zd__isa_parse(isa_name);
  if (isa < 0 || isa > (int)zd__isa_detect()) {
    fprintf(stderr, "bench_adam: ISA '%s' unknown or not supported by this CPU (best: %s)\n",
            isa_name, zd__isa_name(zd__isa_detect()));
    return 2;
  }
  zd__pool_t *pool;
  int rc = zd__pool_create(nthreads, &pool);
  if (rc) {
    fprintf(stderr, "bench_adam: zd__pool_create: %s\n", strerror(-rc));
    return 1;
  }

  /* Buffers for the largest size; smaller rows use their prefix. */
  uint64_t nmax = 1ull << max_log2;
  size_t gsz = dtype_size(gdt), psz = pdt ? dtype_size(pdt) : 0;
  float *master = alloc_buf(nmax * 4), *m = alloc_buf(nmax * 4), *v = alloc_buf(nmax * 4);
  void *grad = alloc_buf(nmax * gsz), *param = pdt ? alloc_buf(nmax * psz) : NULL;
  for (uint64_t i = 0; i < nmax; i++) {
    float g = rnd_unit() * 1e-2f;
    master[i] = rnd_unit();
    m[i] = v[i] = 0;
    if (gdt == ZD_F32) ((float *)grad)[i] = g;
    if (gdt == ZD_BF16) ((uint16_t *)grad)[i] = zd__f32_to_bf16(g);
    /* f16: a random value of about the same size (sign, exponent 2^-10..2^-6, mantissa). */
    if (gdt == ZD_F16) ((uint16_t *)grad)[i] = (uint16_t)((rng & 0x83ff) | ((5 + rng % 5) << 10));
  }
  if (param) memset(param, 0, nmax * psz);
  zd__segment_t *segs = calloc(nmax / 1024 + 2, sizeof *segs);
  if (!segs) return 1;
  /* torch.optim.AdamW's defaults; the small vectors without weight decay. */
  zd_group_t hp[2] = {
      {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 1e-2},
      {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0},
  };
  zd__adam_group_t groups[2];
  /* Bytes per element: read master, m, v, grad; write master, m, v, working param. */
  double elem_bytes = 4 * 6 + (double)gsz + (double)psz;

  printf("# bench_adam: AdamW step over an fp32 master shard, grad %s, working params %s\n",
         dtype_name(gdt), dtype_name(pdt));
  printf(
      "# %.0f bytes moved per param; pass: the same loads and stores, no arithmetic; "
      "medians of %d runs after %d warm-up\n",
      elem_bytes, iters, warmup);
  printf("#\n");
  printf("# %10s %7s %7s %10s %9s %8s %10s %10s %8s\n", "params", "isa", "threads", "step_ms",
         "Gparam/s", "GB/s", "pass_ms", "pass_GB/s", "%pass");
  double *tk = calloc((size_t)iters, sizeof(double)), *tp = calloc((size_t)iters, sizeof(double));
  if (!tk || !tp) return 1;
  uint64_t step = 0;
  for (int lg = min_log2; lg <= max_log2; lg++) {
    uint64_t n = 1ull << lg;
    bench_t b = {
        .args = {.master = master,
                 .exp_avg = m,
                 .exp_avg_sq = v,
                 .grad = grad,
                 .grad_dtype = (zd_dtype_t)gdt,
                 .param = param,
                 .param_dtype = pdt ? (zd_dtype_t)pdt : ZD_F32,
                 .grad_scale = 1.0f,
                 .segs = segs,
                 .nsegs = make_segments(segs, n),
                 .groups = groups},
        .kernel = zd__adam_impl((zd__isa_t)isa),
        .isa = (zd__isa_t)isa,
        .n = n,
    };
    for (int it = 0; it < warmup + iters; it++) {
      step++;
      for (int k = 0; k < 2; k++) zd__adam_group_init(&groups[k], &hp[k], step);
      /* Alternate which goes first, so neither always finds the caches the other left. */
      double kt, pt;
      if (it % 2) {
        kt = timed_run(pool, &b, 0);
        pt = timed_run(pool, &b, 1);
      } else {
        pt = timed_run(pool, &b, 1);
        kt = timed_run(pool, &b, 0);
      }
      if (it >= warmup) {
        tk[it - warmup] = kt;
        tp[it - warmup] = pt;
      }
    }
    double k_s = median(tk, iters), p_s = median(tp, iters);
    double bytes = elem_bytes * (double)n;
    printf("  %10llu %7s %7u %10.3f %9.3f %8.2f %10.3f %10.2f %7.1f%%\n", (unsigned long long)n,
           zd__isa_name((zd__isa_t)isa), zd__pool_size(pool), k_s * 1e3, (double)n / k_s * 1e-9,
           bytes / k_s * 1e-9, p_s * 1e3, bytes / p_s * 1e-9, 100.0 * p_s / k_s);
    fflush(stdout);
  }
  free(tk);
  free(tp);
  free(segs);
  free(master);
  free(m);
  free(v);
  free(grad);
  free(param);
  zd__pool_destroy(pool);
  return 0;
}
