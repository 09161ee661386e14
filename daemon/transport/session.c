/* Client sessions (session.h): connections, frame reading and dispatch, writing, a session's life
 * and teardown; the set of sessions with its counters, the rank attachment table it drives and
 * the loop's busy polling. The command table and the request handlers are in requests.c, a
 * request's job and its reply in jobs.c. */
#include "session.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attach.h"
#include "buffers.h"
#include "clock.h"
#include "frame.h"
#include "log.h"
#include "session_internal.h"

#define READ_CHUNK 65536 /* bytes read per recvmsg when no frame size is known yet */

static void update_poll(zd__session_t *s);
static void maybe_teardown(zd__session_t *s);
static size_t unsent_bytes(zd__session_t *s);

/* Whether to take more requests from this client now. Backpressure: a client that pipelines up
 * to max_inflight, or sends without reading its replies (more than max_frame_bytes of them
 * unsent), is not read until it catches up, so it cannot make zerod hold unbounded memory. */
static int accepting(zd__session_t *s) {
  const zd__config_t *cfg = s->cfg;
  return !s->closing && !s->rank_wait && s->inflight < cfg->max_inflight &&
         unsent_bytes(s) < cfg->max_frame_bytes;
}
static void process_frames(zd__session_t *s);

/* ---- writing ------------------------------------------------------------------------------- */

/* The connection is broken: what is queued goes, and nothing more is written (the stream may end
 * in a partial frame). */
static void drop_writes(zd__session_t *s) {
  pthread_mutex_lock(&s->wq_lock);
  s->write_failed = 1;
  while (s->wq_head) {
    out_buf_t *b = s->wq_head;
    s->wq_head = b->next;
    free(b);
  }
  s->wq_tail = NULL;
  s->wq_bytes = 0;
  pthread_mutex_unlock(&s->wq_lock);
}

/* Whether replies wait to be written, and how many bytes of them. */
static size_t unsent_bytes(zd__session_t *s) {
  pthread_mutex_lock(&s->wq_lock);
  size_t n = s->wq_bytes;
  pthread_mutex_unlock(&s->wq_lock);
  return n;
}

static void enqueue_locked(zd__session_t *s, out_buf_t *b) {
  if (s->write_failed) {
    free(b);
    return;
  }
  b->next = NULL;
  if (s->wq_tail)
    s->wq_tail->next = b;
  else
    s->wq_head = b;
  s->wq_tail = b;
  s->wq_bytes += b->len - b->off;
}

/* Writes what the socket takes; -errno on a failed write (the queue is then as it was). */
static int flush_locked(zd__session_t *s) {
  while (s->wq_head) {
    out_buf_t *b = s->wq_head;
    ssize_t n = send(s->fd, b->data + b->off, b->len - b->off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) return errno == EAGAIN || errno == EINTR ? 0 : -errno;
    b->off += (size_t)n;
    s->wq_bytes -= (size_t)n;
    if (b->off < b->len) return 0;
    s->wq_head = b->next;
    if (!s->wq_head) s->wq_tail = NULL;
    free(b);
  }
  return 0;
}

/* Loop thread. */
static void flush(zd__session_t *s) {
  pthread_mutex_lock(&s->wq_lock);
  int rc = flush_locked(s);
  pthread_mutex_unlock(&s->wq_lock);
  if (rc) {
    ZD_LOG_DEBUG("session %u: write failed: %s", s->id, strerror(-rc));
    drop_writes(s);
    s->closing = 1;
  }
}

out_buf_t *zd__frame_buf(uint16_t type, uint64_t id, const ProtobufCMessage *msg) {
  size_t len = protobuf_c_message_get_packed_size(msg);
  out_buf_t *b = malloc(sizeof *b + ZD__FRAME_HEADER_SIZE + len);
  if (!b) return NULL;
  zd__frame_header_t h = {.magic = ZD__FRAME_MAGIC,
                          .version = ZD_PROTOCOL_VERSION,
                          .type = type,
                          .length = (uint32_t)len,
                          .request_id = id};
  zd__frame_encode(&h, b->data);
  protobuf_c_message_pack(msg, b->data + ZD__FRAME_HEADER_SIZE);
  b->len = ZD__FRAME_HEADER_SIZE + len;
  b->off = 0;
  b->next = NULL;
  return b;
}

