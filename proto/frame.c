/* Frame header codec: explicit little-endian byte order, so the wire format does not depend on
 * the compiler's struct layout. */
#include "frame.h"

#include "zerod/errors.h"

static void put16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}

static void put32(uint8_t *p, uint32_t v) {
  put16(p, (uint16_t)v);
  put16(p + 2, (uint16_t)(v >> 16));
}

static void put64(uint8_t *p, uint64_t v) {
  put32(p, (uint32_t)v);
  put32(p + 4, (uint32_t)(v >> 32));
}

static uint16_t get16(const uint8_t *p) {
  return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t get32(const uint8_t *p) {
  return get16(p) | ((uint32_t)get16(p + 2) << 16);
}

static uint64_t get64(const uint8_t *p) {
  return get32(p) | ((uint64_t)get32(p + 4) << 32);
}

void zd__frame_encode(const zd__frame_header_t *h, uint8_t out[ZD__FRAME_HEADER_SIZE]) {
  put32(out, h->magic);
  put16(out + 4, h->version);
  put16(out + 6, h->type);
  put32(out + 8, h->length);
  put32(out + 12, h->flags);
  put64(out + 16, h->request_id);
}

int zd__frame_decode(const uint8_t in[ZD__FRAME_HEADER_SIZE], zd__frame_header_t *h) {
  h->magic = get32(in);
  h->version = get16(in + 4);
  h->type = get16(in + 6);
  h->length = get32(in + 8);
  h->flags = get32(in + 12);
  h->request_id = get64(in + 16);
  return h->magic == ZD__FRAME_MAGIC ? ZD_OK : ZD_EPROTO;
}

const char *zd__msg_name(uint16_t type) {
  switch (type & (uint16_t)~ZD__FRAME_REPLY) {
#define ZD__MSG_NAME(name, value, text) \
  case value:                           \
    return text;
    ZD__MSG_MAP(ZD__MSG_NAME)
#undef ZD__MSG_NAME
  }
  return "unknown";
}
