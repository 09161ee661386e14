"""Checkpoints, resume and resharding against real zerod processes (no torch needed).

Every run trains the same model on the same gradients: the gradient of step s is drawn from a
generator seeded with s, rank 0 sends it and the other ranks send zeros, and gradients are summed
(grad_mean=False), so the reduced gradient is exactly step s's at every world size and every
world size must produce the same bits. Covered:
  - periodic (checkpoint_every_steps) and explicit (Client.checkpoint) checkpoints: the files,
    the manifest, retention (checkpoint_keep) and the status section;
  - every zerod SIGKILLed mid-training, restarted with --resume latest: the trainers resume at the
    checkpoint's step and the continued run is bit-identical to an uninterrupted one;
  - resharding: a checkpoint written at W=4 resumed at W=2 and W=1, one written at W=1 resumed
    at W=4, each continuing bit-identically;
  - a flipped byte and a truncated file: detected by the checksum, reported with the file and
    both checksums, and the previous checkpoint loaded instead;
  - disk faults: a missing directory and a file-size limit (RLIMIT_FSIZE) fail the checkpoint
    with a clear error while training goes on, and leave no directory that looks complete;
  - a world that heals: of two zerods, one is SIGKILLed mid-training; the survivor goes
        degraded, then rejoining, without a restart of its own; the killed one is restarted (with
    its old command line: no --resume); every trainer registers again, all ranks resume the newest complete
    checkpoint and the run continues bit-identically. The times from the kill to degraded and
    from the restart to training again are printed.
"""

from __future__ import annotations

import glob
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
from typing import Dict, List, Optional

import common  # sets up sys.path and the library first

import numpy as np

import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402

PARAMS = [("ck.w", (37, 29)), ("ck.b", (29,)), ("ck.v", (300,)), ("ck.s", ())]
BUCKET = "512"  # several buckets: parameters straddle buckets and rank slices


def step_grads(step: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in PARAMS}


class Trainer:
    """One rank's client with numpy views of each parameter in the shared buffers."""

    def __init__(self, world: zerod.testing.LocalWorld, rank: int, init: Optional[float],
                 groups: Optional[List[dict]] = None) -> None:
        self.rank = rank
        self.client = world.connect(rank)
        self.client.layout([(n, s) for n, s in PARAMS], groups, grad_mean=False)
        params = np.frombuffer(self.client.param_buffer, dtype=np.float32)
        grads = np.frombuffer(self.client.grad_buffer, dtype=np.float32)
        self.p: Dict[str, np.ndarray] = {}
        self.g: Dict[str, np.ndarray] = {}
        for i, (name, shape) in enumerate(PARAMS):
            info = self.client.param_info(i)
            self.p[name] = params[info.offset:info.offset + info.numel].reshape(shape)
            self.g[name] = grads[info.offset:info.offset + info.numel].reshape(shape)
        if init is not None:
            for name, _ in PARAMS:
                self.p[name][...] = init
        self.info = None

    def snapshot(self) -> Dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.p.items()}

    def step(self, s: int) -> None:
        grads = step_grads(s)
        for name, _ in PARAMS:
            self.g[name][...] = grads[name] if self.rank == 0 else 0.0
        self.client.step()


