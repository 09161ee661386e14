/* libzerod (zerod/zerod.h): the connection of one client and its requests.
 *
 * The socket is blocking: a call writes its request frame and reads frames until its reply
 * arrives. Replies to other pipelined requests that arrive first are kept in a small table until
 * zd_wait() asks for them. zd_connect() tries again, backing off, while zerod refuses new
 * connections for want of a free one (max_clients), up to its timeout. The model and its buffers
 * are client_register.c's; device buffers and the stream ordering around each request are
 * client_cuda.c's (zd__cuda_*: nothing without CUDA). The last error is kept here, per thread, for
 * every file of the library.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "endpoint.h"
#include "group.h"
#include "wire.h"

#define HELLO_TIMEOUT_MS 30000
/* The pauses between connection attempts while zerod is full: doubling from MIN up to MAX. */
#define BUSY_BACKOFF_MIN_MS 5
#define BUSY_BACKOFF_MAX_MS 200
/* zd_rejoin(): its default bound (a zerod's restart and the world's re-forming), and its
 * backoff between tries */
#define REJOIN_TIMEOUT_MS     120000
#define REJOIN_BACKOFF_MIN_MS 10
#define REJOIN_BACKOFF_MAX_MS 250

static __thread char last_error[ZD__ERR_MSG_MAX];

const char *zd_last_error(void) {
  return last_error;
}

const char *zd_version(void) {
  return ZD_VERSION_STRING;
}

