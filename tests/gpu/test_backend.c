/* Backend selection and the validation of device buffers, through a real CUDA-built zerod, with
 * or without a GPU. It never exits 77: each machine checks its own story.
 *
 * Without a usable GPU (the CI machine: CUDA compiled in, no driver):
 *   - backend auto starts, logs one line saying why CUDA is not used, and serves the CPU backend
 *     (hello, status, a register and a step with host buffers);
 *   - backend cuda exits with status 1 and the same reason;
 *   - device buffers are refused with ZD_EBACKEND: by libzerod (zd_layout with ZD_MEMORY_CUDA,
 *     zd_cuda_device) and by the daemon (a register frame carrying forged CUDA IPC handles);
 *   - a CUDA register of the wrong form is refused with its own error before the backend is
 *     looked at: event handles other than one per event slot or of the wrong size, an
 *     event_slot out of range or missing (so these checks of the real daemon run without a GPU).
 * With a usable GPU:
 *   - backend auto picks CUDA: hello and status say cuda, the device and its UUID;
 *   - host buffers are refused with ZD_EBACKEND (libzerod, and a raw register with memfds);
 *   - the same form checks; forged device buffers are refused with ZD_EBUFFER naming the
 *     problem: another GPU's UUID, handles of the wrong size, handles CUDA cannot open, real
 *     memory with forged events; the rank then still takes a real registration and steps;
 *   - backend cuda with more local ranks than GPUs exits with status 1 naming the missing GPU.
 * Either way, libzerod's own CUDA side against a fake zerod (a thread of this test) that says it
 * runs the CUDA backend:
 *   - without a GPU: zd_cuda_device and zd_layout(ZD_MEMORY_CUDA) fail with ZD_EBACKEND and the
 *     reason (no driver), host buffers are refused, and nothing crashes at close;
 *   - with one: a GPU this process does not see is -ENODEV / ZD_EBUFFER; the register carries
 *     one event handle per slot and an event_slot; pipelined requests each name a slot that no
 *     other outstanding request holds, a 65th outstanding request is refused (-EBUSY), and a slot
 *     is reused only after zd_wait() gave it back; zd_close frees device buffers only when zerod
 *     said it holds none of their handles (Error.cuda_mappings_kept of a refused register,
 *     ByeReply.cuda_mappings_kept), and leaves them allocated when it said it keeps some, said
 *     nothing, or never answered.
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "adam_cuda.h"
#include "check.h"
#include "harness.h"
#include "layout.h"
#include "mlp.h"
#include "zerod.pb-c.h"
#include "zerod/zerod.h"

#define BUCKET_ELEMS 256

/* The daemon of the current case: its log is printed if a check fails. */
static zdt_daemon_t d;
static int passed;

static void on_exit_dump(void) {
  if (passed || d.pid <= 0) return;
  zdt_dump_log(&d);
  kill(d.pid, SIGKILL);
}

/* Runs zerod with args until it exits (at most 20 s); returns its wait status; its output goes to
 * log. */
static int run_zerod(const char *log, const char *const *args) {
  const char *bin = getenv("ZEROD_BIN");
  CHECK_MSG(bin && bin[0], "ZEROD_BIN is not set (run the tests with meson test)");
  char dir[] = "/tmp/zerod-backend-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  char sock[128], ctl[160];
  snprintf(sock, sizeof sock, "%s/zerod.sock", dir);
  snprintf(ctl, sizeof ctl, "unix:%s/control.sock", dir);
  const char *argv[32] = {bin, "--socket", sock, "--control_address", ctl};
  int n = 5;
  for (int i = 0; args[i] && n < 31; i++) argv[n++] = args[i];
  argv[n] = NULL;
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execv(bin, (char *const *)argv);
    _exit(127);
  }
  int status = -1;
  for (int i = 0; i < 2000; i++) {
    if (waitpid(pid, &status, WNOHANG) == pid) break;
    if (i == 1999) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      CHECK_MSG(0, "zerod %s did not exit within 20 s", args[0]);
    }
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  unlink(sock);
  rmdir(dir);
  return status;
}

static char *slurp(const char *path) {
  FILE *f = fopen(path, "r");
  CHECK_MSG(f, "cannot open %s", path);
  static char buf[1 << 16];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = 0;
  fclose(f);
  return buf;
}

/* A raw register of the example MLP: f32 params and grads, two groups, bucket size BUCKET_ELEMS,
 * world size 1; with cuda set, the given CUDA buffers (and no descriptors), else fds; event_slot
 * when slot >= 0. */
