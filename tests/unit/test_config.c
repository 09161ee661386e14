/* Tests of the settings table (daemon/config.c) and the log line (daemon/log.c).
 *
 * Configuration errors are what an operator sees first, so beyond the values each error class
 * is checked for its code and for a message that names the setting, where the value came from
 * and what was expected. Config files are real temporary files; the environment is passed as an
 * envp array except XDG_RUNTIME_DIR, which the socket default reads with getenv.
 */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "config.h"
#include "log.h"

#define NARGS(...) (int)(sizeof((char *[]){__VA_ARGS__}) / sizeof(char *))
#define ARGV(...)                           \
  NARGS("zerod", __VA_ARGS__), (char *[]) { \
    "zerod", __VA_ARGS__, NULL              \
  }

static char *no_env[] = {NULL};
static char tmpdir[] = "/tmp/zd_test_config_XXXXXX";

/* Writes text to a new file in tmpdir and returns its path (static storage, one per call). */
static char paths[16][64];
static int npaths;

static const char *write_file(const char *text) {
  CHECK(npaths < 16);
  char *path = paths[npaths++];
  snprintf(path, 64, "%s/cfgXXXXXX", tmpdir);
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  CHECK_INT_EQ(write(fd, text, strlen(text)), (long long)strlen(text));
  close(fd);
  return path;
}

typedef struct visit {
  int count;
  int seen[ZD__CONFIG_MAX_SETTINGS];
  char names[ZD__CONFIG_MAX_SETTINGS][40], values[ZD__CONFIG_MAX_SETTINGS][400],
      sources[ZD__CONFIG_MAX_SETTINGS][16];
} visit_t;

static void record(void *ctx, const char *name, const char *value, const char *source) {
  visit_t *v = ctx;
  CHECK(v->count < ZD__CONFIG_MAX_SETTINGS);
  snprintf(v->names[v->count], sizeof v->names[0], "%s", name);
  snprintf(v->values[v->count], sizeof v->values[0], "%s", value);
  snprintf(v->sources[v->count], sizeof v->sources[0], "%s", source);
  v->count++;
}

static int find(const visit_t *v, const char *name) {
  for (int i = 0; i < v->count; i++)
    if (!strcmp(v->names[i], name)) return i;
  fprintf(stderr, "setting %s not visited\n", name);
  exit(1);
}

static void check_setting(const visit_t *v, const char *name, const char *value,
                          const char *source) {
  int i = find(v, name);
  CHECK_STR_EQ(v->values[i], value);
  CHECK_STR_EQ(v->sources[i], source);
}

static const char *const all_names[] = {"socket",
                                        "socket_mode",
                                        "allowed_uids",
                                        "allowed_gids",
                                        "max_clients",
                                        "max_clients_per_uid",
                                        "hello_timeout_ms",
                                        "max_frame_bytes",
                                        "frame_timeout_ms",
                                        "max_inflight",
                                        "busy_poll_us",
                                        "backend",
                                        "threads",
                                        "pin_threads",
                                        "kernel_isa",
                                        "overlap_update",
                                        "ranks_per_gpu",
                                        "cuda_step",
                                        "local_ranks",
                                        "world_size",
                                        "world_size_record",
                                        "first_rank",
                                        "bucket_elems",
                                        "control_address",
                                        "control_token_file",
                                        "control_insecure",
                                        "tls_cert",
                                        "tls_key",
                                        "tls_ca",
                                        "rendezvous_address",
                                        "rendezvous",
                                        "collective_timeout_ms",
                                        "heartbeat_ms",
                                        "peer_timeout_ms",
                                        "connect_timeout_ms",
                                        "collective_host",
                                        "checkpoint_dir",
                                        "checkpoint_every_steps",
                                        "checkpoint_every_seconds",
                                        "checkpoint_keep",
                                        "resume",
                                        "state_dir",
                                        "state_dir_any_fs",
                                        "state_dir_mode",
                                        "state_snapshot_every_steps",
                                        "state_snapshot_every_s",
                                        "buddy_copy_every_steps",
                                        "buddy_copy_every_s",
                                        "buddy_bandwidth_bytes_per_s",
                                        "failure_domain",
                                        "checkpoint_throttle_bytes_per_s",
                                        "shutdown_timeout_ms",
                                        "log_level",
                                        "metrics_address",
                                        "config"};
#define NNAMES (int)(sizeof all_names / sizeof all_names[0])

