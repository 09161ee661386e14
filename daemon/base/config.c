/* zerod's settings table and the code that reads it (config.h).
 *
 * Every setting is one row below: name, type, field, default, bounds, help (redis
 * standardConfig). Defaults, the config file, ZEROD_* variables and flags all go through the same
 * set_value(), so a value means the same thing wherever it is written and every error names the
 * setting, where the value came from, the value and what was expected. `--help` and the effective
 * configuration (zd__config_visit) are printed from the same rows, so they cannot fall behind the
 * parser. Settings whose default depends on others (socket, allowed_uids, world_size,
 * bucket_elems, rendezvous_address) are resolved once at the end of the load, so the rest of the
 * daemon and the configuration it logs see the values it actually uses.
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>
#include <unistd.h>

#include "endpoint.h"
#include "layout.h"

extern char **environ;

typedef enum { T_STRING, T_U32, T_U64, T_MODE, T_UIDS, T_GIDS, T_ENUM } type_t;

enum { SRC_DEFAULT = 0, SRC_FILE, SRC_ENV, SRC_FLAG };
static const char *const source_names[] = {"default", "file", "env", "flag"};

typedef struct setting {
  const char *section;
  const char *name;
  type_t type;
  size_t offset;
  const char *def;
  uint64_t min, max;         /* T_U32, T_U64 */
  const char *const *values; /* T_ENUM: NULL-terminated */
  const char *metavar;       /* T_STRING: what the value is, for --help */
  const char *help;
} setting_t;

#define FIELD(f) offsetof(zd__config_t, f)
#define STR(sec, name, f, def, meta, help) \
  { sec, name, T_STRING, FIELD(f), def, 0, 0, NULL, meta, help }
#define U32(sec, name, f, def, lo, hi, help) \
  { sec, name, T_U32, FIELD(f), def, lo, hi, NULL, NULL, help }
#define U64(sec, name, f, def, lo, hi, help) \
  { sec, name, T_U64, FIELD(f), def, lo, hi, NULL, NULL, help }
#define MODE(sec, name, f, def, help) \
  { sec, name, T_MODE, FIELD(f), def, 0, 0777, NULL, NULL, help }
#define IDS(sec, name, type, f, help) \
  { sec, name, type, FIELD(f), "", 0, 0, NULL, NULL, help }
#define ENUM(sec, name, f, def, vals, help) \
  { sec, name, T_ENUM, FIELD(f), def, 0, 0, vals, NULL, help }

#define S_PROTO   "Local protocol"
#define S_COMPUTE "Compute"
#define S_WORLD   "World"
#define S_OPS     "Operations"
#define S_CKPT    "Checkpoints"

static const char *const backends[] = {"auto", "cpu", "cuda", NULL};
static const char *const isas[] = {"auto", "avx512bf16", "avx512", "avx2", "scalar", NULL};
static const char *const cuda_steps[] = {"fast", "legacy", NULL};
static const char *const world_size_records[] = {"use", "ignore", NULL};
static const char *const state_modes[] = {"auto", "mapped", "snapshot", NULL};
static const char *const levels[] = {"error", "warn", "info", "debug", NULL};

