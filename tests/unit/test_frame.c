/* Unit test of the frame header codec (proto/frame.c, docs/protocol.md) and the error space
 * (proto/error.c, zerod/errors.h): the exact 24-byte little-endian wire layout, encode/decode
 * round trips of random headers, rejection of a bad magic, message type names, error names and
 * descriptions for zerod's codes, ZD_OK and negated errno values, and zd__errf.
 */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "error.h"
#include "frame.h"

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static uint64_t rnd(void) { /* xorshift64* */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545f4914f6cdd1dull;
}

static void check_header_eq(const zd__frame_header_t *a, const zd__frame_header_t *b) {
  CHECK_U64_EQ(a->magic, b->magic);
  CHECK_U64_EQ(a->version, b->version);
  CHECK_U64_EQ(a->type, b->type);
  CHECK_U64_EQ(a->length, b->length);
  CHECK_U64_EQ(a->flags, b->flags);
  CHECK_U64_EQ(a->request_id, b->request_id);
}

static void check_bytes(const uint8_t *got, const uint8_t *want, size_t n) {
  for (size_t i = 0; i < n; i++)
    CHECK_MSG(got[i] == want[i], "byte %zu is 0x%02x, expected 0x%02x", i, got[i], want[i]);
}

/* Every field at its offset, least significant byte first. */
static void test_wire_layout(void) {
  CHECK_INT_EQ(ZD__FRAME_HEADER_SIZE, 24);
  const zd__frame_header_t h = {
      .magic = ZD__FRAME_MAGIC,
      .version = 0x0102,
      .type = 0x8003,
      .length = 0x0a0b0c0d,
      .flags = 0x11223344,
      .request_id = 0x0102030405060708ull,
  };
  const uint8_t want[24] = {
      0x5a, 0x52, 0x44, 0x31,                         /*  0 magic "ZRD1" */
      0x02, 0x01,                                     /*  4 version */
      0x03, 0x80,                                     /*  6 type */
      0x0d, 0x0c, 0x0b, 0x0a,                         /*  8 length */
      0x44, 0x33, 0x22, 0x11,                         /* 12 flags */
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, /* 16 request id */
  };
  CHECK(memcmp(want, "ZRD1", 4) == 0);
  uint8_t out[24 + 8];
  memset(out, 0xee, sizeof out);
  zd__frame_encode(&h, out);
  check_bytes(out, want, 24);
  for (size_t i = 24; i < sizeof out; i++) CHECK_INT_EQ(out[i], 0xee); /* nothing past 24 */

  zd__frame_header_t d;
  memset(&d, 0xff, sizeof d);
  CHECK_INT_EQ(zd__frame_decode(want, &d), ZD_OK);
  check_header_eq(&d, &h);

  /* All ones and all zeros in every field but the magic. */
  zd__frame_header_t hi = {ZD__FRAME_MAGIC, 0xffff, 0xffff, 0xffffffffu, 0xffffffffu, UINT64_MAX};
  zd__frame_header_t lo = {ZD__FRAME_MAGIC, 0, 0, 0, 0, 0};
  zd__frame_encode(&hi, out);
  for (int i = 4; i < 24; i++) CHECK_INT_EQ(out[i], 0xff);
  CHECK_INT_EQ(zd__frame_decode(out, &d), ZD_OK);
  check_header_eq(&d, &hi);
  zd__frame_encode(&lo, out);
  for (int i = 4; i < 24; i++) CHECK_INT_EQ(out[i], 0);
  CHECK_INT_EQ(zd__frame_decode(out, &d), ZD_OK);
  check_header_eq(&d, &lo);
}

static void test_round_trip(void) {
  for (int iter = 0; iter < 100000; iter++) {
    zd__frame_header_t d, h;
    h.magic = ZD__FRAME_MAGIC;
    h.version = (uint16_t)rnd();
    h.type = (uint16_t)rnd();
    h.length = (uint32_t)rnd();
    h.flags = (uint32_t)rnd();
    h.request_id = rnd();
    uint8_t buf[24], again[24];
    zd__frame_encode(&h, buf);
    CHECK_MSG(zd__frame_decode(buf, &d) == ZD_OK, "iteration %d", iter);
    check_header_eq(&d, &h);
    /* And bytes -> header -> bytes for arbitrary bytes after a good magic. */
    for (int i = 4; i < 24; i++) buf[i] = (uint8_t)rnd();
    CHECK_INT_EQ(zd__frame_decode(buf, &d), ZD_OK);
    zd__frame_encode(&d, again);
    check_bytes(again, buf, 24);
  }
}

