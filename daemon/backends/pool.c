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
 *
 * Helper i is thread number i of every run and works in a run of `threads` only if i < threads;
 * a run wakes exactly those helpers, each on its own condition variable. So a run's threads are
 * known before it starts, and with bound threads (pool.h) the caller keeps every CPU but theirs.
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
  unsigned threads;      /* threads this run uses, the caller included: helpers 1..threads-1 */
  _Atomic uint64_t next; /* first element not handed out yet */
} run_t;

typedef struct helper {
  struct zd__pool *pool;
  unsigned index;      /* its thread number in every run, >= 1 */
  int cpu;             /* the CPU it is bound to; -1 unbound */
  atomic_int asleep;   /* on `wake`, or about to be */
  pthread_cond_t wake; /* a new run that uses it, or stop */
} helper_t;

struct zd__pool {
  unsigned nthreads;
  unsigned cpus; /* zd__pool_cpus */
  pthread_t *threads;
  helper_t *helpers;        /* [i] for helper i, 1 <= i < nthreads */
  pthread_mutex_t run_lock; /* one zd__pool_for at a time */
  _Atomic(run_t *) current; /* the run in progress; NULL once its caller stops handing out */
  atomic_ulong generation;  /* bumped for each run that wakes helpers */
  atomic_uint inside;       /* helpers that may be reading `current` */
  atomic_int caller_waiting;
  atomic_int stop;
  pthread_mutex_t lock; /* for the condition variables only */
  pthread_cond_t idle;  /* the caller: inside dropped to 0 */
  int pinned;           /* helper i is bound to the i-th CPU of the mask (pool.h) */
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

/* Sleeps until a run newer than `seen` is published (one that does not use this helper does
 * not wake it), or stop. */
static void sleep_for_run(zd__pool_t *p, helper_t *h, unsigned long seen) {
  pthread_mutex_lock(&p->lock);
  atomic_store(&h->asleep, 1);
  while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop))
    pthread_cond_wait(&h->wake, &p->lock);
  atomic_store(&h->asleep, 0);
  pthread_mutex_unlock(&p->lock);
}

static void *helper_main(void *arg) {
  helper_t *h = arg;
  zd__pool_t *p = h->pool;
  unsigned long seen = 0;
  for (;;) {
    uint64_t since = now_ns();
    unsigned spins = 0;
    while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop)) {
      cpu_relax();
      if (++spins % 64 == 0 && now_ns() - since > HELPER_SPIN_NS) {
        sleep_for_run(p, h, seen);
        since = now_ns();
      }
    }
    if (atomic_load(&p->stop)) break;
    seen = atomic_load(&p->generation);
    atomic_fetch_add(&p->inside, 1);
    run_t *r = atomic_load(&p->current);
    if (r && h->index < r->threads) work(r, h->index);
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

/* Binds helper i to the i-th CPU of mask (the first stays free for the caller); on any failure
 * unbinds them all again. */
static void pin_helpers(zd__pool_t *p, const cpu_set_t *mask) {
  if (p->nthreads < 2 || (unsigned)CPU_COUNT(mask) < p->nthreads) return;
  unsigned i = 0;
  int ok = 1;
  for (int cpu = 0; cpu < CPU_SETSIZE && i < p->nthreads && ok; cpu++) {
    if (!CPU_ISSET(cpu, mask)) continue;
    if (i > 0) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      ok = pthread_setaffinity_np(p->threads[i], sizeof one, &one) == 0;
      p->helpers[i].cpu = cpu;
    }
    i++;
  }
  if (ok) {
    p->pinned = 1;
    return;
  }
  for (unsigned h = 1; h < p->nthreads; h++) {
    pthread_setaffinity_np(p->threads[h], sizeof *mask, mask);
    p->helpers[h].cpu = -1;
  }
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
  p->helpers = calloc(nthreads, sizeof *p->helpers);
  if (!p->threads || !p->helpers) {
    free(p->threads);
    free(p->helpers);
    free(p);
    return -ENOMEM;
  }
  pthread_mutex_init(&p->run_lock, NULL);
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->idle, NULL);
  p->cpus = cpus;
  p->nthreads = 1;
  for (unsigned i = 1; i < nthreads; i++) {
    helper_t *h = &p->helpers[i];
    h->pool = p;
    h->index = i;
    h->cpu = -1;
    pthread_cond_init(&h->wake, NULL);
    int rc = pthread_create(&p->threads[i], NULL, helper_main, h);
    if (rc) {
      pthread_cond_destroy(&h->wake);
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
  for (unsigned i = 1; i < pool->nthreads; i++) pthread_cond_signal(&pool->helpers[i].wake);
  pthread_mutex_unlock(&pool->lock);
  for (unsigned i = 1; i < pool->nthreads; i++) {
    pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->helpers[i].wake);
  }
  pthread_cond_destroy(&pool->idle);
  pthread_mutex_destroy(&pool->lock);
  pthread_mutex_destroy(&pool->run_lock);
  free(pool->threads);
  free(pool->helpers);
  free(pool);
}

/* Binds the calling thread, for a run of `threads`, to the CPUs of its mask that none of the
 * run's helpers is bound to, saving its mask in *before; 0 if it was left as it was (nothing
 * would be left, or the call failed). Its current mask is the base, so a mask an operator set
 * later is kept. */
static int keep_off(const zd__pool_t *pool, unsigned threads, cpu_set_t *before) {
  if (pthread_getaffinity_np(pthread_self(), sizeof *before, before) != 0) return 0;
  cpu_set_t want = *before;
  for (unsigned i = 1; i < threads; i++)
    if (pool->helpers[i].cpu >= 0) CPU_CLR(pool->helpers[i].cpu, &want);
  if (CPU_COUNT(&want) == 0 || CPU_EQUAL(&want, before)) return 0;
  return pthread_setaffinity_np(pthread_self(), sizeof want, &want) == 0;
}

/* Gives the calling thread its mask back. Should the CPUs it may use have changed meanwhile (a
 * cpuset shrunk), the kernel refuses the old mask; every CPU is then asked for, which it cuts to
 * those allowed, rather than leave the thread bound to a few. */
static void give_back(const cpu_set_t *before) {
  if (pthread_setaffinity_np(pthread_self(), sizeof *before, before) == 0) return;
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) CPU_SET(cpu, &all);
  pthread_setaffinity_np(pthread_self(), sizeof all, &all);
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
  for (unsigned i = 1; i < threads; i++) {
    if (!atomic_load(&pool->helpers[i].asleep)) continue;
    pthread_mutex_lock(&pool->lock);
    pthread_cond_signal(&pool->helpers[i].wake);
    pthread_mutex_unlock(&pool->lock);
  }
  /* Off this run's helpers' CPUs (after the wake-ups, so that a helper whose CPU the caller is on
   * starts while the caller moves away). */
  cpu_set_t before;
  int moved = pool->pinned && keep_off(pool, threads, &before);
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
  if (moved) give_back(&before);
}