static const setting_t settings[] = {
    STR(S_PROTO, "socket", socket_path, "", "PATH",
        "Unix socket to listen on (\"\": $XDG_RUNTIME_DIR/zerod.sock, else /run/zerod/zerod.sock)"),
    MODE(S_PROTO, "socket_mode", socket_mode, "0660", "permissions of the socket file, in octal"),
    IDS(S_PROTO, "allowed_uids", T_UIDS, allowed_uids,
        "users who may connect, by uid or name (default: the daemon's own uid and root)"),
    IDS(S_PROTO, "allowed_gids", T_GIDS, allowed_gids,
        "groups whose members may connect, by gid or name (default: none)"),
    U32(S_PROTO, "max_clients", max_clients, "64", 1, 4096, "simultaneous client connections"),
    U32(S_PROTO, "max_clients_per_uid", max_clients_per_uid, "32", 1, 4096,
        "simultaneous client connections of one user, so that one user's idle or stray "
        "connections cannot lock the others out"),
    U32(S_PROTO, "hello_timeout_ms", hello_timeout_ms, "10000", 100, 600000,
        "a connection that has not said hello within this time is closed"),
    U32(S_PROTO, "max_frame_bytes", max_frame_bytes, "16777216", 4096, 67108864,
        "largest request or reply frame, in bytes"),
    U32(S_PROTO, "frame_timeout_ms", frame_timeout_ms, "10000", 100, 600000,
        "a frame once started must be complete within this time"),
    U32(S_PROTO, "max_inflight", max_inflight, "64", 1, 1024, "pipelined requests per client"),
    U32(S_PROTO, "busy_poll_us", busy_poll_us, "50", 0, 10000,
        "after each reply, the daemon looks for the next request this many microseconds without "
        "sleeping, so that a client that sends it at once skips a thread wake-up (0: always "
        "sleep; otherwise each reply may cost up to this much of one CPU)"),

    ENUM(S_COMPUTE, "backend", backend, "auto", backends,
         "where optimizer steps run (auto: cuda when a GPU is usable, else cpu)"),
    U32(S_COMPUTE, "threads", threads, "0", 0, 1024, "CPU kernel threads (0: one per CPU)"),
    U32(S_COMPUTE, "pin_threads", pin_threads, "1", 0, 1,
        "bind the CPU kernel threads to CPUs of their own, from zerod's affinity mask at start-up "
        "where it has a CPU per thread: helper i to the i-th CPU, a rank's thread during a run to "
        "the CPUs that run's helpers do not use (0: leave placement to the scheduler, which may "
        "put two on one CPU)"),
    ENUM(S_COMPUTE, "kernel_isa", kernel_isa, "auto", isas,
         "CPU kernel instruction set (auto: the widest this CPU supports)"),
    U32(S_COMPUTE, "overlap_update", overlap_update, "0", 0, 1,
        "CPU backend: update each bucket as soon as its scatter completes, while the trainer's "
        "backward goes on, into a second set of state arrays that the step commits when nothing "
        "clipped, overflowed or changed the hyperparameters (else the bucket is updated again "
        "from the untouched set: the same bits either way). Doubles the host memory of the "
        "state (master and moments: 12 to 16 bytes more per parameter); pays when the trainer "
        "scatters buckets from its backward hooks and zerod has CPUs of its own to update on "
        "while the trainer computes. The CUDA backend refuses it"),
    U32(S_COMPUTE, "ranks_per_gpu", ranks_per_gpu, "1", 1, 64,
        "CUDA backend: local ranks that share one GPU (local rank i runs on GPU i / "
        "ranks_per_gpu). Above 1 the ranks of a GPU reduce and gather among themselves in device "
        "memory inside zerod, without NCCL; for now that needs every rank of the world in this "
        "zerod, on one GPU (ranks_per_gpu = local_ranks = world_size). Ignored by the CPU backend"),
    ENUM(S_COMPUTE, "cuda_step", cuda_step, "fast", cuda_steps,
         "how a CUDA rank's worker waits for the GPU and answers (fast: the stream wakes the "
         "worker through cudaLaunchHostFunc and a futex, polling NCCL's errors every millisecond; "
         "a scatter, gather or step is answered as soon as its work is queued and its outcome "
         "known, by the worker itself, and a failure found later is answered to the next "
         "request and degrades the rank; legacy: the worker polls an event, spinning 50 us then "
         "sleeping up to 1 ms, and every CUDA job is answered by the loop thread once its work "
         "has completed). The CPU backend ignores it"),

    U32(S_WORLD, "local_ranks", local_ranks, "1", 1, 64, "ranks served by this daemon"),
    U32(S_WORLD, "world_size", world_size, "0", 0, 65536,
        "ranks in the whole job (0: local_ranks, a single-node world)"),
    ENUM(S_WORLD, "world_size_record", world_size_record, "use", world_size_records,
         "a live resize (zeroctl resize) leaves a record of the new world size in state_dir (file "
         "world_size) and in the rendezvous store (key zerod/world_size); use: a zerod that "
         "starts again takes the record (the store's, else state_dir's) over world_size (a rank "
         "the record left "
         "out of the world stays out: degraded, its trainer refused with ZD_ERANK); ignore: "
         "world_size as configured, as before live resize existed"),
    U32(S_WORLD, "first_rank", first_rank, "0", 0, 65535,
        "global rank of this daemon's local rank 0"),
    U64(S_WORLD, "bucket_elems", bucket_elems, "0", 0, 1ull << 40,
        "target elements per gradient bucket (0: max(40M, 1M * world_size))"),
    STR(S_WORLD, "control_address", control_address, "127.0.0.1:7070", "ADDR",
        "listen address of the gRPC control service"),
    STR(S_WORLD, "control_token_file", control_token_file, "", "FILE",
        "file (mode 0600) holding the world's control token, which the rendezvous store's calls "
        "must carry (\"\": none; every zerod of a world and zeroctl use the same)"),
    U32(S_WORLD, "control_insecure", control_insecure, "0", 0, 1,
        "1: serve the control service on an address other hosts reach without TLS "
        "(use a control_token_file and a network only the job's nodes reach)"),
    STR(S_WORLD, "tls_cert", tls_cert, "", "FILE",
        "PEM certificate of this node for mutual TLS on the control service and on every call "
        "to other nodes; its subjectAltName names the host peers dial (control_address). Set "
        "with tls_key and tls_ca (\"\": no TLS)"),
    STR(S_WORLD, "tls_key", tls_key, "", "FILE",
        "PEM private key of tls_cert, without a passphrase (mode 0600)"),
    STR(S_WORLD, "tls_ca", tls_ca, "", "FILE",
        "PEM certificate of the CA that signs every member's certificate (zerods and zeroctl): "
        "a call without a certificate it signed is refused"),
    STR(S_WORLD, "rendezvous_address", rendezvous_address, "", "ADDR",
        "control service of the daemon holding rank 0 (\"\": control_address)"),
    STR(S_WORLD, "rendezvous", rendezvous, "builtin", "STORE",
        "where the world's coordination lives: builtin (the store of the daemon holding rank 0, "
        "at rendezvous_address) or etcd://host:port[,host:port...][/job] (etcd's v3 API; keys "
        "under /zerod/<job>/; the world then re-forms after the loss of any node, rank 0's "
        "included; rendezvous_address is not used)"),
    U32(S_WORLD, "collective_timeout_ms", collective_timeout_ms, "1800000", 100, 86400000,
        "a collective not complete within this time marks the world degraded (a dead peer is "
        "noticed at once; this bounds a silent one, so leave room for a rank's checkpoint or "
        "evaluation between steps: torch.distributed's default is 30 minutes too)"),
    U32(S_WORLD, "heartbeat_ms", heartbeat_ms, "1000", 50, 60000,
        "how often each node's health service is checked by the other nodes of the world"),
    U32(S_WORLD, "peer_timeout_ms", peer_timeout_ms, "10000", 200, 86400000,
        "a node whose health service has not answered for this long is declared dead: the "
        "collectives waiting for it fail and the ranks are degraded (a busy node still "
        "answers; only a stopped process, host or network stays silent)"),
    U32(S_WORLD, "connect_timeout_ms", connect_timeout_ms, "600000", 1000, 86400000,
        "how long a rank waits for its peers to join the world at start"),
    STR(S_WORLD, "collective_host", collective_host, "127.0.0.1", "HOST",
        "address this node's collectives listen on and peers connect to (multi-node: the "
        "node's own address)"),

    STR(S_CKPT, "checkpoint_dir", checkpoint_dir, "", "DIR",
        "directory of the checkpoints (one step-N directory each; shared by every node of a "
        "multi-node world; it must exist). \"\": no checkpoints"),
    U32(S_CKPT, "checkpoint_every_steps", checkpoint_every_steps, "0", 0, 4000000000u,
        "checkpoint after every N-th step (0: not by steps)"),
    U32(S_CKPT, "checkpoint_every_seconds", checkpoint_every_seconds, "0", 0, 31536000,
        "checkpoint after the first step once N seconds have passed since the last request "
        "(0: not by time)"),
    U32(S_CKPT, "checkpoint_keep", checkpoint_keep, "3", 0, 1000000,
        "complete checkpoints kept; older ones, and incomplete leftovers older than the newest "
        "complete one, are deleted (0: keep all)"),
    STR(S_CKPT, "resume", resume, "", "latest|DIR",
        "a rank registering a model it does not hold loads \"latest\" (the newest complete "
        "checkpoint in checkpoint_dir whose parameters match, at any world size) or the "
        "checkpoint DIR (\"\": start from the trainer's values)"),
    STR(S_CKPT, "state_dir", state_dir, "", "DIR",
        "CPU backend: keep each rank's state (two sets of master and moments, the step, the "
        "loss scaler) in a file of this directory, mapped, committed after every step, so that "
        "a zerod killed or restarted with the same state_dir continues at the last completed "
        "step (world size > 1: set it on every node; the world re-forms around a restarted "
        "zerod, whose survivors keep their state, and continues from the files at the newest step "
        "every rank "
        "holds). Doubles the host memory of the state. It must be on a memory file system "
        "(tmpfs: /dev/shm, a systemd RuntimeDirectory, a Kubernetes emptyDir with medium "
        "Memory), owned by zerod's user, mode 0700 (created so if missing). The CUDA backend "
        "keeps it as snapshots instead (state_dir_mode). \"\": off"),
    U32(S_CKPT, "state_dir_any_fs", state_dir_any_fs, "0", 0, 1,
        "allow a state_dir that is not on tmpfs or ramfs (every step then writes the whole "
        "state through the page cache to that file system)"),
    ENUM(S_CKPT, "state_dir_mode", state_dir_mode, "auto", state_modes,
         "how state_dir keeps the state: mapped (CPU backend: the state arrays live in files "
         "of state_dir, committed every step), snapshot (an asynchronous copy of each rank's "
         "state into a file of state_dir every state_snapshot_every_steps steps or "
         "state_snapshot_every_s seconds; a restarted zerod goes back to the newest snapshot "
         "every rank holds: the CUDA backend's mode, whose device memory dies with zerod), auto "
         "(mapped on the cpu backend, snapshot on cuda)"),
    U32(S_CKPT, "state_snapshot_every_steps", state_snapshot_every_steps, "0", 0, 4000000000u,
        "state_dir_mode = snapshot: a snapshot of every rank's state every this many steps "
        "(set it alike on every node; 0: none by steps)"),
    U32(S_CKPT, "state_snapshot_every_s", state_snapshot_every_s, "0", 0, 4000000000u,
        "state_dir_mode = snapshot: a snapshot also after the first step that ends this many "
        "seconds after the last one (every rank snapshots the same step; 0: none by time)"),
    U32(S_CKPT, "buddy_copy_every_steps", buddy_copy_every_steps, "0", 0, 4000000000u,
        "CPU backend, world size > 1: every this many steps each rank's committed shard state "
        "is copied, in the background, into the memory of its buddy (the next node in rank "
        "order whose failure_domain differs), over the control plane (TLS where it has TLS), "
        "so that a node that comes back empty resumes from the copy instead of a checkpoint. "
        "Set it alike on every node. 0: off"),
    U32(S_CKPT, "buddy_copy_every_s", buddy_copy_every_s, "0", 0, 4000000000u,
        "CPU backend, world size > 1: a buddy copy also after the first step that ends this many "
        "seconds after the last one (every rank copies the same step: the step's records carry "
        "the request). With buddy_copy_every_steps too, a copy whenever either is due. 0: none "
        "by time"),
    U64(S_CKPT, "buddy_bandwidth_bytes_per_s", buddy_bandwidth_bytes_per_s, "0", 0, 1ull << 40,
        "the most bytes per second a rank's buddy copy is sent at (0: no limit)"),
    STR(S_CKPT, "failure_domain", failure_domain, "", "LABEL",
        "this node's failure domain (a rack, a zone): buddy copies go to a node of another "
        "domain when there is one (\"\": every node its own domain)"),
    U64(S_CKPT, "checkpoint_throttle_bytes_per_s", checkpoint_throttle_bytes_per_s, "0", 0,
        1ull << 40,
        "TESTING ONLY: write checkpoint files no faster than this (0: full speed), so that "
        "kill trials land in the middle of a file"),

    U32(S_OPS, "shutdown_timeout_ms", shutdown_timeout_ms, "10000", 0, 3600000,
        "after SIGTERM, collectives still waiting for a peer this long are aborted so that "
        "zerod exits (0: wait for them, up to collective_timeout_ms)"),
    ENUM(S_OPS, "log_level", log_level, "info", levels,
         "least severe level logged (re-read from the config file on SIGHUP)"),
    STR(S_OPS, "metrics_address", metrics_address, "", "ADDR",
        "listen address of the Prometheus endpoint http://ADDR/metrics, e.g. 127.0.0.1:9400 "
        "(\"\": off; port 0: a free port, logged). It serves numbers only, no secrets, but "
        "anyone who reaches it sees them"),
    STR(S_OPS, "config", config_file, "", "FILE",
        "file of `name = value` lines, read before the environment and flags"),
};

