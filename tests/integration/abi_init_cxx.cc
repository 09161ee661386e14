/* zerod.h's initialisers compiled as C++ (test_abi.c checks the sizes they set): a C++ trainer
 * includes the same header. Built with -Werror=missing-field-initializers, like test_abi.c, so
 * that an initialiser missing a field fails the build. */
#include <stddef.h>

#include "zerod/zerod.h"

extern "C" size_t zdt_cxx_init_sizes(size_t *out, size_t n);

size_t zdt_cxx_init_sizes(size_t *out, size_t n) {
  zd_model_desc_t desc = ZD_MODEL_DESC_INIT;
  zd_step_opts_t opts = ZD_STEP_OPTS_INIT;
  zd_loss_scaler_t scaler = ZD_LOSS_SCALER_INIT;
  zd_info_t info = ZD_INFO_INIT;
  zd_param_info_t pinfo = ZD_PARAM_INFO_INIT;
  zd_bucket_info_t binfo = ZD_BUCKET_INFO_INIT;
  zd_step_result_t res = ZD_STEP_RESULT_INIT;
  const size_t sizes[] = {desc.size,       desc.param_size, desc.group_size, opts.size,
                          opts.group_size, scaler.size,     info.size,       pinfo.size,
                          binfo.size,      res.size};
  size_t count = sizeof sizes / sizeof sizes[0];
  for (size_t i = 0; i < count && i < n; i++) out[i] = sizes[i];
  return count;
}
