/* The CPU compute backend (compute.h): state in host memory, kernels of kernels/adam.h split over
 * the daemon's fork-join pool. Every operation is complete when it returns, so begin and finish
 * have nothing to do, a snapshot has no fence and the step record is all-gathered from host
 * memory. A stand-in uses its client's host buffers, which outlive the client (no slice_params
 * or zero).
 *
 * The state arrays are placed by common/placement.h, each at its own colour, so that a step's
 * streams never start at the same address modulo a large power of two (at 2^25 parameters that
 * halved the step). Statistics are summed in the fixed block order of adam.h whatever the split.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "compute.h"
#include "grad_norm.h"
#include "optim.h"
#include "placement.h"
#include "pool.h"

typedef struct cpu_compute {
  zd__compute_t base;
  zd__pool_t *pool;
  zd__adam_fn adam;
  zd__stats_fn stats;
  zd__norm_fn norm;
  zd__norm_part_fn part; /* a parameter's norm in parts (split across ranks' slices) */
  unsigned next_colour;  /* the next state array's colour (placement.h) */
  uint64_t *nonfinite;   /* per pool thread, for the statistics */
} cpu_compute_t;

/* Per shard: scratch for the statistics' block sums, as many as the largest bucket has. */
typedef struct cpu_shard {
  double *block_sums;
} cpu_shard_t;

/* ---- state --------------------------------------------------------------------------------- */

/* A shard's arrays (its state arrays, and the gradient shard when it has one: at most five) are
 * allocated one after the other by one thread, so handing out the five state colours in turn
 * gives each its own. With overlap_update a shard has a second set of state arrays, which an
 * update reads and writes together with the first: the turn goes on to the spare colour and
 * then the params' (which only the non-speculated buckets' updates and the commit write, with
 * one set read), so that a model of up to seven arrays has seven colours, none the grads'. */
static int cpu_alloc(zd__compute_t *base, uint64_t n, float **out, zd__err_t *err) {
  cpu_compute_t *c = (cpu_compute_t *)base;
  size_t bytes = (size_t)n * sizeof(float);
  static const unsigned colours[] = {
      ZD__COLOUR_STATE,     ZD__COLOUR_STATE + 1,   ZD__COLOUR_STATE + 2, ZD__COLOUR_STATE + 3,
      ZD__COLOUR_STATE_MAX, ZD__COLOUR_STATE_SPARE, ZD__COLOUR_PARAMS};
  unsigned colour = colours[c->next_colour];
  c->next_colour = (c->next_colour + 1) % (sizeof colours / sizeof colours[0]);
  void *p;
  int rc = zd__place_anon(bytes, colour, &p);
  if (rc) return zd__errf(err, rc, "cannot map %zu bytes of optimizer state", bytes);
  *out = p;
  return ZD_OK;
}

static void cpu_release(zd__compute_t *base, float *p, uint64_t n) {
  (void)base;
  zd__place_release(p, (size_t)n * sizeof(float));
}

/* ---- host staging: plain memory, copies complete on return ------------------------------------
 */

static int cpu_host_alloc(zd__compute_t *base, size_t bytes, void **out, zd__err_t *err) {
  (void)base;
  *out = malloc(bytes ? bytes : 1);
  if (!*out) return zd__errf(err, -ENOMEM, "no host memory for %zu bytes of staging", bytes);
  return ZD_OK;
}

static void cpu_host_free(void *p) {
  free(p);
}

/* Synchronous: the snapshot is whole when this returns, so there is no fence. */
static int cpu_snapshot(zd__compute_t *base, float *const *arrays, uint32_t count, uint64_t n,
                        float *host, void **fence, zd__err_t *err) {
  (void)base, (void)err;
  for (uint32_t i = 0; i < count; i++)
    memcpy(host + (size_t)i * n, arrays[i], (size_t)n * sizeof(float));
  *fence = NULL;
  return ZD_OK;
}

static int cpu_fence_wait(void *fence, int timeout_ms, zd__err_t *err) {
  (void)fence, (void)timeout_ms, (void)err;
  return ZD_OK;
}

static void cpu_fence_free(void *fence) {
  (void)fence;
}

