"""The offload path of ZeroOptimizer (zerod.offload) against torch.optim.AdamW, bit for bit.

A model trained through ZeroOptimizer with offload, and a CPU fp32 copy of it stepped by torch's
AdamW (foreach=False: the formula ZeroOptimizer follows for a model stepped on the CPU) with the
very gradients the model computed (after each step's clipping coefficient, as zerod reported it:
test_optimizer.py shows that coefficient is torch's); after every step each parameter must equal
the reference's, rounded to the parameter dtype (bf16 params: fp32 master weights in both), bit
for bit. Runs: fp32, bf16, fp32 with clipping that triggers, gradients changed between backward
and step() (copied again), two micro-batches per step with and without no_sync() (without it
every bucket is copied and scattered twice, the second time only after the first scatter was
answered), overlap=False, and a trainer that crashes
(os._exit in a child process, no close) after 3 steps and is replaced by one whose model starts
from other values: it must resume zerod's state (resumed, step count, parameters) and go on
bit-identical to the reference.

This file runs the CPU rehearsal (offload="rehearsal": the same machinery with plain copies, no
streams; suite python), and holds the code test_offload_cuda.py runs with the model on a GPU
(suite gpu), where it also probes whether torch's CUDA single-tensor AdamW gives the CPU formula's
bits (reported, not asserted).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import unittest
import warnings
from typing import Any, List, Optional, Tuple

import common

torch = common.require_torch()
import torch.nn as nn  # noqa: E402

import zerod  # noqa: E402
import zerod.testing  # noqa: E402
import zerod.torch as zt  # noqa: E402
from zerod.torch import ZeroOptimizer  # noqa: E402

LR, WD, MAX_NORM = 1e-2, 0.05, 0.05
STEPS = 6


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # several buckets of 256 elements (the daemon's --bucket_elems), params of odd sizes
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 20), nn.Tanh(),
                         nn.Linear(20, 7))


def batch(step: int) -> Tuple[Any, Any]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 7, generator=g)


def loss_of(model: nn.Module, step: int, device: Any, dtype: Any) -> Any:
    x, y = batch(step)
    out = model(x.to(device, dtype)).float()
    return ((out - y.to(device)) ** 2).mean() * 4.0


def named(model: nn.Module, tag: str) -> List[Any]:
    return [(f"{tag}.{n}", p) for n, p in model.named_parameters()]


def train_steps(opt: ZeroOptimizer, model: nn.Module, steps: range, device: Any,
                dtype: Any) -> List[Tuple[List[Any], float]]:
    """Steps of the offloaded model; returns each step's gradients (fp32, on the CPU) and zerod's
    clipping coefficient."""
    out = []
    for step in steps:
        opt.zero_grad()
        loss_of(model, step, device, dtype).backward()
        grads = [p.grad.detach().float().cpu().clone() for p in model.parameters()]
        opt.step()
        out.append((grads, opt.last_result.clip_coef))
    return out


def ref_step(ref: nn.Module, ropt: Any, grads: List[Any], coef: float, clip: bool) -> None:
    with torch.no_grad():
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.clone()
            if clip:
                p.grad.mul_(coef)
    ropt.step()


def mismatch(model: nn.Module, ref: nn.Module, dtype: Any) -> Optional[str]:
    """None when every parameter equals the reference rounded to dtype, bit for bit."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        got = p.detach().cpu()
        want = q.detach().to(dtype)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        diff = (got.view(bits) != want.view(bits))
        if bool(diff.any()):
            i = int(diff.flatten().nonzero()[0])
            return (f"{name}: {int(diff.sum())} of {got.numel()} elements differ, first at "
                    f"{i}: {float(got.flatten()[i])!r} vs torch's {float(want.flatten()[i])!r}")
    return None


