/* Step logic (step.h): model state, register/resume, scatter, step, gather, and the stand-in for
 * a client that left. Runs on a rank's worker thread; the backend's pieces go through
 * zd__compute_t (compute.h). */
#include "clock.h"
#include "step.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "buddy.h"
#include "snapshot.h"
#include "checkpoint.h"
#include "group.h"
#include "hash.h"
#include "log.h"
#include "resize.h"
#include "step_decide.h"
#include "world.h"

/* The step number in the record of a rank that stands in for its client (zd__model_stand_in): no
 * step ever gets this far, and the record's layout stays the one the CUDA kernels write. */
#define ABANDONED_STEP UINT64_MAX
/* A record's step with this bit set asks every rank to checkpoint after the step (checkpoint.h):
 * the ranks compare steps without it and OR it. No step number comes near it. */
#define CHECKPOINT_BIT (1ull << 62)
/* A record's step with this bit set says the rank has parameters without a gradient this step
 * (StepRequest.absent): the ranks compare steps without it, and where any record has it, every
 * rank exchanges its bitmap after the records (combine_absent). Not set on the device's path
 * (step_on_device), which is taken only where it cannot matter (device_path_ok). */
#define ABSENT_BIT (1ull << 61)
/* Buddy copies (buddy.h): a record's step with BUDDY_BIT asks every rank to copy the step
 * (buddy_copy_every_s), with BUDDY_BUSY_BIT says the rank's previous copy is still being sent, so
 * that no rank copies it; the ranks compare steps without them and OR them. */
#define BUDDY_BIT      (1ull << 60)
#define BUDDY_BUSY_BIT (1ull << 59)
/* Live resize (resize.h): a record's step with RESIZE_BIT asks every rank to resize the world
 * after the step to the size in RESIZE_MASK (bits 42..57; the lowest asking rank's wins). */
#define RESIZE_BIT   (1ull << 58)
#define RESIZE_SHIFT 42
#define RESIZE_MASK  (0xffffull << RESIZE_SHIFT)
/* State snapshots (snapshot.h): a record's step with SNAPSHOT_BIT asks every rank to snapshot the
 * step, with SNAPSHOT_BUSY_BIT says the rank's previous snapshot is still being written, so that
 * no rank takes it; OR-ed as BUDDY_BIT is. Below RESIZE_MASK, still far above any step count
 * (2^40 steps). */
#define SNAPSHOT_BIT      (1ull << 41)
#define SNAPSHOT_BUSY_BIT (1ull << 40)
#define STEP_FLAGS                                                                       \
  (CHECKPOINT_BIT | ABSENT_BIT | BUDDY_BIT | BUDDY_BUSY_BIT | RESIZE_BIT | RESIZE_MASK | \
   SNAPSHOT_BIT | SNAPSHOT_BUSY_BIT)

/* This rank's snapshot bits for the record of step `step` (snapshot.h). */
static uint64_t snapshot_flags(const zd__step_ctx_t *ctx, uint64_t step) {
  int s = zd__snapshot_wants(ctx, step);
  return (s & ZD__SNAPSHOT_WANT ? SNAPSHOT_BIT : 0) |
         (s & ZD__SNAPSHOT_BUSY ? SNAPSHOT_BUSY_BIT : 0);
}

/* Every rank's decision from the same records' OR of their steps. */
static void snapshot_agreed(const zd__step_ctx_t *ctx, uint64_t step, uint64_t any) {
  zd__snapshot_agreed(ctx, step, (any & SNAPSHOT_BIT) != 0, (any & SNAPSHOT_BUSY_BIT) != 0);
}

/* What the ranks must agree on before a step: every group (the table's fields, common/group.h),
 * clipping (and the torch order it clips by, where it takes one: torch_order, the ranks' norm is
 * then a collective after the commit point), averaging and loss scaling, and every parameter's own
 * step count where some lag behind the model's (zd__model_t.lag). */
static uint64_t hparam_hash(const zd__model_t *m, const zd_group_t *groups,
                            zd_clip_norm_t torch_order) {
  uint64_t h = ZD__FNV1A_INIT;
  for (uint32_t i = 0; i < m->shard.ngroups; i++) h = zd__group_hash(h, &groups[i]);
  int32_t flags[2] = {m->grad_mean, m->scaler.enabled};
  h = zd__fnv1a(h, &m->max_grad_norm, sizeof m->max_grad_norm);
  if (torch_order != ZD_CLIP_NORM_DOUBLE) {
    int32_t o = (int32_t)torch_order;
    h = zd__fnv1a(h, &o, sizeof o);
  }
  if (m->nlagging) h = zd__fnv1a(h, m->lag, m->layout->nparams * sizeof *m->lag);
  return zd__fnv1a(h, flags, sizeof flags);
}

/* Whether the backend skips parameters without a gradient (StepRequest.absent) and steps each
 * parameter at its own step count: the CPU backend, whose update reads the segments it is given
 * (compute.h), and the CUDA backend, which maps them onto per-parameter layouts built at
 * registration (kernels/cuda_plan.h). */
static int skips_absent(const zd__step_ctx_t *ctx) {
  return strcmp(ctx->compute->name, "cpu") == 0 || strcmp(ctx->compute->name, "cuda") == 0;
}

/* Whether a step with statistics may take the device's path (step_on_device), whose update is
 * queued before any record is read: not when some parameter lags the model's step (the same on
 * every rank: the lags are in the records' hash), nor at world size 1 when this rank has
 * parameters without a gradient. At world size > 1 a rank cannot know whether another has any
 * before the records, and every rank must take the same path: there the device's path steps
 * absent parameters with their zero gradients, as before presence (docs/design.md). */
static int device_path_ok(const zd__step_ctx_t *ctx, const zd__model_t *m, const uint8_t *absent) {
  return !m->nlagging && !(ctx->world_size == 1 && absent);
}

/* ---- state --------------------------------------------------------------------------------- */

/* Element e of the client's param buffer. */
static void *param_at(const zd__model_t *m, const zd__buffers_t *buf, uint64_t e) {
  return (char *)buf->params.addr + e * zd_dtype_size(m->shard.param_dtype);
}

/* The edges of a job (compute.h): begin orders the job after the client's work on its buffers;
 * end waits for everything the job queued, also after a failure (whose error is kept: err keeps
 * the first failure's message). */
static int job_begin(const zd__step_ctx_t *ctx, const zd__buffers_t *buf, uint32_t slot,
                     zd__err_t *err) {
  return ctx->compute->ops->begin(ctx->compute, buf, slot, err);
}

static int job_end(const zd__step_ctx_t *ctx, const zd__buffers_t *buf, uint32_t slot, int rc,
                   zd__err_t *err) {
  zd__err_t end_err = {0};
  int end = ctx->compute->ops->finish(ctx->compute, ctx->comm, buf, slot, &end_err);
  if (rc) return rc;
  if (end) *err = end_err;
  return end;
}

/* The end of a job whose reply is known once its work is queued (a scatter, a gather, a step
 * past its decision): the backend may answer without waiting for the work (compute.h,
 * finish_early); a failed job waits as every job does. */
static int job_end_early(const zd__step_ctx_t *ctx, const zd__buffers_t *buf, uint32_t slot, int rc,
                         zd__err_t *err) {
  const zd__compute_ops_t *ops = ctx->compute->ops;
  if (rc || !ops->finish_early) return job_end(ctx, buf, slot, rc, err);
  return ops->finish_early(ctx->compute, ctx->comm, buf, slot, err);
}

static int gather_buckets(const zd__step_ctx_t *ctx, zd__model_t *m, const zd__buffers_t *buf,
                          int32_t bucket, zd__err_t *err);

/* What each rank says about a registration before anything is changed: all ranks must register
 * the same model, and either all resume the same step or all start afresh. */
typedef struct attach_record {
  int32_t code; /* this rank's own verdict: ZD_OK or why it refuses */
  uint32_t param_dtype;
  uint32_t grad_dtype;
  uint32_t resume;
  uint64_t layout_hash;
  uint64_t step;
  uint64_t table_bytes; /* size of the serialized parameter table */
  uint32_t grow;        /* the registration grows the model held (zd__model_grow) */
  uint32_t ngroups;
  uint64_t groups_hash; /* with grow: every group's fields (the new group's among them) */
  uint32_t image;       /* the rank holds a live resize's image (resize.h): resume and step are
                           its; a rank without one (joined a grown world) gets its shard from it */
} attach_record_t;

/* Names the first parameter on which this rank's model differs from rank `other`'s: every rank
 * contributes its parameter table to an all-gather of the largest table's size. */
static int describe_mismatch(const zd__step_ctx_t *ctx, const zd__layout_t *mine,
                             const attach_record_t *all, uint32_t other, zd__err_t *err) {
  uint64_t max = 0;
  for (uint32_t r = 0; r < ctx->world_size; r++)
    if (all[r].table_bytes > max) max = all[r].table_bytes;
  char *table = NULL, *tables = NULL;
  size_t len = 0;
  zd_param_t *params = NULL;
  zd__layout_t *theirs = NULL;
  int rc = zd__layout_serialize(mine, &table, &len);
  char *send = calloc(max + 1, 1);
  tables = calloc(ctx->world_size, max + 1);
  if (rc || !send || !tables) {
    rc = zd__errf(err, -ENOMEM, "out of memory comparing parameter tables");
    goto exit;
  }
  memcpy(send, table, len);
  rc = ctx->comm->ops->allgather_bytes(ctx->comm, send, max + 1, tables, err);
  if (rc) goto exit;
  uint32_t n = 0;
  char *theirs_text = tables + (size_t)other * (max + 1);
  char diff[512] = "the parameter tables could not be compared";
  if (zd__layout_parse(theirs_text, all[other].table_bytes, &params, &n) == 0 &&
      zd__layout_build(params, n, UINT32_MAX, ctx->world_size, mine->bucket_elems, &theirs, NULL) ==
          0)
    zd__layout_diff(mine, theirs, diff, sizeof diff);
  rc = zd__errf(err, ZD_ELAYOUT, "ranks registered different models; rank %u vs rank %u: %s",
                ctx->rank, other, diff);
exit:
  zd__layout_free(theirs);
  free(params);
  free(tables);
  free(send);
  free(table);
  return rc;
}

