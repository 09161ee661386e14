/* Helpers the CUDA launchers of kernels/ share (adam.cu, decide.cu): the check after a launch,
 * the refusal of the legacy default stream, and the loading of decide.cu's kernels by
 * zd__cuda_kernels_preload. Internal: included by the .cu files of kernels/ only. */
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

/* Loads decide.cu's kernels (cudaFuncGetAttributes): part of zd__cuda_kernels_preload. */
cudaError_t zd__cuda_decide_preload(void);

#endif /* ZD_KERNELS_LAUNCH_CUH */