static void test_defaults(void) {
  zd__config_t cfg;
  zd__err_t err = {0};
  char path[256];
  setenv("XDG_RUNTIME_DIR", "/run/user/4242", 1);
  CHECK_INT_EQ(zd__config_load(&cfg, 1, (char *[]){"zerod", NULL}, no_env, &err), ZD__CONFIG_RUN);
  CHECK_STR_EQ(cfg.socket_path, "/run/user/4242/zerod.sock");
  CHECK_INT_EQ(cfg.socket_mode, 0660);
  uint32_t self = (uint32_t)geteuid();
  CHECK_INT_EQ(cfg.allowed_uids.n, self ? 2 : 1);
  CHECK_INT_EQ(cfg.allowed_uids.ids[0], self);
  if (self) CHECK_INT_EQ(cfg.allowed_uids.ids[1], 0);
  CHECK_INT_EQ(cfg.allowed_gids.n, 0);
  CHECK_INT_EQ(cfg.max_clients, 64);
  CHECK_INT_EQ(cfg.max_clients_per_uid, 32);
  CHECK_INT_EQ(cfg.hello_timeout_ms, 10000);
  CHECK_INT_EQ(cfg.heartbeat_ms, 1000);
  CHECK_INT_EQ(cfg.peer_timeout_ms, 10000);
  CHECK_INT_EQ(cfg.max_frame_bytes, 16777216);
  CHECK_INT_EQ(cfg.frame_timeout_ms, 10000);
  CHECK_INT_EQ(cfg.max_inflight, 64);
  CHECK_INT_EQ(cfg.busy_poll_us, 50);
  CHECK_STR_EQ(cfg.backend, "auto");
  CHECK_INT_EQ(cfg.threads, 0);
  CHECK_INT_EQ(cfg.pin_threads, 1);
  CHECK_STR_EQ(cfg.kernel_isa, "auto");
  CHECK_INT_EQ(cfg.overlap_update, 0);
  CHECK_INT_EQ(cfg.ranks_per_gpu, 1);
  CHECK_STR_EQ(cfg.cuda_step, "fast");
  CHECK_INT_EQ(cfg.local_ranks, 1);
  CHECK_INT_EQ(cfg.world_size, 1); /* 0 resolves to local_ranks */
  CHECK_INT_EQ(cfg.first_rank, 0);
  CHECK_U64_EQ(cfg.bucket_elems, 40000000ull);
  CHECK_STR_EQ(cfg.control_address, "127.0.0.1:7070");
  CHECK_STR_EQ(cfg.rendezvous_address, "127.0.0.1:7070");
  CHECK_INT_EQ(cfg.collective_timeout_ms, 1800000);
  CHECK_STR_EQ(cfg.log_level, "info");
  CHECK_STR_EQ(cfg.metrics_address, ""); /* off */
  CHECK_STR_EQ(cfg.config_file, "");
  CHECK_STR_EQ(cfg.state_dir_mode, "auto"); /* mapped on the cpu backend, snapshot on cuda */
  CHECK_INT_EQ(cfg.state_snapshot_every_steps, 0);
  CHECK_INT_EQ(cfg.state_snapshot_every_s, 0);

  /* Every row, in table order, once, all from the defaults. */
  visit_t v = {0};
  zd__config_visit(&cfg, record, &v);
  CHECK_INT_EQ(v.count, NNAMES);
  for (int i = 0; i < NNAMES; i++) {
    CHECK_STR_EQ(v.names[i], all_names[i]);
    CHECK_STR_EQ(v.sources[i], "default");
  }
  check_setting(&v, "socket_mode", "0660", "default");
  snprintf(path, sizeof path, self ? "%u,0" : "%u", self);
  check_setting(&v, "allowed_uids", path, "default");
  check_setting(&v, "allowed_gids", "", "default");
  check_setting(&v, "bucket_elems", "40000000", "default");
  zd__config_free(&cfg);
  zd__config_free(&cfg); /* idempotent */

  /* Without XDG_RUNTIME_DIR the system path. */
  unsetenv("XDG_RUNTIME_DIR");
  CHECK_INT_EQ(zd__config_load(&cfg, 0, NULL, no_env, &err), ZD__CONFIG_RUN);
  CHECK_STR_EQ(cfg.socket_path, "/run/zerod/zerod.sock");
  zd__config_free(&cfg);
  setenv("XDG_RUNTIME_DIR", "/run/user/4242", 1);
}

