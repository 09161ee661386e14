/* Benchmark of the CPU collectives (gloo.h): reduce-scatter and all-gather bus bandwidth of W
 * ranks forked on loopback, next to the throughput of a plain TCP stream between two processes
 * measured in the same run, which is what the collectives' TCP transfers can hope for here.
 *
 * The table follows nccl-tests: size is the whole buffer (W slices; the reduce-scatter's input,
 * the all-gather's output), time is the median over iterations of the slowest rank's time of one
 * call (the ranks start each call together after a barrier), algbw = size / time, busbw = algbw *
 * (W - 1) / W for both operations. GB/s are 1e9 bytes per second. The tcp columns stream `size`
 * bytes over 127.0.0.1: one way, and both ways at once (the rate of each direction, as a W = 2
 * ring moves data). A program, not a test: run it and report the table.
 *
 *   bench_comm [--ranks 2,4] [--iters 5] [--min-mib 1] [--max-mib 256] [--dtype f32|bf16|f16]
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gloo.h"

#define MAX_SIZES 16
#define MAX_ITERS 64

static char g_dir[256];

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void die(const char *what, const char *msg) {
  fprintf(stderr, "bench_comm: %s: %s\n", what, msg);
  exit(1);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ---- the rendezvous: a key-value store over a directory (as in tests/unit/test_gloo.c) ---- */

static void key_path(char *out, size_t n, const char *key) {
  int len = snprintf(out, n, "%s/", g_dir);
  for (const char *k = key; *k && (size_t)len + 1 < n; k++) out[len++] = *k == '/' ? '#' : *k;
  out[len] = 0;
}

static int kv_set(void *ctx, const char *key, const void *value, size_t len, zd__err_t *err) {
  (void)ctx;
  char path[512], tmp[600];
  key_path(path, sizeof path, key);
  snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
  FILE *f = fopen(tmp, "wb");
  if (!f) return zd__errf(err, -errno, "open %s: %s", tmp, strerror(errno));
  size_t wrote = fwrite(value, 1, len, f);
  if (fclose(f) != 0 || wrote != len || rename(tmp, path) != 0)
    return zd__errf(err, -EIO, "write %s failed", path);
  return ZD_OK;
}

static int kv_get(void *ctx, const char *key, void **value, size_t *len, int timeout_ms,
                  zd__err_t *err) {
  (void)ctx;
  char path[512];
  key_path(path, sizeof path, key);
  double deadline = now_s() + timeout_ms / 1e3;
  for (;;) {
    FILE *f = fopen(path, "rb");
    if (f) {
      struct stat st;
      char *buf = fstat(fileno(f), &st) == 0 ? malloc((size_t)st.st_size + 1) : NULL;
      size_t got = buf ? fread(buf, 1, (size_t)st.st_size, f) : 0;
      fclose(f);
      if (!buf || got != (size_t)st.st_size) {
        free(buf);
        return zd__errf(err, -EIO, "read %s failed", path);
      }
      *value = buf;
      *len = got;
      return ZD_OK;
    }
    if (now_s() >= deadline) return zd__errf(err, -ETIMEDOUT, "no key '%s'", key);
    usleep(2000);
  }
}

static int kv_wait(void *ctx, const char *const *keys, size_t nkeys, int timeout_ms,
                   zd__err_t *err) {
  (void)ctx;
  double deadline = now_s() + timeout_ms / 1e3;
  for (size_t i = 0; i < nkeys; i++) {
    char path[512];
    key_path(path, sizeof path, keys[i]);
    while (access(path, F_OK) != 0) {
      if (now_s() >= deadline) return zd__errf(err, -ETIMEDOUT, "no key '%s'", keys[i]);
      usleep(2000);
    }
  }
  return ZD_OK;
}

/* ---- collectives --------------------------------------------------------------------------- */

