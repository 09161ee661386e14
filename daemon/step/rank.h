/* Local ranks: the optimizer state of one data-parallel rank and the worker thread that runs its
 * jobs.
 *
 * A rank holds at most one model (zd__model_t): the layout, fp32 master weights and Adam moments
 * of its shard, the hyperparameters and the step counter. The model outlives its clients: a
 * client that reconnects and registers the same layout continues where the last one stopped.
 *
 * Ownership: the loop thread creates jobs from client requests and queues them on the rank; the
 * rank's worker thread runs them in order (a collective can block there without stalling the
 * loop) and hands each finished job back to whoever queued it (its done callback: the transport,
 * which answers the client). The model is touched only by the thread running a job: the worker,
 * or the loop thread itself for a small job of an idle rank (zd__rank_run_inline); the loop reads
 * a snapshot (zd__rank_stats_t) under a lock.
 */
#ifndef ZD_DAEMON_RANK_H
#define ZD_DAEMON_RANK_H

#include <pthread.h>
#include <stdint.h>

#include "backend.h"
#include "comm.h"
#include "error.h"
#include "layout.h"
#include "liveness.h"
#include "model.h"
#include "pool.h"
#include "shm.h"
#include "state.h"
#include "status.h"
#include "step.h"
#include "step_decide.h"
#include "zerod/zerod.h"

typedef struct zd__rank zd__rank_t;
typedef struct zd__job zd__job_t;

/* A daemon's local ranks, looked up by index by the layers above (loop thread). */
typedef struct zd__ranks {
  uint32_t n;
  zd__rank_t **rank; /* rank[i] is local rank i */
} zd__ranks_t;

typedef enum zd__job_type {
  ZD__JOB_ATTACH,    /* register: create or resume the model, fill the client's param buffer */
  ZD__JOB_SCATTER,   /* reduce-scatter one bucket or all */
  ZD__JOB_STEP,      /* [scatter], optimizer step, [gather] */
  ZD__JOB_GATHER,    /* all-gather one bucket or all */
  ZD__JOB_STAND_IN,  /* the client left (W > 1): stand in for it where the world is (step.h) */
  ZD__JOB_CHECKPOINT /* checkpoint the state between steps (zd_checkpoint; step.h) */
} zd__job_type_t;

/* Called on the thread that ran the job (its worker; neither for a job that zd__rank_run_inline
 * ran, whose caller completes it): `answer` (may be NULL) right after it ran, `done` once its
 * work is complete. They differ on a CUDA rank in cuda_step fast, where a job may leave its
 * work running on the stream after its reply (compute.h, finish_early): done then comes once
 * the worker has seen the stream run out (or fail); and with overlap_update, where a step
 * without its gather leaves its parameters' writes to the speculation thread (model.h): done
 * once they have ended. Jobs are done in the order they ran. */
typedef void (*zd__job_done_fn)(zd__job_t *job);

struct zd__job {
  zd__job_t *next;
  zd__job_type_t type;
  zd__rank_t *rank;
  zd__job_done_fn answer; /* set by whoever queues it; may be NULL */
  zd__job_done_fn done;   /* set by whoever queues it */
  void *session;          /* the requester, for the reply (STAND_IN: the session that left, which
                             waits for it before it ends) */
  uint64_t request_id;
  uint16_t msg_type;
  const zd__buffers_t *buffers;
  uint32_t event_slot; /* CUDA buffers: the request's pair of events (< ZD__EVENT_SLOTS); 0 with
                          host buffers */
  union {
    zd__model_spec_t *spec; /* ATTACH */
    int32_t bucket;         /* SCATTER, GATHER: -1 for all */
    struct {
      zd_group_t *groups; /* NULL: keep; else ngroups validated entries, owned by the job */
      uint32_t ngroups;
      int scatter;
      int gather;
      zd_clip_norm_t clip_norm;
      uint8_t *absent; /* parameters without a gradient (StepRequest.absent), one bit each,
                          owned by the job; NULL: every parameter has one */
    } step;
    int abrupt; /* STAND_IN: the client disconnected (else it said bye) */
    int wait;   /* CHECKPOINT: answer once it is written */
  } in;
  zd_group_t *next_groups; /* SCATTER: the next step's groups as the trainer had them
                              (ScatterRequest.groups), the model's number of them, owned by the
                              job; NULL: none sent */
  int code;                /* result */
  int answer_early;        /* set when queued: the worker may send the reply itself (jobs.h) */
  int answered;            /* it did */
  zd__err_t err;
  union {
    struct {
      uint64_t step;
      int resumed;
      double loss_scale;
      uint64_t layout_hash;
      uint64_t total_elems;
      uint32_t nbuckets;
      uint64_t shard_elems;
    } attach;
    zd__step_out_t step;
    int kept; /* STAND_IN: the rank took over the client's param buffer (the session forgets it) */
    struct {
      uint64_t step;
      char dir[512];
    } checkpoint;
  } out;
};

