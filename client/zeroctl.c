/* zeroctl: the operator's command line for zerod's control service (docs/design.md).
 *
 *   zeroctl [--address ADDR] [--timeout-ms N] status [--world] [--json] [--watch SECONDS]
 *   zeroctl [--address ADDR] [--timeout-ms N] health [--service NAME]
 *   zeroctl [--address ADDR] [--timeout-ms N] [--token-file FILE] checkpoint [--wait SECONDS]
 *   zeroctl [--address ADDR] [--token-file FILE] drain [--leave] [--wait SECONDS] [--force]
 *   zeroctl [--address ADDR] [--token-file FILE] resize --world_size N [--wait SECONDS]
 *   zeroctl verify CKPT_DIR
 *   zeroctl export CKPT_DIR --out FILE [--moments]
 *   zeroctl import FILE --out ROOT
 *
 * status asks one node for its ranks (shard, step, loss scale, grad norm, step time, client,
 * health) and prints a table, or JSON for scripts; --world asks that node for the node registry
 * (Nodes, on rank 0's node: zeroctl follows the node's rendezvous_address if it is not that node)
 * and then every node (up to FETCH_THREADS at a time, so that N unreachable nodes cost one timeout,
 * not N), merging the rows by global rank. A node that cannot be reached is a row of its own with
 * the error; status exits 1 when a node cannot be reached or a rank is degraded or missing, so
 * that scripts and cron checks notice. health is the standard gRPC health check:
 * exit 0 when serving, 1 otherwise, so it fits scripts and probes.
 *
 * checkpoint asks a node for a checkpoint after the next step of every rank of the world (the
 * ranks agree through the step, so any node will do); with --wait it then polls the node's status
 * until a newer checkpoint is complete (exit 0) or a failure is reported (exit 1). The call
 * carries the control token of --token-file (or $ZEROD_CONTROL_TOKEN_FILE) where zerod has one.
 *
 * drain readies a node for maintenance (a Kubernetes preStop hook, by hand before a reboot): one
 * call that zerod answers once the checkpoint it asked for is complete, as that zerod begins to
 * shut down; the call's deadline is --wait plus a margin, so that zerod's own bound answers first.
 * drain --leave does it without storage: the node's ranks leave the world through a live resize
 * (the node of the highest ranks only) and the others go on at the smaller size.
 *
 * verify and export work offline on a checkpoint directory (common/checkpoint_format.h), no
 * zerod involved: verify checks every rank file's size, checksum and header against the manifest;
 * export writes the fp32 master weights (and with --moments Adam's moments) as one safetensors
 * file by parameter name, for the rest of the ecosystem. import goes the other way: optimizer state
 * saved from torch (zerod.checkpoint.save_torch_state) becomes a checkpoint that zerod resumes.
 *
 * Every call has a timeout and fails fast when nothing listens (no WAIT_FOR_READY): an operator
 * wants "cannot reach zerod control service at X: connection refused" at once, not a hang.
 *
 * Where zerod has mutual TLS (tls_cert), zeroctl connects with --tls-cert, --tls-key and --tls-ca
 * (or $ZEROCTL_TLS_CERT, _KEY, _CA: zeroctl's own certificate, not the node's ZEROD_TLS_*).
 */
#include <errno.h>
#include <grpc/grpc.h>
#include <grpc/support/log.h>
#include <inttypes.h>
#include <limits.h>
#include <time.h>
#include <unistd.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint_format.h"
#include "token.h"
#include "control.pb-c.h"
#include "error.h"
#include "grpc_unary.h"
#include "health.pb-c.h"

#define DEFAULT_ADDRESS      "127.0.0.1:7070"
#define DEFAULT_TIMEOUT_MS   5000
#define DEFAULT_DRAIN_WAIT_S 120
#define DRAIN_MARGIN_MS      10000 /* the call outlives zerod's wait by this much */

enum { EXIT_OK = 0, EXIT_FAIL = 1, EXIT_USAGE = 2 };

typedef struct options {
  const char *address;
  int timeout_ms;
  const char *command;
  int world;
  int json;
  int watch_s; /* status --watch: refresh every this many seconds; 0: once */
  const char *service;
  const char *ckpt_dir;   /* verify, export */
  const char *out;        /* export --out */
  int moments;            /* export --moments */
  int wait_s;             /* checkpoint, drain --wait: seconds to wait for it to be complete */
  int force;              /* drain --force: stop even without a checkpoint */
  int leave;              /* drain --leave: leave the world by a live resize, no checkpoint */
  uint32_t world_size;    /* resize --world_size */
  const char *token_file; /* --token-file: the control token for calls that write */
  const char *tls_cert, *tls_key, *tls_ca; /* --tls-*: mutual TLS; NULL: plaintext */
} options_t;

/* One node as zeroctl saw it: its status, or why there is none. */
typedef struct node {
  char *address;
  uint32_t first_rank; /* from the registry, for the rows of a node that did not answer */
  uint32_t local_ranks;
  Zerod__V1__NodeStatus *status;
  char error[ZD__ERR_MSG_MAX];
} node_t;

/* One row of the table: a rank of a node that answered, or a rank nobody could describe. */
typedef struct row {
  uint32_t rank;
  const node_t *node;                /* NULL: no node registered this rank */
  const Zerod__V1__RankStatus *stat; /* NULL: no status (see node->error) */
} row_t;

