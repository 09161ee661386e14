/* libzerod: the C client library of zerod.
 *
 * A training process ("client") attaches to one rank of a zerod daemon over its Unix socket,
 * registers its model's parameter list, and receives two flat shared buffers laid out by zerod's
 * layout rule: one for the working parameters (fp32 or bf16) and one for the gradients (fp32,
 * bf16 or fp16). Each step the client writes gradients into the grad buffer and calls zd_step();
 * zerod reduce-scatters them over all ranks, runs AdamW (or Adam) on its fp32 master shard, and
 * all-gathers the updated parameters back into the param buffer. Nothing bulky crosses the socket.
 *
 * The buffers are host shared memory for a zerod running its CPU backend, or device memory on
 * the rank's GPU, shared with zerod through CUDA IPC, for one running its CUDA backend
 * (zd_model_desc_t.memory). The API is the same; with device buffers the library also orders the
 * trainer's CUDA stream and zerod's without any host synchronisation (zd_set_stream()).
 *
 * CUDA: a CUDA build links its own CUDA runtime statically (CUDA 13: it needs a driver of CUDA 13
 * or newer for device buffers) and makes no CUDA call until device buffers are asked for, so it
 * loads and serves host buffers where there is no GPU or driver. Its CUDA objects (buffers,
 * events) live in the primary context of the buffers' GPU, the one CUDA frameworks (PyTorch) use,
 * and every call gives the calling thread back the CUDA context it had (none stays none): calls
 * may come from any thread, one at a time. Streams passed in may come from another CUDA runtime
 * of the process (a framework's); they must belong to that primary context.
 *
 * Threading: a zd_client_t is not thread-safe; use it from one thread at a time. Different
 * clients are independent. All calls block unless they say otherwise.
 *
 * Errors: every fallible function returns ZD_OK (0) or a negative code (zerod/errors.h), and
 * its comment lists them. The detailed message ("grad buffer is 4096 bytes, layout needs 8192") is
 * kept per thread and read with zd_last_error() until the next failing call on that thread. Every
 * function that sends a request to zerod may also return the transport's errors: ZD_ECLOSED
 * (zerod closed the connection or is gone), ZD_EPROTO (a malformed reply), ZD_ESHUTDOWN (zerod is
 * shutting down), -ENOMEM, and a negated errno of the socket (-EPIPE, -ECONNRESET, ...); the
 * lists below say "transport" for them.
 *
 * A growing ABI (docs/abi.md). A structure that may gain fields begins with `size`, the sizeof
 * the caller was compiled with, which its initialiser sets (ZD_MODEL_DESC_INIT, ZD_INFO_INIT,
 * ...); an array of structures travels with its element size (zd_model_desc_t.param_size and
 * .group_size, zd_step_opts_t.group_size), which the initialisers set too. Fields are only ever
 * appended, each at or after the end of the structure before it (behind an explicit padding
 * member where it would fall into the old trailing padding), so that a size says which fields
 * the caller has. libzerod
 *   - reads, from a structure or array element the caller fills, the fields that lie wholly within
 *     its size, and gives every other field its default (zero unless the field's comment says);
 *   - fills, in a structure it returns, the bytes within its size and nothing beyond;
 *   - walks an array by its element size;
 *   - refuses with -EINVAL, before anything else, a size that is not a multiple of 8, is below
 *     the structure's minimum (the end of its last field without a default: its comment says) or
 *     above its own sizeof (a caller built against a newer zerod.h needs a libzerod at least as
 *     new); the message names the structure, the size given and the sizes this library takes.
 * Arrays libzerod returns (zd_group_fields(), zd_constants()) come with their element size: walk
 * them by it and read the fields you know. The first zerod.h whose structures carried sizes
 * was that of libzerod.so.1; binaries built against an earlier one need libzerod.so.0.
 */
#ifndef ZEROD_ZEROD_H
#define ZEROD_ZEROD_H

#include <stddef.h>
#include <stdint.h>

#include "zerod/errors.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ZD_VERSION_MAJOR  0
#define ZD_VERSION_MINOR  1
#define ZD_VERSION_PATCH  0
#define ZD_VERSION_STRING "0.1.0"

/* Highest local protocol version this library speaks (docs/protocol.md). */
#define ZD_PROTOCOL_VERSION 1

#define ZD_MAX_DIMS         8
#define ZD_ALL_BUCKETS      (-1)
#define ZD_ANY_RANK         (-1)

/* Element types. Values match proto/zerod.proto. */
typedef enum zd_dtype { ZD_F32 = 1, ZD_BF16 = 2, ZD_F16 = 3 } zd_dtype_t;

/* Update rule of a parameter group: AdamW (decoupled weight decay, as torch.optim.AdamW), Adam
 * (L2 penalty added to the gradient, as torch.optim.Adam) or SGD (torch.optim.SGD: lr,
 * weight_decay, maximize and the group's momentum, dampening and nesterov) or Adagrad
 * (torch.optim.Adagrad: lr, eps, weight_decay, maximize, lr_decay, initial_accumulator_value) or
 * RMSprop (torch.optim.RMSprop: lr, eps, weight_decay, maximize, momentum, alpha, centered) or
 * Lion (lion_pytorch.Lion of PyPI's lion-pytorch: lr, beta1, beta2, weight_decay).
 * zerod's table of optimizers (kernels/optim.h) lists what each reads and keeps. */
/* X(NAME, value): ZD_<NAME> = value, one row per optimizer (zd_optimizer_t below, libzerod's
 * constants and the daemon's check of a group's optimizer are made from it). */
/* clang-format off */
#define ZD_OPTIMIZERS(X) \
  X(ADAMW, 0) \
  X(ADAM, 1) \
  X(SGD, 2) \
  X(ADAGRAD, 3) \
  X(RMSPROP, 4) \
  X(LION, 5)
