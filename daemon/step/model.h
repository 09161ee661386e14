/* A rank's model: what it registered (zd__model_spec_t), the optimizer state of its shard and
 * everything a step reads and writes between jobs (zd__model_t), and what the step logic and the
 * checkpointer need of the rank that holds it (zd__step_ctx_t).
 *
 * The model outlives its clients: a client that reconnects and registers the same layout continues
 * where the last one stopped. Its state arrays are those its groups need at registration (the
 * table of common/state.h), allocated by the rank's compute backend, which sees them as a shard
 * (zd__shard_t, compute.h). The thread running a job of the rank's owns the model, but for what
 * overlap_update's speculation thread holds while a bucket of its is in flight (below).
 *
 * overlap_update: ownership between the job's thread (the rank's worker) and the model's
 * speculation thread (model.c). The worker queues bucket b (zd__model_speculate) right after b's
 * reduce-scatter, and from then until the speculation thread has finished b ("b in flight") the
 * speculation thread alone writes the other set's part of bucket b, spec_sumsq[b],
 * spec_nonfinite[b] and speculated[b], and reads b's reduced gradients (shard.grad[b] and what
 * it points to, shard.grad_dtype[b]), the committed set's part of b, the shard's pointers and
 * scratch (shard.state, shard.segs, shard.cdata, the backend's statistics scratch), committed.set,
 * spec_consts, spec_scale and spec_stats. The worker leaves all of those alone while any bucket
 * is in flight, except that it reduce-scatters and marks buckets that are not in flight (their
 * own elements of grad[], grad_dtype[], speculated[], scattered[], attempted[] and their own
 * range of the gradient shard). A job that needs more waits for every bucket first
 * (zd__model_spec_wait: rank.c does it before every job but a scatter or a gather), and a scatter
 * of a bucket in flight waits for it. Queueing and finishing go through the speculation thread's
 * lock, so what one side wrote before handing a bucket over is seen by the other. After a step's
 * commit the same thread may write a bucket's working parameters instead (zd__model_params_async):
 * it then owns that bucket's slice of the client's param buffer and reads the committed set, and
 * the step waits for it before the bucket's gather and before it ends.
 */
#ifndef ZD_DAEMON_MODEL_H
#define ZD_DAEMON_MODEL_H

#include <stdatomic.h>
#include <stdint.h>

#include "comm.h"
#include "compute.h"
#include "error.h"
#include "layout.h"
#include "shm.h"
#include "state.h"
#include "state_file.h"
#include "step_decide.h"
#include "zerod/zerod.h"

/* Which set of state arrays holds the model's state, and of which step: one small record the
 * model owns, written at every commit (zd__model_commit). Everything that reads the state
 * (checkpoints, status, resharding, the stand-in, exchanges) reads the committed set, which
 * shard.state always points to. With one set (overlap_update off) set is always 0. */
typedef struct zd__committed {
  uint32_t set;  /* the committed set: 0 or 1 */
  uint64_t step; /* the steps applied to it (the model's step) */
} zd__committed_t;

/* What a register request asks for, validated by the loop. Owned by the attach job. */
typedef struct zd__model_spec {
  zd__layout_t *layout;
  zd_group_t *groups;
  uint32_t ngroups;
  zd_dtype_t param_dtype;
  zd_dtype_t grad_dtype;
  double max_grad_norm; /* 0: no clipping */
  int grad_mean;
  zd_loss_scaler_t scaler; /* .enabled = 0: none */
  int replace;
  int grow; /* the model extends the one the rank holds (zd__model_grow) */
} zd__model_spec_t;

void zd__model_spec_free(zd__model_spec_t *spec);

