"""Moving a training run between plain torch and zerod (zerod.checkpoint), against real zerod
and zeroctl processes, with Debian's torch 1.13 (zerod's default update is its AdamW's).

The run: a model with two parameter groups (their own lr and weight decay) trains K steps with
torch.optim.AdamW; its state goes into zerod (save_torch_state, zeroctl import, zerod --resume,
a ZeroOptimizer built on a model initialised differently), trains M steps there, comes back out
(ZeroOptimizer.checkpoint, torch_state_dict through zeroctl export, a fresh torch AdamW on a third
model) and trains N more steps. Every step's parameters, and the moments and step at each move,
must be bitwise those of one torch AdamW run of K+M+N steps. Also: the imported checkpoint
resumed by a world of two ranks (resharding) holds the torch run's weights bit for bit, and the
errors of the conversions. All of it again with amsgrad=True (InteropAmsgradTest): torch's
max_exp_avg_sq goes into zerod, is resharded, and comes back out under torch's key. The check with the `safetensors` package from PyPI is its own test
(test_interop_safetensors.py): Debian has no python3-safetensors.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import tempfile
import threading
import unittest
from typing import Any, Dict, List

import common

torch = common.require_torch()
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zerod.testing  # noqa: E402
from zerod import checkpoint as zc  # noqa: E402
from zerod.torch import ZeroAdagrad, ZeroLion, ZeroOptimizer, ZeroRMSprop, ZeroSGD  # noqa: E402

try:
    from lion_pytorch import Lion  # PyPI lion-pytorch: InteropLionTest's reference
except ImportError:
    Lion = None

K, M, N = 4, 5, 4
HP = {"lr": 3e-3, "betas": (0.9, 0.99), "eps": 1e-7}
GROUP_HP = [{"weight_decay": 0.1}, {"weight_decay": 0.0, "lr": 1e-2}]
# The torch optimizer and its zerod counterpart (InteropSGDTest swaps them).
TORCH_CLS: Any = torch.optim.AdamW
ZERO_CLS: Any = ZeroOptimizer


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 48), nn.Tanh(), nn.Linear(48, 32), nn.Tanh(),
                         nn.Linear(32, 3))


def named_groups(model: nn.Module) -> List[Dict[str, Any]]:
    """Weights in group 0, biases in group 1, as (name, parameter) pairs."""
    named = list(model.named_parameters())
    return [dict(GROUP_HP[0], params=[(n, p) for n, p in named if n.endswith("weight")]),
            dict(GROUP_HP[1], params=[(n, p) for n, p in named if n.endswith("bias")])]


def torch_groups(model: nn.Module) -> List[Dict[str, Any]]:
    return [dict(g, params=[p for _, p in g["params"]]) for g in named_groups(model)]


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
    return F.mse_loss(model(x), y)


def train_step(model: nn.Module, opt: Any, step: int) -> None:
    opt.zero_grad()
    loss_of(model, step).backward()
    opt.step()


def zerod_kind() -> str:
    """zerod's optimizer name for TORCH_CLS, from zerod.optim's table: the model registered
    by hand must hold the arrays of that optimizer (and no other)."""
    import zerod.optim

    for row in zerod.optim.TABLE.values():
        try:
            if row.torch_class() is TORCH_CLS:
                return row.kind
        except ImportError:
            continue
    raise AssertionError(f"{TORCH_CLS.__name__} has no row in zerod.optim.TABLE")


def snapshot(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


_REF: Dict[str, Any] = {}


def reference() -> Dict[str, Any]:
    """One plain torch AdamW run of K+M+N steps: the parameters after every step and the
    optimizer's state_dict after steps K and K+M (computed once)."""
    if not _REF:
        model = make_model(1)
        opt = TORCH_CLS(torch_groups(model), **HP)
        _REF["params"] = {0: snapshot(model)}
        for s in range(1, K + M + N + 1):
            train_step(model, opt, s)
            _REF["params"][s] = snapshot(model)
            if s in (K, K + M):
                _REF[f"state{s}"] = copy.deepcopy(opt.state_dict())
    return _REF


