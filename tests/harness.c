/* Test harness (harness.h). */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "mlp.h"
#include "zerod.pb-c.h"
#include "zerod/zerod.h"

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

void zdt_dump_log(const zdt_daemon_t *d) {
  FILE *f = fopen(d->log, "r");
  if (!f) return;
  fprintf(stderr, "---- zerod log %s ----\n", d->log);
  char line[1024];
  while (fgets(line, sizeof line, f)) fputs(line, stderr);
  fprintf(stderr, "---- end of log ----\n");
  fclose(f);
}

int zdt_log_contains(const zdt_daemon_t *d, const char *s) {
  FILE *f = fopen(d->log, "r");
  if (!f) return 0;
  char line[2048];
  int found = 0;
  while (!found && fgets(line, sizeof line, f)) found = strstr(line, s) != NULL;
  fclose(f);
  return found;
}

int zdt_raw_connect(const char *socket_path) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  CHECK(fd >= 0);
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", socket_path);
  if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Daemons started and not stopped yet: a test that fails (CHECK exits) must not leave them
 * running. Only the process that started them kills them (forked children exit too). */
#define MAX_LIVE 16
static pid_t live[MAX_LIVE];
static pid_t live_owner;

static void kill_leftovers(void) {
  if (getpid() != live_owner) return;
  for (int i = 0; i < MAX_LIVE; i++)
    if (live[i] > 0) {
      kill(live[i], SIGKILL);
      waitpid(live[i], NULL, 0);
      live[i] = 0;
    }
}

static void track(pid_t pid, pid_t untrack) {
  if (!live_owner) {
    live_owner = getpid();
    atexit(kill_leftovers);
  }
  for (int i = 0; i < MAX_LIVE; i++)
    if (live[i] == untrack) {
      live[i] = pid;
      return;
    }
  if (pid)
    fprintf(stderr, "harness: more than %d daemons at once; pid %d not tracked\n", MAX_LIVE,
            (int)pid);
}

/* zdt_run (harness.h). */
int zdt_run(const char *const *args, const char **output) {
  static char out[65536];
  int fds[2];
  CHECK(pipe(fds) == 0);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    const char *argv[16] = {getenv("ZEROD_BIN")};
    for (int i = 0; args[i] && i < 14; i++) argv[i + 1] = args[i];
    execv(argv[0], (char *const *)argv);
    _exit(127);
  }
  close(fds[1]);
  size_t n = 0;
  ssize_t r;
  while ((r = read(fds[0], out + n, sizeof out - 1 - n)) > 0) n += (size_t)r;
  out[n] = '\0';
  close(fds[0]);
  int status;
  waitpid(pid, &status, 0);
  *output = out;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void zdt_start(zdt_daemon_t *d, const char *const *extra) {
  const char *bin = getenv("ZEROD_BIN");
  CHECK_MSG(bin && bin[0], "ZEROD_BIN is not set (run the tests with meson test)");
  snprintf(d->dir, sizeof d->dir, "/tmp/zerod-test-XXXXXX");
  CHECK(mkdtemp(d->dir) != NULL);
  snprintf(d->socket, sizeof d->socket, "%s/zerod.sock", d->dir);
  snprintf(d->log, sizeof d->log, "%s/zerod.log", d->dir);
  snprintf(d->control, sizeof d->control, "unix:%s/control.sock", d->dir);
  const char *argv[64];
  int n = 0;
  argv[n++] = bin;
  argv[n++] = "--socket";
  argv[n++] = d->socket;
  int own_level = 0; /* extra sets the level, or leaves it to a config file (--config) */
  for (int i = 0; extra && extra[i]; i++)
    own_level |= !strcmp(extra[i], "--log_level") || !strcmp(extra[i], "--config");
  if (!own_level) {
    argv[n++] = "--log_level";
    argv[n++] = "debug";
  }
  argv[n++] = "--control_address";
  argv[n++] = d->control;
  for (int i = 0; extra && extra[i] && n < 62; i++) argv[n++] = extra[i];
  argv[n] = NULL;
  d->pid = fork();
  CHECK(d->pid >= 0);
  if (d->pid == 0) {
    int fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
      dup2(fd, 2);
      dup2(fd, 1);
      close(fd);
    }
    /* The suites that use host buffers need the CPU backend, also on a machine with a GPU, where
     * backend auto would pick CUDA (which takes device buffers only). Tests of the CUDA backend
     * pass --backend, which wins over the environment; a caller may set ZEROD_BACKEND itself. */
    setenv("ZEROD_BACKEND", "cpu", 0);
    execv(bin, (char *const *)argv);
    fprintf(stderr, "exec %s: %s\n", bin, strerror(errno));
    _exit(127);
  }
  track(d->pid, 0);
  int limit_ms = 10000 * zdt_hang_scale();
  for (int waited = 0; waited < limit_ms; waited += 10) {
    int fd = zdt_raw_connect(d->socket);
    if (fd >= 0) {
      close(fd);
      return;
    }
    int status;
    if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
      track(0, d->pid);
      zdt_dump_log(d);
      fprintf(stderr, "zerod exited during start-up (%s)\n", zdt_status_str(status));
      exit(1);
    }
    sleep_ms(10);
  }
  zdt_dump_log(d);
  fprintf(stderr, "zerod did not accept connections on %s within %d ms\n", d->socket, limit_ms);
  kill(d->pid, SIGKILL);
  exit(1);
}

