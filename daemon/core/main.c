/* zerod's entry point: configuration, logging, the daemon's lifetime, exit status.
 * Exit status: 0 after a clean shutdown, 1 when the daemon failed, 2 for a configuration error. */
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include "adam.h"
#include "config.h"
#include "daemon.h"
#include "log.h"

static void log_setting(void *ctx, const char *name, const char *value, const char *source) {
  (void)ctx;
  ZD_LOG_INFO("config %s = %s (%s)", name, value, source);
}

int main(int argc, char **argv) {
  zd__config_t cfg = {0};
  zd__err_t err = {0};
  int rc = zd__config_load(&cfg, argc, argv, NULL, &err);
  if (rc == ZD__CONFIG_HELP) {
    zd__config_print_help(stdout);
    return 0;
  }
  if (rc == ZD__CONFIG_HELP_MARKDOWN) {
    zd__config_print_markdown(stdout);
    return 0;
  }
  if (rc == ZD__CONFIG_VERSION) {
#ifdef ZD_HAVE_CUDA
    const char *backends = "cpu, cuda";
#else
    const char *backends = "cpu";
#endif
    printf("zerod %s (local protocol %d; backends: %s; kernels: %s)\n", ZD_VERSION,
           ZD_PROTOCOL_VERSION, backends, zd__isa_name(zd__isa_detect()));
    return 0;
  }
  if (rc < 0) {
    fprintf(stderr, "zerod: %s\n", err.msg);
    return 2;
  }
  zd__log_level = zd__log_parse_level(cfg.log_level);
  signal(SIGPIPE, SIG_IGN);
  signal(SIGHUP, SIG_IGN); /* until the loop handles it: a daemon starting up must not die of it */
  /* A checkpoint write past RLIMIT_FSIZE must fail with EFBIG (the checkpoint fails, training
   * goes on), not kill the process that holds the only copy of the optimizer state. */
  signal(SIGXFSZ, SIG_IGN);
  ZD_LOG_INFO("zerod %s starting (pid %d)", ZD_VERSION, (int)getpid());
  zd__config_visit(&cfg, log_setting, NULL);

  zd__daemon_t *d;
  rc = zd__daemon_create(&cfg, &d, &err);
  if (rc) {
    ZD_LOG_ERROR("cannot start: %s", err.msg);
    zd__config_free(&cfg);
    return 1;
  }
  rc = zd__daemon_run(d);
  zd__daemon_destroy(d);
  zd__config_free(&cfg);
  if (rc) return 1;
  ZD_LOG_INFO("shut down cleanly");
  return 0;
}