typedef struct opts {
  int ranks[4];
  int nranks;
  int iters;
  size_t sizes[MAX_SIZES];
  int nsizes;
  zd_dtype_t dtype;
} opts_t;

/* Per size: the median of the slowest rank's time, reduce-scatter and all-gather; written by
 * rank 0 into a pipe for the parent. */
typedef struct result {
  double rs_s[MAX_SIZES], ag_s[MAX_SIZES];
} result_t;

/* The ranks start a timed call together, and each call's time is the slowest rank's. */
static void barrier(zd__gloo_t *g) {
  uint8_t one = 1, all[64];
  zd__err_t err;
  if (zd__gloo_allgather_bytes(g, &one, 1, all, &err)) die("barrier", err.msg);
}

static double slowest(zd__gloo_t *g, int w, double t) {
  double all[64];
  zd__err_t err;
  if (zd__gloo_allgather_bytes(g, &t, sizeof t, all, &err)) die("gather times", err.msg);
  double max = 0;
  for (int r = 0; r < w; r++) max = all[r] > max ? all[r] : max;
  return max;
}

static void run_rank(const opts_t *o, int w, int rank, int out_fd) {
  zd__kv_t kv = {.ctx = NULL, .set = kv_set, .get = kv_get, .wait = kv_wait};
  char prefix[32];
  snprintf(prefix, sizeof prefix, "bench-w%d", w);
  zd__gloo_opts_t go = {.kv = &kv,
                        .prefix = prefix,
                        .rank = (uint32_t)rank,
                        .world_size = (uint32_t)w,
                        .host = "127.0.0.1",
                        .timeout_ms = 60000,
                        .connect_timeout_ms = 30000};
  zd__err_t err;
  zd__gloo_t *g;
  if (zd__gloo_connect(&go, &g, &err)) die("connect", err.msg);
  size_t esize = zd_dtype_size(o->dtype);
  size_t max = o->sizes[o->nsizes - 1];
  char *send = malloc(max), *params = malloc(max);
  float *recv = malloc(max / w / esize * sizeof(float) + 4);
  if (!send || !params || !recv) die("malloc", "out of memory");
  /* Small finite values of any dtype (0x3c00 is 1.0 in f16, 0x3f80 in bf16). */
  for (size_t i = 0; i < max / 2; i++) ((uint16_t *)send)[i] = 0x3c00;
  memset(params, 1, max);
  memset(recv, 0, max / w / esize * sizeof(float) + 4);
  result_t res;
  for (int s = 0; s < o->nsizes; s++) {
    uint64_t count = o->sizes[s] / (size_t)w / esize; /* elements per rank */
    size_t slice = o->sizes[s] / (size_t)w;
    double rs[MAX_ITERS], ag[MAX_ITERS];
    for (int it = -1; it < o->iters; it++) { /* iteration -1 warms up */
      barrier(g);
      double t0 = now_s();
      if (zd__gloo_reduce_scatter(g, send, o->dtype, recv, count, 0, &err))
        die("reduce-scatter", err.msg);
      double t_rs = slowest(g, w, now_s() - t0);
      barrier(g);
      t0 = now_s();
      if (zd__gloo_all_gather(g, params, slice, 0, &err)) die("all-gather", err.msg);
      double t_ag = slowest(g, w, now_s() - t0);
      if (it >= 0) rs[it] = t_rs, ag[it] = t_ag;
    }
    res.rs_s[s] = median(rs, o->iters);
    res.ag_s[s] = median(ag, o->iters);
  }
  if (rank == 0 && write(out_fd, &res, sizeof res) != (ssize_t)sizeof res) die("pipe", "write");
  zd__gloo_destroy(g);
  free(send);
  free(params);
  free(recv);
}

