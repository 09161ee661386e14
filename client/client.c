/* libzerod (zerod/zerod.h): connection, shared buffers and requests of one client.
 *
 * The socket is blocking: a call writes its request frame and reads frames until its reply
 * arrives. Replies to other pipelined requests that arrive first are kept in a small table until
 * zd_wait() asks for them. Host buffers are sealed memfds (the daemon refuses buffers that could
 * shrink under it) passed with SCM_RIGHTS along the register frame. Device buffers (a CUDA build,
 * ZD_MEMORY_CUDA) are cudaMalloc'd on the rank's GPU and travel as CUDA IPC handles in the
 * register request, with a ring of ZD__EVENT_SLOTS pairs of IPC events that order the trainer's
 * stream and zerod's, one pair per outstanding request: a request takes a free slot k, records
 * "grads ready" k on the trainer's stream before it is sent, and once its reply is in the stream
 * waits on "params ready" k, which zerod recorded after the request's work; the slot is free again
 * after that. Each wait of either side thus covers exactly its own request.
 *
 * The CUDA runtime is linked statically (and its symbols kept private), so that a CUDA build of
 * libzerod loads on machines without a GPU or driver and serves host buffers there; it touches
 * CUDA only for device buffers.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#ifdef ZD_HAVE_CUDA
#include <cudaTypedefs.h> /* driver entry points' types (cuCtxGetCurrent): no libcuda link */
#include <cuda_runtime_api.h>
#include <pthread.h>
#endif

#include "dtype.h"
#include "endpoint.h"
#include "error.h"
#include "frame.h"
#include "layout.h"
#include "wire.h"
#include "zerod.pb-c.h"
#include "zerod/zerod.h"

/* One pair of events per outstanding request (proto/frame.h). */
#define MAX_OUTSTANDING  ZD__EVENT_SLOTS
#define HELLO_TIMEOUT_MS 30000

_Static_assert(ZD__EVENT_SLOTS <= 64, "event slots are bits of a uint64_t");

typedef struct pending {
  uint64_t id;
  uint16_t type;
  int slot; /* device buffers: the request's event slot, taken until it is forgotten; -1: none */
  int done;
  int code;
  int mappings_kept; /* an Error's cuda_mappings_kept: 0, 1, or -1 when absent */
  char msg[ZD__ERR_MSG_MAX];
  zd_step_result_t step;
} pending_t;

struct zd_client {
  int fd;
  uint64_t next_id;
  zd_info_t info;
  pending_t pending[MAX_OUTSTANDING];
  uint32_t npending;

  /* zd_layout() */
  zd__layout_t *layout;
  zd_group_t *groups;
  uint32_t ngroups;
  zd_dtype_t param_dtype, grad_dtype;
  double max_grad_norm;
  int grad_mean;
  zd_loss_scaler_t loss_scaler;
  unsigned flags;
  int param_fd, grad_fd;
  void *params, *grads;
  size_t param_bytes, grad_bytes;
  int registered;

  /* Device buffers (ZD_MEMORY_CUDA) */
  zd_memory_t memory;
  int device;          /* this process's ordinal of the buffers' GPU */
  void *stream;        /* zd_set_stream(): cudaStream_t; NULL: the legacy default stream */
  int exported;        /* the handles went to zerod, which may have them open: the buffers
                          and events must then outlive the process's use of them */
  int kept;            /* zerod said it keeps (or may keep) handles of these buffers open:
                          only a bye saying otherwise lets them be freed */
  uint64_t slots_busy; /* bit k: event slot k belongs to an outstanding request */
  uint32_t next_slot;  /* where the search for a free slot starts (round robin) */
  void *grads_ready[ZD__EVENT_SLOTS];  /* cudaEvent_t, recorded here, waited on by zerod */
  void *params_ready[ZD__EVENT_SLOTS]; /* cudaEvent_t, recorded by zerod, waited on here */
  uint8_t uuid[16];                    /* of the buffers' GPU */
  uint8_t param_handle[64], grad_handle[64];
  uint8_t grads_ready_handle[ZD__EVENT_SLOTS][64], params_ready_handle[ZD__EVENT_SLOTS][64];
  /* From hello, with zerod's CUDA backend: its ordinal and the UUID of the rank's GPU. */
  int has_rank_gpu;
  int rank_device;
  uint8_t rank_uuid[16];
};

static __thread char last_error[ZD__ERR_MSG_MAX];

const char *zd_last_error(void) {
  return last_error;
}

const char *zd_version(void) {
  return ZD_VERSION_STRING;
}

static int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return code;
}

/* ---- frames -------------------------------------------------------------------------------- */

static int send_all(zd_client_t *c, const uint8_t *buf, size_t len, const int *fds, int nfds) {
  size_t off = 0;
  while (off < len) {
    struct iovec iov = {.iov_base = (void *)(buf + off), .iov_len = len - off};
    union {
      char buf[CMSG_SPACE(2 * sizeof(int))];
      struct cmsghdr align;
    } ctrl;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds > 0 && off == 0) { /* descriptors ride along the first byte of the frame */
      msg.msg_control = ctrl.buf;
      msg.msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int));
      struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_RIGHTS;
      cm->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
      memcpy(CMSG_DATA(cm), fds, (size_t)nfds * sizeof(int));
    }
    ssize_t n = sendmsg(c->fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail(errno == EPIPE || errno == ECONNRESET ? ZD_ECLOSED : -errno,
                  "sending to zerod failed: %s", strerror(errno));
    }
    off += (size_t)n;
  }
  return ZD_OK;
}

static int send_request(zd_client_t *c, uint16_t type, const ProtobufCMessage *msg, const int *fds,
                        int nfds, uint64_t *id) {
  size_t len = protobuf_c_message_get_packed_size(msg);
  uint8_t *buf = malloc(ZD__FRAME_HEADER_SIZE + len);
  if (!buf) return fail(-ENOMEM, "out of memory for a %zu-byte request", len);
  zd__frame_header_t h = {.magic = ZD__FRAME_MAGIC,
                          .version = ZD_PROTOCOL_VERSION,
                          .type = type,
                          .length = (uint32_t)len,
                          .request_id = ++c->next_id};
  zd__frame_encode(&h, buf);
  protobuf_c_message_pack(msg, buf + ZD__FRAME_HEADER_SIZE);
  int rc = send_all(c, buf, ZD__FRAME_HEADER_SIZE + len, fds, nfds);
  free(buf);
  if (rc == ZD_OK) *id = h.request_id;
  return rc;
}

/* Reads exactly len bytes; timeout_ms < 0 waits for ever. */
/* Before sleeping on a reply, look for it for this long: a small step's reply comes back within
 * tens of microseconds, about what waking a sleeping thread costs on a virtual machine. */
#define REPLY_SPIN_NS 50000

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Reads what is there without blocking, for up to REPLY_SPIN_NS; returns bytes read, 0 if none
 * came, or -1 with errno (EOF reads as 0 bytes on the blocking path that follows). */
