/* A trainer's death never costs state (docs/design.md, "When a trainer dies"): at world sizes 2
 * and 4 (one zerod of W local ranks; at W=2 also two zerods), trainers are forked processes
 * training the example MLP, and one of them kills itself with SIGKILL in the middle of a step:
 * before its scatters, between two of its per-bucket scatters, after its scatters and before its
 * step, and between two of its per-bucket gathers after a step without gather. Then every
 * trainer of a world is killed at once, each at another of those points, and all are restarted
 * together (torchrun-style).
 *
 * Each time: the surviving trainers get ZD_EABORTED well within the collective timeout
 * (ABORT_MAX_S: no wait for it, no hang, no degraded rank), naming the dead trainer's rank; the
 * killed trainer's rank is free at once; a restarted trainer reattaches alone (resumed, at the step
 * its rank holds) and the world trains on; after the last step every rank's parameters are bitwise
 * equal to those of a run of the same world in which nobody died, and every rank is healthy. The
 * times from the kill to the survivors' error and from the restart to the first step trained are
 * printed. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "harness.h"
#include "mlp.h"
#include "zerod/zerod.h"

#define MAX_RANKS   4
#define MAX_ELEMS   2048
#define STEPS       6
#define KILL_STEP   3   /* steps 0..2 are applied when a trainer dies in step 3 */
#define ABORT_MAX_S 5.0 /* half the collective timeout (10 s): released by the abort, not by it */

typedef enum point {
  ALIVE,          /* trains to the end */
  BEFORE_SCATTER, /* gradients written, nothing sent */
  MID_SCATTER,    /* the two highest buckets scattered */
  AFTER_SCATTER,  /* every bucket scattered, no step */
  DURING_GATHER,  /* stepped without gather, bucket 0 gathered */
} point_t;

static const char *point_name[] = {"alive", "before scatter", "mid-scatter",
                                   "after scatter, before step", "during gather"};

/* How every trainer of a run sends a step: zd_step with everything, per-bucket scatters then a
 * step without scatter, or also without gather and then per-bucket gathers. */
typedef enum mode { MODE_STEP, MODE_BUCKETS, MODE_GATHERS } send_mode_t;

typedef struct world {
  uint32_t world_size;
  uint32_t ndaemons;
  zdt_daemon_t daemons[2];
} world_t;

/* What the trainers (other processes) tell the test, in shared memory. */
typedef struct report {
  int aborted[MAX_RANKS]; /* ZD_EABORTED answers */
  double abort_at[MAX_RANKS];
  char abort_msg[MAX_RANKS][512];
  double killed_at[MAX_RANKS];
  double restarted_at[MAX_RANKS];
  double registered_at[MAX_RANKS];
  double training_at[MAX_RANKS]; /* a restarted trainer's first step done */
  int resumed[MAX_RANKS];
  uint64_t resume_step[MAX_RANKS];
  int busy[MAX_RANKS]; /* registers refused with ZD_EBUSY before the rank was free */
  int done[MAX_RANKS];
  int lone_registered;                /* test_bye_and_waiting_stand_in's trainer of rank 0 */
  float params[MAX_RANKS][MAX_ELEMS]; /* each rank's param buffer after the last step */
} report_t;

static report_t *rep;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void start_world(world_t *w, uint32_t world_size, uint32_t ndaemons) {
  w->world_size = world_size;
  w->ndaemons = ndaemons;
  uint32_t per = world_size / ndaemons;
  for (uint32_t i = 0; i < ndaemons; i++) {
    char ws[8], lr[8], fr[8];
    snprintf(ws, sizeof ws, "%u", world_size);
    snprintf(lr, sizeof lr, "%u", per);
    snprintf(fr, sizeof fr, "%u", i * per);
    const char *args[] = {"--world_size", ws, "--local_ranks", lr, "--first_rank", fr,
                          /* a trainer that hangs shows as a failure, not as a slow test */
                          "--collective_timeout_ms", "10000", "--connect_timeout_ms", "10000",
                          "--shutdown_timeout_ms", "1000", "--bucket_elems", "128", "--threads",
                          "1", "--log_level", "info", i ? "--rendezvous_address" : NULL,
                          w->daemons[0].control, NULL};
    zdt_start(&w->daemons[i], args);
  }
}

