/* zerod against clients that misbehave or crowd it, and against stray signals: connections that
 * never say hello are closed after hello_timeout_ms, so idle connections cannot lock a trainer
 * out of max_clients, and a client that finds zerod full waits for a free connection up to its
 * connect timeout; one user's connections are capped by max_clients_per_uid; connecting
 * clients are not logged one line each at info; SIGHUP neither kills zerod nor loses its state,
 * and re-reads log_level from the config file; a peer node that stops (SIGSTOP) is noticed by the
 * heartbeat within peer_timeout_ms, while a peer that is only slow is waited for. */
#include <pthread.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "harness.h"
#include "rendezvous.h"
#include "zerod/zerod.h"

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* A client of one f32 parameter of n elements on local rank 0. */
static zd_client_t *attach(const char *socket, uint64_t n) {
  zd_client_t *c;
  int rc = zd_connect(socket, 0, 5000, &c);
  CHECK_MSG(rc == ZD_OK, "connect: %s (%s)", zd_err_name(rc), zd_last_error());
  zd_param_t p = {.name = "w", .ndim = 1, .shape = {n}, .group = 0};
  zd_group_t g;
  zd_group_init(&g, 1, sizeof g);
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = &p;
  desc.nparams = 1;
  desc.groups = &g;
  desc.ngroups = 1;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  CHECK_MSG(zd_layout(c, &desc) == ZD_OK, "layout: %s", zd_last_error());
  CHECK_MSG(zd_register(c) == ZD_OK, "register: %s", zd_last_error());
  float *grad = zd_grad_buffer(c, NULL);
  for (uint64_t i = 0; i < n; i++) grad[i] = 0.01f * (float)(i % 5);
  return c;
}

static uint64_t step(zd_client_t *c) {
  zd_step_result_t r = ZD_STEP_RESULT_INIT;
  CHECK_MSG(zd_step(c, NULL, &r) == ZD_OK, "step: %s", zd_last_error());
  return r.step;
}

static void test_hello_timeout_frees_slots(void) {
  zdt_daemon_t d;
  const char *extra[] = {"--max_clients", "4", "--hello_timeout_ms", "300", NULL};
  zdt_start(&d, extra);
  sleep_ms(200); /* zdt_start's probe connection is gone */
  int idle[4];
  for (int i = 0; i < 4; i++) idle[i] = zdt_raw_connect(d.socket);
  sleep_ms(50);
  /* Every slot is taken by a connection that says nothing: a trainer that cannot wait long is
   * refused, saying what it waited for... */
  zd_client_t *c;
  int rc = zd_connect(d.socket, 0, 50, &c);
  CHECK_MSG(rc == ZD_EBUSY, "connect with 4 idle connections: %s, expected ZD_EBUSY",
            zd_err_name(rc));
  CHECK_CONTAINS(zd_last_error(), "max_clients is 4");
  CHECK_CONTAINS(zd_last_error(), "for a free connection");
  /* ... one that can wait gets in once hello_timeout_ms has closed the idle ones... */
  uint64_t t0 = now_ms();
  rc = zd_connect(d.socket, 0, 5000, &c);
  CHECK_MSG(rc == ZD_OK, "connect waiting for the idle connections to go: %s (%s)", zd_err_name(rc),
            zd_last_error());
  CHECK_MSG(now_ms() - t0 < 3000, "connected after %llu ms; the idle ones go at 300 ms",
            (unsigned long long)(now_ms() - t0));
  zd_close(c);
  /* ... and the idle ones were closed with a reason. */
  for (int i = 0; i < 4; i++) {
    zdt_expect_error(idle[i], 0, ZD_EPROTO, "no hello within 300 ms (hello_timeout_ms)");
    CHECK_MSG(zdt_raw_closed(idle[i], 3000), "idle connection %d still open", i);
    close(idle[i]);
  }
  zd_client_t *t = attach(d.socket, 4096);
  CHECK_U64_EQ(step(t), 1);
  zd_close(t);
  /* A client that said hello in time is not timed out: it may stay idle between requests. */
  int fd = zdt_raw_connect(d.socket);
  zdt_raw_hello(fd, 1);
  sleep_ms(600);
  CHECK_MSG(!zdt_raw_closed(fd, 100), "a connection that said hello was closed while idle");
  close(fd);
  zdt_stop(&d, SIGTERM, 0);
}

