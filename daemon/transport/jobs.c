/* A request's job, from its submission to its reply: the one owner of a job's completion.
 *
 * A handler (requests.c) makes a job of a request and submits it here. A small job of an idle
 * world-size-1 CPU rank runs at once on the loop thread (zd__rank_run_inline) and is completed
 * right away; any other job is queued on the session's rank, whose worker runs it, calls
 * answer_early (job->answer) and then, once the job's work has completed, job_finished
 * (job->done; on a CUDA rank in cuda_step fast that may be after the next jobs ran, rank.h). The
 * first answers a successful job from the worker itself (job->answer_early: the client need not
 * wait for the loop thread to be woken); the second hands the job to the loop through the set's
 * completion queue (uv_async_send), where complete() does the loop's part for every job: the
 * accounting, the session's state after a register, the reply when the worker did not send it,
 * and the session's next step. The session counts the job in flight until then, so it keeps the
 * client's CUDA buffers mapped while the job's work may still use them.
 *
 * Ordering: a client's jobs are answered in the order they ran. Errors are answered by the loop
 * (which counts them), and so is every later job's reply until the loop has sent that error
 * (s->held, under wq_lock). A job on CUDA buffers is answered by the worker only on a rank in
 * cuda_step fast (zd__rank_cuda_fast; in legacy the loop answers them all): the worker frees the
 * job's event slot (an atomic bit, buffers.h) just before it sends the reply, since the client
 * may name the slot again as soon as it reads it, and the loop then leaves the slot alone.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "buffers.h"
#include "log.h"
#include "session_internal.h"

static void job_finished(zd__job_t *job);
static void answer_early(zd__job_t *job);

zd__job_t *zd__job_new(zd__session_t *s, zd__job_type_t type, const zd__frame_header_t *h) {
  zd__job_t *job = calloc(1, sizeof *job);
  if (!job) return NULL;
  job->type = type;
  job->answer = answer_early;
  job->done = job_finished;
  job->session = s;
  job->request_id = h->request_id;
  job->msg_type = h->type;
  job->buffers = &s->buf.bufs;
  return job;
}

/* The reply to a job that succeeded (not a stand-in: nobody waits for that), encoded; NULL when
 * out of memory. Any thread. */
static out_buf_t *success_frame(const zd__job_t *job) {
  uint16_t type = (uint16_t)(job->msg_type | ZD__FRAME_REPLY);
  switch (job->type) {
    case ZD__JOB_ATTACH: {
      Zerod__V1__RegisterReply rep = ZEROD__V1__REGISTER_REPLY__INIT;
      rep.step = job->out.attach.step;
      rep.resumed = job->out.attach.resumed;
      rep.layout_hash = job->out.attach.layout_hash;
      rep.total_elems = job->out.attach.total_elems;
      rep.nbuckets = job->out.attach.nbuckets;
      rep.shard_elems = job->out.attach.shard_elems;
      rep.loss_scale = job->out.attach.loss_scale;
      return zd__frame_buf(type, job->request_id, &rep.base);
    }
    case ZD__JOB_STEP: {
      Zerod__V1__StepReply rep = ZEROD__V1__STEP_REPLY__INIT;
      rep.step = job->out.step.step;
      rep.applied = job->out.step.applied;
      rep.grad_norm = job->out.step.grad_norm;
      rep.loss_scale = job->out.step.loss_scale;
      rep.clip_coef = job->out.step.clip_coef;
      rep.duration_us = job->out.step.duration_us;
      rep.has_idle_cpus = 1;
      rep.idle_cpus = job->out.step.idle_cpus;
      return zd__frame_buf(type, job->request_id, &rep.base);
    }
    case ZD__JOB_SCATTER: {
      Zerod__V1__ScatterReply rep = ZEROD__V1__SCATTER_REPLY__INIT;
      return zd__frame_buf(type, job->request_id, &rep.base);
    }
    case ZD__JOB_GATHER: {
      Zerod__V1__GatherReply rep = ZEROD__V1__GATHER_REPLY__INIT;
      return zd__frame_buf(type, job->request_id, &rep.base);
    }
    case ZD__JOB_CHECKPOINT: {
      Zerod__V1__CheckpointReply rep = ZEROD__V1__CHECKPOINT_REPLY__INIT;
      rep.step = job->out.checkpoint.step;
      rep.dir = (char *)job->out.checkpoint.dir;
      return zd__frame_buf(type, job->request_id, &rep.base);
    }
    case ZD__JOB_STAND_IN:
      break;
  }
  zd_assert(!"no reply for this job");
  return NULL;
}

/* Worker thread: the reply goes into the socket now if nothing waits before it, else to the end
 * of the queue, which the loop writes once it sees the job end (a failed write too: the loop finds
 * the error then, and closes the session). The session stays open meanwhile: it is torn down only
 * with no job in flight. Sets job->answered if it answered. */
static void answer_early(zd__job_t *job) {
  if (!job->answer_early) return;
  zd__session_t *s = job->session;
  out_buf_t *b = job->code == ZD_OK ? success_frame(job) : NULL; /* NULL: out of memory too */
  pthread_mutex_lock(&s->wq_lock);
  if (!b || s->held) {
    s->held++;
    pthread_mutex_unlock(&s->wq_lock);
    free(b);
    return;
  }
  /* Every call naming the slot's events was made: free it for the client's next request. */
  zd__buffers_job_done(&s->buf, job->event_slot);
  zd__session_send_locked(s, b);
  pthread_mutex_unlock(&s->wq_lock);
  job->answered = 1;
}

/* The loop's reply to a job the worker did not answer. kept: for a failed attach, whether its
 * buffers' mappings were left open (zd__buffers_release). */