static const zdt_daemon_t *daemon_of(const world_t *w, uint32_t rank) {
  return &w->daemons[rank / (w->world_size / w->ndaemons)];
}

/* Every rank healthy, then a clean shutdown. */
static void stop_world(world_t *w) {
  for (uint32_t i = 0; i < w->ndaemons; i++) {
    zd_client_t *c;
    CHECK_MSG(zd_connect(w->daemons[i].socket, ZD_ANY_RANK, 0, &c) == ZD_OK, "status: %s",
              zd_last_error());
    char *status;
    CHECK_INT_EQ(zd_status(c, &status), ZD_OK);
    if (strstr(status, "health:degraded")) zdt_dump_log(&w->daemons[i]);
    CHECK_MSG(!strstr(status, "health:degraded"), "zerod %u has a degraded rank:\n%s", i, status);
    zd_free(status);
    zd_close(c);
  }
  for (uint32_t i = w->ndaemons; i-- > 0;) {
    zdt_stop(&w->daemons[i], SIGTERM, 0);
  }
}

/* ---- a trainer (a process of its own) ----------------------------------------------------------
 */

static void die_here(uint32_t rank) {
  rep->killed_at[rank] = now_s();
  raise(SIGKILL);
}

/* One request; ZD_EABORTED is recorded and returned, anything else fails the trainer. */
static int check_rc(int rc, uint32_t rank, int step, const char *what) {
  if (rc == ZD_EABORTED) {
    if (!rep->aborted[rank]++) {
      rep->abort_at[rank] = now_s();
      snprintf(rep->abort_msg[rank], sizeof rep->abort_msg[rank], "%s", zd_last_error());
    }
    return rc;
  }
  CHECK_MSG(rc == ZD_OK, "rank %u step %d: %s: %s: %s", rank, step, what, zd_err_name(rc),
            zd_last_error());
  return rc;
}

/* One step in mode m, dying at `die` (ALIVE: not at all). ZD_OK or ZD_EABORTED. */
static int send_step(zd_client_t *c, send_mode_t m, point_t die, uint32_t rank, int step,
                     uint32_t nbuckets) {
  if (die == BEFORE_SCATTER) die_here(rank);
  if (m == MODE_STEP) return check_rc(zd_step(c, NULL, NULL), rank, step, "zd_step");
  for (uint32_t b = nbuckets; b-- > 0;) {
    if (die == MID_SCATTER && b == nbuckets - 3) die_here(rank);
    check_rc(zd_scatter(c, (int)b), rank, step, "zd_scatter");
  }
  if (die == AFTER_SCATTER) die_here(rank);
  zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
  opts.flags = ZD_STEP_NO_SCATTER | (m == MODE_GATHERS ? ZD_STEP_NO_GATHER : 0);
  int rc = check_rc(zd_step(c, &opts, NULL), rank, step, "zd_step");
  if (rc || m != MODE_GATHERS) return rc;
  for (uint32_t b = 0; b < nbuckets; b++) {
    if (die == DURING_GATHER && b == 1) die_here(rank);
    check_rc(zd_gather(c, (int)b), rank, step, "zd_gather");
  }
  return ZD_OK;
}

