/* libFuzzer harness of session dispatch (daemon/transport/session.c, buffers.c, attach.c): frame
 * sequences sent to a live zerod over its real Unix socket.
 *
 * One zerod per process, created once (CPU backend, one local rank in a world of one, 64-element
 * buckets, a checkpoint_dir, all in a temporary directory). The fuzzer's thread is the daemon's
 * loop thread: between its own writes and reads the harness runs the daemon's libuv loop, while
 * the rank's worker thread runs the jobs as it does in zerod. Each input opens up to two
 * connections and plays a list of operations on them; at its end every connection is half-closed
 * and the harness waits until zerod has torn every session down.
 *
 * Checked, besides the sanitizers and zerod's own assertions:
 * - every complete request frame is answered exactly once with its request id: by its reply type,
 *   whose body unpacks, or by an Error with a code and a message, which carries
 *   cuda_mappings_kept exactly when it answers a register; a frame that breaks the stream (bad
 *   magic, over max_frame_bytes) is answered by an Error and the connection closed; nothing after
 *   bye is answered. The harness knows which frames zerod sees from the bytes it wrote, read the
 *   way dispatch_frames reads them;
 * - zerod closes a connection only after bye, a broken stream, or the client's own end;
 * - no input leaves a session, an attached rank or a descriptor behind;
 * - every PROBE_EVERY inputs, a well-behaved client still says hello, registers (replace), steps
 *   and says bye without an error.
 *
 * Input: a list of operations, each an opcode byte o (kind o % 8) and its arguments:
 *   0, 6, 7  FRAME   a type byte (low 4 bits: 1..8 the request types, 9 Error, others unknown;
 *                    0x10: the reply bit), a modifier byte (MOD_*), with MOD_LENGTH 4 bytes of
 *                    declared body length, one byte per descriptor sent along (FD_*), a 2-byte
 *                    body length and the body. The request id is the harness's, unique per input.
 *   1        RAW     a length byte and that many bytes, written as they are
 *   2        PUMP    run zerod until every complete request on this connection is answered
 *   3        SWITCH  the following operations go to the other connection
 *   4        CLOSE   half-close this connection and wait until zerod closes it (o & 8: close it
 *                    at once without reading); the next operation on it opens a new one
 *   5        CANNED  a byte choosing a valid request (canned()): hello, register (with buffers of
 *                    the right size), step, scatter, gather, status, bye, checkpoint
 * Integers are little-endian; past the end of the input every byte reads as 0.
 *
 * FUZZ_SESSION_TRACE=1 in the environment prints the conversation (each frame zerod sees, each
 * answer) on stderr: run the harness on one input to read what a reproducer does. Races in the
 * threads behind a request (the rank worker, the checkpointer) show only on some runs: give a
 * reproducer -runs=300.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "daemon.h"
#include "frame.h"
#include "fuzz.h"
#include "layout.h"
#include "log.h"
#include "session.h"
#include "wire.h"
#include "zerod.pb-c.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);

#define PROBE_EVERY  64
#define WAIT_MS      30000     /* the longest zerod may take to answer: a hang fails the input */
#define MAX_FD_BYTES (1 << 20) /* buffers sent along are capped: bigger models fail at register */
#define FD_SLACK     8         /* descriptors the process may gain over its first inputs */

/* FRAME's modifier byte. */
enum {
  MOD_VERSION = 1 << 0, /* protocol version 2 */
  MOD_MAGIC = 1 << 1,   /* a wrong magic: the stream breaks */
  MOD_FLAGS = 1 << 2,   /* flags 1 */
  MOD_LENGTH = 1 << 3,  /* the header declares the 4-byte length that follows, not the body's */
  MOD_HASH = 1 << 4,    /* a register body gets the layout hash zerod computes for it */
  MOD_NFDS_SHIFT = 5,   /* bits 5..7: descriptors sent with the frame's first byte */
};

/* A descriptor spec byte: FD_KIND_MASK picks the kind, the other bits modify it. */
enum {
  FD_PARAMS = 0, /* a sealed memfd of the param buffer the register body needs */
  FD_GRADS = 1,  /* ... of the grad buffer */
  FD_SIZED = 2,  /* a sealed memfd of (byte >> 4) * 512 bytes */
  FD_PIPE = 3,   /* a pipe's reading end */
  FD_KIND_MASK = 3,
  FD_UNSEALED = 1 << 2,
  FD_SHORT = 1 << 3, /* one byte smaller */
};

/* ---- the daemon ------------------------------------------------------------------------------ */

static char dir[64], sock_path[128], ckpt_dir[128], control_addr[160];
static zd__config_t cfg;
static zd__daemon_t *daemon_;
static uint64_t inputs, frames_sent;
static uint64_t connects; /* connections made, for zerod's clients_total */
static int fd_baseline = -1;
static int trace; /* $FUZZ_SESSION_TRACE set: the conversation on stderr, to read a reproducer */

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  return remove(path);
}