static ssize_t read_spinning(zd_client_t *c, uint8_t *buf, size_t len) {
  uint64_t deadline = now_ns() + REPLY_SPIN_NS;
  do {
    ssize_t n = recv(c->fd, buf, len, MSG_DONTWAIT);
    if (n > 0) return n;
    if (n == 0 || (errno != EAGAIN && errno != EINTR)) return 0; /* let the blocking read say */
  } while (now_ns() < deadline);
  return 0;
}

static int read_all(zd_client_t *c, uint8_t *buf, size_t len, int timeout_ms) {
  size_t off = (size_t)read_spinning(c, buf, len);
  while (off < len) {
    if (timeout_ms >= 0) {
      struct pollfd p = {.fd = c->fd, .events = POLLIN};
      int n = poll(&p, 1, timeout_ms);
      if (n == 0) return fail(-ETIMEDOUT, "no reply from zerod within %d ms", timeout_ms);
      if (n < 0) {
        if (errno == EINTR) continue;
        return fail(-errno, "poll: %s", strerror(errno));
      }
    }
    ssize_t n = recv(c->fd, buf + off, len - off, 0);
    if (n == 0) return fail(ZD_ECLOSED, "zerod closed the connection");
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail(errno == ECONNRESET ? ZD_ECLOSED : -errno, "reading from zerod failed: %s",
                  strerror(errno));
    }
    off += (size_t)n;
  }
  return ZD_OK;
}

/* Reads one frame; *body is allocated (free()). */
static int read_frame(zd_client_t *c, zd__frame_header_t *h, uint8_t **body, int timeout_ms) {
  uint8_t hdr[ZD__FRAME_HEADER_SIZE];
  int rc = read_all(c, hdr, sizeof hdr, timeout_ms);
  if (rc) return rc;
  if (zd__frame_decode(hdr, h) != ZD_OK)
    return fail(ZD_EPROTO, "reply from zerod has a bad magic number 0x%08x", h->magic);
  if (h->length > ZD__FRAME_MAX_BODY)
    return fail(ZD_EPROTO, "reply from zerod claims %u bytes; at most %u expected", h->length,
                ZD__FRAME_MAX_BODY);
  *body = malloc(h->length ? h->length : 1);
  if (!*body) return fail(-ENOMEM, "out of memory for a %u-byte reply", h->length);
  rc = read_all(c, *body, h->length, timeout_ms);
  if (rc) {
    free(*body);
    *body = NULL;
  }
  return rc;
}

static pending_t *find_pending(zd_client_t *c, uint64_t id) {
  for (uint32_t i = 0; i < c->npending; i++)
    if (c->pending[i].id == id) return &c->pending[i];
  return NULL;
}

/* An event slot is free again only here: after its request's reply was processed (and, for
 * zd_wait, the stream made to wait on its "params ready"), or when the request is given up. */
static void put_slot(zd_client_t *c, int slot) {
  if (slot >= 0) c->slots_busy &= ~(1ull << slot);
}

static void forget_pending(zd_client_t *c, pending_t *p) {
  put_slot(c, p->slot);
  *p = c->pending[--c->npending];
}

/* Records the outcome of a frame into its pending entry. Step replies are decoded here; other
 * reply bodies are handed back through *body_out when the caller waits for exactly that id. */
static int settle(zd_client_t *c, pending_t *p, const zd__frame_header_t *h, const uint8_t *body) {
  p->done = 1;
  if (h->type == ZD__MSG_ERROR) {
    Zerod__V1__Error *e = zerod__v1__error__unpack(NULL, h->length, body);
    if (!e) {
      p->code = ZD_EPROTO;
      snprintf(p->msg, sizeof p->msg, "malformed error reply from zerod");
      return ZD_OK;
    }
    p->code = e->code;
    p->mappings_kept = e->has_cuda_mappings_kept ? e->cuda_mappings_kept != 0 : -1;
    snprintf(p->msg, sizeof p->msg, "%s", e->message);
    zerod__v1__error__free_unpacked(e, NULL);
    return ZD_OK;
  }
  if (h->type != (p->type | ZD__FRAME_REPLY)) {
    p->code = ZD_EPROTO;
    snprintf(p->msg, sizeof p->msg, "zerod answered %s request %" PRIu64 " with a %s reply",
             zd__msg_name(p->type), p->id, zd__msg_name(h->type));
    return ZD_OK;
  }
  p->code = ZD_OK;
  if (p->type == ZD__MSG_STEP) {
    Zerod__V1__StepReply *r = zerod__v1__step_reply__unpack(NULL, h->length, body);
    if (!r) {
      p->code = ZD_EPROTO;
      snprintf(p->msg, sizeof p->msg, "malformed step reply from zerod");
      return ZD_OK;
    }
    p->step = (zd_step_result_t){.step = r->step,
                                 .applied = r->applied,
                                 .grad_norm = r->grad_norm,
                                 .loss_scale = r->loss_scale,
                                 .clip_coef = r->clip_coef,
                                 .duration_us = r->duration_us};
    c->info.step = r->step;
    c->info.loss_scale = r->loss_scale;
    zerod__v1__step_reply__free_unpacked(r, NULL);
  }
  return ZD_OK;
}

/* Reads frames until request id is answered. On success, *body receives the reply body when
 * body is not NULL (caller frees). */
static int await(zd_client_t *c, uint64_t id, uint8_t **body, uint32_t *body_len, int timeout_ms) {
  pending_t *p = find_pending(c, id);
  if (!p) return fail(-EINVAL, "request %" PRIu64 " is not outstanding", id);
  while (!p->done) {
    zd__frame_header_t h;
    uint8_t *b;
    int rc = read_frame(c, &h, &b, timeout_ms);
    if (rc) return rc;
    pending_t *q = find_pending(c, h.request_id);
    if (!q || q->done) {
      rc = fail(ZD_EPROTO, "zerod sent a reply to unknown request %" PRIu64, h.request_id);
      if (h.type == ZD__MSG_ERROR && h.request_id == 0) { /* about the connection itself */
        Zerod__V1__Error *e = zerod__v1__error__unpack(NULL, h.length, b);
        if (e) rc = fail(e->code, "%s", e->message);
        zerod__v1__error__free_unpacked(e, NULL);
      }
      free(b);
      return rc;
    }
    settle(c, q, &h, b);
    if (q == p && body && h.type != ZD__MSG_ERROR) {
      *body = b;
      *body_len = h.length;
    } else {
      free(b);
    }
  }
  int code = p->code;
  if (code) fail(code, "%s", p->msg);
  return code;
}

static int check_room(const zd_client_t *c) {
  if (c->npending == MAX_OUTSTANDING)
    return fail(-EBUSY, "%d requests are outstanding; zd_wait() for some first", MAX_OUTSTANDING);
  return ZD_OK;
}

/* Sends a request; slot (-1: none) is its event slot, taken by cuda_before_request() and
 * given back here if the request cannot be sent. */
static int start(zd_client_t *c, uint16_t type, const ProtobufCMessage *msg, const int *fds,
                 int nfds, int slot, uint64_t *id) {
  int rc = check_room(c);
  if (!rc) rc = send_request(c, type, msg, fds, nfds, id);
  if (rc) {
    put_slot(c, slot);
    return rc;
  }
  c->pending[c->npending++] =
      (pending_t){.id = *id, .type = type, .slot = slot, .mappings_kept = -1};
  return ZD_OK;
}