int zd__fail(int code, const char *fmt, ...) {
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
      return zd__fail(errno == EPIPE || errno == ECONNRESET ? ZD_ECLOSED : -errno,
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
  if (!buf) return zd__fail(-ENOMEM, "out of memory for a %zu-byte request", len);
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

/* Before sleeping on a reply, look for it for this long: a small step's reply comes back within
 * tens of microseconds, about what waking a sleeping thread costs on a virtual machine. */
#define REPLY_SPIN_NS 50000
/* A step's wait looks for as long as the last step took, plus REPLY_SPIN_NS, where that is at most
 * this: a sleeping client's wake-up (20-40 us on a virtual machine) was up to a fifth of a
 * 2^20-parameter step. A longer step sleeps: the wake-up is then a small part of it, and its
 * kernel may be using every core. So does one whose kernel used every CPU (StepReply.idle_cpus).
 * Past the first REPLY_SPIN_NS the look yields the CPU between tries, so the daemon's threads go
 * first on a busy machine. */
#define STEP_SPIN_MAX_NS 1000000

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Reads what is there without blocking, for up to c->reply_spin_ns (REPLY_SPIN_NS if unset);
 * returns bytes read, or 0 if none came (EOF and errors read as 0 bytes here: the blocking read
 * that follows reports them). */
static ssize_t read_spinning(zd_client_t *c, uint8_t *buf, size_t len) {
  uint64_t start = now_ns(), now = start;
  uint64_t spin = c->reply_spin_ns ? c->reply_spin_ns : REPLY_SPIN_NS;
  do {
    ssize_t n = recv(c->fd, buf, len, MSG_DONTWAIT);
    if (n > 0) return n;
    if (n == 0 || (errno != EAGAIN && errno != EINTR)) return 0; /* let the blocking read say */
    if (now - start >= REPLY_SPIN_NS) sched_yield();
    now = now_ns();
  } while (now - start < spin);
  return 0;
}

static int read_all(zd_client_t *c, uint8_t *buf, size_t len, int timeout_ms) {
  size_t off = (size_t)read_spinning(c, buf, len);
  while (off < len) {
    if (timeout_ms >= 0) {
      struct pollfd p = {.fd = c->fd, .events = POLLIN};
      int n = poll(&p, 1, timeout_ms);
      if (n == 0) return zd__fail(-ETIMEDOUT, "no reply from zerod within %d ms", timeout_ms);
      if (n < 0) {
        if (errno == EINTR) continue;
        return zd__fail(-errno, "poll: %s", strerror(errno));
      }
    }
    ssize_t n = recv(c->fd, buf + off, len - off, 0);
    if (n == 0) return zd__fail(ZD_ECLOSED, "zerod closed the connection");
    if (n < 0) {
      if (errno == EINTR) continue;
      return zd__fail(errno == ECONNRESET ? ZD_ECLOSED : -errno, "reading from zerod failed: %s",
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
    return zd__fail(ZD_EPROTO, "reply from zerod has a bad magic number 0x%08x", h->magic);
  if (h->length > ZD__FRAME_MAX_BODY)
    return zd__fail(ZD_EPROTO, "reply from zerod claims %u bytes; at most %u expected", h->length,
                    ZD__FRAME_MAX_BODY);
  *body = malloc(h->length ? h->length : 1);
  if (!*body) return zd__fail(-ENOMEM, "out of memory for a %u-byte reply", h->length);
  rc = read_all(c, *body, h->length, timeout_ms);
  if (rc) {
    free(*body);
    *body = NULL;
  }
  return rc;
}

zd__pending_t *zd__find_pending(zd_client_t *c, uint64_t id) {
  for (uint32_t i = 0; i < c->npending; i++)
    if (c->pending[i].id == id) return &c->pending[i];
  return NULL;
}

/* An event slot is free again only here: after its request's reply was processed (and, for
 * zd_wait, the stream made to wait on its "params ready"), or when the request is given up. */
static void put_slot(zd_client_t *c, int slot) {
  if (slot >= 0) c->slots_busy &= ~(1ull << slot);
}

void zd__forget_pending(zd_client_t *c, zd__pending_t *p) {
  put_slot(c, p->slot);
  *p = c->pending[--c->npending];
}

/* Records the outcome of a frame into its pending entry. Step replies are decoded here; other
 * reply bodies are handed back through *body_out when the caller waits for exactly that id. */
static int settle(zd_client_t *c, zd__pending_t *p, const zd__frame_header_t *h,
                  const uint8_t *body) {
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
    int cpu_left = !r->has_idle_cpus || r->idle_cpus > 0;
    c->step_spin_ns = cpu_left && r->duration_us <= STEP_SPIN_MAX_NS / 1000
                          ? r->duration_us * 1000 + REPLY_SPIN_NS
                          : REPLY_SPIN_NS;
    zerod__v1__step_reply__free_unpacked(r, NULL);
  }
  return ZD_OK;
}

int zd__await(zd_client_t *c, uint64_t id, uint8_t **body, uint32_t *body_len, int timeout_ms) {
  zd__pending_t *p = zd__find_pending(c, id);
  if (!p) return zd__fail(-EINVAL, "request %" PRIu64 " is not outstanding", id);
  while (!p->done) {
    zd__frame_header_t h;
    uint8_t *b;
    int rc = read_frame(c, &h, &b, timeout_ms);
    if (rc) return rc;
    zd__pending_t *q = zd__find_pending(c, h.request_id);
    if (!q || q->done) {
      rc = zd__fail(ZD_EPROTO, "zerod sent a reply to unknown request %" PRIu64, h.request_id);
      if (h.type == ZD__MSG_ERROR && h.request_id == 0) { /* about the connection itself */
        Zerod__V1__Error *e = zerod__v1__error__unpack(NULL, h.length, b);
        if (e) rc = zd__fail(e->code, "%s", e->message);
        c->refused = e != NULL;
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
  if (code) zd__fail(code, "%s", p->msg);
  return code;
}

int zd__check_room(const zd_client_t *c) {
  if (c->npending == ZD__MAX_OUTSTANDING)
    return zd__fail(-EBUSY, "%d requests are outstanding; zd_wait() for some first",
                    ZD__MAX_OUTSTANDING);
  return ZD_OK;
}

int zd__start(zd_client_t *c, uint16_t type, const ProtobufCMessage *msg, const int *fds, int nfds,
              int slot, uint64_t *id) {
  int rc = zd__check_room(c);
  if (!rc) rc = send_request(c, type, msg, fds, nfds, id);
  if (rc) {
    put_slot(c, slot);
    return rc;
  }
  c->pending[c->npending++] =
      (zd__pending_t){.id = *id, .type = type, .slot = slot, .mappings_kept = -1};
  return ZD_OK;
}

/* Sends a request and waits for its reply; *body as in zd__await(). */
static int call(zd_client_t *c, uint16_t type, const ProtobufCMessage *msg, const int *fds,
                int nfds, uint8_t **body, uint32_t *body_len, int timeout_ms) {
  uint64_t id;
  int rc = zd__start(c, type, msg, fds, nfds, -1, &id);
  if (rc) return rc;
  rc = zd__await(c, id, body, body_len, timeout_ms);
  zd__pending_t *p = zd__find_pending(c, id);
  if (p && p->done) zd__forget_pending(c, p);
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
    return zd__fail(-ENAMETOOLONG, "default socket path is too long");
  if (strlen(buf) >= sizeof(((struct sockaddr_un *)0)->sun_path))
    return zd__fail(-ENAMETOOLONG, "socket path %s is longer than %zu bytes", buf,
                    sizeof(((struct sockaddr_un *)0)->sun_path) - 1);
  return ZD_OK;
}

/* After a failed hello: whether zerod refused the connection itself (ZD_EBUSY at max_clients or
 * max_clients_per_uid), which a later try may get. zerod writes its refusal and closes: when
 * sending the hello failed on the closed socket, the refusal may still be there to read. */
static int refused_busy(zd_client_t *c, int rc) {
  if (rc == ZD_ECLOSED && !c->refused) {
    char msg[ZD__ERR_MSG_MAX];
    snprintf(msg, sizeof msg, "%s", last_error);
    zd__frame_header_t h;
    uint8_t *b = NULL;
    if (read_frame(c, &h, &b, 0) == ZD_OK && h.type == ZD__MSG_ERROR && h.request_id == 0) {
      Zerod__V1__Error *e = zerod__v1__error__unpack(NULL, h.length, b);
      if (e) {
        rc = zd__fail(e->code, "%s", e->message);
        c->refused = 1;
      }
      zerod__v1__error__free_unpacked(e, NULL);
    }
    free(b);
    if (!c->refused) zd__fail(rc, "%s", msg); /* the first error, not the read's */
  }
  return c->refused && rc == ZD_EBUSY;
}

/* One connection and hello; *busy: zerod refused it for want of a free connection. */
static int connect_once(const char *path, int local_rank, int timeout_ms, zd_client_t **out,
                        int *busy) {
  int rc;
  *busy = 0;
  zd_client_t *c = calloc(1, sizeof *c);
  if (!c) return zd__fail(-ENOMEM, "out of memory");
  c->param_fd = c->grad_fd = -1;
  c->info.size = sizeof c->info;
  c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c->fd < 0) {
    rc = zd__fail(-errno, "socket: %s", strerror(errno));
    goto fail;
  }
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
  if (connect(c->fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
    rc = zd__fail(-errno,
                  "cannot connect to zerod at %s: %s (is zerod running, and is this the "
                  "socket it listens on?)",
                  path, strerror(errno));
    goto fail;
  }
  Zerod__V1__HelloRequest req = ZEROD__V1__HELLO_REQUEST__INIT;
  req.min_version = ZD_PROTOCOL_VERSION;
  req.max_version = ZD_PROTOCOL_VERSION;
  req.has_local_rank = 1;
  req.local_rank = local_rank; /* zerod refuses negatives other than ZD_ANY_RANK */
  char name[64];
  snprintf(name, sizeof name, "%s[%d]", program_invocation_short_name, (int)getpid());
  req.client_name = name;
  uint8_t *body = NULL;
  uint32_t len = 0;
  rc = call(c, ZD__MSG_HELLO, &req.base, NULL, 0, &body, &len, timeout_ms);
  if (rc) {
    *busy = refused_busy(c, rc);
    if (*busy) rc = ZD_EBUSY;
    goto fail;
  }
  Zerod__V1__HelloReply *rep = zerod__v1__hello_reply__unpack(NULL, len, body);
  free(body);
  if (!rep) {
    rc = zd__fail(ZD_EPROTO, "malformed hello reply from zerod");
    goto fail;
  }
  c->info.protocol_version = rep->version;
  c->info.world_size = rep->world_size;
  c->info.rank = rep->rank;
  c->info.local_rank = rep->local_rank;
  c->info.bucket_elems = rep->bucket_elems;
  c->overlap_update = rep->has_overlap_update && rep->overlap_update;
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

int zd_connect(const char *socket_path, int local_rank, int timeout_ms, zd_client_t **out) {
  char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
  if (!out) return zd__fail(-EINVAL, "zd_connect: out is NULL; pass where the client goes");
  *out = NULL;
  int rc = resolve_path(socket_path, path, sizeof path);
  if (rc) return rc;
  /* zerod at max_clients refuses at once; a connection frees up when a client leaves or an idle
   * one reaches hello_timeout_ms: try again, backing off, until the hello's timeout. */
  uint64_t wait_ms = timeout_ms > 0 ? (uint64_t)timeout_ms : HELLO_TIMEOUT_MS;
  uint64_t start = now_ns(), backoff_ms = BUSY_BACKOFF_MIN_MS;
  for (unsigned tries = 1;; tries++) {
    uint64_t waited_ms = (now_ns() - start) / 1000000u;
    int busy;
    rc = connect_once(path, local_rank, (int)(wait_ms > waited_ms ? wait_ms - waited_ms : 1), out,
                      &busy);
    if (!rc) snprintf((*out)->path, sizeof(*out)->path, "%s", path);
    if (!busy) return rc;
    waited_ms = (now_ns() - start) / 1000000u;
    if (waited_ms >= wait_ms) {
      char msg[ZD__ERR_MSG_MAX];
      snprintf(msg, sizeof msg, "%s", last_error);
      return zd__fail(ZD_EBUSY,
                      "%s; waited %" PRIu64
                      " ms for a free connection (%u tries; the wait is "
                      "bounded by the connect timeout, %" PRIu64 " ms)",
                      msg, waited_ms, tries, wait_ms);
    }
    uint64_t nap_ms = backoff_ms < wait_ms - waited_ms ? backoff_ms : wait_ms - waited_ms;
    struct timespec ts = {.tv_sec = (time_t)(nap_ms / 1000),
                          .tv_nsec = (long)(nap_ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    backoff_ms = backoff_ms * 2 < BUSY_BACKOFF_MAX_MS ? backoff_ms * 2 : BUSY_BACKOFF_MAX_MS;
  }
}

/* ---- rejoin ------------------------------------------------------------------------------- */

/* Codes that a later try cannot change: the model or the call is wrong, not the world; or the
 * rank is degraded (zerod answers so only where its world cannot heal: no state_dir and no
 * checkpoints, a failed device), which only a restart of zerod ends. */
static int rejoin_permanent(int rc) {
  return rc == ZD_ELAYOUT || rc == ZD_EHPARAM || rc == ZD_EDTYPE || rc == ZD_EGROUP ||
         rc == ZD_EBUFFER || rc == ZD_EBACKEND || rc == ZD_EPROTO || rc == ZD_EDEGRADED ||
         rc == -EINVAL || rc == -ENOMEM || rc == -ENAMETOOLONG;
}

static void nap_ms(uint64_t ms) {
  struct timespec ts = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* One try: a new connection to the same socket and local rank, which replaces the old one, and
 * the same model registered on it with the same buffers. */
static int rejoin_once(zd_client_t *c, int timeout_ms) {
  while (c->npending > 0) zd__forget_pending(c, &c->pending[c->npending - 1]); /* void now */
  if (c->fd >= 0) close(c->fd); /* zerod sees its client leave; the rank is free again */
  c->fd = -1;
  zd_client_t *n = NULL;
  int busy;
  int rc = connect_once(c->path, (int)c->info.local_rank, timeout_ms, &n, &busy);
  if (rc) return rc;
  if (n->info.world_size != c->info.world_size || n->info.rank != c->info.rank ||
      strcmp(n->info.backend, c->info.backend) != 0) {
    rc = zd__fail(ZD_ELAYOUT,
                  "zerod at %s now serves rank %u of %u (%s backend); this model was rank %u of "
                  "%u (%s backend)",
                  c->path, n->info.rank, n->info.world_size, n->info.backend, c->info.rank,
                  c->info.world_size, c->info.backend);
    close(n->fd);
    free(n);
    return rc;
  }
  c->fd = n->fd;
  c->info.protocol_version = n->info.protocol_version;
  snprintf(c->info.daemon_version, sizeof c->info.daemon_version, "%s", n->info.daemon_version);
  c->overlap_update = n->overlap_update;
  free(n);
  c->registered = 0;
  rc = zd_register(c);
  c->registered = 1; /* the buffers stay this model's either way */
  return rc;
}

int zd_rejoin(zd_client_t *c, int timeout_ms) {
  if (!c) return zd__fail(-EINVAL, "zd_rejoin: client is NULL");
  if (!c->registered) return zd__fail(ZD_EORDER, "zd_rejoin before zd_register");
  if (c->memory == ZD_MEMORY_CUDA)
    return zd__fail(ZD_EBACKEND,
                    "zd_rejoin: device buffers die with the process that zerod was: register "
                    "a new client");
  if (!c->path[0]) return zd__fail(-EINVAL, "zd_rejoin: the client has no socket path");
  uint64_t wait_ms = timeout_ms > 0 ? (uint64_t)timeout_ms : REJOIN_TIMEOUT_MS;
  uint64_t start = now_ns(), backoff = REJOIN_BACKOFF_MIN_MS;
  for (unsigned tries = 1;; tries++) {
    uint64_t waited = (now_ns() - start) / 1000000u;
    int rc = rejoin_once(c, (int)(wait_ms > waited ? wait_ms - waited : 1));
    if (rc == ZD_OK) return ZD_OK;
    if (rejoin_permanent(rc)) return rc;
    waited = (now_ns() - start) / 1000000u;
    if (waited >= wait_ms) {
      char msg[ZD__ERR_MSG_MAX];
      snprintf(msg, sizeof msg, "%s", last_error);
      return zd__fail(-ETIMEDOUT,
                      "gave up after %" PRIu64
                      " ms (%u tries) waiting for zerod at %s (rank %u, local rank %u) to take "
                      "this model again and every rank to register it; last: %s (%s)",
                      waited, tries, c->path, c->info.rank, c->info.local_rank, zd_err_name(rc),
                      msg);
    }
    nap_ms(backoff < wait_ms - waited ? backoff : wait_ms - waited);
    backoff = backoff * 2 < REJOIN_BACKOFF_MAX_MS ? backoff * 2 : REJOIN_BACKOFF_MAX_MS;
  }
}

/* ---- requests ------------------------------------------------------------------------------ */

static int check_registered(const zd_client_t *c, const char *what) {
  if (!c) return zd__fail(-EINVAL, "%s: client is NULL", what);
  if (!c->registered) return zd__fail(ZD_EORDER, "%s before zd_register", what);
  return ZD_OK;
}

int zd_step_start(zd_client_t *c, const zd_step_opts_t *caller_opts, zd_request_t *req_out) {
  int rc = check_registered(c, "zd_step");
  if (rc) return rc;
  zd_step_opts_t opts; /* the caller's, by its size, with the defaults of what it lacks */
  if ((rc = zd__read_step_opts(caller_opts, &opts))) return rc;
  size_t ng = opts.groups ? opts.ngroups : 0;
  if (ng && ng != c->ngroups)
    return zd__fail(ZD_EGROUP, "step carries %zu groups; the model has %u", ng, c->ngroups);
  Zerod__V1__StepRequest req = ZEROD__V1__STEP_REQUEST__INIT;
  zd_group_t groups[ng ? ng : 1];
  Zerod__V1__Group wire[ng ? ng : 1];
  Zerod__V1__Group *wp[ng ? ng : 1];
  zd__read_groups(groups, opts.groups, ng, opts.group_size);
  for (size_t g = 0; g < ng; g++) {
    zd__wire_group_to(&wire[g], &groups[g]);
    wp[g] = &wire[g];
  }
  req.n_groups = ng;
  req.groups = wp;
  req.has_scatter = req.has_gather = 1;
  req.scatter = !(opts.flags & ZD_STEP_NO_SCATTER);
  req.gather = !(opts.flags & ZD_STEP_NO_GATHER);
  /* Left out when it is the default: a zerod older than the field then reads the same request. */
  req.has_clip_norm = opts.clip_norm != ZD_CLIP_NORM_DOUBLE;
  req.clip_norm = (Zerod__V1__ClipNorm)opts.clip_norm;
  /* Left out when every parameter has a gradient: the common step carries no bitmap. */
  uint32_t np = c->layout->nparams;
  size_t nbytes = ((size_t)np + 7) / 8;
  int any = 0;
  for (size_t i = 0; opts.absent && i < nbytes && !any; i++) any = opts.absent[i] != 0;
  if (any && np % 8 && opts.absent[nbytes - 1] >> (np % 8))
    return zd__fail(
        -EINVAL, "zd_step_opts_t.absent sets a bit past parameter %u (the model's last)", np - 1);
  req.has_absent = any;
  req.absent.len = any ? nbytes : 0;
  req.absent.data = any ? (uint8_t *)opts.absent : NULL;
  int slot;
  if ((rc = zd__cuda_before_request(c, &slot))) return rc;
  req.has_event_slot = slot >= 0;
  req.event_slot = slot >= 0 ? (uint32_t)slot : 0;
  return zd__start(c, ZD__MSG_STEP, &req.base, NULL, 0, slot, req_out);
}

static int bucket_start(zd_client_t *c, uint16_t type, int bucket, zd_request_t *req_out) {
  int rc = check_registered(c, type == ZD__MSG_SCATTER ? "zd_scatter" : "zd_gather");
  if (rc) return rc;
  int slot;
  if ((rc = zd__cuda_before_request(c, &slot))) return rc;
  if (type == ZD__MSG_SCATTER) {
    Zerod__V1__ScatterRequest req = ZEROD__V1__SCATTER_REQUEST__INIT;
    req.has_bucket = 1;
    req.bucket = bucket;
    req.has_event_slot = slot >= 0;
    req.event_slot = slot >= 0 ? (uint32_t)slot : 0;
    /* zd_set_next_groups(): only to a zerod that takes them, only while they are the model's
     * number (a new layout may have changed it) */
    uint32_t ng =
        c->next_pending && c->overlap_update && c->next_ngroups == c->ngroups ? c->next_ngroups : 0;
    Zerod__V1__Group wire[ng ? ng : 1];
    Zerod__V1__Group *wp[ng ? ng : 1];
    for (uint32_t g = 0; g < ng; g++) {
      zd__wire_group_to(&wire[g], &c->next_groups[g]);
      wp[g] = &wire[g];
    }
    req.n_groups = ng;
    req.groups = wp;
    rc = zd__start(c, type, &req.base, NULL, 0, slot, req_out);
    if (!rc) c->next_pending = 0;
    return rc;
  }
  Zerod__V1__GatherRequest req = ZEROD__V1__GATHER_REQUEST__INIT;
  req.has_bucket = 1;
  req.bucket = bucket;
  req.has_event_slot = slot >= 0;
  req.event_slot = slot >= 0 ? (uint32_t)slot : 0;
  return zd__start(c, type, &req.base, NULL, 0, slot, req_out);
}

int zd_set_next_groups(zd_client_t *c, const zd_group_t *groups, size_t ngroups,
                       size_t group_size) {
  int rc = check_registered(c, "zd_set_next_groups");
  if (rc) return rc;
  if (!groups || !ngroups) {
    c->next_pending = 0;
    return ZD_OK;
  }
  zd_step_opts_t in = ZD_STEP_OPTS_INIT, opts; /* the step's checks of groups, by their size */
  in.groups = groups;
  in.ngroups = ngroups;
  in.group_size = group_size;
  if ((rc = zd__read_step_opts(&in, &opts))) return rc;
  if (ngroups != c->ngroups)
    return zd__fail(ZD_EGROUP, "zd_set_next_groups: %zu groups; the model has %u", ngroups,
                    c->ngroups);
  zd_group_t *copy = realloc(c->next_groups, ngroups * sizeof *copy);
  if (!copy) return zd__fail(-ENOMEM, "zd_set_next_groups: out of memory");
  c->next_groups = copy;
  zd__read_groups(copy, groups, ngroups, group_size);
  zd__err_t err = {0};
  for (size_t g = 0; g < ngroups; g++)
    if (zd__group_check(&copy[g], "zd_set_next_groups", &err) != ZD_OK) {
      c->next_pending = 0;
      return zd__fail(err.code, "%s", err.msg);
    }
  c->next_ngroups = (uint32_t)ngroups;
  c->next_pending = 1;
  return ZD_OK;
}

int zd_scatter_start(zd_client_t *c, int bucket, zd_request_t *req) {
  return bucket_start(c, ZD__MSG_SCATTER, bucket, req);
}

int zd_gather_start(zd_client_t *c, int bucket, zd_request_t *req) {
  return bucket_start(c, ZD__MSG_GATHER, bucket, req);
}

/* A result's size is checked before the request is sent or waited for: a step is never applied
 * and then left unreported. */
static int check_result(const zd_step_result_t *result) {
  return result ? ZD__CHECK_FILLED(result, zd_step_result_t, ZD_STEP_RESULT_INIT) : ZD_OK;
}

int zd_wait(zd_client_t *c, zd_request_t req, zd_step_result_t *result) {
  if (!c) return zd__fail(-EINVAL, "zd_wait: client is NULL");
  int rc = check_result(result);
  if (rc) return rc;
  zd__pending_t *w = zd__find_pending(c, req);
  c->reply_spin_ns = w && w->type == ZD__MSG_STEP ? c->step_spin_ns : 0;
  rc = zd__await(c, req, NULL, NULL, -1);
  c->reply_spin_ns = 0;
  zd__pending_t *p = zd__find_pending(c, req);
  if (p && p->done) {
    if (result && p->type == ZD__MSG_STEP && rc == ZD_OK) zd__write_filled(result, &p->step);
    /* zerod recorded the slot's params-ready after the request's work, failed or not; the slot is
     * free once the stream waits on it */
    int crc = zd__cuda_after_reply(c, p->slot);
    zd__forget_pending(c, p);
    if (!rc) rc = crc;
  }
  return rc;
}

int zd_step(zd_client_t *c, const zd_step_opts_t *opts, zd_step_result_t *result) {
  zd_request_t req;
  int rc = check_result(result);
  if (!rc) rc = zd_step_start(c, opts, &req);
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

int zd_checkpoint(zd_client_t *c, uint32_t flags, uint64_t *step, char *dir, size_t len) {
  int rc = check_registered(c, "zd_checkpoint");
  if (rc) return rc;
  Zerod__V1__CheckpointRequest req = ZEROD__V1__CHECKPOINT_REQUEST__INIT;
  req.has_wait = 1;
  req.wait = !(flags & ZD_CHECKPOINT_NO_WAIT);
  uint64_t id;
  if ((rc = zd__start(c, ZD__MSG_CHECKPOINT, &req.base, NULL, 0, -1, &id))) return rc;
  uint8_t *body = NULL;
  uint32_t body_len = 0;
  rc = zd__await(c, id, &body, &body_len, -1);
  zd__pending_t *p = zd__find_pending(c, id);
  if (p && p->done) zd__forget_pending(c, p);
  if (rc) return rc;
  Zerod__V1__CheckpointReply *rep = zerod__v1__checkpoint_reply__unpack(NULL, body_len, body);
  free(body);
  if (!rep) return zd__fail(ZD_EPROTO, "zd_checkpoint: malformed reply from zerod");
  if (step) *step = rep->step;
  if (dir && len) snprintf(dir, len, "%s", rep->dir);
  zerod__v1__checkpoint_reply__free_unpacked(rep, NULL);
  return ZD_OK;
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

void zd_free(void *ptr) {
  free(ptr);
}

int zd_status(zd_client_t *c, char **text) {
  if (!c || !text) return zd__fail(-EINVAL, "zd_status: client and text are required");
  *text = NULL;
  Zerod__V1__StatusRequest req = ZEROD__V1__STATUS_REQUEST__INIT;
  uint8_t *body = NULL;
  uint32_t len = 0;
  int rc = call(c, ZD__MSG_STATUS, &req.base, NULL, 0, &body, &len, -1);
  if (rc) return rc;
  Zerod__V1__StatusReply *rep = zerod__v1__status_reply__unpack(NULL, len, body);
  free(body);
  if (!rep) return zd__fail(ZD_EPROTO, "malformed status reply from zerod");
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
    return zd__fail(rc, "out of memory formatting the status");
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
      zd__pending_t *p = &c->pending[c->npending - 1];
      if (!p->done && zd__await(c, p->id, NULL, NULL, -1) != ZD_OK && !p->done) break; /* gone */
      zd__forget_pending(c, p);
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
  /* Device memory and events zerod may still have open are left allocated (zd__cuda_release). */
  zd__release_buffers(c);
  free(c->next_groups);
  free(c);
}