static void at_exit(void) {
  fprintf(stderr, "fuzz_session: zerod read %llu request frames in %llu inputs\n",
          (unsigned long long)frames_sent, (unsigned long long)inputs);
  if (dir[0]) nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static int open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  FUZZ_CHECK(d, "opendir /proc/self/fd: %s", strerror(errno));
  int n = 0;
  for (struct dirent *e; (e = readdir(d));) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

/* ---- connections ----------------------------------------------------------------------------- */

/* A request zerod must answer once: a complete frame, or the frame that broke the stream. */
typedef struct expect {
  uint64_t id;
  uint16_t type; /* the request's type (0 for a broken header: its error has no kept flag) */
  uint8_t brk;   /* only an Error answers it */
  uint8_t used;
} expect_t;

typedef struct reply {
  uint64_t id;
  uint16_t type;
  int8_t kept; /* Error.cuda_mappings_kept: -1 absent */
  uint8_t used;
} reply_t;

typedef struct conn {
  int no; /* 0 or 1, for the trace */
  int fd; /* -1: none open */
  int half_closed;
  int write_dead; /* zerod reads no more (EPIPE): further bytes are not sent */
  int eof;
  uint8_t *sent; /* every byte written, as zerod reads them */
  size_t nsent, capsent, parsed;
  int stopped; /* bye or a broken stream seen in sent: zerod reads no further */
  int bye;
  expect_t *exp;
  size_t nexp, capexp;
  reply_t *rep;
  size_t nrep, caprep;
  size_t nerrors;
  uint8_t *in; /* received bytes not yet parsed */
  size_t nin, capin;
} conn_t;

static void grow(void *pp, size_t *cap, size_t need, size_t elem) {
  void **p = pp;
  if (need <= *cap) return;
  size_t c = *cap ? *cap : 64;
  while (c < need) c *= 2;
  void *q = realloc(*p, c * elem);
  FUZZ_CHECK(q, "out of memory");
  *p = q;
  *cap = c;
}

static void conn_open(conn_t *c) {
  c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  FUZZ_CHECK(c->fd >= 0, "socket: %s", strerror(errno));
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", sock_path);
  /* The listen backlog takes it now; zerod accepts it when its loop runs. */
  FUZZ_CHECK(connect(c->fd, (struct sockaddr *)&addr, sizeof addr) == 0, "connect %s: %s",
             sock_path, strerror(errno));
  FUZZ_CHECK(fcntl(c->fd, F_SETFL, O_NONBLOCK) == 0, "O_NONBLOCK: %s", strerror(errno));
  connects++;
}

static void conn_free(conn_t *c) {
  if (c->fd >= 0) close(c->fd);
  free(c->sent);
  free(c->exp);
  free(c->rep);
  free(c->in);
  *c = (conn_t){.no = c->no, .fd = -1};
}

static void expect(conn_t *c, uint64_t id, uint16_t type, int brk) {
  grow(&c->exp, &c->capexp, c->nexp + 1, sizeof *c->exp);
  c->exp[c->nexp++] = (expect_t){.id = id, .type = type, .brk = (uint8_t)brk};
}

/* What zerod makes of the bytes written so far (dispatch_frames): each complete frame is a
 * request; a bad magic or a body over max_frame_bytes breaks the stream; bye ends it. */
static void model_advance(conn_t *c) {
  while (!c->stopped && c->nsent - c->parsed >= ZD__FRAME_HEADER_SIZE) {
    zd__frame_header_t h;
    if (zd__frame_decode(c->sent + c->parsed, &h) != ZD_OK) {
      expect(c, 0, 0, 1);
      c->stopped = 1;
      if (trace) fprintf(stderr, "%d -> bad magic: the stream breaks\n", c->no);
      break;
    }
    if (h.length > cfg.max_frame_bytes) {
      expect(c, h.request_id, h.type, 1);
      c->stopped = 1;
      if (trace)
        fprintf(stderr, "%d -> id %llu: %u-byte body, the stream breaks\n", c->no,
                (unsigned long long)h.request_id, h.length);
      break;
    }
    if (c->nsent - c->parsed < ZD__FRAME_HEADER_SIZE + (size_t)h.length) break;
    c->parsed += ZD__FRAME_HEADER_SIZE + (size_t)h.length;
    expect(c, h.request_id, h.type, 0);
    frames_sent++;
    if (trace)
      fprintf(stderr, "%d -> id %llu %s (0x%x) v%u flags %u, %u bytes\n", c->no,
              (unsigned long long)h.request_id, zd__msg_name(h.type), h.type, h.version, h.flags,
              h.length);
    /* A bye that is not refused (version, flags, over bye's 64-byte limit) is the last request
     * zerod reads. */
    if (h.type == ZD__MSG_BYE && h.version == ZD_PROTOCOL_VERSION && h.flags == 0 &&
        h.length <= 64) {
      c->stopped = c->bye = 1;
    }
  }
}

static const ProtobufCMessageDescriptor *reply_descriptor(uint16_t type) {
  switch (type & (uint16_t)~ZD__FRAME_REPLY) {
    case ZD__MSG_HELLO:
      return &zerod__v1__hello_reply__descriptor;
    case ZD__MSG_REGISTER:
      return &zerod__v1__register_reply__descriptor;
    case ZD__MSG_STEP:
      return &zerod__v1__step_reply__descriptor;
    case ZD__MSG_SCATTER:
      return &zerod__v1__scatter_reply__descriptor;
    case ZD__MSG_GATHER:
      return &zerod__v1__gather_reply__descriptor;
    case ZD__MSG_STATUS:
      return &zerod__v1__status_reply__descriptor;
    case ZD__MSG_BYE:
      return &zerod__v1__bye_reply__descriptor;
    case ZD__MSG_CHECKPOINT:
      return &zerod__v1__checkpoint_reply__descriptor;
  }
  return NULL;
}

/* One frame from zerod: well formed, and no more answers than requests. */
static void on_reply(conn_t *c, const zd__frame_header_t *h, const uint8_t *body) {
  FUZZ_CHECK(h->version == ZD_PROTOCOL_VERSION && h->flags == 0,
             "reply header: version %u flags %u", h->version, h->flags);
  int8_t kept = -1;
  if (h->type == ZD__MSG_ERROR) {
    Zerod__V1__Error *e = zerod__v1__error__unpack(NULL, h->length, body);
    FUZZ_CHECK(e, "an Error of %u bytes does not unpack", h->length);
    FUZZ_CHECK(e->code < 0 && e->message && e->message[0], "Error %d without a message", e->code);
    if (e->has_cuda_mappings_kept) kept = (int8_t)e->cuda_mappings_kept;
    if (trace)
      fprintf(stderr, "%d <- id %llu Error %s: %s\n", c->no, (unsigned long long)h->request_id,
              zd_err_name(e->code), e->message);
    zerod__v1__error__free_unpacked(e, NULL);
    c->nerrors++;
  } else {
    const ProtobufCMessageDescriptor *d = reply_descriptor(h->type);
    FUZZ_CHECK((h->type & ZD__FRAME_REPLY) && d, "zerod sent a frame of type 0x%x", h->type);
    ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, h->length, body);
    FUZZ_CHECK(m, "a %s reply of %u bytes does not unpack", d->name, h->length);
    protobuf_c_message_free_unpacked(m, NULL);
    if (trace)
      fprintf(stderr, "%d <- id %llu %s reply\n", c->no, (unsigned long long)h->request_id,
              zd__msg_name(h->type));
  }
  grow(&c->rep, &c->caprep, c->nrep + 1, sizeof *c->rep);
  c->rep[c->nrep++] = (reply_t){.id = h->request_id, .type = h->type, .kept = kept};
  FUZZ_CHECK(c->nrep <= c->nexp, "%zu answers to %zu requests (the last: type 0x%x id %llu)",
             c->nrep, c->nexp, h->type, (unsigned long long)h->request_id);
}

