/* The CUDA optimizer kernels (adam_cuda.h): the fused AdamW/Adam update, the gradient statistics,
 * their host launchers, and the check that says why CUDA cannot be used. (The step's decision
 * from the gathered records is decide.cu's.)
 *
 * The update walks a table of tiles built once per range (zd__cuda_layout_create): a tile is at
 * most ZD__CUDA_TILE elements of one segment, cut at multiples of ZD__CUDA_TILE, so a block
 * looks up its group's constants once per tile and never per element, and only the first and
 * last tile of a segment have edges off the 8-element grid. Blocks stride over the tiles; in a
 * tile each thread takes 8 consecutive elements at a time (two 16-byte loads of each fp32 array,
 * one of a 16-bit grad, all issued before the arithmetic), edges element by element. The grid is
 * one wave: as many blocks as the kernel variant keeps resident on every SM at once
 * (cudaOccupancyMaxActiveBlocksPerMultiprocessor, asked once per layout), no more than tiles.
 *
 * The statistics follow adam.h's fixed order: four threads per 2048-element block, each owning
 * four of the sixteen lanes and reading one 16-byte (or 8-byte) vector per 16 elements, lanes
 * added in increasing element order, then the lanes' binary tree through warp shuffles. The
 * block sums are then added pairwise by levels (adam.h): a block of the tree kernel takes 2048
 * consecutive sums, eight per thread added in registers (levels 1-3), the warp's 32 through
 * shuffles (levels 4-8), the block's 8 warps by thread 0 (levels 9-11); one launch per level of
 * chunks until at most 2048 remain, which the finalize kernel adds the same way before it writes
 * and seals the record. Each launch is a handful of dependent adds deep, where adding the sums
 * in a serial chain took one add per block sum (0.9 ms of 1.24 at 2^28 gradients).
 *
 * Arithmetic: see adam.cuh (explicit _rn intrinsics, FMA exactly where adam.h has it). Doubles in
 * the statistics use __dmul_rn/__dadd_rn so that `lane += x * x` is never fused either.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adam.cuh"
#include "launch.cuh"

#define FULL_MASK 0xffffffffu

/* ---- errors -------------------------------------------------------------------------------- */

#define CUDA_TRY(err, call, what)        \
  do {                                   \
    cudaError_t e_ = (call);             \
    if (e_ != cudaSuccess) {             \
      rc = zd__cuda_errf(err, e_, what); \
      goto fail;                         \
    }                                    \
  } while (0)

/* ---- availability -------------------------------------------------------------------------- */

#define MIN_CC_MAJOR 9 /* sm_90 code and compute_90 PTX are built in */

static int device_usable(int dev, char *why, size_t len) {
  int major = 0, minor = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(why, len, "GPU %d: cannot read its compute capability: %s (%s)", dev,
             cudaGetErrorString(e), cudaGetErrorName(e));
    return 0;
  }
  if (major >= MIN_CC_MAJOR) return 1;
  cudaDeviceProp prop;
  const char *name = "?";
  if (cudaGetDeviceProperties(&prop, dev) == cudaSuccess)
    name = prop.name;
  else
    (void)cudaGetLastError();
  snprintf(why, len,
           "GPU %d (%.100s) has compute capability %d.%d; this zerod has CUDA kernels for "
           "%d.0 (Hopper) and later only",
           dev, name, major, minor, MIN_CC_MAJOR);
  return 0;
}

int zd__cuda_available(char *why, size_t len) {
  char scratch[512];
  if (!why || !len) {
    why = scratch;
    len = sizeof scratch;
  }
  why[0] = 0;
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    int drv = 0, rt = 0;
    (void)cudaDriverGetVersion(&drv);
    (void)cudaRuntimeGetVersion(&rt);
    (void)cudaGetLastError();
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    if (e == cudaErrorInsufficientDriver && drv == 0)
      snprintf(why, len,
               "no NVIDIA driver is loaded (libcuda.so.1 not found, or no GPU kernel "
               "module); this zerod was built with CUDA %d.%d",
               rt / 1000, rt % 1000 / 10);
    else if (e == cudaErrorInsufficientDriver)
      snprintf(why, len,
               "the NVIDIA driver supports CUDA %d.%d; this zerod was built with CUDA "
               "%d.%d and needs a driver for that version or later",
               drv / 1000, drv % 1000 / 10, rt / 1000, rt % 1000 / 10);
    else if (e == cudaErrorNoDevice)
      snprintf(why, len, "no CUDA device is visible%s%s%s", vis ? " (CUDA_VISIBLE_DEVICES=" : "",
               vis ? vis : "", vis ? ")" : "");
    else
      snprintf(why, len, "CUDA cannot be initialised: cudaGetDeviceCount: %s (%s)",
               cudaGetErrorString(e), cudaGetErrorName(e));
    return 0;
  }
  if (count <= 0) {
    snprintf(why, len, "no CUDA device is visible");
    return 0;
  }
  int usable = 0;
  size_t used = 0;
  for (int dev = 0; dev < count; dev++) {
    char one[512];
    if (device_usable(dev, one, sizeof one)) {
      usable++;
    } else if (used < len) {
      int w = snprintf(why + used, len - used, "%s%s", used ? "; " : "", one);
      used += w > 0 ? (size_t)w : 0;
    }
  }
  return usable;
}

int zd__cuda_device_check(int device, zd__err_t *err) {
  char why[512];
  int total = 0;
  if (cudaGetDeviceCount(&total) != cudaSuccess) {
    (void)cudaGetLastError();
    zd__cuda_available(why, sizeof why); /* says why CUDA cannot start */
    return zd__errf(err, ZD_EBACKEND, "%s", why);
  }
  if (device < 0 || device >= total)
    return zd__errf(err, ZD_EBACKEND, "GPU %d does not exist: %d CUDA device%s visible", device,
                    total, total == 1 ? " is" : "s are");
  if (!device_usable(device, why, sizeof why)) return zd__errf(err, ZD_EBACKEND, "%s", why);
  return ZD_OK;
}

/* ---- layouts ------------------------------------------------------------------------------- */

#define ADAM_THREADS    256
#define ADAM_VEC        8 /* elements per thread and iteration */
#define STATS_THREADS   256
#define STATS_PER_BLOCK (STATS_THREADS / 4) /* four threads per statistics block */
#define TREE_THREADS    256
#define TREE_PER_THREAD 8
#define TREE_CHUNK      (TREE_THREADS * TREE_PER_THREAD) /* block sums per block of the tree */

static int gdt_variant(int gdt) {
  return gdt == ZD_F32 ? 0 : gdt == ZD_BF16 ? 1 : 2;
}

