/* Reading a checkpoint's rank files (ckpt_load.h): verification against the manifest, and the
 * resharding load that maps a rank of any layout onto the writer's rank files. */
#include "ckpt_load.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "ckpt_file.h"
#include "safetensors.h"

#define CHUNK     (8u << 20) /* bytes per read while verifying: large, for throughput */
#define MERGE_GAP (1u << 16) /* elements of padding a load reads through to merge two runs */
#define F32_BYTES ZD__SAFETENSORS_F32_BYTES

/* ---- verification ---------------------------------------------------------------------------- */

/* Opens rank file r of m and checks its size and header (not its checksum). */
static int open_rank_file(const char *dir, const zd__ckpt_manifest_t *m, uint32_t r, int *fd,
                          zd__ckpt_shard_hdr_t *h, zd__err_t *err) {
  return zd__ckpt_shard_open(dir, &m->files[r], r, m->world_size, m->step, m->layout->shard_elems,
                             m->states, fd, h, err);
}

int zd__ckpt_verify(const char *dir, const zd__ckpt_manifest_t *m, zd__err_t *err) {
  char *buf = malloc(CHUNK);
  XXH3_state_t *xxh = XXH3_createState();
  int rc = 0;
  if (!buf || !xxh) {
    rc = zd__errf(err, -ENOMEM, "%s: out of memory to verify", dir);
    goto exit;
  }
  for (uint32_t r = 0; r < m->nfiles && !rc; r++) {
    const zd__ckpt_file_t *f = &m->files[r];
    char path[PATH_MAX];
    if (zd__ckpt_join(path, sizeof path, dir, f->name)) {
      rc = zd__errf(err, -ENAMETOOLONG, "%s/%s: path too long", dir, f->name);
      break;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      rc = -errno;
      zd__errf(err, rc, "%s: %s (expected %" PRIu64 " bytes, checksum 0x%016" PRIx64 ")", path,
               strerror(-rc), f->bytes, f->xxh3);
      break;
    }
    posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    XXH3_64bits_reset(xxh);
    uint64_t bytes = 0;
    for (;;) {
      ssize_t n = zd__ckpt_pread_all(fd, buf, CHUNK, bytes);
      if (n < 0) {
        rc = zd__errf(err, (int)n, "%s: %s", path, strerror((int)-n));
        break;
      }
      XXH3_64bits_update(xxh, buf, (size_t)n);
      bytes += (uint64_t)n;
      if ((size_t)n < CHUNK) break;
    }
    if (!rc) {
      uint64_t sum = XXH3_64bits_digest(xxh);
      if (bytes != f->bytes || sum != f->xxh3) {
        rc = zd__errf(err, -EBADMSG,
                      "%s: %" PRIu64 " bytes, checksum 0x%016" PRIx64 "; expected %" PRIu64
                      " bytes, checksum 0x%016" PRIx64,
                      f->name, bytes, sum, f->bytes, f->xxh3);
      }
    }
    close(fd);
    if (!rc) {
      int hfd;
      zd__ckpt_shard_hdr_t h;
      if (!(rc = open_rank_file(dir, m, r, &hfd, &h, err))) close(hfd);
    }
  }
exit:
  XXH3_freeState(xxh);
  free(buf);
  return rc;
}

/* ---- resharding ------------------------------------------------------------------------------ */

/* A contiguous run of elements: `n` of them at `src` in the writer's rank file `file` (shard
 * element index), to `dst` in the reader's array. */
typedef struct run {
  uint32_t file;
  uint64_t src, dst, n;
} run_t;

typedef struct runs {
  run_t *v;
  size_t n, cap;
} runs_t;

/* Appends a run, merging it into the previous one when they come from the same file with the same
 * distance between them on both sides (the padding between is read too, and zeroed after). */
static int runs_add(runs_t *rs, uint32_t file, uint64_t src, uint64_t dst, uint64_t n) {
  if (rs->n) {
    run_t *last = &rs->v[rs->n - 1];
    uint64_t dst_end = last->dst + last->n, src_end = last->src + last->n;
    if (last->file == file && dst >= dst_end && src >= src_end && dst - dst_end == src - src_end &&
        dst - dst_end <= MERGE_GAP) {
      last->n = dst + n - last->dst;
      return 0;
    }
  }
  if (rs->n == rs->cap) {
    size_t cap = rs->cap ? rs->cap * 2 : 64;
    run_t *v = realloc(rs->v, cap * sizeof *v);
    if (!v) return -ENOMEM;
    rs->v = v;
    rs->cap = cap;
  }
  rs->v[rs->n++] = (run_t){.file = file, .src = src, .dst = dst, .n = n};
  return 0;
}

