/* The table of a shard's state arrays (state.h). */
#include "state.h"

#include <string.h>

static const char *const names[ZD__NSTATES] = {
#define NAME(role, name, optional, needed) name,
    ZD__STATE_ARRAYS(NAME)
#undef NAME
};

zd__states_t zd__states_always(void) {
  zd__states_t set = 0;
#define ALWAYS(role, name, optional, needed) \
  if (!(optional)) set |= ZD__STATE_BIT(ZD__STATE_##role);
  ZD__STATE_ARRAYS(ALWAYS)
#undef ALWAYS
  return set;
}

/* The arrays group g needs. */
static zd__states_t group_needs(const zd_group_t *g) {
  zd__states_t set = 0;
#define NEEDS(role, name, optional, needed) \
  if (!(optional) || (needed)) set |= ZD__STATE_BIT(ZD__STATE_##role);
  ZD__STATE_ARRAYS(NEEDS)
#undef NEEDS
  return set;
}

zd__states_t zd__states_needed(const zd_group_t *groups, uint32_t ngroups) {
  zd__states_t set = zd__states_always();
  for (uint32_t i = 0; i < ngroups; i++) set |= group_needs(&groups[i]);
  return set;
}

int zd__states_missing(zd__states_t have, const zd_group_t *groups, uint32_t ngroups) {
  zd__states_t lack = zd__states_needed(groups, ngroups) & ~have;
  for (int s = 0; s < ZD__NSTATES; s++)
    if (lack & ZD__STATE_BIT(s)) return s;
  return -1;
}

const char *zd__state_name(zd__state_t s) {
  return (unsigned)s < ZD__NSTATES ? names[s] : NULL;
}

int zd__state_by_name(const char *name) {
  for (int s = 0; s < ZD__NSTATES; s++)
    if (!strcmp(names[s], name)) return s;
  return -1;
}