/* Pairs answers with requests once the connection is over: a reply with a request of its id and
 * type, then an Error with any request of its id left. */
static void check_answers(conn_t *c) {
  FUZZ_CHECK(c->nrep == c->nexp, "%zu answers to %zu requests", c->nrep, c->nexp);
  for (int pass = 0; pass < 2; pass++) {
    for (size_t i = 0; i < c->nrep; i++) {
      reply_t *r = &c->rep[i];
      if (r->used || (pass == 0) != (r->type != ZD__MSG_ERROR)) continue;
      int regs = 0, others = 0;
      expect_t *match = NULL;
      for (size_t j = 0; j < c->nexp; j++) {
        expect_t *e = &c->exp[j];
        if (e->used || e->id != r->id) continue;
        if (pass == 0 && (e->brk || (e->type & ZD__FRAME_REPLY) ||
                          (uint16_t)(e->type | ZD__FRAME_REPLY) != r->type))
          continue;
        if (!match) match = e;
        if (e->type == ZD__MSG_REGISTER)
          regs++;
        else
          others++;
      }
      FUZZ_CHECK(match, "answer type 0x%x id %llu matches no request", r->type,
                 (unsigned long long)r->id);
      match->used = r->used = 1;
      if (pass == 1 && !others)
        FUZZ_CHECK(r->kept >= 0, "an Error answering register %llu has no cuda_mappings_kept",
                   (unsigned long long)r->id);
      if (pass == 1 && !regs)
        FUZZ_CHECK(r->kept < 0, "an Error answering a type-0x%x request carries cuda_mappings_kept",
                   match->type);
    }
  }
}

