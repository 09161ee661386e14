/* Per-bucket scatter and gather, pipelined: the way a trainer overlaps communication with its
 * backward and forward passes. Two zerods train the same model for 50 steps, one with plain
 * zd_step() and one with scatter per bucket + step(NO_SCATTER | NO_GATHER) + gather per bucket,
 * all requests in flight at once and waited for out of order; the parameters must stay bitwise
 * equal. A step that claims scattered gradients which were not is refused. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "check.h"
#include "harness.h"
#include "mlp.h"
#include "zerod/zerod.h"

#define STEPS 50

static zd_client_t *start_client(const zdt_daemon_t *d) {
  zd_client_t *c;
  CHECK_INT_EQ(zd_connect(d->socket, ZD_ANY_RANK, 0, &c), ZD_OK);
  zd_group_t groups[2];
  zd_group_init(groups, 2, sizeof groups[0]);
  groups[1].weight_decay = 0;
  zd_model_desc_t desc = zdt_mlp_desc(groups, 2);
  CHECK_INT_EQ(zd_layout(c, &desc), ZD_OK);
  float init[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
  float *p[MLP_NPARAMS] = {init[0], init[1], init[2], init[3]};
  mlp_init(p, 7);
  float *buf = zd_param_buffer(c, NULL);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(c, (size_t)i, &info);
    memcpy(buf + info.offset, init[i], info.numel * sizeof(float));
  }
  CHECK_MSG(zd_register(c) == ZD_OK, "register: %s", zd_last_error());
  return c;
}

/* Gradients of the current parameters into the grad buffer. */
static void backward(zd_client_t *c, int step) {
  float work[MLP_NPARAMS][MLP_HIDDEN * MLP_IN], grad[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
  float *p[MLP_NPARAMS], *g[MLP_NPARAMS];
  const float *pb = zd_param_buffer(c, NULL);
  float *gb = zd_grad_buffer(c, NULL);
  zd_param_info_t info[MLP_NPARAMS];
  for (int i = 0; i < MLP_NPARAMS; i++) {
    info[i] = (zd_param_info_t)ZD_PARAM_INFO_INIT;
    zd_param_info(c, (size_t)i, &info[i]);
    memcpy(work[i], pb + info[i].offset, info[i].numel * sizeof(float));
    p[i] = work[i];
    g[i] = grad[i];
  }
  mlp_loss_grad((const float *const *)p, g, (uint64_t)step, 0);
  for (int i = 0; i < MLP_NPARAMS; i++)
    memcpy(gb + info[i].offset, grad[i], info[i].numel * sizeof(float));
}

int main(void) {
  const char *args[] = {"--bucket_elems", "100", NULL};
  zdt_daemon_t da, db;
  zdt_start(&da, args);
  zdt_start(&db, args);
  zd_client_t *a = start_client(&da), *b = start_client(&db);
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(b, &info);
  uint32_t nb = info.nbuckets;
  CHECK_MSG(nb >= 3, "expected several buckets, got %u", nb);
  size_t bytes;
  zd_param_buffer(a, &bytes);

  for (int step = 0; step < STEPS; step++) {
    backward(a, step);
    CHECK_MSG(zd_step(a, NULL, NULL) == ZD_OK, "plain step: %s", zd_last_error());

    backward(b, step);
    zd_request_t req[64];
    uint32_t n = 0;
    for (uint32_t k = 0; k < nb; k++) /* buckets become ready in reverse, as in backward */
      CHECK_INT_EQ(zd_scatter_start(b, (int)(nb - 1 - k), &req[n++]), ZD_OK);
    zd_request_t step_req;
    zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
    opts.flags = ZD_STEP_NO_SCATTER | ZD_STEP_NO_GATHER;
    CHECK_INT_EQ(zd_step_start(b, &opts, &step_req), ZD_OK);
    for (uint32_t k = 0; k < nb; k++) CHECK_INT_EQ(zd_gather_start(b, (int)k, &req[n++]), ZD_OK);
    zd_step_result_t r = ZD_STEP_RESULT_INIT;
    CHECK_MSG(zd_wait(b, step_req, &r) == ZD_OK, "pipelined step: %s", zd_last_error());
    CHECK_U64_EQ(r.step, (uint64_t)step + 1);
    for (uint32_t k = n; k-- > 0;) /* waited for out of order */
      CHECK_MSG(zd_wait(b, req[k], NULL) == ZD_OK, "request %u: %s", k, zd_last_error());
    CHECK_MSG(memcmp(zd_param_buffer(a, NULL), zd_param_buffer(b, NULL), bytes) == 0,
              "step %d: pipelined training differs from plain training", step + 1);
  }
  printf(
      "  %d steps with %u buckets scattered and gathered one by one, pipelined: bitwise equal "
      "to plain steps\n",
      STEPS, nb);

  /* Claiming scattered gradients that were not: refused, nothing applied. */
  zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
  opts.flags = ZD_STEP_NO_SCATTER;
  CHECK_INT_EQ(zd_scatter(b, 0), ZD_OK);
  CHECK_INT_EQ(zd_step(b, &opts, NULL), ZD_EORDER);
  CHECK_CONTAINS(zd_last_error(), "bucket 1 was not scattered since step 50");
  printf("  %s\n", zd_last_error());
  zd_step_result_t r = ZD_STEP_RESULT_INIT;
  CHECK_INT_EQ(zd_step(b, NULL, &r), ZD_OK);
  CHECK_U64_EQ(r.step, STEPS + 1);

  /* Closing with the pipeline full (64 requests outstanding, none waited for): the outstanding
   * requests are answered, the bye goes out, and the rank is free when zd_close returns. */
  zd_request_t many[64];
  for (int i = 0; i < 64; i++) CHECK_INT_EQ(zd_scatter_start(b, i % (int)nb, &many[i]), ZD_OK);
  zd_request_t extra;
  CHECK_INT_EQ(zd_scatter_start(b, 0, &extra), -EBUSY);
  zd_close(b);
  b = start_client(&db);
  zd_get_info(b, &info);
  CHECK_INT_EQ(info.resumed, 1);
  CHECK_U64_EQ(info.step, STEPS + 1);
  printf("  closed with 64 requests outstanding: answered, bye sent, the rank free at once\n");

  zd_close(a);
  zd_close(b);
  zdt_stop(&da, SIGTERM, 0);
  zdt_stop(&db, SIGTERM, 0);
  printf("test_pipeline: ok\n");
  return 0;
}