typedef struct zd__model {
  zd__layout_t *layout;  /* owned; shard.layout is this */
  zd__shard_t shard;     /* what the compute backend sees: the state arrays by role, the
                            segments, where each bucket's reduced gradients are */
  zd__states_t states;   /* the state arrays the model has (shard.state[s] != NULL) */
  zd_group_t *groups;    /* current hyperparameters, shard.ngroups of them */
  zd_dtype_t grad_dtype; /* (the param dtype is shard.param_dtype) */
  double max_grad_norm;
  int grad_mean;
  zd__scaler_t scaler;
  uint64_t step; /* steps applied */
  uint64_t steps_skipped;
  /* Per parameter (layout order): the steps applied to the model that skipped it (it had no
   * gradient on any rank: StepRequest.absent), so that its own step count, torch's
   * state['step'], is step - lag[i]; nlagging: how many are nonzero (0: every parameter is at
   * the model's step, the common case). Saved in checkpoints (a parameter's "steps_behind"). */
  uint64_t *lag;
  uint32_t nlagging;
  zd__compute_t *compute; /* the backend that owns the shard's arrays */
  /* The state arrays by set and role: sets[committed.set] is shard.state. overlap_update (CPU):
   * two sets, and an update reads the committed set and writes the other (compute.h, update),
   * which becomes the committed one when the step commits; otherwise sets[1] is all NULL and
   * updates are in place. */
  float *sets[2][ZD__NSTATES];
  zd__committed_t committed;
  /* state_dir: both sets live in this file, and every commit writes its header (state_file.h);
   * restored: how many committed records of this model the file held (0..2, state_file.h), the
   * newest of which the model took at creation; restored_rec: they. */
  struct zd__state_file *file;
  int restored;
  zd__state_rec_t restored_rec[2];
  /* The world re-formed around this model, kept with its state file (rank.c, heal): until a
   * registration agrees again with the other ranks on the step every one holds (step.c,
   * zd__model_attach), no step, scatter or gather may run and no client resumes alone. */
  int rejoin;
  /* How the last registration's state was made (zd__ckptr_resume): ZD__FROM_* and, when the
   * state files were not used, why. */
  int resumed_from;
  char resume_note[160];
  /* overlap_update: the speculative update of bucket b (step.c, zd__model_scatter; run on the
   * speculation thread, spec) wrote the other set's part of bucket b from the committed set and
   * the bucket's reduced gradients, for step spec_step with spec_scale and spec_consts (step
   * spec_step's constants of every group); spec_sumsq / spec_nonfinite are the bucket's
   * statistics (compute.h, grad_stats), taken where spec_stats. Cleared by every scatter of the
   * bucket and at the end of every step attempt. The key (spec_consts, spec_scale, spec_step,
   * spec_stats) changes only while no bucket is in flight. */
  struct zd__spec *spec; /* the speculation thread; NULL with one set */
  int spec_stats;
  /* The groups a scatter of this step attempt said the step will apply (ScatterRequest.groups),
   * which the speculation uses instead of groups; has_next_groups: there are such (spec_cap
   * entries allocated, shard.ngroups used). Forgotten at the end of every step attempt. */
  zd_group_t *next_groups;
  int has_next_groups;
  uint8_t *speculated;
  double *spec_sumsq;
  uint64_t *spec_nonfinite;
  zd__adam_group_t *spec_consts; /* spec_cap of them */
  uint32_t spec_cap;
  float spec_scale;
  uint64_t spec_step;
  uint64_t spec_committed, spec_recomputed; /* buckets whose speculation was used, or not */
  uint8_t *scattered;                       /* per bucket: reduced since the last step */
  uint8_t *attempted;  /* per bucket: reduced in the step attempt in progress (cleared by
                          every exchange of step records, whatever its verdict) */
  uint8_t *ungathered; /* per bucket: a step without gather came since its last gather */
  int abandoned;       /* the last step attempt was abandoned, and no scatter came since */
  zd__shm_t kept;      /* W > 1, host memory: the last client's param buffer (the full
                          model as of its last gather), for the next client; else none */
  /* Where the time goes, for metrics: host time of each phase (CUDA: the time to queue it, the
   * device runs it later) and the bytes the collectives were given. */
  uint64_t scatter_us, update_us, gather_us;
  uint64_t collective_bytes, collective_us;
} zd__model_t;

/* Where a registration's state came from (zd__model_t.resumed_from). */
enum {
  ZD__FROM_CLIENT = 0, /* the client's values: nothing resumed */
  ZD__FROM_STATE_FILE, /* a state file's record (state_dir) */
  ZD__FROM_CHECKPOINT, /* the newest checkpoint */
  ZD__FROM_MODEL,      /* a model kept across a world that re-formed, re-agreed (state_dir) */
  ZD__FROM_HELD,       /* a trainer reattached to the model its rank held */
  ZD__FROM_BUDDY,      /* the world's buddy copies and snapshots (buddy.h) */
  ZD__FROM_RESIZE,     /* a live resize's image of the whole model (resize.h) */
  ZD__FROM_SNAPSHOT    /* the newest state snapshot every rank holds (snapshot.h) */
};