static void run_world(const opts_t *o, int w, result_t *res) {
  int fds[2];
  if (pipe(fds)) die("pipe", strerror(errno));
  pid_t pids[64];
  for (int r = 0; r < w; r++) {
    fflush(NULL);
    pids[r] = fork();
    if (pids[r] < 0) die("fork", strerror(errno));
    if (pids[r] == 0) {
      close(fds[0]);
      run_rank(o, w, r, fds[1]);
      _exit(0);
    }
  }
  close(fds[1]);
  ssize_t got = read(fds[0], res, sizeof *res);
  close(fds[0]);
  for (int r = 0; r < w; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st)) die("rank", "a rank failed (see above)");
  }
  if (got != (ssize_t)sizeof *res) die("pipe", "no result from rank 0");
}

/* ---- plain TCP over loopback ------------------------------------------------------------- */

static void write_all(int fd, const char *p, size_t n) {
  while (n) {
    ssize_t k = write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) die("tcp write", strerror(errno));
    p += k, n -= (size_t)k;
  }
}

static void read_all(int fd, char *p, size_t n) {
  while (n) {
    ssize_t k = read(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) die("tcp read", k ? strerror(errno) : "closed");
    p += k, n -= (size_t)k;
  }
}

typedef struct sender {
  int fd;
  const char *buf;
  size_t n;
} sender_t;

static void *send_main(void *arg) {
  sender_t *s = arg;
  write_all(s->fd, s->buf, s->n);
  return NULL;
}

/* One side of a stream test: per size and iteration, sync with a byte, then send `size` bytes
 * (and receive as many from the peer when both ways) and wait for the peer's byte saying it has
 * everything. The side with `timing` returns medians. */
static void tcp_side(int fd, const opts_t *o, int two_way, int timing, double *out_s) {
  size_t max = o->sizes[o->nsizes - 1];
  char *sbuf = malloc(max), *rbuf = malloc(max), tok = 0;
  if (!sbuf || !rbuf) die("malloc", "out of memory");
  memset(sbuf, 7, max);
  memset(rbuf, 0, max);
  for (int s = 0; s < o->nsizes; s++) {
    double t[MAX_ITERS];
    size_t n = o->sizes[s];
    for (int it = -1; it < o->iters; it++) {
      write_all(fd, &tok, 1);
      read_all(fd, &tok, 1);
      double t0 = now_s();
      if (two_way) {
        sender_t snd = {fd, sbuf, n};
        pthread_t th;
        pthread_create(&th, NULL, send_main, &snd);
        read_all(fd, rbuf, n);
        pthread_join(th, NULL);
      } else if (timing) {
        write_all(fd, sbuf, n);
      } else {
        read_all(fd, rbuf, n);
      }
      write_all(fd, &tok, 1); /* "I have everything" */
      read_all(fd, &tok, 1);
      if (it >= 0) t[it] = now_s() - t0;
    }
    if (timing) out_s[s] = median(t, o->iters);
  }
  free(sbuf);
  free(rbuf);
}

static void tcp_stream(const opts_t *o, int two_way, double *out_s) {
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t alen = sizeof a;
  if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, 1) ||
      getsockname(lfd, (struct sockaddr *)&a, &alen))
    die("tcp listen", strerror(errno));
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(lfd);
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) die("tcp connect", strerror(errno));
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    tcp_side(fd, o, two_way, 0, NULL);
    _exit(0);
  }
  int fd = accept(lfd, NULL, NULL), one = 1;
  if (fd < 0) die("tcp accept", strerror(errno));
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  close(lfd);
  tcp_side(fd, o, two_way, 1, out_s);
  close(fd);
  waitpid(pid, NULL, 0);
}

/* ---- main -------------------------------------------------------------------------------- */

