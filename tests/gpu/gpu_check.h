/* Helpers of the GPU tests (tests/gpu) and the CUDA benchmark: skip without a usable GPU, abort on
 * a CUDA error with the call and file:line, a fixed-seed PRNG, bit views of floats. Tests may
 * abort; the library never does. */
#ifndef ZD_TESTS_GPU_CHECK_H
#define ZD_TESTS_GPU_CHECK_H

#include <cuda_runtime_api.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adam_cuda.h"
#include "check.h"

#define CUDA_CHECK(call)                                                                         \
  do {                                                                                           \
    cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_), \
              cudaGetErrorName(e_));                                                             \
      exit(1);                                                                                   \
    }                                                                                            \
  } while (0)

/* The error of the last library call, for ZD_CHECK. */
static zd__err_t gpu_err __attribute__((unused));

/* expr returns a zerod code and fills gpu_err; anything but ZD_OK fails the test. */
#define ZD_CHECK(expr)                                                                    \
  do {                                                                                    \
    memset(&gpu_err, 0, sizeof gpu_err);                                                  \
    int rc_ = (expr);                                                                     \
    if (rc_ != ZD_OK) {                                                                   \
      fprintf(stderr, "%s:%d: %s returned %d (%s): %s\n", __FILE__, __LINE__, #expr, rc_, \
              zd_err_name(rc_), gpu_err.msg);                                             \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

/* Exits 77 (meson: skipped) with the reason when no GPU can run the kernels; else selects device
 * 0 and prints what it is. */
static inline void gpu_or_skip(const char *prog) {
  char why[1024];
  if (zd__cuda_available(why, sizeof why) == 0) {
    printf("%s: skipped, CUDA unusable: %s\n", prog, why);
    exit(ZD_TEST_SKIP);
  }
  CUDA_CHECK(cudaSetDevice(0));
  struct cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int drv = 0, rt = 0;
  CUDA_CHECK(cudaDriverGetVersion(&drv));
  CUDA_CHECK(cudaRuntimeGetVersion(&rt));
  printf(
      "%s: GPU 0 %s, compute capability %d.%d, %d SMs, %.1f GiB; driver CUDA %d.%d, runtime "
      "%d.%d\n",
      prog, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
      (double)prop.totalGlobalMem / (1 << 30), drv / 1000, drv % 1000 / 10, rt / 1000,
      rt % 1000 / 10);
}

#endif /* ZD_TESTS_GPU_CHECK_H */
