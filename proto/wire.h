/* Conversions between the local protocol's messages (zerod.proto) and zerod's C structures, for
 * the daemon (decoding, with the checks that need no state) and libzerod (encoding).
 *
 * A group's fields are converted from the table in common/group.h: message Group has exactly the
 * fields of zd_group_t, by the same names, so a hyperparameter added to the table and to the
 * .proto travels without an edit here. The wire's DType values are zd_dtype_t's (checked at
 * compile time from the dtype table, common/dtype.h).
 */
#ifndef ZD_PROTO_WIRE_H
#define ZD_PROTO_WIRE_H

#include <stddef.h>

#include "error.h"
#include "zerod.pb-c.h"
#include "zerod/zerod.h"

/* Fills w (initialised here) from g; every field is marked present. */
void zd__wire_group_to(Zerod__V1__Group *w, const zd_group_t *g);

/* Decodes n groups into out and checks each (zd__group_check): ZD_OK, or ZD_EHPARAM with the
 * first failing field named after its group ("group 1: lr is nan; expected a finite value >= 0").
 * A field an older client did not send has the .proto's default, which is the table's. */
int zd__wire_groups_from(zd_group_t *out, Zerod__V1__Group *const *in, size_t n, zd__err_t *err);

/* The wire value of a dtype, and back. Values are the same; neither checks it (zd__dtype_check
 * does, with the message the caller wants). */
Zerod__V1__DType zd__wire_dtype_to(zd_dtype_t dtype);
zd_dtype_t zd__wire_dtype_from(Zerod__V1__DType dtype);

/* The loss scaler of a register request: in NULL means no loss scaling (*out zeroed, enabled 0).
 * ZD_OK, or ZD_EHPARAM naming the first factor out of range. */
int zd__wire_scaler_from(zd_loss_scaler_t *out, const Zerod__V1__LossScaler *in, zd__err_t *err);

/* Fills w from s and returns it, or returns NULL when s is not enabled: what
 * RegisterRequest.loss_scaler takes. */
Zerod__V1__LossScaler *zd__wire_scaler_to(Zerod__V1__LossScaler *w, const zd_loss_scaler_t *s);

#endif /* ZD_PROTO_WIRE_H */