/* Elements [i0, i1) of parameter p, bound for dst onwards, as runs of the writer's rank files. */
static int map_param(const zd__layout_t *old, uint32_t p, uint64_t i0, uint64_t i1, uint64_t dst,
                     runs_t *rs) {
  const zd__layout_param_t *op = &old->params[p];
  const zd__bucket_t *ob = &old->buckets[op->bucket];
  for (uint64_t i = i0; i < i1;) {
    uint64_t rel = op->offset + i - ob->offset;
    uint64_t file = rel / ob->shard_elems, pos = rel % ob->shard_elems;
    uint64_t n = ob->shard_elems - pos < i1 - i ? ob->shard_elems - pos : i1 - i;
    if (runs_add(rs, (uint32_t)file, ob->shard_base + pos, dst + (i - i0), n)) return -ENOMEM;
    i += n;
  }
  return 0;
}

/* Whether a and b have the same parameter table (names, shapes, groups, in order); if not, the
 * first difference in buf. World size and bucket size may differ. */
int zd__ckpt_same_params(const zd__layout_t *a, const zd__layout_t *b, char *buf, size_t len) {
  uint32_t n = a->nparams < b->nparams ? a->nparams : b->nparams;
  for (uint32_t i = 0; i < n; i++) {
    const zd__layout_param_t *pa = &a->params[i], *pb = &b->params[i];
    char sa[160], sb[160];
    zd__shape_format(pa->shape, pa->ndim, sa, sizeof sa);
    zd__shape_format(pb->shape, pb->ndim, sb, sizeof sb);
    if (strcmp(pa->name, pb->name) != 0 || strcmp(sa, sb) != 0 || pa->group != pb->group) {
      snprintf(buf, len, "parameter %u: '%s' %s group %u in the checkpoint vs '%s' %s group %u", i,
               pa->name, sa, pa->group, pb->name, sb, pb->group);
      return 0;
    }
  }
  if (a->nparams != b->nparams) {
    snprintf(buf, len, "%u parameters in the checkpoint vs %u", a->nparams, b->nparams);
    return 0;
  }
  return 1;
}

/* The writer's rank files, opened as runs first need them. */
typedef struct sources {
  const char *dir;
  const zd__ckpt_manifest_t *m;
  int *fd;
  zd__ckpt_shard_hdr_t *hdr;
} sources_t;

static int sources_init(sources_t *s, const char *dir, const zd__ckpt_manifest_t *m) {
  s->dir = dir;
  s->m = m;
  s->fd = malloc(m->nfiles * sizeof *s->fd);
  s->hdr = calloc(m->nfiles, sizeof *s->hdr);
  if (!s->fd || !s->hdr) return -ENOMEM;
  for (uint32_t r = 0; r < m->nfiles; r++) s->fd[r] = -1;
  return 0;
}

static int sources_get(sources_t *s, uint32_t r, zd__err_t *err) {
  if (s->fd[r] >= 0) return 0;
  return open_rank_file(s->dir, s->m, r, &s->fd[r], &s->hdr[r], err);
}

static void sources_close(sources_t *s) {
  for (uint32_t r = 0; s->fd && r < s->m->nfiles; r++)
    if (s->fd[r] >= 0) close(s->fd[r]);
  free(s->fd);
  free(s->hdr);
}

/* Reads n elements of array t at src of rank file r into dst. */
static int read_elems(sources_t *s, uint32_t r, zd__state_t t, uint64_t src, uint64_t n, float *dst,
                      zd__err_t *err) {
  int rc = sources_get(s, r, err);
  if (rc) return rc;
  uint64_t off = s->hdr[r].data_start + s->hdr[r].off[t] + src * F32_BYTES;
  ssize_t got = zd__ckpt_pread_all(s->fd[r], dst, n * F32_BYTES, off);
  if (got < 0)
    return zd__errf(err, (int)got, "%s/%s: %s", s->dir, s->m->files[r].name, strerror((int)-got));
  if ((uint64_t)got != n * F32_BYTES)
    return zd__errf(err, -EBADMSG, "%s/%s: ends at %" PRIu64 " bytes; expected %" PRIu64 " or more",
                    s->dir, s->m->files[r].name, off + (uint64_t)got, off + n * F32_BYTES);
  return 0;
}

