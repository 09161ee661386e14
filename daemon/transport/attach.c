/* The rank attachment table (attach.h). */
#include "attach.h"

#include <stdlib.h>

#include "log.h"

typedef struct slot {
  zd__session_t *holder; /* NULL: free */
  int attached;          /* 0: reserved by holder's hello; 1: holder registered */
  int named;             /* reserved by a hello that named the rank (a weak reservation) */
} slot_t;

struct zd__attach {
  uint32_t nranks;
  slot_t slots[];
};

zd__attach_t *zd__attach_new(uint32_t nranks) {
  zd__attach_t *a = calloc(1, sizeof *a + nranks * sizeof a->slots[0]);
  if (a) a->nranks = nranks;
  return a;
}

void zd__attach_free(zd__attach_t *a) {
  free(a);
}

int zd__attach_reserve_any(zd__attach_t *a, zd__session_t *s, uint32_t *local) {
  for (uint32_t i = 0; i < a->nranks; i++) {
    if (a->slots[i].holder) continue;
    a->slots[i] = (slot_t){.holder = s};
    *local = i;
    return 0;
  }
  return -1;
}

int zd__attach_reserve(zd__attach_t *a, zd__session_t *s, uint32_t local) {
  zd_assert(local < a->nranks);
  slot_t *slot = &a->slots[local];
  if (!slot->holder) *slot = (slot_t){.holder = s, .named = 1};
  return slot->holder == s;
}

zd__session_t *zd__attach_blocker(const zd__attach_t *a, const zd__session_t *s, uint32_t local,
                                  int named) {
  zd_assert(local < a->nranks);
  const slot_t *slot = &a->slots[local];
  if (!slot->holder || slot->holder == s) return NULL;
  if (named && slot->named && !slot->attached) return NULL; /* a weak reservation yields */
  return slot->holder;
}

zd__session_t *zd__attach_take(zd__attach_t *a, zd__session_t *s, uint32_t local, int named) {
  zd__session_t *blocker = zd__attach_blocker(a, s, local, named);
  if (blocker) return blocker;
  a->slots[local] = (slot_t){.holder = s, .attached = 1, .named = named};
  return NULL;
}

void zd__attach_unattach(zd__attach_t *a, const zd__session_t *s, uint32_t local) {
  zd_assert(local < a->nranks && a->slots[local].holder == s);
  a->slots[local].attached = 0;
}

int zd__attach_release(zd__attach_t *a, const zd__session_t *s, uint32_t local) {
  zd_assert(local < a->nranks);
  slot_t *slot = &a->slots[local];
  if (slot->holder != s) return 0;
  int attached = slot->attached;
  *slot = (slot_t){0};
  return attached;
}

zd__session_t *zd__attach_holder(const zd__attach_t *a, uint32_t local, int *attached) {
  zd_assert(local < a->nranks);
  *attached = a->slots[local].attached;
  return a->slots[local].holder;
}
