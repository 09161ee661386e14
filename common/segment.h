/* Segments: how a kernel learns which hyperparameter group each element of a shard belongs to.
 *
 * A rank's shard of a bucket is a contiguous range of elements; the parameters in it are
 * described by a sorted list of non-overlapping segments (offset and length in elements, relative
 * to the start of the range, and the group index). Elements covered by no segment are padding:
 * kernels leave them untouched. Per-group constants are looked up once per segment, never per
 * element.
 */
#ifndef ZD_COMMON_SEGMENT_H
#define ZD_COMMON_SEGMENT_H

#include <stdint.h>

typedef struct zd__segment {
  uint64_t offset;
  uint64_t length;
  uint32_t group;
} zd__segment_t;

#endif /* ZD_COMMON_SEGMENT_H */
