/* The rendezvous client (rendezvous.h) on a real etcd: the built-in store's rules kept there.
 *
 *   test_etcd_rdv HOST:PORT
 *
 * run by tests/python/test_etcd.py with the etcd it started (exit 77 without an endpoint). Checks:
 * a key is written once (the same value again is a retry, another is -EEXIST), get and wait, a
 * wait satisfied by a later set from another thread, a wait that times out naming the missing
 * keys, delete and delete by prefix, two jobs on one etcd that do not see each other's keys, the
 * node registry (register, re-register of a restarted node, listing with a junk entry left out),
 * failover past a dead first endpoint, an unreachable etcd named in the error, and bad URLs.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "control.pb-c.h"
#include "etcd.h"
#include "rendezvous.h"
#include "zerod/zerod.h"

#define CALL_MS 5000

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static zd__rdv_t *open_rdv(const char *url) {
  zd__rdv_t *rdv;
  zd__err_t err = {0};
  CHECK_MSG(zd__rdv_open(url, &rdv, &err) == ZD_OK, "%s", err.msg);
  return rdv;
}

typedef struct {
  const char *url;
  int rc;
} late_t;

static void *late_set(void *arg) {
  late_t *l = arg;
  struct timespec ts = {0, 300 * 1000000L};
  nanosleep(&ts, NULL);
  zd__rdv_t *rdv = open_rdv(l->url);
  zd__err_t err = {0};
  l->rc = zd__rdv_set(rdv, "late", "value-from-thread", 17, CALL_MS, &err);
  zd__rdv_close(rdv);
  return NULL;
}

static void store_rules(const char *url) {
  zd__rdv_t *rdv = open_rdv(url);
  zd__err_t err = {0};
  CHECK_MSG(zd__rdv_set(rdv, "k1", "v1", 2, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_MSG(zd__rdv_set(rdv, "k1", "v1", 2, CALL_MS, &err) == ZD_OK, "a retry: %s", err.msg);
  CHECK_INT_EQ(zd__rdv_set(rdv, "k1", "v2", 2, CALL_MS, &err), -EEXIST);
  CHECK_CONTAINS(err.msg, "'k1' is already set to another value");
  void *value = NULL;
  size_t len = 0;
  CHECK_MSG(zd__rdv_get(rdv, "k1", &value, &len, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_INT_EQ(len, 2);
  CHECK(memcmp(value, "v1", 2) == 0);
  free(value);
  /* an empty value is a value */
  CHECK_MSG(zd__rdv_set(rdv, "empty", "", 0, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_MSG(zd__rdv_get(rdv, "empty", &value, &len, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_INT_EQ(len, 0);
  free(value);

  /* a wait that a later set from another thread satisfies */
  late_t l = {.url = url, .rc = -1};
  pthread_t t;
  CHECK(pthread_create(&t, NULL, late_set, &l) == 0);
  double t0 = now_ms();
  CHECK_MSG(zd__rdv_get(rdv, "late", &value, &len, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  double took = now_ms() - t0;
  pthread_join(t, NULL);
  CHECK_INT_EQ(l.rc, ZD_OK);
  CHECK_INT_EQ(len, 17);
  CHECK(memcmp(value, "value-from-thread", 17) == 0);
  free(value);
  CHECK_WITHIN(took, 2000, "a wait on etcd answers within its poll's backoff of the set");

  /* a wait that times out names the missing keys, not those that exist */
  const char *keys[] = {"k1", "missing-a", "missing-b"};
  t0 = now_ms();
  CHECK_INT_EQ(zd__rdv_wait(rdv, keys, 3, 400, &err), -ETIMEDOUT);
  took = now_ms() - t0;
  CHECK_CONTAINS(err.msg, "'missing-a', 'missing-b'");
  CHECK_CONTAINS(err.msg, url);
  CHECK(strstr(err.msg, "'k1'") == NULL);
  CHECK_MSG(took >= 390, "the wait ended after %.0f ms, before its timeout", took);
  CHECK_WITHIN(took, 2000, "a wait's timeout holds");

  /* delete, and delete by prefix */
  CHECK_MSG(zd__rdv_delete(rdv, "k1", CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_MSG(zd__rdv_delete(rdv, "k1", CALL_MS, &err) == ZD_OK, "absent is fine: %s", err.msg);
  CHECK_MSG(zd__rdv_set(rdv, "k1", "v2", 2, CALL_MS, &err) == ZD_OK, "after a delete: %s", err.msg);
  CHECK_MSG(zd__rdv_set(rdv, "gloo/w1/0", "a", 1, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_MSG(zd__rdv_set(rdv, "gloo/w1/1", "b", 1, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_MSG(zd__rdv_set(rdv, "gloo/w10/0", "c", 1, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_MSG(zd__rdv_delete_prefix(rdv, "gloo/w1/", CALL_MS, &err) == ZD_OK, "%s", err.msg);
  const char *gone[] = {"gloo/w1/0"}, *kept[] = {"gloo/w10/0", "k1"};
  CHECK_INT_EQ(zd__rdv_wait(rdv, gone, 1, 0, &err), -ETIMEDOUT);
  CHECK_MSG(zd__rdv_wait(rdv, kept, 2, CALL_MS, &err) == ZD_OK, "%s", err.msg);

  /* sizes, as the built-in store's */
  char big_key[1100];
  memset(big_key, 'k', sizeof big_key - 1);
  big_key[sizeof big_key - 1] = '\0';
  CHECK_INT_EQ(zd__rdv_set(rdv, big_key, "v", 1, CALL_MS, &err), -EINVAL);
  size_t big = (1u << 20) + 1;
  char *v = calloc(1, big);
  CHECK(v);
  CHECK_INT_EQ(zd__rdv_set(rdv, "big", v, big, CALL_MS, &err), ZD_ETOOBIG);
  CHECK_MSG(zd__rdv_set(rdv, "big", v, big - 1, CALL_MS, &err) == ZD_OK, "1 MiB: %s", err.msg);
  free(v);
  zd__rdv_close(rdv);
}

/* Two jobs on one etcd: each sees its own keys only. */
static void jobs_apart(const char *endpoint) {
  char a[256], b[256];
  snprintf(a, sizeof a, "etcd://%s/job-a", endpoint);
  snprintf(b, sizeof b, "etcd://%s/job-b", endpoint);
  zd__rdv_t *ra = open_rdv(a), *rb = open_rdv(b);
  zd__err_t err = {0};
  CHECK_MSG(zd__rdv_set(ra, "zerod/world", "aaaa", 4, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_MSG(zd__rdv_set(rb, "zerod/world", "bbbb", 4, CALL_MS, &err) == ZD_OK,
            "job b's key is its own: %s", err.msg);
  const char *k[] = {"only-a"};
  CHECK_MSG(zd__rdv_set(ra, "only-a", "x", 1, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_INT_EQ(zd__rdv_wait(rb, k, 1, 0, &err), -ETIMEDOUT);
  CHECK_MSG(zd__rdv_delete_prefix(rb, "zerod/", CALL_MS, &err) == ZD_OK, "%s", err.msg);
  void *value = NULL;
  size_t len = 0;
  CHECK_MSG(zd__rdv_get(ra, "zerod/world", &value, &len, CALL_MS, &err) == ZD_OK,
            "job b's delete left job a's key: %s", err.msg);
  CHECK(len == 4 && memcmp(value, "aaaa", 4) == 0);
  free(value);
  zd__rdv_close(ra);
  zd__rdv_close(rb);
}

static void registry(const char *url) {
  zd__rdv_t *rdv = open_rdv(url);
  zd__err_t err = {0};
  CHECK_MSG(zd__rdv_register_node(rdv, 0, 1, "unix:/tmp/a.sock", 11, CALL_MS, &err) == ZD_OK, "%s",
            err.msg);
  CHECK_MSG(zd__rdv_register_node(rdv, 2, 2, "10.0.0.2:7070", 22, CALL_MS, &err) == ZD_OK, "%s",
            err.msg);
  /* node 0 restarted elsewhere: its entry is replaced */
  CHECK_MSG(zd__rdv_register_node(rdv, 0, 1, "unix:/tmp/moved.sock", 33, CALL_MS, &err) == ZD_OK,
            "%s", err.msg);
  CHECK_MSG(zd__rdv_set(rdv, "node/9", "junk", 4, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  Zerod__V1__NodesReply *rep = NULL;
  CHECK_MSG(zd__rdv_nodes(rdv, &rep, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  CHECK_INT_EQ(rep->n_nodes, 2); /* the junk entry is left out */
  CHECK_INT_EQ(rep->nodes[0]->first_rank, 0);
  CHECK_STR_EQ(rep->nodes[0]->control_address, "unix:/tmp/moved.sock");
  CHECK_U64_EQ(rep->nodes[0]->incarnation, 33);
  CHECK_INT_EQ(rep->nodes[1]->first_rank, 2);
  CHECK_INT_EQ(rep->nodes[1]->local_ranks, 2);
  protobuf_c_message_free_unpacked(&rep->base, NULL);
  zd__rdv_close(rdv);
}

/* A dead endpoint first: calls go on with the next one. */
static void failover(const char *endpoint, const char *dead) {
  char url[512];
  snprintf(url, sizeof url, "etcd://%s,%s/failover", dead, endpoint);
  zd__rdv_t *rdv = open_rdv(url);
  zd__err_t err = {0};
  double t0 = now_ms();
  CHECK_MSG(zd__rdv_set(rdv, "k", "v", 1, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  void *value = NULL;
  size_t len = 0;
  CHECK_MSG(zd__rdv_get(rdv, "k", &value, &len, CALL_MS, &err) == ZD_OK, "%s", err.msg);
  free(value);
  CHECK_WITHIN(now_ms() - t0, 3000, "one dead endpoint costs at most one attempt's share");
  zd__rdv_close(rdv);
}

static void unreachable(const char *dead) {
  char url[512];
  snprintf(url, sizeof url, "etcd://%s/nobody", dead);
  zd__rdv_t *rdv = open_rdv(url);
  zd__err_t err = {0};
  double t0 = now_ms();
  int rc = zd__rdv_set(rdv, "k", "v", 1, 600, &err);
  CHECK_MSG(rc == -ETIMEDOUT || rc == ZD_EPEER, "rc %d: %s", rc, err.msg);
  CHECK_CONTAINS(err.msg, url);
  CHECK_CONTAINS(err.msg, dead);
  CHECK_WITHIN(now_ms() - t0, 3000, "an unreachable etcd fails at the call's timeout");
  printf("unreachable: %s\n", err.msg);
  const char *k[] = {"k"};
  rc = zd__rdv_wait(rdv, k, 1, 600, &err);
  CHECK_MSG(rc == -ETIMEDOUT || rc == ZD_EPEER, "rc %d: %s", rc, err.msg);
  CHECK_CONTAINS(err.msg, dead);
  zd__rdv_close(rdv);
}

static void bad_urls(void) {
  static const char *const bad[] = {"etcd://",     "etcd://host",       "etcd://h:1,/j",
                                    "etcd://h:x",  "etcd://h:1/",       "etcd://h:1/a b",
                                    "etcd://:1/j", "etcd://h:1,h:2:/j", NULL};
  for (int i = 0; bad[i]; i++) {
    zd__rdv_t *rdv = NULL;
    zd__err_t err = {0};
    CHECK_MSG(zd__rdv_open(bad[i], &rdv, &err) == ZD_ECONFIG, "'%s' was accepted", bad[i]);
    CHECK(rdv == NULL);
    CHECK_MSG(zd__etcd_check_url(bad[i], &err) == ZD_ECONFIG, "'%s'", bad[i]);
  }
  zd__err_t err = {0};
  CHECK_MSG(zd__etcd_check_url("etcd://10.0.0.1:2379,[::1]:2379,etcd.local:2379/run-3.b_c", &err) ==
                ZD_OK,
            "%s", err.msg);
}

int main(int argc, char **argv) {
  if (argc < 3) {
    printf("SKIP: needs an etcd endpoint and a dead one (tests/python/test_etcd.py runs it)\n");
    return ZD_TEST_SKIP;
  }
  const char *endpoint = argv[1], *dead = argv[2];
  char url[512];
  snprintf(url, sizeof url, "etcd://%s/rdv-test", endpoint);
  bad_urls();
  store_rules(url);
  jobs_apart(endpoint);
  registry(url);
  failover(endpoint, dead);
  unreachable(dead);
  printf("etcd rendezvous: all checks passed\n");
  return 0;
}