static void trainer(const world_t *w, uint32_t rank, send_mode_t m, point_t die, int restarted) {
  uint32_t per = w->world_size / w->ndaemons;
  const char *socket = daemon_of(w, rank)->socket;
  zd_client_t *c;
  int rc;
  /* A restarted trainer may come before zerod has seen its predecessor's connection close. */
  for (;;) {
    CHECK_MSG(zd_connect(socket, (int)(rank % per), 0, &c) == ZD_OK, "connect: %s",
              zd_last_error());
    static const zd_group_t g[2] = {
        {.lr = 2e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01},
        {.lr = 1e-3, .beta1 = 0.85, .beta2 = 0.99, .eps = 1e-7, .optimizer = ZD_ADAM}};
    zd_model_desc_t desc = zdt_mlp_desc(g, 2);
    CHECK_INT_EQ(zd_layout(c, &desc), ZD_OK);
    float init[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
    float *p[MLP_NPARAMS] = {init[0], init[1], init[2], init[3]};
    mlp_init(p, 11);
    float *pb = zd_param_buffer(c, NULL);
    for (int i = 0; i < MLP_NPARAMS; i++) {
      zd_param_info_t info = ZD_PARAM_INFO_INIT;
      zd_param_info(c, (size_t)i, &info);
      memcpy(pb + info.offset, init[i], info.numel * sizeof(float));
    }
    rc = zd_register(c);
    if (rc != ZD_EBUSY || !restarted || rep->busy[rank] >= 100) break;
    rep->busy[rank]++;
    zd_close(c);
    nanosleep(&(struct timespec){.tv_nsec = 10000000}, NULL);
  }
  CHECK_MSG(rc == ZD_OK, "rank %u register: %s: %s", rank, zd_err_name(rc), zd_last_error());
  rep->registered_at[rank] = now_s();
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(c, &info);
  CHECK_MSG(info.total_elems <= MAX_ELEMS && info.nbuckets >= 3, "%llu elements, %u buckets",
            (unsigned long long)info.total_elems, info.nbuckets);
  if (restarted) {
    rep->resumed[rank] = info.resumed;
    rep->resume_step[rank] = info.step;
  }
  for (int step = (int)info.step; step < STEPS; step++) {
    float work[MLP_NPARAMS][MLP_HIDDEN * MLP_IN], grad[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
    float *p[MLP_NPARAMS], *g[MLP_NPARAMS];
    const float *pb = zd_param_buffer(c, NULL);
    float *gb = zd_grad_buffer(c, NULL);
    zd_param_info_t pi[MLP_NPARAMS];
    for (int i = 0; i < MLP_NPARAMS; i++) {
      pi[i] = (zd_param_info_t)ZD_PARAM_INFO_INIT;
      zd_param_info(c, (size_t)i, &pi[i]);
      p[i] = work[i];
      g[i] = grad[i];
      memcpy(work[i], pb + pi[i].offset, pi[i].numel * sizeof(float));
    }
    mlp_loss_grad((const float *const *)p, g, (uint64_t)step, rank);
    for (int i = 0; i < MLP_NPARAMS; i++)
      memcpy(gb + pi[i].offset, grad[i], pi[i].numel * sizeof(float));
    point_t at = step == KILL_STEP && !restarted ? die : ALIVE;
    /* ZD_EABORTED: nothing was applied; the gradients are still in the buffer. */
    while (send_step(c, m, at, rank, step, info.nbuckets) == ZD_EABORTED) {
    }
    if (restarted && !rep->training_at[rank]) rep->training_at[rank] = now_s();
  }
  memcpy(rep->params[rank], zd_param_buffer(c, NULL), info.total_elems * sizeof(float));
  rep->done[rank] = 1;
  zd_close(c);
  exit(0);
}

static pid_t spawn(const world_t *w, uint32_t rank, send_mode_t m, point_t die, int restarted) {
  fflush(NULL);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) trainer(w, rank, m, die, restarted);
  return pid;
}

/* ---- a run --------------------------------------------------------------------------------- */

/* Waits for every trainer. One killed as planned (SIGKILL) is started again at once, or, with
 * together, once every trainer that was to die is dead (torchrun restarts them all). */
static void run_world(const world_t *w, send_mode_t m, const point_t *die, int together) {
  uint32_t n = w->world_size;
  pid_t pids[MAX_RANKS];
  memset(rep, 0, sizeof *rep);
  for (uint32_t q = 0; q < n; q++) pids[q] = spawn(w, q, m, die[q], 0);
  int left = (int)n, dead = 0, victims = 0;
  for (uint32_t q = 0; q < n; q++) victims += die[q] != ALIVE;
  while (left > 0) {
    int st;
    pid_t pid = wait(&st);
    CHECK(pid > 0);
    uint32_t q = 0;
    while (q < n && pids[q] != pid) q++;
    CHECK(q < n);
    if (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL && die[q] != ALIVE && !rep->done[q] &&
        !rep->restarted_at[q]) {
      pids[q] = 0;
      if (++dead < victims && together) continue;
      for (uint32_t r = 0; r < n; r++) {
        if (pids[r]) continue;
        rep->restarted_at[r] = now_s();
        pids[r] = spawn(w, r, m, die[r], 1);
      }
      continue;
    }
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "trainer of rank %u: status 0x%x", q, st);
    CHECK_MSG(rep->done[q], "trainer of rank %u did not finish", q);
    left--;
  }
}