static void send_register(int fd, uint64_t id, Zerod__V1__CudaBuffers *cuda, int slot,
                          const int *fds, int nfds) {
  zd__layout_t *l = NULL;
  zd__err_t err = {0};
  CHECK_MSG(zd__layout_build(mlp_params, MLP_NPARAMS, 2, 1, BUCKET_ELEMS, &l, &err) == ZD_OK, "%s",
            err.msg);
  Zerod__V1__Param params[MLP_NPARAMS], *pp[MLP_NPARAMS];
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zerod__v1__param__init(&params[i]);
    params[i].name = (char *)mlp_params[i].name;
    params[i].n_shape = mlp_params[i].ndim;
    params[i].shape = (uint64_t *)mlp_params[i].shape;
    params[i].group = mlp_params[i].group;
    pp[i] = &params[i];
  }
  Zerod__V1__Group g = ZEROD__V1__GROUP__INIT, *gp[2] = {&g, &g};
  g.lr = 1e-3;
  g.beta1 = 0.9;
  g.beta2 = 0.999;
  g.eps = 1e-8;
  g.weight_decay = 0;
  Zerod__V1__RegisterRequest req = ZEROD__V1__REGISTER_REQUEST__INIT;
  req.n_params = MLP_NPARAMS;
  req.params = pp;
  req.n_groups = 2;
  req.groups = gp;
  req.param_dtype = ZEROD__V1__DTYPE__F32;
  req.grad_dtype = ZEROD__V1__DTYPE__F32;
  req.layout_hash = l->hash;
  req.cuda = cuda;
  req.has_event_slot = slot >= 0;
  req.event_slot = slot >= 0 ? (uint32_t)slot : 0;
  uint8_t *buf = malloc(zerod__v1__register_request__get_packed_size(&req));
  CHECK(buf);
  size_t len = zerod__v1__register_request__pack(&req, buf);
  zd__frame_header_t h = {.magic = ZD__FRAME_MAGIC,
                          .version = ZD_PROTOCOL_VERSION,
                          .type = ZD__MSG_REGISTER,
                          .length = (uint32_t)len,
                          .request_id = id};
  zdt_raw_send(fd, &h, buf, fds, nfds);
  free(buf);
  zd__layout_free(l);
}

/* CUDA buffers with every field present: uuid 16 bytes, memory handles 64 bytes of zeros, and
 * one event handle per slot of each kind, 64 bytes each, all different (forged: byte 0 says the
 * kind, byte 1 the slot). */
static uint8_t zeros[64];
static uint8_t forged_events[2][ZD__EVENT_SLOTS][64];
static ProtobufCBinaryData forged_ev[2][ZD__EVENT_SLOTS];
static void forge(Zerod__V1__CudaBuffers *cb, const uint8_t uuid[16]) {
  zerod__v1__cuda_buffers__init(cb);
  cb->has_device = 1;
  cb->device = 0;
  cb->has_device_uuid = 1;
  cb->device_uuid = (ProtobufCBinaryData){16, (uint8_t *)uuid};
  ProtobufCBinaryData h = {64, zeros};
  cb->has_param_handle = cb->has_grad_handle = 1;
  cb->param_handle = cb->grad_handle = h;
  for (int i = 0; i < 2; i++)
    for (int k = 0; k < ZD__EVENT_SLOTS; k++) {
      memset(forged_events[i][k], 0, 64);
      forged_events[i][k][0] = (uint8_t)(i + 1);
      forged_events[i][k][1] = (uint8_t)k;
      forged_ev[i][k] = (ProtobufCBinaryData){64, forged_events[i][k]};
    }
  cb->n_grads_ready = cb->n_params_ready = ZD__EVENT_SLOTS;
  cb->grads_ready = forged_ev[0];
  cb->params_ready = forged_ev[1];
}

/* A CUDA register of the wrong form: refused for that, whatever the backend (zerod checks the
 * form first), on the session fd (hello done); request ids from id. */
static void form_checks(int fd, uint64_t id, const uint8_t uuid[16]) {
  Zerod__V1__CudaBuffers cb;
  forge(&cb, uuid);
  cb.n_grads_ready = 1;
  send_register(fd, id, &cb, 0, NULL, 0);
  printf("  one grads_ready handle: %s\n",
         zdt_expect_error_kept(fd, id, ZD_EBUFFER,
                               "cuda.grads_ready carries 1 event handles; expected 64 (one per "
                               "event slot 0..63)",
                               0));
  forge(&cb, uuid);
  cb.n_params_ready = 0;
  send_register(fd, id + 1, &cb, 0, NULL, 0);
  printf("  no params_ready handles: %s\n",
         zdt_expect_error_kept(fd, id + 1, ZD_EBUFFER, "cuda.params_ready carries 0 event handles",
                               0));
  forge(&cb, uuid);
  forged_ev[1][5].len = 12;
  send_register(fd, id + 2, &cb, 0, NULL, 0);
  printf("  a short event handle: %s\n",
         zdt_expect_error_kept(fd, id + 2, ZD_EBUFFER,
                               "cuda.params_ready[5] is 12 bytes; expected 64", 0));
  forge(&cb, uuid);
  cb.n_grads_ready = 1;
  send_register(fd, id + 3, &cb, 0, NULL, 0);
  printf("  one grads_ready handle: %s\n",
         zdt_expect_error_kept(fd, id + 3, ZD_EBUFFER,
                               "cuda.grads_ready carries 1 event handles; expected 64", 0));
  forge(&cb, uuid);
  send_register(fd, id + 4, &cb, ZD__EVENT_SLOTS, NULL, 0);
  printf(
      "  event_slot 64: %s\n",
      zdt_expect_error_kept(fd, id + 4, -EINVAL, "register: event_slot is 64; expected 0..63", 0));
  send_register(fd, id + 5, &cb, -1, NULL, 0);
  printf("  no event_slot: %s\n",
         zdt_expect_error_kept(fd, id + 5, -EINVAL,
                               "register carries no event_slot; a client with CUDA buffers "
                               "names one in 0..63",
                               0));
}