#define NSETTINGS (sizeof settings / sizeof settings[0])
_Static_assert(NSETTINGS <= ZD__CONFIG_MAX_SETTINGS, "raise ZD__CONFIG_MAX_SETTINGS");

/* Longest value quoted back in a message: enough to recognise it, short enough to leave room for
 * what was expected in ZD__ERR_MSG_MAX. */
#define QUOTE_MAX 160

static void *field(zd__config_t *cfg, const setting_t *s) {
  return (char *)cfg + s->offset;
}
static const void *cfield(const zd__config_t *cfg, const setting_t *s) {
  return (const char *)cfg + s->offset;
}

/* Flags accept '-' for '_'; the file accepts either too, so one spelling works everywhere. */
static int find_setting(const char *name, size_t len) {
  for (size_t i = 0; i < NSETTINGS; i++) {
    const char *t = settings[i].name;
    size_t j = 0;
    for (; j < len && t[j]; j++)
      if (t[j] != name[j] && !(t[j] == '_' && name[j] == '-')) break;
    if (j == len && !t[j]) return (int)i;
  }
  return -1;
}

static int setting_index(const char *name) {
  return find_setting(name, strlen(name));
}

/* Whole decimal (or octal) numbers only: strtoull alone would take "-1", " 5", "+5" and "5x". */
static int parse_u64(const char *text, int base, uint64_t *out) {
  char *end;
  if (!isdigit((unsigned char)text[0])) return -1;
  errno = 0;
  unsigned long long v = strtoull(text, &end, base);
  if (errno || *end) return -1;
  *out = v;
  return 0;
}

