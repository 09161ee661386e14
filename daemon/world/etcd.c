/* etcd v3 client (etcd.h): unary calls of etcdserverpb.KV with protobuf-c messages through
 * grpc_unary, one channel per endpoint, retried across endpoints until the call's deadline.
 */
#include "etcd.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "etcd.pb-c.h"
#include "grpc_unary.h"

#define MAX_ENDPOINTS 16
#define MAX_JOB       128
#define TXN_OPS       64   /* counting ranges per Txn: etcd refuses more than 128 by default */
#define ATTEMPT_MS    1000 /* with several endpoints, one attempt's share of a call's time */
#define RETRY_MS      50   /* pause after an endpoint answered UNAVAILABLE */

struct zd__etcd {
  char *url;
  char prefix[MAX_JOB + 16]; /* "/zerod/<job>/" */
  size_t nep;
  size_t cur; /* the endpoint that answered last */
  zd__grpc_channel_t *ch[MAX_ENDPOINTS];
};

int zd__etcd_is_url(const char *address) {
  return address && strncmp(address, ZD__ETCD_SCHEME, strlen(ZD__ETCD_SCHEME)) == 0;
}

/* Splits url into endpoints (written into eps, each NUL-terminated in buf) and job. */
static int parse(const char *url, char *buf, size_t cap, char **eps, size_t *nep, const char **job,
                 zd__err_t *err) {
  *nep = 0;
  *job = "default";
  if (!zd__etcd_is_url(url))
    return zd__errf(err, ZD_ECONFIG, "rendezvous '%.200s' is not an etcd URL (etcd://host:port)",
                    url);
  const char *rest = url + strlen(ZD__ETCD_SCHEME);
  if (strlen(rest) + 1 > cap)
    return zd__errf(err, ZD_ECONFIG, "rendezvous '%.64s...' is too long", url);
  memcpy(buf, rest, strlen(rest) + 1);
  char *slash = strchr(buf, '/');
  if (slash) {
    *slash = '\0';
    *job = slash + 1;
    size_t n = strlen(*job);
    if (n == 0 || n > MAX_JOB)
      return zd__errf(err, ZD_ECONFIG,
                      "rendezvous '%.200s': the job after '/' has %zu characters; 1..%d", url, n,
                      MAX_JOB);
    for (const char *c = *job; *c; c++)
      if (!isalnum((unsigned char)*c) && *c != '-' && *c != '_' && *c != '.')
        return zd__errf(err, ZD_ECONFIG,
                        "rendezvous '%.200s': the job may hold letters, digits, '-', '_' and '.' "
                        "only",
                        url);
  }
  for (char *tok = buf, *next; tok; tok = next) {
    next = strchr(tok, ',');
    if (next) *next++ = '\0';
    char *colon = strrchr(tok, ':');
    if (!tok[0] || !colon || colon == tok || !colon[1] ||
        strspn(colon + 1, "0123456789") != strlen(colon + 1))
      return zd__errf(err, ZD_ECONFIG,
                      "rendezvous '%.200s': endpoint '%.100s' is not host:port (etcd://host:port"
                      "[,host:port...][/job])",
                      url, tok);
    if (*nep == MAX_ENDPOINTS)
      return zd__errf(err, ZD_ECONFIG, "rendezvous '%.200s': more than %d endpoints", url,
                      MAX_ENDPOINTS);
    eps[(*nep)++] = tok;
  }
  return ZD_OK;
}

int zd__etcd_check_url(const char *url, zd__err_t *err) {
  char buf[1024], *eps[MAX_ENDPOINTS];
  size_t nep;
  const char *job;
  return parse(url, buf, sizeof buf, eps, &nep, &job, err);
}

