/* Layout: where each parameter lives in the flat buffers, and which part each rank owns.
 *
 * docs/design.md, "Layout". Parameters are placed in registration order, each at a multiple of
 * ZD__ALIGN elements. The flat buffer is cut into buckets: a bucket takes parameters until it holds
 * at least bucket_elems elements (a parameter is never split between buckets). Each bucket is
 * padded to a multiple of ZD__ALIGN * world_size and split into world_size equal slices; rank r's
 * shard is its slice of every bucket, and a parameter may straddle slices. The layout is a pure
 * function of (parameter list, world size, bucket size), and its hash is what clients and peers
 * compare.
 *
 * Used by the daemon and by libzerod, which sizes the shared buffers with it.
 */
#ifndef ZD_COMMON_LAYOUT_H
#define ZD_COMMON_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "segment.h"
#include "zerod/zerod.h"

#define ZD__ALIGN      64 /* elements: every parameter and every shard slice starts at a multiple */
#define ZD__MAX_NAME   255
#define ZD__MAX_PARAMS (1u << 20)
#define ZD__MAX_ELEMS  (1ull << 40)

typedef struct zd__layout_param {
  char *name;
  uint32_t ndim;
  uint64_t shape[ZD_MAX_DIMS];
  uint64_t numel;
  uint32_t group;
  uint64_t offset; /* absolute element offset in the flat buffer */
  uint32_t bucket;
} zd__layout_param_t;

typedef struct zd__bucket {
  uint64_t offset;      /* absolute element offset of the bucket */
  uint64_t elems;       /* padded to a multiple of ZD__ALIGN * world_size */
  uint64_t shard_elems; /* elems / world_size: one rank's slice */
  uint64_t shard_base;  /* offset of this bucket's slice within a rank's shard */
  uint32_t first_param;
  uint32_t nparams;
} zd__bucket_t;

typedef struct zd__layout {
  uint32_t world_size;
  uint64_t bucket_elems; /* the target the buckets were cut with */
  uint32_t nparams;
  zd__layout_param_t *params;
  uint32_t nbuckets;
  zd__bucket_t *buckets;
  uint64_t total_elems; /* flat buffer elements, padding included */
  uint64_t shard_elems; /* total_elems / world_size */
  uint64_t hash;
} zd__layout_t;

/* Megatron's default bucket size for a world: max(40M, 1M * world_size) elements. */
uint64_t zd__layout_default_bucket_elems(uint32_t world_size);

/* Builds the layout of params (the names are copied). Validates the list: names non-empty, unique,
 * at most ZD__MAX_NAME bytes; ndim at most ZD_MAX_DIMS; group below ngroups; sizes within
 * ZD__MAX_ELEMS. Errors: -EINVAL, ZD_EGROUP, -ENOMEM, each with a message naming the parameter. */
int zd__layout_build(const zd_param_t *params, uint32_t nparams, uint32_t ngroups,
                     uint32_t world_size, uint64_t bucket_elems, zd__layout_t **out,
                     zd__err_t *err);

/* Destroys a layout; accepts NULL. */
void zd__layout_free(zd__layout_t *layout);

/* Describes the first difference between two layouts in buf ("parameter 3: 'fc2.weight' [32, 16]
 * group 0 vs 'fc2.weight' [16, 32] group 0"); returns 0 when they are the same. */
int zd__layout_diff(const zd__layout_t *a, const zd__layout_t *b, char *buf, size_t len);

/* Segments of rank `rank`'s slice of bucket `bucket`, offsets relative to the slice start.
 * *segs is allocated (free()); *nsegs may be 0 when the slice holds only padding. */
int zd__layout_segments(const zd__layout_t *layout, uint32_t rank, uint32_t bucket,
                        zd__segment_t **segs, uint32_t *nsegs);

/* The parameter table as text, one line per parameter: "<group> <ndim> <dims...> <name length>
 * <name>\n". Ranks exchange it to name the first parameter on which their models differ.
 * *out is allocated (free()). */
int zd__layout_serialize(const zd__layout_t *layout, char **out, size_t *len);

/* Parses a table from zd__layout_serialize; the names of *params point into buf, which must stay
 * alive. Reads buf[0, len) only: a peer's table need not be NUL-terminated. *params is allocated
 * (free()). -EINVAL for a malformed table (numbers are plain decimal digits, one blank apart). */
int zd__layout_parse(char *buf, size_t len, zd_param_t **params, uint32_t *nparams);

/* Formats a shape as "[32, 16]". */
void zd__shape_format(const uint64_t *shape, uint32_t ndim, char *buf, size_t len);

#endif /* ZD_COMMON_LAYOUT_H */
