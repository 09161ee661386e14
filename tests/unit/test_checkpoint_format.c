/* Unit test of the checkpoint files (common/ckpt_*.c): rank files and manifest written
 * and read back at world sizes 1, 2 and 4 (values bit for bit), every manifest field round-tripped,
 * corruption (a flipped byte, a truncated file) reported with the file and both checksums, an
 * incomplete checkpoint, find_latest falling back past broken ones, resharding loads between world
 * and bucket sizes, retention, export (its safetensors header parsed back and its values checked),
 * the throttled writer, import (a torch-state file and an export back in, every element checked
 * after loads at two topologies; malformed files refused with their cause), and every array of the
 * state table (common/state.h) through all of these by its name.
 *
 * Values are a function of (parameter, element, tensor) drawn from a fixed seed, so any rank of any
 * layout knows what each of its elements must hold; where an element goes is computed here from
 * the layout rule (docs/design.md, "Layout"), not by the code under test. Padding is written as
 * garbage and must load as 0. Everything happens under a temporary directory, removed at exit.
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "check.h"
#include "checkpoint_format.h"
#include "error.h"
#include "group.h"
#include "layout.h"

static char tmp_root[64];

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  return remove(path);
}

static void cleanup(void) {
  if (tmp_root[0]) nftw(tmp_root, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* ---- the model and its values ---- */

static const zd_param_t model[] = {
    {"embed.weight", 2, {13, 11}, 0}, {"embed.bias", 1, {11}, 1},   {"scale", 0, {0}, 1},
    {"block.0.w", 2, {40, 9}, 0},     {"block.0.b", 1, {9}, 1},     {"block.1.w", 3, {4, 5, 7}, 0},
    {"empty", 2, {0, 5}, 0},          {"head.weight", 1, {300}, 0}, {"head.bias", 1, {1}, 1},
};
#define NPARAMS (sizeof model / sizeof model[0])
#define NGROUPS 2

/* The value of element i of parameter p in tensor t: random bits, every float but NaN. */
static float value(uint32_t p, uint64_t i, int t) {
  uint64_t x = 0x5eed5eedull ^ (p * 0x9e3779b97f4a7c15ull) ^ (i * 0xbf58476d1ce4e5b9ull) ^
               ((uint64_t)t << 56);
  x ^= x >> 31;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 29;
  union {
    uint32_t u;
    float f;
  } v = {.u = (uint32_t)x};
  if (v.f != v.f) v.u &= 0xff7fffffu; /* NaN has many payloads: keep comparisons simple */
  return v.f;
}

static zd__layout_t *build(uint32_t world, uint64_t bucket) {
  zd__layout_t *l;
  zd__err_t err = {0};
  int rc = zd__layout_build(model, NPARAMS, NGROUPS, world, bucket, &l, &err);
  CHECK_MSG(rc == 0, "layout: %s", err.msg);
  return l;
}

/* Rank r's arrays, every one of the state table's in its order (master, exp_avg, exp_avg_sq,
 * max_exp_avg_sq, ...), for layout l as the writer holds them: each parameter's elements where the
 * layout rule puts them, padding filled with `pad`. */
static float *shard_arrays(const zd__layout_t *l, uint32_t r, float pad) {
  uint64_t n = l->shard_elems;
  float *a = malloc(ZD__NSTATES * n * sizeof *a + 1);
  CHECK(a);
  for (uint64_t k = 0; k < ZD__NSTATES * n; k++) a[k] = pad;
  for (uint32_t p = 0; p < l->nparams; p++) {
    const zd__layout_param_t *lp = &l->params[p];
    const zd__bucket_t *b = &l->buckets[lp->bucket];
    for (uint64_t i = 0; i < lp->numel; i++) {
      uint64_t rel = lp->offset + i - b->offset;
      if (rel / b->shard_elems != r) continue;
      uint64_t pos = b->shard_base + rel % b->shard_elems;
      for (int t = 0; t < ZD__NSTATES; t++) a[t * n + pos] = value(p, i, t);
    }
  }
  return a;
}

static zd_group_t groups[NGROUPS];

/* The manifests' creation time when not 0 (tests of what "newest" means). */
static uint64_t created_ms;
/* write_ckpt writes max_exp_avg_sq too (a model with amsgrad). */
static int with_max;
/* write_ckpt writes every array of the state table. */
static int with_all;

/* Every array of the state table. */
static zd__states_t all_states(void) {
  zd__states_t set = 0;
  for (int t = 0; t < ZD__NSTATES; t++) set |= ZD__STATE_BIT(t);
  return set;
}

static void fill_manifest(zd__ckpt_manifest_t *m, const zd__layout_t *l, uint64_t step) {
  memset(m, 0, sizeof *m);
  m->version = ZD__CKPT_VERSION;
  m->step = step;
  m->steps_skipped = 3;
  m->world_size = l->world_size;
  m->bucket_elems = l->bucket_elems;
  m->layout_hash = l->hash;
  m->layout = (zd__layout_t *)l;
  groups[0] = zd__group_default();
  groups[1] = zd__group_default();
  groups[1].weight_decay = 0;
  m->groups = groups;
  m->ngroups = NGROUPS;
  m->param_dtype = ZD_BF16;
  m->grad_dtype = ZD_F16;
  m->max_grad_norm = 1.0;
  m->grad_mean = 1;
  m->scaler.enabled = 1;
  m->scaler.cfg = (zd_loss_scaler_t){.size = sizeof(zd_loss_scaler_t),
                                     .enabled = 1,
                                     .initial_scale = 65536,
                                     .growth_factor = 2,
                                     .backoff_factor = 0.5,
                                     .growth_interval = 1000,
                                     .hysteresis = 2,
                                     .min_scale = 1};
  m->scaler.scale = 32768;
  m->created_ms = created_ms ? created_ms : 1700000000123ull;
}

/* Writes a complete checkpoint of step at layout l under root; returns its directory (static). */
static const char *write_ckpt(const char *root, const zd__layout_t *l, uint64_t step,
                              zd__ckpt_manifest_t *m_out) {
  static char dir[512];
  CHECK_INT_EQ(zd__ckpt_dir_name(root, step, dir, sizeof dir), 0);
  zd__ckpt_file_t *files = calloc(l->world_size, sizeof *files);
  zd__err_t err = {0};
  for (uint32_t r = 0; r < l->world_size; r++) {
    float *a = shard_arrays(l, r, 1234.5f);
    uint64_t n = l->shard_elems;
    zd__ckpt_shard_t s = {
        r, l->world_size, step, n, {a, a + n, a + 2 * n, with_max ? a + 3 * n : NULL}};
    for (int t = 0; with_all && t < ZD__NSTATES; t++) s.state[t] = a + t * n;
    int rc = zd__ckpt_write_shard(dir, &s, 0, &files[r], &err);
    CHECK_MSG(rc == 0, "%s", err.msg);
    CHECK_U64_EQ(files[r].rank, r);
    free(a);
  }
  zd__ckpt_manifest_t m;
  fill_manifest(&m, l, step);
  m.files = files;
  m.nfiles = l->world_size;
  m.states = zd__states_legacy() | (with_max ? ZD__STATE_BIT(ZD__STATE_MAX_EXP_AVG_SQ) : 0);
  if (with_all) m.states = all_states();
  int rc = zd__ckpt_write_manifest(dir, &m, &err);
  CHECK_MSG(rc == 0, "%s", err.msg);
  if (m_out) {
    *m_out = m;
    m_out->files = NULL; /* freed here */
  }
  free(files);
  return dir;
}

