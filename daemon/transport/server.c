/* The listening Unix socket (server.h). */
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "log.h"
#include "session.h"

#define ACCEPT_PAUSE_MS 100 /* out of descriptors: wait this long before accepting again */

struct zd__server {
  uv_loop_t *loop;
  const zd__config_t *cfg;
  zd__sessions_t *sessions; /* where accepted connections go */
  int listen_fd;
  uv_poll_t listen_poll;
  uv_timer_t accept_pause;
  int listening; /* between a successful start and the stop */
  int open_handles;
  char socket_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
  ino_t socket_inode;
  int lock_fd;
  char lock_path[sizeof(((struct sockaddr_un *)0)->sun_path) + 8];
};

static void on_connection(uv_poll_t *handle, int status, int events);

static void on_accept_resume(uv_timer_t *t) {
  zd__server_t *srv = t->data;
  if (srv->listening) uv_poll_start(&srv->listen_poll, UV_READABLE, on_connection);
}

/* The listener stays readable while connections wait; without descriptors to accept them the
 * loop would spin. Stop listening for a moment instead, and say so once per pause. */
static void pause_accepting(zd__server_t *srv, int err) {
  ZD_LOG_WARN("cannot accept connections: %s; accepting again in %d ms", strerror(err),
              ACCEPT_PAUSE_MS);
  uv_poll_stop(&srv->listen_poll);
  uv_timer_start(&srv->accept_pause, on_accept_resume, ACCEPT_PAUSE_MS, 0);
}

static void on_connection(uv_poll_t *handle, int status, int events) {
  zd__server_t *srv = handle->data;
  (void)events;
  if (status < 0) {
    ZD_LOG_ERROR("listening socket failed: %s", uv_strerror(status));
    return;
  }
  for (int i = 0; i < 64; i++) {
    int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
        pause_accepting(srv, errno);
      else if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
        ZD_LOG_ERROR("accept failed: %s", strerror(errno));
      return;
    }
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      ZD_LOG_ERROR("SO_PEERCRED failed: %s; dropping the connection", strerror(errno));
      close(fd);
      continue;
    }
    int rc = zd__session_create(srv->sessions, fd, &cred);
    if (rc) ZD_LOG_ERROR("cannot serve a new connection: %s", zd_strerror(rc));
  }
}

/* Another daemon is alive on path if it accepts a connection, or has a full backlog. Never blocks:
 * a stopped process holding the socket must not hang our start. */
static int socket_in_use(const char *path) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
  int alive = connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0 || errno == EAGAIN;
  close(fd);
  return alive;
}

/* Holds <socket>.lock for the daemon's lifetime: the check for a live socket, the removal of a
 * stale one and the bind happen under it. */