void zd__session_send(zd__session_t *s, out_buf_t *b) {
  if (s->torn_down) {
    free(b);
    return;
  }
  if (!b) {
    ZD_LOG_ERROR("session %u: out of memory for a reply; closing", s->id);
    s->closing = 1;
    return;
  }
  pthread_mutex_lock(&s->wq_lock);
  enqueue_locked(s, b);
  pthread_mutex_unlock(&s->wq_lock);
  flush(s);
  zd__sessions_poll_busily(s->ss);
}

void zd__session_send_locked(zd__session_t *s, out_buf_t *b) {
  if (!s->wq_head && !s->write_failed) {
    ssize_t n = send(s->fd, b->data, b->len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) b->off = (size_t)n;
  }
  if (b->off < b->len)
    enqueue_locked(s, b); /* the loop writes the rest once it sees the job end */
  else
    free(b);
}

static void send_frame(zd__session_t *s, uint16_t type, uint64_t id, const ProtobufCMessage *msg) {
  if (!s->torn_down) zd__session_send(s, zd__frame_buf(type, id, msg));
}

void zd__session_reply(zd__session_t *s, uint16_t req_type, uint64_t id,
                       const ProtobufCMessage *msg) {
  send_frame(s, (uint16_t)(req_type | ZD__FRAME_REPLY), id, msg);
}

void zd__session_send_error(zd__session_t *s, uint64_t id, int code, const char *msg, int kept) {
  Zerod__V1__Error e = ZEROD__V1__ERROR__INIT;
  e.code = code;
  e.message = (char *)msg;
  e.has_cuda_mappings_kept = kept >= 0;
  e.cuda_mappings_kept = kept > 0;
  s->ss->counters.errors_total++;
  ZD_LOG_DEBUG("session %u: request %" PRIu64 " failed: %s: %s", s->id, id, zd_err_name(code), msg);
  send_frame(s, ZD__MSG_ERROR, id, &e.base);
}

/* A register refused before its job was queued holds nothing: whatever it opened was closed. */
static int kept_if_register(uint16_t type) {
  return type == ZD__MSG_REGISTER ? 0 : -1;
}

