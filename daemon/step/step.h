/* Step logic: the operations a client drives on a rank's model (model.h).
 *
 *   attach   create the model from the client's parameters, or resume the one held (same layout)
 *   scatter  reduce-scatter the gradients of a bucket into this rank's shard
 *   step     global gradient statistics (norm, found-inf, agreement of all ranks), loss-scale skip,
 *            clipping, the fused AdamW/Adam update of the shard writing working parameters into
 *            the client's buffer, then gather
 *   gather   all-gather the updated parameters of a bucket into the client's buffer
 *
 * Everything runs on the thread running the rank's job (its worker, or the loop thread for a small
 * job of an idle world-size-1 CPU rank) and is the same for every backend and world size:
 * communication goes through zd__comm_t, state and kernels through zd__compute_t (compute.h). A
 * step is atomic: until every rank has agreed on the statistics (the commit point), a failure
 * leaves master, moments and step counter unchanged on every rank. Each public operation below
 * is one job: it starts with the backend's begin and ends with its finish, so that when it
 * returns nothing it queued is still running (the session may then release the buffers); `slot`
 * is the job's pair of the client's CUDA events (the request's event_slot; 0 with host buffers).
 *
 * At world size > 1 a client may leave in the middle of a step (docs/design.md, "When a trainer
 * dies"): its rank's worker then stands in for it (zd__model_stand_in) and the step is abandoned
 * on every rank (ZD_EABORTED) at the commit point, so that no rank applies it; the rank keeps the
 * client's param buffer, the full model, for the next client, which resumes alone.
 */
#ifndef ZD_DAEMON_STEP_H
#define ZD_DAEMON_STEP_H

#include <stdint.h>

#include "adam.h"
#include "comm.h"
#include "compute.h"
#include "model.h"
#include "shm.h"

/* What a step did, for its reply and the rank's stats. */
typedef struct zd__step_out {
  uint64_t step;
  int applied;
  double grad_norm; /* NaN when not computed (world size 1, no clipping, no loss scaling) */
  double loss_scale;
  double clip_coef;
  uint64_t duration_us;
  uint32_t idle_cpus; /* CPUs the step's kernel left idle (step_idle_cpus in rank.c) */
} zd__step_out_t;

/* Register. *model is the rank's model (NULL if none) and is resumed (same layout, spec->replace
 * not set) or replaced; takes spec. On success the client's param buffer holds the full model
 * and *resumed says whether state was kept.
 * A resume at world size > 1 with host buffers is local: the rank's kept param buffer (the last
 * client's) is copied into the client's, with no barrier and no collective, so that a restarted
 * trainer rejoins a world whose other ranks are training; it must use the model's dtypes
 * (ZD_EDTYPE otherwise: the other ranks' clients were not asked).
 * Everything else is collective: every rank must register the same model, and all resume the
 * same step or all start afresh. ZD_ELAYOUT when a different model is held and spec->replace is
 * not set, or when ranks registered different models. */
int zd__model_attach(const zd__step_ctx_t *ctx, zd__model_t **model, zd__model_spec_t *spec,
                     const zd__buffers_t *buf, uint32_t slot, int *resumed, zd__err_t *err);

/* bucket: index or -1 for all. ZD_EORDER-free: the session checked the index. next_groups
 * (NULL: none): the model's number of checked groups, the next step's as the trainer has them
 * (ScatterRequest.groups), which overlap_update's speculation of this step uses from here on
 * (copied; forgotten at the end of the step attempt). */
int zd__model_scatter(const zd__step_ctx_t *ctx, zd__model_t *model, const zd__buffers_t *buf,
                      uint32_t slot, int32_t bucket, const zd_group_t *next_groups, zd__err_t *err);
int zd__model_gather(const zd__step_ctx_t *ctx, zd__model_t *model, const zd__buffers_t *buf,
                     uint32_t slot, int32_t bucket, zd__err_t *err);

/* groups: NULL keeps the model's hyperparameters, else ngroups checked entries (copied).
 * clip_norm (checked): the norm this step clips by; a torch order is used where the backend
 * computes it (compute.h, torch_norm) at world size 1 with fp32 gradients, no loss scaler and
 * clipping on, else the double norm.
 * absent (NULL: none): the parameters without a gradient this step, one bit each in layout order
 * (StepRequest.absent), whose gradients the client zeroed. The ranks combine theirs as DDP does
 * (zd__model_t.lag): a parameter absent on every rank is skipped (its master weights, state and
 * step count untouched, its working parameters left as they are); one present somewhere is
 * stepped with the reduced gradient. Both backends skip, except the CUDA backend's step with
 * the decision on the device (cuda_step fast, statistics) at world size > 1, which steps an
 * absent parameter with its zero gradient (step.c, device_path_ok).
 * ZD_EABORTED when a rank's worker stood in for its client (zd__model_stand_in): nothing
 * applied, and every bucket must be scattered again. */
int zd__model_step(const zd__step_ctx_t *ctx, zd__model_t *model, const zd__buffers_t *buf,
                   uint32_t slot, const zd_group_t *groups, int scatter, int gather,
                   zd_clip_norm_t clip_norm, const uint8_t *absent, zd__step_out_t *out,
                   zd__err_t *err);

/* A checkpoint of the state as of the last step, asked by the client of every rank of the world
 * between the same two steps (zd_checkpoint: a collective, which first checks that every rank is
 * at the same step). wait: returns once the checkpoint is written (checkpoint.h); dir (len bytes)
 * names its directory; *step is its step. Errors: ZD_ECONFIG (no checkpoint_dir), ZD_ESTEP,
 * ZD_ECHECKPOINT, the communicator's. */
int zd__model_checkpoint(const zd__step_ctx_t *ctx, zd__model_t *model, int wait, char *dir,
                         size_t len, uint64_t *step, zd__err_t *err);

/* The rank's client left (abrupt: it disconnected, else it said bye), after its requests in
 * flight had run; world size > 1. Stands in for it in whatever the other ranks still do with
 * this rank, in the order they do it, so that none of them waits for it:
 *   - the gathers of every bucket left ungathered since a step without gather (ascending, as
 *     a gather of all buckets goes), from and into the client's param buffer;
 *   - the step in progress when this rank scattered some of its buckets in the current
 *     attempt (since the last exchange of step records), or when the client disconnected at a
 *     step's edge (unless this rank's last step attempt was abandoned: every surviving client
 *     knows then): the buckets not scattered in this attempt (descending, as scatters go),
 *     sending the client's grad buffer, then the step record, marked abandoned, which makes
 *     every rank refuse the step with ZD_EABORTED.
 * With device buffers (CUDA IPC mappings of a process that may be dead) the client's buffers and
 * events are never touched: a bucket-sized scratch of the rank's device memory stands in for
 * them, holding for each gather this rank's slice written from the master weights (what the
 * other ranks' clients must receive) and zeros for the scatters (the step is abandoned).
 * A bye at a step's edge needs nothing. Then, with host buffers, the model keeps the client's
 * param buffer (*kept = 1: the caller must forget it, not unmap it) for the next client's local
 * resume. Bounded like any collective; fails as they do (the rank is then degraded). */
int zd__model_stand_in(const zd__step_ctx_t *ctx, zd__model_t *model, const zd__buffers_t *buf,
                       int abrupt, int *kept, zd__err_t *err);

#endif /* ZD_DAEMON_STEP_H */
