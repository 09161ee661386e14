/* Blocking unary gRPC calls and the payload and status helpers the server shares (grpc_unary.h).
 *
 * A call is one batch (send metadata, message and close; receive metadata, message and status)
 * on a pluck completion queue of its own, plucked until it completes. The call's deadline bounds
 * the wait, so the pluck itself needs none. Channels reconnect quickly (100 ms to 1 s backoff,
 * not gRPC's default of 1 s growing to 2 minutes): a peer waiting for rank 0's node to come up
 * must see it within a second, not at the next step of a long backoff.
 *
 * The TLS identity can be replaced while the process runs (zd__grpc_tls_reload, on zerod's
 * SIGHUP): servers get their certificates through gRPC's certificate-config fetcher, which gRPC
 * asks at each new handshake, and each new channel builds its credentials from the identity of
 * the moment; connections already made keep theirs.
 */
#include "grpc_unary.h"

#include <errno.h>
#include <fcntl.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tsan.h"

#define PEM_MAX (1u << 20) /* a CA bundle is a few hundred kB at most */

/* A server's view of the identity: the generation it was last given by the fetcher. Kept in a list
 * for the process's life (a server's credentials have no destroy hook to free it by). */
typedef struct served {
  uint64_t generation;
  struct served *next;
} served_t;

/* The process's TLS identity (zd__grpc_tls_load, zd__grpc_tls_reload): PEM text, NULL while none
 * is loaded. Loaded at start before any thread reads it; replaced under `lock`, which every
 * reader after the start takes (gRPC's handshake threads through the fetcher, channel opens). */
static struct {
  pthread_mutex_t lock;
  char *cert, *key, *ca;
  uint64_t generation; /* bumped by every replacement */
  served_t *servers;
  char cert_name[32], key_name[32]; /* for messages */
} tls = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* Reads one PEM file into a NUL-terminated string that must contain marker. A secret (a private
 * key) must not be readable by others. */
static int read_pem(const char *path, const char *name, const char *marker, int secret, char **out,
                    zd__err_t *err) {
  *out = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return zd__errf(err, -errno, "%s %s: %s", name, path, strerror(errno));
  struct stat st;
  char *text = NULL;
  int rc = ZD_OK;
  if (fstat(fd, &st) != 0) {
    rc = zd__errf(err, -errno, "%s %s: %s", name, path, strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    rc = zd__errf(err, ZD_ECONFIG, "%s %s is not a regular file", name, path);
  } else if (st.st_size == 0 || (uint64_t)st.st_size > PEM_MAX) {
    rc = zd__errf(err, ZD_ECONFIG, "%s %s has %lld bytes; a PEM file has 1 to %u", name, path,
                  (long long)st.st_size, PEM_MAX);
  } else if (secret && (st.st_mode & 027)) {
    rc = zd__errf(err, ZD_ECONFIG,
                  "%s %s has mode %04o; a private key must have no access for others and no "
                  "write for the group (chmod 600, or 640 for a Kubernetes secret's fsGroup)",
                  name, path, (unsigned)(st.st_mode & 07777));
  } else if (!(text = malloc((size_t)st.st_size + 1))) {
    rc = zd__errf(err, -ENOMEM, "out of memory reading %s %s", name, path);
  }
  size_t n = 0;
  while (!rc && n < (size_t)st.st_size) {
    ssize_t got = read(fd, text + n, (size_t)st.st_size - n);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) rc = zd__errf(err, -errno, "%s %s: %s", name, path, strerror(errno));
    if (got <= 0) break;
    n += (size_t)got;
  }
  close(fd);
  if (!rc) {
    text[n] = '\0';
    /* Enough to catch a swapped, truncated or encrypted file with a message naming it, rather
     * than gRPC's later "invalid private key"; the full parse is OpenSSL's. */
    if (secret && strstr(text, "ENCRYPTED PRIVATE KEY"))
      rc = zd__errf(err, ZD_ECONFIG,
                    "%s %s is encrypted; gRPC needs a key without a passphrase (openssl pkey -in "
                    "KEY -out PLAIN)",
                    name, path);
    else if (!strstr(text, "-----BEGIN ") || !strstr(text, marker))
      rc = zd__errf(err, ZD_ECONFIG, "%s %s is not a PEM file holding %s", name, path,
                    secret ? "a private key" : "certificates");
  }
  if (rc) {
    free(text);
    return rc;
  }
  *out = text;
  return ZD_OK;
}

