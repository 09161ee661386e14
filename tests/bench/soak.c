/* soak: a zerod world under load for a given time, with trainers killed and restarted at random.
 *
 * One zerod serves W local ranks (Gloo between them). W trainer processes (one per rank, forked,
 * libzerod) register one model and step in a loop, retrying a step that comes back ZD_EABORTED
 * (another trainer died in it) as the Python ZeroOptimizer does; M client threads connect, ask
 * for the status and leave, over and over. Every --kill-ms a random trainer is SIGKILLed and
 * started again (it reattaches and resumes the model). At the end it prints steps, the errors by
 * code and by who saw them (trainers, status clients), with the aborts the kills explain
 * (ZD_EABORTED, at most one per surviving trainer and kill) apart, zerod's RSS and open
 * descriptors after warm-up, every --sample-s during the run, at the end and after every client
 * left, and the p50/p99/max step latency the trainers saw (successful steps; a retried step
 * counts from its retry).
 *
 *   soak [--world 4] [--clients 50] [--seconds 600] [--kill-ms 5000|0] [--elems 65536]
 *        [--sample-s 60]
 *
 * A program, not a test: it reports, it asserts nothing. Exit status 0 when no client saw an
 * error other than the injected ones and zerod exited cleanly, 1 otherwise.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <dirent.h>

#include "harness.h"
#include "zerod/zerod.h"

#define MAX_WORLD 16
#define LAT_CAP   (1u << 21) /* latencies kept per trainer slot */
#define NCODES    64         /* error codes counted: ZD_* (-4001..) and -errno below 64 */

typedef struct shared {
  _Atomic int stop;
  _Atomic uint64_t steps[MAX_WORLD];
  _Atomic uint64_t errors[2][NCODES]; /* [trainer, status client][code_index()], no aborts */
  _Atomic uint64_t aborts;            /* ZD_EABORTED: a step another trainer's kill abandoned */
  _Atomic uint64_t nlat[MAX_WORLD];
  float lat_us[MAX_WORLD][LAT_CAP];
} shared_t;

static shared_t *sh;

static uint64_t now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* ZD_* codes 1..40, -errno 41..63 (clamped), 0 other. */
static int code_index(int rc) {
  if (rc <= -4001 && rc >= -4040) return -rc - 4000;
  if (rc < 0 && -rc < NCODES - 41) return 41 + -rc;
  return 0;
}

static const char *index_name(int i, char *buf, size_t len) {
  if (i >= 1 && i <= 40) return zd_strerror(-4000 - i);
  if (i >= 41) {
    snprintf(buf, len, "%s", strerror(i - 41));
    return buf;
  }
  return "other";
}

/* who: 0 a trainer, 1 a status client (which one saw an error is half of what it means) */
static void count_error(int who, int rc) {
  atomic_fetch_add(&sh->errors[who][code_index(rc)], 1);
}

static int attach(const char *socket, uint32_t rank, uint64_t n, zd_client_t **out) {
  zd_client_t *c;
  int rc = zd_connect(socket, (int)rank, 5000, &c);
  if (rc) return rc;
  zd_param_t p = {.name = "soak.weights", .ndim = 1, .shape = {n}, .group = 0};
  zd_group_t g;
  zd_group_init(&g, 1, sizeof g);
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = &p;
  desc.nparams = 1;
  desc.groups = &g;
  desc.ngroups = 1;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  if ((rc = zd_layout(c, &desc)) || (rc = zd_register(c))) {
    zd_close(c);
    return rc;
  }
  float *grad = zd_grad_buffer(c, NULL);
  for (uint64_t i = 0; i < n; i++) grad[i] = (float)((int)((i + rank) % 2001) - 1000) * 1e-6f;
  *out = c;
  return ZD_OK;
}

/* A trainer process: step until told to stop; reconnect after an error. */
static void trainer_main(const char *socket, uint32_t rank, uint64_t n) {
  zd_client_t *c = NULL;
  while (!atomic_load(&sh->stop)) {
    if (!c) {
      int rc = attach(socket, rank, n, &c);
      if (rc) {
        count_error(0, rc);
        usleep(20000);
        continue;
      }
    }
    uint64_t t0 = now_us();
    int rc = zd_step(c, NULL, NULL);
    if (rc == ZD_EABORTED) { /* retryable: the gradients are still in the buffer */
      atomic_fetch_add(&sh->aborts, 1);
      continue;
    }
    if (rc) {
      count_error(0, rc);
      zd_close(c);
      c = NULL;
      continue;
    }
    uint64_t k = atomic_fetch_add(&sh->nlat[rank], 1);
    sh->lat_us[rank][k % LAT_CAP] = (float)(now_us() - t0);
    atomic_fetch_add(&sh->steps[rank], 1);
  }
  zd_close(c);
  _exit(0);
}