/* Reads what zerod sent. */
static void conn_read(conn_t *c) {
  if (c->fd < 0 || c->eof) return;
  for (;;) {
    grow(&c->in, &c->capin, c->nin + 65536, 1);
    ssize_t n = recv(c->fd, c->in + c->nin, c->capin - c->nin, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) break;
    /* ECONNRESET: zerod closed with bytes of ours unread, after we read all it sent. */
    if (n <= 0) {
      FUZZ_CHECK(n == 0 || errno == ECONNRESET, "recv: %s", strerror(errno));
      c->eof = 1;
      FUZZ_CHECK(c->half_closed || c->stopped,
                 "zerod closed the connection without bye, a broken stream or our end (after "
                 "%zu requests, %zu answers)",
                 c->nexp, c->nrep);
      break;
    }
    c->nin += (size_t)n;
  }
  size_t off = 0;
  while (c->nin - off >= ZD__FRAME_HEADER_SIZE) {
    zd__frame_header_t h;
    FUZZ_CHECK(zd__frame_decode(c->in + off, &h) == ZD_OK, "zerod sent a bad magic");
    FUZZ_CHECK(h.length <= cfg.max_frame_bytes, "zerod sent a %u-byte body", h.length);
    if (c->nin - off < ZD__FRAME_HEADER_SIZE + (size_t)h.length) break;
    on_reply(c, &h, c->in + off + ZD__FRAME_HEADER_SIZE);
    off += ZD__FRAME_HEADER_SIZE + (size_t)h.length;
  }
  memmove(c->in, c->in + off, c->nin - off);
  c->nin -= off;
  if (c->eof && trace) fprintf(stderr, "%d <- closed\n", c->no);
  if (c->eof) FUZZ_CHECK(c->nin == 0, "zerod closed in the middle of a %zu-byte reply", c->nin);
}

/* ---- driving the loop ------------------------------------------------------------------------ */

typedef struct world {
  conn_t conns[2];
  uint64_t next_id;
} world_t;

/* One turn: the daemon's loop without blocking, then the replies. */
static void turn(world_t *w) {
  uv_run(zd__daemon_loop(daemon_), UV_RUN_NOWAIT);
  for (int i = 0; i < 2; i++) conn_read(&w->conns[i]);
}

/* Waits (a little) for the loop or a connection to have something new, or for `writer` to take
 * more bytes. */
static void wait_events(world_t *w, const conn_t *writer) {
  uv_loop_t *loop = zd__daemon_loop(daemon_);
  struct pollfd p[3] = {{.fd = uv_backend_fd(loop), .events = POLLIN}};
  int n = 1;
  for (int i = 0; i < 2; i++) {
    const conn_t *c = &w->conns[i];
    short events = (short)((c->eof ? 0 : POLLIN) | (c == writer ? POLLOUT : 0));
    if (c->fd >= 0 && events) p[n++] = (struct pollfd){.fd = c->fd, .events = events};
  }
  int timeout = uv_backend_timeout(loop);
  poll(p, (nfds_t)n, timeout < 0 || timeout > 10 ? 10 : timeout);
}

static uint32_t conns_open(const world_t *w) {
  uint32_t n = 0;
  for (int i = 0; i < 2; i++) n += w->conns[i].fd >= 0 && !w->conns[i].eof;
  return n;
}

typedef int (*until_fn)(const world_t *w, const conn_t *c);

static void run_until(world_t *w, const conn_t *c, until_fn done, const char *what) {
  uint64_t deadline = now_ms() + WAIT_MS;
  for (turn(w); !done(w, c); turn(w)) {
    const zd__sessions_t *ss = zd__daemon_sessions(daemon_);
    FUZZ_CHECK(now_ms() < deadline,
               "zerod did not %s within %d ms (%zu requests, %zu answers; %u sessions open, "
               "%llu of %llu connections accepted)",
               what, WAIT_MS, c ? c->nexp : 0, c ? c->nrep : 0, zd__sessions_open(ss),
               (unsigned long long)zd__sessions_counters(ss)->clients_total,
               (unsigned long long)connects);
    wait_events(w, NULL);
  }
}

/* Every request answered, and a connection zerod ends (bye, broken stream) closed. */
static int answered(const world_t *w, const conn_t *c) {
  (void)w;
  return c->fd < 0 || c->write_dead || c->eof || (c->nrep == c->nexp && (!c->stopped || c->eof));
}

static int closed_by_zerod(const world_t *w, const conn_t *c) {
  (void)w;
  return c->eof;
}

/* zerod accepted every connection made and holds a session for each open one, none else: a
 * connection closed before zerod accepted it must not reserve a rank in a later input. */
static int sessions_match(const world_t *w, const conn_t *c) {
  (void)c;
  const zd__sessions_t *ss = zd__daemon_sessions(daemon_);
  return zd__sessions_counters(ss)->clients_total == connects &&
         zd__sessions_open(ss) == conns_open(w);
}

