"""Lightning with a ZeroOptimizer at W=2, bitwise against Lightning's own run.

Two processes under torchrun (Lightning's DDP strategy over Gloo), one zerod of two local
ranks. Each worker fits the README's recipe ("Using zerod with Lightning": ZeroModule below,
whose configure_optimizers builds the ZeroOptimizer and hands DDP's gradients to zerod) for 4
steps of 2 micro-batches (accumulate_grad_batches), then the same module with torch's AdamW and
Lightning's own gradient clipping; every parameter must be bitwise equal, the clip binding at
every step or not (zerod clips by torch's fp32 total norm of the averaged gradient at W > 1
too). No gradient goes through the Gloo process group during the zerod run: its
all-reduces (counted with torch's profiler, as in test_ddp.py) are Lightning's own few
elements (its decisions), against thousands of gradient elements per step.

Needs lightning in this interpreter: exits 77 (SKIP) without it.
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
from typing import Any, Dict

import common

torch = common.require_torch()
try:
    import lightning.pytorch as pl
except ImportError as e:
    common.skip(f"lightning is not importable here ({e}): scripts/torch2_venv.sh --frameworks "
                f"installs it into the torch 2.x venv")
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import zerod.ddp  # noqa: E402
import zerod.testing  # noqa: E402
from zerod.torch import ZeroOptimizer  # noqa: E402

STEPS, MICRO = 4, 2


def make_net() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))


def loader() -> Any:
    g = torch.Generator().manual_seed(9)
    n = 2 * STEPS * MICRO * 8  # both ranks' batches: Lightning's DistributedSampler splits them
    ds = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g),
                                        torch.randn(n, 4, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


class TorchModule(pl.LightningModule):
    """What a Lightning user writes: torch's AdamW (Lightning clips: gradient_clip_val)."""

    def __init__(self, max_norm: float = 1.0, **zerod_options: Any) -> None:
        super().__init__()
        self.net = make_net()
        self.max_norm = max_norm
        self.zerod_options = zerod_options

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


# ---- the README's recipe ("Using zerod with Lightning") ----------------------------------------
class ZeroModule(TorchModule):
    def configure_optimizers(self) -> Any:
        # Lightning's DDP strategy has wrapped the module by now: hand DDP's gradients to zerod,
        # which also clips (no gradient_clip_val: it would clip each rank's local gradients).
        opt = ZeroOptimizer(self.named_parameters(), lr=1e-2, max_grad_norm=self.max_norm,
                            **self.zerod_options)
        if isinstance(self.trainer.strategy.model, DistributedDataParallel):
            zerod.ddp.register(self.trainer.strategy.model, opt)
        return opt


def fit(module: pl.LightningModule, clip: Any = None) -> None:
    pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS,
               accumulate_grad_batches=MICRO, gradient_clip_val=clip, logger=False,
               enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(module, loader())
# -------------------------------------------------------------------------------------------------


def gloo_elems(prof: Any) -> Dict[str, int]:
    """Elements of every Gloo collective the profiler saw, by its name."""
    out: Dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("gloo:"):
            n = 0
            for shape in e.input_shapes:
                k = 1
                for d in shape:
                    k *= d
                n += k if shape else 0
            out[e.name] = out.get(e.name, 0) + n
    return out


def worker(out: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    res: Dict[str, Any] = {"rank": rank}
    for max_norm in (1e4, 0.05):  # a clip that never binds, one that binds at every step
        ref = TorchModule()
        fit(ref, clip=max_norm)
        want = {n: p.detach().clone() for n, p in ref.named_parameters()}
        from torch.profiler import ProfilerActivity, profile
        # replace: the second run starts afresh on the ranks the first one trained
        mod = ZeroModule(max_norm, replace=True)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fit(mod)
        got = {n: p.detach().clone() for n, p in mod.named_parameters()}
        res[str(max_norm)] = {
            "gloo": gloo_elems(prof),
            "param_elems": sum(p.numel() for p in mod.parameters()),
            "max_diff": max(float((got[n] - want[n]).abs().max()) for n in want),
            "diffs": [common.first_difference(n, got[n], want[n]) for n in want
                      if not torch.equal(got[n], want[n])][:3]}
        mod.trainer.optimizers[0].close()
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(res, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LightningW2Test(unittest.TestCase):
    def test_w2(self) -> None:
        tmp = tempfile.mkdtemp(prefix="zerod-pl-")
        try:
            with zerod.testing.LocalWorld(2, log_level="info") as w:
                env = dict(os.environ, ZEROD_SOCKET=w.endpoint(0)[0], OMP_NUM_THREADS="1")
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
                    print(f"lightning {pl.__version__} W=2 rank {r} max_grad_norm {norm}: max "
                          f"|diff| {r2['max_diff']}, Gloo collectives during the zerod run "
                          f"{r2['gloo']}; {r2['diffs'][:1]}")
                    # Lightning's own all-reduces of a flag or a scalar (its decisions, e.g.
                    # whether to stop), never the gradients
                    self.assertLess(r2["gloo"].get("gloo:all_reduce", 0), 64, r2["param_elems"])
                self.assertEqual(res["10000.0"]["diffs"], [], f"rank {r}")
                self.assertEqual(res["0.05"]["diffs"], [], f"rank {r}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        sys.exit(0)
    common.run(LightningW2Test)
