/* The unary gRPC server (grpc_server.h): a completion-queue thread, the tag state machine of a
 * call, the method table's dispatch, binding the address, and the shutdown sequence.
 *
 * gRPC's completion queue has no descriptor libuv could poll, so one thread blocks in
 * grpc_completion_queue_next() and hands each completed tag to the loop through a locked list and
 * uv_async_send(). Everything else happens on the loop thread: handlers read the daemon's state
 * there like the rest of the daemon, and every grpc_call_start_batch() is made there. A tag is
 * embedded in the object it completes (a call, or the server's shutdown), so the hand-over
 * allocates nothing; a call object is reference counted by its outstanding batches and the
 * handler's holds.
 *
 * A call's life: a slot per method waits for a new call (request_registered_call); when one
 * arrives the slot is re-armed, the payload is decoded against the method's request type, and
 * the handler answers with one batch (initial metadata, message, status, receive close). A
 * deferred call instead starts its receive-close batch at once, to learn of a client that gives
 * up, and is answered later without it.
 *
 * A unix: address is bound and accepted here, not by gRPC: each connecting process's credentials
 * (SO_PEERCRED) are checked as the client socket checks them, which gRPC's own listener cannot
 * do, and only an admitted connection is handed to gRPC (grpc_server_add_channel_from_fd, plain
 * HTTP/2: the kernel, not TLS, says who is at the other end of a unix socket).
 *
 * Shutdown: the server is shut down (calls still being answered are cancelled if they have not
 * finished after a grace period), the queue is shut down and drained by its thread, the thread is
 * joined, and once no call object is left the server and queue are destroyed and the handles
 * closed; only then is the owner told.
 */
#include "grpc_server.h"

#include <errno.h>
#include <inttypes.h>
#include <grpc/grpc_posix.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/log.h>
#include <grpc/support/time.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "clock.h"
#include "grpc_unary.h"
#include "log.h"
#include "tsan.h"

#define SLOTS_PER_METHOD  2   /* calls of one method gRPC can hand us without waiting */
#define SHUTDOWN_GRACE_MS 500 /* calls still running this long after shutdown are cancelled */

typedef enum tag_kind { TAG_CALL, TAG_CLOSE, TAG_SHUTDOWN } tag_kind_t;

/* What the queue thread hands to the loop: embedded in its owner, one completion at a time. */
typedef struct tag {
  tag_kind_t kind;
  int ok;           /* the event's success flag */
  struct tag *next; /* in the hand-over list */
} tag_t;

typedef enum call_stage { STAGE_REQUESTED, STAGE_REPLYING } call_stage_t;

typedef zd__gsrv_call_t call_t;

struct zd__gsrv_call {
  tag_t tag;       /* the new call, then the reply batch */
  tag_t close_tag; /* receive-close of a deferred call */
  zd__gsrv_t *s;
  int method; /* index in the table; -1: a method not in it */
  call_stage_t stage;
  int refs; /* the tag's operation, the close batch, the handler's holds */
  int replied;
  int deferred;
  int cancelled; /* out-parameter of receive-close */
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_call_details details; /* calls of unknown methods */
  grpc_byte_buffer *payload;
  grpc_byte_buffer *reply;
  grpc_slice status_details;
  void (*on_cancel)(void *arg); /* a deferred call's */
  void *cancel_arg;
};

struct zd__gsrv {
  uv_loop_t *loop;
  const zd__gsrv_method_t *methods;
  size_t nmethods;
  void *ctx;
  char log_name[32];
  char address[256];   /* as bound: a port 0 replaced */
  char unix_path[108]; /* "" unless a unix: address */
  ino_t unix_inode;
  int unix_fd; /* its listening socket; -1: none */
  uv_poll_t unix_poll;
  int (*peer_allowed)(void *ctx, int fd, const struct ucred *cred);
  struct ucred peers[4096]; /* by descriptor, below 4096: who a "fd:N" peer of gRPC's is */
  uint64_t refused_peers;
  uint64_t refused_logged_ms; /* when a refused process was last logged (a flood is summed up) */

  grpc_server *server;
  grpc_completion_queue *cq;
  void **registered; /* per method */
  pthread_t thread;
  int thread_started;

