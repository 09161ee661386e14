"""zerod's overlapped update (overlap_update = 1): each bucket is updated speculatively as its
scatter completes, into the second set of state arrays, and the step commits it only when its
decision applies exactly what the speculation applied; otherwise the bucket is updated again from
the untouched committed set (docs/design.md, "The overlapped update").

Every test of test_optimizer.py runs again against a zerod with the setting on (clipping, fp16
gradients with a loss-scaler overflow, amsgrad, schedulers, state_dict resume, ...: bitwise against
torch's optimizer), and the tests below check the speculation's own cases: committed when nothing
changes, committed too when a scheduler changes the lr before backward (the first scatter carries
it), recomputed when clipping triggers on some steps or the lr changes between backward and step(),
dropped on an overflow, and a checkpoint written and resumed with the setting on; and, at world
size 2, steps without their gather (answered at the commit, the parameters written beside the
gathers that follow) against a zerod without the setting. The other world-size-2 cases
(conformance, a trainer killed mid-step) are test_conformance.py --overlap and test_abandon.py
--overlap.
"""

from __future__ import annotations

import os
import tempfile
import threading
import unittest
from typing import Dict

import common

torch = common.require_torch()
import test_optimizer as base  # noqa: E402
import zerod  # noqa: E402
import zerod.testing  # noqa: E402
from zerod.torch import ZeroOptimizer  # noqa: E402

small_model, loss_of = base.small_model, base.loss_of