static void test_bad_magic(void) {
  uint8_t buf[24];
  zd__frame_header_t h = {.magic = ZD__FRAME_MAGIC, .version = 1, .type = ZD__MSG_HELLO}, d;
  zd__frame_encode(&h, buf);
  /* Any flipped bit of the magic is refused; a flipped bit elsewhere is the caller's to judge. */
  for (int bit = 0; bit < 24 * 8; bit++) {
    buf[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    int rc = zd__frame_decode(buf, &d);
    CHECK_MSG(rc == (bit < 32 ? ZD_EPROTO : ZD_OK), "bit %d flipped: %d (%s)", bit, rc,
              zd_err_name(rc));
    buf[bit / 8] ^= (uint8_t)(1u << (bit % 8));
  }
  memcpy(buf, "1DRZ", 4); /* big-endian magic */
  CHECK_INT_EQ(zd__frame_decode(buf, &d), ZD_EPROTO);
  memset(buf, 0, sizeof buf);
  CHECK_INT_EQ(zd__frame_decode(buf, &d), ZD_EPROTO);
  memcpy(buf, "GET / HTTP/1.1\r\nHost: x\r\n", 24);
  CHECK_INT_EQ(zd__frame_decode(buf, &d), ZD_EPROTO);
}

static void test_msg_names(void) {
  /* Wire values, written out: never renumbered. */
  static const struct {
    int type;
    uint16_t value;
    const char *name;
  } msgs[] = {
      {ZD__MSG_HELLO, 1, "hello"},      {ZD__MSG_REGISTER, 2, "register"},
      {ZD__MSG_STEP, 3, "step"},        {ZD__MSG_SCATTER, 4, "scatter"},
      {ZD__MSG_GATHER, 5, "gather"},    {ZD__MSG_STATUS, 6, "status"},
      {ZD__MSG_BYE, 7, "bye"},          {ZD__MSG_CHECKPOINT, 8, "checkpoint"},
      {ZD__MSG_ERROR, 0x7fff, "error"},
  };
  const size_t n = sizeof msgs / sizeof msgs[0];
  int in_map = 0;
#define COUNT_MSG(name, value, text) in_map++;
  ZD__MSG_MAP(COUNT_MSG)
#undef COUNT_MSG
  CHECK_INT_EQ(in_map, n); /* a new type needs a line in this table */
  CHECK_U64_EQ(ZD__FRAME_REPLY, 0x8000);
  for (size_t i = 0; i < n; i++) {
    CHECK_INT_EQ(msgs[i].type, msgs[i].value);
    CHECK_STR_EQ(zd__msg_name(msgs[i].value), msgs[i].name);
    CHECK_STR_EQ(zd__msg_name((uint16_t)(msgs[i].value | ZD__FRAME_REPLY)), msgs[i].name);
  }
  /* Every other value, with or without the reply bit, is unknown. */
  for (uint32_t t = 0; t <= 0xffff; t++) {
    const char *want = "unknown";
    for (size_t i = 0; i < n; i++)
      if ((t & ~ZD__FRAME_REPLY) == msgs[i].value) want = msgs[i].name;
    const char *got = zd__msg_name((uint16_t)t);
    CHECK_MSG(got && strcmp(got, want) == 0, "type 0x%04x: \"%s\", expected \"%s\"", t,
              got ? got : "(null)", want);
  }
  CHECK_STR_EQ(zd__msg_name(0), "unknown");
  CHECK_STR_EQ(zd__msg_name(9), "unknown");
  CHECK_STR_EQ(zd__msg_name(ZD__FRAME_REPLY), "unknown");
  CHECK_STR_EQ(zd__msg_name(0x7ffe), "unknown");
}

static void test_error_space(void) {
  static const struct {
    int code;
    const char *name, *text;
  } errs[] = {
#define ERR_ROW(name, value, text) {value, "ZD_" #name, text},
      ZD_ERROR_MAP(ERR_ROW)
#undef ERR_ROW
  };
  const size_t n = sizeof errs / sizeof errs[0];
  CHECK(n >= 21);
  CHECK_INT_EQ(ZD_EPROTO, -4001); /* wire values */
  CHECK_INT_EQ(ZD_ECONFIG, -4021);
  for (size_t i = 0; i < n; i++) {
    CHECK_INT_LT(errs[i].code, -4000); /* never an errno */
    CHECK_STR_EQ(zd_err_name(errs[i].code), errs[i].name);
    CHECK_STR_EQ(zd_strerror(errs[i].code), errs[i].text);
    CHECK(errs[i].text[0] != '\0');
    for (size_t j = 0; j < i; j++) {
      CHECK_INT_NE(errs[i].code, errs[j].code);
      CHECK(strcmp(errs[i].name, errs[j].name) != 0);
      CHECK(strcmp(errs[i].text, errs[j].text) != 0);
    }
  }
  CHECK_STR_EQ(zd_err_name(ZD_OK), "ZD_OK");
  CHECK_STR_EQ(zd_strerror(ZD_OK), "success");

  /* Negated errno values: the system's name and description. */
  static const struct {
    int err;
    const char *name;
  } sys[] = {
      {ETIMEDOUT, "ETIMEDOUT"}, {ENOENT, "ENOENT"}, {EINVAL, "EINVAL"},
      {ENOMEM, "ENOMEM"},       {EPIPE, "EPIPE"},   {ECONNREFUSED, "ECONNREFUSED"},
      {EACCES, "EACCES"},       {EPROTO, "EPROTO"}, {EBUSY, "EBUSY"},
  };
  for (size_t i = 0; i < sizeof sys / sizeof sys[0]; i++) {
    CHECK_STR_EQ(zd_err_name(-sys[i].err), sys[i].name);
    CHECK_STR_EQ(zd_strerror(-sys[i].err), strerror(sys[i].err));
  }
  CHECK(ZD_EPROTO != -EPROTO && ZD_EBUSY != -EBUSY); /* same names, distinct spaces */

  /* Anything else: a placeholder, never NULL or empty. */
  const int unknown[] = {1, 4001, -4000, -4025, -4999, INT_MIN, INT_MAX};
  for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
    CHECK_STR_EQ(zd_err_name(unknown[i]), "ZD_UNKNOWN");
    CHECK_STR_EQ(zd_strerror(unknown[i]), "unknown error");
  }
  for (int code = -5000; code <= 5000; code++) {
    const char *a = zd_err_name(code), *b = zd_strerror(code);
    CHECK_MSG(a && a[0] && b && b[0], "code %d: name %s, text %s", code, a ? a : "(null)",
              b ? b : "(null)");
  }
}