struct waiter {
  const char *socket;
  int timeout_ms;
  int rc;
  uint64_t elapsed_ms;
  char msg[512];
  zd_client_t *c;
};

static void *wait_connect(void *arg) {
  struct waiter *w = arg;
  uint64_t t0 = now_ms();
  w->rc = zd_connect(w->socket, ZD_ANY_RANK, w->timeout_ms, &w->c);
  w->elapsed_ms = now_ms() - t0;
  snprintf(w->msg, sizeof w->msg, "%s", zd_last_error());
  return NULL;
}

/* zerod at max_clients: a client waits (bounded by its connect timeout) for a connection to
 * free up instead of failing at once; one whose timeout passes first gets ZD_EBUSY saying what it
 * waited for and how long. */
static void test_connect_waits_for_free_slot(void) {
  zdt_daemon_t d;
  const char *extra[] = {"--max_clients", "1", "--local_ranks", "2", NULL};
  zdt_start(&d, extra);
  sleep_ms(200); /* zdt_start's probe connection is gone */
  zd_client_t *a;
  CHECK_MSG(zd_connect(d.socket, ZD_ANY_RANK, 2000, &a) == ZD_OK, "first: %s", zd_last_error());
  struct waiter w = {.socket = d.socket, .timeout_ms = 10000};
  pthread_t th;
  CHECK(pthread_create(&th, NULL, wait_connect, &w) == 0);
  sleep_ms(400);
  zd_close(a); /* the waiting client gets the connection now */
  CHECK(pthread_join(th, NULL) == 0);
  CHECK_MSG(w.rc == ZD_OK, "the waiting client: %s (%s)", zd_err_name(w.rc), w.msg);
  CHECK_MSG(w.elapsed_ms >= 350 && w.elapsed_ms < 5000,
            "the waiting client connected after %llu ms; the first left at 400 ms",
            (unsigned long long)w.elapsed_ms);
  /* The connection stays taken: a client with a short timeout gives up after it. */
  struct waiter late = {.socket = d.socket, .timeout_ms = 300};
  wait_connect(&late);
  CHECK_MSG(late.rc == ZD_EBUSY, "connect to a full zerod: %s, expected ZD_EBUSY",
            zd_err_name(late.rc));
  CHECK_CONTAINS(late.msg, "max_clients is 1");
  CHECK_CONTAINS(late.msg, "for a free connection");
  CHECK_CONTAINS(late.msg, "connect timeout, 300 ms");
  CHECK_MSG(late.elapsed_ms >= 290 && late.elapsed_ms < 2000,
            "gave up after %llu ms with a 300 ms timeout", (unsigned long long)late.elapsed_ms);
  zd_close(w.c);
  zdt_stop(&d, SIGTERM, 0);
}

static void test_per_uid_limit(void) {
  zdt_daemon_t d;
  const char *extra[] = {"--max_clients_per_uid", "2", NULL};
  zdt_start(&d, extra);
  sleep_ms(200); /* zdt_start's probe connection is gone */
  int a = zdt_raw_connect(d.socket), b = zdt_raw_connect(d.socket);
  zdt_raw_hello(a, 1);
  zdt_raw_hello(b, 1);
  int c = zdt_raw_connect(d.socket);
  char want[64];
  snprintf(want, sizeof want, "uid %d has 2 connections", (int)getuid());
  zdt_expect_error(c, 0, ZD_EBUSY, want);
  CHECK(zdt_raw_closed(c, 2000));
  close(c);
  close(a); /* a slot frees when a connection goes */
  sleep_ms(100);
  int e = zdt_raw_connect(d.socket);
  zdt_raw_hello(e, 2);
  close(e);
  close(b);
  zdt_stop(&d, SIGTERM, 0);
}

