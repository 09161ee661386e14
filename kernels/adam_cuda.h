/* The CUDA optimizer kernels (kernels/adam.cu, kernels/decide.cu): host-callable C API.
 *
 * What runs on the device each step, stream-ordered:
 *   zd__cuda_grad_stats   sum of squares and non-finite count of a shard's gradients, per range,
 *                         into this rank's step record in device memory, sealed with its check
 *                         word (all-gather the records of all ranks with NCCL);
 *   zd__cuda_step_decide  the step's decision from the gathered records (kernels/step_decide.h:
 *                         the records' checks, the ranks' agreement, zd__step_decide), into a
 *                         small struct in device memory, without the host reading anything back;
 *                         or the host reads the records back and decides itself, with the same
 *                         functions;
 *   zd__cuda_adam_step    the fused AdamW/Adam update of a range, with the gradient factor the
 *                         decision gave: from the host (grad_scale), or from the device decision
 *                         (d_decision: the update then runs only if the verdict is APPLY).
 *
 * Bitwise contract: zd__cuda_adam_step gives the bits of zd__adam_step_ref (kernels/adam.h) for
 * every element (a NaN may carry another payload or sign: the GPU makes canonical NaNs);
 * zd__cuda_grad_stats gives the block sums of zd__grad_stats_ref, added as zd__grad_stats_sum
 * does (pairwise by levels); zd__cuda_step_decide gives zd__step_decide_records' decision.
 *
 * Conventions: every launcher takes an explicit stream (never the legacy default stream: pass a
 * stream created by the caller), checks the launch, and returns ZD_OK or an error code with a
 * message in *err (err may be NULL): -EINVAL for bad arguments, ZD_EDTYPE for a dtype the kernel
 * does not take, -ENOMEM when device or host memory runs out, ZD_EBACKEND for any other CUDA
 * failure (the message names the CUDA error). Launchers never synchronise and never allocate;
 * errors of the kernels themselves surface at the caller's next synchronisation, as with any
 * CUDA work. Functions are thread-safe; a layout must be used by one stream at a time.
 *
 * Device pointers: 16-byte aligned ranges (cudaMalloc'd buffers at offsets that are multiples of
 * 8 elements: the layout's 64-element alignment guarantees it) run the vectorised path; any other
 * alignment still gives the same bits through a scalar (element by element) path, slower.
 */
#ifndef ZD_KERNELS_ADAM_CUDA_H
#define ZD_KERNELS_ADAM_CUDA_H

#include <cuda_runtime_api.h>
#include <math.h> /* before extern "C": C++ math.h holds templates */
#include <stddef.h>
#include <stdint.h>

#include "step_decide.h" /* the record, the decision: plain C, also without CUDA */
#include "zerod/zerod.h"