int zd__ckpt_load_shard(const char *dir, const zd__ckpt_manifest_t *m, const zd__layout_t *layout,
                        uint32_t rank, float *state[ZD__NSTATES], zd__err_t *err) {
  char diff[ZD__ERR_MSG_MAX - 128];
  if (!zd__ckpt_same_params(m->layout, layout, diff, sizeof diff))
    return zd__errf(err, ZD_ELAYOUT, "%s: the model differs from the checkpoint's: %s", dir, diff);
  for (int t = 0; t < ZD__NSTATES; t++) {
    if (!state[t] && zd__states_always() & ZD__STATE_BIT(t))
      return zd__errf(err, -EINVAL, "%s: no %s array to load into; every model has one", dir,
                      zd__state_name(t));
    if (state[t] && !(m->states & ZD__STATE_BIT(t)))
      return zd__errf(err, ZD_ECHECKPOINT,
                      "%s: the checkpoint has no %s, which the model has (the checkpoint was "
                      "written by a model whose groups did not need it; torch's load_state_dict "
                      "would leave the state without it and its step raise KeyError): resume with "
                      "groups that do not need it, or start afresh",
                      dir, zd__state_name(t));
  }
  if (rank >= layout->world_size)
    return zd__errf(err, -EINVAL, "rank %u of a world of %u", rank, layout->world_size);
  runs_t rs = {0};
  runs_t zero = {0}; /* padding of the new shard: file and src unused */
  sources_t src = {0};
  int rc = -ENOMEM;
  if (sources_init(&src, dir, m)) goto oom;
  uint64_t cursor = 0;
  for (uint32_t b = 0; b < layout->nbuckets; b++) {
    const zd__bucket_t *bk = &layout->buckets[b];
    uint64_t lo = bk->offset + (uint64_t)rank * bk->shard_elems, hi = lo + bk->shard_elems;
    for (uint32_t p = bk->first_param; p < bk->first_param + bk->nparams; p++) {
      const zd__layout_param_t *np = &layout->params[p];
      uint64_t s = np->offset > lo ? np->offset : lo;
      uint64_t e = np->offset + np->numel < hi ? np->offset + np->numel : hi;
      if (s >= e) continue;
      uint64_t dst = bk->shard_base + (s - lo);
      if (dst > cursor && runs_add(&zero, 0, 0, cursor, dst - cursor)) goto oom;
      if (map_param(m->layout, p, s - np->offset, e - np->offset, dst, &rs)) goto oom;
      cursor = dst + (e - s);
    }
  }
  if (layout->shard_elems > cursor && runs_add(&zero, 0, 0, cursor, layout->shard_elems - cursor))
    goto oom;
  for (int t = 0; t < ZD__NSTATES; t++) {
    if (!state[t]) continue; /* an array the model lacks: the checkpoint's is not read */
    for (size_t i = 0; i < rs.n; i++) {
      const run_t *r = &rs.v[i];
      if ((rc = read_elems(&src, r->file, t, r->src, r->n, state[t] + r->dst, err))) goto exit;
    }
    for (size_t i = 0; i < zero.n; i++)
      memset(state[t] + zero.v[i].dst, 0, zero.v[i].n * sizeof(float));
  }
  rc = ZD_OK;
  goto exit;
oom:
  rc = zd__errf(err, -ENOMEM, "%s: out of memory planning the load of rank %u", dir, rank);
exit:
  sources_close(&src);
  free(rs.v);
  free(zero.v);
  return rc;
}

/* ---- reading a parameter, for exports -------------------------------------------------------- */

struct zd__ckpt_reader {
  sources_t src;
  runs_t rs;
};

int zd__ckpt_reader_open(const char *dir, const zd__ckpt_manifest_t *m, zd__ckpt_reader_t **out,
                         zd__err_t *err) {
  zd__ckpt_reader_t *r = calloc(1, sizeof *r);
  if (!r || sources_init(&r->src, dir, m)) {
    zd__ckpt_reader_close(r);
    return zd__errf(err, -ENOMEM, "%s: out of memory", dir);
  }
  *out = r;
  return ZD_OK;
}

int zd__ckpt_reader_param(zd__ckpt_reader_t *r, zd__state_t t, uint32_t p, uint64_t first,
                          uint64_t n, float *dst, zd__err_t *err) {
  const zd__layout_t *l = r->src.m->layout;
  if ((unsigned)t >= ZD__NSTATES || !(r->src.m->states & ZD__STATE_BIT(t)))
    return zd__errf(err, -EINVAL, "%s: the checkpoint has no array %d", r->src.dir, (int)t);
  r->rs.n = 0;
  if (map_param(l, p, first, first + n, 0, &r->rs))
    return zd__errf(err, -ENOMEM, "%s: out of memory", r->src.dir);
  for (size_t k = 0; k < r->rs.n; k++) {
    const run_t *run = &r->rs.v[k];
    int rc = read_elems(&r->src, run->file, t, run->src, run->n, dst + run->dst, err);
    if (rc) return rc;
  }
  return ZD_OK;
}

void zd__ckpt_reader_close(zd__ckpt_reader_t *r) {
  if (!r) return;
  sources_close(&r->src);
  free(r->rs.v);
  free(r);
}