  uv_async_t async;
  uv_timer_t grace;
  int open_handles;
  pthread_mutex_t lock; /* the hand-over list and cq_drained */
  tag_t *head, *tail;
  int cq_drained; /* the thread saw GRPC_QUEUE_SHUTDOWN and is exiting */

  tag_t shutdown_tag;
  int stopping;
  int server_down; /* the shutdown tag came back */
  int thread_joined;
  int destroyed;
  uint32_t ncalls; /* call objects alive */
  void (*done)(void *arg);
  void *done_arg;
};

/* ---- completion-queue thread ----------------------------------------------------------------- */

/* A tag handed to gRPC on the loop thread comes back on the queue thread after everything the loop
 * wrote before handing it over: gRPC's locks make it so, out of ThreadSanitizer's sight. */
#define TAG_TO_GRPC(t)   ZD_TSAN_RELEASE(t)
#define TAG_FROM_GRPC(t) ZD_TSAN_ACQUIRE(t)

static void *cq_main(void *arg) {
  zd__gsrv_t *s = arg;
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type != GRPC_OP_COMPLETE) continue;
    tag_t *t = ev.tag;
    TAG_FROM_GRPC(t);
    t->ok = ev.success;
    t->next = NULL;
    pthread_mutex_lock(&s->lock);
    if (s->tail)
      s->tail->next = t;
    else
      s->head = t;
    s->tail = t;
    pthread_mutex_unlock(&s->lock);
    uv_async_send(&s->async);
  }
  pthread_mutex_lock(&s->lock);
  s->cq_drained = 1;
  pthread_mutex_unlock(&s->lock);
  uv_async_send(&s->async);
  return NULL;
}

/* ---- calls ----------------------------------------------------------------------------------- */

static void maybe_destroy(zd__gsrv_t *s);

static const char *method_path(const zd__gsrv_t *s, int i) {
  return i >= 0 ? s->methods[i].path : "unknown methods";
}

static call_t *call_new(zd__gsrv_t *s, int method) {
  call_t *k = calloc(1, sizeof *k);
  if (!k) return NULL;
  k->tag.kind = TAG_CALL;
  k->close_tag.kind = TAG_CLOSE;
  k->s = s;
  k->method = method;
  k->refs = 1;
  k->status_details = grpc_empty_slice();
  grpc_metadata_array_init(&k->md);
  grpc_call_details_init(&k->details);
  s->ncalls++;
  return k;
}

void zd__gsrv_call_ref(call_t *k) {
  k->refs++;
}

void zd__gsrv_call_unref(call_t *k) {
  if (--k->refs > 0) return;
  zd__gsrv_t *s = k->s;
  /* What gRPC filled in for the call may have been allocated on any thread that polled gRPC (the
   * heartbeat's calls do other calls' work) and reached the loop through the queue. */
  ZD_TSAN_IGNORE_BEGIN();
  if (k->call) grpc_call_unref(k->call);
  grpc_metadata_array_destroy(&k->md);
  grpc_call_details_destroy(&k->details);
  if (k->payload) grpc_byte_buffer_destroy(k->payload);
  if (k->reply) grpc_byte_buffer_destroy(k->reply);
  grpc_slice_unref(k->status_details);
  ZD_TSAN_IGNORE_END();
  free(k);
  s->ncalls--;
  maybe_destroy(s);
}

/* Arms a slot for the next call of method i (-1: any method not in the table). */
static void request_call(zd__gsrv_t *s, int i) {
  call_t *k = call_new(s, i);
  if (!k) {
    ZD_LOG_ERROR("%s: out of memory; one slot of %s stays empty", s->log_name, method_path(s, i));
    return;
  }
  grpc_call_error e;
  TAG_TO_GRPC(&k->tag);
  if (i >= 0)
    e = grpc_server_request_registered_call(s->server, s->registered[i], &k->call, &k->deadline,
                                            &k->md, &k->payload, s->cq, s->cq, &k->tag);
  else
    e = grpc_server_request_call(s->server, &k->call, &k->details, &k->md, s->cq, s->cq, &k->tag);
  if (e != GRPC_CALL_OK) {
    ZD_LOG_ERROR("%s: cannot wait for calls of %s (grpc_call_error %d)", s->log_name,
                 method_path(s, i), (int)e);
    zd__gsrv_call_unref(k);
  }
}

