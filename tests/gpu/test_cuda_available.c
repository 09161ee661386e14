/* zd__cuda_available / zd__cuda_device_check and the launchers' argument checks, from C, with or
 * without a GPU: this test passes either way (it is what tells the CI machine's story: CUDA
 * compiled in, no driver, a clear reason). Without a GPU it checks that the reason is given and
 * that every launcher refuses bad arguments before touching CUDA. */
#include <errno.h>

#include "gpu_check.h"

#define EXPECT_RC(expr, want)                                                                  \
  do {                                                                                         \
    memset(&gpu_err, 0, sizeof gpu_err);                                                       \
    int rc_ = (expr);                                                                          \
    CHECK_MSG(rc_ == (want), "%s returned %d (%s: %s), want %d", #expr, rc_, zd_err_name(rc_), \
              gpu_err.msg, (int)(want));                                                       \
    CHECK_MSG(gpu_err.msg[0], "%s: no message", #expr);                                        \
    printf("  refused as expected: %s\n", gpu_err.msg);                                        \
  } while (0)

int main(void) {
  char why[1024];
  int n = zd__cuda_available(why, sizeof why);
  CHECK_INT_EQ(zd__cuda_available(NULL, 0), n);
  int total = 0;
  cudaError_t e = cudaGetDeviceCount(&total);
  if (e != cudaSuccess) total = 0;
  if (n == 0) {
    printf("cuda_available: no usable GPU: %s\n", why);
    CHECK_MSG(why[0], "zd__cuda_available gives 0 devices and no reason");
    memset(&gpu_err, 0, sizeof gpu_err);
    CHECK_INT_EQ(zd__cuda_device_check(0, &gpu_err), ZD_EBACKEND);
    printf("cuda_available: device 0: %s\n", gpu_err.msg);
    CHECK(gpu_err.msg[0]);
  } else {
    printf("cuda_available: %d usable of %d CUDA devices%s%s\n", n, total, why[0] ? "; " : "", why);
    int ok = 0;
    for (int d = 0; d < total; d++) ok += zd__cuda_device_check(d, &gpu_err) == ZD_OK;
    CHECK_INT_EQ(ok, n);
    EXPECT_RC(zd__cuda_device_check(total, &gpu_err), ZD_EBACKEND);
  }

  /* Argument checks that happen before any CUDA call. */
  cudaStream_t s = cudaStreamPerThread;
  zd__cuda_layout_t *l = (zd__cuda_layout_t *)&l;
  zd__segment_t overlap[2] = {{0, 100, 0}, {99, 10, 0}};
  EXPECT_RC(zd__cuda_layout_create(overlap, 2, 200, s, &l, &gpu_err), -EINVAL);
  CHECK(l == NULL);
  zd__segment_t past[1] = {{190, 11, 0}};
  EXPECT_RC(zd__cuda_layout_create(past, 1, 200, s, &l, &gpu_err), -EINVAL);
  EXPECT_RC(zd__cuda_layout_create(past, 1, 200, NULL, &l, &gpu_err), -EINVAL);
  EXPECT_RC(zd__cuda_layout_create(past, 1, 200, s, NULL, &gpu_err), -EINVAL);
  zd__cuda_adam_args_t a;
  memset(&a, 0, sizeof a);
  EXPECT_RC(zd__cuda_adam_step(NULL, &a, s, &gpu_err), -EINVAL);
  EXPECT_RC(zd__cuda_grad_stats(NULL, NULL, ZD_F32, NULL, 0, NULL, s, &gpu_err), -EINVAL);
  zd__adam_group_t g;
  memset(&g, 0, sizeof g);
  EXPECT_RC(zd__cuda_groups_upload(NULL, &g, 1, s, &gpu_err), -EINVAL);
  EXPECT_RC(zd__cuda_groups_upload((zd__adam_group_t *)&g, &g, 1, NULL, &gpu_err), -EINVAL);
  printf("PASS\n");
  return 0;
}
