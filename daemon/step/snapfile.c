/* The file of a shard's state copy: buddy copies and state snapshots (snapfile.h). */
#include "snapfile.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "clock.h"
#include "log.h"
#include "state.h"

uint64_t zd__snapfile_arrays_bytes(uint32_t states, uint64_t shard_elems) {
  uint64_t n = 0;
  for (int s = 0; s < ZD__NSTATES; s++) n += (states >> s) & 1u;
  return n * shard_elems * sizeof(float);
}

uint64_t zd__snapfile_data_bytes(uint32_t states, uint64_t shard_elems, uint64_t nlags) {
  return zd__snapfile_arrays_bytes(states, shard_elems) + nlags * sizeof(uint64_t);
}

void zd__snapfile_seal(zd__snapfile_hdr_t *h) {
  h->magic = ZD__SNAPFILE_MAGIC;
  h->version = ZD__SNAPFILE_VERSION;
  h->hdr_sum = XXH3_64bits(h, offsetof(zd__snapfile_hdr_t, hdr_sum));
}

int zd__snapfile_check(int fd, uint32_t rank, uint32_t world_size, zd__snapfile_hdr_t *h, char *why,
                       size_t len) {
  struct stat st;
  why[0] = '\0';
  if (fstat(fd, &st) != 0) {
    snprintf(why, len, "fstat: %s", strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    snprintf(why, len, "not a regular file");
  } else if (st.st_uid != geteuid()) {
    snprintf(why, len, "owned by another user");
  } else if (st.st_mode & 077) {
    snprintf(why, len, "readable or writable by other users");
  } else if ((uint64_t)st.st_size < ZD__SNAPFILE_HDR_BYTES ||
             pread(fd, h, sizeof *h, 0) != (ssize_t)sizeof *h) {
    snprintf(why, len, "cut short (no whole header)");
  } else if (h->magic == ZD__SNAPFILE_MAGIC && h->version != ZD__SNAPFILE_VERSION) {
    snprintf(why, len,
             "of format version %u; this zerod reads version %u (version 2 added the "
             "per-parameter step lags)",
             h->version, ZD__SNAPFILE_VERSION);
  } else if (h->magic != ZD__SNAPFILE_MAGIC ||
             h->hdr_sum != XXH3_64bits(h, offsetof(zd__snapfile_hdr_t, hdr_sum))) {
    snprintf(why, len, "its header is damaged");
  } else if (h->rank != rank || h->world_size != world_size || h->rank >= h->world_size ||
             !h->bytes || h->bytes > ZD__SNAPFILE_MAX_BYTES || h->nlags > ZD__SNAPFILE_MAX_LAGS ||
             (h->states >> ZD__NSTATES) != 0 || /* with the next: the sum below cannot wrap */
             h->shard_elems > ZD__SNAPFILE_MAX_BYTES / sizeof(float) ||
             h->bytes != zd__snapfile_data_bytes(h->states, h->shard_elems, h->nlags) ||
             (uint64_t)st.st_size != ZD__SNAPFILE_HDR_BYTES + h->bytes) {
    snprintf(why, len,
             "%" PRIu64 " bytes, whose header says rank %u of %u, %" PRIu64
             " bytes of data: not this file's (rank %u of %u)",
             (uint64_t)st.st_size, h->rank, h->world_size, h->bytes, rank, world_size);
  }
  return why[0] ? -1 : 0;
}

void zd__snapfile_set_aside(const char *what, const char *path, const char *why) {
  char aside[4200];
  snprintf(aside, sizeof aside, "%s.bad-%" PRIu64, path, zd__unix_ms());
  if (rename(path, aside) == 0)
    ZD_LOG_ERROR("%s %s: %s; renamed to %s (not used, not deleted)", what, path, why, aside);
  else
    ZD_LOG_ERROR("%s %s: %s, and it cannot be renamed aside (%s)", what, path, why,
                 strerror(errno));
}