static int cpu_restore(zd__compute_t *base, float *const *arrays, uint32_t count, uint64_t n,
                       const float *host, int timeout_ms, zd__err_t *err) {
  (void)base, (void)timeout_ms, (void)err;
  for (uint32_t i = 0; i < count; i++)
    memcpy(arrays[i], host + (size_t)i * n, (size_t)n * sizeof(float));
  return ZD_OK;
}

static int cpu_shard_init(zd__compute_t *base, zd__shard_t *s, uint32_t world_size,
                          zd__err_t *err) {
  (void)base, (void)world_size;
  uint64_t max_blocks = 0;
  for (uint32_t b = 0; b < s->layout->nbuckets; b++)
    if (zd__stats_blocks(s->layout->buckets[b].shard_elems) > max_blocks)
      max_blocks = zd__stats_blocks(s->layout->buckets[b].shard_elems);
  cpu_shard_t *cs = calloc(1, sizeof *cs);
  if (cs) cs->block_sums = calloc(max_blocks ? max_blocks : 1, sizeof *cs->block_sums);
  if (!cs || !cs->block_sums) {
    free(cs);
    return zd__errf(err, -ENOMEM, "out of memory for the statistics of %llu blocks",
                    (unsigned long long)max_blocks);
  }
  s->cdata = cs;
  return ZD_OK;
}

static void cpu_shard_fini(zd__compute_t *base, zd__shard_t *s) {
  (void)base;
  cpu_shard_t *cs = s->cdata;
  if (cs) free(cs->block_sums);
  free(cs);
  s->cdata = NULL;
}

/* This rank's slice of bucket b in the client's param buffer. */
static void *param_slice(const zd__shard_t *s, const zd__buffers_t *buf, uint32_t b) {
  const zd__bucket_t *bk = &s->layout->buckets[b];
  uint64_t e = bk->offset + (uint64_t)s->rank * bk->shard_elems;
  return (char *)buf->params.addr + e * zd_dtype_size(s->param_dtype);
}

static int cpu_begin(zd__compute_t *base, const zd__buffers_t *buf, uint32_t slot, zd__err_t *err) {
  (void)base, (void)buf, (void)slot, (void)err;
  return ZD_OK;
}

static int cpu_finish(zd__compute_t *base, zd__comm_t *comm, const zd__buffers_t *buf,
                      uint32_t slot, zd__err_t *err) {
  (void)base, (void)comm, (void)buf, (void)slot, (void)err;
  return ZD_OK;
}

/* Copies between the master shard and the client's param buffer over the covered elements. */
static int cpu_exchange(zd__compute_t *base, const zd__shard_t *sh, const zd__buffers_t *buf,
                        int to_client, zd__err_t *err) {
  (void)base, (void)err;
  const zd__layout_t *l = sh->layout;
  for (uint32_t b = 0; b < l->nbuckets; b++) {
    float *master = sh->state[ZD__STATE_MASTER] + l->buckets[b].shard_base;
    void *param = param_slice(sh, buf, b);
    for (uint32_t s = 0; s < sh->nsegs[b]; s++) {
      const zd__segment_t *sg = &sh->segs[b][s];
      for (uint64_t i = sg->offset; i < sg->offset + sg->length; i++) {
        if (sh->param_dtype == ZD_BF16) {
          uint16_t *p = param;
          if (to_client)
            p[i] = zd__f32_to_bf16(master[i]);
          else
            master[i] = zd__bf16_to_f32(p[i]);
        } else {
          float *p = param;
          if (to_client)
            p[i] = master[i];
          else
            master[i] = p[i];
        }
      }
    }
  }
  return ZD_OK;
}

/* ---- statistics ---------------------------------------------------------------------------- */

typedef struct stats_run {
  const cpu_compute_t *c;
  const void *grad;
  zd_dtype_t dtype;
  const zd__segment_t *segs;
  uint32_t nsegs;
  uint64_t n;
  double *sums;
} stats_run_t;

static void stats_chunk(void *arg, uint64_t b0, uint64_t b1, unsigned thread) {
  stats_run_t *r = arg;
  r->c->stats(r->grad, r->dtype, r->segs, r->nsegs, r->n, b0, b1, r->sums + b0,
              &r->c->nonfinite[thread]);
}

