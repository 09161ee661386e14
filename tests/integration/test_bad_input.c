/* Bad input against a real zerod: every case must get its own error reply naming the problem and
 * the expected value, and zerod must keep serving a well-behaved client that trains alongside
 * (it steps after every case). Frames are built by hand here, since libzerod never sends them. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <time.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "harness.h"
#include "layout.h"
#include "mlp.h"
#include "zerod.pb-c.h"
#include "zerod/zerod.h"

static zdt_daemon_t daemon_;
static zd_client_t *bystander;
static uint64_t bystander_steps;

/* The well-behaved client: one more step must still work. */
static void bystander_step(const char *after) {
  zd_step_result_t r = ZD_STEP_RESULT_INIT;
  int rc = zd_step(bystander, NULL, &r);
  CHECK_MSG(rc == ZD_OK, "bystander step after '%s' failed: %s", after, zd_last_error());
  CHECK_U64_EQ(r.step, ++bystander_steps);
  printf("  ok: %s\n", after);
}

static int connect_hello(void) {
  int fd = zdt_raw_connect(daemon_.socket);
  CHECK(fd >= 0);
  zdt_raw_hello(fd, 1);
  return fd;
}

static int make_memfd(size_t bytes, int seal) {
  int fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  CHECK(fd >= 0);
  CHECK(ftruncate(fd, (off_t)bytes) == 0);
  if (seal) CHECK(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
  return fd;
}

/* A register request for the MLP; tweak() may break it before it is packed. */
typedef struct reg {
  Zerod__V1__RegisterRequest req;
  Zerod__V1__Param params[MLP_NPARAMS];
  Zerod__V1__Param *pp[MLP_NPARAMS];
  Zerod__V1__Group groups[2];
  Zerod__V1__Group *gp[2];
  uint64_t total_elems;
} reg_t;

static void reg_init(reg_t *r, uint32_t world_size) {
  zerod__v1__register_request__init(&r->req);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zerod__v1__param__init(&r->params[i]);
    r->params[i].name = (char *)mlp_params[i].name;
    r->params[i].n_shape = mlp_params[i].ndim;
    r->params[i].shape = (uint64_t *)mlp_params[i].shape;
    r->params[i].group = mlp_params[i].group;
    r->pp[i] = &r->params[i];
  }
  for (int g = 0; g < 2; g++) {
    zerod__v1__group__init(&r->groups[g]);
    r->groups[g].lr = 1e-3;
    r->groups[g].beta1 = 0.9;
    r->groups[g].beta2 = 0.999;
    r->groups[g].eps = 1e-8;
    r->groups[g].weight_decay = 0.01;
    r->gp[g] = &r->groups[g];
  }
  r->req.n_params = MLP_NPARAMS;
  r->req.params = r->pp;
  r->req.n_groups = 2;
  r->req.groups = r->gp;
  r->req.param_dtype = ZEROD__V1__DTYPE__F32;
  r->req.grad_dtype = ZEROD__V1__DTYPE__F32;
  zd__layout_t *l;
  CHECK_INT_EQ(zd__layout_build(mlp_params, MLP_NPARAMS, 2, world_size, 0, &l, NULL), ZD_OK);
  r->req.layout_hash = l->hash;
  r->total_elems = l->total_elems;
  zd__layout_free(l);
}

/* Sends a register with two buffers of the given sizes on a fresh session; returns the fd. */
static int send_register(reg_t *r, size_t param_bytes, size_t grad_bytes, int seal) {
  int fd = connect_hello();
  uint8_t *buf = malloc(zerod__v1__register_request__get_packed_size(&r->req));
  size_t len = zerod__v1__register_request__pack(&r->req, buf);
  int fds[2] = {make_memfd(param_bytes, seal), make_memfd(grad_bytes, seal)};
  zd__frame_header_t h = {.magic = ZD__FRAME_MAGIC,
                          .version = ZD_PROTOCOL_VERSION,
                          .type = ZD__MSG_REGISTER,
                          .length = (uint32_t)len,
                          .request_id = 7};
  zdt_raw_send(fd, &h, buf, fds, 2);
  close(fds[0]);
  close(fds[1]);
  free(buf);
  return fd;
}