/* Sends a request and waits for its reply; *body as in await(). */
static int call(zd_client_t *c, uint16_t type, const ProtobufCMessage *msg, const int *fds,
                int nfds, uint8_t **body, uint32_t *body_len, int timeout_ms) {
  uint64_t id;
  int rc = start(c, type, msg, fds, nfds, -1, &id);
  if (rc) return rc;
  rc = await(c, id, body, body_len, timeout_ms);
  pending_t *p = find_pending(c, id);
  if (p && p->done) forget_pending(c, p);
  return rc;
}

/* ---- connection ---------------------------------------------------------------------------- */

static int resolve_path(const char *socket_path, char *buf, size_t len) {
  const char *env = getenv("ZEROD_SOCKET");
  if (socket_path && socket_path[0])
    snprintf(buf, len, "%s", socket_path);
  else if (env && env[0])
    snprintf(buf, len, "%s", env);
  else if (zd__socket_default_path(buf, len) != 0)
    return fail(-ENAMETOOLONG, "default socket path is too long");
  if (strlen(buf) >= sizeof(((struct sockaddr_un *)0)->sun_path))
    return fail(-ENAMETOOLONG, "socket path %s is longer than %zu bytes", buf,
                sizeof(((struct sockaddr_un *)0)->sun_path) - 1);
  return ZD_OK;
}

int zd_connect(const char *socket_path, int local_rank, int timeout_ms, zd_client_t **out) {
  char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
  *out = NULL;
  int rc = resolve_path(socket_path, path, sizeof path);
  if (rc) return rc;
  zd_client_t *c = calloc(1, sizeof *c);
  if (!c) return fail(-ENOMEM, "out of memory");
  c->param_fd = c->grad_fd = -1;
  c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c->fd < 0) {
    rc = fail(-errno, "socket: %s", strerror(errno));
    goto fail;
  }
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
  if (connect(c->fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
    rc = fail(-errno,
              "cannot connect to zerod at %s: %s (is zerod running, and is this the "
              "socket it listens on?)",
              path, strerror(errno));
    goto fail;
  }
  Zerod__V1__HelloRequest req = ZEROD__V1__HELLO_REQUEST__INIT;
  req.min_version = ZD_PROTOCOL_VERSION;
  req.max_version = ZD_PROTOCOL_VERSION;
  req.has_local_rank = 1;
  req.local_rank = local_rank < 0 ? -1 : local_rank;
  char name[64];
  snprintf(name, sizeof name, "%s[%d]", program_invocation_short_name, (int)getpid());
  req.client_name = name;
  uint8_t *body = NULL;
  uint32_t len = 0;
  rc = call(c, ZD__MSG_HELLO, &req.base, NULL, 0, &body, &len,
            timeout_ms > 0 ? timeout_ms : HELLO_TIMEOUT_MS);
  if (rc) goto fail;
  Zerod__V1__HelloReply *rep = zerod__v1__hello_reply__unpack(NULL, len, body);
  free(body);
  if (!rep) {
    rc = fail(ZD_EPROTO, "malformed hello reply from zerod");
    goto fail;
  }
  c->info.protocol_version = rep->version;
  c->info.world_size = rep->world_size;
  c->info.rank = rep->rank;
  c->info.local_rank = rep->local_rank;
  c->info.bucket_elems = rep->bucket_elems;
  snprintf(c->info.backend, sizeof c->info.backend, "%s", rep->backend);
  snprintf(c->info.daemon_version, sizeof c->info.daemon_version, "%s", rep->daemon_version);
  c->info.loss_scale = 1.0;
  if (rep->has_device_uuid && rep->device_uuid.len == sizeof c->rank_uuid) {
    c->has_rank_gpu = 1;
    c->rank_device = rep->has_device ? rep->device : -1;
    memcpy(c->rank_uuid, rep->device_uuid.data, sizeof c->rank_uuid);
  }
  zerod__v1__hello_reply__free_unpacked(rep, NULL);
  *out = c;
  return ZD_OK;

fail:
  if (c->fd >= 0) close(c->fd);
  free(c);
  return rc;
}

/* ---- buffers and layout -------------------------------------------------------------------- */

