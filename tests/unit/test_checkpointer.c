/* The checkpointer's waits and its staging memory (daemon/step/checkpoint.c), against a fake
 * compute backend whose snapshot copies complete only when the test says so (the fence), as the
 * CUDA backend's asynchronous copies to pinned memory do:
 *   - a snapshot is written once its fence is done, and a resume reads it back bit for bit;
 *   - a fence that never completes fails that checkpoint within the timeout, and its staging is
 *     never freed nor reused (a DMA into freed memory): the next snapshot gets new staging;
 *   - a rank whose previous file is still being written (a slow disk: the write throttle) gets
 *     -ETIMEDOUT naming it within the timeout, instead of waiting for ever;
 *   - a resume whose copy to the state does not finish fails within the timeout, poisoning the
 *     staging it read from.
 * World size 1, global rank 0 (the finisher writes the manifests here).
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "checkpoint.h"
#include "clock.h"
#include "compute.h"
#include "model.h"

#define TIMEOUT_MS 400

/* ---- the fake backend ------------------------------------------------------------------------ */

typedef struct fence {
  atomic_int done;
} fence_t;

static atomic_int fences_complete = 1; /* new fences are done at once */
static fence_t *_Atomic last_fence;    /* the last snapshot's (until the writer frees it) */
static int restore_times_out;
static void *allocated[16];
static int nallocated;
static void *freed[16];
static int nfreed;

static int f_alloc(zd__compute_t *c, uint64_t n, float **out, zd__err_t *err) {
  (void)c, (void)err;
  *out = calloc(n, sizeof(float));
  return *out ? ZD_OK : -ENOMEM;
}
static void f_release(zd__compute_t *c, float *p, uint64_t n) {
  (void)c, (void)n;
  free(p);
}
static int f_shard_init(zd__compute_t *c, zd__shard_t *s, uint32_t w, zd__err_t *err) {
  (void)c, (void)s, (void)w, (void)err;
  return ZD_OK;
}
static void f_shard_fini(zd__compute_t *c, zd__shard_t *s) {
  (void)c, (void)s;
}
static int f_host_alloc(zd__compute_t *c, size_t bytes, void **out, zd__err_t *err) {
  (void)c, (void)err;
  *out = malloc(bytes);
  CHECK(*out && nallocated < 16);
  allocated[nallocated++] = *out;
  for (int i = 0; i < nfreed; i++) /* malloc may hand back a freed address: not freed any more */
    if (freed[i] == *out) freed[i] = NULL;
  return ZD_OK;
}
static void f_host_free(void *p) {
  CHECK(nfreed < 16);
  freed[nfreed++] = p;
  free(p);
}
static int f_snapshot(zd__compute_t *c, float *const *arrays, uint32_t count, uint64_t n,
                      float *host, void **fence, zd__err_t *err) {
  (void)c, (void)err;
  for (uint32_t i = 0; i < count; i++) memcpy(host + i * n, arrays[i], n * sizeof(float));
  fence_t *f = calloc(1, sizeof *f);
  CHECK(f);
  atomic_store(&f->done, atomic_load(&fences_complete));
  atomic_store(&last_fence, f);
  *fence = f;
  return ZD_OK;
}
static int f_fence_wait(void *fence, int timeout_ms, zd__err_t *err) {
  fence_t *f = fence;
  uint64_t deadline = zd__now_ms() + (uint64_t)timeout_ms;
  while (!atomic_load(&f->done)) {
    if (zd__now_ms() >= deadline) return zd__errf(err, -ETIMEDOUT, "fake fence not done");
    usleep(1000);
  }
  return ZD_OK;
}
static void f_fence_free(void *fence) {
  fence_t *expected = fence;
  atomic_compare_exchange_strong(&last_fence, &expected, NULL);
  free(fence);
}
static int f_restore(zd__compute_t *c, float *const *arrays, uint32_t count, uint64_t n,
                     const float *host, int timeout_ms, zd__err_t *err) {
  (void)c;
  if (restore_times_out) {
    usleep((useconds_t)timeout_ms * 1000);
    return zd__errf(err, -ETIMEDOUT, "the fake copy to the state not complete within %d ms",
                    timeout_ms);
  }
  for (uint32_t i = 0; i < count; i++) memcpy(arrays[i], host + i * n, n * sizeof(float));
  return ZD_OK;
}

static const zd__compute_ops_t fake_ops = {
    .alloc = f_alloc,
    .release = f_release,
    .shard_init = f_shard_init,
    .shard_fini = f_shard_fini,
    .host_alloc = f_host_alloc,
    .host_free = f_host_free,
    .snapshot = f_snapshot,
    .fence_wait = f_fence_wait,
    .fence_free = f_fence_free,
    .restore = f_restore,
};
static zd__compute_t fake = {.ops = &fake_ops, .name = "fake"};

/* ---- a model ----------------------------------------------------------------------------------
 */