/* Frees a job and what it owns. */
void zd__job_free(zd__job_t *job);

typedef enum zd__health {
  ZD__HEALTH_OK = 0,
  ZD__HEALTH_DEGRADED = 1,   /* a collective or the world's bootstrap failed; see the reason */
  ZD__HEALTH_CONNECTING = 2, /* joining the world: waiting for peers */
  ZD__HEALTH_REJOINING = 3,  /* a peer failed: re-forming the world (checkpoints on: rank.c) */
  ZD__HEALTH_RESTORING = 4   /* a registration is loading a checkpoint (resume, or after a heal) */
} zd__health_t;

/* "ok", "degraded", "connecting". */
const char *zd__health_name(zd__health_t health); /* ... "rejoining" */

/* Upper bounds (microseconds) of the step-duration histogram's buckets, as Prometheus' "le". */
#define ZD__STEP_HIST_BOUNDS_US                                                            \
  {                                                                                        \
    100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000, 1000000, \
        2500000, 10000000                                                                  \
  }
#define ZD__STEP_HIST_BUCKETS 15

/* What the loop may read about a rank at any time. */
typedef struct zd__rank_stats {
  int has_model;
  uint32_t nparams;
  uint32_t nbuckets;
  uint64_t layout_hash;
  uint64_t total_elems;
  uint64_t shard_elems;
  zd__states_t states;       /* the model's state arrays (common/state.h), each shard_elems fp32 */
  uint64_t grad_shard_bytes; /* reduced-gradient buffer (0 at world size 1: read in place) */
  zd_dtype_t param_dtype;
  zd_dtype_t grad_dtype;
  uint64_t step;
  uint64_t steps_skipped;
  double loss_scale;
  double last_grad_norm;
  double last_clip_coef;
  uint64_t last_step_us;
  uint64_t total_step_us;
  uint64_t steps_run; /* step jobs that ran the update or a skip */
  uint64_t scatters;
  uint64_t gathers;
  uint32_t state_sets;      /* 2 with overlap_update (model.h), else 1 */
  uint32_t committed_set;   /* the set that holds the state (model.h, zd__committed_t) */
  uint64_t spec_committed;  /* buckets whose speculative update a step committed */
  uint32_t params_lagging;  /* parameters whose own step count lags the model's (model.h, lag) */
  uint64_t spec_recomputed; /* ... and whose speculation a step recomputed (clipped, skipped
                               is not counted: nothing applied) */
  uint64_t heals;           /* times the world was re-formed around this rank after a peer failed */
  /* the model's phase and collective counters (zd__model_t), and the step durations in the
   * buckets of ZD__STEP_HIST_BOUNDS_US (the last one: longer), for the metrics' histogram */
  uint64_t scatter_us, update_us, gather_us, collective_bytes, collective_us;
  uint64_t step_hist[ZD__STEP_HIST_BUCKETS + 1];
  int resume_pending; /* healed: the next registration resumes the newest checkpoint */
  /* The last recovery (a registration that resumed a state or a heal's re-registration): how
   * ("state_dir", "state_dir (kept)", "checkpoint", "none": the client's values; "" none yet),
   * its step, how long from the loss (the heal's start, else the registration's) to the rank
   * serving again, and why the state files were not used when they were not. */
  char recovery[24];
  uint64_t recovery_step;
  uint64_t recovery_ms;
  char recovery_note[160];
  char state_path[256];          /* state_dir: the model's state file; "" none */
  uint64_t state_committed_step; /* ... and the step its newest header commits */
  zd__phase_times_t gpu_times;   /* CUDA: where the steps' GPU time went (compute.h) */
  zd__health_t health;
  char degraded_reason[ZD__ERR_MSG_MAX];
  /* The last live resize (zd__rank_request_resize): "" when none; else what happened, for status
   * ("step 12: 4 -> 2 ranks in 35 ms", or the reason it failed). */
  char last_resize[ZD__ERR_MSG_MAX];
  uint64_t resizes; /* live resizes this rank took part in, done or failed (last_resize's) */
  int left;         /* a live resize left this rank outside the world (zeroctl drain --leave) */
  /* A live resize to this many ranks agreed at the last step and not run yet (0: none): it runs
   * at the trainer's next request and can no longer be withdrawn. */
  uint32_t resize_agreed;
} zd__rank_stats_t;