/* Sum of squares and non-finite count of this rank's reduced gradients of bucket b. */
static int cpu_grad_stats(zd__compute_t *base, const zd__shard_t *s, uint32_t b, int first,
                          zd__step_record_t *rec, zd__err_t *err) {
  (void)first, (void)err;
  const cpu_compute_t *c = (const cpu_compute_t *)base;
  const cpu_shard_t *cs = s->cdata;
  const zd__bucket_t *bk = &s->layout->buckets[b];
  stats_run_t r = {.c = c,
                   .grad = s->grad[b],
                   .dtype = s->grad_dtype[b],
                   .segs = s->segs[b],
                   .nsegs = s->nsegs[b],
                   .n = bk->shard_elems,
                   .sums = cs->block_sums};
  unsigned nthreads = zd__pool_size(c->pool);
  memset(c->nonfinite, 0, nthreads * sizeof *c->nonfinite);
  /* The statistics read one stream where the update moves eight: a thread pays off only over
   * proportionally more elements. */
  uint64_t nblocks = zd__stats_blocks(bk->shard_elems);
  zd__pool_for(c->pool, nblocks, 1, 8 * ZD__POOL_STREAM_MIN_PER_THREAD / ZD__STATS_BLOCK,
               stats_chunk, &r);
  rec->sumsq += zd__grad_stats_sum(r.sums, nblocks);
  for (unsigned t = 0; t < nthreads; t++) rec->nonfinite += c->nonfinite[t];
  return ZD_OK;
}

/* A chain's state between ranks in one round of cpu_torch_norm: per bucket, the lane state of the
 * parameter that continues on the next rank's slice. */
typedef struct norm_msg {
  float acc[8];
  uint32_t ready; /* acc holds a chain passed on this round */
  uint32_t pad;
} norm_msg_t;

/* One thread on each rank: each parameter's norm is one chain in torch's order, the parts of a
 * parameter split across ranks' slices taken rank after rank (compute.h). A model clipped bit for
 * bit at world size 1 is one torch would clip on one CPU anyway; at world size > 1 the extra cost
 * is the rounds (none where no parameter is split) and the norms' all-gather. */
