"""zerod.torch.ZeroOptimizer across a live resize (docs/design.md, "Live resize"; README), against
real zerod processes.

A world of 4 zerods (one rank each, CPU backend, unix sockets, as test_resize.py builds it) with a
plain ZeroOptimizer training loop per rank on threads (zero_grad, backward, step; backward's
hooks scatter the buckets). `zeroctl resize --world_size 2` shrinks it in the middle of training:
the trainers of ranks 0 and 1 continue with no code beyond calling step() (it sees the resize by
the world size a new connection reports, lays the model out again for 2 ranks, registers and
sends the step again), every step bitwise equal to torch.optim.AdamW(foreach=False) on the same
gradients, and ``opt.world_size`` is 2; those of ranks 2 and 3 get ZerodError ZD_ERANK naming the
resize. Then `zeroctl resize --world_size 4` grows it back: ranks 0 and 1's step() waits in its
registration while two new empty zerods start for ranks 2 and 3 and two new trainers register
(their parameters junk: the state comes from zerod); every rank trains on, bitwise again. The
shrink again with gather="lazy" (the forward's gather hooks made again for the new layout).
Prints how long the step that met the shrink took (the resize, the new layout and the step).

The reduced gradient is the same at every world size (test_state_dir's: rank 0 sends step s's
gradient, the others zeros, grad_mean off).
"""

from __future__ import annotations

import sys
import threading
import time
import unittest
import warnings
from typing import List

import common  # sets up sys.path and the library first

import numpy as np

import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402

torch = common.require_torch()

import test_resize as rz  # noqa: E402  (zeroctl, status, ARGS)
import test_state_dir as sd  # noqa: E402  (PARAMS, gradients, reference)
from zerod.torch import ZeroOptimizer  # noqa: E402

NAMES = [n for n, _ in sd.PARAMS]


class Loop:
    """One rank's trainer: a model of test_state_dir's parameters and its ZeroOptimizer."""

    def __init__(self, d: zerod.testing.LocalZerod, rank: int, junk: bool = False,
                 lazy: bool = False) -> None:
        self.rank = rank
        init = sd.init_values()
        self.ps = [torch.nn.Parameter(torch.tensor(np.full_like(init[n], -7.0) if junk
                                                   else init[n])) for n in NAMES]
        kw = ({"gather": "lazy", "module": torch.nn.ParameterList(self.ps)} if lazy else {})
        self.opt = ZeroOptimizer(list(zip(NAMES, self.ps)), socket=d.socket, local_rank=0,
                                 grad_mean=False, foreach=False, **kw)

    def step(self, s: int) -> None:
        g = sd.step_grads(s)
        self.opt.zero_grad()
        loss = sum((p * (torch.tensor(np.asarray(g[n])) if self.rank == 0 else
                         torch.zeros(p.shape))).sum() for n, p in zip(NAMES, self.ps))
        loss.backward()
        self.opt.step()


