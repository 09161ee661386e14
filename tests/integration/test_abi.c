/* libzerod's versioned structures (zerod.h, "A growing ABI"; docs/abi.md), against a real zerod.
 *
 * An old client: a program built against an older zerod.h, as this one pretends to be with its own
 * copies of the structures as they would have been. Its zd_group_t lacks amsgrad (the last field),
 * its zd_model_desc_t memory and device, its zd_step_opts_t flags and clip_norm, its
 * zd_step_result_t duration_us, its zd_info_t loss_scale; it sets the sizes to its own sizeof and
 * trains the example MLP. Its parameters must be, bit for bit and after every step, those of a
 * client with today's structures whose missing fields hold the defaults. Bytes of 0xa5 follow
 * every old structure and array: a library that read past a size, or walked the group array by
 * its own stride, would take them for amsgrad, memory, flags... and refuse or train otherwise;
 * one that wrote past a size would change them.
 *
 * Also: sizes refused with a message that names the structure (zero, not a multiple of 8, below
 * the minimum, above this library's), a step whose result cannot be written is not sent,
 * zd_group_init writes within group_size only, and the initialisers (C here, C++ in
 * abi_init_cxx.cc) name every field and set every size.
 */
#include <errno.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "check.h"
#include "harness.h"
#include "mlp.h"
#include "zerod/zerod.h"

#define STEPS  12
#define POISON 0xa5

/* ---- the structures as an older zerod.h declared them -----------------------------------------
 */

typedef struct old_group { /* zd_group_t before amsgrad */
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  zd_optimizer_t optimizer;
  int maximize;
  zd_update_t update;
  zd_sqrt_mode_t sqrt_mode;
} old_group_t;

typedef struct old_model_desc { /* before memory and device */
  size_t size;
  const zd_param_t *params;
  size_t nparams;
  size_t param_size;
  const old_group_t *groups;
  size_t ngroups;
  size_t group_size;
  zd_dtype_t param_dtype;
  zd_dtype_t grad_dtype;
  double max_grad_norm;
  zd_grad_reduce_t grad_reduce;
  unsigned flags;
  const zd_loss_scaler_t *loss_scaler;
} old_model_desc_t;

typedef struct old_step_opts { /* before flags and clip_norm */
  size_t size;
  const old_group_t *groups;
  size_t ngroups;
  size_t group_size;
} old_step_opts_t;

typedef struct old_step_result { /* before duration_us */
  size_t size;
  uint64_t step;
  int applied;
  double grad_norm;
  double loss_scale;
  double clip_coef;
} old_step_result_t;

typedef struct old_info { /* before loss_scale */
  size_t size;
  uint32_t protocol_version;
  uint32_t world_size;
  uint32_t rank;
  uint32_t local_rank;
  uint64_t bucket_elems;
  char backend[16];
  char daemon_version[32];
  uint64_t step;
  int resumed;
  uint64_t layout_hash;
  uint64_t total_elems;
  uint32_t nbuckets;
} old_info_t;

/* Each is today's structure cut before its missing fields: the sizes a client of that header
 * would pass. */
_Static_assert(sizeof(old_group_t) == offsetof(zd_group_t, amsgrad), "old zd_group_t");
_Static_assert(sizeof(old_model_desc_t) == offsetof(zd_model_desc_t, memory), "old desc");
_Static_assert(sizeof(old_step_opts_t) == offsetof(zd_step_opts_t, flags), "old opts");
_Static_assert(sizeof(old_step_result_t) == offsetof(zd_step_result_t, duration_us), "old result");
_Static_assert(sizeof(old_info_t) == offsetof(zd_info_t, loss_scale), "old info");

/* An old structure followed by poison. */
#define POISONED(type, n)     \
  struct {                    \
    type v[n];                \
    unsigned char poison[64]; \
  }

static void check_poison(const unsigned char *p, size_t n, const char *what) {
  for (size_t i = 0; i < n; i++)
    CHECK_MSG(p[i] == POISON, "libzerod wrote past the size of %s: byte %zu is 0x%02x", what, i,
              p[i]);
}

/* The hyperparameters of both runs: every field away from its default but amsgrad, which the old
 * client does not have. Group 0 AdamW with a decaying lr, group 1 Adam, maximizing, torch 2's
 * first moment. */