class OverlapOptimizerTest(base.OptimizerTest):
    """test_optimizer.py's tests, and the speculation's own, with overlap_update = 1."""

    @classmethod
    def setUpClass(cls) -> None:
        cls.daemon = zerod.testing.LocalZerod(
            ["--bucket_elems", "256", "--overlap_update", "1"], log_level="info")

    def counters(self, opt: ZeroOptimizer) -> Dict[str, int]:
        s = opt.client.rank_status()
        return {k: int(s[k]) for k in ("state_sets", "overlap_buckets_committed",
                                       "overlap_buckets_recomputed", "scatters")}

    def test_overlap_committed_when_nothing_changes(self) -> None:
        model, ref = small_model(), small_model()
        opt = self.make(model, lr=1e-2, weight_decay=0.1)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        before = self.counters(opt)
        self.assertEqual(before["state_sets"], 2)
        for step in range(6):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                loss_of(m, step).backward()
                o.step()
            self.assert_equal_params(model, ref, f"step {step + 1}")
        after = self.counters(opt)
        nb = opt.info.nbuckets
        self.assertGreater(nb, 1)
        self.assertEqual(after["overlap_buckets_committed"] - before["overlap_buckets_committed"],
                         6 * nb, "every bucket of every step committed as speculated")
        self.assertEqual(after["overlap_buckets_recomputed"], before["overlap_buckets_recomputed"])

    def test_overlap_lr_changed_between_backward_and_step(self) -> None:
        model, ref = small_model(), small_model()
        opt = self.make(model, lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        before = self.counters(opt)
        for step in range(5):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                loss_of(m, step).backward()
                if step % 2 == 1:  # a scheduler's change after backward: the speculation is void
                    for g in o.param_groups:
                        g["lr"] = 1e-2 * (1 + step)
                o.step()
            self.assert_equal_params(model, ref, f"step {step + 1}")
        after = self.counters(opt)
        nb = opt.info.nbuckets
        # steps 1, 3, 5 keep the lr zerod had (committed); 2 and 4 change it (recomputed)
        self.assertEqual(after["overlap_buckets_recomputed"] - before["overlap_buckets_recomputed"],
                         2 * nb)
        self.assertEqual(after["overlap_buckets_committed"] - before["overlap_buckets_committed"],
                         3 * nb)

    def test_overlap_scheduler_before_backward(self) -> None:
        """An lr changed after every step (where torch's schedulers change it): the next step's
        first scatter carries it (zd_set_next_groups), the speculation uses it, and every bucket
        commits; on step 4 it changes again between backward and step(): that step's buckets
        are updated again."""
        model, ref = small_model(), small_model()
        opt = self.make(model, lr=1e-2, weight_decay=0.1)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        before = self.counters(opt)
        for step in range(6):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                loss_of(m, step).backward()
                if step == 3:
                    for g in o.param_groups:
                        g["lr"] *= 0.5
                o.step()
                for g in o.param_groups:  # the scheduler's step, for the next one
                    g["lr"] = 1e-2 / (2 + step)
            self.assert_equal_params(model, ref, f"step {step + 1}")
        after = self.counters(opt)
        nb = opt.info.nbuckets
        self.assertEqual(after["overlap_buckets_committed"] - before["overlap_buckets_committed"],
                         5 * nb, "every bucket of the steps whose lr was set before backward")
        self.assertEqual(after["overlap_buckets_recomputed"] - before["overlap_buckets_recomputed"],
                         nb, "the step whose lr changed after backward")

    def test_overlap_next_groups_client(self) -> None:
        """The client's zd_set_next_groups: checked like a step's groups, sent with the next
        scatter only; groups the step does not apply cost a second update, not the bits."""
        model, ref = small_model(), small_model()
        opt = self.make(model, lr=1e-2, overlap=False)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        c = opt.client
        with self.assertRaises(zerod.ZerodError) as e:
            c.set_next_groups([zerod.Group(lr=1e-2)] * 2)
        self.assertEqual(e.exception.name, "ZD_EGROUP")
        with self.assertRaises(zerod.ZerodError) as e:
            c.set_next_groups([zerod.Group(lr=-1.0)])
        self.assertEqual(e.exception.name, "ZD_EHPARAM")
        before = self.counters(opt)
        nb = opt.info.nbuckets
        for step, told in enumerate((2e-2, 1e-2)):  # told: what the scatters say the lr is
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                loss_of(m, step).backward()
            told_groups = opt._current_hparams()  # the model's (its formula), the lr told
            for g in told_groups:
                g.lr = told
            c.set_next_groups(told_groups)
            for b in reversed(range(nb)):
                c.scatter(b)
            c.step(scatter=False)
            ropt.step()
            self.assert_equal_params(model, ref, f"step {step + 1}")
        after = self.counters(opt)
        self.assertEqual(after["overlap_buckets_recomputed"] - before["overlap_buckets_recomputed"],
                         nb, "step 1: told 2e-2, applied 1e-2")
        self.assertEqual(after["overlap_buckets_committed"] - before["overlap_buckets_committed"],
                         nb, "step 2: told what it applied")

    def test_overlap_clipping_on_some_steps(self) -> None:
        model, ref = small_model(), small_model()
        max_norm = 0.5
        opt = self.make(model, lr=1e-2, max_grad_norm=max_norm)
        opt._clip_norm = "double"  # the update bitwise given zerod's coefficient (test_optimizer)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        before = self.counters(opt)
        clipped = 0
        for step in range(6):
            factor = 20.0 if step % 2 else 0.05  # large gradients clip, small ones do not
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                (loss_of(m, step) * factor).backward()
            opt.step()
            r = opt.last_result
            with torch.no_grad():
                for p in ref.parameters():
                    p.grad.mul_(r.clip_coef)
            ropt.step()
            clipped += r.clip_coef < 1.0
            self.assertEqual(r.clip_coef < 1.0, step % 2 == 1, f"step {step + 1}")
            self.assert_equal_params(model, ref, f"step {step + 1}")
        after = self.counters(opt)
        nb = opt.info.nbuckets
        self.assertEqual(clipped, 3)
        self.assertEqual(after["overlap_buckets_recomputed"] - before["overlap_buckets_recomputed"],
                         3 * nb)
        self.assertEqual(after["overlap_buckets_committed"] - before["overlap_buckets_committed"],
                         3 * nb)

    def test_overlap_overflow_dropped(self) -> None:
        model = small_model()
        scaler = {"initial_scale": 1024.0, "hysteresis": 1, "backoff_factor": 0.5,
                  "growth_interval": 100, "growth_factor": 2.0}
        opt = self.make(model, lr=1e-2, grad_dtype=torch.float16, loss_scaler=scaler)
        before = self.counters(opt)
        opt.zero_grad()
        opt.scale_loss(loss_of(model, 0) * float("inf")).backward()
        params = [p.detach().clone() for p in model.parameters()]
        opt.step()
        self.assertFalse(opt.last_result.applied)
        for p, b in zip(model.parameters(), params):
            self.assertTrue(torch.equal(p, b), "a skipped step leaves the params alone")
        after = self.counters(opt)
        self.assertEqual(after["overlap_buckets_committed"], before["overlap_buckets_committed"])
        status = opt.client.rank_status()
        self.assertEqual(int(status["step"]), 0)


class OverlapCheckpointTest(unittest.TestCase):
    """A checkpoint written with overlap_update = 1 (of the committed set) and resumed by a new
    zerod with the setting on: training continues bitwise as torch's AdamW without a break."""

    def test_checkpoint_and_resume(self) -> None:
        tag = "overlap_ckpt"
        model, ref = small_model(), small_model()
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)

        def named(m):
            return [(f"{tag}.{n}", p) for n, p in m.named_parameters()]

        def train(m, o, steps):
            for step in steps:
                for mm, oo in ((m, o), (ref, ropt)):
                    oo.zero_grad()
                    loss_of(mm, step).backward()
                    oo.step()
                common.assert_params_equal(self, m.named_parameters(), ref.named_parameters(),
                                           f"step {step + 1}")

        with tempfile.TemporaryDirectory() as tmp:
            os.makedirs(os.path.join(tmp, "ckpt"))
            args = ["--bucket_elems", "256", "--overlap_update", "1", "--checkpoint_dir",
                    os.path.join(tmp, "ckpt")]
            d = zerod.testing.LocalZerod(args, log_level="info")
            try:
                opt = ZeroOptimizer(named(model), lr=1e-2, weight_decay=0.1, socket=d.socket,
                                    replace=True)
                train(model, opt, range(5))  # an odd number: set 1 is the committed one
                self.assertEqual(opt.client.rank_status()["committed_set"], "1")
                step, where = opt.checkpoint()
                self.assertEqual(step, 5)
                opt.close()
            finally:
                d.stop()
            d = zerod.testing.LocalZerod(args + ["--resume", "latest"], log_level="info")
            try:
                model2 = small_model(seed=77)
                opt2 = ZeroOptimizer(named(model2), lr=1e-2, weight_decay=0.1, socket=d.socket)
                self.assertTrue(opt2.resumed)
                self.assertEqual(opt2.step_count, 5)
                common.assert_params_equal(self, model2.named_parameters(),
                                           ref.named_parameters(), "resumed")
                train(model2, opt2, range(5, 10))
                st = opt2.client.rank_status()
                self.assertGreater(int(st["overlap_buckets_committed"]), 0)
                opt2.close()
            finally:
                d.stop()


