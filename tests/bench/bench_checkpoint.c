/* bench_checkpoint: what a checkpoint costs a training step, and how fast it reaches the disk.
 *
 * A checkpoint must not hold the step while its files are written: the step it is taken at pays
 * only the snapshot of the shard (master, exp_avg, exp_avg_sq into host memory) and the files are
 * written by a background thread. For each size N this program starts a real zerod (world size
 * 1, CPU backend, checkpoint_every_steps K, checkpoint_keep 1) with a checkpoint_dir of its own
 * under --dir, registers a model of N fp32 parameters and measures, per repetition, in one run:
 *
 *   stall  the client-observed time of the step that takes a checkpoint minus the median plain
 *          step's (and the same difference of zerod's own step durations, duration_us), next to
 *          the daemon's own snapshot time (status section "checkpoint", key last_snapshot_us)
 *          and a plain memcpy of the same 3*N*4 bytes in this process;
 *   write  the checkpoint's bytes (status last_bytes) over the time from that step's return until
 *          its manifest.json exists, next to this program's own sequential write + fsync of as
 *          many bytes in 8 MiB chunks to a file in the same directory, before or after it in
 *          alternate repetitions.
 *
 * Each size first takes one checkpoint that is not timed (zerod's snapshot buffer and the files
 * are fresh then), and every timed step starts with no write in flight. Medians of --reps.
 *
 *   bench_checkpoint [--zerod PATH] [--dir DIR] [--log2 20,23,25] [--reps 5] [--every 4]
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "mempass.h"
#include "zerod/zerod.h"

#define MAX_SIZES   8
#define WRITE_CHUNK (8u << 20)

static void usage(void) {
  fprintf(stderr,
          "usage: bench_checkpoint [--zerod PATH] [--dir DIR] [--log2 20,23,25] "
          "[--reps N] [--every K]\n");
  exit(2);
}

static void die(const char *what) {
  fprintf(stderr, "bench_checkpoint: %s: %s\n", what, zd_last_error());
  exit(1);
}

static zd_client_t *attach(const zdt_daemon_t *d, uint64_t n) {
  zd_client_t *c;
  if (zd_connect(d->socket, ZD_ANY_RANK, 0, &c) != ZD_OK) die("connect");
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
  if (zd_layout(c, &desc) != ZD_OK || zd_register(c) != ZD_OK) die("register");
  float *grad = zd_grad_buffer(c, NULL), *param = zd_param_buffer(c, NULL);
  for (uint64_t i = 0; i < n; i++) {
    grad[i] = (float)((int)(i % 2001) - 1000) * 1e-5f;
    param[i] = (float)(i % 97) * 1e-3f;
  }
  return c;
}

/* One step; its client-observed seconds, the step count after it in *step and zerod's own time
 * for it (zd_step_result_t.duration_us, the snapshot included) in *daemon_s. */
static double timed_step(zd_client_t *c, uint64_t *step, double *daemon_s) {
  zd_step_result_t r = ZD_STEP_RESULT_INIT;
  double t0 = zd_bench_now();
  if (zd_step(c, NULL, &r) != ZD_OK) die("step");
  double t = zd_bench_now() - t0;
  *step = r.step;
  *daemon_s = (double)r.duration_us * 1e-6;
  return t;
}

/* A key of status section "checkpoint", as a number (0 when absent). */
static uint64_t ckpt_status(zd_client_t *c, const char *key) {
  char *text = NULL;
  if (zd_status(c, &text) != ZD_OK) die("status");
  const char *sec = strstr(text, "# checkpoint");
  uint64_t v = 0;
  if (sec) {
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\n%s:", key);
    const char *k = strstr(sec, pattern);
    const char *next = strstr(sec + 1, "\n#");
    if (k && (!next || k < next)) v = strtoull(k + strlen(pattern), NULL, 10);
  }
  zd_free(text);
  return v;
}

static void sleep_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

