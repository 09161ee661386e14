/* bench_state_dir: what state_dir costs a step: the out-of-place update into the other set of the
 * state file and the commit's header write, next to today's in-place step.
 *
 * Three zerods (world size 1, AdamW, f32, the same --threads): off (today's in-place step), ovl
 * (overlap_update = 1: two sets in anonymous memory, every update out of place; the trainer
 * scatters in its step, so nothing is speculated) and on (state_dir, a fresh directory under
 * --dir, tmpfs: /dev/shm by default: the two sets in the mapped file, out of place, and the
 * header write). For each size a model of that many parameters (one tensor) is registered with
 * each, and zd_step() round trips of the three go in turn (rotating who goes first), so that all
 * see the same machine; each row gives medians of --iters steps after 3 warm-up, as the client
 * sees them (off_ms, ovl_ms, on_ms) and as the daemon reports them (the reply's duration_us:
 * off_d, ovl_d, on_d), and on_d / off_d - 1 and on_d / ovl_d - 1: what state_dir costs, and what
 * of it is the mapping and the commit rather than out-of-place writing. The target: at most
 * 2% from 2^23 parameters (the same memory traffic: the in-place update reads and writes each array
 * once, the out-of-place one reads one set and writes the other).
 *
 * --kernel 1 prints a second table instead: the update kernel alone (zd__optim_impl, this CPU's
 * best ISA, AdamW f32 with f32 working parameters written, as zerod's step at world size 1), on
 * arrays placed as the CPU backend places them, in place and out of place (reading one set,
 * writing the other with streaming stores, the sets alternating as commits would), the two in
 * turn, on one thread and on --threads threads (0: one per CPU): what the out-of-place step
 * costs without zerod, its socket, its commit or a file.
 *
 *   bench_state_dir [--zerod PATH] [--dir /dev/shm] [--min-log2 20] [--max-log2 23] [--iters 15]
 *                   [--threads N] [--kernel 0|1]
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"
#include "mempass.h"
#include "optim.h"
#include "placement.h"
#include "zerod/zerod.h"

static void usage(void) {
  fprintf(stderr,
          "usage: bench_state_dir [--zerod PATH] [--dir DIR] [--min-log2 N] [--max-log2 N]"
          " [--iters N] [--threads N] [--kernel 0|1]\n");
  exit(2);
}

static uint64_t rng = 0x2545f4914f6cdd1dull;
static float rnd_unit(void) { /* xorshift64, uniform in [-1, 1): data like a model's */
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (float)((double)(rng >> 40) / (double)(1 << 23) - 1.0);
}

static zd_client_t *attach(const zdt_daemon_t *d, uint64_t n) {
  zd_client_t *c;
  if (zd_connect(d->socket, ZD_ANY_RANK, 0, &c) != ZD_OK) {
    fprintf(stderr, "bench_state_dir: connect: %s\n", zd_last_error());
    exit(1);
  }
  zd_param_t p = {.name = "weights", .ndim = 1, .shape = {n}, .group = 0};
  zd_group_t g;
  zd_group_init(&g, 1, sizeof g);
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = &p;
  desc.nparams = 1;
  desc.groups = &g;
  desc.ngroups = 1;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  desc.flags = ZD_REGISTER_REPLACE;
  if (zd_layout(c, &desc) != ZD_OK) {
    fprintf(stderr, "bench_state_dir: layout: %s\n", zd_last_error());
    exit(1);
  }
  float *params = zd_param_buffer(c, NULL), *grads = zd_grad_buffer(c, NULL);
  for (uint64_t i = 0; i < n; i++) params[i] = rnd_unit();
  if (zd_register(c) != ZD_OK) {
    fprintf(stderr, "bench_state_dir: register %llu params: %s\n", (unsigned long long)n,
            zd_last_error());
    exit(1);
  }
  for (uint64_t i = 0; i < n; i++) grads[i] = rnd_unit() * 1e-2f;
  return c;
}

static double step_seconds(zd_client_t *c, double *daemon_s) {
  zd_step_result_t r = ZD_STEP_RESULT_INIT;
  double t0 = zd_bench_now();
  if (zd_step(c, NULL, &r) != ZD_OK) {
    fprintf(stderr, "bench_state_dir: step: %s\n", zd_last_error());
    exit(1);
  }
  *daemon_s = (double)r.duration_us * 1e-6;
  return zd_bench_now() - t0;
}

/* ---- --kernel: the update alone ------------------------------------------------------------ */

typedef struct kpart {
  const zd__adam_args_t *args;
  zd__adam_fn fn;
  uint64_t begin, end;
} kpart_t;

static void *kpart_run(void *arg) {
  const kpart_t *p = arg;
  p->fn(p->args, p->begin, p->end);
  return NULL;
}