static void hyper(int step, zd_group_t g[2]) {
  zd_group_init(g, 2, sizeof g[0]);
  g[0].lr = 3e-3 / (1.0 + 0.1 * step);
  g[0].beta1 = 0.85;
  g[0].weight_decay = 0.02;
  g[1].lr = 1e-3;
  g[1].beta2 = 0.99;
  g[1].eps = 1e-6;
  g[1].weight_decay = 0.1;
  g[1].optimizer = ZD_ADAM;
  g[1].maximize = 1;
  g[1].update = ZD_UPDATE_TORCH2;
  g[1].sqrt_mode = ZD_SQRT_EXACT;
}

static void to_old(const zd_group_t g[2], old_group_t out[2]) {
  for (int i = 0; i < 2; i++) {
    CHECK_INT_EQ(g[i].amsgrad, 0); /* the default: what the old client gets */
    out[i] = (old_group_t){.lr = g[i].lr,
                           .beta1 = g[i].beta1,
                           .beta2 = g[i].beta2,
                           .eps = g[i].eps,
                           .weight_decay = g[i].weight_decay,
                           .optimizer = g[i].optimizer,
                           .maximize = g[i].maximize,
                           .update = g[i].update,
                           .sqrt_mode = g[i].sqrt_mode};
  }
}

static zd_client_t *connect_to(const zdt_daemon_t *d) {
  zd_client_t *c;
  /* Nowhere to put the client: refused, not a crash. */
  CHECK_INT_EQ(zd_connect(d->socket, ZD_ANY_RANK, 0, NULL), -EINVAL);
  CHECK_MSG(zd_connect(d->socket, ZD_ANY_RANK, 0, &c) == ZD_OK, "connect: %s", zd_last_error());
  return c;
}

/* The initial values (seed 7) at each parameter's offset; zd_param_info() with an older, shorter
 * zd_param_info_t (without bucket and group) when `old`. */
