/* Unary gRPC calls with protobuf-c messages: the one wrapper around gRPC's C core that zerod's
 * control service (daemon/control.c), its rendezvous client (daemon/rendezvous.c) and zeroctl
 * share, so that the tag-and-batch state machine of a call is written once.
 *
 * The client half makes blocking calls on a channel (a pluck completion queue per call, so a
 * channel may be shared by threads); the common half packs and unpacks messages to byte buffers
 * and maps between gRPC status codes and zerod's error space (zerod/errors.h). Every error comes
 * back as a zd__err_t whose message names the address, the method and what went wrong.
 */
#ifndef ZD_COMMON_GRPC_UNARY_H
#define ZD_COMMON_GRPC_UNARY_H

#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>
#include <stddef.h>

#include "error.h"

/* Largest message either end sends or accepts. Status of a node is a few kB per rank and
 * rendezvous values (a Gloo address, NCCL's 128-byte id) are small: 8 MiB leaves room for a
 * large world without letting one bad peer allocate much. */
#define ZD__GRPC_MAX_MESSAGE (8u << 20)

/* Call flags. */
enum {
  /* Queue the call until the channel connects (or the deadline passes) instead of failing at
   * once when the server is not up yet: for peers that start before rank 0's node. */
  ZD__GRPC_WAIT_FOR_READY = 1,
};

typedef struct zd__grpc_channel zd__grpc_channel_t;

/* Opens an insecure channel to address ("host:port" or "unix:/path"); takes a grpc_init()
 * reference that zd__grpc_channel_close() gives back. Does not connect yet. Errors: -EINVAL
 * (empty address), -ENOMEM. Thread-safe. */
int zd__grpc_channel_open(const char *address, zd__grpc_channel_t **out, zd__err_t *err);

/* Closes the channel; no call may be in progress on it. Accepts NULL. */
void zd__grpc_channel_close(zd__grpc_channel_t *ch);

/* The address the channel was opened with. */
const char *zd__grpc_channel_address(const zd__grpc_channel_t *ch);

/* The metadata key of the control token ("authorization: Bearer <token>"). */
#define ZD__GRPC_AUTH_KEY "authorization"

/* Sends "authorization: Bearer <token>" with every later call on the channel (NULL or "": none),
 * for the control service's calls that need the token (control_token_file). Not while a call is in
 * progress. Errors: -ENOMEM. */
int zd__grpc_channel_set_token(zd__grpc_channel_t *ch, const char *token);

/* Whether the channel is connected now (does not try to connect). */
int zd__grpc_channel_ready(zd__grpc_channel_t *ch);

/* One blocking unary call of method ("/package.Service/Method") with the bytes req[0..len) as the
 * request. Returns within about timeout_ms (> 0). On success *reply is the reply payload
 * (malloc'd; free() it, may be NULL with *reply_len 0 for an empty message).
 * *grpc_status (may be NULL) receives the gRPC status code, GRPC_STATUS_OK on success, so callers
 * can tell NOT_FOUND from FAILED_PRECONDITION; the return value is the same outcome in zerod's
 * error space (zd__grpc_code_of) and err carries "<what> at <address>: <server's message>".
 * Thread-safe for distinct calls on one channel. */
int zd__grpc_call_raw(zd__grpc_channel_t *ch, const char *method, const void *req, size_t len,
                      void **reply, size_t *reply_len, int timeout_ms, unsigned flags,
                      int *grpc_status, zd__err_t *err);

/* The same with protobuf-c messages: packs req, unpacks the reply as reply_desc into *reply (free
 * it with protobuf_c_message_free_unpacked(*reply, NULL)). A reply that does not decode is
 * ZD_EPROTO. */
int zd__grpc_call(zd__grpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                  const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply,
                  int timeout_ms, unsigned flags, int *grpc_status, zd__err_t *err);

/* Packs msg into a new byte buffer (grpc_byte_buffer_destroy() it). Like every gRPC allocation,
 * it aborts when out of memory. */
grpc_byte_buffer *zd__grpc_pack(const ProtobufCMessage *msg);

/* Copies a received byte buffer into one malloc'd block (*data, NULL for an empty buffer).
 * Returns 0 or -ENOMEM. */
int zd__grpc_read(grpc_byte_buffer *bb, void **data, size_t *len);

/* zerod's error code for a gRPC status, and the gRPC status for a zerod error code. */
int zd__grpc_code_of(grpc_status_code status);
grpc_status_code zd__grpc_status_of(int code);

/* "UNAVAILABLE", "NOT_FOUND", ... ("UNKNOWN_STATUS" for values outside the enum). */
const char *zd__grpc_status_name(grpc_status_code status);

#endif /* ZD_COMMON_GRPC_UNARY_H */
