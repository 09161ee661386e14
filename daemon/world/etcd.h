/* A blocking client of etcd's v3 API (KV Range, Put, DeleteRange, Txn over gRPC; proto/etcd.proto)
 * for the rendezvous store when the world's coordination lives in etcd (`rendezvous =
 * etcd://...`, rendezvous.h): the few operations the rendezvous needs, on keys below the job's
 * prefix.
 *
 * A URL is "etcd://host:port[,host:port...][/job]": the cluster's client endpoints, tried in turn
 * (a call that finds its endpoint unavailable goes on with the next one until its deadline), and
 * the job, whose keys are "/zerod/<job>/<key>" ("default" when the URL names none) so that several
 * jobs share one etcd. Channels use the process's TLS identity when one is loaded (grpc_unary.h):
 * etcd must then present a certificate for the endpoint's host signed by tls_ca, and it sees the
 * node's certificate. No other credential is sent: not the control token.
 *
 * One zd__etcd_t per thread (as a zd__rdv_t). Every call returns within about its timeout; a call
 * that cannot reach etcd fails with -ETIMEDOUT or ZD_EPEER and a message naming the endpoints.
 */
#ifndef ZD_DAEMON_ETCD_H
#define ZD_DAEMON_ETCD_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"

#define ZD__ETCD_SCHEME "etcd://"

typedef struct zd__etcd zd__etcd_t;

/* Whether address is an etcd URL (begins with "etcd://"). */
int zd__etcd_is_url(const char *address);

/* Checks url's form without opening anything (config.c's check). Errors: ZD_ECONFIG naming what
 * is wrong. */
int zd__etcd_check_url(const char *url, zd__err_t *err);

/* Parses url and opens a channel per endpoint (no connection yet). Errors: ZD_ECONFIG, -ENOMEM. */
int zd__etcd_open(const char *url, zd__etcd_t **out, zd__err_t *err);

/* Accepts NULL. */
void zd__etcd_close(zd__etcd_t *e);

/* The URL it was opened with (for messages). */
const char *zd__etcd_url(const zd__etcd_t *e);

/* Stores value under key unless key exists (one Txn: create_revision == 0, then Put, else Range).
 * *existing is NULL when this call stored it, else a malloc'd copy of the value that is there
 * (*existing_len bytes). */
int zd__etcd_create(zd__etcd_t *e, const char *key, const void *value, size_t len, void **existing,
                    size_t *existing_len, int timeout_ms, zd__err_t *err);

/* *found, and when found the value (malloc'd) in *value and *len. */
int zd__etcd_get(zd__etcd_t *e, const char *key, void **value, size_t *len, int *found,
                 int timeout_ms, zd__err_t *err);

/* *first_missing: the index of the first of keys[0..nkeys) that does not exist, nkeys when every
 * one does (one Txn of counting Ranges per 64 keys). */
int zd__etcd_missing(zd__etcd_t *e, const char *const *keys, size_t nkeys, size_t *first_missing,
                     int timeout_ms, zd__err_t *err);

/* Deletes key, or with prefix every key that begins with it. */
int zd__etcd_delete(zd__etcd_t *e, const char *key, int prefix, int timeout_ms, zd__err_t *err);

/* One entry of zd__etcd_list: key relative to the job's prefix. */
typedef struct zd__etcd_kv {
  char *key;
  uint8_t *value;
  size_t len;
} zd__etcd_kv_t;

/* Every entry whose key begins with prefix, in key order (*kvs malloc'd; zd__etcd_kvs_free). One
 * attempt per endpoint, failing at once on one that is not connected: for a caller that asks
 * again soon (the heartbeat's registry). */
int zd__etcd_list(zd__etcd_t *e, const char *prefix, zd__etcd_kv_t **kvs, size_t *n, int timeout_ms,
                  zd__err_t *err);
void zd__etcd_kvs_free(zd__etcd_kv_t *kvs, size_t n);

#endif /* ZD_DAEMON_ETCD_H */
