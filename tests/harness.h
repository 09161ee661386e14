/* Test harness: a real zerod process on a temporary socket (redis start_server, memcached
 * new_memcached), a raw frame client for tests that must send what libzerod never would, and the
 * example MLP as a model description. The zerod binary comes from $ZEROD_BIN (set by meson
 * test). */
#ifndef ZD_TESTS_HARNESS_H
#define ZD_TESTS_HARNESS_H

#include <stdint.h>
#include <sys/types.h>

#include "frame.h"
#include "zerod/zerod.h"

typedef struct zdt_daemon {
  pid_t pid;
  char dir[64];      /* temporary directory, removed by zdt_stop */
  char socket[108];  /* dir/zerod.sock */
  char log[160];     /* dir/zerod.log: the daemon's stderr */
  char control[128]; /* unix:dir/control.sock: the gRPC control service */
} zdt_daemon_t;

/* Starts zerod with --socket, --control_address and --log_level debug (unless extra has
 * --log_level or --config) plus extra (NULL-terminated, may be NULL) and waits until the socket
 * accepts connections. Exits the test on failure, printing
 * the log. The backend is cpu (ZEROD_BACKEND, unless the environment sets it) so that host-buffer
 * tests also pass on a machine with a GPU; extra may pass --backend. */
void zdt_start(zdt_daemon_t *d, const char *const *extra);

/* Runs $ZEROD_BIN with args (NULL-terminated, at most 14) to its end: for command lines and
 * start-up refusals. Returns its exit status (-1: killed) and its stdout and stderr together in
 * *output (a static buffer, valid until the next call). */
int zdt_run(const char *const *args, const char **output);

/* Sends sig, waits for zerod to end (20 s; zdt_hang_scale() times that under a sanitizer) and
 * fails the test, printing the log, unless it ended as a stop by sig should: death by SIGKILL
 * after SIGKILL, else exit 0 (SIGTERM, SIGINT; sig 0 sends nothing, for a zerod expected to have
 * exited by itself). A zerod stopped before (pid 0) only has its directory removed. Removes the
 * directory unless keep. */
void zdt_stop(zdt_daemon_t *d, int sig, int keep);

/* A wait status in words ("exit 0", "signal 11 (Segmentation fault)"), in a static buffer
 * valid until the next call. */
const char *zdt_status_str(int status);

/* The factor for waits that only catch a hang (start-up, shutdown): 1, or 10 under a sanitizer
 * (zd_test_sanitized, check.h). */
int zdt_hang_scale(void);

/* Prints the daemon's log to stderr (for failures). */
void zdt_dump_log(const zdt_daemon_t *d);

/* Whether the log contains s. */
int zdt_log_contains(const zdt_daemon_t *d, const char *s);

/* The example MLP (examples/mlp.h) as a model: its parameters, groups[0..ngroups), f32 params and
 * grads, every other field its default (ZD_MODEL_DESC_INIT); callers set the rest. */
zd_model_desc_t zdt_mlp_desc(const zd_group_t *groups, size_t ngroups);

/* Raw frames. */
int zdt_raw_connect(const char *socket_path);
void zdt_raw_send(int fd, const zd__frame_header_t *h, const void *body, const int *fds, int nfds);
/* Sends a frame with the right magic and version. */
void zdt_raw_request(int fd, uint16_t type, uint64_t id, const void *body, uint32_t len);
/* Reads one frame (body allocated, may be NULL for empty); returns 0, or -1 on EOF/timeout. */
int zdt_raw_recv(int fd, zd__frame_header_t *h, uint8_t **body, int timeout_ms);
/* Reads one frame and checks that it is an error for id with code and a message containing
 * substr; returns the message (static buffer). */
const char *zdt_expect_error(int fd, uint64_t id, int code, const char *substr);
/* The same, and checks Error.cuda_mappings_kept: kept 0 or 1, or -1 for absent (zerod sets it
 * on every error answering a register, and only there). */
const char *zdt_expect_error_kept(int fd, uint64_t id, int code, const char *substr, int kept);
/* Whether the peer closed the connection within timeout_ms. */
int zdt_raw_closed(int fd, int timeout_ms);
/* Says hello (protocol version 1, local rank 0) and checks the reply. */
void zdt_raw_hello(int fd, uint64_t id);

#endif /* ZD_TESTS_HARNESS_H */
