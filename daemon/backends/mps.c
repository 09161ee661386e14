/* MPS detection at start (mps.h): the runtime's per-device attribute, the compute mode and the
 * control daemon's pipe, turned into one state, a log line with advice and status keys. */
#include "mps.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "log.h"
#ifdef ZD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define DEFAULT_PIPE_DIR "/tmp/nvidia-mps"

int zd__mps_pipe_probe(char *dir_out, size_t len) {
  const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
  if (!dir || !dir[0]) dir = DEFAULT_PIPE_DIR;
  snprintf(dir_out, len, "%s", dir);
  char path[512];
  snprintf(path, sizeof path, "%s/control", dir);
  struct stat st;
  if (stat(path, &st) != 0) return errno == ENOENT || errno == ENOTDIR ? 0 : -errno;
  return S_ISFIFO(st.st_mode) ? 1 : -EINVAL;
}

void zd__mps_probe(const zd__backend_t *b, zd__mps_t *out) {
  memset(out, 0, sizeof *out);
  out->state = ZD__MPS_UNKNOWN;
  out->compute_mode = -1;
  out->pipe = zd__mps_pipe_probe(out->pipe_dir, sizeof out->pipe_dir);
#ifdef ZD_HAVE_CUDA
  if (b->kind != ZD__BACKEND_CUDA || !b->ngpus) return;
  uint32_t on = 0, nread = 0;
  for (uint32_t i = 0; i < b->ngpus; i++) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMpsEnabled, b->gpus[i].device) != cudaSuccess) {
      (void)cudaGetLastError(); /* an older driver: the attribute is unknown there */
      continue;
    }
    nread++;
    on += v != 0;
  }
  if (nread == b->ngpus) out->state = on == nread ? ZD__MPS_ON : on ? ZD__MPS_MIXED : ZD__MPS_OFF;
  int mode = 0;
  if (cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, b->gpus[0].device) == cudaSuccess)
    out->compute_mode = mode;
  else
    (void)cudaGetLastError();
#else
  (void)b;
#endif
}

const char *zd__mps_state_name(zd__mps_state_t s) {
  switch (s) {
    case ZD__MPS_OFF:
      return "off";
    case ZD__MPS_ON:
      return "on";
    case ZD__MPS_MIXED:
      return "mixed";
    default:
      return "unknown";
  }
}

const char *zd__mps_compute_mode_name(int mode) {
  switch (mode) {
    case 0:
      return "default";
    case 2:
      return "prohibited";
    case 3:
      return "exclusive_process";
    default:
      return "unknown";
  }
}

static const char *pipe_word(int pipe) {
  return pipe > 0 ? "present" : pipe == 0 ? "absent" : "not a FIFO or unreadable";
}

void zd__mps_log(const zd__mps_t *m) {
  const char *mode = zd__mps_compute_mode_name(m->compute_mode);
  if (m->state == ZD__MPS_ON) {
    ZD_LOG_INFO(
        "MPS: on (control pipe %s/control, compute mode %s): zerod's and the trainers' "
        "kernels can run concurrently if the trainers use the same MPS control daemon "
        "(same CUDA_MPS_PIPE_DIRECTORY)",
        m->pipe_dir, mode);
    return;
  }
  if (m->state == ZD__MPS_UNKNOWN) {
    ZD_LOG_INFO(
        "MPS: unknown (the driver does not report it; control pipe %s/control %s, "
        "compute mode %s)",
        m->pipe_dir, pipe_word(m->pipe), mode);
    return;
  }
  ZD_LOG_WARN(
      "MPS: %s (control pipe %s/control %s, compute mode %s): zerod and the trainers are "
      "separate CUDA contexts, so their kernels time-slice instead of running "
      "concurrently and every hand-over is a context switch%s; start "
      "`nvidia-cuda-mps-control -d` before zerod and the trainers, all with the same "
      "CUDA_MPS_PIPE_DIRECTORY (README, \"Sharing a GPU with the trainers\")",
      zd__mps_state_name(m->state), m->pipe_dir, pipe_word(m->pipe), mode,
      m->compute_mode == 3 ? "; in exclusive-process mode a trainer cannot even create "
                             "a context on zerod's GPU without MPS"
      : m->pipe > 0        ? "; the pipe exists but this process is not an MPS client: the "
                             "daemon is gone, or it serves another user"
                           : "");
}

void zd__mps_status(const zd__mps_t *m, zd__status_t *st) {
  zd__status_add(st, "gpu_mps", "%s", zd__mps_state_name(m->state));
  zd__status_add(st, "gpu_mps_pipe", "%s/control (%s)", m->pipe_dir, pipe_word(m->pipe));
  zd__status_add(st, "gpu_compute_mode", "%s", zd__mps_compute_mode_name(m->compute_mode));
}
