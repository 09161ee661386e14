/* Tests of the host half of the group communicator (devgroup.h), with threads standing in for the
 * workers of local ranks that share a GPU; no GPU is needed.
 *
 * - Joining: every member waits for the others; the handles are freed once, with the group, by
 *   the last member out; a rank joining twice and a key reused for another size are refused; a
 *   join with a member missing times out (naming how many joined), and one whose stop flag is set
 *   is cancelled.
 * - 500 collectives of 4 members in a row: between meet and done every member reads every other
 *   member's post of this very collective (a member publishes again only after done), and the
 *   posts' buffers hold that collective's values.
 * - Failures, each within its bound: members in different operations all get ZD_EPEER; a member
 *   that never comes makes the others time out with a message naming it, and every later meet
 *   fails at once with the same reason; a break from another thread (an abort) wakes a waiting
 *   meet at once; rendezvous B after a break still completes when the late member comes within
 *   the grace, and otherwise ends after it.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "devgroup.h"

static atomic_int freed;

static void count_free(void *h) {
  (void)h;
  atomic_fetch_add(&freed, 1);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct member {
  const char *key;
  uint32_t rank, size;
  int timeout_ms;
  atomic_int *stop;
  zd__devgroup_t *g;
  int rc;
  zd__err_t err;
  /* a run of collectives */
  int rounds;
  uint32_t bucket; /* what it publishes (the mismatch test changes one) */
  int skip_meet;   /* joins, then never meets */
  int value;       /* the buffer its posts name: the round number */
  double took;
} member_t;

static void *join_main(void *arg) {
  member_t *m = arg;
  static int h[2];
  void *handles[ZD__DEVGROUP_HANDLES] = {&h[0], &h[1]};
  m->rc = zd__devgroup_join(m->key, m->rank, m->size, 0, handles, count_free, m->timeout_ms,
                            m->stop, &m->g, &m->err);
  return NULL;
}

/* Joins, then runs m->rounds collectives, checking every post between meet and done. */
static void *run_main(void *arg) {
  member_t *m = arg;
  join_main(m);
  if (m->rc || m->skip_meet) return NULL;
  double t0 = now_s();
  for (int round = 0; round < m->rounds; round++) {
    m->value = round;
    zd__devgroup_post_t p = {
        .op = 1, .bucket = m->bucket, .dtype = 1, .elems = 64, .src = &m->value};
    m->rc = zd__devgroup_meet(m->g, m->rank, &p, m->timeout_ms, "the test collective", &m->err);
    if (m->rc) break;
    for (uint32_t r = 0; r < m->size; r++) {
      const zd__devgroup_post_t *q = zd__devgroup_post(m->g, r);
      int seen = *(const int *)q->src;
      CHECK_MSG(seen == round, "rank %u, round %d: rank %u's buffer holds round %d", m->rank, round,
                r, seen);
    }
    m->rc = zd__devgroup_done(m->g, m->rank, m->timeout_ms, "the test collective", &m->err);
    if (m->rc) break;
  }
  m->took = now_s() - t0;
  return NULL;
}

static void run(member_t *m, uint32_t n, void *(*fn)(void *)) {
  pthread_t th[ZD__DEVGROUP_MAX];
  for (uint32_t r = 0; r < n; r++) CHECK(pthread_create(&th[r], NULL, fn, &m[r]) == 0);
  for (uint32_t r = 0; r < n; r++) pthread_join(th[r], NULL);
}

static void leave_all(member_t *m, uint32_t n) {
  for (uint32_t r = 0; r < n; r++) zd__devgroup_leave(m[r].g);
}