/* Refuses the request of header h (which is not a job). */
static void refusef(zd__session_t *s, const zd__frame_header_t *h, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void refusef(zd__session_t *s, const zd__frame_header_t *h, int code, const char *fmt, ...) {
  char msg[ZD__ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  zd__session_send_error(s, h->request_id, code, msg, kept_if_register(h->type));
}

/* An error after which the stream cannot be trusted: reply, then close once it is written.
 * kept: as for send_error_kept. */
static void fail_stream(zd__session_t *s, uint64_t id, int kept, int code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void fail_stream(zd__session_t *s, uint64_t id, int kept, int code, const char *fmt, ...) {
  char msg[ZD__ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  /* Any local process can cause this as often as it likes: one line per event at debug, and the
   * daemon's summary (connection_summary) counts them at info with the last reason. */
  ZD_LOG_DEBUG("session %u (pid %d): %s; closing the connection", s->id, (int)s->cred.pid, msg);
  zd__session_counters_t *n = &s->ss->counters;
  n->connections_dropped++;
  snprintf(n->last_drop, sizeof n->last_drop, "pid %d uid %d: %s", (int)s->cred.pid,
           (int)s->cred.uid, msg);
  zd__session_send_error(s, id, code, msg, kept);
  s->rlen = 0;
  s->closing = 1;
}

/* ---- a session's rank --------------------------------------------------------------------- */

void zd__session_close_fds(zd__session_t *s) {
  for (int i = 0; i < s->nfds; i++) close(s->fds[i]);
  s->nfds = 0;
}

/* Releases the rank (attached or reserved) and the buffers once nothing uses them. */
static void detach(zd__session_t *s) {
  zd__buffers_release(&s->buf, s->rank, s->id); /* while s->rank still says whose they were */
  if (s->rank) {
    uint32_t local = zd__rank_local(s->rank);
    if (zd__attach_release(s->ss->attach, s, local)) {
      ZD_LOG_INFO("session %u: client '%s' (pid %d) detached from local rank %u", s->id, s->name,
                  (int)s->cred.pid, local);
    }
    s->rank = NULL;
  }
  s->state = SESSION_NEW;
}

void zd__session_reply_bye(zd__session_t *s, uint64_t id) {
  detach(s); /* before the reply, so the client can reattach as soon as it reads it */
  s->bye_pending = 0;
  Zerod__V1__ByeReply rep = ZEROD__V1__BYE_REPLY__INIT;
  rep.has_cuda_mappings_kept = 1; /* of this connection: the client frees its memory only if 0 */
  rep.cuda_mappings_kept = s->buf.mappings_kept != 0;
  zd__session_reply(s, ZD__MSG_BYE, id, &rep.base);
}

/* Validates the envelope and runs the command. The handler replies, queues a job, or fails. */
static void dispatch(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body) {
  s->ss->counters.requests_total++;
  if (s->ss->polling) s->ss->counters.requests_polled++;
  zd__err_t err = {0};
  const command_t *cmd = zd__session_command(h->type);
  if (!cmd) {
    char expected[256];
    zd__session_commands(expected, sizeof expected);
    refusef(s, h, ZD_ETYPE, "unknown message type %u; expected one of %s", h->type, expected);
    return;
  }
  const char *name = zd__msg_name(cmd->type);
  uint32_t max_body = cmd->max_body ? cmd->max_body : s->cfg->max_frame_bytes;
  if (h->length > max_body) {
    refusef(s, h, ZD_ETOOBIG, "%s body is %u bytes; at most %u expected", name, h->length,
            max_body);
    return;
  }
  if (s->ss->shutting_down) { /* with a state_dir the state stays for the next zerod */
    if (s->cfg->state_dir[0])
      refusef(s, h, ZD_ECLOSED,
              "zerod is stopping (a planned stop); %s refused: its state_dir keeps the "
              "committed state for the next zerod: register again there (zd_rejoin)",
              name);
    else
      refusef(s, h, ZD_ESHUTDOWN, "zerod is shutting down; %s refused", name);
    return;
  }
  if (cmd->needs >= CMD_NEEDS_HELLO && s->state == SESSION_NEW) {
    refusef(s, h, ZD_EORDER, "%s before hello: say hello first", name);
    return;
  }
  if (cmd->needs >= CMD_NEEDS_MODEL && s->state != SESSION_REGISTERED) {
    refusef(s, h, ZD_EORDER, "%s before register: register a model first", name);
    return;
  }
  int rc = cmd->handler(s, h, body, &err);
  if (rc)
    zd__session_send_error(s, h->request_id, rc, err.msg[0] ? err.msg : zd_strerror(rc),
                           kept_if_register(h->type));
}

/* ---- reading ------------------------------------------------------------------------------- */

static void on_frame_timeout(uv_timer_t *t) {
  zd__session_t *s = t->data;
  if (s->rlen == 0) return;
  zd__frame_header_t h = {0};
  size_t want = ZD__FRAME_HEADER_SIZE;
  if (s->rlen >= ZD__FRAME_HEADER_SIZE) {
    zd__frame_decode(s->rbuf, &h);
    want += h.length;
  }
  fail_stream(s, h.request_id, kept_if_register(h.type), ZD_EPROTO,
              "truncated frame: received %zu of %zu bytes within %u ms", s->rlen, want,
              s->cfg->frame_timeout_ms);
  update_poll(s);
  maybe_teardown(s);
}

static void consume(zd__session_t *s, size_t n) {
  memmove(s->rbuf, s->rbuf + n, s->rlen - n);
  s->rlen -= n;
}

/* How long a register waits for a rank whose client has gone (register_waits), and how often it
 * looks again. */
#define RANK_WAIT_MS      3000
#define RANK_WAIT_POLL_MS 20

static void on_rank_wait(uv_timer_t *t) {
  zd__session_t *s = t->data;
  s->rank_wait = 0;
  if (s->closing || s->torn_down) return;
  process_frames(s);
  update_poll(s);
  maybe_teardown(s);
}

/* A register for a rank that another session still holds only because its client's job in
 * flight (typically a registration waiting for the other ranks, which gives up within a second
 * of its client leaving) has not ended: the client is gone, so the rank is about to be free. A
 * trainer restarted at once would otherwise be refused ZD_EBUSY; it waits (reading nothing more)
 * until the rank is free, for at most RANK_WAIT_MS, and is then refused as before. */
static int register_waits(zd__session_t *s) {
  if (!s->rank) return 0;
  zd__session_t *holder =
      zd__attach_blocker(s->ss->attach, s, zd__rank_local(s->rank), s->named_rank);
  uint64_t now = zd__now_ms();
  if (!holder || !holder->closing || holder->inflight == 0 ||
      (s->rank_wait_until_ms && now >= s->rank_wait_until_ms)) {
    s->rank_wait_until_ms = 0;
    return 0;
  }
  if (!s->rank_wait_until_ms) {
    s->rank_wait_until_ms = now + RANK_WAIT_MS;
    ZD_LOG_DEBUG(
        "session %u: register waits for local rank %u, held by session %u (pid %d) "
        "whose client has gone",
        s->id, zd__rank_local(s->rank), holder->id, (int)holder->cred.pid);
  }
  s->rank_wait = 1;
  uv_timer_start(&s->hello_timer, on_rank_wait, RANK_WAIT_POLL_MS, 0); /* idle after hello */
  return 1;
}

static void dispatch_frames(zd__session_t *s) {
  const zd__config_t *cfg = s->cfg;
  while (accepting(s) && s->rlen >= ZD__FRAME_HEADER_SIZE) {
    zd__frame_header_t h;
    if (zd__frame_decode(s->rbuf, &h) != ZD_OK) {
      fail_stream(s, 0, -1, ZD_EPROTO, "garbage frame: magic is 0x%08x, expected 0x%08x ('ZRD1')",
                  h.magic, ZD__FRAME_MAGIC);
      break;
    }
    if (h.length > cfg->max_frame_bytes) {
      fail_stream(s, h.request_id, kept_if_register(h.type), ZD_ETOOBIG,
                  "frame body is %u bytes; max_frame_bytes is %u", h.length, cfg->max_frame_bytes);
      break;
    }
    size_t total = ZD__FRAME_HEADER_SIZE + (size_t)h.length;
    if (s->rlen < total) break;
    if (h.type == ZD__MSG_REGISTER && h.version == ZD_PROTOCOL_VERSION && register_waits(s)) break;
    if (h.version != ZD_PROTOCOL_VERSION) {
      refusef(s, &h, ZD_EVERSION,
              "frame has protocol version %u; this zerod speaks "
              "version %d",
              h.version, ZD_PROTOCOL_VERSION);
    } else if (h.flags != 0) {
      refusef(s, &h, ZD_EPROTO, "frame flags are 0x%x; expected 0", h.flags);
    } else {
      dispatch(s, &h, s->rbuf + ZD__FRAME_HEADER_SIZE);
    }
    if (s->torn_down) return;
    /* The descriptors that came with a register frame belong to it, used or refused: never to a
     * later register that came without any. */
    if (h.type == ZD__MSG_REGISTER) zd__session_close_fds(s);
    consume(s, total);
  }
}

static void process_frames(zd__session_t *s) {
  s->dispatching = 1;
  dispatch_frames(s);
  s->dispatching = 0;
  if (s->torn_down) return;
  /* A partial frame must complete within frame_timeout_ms, counted while we read: a session held
   * back by backpressure is not the client's delay. */
  if (s->rlen > 0 && accepting(s)) {
    if (!uv_is_active((uv_handle_t *)&s->frame_timer))
      uv_timer_start(&s->frame_timer, on_frame_timeout, s->cfg->frame_timeout_ms, 0);
  } else {
    uv_timer_stop(&s->frame_timer);
  }
}

static int ensure_capacity(zd__session_t *s, size_t need) {
  if (s->rcap - s->rlen >= need) return 0;
  size_t cap = s->rcap ? s->rcap : READ_CHUNK;
  while (cap - s->rlen < need) cap *= 2;
  uint8_t *p = realloc(s->rbuf, cap);
  if (!p) return -ENOMEM;
  s->rbuf = p;
  s->rcap = cap;
  return 0;
}

static void take_fds(zd__session_t *s, struct msghdr *msg) {
  for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    int n = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
    int *fds = (int *)CMSG_DATA(c);
    for (int i = 0; i < n; i++) {
      if (s->nfds < MAX_FDS)
        s->fds[s->nfds++] = fds[i];
      else
        close(fds[i]); /* more than any request needs */
    }
  }
}

static void read_some(zd__session_t *s) {
  for (int round = 0; round < 16 && !s->closing; round++) {
    /* Read the rest of the current frame in one go when its size is known. */
    size_t want = READ_CHUNK;
    if (s->rlen >= ZD__FRAME_HEADER_SIZE) {
      zd__frame_header_t h;
      if (zd__frame_decode(s->rbuf, &h) == ZD_OK && h.length <= s->cfg->max_frame_bytes &&
          ZD__FRAME_HEADER_SIZE + (size_t)h.length > s->rlen + want)
        want = ZD__FRAME_HEADER_SIZE + (size_t)h.length - s->rlen;
    }
    if (ensure_capacity(s, want) != 0) {
      fail_stream(s, 0, -1, -ENOMEM, "out of memory reading a frame");
      return;
    }
    union {
      char buf[CMSG_SPACE(MAX_FDS * sizeof(int))];
      struct cmsghdr align;
    } ctrl;
    struct iovec iov = {.iov_base = s->rbuf + s->rlen, .iov_len = s->rcap - s->rlen};
    struct msghdr msg = {.msg_iov = &iov,
                         .msg_iovlen = 1,
                         .msg_control = ctrl.buf,
                         .msg_controllen = sizeof ctrl.buf};
    ssize_t n = recvmsg(s->fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) return;
      ZD_LOG_DEBUG("session %u: read failed: %s", s->id, strerror(errno));
      drop_writes(s);
      s->closing = 1;
      return;
    }
    take_fds(s, &msg);
    if (msg.msg_flags & MSG_CTRUNC) {
      fail_stream(s, 0, -1, ZD_EPROTO,
                  "too many file descriptors in one message; expected at most %d", MAX_FDS);
      return;
    }
    if (n == 0) {
      if (s->rlen > 0)
        ZD_LOG_WARN(
            "session %u (pid %d): connection closed in the middle of a frame (%zu bytes "
            "received)",
            s->id, (int)s->cred.pid, s->rlen);
      s->closing = 1;
      return;
    }
    s->rlen += (size_t)n;
    process_frames(s);
    if (s->torn_down || !accepting(s)) return;
  }
}

static void on_poll(uv_poll_t *handle, int status, int events) {
  zd__session_t *s = handle->data;
  if (status < 0) { /* libuv stopped the handle */
    s->poll_events = 0;
    drop_writes(s);
    s->closing = 1;
  } else {
    if (events & UV_WRITABLE) {
      flush(s);
      if (!s->closing) process_frames(s); /* frames held back while replies piled up */
    }
    if (events & UV_READABLE) read_some(s);
  }
  update_poll(s);
  maybe_teardown(s);
}

static void update_poll(zd__session_t *s) {
  if (s->torn_down) return;
  int events = 0;
  if (accepting(s)) events |= UV_READABLE;
  if (unsent_bytes(s)) events |= UV_WRITABLE;
  if (events == s->poll_events) return;
  s->poll_events = events;
  if (events)
    uv_poll_start(&s->poll, events, on_poll);
  else
    uv_poll_stop(&s->poll);
}

/* ---- lifecycle ----------------------------------------------------------------------------- */

static void on_handle_closed(uv_handle_t *h) {
  zd__session_t *s = h->data;
  if (--s->open_handles > 0) return;
  zd__sessions_t *ss = s->ss;
  free(s->rbuf);
  pthread_mutex_destroy(&s->wq_lock);
  free(s);
  if (ss->env.closed) ss->env.closed(ss->env.ctx);
}

static void maybe_teardown(zd__session_t *s) {
  /* Gone without a bye (not a shutdown's drain): its jobs still queued leave its buffers alone. */
  if (s->closing && !s->bye_pending && !s->ss->shutting_down) zd__buffers_client_gone(&s->buf);
  zd__job_stand_in(s);
  if (s->torn_down || !s->closing || s->inflight > 0 || unsent_bytes(s)) return;
  if (s->bye_pending) {
    zd__session_reply_bye(s, s->bye_id);
    if (unsent_bytes(s)) {
      update_poll(s);
      return;
    }
  }
  s->torn_down = 1;
  detach(s);
  zd__session_close_fds(s);
  drop_writes(s);
  zd__sessions_t *ss = s->ss;
  if (s->prev)
    s->prev->next = s->next;
  else
    ss->head = s->next;
  if (s->next) s->next->prev = s->prev;
  ss->n--;
  uv_poll_stop(&s->poll);
  uv_timer_stop(&s->frame_timer);
  uv_timer_stop(&s->hello_timer);
  /* The descriptor is closed only after the poll handle: closing the handle removes the
   * descriptor from libuv's epoll set by number, which after a close may already name another
   * thread's file (a checkpoint's, seen by ThreadSanitizer). */
  uv_close((uv_handle_t *)&s->poll, on_handle_closed);
  close(s->fd);
  uv_close((uv_handle_t *)&s->frame_timer, on_handle_closed);
  uv_close((uv_handle_t *)&s->hello_timer, on_handle_closed);
}

/* A connection that has not said hello in time holds a slot of max_clients for nothing: idle
 * connections must not be able to lock trainers out. */
static void on_hello_timeout(uv_timer_t *t) {
  zd__session_t *s = t->data;
  if (s->state != SESSION_NEW || s->closing) return;
  s->ss->counters.clients_timed_out++;
  fail_stream(s, 0, -1, ZD_EPROTO, "no hello within %u ms (hello_timeout_ms); closing",
              s->cfg->hello_timeout_ms);
  update_poll(s);
  maybe_teardown(s);
}

/* Connections of this uid, this one included. */
static uint32_t sessions_of_uid(const zd__sessions_t *ss, uid_t uid) {
  uint32_t n = 0;
  for (const zd__session_t *x = ss->head; x; x = x->next)
    if (!x->closing && x->cred.uid == uid) n++;
  return n;
}

static int gid_allowed(const zd__config_t *cfg, uint32_t gid) {
  for (uint32_t i = 0; i < cfg->allowed_gids.n; i++)
    if (cfg->allowed_gids.ids[i] == gid) return 1;
  return 0;
}

/* The peer's uid, its primary gid, or any of its supplementary groups (SO_PEERGROUPS: a user
 * added to group zerod is allowed without changing its primary group). */
int zd__peer_allowed(const zd__config_t *cfg, int fd, const struct ucred *cred) {
  for (uint32_t i = 0; i < cfg->allowed_uids.n; i++)
    if (cfg->allowed_uids.ids[i] == (uint32_t)cred->uid) return 1;
  if (gid_allowed(cfg, (uint32_t)cred->gid)) return 1;
  if (cfg->allowed_gids.n == 0) return 0;
  gid_t groups[256];
  socklen_t len = sizeof groups;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) != 0) return 0;
  for (size_t i = 0; i < len / sizeof groups[0]; i++)
    if (gid_allowed(cfg, (uint32_t)groups[i])) return 1;
  return 0;
}

