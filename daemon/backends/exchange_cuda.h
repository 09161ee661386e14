/* The copy between a rank's fp32 master weights and the client's working parameters on the GPU
 * (exchange_cuda.cu): at registration, the client's initial values become the master weights, or
 * (resuming) the master weights are written back as working parameters. Only covered elements
 * (the segments of a bucket's shard) are touched, as on the CPU; bf16 conversions are those of
 * kernels/adam.h (round to nearest even, NaN to 0x7fc0), bit for bit, and the same device
 * function (adam.cuh's zd__dev_f32_to_bf16) as the update kernel's parameter store: master to
 * param gives the bits that update wrote (the stand-in's scratch relies on it, compute.h).
 *
 * CUDA builds only. Queued on `stream`; registration and stand-ins only, not the hot path: one
 * small kernel per run of contiguous segments.
 */
#ifndef ZD_DAEMON_EXCHANGE_CUDA_H
#define ZD_DAEMON_EXCHANGE_CUDA_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "zerod/zerod.h"

#ifdef __cplusplus
extern "C" {
#endif

#include "error.h"
#include "segment.h"

/* master and param address the start of the range the segments' offsets are relative to.
 * to_client: param[i] = master[i] (as param_dtype), else master[i] = param[i]. Errors: ZD_EDTYPE,
 * ZD_EBACKEND (launch failed). */
int zd__cuda_exchange(float *master, void *param, zd_dtype_t param_dtype, const zd__segment_t *segs,
                      uint32_t nsegs, int to_client, cudaStream_t stream, zd__err_t *err);

/* Loads the exchange kernels on the current device now (cudaFuncGetAttributes), while nothing is
 * queued. With CUDA's lazy loading (the default since 12.2) a kernel's first launch loads its
 * module under the context's lock and waits for the device's queued work to drain: at
 * registration that is the client's "grads ready" wait (or a collective waiting for a peer), an
 * unbounded host block without any polling, which also stalls every other thread's CUDA call on
 * that device (the loop thread opening IPC handles). Errors: ZD_EBACKEND. */
int zd__cuda_exchange_preload(zd__err_t *err);

#ifdef __cplusplus
}
#endif

#endif /* ZD_DAEMON_EXCHANGE_CUDA_H */