static int create_buffer(const char *name, size_t bytes, int *fd, void **addr) {
  *fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (*fd < 0) return fail(-errno, "memfd_create(%s): %s", name, strerror(errno));
  if (ftruncate(*fd, (off_t)bytes) != 0 ||
      fcntl(*fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    int e = errno;
    close(*fd);
    *fd = -1;
    return fail(-e, "cannot size %s to %zu bytes: %s", name, bytes, strerror(e));
  }
  *addr = mmap(NULL, bytes ? bytes : 1, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
  if (*addr == MAP_FAILED) {
    int e = errno;
    close(*fd);
    *fd = -1;
    *addr = NULL;
    return fail(-e, "cannot map %s (%zu bytes): %s", name, bytes, strerror(e));
  }
  return ZD_OK;
}

/* ---- CUDA device buffers ------------------------------------------------------------------- */

#ifdef ZD_HAVE_CUDA
static void uuid_str(const uint8_t u[16], char *buf, size_t len) {
  snprintf(buf, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
           u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
           u[14], u[15]);
}

/* A failed CUDA call: ZD_EBACKEND (-ENOMEM when out of device memory) with what and CUDA's word. */
static int cuda_fail(cudaError_t e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int cuda_fail(cudaError_t e, const char *fmt, ...) {
  char what[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  (void)cudaGetLastError();
  return fail(e == cudaErrorMemoryAllocation ? -ENOMEM : ZD_EBACKEND, "%s: %s (%s)", what,
              cudaGetErrorString(e), cudaGetErrorName(e));
}

/* Why CUDA cannot run in this process at all, or ZD_OK with the device count. */
static int cuda_devices(int *count) {
  *count = 0;
  cudaError_t e = cudaGetDeviceCount(count);
  if (e == cudaSuccess && *count > 0) return ZD_OK;
  int drv = 0;
  (void)cudaDriverGetVersion(&drv);
  (void)cudaGetLastError();
  if (e == cudaErrorInsufficientDriver && drv == 0)
    return fail(ZD_EBACKEND,
                "device buffers need CUDA, but no NVIDIA driver is loaded in this "
                "process's machine (cudaGetDeviceCount: %s)",
                cudaGetErrorString(e));
  if (e == cudaErrorInsufficientDriver)
    return fail(ZD_EBACKEND,
                "device buffers need CUDA, but the NVIDIA driver supports CUDA %d.%d "
                "and libzerod's CUDA runtime is %d.%d: it needs a driver of CUDA %d or newer "
                "(cudaGetDeviceCount: %s)",
                drv / 1000, drv % 1000 / 10, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10,
                CUDART_VERSION / 1000, cudaGetErrorString(e));
  if (e == cudaSuccess || e == cudaErrorNoDevice)
    return fail(ZD_EBACKEND, "device buffers need CUDA, but no CUDA device is visible");
  return cuda_fail(e, "device buffers need CUDA, which cannot start: cudaGetDeviceCount");
}

static int device_uuid(int device, uint8_t uuid[16]) {
  struct cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return cuda_fail(e, "cudaGetDeviceProperties(%d)", device);
  memcpy(uuid, prop.uuid.bytes, 16);
  return ZD_OK;
}

/* Every CUDA call of the library runs with the buffers' GPU current and gives the caller back the
 * context it had, through the driver (cuCtxGetCurrent/cuCtxSetCurrent, found at run time so that
 * libzerod never links libcuda). The runtime alone cannot do it: on a thread with no current
 * context cudaGetDevice answers 0, and "restoring" that with cudaSetDevice(0) would create a
 * context on GPU 0 (hundreds of MiB) in a trainer of another GPU, and leave it current on the
 * trainer's thread. The library's own objects live in the primary context of the buffers' GPU,
 * the one the runtimes of CUDA frameworks (PyTorch) use, whatever context the caller had. */
static pthread_once_t ctx_once = PTHREAD_ONCE_INIT;
static PFN_cuCtxGetCurrent_v4000 ctx_get;
static PFN_cuCtxSetCurrent_v4000 ctx_set;

static void find_ctx_fns(void) {
  void *get = NULL, *set = NULL;
  enum cudaDriverEntryPointQueryResult qg = cudaDriverEntryPointSymbolNotFound, qs = qg;
  if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get, 12000, cudaEnableDefault, &qg) ==
          cudaSuccess &&
      qg == cudaDriverEntryPointSuccess &&
      cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &set, 12000, cudaEnableDefault, &qs) ==
          cudaSuccess &&
      qs == cudaDriverEntryPointSuccess) {
    ctx_get = (PFN_cuCtxGetCurrent_v4000)get;
    ctx_set = (PFN_cuCtxSetCurrent_v4000)set;
  }
  (void)cudaGetLastError();
}

typedef struct device_scope {
  CUcontext prev; /* the caller's current context; NULL: none */
  int restore;
} device_scope_t;

static int enter_device(int device, device_scope_t *s) {
  s->prev = NULL;
  s->restore = 0;
  pthread_once(&ctx_once, find_ctx_fns);
  if (!ctx_get || !ctx_set)
    return fail(ZD_EBACKEND,
                "the CUDA driver does not provide cuCtxGetCurrent/cuCtxSetCurrent "
                "(cudaGetDriverEntryPointByVersion)");
  CUresult r = ctx_get(&s->prev);
  if (r != CUDA_SUCCESS) return fail(ZD_EBACKEND, "cuCtxGetCurrent: CUresult %d", (int)r);
  cudaError_t e = cudaSetDevice(device); /* its primary context, current on this thread */
  if (e != cudaSuccess) return cuda_fail(e, "cudaSetDevice(%d)", device);
  CUcontext now = NULL;
  s->restore = ctx_get(&now) != CUDA_SUCCESS || now != s->prev;
  return ZD_OK;
}

static void leave_device(const device_scope_t *s) {
  if (s->restore) (void)ctx_set(s->prev); /* NULL unbinds: the thread had no context */
}

/* Device memory and events zerod may still have open are never freed: CUDA leaves freeing an
 * exported allocation before every importer closed it undefined (cudaIpcOpenMemHandle), and
 * operations on an imported event after the exporter destroyed it (cudaIpcOpenEventHandle). They
 * are then left allocated until the process exits. Whether zerod has them open is what it said:
 * ByeReply.cuda_mappings_kept, or Error.cuda_mappings_kept for a register it refused; without an
 * answer it may. */
static void release_cuda(zd_client_t *c) {
  if (c->memory != ZD_MEMORY_CUDA) return;
  if (!c->exported) {
    device_scope_t ds;
    int entered = enter_device(c->device, &ds) == ZD_OK;
    if (entered) { /* cudaFree waits for the device's work, the trainer's on these buffers too */
      if (c->params) (void)cudaFree(c->params);
      if (c->grads) (void)cudaFree(c->grads);
      for (int k = 0; k < ZD__EVENT_SLOTS; k++) {
        if (c->grads_ready[k]) (void)cudaEventDestroy((cudaEvent_t)c->grads_ready[k]);
        if (c->params_ready[k]) (void)cudaEventDestroy((cudaEvent_t)c->params_ready[k]);
      }
      (void)cudaGetLastError();
      leave_device(&ds);
    }
  }
  c->params = c->grads = NULL;
  memset(c->grads_ready, 0, sizeof c->grads_ready);
  memset(c->params_ready, 0, sizeof c->params_ready);
  c->exported = 0;
  c->kept = 0;
}

/* Rounds an IPC-exported allocation up to 2 MiB: CUDA exports a whole underlying block, which a
 * smaller allocation may share with others of this process. */
static size_t ipc_size(size_t bytes) {
  size_t unit = (size_t)2 << 20;
  return bytes ? (bytes + unit - 1) / unit * unit : unit;
}

/* cudaMalloc, not cudaMallocAsync or a memory pool: cudaIpcGetMemHandle exports only cudaMalloc'd
 * memory, from the base of the allocation (which is 256-byte aligned: every parameter and every
 * shard, at multiples of 64 elements, is then aligned for the daemon's 16-byte vector loads). */
static int create_cuda_buffers(zd_client_t *c, int device) {
  int count, rc = cuda_devices(&count);
  if (rc) return rc;
  if (device < 0 || device >= count)
    return fail(-EINVAL, "zd_model_desc_t.device is %d; this process sees %d CUDA device%s", device,
                count, count == 1 ? "" : "s");
  uint8_t uuid[16];
  if ((rc = device_uuid(device, uuid))) return rc;
  if (c->has_rank_gpu && memcmp(uuid, c->rank_uuid, sizeof uuid) != 0) {
    char mine[48], theirs[48];
    uuid_str(uuid, mine, sizeof mine);
    uuid_str(c->rank_uuid, theirs, sizeof theirs);
    return fail(ZD_EBUFFER,
                "CUDA device %d (%s) is not the GPU of local rank %u, %s (zerod's "
                "device %d); put the buffers there (zd_cuda_device())",
                device, mine, c->info.local_rank, theirs, c->rank_device);
  }
  device_scope_t ds;
  if ((rc = enter_device(device, &ds))) return rc;
  c->memory = ZD_MEMORY_CUDA; /* from here release_cuda() undoes what was made */
  c->device = device;
  c->exported = 0;
  c->kept = 0;
  memcpy(c->uuid, uuid, sizeof uuid);
  cudaError_t e;
  cudaEvent_t ev;
  cudaIpcMemHandle_t mh;
  cudaIpcEventHandle_t eh;
  size_t pbytes = ipc_size(c->param_bytes), gbytes = ipc_size(c->grad_bytes);
  if ((e = cudaMalloc(&c->params, pbytes)) != cudaSuccess) {
    c->params = NULL;
    rc = cuda_fail(e, "cudaMalloc of the %zu-byte param buffer (%zu bytes rounded) on device %d",
                   c->param_bytes, pbytes, device);
    goto exit;
  }
  if ((e = cudaMalloc(&c->grads, gbytes)) != cudaSuccess) {
    c->grads = NULL;
    rc = cuda_fail(e, "cudaMalloc of the %zu-byte grad buffer (%zu bytes rounded) on device %d",
                   c->grad_bytes, gbytes, device);
    goto exit;
  }
  /* Zeroed on this thread's legacy default stream, and waited for: the trainer then writes its
   * initial values on any stream it likes (a non-blocking one is not ordered after the memset). */
  if ((e = cudaMemset(c->params, 0, pbytes)) != cudaSuccess) {
    rc = cuda_fail(e, "cudaMemset of the param buffer on device %d", device);
    goto exit;
  }
  if ((e = cudaMemset(c->grads, 0, gbytes)) != cudaSuccess) {
    rc = cuda_fail(e, "cudaMemset of the grad buffer on device %d", device);
    goto exit;
  }
  if ((e = cudaStreamSynchronize(cudaStreamLegacy)) != cudaSuccess) {
    rc = cuda_fail(e, "cudaStreamSynchronize after zeroing the buffers on device %d", device);
    goto exit;
  }
  if ((e = cudaIpcGetMemHandle(&mh, c->params)) != cudaSuccess) {
    rc = cuda_fail(e, "cudaIpcGetMemHandle of the param buffer");
    goto exit;
  }
  memcpy(c->param_handle, &mh, sizeof c->param_handle);
  if ((e = cudaIpcGetMemHandle(&mh, c->grads)) != cudaSuccess) {
    rc = cuda_fail(e, "cudaIpcGetMemHandle of the grad buffer");
    goto exit;
  }
  memcpy(c->grad_handle, &mh, sizeof c->grad_handle);
  for (int i = 0; i < 2 * ZD__EVENT_SLOTS; i++) {
    int k = i % ZD__EVENT_SLOTS, params = i >= ZD__EVENT_SLOTS;
    const char *name = params ? "params-ready" : "grads-ready";
    if ((e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess)) !=
        cudaSuccess) {
      rc = cuda_fail(e,
                     "cudaEventCreateWithFlags(cudaEventDisableTiming | "
                     "cudaEventInterprocess) of %s event %d",
                     name, k);
      goto exit;
    }
    (params ? c->params_ready : c->grads_ready)[k] = ev;
    if ((e = cudaIpcGetEventHandle(&eh, ev)) != cudaSuccess) {
      rc = cuda_fail(e, "cudaIpcGetEventHandle of %s event %d", name, k);
      goto exit;
    }
    memcpy(params ? c->params_ready_handle[k] : c->grads_ready_handle[k], &eh, sizeof eh);
  }
  rc = ZD_OK;
exit:
  leave_device(&ds);
  return rc;
}