static char *trim(char *s) {
  while (isspace((unsigned char)*s)) s++;
  size_t n = strlen(s);
  while (n && isspace((unsigned char)s[n - 1])) s[--n] = '\0';
  return s;
}

static int parse_ids(const setting_t *s, const char *text, const char *origin, zd__idlist_t *out,
                     zd__err_t *err) {
  int rc = 0;
  char *save = NULL, *copy = strdup(text);
  if (!copy) return zd__errf(err, -ENOMEM, "%s: out of memory", origin);
  out->n = 0;
  for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    uint64_t id;
    tok = trim(tok);
    if (!*tok) continue;
    if (out->n == ZD__MAX_IDS) {
      rc = zd__errf(err, ZD_ECONFIG, "%s=%.*s: %s takes at most %d ids", origin, QUOTE_MAX, text,
                    s->name, ZD__MAX_IDS);
      goto fail;
    }
    if (isdigit((unsigned char)tok[0])) {
      /* (uid_t)-1 means "no change" to chown and friends: never a real id. */
      if (parse_u64(tok, 10, &id) || id >= UINT32_MAX) {
        rc = zd__errf(err, ZD_ECONFIG,
                      "%s=%.*s: %s must be a comma-separated list of %s names or numbers below "
                      "%u, not '%s'",
                      origin, QUOTE_MAX, text, s->name, s->type == T_UIDS ? "user" : "group",
                      UINT32_MAX, tok);
        goto fail;
      }
    } else if (s->type == T_UIDS) {
      struct passwd *pw = getpwnam(tok);
      if (!pw) {
        rc = zd__errf(err, ZD_ECONFIG, "%s=%.*s: %s: no such user '%s'", origin, QUOTE_MAX, text,
                      s->name, tok);
        goto fail;
      }
      id = pw->pw_uid;
    } else {
      struct group *gr = getgrnam(tok);
      if (!gr) {
        rc = zd__errf(err, ZD_ECONFIG, "%s=%.*s: %s: no such group '%s'", origin, QUOTE_MAX, text,
                      s->name, tok);
        goto fail;
      }
      id = gr->gr_gid;
    }
    out->ids[out->n++] = (uint32_t)id;
  }
fail:
  free(copy);
  return rc;
}

/* Parses text for setting s and stores it; origin says where text came from ("ZEROD_SOCKET",
 * "--socket", "zerod.conf:3: socket") and starts every message. */
