/* The safetensors container, as checkpoints use it: an 8-byte little-endian header length, a JSON
 * header (one entry per tensor: dtype, shape, data_offsets from the start of the data; and
 * "__metadata__", strings only), then the data. Rank files, exports and imports are all
 * safetensors, so the header's bytes are built and parsed here once; what each file's tensors and
 * metadata must be is its module's (ckpt_shard, ckpt_interop).
 *
 * Tensors are F32 only (zerod's state is fp32) and written as they lie in memory: the host must
 * be little-endian, as safetensors stores them.
 */
#ifndef ZD_COMMON_SAFETENSORS_H
#define ZD_COMMON_SAFETENSORS_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
               "checkpoints assume a little-endian host");

#define ZD__SAFETENSORS_F32_BYTES 4u
/* How zerod dumps JSON into a header and its metadata strings: compact, doubles bit for bit. */
#define ZD__SAFETENSORS_JSON_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(17))

/* A header entry for an F32 tensor of shape[ndim] at bytes [begin, end) of the data. NULL when
 * out of memory. */
json_t *zd__safetensors_entry(const uint64_t *shape, uint32_t ndim, uint64_t begin, uint64_t end);

/* The length and the JSON header, padded with spaces so that the data starts at a multiple of 8.
 * *out is allocated (free()). 0 or -ENOMEM (no message). */
int zd__safetensors_header_bytes(const json_t *hdr, char **out, size_t *len);

/* Whether obj[key] is the string want. */
int zd__safetensors_str_is(const json_t *obj, const char *key, const char *want);

/* Reads the header of the safetensors file open as fd (file_bytes long; messages name it `name`):
 * *hdr (json_decref) is its JSON object, *data_start the offset of the data. -EBADMSG for a file
 * whose header length is not 2 to max_bytes bytes within the file, or whose header is not a JSON
 * object (duplicate keys refused); -ENOMEM; -errno from pread. */
int zd__safetensors_read_header(int fd, const char *name, uint64_t file_bytes, uint64_t max_bytes,
                                json_t **hdr, uint64_t *data_start, zd__err_t *err);

#endif /* ZD_COMMON_SAFETENSORS_H */