static void expect_register_error(reg_t *r, int code, const char *substr, const char *what) {
  size_t bytes = r->total_elems * 4;
  int fd = send_register(r, bytes, bytes, 1);
  const char *msg = zdt_expect_error(fd, 7, code, substr);
  printf("  %s -> %s: %s\n", what, zd_err_name(code), msg);
  close(fd);
  bystander_step(what);
}

static void test_version(void) {
  int fd = zdt_raw_connect(daemon_.socket);
  zd__frame_header_t h = {
      .magic = ZD__FRAME_MAGIC, .version = 9, .type = ZD__MSG_HELLO, .request_id = 3};
  zdt_raw_send(fd, &h, NULL, NULL, 0);
  printf("  frame version 9 -> %s\n",
         zdt_expect_error(fd, 3, ZD_EVERSION, "protocol version 9; this zerod speaks version 1"));
  /* the header layout is fixed, so the session goes on: a correct hello still works */
  Zerod__V1__HelloRequest req = ZEROD__V1__HELLO_REQUEST__INIT;
  req.min_version = 2;
  req.max_version = 3;
  uint8_t buf[64];
  size_t len = zerod__v1__hello_request__pack(&req, buf);
  zdt_raw_request(fd, ZD__MSG_HELLO, 4, buf, (uint32_t)len);
  printf("  hello versions 2..3 -> %s\n",
         zdt_expect_error(fd, 4, ZD_EVERSION,
                          "client speaks protocol versions 2..3; this zerod "
                          "speaks 1"));
  /* a negative local rank other than -1 (ZD_ANY_RANK) is a mistake, not "any rank" */
  req.min_version = req.max_version = ZD_PROTOCOL_VERSION;
  req.has_local_rank = 1;
  req.local_rank = -5;
  len = zerod__v1__hello_request__pack(&req, buf);
  zdt_raw_request(fd, ZD__MSG_HELLO, 6, buf, (uint32_t)len);
  printf("  hello local rank -5 -> %s\n",
         zdt_expect_error(fd, 6, ZD_ERANK,
                          "local rank -5 is not valid; expected 0..0, or -1 (ZD_ANY_RANK)"));
  zdt_raw_hello(fd, 5);
  close(fd);
  bystander_step("wrong protocol version, bad local rank");
}

static void test_truncated(void) {
  int fd = zdt_raw_connect(daemon_.socket);
  uint8_t buf[ZD__FRAME_HEADER_SIZE + 10] = {0};
  zd__frame_header_t h = {.magic = ZD__FRAME_MAGIC,
                          .version = 1,
                          .type = ZD__MSG_HELLO,
                          .length = 100,
                          .request_id = 11};
  zd__frame_encode(&h, buf);
  CHECK_INT_EQ(send(fd, buf, sizeof buf, MSG_NOSIGNAL), (long long)sizeof buf);
  printf("  truncated frame -> %s\n",
         zdt_expect_error(fd, 11, ZD_EPROTO,
                          "truncated frame: received 34 of 124 bytes within "
                          "500 ms"));
  CHECK(zdt_raw_closed(fd, 2000));
  close(fd);
  /* a truncated register is answered like every refused register: zerod holds none of its IPC
   * handles (docs/protocol.md, "Releasing the handles") */
  fd = connect_hello();
  h.type = ZD__MSG_REGISTER;
  h.request_id = 15;
  zd__frame_encode(&h, buf);
  CHECK_INT_EQ(send(fd, buf, sizeof buf, MSG_NOSIGNAL), (long long)sizeof buf);
  printf("  truncated register -> %s\n",
         zdt_expect_error_kept(fd, 15, ZD_EPROTO, "truncated frame: received 34 of 124 bytes", 0));
  CHECK(zdt_raw_closed(fd, 2000));
  close(fd);
  bystander_step("truncated frame");
}