/* clang-format on */
typedef enum zd_optimizer {
#define ZD__OPTIMIZER_ENUM(name, value) ZD_##name = value,
  ZD_OPTIMIZERS(ZD__OPTIMIZER_ENUM)
#undef ZD__OPTIMIZER_ENUM
} zd_optimizer_t;

/* Which torch release's formula a group's update follows, bit for bit (kernels/adam.h):
 * ZD_UPDATE_TORCH113, torch 1.13's (first moment m = m * beta1 + (1 - beta1) * g, one fma), the
 * default; ZD_UPDATE_TORCH2, torch 2.x's single-tensor path on CPU (m = m.lerp(g, 1 - beta1)). The
 * two differ in the last bit of about a quarter of the moments. The other three are torch 2.x's
 * formulas for parameters on a CUDA device, which round differently from its CPU path and from
 * each other: ZD_UPDATE_TORCH2_CUDA, the single-tensor path (foreach=False);
 * ZD_UPDATE_TORCH2_CUDA_FOREACH, foreach=True (torch's default on CUDA);
 * ZD_UPDATE_TORCH2_CUDA_FUSED, fused=True. They take the correctly rounded sqrt (a GPU's) whatever
 * the group's sqrt_mode says.
 * A CPU backend computes them with its scalar reference (slower than its vector paths). */
typedef enum zd_update {
  ZD_UPDATE_TORCH113 = 0,
  ZD_UPDATE_TORCH2 = 1,
  ZD_UPDATE_TORCH2_CUDA = 2,
  ZD_UPDATE_TORCH2_CUDA_FOREACH = 3,
  ZD_UPDATE_TORCH2_CUDA_FUSED = 4
} zd_update_t;

/* How the update takes the square root of the second moment: ZD_SQRT_EXACT, correctly rounded
 * (torch without MKL, e.g. Debian's, and torch's fused=True CPU kernel), the default;
 * ZD_SQRT_MKL_EX, the sequence of MKL's SSE4.2 vsSqrt kernel (rsqrtps and two Newton steps, not
 * always correctly rounded) that PyPI's torch wheels run on x86-64 CPUs MKL does not treat as
 * Intel's. rsqrtps is approximate and its bits are the CPU's: ZD_SQRT_MKL_EX reproduces torch only
 * where torch runs on the CPU zerod runs on. Compare on the spot with zd_sqrt(). */
typedef enum zd_sqrt_mode { ZD_SQRT_EXACT = 0, ZD_SQRT_MKL_EX = 1 } zd_sqrt_mode_t;

/* Hyperparameters of one parameter group: an element of zd_model_desc_t.groups and
 * zd_step_opts_t.groups, whose group_size is the caller's sizeof(zd_group_t) (no size of its own).
 * Required: lr to weight_decay (group_size at least 40); the other fields default as
 * zd_group_init() sets them. Doubles, as Python floats are: zerod derives the fp32
 * constants of the update exactly as torch does (kernels/adam.h). lr >= 0, eps > 0,
 * 0 <= beta < 1, weight_decay >= 0, all finite. maximize: 1 maximizes the objective, as
 * torch.optim.AdamW/Adam's maximize=True (the update follows the negated gradient); 0 (the
 * default) minimizes it. amsgrad: 1 is torch's amsgrad=True (the denominator uses the running
 * maximum of the second moment, a fourth state array max_exp_avg_sq). update and sqrt_mode: the
 * formula of the torch being matched (above; the Python package picks them from the running torch).
 * zerod keeps the fields in one table (common/group.h): zd_group_fields() describes them to
 * bindings. */
typedef struct zd_group {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  zd_optimizer_t optimizer;
  int maximize; /* 0 or 1 */
  zd_update_t update;
  zd_sqrt_mode_t sqrt_mode;
  int amsgrad; /* 0 or 1 */
  /* ZD_SGD's (torch.optim.SGD's arguments; default 0, ignored by the other optimizers):
   * momentum >= 0 (0: no momentum buffer), dampening (finite), nesterov 0 or 1 (needs
   * momentum > 0 and dampening 0, as torch). The first double sits at offset 64, past the
   * trailing padding of the structure that ended with amsgrad (docs/abi.md). */
  double momentum;
  double dampening;
  int nesterov;
  /* ZD_ADAGRAD's (torch.optim.Adagrad's; default 0): lr_decay >= 0, initial_accumulator_value
   * >= 0 (its state `sum` starts there). */
  double lr_decay;
  double initial_accumulator_value;
  /* ZD_RMSPROP's (torch.optim.RMSprop's; it reads momentum too): alpha >= 0 (default 0.99),
   * centered 0 or 1 (default 0). */
  double alpha;
  int centered;
} zd_group_t;

/* Sets ngroups groups of group_size bytes each (sizeof(zd_group_t) of the caller's zerod.h) to the
 * defaults, torch.optim.AdamW's: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2,
 * maximize 0; optimizer ZD_ADAMW; update ZD_UPDATE_TORCH113; sqrt_mode ZD_SQRT_EXACT; amsgrad 0;
 * momentum 0, dampening 0, nesterov 0, lr_decay 0, initial_accumulator_value 0, alpha 0.99,
 * centered 0.
 * Writes the fields within group_size and nothing else. Thread-safe.
 * Errors: -EINVAL (groups NULL with ngroups > 0, or a group_size this library does not take). */
ZD_EXPORT int zd_group_init(zd_group_t *groups, size_t ngroups, size_t group_size);

/* y[i] = the square root of x[i] as sqrt_mode computes it in zerod's update, on this CPU, for
 * i < n: for a binding to compare with the sqrt of the framework it runs under (the Python
 * package compares torch.sqrt on a set of probes and picks the mode that matches). zerod computes
 * the same bits on the same CPU; ZD_SQRT_MKL_EX's may differ on another CPU model. x and y may be
 * the same array. Returns ZD_OK, or -EINVAL for an unknown mode or NULL arrays with n > 0.
 * Thread-safe. */
ZD_EXPORT int zd_sqrt(zd_sqrt_mode_t sqrt_mode, const float *x, float *y, size_t n);