/* Before a request that lets zerod touch the buffers: takes a free event slot (*slot) and
 * records its "grads ready" on the current stream, so that zerod's work for the request comes
 * after everything queued on that stream so far, and after nothing queued later: the slot is this
 * request's alone until its reply is processed, so zerod's wait on it covers exactly this record.
 * Nothing about earlier streams needs carrying over: zerod runs the client's requests in order on
 * one stream, after the records of the earlier requests' own slots. A stream being captured into
 * a CUDA graph is refused: the record would only be captured, not made, and zerod would wait on
 * the slot's previous record. Host buffers: *slot is -1 and nothing happens. On failure no slot
 * is taken. */
static int cuda_before_request(zd_client_t *c, int *slot) {
  *slot = -1;
  if (c->memory != ZD_MEMORY_CUDA) return ZD_OK;
  int rc = check_room(c); /* a request may be outstanding per slot: one is free below this */
  if (rc) return rc;
  int k = -1;
  for (uint32_t i = 0; i < ZD__EVENT_SLOTS && k < 0; i++) {
    uint32_t j = (c->next_slot + i) % ZD__EVENT_SLOTS;
    if (!(c->slots_busy & (1ull << j))) k = (int)j;
  }
  if (k < 0) /* more slots taken than requests outstanding: a bug of this file */
    return fail(ZD_EINTERNAL, "libzerod: no free event slot with %u of %d requests outstanding",
                c->npending, MAX_OUTSTANDING);
  device_scope_t ds;
  if ((rc = enter_device(c->device, &ds))) return rc;
  cudaStream_t s = (cudaStream_t)c->stream;
  enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(s, &capture);
  if (e != cudaSuccess) {
    rc = cuda_fail(e, "cudaStreamIsCapturing of the client's stream");
    goto exit;
  }
  if (capture != cudaStreamCaptureStatusNone) {
    rc = fail(-EINVAL,
              "the client's CUDA stream is being captured into a graph: zerod's "
              "requests cannot be captured (send them outside the capture)");
    goto exit;
  }
  if ((e = cudaEventRecord((cudaEvent_t)c->grads_ready[k], s)) != cudaSuccess) {
    rc = cuda_fail(e, "cudaEventRecord of grads-ready event %d on the client's stream", k);
    goto exit;
  }
  c->slots_busy |= 1ull << k;
  c->next_slot = (uint32_t)(k + 1) % ZD__EVENT_SLOTS;
  *slot = k;
exit:
  leave_device(&ds);
  return rc;
}

/* After the reply of the request of event slot `slot` (-1: none): what the current stream does
 * next comes after zerod's work for it, and, zerod's stream being in order, for every earlier
 * request. A request zerod refused before queueing any work has no record of its own: the wait is
 * then on the slot's previous record, a request already waited for, and changes nothing. */
static int cuda_after_reply(zd_client_t *c, int slot) {
  if (c->memory != ZD_MEMORY_CUDA || slot < 0) return ZD_OK;
  device_scope_t ds;
  int rc = enter_device(c->device, &ds);
  if (rc) return rc;
  cudaError_t e =
      cudaStreamWaitEvent((cudaStream_t)c->stream, (cudaEvent_t)c->params_ready[slot], 0);
  leave_device(&ds);
  return e == cudaSuccess ? ZD_OK
                          : cuda_fail(e,
                                      "cudaStreamWaitEvent of the client's stream on "
                                      "params-ready event %d",
                                      slot);
}

/* Whether the stream belongs to the buffers' GPU. */
static int check_stream(const zd_client_t *c, void *stream) {
  device_scope_t ds;
  int rc = enter_device(c->device, &ds);
  if (rc) return rc;
  int dev = -1;
  cudaError_t e = cudaStreamGetDevice((cudaStream_t)stream, &dev);
  leave_device(&ds);
  if (e != cudaSuccess) return cuda_fail(e, "zd_set_stream: cudaStreamGetDevice of the stream");
  if (dev != c->device)
    return fail(-EINVAL,
                "zd_set_stream: the stream is on CUDA device %d; the buffers are on "
                "device %d",
                dev, c->device);
  return ZD_OK;
}
#else
static void release_cuda(zd_client_t *c) {
  (void)c;
}
static int cuda_before_request(zd_client_t *c, int *slot) {
  (void)c;
  *slot = -1;
  return ZD_OK;
}
static int cuda_after_reply(zd_client_t *c, int slot) {
  (void)c, (void)slot;
  return ZD_OK;
}
static int check_stream(const zd_client_t *c, void *stream) {
  (void)c, (void)stream;
  return ZD_OK;
}
#endif