class OffloadCase:
    """The runs, for a device ("cpu": the rehearsal, "cuda": the real path)."""

    DEVICE = "cpu"
    daemon: Any

    def offload_arg(self) -> Any:
        return "rehearsal" if self.DEVICE == "cpu" else None

    def make(self, model: nn.Module, tag: str, **kw: Any) -> ZeroOptimizer:
        return ZeroOptimizer(named(model, tag), lr=LR, weight_decay=WD,
                             socket=self.daemon.socket, offload=self.offload_arg(), **kw)

    def check_sqrt(self) -> None:
        note = zt._probe_sqrt()[1]
        if note:
            self.skipTest(f"torch.sqrt on this CPU matches none of zerod's modes: {note[:120]}")

    def run_against_torch(self, dtype: Any, clip: bool, tag: str) -> None:
        self.check_sqrt()
        model = make_model(1).to(self.DEVICE, dtype)
        ref = make_model(1)  # fp32 master weights on the CPU, torch's: the model's initial values
        with torch.no_grad():
            for q, p in zip(ref.parameters(), model.parameters()):
                q.copy_(p.detach().float().cpu())
        ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
        opt = self.make(model, tag, replace=True, **({"max_grad_norm": MAX_NORM} if clip else {}))
        try:
            self.assertIsNotNone(opt._offload, "the optimizer did not offload")
            clipped = 0
            for step in range(STEPS):
                [(grads, coef)] = train_steps(opt, model, range(step, step + 1), self.DEVICE,
                                              dtype)
                ref_step(ref, ropt, grads, coef, clip)
                clipped += coef < 1.0
                bad = mismatch(model, ref, dtype)
                self.assertIsNone(bad, f"{tag}, step {step + 1}: {bad}")
            if clip:
                self.assertGreaterEqual(clipped, STEPS // 2, "clipping did not trigger")
            self.assertGreaterEqual(opt._offload.copies, opt._nbuckets * STEPS)
        finally:
            opt.close()

    def test_fp32(self) -> None:
        self.run_against_torch(torch.float32, False, f"{self.DEVICE}.fp32")

    def test_bf16(self) -> None:
        self.run_against_torch(torch.bfloat16, False, f"{self.DEVICE}.bf16")

    def test_fp32_clip(self) -> None:
        self.run_against_torch(torch.float32, True, f"{self.DEVICE}.clip")

    def test_gradients_changed_after_backward(self) -> None:
        """clip_grad_norm_ between backward and step(): the buckets are copied again."""
        self.check_sqrt()
        model = make_model(1).to(self.DEVICE)
        ref = make_model(1)
        ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
        opt = self.make(model, f"{self.DEVICE}.changed", replace=True)
        try:
            for step in range(3):
                opt.zero_grad()
                loss_of(model, step, self.DEVICE, torch.float32).backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p.grad.mul_(0.5)
                grads = [p.grad.detach().float().cpu().clone() for p in model.parameters()]
                with self.assertWarns(UserWarning) if step == 0 else _nothing():
                    opt.step()
                ref_step(ref, ropt, grads, 1.0, False)
                bad = mismatch(model, ref, torch.float32)
                self.assertIsNone(bad, f"step {step + 1}: {bad}")
        finally:
            opt.close()

    def run_accumulation(self, no_sync: bool, overlap: bool = True) -> None:
        """Two micro-batches per step: the first inside no_sync() (its buckets are copied when
        the second completes them), or without it (every bucket is copied and scattered again
        once the second backward completes it, after the first's scatters were answered)."""
        self.check_sqrt()
        model = make_model(1).to(self.DEVICE)
        ref = make_model(1)
        ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
        opt = self.make(model, f"{self.DEVICE}.acc{int(no_sync)}{int(overlap)}", replace=True,
                        overlap=overlap)
        try:
            for step in range(3):
                opt.zero_grad()
                if no_sync:
                    with opt.no_sync():
                        loss_of(model, 2 * step, self.DEVICE, torch.float32).backward()
                else:
                    loss_of(model, 2 * step, self.DEVICE, torch.float32).backward()
                loss_of(model, 2 * step + 1, self.DEVICE, torch.float32).backward()
                grads = [p.grad.detach().float().cpu().clone() for p in model.parameters()]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the re-scatter's, without no_sync()
                    opt.step()
                ref_step(ref, ropt, grads, 1.0, False)
                bad = mismatch(model, ref, torch.float32)
                self.assertIsNone(bad, f"step {step + 1}: {bad}")
            # without no_sync() every bucket went twice: the second copy after the first's
            # scatter was answered (zerod may read a scattered bucket until the step)
            per_step = opt._nbuckets * (1 if no_sync else 2)
            self.assertEqual(opt._offload.copies, 3 * per_step)
        finally:
            opt.close()

    def test_accumulation_no_sync(self) -> None:
        self.run_accumulation(True)

    def test_accumulation_without_no_sync(self) -> None:
        self.run_accumulation(False)

    def test_no_overlap(self) -> None:
        self.run_accumulation(True, overlap=False)

    def test_parameter_without_gradient(self) -> None:
        """An auxiliary head used on odd steps only, its .grad None on the others
        (zero_grad(set_to_none=True)): skipped as torch's AdamW skips it (no weight decay, no
        moment update, its own step count held back), bit for bit."""
        self.check_sqrt()
        model = Head().to(self.DEVICE)
        ref = Head()
        with torch.no_grad():
            for q, p in zip(ref.parameters(), model.parameters()):
                q.copy_(p.detach().float().cpu())
        ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
        opt = self.make(model, f"{self.DEVICE}.absent", replace=True)
        try:
            self.assertIsNotNone(opt._offload, "the optimizer did not offload")
            skipped = 0
            for step in range(STEPS):
                opt.zero_grad(set_to_none=True)
                x, y = batch(step)
                out = model(x.to(self.DEVICE), step % 2 == 1).float()
                (((out - y.to(self.DEVICE)) ** 2).mean() * 4.0).backward()
                grads = [None if p.grad is None else p.grad.detach().float().cpu().clone()
                         for p in model.parameters()]
                skipped += sum(g is None for g in grads)
                opt.step()
                with torch.no_grad():
                    for q, g in zip(ref.parameters(), grads):
                        q.grad = g
                ropt.step()
                bad = mismatch(model, ref, torch.float32)
                used = "used" if step % 2 else "unused"
                self.assertIsNone(bad, f"step {step + 1} (aux head {used}): {bad}")
            self.assertEqual(skipped, 2 * (STEPS // 2), "the head was not left out of backward")
            # the head's weight and bias were skipped (their own step counts lag the model's)
            lagging = int(opt.client.rank_status().get("params_lagging", "-1"))
            self.assertEqual(lagging, 2, "zerod did not skip the head's two parameters")
        finally:
            opt.close()

    def test_trainer_crash_and_reattach(self) -> None:
        """A trainer dies after 3 steps without closing; its replacement resumes zerod's state."""
        self.check_sqrt()
        tag = f"{self.DEVICE}.crash"
        with tempfile.TemporaryDirectory() as tmp:
            saved = os.path.join(tmp, "grads.pt")
            child = subprocess.run([sys.executable, __file__, "--child", self.daemon.socket,
                                    self.DEVICE, tag, saved], capture_output=True, text=True,
                                   timeout=120)
            self.assertEqual(child.returncode, 0, f"the child trainer failed:\n{child.stderr}")
            history = torch.load(saved)
        ref = make_model(1)
        ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
        for grads, coef in history:
            ref_step(ref, ropt, grads, coef, False)
        model = make_model(2).to(self.DEVICE)  # other initial values: zerod's must win
        opt = self.make(model, tag)
        try:
            self.assertTrue(opt.resumed, "the new trainer did not resume zerod's state")
            self.assertEqual(opt.step_count, len(history))
            bad = mismatch(model, ref, torch.float32)
            self.assertIsNone(bad, f"after the reattach: {bad}")
            for step in range(3, STEPS):
                [(grads, coef)] = train_steps(opt, model, range(step, step + 1), self.DEVICE,
                                              torch.float32)
                ref_step(ref, ropt, grads, coef, False)
                bad = mismatch(model, ref, torch.float32)
                self.assertIsNone(bad, f"step {step + 1} after the reattach: {bad}")
        finally:
            opt.close()


class Head(nn.Module):
    """A trunk, a main head and an auxiliary one that forward adds on some steps only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Linear(16, 24)
        self.main = nn.Linear(24, 7)
        self.aux = nn.Linear(24, 7)

    def forward(self, x: Any, use_aux: bool) -> Any:
        h = torch.tanh(self.trunk(x))
        out = self.main(h)
        return out + 0.5 * self.aux(h) if use_aux else out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def child(socket: str, device: str, tag: str, saved: str) -> None:
    """The trainer that crashes: 3 steps, their gradients saved, then gone without a close."""
    model = make_model(1).to(device)
    opt = ZeroOptimizer(named(model, tag), lr=LR, weight_decay=WD, socket=socket, replace=True,
                        offload="rehearsal" if device == "cpu" else None)
    history = train_steps(opt, model, range(3), device, torch.float32)
    torch.save(history, saved)
    sys.stdout.flush()
    os._exit(0)


# --overlap: the zerod runs overlap_update = 1, where the step without its gather that this path
# sends is answered before its parameters are written, and each gather waits for its bucket's.
OVERLAP = False


class OffloadRehearsalTest(OffloadCase, unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.daemon = zerod.testing.LocalZerod(
            ["--bucket_elems", "256"] + (["--overlap_update", "1"] if OVERLAP else []),
            log_level="info")

    def test_bye_after_step_without_gather(self) -> None:
        """A client that says bye right after a step without its gather, before gathering: the
        buffers stay mapped in zerod until the parameters' writes of that step have ended (with
        overlap_update they run after the answer), zerod lives on, and a new client resumes the
        step's parameters, torch's AdamW's on the same gradients, bit for bit."""
        self.check_sqrt()
        n, tag = 1 << 18, f"bye{int(OVERLAP)}"
        update, sqrt_mode = zt._choose_formula({}, False, "test")  # the running torch's AdamW
        group = {"lr": LR, "weight_decay": WD, "update": update, "sqrt_mode": sqrt_mode}
        init = torch.linspace(-1.0, 1.0, n)
        grad = torch.sin(torch.arange(n, dtype=torch.float32) * 0.01) * 1e-2
        for attempt in range(3):
            with zerod.Client(self.daemon.socket) as c:
                c.layout([(f"{tag}.w", (n,))], [group],
                         replace=attempt == 0)
                pv = torch.frombuffer(c.param_buffer, dtype=torch.float32)
                pv.copy_(init)
                c.register()
                torch.frombuffer(c.grad_buffer, dtype=torch.float32).copy_(grad)
                c.scatter()  # speculated with overlap_update: the step commits, writes later
                c.step(scatter=False, gather=False)
                del pv
            # gone: the next client's registration resumes the model, its buffer from zerod's
            # master weights, attempt + 1 steps from init with this gradient
        ref = init.clone().requires_grad_(True)
        ropt = torch.optim.AdamW([ref], lr=LR, weight_decay=WD, foreach=False)
        for _ in range(3):
            ref.grad = grad.clone()
            ropt.step()
        with zerod.Client(self.daemon.socket) as c:
            c.layout([(f"{tag}.w", (n,))], [group])
            info = c.register()
            self.assertEqual(info.step, 3)
            got = torch.frombuffer(c.param_buffer, dtype=torch.float32).clone()
        diff = got.view(torch.int32) != ref.detach().view(torch.int32)
        self.assertFalse(bool(diff.any()), common.first_difference("w", got, ref.detach()))
        if OVERLAP:
            with zerod.Client(self.daemon.socket) as c:
                st = c.status()
            self.assertIn("overlap_buckets_committed", st)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.daemon.stop()

    def test_arguments(self) -> None:
        model = make_model(1)
        with self.assertRaises(ValueError):
            ZeroOptimizer(model.parameters(), socket=self.daemon.socket, offload=True)
        with self.assertRaises(ValueError):
            ZeroOptimizer(model.parameters(), socket=self.daemon.socket, offload="yes")
        opt = ZeroOptimizer(named(model, "plain"), socket=self.daemon.socket, replace=True)
        try:
            self.assertIsNone(opt._offload, "a CPU model offloaded without the switch")
        finally:
            opt.close()

    def test_pinned_needs_cuda(self) -> None:
        """ZD_MEMORY_HOST_PINNED where libzerod has no CUDA or no GPU: ZD_EBACKEND, named."""
        if torch.cuda.is_available():
            self.skipTest("a GPU is present: pinning works here (test_offload_cuda.py)")
        with zerod.Client(self.daemon.socket) as c:
            with self.assertRaises(zerod.ZerodError) as cm:
                c.layout([("w", (4,))], memory="host_pinned", replace=True)
            self.assertEqual(cm.exception.name, "ZD_EBACKEND")
            self.assertIn("ZD_MEMORY_HOST_PINNED", str(cm.exception))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:6])
    OVERLAP = "--overlap" in sys.argv[1:]
    common.run(OffloadRehearsalTest)
