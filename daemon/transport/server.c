/* The listening Unix socket (daemon.h): created with the configured mode, refusing to take over a
 * socket another zerod still serves, handing each accepted connection with its peer credentials
 * (SO_PEERCRED) to a new session, and removed at shutdown.
 *
 * One listener per process, so its few pieces of state are file-local: the socket file's inode
 * (only our own file is removed at shutdown), the start lock (<socket>.lock, held while we run,
 * so that two zerods started at once cannot remove each other's socket), and the timer that
 * resumes accepting after the process ran out of file descriptors.
 */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon.h"
#include "log.h"
#include "session.h"

#define ACCEPT_PAUSE_MS 100 /* out of descriptors: wait this long before accepting again */

static ino_t socket_inode;
static int lock_fd = -1;
static char lock_path[sizeof(((struct sockaddr_un *)0)->sun_path) + 8];
static uv_timer_t accept_pause;

static void on_connection(uv_poll_t *handle, int status, int events);

static void on_accept_resume(uv_timer_t *t) {
  zd__daemon_t *d = t->data;
  if (d->listening) uv_poll_start(&d->listen_poll, UV_READABLE, on_connection);
}

/* The listener stays readable while connections wait; without descriptors to accept them the
 * loop would spin. Stop listening for a moment instead, and say so once per pause. */
static void pause_accepting(zd__daemon_t *d, int err) {
  ZD_LOG_WARN("cannot accept connections: %s; accepting again in %d ms", strerror(err),
              ACCEPT_PAUSE_MS);
  uv_poll_stop(&d->listen_poll);
  uv_timer_start(&accept_pause, on_accept_resume, ACCEPT_PAUSE_MS, 0);
}

static void on_connection(uv_poll_t *handle, int status, int events) {
  zd__daemon_t *d = handle->data;
  (void)events;
  if (status < 0) {
    ZD_LOG_ERROR("listening socket failed: %s", uv_strerror(status));
    return;
  }
  for (int i = 0; i < 64; i++) {
    int fd = accept4(d->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
        pause_accepting(d, errno);
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
    int rc = zd__session_create(d, fd, &cred);
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
static int take_lock(const char *path, zd__err_t *err) {
  snprintf(lock_path, sizeof lock_path, "%s.lock", path);
  lock_fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd < 0) return zd__errf(err, -errno, "cannot open %s: %s", lock_path, strerror(errno));
  if (flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    int e = errno;
    close(lock_fd);
    lock_fd = -1;
    return zd__errf(err, e == EWOULDBLOCK ? -EADDRINUSE : -e, "%s: %s", lock_path,
                    e == EWOULDBLOCK ? "another zerod holds it (running or starting on this "
                                       "socket)"
                                     : strerror(e));
  }
  return ZD_OK;
}

static void release_lock(void) {
  if (lock_fd < 0) return;
  unlink(lock_path);
  close(lock_fd);
  lock_fd = -1;
}

static int prepare_path(const char *path, zd__err_t *err) {
  char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
  snprintf(dir, sizeof dir, "%s", path);
  char *parent = dirname(dir);
  if (mkdir(parent, 0755) != 0 && errno != EEXIST)
    return zd__errf(err, -errno, "cannot create socket directory %s: %s", parent, strerror(errno));
  int rc = take_lock(path, err);
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

int zd__server_start(zd__daemon_t *d, zd__err_t *err) {
  const char *path = d->cfg->socket_path;
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof addr.sun_path)
    return zd__errf(err, -ENAMETOOLONG, "socket path %s is longer than %zu bytes", path,
                    sizeof addr.sun_path - 1);
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
  snprintf(d->socket_path, sizeof d->socket_path, "%s", path);
  int rc = prepare_path(path, err);
  if (rc) {
    release_lock();
    return rc;
  }

  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    rc = zd__errf(err, -errno, "socket: %s", strerror(errno));
    release_lock();
    return rc;
  }
  /* The socket file is created with socket_mode itself (no chmod afterwards): there is no window
   * in which a process outside the allowed set could connect. */
  mode_t old = umask(~(mode_t)d->cfg->socket_mode & 0777);
  rc = bind(fd, (struct sockaddr *)&addr, sizeof addr);
  int bind_errno = errno;
  umask(old);
  if (rc != 0) {
    close(fd);
    release_lock();
    return zd__errf(err, -bind_errno, "cannot bind %s: %s", path, strerror(bind_errno));
  }
  struct stat st;
  if (stat(path, &st) != 0) {
    rc = zd__errf(err, -errno, "stat %s: %s", path, strerror(errno));
    goto fail;
  }
  socket_inode = st.st_ino;
  if (listen(fd, 128) != 0) {
    rc = zd__errf(err, -errno, "listen on %s: %s", path, strerror(errno));
    goto fail;
  }
  rc = uv_poll_init(&d->loop, &d->listen_poll, fd);
  if (rc) {
    zd__errf(err, rc, "uv_poll_init: %s", uv_strerror(rc));
    goto fail;
  }
  uv_timer_init(&d->loop, &accept_pause);
  accept_pause.data = d;
  d->listen_poll.data = d;
  d->listen_fd = fd;
  d->listening = 1;
  uv_poll_start(&d->listen_poll, UV_READABLE, on_connection);
  ZD_LOG_INFO("listening on %s (mode %04o)", path, d->cfg->socket_mode);
  return ZD_OK;

fail:
  unlink(path);
  close(fd);
  release_lock();
  return rc;
}

static void on_listen_closed(uv_handle_t *h) {
  zd__daemon_t *d = h->data;
  close(d->listen_fd);
  d->listen_fd = -1;
}

void zd__server_stop(zd__daemon_t *d) {
  if (!d->listening) return;
  d->listening = 0;
  struct stat st;
  if (lstat(d->socket_path, &st) == 0 && st.st_ino == socket_inode) unlink(d->socket_path);
  release_lock();
  uv_close((uv_handle_t *)&accept_pause, NULL);
  uv_close((uv_handle_t *)&d->listen_poll, on_listen_closed);
  ZD_LOG_INFO("stopped listening; removed %s", d->socket_path);
}
