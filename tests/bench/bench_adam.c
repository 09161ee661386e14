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
 *              [--update torch113|torch2] [--sqrt exact|mkl_ex]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adam.h"
#include "mempass.h"
#include "pool.h"

typedef struct {
  zd__adam_args_t args;
  zd__adam_fn kernel;
  zd__isa_t isa;
  uint64_t n;
} bench_t;

static size_t dtype_size(zd_dtype_t t) {
  return t == ZD_F32 ? 4 : 2;
}

static const char *dtype_name(int t) {
  return t == ZD_F32 ? "f32" : t == ZD_BF16 ? "bf16" : t == ZD_F16 ? "f16" : "none";
}

/* ---- runs ---------------------------------------------------------------------------------- */

static void task(void *arg, unsigned t, unsigned ntasks) {
  const bench_t *b = arg;
  uint64_t lo, hi;
  zd_bench_split(b->n, t, ntasks, &lo, &hi);
  if (lo < hi) b->kernel(&b->args, lo, hi);
}

static double timed_run(zd__pool_t *pool, bench_t *b, int run_pass) {
  if (run_pass) return zd_bench_mempass(pool, b->isa, &b->args, b->n);
  double t0 = zd_bench_now();
  zd__pool_run(pool, zd__pool_size(pool), task, b);
  return zd_bench_now() - t0;
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
          "[--param f32|bf16|none]\n"
          "                  [--update torch113|torch2] [--sqrt exact|mkl_ex]\n");
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
  zd_update_t update = ZD_UPDATE_TORCH113;
  zd_sqrt_mode_t sqrt_mode = ZD_SQRT_EXACT;
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
    else if (!strcmp(opt, "--update") && (!strcmp(val, "torch113") || !strcmp(val, "torch2")))
      update = !strcmp(val, "torch2") ? ZD_UPDATE_TORCH2 : ZD_UPDATE_TORCH113;
    else if (!strcmp(opt, "--sqrt") && (!strcmp(val, "exact") || !strcmp(val, "mkl_ex")))
      sqrt_mode = !strcmp(val, "mkl_ex") ? ZD_SQRT_MKL_EX : ZD_SQRT_EXACT;
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
  float *master = zd_bench_alloc(nmax * 4), *m = zd_bench_alloc(nmax * 4),
        *v = zd_bench_alloc(nmax * 4);
  void *grad = zd_bench_alloc(nmax * gsz), *param = pdt ? zd_bench_alloc(nmax * psz) : NULL;
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
  for (int k = 0; k < 2; k++) hp[k].update = update, hp[k].sqrt_mode = sqrt_mode;
  zd__adam_group_t groups[2];
  /* Bytes per element: read master, m, v, grad; write master, m, v, working param. */
  double elem_bytes = 4 * 6 + (double)gsz + (double)psz;

  printf(
      "# bench_adam: AdamW step over an fp32 master shard, grad %s, working params %s, update %s, "
      "sqrt %s\n",
      dtype_name(gdt), dtype_name(pdt), update == ZD_UPDATE_TORCH2 ? "torch2" : "torch113",
      sqrt_mode == ZD_SQRT_MKL_EX ? "mkl_ex" : "exact");
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
    double k_s = zd_bench_median(tk, iters), p_s = zd_bench_median(tp, iters);
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
