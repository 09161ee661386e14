"""ZeroOptimizer with the model on a GPU (suite `gpu`): device buffers shared with zerod's CUDA
backend through CUDA IPC, torch's streams ordered with zerod's by libzerod's IPC events; and the
torch CUDA conformance matrix.

Against zerod's CPU path (TorchCudaTest.test_fp32/test_bf16): the same training through a second
ZeroOptimizer whose model is on the CPU, on a zerod running its CPU backend, fed the very gradients
the GPU model computed. Every parameter must be bitwise equal after every step: fp32, and bf16
params with bf16 grads. Every third step runs on a side stream (torch.cuda.stream): step()'s
request then names the side stream, while the hooks' scatters name the stream autograd accumulates
on. A spin kernel ahead of backward and of step() keeps the GPU busy while the host sends the
requests, so a request that zerod ran without waiting for the stream, or parameters read before
zerod's update, fail the comparison instead of losing a race to the small MLP's microsecond
kernels. Also: the errors for a model on the wrong kind of memory, and a model that stays usable
after close().

Against torch on CPU (test_against_torch_adamw_on_cpu): zerod's CUDA update compared with
torch.optim.AdamW stepping a CPU copy of the model with the same gradients, bit for bit after
every step, plain, with amsgrad, with maximize and with clipping, where a CPU AdamW computes
zerod's formula with a correctly rounded sqrt (Debian's 1.13 default; fused=True on 2.x). Clipping
on CUDA uses zerod's double norm: its coefficient must be within COEF_ULPS of clip_grad_norm_'s,
and the update bitwise given it. The same steps run first against zerod's CPU backend told to
follow the CUDA formula (sqrt_mode exact), on every machine.

The matrix (TorchCudaTest.test_matrix; MatrixOnCpuTest runs the same code on CPU tensors against
zerod's CPU backend on every machine, so that the machinery is known to work before a GPU runs
it). Rows: param dtype (fp32; bf16 params and grads, where torch steps fp32 master weights fed the
bf16 gradients and its parameters are compared rounded to bf16, as zerod writes them) x
torch.optim.AdamW / Adam x option (plain; weight decay; amsgrad; maximize; clipping with
clip_grad_norm_; two parameter groups with different lr, betas, eps and weight decay, one with
beta1 0.3, lerp's second form); 12 steps each with a LambdaLR schedule, a 7-element tensor among
the parameters (shorter than any vector: the kernels' tails). Columns: zerod against torch's
single-tensor (foreach=False), foreach=True and fused=True implementations on the same device,
zerod's CUDA path against its CPU path (the same formula; also fp16 gradients with zerod's loss
scaler and an overflow, where torch has no equivalent), and torch's foreach and fused against its
own single-tensor path. A cell says "bitwise" or the largest distance in ULPs of the parameter
dtype and the first step that differed. It fails only where zerod claims bit-identity: the
CUDA-vs-CPU column, and a torch implementation that ZeroOptimizer accepts for the device (an
implementation it refuses is compared with its default formula and reported, "refused"). The
matrix is printed with the prefix "matrix: " and appended to $ZEROD_TORCH_MATRIX when set.

Predictions for torch 2.x on CUDA, from its sources (optim/adam.py, aten/src/ATen/native/cuda:
Lerp.h, PointwiseOpsKernel.cu, BinaryDivTrueKernel.cu, ForeachPointwiseOp.cu,
ForeachBinaryOpScalarList.cu, fused_adam_utils.cuh). torch is built with nvcc's default
-fmad=true, so `a + b * c` in its kernels is one FMA, while a chain of separate kernels rounds
after every op. The three paths round differently from each other and from torch's CPU path, and
zerod carries each as an update variant (kernels/adam.h has the exact formulas; emulate_cuda_step
emulates them), which ZeroOptimizer picks from foreach/fused as torch would:
- single-tensor (foreach=False; update "torch2_cuda"): m by lerp_ (fma(w, g - m, m), or
  fma(w - 1, g - m, g) for w >= 0.5: the CPU torch2 form); v = fma(1 - beta2, g * g, v * beta2)
  (addcmul_ is `a + alpha * (b * c)`, g*g rounded first); d = sqrt(v) * fp32(1 / bc2s) + eps
  (division by a CPU scalar is a multiplication by its fp32 reciprocal); p = fma(-step_size,
  m / d, p) (addcdiv_ is `a + alpha * (b / c)`).
- foreach=True (torch's default on CUDA; "torch2_cuda_foreach"): the same, except that
  _foreach_div_ by the list of bias_correction2_sqrt divides truly: d = sqrt(v) / bc2s + eps.
  Predicted: foreach~single differs (d) in a few elements from step 1.
- fused=True ("torch2_cuda_fused"): one kernel whose hyperparameters are doubles: m = beta1 * m +
  (1 - beta1) * g and v = beta2 * v + (1 - beta2) * g * g in double (one product contracted into
  a double fma: which one is nvcc's choice, assumed the first; the probe names it) rounded once to
  fp32; AdamW's decay p - lr * wd * p, Adam's g + p * wd in double (contracted); bias corrections
  1 - pow(beta, step) in double on the device, handed to the math as fp32; d = sqrtf(v) / bc2s
  with + eps in double; p -= step_size * m / d in fp32, step_size = fp32(lr / fp32(bc1)).
- Adam (L2): grad.add(param, alpha=wd) is fma(wd, p, g) in the single/foreach paths. amsgrad's
  torch.maximum and maximize's negation are exact.
- Every zerod~single/foreach/fused cell is claimed (strict) on CUDA with torch 2.x; zerod~cpu
  compares zerod's CUDA kernel with its CPU reference for every formula of the row.
- On CPU (MatrixOnCpuTest, torch 1.13 here): single and foreach bitwise with zerod (strict), where
  torch's sqrt is correctly rounded; fused=True (2.x) with the 7-element tensor is refused.
- Not reproduced, expected never to show: CUDA's double pow (within 2 ULP) against the host's in
  the fused bias corrections, which differ only when 1 - pow lies that close to an fp32 rounding
  boundary.
A prediction that fails says where the next GPU run's formula variants must change. To say
which formula each torch path does compute, the matrix ends with a probe (formula_probe): one step
of each implementation from a known state (65,536 fp32 elements at step 6), whose new m, v and p
are compared, stage by stage, with emulations of the candidate formulas above (fp32 operations and
single-rounding fmas emulated exactly in float64 on the CPU); it names the candidates that match
every element. Its sqrt is the correctly rounded one (CUDA's). On Debian's torch 1.13 CPU it
names zerod's formula at every stage; on PyPI's 2.11 CPU, zerod's torch2 formula (lerp) for m and
v (its p there differs where MKL's sqrt does).

The GPU tests are skipped where torch has no CUDA or no GPU is visible (Debian's python3-torch is
CPU-only): the file then exits 77 after the CPU runs, or 1 if one failed. Under meson the
interpreter is $ZEROD_GPU_PYTHON when set (run_gpu.sh), else /usr/bin/python3.
"""


