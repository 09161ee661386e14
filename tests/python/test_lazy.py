"""ZeroOptimizer(gather="lazy") against real zerod processes (W=1; W=2 runs through
test_conformance.py --lazy): step() returns at the step's commit, sent without its gather, and
each submodule's forward pre-hook waits for its own buckets' gathers.

- The hooks: after step() the gathers are pending (the optimizer says so); a forward of the first
  layer alone waits for the buckets up to that layer's and no further; the whole forward waits
  for the rest. Parameters read after wait_params() (synchronize) are torch's, bit for bit, and
  so is model.state_dict() taken right after step() (its hook waits).
- Bit for bit against torch: AdamW(foreach=False) with clipping (max_grad_norm against
  clip_grad_norm_, triggering on some steps), and ZeroSGD against torch.optim.SGD with momentum,
  each with overlap_update off and on; the optimizer's state_dict, checkpoint and close after a
  lazy step.
- A zerod lost between step() and the next forward: with a state_dir, zerod SIGKILLed right after
  step() returned and started again on the same socket; the next forward's wait registers the
  model again (the step was committed: the parameters are zerod's) and training continues bit for
  bit. Without a state_dir: the wait raises ZerodError naming the lost step, within the rejoin
  timeout, never a hang or a silently wrong value.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import unittest
import warnings
from typing import Any, Dict, List, Optional, Tuple

import common

torch = common.require_torch()

import zerod  # noqa: E402
import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402
from zerod.torch import ZeroOptimizer, ZeroSGD  # noqa: E402

BUCKET = "256"  # several buckets per model below
STEPS = 12


def make_model(seed: int = 5) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48),
                            torch.nn.Tanh(), torch.nn.Linear(48, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    # large inputs on every third step: gradients whose norm passes max_grad_norm
    scale = 30.0 if step % 3 == 0 else 1.0
    return torch.randn(8, 16, generator=g) * scale, torch.randn(8, 4, generator=g)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    return torch.nn.functional.mse_loss(model(x), y)


def tmpfs_root() -> str:
    for root in (os.environ.get("ZEROD_TEST_TMPFS", ""), "/dev/shm"):
        if root and os.path.isdir(root) and os.access(root, os.W_OK):
            return root
    common.skip("no writable /dev/shm for the state_dir")
    return ""


def restart_same_socket(old: zerod.testing.LocalZerod) -> zerod.testing.LocalZerod:
    d = zerod.testing.LocalZerod(list(old.args), log_level="info", start=False)
    d.socket = old.socket
    if os.path.exists(d.socket):
        os.unlink(d.socket)
    d.start()
    return d


class LazyTest(unittest.TestCase):
    def zerod(self, *extra: str) -> zerod.testing.LocalZerod:
        d = zerod.testing.LocalZerod(["--bucket_elems", BUCKET, *extra], log_level="info")
        self.addCleanup(d.stop)
        return d

    def pair(self, d: zerod.testing.LocalZerod, kind: str, clip: float = 0.0
             ) -> Tuple[torch.nn.Module, Any, torch.nn.Module, Any]:
        model, ref = make_model(), make_model()
        if kind == "sgd":
            opt = ZeroSGD(model.parameters(), lr=0.05, momentum=0.9, socket=d.socket,
                          gather="lazy", module=model)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        else:
            opt = ZeroOptimizer(model.parameters(), lr=3e-3, max_grad_norm=clip,
                                socket=d.socket, gather="lazy", module=model)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
        self.addCleanup(opt.close)
        return model, opt, ref, ref_opt

    def ref_step(self, ref: torch.nn.Module, ref_opt: Any, step: int, clip: float) -> None:
        ref_opt.zero_grad()
        loss_of(ref, step).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(ref.parameters()), clip)
        ref_opt.step()

    def assert_equal_params(self, model: torch.nn.Module, ref: torch.nn.Module, when: str
                            ) -> None:
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            self.assertTrue(torch.equal(a, b), f"{when}: {common.first_difference(n, a, b)}")

    def train(self, kind: str, overlap: bool, clip: float = 0.0) -> None:
        d = self.zerod(*(["--overlap_update", "1"] if overlap else []))
        model, opt, ref, ref_opt = self.pair(d, kind, clip)
        self.assertGreaterEqual(opt.info.nbuckets, 3)
        clipped = 0
        for step in range(STEPS):
            opt.zero_grad()
            loss = loss_of(model, step)  # the forward waits for the last step's gathers
            self.assertTrue(torch.equal(loss, loss_of(ref, step)),
                            f"step {step + 1}'s forward read other parameters than torch's")
            self.ref_step(ref, ref_opt, step, clip)
            loss.backward()
            opt.step()
            self.assertTrue(opt._lazy_owed, f"step {step + 1} returned with its gathers done")
            if clip and opt.last_result.clip_coef < 1.0:
                clipped += 1
            if step % 4 == 3:
                opt.wait_params()
                self.assertFalse(opt._lazy_owed)
                self.assert_equal_params(model, ref, f"after step {step + 1}")
        # The loss of the next forward (hooks) is the reference's: the forward read step STEPS's
        # parameters.
        self.assertTrue(torch.equal(loss_of(model, STEPS), loss_of(ref, STEPS)),
                        "a forward after a lazy step read other parameters than torch's")
        self.assertFalse(opt._lazy_owed)
        self.assert_equal_params(model, ref, "at the end")
        if clip:
            self.assertGreater(clipped, 0, "clipping never triggered")
            self.assertLess(clipped, STEPS, "clipping triggered on every step")
        self.assertEqual(opt.step_count, STEPS)

    def test_adamw_clip(self) -> None:
        self.train("adamw", False, clip=8.0)

    def test_adamw_clip_overlap(self) -> None:
        self.train("adamw", True, clip=8.0)

    def test_sgd(self) -> None:
        self.train("sgd", False)

    def test_sgd_overlap(self) -> None:
        self.train("sgd", True)

    def test_hooks_and_reads(self) -> None:
        """Each submodule waits for its own buckets; state_dict() right after step() is the
        step's; the optimizer's state_dict, checkpoint and close after a lazy step."""
        ckpt = tempfile.mkdtemp(prefix="zerod-lazy-ckpt-")
        self.addCleanup(shutil.rmtree, ckpt, True)
        d = self.zerod("--overlap_update", "1", "--checkpoint_dir", ckpt)
        model, opt, ref, ref_opt = self.pair(d, "adamw")
        first_bucket_top = max(pi.bucket for pi, p in zip(opt._pinfo, opt._params)
                               if any(p is q for q in model[0].parameters()))
        self.assertLess(first_bucket_top + 1, opt.info.nbuckets, "one bucket holds layer 0")
        for step in range(3):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
            self.ref_step(ref, ref_opt, step, 0.0)
        self.assertTrue(opt._lazy_owed)
        with torch.no_grad():
            model[0](batch(3)[0])  # the first layer alone: its buckets, not the others
        self.assertEqual(opt._lazy_done, first_bucket_top + 1)
        self.assertTrue(opt._lazy_owed)
        sd = model.state_dict()  # its hook waits for the rest
        self.assertFalse(opt._lazy_owed)
        for n, b in zip(sd, ref.parameters()):
            self.assertTrue(torch.equal(sd[n], b), f"state_dict() after step(): {n}")

        opt.zero_grad()
        loss_of(model, 3).backward()
        opt.step()
        self.ref_step(ref, ref_opt, 3, 0.0)
        self.assertEqual(opt.state_dict()["zerod"]["step"], 4)  # waits, then reads
        self.assertFalse(opt._lazy_owed)
        opt.zero_grad()
        loss_of(model, 4).backward()
        opt.step()
        self.ref_step(ref, ref_opt, 4, 0.0)
        step, _ = opt.checkpoint()
        self.assertEqual(step, 5)
        opt.zero_grad()
        loss_of(model, 5).backward()
        opt.step()
        self.ref_step(ref, ref_opt, 5, 0.0)
        opt.synchronize()  # the alias
        self.assert_equal_params(model, ref, "after synchronize()")
        opt.zero_grad()
        loss_of(model, 6).backward()
        opt.step()
        self.ref_step(ref, ref_opt, 6, 0.0)
        opt.close()  # waits for the gathers before the parameters get private copies
        self.assert_equal_params(model, ref, "after close()")
        with self.assertRaises(ValueError):
            ZeroOptimizer(model.parameters(), socket=d.socket, gather="lazy")  # no module

    def lose_zerod(self, daemons: List[zerod.testing.LocalZerod], opt: Any,
                   unanswered: bool) -> None:
        """SIGKILLs the last zerod and starts another on its socket with its settings. With
        unanswered, the gathers are sent again after the kill, as if zerod had died before
        answering them (at W=1 it answers within microseconds of step(), so a kill rarely lands
        before): the next wait meets the loss itself."""
        if unanswered:
            opt.wait_params()
        common.stop_zerod(daemons[-1], signal.SIGKILL)
        daemons.append(restart_same_socket(daemons[-1]))
        if unanswered:
            opt._lazy_owed = True
            opt._lazy_next = opt._lazy_done = 0
            opt._lazy_gathers = []

    def test_zerod_killed_after_step(self) -> None:
        """state_dir: SIGKILL right after step() returned; the next forward heals, bit for bit."""
        top = tempfile.mkdtemp(prefix="zerod-lazy-", dir=tmpfs_root())
        self.addCleanup(shutil.rmtree, top, True)
        d = zerod.testing.LocalZerod(["--bucket_elems", BUCKET, "--overlap_update", "1",
                                      "--state_dir", os.path.join(top, "state")],
                                     log_level="info")
        daemons = [d]
        self.addCleanup(lambda: [x.stop(signal.SIGKILL, check=False) for x in daemons])
        model, opt, ref, ref_opt = self.pair(d, "adamw")
        opt.rejoin_timeout_s = 30.0
        for step in range(8):
            opt.zero_grad()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = loss_of(model, step)
            if step in (3, 6):
                self.assertTrue(any("registering the model again" in str(w.message)
                                    for w in caught), f"step {step + 1}: the forward's wait "
                                                      f"did not register the model again")
            self.assertTrue(torch.equal(loss, loss_of(ref, step)),
                            f"step {step + 1}'s forward read other parameters than torch's")
            loss.backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # step()'s own rejoin after a plain kill
                opt.step()
            self.ref_step(ref, ref_opt, step, 0.0)
            if step in (2, 5):  # zerod lost between step() and the next forward
                self.lose_zerod(daemons, opt, unanswered=True)
            if step == 4:  # and answered already: step() meets the loss
                self.lose_zerod(daemons, opt, unanswered=False)
        opt.wait_params()
        self.assert_equal_params(model, ref, "after three zerods lost between steps")
        self.assertEqual(opt.step_count, 8)

    def test_zerod_killed_no_state_dir(self) -> None:
        """No state_dir: the forward's wait raises ZerodError naming the lost step, within the
        rejoin timeout (no hang, no silently wrong value)."""
        d = zerod.testing.LocalZerod(["--bucket_elems", BUCKET], log_level="info")
        daemons = [d]
        self.addCleanup(lambda: [x.stop(signal.SIGKILL, check=False) for x in daemons])
        model, opt, _, _ = self.pair(d, "adamw")
        opt.rejoin_timeout_s = 10.0
        for step in range(2):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
        self.lose_zerod(daemons, opt, unanswered=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.assertRaises(ZerodError) as cm:
                loss_of(model, 2)
        self.assertIn("step 2 was lost with zerod", str(cm.exception))
        self.assertFalse(opt._lazy_owed)


if __name__ == "__main__":
    common.run(LazyTest)