/* How a field of zd_group_t is stored: a double, an enum (int-sized), or an int used as a boolean
 * (0 or 1). */
typedef enum zd_field_kind {
  ZD_FIELD_DOUBLE = 0,
  ZD_FIELD_ENUM = 1,
  ZD_FIELD_BOOL = 2
} zd_field_kind_t;

/* One field of zd_group_t, as zd_group_fields() describes it. */
typedef struct zd_group_field {
  const char *name;     /* the C name ("lr"), also the field's name in the wire format */
  zd_field_kind_t kind; /* its type */
  size_t offset;        /* offsetof(zd_group_t, <name>) */
  double default_value; /* its value after zd_group_init() (an enum's or boolean's as a double) */
} zd_group_field_t;

/* The fields of zd_group_t in declaration order, for bindings that build the structure at run
 * time instead of copying this header (the Python package does): *fields (if not NULL) receives a
 * static array of the returned count, valid for the life of the library, whose elements are
 * *field_size bytes apart (if not NULL: sizeof(zd_group_field_t) of this library; walk by it);
 * *group_size (if not NULL) receives this library's sizeof(zd_group_t). Never fails; thread-safe.
 */
ZD_EXPORT size_t zd_group_fields(const zd_group_field_t **fields, size_t *field_size,
                                 size_t *group_size);

/* A named integer constant of this header: an enum value, a flag, a limit, an error code. */
typedef struct zd_constant {
  const char *name; /* as spelled here: "ZD_F32", "ZD_EBUFFER", "ZD_STEP_NO_GATHER" */
  int64_t value;
} zd_constant_t;

/* Every integer constant of zerod.h and zerod/errors.h with its value in this library, for
 * bindings that must not copy them by hand (the Python package defines its ZD_* names from it):
 * *table (if not NULL) receives a static array of the returned count, valid for the life of the
 * library, whose elements are *constant_size bytes apart (if not NULL: sizeof(zd_constant_t) of
 * this library; walk by it). Never fails; thread-safe. */
ZD_EXPORT size_t zd_constants(const zd_constant_t **table, size_t *constant_size);

/* One parameter of the model, in registration order: an element of zd_model_desc_t.params, whose
 * param_size is the caller's sizeof(zd_param_t) (no size of its own). Every field is required.
 * name: unique, at most 255 bytes. */
typedef struct zd_param {
  const char *name;
  uint32_t ndim; /* 0 for a scalar; at most ZD_MAX_DIMS */
  uint64_t shape[ZD_MAX_DIMS];
  uint32_t group; /* index into zd_model_desc_t.groups */
} zd_param_t;

/* Dynamic loss scaling for fp16 gradients (Megatron/DeepSpeed semantics): the client multiplies
 * its loss by the current scale; zerod unscales, skips the step on overflow (inf/nan) and then
 * multiplies the scale by backoff_factor once `hysteresis` overflows have been seen (not below
 * min_scale); after growth_interval clean steps in a row it multiplies it by growth_factor.
 * Pointed to by zd_model_desc_t.loss_scaler. Every field is required (size at least 56);
 * ZD_LOSS_SCALER_INIT gives the values in the comments. */
typedef struct zd_loss_scaler {
  size_t size;              /* sizeof(zd_loss_scaler_t) */
  int enabled;              /* 1; 0 disables loss scaling, as a NULL zd_model_desc_t.loss_scaler */
  double initial_scale;     /* 65536 */
  double growth_factor;     /* 2 */
  double backoff_factor;    /* 0.5 */
  uint32_t growth_interval; /* 1000 */
  uint32_t hysteresis;      /* 2 */
  double min_scale;         /* 1 */
} zd_loss_scaler_t;
#define ZD_LOSS_SCALER_INIT \
  { sizeof(zd_loss_scaler_t), 1, 65536.0, 2.0, 0.5, 1000u, 2u, 1.0 }

/* Where the shared buffers live. ZD_MEMORY_HOST_PINNED is for a model on a GPU trained by a
 * zerod running its CPU backend ("offload"): the buffers are the same host shared memory as
 * ZD_MEMORY_HOST (to zerod they are ordinary host buffers), and libzerod also page-locks them for
 * CUDA (cudaHostRegister, portable: for every GPU of the process; zd_model_desc_t.device names
 * the GPU whose context registers them), so that the trainer's device-to-host copies of gradients
 * and host-to-device copies of parameters run asynchronously at full bandwidth. They are
 * unregistered before they are unmapped (zd_layout() again, zd_close()). */
typedef enum zd_memory {
  ZD_MEMORY_HOST = 0,       /* host shared memory (sealed memfds): for zerod's CPU backend */
  ZD_MEMORY_CUDA = 1,       /* device memory on the rank's GPU, shared through CUDA IPC: for
                               zerod's CUDA backend */
  ZD_MEMORY_HOST_PINNED = 2 /* host shared memory page-locked for CUDA: for zerod's CPU
                               backend and a model on a GPU */
} zd_memory_t;

/* Register flags. ZD_REGISTER_REPLACE: start afresh, discarding any state zerod holds on this rank,
 * for this model or another (at world size > 1: on every rank). */
#define ZD_REGISTER_REPLACE 0x1u
/* ZD_REGISTER_GROW: the model extends the one this rank holds, as torch's add_param_group extends
 * an optimizer (a client closed, and this one lays out the grown model): the held parameter
 * table (names, shapes, groups, in order) is the start of this one. The held parameters keep
 * their state bit for bit (master weights, moments, their own step counts), the new ones start
 * afresh from the param buffer (their own step count 0), and the model's step and loss scaler
 * carry over (zd_info_t.resumed is 1). At world size > 1 every rank grows the model alike at the
 * same step, or every rank's registration fails naming the first difference (ZD_ELAYOUT: a
 * parameter; ZD_EHPARAM: a group field; ZD_ESTEP: the step). CPU backend only (ZD_EBACKEND).
 * Not with ZD_REGISTER_REPLACE (-EINVAL). Where the rank holds no model it registers as a new
 * one; where it holds this very model it resumes it. */
