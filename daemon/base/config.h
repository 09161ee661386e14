/* zerod's configuration: one table of settings (config.c), read from a config file, ZEROD_*
 * environment variables and command-line flags, in that order of increasing precedence.
 *
 * The same table parses all three sources, prints `zerod --help`, logs the effective
 * configuration at start (each value with where it came from) and feeds the "config" section of
 * the status (redis standardConfig, memcached `stats settings`). Adding a setting is adding one
 * row to the table and one field here.
 */
#ifndef ZD_DAEMON_CONFIG_H
#define ZD_DAEMON_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "error.h"

#define ZD__MAX_IDS             32
#define ZD__CONFIG_MAX_SETTINGS 64 /* rows the table in config.c may have */

typedef struct zd__idlist {
  uint32_t n;
  uint32_t ids[ZD__MAX_IDS];
} zd__idlist_t;

typedef struct zd__config {
  /* local protocol */
  char *socket_path;         /* socket; "" resolved to the default path at load */
  uint32_t socket_mode;      /* socket_mode, octal */
  zd__idlist_t allowed_uids; /* allowed_uids; default: the daemon's uid and 0 */
  zd__idlist_t allowed_gids; /* allowed_gids; default: none */
  uint32_t max_clients;
  uint32_t max_clients_per_uid;
  uint32_t hello_timeout_ms; /* a connection must say hello within this */
  uint32_t max_frame_bytes;
  uint32_t frame_timeout_ms; /* a frame started must be complete within this */
  uint32_t max_inflight;     /* pipelined requests per client */
  uint32_t busy_poll_us;     /* after a reply, the loop polls this long before sleeping */
  /* compute */
  char *backend;           /* auto | cpu | cuda */
  uint32_t threads;        /* kernel threads; 0: one per CPU */
  uint32_t pin_threads;    /* bind them to CPUs of their own (pool.h) */
  char *kernel_isa;        /* auto | avx512bf16 | avx512 | avx2 | scalar */
  uint32_t overlap_update; /* two sets of state arrays, buckets updated as scattered (model.h) */
  /* CUDA: local ranks per GPU (local rank i on GPU i / ranks_per_gpu) */
  uint32_t ranks_per_gpu;
  char *cuda_step; /* fast | legacy: how a CUDA rank waits and answers (rank.h) */
  /* world */
  uint32_t local_ranks;      /* R */
  uint32_t world_size;       /* W; 0: local_ranks (a single-node world) */
  char *world_size_record;   /* use | ignore: a live resize's record over world_size */
  uint32_t first_rank;       /* global rank of local rank 0 */
  uint64_t bucket_elems;     /* 0: max(40M, 1M * W) */
  char *control_address;     /* gRPC control service listen address */
  char *rendezvous_address;  /* rank 0's control service; "": control_address */
  char *rendezvous;          /* "builtin" (rank 0's store) or etcd://host:port[,...][/job] */
  char *control_token_file;  /* the store's calls need its token; "": none */
  uint32_t control_insecure; /* 1: a control_address beyond loopback is allowed without TLS */
  char *tls_cert;            /* mutual TLS: this node's certificate; "": no TLS */
  char *tls_key;             /* its private key */
  char *tls_ca;              /* the CA every member's certificate is signed by */
  uint32_t collective_timeout_ms;
  uint32_t connect_timeout_ms; /* peers must join the world within this at start */
  uint32_t heartbeat_ms;       /* other nodes' health checked this often */
  uint32_t peer_timeout_ms;    /* a node silent this long is dead */
  char *collective_host;       /* Gloo's listen/connect address of this node */
  /* checkpoints */
  char *checkpoint_dir; /* "": off */
  uint32_t checkpoint_every_steps;
  uint32_t checkpoint_every_seconds;
  uint32_t checkpoint_keep;
  char *resume;                        /* "", "latest" or a checkpoint directory */
  char *state_dir;                     /* "": off (state_file.h) */
  uint32_t state_dir_any_fs;           /* 1: a state_dir off tmpfs/ramfs is allowed */
  char *state_dir_mode;                /* auto | mapped | snapshot (step/snapshot.h) */
  uint32_t state_snapshot_every_steps; /* snapshot mode: 0 none by steps */
  uint32_t state_snapshot_every_s;     /* snapshot mode: 0 none by time */
  uint64_t checkpoint_throttle_bytes_per_s;
  uint32_t buddy_copy_every_steps;      /* 0: off (step/buddy.h) */
  uint32_t buddy_copy_every_s;          /* 0: none by time */
  uint64_t buddy_bandwidth_bytes_per_s; /* 0: no limit */
  char *failure_domain;                 /* "": none */
  /* operations */
  uint32_t shutdown_timeout_ms; /* then abort collectives still running */
  char *log_level;              /* error | warn | info | debug */
  char *metrics_address;        /* Prometheus endpoint (metrics.h); "": off */
  char *config_file;            /* --config / ZEROD_CONFIG */
  /* Where each setting came from, indexed like the table in config.c; read it through
   * zd__config_visit(). Kept in the instance so two loads (tests, reload) do not share it. */
  unsigned char source[ZD__CONFIG_MAX_SETTINGS];
  /* The command line it was loaded from, for a reload (SIGHUP); not owned. */
  int argc;
  char **argv;
} zd__config_t;

/* Result of zd__config_load() besides errors. */
enum {
  ZD__CONFIG_RUN = 0,
  ZD__CONFIG_HELP = 1,
  ZD__CONFIG_VERSION = 2,
  ZD__CONFIG_HELP_MARKDOWN = 3
};

/* Fills cfg from defaults, the config file (--config FILE or ZEROD_CONFIG), ZEROD_* variables of
 * envp (NULL: environ) and argv flags (--name VALUE or --name=VALUE; setting names with '-' or
 * '_'). Returns ZD__CONFIG_RUN, ZD__CONFIG_HELP (--help/-h), ZD__CONFIG_VERSION (--version/-V),
 * ZD__CONFIG_HELP_MARKDOWN (--help-markdown), or a negative code with a message naming the
 * setting, its source (file:line, variable or flag), the bad value and what is expected
 * (ZD_ECONFIG, -ENOENT for a missing file). cfg is overwritten, not freed: pass a zeroed or freed
 * one. On any result but ZD__CONFIG_RUN it is left released (zd__config_free() on it is still
 * fine). Start-up and the loop thread's SIGHUP reload only, where no other thread calls
 * getpwnam, getgrnam or setenv: not thread-safe. */
int zd__config_load(zd__config_t *cfg, int argc, char **argv, char **envp, zd__err_t *err);

/* Releases the strings; accepts a zeroed or partly loaded cfg. */
void zd__config_free(zd__config_t *cfg);

/* `zerod --help`: usage and every setting with its type, default and meaning. */
void zd__config_print_help(FILE *out);

/* `zerod --help-markdown`: every setting as a row of the README's Markdown table. */
void zd__config_print_markdown(FILE *out);

/* Calls fn for each setting in table order with its name, effective value as text and source
 * ("default", "file", "env" or "flag"). */
typedef void (*zd__config_visit_fn)(void *ctx, const char *name, const char *value,
                                    const char *source);
void zd__config_visit(const zd__config_t *cfg, zd__config_visit_fn fn, void *ctx);

#endif /* ZD_DAEMON_CONFIG_H */
