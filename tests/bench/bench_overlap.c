/* bench_overlap: what the optimizer update adds to a trainer's iteration, with overlap_update on
 * and off, next to the trainer's forward + backward alone, at world size 1 and 2.
 *
 * Per world size W (--world) and size: two zerods (AdamW, f32) of W local ranks each, one with
 * overlap_update = 1 and one without, both bound to the last CPU of this process's affinity mask
 * with one kernel thread; W trainer threads, one client each, all on the first CPU. A model of n
 * parameters in --buckets buckets (one parameter each) is registered with each zerod. Forward +
 * backward is synthetic: a busy loop of --fwd times the update's own time for the forward, then,
 * per bucket in descending order (as backward completes them), a busy loop of --bwd times the
 * update's time divided by the buckets, after which the bucket's scatter is sent without waiting
 * (zd_scatter_start, as zerod.torch's backward hooks do). Then step (ZD_STEP_NO_SCATTER) and wait
 * for it: the iteration's end. The trainers start each iteration together; its time is the
 * slowest trainer's.
 *
 * The update's time (update_ms) is measured first in the same run: a step of the off zerod after
 * every scatter has completed. Each row gives medians over --iters iterations (after 2 warm-up),
 * the four kinds alternating: fb_ms (forward + backward alone, no zerod), off_ms and on_ms (the
 * whole iteration), lazy_ms (the on zerod driven as the offload path and a trainer that gathers
 * each layer's parameters just before its forward drive it: the step without its gather
 * (ZD_STEP_NO_GATHER), every bucket's gather started as it returns, and the next forward waiting
 * for bucket b's gather before its b-th part, ascending; two such iterations back to back, the
 * second timed, so that no pause between the kinds hides the parameters' writes), what the
 * update adds to forward + backward in each (+off, +on, +lazy), and whether the target
 * holds (at most 10% where the update alone is shorter than backward: bwd/up > 1; tgt_on,
 * tgt_lz), and the time zerod says it spent in the step of each (stp_off, stp_on, stp_lz, ms:
 * rank 0's zd_step_result_t.duration_us; with the setting on, the wait for the last speculation,
 * the commit's parameter write and what it recomputes; lazy: what is left once the writes go to
 * the speculation thread).
 *
 * --passes: before the table, the memory passes behind the out-of-place update (kernels/adam.h,
 * src[]): the update's streams read in place and written back (4 read, 3 written: the in-place
 * step's own pattern, less the params), read from one set and written to another with ordinary
 * stores (the speculation's), and the same with non-temporal stores; one thread each, GB/s of
 * the bytes the kernel asks for.
 *
 *   bench_overlap [--zerod PATH] [--min-log2 20] [--max-log2 24] [--buckets 8] [--iters 7]
 *                 [--fwd 0.5] [--bwd 1.5,3] [--world 1,2] [--passes 0|1]
 *
 * --world 0 prints the passes alone.
 */
#include <emmintrin.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "mempass.h"
#include "zerod/zerod.h"

#define MAX_BUCKETS 64
#define MAX_WORLD   2

static void usage(void) {
  fprintf(stderr,
          "usage: bench_overlap [--zerod PATH] [--min-log2 N] [--max-log2 N] [--buckets N]\n"
          "                     [--iters N] [--fwd X] [--bwd X[,X...]] [--world W[,W]]\n"
          "                     [--passes 0|1]\n");
  exit(2);
}

static void die(const char *what) {
  fprintf(stderr, "bench_overlap: %s: %s\n", what, zd_last_error());
  exit(1);
}

static void busy(double seconds) {
  double end = zd_bench_now() + seconds;
  while (zd_bench_now() < end) {
  }
}