static zd__model_t *new_model(const zd__step_ctx_t *ctx, uint64_t seed) {
  zd_param_t params[2] = {{.name = "w", .ndim = 2, .shape = {64, 100}, .group = 0},
                          {.name = "b", .ndim = 1, .shape = {100}, .group = 0}};
  zd__model_spec_t spec = {.ngroups = 1, .param_dtype = ZD_F32, .grad_dtype = ZD_F32};
  zd__err_t err = {0};
  CHECK_MSG(zd__layout_build(params, 2, 1, 1, 1024, &spec.layout, &err) == ZD_OK, "%s", err.msg);
  spec.groups = calloc(1, sizeof *spec.groups);
  CHECK(spec.groups);
  spec.groups[0] = (zd_group_t){.lr = 1e-3,
                                .beta1 = 0.9,
                                .beta2 = 0.999,
                                .eps = 1e-8,
                                .weight_decay = 0.01,
                                .optimizer = ZD_ADAMW};
  zd__model_t *m = NULL;
  CHECK_MSG(zd__model_create(ctx, &spec, &m, &err) == ZD_OK, "%s", err.msg);
  zd__model_configure(m, &spec, 0);
  /* seed 0: zeros, as a model about to be resumed; else a pattern over the elements the
   * checkpoint holds (the parameters' segments, not the padding) */
  for (uint32_t b = 0; seed && b < m->layout->nbuckets; b++)
    for (uint32_t g = 0; g < m->shard.nsegs[b]; g++) {
      const zd__segment_t *sg = &m->shard.segs[b][g];
      for (int s = 0; s < ZD__NSTATES; s++)
        for (uint64_t i = sg->offset; m->shard.state[s] && i < sg->offset + sg->length; i++)
          m->shard.state[s][m->layout->buckets[b].shard_base + i] =
              (float)(seed * 1000003u + (uint64_t)s * 7919u + i) * 0.25f;
    }
  return m;
}

static void same_state(const zd__model_t *a, const zd__model_t *b) {
  CHECK_U64_EQ(a->layout->shard_elems, b->layout->shard_elems);
  for (int s = 0; s < ZD__NSTATES; s++) {
    CHECK_INT_EQ(!a->shard.state[s], !b->shard.state[s]);
    if (a->shard.state[s])
      CHECK_MSG(
          memcmp(a->shard.state[s], b->shard.state[s], a->layout->shard_elems * sizeof(float)) == 0,
          "state array %d differs after the resume", s);
  }
}

static int was_freed(const void *p) {
  for (int i = 0; i < nfreed; i++)
    if (freed[i] == p) return 1;
  return 0;
}

/* ---- the runs ---------------------------------------------------------------------------------
 */

/* Opens the next snapshot's fence 100 ms after it exists. */
static void *open_fence_later(void *arg) {
  (void)arg;
  fence_t *f;
  while (!(f = atomic_load(&last_fence))) usleep(1000);
  usleep(100 * 1000);
  atomic_store(&f->done, 1);
  return NULL;
}

static void stats(zd__ckptr_t *c, zd__ckpt_stats_t *st) {
  zd__ckptr_stats(c, st);
}

/* Waits for the writer to be done with every queued snapshot (at most 5 s). */
static void writes_done(zd__ckptr_t *c) {
  zd__ckpt_stats_t st;
  for (int i = 0; i < 500; i++) {
    stats(c, &st);
    if (!st.in_progress) return;
    usleep(10 * 1000);
  }
  CHECK_MSG(0, "%llu checkpoint writes still in progress after 5 s",
            (unsigned long long)st.in_progress);
}

static zd__model_t *resume(zd__step_ctx_t *ctx, int *loaded, int *rc) {
  zd__model_t *r = new_model(ctx, 0);
  zd__err_t err = {0};
  *rc = zd__ckptr_resume(ctx->ckpt, ctx, r, 0, loaded, &err);
  if (*rc) printf("  resume: %s\n", err.msg);
  return r;
}