static void test_file(void) {
  zd__config_t cfg;
  zd__err_t err = {0};
  const char *path = write_file(
      "# zerod test config\n"
      "\n"
      "socket = /tmp/zd#1.sock   # '#' inside a value stays\n"
      "socket_mode 0600\n"
      "  max-clients=7\n"
      "allowed_uids = 0, 1000,root\n"
      "allowed_gids = 0\n"
      "backend = cpu\n"
      "kernel_isa scalar\n"
      "local_ranks = 4\n"
      "world_size = 8\n"
      "first_rank = 4\n"
      "bucket_elems = 123456789012\n"
      "rendezvous_address = \"10.0.0.1:7070\"\n"
      "control_address = 0.0.0.0:7071\r\n"
      "log_level = debug\n");
  char *env[] = {"ZEROD_CONFIG=", NULL};
  char envbuf[300];
  snprintf(envbuf, sizeof envbuf, "ZEROD_CONFIG=%s", path);
  env[0] = envbuf;
  CHECK_INT_EQ(zd__config_load(&cfg, 1, (char *[]){"zerod", NULL}, env, &err), ZD__CONFIG_RUN);
  CHECK_STR_EQ(cfg.socket_path, "/tmp/zd#1.sock");
  CHECK_INT_EQ(cfg.socket_mode, 0600);
  CHECK_INT_EQ(cfg.max_clients, 7);
  CHECK_INT_EQ(cfg.allowed_uids.n, 3);
  CHECK_INT_EQ(cfg.allowed_uids.ids[1], 1000);
  CHECK_INT_EQ(cfg.allowed_uids.ids[2], 0);
  CHECK_INT_EQ(cfg.allowed_gids.n, 1);
  CHECK_STR_EQ(cfg.backend, "cpu");
  CHECK_STR_EQ(cfg.kernel_isa, "scalar");
  CHECK_INT_EQ(cfg.local_ranks, 4);
  CHECK_INT_EQ(cfg.world_size, 8);
  CHECK_INT_EQ(cfg.first_rank, 4);
  CHECK_U64_EQ(cfg.bucket_elems, 123456789012ull);
  CHECK_STR_EQ(cfg.rendezvous_address, "10.0.0.1:7070");
  CHECK_STR_EQ(cfg.control_address, "0.0.0.0:7071");
  CHECK_STR_EQ(cfg.log_level, "debug");
  CHECK_STR_EQ(cfg.config_file, path);

  visit_t v = {0};
  zd__config_visit(&cfg, record, &v);
  check_setting(&v, "socket_mode", "0600", "file");
  check_setting(&v, "allowed_uids", "0,1000,0", "file");
  check_setting(&v, "config", path, "env");
  check_setting(&v, "max_inflight", "64", "default");
  check_setting(&v, "frame_timeout_ms", "10000", "default");
  zd__config_free(&cfg);
}

static void test_env_and_flags(void) {
  zd__config_t cfg;
  zd__err_t err = {0};
  char *env[] = {"ZEROD_LOCAL_RANKS=2",
                 "ZEROD_BACKEND=cuda",
                 "ZEROD_SOCKET_MODE=0600",
                 "ZEROD_LOCAL_RANK=9" /* not a setting's variable: ignored */,
                 "HOME=/x",
                 NULL};
  CHECK_INT_EQ(zd__config_load(&cfg, 1, (char *[]){"zerod", NULL}, env, &err), ZD__CONFIG_RUN);
  CHECK_INT_EQ(cfg.local_ranks, 2);
  CHECK_INT_EQ(cfg.world_size, 2);
  CHECK_STR_EQ(cfg.backend, "cuda");
  CHECK_INT_EQ(cfg.socket_mode, 0600);
  zd__config_free(&cfg);

  /* Both flag forms, dashes and underscores. */
  CHECK_INT_EQ(
      zd__config_load(&cfg,
                      ARGV("--max-clients", "5", "--max_frame_bytes=8192", "--frame-timeout-ms=250",
                           "--max_inflight", "3", "--allowed-gids=", "--socket", "/tmp/x.sock",
                           "--rendezvous_address", "h:1"),
                      no_env, &err),
      ZD__CONFIG_RUN);
  CHECK_INT_EQ(cfg.max_clients, 5);
  CHECK_INT_EQ(cfg.max_frame_bytes, 8192);
  CHECK_INT_EQ(cfg.frame_timeout_ms, 250);
  CHECK_INT_EQ(cfg.max_inflight, 3);
  CHECK_INT_EQ(cfg.allowed_gids.n, 0);
  CHECK_STR_EQ(cfg.socket_path, "/tmp/x.sock");
  CHECK_STR_EQ(cfg.rendezvous_address, "h:1");
  visit_t v = {0};
  zd__config_visit(&cfg, record, &v);
  check_setting(&v, "max_clients", "5", "flag");
  check_setting(&v, "allowed_gids", "", "flag");
  check_setting(&v, "rendezvous", "builtin", "default");
  zd__config_free(&cfg);

  /* An etcd rendezvous is where the world's store calls go: it replaces rendezvous_address. */
  CHECK_INT_EQ(zd__config_load(&cfg,
                               ARGV("--rendezvous_address", "h:1", "--rendezvous",
                                    "etcd://10.0.0.5:2379,10.0.0.6:2379/run-1"),
                               no_env, &err),
               ZD__CONFIG_RUN);
  CHECK_STR_EQ(cfg.rendezvous, "etcd://10.0.0.5:2379,10.0.0.6:2379/run-1");
  CHECK_STR_EQ(cfg.rendezvous_address, "etcd://10.0.0.5:2379,10.0.0.6:2379/run-1");
  zd__config_free(&cfg);

  CHECK_INT_EQ(zd__config_load(&cfg, ARGV("--help"), no_env, &err), ZD__CONFIG_HELP);
  CHECK_INT_EQ(zd__config_load(&cfg, ARGV("--threads", "2", "-h"), no_env, &err), ZD__CONFIG_HELP);
  CHECK_INT_EQ(zd__config_load(&cfg, ARGV("-V"), no_env, &err), ZD__CONFIG_VERSION);
  CHECK_INT_EQ(zd__config_load(&cfg, ARGV("--version"), no_env, &err), ZD__CONFIG_VERSION);
  zd__config_free(&cfg);
}

