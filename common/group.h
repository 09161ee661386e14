/* The hyperparameters of a parameter group (zd_group_t in zerod/zerod.h), as one table.
 *
 * Everything that lists the fields of a group is generated from ZD__GROUP_FIELDS: the defaults
 * (zd__group_default, and libzerod's zd_group_init), the validation and its messages
 * (zd__group_check, run by the daemon on every group a register or a step carries), the group's
 * part of the hash that the ranks of a world compare before each step (zd__group_hash), the wire
 * conversion both ways (proto/wire.c: the fields of message Group in proto/zerod.proto have the C
 * names) and the description libzerod exports (zd_group_fields), from which the Python package
 * builds its ctypes mirror of zd_group_t and takes the names it reads in a torch parameter group.
 *
 * Adding a hyperparameter touches four files: its field at the end of zd_group_t (zerod.h: at or
 * after the end of the structure before it, so that an older client's group_size leaves it out;
 * docs/abi.md), its row here,
 * the same name in message Group (zerod.proto: an optional field whose [default] is the row's
 * default, so that older clients still register), and its effect on the kernels' per-step
 * constants (zd__adam_group_init, kernels/adam.c). group.c checks at compile time that the table
 * and zd_group_t agree on names, types and order.
 */
#ifndef ZD_COMMON_GROUP_H
#define ZD_COMMON_GROUP_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "zerod/zerod.h"

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, KIND, valid, expected, default), in zd_group_t's order:
 *   KIND      DOUBLE: a double, which must also be finite; ENUM: an int-sized enum; BOOL: an int
 *             (zd_field_kind_t ZD_FIELD_<KIND> in zerod.h)
 *   valid     the condition zd__group_check requires of v, the field's value
 *   expected  what its error message says is expected ("group 1: lr is -1; expected a finite
 *             value >= 0")
 *   default   zd__group_default()'s value: torch.optim.AdamW's (and for the fields only SGD
 *             reads, torch.optim.SGD's)
 * One row per line, unaligned, so that adding a field adds a line (and a backslash to the one
 * before). */
/* The optimizer row's check and message, from zerod.h's list (ZD_OPTIMIZERS): "one of ADAMW (0)
 * ADAM (1) ...". */
#define ZD__GROUP_IS_OPTIMIZER(name, value)   || v == ZD_##name
#define ZD__GROUP_OPTIMIZER_NAME(name, value) " " #name " (" #value ")"
/* clang-format off */
#define ZD__GROUP_FIELDS(X) \
  X(lr, DOUBLE, v >= 0, "a finite value >= 0", 1e-3) \
  X(beta1, DOUBLE, v >= 0 && v < 1, "a value in [0, 1)", 0.9) \
  X(beta2, DOUBLE, v >= 0 && v < 1, "a value in [0, 1)", 0.999) \
  X(eps, DOUBLE, v > 0, "a finite value > 0", 1e-8) \
  X(weight_decay, DOUBLE, v >= 0, "a finite value >= 0", 1e-2) \
  X(optimizer, ENUM, 0 ZD_OPTIMIZERS(ZD__GROUP_IS_OPTIMIZER), "one of" ZD_OPTIMIZERS(ZD__GROUP_OPTIMIZER_NAME), ZD_ADAMW) \
  X(maximize, BOOL, v == 0 || v == 1, "0 or 1", 0) \
  X(update, ENUM, v == ZD_UPDATE_TORCH113 || v == ZD_UPDATE_TORCH2 || v == ZD_UPDATE_TORCH2_CUDA || v == ZD_UPDATE_TORCH2_CUDA_FOREACH || v == ZD_UPDATE_TORCH2_CUDA_FUSED, "TORCH113 (0), TORCH2 (1), TORCH2_CUDA (2), TORCH2_CUDA_FOREACH (3) or TORCH2_CUDA_FUSED (4)", ZD_UPDATE_TORCH113) \
  X(sqrt_mode, ENUM, v == ZD_SQRT_EXACT || v == ZD_SQRT_MKL_EX, "EXACT (0) or MKL_EX (1)", ZD_SQRT_EXACT) \
  X(amsgrad, BOOL, v == 0 || v == 1, "0 or 1", 0) \
  X(momentum, DOUBLE, v >= 0, "a finite value >= 0", 0) \
  X(dampening, DOUBLE, 1, "a finite value", 0) \
  X(nesterov, BOOL, v == 0 || v == 1, "0 or 1", 0) \
  X(lr_decay, DOUBLE, v >= 0, "a finite value >= 0", 0) \
  X(initial_accumulator_value, DOUBLE, v >= 0, "a finite value >= 0", 0) \
  X(alpha, DOUBLE, v >= 0, "a finite value >= 0", 0.99) \
  X(centered, BOOL, v == 0 || v == 1, "0 or 1", 0)
/* clang-format on */

/* The smallest zd_group_t a caller may pass (zd_model_desc_t.group_size): lr to weight_decay, the
 * fields message Group requires (zerod.proto); every later field has a default. */
#define ZD__GROUP_MIN_SIZE (offsetof(zd_group_t, weight_decay) + sizeof(double))

/* zd_group_t with every field at its default (the table's). */
zd_group_t zd__group_default(void);

/* Checks every field of g against its row: ZD_OK, or ZD_EHPARAM for the first field that fails,
 * with a message prefixed by `where` ("group 1: lr is -1; expected a finite value >= 0"). */
int zd__group_check(const zd_group_t *g, const char *where, zd__err_t *err);

/* Folds g's fields, in table order, into the FNV-1a hash h (doubles as their 8 bytes, the other
 * kinds as an int32_t): two groups hash alike exactly when every field has the same bits. */
uint64_t zd__group_hash(uint64_t h, const zd_group_t *g);

#ifdef __cplusplus
}
#endif

#endif /* ZD_COMMON_GROUP_H */
