/* The host side of the CUDA update that needs no GPU (plain C, built into the CPU kernels and
 * tested by tests/unit/test_cuda_plan.c): which kernels of the optimizers' table a step launches,
 * and how a step whose parameters are not all at the model's step reaches the device.
 *
 * Families. zd__cuda_optim_step (optim_cuda.h) launches one kernel per kernel family of the table
 * (kernels/optim.h: adam, sgd, adagrad, rmsprop, lion) that some group uses, each over the whole
 * layout, told which optimizers are its own (zd__optim_family_mask): a tile of another family's
 * group is left to that family's kernel.
 *
 * Presence and per-parameter step counts (daemon/step/step.c, uneven_build): such a step hands
 * the backend a shard whose segments are rebuilt per parameter, the skipped parameters left out,
 * the others naming constants of their own step count. The device's tile tables are built once at
 * registration, so the CUDA backend keeps a second layout per bucket with one segment per
 * parameter whose group is the parameter's index (zd__cuda_param_segments), and, for such a step,
 * uploads a map from parameter index to constants index, ZD__CUDA_SKIP for a skipped parameter
 * (zd__cuda_param_map), which the kernels read per tile (zd__cuda_adam_args_t.d_map).
 */
#ifndef ZD_KERNELS_CUDA_PLAN_H
#define ZD_KERNELS_CUDA_PLAN_H

#include <stdint.h>

#include "error.h"
#include "layout.h"
#include "segment.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A map entry: the parameter is skipped this step. */
#ifndef ZD__CUDA_SKIP
#define ZD__CUDA_SKIP UINT32_MAX
#endif

/* The optimizers (bit 1 << ZD_<OPT>) that the kernel family of `optimizer`'s row of the table
 * steps (ZD_ADAMW's: ZD_ADAMW and ZD_ADAM); 0 for a value with no row. */
uint32_t zd__optim_family_mask(int optimizer);

/* The segments of rank's slice of bucket b, one per parameter with elements there, in order,
 * offsets relative to the slice's start and group the parameter's index in l (l->nparams at
 * most). out: room for the bucket's nparams segments (at least 1). Returns how many. */
uint32_t zd__cuda_param_segments(const zd__layout_t *l, uint32_t rank, uint32_t b,
                                 zd__segment_t *out);

/* The map of a step from the segments of every bucket of rank's slice (segs[b], nsegs[b], as
 * step.c hands them to the backend): map[i] for every parameter i of l (l->nparams entries) is
 * the group of the segment that covers parameter i's part of the slice, or ZD__CUDA_SKIP where
 * no segment covers it (a skipped parameter, or one with no element in the slice). Errors:
 * ZD_EINTERNAL when a segment covers part of a parameter only, or names a group >= ngroups. */
int zd__cuda_param_map(const zd__layout_t *l, uint32_t rank, const zd__segment_t *const *segs,
                       const uint32_t *nsegs, uint32_t ngroups, uint32_t *map, zd__err_t *err);

#ifdef __cplusplus
}
#endif

#endif /* ZD_KERNELS_CUDA_PLAN_H */
