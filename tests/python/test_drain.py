"""zeroctl drain against real zerod processes and trainers (no torch needed).

The run is test_checkpoint.py's (the same model, gradients and uninterrupted reference). Covered:
  - a W=2 world drained while both trainers step, as one zerod of two local ranks and as two
    zerods of which the one without rank 0 is drained: the drain's checkpoint is complete
    (its manifest written) and verifies, zeroctl prints its step and directory, zerod exits 0,
    the trainers see errors, and a zerod restarted with --resume latest continues from that
    checkpoint bit-identically to the uninterrupted run;
  - a drain that cannot complete (the trainer is idle, so no step takes the checkpoint): while it
    waits, readiness (health service zerod.ranks) fails, status says draining and a registration
    is refused naming the drain; then it gives up, zeroctl exits 1 and zerod goes on serving;
  - refusals: no control token (logged with the peer), nothing to checkpoint (no checkpoint_dir,
    no model), each leaving zerod running; --force then stops it without a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import unittest
from typing import List

import common  # sets up sys.path and the library first

import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402

from test_checkpoint import (PARAMS, Trainer, close, on_all, reference, start,  # noqa: E402
                             train)

ZEROCTL = os.environ.get("ZEROCTL_BIN", "build/client/zeroctl")
LAST = 600  # the trainers step up to this far while the drain happens


def zeroctl(daemon: zerod.testing.LocalZerod, *args: str,
            timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([ZEROCTL, "--address", daemon.control_address, *args],
                          capture_output=True, text=True, timeout=timeout)


class DrainTest(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="zerod-drain-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def assert_same(self, got, want, what: str) -> None:
        for name, _ in PARAMS:
            g, w = got[name].view("u4"), want[name].view("u4")
            self.assertTrue((g == w).all(), f"{what}: {name} differs at "
                            f"{int((g != w).sum())} elements")

    def test_drain_while_training_then_resume(self) -> None:
        self.drain_while_training(daemons=1, drained=0)

    def test_drain_a_node_without_rank_0(self) -> None:
        # rank 1's zerod: its own file counts only once rank 0's zerod wrote the manifest
        self.drain_while_training(daemons=2, drained=1)

    def drain_while_training(self, daemons: int, drained: int) -> None:
        ref = reference(LAST)
        world, trainers = start(2, ["--checkpoint-dir", self.dir], daemons=daemons)
        daemon = world.daemons[drained]
        done: List[int] = [0, 0]

        def run(t: Trainer) -> None:
            for s in range(4, LAST + 1):
                t.step(s)
                done[t.rank] = s
                time.sleep(0.002)

        try:
            train(trainers, range(1, 4))
            seen: List[BaseException] = []

            def trainers_step() -> None:
                try:
                    on_all(trainers, run)
                except BaseException as e:  # checked below
                    seen.append(e)

            stepping = threading.Thread(target=trainers_step)
            stepping.start()
            time.sleep(0.3)
            out = zeroctl(daemon, "drain", "--wait", "60")
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr + world.log())
            m = re.search(r"checkpoint of step (\d+) complete in (\S+);", out.stdout)
            self.assertIsNotNone(m, out.stdout)
            step, path = int(m.group(1)), m.group(2)
            self.assertEqual(daemon.process.wait(30), 0, world.log())
            stepping.join(60)
            self.assertFalse(stepping.is_alive())
            self.assertEqual(len(seen), 1, "the trainers saw no error")
            self.assertIsInstance(seen[0], ZerodError)
            self.assertLess(max(done), LAST, "the trainers finished before zerod stopped")
            self.assertGreater(step, 3)
            self.assertEqual(path, os.path.join(self.dir, f"step-{step:012d}"))
            self.assertIn("drain: checkpoint of step", daemon.log())
            self.assertIn("shut down cleanly", daemon.log())
            for t in trainers:
                try:
                    t.client.close()  # their zerod is gone: the bye may fail
                except ZerodError:
                    pass
            common.stop_world(world)  # the drained zerod exited 0 (above), the other exits 0
        finally:
            for t in trainers:
                try:
                    t.client.close()
                except ZerodError:
                    pass
            world.stop(signal.SIGKILL, check=False)  # only what a failure above left running
        verify = subprocess.run([ZEROCTL, "verify", path], capture_output=True, text=True)
        self.assertEqual(verify.returncode, 0, verify.stdout + verify.stderr)
        # the zerod that replaces it resumes the drain's checkpoint
        world, trainers = start(2, ["--checkpoint-dir", self.dir, "--resume", "latest"],
                                init=-7.0, daemons=daemons)
        try:
            for t in trainers:
                self.assertTrue(t.info.resumed)
                self.assertEqual(t.info.step, step)
                self.assert_same(t.snapshot(), ref[step], f"rank {t.rank} at the resume")
            last = min(step + 5, LAST)
            for s, params in train(trainers, range(step + 1, last + 1)).items():
                self.assert_same(params, ref[s], f"step {s} after the resume")
        finally:
            close(world, trainers)

    def test_drain_gives_up_without_a_step(self) -> None:
        world, trainers = start(1, ["--checkpoint-dir", self.dir])
        daemon = world.daemons[0]
        try:
            train(trainers, range(1, 3))
            # The drain gives up after `wait` s; readiness must be seen down before that, which
            # needs a longer wait where zerod runs under a sanitizer.
            wait = 3 * common.HANG_SCALE
            drain = subprocess.Popen([ZEROCTL, "--address", daemon.control_address, "drain",
                                      "--wait", str(wait)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + wait * 2 / 3
            while zeroctl(daemon, "health", "--service", "zerod.ranks").returncode == 0:
                self.assertLess(time.monotonic(), deadline, "readiness still serving")
                time.sleep(0.05)
            self.assertEqual(zeroctl(daemon, "health").returncode, 0, "liveness must stay")
            status = json.loads(zeroctl(daemon, "status", "--json").stdout)
            self.assertTrue(status["nodes"][0]["draining"])
            self.assertIn("draining", zeroctl(daemon, "status").stdout)
            other = Trainer(world, 0, 0.25)
            with self.assertRaises(ZerodError) as e:
                other.client.register()
            self.assertIn("draining (zeroctl drain from", e.exception.message)
            other.client.close()
            out, err = drain.communicate(timeout=30)
            self.assertEqual(drain.returncode, 1, out + err)
            self.assertIn(f"no checkpoint was complete within {wait * 1000} ms", err)
            self.assertIn("given up, zerod goes on serving", daemon.log())
            # serving again: ready, and the trainer goes on
            self.assertEqual(zeroctl(daemon, "health", "--service", "zerod.ranks").returncode, 0)
            train(trainers, range(3, 5))
        finally:
            close(world, trainers)

    def test_refusals_and_force(self) -> None:
        with zerod.testing.LocalZerod([]) as plain:
            out = zeroctl(plain, "drain")
            self.assertEqual(out.returncode, 1, out.stdout)
            self.assertIn("nothing to checkpoint: checkpoint_dir is not set", out.stderr)
            self.assertIn("--force", out.stderr)
            self.assertEqual(zeroctl(plain, "health").returncode, 0)
        token = os.path.join(self.dir, "token")
        with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write("0123456789abcdef0123456789abcdef\n")
        ckpt = os.path.join(self.dir, "ckpt")
        os.mkdir(ckpt)
        d = zerod.testing.LocalZerod(["--checkpoint-dir", ckpt, "--control_token_file", token])
        try:
            out = zeroctl(d, "drain")
            self.assertEqual(out.returncode, 1)
            self.assertIn("needs this world's control token", out.stderr)
            self.assertRegex(d.log(), r"refused /zerod.v1.Control/Drain from unix:\S+ \(pid \d+ "
                             r"uid 0\): no control token")
            out = zeroctl(d, "--token-file", token, "drain")
            self.assertEqual(out.returncode, 1)
            self.assertIn("nothing to checkpoint: no model is registered", out.stderr)
            self.assertIsNone(d.process.poll())
            out = zeroctl(d, "--token-file", token, "drain", "--force")
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
            self.assertIn("drained without a checkpoint", out.stdout)
            self.assertIn("no model is registered", out.stderr)
            self.assertEqual(d.process.wait(30), 0, d.log())
            self.assertEqual(os.listdir(ckpt), [])
        finally:
            d.stop(check=False)


if __name__ == "__main__":
    common.run(DrainTest)