static void usage(FILE *out) {
  fprintf(
      out,
      "usage: zeroctl [--address ADDR] [--timeout-ms N] COMMAND [OPTIONS]\n"
      "\n"
      "Commands:\n"
      "  status [--world] [--json]  ranks of a zerod: shard, step, loss scale, last grad norm,\n"
      "                             last step time, attached client, health (and why not ok);\n"
      "                             --world: every node of the world, through rank 0's node\n"
      "                             (or, with an etcd rendezvous, any node);\n"
      "                             --json: machine-readable output; exit status 1 when\n"
      "                             a node is unreachable or a rank degraded or missing;\n"
      "                             --watch SECONDS: redraw the table every SECONDS until\n"
      "                             interrupted (step, step time, loss scale, clients, health)\n"
      "  health [--service NAME]    gRPC health check (service \"\" by default; \"zerod.ranks\"\n"
      "                             is serving only while every local rank is healthy);\n"
      "                             exit status 0 when serving, 1 otherwise\n"
      "  checkpoint [--wait SECONDS]\n"
      "                             ask for a checkpoint after the next step of every rank\n"
      "                             of the world (zerod's checkpoint_dir must be set); --wait:\n"
      "                             until it is complete (exit 0) or failed (exit 1)\n"
      "  resize --world_size N [--wait SECONDS]\n"
      "                             live resize: after the next step of every rank the world\n"
      "                             becomes N ranks, the zerods moving the shards in memory (no\n"
      "                             checkpoint file; CPU backend). Trainers of the ranks below N\n"
      "                             get ZD_EPEER and register again; those of ranks >= N get\n"
      "                             ZD_ERANK and stop. To grow, start the new ranks' zerods\n"
      "                             (world_size N) once this node's status shows N. --wait: until\n"
      "                             this node's ranks report the resize (exit 0) or its failure\n"
      "  drain [--leave] [--wait SECONDS] [--force]\n"
      "                             before maintenance: mark the node draining (readiness\n"
      "                             fails, registrations are refused), checkpoint as above,\n"
      "                             and once that is complete shut this zerod down as SIGTERM\n"
      "                             does; prints the checkpoint's step and directory. --wait:\n"
      "                             for the checkpoint (default %d); exit 1 and zerod goes on\n"
      "                             serving when it fails or is late, or when there is nothing\n"
      "                             to checkpoint (no checkpoint_dir, no model). --force: stop\n"
      "                             anyway (exit 1 if a checkpoint was asked for but failed)\n"
      "                             --leave: no checkpoint: this node's ranks leave the world\n"
      "                             through a live resize to the world without them (the others\n"
      "                             go on training from the step reached; CPU backend), then\n"
      "                             zerod shuts down. Only the node of the highest ranks may\n"
      "                             leave (the staying ranks keep their numbers); refused where\n"
      "                             this node holds every rank. The resize rides the next step;\n"
      "                             this node's ranks leave at their trainers' next request.\n"
      "                             --wait: for them to have left; --force: stop anyway when\n"
      "                             the leave fails or is late (the others lose the node)\n"
      "  verify CKPT_DIR            check a checkpoint offline: every rank file's size, XXH3\n"
      "                             checksum and header against its manifest; exit status 1\n"
      "                             when it is incomplete or corrupt\n"
      "  export CKPT_DIR --out FILE [--moments]\n"
      "                             write a checkpoint's fp32 master weights as one safetensors\n"
      "                             file, a tensor per parameter name (--moments: also\n"
      "                             NAME.exp_avg and NAME.exp_avg_sq, and\n"
      "                             NAME.max_exp_avg_sq with amsgrad); verifies it first\n"
      "  import FILE --out ROOT     make optimizer state saved from torch (Python:\n"
      "                             zerod.checkpoint.save_torch_state) a checkpoint under ROOT\n"
      "                             that zerod resumes (--resume DIR) at any world size; prints\n"
      "                             its directory (offline: no options before the command)\n"
      "\n"
      "Options:\n"
      "  --address ADDR    control service: host:port or unix:/path (default:\n"
      "                    $ZEROD_CONTROL_ADDRESS, else " DEFAULT_ADDRESS
      ")\n"
      "  --timeout-ms N    per call (default %d)\n"
      "  --token-file FILE control token (zerod's control_token_file) for calls that write\n"
      "                    (default: $ZEROD_CONTROL_TOKEN_FILE)\n"
      "  --tls-cert FILE   mutual TLS, for a zerod with tls_cert: zeroctl's certificate (PEM),\n"
      "                    signed by zerod's tls_ca (default: $ZEROCTL_TLS_CERT); with:\n"
      "  --tls-key FILE    its private key (default: $ZEROCTL_TLS_KEY)\n"
      "  --tls-ca FILE     the CA that signed zerod's certificates; zerod's certificate must\n"
      "                    name the host of --address (default: $ZEROCTL_TLS_CA)\n"
      "  -h, --help        this text\n"
      "  -V, --version     zeroctl's version\n"
      "\n"
      "Exit status: 0 success, 1 failure (a node unreachable, a rank degraded or missing, not\n"
      "serving, a checkpoint incomplete or corrupt), 2 bad usage.\n",
      DEFAULT_DRAIN_WAIT_S, DEFAULT_TIMEOUT_MS);
}

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("zeroctl: ", stderr);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputs("\n(zeroctl --help for usage)\n", stderr);
  return EXIT_USAGE;
}

/* Takes "--name VALUE" or "--name=VALUE"; returns the value or NULL if arg is not --name. */
static const char *flag_value(int argc, char **argv, int *i, const char *name, int *missing) {
  size_t n = strlen(name);
  if (strncmp(argv[*i], name, n) != 0) return NULL;
  if (argv[*i][n] == '=') return argv[*i] + n + 1;
  if (argv[*i][n] != '\0') return NULL;
  if (*i + 1 >= argc) {
    *missing = 1;
    return NULL;
  }
  return argv[++*i];
}

static const char *env_or_null(const char *name) {
  const char *v = getenv(name);
  return v && v[0] ? v : NULL;
}

