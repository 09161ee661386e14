/* The CUDA kernels of SGD and Adagrad (kernels/optim_cuda.h) against their scalar references
 * (kernels/sgd.c, adagrad.c through the optimizers' table, optim.h), bit for bit: random shards
 * with gaps between segments, four groups (SGD with dampening, with nesterov and maximize, without
 * momentum; Adagrad with lr_decay and weight decay), steps 1 to 3 (the buffer and sum created at
 * step 1), every grad dtype x param output (f32, bf16, none). Exits 77 without a usable GPU. */
#include <cuda_runtime.h>

#include "gpu_check.h"
#include "group.h"
#include "optim.h"
#include "optim_cuda.h"

#define N 50000

static uint64_t rng = 0x853c49e6748fea9bull;
static float uni(float lo, float hi) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return lo + (hi - lo) * (float)((rng >> 40) & 0xffffff) / (float)0x1000000;
}

static void *dev(size_t bytes) {
  void *p = NULL;
  CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

int main(void) {
  gpu_or_skip("test_optim_cuda");
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  static zd__segment_t segs[512];
  uint32_t nsegs = 0;
  for (uint64_t at = 0; nsegs < 512;) {
    at += (uint64_t)(uni(0, 4));
    uint64_t len = 1 + (uint64_t)uni(0, 400);
    if (at + len > N) break;
    segs[nsegs] = (zd__segment_t){.offset = at, .length = len, .group = nsegs % 4};
    nsegs++;
    at += len;
  }
  zd__segment_t *d_segs = (zd__segment_t *)dev(nsegs * sizeof *segs);
  CUDA_CHECK(cudaMemcpy(d_segs, segs, nsegs * sizeof *segs, cudaMemcpyHostToDevice));
  static const zd_dtype_t gds[] = {ZD_F32, ZD_BF16, ZD_F16};
  static const int pds[] = {0, ZD_F32, ZD_BF16};
  static float state[ZD__NSTATES][N], back[ZD__NSTATES][N], g32[N];
  static uint16_t g16[N], p16[N], p16_back[N];
  static float p32[N], p32_back[N];
  float *d_state[ZD__NSTATES];
  for (int s = 0; s < ZD__NSTATES; s++) d_state[s] = (float *)dev(N * sizeof(float));
  void *d_grad = dev(N * sizeof(float)), *d_param = dev(N * sizeof(float));
  int cases = 0;
  for (int gi = 0; gi < 3; gi++)
    for (int pi = 0; pi < 3; pi++) {
      for (int s = 0; s < ZD__NSTATES; s++)
        for (int i = 0; i < N; i++) state[s][i] = uni(-1, 1);
      for (int s = 0; s < ZD__NSTATES; s++)
        CUDA_CHECK(cudaMemcpy(d_state[s], state[s], N * sizeof(float), cudaMemcpyHostToDevice));
      for (int t = 1; t <= 3; t++) {
        zd_group_t hp[4];
        zd__adam_group_t c[4];
        for (int k = 0; k < 4; k++) {
          hp[k] = zd__group_default();
          hp[k].lr = uni(0.001f, 0.3f);
          hp[k].weight_decay = k == 2 ? 0 : uni(0, 0.1f);
          hp[k].optimizer = k == 3 ? ZD_ADAGRAD : ZD_SGD;
          hp[k].momentum = k == 2 ? 0 : 0.9;
          hp[k].dampening = k == 0 ? 0.1 : 0;
          hp[k].nesterov = k == 1;
          hp[k].maximize = k == 1;
          hp[k].lr_decay = k == 3 ? 0.01 : 0;
          hp[k].initial_accumulator_value = k == 3 ? 0.1 : 0;
          hp[k].eps = k == 3 ? 1e-10 : 1e-8;
          zd__adam_group_init(&c[k], &hp[k], (uint64_t)t);
        }
        for (int i = 0; i < N; i++) {
          g32[i] = uni(-2, 2);
          g16[i] = gds[gi] == ZD_BF16 ? zd__f32_to_bf16(g32[i]) : (uint16_t)((rng >> 20) & 0x3bff);
        }
        const void *grad = gds[gi] == ZD_F32 ? (const void *)g32 : (const void *)g16;
        size_t gbytes = gds[gi] == ZD_F32 ? N * 4 : N * 2;
        CUDA_CHECK(cudaMemcpy(d_grad, grad, gbytes, cudaMemcpyHostToDevice));
        zd__adam_args_t a;
        memset(&a, 0, sizeof a);
        for (int s = 0; s < ZD__NSTATES; s++) a.state[s] = state[s];
        a.grad = grad;
        a.grad_dtype = gds[gi];
        a.param = pds[pi] == ZD_BF16 ? (void *)p16 : pds[pi] == ZD_F32 ? (void *)p32 : NULL;
        a.param_dtype = pds[pi] ? (zd_dtype_t)pds[pi] : ZD_F32;
        a.grad_scale = 0.5f;
        a.segs = segs;
        a.nsegs = nsegs;
        a.groups = c;
        zd__optim_impl(ZD__ISA_SCALAR)(&a, 0, N);
        zd__adam_args_t d = a;
        for (int s = 0; s < ZD__NSTATES; s++) d.state[s] = d_state[s];
        d.grad = d_grad;
        d.param = pds[pi] ? d_param : NULL;
        ZD_CHECK(zd__cuda_optim_step(&d, d_segs, nsegs, 4, N, stream, &gpu_err));
        CUDA_CHECK(cudaStreamSynchronize(stream));
        for (int s = 0; s < ZD__NSTATES; s++)
          CUDA_CHECK(cudaMemcpy(back[s], d_state[s], N * sizeof(float), cudaMemcpyDeviceToHost));
        for (uint32_t k = 0; k < nsegs; k++)
          for (uint64_t i = segs[k].offset; i < segs[k].offset + segs[k].length; i++)
            for (int s = 0; s < ZD__NSTATES; s++)
              CHECK_MSG(f2u(back[s][i]) == f2u(state[s][i]) ||
                            (back[s][i] != back[s][i] && state[s][i] != state[s][i]),
                        "grad %d param %d step %d: %s[%llu] %08x on the GPU, %08x reference", gi,
                        pi, t, zd__state_name((zd__state_t)s), (unsigned long long)i,
                        f2u(back[s][i]), f2u(state[s][i]));
        if (pds[pi] == ZD_BF16) {
          CUDA_CHECK(cudaMemcpy(p16_back, d_param, N * 2, cudaMemcpyDeviceToHost));
          for (uint32_t k = 0; k < nsegs; k++)
            for (uint64_t i = segs[k].offset; i < segs[k].offset + segs[k].length; i++)
              CHECK(p16_back[i] == p16[i]);
        } else if (pds[pi] == ZD_F32) {
          CUDA_CHECK(cudaMemcpy(p32_back, d_param, N * 4, cudaMemcpyDeviceToHost));
          for (uint32_t k = 0; k < nsegs; k++)
            for (uint64_t i = segs[k].offset; i < segs[k].offset + segs[k].length; i++)
              CHECK(f2u(p32_back[i]) == f2u(p32[i]));
        }
        cases++;
      }
    }
  printf("PASS: SGD and Adagrad on the GPU equal the scalar reference bit for bit (%d cases)\n",
         cases);
  return 0;
}