/* A client that names a rank only to read the status (or a trainer's hello before its register)
 * reserves it weakly: a restarted trainer of that rank, naming it too, still registers. */
static void test_named_reader_yields(void) {
  zdt_daemon_t d;
  zdt_start(&d, NULL);
  zd_client_t *reader;
  CHECK(zd_connect(d.socket, 0, 2000, &reader) == ZD_OK);
  zd_client_t *t = attach(d.socket, 4096); /* names local rank 0 too */
  CHECK_U64_EQ(step(t), 1);
  char *text = NULL;
  CHECK(zd_status(reader, &text) == ZD_OK); /* the reader goes on reading */
  free(text);
  zd_close(reader);
  zd_close(t);
  zdt_stop(&d, SIGTERM, 0);
}

/* 200 connect/status/bye rounds at log level info write no line per connection. */
static void test_connection_log_volume(void) {
  zdt_daemon_t d;
  const char *extra[] = {"--log_level", "info", NULL};
  zdt_start(&d, extra);
  for (int i = 0; i < 200; i++) {
    zd_client_t *c;
    CHECK_MSG(zd_connect(d.socket, 0, 2000, &c) == ZD_OK, "connect: %s", zd_last_error());
    char *text = NULL;
    CHECK(zd_status(c, &text) == ZD_OK);
    free(text);
    zd_close(c);
  }
  CHECK_MSG(!zdt_log_contains(&d, "session "), "connections were logged one by one at info");
  zdt_stop(&d, SIGTERM, 0);
}

static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  CHECK(f != NULL);
  fputs(text, f);
  fclose(f);
}

static void test_sighup_keeps_state(void) {
  char conf[] = "/tmp/zerod-hup-XXXXXX";
  int fd = mkstemp(conf);
  CHECK(fd >= 0);
  close(fd);
  write_file(conf, "log_level = info\n");
  zdt_daemon_t d;
  const char *extra[] = {"--config", conf, NULL};
  zdt_start(&d, extra);
  zd_client_t *c = attach(d.socket, 4096);
  CHECK_U64_EQ(step(c), 1);
  CHECK_U64_EQ(step(c), 2);

  write_file(conf, "log_level = warn\nmax_clients = 7\n");
  CHECK(kill(d.pid, SIGHUP) == 0);
  sleep_ms(300);
  CHECK_MSG(waitpid(d.pid, NULL, WNOHANG) == 0, "zerod died of SIGHUP");
  CHECK_MSG(zdt_log_contains(&d, "SIGHUP: log_level is now warn (was info)"),
            "log_level not re-read");
  CHECK_MSG(zdt_log_contains(&d, "SIGHUP: max_clients changed to 7 (running with 64"),
            "a setting that needs a restart is not named");
  /* The same client and state: the step counter goes on. */
  CHECK_U64_EQ(step(c), 3);
  /* A broken file keeps the running configuration. */
  write_file(conf, "log_level = loud\n");
  CHECK(kill(d.pid, SIGHUP) == 0);
  sleep_ms(300);
  CHECK_MSG(waitpid(d.pid, NULL, WNOHANG) == 0, "zerod died of a SIGHUP with a broken file");
  CHECK_MSG(zdt_log_contains(&d, "configuration not reloaded"), "a bad reload is not reported");
  CHECK_U64_EQ(step(c), 4);
  zd_close(c);
  zdt_stop(&d, SIGTERM, 0);
  unlink(conf);
}

/* ---- the heartbeat: two zerods of one rank each ---- */

typedef struct peer_client {
  const char *socket;
  uint32_t rank;
  zd_client_t *c;
  int delay_ms; /* before the step */
  int rc;
  uint64_t step;
  char msg[512];
} peer_client_t;