static char *subroot(const char *name) {
  static char buf[256];
  snprintf(buf, sizeof buf, "%s/%s", tmp_root, name);
  CHECK_INT_EQ(mkdir(buf, 0755), 0);
  return buf;
}

static uint64_t file_xxh3(const char *path, uint64_t *bytes) {
  FILE *f = fopen(path, "rb");
  CHECK(f);
  XXH3_state_t *s = XXH3_createState();
  XXH3_64bits_reset(s);
  char buf[65536];
  size_t n;
  *bytes = 0;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
    XXH3_64bits_update(s, buf, n);
    *bytes += n;
  }
  fclose(f);
  uint64_t h = XXH3_64bits_digest(s);
  XXH3_freeState(s);
  return h;
}

/* Loads every rank of layout `to` from dir and compares with shard_arrays(to, r, 0): every element
 * bit for bit, padding 0, of every array the checkpoint has. */
static void check_load(const char *dir, const zd__layout_t *to) {
  zd__ckpt_manifest_t *m;
  zd__err_t err = {0};
  int rc = zd__ckpt_read_manifest(dir, &m, &err);
  CHECK_MSG(rc == 0, "%s", err.msg);
  rc = zd__ckpt_verify(dir, m, &err);
  CHECK_MSG(rc == 0, "%s", err.msg);
  for (uint32_t r = 0; r < to->world_size; r++) {
    uint64_t n = to->shard_elems;
    float *want = shard_arrays(to, r, 0.0f), *got = malloc(ZD__NSTATES * n * sizeof *got + 1);
    for (uint64_t k = 0; k < ZD__NSTATES * n; k++) got[k] = -7.0f; /* must be overwritten */
    float *state[ZD__NSTATES] = {0};
    for (int t = 0; t < ZD__NSTATES; t++)
      if (m->states & ZD__STATE_BIT(t)) state[t] = got + t * n;
    rc = zd__ckpt_load_shard(dir, m, to, r, state, &err);
    CHECK_MSG(rc == 0, "%s", err.msg);
    for (uint64_t k = 0; k < ZD__NSTATES * n; k++) {
      if (!(m->states & ZD__STATE_BIT(k / n))) continue;
      uint32_t a, b;
      memcpy(&a, &got[k], 4);
      memcpy(&b, &want[k], 4);
      CHECK_MSG(a == b,
                "%s: loaded at W=%u bucket %" PRIu64 " (written at W=%u bucket %" PRIu64
                "), rank %u tensor %" PRIu64 " element %" PRIu64 ": 0x%08x vs 0x%08x",
                dir, to->world_size, to->bucket_elems, m->world_size, m->bucket_elems, r, k / n,
                k % n, a, b);
    }
    free(want);
    free(got);
  }
  zd__ckpt_manifest_free(m);
}

/* ---- tests ---- */

static void test_roundtrip(void) {
  const uint32_t worlds[] = {1, 2, 4};
  for (size_t w = 0; w < 3; w++) {
    char name[32];
    snprintf(name, sizeof name, "roundtrip-%u", worlds[w]);
    const char *root = subroot(name);
    zd__layout_t *l = build(worlds[w], 200);
    const char *dir = write_ckpt(root, l, 42, NULL);
    char expect_dir[512];
    snprintf(expect_dir, sizeof expect_dir, "%s/step-000000000042", root);
    CHECK_STR_EQ(dir, expect_dir);

    zd__ckpt_manifest_t *m;
    zd__err_t err = {0};
    CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &m, &err), 0);
    CHECK_INT_EQ(m->nfiles, worlds[w]);
    for (uint32_t r = 0; r < m->nfiles; r++) {
      char want[64], path[600];
      snprintf(want, sizeof want, "rank-%05u-of-%05u.safetensors", r, worlds[w]);
      CHECK_STR_EQ(m->files[r].name, want);
      snprintf(path, sizeof path, "%s/%s", dir, want);
      uint64_t bytes, h = file_xxh3(path, &bytes);
      CHECK_U64_EQ(m->files[r].bytes, bytes);
      CHECK_U64_EQ(m->files[r].xxh3, h);
      CHECK_INT_EQ(bytes % 8, 0); /* header padded to 8, then 3 x shard_elems floats */
      CHECK(bytes > 12 * l->shard_elems);
      snprintf(path, sizeof path, "%s/%s.tmp", dir, want);
      CHECK_INT_EQ(access(path, F_OK), -1); /* no temporary left behind */
    }
    zd__ckpt_manifest_free(m);
    check_load(dir, l);
    zd__layout_free(l);
  }
}

