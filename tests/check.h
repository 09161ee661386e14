/* Assertions for zerod's test programs: on failure they print the expression, both sides with
 * their values and file:line, and exit(1). Each test is a separate process run by `meson test`
 * with a timeout; exit 77 means skipped (e.g. no GPU). */
#ifndef ZD_TESTS_CHECK_H
#define ZD_TESTS_CHECK_H

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ZD_TEST_SKIP 77

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

#define CHECK_MSG(cond, ...)                                                   \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                            \
      fputc('\n', stderr);                                                     \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

#define CHECK_OP_(a, op, b, type, fmt)                                                           \
  do {                                                                                           \
    type a_ = (a), b_ = (b);                                                                     \
    if (!(a_ op b_)) {                                                                           \
      fprintf(stderr, "%s:%d: CHECK(%s %s %s) failed: " fmt " vs " fmt "\n", __FILE__, __LINE__, \
              #a, #op, #b, a_, b_);                                                              \
      exit(1);                                                                                   \
    }                                                                                            \
  } while (0)

#define CHECK_INT_EQ(a, b) CHECK_OP_(a, ==, b, long long, "%lld")
#define CHECK_INT_NE(a, b) CHECK_OP_(a, !=, b, long long, "%lld")
#define CHECK_INT_LT(a, b) CHECK_OP_(a, <, b, long long, "%lld")
#define CHECK_INT_LE(a, b) CHECK_OP_(a, <=, b, long long, "%lld")
#define CHECK_INT_GE(a, b) CHECK_OP_(a, >=, b, long long, "%lld")
#define CHECK_U64_EQ(a, b) CHECK_OP_(a, ==, b, unsigned long long, "%llu")
#define CHECK_DBL_EQ(a, b) CHECK_OP_(a, ==, b, double, "%.17g")

#define CHECK_STR_EQ(a, b)                                                                         \
  do {                                                                                             \
    const char *a_ = (a), *b_ = (b);                                                               \
    if (!a_ || !b_ || strcmp(a_, b_) != 0) {                                                       \
      fprintf(stderr, "%s:%d: CHECK(%s == %s) failed: \"%s\" vs \"%s\"\n", __FILE__, __LINE__, #a, \
              #b, a_ ? a_ : "(null)", b_ ? b_ : "(null)");                                         \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

/* Checks that haystack contains needle (for error messages). */
#define CHECK_CONTAINS(haystack, needle)                                                \
  do {                                                                                  \
    const char *h_ = (haystack), *n_ = (needle);                                        \
    if (!h_ || !strstr(h_, n_)) {                                                       \
      fprintf(stderr, "%s:%d: expected \"%s\" to contain \"%s\"\n", __FILE__, __LINE__, \
              h_ ? h_ : "(null)", n_);                                                  \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

/* Whether the test runs under a sanitizer: scripts/sanitize.sh sets ZEROD_TEST_SANITIZER=1, where
 * everything runs 2-15x slower on a loaded machine. */
static inline int zd_test_sanitized(void) {
  const char *s = getenv("ZEROD_TEST_SANITIZER");
  return s && s[0] && strcmp(s, "0") != 0;
}

/* A wall-clock safety net: fails the test when took exceeds limit (both in the same unit), saying
 * what the bound protects against (printf format and arguments). Never checked under a sanitizer,
 * where it only prints the time. A bound is generous, many times what a loaded two-core machine
 * needs, and below the timeout whose wait it is there to catch. */
#define CHECK_WITHIN(took, limit, ...)                                                        \
  do {                                                                                        \
    double took_ = (took), limit_ = (limit);                                                  \
    if (took_ <= limit_) break;                                                               \
    if (zd_test_sanitized()) {                                                                \
      printf("  (sanitizer: %s:%d: %g over the bound %g, not checked)\n", __FILE__, __LINE__, \
             took_, limit_);                                                                  \
      break;                                                                                  \
    }                                                                                         \
    fprintf(stderr, "%s:%d: %s is %g, over its bound %g: ", __FILE__, __LINE__, #took, took_, \
            limit_);                                                                          \
    fprintf(stderr, __VA_ARGS__);                                                             \
    fputc('\n', stderr);                                                                      \
    exit(1);                                                                                  \
  } while (0)

/* The tests' pseudo-random numbers: splitmix64, one fixed sequence per test program, so that a
 * failure reproduces. */
static inline uint64_t zd_test_rnd(void) {
  static uint64_t state = 0x9e3779b97f4a7c15ull;
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Uniform in [0, n) (0 for n = 0). */
static inline uint64_t rnd_below(uint64_t n) {
  return n ? zd_test_rnd() % n : 0;
}

/* Uniform in [-1, 1). */
static inline float rnd_unit(void) {
  return (float)((double)(zd_test_rnd() >> 40) / (double)(1 << 23) - 1.0);
}

/* A float's or double's bits, and back: results are compared bit for bit. */
static inline uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint64_t d2u(double d) {
  uint64_t u;
  memcpy(&u, &d, sizeof u);
  return u;
}

#endif /* ZD_TESTS_CHECK_H */