static zd_client_t *attach(const zdt_daemon_t *d, uint64_t n, int nb) {
  zd_client_t *c;
  if (zd_connect(d->socket, ZD_ANY_RANK, 0, &c) != ZD_OK) die("connect");
  zd_param_t p[MAX_BUCKETS];
  char names[MAX_BUCKETS][16];
  for (int b = 0; b < nb; b++) {
    snprintf(names[b], sizeof names[b], "w%d", b);
    p[b] = (zd_param_t){.name = names[b], .ndim = 1, .shape = {n / (uint64_t)nb}, .group = 0};
  }
  zd_group_t g;
  zd_group_init(&g, 1, sizeof g);
  g.weight_decay = 0.01;
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = p;
  desc.nparams = (size_t)nb;
  desc.groups = &g;
  desc.ngroups = 1;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  desc.flags = ZD_REGISTER_REPLACE;
  if (zd_layout(c, &desc) != ZD_OK) die("layout");
  float *w = zd_param_buffer(c, NULL);
  for (uint64_t i = 0; i < n; i++) w[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
  if (zd_register(c) != ZD_OK) die("register");
  float *gr = zd_grad_buffer(c, NULL);
  for (uint64_t i = 0; i < n; i++) gr[i] = (float)((i * 40503u) % 1000) * 1e-5f - 5e-3f;
  zd_info_t info = ZD_INFO_INIT;
  if (zd_get_info(c, &info) != ZD_OK) die("info");
  if ((int)info.nbuckets != nb) {
    fprintf(stderr, "bench_overlap: %u buckets, expected %d\n", info.nbuckets, nb);
    exit(1);
  }
  return c;
}

/* Returns the time zerod says it spent on the step (zd_step_result_t.duration_us), seconds.
 * no_gather: ZD_STEP_NO_GATHER (the caller gathers each bucket itself). */
static double step(zd_client_t *c, int no_gather) {
  zd_step_opts_t o = ZD_STEP_OPTS_INIT;
  o.flags = ZD_STEP_NO_SCATTER | (no_gather ? ZD_STEP_NO_GATHER : 0u);
  zd_step_result_t r = ZD_STEP_RESULT_INIT;
  if (zd_step(c, &o, &r) != ZD_OK) die("step");
  return (double)r.duration_us * 1e-6;
}

/* One iteration; c NULL: forward + backward alone. *in_step: zerod's time in the step.
 * gathers (lazy): the step does not gather; it starts every bucket's gather once it returns
 * (into gathers, *pending set), and the next iteration's forward waits for bucket b's before its
 * b-th part, in ascending order, as a trainer that gathers each layer's parameters just before
 * its forward (offload.py's gathers, bucket by bucket). */
static double iteration(zd_client_t *c, int nb, double fwd, double bwd_bucket, double *in_step,
                        zd_request_t *gathers, int *pending) {
  zd_request_t req[MAX_BUCKETS];
  double t0 = zd_bench_now();
  if (gathers && *pending) {
    for (int b = 0; b < nb; b++) {
      if (zd_wait(c, gathers[b], NULL) != ZD_OK) die("gather wait");
      busy(fwd / nb);
    }
    *pending = 0;
  } else {
    busy(fwd);
  }
  for (int b = nb; b-- > 0;) {
    busy(bwd_bucket);
    if (c && zd_scatter_start(c, b, &req[b]) != ZD_OK) die("scatter");
  }
  if (c) {
    for (int b = nb; b-- > 0;)
      if (zd_wait(c, req[b], NULL) != ZD_OK) die("scatter wait");
    *in_step = step(c, gathers != NULL);
    if (gathers) {
      for (int b = 0; b < nb; b++)
        if (zd_gather_start(c, b, &gathers[b]) != ZD_OK) die("gather");
      *pending = 1;
    }
  }
  return zd_bench_now() - t0;
}

/* ---- trainers: one thread per rank, driven in lockstep by main ------------------------------ */

typedef enum { CMD_ATTACH, CMD_UPDATE, CMD_ITER, CMD_CLOSE, CMD_EXIT } cmd_t;

static struct {
  pthread_barrier_t start, end;
  cmd_t cmd;
  const zdt_daemon_t *daemon; /* CMD_ATTACH: the zerod to attach to */
  int which;                  /* CMD_ATTACH (where the client goes), CMD_UPDATE, CMD_ITER: the
                                 zerod (0 off, 1 on); CMD_ITER: -1 for forward + backward alone,
                                 2 for the on zerod with lazy gathers (iteration's gathers) */
  uint64_t n;
  int nb;
  double fwd, bwd_bucket;
} g_run;

typedef struct trainer {
  pthread_t thread;
  int cpu;
  zd_client_t *c[2];
  zd_request_t gathers[MAX_BUCKETS]; /* the on zerod's, lazy: started after its last step */
  int pending;                       /* they are */
  double seconds;                    /* of the last timed command */
  double in_step;                    /* CMD_ITER: zerod's time in its step */
} trainer_t;

static void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  if (sched_setaffinity(0, sizeof s, &s) != 0) perror("bench_overlap: sched_setaffinity");
}