static void format_ids(const zd__idlist_t *ids, char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  for (uint32_t i = 0; i < ids->n && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, "%s%u", i ? ", " : "", ids->ids[i]);
  if (ids->n == 0) snprintf(buf, len, "none");
}

int zd__session_create(zd__sessions_t *ss, int fd, const struct ucred *cred) {
  zd__session_t *s = calloc(1, sizeof *s);
  if (!s) {
    close(fd);
    return -ENOMEM;
  }
  const zd__config_t *cfg = ss->env.cfg;
  uv_loop_t *loop = ss->env.loop;
  s->ss = ss;
  s->cfg = cfg;
  s->fd = fd;
  s->cred = *cred;
  zd__buffers_init(&s->buf);
  s->id = ++ss->next_id;
  snprintf(s->name, sizeof s->name, "pid %d", (int)cred->pid);
  int rc = uv_poll_init(loop, &s->poll, fd);
  if (rc) {
    close(fd);
    free(s);
    return rc;
  }
  pthread_mutex_init(&s->wq_lock, NULL);
  uv_timer_init(loop, &s->frame_timer);
  uv_timer_init(loop, &s->hello_timer);
  s->poll.data = s;
  s->frame_timer.data = s;
  s->hello_timer.data = s;
  s->open_handles = 3;
  s->next = ss->head;
  if (ss->head) ss->head->prev = s;
  ss->head = s;
  ss->n++;
  zd__session_counters_t *n = &ss->counters;
  n->clients_total++;

  if (!zd__peer_allowed(cfg, fd, cred)) {
    char uids[256], gids[256];
    format_ids(&cfg->allowed_uids, uids, sizeof uids);
    format_ids(&cfg->allowed_gids, gids, sizeof gids);
    n->clients_denied++;
    fail_stream(s, 0, -1, ZD_EDENIED,
                "uid %d gid %d (pid %d) is not allowed to use zerod; allowed "
                "uids: %s; allowed gids: %s",
                (int)cred->uid, (int)cred->gid, (int)cred->pid, uids, gids);
  } else if (ss->n > cfg->max_clients) {
    n->clients_refused++;
    fail_stream(s, 0, -1, ZD_EBUSY, "zerod has %u clients connected; max_clients is %u", ss->n - 1,
                cfg->max_clients);
  } else if (sessions_of_uid(ss, cred->uid) > cfg->max_clients_per_uid) {
    n->clients_refused++;
    fail_stream(s, 0, -1, ZD_EBUSY, "uid %d has %u connections to zerod; max_clients_per_uid is %u",
                (int)cred->uid, sessions_of_uid(ss, cred->uid) - 1, cfg->max_clients_per_uid);
  } else {
    ZD_LOG_DEBUG("session %u: connection from pid %d uid %d", s->id, (int)cred->pid,
                 (int)cred->uid);
    uv_timer_start(&s->hello_timer, on_hello_timeout, cfg->hello_timeout_ms, 0);
  }
  update_poll(s);
  maybe_teardown(s);
  return ZD_OK;
}