static void describe_state(const attach_record_t *rec, char *buf, size_t len) {
  if (rec->resume)
    snprintf(buf, len, "resumes step %" PRIu64, rec->step);
  else
    snprintf(buf, len, "starts afresh");
}

/* Names the first group field on which this rank's groups differ from rank `other`'s (a grown
 * model's registration, where every rank must add the same group): all-gathers every rank's
 * groups, padded to the most groups. */
static int describe_groups(const zd__step_ctx_t *ctx, const zd_group_t *mine, uint32_t n,
                           const attach_record_t *all, uint32_t other, zd__err_t *err) {
  uint32_t max = 0;
  for (uint32_t r = 0; r < ctx->world_size; r++)
    if (all[r].ngroups > max) max = all[r].ngroups;
  zd_group_t *send = calloc(max ? max : 1, sizeof *send);
  zd_group_t *every = calloc((size_t)ctx->world_size * (max ? max : 1), sizeof *every);
  if (!send || !every) {
    free(send);
    free(every);
    return zd__errf(err, -ENOMEM, "out of memory comparing parameter groups");
  }
  memcpy(send, mine, n * sizeof *mine);
  int rc =
      ctx->comm->ops->allgather_bytes(ctx->comm, send, (max ? max : 1) * sizeof *send, every, err);
  if (rc) goto exit;
  const zd_group_t *theirs = every + (size_t)other * (max ? max : 1);
  char diff[256];
  snprintf(diff, sizeof diff, "rank %u has %u groups, rank %u %u", other, all[other].ngroups,
           ctx->rank, n);
  for (uint32_t g = 0; g < n && g < all[other].ngroups; g++) {
    int found = 0;
#define ZD__GROUP_DIFF(name, KIND, valid, expected, dflt)                                       \
  if (!found && memcmp(&theirs[g].name, &mine[g].name, sizeof mine[g].name) != 0) {             \
    found = 1;                                                                                  \
    snprintf(diff, sizeof diff, "group %u: %s is %.17g on rank %u, %.17g on rank %u", g, #name, \
             (double)theirs[g].name, other, (double)mine[g].name, ctx->rank);                   \
  }
    ZD__GROUP_FIELDS(ZD__GROUP_DIFF)
#undef ZD__GROUP_DIFF
    if (found) break;
  }
  rc = zd__errf(err, ZD_EHPARAM,
                "ranks grew the model with different parameter groups (every rank adds the same "
                "group at the same step): %s",
                diff);
exit:
  free(send);
  free(every);
  return rc;
}

/* Compares the records of all ranks; every rank reaches the same verdict. */
static int agree_attach(const zd__step_ctx_t *ctx, const attach_record_t *mine,
                        const zd__layout_t *layout, const zd_group_t *groups, int *any_image,
                        zd__err_t *err) {
  uint32_t w = ctx->world_size;
  *any_image = 0;
  attach_record_t *all = calloc(w, sizeof *all);
  if (!all) return zd__errf(err, -ENOMEM, "out of memory");
  int rc = ctx->comm->ops->allgather_bytes(ctx->comm, mine, sizeof *mine, all, err);
  if (rc) goto exit;
  for (uint32_t r = 0; r < w; r++) *any_image |= all[r].image != 0;
  for (uint32_t r = 0; r < w && !rc; r++) {
    if (mine->code) { /* our own refusal, with its message already in err */
      rc = mine->code;
    } else if (all[r].code) {
      rc = zd__errf(err, all[r].code,
                    "rank %u refused the registration (%s); every rank must "
                    "register the same model",
                    r, zd_err_name(all[r].code));
    }
  }
  for (uint32_t r = 0; r < w && !rc; r++) {
    if (all[r].layout_hash != mine->layout_hash) {
      rc = describe_mismatch(ctx, layout, all, r, err);
    } else if (all[r].param_dtype != mine->param_dtype || all[r].grad_dtype != mine->grad_dtype) {
      rc = zd__errf(err, ZD_EDTYPE,
                    "rank %u registered %s params and %s grads, rank %u %s and %s; "
                    "every rank must use the same dtypes",
                    r, zd_dtype_name((zd_dtype_t)all[r].param_dtype),
                    zd_dtype_name((zd_dtype_t)all[r].grad_dtype), ctx->rank,
                    zd_dtype_name((zd_dtype_t)mine->param_dtype),
                    zd_dtype_name((zd_dtype_t)mine->grad_dtype));
    } else if (*any_image && (!all[r].image || !mine->image)) {
      continue; /* a rank that joined a grown world empty: its shard comes from the image */
    } else if (all[r].resume != mine->resume || all[r].step != mine->step) {
      char theirs[64], ours[64];
      describe_state(&all[r], theirs, sizeof theirs);
      describe_state(mine, ours, sizeof ours);
      rc = zd__errf(err, ZD_ESTEP,
                    "ranks are out of step: rank %u %s, rank %u %s; every rank "
                    "must resume the same step (or all register with replace)",
                    r, theirs, ctx->rank, ours);
    }
  }
  /* After every other check, which every rank fails alike or passes alike: describe_groups is a
   * collective that every rank must enter. */
  for (uint32_t r = 0; r < w && !rc; r++)
    if (mine->grow && all[r].grow &&
        (all[r].ngroups != mine->ngroups || all[r].groups_hash != mine->groups_hash))
      rc = describe_groups(ctx, groups, mine->ngroups, all, r, err);
exit:
  free(all);
  return rc;
}

/* A reattach at world size > 1 (zd__model_attach): the other ranks may be training, and their
 * clients are not asked, so nothing here waits for them. The full model comes from the param
 * buffer the rank kept from its last client, whose gathers were all done (by it, or by the
 * stand-in that took its place); this rank's slice is written from the master weights, as at any
 * resume. */
static int resume_alone(const zd__step_ctx_t *ctx, zd__model_t *m, zd__model_spec_t *spec,
                        const zd__buffers_t *buf, uint32_t slot, zd__err_t *err) {
  if (spec->param_dtype != m->shard.param_dtype || spec->grad_dtype != m->grad_dtype)
    return zd__errf(err, ZD_EDTYPE,
                    "rank %u holds this model with %s params and %s grads, as every rank of the "
                    "world does; a client that reattaches alone registers %s and %s: use the "
                    "model's dtypes, or register on every rank with replace",
                    ctx->rank, zd_dtype_name(m->shard.param_dtype), zd_dtype_name(m->grad_dtype),
                    zd_dtype_name(spec->param_dtype), zd_dtype_name(spec->grad_dtype));
  int rc = zd__model_check_states(m, spec->groups, "resume", err);
  if (rc) return rc;
  rc = job_begin(ctx, buf, slot, err);
  if (rc) return job_end(ctx, buf, slot, rc, err);
  size_t bytes = m->layout->total_elems * zd_dtype_size(m->shard.param_dtype);
  zd_assert(m->kept.bytes >= bytes && buf->params.bytes >= bytes); /* both checked at register */
  memcpy(buf->params.addr, m->kept.addr, bytes);
  zd__model_resume(m, spec);
  m->resumed_from = ZD__FROM_HELD;
  rc = ctx->compute->ops->exchange(ctx->compute, &m->shard, buf, 1, err);
  if (!rc) zd__shm_unmap(&m->kept); /* the new client's buffer is the model's copy from now on */
  return job_end(ctx, buf, slot, rc, err);
}

/* The registration of a model kept across a world that re-formed (m->rejoin): what its state
 * file holds now (its newest commit, and the one before) is compared with the other ranks' files
 * as a restarted zerod's are (zd__ckptr_resume), and the model serves the step every rank holds
 * (going back one commit when it is ahead) or, when the files have none in common, falls back as
 * every rank does. The arrays stay where they are: nothing is read again. */
static int rejoin_model(const zd__step_ctx_t *ctx, zd__model_t *m, zd__model_spec_t *spec,
                        const zd__buffers_t *buf, int *resumed, zd__err_t *err) {
  uint64_t held = m->step;
  zd__model_resume(m, spec);
  zd__model_configure(m, spec, 0); /* the scaler as a new model's: the record it takes sets it */
  zd__shm_unmap(&m->kept);
  m->restored = zd__state_file_records(m->file, m->restored_rec);
  int loaded = 0;
  int rc = zd__ckptr_resume(ctx->ckpt, ctx, m, 0, &loaded, err);
  if (rc) return rc; /* still rejoin: the next registration tries again */
  m->rejoin = 0;
  if (m->resumed_from == ZD__FROM_STATE_FILE) m->resumed_from = ZD__FROM_MODEL;
  ZD_LOG_INFO("rank %u kept its model (step %" PRIu64
              ") across the world's re-forming and serves "
              "step %" PRIu64 " (%s)",
              ctx->rank, held, m->step,
              m->resumed_from == ZD__FROM_MODEL        ? "the step every rank holds"
              : m->resumed_from == ZD__FROM_CHECKPOINT ? "the newest checkpoint"
              : m->resumed_from == ZD__FROM_BUDDY      ? "the world's buddy copies"
              : m->resumed_from == ZD__FROM_SNAPSHOT   ? "the world's state snapshots"
                                                       : "the client's values");
  *resumed = loaded;
  return ctx->compute->ops->exchange(ctx->compute, &m->shard, buf, loaded, err);
}

/* How long a grown model's registration waits for each copy of the state (zd__model_grow; the
 * CPU backend's copies are done on return). */
#define GROW_TIMEOUT_MS 600000

