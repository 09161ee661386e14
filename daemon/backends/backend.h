/* Which compute backend this zerod runs, chosen once at start from the `backend` setting, and
 * what the other layers need to know about it: its name, why CUDA is not used after an `auto`
 * fallback, each local rank's GPU (CUDA), or the CPU kernels' instruction set.
 *
 * `cpu` is the CPU backend; `cuda` needs a build with CUDA and a usable GPU for every local rank
 * (local rank i on CUDA device i / ranks_per_gpu, after CUDA_VISIBLE_DEVICES: one GPU per rank by
 * default, or ranks_per_gpu ranks sharing one) or zerod does not start; `auto` takes CUDA
 * when both hold, else the CPU backend with one log line saying why not (INFO when no GPU is
 * visible at all, WARN when one is but cannot serve). Read-only once chosen: any thread.
 */
#ifndef ZD_DAEMON_BACKEND_H
#define ZD_DAEMON_BACKEND_H

#include <stdint.h>

#include "config.h"
#include "error.h"
#include "gpu.h"

typedef enum zd__backend_kind { ZD__BACKEND_CPU = 0, ZD__BACKEND_CUDA = 1 } zd__backend_kind_t;

/* A GPU as the daemon reports it (status, hello, error messages). Plain data: also in builds
 * without CUDA. */
typedef struct zd__gpu_info {
  int device;                      /* ordinal in this process (after CUDA_VISIBLE_DEVICES) */
  uint8_t uuid[16];                /* cudaDeviceProp.uuid: the same GPU in every process */
  char uuid_str[ZD__GPU_UUID_STR]; /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
  char name[96];
} zd__gpu_info_t;

typedef struct zd__backend {
  zd__backend_kind_t kind;
  /* Why the CUDA backend is not used although the configuration did not refuse it ("CUDA not
   * used: ..."), for messages and status; "" otherwise. */
  char note[ZD__ERR_MSG_MAX];
  uint32_t ngpus;       /* CUDA: local_ranks (entries, not distinct GPUs); 0 with the CPU backend */
  zd__gpu_info_t *gpus; /* CUDA: gpus[i] is local rank i's (ranks sharing a GPU: equal entries) */
  int isa;              /* CPU: the kernels' instruction set (zd__isa_t of kernels/adam.h) */
} zd__backend_t;

/* Chooses per cfg (backend, kernel_isa, local_ranks, ranks_per_gpu) and fills *out
 * (zd__backend_free). Errors with a message: ZD_EBACKEND (backend cuda and no usable GPU for some
 * local rank: why), ZD_ECONFIG (an unknown kernel_isa, or one this CPU does not run). */
int zd__backend_choose(const zd__config_t *cfg, zd__backend_t *out, zd__err_t *err);

/* Frees what zd__backend_choose allocated; accepts a zeroed backend. */
void zd__backend_free(zd__backend_t *b);

/* "cpu" or "cuda". */
const char *zd__backend_name(zd__backend_kind_t kind);

/* The CUDA device (ordinal) of local rank `local` under cfg: local / ranks_per_gpu. */
uint32_t zd__backend_device_of(const zd__config_t *cfg, uint32_t local);

/* The GPU of local rank `local` with the CUDA backend; NULL with the CPU backend. */
const zd__gpu_info_t *zd__backend_gpu(const zd__backend_t *b, uint32_t local);

#endif /* ZD_DAEMON_BACKEND_H */