int zd_set_stream(zd_client_t *c, void *stream) {
  if (!c) return fail(-EINVAL, "zd_set_stream: client is NULL");
  if (c->memory != ZD_MEMORY_CUDA)
    return fail(ZD_EORDER,
                "zd_set_stream: the client has no device buffers (zd_layout with "
                "ZD_MEMORY_CUDA first)");
  if (stream == c->stream) return ZD_OK;
  int rc = stream ? check_stream(c, stream) : ZD_OK;
  if (rc) return rc;
  c->stream = stream;
  return ZD_OK;
}

int zd_cuda_device(const zd_client_t *c, int *device) {
  if (!c || !device) return fail(-EINVAL, "zd_cuda_device: client and device are required");
  if (!c->has_rank_gpu)
    return fail(ZD_EBACKEND, "zerod runs the %s backend: local rank %u has no GPU", c->info.backend,
                c->info.local_rank);
#ifdef ZD_HAVE_CUDA
  int count, rc = cuda_devices(&count);
  if (rc) return rc;
  for (int d = 0; d < count; d++) {
    uint8_t uuid[16];
    if ((rc = device_uuid(d, uuid))) return rc;
    if (memcmp(uuid, c->rank_uuid, sizeof uuid) == 0) {
      *device = d;
      return ZD_OK;
    }
  }
  char theirs[48];
  uuid_str(c->rank_uuid, theirs, sizeof theirs);
  return fail(-ENODEV,
              "local rank %u runs on %s (zerod's device %d), which this process does not "
              "see among its %d CUDA devices (CUDA_VISIBLE_DEVICES?)",
              c->info.local_rank, theirs, c->rank_device, count);
#else
  return fail(ZD_EBACKEND, "this libzerod was built without CUDA");
#endif
}

static void release_buffers(zd_client_t *c) {
  if (c->memory == ZD_MEMORY_CUDA) {
    release_cuda(c);
  } else {
    if (c->params) munmap(c->params, c->param_bytes ? c->param_bytes : 1);
    if (c->grads) munmap(c->grads, c->grad_bytes ? c->grad_bytes : 1);
  }
  c->memory = ZD_MEMORY_HOST;
  c->stream = NULL;
  if (c->param_fd >= 0) close(c->param_fd);
  if (c->grad_fd >= 0) close(c->grad_fd);
  c->params = c->grads = NULL;
  c->param_fd = c->grad_fd = -1;
  zd__layout_free(c->layout);
  c->layout = NULL;
  free(c->groups);
  c->groups = NULL;
}

int zd_layout(zd_client_t *c, const zd_model_desc_t *desc) {
  if (!c || !desc) return fail(-EINVAL, "zd_layout: client and desc are required");
  if (c->registered) return fail(ZD_EORDER, "zd_layout after zd_register: the model is fixed");
  zd__err_t err = {0};
  if (zd__dtype_check(desc->param_dtype, ZD__DTYPE_PARAM, &err) ||
      zd__dtype_check(desc->grad_dtype, ZD__DTYPE_GRAD, &err))
    return fail(err.code, "%s", err.msg);
  if (!desc->groups || desc->ngroups == 0)
    return fail(ZD_EGROUP, "model has no parameter groups; expected at least 1");
  if (desc->nparams > UINT32_MAX || desc->ngroups > UINT32_MAX)
    return fail(-EINVAL, "too many parameters or groups");
  if (desc->memory != ZD_MEMORY_HOST && desc->memory != ZD_MEMORY_CUDA)
    return fail(-EINVAL,
                "zd_model_desc_t.memory is %d; expected ZD_MEMORY_HOST (0) or "
                "ZD_MEMORY_CUDA (1)",
                (int)desc->memory);
  int cuda = desc->memory == ZD_MEMORY_CUDA;
  if (cuda != (strcmp(c->info.backend, "cuda") == 0))
    return fail(
        ZD_EBACKEND,
        cuda ? "zerod runs its %s backend, which takes host buffers only: "
               "device buffers (ZD_MEMORY_CUDA) need a zerod with backend cuda"
             : "zerod runs its %s backend, which takes CUDA device buffers "
               "only: set zd_model_desc_t.memory = ZD_MEMORY_CUDA (the device: zd_cuda_device())",
        c->info.backend);
#ifndef ZD_HAVE_CUDA
  if (cuda) return fail(ZD_EBACKEND, "this libzerod was built without CUDA: no device buffers");
#endif
  release_buffers(c);
  int rc = zd__layout_build(desc->params, (uint32_t)desc->nparams, (uint32_t)desc->ngroups,
                            c->info.world_size, c->info.bucket_elems, &c->layout, &err);
  if (rc) return fail(rc, "%s", err.msg);
  c->groups = malloc(desc->ngroups * sizeof *c->groups);
  if (!c->groups) {
    release_buffers(c);
    return fail(-ENOMEM, "out of memory");
  }
  memcpy(c->groups, desc->groups, desc->ngroups * sizeof *c->groups);
  c->ngroups = (uint32_t)desc->ngroups;
  c->param_dtype = desc->param_dtype;
  c->grad_dtype = desc->grad_dtype;
  c->max_grad_norm = desc->max_grad_norm;
  c->grad_mean = desc->grad_mean;
  c->loss_scaler = desc->loss_scaler;
  c->flags = desc->flags;
  c->param_bytes = c->layout->total_elems * zd_dtype_size(desc->param_dtype);
  c->grad_bytes = c->layout->total_elems * zd_dtype_size(desc->grad_dtype);
#ifdef ZD_HAVE_CUDA
  if (cuda) {
    if ((rc = create_cuda_buffers(c, desc->device))) {
      release_buffers(c);
      return rc;
    }
  } else
#endif
      if ((rc = create_buffer("zerod-params", c->param_bytes, &c->param_fd, &c->params)) ||
          (rc = create_buffer("zerod-grads", c->grad_bytes, &c->grad_fd, &c->grads))) {
    release_buffers(c);
    return rc;
  }
  c->info.layout_hash = c->layout->hash;
  c->info.total_elems = c->layout->total_elems;
  c->info.nbuckets = c->layout->nbuckets;
  return ZD_OK;
}