static void check_params(const world_t *w, const float *ref, uint64_t n, const char *what) {
  for (uint32_t q = 0; q < w->world_size; q++)
    for (uint64_t e = 0; e < n; e++)
      CHECK_MSG(memcmp(&rep->params[q][e], &ref[e], sizeof(float)) == 0,
                "%s: rank %u element %llu is %.9g, %.9g without a failure", what, q,
                (unsigned long long)e, rep->params[q][e], ref[e]);
}

/* The run without failures: every rank's final parameters, equal on every rank. */
static void reference(world_t *w, float *ref) {
  point_t none[MAX_RANKS] = {ALIVE, ALIVE, ALIVE, ALIVE};
  run_world(w, MODE_STEP, none, 0);
  memcpy(ref, rep->params[0], sizeof rep->params[0]);
  check_params(w, ref, MAX_ELEMS, "reference");
}

/* One trainer (`victim`) dies at `at`; the others survive. */
static void one_dies(world_t *w, const char *name, uint32_t victim, point_t at, const float *ref) {
  static const send_mode_t mode_of[] = {MODE_STEP, MODE_STEP, MODE_BUCKETS, MODE_BUCKETS,
                                        MODE_GATHERS};
  point_t die[MAX_RANKS] = {ALIVE, ALIVE, ALIVE, ALIVE};
  die[victim] = at;
  run_world(w, mode_of[at], die, 0);
  uint64_t applied = at == DURING_GATHER ? KILL_STEP + 1 : KILL_STEP;
  CHECK_MSG(rep->resumed[victim], "%s: the restarted trainer did not resume", name);
  /* free once zerod has seen the connection close, which may come after its trainer's restart */
  CHECK_INT_LE(rep->busy[victim], 5);
  CHECK_U64_EQ(rep->resume_step[victim], applied);
  double slowest = 0;
  char want[64];
  snprintf(want, sizeof want, "step %llu abandoned: rank %u's trainer disconnected",
           (unsigned long long)applied + 1, victim);
  for (uint32_t q = 0; q < w->world_size; q++) {
    if (q == victim) continue;
    CHECK_MSG(rep->aborted[q] == 1, "%s: rank %u got ZD_EABORTED %d times", name, q,
              rep->aborted[q]);
    CHECK_CONTAINS(rep->abort_msg[q], want);
    double took = rep->abort_at[q] - rep->killed_at[victim];
    CHECK_WITHIN(took, ABORT_MAX_S,
                 "%s: rank %u's step must be abandoned at the kill, not at "
                 "the collective timeout (10 s)",
                 name, q);
    if (took > slowest) slowest = took;
  }
  check_params(w, ref, MAX_ELEMS, name);
  printf(
      "  %s, rank %u killed %s: survivors got ZD_EABORTED %.0f ms after the kill; restarted "
      "trainer registered %.0f ms after its start (%d ZD_EBUSY), resumed at step %llu, "
      "trained again %.0f ms after its start; parameters bitwise equal\n",
      name, victim, point_name[at], 1e3 * slowest,
      1e3 * (rep->registered_at[victim] - rep->restarted_at[victim]), rep->busy[victim],
      (unsigned long long)applied, 1e3 * (rep->training_at[victim] - rep->restarted_at[victim]));
}

/* Every trainer dies in the same step, each at another point, and all are restarted. */
static void all_die(world_t *w, const char *name, const float *ref) {
  static const point_t points[MAX_RANKS] = {MID_SCATTER, BEFORE_SCATTER, AFTER_SCATTER,
                                            BEFORE_SCATTER};
  point_t die[MAX_RANKS];
  memcpy(die, points, sizeof die);
  run_world(w, MODE_BUCKETS, die, 1);
  double last = 0;
  for (uint32_t q = 0; q < w->world_size; q++) {
    CHECK_MSG(rep->resumed[q], "%s: rank %u did not resume", name, q);
    CHECK_U64_EQ(rep->resume_step[q], KILL_STEP);
    CHECK_INT_EQ(rep->aborted[q], 0);
    double took = rep->training_at[q] - rep->restarted_at[q];
    if (took > last) last = took;
  }
  check_params(w, ref, MAX_ELEMS, name);
  printf(
      "  %s, every trainer killed (at different points) and restarted: all resumed at step "
      "%d, trained again within %.0f ms; parameters bitwise equal\n",
      name, KILL_STEP, 1e3 * last);
}

/* ---- a bye in the middle of a step; a stand-in that waits ----------------------------------- */