int zd__grpc_tls_load(const zd__grpc_tls_files_t *f, zd__err_t *err) {
  int have_cert = f->cert && f->cert[0], have_key = f->key && f->key[0],
      have_ca = f->ca && f->ca[0];
  if (!have_cert && !have_key && !have_ca) return ZD_OK;
  if (!have_cert || !have_key || !have_ca)
    return zd__errf(err, ZD_ECONFIG,
                    "%s, %s and %s go together (mutual TLS needs this node's certificate, its "
                    "key and the CA that signs every member's); %s is not set",
                    f->cert_name, f->key_name, f->ca_name,
                    !have_cert  ? f->cert_name
                    : !have_key ? f->key_name
                                : f->ca_name);
  char *cert = NULL, *key = NULL, *ca = NULL;
  int rc = read_pem(f->cert, f->cert_name, "-----BEGIN CERTIFICATE-----", 0, &cert, err);
  if (!rc) rc = read_pem(f->key, f->key_name, "PRIVATE KEY-----", 1, &key, err);
  if (!rc) rc = read_pem(f->ca, f->ca_name, "-----BEGIN CERTIFICATE-----", 0, &ca, err);
  if (rc) {
    free(cert);
    free(key);
    free(ca);
    return rc;
  }
  pthread_mutex_lock(&tls.lock);
  free(tls.cert);
  free(tls.key);
  free(tls.ca);
  tls.cert = cert;
  tls.key = key;
  tls.ca = ca;
  tls.generation++;
  snprintf(tls.cert_name, sizeof tls.cert_name, "%s", f->cert_name);
  snprintf(tls.key_name, sizeof tls.key_name, "%s", f->key_name);
  pthread_mutex_unlock(&tls.lock);
  return ZD_OK;
}

/* What OpenSSL says of a file that does not hold what it should, for the caller's message. */
static void ssl_reason(char *buf, size_t len) {
  unsigned long e = ERR_peek_last_error();
  if (e)
    ERR_error_string_n(e, buf, len);
  else
    snprintf(buf, len, "no PEM block of the right kind");
  ERR_clear_error();
}

/* What gRPC finds only at a handshake, checked before a replacement is accepted: every PEM
 * parses, and the key is the certificate's. */
static int check_pair(const char *cert, const char *key, const char *ca,
                      const zd__grpc_tls_files_t *f, zd__err_t *err) {
  char why[256];
  int rc = ZD_OK;
  BIO *b = BIO_new_mem_buf(cert, -1);
  X509 *x = b ? PEM_read_bio_X509(b, NULL, NULL, NULL) : NULL;
  BIO_free(b);
  b = BIO_new_mem_buf(key, -1);
  EVP_PKEY *k = b ? PEM_read_bio_PrivateKey(b, NULL, NULL, NULL) : NULL;
  BIO_free(b);
  b = BIO_new_mem_buf(ca, -1);
  X509 *c = b ? PEM_read_bio_X509(b, NULL, NULL, NULL) : NULL;
  BIO_free(b);
  if (!x) {
    ssl_reason(why, sizeof why);
    rc = zd__errf(err, ZD_ECONFIG, "%s %s: no certificate parses (%s)", f->cert_name, f->cert, why);
  } else if (!k) {
    ssl_reason(why, sizeof why);
    rc = zd__errf(err, ZD_ECONFIG, "%s %s: no private key parses (%s)", f->key_name, f->key, why);
  } else if (!c) {
    ssl_reason(why, sizeof why);
    rc = zd__errf(err, ZD_ECONFIG, "%s %s: no certificate parses (%s)", f->ca_name, f->ca, why);
  } else if (X509_check_private_key(x, k) != 1) {
    ERR_clear_error();
    rc = zd__errf(err, ZD_ECONFIG, "%s %s is not the private key of %s %s", f->key_name, f->key,
                  f->cert_name, f->cert);
  }
  X509_free(x);
  EVP_PKEY_free(k);
  X509_free(c);
  return rc;
}

