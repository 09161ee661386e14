/* Unit test of the group table (common/group.h), the dtype table (common/dtype.h) and the wire
 * conversions generated from them (proto/wire.c): message Group has exactly the table's fields, by
 * name and in order, with the table's defaults; every field survives encoding, packing, unpacking
 * and decoding; a Group from an older client (optional fields absent) decodes to the defaults;
 * zd__group_check names the failing field as the table says; the group hash sees every field;
 * zd_group_fields() describes zd_group_t; dtype checks and their messages; the loss scaler both
 * ways.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "dtype.h"
#include "group.h"
#include "wire.h"

static const char *const table_names[] = {
#define NAME(name, kind, valid, expected, dflt) #name,
    ZD__GROUP_FIELDS(NAME)
#undef NAME
};
#define NFIELDS (sizeof table_names / sizeof table_names[0])

/* Every field set away from its default (maximize, optimizer included). */
static zd_group_t unusual(void) {
  zd_group_t g = zd__group_default();
  g.lr = 3.25e-4;
  g.beta1 = 0.8125;
  g.beta2 = 0.96875;
  g.eps = 1e-6;
  g.weight_decay = 0.125;
  g.optimizer = ZD_ADAM;
  g.maximize = 1;
  return g;
}

static void test_descriptor(void) {
  const ProtobufCMessageDescriptor *d = &zerod__v1__group__descriptor;
  CHECK_U64_EQ(d->n_fields, NFIELDS);
  zd_group_t def = zd__group_default();
  const zd_group_field_t *fields;
  size_t field_size = 0, size = 0;
  CHECK_U64_EQ(zd_group_fields(&fields, &field_size, &size), NFIELDS);
  CHECK_U64_EQ(field_size, sizeof(zd_group_field_t));
  CHECK_U64_EQ(size, sizeof(zd_group_t));
  for (unsigned i = 0; i < d->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &d->fields[i];
    CHECK_STR_EQ(f->name, table_names[i]);
    CHECK_STR_EQ(fields[i].name, table_names[i]);
    CHECK_U64_EQ(f->id, i + 1);
    /* The value zd_group_fields() reports as the default is zd__group_default()'s. */
    const char *at = (const char *)&def + fields[i].offset;
    double dflt =
        fields[i].kind == ZD_FIELD_DOUBLE ? *(const double *)at : (double)*(const int *)at;
    CHECK_DBL_EQ(fields[i].default_value, dflt);
    /* A field added after the first five is optional, with the table's default. */
    if (f->label == PROTOBUF_C_LABEL_REQUIRED) {
      CHECK_INT_LT(i, 5);
      continue;
    }
    CHECK_INT_EQ(f->label, PROTOBUF_C_LABEL_OPTIONAL);
    CHECK(f->default_value);
    double wire_default = f->type == PROTOBUF_C_TYPE_DOUBLE ? *(const double *)f->default_value
                          : f->type == PROTOBUF_C_TYPE_BOOL
                              ? (double)*(const protobuf_c_boolean *)f->default_value
                              : (double)*(const int *)f->default_value;
    CHECK_MSG(wire_default == fields[i].default_value, "Group.%s: .proto default %g, table %g",
              f->name, wire_default, fields[i].default_value);
  }
  for (size_t i = 1; i < NFIELDS; i++) CHECK(fields[i].offset > fields[i - 1].offset);
  printf("descriptor: message Group is the table (%zu fields, names, order, defaults)\n", NFIELDS);
}

/* Every field of a and b has the same bits (zd_group_fields() says where they are). */
static int same_group(const zd_group_t *a, const zd_group_t *b) {
  const zd_group_field_t *f;
  size_t n = zd_group_fields(&f, NULL, NULL);
  for (size_t i = 0; i < n; i++) {
    size_t size = f[i].kind == ZD_FIELD_DOUBLE ? sizeof(double) : sizeof(int);
    if (memcmp((const char *)a + f[i].offset, (const char *)b + f[i].offset, size)) return 0;
  }
  return 1;
}

static zd_group_t round_trip(const Zerod__V1__Group *w) {
  size_t len = zerod__v1__group__get_packed_size(w);
  uint8_t buf[256];
  CHECK(len <= sizeof buf);
  zerod__v1__group__pack(w, buf);
  Zerod__V1__Group *back = zerod__v1__group__unpack(NULL, len, buf);
  CHECK(back);
  zd_group_t g;
  memset(&g, 0xa5, sizeof g);
  zd__err_t err = {0};
  int rc = zd__wire_groups_from(&g, &back, 1, &err);
  CHECK_MSG(rc == ZD_OK, "%s", err.msg);
  zerod__v1__group__free_unpacked(back, NULL);
  return g;
}

static void test_group_wire(void) {
  zd_group_t g = unusual();
  Zerod__V1__Group w;
  zd__wire_group_to(&w, &g);
  CHECK_INT_EQ(w.has_optimizer, 1);
  CHECK_INT_EQ(w.has_maximize, 1);
  zd_group_t back = round_trip(&w);
  CHECK(same_group(&back, &g));
  /* An older client: only the required fields. */
  w.has_optimizer = w.has_maximize = 0;
  back = round_trip(&w);
  zd_group_t def = zd__group_default();
  CHECK_INT_EQ(back.optimizer, def.optimizer);
  CHECK_INT_EQ(back.maximize, def.maximize);
  CHECK_DBL_EQ(back.lr, g.lr);
  /* A boolean travels as 0 or 1. */
  g.maximize = 7;
  zd__wire_group_to(&w, &g);
  CHECK_INT_EQ(round_trip(&w).maximize, 1);
  printf("group wire: every field round-trips; absent optional fields take the defaults\n");
}