class OverlapNoGatherWorldTest(unittest.TestCase):
    """Steps without their gather at world size 2 (two local ranks, a client each, in threads),
    the offload path's pattern at W > 1: with the setting on zerod answers each at its commit and
    the speculation thread writes the buckets' parameters beside the gathers that follow, bucket
    by bucket. Every rank's gathered parameters after each step must equal, bit for bit, those of
    the same steps sent with their gather to a zerod without the setting."""

    N, STEPS = 16 * 256, 4  # 16 parameters of 256 elements, a bucket each

    def run_world(self, overlap: bool, no_gather: bool) -> list:
        args = ["--bucket_elems", "256", "--world_size", "2", "--local_ranks", "2"]
        d = zerod.testing.LocalZerod(args + (["--overlap_update", "1"] if overlap else []),
                                     log_level="info")
        out: list = [[], []]
        errors: list = []

        def rank(r: int) -> None:
            try:
                with zerod.Client(d.socket, local_rank=r) as c:
                    c.layout([(f"w{i}", (256,)) for i in range(self.N // 256)],
                             [{"lr": 1e-2, "weight_decay": 0.05}], replace=True)
                    torch.frombuffer(c.param_buffer, dtype=torch.float32).copy_(
                        torch.linspace(-1.0, 1.0, self.N))
                    info = c.register()
                    if info.nbuckets < 8:
                        raise AssertionError(f"{info.nbuckets} buckets: too few to overlap")
                    for s in range(self.STEPS):
                        g = torch.sin(torch.arange(self.N, dtype=torch.float32) * (0.01 + s)
                                      + r) * 1e-2
                        torch.frombuffer(c.grad_buffer, dtype=torch.float32).copy_(g)
                        if no_gather:
                            c.scatter()  # speculated with the setting on
                            c.step(scatter=False, gather=False)
                            for b in range(info.nbuckets):
                                c.gather(b)
                        else:
                            c.step()
                        out[r].append(
                            torch.frombuffer(c.param_buffer, dtype=torch.float32).clone())
                    if overlap:
                        committed = int(c.rank_status()["overlap_buckets_committed"])
                        if committed < info.nbuckets * self.STEPS // 2:
                            raise AssertionError(f"rank {r}: {committed} buckets committed "
                                                 f"from their speculation")
            except BaseException as e:  # reported by the test's thread
                errors.append(e)

        try:
            threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        finally:
            d.stop()
        if errors:
            raise errors[0]
        return out

    def test_steps_without_gather(self) -> None:
        want = self.run_world(overlap=False, no_gather=False)
        got = self.run_world(overlap=True, no_gather=True)
        for r in range(2):
            for s in range(self.STEPS):
                same = bool((got[r][s].view(torch.int32) == want[r][s].view(torch.int32)).all())
                self.assertTrue(same, common.first_difference(f"rank {r} step {s + 1}",
                                                              got[r][s], want[r][s]))


if __name__ == "__main__":
    common.run(OverlapOptimizerTest, OverlapCheckpointTest, OverlapNoGatherWorldTest)
