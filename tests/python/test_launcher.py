"""ZeroOptimizer under a launcher (torchrun and the tools that follow it): with no local_rank
given it takes LOCAL_RANK from the environment and checks RANK and WORLD_SIZE against zerod's
world (global rank = first_rank + local rank, world size), with an error naming both values when
they disagree. The W=2 case starts two trainer processes with the environment torchrun gives its
workers (LOCAL_RANK, RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT; Debian's torchrun
1.13 fails in its agent under Python 3.11 before starting any worker) against one zerod of two
local ranks, and compares both trainers bitwise with torch's AdamW.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import unittest
from typing import Dict, Iterator

import common

torch = common.require_torch()
import torch.nn as nn  # noqa: E402

import zerod.testing  # noqa: E402
from zerod.torch import ZeroOptimizer  # noqa: E402

LAUNCHER_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE")


class _env:
    """Sets (value str) or removes (None) environment variables for a block."""

    def __init__(self, **values: object) -> None:
        self.values = values
        self.saved: Dict[str, object] = {}

    def __enter__(self) -> None:
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)


def model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


class LauncherW1Test(unittest.TestCase):
    """One zerod of one rank (world size 1) for optimizers that register, and one of two local
    ranks (world size 2, first rank 0) for the refusals, which come before registration (a
    registration there would wait for the other rank)."""

    @classmethod
    def setUpClass(cls) -> None:
        cls.daemon = zerod.testing.LocalZerod(log_level="info")
        cls.daemon2 = zerod.testing.LocalZerod(["--local_ranks", "2"], log_level="info")

    @classmethod
    def tearDownClass(cls) -> None:
        cls.daemon.stop()
        cls.daemon2.stop()

    def setUp(self) -> None:
        self._clean = _env(**{k: None for k in LAUNCHER_VARS})
        self._clean.__enter__()

    def tearDown(self) -> None:
        self._clean.__exit__()

    def make(self, daemon: object = None, **kw: object) -> ZeroOptimizer:
        d = daemon or self.daemon
        return ZeroOptimizer(model().parameters(), socket=d.socket, replace=True,
                             timeout_ms=20000, **kw)

    def test_local_rank_from_environment(self) -> None:
        with _env(LOCAL_RANK=0, RANK=0, WORLD_SIZE=1):
            with self.make() as opt:
                self.assertEqual((opt.info.local_rank, opt.info.rank, opt.info.world_size),
                                 (0, 0, 1))
                self.assertIsNone(opt.step())  # a step with zero gradients goes through
        with _env(LOCAL_RANK=0):  # RANK/WORLD_SIZE unset: nothing to check
            with self.make() as opt:
                self.assertEqual(opt.info.local_rank, 0)

    def test_explicit_local_rank_wins(self) -> None:
        with _env(LOCAL_RANK=1, RANK=7, WORLD_SIZE=9):
            with self.make(local_rank=0) as opt:
                self.assertEqual(opt.info.local_rank, 0)

    def test_rank_disagrees(self) -> None:
        with _env(LOCAL_RANK=1, RANK=3, WORLD_SIZE=2):
            with self.assertRaises(ValueError) as cm:
                self.make(self.daemon2)
        msg = str(cm.exception)
        for part in ("LOCAL_RANK=1", "RANK=3", "RANK is 3 here, 1 in zerod", "first_rank 0",
                     "--first_rank"):
            self.assertIn(part, msg)
        self.assertNotIn("WORLD_SIZE is", msg)

    def test_world_size_disagrees(self) -> None:
        with _env(LOCAL_RANK=0, RANK=0, WORLD_SIZE=4):
            with self.assertRaises(ValueError) as cm:
                self.make(self.daemon2)
        self.assertIn("WORLD_SIZE is 4 here, 2 in zerod", str(cm.exception))

    def test_bad_values(self) -> None:
        with _env(LOCAL_RANK="one"):
            with self.assertRaisesRegex(ValueError, "LOCAL_RANK is 'one'"):
                self.make()
        with _env(LOCAL_RANK=-2):
            with self.assertRaisesRegex(ValueError, "LOCAL_RANK is -2"):
                self.make()
        with _env(LOCAL_RANK=5):  # no such rank: zerod says so
            with self.assertRaises(zerod.ZerodError) as cm:
                self.make()
        self.assertEqual(cm.exception.name, "ZD_ERANK")


WORKER = textwrap.dedent("""
    import copy, os, sys, torch
    import torch.nn as nn
    from zerod.torch import ZeroOptimizer
    torch.set_num_threads(1)
    torch.manual_seed(3)
    base = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(6, 8, generator=g) for _ in range(4)]
    def train(m, opt):
        for x in xs:
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    ref = copy.deepcopy(base)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    m = copy.deepcopy(base)
    opt = ZeroOptimizer(m.parameters(), lr=1e-2)  # socket from ZEROD_SOCKET, rank from LOCAL_RANK
    train(m, opt)
    same = all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
    print(f"local {opt.info.local_rank} rank {opt.info.rank}/{opt.info.world_size} "
          f"bitwise {same}", flush=True)
    opt.close()
""")


class LauncherW2Test(unittest.TestCase):
    def test_two_workers(self) -> None:
        with zerod.testing.LocalWorld(2, log_level="info") as w:
            env = dict(os.environ, ZEROD_SOCKET=w.endpoint(0)[0], WORLD_SIZE="2",
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511",
                       GROUP_RANK="0", OMP_NUM_THREADS="1")
            procs = []
            for r in range(2):
                e = dict(env, LOCAL_RANK=str(r), RANK=str(r))
                procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=e,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))
            outs = [p.communicate(timeout=120 * common.HANG_SCALE) for p in procs]
        for r, (p, (out, err)) in enumerate(zip(procs, outs)):
            self.assertEqual(p.returncode, 0, f"worker {r}: {err[-3000:]}")
            self.assertEqual(out.strip(), f"local {r} rank {r}/2 bitwise True", err[-2000:])


def _cases() -> Iterator[type]:
    yield LauncherW1Test
    yield LauncherW2Test


if __name__ == "__main__":
    common.run(*_cases())
