/* Compute backends: where a rank's optimizer state lives and what runs the kernels on it, behind
 * one small vtable so that the step logic (step/step.c) is ONE code path for every backend.
 *
 * A backend sees a rank's shard (zd__shard_t), never the model: the layout, the segments of each
 * bucket, the state arrays by role (common/state.h: master and the optimizer's own arrays, as a
 * table) and where each bucket's reduced gradients are. An optimizer's state is therefore data:
 * a new state array is a row of that table and its use in the kernels, nothing here.
 *
 * The step logic decides the order of operations, builds the step record, takes the decision and
 * keeps the step atomic; a backend only provides the pieces:
 *
 *   alloc / release   zeroed fp32 arrays (the state arrays, the reduced-gradient shard)
 *   shard_init/fini   per-shard resources built once at registration (CUDA: the device layout
 *                     of every bucket, the step record in device memory)
 *   begin / finish    the edges of a job: begin orders the job after the client's work on its
 *                     buffers (CUDA: the stream waits on the "grads ready" event of the job's
 *                     event slot); finish orders the client after the job (CUDA: records the
 *                     slot's "params ready") and waits until the job's work is complete, bounded
 *                     by the collective timeout; finish_early may instead return once the work
 *                     is queued (CUDA, cuda_step fast), and settle then sees it complete
 *   stream_idle       whether the rank's device work has run out (before the session closes a
 *                     client's CUDA IPC mappings)
 *   exchange          master weights <-> the client's param buffer over this rank's shard
 *   slice_params/zero (CUDA) a stand-in's scratch: this rank's working parameters of a bucket
 *                     from the master weights, zeroing; never the buffers of a client that left
 *   host_alloc/free   host staging memory for copies of the state (CUDA: pinned, so that the
 *                     copies are asynchronous and their waits are bounded)
 *   snapshot          the state arrays to host staging, stream-ordered, off the step's path; a
 *                     fence says when the copy is done (fence_wait, any thread)
 *   restore           host staging back into the state arrays (a resume), bounded wait
 *   grad_stats        sum of squares and non-finite count of a bucket's reduced gradients, into
 *                     this rank's step record
 *   torch_norm        (CPU only) the global norm in the fp32 order of a torch build, for clipping
 *                     bit for bit as that torch does (a collective at world size > 1)
 *   gather_records    all-gather of the step records (the commit point), into host memory
 *   update            the optimizer update of one bucket (each group by its optimizer's kernel,
 *                     kernels/optim.h's table), writing working parameters;
 *                     in place, or (CPU) from the committed set of state arrays into the other
 *   params_from_master (CPU) a bucket's working parameters from the master weights
 *   phase_times       (CUDA) where the GPU time of the steps went, from timing events
 *   queue_decision /  (CUDA, cuda_step fast) the records' all-gather and the step's decision on
 *   wait_decision     the device, queued before the update with no host wait in between, and the
 *                     wait for the decision alone (step.c checks it against its own)
 *
 * CPU (compute_cpu.c): host memory (mmap, huge pages), the fork-join pool and the SIMD kernels of
 * kernels/adam.h; begin and finish do nothing (every operation is complete when it returns).
 * CUDA (compute_cuda.c): device memory, one non-blocking stream per rank, the launchers of
 * kernels/adam_cuda.h. Everything is queued on the rank's stream; in a job the worker thread
 * waits for the GPU in at most two places, both bounded by collective_timeout_ms with the
 * communicator's asynchronous errors polled (docs/design.md, "Where the host waits"):
 * gather_records when the step needs statistics (to read every rank's record), and finish (before
 * the job's reply; with finish_early in cuda_step fast not at all, and settle waits between jobs).
 * Registration also waits for its layout tables (on a stream of its own) and a resume for its
 * restore (bounded by the checkpoint timeout), and freeing state waits (bounded) for the rank's
 * stream to run out. A snapshot is waited for by the checkpoint writer's thread, not the worker
 * (fence_wait, bounded).
 *
 * A compute object belongs to one rank and is used by one thread at a time: its worker, or the
 * loop thread for the small jobs of a CPU rank it runs inline (rank.h). The one exception is
 * stream_idle, which the loop thread may call between jobs (zd__rank_stream_idle), and the
 * operations that take no backend (host_free, fence_wait, fence_free), which any thread may call.
 */
