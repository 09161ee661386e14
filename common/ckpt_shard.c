/* A checkpoint's rank file (ckpt_shard.h): its name, its atomic write and its header check. */
#include "ckpt_shard.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt_file.h"
#include "safetensors.h"

#define CHUNK         (8u << 20) /* bytes per write: large, for throughput */
#define MAX_SHARD_HDR (1u << 20) /* a rank file's header is a few hundred bytes */
#define SHARD_FORMAT  "zerod-shard"
#define F32_BYTES     ZD__SAFETENSORS_F32_BYTES

/* The names of the arrays in set, in the table's order and ", "-separated, into buf. */
static void names_of(zd__states_t set, char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  for (int s = 0; s < ZD__NSTATES; s++) {
    if (!(set & ZD__STATE_BIT(s))) continue;
    int n = snprintf(buf + used, len - used, "%s%s", used ? ", " : "", zd__state_name(s));
    if (n < 0 || (size_t)n >= len - used) break;
    used += (size_t)n;
  }
}

static double mono_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Reads and checks the header of rank file `name` (open as fd, file_bytes long): one F32 tensor
 * of elems elements per array in states, filling the data exactly, metadata naming this rank,
 * world and step. */
static int read_shard_header(int fd, const char *name, uint64_t file_bytes, uint32_t rank,
                             uint32_t world_size, uint64_t step, uint64_t elems,
                             zd__states_t states, zd__ckpt_shard_hdr_t *h, zd__err_t *err) {
  json_t *hdr;
  int rc =
      zd__safetensors_read_header(fd, name, file_bytes, MAX_SHARD_HDR, &hdr, &h->data_start, err);
  if (rc) return rc;
  char want[32];
  json_t *meta = json_object_get(hdr, "__metadata__");
  if (!json_is_object(meta) || !zd__safetensors_str_is(meta, "format", SHARD_FORMAT) ||
      !zd__safetensors_str_is(meta, "version", "1")) {
    rc = zd__errf(err, -EBADMSG, "%s: metadata is not format \"" SHARD_FORMAT "\" version \"1\"",
                  name);
    goto exit;
  }
  const char *keys[3] = {"rank", "world_size", "step"};
  uint64_t vals[3] = {rank, world_size, step};
  for (int k = 0; k < 3; k++) {
    snprintf(want, sizeof want, "%" PRIu64, vals[k]);
    if (!zd__safetensors_str_is(meta, keys[k], want)) {
      const char *got = json_string_value(json_object_get(meta, keys[k]));
      rc = zd__errf(err, -EBADMSG, "%s: metadata %s is \"%s\"; expected \"%s\"", name, keys[k],
                    got ? got : "(missing)", want);
      goto exit;
    }
  }
  int ntensors = __builtin_popcount(states);
  if (json_object_size(hdr) != 1 + (size_t)ntensors) {
    char list[256];
    names_of(states, list, sizeof list);
    rc = zd__errf(err, -EBADMSG, "%s: %zu tensors; expected %d (%s%s)", name,
                  json_object_size(hdr) - 1, ntensors, list,
                  states & ~zd__states_always() ? ": the arrays the manifest lists" : "");
    goto exit;
  }
  uint64_t tbytes = elems * F32_BYTES;
  for (int t = 0; t < ZD__NSTATES; t++) {
    if (!(states & ZD__STATE_BIT(t))) continue;
    json_t *e = json_object_get(hdr, zd__state_name(t));
    json_t *shape = json_object_get(e, "shape"), *offs = json_object_get(e, "data_offsets");
    json_int_t begin = json_integer_value(json_array_get(offs, 0));
    json_int_t end = json_integer_value(json_array_get(offs, 1));
    if (!json_is_object(e) || !zd__safetensors_str_is(e, "dtype", "F32") ||
        json_array_size(shape) != 1 || !json_is_integer(json_array_get(shape, 0)) ||
        (uint64_t)json_integer_value(json_array_get(shape, 0)) != elems ||
        json_array_size(offs) != 2 || begin < 0 || end < begin ||
        (uint64_t)(end - begin) != tbytes || (uint64_t)end > file_bytes - h->data_start) {
      rc = zd__errf(err, -EBADMSG,
                    "%s: tensor \"%s\" is not F32 of shape [%" PRIu64 "] within the file (%" PRIu64
                    " bytes)",
                    name, zd__state_name(t), elems, file_bytes);
      goto exit;
    }
    h->off[t] = (uint64_t)begin;
  }
  if (file_bytes != h->data_start + (uint64_t)ntensors * tbytes) {
    rc = zd__errf(err, -EBADMSG,
                  "%s: %" PRIu64 " bytes; expected %" PRIu64 " (header and %d x %" PRIu64
                  " elements)",
                  name, file_bytes, h->data_start + (uint64_t)ntensors * tbytes, ntensors, elems);
    goto exit;
  }
exit:
  json_decref(hdr);
  return rc;
}

