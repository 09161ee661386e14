/* Frame codec of the local protocol (docs/protocol.md).
 *
 * Every message on the Unix socket is one frame: a fixed 24-byte little-endian header followed by
 * a protobuf-c body (proto/zerod.proto). The header carries what the receiver needs before it can
 * trust the body: a magic number to reject garbage, the protocol version, the message type, the
 * body length (bounded by the receiver's limit) and a request id that the reply echoes, so that
 * requests can be pipelined. Shared by the daemon and libzerod.
 */
#ifndef ZD_PROTO_FRAME_H
#define ZD_PROTO_FRAME_H

#include <stddef.h>
#include <stdint.h>

#define ZD__FRAME_MAGIC       0x3144525au /* "ZRD1" on the wire */
#define ZD__FRAME_HEADER_SIZE 24
#define ZD__FRAME_REPLY       0x8000u /* set in the type of a successful reply */
/* Largest body a peer may send; the daemon's own limit (max_frame_bytes) may be lower. */
#define ZD__FRAME_MAX_BODY (64u << 20)

/* A client with CUDA buffers shares a ring of this many pairs of IPC events with zerod ("grads
 * ready", "params ready"; CudaBuffers in zerod.proto): one pair per request it may have
 * outstanding, named by the request's event_slot. It is therefore also libzerod's limit of
 * outstanding requests per client (docs/protocol.md, "CUDA buffers"). At most 64: both sides keep
 * the slots in use as bits of a uint64_t. */
#define ZD__EVENT_SLOTS 64

/* Message types: XX(constant suffix, value, name). A successful reply has the request's type with
 * ZD__FRAME_REPLY set; a failed request is answered by an ERROR frame with the same request id. */
#define ZD__MSG_MAP(XX)           \
  XX(HELLO, 1, "hello")           \
  XX(REGISTER, 2, "register")     \
  XX(STEP, 3, "step")             \
  XX(SCATTER, 4, "scatter")       \
  XX(GATHER, 5, "gather")         \
  XX(STATUS, 6, "status")         \
  XX(BYE, 7, "bye")               \
  XX(CHECKPOINT, 8, "checkpoint") \
  XX(ERROR, 0x7fff, "error")

enum {
#define ZD__MSG_ENUM(name, value, text) ZD__MSG_##name = (value),
  ZD__MSG_MAP(ZD__MSG_ENUM)
#undef ZD__MSG_ENUM
};

typedef struct zd__frame_header {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint32_t length; /* body bytes after the header */
  uint32_t flags;  /* reserved, 0 */
  uint64_t request_id;
} zd__frame_header_t;

/* Writes h into out (24 bytes, little-endian). */
void zd__frame_encode(const zd__frame_header_t *h, uint8_t out[ZD__FRAME_HEADER_SIZE]);

/* Reads a header. Returns ZD_OK, or ZD_EPROTO when the magic is wrong (the stream cannot be
 * trusted any further). Version, type and length are the caller's to check. */
int zd__frame_decode(const uint8_t in[ZD__FRAME_HEADER_SIZE], zd__frame_header_t *h);

/* Name of a message type without the reply bit ("step"), or "unknown". */
const char *zd__msg_name(uint16_t type);

#endif /* ZD_PROTO_FRAME_H */