#ifndef ZD_DAEMON_COMPUTE_H
#define ZD_DAEMON_COMPUTE_H

#include <stddef.h>
#include <stdint.h>

#include "adam.h"
#include "comm.h"
#include "error.h"
#include "layout.h"
#include "segment.h"
#include "shm.h"
#include "state.h"

struct zd__pool;

/* A rank's shard of the model, as the backends see it. The step logic fills it at registration
 * (step.h's model holds one) and keeps grad and grad_dtype current; a backend reads it, and owns
 * only cdata. */
typedef struct zd__shard {
  const zd__layout_t *layout; /* the model's layout */
  uint32_t rank;              /* global rank: whose slice of every bucket */
  zd_dtype_t param_dtype;     /* of the client's param buffer */
  uint32_t ngroups;           /* parameter groups: the update's constants come one per group */
  uint64_t elems;             /* elements of each array below (the layout's shard, at least 1) */
  float *state[ZD__NSTATES];  /* by role, in the backend's memory; NULL: the model has none */
  float *grad_shard;          /* world size > 1: reduced gradients of the whole shard; else NULL */
  zd__segment_t **segs;       /* per bucket: this rank's segments (host memory) */
  uint32_t *nsegs;
  const void **grad; /* per bucket: where its reduced gradients are (grad_shard, or at world size 1
                        the client's grad buffer), as the last reduce-scatter left them */
  zd_dtype_t *grad_dtype; /* per bucket: their dtype */
  void *cdata;            /* the backend's (shard_init/shard_fini) */
} zd__shard_t;

/* What every rank contributes before an update (the commit point of a step). The layout is that
 * of zd__cuda_stats_t (kernels/step_decide.h): the CUDA statistics kernel writes it in device
 * memory and NCCL all-gathers it there; the three words after the statistics are the tags every
 * rank must agree on, and the last the check word of the 40 bytes before it (zd__record_check),
 * set by whoever writes the record last, so that a torn or poisoned record is refused. */
typedef struct zd__step_record {
  double sumsq;       /* this rank's sum of squared (reduced) gradients */
  uint64_t nonfinite; /* ... and count of non-finite ones */
  uint64_t step;      /* number of the step about to be applied */
  uint64_t layout_hash;
  uint64_t hparam_hash;
  uint64_t check; /* zd__record_check of the fields above */
} zd__step_record_t;

typedef struct zd__compute zd__compute_t;
struct zd__cuda_decide_args; /* kernels/step_decide.h */
struct zd__cuda_decision;

/* Where a step's GPU time went (phase_times): from the job's start on the stream (after the wait
 * for the client's "grads ready") to the first statistics or update (scatter), to the first
 * update (statistics, the records' exchange and the decision), to the end of the last bucket's
 * update (update), to the "params ready" record (gather). Steps that ran no update (skipped,
 * failed) and scatter or gather jobs are not counted. */
typedef struct zd__phase_times {
  uint64_t steps; /* steps counted */
  double scatter_us, stats_us, update_us, gather_us;
} zd__phase_times_t;

