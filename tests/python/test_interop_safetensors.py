"""zerod's state files opened and written by the `safetensors` package from PyPI, the format's
reference implementation: zeroctl export's output and save_torch_state's read back with the
values and metadata written; a file written by safetensors itself (its own tensor order and
alignment) imported by zeroctl; and a torch -> checkpoint -> torch round trip under the running
torch, whose optimizer must continue bit for bit (no zerod step in between, so any torch works).

Debian has no python3-safetensors. Where this interpreter cannot import it, the test re-runs
itself under $ZEROD_TORCH2_PYTHON (the torch 2.x venv of scripts/torch2_venv.sh, which must
install safetensors) when that is set, and otherwise exits 77 (skipped, never a pass).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import common

_REEXEC = "ZEROD_INTEROP_REEXEC"

try:
    import safetensors  # noqa: F401
except ImportError:
    other = os.environ.get("ZEROD_TORCH2_PYTHON", "")
    # Not realpath: a venv's python is a link to the interpreter it was made from.
    if other and not os.environ.get(_REEXEC) and os.path.abspath(other) != sys.executable:
        os.environ[_REEXEC] = "1"
        print(f"safetensors is not importable here; running under {other}", flush=True)
        os.execv(other, [other] + sys.argv)
    common.skip("the safetensors package is not importable (Debian has none; install it from "
                "PyPI into the venv named by $ZEROD_TORCH2_PYTHON)")

torch = common.require_torch()
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from zerod import checkpoint as zc  # noqa: E402


def model_and_optimizer():
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(6, 20), torch.nn.Tanh(), torch.nn.Linear(20, 2))
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n.endswith("weight")]},
              {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]
    return model, groups, torch.optim.AdamW(groups, lr=2e-3, betas=(0.85, 0.995))


def step(model, opt, s: int) -> None:
    g = torch.Generator().manual_seed(s)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(torch.randn(9, 6, generator=g)),
                                 torch.randn(9, 2, generator=g)).backward()
    opt.step()


class SafetensorsTest(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="zerod-st-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        print(f"\n  safetensors {safetensors.__version__}, torch {torch.__version__}, "
              f"{sys.executable}", flush=True)
        self.model, self.groups, self.opt = model_and_optimizer()
        for s in range(1, 4):
            step(self.model, self.opt, s)
        self.want = {}  # every tensor the files must hold, by its name there
        for name, p in self.model.named_parameters():
            st = self.opt.state[p]
            self.want[name] = p.detach()
            self.want[name + ".exp_avg"] = st["exp_avg"]
            self.want[name + ".exp_avg_sq"] = st["exp_avg_sq"]

    def assert_holds_want(self, path: str, what: str) -> dict:
        with safe_open(path, framework="pt") as f:
            self.assertEqual(sorted(f.keys()), sorted(self.want), what)
            for name, w in self.want.items():
                g = f.get_tensor(name)
                self.assertEqual(g.dtype, torch.float32, f"{what}: {name}")
                self.assertTrue(torch.equal(g, w), common.first_difference(
                    f"{what}: {name}", g, w))
            return f.metadata()

    def test_files_open_with_safetensors_and_go_back_in(self) -> None:
        saved = os.path.join(self.dir, "torch.safetensors")
        zc.save_torch_state(self.opt, self.model.named_parameters(), saved)
        meta = self.assert_holds_want(saved, "save_torch_state's file")
        self.assertEqual((meta["format"], meta["zerod_format"], meta["step"]),
                         ("pt", "zerod-torch-state", "3"))

        ckpt = zc.import_checkpoint(saved, os.path.join(self.dir, "in"))
        export = os.path.join(self.dir, "export.safetensors")
        subprocess.run([os.environ["ZEROCTL_BIN"], "export", ckpt, "--out", export,
                        "--moments"], check=True, stdout=subprocess.DEVNULL)
        meta = self.assert_holds_want(export, "zeroctl export's file")
        self.assertEqual((meta["format"], meta["zerod_format"], meta["step"], meta["moments"]),
                         ("pt", "zerod-export", "3", "1"))

        # Written by safetensors itself (its order and alignment, not ours): imported alike.
        with safe_open(saved, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata()
        rewritten = os.path.join(self.dir, "rewritten.safetensors")
        save_file(tensors, rewritten, metadata=metadata)
        again = zc.import_checkpoint(rewritten, os.path.join(self.dir, "again"))
        self.assert_state_equal(zc.torch_state_dict(again).state_dict,
                                zc.torch_state_dict(ckpt).state_dict)

    def assert_state_equal(self, got: dict, want: dict) -> None:
        self.assertEqual(got["param_groups"], want["param_groups"])
        self.assertEqual(sorted(got["state"]), sorted(want["state"]))
        for i, st in want["state"].items():
            for key, w in st.items():
                g = got["state"][i][key]
                self.assertEqual(type(g), type(w), f"parameter {i} {key}")
                if isinstance(w, torch.Tensor):
                    self.assertEqual((g.dtype, tuple(g.shape)), (w.dtype, tuple(w.shape)),
                                     f"parameter {i} {key}")
                    self.assertTrue(torch.equal(g, w), common.first_difference(
                        f"parameter {i} {key}", g, w))
                else:
                    self.assertEqual(g, w, f"parameter {i} {key}")

    def test_round_trip_under_the_running_torch(self) -> None:
        saved = os.path.join(self.dir, "torch.safetensors")
        zc.save_torch_state(self.opt, self.model.named_parameters(), saved)
        ckpt = zc.import_checkpoint(saved, os.path.join(self.dir, "in"))
        model, groups, opt = model_and_optimizer()  # step 0: its own weights
        state = zc.torch_state_dict(ckpt, model.named_parameters())
        state.load_params(model.named_parameters())
        opt.load_state_dict(state.state_dict)
        # The step as this torch stores it (a tensor of its dtype), the moments, the groups.
        self.assert_state_equal(opt.state_dict(), self.opt.state_dict())
        for s in range(4, 7):
            step(self.model, self.opt, s)
            step(model, opt, s)
        common.assert_params_equal(self, model.named_parameters(), self.model.named_parameters(),
                                   "3 steps after the round trip")


if __name__ == "__main__":
    common.run(SafetensorsTest)