static void test_precedence(void) {
  zd__config_t cfg;
  zd__err_t err = {0};
  const char *path = write_file("threads = 1\nmax_clients = 1\nmax_inflight = 1\n");
  char cfgvar[300];
  snprintf(cfgvar, sizeof cfgvar, "ZEROD_CONFIG=%s", path);
  char *env[] = {cfgvar, "ZEROD_THREADS=2", "ZEROD_MAX_CLIENTS=2", NULL};
  CHECK_INT_EQ(zd__config_load(&cfg, ARGV("--threads", "3"), env, &err), ZD__CONFIG_RUN);
  CHECK_INT_EQ(cfg.threads, 3);      /* flag > env > file */
  CHECK_INT_EQ(cfg.max_clients, 2);  /* env > file */
  CHECK_INT_EQ(cfg.max_inflight, 1); /* file > default */
  CHECK_INT_EQ(cfg.max_frame_bytes, 16777216);
  visit_t v = {0};
  zd__config_visit(&cfg, record, &v);
  CHECK_INT_EQ(v.count, NNAMES);
  check_setting(&v, "threads", "3", "flag");
  check_setting(&v, "max_clients", "2", "env");
  check_setting(&v, "max_inflight", "1", "file");
  check_setting(&v, "max_frame_bytes", "16777216", "default");
  check_setting(&v, "config", path, "env");
  zd__config_free(&cfg);

  /* --config beats ZEROD_CONFIG. */
  const char *other = write_file("threads = 9\n");
  CHECK_INT_EQ(zd__config_load(&cfg, ARGV("--config", (char *)other), env, &err), ZD__CONFIG_RUN);
  CHECK_INT_EQ(cfg.threads, 2); /* env still beats the file */
  CHECK_INT_EQ(cfg.max_clients, 2);
  CHECK_INT_EQ(cfg.max_inflight, 64); /* the env's file was not read */
  CHECK_STR_EQ(cfg.config_file, other);
  zd__config_free(&cfg);
}

/* Loads and expects failure with code; every needle must be in the message. */
static void expect_error(int argc, char **argv, char **envp, int code, ...) {
  zd__config_t cfg;
  zd__err_t err = {0};
  va_list ap;
  int rc = zd__config_load(&cfg, argc, argv, envp, &err);
  CHECK_MSG(rc == code, "expected %d, got %d (%s)", code, rc, err.msg);
  CHECK_INT_EQ(err.code, code);
  va_start(ap, code);
  for (const char *needle; (needle = va_arg(ap, const char *));) CHECK_CONTAINS(err.msg, needle);
  va_end(ap);
  /* A failed load leaves nothing to free, and freeing is still allowed. */
  CHECK(cfg.socket_path == NULL && cfg.backend == NULL && cfg.config_file == NULL);
  zd__config_free(&cfg);
}

