/* The checkpoints under a root directory (ckpt_root.h): listing, choosing the newest that loads,
 * and retention. */
#include "ckpt_root.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_file.h"
#include "ckpt_load.h"

static int cmp_desc(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? 1 : x > y ? -1 : 0;
}

int zd__ckpt_list(const char *root, uint64_t **steps, size_t *n, zd__err_t *err) {
  *steps = NULL;
  *n = 0;
  DIR *d = opendir(root);
  if (!d) {
    if (errno == ENOENT) return ZD_OK;
    int rc = -errno;
    return zd__errf(err, rc, "cannot list checkpoints in %s: %s", root, strerror(-rc));
  }
  uint64_t *v = NULL;
  size_t cnt = 0, cap = 0;
  int rc = ZD_OK;
  struct dirent *e;
  while ((e = readdir(d))) {
    const char *digits = e->d_name + 5;
    size_t nd = strlen(digits);
    if (strncmp(e->d_name, "step-", 5) != 0 || nd == 0 || nd > 19 ||
        strspn(digits, "0123456789") != nd)
      continue;
    struct stat st;
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) || !S_ISDIR(st.st_mode)) continue;
    if (cnt == cap) {
      cap = cap ? cap * 2 : 16;
      uint64_t *nv = realloc(v, cap * sizeof *nv);
      if (!nv) {
        rc = zd__errf(err, -ENOMEM, "out of memory listing %s", root);
        break;
      }
      v = nv;
    }
    v[cnt++] = strtoull(digits, NULL, 10);
  }
  closedir(d);
  if (rc) {
    free(v);
    return rc;
  }
  if (cnt) qsort(v, cnt, sizeof *v, cmp_desc);
  *steps = v;
  *n = cnt;
  return ZD_OK;
}

/* A checkpoint directory as choosing and pruning see it. */
typedef struct entry {
  uint64_t step;
  uint64_t created_ms; /* the manifest's; 0 when it has none that reads */
  uint64_t mtime_ms;   /* the directory's last change (files created or renamed in it) */
  int complete;        /* a manifest that reads (its files are checked later) */
} entry_t;

/* Most recently completed first: the newest checkpoint is the one written last, not the one with
 * the highest step (a fresh run in a directory that holds an older run's checkpoints must not
 * lose its own to the retention, nor resume the old run's). Then the ones without a readable
 * manifest, highest step first. */
static int cmp_entry(const void *a, const void *b) {
  const entry_t *x = a, *y = b;
  if (x->complete != y->complete) return x->complete ? -1 : 1;
  if (x->complete && x->created_ms != y->created_ms) return x->created_ms < y->created_ms ? 1 : -1;
  return x->step < y->step ? 1 : x->step > y->step ? -1 : 0;
}

static int list_entries(const char *root, entry_t **out, size_t *n, zd__err_t *err) {
  uint64_t *steps;
  int rc = zd__ckpt_list(root, &steps, n, err);
  if (rc) return rc;
  entry_t *v = calloc(*n ? *n : 1, sizeof *v);
  if (!v) {
    free(steps);
    return zd__errf(err, -ENOMEM, "out of memory listing %s", root);
  }
  for (size_t i = 0; i < *n; i++) {
    char dir[PATH_MAX];
    zd__err_t e = {0};
    zd__ckpt_manifest_t *m = NULL;
    v[i].step = steps[i];
    struct stat st;
    if (zd__ckpt_dir_name(root, steps[i], dir, sizeof dir) == 0 && stat(dir, &st) == 0)
      v[i].mtime_ms = (uint64_t)st.st_mtim.tv_sec * 1000 + (uint64_t)st.st_mtim.tv_nsec / 1000000;
    if (zd__ckpt_dir_name(root, steps[i], dir, sizeof dir) == 0 &&
        zd__ckpt_read_manifest(dir, &m, &e) == 0) {
      v[i].complete = 1;
      v[i].created_ms = m->created_ms;
    }
    zd__ckpt_manifest_free(m);
  }
  free(steps);
  if (*n) qsort(v, *n, sizeof *v, cmp_entry);
  *out = v;
  return ZD_OK;
}

