/* The daemon's one clock: monotonic time for deadlines, timeouts and durations; wall-clock time
 * only for what is shown to people or written to disk (a checkpoint's creation time). */
#ifndef ZD_COMMON_CLOCK_H
#define ZD_COMMON_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t zd__now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static inline uint64_t zd__now_ms(void) {
  return zd__now_us() / 1000u;
}

/* Milliseconds since the epoch (CLOCK_REALTIME: may jump; never for durations). */
static inline uint64_t zd__unix_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

#endif /* ZD_COMMON_CLOCK_H */