static void test_oversized(void) {
  int fd = zdt_raw_connect(daemon_.socket);
  uint8_t buf[ZD__FRAME_HEADER_SIZE];
  zd__frame_header_t h = {.magic = ZD__FRAME_MAGIC,
                          .version = 1,
                          .type = ZD__MSG_REGISTER,
                          .length = 10u << 20,
                          .request_id = 12};
  zd__frame_encode(&h, buf);
  CHECK_INT_EQ(send(fd, buf, sizeof buf, MSG_NOSIGNAL), (long long)sizeof buf);
  printf("  oversized frame -> %s\n",
         zdt_expect_error(fd, 12, ZD_ETOOBIG,
                          "frame body is 10485760 bytes; max_frame_bytes is "
                          "65536"));
  CHECK(zdt_raw_closed(fd, 2000));
  close(fd);
  /* a body within max_frame_bytes but over the command's own limit: refused, session lives */
  fd = connect_hello();
  uint8_t *big = calloc(1, 5000);
  zdt_raw_request(fd, ZD__MSG_STATUS, 13, big, 5000);
  printf("  status body of 5000 bytes -> %s\n",
         zdt_expect_error(fd, 13, ZD_ETOOBIG, "status body is 5000 bytes; at most 64 expected"));
  free(big);
  /* the session is still framed and answers: a second hello is its own error */
  Zerod__V1__HelloRequest hello = ZEROD__V1__HELLO_REQUEST__INIT;
  hello.min_version = hello.max_version = ZD_PROTOCOL_VERSION;
  uint8_t hb[64];
  zdt_raw_request(fd, ZD__MSG_HELLO, 14, hb, (uint32_t)zerod__v1__hello_request__pack(&hello, hb));
  zdt_expect_error(fd, 14, ZD_EORDER, "hello sent twice");
  close(fd);
  bystander_step("oversized frame");
}

static void test_garbage(void) {
  int fd = zdt_raw_connect(daemon_.socket);
  const char junk[] = "GET / HTTP/1.1\r\nHost: zerod\r\n\r\n";
  CHECK_INT_EQ(send(fd, junk, sizeof junk - 1, MSG_NOSIGNAL), (long long)sizeof junk - 1);
  printf("  garbage -> %s\n", zdt_expect_error(fd, 0, ZD_EPROTO,
                                               "garbage frame: magic is "
                                               "0x20544547, expected 0x3144525a"));
  CHECK(zdt_raw_closed(fd, 2000));
  close(fd);
  /* a well-framed hello whose body is not protobuf */
  fd = zdt_raw_connect(daemon_.socket);
  uint8_t body[16];
  memset(body, 0xff, sizeof body);
  zdt_raw_request(fd, ZD__MSG_HELLO, 21, body, sizeof body);
  printf("  garbage body -> %s\n", zdt_expect_error(fd, 21, ZD_EPROTO, "malformed hello body"));
  zdt_raw_hello(fd, 22);
  close(fd);
  bystander_step("garbage frame");
}

static void test_unknown_type(void) {
  int fd = connect_hello();
  zdt_raw_request(fd, 99, 31, NULL, 0);
  printf("  type 99 -> %s\n", zdt_expect_error(fd, 31, ZD_ETYPE,
                                               "unknown message type 99; "
                                               "expected one of hello (1)"));
  zdt_raw_request(fd, ZD__MSG_STATUS, 32, NULL, 0); /* the session goes on */
  zd__frame_header_t h;
  uint8_t *b;
  CHECK(zdt_raw_recv(fd, &h, &b, 5000) == 0);
  CHECK_INT_EQ(h.type, ZD__MSG_STATUS | ZD__FRAME_REPLY);
  free(b);
  close(fd);
  bystander_step("unknown message type");
}

static void test_order(void) {
  int fd = zdt_raw_connect(daemon_.socket);
  zdt_raw_request(fd, ZD__MSG_SCATTER, 41, NULL, 0);
  printf("  scatter before hello -> %s\n",
         zdt_expect_error(fd, 41, ZD_EORDER, "scatter before hello"));
  zdt_raw_hello(fd, 42);
  zdt_raw_request(fd, ZD__MSG_STEP, 43, NULL, 0);
  printf("  step before register -> %s\n",
         zdt_expect_error(fd, 43, ZD_EORDER, "step before register: register a model first"));
  close(fd);
  bystander_step("step before register");
}

