/* bench_adam: throughput of the CPU optimizer step (kernels/adam.h) against the memory bus.
 *
 * The step is a streaming kernel: per element it reads master, exp_avg, exp_avg_sq and the grad
 * and writes master, exp_avg, exp_avg_sq and the working parameter, so its limit is the memory
 * bandwidth the cores can draw. Each row therefore also times a memory pass that moves the same
 * bytes, split the same way over the same pool, with the same vector width, prefetching and kind
 * of stores, but no arithmetic, over padded buffers of its own (mempass.h) holding the same values
 * (random, like a model's in training: memory may move zeros faster than other data); the %pass
 * column is the kernel's speed as a percentage of that pass (100% = the bus is the only limit).
 *
 * The kernel runs on arrays placed as zerod places them: the state arrays come from the CPU
 * backend's own allocator, one fresh set per row, and the grad and param buffers are memfds (as a
 * client's are) mapped at their colours (common/placement.h), so a placement that makes the
 * streams collide shows here as a kernel below its pass. --placement plain maps everything with
 * plain back-to-back mmap calls instead, as zerod did before it placed its arrays. Sizes are
 * powers of two and, next to each, the power of two plus --odd elements (0: none).
 *
 * The second table (--gpt2) steps a GPT-2 small layout (148 tensors, 124M parameters) two ways:
 * zerod's way, one pass of the segmented kernel over each bucket of the flat shard, and a
 * per-tensor loop like the optimizers that step each parameter tensor with its own kernel call
 * (each tensor's arrays allocated on their own, each call split over all threads).
 *
 * Kernel and pass runs alternate so both see the same machine state, each after the pool's threads
 * have gone to sleep (as at the start of a step: zd_bench_settle); medians after warm-up.
 *
 *   bench_adam [--min-log2 16] [--max-log2 25] [--odd 123456] [--threads N]
 *              [--isa auto|scalar|avx2|avx512|avx512bf16] [--iters 15] [--warmup 3]
 *              [--grad f32|bf16|f16] [--param f32|bf16|none] [--placement zerod|plain]
 *              [--gpt2 0|1|only] [--update torch113|torch2] [--sqrt exact|mkl_ex]
 *              [--amsgrad]
 *
 * --update and --sqrt pick the formula of every group (zd_group_t.update, .sqrt_mode). --amsgrad
 * turns amsgrad on in every group (first table only, with --gpt2 0): one more state array,
 * max_exp_avg_sq, which its pass moves too.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "adam.h"
#include "compute.h"
#include "layout.h"
#include "mempass.h"
#include "placement.h"
#include "pool.h"

typedef struct {
  zd__pool_t *pool;
  zd__compute_t *cpu; /* zerod's CPU backend: its allocator */
  zd__isa_t isa;
  zd__adam_fn kernel;
  int gdt, pdt; /* pdt 0: no working params */
  int plain;    /* --placement plain */
  int amsgrad;  /* --amsgrad: max_exp_avg_sq, one more stream */
  int iters, warmup;
} cfg_t;

static size_t dtype_size(int t) {
  return t == ZD_F32 ? 4 : t ? 2 : 0;
}

static const char *dtype_name(int t) {
  return t == ZD_F32 ? "f32" : t == ZD_BF16 ? "bf16" : t == ZD_F16 ? "f16" : "none";
}

static void die(const char *what, int rc) {
  fprintf(stderr, "bench_adam: %s: %s\n", what, strerror(rc < 0 ? -rc : rc));
  exit(1);
}

/* ---- buffers ------------------------------------------------------------------------------- */

/* The five streams of a step over n elements, and how to give them back. */
typedef struct {
  float *master, *m, *v, *x; /* x: max_exp_avg_sq with --amsgrad, else NULL */
  void *grad, *param;
  uint64_t n;
  int kind; /* 0: zerod's placement, 1: plain mmap, 2: padded (the pass) */
} streams_t;

static int memfd_of(size_t bytes) {
  int fd = memfd_create("bench_adam", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) die("memfd", errno);
  return fd;
}

/* A shared buffer like a client's: a memfd, mapped at `colour` (kind 0), plainly (1) or padded
 * (2). The mapping keeps the memory; the descriptor is closed. */