from __future__ import annotations

import copy
import math
import os
import struct
import unittest
from fractions import Fraction
from typing import Any, Dict, List, Optional, Tuple

import common

torch = common.require_torch()
NO_GPU = None if torch.cuda.is_available() else (
    "torch sees no CUDA GPU (torch.cuda.is_available() is False; Debian's python3-torch is "
    "built without CUDA)")

import models  # noqa: E402
import zerod  # noqa: E402
import zerod.testing  # noqa: E402
from zerod.torch import ZeroOptimizer  # noqa: E402

STEPS = 60
LR = 3e-3
BUCKET_ELEMS = "2048"  # the MLP spans several buckets: per-bucket scatter from the hooks
SPIN_CYCLES = 20_000_000  # torch.cuda._sleep: about 10 ms at 2 GHz
# zerod's double clip norm against clip_grad_norm_'s fp32 one: the coefficients at most this many
# fp32 ULP apart (the documented maximum; test_optimizer.DOUBLE_NORM_ULPS says why)
COEF_ULPS = 4


def f32_bits(x: float) -> int:
    """x rounded to fp32, as its bits read as a signed integer (ordered like the floats >= 0)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def grads_of(opt: ZeroOptimizer) -> List[torch.Tensor]:
    """The optimizer's gradients as they stand in its grad buffer (views), in parameter order."""
    return list(opt._gviews)


def reference_impl(tc: unittest.TestCase) -> Dict[str, Any]:
    """torch.optim.AdamW's implementation choice that computes zerod's CUDA formula on CPU
    tensors here (module docstring); skips the test where none does."""
    import zerod.torch as zt

    sqrt_mode, why = zt._probe_sqrt()
    if sqrt_mode == "exact" and not why:
        return {"foreach": False}  # torch's default formula, and its sqrt is exact here
    if int(torch.__version__.split(".")[0]) >= 2:
        return {"fused": True}  # the same formula with a correctly rounded sqrt
    tc.skipTest(f"torch {torch.__version__} on this CPU takes its sqrt from MKL ({sqrt_mode}"
                f"{': ' + why if why else ''}) and has no fused=True: no CPU AdamW computes "
                f"zerod's CUDA formula here")
    return {}


def against_torch(tc: unittest.TestCase, daemon: Any, dev: torch.device) -> None:
    """Plain, amsgrad, maximize and clipped runs of steps_against_torch."""
    impl = reference_impl(tc)
    configs = [("plain", {}, 0.0), ("amsgrad", {"amsgrad": True}, 0.0),
               ("maximize", {"maximize": True}, 0.0), ("clipped", {}, 0.05)]
    for name, hp, max_norm in configs:
        with tc.subTest(config=name):
            steps_against_torch(tc, daemon, dev, name, hp, max_norm, impl)


def steps_against_torch(tc: unittest.TestCase, daemon: Any, dev: torch.device, name: str,
                        hp: Dict[str, Any], max_norm: float, impl: Dict[str, Any]) -> None:
    """6 steps of zerod (the model on dev, on daemon) against torch.optim.AdamW(**hp, **impl) on
    a CPU copy fed the same gradients: every parameter bitwise equal after every step. zerod
    follows torch's CPU formula with an exact sqrt (update named: on CUDA ZeroOptimizer would
    pick torch's CUDA formula) and the double clip norm, on either backend."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(),
                                torch.nn.Linear(48, 16))  # every tensor 16+ elements
    ref = copy.deepcopy(model)  # stays on the CPU
    model = model.to(dev)
    named = [(f"{name}.{n}", p) for n, p in model.named_parameters()]
    cpu_formula = "torch2" if int(torch.__version__.split(".")[0]) >= 2 else "torch113"
    opt = ZeroOptimizer(named, lr=1e-2, weight_decay=0.1, max_grad_norm=max_norm,
                        socket=daemon.socket, replace=True, update=cpu_formula,
                        sqrt_mode="exact", **hp)
    opt._clip_norm = "double"  # the CUDA backend's norm, whatever order the package names
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, **hp, **impl)
    try:
        tc.assertEqual(opt.info.backend, dev.type)
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(32, 24, generator=g), torch.randn(32, 16, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev))
            if hp.get("amsgrad"):
                loss = loss * 0.5 ** step  # shrinking: the max stays above exp_avg_sq
            loss.backward()
            grads = [gr.to("cpu") for gr in grads_of(opt)]  # before the step
            for p, gr in zip(ref.parameters(), grads):
                p.grad = gr.clone()
            opt.step()
            where = f"{name}, step {step + 1}"
            if max_norm:
                r = opt.last_result
                total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
                coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
                tc.assertLess(coef, 1.0, f"{where}: max_norm {max_norm} should clip")
                ulps = abs(f32_bits(r.clip_coef) - f32_bits(coef))
                tc.assertLessEqual(ulps, COEF_ULPS, f"{where}: zerod's coefficient "
                                   f"{r.clip_coef!r}, clip_grad_norm_'s {coef!r}")
                with torch.no_grad():  # the update given zerod's coefficient
                    for p, gr in zip(ref.parameters(), grads):
                        p.grad.copy_(gr).mul_(r.clip_coef)
            ropt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            got = [(n, p.detach().to("cpu")) for n, p in model.named_parameters()]
            common.assert_params_equal(tc, got, list(ref.named_parameters()),
                                       f"{where} against torch.optim.AdamW({impl}) on CPU")
    finally:
        opt.close()


# ---- the conformance matrix ------------------------------------------------------------------

MATRIX_STEPS = 12
MATRIX_SHAPES = [("l1.weight", (48, 24)), ("l1.bias", (48,)), ("l2.weight", (7, 48)),
                 ("l2.bias", (7,))]  # a 7-element tensor: shorter than any vector (tails)
MATRIX_LR = 1e-2
MATRIX_MAX_NORM = 0.05  # below the gradients' norm at every step: every step clips
# (name, hyperparameters of both optimizers, max_norm, two parameter groups)
MATRIX_OPTIONS = [
    ("plain", {"weight_decay": 0.0}, 0.0, False),
    ("wd", {"weight_decay": 0.1}, 0.0, False),
    ("amsgrad", {"weight_decay": 0.1, "amsgrad": True}, 0.0, False),
    ("maximize", {"weight_decay": 0.1, "maximize": True}, 0.0, False),
    ("clip", {"weight_decay": 0.1}, MATRIX_MAX_NORM, False),
    ("groups", {"weight_decay": 0.1}, 0.0, True),  # group 1: beta1 0.3 (lerp's second form)
]
IMPLS = [("single", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})]


def matrix_lambda(step: int) -> float:
    """The matrix's lr schedule (LambdaLR): 4 steps of warm-up, then decay."""
    return (step + 1) / 4 if step < 4 else 0.85 ** (step - 3)


