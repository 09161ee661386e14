/* End-to-end check of the placement of a step's streams (common/placement.h) at a power-of-two
 * parameter count, the size at which arrays mapped back to back used to collide (issue 16): the
 * client's param and grad buffers sit at their colours in the client, zerod maps the same memfds at
 * the same colours, and every large mapping zerod holds for the model (master, exp_avg,
 * exp_avg_sq, the two client buffers) starts at a different address modulo ZD__PLACE_ALIGN, read
 * from /proc/<zerod>/maps. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "harness.h"
#include "placement.h"
#include "zerod/zerod.h"

#define NPARAM  ((uint64_t)1 << 22)
#define BIG_MIN ((unsigned long long)NPARAM * 4 - 4096) /* one fp32 array of the model */
/* ... and at most two of them: not a sanitizer's shadow memory or allocator regions (TiBs) */
#define BIG_MAX ((unsigned long long)NPARAM * 8)

typedef struct big_map {
  unsigned long long lo, hi;
  char path[128];
} big_map_t;

/* zerod's read-write mappings of at least one model array. */
static int big_maps(pid_t pid, big_map_t *out, int max) {
  char name[64], line[512];
  snprintf(name, sizeof name, "/proc/%d/maps", (int)pid);
  FILE *f = fopen(name, "r");
  CHECK_MSG(f != NULL, "cannot open %s", name);
  int n = 0;
  while (fgets(line, sizeof line, f)) {
    big_map_t m = {0};
    char perms[8];
    if (sscanf(line, "%llx-%llx %7s %*s %*s %*s %127[^\n]", &m.lo, &m.hi, perms, m.path) < 3)
      continue;
    if (perms[0] != 'r' || perms[1] != 'w' || m.hi - m.lo < BIG_MIN || m.hi - m.lo > BIG_MAX)
      continue;
    CHECK_MSG(n < max, "more than %d large mappings in zerod", max);
    out[n++] = m;
  }
  fclose(f);
  return n;
}

static const big_map_t *find(const big_map_t *m, int n, const char *name) {
  const big_map_t *hit = NULL;
  for (int i = 0; i < n; i++)
    if (strstr(m[i].path, name)) {
      CHECK_MSG(hit == NULL, "zerod maps %s twice", name);
      hit = &m[i];
    }
  CHECK_MSG(hit != NULL, "zerod does not map %s", name);
  return hit;
}

int main(void) {
  zdt_daemon_t d;
  zdt_start(&d, NULL);
  zd_client_t *c;
  CHECK_MSG(zd_connect(d.socket, ZD_ANY_RANK, 0, &c) == ZD_OK, "connect: %s", zd_last_error());
  zd_group_t group = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
  zd_param_t param = {.name = "w", .ndim = 1, .shape = {NPARAM}};
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  desc.params = &param;
  desc.nparams = 1;
  desc.groups = &group;
  desc.ngroups = 1;
  desc.param_dtype = ZD_F32;
  desc.grad_dtype = ZD_F32;
  CHECK_MSG(zd_layout(c, &desc) == ZD_OK, "layout: %s", zd_last_error());
  CHECK_MSG(zd_register(c) == ZD_OK, "register: %s", zd_last_error());

  uintptr_t pb = (uintptr_t)zd_param_buffer(c, NULL), gb = (uintptr_t)zd_grad_buffer(c, NULL);
  CHECK_U64_EQ(pb % ZD__PLACE_ALIGN, ZD__COLOUR_PARAMS * ZD__PLACE_STRIDE);
  CHECK_U64_EQ(gb % ZD__PLACE_ALIGN, ZD__COLOUR_GRADS * ZD__PLACE_STRIDE);

  big_map_t m[16];
  int n = big_maps(d.pid, m, 16);
  CHECK_U64_EQ(find(m, n, "memfd:zerod-params")->lo % ZD__PLACE_ALIGN,
               ZD__COLOUR_PARAMS * ZD__PLACE_STRIDE);
  CHECK_U64_EQ(find(m, n, "memfd:zerod-grads")->lo % ZD__PLACE_ALIGN,
               ZD__COLOUR_GRADS * ZD__PLACE_STRIDE);
  /* The three state arrays and the two buffers at least; no two start alike modulo 2 MiB. */
  CHECK_MSG(n >= 5, "zerod has %d mappings of %llu bytes or more; expected the model's 5", n,
            BIG_MIN);
  for (int i = 0; i < n; i++)
    for (int j = i + 1; j < n; j++)
      CHECK_MSG(m[i].lo % ZD__PLACE_ALIGN != m[j].lo % ZD__PLACE_ALIGN,
                "zerod's mappings at %#llx (%s) and %#llx (%s) start alike modulo %zu", m[i].lo,
                m[i].path, m[j].lo, m[j].path, ZD__PLACE_ALIGN);

  zd_close(c);
  zdt_stop(&d, SIGTERM, 0);
  printf("colours: ok (%d large mappings in zerod)\n", n);
  return 0;
}