static void test_join(void) {
  atomic_store(&freed, 0);
  member_t m[3];
  for (uint32_t r = 0; r < 3; r++)
    m[r] = (member_t){.key = "join", .rank = r, .size = 3, .timeout_ms = 5000};
  run(m, 3, join_main);
  for (uint32_t r = 0; r < 3; r++) CHECK_MSG(m[r].rc == ZD_OK, "rank %u: %s", r, m[r].err.msg);
  CHECK(m[0].g == m[1].g && m[1].g == m[2].g);
  CHECK_INT_EQ(zd__devgroup_size(m[0].g), 3);
  zd__devgroup_leave(m[0].g);
  zd__devgroup_leave(m[1].g);
  CHECK_INT_EQ(atomic_load(&freed), 0); /* a peer may still wait on them */
  zd__devgroup_leave(m[2].g);
  CHECK_INT_EQ(atomic_load(&freed), 6);

  /* A rank twice, and the key of a group of another size. */
  member_t a = {.key = "twice", .rank = 0, .size = 2, .timeout_ms = 5000};
  pthread_t th;
  CHECK(pthread_create(&th, NULL, join_main, &a) == 0);
  usleep(50000);
  member_t dup = {.key = "twice", .rank = 0, .size = 2, .timeout_ms = 5000};
  join_main(&dup);
  CHECK_INT_EQ(dup.rc, ZD_EINTERNAL);
  CHECK_CONTAINS(dup.err.msg, "rank 0 joined twice");
  member_t other = {.key = "twice", .rank = 1, .size = 3, .timeout_ms = 5000};
  join_main(&other);
  CHECK_INT_EQ(other.rc, ZD_EINTERNAL);
  CHECK_CONTAINS(other.err.msg, "2 ranks on GPU 0, joined as one of 3");
  member_t b = {.key = "twice", .rank = 1, .size = 2, .timeout_ms = 5000};
  join_main(&b);
  pthread_join(th, NULL);
  CHECK_MSG(a.rc == ZD_OK && b.rc == ZD_OK, "%s / %s", a.err.msg, b.err.msg);
  zd__devgroup_leave(a.g);
  zd__devgroup_leave(b.g);

  /* A member missing: the join times out; a stop flag cancels it. */
  member_t alone = {.key = "alone", .rank = 1, .size = 2, .timeout_ms = 200};
  double t0 = now_s();
  join_main(&alone);
  CHECK_INT_EQ(alone.rc, -ETIMEDOUT);
  CHECK_CONTAINS(alone.err.msg, "1 of the group's 2 ranks joined within 200 ms");
  CHECK_WITHIN(now_s() - t0, 2.0, "the join's timeout");
  atomic_int stop = 1;
  member_t stopped = {.key = "stopped", .rank = 0, .size = 2, .timeout_ms = 60000, .stop = &stop};
  t0 = now_s();
  join_main(&stopped);
  CHECK_INT_EQ(stopped.rc, -ECANCELED);
  CHECK_WITHIN(now_s() - t0, 1.0, "a cancelled join");
}

static void test_rounds(void) {
  member_t m[4];
  for (uint32_t r = 0; r < 4; r++)
    m[r] = (member_t){.key = "rounds", .rank = r, .size = 4, .timeout_ms = 10000, .rounds = 500};
  run(m, 4, run_main);
  for (uint32_t r = 0; r < 4; r++) CHECK_MSG(m[r].rc == ZD_OK, "rank %u: %s", r, m[r].err.msg);
  CHECK(!zd__devgroup_failed(m[0].g));
  leave_all(m, 4);
}

static void test_mismatch(void) {
  member_t m[3];
  for (uint32_t r = 0; r < 3; r++)
    m[r] = (member_t){
        .key = "mismatch", .rank = r, .size = 3, .timeout_ms = 10000, .rounds = 3, .bucket = 3};
  m[1].bucket = 2;
  run(m, 3, run_main);
  for (uint32_t r = 0; r < 3; r++) {
    CHECK_INT_EQ(m[r].rc, ZD_EPEER);
    CHECK_CONTAINS(m[r].err.msg, "collectives out of step");
    CHECK_WITHIN(m[r].took, 2.0, "the mismatch");
  }
  leave_all(m, 3);
}

static void test_missing(void) {
  member_t m[3];
  for (uint32_t r = 0; r < 3; r++)
    m[r] = (member_t){.key = "missing", .rank = r, .size = 3, .timeout_ms = 1500, .rounds = 1};
  m[2].skip_meet = 1;
  run(m, 3, run_main);
  for (uint32_t r = 0; r < 2; r++) {
    CHECK_INT_EQ(m[r].rc, -ETIMEDOUT);
    CHECK_CONTAINS(m[r].err.msg,
                   "the test collective: rank(s) 2 of the group did not arrive "
                   "within 1500 ms");
    CHECK_WITHIN(m[r].took, 6.0, "the timeout of a rendezvous");
  }
  /* Broken for good: the late member fails at once, with the first reason. */
  zd__devgroup_post_t p = {.op = 1, .bucket = 0, .dtype = 1, .elems = 64, .src = &m[2].value};
  zd__err_t err = {0};
  double t0 = now_s();
  CHECK_INT_EQ(zd__devgroup_meet(m[2].g, 2, &p, 10000, "late", &err), -ETIMEDOUT);
  CHECK_CONTAINS(err.msg, "rank(s) 2 of the group did not arrive");
  CHECK_WITHIN(now_s() - t0, 0.5, "a meet on a broken group");
  leave_all(m, 3);
}

typedef struct breaker {
  zd__devgroup_t *g;
  int after_ms;
} breaker_t;

