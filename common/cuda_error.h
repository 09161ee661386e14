/* A failed CUDA runtime call as a zerod error, the same way everywhere CUDA is called (the
 * daemon's CUDA backend, the kernels' launchers, libzerod's device buffers): -ENOMEM for
 * cudaErrorMemoryAllocation, ZD_EBACKEND for anything else, and a message that ends in CUDA's
 * own words, "<what>: out of memory (cudaErrorMemoryAllocation)".
 * Header-only, for files compiled with the CUDA runtime's headers: include <cuda_runtime_api.h>
 * first. */
#ifndef ZD_COMMON_CUDA_ERROR_H
#define ZD_COMMON_CUDA_ERROR_H

#include <errno.h>

#include "error.h"

/* The error code of CUDA error e (not cudaSuccess). */
static inline int zd__cuda_code(cudaError_t e) {
  return e == cudaErrorMemoryAllocation ? -ENOMEM : ZD_EBACKEND;
}

/* Sets err (may be NULL) to "<what>: <CUDA's string> (<its name>)" and returns zd__cuda_code(e). */
static inline int zd__cuda_errf(zd__err_t *err, cudaError_t e, const char *what) {
  return zd__errf(err, zd__cuda_code(e), "%s: %s (%s)", what, cudaGetErrorString(e),
                  cudaGetErrorName(e));
}

#endif /* ZD_COMMON_CUDA_ERROR_H */