static void test_buffers(void) {
  reg_t r;
  reg_init(&r, 1);
  size_t need = r.total_elems * 4;
  int fd = send_register(&r, need - 4, need, 1);
  char want[128];
  snprintf(want, sizeof want, "param buffer is %zu bytes, layout needs %zu", need - 4, need);
  printf("  small buffer -> %s\n", zdt_expect_error(fd, 7, ZD_EBUFFER, want));
  close(fd);
  fd = send_register(&r, need, need / 2, 1);
  snprintf(want, sizeof want, "grad buffer is %zu bytes, layout needs %zu", need / 2, need);
  printf("  small grad buffer -> %s\n", zdt_expect_error(fd, 7, ZD_EBUFFER, want));
  close(fd);
  fd = send_register(&r, need, need, 0);
  printf("  unsealed buffer -> %s\n",
         zdt_expect_error(fd, 7, ZD_EBUFFER, "not sealed against shrinking"));
  close(fd);
  /* no descriptors at all */
  fd = connect_hello();
  uint8_t *buf = malloc(zerod__v1__register_request__get_packed_size(&r.req));
  size_t len = zerod__v1__register_request__pack(&r.req, buf);
  zdt_raw_request(fd, ZD__MSG_REGISTER, 8, buf, (uint32_t)len);
  free(buf);
  printf("  no descriptors -> %s\n",
         zdt_expect_error(fd, 8, ZD_EBUFFER, "register needs 2 file descriptors"));
  close(fd);
  bystander_step("buffer smaller than the layout");
}

static void test_register_fields(void) {
  reg_t r;
  reg_init(&r, 1);
  r.req.param_dtype = ZEROD__V1__DTYPE__F16;
  expect_register_error(&r, ZD_EDTYPE, "param dtype 3 (f16) not supported; expected f32 or bf16",
                        "f16 params");
  reg_init(&r, 1);
  r.req.grad_dtype = (Zerod__V1__DType)9;
  expect_register_error(&r, ZD_EDTYPE, "grad dtype 9 not supported; expected f32, bf16 or f16",
                        "unknown grad dtype");
  reg_init(&r, 1);
  r.params[2].group = 5;
  expect_register_error(&r, ZD_EGROUP,
                        "parameter 2 'fc2.weight' is in group 5; expected a group "
                        "below 2",
                        "unknown parameter group");
  reg_init(&r, 1);
  r.groups[1].lr = NAN;
  expect_register_error(&r, ZD_EHPARAM, "group 1: lr is nan; expected a finite value >= 0",
                        "lr NaN");
  reg_init(&r, 1);
  r.groups[0].lr = -1e-3;
  expect_register_error(&r, ZD_EHPARAM, "group 0: lr is -0.001; expected a finite value >= 0",
                        "lr negative");
  reg_init(&r, 1);
  r.groups[0].eps = INFINITY;
  expect_register_error(&r, ZD_EHPARAM, "group 0: eps is inf; expected a finite value > 0",
                        "eps infinite");
  reg_init(&r, 1);
  r.groups[0].eps = -1e-8;
  expect_register_error(&r, ZD_EHPARAM, "group 0: eps is -1e-08; expected a finite value > 0",
                        "eps negative");
  reg_init(&r, 1);
  r.groups[0].beta1 = 1.0;
  expect_register_error(&r, ZD_EHPARAM, "group 0: beta1 is 1; expected a value in [0, 1)",
                        "beta1 = 1");
  reg_init(&r, 1);
  r.groups[1].beta2 = -0.5;
  expect_register_error(&r, ZD_EHPARAM, "group 1: beta2 is -0.5; expected a value in [0, 1)",
                        "beta2 negative");
  reg_init(&r, 1);
  r.req.layout_hash ^= 1;
  expect_register_error(&r, ZD_ELAYOUT, "client and daemon disagree on the layout",
                        "layout hash mismatch");
}