def matrix_grads(step: int) -> List[torch.Tensor]:
    """Step's fp32 gradients: a wide dynamic range per element, shrinking from step to step (so
    that amsgrad's maximum differs from exp_avg_sq), the same on every machine."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _, shape in MATRIX_SHAPES:
        x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))
        out.append(x * 0.7 ** step)
    return out


def matrix_init() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=g) * 0.3 for _, shape in MATRIX_SHAPES]


def matrix_groups(tensors: List[Any], named: bool, hp: Dict[str, Any],
                  two: bool) -> List[Dict[str, Any]]:
    """Parameter groups over the matrix's tensors: one, or two with different hyperparameters."""
    items = [(n, t) for (n, _), t in zip(MATRIX_SHAPES, tensors)] if named else list(tensors)
    base = dict(hp)
    if not two:
        return [dict(base, params=items)]
    other = dict(base, lr=MATRIX_LR * 3, betas=(0.3, 0.95), eps=1e-6, weight_decay=0.0)
    return [dict(base, params=items[:2]), dict(other, params=items[2:])]


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns as int64 ordered like the values (-0 and +0 both 0): ULP distances are
    differences of these."""
    if t.dtype == torch.float32:
        i = t.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    i = t.contiguous().view(torch.int16).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def max_ulps(a: List[torch.Tensor], b: List[torch.Tensor]) -> int:
    return max(int((ordered_bits(x) - ordered_bits(y)).abs().max()) for x, y in zip(a, b))


class Run:
    """One trajectory: the parameters after every step (CPU copies in the compared dtype), and
    zerod's clip coefficients and step results where zerod ran it."""

    def __init__(self) -> None:
        self.params: List[List[torch.Tensor]] = []
        self.coefs: List[float] = []
        self.applied: List[bool] = []
        self.scales: List[float] = []
        self.error = ""


def compare(a: Run, b: Run) -> Tuple[int, int]:
    """(max ULPs over every step and parameter, the first step that differed: 0 if none)."""
    worst, first = 0, 0
    for s, (x, y) in enumerate(zip(a.params, b.params)):
        u = max_ulps(x, y)
        if u and not first:
            first = s + 1
        worst = max(worst, u)
    return worst, first


def cell_text(result: Optional[Tuple[int, int]], claimed: bool, note: str = "") -> str:
    """ "bitwise", or "<max ULPs>u@<first step>"; "*" where zerod claims bit-identity, "!" where
    that claim failed; note (n/a, refused) where nothing was compared."""
    if result is None:
        return note or "-"
    ulps, first = result
    text = "bitwise" if not ulps else f"{ulps}u@{first}"
    if claimed:
        text += "!" if ulps else "*"
    return text


def zerod_run(daemon: Any, dev: torch.device, dtype: torch.dtype, hp: Dict[str, Any],
              max_norm: float, two: bool, impl: Dict[str, Any], formula: Optional[List[Any]] = None,
              grad_dtype: Optional[torch.dtype] = None, loss_scaler: Any = None,
              overflow_step: int = -1) -> Tuple[Run, List[Tuple[str, str]]]:
    """MATRIX_STEPS steps of ZeroOptimizer on dev (zerod on daemon) with the matrix's gradients
    (in grad_dtype, multiplied by the loss scale when there is a scaler; +inf in one element at
    overflow_step), and the groups' (update, sqrt_mode) it followed. impl: foreach/fused as a
    torch user passes them (ValueError where zerod refuses them); formula: force each group's
    (update, sqrt_mode) instead (the CPU reference of a CUDA run)."""
    params = [torch.nn.Parameter(t.clone().to(dtype).to(dev)) for t in matrix_init()]
    groups = matrix_groups(params, True, hp, two)
    if formula:
        for g, (update, sqrt_mode) in zip(groups, formula):
            g.update(update=update, sqrt_mode=sqrt_mode)
    kw = dict(impl)
    opt = ZeroOptimizer(groups, lr=MATRIX_LR, max_grad_norm=max_norm, socket=daemon.socket,
                        replace=True, overlap=False, grad_dtype=grad_dtype,
                        loss_scaler=loss_scaler, **kw)
    run = Run()
    try:
        opt._clip_norm = "double"  # zerod's own norm on both backends: the coefficient is compared
        chosen = [(g["update"], g["sqrt_mode"]) for g in opt.param_groups]
        sched = torch.optim.lr_scheduler.LambdaLR(opt, matrix_lambda)
        for step in range(MATRIX_STEPS):
            grads = matrix_grads(step)
            opt.zero_grad()
            with torch.no_grad():
                for gv, g in zip(opt._gviews, grads):
                    if loss_scaler is not None:
                        g = g * opt.loss_scale
                    if step == overflow_step:
                        g = g.clone()
                        g.view(-1)[0] = float("inf")
                    gv.copy_(g.to(gv.dtype).to(dev))
            opt.step()
            sched.step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            r = opt.last_result
            run.coefs.append(r.clip_coef)
            run.applied.append(r.applied)
            run.scales.append(r.loss_scale)
            run.params.append([p.detach().to("cpu").clone() for p in params])
    finally:
        opt.close()
    return run, chosen


def torch_run(dev: torch.device, dtype: torch.dtype, optimizer: str, hp: Dict[str, Any],
              max_norm: float, two: bool, impl: Dict[str, Any],
              coefs: List[float]) -> Tuple[Run, int]:
    """The same steps through torch.optim.AdamW/Adam(**impl) on dev, on fp32 master weights (the
    gradients rounded to dtype first; the parameters compared rounded to dtype, as zerod writes
    them). With max_norm the gradients are multiplied by zerod's coefficient of the step (coefs);
    returns the run and the largest distance, in fp32 ULPs, between clip_grad_norm_'s
    coefficient and zerod's."""
    params = [torch.nn.Parameter(t.clone().to(dtype).float().to(dev)) for t in matrix_init()]
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    hp = {k: v for k, v in hp.items() if k != "optimizer"}
    opt = cls(matrix_groups(params, False, hp, two), lr=MATRIX_LR, **impl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, matrix_lambda)
    run, coef_ulps = Run(), 0
    for step in range(MATRIX_STEPS):
        for p, g in zip(params, matrix_grads(step)):
            p.grad = g.to(dtype).float().to(dev)
        if max_norm:
            total = torch.nn.utils.clip_grad_norm_(params, max_norm)  # scales .grad itself
            coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
            coef_ulps = max(coef_ulps, abs(f32_bits(coef) - f32_bits(coefs[step])))
            with torch.no_grad():  # the update given zerod's coefficient
                for p, g in zip(params, matrix_grads(step)):
                    p.grad.copy_(g.to(dtype).float().to(dev)).mul_(coefs[step])
        opt.step()
        sched.step()
        run.params.append([p.detach().to("cpu").to(dtype).clone() for p in params])
    return run, coef_ulps


