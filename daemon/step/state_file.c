/* A rank's state file (state_file.h): checking state_dir, opening, checking and mapping a file,
 * the commit's header write, and the status of the files open. */
#include "state_file.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/magic.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>
#include <xxhash.h>

#include "clock.h"
#include "log.h"
#include "placement.h"

#define MAGIC       "ZDSTATE\n"
#define SLOT_STRIDE 2048u
#define DATA_ALIGN  ZD__PLACE_ALIGN

/* One header slot; checksum is the XXH3-64 of the bytes before it. */
typedef struct zd__state_slot {
  char magic[8];
  uint32_t version;
  uint32_t slot_bytes; /* sizeof (zd__state_slot_t) */
  uint64_t seq;        /* 0: never written */
  uint64_t layout_hash;
  uint32_t world_size;
  uint32_t rank;
  uint64_t shard_elems;
  uint32_t states;
  uint32_t set;
  uint64_t step;
  uint64_t steps_skipped;
  uint32_t scaler_enabled;
  uint32_t growth_tracker;
  uint32_t hysteresis_tracker;
  uint32_t pad;
  double scale;
  uint64_t file_bytes;
  uint32_t nparams;
  uint32_t nlagging; /* parameters whose lag is not 0: the lags array is read only then */
  uint64_t lags_sum; /* the XXH3-64 of the slot's lags array (nlagging > 0) */
  uint64_t checksum;
} zd__state_slot_t;
_Static_assert(sizeof(zd__state_slot_t) == 128, "the header slot is 128 bytes");

struct zd__state_file {
  char path[4096];
  int fd;
  void *map;
  size_t bytes;
  uint64_t seq; /* of the newest slot written */
  zd__state_file_key_t key;
  _Atomic uint64_t committed_step;
  _Atomic int has_commit;
  struct zd__state_file *next; /* the open files, for the status */
};

static pthread_mutex_t open_lock = PTHREAD_MUTEX_INITIALIZER;
static zd__state_file_t *open_files;

int zd__state_dir_check(const char *dir, int any_fs, zd__err_t *err) {
  if (mkdir(dir, 0700) != 0 && errno != EEXIST)
    return zd__errf(err, ZD_ECONFIG, "state_dir %s: cannot create it: %s", dir, strerror(errno));
  struct stat st;
  if (lstat(dir, &st) != 0)
    return zd__errf(err, ZD_ECONFIG, "state_dir %s: %s", dir, strerror(errno));
  if (!S_ISDIR(st.st_mode))
    return zd__errf(err, ZD_ECONFIG, "state_dir %s is not a directory (nor a link to one)", dir);
  if (st.st_uid != geteuid())
    return zd__errf(err, ZD_ECONFIG,
                    "state_dir %s is owned by uid %u, not zerod's user (uid %u): the state "
                    "files hold the model, only zerod's user may reach them",
                    dir, (unsigned)st.st_uid, (unsigned)geteuid());
  if (st.st_mode & 077)
    return zd__errf(err, ZD_ECONFIG,
                    "state_dir %s has mode %04o: other users may enter it; chmod 700 it (the "
                    "state files hold the model)",
                    dir, (unsigned)(st.st_mode & 07777));
  struct statfs fs;
  if (statfs(dir, &fs) != 0)
    return zd__errf(err, ZD_ECONFIG, "state_dir %s: statfs: %s", dir, strerror(errno));
  if (fs.f_type != TMPFS_MAGIC && fs.f_type != RAMFS_MAGIC && !any_fs)
    return zd__errf(err, ZD_ECONFIG,
                    "state_dir %s is not on a memory file system (tmpfs or ramfs; file system "
                    "magic 0x%lx): every step would write the whole state to a disk; use "
                    "/dev/shm, a systemd RuntimeDirectory or a Kubernetes emptyDir with medium "
                    "Memory, or set state_dir_any_fs = 1 to allow it",
                    dir, (unsigned long)fs.f_type);
  return ZD_OK;
}

static uint64_t slot_sum(const zd__state_slot_t *s) {
  return XXH3_64bits(s, offsetof(zd__state_slot_t, checksum));
}

/* The bytes of one slot's lags array, with what rounds it to the next 4 KiB. */
static size_t lags_stride(uint32_t nparams) {
  return ((size_t)nparams * sizeof(uint64_t) + 4095) / 4096 * 4096;
}

/* Where the arrays' region begins: after the header slots and their lags. */
static size_t head_bytes(uint32_t nparams) {
  return 2 * SLOT_STRIDE + 2 * lags_stride(nparams);
}