/* One update of n elements split over nth threads (the first on the calling thread). */
static double kernel_step(const zd__adam_args_t *a, zd__adam_fn fn, uint64_t n, unsigned nth) {
  kpart_t part[64];
  pthread_t th[64];
  double t0 = zd_bench_now();
  for (unsigned k = 0; k < nth; k++) {
    part[k] = (kpart_t){.args = a, .fn = fn, .begin = n * k / nth, .end = n * (k + 1) / nth};
    if (k && pthread_create(&th[k], NULL, kpart_run, &part[k])) {
      fprintf(stderr, "bench_state_dir: pthread_create failed\n");
      exit(1);
    }
  }
  kpart_run(&part[0]);
  for (unsigned k = 1; k < nth; k++) pthread_join(th[k], NULL);
  return zd_bench_now() - t0;
}

static float *kernel_array(uint64_t n, unsigned colour) {
  void *p;
  if (zd__place_anon((size_t)n * sizeof(float), colour, &p)) {
    fprintf(stderr, "bench_state_dir: cannot map %llu floats\n", (unsigned long long)n);
    exit(1);
  }
  return p;
}

static int kernel_table(int min_log2, int max_log2, int iters, unsigned threads) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  unsigned nth = threads ? threads : cpus > 0 ? (unsigned)cpus : 1;
  if (nth > 64) nth = 64;
  zd__isa_t isa = zd__isa_detect();
  zd__adam_fn fn = zd__optim_impl(isa);
  zd_group_t g;
  zd_group_init(&g, 1, sizeof g);
  zd__adam_group_t consts;
  zd__adam_group_init(&consts, &g, 1);
  printf(
      "# bench_state_dir --kernel: the update alone (%s), AdamW f32, f32 params written; "
      "medians of %d updates after 3 warm-up, in place and out of place in turn\n#\n",
      zd__isa_name(isa), iters);
  printf("# %10s %7s %9s %9s %8s\n", "params", "threads", "inpl_ms", "oop_ms", "oop/inpl");
  double *t[2];
  for (int k = 0; k < 2; k++) t[k] = calloc((size_t)iters, sizeof(double));
  for (int lg = min_log2; lg <= max_log2; lg++) {
    uint64_t n = 1ull << lg;
    /* the CPU backend's colours (compute_cpu.c): the first set, then overlap_update's second */
    static const zd__state_t roles[3] = {ZD__STATE_MASTER, ZD__STATE_EXP_AVG, ZD__STATE_EXP_AVG_SQ};
    static const unsigned colours[2][3] = {
        {ZD__COLOUR_STATE, ZD__COLOUR_STATE + 1, ZD__COLOUR_STATE + 2},
        {ZD__COLOUR_STATE + 3, ZD__COLOUR_STATE_MAX, ZD__COLOUR_STATE_SPARE}};
    float *set[2][3], *grad = kernel_array(n, ZD__COLOUR_GRADS),
                      *param = kernel_array(n, ZD__COLOUR_PARAMS);
    for (int k = 0; k < 2; k++)
      for (int i = 0; i < 3; i++) set[k][i] = kernel_array(n, colours[k][i]);
    for (uint64_t i = 0; i < n; i++) {
      grad[i] = rnd_unit() * 1e-2f;
      param[i] = set[0][0][i] = set[1][0][i] = rnd_unit();
      set[0][1][i] = set[0][2][i] = set[1][1][i] = set[1][2][i] = 0;
    }
    zd__segment_t seg = {.offset = 0, .length = n, .group = 0};
    unsigned counts[2] = {1, nth};
    for (int c = 0; c < (nth > 1 ? 2 : 1); c++) {
      int cur = 0; /* the out-of-place run's committed set */
      for (int it = 0; it < 3 + iters; it++) {
        for (int j = 0; j < 2; j++) {
          int mode = (it + j) % 2; /* 0: in place (set 0), 1: out of place */
          zd__adam_args_t a = {.grad = grad,
                               .grad_dtype = ZD_F32,
                               .param = param,
                               .param_dtype = ZD_F32,
                               .grad_scale = 1.0f,
                               .segs = &seg,
                               .nsegs = 1,
                               .groups = &consts};
          for (int i = 0; i < 3; i++) {
            a.state[roles[i]] = set[mode ? cur ^ 1 : 0][i];
            if (mode) a.src[roles[i]] = set[cur][i];
          }
          double s = kernel_step(&a, fn, n, counts[c]);
          if (mode) cur ^= 1;
          if (it >= 3) t[mode][it - 3] = s;
        }
      }
      double m0 = zd_bench_median(t[0], iters), m1 = zd_bench_median(t[1], iters);
      printf("  %10llu %7u %9.3f %9.3f %7.1f%%\n", (unsigned long long)n, counts[c], m0 * 1e3,
             m1 * 1e3, 100.0 * (m1 / m0 - 1.0));
      fflush(stdout);
    }
    zd__place_release(grad, (size_t)n * sizeof(float));
    zd__place_release(param, (size_t)n * sizeof(float));
    for (int k = 0; k < 2; k++)
      for (int i = 0; i < 3; i++) zd__place_release(set[k][i], (size_t)n * sizeof(float));
  }
  for (int k = 0; k < 2; k++) free(t[k]);
  return 0;
}