static void test_errors(void) {
  char cfgvar[300];
  char *env[] = {cfgvar, NULL};
  const char *path;

  /* Unknown setting in a file, with file:line. */
  path = write_file("threads = 1\n# comment\n\nthreadz = 2\n");
  char where[300];
  snprintf(where, sizeof where, "%s:4", path);
  snprintf(cfgvar, sizeof cfgvar, "ZEROD_CONFIG=%s", path);
  expect_error(1, (char *[]){"zerod", NULL}, env, ZD_ECONFIG, where, "unknown setting 'threadz'",
               NULL);

  /* A rendezvous is builtin or an etcd URL. */
  expect_error(ARGV("--rendezvous", "redis://h:1"), no_env, ZD_ECONFIG, "rendezvous (flag)",
               "redis://h:1", "etcd://host:port", NULL);
  expect_error(ARGV("--rendezvous", "etcd:///job"), no_env, ZD_ECONFIG, "rendezvous", NULL);
  /* state_dir_mode = snapshot: needs state_dir and a period; the periods need the mode */
  expect_error(ARGV("--state_dir_mode", "snapshot", "--state_snapshot_every_steps", "100"), no_env,
               ZD_ECONFIG, "state_dir_mode = snapshot (flag) needs state_dir", NULL);
  expect_error(ARGV("--state_dir", "/dev/shm/x", "--state_dir_mode", "snapshot"), no_env,
               ZD_ECONFIG, "needs state_snapshot_every_steps > 0 or state_snapshot_every_s > 0",
               NULL);
  expect_error(ARGV("--state_dir", "/dev/shm/x", "--state_dir_mode", "mapped",
                    "--state_snapshot_every_s", "60"),
               no_env, ZD_ECONFIG, "state_snapshot_every_s=60", "state_dir_mode is mapped (flag)",
               NULL);
  expect_error(ARGV("--state_snapshot_every_steps", "100"), no_env, ZD_ECONFIG,
               "state_snapshot_every_steps=100", "need state_dir", NULL);
  expect_error(ARGV("--state_dir_mode", "copy"), no_env, ZD_ECONFIG,
               "state_dir_mode must be one of auto, mapped, snapshot", NULL);

  /* Bad values in a file name the line, the setting and the range. */
  path = write_file("local_ranks = 65\n");
  snprintf(where, sizeof where, "%s:1", path);
  expect_error(ARGV("--config", (char *)path), no_env, ZD_ECONFIG, where, "local_ranks=65",
               "local_ranks must be", "between 1 and 64", NULL);
  path = write_file("max_clients\n");
  expect_error(ARGV("--config", (char *)path), no_env, ZD_ECONFIG, "max_clients", "missing value",
               NULL);
  path = write_file("config = /etc/other.conf\n");
  expect_error(ARGV("--config", (char *)path), no_env, ZD_ECONFIG, ":1:", "--config", NULL);
  path = write_file("max_clients: 3\n");
  expect_error(ARGV("--config", (char *)path), no_env, ZD_ECONFIG, ":1:", "name = value", NULL);

  /* Missing config file. */
  expect_error(ARGV("--config=/nonexistent/zerod.conf"), no_env, -ENOENT, "/nonexistent/zerod.conf",
               "--config", "No such file", NULL);
  snprintf(cfgvar, sizeof cfgvar, "ZEROD_CONFIG=/nonexistent/z.conf");
  expect_error(1, (char *[]){"zerod", NULL}, env, -ENOENT, "/nonexistent/z.conf", "ZEROD_CONFIG",
               NULL);
  expect_error(ARGV("--config", tmpdir), no_env, -EISDIR, tmpdir, NULL);

  /* Unknown flags, positional arguments, missing values. */
  expect_error(ARGV("--bogus", "1"), no_env, ZD_ECONFIG, "unknown flag --bogus", NULL);
  expect_error(ARGV("--bogus=1"), no_env, ZD_ECONFIG, "unknown flag --bogus", NULL);
  expect_error(ARGV("-x"), no_env, ZD_ECONFIG, "unknown flag -x", NULL);
  expect_error(ARGV("extra"), no_env, ZD_ECONFIG, "unexpected argument 'extra'", NULL);
  expect_error(ARGV("--threads", "2", "extra"), no_env, ZD_ECONFIG, "'extra'", NULL);
  expect_error(ARGV("--threads"), no_env, ZD_ECONFIG, "--threads", "missing value", NULL);
  expect_error(ARGV("--socket", "--threads", "2"), no_env, ZD_ECONFIG, "--socket", "missing value",
               NULL);
  expect_error(ARGV("--config"), no_env, ZD_ECONFIG, "--config", "missing value", NULL);

  /* Bad numbers from each source: garbage, negative, overflow, out of range. */
  expect_error(1, (char *[]){"zerod", NULL}, (char *[]){"ZEROD_LOCAL_RANKS=0", NULL}, ZD_ECONFIG,
               "ZEROD_LOCAL_RANKS=0: local_ranks must be", "between 1 and 64", NULL);
  expect_error(ARGV("--threads=4x"), no_env, ZD_ECONFIG, "--threads=4x", "threads must be",
               "between 0 and 1024", NULL);
  expect_error(ARGV("--max-clients", "-1"), no_env, ZD_ECONFIG, "--max-clients", "max_clients",
               "between 1 and 4096", NULL);
  expect_error(ARGV("--max_clients=-1"), no_env, ZD_ECONFIG, "--max_clients=-1", "max_clients",
               NULL);
  expect_error(ARGV("--bucket-elems=99999999999999999999999"), no_env, ZD_ECONFIG, "bucket_elems",
               "between 0 and 1099511627776", NULL);
  expect_error(ARGV("--max_frame_bytes=4095"), no_env, ZD_ECONFIG, "max_frame_bytes",
               "between 4096 and 67108864", NULL);
  expect_error(ARGV("--max_frame_bytes="), no_env, ZD_ECONFIG, "max_frame_bytes", NULL);
  expect_error(ARGV("--threads", " 1"), no_env, ZD_ECONFIG, "threads", NULL);
  expect_error(ARGV("--collective_timeout_ms=99"), no_env, ZD_ECONFIG, "collective_timeout_ms",
               "between 100 and 86400000", NULL);
  expect_error(ARGV("--max_inflight=1025"), no_env, ZD_ECONFIG, "between 1 and 1024", NULL);
  expect_error(ARGV("--busy_poll_us=10001"), no_env, ZD_ECONFIG, "between 0 and 10000", NULL);

  /* Enums and modes. */
  expect_error(1, (char *[]){"zerod", NULL}, (char *[]){"ZEROD_BACKEND=gpu", NULL}, ZD_ECONFIG,
               "ZEROD_BACKEND=gpu", "backend must be one of auto, cpu, cuda", NULL);
  expect_error(ARGV("--kernel-isa", "sse"), no_env, ZD_ECONFIG, "kernel_isa",
               "auto, avx512bf16, avx512, avx2, scalar", NULL);
  expect_error(ARGV("--cuda-step", "slow"), no_env, ZD_ECONFIG, "cuda_step", "fast, legacy", NULL);
  expect_error(ARGV("--log_level=verbose"), no_env, ZD_ECONFIG, "log_level",
               "error, warn, info, debug", NULL);
  expect_error(ARGV("--socket-mode=0668"), no_env, ZD_ECONFIG, "--socket-mode=0668",
               "socket_mode must be an octal mode between 0000 and 0777", NULL);
  expect_error(ARGV("--socket-mode=01777"), no_env, ZD_ECONFIG, "socket_mode", "0777", NULL);

  /* ID lists. */
  expect_error(ARGV("--allowed-uids=0,no_such_user_zd"), no_env, ZD_ECONFIG, "allowed_uids",
               "no such user 'no_such_user_zd'", NULL);
  expect_error(ARGV("--allowed-gids=no_such_group_zd"), no_env, ZD_ECONFIG, "allowed_gids",
               "no such group", NULL);
  expect_error(ARGV("--allowed-uids=12x"), no_env, ZD_ECONFIG, "allowed_uids", "'12x'", NULL);
  expect_error(ARGV("--allowed-uids=4294967295"), no_env, ZD_ECONFIG, "allowed_uids", NULL);
  char many[200] = "0";
  for (int i = 1; i <= ZD__MAX_IDS; i++) snprintf(many + strlen(many), 8, ",%d", i);
  expect_error(ARGV("--allowed-uids", many), no_env, ZD_ECONFIG, "allowed_uids", "at most 32",
               NULL);
  expect_error(ARGV("--allowed-uids="), no_env, ZD_ECONFIG, "allowed_uids", "allowed_gids", NULL);

  /* Across settings. */
  expect_error(ARGV("--local-ranks=4", "--world-size=2"), no_env, ZD_ECONFIG, "world_size=2",
               "local_ranks=4", NULL);
  expect_error(ARGV("--local-ranks=4", "--world-size=8", "--first-rank=6"), no_env, ZD_ECONFIG,
               "first_rank=6", "local_ranks=4", "world_size=8", NULL);
  expect_error(ARGV("--first-rank=1"), no_env, ZD_ECONFIG, "first_rank=1", "world_size=1", NULL);
  /* ranks_per_gpu: at most local_ranks, and above 1 only for the whole world on one GPU. */
  expect_error(ARGV("--local-ranks=2", "--ranks-per-gpu=3"), no_env, ZD_ECONFIG,
               "ranks_per_gpu=3 (flag) is more than local_ranks=2", NULL);
  expect_error(ARGV("--ranks-per-gpu=0"), no_env, ZD_ECONFIG, "ranks_per_gpu", "between 1 and 64",
               NULL);
  expect_error(ARGV("--ranks-per-gpu=65"), no_env, ZD_ECONFIG, "ranks_per_gpu", "between 1 and 64",
               NULL);
  expect_error(ARGV("--local-ranks=2", "--world-size=4", "--ranks-per-gpu=2"), no_env, ZD_ECONFIG,
               "ranks_per_gpu > 1 needs the whole world in this zerod for now: world_size 4, "
               "local_ranks 2",
               NULL);
  expect_error(ARGV("--local-ranks=4", "--ranks-per-gpu=2"), no_env, ZD_ECONFIG,
               "ranks_per_gpu=2 (flag) with local_ranks=4",
               "needs every local rank on one GPU for now", NULL);
  expect_error(ARGV("--control-address="), no_env, ZD_ECONFIG, "control_address", NULL);
  char longpath[200];
  memset(longpath, 'a', sizeof longpath - 1);
  longpath[sizeof longpath - 1] = '\0';
  expect_error(ARGV("--socket", longpath), no_env, ZD_ECONFIG, "socket", "at most 107", NULL);

  /* The world checks pass at the edges. */
  zd__config_t cfg;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__config_load(&cfg, ARGV("--local-ranks=4", "--world-size=8", "--first-rank=4"),
                               no_env, &err),
               ZD__CONFIG_RUN);
  CHECK_U64_EQ(cfg.bucket_elems, 40000000ull);
  zd__config_free(&cfg);
  /* The supported sharing: the whole world in this daemon, on one GPU (4 ranks by env). */
  char *rpg_env[] = {"ZEROD_RANKS_PER_GPU=4", NULL};
  CHECK_INT_EQ(zd__config_load(&cfg, ARGV("--local-ranks=4", "--world-size=4"), rpg_env, &err),
               ZD__CONFIG_RUN);
  CHECK_INT_EQ(cfg.ranks_per_gpu, 4);
  CHECK_INT_EQ(cfg.world_size, 4);
  zd__config_free(&cfg);
  CHECK_INT_EQ(zd__config_load(&cfg, ARGV("--world-size=64"), no_env, &err), ZD__CONFIG_RUN);
  CHECK_U64_EQ(cfg.bucket_elems, 64000000ull);
  zd__config_free(&cfg);
}

