/* Shared pieces of the benchmarks: the memory pass (the AdamW kernel's loads and stores with no
 * arithmetic: the limit a step is measured against) over padded buffers, timing and
 * statistics. */
#ifndef ZD_TESTS_BENCH_MEMPASS_H
#define ZD_TESTS_BENCH_MEMPASS_H

#include <stddef.h>
#include <stdint.h>

#include "adam.h"
#include "pool.h"

/* One pass over elements [0, n) of args' streams (read master, exp_avg, exp_avg_sq, grad, and
 * max_exp_avg_sq when not NULL; write them back and the working params), split over the pool
 * exactly as the daemon splits the kernel (ZD__POOL_STREAM_*); returns seconds. n: a multiple
 * of 16. The values are left as they are. Give the pass the values the kernel it is compared with
 * sees: memory may move some data (zeros) faster than other. */
double zd_bench_mempass(zd__pool_t *pool, zd__isa_t isa, const zd__adam_args_t *args, uint64_t n);

/* Spins for a while (on the calling thread, which stays awake) before a timed run, so that the
 * pool threads of the run before it have gone to sleep: a step finds them asleep, since it
 * follows a trainer's forward and backward, and a run that found them still spinning would be
 * timed without the wake-up it costs in use. */
void zd_bench_settle(void);

double zd_bench_now(void);
double zd_bench_median(double *t, int n);               /* sorts t */
double zd_bench_percentile(double *t, int n, double q); /* sorts t; q in [0, 1] */
/* A padded buffer for the pass: its own mapping, huge pages advised, the k-th of the process
 * starting (4 KiB + 320 KiB) * k modulo 2 MiB past a 2 MiB boundary, so that buffers allocated one
 * after the other (up to 512) never start at the same address modulo 2 MiB or any larger power of
 * two, whatever their sizes, and spread over the 4 KiB pages in between: the limit the pass
 * measures is the bus's, not that of a placement. fd >= 0 maps that file (shared) instead of
 * anonymous memory. Exits on failure. */
void *zd_bench_alloc(size_t bytes, int fd);
void zd_bench_free(void *p, size_t bytes);

#endif /* ZD_TESTS_BENCH_MEMPASS_H */