static int memfd(size_t bytes) {
  int fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  CHECK(fd >= 0);
  CHECK(ftruncate(fd, (off_t)bytes) == 0);
  CHECK(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
  return fd;
}

/* g: two groups (weights, biases). */
static zd_model_desc_t mlp_desc(zd_group_t *g, zd_memory_t memory, int device) {
  zd_group_init(g, 2, sizeof g[0]);
  zd_model_desc_t desc = zdt_mlp_desc(g, 2);
  desc.grad_reduce = ZD_GRAD_MEAN;
  desc.memory = memory;
  desc.device = device;
  return desc;
}

/* ---- a fake zerod that says it runs the CUDA backend ----------------------------------------- */

typedef enum { FAKE_REFUSE, FAKE_DROP, FAKE_ACCEPT } fake_register_t;

#define FAKE_MAX_SEEN 256

typedef struct fake {
  int lfd;
  char dir[64], path[108];
  uint8_t uuid[16];    /* the rank's GPU, as hello says */
  fake_register_t reg; /* register: refused with an error, the connection dropped, or accepted */
  int refuse_kept;     /* a refused register's Error.cuda_mappings_kept: -1 absent, 0, 1 */
  int bye_kept;        /* ByeReply.cuda_mappings_kept: -1 absent, 0, 1 */
  pthread_t thread;
  /* What the client sent (read after fake_stop): the register's event handles, and the
   * event_slot of every register, scatter, step and gather in order (-1: none). */
  size_t n_grads_ready, n_params_ready;
  int nseen;
  int seen_slot[FAKE_MAX_SEEN];
  uint16_t seen_type[FAKE_MAX_SEEN];
} fake_t;

static void fake_reply(int fd, uint16_t type, uint64_t id, const ProtobufCMessage *msg) {
  uint8_t buf[1024];
  size_t len = protobuf_c_message_pack(msg, buf);
  zd__frame_header_t h = {.magic = ZD__FRAME_MAGIC,
                          .version = ZD_PROTOCOL_VERSION,
                          .type = type,
                          .length = (uint32_t)len,
                          .request_id = id};
  zdt_raw_send(fd, &h, buf, NULL, 0);
}

static void fake_seen(fake_t *f, uint16_t type, protobuf_c_boolean has, uint32_t slot) {
  if (f->nseen == FAKE_MAX_SEEN) return;
  f->seen_type[f->nseen] = type;
  f->seen_slot[f->nseen++] = has ? (int)slot : -1;
}

static void *fake_main(void *arg) {
  fake_t *f = arg;
  for (;;) {
    int fd = accept(f->lfd, NULL, NULL);
    if (fd < 0) return NULL; /* shut down */
    for (;;) {
      zd__frame_header_t h;
      uint8_t *body;
      if (zdt_raw_recv(fd, &h, &body, 10000) != 0) break;
      if (h.type == ZD__MSG_REGISTER) {
        Zerod__V1__RegisterRequest *r = zerod__v1__register_request__unpack(NULL, h.length, body);
        if (r) {
          f->n_grads_ready = r->cuda ? r->cuda->n_grads_ready : 0;
          f->n_params_ready = r->cuda ? r->cuda->n_params_ready : 0;
          fake_seen(f, h.type, r->has_event_slot, r->event_slot);
          zerod__v1__register_request__free_unpacked(r, NULL);
        }
      } else if (h.type == ZD__MSG_SCATTER) {
        Zerod__V1__ScatterRequest *r = zerod__v1__scatter_request__unpack(NULL, h.length, body);
        if (r) fake_seen(f, h.type, r->has_event_slot, r->event_slot);
        zerod__v1__scatter_request__free_unpacked(r, NULL);
      } else if (h.type == ZD__MSG_GATHER) {
        Zerod__V1__GatherRequest *r = zerod__v1__gather_request__unpack(NULL, h.length, body);
        if (r) fake_seen(f, h.type, r->has_event_slot, r->event_slot);
        zerod__v1__gather_request__free_unpacked(r, NULL);
      }
      free(body);
      if (h.type == ZD__MSG_HELLO) {
        Zerod__V1__HelloReply r = ZEROD__V1__HELLO_REPLY__INIT;
        r.version = ZD_PROTOCOL_VERSION;
        r.daemon_version = (char *)"fake";
        r.world_size = 1;
        r.bucket_elems = BUCKET_ELEMS;
        r.backend = (char *)"cuda";
        r.has_device = r.has_device_uuid = 1;
        r.device_uuid = (ProtobufCBinaryData){16, f->uuid};
        fake_reply(fd, ZD__MSG_HELLO | ZD__FRAME_REPLY, h.request_id, &r.base);
      } else if (h.type == ZD__MSG_BYE) {
        Zerod__V1__ByeReply r = ZEROD__V1__BYE_REPLY__INIT;
        r.has_cuda_mappings_kept = f->bye_kept >= 0;
        r.cuda_mappings_kept = f->bye_kept > 0;
        fake_reply(fd, ZD__MSG_BYE | ZD__FRAME_REPLY, h.request_id, &r.base);
        break;
      } else if (h.type == ZD__MSG_REGISTER && f->reg == FAKE_DROP) {
        break;
      } else if (h.type == ZD__MSG_REGISTER && f->reg == FAKE_ACCEPT) {
        Zerod__V1__RegisterReply r = ZEROD__V1__REGISTER_REPLY__INIT;
        r.nbuckets = 1;
        r.loss_scale = 1;
        fake_reply(fd, ZD__MSG_REGISTER | ZD__FRAME_REPLY, h.request_id, &r.base);
      } else if ((h.type == ZD__MSG_SCATTER || h.type == ZD__MSG_GATHER) && f->reg == FAKE_ACCEPT) {
        Zerod__V1__ScatterReply r = ZEROD__V1__SCATTER_REPLY__INIT; /* both are empty */
        fake_reply(fd, h.type | ZD__FRAME_REPLY, h.request_id, &r.base);
      } else {
        Zerod__V1__Error r = ZEROD__V1__ERROR__INIT;
        r.code = h.type == ZD__MSG_REGISTER ? ZD_EBUFFER : ZD_EINTERNAL;
        r.message = (char *)"fake zerod: refused";
        if (h.type == ZD__MSG_REGISTER && f->refuse_kept >= 0) {
          r.has_cuda_mappings_kept = 1;
          r.cuda_mappings_kept = f->refuse_kept > 0;
        }
        fake_reply(fd, ZD__MSG_ERROR, h.request_id, &r.base);
      }
    }
    close(fd);
  }
}

static void fake_start(fake_t *f, const uint8_t uuid[16], fake_register_t reg, int refuse_kept,
                       int bye_kept) {
  memset(f, 0, sizeof *f);
  snprintf(f->dir, sizeof f->dir, "/tmp/zerod-fake-XXXXXX");
  CHECK(mkdtemp(f->dir) != NULL);
  snprintf(f->path, sizeof f->path, "%s/zerod.sock", f->dir);
  memcpy(f->uuid, uuid, 16);
  f->reg = reg;
  f->refuse_kept = refuse_kept;
  f->bye_kept = bye_kept;
  f->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  CHECK(f->lfd >= 0);
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", f->path);
  CHECK(bind(f->lfd, (struct sockaddr *)&addr, sizeof addr) == 0);
  CHECK(listen(f->lfd, 4) == 0);
  CHECK(pthread_create(&f->thread, NULL, fake_main, f) == 0);
}

static void fake_stop(fake_t *f) {
  shutdown(f->lfd, SHUT_RDWR); /* wakes accept() */
  CHECK(pthread_join(f->thread, NULL) == 0);
  close(f->lfd);
  unlink(f->path);
  rmdir(f->dir);
}

/* Without a GPU: libzerod's CUDA side says why device buffers cannot be had. */
static void fake_without_gpu(const char *why) {
  printf("libzerod against a fake CUDA zerod, without a GPU\n");
  uint8_t uuid[16] = {0xde, 0xad};
  fake_t f;
  fake_start(&f, uuid, FAKE_REFUSE, 0, 0);
  zd_client_t *c;
  CHECK_MSG(zd_connect(f.path, ZD_ANY_RANK, 0, &c) == ZD_OK, "%s", zd_last_error());
  int dev = 7;
  CHECK_INT_EQ(zd_cuda_device(c, &dev), ZD_EBACKEND);
  CHECK_CONTAINS(zd_last_error(), "device buffers need CUDA");
  printf("  zd_cuda_device: %s\n", zd_last_error());
  CHECK_INT_EQ(zd_set_stream(c, NULL), ZD_EORDER);
  zd_group_t g[2];
  zd_model_desc_t desc = mlp_desc(g, ZD_MEMORY_CUDA, 0);
  CHECK_INT_EQ(zd_layout(c, &desc), ZD_EBACKEND);
  CHECK_CONTAINS(zd_last_error(), "device buffers need CUDA");
  printf("  zd_layout(ZD_MEMORY_CUDA): %s\n", zd_last_error());
  CHECK_INT_EQ(zd_param_buffer(c, NULL) == NULL, 1);
  desc = mlp_desc(g, ZD_MEMORY_HOST, 0);
  CHECK_INT_EQ(zd_layout(c, &desc), ZD_EBACKEND);
  CHECK_CONTAINS(zd_last_error(), "takes CUDA device buffers only");
  zd_close(c);
  fake_stop(&f);
  (void)why;
}

/* A device pointer still allocated (not freed by zd_close)? */
static int still_allocated(void *p) {
  struct cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  (void)cudaGetLastError();
  return e == cudaSuccess && a.type == cudaMemoryTypeDevice;
}

/* With a GPU: libzerod's checks of the GPU, and what zd_close frees. */
static void fake_with_gpu(const struct cudaDeviceProp *prop) {
  printf("libzerod against a fake CUDA zerod, with a GPU\n");
  uint8_t other[16];
  memcpy(other, prop->uuid.bytes, 16);
  other[15] ^= 0xff;
  fake_t f;
  fake_start(&f, other, FAKE_REFUSE, 0, 0);
  zd_client_t *c;
  CHECK_MSG(zd_connect(f.path, ZD_ANY_RANK, 0, &c) == ZD_OK, "%s", zd_last_error());
  int dev = 7;
  CHECK_INT_EQ(zd_cuda_device(c, &dev), -ENODEV);
  printf("  zd_cuda_device, a GPU this process does not see: %s\n", zd_last_error());
  zd_group_t g[2];
  zd_model_desc_t desc = mlp_desc(g, ZD_MEMORY_CUDA, 0);
  CHECK_INT_EQ(zd_layout(c, &desc), ZD_EBUFFER);
  printf("  zd_layout on device 0: %s\n", zd_last_error());
  zd_close(c);
  fake_stop(&f);

  /* The rank's GPU is device 0: the buffers are made; the register fails, or succeeds and the
   * bye answers, in several ways. zd_close frees the buffers only when zerod said it holds none
   * of their handles. */
  struct {
    fake_register_t reg;
    int refuse_kept, bye_kept;
    int pipeline; /* requests outstanding on every event slot */
    int kept;
    const char *what;
  } cases[] = {
      {FAKE_REFUSE, 0, -1, 0, 0, "register refused, zerod says it closed the handles: freed"},
      {FAKE_REFUSE, 1, 1, 0, 1, "register refused, zerod kept the handles: left allocated"},
      {FAKE_REFUSE, -1, -1, 0, 1,
       "register refused and bye answered without saying what zerod holds: left allocated"},
      {FAKE_REFUSE, -1, 0, 0, 0,
       "register refused without saying, then bye says nothing kept: freed"},
      {FAKE_DROP, 0, 0, 0, 1, "register never answered: left allocated"},
      {FAKE_ACCEPT, 0, 0, 1, 0, "registered, 66 requests, bye says nothing kept: freed"},
      {FAKE_ACCEPT, 0, 1, 0, 1, "registered, bye says mappings kept: left allocated"},
      {FAKE_ACCEPT, 0, -1, 0, 1, "registered, bye says nothing about mappings: left allocated"}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    fake_start(&f, (const uint8_t *)prop->uuid.bytes, cases[i].reg, cases[i].refuse_kept,
               cases[i].bye_kept);
    CHECK_MSG(zd_connect(f.path, ZD_ANY_RANK, 0, &c) == ZD_OK, "%s", zd_last_error());
    CHECK_MSG(zd_cuda_device(c, &dev) == ZD_OK, "%s", zd_last_error());
    CHECK_INT_EQ(dev, 0);
    desc = mlp_desc(g, ZD_MEMORY_CUDA, 0);
    CHECK_MSG(zd_layout(c, &desc) == ZD_OK, "%s", zd_last_error());
    void *p = zd_param_buffer(c, NULL), *q = zd_grad_buffer(c, NULL);
    CHECK(still_allocated(p) && still_allocated(q));
    int rc = zd_register(c);
    int want = cases[i].reg == FAKE_DROP     ? ZD_ECLOSED
               : cases[i].reg == FAKE_REFUSE ? ZD_EBUFFER
                                             : ZD_OK;
    CHECK_MSG(rc == want, "register returned %d (%s): %s", rc, zd_err_name(rc), zd_last_error());
    int nreq = 0, reused = -1;
    if (cases[i].pipeline) {
      /* As many requests outstanding as there are event slots, then one more (refused); a slot
       * freed by zd_wait is the one the next request takes. */
      zd_request_t req[ZD__EVENT_SLOTS], extra;
      for (int k = 0; k < ZD__EVENT_SLOTS; k++)
        CHECK_MSG(zd_scatter_start(c, k % 2 ? ZD_ALL_BUCKETS : 0, &req[k]) == ZD_OK,
                  "request %d: %s", k, zd_last_error());
      CHECK_INT_EQ(zd_gather_start(c, 0, &extra), -EBUSY);
      printf("  request %d outstanding: %s\n", ZD__EVENT_SLOTS + 1, zd_last_error());
      CHECK_MSG(zd_wait(c, req[10], NULL) == ZD_OK, "%s", zd_last_error());
      CHECK_MSG(zd_gather_start(c, 0, &extra) == ZD_OK, "%s", zd_last_error());
      reused = 10;
      for (int k = 0; k < ZD__EVENT_SLOTS; k++)
        if (k != 10) CHECK_MSG(zd_wait(c, req[k], NULL) == ZD_OK, "%s", zd_last_error());
      CHECK_MSG(zd_wait(c, extra, NULL) == ZD_OK, "%s", zd_last_error());
      CHECK_MSG(zd_gather(c, 0) == ZD_OK, "%s", zd_last_error());
      nreq = ZD__EVENT_SLOTS + 2;
    }
    zd_close(c);
    fake_stop(&f);
    CHECK_MSG(still_allocated(p) == cases[i].kept && still_allocated(q) == cases[i].kept,
              "%s: param buffer allocated %d, grad buffer %d", cases[i].what, still_allocated(p),
              still_allocated(q));
    printf("  %s\n", cases[i].what);
    /* What went over the wire: a ring of 64 event pairs, and a slot with every request. */
    CHECK_MSG(f.n_grads_ready == ZD__EVENT_SLOTS && f.n_params_ready == ZD__EVENT_SLOTS,
              "register carried %zu + %zu event handles; expected %d + %d", f.n_grads_ready,
              f.n_params_ready, ZD__EVENT_SLOTS, ZD__EVENT_SLOTS);
    CHECK_INT_EQ(f.nseen, 1 + nreq);
    for (int k = 0; k < f.nseen; k++)
      CHECK_MSG(f.seen_slot[k] >= 0 && f.seen_slot[k] < ZD__EVENT_SLOTS,
                "request %d (%s) carries event_slot %d; expected 0..%d", k,
                zd__msg_name(f.seen_type[k]), f.seen_slot[k], ZD__EVENT_SLOTS - 1);
    if (nreq) {
      /* seen: the register (its slot free again once answered), 64 scatters outstanding
       * together, the gather sent after req[10] was waited for, then one more gather */
      uint64_t used = 0;
      for (int k = 1; k <= ZD__EVENT_SLOTS; k++) {
        CHECK_MSG(!(used & (1ull << f.seen_slot[k])),
                  "outstanding requests share event slot %d (request %d)", f.seen_slot[k], k - 1);
        used |= 1ull << f.seen_slot[k];
      }
      CHECK_MSG(f.seen_slot[1 + ZD__EVENT_SLOTS] == f.seen_slot[1 + reused],
                "the request sent after zd_wait() freed slot %d took slot %d",
                f.seen_slot[1 + reused], f.seen_slot[1 + ZD__EVENT_SLOTS]);
      printf(
          "  %d requests outstanding held %d distinct event slots; a slot is reused only after "
          "zd_wait()\n",
          ZD__EVENT_SLOTS, ZD__EVENT_SLOTS);
    }
  }
}

static void without_gpu(const char *why) {
  printf("no usable GPU: %s\n", why);
  /* backend auto: the CPU backend, and one line saying why not CUDA */
  const char *args[] = {"--backend", "auto", "--bucket_elems", "256", NULL};
  zdt_start(&d, args);
  CHECK_MSG(zdt_log_contains(&d, "backend auto: CUDA not used: "), "no fallback line in the log");
  CHECK_MSG(zdt_log_contains(&d, why), "the log does not give the reason '%s'", why);
  CHECK(zdt_log_contains(&d, "running the CPU backend"));
  printf("  auto: falls back to the CPU backend and says why\n");

  zd_client_t *c;
  CHECK_MSG(zd_connect(d.socket, ZD_ANY_RANK, 0, &c) == ZD_OK, "%s", zd_last_error());
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(c, &info);
  CHECK_STR_EQ(info.backend, "cpu");
  char *status;
  CHECK_INT_EQ(zd_status(c, &status), ZD_OK);
  CHECK_CONTAINS(status, "backend:cpu\n");
  CHECK_CONTAINS(status, "backend_note:CUDA not used: ");
  free(status);
  int dev = 7;
  CHECK_INT_EQ(zd_cuda_device(c, &dev), ZD_EBACKEND);
  printf("  zd_cuda_device: %s\n", zd_last_error());
  zd_group_t g[2];
  zd_model_desc_t desc = mlp_desc(g, ZD_MEMORY_CUDA, 0);
  CHECK_INT_EQ(zd_layout(c, &desc), ZD_EBACKEND);
  CHECK_CONTAINS(zd_last_error(), "cpu backend");
  printf("  zd_layout(ZD_MEMORY_CUDA): %s\n", zd_last_error());
  desc = mlp_desc(g, ZD_MEMORY_HOST, 0);
  CHECK_MSG(zd_layout(c, &desc) == ZD_OK, "%s", zd_last_error());
  CHECK_MSG(zd_register(c) == ZD_OK, "%s", zd_last_error());
  zd_step_result_t res = ZD_STEP_RESULT_INIT;
  CHECK_MSG(zd_step(c, NULL, &res) == ZD_OK, "%s", zd_last_error());
  CHECK_U64_EQ(res.step, 1);
  zd_close(c);
  printf("  host buffers: register and step on the CPU backend\n");

  /* A register frame with forged CUDA handles: refused before CUDA is touched. */
  int fd = zdt_raw_connect(d.socket);
  CHECK(fd >= 0);
  zdt_raw_hello(fd, 1);
  Zerod__V1__CudaBuffers cb;
  uint8_t uuid[16] = {1, 2, 3};
  form_checks(fd, 10, uuid);
  forge(&cb, uuid);
  send_register(fd, 2, &cb, 0, NULL, 0);
  const char *msg = zdt_expect_error(fd, 2, ZD_EBACKEND, "this zerod runs the CPU backend");
  CHECK_CONTAINS(msg, why);
  printf("  forged CUDA register: %s\n", msg);
  send_register(fd, 3, &cb, 0, NULL, 0);
  printf("  ... and says it holds none of the register's handles: %s\n",
         zdt_expect_error_kept(fd, 3, ZD_EBACKEND, "this zerod runs the CPU backend", 0));
  close(fd);
  zdt_stop(&d, SIGTERM, 0);

  /* backend cuda: refused at start with the reason */
  const char *log = "/tmp/zerod-backend-cuda.log";
  const char *cuda_args[] = {"--backend", "cuda", NULL};
  int st = run_zerod(log, cuda_args);
  const char *text = slurp(log);
  CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 1, "zerod --backend cuda: status 0x%x; log:\n%s",
            st, text);
  CHECK_CONTAINS(text, "backend cuda requested, but ");
  CHECK_CONTAINS(text, why);
  printf("  --backend cuda: exit status 1, %s", strstr(text, "backend cuda requested"));
  unlink(log);
}

