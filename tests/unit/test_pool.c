/* Unit test of the fork-join pool (daemon/backends/pool.c): every element of a range is run
 * exactly once, in chunks on grain boundaries, by no more threads than the range pays for, with
 * thread numbers that are in range and never run two chunks at once; a range too small for two
 * threads runs inline on the caller; runs issued back to back, after the helpers fell asleep, and
 * from several threads at once all complete; a bound pool runs each thread on a CPU of its own.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "check.h"
#include "pool.h"

#define MAXN 200000

typedef struct {
  uint64_t n, grain;
  unsigned size;
  atomic_uchar *seen;    /* per element: times run */
  atomic_int busy[64];   /* per thread number: a chunk is running */
  atomic_int used[64];   /* per thread number: ran something */
  atomic_int bad_bounds; /* chunks not on grain boundaries, or out of range */
  atomic_int overlap;    /* a thread number ran two chunks at once */
  atomic_int calls;
  pthread_t caller;
  atomic_int on_caller; /* chunks run on the calling thread */
} run_t;

static void chunk(void *arg, uint64_t b, uint64_t e, unsigned thread) {
  run_t *r = arg;
  atomic_fetch_add(&r->calls, 1);
  if (thread >= r->size || b >= e || e > r->n || b % r->grain || (e % r->grain && e != r->n))
    atomic_fetch_add(&r->bad_bounds, 1);
  if (thread >= r->size) return;
  int zero = 0;
  if (!atomic_compare_exchange_strong(&r->busy[thread], &zero, 1)) atomic_fetch_add(&r->overlap, 1);
  atomic_store(&r->used[thread], 1);
  if (pthread_equal(pthread_self(), r->caller)) atomic_fetch_add(&r->on_caller, 1);
  for (uint64_t i = b; i < e; i++) atomic_fetch_add(&r->seen[i], 1);
  atomic_store(&r->busy[thread], 0);
}

static run_t *run_new(void) {
  run_t *r = calloc(1, sizeof *r);
  CHECK(r != NULL);
  r->seen = calloc(MAXN, sizeof *r->seen);
  CHECK(r->seen != NULL);
  return r;
}

/* One run of n elements, checked. */
static void check_run(zd__pool_t *pool, run_t *r, uint64_t n, uint64_t grain, uint64_t min) {
  unsigned size = zd__pool_size(pool);
  for (uint64_t i = 0; i < n; i++) atomic_store(&r->seen[i], 0);
  for (int t = 0; t < 64; t++) atomic_store(&r->used[t], 0);
  r->n = n;
  r->grain = grain;
  r->size = size;
  r->caller = pthread_self();
  atomic_store(&r->calls, 0);
  atomic_store(&r->on_caller, 0);
  zd__pool_for(pool, n, grain, min, chunk, r);
  for (uint64_t i = 0; i < n; i++)
    CHECK_MSG(atomic_load(&r->seen[i]) == 1,
              "n %llu grain %llu min %llu: element %llu ran %d times", (unsigned long long)n,
              (unsigned long long)grain, (unsigned long long)min, (unsigned long long)i,
              atomic_load(&r->seen[i]));
  CHECK_INT_EQ(atomic_load(&r->bad_bounds), 0);
  CHECK_INT_EQ(atomic_load(&r->overlap), 0);
  uint64_t eff_min = min < grain ? grain : min;
  uint64_t allowed = n / eff_min < 1 ? 1 : n / eff_min;
  int used = 0;
  for (int t = 0; t < 64; t++) used += atomic_load(&r->used[t]);
  CHECK_MSG((uint64_t)used <= allowed, "n %llu min %llu: %d threads used, %llu allowed",
            (unsigned long long)n, (unsigned long long)min, used, (unsigned long long)allowed);
  /* What a step's reply reports (idle_cpus): the threads the run was allowed, at most the pool. */
  unsigned told = zd__pool_threads_for(pool, n, grain, min);
  CHECK_MSG(told == (allowed < size ? allowed : size) && (unsigned)used <= told,
            "n %llu min %llu: zd__pool_threads_for says %u; %d used, %llu allowed, pool of %u",
            (unsigned long long)n, (unsigned long long)min, told, used, (unsigned long long)allowed,
            size);
  if (n && allowed < 2) { /* inline: one call, on the caller, thread 0 */
    CHECK_INT_EQ(atomic_load(&r->calls), 1);
    CHECK_INT_EQ(atomic_load(&r->on_caller), 1);
    CHECK_INT_EQ(atomic_load(&r->used[0]), 1);
  }
  if (n == 0) CHECK_INT_EQ(atomic_load(&r->calls), 0);
}