int zd__model_attach(const zd__step_ctx_t *ctx, zd__model_t **model, zd__model_spec_t *spec,
                     const zd__buffers_t *buf, uint32_t slot, int *resumed, zd__err_t *err) {
  zd__model_t *m = *model;
  zd__resize_image_t *img = ctx->resize_image ? *ctx->resize_image : NULL;
  char diff[512] = "";
  int same = m && m->layout->hash == spec->layout->hash &&
             zd__layout_diff(m->layout, spec->layout, diff, sizeof diff) == 0;
  /* A model kept across a world that re-formed (state_dir) registers as a new one would, so that
   * its collectives meet those of a restarted rank's registration, and then re-agrees its step. */
  int rejoin = same && m->rejoin && !spec->replace;
  if (same && !rejoin && !spec->replace && m->kept.kind == ZD__SHM_HOST &&
      buf->params.kind == ZD__SHM_HOST) {
    *resumed = 1;
    return resume_alone(ctx, m, spec, buf, slot, err);
  }
  /* Trainers may register minutes apart; the agreement below is a collective bounded by the
   * collective timeout. Wait for every rank through the rendezvous store first, which may take
   * as long as a world takes to form, and can be cancelled by a shutdown. */
  if (ctx->member) {
    int rc = zd__world_barrier(ctx->member, "register", ctx->attach_abandoned, err);
    if (rc) {
      char cause[ZD__ERR_MSG_MAX];
      snprintf(cause, sizeof cause, "%s", err->msg);
      return zd__errf(err, rc,
                      "registration on rank %u: waiting for the other ranks' clients to "
                      "register: %s%s",
                      ctx->rank, cause,
                      rc == -ETIMEDOUT ? " (a client of a rank that holds this model resumes "
                                         "alone and is not waited for: a new model takes "
                                         "replace on every rank)"
                                       : "");
    }
  }
  if (m && !same && !diff[0]) zd__layout_diff(m->layout, spec->layout, diff, sizeof diff);
  if (spec->replace || rejoin) same = 0; /* start afresh even with the same model */
  /* add_param_group: the model held, grown by parameters after its own, keeps its state and step
   * (zd__model_grow). */
  int grow = m && !same && !rejoin && !spec->replace && spec->grow;
  int grows = grow && zd__model_grows(m->layout, spec->layout, diff, sizeof diff);
  attach_record_t rec = {.param_dtype = spec->param_dtype,
                         .grad_dtype = spec->grad_dtype,
                         .resume = (uint32_t)(same || grow),
                         .layout_hash = spec->layout->hash,
                         .step = same || grow ? m->step : 0,
                         .grow = (uint32_t)grow,
                         .ngroups = spec->ngroups,
                         .image = img && !spec->replace};
  if (rec.image) { /* the model was dropped at the resize: the image is the state */
    rec.resume = 1;
    rec.step = img->step;
  }
  for (uint32_t g = 0; grow && g < spec->ngroups; g++)
    rec.groups_hash = zd__group_hash(rec.groups_hash, &spec->groups[g]);
  char *table = NULL;
  size_t table_len = 0;
  if (zd__layout_serialize(spec->layout, &table, &table_len) != 0)
    rec.code = zd__errf(err, -ENOMEM, "out of memory");
  free(table);
  rec.table_bytes = table_len;
  if (!rec.code && grow && !grows)
    rec.code = zd__errf(err, ZD_ELAYOUT,
                        "rank %u cannot grow the model it holds (%u parameters, step %" PRIu64
                        ") into the one registered: %s",
                        ctx->rank, m->layout->nparams, m->step, diff);
  else if (!rec.code && grow && !skips_absent(ctx))
    rec.code = zd__errf(err, ZD_EBACKEND,
                        "rank %u: growing a model (add_param_group) needs per-parameter step "
                        "counts, which only the CPU backend keeps (backend %s); register the "
                        "grown model with replace",
                        ctx->rank, ctx->compute->name);
  else if (!rec.code && m && !same && !spec->replace && !rejoin && !grow)
    rec.code = zd__errf(err, ZD_ELAYOUT,
                        "rank %u holds a different model (%u parameters, layout hash %016" PRIx64
                        ", step %" PRIu64 "): %s; register with replace to discard its state",
                        ctx->rank, m->layout->nparams, m->layout->hash, m->step, diff);
  if (!rec.code && (same || rejoin))
    rec.code = zd__model_check_states(m, spec->groups, "resume", err);
  if (!rec.code && rec.image && !zd__resize_matches(img, spec->layout, diff, sizeof diff))
    rec.code = zd__errf(err, ZD_ELAYOUT, "rank %u: %s", ctx->rank, diff);
  /* The client's initial values (or its buffers' last use) come before anything reads or writes
   * them. */
  zd__err_t begin_err = {0};
  int rc = job_begin(ctx, buf, slot, &begin_err);
  if (rc && !rec.code) {
    rec.code = rc;
    *err = begin_err;
  }
  /* Every rank takes part even when it refuses, so that all fail together instead of leaving the
   * others waiting in the collective. */
  int any_image = 0;
  rc = agree_attach(ctx, &rec, spec->layout, spec->groups, &any_image, err);
  if (rc) return job_end(ctx, buf, slot, rc, err);

  *resumed = same;
  if (any_image && !spec->replace) { /* every rank: the first registration after a live resize */
    zd__model_t *fresh = NULL;
    rc = zd__resize_load(ctx, img, spec, buf, &fresh, err);
    if (rc) return job_end(ctx, buf, slot, rc, err);
    zd__model_free(m);
    *model = m = fresh;
    *resumed = 1;
    zd__resize_image_free(img);
    *ctx->resize_image = NULL;
  } else if (same) {
    zd__model_resume(m, spec);
    m->resumed_from = ZD__FROM_HELD;
    zd__shm_unmap(&m->kept);
    rc = ctx->compute->ops->exchange(ctx->compute, &m->shard, buf, 1, err);
  } else if (rejoin) {
    rc = rejoin_model(ctx, m, spec, buf, resumed, err);
  } else if (grow) { /* held's kept param buffer goes with it */
    rc = zd__model_grow(ctx, model, spec, buf, GROW_TIMEOUT_MS, err);
    *resumed = 1;
    m = *model;
    if (rc) return job_end(ctx, buf, slot, rc, err);
  } else {
    if (img) { /* replace: the image held across a resize is given up */
      zd__resize_image_free(img);
      *ctx->resize_image = NULL;
    }
    zd__model_t *fresh = NULL;
    rc = zd__model_create(ctx, spec, &fresh, err);
    if (rc) return job_end(ctx, buf, slot, rc, err);
    zd__model_configure(fresh, spec, 0);
    int loaded = 0;
    rc = zd__ckptr_resume(ctx->ckpt, ctx, fresh, spec->replace, &loaded, err);
    if (rc) {
      zd__model_free(fresh);
      return job_end(ctx, buf, slot, rc, err);
    }
    /* From a checkpoint the master weights are the model's, else the client's initial values. */
    rc = ctx->compute->ops->exchange(ctx->compute, &fresh->shard, buf, loaded, err);
    *resumed = loaded;
    if (m)
      ZD_LOG_WARN("replacing model at step %" PRIu64 " (%u parameters)", m->step,
                  m->layout->nparams);
    zd__model_free(m);
    *model = m = fresh;
  }
  /* Every client starts from the same full model: each rank's slice came from (or was written
   * into) its own client's buffer. */
  if (!rc) rc = gather_buckets(ctx, m, buf, -1, err);
  return job_end(ctx, buf, slot, rc, err);
}

/* ---- scatter, step, gather ----------------------------------------------------------------- */

/* spec: queue each bucket for its speculative update once reduced (zd__model_scatter). */
static int scatter_buckets(const zd__step_ctx_t *ctx, zd__model_t *m, const zd__buffers_t *buf,
                           int32_t bucket, int spec, zd__err_t *err) {
  const zd__layout_t *l = m->layout;
  /* All buckets go in descending order, the order in which backward completes them and clients
   * scatter them one by one: ranks that scatter some buckets themselves and leave the rest to the
   * step then still run the same sequence of collectives. */
  uint32_t hi = bucket < 0 ? l->nbuckets : (uint32_t)bucket + 1, lo = bucket < 0 ? 0 : hi - 1;
  size_t gsize = zd_dtype_size(m->grad_dtype);
  uint64_t t0 = zd__now_us();
  for (uint32_t b = hi; b-- > lo;) {
    const zd__bucket_t *bk = &l->buckets[b];
    const void *send = (const char *)buf->grads.addr + bk->offset * gsize;
    float *scratch = m->shard.grad_shard ? m->shard.grad_shard + bk->shard_base : NULL;
    m->speculated[b] =
        0; /* new gradients (even a failed scatter's): an earlier speculation is void */
    int rc =
        ctx->comm->ops->reduce_scatter(ctx->comm, b, send, m->grad_dtype, bk->shard_elems, scratch,
                                       &m->shard.grad[b], &m->shard.grad_dtype[b], err);
    if (rc) return rc;
    m->scattered[b] = m->attempted[b] = 1;
    m->abandoned = 0; /* a new attempt */
    m->collective_bytes += bk->elems * gsize;
    if (spec) zd__model_speculate(m, b);
  }
  uint64_t us = zd__now_us() - t0;
  m->scatter_us += us;
  m->collective_us += us;
  return ZD_OK;
}

static int gather_buckets(const zd__step_ctx_t *ctx, zd__model_t *m, const zd__buffers_t *buf,
                          int32_t bucket, zd__err_t *err) {
  const zd__layout_t *l = m->layout;
  uint32_t b0 = bucket < 0 ? 0 : (uint32_t)bucket, b1 = bucket < 0 ? l->nbuckets : b0 + 1;
  uint64_t t0 = zd__now_us();
  for (uint32_t b = b0; b < b1; b++) {
    const zd__bucket_t *bk = &l->buckets[b];
    zd__model_spec_wait_bucket(m, (int32_t)b); /* a step's write of its parameters */
    int rc = ctx->comm->ops->all_gather(ctx->comm, b, param_at(m, buf, bk->offset),
                                        m->shard.param_dtype, bk->shard_elems, err);
    if (rc) return rc;
    m->ungathered[b] = 0;
    m->collective_bytes += bk->elems * zd_dtype_size(m->shard.param_dtype);
  }
  uint64_t us = zd__now_us() - t0;
  m->gather_us += us;
  m->collective_us += us;
  return ZD_OK;
}