const char *zd__gsrv_call_path(const call_t *k) {
  return k->method >= 0 ? k->s->methods[k->method].path : "?";
}

int zd__gsrv_call_metadata(const call_t *k, const char *key, char *buf, size_t len) {
  buf[0] = '\0';
  int found = 0;
  /* gRPC filled the array in on whichever thread received the call (see zd__gsrv_call_unref) */
  ZD_TSAN_IGNORE_BEGIN();
  for (size_t i = 0; i < k->md.count && !found; i++) {
    const grpc_metadata *m = &k->md.metadata[i];
    size_t kl = GRPC_SLICE_LENGTH(m->key), vl = GRPC_SLICE_LENGTH(m->value);
    if (kl != strlen(key) || memcmp(GRPC_SLICE_START_PTR(m->key), key, kl) != 0) continue;
    found = vl >= len ? -1 : 1;
    if (found > 0) {
      memcpy(buf, GRPC_SLICE_START_PTR(m->value), vl);
      buf[vl] = '\0';
    }
  }
  ZD_TSAN_IGNORE_END();
  return found;
}

void zd__gsrv_call_peer(const call_t *k, char *buf, size_t len) {
  char *peer = grpc_call_get_peer(k->call);
  char subject[160] = "";
  grpc_auth_context *auth = grpc_call_auth_context(k->call);
  if (auth) { /* with mutual TLS, who the CA says the caller is */
    grpc_auth_property_iterator it =
        grpc_auth_context_find_properties_by_name(auth, GRPC_X509_SUBJECT_PROPERTY_NAME);
    const grpc_auth_property *p = grpc_auth_property_iterator_next(&it);
    if (p) snprintf(subject, sizeof subject, " (certificate %.*s)", (int)p->value_length, p->value);
    grpc_auth_context_release(auth);
  }
  int fd;
  if (peer && sscanf(peer, "fd:%d", &fd) == 1 && fd >= 0 &&
      fd < (int)(sizeof k->s->peers / sizeof k->s->peers[0]))
    snprintf(buf, len, "unix:%s (pid %d uid %d)", k->s->unix_path, (int)k->s->peers[fd].pid,
             (int)k->s->peers[fd].uid);
  else
    snprintf(buf, len, "%s%s", peer ? peer : "unknown peer", subject);
  gpr_free(peer);
}

/* The one batch that ends a call. payload may be NULL (an error status). The call's reference
 * passes from the request to this batch. */
static void send_reply(call_t *k, grpc_status_code status, const char *msg,
                       grpc_byte_buffer *payload) {
  zd_assert(!k->replied);
  k->replied = 1;
  k->stage = STAGE_REPLYING;
  k->reply = payload;
  if (status != GRPC_STATUS_OK) {
    k->status_details = grpc_slice_from_copied_string(msg);
    ZD_LOG_DEBUG("%s: %s: %s: %s", k->s->log_name, zd__gsrv_call_path(k),
                 zd__grpc_status_name(status), msg);
  }
  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (payload) {
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = payload;
  }
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = status;
  ops[n++].data.send_status_from_server.status_details =
      status != GRPC_STATUS_OK ? &k->status_details : NULL;
  if (!k->deferred) { /* a deferred call's receive-close is already pending */
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n++].data.recv_close_on_server.cancelled = &k->cancelled;
  }
  TAG_TO_GRPC(&k->tag);
  grpc_call_error e = grpc_call_start_batch(k->call, ops, n, &k->tag, NULL);
  if (e != GRPC_CALL_OK) {
    ZD_LOG_ERROR("%s: cannot send a reply (grpc_call_error %d)", k->s->log_name, (int)e);
    zd__gsrv_call_unref(k);
  }
}

void zd__gsrv_reply(call_t *k, const ProtobufCMessage *msg) {
  send_reply(k, GRPC_STATUS_OK, NULL, zd__grpc_pack(msg));
}