/* Returns -1 to go on, else an exit status (help, version, bad usage). */
static int parse(int argc, char **argv, options_t *o) {
  const char *env = getenv("ZEROD_CONTROL_ADDRESS");
  const char *token_env = getenv("ZEROD_CONTROL_TOKEN_FILE");
  *o = (options_t){.address = env && env[0] ? env : DEFAULT_ADDRESS,
                   .token_file = token_env && token_env[0] ? token_env : NULL,
                   .timeout_ms = DEFAULT_TIMEOUT_MS,
                   .service = "",
                   .tls_cert = env_or_null("ZEROCTL_TLS_CERT"),
                   .tls_key = env_or_null("ZEROCTL_TLS_KEY"),
                   .tls_ca = env_or_null("ZEROCTL_TLS_CA")};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v;
    int missing = 0;
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      usage(stdout);
      return EXIT_OK;
    }
    if (!strcmp(a, "-V") || !strcmp(a, "--version")) {
      printf("zeroctl %s\n", ZD_VERSION);
      return EXIT_OK;
    }
    if ((v = flag_value(argc, argv, &i, "--address", &missing))) {
      if (!v[0]) return usage_error("--address is empty");
      o->address = v;
    } else if ((v = flag_value(argc, argv, &i, "--timeout-ms", &missing))) {
      char *end;
      errno = 0;
      long t = strtol(v, &end, 10);
      if (errno || *end || t < 1 || t > 3600000)
        return usage_error("--timeout-ms '%s': expected milliseconds, 1..3600000", v);
      o->timeout_ms = (int)t;
    } else if ((v = flag_value(argc, argv, &i, "--watch", &missing))) {
      char *end;
      errno = 0;
      long t = strtol(v, &end, 10);
      if (errno || *end || t < 1 || t > 86400)
        return usage_error("--watch '%s': expected seconds, 1..86400", v);
      o->watch_s = (int)t;
    } else if ((v = flag_value(argc, argv, &i, "--wait", &missing))) {
      char *end;
      errno = 0;
      long t = strtol(v, &end, 10);
      if (errno || *end || t < 1 || t > 86400)
        return usage_error("--wait '%s': expected seconds, 1..86400", v);
      o->wait_s = (int)t;
    } else if ((v = flag_value(argc, argv, &i, "--world_size", &missing)) ||
               (v = flag_value(argc, argv, &i, "--world-size", &missing))) {
      char *end;
      errno = 0;
      long n = strtol(v, &end, 10);
      if (errno || *end || n < 2 || n > 65535)
        return usage_error("--world_size '%s': expected 2..65535", v);
      o->world_size = (uint32_t)n;
    } else if ((v = flag_value(argc, argv, &i, "--token-file", &missing))) {
      if (!v[0]) return usage_error("--token-file is empty");
      o->token_file = v;
    } else if ((v = flag_value(argc, argv, &i, "--tls-cert", &missing))) {
      o->tls_cert = v;
    } else if ((v = flag_value(argc, argv, &i, "--tls-key", &missing))) {
      o->tls_key = v;
    } else if ((v = flag_value(argc, argv, &i, "--tls-ca", &missing))) {
      o->tls_ca = v;
    } else if ((v = flag_value(argc, argv, &i, "--service", &missing))) {
      o->service = v;
    } else if ((v = flag_value(argc, argv, &i, "--out", &missing))) {
      if (!v[0]) return usage_error("--out is empty");
      o->out = v;
    } else if (missing) {
      return usage_error("%s needs a value", a);
    } else if (!strcmp(a, "--world")) {
      o->world = 1;
    } else if (!strcmp(a, "--json")) {
      o->json = 1;
    } else if (!strcmp(a, "--moments")) {
      o->moments = 1;
    } else if (!strcmp(a, "--force")) {
      o->force = 1;
    } else if (!strcmp(a, "--leave")) {
      o->leave = 1;
    } else if (a[0] == '-') {
      return usage_error("unknown option '%s'", a);
    } else if (!o->command) {
      o->command = a;
    } else if (!o->ckpt_dir && (!strcmp(o->command, "verify") || !strcmp(o->command, "export"))) {
      o->ckpt_dir = a;
    } else {
      return usage_error("unexpected argument '%s'", a);
    }
  }
  if (!o->command)
    return usage_error("no command given: status, health, checkpoint, drain, verify or export");
  int offline = !strcmp(o->command, "verify") || !strcmp(o->command, "export");
  int drain = !strcmp(o->command, "drain");
  int resize = !strcmp(o->command, "resize");
  if (strcmp(o->command, "status") != 0 && strcmp(o->command, "health") != 0 &&
      strcmp(o->command, "checkpoint") != 0 && !drain && !offline && !resize)
    return usage_error(
        "unknown command '%s': expected status, health, checkpoint, drain, resize, verify or "
        "export",
        o->command);
  if (o->wait_s && strcmp(o->command, "checkpoint") != 0 && !drain && !resize)
    return usage_error("--wait is an option of checkpoint, drain and resize");
  if (resize && !o->world_size) return usage_error("resize needs --world_size N");
  if (!resize && o->world_size) return usage_error("--world_size is an option of resize");
  if (resize && (o->world || o->json || o->watch_s || o->service[0] || o->force))
    return usage_error("resize takes --world_size and --wait only");
  if (o->force && !drain) return usage_error("--force is an option of drain");
  if (o->leave && !drain) return usage_error("--leave is an option of drain");
  if (!strcmp(o->command, "checkpoint") && (o->world || o->json || o->watch_s || o->service[0]))
    return usage_error("checkpoint takes --wait only");
  if (drain && (o->world || o->json || o->watch_s || o->service[0]))
    return usage_error("drain takes --leave, --wait and --force only");
  if (offline) {
    if (!o->ckpt_dir) return usage_error("%s needs a checkpoint directory", o->command);
    if (!strcmp(o->command, "export") && !o->out) return usage_error("export needs --out FILE");
    if (o->world || o->json || o->watch_s || o->service[0] ||
        (!strcmp(o->command, "verify") && (o->out || o->moments)))
      return usage_error("%s takes %s", o->command,
                         !strcmp(o->command, "export") ? "--out and --moments only" : "no options");
  } else if (o->out || o->moments) {
    return usage_error("--out and --moments are options of export");
  }
  if (!strcmp(o->command, "health") && (o->world || o->json || o->watch_s))
    return usage_error("health takes --service only");
  if (o->watch_s && o->json) return usage_error("--watch draws the table: it takes no --json");
  return -1;
}

/* ---- calls --------------------------------------------------------------------------------- */

static int call(const char *address, const char *method, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply,
                int timeout_ms, int *status, zd__err_t *err) {
  zd__grpc_channel_t *ch;
  int rc = zd__grpc_channel_open(address, &ch, err);
  if (rc) return rc;
  rc = zd__grpc_call(ch, method, req, reply_desc, reply, timeout_ms, 0, status, err);
  zd__grpc_channel_close(ch);
  return rc;
}

/* ---- checkpoint ----------------------------------------------------------------------------- */

/* The node's checkpoint status; dir and error (ZD__ERR_MSG_MAX bytes each) get the last complete
 * one's directory and the last failure ("" when none). */
static int node_checkpoint(const options_t *o, Zerod__V1__CheckpointStatus *out, char *dir,
                           char *error, zd__err_t *err) {
  Zerod__V1__NodeStatusRequest req = ZEROD__V1__NODE_STATUS_REQUEST__INIT;
  ProtobufCMessage *reply = NULL;
  int rc = call(o->address, "/zerod.v1.Control/Status", &req.base,
                &zerod__v1__node_status__descriptor, &reply, o->timeout_ms, NULL, err);
  if (rc) return rc;
  Zerod__V1__NodeStatus *st = (Zerod__V1__NodeStatus *)reply;
  if (!st->checkpoint) {
    protobuf_c_message_free_unpacked(reply, NULL);
    return zd__errf(err, ZD_EVERSION, "%s reports no checkpoints (an older zerod)", o->address);
  }
  *out = *st->checkpoint;
  snprintf(dir, ZD__ERR_MSG_MAX, "%s", out->last_dir ? out->last_dir : "");
  snprintf(error, ZD__ERR_MSG_MAX, "%s", out->last_error ? out->last_error : "");
  out->last_dir = out->last_error = NULL; /* freed with the reply */
  protobuf_c_message_free_unpacked(reply, NULL);
  return ZD_OK;
}

static int cmd_checkpoint(const options_t *o) {
  zd__err_t err = {0};
  char token[ZD__TOKEN_MAX] = "";
  if (o->token_file && zd__token_load(o->token_file, token, &err) != 0) {
    fprintf(stderr, "zeroctl: %s\n", err.msg);
    return EXIT_FAIL;
  }
  Zerod__V1__CheckpointStatus before = ZEROD__V1__CHECKPOINT_STATUS__INIT, now;
  char dir[ZD__ERR_MSG_MAX], error[ZD__ERR_MSG_MAX];
  if (o->wait_s && node_checkpoint(o, &before, dir, error, &err) != 0) {
    fprintf(stderr, "zeroctl: %s\n", err.msg);
    return EXIT_FAIL;
  }
  zd__grpc_channel_t *ch;
  Zerod__V1__RequestCheckpointRequest req = ZEROD__V1__REQUEST_CHECKPOINT_REQUEST__INIT;
  ProtobufCMessage *reply = NULL;
  int rc = zd__grpc_channel_open(o->address, &ch, &err);
  if (!rc && token[0] && zd__grpc_channel_set_token(ch, token))
    rc = zd__errf(&err, -ENOMEM, "out of memory");
  if (!rc)
    rc = zd__grpc_call(ch, "/zerod.v1.Control/Checkpoint", &req.base,
                       &zerod__v1__request_checkpoint_reply__descriptor, &reply, o->timeout_ms, 0,
                       NULL, &err);
  if (!rc) zd__grpc_channel_close(ch);
  if (rc) {
    fprintf(stderr, "zeroctl: %s\n", err.msg);
    return EXIT_FAIL;
  }
  protobuf_c_message_free_unpacked(reply, NULL);
  printf("%s: checkpoint requested; taken after the next step of every rank\n", o->address);
  if (!o->wait_s) return EXIT_OK;
  for (int waited_ms = 0; waited_ms < o->wait_s * 1000; waited_ms += 200) {
    usleep(200000);
    if (node_checkpoint(o, &now, dir, error, &err) != 0) {
      fprintf(stderr, "zeroctl: %s\n", err.msg);
      return EXIT_FAIL;
    }
    if (now.failures > before.failures) {
      fprintf(stderr, "zeroctl: checkpoint failed: %s\n", error);
      return EXIT_FAIL;
    }
    if (now.completed > before.completed) {
      printf("complete: step %" PRIu64 " in %s\n", now.last_step, dir);
      return EXIT_OK;
    }
  }
  fprintf(stderr, "zeroctl: no checkpoint complete within %d s (no step taken meanwhile?)\n",
          o->wait_s);
  return EXIT_FAIL;
}