int zd__grpc_tls_reload(const zd__grpc_tls_files_t *f, int *changed, zd__err_t *err) {
  *changed = 0;
  if (!zd__grpc_tls_enabled()) return ZD_OK;
  char *cert = NULL, *key = NULL, *ca = NULL;
  int rc = read_pem(f->cert, f->cert_name, "-----BEGIN CERTIFICATE-----", 0, &cert, err);
  if (!rc) rc = read_pem(f->key, f->key_name, "PRIVATE KEY-----", 1, &key, err);
  if (!rc) rc = read_pem(f->ca, f->ca_name, "-----BEGIN CERTIFICATE-----", 0, &ca, err);
  if (!rc) rc = check_pair(cert, key, ca, f, err);
  if (!rc) {
    pthread_mutex_lock(&tls.lock);
    if (strcmp(cert, tls.cert) != 0 || strcmp(key, tls.key) != 0 || strcmp(ca, tls.ca) != 0) {
      char *old[3] = {tls.cert, tls.key, tls.ca};
      tls.cert = cert;
      tls.key = key;
      tls.ca = ca;
      cert = old[0];
      key = old[1];
      ca = old[2];
      tls.generation++;
      *changed = 1;
    }
    pthread_mutex_unlock(&tls.lock);
  }
  free(cert);
  free(key);
  free(ca);
  return rc;
}

int zd__grpc_tls_enabled(void) {
  pthread_mutex_lock(&tls.lock);
  int on = tls.cert != NULL;
  pthread_mutex_unlock(&tls.lock);
  return on;
}

/* gRPC's certificate-config fetcher, on its handshake threads: the identity when this server has
 * not had the current one yet (always, the first time, while the server is set up). */
static grpc_ssl_certificate_config_reload_status fetch_config(
    void *arg, grpc_ssl_server_certificate_config **config) {
  served_t *sv = arg;
  grpc_ssl_certificate_config_reload_status st = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
  pthread_mutex_lock(&tls.lock);
  if (sv->generation != tls.generation) {
    grpc_ssl_pem_key_cert_pair pair = {.private_key = tls.key, .cert_chain = tls.cert};
    *config = grpc_ssl_server_certificate_config_create(tls.ca, &pair, 1); /* copies them */
    sv->generation = tls.generation;
    st = *config ? GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW : GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_FAIL;
  }
  pthread_mutex_unlock(&tls.lock);
  return st;
}

grpc_server_credentials *zd__grpc_server_credentials(void) {
  if (!zd__grpc_tls_enabled()) return grpc_insecure_server_credentials_create();
  served_t *sv = calloc(1, sizeof *sv);
  if (!sv) return NULL;
  pthread_mutex_lock(&tls.lock);
  sv->next = tls.servers;
  tls.servers = sv;
  pthread_mutex_unlock(&tls.lock);
  grpc_ssl_server_credentials_options *opt =
      grpc_ssl_server_credentials_create_options_using_config_fetcher(
          GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY, fetch_config, sv);
  return grpc_ssl_server_credentials_create_with_options(opt); /* takes opt */
}

/* The channel's credentials: this process's identity at this moment, or none. A unix: address
 * gets none: zerod checks who connects there by the socket's peer credentials, not TLS. */
static grpc_channel_credentials *channel_credentials(const char *address) {
  pthread_mutex_lock(&tls.lock);
  grpc_channel_credentials *creds;
  if (!tls.cert || !strncmp(address, "unix:", 5)) {
    creds = grpc_insecure_credentials_create();
  } else {
    grpc_ssl_pem_key_cert_pair pair = {.private_key = tls.key, .cert_chain = tls.cert};
    creds = grpc_ssl_credentials_create_ex(tls.ca, &pair, NULL, NULL); /* copies them */
  }
  pthread_mutex_unlock(&tls.lock);
  return creds;
}