def on_all(trainers: List[Trainer], fn) -> list:
    """fn(trainer) on every trainer at once (collectives need every rank); results in rank order."""
    out: list = [None] * len(trainers)
    errors: list = []

    def run(i: int) -> None:
        try:
            out[i] = fn(trainers[i])
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(trainers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


def start(world_size: int, args: List[str], init: Optional[float] = 0.25, daemons: int = 1,
          world: Optional[zerod.testing.LocalWorld] = None, groups: Optional[List[dict]] = None):
    if world is None:
        world = zerod.testing.LocalWorld(world_size, daemons=daemons,
                                         args=["--bucket_elems", BUCKET] + args)
    def attach(rank: int) -> Trainer:
        t = Trainer(world, rank, init, groups)
        t.info = t.client.register()
        return t

    out: list = [None] * world_size
    errors: list = []

    def run(r: int) -> None:
        try:
            out[r] = attach(r)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        world.stop(check=False)
        raise errors[0]
    return world, out


def train(trainers: List[Trainer], steps: range) -> Dict[int, Dict[str, np.ndarray]]:
    """Runs the steps on every rank; the full model after each, from rank 0's buffer."""
    seen = {}
    for s in steps:
        on_all(trainers, lambda t: t.step(s))
        seen[s] = trainers[0].snapshot()
    return seen


def close(world, trainers: List[Trainer]) -> None:
    for t in trainers:
        t.client.close()
    world.stop()


def wait_complete(root: str, step: int, timeout: float = 30.0) -> str:
    path = os.path.join(root, f"step-{step:012d}")
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(path, "manifest.json")):
        if time.monotonic() > deadline:
            raise AssertionError(f"checkpoint of step {step} not complete in {timeout} s")
        time.sleep(0.02)
    return path


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
    """A safetensors file of F32 tensors, read by the format's definition (8-byte header length,
    JSON header, raw data): the test does not trust zerod's own reader."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", t
        begin, end = t["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + begin:8 + n + end], dtype=np.float32).reshape(
            t["shape"])
    return out


def rank_health(daemon: zerod.testing.LocalZerod) -> dict:
    """Local rank 0's row of `zeroctl status --json` (the control service: attaches no rank)."""
    zeroctl = os.environ.get("ZEROCTL_BIN", "build/client/zeroctl")
    out = subprocess.run([zeroctl, "--address", daemon.control_address, "status", "--json"],
                         capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout)["ranks"][0]


_REFERENCE: Dict[int, Dict[str, np.ndarray]] = {}


def reference(steps: int = 12) -> Dict[int, Dict[str, np.ndarray]]:
    """The uninterrupted run at W=1 (computed once)."""
    if max(_REFERENCE, default=-1) < steps:
        _REFERENCE.clear()
        world, trainers = start(1, [])
        _REFERENCE[0] = trainers[0].snapshot()
        _REFERENCE.update(train(trainers, range(1, steps + 1)))
        close(world, trainers)
    return _REFERENCE