static int set_value(zd__config_t *cfg, int idx, const char *text, const char *origin, int source,
                     zd__err_t *err) {
  const setting_t *s = &settings[idx];
  uint64_t v;
  switch (s->type) {
    case T_STRING: {
      char *copy = strdup(text), **p = field(cfg, s);
      if (!copy) return zd__errf(err, -ENOMEM, "%s: out of memory", origin);
      free(*p);
      *p = copy;
      break;
    }
    case T_U32:
    case T_U64:
      if (parse_u64(text, 10, &v) || v < s->min || v > s->max)
        return zd__errf(err, ZD_ECONFIG, "%s=%.*s: %s must be a whole number between %llu and %llu",
                        origin, QUOTE_MAX, text, s->name, (unsigned long long)s->min,
                        (unsigned long long)s->max);
      if (s->type == T_U32)
        *(uint32_t *)field(cfg, s) = (uint32_t)v;
      else
        *(uint64_t *)field(cfg, s) = v;
      break;
    case T_MODE:
      if (parse_u64(text, 8, &v) || v > s->max)
        return zd__errf(err, ZD_ECONFIG, "%s=%.*s: %s must be an octal mode between 0000 and 0777",
                        origin, QUOTE_MAX, text, s->name);
      *(uint32_t *)field(cfg, s) = (uint32_t)v;
      break;
    case T_UIDS:
    case T_GIDS: {
      zd__idlist_t ids;
      int rc = parse_ids(s, text, origin, &ids, err);
      if (rc) return rc;
      *(zd__idlist_t *)field(cfg, s) = ids;
      break;
    }
    case T_ENUM: {
      const char *const *val = s->values;
      while (*val && strcmp(*val, text)) val++;
      if (!*val) {
        char allowed[128] = "";
        for (val = s->values; *val; val++) {
          if (val != s->values) strncat(allowed, ", ", sizeof allowed - strlen(allowed) - 1);
          strncat(allowed, *val, sizeof allowed - strlen(allowed) - 1);
        }
        return zd__errf(err, ZD_ECONFIG, "%s=%.*s: %s must be one of %s", origin, QUOTE_MAX, text,
                        s->name, allowed);
      }
      char *copy = strdup(*val), **p = field(cfg, s);
      if (!copy) return zd__errf(err, -ENOMEM, "%s: out of memory", origin);
      free(*p);
      *p = copy;
      break;
    }
  }
  cfg->source[idx] = (unsigned char)source;
  return 0;
}

/* `name = value` or `name value`; '#' starts a comment at the start of a line or after a blank,
 * so a '#' inside a path or address survives; "..." quotes allow an empty value. */
static int load_file(zd__config_t *cfg, const char *path, const char *from, zd__err_t *err) {
  char *line = NULL, origin[512];
  size_t cap = 0;
  unsigned lineno = 0;
  int rc = 0;
  FILE *f = fopen(path, "r");
  if (!f)
    return zd__errf(err, -errno, "config file %s (from %s): cannot open: %s", path, from,
                    strerror(errno));
  errno = 0;
  while (getline(&line, &cap, f) != -1) {
    char *p = line, *name, *value;
    size_t namelen;
    int idx, has_eq = 0;
    lineno++;
    for (char *c = p; *c; c++)
      if (*c == '#' && (c == p || isspace((unsigned char)c[-1]))) {
        *c = '\0';
        break;
      }
    p = trim(p);
    if (!*p) continue;
    name = p;
    namelen = strspn(p, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-");
    p += namelen;
    if (!namelen || (*p && !isspace((unsigned char)*p) && *p != '=')) {
      rc = zd__errf(err, ZD_ECONFIG, "%s:%u: expected 'name = value', got '%.*s'", path, lineno,
                    QUOTE_MAX, name);
      goto fail;
    }
    while (isspace((unsigned char)*p)) p++;
    if (*p == '=') {
      has_eq = 1;
      p++;
      while (isspace((unsigned char)*p)) p++;
    }
    name[namelen] = '\0';
    value = p;
    idx = find_setting(name, namelen);
    if (idx < 0) {
      rc = zd__errf(err, ZD_ECONFIG, "%s:%u: unknown setting '%.*s' (see zerod --help)", path,
                    lineno, QUOTE_MAX, name);
      goto fail;
    }
    if (settings[idx].offset == FIELD(config_file)) {
      rc = zd__errf(err, ZD_ECONFIG,
                    "%s:%u: config cannot be set in a config file; use --config "
                    "or ZEROD_CONFIG",
                    path, lineno);
      goto fail;
    }
    if (!*value && !has_eq) {
      rc = zd__errf(err, ZD_ECONFIG, "%s:%u: %s: missing value", path, lineno, settings[idx].name);
      goto fail;
    }
    size_t vlen = strlen(value);
    if (vlen >= 2 && value[0] == '"' && value[vlen - 1] == '"') {
      value[vlen - 1] = '\0';
      value++;
    }
    snprintf(origin, sizeof origin, "%.300s:%u: %s", path, lineno, settings[idx].name);
    rc = set_value(cfg, idx, value, origin, SRC_FILE, err);
    if (rc) goto fail;
    errno = 0;
  }
  if (ferror(f)) {
    int e = errno ? errno : EIO;
    rc = zd__errf(err, -e, "config file %s (from %s): cannot read: %s", path, from, strerror(e));
  }
fail:
  free(line);
  fclose(f);
  return rc;
}

static const char *env_lookup(char **envp, const char *var) {
  size_t len = strlen(var);
  for (char **e = envp; e && *e; e++)
    if (!strncmp(*e, var, len) && (*e)[len] == '=') return *e + len + 1;
  return NULL;
}

static void env_name(const setting_t *s, char *buf, size_t len) {
  size_t i = (size_t)snprintf(buf, len, "ZEROD_");
  for (const char *c = s->name; *c && i + 1 < len; c++) buf[i++] = (char)toupper((unsigned char)*c);
  buf[i] = '\0';
}

/* Walks argv once. With apply == 0 it only checks the syntax, stops at --help/--version and
 * finds --config (which must be known before the file is read); with apply == 1 it stores the
 * values. Both walks see the same errors in the same order. */
static int scan_flags(zd__config_t *cfg, int argc, char **argv, int apply, const char **config_path,
                      zd__err_t *err) {
  char origin[160];
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i], *value, *eq;
    size_t namelen;
    int idx;
    if (!strcmp(arg, "-h") || !strcmp(arg, "--help")) return ZD__CONFIG_HELP;
    if (!strcmp(arg, "-V") || !strcmp(arg, "--version")) return ZD__CONFIG_VERSION;
    if (!strcmp(arg, "--help-markdown")) return ZD__CONFIG_HELP_MARKDOWN;
    if (strncmp(arg, "--", 2) != 0 || !arg[2]) {
      if (arg[0] == '-' && arg[1])
        return zd__errf(err, ZD_ECONFIG, "unknown flag %.*s (see zerod --help)", QUOTE_MAX, arg);
      return zd__errf(err, ZD_ECONFIG, "unexpected argument '%.*s': settings are --NAME VALUE",
                      QUOTE_MAX, arg);
    }
    eq = strchr(arg, '=');
    namelen = eq ? (size_t)(eq - arg - 2) : strlen(arg + 2);
    idx = find_setting(arg + 2, namelen);
    if (idx < 0)
      return zd__errf(err, ZD_ECONFIG, "unknown flag --%.*s (see zerod --help)",
                      (int)(namelen < QUOTE_MAX ? namelen : QUOTE_MAX), arg + 2);
    snprintf(origin, sizeof origin, "--%.*s", (int)namelen, arg + 2);
    if (eq) {
      value = eq + 1;
    } else if (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
      value = argv[++i];
    } else {
      return zd__errf(
          err, ZD_ECONFIG, "%s: missing value (%s)", origin,
          i + 1 < argc ? "use --NAME=VALUE for a value starting with --" : "last argument");
    }
    if (settings[idx].offset == FIELD(config_file)) {
      if (!apply) *config_path = value;
    } else if (apply) {
      int rc = set_value(cfg, idx, value, origin, SRC_FLAG, err);
      if (rc) return rc;
    }
  }
  return ZD__CONFIG_RUN;
}