struct zd__world;

typedef struct zd__rank_env {
  uint32_t local_rank;
  uint32_t local_ranks; /* of this daemon: their workers may all be stepping at once */
  uint32_t rank;        /* global */
  uint32_t world_size;
  zd__comm_t *comm;              /* taken over by the rank; NULL: join `world` first */
  const struct zd__world *world; /* how to join a multi-rank world (world.h); outlives the rank */
  struct zd__pool *pool;         /* CPU backend: the kernel pool and ISA (zd__isa_t) */
  struct zd__ckptr *ckpt;        /* the daemon's checkpointer; outlives the rank */
  int isa;
  const zd__gpu_info_t *gpu; /* CUDA backend: this rank's GPU (outlives the rank); NULL: CPU */
  int cuda_fast;             /* CUDA backend: cuda_step fast (else legacy; config.h) */
  int overlap_update;        /* CPU backend: overlap_update (config.h, model.h) */
  const char *state_dir;     /* CPU backend: state_dir (config.h, state_file.h); NULL: none */
  const char *record_dir;    /* where a live resize writes its world size record (world_record.h):
                                state_dir in either state_dir_mode; NULL: none */
  /* The live resize's record that gave world_size at start (world_record.h; world_size_record =
   * use); NULL: world_size as configured. A rank at or beyond it stays out of the world (its
   * trainer is refused with ZD_ERANK, the rank is degraded), as a rank a resize left. Rank 0
   * writes it into the rendezvous store once the world formed (its store may have restarted). */
  const struct zd__world_record *record;
  /* Called on the worker each time this rank's world instance forms (join, heal, resize) with
   * the zerod process of every global rank (world.h's incarnations, world_size of them): the
   * heartbeat watches those processes from then on (zd__liveness_formed). NULL: nobody. */
  void (*formed)(void *ctx, const uint64_t *incarnations, uint32_t world_size);
  void *formed_ctx;
} zd__rank_env_t;

/* Creates a rank and starts its worker thread. With the CUDA backend the worker first makes the
 * device current, creates the rank's stream and state backend, and its NCCL communicator (a
 * one-rank one at world size 1, else through the world's rendezvous); the rank says `connecting`
 * until then and `degraded`, with the reason, if that fails. Errors: -ENOMEM, -EAGAIN. */
int zd__rank_create(const zd__rank_env_t *env, zd__rank_t **out);

/* Shutdown has begun: waits for peers (the world's bootstrap, registration barriers) give up
 * with -ECANCELED from now on, so that the jobs in flight finish soon, and a stand-in for a
 * client that left (ZD__JOB_STAND_IN, whose answer nobody waits for) is aborted at once. Any
 * thread. */
void zd__rank_cancel(zd__rank_t *rank);

/* The client of the registration queued or running on the rank left: a registration still waiting
 * for the other ranks' clients (the barrier) gives up within a second, so that the rank is
 * released for the next client. Any thread (the loop). */
void zd__rank_abandon_attach(zd__rank_t *rank);

/* Shutdown is taking too long: the collective in progress fails now (-ECANCELED) instead of
 * waiting for a silent peer up to the collective timeout; the rank is then degraded. Any
 * thread. */
void zd__rank_abort(zd__rank_t *rank);

/* A peer of the world was found dead or restarted (the heartbeat's verdict on the process
 * `incarnation` of global rank peer_rank, liveness.h). Ignored when it is not about the world
 * instance this rank is in (formed with another process than a silent one, or with the one now
 * there) and while the rank re-forms; otherwise the collective in progress, and every later one,
 * fails at once with ZD_EPEER and `why`, and so does a registration waiting for the other ranks,
 * which then degrades the rank, instead of waiting for the collective or connect timeout. Any
 * thread. */
void zd__rank_peer_dead(zd__rank_t *rank, uint32_t peer_rank, zd__verdict_t verdict,
                        uint64_t incarnation, const char *why);

/* Stops the worker after the queued jobs have run (cancelling a world bootstrap still waiting
 * for peers), joins it and frees the rank and its model; accepts NULL. */
