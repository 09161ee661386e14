/* Logging: one line per event on stderr (journald and kubectl logs pick it up), with time, pid,
 * rank and level:
 *   2026-11-21T10:11:12.123456Z zerod[4242] rank=0 INFO registered model: 12 params, 1 bucket
 * The level is checked before the arguments are evaluated; formats are checked by the compiler.
 * Never log secrets or bulk data.
 */
#ifndef ZD_COMMON_LOG_H
#define ZD_COMMON_LOG_H

enum { ZD__LOG_ERROR = 0, ZD__LOG_WARN = 1, ZD__LOG_INFO = 2, ZD__LOG_DEBUG = 3 };

extern int zd__log_level;

/* Parses "error", "warn", "info", "debug"; -1 if unknown. */
int zd__log_parse_level(const char *name);

/* Sets this thread's rank tag (global rank), or -1 for none ("rank=-"). */
void zd__log_set_rank(int rank);

void zd__log_write(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Logs at error level with file:line and aborts. For broken invariants only. */
void zd__panic(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4), noreturn));

#define ZD_LOG(level, ...)                                           \
  do {                                                               \
    if ((level) <= zd__log_level) zd__log_write(level, __VA_ARGS__); \
  } while (0)
#define ZD_LOG_ERROR(...) ZD_LOG(ZD__LOG_ERROR, __VA_ARGS__)
#define ZD_LOG_WARN(...)  ZD_LOG(ZD__LOG_WARN, __VA_ARGS__)
#define ZD_LOG_INFO(...)  ZD_LOG(ZD__LOG_INFO, __VA_ARGS__)
#define ZD_LOG_DEBUG(...) ZD_LOG(ZD__LOG_DEBUG, __VA_ARGS__)

#define zd_panic(...)     zd__panic(__FILE__, __LINE__, __VA_ARGS__)
#define zd_assert(cond)                                                        \
  do {                                                                         \
    if (!(cond)) zd__panic(__FILE__, __LINE__, "assertion failed: %s", #cond); \
  } while (0)

#endif /* ZD_COMMON_LOG_H */