static int cpu_torch_norm(zd__compute_t *base, zd__comm_t *comm, const zd__shard_t *s,
                          zd_clip_norm_t order, float scale, const uint8_t *present, float *total,
                          zd__err_t *err) {
  const cpu_compute_t *c = (const cpu_compute_t *)base;
  const zd__layout_t *l = s->layout;
  zd__norm_order_t o = order == ZD_CLIP_NORM_TORCH113  ? ZD__NORM_TORCH113
                       : order == ZD_CLIP_NORM_TORCH26 ? ZD__NORM_TORCH26
                                                       : ZD__NORM_TORCH215;
  uint32_t w = l->world_size, r = s->rank, np = l->nparams, nb = l->nbuckets;
  for (uint32_t b = 0; b < nb; b++)
    if (s->grad_dtype[b] != ZD_F32)
      return zd__errf(err, ZD_EINTERNAL, "torch's norm of bucket %u's %s gradients: fp32 only", b,
                      zd_dtype_name(s->grad_dtype[b]));
  int rc = ZD_OK;
  /* per bucket: the chain this rank passes on, and the one it continues (the round it arrives
   * in: the number of ranks between the parameter's first and this one) */
  zd__norm_state_t *chain = calloc(nb, sizeof *chain);
  uint32_t *in_round = calloc(nb, sizeof *in_round), *in_param = calloc(nb, sizeof *in_param);
  uint8_t *out_ready = calloc(nb, 1);
  norm_msg_t *send = calloc(nb, sizeof *send), *recv = calloc((size_t)w * nb, sizeof *recv);
  /* the norms' all-gather: a status word, then every parameter's norm (this rank's, else 0) */
  size_t row = sizeof(int32_t) + (size_t)np * sizeof(float);
  char *mine = calloc(1, row), *all = calloc(w, row);
  float *norms = calloc(np, sizeof *norms), *stack = calloc(np, sizeof *stack);
  if (!chain || !in_round || !in_param || !out_ready || !send || !recv || !mine || !all || !norms ||
      !stack) {
    rc = zd__errf(err, -ENOMEM, "out of memory for the norms of %u parameters", np);
    goto exit;
  }
  uint32_t rounds = 0;
  for (uint32_t b = 0; b < nb; b++) {
    const zd__bucket_t *bk = &l->buckets[b];
    uint64_t se = bk->shard_elems, lo = bk->offset + (uint64_t)r * se, hi = lo + se;
    const float *g = (const float *)s->grad[b];
    for (uint32_t i = bk->first_param; i < bk->first_param + bk->nparams; i++) {
      const zd__layout_param_t *p = &l->params[i];
      uint64_t n = p->numel, po = p->offset;
      if (n == 0) continue; /* its norm is 0 */
      uint32_t fr = (uint32_t)((po - bk->offset) / se),
               lr = (uint32_t)((po + n - 1 - bk->offset) / se);
      if (lr - fr > rounds) rounds = lr - fr;
      if (r < fr || r > lr) continue;
      if (r > fr) { /* continued here from the rank before (at most one per bucket) */
        in_round[b] = r - fr;
        in_param[b] = i;
        continue;
      }
      uint64_t e = po + n < hi ? po + n : hi;
      if (r == lr && scale == 1.0f) {
        norms[i] = c->norm(g + (po - lo), n, o); /* whole here: world size 1's path */
      } else {
        zd__norm_state_t st = {{0}};
        float v = c->part(&st, g + (po - lo), n, 0, e - po, scale, o);
        if (r == lr) {
          norms[i] = v;
        } else { /* the last parameter of this slice goes on to the next rank */
          chain[b] = st;
          out_ready[b] = 1;
        }
      }
    }
  }
  /* The rounds: in round t, the chains that started t ranks before arrive. Every rank takes part
   * in every round, also after a failure of its own (reported in the status word below). */
  int32_t status = ZD_OK;
  for (uint32_t t = 1; t <= rounds && w > 1; t++) {
    for (uint32_t b = 0; b < nb; b++) {
      send[b].ready = out_ready[b];
      memcpy(send[b].acc, chain[b].acc, sizeof send[b].acc);
      out_ready[b] = 0;
    }
    rc = comm->ops->allgather_bytes(comm, send, nb * sizeof *send, recv, err);
    if (rc) goto exit;
    for (uint32_t b = 0; b < nb && !status; b++) {
      if (in_round[b] != t) continue;
      const zd__bucket_t *bk = &l->buckets[b];
      const zd__layout_param_t *p = &l->params[in_param[b]];
      const norm_msg_t *prev = &recv[(size_t)(r - 1) * nb + b];
      if (!prev->ready) {
        status = zd__errf(err, ZD_EINTERNAL,
                          "torch's norm: rank %u did not pass on parameter %u's chain in round %u",
                          r - 1, in_param[b], t);
        break;
      }
      uint64_t se = bk->shard_elems, lo = bk->offset + (uint64_t)r * se, hi = lo + se;
      uint64_t e = p->offset + p->numel < hi ? p->offset + p->numel : hi;
      zd__norm_state_t st;
      memcpy(st.acc, prev->acc, sizeof st.acc);
      float v = c->part(&st, (const float *)s->grad[b], p->numel, lo - p->offset, e - lo, scale, o);
      if (e == p->offset + p->numel) {
        norms[in_param[b]] = v;
      } else {
        chain[b] = st;
        out_ready[b] = 1;
      }
    }
  }
  memcpy(mine, &status, sizeof status);
  memcpy(mine + sizeof status, norms, (size_t)np * sizeof *norms);
  if (w > 1) {
    rc = comm->ops->allgather_bytes(comm, mine, row, all, err);
    if (rc) goto exit;
    for (uint32_t q = 0; q < w; q++) {
      int32_t st;
      memcpy(&st, all + q * row, sizeof st);
      if (st && !status) {
        status = zd__errf(err, st, "torch's norm failed on rank %u (%s)", q, zd_err_name(st));
      }
    }
    /* each parameter's norm from the rank that holds its last element */
    for (uint32_t i = 0; i < np && !status; i++) {
      const zd__layout_param_t *p = &l->params[i];
      const zd__bucket_t *bk = &l->buckets[p->bucket];
      if (p->numel == 0) continue;
      uint64_t q = (p->offset + p->numel - 1 - bk->offset) / bk->shard_elems;
      memcpy(&norms[i], all + q * row + sizeof status + (size_t)i * sizeof(float), sizeof(float));
    }
  }
  rc = status;
  /* torch stacks the per-parameter norms (of the parameters present) and takes the same norm of
   * the stack. */
  if (!rc) *total = zd__torch_norm2_total(c->norm, norms, np, present, o, stack);
exit:
  free(stack);
  free(norms);
  free(all);
  free(mine);
  free(recv);
  free(send);
  free(out_ready);
  free(in_param);
  free(in_round);
  free(chain);
  return rc;
}

