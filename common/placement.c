/* Coloured placement of streamed arrays (placement.h): reserve address space with PROT_NONE,
 * map the array inside it with MAP_FIXED at its colour's offset from a ZD__PLACE_ALIGN boundary,
 * and give the rest of the reservation back, so that what remains is one ordinary mapping. */
#include "placement.h"

#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

static int place(int fd, size_t bytes, unsigned colour, void **out) {
  *out = NULL;
  if (bytes == 0) return -EINVAL;
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size_t off = (colour % ZD__PLACE_COLOURS) * ZD__PLACE_STRIDE;
  if (bytes > SIZE_MAX - 2 * ZD__PLACE_ALIGN - page) return -ENOMEM;
  size_t len = (bytes + page - 1) / page * page;
  /* Room for the worst start of the reservation (one page past a boundary) and the colour. */
  size_t span = len + ZD__PLACE_ALIGN + off;
  char *res = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (res == MAP_FAILED) return -errno;
  uintptr_t aligned = ((uintptr_t)res + ZD__PLACE_ALIGN - 1) & ~(uintptr_t)(ZD__PLACE_ALIGN - 1);
  char *addr = (char *)aligned + off;
  void *p = fd < 0 ? mmap(addr, len, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0)
                   : mmap(addr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    munmap(res, span);
    return -e;
  }
  if (addr > res) munmap(res, (size_t)(addr - res));
  if (res + span > addr + len) munmap(addr + len, (size_t)(res + span - (addr + len)));
  /* Advice only: a kernel without transparent huge pages (or with them off) says EINVAL, and
   * the array works the same in 4 KiB pages. */
  madvise(addr, len, MADV_HUGEPAGE);
  *out = addr;
  return 0;
}

int zd__place_anon(size_t bytes, unsigned colour, void **out) {
  return place(-1, bytes, colour, out);
}

int zd__place_fd(int fd, size_t bytes, unsigned colour, void **out) {
  if (fd < 0) {
    *out = NULL;
    return -EBADF;
  }
  return place(fd, bytes, colour, out);
}

void zd__place_release(void *addr, size_t bytes) {
  if (addr) munmap(addr, bytes ? bytes : 1);
}
