/* libzerod's insides, shared by its files and by nothing else (never installed).
 *
 * One zd_client_t is split over three files: client.c owns the connection and the request/reply
 * transport (pipelined requests, their table of pending replies, the thread-local last error);
 * client_register.c owns the model: its layout, the host buffers and the register request;
 * client_cuda.c, built only with CUDA, owns device buffers, their IPC events and the stream
 * ordering; abi.c reads the caller's structures by their sizes (zerod.h, "A growing ABI") into
 * the full-size copies the others work on. This header is the struct they share and the few
 * functions they call across. Without CUDA the zd__cuda_* calls are inline stubs, so the generic
 * files carry no #ifdef.
 */
#ifndef ZEROD_CLIENT_INTERNAL_H
#define ZEROD_CLIENT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "frame.h"
#include "layout.h"
#include "zerod.pb-c.h"
#include "zerod/zerod.h"

/* One pair of events per outstanding request (proto/frame.h). */
#define ZD__MAX_OUTSTANDING ZD__EVENT_SLOTS

_Static_assert(ZD__EVENT_SLOTS <= 64, "event slots are bits of a uint64_t");

typedef struct zd__pending {
  uint64_t id;
  uint16_t type;
  int slot; /* device buffers: the request's event slot, taken until it is forgotten; -1: none */
  int done;
  int code;
  int mappings_kept; /* an Error's cuda_mappings_kept: 0, 1, or -1 when absent */
  char msg[ZD__ERR_MSG_MAX];
  zd_step_result_t step;
} zd__pending_t;

struct zd_client {
  int fd;
  uint64_t next_id;
  uint64_t reply_spin_ns; /* how long the read of the reply being awaited looks before sleeping */
  uint64_t step_spin_ns;  /* what a step's wait looks for: from the last step's duration */
  zd_info_t info;         /* this library's full zd_info_t */
  zd__pending_t pending[ZD__MAX_OUTSTANDING];
  uint32_t npending;

  /* zd_layout() */
  zd__layout_t *layout;
  zd_group_t *groups;
  uint32_t ngroups;
  zd_dtype_t param_dtype, grad_dtype;
  double max_grad_norm;
  zd_grad_reduce_t grad_reduce;
  zd_loss_scaler_t loss_scaler;
  unsigned flags;
  int param_fd, grad_fd;
  void *params, *grads;
  size_t param_bytes, grad_bytes;
  int registered;

  /* Device buffers (ZD_MEMORY_CUDA), or pinned host buffers (ZD_MEMORY_HOST_PINNED) */
  zd_memory_t memory;
  int device;          /* this process's ordinal of the buffers' GPU (pinned: of the model's) */
  int pinned;          /* pinned host buffers: bit 0, the params are registered; bit 1, grads */
  void *stream;        /* zd_set_stream(): cudaStream_t; NULL: the legacy default stream */
  int exported;        /* the handles went to zerod, which may have them open: the buffers
                          and events must then outlive the process's use of them */
  int kept;            /* zerod said it keeps (or may keep) handles of these buffers open:
                          only a bye saying otherwise lets them be freed */
  uint64_t slots_busy; /* bit k: event slot k belongs to an outstanding request */
  uint32_t next_slot;  /* where the search for a free slot starts (round robin) */
  void *grads_ready[ZD__EVENT_SLOTS];  /* cudaEvent_t, recorded here, waited on by zerod */
  void *params_ready[ZD__EVENT_SLOTS]; /* cudaEvent_t, recorded by zerod, waited on here */
  uint8_t uuid[16];                    /* of the buffers' GPU */
  uint8_t param_handle[64], grad_handle[64];
  uint8_t grads_ready_handle[ZD__EVENT_SLOTS][64], params_ready_handle[ZD__EVENT_SLOTS][64];
  /* From hello, with zerod's CUDA backend: its ordinal and the UUID of the rank's GPU. */
  int overlap_update; /* from hello: zerod runs overlap_update (takes a scatter's groups) */
  /* zd_set_next_groups(): groups to send with the next scatter (next_ngroups of them, malloc'd);
   * next_pending: not sent yet */
  zd_group_t *next_groups;
  uint32_t next_ngroups;
  int next_pending;
  int has_rank_gpu;
  int rank_device;
  uint8_t rank_uuid[16];
  /* zerod answered with an error about the connection itself (request id 0), e.g. ZD_EBUSY at
   * max_clients, and closes it (zd__await) */
  int refused;
  /* zd_connect(): the socket path it resolved, for zd_rejoin()'s new connections */
  char path[108];
};

