"""Hugging Face Accelerate with a ZeroOptimizer at W=2, bitwise against Accelerate's own run.

Two processes under torchrun (DDP over Gloo), one zerod of two local ranks. Each worker trains
the README's recipe ("Using zerod with Accelerate": recipe() below is that code) for 4 steps of
2 micro-batches (accelerator.accumulate), and the same loop with torch.optim.AdamW as
Accelerate users write it (accelerator.clip_grad_norm_ when it syncs); every parameter must be
bitwise equal with a clip that does not bind and with one that binds at every step (zerod clips
by torch's fp32 total norm of the averaged gradient at W > 1 too). With the recipe, gradients are
reduced by zerod only (zerod.ddp.register): the Gloo process group sees no all-reduce during
training (counted with torch's profiler, as in test_ddp.py).

Needs accelerate in this interpreter: exits 77 (SKIP) without it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest
from typing import Any, Dict, List

import common

torch = common.require_torch()
try:
    import accelerate
except ImportError as e:
    common.skip(f"accelerate is not importable here ({e}): scripts/torch2_venv.sh --frameworks "
                f"installs it into the torch 2.x venv")
import torch.nn as nn  # noqa: E402

import zerod.ddp  # noqa: E402
import zerod.testing  # noqa: E402
from zerod.torch import ZeroOptimizer  # noqa: E402

STEPS, MICRO = 4, 2


def make_model() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))


def data(rank: int) -> List[Any]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
            for _ in range(STEPS * MICRO)]


# ---- the README's recipe ("Using zerod with Accelerate") ---------------------------------------
def recipe(model: nn.Module, batches: List[Any], max_norm: float = 1.0,
           **zerod_options: Any) -> nn.Module:
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2)
    model = accelerator.prepare(model)  # DDP first: the optimizer takes the moved parameters
    opt = ZeroOptimizer(accelerator.unwrap_model(model).named_parameters(), lr=1e-2,
                        max_grad_norm=max_norm,  # zerod clips the reduced gradient
                        **zerod_options)
    zerod.ddp.register(model, opt)      # DDP leaves the reduction to zerod
    opt = accelerator.prepare(opt)
    for x, y in batches:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
    return accelerator.unwrap_model(model)
# -------------------------------------------------------------------------------------------------


def reference(model: nn.Module, batches: List[Any], max_norm: float) -> nn.Module:
    """Accelerate's own loop: torch's AdamW, clip_grad_norm_ by Accelerate when it syncs."""
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    for x, y in batches:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            opt.zero_grad()
    return accelerator.unwrap_model(model)


def worker(out: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    batches = data(rank)
    res: Dict[str, Any] = {"rank": rank}
    for max_norm in (1e4, 0.05):  # a clip that never binds, one that binds at every step
        ref = reference(make_model(), batches, max_norm)
        want = {n: p.detach().clone() for n, p in ref.named_parameters()}
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            # replace: the second run starts afresh on the ranks the first one trained
            model = recipe(make_model(), batches, max_norm, replace=True)
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
        res[str(max_norm)] = {
            "gloo": sorted({e.name for e in prof.events() if e.name.startswith("gloo:")}),
            "max_diff": max(float((got[n] - want[n]).abs().max()) for n in want),
            "diffs": [common.first_difference(n, got[n], want[n]) for n in want
                      if not torch.equal(got[n], want[n])][:3]}
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(res, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AccelerateW2Test(unittest.TestCase):
    def test_w2(self) -> None:
        tmp = tempfile.mkdtemp(prefix="zerod-acc-")
        try:
            with zerod.testing.LocalWorld(2, log_level="info") as w:
                # ACCELERATE_USE_CPU: what `accelerate launch --cpu` sets (multi-process CPU, DDP)
                env = dict(os.environ, ZEROD_SOCKET=w.endpoint(0)[0], OMP_NUM_THREADS="1",
                           ACCELERATE_USE_CPU="1")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                       "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                       str(free_port()), __file__, "--worker", tmp]
                p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, timeout=300 * common.HANG_SCALE)
            self.assertEqual(p.returncode, 0, p.stdout[-4000:])
            for r in range(2):
                with open(os.path.join(tmp, f"result-{r}.json")) as f:
                    res: Dict[str, Any] = json.load(f)
                for norm, r2 in ((k, v) for k, v in res.items() if k != "rank"):
                    print(f"accelerate {accelerate.__version__} W=2 rank {r} max_grad_norm "
                          f"{norm}: max |diff| {r2['max_diff']}, Gloo collectives during the "
                          f"zerod run {r2['gloo']}; {r2['diffs'][:1]}")
                    self.assertNotIn("gloo:all_reduce", r2["gloo"])
                # bitwise, the clip binding or not: zerod's total norm at W > 1 is torch's fp32
                # clip_grad_norm_ total of the averaged gradient (README)
                self.assertEqual(res["10000.0"]["diffs"], [], f"rank {r}")
                self.assertEqual(res["0.05"]["diffs"], [], f"rank {r}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        sys.exit(0)
    common.run(AccelerateW2Test)