void zd__gsrv_reply_error(call_t *k, grpc_status_code status, const char *fmt, ...) {
  char msg[ZD__ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  send_reply(k, status, msg, NULL);
}

grpc_call_error zd__gsrv_defer(call_t *k, void (*on_cancel)(void *arg), void *arg) {
  grpc_op op = {.op = GRPC_OP_RECV_CLOSE_ON_SERVER};
  op.data.recv_close_on_server.cancelled = &k->cancelled;
  TAG_TO_GRPC(&k->close_tag);
  grpc_call_error e = grpc_call_start_batch(k->call, &op, 1, &k->close_tag, NULL);
  if (e != GRPC_CALL_OK) return e;
  k->deferred = 1;
  k->refs++; /* the close batch */
  k->on_cancel = on_cancel;
  k->cancel_arg = arg;
  return GRPC_CALL_OK;
}

/* The receive-close of a deferred call: a client that cancelled (deadline, disconnect) before
 * its answer ends the call, and no reply is sent. */
static void on_close_event(call_t *k) {
  if (!k->replied && k->cancelled) {
    k->replied = 1;
    k->on_cancel(k->cancel_arg);
    zd__gsrv_call_unref(k); /* the reference the reply would have held */
  }
  zd__gsrv_call_unref(k);
}

/* Validates the envelope (payload, size, request type) and runs the handler. */
static void dispatch(call_t *k) {
  zd__gsrv_t *s = k->s;
  if (k->method < 0) {
    char name[256];
    ZD_TSAN_IGNORE_BEGIN(); /* gRPC's, as the metadata (zd__gsrv_call_metadata) */
    size_t n = GRPC_SLICE_LENGTH(k->details.method);
    if (n >= sizeof name) n = sizeof name - 1;
    memcpy(name, GRPC_SLICE_START_PTR(k->details.method), n);
    ZD_TSAN_IGNORE_END();
    name[n] = '\0';
    zd__gsrv_reply_error(k, GRPC_STATUS_UNIMPLEMENTED, "zerod does not serve method %s", name);
    return;
  }
  const zd__gsrv_method_t *m = &s->methods[k->method];
  zd__err_t err = {0};
  ProtobufCMessage *req = NULL;
  void *data = NULL;
  size_t len = 0;
  int rc;
  if (!k->payload) {
    rc = zd__errf(&err, -EINVAL, "%s: the call carried no request message", m->path);
    goto exit;
  }
  if ((rc = zd__grpc_read(k->payload, &data, &len))) {
    zd__errf(&err, rc, "%s: out of memory reading the request", m->path);
    goto exit;
  }
  if (len > m->max_bytes) {
    rc = zd__errf(&err, ZD_ETOOBIG, "%s: the request is %zu bytes; at most %u are accepted",
                  m->path, len, m->max_bytes);
    goto exit;
  }
  req = protobuf_c_message_unpack(m->request, NULL, len, data);
  if (!req) {
    rc = zd__errf(&err, -EINVAL, "%s: the %zu-byte request is not a valid %s", m->path, len,
                  m->request->name);
    goto exit;
  }
  rc = m->handler(s->ctx, k, &req, &err);
exit:
  if (rc) send_reply(k, zd__grpc_status_of(rc), err.msg, NULL);
  if (req) protobuf_c_message_free_unpacked(req, NULL);
  free(data);
}

/* ---- the loop side of the queue -------------------------------------------------------------- */

static void on_handle_closed(uv_handle_t *h) {
  zd__gsrv_t *s = h->data;
  if (--s->open_handles > 0) return;
  void (*done)(void *) = s->done;
  void *arg = s->done_arg;
  pthread_mutex_destroy(&s->lock);
  free(s->registered);
  free(s);
  if (done) done(arg);
}

static void remove_unix_socket(zd__gsrv_t *s) {
  struct stat st;
  if (s->unix_path[0] && lstat(s->unix_path, &st) == 0 && st.st_ino == s->unix_inode)
    unlink(s->unix_path);
}

static void stop_unix_listener(zd__gsrv_t *s) {
  if (s->unix_fd < 0) return;
  if (s->unix_poll.data) { /* set once the poll handle exists (after grpc_server_start) */
    uv_poll_stop(&s->unix_poll);
    uv_close((uv_handle_t *)&s->unix_poll, on_handle_closed);
  }
  close(s->unix_fd);
  s->unix_fd = -1;
}

/* The end, once the queue thread is joined and no call object is left. */
static void maybe_destroy(zd__gsrv_t *s) {
  if (!s->thread_joined || s->ncalls > 0 || s->destroyed) return;
  s->destroyed = 1;
  grpc_server_destroy(s->server);
  grpc_completion_queue_destroy(s->cq);
  grpc_shutdown();
  remove_unix_socket(s);
  uv_close((uv_handle_t *)&s->async, on_handle_closed);
  uv_close((uv_handle_t *)&s->grace, on_handle_closed);
}

static void handle_tag(zd__gsrv_t *s, tag_t *t) {
  switch (t->kind) {
    case TAG_SHUTDOWN:
      s->server_down = 1;
      uv_timer_stop(&s->grace);
      grpc_completion_queue_shutdown(s->cq); /* the thread drains it and exits */
      break;
    case TAG_CLOSE:
      on_close_event((call_t *)((char *)t - offsetof(call_t, close_tag)));
      break;
    case TAG_CALL: {
      call_t *k = (call_t *)t;
      if (k->stage == STAGE_REPLYING || !t->ok) { /* reply sent, or a slot the shutdown ended */
        zd__gsrv_call_unref(k);
        break;
      }
      if (!s->stopping) request_call(s, k->method);
      dispatch(k);
      break;
    }
  }
}

static void on_async(uv_async_t *h) {
  zd__gsrv_t *s = h->data;
  pthread_mutex_lock(&s->lock);
  tag_t *t = s->head;
  s->head = s->tail = NULL;
  int drained = s->cq_drained;
  pthread_mutex_unlock(&s->lock);
  while (t) {
    tag_t *next = t->next;
    handle_tag(s, t);
    t = next;
  }
  if (drained && !s->thread_joined) {
    pthread_join(s->thread, NULL);
    s->thread_joined = 1;
    maybe_destroy(s);
  }
}

static void on_grace(uv_timer_t *t) {
  zd__gsrv_t *s = t->data;
  if (s->server_down) return;
  ZD_LOG_INFO("%s: cancelling the calls still running %d ms into the shutdown", s->log_name,
              SHUTDOWN_GRACE_MS);
  grpc_server_cancel_all_calls(s->server);
}

void zd__gsrv_stop(zd__gsrv_t *s, void (*done)(void *arg), void *arg) {
  if (s->stopping) return;
  s->stopping = 1;
  s->done = done;
  s->done_arg = arg;
  stop_unix_listener(s);
  TAG_TO_GRPC(&s->shutdown_tag);
  grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
  uv_timer_start(&s->grace, on_grace, SHUTDOWN_GRACE_MS, 0);
}

const char *zd__gsrv_address(const zd__gsrv_t *s) {
  return s->address;
}

/* ---- start ----------------------------------------------------------------------------------- */

/* What OpenSSL's reason for a failed handshake means here. */
static const char *tls_refusal_meaning(const char *msg) {
  if (strstr(msg, "peer did not return a certificate"))
    return "the client presented no certificate (zeroctl: --tls-cert)";
  if (strstr(msg, "certificate verify failed"))
    return "a certificate not signed by tls_ca (the client's, or a server's this zerod called)";
  if (strstr(msg, "wrong version number") || strstr(msg, "http request"))
    return "the other end does not speak TLS (a plaintext client or server)";
  if (strstr(msg, "certificate expired")) return "a certificate has expired";
  return "see OpenSSL's reason";
}

/* gRPC's own log lines, into the daemon's log. gRPC filters by GRPC_VERBOSITY (default: errors)
 * before calling this. A refused TLS handshake is said in the daemon's words: it is a refusal of
 * the control plane, which operators look for. gRPC reports it without the peer's address (the C
 * core exposes none for a connection whose handshake failed), so the line cannot name it. */
static void grpc_log(gpr_log_func_args *a) {
  const char *tls = strstr(a->message, "Handshake failed with fatal error");
  if (tls && a->severity == GPR_LOG_SEVERITY_ERROR) {
    /* "Handshake failed with fatal error SSL_ERROR_SSL: error:0A000086:SSL routines::certificate
     * verify failed." */
    const char *why = strrchr(a->message, ':');
    why = why ? why + 1 : a->message;
    size_t n = strlen(why);
    if (n && why[n - 1] == '.') n--;
    ZD_LOG_WARN(
        "control: refused a TLS connection (gRPC does not report the peer's address): "
        "%.*s: %s",
        (int)n, why, tls_refusal_meaning(a->message));
  } else if (a->severity == GPR_LOG_SEVERITY_ERROR) {
    ZD_LOG_WARN("grpc: %s (%s:%d)", a->message, a->file, a->line);
  } else {
    ZD_LOG_DEBUG("grpc: %s", a->message);
  }
}

static int unix_in_use(const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  int in_use = connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0;
  close(fd);
  return in_use;
}

/* A unix: address: gRPC would unlink whatever socket is at the path, a live zerod's included,
 * so look first, as server.c does for the client socket. */
static int prepare_unix(zd__gsrv_t *s, const zd__gsrv_config_t *cfg, zd__err_t *err) {
  const char *addr = cfg->address, *path = addr + 5;
  if (strncmp(path, "//", 2) == 0) path += 2; /* unix:///abs/path */
  if (!path[0] || strlen(path) >= sizeof s->unix_path)
    return zd__errf(err, ZD_ECONFIG, "%s %s: the socket path must have 1..%zu bytes",
                    cfg->address_name, addr, sizeof s->unix_path - 1);
  snprintf(s->unix_path, sizeof s->unix_path, "%s", path);
  struct stat st;
  if (lstat(path, &st) != 0) return ZD_OK;
  if (!S_ISSOCK(st.st_mode))
    return zd__errf(err, -EEXIST, "%s %s: %s exists and is not a socket", cfg->address_name, addr,
                    path);
  if (unix_in_use(path))
    return zd__errf(err, -EADDRINUSE, "%s %s: another process is listening on %s",
                    cfg->address_name, addr, path);
  return ZD_OK;
}

/* gRPC refused the address for its own reasons, which it logged. With TLS, the likely one is the
 * credentials, of which gRPC says only "Invalid private key" or that a PEM did not parse. */
static void grpc_refused(char *why, size_t len) {
  if (zd__grpc_tls_enabled())
    snprintf(why, len,
             "gRPC refused the TLS identity: tls_key is not the key of tls_cert, or a PEM file "
             "does not parse (the grpc line above says which)");
  else
    snprintf(why, len, "gRPC refused it; see the grpc line above");
}

/* Why a TCP address could not be bound, found by trying it the way gRPC does (gRPC itself says
 * nothing for an address in use). Called only after gRPC failed, so it races with nothing that
 * matters: at worst the diagnosis is vaguer. */
static void diagnose_tcp(const char *addr, char *why, size_t len) {
  snprintf(why, len, "malformed: expected host:port or unix:/path");
  const char *colon = strrchr(addr, ':');
  if (!colon || !colon[1]) return;
  char host[256];
  snprintf(host, sizeof host, "%.*s", (int)(colon - addr), addr);
  size_t hl = strlen(host);
  if (hl >= 2 && host[0] == '[' && host[hl - 1] == ']') { /* [::1]:7070 */
    memmove(host, host + 1, hl - 2);
    host[hl - 2] = '\0';
  }
  struct addrinfo hints = {
      .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
  struct addrinfo *res = NULL;
  int gai = getaddrinfo(host[0] ? host : NULL, colon + 1, &hints, &res);
  if (gai) {
    snprintf(why, len, "cannot resolve '%s' port '%s': %s", host, colon + 1, gai_strerror(gai));
    return;
  }
  grpc_refused(why, len);
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      int e = errno;
      snprintf(why, len, "%s",
               e == EADDRINUSE      ? "another process is listening on it"
               : e == EADDRNOTAVAIL ? "not an address of this host"
                                    : strerror(e));
      close(fd);
      break;
    }
    close(fd);
  }
  freeaddrinfo(res);
}