static void parse(int argc, char **argv, opts_t *o) {
  size_t min_mib = 1, max_mib = 256;
  o->ranks[0] = 2, o->ranks[1] = 4, o->nranks = 2;
  o->iters = 5;
  o->dtype = ZD_F32;
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(argv[i], "--ranks") && v) {
      o->nranks = 0;
      for (char *p = argv[++i]; *p && o->nranks < 4; p++) {
        o->ranks[o->nranks++] = (int)strtol(p, &p, 10);
        if (!*p) break;
      }
    } else if (!strcmp(argv[i], "--iters") && v) {
      o->iters = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--min-mib") && v) {
      min_mib = (size_t)atol(argv[++i]);
    } else if (!strcmp(argv[i], "--max-mib") && v) {
      max_mib = (size_t)atol(argv[++i]);
    } else if (!strcmp(argv[i], "--dtype") && v) {
      i++;
      o->dtype = !strcmp(v, "bf16") ? ZD_BF16 : !strcmp(v, "f16") ? ZD_F16 : ZD_F32;
    } else {
      fprintf(stderr,
              "usage: %s [--ranks 2,4] [--iters 5] [--min-mib 1] [--max-mib 256] "
              "[--dtype f32|bf16|f16]\n",
              argv[0]);
      exit(2);
    }
  }
  if (o->iters < 1 || o->iters > MAX_ITERS) die("--iters", "must be 1..64");
  o->nsizes = 0;
  for (size_t m = min_mib; m <= max_mib && o->nsizes < MAX_SIZES; m *= 2)
    o->sizes[o->nsizes++] = m << 20;
  if (!o->nsizes) die("sizes", "empty range");
  for (int k = 0; k < o->nranks; k++)
    if (o->ranks[k] < 1 || o->ranks[k] > 64) die("--ranks", "each must be 1..64");
}

int main(int argc, char **argv) {
  opts_t o;
  parse(argc, argv, &o);
  signal(SIGPIPE, SIG_IGN);
  const char *tmp = getenv("TMPDIR");
  snprintf(g_dir, sizeof g_dir, "%s/zd-bench-comm-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(g_dir)) die("mkdtemp", strerror(errno));

  double one_way[MAX_SIZES], two_way[MAX_SIZES];
  tcp_stream(&o, 0, one_way);
  tcp_stream(&o, 1, two_way);

  printf(
      "# bench_comm: Gloo TCP collectives on 127.0.0.1 (gloo.h), %s reduce-scatter input, "
      "median of %d\n",
      zd_dtype_name(o.dtype), o.iters);
  printf(
      "# size: whole buffer (W slices); ms: slowest rank per call; algbw = size/time; "
      "busbw = algbw*(W-1)/W; GB/s\n");
  printf(
      "# tcp: plain TCP stream of size bytes between 2 processes, same run: one way, and each "
      "direction of both at once\n");
  printf("%3s %11s %9s %8s %8s %9s %8s %8s %10s %10s\n", "W", "size", "rs ms", "rs alg", "rs bus",
         "ag ms", "ag alg", "ag bus", "tcp 1-way", "tcp 2-way");
  for (int k = 0; k < o.nranks; k++) {
    int w = o.ranks[k];
    result_t res;
    run_world(&o, w, &res);
    for (int s = 0; s < o.nsizes; s++) {
      double size = (double)o.sizes[s], f = (w - 1.0) / w;
      double rs_alg = size / res.rs_s[s] / 1e9, ag_alg = size / res.ag_s[s] / 1e9;
      printf("%3d %11zu %9.2f %8.2f %8.2f %9.2f %8.2f %8.2f %10.2f %10.2f\n", w, o.sizes[s],
             res.rs_s[s] * 1e3, rs_alg, rs_alg * f, res.ag_s[s] * 1e3, ag_alg, ag_alg * f,
             size / one_way[s] / 1e9, size / two_way[s] / 1e9);
    }
  }

  DIR *d = opendir(g_dir);
  struct dirent *e;
  char path[600];
  while (d && (e = readdir(d)))
    if (e->d_name[0] != '.') snprintf(path, sizeof path, "%s/%s", g_dir, e->d_name), unlink(path);
  if (d) closedir(d);
  rmdir(g_dir);
  return 0;
}