static void test_help(void) {
  char *buf = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&buf, &len);
  CHECK(out);
  zd__config_print_help(out);
  fclose(out);
  CHECK_CONTAINS(buf, "Usage: zerod [--config FILE] [--NAME VALUE]...");
  for (int i = 0; i < NNAMES; i++) {
    char flag[64], var[64];
    snprintf(flag, sizeof flag, "--%s ", all_names[i]);
    snprintf(var, sizeof var, "ZEROD_");
    for (const char *c = all_names[i]; *c; c++) {
      size_t n = strlen(var);
      var[n] = (char)(*c >= 'a' && *c <= 'z' ? *c - 32 : *c);
      var[n + 1] = '\0';
    }
    CHECK_CONTAINS(buf, flag);
    CHECK_CONTAINS(buf, var);
  }
  CHECK_CONTAINS(buf, "default 16777216; 4096..67108864");
  CHECK_CONTAINS(buf, "auto|cpu|cuda");
  CHECK_CONTAINS(buf, "default 0660");
  CHECK_CONTAINS(buf, "Local protocol:");
  CHECK_CONTAINS(buf, "World:");
  free(buf);
}

/* Runs fn with stderr redirected into a pipe and returns what it wrote (static buffer). */
static const char *capture_stderr(void (*fn)(void)) {
  static char buf[16384];
  int fds[2], saved = dup(STDERR_FILENO);
  CHECK(saved >= 0 && pipe(fds) == 0);
  CHECK(dup2(fds[1], STDERR_FILENO) >= 0);
  close(fds[1]);
  fn();
  CHECK(dup2(saved, STDERR_FILENO) >= 0);
  close(saved);
  size_t len = 0;
  ssize_t n;
  while ((n = read(fds[0], buf + len, sizeof buf - 1 - len)) > 0) len += (size_t)n;
  close(fds[0]);
  buf[len] = '\0';
  return buf;
}