void zd__session_continue(zd__session_t *s) {
  if (!s->closing && !s->dispatching) process_frames(s); /* frames held back by max_inflight */
  update_poll(s);
  maybe_teardown(s);
}

pid_t zd__session_pid(const zd__session_t *s) {
  return s->cred.pid;
}
const char *zd__session_name(const zd__session_t *s) {
  return s->name;
}

/* ---- the set of sessions ------------------------------------------------------------------- */

int zd__sessions_create(const zd__sessions_env_t *env, zd__sessions_t **out) {
  zd__sessions_t *ss = calloc(1, sizeof *ss);
  if (!ss || !(ss->attach = zd__attach_new(env->ranks->n))) {
    free(ss);
    return -ENOMEM;
  }
  ss->env = *env;
  int rc = zd__jobs_init(ss);
  if (rc) {
    zd__attach_free(ss->attach);
    free(ss);
    return rc;
  }
  *out = ss;
  return ZD_OK;
}

void zd__sessions_close(zd__sessions_t *ss) {
  zd_assert(!ss->head);
  uv_close((uv_handle_t *)&ss->done_async, NULL);
}

void zd__sessions_destroy(zd__sessions_t *ss) {
  if (!ss) return;
  zd_assert(!ss->head);
  zd__attach_free(ss->attach);
  pthread_mutex_destroy(&ss->done_lock);
  free(ss);
}

