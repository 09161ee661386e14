/* What the transport's modules share, private to daemon/transport (everyone else uses
 * session.h): a session's state and the set's; session.c (connections, frames, writing, a
 * session's life), requests.c (the command table and its handlers) and jobs.c (a request's job,
 * from its submission to its reply) reach each other through the functions below. */
#ifndef ZD_DAEMON_SESSION_INTERNAL_H
#define ZD_DAEMON_SESSION_INTERNAL_H

#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "attach.h"
#include "buffers.h"
#include "frame.h"
#include "session.h"
#include "zerod.pb-c.h"

#define MAX_FDS 8 /* descriptors held per session before a register consumes them */

typedef enum session_state {
  SESSION_NEW,         /* waiting for hello */
  SESSION_READY,       /* hello done: version agreed, local rank chosen */
  SESSION_REGISTERING, /* attach job in flight */
  SESSION_REGISTERED,  /* model registered: step, scatter, gather allowed */
} session_state_t;

/* An encoded frame on its way out. */
typedef struct out_buf {
  struct out_buf *next;
  size_t len;
  size_t off;
  uint8_t data[];
} out_buf_t;

struct zd__sessions {
  zd__sessions_env_t env;
  zd__session_t *head; /* open sessions, linked through the session */
  uint32_t n;
  uint32_t next_id;
  zd__session_counters_t counters;
  zd__attach_t *attach;   /* which session holds each local rank; written only through here */
  char refuse_by[160];    /* registrations are refused (a drain asked by this); "": they are not */
  int shutting_down;      /* zd__sessions_drain was called: every request is refused */
  uint64_t busy_until_ns; /* the loop polls without sleeping until then (uv_hrtime) */
  int polling;            /* the loop's current pass did not sleep */
  /* Finished jobs from the rank workers, in completion order, for the loop (jobs.c). */
  uv_async_t done_async;
  pthread_mutex_t done_lock;
  zd__job_t *done_head, *done_tail;
};

struct zd__session {
  zd__sessions_t *ss;
  const zd__config_t *cfg;
  zd__session_t *next, *prev;
  uint32_t id;
  int fd;
  uv_poll_t poll;
  uv_timer_t frame_timer;
  uv_timer_t hello_timer; /* a connection must say hello within hello_timeout_ms */
  int open_handles;       /* poll and timers, until their close callbacks ran */
  struct ucred cred;
  char name[64];
  session_state_t state;
  int named_rank; /* its hello named the rank (a weak reservation: attach.h) */
  int closing;    /* read no more; tear down once idle */
  int rank_wait;  /* a register waits for a departed client's rank (register_waits) */
  uint64_t rank_wait_until_ms;
  int dispatching; /* in process_frames: a job done inline must not re-enter it */
  int torn_down;   /* handles closing */
  int poll_events;

  uint8_t *rbuf; /* received bytes not yet consumed */
  size_t rlen;
  size_t rcap;
  int fds[MAX_FDS]; /* received descriptors, oldest first */
  int nfds;
  /* Replies not yet written, oldest first. The loop owns everything else of a session; the rank
   * worker also writes here, to answer a finished job before the loop wakes (jobs.c), so the
   * queue and the socket's sending side are under wq_lock. */
  pthread_mutex_t wq_lock;
  out_buf_t *wq_head, *wq_tail;
  size_t wq_bytes;  /* reading stops above max_frame_bytes */
  uint32_t held;    /* jobs a worker left to the loop to answer, not answered yet: until then no
                       worker answers, so that replies to jobs keep their order */
  int write_failed; /* nothing more is written: the stream may end in a partial frame */

  zd__rank_t *rank; /* from hello on; held in the attachment table, or competed for at register */
  zd__session_buffers_t buf;
  uint32_t nbuckets;
  uint32_t ngroups;
  uint32_t nparams;  /* of the registered layout: the length of a step's absent bitmap */
  uint32_t inflight; /* jobs queued on the rank */
  uint64_t bye_id;   /* bye waits for the jobs in flight; this is its request id */
  int bye_pending;
  int stood_in; /* W > 1: its rank was released at its end, and the rank stands in for it */
};

/* ---- session.c ----------------------------------------------------------------------------- */

/* A frame of type `type` for request id, encoded; NULL when out of memory. Any thread. */
out_buf_t *zd__frame_buf(uint16_t type, uint64_t id, const ProtobufCMessage *msg);

/* Queues b (NULL: the encoding ran out of memory, which closes the session) and writes what the
 * socket takes; the loop then polls busily for the client's next request. */
void zd__session_send(zd__session_t *s, out_buf_t *b);

/* Queues a reply frame for request `id` of type req_type (the reply type is derived). */
void zd__session_reply(zd__session_t *s, uint16_t req_type, uint64_t id,
                       const ProtobufCMessage *msg);

/* An Error reply for request id, counted. kept: Error.cuda_mappings_kept, which every error
 * answering a register carries (whether zerod still holds IPC handles that register sent;
 * docs/protocol.md); -1 leaves it out. */
void zd__session_send_error(zd__session_t *s, uint64_t id, int code, const char *msg, int kept);

/* A rank worker's reply (jobs.c): written into the socket now if nothing waits before it, else
 * queued for the loop to write; nothing once the connection broke. Worker thread, wq_lock held. */
void zd__session_send_locked(zd__session_t *s, out_buf_t *b);

/* The loop's next look at the session after one of its jobs ended: frames held back by
 * max_inflight, the poll handle, and the teardown of a closing session with nothing in flight. */
void zd__session_continue(zd__session_t *s);

/* Closes the descriptors received and not yet taken by a register. */
void zd__session_close_fds(zd__session_t *s);

/* Detaches the session and answers its bye. */
void zd__session_reply_bye(zd__session_t *s, uint64_t id);

/* Sets the poll deadline after a reply (busy_poll_us), unless a rank's worker has a job. */
void zd__sessions_poll_busily(zd__sessions_t *ss);

/* ---- requests.c ---------------------------------------------------------------------------- */

typedef int (*handler_fn)(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                          zd__err_t *err);

enum { CMD_ANY = 0, CMD_NEEDS_HELLO = 1, CMD_NEEDS_MODEL = 2 };

typedef struct command {
  uint16_t type;
  handler_fn handler;
  int needs;
  uint32_t max_body; /* 0: the configured max_frame_bytes */
} command_t;

/* The command of a frame type; NULL if there is none. */
const command_t *zd__session_command(uint16_t type);

/* "hello (1), register (2), ..., checkpoint (8)": the commands, for a message (len bytes). */
void zd__session_commands(char *buf, size_t len);

/* ---- jobs.c -------------------------------------------------------------------------------- */

/* A job for request h on this session's rank; NULL when out of memory. */
zd__job_t *zd__job_new(zd__session_t *s, zd__job_type_t type, const zd__frame_header_t *h);

/* Runs the job inline when the rank allows it (and completes it), else queues it on the rank;
 * counts it in flight until it is complete. */
void zd__job_submit(zd__session_t *s, zd__job_t *job);

/* A leaving client's rank: released, and stood in for where the world still needs it. */
void zd__job_stand_in(zd__session_t *s);

/* The completion queue's handle, on the set (zd__sessions_create). */
int zd__jobs_init(zd__sessions_t *ss);

#endif /* ZD_DAEMON_SESSION_INTERNAL_H */