int main(void) {
  char dir[] = "/tmp/zd-ckptr-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  zd__ckpt_settings_t set = {.dir = dir, .resume = "latest", .timeout_ms = TIMEOUT_MS};
  zd__ckptr_t *c = NULL;
  zd__err_t err = {0};
  CHECK_MSG(zd__ckptr_create(&set, NULL, 1, &c, &err) == ZD_OK, "%s", err.msg);
  zd__step_ctx_t ctx = {.rank = 0, .local_rank = 0, .world_size = 1, .compute = &fake, .ckpt = c};
  zd__model_t *m = new_model(&ctx, 1);
  zd__ckpt_stats_t st;

  /* 1. The write waits for the copy (its fence opens 100 ms after the snapshot); take's wait
   * returns once the checkpoint is complete, and a resume reads the state back. */
  printf("a snapshot written once its copy is done, and resumed\n");
  m->step = 7;
  atomic_store(&fences_complete, 0);
  pthread_t th;
  CHECK(pthread_create(&th, NULL, open_fence_later, NULL) == 0);
  char cdir[512];
  uint64_t t0 = zd__now_ms();
  int rc = zd__ckptr_take(c, &ctx, m, 1, cdir, sizeof cdir, &err);
  CHECK_MSG(rc == ZD_OK, "take: %s", err.msg);
  CHECK(pthread_join(th, NULL) == 0);
  CHECK_MSG(zd__now_ms() - t0 >= 100, "the write did not wait for the copy");
  stats(c, &st);
  CHECK_U64_EQ(st.completed, 1);
  CHECK_U64_EQ(st.failures, 0);
  CHECK_INT_EQ(nallocated, 1);
  void *first = allocated[0];
  int loaded = 0;
  zd__model_t *r = resume(&ctx, &loaded, &rc);
  CHECK_INT_EQ(rc, ZD_OK);
  CHECK_INT_EQ(loaded, 1);
  CHECK_U64_EQ(r->step, 7);
  same_state(m, r);
  CHECK_INT_EQ(nallocated, 1); /* the resume loaded through the same staging */
  zd__model_free(r);

  /* 2. A copy that never completes: the checkpoint fails within the timeout, and its staging is
   * never freed nor reused. */
  printf("a copy that never completes\n");
  m->step = 8;
  atomic_store(&fences_complete, 0);
  t0 = zd__now_ms();
  rc = zd__ckptr_take(c, &ctx, m, 1, cdir, sizeof cdir, &err);
  uint64_t took = zd__now_ms() - t0;
  printf("  take: %s (after %llu ms)\n", err.msg, (unsigned long long)took);
  CHECK_INT_NE(rc, ZD_OK);
  CHECK_CONTAINS(err.msg, "did not finish");
  CHECK_MSG(took < 3 * TIMEOUT_MS, "the failed checkpoint took %llu ms; the timeout is %d ms",
            (unsigned long long)took, TIMEOUT_MS);
  stats(c, &st);
  CHECK_U64_EQ(st.failures, 1);
  CHECK(!was_freed(first));
  atomic_store(&fences_complete, 1);
  m->step = 9;
  rc = zd__ckptr_take(c, &ctx, m, 1, cdir, sizeof cdir, &err);
  CHECK_MSG(rc == ZD_OK, "take after a poisoned staging: %s", err.msg);
  CHECK_INT_EQ(nallocated, 2);
  CHECK(allocated[1] != first);
  CHECK(!was_freed(first));
  r = resume(&ctx, &loaded, &rc);
  CHECK_INT_EQ(rc, ZD_OK);
  CHECK_U64_EQ(r->step, 9);
  same_state(m, r);
  zd__model_free(r);

  /* 3. The previous write still running (a disk of 20 kB/s): the next snapshot gives up within
   * the timeout with an error naming it. */
  printf("a previous write still running\n");
  zd__ckptr_destroy(c);
  set.throttle_bytes_per_s = 20000;
  CHECK_MSG(zd__ckptr_create(&set, NULL, 1, &c, &err) == ZD_OK, "%s", err.msg);
  ctx.ckpt = c;
  m->step = 10;
  rc = zd__ckptr_take(c, &ctx, m, 0, NULL, 0, &err);
  CHECK_MSG(rc == ZD_OK, "take: %s", err.msg);
  m->step = 11;
  t0 = zd__now_ms();
  rc = zd__ckptr_take(c, &ctx, m, 0, NULL, 0, &err);
  took = zd__now_ms() - t0;
  printf("  take: %s (after %llu ms)\n", err.msg, (unsigned long long)took);
  CHECK_INT_EQ(rc, -ETIMEDOUT);
  CHECK_CONTAINS(err.msg, "previous checkpoint file of rank 0 was still being written");
  CHECK_MSG(took < 3 * TIMEOUT_MS, "took %llu ms", (unsigned long long)took);
  writes_done(c); /* the throttled write: ~240 kB at 20 kB/s, a few seconds at most */

  /* 4. A resume whose copy to the state does not finish: -ETIMEDOUT, the staging poisoned. */
  printf("a resume whose copy does not finish\n");
  zd__ckptr_destroy(c);
  set.throttle_bytes_per_s = 0;
  CHECK_MSG(zd__ckptr_create(&set, NULL, 1, &c, &err) == ZD_OK, "%s", err.msg);
  ctx.ckpt = c;
  int before = nallocated;
  restore_times_out = 1;
  r = resume(&ctx, &loaded, &rc);
  CHECK_INT_EQ(rc, -ETIMEDOUT);
  CHECK_INT_EQ(nallocated, before + 1);
  void *poisoned = allocated[before];
  zd__model_free(r);
  restore_times_out = 0;
  r = resume(&ctx, &loaded, &rc);
  CHECK_INT_EQ(rc, ZD_OK);
  CHECK_INT_EQ(nallocated, before + 2); /* new staging: the poisoned one is left alone */
  zd__model_free(r);
  zd__ckptr_destroy(c);
  CHECK(!was_freed(poisoned) && !was_freed(first));
  free(poisoned); /* what zerod leaves to its exit */
  free(first);
  zd__model_free(m);
  char rm[64];
  snprintf(rm, sizeof rm, "rm -rf %s", dir);
  CHECK_INT_EQ(system(rm), 0);
  printf("test_checkpointer: ok\n");
  return 0;
}