/* ---- resize -------------------------------------------------------------------------------- */

/* The node's first rank's last resize into out (ZD__ERR_MSG_MAX bytes; "" when none). */
static int node_last_resize(const options_t *o, char *out, zd__err_t *err) {
  Zerod__V1__NodeStatusRequest req = ZEROD__V1__NODE_STATUS_REQUEST__INIT;
  ProtobufCMessage *reply = NULL;
  int rc = call(o->address, "/zerod.v1.Control/Status", &req.base,
                &zerod__v1__node_status__descriptor, &reply, o->timeout_ms, NULL, err);
  if (rc) return rc;
  Zerod__V1__NodeStatus *st = (Zerod__V1__NodeStatus *)reply;
  const char *last = st->n_ranks && st->ranks[0]->last_resize ? st->ranks[0]->last_resize : "";
  snprintf(out, ZD__ERR_MSG_MAX, "%s", last);
  protobuf_c_message_free_unpacked(reply, NULL);
  return ZD_OK;
}

static int cmd_resize(const options_t *o) {
  zd__err_t err = {0};
  char token[ZD__TOKEN_MAX] = "", before[ZD__ERR_MSG_MAX] = "", now[ZD__ERR_MSG_MAX];
  if (o->token_file && zd__token_load(o->token_file, token, &err) != 0) {
    fprintf(stderr, "zeroctl: %s\n", err.msg);
    return EXIT_FAIL;
  }
  if (o->wait_s && node_last_resize(o, before, &err) != 0) {
    fprintf(stderr, "zeroctl: %s\n", err.msg);
    return EXIT_FAIL;
  }
  Zerod__V1__ResizeRequest req = ZEROD__V1__RESIZE_REQUEST__INIT;
  req.world_size = o->world_size;
  zd__grpc_channel_t *ch = NULL;
  ProtobufCMessage *reply = NULL;
  int rc = zd__grpc_channel_open(o->address, &ch, &err);
  if (!rc && token[0] && zd__grpc_channel_set_token(ch, token))
    rc = zd__errf(&err, -ENOMEM, "out of memory");
  if (!rc)
    rc = zd__grpc_call(ch, "/zerod.v1.Control/Resize", &req.base,
                       &zerod__v1__resize_reply__descriptor, &reply, o->timeout_ms, 0, NULL, &err);
  if (ch) zd__grpc_channel_close(ch);
  if (rc) {
    fprintf(stderr, "zeroctl: resize: %s\n", err.msg);
    return EXIT_FAIL;
  }
  uint32_t from = ((Zerod__V1__ResizeReply *)reply)->world_size;
  protobuf_c_message_free_unpacked(reply, NULL);
  printf("%s: resize from %u to %u ranks requested; done after the next step of every rank\n",
         o->address, from, o->world_size);
  if (!o->wait_s) return EXIT_OK;
  for (int waited_ms = 0; waited_ms < o->wait_s * 1000; waited_ms += 200) {
    usleep(200000);
    if (node_last_resize(o, now, &err) != 0) {
      fprintf(stderr, "zeroctl: %s\n", err.msg);
      return EXIT_FAIL;
    }
    if (strcmp(now, before) != 0) {
      int failed = strstr(now, "failed") != NULL;
      fprintf(failed ? stderr : stdout, "%s%s\n", failed ? "zeroctl: resize " : "resized: ", now);
      return failed ? EXIT_FAIL : EXIT_OK;
    }
  }
  fprintf(stderr, "zeroctl: no resize within %d s (no step taken meanwhile?)\n", o->wait_s);
  return EXIT_FAIL;
}

/* ---- drain --------------------------------------------------------------------------------- */

static int cmd_drain(const options_t *o) {
  zd__err_t err = {0};
  char token[ZD__TOKEN_MAX] = "";
  if (o->token_file && zd__token_load(o->token_file, token, &err) != 0) {
    fprintf(stderr, "zeroctl: %s\n", err.msg);
    return EXIT_FAIL;
  }
  int wait_s = o->wait_s ? o->wait_s : DEFAULT_DRAIN_WAIT_S;
  Zerod__V1__DrainRequest req = ZEROD__V1__DRAIN_REQUEST__INIT;
  req.wait_ms = (uint32_t)wait_s * 1000u;
  req.has_force = 1;
  req.force = o->force;
  req.has_leave = o->leave;
  req.leave = o->leave;
  zd__grpc_channel_t *ch = NULL;
  ProtobufCMessage *reply = NULL;
  int rc = zd__grpc_channel_open(o->address, &ch, &err);
  if (!rc && token[0] && zd__grpc_channel_set_token(ch, token))
    rc = zd__errf(&err, -ENOMEM, "out of memory");
  if (!rc)
    rc =
        zd__grpc_call(ch, "/zerod.v1.Control/Drain", &req.base, &zerod__v1__drain_reply__descriptor,
                      &reply, wait_s * 1000 + DRAIN_MARGIN_MS, 0, NULL, &err);
  if (ch) zd__grpc_channel_close(ch);
  if (rc) {
    fprintf(stderr, "zeroctl: drain: %s\n", err.msg);
    return EXIT_FAIL;
  }
  Zerod__V1__DrainReply *r = (Zerod__V1__DrainReply *)reply;
  int exit_rc = EXIT_OK;
  if (r->has_left && r->left) {
    printf("%s: drained: its ranks left the world after step %" PRIu64
           ", which goes on at %u rank%s without a checkpoint; zerod is shutting down\n",
           o->address, r->left_after_step, r->world_size, r->world_size == 1 ? "" : "s");
  } else if (r->checkpointed) {
    printf("%s: drained: checkpoint of step %" PRIu64 " complete in %s; zerod is shutting down\n",
           o->address, r->step, r->dir ? r->dir : "?");
  } else {
    exit_rc = r->has_lost && r->lost ? EXIT_FAIL : EXIT_OK;
    printf("%s: drained without %s (--force); zerod is shutting down\n", o->address,
           o->leave ? "leaving the world" : "a checkpoint");
    fprintf(stderr, "zeroctl: %s: %s%s\n", o->leave ? "not left" : "no checkpoint",
            r->no_checkpoint ? r->no_checkpoint : "?",
            !exit_rc   ? ""
            : o->leave ? "; the other nodes lose this node's ranks as in a crash"
                       : "; the steps since the last complete checkpoint are lost");
  }
  protobuf_c_message_free_unpacked(reply, NULL);
  return exit_rc;
}

static void fetch_status(node_t *n, int timeout_ms) {
  Zerod__V1__NodeStatusRequest req = ZEROD__V1__NODE_STATUS_REQUEST__INIT;
  zd__err_t err = {0};
  ProtobufCMessage *reply = NULL;
  if (call(n->address, "/zerod.v1.Control/Status", &req.base, &zerod__v1__node_status__descriptor,
           &reply, timeout_ms, NULL, &err) == 0)
    n->status = (Zerod__V1__NodeStatus *)reply;
  else
    snprintf(n->error, sizeof n->error, "%s", err.msg);
}