/* How rank 0's trainer of test_bye_and_waiting_stand_in leaves after its steps. */
typedef enum lone_end {
  DIES,          /* SIGKILL at the step's edge */
  BYE_HALF_STEP, /* scatters its highest bucket, then says bye */
  REFUSED_DIES,  /* steps with another learning rate than rank 1 (refused), then SIGKILL */
} lone_end_t;

/* A trainer of its own process: registers on local rank 0 of a W=2 zerod, steps `steps` times
 * and leaves as `end` says. */
static void lone_trainer(const char *socket, int steps, lone_end_t end) {
  zd_client_t *c;
  CHECK_INT_EQ(zd_connect(socket, 0, 0, &c), ZD_OK);
  zd_group_t g[2] = {{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8},
                     {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8}};
  zd_model_desc_t desc = zdt_mlp_desc(g, 2);
  CHECK_INT_EQ(zd_layout(c, &desc), ZD_OK);
  CHECK_MSG(zd_register(c) == ZD_OK, "register: %s", zd_last_error());
  rep->lone_registered = 1;
  for (int i = 0; i < steps; i++) {
    int rc = zd_step(c, NULL, NULL);
    CHECK_MSG(rc == ZD_OK, "step: %s: %s", zd_err_name(rc), zd_last_error());
  }
  if (end == REFUSED_DIES) {
    g[0].lr = 5e-3;
    zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
    opts.groups = g;
    opts.ngroups = 2;
    CHECK_INT_EQ(zd_step(c, &opts, NULL), ZD_EHPARAM);
  }
  if (end != BYE_HALF_STEP) raise(SIGKILL);
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(c, &info);
  CHECK_INT_EQ(zd_scatter(c, (int)info.nbuckets - 1), ZD_OK);
  zd_close(c);
  exit(0);
}

static pid_t spawn_lone(const char *socket, int steps, lone_end_t end) {
  rep->lone_registered = 0;
  fflush(NULL);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) lone_trainer(socket, steps, end);
  return pid;
}

static void reap(pid_t pid, int killed) {
  int st;
  CHECK(waitpid(pid, &st, 0) == pid);
  if (killed)
    CHECK_MSG(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "status 0x%x", st);
  else
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
}

/* Rank 1's trainer is this process; rank 0's come and go:
 *   - one says bye in the middle of a step (a bucket scattered): the step is abandoned too;
 *   - one dies right after a step both ranks refused (other hyperparameters): rank 1 scatters
 *     every bucket again in its next step, and the stand-in with it;
 *   - one dies at a step's edge while rank 1 is not stepping: its rank's stand-in waits for rank 1
 *     in the next step, and a restarted trainer registering meanwhile waits behind it until
 *     rank 1 steps (abandoned: ZD_EABORTED) and retries; then both train on;
 *   - a shutdown does not wait for a stand-in that waits: zerod exits at once, not after
 *     shutdown_timeout_ms (30 s here, far from the bound of 10 s). */