typedef struct zd__compute_ops {
  /* n zeroed fp32 elements (n >= 1) in the backend's memory. Errors: -ENOMEM, ZD_EBACKEND. */
  int (*alloc)(zd__compute_t *c, uint64_t n, float **out, zd__err_t *err);
  void (*release)(zd__compute_t *c, float *p, uint64_t n); /* accepts NULL */
  /* After the shard's arrays and segments exist; shard_fini accepts a half-built shard. */
  int (*shard_init)(zd__compute_t *c, zd__shard_t *s, uint32_t world_size, zd__err_t *err);
  void (*shard_fini)(zd__compute_t *c, zd__shard_t *s);
  /* slot: the job's pair of the client's events (< ZD__EVENT_SLOTS; ignored with host buffers). */
  int (*begin)(zd__compute_t *c, const zd__buffers_t *buf, uint32_t slot, zd__err_t *err);
  /* Called once at the end of every job that called begin, with the same slot, whether it failed
   * or not; waits for everything the job queued. Errors as the communicator's (ZD_EPEER,
   * -ETIMEDOUT) or ZD_EBACKEND for a failure of the device. */
  int (*finish)(zd__compute_t *c, zd__comm_t *comm, const zd__buffers_t *buf, uint32_t slot,
                zd__err_t *err);
  /* As finish, for a job whose reply does not depend on its work's completion (a scatter, a
   * gather, a step once its decision is taken): may return once the work is queued, leaving
   * stream_idle 0. A failure of that work is then returned by the next begin, by a later finish
   * (whose wait covers it), or by settle. NULL: finish is called instead (every operation of the
   * CPU backend is complete when it returns). */
  int (*finish_early)(zd__compute_t *c, zd__comm_t *comm, const zd__buffers_t *buf, uint32_t slot,
                      zd__err_t *err);
  /* Worker thread, between jobs: whether the work a finish_early left running has completed.
   * wait 0: never blocks (a query); wait 1: waits for it, bounded by the collective timeout as
   * finish's wait is (and after that long, wait 0 waits too). Returns ZD_OK when nothing is left
   * running (stream_idle is then 1, unless a failure left the stream stuck), -EAGAIN while it
   * runs (wait 0), or the failure of that work, which the next begin returns again so that the
   * next reply says it. NULL: nothing is ever left running. */
  int (*settle)(zd__compute_t *c, zd__comm_t *comm, int wait, zd__err_t *err);
  /* 1 when nothing of the rank's jobs is left on its device stream, as the worker last saw it:
   * every job's finish (or, after a finish_early, settle or a later wait) saw its work complete,
   * or a failed wait found the stream run out (or the device failed: nothing more runs); else 0.
   * Unlike the other operations it may be called from the loop thread while the worker is between
   * jobs: it reads a flag the worker keeps (an atomic), no CUDA call that could block behind a
   * stuck teardown. NULL: always idle (the CPU backend: every operation is complete when it
   * returns). */
  int (*stream_idle)(zd__compute_t *c);
  /* to_client: master -> param buffer (resume), else param buffer -> master (a new model); only
   * the elements the segments cover. */
  int (*exchange)(zd__compute_t *c, const zd__shard_t *s, const zd__buffers_t *buf, int to_client,
                  zd__err_t *err);
  /* The stand-in for a client that left (step.h) never touches that client's buffers: with
   * device buffers they are another process's memory, which may be gone (CUDA IPC: undefined).
   * It uses scratch memory of its own (alloc) instead, and these two operations. NULL with the
   * CPU backend, whose host buffers stay mapped (and valid) after their client's exit.
   *
   * slice_params writes this rank's slice of bucket b's working parameters into `bucket`, a
   * buffer in the backend's memory holding the whole bucket in the param dtype (element 0: the
   * bucket's first; at least shard_elems * world size elements): the slice is zeroed, then every
   * element the segments cover is written from the master weights with the conversion update
   * writes (bit for bit: what the client's buffer holds after that update); the rest of `bucket`
   * is left alone. zero zeroes `bytes` at p (backend's memory). Both are queued after the work
   * before them. Errors: ZD_EDTYPE, ZD_EBACKEND. */
  int (*slice_params)(zd__compute_t *c, const zd__shard_t *s, uint32_t b, void *bucket,
                      zd__err_t *err);
  int (*zero)(zd__compute_t *c, void *p, size_t bytes, zd__err_t *err);
  /* Host staging memory for copies of the state (snapshot, restore): CPU malloc; CUDA pinned
   * (cudaMallocHost), so that the copies are asynchronous DMA and the waits after them bound
   * something (a copy to pageable memory blocks the host). Errors: -ENOMEM, ZD_EBACKEND.
   * host_free takes no backend: the checkpointer, which keeps its staging across models, outlives
   * the ranks (call it through any backend's ops table of the same kind). Memory a copy may still
   * write or read (a fence or a restore that timed out) must never be freed nor reused: leak it.
   * The CUDA backend leaks it itself (with a warning) once a stream of the process was found
   * stuck (a wait for it timed out), since cudaFreeHost waits for the whole device. Accepts NULL.
   * Any thread. */
  int (*host_alloc)(zd__compute_t *c, size_t bytes, void **out, zd__err_t *err);
  void (*host_free)(void *p);
  /* Queues a copy of `count` state arrays (arrays[i]: n elements in the backend's memory) into
   * host (host_alloc'd, count * n floats), back to back, after everything queued so far, and
   * returns without waiting for it: the step's reply is not held by the copy. Work queued on the
   * rank later that writes those arrays (the next update, an exchange into master, a restore)
   * runs only after the copy (CUDA: the copy runs on a side stream, and the rank's stream waits
   * for it, a stream wait, never a host wait). *fence (NULL where the copy is done on return:
   * CPU) says when host holds the copy: fence_wait, then fence_free, from any thread, without
   * the backend (through its ops table: the writer thread may wait after the rank has gone).
   * Errors: ZD_EBACKEND, -ENOMEM. On an error the copy may have been queued in part: host must be
   * treated as still being written (never freed nor reused). */
  int (*snapshot)(zd__compute_t *c, float *const *arrays, uint32_t count, uint64_t n, float *host,
                  void **fence, zd__err_t *err);
  /* Waits at most timeout_ms until the copy of `fence` is done (NULL: at once). Errors:
   * -ETIMEDOUT (the copy may still be writing its host memory), ZD_EBACKEND (the device failed).
   * fence_free accepts NULL and a fence whose copy is not done (released once it is). */
  int (*fence_wait)(void *fence, int timeout_ms, zd__err_t *err);
  void (*fence_free)(void *fence);
  /* Copies host (count * n floats, host_alloc'd) into the state arrays (a resume), after the
   * work queued before it, and waits at most timeout_ms for it. Errors: -ETIMEDOUT, naming what
   * did not finish (the copy may still be reading host: leak it), ZD_EBACKEND. */
  int (*restore)(zd__compute_t *c, float *const *arrays, uint32_t count, uint64_t n,
                 const float *host, int timeout_ms, zd__err_t *err);
  /* Adds bucket b's statistics into this rank's record (first: b is the first bucket of the
   * step; rec carries the tags). */
  int (*grad_stats)(zd__compute_t *c, const zd__shard_t *s, uint32_t b, int first,
                    zd__step_record_t *rec, zd__err_t *err);
  /* torch.nn.utils.clip_grad_norm_'s total norm of the model's fp32 gradients in the order of
   * torch build `order` (not ZD_CLIP_NORM_DOUBLE; kernels/grad_norm.h), each gradient element
   * taken as its fp32 product with `scale` (1, or 1/world_size where summed gradients are
   * averaged: exact where world_size is a power of two): each parameter's norm, then the norm of
   * those in parameter order, of the parameters present alone (present: bit i % 8 of present[i /
   * 8] for parameter i; NULL: all). After every bucket's scatter. At world size > 1 a collective
   * of every rank, which every rank must enter for the same step with the same order, scale and
   * presence (comm's allgather_bytes): a parameter split across ranks' slices is one chain in
   * torch's order, each rank continuing it from the lane state the rank before it passed on (one
   * round per rank a parameter spans beyond its first, all chains' rounds together), and then
   * every rank gathers every parameter's norm and takes the same total. Every rank returns the
   * same total or the same failure (a rank's failure is exchanged), except where a rank cannot
   * allocate its buffers (-ENOMEM before any collective: its peers' collective times out).
   * Errors: -ENOMEM, ZD_EINTERNAL, and comm's. NULL: the backend does not compute it (CUDA), and
   * steps clip by the double norm. */
  int (*torch_norm)(zd__compute_t *c, zd__comm_t *comm, const zd__shard_t *s, zd_clip_norm_t order,
                    float scale, const uint8_t *present, float *total, zd__err_t *err);
  /* all[r] = rank r's record. stats: grad_stats ran for every bucket of this step; else the
   * statistics are 0. Waits for the result. */
  int (*gather_records)(zd__compute_t *c, zd__comm_t *comm, const zd__shard_t *s,
                        const zd__step_record_t *mine, int stats, zd__step_record_t *all,
                        zd__err_t *err);
  /* The update of bucket b: consts holds this step's constants of every group (s->ngroups).
   * out NULL: in place (reads and writes s->state); else out of place: reads s->state and writes
   * out[role] (arrays of s->elems elements, NULL where s->state has none), with the same bits,
   * every array of the bucket's range written (one a group leaves alone is copied). buf NULL:
   * no working parameters are written (a speculative update, daemon/step/step.c); else the
   * client's param buffer at this rank's slice. Out of place is the CPU backend's only: the CUDA
   * backend returns ZD_ECONFIG. */
  int (*update)(zd__compute_t *c, const zd__shard_t *s, uint32_t b, const zd__buffers_t *buf,
                const zd__adam_group_t *consts, float grad_scale, float *const *out,
                zd__err_t *err);
  /* Writes this rank's slice of bucket b in the client's param buffer from the master weights,
   * with the conversion update writes (the same bits): after a speculative update is
   * committed. NULL: not supported (CUDA). */
  int (*params_from_master)(zd__compute_t *c, const zd__shard_t *s, uint32_t b,
                            const zd__buffers_t *buf, zd__err_t *err);
  /* The GPU time of the rank's steps so far, by part, from timing events recorded on the stream
   * at the parts' boundaries and read only once a wait or a query found them complete (never a
   * wait of their own): a step is counted some time after it ran. Worker thread. NULL: not
   * measured (CPU: the host's clock in the model's counters says it). */
  void (*phase_times)(zd__compute_t *c, struct zd__phase_times *out);
  /* The decision on the device, for a step with statistics (CUDA in cuda_step fast, with the
   * decision kernel of kernels/adam_cuda.h; NULL elsewhere: the step gathers the records with
   * gather_records and decides on the host). queue_decision, after grad_stats of every bucket
   * (which sealed this rank's record with its check word), queues with no wait: the receive
   * buffer of the records filled with 0xFF bytes (a record the all-gather does not write whole
   * fails its check), the records' all-gather, the decision kernel over them (a: everything but
   * the records; kernels/step_decide.h), and one copy of the decision and of the records into
   * pinned host memory. Until the job's finish, update then runs only where that decision's
   * verdict is APPLY, with its gradient factor (update's grad_scale is ignored). wait_decision,
   * once the update (and the gather) are queued, waits for that copy alone, bounded and polling
   * the communicator as finish does, and returns the device's decision and every rank's record
   * as copied. Errors: the communicator's (ZD_EPEER, -ETIMEDOUT: it is then aborted),
   * ZD_EBACKEND, -ENOMEM. */
  int (*queue_decision)(zd__compute_t *c, zd__comm_t *comm, const zd__shard_t *s,
                        const struct zd__cuda_decide_args *a, zd__err_t *err);
  int (*wait_decision)(zd__compute_t *c, zd__comm_t *comm, const zd__shard_t *s,
                       struct zd__cuda_decision *dec, zd__step_record_t *all, zd__err_t *err);
  void (*destroy)(zd__compute_t *c);
} zd__compute_ops_t;