/* Asks every node for its status, FETCH_THREADS at a time: each thread takes the next node. */
#define FETCH_THREADS 16

typedef struct fetch_all {
  node_t *nodes;
  size_t nnodes;
  int timeout_ms;
  pthread_mutex_t lock;
  size_t next;
} fetch_all_t;

static void *fetch_worker(void *arg) {
  fetch_all_t *f = arg;
  for (;;) {
    pthread_mutex_lock(&f->lock);
    size_t i = f->next++;
    pthread_mutex_unlock(&f->lock);
    if (i >= f->nnodes) return NULL;
    fetch_status(&f->nodes[i], f->timeout_ms);
  }
}

static void fetch_statuses(node_t *nodes, size_t nnodes, int timeout_ms) {
  fetch_all_t f = {.nodes = nodes, .nnodes = nnodes, .timeout_ms = timeout_ms};
  pthread_t tids[FETCH_THREADS];
  size_t nthreads = 0;
  pthread_mutex_init(&f.lock, NULL);
  while (nthreads < FETCH_THREADS && nthreads + 1 < nnodes &&
         pthread_create(&tids[nthreads], NULL, fetch_worker, &f) == 0)
    nthreads++;
  fetch_worker(&f); /* this thread too: with no helper thread it fetches every node itself */
  for (size_t t = 0; t < nthreads; t++) pthread_join(tids[t], NULL);
  pthread_mutex_destroy(&f.lock);
}

/* The node registry, from address or, when that node is not rank 0's, from the rendezvous
 * address it names. */
static int fetch_nodes(const char *address, int timeout_ms, Zerod__V1__NodesReply **out,
                       char **registry, zd__err_t *err) {
  Zerod__V1__NodesRequest req = ZEROD__V1__NODES_REQUEST__INIT;
  ProtobufCMessage *reply = NULL;
  int status;
  *registry = strdup(address);
  int rc = call(address, "/zerod.v1.Control/Nodes", &req.base, &zerod__v1__nodes_reply__descriptor,
                &reply, timeout_ms, &status, err);
  if (rc && status == GRPC_STATUS_FAILED_PRECONDITION) {
    node_t n = {.address = (char *)address};
    fetch_status(&n, timeout_ms);
    if (n.status && n.status->rendezvous_address && n.status->rendezvous_address[0] &&
        strcmp(n.status->rendezvous_address, address) != 0) {
      free(*registry);
      *registry = strdup(n.status->rendezvous_address);
      rc = call(*registry, "/zerod.v1.Control/Nodes", &req.base,
                &zerod__v1__nodes_reply__descriptor, &reply, timeout_ms, NULL, err);
    }
    if (n.status) zerod__v1__node_status__free_unpacked(n.status, NULL);
  }
  *out = (Zerod__V1__NodesReply *)reply;
  return rc;
}

/* ---- output helpers ------------------------------------------------------------------------ */

static void human_bytes(uint64_t b, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = (double)b;
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    u++;
  }
  if (u == 0)
    snprintf(buf, len, "%" PRIu64 " B", b);
  else
    snprintf(buf, len, "%.1f %s", v, units[u]);
}

static void json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
    switch (*p) {
      case '"':
        fputs("\\\"", f);
        break;
      case '\\':
        fputs("\\\\", f);
        break;
      case '\n':
        fputs("\\n", f);
        break;
      case '\r':
        fputs("\\r", f);
        break;
      case '\t':
        fputs("\\t", f);
        break;
      case '\b':
        fputs("\\b", f);
        break;
      case '\f':
        fputs("\\f", f);
        break;
      default:
        if (*p < 0x20)
          fprintf(f, "\\u%04x", *p);
        else
          fputc(*p, f);
    }
  }
  fputc('"', f);
}

static void json_double(FILE *f, double v) {
  if (isfinite(v))
    fprintf(f, "%.17g", v);
  else
    fputs("null", f);
}

/* ---- rows ---------------------------------------------------------------------------------- */

static int cmp_row(const void *a, const void *b) {
  const row_t *x = a, *y = b;
  return x->rank < y->rank ? -1 : x->rank > y->rank;
}

/* Rows of every node's ranks, and of the ranks of world_size nobody described; sorted. */
static row_t *make_rows(const node_t *nodes, size_t nnodes, uint32_t world_size, size_t *nrows) {
  size_t cap = world_size, n = 0;
  for (size_t i = 0; i < nnodes; i++)
    cap += nodes[i].status ? nodes[i].status->n_ranks : nodes[i].local_ranks;
  row_t *rows = calloc(cap ? cap : 1, sizeof *rows);
  if (!rows) return NULL;
  for (size_t i = 0; i < nnodes; i++) {
    const node_t *nd = &nodes[i];
    if (nd->status) {
      for (size_t r = 0; r < nd->status->n_ranks; r++)
        rows[n++] =
            (row_t){.rank = nd->status->ranks[r]->rank, .node = nd, .stat = nd->status->ranks[r]};
    } else {
      for (uint32_t r = 0; r < nd->local_ranks; r++)
        rows[n++] = (row_t){.rank = nd->first_rank + r, .node = nd};
    }
  }
  for (uint32_t r = 0; r < world_size; r++) {
    int seen = 0;
    for (size_t j = 0; j < n && !seen; j++) seen = rows[j].rank == r && rows[j].node;
    if (!seen) rows[n++] = (row_t){.rank = r};
  }
  qsort(rows, n, sizeof *rows, cmp_row);
  *nrows = n;
  return rows;
}

/* ---- table --------------------------------------------------------------------------------- */

enum { NCOLS = 12, CELL = 96 };

static const char *const headers[NCOLS] = {"RANK",        "LOCAL",      "NODE",      "HEALTH",
                                           "CLIENT",      "STEP",       "SHARD",     "SHARD_ELEMS",
                                           "STATE_BYTES", "LOSS_SCALE", "GRAD_NORM", "STEP_MS"};

static void row_cells(const row_t *r, char cells[NCOLS][CELL]) {
  for (int i = 0; i < NCOLS; i++) snprintf(cells[i], CELL, "-");
  const Zerod__V1__RankStatus *s = r->stat;
  snprintf(cells[0], CELL, "%u", r->rank);
  if (r->node) snprintf(cells[2], CELL, "%s", r->node->address);
  if (!s) {
    snprintf(cells[3], CELL, "%s", r->node ? "unreachable" : "missing");
    return;
  }
  snprintf(cells[1], CELL, "%u", s->local_rank);
  snprintf(cells[3], CELL, "%s", s->health);
  if (s->client) {
    char tag[24]; /* libzerod names its clients "program[pid]": no need to say the pid twice */
    snprintf(tag, sizeof tag, "[%d]", s->client_pid);
    if (s->has_client_pid && !strstr(s->client, tag))
      snprintf(cells[4], CELL, "%s (pid %d)", s->client, s->client_pid);
    else
      snprintf(cells[4], CELL, "%s", s->client);
  }
  if (s->has_step) snprintf(cells[5], CELL, "%" PRIu64, s->step);
  if (s->n_shard) /* the slice of the first bucket, and how many buckets more (--json: all) */
    snprintf(cells[6], CELL, "[%" PRIu64 ",%" PRIu64 ")%s", s->shard[0]->begin, s->shard[0]->end,
             s->n_shard > 1 ? "+" : "");
  if (s->n_shard > 1) {
    size_t used = strlen(cells[6]);
    snprintf(cells[6] + used, CELL - used, "%zu", s->n_shard - 1);
  }
  if (s->has_shard_elems) snprintf(cells[7], CELL, "%" PRIu64, s->shard_elems);
  if (s->has_state_bytes) {
    char h[32];
    human_bytes(s->state_bytes, h, sizeof h);
    snprintf(cells[8], CELL, "%" PRIu64 " (%s)", s->state_bytes, h);
  }
  if (s->has_loss_scale) snprintf(cells[9], CELL, "%g", s->loss_scale);
  if (s->has_last_grad_norm) snprintf(cells[10], CELL, "%.6g", s->last_grad_norm);
  if (s->has_last_step_us) snprintf(cells[11], CELL, "%.3f", (double)s->last_step_us / 1000.0);
}

