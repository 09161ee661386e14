/* A GPU's name (gpu.h). */
#include "gpu.h"

#include <stdio.h>

void zd__gpu_uuid_str(const uint8_t u[16], char *buf, size_t len) {
  snprintf(buf, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
           u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
           u[14], u[15]);
}
