/* Rendezvous client (rendezvous.h): KvSet, KvGet and KvWait of rank 0's control service as
 * blocking calls with one overall deadline, or the same operations on etcd (etcd.h).
 *
 * Peers start in any order, so every call waits for the channel to connect (WAIT_FOR_READY), and
 * an UNAVAILABLE answer (rank 0's zerod restarting or shutting down) is retried until the
 * deadline rather than failing the whole world's start-up. Everything else is final.
 *
 * On etcd the store's rules are kept: a key is written once (a Txn that puts only if the key has
 * no create revision, else reads it back: the same value is a retry, another is -EEXIST), and a
 * wait polls the keys (one Txn of counting ranges) with a backoff from 2 to 100 ms until they all
 * exist or the timeout passes; an etcd that cannot be reached meanwhile is waited for like a key.
 */
#include "clock.h"
#include "rendezvous.h"

#define GET_MIN_MS 1000 /* a get after a successful wait has at least this long */

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "control.pb-c.h"
#include "etcd.h"
#include "grpc_unary.h"

#define RETRY_MS 100 /* pause between attempts while the store answers UNAVAILABLE */
#define WAIT_SLACK_MS                                                                             \
  100                        /* on a connected channel, a KvWait's call outlives its server-side  \
                                wait by this much, so the "still missing" answer beats the call's \
                                deadline */
#define MAX_KEY_BYTES   1024 /* as the server enforces */
#define MAX_VALUE_BYTES (1u << 20) /* as the built-in store enforces (kvstore.h), on etcd too */
#define POLL_MIN_MS     2          /* an etcd wait's first pause between looks */
#define POLL_MAX_MS     100        /* and its longest */

struct zd__rdv {
  zd__grpc_channel_t *ch; /* the built-in store (rank 0's control service), or */
  zd__etcd_t *etcd;       /* etcd */
};

static const char *rdv_address(const zd__rdv_t *rdv) {
  return rdv->etcd ? zd__etcd_url(rdv->etcd) : zd__grpc_channel_address(rdv->ch);
}

