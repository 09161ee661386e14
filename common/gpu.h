/* How zerod names a GPU in messages and status: the form nvidia-smi -L prints,
 * "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", from the 16 bytes of cudaDeviceProp.uuid, which
 * name the same GPU in every process (ordinals do not: CUDA_VISIBLE_DEVICES renumbers them).
 * Plain C, also in builds without CUDA. */
#ifndef ZD_COMMON_GPU_H
#define ZD_COMMON_GPU_H

#include <stddef.h>
#include <stdint.h>

#define ZD__GPU_UUID_STR 48 /* bytes that hold the string and its NUL, with room to spare */

/* Writes uuid's name into buf (len bytes, ZD__GPU_UUID_STR or more for all of it). */
void zd__gpu_uuid_str(const uint8_t uuid[16], char *buf, size_t len);

#endif /* ZD_COMMON_GPU_H */
