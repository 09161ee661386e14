"""numpy float32 emulation of torch's CPU Adam / AdamW (fp32 params, single-tensor path, the CPU
default), bit for bit, plus a test harness that runs the real torch optimizer next to it.

Usage:  <python with torch> emulate.py [--formula 2x|113] [--sqrt mkl_ex|exact] [--impl single|foreach|fused]
  --formula 2x  : torch 2.x op sequence (lerp_ first moment)            [default for torch >= 2]
  --formula 113 : torch 1.13 / zerod formula (mul_+add_ first moment)   [default for torch 1.x]
  --sqrt mkl_ex : torch's sqrt as MKL VML vsSqrt HA "EX" path computes it (rsqrtps + 2 Newton-type
                  corrections, no FMA) -- what pip wheels (MKL) do on non-Intel x86 CPUs; uses
                  the CPU's own rsqrtps through libmklsqrt_ex.so           [default for torch >= 2]
  --sqrt exact  : correctly rounded sqrt (sqrtps/sqrtss; builds without MKL, e.g. Debian 1.13)

Per element, everything fp32, fma = one rounding (fma32 below), other ops round separately.
Python-float hyperparameters reach the kernels as fp32 scalars, rounded once from double.
  torch 2.x, AVX2/AVX-512 ATen capability:
    g  = -grad if maximize else grad
    AdamW, wd != 0: p = p * f32(1 - lr*wd)
    Adam,  wd != 0: g = fma(p, f32(wd), g)                        (grad.add(param, alpha=wd))
    w  = f32(1 - beta1)
    m  = fma(w, g - m, m)          if |w| <  0.5                  (exp_avg.lerp_(g, 1-beta1))
         fma(w - 1, g - m, g)      if |w| >= 0.5
    v  = fma(f32(1-beta2) * g, g, v * f32(beta2))                 (mul_(b2).addcmul_(g, g, 1-b2))
    amsgrad: vmax = max(vmax, v) (NaN propagates); s = vmax else s = v
    d  = SQRT(s) / f32(bc2 ** 0.5) + f32(eps)                     bc2 = 1 - beta2**t   (doubles)
    p  = p + (f32(-(lr / bc1)) * m) / d                           bc1 = 1 - beta1**t   (doubles)
  torch 1.13 (zerod's current formula): m = fma(g, f32(1-beta1), m * f32(beta1)), bc2s = math.sqrt(bc2),
    sqrt correctly rounded; the rest as above.
"""
import sys, os, math, ctypes, argparse
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from f32ops import fma32, f32, f64

_lib = None
def sqrt_mkl_ex(x):
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "libmklsqrt_ex.so"))
    x = np.ascontiguousarray(x, f32); y = np.empty_like(x)
    _lib.mkl_ex_sqrt(x.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(x.size))
    return y

def sqrt_exact(x):
    with np.errstate(invalid="ignore"):
        return np.sqrt(np.asarray(x, f32))

class EmuAdam:
    def __init__(self, shapes, lr, betas, eps, wd, amsgrad, maximize, decoupled, formula="2x", sqrt=sqrt_mkl_ex):
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, wd
        self.amsgrad, self.maximize, self.decoupled, self.formula, self.sqrt = amsgrad, maximize, decoupled, formula, sqrt
        self.m = [np.zeros(s, f32) for s in shapes]; self.v = [np.zeros(s, f32) for s in shapes]
        self.vmax = [np.zeros(s, f32) for s in shapes]; self.t = 0

    def step(self, params, grads):
        self.t += 1; t = float(self.t)
        lr, b1, b2, eps, wd = self.lr, self.b1, self.b2, self.eps, self.wd
        bc1 = 1 - b1 ** t; bc2 = 1 - b2 ** t
        step_size = lr / bc1
        bc2s = math.sqrt(bc2) if self.formula == "113" else bc2 ** 0.5
        NSS, BC2S, E = f32(-step_size), f32(bc2s), f32(eps)
        W1, A1, B1 = f32(1 - b1), f32(1 - b1), f32(b1)
        A2, B2 = f32(1 - b2), f32(b2)
        out = []
        with np.errstate(all="ignore"):
            for i, (p, g) in enumerate(zip(params, grads)):
                p = p.astype(f32).copy(); g = g.astype(f32)
                if self.maximize: g = -g
                if wd != 0:
                    if self.decoupled: p = p * f32(1 - lr * wd)
                    elif self.formula == "2x_nofma": g = g + p * f32(wd)
                    else: g = fma32(p, f32(wd), g)
                m, v = self.m[i], self.v[i]
                if self.formula == "2x":
                    m = fma32(W1, g - m, m) if abs(W1) < 0.5 else fma32(W1 - f32(1), g - m, g)
                elif self.formula == "2x_nofma":   # ATEN_CPU_CAPABILITY=default (CPU without AVX2)
                    m = (m + W1 * (g - m)) if abs(W1) < 0.5 else (g - (g - m) * (f32(1) - W1))
                else:
                    m = fma32(g, A1, m * B1)
                if self.formula == "2x_nofma":
                    v = v * B2 + (A2 * g) * g
                else:
                    v = fma32(A2 * g, g, v * B2)
                if self.amsgrad:
                    self.vmax[i] = np.maximum(self.vmax[i], v); s = self.vmax[i]
                else:
                    s = v
                d = self.sqrt(s) / BC2S + E
                p = p + (NSS * m) / d
                self.m[i], self.v[i] = m.astype(f32), v.astype(f32)
                out.append(p.astype(f32))
        return out

