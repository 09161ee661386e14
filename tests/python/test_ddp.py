"""zerod.ddp: a DistributedDataParallel model whose gradients are reduced once, by zerod.

W=2: two trainer processes, each a DDP model over a Gloo process group and a ZeroOptimizer on
local ranks 0 and 1 of one zerod started with --local_ranks 2, train 4 steps of 2 micro-batches
each (the first under DDP's own model.no_sync(), nothing else), and every parameter must be
bitwise equal to torch's AdamW stepped on the mean over the ranks of each rank's accumulated
gradient, (g0 + g1) * 0.5, as zerod averages.

The bytes are counted where they cannot be missed: every collective that reaches the Gloo
process group is an operator torch's profiler records ("gloo:all_reduce" with its input's
shape), whoever calls it (DDP's C++ reducer included), as is DDP's first-iteration bucket rebuild
(a broadcast of a few bucket sizes, no gradient); zerod's own counter is the rank's
collective_bytes (bytes given to its reduce-scatters and all-gathers). With zerod.ddp.register:
no gradient goes through the process group during training, and zerod moves exactly
one reduce-scatter and one all-gather of its buffer per step. Without it (DDP as it comes, the
same optimizer, its no_sync() beside DDP's): DDP all-reduces every gradient once per step, its
copy of the mean back into .grad makes the optimizer scatter every bucket again, so zerod moves
two reduce-scatters and one all-gather per step; the parameters are bitwise equal too (the mean
of two equal means is the mean). Also the refusals of register() (W=1).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import subprocess
import sys
import unittest
import warnings
from typing import Any, Dict, List

import common

torch = common.require_torch()
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import zerod.ddp  # noqa: E402
import zerod.testing  # noqa: E402
from zerod.torch import ZeroOptimizer  # noqa: E402

STEPS, MICRO, WORLD = 4, 2, 2


def make_model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(12, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(),
                         nn.Linear(48, 6))


def batch(step: int, micro: int, rank: int) -> Any:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(5, 12, generator=g)


def loss_of(model: nn.Module, x: Any) -> Any:
    return model(x).square().mean()


def reference() -> nn.Module:
    """torch's AdamW on the mean over the ranks of each rank's accumulated gradient."""
    ref = make_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        per_rank: List[List[Any]] = []
        for r in range(WORLD):
            for p in ref.parameters():
                p.grad = None
            for m in range(MICRO):
                loss_of(ref, batch(step, m, r)).backward()
            per_rank.append([p.grad.clone() for p in ref.parameters()])
        for p, g0, g1 in zip(ref.parameters(), *per_rank):
            p.grad = (g0 + g1) * 0.5
        opt.step()
    return ref


def gloo_elems(prof: Any) -> Dict[str, int]:
    """Elements of every Gloo collective the profiler saw, by its name."""
    out: Dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("gloo:") and e.name != "gloo:barrier":
            n = 0
            for shape in e.input_shapes:
                k = 1
                for d in shape:
                    k *= d
                n += k if shape else 0
            out[e.name] = out.get(e.name, 0) + n
    return out


def worker(rank: int, mode: str, sock: str, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    model = DDP(make_model())
    opt = ZeroOptimizer(model.module.named_parameters(), lr=1e-2, socket=sock,
                        local_rank=rank, replace=True, timeout_ms=60000)
    if mode == "hook":
        zerod.ddp.register(model, opt)
    before = int(opt.client.rank_status()["collective_bytes"])
    from torch.profiler import ProfilerActivity, profile
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for step in range(STEPS):
                opt.zero_grad()
                for m in range(MICRO):
                    last = m == MICRO - 1
                    # With the hook DDP's no_sync() is all it takes; without it the optimizer
                    # must be told too (or it scatters every micro-batch).
                    with contextlib.ExitStack() as stack:
                        if not last:
                            stack.enter_context(model.no_sync())
                            if mode == "plain":
                                stack.enter_context(opt.no_sync())
                        loss_of(model, batch(step, m, rank)).backward()
                opt.step()
            # Gloo completes a collective's future before it ends the collective's profiler
            # record, so the last step's all-reduce may still be open here; a barrier waits
            # for every earlier collective to finish (record included). The barrier's own
            # record is not counted.
            dist.barrier()
    zerod_bytes = int(opt.client.rank_status()["collective_bytes"]) - before
    ref = reference()
    diffs = [common.first_difference(n, a, b) for (n, a), (_, b) in
             zip(model.module.named_parameters(), ref.named_parameters()) if not torch.equal(a, b)]
    print(json.dumps({
        "rank": rank, "diffs": diffs, "gloo": gloo_elems(prof), "zerod_bytes": zerod_bytes,
        "buffer_bytes": opt.info.total_elems * 4,
        "param_elems": sum(p.numel() for p in model.parameters()),
        "warnings": [str(w.message)[:120] for w in rec]}), flush=True)
    opt.close()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DDPW2Test(unittest.TestCase):
    def run_world(self, mode: str) -> List[Dict[str, Any]]:
        with zerod.testing.LocalWorld(WORLD, args=["--bucket_elems", "1024"],
                                      log_level="info") as w:
            port = free_port()
            env = dict(os.environ, OMP_NUM_THREADS="1")
            procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), mode,
                                       w.endpoint(r)[0], str(port)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for r in range(WORLD)]
            outs = [p.communicate(timeout=240 * common.HANG_SCALE) for p in procs]
        results = []
        for r, (p, (out, err)) in enumerate(zip(procs, outs)):
            self.assertEqual(p.returncode, 0, f"{mode} worker {r}: {err[-3000:]}")
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            self.assertEqual(len(lines), 1, f"{mode} worker {r} printed {out!r}")
            res = json.loads(lines[0])
            self.assertEqual(res["diffs"], [], f"{mode} rank {r}: not bitwise equal to AdamW")
            results.append(res)
        return results

    def test_gradients_reduced_once(self) -> None:
        for res in self.run_world("hook"):
            print(f"hook, rank {res['rank']}: process group (elements) {res['gloo']}, zerod "
                  f"{res['zerod_bytes']} bytes over {STEPS} steps (buffer "
                  f"{res['buffer_bytes']} bytes)")
            # Only DDP's first-iteration bucket rebuild (a broadcast of a few bucket sizes,
            # ints: no gradient) reaches the process group; no gradient collective does.
            self.assertEqual([k for k in res["gloo"] if k != "gloo:broadcast"], [],
                             "a gradient went through DDP's process group")
            self.assertLess(res["gloo"].get("gloo:broadcast", 0), 64)
            # one reduce-scatter and one all-gather of the whole buffer per step
            self.assertEqual(res["zerod_bytes"], STEPS * 2 * res["buffer_bytes"])
            self.assertEqual([w for w in res["warnings"] if "scatter" in w], [])

    def test_without_hook_twice(self) -> None:
        for res in self.run_world("plain"):
            print(f"plain DDP, rank {res['rank']}: process group (elements) {res['gloo']}, zerod "
                  f"{res['zerod_bytes']} bytes over {STEPS} steps (buffer "
                  f"{res['buffer_bytes']} bytes)")
            gloo = dict(res["gloo"])
            self.assertLess(gloo.pop("gloo:broadcast", 0), 64)  # DDP's bucket rebuild
            self.assertEqual(gloo, {"gloo:all_reduce": STEPS * res["param_elems"]})
            # DDP's copy-back: every bucket scattered again at step()
            self.assertEqual(res["zerod_bytes"], STEPS * 3 * res["buffer_bytes"])
            self.assertTrue(any("gradients changed after backward" in w
                                for w in res["warnings"]), res["warnings"])


class RegisterRefusalsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.daemon = zerod.testing.LocalZerod(log_level="info")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)

    @classmethod
    def tearDownClass(cls) -> None:
        dist.destroy_process_group()
        cls.daemon.stop()

    def test_refusals(self) -> None:
        m = DDP(make_model(), gradient_as_bucket_view=True)
        with ZeroOptimizer(m.parameters(), socket=self.daemon.socket, replace=True) as opt:
            with self.assertRaisesRegex(ValueError, "gradient_as_bucket_view"):
                zerod.ddp.register(m, opt)
        m = DDP(make_model())
        first = list(m.module.parameters())[:2]
        with ZeroOptimizer(first, socket=self.daemon.socket, replace=True) as opt:
            with self.assertRaisesRegex(ValueError, r"4 parameter\(s\) the ZeroOptimizer does "
                                                    r"not own \(2.weight, 2.bias, 4.weight"):
                zerod.ddp.register(m, opt)
            with self.assertRaisesRegex(TypeError, "DistributedDataParallel"):
                zerod.ddp.register(m.module, opt)  # type: ignore[arg-type]
        with self.assertRaisesRegex(TypeError, "ZeroOptimizer"):
            zerod.ddp.register(m, torch.optim.AdamW(m.parameters()))  # type: ignore[arg-type]

    def test_w1_bitwise(self) -> None:
        # world size 1: the hook changes nothing but the traffic; one step of AdamW
        base = make_model()
        m = DDP(copy.deepcopy(base))
        ref = copy.deepcopy(base)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        with ZeroOptimizer(m.parameters(), lr=1e-2, socket=self.daemon.socket,
                           replace=True) as opt:
            zerod.ddp.register(m, opt)
            for step in range(3):
                opt.zero_grad()
                ref_opt.zero_grad()
                loss_of(m, batch(step, 0, 0)).backward()
                loss_of(ref, batch(step, 0, 0)).backward()
                opt.step()
                ref_opt.step()
            common.assert_params_equal(self, list(m.module.named_parameters()),
                                       list(ref.named_parameters()), "W=1 with the hook")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
        sys.exit(0)
    common.run(DDPW2Test, RegisterRefusalsTest)