static void *peer_attach(void *arg) {
  peer_client_t *p = arg;
  int rc = zd_connect(p->socket, 0, 5000, &p->c);
  CHECK_MSG(rc == ZD_OK, "connect: %s", zd_last_error());
  zd_param_t prm = {.name = "w", .ndim = 1, .shape = {4096}, .group = 0};
  zd_group_t g;
  zd_group_init(&g, 1, sizeof g);
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = &prm;
  desc.nparams = 1;
  desc.groups = &g;
  desc.ngroups = 1;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  CHECK_MSG(zd_layout(p->c, &desc) == ZD_OK, "layout: %s", zd_last_error());
  CHECK_MSG(zd_register(p->c) == ZD_OK, "register rank %u: %s", p->rank, zd_last_error());
  return NULL;
}

static void *peer_step(void *arg) {
  peer_client_t *p = arg;
  sleep_ms(p->delay_ms);
  zd_step_result_t r = ZD_STEP_RESULT_INIT;
  p->rc = zd_step(p->c, NULL, &r);
  p->step = r.step;
  snprintf(p->msg, sizeof p->msg, "%s", p->rc ? zd_last_error() : "");
  return NULL;
}

static void both(void *(*fn)(void *), peer_client_t *a, peer_client_t *b) {
  pthread_t ta, tb;
  pthread_create(&ta, NULL, fn, a);
  pthread_create(&tb, NULL, fn, b);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
}

static uint64_t ms_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* `zeroctl --address ADDR status`: exit status, output in out. */
static int zeroctl_status(const char *address, char *out, size_t len) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "'%s' --address '%s' status 2>&1", getenv("ZEROCTL_BIN"), address);
  FILE *p = popen(cmd, "r");
  CHECK(p != NULL);
  size_t n = fread(out, 1, len - 1, p);
  out[n] = '\0';
  int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int count(const char *hay, const char *needle) {
  int n = 0;
  for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle)) n++;
  return n;
}

/* Under systemd (a NOTIFY_SOCKET of our own here): READY=1, then WATCHDOG=1 with a STATUS= line
 * every half WATCHDOG_USEC, from the loop; STOPPING=1 at SIGTERM. */
static void test_systemd_notify(void) {
  char path[] = "/tmp/zerod-notify-XXXXXX";
  CHECK(mkdtemp(path) != NULL);
  char sock[sizeof path + 8];
  snprintf(sock, sizeof sock, "%s/notify", path);
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", sock);
  CHECK(bind(fd, (struct sockaddr *)&addr, sizeof addr) == 0);
  setenv("NOTIFY_SOCKET", sock, 1);
  setenv("WATCHDOG_USEC", "200000", 1); /* 0.2 s: a ping every 0.1 s */
  zdt_daemon_t d;
  zdt_start(&d, NULL);
  unsetenv("NOTIFY_SOCKET");
  unsetenv("WATCHDOG_USEC");
  struct timeval tv = {.tv_sec = 2};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char msg[512];
  int ready = 0, pings = 0;
  for (int i = 0; i < 20 && pings < 3; i++) {
    ssize_t n = recv(fd, msg, sizeof msg - 1, 0);
    CHECK_MSG(n > 0, "no notification from zerod (%d pings so far)", pings);
    msg[n] = '\0';
    ready |= !strcmp(msg, "READY=1");
    if (strstr(msg, "WATCHDOG=1\nSTATUS=1 of 1 local rank(s) ok, step ")) pings++;
  }
  CHECK_MSG(ready && pings >= 3, "READY %d, watchdog pings %d; last: %s", ready, pings, msg);
  zdt_stop(&d, SIGTERM, 0);
  int stopping = 0;
  tv.tv_sec = 0;
  tv.tv_usec = 200000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (ssize_t n; (n = recv(fd, msg, sizeof msg - 1, 0)) > 0;) {
    msg[n] = '\0';
    stopping |= !strcmp(msg, "STOPPING=1");
  }
  CHECK_MSG(stopping, "no STOPPING=1 at SIGTERM");
  close(fd);
  unlink(sock);
  rmdir(path);
}

/* A token file of mode `mode` holding `token`; path in buf. */
static void token_file(char *buf, size_t len, const char *token, int mode) {
  snprintf(buf, len, "/tmp/zerod-token-XXXXXX");
  int fd = mkstemp(buf);
  CHECK(fd >= 0);
  CHECK(write(fd, token, strlen(token)) == (ssize_t)strlen(token));
  CHECK(write(fd, "\n", 1) == 1);
  close(fd);
  CHECK(chmod(buf, (mode_t)mode) == 0);
}