int main(int argc, char **argv) {
  int min_log2 = 20, max_log2 = 23, iters = 15, kernel = 0;
  unsigned threads = 0;
  const char *zerod = getenv("ZEROD_BIN") ? getenv("ZEROD_BIN") : "build/daemon/zerod";
  const char *root = "/dev/shm";
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) usage();
    const char *o = argv[i], *v = argv[i + 1];
    if (!strcmp(o, "--zerod"))
      zerod = v;
    else if (!strcmp(o, "--dir"))
      root = v;
    else if (!strcmp(o, "--min-log2"))
      min_log2 = atoi(v);
    else if (!strcmp(o, "--max-log2"))
      max_log2 = atoi(v);
    else if (!strcmp(o, "--iters"))
      iters = atoi(v);
    else if (!strcmp(o, "--threads"))
      threads = (unsigned)atoi(v);
    else if (!strcmp(o, "--kernel"))
      kernel = atoi(v);
    else
      usage();
  }
  if (min_log2 < 10 || max_log2 > 30 || min_log2 > max_log2 || iters < 1) usage();
  if (kernel) return kernel_table(min_log2, max_log2, iters, threads);
  setenv("ZEROD_BIN", zerod, 1);
  char dir[512], state_dir[600], threads_arg[16];
  snprintf(dir, sizeof dir, "%s/bench_state_dir-XXXXXX", root);
  if (!mkdtemp(dir)) {
    perror("bench_state_dir: mkdtemp");
    return 1;
  }
  snprintf(state_dir, sizeof state_dir, "%s/state", dir);
  snprintf(threads_arg, sizeof threads_arg, "%u", threads);
  zdt_daemon_t dm[3];
  const char *args_off[] = {"--threads", threads_arg, "--log_level", "warn", NULL};
  const char *args_ovl[] = {"--threads",        threads_arg, "--log_level", "warn",
                            "--overlap_update", "1",         NULL};
  const char *args_on[] = {"--threads",   threads_arg, "--log_level", "warn",
                           "--state_dir", state_dir,   NULL};
  zdt_start(&dm[0], args_off);
  zdt_start(&dm[1], args_ovl);
  zdt_start(&dm[2], args_on);
  printf(
      "# bench_state_dir: zd_step() round trips, AdamW f32, world size 1, threads %s "
      "(0: one per CPU); state_dir under %s\n# medians of %d steps after 3 warm-up, the three "
      "zerods in turn\n#\n",
      threads_arg, root, iters);
  printf("# %10s %8s %8s %8s %8s %8s %8s %8s %8s\n", "params", "off_ms", "ovl_ms", "on_ms", "off_d",
         "ovl_d", "on_d", "on/off", "on/ovl");
  double *t[6];
  for (int k = 0; k < 6; k++) t[k] = calloc((size_t)iters, sizeof(double));
  for (int lg = min_log2; lg <= max_log2; lg++) {
    uint64_t n = 1ull << lg;
    zd_client_t *c[3];
    for (int k = 0; k < 3; k++) c[k] = attach(&dm[k], n);
    for (int it = 0; it < 3 + iters; it++) {
      double s[3], d[3];
      for (int j = 0; j < 3; j++) {
        int k = (it + j) % 3;
        zd_bench_settle();
        s[k] = step_seconds(c[k], &d[k]);
      }
      if (it < 3) continue;
      for (int k = 0; k < 3; k++) {
        t[k][it - 3] = s[k];
        t[3 + k][it - 3] = d[k];
      }
    }
    double m[6];
    for (int k = 0; k < 6; k++) m[k] = zd_bench_median(t[k], iters);
    printf("  %10llu %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f %7.1f%% %7.1f%%\n", (unsigned long long)n,
           m[0] * 1e3, m[1] * 1e3, m[2] * 1e3, m[3] * 1e3, m[4] * 1e3, m[5] * 1e3,
           100.0 * (m[5] / m[3] - 1.0), 100.0 * (m[5] / m[4] - 1.0));
    fflush(stdout);
    for (int k = 0; k < 3; k++) zd_close(c[k]);
  }
  for (int k = 0; k < 6; k++) free(t[k]);
  for (int k = 3; k-- > 0;) zdt_stop(&dm[k], SIGTERM, 0);
  char cmd[700];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "bench_state_dir: could not remove %s\n", dir);
  return 0;
}
