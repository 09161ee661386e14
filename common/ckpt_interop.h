/* Exports and imports: the checkpoint's state as one safetensors file of whole parameters, which
 * torch and Hugging Face loaders read, and such a file (from zeroctl export, or a torch optimizer's
 * state through the Python client's zerod.checkpoint.save_torch_state) back into a checkpoint.
 *
 * Unlike a rank file, the file holds each parameter whole, with its name and shape, whatever the
 * world size and bucket size it was written at: export is the way out of zerod, import the way in.
 */
#ifndef ZD_COMMON_CKPT_INTEROP_H
#define ZD_COMMON_CKPT_INTEROP_H

#include <stddef.h>

#include "error.h"

/* Exports the checkpoint in dir (verified first) as one safetensors file at out_path: an F32 tensor
 * per parameter with its name and shape, its master weights; with moments also a tensor
 * "<name>.<array>" per parameter for every other state array the checkpoint has (common/state.h;
 * today "<name>.exp_avg", "<name>.exp_avg_sq", and "<name>.max_exp_avg_sq" with amsgrad), each
 * array's tensors after the previous array's, in the table's order. Metadata: format "pt" (what
 * Hugging Face loaders require), zerod_format "zerod-export", step, steps_skipped, world_size,
 * layout_hash, the groups and each parameter's group (JSON strings). Written atomically (.tmp,
 * fsync, rename, fsync of the directory). Errors: the manifest's and verification's; -EINVAL when
 * two tensors would have the same name. */
int zd__ckpt_export(const char *dir, const char *out_path, int moments, zd__err_t *err);

/* Imports optimizer state from elsewhere: reads the safetensors file at in_path and writes a
 * complete checkpoint of world size 1 (default bucket size) under root, which any world size
 * resumes (resharding). root is created if it is missing (its parent must exist); the checkpoint's
 * directory goes into dir_out (dir_len bytes). Blocks for the read, the write and a verification
 * of what was written; holds every parameter's arrays in memory (4 bytes per element and array).
 *
 * The file: for each parameter an F32 tensor "<name>" (its fp32 master weights, with its shape),
 * and a tensor "<name>.<array>" of the same shape for every other state array a model has
 * (common/state.h; today "<name>.exp_avg", "<name>.exp_avg_sq"); an optional array (today
 * max_exp_avg_sq, with amsgrad) for every parameter or none, and the checkpoint then has it; no
 * other tensor. Metadata (strings, as safetensors requires): zerod_format "zerod-torch-state" or
 * "zerod-export" (a zeroctl export with moments "1": a checkpoint goes back in unchanged),
 * zerod_version "1", step (the Adam steps applied: zerod's next step is step + 1), steps_skipped
 * (optional, default 0), groups (JSON: an array of groups as the manifest writes them: every field
 * of zd_group_t by its C name), params (JSON: the parameter names in registration order; optional
 * in an export, whose master tensors are then taken in the order of their data) and param_groups
 * (JSON: each parameter's group, in that order). The manifest's dtypes are f32, max_grad_norm 0,
 * gradients averaged and no loss scaler: a resume takes those from the registration, not from the
 * checkpoint.
 *
 * Errors: -EBADMSG naming the file and what it lacks (not safetensors, a tensor missing, of
 * another dtype or shape, outside the data, a tensor that is no parameter's, malformed metadata);
 * ZD_EVERSION for a zerod_version other than "1"; -EEXIST when root already holds a complete
 * checkpoint of that step; the layout's errors (-EINVAL, ZD_EGROUP: bad names, groups); the
 * writer's. On an error before the manifest nothing complete is left behind. */
int zd__ckpt_import(const char *in_path, const char *root, char *dir_out, size_t dir_len,
                    zd__err_t *err);

#endif /* ZD_COMMON_CKPT_INTEROP_H */
