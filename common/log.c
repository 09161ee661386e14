/* The daemon's log lines (log.h): time, pid, rank and level in front of each message, on stderr.
 *
 * Each line is formatted into one stack buffer and leaves in one write(2), so lines from rank
 * workers, the loop thread and the gRPC thread never interleave; the buffer is PIPE_BUF bytes,
 * the most a pipe (journald, kubectl's container runtime) writes atomically. Longer messages are
 * cut and end in "...". No locks and no stdio, so logging cannot deadlock with a thread that
 * holds a stdio lock, and a panic can log from anywhere.
 */
#include "log.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define LINE_MAX_BYTES PIPE_BUF

int zd__log_level = ZD__LOG_INFO;

static __thread int thread_rank = -1;

static const char *const level_names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
static const char *const level_args[] = {"error", "warn", "info", "debug"};

int zd__log_parse_level(const char *name) {
  if (!name) return -1;
  for (int i = 0; i < 4; i++)
    if (!strcmp(name, level_args[i])) return i;
  return -1;
}

void zd__log_set_rank(int rank) {
  thread_rank = rank < 0 ? -1 : rank;
}

/* prefix is written between the level and the message ("PANIC file:line: "), may be "". */
static void vlog(int level, const char *prefix, const char *fmt, va_list ap) {
  char line[LINE_MAX_BYTES], rank[16];
  struct timespec ts;
  struct tm tm;
  size_t len, cap = sizeof line - 1; /* room for '\n' */
  int saved_errno = errno, n;

  clock_gettime(CLOCK_REALTIME, &ts);
  gmtime_r(&ts.tv_sec, &tm);
  if (thread_rank < 0)
    snprintf(rank, sizeof rank, "-");
  else
    snprintf(rank, sizeof rank, "%d", thread_rank);
  len = strftime(line, cap, "%Y-%m-%dT%H:%M:%S", &tm);
  n = snprintf(line + len, cap - len, ".%06ldZ zerod[%d] rank=%s %s %s", ts.tv_nsec / 1000L,
               (int)getpid(), rank,
               level_names[level < 0   ? 0
                           : level > 3 ? 3
                                       : level],
               prefix);
  len += (size_t)n < cap - len ? (size_t)n : cap - len - 1;

  size_t start = len;
  n = vsnprintf(line + len, cap - len, fmt, ap);
  if (n < 0) n = 0;
  if ((size_t)n >= cap - len) {
    len = cap - 1; /* vsnprintf's terminator */
    memcpy(line + len - 3, "...", 3);
  } else {
    len += (size_t)n;
  }
  /* A message is one event: a stray newline would start a line without time, pid or rank. */
  while (len > start && line[len - 1] == '\n') len--;
  for (size_t i = start; i < len; i++)
    if (line[i] == '\n' || line[i] == '\r') line[i] = ' ';
  line[len++] = '\n';

  for (size_t off = 0; off < len;) {
    ssize_t w = write(STDERR_FILENO, line + off, len - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) break;
    off += (size_t)w;
  }
  errno = saved_errno;
}

void zd__log_write(int level, const char *fmt, ...) {
  va_list ap;
  if (level > zd__log_level) return;
  va_start(ap, fmt);
  vlog(level, "", fmt, ap);
  va_end(ap);
}

void zd__panic(const char *file, int line, const char *fmt, ...) {
  char prefix[256];
  va_list ap;
  snprintf(prefix, sizeof prefix, "PANIC %s:%d: ", file, line);
  va_start(ap, fmt);
  vlog(ZD__LOG_ERROR, prefix, fmt, ap);
  va_end(ap);
  abort();
}