static int pdt_variant(int pdt) { /* 0: no param output */
  return pdt == ZD_F32 ? 0 : pdt == ZD_BF16 ? 1 : 2;
}

/* Partial sums the tree needs for m block sums: one per chunk of TREE_CHUNK at every level that
 * has more than TREE_CHUNK values (the finalize adds the last level's at most TREE_CHUNK). */
static uint64_t tree_partials(uint64_t m) {
  uint64_t total = 0;
  while (m > TREE_CHUNK) {
    m = (m + TREE_CHUNK - 1) / TREE_CHUNK;
    total += m;
  }
  return total;
}

static cudaError_t size_grids(zd__cuda_layout_t *l, int sms);

static int check_segments(const zd__segment_t *segs, uint32_t nsegs, uint64_t n, zd__err_t *err) {
  if (nsegs && !segs)
    return zd__errf(err, -EINVAL, "CUDA layout: %u segments but no segment list", nsegs);
  uint64_t end = 0;
  for (uint32_t s = 0; s < nsegs; s++) {
    const zd__segment_t *g = &segs[s];
    if (g->offset > n || g->length > n - g->offset)
      return zd__errf(err, -EINVAL,
                      "CUDA layout: segment %u [%llu, +%llu) ends past the range of %llu "
                      "elements",
                      s, (unsigned long long)g->offset, (unsigned long long)g->length,
                      (unsigned long long)n);
    if (g->group == UINT32_MAX)
      return zd__errf(err, -EINVAL, "CUDA layout: segment %u has group %u", s, g->group);
    if (g->offset < end)
      return zd__errf(err, -EINVAL,
                      "CUDA layout: segment %u starts at %llu, before the end %llu of "
                      "segment %u; segments must be sorted and disjoint",
                      s, (unsigned long long)g->offset, (unsigned long long)end, s - 1);
    end = g->offset + g->length;
  }
  return ZD_OK;
}

int zd__cuda_layout_create(const zd__segment_t *segs, uint32_t nsegs, uint64_t n,
                           cudaStream_t stream, zd__cuda_layout_t **out, zd__err_t *err) {
  if (!out) return zd__errf(err, -EINVAL, "CUDA layout: no result pointer");
  *out = NULL;
  int rc = zd__check_stream(stream, "CUDA layout", err);
  if (rc) return rc;
  rc = check_segments(segs, nsegs, n, err);
  if (rc) return rc;

  zd__cuda_layout_t *l = (zd__cuda_layout_t *)calloc(1, sizeof *l);
  tile_t *tiles = NULL;
  seg_t *hsegs = NULL;
  uint32_t *first = NULL;
  if (!l) return zd__errf(err, -ENOMEM, "CUDA layout: out of memory");
  l->n = n;
  l->nsegs = nsegs;
  l->nblocks = zd__stats_blocks(n);
  for (uint32_t s = 0; s < nsegs; s++) {
    if (segs[s].group + 1 > l->ngroups) l->ngroups = segs[s].group + 1;
    if (segs[s].length)
      l->ntiles += (segs[s].offset + segs[s].length - 1) / ZD__CUDA_TILE -
                   segs[s].offset / ZD__CUDA_TILE + 1;
  }
  tiles = (tile_t *)malloc((l->ntiles ? l->ntiles : 1) * sizeof *tiles);
  hsegs = (seg_t *)malloc((nsegs ? nsegs : 1) * sizeof *hsegs);
  first = (uint32_t *)malloc((l->nblocks ? l->nblocks : 1) * sizeof *first);
  if (!tiles || !hsegs || !first) {
    rc = zd__errf(err, -ENOMEM, "CUDA layout: out of memory for %llu tiles",
                  (unsigned long long)l->ntiles);
    goto fail;
  }
  {
    uint64_t t = 0;
    for (uint32_t s = 0; s < nsegs; s++) {
      uint64_t lo = segs[s].offset, hi = lo + segs[s].length;
      hsegs[s] = (seg_t){lo, hi};
      while (lo < hi) {
        uint64_t cut = (lo / ZD__CUDA_TILE + 1) * ZD__CUDA_TILE;
        uint64_t e = cut < hi ? cut : hi;
        tiles[t++] = (tile_t){lo, (uint32_t)(e - lo), segs[s].group};
        lo = e;
      }
    }
    uint32_t s = 0;
    for (uint64_t k = 0; k < l->nblocks; k++) {
      while (s < nsegs && hsegs[s].hi <= k * ZD__STATS_BLOCK) s++;
      first[k] = s; /* zd__segs_find(segs, nsegs, k * ZD__STATS_BLOCK) */
    }
  }

  int dev, sms;
  CUDA_TRY(err, cudaGetDevice(&dev), "CUDA layout: cudaGetDevice");
  CUDA_TRY(err, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
           "CUDA layout: multiprocessor count");
  l->sms = sms;
  CUDA_TRY(err, size_grids(l, sms), "CUDA layout: the kernels' occupancy");
  if (l->ntiles) {
    CUDA_TRY(err, cudaMalloc((void **)&l->d_tiles, l->ntiles * sizeof(tile_t)),
             "CUDA layout: cudaMalloc of the tile table");
    CUDA_TRY(err,
             cudaMemcpyAsync(l->d_tiles, tiles, l->ntiles * sizeof(tile_t), cudaMemcpyHostToDevice,
                             stream),
             "CUDA layout: copying the tile table");
  }
  if (nsegs) {
    CUDA_TRY(err, cudaMalloc((void **)&l->d_segs, nsegs * sizeof(seg_t)),
             "CUDA layout: cudaMalloc of the segments");
    CUDA_TRY(
        err,
        cudaMemcpyAsync(l->d_segs, hsegs, nsegs * sizeof(seg_t), cudaMemcpyHostToDevice, stream),
        "CUDA layout: copying the segments");
  }
  if (l->nblocks) {
    CUDA_TRY(err, cudaMalloc((void **)&l->d_first_seg, l->nblocks * sizeof(uint32_t)),
             "CUDA layout: cudaMalloc of the block table");
    CUDA_TRY(err, cudaMalloc((void **)&l->d_sums, l->nblocks * sizeof(double)),
             "CUDA layout: cudaMalloc of the block sums");
    CUDA_TRY(err, cudaMalloc((void **)&l->d_counts, l->nblocks * sizeof(unsigned long long)),
             "CUDA layout: cudaMalloc of the block counts");
    CUDA_TRY(err,
             cudaMemcpyAsync(l->d_first_seg, first, l->nblocks * sizeof(uint32_t),
                             cudaMemcpyHostToDevice, stream),
             "CUDA layout: copying the block table");
  }
  l->npartial = tree_partials(l->nblocks);
  if (l->npartial) {
    CUDA_TRY(err, cudaMalloc((void **)&l->d_partial, l->npartial * sizeof(double)),
             "CUDA layout: cudaMalloc of the partial sums");
    CUDA_TRY(err, cudaMalloc((void **)&l->d_pcounts, l->npartial * sizeof(unsigned long long)),
             "CUDA layout: cudaMalloc of the partial counts");
  }
  /* The host tables are pageable and freed below: wait for the copies. */
  CUDA_TRY(err, cudaStreamSynchronize(stream), "CUDA layout: waiting for the table copies");
  free(tiles);
  free(hsegs);
  free(first);
  *out = l;
  return ZD_OK;
fail:
  free(tiles);
  free(hsegs);
  free(first);
  zd__cuda_layout_destroy(l);
  return rc;
}

