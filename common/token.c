/* The control token (token.h). */
#include "token.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TOKEN_MIN 16

int zd__token_load(const char *path, char *buf, zd__err_t *err) {
  buf[0] = '\0';
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return zd__errf(err, -errno, "control_token_file %s: %s", path, strerror(errno));
  struct stat st;
  int rc = ZD_OK;
  if (fstat(fd, &st) != 0) {
    rc = zd__errf(err, -errno, "control_token_file %s: %s", path, strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    rc = zd__errf(err, ZD_ECONFIG, "control_token_file %s is not a regular file", path);
  } else if (st.st_mode & 027) {
    rc = zd__errf(err, ZD_ECONFIG,
                  "control_token_file %s has mode %04o; expected no access for others and no "
                  "write for the group (chmod 600, or 640 for a Kubernetes secret's fsGroup)",
                  path, (unsigned)(st.st_mode & 07777));
  } else if (st.st_uid != geteuid() && st.st_uid != 0) {
    rc = zd__errf(err, ZD_ECONFIG,
                  "control_token_file %s belongs to uid %u; expected this user (%u) or root", path,
                  (unsigned)st.st_uid, (unsigned)geteuid());
  }
  char text[ZD__TOKEN_MAX + 1];
  ssize_t n = rc ? 0 : read(fd, text, sizeof text - 1);
  close(fd);
  if (rc) return rc;
  if (n < 0) return zd__errf(err, -errno, "control_token_file %s: %s", path, strerror(errno));
  text[n] = '\0';
  size_t len = strcspn(text, "\r\n");
  if (len < TOKEN_MIN || len >= ZD__TOKEN_MAX)
    return zd__errf(err, ZD_ECONFIG,
                    "control_token_file %s: the token (its first line) has %zu bytes; expected "
                    "%d to %d (e.g. openssl rand -hex 32)",
                    path, len, TOKEN_MIN, ZD__TOKEN_MAX - 1);
  for (size_t i = 0; i < len; i++)
    if (text[i] <= ' ' || text[i] > '~')
      return zd__errf(err, ZD_ECONFIG,
                      "control_token_file %s: byte %zu of the token is not printable ASCII "
                      "without spaces",
                      path, i);
  memcpy(buf, text, len);
  buf[len] = '\0';
  return ZD_OK;
}

int zd__token_equal(const char *a, const char *b) {
  size_t la = strlen(a), lb = strlen(b);
  unsigned char diff = la != lb;
  for (size_t i = 0; i < la && i < lb; i++) diff |= (unsigned char)(a[i] ^ b[i]);
  return diff == 0;
}
