"""Emulation of torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=2) on CPU for fp32 grads,
bit for bit, for Debian's torch 1.13 and the PyPI wheels 2.6 and 2.15 (README.md section 6).

Run with the torch to check: `python clip_emulate.py [cases]`. It compares per-tensor norms, the
total norm and every clipped gradient with the real thing and prints the mismatch counts."""
import os, sys
import numpy as np, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from f32ops import fma32, f32

# How each build compiled ATen's reduce-last-dim norm kernel (ReduceOpsKernel.cpp, the AVX2 copy:
# the AVX-512 slot of norm_stub is empty, so AVX-512 CPUs run it too), found by measurement:
#   main: the 8-lane loop acc = acc + x*x, fused into one fma (GCC contracts the intrinsics) or not;
#   tail: the n % 8 scalar tail s += x*x: "fma" every element fused; "split4": GCC vectorised the
#         tail's products four at a time (first 4 * (m // 4) of the m tail elements unfused: a
#         rounded product, then an in-order add), the remaining m % 4 fused;
#   one_abs: a one-element tensor is |x| (linalg_vector_norm's is_reduce_over_1D_vector, 2.x).
VARIANTS = {
    "1.13": dict(main_fma=True, tail="split4", one_abs=False),
    "2.6": dict(main_fma=True, tail="fma", one_abs=True),
    "2.15": dict(main_fma=False, tail="split4", one_abs=True),
}


def variant_of(version):
    for k in ("1.13", "2.6", "2.15"):
        if version.startswith(k): return VARIANTS[k]
    raise KeyError(f"no measured norm variant for torch {version}")


def norm2(x, v):
    """ATen CPU vector_norm(x, 2) of a contiguous fp32 tensor: 8 fp32 lanes, lane j accumulates
    x[i]^2 for i = j (mod 8) over the first n - n % 8 elements; lanes summed ((l0+l1)+l2)+...+l7;
    then the tail in order (see VARIANTS); sqrt correctly rounded."""
    x = np.ascontiguousarray(x, f32).reshape(-1); n = x.size; L = 8; nv = n - n % L
    with np.errstate(all="ignore"):
        if n == 1 and v["one_abs"]: return f32(abs(x[0]))
        acc = np.zeros(L, f32)
        for row in x[:nv].reshape(-1, L):
            acc = fma32(row, row, acc) if v["main_fma"] else acc + row * row
        s = acc[0]
        for j in range(1, L): s = f32(s + acc[j])
        m = n - nv; unfused = 4 * (m // 4) if v["tail"] == "split4" else 0
        for d in range(nv, n):
            s = f32(s + x[d] * x[d]) if d - nv < unfused else fma32(x[d], x[d], s)[()]
        return f32(np.sqrt(f32(s)))


def clip(grads, max_norm, v):
    norms = np.array([norm2(g, v) for g in grads], f32)
    total = norm2(norms, v)   # vector_norm(stack(norms)) in 2.x, torch.norm(stack(norms)) in 1.13
    with np.errstate(all="ignore"):
        coef = (f32(1) / (total + f32(1e-6))) * f32(max_norm)     # max_norm / t == t.reciprocal() * max_norm
        coef_c = np.minimum(coef, f32(1.0)) if not np.isnan(coef) else coef   # clamp(max=1) keeps NaN
        return norms, total, coef_c, [g * coef_c for g in grads]


def same(a, b):
    a, b = np.asarray(a, f32), np.asarray(b, f32)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


if __name__ == "__main__":
    v = variant_of(torch.__version__)
    ncases = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    rng = np.random.default_rng(7)
    dims = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 31, 33, 64, 100, 127, 128, 129, 1000, 4097]
    bad = dict(norm=0, total=0, grads=0); ntensors = 0; elems = 0
    for trial in range(ncases):
        shapes = []
        for _ in range(int(rng.integers(1, 20))):
            r = rng.random()
            if r < 0.5: shapes.append((int(rng.integers(1, 300)),))
            else:
                sh = tuple(int(s) for s in rng.choice(dims, size=rng.integers(1, 4)))
                shapes.append(sh if np.prod(sh) <= 200000 else sh[:1])
        grads = [(rng.standard_normal(s) * 10 ** rng.uniform(-6, 3)).astype(f32) for s in shapes]
        max_norm = float(rng.choice([0.01, 0.3, 1.0, 3.0, 1e3]))
        ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for p, g in zip(ps, grads): p.grad = torch.from_numpy(g.copy())
        tnorms = [torch.linalg.vector_norm(p.grad, 2).numpy() for p in ps]
        tot = torch.nn.utils.clip_grad_norm_(ps, max_norm).numpy()
        norms, total, coef, eg = clip(grads, max_norm, v)
        bad["norm"] += sum(int(not same(a, b)) for a, b in zip(tnorms, norms))
        bad["total"] += int(not same(tot, total))
        bad["grads"] += sum(int((~same(p.grad.numpy(), e)).sum()) for p, e in zip(ps, eg))
        ntensors += len(shapes); elems += sum(g.size for g in grads)
    print(f"torch {torch.__version__} {v}: {ncases} clip cases, {ntensors} tensors, {elems} elements; "
          f"mismatches {bad}")
    # non-finite behaviour
    for bad_val in (np.nan, np.inf):
        ps = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))]
        ps[0].grad = torch.tensor([1.0, bad_val, 2.0, 3.0]); ps[1].grad = torch.tensor([1.0, 2.0, 3.0])
        tot = torch.nn.utils.clip_grad_norm_(ps, 1.0)
        print(f"grad contains {bad_val}: total={tot.item()} grads -> {ps[0].grad.tolist()} {ps[1].grad.tolist()}")