void zd__sessions_drain(zd__sessions_t *ss) {
  ss->shutting_down = 1;
  zd__session_t *s = ss->head;
  while (s) {
    zd__session_t *next = s->next;
    s->closing = 1;
    update_poll(s);
    maybe_teardown(s); /* may free s */
    s = next;
  }
}

uint32_t zd__sessions_open(const zd__sessions_t *ss) {
  return ss->n;
}

const zd__session_counters_t *zd__sessions_counters(const zd__sessions_t *ss) {
  return &ss->counters;
}

const zd__session_t *zd__sessions_attached(const zd__sessions_t *ss, uint32_t local) {
  int attached;
  const zd__session_t *s = zd__attach_holder(ss->attach, local, &attached);
  return attached ? s : NULL;
}

void zd__sessions_refuse_registers(zd__sessions_t *ss, const char *by) {
  snprintf(ss->refuse_by, sizeof ss->refuse_by, "%s", by ? by : "");
}

void zd__sessions_poll_busily(zd__sessions_t *ss) {
  uint32_t busy_poll_us = ss->env.cfg->busy_poll_us;
  if (!busy_poll_us) return;
  /* Not while a worker runs a job: its kernel may need every CPU, and its end wakes the loop. */
  const zd__ranks_t *r = ss->env.ranks;
  for (uint32_t i = 0; i < r->n; i++)
    if (!zd__rank_idle(r->rank[i])) return;
  ss->busy_until_ns = uv_hrtime() + busy_poll_us * 1000ull;
}

