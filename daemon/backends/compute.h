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
 *                     by the collective timeout
 *   stream_idle       whether the rank's device work has run out (before the session closes a
 *                     client's CUDA IPC mappings)
 *   exchange          master weights <-> the client's param buffer over this rank's shard
 *   grad_stats        sum of squares and non-finite count of a bucket's reduced gradients, into
 *                     this rank's step record
 *   torch_norm        (CPU only) the global norm in the fp32 order of a torch build, for clipping
 *                     bit for bit as that torch does at world size 1
 *   gather_records    all-gather of the step records (the commit point), into host memory
 *   update            the fused AdamW/Adam update of one bucket, writing working parameters
 *
 * CPU (compute_cpu.c): host memory (mmap, huge pages), the fork-join pool and the SIMD kernels of
 * kernels/adam.h; begin and finish do nothing (every operation is complete when it returns).
 * CUDA (compute_cuda.c): device memory, one non-blocking stream per rank, the launchers of
 * kernels/adam_cuda.h. Everything is queued on the rank's stream; in a job the worker thread
 * waits for the GPU in exactly two places, both bounded by collective_timeout_ms with the
 * communicator's asynchronous errors polled (docs/design.md, "Where the host waits"):
 * gather_records when the step needs statistics (to read every rank's record), and finish (before
 * the job's reply). Registration also waits for its layout tables (on a stream of its own), and
 * freeing state waits (bounded) for the rank's stream to run out.
 *
 * A compute object belongs to one rank and is used by one thread at a time: its worker, or the
 * loop thread for the small jobs of a CPU rank it runs inline (rank.h). The one exception is
 * stream_idle, which the loop thread may call between jobs (zd__rank_stream_idle).
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
  /* 1 when nothing of the rank's jobs is left on its device stream, as the worker last saw it:
   * every job's finish waited for its work, or a failed wait found the stream run out (or the
   * device failed: nothing more runs); else 0. Unlike the other operations it may be called from
   * the loop thread while the worker is between jobs: it reads a flag the worker keeps (an
   * atomic), no CUDA call that could block behind a stuck teardown. NULL: always idle (the CPU
   * backend: every operation is complete when it returns). */
  int (*stream_idle)(zd__compute_t *c);
  /* to_client: master -> param buffer (resume), else param buffer -> master (a new model); only
   * the elements the segments cover. */
  int (*exchange)(zd__compute_t *c, const zd__shard_t *s, const zd__buffers_t *buf, int to_client,
                  zd__err_t *err);
  /* Copies n elements of one of the shard's state arrays (state: in the backend's memory) to
   * host memory (to_host: a checkpoint's snapshot) or back (a resume); complete when it returns,
   * after the work queued before it. */
  int (*copy_state)(zd__compute_t *c, float *state, float *host, uint64_t n, int to_host,
                    zd__err_t *err);
  /* Adds bucket b's statistics into this rank's record (first: b is the first bucket of the
   * step; rec carries the tags). */
  int (*grad_stats)(zd__compute_t *c, const zd__shard_t *s, uint32_t b, int first,
                    zd__step_record_t *rec, zd__err_t *err);
  /* torch.nn.utils.clip_grad_norm_'s total norm of the model's fp32 gradients in the order of
   * torch build `order` (not ZD_CLIP_NORM_DOUBLE; kernels/grad_norm.h): each parameter's norm,
   * then the norm of those in parameter order. World size 1 only (every parameter whole in this
   * rank's shard), after every bucket's scatter. Errors: -ENOMEM. NULL: the backend does not
   * compute it (CUDA), and steps clip by the double norm. */
  int (*torch_norm)(zd__compute_t *c, const zd__shard_t *s, zd_clip_norm_t order, float *total,
                    zd__err_t *err);
  /* all[r] = rank r's record. stats: grad_stats ran for every bucket of this step; else the
   * statistics are 0. Waits for the result. */
  int (*gather_records)(zd__compute_t *c, zd__comm_t *comm, const zd__shard_t *s,
                        const zd__step_record_t *mine, int stats, zd__step_record_t *all,
                        zd__err_t *err);
  /* The update of bucket b: consts holds this step's constants of every group (s->ngroups). */
  int (*update)(zd__compute_t *c, const zd__shard_t *s, uint32_t b, const zd__buffers_t *buf,
                const zd__adam_group_t *consts, float grad_scale, zd__err_t *err);
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
 * rank's stream. timeout_ms bounds every wait for the GPU. Call from the rank's worker thread.
 * Errors: ZD_EBACKEND (the message names the device and the CUDA error), -ENOMEM. */
int zd__compute_cuda_create(int device, int timeout_ms, zd__compute_t **out, zd__err_t *err);

/* The rank's stream (a cudaStream_t), on which the NCCL communicator queues its operations. */
void *zd__compute_cuda_stream(zd__compute_t *c);
#endif

static inline void zd__compute_destroy(zd__compute_t *c) {
  if (c) c->ops->destroy(c);
}

#endif /* ZD_DAEMON_COMPUTE_H */