static void test_step_fields(void) {
  /* hyperparameters sent with a step are checked too, on the bystander's own session */
  zd_group_t groups[2];
  zd_group_init(groups, 2, sizeof groups[0]);
  groups[1].lr = -INFINITY;
  zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
  opts.groups = groups;
  opts.ngroups = 2;
  int rc = zd_step(bystander, &opts, NULL);
  CHECK_INT_EQ(rc, ZD_EHPARAM);
  CHECK_CONTAINS(zd_last_error(), "group 1: lr is -inf; expected a finite value >= 0");
  printf("  step with lr -inf -> %s: %s\n", zd_err_name(rc), zd_last_error());
  opts.ngroups = 1;
  rc = zd_step(bystander, &opts, NULL);
  CHECK_INT_EQ(rc, ZD_EGROUP);
  CHECK_CONTAINS(zd_last_error(), "step carries 1 groups; the model has 2");
  rc = zd_scatter(bystander, 99);
  CHECK_INT_EQ(rc, -EINVAL);
  CHECK_CONTAINS(zd_last_error(), "bucket 99 does not exist; expected -1 (all) or 0..0");
  zd_step_opts_t clip = ZD_STEP_OPTS_INIT;
  clip.clip_norm = (zd_clip_norm_t)4;
  rc = zd_step(bystander, &clip, NULL);
  CHECK_INT_EQ(rc, ZD_EHPARAM);
  CHECK_CONTAINS(zd_last_error(),
                 "clip_norm is 4; expected 0 (double), 1 (torch 1.13), 2 "
                 "(torch 2.6) or 3 (torch 2.15)");
  bystander_step("bad step hyperparameters");
}

/* Event slots and IPC mappings (docs/protocol.md, "CUDA buffers"), on this CPU zerod: a client
 * with host buffers names no event slot; a CUDA register's event handles and slot are checked
 * for form before the backend is looked at, so any zerod refuses a malformed one with its own
 * error; every error answering a register says zerod holds none of its handles
 * (cuda_mappings_kept false), other errors leave the field out; and bye says whether zerod kept
 * any mapping of the connection. */
static uint8_t ev_bytes[2][ZD__EVENT_SLOTS][64];
static ProtobufCBinaryData ev_handles[2][ZD__EVENT_SLOTS];

static void cuda_buffers(Zerod__V1__CudaBuffers *cb) {
  static uint8_t uuid[16] = {7}, mem[64];
  zerod__v1__cuda_buffers__init(cb);
  cb->has_device_uuid = cb->has_param_handle = cb->has_grad_handle = 1;
  cb->device_uuid = (ProtobufCBinaryData){16, uuid};
  cb->param_handle = cb->grad_handle = (ProtobufCBinaryData){64, mem};
  for (int i = 0; i < 2; i++)
    for (int k = 0; k < ZD__EVENT_SLOTS; k++) {
      ev_bytes[i][k][0] = (uint8_t)(i + 1); /* all different */
      ev_bytes[i][k][1] = (uint8_t)k;
      ev_handles[i][k] = (ProtobufCBinaryData){64, ev_bytes[i][k]};
    }
  cb->n_grads_ready = cb->n_params_ready = ZD__EVENT_SLOTS;
  cb->grads_ready = ev_handles[0];
  cb->params_ready = ev_handles[1];
}

static void send_raw_register(int fd, uint64_t id, reg_t *r) {
  uint8_t *buf = malloc(zerod__v1__register_request__get_packed_size(&r->req));
  CHECK(buf);
  size_t len = zerod__v1__register_request__pack(&r->req, buf);
  zdt_raw_request(fd, ZD__MSG_REGISTER, id, buf, (uint32_t)len);
  free(buf);
}

static void send_bucket_request(int fd, uint16_t type, uint64_t id, int slot) {
  uint8_t buf[64];
  size_t len;
  if (type == ZD__MSG_STEP) {
    Zerod__V1__StepRequest req = ZEROD__V1__STEP_REQUEST__INIT;
    req.has_event_slot = slot >= 0;
    req.event_slot = slot >= 0 ? (uint32_t)slot : 0;
    len = zerod__v1__step_request__pack(&req, buf);
  } else if (type == ZD__MSG_SCATTER) {
    Zerod__V1__ScatterRequest req = ZEROD__V1__SCATTER_REQUEST__INIT;
    req.has_event_slot = slot >= 0;
    req.event_slot = slot >= 0 ? (uint32_t)slot : 0;
    len = zerod__v1__scatter_request__pack(&req, buf);
  } else {
    Zerod__V1__GatherRequest req = ZEROD__V1__GATHER_REQUEST__INIT;
    req.has_event_slot = slot >= 0;
    req.event_slot = slot >= 0 ? (uint32_t)slot : 0;
    len = zerod__v1__gather_request__pack(&req, buf);
  }
  zdt_raw_request(fd, type, id, buf, (uint32_t)len);
}