int zd_register(zd_client_t *c) {
  if (!c) return fail(-EINVAL, "zd_register: client is NULL");
  if (!c->layout) return fail(ZD_EORDER, "zd_register before zd_layout");
  if (c->registered) return fail(ZD_EORDER, "model already registered on this client");
  const zd__layout_t *l = c->layout;
  int rc = -ENOMEM;
  Zerod__V1__Param *params = calloc(l->nparams, sizeof *params);
  Zerod__V1__Param **pp = calloc(l->nparams, sizeof *pp);
  Zerod__V1__Group *groups = calloc(c->ngroups, sizeof *groups);
  Zerod__V1__Group **gp = calloc(c->ngroups, sizeof *gp);
  if (!params || !pp || !groups || !gp) {
    fail(rc, "out of memory");
    goto exit;
  }
  for (uint32_t i = 0; i < l->nparams; i++) {
    zerod__v1__param__init(&params[i]);
    params[i].name = l->params[i].name;
    params[i].n_shape = l->params[i].ndim;
    params[i].shape = (uint64_t *)l->params[i].shape;
    params[i].group = l->params[i].group;
    pp[i] = &params[i];
  }
  for (uint32_t g = 0; g < c->ngroups; g++) {
    zd__wire_group_to(&groups[g], &c->groups[g]);
    gp[g] = &groups[g];
  }
  Zerod__V1__RegisterRequest req = ZEROD__V1__REGISTER_REQUEST__INIT;
  Zerod__V1__LossScaler scaler;
  req.n_params = l->nparams;
  req.params = pp;
  req.n_groups = c->ngroups;
  req.groups = gp;
  req.param_dtype = zd__wire_dtype_to(c->param_dtype);
  req.grad_dtype = zd__wire_dtype_to(c->grad_dtype);
  req.layout_hash = l->hash;
  req.has_max_grad_norm = 1;
  req.max_grad_norm = c->max_grad_norm;
  req.has_grad_mean = 1;
  req.grad_mean = c->grad_mean != 0;
  req.has_replace = 1;
  req.replace = (c->flags & ZD_REGISTER_REPLACE) != 0;
  req.loss_scaler = zd__wire_scaler_to(&scaler, &c->loss_scaler);
  int fds[2] = {c->param_fd, c->grad_fd}, nfds = 2, slot = -1;
  Zerod__V1__CudaBuffers cb = ZEROD__V1__CUDA_BUFFERS__INIT;
  ProtobufCBinaryData grh[ZD__EVENT_SLOTS], prh[ZD__EVENT_SLOTS];
  if (c->memory == ZD_MEMORY_CUDA) {
    cb.has_device = 1;
    cb.device = c->device;
    cb.has_device_uuid = 1;
    cb.device_uuid = (ProtobufCBinaryData){sizeof c->uuid, c->uuid};
    cb.has_param_handle = 1;
    cb.param_handle = (ProtobufCBinaryData){sizeof c->param_handle, c->param_handle};
    cb.has_grad_handle = 1;
    cb.grad_handle = (ProtobufCBinaryData){sizeof c->grad_handle, c->grad_handle};
    for (int k = 0; k < ZD__EVENT_SLOTS; k++) {
      grh[k] = (ProtobufCBinaryData){sizeof c->grads_ready_handle[k], c->grads_ready_handle[k]};
      prh[k] = (ProtobufCBinaryData){sizeof c->params_ready_handle[k], c->params_ready_handle[k]};
    }
    cb.n_grads_ready = cb.n_params_ready = ZD__EVENT_SLOTS;
    cb.grads_ready = grh;
    cb.params_ready = prh;
    req.cuda = &cb;
    nfds = 0;
    if ((rc = cuda_before_request(c, &slot))) goto exit; /* the initial values come first */
    req.has_event_slot = 1;
    req.event_slot = (uint32_t)slot;
  }
  uint8_t *body = NULL;
  uint32_t len = 0;
  uint64_t id;
  rc = start(c, ZD__MSG_REGISTER, &req.base, fds, nfds, slot, &id);
  if (rc) goto exit; /* not sent whole: zerod opened nothing */
  if (c->memory == ZD_MEMORY_CUDA) c->exported = 1;
  rc = await(c, id, &body, &len, -1);
  pending_t *p = find_pending(c, id);
  int answered = p && p->done;
  if (rc) {
    /* zerod says whether it still holds the handles this register sent (it keeps them only
     * when its stream may still use them); without an answer, or an answer that does not say,
     * it may. No wait on "params ready": zerod's work on the buffers is over if it closed them,
     * and if it kept them that work may never end. */
    if (c->memory == ZD_MEMORY_CUDA) {
      if (answered && p->mappings_kept == 0 && !c->kept)
        c->exported = 0;
      else
        c->kept = 1;
    }
    if (answered) forget_pending(c, p);
    goto exit;
  }
  int crc = cuda_after_reply(c, slot); /* the model zerod wrote comes before the stream's next
                                          work */
  if (answered) forget_pending(c, p);
  Zerod__V1__RegisterReply *rep = zerod__v1__register_reply__unpack(NULL, len, body);
  free(body);
  if (!rep) {
    rc = fail(ZD_EPROTO, "malformed register reply from zerod");
    goto exit;
  }
  c->info.step = rep->step;
  c->info.resumed = rep->resumed;
  c->info.loss_scale = rep->loss_scale;
  c->registered = 1;
  zerod__v1__register_reply__free_unpacked(rep, NULL);
  rc = crc;
exit:
  free(gp);
  free(groups);
  free(pp);
  free(params);
  return rc;
}

void *zd_param_buffer(zd_client_t *c, size_t *bytes) {
  if (bytes) *bytes = c ? c->param_bytes : 0;
  return c ? c->params : NULL;
}

void *zd_grad_buffer(zd_client_t *c, size_t *bytes) {
  if (bytes) *bytes = c ? c->grad_bytes : 0;
  return c ? c->grads : NULL;
}

int zd_param_info(const zd_client_t *c, size_t index, zd_param_info_t *out) {
  if (!c || !c->layout || index >= c->layout->nparams)
    return fail(-EINVAL, "parameter %zu does not exist (call zd_layout first; %u parameters)",
                index, c && c->layout ? c->layout->nparams : 0);
  const zd__layout_param_t *p = &c->layout->params[index];
  *out = (zd_param_info_t){.name = p->name,
                           .offset = p->offset,
                           .numel = p->numel,
                           .bucket = p->bucket,
                           .group = p->group};
  return ZD_OK;
}

int zd_bucket_info(const zd_client_t *c, size_t index, zd_bucket_info_t *out) {
  if (!c || !c->layout || index >= c->layout->nbuckets)
    return fail(-EINVAL, "bucket %zu does not exist (call zd_layout first; %u buckets)", index,
                c && c->layout ? c->layout->nbuckets : 0);
  const zd__bucket_t *b = &c->layout->buckets[index];
  *out = (zd_bucket_info_t){.offset = b->offset,
                            .elems = b->elems,
                            .shard_offset = b->offset + (uint64_t)c->info.rank * b->shard_elems,
                            .shard_elems = b->shard_elems};
  return ZD_OK;
}

int zd_get_info(const zd_client_t *c, zd_info_t *out) {
  if (!c) return fail(-EINVAL, "zd_get_info: client is NULL");
  *out = c->info;
  return ZD_OK;
}

/* ---- requests ------------------------------------------------------------------------------ */

static int check_registered(const zd_client_t *c, const char *what) {
  if (!c) return fail(-EINVAL, "%s: client is NULL", what);
  if (!c->registered) return fail(ZD_EORDER, "%s before zd_register", what);
  return ZD_OK;
}

