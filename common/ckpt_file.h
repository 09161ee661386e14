/* The file plumbing of checkpoints: whole writes and reads that survive EINTR and short counts,
 * paths joined without truncation, and the atomic file every checkpoint file is written as.
 *
 * A checkpoint is complete exactly when its manifest exists and every file it lists has its size
 * and checksum (checkpoint_format.h), so every file is written under "<path>.tmp", hashed with
 * XXH3 as it is written, fsynced, renamed over <path> and its directory fsynced: a crash leaves
 * either the old file or the new one, never a part. Rank files, the manifest, exports and imports
 * all go through here, so that a fix to durability is made once.
 *
 * Errors: -errno from the system, with a message naming the file where the function takes err.
 * Thread-safe: no state outside the caller's zd__ckpt_afile_t.
 */
#ifndef ZD_COMMON_CKPT_FILE_H
#define ZD_COMMON_CKPT_FILE_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "error.h"

/* Reads len bytes at off: the bytes read (fewer than len only at the end of the file), or -errno.
 */
ssize_t zd__ckpt_pread_all(int fd, void *buf, size_t len, uint64_t off);

/* "<dir>/<name>" into buf: 0, or -ENAMETOOLONG when it does not fit (no message). */
int zd__ckpt_join(char *buf, size_t len, const char *dir, const char *name);

/* fsyncs the directory dir: a rename into it is durable only then. 0 or -errno (no message). */
int zd__ckpt_fsync_dir(const char *dir);

/* A file being written atomically. The caller allocates it; fd is -1 once it is closed. */
typedef struct zd__ckpt_afile {
  int fd;
  char path[PATH_MAX];
  char tmp[PATH_MAX]; /* path + ".tmp": where the bytes go until the commit */
  struct XXH3_state_s *xxh;
  uint64_t bytes; /* written so far */
} zd__ckpt_afile_t;

/* Creates (or truncates) path.tmp for writing. On an error nothing is left to abort. */
int zd__ckpt_afile_open(zd__ckpt_afile_t *f, const char *path, zd__err_t *err);

/* Appends n bytes and adds them to the checksum. Blocks until the kernel took them. */
int zd__ckpt_afile_write(zd__ckpt_afile_t *f, const void *p, size_t n, zd__err_t *err);

/* fsync, rename over path, fsync of path's directory; *xxh3 (may be NULL) receives the checksum
 * of every byte written. On an error the temporary file is removed and f is released. */
int zd__ckpt_afile_commit(zd__ckpt_afile_t *f, uint64_t *xxh3, zd__err_t *err);

/* Removes the temporary file and releases f; accepts a file that failed to open, or was
 * committed (then it does nothing). */
void zd__ckpt_afile_abort(zd__ckpt_afile_t *f);

#endif /* ZD_COMMON_CKPT_FILE_H */