static int evaluated;
static int side_effect(void) {
  return ++evaluated;
}

static void log_lines(void) {
  zd__log_write(ZD__LOG_INFO, "registered model: %d params, %s", 12, "1 bucket\n");
  zd__log_set_rank(3);
  ZD_LOG_WARN("rank %d slow", 3);
  ZD_LOG_DEBUG("never %d", side_effect()); /* below the level: arguments not evaluated */
  zd__log_set_rank(-1);
}

static char long_msg[10000];
static void log_long(void) {
  zd__log_write(ZD__LOG_ERROR, "%s", long_msg);
}

/* Checks "YYYY-MM-DDTHH:MM:SS.uuuuuuZ zerod[PID] rank=R LEVEL " at line and returns the rest. */
static const char *check_prefix(const char *line, const char *rank, const char *level) {
  const char *shape = "dddd-dd-ddTdd:dd:dd.ddddddZ ";
  for (size_t i = 0; shape[i]; i++) {
    if (shape[i] == 'd')
      CHECK_MSG(line[i] >= '0' && line[i] <= '9', "bad timestamp in %s", line);
    else
      CHECK_MSG(line[i] == shape[i], "bad timestamp in %s", line);
  }
  char expect[128];
  snprintf(expect, sizeof expect, "zerod[%d] rank=%s %s ", (int)getpid(), rank, level);
  const char *rest = line + strlen(shape);
  CHECK_MSG(!strncmp(rest, expect, strlen(expect)), "expected '%s' in %s", expect, line);
  return rest + strlen(expect);
}