/* Defaults that depend on the environment or on other settings, then checks across settings. */
static int resolve(zd__config_t *cfg, zd__err_t *err) {
  const unsigned char *src = cfg->source;
  int i_socket = setting_index("socket"), i_uids = setting_index("allowed_uids");
  int i_local = setting_index("local_ranks"), i_world = setting_index("world_size");
  int i_first = setting_index("first_rank"), i_ctl = setting_index("control_address");
  int i_rpg = setting_index("ranks_per_gpu");
  char path[sizeof(((struct sockaddr_un *)0)->sun_path)];

  if (!cfg->socket_path[0]) {
    int rc = zd__socket_default_path(path, sizeof path);
    if (rc)
      return zd__errf(err, ZD_ECONFIG,
                      "socket: the default path ($XDG_RUNTIME_DIR/zerod.sock) is "
                      "longer than %zu bytes; set socket",
                      sizeof path - 1);
    char *copy = strdup(path);
    if (!copy) return zd__errf(err, -ENOMEM, "socket: out of memory");
    free(cfg->socket_path);
    cfg->socket_path = copy;
  } else if (strlen(cfg->socket_path) >= sizeof path) {
    return zd__errf(err, ZD_ECONFIG,
                    "socket (%s): %.*s is %zu bytes, a Unix socket path holds at "
                    "most %zu",
                    source_names[src[i_socket]], QUOTE_MAX, cfg->socket_path,
                    strlen(cfg->socket_path), sizeof path - 1);
  }

  if (src[i_uids] == SRC_DEFAULT) {
    uint32_t self = (uint32_t)geteuid();
    cfg->allowed_uids.n = 0;
    cfg->allowed_uids.ids[cfg->allowed_uids.n++] = self;
    if (self != 0) cfg->allowed_uids.ids[cfg->allowed_uids.n++] = 0;
  }
  if (!cfg->allowed_uids.n && !cfg->allowed_gids.n)
    return zd__errf(err, ZD_ECONFIG,
                    "allowed_uids and allowed_gids are both empty: no client "
                    "could connect");

  if (!cfg->world_size) {
    cfg->world_size = cfg->local_ranks;
  } else if (cfg->world_size < cfg->local_ranks) {
    return zd__errf(err, ZD_ECONFIG,
                    "world_size=%u (%s) is less than local_ranks=%u (%s): the "
                    "world must hold this daemon's ranks (world_size 0 means local_ranks)",
                    cfg->world_size, source_names[src[i_world]], cfg->local_ranks,
                    source_names[src[i_local]]);
  }
  if ((uint64_t)cfg->first_rank + cfg->local_ranks > cfg->world_size)
    return zd__errf(err, ZD_ECONFIG,
                    "first_rank=%u (%s) + local_ranks=%u (%s) exceeds "
                    "world_size=%u (%s): this daemon's ranks %u..%u must be below world_size",
                    cfg->first_rank, source_names[src[i_first]], cfg->local_ranks,
                    source_names[src[i_local]], cfg->world_size, source_names[src[i_world]],
                    cfg->first_rank, cfg->first_rank + cfg->local_ranks - 1);

  /* Several ranks on one GPU reduce through the in-process group communicator (comm.h), which
   * joins the ranks of this zerod only: a world beyond it, or a second GPU, would need NCCL
   * between the groups as well (a hierarchical communicator, not built). */
  if (cfg->ranks_per_gpu > cfg->local_ranks)
    return zd__errf(err, ZD_ECONFIG,
                    "ranks_per_gpu=%u (%s) is more than local_ranks=%u (%s): a GPU can only be "
                    "shared by this daemon's own ranks",
                    cfg->ranks_per_gpu, source_names[src[i_rpg]], cfg->local_ranks,
                    source_names[src[i_local]]);
  if (cfg->ranks_per_gpu > 1 && cfg->world_size != cfg->local_ranks)
    return zd__errf(err, ZD_ECONFIG,
                    "ranks_per_gpu > 1 needs the whole world in this zerod for now: world_size "
                    "%u, local_ranks %u (ranks_per_gpu=%u, %s)",
                    cfg->world_size, cfg->local_ranks, cfg->ranks_per_gpu,
                    source_names[src[i_rpg]]);
  if (cfg->ranks_per_gpu > 1 && cfg->ranks_per_gpu != cfg->local_ranks)
    return zd__errf(err, ZD_ECONFIG,
                    "ranks_per_gpu=%u (%s) with local_ranks=%u: ranks_per_gpu > 1 needs every "
                    "local rank on one GPU for now (ranks_per_gpu = local_ranks = world_size); "
                    "ranks on several GPUs would need NCCL between the GPUs' groups",
                    cfg->ranks_per_gpu, source_names[src[i_rpg]], cfg->local_ranks);

  /* state_dir_mode (the backend's part, auto on CUDA and mapped refused there: daemon.c) */
  int snap_every = cfg->state_snapshot_every_steps || cfg->state_snapshot_every_s;
  if (!strcmp(cfg->state_dir_mode, "mapped") && snap_every)
    return zd__errf(err, ZD_ECONFIG,
                    "state_snapshot_every_steps=%u / state_snapshot_every_s=%u are for "
                    "state_dir_mode = snapshot, and state_dir_mode is mapped (%s): set them to 0 "
                    "or state_dir_mode = snapshot",
                    cfg->state_snapshot_every_steps, cfg->state_snapshot_every_s,
                    source_names[src[setting_index("state_dir_mode")]]);
  if (!strcmp(cfg->state_dir_mode, "snapshot") && !cfg->state_dir[0])
    return zd__errf(err, ZD_ECONFIG,
                    "state_dir_mode = snapshot (%s) needs state_dir, the directory its snapshot "
                    "files are written to",
                    source_names[src[setting_index("state_dir_mode")]]);
  if (!strcmp(cfg->state_dir_mode, "snapshot") && !snap_every)
    return zd__errf(err, ZD_ECONFIG,
                    "state_dir_mode = snapshot needs state_snapshot_every_steps > 0 or "
                    "state_snapshot_every_s > 0 (both are 0: no snapshot would ever be taken); "
                    "e.g. state_snapshot_every_steps = 100");
  if (snap_every && !cfg->state_dir[0])
    return zd__errf(err, ZD_ECONFIG,
                    "state_snapshot_every_steps=%u / state_snapshot_every_s=%u need state_dir, "
                    "the directory the snapshots are written to (\"\": none set)",
                    cfg->state_snapshot_every_steps, cfg->state_snapshot_every_s);

  if (!cfg->bucket_elems) cfg->bucket_elems = zd__layout_default_bucket_elems(cfg->world_size);

  if (!cfg->control_address[0])
    return zd__errf(err, ZD_ECONFIG, "control_address (%s) is empty: it must be host:port",
                    source_names[src[i_ctl]]);
  /* An etcd rendezvous is where every rank's store calls go: the world's code reads it from
   * rendezvous_address (rendezvous.h tells the two kinds of address apart). */
  if (strcmp(cfg->rendezvous, "builtin") != 0) {
    const char *ep = cfg->rendezvous + strlen("etcd://");
    if (strncmp(cfg->rendezvous, "etcd://", strlen("etcd://")) != 0 || !*ep || *ep == '/' ||
        *ep == ',')
      return zd__errf(err, ZD_ECONFIG,
                      "rendezvous (%s) is '%.200s'; expected builtin or "
                      "etcd://host:port[,host:port...][/job]",
                      source_names[src[setting_index("rendezvous")]], cfg->rendezvous);
    char *copy = strdup(cfg->rendezvous);
    if (!copy) return zd__errf(err, -ENOMEM, "rendezvous: out of memory");
    free(cfg->rendezvous_address);
    cfg->rendezvous_address = copy;
  }
  if (!cfg->rendezvous_address[0]) {
    char *copy = strdup(cfg->control_address);
    if (!copy) return zd__errf(err, -ENOMEM, "rendezvous_address: out of memory");
    free(cfg->rendezvous_address);
    cfg->rendezvous_address = copy;
  }
  return 0;
}