int zd__ckpt_find_latest(const char *root, const zd__layout_t *want, zd__ckpt_reject_fn reject,
                         void *ctx, char **dir_out, zd__ckpt_manifest_t **m_out, zd__err_t *err) {
  *dir_out = NULL;
  *m_out = NULL;
  entry_t *entries;
  size_t n;
  int rc = list_entries(root, &entries, &n, err);
  if (rc) return rc;
  size_t passed = 0;
  for (size_t i = 0; i < n; i++) {
    char dir[PATH_MAX], diff[ZD__ERR_MSG_MAX - 64];
    zd__err_t e = {0};
    zd__ckpt_manifest_t *m = NULL;
    if (zd__ckpt_dir_name(root, entries[i].step, dir, sizeof dir)) continue;
    if (!zd__ckpt_read_manifest(dir, &m, &e) && !zd__ckpt_verify(dir, m, &e)) {
      if (!want || zd__ckpt_same_params(m->layout, want, diff, sizeof diff)) {
        *dir_out = strdup(dir);
        if (!*dir_out) {
          zd__ckpt_manifest_free(m);
          free(entries);
          return zd__errf(err, -ENOMEM, "out of memory");
        }
        *m_out = m;
        free(entries);
        return ZD_OK;
      }
      zd__errf(&e, ZD_ELAYOUT, "the model differs from the checkpoint's: %s", diff);
    }
    zd__ckpt_manifest_free(m);
    passed++;
    if (reject) reject(ctx, dir, e.msg);
  }
  free(entries);
  return zd__errf(err, -ENOENT, "no complete checkpoint under %s (%zu passed over)", root, passed);
}

/* Removes a checkpoint directory: the manifest first (durably), so that an interrupted removal
 * leaves an incomplete directory that the next prune takes, never a broken "complete" one. */
static int remove_ckpt(const char *root, const char *dir, zd__err_t *err) {
  char path[PATH_MAX];
  int rc = 0;
  if (zd__ckpt_join(path, sizeof path, dir, ZD__CKPT_MANIFEST) == 0 && unlink(path) == 0)
    zd__ckpt_fsync_dir(dir);
  DIR *d = opendir(dir);
  if (!d) {
    rc = -errno;
    return zd__errf(err, rc, "cannot remove %s: %s", dir, strerror(-rc));
  }
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    if (unlinkat(dirfd(d), e->d_name, 0) && errno != ENOENT) {
      rc = -errno;
      zd__errf(err, rc, "cannot remove %s/%s: %s", dir, e->d_name, strerror(-rc));
      break;
    }
  }
  closedir(d);
  if (!rc && rmdir(dir)) {
    rc = -errno;
    zd__errf(err, rc, "cannot remove %s: %s", dir, strerror(-rc));
  }
  if (!rc) zd__ckpt_fsync_dir(root);
  return rc;
}

int zd__ckpt_prune(const char *root, uint32_t keep, zd__err_t *err) {
  if (keep == 0) return ZD_OK;
  entry_t *entries;
  size_t n;
  int rc = list_entries(root, &entries, &n, err);
  if (rc) return rc;
  /* The newest complete one (entries[0] when there is one) bounds the leftovers: a directory
   * without a manifest at a higher step may be being written now. */
  uint64_t newest_step = n && entries[0].complete ? entries[0].step : UINT64_MAX;
  uint64_t newest_ms = n && entries[0].complete ? entries[0].created_ms : 0;
  uint32_t kept = 0;
  for (size_t i = 0; i < n && !rc; i++) {
    char dir[PATH_MAX];
    if (zd__ckpt_dir_name(root, entries[i].step, dir, sizeof dir)) continue;
    /* A directory without a manifest is a crash's leftover only when it is below the newest
     * complete step and has not changed since that checkpoint was written; else it may be being
     * written now (by this run, or by a fresh run below an older run's steps). */
    if (entries[i].complete ? kept++ < keep
                            : newest_step == UINT64_MAX || entries[i].step >= newest_step ||
                                  entries[i].mtime_ms >= newest_ms)
      continue;
    rc = remove_ckpt(root, dir, err);
  }
  free(entries);
  return rc;
}
