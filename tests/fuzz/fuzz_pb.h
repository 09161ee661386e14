/* The check both protobuf harnesses (fuzz_frame.c, fuzz_control.c) make of a message that
 * unpacked: it packs again, to bytes that unpack and pack the same once more. What one side packs,
 * the other reads back unchanged.
 *
 * Except for one protobuf-c 1.4 quirk (third-party, not zerod's): it accepts field number 0, which
 * protobuf forbids, when the tag is encoded in more bytes than needed ("85 00"), keeps it as an
 * unknown field, packs that with a one-byte tag and then refuses its own output. zerod never packs
 * a message it received, so such messages are only unpacked and freed here.
 */
#ifndef ZD_TESTS_FUZZ_PB_H
#define ZD_TESTS_FUZZ_PB_H

#include <protobuf-c/protobuf-c.h>
#include <string.h>

#include "fuzz.h"

/* Whether m or a message inside it holds an unknown field numbered 0. */
static inline int fuzz_pb_has_field_zero(const ProtobufCMessage *m) {
  for (unsigned i = 0; i < m->n_unknown_fields; i++)
    if (m->unknown_fields[i].tag == 0) return 1;
  const ProtobufCMessageDescriptor *d = m->descriptor;
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    if (f->type != PROTOBUF_C_TYPE_MESSAGE) continue;
    const char *member = (const char *)m + f->offset;
    if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
        *(const uint32_t *)((const char *)m + f->quantifier_offset) != f->id)
      continue;
    if (f->label == PROTOBUF_C_LABEL_REPEATED) {
      size_t n = *(const size_t *)((const char *)m + f->quantifier_offset);
      ProtobufCMessage *const *sub = *(ProtobufCMessage *const *const *)member;
      for (size_t k = 0; k < n; k++)
        if (fuzz_pb_has_field_zero(sub[k])) return 1;
    } else {
      const ProtobufCMessage *sub = *(const ProtobufCMessage *const *)member;
      if (sub && fuzz_pb_has_field_zero(sub)) return 1;
    }
  }
  return 0;
}

static inline uint8_t *fuzz_pb_pack(const ProtobufCMessage *m, size_t *size) {
  *size = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = malloc(*size ? *size : 1);
  FUZZ_CHECK(buf, "out of memory");
  size_t packed = protobuf_c_message_pack(m, buf);
  FUZZ_CHECK(packed == *size, "%s packed %zu bytes; get_packed_size said %zu", m->descriptor->name,
             packed, *size);
  return buf;
}

/* pack(unpack(pack(m))) == pack(m). */
static inline void fuzz_pb_check_repack(const ProtobufCMessage *m) {
  FUZZ_CHECK(protobuf_c_message_check(m), "%s unpacked but does not check", m->descriptor->name);
  if (fuzz_pb_has_field_zero(m)) return;
  size_t n1, n2;
  uint8_t *a = fuzz_pb_pack(m, &n1);
  ProtobufCMessage *again = protobuf_c_message_unpack(m->descriptor, NULL, n1, a);
  FUZZ_CHECK(again, "%s does not unpack what it packed (%zu bytes)", m->descriptor->name, n1);
  uint8_t *b = fuzz_pb_pack(again, &n2);
  FUZZ_CHECK(n1 == n2 && memcmp(a, b, n1) == 0, "%s repacks differently (%zu bytes, then %zu)",
             m->descriptor->name, n1, n2);
  protobuf_c_message_free_unpacked(again, NULL);
  free(b);
  free(a);
}

#endif /* ZD_TESTS_FUZZ_PB_H */