#define ZD_REGISTER_GROW 0x2u

/* How the ranks' gradients are combined before the step. The zero value is the mean, as in
 * PyTorch's DistributedDataParallel and the Python client (grad_mean=True): a zd_model_desc_t
 * from ZD_MODEL_DESC_INIT averages. Sum when each rank's loss is already divided by the world's
 * batch. */
typedef enum zd_grad_reduce {
  ZD_GRAD_MEAN = 0, /* the sum over ranks divided by the world size (the default) */
  ZD_GRAD_SUM = 1   /* the sum over ranks */
} zd_grad_reduce_t;

/* The model zd_layout() lays out. Initialise it with ZD_MODEL_DESC_INIT, which sets size,
 * param_size and group_size. Required: every field up to grad_dtype (size at least 64); those
 * after it default to zero. */
typedef struct zd_model_desc {
  size_t size; /* sizeof(zd_model_desc_t) */
  const zd_param_t *params;
  size_t nparams;
  size_t param_size; /* sizeof(zd_param_t): the stride of params */
  const zd_group_t *groups;
  size_t ngroups;
  size_t group_size;                   /* sizeof(zd_group_t): the stride of groups */
  zd_dtype_t param_dtype;              /* working params: ZD_F32 or ZD_BF16 */
  zd_dtype_t grad_dtype;               /* ZD_F32, ZD_BF16 or ZD_F16 */
  double max_grad_norm;                /* clip by global L2 norm; 0 disables clipping */
  zd_grad_reduce_t grad_reduce;        /* ZD_GRAD_MEAN (0, the default) or ZD_GRAD_SUM */
  unsigned flags;                      /* ZD_REGISTER_* */
  const zd_loss_scaler_t *loss_scaler; /* NULL (the default): no loss scaling */
  zd_memory_t memory;                  /* ZD_MEMORY_HOST (0, the default), ZD_MEMORY_CUDA or
                                          ZD_MEMORY_HOST_PINNED */
  int device; /* ZD_MEMORY_CUDA: this process's CUDA ordinal of the GPU the buffers go on;
                 it must be the GPU of the client's local rank (zd_cuda_device()).
                 ZD_MEMORY_HOST_PINNED: the CUDA ordinal of the model's GPU (any GPU of this
                 process: zerod has none) */
} zd_model_desc_t;
#define ZD_MODEL_DESC_INIT                                                             \
  {                                                                                    \
    sizeof(zd_model_desc_t), NULL, 0, sizeof(zd_param_t), NULL, 0, sizeof(zd_group_t), \
        (zd_dtype_t)0, (zd_dtype_t)0, 0.0, ZD_GRAD_MEAN, 0u, NULL, ZD_MEMORY_HOST, 0   \
  }

typedef struct zd_client zd_client_t;

/* What the daemon told us at connect and register (zd_get_info()). Initialise it with
 * ZD_INFO_INIT (size: any from 8 up; the library fills what lies within it). */
typedef struct zd_info {
  size_t size; /* sizeof(zd_info_t) */
  uint32_t protocol_version;
  uint32_t world_size;
  uint32_t rank;       /* global rank */
  uint32_t local_rank; /* rank index within this zerod */
  uint64_t bucket_elems;
  char backend[16]; /* "cpu" or "cuda" */
  char daemon_version[32];
  /* Valid after zd_register(): */
  uint64_t step; /* steps applied so far to the registered model */
  int resumed;   /* 1 if zerod already held state for this model (reattach) */
  uint64_t layout_hash;
  uint64_t total_elems; /* elements in the flat buffers, padding included */
  uint32_t nbuckets;
  double loss_scale;
} zd_info_t;
#define ZD_INFO_INIT \
  { sizeof(zd_info_t), 0, 0, 0, 0, 0, "", "", 0, 0, 0, 0, 0, 0.0 }

/* Where parameter `index` lives in the flat buffers (zd_param_info()). Initialise it with
 * ZD_PARAM_INFO_INIT (size: any from 8 up). */
typedef struct zd_param_info {
  size_t size;      /* sizeof(zd_param_info_t) */
  const char *name; /* owned by the client; valid until zd_close() */
  uint64_t offset;  /* element offset in the param and grad buffers */
  uint64_t numel;
  uint32_t bucket;
  uint32_t group;
} zd_param_info_t;
#define ZD_PARAM_INFO_INIT \
  { sizeof(zd_param_info_t), NULL, 0, 0, 0, 0 }

/* Flat element range of a bucket and this rank's slice of it (zd_bucket_info()). Initialise it
 * with ZD_BUCKET_INFO_INIT (size: any from 8 up). */
typedef struct zd_bucket_info {
  size_t size;           /* sizeof(zd_bucket_info_t) */
  uint64_t offset;       /* first element of the bucket */
  uint64_t elems;        /* elements, padded to a multiple of 64 * world size */
  uint64_t shard_offset; /* first element of this rank's slice (absolute) */
  uint64_t shard_elems;
} zd_bucket_info_t;
#define ZD_BUCKET_INFO_INIT \
  { sizeof(zd_bucket_info_t), 0, 0, 0, 0 }

/* How a step computes the global norm it clips by (zd_step_opts_t.clip_norm). ZD_CLIP_NORM_DOUBLE,
 * the default: the square root of a double sum of squares, with every backend and world size; its
 * clip coefficient is within a few ULP of torch.nn.utils.clip_grad_norm_'s. The others name a torch
 * build whose fp32 reduction (per-parameter norms, then the norm of those in parameter order) zerod
 * then reproduces bit for bit: Debian's 1.13.1, PyPI's 2.6, PyPI's 2.15. They apply on the CPU
 * backend at any world size with ZD_F32 gradients, no loss scaler and max_grad_norm > 0
 * (zd_step_result_t.grad_norm is then that fp32 total; at world size > 1 the total of the averaged
 * gradient, ZD_GRAD_MEAN's, whose elements are the sum times fp32 1/world_size: DDP's average
 * where the world size is a power of two); anywhere else a step uses the double norm. At world
 * size > 1 every rank must step with the same clip_norm (else ZD_EHPARAM). */