/* What the step logic needs from its rank. */
typedef struct zd__step_ctx {
  uint32_t rank;
  uint32_t local_rank;
  uint32_t world_size;
  zd__comm_t *comm;
  zd__compute_t *compute;
  struct zd__world_member *member; /* world size > 1: for the registration barrier */
  struct zd__ckptr *ckpt;          /* the daemon's checkpointer (checkpoint.h); NULL: none */
  int overlap_update;              /* two sets of state arrays, buckets updated speculatively as
                                      their scatter completes (config.h; CPU backend only) */
  const char *state_dir;           /* CPU backend: the state lives in a file there (state_file.h:
                                      two sets, every update out of place); NULL: none */
  int resume_latest;               /* the world re-formed: the next registration resumes the
                                    newest complete checkpoint (rank.c) */
  atomic_int *attach_abandoned;    /* set when the client of the registration in progress left */
  /* Live resize (resize.h): the world size an operator asked for (0: none; the rank's, read by
   * the step's record), the one the ranks agreed on at the last step (0: none; set by the step),
   * and the image of the whole model this rank holds across the resize (NULL: none). */
  atomic_uint *resize_want;
  uint32_t *resize_agreed;
  struct zd__resize_image **resize_image;
} zd__step_ctx_t;

/* A new model for spec on the rank of ctx: takes spec's layout and groups, allocates the state
 * arrays its groups need (zeroed) and the backend's per-shard data. With ctx->state_dir both
 * sets are the rank's state file's, and without spec->replace a file holding this model's
 * committed state is taken (m->restored, m->restored_rec[0]: its committed set and step; the
 * loss scaler and the choice of record at world size > 1 are the resume's, checkpoint.h).
 * Errors: -ENOMEM or the backend's, with a message naming the shard's size, or the state
 * file's. */
int zd__model_create(const zd__step_ctx_t *ctx, zd__model_spec_t *spec, zd__model_t **out,
                     zd__err_t *err);

/* Applies a registration's options (dtypes, clipping, averaging, loss scaler) to a model, new or
 * resumed; keep_scaler: a resumed model keeps its scale and trackers when the scaler stays on. */
void zd__model_configure(zd__model_t *m, const zd__model_spec_t *spec, int keep_scaler);

/* A resumed model takes spec's groups and options and starts a fresh run of steps with its new
 * client (no bucket scattered, none left to gather). */
void zd__model_resume(zd__model_t *m, zd__model_spec_t *spec);

/* ZD_EHPARAM, naming the array and the group (`what`: "step", "resume"), when groups need a state
 * array the model was registered without: torch raises KeyError likewise. */
int zd__model_check_states(const zd__model_t *m, const zd_group_t *groups, const char *what,
                           zd__err_t *err);

/* Commits the model's step: the committed record takes m->step, and with switch_set (an update
 * wrote the other set) the other set becomes the committed one (shard.state). With a state file
 * the commit is its header write (set, step, steps skipped, loss scaler: set them first). */
void zd__model_commit(zd__model_t *m, int switch_set);

/* A model restored from its state file (m->restored) serves record i of it (0: the newest commit,
 * 1: the one before, i < m->restored): its set, step, steps skipped and loss scaler (when the
 * registration keeps one on), committed again so that the file's newest record is it. After
 * zd__model_configure. */
void zd__model_take_record(zd__model_t *m, int i);

/* A model restored from its state file that must not serve it (the world cannot agree on a
 * step): the file forgets it, and the model is as zd__model_create makes a fresh one. */
void zd__model_forget_restored(zd__model_t *m);

/* The set an out-of-place update writes (compute.h, update's out): the set that is not
 * committed; NULL with one set. */
float *const *zd__model_other_set(const zd__model_t *m);

/* overlap_update, on the job's thread. zd__model_speculate queues bucket b, reduced and not in
 * flight, for the speculation thread, which updates it out of place with the model's key
 * (spec_consts, spec_scale, spec_stats) and sets speculated[b] if that worked; returns at once.
 * zd__model_spec_wait returns once no bucket is in flight (at once without a speculation
 * thread), and adds the speculation's time to update_us; zd__model_spec_wait_bucket once bucket
 * b is not in flight (b < 0: none is). */
void zd__model_speculate(zd__model_t *m, uint32_t b);