static void *break_main(void *arg) {
  breaker_t *b = arg;
  usleep((useconds_t)b->after_ms * 1000);
  zd__devgroup_break(b->g, -ECANCELED, "aborted (%s)", "zerod is shutting down");
  return NULL;
}

static void test_abort(void) {
  member_t m[2];
  for (uint32_t r = 0; r < 2; r++)
    m[r] = (member_t){.key = "abort", .rank = r, .size = 2, .timeout_ms = 60000, .rounds = 1};
  m[1].skip_meet = 1;
  run(m, 2, join_main);
  breaker_t b = {.g = m[0].g, .after_ms = 100};
  pthread_t th;
  CHECK(pthread_create(&th, NULL, break_main, &b) == 0);
  double t0 = now_s();
  zd__devgroup_post_t p = {.op = 1, .bucket = 0, .dtype = 1, .elems = 64, .src = &m[0].value};
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__devgroup_meet(m[0].g, 0, &p, 60000, "the scatter", &err), -ECANCELED);
  CHECK_CONTAINS(err.msg, "aborted (zerod is shutting down)");
  CHECK_WITHIN(now_s() - t0, 1.0, "an aborted meet");
  pthread_join(th, NULL);
  CHECK_INT_EQ(zd__devgroup_failed(m[1].g), -ECANCELED);
  leave_all(m, 2);
}

typedef struct doner {
  zd__devgroup_t *g;
  uint32_t rank;
  int after_ms;
  int rc;
  zd__err_t err;
  double took;
} doner_t;

static void *done_main(void *arg) {
  doner_t *d = arg;
  usleep((useconds_t)d->after_ms * 1000);
  double t0 = now_s();
  d->rc = zd__devgroup_done(d->g, d->rank, 60000, "the gather", &d->err);
  d->took = now_s() - t0;
  return NULL;
}

static void *meet_main(void *arg) {
  member_t *m = arg;
  zd__devgroup_post_t p = {.op = 2, .bucket = 1, .dtype = 2, .elems = 8, .src = &m->value};
  m->rc = zd__devgroup_meet(m->g, m->rank, &p, m->timeout_ms, "the gather", &m->err);
  return NULL;
}

/* Both members pass meet; the group breaks while rank 0 waits in done; rank 1 comes late_ms
 * after rank 0 (-1: never). */
static void done_after_break(const char *key, int late_ms, doner_t d[2]) {
  member_t m[2];
  for (uint32_t r = 0; r < 2; r++)
    m[r] = (member_t){.key = key, .rank = r, .size = 2, .timeout_ms = 60000};
  run(m, 2, join_main);
  run(m, 2, meet_main);
  CHECK_MSG(m[0].rc == ZD_OK && m[1].rc == ZD_OK, "%s / %s", m[0].err.msg, m[1].err.msg);
  d[0] = (doner_t){.g = m[0].g, .rank = 0, .after_ms = 0};
  d[1] = (doner_t){.g = m[1].g, .rank = 1, .after_ms = late_ms};
  breaker_t b = {.g = m[0].g, .after_ms = 100};
  pthread_t th[3];
  CHECK(pthread_create(&th[0], NULL, done_main, &d[0]) == 0);
  CHECK(pthread_create(&th[1], NULL, break_main, &b) == 0);
  if (late_ms >= 0) CHECK(pthread_create(&th[2], NULL, done_main, &d[1]) == 0);
  pthread_join(th[0], NULL);
  pthread_join(th[1], NULL);
  if (late_ms >= 0) pthread_join(th[2], NULL);
  leave_all(m, 2);
}

static void test_done_grace(void) {
  doner_t d[2];
  /* The late member comes within the grace: done completes for both (every read is over). */
  done_after_break("grace", 400, d);
  CHECK_MSG(d[0].rc == ZD_OK && d[1].rc == ZD_OK, "%s / %s", d[0].err.msg, d[1].err.msg);
  CHECK_MSG(d[0].took >= 0.3, "done returned after %.3f s, before the late member came", d[0].took);
  /* It never comes: done ends after the grace, with the break's reason. */
  done_after_break("no grace", -1, d);
  CHECK_INT_EQ(d[0].rc, -ECANCELED);
  CHECK_CONTAINS(d[0].err.msg, "aborted (zerod is shutting down)");
  CHECK_MSG(d[0].took >= ZD__DEVGROUP_GRACE_MS / 1000.0 - 0.2, "done gave up after %.3f s",
            d[0].took);
  CHECK_WITHIN(d[0].took, ZD__DEVGROUP_GRACE_MS / 1000.0 + 2.0, "rendezvous B after a break");
}

int main(void) {
  test_join();
  test_rounds();
  test_mismatch();
  test_missing();
  test_abort();
  test_done_grace();
  printf("test_devgroup: ok\n");
  return 0;
}