static int needs_stats(const zd__step_ctx_t *ctx, const zd__model_t *m);

/* The bit pattern of a float, for comparing factors exactly (NaN included). */
static uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

/* The gradient factor of step m->step + 1 when nothing clips and nothing overflows (the grad_mean
 * average and the loss scale), from the decision's own function, and that step's constants of
 * the model's groups: what a speculative update applies. */
static float speculation_key(const zd__step_ctx_t *ctx, const zd__model_t *m,
                             const zd_group_t *groups, zd__adam_group_t *consts, uint64_t *step) {
  zd__decide_cfg_t cfg = {.world_size = ctx->world_size, .grad_mean = m->grad_mean};
  zd__step_state_t st = {.scaler = m->scaler, .step = m->step, .steps_skipped = m->steps_skipped};
  zd__decision_t dec;
  zd__step_decide(&cfg, 0, 0, &st, &dec);
  for (uint32_t g = 0; g < m->shard.ngroups; g++)
    zd__adam_group_init(&consts[g], &groups[g], dec.step);
  *step = dec.step;
  return dec.grad_scale;
}

/* overlap_update: makes the model's speculation key that of the next step, before a scatter
 * queues buckets for the speculation thread (model.h): the hyperparameters a scatter of this step
 * attempt said the step will apply (next_groups: this one's, or an earlier one's), else those the
 * model has now, step m->step + 1, the factor that holds when nothing clips and nothing overflows,
 * and whether the step takes statistics. A key that changed voids every speculation made with the
 * old one (after waiting for those in flight, which read it). Returns 0 where nothing may be
 * speculated (one set, no groups, a state array the groups need and the model lacks). */
static int speculation_ready(const zd__step_ctx_t *ctx, zd__model_t *m,
                             const zd_group_t *next_groups) {
  uint32_t ng = m->shard.ngroups;
  if (!m->spec || ng > m->spec_cap || ng == 0) return 0;
  if (next_groups) {
    memcpy(m->next_groups, next_groups, ng * sizeof *next_groups);
    m->has_next_groups = 1;
  }
  const zd_group_t *groups = m->has_next_groups ? m->next_groups : m->groups;
  zd__err_t err = {0};
  if (zd__model_check_states(m, groups, "speculate", &err) != ZD_OK) return 0;
  zd__adam_group_t consts[ng];
  uint64_t step;
  float scale = speculation_key(ctx, m, groups, consts, &step);
  int stats = needs_stats(ctx, m);
  if (step != m->spec_step || float_bits(scale) != float_bits(m->spec_scale) ||
      stats != m->spec_stats || memcmp(consts, m->spec_consts, ng * sizeof *consts) != 0) {
    zd__model_spec_wait(m);
    memset(m->speculated, 0, m->layout->nbuckets); /* made for other constants: void */
    memcpy(m->spec_consts, consts, ng * sizeof *consts);
    m->spec_scale = scale;
    m->spec_step = step;
    m->spec_stats = stats;
  }
  return 1;
}

/* The end of a step attempt, whatever its outcome: its speculations are used or void. */
static void end_speculation(zd__model_t *m) {
  memset(m->speculated, 0, m->layout->nbuckets);
  m->has_next_groups = 0;
}

/* overlap_update: each bucket is queued for its speculative update right after its
 * reduce-scatter (scatter_buckets), from the committed set into the other, with the key of
 * speculation_ready (the step's groups as the trainer's scatters said them, else the model's;
 * step m->step + 1; the factor that holds when nothing clips and nothing overflows); no working
 * parameters are written (the client's backward may still read them). The step commits it only when
 * its decision applies exactly these constants and this factor (zd__model_step); else the bucket is
 * updated again from the committed set, which nothing here wrote. The reply does not wait for it:
 * the next bucket's reduce-scatter runs while this one is updated. A bucket scattered again while
 * in flight waits for its speculation first. */
int zd__model_scatter(const zd__step_ctx_t *ctx, zd__model_t *m, const zd__buffers_t *buf,
                      uint32_t slot, int32_t bucket, const zd_group_t *next_groups,
                      zd__err_t *err) {
  int rc = job_begin(ctx, buf, slot, err);
  int spec = !rc && ctx->overlap_update && speculation_ready(ctx, m, next_groups);
  zd__model_spec_wait_bucket(m, bucket); /* its gradients are about to be written */
  if (!rc) rc = scatter_buckets(ctx, m, buf, bucket, spec, err);
  return job_end_early(ctx, buf, slot, rc, err);
}

int zd__model_gather(const zd__step_ctx_t *ctx, zd__model_t *m, const zd__buffers_t *buf,
                     uint32_t slot, int32_t bucket, zd__err_t *err) {
  int rc = job_begin(ctx, buf, slot, err);
  if (!rc) rc = gather_buckets(ctx, m, buf, bucket, err);
  return job_end_early(ctx, buf, slot, rc, err);
}

/* Checks the records of every rank (all) against this rank's: every rank must be about to apply
 * the same step of the same model with the same hyperparameters. Sums the statistics in rank
 * order. A record that arrived damaged (its check word) comes first, then one marked abandoned (a
 * rank standing in for its client), so that every rank reaches the same verdict: step `step` is
 * refused everywhere. zd__step_decide_records (kernels/step_decide.h) makes the same checks in
 * the same order on the device. */
static int agree(const zd__step_ctx_t *ctx, uint64_t step, const zd__step_record_t *mine,
                 const zd__step_record_t *all, double *sumsq, uint64_t *nonfinite, int *checkpoint,
                 int *any_absent, zd__err_t *err) {
  *sumsq = 0;
  *nonfinite = 0;
  *checkpoint = 0;
  *any_absent = 0;
  for (uint32_t r = 0; r < ctx->world_size; r++)
    if (all[r].check != zd__record_check(&all[r]))
      return zd__errf(err, ZD_EPEER,
                      "rank %u's step record arrived damaged (check word %016" PRIx64
                      ", its contents hash to %016" PRIx64
                      "): a peer failed during the records' exchange; step %" PRIu64 " not applied",
                      r, all[r].check, zd__record_check(&all[r]), step);
  for (uint32_t r = 0; r < ctx->world_size; r++)
    if (all[r].step == ABANDONED_STEP)
      return zd__errf(err, ZD_EABORTED,
                      "step %" PRIu64
                      " abandoned: rank %u's trainer disconnected in the middle "
                      "of it; no rank applied it (retry it, scattering every bucket again, once "
                      "that rank's trainer is back)",
                      step, r);
  for (uint32_t r = 0; r < ctx->world_size; r++) {
    if (all[r].layout_hash != mine->layout_hash)
      return zd__errf(err, ZD_ELAYOUT,
                      "rank %u has layout hash %016" PRIx64
                      ", this rank %u has "
                      "%016" PRIx64,
                      r, all[r].layout_hash, ctx->rank, mine->layout_hash);
    if ((all[r].step & ~STEP_FLAGS) != (mine->step & ~STEP_FLAGS))
      return zd__errf(err, ZD_ESTEP,
                      "rank %u is at step %" PRIu64 ", rank %u at step %" PRIu64
                      "; every rank must step together (step not applied)",
                      r, (uint64_t)((all[r].step & ~STEP_FLAGS) - 1), ctx->rank,
                      (uint64_t)((mine->step & ~STEP_FLAGS) - 1));
    if (all[r].step & CHECKPOINT_BIT) *checkpoint = 1;
    if (all[r].step & ABSENT_BIT) *any_absent = 1;
    if (all[r].hparam_hash != mine->hparam_hash)
      return zd__errf(err, ZD_EHPARAM,
                      "rank %u steps with other hyperparameters than rank %u "
                      "(hash %016" PRIx64 " vs %016" PRIx64
                      "); every rank must use the same "
                      "groups, clipping and loss scaling (step not applied)",
                      r, ctx->rank, all[r].hparam_hash, mine->hparam_hash);
    *sumsq += all[r].sumsq;
    *nonfinite += all[r].nonfinite;
  }
  return ZD_OK;
}

/* Whether a step needs the gradient statistics; the same for a rank standing in, so that every
 * rank exchanges its record the same way (CUDA: from device memory when they are needed). */
static int needs_stats(const zd__step_ctx_t *ctx, const zd__model_t *m) {
  return ctx->world_size > 1 || m->max_grad_norm > 0 || m->scaler.enabled;
}

/* Statistics, the records' exchange and their check: everything before the commit point.
 * abandon: this rank stands in for its client, and its record says so. torch_order: the torch
 * order the step clips by (torch_norm_order), in the records' hash. absent: this rank has
 * parameters without a gradient (its record says so: ABSENT_BIT); *any_absent: some rank has. */