struct zd__grpc_channel {
  grpc_channel *channel;
  char *address;
  char *authorization; /* "Bearer <token>" sent with every call; NULL: none */
};

int zd__grpc_channel_open(const char *address, zd__grpc_channel_t **out, zd__err_t *err) {
  *out = NULL;
  if (!address || !address[0])
    return zd__errf(err, -EINVAL,
                    "empty control service address; expected host:port or "
                    "unix:/path");
  zd__grpc_channel_t *ch = calloc(1, sizeof *ch);
  if (!ch || !(ch->address = strdup(address))) {
    free(ch);
    return zd__errf(err, -ENOMEM, "out of memory opening a channel to %s", address);
  }
  grpc_init();
  grpc_arg args[] = {
      {.type = GRPC_ARG_INTEGER,
       .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
       .value.integer = (int)ZD__GRPC_MAX_MESSAGE},
      {.type = GRPC_ARG_INTEGER,
       .key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
       .value.integer = (int)ZD__GRPC_MAX_MESSAGE},
      /* Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC also takes it as the time a connection
       * attempt may take (default 20 s), and 100 ms fails handshakes on a loaded machine. */
      {.type = GRPC_ARG_INTEGER,
       .key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
       .value.integer = 100},
      {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, .value.integer = 1000},
  };
  grpc_channel_args chargs = {.num_args = sizeof args / sizeof args[0], .args = args};
  grpc_channel_credentials *creds = channel_credentials(address);
  ch->channel = grpc_channel_create(address, creds, &chargs);
  grpc_channel_credentials_release(creds);
  /* grpc_channel_create never returns NULL: a bad target gives a "lame" channel whose calls
   * fail with a message naming the target, which is the error the caller should see anyway. */
  *out = ch;
  return ZD_OK;
}

void zd__grpc_channel_close(zd__grpc_channel_t *ch) {
  if (!ch) return;
  grpc_channel_destroy(ch->channel);
  free(ch->address);
  free(ch->authorization);
  free(ch);
  grpc_shutdown();
}

int zd__grpc_channel_set_token(zd__grpc_channel_t *ch, const char *token) {
  free(ch->authorization);
  ch->authorization = NULL;
  if (!token || !token[0]) return ZD_OK;
  size_t n = strlen(token) + sizeof "Bearer ";
  if (!(ch->authorization = malloc(n))) return -ENOMEM;
  snprintf(ch->authorization, n, "Bearer %s", token);
  return ZD_OK;
}

const char *zd__grpc_channel_address(const zd__grpc_channel_t *ch) {
  return ch->address;
}

int zd__grpc_channel_ready(zd__grpc_channel_t *ch) {
  return grpc_channel_check_connectivity_state(ch->channel, 0) == GRPC_CHANNEL_READY;
}

grpc_byte_buffer *zd__grpc_pack(const ProtobufCMessage *msg) {
  size_t len = protobuf_c_message_get_packed_size(msg);
  grpc_slice slice = grpc_slice_malloc(len);
  protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(slice));
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&slice, 1);
  grpc_slice_unref(slice);
  return bb;
}

int zd__grpc_read(grpc_byte_buffer *bb, void **data, size_t *len) {
  *data = NULL;
  *len = 0;
  if (!bb) return 0;
  /* A received message: gRPC may have filled it in on another of its threads (zd__grpc_call_raw) */
  ZD_TSAN_IGNORE_BEGIN();
  grpc_byte_buffer_reader reader;
  int ok = grpc_byte_buffer_reader_init(&reader, bb);
  grpc_slice slice = ok ? grpc_byte_buffer_reader_readall(&reader) : grpc_empty_slice();
  if (ok) grpc_byte_buffer_reader_destroy(&reader);
  ZD_TSAN_IGNORE_END();
  if (!ok) return -ENOMEM;
  int rc = 0;
  size_t n = GRPC_SLICE_LENGTH(slice);
  if (n > 0) {
    *data = malloc(n);
    if (*data) {
      memcpy(*data, GRPC_SLICE_START_PTR(slice), n);
      *len = n;
    } else {
      rc = -ENOMEM;
    }
  }
  grpc_slice_unref(slice);
  return rc;
}