/* Seconds until dir/step-<step>/manifest.json exists (polled every 100 us, at most 120 s). */
static double wait_manifest(const char *dir, uint64_t step, double since) {
  char path[1200]; /* dir: at most 1100 bytes */
  snprintf(path, sizeof path, "%s/step-%012" PRIu64 "/manifest.json", dir, step);
  struct stat st;
  while (stat(path, &st) != 0) {
    if (zd_bench_now() - since > 120) {
      fprintf(stderr, "bench_checkpoint: %s did not appear within 120 s\n", path);
      exit(1);
    }
    sleep_us(100);
  }
  return zd_bench_now() - since;
}

/* Waits until the daemon counts `completed` checkpoints (retention done) and none in flight. */
static void wait_idle(zd_client_t *c, uint64_t completed) {
  double t0 = zd_bench_now();
  while (ckpt_status(c, "completed") < completed || ckpt_status(c, "in_progress") != 0) {
    if (ckpt_status(c, "failures") != 0 || zd_bench_now() - t0 > 120) {
      fprintf(stderr, "bench_checkpoint: a checkpoint failed or did not finish\n");
      exit(1);
    }
    sleep_us(1000);
  }
}

/* This process's own sequential write + fsync of bytes from buf into a file in dir; seconds. */
static double plain_write(const char *dir, const char *buf, uint64_t bytes) {
  char path[1200];
  snprintf(path, sizeof path, "%s/bench-plain-write.tmp", dir);
  double t0 = zd_bench_now();
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    fprintf(stderr, "bench_checkpoint: %s: %s\n", path, strerror(errno));
    exit(1);
  }
  for (uint64_t done = 0; done < bytes;) {
    size_t n = bytes - done < WRITE_CHUNK ? (size_t)(bytes - done) : WRITE_CHUNK;
    ssize_t w = write(fd, buf + done, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      fprintf(stderr, "bench_checkpoint: write %s: %s\n", path, strerror(errno));
      exit(1);
    }
    done += (uint64_t)w;
  }
  if (fsync(fd) != 0 || close(fd) != 0) {
    fprintf(stderr, "bench_checkpoint: fsync %s: %s\n", path, strerror(errno));
    exit(1);
  }
  double t = zd_bench_now() - t0;
  unlink(path);
  return t;
}

static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *ftw) {
  (void)st, (void)type, (void)ftw;
  return remove(path) != 0 && errno != ENOENT ? -1 : 0;
}

static int parse_sizes(const char *s, int *out) {
  int n = 0;
  for (const char *p = s; *p && n < MAX_SIZES;) {
    char *end;
    long v = strtol(p, &end, 10);
    if (end == p || v < 10 || v > 30) return 0;
    out[n++] = (int)v;
    p = *end == ',' ? end + 1 : end;
    if (*end && *end != ',') return 0;
  }
  return n;
}