int zd__config_load(zd__config_t *cfg, int argc, char **argv, char **envp, zd__err_t *err) {
  const char *config_path = NULL, *text;
  char var[64];
  int rc, i_config = setting_index("config");

  memset(cfg, 0, sizeof *cfg);
  cfg->argc = argc;
  cfg->argv = argv;
  if (!envp) envp = environ;
  for (size_t i = 0; i < NSETTINGS; i++) {
    rc = set_value(cfg, (int)i, settings[i].def, "default", SRC_DEFAULT, err);
    if (rc) goto fail;
  }

  rc = scan_flags(cfg, argc, argv, 0, &config_path, err);
  if (rc) goto fail;
  if (config_path) {
    rc = set_value(cfg, i_config, config_path, "--config", SRC_FLAG, err);
  } else if ((text = env_lookup(envp, "ZEROD_CONFIG"))) {
    rc = set_value(cfg, i_config, text, "ZEROD_CONFIG", SRC_ENV, err);
  }
  if (rc) goto fail;
  if (cfg->config_file[0]) {
    rc = load_file(cfg, cfg->config_file, config_path ? "--config" : "ZEROD_CONFIG", err);
    if (rc) goto fail;
  }

  for (size_t i = 0; i < NSETTINGS; i++) {
    if ((int)i == i_config) continue;
    env_name(&settings[i], var, sizeof var);
    if (!(text = env_lookup(envp, var))) continue;
    rc = set_value(cfg, (int)i, text, var, SRC_ENV, err);
    if (rc) goto fail;
  }

  rc = scan_flags(cfg, argc, argv, 1, NULL, err);
  if (rc) goto fail;
  rc = resolve(cfg, err);
  if (rc) goto fail;
  return ZD__CONFIG_RUN;

fail:
  zd__config_free(cfg);
  return rc;
}

