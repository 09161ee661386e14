/* FNV-1a, 64 bits: the one hash zerod computes itself, for the layout hash (layout.c), a group's
 * part of the hyperparameter hash (group.c) and the step record's hparam_hash (the daemon's step
 * logic). Every rank and every client must compute the same bits from the same bytes, so values
 * are hashed as explicit little-endian bytes where their width or order could differ. Not for
 * files or anything an attacker picks (checkpoints use xxHash's XXH3). */
#ifndef ZD_COMMON_HASH_H
#define ZD_COMMON_HASH_H

#include <stddef.h>
#include <stdint.h>

#define ZD__FNV1A_INIT 0xcbf29ce484222325ull /* the offset basis: the hash of no bytes */

/* h folded with len bytes at data. */
static inline uint64_t zd__fnv1a(uint64_t h, const void *data, size_t len) {
  const uint8_t *p = (const uint8_t *)data;
  for (size_t i = 0; i < len; i++) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

#endif /* ZD_COMMON_HASH_H */