/* ---- client.c: errors and transport ------------------------------------------------------- */

/* Formats the thread's last error (zd_last_error()) and returns code. */
int zd__fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* -EBUSY (with the message) when ZD__MAX_OUTSTANDING requests are outstanding, else ZD_OK. */
int zd__check_room(const zd_client_t *c);

/* Sends a request of the given type, with fds (SCM_RIGHTS) when nfds > 0, and enters it in the
 * pending table; *id receives its request id. slot (-1: none) is its event slot, taken by
 * zd__cuda_before_request(): it belongs to the request from here on, and is given back when the
 * request cannot be sent. Does not wait for the reply. */
int zd__start(zd_client_t *c, uint16_t type, const ProtobufCMessage *msg, const int *fds, int nfds,
              int slot, uint64_t *id);

/* Reads frames until request id is answered (timeout_ms < 0: for ever), settling replies of other
 * pending requests on the way. Returns the request's status (its message in the last error). On
 * success *body (when body is not NULL) receives the reply body, which the caller frees, and
 * *body_len its length. The request stays in the table until zd__forget_pending(). */
int zd__await(zd_client_t *c, uint64_t id, uint8_t **body, uint32_t *body_len, int timeout_ms);

/* The pending entry of request id, or NULL. */
zd__pending_t *zd__find_pending(zd_client_t *c, uint64_t id);

/* Drops a pending entry and frees its event slot: after its reply was processed (and, for device
 * buffers, the stream made to wait on its "params ready"), or when the request is given up. */
void zd__forget_pending(zd_client_t *c, zd__pending_t *p);

/* ---- abi.c: the caller's structures, by their sizes ---------------------------------------- */

/* Each reads the caller's structure into *out, a full-size copy in which the fields beyond the
 * caller's size have their defaults; -EINVAL (with the message) for a size this library does not
 * take. zd__read_model_desc also checks the element sizes of the desc's arrays, and
 * zd__read_step_opts that of its groups when it has any; NULL opts or loss scaler: the defaults
 * (no loss scaling). */
int zd__read_model_desc(const zd_model_desc_t *in, zd_model_desc_t *out);
int zd__read_step_opts(const zd_step_opts_t *in, zd_step_opts_t *out);
int zd__read_loss_scaler(const zd_loss_scaler_t *in, zd_loss_scaler_t *out);

/* Reads n groups of group_size bytes (checked) each into out[n], over the defaults. */
void zd__read_groups(zd_group_t *out, const zd_group_t *in, size_t n, size_t group_size);

/* Reads n parameters of param_size bytes (checked) each into *out, a new array to free(). */
int zd__read_params(const zd_param_t *in, size_t n, size_t param_size, zd_param_t **out);

/* For a structure the library fills: ZD_OK when its size (given as `what`, at most max) is one
 * this library takes, else -EINVAL with a message saying `how` to set it. Checked before the call
 * does anything. */
