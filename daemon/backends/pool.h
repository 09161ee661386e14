/* Fork-join thread pool for the optimizer kernels.
 *
 * A step's kernel is memory-bound, so one rank's update is split over all cores: the rank worker
 * calls zd__pool_run(), which runs `ntasks` pieces of work on the pool's threads and on the
 * calling thread, and returns when all are done. One run at a time: local ranks that step
 * together take turns (the memory bus is the shared limit anyway).
 */
#ifndef ZD_DAEMON_POOL_H
#define ZD_DAEMON_POOL_H

typedef struct zd__pool zd__pool_t;

/* fn(arg, task, ntasks) is called once for each task in [0, ntasks). */
typedef void (*zd__pool_fn)(void *arg, unsigned task, unsigned ntasks);

/* Creates a pool of nthreads threads in all, the caller of zd__pool_run() included (so nthreads - 1
 * new threads). nthreads 0 means one per online CPU. Errors: -ENOMEM, -EAGAIN. */
int zd__pool_create(unsigned nthreads, zd__pool_t **out);

/* Joins the threads; accepts NULL. No run may be in progress. */
void zd__pool_destroy(zd__pool_t *pool);

/* Threads in the pool, the caller included. */
unsigned zd__pool_size(const zd__pool_t *pool);

/* Runs the tasks and returns when all have finished. ntasks 1 runs inline without waking anyone.
 * Thread-safe: concurrent callers are served one after the other. */
void zd__pool_run(zd__pool_t *pool, unsigned ntasks, zd__pool_fn fn, void *arg);

#endif /* ZD_DAEMON_POOL_H */