class Matrix:
    """The cells of one machine's matrix: rows (dtype, optimizer, option), columns: zerod against
    each torch implementation, zerod's CUDA path against its CPU path, and torch's
    implementations against its single-tensor one."""

    COLUMNS = ["zerod~cpu", "zerod~single", "zerod~foreach", "zerod~fused", "foreach~single",
               "fused~single"]

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.rows: List[Tuple[str, str, str]] = []
        self.cells: Dict[Tuple[Tuple[str, str, str], str], str] = {}
        self.failures: List[str] = []
        self.notes: List[str] = []
        self.refused: set = set()  # implementations ZeroOptimizer refused (noted once)

    def put(self, row: Tuple[str, str, str], column: str, result: Optional[Tuple[int, int]],
            claimed: bool, note: str = "") -> None:
        if row not in self.rows:
            self.rows.append(row)
        self.cells[(row, column)] = cell_text(result, claimed, note)
        if claimed and result is not None and result[0]:
            self.failures.append(f"{'/'.join(row)} {column}: zerod claims bit-identity, measured "
                                 f"{result[0]} ULPs from step {result[1]}")

    def table(self) -> str:
        cuda = self.dev.type == "cuda"
        where = (f"CUDA {torch.cuda.get_device_name(self.dev)}" if cuda else "CPU")
        head = (f"torch {torch.__version__} on {where}, {MATRIX_STEPS} steps with LambdaLR; "
                f"cell: bitwise | <max ULPs>u@<first differing step>; * zerod claims "
                f"bit-identity and holds it, ! claimed and broken; refused: ZeroOptimizer "
                f"refuses that implementation (compared with its default formula)")
        widths = [9, 5, 8] + [17 if c.startswith("zerod") else 14 for c in self.COLUMNS]
        lines = [head, "  ".join(h.ljust(w) for h, w in
                                 zip(["dtype", "optim", "option"] + self.COLUMNS, widths))]
        for row in self.rows:
            vals = list(row) + [self.cells.get((row, c), "-") for c in self.COLUMNS]
            lines.append("  ".join(v.ljust(w) for v, w in zip(vals, widths)))
        lines += self.notes
        return "\n".join("matrix: " + ln for ln in lines)


def matrix_row(m: Matrix, row: Tuple[str, str, str], daemon: Any, ref_daemon: Any,
               dev: torch.device, dtype: torch.dtype, optimizer: str, hp0: Dict[str, Any],
               max_norm: float, two: bool, has_fused: bool, claim_unfused: bool) -> None:
    """One row of the matrix: zerod as each torch implementation would have it, torch's three
    implementations, and zerod's CPU path (ref_daemon) on the same formula."""
    hp = dict(hp0, optimizer=optimizer)
    druns: Dict[str, Tuple[Run, List[Tuple[str, str]], bool, str]] = {}
    for iname, impl in IMPLS:
        if iname == "fused" and not has_fused:
            continue
        claimed, why = iname == "fused" or claim_unfused, ""
        try:
            run, chosen = zerod_run(daemon, dev, dtype, hp, max_norm, two, impl)
        except ValueError as e:
            claimed, why = False, "refused"
            if iname not in m.refused:  # the same words in every row: once
                m.refused.add(iname)
                m.notes.append(f"{iname}: ZeroOptimizer refuses it on {dev.type} "
                               f"({str(e).split(':', 1)[-1].strip()[:160]})")
            run, chosen = zerod_run(daemon, dev, dtype, hp, max_norm, two, {})
        druns[iname] = (run, chosen, claimed, why)
    truns: Dict[str, Run] = {}
    for iname, impl in IMPLS:
        if iname not in druns:
            m.put(row, "zerod~" + iname, None, False, "n/a")
            continue
        zrun, chosen, claimed, why = druns[iname]
        try:
            trun, coef_ulps = torch_run(dev, dtype, optimizer, hp0, max_norm, two, impl,
                                        zrun.coefs)
        except Exception as e:  # torch's own implementation failed: say so, go on
            m.put(row, "zerod~" + iname, None, False, "torch-error")
            m.notes.append(f"{'/'.join(row)} {iname}: torch failed: {type(e).__name__}: "
                           f"{str(e)[:160]}")
            if claimed:
                m.failures.append(f"{'/'.join(row)} {iname}: torch failed ({e})")
            continue
        truns[iname] = trun
        res = compare(zrun, trun)
        m.put(row, "zerod~" + iname, res, claimed)
        if why:
            m.cells[(row, "zerod~" + iname)] += " (refused)"
        if max_norm and coef_ulps > COEF_ULPS:
            m.failures.append(f"{'/'.join(row)} {iname}: clip coefficient "
                              f"{coef_ulps} ULPs from clip_grad_norm_'s")
        if max_norm and iname == "single":
            m.notes.append(f"{'/'.join(row)}: clip coefficient within {coef_ulps} "
                           f"fp32 ULPs of clip_grad_norm_'s (at most {COEF_ULPS})")
    for iname in ("foreach", "fused"):
        if iname in truns and "single" in truns:
            m.put(row, f"{iname}~single", compare(truns[iname], truns["single"]), False)
    if ref_daemon is not None:  # zerod's CUDA path against its CPU path, same formulas
        # every formula zerod ran (one per torch implementation it accepts): the worst cell
        worst: Optional[Tuple[int, int]] = None
        seen: List[Any] = []
        try:
            for zrun, chosen, _, _ in druns.values():
                if chosen in seen:
                    continue
                seen.append(chosen)
                ref, _ = zerod_run(ref_daemon, torch.device("cpu"), dtype, hp, max_norm,
                                   two, {}, formula=chosen)
                res = compare(zrun, ref)
                if worst is None or res[0] > worst[0]:
                    worst = res
            m.put(row, "zerod~cpu", worst, True)
        except (ValueError, zerod.ZerodError) as e:
            m.put(row, "zerod~cpu", None, False, "refused")
            m.notes.append(f"{'/'.join(row)} zerod~cpu: {e}")