static void expect_reply(int fd, uint16_t type, uint64_t id) {
  zd__frame_header_t h;
  uint8_t *body;
  CHECK_MSG(zdt_raw_recv(fd, &h, &body, 5000) == 0, "no reply to %s %llu", zd__msg_name(type),
            (unsigned long long)id);
  CHECK_MSG(h.type == (type | ZD__FRAME_REPLY), "%s %llu answered by %s (0x%x)", zd__msg_name(type),
            (unsigned long long)id, zd__msg_name(h.type), h.type);
  CHECK_U64_EQ(h.request_id, id);
  if (type == ZD__MSG_BYE) {
    Zerod__V1__ByeReply *rep = zerod__v1__bye_reply__unpack(NULL, h.length, body);
    CHECK(rep);
    CHECK_MSG(rep->has_cuda_mappings_kept && !rep->cuda_mappings_kept,
              "bye of a host client: cuda_mappings_kept has %d value %d; expected false",
              rep->has_cuda_mappings_kept, rep->cuda_mappings_kept);
    zerod__v1__bye_reply__free_unpacked(rep, NULL);
  }
  if (type == ZD__MSG_STEP) {
    /* A small model's kernel runs on one thread: every other CPU is idle (libzerod then looks
     * for the next step's reply without sleeping). */
    Zerod__V1__StepReply *rep = zerod__v1__step_reply__unpack(NULL, h.length, body);
    CHECK(rep);
    cpu_set_t set; /* the CPUs zerod may run on: it inherits this process's affinity */
    CHECK(sched_getaffinity(0, sizeof set, &set) == 0);
    long cpus = CPU_COUNT(&set);
    CHECK_MSG(rep->has_idle_cpus && rep->idle_cpus == (uint32_t)(cpus - 1),
              "step of a small model: idle_cpus has %d value %u; expected %ld", rep->has_idle_cpus,
              rep->idle_cpus, cpus - 1);
    zerod__v1__step_reply__free_unpacked(rep, NULL);
  }
  free(body);
}

