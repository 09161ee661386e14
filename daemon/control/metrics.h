/* Prometheus metrics: the status (status.h) rendered in the Prometheus text exposition format
 * (version 0.0.4) and served over HTTP at http://<metrics_address>/metrics by libmicrohttpd.
 *
 * Everything exported comes from zd__status_collect(): this module reads no daemon internals, so
 * a number an operator sees in a scrape is the number `zeroctl status` shows. Only numbers leave
 * it (and a few labels: version, backend, GPU names, a degraded rank's reason): no client names,
 * paths, addresses or configuration, so the endpoint holds no secrets.
 *
 * Threading: libmicrohttpd answers on a thread of its own; the loop thread owns the daemon. A
 * scrape asks the loop to render (uv_async_send) and waits for the text on a condition variable,
 * at most ZD__METRICS_RENDER_TIMEOUT_MS: the numbers are those of the moment of the scrape, no
 * work is done when nobody scrapes, and a loop that does not answer fails the scrape (503), which
 * Prometheus records as the target being down, instead of serving stale numbers.
 */
#ifndef ZD_DAEMON_METRICS_H
#define ZD_DAEMON_METRICS_H

#include <stddef.h>
#include <uv.h>

#include "error.h"
#include "status.h"

#define ZD__METRICS_RENDER_TIMEOUT_MS 5000

typedef struct zd__metrics zd__metrics_t;

/* Serves the metrics of the status `status` collects on address ("host:port", "[v6addr]:port";
 * port 0: a free port) when address is not "", else does nothing and sets *out to NULL.
 * Loop thread, start-up. Errors (ZD_ECONFIG, with a message naming metrics_address): a malformed
 * or unresolvable address, an address that cannot be bound. On error, one handle has been closed
 * on loop: the loop must run once more to free it (zd__daemon_create's failure path does). */
int zd__metrics_start(uv_loop_t *loop, const char *address, const zd__status_reg_t *status,
                      zd__metrics_t **out, zd__err_t *err);

/* Stops serving: a scrape waiting for the loop is answered 503, the HTTP thread is joined (this
 * blocks for as long as libmicrohttpd takes to close its connections, not for a render), and the
 * handle is freed in its close callback. Loop thread. Sets *m to NULL; accepts NULL and *m NULL. */
void zd__metrics_stop(zd__metrics_t **m);

/* The exposition text of a status snapshot, NUL-terminated in *text (malloc'd, the caller frees)
 * and *len bytes long. Any thread (it reads only st). Returns 0 or -ENOMEM. Sections and keys the
 * status lacks give no sample; a value that is not a number (or is NaN) gives none either. */
int zd__metrics_render(const zd__status_t *st, char **text, size_t *len);

#endif /* ZD_DAEMON_METRICS_H */
