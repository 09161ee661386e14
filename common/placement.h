/* Placement of the large arrays a step streams through together: the daemon's fp32 master and
 * moments and its reduced-gradient shard, and the client's grad and param buffers (shared
 * memory, mapped by both processes).
 *
 * Why it exists: a step touches element i of every one of these arrays at the same time. Arrays
 * that each get an exact n * 4-byte mapping from mmap(NULL, ...) sit back to back, so when n is a
 * power of two they all start at the same address modulo n * 4, and the step's concurrent
 * accesses fall into the same cache sets and DRAM banks: at 2^25 parameters a step ran at half
 * the speed it reaches at 2^25 + 123456 (issue 16). Every array placed here is given a colour:
 * it starts ZD__PLACE_STRIDE * colour bytes past a ZD__PLACE_ALIGN boundary. Two arrays of
 * different colours therefore never start at the same address modulo ZD__PLACE_ALIGN or any
 * larger power of two, whatever their sizes and wherever the kernel puts them; arrays of one
 * colour may (use one colour per array of the same step).
 *
 * Colours in use (one per stream of a step; the set is small so that every pair of colours is at
 * least ZD__PLACE_STRIDE apart modulo ZD__PLACE_ALIGN):
 *   ZD__COLOUR_STATE + 0..3   the daemon's state: master, exp_avg, exp_avg_sq, gradient shard
 *   ZD__COLOUR_STATE_MAX      and amsgrad's max_exp_avg_sq (the CPU backend hands these five
 *                             out in turn, compute_cpu.c)
 *   ZD__COLOUR_GRADS          the client's grad buffer, in the client and in the daemon
 *   ZD__COLOUR_PARAMS         the client's param buffer, in the client and in the daemon
 *   ZD__COLOUR_STATE_SPARE     overlap_update's second set of state arrays: the CPU backend hands
 *                             out this one and then ZD__COLOUR_PARAMS's after the five above
 *
 * Huge pages: anonymous arrays are advised MADV_HUGEPAGE (transparent huge pages, when
 * /sys/kernel/mm/transparent_hugepage/enabled allows "madvise" or "always"); only the part before
 * the first 2 MiB boundary (the colour's offset) and the tail stay in 4 KiB pages. Shared-memory
 * (memfd) mappings are advised too, but the kernel backs them with huge pages only when
 * /sys/kernel/mm/transparent_hugepage/shmem_enabled says "advise", "within_size" or "always"
 * (many distributions ship "never"), and maps a huge page with one TLB entry only where the
 * virtual address and the file offset agree modulo 2 MiB, which a colour other than a multiple of
 * 2 MiB rules out: a coloured shared buffer is mapped with 4 KiB TLB entries. Placement wins that
 * trade: the collisions cost a factor of two, the TLB misses of a streaming pass a few percent.
 *
 * A placed array is one ordinary mapping of exactly round_up(bytes, page) bytes at the returned
 * address (the reservation around it is given back), so it is released with munmap(addr, bytes)
 * like any other, or zd__place_release. Thread-safe (mmap is).
 */
#ifndef ZD_COMMON_PLACEMENT_H
#define ZD_COMMON_PLACEMENT_H

#include <stddef.h>

#define ZD__PLACE_ALIGN   ((size_t)2 << 20)   /* a huge page */
#define ZD__PLACE_STRIDE  ((size_t)256 << 10) /* between colours */
#define ZD__PLACE_COLOURS 8                   /* ZD__PLACE_ALIGN / ZD__PLACE_STRIDE */

enum {
  ZD__COLOUR_STATE = 0, /* .. ZD__COLOUR_STATE + 3 */
  ZD__COLOUR_GRADS = 4,
  ZD__COLOUR_PARAMS = 5,
  ZD__COLOUR_STATE_MAX = 6,
  ZD__COLOUR_STATE_SPARE = 7, /* overlap_update's second set of state arrays (compute_cpu.c) */
};

/* Maps `bytes` (>= 1) of zeroed, private, read-write anonymous memory at colour `colour`
 * (taken modulo ZD__PLACE_COLOURS) and advises huge pages. Errors: -ENOMEM (or another -errno of
 * mmap). */
int zd__place_anon(size_t bytes, unsigned colour, void **out);

/* Maps `bytes` (>= 1) of the file fd from offset 0, shared and read-write, at colour `colour`, as
 * mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) would, and advises huge pages (see
 * above for what that gives a memfd). Does not take ownership of fd. Errors: -errno of mmap
 * (-ENOMEM, -EACCES, -ENODEV, ...). */
int zd__place_fd(int fd, size_t bytes, unsigned colour, void **out);

/* Unmaps an array of zd__place_anon or zd__place_fd (the same `bytes`); accepts NULL. */
void zd__place_release(void *addr, size_t bytes);

#endif /* ZD_COMMON_PLACEMENT_H */