/* Where array j (of all arrays of both sets, in order) starts: a 2 MiB boundary plus its
 * colour. */
static size_t layout_offsets(uint64_t elems, zd__states_t states, uint32_t nparams,
                             size_t offs[2][ZD__NSTATES]) {
  size_t end = head_bytes(nparams), bytes = (size_t)elems * sizeof(float);
  unsigned j = 0;
  for (int k = 0; k < 2; k++)
    for (int s = 0; s < ZD__NSTATES; s++) {
      offs[k][s] = 0;
      if (!(states & ZD__STATE_BIT(s))) continue;
      size_t at = (end + DATA_ALIGN - 1) / DATA_ALIGN * DATA_ALIGN +
                  (j++ % ZD__PLACE_COLOURS) * ZD__PLACE_STRIDE;
      offs[k][s] = at;
      end = at + bytes;
    }
  return (end + 4095) / 4096 * 4096;
}

/* Gives a new file its size and reserves what its pages hold: the two header slots, their lags
 * and every array. The alignment gaps between arrays stay holes, which cost no memory (a small
 * model's arrays are far smaller than their 2 MiB boundaries), and a full tmpfs says ENOSPC here,
 * not SIGBUS in a step. Returns 0 or an errno. */
static int reserve(int fd, size_t bytes, uint64_t elems, zd__states_t states, uint32_t nparams,
                   const size_t offs[2][ZD__NSTATES]) {
  if (ftruncate(fd, (off_t)bytes) != 0) return errno;
  int e = posix_fallocate(fd, 0, (off_t)head_bytes(nparams));
  size_t len = (size_t)elems * sizeof(float);
  for (int k = 0; k < 2 && !e; k++)
    for (int s = 0; s < ZD__NSTATES && !e; s++)
      if ((states & ZD__STATE_BIT(s)) && len)
        e = posix_fallocate(fd, (off_t)offs[k][s], (off_t)len);
  return e;
}

static zd__state_slot_t *slot_at(const zd__state_file_t *f, unsigned i) {
  return (zd__state_slot_t *)((char *)f->map + i * SLOT_STRIDE);
}

/* Slot i's lags array. */
static uint64_t *lags_at(const zd__state_file_t *f, unsigned i) {
  return (uint64_t *)((char *)f->map + 2 * SLOT_STRIDE + i * lags_stride(f->key.nparams));
}

static uint64_t lags_sum(const uint64_t *lags, uint32_t n) {
  return XXH3_64bits(lags, (size_t)n * sizeof *lags);
}

/* Why slot s (at index i of f) cannot be used (a static string), or NULL when it can. */
static const char *slot_problem(const zd__state_file_t *f, const zd__state_slot_t *s) {
  if (memcmp(s->magic, MAGIC, sizeof s->magic) != 0) return "no header (wrong magic)";
  if (s->version != ZD__STATE_FILE_VERSION) return "another format version";
  if (s->slot_bytes != sizeof *s || s->checksum != slot_sum(s)) return "header checksum wrong";
  /* Another model's slot is judged by its key (zd__state_file_open), not by lags it cannot have. */
  if (s->nlagging && s->nparams == f->key.nparams &&
      s->lags_sum != lags_sum(lags_at(f, (unsigned)(s == slot_at(f, 1))), s->nparams))
    return "lags checksum wrong";
  return NULL;
}

static int all_zero(const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i]) return 0;
  return 1;
}

/* The records best (the newest valid slot) and, when the other slot is valid and one sequence
 * number older, the commit before it: how many (1 or 2) into rec. */
static int records(const zd__state_file_t *f, const zd__state_slot_t *best, zd__state_rec_t *rec) {
  unsigned at_prev = (unsigned)((best->seq - 1) & 1);
  const zd__state_slot_t *prev = slot_at(f, at_prev);
  int n = 1 + (!slot_problem(f, prev) && prev->seq + 1 == best->seq);
  for (int i = 0; i < n; i++) {
    const zd__state_slot_t *r = i ? prev : best;
    unsigned at = i ? at_prev : (unsigned)(best->seq & 1);
    rec[i] = (zd__state_rec_t){.set = r->set,
                               .step = r->step,
                               .steps_skipped = r->steps_skipped,
                               .scaler_enabled = (int)r->scaler_enabled,
                               .scale = r->scale,
                               .growth_tracker = r->growth_tracker,
                               .hysteresis_tracker = r->hysteresis_tracker,
                               .lags = r->nlagging ? lags_at(f, at) : NULL};
  }
  return n;
}

