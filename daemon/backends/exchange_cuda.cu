/* Master weights <-> working parameters on the GPU (exchange_cuda.h). */
#include "adam.cuh" /* zd__dev_f32_to_bf16, zd__dev_bf16_to_f32: adam.h's conversions */
#include "exchange_cuda.h"

#define THREADS    256
#define MAX_BLOCKS 1024

template <bool TO_CLIENT, bool BF16>
__global__ void exchange_kernel(float *master, void *param, uint64_t begin, uint64_t end) {
  for (uint64_t i = begin + (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < end;
       i += (uint64_t)gridDim.x * blockDim.x) {
    if (BF16) {
      uint16_t *p = (uint16_t *)param;
      if (TO_CLIENT)
        p[i] = zd__dev_f32_to_bf16(master[i]);
      else
        master[i] = zd__dev_bf16_to_f32(p[i]);
    } else {
      float *p = (float *)param;
      if (TO_CLIENT)
        p[i] = master[i];
      else
        master[i] = p[i];
    }
  }
}

template <bool TO_CLIENT, bool BF16>
static void launch(float *master, void *param, uint64_t begin, uint64_t end, cudaStream_t s) {
  uint64_t blocks = (end - begin + THREADS - 1) / THREADS;
  exchange_kernel<TO_CLIENT, BF16>
      <<<(unsigned)(blocks < MAX_BLOCKS ? blocks : MAX_BLOCKS), THREADS, 0, s>>>(master, param,
                                                                                 begin, end);
}

extern "C" int zd__cuda_exchange(float *master, void *param, zd_dtype_t param_dtype,
                                 const zd__segment_t *segs, uint32_t nsegs, int to_client,
                                 cudaStream_t stream, zd__err_t *err) {
  if (!zd__dtype_ok(param_dtype, ZD__DTYPE_PARAM))
    return zd__errf(err, ZD_EDTYPE, "exchange: param dtype %d; expected f32 or bf16",
                    (int)param_dtype);
  bool bf16 = param_dtype == ZD_BF16;
  for (uint32_t s = 0; s < nsegs;) {
    uint64_t begin = segs[s].offset, end = begin + segs[s].length;
    for (s++; s < nsegs && segs[s].offset == end; s++) end += segs[s].length; /* one run */
    if (begin == end) continue;
    if (to_client)
      bf16 ? launch<true, true>(master, param, begin, end, stream)
           : launch<true, false>(master, param, begin, end, stream);
    else
      bf16 ? launch<false, true>(master, param, begin, end, stream)
           : launch<false, false>(master, param, begin, end, stream);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
      return zd__errf(err, ZD_EBACKEND, "exchange kernel launch: %s (%s)", cudaGetErrorString(e),
                      cudaGetErrorName(e));
  }
  return ZD_OK;
}

template <bool TO_CLIENT, bool BF16>
static cudaError_t preload_one() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, exchange_kernel<TO_CLIENT, BF16>);
}

extern "C" int zd__cuda_exchange_preload(zd__err_t *err) {
  cudaError_t e = preload_one<true, true>();
  if (e == cudaSuccess) e = preload_one<true, false>();
  if (e == cudaSuccess) e = preload_one<false, true>();
  if (e == cudaSuccess) e = preload_one<false, false>();
  if (e == cudaSuccess) return ZD_OK;
  (void)cudaGetLastError();
  return zd__errf(err, ZD_EBACKEND, "loading the exchange kernels: %s (%s)", cudaGetErrorString(e),
                  cudaGetErrorName(e));
}