static void test_manifest_fields(void) {
  const char *root = subroot("fields");
  zd__layout_t *l = build(3, 100);
  zd__ckpt_manifest_t w;
  const char *dir = write_ckpt(root, l, 0, &w);
  /* Rewrite the manifest with awkward values: doubles whose shortest form is long. */
  zd__ckpt_manifest_t *m;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &m, &err), 0);
  zd_group_t g[NGROUPS] = {zd__group_default(), zd__group_default()};
  g[0].lr = 0.1 / 3;
  g[0].beta1 = 0.8999999999999999;
  g[0].beta2 = 1 - 1e-16;
  g[0].eps = 4.9406564584124654e-324; /* the smallest subnormal */
  g[0].weight_decay = 1e300;
  g[0].optimizer = ZD_ADAM;
  g[0].maximize = 1;
  g[1].lr = 3e-4;
  zd__ckpt_manifest_t in = *m;
  in.step = 1ull << 53;
  in.steps_skipped = 123456789012ull;
  in.groups = g;
  in.param_dtype = ZD_F32;
  in.grad_dtype = ZD_BF16;
  in.max_grad_norm = 0.7071067811865476;
  in.grad_mean = 0;
  in.scaler = (zd__ckpt_scaler_t){.enabled = 0,
                                  .cfg = {.size = sizeof(zd_loss_scaler_t),
                                          .enabled = 1,
                                          .initial_scale = 1.0 / 7,
                                          .growth_factor = 2.000000000000001,
                                          .backoff_factor = 0.3333333333333333,
                                          .growth_interval = 4294967295u,
                                          .hysteresis = 7,
                                          .min_scale = 1e-30},
                                  .scale = 6.02214076e23,
                                  .growth_tracker = 999,
                                  .hysteresis_tracker = 4294967295u};
  in.created_ms = 1234567890123ull;
  CHECK_INT_EQ(zd__ckpt_write_manifest(dir, &in, &err), 0);
  zd__ckpt_manifest_t *out;
  int rc = zd__ckpt_read_manifest(dir, &out, &err);
  CHECK_MSG(rc == 0, "%s", err.msg);
  CHECK_INT_EQ(out->version, ZD__CKPT_VERSION);
  CHECK_U64_EQ(out->step, in.step);
  CHECK_U64_EQ(out->steps_skipped, in.steps_skipped);
  CHECK_INT_EQ(out->world_size, 3);
  CHECK_U64_EQ(out->bucket_elems, 100);
  CHECK_U64_EQ(out->layout_hash, l->hash);
  CHECK_U64_EQ(out->layout->hash, l->hash);
  char diff[256];
  CHECK_MSG(zd__layout_diff(out->layout, l, diff, sizeof diff) == 0, "%s", diff);
  for (uint32_t p = 0; p < l->nparams; p++)
    CHECK_U64_EQ(out->layout->params[p].offset, l->params[p].offset);
  CHECK_INT_EQ(out->ngroups, NGROUPS);
  for (uint32_t k = 0; k < NGROUPS; k++) {
    /* Every field of the table, bit for bit: a new hyperparameter is covered without a change. */
#define SAME(name, kind, valid, expected, dflt)                                   \
  CHECK_MSG(memcmp(&out->groups[k].name, &g[k].name, sizeof g[k].name) == 0,      \
            "group %u " #name ": %.17g vs %.17g", k, (double)out->groups[k].name, \
            (double)g[k].name);
    ZD__GROUP_FIELDS(SAME)
#undef SAME
  }
  CHECK_INT_EQ(out->param_dtype, ZD_F32);
  CHECK_INT_EQ(out->grad_dtype, ZD_BF16);
  CHECK(memcmp(&out->max_grad_norm, &in.max_grad_norm, sizeof(double)) == 0);
  CHECK_INT_EQ(out->grad_mean, 0);
  CHECK_INT_EQ(out->scaler.enabled, 0);
  CHECK_INT_EQ(out->scaler.cfg.enabled, 1);
  CHECK_DBL_EQ(out->scaler.cfg.initial_scale, in.scaler.cfg.initial_scale);
  CHECK_DBL_EQ(out->scaler.cfg.growth_factor, in.scaler.cfg.growth_factor);
  CHECK_DBL_EQ(out->scaler.cfg.backoff_factor, in.scaler.cfg.backoff_factor);
  CHECK_U64_EQ(out->scaler.cfg.growth_interval, 4294967295u);
  CHECK_U64_EQ(out->scaler.cfg.hysteresis, 7);
  CHECK_DBL_EQ(out->scaler.cfg.min_scale, 1e-30);
  CHECK_DBL_EQ(out->scaler.scale, 6.02214076e23);
  CHECK_U64_EQ(out->scaler.growth_tracker, 999);
  CHECK_U64_EQ(out->scaler.hysteresis_tracker, 4294967295u);
  CHECK_U64_EQ(out->created_ms, 1234567890123ull);
  CHECK_INT_EQ(out->nfiles, 3);
  for (uint32_t r = 0; r < 3; r++) {
    CHECK_STR_EQ(out->files[r].name, m->files[r].name);
    CHECK_U64_EQ(out->files[r].bytes, m->files[r].bytes);
    CHECK_U64_EQ(out->files[r].xxh3, m->files[r].xxh3);
  }
  zd__ckpt_manifest_free(out);

  /* The text: the hash is a string of 16 hex digits, doubles in 17 digits. */
  char path[600], hex[32];
  snprintf(path, sizeof path, "%s/manifest.json", dir);
  json_error_t jerr;
  json_t *root_j = json_load_file(path, 0, &jerr);
  CHECK_MSG(root_j, "%s", jerr.text);
  snprintf(hex, sizeof hex, "%016" PRIx64, l->hash);
  CHECK_STR_EQ(json_string_value(json_object_get(root_j, "layout_hash")), hex);
  CHECK_INT_EQ(json_integer_value(json_object_get(root_j, "format_version")), 1);

  /* A version this build does not read; a missing field; a bad file name. */
  json_object_set_new(root_j, "format_version", json_integer(2));
  CHECK_INT_EQ(json_dump_file(root_j, path, 0), 0);
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &out, &err), ZD_EVERSION);
  CHECK_CONTAINS(err.msg, "format_version 2");
  json_object_set_new(root_j, "format_version", json_integer(1));
  json_object_del(json_array_get(json_object_get(root_j, "groups"), 1), "eps");
  CHECK_INT_EQ(json_dump_file(root_j, path, 0), 0);
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &out, &err), -EBADMSG);
  CHECK_CONTAINS(err.msg, "groups[1] eps is missing");
  CHECK_CONTAINS(err.msg, "manifest.json");
  json_object_set_new(json_array_get(json_object_get(root_j, "groups"), 1), "eps", json_real(1e-8));
  json_object_set_new(json_array_get(json_object_get(root_j, "files"), 1), "name",
                      json_string("../../etc/passwd"));
  CHECK_INT_EQ(json_dump_file(root_j, path, 0), 0);
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &out, &err), -EBADMSG);
  CHECK_CONTAINS(err.msg, "expected rank 1 'rank-00001-of-00003.safetensors'");
  /* A parameter table that is not the one the hash was taken of. */
  json_object_set_new(json_array_get(json_object_get(root_j, "files"), 1), "name",
                      json_string("rank-00001-of-00003.safetensors"));
  json_object_set_new(json_array_get(json_object_get(root_j, "params"), 2), "group",
                      json_integer(0));
  CHECK_INT_EQ(json_dump_file(root_j, path, 0), 0);
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &out, &err), -EBADMSG);
  CHECK_CONTAINS(err.msg, "hashes to layout");
  json_decref(root_j);

  /* The writer refuses what it could not read back. */
  in.max_grad_norm = 1.0 / 0.0;
  CHECK_INT_EQ(zd__ckpt_write_manifest(dir, &in, &err), -EINVAL);
  CHECK_CONTAINS(err.msg, "finite");
  in.max_grad_norm = 1;
  in.ngroups = 1;
  CHECK_INT_EQ(zd__ckpt_write_manifest(dir, &in, &err), -EINVAL);
  CHECK_CONTAINS(err.msg, "parameter 1 'embed.bias' is in group 1 of 1");
  in.ngroups = NGROUPS;
  in.param_dtype = ZD_F16;
  CHECK_INT_EQ(zd__ckpt_write_manifest(dir, &in, &err), -EINVAL);
  CHECK_CONTAINS(err.msg, "f16");
  zd__ckpt_manifest_free(m);
  zd__layout_free(l);
}

static void flip_byte(const char *path, off_t at) {
  int fd = open(path, O_RDWR);
  CHECK(fd >= 0);
  unsigned char c;
  CHECK_INT_EQ(pread(fd, &c, 1, at), 1);
  c ^= 0x10;
  CHECK_INT_EQ(pwrite(fd, &c, 1, at), 1);
  close(fd);
}

static void test_corruption(void) {
  const char *root = subroot("corrupt");
  zd__layout_t *l = build(2, 200);
  const char *dir = write_ckpt(root, l, 7, NULL);
  zd__ckpt_manifest_t *m;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &m, &err), 0);
  CHECK_INT_EQ(zd__ckpt_verify(dir, m, &err), 0);
  char path[600], want[64], got[64];
  snprintf(path, sizeof path, "%s/rank-00001-of-00002.safetensors", dir);
  snprintf(want, sizeof want, "0x%016" PRIx64, m->files[1].xxh3);

  flip_byte(path, (off_t)m->files[1].bytes - 100);
  uint64_t bytes, h = file_xxh3(path, &bytes);
  snprintf(got, sizeof got, "checksum 0x%016" PRIx64, h);
  CHECK_INT_EQ(zd__ckpt_verify(dir, m, &err), -EBADMSG);
  CHECK_CONTAINS(err.msg, "rank-00001-of-00002.safetensors");
  CHECK_CONTAINS(err.msg, got);
  CHECK_CONTAINS(err.msg, want);
  flip_byte(path, (off_t)m->files[1].bytes - 100);
  CHECK_INT_EQ(zd__ckpt_verify(dir, m, &err), 0);

  CHECK_INT_EQ(truncate(path, (off_t)m->files[1].bytes - 64), 0);
  h = file_xxh3(path, &bytes);
  snprintf(got, sizeof got, "%" PRIu64 " bytes, checksum 0x%016" PRIx64, bytes, h);
  CHECK_INT_EQ(zd__ckpt_verify(dir, m, &err), -EBADMSG);
  CHECK_CONTAINS(err.msg, "rank-00001-of-00002.safetensors");
  CHECK_CONTAINS(err.msg, got);
  CHECK_CONTAINS(err.msg, want);
  snprintf(got, sizeof got, "expected %" PRIu64 " bytes", m->files[1].bytes);
  CHECK_CONTAINS(err.msg, got);

  /* A truncated file also fails a load (which does not checksum) rather than reading garbage. */
  uint64_t n = l->shard_elems;
  float *a = malloc(3 * n * sizeof *a);
  CHECK_INT_EQ(zd__ckpt_load_shard(dir, m, l, 1, (float *[ZD__NSTATES]){a, a + n, a + 2 * n}, &err),
               -EBADMSG);
  CHECK_CONTAINS(err.msg, "rank-00001-of-00002.safetensors");
  free(a);

  /* A missing rank file. */
  CHECK_INT_EQ(unlink(path), 0);
  CHECK_INT_EQ(zd__ckpt_verify(dir, m, &err), -ENOENT);
  CHECK_CONTAINS(err.msg, "rank-00001-of-00002.safetensors");
  zd__ckpt_manifest_free(m);

  /* No manifest: incomplete. */
  snprintf(path, sizeof path, "%s/manifest.json", dir);
  CHECK_INT_EQ(unlink(path), 0);
  m = (zd__ckpt_manifest_t *)1;
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &m, &err), -ENOENT);
  CHECK(m == NULL);
  CHECK_CONTAINS(err.msg, "manifest.json");
  zd__layout_free(l);
}

