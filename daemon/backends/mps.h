/* Whether zerod's GPU work shares the GPU with the trainers through MPS (NVIDIA's Multi-Process
 * Service), found once at start with the CUDA backend, logged with advice, shown in status.
 *
 * zerod and each trainer are separate processes, hence separate CUDA contexts. Without MPS the
 * GPU time-slices between contexts: a trainer's kernels and zerod's never run at the same time,
 * and every hand-over between them is a context switch. With MPS every client process's work goes
 * through one MPS server, whose single context runs them concurrently.
 *
 * What is read, and how far it can be trusted:
 * - cudaDevAttrMpsEnabled (in CUDA 13's runtime; an older driver may not answer it) of each local
 *   rank's GPU: whether contexts this process creates on it are shared through MPS. It is the
 *   answer for zerod itself; the trainers get MPS only when they reach the same control daemon
 *   (same CUDA_MPS_PIPE_DIRECTORY, same user: MPS serves one user at a time), which zerod cannot
 *   see.
 * - The compute mode (cudaDevAttrComputeMode): EXCLUSIVE_PROCESS lets one process use the GPU,
 *   so zerod and a trainer can share it only through MPS; PROHIBITED lets none.
 * - The control pipe: $CUDA_MPS_PIPE_DIRECTORY/control (default /tmp/nvidia-mps/control), the
 *   FIFO the control daemon (nvidia-cuda-mps-control -d) creates. Its presence says a daemon was
 *   started for that directory; a daemon that crashed leaves it behind, so alone it proves
 *   nothing. It is reported next to the attribute as a hint for a mismatch ("pipe present but
 *   MPS off": zerod sees another directory than the daemon's, or the daemon is gone).
 *
 * Plain data after zd__mps_probe; the loop thread reads it for status.
 */
#ifndef ZD_DAEMON_MPS_H
#define ZD_DAEMON_MPS_H

#include "backend.h"
#include "status.h"

typedef enum zd__mps_state {
  ZD__MPS_UNKNOWN = 0, /* not probed (CPU backend), or the attribute could not be read */
  ZD__MPS_OFF = 1,     /* no local rank's GPU is shared through MPS */
  ZD__MPS_ON = 2,      /* every local rank's GPU is */
  ZD__MPS_MIXED = 3,   /* some are, some are not */
} zd__mps_state_t;

typedef struct zd__mps {
  zd__mps_state_t state;
  int compute_mode; /* the first GPU's cudaComputeMode (0 default, 2 prohibited, 3 exclusive
                     * process); -1 unknown */
  int pipe; /* 1: <pipe_dir>/control is a FIFO; 0: absent; -errno: unreadable or not a FIFO */
  char pipe_dir[256];
} zd__mps_t;

/* The control pipe's directory (CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps) into out, and the
 * state of <dir>/control (mps.pipe's values). Never fails; no CUDA needed. */
int zd__mps_pipe_probe(char *dir_out, size_t len);

/* Fills *out for the backend's GPUs (b->gpus); with the CPU backend only the pipe. Never fails:
 * what cannot be read is "unknown". Calls the CUDA runtime (CUDA builds only). */
void zd__mps_probe(const zd__backend_t *b, zd__mps_t *out);

/* "on", "off", "mixed", "unknown". */
const char *zd__mps_state_name(zd__mps_state_t s);

/* "default", "exclusive_process", "prohibited", "unknown" (also for the retired "exclusive"). */
const char *zd__mps_compute_mode_name(int mode);

/* One log line at start: what was found and what to do about it (INFO with MPS, WARN without). */
void zd__mps_log(const zd__mps_t *m);

/* The keys gpu_mps, gpu_mps_pipe (the control pipe's path, present|absent), gpu_compute_mode,
 * into the current section of st. */
void zd__mps_status(const zd__mps_t *m, zd__status_t *st);

#endif /* ZD_DAEMON_MPS_H */
