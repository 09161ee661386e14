/* Unary gRPC calls with protobuf-c messages: the one wrapper around gRPC's C core that zerod's
 * control service (daemon/control.c), its rendezvous client (daemon/rendezvous.c) and zeroctl
 * share, so that the tag-and-batch state machine of a call is written once.
 *
 * The client half makes blocking calls on a channel (a pluck completion queue per call, so a
 * channel may be shared by threads); the common half packs and unpacks messages to byte buffers
 * and maps between gRPC status codes and zerod's error space (zerod/errors.h). Every error comes
 * back as a zd__err_t whose message names the address, the method and what went wrong. The
 * process's mutual-TLS identity lives here too, so that every channel and server uses it.
 */
#ifndef ZD_COMMON_GRPC_UNARY_H
#define ZD_COMMON_GRPC_UNARY_H

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <protobuf-c/protobuf-c.h>
#include <stddef.h>

#include "error.h"

/* Largest message either end sends or accepts. Status of a node is a few kB per rank and
 * rendezvous values (a Gloo address, NCCL's 128-byte id) are small: 8 MiB leaves room for a
 * large world without letting one bad peer allocate much. */
#define ZD__GRPC_MAX_MESSAGE (8u << 20)

/* Call flags. */
enum {
  /* Queue the call until the channel connects (or the deadline passes) instead of failing at
   * once when the server is not up yet: for peers that start before rank 0's node. */
  ZD__GRPC_WAIT_FOR_READY = 1,
};

/* ---- mutual TLS --------------------------------------------------------------------------------
 * A process has one TLS identity (a zerod node's tls_cert, tls_key and tls_ca; zeroctl's
 * --tls-cert, --tls-key and --tls-ca): once it is loaded, every channel the process opens and
 * every server it starts use it. One identity per process rather than one per channel because
 * every channel of a node speaks for the node, and because channels are opened late (a rank's
 * rendezvous client, a checkpoint's, the heartbeat's) by code that outlives the control service
 * which read the settings. */

/* The three PEM files, and what the user calls them, for messages ("tls_cert" or "--tls-cert"). */
typedef struct zd__grpc_tls_files {
  const char *cert, *key, *ca; /* NULL or "": not set */
  const char *cert_name, *key_name, *ca_name;
} zd__grpc_tls_files_t;

/* Reads and checks the three files and makes them this process's identity; does nothing when
 * none is set. All three or none: a partial set is an error. Checked now: each file is readable,
 * not over 1 MiB and PEM of the right kind (certificates, a private key), and the key is
 * readable by no one but its owner and group (as control_token_file). Whether the key belongs
 * to the certificate, and whether the CA signed it, gRPC finds when a server or channel first
 * uses them. Call at start, before any channel is opened or thread started: not thread-safe
 * against itself or zd__grpc_channel_open(). The identity is held until the process exits.
 * Errors: -errno (a file that cannot be opened or read), ZD_ECONFIG, -ENOMEM; the message names
 * the setting and the path. */
int zd__grpc_tls_load(const zd__grpc_tls_files_t *files, zd__err_t *err);

/* Re-reads the files of the identity loaded at start (zerod's SIGHUP: certificates rotated in
 * place) and, when they differ, makes them the identity: servers present the new certificate and
 * check clients against the new CA from their next handshake, and channels opened from now on
 * use them; connections already made keep theirs. Checked first, beyond zd__grpc_tls_load's
 * checks: each PEM parses and the key is the certificate's; on any error the identity is left
 * as it was. *changed says whether it was replaced. Nothing to do (ZD_OK) without an identity.
 * Thread-safe. Errors: as zd__grpc_tls_load, and ZD_ECONFIG naming the file that is wrong. */
int zd__grpc_tls_reload(const zd__grpc_tls_files_t *files, int *changed, zd__err_t *err);

/* Whether a TLS identity is loaded. Thread-safe. */
int zd__grpc_tls_enabled(void);