static void test_log(void) {
  CHECK_INT_EQ(zd__log_level, ZD__LOG_INFO);
  CHECK_INT_EQ(zd__log_parse_level("error"), ZD__LOG_ERROR);
  CHECK_INT_EQ(zd__log_parse_level("warn"), ZD__LOG_WARN);
  CHECK_INT_EQ(zd__log_parse_level("info"), ZD__LOG_INFO);
  CHECK_INT_EQ(zd__log_parse_level("debug"), ZD__LOG_DEBUG);
  CHECK_INT_EQ(zd__log_parse_level("verbose"), -1);
  CHECK_INT_EQ(zd__log_parse_level(""), -1);
  CHECK_INT_EQ(zd__log_parse_level(NULL), -1);

  const char *out = capture_stderr(log_lines);
  const char *rest = check_prefix(out, "-", "INFO");
  const char *nl = strchr(rest, '\n');
  CHECK(nl);
  CHECK_INT_EQ(nl - rest, (long long)strlen("registered model: 12 params, 1 bucket"));
  CHECK(!strncmp(rest, "registered model: 12 params, 1 bucket\n", (size_t)(nl - rest + 1)));
  rest = check_prefix(nl + 1, "3", "WARN");
  CHECK(!strcmp(rest, "rank 3 slow\n"));
  CHECK_INT_EQ(evaluated, 0);

  memset(long_msg, 'x', sizeof long_msg - 1);
  out = capture_stderr(log_long);
  size_t len = strlen(out);
  CHECK_INT_LE(len, 4096);
  CHECK_INT_GE(len, 4000);
  check_prefix(out, "-", "ERROR");
  CHECK(!strcmp(out + len - 5, "x...\n"));
  CHECK(strchr(out, '\n') == out + len - 1);

  /* A panic logs file:line and aborts. */
  int fds[2];
  CHECK(pipe(fds) == 0);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    struct rlimit no_core = {0, 0};
    setrlimit(RLIMIT_CORE, &no_core); /* an expected abort needs no core dump */
    dup2(fds[1], STDERR_FILENO);
    signal(SIGABRT, SIG_DFL);
    zd_panic("broken %s", "invariant");
  }
  close(fds[1]);
  char buf[1024];
  ssize_t n, got = 0;
  while ((n = read(fds[0], buf + got, sizeof buf - 1 - (size_t)got)) > 0) got += n;
  close(fds[0]);
  buf[got] = '\0';
  int status;
  CHECK(waitpid(pid, &status, 0) == pid);
  CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
  CHECK_CONTAINS(buf, " ERROR PANIC ");
  CHECK_CONTAINS(buf, "test_config.c:");
  CHECK_CONTAINS(buf, ": broken invariant\n");
}

int main(void) {
  CHECK(mkdtemp(tmpdir));
  test_defaults();
  test_file();
  test_env_and_flags();
  test_precedence();
  test_errors();
  test_help();
  test_log();
  for (int i = 0; i < npaths; i++) CHECK_INT_EQ(unlink(paths[i]), 0);
  CHECK_INT_EQ(rmdir(tmpdir), 0);
  printf("test_config: ok\n");
  return 0;
}