static void *shared_buffer(size_t bytes, int kind, unsigned colour) {
  if (!bytes) return NULL;
  int fd = memfd_of(bytes);
  void *p;
  if (kind == 0) {
    int rc = zd__place_fd(fd, bytes, colour, &p);
    if (rc) die("zd__place_fd", rc);
  } else if (kind == 1) {
    p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) die("mmap", errno);
  } else {
    p = zd_bench_alloc(bytes, fd);
  }
  close(fd);
  return p;
}

static float *state_array(const cfg_t *c, uint64_t n, int kind) {
  size_t bytes = n * 4;
  if (kind == 0) {
    float *p;
    zd__err_t err;
    if (c->cpu->ops->alloc(c->cpu, n, &p, &err)) {
      fprintf(stderr, "bench_adam: %s\n", err.msg);
      exit(1);
    }
    return p;
  }
  if (kind == 2) return zd_bench_alloc(bytes, -1);
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) die("mmap", errno);
  madvise(p, bytes, MADV_HUGEPAGE); /* what zerod did before it placed its arrays */
  return p;
}

static uint64_t rng = 0x2545f4914f6cdd1dull;
static float rnd_unit(void) { /* xorshift64, uniform in [-1, 1) */
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (float)((double)(rng >> 40) / (double)(1 << 23) - 1.0);
}

/* Values like those of a model in training: every stream non-zero and without pattern. On the
 * machine this was written on, memory moves zeros markedly faster than other data (a pass over
 * zeroed moments took 60% of the time of one over real ones), so zeroed or patterned buffers
 * would flatter whatever runs over them. */
static void streams_fill(const cfg_t *c, streams_t *s) {
  for (uint64_t i = 0; i < s->n; i++) {
    float g = rnd_unit() * 1e-2f;
    s->master[i] = rnd_unit();
    s->m[i] = rnd_unit() * 1e-3f;
    s->v[i] = (rnd_unit() + 1.0f) * 1e-6f;
    if (s->x) s->x[i] = (rnd_unit() + 1.0f) * 1e-6f;
    if (c->gdt == ZD_F32) ((float *)s->grad)[i] = g;
    if (c->gdt == ZD_BF16) ((uint16_t *)s->grad)[i] = zd__f32_to_bf16(g);
    /* f16: a random value of about the same size (sign, exponent 2^-10..2^-6, mantissa). */
    if (c->gdt == ZD_F16)
      ((uint16_t *)s->grad)[i] = (uint16_t)((rng & 0x83ff) | ((5 + rng % 5) << 10));
    if (c->pdt == ZD_F32) ((float *)s->param)[i] = s->master[i];
    if (c->pdt == ZD_BF16) ((uint16_t *)s->param)[i] = zd__f32_to_bf16(s->master[i]);
  }
}

static void streams_alloc(const cfg_t *c, uint64_t n, int kind, streams_t *s) {
  s->n = n;
  s->kind = kind;
  s->master = state_array(c, n, kind);
  s->m = state_array(c, n, kind);
  s->v = state_array(c, n, kind);
  s->x = c->amsgrad ? state_array(c, n, kind) : NULL;
  s->grad = shared_buffer(n * dtype_size(c->gdt), kind, ZD__COLOUR_GRADS);
  s->param = shared_buffer(n * dtype_size(c->pdt), kind, ZD__COLOUR_PARAMS);
}

/* The pass's buffers get the kernel's data, so both move the same values. */
static void streams_copy(const cfg_t *c, streams_t *dst, const streams_t *src) {
  memcpy(dst->master, src->master, src->n * 4);
  memcpy(dst->m, src->m, src->n * 4);
  memcpy(dst->v, src->v, src->n * 4);
  if (src->x) memcpy(dst->x, src->x, src->n * 4);
  memcpy(dst->grad, src->grad, src->n * dtype_size(c->gdt));
  if (src->param) memcpy(dst->param, src->param, src->n * dtype_size(c->pdt));
}