const char *zd__grpc_status_name(grpc_status_code status) {
  static const char *const names[] = {
      "OK",
      "CANCELLED",
      "UNKNOWN",
      "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED",
      "NOT_FOUND",
      "ALREADY_EXISTS",
      "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED",
      "FAILED_PRECONDITION",
      "ABORTED",
      "OUT_OF_RANGE",
      "UNIMPLEMENTED",
      "INTERNAL",
      "UNAVAILABLE",
      "DATA_LOSS",
      "UNAUTHENTICATED",
  }; /* indexed by the code, as grpc/status.h numbers them */
  if ((unsigned)status < sizeof names / sizeof names[0]) return names[status];
  return "UNKNOWN_STATUS";
}

int zd__grpc_code_of(grpc_status_code status) {
  switch (status) {
    case GRPC_STATUS_OK:
      return ZD_OK;
    case GRPC_STATUS_CANCELLED:
    case GRPC_STATUS_ABORTED:
      return ZD_ECLOSED;
    case GRPC_STATUS_INVALID_ARGUMENT:
      return -EINVAL;
    case GRPC_STATUS_DEADLINE_EXCEEDED:
      return -ETIMEDOUT;
    case GRPC_STATUS_NOT_FOUND:
      return -ENOENT;
    case GRPC_STATUS_ALREADY_EXISTS:
      return -EEXIST;
    case GRPC_STATUS_PERMISSION_DENIED:
    case GRPC_STATUS_UNAUTHENTICATED:
      return ZD_EDENIED;
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
      return ZD_ETOOBIG;
    case GRPC_STATUS_FAILED_PRECONDITION:
      return ZD_EORDER;
    case GRPC_STATUS_OUT_OF_RANGE:
      return -ERANGE;
    case GRPC_STATUS_UNIMPLEMENTED:
      return ZD_ETYPE;
    case GRPC_STATUS_UNAVAILABLE:
      return ZD_EPEER;
    default:
      return ZD_EINTERNAL;
  }
}

grpc_status_code zd__grpc_status_of(int code) {
  switch (code) {
    case ZD_OK:
      return GRPC_STATUS_OK;
    case -EINVAL:
    case ZD_EPROTO:
      return GRPC_STATUS_INVALID_ARGUMENT;
    case -ETIMEDOUT:
      return GRPC_STATUS_DEADLINE_EXCEEDED;
    case -ENOENT:
      return GRPC_STATUS_NOT_FOUND;
    case -EEXIST:
      return GRPC_STATUS_ALREADY_EXISTS;
    case ZD_EDENIED:
      return GRPC_STATUS_PERMISSION_DENIED;
    case -ENOMEM:
    case -ENOSPC:
    case ZD_ETOOBIG:
      return GRPC_STATUS_RESOURCE_EXHAUSTED;
    case ZD_EORDER:
    case ZD_ECONFIG:
      return GRPC_STATUS_FAILED_PRECONDITION;
    case -ERANGE:
      return GRPC_STATUS_OUT_OF_RANGE;
    case ZD_ETYPE:
    case -ENOSYS:
      return GRPC_STATUS_UNIMPLEMENTED;
    case ZD_ESHUTDOWN:
    case ZD_EPEER:
      return GRPC_STATUS_UNAVAILABLE;
    case ZD_ECLOSED:
      return GRPC_STATUS_CANCELLED;
    default:
      return GRPC_STATUS_INTERNAL;
  }
}

static const char *connectivity_name(grpc_connectivity_state s) {
  switch (s) {
    case GRPC_CHANNEL_IDLE:
      return "idle";
    case GRPC_CHANNEL_CONNECTING:
      return "still connecting";
    case GRPC_CHANNEL_READY:
      return "connected";
    case GRPC_CHANNEL_TRANSIENT_FAILURE:
      return "connection failing";
    case GRPC_CHANNEL_SHUTDOWN:
      return "channel shut down";
  }
  return "unknown state";
}