static int take_lock(zd__server_t *srv, const char *path, zd__err_t *err) {
  snprintf(srv->lock_path, sizeof srv->lock_path, "%s.lock", path);
  srv->lock_fd = open(srv->lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (srv->lock_fd < 0)
    return zd__errf(err, -errno, "cannot open %s: %s", srv->lock_path, strerror(errno));
  if (flock(srv->lock_fd, LOCK_EX | LOCK_NB) != 0) {
    int e = errno;
    close(srv->lock_fd);
    srv->lock_fd = -1;
    return zd__errf(err, e == EWOULDBLOCK ? -EADDRINUSE : -e, "%s: %s", srv->lock_path,
                    e == EWOULDBLOCK ? "another zerod holds it (running or starting on this "
                                       "socket)"
                                     : strerror(e));
  }
  return ZD_OK;
}

static void release_lock(zd__server_t *srv) {
  if (srv->lock_fd < 0) return;
  unlink(srv->lock_path);
  close(srv->lock_fd);
  srv->lock_fd = -1;
}

static int prepare_path(zd__server_t *srv, const char *path, zd__err_t *err) {
  char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
  snprintf(dir, sizeof dir, "%s", path);
  char *parent = dirname(dir);
  if (mkdir(parent, 0755) != 0 && errno != EEXIST)
    return zd__errf(err, -errno, "cannot create socket directory %s: %s", parent, strerror(errno));
  int rc = take_lock(srv, path, err);
  if (rc) return rc;
  struct stat st;
  if (lstat(path, &st) != 0) return ZD_OK;
  if (!S_ISSOCK(st.st_mode))
    return zd__errf(err, -EEXIST, "socket path %s exists and is not a socket", path);
  if (socket_in_use(path))
    return zd__errf(err, -EADDRINUSE, "another zerod is listening on %s", path);
  ZD_LOG_INFO("removing stale socket %s", path);
  if (unlink(path) != 0 && errno != ENOENT)
    return zd__errf(err, -errno, "cannot remove stale socket %s: %s", path, strerror(errno));
  return ZD_OK;
}

int zd__server_start(uv_loop_t *loop, const zd__config_t *cfg, zd__sessions_t *sessions,
                     zd__server_t **out, zd__err_t *err) {
  const char *path = cfg->socket_path;
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  *out = NULL;
  if (strlen(path) >= sizeof addr.sun_path)
    return zd__errf(err, -ENAMETOOLONG, "socket path %s is longer than %zu bytes", path,
                    sizeof addr.sun_path - 1);
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
  zd__server_t *srv = calloc(1, sizeof *srv);
  if (!srv) return zd__errf(err, -ENOMEM, "out of memory");
  *srv = (zd__server_t){
      .loop = loop, .cfg = cfg, .sessions = sessions, .listen_fd = -1, .lock_fd = -1};
  snprintf(srv->socket_path, sizeof srv->socket_path, "%s", path);
  int fd = -1;
  int rc = prepare_path(srv, path, err);
  if (rc) goto fail;

  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    rc = zd__errf(err, -errno, "socket: %s", strerror(errno));
    goto fail;
  }
  /* The socket file is created with socket_mode itself (no chmod afterwards): there is no window
   * in which a process outside the allowed set could connect. */
  mode_t old = umask(~(mode_t)cfg->socket_mode & 0777);
  rc = bind(fd, (struct sockaddr *)&addr, sizeof addr);
  int bind_errno = errno;
  umask(old);
  if (rc != 0) {
    rc = zd__errf(err, -bind_errno, "cannot bind %s: %s", path, strerror(bind_errno));
    goto fail;
  }
  struct stat st;
  if (stat(path, &st) != 0) {
    rc = zd__errf(err, -errno, "stat %s: %s", path, strerror(errno));
    goto fail_bound;
  }
  srv->socket_inode = st.st_ino;
  if (listen(fd, 128) != 0) {
    rc = zd__errf(err, -errno, "listen on %s: %s", path, strerror(errno));
    goto fail_bound;
  }
  rc = uv_poll_init(loop, &srv->listen_poll, fd);
  if (rc) {
    zd__errf(err, rc, "uv_poll_init: %s", uv_strerror(rc));
    goto fail_bound;
  }
  uv_timer_init(loop, &srv->accept_pause);
  srv->accept_pause.data = srv;
  srv->listen_poll.data = srv;
  srv->open_handles = 2;
  srv->listen_fd = fd;
  srv->listening = 1;
  uv_poll_start(&srv->listen_poll, UV_READABLE, on_connection);
  ZD_LOG_INFO("listening on %s (mode %04o)", path, cfg->socket_mode);
  *out = srv;
  return ZD_OK;

fail_bound:
  unlink(path);
fail:
  if (fd >= 0) close(fd);
  release_lock(srv);
  free(srv);
  return rc;
}

static void on_closed(uv_handle_t *h) {
  zd__server_t *srv = h->data;
  if (h == (uv_handle_t *)&srv->listen_poll) {
    close(srv->listen_fd);
    srv->listen_fd = -1;
  }
  srv->open_handles--;
}

void zd__server_stop(zd__server_t *srv) {
  if (!srv->listening) return;
  srv->listening = 0;
  struct stat st;
  if (lstat(srv->socket_path, &st) == 0 && st.st_ino == srv->socket_inode) unlink(srv->socket_path);
  release_lock(srv);
  uv_close((uv_handle_t *)&srv->accept_pause, on_closed);
  uv_close((uv_handle_t *)&srv->listen_poll, on_closed);
  ZD_LOG_INFO("stopped listening; removed %s", srv->socket_path);
}

void zd__server_destroy(zd__server_t *srv) {
  if (!srv) return;
  zd_assert(!srv->listening && srv->open_handles == 0);
  free(srv);
}

void zd__server_status(void *ctx, zd__status_t *st) {
  const zd__server_t *srv = ctx;
  zd__status_section(st, "server");
  zd__status_add(st, "socket", "%s", srv->socket_path);
}
