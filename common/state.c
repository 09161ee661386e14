/* The table of a shard's state arrays (state.h). */
#include "state.h"

#include <string.h>

static const char *const names[ZD__NSTATES] = {
#define NAME(role, name, always, legacy) name,
    ZD__STATE_ARRAYS(NAME)
#undef NAME
};

zd__states_t zd__states_always(void) {
  zd__states_t set = 0;
#define ALWAYS(role, name, always, legacy) \
  if (always) set |= ZD__STATE_BIT(ZD__STATE_##role);
  ZD__STATE_ARRAYS(ALWAYS)
#undef ALWAYS
  return set;
}

zd__states_t zd__states_legacy(void) {
  zd__states_t set = 0;
#define LEGACY(role, name, always, legacy) \
  if (legacy) set |= ZD__STATE_BIT(ZD__STATE_##role);
  ZD__STATE_ARRAYS(LEGACY)
#undef LEGACY
  return set;
}

const char *zd__state_name(zd__state_t s) {
  return (unsigned)s < ZD__NSTATES ? names[s] : NULL;
}

int zd__state_by_name(const char *name) {
  for (int s = 0; s < ZD__NSTATES; s++)
    if (!strcmp(names[s], name)) return s;
  return -1;
}