/* Renames the file aside, for an operator to look at; never deleted. 0 or -errno. */
static int set_aside(const char *path, const char *why) {
  char aside[4200];
  snprintf(aside, sizeof aside, "%s.bad-%" PRIu64, path, zd__unix_ms());
  if (rename(path, aside) == 0) {
    ZD_LOG_ERROR(
        "state file %s: %s; renamed to %s (not used, not deleted); the rank falls back "
        "to the newest checkpoint, else a fresh start",
        path, why, aside);
    return 0;
  }
  int e = -errno;
  ZD_LOG_ERROR("state file %s: %s, and it cannot be renamed aside (%s)", path, why, strerror(-e));
  return e;
}

/* Maps fd's `bytes` at a 2 MiB boundary, so that file offsets and addresses agree modulo it. */
static int map_aligned(int fd, size_t bytes, void **out) {
  size_t span = bytes + DATA_ALIGN;
  char *r = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return -errno;
  char *at = (char *)(((uintptr_t)r + DATA_ALIGN - 1) & ~(uintptr_t)(DATA_ALIGN - 1));
  void *p = mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  if (p == MAP_FAILED) {
    int e = -errno;
    munmap(r, span);
    return e;
  }
  if (at > r) munmap(r, (size_t)(at - r));
  size_t tail = (size_t)(r + span - (at + bytes));
  if (tail) munmap(at + bytes, tail);
  *out = p;
  return 0;
}

/* Whether a header slot of the file (fd) is of another format version (a whole slot, checksum
 * right: every version so far ends its 128-byte slot with the XXH3-64 of the bytes before it):
 * the message into why. Read before anything else of the file is judged (another version may
 * have another size). */
static int other_version(int fd, char *why, size_t len) {
  for (unsigned i = 0; i < 2; i++) {
    zd__state_slot_t s;
    if (pread(fd, &s, sizeof s, (off_t)(i * SLOT_STRIDE)) != (ssize_t)sizeof s ||
        memcmp(s.magic, MAGIC, sizeof s.magic) != 0 || s.version == ZD__STATE_FILE_VERSION ||
        s.slot_bytes != sizeof s || s.checksum != slot_sum(&s)) /* damaged: judged later */
      continue;
    snprintf(why, len,
             "is of state file format version %u; this zerod reads version %u only (an upgrade "
             "across a format change: drain to a checkpoint first, README)",
             s.version, ZD__STATE_FILE_VERSION);
    return 1;
  }
  return 0;
}

/* Opens an existing file and decides whether it can be used: 1 (yes, *fd open), 0 (none, or set
 * aside), or a negative errno. */
static int open_existing(const char *path, size_t bytes, int *fd) {
  int d = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (d < 0) {
    if (errno == ENOENT) return 0;
    if (errno == ELOOP) return set_aside(path, "is a symbolic link");
    return -errno;
  }
  struct stat st;
  const char *why = NULL;
  char buf[200];
  if (flock(d, LOCK_EX | LOCK_NB) != 0) { /* in use: never judged, never set aside */
    int e = errno == EWOULDBLOCK ? -EBUSY : -errno;
    close(d);
    return e;
  }
  if (fstat(d, &st) != 0) {
    int e = -errno;
    close(d);
    return e;
  }
  if (!S_ISREG(st.st_mode))
    why = "not a regular file";
  else if (other_version(d, buf, sizeof buf))
    why = buf;
  else if (st.st_uid != geteuid())
    why = "owned by another user";
  else if (st.st_mode & 077)
    why = "readable or writable by other users";
  else if ((uint64_t)st.st_size != bytes) {
    snprintf(buf, sizeof buf,
             "%" PRIu64
             " bytes where this model's state takes %zu (another model, or a file cut "
             "short)",
             (uint64_t)st.st_size, bytes);
    why = buf;
  }
  if (why) {
    close(d);
    return set_aside(path, why);
  }
  *fd = d;
  return 1;
}