typedef struct rejects {
  int n;
  char dir[4][512];
  char reason[4][ZD__ERR_MSG_MAX];
} rejects_t;

static void on_reject(void *ctx, const char *dir, const char *reason) {
  rejects_t *r = ctx;
  CHECK(r->n < 4);
  snprintf(r->dir[r->n], sizeof r->dir[0], "%s", dir);
  snprintf(r->reason[r->n], sizeof r->reason[0], "%s", reason);
  r->n++;
}

static void test_find_latest(void) {
  const char *root = subroot("latest");
  char rootbuf[256];
  snprintf(rootbuf, sizeof rootbuf, "%s", root);
  zd__layout_t *l = build(2, 200);
  char d10[512], d20[512], d30[512];
  snprintf(d10, sizeof d10, "%s", write_ckpt(rootbuf, l, 10, NULL));
  snprintf(d20, sizeof d20, "%s", write_ckpt(rootbuf, l, 20, NULL));
  snprintf(d30, sizeof d30, "%s", write_ckpt(rootbuf, l, 30, NULL));
  char path[600];
  snprintf(path, sizeof path, "%s/rank-00000-of-00002.safetensors", d20);
  flip_byte(path, 200);
  snprintf(path, sizeof path, "%s/manifest.json", d30);
  CHECK_INT_EQ(unlink(path), 0);

  uint64_t *steps;
  size_t n;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__ckpt_list(rootbuf, &steps, &n, &err), 0);
  CHECK_U64_EQ(n, 3);
  CHECK_U64_EQ(steps[0], 30);
  CHECK_U64_EQ(steps[1], 20);
  CHECK_U64_EQ(steps[2], 10);
  free(steps);

  rejects_t rj = {0};
  char *dir;
  zd__ckpt_manifest_t *m;
  zd__layout_t *other_world = build(3, 64); /* same parameters, another topology: acceptable */
  int rc = zd__ckpt_find_latest(rootbuf, other_world, on_reject, &rj, &dir, &m, &err);
  CHECK_MSG(rc == 0, "%s", err.msg);
  CHECK_STR_EQ(dir, d10);
  CHECK_U64_EQ(m->step, 10);
  /* 30 has no manifest: incomplete, not a checkpoint passed over */
  CHECK_INT_EQ(rj.n, 1);
  CHECK_STR_EQ(rj.dir[0], d20);
  CHECK_CONTAINS(rj.reason[0], "rank-00000-of-00002.safetensors");
  CHECK_CONTAINS(rj.reason[0], "checksum");
  free(dir);
  zd__ckpt_manifest_free(m);

  /* A model with another parameter table matches none. */
  zd_param_t p2[NPARAMS];
  memcpy(p2, model, sizeof p2);
  p2[3].shape[0] = 41;
  zd__layout_t *other;
  CHECK_INT_EQ(zd__layout_build(p2, NPARAMS, NGROUPS, 2, 200, &other, &err), 0);
  rj.n = 0;
  CHECK_INT_EQ(zd__ckpt_find_latest(rootbuf, other, on_reject, &rj, &dir, &m, &err), -ENOENT);
  CHECK(dir == NULL && m == NULL);
  CHECK_INT_EQ(rj.n, 3); /* complete ones first (20, 10), then 30 without a manifest */
  CHECK_CONTAINS(rj.reason[2], "no manifest");
  CHECK_CONTAINS(rj.reason[1],
                 "parameter 3: 'block.0.w' [40, 9] group 0 in the checkpoint vs "
                 "'block.0.w' [41, 9] group 0");
  CHECK_CONTAINS(err.msg, "3 passed over");
  /* Nor does a load into its layout. */
  zd__ckpt_manifest_t *m10;
  CHECK_INT_EQ(zd__ckpt_read_manifest(d10, &m10, &err), 0);
  float *a = malloc(3 * other->shard_elems * sizeof *a);
  CHECK_INT_EQ(zd__ckpt_load_shard(d10, m10, other, 0, (float *[ZD__NSTATES]){a, a, a}, &err),
               ZD_ELAYOUT);
  CHECK_CONTAINS(err.msg, "'block.0.w' [41, 9]");
  free(a);
  zd__ckpt_manifest_free(m10);

  /* No checkpoint at all, and no root at all. */
  CHECK_INT_EQ(zd__ckpt_find_latest("/nonexistent/zerod-ckpt", NULL, NULL, NULL, &dir, &m, &err),
               -ENOENT);
  zd__layout_free(other);
  zd__layout_free(other_world);
  zd__layout_free(l);
}

static void test_reshard(void) {
  /* (from W, bucket) -> (to W, bucket): small buckets, so that parameters straddle slices and
   * buckets differently on each side. */
  const struct {
    uint32_t w0;
    uint64_t b0;
    uint32_t w1;
    uint64_t b1;
  } cases[] = {
      {4, 150, 2, 90}, {4, 150, 1, 1000}, {1, 1000, 4, 70}, {2, 100, 3, 130}, {3, 1, 5, 333},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    char name[32];
    snprintf(name, sizeof name, "reshard-%zu", c);
    const char *root = subroot(name);
    zd__layout_t *from = build(cases[c].w0, cases[c].b0), *to = build(cases[c].w1, cases[c].b1);
    CHECK(from->nbuckets > 1 || cases[c].b0 >= 1000);
    const char *dir = write_ckpt(root, from, 5, NULL);
    check_load(dir, to);
    zd__layout_free(from);
    zd__layout_free(to);
  }
}

/* amsgrad's max_exp_avg_sq: a fourth tensor in every rank file, flagged in the manifest,
 * resharded like the others; a model without it ignores it, a model with it refuses a checkpoint
 * that lacks it. */
