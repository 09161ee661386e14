"""The state arrays a model holds follow its optimizers' table, end to end, against real zerod
processes: for each optimizer (and the options that add an array), a model registered with it
holds exactly the arrays zerod.optim.TABLE's row says (the Python row against the C table's
zd__<k>_writes), its status gives state_bytes = 4 bytes per element per array (master
included) and each array's own <name>_bytes, its checkpoint's manifest and rank files hold those
arrays and no other, and the export (zeroctl export --moments) gives them back by torch's names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import unittest
from typing import Any, Dict, List, Tuple

import common

torch = common.require_torch()

import zerod.torch  # noqa: E402,F401  (first: it imports zerod.optim at its end)
import zerod.optim  # noqa: E402
import zerod.testing  # noqa: E402
from zerod import checkpoint as zc  # noqa: E402

# (label, the group's hyperparameters by torch's names, which are also zerod's Group's)
CASES: List[Tuple[str, Dict[str, Any]]] = [
    ("adamw", {"optimizer": "adamw", "lr": 1e-3}),
    ("adam amsgrad", {"optimizer": "adam", "lr": 1e-3, "amsgrad": True}),
    ("sgd", {"optimizer": "sgd", "lr": 0.1}),
    ("sgd momentum", {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}),
    ("adagrad", {"optimizer": "adagrad", "lr": 0.01}),
    ("rmsprop", {"optimizer": "rmsprop", "lr": 0.01}),
    ("rmsprop centered momentum", {"optimizer": "rmsprop", "lr": 0.01, "centered": True,
                                   "momentum": 0.9}),
    ("lion", {"optimizer": "lion", "lr": 1e-4}),
]
# Every state array some row names (torch's names), for the absent ones' checks.
ALL_ARRAYS = sorted({a for row in zerod.optim.TABLE.values() for a, _ in row.arrays})


class StateArraysTest(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="zerod-arrays-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def check_case(self, label: str, group: Dict[str, Any]) -> None:
        row = zerod.optim.TABLE[group["optimizer"]]
        want = row.model_arrays([group])
        ckdir = os.path.join(self.dir, label.replace(" ", "-"))
        os.mkdir(ckdir)
        world = zerod.testing.LocalWorld(1, args=["--checkpoint_dir", ckdir])
        try:
            c = world.connect(0)
            c.layout([("w", (300, 70), 0), ("b", (70,), 0)], [group])
            c.register()
            c.step()
            st = c.rank_status()
            shard = int(st["shard_elems"])
            have = [a for a in ALL_ARRAYS if int(st[a + "_bytes"])]
            self.assertEqual(sorted(have), sorted(want),
                             f"{label}: the arrays zerod holds (status) against the row's")
            for a in want:
                self.assertEqual(int(st[a + "_bytes"]), 4 * shard, f"{label}: {a}_bytes")
            self.assertEqual(int(st["state_bytes"]), 4 * shard * (1 + len(want)),
                             f"{label}: state_bytes, {shard} elements, arrays {want}")
            step, ckpt = c.checkpoint()
            self.assertEqual(step, 1)
            c.close()
        finally:
            world.stop()
        # The manifest names the arrays beyond the legacy pair, and the legacy pair when absent.
        with open(os.path.join(ckpt, "manifest.json")) as f:
            manifest = json.load(f)
        for a in ALL_ARRAYS:
            if a in ("exp_avg", "exp_avg_sq"):  # common/state.h's legacy rows
                expect = None if a in want else False
            else:
                expect = True if a in want else None
            self.assertEqual(manifest.get(a), expect, f"{label}: manifest key {a!r}")
        out = os.path.join(self.dir, label.replace(" ", "-") + ".safetensors")
        subprocess.run([os.environ["ZEROCTL_BIN"], "verify", ckpt], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run([os.environ["ZEROCTL_BIN"], "export", ckpt, "--out", out, "--moments"],
                       check=True, stdout=subprocess.DEVNULL)
        exp = zc.load_export(out)
        self.assertEqual(sorted(exp.state), sorted(want), f"{label}: the export's arrays")
        self.assertTrue(exp.has_moments, label)
        for a in want:
            self.assertEqual(sorted(exp.state[a]), ["b", "w"], f"{label}: {a}")

    def test_each_optimizer_holds_its_rows_arrays(self) -> None:
        for label, group in CASES:
            with self.subTest(label):
                self.check_case(label, group)


if __name__ == "__main__":
    common.run(StateArraysTest)