int zd__state_file_open(const char *dir, const zd__state_file_key_t *key, int may_restore,
                        float *sets[2][ZD__NSTATES], zd__state_file_t **out, int *restored,
                        zd__state_rec_t *rec, zd__err_t *err) {
  *restored = 0;
  *out = NULL;
  zd__state_file_t *f = calloc(1, sizeof *f);
  if (!f) return zd__errf(err, -ENOMEM, "out of memory");
  f->fd = -1;
  f->key = *key;
  snprintf(f->path, sizeof f->path, "%s/rank%u-of-%u-%016" PRIx64 ".zdstate", dir, key->rank,
           key->world_size, key->layout_hash);
  size_t offs[2][ZD__NSTATES];
  size_t bytes = layout_offsets(key->shard_elems, key->states, key->nparams, offs);
  f->bytes = bytes;
  int rc = open_existing(f->path, bytes, &f->fd);
  if (rc < 0 && rc != -EBUSY) {
    zd__errf(err, rc, "state file %s: %s", f->path, strerror(-rc));
    goto fail;
  }
  int fresh = rc == 0;
  if (fresh) {
    rc = 0;
    f->fd = open(f->path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (f->fd < 0) {
      rc = zd__errf(err, -errno, "state file %s: cannot create it: %s", f->path, strerror(errno));
      goto fail;
    }
    if (flock(f->fd, LOCK_EX | LOCK_NB) != 0) rc = errno == EWOULDBLOCK ? -EBUSY : -errno;
    int e = rc ? 0 : reserve(f->fd, bytes, key->shard_elems, key->states, key->nparams, offs);
    if (e) {
      rc = zd__errf(err, -e, "state file %s: cannot reserve %zu bytes: %s", f->path, bytes,
                    strerror(e));
      unlink(f->path); /* ours, empty */
      goto fail;
    }
  }
  /* One zerod per file (the lock, taken above, dies with its holder, killed or not): a second
   * one with the same state_dir and rank would write the same sets. */
  if (rc == -EBUSY) {
    zd__errf(err, -EBUSY,
             "state file %s is in use by another process (another zerod with this state_dir "
             "and rank?)",
             f->path);
    goto fail;
  } else if (rc < 0) {
    zd__errf(err, rc, "state file %s: flock: %s", f->path, strerror(-rc));
    goto fail;
  }
  rc = map_aligned(f->fd, bytes, &f->map);
  if (rc) {
    zd__errf(err, rc, "state file %s: cannot map %zu bytes: %s", f->path, bytes, strerror(-rc));
    goto fail;
  }
  /* The committed record, if any. */
  const zd__state_slot_t *best = NULL;
  const char *problem = NULL;
  int written = 0;
  for (unsigned i = 0; !fresh && i < 2; i++) {
    const zd__state_slot_t *s = slot_at(f, i);
    if (all_zero(s, sizeof *s)) continue;
    written = 1;
    const char *p = slot_problem(f, s);
    if (p) {
      if (!problem) problem = p;
      continue;
    }
    if (!best || s->seq > best->seq) best = s;
  }
  char why[256] = "";
  if (best && (best->layout_hash != key->layout_hash || best->world_size != key->world_size ||
               best->rank != key->rank || best->shard_elems != key->shard_elems ||
               best->states != key->states || best->nparams != key->nparams || best->set > 1))
    snprintf(why, sizeof why,
             "holds the state of another model (layout hash %016" PRIx64 ", rank %u of %u, %" PRIu64
             " shard elements, arrays 0x%x)",
             best->layout_hash, best->rank, best->world_size, best->shard_elems, best->states);
  else if (!best && written)
    snprintf(why, sizeof why, "no usable header: %s in both slots", problem);
  if (why[0]) { /* set aside, and start again with a new file */
    munmap(f->map, bytes);
    close(f->fd);
    rc = set_aside(f->path, why);
    if (rc) {
      zd__errf(err, rc, "state file %s: %s, and it cannot be renamed aside: %s", f->path, why,
               strerror(-rc));
      free(f);
      return rc;
    }
    char dir_copy[4096];
    snprintf(dir_copy, sizeof dir_copy, "%s", dir);
    free(f);
    return zd__state_file_open(dir_copy, key, may_restore, sets, out, restored, rec, err);
  }
  if (best) {
    f->seq = best->seq;
    if (may_restore) {
      *restored = records(f, best, rec);
      atomic_store(&f->committed_step, best->step);
      atomic_store(&f->has_commit, 1);
      ZD_LOG_INFO("state file %s: committed step %" PRIu64 " in set %u (header %" PRIu64 ")",
                  f->path, best->step, best->set, best->seq);
    } else {
      ZD_LOG_WARN("state file %s: its state of step %" PRIu64
                  " is not used (a registration with replace, or world size > 1) and is "
                  "overwritten",
                  f->path, best->step);
    }
  }
  if (!*restored) { /* nothing committed until the first commit writes the arrays it names */
    memset(f->map, 0, 2 * SLOT_STRIDE);
    if (!fresh) memset((char *)f->map + 2 * SLOT_STRIDE, 0, bytes - 2 * SLOT_STRIDE); /* zeroed */
  }
  for (int k = 0; k < 2; k++)
    for (int s = 0; s < ZD__NSTATES; s++)
      sets[k][s] = key->states & ZD__STATE_BIT(s) ? (float *)((char *)f->map + offs[k][s]) : NULL;
  pthread_mutex_lock(&open_lock);
  f->next = open_files;
  open_files = f;
  pthread_mutex_unlock(&open_lock);
  *out = f;
  return ZD_OK;
fail:
  if (f->map) munmap(f->map, bytes);
  if (f->fd >= 0) close(f->fd);
  free(f);
  return rc;
}

void zd__state_file_commit(zd__state_file_t *f, const zd__state_rec_t *rec) {
  zd__state_slot_t s = {.version = ZD__STATE_FILE_VERSION,
                        .slot_bytes = sizeof s,
                        .seq = f->seq + 1,
                        .layout_hash = f->key.layout_hash,
                        .world_size = f->key.world_size,
                        .rank = f->key.rank,
                        .shard_elems = f->key.shard_elems,
                        .states = f->key.states,
                        .set = rec->set,
                        .step = rec->step,
                        .steps_skipped = rec->steps_skipped,
                        .scaler_enabled = (uint32_t)rec->scaler_enabled,
                        .growth_tracker = rec->growth_tracker,
                        .hysteresis_tracker = rec->hysteresis_tracker,
                        .scale = rec->scale,
                        .file_bytes = f->bytes,
                        .nparams = f->key.nparams};
  memcpy(s.magic, MAGIC, sizeof s.magic);
  unsigned at = (unsigned)(s.seq & 1);
  /* The lags first, into this slot's array, which only the record being replaced read (a kill
   * before the slot's write fails that record's lags checksum: state_file.h). */
  for (uint32_t i = 0; rec->lags && i < f->key.nparams; i++) s.nlagging += rec->lags[i] != 0;
  if (s.nlagging) {
    uint64_t *lags = lags_at(f, at);
    if (lags != rec->lags) memcpy(lags, rec->lags, (size_t)f->key.nparams * sizeof *lags);
    s.lags_sum = lags_sum(lags, f->key.nparams);
  }
  s.checksum = slot_sum(&s);
  /* The update's stores (this thread's, and the pool threads' it joined) come first. */
  atomic_thread_fence(memory_order_seq_cst);
  memcpy(slot_at(f, at), &s, sizeof s);
  atomic_thread_fence(memory_order_seq_cst);
  f->seq = s.seq;
  atomic_store(&f->committed_step, rec->step);
  atomic_store(&f->has_commit, 1);
}

int zd__state_file_records(const zd__state_file_t *f, zd__state_rec_t rec[2]) {
  if (!f->seq || !atomic_load(&f->has_commit)) return 0;
  const zd__state_slot_t *best = slot_at(f, (unsigned)(f->seq & 1));
  if (slot_problem(f, best) || best->seq != f->seq) return 0; /* not ours: never served */
  return records(f, best, rec);
}

const char *zd__state_file_path(const zd__state_file_t *f) {
  return f->path;
}

uint64_t zd__state_file_committed_step(const zd__state_file_t *f) {
  return atomic_load(&f->has_commit) ? atomic_load(&f->committed_step) : 0;
}

void zd__state_file_reset(zd__state_file_t *f) {
  memset(f->map, 0, f->bytes);
  atomic_store(&f->has_commit, 0);
}

void zd__state_file_close(zd__state_file_t *f) {
  if (!f) return;
  pthread_mutex_lock(&open_lock);
  for (zd__state_file_t **p = &open_files; *p; p = &(*p)->next)
    if (*p == f) {
      *p = f->next;
      break;
    }
  pthread_mutex_unlock(&open_lock);
  munmap(f->map, f->bytes);
  close(f->fd);
  free(f);
}

void zd__state_file_status(void *ctx, zd__status_t *st) {
  zd__status_section(st, "state_file");
  zd__status_add(st, "state_dir", "%s", (const char *)ctx);
  pthread_mutex_lock(&open_lock);
  for (zd__state_file_t *f = open_files; f; f = f->next) {
    char key[64];
    snprintf(key, sizeof key, "rank%u_path", f->key.rank);
    zd__status_add(st, key, "%s", f->path);
    snprintf(key, sizeof key, "rank%u_committed_step", f->key.rank);
    if (atomic_load(&f->has_commit))
      zd__status_add(st, key, "%" PRIu64, atomic_load(&f->committed_step));
    else
      zd__status_add(st, key, "none");
    snprintf(key, sizeof key, "rank%u_file_bytes", f->key.rank);
    zd__status_add(st, key, "%zu", f->bytes);
  }
  pthread_mutex_unlock(&open_lock);
}