int zd__check_filled(const char *what, size_t size, size_t max, const char *how);
#define ZD__CHECK_FILLED(out, type, init) \
  zd__check_filled(#type ".size", (out)->size, sizeof(type), "initialise it with " #init)

/* Writes the library's structure *full into the caller's *out, up to out's size (checked) and
 * leaving out's size as it is. */
void zd__write_filled(void *out, const void *full);

/* ---- client_register.c: the model's buffers ------------------------------------------------ */

/* Unmaps or frees the buffers (device ones only when zerod holds none of their handles) and
 * drops the layout; the client is then as before zd_layout(). */
void zd__release_buffers(zd_client_t *c);

/* ---- client_cuda.c: device buffers --------------------------------------------------------- */

#ifdef ZD_HAVE_CUDA
#define ZD__HAVE_CUDA 1

/* Allocates zeroed param and grad buffers of c->param_bytes and c->grad_bytes on CUDA device
 * `device`, which must be the rank's GPU, with their ring of IPC events, and fills the handles
 * the register request carries. Sets c->memory to ZD_MEMORY_CUDA once anything is made: on
 * failure zd__cuda_release() undoes it. */
int zd__cuda_create_buffers(zd_client_t *c, int device);

/* Frees the device buffers and events, unless zerod may have them open (c->exported): they are
 * then left allocated until the process exits. Forgets them either way. */
void zd__cuda_release(zd_client_t *c);

/* Before a request that lets zerod touch the buffers: takes a free event slot (*slot) and records
 * its "grads ready" on the client's stream. Host buffers: *slot is -1 and nothing happens. On
 * failure no slot is taken. */
int zd__cuda_before_request(zd_client_t *c, int *slot);

/* After the reply of the request of event slot `slot` (-1: none): the client's stream waits on
 * the slot's "params ready". Host buffers: nothing. */
int zd__cuda_after_reply(zd_client_t *c, int slot);

/* ZD_OK when the stream belongs to the buffers' GPU; -EINVAL (or CUDA's error) otherwise. */
int zd__cuda_check_stream(const zd_client_t *c, void *stream);

/* *device: this process's ordinal of the GPU whose UUID zerod gave in hello (c->rank_uuid). */
int zd__cuda_find_device(const zd_client_t *c, int *device);

/* Page-locks the mapped host buffers for CUDA (cudaHostRegister, portable) in the primary
 * context of CUDA device `device`; sets c->memory to ZD_MEMORY_HOST_PINNED and c->pinned as it
 * goes: on failure zd__cuda_unpin() undoes what was done. */
int zd__cuda_pin(zd_client_t *c, int device);

/* Unregisters what zd__cuda_pin() registered (before the buffers are unmapped). */
void zd__cuda_unpin(zd_client_t *c);

#else
#define ZD__HAVE_CUDA 0

/* Without CUDA no client ever has device buffers (zd_layout() refuses them first). */
static inline int zd__cuda_create_buffers(zd_client_t *c, int device) {
  (void)c, (void)device;
  return zd__fail(ZD_EBACKEND, "this libzerod was built without CUDA: no device buffers");
}
static inline void zd__cuda_release(zd_client_t *c) {
  (void)c;
}
static inline int zd__cuda_before_request(zd_client_t *c, int *slot) {
  (void)c;
  *slot = -1;
  return ZD_OK;
}
static inline int zd__cuda_after_reply(zd_client_t *c, int slot) {
  (void)c, (void)slot;
  return ZD_OK;
}
static inline int zd__cuda_check_stream(const zd_client_t *c, void *stream) {
  (void)c, (void)stream;
  return ZD_OK;
}
static inline int zd__cuda_find_device(const zd_client_t *c, int *device) {
  (void)c, (void)device;
  return zd__fail(ZD_EBACKEND, "this libzerod was built without CUDA");
}
static inline int zd__cuda_pin(zd_client_t *c, int device) {
  (void)c, (void)device;
  return zd__fail(ZD_EBACKEND,
                  "this libzerod was built without CUDA: it cannot pin host buffers "
                  "(ZD_MEMORY_HOST_PINNED); use ZD_MEMORY_HOST");
}
static inline void zd__cuda_unpin(zd_client_t *c) {
  (void)c;
}
#endif

#endif /* ZEROD_CLIENT_INTERNAL_H */
