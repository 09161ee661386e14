/* Fork-join pool (pool.h).
 *
 * A run is a descriptor on the caller's stack, published through `current`; chunks are claimed
 * from its shared position with a compare-and-swap, so no lock is taken on the hot path. The
 * caller may return (and its descriptor go away) only when no helper can still be reading it:
 * helpers count themselves in `inside` before they load `current`, and the caller clears
 * `current` before it waits for `inside` to drain. Both sides of that handshake, and of the two
 * sleep/wake handshakes (helpers waiting for a run, the caller waiting for helpers), are
 * sequentially consistent store-then-load pairs: of the two threads, at least one sees the
 * other's store, so no wake-up is lost.
 */
#include "pool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* How long a helper keeps looking for the next run before it sleeps, and how long the caller
 * spins for the helpers' last chunks before it sleeps. The runs of one step (statistics, then the
 * update of each bucket) follow each other within microseconds, and the last chunks are small;
 * a longer spin would take a CPU from the loop thread and the client just when the step's reply
 * needs them. */
#define HELPER_SPIN_NS 20000
#define CALLER_SPIN_NS 200000

typedef struct run {
  zd__pool_fn fn;
  void *arg;
  uint64_t n, grain;
  unsigned threads;           /* the most threads this run may use, the caller included */
  _Atomic uint64_t next;      /* first element not handed out yet */
  atomic_uint helpers_joined; /* helpers that came to this run; the first threads - 1 work */
} run_t;

struct zd__pool {
  unsigned nthreads;
  unsigned cpus; /* zd__pool_cpus */
  pthread_t *threads;
  pthread_mutex_t run_lock; /* one zd__pool_for at a time */
  _Atomic(run_t *) current; /* the run in progress; NULL once its caller stops handing out */
  atomic_ulong generation;  /* bumped for each run that wakes helpers */
  atomic_uint inside;       /* helpers that may be reading `current` */
  atomic_uint sleepers;     /* helpers asleep on `wake`, or about to be */
  atomic_int caller_waiting;
  atomic_int stop;
  pthread_mutex_t lock;  /* for the condition variables only */
  pthread_cond_t wake;   /* helpers: a new run, or stop */
  pthread_cond_t idle;   /* the caller: inside dropped to 0 */
  int pinned;            /* helper i is bound to the i-th CPU of the mask (pool.h) */
  cpu_set_t caller_cpus; /* the mask's CPUs no helper is bound to: the caller's during a run */
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Guided scheduling: each claim takes 1 / (2 * threads) of what is left, in whole grains, so
 * early chunks are large (few claims) and the last ones a grain (the threads end together). */
static int claim(run_t *r, uint64_t *begin, uint64_t *end) {
  uint64_t at = atomic_load_explicit(&r->next, memory_order_relaxed);
  for (;;) {
    if (at >= r->n) return 0;
    uint64_t left = r->n - at;
    uint64_t size = (left / (2 * (uint64_t)r->threads) + r->grain - 1) / r->grain * r->grain;
    if (size < r->grain) size = r->grain;
    if (size > left) size = left;
    if (atomic_compare_exchange_weak_explicit(&r->next, &at, at + size, memory_order_relaxed,
                                              memory_order_relaxed)) {
      *begin = at;
      *end = at + size;
      return 1;
    }
  }
}

static void work(run_t *r, unsigned thread) {
  uint64_t b, e;
  while (claim(r, &b, &e)) r->fn(r->arg, b, e, thread);
}

/* Sleeps until a run newer than `seen` is published, or stop. */
static void sleep_for_run(zd__pool_t *p, unsigned long seen) {
  pthread_mutex_lock(&p->lock);
  atomic_fetch_add(&p->sleepers, 1);
  while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop))
    pthread_cond_wait(&p->wake, &p->lock);
  atomic_fetch_sub(&p->sleepers, 1);
  pthread_mutex_unlock(&p->lock);
}

static void *helper_main(void *arg) {
  zd__pool_t *p = arg;
  unsigned long seen = 0;
  for (;;) {
    uint64_t since = now_ns();
    unsigned spins = 0;
    while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop)) {
      cpu_relax();
      if (++spins % 64 == 0 && now_ns() - since > HELPER_SPIN_NS) {
        sleep_for_run(p, seen);
        since = now_ns();
      }
    }
    if (atomic_load(&p->stop)) break;
    seen = atomic_load(&p->generation);
    atomic_fetch_add(&p->inside, 1);
    run_t *r = atomic_load(&p->current);
    if (r) {
      unsigned joined = atomic_fetch_add(&r->helpers_joined, 1);
      if (joined + 1 < r->threads) work(r, joined + 1);
    }
    if (atomic_fetch_sub(&p->inside, 1) == 1 && atomic_load(&p->caller_waiting)) {
      pthread_mutex_lock(&p->lock);
      pthread_cond_signal(&p->idle);
      pthread_mutex_unlock(&p->lock);
    }
  }
  return NULL;
}

unsigned zd__pool_cpus(const zd__pool_t *pool) {
  return pool->cpus;
}

int zd__pool_pinned(const zd__pool_t *pool) {
  return pool->pinned;
}

/* Binds helper i to the i-th CPU of mask, and leaves the caller the rest; on any failure unbinds
 * them all again. */
