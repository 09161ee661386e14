/* Status (status.h): the builder of a snapshot and the registry of its writers. */
#include "status.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct entry {
  char *key;
  char *value;
} entry_t;

typedef struct section {
  char *name;
  entry_t *entries;
  size_t n, cap;
} section_t;

struct zd__status {
  section_t *sections;
  size_t n, cap;
  size_t cur; /* the section zd__status_add writes to */
  size_t total;
  int oom;
};

typedef struct writer {
  zd__status_fn fn;
  void *ctx;
} writer_t;

struct zd__status_reg {
  writer_t *w;
  size_t n, cap;
};

zd__status_t *zd__status_new(void) {
  return calloc(1, sizeof(zd__status_t));
}

void zd__status_free(zd__status_t *st) {
  if (!st) return;
  for (size_t i = 0; i < st->n; i++) {
    for (size_t j = 0; j < st->sections[i].n; j++) {
      free(st->sections[i].entries[j].key);
      free(st->sections[i].entries[j].value);
    }
    free(st->sections[i].entries);
    free(st->sections[i].name);
  }
  free(st->sections);
  free(st);
}

static int grow(void **arr, size_t *cap, size_t n, size_t size) {
  if (n < *cap) return 0;
  size_t c = *cap ? *cap * 2 : 8;
  void *p = realloc(*arr, c * size);
  if (!p) return -ENOMEM;
  *arr = p;
  *cap = c;
  return 0;
}

int zd__status_section(zd__status_t *st, const char *name) {
  for (size_t i = 0; i < st->n; i++)
    if (!strcmp(st->sections[i].name, name)) {
      st->cur = i;
      return 0;
    }
  if (grow((void **)&st->sections, &st->cap, st->n, sizeof *st->sections)) goto oom;
  section_t *s = &st->sections[st->n];
  *s = (section_t){.name = strdup(name)};
  if (!s->name) goto oom;
  st->cur = st->n++;
  return 0;
oom:
  st->oom = 1;
  return -ENOMEM;
}

int zd__status_add(zd__status_t *st, const char *key, const char *fmt, ...) {
  if (st->n == 0) return -EINVAL;
  section_t *s = &st->sections[st->cur];
  if (grow((void **)&s->entries, &s->cap, s->n, sizeof *s->entries)) goto oom;
  va_list ap;
  va_start(ap, fmt);
  char *value = NULL;
  int rc = vasprintf(&value, fmt, ap);
  va_end(ap);
  char *k = strdup(key);
  if (rc < 0 || !k) {
    free(k);
    if (rc >= 0) free(value);
    goto oom;
  }
  s->entries[s->n++] = (entry_t){.key = k, .value = value};
  st->total++;
  return 0;
oom:
  st->oom = 1;
  return -ENOMEM;
}

size_t zd__status_nsections(const zd__status_t *st) {
  return st->n;
}
size_t zd__status_nentries(const zd__status_t *st, size_t i) {
  return st->sections[i].n;
}
size_t zd__status_nentries_total(const zd__status_t *st) {
  return st->total;
}
const char *zd__status_section_name(const zd__status_t *st, size_t i) {
  return st->sections[i].name;
}
const char *zd__status_key(const zd__status_t *st, size_t i, size_t j) {
  return st->sections[i].entries[j].key;
}
const char *zd__status_value(const zd__status_t *st, size_t i, size_t j) {
  return st->sections[i].entries[j].value;
}

/* ---- the registry ---------------------------------------------------------------------------- */

zd__status_reg_t *zd__status_reg_new(void) {
  return calloc(1, sizeof(zd__status_reg_t));
}

void zd__status_reg_free(zd__status_reg_t *reg) {
  if (!reg) return;
  free(reg->w);
  free(reg);
}

int zd__status_register(zd__status_reg_t *reg, zd__status_fn fn, void *ctx) {
  if (grow((void **)&reg->w, &reg->cap, reg->n, sizeof *reg->w)) return -ENOMEM;
  reg->w[reg->n++] = (writer_t){.fn = fn, .ctx = ctx};
  return 0;
}

void zd__status_unregister(zd__status_reg_t *reg, zd__status_fn fn, void *ctx) {
  for (size_t i = 0; reg && i < reg->n; i++)
    if (reg->w[i].fn == fn && reg->w[i].ctx == ctx) {
      memmove(&reg->w[i], &reg->w[i + 1], (reg->n - i - 1) * sizeof *reg->w);
      reg->n--;
      return;
    }
}

zd__status_t *zd__status_collect(const zd__status_reg_t *reg) {
  zd__status_t *st = zd__status_new();
  if (!st) return NULL;
  for (size_t i = 0; i < reg->n; i++) reg->w[i].fn(reg->w[i].ctx, st);
  if (st->oom) {
    zd__status_free(st);
    return NULL;
  }
  return st;
}