static void test_errf(void) {
  zd__err_t err = {.code = 0, .msg = "stale"};
  CHECK_INT_EQ(zd__errf(&err, ZD_EBUFFER, "grad buffer is %d bytes, layout needs %d for rank %u",
                        4096, 8192, 1u),
               ZD_EBUFFER);
  CHECK_INT_EQ(err.code, ZD_EBUFFER);
  CHECK_STR_EQ(err.msg, "grad buffer is 4096 bytes, layout needs 8192 for rank 1");
  CHECK_INT_EQ(zd__errf(&err, -ENOENT, "%s", ""), -ENOENT);
  CHECK_INT_EQ(err.code, -ENOENT);
  CHECK_STR_EQ(err.msg, "");
  CHECK_INT_EQ(zd__errf(NULL, ZD_EPEER, "peer %d", 3), ZD_EPEER); /* no message wanted */

  /* A message longer than the buffer is cut and terminated. */
  char longer[ZD__ERR_MSG_MAX * 2];
  memset(longer, 'm', sizeof longer - 1);
  longer[sizeof longer - 1] = '\0';
  CHECK_INT_EQ(zd__errf(&err, ZD_EINTERNAL, "%s", longer), ZD_EINTERNAL);
  CHECK_INT_EQ(strlen(err.msg), ZD__ERR_MSG_MAX - 1);
  CHECK(strncmp(err.msg, longer, ZD__ERR_MSG_MAX - 1) == 0);
}

int main(void) {
  test_wire_layout();
  test_round_trip();
  test_bad_magic();
  test_msg_names();
  test_error_space();
  test_errf();
  printf("test_frame: ok\n");
  return 0;
}