/* Writes bytes (and descriptors, with the first of them) as zerod will read them, running the
 * loop while the socket is full. */
static void conn_write(world_t *w, conn_t *c, const uint8_t *data, size_t len, const int *fds,
                       int nfds) {
  if (c->fd < 0) conn_open(c);
  uint64_t deadline = now_ms() + WAIT_MS;
  size_t off = 0;
  while (off < len && !c->write_dead && !c->half_closed) {
    union {
      char buf[CMSG_SPACE(8 * sizeof(int))];
      struct cmsghdr align;
    } ctrl;
    struct iovec iov = {.iov_base = (void *)(data + off), .iov_len = len - off};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds > 0) {
      msg.msg_control = ctrl.buf;
      msg.msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int));
      struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_RIGHTS;
      cm->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
      memcpy(CMSG_DATA(cm), fds, (size_t)nfds * sizeof(int));
    }
    ssize_t n = sendmsg(c->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      FUZZ_CHECK(now_ms() < deadline, "zerod read nothing for %d ms (%zu requests, %zu answers)",
                 WAIT_MS, c->nexp, c->nrep);
      turn(w);
      wait_events(w, c);
      continue;
    }
    if (n < 0) {
      FUZZ_CHECK(errno == EPIPE || errno == ECONNRESET, "send: %s", strerror(errno));
      FUZZ_CHECK(c->stopped, "zerod stopped reading without bye or a broken stream");
      c->write_dead = 1;
      break;
    }
    nfds = 0;
    grow(&c->sent, &c->capsent, c->nsent + (size_t)n, 1);
    memcpy(c->sent + c->nsent, data + off, (size_t)n);
    c->nsent += (size_t)n;
    off += (size_t)n;
    model_advance(c);
  }
}

/* Half-closes c, reads until zerod closes it and checks every answer; or closes it outright. */
static void conn_close(world_t *w, conn_t *c, int abrupt) {
  if (c->fd < 0) return;
  if (!abrupt) {
    shutdown(c->fd, SHUT_WR);
    c->half_closed = 1;
    run_until(w, c, closed_by_zerod, "close the connection");
    check_answers(c);
  }
  conn_free(c);
  run_until(w, NULL, sessions_match, "tear the session down");
}

/* ---- requests -------------------------------------------------------------------------------- */

typedef struct body {
  uint8_t *data;
  size_t len;
} body_t;

static body_t pack(const ProtobufCMessage *m) {
  body_t b = {.len = protobuf_c_message_get_packed_size(m)};
  b.data = malloc(b.len ? b.len : 1);
  FUZZ_CHECK(b.data, "out of memory");
  protobuf_c_message_pack(m, b.data);
  return b;
}

/* The layout zerod builds for a register request, or NULL where it refuses the parameters. */
static zd__layout_t *layout_of(const Zerod__V1__RegisterRequest *req) {
  if (req->n_params == 0 || req->n_params > 4096) return NULL;
  zd_param_t *params = calloc(req->n_params, sizeof *params);
  FUZZ_CHECK(params, "out of memory");
  zd__layout_t *layout = NULL;
  size_t i = 0;
  for (; i < req->n_params; i++) {
    const Zerod__V1__Param *p = req->params[i];
    if (p->n_shape > ZD_MAX_DIMS) break;
    params[i].name = p->name;
    params[i].ndim = (uint32_t)p->n_shape;
    if (p->n_shape) memcpy(params[i].shape, p->shape, p->n_shape * sizeof *p->shape);
    params[i].group = p->group;
  }
  zd__err_t err = {0};
  if (i == req->n_params)
    zd__layout_build(params, (uint32_t)req->n_params, (uint32_t)req->n_groups, 1, cfg.bucket_elems,
                     &layout, &err);
  free(params);
  return layout;
}

/* The bytes of a buffer of total elements of a wire dtype, capped at MAX_FD_BYTES. */
static size_t buffer_bytes(uint64_t total, Zerod__V1__DType dtype) {
  size_t size = zd_dtype_size(zd__wire_dtype_from(dtype));
  if (!size) size = 4;
  return total > MAX_FD_BYTES / size ? MAX_FD_BYTES : (size_t)(total * size);
}

/* For a register body: the buffer sizes it needs; with fix_hash, the body gets zerod's layout
 * hash (a fuzzer does not find a 64-bit hash by mutation). */
static void register_needs(body_t *b, int fix_hash, size_t *param_bytes, size_t *grad_bytes) {
  *param_bytes = *grad_bytes = 4096;
  Zerod__V1__RegisterRequest *req = zerod__v1__register_request__unpack(NULL, b->len, b->data);
  if (!req) return;
  zd__layout_t *layout = layout_of(req);
  if (layout) {
    *param_bytes = buffer_bytes(layout->total_elems, req->param_dtype);
    *grad_bytes = buffer_bytes(layout->total_elems, req->grad_dtype);
    if (fix_hash && req->layout_hash != layout->hash) {
      req->layout_hash = layout->hash;
      free(b->data);
      *b = pack(&req->base);
    }
  }
  zd__layout_free(layout);
  zerod__v1__register_request__free_unpacked(req, NULL);
}