def run_matrix(tc: unittest.TestCase, daemon: Any, ref_daemon: Any, dev: torch.device,
               claim_unfused: bool = True) -> Matrix:
    """Every cell of the matrix on dev (module docstring, "The matrix"): zerod on daemon (its
    backend matching dev), its CPU path on ref_daemon (None: no such column), torch on dev.
    claim_unfused False: the single-tensor and foreach cells are reported, never claimed (torch's
    CPU sqrt is none of zerod's)."""
    m = Matrix(dev)
    has_fused = int(torch.__version__.split(".")[0]) >= 2
    for dtype, dname in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for optimizer in ("adamw", "adam"):
            for name, hp0, max_norm, two in MATRIX_OPTIONS:
                row = (dname, optimizer, name)
                try:
                    matrix_row(m, row, daemon, ref_daemon, dev, dtype, optimizer, hp0, max_norm,
                               two, has_fused, claim_unfused)
                except Exception as e:  # a broken cell must not hide the others
                    m.put(row, "zerod~single", None, False, "error")
                    m.failures.append(f"{'/'.join(row)}: {type(e).__name__}: {str(e)[:300]}")
    if ref_daemon is not None:
        for dtype, dname in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            row = (dname + "/f16g", "adamw", "scaler")
            scaler = {"initial_scale": 2.0 ** 16, "growth_interval": 3, "hysteresis": 1}
            args = (dtype, {"weight_decay": 0.1}, 0.0, False)
            kw = dict(grad_dtype=torch.float16, loss_scaler=scaler, overflow_step=4)
            try:
                cu, chosen = zerod_run(daemon, dev, *args, {}, **kw)
                ref, _ = zerod_run(ref_daemon, torch.device("cpu"), *args, {}, formula=chosen,
                                   **kw)
            except (ValueError, zerod.ZerodError) as e:
                m.put(row, "zerod~cpu", None, False, "refused")
                m.notes.append(f"{'/'.join(row)}: {e}")
                continue
            except Exception as e:  # a broken cell must not hide the others
                m.put(row, "zerod~cpu", None, False, "error")
                m.failures.append(f"{'/'.join(row)}: {type(e).__name__}: {str(e)[:300]}")
                continue
            m.put(row, "zerod~cpu", compare(cu, ref), True)
            if (cu.applied, cu.scales) != (ref.applied, ref.scales):
                m.failures.append(f"{'/'.join(row)}: loss scaler diverged: CUDA applied "
                                  f"{cu.applied} scales {cu.scales}, CPU {ref.applied} "
                                  f"{ref.scales}")
            m.notes.append(f"{'/'.join(row)}: steps applied {sum(cu.applied)} of "
                           f"{MATRIX_STEPS}, scales {cu.scales[0]:g} -> {cu.scales[-1]:g}")
    try:  # which formula each torch path computes, stage by stage (reported, never failed)
        m.notes += formula_probe(dev)
    except Exception as e:
        m.notes.append(f"probe: failed: {type(e).__name__}: {e}"[:200])
    return m


# ---- the formula probe -----------------------------------------------------------------------
# One step of each torch implementation from a known state (step 6, 65,536 fp32 elements),
# compared stage by stage with emulations of candidate formulas (module docstring, predictions):
# m and v from the inputs, p from torch's own new m and v, so that each stage is judged alone.
# Emulated on the CPU in float64: one fp32 operation is its float64 result rounded to fp32
# (exact for + - * / sqrt of fp32 inputs), an fp32 fma is rounded once (fma32), and the fused
# kernel's double arithmetic is float64 arithmetic.

PROBE_N = 1 << 16
PROBE_T = 6  # the step the probe takes
PROBE_HP = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def f32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> fp32, round to nearest even, back in float64."""
    return x.to(torch.float32).to(torch.float64)


def c32(x: float) -> float:
    """A Python float rounded to fp32 (torch's scalar arguments of fp32 kernels)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def fma32(a: Any, b: Any, c: Any) -> torch.Tensor:
    """fp32 fma(a, b, c), rounded once, of fp32 values held in float64 (tensors or floats):
    a * b is exact in float64; the float64 sum's rounding error (two-sum) settles the one case
    where rounding twice differs, a float64 sum exactly halfway between two floats."""
    a, b, c = (x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)
               for x in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    r = s.to(torch.float32)
    rd = r.to(torch.float64)
    inf = torch.full_like(r, float("inf"))
    toward = torch.where(s > rd, inf, -inf)
    nb = torch.nextafter(r, toward)
    mid = ((rd + nb.to(torch.float64)) / 2 == s) & (s != rd) & (e != 0)
    up = (e > 0) == (nb.to(torch.float64) > rd)
    return torch.where(mid & up, nb, r).to(torch.float64)


def fma64_f32(a: Any, b: Any, c: Any) -> torch.Tensor:
    """(float)fma(a, b, c) of doubles (tensors or floats, broadcast): a * b + c exact (Fractions),
    rounded to a double once (float(Fraction) rounds correctly), then to fp32."""
    a, b, c = (x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)
               for x in (a, b, c))
    a, b, c = torch.broadcast_tensors(a, b, c)
    out = [float(Fraction(x) * Fraction(y) + Fraction(z))
           for x, y, z in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist(),
                              c.reshape(-1).tolist())]
    return f32(torch.tensor(out, dtype=torch.float64).reshape(a.shape))