static void test_event_slots(void) {
  reg_t r;
  reg_init(&r, 1);
  r.req.has_event_slot = 1;
  r.req.event_slot = 3;
  size_t bytes = r.total_elems * 4;
  int fd = send_register(&r, bytes, bytes, 1);
  printf("  host register with an event slot -> %s\n",
         zdt_expect_error_kept(fd, 7, -EINVAL,
                               "register carries event_slot 3, but this client's buffers are host "
                               "memory: event slots are for CUDA buffers",
                               0));
  close(fd);
  /* CUDA registers of the wrong form, to a CPU zerod: the form is checked first */
  Zerod__V1__CudaBuffers cb;
  fd = connect_hello();
  reg_init(&r, 1);
  cuda_buffers(&cb);
  cb.n_grads_ready = 63;
  r.req.cuda = &cb;
  r.req.has_event_slot = 1;
  r.req.event_slot = 0;
  send_raw_register(fd, 8, &r);
  printf("  63 grads_ready handles -> %s\n",
         zdt_expect_error_kept(fd, 8, ZD_EBUFFER,
                               "cuda.grads_ready carries 63 event handles; expected 64", 0));
  cuda_buffers(&cb);
  cb.grads_ready[40].len = 63;
  send_raw_register(fd, 9, &r);
  printf(
      "  a short event handle -> %s\n",
      zdt_expect_error_kept(fd, 9, ZD_EBUFFER, "cuda.grads_ready[40] is 63 bytes; expected 64", 0));
  cuda_buffers(&cb);
  r.req.event_slot = 64;
  send_raw_register(fd, 10, &r);
  printf("  event_slot 64 -> %s\n",
         zdt_expect_error_kept(fd, 10, -EINVAL, "register: event_slot is 64; expected 0..63", 0));
  r.req.event_slot = 63;
  send_raw_register(fd, 11, &r);
  printf("  well-formed CUDA register -> %s\n",
         zdt_expect_error_kept(fd, 11, ZD_EBACKEND, "this zerod runs the CPU backend", 0));
  uint8_t *big = calloc(1, 100); /* not a register: no cuda_mappings_kept */
  zdt_raw_request(fd, ZD__MSG_GATHER, 12, big, 100);
  zdt_expect_error_kept(fd, 12, ZD_ETOOBIG, "gather body is 100 bytes", -1);
  free(big);
  close(fd);
  bystander_step("event slots of registers");

  /* A registered client with host buffers, on a zerod of its own (the bystander holds rank 0
   * here): its scatter, step and gather name no event slot. */
  zdt_daemon_t d;
  zdt_start(&d, NULL);
  fd = zdt_raw_connect(d.socket);
  CHECK(fd >= 0);
  zdt_raw_hello(fd, 1);
  reg_init(&r, 1);
  uint8_t *buf = malloc(zerod__v1__register_request__get_packed_size(&r.req));
  size_t len = zerod__v1__register_request__pack(&r.req, buf);
  int fds[2] = {make_memfd(bytes, 1), make_memfd(bytes, 1)};
  zd__frame_header_t h = {.magic = ZD__FRAME_MAGIC,
                          .version = ZD_PROTOCOL_VERSION,
                          .type = ZD__MSG_REGISTER,
                          .length = (uint32_t)len,
                          .request_id = 2};
  zdt_raw_send(fd, &h, buf, fds, 2);
  close(fds[0]);
  close(fds[1]);
  free(buf);
  expect_reply(fd, ZD__MSG_REGISTER, 2);
  send_bucket_request(fd, ZD__MSG_SCATTER, 3, 5);
  printf("  host client's scatter with an event slot -> %s\n",
         zdt_expect_error_kept(fd, 3, -EINVAL,
                               "scatter carries event_slot 5, but this client's buffers are host "
                               "memory",
                               -1));
  send_bucket_request(fd, ZD__MSG_STEP, 4, 0);
  zdt_expect_error_kept(fd, 4, -EINVAL, "step carries event_slot 0, but", -1);
  send_bucket_request(fd, ZD__MSG_GATHER, 5, 63);
  zdt_expect_error_kept(fd, 5, -EINVAL, "gather carries event_slot 63, but", -1);
  send_bucket_request(fd, ZD__MSG_SCATTER, 6, -1);
  expect_reply(fd, ZD__MSG_SCATTER, 6);
  send_bucket_request(fd, ZD__MSG_STEP, 7, -1);
  expect_reply(fd, ZD__MSG_STEP, 7);
  zdt_raw_request(fd, ZD__MSG_BYE, 8, NULL, 0);
  expect_reply(fd, ZD__MSG_BYE, 8); /* cuda_mappings_kept: false */
  close(fd);
  printf("  then scatter and step without one, and bye says no mappings kept\n");
  zdt_stop(&d, SIGTERM, 0);
}

static long rss_kb(pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  long kb = -1;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %ld kB", &kb) == 1) break;
  if (f) fclose(f);
  return kb;
}

/* A client that sends requests and never reads the replies: zerod stops reading it once its
 * unsent replies pass max_frame_bytes, so its memory stays bounded, and the client gets every
 * reply, in order, once it reads. */
