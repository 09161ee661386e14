/* bench_optim: one row per optimizer of the table (kernels/optim.h) per size: the step's
 * throughput next to a memory pass over the bytes that optimizer must move, in the same run.
 *
 * Per element an optimizer reads the grad and its state streams (master and the arrays its kernel
 * writes: zd__<k>_writes), writes the state streams back and writes the working parameter. The
 * pass moves exactly those bytes with the same vector width and no arithmetic, split over the
 * same pool as the daemon splits the update: for AdamW it is bench_adam's pass (mempass.h:
 * prefetching, streaming stores for the working params as adam_avx*.c); for the others, whose
 * wide paths are the compiler's vectorisation of their reference loop with ordinary stores, a pass
 * with ordinary stores. %pass is the kernel's speed as a percentage of its pass. The kernel is the
 * table's update (zd__optim_impl), as the CPU backend calls it, over two groups alternating every
 * 4096 elements, at a step past the first (SGD's buffer and Adagrad's sum are read). Kernel and
 * pass runs alternate; medians after warm-up. Values are random (memory may move zeros faster).
 *
 *   bench_optim [--min-log2 20] [--max-log2 24] [--threads N] [--isa auto|avx2|avx512|...]
 *               [--iters 11] [--warmup 2]
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "group.h"
#include "mempass.h"
#include "optim.h"
#include "pool.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;
static float rnd(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (float)((rng >> 40) & 0xffffff) / (float)0x800000 - 1.0f;
}

static volatile uint32_t key;

typedef struct pass {
  float *s[ZD__NSTATES]; /* the streams read and written back */
  int ns;
  const float *grad;
  float *param;
  zd__isa_t isa;
} pass_t;

__attribute__((target("avx512f"))) static void pass512(const pass_t *p, uint64_t lo, uint64_t hi) {
  __m512i k = _mm512_set1_epi32((int)key), acc = _mm512_setzero_si512();
  for (uint64_t i = lo; i < hi; i += 16) {
    __m512i g = _mm512_loadu_si512(p->grad + i);
    for (int j = 0; j < p->ns; j++) {
      __m512i x = _mm512_loadu_si512(p->s[j] + i);
      acc = _mm512_xor_si512(acc, x);
      _mm512_storeu_si512(p->s[j] + i, _mm512_xor_si512(x, k));
    }
    _mm512_storeu_si512(p->param + i, _mm512_xor_si512(acc, g));
  }
}

__attribute__((target("avx2"))) static void pass256(const pass_t *p, uint64_t lo, uint64_t hi) {
  __m256i k = _mm256_set1_epi32((int)key), acc = _mm256_setzero_si256();
  for (uint64_t i = lo; i < hi; i += 8) {
    __m256i g = _mm256_loadu_si256((const __m256i *)(p->grad + i));
    for (int j = 0; j < p->ns; j++) {
      __m256i x = _mm256_loadu_si256((const __m256i *)(p->s[j] + i));
      acc = _mm256_xor_si256(acc, x);
      _mm256_storeu_si256((__m256i *)(p->s[j] + i), _mm256_xor_si256(x, k));
    }
    _mm256_storeu_si256((__m256i *)(p->param + i), _mm256_xor_si256(acc, g));
  }
}

static void pass_chunk(void *arg, uint64_t lo, uint64_t hi, unsigned thread) {
  (void)thread;
  const pass_t *p = arg;
  if (p->isa >= ZD__ISA_AVX512)
    pass512(p, lo, hi);
  else
    pass256(p, lo, hi);
}

typedef struct run {
  const zd__adam_args_t *a;
  zd__adam_fn fn;
} run_t;

static void kernel_chunk(void *arg, uint64_t lo, uint64_t hi, unsigned thread) {
  (void)thread;
  const run_t *r = arg;
  r->fn(r->a, lo, hi);
}

/* One row per optimizer of the table (ZD__OPTIMIZERS), Adam's once (AdamW). */
#define NAME(opt, k)  #opt,
#define VALUE(opt, k) ZD_##opt,
static const char *const table_names[] = {ZD__OPTIMIZERS(NAME)};
static const int table_values[] = {ZD__OPTIMIZERS(VALUE)};
#undef NAME
#undef VALUE
#define NTABLE (int)(sizeof table_values / sizeof table_values[0])
static char names[NTABLE][16];
static int optimizers[NTABLE], noptimizers;