def emulate_cuda_step(update: str, optimizer: str, lr: float, betas: Tuple[float, float],
                      eps: float, wd: float, amsgrad: bool, maximize: bool, t: int,
                      st: Dict[str, torch.Tensor], g: torch.Tensor) -> None:
    """One step of torch 2.x's CUDA formula `update` ("torch2_cuda": foreach=False,
    "torch2_cuda_foreach", "torch2_cuda_fused"; module docstring, kernels/adam.h), emulated
    exactly on the CPU in float64 holding fp32 values: st's p, m, v, vmax (float64) updated in
    place with the fp32 gradient g (float64), step number t from 1. The hyperparameters are
    Python floats and the bias corrections computed as torch's Python code (single, foreach) or
    its fused kernel (doubles, handed to the math as fp32) computes them."""
    b1, b2 = betas
    adamw = optimizer == "adamw"
    p, m, v, vmax = st["p"], st["m"], st["v"], st["vmax"]
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    if maximize:
        g = -g
    if update == "torch2_cuda_fused":
        if wd != 0:
            if adamw:
                p = fma64_f32(-(lr * wd), p, p)  # param -= lr * wd * param, contracted
            else:
                g = fma64_f32(p, wd, g)  # grad += param * wd, contracted, rounded to fp32
        m = fma64_f32(b1, m, (1 - b1) * g)  # beta1 * m + (1 - beta1) * g
        v = fma64_f32(b2, v, ((1 - b2) * g) * g)  # beta2 * v + (1 - beta2) * g * g
        s = v
        if amsgrad:
            vmax = torch.where(vmax < v, v, vmax)  # std::max(vmax, v)
            s = vmax
        bc2s, ss = c32(math.sqrt(bc2)), c32(lr / c32(bc1))  # opmath_t bias corrections
        d = f32(f32(torch.sqrt(s)) / bc2s)
        d = f32(d + eps)  # + eps in double
        p = f32(p - f32(f32(ss * m) / d))
    else:
        if wd != 0:
            if adamw:
                p = f32(p * c32(1 - lr * wd))  # mul_
            else:
                g = fma32(c32(wd), p, g)  # add(param, alpha=wd): g + wd * p
        w = c32(1 - b1)  # lerp_'s weight
        x = f32(g - m)
        m = fma32(w, x, m) if abs(w) < 0.5 else fma32(w - 1, x, g)
        v = fma32(c32(1 - b2), f32(g * g), f32(v * c32(b2)))  # mul_, addcmul_
        s = v
        if amsgrad:
            vmax = torch.where(torch.isnan(vmax) | (vmax > v), vmax, v)  # torch.maximum
            s = vmax
        bc2s = c32(bc2 ** 0.5)
        sq = f32(torch.sqrt(s))
        if update == "torch2_cuda":  # div by a CPU scalar: times its fp32 reciprocal
            q = f32(sq * c32(1 / bc2s))
        else:  # _foreach_div_ by a scalar list: true division
            q = f32(sq / bc2s)
        d = f32(q + c32(eps))
        p = fma32(c32(-(lr / bc1)), f32(m / d), p)  # addcdiv_(value=-step_size)
    st.update(p=p, m=m, v=v, vmax=vmax)


def probe_inputs() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    n = PROBE_N
    return {"p": torch.randn(n, generator=g),
            "m": torch.randn(n, generator=g) * 1e-2,
            "v": (torch.randn(n, generator=g) * 1e-2) ** 2 + 1e-12,
            "g": torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g)) * 1e-2}


def probe_torch(dev: torch.device, optimizer: str, impl: Dict[str, Any],
                x: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """torch's (p, m, v) after one step at PROBE_T from the state x, in float64 on the CPU."""
    p = torch.nn.Parameter(x["p"].clone().to(dev))
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    opt = cls([p], **PROBE_HP, **impl)
    p.grad = torch.zeros_like(p)
    opt.step()  # creates the state
    st = opt.state[p]
    with torch.no_grad():
        p.copy_(x["p"].to(dev))
        st["exp_avg"].copy_(x["m"].to(dev))
        st["exp_avg_sq"].copy_(x["v"].to(dev))
        st["step"].fill_(PROBE_T - 1)
    p.grad = x["g"].clone().to(dev)
    opt.step()
    return {"p": p.detach().cpu().double(), "m": st["exp_avg"].cpu().double(),
            "v": st["exp_avg_sq"].cpu().double()}


def probe_candidates(optimizer: str, x: Dict[str, torch.Tensor],
                     t: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, torch.Tensor]]:
    """stage -> candidate -> the emulated result; p's from torch's own new m and v (t)."""
    lr, (b1, b2), eps, wd = (PROBE_HP["lr"], PROBE_HP["betas"], PROBE_HP["eps"],
                             PROBE_HP["weight_decay"])
    p, m, v, g = (x[k].double() for k in ("p", "m", "v", "g"))
    adamw = optimizer == "adamw"
    bc1, bc2 = 1 - b1 ** PROBE_T, 1 - b2 ** PROBE_T
    nss, bc2s = c32(-(lr / bc1)), c32(math.sqrt(bc2))
    w = c32(1 - b1)
    # the gradient after the L2 penalty (Adam): fp32 kernels and zerod, fused's double (its
    # `grad += param * wd` contracted by nvcc into one double fma, or not)
    g32 = g if adamw else fma32(c32(wd), p, g)
    gfu = g if adamw else f32(g + p * wd)
    gfm = g if adamw else fma64_f32(p, wd, g)
    p1 = f32(p * c32(1 - lr * wd)) if adamw else p
    p1fu = f32(p - (lr * wd) * p) if adamw else p
    p1fm = fma64_f32(-(lr * wd), p, p) if adamw else p
    cands: Dict[str, Dict[str, torch.Tensor]] = {"m": {}, "v": {}, "p": {}}
    cands["m"]["lerp (zerod torch2, torch2_cuda*)"] = fma32(w, f32(g32 - m), m)
    cands["m"]["mul+fma (zerod torch113)"] = fma32(g32, c32(1 - b1), f32(m * c32(b1)))
    cands["m"]["double unfused"] = f32(b1 * m + (1 - b1) * gfu)
    cands["m"]["double fma(b1,m,a1*g) (zerod torch2_cuda_fused)"] = fma64_f32(b1, m, (1 - b1) * gfm)
    cands["m"]["double fma(a1,g,b1*m)"] = fma64_f32(1 - b1, gfm, b1 * m)
    a2 = c32(1 - b2)
    cands["v"]["fma(a2*g,g,v*b2) (zerod torch113/torch2)"] = fma32(f32(a2 * g32), g32,
                                                                  f32(v * c32(b2)))
    cands["v"]["fma(a2,g*g,v*b2) (zerod torch2_cuda*)"] = fma32(a2, f32(g32 * g32),
                                                               f32(v * c32(b2)))
    cands["v"]["double unfused"] = f32(b2 * v + ((1 - b2) * gfu) * gfu)
    cands["v"]["double fma(b2,v,a2*g*g) (zerod torch2_cuda_fused)"] = fma64_f32(
        b2, v, ((1 - b2) * gfm) * gfm)
    cands["v"]["double fma(a2*g,g,b2*v)"] = fma64_f32((1 - b2) * gfm, gfm, b2 * v)
    mt, vt = t["m"], t["v"]
    sq = f32(torch.sqrt(vt))
    d_div = f32(f32(sq / bc2s) + c32(eps))
    d_rcp = f32(f32(sq * c32(1 / bc2s)) + c32(eps))
    cands["p"]["p+(nss*m)/d (zerod torch113/torch2)"] = f32(p1 + f32(f32(nss * mt) / d_div))
    cands["p"]["fma(nss,m/d,p), d by reciprocal (zerod torch2_cuda)"] = fma32(
        nss, f32(mt / d_rcp), p1)
    cands["p"]["fma(nss,m/d,p), d by division (zerod torch2_cuda_foreach)"] = fma32(
        nss, f32(mt / d_div), p1)
    for name, bc2s_fu, ss_fu, pd in (
            ("fp32 bias corrections", c32(math.sqrt(c32(1 - b2 ** PROBE_T))),
             c32(lr / c32(1 - b1 ** PROBE_T)), p1fu),
            ("double bias corrections", c32(math.sqrt(bc2)), c32(lr / bc1), p1fu),
            ("bc1 fp32 in ss, bc2s fp32 of double, decay fma (zerod torch2_cuda_fused)",
             c32(math.sqrt(bc2)), c32(lr / c32(bc1)), p1fm)):
        d_fu = f32(f32(sq / bc2s_fu) + eps)
        cands["p"][f"p-(ss*m)/d, {name}"] = f32(pd - f32(f32(ss_fu * mt) / d_fu))
    return cands


