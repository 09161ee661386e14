/* The world size record (world_record.h): its text, its file in state_dir, its key in the
 * rendezvous store. */
#include "world_record.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "rendezvous.h"

#define FORM "\"world_size=N from=W step=S\" (N and W from 1 to 65535, S a step)"

/* One "name=number" field at *p, followed by a space or the end. */
static int field(const char **p, const char *end, const char *name, uint64_t max, uint64_t *out,
                 const char *where, const char *text, zd__err_t *err) {
  size_t n = strlen(name);
  if ((size_t)(end - *p) < n + 1 || memcmp(*p, name, n) != 0 || (*p)[n] != '=')
    return zd__errf(err, ZD_ECONFIG,
                    "%s: world size record '%s': expected '%s=' at '%.*s'; the "
                    "record is " FORM,
                    where, text, name, (int)(end - *p), *p);
  const char *q = *p + n + 1;
  uint64_t v = 0;
  const char *digits = q;
  while (q < end && *q >= '0' && *q <= '9') {
    uint64_t d = (uint64_t)(*q++ - '0');
    if (v > (UINT64_MAX - d) / 10) {
      digits = NULL;
      break;
    }
    v = v * 10 + d;
  }
  if (!digits || q == digits || (q < end && *q != ' ') || v > max || (max != UINT64_MAX && !v))
    return zd__errf(err, ZD_ECONFIG,
                    "%s: world size record '%s': %s is not a number from %d "
                    "to %" PRIu64 "; the record is " FORM,
                    where, text, name, max == UINT64_MAX ? 0 : 1, max);
  *out = v;
  *p = q < end ? q + 1 : q;
  return ZD_OK;
}

int zd__world_record_parse(const char *text, size_t len, const char *where, zd__world_record_t *out,
                           zd__err_t *err) {
  char shown[ZD__WORLD_RECORD_MAX + 1];
  if (len && text[len - 1] == '\n') len--;
  size_t slen = len < ZD__WORLD_RECORD_MAX ? len : ZD__WORLD_RECORD_MAX;
  for (size_t i = 0; i < slen; i++) /* the message shows it on one line, printable */
    shown[i] = text[i] >= ' ' && text[i] <= '~' ? text[i] : '?';
  shown[slen] = '\0';
  if (len == 0)
    return zd__errf(err, ZD_ECONFIG, "%s: the world size record is empty; the record is " FORM,
                    where);
  if (len >= ZD__WORLD_RECORD_MAX || memchr(text, '\n', len) || memchr(text, '\0', len))
    return zd__errf(err, ZD_ECONFIG,
                    "%s: world size record '%s' is not one line of at most %d "
                    "bytes; the record is " FORM,
                    where, shown, ZD__WORLD_RECORD_MAX - 1);
  /* Parsed from the printable copy (a byte it replaced fails the parse either way), so that the
   * messages below quote only printable text. */
  const char *p = shown, *end = shown + len;
  uint64_t w = 0, from = 0, step = 0;
  int rc = field(&p, end, "world_size", 65535, &w, where, shown, err);
  if (!rc) rc = field(&p, end, "from", 65535, &from, where, shown, err);
  if (!rc) rc = field(&p, end, "step", UINT64_MAX, &step, where, shown, err);
  if (!rc && p != end)
    rc = zd__errf(err, ZD_ECONFIG,
                  "%s: world size record '%s': unexpected '%.*s' after the "
                  "step; the record is " FORM,
                  where, shown, (int)(end - p), p);
  if (rc) return rc;
  *out = (zd__world_record_t){.world_size = (uint32_t)w, .from = (uint32_t)from, .step = step};
  return ZD_OK;
}

size_t zd__world_record_format(const zd__world_record_t *rec, char *buf, size_t len) {
  int n = snprintf(buf, len, "world_size=%u from=%u step=%" PRIu64 "\n", rec->world_size, rec->from,
                   rec->step);
  return n < 0 ? 0 : (size_t)n < len ? (size_t)n : len - 1;
}

