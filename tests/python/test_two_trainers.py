"""Two trainers in one process (two threads, each with its own model and ZeroOptimizer on local
ranks 0 and 1 of one zerod started with --local_ranks 2), bitwise against torch's AdamW on a copy
of the model: the ways a user drives a training loop (optimizer or model zero_grad, set_to_none,
concurrent backward, an lr scheduler), and gradients changed between backward and step() with
overlap=True (clip_grad_norm_), which the backward hooks had already scattered: step() must
scatter them again, or zerod steps with the gradients as backward left them (a silent wrong
result at world size > 1, where a scatter reads the grad buffer when zerod runs it).
"""

from __future__ import annotations

import copy
import threading
import unittest
import warnings
from typing import Any, Dict, List

import common

torch = common.require_torch()
import torch.nn as nn  # noqa: E402

import zerod.testing  # noqa: E402
from zerod.torch import ZeroOptimizer  # noqa: E402

STEPS = 5


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 8))


def batches() -> List[Any]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=g) for _ in range(STEPS)]


def train(model: nn.Module, opt: Any, xs: List[Any], how: Dict[str, Any],
          barrier: Any = None) -> None:
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if how.get("sched") else None
    for x in xs:
        zg = how.get("zero_grad", "opt")
        if zg == "opt":
            opt.zero_grad()
        elif zg == "model":
            model.zero_grad()
        elif zg == "model_none":
            model.zero_grad(set_to_none=True)
        loss = model(x).square().sum()
        if barrier is not None:  # both threads' backward at once
            barrier.wait()
        loss.backward()
        if how.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), how["clip"])
        opt.step()
        if sched is not None:
            sched.step()


class TwoTrainersTest(unittest.TestCase):
    def run_pair(self, how: Dict[str, Any], overlap: bool = True) -> List[Any]:
        """Trains the reference and the two threads; returns the warnings the threads saw."""
        base, xs = make_model(), batches()
        ref = copy.deepcopy(base)
        train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), xs, how)
        models = [copy.deepcopy(base) for _ in range(2)]
        errors: List[BaseException] = []
        caught: List[Any] = []
        barrier = threading.Barrier(2, timeout=60) if how.get("barrier") else None
        with zerod.testing.LocalWorld(2, args=["--bucket_elems", "256"], log_level="info") as w:
            def run(r: int) -> None:
                try:
                    sock, local = w.endpoint(r)
                    opt = ZeroOptimizer(models[r].parameters(), lr=1e-2, socket=sock,
                                        local_rank=local, overlap=overlap)
                    try:
                        train(models[r], opt, xs, how, barrier)
                    finally:
                        opt.close()
                except BaseException as e:  # reported by the main thread
                    errors.append(e)
                    if barrier is not None:
                        barrier.abort()

            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=120)
                caught = [str(x.message) for x in rec]
        self.assertEqual(errors, [], f"{how}: a trainer failed")
        for r in range(2):
            common.assert_params_equal(self, list(models[r].named_parameters()),
                                       list(ref.named_parameters()), f"{how} rank {r}")
        return caught

    def test_training_loops(self) -> None:
        for how in ({}, {"zero_grad": "model"}, {"zero_grad": "model_none", "barrier": True},
                    {"zero_grad": "none", "barrier": True}, {"sched": True, "barrier": True}):
            with self.subTest(**how):
                self.run_pair(how)

    def test_clip_between_backward_and_step(self) -> None:
        # The hooks scattered every bucket during backward; clip_grad_norm_ then scaled the
        # grad buffer in place. step() sees the buffer's version changed, scatters every
        # bucket again and warns once per optimizer.
        caught = self.run_pair({"clip": 0.5})
        changed = [m for m in caught if "gradients changed after backward" in m]
        self.assertEqual(len(changed), 2, f"one warning per trainer expected: {caught}")
        self.assertIn("max_grad_norm", changed[0])

    def test_clip_without_overlap(self) -> None:
        caught = self.run_pair({"clip": 0.5}, overlap=False)
        self.assertEqual([m for m in caught if "gradients changed" in m], [])


if __name__ == "__main__":
    common.run(TwoTrainersTest)