#ifdef __cplusplus
extern "C" {
#endif

#include "adam.h"
#include "error.h"

/* ---- availability -------------------------------------------------------------------------- */

/* Number of CUDA devices this build can run its kernels on (compute capability 9.0 or later:
 * code for sm_90 and PTX for compute_90 are built in). 0 when there is none, with the reason in
 * why ("no NVIDIA driver is loaded", "the NVIDIA driver supports CUDA 12.2; this zerod needs
 * 13.0", "no CUDA device is visible (CUDA_VISIBLE_DEVICES=...)", "GPU 0 (...) has compute
 * capability 8.0; ..."); when some devices are usable and others are not, why names the others.
 * why may be NULL. Creates no context; safe to call from any thread, at any time. */
int zd__cuda_available(char *why, size_t len);

/* ZD_OK if `device` can run the kernels, else ZD_EBACKEND with the reason in *err. */
int zd__cuda_device_check(int device, zd__err_t *err);

/* Loads every kernel of this API (adam.cu's and decide.cu's) on the current device now
 * (cudaFuncGetAttributes), rather than at its first launch or occupancy query: a lazy load waits
 * for the device's queued work, which in zerod may be a wait for a client's event or a peer. Call
 * while nothing is queued (a rank's start), before the first zd__cuda_layout_create. */
int zd__cuda_kernels_preload(zd__err_t *err);

/* ---- layouts --------------------------------------------------------------------------------- */

/* Tiles of at most this many elements, cut at multiples of it and at segment boundaries, are
 * the unit of work of the update kernel. */
#define ZD__CUDA_TILE 8192

/* The device-side description of one contiguous range of a shard: its segments (kernels/
 * segment.h), the update's tile table and the scratch of the statistics. Built once per range
 * (per bucket of a rank) when the model is registered; every step then costs O(1) host work. */
typedef struct zd__cuda_layout zd__cuda_layout_t;

/* Builds the layout of a range of n elements covered by segs (sorted by offset, disjoint, inside
 * [0, n); lengths may be 0) on the current device. Allocates device memory (cudaMalloc) and
 * copies the tables with `stream`, then waits for that stream: a set-up call, not for the hot
 * path. Errors: -EINVAL (segments out of order, overlapping or outside the range), -ENOMEM,
 * ZD_EBACKEND. */
int zd__cuda_layout_create(const zd__segment_t *segs, uint32_t nsegs, uint64_t n,
                           cudaStream_t stream, zd__cuda_layout_t **out, zd__err_t *err);

/* Frees a layout (NULL is fine). No kernel using it may still be queued or running: cudaFree
 * does not wait for other streams' work in every case. */
void zd__cuda_layout_destroy(zd__cuda_layout_t *l);

/* Elements, tiles and statistics blocks of a layout; the number of groups its segments refer to
 * (highest group index + 1). */
uint64_t zd__cuda_layout_elems(const zd__cuda_layout_t *l);
uint64_t zd__cuda_layout_tiles(const zd__cuda_layout_t *l);
uint64_t zd__cuda_layout_stats_blocks(const zd__cuda_layout_t *l);
uint32_t zd__cuda_layout_groups(const zd__cuda_layout_t *l);

/* How the kernels cover the layout. The grids are sized from the kernels' occupancy, once per
 * layout (zd__cuda_layout_create): the update's is min(tiles, SMs x resident blocks per SM of
 * that variant of the kernel), the statistics' min(blocks needed, SMs x resident blocks per SM);
 * blocks stride over the rest, and the bits do not depend on the grid.
 * zd__cuda_layout_grids gives the largest update grid over the kernel's variants and the most
 * statistics blocks one pass of the statistics grid covers (over the grad dtypes): a range with
 * more tiles (statistics blocks) makes blocks stride in every variant. For tests and
 * diagnostics. */
void zd__cuda_layout_grids(const zd__cuda_layout_t *l, unsigned *adam_blocks,
                           uint64_t *stats_per_pass);

/* The per-block sums (zd__cuda_layout_stats_blocks doubles, device memory) the last
 * zd__cuda_grad_stats call on this layout left: block k is zd__grad_stats_ref's sums[k]. For
 * tests and diagnostics; valid once that call has completed. Tests may write their own values
 * there (stream-ordered) and add them with zd__cuda_stats_sum. */
double *zd__cuda_layout_block_sums(const zd__cuda_layout_t *l);

/* ---- the update ------------------------------------------------------------------------------ */

/* Groups passed by value in the kernel's arguments (no copy, nothing to keep alive). More groups
 * need a device array (d_groups), which zd__cuda_groups_upload fills stream-ordered. */
#define ZD__CUDA_GROUPS_INLINE 64

typedef struct zd__cuda_adam_args {
  /* The shard's state arrays by role (common/state.h), device, the range's n elements, updated in
   * place. max_exp_avg_sq may be NULL: the model has none. It is required when a group has amsgrad
   * (checked for host groups; a device group's amsgrad without it is the caller's bug: it is
   * ignored). */
  float *state[ZD__NSTATES];
  const void *grad; /* device; ZD_F32, ZD_BF16 or ZD_F16 */
  zd_dtype_t grad_dtype;
  void *param;            /* device; working parameters written back; NULL: none */
  zd_dtype_t param_dtype; /* ZD_F32 or ZD_BF16 (ignored without param) */
  float grad_scale;       /* the gradient factor (unscale, mean, clip); see d_decision */
  /* NULL: the update runs with grad_scale. Else a decision in device memory
   * (zd__cuda_step_decide, queued before on the same stream): the update does nothing at all
   * unless its verdict is ZD__VERDICT_APPLY, and multiplies the gradients by its dec.grad_scale
   * (grad_scale is ignored). Each block reads it once, when it starts. */
  const zd__cuda_decision_t *d_decision;
  /* This step's constants of each group (zd__adam_group_init on the host). ngroups must cover
   * every group the layout's segments name. With ngroups <= ZD__CUDA_GROUPS_INLINE and d_groups
   * NULL, groups (host memory) is copied into the launch: the caller may reuse it as soon as the
   * call returns. Otherwise d_groups (device memory, read when the kernel runs) is used.
   * The constants depend on the number of the step being applied (bias corrections). */
  const zd__adam_group_t *groups;
  const zd__adam_group_t *d_groups;
  uint32_t ngroups;
  /* NULL: a tile's constants are groups[its segment's group]. Else (device memory, nmap entries
   * covering every group index the layout's segments name) they are groups[d_map[its segment's
   * group]], and a tile whose entry is ZD__CUDA_SKIP is not read or written at all: with a layout
   * of one segment per parameter (group: the parameter's index, kernels/cuda_plan.h) this steps
   * each parameter with the constants of its own step count, or skips it (parameters without a
   * gradient, daemon/step/step.c). Filled stream-ordered by zd__cuda_map_upload. */
  const uint32_t *d_map;
  uint32_t nmap;
  /* 0: every covered tile. Else the tiles of groups whose optimizer's bit (1 << ZD_<OPT>) is set
   * only, the others left alone: the family's share of a model whose groups use several kernels
   * (zd__cuda_optim_step, kernels/optim_cuda.h). */
  uint32_t optimizers;
} zd__cuda_adam_args_t;

/* A d_map entry: the tile's parameter is skipped this step (kernels/cuda_plan.h). */
#ifndef ZD__CUDA_SKIP
#define ZD__CUDA_SKIP UINT32_MAX
#endif

/* Queues a copy of n map entries from host memory into d_map (device), carried in the arguments
 * of small kernels as zd__cuda_groups_upload's groups are: stream-ordered, no pinned memory, the
 * host array reusable on return. Errors: -EINVAL, ZD_EBACKEND. */
int zd__cuda_map_upload(uint32_t *d_map, const uint32_t *map, uint32_t n, cudaStream_t stream,
                        zd__err_t *err);

/* Queues the AdamW/Adam update of every element the layout's segments cover (those of d_map's
 * skipped entries and of other optimizers' groups, with `optimizers`, excepted); other elements
 * (padding) are not read or written, in any array. The arrays must not overlap one another.
 * Host `groups` are checked (also where d_groups is the launch's copy). Errors: -EINVAL,
 * ZD_EDTYPE, ZD_EHPARAM (an Adam group of `groups` with sqrt_mode ZD_SQRT_MKL_EX, whose rsqrtps
 * bits the GPU cannot reproduce), ZD_EBACKEND (launch failed). The other optimizers' kernels and
 * the dispatch by the optimizers' table: kernels/optim_cuda.h. */
int zd__cuda_adam_step(const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a,
                       cudaStream_t stream, zd__err_t *err);

/* The grid (blocks) zd__cuda_adam_step launches on this layout with these arguments: the
 * occupancy of the kernel variant their grad dtype, param dtype (or none) and max_exp_avg_sq
 * (or none) select (zd__cuda_layout_grids). For benchmarks and diagnostics; 0 for a dtype the
 * kernel does not take. */
unsigned zd__cuda_adam_grid(const zd__cuda_layout_t *l, const zd__cuda_adam_args_t *a);

/* Queues a copy of n group constants from host memory into d_groups (device), carried in the
 * arguments of small kernels: stream-ordered, no pinned memory, the host array reusable on
 * return. For more than ZD__CUDA_GROUPS_INLINE groups. Errors: -EINVAL, ZD_EHPARAM (as
 * zd__cuda_adam_step), ZD_EBACKEND. */
int zd__cuda_groups_upload(zd__adam_group_t *d_groups, const zd__adam_group_t *groups, uint32_t n,
                           cudaStream_t stream, zd__err_t *err);

/* ---- statistics and decision ----------------------------------------------------------------- */

/* The record (zd__cuda_stats_t, 48 bytes), its check word (zd__record_check) and the decision's
 * types (zd__cuda_decision_t, zd__cuda_decide_args_t, zd__step_verdict_t) are
 * kernels/step_decide.h's: plain C, which host code and CPU tests use without CUDA. */

/* Queues the statistics of the gradients of a range (grad: device, the range's n elements, all
 * readable; only covered elements count) into *d_out (device): with accumulate,
 * d_out->sumsq += range sum and d_out->nonfinite += range count, as the CPU step adds bucket
 * after bucket; without, they are overwritten. tags (host, ZD__CUDA_TAGS words, copied into the
 * launch) are written to d_out->tags unless NULL. The last kernel of every call seals the record:
 * d_out->check = zd__record_check(d_out) over the record as that call leaves it, so after the
 * last range of a step the record is ready to all-gather, with no other launch
 * (zd__cuda_record_seal is for records written otherwise). Kernels: one per-block pass over the
 * gradients, then the block sums added pairwise by levels (adam.h): one launch per 2048-fold
 * reduction beyond the first (none up to 2048 statistics blocks, 4M gradients; one more up to 8G
 * gradients), then one block for the last level, the record and its check. Errors: -EINVAL,
 * ZD_EDTYPE, ZD_EBACKEND. */
int zd__cuda_grad_stats(zd__cuda_layout_t *l, const void *grad, zd_dtype_t grad_dtype,
                        zd__cuda_stats_t *d_out, int accumulate, const uint64_t *tags,
                        cudaStream_t stream, zd__err_t *err);

/* The second half of zd__cuda_grad_stats alone: adds the layout's block sums and counts, as the
 * last zd__cuda_grad_stats left them (or as a test wrote the sums: zd__cuda_layout_block_sums),
 * into *d_out with the same accumulate, tags and seal. For tests of the summation order at sizes
 * whose gradients would not fit in memory. Errors: -EINVAL, ZD_EBACKEND. */
int zd__cuda_stats_sum(zd__cuda_layout_t *l, zd__cuda_stats_t *d_out, int accumulate,
                       const uint64_t *tags, cudaStream_t stream, zd__err_t *err);

/* Queues d_rec->check = zd__record_check(d_rec) (device memory; one thread). For a record that
 * zd__cuda_grad_stats did not write last, e.g. the host's record copied to the device when a
 * step needs no statistics. Errors: -EINVAL, ZD_EBACKEND. */
int zd__cuda_record_seal(zd__cuda_stats_t *d_rec, cudaStream_t stream, zd__err_t *err);

/* Queues the step's decision from the records at a->d_all (device, a->world_size of them, e.g.
 * where the all-gather put them) into *d_out (device): zd__step_decide_records (step_decide.h)
 * run by one device thread, a->cfg and a->st travelling by value in the launch (the caller may
 * reuse *a on return). The update of the step then takes it as its d_decision; the host may read
 * it back (sizeof(zd__cuda_decision_t) bytes) and recompute it with zd__step_decide_records from
 * the records read back, which gives the same decision (zd__cuda_decision_same). A receive buffer
 * filled with 0xFF bytes before the all-gather makes every record the gather did not write INVALID.
 * Errors: -EINVAL (no records or output, world_size 0, mine outside the world, the legacy
 * stream), ZD_EBACKEND. */
int zd__cuda_step_decide(const zd__cuda_decide_args_t *a, zd__cuda_decision_t *d_out,
                         cudaStream_t stream, zd__err_t *err);

#ifdef __cplusplus
}
#endif

#endif /* ZD_KERNELS_ADAM_CUDA_H */