static void streams_free(const cfg_t *c, streams_t *s) {
  float *state[4] = {s->master, s->m, s->v, s->x};
  for (int i = 0; i < 4 && state[i]; i++) {
    if (s->kind == 0)
      c->cpu->ops->release(c->cpu, state[i], s->n);
    else
      munmap(state[i], s->n * 4);
  }
  if (s->grad) munmap(s->grad, s->n * dtype_size(c->gdt));
  if (s->param) munmap(s->param, s->n * dtype_size(c->pdt));
}

static zd__adam_args_t args_of(const cfg_t *c, const streams_t *s, const zd__segment_t *segs,
                               uint32_t nsegs, const zd__adam_group_t *groups) {
  return (zd__adam_args_t){.state[ZD__STATE_MASTER] = s->master,
                           .state[ZD__STATE_EXP_AVG] = s->m,
                           .state[ZD__STATE_EXP_AVG_SQ] = s->v,
                           .state[ZD__STATE_MAX_EXP_AVG_SQ] = s->x,
                           .grad = s->grad,
                           .grad_dtype = (zd_dtype_t)c->gdt,
                           .param = s->param,
                           .param_dtype = c->pdt ? (zd_dtype_t)c->pdt : ZD_F32,
                           .grad_scale = 1.0f,
                           .segs = segs,
                           .nsegs = nsegs,
                           .groups = groups};
}

/* ---- runs ---------------------------------------------------------------------------------- */

typedef struct {
  const zd__adam_args_t *args;
  zd__adam_fn kernel;
} kernel_run_t;

static void kernel_chunk(void *arg, uint64_t lo, uint64_t hi, unsigned thread) {
  (void)thread;
  const kernel_run_t *r = arg;
  r->kernel(r->args, lo, hi);
}

/* One kernel call over [0, n) split as the daemon splits it (compute_cpu.c). */
static void kernel_split(const cfg_t *c, const zd__adam_args_t *a, uint64_t n,
                         uint64_t min_per_thread) {
  kernel_run_t r = {.args = a, .kernel = c->kernel};
  zd__pool_for(c->pool, n, ZD__POOL_STREAM_GRAIN, min_per_thread, kernel_chunk, &r);
}

/* torch.optim.AdamW's defaults; the small vectors without weight decay. main() sets the formula
 * (--update, --sqrt). */
static zd_group_t hparams[2] = {
    {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 1e-2},
    {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0},
};

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

static void size_row(const cfg_t *c, uint64_t n, double elem_bytes) {
  streams_t ks, ps;
  streams_alloc(c, n, c->plain ? 1 : 0, &ks);
  streams_alloc(c, n, 2, &ps);
  streams_fill(c, &ks);
  streams_copy(c, &ps, &ks);
  zd__segment_t *segs = calloc(n / 1024 + 2, sizeof *segs);
  double *tk = calloc((size_t)c->iters, sizeof *tk), *tp = calloc((size_t)c->iters, sizeof *tp);
  if (!segs || !tk || !tp) die("calloc", ENOMEM);
  uint32_t nsegs = make_segments(segs, n);
  zd__adam_group_t groups[2];
  zd__adam_args_t ka = args_of(c, &ks, segs, nsegs, groups);
  zd__adam_args_t pa = args_of(c, &ps, segs, nsegs, groups);
  for (int it = 0; it < c->warmup + c->iters; it++) {
    for (int k = 0; k < 2; k++) zd__adam_group_init(&groups[k], &hparams[k], (uint64_t)it + 1);
    /* Alternate which goes first, so neither always finds the caches the other left. */
    double kt = 0, pt = 0;
    for (int half = 0; half < 2; half++) {
      zd_bench_settle();
      if ((it + half) % 2) {
        double t0 = zd_bench_now();
        kernel_split(c, &ka, n, ZD__POOL_STREAM_MIN_PER_THREAD);
        kt = zd_bench_now() - t0;
      } else {
        pt = zd_bench_mempass(c->pool, c->isa, &pa, n);
      }
    }
    if (it >= c->warmup) {
      tk[it - c->warmup] = kt;
      tp[it - c->warmup] = pt;
    }
  }
  double k_s = zd_bench_median(tk, c->iters), p_s = zd_bench_median(tp, c->iters);
  double bytes = elem_bytes * (double)n;
  printf("  %10llu %7s %7u %10.3f %9.3f %8.2f %10.3f %10.2f %7.1f%%\n", (unsigned long long)n,
         zd__isa_name(c->isa), zd__pool_size(c->pool), k_s * 1e3, (double)n / k_s * 1e-9,
         bytes / k_s * 1e-9, p_s * 1e3, bytes / p_s * 1e-9, 100.0 * p_s / k_s);
  fflush(stdout);
  free(tk);
  free(tp);
  free(segs);
  streams_free(c, &ks);
  streams_free(c, &ps);
}