/* The address as bound: "host:0" gets the port the kernel chose. */
static void set_bound_address(zd__gsrv_t *s, const char *addr, int port) {
  const char *colon = strrchr(addr, ':');
  if (!s->unix_path[0] && colon && strcmp(colon, ":0") == 0)
    snprintf(s->address, sizeof s->address, "%.*s:%d", (int)(colon - addr), addr, port);
  else
    snprintf(s->address, sizeof s->address, "%s", addr);
}

/* A unix: address, bound here with the mode asked for (the umask keeps any wider access from
 * existing even for a moment), replacing a stale socket (prepare_unix checked nobody listens). */
static int listen_unix(zd__gsrv_t *s, const zd__gsrv_config_t *cfg, zd__err_t *err) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", s->unix_path);
  s->unix_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s->unix_fd < 0)
    return zd__errf(err, -errno, "%s %s: socket: %s", cfg->address_name, cfg->address,
                    strerror(errno));
  unlink(s->unix_path);
  mode_t old_mask = umask(~(mode_t)cfg->socket_mode & 0777);
  int rc = bind(s->unix_fd, (struct sockaddr *)&addr, sizeof addr) ? -errno : 0;
  umask(old_mask);
  if (!rc && listen(s->unix_fd, 64)) rc = -errno;
  if (rc) {
    close(s->unix_fd);
    s->unix_fd = -1;
    return zd__errf(err, rc, "cannot listen on %s %s: %s", cfg->address_name, cfg->address,
                    strerror(-rc));
  }
  struct stat st;
  if (lstat(s->unix_path, &st) == 0) s->unix_inode = st.st_ino;
  return ZD_OK;
}