def formula_probe(dev: torch.device) -> List[str]:
    """Lines "probe: ..." saying, per torch implementation, optimizer and stage, which candidate
    formulas reproduce torch's result on every element (or how many elements the closest one
    misses)."""
    x = probe_inputs()
    has_fused = int(torch.__version__.split(".")[0]) >= 2
    lines = [f"probe: one step at t={PROBE_T} of {PROBE_N} fp32 elements (torch "
             f"{torch.__version__}, {dev.type}); per stage the candidates that match every "
             f"element, else the closest with its mismatch count"]
    for iname, impl in IMPLS:
        if iname == "fused" and not has_fused:
            continue
        for optimizer in ("adamw", "adam"):
            try:
                t = probe_torch(dev, optimizer, impl, x)
            except Exception as e:  # report, never fail: the matrix judges
                lines.append(f"probe: {iname:<7} {optimizer:<5} torch failed: {e}"[:200])
                continue
            cands = probe_candidates(optimizer, x, t)
            parts = []
            for stage in ("m", "v", "p"):
                miss = {n: int((c != t[stage]).sum()) for n, c in cands[stage].items()}
                exact = [n for n, k in miss.items() if k == 0]
                if exact:
                    parts.append(f"{stage}: {' = '.join(exact)}")
                else:
                    n, k = min(miss.items(), key=lambda kv: kv[1])
                    parts.append(f"{stage}: none (closest {n}: {k} differ)")
            lines.append(f"probe: {iname:<7} {optimizer:<5} " + "; ".join(parts))
    return lines


def report_matrix(tc: unittest.TestCase, m: Matrix) -> None:
    """Prints the matrix (and writes it to $ZEROD_TORCH_MATRIX when set: scripts/gpu_check.sh's
    summary), then fails on the cells where zerod's claim of bit-identity did not hold."""
    text = m.table()
    print("\n" + text, flush=True)
    path = os.environ.get("ZEROD_TORCH_MATRIX")
    if path:
        with open(path, "a") as f:
            f.write(text + "\n")
    if m.failures:
        tc.fail("zerod's claims of bit-identity that did not hold:\n  " + "\n  ".join(m.failures))


class AgainstTorchOnCpuTest(unittest.TestCase):
    """test_against_torch_adamw_on_cpu's logic with zerod's CPU backend following the CUDA
    formula: it runs on every machine, so that the GPU test's own checks are known to pass
    where the formula is right (and to fail where it is not) before a GPU runs them."""

    def test_against_torch_adamw_on_cpu(self) -> None:
        with zerod.testing.LocalZerod(["--backend", "cpu"], log_level="info") as d:
            against_torch(self, d, torch.device("cpu"))


class MatrixOnCpuTest(unittest.TestCase):
    """The matrix's code on CPU tensors against zerod's CPU backend (module docstring): strict
    where ZeroOptimizer claims torch's CPU formula, which needs torch's sqrt to be one zerod
    reproduces (zerod.torch._probe_sqrt) except with fused=True."""

    def test_matrix_on_cpu(self) -> None:
        import zerod.torch as zt

        why = zt._probe_sqrt()[1]
        with zerod.testing.LocalZerod(["--backend", "cpu"], log_level="info") as d:
            m = run_matrix(self, d, None, torch.device("cpu"), claim_unfused=not why)
        if why:  # torch's CPU sqrt is not zerod's: only fused cells can hold
            m.notes.append(f"torch's CPU sqrt matches none of zerod's modes here: single and "
                           f"foreach cells are reported, not claimed ({why[:120]}...)")
        report_matrix(self, m)


CUDA_UPDATES = ("torch2_cuda", "torch2_cuda_foreach", "torch2_cuda_fused")


def emulated_run(update: str, dtype: torch.dtype, hp: Dict[str, Any],
                 two: bool) -> List[List[torch.Tensor]]:
    """zerod_run's trajectory (no clipping, no scaler) by emulate_cuda_step: the parameters
    after every step, rounded to dtype as zerod writes them."""
    opt = hp.get("optimizer", "adamw")
    groups = matrix_groups(list(range(len(MATRIX_SHAPES))), False,
                           {k: v for k, v in hp.items() if k != "optimizer"}, two)
    hps: Dict[int, Dict[str, Any]] = {}
    for g in groups:
        for i in g["params"]:
            hps[i] = g
    states = [{"p": t.to(dtype).double(), "m": torch.zeros(t.shape, dtype=torch.float64),
               "v": torch.zeros(t.shape, dtype=torch.float64),
               "vmax": torch.zeros(t.shape, dtype=torch.float64)} for t in matrix_init()]
    out = []
    for step in range(MATRIX_STEPS):
        for i, (st, g) in enumerate(zip(states, matrix_grads(step))):
            h = hps[i]
            lr = h.get("lr", MATRIX_LR) * matrix_lambda(step)  # LambdaLR's base_lr * lambda
            emulate_cuda_step(update, opt, lr, h.get("betas", (0.9, 0.999)), h.get("eps", 1e-8),
                              h.get("weight_decay", 1e-2), h.get("amsgrad", False),
                              h.get("maximize", False), step + 1, st,
                              g.to(dtype).double())
        out.append([st["p"].float().to(dtype) for st in states])
    return out