static void reply(zd__session_t *s, zd__job_t *job, int kept) {
  if (job->type == ZD__JOB_STAND_IN) return; /* no request: nothing to answer */
  if (job->answered) {
    s->ss->counters.replies_early++;
    zd__sessions_poll_busily(s->ss); /* as if the loop had just sent it */
    return;
  }
  if (job->code != ZD_OK)
    zd__session_send_error(s, job->request_id, job->code,
                           job->err.msg[0] ? job->err.msg : zd_strerror(job->code),
                           job->type == ZD__JOB_ATTACH ? kept : -1);
  else
    zd__session_send(s, success_frame(job));
  if (job->answer_early) { /* a worker held it back: its reply is queued now, in order */
    pthread_mutex_lock(&s->wq_lock);
    zd_assert(s->held > 0);
    s->held--;
    pthread_mutex_unlock(&s->wq_lock);
  }
}

/* Loop thread: a job of session s is done. */
static void complete(zd__session_t *s, zd__job_t *job) {
  zd_assert(s->inflight > 0);
  s->inflight--;
  if (!job->answered) zd__buffers_job_done(&s->buf, job->event_slot); /* else the worker did */
  int kept = 0;
  if (job->type == ZD__JOB_ATTACH) {
    if (job->code == ZD_OK) {
      s->state = SESSION_REGISTERED;
    } else {
      zd__attach_unattach(s->ss->attach, s, zd__rank_local(s->rank)); /* still reserved */
      kept = zd__buffers_release(&s->buf, s->rank, s->id); /* before the answer: it says so */
      if (s->state == SESSION_REGISTERING) s->state = SESSION_READY;
    }
  }
  if (job->type == ZD__JOB_STAND_IN && job->out.kept) /* the rank holds the param buffer now */
    s->buf.bufs.params = (zd__shm_t){0};
  reply(s, job, kept);
  zd__job_free(job);
  zd__session_continue(s);
}

/* Worker thread: the job ran. */
static void job_finished(zd__job_t *job) {
  zd__session_t *s = job->session;
  zd__sessions_t *ss = s->ss;
  job->next = NULL;
  pthread_mutex_lock(&ss->done_lock);
  if (ss->done_tail)
    ss->done_tail->next = job;
  else
    ss->done_head = job;
  ss->done_tail = job;
  pthread_mutex_unlock(&ss->done_lock);
  uv_async_send(&ss->done_async);
}

static void on_jobs_done(uv_async_t *handle) {
  zd__sessions_t *ss = handle->data;
  pthread_mutex_lock(&ss->done_lock);
  zd__job_t *job = ss->done_head;
  ss->done_head = ss->done_tail = NULL;
  pthread_mutex_unlock(&ss->done_lock);
  while (job) {
    zd__job_t *next = job->next;
    complete(job->session, job);
    job = next;
  }
}

int zd__jobs_init(zd__sessions_t *ss) {
  pthread_mutex_init(&ss->done_lock, NULL);
  int rc = uv_async_init(ss->env.loop, &ss->done_async, on_jobs_done);
  if (rc) {
    pthread_mutex_destroy(&ss->done_lock);
    return rc;
  }
  ss->done_async.data = ss;
  return ZD_OK;
}

void zd__job_submit(zd__session_t *s, zd__job_t *job) {
  /* Inline only with nothing of this session in flight: a job of its that finished on the worker
   * may still wait in the completion queue, and its reply must go out first. */
  int idle = s->inflight == 0;
  s->inflight++;
  zd__buffers_job_queued(&s->buf, job->event_slot); /* CUDA: the slot is taken until it is done */
  if (idle && zd__rank_run_inline(s->rank, job)) {
    complete(s, job);
    return;
  }
  s->ss->busy_until_ns = 0; /* the kernel's threads may need every CPU now */
  /* With CUDA buffers only in cuda_step fast (legacy: the loop answers, as it always did). */
  job->answer_early = job->type != ZD__JOB_ATTACH && job->type != ZD__JOB_STAND_IN &&
                      (!zd__buffers_cuda(&s->buf) || zd__rank_cuda_fast(s->rank));
  zd__rank_submit(s->rank, job);
}

/* The registered client of a rank of a multi-rank world is leaving (docs/design.md, "When a
 * trainer dies"): its rank is free at once for a restarted trainer, and its last job, after those
 * in flight, stands in for it where the world still needs this rank (ZD__JOB_STAND_IN). */
void zd__job_stand_in(zd__session_t *s) {
  if (s->closing && s->state == SESSION_REGISTERING && s->rank)
    zd__rank_abandon_attach(s->rank); /* its registration may wait for the others for minutes */
  if (!s->closing || s->state != SESSION_REGISTERED || s->stood_in ||
      zd__rank_world_size(s->rank) < 2 || s->ss->shutting_down)
    return;
  /* A rank whose world broke (degraded, or re-forming it: its worker may wait minutes for a
   * restarted peer) has no step left to stand in for, and its model is dropped or frozen: the
   * client leaves at once. */
  zd__rank_stats_t st;
  zd__rank_stats(s->rank, &st);
  if (st.health != ZD__HEALTH_OK) return;
  zd__job_t *job = zd__job_new(s, ZD__JOB_STAND_IN, &(zd__frame_header_t){0});
  if (!job) return; /* then released at the end, as at world size 1 */
  s->stood_in = 1;
  job->in.abrupt = !s->bye_pending;
  zd__attach_release(s->ss->attach, s, zd__rank_local(s->rank));
  ZD_LOG_INFO("session %u: client '%s' (pid %d) %s; local rank %u released", s->id, s->name,
              (int)s->cred.pid, s->bye_pending ? "said bye" : "disconnected",
              zd__rank_local(s->rank));
  s->inflight++;
  zd__rank_submit(s->rank, job);
}