typedef enum zd_clip_norm {
  ZD_CLIP_NORM_DOUBLE = 0,
  ZD_CLIP_NORM_TORCH113 = 1,
  ZD_CLIP_NORM_TORCH26 = 2,
  ZD_CLIP_NORM_TORCH215 = 3
} zd_clip_norm_t;

/* Step options; a NULL zd_step_opts_t means all defaults. Initialise it with ZD_STEP_OPTS_INIT,
 * which sets size and group_size. Required: every field up to group_size (size at least 32);
 * those after it default to zero. */
#define ZD_STEP_NO_SCATTER 0x1u /* gradients already scattered with zd_scatter() */
#define ZD_STEP_NO_GATHER  0x2u /* parameters gathered later with zd_gather() */
typedef struct zd_step_opts {
  size_t size;              /* sizeof(zd_step_opts_t) */
  const zd_group_t *groups; /* per-group hyperparameters for this and later steps (schedulers);
                               NULL keeps the current ones */
  size_t ngroups;           /* must equal the registered number when groups is set */
  size_t group_size;        /* sizeof(zd_group_t): the stride of groups */
  unsigned flags;           /* ZD_STEP_* */
  zd_clip_norm_t clip_norm; /* the norm clipping uses (zd_clip_norm_t); not kept between steps */
  /* Parameters without a gradient this step (torch's `p.grad is None`): (nparams + 7) / 8 bytes,
   * bit i % 8 of byte i / 8 set for parameter i of the registration; NULL (or no bit set): every
   * parameter has one. The client zeroes their gradients before they are scattered. zerod skips a
   * parameter absent on every rank, as torch's optimizers skip a parameter whose .grad is None:
   * its master weights, state and step count stay, its working parameters are left as they are;
   * absent on some ranks only, its gradient is the reduced one (theirs zeros), as DDP's. Each
   * parameter's bias corrections follow its own step count. Except in a CUDA step whose decision
   * is taken on the device (cuda_step fast, with statistics) at world size > 1, which steps every
   * parameter (an absent one with its zero gradient). Only for this step. */
  const uint8_t *absent;
} zd_step_opts_t;
#define ZD_STEP_OPTS_INIT \
  { sizeof(zd_step_opts_t), NULL, 0, sizeof(zd_group_t), 0u, ZD_CLIP_NORM_DOUBLE, NULL }

/* What a step did (zd_step(), zd_wait()). Initialise it with ZD_STEP_RESULT_INIT (size: any from 8
 * up). */
typedef struct zd_step_result {
  size_t size;          /* sizeof(zd_step_result_t) */
  uint64_t step;        /* steps applied after this one */
  int applied;          /* 0 if skipped because of an overflow (loss scaling) */
  double grad_norm;     /* global L2 norm of the (unscaled, reduced) gradient; NaN when not
                           computed (world size 1 with no clipping and no loss scaling) */
  double loss_scale;    /* scale to use for the next step's loss */
  double clip_coef;     /* factor applied to the gradient by clipping (1 if none) */
  uint64_t duration_us; /* time zerod spent on the step */
} zd_step_result_t;
#define ZD_STEP_RESULT_INIT \
  { sizeof(zd_step_result_t), 0, 0, 0.0, 0.0, 0.0, 0 }

/* A request sent with one of the *_start functions, completed by zd_wait(). */
typedef uint64_t zd_request_t;

/* Connects to zerod and attaches to a local rank.
 * socket_path: NULL for the default ($ZEROD_SOCKET, else $XDG_RUNTIME_DIR/zerod.sock, else
 *   /run/zerod/zerod.sock). local_rank: index of the rank within that zerod, or ZD_ANY_RANK for
 *   the first one no other client holds.
 * On success *out is a new client; close it with zd_close(). Blocks for at most timeout_ms
 * milliseconds waiting for the daemon's hello (0: 30 s). The rank is reserved for this client
 * from its hello until zd_close() or a disconnect, so that trainers started together with
 * ZD_ANY_RANK each get their own; zd_register() attaches to it. A rank named explicitly is held
 * weakly: ZD_ANY_RANK clients skip it, but another client that names it too may register on it
 * first. A rank named explicitly that another client holds is not refused here (that client may
 * leave first): zd_register() returns ZD_EBUSY if it is still attached, or reserved by a
 * ZD_ANY_RANK hello. Errors: -EINVAL (out is NULL), -ENOENT/-ECONNREFUSED (no daemon),
 * -ENAMETOOLONG (socket path), -ETIMEDOUT (no hello within timeout_ms), ZD_EVERSION, ZD_EBUSY
 * (ZD_ANY_RANK and every rank held; or zerod stayed at max_clients or max_clients_per_uid for
 * the whole timeout: a connection zerod refuses for want of a free one is tried again, with
 * pauses from 5 ms doubling up to 200 ms, until timeout_ms (0: 30 s) has passed, and the message
 * then says how long it waited), ZD_ERANK (no such rank, or negative other than ZD_ANY_RANK),
 * ZD_EDENIED, transport. */
ZD_EXPORT int zd_connect(const char *socket_path, int local_rank, int timeout_ms,
                         zd_client_t **out);