int zd__etcd_open(const char *url, zd__etcd_t **out, zd__err_t *err) {
  *out = NULL;
  char buf[1024], *eps[MAX_ENDPOINTS];
  size_t nep;
  const char *job;
  int rc = parse(url, buf, sizeof buf, eps, &nep, &job, err);
  if (rc) return rc;
  zd__etcd_t *e = calloc(1, sizeof *e);
  if (!e || !(e->url = strdup(url))) {
    free(e);
    return zd__errf(err, -ENOMEM, "out of memory opening the etcd client");
  }
  snprintf(e->prefix, sizeof e->prefix, "/zerod/%s/", job);
  for (size_t i = 0; i < nep; i++) {
    if ((rc = zd__grpc_channel_open(eps[i], &e->ch[i], err))) {
      zd__etcd_close(e);
      return rc;
    }
    e->nep++;
  }
  *out = e;
  return ZD_OK;
}

void zd__etcd_close(zd__etcd_t *e) {
  if (!e) return;
  for (size_t i = 0; i < e->nep; i++) zd__grpc_channel_close(e->ch[i]);
  free(e->url);
  free(e);
}

const char *zd__etcd_url(const zd__etcd_t *e) {
  return e->url;
}

static void sleep_ms(int64_t ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* One call of method, on the endpoint that answered last and then the others in turn, until
 * timeout_ms passes. Only an unreachable endpoint (UNAVAILABLE, or no answer within its share of
 * the time) moves on: etcd's own refusals are final. With once, every endpoint is tried once and
 * a channel that is not connected fails at once (no WAIT_FOR_READY): for callers that ask again
 * soon anyway (the heartbeat). The error names what, the endpoint and the URL. */
static int call(zd__etcd_t *e, const char *method, const char *what, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply,
                int timeout_ms, int once, zd__err_t *err) {
  const int64_t deadline = (int64_t)zd__now_ms() + (timeout_ms > 0 ? timeout_ms : 1);
  zd__err_t last = {0};
  int rc, attempts = 0;
  for (;;) {
    int64_t left = deadline - (int64_t)zd__now_ms();
    if (left < 1) left = 1;
    int ms = e->nep > 1 && left > ATTEMPT_MS ? ATTEMPT_MS : (int)left;
    *reply = NULL;
    rc = zd__grpc_call(e->ch[e->cur], method, req, reply_desc, reply, ms,
                       once ? 0 : ZD__GRPC_WAIT_FOR_READY, NULL, &last);
    attempts++;
    if (rc == ZD_OK) return ZD_OK;
    if (rc != ZD_EPEER && rc != -ETIMEDOUT) break;
    e->cur = (e->cur + 1) % e->nep;
    left = deadline - (int64_t)zd__now_ms();
    if (left <= 0 || (once && (size_t)attempts >= e->nep)) break;
    if (rc == ZD_EPEER) sleep_ms(left < RETRY_MS ? left : RETRY_MS);
  }
  /* grpc_unary words an unreachable server as zerod's control service: here it is etcd. */
  static const char zerod_words[] = "cannot reach zerod control service at ";
  const size_t n = sizeof zerod_words - 1;
  const char *rest = strncmp(last.msg, zerod_words, n) == 0 ? last.msg + n : NULL;
  return zd__errf(err, rc, "etcd rendezvous %s: cannot %s (%d attempt%s in %d ms): %s%s", e->url,
                  what, attempts, attempts == 1 ? "" : "s", timeout_ms,
                  rest ? "cannot reach etcd at " : "", rest ? rest : last.msg);
}

/* The job's prefix + key, malloc'd into *out. */
static int full_key(const zd__etcd_t *e, const char *key, ProtobufCBinaryData *out,
                    zd__err_t *err) {
  size_t p = strlen(e->prefix), k = strlen(key);
  uint8_t *b = malloc(p + k + 1);
  if (!b) return zd__errf(err, -ENOMEM, "out of memory for an etcd key");
  memcpy(b, e->prefix, p);
  memcpy(b + p, key, k + 1);
  out->data = b;
  out->len = p + k;
  return ZD_OK;
}

/* The end of a prefix's range: the prefix with its last byte + 1 (keys are text: never 0xff). */
static int range_end(const ProtobufCBinaryData *key, ProtobufCBinaryData *end, zd__err_t *err) {
  uint8_t *b = malloc(key->len);
  if (!b) return zd__errf(err, -ENOMEM, "out of memory for an etcd range");
  memcpy(b, key->data, key->len);
  b[key->len - 1]++;
  end->data = b;
  end->len = key->len;
  return ZD_OK;
}

static int copy_value(const ProtobufCBinaryData *v, void **value, size_t *len, zd__err_t *err) {
  *value = malloc(v->len ? v->len : 1);
  if (!*value) return zd__errf(err, -ENOMEM, "out of memory for a %zu-byte value", v->len);
  if (v->len) memcpy(*value, v->data, v->len);
  *len = v->len;
  return ZD_OK;
}

int zd__etcd_create(zd__etcd_t *e, const char *key, const void *value, size_t len, void **existing,
                    size_t *existing_len, int timeout_ms, zd__err_t *err) {
  *existing = NULL;
  *existing_len = 0;
  ProtobufCBinaryData k;
  int rc = full_key(e, key, &k, err);
  if (rc) return rc;
  Etcdserverpb__Compare cmp = ETCDSERVERPB__COMPARE__INIT;
  cmp.result = ETCDSERVERPB__COMPARE__COMPARE_RESULT__EQUAL;
  cmp.target = ETCDSERVERPB__COMPARE__COMPARE_TARGET__CREATE;
  cmp.key = k;
  cmp.target_union_case = ETCDSERVERPB__COMPARE__TARGET_UNION_CREATE_REVISION;
  cmp.create_revision = 0; /* the key does not exist */
  Etcdserverpb__PutRequest put = ETCDSERVERPB__PUT_REQUEST__INIT;
  put.key = k;
  put.value.data = (uint8_t *)value;
  put.value.len = len;
  Etcdserverpb__RangeRequest get = ETCDSERVERPB__RANGE_REQUEST__INIT;
  get.key = k;
  Etcdserverpb__RequestOp on_ok = ETCDSERVERPB__REQUEST_OP__INIT, on_fail = on_ok;
  on_ok.request_case = ETCDSERVERPB__REQUEST_OP__REQUEST_REQUEST_PUT;
  on_ok.request_put = &put;
  on_fail.request_case = ETCDSERVERPB__REQUEST_OP__REQUEST_REQUEST_RANGE;
  on_fail.request_range = &get;
  Etcdserverpb__Compare *cmps[] = {&cmp};
  Etcdserverpb__RequestOp *oks[] = {&on_ok}, *fails[] = {&on_fail};
  Etcdserverpb__TxnRequest txn = ETCDSERVERPB__TXN_REQUEST__INIT;
  txn.n_compare = 1;
  txn.compare = cmps;
  txn.n_success = 1;
  txn.success = oks;
  txn.n_failure = 1;
  txn.failure = fails;
  char what[300];
  snprintf(what, sizeof what, "set '%.250s'", key);
  ProtobufCMessage *reply = NULL;
  rc = call(e, "/etcdserverpb.KV/Txn", what, &txn.base, &etcdserverpb__txn_response__descriptor,
            &reply, timeout_ms, 0, err);
  if (rc) goto exit;
  const Etcdserverpb__TxnResponse *r = (const Etcdserverpb__TxnResponse *)reply;
  if (r->succeeded) goto exit;
  /* The key exists: its value, unless it was deleted between the compare and the range. */
  if (r->n_responses == 1 &&
      r->responses[0]->response_case == ETCDSERVERPB__RESPONSE_OP__RESPONSE_RESPONSE_RANGE &&
      r->responses[0]->response_range->n_kvs == 1) {
    rc = copy_value(&r->responses[0]->response_range->kvs[0]->value, existing, existing_len, err);
  } else {
    rc = zd__errf(err, ZD_EPEER, "etcd rendezvous %s: %s: the key exists but has no value", e->url,
                  what);
  }
exit:
  if (reply) protobuf_c_message_free_unpacked(reply, NULL);
  free(k.data);
  return rc;
}

int zd__etcd_get(zd__etcd_t *e, const char *key, void **value, size_t *len, int *found,
                 int timeout_ms, zd__err_t *err) {
  *value = NULL;
  *len = 0;
  *found = 0;
  Etcdserverpb__RangeRequest req = ETCDSERVERPB__RANGE_REQUEST__INIT;
  int rc = full_key(e, key, &req.key, err);
  if (rc) return rc;
  char what[300];
  snprintf(what, sizeof what, "get '%.250s'", key);
  ProtobufCMessage *reply = NULL;
  rc = call(e, "/etcdserverpb.KV/Range", what, &req.base, &etcdserverpb__range_response__descriptor,
            &reply, timeout_ms, 0, err);
  if (!rc) {
    const Etcdserverpb__RangeResponse *r = (const Etcdserverpb__RangeResponse *)reply;
    if (r->n_kvs == 1) {
      *found = 1;
      rc = copy_value(&r->kvs[0]->value, value, len, err);
    }
  }
  if (reply) protobuf_c_message_free_unpacked(reply, NULL);
  free(req.key.data);
  return rc;
}

int zd__etcd_missing(zd__etcd_t *e, const char *const *keys, size_t nkeys, size_t *first_missing,
                     int timeout_ms, zd__err_t *err) {
  const int64_t deadline = (int64_t)zd__now_ms() + timeout_ms;
  Etcdserverpb__RangeRequest ranges[TXN_OPS];
  Etcdserverpb__RequestOp ops[TXN_OPS], *opp[TXN_OPS];
  int rc = ZD_OK;
  *first_missing = nkeys;
  for (size_t base = 0; base < nkeys && !rc; base += TXN_OPS) {
    size_t n = nkeys - base < TXN_OPS ? nkeys - base : TXN_OPS, made = 0;
    for (; made < n; made++) {
      ranges[made] = (Etcdserverpb__RangeRequest)ETCDSERVERPB__RANGE_REQUEST__INIT;
      ranges[made].count_only = 1;
      if ((rc = full_key(e, keys[base + made], &ranges[made].key, err))) break;
      ops[made] = (Etcdserverpb__RequestOp)ETCDSERVERPB__REQUEST_OP__INIT;
      ops[made].request_case = ETCDSERVERPB__REQUEST_OP__REQUEST_REQUEST_RANGE;
      ops[made].request_range = &ranges[made];
      opp[made] = &ops[made];
    }
    ProtobufCMessage *reply = NULL;
    if (!rc) {
      Etcdserverpb__TxnRequest txn = ETCDSERVERPB__TXN_REQUEST__INIT;
      txn.n_success = n;
      txn.success = opp;
      int64_t left = deadline - (int64_t)zd__now_ms();
      char what[300];
      snprintf(what, sizeof what, "look up '%.200s'%s", keys[base], n > 1 ? " and others" : "");
      rc = call(e, "/etcdserverpb.KV/Txn", what, &txn.base, &etcdserverpb__txn_response__descriptor,
                &reply, left > 1 ? (int)left : 1, 0, err);
    }
    if (!rc) {
      const Etcdserverpb__TxnResponse *r = (const Etcdserverpb__TxnResponse *)reply;
      if (r->n_responses != n)
        rc = zd__errf(err, ZD_EPROTO, "etcd rendezvous %s: %zu answers to %zu look-ups", e->url,
                      r->n_responses, n);
      for (size_t i = 0; !rc && i < n; i++) {
        const Etcdserverpb__ResponseOp *op = r->responses[i];
        if (op->response_case != ETCDSERVERPB__RESPONSE_OP__RESPONSE_RESPONSE_RANGE ||
            op->response_range->count == 0) {
          *first_missing = base + i;
          break;
        }
      }
    }
    if (reply) protobuf_c_message_free_unpacked(reply, NULL);
    for (size_t i = 0; i < made; i++) free(ranges[i].key.data);
    if (*first_missing != nkeys) break;
  }
  return rc;
}

int zd__etcd_delete(zd__etcd_t *e, const char *key, int prefix, int timeout_ms, zd__err_t *err) {
  Etcdserverpb__DeleteRangeRequest req = ETCDSERVERPB__DELETE_RANGE_REQUEST__INIT;
  int rc = full_key(e, key, &req.key, err);
  if (rc) return rc;
  if (prefix && (rc = range_end(&req.key, &req.range_end, err))) goto exit;
  char what[300];
  snprintf(what, sizeof what, "delete '%.250s'%s", key, prefix ? "*" : "");
  ProtobufCMessage *reply = NULL;
  rc = call(e, "/etcdserverpb.KV/DeleteRange", what, &req.base,
            &etcdserverpb__delete_range_response__descriptor, &reply, timeout_ms, 0, err);
  if (reply) protobuf_c_message_free_unpacked(reply, NULL);
exit:
  free(req.key.data);
  free(req.range_end.data);
  return rc;
}

void zd__etcd_kvs_free(zd__etcd_kv_t *kvs, size_t n) {
  if (!kvs) return;
  for (size_t i = 0; i < n; i++) {
    free(kvs[i].key);
    free(kvs[i].value);
  }
  free(kvs);
}

int zd__etcd_list(zd__etcd_t *e, const char *prefix, zd__etcd_kv_t **kvs, size_t *n, int timeout_ms,
                  zd__err_t *err) {
  *kvs = NULL;
  *n = 0;
  Etcdserverpb__RangeRequest req = ETCDSERVERPB__RANGE_REQUEST__INIT;
  int rc = full_key(e, prefix, &req.key, err);
  if (rc) return rc;
  ProtobufCMessage *reply = NULL;
  if ((rc = range_end(&req.key, &req.range_end, err))) goto exit;
  char what[300];
  snprintf(what, sizeof what, "list '%.250s*'", prefix);
  rc = call(e, "/etcdserverpb.KV/Range", what, &req.base, &etcdserverpb__range_response__descriptor,
            &reply, timeout_ms, 1, err);
  if (rc) goto exit;
  const Etcdserverpb__RangeResponse *r = (const Etcdserverpb__RangeResponse *)reply;
  size_t plen = strlen(e->prefix);
  zd__etcd_kv_t *out = calloc(r->n_kvs ? r->n_kvs : 1, sizeof *out);
  if (!out) {
    rc = zd__errf(err, -ENOMEM, "out of memory listing '%s'", prefix);
    goto exit;
  }
  size_t got = 0;
  for (size_t i = 0; i < r->n_kvs; i++) {
    const Etcdserverpb__KeyValue *kv = r->kvs[i];
    if (kv->key.len < plen) continue; /* cannot be: the range is below the prefix */
    size_t klen = kv->key.len - plen;
    char *key = malloc(klen + 1);
    void *value = NULL;
    size_t vlen = 0;
    if (!key || copy_value(&kv->value, &value, &vlen, err)) {
      free(key);
      zd__etcd_kvs_free(out, got);
      rc = zd__errf(err, -ENOMEM, "out of memory listing '%s'", prefix);
      goto exit;
    }
    memcpy(key, kv->key.data + plen, klen);
    key[klen] = '\0';
    out[got++] = (zd__etcd_kv_t){.key = key, .value = value, .len = vlen};
  }
  *kvs = out;
  *n = got;
exit:
  if (reply) protobuf_c_message_free_unpacked(reply, NULL);
  free(req.key.data);
  free(req.range_end.data);
  return rc;
}