static void print_table(const node_t *nodes, size_t nnodes, const row_t *rows, size_t nrows) {
  for (size_t i = 0; i < nnodes; i++) {
    const Zerod__V1__NodeStatus *st = nodes[i].status;
    if (!st) continue;
    printf("node %s: zerod %s, pid %d, ranks %u..%u of %u, backend %s, up %" PRIu64 " s\n",
           nodes[i].address, st->version, st->pid, st->first_rank,
           st->first_rank + (st->local_ranks ? st->local_ranks - 1 : 0), st->world_size,
           st->backend, st->uptime_s);
    if (st->has_configured_world_size)
      printf("node %s: world size %u, configured world_size %u (a live resize)\n", nodes[i].address,
             st->world_size, st->configured_world_size);
    if (st->has_draining && st->draining)
      printf("node %s: draining: shutting down once its checkpoint is complete\n",
             nodes[i].address);
  }
  char(*cells)[NCOLS][CELL] = calloc(nrows ? nrows : 1, sizeof *cells);
  if (!cells) return;
  size_t width[NCOLS];
  for (int c = 0; c < NCOLS; c++) width[c] = strlen(headers[c]);
  for (size_t r = 0; r < nrows; r++) {
    row_cells(&rows[r], cells[r]);
    for (int c = 0; c < NCOLS; c++)
      if (strlen(cells[r][c]) > width[c]) width[c] = strlen(cells[r][c]);
  }
  /* Numbers right-aligned, words left-aligned; no trailing blanks. */
  static const int right[NCOLS] = {1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1};
  printf("\n");
  for (int c = 0; c < NCOLS; c++)
    printf("%s%*s", c ? "  " : "", right[c] ? (int)width[c] : -(int)width[c], headers[c]);
  printf("\n");
  for (size_t r = 0; r < nrows; r++) {
    for (int c = 0; c < NCOLS; c++)
      printf("%s%*s", c ? "  " : "", right[c] ? (int)width[c] : -(int)width[c], cells[r][c]);
    printf("\n");
  }
  free(cells);

  int header = 0;
  for (size_t r = 0; r < nrows; r++) {
    const Zerod__V1__RankStatus *s = rows[r].stat;
    if (!s || !s->degraded_reason) continue;
    if (!header++) printf("\ndegraded:\n");
    printf("  rank %u: %s\n", rows[r].rank, s->degraded_reason);
  }
  header = 0; /* state_dir: where each rank's state lives, and how it last came back */
  for (size_t r = 0; r < nrows; r++) {
    const Zerod__V1__RankStatus *s = rows[r].stat;
    if (!s || (!s->state_file && !s->last_recovery)) continue;
    if (!header++) printf("\nstate:\n");
    printf("  rank %u:", rows[r].rank);
    if (s->state_file)
      printf(" %s, committed step %" PRIu64 ";", s->state_file, s->state_committed_step);
    if (s->last_recovery)
      printf(" last recovery %s at step %" PRIu64 " in %" PRIu64 " ms%s%s", s->last_recovery,
             s->last_recovery_step, s->last_recovery_ms, s->last_recovery_note ? ": " : "",
             s->last_recovery_note ? s->last_recovery_note : "");
    else
      printf(" no recovery since zerod started");
    printf("\n");
  }
  header = 0; /* state snapshots: each rank's newest snapshot in state_dir */
  for (size_t r = 0; r < nrows; r++) {
    const Zerod__V1__RankStatus *s = rows[r].stat;
    if (!s || !s->has_snapshot_step) continue;
    if (!header++) printf("\nstate snapshots:\n");
    printf("  rank %u: step %" PRIu64 ", %" PRIu64 " ms old, %" PRIu64 " bytes\n", rows[r].rank,
           s->snapshot_step, s->snapshot_age_ms, s->snapshot_bytes);
  }
  header = 0; /* buddy copies: each rank's newest copy at its buddy */
  for (size_t r = 0; r < nrows; r++) {
    const Zerod__V1__RankStatus *s = rows[r].stat;
    if (!s || (!s->has_buddy_copy_step && !s->buddy_copy_error)) continue;
    if (!header++) printf("\nbuddy copies:\n");
    printf("  rank %u:", rows[r].rank);
    if (s->has_buddy_copy_step)
      printf(" step %" PRIu64 ", %" PRIu64 " ms old, held by %s", s->buddy_copy_step,
             s->buddy_copy_age_ms, s->buddy_copy_holder ? s->buddy_copy_holder : "?");
    else
      printf(" no copy yet");
    if (s->buddy_copy_error) printf("; last copy failed: %s", s->buddy_copy_error);
    printf("\n");
  }
  header = 0; /* live resize: the last one each rank took part in */
  for (size_t r = 0; r < nrows; r++) {
    const Zerod__V1__RankStatus *s = rows[r].stat;
    if (!s || !s->last_resize) continue;
    if (!header++) printf("\nlast resize:\n");
    printf("  rank %u: %s\n", rows[r].rank, s->last_resize);
  }
  header = 0;
  for (size_t i = 0; i < nnodes; i++) {
    if (nodes[i].status) continue;
    if (!header++) printf("\nerrors:\n");
    printf("  node %s: %s\n", nodes[i].address, nodes[i].error);
  }
  for (size_t r = 0; r < nrows; r++) {
    if (rows[r].node) continue;
    if (!header++) printf("\nerrors:\n");
    printf("  rank %u: no node registered it\n", rows[r].rank);
  }
}

/* ---- JSON ---------------------------------------------------------------------------------- */