static void *trainer_main(void *arg) {
  trainer_t *t = arg;
  pin(t->cpu);
  for (;;) {
    pthread_barrier_wait(&g_run.start);
    cmd_t cmd = g_run.cmd;
    if (cmd == CMD_EXIT) break;
    if (cmd == CMD_ATTACH) {
      t->c[g_run.which] = attach(g_run.daemon, g_run.n, g_run.nb);
    } else if (cmd == CMD_UPDATE) { /* every scatter complete, then the step alone */
      zd_client_t *c = t->c[g_run.which];
      if (t->pending) /* the lazy iterations' gathers, before the buffers are written again */
        for (int b = 0; b < g_run.nb; b++) zd_wait(t->c[1], t->gathers[b], NULL);
      t->pending = 0;
      for (int b = g_run.nb; b-- > 0;)
        if (zd_scatter(c, b) != ZD_OK) die("scatter");
      pthread_barrier_wait(&g_run.end);
      pthread_barrier_wait(&g_run.start); /* the timed part starts together */
      double t0 = zd_bench_now();
      step(c, 0);
      t->seconds = zd_bench_now() - t0;
    } else if (cmd == CMD_ITER && g_run.which == 2) {
      /* Two lazy iterations back to back, the second timed: its forward waits for the gathers
       * of the step just before it, with no pause in which the writes could end unseen. */
      iteration(t->c[1], g_run.nb, g_run.fwd, g_run.bwd_bucket, &t->in_step, t->gathers,
                &t->pending);
      t->seconds = iteration(t->c[1], g_run.nb, g_run.fwd, g_run.bwd_bucket, &t->in_step,
                             t->gathers, &t->pending);
    } else if (cmd == CMD_ITER) {
      if (g_run.which == 1 && t->pending) { /* the lazy iterations' gathers first */
        for (int b = 0; b < g_run.nb; b++) zd_wait(t->c[1], t->gathers[b], NULL);
        t->pending = 0;
      }
      t->seconds = iteration(g_run.which < 0 ? NULL : t->c[g_run.which], g_run.nb, g_run.fwd,
                             g_run.bwd_bucket, &t->in_step, NULL, NULL);
    } else if (cmd == CMD_CLOSE) {
      if (t->pending)
        for (int b = 0; b < g_run.nb; b++) zd_wait(t->c[1], t->gathers[b], NULL);
      t->pending = 0;
      for (int k = 0; k < 2; k++) zd_close(t->c[k]);
      t->c[0] = t->c[1] = NULL;
    }
    pthread_barrier_wait(&g_run.end);
  }
  return NULL;
}

/* Runs cmd on every trainer; returns the slowest one's seconds (and, CMD_ITER, rank 0's time in
 * zerod's step in *in_step when not NULL). */
static double run_all(trainer_t *ts, int w, cmd_t cmd, int which, double *in_step) {
  g_run.cmd = cmd;
  g_run.which = which;
  pthread_barrier_wait(&g_run.start);
  if (cmd == CMD_UPDATE) {
    pthread_barrier_wait(&g_run.end);
    pthread_barrier_wait(&g_run.start);
  }
  if (cmd == CMD_EXIT) return 0;
  pthread_barrier_wait(&g_run.end);
  if (in_step) *in_step = ts[0].in_step;
  double most = 0;
  for (int r = 0; r < w; r++)
    if (ts[r].seconds > most) most = ts[r].seconds;
  return most;
}

/* ---- the memory passes behind the out-of-place update --------------------------------------- */

