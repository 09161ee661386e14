/* The rendezvous key-value store: what rank 0's node keeps for the ranks of a world to find each
 * other (addresses, the world id, NCCL's unique id, the node registry), and the waits on it.
 *
 * Plain C on the loop thread: no gRPC, no protobuf; the control service (control.c) translates
 * its requests into these calls. Keys are NUL-terminated strings, values opaque bytes. A key is
 * written once: setting it again to the same value is a retry, to another value an error. Sizes
 * are bounded by the limits given at creation, so a client cannot make the daemon hold much.
 * A wait is answered through its callback when every key exists or its timeout passes; it holds
 * a timer on the loop until its close callback has run.
 *
 * Every function that validates a key takes `what`, the operation as the client knows it
 * ("KvSet"), to begin the error message with. Not thread-safe: the loop thread only.
 */
#ifndef ZD_DAEMON_KVSTORE_H
#define ZD_DAEMON_KVSTORE_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "error.h"

typedef struct zd__kvstore zd__kvstore_t;
typedef struct zd__kv_wait zd__kv_wait_t;

typedef struct zd__kvstore_limits {
  size_t max_key_bytes;   /* a key has 1..max_key_bytes bytes */
  size_t max_value_bytes; /* one value */
  size_t max_total_bytes; /* keys (with their NUL) and values together */
  size_t max_wait_keys;   /* keys of one wait */
  uint32_t max_waiters;   /* waits pending at once */
} zd__kvstore_limits_t;

/* An empty store whose waits use timers of loop; NULL when out of memory. The limits are copied. */
zd__kvstore_t *zd__kvstore_new(uv_loop_t *loop, const zd__kvstore_limits_t *limits);

/* Frees the store. No wait may be pending or closing (zd__kvstore_shutdown, then every close
 * callback). Accepts NULL. */
void zd__kvstore_free(zd__kvstore_t *s);

/* Stores value[0..len) under key, unless key exists: with the same value that is a retry and
 * succeeds, with another it is -EEXIST. Then advances every pending wait (whose callbacks may
 * run before this returns). Errors: -EINVAL (key size), ZD_ETOOBIG (value size), -EEXIST,
 * -ENOSPC (the store would exceed max_total_bytes), -ENOMEM. */
int zd__kvstore_set(zd__kvstore_t *s, const char *key, const void *value, size_t len,
                    const char *what, zd__err_t *err);

/* *found, and when found *value and *len, pointing into the store: valid until the next change.
 * Errors: -EINVAL (key size). */
int zd__kvstore_get(const zd__kvstore_t *s, const char *key, const uint8_t **value, size_t *len,
                    int *found, const char *what, zd__err_t *err);

/* Whether key exists (keys are not validated here). */
int zd__kvstore_has(const zd__kvstore_t *s, const char *key);

/* Removes key; *found says whether it was there. Pending waits that already saw the key keep
 * their place. Errors: -EINVAL (key size). */
int zd__kvstore_delete(zd__kvstore_t *s, const char *key, int *found, const char *what,
                       zd__err_t *err);

/* Removes every key that begins with prefix (non-empty): what a finished world instance wrote.
 * Returns how many. */
size_t zd__kvstore_delete_prefix(zd__kvstore_t *s, const char *prefix);

/* The entries whose keys begin with prefix, in key order: entries *first .. *first + n - 1, n
 * returned. Indices are valid until the next change. */
size_t zd__kvstore_prefix(const zd__kvstore_t *s, const char *prefix, size_t *first);

/* Entry i, as zd__kvstore_prefix numbers them. */
void zd__kvstore_entry(const zd__kvstore_t *s, size_t i, const char **key, const uint8_t **value,
                       size_t *len);

/* Ends a wait, with why: ZD_OK (every key exists), -ETIMEDOUT or ZD_ESHUTDOWN. The wait is out
 * of the store; zd__kv_wait_next() may still be asked until the close callback. */
typedef void (*zd__kv_wait_cb)(void *arg, int why);

/* Runs once the wait's timer is closed: the wait is gone, and arg may be freed. */
typedef void (*zd__kv_closed_cb)(void *arg);

/* Waits for every key of keys[0..nkeys) (the caller keeps them until the close callback).
 * When the answer is known now, returns ZD_OK with *w NULL and *ready set: 1 when every key
 * exists, 0 when timeout_ms is 0 and some do not; no callback runs. Otherwise *w is a pending
 * wait: done(arg, why) runs once when it ends, unless zd__kv_wait_cancel ends it first, and
 * closed(arg) after either. Errors (no callback runs): -EINVAL (too many keys, a key's size),
 * ZD_ESHUTDOWN (after zd__kvstore_shutdown; the message is its why), -ENOSPC (max_waiters). */
int zd__kvstore_wait(zd__kvstore_t *s, const char *const *keys, size_t nkeys, uint64_t timeout_ms,
                     zd__kv_wait_cb done, zd__kv_closed_cb closed, void *arg, zd__kv_wait_t **w,
                     int *ready, const char *what, zd__err_t *err);

/* Ends a pending wait without its done callback (its asker went away); closed still runs. */
void zd__kv_wait_cancel(zd__kv_wait_t *w);

/* Index of the first of the wait's keys it has not seen: keys before it existed once (a delete
 * does not send a wait back), those from it on are the ones to report missing. */
size_t zd__kv_wait_next(const zd__kv_wait_t *w);

/* Ends every pending wait with done(arg, ZD_ESHUTDOWN) and refuses new ones from now on with
 * ZD_ESHUTDOWN and the message why. Returns how many waits were pending. */
uint32_t zd__kvstore_shutdown(zd__kvstore_t *s, const char *why);

#endif /* ZD_DAEMON_KVSTORE_H */