int zd__ckpt_shard_open(const char *dir, const zd__ckpt_file_t *f, uint32_t rank,
                        uint32_t world_size, uint64_t step, uint64_t elems, zd__states_t states,
                        int *fd_out, zd__ckpt_shard_hdr_t *h, zd__err_t *err) {
  char path[PATH_MAX];
  if (zd__ckpt_join(path, sizeof path, dir, f->name))
    return zd__errf(err, -ENAMETOOLONG, "%s/%s: path too long", dir, f->name);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int rc = -errno;
    return zd__errf(err, rc, "%s: %s", path, strerror(-rc));
  }
  struct stat st;
  int rc = 0;
  if (fstat(fd, &st)) {
    rc = -errno;
    zd__errf(err, rc, "%s: %s", path, strerror(-rc));
  } else if ((uint64_t)st.st_size != f->bytes) {
    rc = zd__errf(err, -EBADMSG, "%s: %lld bytes; expected %" PRIu64, f->name,
                  (long long)st.st_size, f->bytes);
  } else {
    rc = read_shard_header(fd, f->name, f->bytes, rank, world_size, step, elems, states, h, err);
  }
  if (rc) {
    close(fd);
    return rc;
  }
  *fd_out = fd;
  return 0;
}

int zd__ckpt_dir_name(const char *root, uint64_t step, char *buf, size_t len) {
  int n = snprintf(buf, len, "%s/step-%012llu", root, (unsigned long long)step);
  return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : ZD_OK;
}

void zd__ckpt_file_name(uint32_t rank, uint32_t world_size, char *buf, size_t len) {
  snprintf(buf, len, "rank-%05u-of-%05u.safetensors", rank, world_size);
}

/* ---- writing a rank file --------------------------------------------------------------------- */

int zd__ckpt_write_shard(const char *dir, const zd__ckpt_shard_t *s, uint64_t throttle_bytes_per_s,
                         zd__ckpt_file_t *out, zd__err_t *err) {
  if (s->world_size == 0 || s->rank >= s->world_size)
    return zd__errf(err, -EINVAL, "rank %u of a world of %u", s->rank, s->world_size);
  for (int t = 0; t < ZD__NSTATES; t++)
    if (!s->state[t] && zd__states_always() & ZD__STATE_BIT(t))
      return zd__errf(err, -EINVAL, "rank %u: no %s array; every rank file holds one", s->rank,
                      zd__state_name(t));
  if (mkdir(dir, 0755) && errno != EEXIST) {
    int rc = -errno;
    return zd__errf(err, rc, "cannot create checkpoint directory %s: %s", dir, strerror(-rc));
  }
  zd__ckpt_file_t file = {.rank = s->rank};
  zd__ckpt_file_name(s->rank, s->world_size, file.name, sizeof file.name);
  char path[PATH_MAX], num[3][24]; /* rank, world_size, step */
  if (zd__ckpt_join(path, sizeof path, dir, file.name))
    return zd__errf(err, -ENAMETOOLONG, "%s/%s: path too long", dir, file.name);

  json_t *hdr = json_object(), *meta = json_object();
  json_object_set_new(meta, "format", json_string(SHARD_FORMAT));
  json_object_set_new(meta, "version", json_string("1"));
  snprintf(num[0], sizeof num[0], "%u", s->rank);
  snprintf(num[1], sizeof num[1], "%u", s->world_size);
  snprintf(num[2], sizeof num[2], "%" PRIu64, s->step);
  json_object_set_new(meta, "rank", json_string(num[0]));
  json_object_set_new(meta, "world_size", json_string(num[1]));
  json_object_set_new(meta, "step", json_string(num[2]));
  json_object_set_new(hdr, "__metadata__", meta);
  uint64_t tbytes = s->elems * F32_BYTES, off = 0;
  for (int t = 0; t < ZD__NSTATES; t++) {
    if (!s->state[t]) continue;
    json_object_set_new(hdr, zd__state_name(t),
                        zd__safetensors_entry(&s->elems, 1, off, off + tbytes));
    off += tbytes;
  }
  char *head = NULL;
  size_t head_len = 0;
  int rc = zd__safetensors_header_bytes(hdr, &head, &head_len);
  json_decref(hdr);
  if (rc) return zd__errf(err, rc, "%s: out of memory for the header", path);

  zd__ckpt_afile_t f;
  if ((rc = zd__ckpt_afile_open(&f, path, err))) goto exit;
  if ((rc = zd__ckpt_afile_write(&f, head, head_len, err))) goto fail;
  /* Throttled, smaller chunks (an eighth of a second's worth) so that the pace is even. */
  size_t chunk = CHUNK;
  if (throttle_bytes_per_s && throttle_bytes_per_s / 8 < chunk)
    chunk = throttle_bytes_per_s / 8 > 4096 ? (size_t)(throttle_bytes_per_s / 8) : 4096;
  double start = mono_s();
  for (int t = 0; t < ZD__NSTATES; t++) {
    const char *p = (const char *)s->state[t];
    if (!p) continue;
    for (uint64_t done = 0; done < tbytes;) {
      size_t n = tbytes - done < chunk ? (size_t)(tbytes - done) : chunk;
      if ((rc = zd__ckpt_afile_write(&f, p + done, n, err))) goto fail;
      done += n;
      if (throttle_bytes_per_s) {
        double ahead = (double)f.bytes / (double)throttle_bytes_per_s - (mono_s() - start);
        if (ahead > 0) {
          struct timespec ts = {(time_t)ahead, (long)((ahead - (double)(time_t)ahead) * 1e9)};
          while (nanosleep(&ts, &ts) && errno == EINTR) {
          }
        }
      }
    }
  }
  file.bytes = f.bytes;
  if ((rc = zd__ckpt_afile_commit(&f, &file.xxh3, err))) goto exit;
  *out = file;
  goto exit;
fail:
  zd__ckpt_afile_abort(&f);
exit:
  free(head);
  return rc;
}