/* In a sanitizer build (scripts/sanitize.sh) zerod reports to its stderr, the log that zdt_stop
 * deletes, and not every test looks at how each zerod exited: a report fails the test here. */
static void check_sanitizer_report(const zdt_daemon_t *d) {
  static const char *const marks[] = {"runtime error:", "ERROR: AddressSanitizer",
                                      "ERROR: LeakSanitizer", "WARNING: ThreadSanitizer"};
  for (size_t i = 0; i < sizeof marks / sizeof marks[0]; i++) {
    if (!zdt_log_contains(d, marks[i])) continue;
    zdt_dump_log(d);
    fprintf(stderr, "zerod's log has a sanitizer report (\"%s\")\n", marks[i]);
    exit(1);
  }
}

int zdt_hang_scale(void) {
  return zd_test_sanitized() ? 10 : 1;
}

const char *zdt_status_str(int status) {
  static char buf[96];
  if (WIFEXITED(status))
    snprintf(buf, sizeof buf, "exit %d", WEXITSTATUS(status));
  else if (WIFSIGNALED(status))
    snprintf(buf, sizeof buf, "signal %d (%s)%s", WTERMSIG(status), strsignal(WTERMSIG(status)),
             WCOREDUMP(status) ? ", core dumped" : "");
  else
    snprintf(buf, sizeof buf, "wait status 0x%x", status);
  return buf;
}

void zdt_stop(zdt_daemon_t *d, int sig, int keep) {
  if (d->pid > 0) {
    int status = -1, limit_ms = 20000 * zdt_hang_scale();
    if (sig) kill(d->pid, sig);
    for (int waited = 0; waitpid(d->pid, &status, WNOHANG) != d->pid; waited += 10) {
      if (waited >= limit_ms) {
        zdt_dump_log(d);
        fprintf(stderr, "zerod (pid %d) did not exit within %d ms of signal %d\n", (int)d->pid,
                limit_ms, sig);
        kill(d->pid, SIGKILL);
        waitpid(d->pid, &status, 0);
        track(0, d->pid);
        exit(1);
      }
      sleep_ms(10);
    }
    track(0, d->pid);
    pid_t pid = d->pid;
    d->pid = 0;
    check_sanitizer_report(d);
    int killed = sig == SIGKILL;
    if (killed ? !WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL
               : !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      zdt_dump_log(d);
      fprintf(stderr, "zerod (pid %d, %s) ended with %s after signal %d; expected %s\n", (int)pid,
              d->socket, zdt_status_str(status), sig, killed ? "death by SIGKILL" : "exit 0");
      exit(1);
    }
  }
  if (!keep) {
    char lock[sizeof d->socket + 8];
    snprintf(lock, sizeof lock, "%s.lock", d->socket); /* left behind by a killed zerod */
    unlink(lock);
    unlink(d->log);
    unlink(d->socket);
    unlink(d->control + 5);
    rmdir(d->dir);
  }
}

void zdt_raw_send(int fd, const zd__frame_header_t *h, const void *body, const int *fds, int nfds) {
  uint8_t *buf = malloc(ZD__FRAME_HEADER_SIZE + h->length);
  CHECK(buf);
  zd__frame_encode(h, buf);
  if (h->length) memcpy(buf + ZD__FRAME_HEADER_SIZE, body, h->length);
  struct iovec iov = {.iov_base = buf, .iov_len = ZD__FRAME_HEADER_SIZE + h->length};
  union {
    char b[CMSG_SPACE(8 * sizeof(int))];
    struct cmsghdr align;
  } ctrl;
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
  if (nfds > 0) {
    msg.msg_control = ctrl.b;
    msg.msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int));
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
    memcpy(CMSG_DATA(cm), fds, (size_t)nfds * sizeof(int));
  }
  ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
  CHECK_INT_EQ(n, (long long)iov.iov_len);
  free(buf);
}

