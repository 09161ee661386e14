/* The reduction kernel of the in-process group communicator (comm_cuda_group.c): ranks of one
 * zerod that share a GPU sum their gradients by reading each other's buffers directly, all of
 * them device memory of one process on one device.
 *
 * CUDA builds only (group_cuda.cu). Queued on the caller's stream; no host synchronisation.
 */
#ifndef ZD_DAEMON_GROUP_CUDA_H
#define ZD_DAEMON_GROUP_CUDA_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "zerod/zerod.h"

#ifdef __cplusplus
extern "C" {
#endif

#include "error.h"

/* The most ranks a group reduces (the kernel holds one value per rank in registers). */
#define ZD__GROUP_REDUCE_MAX 64

/* dst[i] = the sum over r < nsrc of src[r][offset + i] (elements of dtype), for i < n, in fp32:
 * every value is converted to fp32 (exactly) and the nsrc values are added as a pairwise tree in
 * rank order ((s0 + s1) + (s2 + s3) for four; (s0 + s1) + s2 for three), each addition rounded on
 * its own. The order is fixed, so every run gives the same bits; with a power-of-two nsrc and
 * equal inputs every addition doubles, exactly. Errors: -EINVAL (nsrc out
 * of 1..ZD__GROUP_REDUCE_MAX), ZD_EDTYPE, ZD_EBACKEND (the launch failed). */
int zd__cuda_group_reduce(const void *const *src, uint32_t nsrc, zd_dtype_t dtype, uint64_t offset,
                          uint64_t n, float *dst, cudaStream_t stream, zd__err_t *err);

/* Loads the kernel on the current device now, while nothing is queued (exchange_cuda.h says why:
 * a lazily loaded module's first launch waits for the device's queued work). Errors:
 * ZD_EBACKEND. */
int zd__cuda_group_preload(zd__err_t *err);

#ifdef __cplusplus
}
#endif

#endif /* ZD_DAEMON_GROUP_CUDA_H */