/* Registers the model, in two calls so that the caller can place its initial values:
 *   zd_layout(c, desc)  computes the layout and creates zeroed buffers (zd_param_buffer()): host
 *                       shared memory, or with desc->memory ZD_MEMORY_CUDA device memory
 *                       (cudaMalloc on desc->device, never a stream-ordered pool, which CUDA IPC
 *                       cannot export; sizes rounded up to 2 MiB so that no other allocation
 *                       shares their IPC-exported block) and 64 pairs of IPC events
 *                       (zd_set_stream()); the zeroing is complete when it returns, so the
 *                       initial values may be written on any stream;
 *   zd_register(c)      sends them to zerod, which takes the buffer's contents as the initial
 *                       weights of a new model, or overwrites them with its master weights when it
 *                       already holds this model (reattach: same layout hash; info.resumed = 1).
 * At world size > 1 zd_register() of a new model (or with ZD_REGISTER_REPLACE) is collective: it
 * returns when every rank has registered the same layout, and the param buffer then holds the
 * full model. A reattach there is not: a restarted trainer resumes alone, at the step its rank
 * holds (info.step), with the full model its rank's last client left (host buffers; with device
 * buffers every rank registers again, collectively).
 * With device buffers, initial values written by kernels or copies on the client's stream
 * (zd_set_stream()) before zd_register() are seen by zerod; the param buffer's contents after
 * zd_register() are ordered before the stream's later work. A register that fails makes no
 * stream wait: zerod's work on the buffers is over when it closed their handles, and when it
 * keeps them (zd_close()) that work may never end.
 * Errors of zd_layout() (nothing is sent to zerod): -EINVAL (NULL client or desc; a size,
 * param_size, group_size or loss_scaler->size this library does not take; a bad parameter,
 * grad_reduce, memory or device ordinal), ZD_EORDER (after zd_register()), ZD_EDTYPE, ZD_EGROUP (no
 * groups, or a parameter's group out of range), ZD_EBUFFER (device buffers on another GPU than the
 * rank's), ZD_EBACKEND (device buffers and a zerod running its CPU backend, host buffers (pinned or
 * not) and one running its CUDA backend, device or pinned buffers and a libzerod built without
 * CUDA, CUDA unusable in this process or no GPU in it, or a CUDA call that failed, such as
 * cudaHostRegister: the message says why), -ENOMEM, and memfd or mmap's negated errno.
 * Errors of zd_register(): -EINVAL (NULL client), ZD_EORDER (no zd_layout(), or registered
 * already), ZD_EHPARAM (a group or the loss scaler; zerod checks them), ZD_EDTYPE, ZD_ELAYOUT
 * (zerod holds a different model on this rank; pass ZD_REGISTER_REPLACE to discard it, or ranks
 * disagree), ZD_EBUFFER, ZD_EBUSY (the rank is another client's), ZD_EBACKEND,
 * ZD_EPEER/ZD_EDEGRADED/-ETIMEDOUT (at world size > 1, a rank failed to register with it),
 * transport. */
ZD_EXPORT int zd_layout(zd_client_t *client, const zd_model_desc_t *desc);
ZD_EXPORT int zd_register(zd_client_t *client);

/* Registers the same model again, with the same buffers, on a new connection to the same socket
 * and local rank: for a trainer whose zerod was restarted (its connection then fails with
 * ZD_ECLOSED) or whose world re-formed around a peer zerod's restart (its requests then fail with
 * ZD_EPEER, "register again"), with the zerods' state in a state_dir. It replaces the old
 * connection (its outstanding requests are void) and tries again, backing off, until zerod takes
 * the model and every rank has registered it, or timeout_ms (<= 0: 120 s) has passed. On success
 * info.step is the step every rank holds and the param buffer holds the parameters of that step;
 * a step the trainer had in flight was applied when info.step counts it, and must be sent again
 * (every bucket scattered again; the grad buffer is as the trainer left it) when it does not.
 * Host buffers only. Errors: -EINVAL (NULL client), ZD_EORDER (not registered), ZD_EBACKEND
 * (device buffers), ZD_ELAYOUT (zerod now serves another rank, or another model), ZD_EDEGRADED
 * (the rank's world cannot heal: no state_dir and no checkpoints), a register's other errors
 * that a later try cannot change (ZD_EHPARAM, ZD_EDTYPE, ...), and -ETIMEDOUT,
 * whose message names the socket, the rank and the last error it waited on. */
ZD_EXPORT int zd_rejoin(zd_client_t *client, int timeout_ms);

/* The shared buffers (valid after zd_layout() until zd_close()); bytes receives their size (the
 * layout's bytes). The caller writes gradients into the grad buffer before zd_scatter()/zd_step()
 * and reads parameters from the param buffer after zd_gather()/zd_step(). Padding elements
 * between parameters must stay zero. Each buffer starts on a 256-byte boundary (host: a page) and
 * every parameter at a multiple of 64 elements (zd_param_info()), so views of parameters are
 * aligned for vector loads. With ZD_MEMORY_CUDA these are device pointers on the buffers' GPU
 * (desc->device; the allocation itself is rounded up to 2 MiB): write and read them with kernels
 * or copies on the stream given to zd_set_stream() (or, without one, the legacy default stream of
 * that GPU). A framework may wrap them without a copy (__cuda_array_interface__ with this
 * pointer, the element count info.total_elems and the dtype; its "stream" entry, if any, should
 * name the stream given to zd_set_stream(), on which the contents are ordered). Such views must
 * not outlive zd_close(). No errors: NULL (and *bytes 0) for a NULL client or before zd_layout().
 */
ZD_EXPORT void *zd_param_buffer(zd_client_t *client, size_t *bytes);
ZD_EXPORT void *zd_grad_buffer(zd_client_t *client, size_t *bytes);

/* Layout queries (valid after zd_layout()); out's size says what is filled (ZD_*_INIT). Errors:
 * -EINVAL (NULL client; before zd_layout() for zd_param_info() and zd_bucket_info(); an index out
 * of range; an out->size this library does not take). Nothing is sent to zerod. */
ZD_EXPORT int zd_param_info(const zd_client_t *client, size_t index, zd_param_info_t *out);
ZD_EXPORT int zd_bucket_info(const zd_client_t *client, size_t index, zd_bucket_info_t *out);
ZD_EXPORT int zd_get_info(const zd_client_t *client, zd_info_t *out);

