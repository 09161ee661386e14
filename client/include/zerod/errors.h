/* zerod error space.
 *
 * One list of error codes shared by the daemon, the client library and the wire protocol (an error
 * reply carries one of these codes). ZD_OK is 0; zerod's own codes are negative numbers below
 * -4000; system errors are negated errno values (-ENOENT, -ETIMEDOUT, ...). zd_strerror() names
 * either kind. The detailed message that goes with an error (which buffer, which value, what was
 * expected) travels separately: see zd_last_error() in zerod.h and the Error reply in
 * proto/zerod.proto.
 */
#ifndef ZEROD_ERRORS_H
#define ZEROD_ERRORS_H

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define ZD_EXPORT __attribute__((visibility("default")))
#else
#define ZD_EXPORT
#endif

/* XX(name, value, description). Values are part of the wire protocol: never renumber. */
#define ZD_ERROR_MAP(XX)                                                    \
  XX(EPROTO, -4001, "malformed frame or message")                           \
  XX(EVERSION, -4002, "protocol version not supported")                     \
  XX(ETOOBIG, -4003, "frame larger than the limit")                         \
  XX(ETYPE, -4004, "unknown message type")                                  \
  XX(EORDER, -4005, "request not valid in this session state")              \
  XX(EBUFFER, -4006, "buffer does not match the layout")                    \
  XX(EDTYPE, -4007, "unsupported dtype")                                    \
  XX(EGROUP, -4008, "unknown parameter group")                              \
  XX(EHPARAM, -4009, "invalid hyperparameter")                              \
  XX(ELAYOUT, -4010, "layout mismatch")                                     \
  XX(ERANK, -4011, "no such rank")                                          \
  XX(EBUSY, -4012, "rank already attached to another client")               \
  XX(ESTEP, -4013, "ranks disagree on the step")                            \
  XX(EPEER, -4014, "peer failed")                                           \
  XX(EDEGRADED, -4015, "rank degraded")                                     \
  XX(ESHUTDOWN, -4016, "daemon shutting down")                              \
  XX(EDENIED, -4017, "peer credentials not allowed")                        \
  XX(EBACKEND, -4018, "backend unavailable")                                \
  XX(ECLOSED, -4019, "connection closed")                                   \
  XX(EINTERNAL, -4020, "internal error")                                    \
  XX(ECONFIG, -4021, "invalid configuration")                               \
  XX(EAPPLIED, -4022, "step applied, but its parameters were not gathered") \
  XX(EABORTED, -4023, "step abandoned: a rank's trainer left; retry it")    \
  XX(ECHECKPOINT, -4024, "checkpoint failed or not loadable")

typedef enum zd_error {
  ZD_OK = 0,
#define ZD_ERROR_ENUM(name, value, text) ZD_##name = (value),
  ZD_ERROR_MAP(ZD_ERROR_ENUM)
#undef ZD_ERROR_ENUM
} zd_error_t;

/* Short description of an error code: zerod's own codes and negated errno values. Never NULL;
 * the string is static. Thread-safe. No errors. */
ZD_EXPORT const char *zd_strerror(int code);

/* Symbolic name of an error code ("ZD_EBUFFER", "ETIMEDOUT"); "ZD_UNKNOWN" for others. Never
 * NULL; the string is static. Thread-safe. No errors. */
ZD_EXPORT const char *zd_err_name(int code);

#ifdef __cplusplus
}
#endif
#endif /* ZEROD_ERRORS_H */
