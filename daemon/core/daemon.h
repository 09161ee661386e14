/* The daemon: the libuv loop and everything it owns.
 *
 * One zd__daemon_t per process, opaque: its fields are daemon.c's. The loop thread owns it and
 * what hangs from it: the listening socket (server.h), the client sessions with the table of which
 * session holds which local rank (session.h), the local ranks (rank.h), the control service
 * (control.h), signals, and the completion queue through which rank workers hand finished jobs
 * back (uv_async_send). The other modules read what they need through the accessors below; none
 * writes the daemon's state.
 *
 * Shutdown (SIGTERM/SIGINT): stop accepting and remove the socket, stop reading requests, let the
 * jobs in flight finish and their replies go out, close the sessions, join the rank workers,
 * close every handle; the loop then closes with nothing open.
 */
#ifndef ZD_DAEMON_DAEMON_H
#define ZD_DAEMON_DAEMON_H

#include <stdint.h>
#include <uv.h>

#include "clock.h"
#include "compute.h"
#include "config.h"
#include "error.h"
#include "pool.h"
#include "rank.h"

/* The compute backend the daemon runs, chosen once at start. */
typedef enum zd__backend { ZD__BACKEND_CPU = 0, ZD__BACKEND_CUDA = 1 } zd__backend_t;

typedef struct zd__daemon zd__daemon_t;
typedef struct zd__sessions zd__sessions_t;
typedef struct zd__server zd__server_t;

/* Sets up the loop, pool, ranks, sessions and socket from cfg (which must outlive the daemon).
 * Errors with a message: socket in use, bad path, no memory. */
int zd__daemon_create(const zd__config_t *cfg, zd__daemon_t **out, zd__err_t *err);

/* A reply went out: the loop polls for the next request without sleeping for busy_poll_us,
 * unless a rank's worker has a job (its kernel may need every CPU; its end wakes the loop). */
void zd__daemon_poll_busily(zd__daemon_t *d);
/* A job went to a worker: the loop sleeps until something happens, and polls again after a
 * reply that leaves every worker idle. */
void zd__daemon_stop_polling(zd__daemon_t *d);
/* Whether the loop's current pass is one that did not sleep (for the requests_polled count). */
int zd__daemon_polling(const zd__daemon_t *d);

/* Runs until shutdown completes. Returns 0, or the error of uv_loop_close() if handles leaked. */
int zd__daemon_run(zd__daemon_t *d);

/* Frees what zd__daemon_run left (nothing, after a clean shutdown); accepts NULL. */
void zd__daemon_destroy(zd__daemon_t *d);

/* Starts the shutdown sequence (signals; idempotent). Loop thread. */
void zd__daemon_shutdown(zd__daemon_t *d);

/* ---- drain (zeroctl drain) ------------------------------------------------------------------
 * Before maintenance: the node is marked draining (readiness fails, registrations are refused), a
 * checkpoint is requested as zeroctl checkpoint does (taken after the next step of every rank),
 * and once it is complete (its manifest written, by this node or, where rank 0 lives elsewhere,
 * seen in the shared checkpoint_dir) the daemon shuts down as on SIGTERM. */

/* How a drain ended. */
typedef struct zd__drain_result {
  int rc;           /* ZD_OK: zerod is shutting down now; else the drain was given up and zerod
                       goes on serving (ZD_ESHUTDOWN: it is shutting down for another reason) */
  int checkpointed; /* a checkpoint of `step` is complete in `dir` */
  int lost;         /* forced without a checkpoint although one was asked for (failed, late) */
  uint64_t step;
  char dir[512];
  char msg[ZD__ERR_MSG_MAX]; /* rc != 0: why; ZD_OK without a checkpoint: why there is none */
} zd__drain_result_t;

typedef void (*zd__drain_done_fn)(void *arg, const zd__drain_result_t *res);

/* Starts a drain asked for by `by` (the caller, for logs and refusals): done(arg, res) runs on
 * the loop thread once it ends, before the shutdown begins; never when this returns an error.
 * wait_ms bounds the wait for the checkpoint. force: stop even without a checkpoint (nothing to
 * checkpoint, or it failed or was late). Errors: ZD_ECONFIG (no checkpoint_dir) and ZD_EORDER
 * (no model registered), unless force; ZD_EORDER (a drain already in progress), ZD_ESHUTDOWN.
 * Loop thread. */
int zd__daemon_drain(zd__daemon_t *d, const char *by, uint32_t wait_ms, int force,
                     zd__drain_done_fn done, void *arg, zd__err_t *err);

/* Who asked for the drain in progress, or NULL when none is. Loop thread. */
const char *zd__daemon_draining(const zd__daemon_t *d);

/* Called by session.c when a session's handles are closed, to finish a shutdown. Loop thread. */
void zd__daemon_session_gone(zd__daemon_t *d);

/* "cpu" or "cuda". */
const char *zd__backend_name(zd__backend_t backend);

/* ---- accessors -------------------------------------------------------------------------------
 * What is fixed once zd__daemon_create has returned (configuration, world and bucket sizes,
 * backend, GPUs, kernel pool, start time) may be read from any thread for the daemon's lifetime;
 * the rest is the loop thread's. */

uv_loop_t *zd__daemon_loop(zd__daemon_t *d);
const zd__config_t *zd__daemon_config(const zd__daemon_t *d);
uint32_t zd__daemon_world_size(const zd__daemon_t *d); /* world_size, or local_ranks if 0 */
struct zd__ckptr *zd__daemon_checkpointer(const zd__daemon_t *d); /* NULL before the ranks */
uint64_t zd__daemon_bucket_elems(const zd__daemon_t *d);
uint64_t zd__daemon_start_us(const zd__daemon_t *d); /* zd__now_us() at create */

zd__backend_t zd__daemon_backend(const zd__daemon_t *d);
/* Why the CUDA backend is not used although it was not refused by configuration ("CUDA not used:
 * ..."), for messages and status; "" otherwise. */
const char *zd__daemon_backend_note(const zd__daemon_t *d);
/* CUDA backend: the GPU of local rank `local` (< the configured local_ranks); NULL with the CPU
 * backend. */
const zd__gpu_info_t *zd__daemon_gpu(const zd__daemon_t *d, uint32_t local);
/* CPU backend: the kernels' ISA (zd__isa_t) and their thread pool. */
int zd__daemon_isa(const zd__daemon_t *d);
zd__pool_t *zd__daemon_pool(const zd__daemon_t *d);

/* The local ranks: their number, and rank `local` (< that number). Loop thread; the ranks live
 * until the shutdown's last step, when the number drops to 0. */
uint32_t zd__daemon_nranks(const zd__daemon_t *d);
zd__rank_t *zd__daemon_rank(const zd__daemon_t *d, uint32_t local);

/* Whether the shutdown has begun (requests are refused from then on). Loop thread. */
int zd__daemon_shutting_down(const zd__daemon_t *d);

/* The client sessions and the listener (session.h, server.h). Loop thread; valid until
 * zd__daemon_destroy. */
zd__sessions_t *zd__daemon_sessions(const zd__daemon_t *d);
const zd__server_t *zd__daemon_server(const zd__daemon_t *d);

#endif /* ZD_DAEMON_DAEMON_H */