static int commit_point(const zd__step_ctx_t *ctx, zd__model_t *m, const zd_group_t *groups,
                        zd_clip_norm_t torch_order, int need_stats, int abandon, int absent,
                        double *sumsq, uint64_t *nonfinite, int *checkpoint, int *any_absent,
                        zd__err_t *err) {
  const zd__layout_t *l = m->layout;
  zd__compute_t *c = ctx->compute;
  uint64_t flag = !abandon && zd__ckptr_wants(ctx->ckpt, m->step + 1) ? CHECKPOINT_BIT : 0;
  if (!abandon && absent) flag |= ABSENT_BIT;
  int buddy = abandon ? 0 : zd__buddy_wants(ctx);
  if (buddy & ZD__BUDDY_WANT) flag |= BUDDY_BIT;
  if (buddy & ZD__BUDDY_BUSY) flag |= BUDDY_BUSY_BIT;
  if (!abandon) flag |= snapshot_flags(ctx, m->step + 1);
  uint32_t want = !abandon && ctx->resize_want ? atomic_load(ctx->resize_want) : 0;
  if (want) flag |= RESIZE_BIT | ((uint64_t)(want & 0xffff) << RESIZE_SHIFT);
  zd__step_record_t rec = {.step = abandon ? ABANDONED_STEP : (m->step + 1) | flag,
                           .layout_hash = l->hash,
                           .hparam_hash = hparam_hash(m, groups, torch_order)};
  int rc = ZD_OK;
  for (uint32_t b = 0; need_stats && b < l->nbuckets && !rc; b++) {
    if (m->speculated[b]) { /* taken by the speculation: the same sums, added in the same order */
      rec.sumsq += m->spec_sumsq[b];
      rec.nonfinite += m->spec_nonfinite[b];
    } else {
      rc = c->ops->grad_stats(c, &m->shard, b, b == 0, &rec, err);
    }
  }
  if (rc) return rc;
  /* The host's record as gathered from host memory (the CPU backend's statistics are in it; a
   * device record is sealed where it is written: zd__cuda_grad_stats). */
  rec.check = zd__record_check(&rec);
  uint32_t w = ctx->world_size;
  zd__step_record_t stack[8], *all = w <= 8 ? stack : calloc(w, sizeof *all);
  if (!all) return zd__errf(err, -ENOMEM, "out of memory");
  rc = c->ops->gather_records(c, ctx->comm, &m->shard, &rec, need_stats, all, err);
  if (!rc) memset(m->attempted, 0, l->nbuckets); /* the attempt is over on every rank */
  if (!rc) rc = agree(ctx, m->step + 1, &rec, all, sumsq, nonfinite, checkpoint, any_absent, err);
  if (!rc) { /* every rank takes the same decision from the same records */
    uint64_t any = 0;
    for (uint32_t r = 0; r < w; r++) any |= all[r].step;
    zd__buddy_agreed(ctx, m->step + 1, (any & BUDDY_BIT) != 0, (any & BUDDY_BUSY_BIT) != 0);
    snapshot_agreed(ctx, m->step + 1, any);
    for (uint32_t r = 0; r < w && ctx->resize_agreed; r++)
      if (all[r].step & RESIZE_BIT) {
        *ctx->resize_agreed = (uint32_t)((all[r].step & RESIZE_MASK) >> RESIZE_SHIFT);
        break;
      }
  }
  if (all != stack) free(all);
  zd__err_t ignored;
  if (rc && (flag & CHECKPOINT_BIT))
    zd__ckptr_request(ctx->ckpt, &ignored); /* not committed: ask again next step */
  return rc;
}

/* Every rank of the world agreed to checkpoint after this step; after the job's end, so that the
 * snapshot is queued behind the step's work (the update, the gather). It does not hold the reply:
 * the backend queues the copy and the rank's later work that writes the state waits for it
 * (compute.h, snapshot), and the checkpoint writer waits for the copy. A failure to snapshot costs
 * this checkpoint only (the checkpointer reports it), never the step. */
static void snapshot_after_step(const zd__step_ctx_t *ctx, zd__model_t *m) {
  zd__err_t err = {0};
  if (zd__ckptr_take(ctx->ckpt, ctx, m, 0, NULL, 0, &err) != ZD_OK)
    ZD_LOG_ERROR("checkpoint of step %" PRIu64 ": no snapshot taken: %s", m->step, err.msg);
}

int zd__model_checkpoint(const zd__step_ctx_t *ctx, zd__model_t *m, int wait, char *dir, size_t len,
                         uint64_t *step, zd__err_t *err) {
  if (!ctx->ckpt) return zd__errf(err, ZD_ECONFIG, "this daemon takes no checkpoints");
  /* Every trainer of the world asks at the same point between steps: agree on which. */
  struct {
    uint64_t step, layout_hash;
  } mine = {m->step, m->layout->hash}, stack[8], *all = stack;
  uint32_t w = ctx->world_size;
  if (w > 8 && !(all = calloc(w, sizeof *all))) return zd__errf(err, -ENOMEM, "out of memory");
  int rc = ctx->comm->ops->allgather_bytes(ctx->comm, &mine, sizeof mine, all, err);
  for (uint32_t r = 0; !rc && r < w; r++)
    if (all[r].step != mine.step || all[r].layout_hash != mine.layout_hash)
      rc = zd__errf(err, ZD_ESTEP,
                    "checkpoint: rank %u is at step %" PRIu64 ", rank %u at step %" PRIu64
                    "; every trainer must ask for it at the same step",
                    r, all[r].step, ctx->rank, mine.step);
  if (all != stack) free(all);
  if (!rc) rc = zd__ckptr_take(ctx->ckpt, ctx, m, wait, dir, len, err);
  *step = m->step;
  return rc;
}

/* The torch order this step clips by (zd__model_step), or ZD_CLIP_NORM_DOUBLE where it clips by
 * the double norm: where the backend computes torch's fp32 total (CPU) of the unscaled fp32
 * gradient, as torch's clip_grad_norm_ sees it. fp16 and bf16 gradients and the loss scaler keep
 * the double norm (their unscaling and the scaler's skip have no torch order here). */
static zd_clip_norm_t torch_norm_order(const zd__step_ctx_t *ctx, const zd__model_t *m,
                                       zd_clip_norm_t clip_norm) {
  int torch = clip_norm != ZD_CLIP_NORM_DOUBLE && ctx->compute->ops->torch_norm &&
              m->max_grad_norm > 0 && !m->scaler.enabled && m->grad_dtype == ZD_F32;
  return torch ? clip_norm : ZD_CLIP_NORM_DOUBLE;
}

/* torch's fp32 total norm of this step's gradient (compute.h, torch_norm), after the commit point:
 * at world size > 1 a collective, which every rank enters because every rank agreed on the same
 * step and the same torch order (the records' hash carries it), and a rank standing in for its
 * client never gets here (its step is abandoned at the commit point on every rank). The gradient
 * clipped is the averaged one where the ranks' gradients are summed and averaged (grad_mean): each
 * element is the sum times fp32 1/world_size, which is the mean exactly where the world size is a
 * power of two (DDP's average: each rank's gradient / world_size, summed). present: NULL (every
 * parameter in torch's stack), or a per-parameter bitmap (grad_norm.h, zd__torch_norm2_total). */
static int torch_total_norm(const zd__step_ctx_t *ctx, zd__model_t *m, zd_clip_norm_t torch_order,
                            const uint8_t *present, float *total, zd__err_t *err) {
  float scale = m->grad_mean && ctx->world_size > 1 ? (float)(1.0 / ctx->world_size) : 1.0f;
  uint64_t t0 = zd__now_us();
  int rc = ctx->compute->ops->torch_norm(ctx->compute, ctx->comm, &m->shard, torch_order, scale,
                                         present, total, err);
  if (ctx->world_size > 1) m->collective_us += zd__now_us() - t0;
  return rc;
}

/* A step with statistics whose backend decides on the device (compute.h, queue_decision: CUDA in
 * cuda_step fast), from the scatter on. Queued with no host wait in between: the statistics,
 * which seal this rank's record; the records' all-gather into a poisoned buffer; the decision
 * kernel; the copy of the decision and the records to the host; the update of every bucket,
 * which runs only where the device's verdict is APPLY. Only then does the host wait, for the copy
 * alone (the update runs meanwhile), and it takes the same decision again from the copied
 * records: the two must be the same (else ZD_EINTERNAL: the device did something the host cannot
 * account for, and the rank is degraded). The gather is queued after that wait, where the step
 * was applied, as on the host path: a rank standing in for its client (which decides on the host)
 * queues no gather after an abandoned step, so no rank may queue one before it knows the verdict.
 * The model's bookkeeping follows the decision, as on the host path.
 *
 * Across ranks: every rank decides from the records as its own all-gather left them. Where the
 * all-gather completed everywhere the records are the same on every rank, and so is the decision:
 * every rank applies the step or none does. A record that a failing peer left torn or unwritten
 * fails its check word (the buffer was 0xFF before the gather): that rank's verdict is INVALID
 * and it applies nothing, and no rank ever applies an update computed from a damaged record. What
 * is not guaranteed is that all ranks reach the same verdict when a peer fails during the
 * all-gather: a rank that received every record whole before the failure applies the step while
 * another does not. The failure breaks the communicator (NCCL's error, or the heartbeat's
 * verdict, on every surviving rank, at the latest at its next collective), and the broken world
 * re-forms and rolls every rank back to the newest checkpoint (rank.c), or stays degraded without
 * checkpoints: state that may differ between ranks is never stepped on. The host path
 * (gather_records, then the decision) has the same window between the end of one rank's
 * all-gather and another's. */