/* Server credentials for this process's identity: SSL with its certificate and key, requiring
 * every client to present a certificate that the CA signed (GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_
 * CERTIFICATE_AND_VERIFY); insecure credentials when no identity is loaded. The certificates come
 * through gRPC's certificate-config fetcher, so a zd__grpc_tls_reload reaches the server's next
 * handshake. Release with grpc_server_credentials_release(). Needs grpc_init(). NULL: out of
 * memory. */
grpc_server_credentials *zd__grpc_server_credentials(void);

/* ---- channels ----------------------------------------------------------------------------------
 */

typedef struct zd__grpc_channel zd__grpc_channel_t;

/* Opens a channel to address ("host:port" or "unix:/path"); takes a grpc_init() reference that
 * zd__grpc_channel_close() gives back. Does not connect yet. With a TLS identity loaded
 * (zd__grpc_tls_load) the channel is SSL: it trusts only the identity's CA, presents the
 * identity's certificate, and checks that the server's certificate names the host of address
 * (a subjectAltName DNS name or IP address; "localhost" for a unix: address). Errors: -EINVAL
 * (empty address), -ENOMEM. Thread-safe. */
int zd__grpc_channel_open(const char *address, zd__grpc_channel_t **out, zd__err_t *err);

/* Closes the channel; no call may be in progress on it. Accepts NULL. */
void zd__grpc_channel_close(zd__grpc_channel_t *ch);

/* The address the channel was opened with. */
const char *zd__grpc_channel_address(const zd__grpc_channel_t *ch);

/* The metadata key of the control token ("authorization: Bearer <token>"). */
#define ZD__GRPC_AUTH_KEY "authorization"

/* Sends "authorization: Bearer <token>" with every later call on the channel (NULL or "": none),
 * for the control service's calls that need the token (control_token_file). Not while a call is in
 * progress. Errors: -ENOMEM. */
int zd__grpc_channel_set_token(zd__grpc_channel_t *ch, const char *token);

/* Whether the channel is connected now (does not try to connect). */
int zd__grpc_channel_ready(zd__grpc_channel_t *ch);

/* One blocking unary call of method ("/package.Service/Method") with the bytes req[0..len) as the
 * request. Returns within about timeout_ms (> 0). On success *reply is the reply payload
 * (malloc'd; free() it, may be NULL with *reply_len 0 for an empty message).
 * *grpc_status (may be NULL) receives the gRPC status code, GRPC_STATUS_OK on success, so callers
 * can tell NOT_FOUND from FAILED_PRECONDITION; the return value is the same outcome in zerod's
 * error space (zd__grpc_code_of) and err carries "<what> at <address>: <server's message>".
 * Thread-safe for distinct calls on one channel. */
int zd__grpc_call_raw(zd__grpc_channel_t *ch, const char *method, const void *req, size_t len,
                      void **reply, size_t *reply_len, int timeout_ms, unsigned flags,
                      int *grpc_status, zd__err_t *err);

/* The same with protobuf-c messages: packs req, unpacks the reply as reply_desc into *reply (free
 * it with protobuf_c_message_free_unpacked(*reply, NULL)). A reply that does not decode is
 * ZD_EPROTO. */
int zd__grpc_call(zd__grpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                  const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply,
                  int timeout_ms, unsigned flags, int *grpc_status, zd__err_t *err);

/* Packs msg into a new byte buffer (grpc_byte_buffer_destroy() it). Like every gRPC allocation,
 * it aborts when out of memory. */
grpc_byte_buffer *zd__grpc_pack(const ProtobufCMessage *msg);

/* Copies a received byte buffer into one malloc'd block (*data, NULL for an empty buffer).
 * Returns 0 or -ENOMEM. */
int zd__grpc_read(grpc_byte_buffer *bb, void **data, size_t *len);

/* zerod's error code for a gRPC status, and the gRPC status for a zerod error code. */
int zd__grpc_code_of(grpc_status_code status);
grpc_status_code zd__grpc_status_of(int code);

/* "UNAVAILABLE", "NOT_FOUND", ... ("UNKNOWN_STATUS" for values outside the enum). */
const char *zd__grpc_status_name(grpc_status_code status);

#endif /* ZD_COMMON_GRPC_UNARY_H */