static void test_ranges(void) {
  unsigned sizes[] = {1, 2, 3, 8};
  uint64_t ns[] = {0, 1, 63, 64, 4095, 4096, 4097, 65536, 123457, MAXN};
  uint64_t grains[] = {1, 7, 64, 4096};
  uint64_t mins[] = {0, 1, 1000, 32768, 1u << 20};
  run_t *r = run_new();
  for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
    zd__pool_t *pool;
    CHECK_INT_EQ(zd__pool_create(sizes[s], (int)(s % 2), &pool), 0); /* bound and not */
    CHECK_INT_EQ(zd__pool_size(pool), sizes[s]);
    for (size_t i = 0; i < sizeof ns / sizeof *ns; i++)
      for (size_t g = 0; g < sizeof grains / sizeof *grains; g++)
        for (size_t m = 0; m < sizeof mins / sizeof *mins; m++)
          check_run(pool, r, ns[i], grains[g], mins[m]);
    zd__pool_destroy(pool);
  }
  free(r->seen);
  free(r);
  zd__pool_destroy(NULL); /* accepted */
}

/* Runs with pauses longer than the helpers' spin, so each run must wake a sleeping helper. */
static void test_sleep_wake(void) {
  zd__pool_t *pool;
  CHECK_INT_EQ(zd__pool_create(2, 1, &pool), 0);
  run_t *r = run_new();
  for (int i = 0; i < 200; i++) {
    check_run(pool, r, 8192 + (uint64_t)i, 64, 64);
    if (i % 2) usleep(1000);
  }
  for (int i = 0; i < 20000; i++) check_run(pool, r, 512, 64, 64); /* back to back */
  zd__pool_destroy(pool);
  free(r->seen);
  free(r);
}

/* Several threads sharing one pool, as the local ranks of a daemon do. */
static zd__pool_t *shared_pool;

static void *caller_main(void *arg) {
  (void)arg;
  run_t *r = run_new();
  for (int i = 0; i < 2000; i++) check_run(shared_pool, r, 1000 + (uint64_t)(i % 7) * 300, 16, 64);
  free(r->seen);
  free(r);
  return NULL;
}

static void test_concurrent_callers(void) {
  CHECK_INT_EQ(zd__pool_create(3, 1, &shared_pool), 0);
  pthread_t t[3];
  for (int i = 0; i < 3; i++) CHECK_INT_EQ(pthread_create(&t[i], NULL, caller_main, NULL), 0);
  for (int i = 0; i < 3; i++) pthread_join(t[i], NULL);
  zd__pool_destroy(shared_pool);
}

/* A bound pool of two, each run after its helper fell asleep: the helper always runs on the same
 * CPU, and the caller never on that one, during the run and after it (its own mask is given back).
 * Unbound, the scheduler woke the helper on the caller's CPU in a quarter to half of such runs on
 * the 2-vCPU machine this was written on. */
typedef struct {
  atomic_int cpu[2]; /* per thread number: the CPU of its last chunk, -1 none */
  atomic_int moved;  /* a helper chunk ran on another CPU than the helper's earlier ones */
  atomic_int helper_cpu;
  atomic_int helper_cpus_allowed; /* CPUs in the helper's affinity mask at its last chunk */
  atomic_int caller_may_share;    /* the caller's mask held the helper's CPU during a run */
} placement_t;

