/* The optimizer state of a shard, as one table: the fp32 arrays a rank holds for its slice of the
 * model (master weights, and the optimizer's own arrays), each with its role, torch's name for it
 * in optimizer.state_dict() and when a model has it.
 *
 * Everything that lists the arrays is generated from ZD__STATE_ARRAYS: the daemon allocates the
 * arrays a model's groups need and hands them to the compute backends and kernels by role, the
 * checkpoint's rank files hold one tensor per array by its name (the manifest says which optional
 * arrays a checkpoint has), exports and imports name them "<param>.<name>", and the status reports
 * their bytes. Which arrays a model has is its optimizers' (the table in kernels/optim.h), so that
an SGD model without momentum holds its master weights and nothing else. Adding a state array is
a row here and its use in the kernels.
 */
#ifndef ZD_COMMON_STATE_H
#define ZD_COMMON_STATE_H

#include <stdint.h>

#include "zerod/zerod.h"

/* X(ROLE, name, always, legacy), in the order arrays are allocated and written:
 *   ROLE      the enum constant ZD__STATE_<ROLE>
 *   name      torch's state name ("exp_avg"), the checkpoint tensor's name
 *   always    1: every model has the array (the master weights); 0: a model has it when one of
 *             its groups' optimizers keeps it, as the optimizers' table says (kernels/optim.h:
 *             the arrays a row's kernel writes for the group, zd__optim_states). A model has the
 *             arrays its groups keep at registration for its life (a group may turn amsgrad off
 *             and on again, as in torch); a step or resume whose groups need an array the model
 *             lacks is refused (torch raises KeyError).
 *   legacy    1: a checkpoint manifest that does not name the array has it (exp_avg and
 *             exp_avg_sq, which every model held before the arrays followed the optimizer); a
 *             manifest names such an array only when it lacks it ("exp_avg": false) */
/* clang-format off */
#define ZD__STATE_ARRAYS(X) \
  X(MASTER, "master", 1, 1) \
  X(EXP_AVG, "exp_avg", 0, 1) \
  X(EXP_AVG_SQ, "exp_avg_sq", 0, 1) \
  X(MAX_EXP_AVG_SQ, "max_exp_avg_sq", 0, 0) \
  X(MOMENTUM_BUFFER, "momentum_buffer", 0, 0) \
  X(SUM, "sum", 0, 0) \
  X(SQUARE_AVG, "square_avg", 0, 0) \
  X(GRAD_AVG, "grad_avg", 0, 0)
/* clang-format on */

typedef enum zd__state {
#define ZD__STATE_ENUM(role, name, always, legacy) ZD__STATE_##role,
  ZD__STATE_ARRAYS(ZD__STATE_ENUM)
#undef ZD__STATE_ENUM
      ZD__NSTATES
} zd__state_t;

/* A set of state arrays: bit s for zd__state_t s. */
typedef uint32_t zd__states_t;
#define ZD__STATE_BIT(s) ((zd__states_t)1 << (s))

/* The arrays every model has, whatever its groups (the rows with `always`). Which others a
 * model has is its optimizers' (zd__optim_states, kernels/optim.h). */
zd__states_t zd__states_always(void);

/* The arrays a checkpoint manifest has when it names none (the rows with `legacy`). */
zd__states_t zd__states_legacy(void);

/* The name of array s ("exp_avg"); NULL for a value out of range. */
const char *zd__state_name(zd__state_t s);

/* The array named name, or -1 when no row has that name. */
int zd__state_by_name(const char *name);

#endif /* ZD_COMMON_STATE_H */