int zd__sessions_poll_now(zd__sessions_t *ss) {
  return ss->polling = uv_hrtime() < ss->busy_until_ns;
}

void zd__sessions_status(void *ctx, zd__status_t *st) {
  const zd__sessions_t *ss = ctx;
  const zd__session_counters_t *n = &ss->counters;
  zd__status_section(st, "server");
  zd__status_add(st, "clients_connected", "%u", ss->n);
  zd__status_add(st, "clients_total", "%" PRIu64, n->clients_total);
  zd__status_add(st, "clients_denied", "%" PRIu64, n->clients_denied);
  zd__status_add(st, "requests_total", "%" PRIu64, n->requests_total);
  zd__status_add(st, "requests_polled", "%" PRIu64, n->requests_polled);
  zd__status_add(st, "replies_early", "%" PRIu64, n->replies_early);
  zd__status_add(st, "errors_total", "%" PRIu64, n->errors_total);
  const zd__ranks_t *r = ss->env.ranks;
  for (uint32_t i = 0; i < r->n; i++) { /* into the rank's own section */
    char name[32];
    snprintf(name, sizeof name, "rank %u", zd__rank_global(r->rank[i]));
    zd__status_section(st, name);
    const zd__session_t *c = zd__sessions_attached(ss, i);
    zd__status_add(st, "client", "%s", c ? c->name : "none");
    zd__status_add(st, "client_pid", "%d", c ? (int)c->cred.pid : 0);
  }
}