static int step_on_device(const zd__step_ctx_t *ctx, zd__model_t *m, const zd__buffers_t *buf,
                          uint32_t slot, const zd_group_t *groups, int gather, uint64_t t0,
                          zd__step_out_t *out, zd__err_t *err) {
  const zd__layout_t *l = m->layout;
  zd__compute_t *c = ctx->compute;
  uint32_t w = ctx->world_size;
  uint64_t flag = zd__ckptr_wants(ctx->ckpt, m->step + 1) ? CHECKPOINT_BIT : 0;
  uint64_t snap = snapshot_flags(ctx, m->step + 1);
  zd__step_record_t rec = {.step = (m->step + 1) | flag | snap,
                           .layout_hash = l->hash,
                           .hparam_hash = hparam_hash(m, groups, ZD_CLIP_NORM_DOUBLE)};
  int rc = ZD_OK;
  for (uint32_t b = 0; b < l->nbuckets && !rc; b++)
    rc = c->ops->grad_stats(c, &m->shard, b, b == 0, &rec, err);
  rec.check = zd__record_check(&rec); /* as the device sealed it: agree() compares with it */
  zd__cuda_decide_args_t a = {
      .world_size = w,
      .mine = ctx->rank,
      .step_mask = ~(CHECKPOINT_BIT | SNAPSHOT_BIT | SNAPSHOT_BUSY_BIT),
      .checkpoint_bit = CHECKPOINT_BIT,
      .abandoned = ABANDONED_STEP,
      .cfg = {.world_size = w,
              .grad_mean = m->grad_mean,
              .need_stats = 1,
              .max_grad_norm = m->max_grad_norm},
      .st = {.scaler = m->scaler, .step = m->step, .steps_skipped = m->steps_skipped}};
  if (!rc) rc = c->ops->queue_decision(c, ctx->comm, &m->shard, &a, err);
  /* The constants of step m->step + 1, the one an APPLY verdict applies. */
  zd__adam_group_t consts[m->shard.ngroups];
  for (uint32_t g = 0; g < m->shard.ngroups; g++)
    zd__adam_group_init(&consts[g], &groups[g], m->step + 1);
  uint64_t t_update = zd__now_us();
  for (uint32_t b = 0; b < l->nbuckets && !rc; b++)
    rc = c->ops->update(c, &m->shard, b, buf, consts, 1.0f, NULL, err); /* the decision's factor */
  m->update_us += zd__now_us() - t_update;
  zd__step_record_t stack[8], *all = w <= 8 ? stack : calloc(w, sizeof *all);
  if (!all && !rc) rc = zd__errf(err, -ENOMEM, "out of memory");
  zd__cuda_decision_t dev, host;
  if (!rc) rc = c->ops->wait_decision(c, ctx->comm, &m->shard, &dev, all, err);
  if (rc) { /* the state is in doubt: the communicator or the device failed (degraded) */
    if (all != stack) free(all);
    ZD_LOG_ERROR("step %" PRIu64 ": the step could not be queued or decided on the device: %s",
                 m->step + 1, err->msg);
    return job_end(ctx, buf, slot, rc, err);
  }
  memset(m->attempted, 0, l->nbuckets); /* the attempt is over on every rank */
  zd__step_decide_records(&a, (const zd__cuda_stats_t *)all, &host);
  uint64_t any = 0; /* the snapshot bits of every rank's record, as copied from the device */
  for (uint32_t r = 0; r < w; r++) any |= all[r].step;
  snapshot_agreed(ctx, m->step + 1, any);
  if (!zd__cuda_decision_same(&dev, &host)) {
    rc = zd__errf(err, ZD_EINTERNAL,
                  "step %" PRIu64
                  ": the device's decision (verdict %d, bad rank %d) differs "
                  "from the host's (verdict %d, bad rank %d) on the same records",
                  m->step + 1, (int)dev.verdict, (int)dev.bad_rank, (int)host.verdict,
                  (int)host.bad_rank);
  } else if (dev.verdict == ZD__VERDICT_DISAGREE || dev.verdict == ZD__VERDICT_INVALID) {
    double sumsq;
    uint64_t nonfinite;
    int checkpoint, any_absent;
    rc = agree(ctx, m->step + 1, &rec, all, &sumsq, &nonfinite, &checkpoint, &any_absent,
               err); /* the why */
    if (!rc)
      rc = zd__errf(err, ZD_EINTERNAL,
                    "step %" PRIu64
                    ": the decision refused the records (verdict %d, rank %d), "
                    "which the host's check accepts",
                    m->step + 1, (int)dev.verdict, (int)dev.bad_rank);
  }
  if (all != stack) free(all);
  if (rc) {
    zd__err_t ignored;
    if (flag) zd__ckptr_request(ctx->ckpt, &ignored); /* not committed: ask again next step */
    if (rc == ZD_EABORTED) { /* the whole attempt is void on every rank: scatter again */
      memset(m->scattered, 0, l->nbuckets);
      m->abandoned = 1;
    }
    if (rc == ZD_EINTERNAL) ZD_LOG_ERROR("%s", err->msg);
    return job_end(ctx, buf, slot, rc, err);
  }
  /* Committed: the model follows the decision every rank took from the same records. */
  if (groups != m->groups) memcpy(m->groups, groups, m->shard.ngroups * sizeof *groups);
  memset(m->scattered, 0, l->nbuckets);
  if (!gather) memset(m->ungathered, 1, l->nbuckets);
  *out = (zd__step_out_t){.step = dev.dec.step,
                          .applied = dev.dec.applied,
                          .grad_norm = dev.dec.grad_norm,
                          .loss_scale = dev.dec.loss_scale,
                          .clip_coef = dev.dec.clip_coef};
  m->step = dev.st.step;
  zd__model_commit(m, 0); /* one set, updated in place */
  m->scaler = dev.st.scaler;
  m->steps_skipped = dev.st.steps_skipped;
  int applied = dev.verdict == ZD__VERDICT_APPLY;
  if (applied && gather) rc = gather_buckets(ctx, m, buf, -1, err);
  rc = job_end_early(ctx, buf, slot, rc, err);
  if (dev.checkpoint) snapshot_after_step(ctx, m); /* also after a failed gather: state whole */
  zd__snapshot_after_step(ctx, m);                 /* state_dir_mode = snapshot (snapshot.h) */
  out->duration_us = zd__now_us() - t0;
  if (rc && applied) {
    char cause[ZD__ERR_MSG_MAX];
    snprintf(cause, sizeof cause, "%s", err->msg);
    return zd__errf(err, ZD_EAPPLIED, "step %" PRIu64 " was applied, but %s failed (%s): %s",
                    m->step, gather ? "the gather" : "completing it", zd_err_name(rc), cause);
  }
  return rc;
}

/* ---- parameters without a gradient, and per-parameter step counts ------------------------- */

/* The parameters a step skips: those absent on every rank (DDP's rule: present on some rank, a
 * parameter is stepped with the reduced gradient, the others' zeros in it). Every rank takes the
 * same bitmap from the same all-gather of every rank's (a rank without absent parameters sends
 * zeros). skip: (nparams + 7) / 8 bytes. */
static int combine_absent(const zd__step_ctx_t *ctx, const zd__model_t *m, const uint8_t *mine,
                          uint8_t *skip, zd__err_t *err) {
  size_t n = ((size_t)m->layout->nparams + 7) / 8;
  uint32_t w = ctx->world_size;
  if (w == 1) {
    if (mine)
      memcpy(skip, mine, n);
    else
      memset(skip, 0, n);
    return ZD_OK;
  }
  uint8_t *send = calloc(n, 1), *all = calloc((size_t)w * n, 1);
  int rc = send && all ? ZD_OK : zd__errf(err, -ENOMEM, "out of memory");
  if (!rc && mine) memcpy(send, mine, n);
  if (!rc) rc = ctx->comm->ops->allgather_bytes(ctx->comm, send, n, all, err);
  if (!rc) {
    memset(skip, 0xff, n);
    for (uint32_t r = 0; r < w; r++)
      for (size_t i = 0; i < n; i++) skip[i] &= all[(size_t)r * n + i];
  }
  free(send);
  free(all);
  return rc;
}

static int bit_set(const uint8_t *bits, uint32_t i) {
  return bits && (bits[i / 8] >> (i % 8)) & 1;
}

/* A step whose parameters are not all at the model's step: some skipped (skip), some lagging
 * (zd__model_t.lag). The update then sees a shard whose segments are rebuilt one run per
 * parameter (adjacent parameters of the same constants merged), the skipped ones left out, each
 * with the constants of its group at its own step, torch's per-parameter state['step'] + 1:
 * consts[g] for group g at the model's step (parameters that do not lag keep their group's
 * index), then one entry per (group, step) pair that a lagging parameter needs. */
typedef struct uneven {
  zd__shard_t shard; /* the model's, with segs, nsegs and ngroups below */
  zd__segment_t **segs;
  uint32_t *nsegs;
  uint8_t *plain; /* per bucket: no parameter in it skipped or lagging (its segments are the
                     model's: a speculation of it may stand) */
  zd__adam_group_t *consts;
  uint32_t nconsts;
} uneven_t;

static void uneven_free(const zd__layout_t *l, uneven_t *u) {
  if (u->segs)
    for (uint32_t b = 0; b < l->nbuckets; b++) free(u->segs[b]);
  free(u->segs);
  free(u->nsegs);
  free(u->plain);
  free(u->consts);
}

static int uneven_build(const zd__step_ctx_t *ctx, const zd__model_t *m, const uint8_t *skip,
                        uint64_t step, uneven_t *u, zd__err_t *err) {
  const zd__layout_t *l = m->layout;
  uint32_t ng = m->shard.ngroups, cap = ng + m->nlagging;
  *u = (uneven_t){.shard = m->shard};
  u->segs = calloc(l->nbuckets, sizeof *u->segs);
  u->nsegs = calloc(l->nbuckets, sizeof *u->nsegs);
  u->plain = calloc(l->nbuckets, 1);
  u->consts = calloc(cap ? cap : 1, sizeof *u->consts);
  uint32_t *key_group = calloc(cap ? cap : 1, sizeof *key_group);
  uint64_t *key_step = calloc(cap ? cap : 1, sizeof *key_step);
  int rc = u->segs && u->nsegs && u->plain && u->consts && key_group && key_step
               ? ZD_OK
               : zd__errf(err, -ENOMEM, "out of memory");
  for (uint32_t g = 0; !rc && g < ng; g++) {
    zd__adam_group_init(&u->consts[g], &m->groups[g], step);
    key_group[g] = g;
    key_step[g] = step;
  }
  u->nconsts = ng;
  for (uint32_t b = 0; !rc && b < l->nbuckets; b++) {
    const zd__bucket_t *bk = &l->buckets[b];
    uint64_t lo = bk->offset + (uint64_t)ctx->rank * bk->shard_elems, hi = lo + bk->shard_elems;
    zd__segment_t *out = malloc((bk->nparams ? bk->nparams : 1) * sizeof *out);
    if (!out) {
      rc = zd__errf(err, -ENOMEM, "out of memory");
      break;
    }
    u->segs[b] = out;
    u->plain[b] = 1;
    uint32_t n = 0;
    for (uint32_t i = bk->first_param; i < bk->first_param + bk->nparams; i++) {
      const zd__layout_param_t *p = &l->params[i];
      uint64_t s = p->offset > lo ? p->offset : lo;
      uint64_t e = p->offset + p->numel < hi ? p->offset + p->numel : hi;
      if (s >= e) continue;
      if (bit_set(skip, i)) {
        u->plain[b] = 0;
        continue;
      }
      uint32_t k = p->group;
      if (m->lag[i]) {
        u->plain[b] = 0;
        uint64_t own = step - m->lag[i]; /* >= 1: a lag never exceeds the steps before this */
        for (k = ng; k < u->nconsts; k++)
          if (key_group[k] == p->group && key_step[k] == own) break;
        if (k == u->nconsts) {
          zd_assert(k < cap);
          zd__adam_group_init(&u->consts[k], &m->groups[p->group], own);
          key_group[k] = p->group;
          key_step[k] = own;
          u->nconsts++;
        }
      }
      zd__segment_t *prev = n ? &out[n - 1] : NULL;
      if (prev && prev->group == k && prev->offset + prev->length == s - lo)
        prev->length += e - s;
      else
        out[n++] = (zd__segment_t){.offset = s - lo, .length = e - s, .group = k};
    }
    u->nsegs[b] = n;
  }
  free(key_group);
  free(key_step);
  if (rc) {
    uneven_free(l, u);
    return rc;
  }
  u->shard.segs = u->segs;
  u->shard.nsegs = u->nsegs;
  u->shard.ngroups = u->nconsts;
  return ZD_OK;
}