int main(int argc, char **argv) {
  int sizes[MAX_SIZES], nsizes = parse_sizes("20,23,25", sizes), reps = 5, every = 4;
  const char *zerod = getenv("ZEROD_BIN") ? getenv("ZEROD_BIN") : "build/daemon/zerod";
  const char *dir_arg = NULL;
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) usage();
    const char *o = argv[i], *v = argv[i + 1];
    if (!strcmp(o, "--zerod"))
      zerod = v;
    else if (!strcmp(o, "--dir"))
      dir_arg = v;
    else if (!strcmp(o, "--log2"))
      nsizes = parse_sizes(v, sizes);
    else if (!strcmp(o, "--reps"))
      reps = atoi(v);
    else if (!strcmp(o, "--every"))
      every = atoi(v);
    else
      usage();
  }
  if (nsizes < 1 || reps < 1 || every < 2) usage();
  setenv("ZEROD_BIN", zerod, 1);

  /* The checkpoints go to a fresh directory of their own, under --dir or /tmp. */
  char root[1024];
  if (dir_arg && strlen(dir_arg) > sizeof root - 32) usage();
  snprintf(root, sizeof root, "%s/bench-checkpoint-XXXXXX", dir_arg ? dir_arg : "/tmp");
  if (!mkdtemp(root)) {
    fprintf(stderr, "bench_checkpoint: mkdtemp %s: %s\n", root, strerror(errno));
    return 1;
  }
  char every_arg[16], dir[1100];
  snprintf(every_arg, sizeof every_arg, "%d", every);
  const char *args[] = {"--checkpoint-dir",
                        dir,
                        "--checkpoint-every-steps",
                        every_arg,
                        "--checkpoint-keep",
                        "1",
                        "--log_level",
                        "warn",
                        NULL};

  int max_log2 = 0;
  for (int i = 0; i < nsizes; i++) max_log2 = sizes[i] > max_log2 ? sizes[i] : max_log2;
  uint64_t max_bytes = 3ull * 4ull << max_log2;
  /* src also feeds the plain write, which writes as many bytes as a checkpoint file: the arrays
   * and the safetensors header. */
  uint64_t src_bytes = max_bytes + (1u << 20);
  char *src = zd_bench_alloc(src_bytes, -1), *dst = zd_bench_alloc(max_bytes, -1);
  for (uint64_t i = 0; i < src_bytes; i++) src[i] = (char)(i * 131 + (i >> 12));
  memset(dst, 0, max_bytes);

  printf(
      "# bench_checkpoint: checkpoints of an f32 AdamW shard through zerod (world size 1, "
      "cpu backend), checkpoint_every_steps %d, into %s/log2-NN\n",
      every, root);
  printf(
      "# stall: checkpoint step - median plain step, as the client sees it (dstall: zerod's own "
      "step durations); snap: zerod's last_snapshot_us; memcpy: the same 3*N*4 bytes here\n");
  printf(
      "# write: checkpoint bytes / (step return -> manifest.json); plain: write + fsync of as "
      "many bytes to the same directory. Medians of %d\n#\n",
      reps);
  printf("# %10s %7s %8s %9s %8s %9s %8s %9s %6s %6s %8s %8s %8s %6s\n", "params", "MiB", "step_ms",
         "ckstep_ms", "stall_ms", "dstall_ms", "snap_ms", "memcpy_ms", "st/mc", "sn/mc", "write_s",
         "ck_MB/s", "pl_MB/s", "%plain");
  double *plain = calloc((size_t)reps * (size_t)every, sizeof *plain);
  double *dplain = calloc((size_t)reps * (size_t)every, sizeof *dplain);
  double *dck = calloc((size_t)reps, sizeof *dck), *dstall = calloc((size_t)reps, sizeof *dstall);
  double *stall = calloc((size_t)reps, sizeof *stall),
         *ckstep = calloc((size_t)reps, sizeof *ckstep);
  double *snap = calloc((size_t)reps, sizeof *snap), *mc = calloc((size_t)reps, sizeof *mc);
  double *wr = calloc((size_t)reps, sizeof *wr), *pw = calloc((size_t)reps, sizeof *pw);
  double *ckrate = calloc((size_t)reps, sizeof *ckrate),
         *prate = calloc((size_t)reps, sizeof *prate);
  if (!plain || !dplain || !dck || !dstall || !stall || !ckstep || !snap || !mc || !wr || !pw ||
      !ckrate || !prate) {
    fprintf(stderr, "bench_checkpoint: out of memory\n");
    return 1;
  }
  int failed = 0;
  for (int si = 0; si < nsizes; si++) {
    uint64_t n = 1ull << sizes[si], bytes = 3 * n * 4, completed = 0;
    /* A zerod and a checkpoint_dir per size: retention orders checkpoints by step, and a new
     * model's steps start again at 0 (its checkpoints would be the "oldest" in a shared dir). */
    snprintf(dir, sizeof dir, "%s/log2-%02d", root, sizes[si]);
    if (mkdir(dir, 0755) != 0) {
      fprintf(stderr, "bench_checkpoint: mkdir %s: %s\n", dir, strerror(errno));
      return 1;
    }
    zdt_daemon_t d;
    zdt_start(&d, args);
    zd_client_t *c = attach(&d, n);
    uint64_t step = 0;
    /* Untimed: warm-up steps and one checkpoint (fresh snapshot buffer, fresh files). */
    double ds;
    do timed_step(c, &step, &ds);
    while (step % (uint64_t)every != 0);
    wait_manifest(dir, step, zd_bench_now());
    wait_idle(c, ++completed);
    uint64_t ckbytes = ckpt_status(c, "last_bytes"); /* the plain write writes as many */
    if (ckbytes > src_bytes || ckbytes < bytes) {
      fprintf(stderr,
              "bench_checkpoint: a checkpoint of %" PRIu64 " bytes for %" PRIu64
              " bytes of state\n",
              ckbytes, bytes);
      return 1;
    }
    int nplain = 0;
    for (int r = 0; r < reps; r++) {
      double pws = 0;
      if (r % 2) pws = plain_write(dir, src, ckbytes);
      double ck = 0;
      for (;;) {
        double t = timed_step(c, &step, &ds);
        if (step % (uint64_t)every == 0) {
          ck = t;
          dck[r] = ds;
          break;
        }
        dplain[nplain] = ds;
        plain[nplain++] = t;
      }
      double since = zd_bench_now();
      wr[r] = wait_manifest(dir, step, since);
      wait_idle(c, ++completed);
      snap[r] = (double)ckpt_status(c, "last_snapshot_us") * 1e-6;
      if (ckpt_status(c, "last_bytes") != ckbytes) {
        fprintf(stderr, "bench_checkpoint: checkpoints of one model differ in size\n");
        return 1;
      }
      if (r % 2 == 0) pws = plain_write(dir, src, ckbytes);
      double t0 = zd_bench_now();
      memcpy(dst, src, bytes);
      mc[r] = zd_bench_now() - t0;
      ckstep[r] = ck;
      pw[r] = pws;
      ckrate[r] = (double)ckbytes / wr[r];
      prate[r] = (double)ckbytes / pws;
    }
    double step_med = zd_bench_median(plain, nplain), dstep_med = zd_bench_median(dplain, nplain);
    for (int r = 0; r < reps; r++) {
      stall[r] = ckstep[r] - step_med;
      dstall[r] = dck[r] - dstep_med;
    }
    double dst = zd_bench_median(dstall, reps);
    double st = zd_bench_median(stall, reps), sn = zd_bench_median(snap, reps);
    double m = zd_bench_median(mc, reps), ckr = zd_bench_median(ckrate, reps);
    double pr = zd_bench_median(prate, reps);
    printf("  %10" PRIu64
           " %7.1f %8.3f %9.3f %8.3f %9.3f %8.3f %9.3f %6.2f %6.2f %8.3f %8.1f "
           "%8.1f %5.1f%%\n",
           n, (double)bytes / (1 << 20), step_med * 1e3, zd_bench_median(ckstep, reps) * 1e3,
           st * 1e3, dst * 1e3, sn * 1e3, m * 1e3, st / m, sn / m, zd_bench_median(wr, reps),
           ckr * 1e-6, pr * 1e-6, 100.0 * ckr / pr);
    fflush(stdout);
    zd_close(c);
    zdt_stop(&d, SIGTERM, 0); /* exits 1 unless zerod exits 0 */
  }

  /* checkpoint_keep 1 leaves the last checkpoint; the directory is this program's own. */
  if (nftw(root, remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0)
    fprintf(stderr, "bench_checkpoint: could not remove %s: %s\n", root, strerror(errno));
  free(plain);
  free(dplain);
  free(dck);
  free(dstall);
  free(stall);
  free(ckstep);
  free(snap);
  free(mc);
  free(wr);
  free(pw);
  free(ckrate);
  free(prate);
  zd_bench_free(src, src_bytes);
  zd_bench_free(dst, max_bytes);
  return failed;
}
