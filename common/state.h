/* The optimizer state of a shard, as one table: the fp32 arrays a rank holds for its slice of the
 * model (master weights, and the optimizer's own arrays), each with its role, torch's name for it
 * in optimizer.state_dict() and when a model has it.
 *
 * Everything that lists the arrays is generated from ZD__STATE_ARRAYS: the daemon allocates the
 * arrays a model's groups need and hands them to the compute backends and kernels by role, the
 * checkpoint's rank files hold one tensor per array by its name (the manifest says which optional
 * arrays a checkpoint has), exports and imports name them "<param>.<name>", and the status reports
 * their bytes. Adding a state array is a row here and its use in the kernels.
 */
#ifndef ZD_COMMON_STATE_H
#define ZD_COMMON_STATE_H

#include <stdint.h>

#include "zerod/zerod.h"

/* X(ROLE, name, optional, needed), in the order arrays are allocated and written:
 *   ROLE      the enum constant ZD__STATE_<ROLE>
 *   name      torch's state name ("exp_avg"), the checkpoint tensor's name
 *   optional  0: every model has the array; 1: only a model whose groups need it
 *   needed    for an optional array, an expression of g (const zd_group_t *): whether group g
 *             needs it. A model has it when one of its groups does at registration and keeps it
 *             for its life (a group may turn amsgrad off and on again, as in torch); a step or
 *             resume whose groups need an array the model lacks is refused (torch raises
 *             KeyError). */
/* clang-format off */
#define ZD__STATE_ARRAYS(X) \
  X(MASTER, "master", 0, 1) \
  X(EXP_AVG, "exp_avg", 0, 1) \
  X(EXP_AVG_SQ, "exp_avg_sq", 0, 1) \
  X(MAX_EXP_AVG_SQ, "max_exp_avg_sq", 1, g->amsgrad) \
  X(MOMENTUM_BUFFER, "momentum_buffer", 1, (g->optimizer == ZD_SGD || g->optimizer == ZD_RMSPROP) && g->momentum != 0) \
  X(SUM, "sum", 1, g->optimizer == ZD_ADAGRAD) \
  X(SQUARE_AVG, "square_avg", 1, g->optimizer == ZD_RMSPROP) \
  X(GRAD_AVG, "grad_avg", 1, g->optimizer == ZD_RMSPROP && g->centered)
/* clang-format on */

typedef enum zd__state {
#define ZD__STATE_ENUM(role, name, optional, needed) ZD__STATE_##role,
  ZD__STATE_ARRAYS(ZD__STATE_ENUM)
#undef ZD__STATE_ENUM
      ZD__NSTATES
} zd__state_t;

/* A set of state arrays: bit s for zd__state_t s. */
typedef uint32_t zd__states_t;
#define ZD__STATE_BIT(s) ((zd__states_t)1 << (s))

/* The arrays every model has, whatever its groups (the rows that are not optional). */
zd__states_t zd__states_always(void);

/* The arrays a model with these groups has: zd__states_always() and those some group needs. */
zd__states_t zd__states_needed(const zd_group_t *groups, uint32_t ngroups);

/* The first optional array that groups need and `have` lacks, or -1 when none. */
int zd__states_missing(zd__states_t have, const zd_group_t *groups, uint32_t ngroups);

/* The name of array s ("exp_avg"); NULL for a value out of range. */
const char *zd__state_name(zd__state_t s);

/* The array named name, or -1 when no row has that name. */
int zd__state_by_name(const char *name);

#endif /* ZD_COMMON_STATE_H */