class CudaFormulasOnCpuTest(unittest.TestCase):
    """zerod's formulas of torch 2.x's CUDA paths (update torch2_cuda, torch2_cuda_foreach,
    torch2_cuda_fused) on zerod's CPU backend, which computes them with its scalar reference
    (kernels/adam.c), against their exact emulation (emulate_cuda_step, from torch's sources):
    every parameter bitwise after every one of the matrix's 12 steps (LambdaLR, the 7-element
    tensor), fp32 and bf16 params and grads, AdamW and Adam, weight decay, amsgrad, maximize, two
    groups (beta1 0.3: lerp's other form). The CUDA kernel is checked against the same reference
    by tests/gpu/test_adam_cuda.cu; the GPU matrix then checks both against torch itself."""

    def test_reference_equals_emulation(self) -> None:
        options = [o for o in MATRIX_OPTIONS if not o[2]]  # no clipping: its coefficient is zerod's
        with zerod.testing.LocalZerod(["--backend", "cpu"], log_level="info") as d:
            for update in CUDA_UPDATES:
                for dtype, dname in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                    for optimizer in ("adamw", "adam"):
                        for name, hp0, _, two in options:
                            hp = dict(hp0, optimizer=optimizer)
                            where = f"{update} {dname} {optimizer} {name}"
                            with self.subTest(where):
                                run, _ = zerod_run(d, torch.device("cpu"), dtype, hp, 0.0, two,
                                                   {}, formula=[(update, "exact")] * 2)
                                want = emulated_run(update, dtype, hp, two)
                                for s, (got, exp) in enumerate(zip(run.params, want)):
                                    for (n, _), x, y in zip(MATRIX_SHAPES, got, exp):
                                        self.assertTrue(
                                            torch.equal(x.view(torch.int16 if x.dtype ==
                                                               torch.bfloat16 else torch.int32),
                                                        y.view(torch.int16 if y.dtype ==
                                                               torch.bfloat16 else torch.int32)),
                                            f"{where}, step {s + 1}: "
                                            + common.first_difference(n, x, y))


class TorchCudaTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        if NO_GPU:
            raise unittest.SkipTest(NO_GPU)
        cls.gpu_daemon = zerod.testing.LocalZerod(["--backend", "cuda", "--bucket_elems",
                                                   BUCKET_ELEMS], log_level="info")
        cls.cpu_daemon = zerod.testing.LocalZerod(["--backend", "cpu", "--bucket_elems",
                                                   BUCKET_ELEMS], log_level="info")

    @classmethod
    def tearDownClass(cls) -> None:
        cls.gpu_daemon.stop()
        cls.cpu_daemon.stop()

    def train(self, dtype: torch.dtype) -> None:
        with zerod.Client(self.gpu_daemon.socket) as c:  # the rank's GPU, as we number it
            dev = torch.device("cuda", c.cuda_device())
        model = models.make_model("mlp").to(dtype)
        ref = models.make_model("mlp").to(dtype)
        model = model.to(dev)
        opt = ZeroOptimizer(models.param_groups(model, named=True), lr=LR,
                            socket=self.gpu_daemon.socket, replace=True)
        # the CPU reference follows the formula ZeroOptimizer chose for the GPU model (torch's
        # CUDA default, foreach), which the CPU backend computes with its scalar reference
        ref_opt = ZeroOptimizer(models.param_groups(ref, named=True), lr=LR,
                                socket=self.cpu_daemon.socket, replace=True,
                                update=opt.param_groups[0]["update"],
                                sqrt_mode=opt.param_groups[0]["sqrt_mode"])
        self.assertEqual(opt.info.backend, "cuda")
        sched_fn = models.lr_lambda(STEPS)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, sched_fn)
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, sched_fn)
        side = torch.cuda.Stream(dev)
        # The side stream's gradients are accumulated on the default stream, on purpose.
        if hasattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch"):
            torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
        try:
            for p in model.parameters():  # views of device buffers, on the model's GPU
                self.assertEqual(p.device, dev)
            for step in range(STEPS):
                # Every third step runs forward, backward and step on a side stream.
                stream = side if step % 3 == 2 else torch.cuda.current_stream(dev)
                with torch.cuda.stream(stream):
                    x, y = models.batch("mlp", step, 0, dtype)
                    opt.zero_grad()
                    loss = models.loss_fn(model, x.to(dev), y.to(dev))
                    torch.cuda._sleep(SPIN_CYCLES)  # backward's kernels wait; its hooks do not
                    loss.backward()
                    gpu_grads = [g.to("cpu") for g in grads_of(opt)]  # before the step
                    torch.cuda._sleep(SPIN_CYCLES)  # zerod's step waits for it, then we for zerod
                    opt.step()
                    sched.step()
                ref_opt.zero_grad()
                with torch.no_grad():
                    for g_ref, g in zip(grads_of(ref_opt), gpu_grads):
                        g_ref.copy_(g)
                ref_opt.step()
                ref_sched.step()
                torch.cuda.synchronize(dev)
                got = [(n, p.detach().to("cpu")) for n, p in model.named_parameters()]
                common.assert_params_equal(self, got, ref.named_parameters(),
                                           f"{dtype} step {step} (loss {float(loss):.6f})")
            self.assertEqual(opt.step_count, STEPS)
        finally:
            opt.close()
            ref_opt.close()
        # After close() the model holds private copies and still trains on the GPU.
        out = model(models.batch("mlp", 0, 0, dtype)[0].to(dev))
        self.assertTrue(bool(torch.isfinite(out.float()).all()))

    def test_against_torch_adamw_on_cpu(self) -> None:
        with zerod.Client(self.gpu_daemon.socket) as c:
            dev = torch.device("cuda", c.cuda_device())
        against_torch(self, self.gpu_daemon, dev)

    def test_fp32(self) -> None:
        self.train(torch.float32)

    def test_bf16(self) -> None:
        self.train(torch.bfloat16)

    def test_matrix(self) -> None:
        with zerod.Client(self.gpu_daemon.socket) as c:
            dev = torch.device("cuda", c.cuda_device())
        report_matrix(self, run_matrix(self, self.gpu_daemon, self.cpu_daemon, dev))

    def test_cuda_params_need_the_cuda_backend(self) -> None:
        """Unless they offload (by default on a CPU zerod: test_offload_cuda.py); offload=False
        keeps them to device buffers, which a CPU zerod refuses."""
        model = models.make_model("mlp").cuda()
        with self.assertRaises(zerod.ZerodError) as cm:
            ZeroOptimizer(model.parameters(), lr=LR, socket=self.cpu_daemon.socket,
                          offload=False)
        self.assertEqual(cm.exception.name, "ZD_EBACKEND", str(cm.exception))

    def test_cpu_params_need_the_cpu_backend(self) -> None:
        model = models.make_model("mlp")
        with self.assertRaises(zerod.ZerodError) as cm:
            ZeroOptimizer(model.parameters(), lr=LR, socket=self.gpu_daemon.socket,
                          replace=True)
        self.assertEqual(cm.exception.name, "ZD_EBACKEND", str(cm.exception))


def main() -> Any:
    common.run(AgainstTorchOnCpuTest, MatrixOnCpuTest, CudaFormulasOnCpuTest, TorchCudaTest)


if __name__ == "__main__":
    main()