static void place_chunk(void *arg, uint64_t b, uint64_t e, unsigned thread) {
  placement_t *p = arg;
  int cpu = sched_getcpu();
  atomic_store(&p->cpu[thread], cpu);
  cpu_set_t allowed;
  CHECK(sched_getaffinity(0, sizeof allowed, &allowed) == 0);
  if (thread == 1) atomic_store(&p->helper_cpus_allowed, CPU_COUNT(&allowed));
  int h = atomic_load(&p->helper_cpu);
  if (thread == 0 && h >= 0 && CPU_ISSET(h, &allowed)) atomic_fetch_add(&p->caller_may_share, 1);
  if (thread == 1) {
    int expect = -1;
    if (!atomic_compare_exchange_strong(&p->helper_cpu, &expect, cpu) && expect != cpu)
      atomic_fetch_add(&p->moved, 1);
  }
  for (volatile uint64_t i = b; i < e; i++) continue; /* a few microseconds of work per chunk */
}

static void test_pinned(void) {
  cpu_set_t mine;
  CHECK(sched_getaffinity(0, sizeof mine, &mine) == 0);
  zd__pool_t *pool;
  CHECK_INT_EQ(zd__pool_create(2, 1, &pool), 0);
  /* Binding may be forbidden here (a seccomp filter without sched_setaffinity): then the pool
   * must say it is not bound, and run unbound. */
  int permitted = pthread_setaffinity_np(pthread_self(), sizeof mine, &mine) == 0;
  if (CPU_COUNT(&mine) < 2 || !permitted) {
    CHECK_INT_EQ(zd__pool_pinned(pool), 0);
    zd__pool_destroy(pool);
    printf("  %s: the pool is not bound\n",
           permitted ? "one CPU" : "binding threads is not permitted here");
    return;
  }
  CHECK_INT_EQ(zd__pool_pinned(pool), 1);
  placement_t p = {.helper_cpu = -1};
  int both = 0, runs = 40;
  for (int i = 0; i < runs; i++) {
    usleep(2000); /* past the helper's spin: it sleeps */
    atomic_store(&p.cpu[0], -1);
    atomic_store(&p.cpu[1], -1);
    zd__pool_for(pool, 1u << 20, 4096, 1u << 19, place_chunk, &p);
    int c0 = atomic_load(&p.cpu[0]), c1 = atomic_load(&p.cpu[1]);
    if (c1 >= 0) {
      both++;
      CHECK_MSG(c0 != c1, "run %d: the caller and the helper both ran on CPU %d", i, c0);
    }
    cpu_set_t now;
    CHECK(sched_getaffinity(0, sizeof now, &now) == 0);
    CHECK_MSG(CPU_EQUAL(&now, &mine), "run %d: the caller's affinity mask was not given back", i);
  }
  CHECK_MSG(atomic_load(&p.moved) == 0, "the bound helper ran on %d other CPUs",
            atomic_load(&p.moved));
  CHECK_MSG(atomic_load(&p.helper_cpus_allowed) == 1, "the helper may run on %d CPUs; expected 1",
            atomic_load(&p.helper_cpus_allowed));
  CHECK_MSG(atomic_load(&p.caller_may_share) == 0,
            "in %d chunks the caller's mask held the helper's CPU",
            atomic_load(&p.caller_may_share));
  CHECK_MSG(both > 0, "the helper joined none of %d runs", runs);
  zd__pool_destroy(pool);
  CHECK_INT_EQ(zd__pool_create(2, 0, &pool), 0);
  CHECK_INT_EQ(zd__pool_pinned(pool), 0);
  zd__pool_destroy(pool);
  printf("  bound pool of 2: helper on CPU %d, joined %d of %d runs, never on the caller's CPU\n",
         atomic_load(&p.helper_cpu), both, runs);
}

int main(void) {
  test_ranges();
  test_pinned();
  test_sleep_wake();
  test_concurrent_callers();
  printf("pool: ok\n");
  return 0;
}