static void with_gpu(int ngpus) {
  printf("%d usable GPU(s)\n", ngpus);
  struct cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0) == cudaSuccess);
  const char *args[] = {"--backend", "auto", "--bucket_elems", "256", NULL};
  zdt_start(&d, args);
  CHECK_MSG(zdt_log_contains(&d, "local rank 0: GPU 0"), "no GPU line in the log");
  zd_client_t *c;
  CHECK_MSG(zd_connect(d.socket, ZD_ANY_RANK, 0, &c) == ZD_OK, "%s", zd_last_error());
  zd_info_t info = ZD_INFO_INIT;
  zd_get_info(c, &info);
  CHECK_STR_EQ(info.backend, "cuda");
  int dev = -1;
  CHECK_MSG(zd_cuda_device(c, &dev) == ZD_OK, "%s", zd_last_error());
  CHECK_INT_EQ(dev, 0); /* same CUDA_VISIBLE_DEVICES as zerod */
  char *status;
  CHECK_INT_EQ(zd_status(c, &status), ZD_OK);
  CHECK_CONTAINS(status, "backend:cuda\n");
  CHECK_CONTAINS(status, "device:0\n");
  CHECK_CONTAINS(status, "gpu_uuid:GPU-");
  free(status);
  zd_group_t g[2];
  zd_model_desc_t desc = mlp_desc(g, ZD_MEMORY_HOST, 0);
  CHECK_INT_EQ(zd_layout(c, &desc), ZD_EBACKEND);
  printf("  zd_layout(ZD_MEMORY_HOST): %s\n", zd_last_error());
  zd_close(c);

  int fd = zdt_raw_connect(d.socket);
  CHECK(fd >= 0);
  zdt_raw_hello(fd, 1);
  int fds[2] = {memfd(1 << 20), memfd(1 << 20)};
  send_register(fd, 2, NULL, -1, fds, 2);
  printf("  host register: %s\n",
         zdt_expect_error(fd, 2, ZD_EBACKEND, "this zerod runs the CUDA backend"));
  close(fds[0]);
  close(fds[1]);
  Zerod__V1__CudaBuffers cb;
  uint8_t other[16];
  memcpy(other, prop.uuid.bytes, 16);
  other[15] ^= 0xff;
  forge(&cb, other);
  send_register(fd, 3, &cb, 0, NULL, 0);
  printf("  another GPU: %s\n", zdt_expect_error(fd, 3, ZD_EBUFFER, "local rank 0 runs on GPU-"));
  forge(&cb, (const uint8_t *)prop.uuid.bytes);
  cb.param_handle.len = 12;
  send_register(fd, 4, &cb, 0, NULL, 0);
  printf("  short handle: %s\n",
         zdt_expect_error(fd, 4, ZD_EBUFFER, "cuda.param_handle is 12 bytes; expected 64"));
  form_checks(fd, 20, (const uint8_t *)prop.uuid.bytes);
  forge(&cb, (const uint8_t *)prop.uuid.bytes);
  send_register(fd, 6, &cb, 0, NULL, 0);
  printf("  zero handles: %s\n", zdt_expect_error(fd, 6, ZD_EBUFFER, "param buffer: "));
  /* Real memory of this GPU, forged events: refused after the memory was opened (zerod closes
   * it again before it answers, and says so, so the memory may be freed after the answer). */
  void *pm, *gm;
  CHECK(cudaSetDevice(0) == cudaSuccess);
  CHECK(cudaMalloc(&pm, 2u << 20) == cudaSuccess);
  CHECK(cudaMalloc(&gm, 2u << 20) == cudaSuccess);
  cudaIpcMemHandle_t ph, gh;
  CHECK(cudaIpcGetMemHandle(&ph, pm) == cudaSuccess);
  CHECK(cudaIpcGetMemHandle(&gh, gm) == cudaSuccess);
  forge(&cb, (const uint8_t *)prop.uuid.bytes);
  cb.param_handle = (ProtobufCBinaryData){sizeof ph, (uint8_t *)&ph};
  cb.grad_handle = (ProtobufCBinaryData){sizeof gh, (uint8_t *)&gh};
  send_register(fd, 7, &cb, 0, NULL, 0);
  printf("  forged events (zerod closed the memory it opened: cuda_mappings_kept false): %s\n",
         zdt_expect_error_kept(fd, 7, ZD_EBUFFER, "grads_ready[0] event: ", 0));
  close(fd);
  CHECK(cudaFree(pm) == cudaSuccess);
  CHECK(cudaFree(gm) == cudaSuccess);

  /* After all that, the rank is free and healthy: a real registration and a step. */
  CHECK_MSG(zd_connect(d.socket, ZD_ANY_RANK, 0, &c) == ZD_OK, "%s", zd_last_error());
  CHECK_MSG(zd_cuda_device(c, &dev) == ZD_OK, "%s", zd_last_error());
  desc = mlp_desc(g, ZD_MEMORY_CUDA, dev);
  CHECK_MSG(zd_layout(c, &desc) == ZD_OK, "%s", zd_last_error());
  CHECK_MSG(zd_register(c) == ZD_OK, "register after the refused ones: %s", zd_last_error());
  zd_step_result_t res = ZD_STEP_RESULT_INIT;
  CHECK_MSG(zd_step(c, NULL, &res) == ZD_OK, "%s", zd_last_error());
  CHECK_U64_EQ(res.step, 1);
  CHECK_INT_EQ(zd_status(c, &status), ZD_OK);
  CHECK_CONTAINS(status, "health:ok\n");
  free(status);
  zd_close(c);
  printf("  then a real registration and a step: ok\n");
  zdt_stop(&d, SIGTERM, 0);

  /* One GPU per local rank: one rank more than there are GPUs. */
  char ranks[16];
  snprintf(ranks, sizeof ranks, "%d", ngpus + 1);
  const char *log = "/tmp/zerod-backend-cuda.log";
  const char *cuda_args[] = {"--backend", "cuda", "--local_ranks", ranks, NULL};
  int st = run_zerod(log, cuda_args);
  const char *text = slurp(log);
  CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 1,
            "zerod --backend cuda --local_ranks %s: status "
            "0x%x; log:\n%s",
            ranks, st, text);
  char want[64];
  snprintf(want, sizeof want, "local rank %d needs GPU %d", ngpus, ngpus);
  CHECK_CONTAINS(text, want);
  printf("  --local_ranks %s: exit status 1, %s", ranks, strstr(text, "backend cuda requested"));
  unlink(log);
}

int main(void) {
  char why[1024];
  int n = zd__cuda_available(why, sizeof why);
  atexit(on_exit_dump);
  if (n == 0) {
    without_gpu(why);
    fake_without_gpu(why);
  } else {
    with_gpu(n);
    struct cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0) == cudaSuccess);
    fake_with_gpu(&prop);
  }
  passed = 1;
  printf("test_backend: ok\n");
  return 0;
}