/* A refused process, logged with who it was; a flood of them is logged once a second with the
 * count, so that a local user cannot fill the log. */
static void log_refused_peer(zd__gsrv_t *s, const struct ucred *cred) {
  s->refused_peers++;
  uint64_t now = zd__now_ms();
  if (s->refused_logged_ms && now - s->refused_logged_ms < 1000) return;
  s->refused_logged_ms = now;
  ZD_LOG_WARN(
      "%s: refused a connection to unix:%s from pid %d uid %d gid %d: not in "
      "allowed_uids or allowed_gids (%" PRIu64 " refused so far)",
      s->log_name, s->unix_path, (int)cred->pid, (int)cred->uid, (int)cred->gid, s->refused_peers);
}

static void on_unix_connection(uv_poll_t *h, int status, int events) {
  zd__gsrv_t *s = h->data;
  (void)events;
  if (status < 0) return;
  for (;;) {
    int fd = accept4(s->unix_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
        ZD_LOG_WARN("%s: accept on unix:%s: %s", s->log_name, s->unix_path, strerror(errno));
      if (errno == EINTR) continue;
      return;
    }
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      ZD_LOG_WARN("%s: SO_PEERCRED on unix:%s: %s", s->log_name, s->unix_path, strerror(errno));
      close(fd);
      continue;
    }
    if (s->stopping || (s->peer_allowed && !s->peer_allowed(s->ctx, fd, &cred))) {
      if (!s->stopping) log_refused_peer(s, &cred);
      close(fd);
      continue;
    }
    if (fd < (int)(sizeof s->peers / sizeof s->peers[0])) s->peers[fd] = cred;
    ZD_LOG_DEBUG("%s: connection on unix:%s from pid %d uid %d", s->log_name, s->unix_path,
                 (int)cred.pid, (int)cred.uid);
    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    grpc_server_add_channel_from_fd(s->server, fd, creds); /* owns fd from here */
    grpc_server_credentials_release(creds);
  }
}

