/* Fork-join thread pool for the optimizer kernels.
 *
 * A step's kernel is memory-bound, so one rank's update is split over all cores: the rank worker
 * calls zd__pool_for(), which runs a range of work on the calling thread and on the pool's
 * threads, and returns when all of it is done. One run at a time: local ranks that step together
 * take turns (the memory bus is the shared limit anyway).
 *
 * More threads must never make a run slower, so the pool
 *   - wakes no one for a range too small to pay for the wake-up: a helper thread is asked for only
 *     per `min_per_thread` elements of the range (the caller's measure of what waking a thread
 *     costs, in elements of its kernel);
 *   - hands the range out in shrinking chunks from a shared position (guided scheduling): the
 *     caller starts at once, a helper that wakes late takes only what is left, and the threads
 *     finish within about one small chunk of each other;
 *   - keeps its threads spinning for a short while after a run before they sleep, so the runs of
 *     one step (statistics, then the update of every bucket) find them awake;
 *   - pinned (zd__pool_create's pin), runs each thread on a CPU of its own. Left to itself, the
 *     scheduler woke a sleeping helper on the caller's CPU in 20-70% of the steps of 2^21
 *     parameters through zerod on a 2-vCPU virtual machine, with the other CPU idle, and the
 *     helper then waited there for the whole run (the step took up to twice its memory pass).
 *     Helper i is bound to the i-th CPU of the process's affinity mask, and the caller, for the
 *     length of a run that uses helpers, to the CPUs of its own mask that the run's helpers are
 *     not bound to (a run of 2 threads on 16 CPUs leaves it 15).
 */
#ifndef ZD_DAEMON_POOL_H
#define ZD_DAEMON_POOL_H

#include <stdint.h>

typedef struct zd__pool zd__pool_t;

/* The split of the streaming kernels (the optimizer update and, scaled by the bytes they move,
 * its statistics and the benchmarks' memory pass): chunks of whole ZD__POOL_STREAM_GRAIN elements
 * (a multiple of every stream's cache line, and enough work that claiming a chunk costs nothing
 * next to it), and one thread per ZD__POOL_STREAM_MIN_PER_THREAD elements. Waking a thread costs
 * the waker 7-9 us and the thread 6-16 us to start on the 2-vCPU virtual machine this was
 * measured on, and a helper then competes for the CPUs with the daemon's loop thread and the
 * client waiting for its reply: through zerod (bench_step) a second thread made steps of 2^18 to
 * 2^20 parameters 10-20% slower, did nothing at 2^21 and saved 11% from 2^22 on. */
#define ZD__POOL_STREAM_GRAIN          4096u
#define ZD__POOL_STREAM_MIN_PER_THREAD ((uint64_t)1 << 20)

/* A chunk [begin, end) of the range. thread (< zd__pool_size) names the thread running it, for
 * per-thread accumulators: no two chunks with the same thread run at the same time. */
typedef void (*zd__pool_fn)(void *arg, uint64_t begin, uint64_t end, unsigned thread);

/* Creates a pool of nthreads threads in all, the caller of zd__pool_for() included (so nthreads - 1
 * new threads). nthreads 0 means one per CPU of the process's affinity mask. pin: bind the threads
 * to CPUs of their own (above), where the mask has at least nthreads CPUs; where it has fewer, or
 * binding fails, the pool runs unbound (zd__pool_pinned says which). Errors: -ENOMEM, -EAGAIN. */
int zd__pool_create(unsigned nthreads, int pin, zd__pool_t **out);

/* Whether the pool's threads are bound to CPUs of their own. */
int zd__pool_pinned(const zd__pool_t *pool);

/* Joins the threads; accepts NULL. No run may be in progress. */
void zd__pool_destroy(zd__pool_t *pool);

/* Threads in the pool, the caller included. */
unsigned zd__pool_size(const zd__pool_t *pool);

/* CPUs this process may run on (its affinity mask, else the CPUs online), counted when the pool
 * was created: a pool of nthreads 0 has one thread per CPU. */
unsigned zd__pool_cpus(const zd__pool_t *pool);

/* Threads zd__pool_for() runs a range of n elements on (the caller included). */
unsigned zd__pool_threads_for(const zd__pool_t *pool, uint64_t n, uint64_t grain,
                              uint64_t min_per_thread);

/* Runs fn over [0, n) in chunks whose bounds are multiples of `grain` (but n) and returns when
 * all have finished. Uses at most max(1, n / min_per_thread) threads (the caller included): with
 * one, fn(arg, 0, n, 0) runs inline and no thread is woken. grain >= 1; min_per_thread 0 means
 * one thread per grain. Thread-safe: concurrent callers are served one after the other. */
void zd__pool_for(zd__pool_t *pool, uint64_t n, uint64_t grain, uint64_t min_per_thread,
                  zd__pool_fn fn, void *arg);

#endif /* ZD_DAEMON_POOL_H */
