/* The table of optimizers: which kernel steps a group, per its zd_group_t.optimizer.
 *
 * One row per optimizer (ZD__OPTIMIZERS). A row names its kernel family `k`, whose files provide,
 * for every CPU instruction set of adam.h (zd__isa_t):
 *   void zd__<k>_consts(zd__adam_group_t *c, const zd_group_t *hp, uint64_t step)
 *       the group's fp32 constants for step number `step` (from 1), derived on the host as torch
 *       derives its scalars; c->optimizer is hp->optimizer
 *   zd__adam_fn zd__<k>_impl(zd__isa_t isa)
 *       its update of the covered elements in [begin, end) of a zd__adam_args_t (state arrays by
 *       role, out of place when src[] is set, working parameters written back), the scalar
 *       reference for ZD__ISA_SCALAR (the specification) and a wide path for each other ISA
 *   zd__states_t zd__<k>_writes(const zd__adam_group_t *c)
 *       the state arrays (common/state.h) its update writes for a group: an update out of place
 *       copies the others from src[] (zd__optim_impl), so that the set it writes holds the whole
 *       state
 * The state arrays a group keeps are those its kernel writes (zd__<k>_writes, zd__optim_states):
 * a model holds the union over its groups at registration, and nothing else lists an
 * optimizer's arrays (common/state.h has one row per array, naming no optimizer). Its
 * hyperparameters are rows of common/group.h. The group's part of the step hash is
 * every field of zd_group_t (zd__group_hash), whatever the optimizer reads; the step's checks
 * (non-finite gradients, clipping, loss scaling) are the optimizer's caller's, the same for all.
 *
 * Rows, with torch's state names (state.h) and the reference each is bit-identical to:
 *   ADAMW, ADAM  adam   exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad)   torch.optim.AdamW/Adam
 *                                                                       (kernels/adam.h)
 *   SGD          sgd    momentum_buffer (momentum != 0)                 torch.optim.SGD
 *                                                                       (kernels/sgd.c)
 *   ADAGRAD      adagrad  sum                                           torch.optim.Adagrad
 *                                                                       (kernels/adagrad.c)
 *   RMSPROP      rmsprop  square_avg, grad_avg (centered),              torch.optim.RMSprop
 *                         momentum_buffer (momentum != 0)               (kernels/rmsprop.c)
 *   LION         lion   exp_avg                                         lion_pytorch.Lion
 *                                                                       (kernels/lion.c)
 * A model with groups of several optimizers is stepped run by run: zd__optim_impl's update walks
 * the segments of [begin, end) and hands each run of consecutive segments whose optimizers share
 * a kernel to that kernel, in one call.
 *
 * Adding an optimizer touches five files besides its tests (docs/optimizers.md, checked against
 * what Lion touched):
 *   kernels/<k>.c                 its kernel in the frame of kernels/optim_kernel.h (formula,
 *                                 constants in fields of zd__adam_group_t, the arrays it writes)
 *   kernels/optim.h               its row of ZD__OPTIMIZERS (and its line in the list above);
 *                                 kernels/meson.build builds <k>.c per ISA from the rows
 *   client/include/zerod/zerod.h  its row of ZD_OPTIMIZERS: ZD_<NAME>, libzerod's constant and
 *                                 the daemon's check of a group's optimizer
 *   proto/zerod.proto             its value in enum Optimizer
 *   client/python/zerod/optim.py  zerod.torch.Zero<Name> and its zerod.optim.TABLE row (torch
 *                                 class, state arrays by torch's names and the groups that keep
 *                                 each, whether torch counts steps), from which zerod.checkpoint
 *                                 exports to and imports from the torch optimizer
 * plus the ABI baseline regenerated (client/abi/libzerod.abi: one enumerator). One that needs a
 * new state array or hyperparameter adds its row to common/state.h or common/group.h too.
 */
#ifndef ZD_KERNELS_OPTIM_H
#define ZD_KERNELS_OPTIM_H

#include <math.h> /* before extern "C": C++ math.h holds templates */
#include <stdint.h>
#include <string.h>

#include "zerod/zerod.h"

#ifdef __cplusplus
extern "C" {
#endif

/* adam.h inside the block, as adam_cuda.h includes it: its functions are C's in C++ too. */
#include "adam.h"
#include "state.h"

/* X(OPTIMIZER, k): zd_optimizer_t ZD_<OPTIMIZER> is stepped by kernel family k. */
/* clang-format off */
#define ZD__OPTIMIZERS(X) \
  X(ADAMW, adam) \
  X(ADAM, adam) \
  X(SGD, sgd) \
  X(ADAGRAD, adagrad) \
  X(RMSPROP, rmsprop) \
  X(LION, lion)
/* clang-format on */

/* Each row's family functions, declared once per row (C allows a family that steps several
 * optimizers to be declared again). */
#define ZD__OPTIM_DECLARE(opt, k)                                                     \
  void zd__##k##_consts(zd__adam_group_t *c, const zd_group_t *hp, uint64_t step);    \
  zd__adam_fn zd__##k##_impl(zd__isa_t isa);                                          \
  zd__states_t zd__##k##_writes(const zd__adam_group_t *c);                           \
  void zd__##k##_step_ref(const zd__adam_args_t *a, uint64_t begin, uint64_t end);    \
  void zd__##k##_step_avx2(const zd__adam_args_t *a, uint64_t begin, uint64_t end);   \
  void zd__##k##_step_avx512(const zd__adam_args_t *a, uint64_t begin, uint64_t end); \
  void zd__##k##_step_avx512bf16(const zd__adam_args_t *a, uint64_t begin, uint64_t end);
ZD__OPTIMIZERS(ZD__OPTIM_DECLARE)
#undef ZD__OPTIM_DECLARE

/* The update of every optimizer of the table for an ISA: each run of segments goes to its
 * optimizer's kernel (above). For a model whose groups are all AdamW/Adam it computes what
 * zd__adam_impl(isa) computes, bit for bit. */
zd__adam_fn zd__optim_impl(zd__isa_t isa);

/* The state arrays a group's kernel writes (the row's zd__<k>_writes; c->optimizer picks it). */
zd__states_t zd__optim_writes(const zd__adam_group_t *c);

/* The state arrays (common/state.h) group g keeps: those its row's kernel writes for it
 * (zd__<k>_writes), the master weights included. An optimizer's arrays are the table's, nothing
 * else lists them: SGD without momentum keeps the master weights alone. */
zd__states_t zd__optim_group_states(const zd_group_t *g);

/* The arrays a model with these groups has: those every model has (zd__states_always) and those
 * some group keeps (zd__optim_group_states). */
zd__states_t zd__optim_states(const zd_group_t *groups, uint32_t ngroups);

/* The first array that groups keep and `have` lacks, or -1 when none. */
int zd__optim_states_missing(zd__states_t have, const zd_group_t *groups, uint32_t ngroups);

/* Whether the table has a row for optimizer (a zd_optimizer_t value). */
int zd__optim_known(int optimizer);

/* The table's name of a kernel family of optimizer ("adam", "sgd"); NULL for none. */
const char *zd__optim_kernel_name(int optimizer);

#ifdef __cplusplus
}
#endif

#endif /* ZD_KERNELS_OPTIM_H */