static void test_max_exp_avg_sq(void) {
  zd__err_t err = {0};
  zd__layout_t *from = build(4, 150), *to = build(3, 130);
  with_max = 1;
  const char *dir = write_ckpt(subroot("ams"), from, 5, NULL);
  with_max = 0;
  zd__ckpt_manifest_t *m;
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &m, &err), 0);
  CHECK_INT_EQ(m->states, zd__states_legacy() | ZD__STATE_BIT(ZD__STATE_MAX_EXP_AVG_SQ));
  check_load(dir, to); /* all four, resharded */
  uint64_t n = to->shard_elems;
  float *a = malloc(4 * n * sizeof *a + 1);
  CHECK_MSG(
      zd__ckpt_load_shard(dir, m, to, 1, (float *[ZD__NSTATES]){a, a + n, a + 2 * n}, &err) == 0,
      "%s", err.msg);
  zd__ckpt_manifest_free(m);
  /* Rank files whose tensor count disagrees with the manifest fail verification. */
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &m, &err), 0);
  m->states = zd__states_legacy();
  CHECK_INT_EQ(zd__ckpt_verify(dir, m, &err), -EBADMSG);
  CHECK_CONTAINS(err.msg, "tensors; expected 3");
  zd__ckpt_manifest_free(m);

  const char *old = write_ckpt(subroot("no-ams"), from, 5, NULL);
  CHECK_INT_EQ(zd__ckpt_read_manifest(old, &m, &err), 0);
  CHECK_INT_EQ(m->states, zd__states_legacy());
  m->states |= ZD__STATE_BIT(ZD__STATE_MAX_EXP_AVG_SQ);
  CHECK_INT_EQ(zd__ckpt_verify(old, m, &err), -EBADMSG);
  CHECK_CONTAINS(err.msg, "max_exp_avg_sq");
  m->states = zd__states_legacy();
  CHECK_INT_EQ(zd__ckpt_load_shard(old, m, to, 0,
                                   (float *[ZD__NSTATES]){a, a + n, a + 2 * n, a + 3 * n}, &err),
               ZD_ECHECKPOINT);
  CHECK_CONTAINS(err.msg, "has no max_exp_avg_sq");
  zd__ckpt_manifest_free(m);
  free(a);
  zd__layout_free(from);
  zd__layout_free(to);
  printf("max_exp_avg_sq: written, flagged, resharded; refused where missing\n");
}

static void test_prune(void) {
  char root[256];
  snprintf(root, sizeof root, "%s", subroot("prune"));
  zd__layout_t *l = build(1, 1000);
  const uint64_t complete[] = {10, 20, 30, 40, 50, 60};
  for (size_t i = 0; i < 6; i++) write_ckpt(root, l, complete[i], NULL);
  /* Crash leftovers: 25 (older than the newest complete one) and 70 (newer: in progress). */
  char dir[512];
  zd__ckpt_dir_name(root, 25, dir, sizeof dir);
  CHECK_INT_EQ(mkdir(dir, 0755), 0);
  /* untouched since before the newest complete checkpoint was written: a leftover */
  const struct timespec past[2] = {{1600000000, 0}, {1600000000, 0}};
  CHECK_INT_EQ(utimensat(AT_FDCWD, dir, past, 0), 0);
  zd__ckpt_dir_name(root, 70, dir, sizeof dir);
  CHECK_INT_EQ(mkdir(dir, 0755), 0);
  snprintf(dir + strlen(dir), sizeof dir - strlen(dir), "/rank-00000-of-00001.safetensors.tmp");
  FILE *f = fopen(dir, "w");
  CHECK(f);
  fclose(f);
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__ckpt_prune(root, 0, &err), 0); /* keep all */
  uint64_t *steps;
  size_t n;
  CHECK_INT_EQ(zd__ckpt_list(root, &steps, &n, &err), 0);
  CHECK_U64_EQ(n, 8);
  free(steps);
  int rc = zd__ckpt_prune(root, 2, &err);
  CHECK_MSG(rc == 0, "%s", err.msg);
  CHECK_INT_EQ(zd__ckpt_list(root, &steps, &n, &err), 0);
  CHECK_U64_EQ(n, 3);
  CHECK_U64_EQ(steps[0], 70);
  CHECK_U64_EQ(steps[1], 60);
  CHECK_U64_EQ(steps[2], 50);
  free(steps);
  CHECK_INT_EQ(zd__ckpt_prune(root, 1, &err), 0);
  CHECK_INT_EQ(zd__ckpt_list(root, &steps, &n, &err), 0);
  CHECK_U64_EQ(n, 2);
  CHECK_U64_EQ(steps[0], 70);
  CHECK_U64_EQ(steps[1], 60);
  free(steps);
  zd__ckpt_dir_name(root, 60, dir, sizeof dir);
  check_load(dir, l);
  zd__layout_free(l);
}

/* A fresh run in a directory holding an older run's checkpoints at higher steps: its own are the
 * newest (written last), for the resume and for the retention. */
static void test_newest_is_written_last(void) {
  char root[256];
  snprintf(root, sizeof root, "%s", subroot("newest"));
  zd__layout_t *l = build(1, 1000);
  created_ms = 1700000000000ull; /* run A, steps 60 and 80 */
  write_ckpt(root, l, 60, NULL);
  created_ms += 10;
  write_ckpt(root, l, 80, NULL);
  created_ms += 1000; /* run B, from scratch: steps 20 and 40 */
  write_ckpt(root, l, 20, NULL);
  created_ms += 10;
  write_ckpt(root, l, 40, NULL);
  char dir[512], *found;
  zd__ckpt_manifest_t *m;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__ckpt_find_latest(root, l, NULL, NULL, &found, &m, &err), 0);
  CHECK_U64_EQ(m->step, 40);
  free(found);
  zd__ckpt_manifest_free(m);
  CHECK_INT_EQ(zd__ckpt_prune(root, 2, &err), 0); /* keeps run B's two */
  uint64_t *steps;
  size_t n;
  CHECK_INT_EQ(zd__ckpt_list(root, &steps, &n, &err), 0);
  CHECK_U64_EQ(n, 2);
  CHECK_U64_EQ(steps[0], 40);
  CHECK_U64_EQ(steps[1], 20);
  free(steps);
  /* run B's next one, in progress at step 60 again (no manifest yet): never pruned */
  zd__ckpt_dir_name(root, 60, dir, sizeof dir);
  CHECK_INT_EQ(mkdir(dir, 0755), 0);
  CHECK_INT_EQ(zd__ckpt_prune(root, 2, &err), 0);
  CHECK_INT_EQ(zd__ckpt_list(root, &steps, &n, &err), 0);
  CHECK_U64_EQ(n, 3);
  free(steps);
  created_ms = 0;
  zd__layout_free(l);
}

/* Reads an exported file's header back; *data_start is where the tensors begin. */
static json_t *read_export_header(const char *path, FILE **fp, uint64_t *data_start) {
  FILE *f = fopen(path, "rb");
  CHECK(f);
  unsigned char lenb[8];
  CHECK_INT_EQ(fread(lenb, 1, 8, f), 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; i++) n |= (uint64_t)lenb[i] << (8 * i);
  CHECK_INT_EQ(n % 8, 0);
  char *text = malloc(n);
  CHECK_U64_EQ(fread(text, 1, n, f), n);
  CHECK(text[0] == '{');
  json_error_t jerr;
  json_t *hdr = json_loadb(text, n, 0, &jerr);
  CHECK_MSG(hdr, "%s", jerr.text);
  free(text);
  *fp = f;
  *data_start = 8 + n;
  return hdr;
}

