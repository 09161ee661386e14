/* libFuzzer harness of the control service's message decoding (proto/control.proto,
 * proto/health.proto): what zerod's gRPC server unpacks from any client that reaches its port,
 * and what zeroctl and the rendezvous client unpack from replies and stored values.
 *
 * The first input byte picks the message, the rest is its serialized form. A message that unpacks
 * must pack again, to bytes that unpack and pack the same once more (fuzz_pb.h); then it is freed.
 */
#include <string.h>

#include "control.pb-c.h"
#include "fuzz_pb.h"
#include "health.pb-c.h"

static const ProtobufCMessageDescriptor *const messages[] = {
    /* Requests: zerod's gRPC server (daemon/control/grpc_server.c). */
    &zerod__v1__node_status_request__descriptor,
    &zerod__v1__nodes_request__descriptor,
    &zerod__v1__kv_set_request__descriptor,
    &zerod__v1__kv_get_request__descriptor,
    &zerod__v1__kv_wait_request__descriptor,
    &zerod__v1__kv_delete_request__descriptor,
    &grpc__health__v1__health_check_request__descriptor,
    /* Replies and stored values: zeroctl, the rendezvous client (NodeInfo from the store). */
    &zerod__v1__node_status__descriptor,
    &zerod__v1__nodes_reply__descriptor,
    &zerod__v1__node_info__descriptor,
    &zerod__v1__kv_set_reply__descriptor,
    &zerod__v1__kv_get_reply__descriptor,
    &zerod__v1__kv_wait_reply__descriptor,
    &zerod__v1__kv_delete_reply__descriptor,
    &grpc__health__v1__health_check_response__descriptor,
};
#define NMESSAGES (sizeof messages / sizeof messages[0])

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!size) return 0;
  const ProtobufCMessageDescriptor *d = messages[data[0] % NMESSAGES];
  /* The body just before an inaccessible page and unmapped right after the unpack: a read past it
   * or a pointer kept into it faults, also in protobuf-c (not built with ASan). */
  char *body = fuzz_guarded_copy(data + 1, size - 1);
  ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, size - 1, (const uint8_t *)body);
  fuzz_guarded_free(body, size - 1);
  if (!m) return 0;
  fuzz_pb_check_repack(m);
  protobuf_c_message_free_unpacked(m, NULL);
  return 0;
}
