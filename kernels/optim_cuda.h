/* CUDA kernels of the optimizers' table other than Adam's (kernels/optim.h; Adam's are
 * adam_cuda.h's): SGD (sgd.c) and Adagrad (adagrad.c), each element by the formula of its CPU
 * reference file, which the device computes with the host's rounding (the CUDA arguments of the
 * root meson.build: -fmad=false, IEEE division and sqrt; fmaf where the formula fuses).
 *
 * Not wired into the CUDA backend yet: compute_cuda.c refuses groups of these optimizers (its
 * update is adam_cuda.h's, with the step decision, the layout's grids and the record); this entry
 * point is the kernels and their test (tests/gpu/test_optim_cuda.cu) against the scalar
 * reference. Its layout is a plain segment list in device memory; each element finds its segment
 * by binary search (not tuned: a first kernel).
 */
#ifndef ZD_KERNELS_OPTIM_CUDA_H
#define ZD_KERNELS_OPTIM_CUDA_H

#include <cuda_runtime.h>
#include <math.h> /* before extern "C": C++ math.h holds templates */
#include <stdint.h>
#include <string.h>

#include "zerod/zerod.h"

#ifdef __cplusplus
extern "C" {
#endif

#include "adam.h"
#include "error.h"

/* The update of elements [0, n) covered by d_segs (device, nsegs sorted segments): the groups'
 * constants (host memory, ngroups <= ZD__CUDA_OPTIM_GROUPS, copied into the launch) name SGD or
 * Adagrad; state arrays, grad and param (device) as zd__adam_args_t's, in place (src ignored).
 * Errors: -EINVAL (a group of another optimizer, too many groups, a missing array), ZD_EHPARAM
 * (sqrt_mode ZD_SQRT_MKL_EX, which the GPU cannot reproduce), ZD_EDTYPE, ZD_EBACKEND. */
#define ZD__CUDA_OPTIM_GROUPS 16
int zd__cuda_optim_step(const zd__adam_args_t *a, const zd__segment_t *d_segs, uint32_t nsegs,
                        uint32_t ngroups, uint64_t n, cudaStream_t stream, zd__err_t *err);

#ifdef __cplusplus
}
#endif

#endif /* ZD_KERNELS_OPTIM_CUDA_H */