static void test_export(void) {
  const char *root = subroot("export");
  zd__layout_t *l = build(2, 120);
  const char *dir = write_ckpt(root, l, 99, NULL);
  char out[300];
  for (int moments = 0; moments <= 1; moments++) {
    snprintf(out, sizeof out, "%s/model-%d.safetensors", tmp_root, moments);
    zd__err_t err = {0};
    int rc = zd__ckpt_export(dir, out, moments, &err);
    CHECK_MSG(rc == 0, "%s", err.msg);
    FILE *f;
    uint64_t data_start;
    json_t *hdr = read_export_header(out, &f, &data_start);
    json_t *meta = json_object_get(hdr, "__metadata__");
    CHECK_STR_EQ(json_string_value(json_object_get(meta, "format")), "pt");
    CHECK_STR_EQ(json_string_value(json_object_get(meta, "step")), "99");
    CHECK_STR_EQ(json_string_value(json_object_get(meta, "world_size")), "2");
    CHECK_INT_EQ(json_object_size(hdr), 1 + (moments ? 3 : 1) * NPARAMS);
    static const char *const suffix[3] = {"", ".exp_avg", ".exp_avg_sq"};
    uint64_t total = 0;
    for (int t = 0; t < (moments ? 3 : 1); t++) {
      for (uint32_t p = 0; p < NPARAMS; p++) {
        char name[300];
        snprintf(name, sizeof name, "%s%s", model[p].name, suffix[t]);
        json_t *e = json_object_get(hdr, name), *shape = json_object_get(e, "shape");
        CHECK_MSG(e, "no tensor '%s'", name);
        CHECK_STR_EQ(json_string_value(json_object_get(e, "dtype")), "F32");
        CHECK_U64_EQ(json_array_size(shape), model[p].ndim);
        uint64_t numel = 1;
        for (uint32_t d = 0; d < model[p].ndim; d++) {
          CHECK_U64_EQ(json_integer_value(json_array_get(shape, d)), model[p].shape[d]);
          numel *= model[p].shape[d];
        }
        json_t *offs = json_object_get(e, "data_offsets");
        uint64_t begin = (uint64_t)json_integer_value(json_array_get(offs, 0));
        uint64_t end = (uint64_t)json_integer_value(json_array_get(offs, 1));
        CHECK_U64_EQ(end - begin, numel * 4);
        total += numel * 4;
        float *v = malloc(numel * 4 + 4);
        CHECK_INT_EQ(fseek(f, (long)(data_start + begin), SEEK_SET), 0);
        CHECK_U64_EQ(fread(v, 4, numel, f), numel);
        for (uint64_t i = 0; i < numel; i++) {
          float want = value(p, i, t);
          CHECK_MSG(memcmp(&v[i], &want, 4) == 0, "%s[%" PRIu64 "]: %.9g vs %.9g", name, i, v[i],
                    want);
        }
        free(v);
      }
    }
    struct stat st;
    CHECK_INT_EQ(stat(out, &st), 0);
    CHECK_U64_EQ((uint64_t)st.st_size, data_start + total); /* tensors fill the data exactly */
    fclose(f);
    json_decref(hdr);
  }
  /* A corrupt checkpoint is not exported, and nothing is left at out. */
  zd__ckpt_manifest_t *m;
  zd__err_t err = {0};
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &m, &err), 0);
  char path[600];
  snprintf(path, sizeof path, "%s/rank-00000-of-00002.safetensors", dir);
  flip_byte(path, (off_t)m->files[0].bytes - 4);
  zd__ckpt_manifest_free(m);
  snprintf(out, sizeof out, "%s/corrupt.safetensors", tmp_root);
  CHECK_INT_EQ(zd__ckpt_export(dir, out, 1, &err), -EBADMSG);
  CHECK_CONTAINS(err.msg, "checksum");
  CHECK_INT_EQ(access(out, F_OK), -1);
  zd__layout_free(l);
}

static void test_throttle(void) {
  const char *root = subroot("throttle");
  uint64_t n = 20000; /* 240 KB at 2 MB/s: about 0.1 s */
  float *a = malloc(3 * n * sizeof *a);
  for (uint64_t k = 0; k < 3 * n; k++) a[k] = value(0, k, 0);
  char dir[512];
  zd__ckpt_dir_name(root, 1, dir, sizeof dir);
  zd__ckpt_shard_t s = {0, 1, 1, n, {a, a + n, a + 2 * n}};
  zd__ckpt_file_t f;
  zd__err_t err = {0};
  int rc = zd__ckpt_write_shard(dir, &s, 2000000, &f, &err);
  CHECK_MSG(rc == 0, "%s", err.msg);
  char path[600];
  snprintf(path, sizeof path, "%s/%s", dir, f.name);
  uint64_t bytes, h = file_xxh3(path, &bytes);
  CHECK_U64_EQ(f.bytes, bytes);
  CHECK_U64_EQ(f.xxh3, h);
  /* The tensors are the arrays, byte for byte, after the header. */
  FILE *fp = fopen(path, "rb");
  CHECK(fp);
  CHECK_INT_EQ(fseek(fp, (long)(bytes - 3 * n * 4), SEEK_SET), 0);
  float *back = malloc(3 * n * sizeof *back);
  CHECK_U64_EQ(fread(back, 4, 3 * n, fp), 3 * n);
  CHECK(memcmp(back, a, 3 * n * 4) == 0);
  fclose(fp);
  free(back);
  free(a);
}

/* ---- import ---- */

#define J_DOUBLE(v) json_real(v)
#define J_ENUM(v)   json_integer(v)
#define J_BOOL(v)   json_boolean(v)

/* The groups as the manifest and the imported files write them (every field by its C name). */
static char *groups_text(const zd_group_t *gs, uint32_t n) {
  json_t *arr = json_array();
  for (uint32_t g = 0; g < n; g++) {
    json_t *o = json_object();
#define PUT(name, kind, valid, expected, dflt) json_object_set_new(o, #name, J_##kind(gs[g].name));
    ZD__GROUP_FIELDS(PUT)
#undef PUT
    json_array_append_new(arr, o);
  }
  char *text = json_dumps(arr, JSON_COMPACT | JSON_REAL_PRECISION(17));
  json_decref(arr);
  return text;
}

static void set_meta(json_t *hdr, const char *key, const char *value) {
  json_object_set_new(json_object_get(hdr, "__metadata__"), key, json_string(value));
}

/* A file as zerod.checkpoint.save_torch_state writes it, of the test model at `step`: the header,
 * and the data in *data. The tensors lie in the data in reverse parameter order, so that the
 * parameter order can only come from the "params" metadata. */
static json_t *state_file(uint64_t step, char **data, uint64_t *data_bytes) {
  static const char *const suffix[3] = {"", ".exp_avg", ".exp_avg_sq"};
  json_t *hdr = json_object(), *meta = json_object(), *names = json_array(), *pg = json_array();
  uint64_t total = 0;
  for (uint32_t p = 0; p < NPARAMS; p++) {
    uint64_t numel = 1;
    for (uint32_t d = 0; d < model[p].ndim; d++) numel *= model[p].shape[d];
    total += 3 * numel * 4;
  }
  char *buf = malloc(total + 1);
  uint64_t off = 0;
  for (int t = 0; t < 3; t++) {
    for (uint32_t q = NPARAMS; q-- > 0;) {
      const zd_param_t *mp = &model[q];
      json_t *shape = json_array(), *e = json_object();
      uint64_t numel = 1;
      for (uint32_t d = 0; d < mp->ndim; d++) {
        json_array_append_new(shape, json_integer((json_int_t)mp->shape[d]));
        numel *= mp->shape[d];
      }
      for (uint64_t i = 0; i < numel; i++) {
        float v = value(q, i, t);
        memcpy(buf + off + i * 4, &v, 4);
      }
      json_object_set_new(e, "dtype", json_string("F32"));
      json_object_set_new(e, "shape", shape);
      json_object_set_new(e, "data_offsets",
                          json_pack("[I, I]", (json_int_t)off, (json_int_t)(off + numel * 4)));
      char name[300];
      snprintf(name, sizeof name, "%s%s", mp->name, suffix[t]);
      json_object_set_new(hdr, name, e);
      off += numel * 4;
    }
  }
  for (uint32_t p = 0; p < NPARAMS; p++) {
    json_array_append_new(names, json_string(model[p].name));
    json_array_append_new(pg, json_integer(model[p].group));
  }
  char num[24], *names_text = json_dumps(names, JSON_COMPACT), *pg_text = json_dumps(pg, 0);
  zd_group_t gs[NGROUPS] = {zd__group_default(), zd__group_default()};
  gs[1].weight_decay = 0;
  gs[1].lr = 0.25;
  char *g_text = groups_text(gs, NGROUPS);
  snprintf(num, sizeof num, "%" PRIu64, step);
  json_object_set_new(meta, "format", json_string("pt"));
  json_object_set_new(meta, "zerod_format", json_string("zerod-torch-state"));
  json_object_set_new(meta, "zerod_version", json_string("1"));
  json_object_set_new(meta, "step", json_string(num));
  json_object_set_new(meta, "params", json_string(names_text));
  json_object_set_new(meta, "param_groups", json_string(pg_text));
  json_object_set_new(meta, "groups", json_string(g_text));
  json_object_set_new(hdr, "__metadata__", meta);
  free(names_text);
  free(pg_text);
  free(g_text);
  json_decref(names);
  json_decref(pg);
  *data = buf;
  *data_bytes = total;
  return hdr;
}