struct zd__compute {
  const zd__compute_ops_t *ops;
  const char *name; /* "cpu", "cuda" */
};

/* The CPU backend over a kernel pool (shared by the daemon's ranks) and an ISA (zd__isa_t). */
int zd__compute_cpu_create(struct zd__pool *pool, int isa, zd__compute_t **out);

/* Threads of `pool` the CPU backend updates a bucket of shard_elems elements with. */
unsigned zd__compute_cpu_update_threads(const struct zd__pool *pool, uint64_t shard_elems);

#ifdef ZD_HAVE_CUDA
/* The CUDA backend on `device`, which becomes the calling thread's current device; creates the
 * rank's stream. timeout_ms bounds every wait for the GPU. fast: cuda_step fast (finish_early
 * returns once the work is queued; the waits sleep until the stream wakes them), else legacy
 * (finish_early waits as finish does; the waits poll). Call from the rank's worker thread.
 * Errors: ZD_EBACKEND (the message names the device and the CUDA error), -ENOMEM. */
int zd__compute_cuda_create(int device, int timeout_ms, int fast, zd__compute_t **out,
                            zd__err_t *err);

/* cuda_step fast: the stream's waiter (a zd__cuda_waiter_t, cuda_check.h; owned by the backend)
 * for the rank's communicator (zd__comm_nccl_set_waiter); legacy: NULL. */
void *zd__compute_cuda_waiter(zd__compute_t *c);

/* The rank's stream (a cudaStream_t), on which the NCCL communicator queues its operations. */
void *zd__compute_cuda_stream(zd__compute_t *c);
#endif

static inline void zd__compute_destroy(zd__compute_t *c) {
  if (c) c->ops->destroy(c);
}

#endif /* ZD_DAEMON_COMPUTE_H */
