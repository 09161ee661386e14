/* Fork-join pool (pool.h): workers sleep on a condition variable and take tasks from a shared
 * counter, so an uneven split still finishes together. */
#include "pool.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

struct zd__pool {
  unsigned nthreads;
  pthread_t *threads;
  pthread_mutex_t run_lock; /* one zd__pool_run at a time */
  pthread_mutex_t lock;
  pthread_cond_t wake;
  pthread_cond_t done;
  unsigned long generation; /* bumped for each run */
  int stop;
  zd__pool_fn fn;
  void *arg;
  unsigned ntasks;
  unsigned next_task; /* under lock */
  unsigned pending;   /* tasks not yet finished */
};

/* Takes tasks until none are left; returns with lock held. */
static void drain(zd__pool_t *p) {
  while (p->next_task < p->ntasks) {
    unsigned task = p->next_task++;
    pthread_mutex_unlock(&p->lock);
    p->fn(p->arg, task, p->ntasks);
    pthread_mutex_lock(&p->lock);
    if (--p->pending == 0) pthread_cond_signal(&p->done);
  }
}

static void *worker_main(void *arg) {
  zd__pool_t *p = arg;
  unsigned long seen = 0;
  pthread_mutex_lock(&p->lock);
  for (;;) {
    while (!p->stop && p->generation == seen) pthread_cond_wait(&p->wake, &p->lock);
    if (p->stop) break;
    seen = p->generation;
    drain(p);
  }
  pthread_mutex_unlock(&p->lock);
  return NULL;
}

int zd__pool_create(unsigned nthreads, zd__pool_t **out) {
  if (nthreads == 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    nthreads = n > 0 ? (unsigned)n : 1;
  }
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
  pthread_cond_init(&p->done, NULL);
  p->nthreads = 1;
  for (unsigned i = 1; i < nthreads; i++) {
    int rc = pthread_create(&p->threads[i], NULL, worker_main, p);
    if (rc) {
      zd__pool_destroy(p);
      return -rc;
    }
    p->nthreads++;
  }
  *out = p;
  return 0;
}

void zd__pool_destroy(zd__pool_t *pool) {
  if (!pool) return;
  pthread_mutex_lock(&pool->lock);
  pool->stop = 1;
  pthread_cond_broadcast(&pool->wake);
  pthread_mutex_unlock(&pool->lock);
  for (unsigned i = 1; i < pool->nthreads; i++) pthread_join(pool->threads[i], NULL);
  pthread_cond_destroy(&pool->done);
  pthread_cond_destroy(&pool->wake);
  pthread_mutex_destroy(&pool->lock);
  pthread_mutex_destroy(&pool->run_lock);
  free(pool->threads);
  free(pool);
}

unsigned zd__pool_size(const zd__pool_t *pool) {
  return pool->nthreads;
}

void zd__pool_run(zd__pool_t *pool, unsigned ntasks, zd__pool_fn fn, void *arg) {
  if (ntasks == 0) return;
  if (ntasks == 1 || pool->nthreads == 1) {
    for (unsigned t = 0; t < ntasks; t++) fn(arg, t, ntasks);
    return;
  }
  pthread_mutex_lock(&pool->run_lock);
  pthread_mutex_lock(&pool->lock);
  pool->fn = fn;
  pool->arg = arg;
  pool->ntasks = ntasks;
  pool->next_task = 0;
  pool->pending = ntasks;
  pool->generation++;
  pthread_cond_broadcast(&pool->wake);
  drain(pool);
  while (pool->pending) pthread_cond_wait(&pool->done, &pool->lock);
  pthread_mutex_unlock(&pool->lock);
  pthread_mutex_unlock(&pool->run_lock);
}
