/* Shared pieces of the benchmarks: the memory pass (the AdamW kernel's loads and stores with no
 * arithmetic: the limit a step is measured against), the work split, timing and statistics. */
#ifndef ZD_TESTS_BENCH_MEMPASS_H
#define ZD_TESTS_BENCH_MEMPASS_H

#include <stddef.h>
#include <stdint.h>

#include "adam.h"
#include "pool.h"

/* One pass over elements [0, n) of args' streams (read master, exp_avg, exp_avg_sq, grad; write
 * them back and the working params), split over the pool exactly as the daemon splits the kernel
 * (ZD__POOL_STREAM_*); returns seconds. n: a multiple of 16. */
double zd_bench_mempass(zd__pool_t *pool, zd__isa_t isa, const zd__adam_args_t *args, uint64_t n);

double zd_bench_now(void);
double zd_bench_median(double *t, int n);               /* sorts t */
double zd_bench_percentile(double *t, int n, double q); /* sorts t; q in [0, 1] */
void *zd_bench_alloc(size_t bytes); /* 2 MiB aligned, huge pages advised; exits on failure */

#endif /* ZD_TESTS_BENCH_MEMPASS_H */