/* An update out of place writes the other set over the segments it is given: the skipped
 * parameters' part of bucket b is copied into it from the committed set, so that the set the
 * step commits holds their state unchanged (host memory: out of place is the CPU backend's). */
static void copy_skipped(const zd__step_ctx_t *ctx, const zd__model_t *m, const uint8_t *skip,
                         uint32_t b, float *const *other) {
  const zd__layout_t *l = m->layout;
  const zd__bucket_t *bk = &l->buckets[b];
  uint64_t lo = bk->offset + (uint64_t)ctx->rank * bk->shard_elems, hi = lo + bk->shard_elems;
  for (uint32_t i = bk->first_param; i < bk->first_param + bk->nparams; i++) {
    const zd__layout_param_t *p = &l->params[i];
    uint64_t s = p->offset > lo ? p->offset : lo;
    uint64_t e = p->offset + p->numel < hi ? p->offset + p->numel : hi;
    if (s >= e || !bit_set(skip, i)) continue;
    uint64_t at = bk->shard_base + (s - lo);
    for (int a = 0; a < ZD__NSTATES; a++)
      if (m->shard.state[a] && other[a])
        memcpy(other[a] + at, m->shard.state[a] + at, (e - s) * sizeof(float));
  }
}

int zd__model_step(const zd__step_ctx_t *ctx, zd__model_t *m, const zd__buffers_t *buf,
                   uint32_t slot, const zd_group_t *groups, int scatter, int gather,
                   zd_clip_norm_t clip_norm, const uint8_t *absent, zd__step_out_t *out,
                   zd__err_t *err) {
  const zd__layout_t *l = m->layout;
  uint64_t t0 = zd__now_us();
  if (!scatter)
    for (uint32_t b = 0; b < l->nbuckets; b++)
      if (!m->scattered[b])
        return zd__errf(err, ZD_EORDER,
                        "bucket %u was not scattered since step %" PRIu64
                        "; scatter every bucket or step with scatter",
                        b, m->step);
  int rc = groups ? zd__model_check_states(m, groups, "step", err) : ZD_OK;
  if (rc) return rc;
  rc = job_begin(ctx, buf, slot, err);
  if (!rc && scatter) rc = scatter_buckets(ctx, m, buf, -1, 0, err);
  if (rc) return job_end(ctx, buf, slot, rc, err);
  /* The step's hyperparameters become the model's only once every rank has agreed to them. */
  if (!groups) groups = m->groups;

  zd_clip_norm_t torch_order = torch_norm_order(ctx, m, clip_norm);
  int need_stats = needs_stats(ctx, m);
  if (need_stats && ctx->compute->ops->queue_decision && device_path_ok(ctx, m, absent))
    return step_on_device(ctx, m, buf, slot, groups, gather, t0, out, err);
  double sumsq = 0;
  uint64_t nonfinite = 0;
  int checkpoint = 0, any_absent = 0;
  if (!skips_absent(ctx)) absent = NULL; /* stepped with their zero gradients */
  rc = commit_point(ctx, m, groups, torch_order, need_stats, 0, absent != NULL, &sumsq, &nonfinite,
                    &checkpoint, &any_absent, err);
  if (rc == ZD_EABORTED) { /* the whole attempt is void on every rank: scatter again */
    memset(m->scattered, 0, l->nbuckets);
    m->abandoned = 1;
  }
  /* Some rank has parameters without a gradient: the ones absent everywhere are skipped, on
   * every rank alike (the same all-gather), before anything is applied. */
  uint8_t *skip = NULL, *present = NULL;
  size_t nbytes = ((size_t)l->nparams + 7) / 8;
  if (!rc && any_absent) {
    skip = malloc(nbytes);
    rc = skip ? combine_absent(ctx, m, absent, skip, err) : zd__errf(err, -ENOMEM, "out of memory");
  }
  /* torch's total, where the step clips by it: every rank returns the same total or the same
   * failure (compute.h), and a failure leaves the step unapplied on every rank. The parameters
   * skipped on every rank are left out of it, as clip_grad_norm_ over p.grad is not None. */
  float torch_total = 0;
  if (!rc && torch_order != ZD_CLIP_NORM_DOUBLE) {
    if (skip) {
      present = malloc(nbytes);
      if (!present) rc = zd__errf(err, -ENOMEM, "out of memory");
      for (size_t i = 0; present && i < nbytes; i++) present[i] = (uint8_t)~skip[i];
    }
    if (!rc) rc = torch_total_norm(ctx, m, torch_order, present, &torch_total, err);
    free(present);
    zd__err_t ignored;
    if (rc && checkpoint) zd__ckptr_request(ctx->ckpt, &ignored); /* ask again next step */
  }
  if (rc) {
    free(skip);
    end_speculation(m); /* the committed set is untouched */
    return job_end(ctx, buf, slot, rc, err);
  }

  /* Committed: every rank takes the same decision from the same global statistics (the same
   * function as the CUDA backend's decide kernel). */
  if (groups != m->groups) memcpy(m->groups, groups, m->shard.ngroups * sizeof *groups);
  memset(m->scattered, 0, l->nbuckets);
  /* Its client gathers every bucket before its next scatter, the update applied or skipped. */
  if (!gather) memset(m->ungathered, 1, l->nbuckets);
  zd__decide_cfg_t cfg = {.world_size = ctx->world_size,
                          .grad_mean = m->grad_mean,
                          .need_stats = need_stats,
                          .max_grad_norm = m->max_grad_norm};
  if (torch_order != ZD_CLIP_NORM_DOUBLE) {
    cfg.torch_total = 1;
    cfg.total_norm = torch_total;
  }
  zd__step_state_t st = {.scaler = m->scaler, .step = m->step, .steps_skipped = m->steps_skipped};
  zd__decision_t dec;
  zd__step_decide(&cfg, sumsq, nonfinite, &st, &dec);
  *out = (zd__step_out_t){.step = dec.step,
                          .applied = dec.applied,
                          .grad_norm = dec.grad_norm,
                          .loss_scale = dec.loss_scale,
                          .clip_coef = dec.clip_coef};
  if (dec.skip) {
    free(skip);
    m->scaler = st.scaler;
    m->steps_skipped = st.steps_skipped;
    zd__model_commit(m, 0);                         /* the scaler's new state (a state file) */
    end_speculation(m);                             /* dropped: the committed set stays */
    rc = job_end_early(ctx, buf, slot, ZD_OK, err); /* skipped: parameters unchanged, no gather */
    if (!rc && checkpoint) snapshot_after_step(ctx, m);
    out->duration_us = zd__now_us() - t0;
    return rc;
  }
  zd__adam_group_t consts[m->shard.ngroups];
  for (uint32_t g = 0; g < m->shard.ngroups; g++)
    zd__adam_group_init(&consts[g], &m->groups[g], dec.step);
  /* Parameters skipped or lagging (skips_absent): the update sees their segments rebuilt
   * (uneven_t). */
  uneven_t uneven = {0};
  int is_uneven = skips_absent(ctx) && (skip || m->nlagging);
  if (is_uneven) rc = uneven_build(ctx, m, skip, dec.step, &uneven, err);
  if (rc) { /* out of memory: nothing applied, on this rank (the others fail at the gather) */
    free(skip);
    end_speculation(m);
    return job_end(ctx, buf, slot, rc, err);
  }
  const zd__shard_t *shard = is_uneven ? &uneven.shard : &m->shard;
  const zd__adam_group_t *step_consts = is_uneven ? uneven.consts : consts;
  /* overlap_update: the update writes the other set, and the step commits by switching to it.
   * A bucket's speculation stands only where this decision applies exactly what it applied (the
   * same constants of every group, the same factor: no clipping, no overflow, no hyperparameter
   * changed since, no parameter of the bucket skipped or lagging); every other bucket is updated
   * now from the committed set, as it would be in place. */
  float *const *other = zd__model_other_set(m);
  int reuse = other && dec.step == m->spec_step &&
              float_bits(dec.grad_scale) == float_bits(m->spec_scale) && m->shard.ngroups > 0 &&
              m->shard.ngroups <= m->spec_cap &&
              memcmp(consts, m->spec_consts, m->shard.ngroups * sizeof *consts) == 0;
  uint64_t t_update = zd__now_us();
  for (uint32_t b = 0; b < l->nbuckets && !rc; b++) {
    if (is_uneven && !uneven.plain[b]) m->speculated[b] = 0; /* made for the model's segments */
    if (reuse && m->speculated[b]) continue;
    if (m->speculated[b]) m->spec_recomputed++;
    rc = ctx->compute->ops->update(ctx->compute, shard, b, buf, step_consts, dec.grad_scale, other,
                                   err);
    if (!rc && other && skip) copy_skipped(ctx, m, skip, b, other);
  }
  m->update_us += zd__now_us() - t_update;
  if (is_uneven) uneven_free(l, &uneven);
  if (rc) { /* only the device fails here, and its rank is then degraded (rank.c) */
    free(skip);
    end_speculation(m);
    ZD_LOG_ERROR("step %" PRIu64 ": the update could not be queued: %s", dec.step, err->msg);
    return job_end(ctx, buf, slot, rc, err);
  }
  for (uint32_t i = 0; skip && i < l->nparams; i++)
    if (bit_set(skip, i) && m->lag[i]++ == 0) m->nlagging++; /* its own step did not advance */
  free(skip);
  m->step = st.step;
  m->scaler = st.scaler;
  zd__model_commit(m, other != NULL);
  /* The working parameters of the speculated buckets, from the master weights just committed.
   * Where the buckets are gathered next (this step's gather at W > 1, or the client's gathers
   * after a step without one), the speculation thread writes them, in the gathers' order, and
   * each bucket's gather starts once its own are written (gather_buckets): the gather of a
   * committed bucket overlaps the write of the next. At W = 1 a step that gathers writes them
   * itself (its gathers move nothing). */
  int early = m->spec && (gather ? ctx->world_size > 1 : 1);
  for (uint32_t b = 0; reuse && b < l->nbuckets && !rc; b++)
    if (m->speculated[b]) {
      if (early)
        zd__model_params_async(m, b, buf);
      else
        rc = ctx->compute->ops->params_from_master(ctx->compute, &m->shard, b, buf, err);
      m->spec_committed++;
    }
  end_speculation(m);
  if (gather) { /* every rank's peers enter this gather: never skipped, even after a failure */
    zd__err_t gerr = {0};
    int g = gather_buckets(ctx, m, buf, -1, rc ? &gerr : err);
    if (!rc) rc = g;
  }
  /* Every write queued above, also after a failed gather. Without the gather the reply goes now
   * and the writes go on beside the client's gathers (model.h, zd__model_params_async). */
  if (gather) zd__model_spec_wait(m);
  rc = job_end_early(ctx, buf, slot, rc, err);
  if (checkpoint) snapshot_after_step(ctx, m); /* also after a failed gather: the state is whole */
  zd__buddy_after_step(ctx, m);                /* every buddy_copy_every_steps steps (buddy.h) */
  zd__snapshot_after_step(ctx, m);             /* state_dir_mode = snapshot (snapshot.h) */
  out->duration_us = zd__now_us() - t0;
  if (rc) {
    char cause[ZD__ERR_MSG_MAX];
    snprintf(cause, sizeof cause, "%s", err->msg);
    /* A distinct code: the client must not take this step for one that was not applied. */
    return zd__errf(err, ZD_EAPPLIED, "step %" PRIu64 " was applied, but %s failed (%s): %s",
                    m->step, gather ? "the gather" : "completing it", zd_err_name(rc), cause);
  }
  return ZD_OK;
}

