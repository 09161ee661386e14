/* A unary gRPC server on the daemon's loop: gRPC's C core behind a table of methods.
 *
 * The caller gives a table of {path, request decoder, handler, largest request}; this module
 * binds the address, waits for calls, checks the envelope (a request message, its size, that it
 * decodes), runs the handler on the loop thread and sends its one answer. It knows nothing of
 * what the methods mean. Calls of a method not in the table are answered UNIMPLEMENTED.
 *
 * Threading: one thread blocks in grpc_completion_queue_next() and hands every completion to the
 * loop thread (uv_async_send); the loop thread runs the handlers and starts every gRPC batch.
 * Every function here is for the loop thread only.
 */
#ifndef ZD_DAEMON_GRPC_SERVER_H
#define ZD_DAEMON_GRPC_SERVER_H

#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "error.h"

typedef struct zd__gsrv zd__gsrv_t;
typedef struct zd__gsrv_call zd__gsrv_call_t;

/* Answers the call (zd__gsrv_reply, zd__gsrv_reply_error; now or, after zd__gsrv_defer, later)
 * and returns ZD_OK; or, without answering, returns an error with err set, which is sent as the
 * call's status (zd__grpc_status_of). *req is the decoded request, freed after
 * the handler returns; a handler that keeps it sets *req to NULL and frees it itself
 * (protobuf_c_message_free_unpacked). ctx is the server's (zd__gsrv_config_t). */
typedef int (*zd__gsrv_handler_fn)(void *ctx, zd__gsrv_call_t *call, ProtobufCMessage **req,
                                   zd__err_t *err);

typedef struct zd__gsrv_method {
  const char *path;                          /* "/package.Service/Method" */
  const ProtobufCMessageDescriptor *request; /* what the payload must decode as */
  zd__gsrv_handler_fn handler;
  uint32_t max_bytes; /* largest request accepted */
} zd__gsrv_method_t;

typedef struct zd__gsrv_config {
  uv_loop_t *loop;
  const char *address;      /* "host:port" ("host:0": a port the kernel picks) or "unix:/path" */
  const char *address_name; /* where the address came from, for messages ("control_address") */
  const char *log_name;     /* begins the server's log lines ("control") */
  unsigned socket_mode;     /* permissions of a unix: socket, as it is created */
  const zd__gsrv_method_t *methods; /* kept, not copied: must outlive the server */
  size_t nmethods;
  void *ctx; /* the handlers' first argument */
  /* A unix: address: whether the process connecting (fd, its SO_PEERCRED credentials cred) may
   * call; asked before gRPC sees the connection. NULL: whoever the socket's mode lets connect. */
  int (*peer_allowed)(void *ctx, int fd, const struct ucred *cred);
} zd__gsrv_config_t;

/* Binds cfg->address and starts serving. A unix: path where another process listens, or that is
 * not a socket, is refused rather than replaced; a stale socket is. Errors: ZD_ECONFIG (empty or
 * malformed address), -EEXIST, -EADDRINUSE, -EADDRNOTAVAIL (the message says why the address
 * could not be bound), ZD_EINTERNAL, -ENOMEM; on error nothing is left running, and the server's
 * handles close on the loop by themselves. */
int zd__gsrv_start(const zd__gsrv_config_t *cfg, zd__gsrv_t **out, zd__err_t *err);

/* Begins shutdown: no new call is accepted, calls still unanswered after a grace period are
 * cancelled, the queue thread is drained and joined, gRPC shut down, a unix: socket removed, and
 * once every call object is gone (zd__gsrv_call_unref) and the handles are closed the server is
 * freed and done(arg) runs on the loop thread. Calls may still be answered until then. */
void zd__gsrv_stop(zd__gsrv_t *s, void (*done)(void *arg), void *arg);

/* The address as bound: a "host:0" address gets its port. Valid until the server is freed. */
const char *zd__gsrv_address(const zd__gsrv_t *s);

/* The call's method path, for messages. */
const char *zd__gsrv_call_path(const zd__gsrv_call_t *call);

/* The value of the call's request metadata `key` (lower case), copied into buf (len bytes) with a
 * NUL. Returns 1 if found, 0 if absent, -1 if it does not fit. */
int zd__gsrv_call_metadata(const zd__gsrv_call_t *call, const char *key, char *buf, size_t len);

/* Who called ("ipv4:127.0.0.1:51234", "unix:..."), for logging a refused call. */
void zd__gsrv_call_peer(const zd__gsrv_call_t *call, char *buf, size_t len);

/* Answers the call with msg (packed now: msg may go when this returns). */
void zd__gsrv_reply(zd__gsrv_call_t *call, const ProtobufCMessage *msg);

/* Answers the call with a status other than OK and a printf-formatted message. */
void zd__gsrv_reply_error(zd__gsrv_call_t *call, grpc_status_code status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Lets the handler return without answering: the call is answered later. on_cancel(arg) runs on
 * the loop thread if the client cancels it (deadline, disconnect) before then; the call is then
 * over and must not be answered. Returns GRPC_CALL_OK, or gRPC's error (the call is not deferred:
 * answer it or return an error). */
grpc_call_error zd__gsrv_defer(zd__gsrv_call_t *call, void (*on_cancel)(void *arg), void *arg);

/* Keeps the call object, and so the end of the server's shutdown, until the matching unref: for
 * state of the handler's that outlives its answer (a timer being closed). */
void zd__gsrv_call_ref(zd__gsrv_call_t *call);
void zd__gsrv_call_unref(zd__gsrv_call_t *call);

#endif /* ZD_DAEMON_GRPC_SERVER_H */
