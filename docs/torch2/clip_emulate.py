"""Emulation of torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=2) on CPU for fp32 grads."""
import sys, numpy as np, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from f32ops import fma32, f32, f64
def norm2(x, tail_fma=True):
    """ATen CPU vector_norm(p=2) of a contiguous fp32 tensor (reduce-lastdim path, AVX2 kernel even
    on AVX-512 CPUs): 8 fp32 lanes, lane j accumulates x[i]^2 for i = j mod 8 over the first n - n%8
    elements, acc = acc + x*x (product and sum rounded separately); lanes summed in order
    ((l0+l1)+l2)+...+l7; then the n%8 tail elements added in order; sqrt correctly rounded."""
    x = np.ascontiguousarray(x, f32).reshape(-1); n = x.size; L = 8; nv = n - n % L
    acc = np.zeros(L, f32)
    with np.errstate(all="ignore"):
        for row in x[:nv].reshape(-1, L): acc = acc + row * row
        s = acc[0]
        for j in range(1, L): s = f32(s + acc[j])
        for d in range(nv, n): s = fma32(x[d], x[d], s) if tail_fma else f32(s + x[d] * x[d])
        return f32(np.sqrt(f32(s)))
def clip(grads, max_norm, tail_fma=True):
    norms = np.array([norm2(g, tail_fma) for g in grads], f32)
    total = norm2(norms, tail_fma)
    with np.errstate(all="ignore"):
        coef = (f32(1) / (total + f32(1e-6))) * f32(max_norm)     # max_norm / t == t.reciprocal() * max_norm
        coef_c = np.minimum(coef, f32(1.0)) if not np.isnan(coef) else coef   # clamp(max=1) keeps NaN
        return total, coef, coef_c, [g * coef_c for g in grads]
if __name__ == "__main__":
    print("torch", torch.__version__)
    rng = np.random.default_rng(5)
    bad = dict(total=0, coef=0, grads=0); bad_nf = dict(total=0, coef=0, grads=0); cases = 0; elems = 0
    for trial in range(300):
        k = int(rng.integers(1, 12))
        shapes = [tuple(int(s) for s in rng.choice([1, 3, 7, 8, 16, 33, 100, 1000, 4097], size=rng.integers(1, 3))) for _ in range(k)]
        grads = [(rng.standard_normal(s) * 10 ** rng.uniform(-4, 2)).astype(f32) for s in shapes]
        max_norm = float(rng.choice([0.01, 1.0, 5.0, 1e3]))
        ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for p, g in zip(ps, grads): p.grad = torch.from_numpy(g.copy())
        tot = torch.nn.utils.clip_grad_norm_(ps, max_norm)
        for tf, b in ((True, bad), (False, bad_nf)):
            total, coef, coef_c, eg = clip(grads, max_norm, tf)
            b["total"] += int(tot.numpy().view(np.uint32) != total.view(np.uint32))
            b["grads"] += sum(int((p.grad.numpy().view(np.uint32) != e.view(np.uint32)).sum()) for p, e in zip(ps, eg))
            # coefficient: torch's own formula on its own total
            tc = torch.clamp(max_norm / (tot + 1e-6), max=1.0).numpy()
            b["coef"] += int(tc.view(np.uint32) != coef_c.view(np.uint32))
        cases += 1; elems += sum(g.size for g in grads)
    print(f"{cases} random clip cases, {elems} grad elements; mismatches (tail fma) {bad}; (tail no fma) {bad_nf}")
    # coefficient formula alone: reciprocal*max_norm vs true division
    t = (rng.random(200000) * 10 ** rng.uniform(-3, 3, 200000)).astype(f32)
    for mn in (1.0, 0.5, 3.0, 0.3):
        c_t = (mn / (torch.from_numpy(t) + 1e-6)).numpy()
        c_recip = (f32(1) / (t + f32(1e-6))) * f32(mn); c_div = f32(mn) / (t + f32(1e-6))
        print(f"max_norm={mn}: torch vs reciprocal*max_norm mismatches {int((c_t.view(np.uint32)!=c_recip.view(np.uint32)).sum())}, vs max_norm/x {int((c_t.view(np.uint32)!=c_div.view(np.uint32)).sum())} of {t.size}")
    # non-finite behaviour
    for bad_val in (np.nan, np.inf):
        ps = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))]
        ps[0].grad = torch.tensor([1.0, bad_val, 2.0, 3.0]); ps[1].grad = torch.tensor([1.0, 2.0, 3.0])
        tot = torch.nn.utils.clip_grad_norm_(ps, 1.0)
        print(f"grad contains {bad_val}: total={tot.item()} grads -> {ps[0].grad.tolist()} {ps[1].grad.tolist()}")
        try:
            torch.nn.utils.clip_grad_norm_(ps, 1.0, error_if_nonfinite=True); print("  error_if_nonfinite: no error")
        except RuntimeError as e: print("  error_if_nonfinite=True raises RuntimeError:", str(e)[:80])
    # total below max_norm: coefficient clamps to exactly 1.0 and grads are multiplied by 1.0 (unchanged bits, -0 stays)
    ps = [torch.nn.Parameter(torch.zeros(3))]; ps[0].grad = torch.tensor([0.1, -0.0, 1e-40])
    tot = torch.nn.utils.clip_grad_norm_(ps, 10.0); print("small grads after clip:", ps[0].grad.tolist(), "total", tot.item())