static int cpu_gather_records(zd__compute_t *base, zd__comm_t *comm, const zd__shard_t *s,
                              const zd__step_record_t *mine, int stats, zd__step_record_t *all,
                              zd__err_t *err) {
  (void)base, (void)s, (void)stats;
  return comm->ops->allgather_bytes(comm, mine, sizeof *mine, all, err);
}

/* ---- update -------------------------------------------------------------------------------- */

typedef struct adam_run {
  const zd__adam_args_t *args;
  zd__adam_fn fn;
} adam_run_t;

static void adam_chunk(void *arg, uint64_t begin, uint64_t end, unsigned thread) {
  (void)thread;
  const adam_run_t *r = arg;
  r->fn(r->args, begin, end);
}

/* Whether some group leaves max_exp_avg_sq alone (amsgrad off) in a shard that has the array:
 * an update out of place then copies the bucket's part of it first, so that the other set holds
 * the whole state (torch keeps the array of a group that turns amsgrad off). */
static int keeps_max_sq(const zd__shard_t *s, const zd__adam_group_t *consts) {
  if (!s->state[ZD__STATE_MAX_EXP_AVG_SQ]) return 0;
  for (uint32_t g = 0; g < s->ngroups; g++)
    if (!consts[g].amsgrad) return 1;
  return 0;
}

static int cpu_update(zd__compute_t *base, const zd__shard_t *s, uint32_t b,
                      const zd__buffers_t *buf, const zd__adam_group_t *consts, float grad_scale,
                      float *const *out, zd__err_t *err) {
  (void)err;
  const cpu_compute_t *c = (const cpu_compute_t *)base;
  const zd__bucket_t *bk = &s->layout->buckets[b];
  zd__adam_args_t args = {
      .grad = s->grad[b],
      .grad_dtype = s->grad_dtype[b],
      .param = buf ? param_slice(s, buf, b) : NULL,
      .param_dtype = s->param_dtype,
      .grad_scale = grad_scale,
      .segs = s->segs[b],
      .nsegs = s->nsegs[b],
      .groups = consts,
  };
  for (int i = 0; i < ZD__NSTATES; i++) { /* bucket b's part of every array the shard has */
    args.state[i] = s->state[i] ? s->state[i] + bk->shard_base : NULL;
    if (out && s->state[i]) { /* read the committed set, write the other */
      args.src[i] = args.state[i];
      args.state[i] = out[i] + bk->shard_base;
    }
  }
  if (out && keeps_max_sq(s, consts))
    memcpy(args.state[ZD__STATE_MAX_EXP_AVG_SQ], args.src[ZD__STATE_MAX_EXP_AVG_SQ],
           bk->shard_elems * sizeof(float));
  adam_run_t run = {.args = &args, .fn = c->adam};
  zd__pool_for(c->pool, bk->shard_elems, ZD__POOL_STREAM_GRAIN, ZD__POOL_STREAM_MIN_PER_THREAD,
               adam_chunk, &run);
  return ZD_OK;
}

typedef struct params_run {
  const zd__shard_t *s;
  uint32_t b;
  const float *master;
  void *param;
} params_run_t;

/* n floats from src to dst; stream: past the cache (non-temporal stores, no read for ownership
 * of the lines overwritten), for a piece of at least ZD__ADAM_NT_MIN elements, which zerod does
 * not read back: overlap_update's commit writes the working parameters from the master weights
 * in a pass of its own, and memcpy's ordinary stores (its non-temporal threshold scales with the
 * last-level cache, 300 MiB on the 2-vCPU VM measured) took 1.15-1.7x as long at 2^22 elements
 * (bench_overlap's commit, 8 buckets of 2^19, and a copy alone). The same bits either way. */