int zd_step_start(zd_client_t *c, const zd_step_opts_t *opts, zd_request_t *req_out) {
  int rc = check_registered(c, "zd_step");
  if (rc) return rc;
  Zerod__V1__StepRequest req = ZEROD__V1__STEP_REQUEST__INIT;
  size_t ng = opts && opts->groups ? opts->ngroups : 0;
  Zerod__V1__Group groups[ng ? ng : 1];
  Zerod__V1__Group *gp[ng ? ng : 1];
  for (size_t g = 0; g < ng; g++) {
    zd__wire_group_to(&groups[g], &opts->groups[g]);
    gp[g] = &groups[g];
  }
  req.n_groups = ng;
  req.groups = gp;
  req.has_scatter = req.has_gather = 1;
  req.scatter = !(opts && (opts->flags & ZD_STEP_NO_SCATTER));
  req.gather = !(opts && (opts->flags & ZD_STEP_NO_GATHER));
  int slot;
  if ((rc = cuda_before_request(c, &slot))) return rc;
  req.has_event_slot = slot >= 0;
  req.event_slot = slot >= 0 ? (uint32_t)slot : 0;
  return start(c, ZD__MSG_STEP, &req.base, NULL, 0, slot, req_out);
}

static int bucket_start(zd_client_t *c, uint16_t type, int bucket, zd_request_t *req_out) {
  int rc = check_registered(c, type == ZD__MSG_SCATTER ? "zd_scatter" : "zd_gather");
  if (rc) return rc;
  int slot;
  if ((rc = cuda_before_request(c, &slot))) return rc;
  if (type == ZD__MSG_SCATTER) {
    Zerod__V1__ScatterRequest req = ZEROD__V1__SCATTER_REQUEST__INIT;
    req.has_bucket = 1;
    req.bucket = bucket;
    req.has_event_slot = slot >= 0;
    req.event_slot = slot >= 0 ? (uint32_t)slot : 0;
    return start(c, type, &req.base, NULL, 0, slot, req_out);
  }
  Zerod__V1__GatherRequest req = ZEROD__V1__GATHER_REQUEST__INIT;
  req.has_bucket = 1;
  req.bucket = bucket;
  req.has_event_slot = slot >= 0;
  req.event_slot = slot >= 0 ? (uint32_t)slot : 0;
  return start(c, type, &req.base, NULL, 0, slot, req_out);
}

int zd_scatter_start(zd_client_t *c, int bucket, zd_request_t *req) {
  return bucket_start(c, ZD__MSG_SCATTER, bucket, req);
}

int zd_gather_start(zd_client_t *c, int bucket, zd_request_t *req) {
  return bucket_start(c, ZD__MSG_GATHER, bucket, req);
}

int zd_wait(zd_client_t *c, zd_request_t req, zd_step_result_t *result) {
  if (!c) return fail(-EINVAL, "zd_wait: client is NULL");
  int rc = await(c, req, NULL, NULL, -1);
  pending_t *p = find_pending(c, req);
  if (p && p->done) {
    if (result && p->type == ZD__MSG_STEP && rc == ZD_OK) *result = p->step;
    /* zerod recorded the slot's params-ready after the request's work, failed or not; the slot is
     * free once the stream waits on it */
    int crc = cuda_after_reply(c, p->slot);
    forget_pending(c, p);
    if (!rc) rc = crc;
  }
  return rc;
}

int zd_step(zd_client_t *c, const zd_step_opts_t *opts, zd_step_result_t *result) {
  zd_request_t req;
  int rc = zd_step_start(c, opts, &req);
  return rc ? rc : zd_wait(c, req, result);
}

int zd_scatter(zd_client_t *c, int bucket) {
  zd_request_t req;
  int rc = zd_scatter_start(c, bucket, &req);
  return rc ? rc : zd_wait(c, req, NULL);
}

int zd_gather(zd_client_t *c, int bucket) {
  zd_request_t req;
  int rc = zd_gather_start(c, bucket, &req);
  return rc ? rc : zd_wait(c, req, NULL);
}

/* Appends to a growing string; returns -ENOMEM on failure. */
static int append(char **buf, size_t *len, size_t *cap, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int append(char **buf, size_t *len, size_t *cap, const char *fmt, ...) {
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(*buf + *len, *cap - *len, fmt, ap);
    va_end(ap);
    if (n < 0) return -EINVAL;
    if (*len + (size_t)n < *cap) {
      *len += (size_t)n;
      return 0;
    }
    size_t ncap = (*cap + (size_t)n) * 2;
    char *p = realloc(*buf, ncap);
    if (!p) return -ENOMEM;
    *buf = p;
    *cap = ncap;
  }
}

int zd_status(zd_client_t *c, char **text) {
  if (!c || !text) return fail(-EINVAL, "zd_status: client and text are required");
  *text = NULL;
  Zerod__V1__StatusRequest req = ZEROD__V1__STATUS_REQUEST__INIT;
  uint8_t *body = NULL;
  uint32_t len = 0;
  int rc = call(c, ZD__MSG_STATUS, &req.base, NULL, 0, &body, &len, -1);
  if (rc) return rc;
  Zerod__V1__StatusReply *rep = zerod__v1__status_reply__unpack(NULL, len, body);
  free(body);
  if (!rep) return fail(ZD_EPROTO, "malformed status reply from zerod");
  size_t cap = 4096, used = 0;
  char *out = malloc(cap);
  rc = out ? 0 : -ENOMEM;
  if (out) out[0] = '\0';
  for (size_t i = 0; i < rep->n_sections && rc == 0; i++) {
    const Zerod__V1__StatusSection *s = rep->sections[i];
    rc = append(&out, &used, &cap, "%s# %s\n", i ? "\n" : "", s->name);
    for (size_t j = 0; j < s->n_entries && rc == 0; j++)
      rc = append(&out, &used, &cap, "%s:%s\n", s->entries[j]->key, s->entries[j]->value);
  }
  zerod__v1__status_reply__free_unpacked(rep, NULL);
  if (rc) {
    free(out);
    return fail(rc, "out of memory formatting the status");
  }
  *text = out;
  return ZD_OK;
}

void zd_close(zd_client_t *c) {
  if (!c) return;
  int bye = ZD_ECLOSED;
  if (c->fd >= 0) {
    char saved[sizeof last_error];
    memcpy(saved, last_error, sizeof saved); /* closing must not hide the caller's last error */
    /* Requests still outstanding are answered first (zerod answers bye after them anyway), so
     * the bye always has a slot. */
    while (c->npending > 0) {
      pending_t *p = &c->pending[c->npending - 1];
      if (!p->done && await(c, p->id, NULL, NULL, -1) != ZD_OK && !p->done) break; /* gone */
      forget_pending(c, p);
    }
    Zerod__V1__ByeRequest req = ZEROD__V1__BYE_REQUEST__INIT;
    uint8_t *body = NULL;
    uint32_t len = 0;
    bye = call(c, ZD__MSG_BYE, &req.base, NULL, 0, &body, &len, -1);
    memcpy(last_error, saved, sizeof saved);
    close(c->fd);
    /* zerod closed the connection's IPC handles before it answered the bye, unless it says it
     * kept some (its stream may still have work on them) */
    Zerod__V1__ByeReply *rep = bye == ZD_OK ? zerod__v1__bye_reply__unpack(NULL, len, body) : NULL;
    if (rep && rep->has_cuda_mappings_kept && !rep->cuda_mappings_kept) c->exported = 0;
    if (rep) zerod__v1__bye_reply__free_unpacked(rep, NULL);
    free(body);
  }
  /* Device memory and events zerod may still have open are left allocated (release_cuda). */
  release_buffers(c);
  free(c);
}