/* 4 streams read (master, exp_avg, exp_avg_sq, grad), 3 written: to src itself (in place), to
 * dst with ordinary stores, or to dst with non-temporal ones. A multiply keeps the compiler from
 * turning the copy into memcpy. */
static void pass(float *const *src, const float *grad, float *const *dst, uint64_t n, int nt) {
  const __m128 k = _mm_set1_ps(1.0f);
  for (uint64_t i = 0; i < n; i += 4) {
    __m128 g = _mm_load_ps(grad + i);
    for (int s = 0; s < 3; s++) {
      __m128 v =
          _mm_add_ps(_mm_mul_ps(_mm_load_ps(src[s] + i), k), _mm_mul_ps(g, _mm_setzero_ps()));
      if (nt)
        _mm_stream_ps(dst[s] + i, v);
      else
        _mm_store_ps(dst[s] + i, v);
    }
  }
  _mm_sfence();
}

/* Median seconds of a pass; out: from one set into the other, alternating the sets from pass
 * to pass as the overlapped update does from step to step (each reads what the last wrote). */
static double time_pass(float *const *a, float *const *b, const float *grad, uint64_t n, int out,
                        int nt, int iters) {
  double t[32];
  for (int it = 0; it < iters + 1; it++) {
    float *const *src = out && it % 2 ? b : a, *const *dst = !out ? a : it % 2 ? a : b;
    double t0 = zd_bench_now();
    pass(src, grad, dst, n, nt);
    if (it > 0) t[it - 1] = zd_bench_now() - t0;
  }
  return zd_bench_median(t, iters);
}

static void passes(int min_log2, int max_log2, int iters) {
  printf(
      "# memory passes, one thread: 4 streams read, 3 written (28 bytes per element asked); "
      "out: into the other set, the sets alternating, with ordinary or non-temporal (nt) "
      "stores\n");
  printf("# %10s %10s %10s %10s %8s %8s %10s\n", "elems", "in_ms", "out_ms", "out_nt_ms", "out/in",
         "nt/in", "in_GB/s");
  for (int lg = min_log2; lg <= max_log2; lg++) {
    uint64_t n = 1ull << lg;
    size_t bytes = n * sizeof(float);
    float *a[3], *b[3], *g = zd_bench_alloc(bytes, -1);
    for (int s = 0; s < 3; s++) {
      a[s] = zd_bench_alloc(bytes, -1);
      b[s] = zd_bench_alloc(bytes, -1);
      for (uint64_t i = 0; i < n; i++) a[s][i] = b[s][i] = (float)(i % 97) * 0.01f;
    }
    for (uint64_t i = 0; i < n; i++) g[i] = (float)(i % 89) * 0.001f;
    double in = time_pass(a, b, g, n, 0, 0, iters), out = time_pass(a, b, g, n, 1, 0, iters);
    double nt = time_pass(a, b, g, n, 1, 1, iters);
    printf("  %10llu %10.3f %10.3f %10.3f %8.2f %8.2f %10.1f\n", (unsigned long long)n, in * 1e3,
           out * 1e3, nt * 1e3, out / in, nt / in, 28.0 * (double)n / in * 1e-9);
    for (int s = 0; s < 3; s++) {
      zd_bench_free(a[s], bytes);
      zd_bench_free(b[s], bytes);
    }
    zd_bench_free(g, bytes);
  }
  printf("#\n");
  fflush(stdout);
}