static void sleep_ms(int64_t ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

int zd__rdv_open(const char *address, zd__rdv_t **out, zd__err_t *err) {
  *out = NULL;
  zd__rdv_t *rdv = calloc(1, sizeof *rdv);
  if (!rdv) return zd__errf(err, -ENOMEM, "out of memory opening the rendezvous client");
  int rc = zd__etcd_is_url(address) ? zd__etcd_open(address, &rdv->etcd, err)
                                    : zd__grpc_channel_open(address, &rdv->ch, err);
  if (rc) {
    free(rdv);
    return rc;
  }
  *out = rdv;
  return ZD_OK;
}

int zd__rdv_set_token(zd__rdv_t *rdv, const char *token, zd__err_t *err) {
  if (rdv->etcd) return ZD_OK; /* the control token is zerod's secret: never sent to etcd */
  if (zd__grpc_channel_set_token(rdv->ch, token))
    return zd__errf(err, -ENOMEM, "out of memory for the control token");
  return ZD_OK;
}

void zd__rdv_close(zd__rdv_t *rdv) {
  if (!rdv) return;
  zd__grpc_channel_close(rdv->ch);
  zd__etcd_close(rdv->etcd);
  free(rdv);
}

static int check_key(const zd__rdv_t *rdv, const char *key, zd__err_t *err) {
  size_t n = key ? strlen(key) : 0;
  if (n == 0 || n > MAX_KEY_BYTES)
    return zd__errf(err, -EINVAL, "rendezvous at %s: key '%.64s' is %zu bytes; keys have 1..%d",
                    rdv_address(rdv), key ? key : "", n, MAX_KEY_BYTES);
  return ZD_OK;
}

/* One call, retried while the store is unavailable, until deadline_ms (monotonic). For KvWait,
 * *wait_timeout_ms is set to the server-side wait of each attempt. what ("set 'key'") goes into
 * the message of a failure, which names the address too. */
static int call_retry(zd__rdv_t *rdv, const char *method, const char *what, ProtobufCMessage *req,
                      uint32_t *wait_timeout_ms, const ProtobufCMessageDescriptor *reply_desc,
                      ProtobufCMessage **reply, int64_t deadline_ms, zd__err_t *err) {
  zd__err_t e = {0};
  int attempts = 0, status = GRPC_STATUS_OK, rc;
  for (;;) {
    int64_t left = deadline_ms - (int64_t)zd__now_ms();
    if (left < 1) left = 1;
    /* A KvWait waits the whole time on the server. Only a connected channel gets the slack on
     * top: one still connecting cannot get the answer before the server's wait ends anyway, and
     * the caller's timeout then holds exactly. */
    int call_ms = (int)left;
    if (wait_timeout_ms) {
      *wait_timeout_ms = (uint32_t)left;
      if (zd__grpc_channel_ready(rdv->ch)) call_ms += WAIT_SLACK_MS;
    }
    rc = zd__grpc_call(rdv->ch, method, req, reply_desc, reply, call_ms, ZD__GRPC_WAIT_FOR_READY,
                       &status, &e);
    attempts++;
    if (rc != ZD_EPEER) break;
    left = deadline_ms - (int64_t)zd__now_ms();
    if (left <= 0) break;
    sleep_ms(left < RETRY_MS ? left : RETRY_MS);
  }
  if (rc == ZD_OK) return ZD_OK;
  const char *addr = zd__grpc_channel_address(rdv->ch);
  if (status == GRPC_STATUS_FAILED_PRECONDITION)
    return zd__errf(err, ZD_ECONFIG,
                    "rendezvous: cannot %s: rendezvous_address %s is not rank "
                    "0's control service: %s",
                    what, addr, e.msg);
  if (rc == ZD_EPEER)
    return zd__errf(err, rc, "rendezvous: cannot %s: %s (gave up after %d attempts)", what, e.msg,
                    attempts);
  return zd__errf(err, rc, "rendezvous: cannot %s: %s", what, e.msg);
}

/* ---- on etcd --------------------------------------------------------------------------------- */

static int etcd_set(zd__rdv_t *rdv, const char *key, const void *value, size_t len, int timeout_ms,
                    zd__err_t *err) {
  if (len > MAX_VALUE_BYTES)
    return zd__errf(err, ZD_ETOOBIG, "rendezvous %s: the value of '%s' is %zu bytes; at most %u",
                    rdv_address(rdv), key, len, MAX_VALUE_BYTES);
  void *there = NULL;
  size_t there_len = 0;
  int rc = zd__etcd_create(rdv->etcd, key, value, len, &there, &there_len, timeout_ms, err);
  if (rc || !there) return rc;
  if (there_len != len || (len && memcmp(there, value, len) != 0))
    rc = zd__errf(err, -EEXIST,
                  "rendezvous %s: '%s' is already set to another value; rendezvous keys are "
                  "written once",
                  rdv_address(rdv), key);
  free(there);
  return rc;
}

static void list_keys(char *buf, size_t cap, char *const *keys, size_t n);

/* Polls until every key exists; an etcd that does not answer is waited for until the timeout. */
static int etcd_wait(zd__rdv_t *rdv, const char *const *keys, size_t nkeys, int timeout_ms,
                     zd__err_t *err) {
  const int64_t deadline = (int64_t)zd__now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
  int64_t pause = POLL_MIN_MS;
  size_t next = 0; /* keys before it were seen: a key is never looked up again once found */
  zd__err_t last = {0};
  int rc = ZD_OK;
  for (;;) {
    int64_t left = deadline - (int64_t)zd__now_ms();
    size_t missing = 0;
    rc = zd__etcd_missing(rdv->etcd, keys + next, nkeys - next, &missing,
                          left > 100 ? (int)left : 100, &last);
    if (rc == ZD_OK) {
      next += missing;
      if (next == nkeys) return ZD_OK;
    } else if (rc != -ETIMEDOUT && rc != ZD_EPEER) {
      *err = last;
      return rc;
    }
    left = deadline - (int64_t)zd__now_ms();
    if (left <= 0) break;
    sleep_ms(pause < left ? pause : left);
    pause = pause * 2 > POLL_MAX_MS ? POLL_MAX_MS : pause * 2;
  }
  if (rc) {
    *err = last;
    return rc;
  }
  char names[256];
  list_keys(names, sizeof names, (char *const *)keys + next, nkeys - next);
  return zd__errf(err, -ETIMEDOUT, "rendezvous at %s: timed out after %d ms waiting for %s",
                  rdv_address(rdv), timeout_ms, names);
}

static int etcd_get(zd__rdv_t *rdv, const char *key, void **value, size_t *len, int timeout_ms,
                    zd__err_t *err) {
  int found = 0;
  int rc = zd__etcd_get(rdv->etcd, key, value, len, &found, timeout_ms, err);
  if (!rc && !found)
    rc = zd__errf(err, ZD_EPEER,
                  "rendezvous at %s: key '%s' vanished after it was set (deleted: a world "
                  "instance that broke?)",
                  rdv_address(rdv), key);
  return rc;
}

/* ---- either store ---------------------------------------------------------------------------- */

int zd__rdv_set(zd__rdv_t *rdv, const char *key, const void *value, size_t len, int timeout_ms,
                zd__err_t *err) {
  int rc = check_key(rdv, key, err);
  if (rc) return rc;
  if (rdv->etcd) return etcd_set(rdv, key, value, len, timeout_ms, err);
  Zerod__V1__KvSetRequest req = ZEROD__V1__KV_SET_REQUEST__INIT;
  req.key = (char *)key;
  req.value.data = (uint8_t *)value;
  req.value.len = len;
  ProtobufCMessage *reply = NULL;
  char what[MAX_KEY_BYTES + 16];
  snprintf(what, sizeof what, "set '%s'", key);
  rc = call_retry(rdv, "/zerod.v1.Control/KvSet", what, &req.base, NULL,
                  &zerod__v1__kv_set_reply__descriptor, &reply, (int64_t)zd__now_ms() + timeout_ms,
                  err);
  if (reply) protobuf_c_message_free_unpacked(reply, NULL);
  return rc;
}

static int delete_keys(zd__rdv_t *rdv, const char *key, int prefix, int timeout_ms,
                       zd__err_t *err) {
  int rc = check_key(rdv, key, err);
  if (rc) return rc;
  if (rdv->etcd) return zd__etcd_delete(rdv->etcd, key, prefix, timeout_ms, err);
  Zerod__V1__KvDeleteRequest req = ZEROD__V1__KV_DELETE_REQUEST__INIT;
  req.key = (char *)key;
  req.has_prefix = prefix;
  req.prefix = prefix;
  ProtobufCMessage *reply = NULL;
  char what[MAX_KEY_BYTES + 16];
  snprintf(what, sizeof what, "delete '%s'", key);
  rc = call_retry(rdv, "/zerod.v1.Control/KvDelete", what, &req.base, NULL,
                  &zerod__v1__kv_delete_reply__descriptor, &reply,
                  (int64_t)zd__now_ms() + timeout_ms, err);
  if (reply) protobuf_c_message_free_unpacked(reply, NULL);
  return rc;
}

int zd__rdv_delete(zd__rdv_t *rdv, const char *key, int timeout_ms, zd__err_t *err) {
  return delete_keys(rdv, key, 0, timeout_ms, err);
}

int zd__rdv_delete_prefix(zd__rdv_t *rdv, const char *prefix, int timeout_ms, zd__err_t *err) {
  return delete_keys(rdv, prefix, 1, timeout_ms, err);
}

/* Names the missing keys for a timeout message: "'a', 'b' and 3 more". */
static void list_keys(char *buf, size_t cap, char *const *keys, size_t n) {
  size_t off = 0;
  buf[0] = '\0';
  for (size_t i = 0; i < n && off < cap; i++) {
    if (i == 4 && n > 5) {
      snprintf(buf + off, cap - off, " and %zu more", n - i);
      return;
    }
    int w = snprintf(buf + off, cap - off, "%s'%s'", i ? ", " : "", keys[i]);
    if (w < 0) return;
    off += (size_t)w;
  }
}

int zd__rdv_wait(zd__rdv_t *rdv, const char *const *keys, size_t nkeys, int timeout_ms,
                 zd__err_t *err) {
  for (size_t i = 0; i < nkeys; i++) {
    int rc = check_key(rdv, keys[i], err);
    if (rc) return rc;
  }
  if (nkeys == 0) return ZD_OK;
  if (rdv->etcd) return etcd_wait(rdv, keys, nkeys, timeout_ms, err);
  Zerod__V1__KvWaitRequest req = ZEROD__V1__KV_WAIT_REQUEST__INIT;
  req.n_keys = nkeys;
  req.keys = (char **)keys;
  char names[256], what[300];
  list_keys(names, sizeof names, (char *const *)keys, nkeys);
  snprintf(what, sizeof what, "wait for %s", names);
  ProtobufCMessage *reply = NULL;
  int rc = call_retry(rdv, "/zerod.v1.Control/KvWait", what, &req.base, &req.timeout_ms,
                      &zerod__v1__kv_wait_reply__descriptor, &reply,
                      (int64_t)zd__now_ms() + timeout_ms, err);
  if (rc) goto exit;
  Zerod__V1__KvWaitReply *rep = (Zerod__V1__KvWaitReply *)reply;
  if (!rep->ok) {
    list_keys(names, sizeof names, rep->missing, rep->n_missing);
    rc = zd__errf(err, -ETIMEDOUT, "rendezvous at %s: timed out after %d ms waiting for %s",
                  rdv_address(rdv), timeout_ms, rep->n_missing ? names : "keys");
  }
exit:
  if (reply) protobuf_c_message_free_unpacked(reply, NULL);
  return rc;
}

int zd__rdv_get(zd__rdv_t *rdv, const char *key, void **value, size_t *len, int timeout_ms,
                zd__err_t *err) {
  *value = NULL;
  *len = 0;
  int rc = zd__rdv_wait(rdv, &key, 1, timeout_ms, err);
  if (rc) return rc;
  /* The key exists now: the get gets a time of its own, even if the wait used up the budget. */
  int64_t deadline = (int64_t)zd__now_ms() + (timeout_ms > GET_MIN_MS ? timeout_ms : GET_MIN_MS);
  if (rdv->etcd)
    return etcd_get(rdv, key, value, len, (int)(deadline - (int64_t)zd__now_ms()), err);
  Zerod__V1__KvGetRequest req = ZEROD__V1__KV_GET_REQUEST__INIT;
  req.key = (char *)key;
  ProtobufCMessage *reply = NULL;
  char what[MAX_KEY_BYTES + 16];
  snprintf(what, sizeof what, "get '%s'", key);
  rc = call_retry(rdv, "/zerod.v1.Control/KvGet", what, &req.base, NULL,
                  &zerod__v1__kv_get_reply__descriptor, &reply, deadline, err);
  if (rc) goto exit;
  Zerod__V1__KvGetReply *rep = (Zerod__V1__KvGetReply *)reply;
  if (!rep->found) {
    /* Keys are never deleted: the store restarted between the wait and the get. */
    rc = zd__errf(err, ZD_EPEER,
                  "rendezvous at %s: key '%s' vanished after it was set (did rank "
                  "0's zerod restart?)",
                  rdv_address(rdv), key);
    goto exit;
  }
  size_t n = rep->has_value ? rep->value.len : 0;
  *value = malloc(n ? n : 1);
  if (!*value) {
    rc = zd__errf(err, -ENOMEM, "out of memory for the %zu-byte value of '%s'", n, key);
    goto exit;
  }
  if (n) memcpy(*value, rep->value.data, n);
  *len = n;
exit:
  if (reply) protobuf_c_message_free_unpacked(reply, NULL);
  return rc;
}

int zd__rdv_lookup(zd__rdv_t *rdv, const char *key, void **value, size_t *len, int *found,
                   int timeout_ms, zd__err_t *err) {
  *value = NULL;
  *len = 0;
  *found = 0;
  int rc = check_key(rdv, key, err);
  if (rc) return rc;
  if (rdv->etcd) return zd__etcd_get(rdv->etcd, key, value, len, found, timeout_ms, err);
  Zerod__V1__KvGetRequest req = ZEROD__V1__KV_GET_REQUEST__INIT;
  req.key = (char *)key;
  ProtobufCMessage *reply = NULL;
  char what[MAX_KEY_BYTES + 16];
  snprintf(what, sizeof what, "get '%s'", key);
  rc = call_retry(rdv, "/zerod.v1.Control/KvGet", what, &req.base, NULL,
                  &zerod__v1__kv_get_reply__descriptor, &reply, (int64_t)zd__now_ms() + timeout_ms,
                  err);
  if (rc) return rc;
  Zerod__V1__KvGetReply *rep = (Zerod__V1__KvGetReply *)reply;
  size_t n = rep->found && rep->has_value ? rep->value.len : 0;
  if (rep->found && !(*value = malloc(n ? n : 1)))
    rc = zd__errf(err, -ENOMEM, "out of memory for the %zu-byte value of '%s'", n, key);
  if (!rc && rep->found) {
    if (n) memcpy(*value, rep->value.data, n);
    *len = n;
    *found = 1;
  }
  protobuf_c_message_free_unpacked(reply, NULL);
  return rc;
}

int zd__rdv_register_node(zd__rdv_t *rdv, uint32_t first_rank, uint32_t local_ranks,
                          const char *control_address, uint64_t incarnation, int timeout_ms,
                          zd__err_t *err) {
  Zerod__V1__NodeInfo info = ZEROD__V1__NODE_INFO__INIT;
  info.has_incarnation = 1;
  info.incarnation = incarnation;
  info.first_rank = first_rank;
  info.local_ranks = local_ranks;
  info.control_address = (char *)control_address;
  uint8_t *buf = malloc(protobuf_c_message_get_packed_size(&info.base) + 1);
  if (!buf) return zd__errf(err, -ENOMEM, "out of memory registering the node");
  size_t len = protobuf_c_message_pack(&info.base, buf);
  char key[32];
  snprintf(key, sizeof key, ZD__RDV_NODE_PREFIX "%u", first_rank);
  int rc = zd__rdv_set(rdv, key, buf, len, timeout_ms, err);
  if (rc == -EEXIST) { /* a restarted zerod rejoining: its entry is its own to replace */
    zd__err_t derr = {0};
    rc = zd__rdv_delete(rdv, key, timeout_ms, &derr);
    if (rc) *err = derr;
    if (!rc) rc = zd__rdv_set(rdv, key, buf, len, timeout_ms, err);
  }
  free(buf);
  return rc;
}

static int by_first_rank(const void *a, const void *b) {
  const Zerod__V1__NodeInfo *x = *(Zerod__V1__NodeInfo *const *)a;
  const Zerod__V1__NodeInfo *y = *(Zerod__V1__NodeInfo *const *)b;
  return x->first_rank < y->first_rank ? -1 : x->first_rank > y->first_rank;
}

int zd__rdv_nodes(zd__rdv_t *rdv, Zerod__V1__NodesReply **out, int timeout_ms, zd__err_t *err) {
  *out = NULL;
  if (!rdv->etcd) {
    Zerod__V1__NodesRequest req = ZEROD__V1__NODES_REQUEST__INIT;
    ProtobufCMessage *reply = NULL;
    int rc = zd__grpc_call(rdv->ch, "/zerod.v1.Control/Nodes", &req.base,
                           &zerod__v1__nodes_reply__descriptor, &reply, timeout_ms, 0, NULL, err);
    if (!rc) *out = (Zerod__V1__NodesReply *)reply;
    return rc;
  }
  /* On etcd the registry is the entries under ZD__RDV_NODE_PREFIX, read as the control service's
   * Nodes does (control.c): an entry that does not decode is left out; by first rank. */
  zd__etcd_kv_t *kvs = NULL;
  size_t n = 0;
  int rc = zd__etcd_list(rdv->etcd, ZD__RDV_NODE_PREFIX, &kvs, &n, timeout_ms, err);
  if (rc) return rc;
  Zerod__V1__NodesReply *rep = malloc(sizeof *rep);
  Zerod__V1__NodeInfo **nodes = calloc(n ? n : 1, sizeof *nodes);
  if (!rep || !nodes) {
    free(rep);
    free(nodes);
    zd__etcd_kvs_free(kvs, n);
    return zd__errf(err, -ENOMEM, "out of memory for the node registry");
  }
  *rep = (Zerod__V1__NodesReply)ZEROD__V1__NODES_REPLY__INIT;
  rep->nodes = nodes;
  for (size_t i = 0; i < n; i++) {
    Zerod__V1__NodeInfo *info = zerod__v1__node_info__unpack(NULL, kvs[i].len, kvs[i].value);
    if (info) rep->nodes[rep->n_nodes++] = info;
  }
  zd__etcd_kvs_free(kvs, n);
  qsort(rep->nodes, rep->n_nodes, sizeof *rep->nodes, by_first_rank);
  *out = rep;
  return ZD_OK;
}