class ResizeTorchTest(unittest.TestCase):
    def setUp(self) -> None:
        quiet = warnings.catch_warnings()  # step()'s "resized ... laying the model out again"
        quiet.__enter__()
        self.addCleanup(quiet.__exit__, None, None, None)
        warnings.simplefilter("ignore")
        self.ref = sd.Reference()

    def assert_same(self, loops: List[Loop], step: int, what: str) -> None:
        want = self.ref.at(step)
        for t in loops:
            t.opt.wait_params()  # gather="lazy": the step's gathers
            for n, p in zip(NAMES, t.ps):
                got = p.detach().numpy().view(np.uint32).ravel()
                diff = np.flatnonzero(got != want[n].view(np.uint32).ravel())
                self.assertEqual(diff.size, 0, f"{what}: rank {t.rank}: {n} differs from "
                                 f"torch's step {step} at {diff.size} elements")
            self.assertEqual(t.opt.step_count, step, f"{what}: rank {t.rank}")

    def train(self, loops: List[Loop], steps: range) -> None:
        for s in steps:
            sd.on_all([lambda t=t: t.step(s) for t in loops])
            self.assert_same(loops, s, f"step {s}")

    def shrink(self, world: zerod.testing.LocalWorld, lazy: bool = False) -> List[Loop]:
        """W=4 trains steps 1..3, `zeroctl resize --world_size 2` rides step 4, step 5 finds
        it: ranks 0 and 1 follow, 2 and 3 get ZD_ERANK; W=2 trains steps 6 and 7."""
        loops = sd.on_all([lambda r=r: Loop(world.daemons[r], r, lazy=lazy) for r in range(4)])
        self.loops = loops
        self.assertEqual([t.opt.world_size for t in loops], [4] * 4)
        self.train(loops, range(1, 4))

        # ---- shrink 4 -> 2 in the middle of training ----
        rz.zeroctl("--address", world.daemons[1].control_address, "resize",
                   "--world_size", "2")
        self.train(loops, range(4, 5))  # the step the resize rides
        t0 = time.monotonic()
        got = rz.attempt([lambda t=t: t.step(5) for t in loops])
        print(f"\n    {'lazy ' if lazy else ''}step 5 across the shrink 4 -> 2 (resize, "
              f"new layout, step): {time.monotonic() - t0:.3f} s")
        for t, e in zip(loops, got):
            if t.rank < 2:
                self.assertIsNone(e, f"rank {t.rank}: step 5 across the resize: {e!r}")
            else:
                self.assertIsInstance(e, ZerodError, f"rank {t.rank}: step 5")
                self.assertEqual(e.code, rz.ZD_ERANK, e.message)
                self.assertIn("left the world", e.message)
                self.assertIn("resized from 4 to 2", e.message)
        for t in loops[2:]:
            t.opt.close()
        for r in (2, 3):
            world.daemons[r].stop()
        loops = loops[:2]
        self.assert_same(loops, 5, "step 5, sent again at W=2")
        self.assertEqual([t.opt.world_size for t in loops], [2, 2])
        self.train(loops, range(6, 8))
        return loops

    def test_shrink_lazy(self) -> None:
        """gather="lazy" (the forward's hooks made again for the new buckets), shrink only."""
        world = zerod.testing.LocalWorld(4, daemons=4, args=rz.ARGS, log_level="info")
        self.loops: List[Loop] = []
        try:
            self.shrink(world, lazy=True)
        except BaseException:
            sys.stderr.write(world.log())
            raise
        finally:
            for t in self.loops:
                t.opt.close()
            world.stop(check=False)

    def test_shrink_and_grow(self) -> None:
        world = zerod.testing.LocalWorld(4, daemons=4, args=rz.ARGS, log_level="info")
        self.loops: List[Loop] = []
        try:
            loops = self.shrink(world)

            # ---- grow 2 -> 4: new empty zerods and trainers for ranks 2 and 3 ----
            rz.zeroctl("--address", world.daemons[0].control_address, "resize",
                       "--world_size", "4")
            self.train(loops, range(8, 9))  # the step the resize rides
            started = time.monotonic()

            def grown(r: int) -> Loop:
                t = Loop(world.daemons[r], r, junk=True)
                t.step(9)
                return t

            # Ranks 0 and 1's step 9 meets the resize and waits in its registration; the new
            # zerods start meanwhile, from this thread (they die with the thread that started
            # them: PR_SET_PDEATHSIG), then the new trainers register and step.
            got: list = []
            fns = [lambda t=t: t.step(9) for t in loops]
            staying = threading.Thread(target=lambda: got.extend(rz.attempt(fns)))
            staying.start()
            rz.ResizeTest.wait_world_size(self, world.daemons[0], 4)
            time.sleep(0.5)  # rank 0 names the new world before the new zerods look
            for r in (2, 3):
                rz.ResizeTest.add_zerod(self, world, r, 4)
            for r in (2, 3):
                world.daemons[r].wait_ready()
            loops = loops + sd.on_all([lambda r=r: grown(r) for r in (2, 3)])
            self.loops += loops[2:]
            staying.join(120)
            self.assertFalse(staying.is_alive(), "step 9 of ranks 0 and 1 hangs")
            self.assertEqual(got, [None, None], "step 9 of ranks 0 and 1 across the grow")
            self.assert_same(loops, 9, "step 9 across the grow")
            self.assertEqual([t.opt.world_size for t in loops], [4] * 4)
            self.assertLess(time.monotonic() - started, 60)
            self.train(loops, range(10, 12))
        except BaseException:
            sys.stderr.write(world.log())
            raise
        finally:
            for t in self.loops:
                t.opt.close()
            world.stop(check=False)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:])
