/* CUDA kernels of SGD and Adagrad (optim_cuda.h): one thread per element, the formulas of sgd.c
 * and adagrad.c operation for operation. */
#include <cuda_fp16.h>
#include <errno.h>
#include <string.h>

#include "optim.h"
#include "optim_cuda.h"

namespace {

struct groups_t {
  zd__adam_group_t g[ZD__CUDA_OPTIM_GROUPS];
};

struct args_t {
  float *master, *buf, *sum;
  const void *grad;
  int grad_dtype;
  void *param;
  int param_dtype;
  float grad_scale;
  const zd__segment_t *segs;
  uint32_t nsegs;
  uint64_t n;
};

__device__ float grad_at(const args_t &a, uint64_t i) {
  if (a.grad_dtype == ZD_BF16)
    return __uint_as_float((uint32_t)((const uint16_t *)a.grad)[i] << 16);
  if (a.grad_dtype == ZD_F16) return __half2float(((const __half *)a.grad)[i]);
  return ((const float *)a.grad)[i];
}

__device__ uint16_t to_bf16(float f) { /* common/dtype.h's zd__f32_to_bf16 */
  if (f != f) return 0x7fc0;
  uint32_t u = __float_as_uint(f);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__global__ void optim_kernel(args_t a, groups_t gs) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < a.n;
       i += (uint64_t)gridDim.x * blockDim.x) {
    uint32_t lo = 0, hi = a.nsegs; /* the segment holding i, if any */
    while (lo < hi) {
      uint32_t mid = lo + (hi - lo) / 2;
      if (a.segs[mid].offset + a.segs[mid].length <= i)
        lo = mid + 1;
      else
        hi = mid;
    }
    if (lo == a.nsegs || a.segs[lo].offset > i) continue; /* padding */
    const zd__adam_group_t &c = gs.g[a.segs[lo].group];
    float g = grad_at(a, i) * a.grad_scale;
    if (c.negate_grad) g = -g;
    float p = a.master[i];
    if (c.has_weight_decay) g = fmaf(p, c.weight_decay, g);
    if (c.optimizer == ZD_SGD) {
      if (c.has_momentum && a.buf) {
        float b = c.momentum_first ? g : fmaf(g, c.dampening_weight, a.buf[i] * c.momentum);
        a.buf[i] = b;
        g = c.nesterov ? fmaf(b, c.momentum, g) : b;
      }
      p = fmaf(g, c.neg_lr, p);
    } else { /* ZD_ADAGRAD */
      float s = c.sum_first ? c.init_sum : a.sum[i];
      s = fmaf(g, g, s);
      float d = sqrtf(s) + c.eps;
      p = p + (c.neg_clr * g) / d;
      a.sum[i] = s;
    }
    a.master[i] = p;
    if (a.param && a.param_dtype == ZD_BF16)
      ((uint16_t *)a.param)[i] = to_bf16(p);
    else if (a.param)
      ((float *)a.param)[i] = p;
  }
}

}  // namespace

extern "C" int zd__cuda_optim_step(const zd__adam_args_t *a, const zd__segment_t *d_segs,
                                   uint32_t nsegs, uint32_t ngroups, uint64_t n,
                                   cudaStream_t stream, zd__err_t *err) {
  if (!a || !a->groups || ngroups > ZD__CUDA_OPTIM_GROUPS || !a->state[ZD__STATE_MASTER] ||
      (nsegs && !d_segs))
    return zd__errf(err, -EINVAL, "zd__cuda_optim_step: bad arguments");
  if (a->grad_dtype != ZD_F32 && a->grad_dtype != ZD_BF16 && a->grad_dtype != ZD_F16)
    return zd__errf(err, ZD_EDTYPE, "zd__cuda_optim_step: grad dtype %d", (int)a->grad_dtype);
  groups_t gs;
  memset(&gs, 0, sizeof gs);
  for (uint32_t k = 0; k < ngroups; k++) {
    const zd__adam_group_t &c = a->groups[k];
    if (c.optimizer != ZD_SGD && c.optimizer != ZD_ADAGRAD)
      return zd__errf(err, -EINVAL, "zd__cuda_optim_step: group %u is not SGD or Adagrad", k);
    if (c.optimizer == ZD_ADAGRAD && c.sqrt_mode == ZD_SQRT_MKL_EX)
      return zd__errf(err, ZD_EHPARAM,
                      "group %u: sqrt_mode MKL_EX has no GPU form (rsqrtps is the CPU's)", k);
    if (c.optimizer == ZD_ADAGRAD && !a->state[ZD__STATE_SUM])
      return zd__errf(err, -EINVAL, "zd__cuda_optim_step: group %u needs sum", k);
    gs.g[k] = c;
  }
  args_t d = {a->state[ZD__STATE_MASTER],
              a->state[ZD__STATE_MOMENTUM_BUFFER],
              a->state[ZD__STATE_SUM],
              a->grad,
              (int)a->grad_dtype,
              a->param,
              (int)a->param_dtype,
              a->grad_scale,
              d_segs,
              nsegs,
              n};
  if (n == 0) return ZD_OK;
  uint64_t blocks = (n + 255) / 256;
  optim_kernel<<<(unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, stream>>>(d, gs);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return zd__errf(err, ZD_EBACKEND, "zd__cuda_optim_step: launch: %s", cudaGetErrorString(e));
  return ZD_OK;
}