static void pin_helpers(zd__pool_t *p, const cpu_set_t *mask) {
  if (p->nthreads < 2 || (unsigned)CPU_COUNT(mask) < p->nthreads) return;
  p->caller_cpus = *mask;
  unsigned i = 0;
  int ok = 1;
  for (int cpu = 0; cpu < CPU_SETSIZE && i < p->nthreads && ok; cpu++) {
    if (!CPU_ISSET(cpu, mask)) continue;
    if (i > 0) { /* the first CPU stays the caller's */
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      ok = pthread_setaffinity_np(p->threads[i], sizeof one, &one) == 0;
      CPU_CLR(cpu, &p->caller_cpus);
    }
    i++;
  }
  if (ok) {
    p->pinned = 1;
    return;
  }
  for (unsigned h = 1; h < p->nthreads; h++)
    pthread_setaffinity_np(p->threads[h], sizeof *mask, mask);
}

int zd__pool_create(unsigned nthreads, int pin, zd__pool_t **out) {
  cpu_set_t mask;
  int have_mask = sched_getaffinity(0, sizeof mask, &mask) == 0 && CPU_COUNT(&mask) > 0;
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  unsigned cpus = have_mask ? (unsigned)CPU_COUNT(&mask) : online > 0 ? (unsigned)online : 1;
  if (nthreads == 0) nthreads = cpus;
  zd__pool_t *p = calloc(1, sizeof *p);
  if (!p) return -ENOMEM;
  p->threads = calloc(nthreads, sizeof *p->threads);
  if (!p->threads) {
    free(p);
    return -ENOMEM;
  }
  pthread_mutex_init(&p->run_lock, NULL);
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->wake, NULL);
  pthread_cond_init(&p->idle, NULL);
  p->cpus = cpus;
  p->nthreads = 1;
  for (unsigned i = 1; i < nthreads; i++) {
    int rc = pthread_create(&p->threads[i], NULL, helper_main, p);
    if (rc) {
      zd__pool_destroy(p);
      return -rc;
    }
    p->nthreads++;
  }
  if (pin && have_mask) pin_helpers(p, &mask);
  *out = p;
  return 0;
}

void zd__pool_destroy(zd__pool_t *pool) {
  if (!pool) return;
  pthread_mutex_lock(&pool->lock);
  atomic_store(&pool->stop, 1);
  pthread_cond_broadcast(&pool->wake);
  pthread_mutex_unlock(&pool->lock);
  for (unsigned i = 1; i < pool->nthreads; i++) pthread_join(pool->threads[i], NULL);
  pthread_cond_destroy(&pool->idle);
  pthread_cond_destroy(&pool->wake);
  pthread_mutex_destroy(&pool->lock);
  pthread_mutex_destroy(&pool->run_lock);
  free(pool->threads);
  free(pool);
}

unsigned zd__pool_size(const zd__pool_t *pool) {
  return pool->nthreads;
}

unsigned zd__pool_threads_for(const zd__pool_t *pool, uint64_t n, uint64_t grain,
                              uint64_t min_per_thread) {
  if (grain == 0) grain = 1;
  if (min_per_thread < grain) min_per_thread = grain;
  uint64_t want = n / min_per_thread;
  return want < 1 ? 1 : want > pool->nthreads ? pool->nthreads : (unsigned)want;
}

void zd__pool_for(zd__pool_t *pool, uint64_t n, uint64_t grain, uint64_t min_per_thread,
                  zd__pool_fn fn, void *arg) {
  if (n == 0) return;
  if (grain == 0) grain = 1;
  unsigned threads = zd__pool_threads_for(pool, n, grain, min_per_thread);
  if (threads == 1) {
    fn(arg, 0, n, 0);
    return;
  }
  run_t r = {.fn = fn, .arg = arg, .n = n, .grain = grain, .threads = threads};
  pthread_mutex_lock(&pool->run_lock);
  atomic_store(&pool->current, &r);
  atomic_fetch_add(&pool->generation, 1);
  unsigned asleep = atomic_load(&pool->sleepers);
  if (asleep) {
    pthread_mutex_lock(&pool->lock);
    for (unsigned i = 0; i < asleep && i + 1 < threads; i++) pthread_cond_signal(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
  }
  /* Off the helpers' CPUs for the run (after the wake-ups, so a helper woken on this CPU starts
   * while the caller moves). A caller on one of them is migrated at once. */
  cpu_set_t before;
  int moved =
      pool->pinned && pthread_getaffinity_np(pthread_self(), sizeof before, &before) == 0 &&
      pthread_setaffinity_np(pthread_self(), sizeof pool->caller_cpus, &pool->caller_cpus) == 0;
  work(&r, 0);
  /* Nothing is left to hand out; wait until no helper can still touch r. */
  atomic_store(&pool->current, NULL);
  uint64_t since = now_ns();
  unsigned spins = 0;
  while (atomic_load(&pool->inside)) {
    cpu_relax();
    if (++spins % 64 == 0 && now_ns() - since > CALLER_SPIN_NS) {
      pthread_mutex_lock(&pool->lock);
      atomic_store(&pool->caller_waiting, 1);
      while (atomic_load(&pool->inside)) pthread_cond_wait(&pool->idle, &pool->lock);
      atomic_store(&pool->caller_waiting, 0);
      pthread_mutex_unlock(&pool->lock);
    }
  }
  pthread_mutex_unlock(&pool->run_lock);
  if (moved) pthread_setaffinity_np(pthread_self(), sizeof before, &before);
}
