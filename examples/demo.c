/* zerod-demo: trains the tiny MLP of mlp.h through a running zerod and prints its loss.
 *
 * The smallest complete use of libzerod: connect, lay the model out in the shared buffers, put the
 * initial weights in, register, then per step write gradients and call zd_step(). Run it twice:
 * the second run resumes where the first stopped (zerod keeps the optimizer state), unless
 * --fresh asks zerod to discard it.
 *
 *   zerod-demo [--socket PATH] [--steps N] [--fresh]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mlp.h"
#include "zerod/zerod.h"

static int fail(const char *what) {
  fprintf(stderr, "zerod-demo: %s: %s\n", what, zd_last_error());
  return 1;
}

int main(int argc, char **argv) {
  const char *socket = NULL;
  int steps = 300, fresh = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--socket") == 0 && i + 1 < argc) {
      socket = argv[++i];
    } else if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--fresh") == 0) {
      fresh = 1;
    } else {
      fprintf(stderr, "usage: zerod-demo [--socket PATH] [--steps N] [--fresh]\n");
      return 2;
    }
  }

  zd_client_t *c;
  if (zd_connect(socket, ZD_ANY_RANK, 0, &c) != ZD_OK) return fail("connect");
  zd_group_t groups[2];
  zd_group_init(groups, 2, sizeof groups[0]);
  groups[0].lr = groups[1].lr = 3e-3;
  groups[1].weight_decay = 0; /* no decay on biases */
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = mlp_params;
  desc.nparams = MLP_NPARAMS;
  desc.groups = groups;
  desc.ngroups = 2;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  desc.flags = fresh ? ZD_REGISTER_REPLACE : 0;
  if (zd_layout(c, &desc) != ZD_OK) return fail("layout");

  /* Views of each parameter and gradient in the shared buffers. */
  float *params = zd_param_buffer(c, NULL), *grads = zd_grad_buffer(c, NULL);
  float *p[MLP_NPARAMS], *g[MLP_NPARAMS];
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    zd_param_info(c, (size_t)i, &info);
    p[i] = params + info.offset;
    g[i] = grads + info.offset;
  }
  mlp_init(p, 1);
  if (zd_register(c) != ZD_OK) return fail("register");
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(c, &info);
  printf("zerod %s: rank %u of %u, %llu elements in %u bucket(s), %s at step %llu\n",
         info.daemon_version, info.rank, info.world_size, (unsigned long long)info.total_elems,
         info.nbuckets, info.resumed ? "resumed" : "new model", (unsigned long long)info.step);

  float loss = 0;
  for (int s = 0; s < steps; s++) {
    uint64_t step = info.step + (uint64_t)s;
    loss = mlp_loss_grad((const float *const *)p, g, step, info.rank);
    zd_step_result_t r = ZD_STEP_RESULT_INIT;
    if (zd_step(c, NULL, &r) != ZD_OK) return fail("step");
    if (s % 25 == 0 || s + 1 == steps)
      printf("step %5llu  loss %.6f  (zerod: %llu us)\n", (unsigned long long)r.step, loss,
             (unsigned long long)r.duration_us);
  }
  printf("final loss %.6f after %d steps\n", loss, steps);
  zd_close(c);
  return 0;
}
