/* The safetensors container's header (safetensors.h). */
#include "safetensors.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_file.h"

json_t *zd__safetensors_entry(const uint64_t *shape, uint32_t ndim, uint64_t begin, uint64_t end) {
  json_t *t = json_object(), *s = json_array();
  for (uint32_t d = 0; d < ndim; d++) json_array_append_new(s, json_integer((json_int_t)shape[d]));
  json_object_set_new(t, "dtype", json_string("F32"));
  json_object_set_new(t, "shape", s);
  json_object_set_new(t, "data_offsets", json_pack("[I, I]", (json_int_t)begin, (json_int_t)end));
  return t;
}

int zd__safetensors_header_bytes(const json_t *hdr, char **out, size_t *len) {
  char *text = json_dumps(hdr, ZD__SAFETENSORS_JSON_FLAGS);
  if (!text) return -ENOMEM;
  size_t n = strlen(text), padded = (n + 7) / 8 * 8;
  char *buf = malloc(8 + padded);
  if (!buf) {
    free(text);
    return -ENOMEM;
  }
  for (int i = 0; i < 8; i++) buf[i] = (char)((uint64_t)padded >> (8 * i));
  memcpy(buf + 8, text, n);
  memset(buf + 8 + n, ' ', padded - n);
  free(text);
  *out = buf;
  *len = 8 + padded;
  return 0;
}

int zd__safetensors_str_is(const json_t *obj, const char *key, const char *want) {
  const char *v = json_string_value(json_object_get(obj, key));
  return v && strcmp(v, want) == 0;
}

int zd__safetensors_read_header(int fd, const char *name, uint64_t file_bytes, uint64_t max_bytes,
                                json_t **hdr, uint64_t *data_start, zd__err_t *err) {
  *hdr = NULL;
  unsigned char lenb[8];
  ssize_t r = zd__ckpt_pread_all(fd, lenb, 8, 0);
  if (r < 0) return zd__errf(err, (int)r, "%s: cannot read: %s", name, strerror((int)-r));
  uint64_t n = 0;
  for (int i = 0; r == 8 && i < 8; i++) n |= (uint64_t)lenb[i] << (8 * i);
  /* "{}" is the shortest header */
  if (r < 8 || n < 2 || n > max_bytes || 8 + n > file_bytes)
    return zd__errf(err, -EBADMSG,
                    "%s: not a safetensors file (%" PRIu64 " bytes, header length %" PRIu64
                    "; expected a header of 2 to %" PRIu64 " bytes within the file)",
                    name, file_bytes, n, max_bytes);
  char *text = malloc(n);
  if (!text) return zd__errf(err, -ENOMEM, "%s: out of memory for its header", name);
  r = zd__ckpt_pread_all(fd, text, n, 8);
  json_error_t jerr;
  json_t *j = r == (ssize_t)n ? json_loadb(text, n, JSON_REJECT_DUPLICATES, &jerr) : NULL;
  free(text);
  if (r < 0) return zd__errf(err, (int)r, "%s: cannot read: %s", name, strerror((int)-r));
  if (!json_is_object(j)) {
    const char *why = !j && r == (ssize_t)n ? jerr.text : NULL; /* the parser's, if it failed */
    json_decref(j);
    return zd__errf(err, -EBADMSG, "%s: the safetensors header is not a JSON object%s%s", name,
                    why ? ": " : "", why ? why : "");
  }
  *hdr = j;
  *data_start = 8 + n;
  return 0;
}
