/* The file plumbing of checkpoints (ckpt_file.h): whole reads and writes, and atomic files. */
#include "ckpt_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

static int write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len) {
    ssize_t w = write(fd, p, len);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    p += w;
    len -= (size_t)w;
  }
  return 0;
}

ssize_t zd__ckpt_pread_all(int fd, void *buf, size_t len, uint64_t off) {
  char *p = buf;
  size_t done = 0;
  while (done < len) {
    ssize_t r = pread(fd, p + done, len - done, (off_t)(off + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (r == 0) break;
    done += (size_t)r;
  }
  return (ssize_t)done;
}

int zd__ckpt_join(char *buf, size_t len, const char *dir, const char *name) {
  int n = snprintf(buf, len, "%s/%s", dir, name);
  return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

int zd__ckpt_fsync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -errno;
  int rc = fsync(fd) ? -errno : 0;
  close(fd);
  return rc;
}

int zd__ckpt_afile_open(zd__ckpt_afile_t *f, const char *path, zd__err_t *err) {
  f->fd = -1;
  f->bytes = 0;
  f->xxh = NULL;
  int n = snprintf(f->path, sizeof f->path, "%s", path);
  int m = snprintf(f->tmp, sizeof f->tmp, "%s.tmp", path);
  if (n < 0 || (size_t)n >= sizeof f->path || m < 0 || (size_t)m >= sizeof f->tmp)
    return zd__errf(err, -ENAMETOOLONG, "%s: path too long", path);
  f->xxh = XXH3_createState();
  if (!f->xxh || XXH3_64bits_reset(f->xxh) != XXH_OK) {
    XXH3_freeState(f->xxh);
    f->xxh = NULL;
    return zd__errf(err, -ENOMEM, "%s: out of memory for the checksum state", path);
  }
  f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f->fd < 0) {
    int rc = -errno;
    XXH3_freeState(f->xxh);
    f->xxh = NULL;
    return zd__errf(err, rc, "cannot create %s: %s", f->tmp, strerror(-rc));
  }
  return ZD_OK;
}

int zd__ckpt_afile_write(zd__ckpt_afile_t *f, const void *p, size_t n, zd__err_t *err) {
  int rc = write_all(f->fd, p, n);
  if (rc) return zd__errf(err, rc, "cannot write %s: %s", f->tmp, strerror(-rc));
  XXH3_64bits_update(f->xxh, p, n);
  f->bytes += n;
  return ZD_OK;
}

void zd__ckpt_afile_abort(zd__ckpt_afile_t *f) {
  if (f->fd >= 0) {
    close(f->fd);
    unlink(f->tmp);
  }
  f->fd = -1;
  XXH3_freeState(f->xxh);
  f->xxh = NULL;
}

int zd__ckpt_afile_commit(zd__ckpt_afile_t *f, uint64_t *xxh3, zd__err_t *err) {
  int rc = 0;
  if (fsync(f->fd)) {
    rc = -errno;
    zd__errf(err, rc, "cannot fsync %s: %s", f->tmp, strerror(-rc));
    goto fail;
  }
  if (close(f->fd)) {
    rc = -errno;
    f->fd = -1;
    unlink(f->tmp);
    zd__errf(err, rc, "cannot close %s: %s", f->tmp, strerror(-rc));
    goto fail;
  }
  f->fd = -1;
  if (rename(f->tmp, f->path)) {
    rc = -errno;
    unlink(f->tmp);
    zd__errf(err, rc, "cannot rename %s to %s: %s", f->tmp, f->path, strerror(-rc));
    goto fail;
  }
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s", f->path);
  char *slash = strrchr(dir, '/');
  if (!slash)
    snprintf(dir, sizeof dir, ".");
  else if (slash == dir)
    dir[1] = '\0';
  else
    *slash = '\0';
  if ((rc = zd__ckpt_fsync_dir(dir))) {
    zd__errf(err, rc, "cannot fsync directory %s: %s", dir, strerror(-rc));
    goto fail;
  }
  if (xxh3) *xxh3 = XXH3_64bits_digest(f->xxh);
  XXH3_freeState(f->xxh);
  f->xxh = NULL;
  return ZD_OK;
fail:
  zd__ckpt_afile_abort(f);
  return rc;
}