/* Device buffers only: the CUDA stream (a cudaStream_t of the buffers' GPU) on which the trainer
 * writes gradients and reads parameters; NULL (the default) is the legacy default stream of the
 * buffers' GPU. zd_layout() resets it to NULL. It may change between any two calls; each call
 * uses the stream current at that call.
 *
 * The library shares a ring of 64 pairs of IPC events with zerod, one pair per request that may
 * be outstanding. Each register, scatter, step or gather request takes a free pair ("slot") and:
 *   - when it is sent, records the slot's "grads ready" on the current stream; zerod's stream
 *     waits on exactly that record before the request's work. So zerod sees the work queued on
 *     the current stream before the request, and does not wait for anything queued after it
 *     (whichever stream later requests use): per-bucket scatters sent from backward overlap the
 *     backward of the buckets that follow. Work on other streams is not covered: order it before
 *     the request on the current stream yourself (an event between your streams). zerod runs a
 *     client's requests in the order they were sent, on one stream of its own, so a request's
 *     work also comes after every earlier request's work, and after what those requests covered;
 *   - when its reply is processed (zd_wait(); zd_step(), zd_scatter(), zd_gather() and a
 *     successful zd_register() do it themselves), makes the current stream wait on the slot's
 *     "params ready", which zerod recorded after the request's work: work queued on that stream
 *     afterwards sees the results of that request and, zerod's stream being in order, of every
 *     earlier one. Other streams are not ordered: wait with the stream that reads the results
 *     current (zd_set_stream() before zd_wait()), or order your streams yourself. The slot is
 *     then free for another request.
 * Nothing is synchronised on the host. Since zerod's wait for a request covers only that
 * request's own record, work queued before a request may wait for the host (a host callback, a
 * stream wait on an event the host records) until the host has the reply of an earlier request:
 * zerod runs that earlier request without waiting for it. It must not wait for the reply of the
 * request itself or of a later one (zerod runs them in order): that is a deadlock, which zerod
 * breaks only at its collective timeout by failing the request and degrading the rank.
 * Requests cannot be sent while the stream is being captured into a CUDA graph (-EINVAL from
 * the request). Errors: -EINVAL (no client; the stream is on another GPU than the buffers),
 * ZD_EORDER (no device buffers: call zd_layout() with ZD_MEMORY_CUDA first), ZD_EBACKEND (CUDA
 * failed: the message names the call). Nothing is sent to zerod. */
ZD_EXPORT int zd_set_stream(zd_client_t *client, void *cuda_stream);

/* The CUDA ordinal, in this process, of the GPU of the client's local rank (zerod's CUDA backend
 * names it by UUID in its hello; ordinals differ between processes when CUDA_VISIBLE_DEVICES
 * does). Valid after zd_connect(). Errors: -EINVAL (NULL client or device), ZD_EBACKEND (zerod
 * runs its CPU backend, libzerod was built without CUDA, or CUDA is unusable here), -ENODEV (this
 * process does not see that GPU; the message gives its UUID). Nothing is sent to zerod. */
ZD_EXPORT int zd_cuda_device(const zd_client_t *client, int *device);

/* One optimizer step: scatter + step + gather unless opts->flags says otherwise. opts and result
 * may be NULL. At world size > 1 every rank must call it; the call returns when this rank's part is
 * done. Errors: -EINVAL (NULL client; an opts->size, opts->group_size or result->size this library
 * does not take: refused before anything is sent), ZD_EORDER (not registered, or a bucket not
 * scattered with NO_SCATTER), ZD_EGROUP (opts->ngroups is not the model's), ZD_EHPARAM, ZD_ESTEP
 * (ranks out of step), ZD_EPEER/ZD_EDEGRADED/-ETIMEDOUT/-ECANCELED (a peer failed, or zerod is
 * shutting down: the step was not applied), ZD_EAPPLIED (the step was applied to the master
 * weights, but the updated parameters could not be gathered into the param buffer; the rank is
 * degraded), ZD_EABORTED (another rank's trainer left in the middle of this step: no rank applied
 * it, every rank's scatters of it are void; scatter again and retry, with the same gradients, once
 * that rank's trainer is back), -EBUSY (64 requests outstanding), ZD_EBACKEND (device buffers:
 * CUDA failed), transport. */
ZD_EXPORT int zd_step(zd_client_t *client, const zd_step_opts_t *opts, zd_step_result_t *result);

/* Reduce-scatter of one bucket (or ZD_ALL_BUCKETS) of the grad buffer into this rank's shard.
 * At world size > 1 every rank scatters the same buckets. zerod may read the bucket's gradients
 * at any time from the scatter until the step (at world size > 1 during the scatter; with
 * overlap_update also at world size 1): a gradient changed after its bucket was scattered must be
 * scattered again. Errors: -EINVAL (NULL client; a bucket
 * that does not exist), ZD_EORDER (not registered), ZD_EPEER/ZD_EDEGRADED/-ETIMEDOUT/-ECANCELED
 * (a peer failed, or zerod is shutting down), ZD_EABORTED (another rank's trainer left in the
 * middle of the step: scatter again), -EBUSY (64 requests outstanding), ZD_EBACKEND (device
 * buffers: CUDA failed), transport. */
ZD_EXPORT int zd_scatter(zd_client_t *client, int bucket);

/* The hyperparameters the next step will apply, as the trainer has them before its backward
 * (where schedulers have set them): the library sends them with the next zd_scatter() or
 * zd_scatter_start() to a zerod that runs overlap_update (its hello says so; to others nothing is
 * sent), whose speculative updates of that step then use them instead of the last step's, so that
 * a per-step schedule does not make every bucket be updated twice. The step still applies the
 * groups its own opts give (or keeps the model's): where they differ from these, zerod updates
 * the buckets again, the same bits either way. Sent once: call it again for a later step (say,
 * before each backward, or only when they changed since the last step's). groups NULL or ngroups
 * 0 drops groups not sent yet. The groups are copied. Errors: -EINVAL (NULL client; a group_size
 * this library does not take), ZD_EORDER (not registered), ZD_EGROUP (ngroups is not the
 * model's), ZD_EHPARAM (a group zd_step() would refuse). Nothing is sent here. */
