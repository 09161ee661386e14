/* What session.c (connections, frames, replies, a session's life) and requests.c (the command
 * table and the request handlers) share: a session's state, and the functions the handlers answer
 * and queue jobs through. Private to daemon/transport; everyone else uses session.h. */
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
#include "step.h"

#define MAX_FDS 8 /* descriptors held per session before a register consumes them */

typedef enum session_state {
  SESSION_NEW,         /* waiting for hello */
  SESSION_READY,       /* hello done: version agreed, local rank chosen */
  SESSION_REGISTERING, /* attach job in flight */
  SESSION_REGISTERED,  /* model registered: step, scatter, gather allowed */
} session_state_t;

typedef struct out_buf {
  struct out_buf *next;
  size_t len;
  size_t off;
  uint8_t data[];
} out_buf_t;

struct zd__sessions {
  zd__daemon_t *d;
  zd__session_t *head; /* open sessions, linked through the session */
  uint32_t n;
  uint32_t next_id;
  zd__session_counters_t counters;
  zd__attach_t *attach; /* which session holds each local rank; written only through here */
};

struct zd__session {
  zd__sessions_t *ss;
  zd__daemon_t *daemon;
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
   * worker also writes here, to answer a finished job before the loop wakes
   * (zd__session_answer_early), so the queue and the socket's sending side are under wq_lock. */
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
  uint32_t inflight;      /* jobs queued on the rank */
  zd__job_t *pending_bye; /* bye waits for the jobs in flight; holds its request id */
  uint64_t bye_id;
  int bye_pending;
  int stood_in; /* W > 1: its rank was released at its end, and the rank stands in for it */
};

typedef int (*handler_fn)(zd__session_t *s, const zd__frame_header_t *h, const uint8_t *body,
                          zd__err_t *err);

enum { CMD_ANY = 0, CMD_NEEDS_HELLO = 1, CMD_NEEDS_MODEL = 2 };

typedef struct command {
  uint16_t type;
  const char *name;
  handler_fn handler;
  int needs;
  uint32_t max_body; /* 0: the configured max_frame_bytes */
} command_t;

/* The command of a frame type; NULL if there is none (requests.c). */
const command_t *zd__session_command(uint16_t type);

/* Queues a reply frame for request `id` of type req_type (the reply type is derived). */
void zd__session_reply(zd__session_t *s, uint16_t req_type, uint64_t id,
                       const ProtobufCMessage *msg);

/* A job for request h on this session's rank; NULL when out of memory. */
zd__job_t *zd__session_job_new(zd__session_t *s, zd__job_type_t type, const zd__frame_header_t *h);

/* Runs the job inline when the rank allows it, else queues it; counts it in flight. */
void zd__session_submit(zd__session_t *s, zd__job_t *job);

/* Closes the descriptors received and not yet taken by a register. */
void zd__session_close_fds(zd__session_t *s);

/* A leaving client's rank: released, and stood in for where the world still needs it. */
void zd__session_stand_in(zd__session_t *s);

/* Detaches the session and answers its bye. */
void zd__session_reply_bye(zd__session_t *s, uint64_t id);

#endif /* ZD_DAEMON_SESSION_INTERNAL_H */
