/* The daemon: the libuv loop and everything it owns.
 *
 * One zd__daemon_t per process. The loop thread owns it: the listening socket (server.c), the
 * client sessions (session.c), the local ranks (rank.c) as far as attaching clients goes, signals
 * and the completion queue through which rank workers hand finished jobs back (uv_async_send).
 * Shutdown (SIGTERM/SIGINT): stop accepting and remove the socket, stop reading requests, let the
 * jobs in flight finish and their replies go out, close the sessions, join the rank workers,
 * close every handle; the loop then closes with nothing open.
 */
#ifndef ZD_DAEMON_DAEMON_H
#define ZD_DAEMON_DAEMON_H

#include <pthread.h>
#include <stdint.h>
#include <uv.h>

#include "compute.h"
#include "clock.h"
#include "config.h"
#include "error.h"
#include "pool.h"
#include "rank.h"
#include "world.h"

/* The compute backend the daemon runs, chosen once at start. */
typedef enum zd__backend { ZD__BACKEND_CPU = 0, ZD__BACKEND_CUDA = 1 } zd__backend_t;

typedef struct zd__session zd__session_t;
typedef struct zd__control zd__control_t;

typedef struct zd__daemon {
  uv_loop_t loop;
  const zd__config_t *cfg;
  uint32_t world_size;
  uint64_t bucket_elems;
  int isa; /* zd__isa_t of the CPU kernels */
  zd__pool_t *pool;
  zd__backend_t backend;
  /* Why the CUDA backend is not used when it was not asked for ("" when it is, or was refused
   * by configuration): for the start-up log and the status. */
  char backend_note[ZD__ERR_MSG_MAX];
  zd__gpu_info_t *gpus; /* CUDA backend: the GPU of each local rank (local rank i: device i) */
  zd__world_t world;    /* how ranks join a multi-rank world */
  uint32_t nranks;
  zd__rank_t **ranks;
  zd__session_t **attached; /* per local rank: the session attached to it, or NULL */

  /* server.c */
  int listen_fd;
  uv_poll_t listen_poll;
  int listening;
  char socket_path[108];

  /* session.c */
  zd__session_t *sessions; /* all open sessions, linked through the session */
  uint32_t nsessions;
  uint32_t next_session_id;

  zd__control_t *control;     /* gRPC control service; NULL once stopped */
  struct zd__liveness *peers; /* the heartbeat of the other nodes; NULL in a one-node world */

  struct zd__metrics *metrics; /* Prometheus endpoint (metrics.h); NULL when off or stopped */

  uv_timer_t shutdown_timer; /* aborts collectives that hold a shutdown too long */
  uv_signal_t sigterm;
  uv_signal_t sigint;
  uv_async_t done_async;
  pthread_mutex_t done_lock;
  zd__job_t *done_head; /* finished jobs from the workers, in completion order */
  zd__job_t *done_tail;
  int shutting_down;
  int handles_closed;

  uv_signal_t sighup;
  uv_timer_t summary_timer; /* the connection summary (connection_summary) */
  uint64_t summary_clients; /* clients_total at the last summary */
  uint64_t summary_dropped; /* connections_dropped at the last summary */

  uint64_t start_us;
  uint64_t clients_total;
  uint64_t clients_denied;
  uint64_t clients_refused;     /* max_clients or max_clients_per_uid reached */
  uint64_t clients_timed_out;   /* no hello within hello_timeout_ms */
  uint64_t connections_dropped; /* closed by zerod after an error reply (all of the above too) */
  char last_drop[ZD__ERR_MSG_MAX + 64];
  uint64_t requests_total;
  uint64_t errors_total;
} zd__daemon_t;

/* Sets up the loop, pool, ranks and socket from cfg (which must outlive the daemon).
 * Errors with a message: socket in use, bad path, no memory. */
int zd__daemon_create(const zd__config_t *cfg, zd__daemon_t **out, zd__err_t *err);

/* Runs until shutdown completes. Returns 0, or the error of uv_loop_close() if handles leaked. */
int zd__daemon_run(zd__daemon_t *d);

/* Frees what zd__daemon_run left (nothing, after a clean shutdown); accepts NULL. */
void zd__daemon_destroy(zd__daemon_t *d);

/* Starts the shutdown sequence (signals; idempotent). */
void zd__daemon_shutdown(zd__daemon_t *d);

/* Called by session.c when a session is gone, to finish a shutdown. */
void zd__daemon_session_gone(zd__daemon_t *d);

/* "cpu" or "cuda". */
const char *zd__backend_name(zd__backend_t backend);

/* server.c: listening socket. */
int zd__server_start(zd__daemon_t *d, zd__err_t *err);
void zd__server_stop(zd__daemon_t *d);

#endif /* ZD_DAEMON_DAEMON_H */