/* ---- GPT-2 small --------------------------------------------------------------------------- */

#define GPT2_TENSORS 148

/* GPT-2 small's parameters in the order of its state_dict; matrices decay (group 0), biases and
 * layer norms do not (group 1). */
static uint32_t gpt2_params(zd_param_t *p, char names[][48]) {
  uint32_t k = 0;
#define ADD(nm, g, ...)                                                                      \
  do {                                                                                       \
    uint64_t shape[] = {__VA_ARGS__};                                                        \
    p[k] = (zd_param_t){.name = names[k], .ndim = sizeof shape / sizeof *shape, .group = g}; \
    memcpy(p[k].shape, shape, sizeof shape);                                                 \
    snprintf(names[k], 48, "%s", nm);                                                        \
    k++;                                                                                     \
  } while (0)
  char nm[48];
  ADD("wte.weight", 0, 50257, 768);
  ADD("wpe.weight", 0, 1024, 768);
  for (int l = 0; l < 12; l++) {
    static const struct {
      const char *name;
      uint32_t group;
      uint64_t rows, cols; /* cols 0: a vector */
    } t[12] = {
        {"ln_1.weight", 1, 768, 0},           {"ln_1.bias", 1, 768, 0},
        {"attn.c_attn.weight", 0, 768, 2304}, {"attn.c_attn.bias", 1, 2304, 0},
        {"attn.c_proj.weight", 0, 768, 768},  {"attn.c_proj.bias", 1, 768, 0},
        {"ln_2.weight", 1, 768, 0},           {"ln_2.bias", 1, 768, 0},
        {"mlp.c_fc.weight", 0, 768, 3072},    {"mlp.c_fc.bias", 1, 3072, 0},
        {"mlp.c_proj.weight", 0, 3072, 768},  {"mlp.c_proj.bias", 1, 768, 0},
    };
    for (int j = 0; j < 12; j++) {
      snprintf(nm, sizeof nm, "h.%d.%s", l, t[j].name);
      if (t[j].cols)
        ADD(nm, t[j].group, t[j].rows, t[j].cols);
      else
        ADD(nm, t[j].group, t[j].rows);
    }
  }
  ADD("ln_f.weight", 1, 768);
  ADD("ln_f.bias", 1, 768);
#undef ADD
  return k;
}

/* One tensor of the per-tensor reference: its own arrays, as a framework allocates a parameter's
 * tensors one by one (64-byte aligned, like torch's CPU allocator). */
typedef struct {
  float *master, *m, *v;
  void *grad, *param;
  uint64_t numel;
  zd__segment_t seg;
} tensor_t;

static void *tensor_alloc(size_t bytes) {
  void *p = NULL;
  if (bytes && posix_memalign(&p, 64, bytes)) die("posix_memalign", ENOMEM);
  return p;
}