static void print_json_rank(const row_t *r) {
  const Zerod__V1__RankStatus *s = r->stat;
  printf("    {\"rank\": %u, \"node\": ", r->rank);
  if (r->node)
    json_string(stdout, r->node->address);
  else
    fputs("null", stdout);
  if (!s) {
    printf(", \"health\": \"%s\", \"error\": ", r->node ? "unreachable" : "missing");
    json_string(stdout, r->node ? r->node->error : "no node registered this rank");
    printf("}");
    return;
  }
  printf(", \"local_rank\": %u, \"health\": ", s->local_rank);
  json_string(stdout, s->health);
  printf(", \"degraded_reason\": ");
  if (s->degraded_reason)
    json_string(stdout, s->degraded_reason);
  else
    fputs("null", stdout);
  printf(", \"client\": ");
  if (s->client)
    json_string(stdout, s->client);
  else
    fputs("null", stdout);
  if (s->has_client_pid) printf(", \"client_pid\": %d", s->client_pid);
  printf(", \"has_model\": %s", s->has_model ? "true" : "false");
  if (s->has_params) printf(", \"params\": %u", s->params);
  if (s->has_shard_elems) printf(", \"shard_elems\": %" PRIu64, s->shard_elems);
  if (s->has_state_bytes) printf(", \"state_bytes\": %" PRIu64, s->state_bytes);
  if (s->has_grad_shard_bytes) printf(", \"grad_shard_bytes\": %" PRIu64, s->grad_shard_bytes);
  if (s->has_step) printf(", \"step\": %" PRIu64, s->step);
  if (s->has_steps_skipped) printf(", \"steps_skipped\": %" PRIu64, s->steps_skipped);
  if (s->has_loss_scale) {
    printf(", \"loss_scale\": ");
    json_double(stdout, s->loss_scale);
  }
  printf(", \"last_grad_norm\": ");
  json_double(stdout, s->has_last_grad_norm ? s->last_grad_norm : NAN);
  if (s->has_last_step_us) printf(", \"last_step_us\": %" PRIu64, s->last_step_us);
  if (s->state_file) {
    printf(", \"state_file\": ");
    json_string(stdout, s->state_file);
    printf(", \"state_committed_step\": %" PRIu64, s->state_committed_step);
  }
  if (s->last_recovery) {
    printf(", \"last_recovery\": ");
    json_string(stdout, s->last_recovery);
    printf(", \"last_recovery_step\": %" PRIu64 ", \"last_recovery_ms\": %" PRIu64,
           s->last_recovery_step, s->last_recovery_ms);
    printf(", \"last_recovery_note\": ");
    if (s->last_recovery_note)
      json_string(stdout, s->last_recovery_note);
    else
      fputs("null", stdout);
  }
  if (s->has_buddy_copy_step) {
    printf(", \"buddy_copy_step\": %" PRIu64 ", \"buddy_copy_age_ms\": %" PRIu64
           ", \"buddy_copy_holder\": ",
           s->buddy_copy_step, s->buddy_copy_age_ms);
    json_string(stdout, s->buddy_copy_holder ? s->buddy_copy_holder : "");
  }
  if (s->buddy_copy_error) {
    printf(", \"buddy_copy_error\": ");
    json_string(stdout, s->buddy_copy_error);
  }
  if (s->has_snapshot_step)
    printf(", \"snapshot_step\": %" PRIu64 ", \"snapshot_age_ms\": %" PRIu64
           ", \"snapshot_bytes\": %" PRIu64,
           s->snapshot_step, s->snapshot_age_ms, s->snapshot_bytes);
  if (s->last_resize) {
    printf(", \"last_resize\": ");
    json_string(stdout, s->last_resize);
  }
  printf(", \"shard\": [");
  for (size_t b = 0; b < s->n_shard; b++)
    printf("%s{\"bucket\": %u, \"begin\": %" PRIu64 ", \"end\": %" PRIu64 "}", b ? ", " : "",
           s->shard[b]->bucket, s->shard[b]->begin, s->shard[b]->end);
  printf("]}");
}

static void print_json(const node_t *nodes, size_t nnodes, const row_t *rows, size_t nrows,
                       uint32_t world_size) {
  printf("{\n  \"world_size\": %u,\n", world_size);
  if (nnodes == 1 && nodes[0].status && nodes[0].status->has_configured_world_size)
    printf("  \"configured_world_size\": %u,\n", nodes[0].status->configured_world_size);
  printf("  \"nodes\": [\n");
  for (size_t i = 0; i < nnodes; i++) {
    const node_t *n = &nodes[i];
    const Zerod__V1__NodeStatus *st = n->status;
    printf("    {\"address\": ");
    json_string(stdout, n->address);
    if (st) {
      printf(", \"ok\": true, \"version\": ");
      json_string(stdout, st->version);
      printf(", \"pid\": %d, \"control_address\": ", st->pid);
      json_string(stdout, st->control_address);
      printf(", \"world_size\": %u, ", st->world_size);
      if (st->has_configured_world_size) /* the setting, where a live resize changed the size */
        printf("\"configured_world_size\": %u, ", st->configured_world_size);
      printf("\"first_rank\": %u, \"local_ranks\": %u, \"backend\": ", st->first_rank,
             st->local_ranks);
      json_string(stdout, st->backend);
      printf(", \"uptime_s\": %" PRIu64 ", \"draining\": %s}", st->uptime_s,
             st->has_draining && st->draining ? "true" : "false");
    } else {
      printf(", \"ok\": false, \"error\": ");
      json_string(stdout, n->error);
      printf("}");
    }
    printf("%s\n", i + 1 < nnodes ? "," : "");
  }
  printf("  ],\n  \"ranks\": [\n");
  for (size_t r = 0; r < nrows; r++) {
    print_json_rank(&rows[r]);
    printf("%s\n", r + 1 < nrows ? "," : "");
  }
  printf("  ]\n}\n");
}

/* ---- commands ------------------------------------------------------------------------------ */

static int cmd_status(const options_t *o) {
  node_t *nodes = NULL;
  size_t nnodes = 0;
  uint32_t world_size = 0;
  row_t *rows = NULL;
  size_t nrows = 0;
  int rc = EXIT_OK;
  if (o->world) {
    Zerod__V1__NodesReply *reg = NULL;
    char *registry = NULL;
    zd__err_t err = {0};
    if (fetch_nodes(o->address, o->timeout_ms, &reg, &registry, &err) != 0) {
      fprintf(stderr, "zeroctl: cannot list the nodes of the world (Nodes at %s): %s\n",
              registry ? registry : o->address, err.msg);
      free(registry);
      return EXIT_FAIL;
    }
    free(registry);
    world_size = reg->world_size;
    nodes = calloc(reg->n_nodes ? reg->n_nodes : 1, sizeof *nodes);
    for (size_t i = 0; nodes && i < reg->n_nodes; i++) {
      nodes[i].address = strdup(reg->nodes[i]->control_address);
      nodes[i].first_rank = reg->nodes[i]->first_rank;
      nodes[i].local_ranks = reg->nodes[i]->local_ranks;
      nnodes++;
    }
    zerod__v1__nodes_reply__free_unpacked(reg, NULL);
  } else {
    nodes = calloc(1, sizeof *nodes);
    if (nodes) nodes[nnodes++].address = strdup(o->address);
  }
  if (!nodes) {
    fprintf(stderr, "zeroctl: out of memory\n");
    return EXIT_FAIL;
  }
  fetch_statuses(nodes, nnodes, o->timeout_ms);
  for (size_t i = 0; i < nnodes; i++)
    if (!nodes[i].status) rc = EXIT_FAIL;
  if (!o->world && !nodes[0].status) {
    fprintf(stderr, "zeroctl: %s\n", nodes[0].error);
    goto exit;
  }
  /* One node lists its own ranks (world_size 0: no "missing" rows for the other nodes'). */
  if (!(rows = make_rows(nodes, nnodes, world_size, &nrows))) {
    fprintf(stderr, "zeroctl: out of memory\n");
    rc = EXIT_FAIL;
    goto exit;
  }
  for (size_t r = 0; r < nrows; r++) /* a missing or degraded rank is a failure for scripts */
    if (!rows[r].node || (rows[r].stat && rows[r].stat->degraded_reason)) rc = EXIT_FAIL;
  if (o->json)
    print_json(nodes, nnodes, rows, nrows, world_size ? world_size : nodes[0].status->world_size);
  else
    print_table(nodes, nnodes, rows, nrows);
exit:
  for (size_t i = 0; i < nnodes; i++) {
    free(nodes[i].address);
    if (nodes[i].status) zerod__v1__node_status__free_unpacked(nodes[i].status, NULL);
  }
  free(nodes);
  free(rows);
  return rc;
}

