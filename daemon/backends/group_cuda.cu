/* The group communicator's reduction kernel (group_cuda.h). */
#include <errno.h>

#include "adam.cuh" /* zd__dev_bf16_to_f32, zd__dev_f16_to_f32: adam.h's conversions */
#include "group_cuda.h"

#define THREADS    256
#define MAX_BLOCKS 2048

/* The senders' buffers, by value (64 pointers: 512 bytes of kernel parameters). */
struct group_src {
  const void *p[ZD__GROUP_REDUCE_MAX];
};

template <zd_dtype_t T>
static __device__ __forceinline__ float load_f32(const void *base, uint64_t i) {
  if (T == ZD_F32) return ((const float *)base)[i];
  if (T == ZD_BF16) return zd__dev_bf16_to_f32(((const uint16_t *)base)[i]);
  return zd__dev_f16_to_f32(((const uint16_t *)base)[i]);
}

/* Every index below is a compile-time constant once the loops are unrolled, so v stays in
 * registers; the guards against nsrc are uniform across the block. */
template <zd_dtype_t T>
__global__ void __launch_bounds__(THREADS)
    group_reduce_kernel(group_src src, uint32_t nsrc, uint64_t offset, uint64_t n, float *dst) {
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x) {
    float v[ZD__GROUP_REDUCE_MAX];
#pragma unroll
    for (uint32_t r = 0; r < ZD__GROUP_REDUCE_MAX; r++)
      if (r < nsrc) v[r] = load_f32<T>(src.p[r], offset + i);
        /* The pairwise tree: at stride s, v[r] += v[r + s] for r a multiple of 2s. */
#pragma unroll
    for (uint32_t s = 1; s < ZD__GROUP_REDUCE_MAX; s *= 2)
#pragma unroll
      for (uint32_t r = 0; r + s < ZD__GROUP_REDUCE_MAX; r += 2 * s)
        if (r + s < nsrc) v[r] = __fadd_rn(v[r], v[r + s]);
    dst[i] = v[0];
  }
}

extern "C" int zd__cuda_group_reduce(const void *const *src, uint32_t nsrc, zd_dtype_t dtype,
                                     uint64_t offset, uint64_t n, float *dst, cudaStream_t stream,
                                     zd__err_t *err) {
  if (nsrc < 1 || nsrc > ZD__GROUP_REDUCE_MAX)
    return zd__errf(err, -EINVAL, "group reduce: %u senders; expected 1 to %d", nsrc,
                    ZD__GROUP_REDUCE_MAX);
  if (!n) return ZD_OK;
  group_src s = {};
  for (uint32_t r = 0; r < nsrc; r++) s.p[r] = src[r];
  uint64_t blocks = (n + THREADS - 1) / THREADS;
  unsigned grid = (unsigned)(blocks < MAX_BLOCKS ? blocks : MAX_BLOCKS);
  switch (dtype) {
    case ZD_F32:
      group_reduce_kernel<ZD_F32><<<grid, THREADS, 0, stream>>>(s, nsrc, offset, n, dst);
      break;
    case ZD_BF16:
      group_reduce_kernel<ZD_BF16><<<grid, THREADS, 0, stream>>>(s, nsrc, offset, n, dst);
      break;
    case ZD_F16:
      group_reduce_kernel<ZD_F16><<<grid, THREADS, 0, stream>>>(s, nsrc, offset, n, dst);
      break;
    default:
      return zd__errf(err, ZD_EDTYPE, "group reduce: dtype %d", (int)dtype);
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return zd__errf(err, ZD_EBACKEND, "group reduce kernel launch: %s (%s)", cudaGetErrorString(e),
                    cudaGetErrorName(e));
  return ZD_OK;
}

extern "C" int zd__cuda_group_preload(zd__err_t *err) {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, group_reduce_kernel<ZD_F32>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, group_reduce_kernel<ZD_BF16>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, group_reduce_kernel<ZD_F16>);
  if (e == cudaSuccess) return ZD_OK;
  (void)cudaGetLastError();
  return zd__errf(err, ZD_EBACKEND, "loading the group reduce kernel: %s (%s)",
                  cudaGetErrorString(e), cudaGetErrorName(e));
}