static void write_file(const char *path, json_t *hdr, const char *data, uint64_t data_bytes) {
  char *text = json_dumps(hdr, JSON_COMPACT);
  size_t n = strlen(text), padded = (n + 7) / 8 * 8;
  FILE *f = fopen(path, "wb");
  CHECK(f);
  unsigned char lenb[8];
  for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)((uint64_t)padded >> (8 * i));
  CHECK_INT_EQ(fwrite(lenb, 1, 8, f), 8);
  CHECK_U64_EQ(fwrite(text, 1, n, f), n);
  for (size_t i = n; i < padded; i++) fputc(' ', f);
  CHECK_U64_EQ(fwrite(data, 1, data_bytes, f), data_bytes);
  CHECK_INT_EQ(fclose(f), 0);
  free(text);
}

/* Imports path under a new root; returns its rc, the directory in dir. */
static int import_into(const char *path, const char *root_name, char *dir, size_t len,
                       zd__err_t *err) {
  char root[300];
  snprintf(root, sizeof root, "%s/%s", tmp_root, root_name);
  return zd__ckpt_import(path, root, dir, len, err);
}

static void mut_missing(json_t *h) {
  json_object_set(h, "stray", json_object_get(h, "head.bias.exp_avg_sq"));
  json_object_del(h, "head.bias.exp_avg_sq");
}
static void mut_extra(json_t *h) {
  json_object_set(h, "stray", json_object_get(h, "head.bias"));
}
static void mut_dtype(json_t *h) {
  json_object_set_new(json_object_get(h, "embed.bias"), "dtype", json_string("F16"));
}
static void mut_shape(json_t *h) {
  json_object_set_new(json_object_get(h, "block.0.w.exp_avg"), "shape", json_pack("[I, I]", 9, 40));
}
static void mut_offsets(json_t *h) {
  json_t *e = json_object_get(h, "embed.weight");
  json_object_set_new(
      e, "data_offsets",
      json_pack("[I, I]", (json_int_t)1 << 30, ((json_int_t)1 << 30) + 13 * 11 * 4));
}
static void mut_version(json_t *h) {
  set_meta(h, "zerod_version", "2");
}
static void mut_step(json_t *h) {
  set_meta(h, "step", "-1");
}
static void mut_group_field(json_t *h) { /* a hyperparameter this build does not know */
  json_t *meta = json_object_get(h, "__metadata__");
  json_t *gs = json_loads(json_string_value(json_object_get(meta, "groups")), 0, NULL);
  json_object_set_new(json_array_get(gs, 1), "no_such_field", json_true());
  char *text = json_dumps(gs, JSON_COMPACT);
  set_meta(h, "groups", text);
  free(text);
  json_decref(gs);
}
static void mut_param_group(json_t *h) {
  set_meta(h, "param_groups", "[0, 1, 1, 0, 1, 0, 0, 0, 5]");
}
static void mut_no_meta(json_t *h) {
  json_object_del(h, "__metadata__");
}
static void mut_names(json_t *h) {
  set_meta(h, "params", "[\"embed.weight\"]");
}
static void mut_format(json_t *h) {
  set_meta(h, "zerod_format", "zerod-shard");
}

static void test_import(void) {
  char path[300], dir[512], root[300];
  snprintf(path, sizeof path, "%s/state.safetensors", tmp_root);
  char *data;
  uint64_t data_bytes;
  json_t *hdr = state_file(42, &data, &data_bytes);
  write_file(path, hdr, data, data_bytes);
  json_decref(hdr);
  free(data);

  /* The root does not exist yet: import creates it. */
  zd__err_t err = {0};
  int rc = import_into(path, "import-a", dir, sizeof dir, &err);
  CHECK_MSG(rc == 0, "%s", err.msg);
  snprintf(root, sizeof root, "%s/import-a/step-000000000042", tmp_root);
  CHECK_STR_EQ(dir, root);
  zd__ckpt_manifest_t *m;
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &m, &err), 0);
  CHECK_U64_EQ(m->step, 42);
  CHECK_U64_EQ(m->steps_skipped, 0);
  CHECK_U64_EQ(m->world_size, 1);
  CHECK_U64_EQ(m->ngroups, NGROUPS);
  CHECK_DBL_EQ(m->groups[1].lr, 0.25);
  CHECK_DBL_EQ(m->groups[1].weight_decay, 0);
  CHECK_DBL_EQ(m->groups[0].weight_decay, zd__group_default().weight_decay);
  CHECK_INT_EQ(m->scaler.enabled, 0);
  for (uint32_t p = 0; p < NPARAMS; p++) {
    CHECK_STR_EQ(m->layout->params[p].name, model[p].name);
    CHECK_U64_EQ(m->layout->params[p].group, model[p].group);
  }
  zd__ckpt_manifest_free(m);
  /* Every element where the layout rule puts it, at the writer's topology and resharded. */
  zd__layout_t *l1 = build(1, 1000), *l4 = build(4, 70);
  check_load(dir, l1);
  check_load(dir, l4);

  /* A second import of the same step does not replace the checkpoint. */
  CHECK_INT_EQ(import_into(path, "import-a", dir, sizeof dir, &err), -EEXIST);
  CHECK_CONTAINS(err.msg, "step-000000000042");

  /* An export goes back in unchanged (its parameter order from its data). */
  zd__layout_t *l2 = build(2, 120);
  const char *src = write_ckpt(subroot("import-src"), l2, 99, NULL);
  zd__layout_free(l2);
  char exported[300];
  snprintf(exported, sizeof exported, "%s/exported.safetensors", tmp_root);
  CHECK_INT_EQ(zd__ckpt_export(src, exported, 1, &err), 0);
  rc = import_into(exported, "import-b", dir, sizeof dir, &err);
  CHECK_MSG(rc == 0, "%s", err.msg);
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &m, &err), 0);
  CHECK_U64_EQ(m->step, 99);
  CHECK_U64_EQ(m->steps_skipped, 3);
  zd__ckpt_manifest_free(m);
  check_load(dir, l4);
  CHECK_INT_EQ(zd__ckpt_export(src, exported, 0, &err), 0);
  CHECK_INT_EQ(import_into(exported, "import-c", dir, sizeof dir, &err), -EBADMSG);
  CHECK_CONTAINS(err.msg, "without moments");

  /* Malformed files: refused with what is wrong, and no checkpoint left that looks complete. */
  static const struct {
    void (*mutate)(json_t *);
    int rc;
    const char *msg;
  } bad[] = {
      {mut_missing, -EBADMSG, "no tensor \"head.bias.exp_avg_sq\""},
      {mut_extra, -EBADMSG, "expected 3 per parameter"},
      {mut_dtype, -EBADMSG, "\"embed.bias\" is not F32"},
      {mut_shape, -EBADMSG, "\"block.0.w.exp_avg\" is not of its parameter's shape"},
      {mut_offsets, -EBADMSG, "\"embed.weight\": data_offsets"},
      {mut_version, ZD_EVERSION, "zerod_version \"2\""},
      {mut_step, -EBADMSG, "\"step\" is \"-1\""},
      {mut_group_field, -EBADMSG, "no_such_field"},
      {mut_param_group, -EBADMSG, "\"param_groups\"[8] ('head.bias')"},
      {mut_no_meta, -EBADMSG, "no __metadata__"},
      {mut_names, -EBADMSG, "\"params\" names 1 parameters"},
      {mut_format, -EBADMSG, "zerod_format is \"zerod-shard\""},
  };
  for (size_t c = 0; c < sizeof bad / sizeof bad[0]; c++) {
    hdr = state_file(7, &data, &data_bytes);
    bad[c].mutate(hdr);
    snprintf(path, sizeof path, "%s/bad-%zu.safetensors", tmp_root, c);
    write_file(path, hdr, data, data_bytes);
    json_decref(hdr);
    free(data);
    char name[32];
    snprintf(name, sizeof name, "import-bad-%zu", c);
    err = (zd__err_t){0};
    rc = import_into(path, name, dir, sizeof dir, &err);
    CHECK_MSG(rc == bad[c].rc, "case %zu: rc %d (%s); expected %d", c, rc, err.msg, bad[c].rc);
    CHECK_CONTAINS(err.msg, bad[c].msg);
    CHECK_CONTAINS(err.msg, path);
    snprintf(root, sizeof root, "%s/%s/step-000000000007/manifest.json", tmp_root, name);
    CHECK_INT_EQ(access(root, F_OK), -1);
  }
  /* Not a safetensors file at all. */
  FILE *f = fopen(path, "wb");
  CHECK(f);
  fputs("hello", f);
  fclose(f);
  CHECK_INT_EQ(import_into(path, "import-junk", dir, sizeof dir, &err), -EBADMSG);
  CHECK_CONTAINS(err.msg, "not a safetensors file");
  zd__layout_free(l1);
  zd__layout_free(l4);
}