static pid_t spawn_trainer(const char *socket, uint32_t rank, uint64_t n) {
  pid_t pid = fork();
  if (pid == 0) trainer_main(socket, rank, n);
  return pid;
}

typedef struct status_client {
  const char *socket;
  uint64_t rounds;
  uint64_t errors;
} status_client_t;

/* Connect, status, bye, over and over (explicit rank 0: takes no rank). */
static void *status_main(void *arg) {
  status_client_t *s = arg;
  while (!atomic_load(&sh->stop)) {
    zd_client_t *c;
    int rc = zd_connect(s->socket, 0, 5000, &c);
    if (rc == ZD_OK) {
      char *text = NULL;
      rc = zd_status(c, &text);
      free(text);
      zd_close(c);
    }
    if (rc) {
      s->errors++;
      count_error(1, rc);
      usleep(10000);
    }
    s->rounds++;
  }
  return NULL;
}

static long rss_kib(pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  long kib = -1;
  if (!f) return -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %ld kB", &kib) == 1) break;
  fclose(f);
  return kib;
}

static int fd_count(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR *d = opendir(path);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  uint32_t world = 4, clients = 50, seconds = 600, kill_ms = 5000, sample_s = 60;
  uint64_t elems = 65536;
  for (int i = 1; i < argc; i += 2) {
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      printf(
          "usage: soak [--world 4] [--clients 50] [--seconds 600] [--kill-ms 5000|0] "
          "[--elems 65536] [--sample-s 60]\n"
          "  --world N      local ranks of the one zerod, one trainer process each (1..%d)\n"
          "  --clients M    threads that connect, ask for the status and leave, in a loop\n"
          "  --seconds S    how long the load runs\n"
          "  --kill-ms T    SIGKILL a random trainer every T ms and start it again (0: never)\n"
          "  --elems N      elements of the model (one f32 parameter)\n"
          "  --sample-s S   zerod's RSS and descriptors printed every S seconds\n"
          "Runs $ZEROD_BIN (meson devenv, or ZEROD_BIN=build/daemon/zerod).\n",
          MAX_WORLD);
      return 0;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "soak: %s needs a value (see --help)\n", argv[i]);
      return 2;
    }
    if (!strcmp(argv[i], "--world"))
      world = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--clients"))
      clients = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--seconds"))
      seconds = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--kill-ms"))
      kill_ms = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--elems"))
      elems = strtoull(argv[i + 1], NULL, 10);
    else if (!strcmp(argv[i], "--sample-s"))
      sample_s = (uint32_t)atoi(argv[i + 1]);
    else {
      fprintf(stderr, "soak: unknown option %s (see --help)\n", argv[i]);
      return 2;
    }
  }
  if (world < 1 || world > MAX_WORLD) {
    fprintf(stderr, "soak: --world must be 1..%d\n", MAX_WORLD);
    return 2;
  }
  sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED) return perror("mmap"), 1;

  char ranks[16], maxc[16];
  snprintf(ranks, sizeof ranks, "%u", world);
  snprintf(maxc, sizeof maxc, "%u", world + clients + 16);
  const char *extra[] = {"--local_ranks",
                         ranks,
                         "--max_clients",
                         maxc,
                         "--max_clients_per_uid", /* every client here is the same user */
                         maxc,
                         "--log_level",
                         "warn",
                         "--collective_timeout_ms",
                         "60000",
                         NULL};
  zdt_daemon_t d;
  zdt_start(&d, extra);

  pid_t trainers[MAX_WORLD];
  for (uint32_t r = 0; r < world; r++) trainers[r] = spawn_trainer(d.socket, r, elems);
  sleep(2); /* warm-up: registration, first steps */
  long rss0 = rss_kib(d.pid);
  int fds0 = fd_count(d.pid);

  pthread_t *threads = calloc(clients, sizeof *threads);
  status_client_t *sc = calloc(clients, sizeof *sc);
  for (uint32_t i = 0; i < clients; i++) {
    sc[i].socket = d.socket;
    pthread_create(&threads[i], NULL, status_main, &sc[i]);
  }

  uint64_t t_start = now_us();
  uint64_t t_end = t_start + (uint64_t)seconds * 1000000u, next_kill = t_start + kill_ms * 1000u;
  uint64_t next_sample = t_start + (uint64_t)sample_s * 1000000u;
  uint64_t kills = 0, last_steps = 0;
  unsigned seed = 12345;
  printf("%8s %12s %10s %6s %8s %8s\n", "time_s", "steps", "aborts", "kills", "rss_kib", "fds");
  printf("%8d %12s %10s %6s %8ld %8d   (after warm-up, before the status clients)\n", 0, "-", "-",
         "-", rss0, fds0);
  fflush(stdout);
  while (now_us() < t_end) {
    usleep(100000);
    if (sample_s && now_us() >= next_sample) {
      uint64_t steps = 0;
      for (uint32_t r = 0; r < world; r++) steps += sh->steps[r];
      printf("%8.0f %12" PRIu64 " %10" PRIu64 " %6" PRIu64 " %8ld %8d\n",
             (double)(now_us() - t_start) / 1e6, steps - last_steps,
             (uint64_t)atomic_load(&sh->aborts), kills, rss_kib(d.pid), fd_count(d.pid));
      fflush(stdout);
      last_steps = steps;
      next_sample += (uint64_t)sample_s * 1000000u;
    }
    if (kill_ms && now_us() >= next_kill) {
      uint32_t r = (uint32_t)rand_r(&seed) % world;
      kill(trainers[r], SIGKILL);
      waitpid(trainers[r], NULL, 0);
      trainers[r] = spawn_trainer(d.socket, r, elems);
      kills++;
      next_kill = now_us() + kill_ms * 1000u;
    }
  }
  long rss1 = rss_kib(d.pid);
  int fds1 = fd_count(d.pid);
  atomic_store(&sh->stop, 1);
  for (uint32_t i = 0; i < clients; i++) pthread_join(threads[i], NULL);
  for (uint32_t r = 0; r < world; r++) {
    /* A trainer stuck in a step of a world whose peer died is not waited for forever. */
    for (int t = 0; t < 100 && waitpid(trainers[r], NULL, WNOHANG) == 0; t++) usleep(50000);
    kill(trainers[r], SIGKILL);
    waitpid(trainers[r], NULL, 0);
  }
  long rss2 = rss_kib(d.pid);
  int fds2 = fd_count(d.pid);

  uint64_t steps = 0, nlat = 0, rounds = 0;
  for (uint32_t r = 0; r < world; r++) steps += sh->steps[r];
  for (uint32_t i = 0; i < clients; i++) rounds += sc[i].rounds;
  float *all = malloc(sizeof(float) * world * (size_t)LAT_CAP);
  for (uint32_t r = 0; r < world; r++) {
    uint64_t k = sh->nlat[r] < LAT_CAP ? sh->nlat[r] : LAT_CAP;
    memcpy(all + nlat, sh->lat_us[r], k * sizeof(float));
    nlat += k;
  }
  qsort(all, nlat, sizeof(float), cmp_float);
  printf("soak: world %u, %u status clients, %u s, a trainer killed every %u ms, %" PRIu64
         " elements\n",
         world, clients, seconds, kill_ms, elems);
  printf("%-28s %" PRIu64 "\n", "steps", steps);
  printf("%-28s %" PRIu64 "\n", "status rounds", rounds);
  printf("%-28s %" PRIu64 "\n", "trainers killed", kills);
  printf("%-28s %.0f / %.0f / %.0f\n", "step latency p50/p99/max us", nlat ? all[nlat / 2] : 0.0,
         nlat ? all[nlat * 99 / 100] : 0.0, nlat ? all[nlat - 1] : 0.0);
  printf("%-28s %ld -> %ld KiB (after the clients left: %ld)\n", "zerod RSS", rss0, rss1, rss2);
  printf("%-28s %d -> %d (after the clients left: %d)\n", "zerod open descriptors", fds0, fds1,
         fds2);
  uint64_t errors = 0;
  char buf[64];
  for (int i = 0; i < NCODES; i++) {
    for (int who = 0; who < 2; who++) {
      if (!sh->errors[who][i]) continue;
      errors += sh->errors[who][i];
      printf("  error %-24s %" PRIu64 " (%s)\n", index_name(i, buf, sizeof buf),
             (uint64_t)sh->errors[who][i], who ? "status clients" : "trainers");
    }
  }
  /* a kill abandons at most the step in flight: one retry for each other trainer */
  uint64_t explained = kills * (world - 1);
  printf("%-28s %" PRIu64 " (injected: at most %" PRIu64 ", one per kill and surviving trainer)\n",
         "ZD_EABORTED, retried", (uint64_t)sh->aborts, explained);
  printf("%-28s %" PRIu64 "\n", "other errors", errors);
  free(all);
  free(threads);
  free(sc);
  zdt_stop(&d, SIGTERM, 0); /* after the report: exits 1, with zerod's log, unless it exits 0 */
  return errors == 0 && sh->aborts <= explained ? 0 : 1;
}
