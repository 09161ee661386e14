/* Tiny MLP (mlp.h). Plain loops in a fixed order: the same binary computes the same bits in every
 * process, which is what the bitwise comparisons rely on. */
#include "mlp.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

const zd_param_t mlp_params[MLP_NPARAMS] = {
    {.name = "fc1.weight", .ndim = 2, .shape = {MLP_HIDDEN, MLP_IN}, .group = 0},
    {.name = "fc1.bias", .ndim = 1, .shape = {MLP_HIDDEN}, .group = 1},
    {.name = "fc2.weight", .ndim = 2, .shape = {MLP_OUT, MLP_HIDDEN}, .group = 0},
    {.name = "fc2.bias", .ndim = 1, .shape = {MLP_OUT}, .group = 1},
};

uint64_t mlp_numel(int i) {
  uint64_t n = 1;
  for (uint32_t d = 0; d < mlp_params[i].ndim; d++) n *= mlp_params[i].shape[d];
  return n;
}

/* splitmix64: small, good enough, and the same everywhere. */
static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* Uniform in [-1, 1). */
static float uniform(uint64_t *state) {
  *state = mix(*state);
  return (float)((double)(*state >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

void mlp_init(float *const p[MLP_NPARAMS], uint64_t seed) {
  uint64_t s = seed;
  for (int i = 0; i < MLP_NPARAMS; i++) {
    float scale = i % 2 ? 0.1f : 1.0f / sqrtf((float)mlp_params[i].shape[1]);
    for (uint64_t k = 0; k < mlp_numel(i); k++) p[i][k] = uniform(&s) * scale;
  }
}

static float teacher[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
static pthread_once_t teacher_once = PTHREAD_ONCE_INIT;

/* Made once per process, also when trainers run as threads of one process
 * (tests/integration/test_world.c): a plain flag let a thread read a half-made teacher. */
static void make_teacher(void) {
  float *t[MLP_NPARAMS] = {teacher[0], teacher[1], teacher[2], teacher[3]};
  mlp_init(t, 0x7eac4e5ull);
  for (int i = 0; i < MLP_NPARAMS; i++)
    for (uint64_t k = 0; k < mlp_numel(i); k++) t[i][k] *= 2.0f;
}

static void forward(const float *const p[MLP_NPARAMS], const float *x, float *h, float *y) {
  for (int j = 0; j < MLP_HIDDEN; j++) {
    float a = p[1][j];
    for (int k = 0; k < MLP_IN; k++) a += p[0][j * MLP_IN + k] * x[k];
    h[j] = tanhf(a);
  }
  for (int o = 0; o < MLP_OUT; o++) {
    float a = p[3][o];
    for (int j = 0; j < MLP_HIDDEN; j++) a += p[2][o * MLP_HIDDEN + j] * h[j];
    y[o] = a;
  }
}

float mlp_loss_grad(const float *const p[MLP_NPARAMS], float *const g[MLP_NPARAMS], uint64_t step,
                    uint32_t rank) {
  pthread_once(&teacher_once, make_teacher);
  const float *t[MLP_NPARAMS] = {teacher[0], teacher[1], teacher[2], teacher[3]};
  for (int i = 0; i < MLP_NPARAMS; i++) memset(g[i], 0, mlp_numel(i) * sizeof(float));
  uint64_t s = mix(step * 0x100000001b3ull + rank);
  float loss = 0;
  const float inv = 1.0f / (MLP_BATCH * MLP_OUT);
  for (int b = 0; b < MLP_BATCH; b++) {
    float x[MLP_IN], h[MLP_HIDDEN], y[MLP_OUT], th[MLP_HIDDEN], ty[MLP_OUT];
    for (int k = 0; k < MLP_IN; k++) x[k] = uniform(&s);
    forward(t, x, th, ty);
    forward(p, x, h, y);
    float dh[MLP_HIDDEN] = {0};
    for (int o = 0; o < MLP_OUT; o++) {
      float e = y[o] - ty[o];
      loss += e * e * inv;
      float dy = 2.0f * e * inv;
      g[3][o] += dy;
      for (int j = 0; j < MLP_HIDDEN; j++) {
        g[2][o * MLP_HIDDEN + j] += dy * h[j];
        dh[j] += dy * p[2][o * MLP_HIDDEN + j];
      }
    }
    for (int j = 0; j < MLP_HIDDEN; j++) {
      float da = dh[j] * (1.0f - h[j] * h[j]);
      g[1][j] += da;
      for (int k = 0; k < MLP_IN; k++) g[0][j * MLP_IN + k] += da * x[k];
    }
  }
  return loss;
}
