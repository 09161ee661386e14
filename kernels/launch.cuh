/* Helpers the CUDA launchers of kernels/ share (adam.cu, decide.cu, optim.cu): the check after a
 * launch, the refusal of the legacy default stream, the layout's tables, and the loading of
 * decide.cu's and optim.cu's kernels by zd__cuda_kernels_preload. Internal: included by the .cu
 * files of kernels/ only. */
#ifndef ZD_KERNELS_LAUNCH_CUH
#define ZD_KERNELS_LAUNCH_CUH

#include <cuda_runtime.h>
#include <errno.h>

#include "adam_cuda.h"
#include "cuda_error.h"

/* After every launch: configuration errors show here, the kernel's own errors later. */
#define LAUNCH_CHECK(err, what)                                 \
  do {                                                          \
    cudaError_t e_ = cudaGetLastError();                        \
    if (e_ != cudaSuccess) return zd__cuda_errf(err, e_, what); \
  } while (0)

/* NULL and cudaStreamLegacy both name the legacy default stream. cudaStreamPerThread is a
 * stream of the calling thread's own and is accepted. */
static inline int zd__check_stream(cudaStream_t stream, const char *who, zd__err_t *err) {
  if (stream && stream != cudaStreamLegacy) return ZD_OK;
  return zd__errf(err, -EINVAL,
                  "%s: stream is the legacy default stream (%s), which serialises with "
                  "every other stream; pass a stream of your own (cudaStreamNonBlocking)",
                  who, stream ? "cudaStreamLegacy" : "NULL");
}

/* The layout's tables (adam_cuda.h, zd__cuda_layout_create in adam.cu), which the update
 * kernels of every family walk (adam.cu, optim.cu). */
#define GDT_VARIANTS 3 /* f32, bf16, f16 */
#define PDT_VARIANTS 3 /* f32, bf16, none */

typedef struct tile {
  uint64_t start; /* offset in the range */
  uint32_t len;   /* 1..ZD__CUDA_TILE */
  uint32_t group;
} tile_t;

typedef struct seg {
  uint64_t lo, hi; /* [lo, hi) */
} seg_t;

struct zd__cuda_layout {
  uint64_t n;
  uint64_t ntiles;
  uint64_t nblocks; /* statistics blocks */
  uint32_t nsegs;
  uint32_t ngroups; /* highest group index + 1 */
  int sms;          /* the device's multiprocessors (the other families' grids: optim.cu) */
  /* The grids of the kernels' variants (size_grids): [grad][param][max_exp_avg_sq], [grad]. */
  unsigned adam_grid[GDT_VARIANTS][PDT_VARIANTS][2];
  unsigned stats_grid[GDT_VARIANTS];
  uint64_t npartial; /* the tree's partial sums over all its levels of chunks */
  tile_t *d_tiles;
  seg_t *d_segs;
  uint32_t *d_first_seg;         /* per statistics block: first segment ending after its start */
  double *d_sums;                /* per statistics block */
  unsigned long long *d_counts;  /* per statistics block: non-finite gradients */
  double *d_partial;             /* the tree's partial sums (npartial) */
  unsigned long long *d_pcounts; /* ... and counts */
};

/* Loads decide.cu's kernels (cudaFuncGetAttributes): part of zd__cuda_kernels_preload. */
cudaError_t zd__cuda_decide_preload(void);

/* Loads optim.cu's kernels (every family of the table but Adam's) and notes their occupancy:
 * part of zd__cuda_kernels_preload. */
cudaError_t zd__cuda_optim_preload(void);

#endif /* ZD_KERNELS_LAUNCH_CUH */
