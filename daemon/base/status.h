/* Status: what zerod reports about itself, as sections of key/value pairs with units in the key
 * names (redis INFO): "server", "world", one "rank N" per local rank, "checkpoint" and "config"
 * (the effective configuration, memcached `stats settings`). The local STATUS request, the
 * control service and the metrics endpoint all render it.
 *
 * Each module writes its own keys: it gives the registry (zd__status_reg_t, one per daemon) a
 * writer, and a snapshot calls every writer in the order they were registered. Several writers
 * may add to one section (zd__status_section reopens a section of that name), so that the
 * transport writes a rank's attached client into the "rank N" section the rank itself opened.
 * This module knows none of them. Loop thread only.
 */
#ifndef ZD_DAEMON_STATUS_H
#define ZD_DAEMON_STATUS_H

#include <stddef.h>

typedef struct zd__status zd__status_t;
typedef struct zd__status_reg zd__status_reg_t;

/* Writes a module's keys into st (zd__status_section, zd__status_add); ctx is the module's. */
typedef void (*zd__status_fn)(void *ctx, zd__status_t *st);

/* An empty registry; NULL when out of memory. */
zd__status_reg_t *zd__status_reg_new(void);
void zd__status_reg_free(zd__status_reg_t *reg); /* accepts NULL */

/* Adds a writer after those registered so far. Errors: -ENOMEM. */
int zd__status_register(zd__status_reg_t *reg, zd__status_fn fn, void *ctx);

/* Removes the writer (fn, ctx), before ctx goes; nothing if it is not registered or reg is
 * NULL. */
void zd__status_unregister(zd__status_reg_t *reg, zd__status_fn fn, void *ctx);

/* A snapshot now: every writer, in order; NULL when out of memory. */
zd__status_t *zd__status_collect(const zd__status_reg_t *reg);
void zd__status_free(zd__status_t *st); /* accepts NULL */

/* Builder, for the writers and for tests. Values are formatted printf-style. Returns 0 or
 * -ENOMEM (the snapshot is then dropped by zd__status_collect). */
zd__status_t *zd__status_new(void);
/* Makes `name` the section that zd__status_add writes to: a new one at the end, or the section of
 * that name if there is one already. */
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