void zd__config_free(zd__config_t *cfg) {
  if (!cfg) return;
  for (size_t i = 0; i < NSETTINGS; i++) {
    if (settings[i].type != T_STRING && settings[i].type != T_ENUM) continue;
    char **p = field(cfg, &settings[i]);
    free(*p);
    *p = NULL;
  }
}

static const char *format_value(const zd__config_t *cfg, const setting_t *s, char *buf,
                                size_t len) {
  switch (s->type) {
    case T_STRING:
    case T_ENUM: {
      const char *str = *(char *const *)cfield(cfg, s);
      return str ? str : "";
    }
    case T_U32:
      snprintf(buf, len, "%u", *(const uint32_t *)cfield(cfg, s));
      break;
    case T_U64:
      snprintf(buf, len, "%llu", (unsigned long long)*(const uint64_t *)cfield(cfg, s));
      break;
    case T_MODE:
      snprintf(buf, len, "%04o", *(const uint32_t *)cfield(cfg, s));
      break;
    case T_UIDS:
    case T_GIDS: {
      const zd__idlist_t *ids = cfield(cfg, s);
      size_t used = 0;
      buf[0] = '\0';
      for (uint32_t i = 0; i < ids->n && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, "%s%u", i ? "," : "", ids->ids[i]);
      break;
    }
  }
  return buf;
}

void zd__config_visit(const zd__config_t *cfg, zd__config_visit_fn fn, void *ctx) {
  /* ZD__MAX_IDS ids of up to 10 digits and a comma each. */
  char buf[ZD__MAX_IDS * 11 + 1];
  for (size_t i = 0; i < NSETTINGS; i++) {
    unsigned src = cfg->source[i];
    fn(ctx, settings[i].name, format_value(cfg, &settings[i], buf, sizeof buf),
       source_names[src < 4 ? src : 0]);
  }
}

void zd__config_print_help(FILE *out) {
  const char *section = NULL;
  char var[64], meta[64];
  fprintf(out,
          "Usage: zerod [--config FILE] [--NAME VALUE]...\n"
          "\n"
          "Every setting is a flag (--NAME VALUE or --NAME=VALUE; '-' works for '_'), a\n"
          "variable ZEROD_NAME and a config file line `name = value`. Flags override the\n"
          "environment, which overrides the file, which overrides the defaults.\n"
          "\n"
          "  -h, --help     print this help and exit\n"
          "  -V, --version  print the version and exit\n"
          "  --help-markdown  print the settings as the README's Markdown table and exit\n");
  for (size_t i = 0; i < NSETTINGS; i++) {
    const setting_t *s = &settings[i];
    if (!section || strcmp(section, s->section)) {
      section = s->section;
      fprintf(out, "\n%s:\n", section);
    }
    env_name(s, var, sizeof var);
    switch (s->type) {
      case T_STRING:
        snprintf(meta, sizeof meta, "%s", s->metavar);
        break;
      case T_U32:
      case T_U64:
        snprintf(meta, sizeof meta, "N");
        break;
      case T_MODE:
        snprintf(meta, sizeof meta, "MODE");
        break;
      case T_UIDS:
        snprintf(meta, sizeof meta, "USER,...");
        break;
      case T_GIDS:
        snprintf(meta, sizeof meta, "GROUP,...");
        break;
      case T_ENUM:
        meta[0] = '\0';
        for (const char *const *v = s->values; *v; v++) {
          if (v != s->values) strncat(meta, "|", sizeof meta - strlen(meta) - 1);
          strncat(meta, *v, sizeof meta - strlen(meta) - 1);
        }
        break;
    }
    fprintf(out, "  --%s %s  (%s", s->name, meta, var);
    if (s->def[0]) fprintf(out, "; default %s", s->def);
    if (s->type == T_U32 || s->type == T_U64)
      fprintf(out, "; %llu..%llu", (unsigned long long)s->min, (unsigned long long)s->max);
    fprintf(out, ")\n      %s\n", s->help);
  }
}

/* The README's settings table is this output (a lint test compares them), so the README cannot
 * fall behind the table either. '|' in help texts would break a row: there is none. */
void zd__config_print_markdown(FILE *out) {
  char var[64];
  fprintf(out,
          "| setting | environment | default | meaning |\n"
          "|---|---|---|---|\n");
  for (size_t i = 0; i < NSETTINGS; i++) {
    const setting_t *s = &settings[i];
    env_name(s, var, sizeof var);
    fprintf(out, "| `%s` | `%s` | %s%s%s | %s", s->name, var, s->def[0] ? "`" : "",
            s->def[0] ? s->def : "(see meaning)", s->def[0] ? "`" : "", s->help);
    if (s->type == T_U32 || s->type == T_U64)
      fprintf(out, " (%llu..%llu)", (unsigned long long)s->min, (unsigned long long)s->max);
    if (s->type == T_ENUM) {
      fprintf(out, " (");
      for (const char *const *v = s->values; *v; v++)
        fprintf(out, "%s`%s`", v == s->values ? "" : ", ", *v);
      fprintf(out, ")");
    }
    fprintf(out, " |\n");
  }
}
