/* Client buffers in host shared memory (shm.h); CUDA IPC buffers are in shm_cuda.c. A host
 * buffer is mapped at the colour its caller names (placement.h), so that zerod's mappings of the
 * grad and param buffers never start at the same address modulo a large power of two as each
 * other or as the state arrays the step streams with them. */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>

#include "placement.h"

int zd__shm_map(int fd, size_t needed, unsigned colour, const char *what, zd__shm_t *out,
                zd__err_t *err) {
  struct stat st;
  *out = (zd__shm_t){0};
  if (fstat(fd, &st) != 0)
    return zd__errf(err, -errno, "%s: fstat failed: %s", what, strerror(errno));
  if (!S_ISREG(st.st_mode))
    return zd__errf(err, ZD_EBUFFER, "%s is not a shared-memory file (expected a memfd)", what);
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK))
    return zd__errf(err, ZD_EBUFFER,
                    "%s is not sealed against shrinking; expected a memfd with F_SEAL_SHRINK",
                    what);
  if ((size_t)st.st_size < needed)
    return zd__errf(err, ZD_EBUFFER, "%s is %lld bytes, layout needs %zu", what,
                    (long long)st.st_size, needed);
  size_t bytes = (size_t)st.st_size;
  void *addr;
  int rc = zd__place_fd(fd, bytes ? bytes : 1, colour, &addr);
  if (rc) return zd__errf(err, rc, "%s: mmap of %zu bytes failed: %s", what, bytes, strerror(-rc));
  out->addr = addr;
  out->bytes = bytes;
  out->kind = ZD__SHM_HOST;
  return ZD_OK;
}

#ifndef ZD_HAVE_CUDA
void zd__shm_close_cuda(zd__shm_t *shm) {
  (void)shm;
}

int zd__shm_open_cuda(int device, const void *handle, size_t len, size_t needed, const char *what,
                      zd__shm_t *out, zd__err_t *err) {
  (void)device, (void)handle, (void)len, (void)needed;
  *out = (zd__shm_t){0};
  return zd__errf(err, ZD_EBACKEND, "%s: this zerod was built without CUDA", what);
}

int zd__shm_open_event(int device, const void *handle, size_t len, const char *what, void **event,
                       zd__err_t *err) {
  (void)device, (void)handle, (void)len;
  *event = NULL;
  return zd__errf(err, ZD_EBACKEND, "%s: this zerod was built without CUDA", what);
}

void zd__shm_close_event(int device, void *event) {
  (void)device, (void)event;
}
#endif

void zd__shm_unmap(zd__shm_t *shm) {
  if (shm->kind == ZD__SHM_CUDA)
    zd__shm_close_cuda(shm);
  else
    zd__place_release(shm->addr, shm->bytes);
  *shm = (zd__shm_t){0};
}