class CheckpointTest(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="zerod-ckpt-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def assert_same(self, got: Dict[str, np.ndarray], want: Dict[str, np.ndarray], what: str):
        for name, _ in PARAMS:
            g, w = got[name].view(np.uint32), want[name].view(np.uint32)
            diff = np.flatnonzero(g.ravel() != w.ravel())
            self.assertEqual(diff.size, 0, f"{what}: {name} differs at {diff.size} elements, "
                             f"first {diff[:5].tolist()}")

    def continue_and_compare(self, world_size: int, resume_step: int, last: int, args: List[str],
                             what: str) -> List[Trainer]:
        ref = reference(last)
        world, trainers = start(world_size, ["--checkpoint-dir", self.dir] + args, init=-7.0)
        try:
            for t in trainers:
                self.assertTrue(t.info.resumed, f"{what}: rank {t.rank} did not resume")
                self.assertEqual(t.info.step, resume_step, f"{what}: rank {t.rank}")
                self.assert_same(t.snapshot(), ref[resume_step],
                                 f"{what}: rank {t.rank}'s parameters at the resume")
            seen = train(trainers, range(resume_step + 1, last + 1))
            for s, params in seen.items():
                self.assert_same(params, ref[s], f"{what}: step {s}")
        finally:
            close(world, trainers)
        return trainers

    def test_periodic_explicit_and_retention(self) -> None:
        world, trainers = start(2, ["--checkpoint-dir", self.dir, "--checkpoint-every-steps", "2",
                                    "--checkpoint-keep", "2"])
        try:
            train(trainers, range(1, 8))
            wait_complete(self.dir, 6)
            got = on_all(trainers, lambda t: t.client.checkpoint())
            self.assertEqual(got[0][0], 7)
            self.assertEqual(got[0][1], os.path.join(self.dir, "step-000000000007"))
            path = wait_complete(self.dir, 7)
            with open(os.path.join(path, "manifest.json")) as f:
                manifest = json.load(f)
            self.assertEqual(manifest["step"], 7)
            self.assertEqual(manifest["world_size"], 2)
            self.assertEqual([p["name"] for p in manifest["params"]], [n for n, _ in PARAMS])
            self.assertEqual(sorted(f["name"] for f in manifest["files"]),
                             ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"])
            # keep 2: steps 6 and 7 remain
            time.sleep(0.2)
            self.assertEqual(sorted(os.listdir(self.dir)),
                             ["step-000000000006", "step-000000000007"])
            status = trainers[0].client.status_dict()
            self.assertEqual(status["checkpoint"]["last_step"], "7")
            self.assertNotIn("last_error", status["checkpoint"])
        finally:
            close(world, trainers)

    def test_zeroctl_checkpoint_and_export(self) -> None:
        zeroctl = os.environ.get("ZEROCTL_BIN", "build/client/zeroctl")
        world, trainers = start(2, ["--checkpoint-dir", self.dir])
        try:
            train(trainers, range(1, 3))
            address = world.daemons[0].control_address
            ask = subprocess.Popen([zeroctl, "--address", address, "checkpoint", "--wait", "60"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            time.sleep(0.5)  # requested before step 3: taken after it, on both ranks
            train(trainers, range(3, 4))
            out, _ = ask.communicate(timeout=60)
            self.assertEqual(ask.returncode, 0, out)
            self.assertIn("complete: step 3", out)
        finally:
            close(world, trainers)
        path = os.path.join(self.dir, "step-000000000003")
        out = subprocess.run([zeroctl, "verify", path], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        export = os.path.join(self.dir, "model.safetensors")
        out = subprocess.run([zeroctl, "export", path, "--out", export, "--moments"],
                             capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        tensors = read_safetensors(export)
        for name, shape in PARAMS:
            self.assertEqual(tensors[name].shape, shape)
            self.assert_same({n: tensors[n] for n, _ in PARAMS}, reference()[3], "exported")
            self.assertIn(name + ".exp_avg", tensors)
            self.assertIn(name + ".exp_avg_sq", tensors)

    def test_world_heals_around_a_restarted_zerod(self) -> None:
        ref = reference(220)
        args = ["--checkpoint-dir", self.dir, "--checkpoint-every-steps", "3",
                "--heartbeat_ms", "100", "--peer_timeout_ms", "1000"]
        world, trainers = start(2, args, daemons=2)
        survivor, victim = world.daemons
        try:
            train(trainers, range(1, 8))
            wait_complete(self.dir, 6)
            # SIGKILL the zerod of rank 1 while rank 0's trainer is inside a step
            t_kill = time.monotonic()
            killed: List[BaseException] = []

            def kill() -> None:
                try:
                    common.stop_zerod(victim, signal.SIGKILL)
                except BaseException as e:  # noqa: BLE001  (raised below)
                    killed.append(e)
            killer = threading.Timer(0.05, kill)
            killer.start()
            with self.assertRaises(ZerodError):
                on_all(trainers, lambda t: [t.step(s) for s in range(8, 200)])
            killer.join()
            if killed:
                raise killed[0]
            phases, t_degraded = [], None
            deadline = time.monotonic() + 30
            while "rejoining" not in phases:
                self.assertLess(time.monotonic(), deadline, f"phases seen: {phases}")
                health = rank_health(survivor)["health"]
                if not phases or phases[-1] != health:
                    phases.append(health)
                    if health in ("degraded", "rejoining") and t_degraded is None:
                        t_degraded = time.monotonic() - t_kill
                time.sleep(0.02)
            for t in trainers:
                try:
                    t.client.close()
                except ZerodError:
                    pass
            # systemd or Kubernetes would restart it; the survivor is not restarted
            t_restart = time.monotonic()
            # restarted with its old command line, without --resume: the survivor's rollback
            # makes every rank load the newest checkpoint
            restarted = zerod.testing.LocalZerod(victim.args, log_level="debug")
            world.daemons[1] = restarted
            world._endpoints[1] = (restarted.socket, 0)
            world2, trainers = start(2, [], init=-7.0, world=world)
            # the newest complete checkpoint when rank 1 died (steps went on until the kill)
            newest = max(int(d[5:]) for d in os.listdir(self.dir)
                         if os.path.exists(os.path.join(self.dir, d, "manifest.json")))
            self.assertGreaterEqual(newest, 6)
            for t in trainers:
                self.assertTrue(t.info.resumed)
                self.assertEqual(t.info.step, newest, f"rank {t.rank} resumed the newest one")
                self.assert_same(t.snapshot(), ref[newest], f"rank {t.rank} after the heal")
            seen = train(trainers, range(newest + 1, newest + 7))
            t_training = time.monotonic() - t_restart
            for s, params in seen.items():
                self.assert_same(params, ref[s], f"healed world, step {s}")
            status = trainers[0].client.rank_status()
            self.assertEqual(status["health"], "ok")
            self.assertEqual(status["heals"], "1")
            # the store (rank 0's zerod) freed what the broken world instance had written
            freed = re.findall(r"rendezvous freed (\d+) key\(s\) under 'gloo/", survivor.log())
            self.assertTrue(freed and int(freed[0]) >= 2, survivor.log()[-3000:])
            print(f"\n    heal: SIGKILL -> survivor {phases[0]} in {t_degraded * 1000:.0f} ms"
                  f" (phases {' -> '.join(phases)}); restart (from the process start) -> 6 "
                  f"steps trained again in {t_training * 1000:.0f} ms", flush=True)
            for t in trainers:
                t.client.close()
            common.stop_world(world)  # the survivor and the restarted zerod exit 0
        finally:
            for t in trainers:
                try:
                    t.client.close()
                except ZerodError:
                    pass
            world.stop(signal.SIGKILL, check=False)  # only what a failure above left running

    def test_sigkill_every_zerod_then_resume_is_bit_identical(self) -> None:
        ref = reference(12)
        world, trainers = start(2, ["--checkpoint-dir", self.dir, "--checkpoint-every-steps", "4"])
        seen = train(trainers, range(1, 11))
        for s in range(1, 11):
            self.assert_same(seen[s], ref[s], f"W=2 before the kill, step {s}")
        wait_complete(self.dir, 8)
        common.stop_world(world, signal.SIGKILL)
        for t in trainers:
            try:
                t.client.close()
            except ZerodError:
                pass
        self.continue_and_compare(2, 8, 12, ["--resume", "latest"], "W=2 after SIGKILL")

    def test_reshard_4_to_2_and_1(self) -> None:
        world, trainers = start(4, ["--checkpoint-dir", self.dir, "--checkpoint-every-steps", "6"])
        train(trainers, range(1, 7))
        wait_complete(self.dir, 6)
        close(world, trainers)
        self.continue_and_compare(2, 6, 10, ["--resume", "latest"], "written at W=4, W=2")
        self.continue_and_compare(1, 6, 10, ["--resume", "latest"], "written at W=4, W=1")

    def test_amsgrad_resume_and_reshard_is_bit_identical(self) -> None:
        # max_exp_avg_sq goes through the checkpoint: written at W=2, resumed at W=1 and W=3,
        # every step after bitwise the uninterrupted run's.
        ams = [{"amsgrad": True}]
        world, trainers = start(1, [], groups=ams)
        ref = {0: trainers[0].snapshot()}
        ref.update(train(trainers, range(1, 11)))
        close(world, trainers)
        self.assertFalse(np.array_equal(ref[10]["ck.w"], reference(10)[10]["ck.w"]))
        world, trainers = start(2, ["--checkpoint-dir", self.dir, "--checkpoint-every-steps", "6"],
                                groups=ams)
        train(trainers, range(1, 7))
        wait_complete(self.dir, 6)
        close(world, trainers)
        for w in (1, 3):
            world, trainers = start(w, ["--checkpoint-dir", self.dir, "--resume", "latest"],
                                    init=-7.0, groups=ams)
            try:
                for t in trainers:
                    self.assertTrue(t.info.resumed and t.info.step == 6, f"W={w} rank {t.rank}")
                    self.assert_same(t.snapshot(), ref[6], f"amsgrad W={w}: at the resume")
                for s, params in train(trainers, range(7, 11)).items():
                    self.assert_same(params, ref[s], f"amsgrad, written at W=2, W={w}: step {s}")
            finally:
                close(world, trainers)
        # A checkpoint written without amsgrad has no max_exp_avg_sq: refused, not zeroed.
        plain = os.path.join(self.dir, "plain")
        os.mkdir(plain)
        world, trainers = start(1, ["--checkpoint-dir", plain, "--checkpoint-every-steps", "2"])
        train(trainers, range(1, 3))
        wait_complete(plain, 2)
        close(world, trainers)
        with self.assertRaises(ZerodError) as cm:
            start(1, ["--checkpoint-dir", plain, "--resume", "latest"], groups=ams)
        self.assertIn("has no max_exp_avg_sq", str(cm.exception))

    def test_reshard_1_to_4(self) -> None:
        world, trainers = start(1, ["--checkpoint-dir", self.dir, "--checkpoint-every-steps", "5"])
        train(trainers, range(1, 6))
        wait_complete(self.dir, 5)
        close(world, trainers)
        self.continue_and_compare(4, 5, 9, ["--resume", "latest"], "written at W=1, W=4")

    def corrupt_and_resume(self, damage) -> str:
        world, trainers = start(1, ["--checkpoint-dir", self.dir, "--checkpoint-every-steps", "3"])
        train(trainers, range(1, 7))
        wait_complete(self.dir, 6)
        close(world, trainers)
        shard = os.path.join(self.dir, "step-000000000006", "rank-00000-of-00001.safetensors")
        damage(shard)
        world, trainers = start(1, ["--checkpoint-dir", self.dir, "--resume", "latest"], init=-7.0)
        try:
            self.assertEqual(trainers[0].info.step, 3, "the previous checkpoint is loaded")
            self.assert_same(trainers[0].snapshot(), reference()[3], "fallback to step 3")
            log = world.log()
        finally:
            close(world, trainers)
        self.assertIn("step-000000000006", log)
        self.assertIn("falling back to the previous", log)
        return log

    def test_flipped_byte_falls_back(self) -> None:
        def flip(path: str) -> None:
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) - 100)
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 0x10]))

        log = self.corrupt_and_resume(flip)
        self.assertIn("rank-00000-of-00001.safetensors", log)
        self.assertRegex(log, r"checksum [0-9a-fx]+.*expected [0-9a-fx]+")

    def test_truncated_file_falls_back(self) -> None:
        def truncate(path: str) -> None:
            os.truncate(path, os.path.getsize(path) // 2)

        log = self.corrupt_and_resume(truncate)
        self.assertIn("rank-00000-of-00001.safetensors", log)

    def test_missing_directory_fails_clearly_and_training_goes_on(self) -> None:
        missing = os.path.join(self.dir, "not-there")
        world, trainers = start(1, ["--checkpoint-dir", missing])
        try:
            train(trainers, range(1, 3))
            with self.assertRaises(ZerodError) as cm:
                trainers[0].client.checkpoint()
            self.assertIn("not-there", str(cm.exception))
            seen = train(trainers, range(3, 5))
            self.assert_same(seen[4], reference()[4], "training after the failed checkpoint")
            status = trainers[0].client.status_dict()["checkpoint"]
            self.assertEqual(status["failures"], "1")
            self.assertIn("not-there", status["last_error"])
            self.assertEqual(status["last_step"], "never")
        finally:
            close(world, trainers)

    def test_file_size_limit_fails_clearly_and_leaves_nothing_complete(self) -> None:
        world, trainers = start(1, ["--checkpoint-dir", self.dir])
        try:
            train(trainers, range(1, 3))
            trainers[0].client.checkpoint()  # a good one first
            pid = world.daemons[0].pid
            subprocess.run(["prlimit", f"--pid={pid}", "--fsize=4096"], check=True)
            train(trainers, range(3, 4))
            with self.assertRaises(ZerodError) as cm:
                trainers[0].client.checkpoint()
            self.assertIn("File too large", str(cm.exception))
            seen = train(trainers, range(4, 6))
            self.assert_same(seen[5], reference()[5], "training after the failed checkpoint")
            status = trainers[0].client.status_dict()["checkpoint"]
            self.assertEqual(status["last_step"], "2")
            self.assertIn("step 3", status["last_error"])
        finally:
            close(world, trainers)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "step-000000000003",
                                                     "manifest.json")))
        leftovers = glob.glob(os.path.join(self.dir, "step-000000000003", "*.safetensors"))
        self.assertEqual(leftovers, [], "only temporary files may be left of a failed write")


if __name__ == "__main__":
    common.run(CheckpointTest)