static int make_fd(uint8_t spec, size_t param_bytes, size_t grad_bytes) {
  int kind = spec & FD_KIND_MASK;
  if (kind == FD_PIPE) {
    int p[2];
    FUZZ_CHECK(pipe2(p, O_CLOEXEC) == 0, "pipe: %s", strerror(errno));
    close(p[1]);
    return p[0];
  }
  size_t bytes = kind == FD_PARAMS  ? param_bytes
                 : kind == FD_GRADS ? grad_bytes
                                    : (spec >> 4) * 512u;
  if ((spec & FD_SHORT) && bytes) bytes--;
  int fd = memfd_create("fuzz-buffer", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  FUZZ_CHECK(fd >= 0, "memfd_create: %s", strerror(errno));
  FUZZ_CHECK(ftruncate(fd, (off_t)bytes) == 0, "ftruncate: %s", strerror(errno));
  if (!(spec & FD_UNSEALED))
    FUZZ_CHECK(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0, "F_ADD_SEALS: %s", strerror(errno));
  return fd;
}

/* Sends one frame with the harness's next request id; the body is consumed. */
static void send_frame(world_t *w, conn_t *c, uint16_t type, uint8_t mod, uint32_t declared,
                       body_t *b, const uint8_t *fd_specs, int nfds) {
  size_t param_bytes = 4096, grad_bytes = 4096;
  if (type == ZD__MSG_REGISTER) register_needs(b, mod & MOD_HASH, &param_bytes, &grad_bytes);
  zd__frame_header_t h = {.magic = (mod & MOD_MAGIC) ? 0x5a5a5a5au : ZD__FRAME_MAGIC,
                          .version = (mod & MOD_VERSION) ? 2 : ZD_PROTOCOL_VERSION,
                          .type = type,
                          .length = (mod & MOD_LENGTH) ? declared : (uint32_t)b->len,
                          .flags = (mod & MOD_FLAGS) ? 1 : 0,
                          .request_id = ++w->next_id};
  uint8_t *frame = malloc(ZD__FRAME_HEADER_SIZE + b->len);
  FUZZ_CHECK(frame, "out of memory");
  zd__frame_encode(&h, frame);
  memcpy(frame + ZD__FRAME_HEADER_SIZE, b->data, b->len);
  int fds[8];
  for (int i = 0; i < nfds; i++) fds[i] = make_fd(fd_specs[i], param_bytes, grad_bytes);
  conn_write(w, c, frame, ZD__FRAME_HEADER_SIZE + b->len, fds, nfds);
  for (int i = 0; i < nfds; i++) close(fds[i]);
  free(frame);
  free(b->data);
  b->data = NULL;
}

/* The canned models: a register of model m % 4 (each with a different layout). */
static body_t canned_register(unsigned m, int replace) {
  static uint64_t shapes[][2] = {{64, 0}, {8, 8}, {100, 0}, {40000, 0}};
  Zerod__V1__Param p[2];
  Zerod__V1__Param *pp[2] = {&p[0], &p[1]};
  Zerod__V1__Group g[2];
  Zerod__V1__Group *gp[2] = {&g[0], &g[1]};
  Zerod__V1__LossScaler scaler = ZEROD__V1__LOSS_SCALER__INIT;
  scaler.initial_scale = 65536, scaler.growth_factor = 2, scaler.backoff_factor = 0.5;
  scaler.growth_interval = 2000, scaler.hysteresis = 2, scaler.min_scale = 1;
  for (int i = 0; i < 2; i++) {
    zerod__v1__param__init(&p[i]);
    zerod__v1__group__init(&g[i]);
    g[i].lr = 1e-3, g[i].beta1 = 0.9, g[i].beta2 = 0.999, g[i].eps = 1e-8;
    g[i].weight_decay = i ? 0 : 1e-2;
  }
  Zerod__V1__RegisterRequest req = ZEROD__V1__REGISTER_REQUEST__INIT;
  req.params = pp;
  req.groups = gp;
  req.param_dtype = ZEROD__V1__DTYPE__F32;
  req.grad_dtype = ZEROD__V1__DTYPE__F32;
  req.replace = replace;
  req.has_replace = 1;
  m %= 4;
  p[0].name = "w";
  p[0].shape = shapes[m];
  p[0].n_shape = m == 1 ? 2 : 1;
  req.n_params = req.n_groups = 1;
  if (m == 1) { /* two groups, bf16 grads under a loss scaler */
    p[1].name = "b";
    p[1].shape = shapes[2];
    p[1].n_shape = 1;
    p[1].group = 1;
    req.n_params = req.n_groups = 2;
    req.grad_dtype = ZEROD__V1__DTYPE__BF16;
    req.loss_scaler = &scaler;
  } else if (m == 2) { /* a scalar too, and gradient clipping */
    p[1].name = "s";
    p[1].shape = NULL;
    p[1].n_shape = 0;
    req.n_params = 2;
    req.max_grad_norm = 1.0;
    req.has_max_grad_norm = 1;
  }
  zd__layout_t *layout = layout_of(&req);
  FUZZ_CHECK(layout, "canned model %u has no layout", m);
  req.layout_hash = layout->hash;
  zd__layout_free(layout);
  return pack(&req.base);
}

/* A valid request, chosen by byte k: k % 8 is the type (hello, register, step, scatter, gather,
 * status, bye, checkpoint), the other bits its arguments. */
static void canned(world_t *w, conn_t *c, uint8_t k) {
  static const uint16_t types[] = {ZD__MSG_HELLO,   ZD__MSG_REGISTER,  ZD__MSG_STEP,
                                   ZD__MSG_SCATTER, ZD__MSG_GATHER,    ZD__MSG_STATUS,
                                   ZD__MSG_BYE,     ZD__MSG_CHECKPOINT};
  uint16_t type = types[k % 8];
  body_t b = {0};
  uint8_t fd_specs[2] = {FD_PARAMS, FD_GRADS};
  int nfds = 0;
  switch (type) {
    case ZD__MSG_HELLO: {
      static const int32_t ranks[] = {-1, 0, 1, -5};
      Zerod__V1__HelloRequest req = ZEROD__V1__HELLO_REQUEST__INIT;
      req.min_version = req.max_version = ZD_PROTOCOL_VERSION;
      req.has_local_rank = 1;
      req.local_rank = ranks[(k >> 3) & 3];
      req.client_name = (k & 0x20) ? "fuzz" : NULL;
      b = pack(&req.base);
      break;
    }
    case ZD__MSG_REGISTER:
      b = canned_register((k >> 3) & 3, (k >> 5) & 1);
      nfds = (k & 0x40) ? 0 : 2;
      break;
    case ZD__MSG_STEP: {
      Zerod__V1__StepRequest req = ZEROD__V1__STEP_REQUEST__INIT;
      Zerod__V1__Group g = ZEROD__V1__GROUP__INIT;
      Zerod__V1__Group *gp[1] = {&g};
      g.lr = 1e-2, g.beta1 = 0.9, g.beta2 = 0.999, g.eps = 1e-8;
      if (k & 0x08) {
        req.groups = gp;
        req.n_groups = 1;
      }
      req.has_scatter = req.has_gather = 1;
      req.scatter = !(k & 0x10);
      req.gather = !(k & 0x20);
      b = pack(&req.base);
      break;
    }
    case ZD__MSG_SCATTER:
    case ZD__MSG_GATHER: {
      Zerod__V1__ScatterRequest req = ZEROD__V1__SCATTER_REQUEST__INIT; /* = GatherRequest */
      req.has_bucket = 1;
      req.bucket = (int32_t)((k >> 3) & 7) - 1;
      b = pack(&req.base);
      break;
    }
    case ZD__MSG_CHECKPOINT: {
      Zerod__V1__CheckpointRequest req = ZEROD__V1__CHECKPOINT_REQUEST__INIT;
      req.has_wait = 1;
      req.wait = !(k & 0x08);
      b = pack(&req.base);
      break;
    }
    default: /* status and bye have empty bodies */
      b.data = malloc(1);
      FUZZ_CHECK(b.data, "out of memory");
      break;
  }
  send_frame(w, c, type, MOD_HASH, 0, &b, fd_specs, nfds);
}

/* An operation of FRAME: see the top of the file. */
static void fuzzed_frame(world_t *w, conn_t *c, fuzz_reader_t *r) {
  uint8_t t = fuzz_u8(r), mod = fuzz_u8(r);
  uint16_t type = t & 0x0f;
  if (type == 9) type = ZD__MSG_ERROR;
  if (t & 0x10) type |= ZD__FRAME_REPLY;
  uint32_t declared = (mod & MOD_LENGTH) ? (uint32_t)fuzz_bytes_le(r, 4) : 0;
  int nfds = mod >> MOD_NFDS_SHIFT;
  uint8_t specs[8];
  for (int i = 0; i < nfds; i++) specs[i] = fuzz_u8(r);
  size_t want = (size_t)fuzz_bytes_le(r, 2), len;
  const uint8_t *p = fuzz_take(r, want, &len);
  body_t b = {.data = malloc(len ? len : 1), .len = len};
  FUZZ_CHECK(b.data, "out of memory");
  memcpy(b.data, p, len);
  send_frame(w, c, type, mod, declared, &b, specs, nfds);
}

/* ---- the well-behaved client ----------------------------------------------------------------- */

/* What a trainer does: hello, register (replace: whatever model the rank holds), step, bye; each
 * must succeed. */
static void probe(void) {
  world_t w = {.conns = {{.no = 0, .fd = -1}, {.no = 1, .fd = -1}}};
  conn_t *c = &w.conns[0];
  static const uint8_t steps[] = {0 /* hello, any rank */, 1 | 0x20 /* register model 0, replace */,
                                  2 /* step */, 6 /* bye */};
  for (size_t i = 0; i < sizeof steps; i++) {
    canned(&w, c, steps[i]);
    run_until(&w, c, answered, "answer the well-behaved client");
    FUZZ_CHECK(c->nerrors == 0 && c->nrep == i + 1,
               "the well-behaved client's request %zu failed (%zu errors) after %llu inputs", i,
               c->nerrors, (unsigned long long)inputs);
  }
  conn_close(&w, c, 0);
  conn_free(&w.conns[1]);
}

/* ---- libFuzzer ------------------------------------------------------------------------------- */

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  snprintf(dir, sizeof dir, "/tmp/zerod-fuzz-session-XXXXXX");
  FUZZ_CHECK(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
  atexit(at_exit);
  trace = getenv("FUZZ_SESSION_TRACE") != NULL;
  snprintf(sock_path, sizeof sock_path, "%s/zerod.sock", dir);
  snprintf(ckpt_dir, sizeof ckpt_dir, "%s/checkpoints", dir);
  snprintf(control_addr, sizeof control_addr, "unix:%s/control.sock", dir);
  FUZZ_CHECK(mkdir(ckpt_dir, 0700) == 0, "mkdir %s: %s", ckpt_dir, strerror(errno));
  /* Small buckets so that models have several; timeouts out of reach so that only the input
   * decides; max_inflight low enough for backpressure to happen. */
  static char *args[] = {"zerod",      "--socket",           sock_path, "--control_address",
                         control_addr, "--backend",          "cpu",     "--local_ranks",
                         "1",          "--threads",          "1",       "--bucket_elems",
                         "64",         "--max_inflight",     "4",       "--max_frame_bytes",
                         "65536",      "--hello_timeout_ms", "600000",  "--frame_timeout_ms",
                         "600000",     "--checkpoint_dir",   ckpt_dir,  "--checkpoint_keep",
                         "2",          "--log_level",        "error",   NULL};
  static char *no_env[] = {NULL};
  zd__err_t err = {0};
  int rc = zd__config_load(&cfg, (int)(sizeof args / sizeof args[0]) - 1, args, no_env, &err);
  FUZZ_CHECK(rc == ZD__CONFIG_RUN, "config: %s", err.msg);
  zd__log_level = zd__log_parse_level(cfg.log_level);
  signal(SIGPIPE, SIG_IGN);
  signal(SIGXFSZ, SIG_IGN);
  rc = zd__daemon_create(&cfg, &daemon_, &err);
  FUZZ_CHECK(rc == ZD_OK, "zerod did not start: %s", err.msg);
  /* zerod's SIGINT/SIGTERM handlers would start its shutdown; libFuzzer installs its own after
   * this (it leaves a handler it finds in place), which end the run with its statistics. */
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  probe();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  FUZZ_CHECK(!zd__daemon_shutting_down(daemon_), "zerod is shutting down");
  world_t w = {.conns = {{.no = 0, .fd = -1}, {.no = 1, .fd = -1}}};
  int cur = 0;
  fuzz_reader_t r = {data, size};
  while (r.left) {
    uint8_t op = fuzz_u8(&r);
    conn_t *c = &w.conns[cur];
    switch (op % 8) {
      case 1: {
        size_t len;
        const uint8_t *p = fuzz_take(&r, fuzz_u8(&r), &len);
        conn_write(&w, c, p, len, NULL, 0);
        break;
      }
      case 2:
        if (c->fd >= 0) run_until(&w, c, answered, "answer every request");
        break;
      case 3:
        cur ^= 1;
        break;
      case 4:
        conn_close(&w, c, op & 8);
        break;
      case 5:
        canned(&w, c, fuzz_u8(&r));
        break;
      default:
        fuzzed_frame(&w, c, &r);
        break;
    }
  }
  for (int i = 0; i < 2; i++) conn_close(&w, &w.conns[i], 0);
  zd__sessions_t *ss = zd__daemon_sessions(daemon_);
  FUZZ_CHECK(!zd__sessions_attached(ss, 0), "local rank 0 is still attached with no client");
  inputs++;
  int fds = open_fds();
  if (fd_baseline < 0 || inputs <= 16) fd_baseline = fds > fd_baseline ? fds : fd_baseline;
  FUZZ_CHECK(fds <= fd_baseline + FD_SLACK, "%d descriptors open, %d after the first inputs", fds,
             fd_baseline);
  if (inputs % PROBE_EVERY == 0) probe();
  return 0;
}
