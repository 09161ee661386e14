"""Live resize against real zerod processes (docs/design.md, "Live resize").

A world of 4 zerods (one rank each, CPU backend, unix sockets) trains; `zeroctl resize
--world_size 2` (sent to rank 1's node: any node will do) shrinks it to 2 after the next step with
no checkpoint_dir and no state_dir: the zerods move the shards in memory. The trainers of ranks 2
and 3 get ZD_ERANK naming the resize, those of ranks 0 and 1 ZD_EPEER ("register again"); they
register again at the new world size and continue bitwise equal to an uninterrupted
torch.optim.AdamW(foreach=False) run. Then `zeroctl resize --world_size 4` grows it back: the
leaving zerods were stopped, two new empty zerods start for ranks 2 and 3, and every rank gets its
shard of the new layout from the image rank 0 holds (a reduce-scatter where the others add -0.0f);
training goes on, bitwise equal again. A world with a checkpoint_dir shrunk to 2 checkpoints as a
world of 2, which a new world of 2 resumes bitwise. Status shows each resize (step, sizes, duration). A peer
SIGKILLed during a resize: the survivors end in a defined state (degraded, or re-forming without
state to continue from), never a hang.

The reference is test_state_dir's (rank 0 sends step s's gradient, the others zeros, summed with
grad_mean off: the reduced gradient is the same at every world size).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from typing import Dict, List

import common  # sets up sys.path and the library first

import numpy as np

import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402

torch = common.require_torch()

import test_state_dir as sd  # noqa: E402  (its PARAMS, gradients, reference and Trainer)


def _groups():
    """The update of the running torch (its AdamW is the reference), as test_buddy.py: under
    torch 2.x the first moment by lerp and torch.sqrt's rounding as measured; under 1.13 zerod's
    defaults."""
    if int(torch.__version__.split(".")[0]) < 2:
        return None
    from zerod.torch import _probe_sqrt
    return [{"update": "torch2", "sqrt_mode": _probe_sqrt()[0]}]


_GROUPS = _groups()
if _GROUPS is not None:  # every layout of this process (test_state_dir's Trainer passes none)
    _layout = zerod.Client.layout

    def _layout_with_groups(client, params, groups=None, **kw):
        return _layout(client, params, groups if groups is not None else _GROUPS, **kw)
    zerod.Client.layout = _layout_with_groups

ZD_EPEER, ZD_ERANK = -4014, -4011
ARGS = ["--bucket_elems", sd.BUCKET, "--heartbeat_ms", "100", "--peer_timeout_ms", "1000",
        "--log_level", "info"]


def zeroctl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    exe = os.environ.get("ZEROCTL_BIN", "zeroctl")
    out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)
    if check and out.returncode != 0:
        raise AssertionError(f"zeroctl {' '.join(args)}: exit {out.returncode}: {out.stderr}")
    return out


def status(d: zerod.testing.LocalZerod) -> dict:
    # exit 1 while a rank is degraded (a leaver, a failed resize): the JSON is there all the same
    return json.loads(zeroctl("--address", d.control_address, "status", "--json",
                              check=False).stdout)


def attempt(fns: List) -> list:
    """Runs every fn at once; each one's result or the ZerodError it raised."""
    def wrap(fn):
        def run():
            try:
                return fn()
            except ZerodError as e:
                return e
        return run
    return sd.on_all([wrap(f) for f in fns])


