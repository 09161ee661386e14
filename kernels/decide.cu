/* The step's decision on the device (adam_cuda.h: zd__cuda_step_decide) and the seal of a record
 * (zd__cuda_record_seal): one thread each, running kernels/step_decide.h's host-and-device
 * functions, so that a rank can queue its update behind the decision without reading the records
 * back, and the host can recompute the same decision from the same records.
 *
 * Bit-identity with the host needs IEEE arithmetic without contraction here too: the build passes
 * -fmad=false -prec-div=true -prec-sqrt=true -ftz=false to every .cu file (meson.build), and
 * step_decide.h has no a*b+c a compiler could fuse anyway; double division and sqrt are always
 * correctly rounded on the GPU.
 */
#include <string.h>

#include "launch.cuh"

__global__ void decide_kernel(const __grid_constant__ zd__cuda_decide_args_t a,
                              zd__cuda_decision_t *out) {
  zd__cuda_decision_t d;
  zd__step_decide_records(&a, a.d_all, &d);
  *out = d;
}

__global__ void seal_kernel(zd__cuda_stats_t *rec) {
  rec->check = zd__record_check(rec);
}

int zd__cuda_step_decide(const zd__cuda_decide_args_t *a, zd__cuda_decision_t *d_out,
                         cudaStream_t stream, zd__err_t *err) {
  if (!a || !a->d_all || !d_out)
    return zd__errf(err, -EINVAL, "CUDA step decision: no arguments, records or output");
  if (a->world_size == 0 || a->mine >= a->world_size)
    return zd__errf(err, -EINVAL, "CUDA step decision: rank %u of a world of %u", a->mine,
                    a->world_size);
  int rc = zd__check_stream(stream, "CUDA step decision", err);
  if (rc) return rc;
  decide_kernel<<<1, 1, 0, stream>>>(*a, d_out);
  LAUNCH_CHECK(err, "CUDA step decision: kernel launch");
  return ZD_OK;
}

int zd__cuda_record_seal(zd__cuda_stats_t *d_rec, cudaStream_t stream, zd__err_t *err) {
  if (!d_rec) return zd__errf(err, -EINVAL, "CUDA record seal: no record");
  int rc = zd__check_stream(stream, "CUDA record seal", err);
  if (rc) return rc;
  seal_kernel<<<1, 1, 0, stream>>>(d_rec);
  LAUNCH_CHECK(err, "CUDA record seal: kernel launch");
  return ZD_OK;
}

cudaError_t zd__cuda_decide_preload(void) {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, decide_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, seal_kernel);
  return e;
}