/* Undoes a start that failed after the server and queue were created. */
static void abort_start(zd__gsrv_t *s) {
  grpc_completion_queue_shutdown(s->cq);
  if (s->thread_started) {
    pthread_join(s->thread, NULL);
  } else {
    while (grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
  }
  grpc_server_destroy(s->server);
  grpc_completion_queue_destroy(s->cq);
  grpc_shutdown();
  stop_unix_listener(s);
  remove_unix_socket(s);
  s->done = NULL;
  uv_close((uv_handle_t *)&s->async, on_handle_closed);
  uv_close((uv_handle_t *)&s->grace, on_handle_closed);
}

int zd__gsrv_start(const zd__gsrv_config_t *cfg, zd__gsrv_t **out, zd__err_t *err) {
  const char *addr = cfg->address;
  *out = NULL;
  zd__gsrv_t *s = calloc(1, sizeof *s);
  void **registered = calloc(cfg->nmethods ? cfg->nmethods : 1, sizeof *registered);
  if (!s || !registered) {
    free(s);
    free(registered);
    return zd__errf(err, -ENOMEM, "out of memory starting the %s service", cfg->log_name);
  }
  s->loop = cfg->loop;
  s->methods = cfg->methods;
  s->nmethods = cfg->nmethods;
  s->ctx = cfg->ctx;
  s->registered = registered;
  snprintf(s->log_name, sizeof s->log_name, "%s", cfg->log_name);
  s->shutdown_tag.kind = TAG_SHUTDOWN;
  s->unix_fd = -1;
  s->peer_allowed = cfg->peer_allowed;
  pthread_mutex_init(&s->lock, NULL);
  int rc = strncmp(addr, "unix:", 5) == 0 ? prepare_unix(s, cfg, err) : ZD_OK;
  if (!rc && !addr[0]) rc = zd__errf(err, ZD_ECONFIG, "%s is empty", cfg->address_name);
  if (!rc && (rc = uv_async_init(s->loop, &s->async, on_async)))
    zd__errf(err, rc, "uv_async_init: %s", uv_strerror(rc));
  if (rc) {
    pthread_mutex_destroy(&s->lock);
    free(s->registered);
    free(s);
    return rc;
  }
  uv_timer_init(s->loop, &s->grace);
  s->async.data = s->grace.data = s;
  s->open_handles = 2;

  gpr_set_log_function(grpc_log);
  grpc_init();
  s->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_arg args[] = {
      {.type = GRPC_ARG_INTEGER,
       .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
       .value.integer = (int)ZD__GRPC_MAX_MESSAGE},
      {.type = GRPC_ARG_INTEGER,
       .key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
       .value.integer = (int)ZD__GRPC_MAX_MESSAGE},
      /* gRPC sets SO_REUSEPORT by default: a second zerod on the same port would silently share
       * the calls instead of failing to start. */
      {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_ALLOW_REUSEPORT, .value.integer = 0},
  };
  grpc_channel_args chargs = {.num_args = sizeof args / sizeof args[0], .args = args};
  s->server = grpc_server_create(&chargs, NULL);
  for (size_t i = 0; i < s->nmethods; i++) {
    s->registered[i] = grpc_server_register_method(s->server, s->methods[i].path, NULL,
                                                   GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!s->registered[i]) {
      rc = zd__errf(err, ZD_EINTERNAL, "cannot register gRPC method %s", s->methods[i].path);
      goto fail;
    }
  }
  grpc_server_register_completion_queue(s->server, s->cq, NULL);
  if ((rc = pthread_create(&s->thread, NULL, cq_main, s))) {
    rc = zd__errf(err, -rc, "cannot start the %s service's thread: %s", s->log_name, strerror(rc));
    goto fail;
  }
  s->thread_started = 1;

  int port = 0;
  if (s->unix_path[0]) {
    if ((rc = listen_unix(s, cfg, err))) goto fail;
  } else {
    grpc_server_credentials *creds = zd__grpc_server_credentials();
    port = creds ? grpc_server_add_http2_port(s->server, addr, creds) : 0;
    if (creds) grpc_server_credentials_release(creds);
    if (port <= 0) {
      char why[256];
      diagnose_tcp(addr, why, sizeof why);
      rc =
          zd__errf(err, -EADDRNOTAVAIL, "cannot listen on %s %s: %s", cfg->address_name, addr, why);
      goto fail;
    }
  }
  set_bound_address(s, addr, port);
  grpc_server_start(s->server);
  if (s->unix_path[0]) {
    uv_poll_init(s->loop, &s->unix_poll, s->unix_fd);
    s->unix_poll.data = s;
    s->open_handles++;
    uv_poll_start(&s->unix_poll, UV_READABLE, on_unix_connection);
  }
  for (size_t i = 0; i < s->nmethods; i++)
    for (int slot = 0; slot < SLOTS_PER_METHOD; slot++) request_call(s, (int)i);
  request_call(s, -1);
  *out = s;
  return ZD_OK;

fail:
  abort_start(s);
  return rc;
}