# ---------------------------------------------------------------------------------------------
def run_case(torch, rng, shapes, hp, nsteps, formula, sqrt, impl):
    lr, betas, eps, wd, amsgrad, maximize, decoupled = hp
    init = [rng.standard_normal(s).astype(f32) for s in shapes]
    tparams = [torch.nn.Parameter(torch.from_numpy(x.copy())) for x in init]
    kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=wd, amsgrad=amsgrad)
    if int(torch.__version__.split(".")[0]) >= 2 or maximize:
        kw["maximize"] = maximize
    if impl == "foreach": kw["foreach"] = True
    if impl == "fused": kw["fused"] = True
    if impl == "single" and int(torch.__version__.split(".")[0]) >= 2: kw["foreach"] = False
    opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)(tparams, **kw)
    emu = EmuAdam(shapes, lr, betas, eps, wd, amsgrad, maximize, decoupled, formula, sqrt)
    eparams = [x.copy() for x in init]
    mism = dict(p=0, m=0, v=0, vmax=0); total = 0; first_bad = None
    for k in range(nsteps):
        scale = 10.0 ** rng.uniform(-4, 1)
        grads = [(rng.standard_normal(s) * scale).astype(f32) for s in shapes]
        for g in grads:   # some exact zeros and sign flips
            g.reshape(-1)[rng.random(g.size) < 0.02] = 0
        for tp, g in zip(tparams, grads): tp.grad = torch.from_numpy(g.copy())
        opt.step()
        eparams = emu.step(eparams, grads)
        for i, tp in enumerate(tparams):
            st = opt.state[tp]
            pairs = [("p", tp.detach().numpy(), eparams[i]), ("m", st["exp_avg"].numpy(), emu.m[i]),
                     ("v", st["exp_avg_sq"].numpy(), emu.v[i])]
            if amsgrad: pairs.append(("vmax", st["max_exp_avg_sq"].numpy(), emu.vmax[i]))
            for name, a, b in pairs:
                nb = int((a.view(np.uint32) != b.view(np.uint32)).sum()); mism[name] += nb
                if nb and first_bad is None: first_bad = (k + 1, i, name)
            # resync the emulation to torch so that one mismatch is counted once, not propagated
            eparams[i] = tp.detach().numpy().copy(); emu.m[i] = st["exp_avg"].numpy().copy()
            emu.v[i] = st["exp_avg_sq"].numpy().copy()
            if amsgrad: emu.vmax[i] = st["max_exp_avg_sq"].numpy().copy()
            total += tp.numel()
    return mism, total, first_bad

def main():
    import torch
    ap = argparse.ArgumentParser()
    major = int(torch.__version__.split(".")[0])
    ap.add_argument("--formula", default="2x" if major >= 2 else "113")
    ap.add_argument("--sqrt", default="mkl_ex" if torch.backends.mkl.is_available() else "exact")
    ap.add_argument("--impl", default="single")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cases", type=int, default=0, help="0: full grid")
    a = ap.parse_args()
    sqrt = sqrt_mkl_ex if a.sqrt == "mkl_ex" else sqrt_exact
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}  formula={a.formula} sqrt={a.sqrt} impl={a.impl} steps={a.steps}")
    rng = np.random.default_rng(2024)
    shapes = [(1,), (7,), (33,), (1000,), (4097,), (3, 5), (64, 65)]
    hps = []
    for decoupled in (True, False):
        for amsgrad in (False, True):
            for maximize in (False, True):
                for lr, betas, eps, wd in [(1e-3, (0.9, 0.999), 1e-8, 0.01), (3e-4, (0.9, 0.95), 1e-6, 0.1),
                                           (0.1, (0.8, 0.99), 1e-3, 0.0), (1e-2, (0.3, 0.5), 1e-8, 0.5),
                                           (1e-3, (0.5, 0.999), 1e-8, 1e-4), (5e-4, (0.0, 0.0), 1e-8, 0.01)]:
                    hps.append((lr, betas, eps, wd, amsgrad, maximize, decoupled))
    if a.cases: hps = hps[:a.cases]
    tot_m = dict(p=0, m=0, v=0, vmax=0); tot = 0
    for hp in hps:
        mism, n, fb = run_case(torch, rng, shapes, hp, a.steps, a.formula, sqrt, a.impl)
        tot += n
        for k in tot_m: tot_m[k] += mism[k]
        lr, betas, eps, wd, ams, mx, dec = hp
        flag = "" if not any(mism.values()) else f"  MISMATCH first at (step, tensor, field)={fb}"
        print(f"{'AdamW' if dec else 'Adam ':5s} lr={lr:<6g} betas={betas} eps={eps:<6g} wd={wd:<6g} amsgrad={ams:d} maximize={mx:d}: "
              f"p {mism['p']}  m {mism['m']}  v {mism['v']}  vmax {mism['vmax']}{flag}")
    print(f"TOTAL over {len(hps)} configs x {a.steps} steps, {tot} element-updates: mismatches {tot_m}")

if __name__ == "__main__":
    main()
