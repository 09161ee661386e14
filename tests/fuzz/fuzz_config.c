/* libFuzzer harness of zerod's configuration loader (daemon/base/config.c): the config file and
 * the command-line flags, the two sources an operator writes by hand.
 *
 * The input up to its first NUL byte is the config file (in a memfd, passed as --config); the rest,
 * split at NUL bytes, are further command-line arguments. The environment is empty. An argument
 * naming "config" is dropped: a second --config could point the loader at /dev/zero or a pipe.
 * A load either fails with a code and a message, or yields a configuration whose cross-setting
 * rules hold (config.h).
 */
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "config.h"
#include "fuzz.h"

#define MAX_ARGS 64

static void visit(void *ctx, const char *name, const char *value, const char *source) {
  (void)ctx;
  FUZZ_CHECK(name && value && source, "a setting without a name, value or source");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int fd = -1;
  static char path[64];
  if (fd < 0) {
    fd = memfd_create("zerod-fuzz.conf", MFD_CLOEXEC);
    FUZZ_CHECK(fd >= 0, "memfd_create failed");
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  }
  const uint8_t *nul = memchr(data, 0, size);
  size_t file_len = nul ? (size_t)(nul - data) : size;
  FUZZ_CHECK(ftruncate(fd, 0) == 0, "ftruncate failed");
  FUZZ_CHECK(pwrite(fd, data, file_len, 0) == (ssize_t)file_len, "pwrite failed");

  /* The arguments, each in its own allocation of its exact size (ASan sees a read past one). */
  char *argv[MAX_ARGS + 1] = {"zerod", "--config", path};
  int argc = 3;
  size_t pos = nul ? file_len + 1 : size;
  while (pos < size && argc < MAX_ARGS) {
    const uint8_t *end = memchr(data + pos, 0, size - pos);
    size_t len = end ? (size_t)(end - (data + pos)) : size - pos;
    char *arg = strndup((const char *)data + pos, len);
    FUZZ_CHECK(arg, "out of memory");
    if (strstr(arg, "config"))
      free(arg);
    else
      argv[argc++] = arg;
    pos += len + 1;
  }
  argv[argc] = NULL;

  char *envp[] = {NULL};
  zd__config_t cfg;
  zd__err_t err = {0};
  int rc = zd__config_load(&cfg, argc, argv, envp, &err);
  if (rc < 0) {
    FUZZ_CHECK(err.code == rc && err.msg[0], "error %d without a message", rc);
  } else if (rc == ZD__CONFIG_RUN) {
    FUZZ_CHECK(cfg.socket_path && cfg.socket_path[0], "no socket path");
    FUZZ_CHECK(cfg.world_size >= cfg.local_ranks &&
                   (uint64_t)cfg.first_rank + cfg.local_ranks <= cfg.world_size,
               "ranks %u..+%u outside world_size %u", cfg.first_rank, cfg.local_ranks,
               cfg.world_size);
    FUZZ_CHECK(cfg.bucket_elems > 0, "bucket_elems left 0");
    FUZZ_CHECK(cfg.rendezvous_address && cfg.rendezvous_address[0], "no rendezvous address");
    FUZZ_CHECK(cfg.allowed_uids.n || cfg.allowed_gids.n, "nobody may connect");
    zd__config_visit(&cfg, visit, NULL);
  }
  zd__config_free(&cfg);
  for (int i = 3; i < argc; i++) free(argv[i]);
  return 0;
}