int zd__world_record_write(const char *dir, const char *tag, const zd__world_record_t *rec,
                           zd__err_t *err) {
  char path[4096], tmp[4096], text[ZD__WORLD_RECORD_MAX];
  snprintf(path, sizeof path, "%s/" ZD__WORLD_RECORD_FILE, dir);
  snprintf(tmp, sizeof tmp, "%s/." ZD__WORLD_RECORD_FILE ".%s.tmp", dir, tag);
  size_t n = zd__world_record_format(rec, text, sizeof text);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return zd__errf(err, -errno, "world size record %s: %s", tmp, strerror(errno));
  int rc = ZD_OK;
  /* O_CREAT's mode is masked by the umask, and an old file keeps its own: set it. */
  errno = 0; /* a short write sets none: EIO below */
  if (fchmod(fd, 0600) != 0 || write(fd, text, n) != (ssize_t)n || fsync(fd) != 0)
    rc = zd__errf(err, errno ? -errno : -EIO, "world size record %s: %s", tmp,
                  strerror(errno ? errno : EIO));
  close(fd);
  if (!rc && rename(tmp, path) != 0)
    rc =
        zd__errf(err, -errno, "world size record %s: rename to %s: %s", tmp, path, strerror(errno));
  if (rc) {
    unlink(tmp);
    return rc;
  }
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* the rename survives a crash */
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return ZD_OK;
}

int zd__world_record_read(const char *dir, zd__world_record_t *out, zd__err_t *err) {
  char path[4096], text[ZD__WORLD_RECORD_MAX + 1];
  snprintf(path, sizeof path, "%s/" ZD__WORLD_RECORD_FILE, dir);
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK); /* a FIFO: no wait */
  if (fd < 0 && errno == ENOENT) return -ENOENT;
  if (fd < 0) return zd__errf(err, -errno, "world size record %s: %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return zd__errf(err, ZD_ECONFIG, "world size record %s: not a regular file", path);
  }
  ssize_t n = read(fd, text, sizeof text);
  int e = errno;
  close(fd);
  if (n < 0) return zd__errf(err, -e, "world size record %s: %s", path, strerror(e));
  return zd__world_record_parse(text, (size_t)n, path, out, err);
}

static int open_store(const char *address, const char *token, zd__rdv_t **rdv, zd__err_t *err) {
  int rc = zd__rdv_open(address, rdv, err);
  if (!rc && token && token[0]) rc = zd__rdv_set_token(*rdv, token, err);
  return rc;
}

int zd__world_record_publish(const char *address, const char *token, const zd__world_record_t *rec,
                             int timeout_ms, zd__err_t *err) {
  char text[ZD__WORLD_RECORD_MAX];
  size_t n = zd__world_record_format(rec, text, sizeof text);
  zd__rdv_t *rdv = NULL;
  int rc = open_store(address, token, &rdv, err);
  /* Keys are written once: the new record replaces the old one. */
  if (!rc) rc = zd__rdv_delete(rdv, ZD__WORLD_RECORD_KEY, timeout_ms, err);
  if (!rc) rc = zd__rdv_set(rdv, ZD__WORLD_RECORD_KEY, text, n, timeout_ms, err);
  zd__rdv_close(rdv);
  return rc;
}

int zd__world_record_lookup(const char *address, const char *token, zd__world_record_t *out,
                            int *malformed, int timeout_ms, zd__err_t *err) {
  *malformed = 0;
  zd__rdv_t *rdv = NULL;
  void *v = NULL;
  size_t len = 0;
  int found = 0;
  int rc = open_store(address, token, &rdv, err);
  if (!rc) rc = zd__rdv_lookup(rdv, ZD__WORLD_RECORD_KEY, &v, &len, &found, timeout_ms, err);
  if (!rc && !found) rc = -ENOENT;
  if (!rc) {
    char where[300];
    snprintf(where, sizeof where, "rendezvous store %s, key " ZD__WORLD_RECORD_KEY, address);
    rc = zd__world_record_parse(v, len, where, out, err);
    *malformed = rc != ZD_OK;
  }
  free(v);
  zd__rdv_close(rdv);
  return rc;
}
