"""Tests of zerod.torch.ZeroOptimizer's behaviour against a real zerod: parameters and gradients
as views of the shared buffers (and autograd accumulating into them in place), per-bucket
scatter from the backward hooks, gradient accumulation with no_sync(), hyperparameters sent only
when they change, Adam (L2), maximize, amsgrad, clipping, bf16 params with fp32 main grads, fp16 grads
with loss scaling, state_dict/load_state_dict with reattach, close(), and the errors. Every
training check is bitwise against torch's own optimizer on a copy of the model.
"""

from __future__ import annotations

import copy
import math
import struct
import unittest
import warnings
from typing import Any, List, Optional

import common

torch = common.require_torch()
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import models  # noqa: E402
import zerod  # noqa: E402
import zerod.testing  # noqa: E402
from zerod.torch import ZeroOptimizer  # noqa: E402


def small_model(seed: int = 5) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 3))


def data(step: int, micro: int = 0, n: int = 16):
    g = torch.Generator().manual_seed(step * 131 + micro)
    return torch.randn(n, 8, generator=g), torch.randn(n, 3, generator=g)


def loss_of(model: nn.Module, step: int, micro: int = 0, dtype=torch.float32) -> torch.Tensor:
    x, y = data(step, micro)
    return F.mse_loss(model(x.to(dtype)).float(), y)


def f32_ulps(a: float, b: float) -> int:
    """How many fp32 values apart a and b are, once rounded to fp32 (both of the same sign)."""
    ia, ib = (struct.unpack("<i", struct.pack("<f", x))[0] for x in (a, b))
    return abs(ia - ib)


class OptimizerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        # 256-element buckets: the small model spans several.
        cls.daemon = zerod.testing.LocalZerod(["--bucket_elems", "256"], log_level="info")

    @classmethod
    def tearDownClass(cls) -> None:
        cls.daemon.stop()

    def scatters(self, opt: ZeroOptimizer) -> int:
        """zerod's scatter counter of the rank (counts since the daemon started)."""
        return int(opt.client.rank_status()["scatters"])

    def named(self, model: nn.Module) -> List[Any]:
        """The model's named parameters, the names prefixed with the test's: every test
        registers a model of its own, which replaces the previous test's (with the same names,
        zerod would resume the previous test's state, as it does for a reattaching trainer)."""
        return [(f"{self._testMethodName}.{n}", p) for n, p in model.named_parameters()]

    def make(self, model: nn.Module, params: Any = None, **kw: Any) -> ZeroOptimizer:
        kw.setdefault("replace", True)
        opt = ZeroOptimizer(self.named(model) if params is None else params,
                            socket=self.daemon.socket, **kw)
        self.addCleanup(opt.close)
        return opt

    def assert_equal_params(self, a: nn.Module, b: nn.Module, where: str) -> None:
        common.assert_params_equal(self, a.named_parameters(), b.named_parameters(), where)

    # ---- buffers and views ----------------------------------------------------------------------

    def test_params_and_grads_are_buffer_views(self) -> None:
        model = small_model()
        before = [p.detach().clone() for p in model.parameters()]
        opt = self.make(model)
        pbase, gbase = opt.client.param_address, opt.client.grad_address
        size = opt.info.total_elems * 4
        for p, b, pi in zip(model.parameters(), before, opt.client.params_info()):
            self.assertEqual(p.data_ptr(), pbase + 4 * pi.offset)
            self.assertEqual(p.grad.data_ptr(), gbase + 4 * pi.offset)
            self.assertTrue(pbase <= p.data_ptr() < pbase + size)
            self.assertTrue(torch.equal(p, b), "initial values copied into the buffer")
            self.assertTrue(p.is_leaf and p.requires_grad)
        ptrs = [p.grad.data_ptr() for p in model.parameters()]
        # The finding this design rests on (torch 1.13): autograd accumulates into a preset
        # .grad in place, so backward writes straight into zerod's grad buffer.
        loss_of(model, 0).backward()
        with opt.no_sync():
            loss_of(model, 1).backward()
        self.assertEqual([p.grad.data_ptr() for p in model.parameters()], ptrs)
        gflat = opt._gflat
        self.assertGreater(float(gflat.abs().sum()), 0.0)
        opt.zero_grad(set_to_none=True)  # accepted, but the views stay
        self.assertEqual([p.grad.data_ptr() for p in model.parameters()], ptrs)
        self.assertEqual(float(gflat.abs().sum()), 0.0)
        # zerod's update lands in the model's own parameters
        loss_of(model, 0).backward()
        w = model[0].weight.detach().clone()
        opt.step()
        self.assertFalse(torch.equal(w, model[0].weight))
        self.assertEqual(model[0].weight.data_ptr(), pbase)

    def test_create_graph_replaces_grad_and_hook_restores_view(self) -> None:
        model, ref = small_model(), small_model()
        opt = self.make(model, lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        ptrs = [p.grad.data_ptr() for p in model.parameters()]
        for step in range(3):
            opt.zero_grad()
            ropt.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's create_graph reference-cycle warning
                loss_of(model, step).backward(create_graph=True)
                loss_of(ref, step).backward(create_graph=True)
            self.assertEqual([p.grad.data_ptr() for p in model.parameters()], ptrs)
            opt.step()
            ropt.step()
            self.assert_equal_params(model, ref, f"step {step + 1}")
        for p in ref.parameters():  # break torch's create_graph reference cycle
            p.grad = None

    def test_user_replaced_grads_are_used(self) -> None:
        model, ref = small_model(), small_model()
        opt = self.make(model, lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        for m in (model, ref):
            for i, p in enumerate(m.parameters()):
                p.grad = torch.full_like(p, 0.01 * (i + 1))  # not the buffer view
        opt.step()
        ropt.step()
        self.assert_equal_params(model, ref, "after a step with assigned grads")
        self.assertEqual(model[0].weight.grad.data_ptr(), opt.client.grad_address)

    # ---- communication ----------------------------------------------------------------------

    def test_buckets_scattered_during_backward(self) -> None:
        model = small_model()
        opt = self.make(model)
        nb = opt.info.nbuckets
        self.assertGreaterEqual(nb, 3)
        sent: List[int] = []
        calls: List[Optional[list]] = []
        real_scatter, real_step = opt.client.scatter_start, opt.client.step_start

        def scatter_start(bucket: int = -1):
            sent.append(bucket)
            return real_scatter(bucket)

        def step_start(groups=None, **kw):
            calls.append((groups, kw))
            return real_step(groups, **kw)

        before = self.scatters(opt)
        opt.client.scatter_start = scatter_start  # type: ignore[assignment]
        opt.client.step_start = step_start  # type: ignore[assignment]
        loss_of(model, 0).backward()
        # every bucket was sent from the hooks before step(), the last layers' first
        self.assertEqual(sorted(sent), list(range(nb)))
        self.assertEqual(sent[0], nb - 1)
        opt.step()
        self.assertEqual(len(sent), nb, "step() sends no scatter of its own")
        self.assertEqual(calls[-1][1], {"scatter": False})
        self.assertIsNone(calls[-1][0], "hyperparameters unchanged: not sent")
        for g in opt.param_groups:
            g["lr"] = 0.5e-3
        opt.zero_grad()
        loss_of(model, 1).backward()
        opt.step()
        self.assertEqual(calls[-1][0][0].lr, 0.5e-3, "changed hyperparameters are sent")
        opt.zero_grad()
        loss_of(model, 2).backward()
        opt.step()
        self.assertIsNone(calls[-1][0])
        self.assertEqual(self.scatters(opt) - before, 3 * nb)

    def test_scatter_order_is_canonical(self) -> None:
        # Layers used in the reverse of their registration order: backward completes bucket 0
        # first, but the scatters must still go out in descending bucket order on every rank.
        class Reversed(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(3)
                self.a = nn.Linear(32, 3)
                self.b = nn.Linear(32, 32)
                self.c = nn.Linear(8, 32)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.a(torch.tanh(self.b(torch.tanh(self.c(x)))))

        model = Reversed()
        ref = copy.deepcopy(model)
        opt = self.make(model, lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        nb = opt.info.nbuckets
        self.assertGreaterEqual(nb, 3)
        sent: List[int] = []
        real = opt.client.scatter_start

        def scatter_start(bucket: int = -1):
            sent.append(bucket)
            return real(bucket)

        opt.client.scatter_start = scatter_start  # type: ignore[assignment]
        for step in range(3):
            opt.zero_grad()
            ropt.zero_grad()
            loss_of(model, step).backward()
            loss_of(ref, step).backward()
            self.assertEqual(sent[-nb:], list(reversed(range(nb))))
            opt.step()
            ropt.step()
            self.assert_equal_params(model, ref, f"step {step + 1}")

    def test_unused_parameter_and_frozen_parameter(self) -> None:
        model, ref = small_model(), small_model()
        extra = nn.Parameter(torch.ones(5))  # never used in forward
        frozen = model[2].bias
        frozen.requires_grad_(False)
        ref[2].bias.requires_grad_(False)
        opt = self.make(model, [*self.named(model), ("extra", extra)], lr=1e-2,
                        weight_decay=0.1)
        self.assertEqual(len(opt.client.params_info()), 6, "the frozen bias is not registered")
        frozen_before = frozen.detach().clone()
        ref_extra = nn.Parameter(torch.ones(5))
        ropt = torch.optim.AdamW([*ref.parameters(), ref_extra], lr=1e-2, weight_decay=0.1,
                                 foreach=False)
        for step in range(3):
            opt.zero_grad(set_to_none=False)
            ropt.zero_grad(set_to_none=False)  # torch steps `extra` with zero grads too
            loss_of(model, step).backward()
            loss_of(ref, step).backward()
            if ref_extra.grad is None:
                ref_extra.grad = torch.zeros_like(ref_extra)
            opt.step()
            ropt.step()
            self.assert_equal_params(model, ref, f"step {step + 1}")
            self.assertTrue(torch.equal(extra, ref_extra))
        self.assertTrue(torch.equal(frozen, frozen_before))
        self.assertLess(float(extra[0]), 1.0, "weight decay applied to the unused parameter")
        # set_to_none=True (torch 2.x's default): `extra` has no gradient, and both skip it.
        extra_before = extra.detach().clone()
        for step in range(3, 5):
            opt.zero_grad(set_to_none=True)
            ropt.zero_grad(set_to_none=True)
            loss_of(model, step).backward()
            loss_of(ref, step).backward()
            opt.step()
            ropt.step()
            self.assert_equal_params(model, ref, f"step {step + 1}")
            self.assertTrue(torch.equal(extra, ref_extra))
        self.assertTrue(torch.equal(extra, extra_before), "the unused parameter was skipped")

    def test_accumulation_no_sync(self) -> None:
        model, ref = small_model(), small_model()
        opt = self.make(model, lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        nb = opt.info.nbuckets
        before = self.scatters(opt)
        for step in range(4):
            opt.zero_grad()
            ropt.zero_grad()
            for micro in range(4):
                if micro < 3:
                    with opt.no_sync():
                        loss_of(model, step, micro).backward()
                        self.assertFalse(any(opt._scattered))
                else:
                    loss_of(model, step, micro).backward()
                    self.assertTrue(all(opt._scattered))
                loss_of(ref, step, micro).backward()
            opt.step()
            ropt.step()
            self.assert_equal_params(model, ref, f"step {step + 1}")
        self.assertEqual(self.scatters(opt) - before, 4 * nb)

    def test_accumulation_without_no_sync_rescatters(self) -> None:
        model, ref = small_model(), small_model()
        opt = self.make(model, lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        nb = opt.info.nbuckets
        before = self.scatters(opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for micro in range(3):
                loss_of(model, 0, micro).backward()
                loss_of(ref, 0, micro).backward()
        self.assertEqual(len([w for w in caught if "no_sync" in str(w.message)]), 1)
        opt.step()
        ropt.step()
        self.assert_equal_params(model, ref, "after accumulating without no_sync")
        self.assertEqual(self.scatters(opt) - before, 3 * nb)

    def test_overlap_off(self) -> None:
        model, ref = small_model(), small_model()
        opt = self.make(model, lr=1e-2, overlap=False)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        for step in range(3):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                loss_of(m, step).backward()
                self.assertFalse(any(opt._scattered))
                o.step()
            self.assert_equal_params(model, ref, f"step {step + 1}")

    # ---- update rules and options ----------------------------------------------------------

    def test_adam_l2_and_closure(self) -> None:
        model, ref = small_model(), small_model()
        opt = self.make(model, lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05,
                        optimizer="adam")
        ropt = torch.optim.Adam(ref.parameters(), lr=2e-3, betas=(0.8, 0.99), eps=1e-6,
                                weight_decay=0.05, foreach=False)
        for step in range(10):
            def closure(m=model, o=opt, s=step) -> torch.Tensor:
                o.zero_grad()
                loss = loss_of(m, s)
                loss.backward()
                return loss
            loss = opt.step(closure)
            ropt.step(lambda: (ropt.zero_grad(), loss_of(ref, step).backward())[0])
            self.assertIsInstance(loss, torch.Tensor)
            self.assert_equal_params(model, ref, f"Adam step {step + 1}")

    def test_maximize_adamw(self) -> None:
        # torch's maximize=True (the update follows -grad), as a constructor keyword.
        model, ref = small_model(), small_model()
        opt = self.make(model, lr=1e-2, weight_decay=0.1, maximize=True)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, maximize=True,
                                 foreach=False)
        self.assertIs(opt.param_groups[0]["maximize"], True)
        for step in range(8):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                loss_of(m, step).backward()
                o.step()
            self.assert_equal_params(model, ref, f"AdamW maximize step {step + 1}")

    def test_maximize_adam_per_group(self) -> None:
        # maximize as a key of one parameter group (Adam, L2 penalty), then switched on for the
        # other group between steps: sent to zerod with the changed hyperparameters.
        model, ref = small_model(), small_model()
        named = self.named(model)
        opt = self.make(model, [{"params": named[:2], "maximize": True}, {"params": named[2:]}],
                        lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, optimizer="adam")
        rparams = list(ref.parameters())
        ropt = torch.optim.Adam([{"params": rparams[:2], "maximize": True},
                                 {"params": rparams[2:]}], lr=2e-3, betas=(0.8, 0.99), eps=1e-6,
                                weight_decay=0.05, foreach=False)
        self.assertEqual([g["maximize"] for g in opt.param_groups], [True, False])
        for step in range(10):
            if step == 5:
                opt.param_groups[1]["maximize"] = ropt.param_groups[1]["maximize"] = True
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                loss_of(m, step).backward()
                o.step()
            self.assert_equal_params(model, ref, f"Adam maximize step {step + 1}")

    def test_amsgrad_adamw(self) -> None:
        # torch's amsgrad=True (the denominator takes the running max of exp_avg_sq), as a
        # constructor keyword, with a learning rate that changes and gradients whose scale drops
        # (so that the max stays above exp_avg_sq for many elements).
        model, ref = small_model(), small_model()
        opt = self.make(model, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, amsgrad=True)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1,
                                 amsgrad=True, foreach=False)
        self.assertIs(opt.param_groups[0]["amsgrad"], True)
        for step in range(12):
            for m, o in ((model, opt), (ref, ropt)):
                o.param_groups[0]["lr"] = 1e-2 * (1 + 0.1 * step)
                o.zero_grad()
                (loss_of(m, step) * 0.5 ** step).backward()
                o.step()
            self.assert_equal_params(model, ref, f"AdamW amsgrad step {step + 1}")

    def test_amsgrad_adam_per_group(self) -> None:
        # amsgrad as a key of one parameter group (Adam, L2 penalty, maximize in the other), turned
        # off and on again between steps: as in torch, max_exp_avg_sq stays as it was while off.
        model, ref = small_model(), small_model()
        named = self.named(model)
        opt = self.make(model, [{"params": named[:2], "amsgrad": True},
                                {"params": named[2:], "maximize": True}],
                        lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, optimizer="adam")
        rparams = list(ref.parameters())
        ropt = torch.optim.Adam([{"params": rparams[:2], "amsgrad": True},
                                 {"params": rparams[2:], "maximize": True}], lr=2e-3,
                                betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, foreach=False)
        self.assertEqual([g["amsgrad"] for g in opt.param_groups], [True, False])
        for step in range(12):
            if step in (4, 8):
                opt.param_groups[0]["amsgrad"] = ropt.param_groups[0]["amsgrad"] = step == 8
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                (loss_of(m, step) * (4.0 if step % 3 == 0 else 0.25)).backward()
                o.step()
            self.assert_equal_params(model, ref, f"Adam amsgrad step {step + 1}")

    def test_amsgrad_turned_on_later_is_refused(self) -> None:
        # torch keeps max_exp_avg_sq only for groups that had amsgrad from their first step (it
        # raises KeyError otherwise); zerod allocates it at registration and refuses likewise.
        model = small_model()
        opt = self.make(model, lr=1e-2)
        loss_of(model, 0).backward()
        opt.step()
        opt.param_groups[0]["amsgrad"] = True
        opt.zero_grad()
        loss_of(model, 1).backward()
        with self.assertRaises(zerod.ZerodError) as cm:
            opt.step()
        self.assertEqual(cm.exception.name, "ZD_EHPARAM")
        self.assertIn("registered without it", str(cm.exception))

    def test_clipping(self) -> None:
        # zerod clipping inside its step against torch's own torch.nn.utils.clip_grad_norm_ +
        # torch.optim.AdamW on a copy of the model, each computing its own norm and coefficient:
        # with the norm order the optimizer names for the running torch (if zerod has it), and
        # with zerod's double norm (its choice for any other torch), whatever torch runs.
        import zerod.torch as zt
        for clip_norm in dict.fromkeys([zt._clip_norm_for_torch(), "double"]):
            with self.subTest(clip_norm=clip_norm):
                worst = self.clip_against_torch(clip_norm)
                print(f"\n    clip_norm {clip_norm}: zerod's norm and coefficient at most "
                      f"{worst[0]} and {worst[1]} ULP from torch's", flush=True)

    # zerod's double norm against torch's fp32 one: the coefficient is "within a few ULP" of
    # torch's (README, "Which torch it matches"), measured at most 4 ULP over 1,886 clipped sets
    # of 1-7 tensors (docs/torch2/README.md, "Clipping"), so 4 is the bound. The coefficient is
    # max_norm times the reciprocal of norm + 1e-6, a function that keeps relative errors: a norm
    # k ULP from torch's gives a coefficient about k ULP from torch's, plus at most 1.5 ULP of
    # the three roundings (the add, the reciprocal, the product), which the measured maximum
    # contains. So the norm (zerod's double rounded to fp32) is held to the same 4 ULP.
    DOUBLE_NORM_ULPS = 4

    def clip_against_torch(self, clip_norm: str, steps: int = 8) -> tuple:
        """Clipped AdamW steps of zerod with clip_norm, and of clip_grad_norm_ + AdamW on a copy;
        returns the largest norm and coefficient differences seen, in fp32 ULP.

        Where clip_norm names a torch order (torch113, torch26, torch215) zerod claims bit
        identity: the norm, the coefficient and every parameter after every step are torch's,
        bit for bit. With "double" the norm and coefficient are within DOUBLE_NORM_ULPS of
        torch's, and the update is bitwise given zerod's coefficient: torch's reference steps
        with its unclipped gradients multiplied by zerod's coefficient, as clip_grad_norm_
        multiplies them by its own."""
        model, ref = small_model(), small_model()
        max_norm = 0.05
        opt = self.make(model, lr=1e-2, max_grad_norm=max_norm)
        opt._clip_norm = clip_norm
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        bitwise = clip_norm != "double"
        worst, clipped = [0, 0], 0
        try:
            for step in range(steps):
                for m, o in ((model, opt), (ref, ropt)):
                    o.zero_grad()
                    loss_of(m, step).backward()
                grads = [p.grad.clone() for p in ref.parameters()]
                total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
                # the coefficient clip_grad_norm_ just applied: its own expression on its total
                coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
                opt.step()
                r = opt.last_result
                where = f"clip_norm {clip_norm}, step {step + 1}"
                diff = [f32_ulps(r.grad_norm, float(total)), f32_ulps(r.clip_coef, coef)]
                worst = [max(w, d) for w, d in zip(worst, diff)]
                if bitwise:
                    self.assertEqual((r.grad_norm, r.clip_coef), (float(total), coef),
                                     f"{where}: zerod's norm and coefficient vs torch's")
                else:
                    self.assertLessEqual(max(diff), self.DOUBLE_NORM_ULPS,
                                         f"{where}: zerod's norm {r.grad_norm!r} and coefficient"
                                         f" {r.clip_coef!r}, torch's {float(total)!r} and "
                                         f"{coef!r}: {diff} ULP apart")
                    with torch.no_grad():
                        for p, g in zip(ref.parameters(), grads):
                            p.grad.copy_(g).mul_(r.clip_coef)
                clipped += coef < 1.0
                ropt.step()
                self.assert_equal_params(model, ref, where)
            self.assertGreaterEqual(clipped, steps // 2, f"clip_norm {clip_norm}: max_norm "
                                    f"{max_norm} clipped {clipped} of {steps} steps")
        finally:
            opt.close()  # the next run needs the rank
        return tuple(worst)

    def clip_run(self, clip_norm: Optional[str] = None) -> List[int]:
        """10 clipped AdamW steps of zerod (clip_norm: the optimizer's choice, else forced) and of
        torch.nn.utils.clip_grad_norm_ + AdamW on tensors of 1, 7, 8, 65, 111, 300 and 1031
        elements; returns the steps whose total norm differs (parameters are asserted equal until
        one does)."""
        sizes = [(1,), (7,), (8,), (13, 5), (37, 3), (300,), (1031,)]

        def model(seed: int) -> nn.Module:
            torch.manual_seed(seed)
            m = nn.Module()
            m.ws = nn.ParameterList([nn.Parameter(torch.randn(s)) for s in sizes])
            return m

        def loss(m: nn.Module, step: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(1000 + step)
            return sum((w * torch.randn(w.shape, generator=g) * 3.0 ** (i - 3)).tanh().sum()
                       for i, w in enumerate(m.ws))

        net, ref = model(11), model(11)
        max_norm = 0.5
        opt = self.make(net, lr=1e-2, max_grad_norm=max_norm)
        if clip_norm is not None:
            opt._clip_norm = clip_norm
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        differ = []
        for step in range(10):
            for m, o in ((net, opt), (ref, ropt)):
                o.zero_grad()
                loss(m, step).backward()
            total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            opt.step()
            ropt.step()
            r = opt.last_result
            self.assertLess(r.clip_coef, 1.0, f"step {step + 1} should clip")
            if r.grad_norm != float(total):
                differ.append(step + 1)
            if not differ:
                self.assert_equal_params(net, ref, f"clipped step {step + 1}")
        opt.close()
        return differ

    def test_clipping_bitwise_as_torch(self) -> None:
        # the running torch's fp32 clip_grad_norm_ total and coefficient, bit for bit (the CPU
        # backend at world size 1), for the releases zerod reproduces
        import zerod.torch as zt
        if zt._clip_norm_for_torch() == "double":
            self.skipTest(f"torch {torch.__version__}: zerod clips by its double norm")
        self.assertEqual(self.clip_run(), [], "steps whose total norm differs from torch's")
        # the double norm is not torch's in some of the same steps: the order is what matters
        self.assertNotEqual(self.clip_run("double"), [], "the double norm matched every step")

    def test_clipping_nonfinite_as_torch(self) -> None:
        # clip_grad_norm_ with a NaN gradient makes every gradient NaN (total NaN); with an inf
        # one, every finite gradient 0 and the inf NaN. zerod applies the step the same way.
        for bad in (float("nan"), float("inf")):
            model, ref = small_model(), small_model()
            opt = self.make(model, lr=1e-2, max_grad_norm=1.0)
            ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                loss_of(m, 0).backward()
                with torch.no_grad():
                    m[0].weight.grad[0, 0] = bad
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            ropt.step()
            self.assertTrue(math.isnan(opt.last_result.clip_coef) if bad != bad
                            else opt.last_result.clip_coef == 0.0, opt.last_result.clip_coef)
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                self.assertTrue(torch.equal(p.isnan(), q.isnan()), f"{bad}: NaNs of {n}")
                self.assertTrue(torch.equal(p[~p.isnan()], q[~q.isnan()]), f"{bad}: {n}")
            opt.close()

    def test_bf16_params_fp32_main_grads(self) -> None:
        model = small_model().to(torch.bfloat16)
        ref = copy.deepcopy(model)
        masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
        opt = self.make(model, lr=1e-2, grad_dtype=torch.float32)
        ropt = torch.optim.AdamW(masters, lr=1e-2, foreach=False)
        self.assertEqual(opt.param_dtype, torch.bfloat16)
        for p in model.parameters():
            self.assertIsNone(p.grad)
            self.assertEqual(p.main_grad.dtype, torch.float32)
        for step in range(5):
            opt.zero_grad()
            for p in ref.parameters():
                p.grad = None
            for micro in range(2):  # fp32 accumulation of bf16 micro-batch gradients
                ctx = opt.no_sync() if micro == 0 else _null()
                with ctx:
                    loss_of(model, step, micro, torch.bfloat16).backward()
                loss_of(ref, step, micro, torch.bfloat16).backward()
                for m, p in zip(masters, ref.parameters()):
                    m.grad = p.grad.float() if m.grad is None or micro == 0 else m.grad + p.grad.float()
                    p.grad = None
            for p in model.parameters():
                self.assertIsNone(p.grad, "main_grad mode leaves .grad None")
            opt.step()
            ropt.step()
            with torch.no_grad():
                for p, m in zip(ref.parameters(), masters):
                    p.copy_(m.to(torch.bfloat16))
            self.assert_equal_params(model, ref, f"bf16 step {step + 1}")

    def test_fp16_grads_loss_scaling(self) -> None:
        model, ref = small_model(), small_model()
        scaler = {"initial_scale": 1024.0, "hysteresis": 1, "backoff_factor": 0.5,
                  "growth_interval": 3, "growth_factor": 2.0}
        opt = self.make(model, lr=1e-2, grad_dtype=torch.float16, loss_scaler=scaler)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        self.assertEqual(opt.loss_scale, 1024.0)
        scales = []
        for step in range(6):
            opt.zero_grad()
            ropt.zero_grad()
            scale = opt.loss_scale
            loss = loss_of(model, step)
            if step == 2:
                loss = loss * float("inf")  # overflow: the step is skipped
            opt.scale_loss(loss).backward()
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            r = opt.last_result
            scales.append(r.loss_scale)
            if step == 2:
                self.assertFalse(r.applied)
                for p, b in zip(model.parameters(), before):
                    self.assertTrue(torch.equal(p, b), "a skipped step leaves the params alone")
                continue
            self.assertTrue(r.applied)
            # reference: the fp16 gradient zerod read, unscaled in fp32
            (loss_of(ref, step) * scale).backward()
            with torch.no_grad():
                for p in ref.parameters():
                    p.grad = p.grad.half().float() * (1.0 / scale)
            ropt.step()
            self.assert_equal_params(model, ref, f"fp16-grad step {step + 1}")
        # backoff on the overflow, growth after growth_interval clean steps
        self.assertEqual(scales, [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0])
        self.assertEqual(int(opt.client.rank_status()["steps_skipped"]), 1)

    # ---- schedulers and state ------------------------------------------------------------

    def test_scheduler_and_state_dict_resume(self) -> None:
        model, ref = small_model(), small_model()
        tag = self._testMethodName

        def groups_of(m: nn.Module) -> List[dict]:
            gs = models.param_groups(m, named=True, weight_decay=0.1)
            return [{**g, "params": [(f"{tag}.{n}", p) for n, p in g["params"]]} for g in gs]

        opt = ZeroOptimizer(groups_of(model), lr=1e-2, socket=self.daemon.socket, replace=True)
        ropt = torch.optim.AdamW(models.param_groups(ref, named=False), lr=1e-2, foreach=False)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=20)
        rsched = torch.optim.lr_scheduler.OneCycleLR(ropt, max_lr=1e-2, total_steps=20)

        def train(m, o, s, rm, ro, rs, steps):
            for step in steps:
                for mm, oo, ss in ((m, o, s), (rm, ro, rs)):
                    oo.zero_grad()
                    loss_of(mm, step).backward()
                    oo.step()
                    ss.step()
                self.assert_equal_params(m, rm, f"step {step + 1}")

        train(model, opt, sched, ref, ropt, rsched, range(6))
        # OneCycleLR drives betas too: they must have been sent
        self.assertNotEqual(opt.param_groups[0]["betas"][0], 0.95)
        sd, sched_sd = opt.state_dict(), sched.state_dict()
        self.assertEqual(sd["zerod"]["step"], 6)
        self.assertEqual(sd["state"], {})
        self.assertEqual(len(sd["param_groups"]), 2)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.close()  # the trainer goes away; zerod keeps master weights and moments
        self.assertTrue(torch.equal(model[0].weight, weights["0.weight"]),
                        "close() leaves the model usable")

        # A new trainer: a freshly initialised model, the same optimizer construction.
        model2 = small_model(seed=99)
        opt2 = ZeroOptimizer(groups_of(model2), lr=1e-2, socket=self.daemon.socket)
        self.addCleanup(opt2.close)
        self.assertTrue(opt2.resumed)
        self.assertEqual(opt2.step_count, 6)
        for n, p in model2.named_parameters():
            self.assertTrue(torch.equal(p, weights[n]), f"{n} resumed from zerod's master")
        sched2 = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=1e-2, total_steps=20)
        opt2.load_state_dict(sd)
        sched2.load_state_dict(sched_sd)
        self.assertEqual(opt2.param_groups[0]["lr"], opt.param_groups[0]["lr"])
        train(model2, opt2, sched2, ref, ropt, rsched, range(6, 12))
        with self.assertWarns(UserWarning):
            opt2.load_state_dict(sd)  # saved at step 6; zerod is at 12
        bad = copy.deepcopy(sd)
        bad["zerod"]["layout_hash"] ^= 1
        with self.assertRaises(ValueError):
            opt2.load_state_dict(bad)

    # ---- errors -----------------------------------------------------------------------------

    def test_errors(self) -> None:
        with self.assertRaises(ValueError):
            ZeroOptimizer(small_model().parameters(), lr=-1.0, socket=self.daemon.socket)
        with self.assertRaises(ValueError):
            ZeroOptimizer(small_model().half().parameters(), socket=self.daemon.socket)
        mixed = small_model()
        mixed[0].to(torch.bfloat16)
        with self.assertRaises(ValueError) as cm:
            ZeroOptimizer(mixed.parameters(), socket=self.daemon.socket)
        self.assertIn("several dtypes", str(cm.exception))
        with self.assertRaises(ValueError):
            ZeroOptimizer([{"params": small_model().parameters(), "amsgrad": "yes"}],
                          socket=self.daemon.socket)
        with self.assertRaises(ValueError) as cm:  # torch's keyword, but not honoured
            ZeroOptimizer(small_model().parameters(), capturable=True, socket=self.daemon.socket)
        self.assertIn("capturable=True is not supported", str(cm.exception))
        with self.assertRaises(ValueError):
            ZeroOptimizer(small_model().parameters(), maximize="yes", socket=self.daemon.socket)
        with self.assertRaises(TypeError):
            ZeroOptimizer(small_model().parameters(), momentum=0.9, socket=self.daemon.socket)
        with self.assertRaises(zerod.ZerodError) as cm:
            ZeroOptimizer(small_model().parameters(), socket="/nonexistent/zerod.sock")
        self.assertEqual(cm.exception.name, "ENOENT")

        model = small_model()
        opt = self.make(model)
        # add_param_group works during training (test_add_group.py), but not with a parameter
        # zerod cannot hold; the group is not added then.
        with self.assertRaises(ValueError):
            opt.add_param_group({"params": [nn.Parameter(torch.ones(2, dtype=torch.float64))]})
        self.assertEqual(len(opt.param_groups), 1)
        with self.assertRaises(zerod.ZerodError) as cm:  # the rank is taken
            ZeroOptimizer(small_model().parameters(), socket=self.daemon.socket)
        self.assertEqual(cm.exception.name, "ZD_EBUSY")
        opt.param_groups[0]["lr"] = float("nan")
        loss_of(model, 0).backward()
        with self.assertRaises(ValueError):
            opt.step()
        opt.param_groups[0]["lr"] = 1e-3
        opt.step()
        opt.close()
        with self.assertRaises(RuntimeError):
            opt.step()

    def test_dropped_optimizer_releases_the_rank(self) -> None:
        import gc
        model = small_model()
        opt = ZeroOptimizer(self.named(model), socket=self.daemon.socket, replace=True)
        loss_of(model, 0).backward()
        opt.step()
        w = model[0].weight.detach().clone()
        del opt
        gc.collect()
        self.assertTrue(torch.equal(model[0].weight, w), "the model keeps its values")
        loss_of(model, 1).backward()  # and still works, on private memory
        opt2 = self.make(model, replace=False)  # the rank is free again; zerod resumes the model
        self.assertTrue(opt2.resumed)
        self.assertEqual(opt2.step_count, 1)

    def test_other_model_needs_replace(self) -> None:
        model = small_model()
        opt = self.make(model)
        opt.close()
        other = nn.Linear(3, 3)
        with self.assertRaises(zerod.ZerodError) as cm:
            ZeroOptimizer(other.parameters(), socket=self.daemon.socket)
        self.assertEqual(cm.exception.name, "ZD_ELAYOUT")
        opt2 = self.make(other, other.parameters(), replace=True)
        self.assertFalse(opt2.resumed)


    # ---- the formula of the running torch ------------------------------------------------------

    def train_against(self, model: nn.Module, ref: nn.Module, ropt: Any, opt: ZeroOptimizer,
                      steps: int = 4) -> None:
        for step in range(steps):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                loss_of(m, step).backward()
                o.step()
            self.assert_equal_params(model, ref, f"step {step + 1}")

    def test_formula_follows_the_running_torch(self) -> None:
        import zerod.torch as zt
        model = small_model()
        opt = self.make(model)
        g = opt.param_groups[0]
        self.assertEqual(g["update"], "torch2" if zt._torch_major() >= 2 else "torch113")
        self.assertEqual(g["sqrt_mode"], zt._probe_sqrt()[0])
        opt.close()  # one rank: the next optimizer takes it
        # named explicitly, a formula is kept (and zerod follows it, so torch is not matched in
        # general; only that it is sent is checked here)
        model2 = small_model()
        opt2 = self.make(model2, update="torch113", sqrt_mode="exact")
        self.assertEqual((opt2.param_groups[0]["update"], opt2.param_groups[0]["sqrt_mode"]),
                         ("torch113", "exact"))
        with self.assertRaises(ValueError):
            self.make(small_model(), update="torch3")

    def test_formula_for_cuda_parameters(self) -> None:
        # _choose_formula with CUDA parameters (no GPU needed): torch 2.x's implementation choice
        # picks one of its CUDA formulas, as torch would take the path (foreach by default);
        # torch 1.13's CUDA kernels are not carried: refused unless the group names its update
        from unittest import mock

        import zerod.torch as zt

        def pick(major: int, **g: Any) -> Any:
            with mock.patch.object(zt, "_torch_major", lambda: major):
                return zt._choose_formula(g, True, "param group 0")

        self.assertEqual(pick(2), ("torch2_cuda_foreach", "exact"))
        self.assertEqual(pick(2, foreach=None, fused=False), ("torch2_cuda_foreach", "exact"))
        self.assertEqual(pick(2, foreach=True), ("torch2_cuda_foreach", "exact"))
        self.assertEqual(pick(2, foreach=False), ("torch2_cuda", "exact"))
        self.assertEqual(pick(2, fused=True), ("torch2_cuda_fused", "exact"))
        self.assertEqual(pick(2, foreach=False, fused=True), ("torch2_cuda_fused", "exact"))
        with self.assertRaisesRegex(ValueError, "together"):
            pick(2, foreach=True, fused=True)
        with self.assertRaisesRegex(ValueError, "need torch >= 2.0"):
            pick(1)
        self.assertEqual(pick(1, update="torch113")[0], "torch113")
        # on the CPU nothing changes: torch 2.x's CPU formula, whatever foreach says
        with mock.patch.object(zt, "_torch_major", lambda: 2):
            self.assertEqual(zt._choose_formula({"fused": True}, False, "g"), ("torch2", "exact"))
            self.assertEqual(zt._choose_formula({"foreach": True}, False, "g")[0], "torch2")

    def test_cuda_formulas_are_accepted_by_zerod(self) -> None:
        # the three CUDA formulas are valid group values for zerod (its CPU backend computes them
        # with the scalar reference): a group naming one registers and steps
        for update in ("torch2_cuda", "torch2_cuda_foreach", "torch2_cuda_fused"):
            with self.subTest(update=update):
                model = small_model()
                opt = self.make(model, update=update, sqrt_mode="exact")
                self.assertEqual(opt.param_groups[0]["update"], update)
                opt.zero_grad()
                loss_of(model, 0).backward()
                opt.step()
                opt.close()

    def test_sqrt_probe_matches_torch(self) -> None:
        # the mode the probe picked reproduces torch.sqrt on fresh values too, through libzerod
        import zerod._lib as zl
        import zerod.torch as zt
        mode, note = zt._probe_sqrt()
        x = torch.rand(100000).mul_(torch.empty(100000).uniform_(-30, 30).exp2())
        y = torch.empty_like(x)
        code = zl.ZD_SQRT_MKL_EX if mode == "mkl_ex" else zl.ZD_SQRT_EXACT
        self.assertEqual(zl.load().zd_sqrt(code, x.data_ptr(), y.data_ptr(), x.numel()), 0)
        diff = int((torch.sqrt(x).view(torch.int32) != y.view(torch.int32)).sum())
        if note:  # neither mode matches this torch: the warning says so; nothing to assert
            print(f"    sqrt probe: {note}")
            return
        self.assertEqual(diff, 0, f"sqrt mode {mode}: {diff} of {x.numel()} differ from torch")

    def test_foreach_is_the_default_on_cpu(self) -> None:
        model, ref = small_model(), small_model()
        with self.assertWarnsRegex(UserWarning, "foreach=True changes nothing"):
            opt = self.make(model, lr=1e-2, foreach=True)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
        self.train_against(model, ref, ropt, opt)

    def test_fused_on_cpu(self) -> None:
        if int(torch.__version__.split(".")[0]) < 2:
            with self.assertRaisesRegex(ValueError, "fused=True needs torch >= 2"):
                self.make(small_model(), fused=True)
            return
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 24))
        ref = copy.deepcopy(model)
        opt = self.make(model, lr=1e-2, fused=True, optimizer="adam", weight_decay=0.1)
        self.assertEqual(opt.param_groups[0]["sqrt_mode"], "exact")
        ropt = torch.optim.Adam(ref.parameters(), lr=1e-2, fused=True, weight_decay=0.1)
        for step in range(4):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                x, y = data(step)
                F.mse_loss(m(x)[:, :3], y).backward()
                o.step()
            self.assert_equal_params(model, ref, f"fused step {step + 1}")
        # a 3-element bias: torch's fused kernel computes it with its own scalar formula
        with self.assertRaisesRegex(ValueError, "fewer than"):
            self.make(small_model(), fused=True)

    # ---- pickling and interpreter exit ---------------------------------------------------------

    def test_scheduler_state_dict_saves(self) -> None:
        import io
        import pickle
        model = small_model()
        opt = self.make(model, lr=1e-2)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=20)
        loss_of(model, 0).backward()
        opt.step()
        sched.step()
        buf = io.BytesIO()
        torch.save(sched.state_dict(), buf)  # torch 1.13's holds a bound method of sched
        buf.seek(0)
        kw = {"weights_only": False} if int(torch.__version__.split(".")[0]) >= 2 else {}
        sched.load_state_dict(torch.load(buf, **kw))
        self.assertEqual(sched.last_epoch, 1)
        stub = pickle.loads(pickle.dumps(opt))
        self.assertIsInstance(stub, zerod.torch.PickledZeroOptimizer)
        with self.assertRaisesRegex(AttributeError, "was pickled"):
            stub.step()
        with self.assertRaises(TypeError):
            copy.deepcopy(opt)

    def test_exit_without_close(self) -> None:
        import subprocess
        import sys
        code = (f"import torch\n"
                f"from zerod.torch import ZeroOptimizer\n"
                f"m = torch.nn.Linear(4, 4)\n"
                f"opt = ZeroOptimizer(m.parameters(), socket={self.daemon.socket!r}, "
                f"replace=True)\n"
                f"m(torch.ones(4)).sum().backward()\n"
                f"opt.step()\n"
                f"print('stepped', flush=True)\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
        self.assertEqual((r.returncode, r.stdout.strip()), (0, "stepped"),
                         f"exit without close(): {r.stderr[-2000:]}")


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


if __name__ == "__main__":
    common.run(OptimizerTest)
