/* The choice of the compute backend (backend.h). */
#include "backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adam.h"
#include "log.h"
#ifdef ZD_HAVE_CUDA
#include "adam_cuda.h"
#include "cuda_check.h"
#endif

static int choose_isa(const zd__config_t *cfg, int *isa, zd__err_t *err) {
  int want = zd__isa_parse(cfg->kernel_isa);
  zd__isa_t best = zd__isa_detect();
  if (want < 0)
    return zd__errf(err, ZD_ECONFIG,
                    "kernel_isa '%s' unknown; expected auto, avx512bf16, avx512, "
                    "avx2 or scalar",
                    cfg->kernel_isa);
  if (want > (int)best)
    return zd__errf(err, ZD_ECONFIG,
                    "kernel_isa %s is not supported by this CPU; the best it "
                    "runs is %s",
                    cfg->kernel_isa, zd__isa_name(best));
  *isa = want;
  return ZD_OK;
}

const char *zd__backend_name(zd__backend_kind_t kind) {
  return kind == ZD__BACKEND_CUDA ? "cuda" : "cpu";
}

#ifdef ZD_HAVE_CUDA
/* What the daemon tells about a GPU: ordinal, UUID (as nvidia-smi prints it), name. Errors:
 * ZD_EBACKEND. */
static int gpu_info(int device, zd__gpu_info_t *out, zd__err_t *err) {
  struct cudaDeviceProp prop;
  memset(out, 0, sizeof *out);
  ZD_CUDA_TRY(err, cudaGetDeviceProperties(&prop, device), "GPU %d: cudaGetDeviceProperties",
              device);
  out->device = device;
  memcpy(out->uuid, prop.uuid.bytes, sizeof out->uuid);
  zd__gpu_uuid_str(out->uuid, out->uuid_str, sizeof out->uuid_str);
  snprintf(out->name, sizeof out->name, "%.95s", prop.name);
  return ZD_OK;
}
#endif

/* Whether the CUDA backend can serve every local rank (local rank i on GPU i / ranks_per_gpu);
 * if not, why, and whether some GPU is visible at all (which makes a fallback worth a warning
 * rather than a note). Fills b->gpus, one entry per local rank, when it can. */
static int cuda_usable(const zd__config_t *cfg, zd__backend_t *b, char *why, size_t len,
                       int *visible) {
  *visible = 0;
#ifdef ZD_HAVE_CUDA
  uint32_t n = cfg->local_ranks, per = cfg->ranks_per_gpu ? cfg->ranks_per_gpu : 1;
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) *visible = 1;
  (void)cudaGetLastError();
  if (zd__cuda_available(why, len) == 0) return 0;
  zd__err_t e = {0};
  for (uint32_t i = 0; i < n; i += per) { /* each GPU once: its first local rank */
    if (zd__cuda_device_check((int)zd__backend_device_of(cfg, i), &e) != ZD_OK) {
      snprintf(why, len,
               "local rank %u needs GPU %u (local_ranks %u, ranks_per_gpu %u: local rank i on "
               "GPU i / ranks_per_gpu): %.100s",
               i, zd__backend_device_of(cfg, i), n, per, e.msg);
      return 0;
    }
  }
  b->gpus = calloc(n, sizeof *b->gpus);
  if (!b->gpus) {
    snprintf(why, len, "out of memory");
    return 0;
  }
  for (uint32_t i = 0; i < n; i++) {
    uint32_t dev = zd__backend_device_of(cfg, i);
    if (i % per) { /* a GPU already described: the same entry */
      b->gpus[i] = b->gpus[i - 1];
      continue;
    }
    if (gpu_info((int)dev, &b->gpus[i], &e) != ZD_OK) {
      snprintf(why, len, "GPU %u: %.200s", dev, e.msg);
      free(b->gpus);
      b->gpus = NULL;
      return 0;
    }
  }
  b->ngpus = n;
  return 1;
#else
  (void)cfg, (void)b;
  snprintf(why, len, "this zerod was built without CUDA");
  return 0;
#endif
}

/* The backend alone, without the ISA. */
static int choose_kind(const zd__config_t *cfg, zd__backend_t *b, zd__err_t *err) {
  if (!strcmp(cfg->backend, "cpu")) return ZD_OK;
  char why[ZD__ERR_MSG_MAX / 2];
  int visible = 0;
  if (cuda_usable(cfg, b, why, sizeof why, &visible)) {
    b->kind = ZD__BACKEND_CUDA;
    for (uint32_t i = 0; i < b->ngpus; i++)
      ZD_LOG_INFO("local rank %u: GPU %d, %s (%s)", i, b->gpus[i].device, b->gpus[i].name,
                  b->gpus[i].uuid_str);
    return ZD_OK;
  }
  if (!strcmp(cfg->backend, "cuda"))
    return zd__errf(err, ZD_EBACKEND, "backend cuda requested, but %s; use backend cpu or auto",
                    why);
  snprintf(b->note, sizeof b->note, "CUDA not used: %s", why);
  if (visible)
    ZD_LOG_WARN("backend auto: %s; running the CPU backend", b->note);
  else
    ZD_LOG_INFO("backend auto: %s; running the CPU backend", b->note);
  return ZD_OK;
}

int zd__backend_choose(const zd__config_t *cfg, zd__backend_t *b, zd__err_t *err) {
  *b = (zd__backend_t){.kind = ZD__BACKEND_CPU};
  int rc = choose_kind(cfg, b, err);
  if (!rc) rc = choose_isa(cfg, &b->isa, err);
  if (rc) zd__backend_free(b);
  return rc;
}

void zd__backend_free(zd__backend_t *b) {
  free(b->gpus);
  b->gpus = NULL;
  b->ngpus = 0;
}

uint32_t zd__backend_device_of(const zd__config_t *cfg, uint32_t local) {
  return local / (cfg->ranks_per_gpu ? cfg->ranks_per_gpu : 1);
}

const zd__gpu_info_t *zd__backend_gpu(const zd__backend_t *b, uint32_t local) {
  if (b->kind != ZD__BACKEND_CUDA) return NULL;
  zd_assert(local < b->ngpus);
  return &b->gpus[local];
}