static void test_bye_and_waiting_stand_in(void) {
  zdt_daemon_t d;
  const char *args[] = {"--world_size",
                        "2",
                        "--local_ranks",
                        "2",
                        "--collective_timeout_ms",
                        "10000",
                        "--shutdown_timeout_ms",
                        "30000",
                        "--bucket_elems",
                        "128",
                        "--threads",
                        "1",
                        "--log_level",
                        "info",
                        NULL};
  zdt_start(&d, args);
  pid_t a = spawn_lone(d.socket, 1, BYE_HALF_STEP);
  zd_client_t *b;
  CHECK_INT_EQ(zd_connect(d.socket, 1, 0, &b), ZD_OK);
  static const zd_group_t g[2] = {{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8},
                                  {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8}};
  zd_model_desc_t desc = zdt_mlp_desc(g, 2);
  CHECK_INT_EQ(zd_layout(b, &desc), ZD_OK);
  CHECK_MSG(zd_register(b) == ZD_OK, "register: %s", zd_last_error());
  zd_step_result_t res = ZD_STEP_RESULT_INIT;
  CHECK_MSG(zd_step(b, NULL, &res) == ZD_OK, "step: %s", zd_last_error());
  CHECK_INT_EQ(zd_step(b, NULL, &res), ZD_EABORTED);
  CHECK_CONTAINS(zd_last_error(), "step 2 abandoned: rank 0's trainer disconnected");
  reap(a, 0);
  printf("  a bye in the middle of a step (one bucket scattered): %s\n", zd_last_error());

  /* resumes, steps with b's retry, is refused with b, dies at the refused step's edge */
  a = spawn_lone(d.socket, 1, REFUSED_DIES);
  CHECK_MSG(zd_step(b, NULL, &res) == ZD_OK, "retried step: %s", zd_last_error());
  CHECK_U64_EQ(res.step, 2);
  CHECK_INT_EQ(zd_step(b, NULL, &res), ZD_EHPARAM);
  reap(a, 1);
  CHECK_INT_EQ(zd_step(b, NULL, &res), ZD_EABORTED);
  CHECK_CONTAINS(zd_last_error(), "step 3 abandoned: rank 0's trainer disconnected");
  printf(
      "  a trainer killed after a refused step: the next one abandoned (every bucket "
      "scattered again)\n");

  a = spawn_lone(d.socket, 1, DIES); /* steps with b's retry, dies at the step's edge */
  CHECK_MSG(zd_step(b, NULL, &res) == ZD_OK, "retried step: %s", zd_last_error());
  CHECK_U64_EQ(res.step, 3);
  reap(a, 1);
  a = spawn_lone(d.socket, 1, DIES);
  nanosleep(&(struct timespec){.tv_nsec = 300000000}, NULL);
  CHECK_MSG(!rep->lone_registered, "a trainer registered while its rank stood in for the last");
  double t0 = now_s();
  CHECK_INT_EQ(zd_step(b, NULL, &res), ZD_EABORTED);
  CHECK_CONTAINS(zd_last_error(), "step 4 abandoned: rank 0's trainer disconnected");
  CHECK_MSG(zd_step(b, NULL, &res) == ZD_OK, "retried step: %s", zd_last_error());
  CHECK_U64_EQ(res.step, 4);
  reap(a, 1); /* registered, stepped with b, died: its rank's stand-in waits again */
  printf(
      "  a restarted trainer waited behind its rank's stand-in until rank 1 stepped (abandoned, "
      "retried: step 4 done %.0f ms later)\n",
      1e3 * (now_s() - t0));
  nanosleep(&(struct timespec){.tv_nsec = 200000000}, NULL);
  t0 = now_s();
  zdt_stop(&d, SIGTERM, 0);
  double took = now_s() - t0;
  CHECK_WITHIN(took, 10.0,
               "a shutdown must not wait for the stand-in up to "
               "shutdown_timeout_ms (30 s)");
  printf("  SIGTERM with a stand-in waiting for a peer: zerod exited 0 in %.0f ms\n", 1e3 * took);
  zd_close(b);
}

int main(void) {
  rep = mmap(NULL, sizeof *rep, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  CHECK(rep != MAP_FAILED);
  static float ref2[MAX_ELEMS], ref4[MAX_ELEMS];
  static const point_t points[] = {BEFORE_SCATTER, MID_SCATTER, AFTER_SCATTER, DURING_GATHER};
  world_t w;

  start_world(&w, 2, 1);
  reference(&w, ref2);
  stop_world(&w);
  for (size_t i = 0; i < sizeof points / sizeof points[0]; i++) {
    start_world(&w, 2, 1);
    one_dies(&w, "W=2 (1 zerod)", (uint32_t)(i % 2), points[i], ref2);
    stop_world(&w);
  }
  for (size_t i = 0; i < sizeof points / sizeof points[0]; i++) {
    start_world(&w, 2, 2);
    one_dies(&w, "W=2 (2 zerods)", (uint32_t)((i + 1) % 2), points[i], ref2);
    stop_world(&w);
  }
  start_world(&w, 2, 1);
  all_die(&w, "W=2 (1 zerod)", ref2);
  stop_world(&w);

  start_world(&w, 4, 1);
  reference(&w, ref4);
  stop_world(&w);
  for (size_t i = 0; i < sizeof points / sizeof points[0]; i++) {
    start_world(&w, 4, 1);
    one_dies(&w, "W=4 (1 zerod)", (uint32_t)(i % 4), points[i], ref4);
    stop_world(&w);
  }
  start_world(&w, 4, 1);
  all_die(&w, "W=4 (1 zerod)", ref4);
  stop_world(&w);

  test_bye_and_waiting_stand_in();
  printf("test_abandon: ok\n");
  return 0;
}