/* The message of a failed call: where, what, and the server's or the transport's words. */
static int call_error(zd__grpc_channel_t *ch, const char *method, grpc_status_code status,
                      const char *details, int timeout_ms, zd__err_t *err) {
  int code = zd__grpc_code_of(status);
  const char *slash = strrchr(method, '/');
  const char *name = slash ? slash + 1 : method;
  /* gRPC cannot make a TLS connection from a key that is not the certificate's; it logs "Invalid
   * private key" and the call sees no address to connect to. */
  if (status == GRPC_STATUS_UNAVAILABLE && strstr(details, "empty address list") &&
      zd__grpc_tls_enabled()) /* under the lock: SIGHUP swaps the PEMs (the names stay) */
    return zd__errf(err, code,
                    "cannot connect to %s: gRPC refused this process's TLS identity (is %s the "
                    "key of %s?)",
                    ch->address, tls.key_name, tls.cert_name);
  /* zerod closes a unix: connection from a process it does not admit at once. */
  if (status == GRPC_STATUS_UNAVAILABLE && !strncmp(ch->address, "unix:", 5) &&
      (strstr(details, "Socket closed") || strstr(details, "Broken pipe") ||
       strstr(details, "Connection reset")))
    return zd__errf(err, code,
                    "cannot reach zerod control service at %s: %s (zerod admits only the users "
                    "and groups of its allowed_uids and allowed_gids there; this process is uid "
                    "%d)",
                    ch->address, details, (int)getuid());
  /* A TLS server closes a plaintext connection at once, which is all gRPC reports. */
  if (status == GRPC_STATUS_UNAVAILABLE && strstr(details, "Socket closed") &&
      !zd__grpc_tls_enabled())
    return zd__errf(err, code,
                    "cannot reach zerod control service at %s: %s (a zerod with mutual TLS, "
                    "tls_cert, closes connections that bring no client certificate)",
                    ch->address, details);
  if (status == GRPC_STATUS_UNAVAILABLE)
    return zd__errf(err, code, "cannot reach zerod control service at %s: %s", ch->address,
                    details[0] ? details : "unavailable");
  if (status == GRPC_STATUS_DEADLINE_EXCEEDED) {
    grpc_connectivity_state s = grpc_channel_check_connectivity_state(ch->channel, 0);
    if (s != GRPC_CHANNEL_READY)
      return zd__errf(err, code, "cannot reach zerod control service at %s within %d ms (%s)",
                      ch->address, timeout_ms, connectivity_name(s));
    return zd__errf(err, code, "%s at %s: no reply within %d ms", name, ch->address, timeout_ms);
  }
  return zd__errf(err, code, "%s at %s: %s: %s", name, ch->address, zd__grpc_status_name(status),
                  details[0] ? details : "(no message)");
}