ZD_EXPORT int zd_set_next_groups(zd_client_t *client, const zd_group_t *groups, size_t ngroups,
                                 size_t group_size);

/* All-gather of one bucket (or ZD_ALL_BUCKETS) of updated parameters into the param buffer.
 * Errors: -EINVAL (NULL client; a bucket that does not exist), ZD_EORDER (not registered),
 * ZD_EPEER/ZD_EDEGRADED/-ETIMEDOUT/-ECANCELED (a peer failed, or zerod is shutting down), -EBUSY
 * (64 requests outstanding), ZD_EBACKEND (device buffers: CUDA failed), transport. */
ZD_EXPORT int zd_gather(zd_client_t *client, int bucket);

/* A checkpoint of this rank's optimizer state as of the last step (master weights, both moments,
 * loss scaler; docs/design.md, "Checkpoints"), written by zerod to a new directory under its
 * checkpoint_dir. At world size > 1 every trainer of the world calls it between the same two
 * steps (a collective, like torch.distributed.checkpoint). With ZD_CHECKPOINT_NO_WAIT it returns
 * once the state is snapshotted and zerod writes in the background; otherwise once this rank's
 * file is written and, on rank 0, the checkpoint complete. step (may be NULL) receives the step,
 * dir (may be NULL, len bytes) its directory. Errors: -EINVAL (NULL client), ZD_ECONFIG (zerod has
 * no checkpoint_dir), ZD_EORDER (not registered), ZD_ESTEP (ranks at different steps),
 * ZD_ECHECKPOINT (writing failed: the message names the file and the cause; training is
 * unharmed), ZD_EPEER/-ECANCELED (the world broke, or zerod is shutting down), -EBUSY (64 requests
 * outstanding), transport. */
#define ZD_CHECKPOINT_NO_WAIT 0x1u
ZD_EXPORT int zd_checkpoint(zd_client_t *client, uint32_t flags, uint64_t *step, char *dir,
                            size_t len);

/* Pipelined forms: send the request and return at once with a handle for zd_wait(). Requests
 * run in the order they were sent. At most 64 may be outstanding per client (-EBUSY beyond: a
 * request is outstanding until zd_wait() returned it); with device buffers each holds one of the
 * 64 event pairs until then (zd_set_stream()). Errors: those of zd_scatter(), zd_gather() and
 * zd_step() that are found before the request is sent (-EINVAL, ZD_EORDER, ZD_EGROUP, -EBUSY,
 * ZD_EBACKEND, transport); the others come from zd_wait(). */
ZD_EXPORT int zd_scatter_start(zd_client_t *client, int bucket, zd_request_t *req);
ZD_EXPORT int zd_gather_start(zd_client_t *client, int bucket, zd_request_t *req);
ZD_EXPORT int zd_step_start(zd_client_t *client, const zd_step_opts_t *opts, zd_request_t *req);

/* Waits for a request sent with a *_start function; result is filled for a step request and may
 * be NULL. Returns the request's own status (the errors of zd_scatter(), zd_gather() or zd_step()),
 * or -EINVAL (NULL client; a request that is not outstanding; a result->size this library does
 * not take, refused before waiting: the request stays outstanding), or transport. Each request is
 * waited for once. With device buffers
 * it then makes the current stream (zd_set_stream()) wait on the request's "params ready" event,
 * also after a failed request (zerod records it after whatever work of the request ran; a request
 * refused before any work leaves the event at its previous record, already waited for), and
 * frees the request's event pair. After ZD_EDEGRADED, ZD_EPEER or -ETIMEDOUT that wait may not
 * end if zerod's stream is stuck. */
ZD_EXPORT int zd_wait(zd_client_t *client, zd_request_t req, zd_step_result_t *result);

/* The daemon's status as text: "# Section" lines followed by "key:value" lines (units in the key
 * names). *text is allocated; release it with zd_free() (or free() from C linked with the same C
 * library); it is NULL after an error. Errors: -EINVAL (NULL client or text), -EBUSY (64 requests
 * outstanding), transport. */
ZD_EXPORT int zd_status(zd_client_t *client, char **text);

/* Releases memory libzerod allocated for the caller (zd_status's text). Accepts NULL. For
 * bindings (ctypes, FFI) whose own free() may not be the allocator libzerod used. No errors. */
ZD_EXPORT void zd_free(void *ptr);

/* Says bye and closes the connection; zerod keeps the rank's state for a later client. Requests
 * still outstanding are answered first (without any stream wait). Unmaps host buffers. Device
 * buffers and their events are freed only when zerod said it holds none of their IPC handles:
 * its answer to the bye says whether it closed every handle of the connection (it does, unless
 * its stream may still have work on them: a rank whose work could not drain after a failure),
 * and its refusal of a register says whether it closed that register's handles. Otherwise they
 * are left allocated until the process exits (CUDA leaves freeing them under an importer
 * undefined): when zerod said it keeps them, or did not answer (connection lost, zerod shutting
 * down, a register never answered). Work on the trainer's streams that still uses device buffers
 * must be complete. Accepts NULL. No errors: a connection already lost is closed all the same, and
 * the caller's last error is kept. */
ZD_EXPORT void zd_close(zd_client_t *client);

/* Message of the last failing call on this thread ("" if none). Valid until the next call. No
 * errors. */
ZD_EXPORT const char *zd_last_error(void);

/* Version of the library loaded, "0.1.0" (ZD_VERSION_STRING of its build). No errors. */
ZD_EXPORT const char *zd_version(void);

/* Bytes per element of a dtype; 0 for an unknown value. Name: "f32", "bf16", "f16", "?". No
 * errors. */
ZD_EXPORT size_t zd_dtype_size(zd_dtype_t dtype);
ZD_EXPORT const char *zd_dtype_name(zd_dtype_t dtype);

#ifdef __cplusplus
}
#endif
#endif /* ZEROD_ZEROD_H */
