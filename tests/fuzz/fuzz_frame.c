/* libFuzzer harness of the local protocol's decoding (proto/frame.c, proto/wire.c, zerod.proto):
 * what zerod and libzerod do with the bytes a peer sends on the Unix socket, short of a session.
 *
 * The input is a byte stream of frames. Each header is decoded (and must encode back to the same
 * 24 bytes); a bad magic or a body longer than the rest ends the stream, as it ends a connection.
 * Each body is copied to just before an inaccessible page, so that a read past it faults even
 * in protobuf-c (not built with ASan), and unpacked with the message its type names: a request, or
 * with the reply bit a reply, or an Error. A request then goes through the checks zerod makes
 * without state (dtypes, groups, loss scaler); every message that unpacks must pack again, and pack
 * the same the second time round (fuzz_pb.h).
 */
#include <string.h>

#include "dtype.h"
#include "frame.h"
#include "fuzz_pb.h"
#include "wire.h"
#include "zerod.pb-c.h"

typedef struct msg_type {
  uint16_t type;
  const ProtobufCMessageDescriptor *request, *reply;
} msg_type_t;

static const msg_type_t types[] = {
    {ZD__MSG_HELLO, &zerod__v1__hello_request__descriptor, &zerod__v1__hello_reply__descriptor},
    {ZD__MSG_REGISTER, &zerod__v1__register_request__descriptor,
     &zerod__v1__register_reply__descriptor},
    {ZD__MSG_STEP, &zerod__v1__step_request__descriptor, &zerod__v1__step_reply__descriptor},
    {ZD__MSG_SCATTER, &zerod__v1__scatter_request__descriptor,
     &zerod__v1__scatter_reply__descriptor},
    {ZD__MSG_GATHER, &zerod__v1__gather_request__descriptor, &zerod__v1__gather_reply__descriptor},
    {ZD__MSG_STATUS, &zerod__v1__status_request__descriptor, &zerod__v1__status_reply__descriptor},
    {ZD__MSG_BYE, &zerod__v1__bye_request__descriptor, &zerod__v1__bye_reply__descriptor},
    {ZD__MSG_ERROR, &zerod__v1__error__descriptor, NULL},
};

/* What zerod checks of a register or step request before it needs any state (session.c). */
static void check_request(uint16_t type, const ProtobufCMessage *m) {
  zd__err_t err = {0};
  if (type == ZD__MSG_REGISTER) {
    const Zerod__V1__RegisterRequest *req = (const Zerod__V1__RegisterRequest *)m;
    zd__dtype_check(zd__wire_dtype_from(req->param_dtype), ZD__DTYPE_PARAM, &err);
    zd__dtype_check(zd__wire_dtype_from(req->grad_dtype), ZD__DTYPE_GRAD, &err);
    zd_loss_scaler_t scaler;
    if (zd__wire_scaler_from(&scaler, req->loss_scaler, &err) == ZD_OK && scaler.enabled) {
      Zerod__V1__LossScaler w;
      FUZZ_CHECK(zd__wire_scaler_to(&w, &scaler) == &w, "an enabled scaler goes on the wire");
      FUZZ_CHECK(w.initial_scale == scaler.initial_scale && w.min_scale == scaler.min_scale,
                 "the loss scaler changes on its way back to the wire");
    }
  }
  Zerod__V1__Group *const *groups = NULL;
  size_t n = 0;
  if (type == ZD__MSG_REGISTER) {
    groups = ((const Zerod__V1__RegisterRequest *)m)->groups;
    n = ((const Zerod__V1__RegisterRequest *)m)->n_groups;
  } else if (type == ZD__MSG_STEP) {
    groups = ((const Zerod__V1__StepRequest *)m)->groups;
    n = ((const Zerod__V1__StepRequest *)m)->n_groups;
  }
  if (!n) return;
  zd_group_t *out = calloc(n, sizeof *out);
  FUZZ_CHECK(out, "out of memory");
  if (zd__wire_groups_from(out, groups, n, &err) == ZD_OK) {
    /* A group zerod accepts goes back on the wire (libzerod's direction) with the same values. */
    for (size_t i = 0; i < n; i++) {
      Zerod__V1__Group w;
      zd__wire_group_to(&w, &out[i]);
      FUZZ_CHECK(w.lr == groups[i]->lr && w.eps == groups[i]->eps,
                 "group %zu changes on its way back to the wire", i);
    }
  } else {
    FUZZ_CHECK(err.code != ZD_OK && err.msg[0], "a refused group comes with a code and a message");
  }
  free(out);
}

static void unpack_body(const zd__frame_header_t *h, const uint8_t *body) {
  uint16_t base = h->type & (uint16_t)~ZD__FRAME_REPLY;
  int reply = (h->type & ZD__FRAME_REPLY) != 0;
  for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
    if (types[i].type != base) continue;
    const ProtobufCMessageDescriptor *d = reply ? types[i].reply : types[i].request;
    if (!d) return;
    ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, h->length, body);
    if (!m) return;
    if (!reply) check_request(base, m);
    fuzz_pb_check_repack(m);
    protobuf_c_message_free_unpacked(m, NULL);
    return;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_reader_t r = {data, size};
  while (r.left >= ZD__FRAME_HEADER_SIZE) {
    uint8_t in[ZD__FRAME_HEADER_SIZE], out[ZD__FRAME_HEADER_SIZE];
    size_t n;
    memcpy(in, fuzz_take(&r, sizeof in, &n), sizeof in);
    zd__frame_header_t h;
    int rc = zd__frame_decode(in, &h);
    zd__frame_encode(&h, out);
    FUZZ_CHECK(memcmp(in, out, sizeof in) == 0, "a header does not encode back to its bytes");
    FUZZ_CHECK(zd__msg_name(h.type) != NULL, "type %u has no name", h.type);
    if (rc != ZD_OK) {
      FUZZ_CHECK(rc == ZD_EPROTO && h.magic != ZD__FRAME_MAGIC, "decode: %d", rc);
      break; /* the stream cannot be trusted any further */
    }
    if (h.length > ZD__FRAME_MAX_BODY || h.length > r.left) break;
    char *body = fuzz_guarded_copy(fuzz_take(&r, h.length, &n), h.length);
    unpack_body(&h, (const uint8_t *)body);
    fuzz_guarded_free(body, h.length);
  }
  return 0;
}