static void list_optimizers(void) {
  for (int i = 0; i < NTABLE; i++) {
    if (table_values[i] == ZD_ADAM) continue; /* AdamW's kernel */
    for (int j = 0; table_names[i][j] && j < 15; j++)
      names[noptimizers][j] = (char)(table_names[i][j] | 0x20); /* lower case */
    optimizers[noptimizers++] = table_values[i];
  }
}

static void row(zd__pool_t *pool, zd__isa_t isa, int which, uint64_t n, int iters, int warmup) {
  zd_group_t hp[2] = {zd__group_default(), zd__group_default()};
  for (int k = 0; k < 2; k++) {
    hp[k].optimizer = (zd_optimizer_t)optimizers[which];
    hp[k].weight_decay = k ? 0.0 : 0.01;
    hp[k].momentum = 0.9;
    hp[k].lr_decay = 1e-4;
    hp[k].centered = 1; /* RMSprop: centered with momentum, its most arrays */
    hp[k].eps = hp[k].optimizer == ZD_ADAGRAD ? 1e-10 : 1e-8;
  }
  zd__adam_group_t consts[2];
  for (int k = 0; k < 2; k++) zd__adam_group_init(&consts[k], &hp[k], 5);
  zd__states_t w = zd__optim_states(hp, 2);
  /* the streams the kernel reads and writes: master and what it writes (optim.h) */
  zd__states_t moved = ZD__STATE_BIT(ZD__STATE_MASTER);
  for (int k = 0; k < 2; k++) moved |= zd__optim_writes(&consts[k]);
  size_t bytes = n * sizeof(float);
  zd__adam_args_t a = {.grad_dtype = ZD_F32, .param_dtype = ZD_F32, .grad_scale = 1.0f};
  pass_t p = {.isa = isa};
  float *grad = zd_bench_alloc(bytes, -1), *param = zd_bench_alloc(bytes, -1);
  for (uint64_t i = 0; i < n; i++) grad[i] = rnd() * 0.01f;
  float *arrays[ZD__NSTATES] = {0}, *pass_arrays[ZD__NSTATES] = {0};
  for (int s = 0; s < ZD__NSTATES; s++) {
    if (!(w & ZD__STATE_BIT(s))) continue;
    arrays[s] = zd_bench_alloc(bytes, -1);
    for (uint64_t i = 0; i < n; i++) arrays[s][i] = s == ZD__STATE_MASTER ? rnd() : rnd() * rnd();
    if (s == ZD__STATE_EXP_AVG_SQ || s == ZD__STATE_SUM || s == ZD__STATE_SQUARE_AVG)
      for (uint64_t i = 0; i < n; i++) arrays[s][i] = arrays[s][i] * arrays[s][i] + 1e-4f;
    if (s == ZD__STATE_GRAD_AVG) /* centered: square_avg - grad_avg^2 stays > 0, as in training */
      for (uint64_t i = 0; i < n; i++) arrays[s][i] = rnd() * 0.001f;
    a.state[s] = arrays[s];
    if (moved & ZD__STATE_BIT(s)) {
      pass_arrays[s] = zd_bench_alloc(bytes, -1);
      memcpy(pass_arrays[s], arrays[s], bytes);
      p.s[p.ns++] = pass_arrays[s];
    }
  }
  float *pgrad = zd_bench_alloc(bytes, -1), *pparam = zd_bench_alloc(bytes, -1);
  memcpy(pgrad, grad, bytes);
  p.grad = pgrad;
  p.param = pparam;
  a.grad = grad;
  a.param = param;
  uint32_t nsegs = (uint32_t)((n + 4095) / 4096);
  zd__segment_t *segs = calloc(nsegs, sizeof *segs);
  for (uint32_t k = 0; k < nsegs; k++) {
    uint64_t off = (uint64_t)k * 4096;
    segs[k] =
        (zd__segment_t){.offset = off, .length = n - off < 4096 ? n - off : 4096, .group = k % 2};
  }
  a.segs = segs;
  a.nsegs = nsegs;
  a.groups = consts;
  /* Adam's pass is bench_adam's (its streams: master, exp_avg, exp_avg_sq, grad, param). */
  zd__adam_args_t adam_pass = a;
  if (optimizers[which] == ZD_ADAMW)
    for (int s = 0; s < ZD__NSTATES; s++) adam_pass.state[s] = pass_arrays[s];
  adam_pass.grad = pgrad;
  adam_pass.param = pparam;
  run_t r = {.a = &a, .fn = zd__optim_impl(isa)};
  double tk[64], tp[64];
  for (int it = 0; it < warmup + iters; it++) {
    zd_bench_settle();
    double t0 = zd_bench_now();
    zd__pool_for(pool, n, ZD__POOL_STREAM_GRAIN, ZD__POOL_STREAM_MIN_PER_THREAD, kernel_chunk, &r);
    double t1 = zd_bench_now();
    zd_bench_settle();
    double t2 = zd_bench_now(), t3;
    key = (uint32_t)it * 0x9e3779b9u;
    if (optimizers[which] == ZD_ADAMW) {
      t3 = t2 + zd_bench_mempass(pool, isa, &adam_pass, n);
    } else {
      zd__pool_for(pool, n, ZD__POOL_STREAM_GRAIN, ZD__POOL_STREAM_MIN_PER_THREAD, pass_chunk, &p);
      t3 = zd_bench_now();
    }
    if (it >= warmup) {
      tk[it - warmup] = t1 - t0;
      tp[it - warmup] = t3 - t2;
    }
  }
  double k_s = zd_bench_median(tk, iters), p_s = zd_bench_median(tp, iters);
  double moved_bytes = (double)n * (8.0 * __builtin_popcount(moved) + 4 + 4);
  printf("  %-8s %10llu %7s %7u %9.3f %9.2f %9.3f %9.2f %7.1f%%\n", names[which],
         (unsigned long long)n, zd__isa_name(isa), zd__pool_size(pool), k_s * 1e3,
         moved_bytes / k_s / 1e9, p_s * 1e3, moved_bytes / p_s / 1e9, 100.0 * p_s / k_s);
  fflush(stdout);
  for (int s = 0; s < ZD__NSTATES; s++) {
    if (arrays[s]) zd_bench_free(arrays[s], bytes);
    if (pass_arrays[s]) zd_bench_free(pass_arrays[s], bytes);
  }
  zd_bench_free(grad, bytes);
  zd_bench_free(param, bytes);
  zd_bench_free(pgrad, bytes);
  zd_bench_free(pparam, bytes);
  free(segs);
}