class InteropTest(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="zerod-interop-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def assert_params(self, got: Dict[str, torch.Tensor], step: int, where: str) -> None:
        want = reference()["params"][step]
        self.assertEqual(sorted(got), sorted(want))
        common.assert_params_equal(self, ((n, got[n]) for n in want), want.items(),
                                   f"{where}, step {step}")

    def assert_state(self, got: Dict[str, Any], want: Dict[str, Any], where: str) -> None:
        """Two torch optimizer state_dicts: the same groups, and every state tensor bitwise
        equal with the same dtype and shape (step included: as this torch stores it)."""
        self.assertEqual(got["param_groups"], want["param_groups"], where)
        self.assertEqual(sorted(got["state"]), sorted(want["state"]), where)
        for i, st in want["state"].items():
            self.assertEqual(sorted(got["state"][i]), sorted(st), f"{where}: parameter {i}")
            for key, w in st.items():
                g = got["state"][i][key]
                self.assertEqual(type(g), type(w), f"{where}: parameter {i} {key}")
                if isinstance(w, torch.Tensor):
                    self.assertEqual((g.dtype, tuple(g.shape)), (w.dtype, tuple(w.shape)),
                                     f"{where}: parameter {i} {key}")
                    self.assertTrue(torch.equal(g, w), common.first_difference(
                        f"{where}: parameter {i} {key}", g, w))
                else:
                    self.assertEqual(g, w, f"{where}: parameter {i} {key}")

    def torch_part(self) -> str:
        """K torch steps, saved and imported: the checkpoint directory."""
        model = make_model(1)
        opt = TORCH_CLS(torch_groups(model), **HP)
        for s in range(1, K + 1):
            train_step(model, opt, s)
        self.assert_params(snapshot(model), K, "plain torch")
        path = os.path.join(self.dir, "from-torch.safetensors")
        # torch.optim.SGD counts no steps: the caller says which (save_torch_state).
        kw = {"step": K} if TORCH_CLS is torch.optim.SGD or TORCH_CLS is Lion else {}
        zc.save_torch_state(opt, model.named_parameters(), path, **kw)
        ckpt = zc.import_checkpoint(path, os.path.join(self.dir, "imported"))
        self.assertEqual(ckpt, os.path.join(self.dir, "imported", f"step-{K:012d}"))
        return ckpt

    def test_torch_then_zerod_then_torch_is_one_adamw_run(self) -> None:
        ref = reference()
        ckpt = self.torch_part()

        # Into zerod: small buckets, so the resume also reshards from the import's layout.
        out_root = os.path.join(self.dir, "zerod")
        os.mkdir(out_root)
        daemon = zerod.testing.LocalZerod(["--bucket_elems", "256", "--resume", ckpt,
                                           "--checkpoint-dir", out_root])
        try:
            model = make_model(2)  # other weights: the checkpoint's must replace them
            opt = ZERO_CLS(named_groups(model), socket=daemon.socket, **HP)
            try:
                self.assertTrue(opt.resumed)
                self.assertEqual(opt.step_count, K)
                self.assert_params(snapshot(model), K, "resumed in zerod")
                for s in range(K + 1, K + M + 1):
                    train_step(model, opt, s)
                    self.assert_params(snapshot(model), s, "in zerod")
                step, out_ckpt = opt.checkpoint()
                self.assertEqual(step, K + M)
            finally:
                opt.close()
        finally:
            daemon.stop()

        # Out again, into a fresh torch AdamW on a third model.
        model = make_model(3)
        state = zc.torch_state_dict(out_ckpt, model.named_parameters())
        self.assertEqual(state.step, K + M)
        self.assertIs(state.optimizer_class, TORCH_CLS)
        state.load_params(model.named_parameters())
        self.assert_params(snapshot(model), K + M, "loaded back into torch")
        opt = TORCH_CLS(torch_groups(model), lr=0.5)  # load_state_dict sets the groups
        # torch 2.x's load_state_dict keeps the step tensors it is given and counts on them in
        # place; the comparison below needs this state as it was.
        opt.load_state_dict(copy.deepcopy(state.state_dict))
        self.assert_state(opt.state_dict(), ref[f"state{K + M}"], "after zerod")
        for s in range(K + M + 1, K + M + N + 1):
            train_step(model, opt, s)
            self.assert_params(snapshot(model), s, "back in torch")

        # The same state from the export file as from the directory.
        export = os.path.join(self.dir, "export.safetensors")
        subprocess.run([os.environ["ZEROCTL_BIN"], "export", out_ckpt, "--out", export,
                        "--moments"], check=True, stdout=subprocess.DEVNULL)
        again = zc.torch_state_dict(export)
        self.assert_state(again.state_dict, state.state_dict, "from the export file")

    def test_import_reads_back_as_the_torch_state(self) -> None:
        """The imported checkpoint, exported and converted back, is the torch optimizer's
        state_dict at step K, bit for bit; its master weights are the model's."""
        ref = reference()
        ckpt = self.torch_part()
        state = zc.torch_state_dict(ckpt)
        self.assert_state(state.state_dict, ref[f"state{K}"], "torch -> zerod -> torch")
        self.assert_params(state.master, K, "the imported master weights")

    def test_import_resumes_at_world_size_2(self) -> None:
        ckpt = self.torch_part()
        model = make_model(1)
        specs = [(n, tuple(p.shape), gi) for gi, g in enumerate(named_groups(model))
                 for n, p in g["params"]]
        world = zerod.testing.LocalWorld(2, args=["--bucket_elems", "512", "--resume", ckpt])
        clients = [world.connect(r) for r in range(2)]
        infos: List[Any] = [None, None]
        errors: List[BaseException] = []

        def attach(r: int) -> None:
            try:
                clients[r].layout(specs, [dict(HP, optimizer=zerod_kind(), **g)
                                          for g in GROUP_HP])
                infos[r] = clients[r].register()
            except BaseException as e:  # re-raised below
                errors.append(e)

        threads = [threading.Thread(target=attach, args=(r,)) for r in range(2)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            if errors:
                raise errors[0]
            want = reference()["params"][K]
            for r, c in enumerate(clients):
                self.assertTrue(infos[r].resumed, f"rank {r}")
                self.assertEqual(infos[r].step, K, f"rank {r}")
                flat = torch.frombuffer(c.param_buffer, dtype=torch.float32)
                got = {}
                for i, (name, shape, _) in enumerate(specs):
                    pi = c.param_info(i)
                    got[name] = flat[pi.offset:pi.offset + pi.numel].reshape(shape).clone()
                common.assert_params_equal(self, ((n, got[n]) for n in want), want.items(),
                                           f"rank {r} of 2 after the resume")
        finally:
            for c in clients:
                c.close()
            world.stop()

    def test_refusals(self) -> None:
        path = os.path.join(self.dir, "x.safetensors")
        model = make_model(1)
        # Parameters at different steps (torch skipped one without a gradient): carried as the
        # largest step and each one's steps behind it.
        opt = torch.optim.AdamW(torch_groups(model), **HP)
        train_step(model, opt, 1)
        model[4].bias.grad = None
        for p in model.parameters():
            if p is not model[4].bias:
                p.grad = torch.zeros_like(p)
        opt.step()
        zc.save_torch_state(opt, model.named_parameters(), path)
        exp = zc.load_export(path)
        self.assertEqual((exp.step, exp.steps_behind), (2, {"4.bias": 1}))
        self.assertEqual(exp.param_step("4.bias"), 1)
        os.remove(path)
        # Optimizers zerod does not have.
        with self.assertRaisesRegex(TypeError, "Adamax"):
            zc.save_torch_state(torch.optim.Adamax(model.parameters(), lr=0.1),
                                model.named_parameters(), path)
        # An unnamed parameter.
        with self.assertRaisesRegex(ValueError, "not among named_params"):
            zc.save_torch_state(torch.optim.AdamW(model.parameters()),
                                list(model.named_parameters())[1:], path)
        self.assertFalse(os.path.exists(path))
        # A fresh optimizer (no state yet) is step 0 with zero moments; Adam is zerod's "adam".
        zc.save_torch_state(torch.optim.Adam(model.parameters(), weight_decay=0.01), None, path)
        exp = zc.load_export(path)
        self.assertEqual((exp.step, exp.names[0], exp.groups[0]["optimizer"]), (0, "param0", 1))
        self.assertEqual(float(abs(exp.exp_avg_sq["param5"]).sum()), 0.0)
        state = zc.torch_state_dict(path)
        self.assertIs(state.optimizer_class, torch.optim.Adam)
        self.assertEqual(state.state_dict["state"], {})
        # zeroctl's refusal reaches the caller with its message; so does a model that differs.
        with self.assertRaisesRegex(RuntimeError, "already holds a complete checkpoint"):
            root = os.path.join(self.dir, "twice")
            zc.import_checkpoint(path, root)
            zc.import_checkpoint(path, root)
        with self.assertRaisesRegex(ValueError, "'param0' is not in the model"):
            zc.torch_state_dict(path, model.named_parameters())
        with self.assertRaisesRegex(RuntimeError, "zeroctl export failed"):
            zc.torch_state_dict(self.dir)  # not a checkpoint



class InteropAmsgradTest(InteropTest):
    """InteropTest's moves with amsgrad=True in every group."""

    _ref_ams: Dict[str, Any] = {}

    def setUp(self) -> None:
        super().setUp()
        saved = (HP, _REF)
        globals().update(HP=dict(HP, amsgrad=True), _REF=self._ref_ams)
        self.addCleanup(globals().update, HP=saved[0], _REF=saved[1])

    def test_amsgrad_state_is_carried(self) -> None:
        # The comparisons above cover max_exp_avg_sq only if torch's state has it.
        state = reference()[f"state{K}"]["state"]
        self.assertTrue(state and all("max_exp_avg_sq" in st for st in state.values()))
        back = zc.torch_state_dict(self.torch_part()).state_dict["state"]
        self.assertTrue(all("max_exp_avg_sq" in st for st in back.values()))


class InteropSGDTest(InteropTest):
    """InteropTest's moves with torch.optim.SGD and zerod.torch.ZeroSGD: momentum with
    dampening in one group, none in the other (its lr overrides), weight decay in the first; the
    momentum_buffer goes into zerod, is resharded, and comes back out under torch's key (and the
    group without momentum as this torch keeps it)."""

    _ref_sgd: Dict[str, Any] = {}

    def setUp(self) -> None:
        super().setUp()
        saved = (HP, _REF, GROUP_HP, TORCH_CLS, ZERO_CLS)
        globals().update(HP={"lr": 0.05, "momentum": 0.9, "dampening": 0.1}, _REF=self._ref_sgd,
                         GROUP_HP=[{"weight_decay": 0.1},
                                   {"weight_decay": 0.0, "lr": 0.1, "momentum": 0.0}],
                         TORCH_CLS=torch.optim.SGD, ZERO_CLS=ZeroSGD)
        self.addCleanup(globals().update, HP=saved[0], _REF=saved[1], GROUP_HP=saved[2],
                        TORCH_CLS=saved[3], ZERO_CLS=saved[4])

    def test_refusals(self) -> None:
        """SGD's own: a fresh SGD (no buffers) is step 0; with buffers, at least 1."""
        path = os.path.join(self.dir, "x.safetensors")
        model = make_model(1)
        opt = torch.optim.SGD(torch_groups(model), **HP)
        zc.save_torch_state(opt, model.named_parameters(), path)
        exp = zc.load_export(path)
        self.assertEqual((exp.step, exp.groups[0]["optimizer"]), (0, 2))
        self.assertEqual(sorted(exp.momentum_buffer), sorted(exp.names))
        train_step(model, opt, 1)
        zc.save_torch_state(opt, model.named_parameters(), path)
        self.assertEqual(zc.load_export(path).step, 1)

    def test_momentum_buffer_is_carried(self) -> None:
        state = reference()[f"state{K}"]["state"]
        self.assertTrue(any(st.get("momentum_buffer") is not None for st in state.values()))
        back = zc.torch_state_dict(self.torch_part()).state_dict["state"]
        self.assertTrue(any("momentum_buffer" in st for st in back.values()))


class InteropAdagradTest(InteropTest):
    """InteropTest's moves with torch.optim.Adagrad and zerod.torch.ZeroAdagrad (lr_decay in
    one group, an accumulator start, weight decay in the first): `sum` and `step` go into zerod,
    are resharded, and come back out under torch's keys."""

    _ref_adagrad: Dict[str, Any] = {}

    def setUp(self) -> None:
        super().setUp()
        saved = (HP, _REF, GROUP_HP, TORCH_CLS, ZERO_CLS)
        globals().update(HP={"lr": 0.05, "initial_accumulator_value": 0.1, "eps": 1e-10},
                         _REF=self._ref_adagrad,
                         GROUP_HP=[{"weight_decay": 0.1, "lr_decay": 0.01},
                                   {"weight_decay": 0.0, "lr": 0.1}],
                         TORCH_CLS=torch.optim.Adagrad, ZERO_CLS=ZeroAdagrad)
        self.addCleanup(globals().update, HP=saved[0], _REF=saved[1], GROUP_HP=saved[2],
                        TORCH_CLS=saved[3], ZERO_CLS=saved[4])

    def test_refusals(self) -> None:
        """Adagrad's own: the file holds `sum` for every parameter at torch's step."""
        path = os.path.join(self.dir, "x.safetensors")
        model = make_model(1)
        opt = torch.optim.Adagrad(torch_groups(model), **HP)
        # A fresh Adagrad already holds step 0 and sum (initial_accumulator_value): the export
        # at step 0 gives them too.
        zc.save_torch_state(opt, model.named_parameters(), path)
        fresh = zc.torch_state_dict(path, model.named_parameters())
        self.assertEqual(fresh.step, 0)
        self.assert_state(fresh.state_dict, opt.state_dict(), "a fresh Adagrad")
        train_step(model, opt, 1)
        zc.save_torch_state(opt, model.named_parameters(), path)
        exp = zc.load_export(path)
        self.assertEqual((exp.step, exp.groups[0]["optimizer"]), (1, 3))
        self.assertEqual(sorted(exp.sum), sorted(exp.names))


class InteropRMSpropTest(InteropTest):
    """InteropTest's moves with torch.optim.RMSprop and zerod.torch.ZeroRMSprop (centered with
    momentum in one group, plain in the other): square_avg, grad_avg, momentum_buffer and step go
    into zerod, are resharded, and come back out under torch's keys."""

    _ref_rms: Dict[str, Any] = {}

    def setUp(self) -> None:
        super().setUp()
        saved = (HP, _REF, GROUP_HP, TORCH_CLS, ZERO_CLS)
        globals().update(HP={"lr": 1e-3, "alpha": 0.9, "eps": 1e-8}, _REF=self._ref_rms,
                         GROUP_HP=[{"weight_decay": 0.1, "momentum": 0.9, "centered": True},
                                   {"weight_decay": 0.0, "lr": 2e-3}],
                         TORCH_CLS=torch.optim.RMSprop, ZERO_CLS=ZeroRMSprop)
        self.addCleanup(globals().update, HP=saved[0], _REF=saved[1], GROUP_HP=saved[2],
                        TORCH_CLS=saved[3], ZERO_CLS=saved[4])

    def test_refusals(self) -> None:
        """RMSprop's own: the file holds square_avg, grad_avg and momentum_buffer for every
        parameter at torch's step."""
        path = os.path.join(self.dir, "x.safetensors")
        model = make_model(1)
        opt = torch.optim.RMSprop(torch_groups(model), **HP)
        train_step(model, opt, 1)
        zc.save_torch_state(opt, model.named_parameters(), path)
        exp = zc.load_export(path)
        self.assertEqual((exp.step, exp.groups[0]["optimizer"]), (1, 4))
        for d in (exp.square_avg, exp.grad_avg, exp.momentum_buffer):
            self.assertEqual(sorted(d), sorted(exp.names))


class InteropLionTest(InteropTest):
    """InteropTest's moves with lion_pytorch.Lion (PyPI lion-pytorch) and zerod.torch.ZeroLion
    (weight decay in one group, betas of its own and another lr in the other): exp_avg goes into
    zerod, is resharded, and comes back out as Lion's state, which Lion loads and continues bit
    for bit. Skipped where lion-pytorch is not installed."""

    _ref_lion: Dict[str, Any] = {}

    def setUp(self) -> None:
        if Lion is None:
            self.skipTest("lion-pytorch is not installed for this python")
        super().setUp()
        saved = (HP, _REF, GROUP_HP, TORCH_CLS, ZERO_CLS)
        globals().update(HP={"lr": 1e-3, "betas": (0.9, 0.99)}, _REF=self._ref_lion,
                         GROUP_HP=[{"weight_decay": 1.0},
                                   {"weight_decay": 0.0, "lr": 2e-3, "betas": (0.95, 0.98)}],
                         TORCH_CLS=Lion, ZERO_CLS=ZeroLion)
        self.addCleanup(globals().update, HP=saved[0], _REF=saved[1], GROUP_HP=saved[2],
                        TORCH_CLS=saved[3], ZERO_CLS=saved[4])

    def test_refusals(self) -> None:
        """Lion's own: a fresh Lion (no state) is step 0; after a step the file holds exp_avg
        for every parameter, at the step given (Lion counts none)."""
        path = os.path.join(self.dir, "x.safetensors")
        model = make_model(1)
        opt = Lion(torch_groups(model), **HP)
        zc.save_torch_state(opt, model.named_parameters(), path)
        exp = zc.load_export(path)
        self.assertEqual((exp.step, exp.groups[0]["optimizer"]), (0, 5))
        self.assertEqual(zc.torch_state_dict(path).state_dict["state"], {})
        train_step(model, opt, 1)
        zc.save_torch_state(opt, model.named_parameters(), path, step=3)
        exp = zc.load_export(path)
        self.assertEqual(exp.step, 3)
        st = opt.state_dict()["state"]
        got = zc.torch_state_dict(path, model.named_parameters()).state_dict["state"]
        self.assertEqual(sorted(got), sorted(st))
        for i in st:
            self.assertTrue(torch.equal(got[i]["exp_avg"], st[i]["exp_avg"]), f"parameter {i}")
        with self.assertRaisesRegex(ValueError, "decoupled_weight_decay"):
            ZeroLion(named_groups(model), decoupled_weight_decay=True)


if __name__ == "__main__":
    # InteropLionTest where lion-pytorch is installed (the torch 2.x venv): elsewhere its skip
    # would turn the whole file into a skip.
    if Lion is None:
        print("note: lion-pytorch is not installed for this python: InteropLionTest not run",
              flush=True)
    common.run(InteropTest, InteropAmsgradTest, InteropSGDTest, InteropAdagradTest,
               InteropRMSpropTest, *([InteropLionTest] if Lion is not None else []))