/* overlap_update, on the job's thread, once a step has committed: queues the write of bucket b's
 * working parameters from the committed master weights into buf (compute.h, params_from_master)
 * for the speculation thread, so that the gathers of the buckets before it run meanwhile. Until
 * the write is done (zd__model_spec_wait_bucket) the speculation thread owns b's slice of buf
 * and reads the committed set. A step that gathers waits for every write before it ends; one
 * that does not (ZD_STEP_NO_GATHER) is answered at once and its writes go on beside the gathers
 * that follow it (each waits for its bucket's), and its job is done (rank.c, settle: the session
 * keeps buf mapped until then) once zd__model_params_pending says none is left. */
void zd__model_params_async(zd__model_t *m, uint32_t b, const zd__buffers_t *buf);
void zd__model_spec_wait(zd__model_t *m);
void zd__model_spec_wait_bucket(zd__model_t *m, int32_t b);
/* The parameters' writes queued and not finished (0 without a speculation thread). */
uint32_t zd__model_params_pending(zd__model_t *m);

/* Sets every parameter's lag (NULL: all 0, every parameter at the model's step), recounting
 * nlagging. */
void zd__model_set_lags(zd__model_t *m, const uint64_t *lags);

/* Whether `grown` extends `held`, as torch's add_param_group extends an optimizer: held's parameter
 * table (names, shapes, groups, in order) is the first held->nparams parameters of grown's, which
 * has more. 0 when it does not, with the first difference in buf ("parameter 3: 'fc.weight' [4,
 * 8] group 0 held vs 'fc.bias' [4] group 0 registered"). World size and bucket size are the
 * same (one daemon's), so a prefix is all there is to compare. */
int zd__model_grows(const zd__layout_t *held, const zd__layout_t *grown, char *buf, size_t len);

/* A registration of a grown model (spec->grow, zd__model_grows true, collective at world size > 1:
 * every rank calls it for the same layouts once they agreed): a new model for spec whose
 * parameters held has keep their state bit for bit (master weights and every state array both
 * have, their step lags), and whose new parameters start as a new model's do: master weights from
 * the client's param buffer, the other arrays zeroed, their own step count 0 (a lag of the model's
 * step, so that their first step is their step 1, as torch counts it for a parameter added by
 * add_param_group); this rank's slice of the param buffer is then written from the master
 * weights, as a resume writes it. The model's step, skipped steps and loss scaler (scale and
 * trackers, when spec keeps one on) carry over. At world size > 1 the held state is resharded by an
 * all-gather of each array's shards over the communicator (host memory: world size * held shard
 * elements floats per array, one array at a time, plus the new shard's arrays), since a held
 * parameter's elements may move to another rank in the grown layout. *model becomes the new model
 * (held is freed; with ctx->state_dir before the new one opens the rank's state file, which is then
 * created afresh for the new layout and committed at the carried step). On an error *model is held,
 * or NULL when it was already freed (state_dir). Errors: -ENOMEM, the backend's (snapshot, restore:
 * bounded by timeout_ms), the communicator's, the state file's. */
int zd__model_grow(const zd__step_ctx_t *ctx, zd__model_t **model, zd__model_spec_t *spec,
                   const zd__buffers_t *buf, int timeout_ms, zd__err_t *err);

/* Helpers of the in-memory reshard (zd__model_grow, resize.c). The state arrays of m present in
 * `states`, in table order (the order a snapshot packs them); index of array s among them. */
uint32_t zd__model_arrays(const zd__model_t *m, zd__states_t states, float **out);
uint32_t zd__model_array_index(zd__states_t states, int s);
/* Copies into `shard` (rank `rank`'s shard of `grown`) every element of held's parameters (the
 * first held->nparams of grown's) that slice holds, from `full`: the all-gathered shards of `held`
 * (rank r's at r * held->shard_elems). grown may be of another world size than held. */
void zd__model_carry(const zd__layout_t *held, const zd__layout_t *grown, uint32_t rank,
                     const float *full, float *shard);
/* Waits for a snapshot's copy (compute.h) and frees its fence. */
int zd__model_snapshot_wait(zd__compute_t *c, void *fence, int timeout_ms, zd__err_t *err);
/* A copy of layout l, built again from its parameter table (same world and bucket size). */
int zd__model_layout_copy(const zd__layout_t *l, zd__layout_t **out, zd__err_t *err);

/* Frees the model, its arrays and the backend's data; accepts NULL and a half-built model. A
 * bucket in flight is finished first, and the speculation thread joined. */
void zd__model_free(zd__model_t *model);

#endif /* ZD_DAEMON_MODEL_H */