static void copy_f32(float *dst, const float *src, uint64_t n, int stream) {
#if defined(__SSE2__)
  if (stream) {
    uint64_t i = 0;
    for (; i < n && ((uintptr_t)(dst + i) & 15); i++) dst[i] = src[i];
    for (; i + 16 <= n; i += 16) {
      _mm_prefetch((const char *)((uintptr_t)(src + i) + ZD__ADAM_PREFETCH * sizeof(float)),
                   _MM_HINT_T0);
      for (int j = 0; j < 16; j += 4) _mm_stream_ps(dst + i + j, _mm_loadu_ps(src + i + j));
    }
    for (; i < n; i++) dst[i] = src[i];
    _mm_sfence(); /* weakly ordered: published before the caller signals completion */
    return;
  }
#else
  (void)stream;
#endif
  memcpy(dst, src, n * sizeof(float));
}

static void params_chunk(void *arg, uint64_t begin, uint64_t end, unsigned thread) {
  (void)thread;
  const params_run_t *r = arg;
  const zd__shard_t *s = r->s;
  int stream = end - begin >= ZD__ADAM_NT_MIN;
  for (uint32_t k = zd__segs_find(s->segs[r->b], s->nsegs[r->b], begin); k < s->nsegs[r->b]; k++) {
    const zd__segment_t *sg = &s->segs[r->b][k];
    if (sg->offset >= end) break;
    uint64_t lo = sg->offset > begin ? sg->offset : begin;
    uint64_t hi = sg->offset + sg->length < end ? sg->offset + sg->length : end;
    if (s->param_dtype == ZD_BF16)
      for (uint64_t i = lo; i < hi; i++) ((uint16_t *)r->param)[i] = zd__f32_to_bf16(r->master[i]);
    else
      copy_f32((float *)r->param + lo, r->master + lo, hi - lo, stream);
  }
}

/* The conversion of the update's param_out (adam.h), split over the pool as the update is. */
static int cpu_params_from_master(zd__compute_t *base, const zd__shard_t *s, uint32_t b,
                                  const zd__buffers_t *buf, zd__err_t *err) {
  (void)err;
  const cpu_compute_t *c = (const cpu_compute_t *)base;
  const zd__bucket_t *bk = &s->layout->buckets[b];
  params_run_t r = {.s = s,
                    .b = b,
                    .master = s->state[ZD__STATE_MASTER] + bk->shard_base,
                    .param = param_slice(s, buf, b)};
  zd__pool_for(c->pool, bk->shard_elems, ZD__POOL_STREAM_GRAIN, 4 * ZD__POOL_STREAM_MIN_PER_THREAD,
               params_chunk, &r);
  return ZD_OK;
}

unsigned zd__compute_cpu_update_threads(const zd__pool_t *pool, uint64_t shard_elems) {
  return zd__pool_threads_for(pool, shard_elems, ZD__POOL_STREAM_GRAIN,
                              ZD__POOL_STREAM_MIN_PER_THREAD);
}

static void cpu_destroy(zd__compute_t *base) {
  cpu_compute_t *c = (cpu_compute_t *)base;
  free(c->nonfinite);
  free(c);
}

static const zd__compute_ops_t cpu_ops = {
    .alloc = cpu_alloc,
    .release = cpu_release,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_host_free,
    .snapshot = cpu_snapshot,
    .fence_wait = cpu_fence_wait,
    .fence_free = cpu_fence_free,
    .restore = cpu_restore,
    .shard_init = cpu_shard_init,
    .shard_fini = cpu_shard_fini,
    .begin = cpu_begin,
    .finish = cpu_finish,
    .exchange = cpu_exchange,
    .grad_stats = cpu_grad_stats,
    .torch_norm = cpu_torch_norm,
    .gather_records = cpu_gather_records,
    .update = cpu_update,
    .params_from_master = cpu_params_from_master,
    .destroy = cpu_destroy,
};

int zd__compute_cpu_create(zd__pool_t *pool, int isa, zd__compute_t **out) {
  cpu_compute_t *c = calloc(1, sizeof *c);
  if (c) c->nonfinite = calloc(zd__pool_size(pool), sizeof *c->nonfinite);
  if (!c || !c->nonfinite) {
    free(c);
    return -ENOMEM;
  }
  c->base.ops = &cpu_ops;
  c->base.name = "cpu";
  c->pool = pool;
  c->adam = zd__optim_impl((zd__isa_t)isa);
  c->stats = zd__grad_stats_impl((zd__isa_t)isa);
  c->norm = zd__torch_norm2_impl((zd__isa_t)isa);
  c->part = zd__torch_norm2_part_impl((zd__isa_t)isa);
  *out = &c->base;
  return ZD_OK;
}
