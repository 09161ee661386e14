/* Dynamic loss scaler (scaler.h): its initial state. */
#include "scaler.h"

void zd__scaler_init(zd__scaler_t *s, const zd_loss_scaler_t *cfg) {
  *s = (zd__scaler_t){.enabled = cfg && cfg->enabled, .scale = 1.0};
  if (!s->enabled) return;
  s->cfg = *cfg;
  s->scale = cfg->initial_scale;
  s->hysteresis_tracker = cfg->hysteresis;
}