/* Every array of the state table, whatever it holds: each is a tensor of every rank file by its
 * name, an optional one is "<name>": true in the manifest, all reshard, an optional one the model
 * has is refused where the checkpoint lacks it, and export and import carry each as
 * "<param>.<name>". Nothing here names an array but master: a row added to the table is tested
 * by this as it is. */
static void test_every_state(void) {
  zd__err_t err = {0};
  zd__layout_t *from = build(3, 100), *to = build(2, 90), *l1 = build(1, 1000);
  with_all = 1;
  const char *written = write_ckpt(subroot("all"), from, 8, NULL);
  with_all = 0;
  char dir[512], path[600];
  snprintf(dir, sizeof dir, "%s", written);
  snprintf(path, sizeof path, "%s/manifest.json", dir);
  json_t *root = json_load_file(path, 0, NULL);
  CHECK(root);
  zd__states_t always = zd__states_legacy();
  for (int t = 0; t < ZD__NSTATES; t++) {
    json_t *flag = json_object_get(root, zd__state_name(t));
    CHECK_MSG(always & ZD__STATE_BIT(t) ? !flag : json_is_true(flag), "manifest key '%s'",
              zd__state_name(t));
  }
  json_decref(root);
  zd__ckpt_manifest_t *m;
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &m, &err), 0);
  CHECK_INT_EQ(m->states, all_states());
  zd__ckpt_manifest_free(m);
  check_load(dir, to);

  /* A model with an optional array refuses a checkpoint without it, naming it. */
  const char *plain = write_ckpt(subroot("all-plain"), from, 8, NULL);
  CHECK_INT_EQ(zd__ckpt_read_manifest(plain, &m, &err), 0);
  uint64_t n = to->shard_elems;
  float *a = malloc(ZD__NSTATES * n * sizeof *a + 1);
  for (int t = 0; t < ZD__NSTATES; t++) {
    if (always & ZD__STATE_BIT(t)) continue;
    float *state[ZD__NSTATES] = {0};
    for (int u = 0; u < ZD__NSTATES; u++)
      if (u == t || always & ZD__STATE_BIT(u)) state[u] = a + u * n;
    CHECK_INT_EQ(zd__ckpt_load_shard(plain, m, to, 0, state, &err), ZD_ECHECKPOINT);
    char want[64];
    snprintf(want, sizeof want, "has no %s", zd__state_name(t));
    CHECK_CONTAINS(err.msg, want);
  }
  free(a);
  zd__ckpt_manifest_free(m);

  /* Exported as "<param>" and "<param>.<name>", every value in place; imported back whole. */
  char out[300];
  snprintf(out, sizeof out, "%s/all.safetensors", tmp_root);
  CHECK_INT_EQ(zd__ckpt_export(dir, out, 1, &err), 0);
  FILE *f;
  uint64_t data_start;
  json_t *hdr = read_export_header(out, &f, &data_start);
  CHECK_U64_EQ(json_object_size(hdr), 1 + ZD__NSTATES * NPARAMS);
  for (int t = 0; t < ZD__NSTATES; t++) {
    for (uint32_t p = 0; p < NPARAMS; p++) {
      char name[300];
      if (t == ZD__STATE_MASTER)
        snprintf(name, sizeof name, "%s", model[p].name);
      else
        snprintf(name, sizeof name, "%s.%s", model[p].name, zd__state_name(t));
      json_t *offs = json_object_get(json_object_get(hdr, name), "data_offsets");
      CHECK_MSG(offs, "no tensor '%s'", name);
      uint64_t begin = (uint64_t)json_integer_value(json_array_get(offs, 0));
      uint64_t end = (uint64_t)json_integer_value(json_array_get(offs, 1));
      for (uint64_t i = 0; i < (end - begin) / 4; i++) {
        float v, want = value(p, i, t);
        CHECK_INT_EQ(fseek(f, (long)(data_start + begin + 4 * i), SEEK_SET), 0);
        CHECK_U64_EQ(fread(&v, 4, 1, f), 1);
        CHECK_MSG(memcmp(&v, &want, 4) == 0, "%s[%" PRIu64 "]: %.9g vs %.9g", name, i, v, want);
      }
    }
  }
  fclose(f);
  json_decref(hdr);
  CHECK_INT_EQ(import_into(out, "import-all", dir, sizeof dir, &err), 0);
  CHECK_INT_EQ(zd__ckpt_read_manifest(dir, &m, &err), 0);
  CHECK_INT_EQ(m->states, all_states());
  zd__ckpt_manifest_free(m);
  check_load(dir, l1);
  check_load(dir, to);
  zd__layout_free(from);
  zd__layout_free(to);
  zd__layout_free(l1);
  printf("every state array (%d): written, flagged, resharded, exported, imported\n", ZD__NSTATES);
}

int main(void) {
  snprintf(tmp_root, sizeof tmp_root, "/tmp/zd-ckpt-test-XXXXXX");
  CHECK(mkdtemp(tmp_root));
  atexit(cleanup);
  test_roundtrip();
  test_manifest_fields();
  test_corruption();
  test_find_latest();
  test_newest_is_written_last();
  test_reshard();
  test_max_exp_avg_sq();
  test_prune();
  test_export();
  test_throttle();
  test_import();
  test_every_state();
  printf("checkpoint_format: ok\n");
  return 0;
}