static void gpt2_table(const cfg_t *c) {
  zd_param_t params[GPT2_TENSORS];
  static char names[GPT2_TENSORS][48];
  uint32_t np = gpt2_params(params, names);
  zd__layout_t *l;
  zd__err_t err;
  if (zd__layout_build(params, np, 2, 1, zd__layout_default_bucket_elems(1), &l, &err)) {
    fprintf(stderr, "bench_adam: layout: %s\n", err.msg);
    exit(1);
  }
  uint64_t total = 0;
  for (uint32_t i = 0; i < np; i++) total += l->params[i].numel;

  /* zerod: the flat shard as the daemon allocates it, stepped bucket by bucket. */
  streams_t zs;
  streams_alloc(c, l->shard_elems, c->plain ? 1 : 0, &zs);
  streams_fill(c, &zs);
  zd__segment_t **bsegs = calloc(l->nbuckets, sizeof *bsegs);
  uint32_t *bnsegs = calloc(l->nbuckets, sizeof *bnsegs);
  if (!bsegs || !bnsegs) die("calloc", ENOMEM);
  for (uint32_t b = 0; b < l->nbuckets; b++)
    if (zd__layout_segments(l, 0, b, &bsegs[b], &bnsegs[b])) die("segments", ENOMEM);

  /* The reference: per tensor, parameters and gradients first (the model, then its backward),
   * then the optimizer's three fp32 tensors for each parameter in turn. */
  tensor_t *t = calloc(np, sizeof *t);
  if (!t) die("calloc", ENOMEM);
  size_t gsz = dtype_size(c->gdt), psz = dtype_size(c->pdt);
  for (uint32_t i = 0; i < np; i++) {
    t[i].numel = l->params[i].numel;
    t[i].param = tensor_alloc(t[i].numel * psz);
  }
  for (uint32_t i = 0; i < np; i++) t[i].grad = tensor_alloc(t[i].numel * gsz);
  for (uint32_t i = 0; i < np; i++) {
    t[i].master = tensor_alloc(t[i].numel * 4);
    t[i].m = tensor_alloc(t[i].numel * 4);
    t[i].v = tensor_alloc(t[i].numel * 4);
    t[i].seg = (zd__segment_t){.offset = 0, .length = t[i].numel, .group = l->params[i].group};
  }
  for (uint32_t i = 0; i < np; i++) { /* the same values as zerod's shard */
    uint64_t o = l->params[i].offset, k = t[i].numel;
    memcpy(t[i].master, zs.master + o, k * 4);
    memcpy(t[i].m, zs.m + o, k * 4);
    memcpy(t[i].v, zs.v + o, k * 4);
    memcpy(t[i].grad, (const char *)zs.grad + o * gsz, k * gsz);
    if (psz) memcpy(t[i].param, (const char *)zs.param + o * psz, k * psz);
  }

  int iters = c->iters;
  double *tz = calloc((size_t)iters, sizeof *tz), *tr = calloc((size_t)iters, sizeof *tr);
  double *tp = calloc((size_t)iters, sizeof *tp);
  if (!tz || !tr || !tp) die("calloc", ENOMEM);
  zd__adam_group_t groups[2];
  zd__segment_t whole = {.offset = 0, .length = l->shard_elems, .group = 0};
  zd__adam_args_t pass = args_of(c, &zs, &whole, 1, groups);
  for (int it = 0; it < c->warmup + iters; it++) {
    for (int k = 0; k < 2; k++) zd__adam_group_init(&groups[k], &hparams[k], (uint64_t)it + 1);
    double tt[3];
    for (int j = 0; j < 3; j++) {
      int which = (it + j) % 3;
      zd_bench_settle();
      double t0 = zd_bench_now();
      if (which == 0) {
        for (uint32_t b = 0; b < l->nbuckets; b++) {
          const zd__bucket_t *bk = &l->buckets[b];
          zd__adam_args_t a = args_of(c, &zs, bsegs[b], bnsegs[b], groups);
          a.state[ZD__STATE_MASTER] += bk->shard_base;
          a.state[ZD__STATE_EXP_AVG] += bk->shard_base;
          a.state[ZD__STATE_EXP_AVG_SQ] += bk->shard_base;
          a.grad = (const char *)zs.grad + bk->offset * gsz;
          a.param = zs.param ? (char *)zs.param + bk->offset * psz : NULL;
          kernel_split(c, &a, bk->shard_elems, ZD__POOL_STREAM_MIN_PER_THREAD);
        }
      } else if (which == 1) {
        for (uint32_t i = 0; i < np; i++) {
          zd__adam_args_t a = {.state[ZD__STATE_MASTER] = t[i].master,
                               .state[ZD__STATE_EXP_AVG] = t[i].m,
                               .state[ZD__STATE_EXP_AVG_SQ] = t[i].v,
                               .grad = t[i].grad,
                               .grad_dtype = (zd_dtype_t)c->gdt,
                               .param = t[i].param,
                               .param_dtype = c->pdt ? (zd_dtype_t)c->pdt : ZD_F32,
                               .grad_scale = 1.0f,
                               .segs = &t[i].seg,
                               .nsegs = 1,
                               .groups = groups};
          /* An OpenMP-style loop: every tensor split over all threads. */
          kernel_split(c, &a, t[i].numel, ZD__POOL_STREAM_GRAIN);
        }
      } else {
        zd_bench_mempass(c->pool, c->isa, &pass, l->shard_elems);
      }
      tt[which] = zd_bench_now() - t0;
    }
    if (it >= c->warmup) {
      tz[it - c->warmup] = tt[0];
      tr[it - c->warmup] = tt[1];
      tp[it - c->warmup] = tt[2];
    }
  }
  double z = zd_bench_median(tz, iters), r = zd_bench_median(tr, iters);
  double p = zd_bench_median(tp, iters);
  printf(
      "#\n# GPT-2 small: %u tensors, %llu params, %u buckets; zerod: one segmented pass per "
      "bucket;\n# per-tensor: one kernel call per tensor over its own arrays, split over all "
      "threads; pass: over zerod's buffers\n",
      np, (unsigned long long)total, l->nbuckets);
  printf("# %7s %10s %9s %10s %9s %10s %8s %8s %9s\n", "threads", "zerod_ms", "Gparam/s",
         "tensor_ms", "Gparam/s", "pass_ms", "%pass", "%pass_t", "speedup");
  printf("  %7u %10.3f %9.3f %10.3f %9.3f %10.3f %7.1f%% %7.1f%% %8.2fx\n", zd__pool_size(c->pool),
         z * 1e3, (double)total / z * 1e-9, r * 1e3, (double)total / r * 1e-9, p * 1e3,
         100.0 * p / z, 100.0 * p / r, r / z);
  fflush(stdout);
  for (uint32_t i = 0; i < np; i++) {
    free(t[i].master);
    free(t[i].m);
    free(t[i].v);
    free(t[i].grad);
    free(t[i].param);
  }
  free(t);
  for (uint32_t b = 0; b < l->nbuckets; b++) free(bsegs[b]);
  free(bsegs);
  free(bnsegs);
  free(tz);
  free(tr);
  free(tp);
  streams_free(c, &zs);
  zd__layout_free(l);
}