void zdt_raw_request(int fd, uint16_t type, uint64_t id, const void *body, uint32_t len) {
  zd__frame_header_t h = {.magic = ZD__FRAME_MAGIC,
                          .version = ZD_PROTOCOL_VERSION,
                          .type = type,
                          .length = len,
                          .request_id = id};
  zdt_raw_send(fd, &h, body, NULL, 0);
}

static int read_full(int fd, uint8_t *buf, size_t len, int timeout_ms) {
  size_t off = 0;
  while (off < len) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, timeout_ms) <= 0) return -1;
    ssize_t n = recv(fd, buf + off, len - off, 0);
    if (n <= 0) return -1;
    off += (size_t)n;
  }
  return 0;
}

int zdt_raw_recv(int fd, zd__frame_header_t *h, uint8_t **body, int timeout_ms) {
  uint8_t hdr[ZD__FRAME_HEADER_SIZE];
  *body = NULL;
  if (read_full(fd, hdr, sizeof hdr, timeout_ms) != 0) return -1;
  CHECK_INT_EQ(zd__frame_decode(hdr, h), ZD_OK);
  CHECK_INT_LE(h->length, ZD__FRAME_MAX_BODY);
  *body = malloc(h->length ? h->length : 1);
  CHECK(*body);
  if (read_full(fd, *body, h->length, timeout_ms) != 0) {
    free(*body);
    *body = NULL;
    return -1;
  }
  return 0;
}

const char *zdt_expect_error(int fd, uint64_t id, int code, const char *substr) {
  return zdt_expect_error_kept(fd, id, code, substr, -2);
}

/* kept -2: not checked */
const char *zdt_expect_error_kept(int fd, uint64_t id, int code, const char *substr, int kept) {
  static char msg[1024];
  zd__frame_header_t h;
  uint8_t *body;
  CHECK_MSG(zdt_raw_recv(fd, &h, &body, 5000) == 0, "no reply (expected error %s containing '%s')",
            zd_err_name(code), substr);
  CHECK_MSG(h.type == ZD__MSG_ERROR, "expected an error reply, got %s (0x%x)", zd__msg_name(h.type),
            h.type);
  CHECK_U64_EQ(h.request_id, id);
  Zerod__V1__Error *e = zerod__v1__error__unpack(NULL, h.length, body);
  CHECK(e);
  snprintf(msg, sizeof msg, "%s", e->message);
  CHECK_MSG(e->code == code, "expected %s, got %s: %s", zd_err_name(code), zd_err_name(e->code),
            e->message);
  CHECK_CONTAINS(msg, substr);
  if (kept != -2) {
    int got = e->has_cuda_mappings_kept ? e->cuda_mappings_kept != 0 : -1;
    CHECK_MSG(got == kept, "error '%s': cuda_mappings_kept is %d, expected %d (-1: absent)", msg,
              got, kept);
  }
  zerod__v1__error__free_unpacked(e, NULL);
  free(body);
  return msg;
}

int zdt_raw_closed(int fd, int timeout_ms) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  if (poll(&p, 1, timeout_ms) <= 0) return 0;
  char c;
  return recv(fd, &c, 1, MSG_DONTWAIT) == 0;
}

void zdt_raw_hello(int fd, uint64_t id) {
  Zerod__V1__HelloRequest req = ZEROD__V1__HELLO_REQUEST__INIT;
  req.min_version = req.max_version = ZD_PROTOCOL_VERSION;
  req.has_local_rank = 1;
  req.local_rank = 0; /* named: hello works while another client holds it (register would not) */
  uint8_t buf[256];
  size_t len = zerod__v1__hello_request__pack(&req, buf);
  zdt_raw_request(fd, ZD__MSG_HELLO, id, buf, (uint32_t)len);
  zd__frame_header_t h;
  uint8_t *body;
  CHECK(zdt_raw_recv(fd, &h, &body, 5000) == 0);
  CHECK_MSG(h.type == (ZD__MSG_HELLO | ZD__FRAME_REPLY), "hello got %s", zd__msg_name(h.type));
  CHECK_U64_EQ(h.request_id, id);
  free(body);
}

zd_model_desc_t zdt_mlp_desc(const zd_group_t *groups, size_t ngroups) {
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = mlp_params;
  desc.nparams = MLP_NPARAMS;
  desc.groups = groups;
  desc.ngroups = ngroups;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  return desc;
}
