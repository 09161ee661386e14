/* The listening Unix socket (daemon.h): created with the configured mode, refusing to take over a
 * socket another zerod still serves, handing each accepted connection with its peer credentials
 * (SO_PEERCRED) to a new session, and removed at shutdown. */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon.h"
#include "log.h"
#include "session.h"

static ino_t socket_inode; /* to remove only our own socket file at shutdown */

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
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
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

/* Another daemon is alive on path if a connection to it succeeds. */
static int socket_in_use(const char *path) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
  int alive = connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0;
  close(fd);
  return alive;
}

static int prepare_path(const char *path, zd__err_t *err) {
  char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
  snprintf(dir, sizeof dir, "%s", path);
  char *parent = dirname(dir);
  if (mkdir(parent, 0755) != 0 && errno != EEXIST)
    return zd__errf(err, -errno, "cannot create socket directory %s: %s", parent, strerror(errno));
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
  if (rc) return rc;

  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return zd__errf(err, -errno, "socket: %s", strerror(errno));
  /* Create the socket file with no access for anyone, then open it up to socket_mode: no window
   * in which a process outside the allowed set could connect. */
  mode_t old = umask(0777);
  rc = bind(fd, (struct sockaddr *)&addr, sizeof addr);
  int bind_errno = errno;
  umask(old);
  if (rc != 0) {
    close(fd);
    return zd__errf(err, -bind_errno, "cannot bind %s: %s", path, strerror(bind_errno));
  }
  struct stat st;
  if (chmod(path, (mode_t)d->cfg->socket_mode) != 0 || stat(path, &st) != 0) {
    rc = zd__errf(err, -errno, "cannot set mode %04o on %s: %s", d->cfg->socket_mode, path,
                  strerror(errno));
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
  d->listen_poll.data = d;
  d->listen_fd = fd;
  d->listening = 1;
  uv_poll_start(&d->listen_poll, UV_READABLE, on_connection);
  ZD_LOG_INFO("listening on %s (mode %04o)", path, d->cfg->socket_mode);
  return ZD_OK;

fail:
  unlink(path);
  close(fd);
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
  uv_close((uv_handle_t *)&d->listen_poll, on_listen_closed);
  ZD_LOG_INFO("stopped listening; removed %s", d->socket_path);
}