static int cmd_health(const options_t *o) {
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  req.service = (char *)o->service;
  ProtobufCMessage *reply = NULL;
  zd__err_t err = {0};
  if (call(o->address, "/grpc.health.v1.Health/Check", &req.base,
           &grpc__health__v1__health_check_response__descriptor, &reply, o->timeout_ms, NULL,
           &err) != 0) {
    fprintf(stderr, "zeroctl: %s\n", err.msg);
    return EXIT_FAIL;
  }
  Grpc__Health__V1__HealthCheckResponse *rep = (Grpc__Health__V1__HealthCheckResponse *)reply;
  int serving = rep->status == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
  const char *name =
      rep->status == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING ? "SERVING"
      : rep->status == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING
          ? "NOT_SERVING"
          : "UNKNOWN";
  if (o->service[0])
    printf("%s: %s (service %s)\n", o->address, name, o->service);
  else
    printf("%s: %s\n", o->address, name);
  protobuf_c_message_free_unpacked(reply, NULL);
  return serving ? EXIT_OK : EXIT_FAIL;
}

/* ---- checkpoints, offline ------------------------------------------------------------------ */

static int cmd_verify(const options_t *o) {
  zd__ckpt_manifest_t *m = NULL;
  zd__err_t err = {0};
  if (zd__ckpt_read_manifest(o->ckpt_dir, &m, &err) != 0) {
    fprintf(stderr, "zeroctl: %s\n", err.msg);
    return EXIT_FAIL;
  }
  printf("%s: step %" PRIu64 ", world size %u, %u parameters, layout 0x%016" PRIx64 "\n",
         o->ckpt_dir, m->step, m->world_size, m->layout->nparams, m->layout_hash);
  for (uint32_t r = 0; r < m->nfiles; r++) {
    char size[32];
    human_bytes(m->files[r].bytes, size, sizeof size);
    printf("  %s  %" PRIu64 " bytes (%s)  xxh3 0x%016" PRIx64 "\n", m->files[r].name,
           m->files[r].bytes, size, m->files[r].xxh3);
  }
  int rc = zd__ckpt_verify(o->ckpt_dir, m, &err);
  zd__ckpt_manifest_free(m);
  if (rc != 0) {
    fprintf(stderr, "zeroctl: %s\n", err.msg);
    return EXIT_FAIL;
  }
  printf("ok\n");
  return EXIT_OK;
}

static int cmd_export(const options_t *o) {
  zd__err_t err = {0};
  if (zd__ckpt_export(o->ckpt_dir, o->out, o->moments, &err) != 0) {
    fprintf(stderr, "zeroctl: %s\n", err.msg);
    return EXIT_FAIL;
  }
  printf("%s: exported to %s%s\n", o->ckpt_dir, o->out, o->moments ? " (with moments)" : "");
  return EXIT_OK;
}

/* ---- import, offline ------------------------------------------------------------------------ */

/* zeroctl import FILE --out ROOT. It talks to no zerod, so it has its own arguments, all after
 * the command. */
static int cmd_import(int argc, char **argv) {
  const char *file = NULL, *root = NULL;
  for (int i = 1; i < argc; i++) {
    int missing = 0;
    const char *v = flag_value(argc, argv, &i, "--out", &missing);
    if (v) {
      if (!v[0]) return usage_error("--out is empty");
      root = v;
    } else if (missing) {
      return usage_error("--out needs a value");
    } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
      usage(stdout);
      return EXIT_OK;
    } else if (argv[i][0] == '-') {
      return usage_error("import takes --out ROOT only, not '%s'", argv[i]);
    } else if (!file) {
      file = argv[i];
    } else {
      return usage_error("unexpected argument '%s'", argv[i]);
    }
  }
  if (!file) return usage_error("import needs a file (zerod.checkpoint.save_torch_state's)");
  if (!root) return usage_error("import needs --out ROOT: where the checkpoint goes");
  char dir[PATH_MAX];
  zd__err_t err = {0};
  if (zd__ckpt_import(file, root, dir, sizeof dir, &err) != 0) {
    fprintf(stderr, "zeroctl: %s\n", err.msg);
    return EXIT_FAIL;
  }
  printf("%s: imported as %s\nresume it with: zerod --resume %s\n", file, dir, dir);
  return EXIT_OK;
}

/* gRPC's log lines are for developers; zeroctl reports the outcome of each call itself. */
static void quiet_log(gpr_log_func_args *a) {
  if (getenv("ZEROCTL_GRPC_LOG"))
    fprintf(stderr, "grpc: %s (%s:%d)\n", a->message, a->file, a->line);
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "import")) return cmd_import(argc - 1, argv + 1);
  options_t o;
  int rc = parse(argc, argv, &o);
  if (rc >= 0) return rc;
  if (!strcmp(o.command, "verify")) return cmd_verify(&o);
  if (!strcmp(o.command, "export")) return cmd_export(&o);
  zd__grpc_tls_files_t tls = {.cert = o.tls_cert,
                              .key = o.tls_key,
                              .ca = o.tls_ca,
                              .cert_name = "--tls-cert",
                              .key_name = "--tls-key",
                              .ca_name = "--tls-ca"};
  zd__err_t err = {0};
  if (zd__grpc_tls_load(&tls, &err) != ZD_OK) {
    fprintf(stderr, "zeroctl: %s\n", err.msg);
    return EXIT_FAIL;
  }
  gpr_set_log_function(quiet_log);
  /* One library reference for the whole run: each call's channel then reuses the library
   * instead of starting and tearing down gRPC's threads around every call. */
  grpc_init();
  if (!strcmp(o.command, "status") && o.watch_s) {
    /* top-style: clear the screen (on a terminal) and redraw, until interrupted; the exit
     * status is the last round's. */
    for (;;) {
      if (isatty(STDOUT_FILENO)) fputs("\033[H\033[2J", stdout);
      time_t now = time(NULL);
      char when[32];
      strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", localtime(&now));
      printf("zeroctl status, every %d s (%s); Ctrl-C to stop\n", o.watch_s, when);
      rc = cmd_status(&o);
      fflush(stdout);
      sleep((unsigned)o.watch_s);
    }
  }
  rc = !strcmp(o.command, "status")       ? cmd_status(&o)
       : !strcmp(o.command, "checkpoint") ? cmd_checkpoint(&o)
       : !strcmp(o.command, "resize")     ? cmd_resize(&o)
       : !strcmp(o.command, "drain")      ? cmd_drain(&o)
                                          : cmd_health(&o);
  grpc_shutdown();
  return rc;
}
