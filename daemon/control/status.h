/* Status: what zerod reports about itself, as sections of key/value pairs with units in the key
 * names (redis INFO): "server", "world", one "rank N" per local rank, and "config" (the effective
 * configuration, memcached `stats settings`). The local STATUS request and the control service
 * both render it. Loop thread only.
 */
#ifndef ZD_DAEMON_STATUS_H
#define ZD_DAEMON_STATUS_H

#include <stddef.h>

typedef struct zd__status zd__status_t;
struct zd__daemon;

/* Snapshot of the daemon now; NULL when out of memory. */
zd__status_t *zd__status_collect(struct zd__daemon *d);
void zd__status_free(zd__status_t *st);

/* Builder, for collect and for tests. Values are formatted printf-style. Returns 0 or -ENOMEM. */
zd__status_t *zd__status_new(void);
int zd__status_section(zd__status_t *st, const char *name);
int zd__status_add(zd__status_t *st, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

size_t zd__status_nsections(const zd__status_t *st);
size_t zd__status_nentries(const zd__status_t *st, size_t section);
size_t zd__status_nentries_total(const zd__status_t *st);
const char *zd__status_section_name(const zd__status_t *st, size_t section);
const char *zd__status_key(const zd__status_t *st, size_t section, size_t entry);
const char *zd__status_value(const zd__status_t *st, size_t section, size_t entry);

#endif /* ZD_DAEMON_STATUS_H */
