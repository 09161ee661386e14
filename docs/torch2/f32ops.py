"""Exact float32 helpers in numpy: fma32 (correctly rounded fused multiply-add of float32 arrays,
via exact double product + TwoSum + midpoint fix-up)."""
import numpy as np
f32, f64 = np.float32, np.float64

def fma32(a, b, c):
    a = np.asarray(a, f32); b = np.asarray(b, f32); c = np.asarray(c, f32)
    a, b, c = np.broadcast_arrays(a, b, c)
    with np.errstate(all="ignore"):
        p = a.astype(f64) * b.astype(f64)          # exact: 24+24 bit significands, double range
        cc = c.astype(f64)
        s = p + cc
        bb = s - p
        err = (p - (s - bb)) + (cc - bb)            # TwoSum: p + cc == s + err exactly
        r = s.astype(f32)
        rd = r.astype(f64)
        toward = np.where(s > rd, f32(np.inf), f32(-np.inf))
        nb = np.nextafter(r, toward)
        mid = (rd + nb.astype(f64)) * 0.5          # exact in double
        fix = np.isfinite(s) & (s != rd) & (s == mid) & (err != 0)
        if fix.any():
            # true value lies strictly on err's side of the midpoint
            up = err > 0
            hi = np.maximum(r, nb); lo = np.minimum(r, nb)
            r = np.where(fix, np.where(up, hi, lo), r)
    return np.asarray(r, f32)