int main(int argc, char **argv) {
  int min_log2 = 20, max_log2 = 24, iters = 11, warmup = 2;
  unsigned nthreads = 0;
  const char *isa_name = "auto";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--min-log2"))
      min_log2 = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--max-log2"))
      max_log2 = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--threads"))
      nthreads = (unsigned)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--isa"))
      isa_name = argv[i + 1];
    else if (!strcmp(argv[i], "--iters"))
      iters = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--warmup"))
      warmup = atoi(argv[i + 1]);
    else {
      fprintf(stderr,
              "usage: bench_optim [--min-log2 20] [--max-log2 24] [--threads N] "
              "[--isa auto|avx2|avx512|avx512bf16] [--iters 11] [--warmup 2]\n");
      return 2;
    }
  }
  int isa = zd__isa_parse(isa_name);
  if (isa < ZD__ISA_AVX2 || isa > (int)zd__isa_detect() || iters < 1 || iters > 64 ||
      min_log2 < 12 || max_log2 > 30 || min_log2 > max_log2) {
    fprintf(stderr, "bench_optim: bad arguments, or ISA '%s' not a wide path this CPU runs\n",
            isa_name);
    return 2;
  }
  list_optimizers();
  zd__pool_t *pool;
  int rc = zd__pool_create(nthreads, 1, &pool);
  if (rc) return 1;
  printf(
      "# bench_optim: one row per optimizer (kernels/optim.h): step vs a memory pass over its "
      "bytes (f32 grad and working params); medians of %d after %d warm-up\n",
      iters, warmup);
  printf("# %-8s %10s %7s %7s %9s %9s %9s %9s %8s\n", "optim", "params", "isa", "threads",
         "step_ms", "step_GB/s", "pass_ms", "pass_GB/s", "%pass");
  for (int l = min_log2; l <= max_log2; l++)
    for (int which = 0; which < noptimizers; which++)
      row(pool, (zd__isa_t)isa, which, (uint64_t)1 << l, iters, warmup);
  zd__pool_destroy(pool);
  return 0;
}
