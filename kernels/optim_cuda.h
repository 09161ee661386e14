/* The CUDA update of every optimizer of the table (kernels/optim.h): one launcher per kernel
 * family, declared from the table's rows, and the dispatch of a step's groups to them.
 *
 * Families: adam is adam_cuda.h's zd__cuda_adam_step (adam.cu); sgd, adagrad, rmsprop and lion
 * are optim.cu's, each element by the formula of its CPU reference file (sgd.c, adagrad.c,
 * rmsprop.c, lion.c) operation for operation, with the host's rounding: explicit IEEE intrinsics
 * (__fmaf_rn where the reference has fmaf, __fmul_rn, __fadd_rn, __fsub_rn, __fdiv_rn,
 * __fsqrt_rn for every other operation, never contracted), built with the root meson.build's
 * -fmad=false -ftz=false -prec-div=true -prec-sqrt=true. Each gives zd__<k>_step_ref's bits for
 * every element (a NaN may differ in payload and sign). sqrt_mode ZD_SQRT_MKL_EX (rsqrtps, an x86
 * instruction's bits) is refused for the families with a square root (adam, adagrad, rmsprop).
 *
 * Every launcher takes the layout (adam_cuda.h: its tile table, built once per range) and
 * zd__cuda_adam_args_t: the state arrays by role (common/state.h; those a family does not use may
 * be NULL, those it needs must be there, as on the CPU), the gradient factor or the device
 * decision, the groups' constants (host groups inline, or d_groups), d_map (per-parameter
 * constants and skipped parameters: cuda_plan.h), and `optimizers`, the mask of the optimizers
 * whose tiles it updates (0: all). The other families' kernels are not tuned as adam's is (one
 * element per thread and iteration, coalesced, no vectors).
 */
#ifndef ZD_KERNELS_OPTIM_CUDA_H
#define ZD_KERNELS_OPTIM_CUDA_H

#include <cuda_runtime_api.h>
#include <math.h> /* before extern "C": C++ math.h holds templates */
#include <stdint.h>

#include "adam_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

#include "optim.h"

/* A family's launcher: queues its update of the tiles of its groups (a->optimizers) over the
 * layout. Errors as zd__cuda_adam_step's: -EINVAL (a missing array the family's groups need, bad
 * arguments), ZD_EDTYPE, ZD_EHPARAM (sqrt_mode MKL_EX where the formula has a sqrt),
 * ZD_EBACKEND. */
typedef int (*zd__cuda_step_fn)(const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a,
                                cudaStream_t stream, zd__err_t *err);

/* zd__cuda_<k>_step for every family k of the table's rows (zd__cuda_adam_step is adam's).
 * Weak: a row whose family has no CUDA kernel yet still links; its launcher is then NULL, and a
 * CUDA zerod refuses its groups at their first step (zd__cuda_optim_step). */
#define ZD__OPTIM_CUDA_DECLARE(opt, k)                                         \
  __attribute__((weak)) int zd__cuda_##k##_step(const zd__cuda_layout_t *l,    \
                                                const zd__cuda_adam_args_t *a, \
                                                cudaStream_t stream, zd__err_t *err);
ZD__OPTIMIZERS(ZD__OPTIM_CUDA_DECLARE)
#undef ZD__OPTIM_CUDA_DECLARE

/* The update of a step: for each family that some group of a->groups (host memory, required:
 * the dispatch reads it; d_groups, when set, is the launch's copy) uses, its launcher with
 * `optimizers` that family's mask (zd__optim_family_mask), in the order the groups first name the
 * families (their tiles are disjoint: the order changes no bit); a group whose optimizer has no
 * row is refused (-EINVAL). Under a map (d_map) every group is
 * dispatched, also those no entry names. For a model whose groups are all AdamW/Adam this is one
 * zd__cuda_adam_step, as before the table. Stops at the first error. */
int zd__cuda_optim_step(const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a,
                        cudaStream_t stream, zd__err_t *err);

/* The grid (blocks) family k's kernel launches on this layout for these arguments (for tests and
 * benchmarks; 0 for a dtype it does not take, or a family with no kernel here: adam's is
 * zd__cuda_adam_grid). optimizer: a row of the family. */
unsigned zd__cuda_optim_grid(const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a,
                             int optimizer);

#ifdef __cplusplus
}
#endif

#endif /* ZD_KERNELS_OPTIM_CUDA_H */
