/* ZD_MEMORY_HOST_PINNED: the host buffers of a CPU zerod, page-locked by libzerod for a model on a
 * GPU (offload). Without a GPU: the layout is refused with ZD_EBACKEND naming the memory kind (a
 * real zerod, run here), and the test exits 77. With one: the buffers are registered with CUDA
 * (cudaPointerGetAttributes says host memory known to CUDA), a bad device ordinal is refused, and
 * a model trained through them, its gradients written by cudaMemcpyAsync device-to-host on a
 * stream of the test's and its parameters read back host-to-device, ends bit for bit where the
 * same training through plain host buffers on another CPU zerod ends. zd_layout() again and
 * zd_close() unregister them (the re-layout's buffers are registered afresh, and the process
 * ends without CUDA complaints).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_check.h"
#include "harness.h"
#include "mlp.h"
#include "zerod/zerod.h"

#define STEPS 5

static void do_layout(zd_client_t *c, zd_memory_t memory, int device, int expect) {
  zd_group_t g[2];
  zd_group_init(g, 2, sizeof g[0]);
  g[0].lr = 1e-2;
  g[1].lr = 3e-3;
  g[1].weight_decay = 0.0;
  zd_model_desc_t desc = zdt_mlp_desc(g, 2);
  desc.flags = ZD_REGISTER_REPLACE;
  desc.memory = memory;
  desc.device = device;
  int rc = zd_layout(c, &desc);
  CHECK_MSG(rc == expect, "zd_layout(memory %d, device %d) returned %d (%s), expected %d: %s",
            (int)memory, device, rc, zd_err_name(rc), expect, zd_last_error());
}

static zd_client_t *layout(const char *socket, zd_memory_t memory, int device, int expect) {
  zd_client_t *c;
  CHECK_MSG(zd_connect(socket, ZD_ANY_RANK, 0, &c) == ZD_OK, "connect: %s", zd_last_error());
  do_layout(c, memory, device, expect);
  return c;
}

static void write_init(zd_client_t *c) {
  float *p = zd_param_buffer(c, NULL);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    CHECK_INT_EQ(zd_param_info(c, (size_t)i, &info), ZD_OK);
    for (uint64_t k = 0; k < info.numel; k++)
      p[info.offset + k] = 0.01f * (float)((k * 7 + i) % 13) - 0.06f;
  }
}

static int is_registered(void *ptr) {
  struct cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, ptr);
  (void)cudaGetLastError();
  return e == cudaSuccess && a.type == cudaMemoryTypeHost;
}

int main(void) {
  char why[1024];
  int ngpus = zd__cuda_available(why, sizeof why);
  zdt_daemon_t a, b;
  const char *args[] = {"--backend", "cpu", "--bucket_elems", "256", NULL};
  zdt_start(&a, args);
  if (ngpus == 0) {
    zd_client_t *c = layout(a.socket, ZD_MEMORY_HOST_PINNED, 0, ZD_EBACKEND);
    CHECK_CONTAINS(zd_last_error(), "ZD_MEMORY_HOST_PINNED");
    printf("refused as expected: %s\n", zd_last_error());
    zd_close(c);
    zdt_stop(&a, SIGTERM, 0);
    printf("test_pinned_cuda: skipped (the refusal without a GPU passed), CUDA unusable: %s\n",
           why);
    return ZD_TEST_SKIP;
  }
  zdt_start(&b, args);
  CUDA_CHECK(cudaSetDevice(0));

  zd_client_t *bad = layout(a.socket, ZD_MEMORY_HOST_PINNED, 999, -EINVAL);
  zd_close(bad);

  zd_client_t *pc = layout(a.socket, ZD_MEMORY_HOST_PINNED, 0, ZD_OK);
  size_t pbytes, gbytes;
  float *pp = zd_param_buffer(pc, &pbytes), *pg = zd_grad_buffer(pc, &gbytes);
  CHECK_MSG(is_registered(pp) && is_registered(pg), "the pinned buffers are not known to CUDA");
  /* a second layout on the same client: the old buffers unregistered and unmapped, new ones
   * registered */
  do_layout(pc, ZD_MEMORY_HOST_PINNED, 0, ZD_OK);
  pp = zd_param_buffer(pc, &pbytes);
  pg = zd_grad_buffer(pc, &gbytes);
  CHECK_MSG(is_registered(pp) && is_registered(pg), "the re-laid-out buffers are not pinned");
  zd_client_t *hc = layout(b.socket, ZD_MEMORY_HOST, 0, ZD_OK);
  float *hp = zd_param_buffer(hc, NULL), *hg = zd_grad_buffer(hc, NULL);
  CHECK_MSG(!is_registered(hp), "plain host buffers are registered with CUDA");
  write_init(pc);
  write_init(hc);
  CHECK_INT_EQ(zd_register(pc), ZD_OK);
  CHECK_INT_EQ(zd_register(hc), ZD_OK);

  size_t n = gbytes / sizeof(float);
  float *dg, *dp, *host = malloc(gbytes);
  CHECK(host);
  CUDA_CHECK(cudaMalloc((void **)&dg, gbytes));
  CUDA_CHECK(cudaMalloc((void **)&dp, pbytes));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int step = 0; step < STEPS; step++) {
    for (size_t k = 0; k < n; k++)
      host[k] = 0.001f * (float)((k * 31 + (size_t)step * 17) % 101) - 0.05f;
    for (int i = 0; i < MLP_NPARAMS; i++) { /* padding stays zero */
      zd_param_info_t info = ZD_PARAM_INFO_INIT;
      CHECK_INT_EQ(zd_param_info(pc, (size_t)i, &info), ZD_OK);
      memcpy(hg + info.offset, host + info.offset, info.numel * sizeof(float));
    }
    /* the pinned path: host gradients -> device -> the pinned grad buffer, asynchronously */
    CUDA_CHECK(cudaMemcpyAsync(dg, hg, gbytes, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(pg, dg, gbytes, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    CHECK_MSG(memcmp(pg, hg, gbytes) == 0, "step %d: the D2H copy into the pinned buffer differs",
              step);
    CHECK_INT_EQ(zd_step(pc, NULL, NULL), ZD_OK);
    CHECK_INT_EQ(zd_step(hc, NULL, NULL), ZD_OK);
    CUDA_CHECK(cudaMemcpyAsync(dp, pp, pbytes, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(host, dp, pbytes, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    CHECK_MSG(memcmp(host, hp, pbytes) == 0,
              "step %d: the parameters through the pinned buffers differ from the host ones",
              step + 1);
  }
  printf("%d steps through pinned buffers: bit for bit those of plain host buffers\n", STEPS);
  CUDA_CHECK(cudaStreamDestroy(s));
  CUDA_CHECK(cudaFree(dg));
  CUDA_CHECK(cudaFree(dp));
  free(host);
  zd_close(pc);
  zd_close(hc);
  CUDA_CHECK(cudaDeviceSynchronize());
  zdt_stop(&a, SIGTERM, 0);
  zdt_stop(&b, SIGTERM, 0);
  printf("test_pinned_cuda: ok\n");
  return 0;
}