class ResizeTest(unittest.TestCase):
    ref: sd.Reference = None

    def setUp(self) -> None:
        if ResizeTest.ref is None:
            ResizeTest.ref = sd.Reference()

    def assert_same(self, ts: List[sd.Trainer], step: int, what: str) -> None:
        want = self.ref.at(step)
        for t in ts:
            for name, _ in sd.PARAMS:
                g, w = t.p[name].view(np.uint32).ravel(), want[name].view(np.uint32).ravel()
                diff = np.flatnonzero(g != w)
                self.assertEqual(diff.size, 0, f"{what}: rank {t.rank}: {name} differs from "
                                 f"torch's step {step} at {diff.size} elements")

    def register(self, world, ranks: List[int], first: bool = False) -> List[sd.Trainer]:
        # After a resize junk initial values: the state must come from zerod.
        init = sd.init_values() if first else None
        ts = sd.on_all([lambda r=r: sd.Trainer(world, init, r, register=False) for r in ranks])
        infos = sd.on_all([lambda t=t: t.client.register() for t in ts])
        for t, info in zip(ts, infos):
            t.info = info
        return ts

    def train(self, ts: List[sd.Trainer], steps: range) -> None:
        for s in steps:
            sd.on_all([lambda t=t: t.step(s) for t in ts])

    def wait_world_size(self, d, n: int, timeout: float = 30.0) -> dict:
        end = time.monotonic() + timeout
        while True:
            st = status(d)
            if st["world_size"] == n:
                return st
            if time.monotonic() > end:
                self.fail(f"{d.control_address}: world_size {st['world_size']}, expected {n}")
            time.sleep(0.05)

    def add_zerod(self, world, rank: int, size: int) -> zerod.testing.LocalZerod:
        d = zerod.testing.LocalZerod([], log_level="info", start=False, timeout=30.0)
        d.args = ["--world_size", str(size), "--first_rank", str(rank), "--local_ranks", "1",
                  "--rendezvous_address", world.daemons[0].control_address] + ARGS
        d.spawn()
        world.daemons[rank] = d
        world._endpoints[rank] = (d.socket, 0)
        return d

    def test_shrink_and_grow_bitwise(self) -> None:
        with zerod.testing.LocalWorld(4, daemons=4, args=ARGS, log_level="info") as world:
            ts = self.register(world, [0, 1, 2, 3], first=True)
            self.train(ts, range(1, 4))
            self.assert_same(ts, 3, "W=4 before the resize")

            # ---- shrink 4 -> 2, asked of rank 1's node ----
            out = zeroctl("--address", world.daemons[1].control_address, "resize",
                          "--world_size", "2")
            self.assertIn("resize from 4 to 2 ranks requested", out.stdout)
            self.train(ts, range(4, 5))  # the step the resize rides
            self.assert_same(ts, 4, "the step the shrink rode")
            got = attempt([lambda t=t: t.step(5) for t in ts])
            for t, e in zip(ts, got):
                self.assertIsInstance(e, ZerodError, f"rank {t.rank}: step 5 after the resize")
                if t.rank < 2:
                    self.assertEqual(e.code, ZD_EPEER, e.message)
                    self.assertIn("resized from 4 to 2 ranks after step 4", e.message)
                    self.assertIn("register again", e.message)
                else:
                    self.assertEqual(e.code, ZD_ERANK, e.message)
                    self.assertIn("left the world", e.message)
                    self.assertIn("resized from 4 to 2", e.message)
            for t in ts:
                t.close()
            st = self.wait_world_size(world.daemons[0], 2)
            left = status(world.daemons[2])
            self.assertIn("this rank left", left["ranks"][0].get("last_resize", ""))
            self.assertEqual(left["ranks"][0]["health"], "degraded")
            # The leavers idle until stopped; stopping them does not disturb the new world.
            for r in (2, 3):
                world.daemons[r].stop()
            ts = self.register(world, [0, 1])
            for t in ts:
                self.assertTrue(t.info.resumed, "the registration after a resize resumes")
            self.assert_same(ts, 4, "W=2 right after the shrink")
            self.train(ts, range(5, 9))
            self.assert_same(ts, 8, "W=2 after the shrink")
            st = status(world.daemons[0])
            self.assertIn("step 4: 4 -> 2 ranks in", st["ranks"][0]["last_resize"])

            # ---- grow 2 -> 4: new empty zerods for ranks 2 and 3 ----
            zeroctl("--address", world.daemons[0].control_address, "resize", "--world_size", "4")
            self.train(ts, range(9, 10))
            got = attempt([lambda t=t: t.step(10) for t in ts])
            for t, e in zip(ts, got):
                self.assertIsInstance(e, ZerodError, f"rank {t.rank}: step 10 after the grow")
                self.assertEqual(e.code, ZD_EPEER, e.message)
                self.assertIn("resized from 2 to 4 ranks after step 9", e.message)
            for t in ts:
                t.close()
            self.wait_world_size(world.daemons[0], 4)
            time.sleep(0.5)  # rank 0 names the new world instance before the new zerods look
            for r in (2, 3):
                self.add_zerod(world, r, 4)
            for r in (2, 3):
                world.daemons[r].wait_ready()
            ts = self.register(world, [0, 1, 2, 3])
            self.assert_same(ts, 9, "W=4 right after the grow (ranks 2, 3 joined empty)")
            self.train(ts, range(10, 13))
            self.assert_same(ts, 12, "W=4 after the grow")
            st = status(world.daemons[0])
            self.assertIn("step 9: 2 -> 4 ranks in", st["ranks"][0]["last_resize"])
            for t in ts:
                t.close()

    def test_checkpoint_after_shrink(self) -> None:
        """A world with a checkpoint_dir shrunk 4 -> 2 checkpoints as a world of 2 (the manifest
        names 2 ranks; zeroctl verify passes), and a world of 2 started on it resumes bitwise."""
        ckpt = tempfile.mkdtemp(prefix="zerod-resize-ckpt-")
        self.addCleanup(shutil.rmtree, ckpt, True)
        args = ARGS + ["--checkpoint_dir", ckpt]
        world = zerod.testing.LocalWorld(4, daemons=4, args=args, log_level="info")
        try:
            ts = self.register(world, [0, 1, 2, 3], first=True)
            self.train(ts, range(1, 3))
            zeroctl("--address", world.daemons[0].control_address, "resize", "--world_size", "2")
            self.train(ts, range(3, 4))
            attempt([lambda t=t: t.step(4) for t in ts])
            for t in ts:
                t.close()
            for r in (2, 3):
                world.daemons[r].stop()
            ts = self.register(world, [0, 1])
            self.train(ts, range(4, 6))
            out = {}
            asked = threading.Thread(target=lambda: out.update(r=zeroctl(
                "--address", world.daemons[1].control_address, "checkpoint", "--wait", "60")))
            asked.start()
            time.sleep(0.5)
            self.train(ts, range(6, 7))  # the checkpoint rides step 6
            asked.join()
            self.assertIn("complete: step 6", out["r"].stdout)
            cdir = out["r"].stdout.split(" in ")[-1].strip()
            zeroctl("verify", cdir)
            with open(os.path.join(cdir, "manifest.json")) as f:
                self.assertEqual(json.load(f)["world_size"], 2)
            for t in ts:
                t.close()
        finally:
            world.stop(check=False)
        with zerod.testing.LocalWorld(2, daemons=2, args=args + ["--resume", "latest"],
                                      log_level="info") as world:
            ts = self.register(world, [0, 1])
            self.assert_same(ts, 6, "a world of 2 resumed from the checkpoint after the shrink")
            for t in ts:
                t.close()

    def test_refusals(self) -> None:
        with zerod.testing.LocalWorld(2, daemons=2, args=ARGS, log_level="info") as world:
            out = zeroctl("--address", world.daemons[0].control_address, "resize",
                          "--world_size", "1", check=False)
            self.assertEqual(out.returncode, 2, out.stderr)
            out = zeroctl("--address", world.daemons[0].control_address, "resize", check=False)
            self.assertEqual(out.returncode, 2)
            self.assertIn("--world_size", out.stderr)
        d = zerod.testing.LocalZerod(ARGS, log_level="info")
        try:
            out = zeroctl("--address", d.control_address, "resize", "--world_size", "2",
                          check=False)
            self.assertEqual(out.returncode, 1)
            self.assertIn("not in a multi-rank world", out.stderr)
        finally:
            d.stop()

    def test_peer_killed_during_resize(self) -> None:
        """A zerod SIGKILLed right after the resize was asked for: the others end in a defined
        state within the peer timeout (their trainers get an error, status says why), no hang."""
        world = zerod.testing.LocalWorld(4, daemons=4, args=ARGS, log_level="info")
        try:
            ts = self.register(world, [0, 1, 2, 3], first=True)
            self.train(ts, range(1, 3))
            zeroctl("--address", world.daemons[0].control_address, "resize", "--world_size", "2")
            self.train(ts, range(3, 4))  # the resize rides step 3
            world.daemons[3].stop(signal.SIGKILL, check=False)
            t0 = time.monotonic()
            got = attempt([lambda t=t: t.step(4) for t in ts[:3]])
            self.assertLess(time.monotonic() - t0, 60, "no hang")
            for t, e in zip(ts[:3], got):
                self.assertIsInstance(e, ZerodError, f"rank {t.rank}")
            st = status(world.daemons[0])["ranks"][0]
            self.assertIn("failed", st.get("last_resize", "") + st.get("degraded_reason", ""),
                          st)
            for t in ts:
                t.close()
        except BaseException:
            sys.stderr.write(world.log())
            raise
        finally:
            world.stop(check=False)

    def test_peer_killed_during_resize_state_dir(self) -> None:
        """As above with a state_dir: the resize fails on every survivor (the image's all-gather
        finds the peer gone), the world heals at its old size from the state files once the lost
        zerod is back, and training continues bitwise; status names the failed resize."""
        state_dir = os.path.join(tempfile.mkdtemp(prefix="zerod-resize-", dir=sd.tmpfs_root()),
                                 "state")
        self.addCleanup(shutil.rmtree, os.path.dirname(state_dir), True)
        world = zerod.testing.LocalWorld(4, daemons=4, args=ARGS + ["--state_dir", state_dir],
                                         log_level="info")
        try:
            ts = self.register(world, [0, 1, 2, 3], first=True)
            self.train(ts, range(1, 4))
            zeroctl("--address", world.daemons[2].control_address, "resize", "--world_size", "2")
            self.train(ts, range(4, 5))  # the resize rides step 4
            world.daemons[3].stop(signal.SIGKILL, check=False)
            t0 = time.monotonic()
            got = attempt([lambda t=t: t.step(5) for t in ts[:3]])
            self.assertLess(time.monotonic() - t0, 60, "no hang")
            for t, e in zip(ts[:3], got):
                self.assertIsInstance(e, ZerodError, f"rank {t.rank}: step 5")
            for t in ts:
                t.close()
            st = status(world.daemons[0])
            self.assertEqual(st["world_size"], 4, "a failed resize leaves the old size")
            self.assertIn("4 -> 2 ranks failed", st["ranks"][0].get("last_resize", ""), st)
            d = zerod.testing.LocalZerod(list(world.daemons[3].args), log_level="info")
            world.daemons[3] = d
            world._endpoints[3] = (d.socket, 0)
            ts = self.register(world, [0, 1, 2, 3])
            for t in ts:
                self.assertTrue(t.info.resumed, f"rank {t.rank} resumed its state file")
            self.assert_same(ts, 4, "W=4 healed after the failed resize")
            self.train(ts, range(5, 7))
            self.assert_same(ts, 6, "W=4 after the failed resize")
            for t in ts:
                t.close()
        except BaseException:
            sys.stderr.write(world.log())
            raise
        finally:
            world.stop(check=False)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:])