int main(int argc, char **argv) {
  int min_log2 = 20, max_log2 = 24, nb = 8, iters = 7, worlds[2] = {1, 2}, nworlds = 2,
      do_passes = 0;
  double fwd = 0.5, bwd[8] = {1.5, 3.0};
  int nbwd = 2;
  const char *zerod = getenv("ZEROD_BIN") ? getenv("ZEROD_BIN") : "build/daemon/zerod";
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) usage();
    const char *o = argv[i], *v = argv[i + 1];
    if (!strcmp(o, "--zerod"))
      zerod = v;
    else if (!strcmp(o, "--min-log2"))
      min_log2 = atoi(v);
    else if (!strcmp(o, "--max-log2"))
      max_log2 = atoi(v);
    else if (!strcmp(o, "--buckets"))
      nb = atoi(v);
    else if (!strcmp(o, "--iters"))
      iters = atoi(v);
    else if (!strcmp(o, "--fwd"))
      fwd = atof(v);
    else if (!strcmp(o, "--passes"))
      do_passes = atoi(v);
    else if (!strcmp(o, "--bwd")) {
      nbwd = 0;
      for (char *s = (char *)v; *s && nbwd < 8; s = strchr(s, ',') ? strchr(s, ',') + 1 : "")
        bwd[nbwd++] = atof(s);
    } else if (!strcmp(o, "--world")) {
      nworlds = 0;
      for (char *s = (char *)v; *s && nworlds < 2; s = strchr(s, ',') ? strchr(s, ',') + 1 : "")
        worlds[nworlds++] = atoi(s);
    } else
      usage();
  }
  if (min_log2 < 12 || max_log2 > 28 || min_log2 > max_log2 || nb < 1 || nb > MAX_BUCKETS ||
      iters < 1 || iters > 32 || nbwd < 1 || nworlds < 1)
    usage();
  for (int k = 0; k < nworlds; k++)
    if (worlds[k] < 0 || worlds[k] > MAX_WORLD) usage();
  setenv("ZEROD_BIN", zerod, 1);

  cpu_set_t mask;
  CPU_ZERO(&mask);
  sched_getaffinity(0, sizeof mask, &mask);
  int first = -1, last = -1;
  for (int i = 0; i < CPU_SETSIZE; i++)
    if (CPU_ISSET(i, &mask)) {
      if (first < 0) first = i;
      last = i;
    }
  if (do_passes) {
    pin(first);
    passes(min_log2, max_log2, iters);
  }
  printf(
      "# bench_overlap: trainers on CPU %d, two zerods (overlap_update 0 and 1) on CPU %d, "
      "1 kernel thread each; AdamW f32, %d buckets; forward %.2fx, backward %s x the update\n",
      first, last, nb, fwd, nbwd > 1 ? "each of" : "");
  printf(
      "# medians of %d iterations after 2 warm-up; +off / +on / +lazy: what the update adds to "
      "forward + backward (lazy: the on zerod, the step without its gather and each bucket "
      "gathered before its part of the next forward); target: at most 10%% where bwd/up > 1\n#\n",
      iters);
  printf("# %2s %10s %6s %10s %10s %10s %10s %10s %8s %8s %8s %8s %7s %7s %8s %8s %8s\n", "W",
         "params", "bwd/up", "update_ms", "fb_ms", "off_ms", "on_ms", "lazy_ms", "+off", "+on",
         "+lazy", "on/off", "tgt_on", "tgt_lz", "stp_off", "stp_on", "stp_lz");
  for (int wi = 0; wi < nworlds; wi++) {
    int w = worlds[wi];
    if (w == 0) continue; /* --world 0: the passes alone */
    trainer_t ts[MAX_WORLD] = {0};
    pthread_barrier_init(&g_run.start, NULL, (unsigned)w + 1);
    pthread_barrier_init(&g_run.end, NULL, (unsigned)w + 1);
    for (int r = 0; r < w; r++) {
      ts[r].cpu = first;
      if (pthread_create(&ts[r].thread, NULL, trainer_main, &ts[r]) != 0) die("pthread_create");
    }
    for (int lg = min_log2; lg <= max_log2; lg++) {
      uint64_t n = (1ull << lg) / (uint64_t)nb * (uint64_t)nb;
      /* A pair of zerods per size: one parameter per bucket (bucket_elems). They inherit the last
       * CPU; the trainers are on the first. */
      /* W = 2: the zerod gets every CPU. Its two rank workers wait for each other in every
       * collective, which bound to one CPU costs a time slice each (steps of 20 ms at 2^18). */
      if (w == 1)
        pin(last);
      else if (sched_setaffinity(0, sizeof mask, &mask) != 0)
        perror("bench_overlap: sched_setaffinity");
      char be[32], ws[8];
      snprintf(be, sizeof be, "%llu", (unsigned long long)(n / (uint64_t)nb));
      snprintf(ws, sizeof ws, "%d", w);
      zdt_daemon_t off, on;
      const char *off_args[] = {
          "--threads",     "1", "--log_level", "warn", "--bucket_elems", be, "--world_size", ws,
          "--local_ranks", ws,  NULL};
      const char *on_args[] = {"--threads",
                               "1",
                               "--log_level",
                               "warn",
                               "--bucket_elems",
                               be,
                               "--world_size",
                               ws,
                               "--local_ranks",
                               ws,
                               "--overlap_update",
                               "1",
                               NULL};
      zdt_start(&off, off_args);
      zdt_start(&on, on_args);
      pin(first);
      g_run.n = n;
      g_run.nb = nb;
      g_run.daemon = &off;
      run_all(ts, w, CMD_ATTACH, 0, NULL);
      g_run.daemon = &on;
      run_all(ts, w, CMD_ATTACH, 1, NULL);
      double tu[32];
      for (int it = 0; it < iters + 2; it++) {
        double s = run_all(ts, w, CMD_UPDATE, 0, NULL);
        if (it >= 2) tu[it - 2] = s;
      }
      double up = zd_bench_median(tu, iters);
      for (int bi = 0; bi < nbwd; bi++) {
        g_run.fwd = fwd * up;
        g_run.bwd_bucket = bwd[bi] * up / nb;
        double tf[32], toff[32], ton[32], tlz[32], soff[32], son[32], slz[32];
        for (int it = 0; it < iters + 2; it++) {
          double so, sn, sl;
          double a = run_all(ts, w, CMD_ITER, -1, NULL);
          double o = run_all(ts, w, CMD_ITER, 0, &so);
          double p = run_all(ts, w, CMD_ITER, 1, &sn);
          double z = run_all(ts, w, CMD_ITER, 2, &sl);
          if (it >= 2) {
            tf[it - 2] = a;
            toff[it - 2] = o;
            ton[it - 2] = p;
            tlz[it - 2] = z;
            soff[it - 2] = so;
            son[it - 2] = sn;
            slz[it - 2] = sl;
          }
        }
        double mf = zd_bench_median(tf, iters), mo = zd_bench_median(toff, iters);
        double mn = zd_bench_median(ton, iters), ml = zd_bench_median(tlz, iters);
        double add_on = 100.0 * (mn - mf) / mf, add_lz = 100.0 * (ml - mf) / mf;
        const char *t_on = bwd[bi] <= 1.0 ? "-" : add_on <= 10.0 ? "met" : "missed";
        const char *t_lz = bwd[bi] <= 1.0 ? "-" : add_lz <= 10.0 ? "met" : "missed";
        printf(
            "  %2d %10llu %6.2f %10.3f %10.3f %10.3f %10.3f %10.3f %7.1f%% %7.1f%% %7.1f%% %8.3f "
            "%7s %7s %8.3f %8.3f %8.3f\n",
            w, (unsigned long long)n, bwd[bi], up * 1e3, mf * 1e3, mo * 1e3, mn * 1e3, ml * 1e3,
            100.0 * (mo - mf) / mf, add_on, add_lz, mn / mo, t_on, t_lz,
            zd_bench_median(soff, iters) * 1e3, zd_bench_median(son, iters) * 1e3,
            zd_bench_median(slz, iters) * 1e3);
        fflush(stdout);
      }
      if (getenv("BENCH_OVERLAP_STATUS")) { /* the zerods' own accounting, for a closer look */
        for (int k = 0; k < 2; k++) {
          char *text = NULL;
          if (zd_status(ts[0].c[k], &text) == ZD_OK)
            fprintf(stderr, "== W=%d %s\n%s\n", w, k ? "on" : "off", text);
          zd_free(text);
        }
      }
      run_all(ts, w, CMD_CLOSE, 0, NULL);
      zdt_stop(&off, SIGTERM, 0);
      zdt_stop(&on, SIGTERM, 0);
    }
    run_all(ts, w, CMD_EXIT, 0, NULL);
    for (int r = 0; r < w; r++) pthread_join(ts[r].thread, NULL);
    pthread_barrier_destroy(&g_run.start);
    pthread_barrier_destroy(&g_run.end);
  }
  return 0;
}
