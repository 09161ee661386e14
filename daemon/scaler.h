/* Dynamic loss scaler for fp16 gradients, with the semantics Megatron-LM and DeepSpeed share.
 *
 * The client multiplies its loss by `scale`; zerod unscales the gradients by 1/scale. A step whose
 * gradients hold an inf or NaN is skipped; after `hysteresis` such steps (not necessarily in a
 * row; the counter refills on growth) the scale is multiplied by backoff_factor, never below
 * min_scale. After growth_interval consecutive clean steps it is multiplied by growth_factor and
 * the hysteresis counter refills. The update is zd__scaler_advance (kernels/step_decide.h), which
 * the CPU step and the CUDA decide kernel share: a pure function of (config, state, found_inf), so
 * every rank of a world computes the same trajectory from the same global found_inf.
 */
#ifndef ZD_DAEMON_SCALER_H
#define ZD_DAEMON_SCALER_H

#include <stdint.h>

#include "zerod/zerod.h"

typedef struct zd__scaler {
  int enabled;
  zd_loss_scaler_t cfg;
  double scale;
  uint32_t growth_tracker;     /* clean steps since the last growth or overflow */
  uint32_t hysteresis_tracker; /* overflows left before the next backoff */
} zd__scaler_t;

/* Starts a scaler; a disabled one keeps scale 1. */
void zd__scaler_init(zd__scaler_t *s, const zd_loss_scaler_t *cfg);

#endif /* ZD_DAEMON_SCALER_H */