static void test_unread_replies(void) {
  int fd = connect_hello();
  long before = rss_kb(daemon_.pid);
  CHECK(fcntl(fd, F_SETFL, O_NONBLOCK) == 0);
  uint8_t frame[ZD__FRAME_HEADER_SIZE];
  uint64_t sent = 0;
  for (int i = 0; i < 200000; i++) {
    zd__frame_header_t h = {
        .magic = ZD__FRAME_MAGIC, .version = 1, .type = ZD__MSG_STATUS, .request_id = 1000 + sent};
    zd__frame_encode(&h, frame);
    ssize_t n = send(fd, frame, sizeof frame, MSG_NOSIGNAL);
    if (n < 0) { /* the socket is full: give zerod time to read, unless it stopped reading */
      struct pollfd p = {.fd = fd, .events = POLLOUT};
      if (poll(&p, 1, 200) <= 0) break;
      i--;
      continue;
    }
    CHECK_INT_EQ(n, (long long)sizeof frame);
    sent++;
  }
  nanosleep(&(struct timespec){.tv_nsec = 300000000}, NULL);
  long after = rss_kb(daemon_.pid);
  CHECK_MSG(sent < 200000, "zerod kept reading %llu requests whose replies nobody read",
            (unsigned long long)sent);
  CHECK_MSG(after - before < 8192, "zerod grew by %ld kB for a client that reads nothing",
            after - before);
  bystander_step("a client not reading its replies");
  CHECK(fcntl(fd, F_SETFL, 0) == 0);
  for (uint64_t i = 0; i < sent; i++) {
    zd__frame_header_t h;
    uint8_t *body;
    CHECK_MSG(zdt_raw_recv(fd, &h, &body, 5000) == 0, "reply %llu of %llu missing",
              (unsigned long long)i, (unsigned long long)sent);
    CHECK_U64_EQ(h.request_id, 1000 + i);
    free(body);
  }
  printf("  %llu requests sent without reading: zerod grew by %ld kB, then answered all in order\n",
         (unsigned long long)sent, after - before);
  close(fd);
}

static void test_denied(void) {
  zdt_daemon_t d;
  const char *args[] = {"--allowed_uids", "4242", "--allowed_gids", "4243", NULL};
  zdt_start(&d, args);
  zd_client_t *c;
  int rc = zd_connect(d.socket, ZD_ANY_RANK, 5000, &c);
  CHECK_INT_EQ(rc, ZD_EDENIED);
  char want[128];
  snprintf(want, sizeof want, "uid %d gid %d", (int)geteuid(), (int)getegid());
  CHECK_CONTAINS(zd_last_error(), want);
  CHECK_CONTAINS(zd_last_error(),
                 "is not allowed to use zerod; allowed uids: 4242; allowed gids: "
                 "4243");
  printf("  uid not allowed -> %s: %s\n", zd_err_name(rc), zd_last_error());
  CHECK(zdt_log_contains(&d, "is not allowed to use zerod"));

  /* A supplementary group in allowed_gids is enough (the user was added to the group). Setting
   * the groups needs root; as another user this part cannot run. */
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    gid_t extra = 4243;
    if (setgroups(1, &extra) != 0) _exit(77);
    zd_client_t *member;
    int crc = zd_connect(d.socket, ZD_ANY_RANK, 5000, &member);
    if (crc != ZD_OK) fprintf(stderr, "member of group 4243 refused: %s\n", zd_last_error());
    _exit(crc == ZD_OK ? 0 : 1);
  }
  int cst;
  waitpid(pid, &cst, 0);
  CHECK_MSG(WIFEXITED(cst) && (WEXITSTATUS(cst) == 0 || WEXITSTATUS(cst) == 77),
            "a member of an allowed supplementary group was refused (status 0x%x)", cst);
  printf("  supplementary group allowed: %s\n",
         WEXITSTATUS(cst) == 0 ? "yes" : "not checked (setgroups needs root)");
  zdt_stop(&d, SIGTERM, 0);
}

int main(void) {
  const char *args[] = {"--max_frame_bytes", "65536", "--frame_timeout_ms", "500", NULL};
  zdt_start(&daemon_, args);
  int rc = zd_connect(daemon_.socket, ZD_ANY_RANK, 0, &bystander);
  CHECK_MSG(rc == ZD_OK, "connect: %s", zd_last_error());
  zd_group_t groups[2];
  zd_group_init(groups, 2, sizeof groups[0]);
  zd_model_desc_t desc = zdt_mlp_desc(groups, 2);
  CHECK_INT_EQ(zd_layout(bystander, &desc), ZD_OK);
  CHECK_INT_EQ(zd_register(bystander), ZD_OK);

  test_version();
  test_truncated();
  test_oversized();
  test_garbage();
  test_unknown_type();
  test_order();
  test_buffers();
  test_register_fields();
  test_step_fields();
  test_event_slots();
  test_unread_replies();
  test_denied();

  zd_close(bystander);
  zdt_stop(&daemon_, SIGTERM, 0);
  printf("test_bad_input: ok\n");
  return 0;
}