void zd__cuda_layout_destroy(zd__cuda_layout_t *l) {
  if (!l) return;
  cudaFree(l->d_pcounts);
  cudaFree(l->d_partial);
  cudaFree(l->d_counts);
  cudaFree(l->d_sums);
  cudaFree(l->d_first_seg);
  cudaFree(l->d_segs);
  cudaFree(l->d_tiles);
  free(l);
}

uint64_t zd__cuda_layout_elems(const zd__cuda_layout_t *l) {
  return l->n;
}
uint64_t zd__cuda_layout_tiles(const zd__cuda_layout_t *l) {
  return l->ntiles;
}
uint64_t zd__cuda_layout_stats_blocks(const zd__cuda_layout_t *l) {
  return l->nblocks;
}
uint32_t zd__cuda_layout_groups(const zd__cuda_layout_t *l) {
  return l->ngroups;
}
void zd__cuda_layout_grids(const zd__cuda_layout_t *l, unsigned *adam_blocks,
                           uint64_t *stats_per_pass) {
  unsigned adam = 0, stats = 0;
  for (int g = 0; g < GDT_VARIANTS; g++) {
    for (int p = 0; p < PDT_VARIANTS; p++)
      for (int x = 0; x < 2; x++)
        if (l->adam_grid[g][p][x] > adam) adam = l->adam_grid[g][p][x];
    if (l->stats_grid[g] > stats) stats = l->stats_grid[g];
  }
  if (adam_blocks) *adam_blocks = adam;
  if (stats_per_pass) *stats_per_pass = (uint64_t)stats * STATS_PER_BLOCK;
}
double *zd__cuda_layout_block_sums(const zd__cuda_layout_t *l) {
  return l->d_sums;
}

/* ---- the update ---------------------------------------------------------------------------- */

/* Everything a launch needs, by value (about 3.7 KB: under the classic 4 KB parameter limit).
 * __grid_constant__ lets threads address it in place, without a per-thread copy. */
typedef struct adam_kargs {
  float *master;
  float *exp_avg;
  float *exp_avg_sq;
  float *max_exp_avg_sq; /* NULL: the model has none (AMS = false) */
  const void *grad;
  void *param;
  const tile_t *tiles;
  uint64_t ntiles;
  float grad_scale;
  int vec; /* every array 16-byte aligned: vectors at multiples of 8 elements */
  const zd__cuda_decision_t *decision; /* NULL: grad_scale; else its verdict and factor */
  const uint32_t *map;                 /* NULL: a tile's group indexes the groups; else map[it] */
  uint32_t optimizers;                 /* 0: every tile; else the tiles of these optimizers */
  const zd__adam_group_t *d_groups;
  zd__adam_group_t groups[ZD__CUDA_GROUPS_INLINE];
} adam_kargs_t;

template <int GDT>
static __device__ __forceinline__ float load_grad(const void *g, uint64_t i) {
  if (GDT == ZD_F32) return __ldg((const float *)g + i);
  return zd__dev_grad_to_f32<GDT>(__ldg((const unsigned short *)g + i));
}

/* Grads i..i+7; i a multiple of 8 and the array 16-byte aligned. */
template <int GDT>
static __device__ __forceinline__ void load_grad8(const void *g, uint64_t i, float x[8]) {
  if (GDT == ZD_F32) {
    const float4 *q = (const float4 *)((const float *)g + i);
    float4 a = __ldg(q), b = __ldg(q + 1);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
    x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    uint4 u = __ldg((const uint4 *)((const uint16_t *)g + i));
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; j++) { /* little-endian: element 2j in the low half */
      x[2 * j] = zd__dev_grad_to_f32<GDT>((uint16_t)(w[j] & 0xffffu));
      x[2 * j + 1] = zd__dev_grad_to_f32<GDT>((uint16_t)(w[j] >> 16));
    }
  }
}

template <int PDT>
static __device__ __forceinline__ void store_param(void *param, uint64_t i, float p) {
  if (PDT == ZD_F32) ((float *)param)[i] = p;
  if (PDT == ZD_BF16) ((uint16_t *)param)[i] = zd__dev_f32_to_bf16(p);
}

