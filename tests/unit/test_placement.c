/* Unit test of the placement of streamed arrays (common/placement.c): every colour starts where
 * the header says, arrays of different colours never start at the same address modulo any power
 * of two from ZD__PLACE_ALIGN up (the sizes that used to collide: exact powers of two, back to
 * back), the mapping is exactly the array (no reservation left behind, after success or failure),
 * memory is zeroed and writable, a placed memfd shares its pages with another mapping of the same
 * file, and the errors are the documented ones.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"
#include "placement.h"

/* Bytes of inaccessible (---p) mappings in this process: a reservation placement forgot. */
static unsigned long long prot_none_bytes(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  CHECK(f != NULL);
  unsigned long long total = 0, lo, hi;
  char perms[8], line[512];
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "%llx-%llx %7s", &lo, &hi, perms) == 3 && !strcmp(perms, "---p"))
      total += hi - lo;
  fclose(f);
  return total;
}

/* Whether [p, p + len) is entirely mapped: msync fails with ENOMEM on an unmapped page. */
static int mapped(const void *p, size_t len) {
  return msync((void *)((uintptr_t)p & ~(uintptr_t)4095), len, MS_ASYNC) == 0;
}

static void test_colours(void) {
  size_t sizes[] = {1, 4096, (size_t)1 << 20, ((size_t)1 << 23) + 4 * 123456, (size_t)1 << 25};
  unsigned long long none = prot_none_bytes();
  for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
    void *a[ZD__PLACE_COLOURS + 1];
    for (unsigned c = 0; c <= ZD__PLACE_COLOURS; c++) {
      CHECK_INT_EQ(zd__place_anon(sizes[s], c, &a[c]), 0);
      /* colour ZD__PLACE_COLOURS wraps to colour 0 */
      CHECK_U64_EQ((uintptr_t)a[c] % ZD__PLACE_ALIGN, (c % ZD__PLACE_COLOURS) * ZD__PLACE_STRIDE);
      unsigned char *b = a[c];
      CHECK_INT_EQ(b[0], 0);
      CHECK_INT_EQ(b[sizes[s] - 1], 0);
      b[0] = b[sizes[s] - 1] = 0xab;
      CHECK(mapped(a[c], sizes[s]));
    }
    CHECK_U64_EQ(prot_none_bytes(), none);
    /* Back-to-back arrays of one size: distinct colours never meet modulo 2 MiB .. 2^40. */
    for (unsigned i = 0; i < ZD__PLACE_COLOURS; i++)
      for (unsigned j = i + 1; j < ZD__PLACE_COLOURS; j++)
        for (int k = 21; k <= 40; k++) {
          uintptr_t mask = ((uintptr_t)1 << k) - 1;
          CHECK_MSG(((uintptr_t)a[i] & mask) != ((uintptr_t)a[j] & mask),
                    "colours %u and %u of %zu bytes meet modulo 2^%d", i, j, sizes[s], k);
        }
    for (unsigned c = 0; c <= ZD__PLACE_COLOURS; c++) {
      zd__place_release(a[c], sizes[s]);
      CHECK(!mapped(a[c], sizes[s]));
    }
  }
  zd__place_release(NULL, 100); /* accepted */
}

static void test_fd(void) {
  size_t bytes = ((size_t)3 << 20) + 1000; /* not a multiple of a page */
  int fd = memfd_create("test_placement", MFD_CLOEXEC);
  CHECK(fd >= 0);
  CHECK_INT_EQ(ftruncate(fd, (off_t)bytes), 0);
  unsigned char *plain = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  CHECK(plain != MAP_FAILED);
  plain[0] = 1;
  plain[bytes - 1] = 2;
  unsigned long long none = prot_none_bytes();
  for (unsigned c = 0; c < ZD__PLACE_COLOURS; c++) {
    unsigned char *p;
    CHECK_INT_EQ(zd__place_fd(fd, bytes, c, (void **)&p), 0);
    CHECK_U64_EQ((uintptr_t)p % ZD__PLACE_ALIGN, c * ZD__PLACE_STRIDE);
    CHECK_INT_EQ(p[0], 1);
    CHECK_INT_EQ(p[bytes - 1], 2);
    p[1] = (unsigned char)(10 + c); /* shared: the other mapping sees it */
    CHECK_INT_EQ(plain[1], 10 + c);
    CHECK_U64_EQ(prot_none_bytes(), none);
    zd__place_release(p, bytes);
    CHECK(!mapped(p, bytes));
  }
  munmap(plain, bytes);
  close(fd);
}

static void test_errors(void) {
  unsigned long long none = prot_none_bytes();
  void *p = (void *)1;
  CHECK_INT_EQ(zd__place_anon(0, 0, &p), -EINVAL);
  CHECK(p == NULL);
  p = (void *)1;
  CHECK_INT_EQ(zd__place_fd(-1, 4096, 0, &p), -EBADF);
  CHECK(p == NULL);
  /* A file open read-only cannot be mapped shared and writable; nothing may be left behind. */
  int fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
  CHECK(fd >= 0);
  p = (void *)1;
  CHECK_INT_EQ(zd__place_fd(fd, 4096, 3, &p), -EACCES);
  CHECK(p == NULL);
  close(fd);
  CHECK_INT_EQ(zd__place_anon(SIZE_MAX - 4096, 0, &p), -ENOMEM);
  CHECK(p == NULL);
  CHECK_U64_EQ(prot_none_bytes(), none);
}

int main(void) {
  test_colours();
  test_fd();
  test_errors();
  printf("placement: ok\n");
  return 0;
}