/* ---- a client that left ---------------------------------------------------------------------- */

/* A stand-in's gather of bucket b on device buffers, through scratch (a buffer of the backend's
 * memory that holds the bucket): what the other ranks receive from this one is its slice as its
 * client's buffer would hold it, the working parameters written from the master weights (after
 * the update, if the bucket's step was applied: its bits, compute.h's slice_params); what it
 * receives from them is discarded. */
static int stand_in_gather(const zd__step_ctx_t *ctx, zd__model_t *m, void *scratch, uint32_t b,
                           zd__err_t *err) {
  zd__compute_t *c = ctx->compute;
  const zd__bucket_t *bk = &m->layout->buckets[b];
  int rc = c->ops->slice_params(c, &m->shard, b, scratch, err);
  if (!rc)
    rc = ctx->comm->ops->all_gather(ctx->comm, b, scratch, m->shard.param_dtype, bk->shard_elems,
                                    err);
  if (rc) return rc;
  m->ungathered[b] = 0;
  m->collective_bytes += bk->elems * zd_dtype_size(m->shard.param_dtype);
  return ZD_OK;
}

/* A stand-in's scatter of bucket b on device buffers: zeros from scratch (the step is abandoned
 * on every rank, so what this rank sends does not matter), reduced into the rank's own gradient
 * shard (world size > 1, where stand-ins run). */
static int stand_in_scatter(const zd__step_ctx_t *ctx, zd__model_t *m, const void *scratch,
                            uint32_t b, zd__err_t *err) {
  const zd__bucket_t *bk = &m->layout->buckets[b];
  zd_assert(m->shard.grad_shard); /* else the shard would be read in place, from scratch */
  int rc = ctx->comm->ops->reduce_scatter(ctx->comm, b, scratch, m->grad_dtype, bk->shard_elems,
                                          m->shard.grad_shard + bk->shard_base, &m->shard.grad[b],
                                          &m->shard.grad_dtype[b], err);
  if (rc) return rc;
  m->scattered[b] = m->attempted[b] = 1;
  m->abandoned = 0; /* a new attempt */
  m->collective_bytes += bk->elems * zd_dtype_size(m->grad_dtype);
  return ZD_OK;
}

/* Bytes of a stand-in's scratch: any bucket, whole, in the larger of the two dtypes. */
static size_t stand_in_scratch_bytes(const zd__step_ctx_t *ctx, const zd__model_t *m) {
  size_t size = zd_dtype_size(m->shard.param_dtype), g = zd_dtype_size(m->grad_dtype), max = 0;
  if (g > size) size = g;
  for (uint32_t b = 0; b < m->layout->nbuckets; b++) {
    size_t bytes = (size_t)m->layout->buckets[b].shard_elems * ctx->world_size * size;
    if (bytes > max) max = bytes;
  }
  return max;
}

int zd__model_stand_in(const zd__step_ctx_t *ctx, zd__model_t *m, const zd__buffers_t *buf,
                       int abrupt, int *kept, zd__err_t *err) {
  const zd__layout_t *l = m->layout;
  zd__compute_t *c = ctx->compute;
  uint32_t nb = l->nbuckets, attempted = 0, ungathered = 0, gathers = 0, scatters = 0;
  for (uint32_t b = 0; b < nb; b++) {
    attempted += m->attempted[b];
    ungathered += m->ungathered[b];
  }
  /* At a step's edge the other ranks' clients may be in the next step already (waiting for this
   * rank in its first scatter), or not: a client that disconnected there gets them out of it, as
   * one that left in the middle must; one that said bye did not leave a step. */
  int step = attempted > 0 || (abrupt && !m->abandoned);
  uint64_t n = m->step + (ungathered ? 0 : 1);
  *kept = 0;
  /* Device buffers are CUDA IPC mappings of the client's process, which may be dead (undefined
   * behaviour; a fault would take the state on this GPU with it): never touched. Scratch of the
   * rank's own device memory stands in for them. Host buffers stay mapped and valid. */
  int device = buf->params.kind == ZD__SHM_CUDA;
  size_t scratch_bytes = device ? stand_in_scratch_bytes(ctx, m) : 0;
  uint64_t scratch_words = (scratch_bytes + sizeof(float) - 1) / sizeof(float);
  float *scratch = NULL;
  /* Nothing is left to order this work after: the client's CUDA events are neither waited on nor
   * recorded. */
  zd__buffers_t own = *buf;
  own.device = -1;
  int rc = job_begin(ctx, &own, 0, err);
  if (!rc && device && (ungathered || step)) {
    if (!c->ops->slice_params || !c->ops->zero)
      rc =
          zd__errf(err, ZD_EINTERNAL, "the %s backend cannot stand in for device buffers", c->name);
    else /* zeroed, on the rank's stream */
      rc = c->ops->alloc(c, scratch_words, &scratch, err);
  }
  for (uint32_t b = 0; b < nb && !rc; b++) {
    if (!m->ungathered[b]) continue;
    rc = device ? stand_in_gather(ctx, m, scratch, b, err)
                : gather_buckets(ctx, m, &own, (int32_t)b, err);
    if (!rc) gathers++;
  }
  if (!rc && step) {
    n = m->step + 1;
    if (device && gathers) rc = c->ops->zero(c, scratch, scratch_bytes, err); /* params there */
    for (uint32_t b = nb; b-- > 0 && !rc;) {
      if (m->attempted[b]) continue;
      rc = device ? stand_in_scatter(ctx, m, scratch, b, err)
                  : scatter_buckets(ctx, m, &own, (int32_t)b, 0, err);
      if (!rc) scatters++;
    }
    double sumsq;
    uint64_t nonfinite;
    int checkpoint, any_absent;
    if (!rc)
      rc = commit_point(ctx, m, m->groups, ZD_CLIP_NORM_DOUBLE, needs_stats(ctx, m), 1, 0, &sumsq,
                        &nonfinite, &checkpoint, &any_absent, err);
    end_speculation(m);      /* nothing of the step is applied */
    if (rc == ZD_EABORTED) { /* as intended: every rank refuses the step */
      rc = ZD_OK;
      memset(m->scattered, 0, nb);
      m->abandoned = 1;
    }
  }
  rc = job_end(ctx, &own, 0, rc, err);
  /* After the wait for the job's work (release waits, bounded, for the stream to run out, and
   * leaves the memory to the exit if it does not). */
  if (scratch) c->ops->release(c, scratch, scratch_words);
  if (rc) {
    ZD_LOG_ERROR("standing in for the client that left in step %" PRIu64 " failed: %s", n,
                 err->msg);
    return rc;
  }
  if (gathers || step)
    ZD_LOG_WARN("the client %s in step %" PRIu64 ": stood in for it (%u gathers, %u scatters%s%s)",
                abrupt ? "disconnected" : "said bye", n, gathers, scatters,
                step ? ", the step abandoned on every rank" : "",
                device ? "; its device buffers untouched" : "");
  if (buf->params.kind == ZD__SHM_HOST) { /* for the next client, which resumes alone */
    zd__shm_unmap(&m->kept);
    m->kept = buf->params;
    *kept = 1;
  }
  return ZD_OK;
}