#define TOKEN "0123456789abcdef0123456789abcdef"

/* With control_token_file, the rendezvous store refuses calls without the token, and with a
 * wrong one, logging the peer but never the token; loose token files and a control address other
 * hosts reach (without control_insecure) are refused at start. */
static void test_control_token(void) {
  char tok[64], loose[64];
  token_file(tok, sizeof tok, TOKEN, 0600);
  zdt_daemon_t d;
  const char *extra[] = {"--control_token_file", tok, NULL};
  zdt_start(&d, extra);
  zd__err_t err = {0};
  zd__rdv_t *rdv;
  CHECK_INT_EQ(zd__rdv_open(d.control, &rdv, &err), ZD_OK);
  int rc = zd__rdv_set(rdv, "k", "v", 1, 2000, &err);
  CHECK_MSG(rc == ZD_EDENIED, "KvSet without the token: %s (%s)", zd_err_name(rc), err.msg);
  CHECK_CONTAINS(err.msg, "no control token");
  CHECK_INT_EQ(zd__rdv_set_token(rdv, "fedcba9876543210fedcba9876543210", &err), ZD_OK);
  void *value = NULL;
  size_t n = 0;
  rc = zd__rdv_get(rdv, "k", &value, &n, 500, &err);
  CHECK_MSG(rc == ZD_EDENIED, "KvGet with a wrong token: %s (%s)", zd_err_name(rc), err.msg);
  CHECK_CONTAINS(err.msg, "a wrong control token");
  CHECK_INT_EQ(zd__rdv_set_token(rdv, TOKEN, &err), ZD_OK);
  CHECK_MSG(zd__rdv_set(rdv, "k", "v", 1, 2000, &err) == ZD_OK, "KvSet with the token: %s",
            err.msg);
  CHECK_MSG(zd__rdv_get(rdv, "k", &value, &n, 2000, &err) == ZD_OK, "KvGet: %s", err.msg);
  CHECK(n == 1 && !memcmp(value, "v", 1));
  free(value);
  zd__rdv_close(rdv);
  CHECK_MSG(zdt_log_contains(&d, "control: refused /zerod.v1.Control/KvSet from unix:"),
            "a refused call is not logged with its peer");
  CHECK_MSG(!zdt_log_contains(&d, TOKEN) && !zdt_log_contains(&d, "fedcba98"),
            "a token appears in the log");
  zdt_stop(&d, SIGTERM, 0);

  const char *out;
  token_file(loose, sizeof loose, TOKEN, 0644);
  CHECK_INT_EQ(zdt_run((const char *[]){"--control_token_file", loose, "--control_address",
                                        "127.0.0.1:0", "--socket", "/tmp/zerod-loose.sock", NULL},
                       &out),
               1);
  CHECK_CONTAINS(out, "has mode 0644; expected no access for others");
  CHECK_INT_EQ(zdt_run((const char *[]){"--control_address", "0.0.0.0:0", "--socket",
                                        "/tmp/zerod-open.sock", NULL},
                       &out),
               1);
  CHECK_CONTAINS(out, "set control_insecure = 1");
  unlink(loose);
  unlink(tok);
}

/* zeroctl status --watch redraws the table until it is stopped. */
static void test_zeroctl_watch(void) {
  zdt_daemon_t d;
  zdt_start(&d, NULL);
  char cmd[512], out[16384];
  snprintf(cmd, sizeof cmd, "timeout 2.5 '%s' --address '%s' status --watch 1 2>&1",
           getenv("ZEROCTL_BIN"), d.control);
  FILE *p = popen(cmd, "r");
  CHECK(p != NULL);
  size_t n = fread(out, 1, sizeof out - 1, p);
  out[n] = '\0';
  pclose(p);
  CHECK_MSG(count(out, "zeroctl status, every 1 s") >= 2, "--watch did not redraw: %s", out);
  CHECK_MSG(count(out, "HEALTH") >= 2, "--watch did not draw the table: %s", out);
  zdt_stop(&d, SIGTERM, 0);
}

