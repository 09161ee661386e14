/* A tiny multi-layer perceptron written in plain C, with its own backward pass: the model the
 * demo trains through zerod and that the integration tests train twice (through zerod, and with
 * the reference kernel in-process) to compare bit for bit.
 *
 * y = W2 tanh(W1 x + b1) + b2, fitted to a fixed random "teacher" network of the same shape on
 * synthetic data by mean squared error. Weights are in parameter group 0, biases in group 1, so a
 * run exercises per-group hyperparameters. The batch of a step depends only on (step, rank), so
 * every process draws the same data.
 */
#ifndef ZD_EXAMPLES_MLP_H
#define ZD_EXAMPLES_MLP_H

#include <stdint.h>

#include "zerod/zerod.h"

#define MLP_IN      16
#define MLP_HIDDEN  32
#define MLP_OUT     4
#define MLP_BATCH   32
#define MLP_NPARAMS 4

/* fc1.weight [32, 16] g0, fc1.bias [32] g1, fc2.weight [4, 32] g0, fc2.bias [4] g1 */
extern const zd_param_t mlp_params[MLP_NPARAMS];

/* Elements of parameter i. */
uint64_t mlp_numel(int i);

/* Initial weights (scaled uniform), deterministic in seed. */
void mlp_init(float *const p[MLP_NPARAMS], uint64_t seed);

/* Loss of the batch of (step, rank) and its gradient with respect to every parameter.
 * Thread-safe. */
float mlp_loss_grad(const float *const p[MLP_NPARAMS], float *const g[MLP_NPARAMS], uint64_t step,
                    uint32_t rank);

#endif /* ZD_EXAMPLES_MLP_H */
