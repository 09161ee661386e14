/* What the libFuzzer harnesses of tests/fuzz share: the entry point libFuzzer calls, an assertion
 * that aborts (libFuzzer keeps the input of a crash; check.h's exit(1) would read as a target that
 * quit), and a reader that turns the fuzzer's bytes into structured values.
 *
 * And a copy of the input with an inaccessible page right after it, for parsers that are given a
 * length and must not read past it.
 *
 * The reader never fails: past the end it yields zeros, so every input decodes to something and
 * the fuzzer's mutations stay meaningful.
 */
#ifndef ZD_TESTS_FUZZ_H
#define ZD_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_CHECK(cond, ...)                                                       \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                                 \
      fputc('\n', stderr);                                                          \
      abort();                                                                      \
    }                                                                               \
  } while (0)

typedef struct fuzz_reader {
  const uint8_t *p;
  size_t left;
} fuzz_reader_t;

static inline uint8_t fuzz_u8(fuzz_reader_t *r) {
  if (!r->left) return 0;
  r->left--;
  return *r->p++;
}

/* n little-endian bytes (n <= 8). */
static inline uint64_t fuzz_bytes_le(fuzz_reader_t *r, unsigned n) {
  uint64_t v = 0;
  for (unsigned i = 0; i < n; i++) v |= (uint64_t)fuzz_u8(r) << (8 * i);
  return v;
}

/* Up to n bytes from the input, without copying; *len says how many there were. */
static inline const uint8_t *fuzz_take(fuzz_reader_t *r, size_t n, size_t *len) {
  const uint8_t *p = r->p;
  *len = n < r->left ? n : r->left;
  r->p += *len;
  r->left -= *len;
  return p;
}

/* A copy of data that ends right before an inaccessible page: a read past its end faults even in
 * uninstrumented code (libc's strtoull, which ASan does not intercept). Release with
 * fuzz_guarded_free(copy, size). */
static inline char *fuzz_guarded_copy(const uint8_t *data, size_t size) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE), pages = (size + page - 1) / page + 1;
  char *map = mmap(NULL, pages * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  FUZZ_CHECK(map != MAP_FAILED, "mmap failed");
  FUZZ_CHECK(mprotect(map + (pages - 1) * page, page, PROT_NONE) == 0, "mprotect failed");
  char *copy = map + (pages - 1) * page - size;
  memcpy(copy, data, size);
  return copy;
}

static inline void fuzz_guarded_free(char *copy, size_t size) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE), pages = (size + page - 1) / page + 1;
  char *guard = copy + size;
  munmap(guard - (pages - 1) * page, pages * page);
}

#endif /* ZD_TESTS_FUZZ_H */