static void write_init(zd_client_t *c, int old) {
  float init[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
  float *p[MLP_NPARAMS] = {init[0], init[1], init[2], init[3]};
  mlp_init(p, 7);
  float *buf = zd_param_buffer(c, NULL);
  for (int i = 0; i < MLP_NPARAMS; i++) {
    zd_param_info_t info = ZD_PARAM_INFO_INIT;
    if (old) {
      union {
        zd_param_info_t info;
        unsigned char bytes[sizeof(zd_param_info_t) + 16];
      } u;
      memset(&u, POISON, sizeof u);
      u.info.size = offsetof(zd_param_info_t, bucket);
      CHECK_INT_EQ(zd_param_info(c, (size_t)i, &u.info), ZD_OK);
      check_poison(u.bytes + offsetof(zd_param_info_t, bucket),
                   sizeof u.bytes - offsetof(zd_param_info_t, bucket), "zd_param_info_t");
      CHECK_INT_EQ(zd_param_info(c, (size_t)i, &info), ZD_OK);
      CHECK(u.info.name == info.name && u.info.offset == info.offset && u.info.numel == info.numel);
    } else {
      CHECK_INT_EQ(zd_param_info(c, (size_t)i, &info), ZD_OK);
    }
    memcpy(buf + info.offset, init[i], info.numel * sizeof(float));
  }
}

static void backward(zd_client_t *c, int step) {
  float work[MLP_NPARAMS][MLP_HIDDEN * MLP_IN], grad[MLP_NPARAMS][MLP_HIDDEN * MLP_IN];
  float *p[MLP_NPARAMS], *g[MLP_NPARAMS];
  const float *pb = zd_param_buffer(c, NULL);
  float *gb = zd_grad_buffer(c, NULL);
  zd_param_info_t info[MLP_NPARAMS];
  for (int i = 0; i < MLP_NPARAMS; i++) {
    info[i] = (zd_param_info_t)ZD_PARAM_INFO_INIT;
    CHECK_INT_EQ(zd_param_info(c, (size_t)i, &info[i]), ZD_OK);
    memcpy(work[i], pb + info[i].offset, info[i].numel * sizeof(float));
    p[i] = work[i];
    g[i] = grad[i];
  }
  mlp_loss_grad((const float *const *)p, g, (uint64_t)step, 0);
  for (int i = 0; i < MLP_NPARAMS; i++)
    memcpy(gb + info[i].offset, grad[i], info[i].numel * sizeof(float));
}

/* Today's client: registers afresh, steps STEPS times and keeps the param buffer after each step
 * in params[step] and the results in res[step]. */
static void run_current(const zdt_daemon_t *d, float **params, zd_step_result_t *res,
                        size_t *bytes) {
  zd_client_t *c = connect_to(d);
  zd_group_t g[2];
  hyper(0, g);
  zd_model_desc_t desc = zdt_mlp_desc(g, 2);
  desc.flags = ZD_REGISTER_REPLACE;
  CHECK_MSG(zd_layout(c, &desc) == ZD_OK, "layout: %s", zd_last_error());
  write_init(c, 0);
  CHECK_MSG(zd_register(c) == ZD_OK, "register: %s", zd_last_error());
  const void *pb = zd_param_buffer(c, bytes);
  for (int s = 0; s < STEPS; s++) {
    backward(c, s);
    hyper(s, g);
    zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
    opts.groups = g;
    opts.ngroups = 2;
    res[s] = (zd_step_result_t)ZD_STEP_RESULT_INIT;
    CHECK_MSG(zd_step(c, &opts, &res[s]) == ZD_OK, "step %d: %s", s, zd_last_error());
    params[s] = malloc(*bytes);
    CHECK(params[s]);
    memcpy(params[s], pb, *bytes);
  }
  zd_close(c);
}

/* The old client, on a fresh registration: the same parameters after every step. */
static void run_old(const zdt_daemon_t *d, float *const *params, const zd_step_result_t *res,
                    size_t bytes) {
  zd_client_t *c = connect_to(d);
  zd_group_t g[2];
  hyper(0, g);
  POISONED(old_group_t, 2) groups;
  memset(&groups, POISON, sizeof groups);
  to_old(g, groups.v);
  POISONED(old_model_desc_t, 1) desc;
  memset(&desc, POISON, sizeof desc);
  desc.v[0] = (old_model_desc_t){.size = sizeof(old_model_desc_t),
                                 .params = mlp_params,
                                 .nparams = MLP_NPARAMS,
                                 .param_size = sizeof(zd_param_t),
                                 .groups = groups.v,
                                 .ngroups = 2,
                                 .group_size = sizeof(old_group_t),
                                 .param_dtype = ZD_F32,
                                 .grad_dtype = ZD_F32,
                                 .flags = ZD_REGISTER_REPLACE};
  CHECK_MSG(zd_layout(c, (const zd_model_desc_t *)&desc.v[0]) == ZD_OK, "old layout: %s",
            zd_last_error());
  write_init(c, 1);
  CHECK_MSG(zd_register(c) == ZD_OK, "old register: %s", zd_last_error());

  POISONED(old_info_t, 1) info;
  memset(&info, POISON, sizeof info);
  info.v[0].size = sizeof(old_info_t);
  CHECK_INT_EQ(zd_get_info(c, (zd_info_t *)&info.v[0]), ZD_OK);
  check_poison(info.poison, sizeof info.poison, "zd_info_t");
  zd_info_t now = ZD_INFO_INIT;
  CHECK_INT_EQ(zd_get_info(c, &now), ZD_OK);
  CHECK_U64_EQ(info.v[0].size, sizeof(old_info_t)); /* the caller's size stays */
  CHECK_U64_EQ(info.v[0].layout_hash, now.layout_hash);
  CHECK_U64_EQ(info.v[0].nbuckets, now.nbuckets);
  CHECK_STR_EQ(info.v[0].backend, now.backend);
  CHECK_MSG(now.nbuckets >= 2, "bucket_elems 256 should give several buckets, got %u",
            now.nbuckets);

  size_t got_bytes;
  const void *pb = zd_param_buffer(c, &got_bytes);
  CHECK_U64_EQ(got_bytes, bytes);
  for (int s = 0; s < STEPS; s++) {
    backward(c, s);
    hyper(s, g);
    to_old(g, groups.v);
    POISONED(old_step_opts_t, 1) opts;
    memset(&opts, POISON, sizeof opts);
    opts.v[0] = (old_step_opts_t){.size = sizeof(old_step_opts_t),
                                  .groups = groups.v,
                                  .ngroups = 2,
                                  .group_size = sizeof(old_group_t)};
    POISONED(old_step_result_t, 1) r;
    memset(&r, POISON, sizeof r);
    r.v[0].size = sizeof(old_step_result_t);
    CHECK_MSG(zd_step(c, (const zd_step_opts_t *)&opts.v[0], (zd_step_result_t *)&r.v[0]) == ZD_OK,
              "old step %d: %s", s, zd_last_error());
    check_poison(r.poison, sizeof r.poison, "zd_step_result_t");
    CHECK_U64_EQ(r.v[0].step, res[s].step);
    CHECK_INT_EQ(r.v[0].applied, res[s].applied);
    CHECK_DBL_EQ(r.v[0].loss_scale, res[s].loss_scale);
    CHECK_DBL_EQ(r.v[0].clip_coef, res[s].clip_coef);
    const uint32_t *a = pb, *b = (const uint32_t *)params[s];
    for (size_t k = 0; k < bytes / 4; k++)
      CHECK_MSG(a[k] == b[k],
                "step %d: element %zu is 0x%08x for the old client, 0x%08x for today's", s + 1, k,
                a[k], b[k]);
  }
  check_poison(groups.poison, sizeof groups.poison, "the group array");
  zd_close(c);
}

/* ---- refusals ----------------------------------------------------------------------------------
 */

static void expect_einval(int rc, const char *substr) {
  CHECK_INT_EQ(rc, -EINVAL);
  CHECK_MSG(strstr(zd_last_error(), substr), "message \"%s\" lacks \"%s\"", zd_last_error(),
            substr);
}

static void refusals(const zdt_daemon_t *d) {
  zd_client_t *c = connect_to(d);
  zd_group_t g[2];
  hyper(0, g);
  zd_model_desc_t desc = zdt_mlp_desc(g, 2);
  desc.flags = ZD_REGISTER_REPLACE;
  desc.size = 0; /* a desc zero-initialised instead of ZD_MODEL_DESC_INIT */
  expect_einval(zd_layout(c, &desc), "zd_model_desc_t.size is 0; this libzerod");
  CHECK(strstr(zd_last_error(), "ZD_MODEL_DESC_INIT"));
  desc.size = sizeof desc + 8; /* a newer header's */
  expect_einval(zd_layout(c, &desc), "built against a newer zerod.h");
  desc.size = offsetof(zd_model_desc_t, grad_dtype); /* without a required field */
  expect_einval(zd_layout(c, &desc), "zd_model_desc_t.size is 60");
  desc.size = offsetof(zd_model_desc_t, memory) + 4; /* not a whole structure */
  expect_einval(zd_layout(c, &desc), "in steps of 8");
  desc.size = sizeof desc;
  desc.group_size = offsetof(zd_group_t, weight_decay);
  expect_einval(zd_layout(c, &desc), "zd_model_desc_t.group_size is 32");
  desc.group_size = sizeof(zd_group_t);
  desc.param_size = offsetof(zd_param_t, group);
  expect_einval(zd_layout(c, &desc), "zd_model_desc_t.param_size is 80");
  desc.param_size = sizeof(zd_param_t);
  zd_loss_scaler_t scaler = ZD_LOSS_SCALER_INIT;
  scaler.size = 0;
  desc.loss_scaler = &scaler;
  expect_einval(zd_layout(c, &desc), "zd_loss_scaler_t.size is 0");
  desc.loss_scaler = NULL;
  CHECK_MSG(zd_layout(c, &desc) == ZD_OK, "layout: %s", zd_last_error());
  CHECK_INT_EQ(zd_register(c), ZD_OK);

  zd_info_t info = ZD_INFO_INIT;
  info.size = 0;
  expect_einval(zd_get_info(c, &info), "zd_info_t.size is 0");
  zd_param_info_t pinfo = ZD_PARAM_INFO_INIT;
  pinfo.size = 12;
  expect_einval(zd_param_info(c, 0, &pinfo), "zd_param_info_t.size is 12");
  zd_bucket_info_t binfo = ZD_BUCKET_INFO_INIT;
  binfo.size = sizeof binfo + 8;
  expect_einval(zd_bucket_info(c, 0, &binfo), "zd_bucket_info_t.size is 48");

  zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
  opts.groups = g;
  opts.ngroups = 2;
  opts.size = 24; /* without group_size */
  expect_einval(zd_step(c, &opts, NULL), "zd_step_opts_t.size is 24");
  opts.size = sizeof opts;
  opts.group_size = 0;
  expect_einval(zd_step(c, &opts, NULL), "zd_step_opts_t.group_size is 0");
  opts.group_size = sizeof(zd_group_t);
  opts.ngroups = 1;
  CHECK_INT_EQ(zd_step(c, &opts, NULL), ZD_EGROUP);
  CHECK_STR_EQ(zd_last_error(), "step carries 1 groups; the model has 2");
  zd_step_result_t res = ZD_STEP_RESULT_INIT;
  res.size = 0;
  expect_einval(zd_step(c, NULL, &res), "zd_step_result_t.size is 0");
  zd_request_t req;
  CHECK_INT_EQ(zd_step_start(c, NULL, &req), ZD_OK);
  expect_einval(zd_wait(c, req, &res), "zd_step_result_t.size is 0");
  res.size = sizeof res; /* the request is still outstanding: waited for once, now */
  CHECK_MSG(zd_wait(c, req, &res) == ZD_OK, "wait: %s", zd_last_error());
  CHECK_U64_EQ(res.step, 1); /* the refused zd_step() sent nothing */
  CHECK_INT_EQ(zd_get_info(c, (info = (zd_info_t)ZD_INFO_INIT, &info)), ZD_OK);
  CHECK_U64_EQ(info.step, 1);
  zd_close(c);
  printf("refusals: zero, odd, short and too large sizes, each named in its message\n");
}

/* zd_group_init writes the defaults, within group_size only. */
static void group_init(void) {
  union {
    old_group_t g[2];
    unsigned char bytes[2 * sizeof(old_group_t) + 16];
  } u;
  memset(&u, POISON, sizeof u);
  CHECK_INT_EQ(zd_group_init((zd_group_t *)u.g, 2, sizeof(old_group_t)), ZD_OK);
  check_poison(u.bytes + sizeof u.g, 16, "groups of zd_group_init");
  zd_group_t full[2];
  memset(full, 0, sizeof full);
  CHECK_INT_EQ(zd_group_init(full, 2, sizeof full[0]), ZD_OK);
  CHECK(memcmp(&u.g[1], &full[1], sizeof(old_group_t)) == 0);
  CHECK_DBL_EQ(full[1].lr, 1e-3);
  CHECK_DBL_EQ(full[1].weight_decay, 1e-2);
  CHECK_INT_EQ(full[1].amsgrad, 0);
  expect_einval(zd_group_init(full, 2, offsetof(zd_group_t, weight_decay)),
                "group_size is 32; this libzerod");
  expect_einval(zd_group_init(full, 2, sizeof full[0] + 8), "newer zerod.h");
  expect_einval(zd_group_init(NULL, 1, sizeof full[0]), "groups is NULL");
  printf("zd_group_init: the defaults, within group_size\n");
}

/* abi_init_cxx.cc: the initialisers' sizes as C++ sees them. */
size_t zdt_cxx_init_sizes(size_t *out, size_t n);

static void initialisers(void) {
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
  zd_loss_scaler_t scaler = ZD_LOSS_SCALER_INIT;
  zd_info_t info = ZD_INFO_INIT;
  zd_param_info_t pinfo = ZD_PARAM_INFO_INIT;
  zd_bucket_info_t binfo = ZD_BUCKET_INFO_INIT;
  zd_step_result_t res = ZD_STEP_RESULT_INIT;
  size_t c[] = {desc.size,   desc.param_size, desc.group_size, opts.size,  opts.group_size,
                scaler.size, info.size,       pinfo.size,      binfo.size, res.size};
  size_t want[] = {sizeof desc,        sizeof(zd_param_t), sizeof(zd_group_t), sizeof opts,
                   sizeof(zd_group_t), sizeof scaler,      sizeof info,        sizeof pinfo,
                   sizeof binfo,       sizeof res};
  size_t cxx[sizeof want / sizeof want[0]];
  CHECK_U64_EQ(zdt_cxx_init_sizes(cxx, sizeof cxx / sizeof cxx[0]), sizeof cxx / sizeof cxx[0]);
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    CHECK_U64_EQ(c[i], want[i]);
    CHECK_U64_EQ(cxx[i], want[i]);
  }
  CHECK_DBL_EQ(scaler.initial_scale, 65536);
  CHECK_INT_EQ(scaler.enabled, 1);
  CHECK_INT_EQ(opts.clip_norm, ZD_CLIP_NORM_DOUBLE);
  printf("initialisers: every size set, in C and C++\n");
}

int main(void) {
  initialisers();
  group_init();
  zdt_daemon_t d;
  const char *args[] = {"--bucket_elems", "256", NULL};
  zdt_start(&d, args);
  static float *params[STEPS];
  zd_step_result_t res[STEPS];
  size_t bytes;
  run_current(&d, params, res, &bytes);
  run_old(&d, params, res, bytes);
  printf("old client: %d steps bitwise equal to today's client with the defaults (%zu bytes)\n",
         STEPS, bytes);
  refusals(&d);
  for (int s = 0; s < STEPS; s++) free(params[s]);
  zdt_stop(&d, SIGTERM, 0); /* fails the test unless zerod exits 0 */
  return 0;
}