static void test_heartbeat(void) {
  zdt_daemon_t da, db;
  char tok[64];
  token_file(tok, sizeof tok, TOKEN, 0600); /* the world forms through a store that needs it */
  const char *common[] = {"--world_size",
                          "2",
                          "--local_ranks",
                          "1",
                          "--heartbeat_ms",
                          "200",
                          "--peer_timeout_ms",
                          "1500",
                          "--collective_timeout_ms",
                          "60000",
                          "--threads",
                          "1",
                          "--control_token_file",
                          tok,
                          "--first_rank"};
  const char *args_a[18], *args_b[20];
  size_t n = sizeof common / sizeof common[0];
  memcpy(args_a, common, sizeof common);
  memcpy(args_b, common, sizeof common);
  args_a[n] = "0";
  args_a[n + 1] = NULL;
  zdt_start(&da, args_a);
  args_b[n] = "1";
  args_b[n + 1] = "--rendezvous_address";
  args_b[n + 2] = da.control;
  args_b[n + 3] = NULL;
  zdt_start(&db, args_b);
  peer_client_t a = {.socket = da.socket, .rank = 0}, b = {.socket = db.socket, .rank = 1};
  both(peer_attach, &a, &b);
  both(peer_step, &a, &b);
  CHECK_MSG(a.rc == ZD_OK && b.rc == ZD_OK, "steps: %s / %s", a.msg, b.msg);

  /* Slow, not dead: rank 1's trainer steps 3 s after rank 0's, twice peer_timeout_ms. */
  b.delay_ms = 3000;
  uint64_t t0 = ms_now();
  both(peer_step, &a, &b);
  CHECK_MSG(a.rc == ZD_OK && b.rc == ZD_OK, "a slow peer was taken for dead: %s / %s", a.msg,
            b.msg);
  CHECK_U64_EQ(a.step, 2);
  CHECK_INT_GE((long long)(ms_now() - t0), 2900);

  /* Stopped: rank 0's step fails soon after peer_timeout_ms, naming the silent node. */
  CHECK(kill(db.pid, SIGSTOP) == 0);
  t0 = ms_now();
  peer_step(&a);
  uint64_t took = ms_now() - t0;
  printf("step with a stopped peer failed after %llu ms: %s\n", (unsigned long long)took, a.msg);
  CHECK_MSG(a.rc == ZD_EPEER, "step with a stopped peer: %s (%s), expected ZD_EPEER",
            zd_err_name(a.rc), a.msg);
  CHECK_CONTAINS(a.msg, "has not answered for");
  CHECK_WITHIN((double)took, 20000.0,
               "a stopped peer is found by its missing heartbeats "
               "(peer_timeout_ms 1.5 s), not by the collective timeout (60 s)");
  /* Degraded now: later steps fail at once, and the reason is said once, not wrapped again. */
  peer_step(&a);
  CHECK_INT_EQ(a.rc, ZD_EDEGRADED);
  peer_step(&a);
  CHECK_INT_EQ(count(a.msg, "is degraded"), 1);
  char out[8192];
  CHECK_INT_EQ(zeroctl_status(da.control, out, sizeof out), 1); /* a degraded rank: exit 1 */
  CHECK_CONTAINS(out, "has not answered for");
  CHECK_INT_EQ(count(out, "is degraded"), 0);
  CHECK(kill(db.pid, SIGCONT) == 0);
  zd_close(a.c);
  zd_close(b.c);
  zdt_stop(&db, SIGTERM, 0);
  zdt_stop(&da, SIGTERM, 0);
  unlink(tok);
}

int main(void) {
  test_hello_timeout_frees_slots();
  test_connect_waits_for_free_slot();
  test_per_uid_limit();
  test_named_reader_yields();
  test_connection_log_volume();
  test_sighup_keeps_state();
  test_zeroctl_watch();
  test_systemd_notify();
  test_control_token();
  test_heartbeat();
  printf("robust: ok\n");
  return 0;
}