int zd__grpc_call_raw(zd__grpc_channel_t *ch, const char *method, const void *req, size_t len,
                      void **reply, size_t *reply_len, int timeout_ms, unsigned flags,
                      int *grpc_status, zd__err_t *err) {
  grpc_metadata_array initial_md, trailing_md;
  grpc_byte_buffer *send = NULL, *recv = NULL;
  grpc_slice details = grpc_empty_slice();
  const char *error_string = NULL;
  grpc_status_code status = GRPC_STATUS_UNKNOWN;
  grpc_call *call = NULL;
  int rc;

  *reply = NULL;
  *reply_len = 0;
  if (grpc_status) *grpc_status = GRPC_STATUS_UNKNOWN;
  grpc_metadata_array_init(&initial_md);
  grpc_metadata_array_init(&trailing_md);
  grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
  gpr_timespec deadline =
      gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                   gpr_time_from_millis(timeout_ms > 0 ? timeout_ms : 1, GPR_TIMESPAN));
  call = grpc_channel_create_call(ch->channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                  grpc_slice_from_static_string(method), NULL, deadline, NULL);
  if (!call) {
    rc = zd__errf(err, ZD_EINTERNAL, "cannot create a call of %s on the channel to %s", method,
                  ch->address);
    goto exit;
  }
  grpc_slice payload = grpc_slice_malloc(len);
  if (len) memcpy(GRPC_SLICE_START_PTR(payload), req, len);
  send = grpc_raw_byte_buffer_create(&payload, 1);
  grpc_slice_unref(payload);

  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (flags & ZD__GRPC_WAIT_FOR_READY) ops[0].flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY;
  grpc_metadata auth;
  if (ch->authorization) {
    memset(&auth, 0, sizeof auth);
    auth.key = grpc_slice_from_static_string(ZD__GRPC_AUTH_KEY);
    auth.value = grpc_slice_from_static_string(ch->authorization);
    ops[0].data.send_initial_metadata.count = 1;
    ops[0].data.send_initial_metadata.metadata = &auth;
  }
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = send;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &initial_md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &recv;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &trailing_md;
  ops[5].data.recv_status_on_client.status = &status;
  ops[5].data.recv_status_on_client.status_details = &details;
  ops[5].data.recv_status_on_client.error_string = &error_string;
  grpc_call_error ce = grpc_call_start_batch(call, ops, 6, call, NULL);
  if (ce != GRPC_CALL_OK) {
    rc = zd__errf(err, ZD_EINTERNAL, "cannot start %s on the channel to %s (grpc_call_error %d)",
                  method, ch->address, (int)ce);
    goto exit;
  }
  /* The call's deadline guarantees this completes. */
  grpc_event ev = grpc_completion_queue_pluck(cq, call, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  if (ev.type != GRPC_OP_COMPLETE || !ev.success) {
    rc = zd__errf(err, ZD_EINTERNAL, "%s to %s: the call batch failed", method, ch->address);
    goto exit;
  }
  if (grpc_status) *grpc_status = status;
  if (status != GRPC_STATUS_OK) {
    char msg[ZD__ERR_MSG_MAX];
    ZD_TSAN_IGNORE_BEGIN(); /* gRPC's, as what the exit frees */
    size_t n = GRPC_SLICE_LENGTH(details);
    if (n >= sizeof msg) n = sizeof msg - 1;
    memcpy(msg, GRPC_SLICE_START_PTR(details), n);
    ZD_TSAN_IGNORE_END();
    msg[n] = '\0';
    rc = call_error(ch, method, status, msg, timeout_ms, err);
    goto exit;
  }
  rc = zd__grpc_read(recv, reply, reply_len);
  if (rc) zd__errf(err, rc, "out of memory reading the reply of %s from %s", method, ch->address);

exit:
  /* What gRPC allocated for the call may have been written by whichever thread completed it (one
   * plucking another queue does other calls' work) and reached this one through the queue. */
  ZD_TSAN_IGNORE_BEGIN();
  if (call) grpc_call_unref(call);
  grpc_completion_queue_shutdown(cq);
  grpc_completion_queue_destroy(cq);
  if (send) grpc_byte_buffer_destroy(send);
  if (recv) grpc_byte_buffer_destroy(recv);
  grpc_slice_unref(details);
  gpr_free((void *)error_string);
  grpc_metadata_array_destroy(&initial_md);
  grpc_metadata_array_destroy(&trailing_md);
  ZD_TSAN_IGNORE_END();
  return rc;
}

int zd__grpc_call(zd__grpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                  const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply,
                  int timeout_ms, unsigned flags, int *grpc_status, zd__err_t *err) {
  *reply = NULL;
  size_t len = protobuf_c_message_get_packed_size(req);
  uint8_t *buf = malloc(len ? len : 1);
  void *out = NULL;
  size_t out_len = 0;
  int rc;
  if (!buf) {
    rc = zd__errf(err, -ENOMEM, "out of memory packing a %zu-byte request", len);
    goto exit;
  }
  protobuf_c_message_pack(req, buf);
  rc = zd__grpc_call_raw(ch, method, buf, len, &out, &out_len, timeout_ms, flags, grpc_status, err);
  if (rc) goto exit;
  *reply = protobuf_c_message_unpack(reply_desc, NULL, out_len, out);
  if (!*reply)
    rc = zd__errf(err, ZD_EPROTO, "%s at %s: the %zu-byte reply is not a valid %s", method,
                  ch->address, out_len, reply_desc->name);
exit:
  free(out);
  free(buf);
  return rc;
}