static void expect_refused(zd_group_t g, const char *msg) {
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__group_check(&g, "group 3", &err), ZD_EHPARAM);
  CHECK_STR_EQ(err.msg, msg);
}

static void test_group_check(void) {
  zd__err_t err = {0};
  zd_group_t g = zd__group_default();
  CHECK_INT_EQ(zd__group_check(&g, "group 0", &err), ZD_OK);
  g = unusual();
  CHECK_INT_EQ(zd__group_check(&g, "group 0", &err), ZD_OK);
  g = zd__group_default();
  g.lr = -1;
  expect_refused(g, "group 3: lr is -1; expected a finite value >= 0");
  g = zd__group_default();
  g.beta2 = NAN;
  expect_refused(g, "group 3: beta2 is nan; expected a value in [0, 1)");
  g = zd__group_default();
  g.eps = 0;
  expect_refused(g, "group 3: eps is 0; expected a finite value > 0");
  g = zd__group_default();
  g.weight_decay = INFINITY;
  expect_refused(g, "group 3: weight_decay is inf; expected a finite value >= 0");
  g = zd__group_default();
  g.optimizer = (zd_optimizer_t)7;
  expect_refused(g,
                 "group 3: optimizer 7 unknown; expected one of ADAMW (0) ADAM (1) SGD (2) "
                 "ADAGRAD (3) RMSPROP (4) LION (5)");
  g = zd__group_default();
  g.maximize = 2;
  expect_refused(g, "group 3: maximize is 2; expected 0 or 1");
  printf("group check: each field refused with the table's message\n");
}

static void test_group_hash(void) {
  zd_group_t a = zd__group_default(), b = a;
  uint64_t h0 = 0xcbf29ce484222325ull;
  CHECK_U64_EQ(zd__group_hash(h0, &a), zd__group_hash(h0, &b));
  b.maximize = 1;
  CHECK_INT_NE(zd__group_hash(h0, &a), zd__group_hash(h0, &b));
  b = a;
  b.optimizer = ZD_ADAM;
  CHECK_INT_NE(zd__group_hash(h0, &a), zd__group_hash(h0, &b));
  b = a;
  b.lr = nextafter(a.lr, 1.0);
  CHECK_INT_NE(zd__group_hash(h0, &a), zd__group_hash(h0, &b));
  printf("group hash: every field counts\n");
}

static void test_dtype(void) {
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__dtype_check(ZD_F32, ZD__DTYPE_PARAM, &err), ZD_OK);
  CHECK_INT_EQ(zd__dtype_check(ZD_BF16, ZD__DTYPE_PARAM, &err), ZD_OK);
  CHECK_INT_EQ(zd__dtype_check(ZD_F16, ZD__DTYPE_GRAD, &err), ZD_OK);
  CHECK_INT_EQ(zd__dtype_check(ZD_F16, ZD__DTYPE_PARAM, &err), ZD_EDTYPE);
  CHECK_STR_EQ(err.msg, "param dtype 3 (f16) not supported; expected f32 or bf16");
  CHECK_INT_EQ(zd__dtype_check(9, ZD__DTYPE_GRAD, &err), ZD_EDTYPE);
  CHECK_STR_EQ(err.msg, "grad dtype 9 not supported; expected f32, bf16 or f16");
  CHECK_INT_EQ(zd__dtype_check(0, ZD__DTYPE_PARAM, &err), ZD_EDTYPE);
  CHECK_STR_EQ(err.msg, "param dtype 0 not supported; expected f32 or bf16");
  CHECK_U64_EQ(zd_dtype_size(ZD_BF16), 2);
  CHECK_U64_EQ(zd_dtype_size((zd_dtype_t)0), 0);
  CHECK_STR_EQ(zd_dtype_name(ZD_F16), "f16");
  CHECK_STR_EQ(zd_dtype_name((zd_dtype_t)9), "?");
  CHECK_INT_EQ(zd__wire_dtype_from(zd__wire_dtype_to(ZD_F16)), ZD_F16);
  CHECK_INT_EQ(zd__wire_dtype_to(ZD_BF16), ZEROD__V1__DTYPE__BF16);
  printf("dtype: checks, messages, sizes, names and wire values\n");
}

static void test_scaler(void) {
  zd_loss_scaler_t s = {0}, back;
  Zerod__V1__LossScaler w;
  CHECK(zd__wire_scaler_to(&w, &s) == NULL);
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__wire_scaler_from(&back, NULL, &err), ZD_OK);
  CHECK_INT_EQ(back.enabled, 0);
  s = (zd_loss_scaler_t){.enabled = 1,
                         .initial_scale = 65536,
                         .growth_factor = 2,
                         .backoff_factor = 0.5,
                         .growth_interval = 1000,
                         .hysteresis = 2,
                         .min_scale = 1};
  CHECK(zd__wire_scaler_to(&w, &s) == &w);
  CHECK_INT_EQ(zd__wire_scaler_from(&back, &w, &err), ZD_OK);
  CHECK(memcmp(&back, &s, sizeof s) == 0);
  w.backoff_factor = 1;
  CHECK_INT_EQ(zd__wire_scaler_from(&back, &w, &err), ZD_EHPARAM);
  CHECK_STR_EQ(err.msg, "loss scaler backoff_factor is 1; expected a value in (0, 1)");
  CHECK_INT_EQ(back.enabled, 0);
  printf("loss scaler: both ways, and its checks\n");
}

int main(void) {
  test_descriptor();
  test_group_wire();
  test_group_check();
  test_group_hash();
  test_dtype();
  test_scaler();
  printf("PASS\n");
  return 0;
}