template <int PDT>
static __device__ __forceinline__ void store_param8(void *param, uint64_t i, const float p[8]) {
  if (PDT == ZD_F32) {
    float4 *q = (float4 *)((float *)param + i);
    q[0] = make_float4(p[0], p[1], p[2], p[3]);
    q[1] = make_float4(p[4], p[5], p[6], p[7]);
  }
  if (PDT == ZD_BF16) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; j++)
      w[j] = (uint32_t)zd__dev_f32_to_bf16(p[2 * j]) |
             ((uint32_t)zd__dev_f32_to_bf16(p[2 * j + 1]) << 16);
    *(uint4 *)((uint16_t *)param + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

/* AMS: the model has max_exp_avg_sq; a group without amsgrad still leaves it alone. */
template <int GDT, int PDT, bool AMS>
static __device__ __forceinline__ void adam_one(const adam_kargs_t &a, uint64_t i, float scale,
                                                const zd__dev_group_t &k) {
  float g = load_grad<GDT>(a.grad, i);
  float p = a.master[i], m = a.exp_avg[i], v = a.exp_avg_sq[i];
  const bool ams = AMS && k.c.amsgrad;
  float x = ams ? a.max_exp_avg_sq[i] : 0.0f;
  zd__dev_adam(g, scale, k, p, m, v, x);
  a.master[i] = p;
  a.exp_avg[i] = m;
  a.exp_avg_sq[i] = v;
  if (ams) a.max_exp_avg_sq[i] = x;
  store_param<PDT>(a.param, i, p);
}

template <int GDT, int PDT, bool AMS>
static __device__ __forceinline__ void adam_eight(const adam_kargs_t &a, uint64_t i, float scale,
                                                  const zd__dev_group_t &k) {
  float4 *pq = (float4 *)(a.master + i), *mq = (float4 *)(a.exp_avg + i),
         *vq = (float4 *)(a.exp_avg_sq + i);
  float4 p0 = pq[0], p1 = pq[1], m0 = mq[0], m1 = mq[1], v0 = vq[0], v1 = vq[1];
  float g[8];
  load_grad8<GDT>(a.grad, i, g);
  float p[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
  float m[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
  float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
  float x[8] = {0};
  const bool ams = AMS && k.c.amsgrad;
  float4 *xq = ams ? (float4 *)(a.max_exp_avg_sq + i) : NULL;
  if (ams) {
    float4 x0 = xq[0], x1 = xq[1];
    x[0] = x0.x, x[1] = x0.y, x[2] = x0.z, x[3] = x0.w;
    x[4] = x1.x, x[5] = x1.y, x[6] = x1.z, x[7] = x1.w;
  }
#pragma unroll
  for (int j = 0; j < 8; j++) zd__dev_adam(g[j], scale, k, p[j], m[j], v[j], x[j]);
  if (ams) {
    xq[0] = make_float4(x[0], x[1], x[2], x[3]);
    xq[1] = make_float4(x[4], x[5], x[6], x[7]);
  }
  pq[0] = make_float4(p[0], p[1], p[2], p[3]);
  pq[1] = make_float4(p[4], p[5], p[6], p[7]);
  mq[0] = make_float4(m[0], m[1], m[2], m[3]);
  mq[1] = make_float4(m[4], m[5], m[6], m[7]);
  vq[0] = make_float4(v[0], v[1], v[2], v[3]);
  vq[1] = make_float4(v[4], v[5], v[6], v[7]);
  store_param8<PDT>(a.param, i, p);
}

/* GDT: ZD_F32, ZD_BF16, ZD_F16; PDT: 0 (no working parameters), ZD_F32, ZD_BF16; AMS: the model
 * has max_exp_avg_sq (a separate kernel, so that a model without it pays nothing). */
template <int GDT, int PDT, bool AMS>
__global__ void __launch_bounds__(ADAM_THREADS)
    adam_kernel(const __grid_constant__ adam_kargs_t a) {
  float scale = a.grad_scale;
  if (a.decision) { /* written by an earlier kernel of the stream: read once, at the start */
    if (a.decision->verdict != ZD__VERDICT_APPLY) return;
    scale = a.decision->dec.grad_scale;
  }
  const zd__adam_group_t *groups = a.d_groups ? a.d_groups : a.groups;
  for (uint64_t t = blockIdx.x; t < a.ntiles; t += gridDim.x) {
    const tile_t tile = a.tiles[t];
    const uint32_t gi = a.map ? a.map[tile.group] : tile.group;
    if (gi == ZD__CUDA_SKIP) continue; /* a parameter the step skips: left untouched */
    if (a.optimizers && !((a.optimizers >> groups[gi].optimizer) & 1u)) continue; /* another's */
    const zd__dev_group_t k = zd__dev_group(groups[gi]);
    const uint64_t lo = tile.start, hi = lo + tile.len;
    /* [lo, vlo) and [vhi, hi) element by element, [vlo, vhi) in vectors of 8. */
    uint64_t vlo = hi, vhi = hi;
    if (a.vec) {
      vlo = (lo + ADAM_VEC - 1) & ~(uint64_t)(ADAM_VEC - 1);
      if (vlo > hi) vlo = hi;
      vhi = vlo + ((hi - vlo) & ~(uint64_t)(ADAM_VEC - 1));
    }
    for (uint64_t i = lo + threadIdx.x; i < vlo; i += blockDim.x)
      adam_one<GDT, PDT, AMS>(a, i, scale, k);
    for (uint64_t i = vlo + (uint64_t)threadIdx.x * ADAM_VEC; i < vhi;
         i += (uint64_t)blockDim.x * ADAM_VEC)
      adam_eight<GDT, PDT, AMS>(a, i, scale, k);
    for (uint64_t i = vhi + threadIdx.x; i < hi; i += blockDim.x)
      adam_one<GDT, PDT, AMS>(a, i, scale, k);
  }
}

typedef void (*adam_kernel_fn)(adam_kargs_t);

template <int GDT, bool AMS>
static adam_kernel_fn adam_kernel_for(int pdt) {
  switch (pdt) {
    case ZD_F32:
      return adam_kernel<GDT, ZD_F32, AMS>;
    case ZD_BF16:
      return adam_kernel<GDT, ZD_BF16, AMS>;
    default:
      return adam_kernel<GDT, 0, AMS>;
  }
}

template <bool AMS>
static adam_kernel_fn adam_kernel_for(int gdt, int pdt) {
  return gdt == ZD_F32    ? adam_kernel_for<ZD_F32, AMS>(pdt)
         : gdt == ZD_BF16 ? adam_kernel_for<ZD_BF16, AMS>(pdt)
                          : adam_kernel_for<ZD_F16, AMS>(pdt);
}

static int aligned16(const void *p) {
  return ((uintptr_t)p & 15u) == 0;
}

/* The GPU has no rsqrtps: ZD_SQRT_MKL_EX, whose bits are an x86 CPU's, cannot run here (in a
 * group whose formula has a square root: SGD's and Lion's ignore sqrt_mode). And amsgrad needs
 * the max_exp_avg_sq array. Groups of optimizers outside `optimizers` (a mask; 0: all) are not
 * checked. */
static int check_groups(const zd__adam_group_t *groups, uint32_t n, int have_max,
                        uint32_t optimizers, const char *what, zd__err_t *err) {
  for (uint32_t i = 0; groups && i < n; i++) {
    if (optimizers && !((optimizers >> groups[i].optimizer) & 1u)) continue;
    const int sqrt_free = groups[i].optimizer == ZD_SGD || groups[i].optimizer == ZD_LION;
    if (groups[i].sqrt_mode != ZD_SQRT_EXACT && !sqrt_free)
      return zd__errf(err, ZD_EHPARAM,
                      "%s: group %u has sqrt_mode MKL_EX, the rsqrtps approximation of an x86 "
                      "CPU, which a GPU cannot reproduce; expected EXACT",
                      what, i);
    if (groups[i].amsgrad && !have_max)
      return zd__errf(err, -EINVAL, "%s: group %u has amsgrad but max_exp_avg_sq is NULL", what, i);
  }
  return ZD_OK;
}

int zd__cuda_adam_step(const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a,
                       cudaStream_t stream, zd__err_t *err) {
  if (!l || !a) return zd__errf(err, -EINVAL, "CUDA adam: no layout or no arguments");
  int rc = zd__check_stream(stream, "CUDA adam", err);
  if (rc) return rc;
  float *master = a->state[ZD__STATE_MASTER], *exp_avg = a->state[ZD__STATE_EXP_AVG];
  float *exp_avg_sq = a->state[ZD__STATE_EXP_AVG_SQ], *max_sq = a->state[ZD__STATE_MAX_EXP_AVG_SQ];
  if (!master || !exp_avg || !exp_avg_sq || !a->grad)
    return zd__errf(err, -EINVAL, "CUDA adam: master, exp_avg, exp_avg_sq and grad are required");
  if (!zd__dtype_ok(a->grad_dtype, ZD__DTYPE_GRAD))
    return zd__errf(err, ZD_EDTYPE, "CUDA adam: grad dtype %d; expected f32, bf16 or f16",
                    (int)a->grad_dtype);
  if (a->param && !zd__dtype_ok(a->param_dtype, ZD__DTYPE_PARAM))
    return zd__errf(err, ZD_EDTYPE, "CUDA adam: param dtype %d; expected f32 or bf16",
                    (int)a->param_dtype);
  if (!a->d_map && a->ngroups < l->ngroups)
    return zd__errf(err, -EINVAL, "CUDA adam: the segments use %u groups, %u given", l->ngroups,
                    a->ngroups);
  if (a->d_map && a->nmap < l->ngroups)
    return zd__errf(err, -EINVAL, "CUDA adam: the segments use %u map entries, %u given",
                    l->ngroups, a->nmap);
  if (!a->d_groups && a->ngroups > ZD__CUDA_GROUPS_INLINE)
    return zd__errf(err, -EINVAL,
                    "CUDA adam: %u groups; at most %d travel with the launch, pass more "
                    "in d_groups (zd__cuda_groups_upload)",
                    a->ngroups, ZD__CUDA_GROUPS_INLINE);
  if (!a->d_groups && a->ngroups && !a->groups)
    return zd__errf(err, -EINVAL, "CUDA adam: %u groups but neither groups nor d_groups",
                    a->ngroups);
  if (a->groups) { /* host groups (also where d_groups holds their device copy): checked */
    rc = check_groups(a->groups, a->ngroups, max_sq != NULL, a->optimizers, "CUDA adam", err);
    if (rc) return rc;
  }
  if (l->ntiles == 0) return ZD_OK; /* nothing covered */

  adam_kargs_t k;
  memset(&k, 0, sizeof k);
  k.master = master;
  k.exp_avg = exp_avg;
  k.exp_avg_sq = exp_avg_sq;
  k.max_exp_avg_sq = max_sq;
  k.grad = a->grad;
  k.param = a->param;
  k.tiles = l->d_tiles;
  k.ntiles = l->ntiles;
  k.grad_scale = a->grad_scale;
  k.decision = a->d_decision;
  k.map = a->d_map;
  k.optimizers = a->optimizers;
  k.d_groups = a->d_groups;
  if (!a->d_groups && a->ngroups) memcpy(k.groups, a->groups, a->ngroups * sizeof *a->groups);
  k.vec = aligned16(master) && aligned16(exp_avg) && aligned16(exp_avg_sq) &&
          (!max_sq || aligned16(max_sq)) && aligned16(a->grad) &&
          (!a->param || aligned16(a->param));
  int pdt = a->param ? (int)a->param_dtype : 0;
  adam_kernel_fn fn = max_sq ? adam_kernel_for<true>((int)a->grad_dtype, pdt)
                             : adam_kernel_for<false>((int)a->grad_dtype, pdt);
  fn<<<zd__cuda_adam_grid(l, a), ADAM_THREADS, 0, stream>>>(k);
  LAUNCH_CHECK(err, "CUDA adam: kernel launch");
  return ZD_OK;
}

unsigned zd__cuda_adam_grid(const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a) {
  if (!zd__dtype_ok(a->grad_dtype, ZD__DTYPE_GRAD)) return 0;
  if (a->param && !zd__dtype_ok(a->param_dtype, ZD__DTYPE_PARAM)) return 0;
  const int x = a->state[ZD__STATE_MAX_EXP_AVG_SQ] != NULL;
  return l->adam_grid[gdt_variant((int)a->grad_dtype)]
                     [pdt_variant(a->param ? (int)a->param_dtype : 0)][x];
}

typedef struct groups_kargs {
  zd__adam_group_t *dst;
  uint32_t n;
  zd__adam_group_t groups[ZD__CUDA_GROUPS_INLINE];
} groups_kargs_t;

__global__ void groups_kernel(const __grid_constant__ groups_kargs_t a) {
  for (uint32_t i = threadIdx.x; i < a.n; i += blockDim.x) a.dst[i] = a.groups[i];
}

int zd__cuda_groups_upload(zd__adam_group_t *d_groups, const zd__adam_group_t *groups, uint32_t n,
                           cudaStream_t stream, zd__err_t *err) {
  int rc = zd__check_stream(stream, "CUDA groups upload", err);
  if (rc) return rc;
  if (n && (!d_groups || !groups))
    return zd__errf(err, -EINVAL, "CUDA groups upload: %u groups but no source or destination", n);
  rc = check_groups(groups, n, 1, 0, "CUDA groups upload", err); /* the array is the launch's */
  if (rc) return rc;
  for (uint32_t done = 0; done < n; done += ZD__CUDA_GROUPS_INLINE) {
    groups_kargs_t k;
    memset(&k, 0, sizeof k);
    k.dst = d_groups + done;
    k.n = n - done < ZD__CUDA_GROUPS_INLINE ? n - done : ZD__CUDA_GROUPS_INLINE;
    memcpy(k.groups, groups + done, k.n * sizeof *groups);
    groups_kernel<<<1, ZD__CUDA_GROUPS_INLINE, 0, stream>>>(k);
    LAUNCH_CHECK(err, "CUDA groups upload: kernel launch");
  }
  return ZD_OK;
}

/* Map entries per launch of map_kernel: 4 KiB of arguments. */
#define MAP_INLINE 1024

typedef struct map_kargs {
  uint32_t *dst;
  uint32_t n;
  uint32_t map[MAP_INLINE];
} map_kargs_t;

__global__ void map_kernel(const __grid_constant__ map_kargs_t a) {
  for (uint32_t i = threadIdx.x; i < a.n; i += blockDim.x) a.dst[i] = a.map[i];
}

int zd__cuda_map_upload(uint32_t *d_map, const uint32_t *map, uint32_t n, cudaStream_t stream,
                        zd__err_t *err) {
  int rc = zd__check_stream(stream, "CUDA map upload", err);
  if (rc) return rc;
  if (n && (!d_map || !map))
    return zd__errf(err, -EINVAL, "CUDA map upload: %u entries but no source or destination", n);
  for (uint32_t done = 0; done < n; done += MAP_INLINE) {
    map_kargs_t k;
    memset(&k, 0, sizeof k);
    k.dst = d_map + done;
    k.n = n - done < MAP_INLINE ? n - done : MAP_INLINE;
    memcpy(k.map, map + done, k.n * sizeof *map);
    map_kernel<<<1, 256, 0, stream>>>(k);
    LAUNCH_CHECK(err, "CUDA map upload: kernel launch");
  }
  return ZD_OK;
}

/* ---- statistics ---------------------------------------------------------------------------- */

/* Grads pos..pos+3 (pos a multiple of 4): one vector when allowed, else element by element;
 * elements at or past end read as 0 and are not counted by the caller. */
template <int GDT>
static __device__ __forceinline__ void load_grad4(const void *g, uint64_t pos, uint64_t end,
                                                  int vec, float x[4]) {
  if (vec && pos + 4 <= end) {
    if (GDT == ZD_F32) {
      float4 f = __ldg((const float4 *)((const float *)g + pos));
      x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
    } else {
      uint2 u = __ldg((const uint2 *)((const uint16_t *)g + pos));
      x[0] = zd__dev_grad_to_f32<GDT>((uint16_t)(u.x & 0xffffu));
      x[1] = zd__dev_grad_to_f32<GDT>((uint16_t)(u.x >> 16));
      x[2] = zd__dev_grad_to_f32<GDT>((uint16_t)(u.y & 0xffffu));
      x[3] = zd__dev_grad_to_f32<GDT>((uint16_t)(u.y >> 16));
    }
    return;
  }
#pragma unroll
  for (int c = 0; c < 4; c++) x[c] = pos + c < end ? load_grad<GDT>(g, pos + c) : 0.0f;
}

/* lane += (double)x * (double)x, never fused; counts a non-finite x. */
static __device__ __forceinline__ void stats_add(double &lane, uint32_t &bad, float x) {
  double d = (double)x;
  lane = __dadd_rn(lane, __dmul_rn(d, d));
  bad += (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

template <int GDT>
__global__ void __launch_bounds__(STATS_THREADS)
    stats_kernel(const void *grad, uint64_t n, const seg_t *segs, uint32_t nsegs,
                 const uint32_t *first_seg, uint64_t nblocks, int vec, double *sums,
                 unsigned long long *counts) {
  const unsigned lane = threadIdx.x & 31, t = lane & 3;
  const uint64_t stride = (uint64_t)gridDim.x * STATS_PER_BLOCK;
  /* The loop bound is the same for a whole warp (8 statistics blocks), so every lane reaches the
   * shuffles below. */
  for (uint64_t base = (uint64_t)blockIdx.x * STATS_PER_BLOCK + (threadIdx.x >> 5) * 8;
       base < nblocks; base += stride) {
    const uint64_t kb = base + (lane >> 2);
    /* acc[c] is lane 4t + c of adam.h's sixteen. */
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    uint32_t bad = 0;
    if (kb < nblocks) {
      const uint64_t blo = kb * ZD__STATS_BLOCK;
      const uint64_t bhi = blo + ZD__STATS_BLOCK < n ? blo + ZD__STATS_BLOCK : n;
      uint32_t s = first_seg[kb];
      uint64_t slo = UINT64_MAX, shi = UINT64_MAX;
      if (s < nsegs) {
        slo = segs[s].lo;
        shi = segs[s].hi;
      }
      if (vec && slo <= blo && shi >= blo + ZD__STATS_BLOCK) {
        /* The whole block is one segment's (the common case): no per-element test, eight
         * vectors in flight per thread. */
        const uint64_t p0 = blo + 4 * t;
#pragma unroll 1
        for (int k = 0; k < ZD__STATS_BLOCK / 16; k += 8) {
          float x[8][4];
#pragma unroll
          for (int u = 0; u < 8; u++)
            load_grad4<GDT>(grad, p0 + 16 * (uint64_t)(k + u), UINT64_MAX, 1, x[u]);
#pragma unroll
          for (int u = 0; u < 8; u++)
#pragma unroll
            for (int c = 0; c < 4; c++) stats_add(acc[c], bad, x[u][c]);
        }
      } else if (slo < bhi) {
        /* Segment edges inside the block: walk the segments along with the elements (each
         * thread's elements increase, so the walk only moves forward). A block that no segment
         * reaches (padding only) reads nothing and sums to 0. */
        for (uint64_t pos = blo + 4 * t; pos < bhi; pos += 16) {
          float x[4];
          load_grad4<GDT>(grad, pos, bhi, vec, x);
#pragma unroll
          for (int c = 0; c < 4; c++) {
            const uint64_t i = pos + c;
            if (i >= bhi) break;
            while (i >= shi) {
              if (++s < nsegs) {
                slo = segs[s].lo;
                shi = segs[s].hi;
              } else {
                slo = shi = UINT64_MAX;
              }
            }
            if (i >= slo) stats_add(acc[c], bad, x[c]);
          }
        }
      }
    }
    /* s8[j] = lane[j] + lane[j+8]: threads 0, 1 hold s8[4t + c]. */
    double s8[4], s4[4];
#pragma unroll
    for (int c = 0; c < 4; c++) s8[c] = __dadd_rn(acc[c], __shfl_down_sync(FULL_MASK, acc[c], 2));
      /* s4[j] = s8[j] + s8[j+4]: thread 0 holds s4[c]. */
#pragma unroll
    for (int c = 0; c < 4; c++) s4[c] = __dadd_rn(s8[c], __shfl_down_sync(FULL_MASK, s8[c], 1));
    const double sum = __dadd_rn(__dadd_rn(s4[0], s4[2]), __dadd_rn(s4[1], s4[3]));
    bad += __shfl_down_sync(FULL_MASK, bad, 2);
    bad += __shfl_down_sync(FULL_MASK, bad, 1);
    if (t == 0 && kb < nblocks) {
      sums[kb] = sum;
      counts[kb] = bad;
    }
  }
}

/* ---- the block sums, pairwise by levels --------------------------------------------------- */

/* The level-order sum (adam.h) of x[0..m), m <= TREE_CHUNK, and the total of c[0..m) (integers:
 * any order), into *sum and *count of thread 0. Every thread of the block (TREE_THREADS) calls
 * it. A value at position p of the chunk is the sum of the complete subtree of width w starting
 * there; it takes in its right neighbour at p + w when that starts before m, as the level rule
 * does (x'[i] = x[2i] + x[2i+1], or x[2i] when 2i+1 is past the end). */
static __device__ __forceinline__ void block_tree(const double *x, const unsigned long long *c,
                                                  uint64_t m, double *sum,
                                                  unsigned long long *count) {
  __shared__ double warp_sum[TREE_THREADS / 32];
  __shared__ unsigned long long warp_count[TREE_THREADS / 32];
  const unsigned t = threadIdx.x, lane = t & 31, w = t >> 5;
  const uint64_t base = (uint64_t)t * TREE_PER_THREAD;
  double v[TREE_PER_THREAD];
  unsigned long long k = 0;
#pragma unroll
  for (int j = 0; j < TREE_PER_THREAD; j++) {
    v[j] = base + j < m ? x[base + j] : 0.0;
    k += base + j < m ? c[base + j] : 0ull;
  }
  /* Widths 1, 2, 4 in registers: this thread's 8 values become one of width 8 at base. */
#pragma unroll
  for (int h = 1; h < TREE_PER_THREAD; h *= 2)
#pragma unroll
    for (int j = 0; j < TREE_PER_THREAD; j += 2 * h)
      if (base + j + h < m) v[j] = __dadd_rn(v[j], v[j + h]);
  /* Widths 8 .. 128 across the warp: lane l's value starts at base; after the step with offset o
   * the lanes that are multiples of 2o hold widths 16o. */
  double s = v[0];
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const double r = __shfl_down_sync(FULL_MASK, s, o);
    if ((lane & (2 * o - 1)) == 0 && base + (uint64_t)o * TREE_PER_THREAD < m) s = __dadd_rn(s, r);
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) k += __shfl_down_sync(FULL_MASK, k, o);
  if (lane == 0) {
    warp_sum[w] = s; /* width 256, starting at 256 w */
    warp_count[w] = k;
  }
  __syncthreads();
  if (t == 0) {
    double y[TREE_THREADS / 32];
    unsigned long long total = 0;
#pragma unroll
    for (int j = 0; j < TREE_THREADS / 32; j++) {
      y[j] = warp_sum[j];
      total += warp_count[j];
    }
    /* Widths 256, 512, 1024. */
#pragma unroll
    for (int h = 1; h < TREE_THREADS / 32; h *= 2)
#pragma unroll
      for (int j = 0; j < TREE_THREADS / 32; j += 2 * h)
        if ((uint64_t)(j + h) * 32 * TREE_PER_THREAD < m) y[j] = __dadd_rn(y[j], y[j + h]);
    *sum = y[0];
    *count = total;
  }
}

/* One level of chunks: block b adds values [b * TREE_CHUNK, + TREE_CHUNK) of m. */
__global__ void __launch_bounds__(TREE_THREADS)
    tree_level(const double *x, const unsigned long long *c, uint64_t m, double *out,
               unsigned long long *out_count) {
  const uint64_t lo = (uint64_t)blockIdx.x * TREE_CHUNK;
  const uint64_t len = m - lo < TREE_CHUNK ? m - lo : TREE_CHUNK;
  double s;
  unsigned long long k;
  block_tree(x + lo, c + lo, len, &s, &k);
  if (threadIdx.x == 0) {
    out[blockIdx.x] = s;
    out_count[blockIdx.x] = k;
  }
}

typedef struct fin_kargs {
  const double *sums; /* the last level: at most TREE_CHUNK values */
  const unsigned long long *counts;
  uint64_t m;
  zd__cuda_stats_t *out;
  int accumulate;
  int set_tags;
  uint64_t tags[ZD__CUDA_TAGS];
} fin_kargs_t;

/* One block: the last level, then the record as this call leaves it, sealed with its check word
 * (step_decide.h), written whole. */
__global__ void __launch_bounds__(TREE_THREADS) stats_finalize(const fin_kargs_t a) {
  double s;
  unsigned long long k;
  block_tree(a.sums, a.counts, a.m, &s, &k);
  if (threadIdx.x == 0) {
    zd__cuda_stats_t r = *a.out;
    r.sumsq = a.accumulate ? __dadd_rn(r.sumsq, s) : s;
    r.nonfinite = a.accumulate ? r.nonfinite + k : k;
    if (a.set_tags)
      for (int j = 0; j < ZD__CUDA_TAGS; j++) r.tags[j] = a.tags[j];
    r.check = zd__record_check(&r);
    *a.out = r;
  }
}

/* The tree over the layout's block sums and counts, then the record. */
static int sum_blocks(zd__cuda_layout_t *l, zd__cuda_stats_t *d_out, int accumulate,
                      const uint64_t *tags, cudaStream_t stream, zd__err_t *err) {
  const double *x = l->d_sums;
  const unsigned long long *c = l->d_counts;
  uint64_t m = l->nblocks, used = 0;
  while (m > TREE_CHUNK) {
    const uint64_t chunks = (m + TREE_CHUNK - 1) / TREE_CHUNK;
    /* used + chunks <= l->npartial: tree_partials counted these levels */
    tree_level<<<(unsigned)chunks, TREE_THREADS, 0, stream>>>(x, c, m, l->d_partial + used,
                                                              l->d_pcounts + used);
    LAUNCH_CHECK(err, "CUDA grad stats: tree kernel launch");
    x = l->d_partial + used;
    c = l->d_pcounts + used;
    used += chunks;
    m = chunks;
  }
  fin_kargs_t k;
  memset(&k, 0, sizeof k);
  k.sums = x;
  k.counts = c;
  k.m = m;
  k.out = d_out;
  k.accumulate = accumulate != 0;
  k.set_tags = tags != NULL;
  if (tags) memcpy(k.tags, tags, sizeof k.tags);
  stats_finalize<<<1, TREE_THREADS, 0, stream>>>(k);
  LAUNCH_CHECK(err, "CUDA grad stats: finalize kernel launch");
  return ZD_OK;
}

int zd__cuda_grad_stats(zd__cuda_layout_t *l, const void *grad, zd_dtype_t grad_dtype,
                        zd__cuda_stats_t *d_out, int accumulate, const uint64_t *tags,
                        cudaStream_t stream, zd__err_t *err) {
  if (!l || !d_out) return zd__errf(err, -EINVAL, "CUDA grad stats: no layout or no output");
  int rc = zd__check_stream(stream, "CUDA grad stats", err);
  if (rc) return rc;
  if (!zd__dtype_ok(grad_dtype, ZD__DTYPE_GRAD))
    return zd__errf(err, ZD_EDTYPE, "CUDA grad stats: grad dtype %d; expected f32, bf16 or f16",
                    (int)grad_dtype);
  if (l->nblocks && !grad) return zd__errf(err, -EINVAL, "CUDA grad stats: no gradients");
  if (l->nblocks) {
    int vec = grad_dtype == ZD_F32 ? aligned16(grad) : ((uintptr_t)grad & 7u) == 0;
    const unsigned grid = l->stats_grid[gdt_variant((int)grad_dtype)];
    switch (grad_dtype) {
      case ZD_BF16:
        stats_kernel<ZD_BF16><<<grid, STATS_THREADS, 0, stream>>>(grad, l->n, l->d_segs, l->nsegs,
                                                                  l->d_first_seg, l->nblocks, vec,
                                                                  l->d_sums, l->d_counts);
        break;
      case ZD_F16:
        stats_kernel<ZD_F16><<<grid, STATS_THREADS, 0, stream>>>(grad, l->n, l->d_segs, l->nsegs,
                                                                 l->d_first_seg, l->nblocks, vec,
                                                                 l->d_sums, l->d_counts);
        break;
      default:
        stats_kernel<ZD_F32><<<grid, STATS_THREADS, 0, stream>>>(grad, l->n, l->d_segs, l->nsegs,
                                                                 l->d_first_seg, l->nblocks, vec,
                                                                 l->d_sums, l->d_counts);
        break;
    }
    LAUNCH_CHECK(err, "CUDA grad stats: block kernel launch");
  }
  return sum_blocks(l, d_out, accumulate, tags, stream, err);
}

int zd__cuda_stats_sum(zd__cuda_layout_t *l, zd__cuda_stats_t *d_out, int accumulate,
                       const uint64_t *tags, cudaStream_t stream, zd__err_t *err) {
  if (!l || !d_out) return zd__errf(err, -EINVAL, "CUDA stats sum: no layout or no output");
  int rc = zd__check_stream(stream, "CUDA stats sum", err);
  if (rc) return rc;
  return sum_blocks(l, d_out, accumulate, tags, stream, err);
}

/* ---- grids --------------------------------------------------------------------------------- */

/* Blocks of kernel fn (threads each) that fit on every SM at once, times the SMs: one wave. At
 * least 1 (a kernel that fits nowhere fails at its launch, with CUDA's reason). */
template <typename F>
static cudaError_t wave(F fn, int threads, int sms, uint64_t *out) {
  int per_sm = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, 0);
  *out = (uint64_t)(per_sm > 0 ? per_sm : 1) * (uint64_t)sms;
  return e;
}

static unsigned at_most(uint64_t cap, uint64_t want) {
  return (unsigned)(want < cap ? want : cap);
}

static cudaError_t size_grids(zd__cuda_layout_t *l, int sms) {
  static const int gdts[GDT_VARIANTS] = {ZD_F32, ZD_BF16, ZD_F16};
  static const int pdts[PDT_VARIANTS] = {ZD_F32, ZD_BF16, 0};
  const uint64_t stats_want = (l->nblocks + STATS_PER_BLOCK - 1) / STATS_PER_BLOCK;
  uint64_t cap = 0;
  cudaError_t e = cudaSuccess;
  for (int g = 0; g < GDT_VARIANTS && e == cudaSuccess; g++) {
    for (int p = 0; p < PDT_VARIANTS && e == cudaSuccess; p++) {
      e = wave(adam_kernel_for<false>(gdts[g], pdts[p]), ADAM_THREADS, sms, &cap);
      l->adam_grid[g][p][0] = at_most(cap, l->ntiles);
      if (e == cudaSuccess)
        e = wave(adam_kernel_for<true>(gdts[g], pdts[p]), ADAM_THREADS, sms, &cap);
      l->adam_grid[g][p][1] = at_most(cap, l->ntiles);
    }
    if (e != cudaSuccess) break;
    e = wave(g == 0   ? stats_kernel<ZD_F32>
             : g == 1 ? stats_kernel<ZD_BF16>
                      : stats_kernel<ZD_F16>,
             STATS_THREADS, sms, &cap);
    l->stats_grid[g] = at_most(cap, stats_want);
  }
  return e;
}

/* ---- loading ------------------------------------------------------------------------------- */

/* cudaFuncGetAttributes loads a kernel's module. With lazy loading (the default since CUDA 12.2)
 * a kernel is otherwise loaded at its first launch, which takes the context's lock and waits for
 * the device's queued work: behind a wait for a client's event or a peer's collective, the first
 * step could stall (and the loop thread's IPC calls on that GPU with it). */
template <typename F>
static cudaError_t load(F *fn) {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, fn);
}

template <int GDT>
static cudaError_t load_adam() {
  cudaError_t e = load(adam_kernel<GDT, ZD_F32, false>);
  if (e == cudaSuccess) e = load(adam_kernel<GDT, ZD_BF16, false>);
  if (e == cudaSuccess) e = load(adam_kernel<GDT, 0, false>);
  if (e == cudaSuccess) e = load(adam_kernel<GDT, ZD_F32, true>);
  if (e == cudaSuccess) e = load(adam_kernel<GDT, ZD_BF16, true>);
  if (e == cudaSuccess) e = load(adam_kernel<GDT, 0, true>);
  if (e == cudaSuccess) e = load(stats_kernel<GDT>);
  return e;
}

int zd__cuda_kernels_preload(zd__err_t *err) {
  cudaError_t e = load_adam<ZD_F32>();
  if (e == cudaSuccess) e = load_adam<ZD_BF16>();
  if (e == cudaSuccess) e = load_adam<ZD_F16>();
  if (e == cudaSuccess) e = load(groups_kernel);
  if (e == cudaSuccess) e = load(map_kernel);
  if (e == cudaSuccess) e = load(tree_level);
  if (e == cudaSuccess) e = load(stats_finalize);
  if (e == cudaSuccess) e = zd__cuda_decide_preload();
  if (e == cudaSuccess) e = zd__cuda_optim_preload();
  if (e == cudaSuccess) return ZD_OK;
  (void)cudaGetLastError();
  return zd__cuda_errf(err, e, "loading the optimizer kernels (cudaFuncGetAttributes)");
}
