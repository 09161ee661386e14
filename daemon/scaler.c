/* Dynamic loss scaler (scaler.h). Megatron's DynamicGradScaler.update() step for step. */
#include "scaler.h"

void zd__scaler_init(zd__scaler_t *s, const zd_loss_scaler_t *cfg) {
  *s = (zd__scaler_t){.enabled = cfg && cfg->enabled, .scale = 1.0};
  if (!s->enabled) return;
  s->cfg = *cfg;
  s->scale = cfg->initial_scale;
  s->hysteresis_tracker = cfg->hysteresis;
}

void zd__scaler_update(zd__scaler_t *s, int found_inf) {
  if (!s->enabled) return;
  if (found_inf) {
    s->growth_tracker = 0;
    if (s->hysteresis_tracker > 0) s->hysteresis_tracker--;
    if (s->hysteresis_tracker == 0) {
      double next = s->scale * s->cfg.backoff_factor;
      s->scale = next > s->cfg.min_scale ? next : s->cfg.min_scale;
    }
    return;
  }
  if (++s->growth_tracker == s->cfg.growth_interval) {
    s->growth_tracker = 0;
    s->hysteresis_tracker = s->cfg.hysteresis;
    s->scale *= s->cfg.growth_factor;
  }
}