void zd__rank_destroy(zd__rank_t *rank);

/* Jobs of a world-size-1 CPU model up to this many elements may run on the loop thread: a step
 * then costs no thread hand-off (two wake-ups saved, most of a tiny step's round trip and up to
 * a quarter of a 2^20-parameter one's). The bound is where the kernel starts to use a second
 * thread (pool.h), so the step runs single-threaded in any case, and a status or control call
 * waits behind it for at most a few milliseconds. */
#define ZD__INLINE_MAX_ELEMS (2 * ZD__POOL_STREAM_MIN_PER_THREAD - 1)

/* Runs a scatter, step or gather job right here, on the calling (loop) thread, when the rank
 * allows it (ZD__INLINE_MAX_ELEMS) and has nothing queued or running; returns 1 if it ran (the
 * caller then completes the job itself), 0 if the job must be submitted. */
int zd__rank_run_inline(zd__rank_t *rank, zd__job_t *job);

/* Queues a job (any thread; in practice the loop); job->done is called once it has run. */
void zd__rank_submit(zd__rank_t *rank, zd__job_t *job);

/* Whether the rank's worker has no job queued or running (any thread; a snapshot). */
int zd__rank_idle(zd__rank_t *rank);

/* 1 when the rank runs the CUDA backend in cuda_step fast: its worker answers jobs on CUDA
 * buffers itself (jobs.c), before their work has completed. Any thread. */
int zd__rank_cuda_fast(const zd__rank_t *rank);

/* Whether the rank's device work has run out: nothing of it queued or running on the rank's
 * stream (CUDA: cudaStreamQuery; a CUDA context that failed counts as idle, since nothing more
 * runs there). Always 1 with the CPU backend, whose operations are complete when they return; 0
 * while jobs wait in the rank's queue. Loop thread, when no job of the session attached to the
 * rank is in flight: nothing then queues work on the stream, so a 1 stays true until the next
 * job (a 0 may turn into 1 later, when stuck work drains). The session asks it before closing a
 * client's CUDA IPC mappings, which must not be closed under work that may still use them. */
int zd__rank_stream_idle(zd__rank_t *rank);

/* Copies the rank's stats (any thread). */
void zd__rank_stats(zd__rank_t *rank, zd__rank_stats_t *out);

/* The rank's status section, "rank N" (a zd__status_fn; ctx is the rank). Loop thread. */
void zd__rank_status(void *rank, zd__status_t *st);

/* Bytes of the state arrays in `states` (master weights and the optimizers' arrays: the status's
 * state_bytes), of a shard of shard_elems elements, in each of `sets` sets (overlap_update: 2). */
uint64_t zd__rank_state_bytes(zd__states_t states, uint64_t shard_elems, uint32_t sets);

/* One bucket's slice owned by a rank: flat element offsets [begin, end). */
typedef struct zd__shard_range {
  uint32_t bucket;
  uint64_t begin;
  uint64_t end;
} zd__shard_range_t;

/* Copies the rank's shard, one range per bucket, as of the last finished job (any thread; for
 * status). *out is malloc'd (free()), NULL with *n = 0 when no model is registered.
 * Errors: -ENOMEM. */
int zd__rank_shard_ranges(zd__rank_t *rank, zd__shard_range_t **out, uint32_t *n);

uint32_t zd__rank_local(const zd__rank_t *rank);
uint32_t zd__rank_global(const zd__rank_t *rank);
uint32_t zd__rank_world_size(const zd__rank_t *rank);

/* Live resize (resize.h): asks this rank to resize the world to world_size ranks after the next
 * step every rank agrees on (the request rides the step's record, so one node's request is
 * enough). CPU backend, world size > 1 before; 1 after only through zeroctl drain --leave (the
 * control service's Resize asks for 2 or more). Errors: ZD_EBACKEND, ZD_ECONFIG (a size out of
 * range), ZD_EORDER (not in a multi-rank world). Any thread. */
int zd__rank_request_resize(zd__rank_t *rank, uint32_t world_size, zd__err_t *err);

/* Withdraws this rank's request for a resize not yet sent with a step (a drain --leave given
 * up); one already agreed on goes on. Any thread. */
void zd__rank_withdraw_resize(zd__rank_t *rank);

/* The rank's GPU with the CUDA backend; NULL with the CPU backend. */
const zd__gpu_info_t *zd__rank_gpu(const zd__rank_t *rank);

#endif /* ZD_DAEMON_RANK_H */