/* ---- main ---------------------------------------------------------------------------------- */

static void usage(void) {
  fprintf(stderr,
          "usage: bench_adam [--min-log2 N] [--max-log2 N] [--odd N] [--threads N] [--isa NAME]\n"
          "                  [--iters N] [--warmup N] [--grad f32|bf16|f16] "
          "[--param f32|bf16|none]\n"
          "                  [--placement zerod|plain] [--gpt2 0|1|only]\n"
          "                  [--update torch113|torch2] [--sqrt exact|mkl_ex] [--amsgrad]\n");
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
  int min_log2 = 16, max_log2 = 25, gpt2 = 1;
  uint64_t odd = 123456;
  unsigned nthreads = 0;
  const char *isa_name = "auto";
  cfg_t c = {.gdt = ZD_F32, .pdt = ZD_F32, .iters = 15, .warmup = 3};
  for (int i = 1; i < argc; i++) {
    const char *opt = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(opt, "--amsgrad")) { /* takes no value */
      c.amsgrad = hparams[0].amsgrad = hparams[1].amsgrad = 1;
      continue;
    }
    if (!val) usage();
    if (!strcmp(opt, "--min-log2"))
      min_log2 = atoi(val);
    else if (!strcmp(opt, "--max-log2"))
      max_log2 = atoi(val);
    else if (!strcmp(opt, "--odd"))
      odd = (uint64_t)atoll(val);
    else if (!strcmp(opt, "--threads"))
      nthreads = (unsigned)atoi(val);
    else if (!strcmp(opt, "--isa"))
      isa_name = val;
    else if (!strcmp(opt, "--iters"))
      c.iters = atoi(val);
    else if (!strcmp(opt, "--warmup"))
      c.warmup = atoi(val);
    else if (!strcmp(opt, "--grad"))
      c.gdt = parse_dtype(val, 0);
    else if (!strcmp(opt, "--param"))
      c.pdt = parse_dtype(val, 1);
    else if (!strcmp(opt, "--placement") && (!strcmp(val, "zerod") || !strcmp(val, "plain")))
      c.plain = !strcmp(val, "plain");
    else if (!strcmp(opt, "--gpt2") && (!strcmp(val, "0") || !strcmp(val, "1")))
      gpt2 = atoi(val);
    else if (!strcmp(opt, "--gpt2") && !strcmp(val, "only"))
      gpt2 = 2;
    else if (!strcmp(opt, "--update") && (!strcmp(val, "torch113") || !strcmp(val, "torch2")))
      for (int k = 0; k < 2; k++)
        hparams[k].update = !strcmp(val, "torch2") ? ZD_UPDATE_TORCH2 : ZD_UPDATE_TORCH113;
    else if (!strcmp(opt, "--sqrt") && (!strcmp(val, "exact") || !strcmp(val, "mkl_ex")))
      for (int k = 0; k < 2; k++)
        hparams[k].sqrt_mode = !strcmp(val, "mkl_ex") ? ZD_SQRT_MKL_EX : ZD_SQRT_EXACT;
    else
      usage();
    i++;
  }
  if (c.amsgrad && gpt2) usage(); /* the GPT-2 table's per-tensor arrays have no fourth one */
  if (min_log2 < 6 || max_log2 > 34 || min_log2 > max_log2 || c.iters < 1 || c.warmup < 0 ||
      odd % 64)
    usage();
  int isa = zd__isa_parse(isa_name);
  if (isa < 0 || isa > (int)zd__isa_detect()) {
    fprintf(stderr, "bench_adam: ISA '%s' unknown or not supported by this CPU (best: %s)\n",
            isa_name, zd__isa_name(zd__isa_detect()));
    return 2;
  }
  c.isa = (zd__isa_t)isa;
  c.kernel = zd__adam_impl(c.isa);
  int rc = zd__pool_create(nthreads, 1, &c.pool); /* bound, as zerod's by default */
  if (rc) die("zd__pool_create", rc);
  if ((rc = zd__compute_cpu_create(c.pool, isa, &c.cpu))) die("zd__compute_cpu_create", rc);

  /* Bytes per element: read master, m, v(, vmax), grad; write master, m, v(, vmax), working
   * param. */
  double elem_bytes =
      4 * (c.amsgrad ? 8 : 6) + (double)dtype_size(c.gdt) + (double)dtype_size(c.pdt);
  printf(
      "# bench_adam: AdamW step over an fp32 master shard, grad %s, working params %s, "
      "arrays placed %s, update %s, sqrt %s%s\n",
      dtype_name(c.gdt), dtype_name(c.pdt),
      c.plain ? "plainly (back to back)" : "as zerod places them",
      hparams[0].update == ZD_UPDATE_TORCH2 ? "torch2" : "torch113",
      hparams[0].sqrt_mode == ZD_SQRT_MKL_EX ? "mkl_ex" : "exact", c.amsgrad ? ", amsgrad" : "");
  printf(
      "# %.0f bytes moved per param; pass: the same loads and stores, no arithmetic, over "
      "padded buffers; medians of %d runs after %d warm-up\n",
      elem_bytes, c.iters, c.warmup);
  if (gpt2 != 2) {
    printf("#\n# %10s %7s %7s %10s %9s %8s %10s %10s %8s\n", "params", "isa", "threads", "step_ms",
           "Gparam/s", "GB/s", "pass_ms", "pass_GB/s", "%pass");
    for (int lg = min_log2; lg <= max_log2; lg++) {
      size_row(&c, 1ull << lg, elem_bytes);
      if (odd) size_row(&c, (1ull << lg) + odd, elem_bytes);
    }
  }
  if (gpt2) gpt2_table(&c);
  zd__compute_destroy(c.cpu);
  zd__pool_destroy(c.pool);
  return 0;
}
