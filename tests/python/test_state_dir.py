"""state_dir against real zerod processes: the state survives zerod.

A trainer steps in a loop against a zerod whose state lives in a file of a state_dir on tmpfs;
zerod is SIGKILLed at random moments (many of them while the trainer is inside a step), started
again with the same command line, and a new client registers with junk initial values. Every
time the rank must come back at a completed step (the last acknowledged one, or the one in
flight when its commit was done before the kill), never a half-applied one, with parameters bitwise
equal to an uninterrupted torch.optim.AdamW(foreach=False) run on the same gradients; the run
then goes on, and ends equal to the reference too. Also covered: the two header slots (the newest
one damaged: the previous commit is served), a file whose headers are both damaged (renamed
aside, not deleted, the log says why, the rank falls back to the newest checkpoint), the status
section, a second zerod on the same file, and the refusal of a state_dir other users may enter.

W=2 (a zerod per rank, one state_dir, rank 0 sends the gradient, rank 1 zeros, summed): both
zerods SIGKILLed during training and restarted (both resume the same step from their files; a
rank that committed the step in flight while the other did not goes back one commit), and one
zerod SIGKILLed while the other re-forms the world around its restart (no checkpoint was taken:
the world continues from the files, no rollback); each time bitwise equal to torch.

Options: --trials N (default 24), --seed S (default 1; "random"), --overlap (zerod with
overlap_update = 1: the speculative updates write the same second set).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import warnings
from typing import Dict, List, Optional

import common  # sets up sys.path and the library first

import numpy as np

import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402

torch = common.require_torch()

# Big enough that a step takes a while (kills land inside steps), small enough for 2 cores.
PARAMS = [("sd.w", (512, 384)), ("sd.b", (384,)), ("sd.v", (70001,)), ("sd.s", ())]
BUCKET = "65536"
NGRADS = 5  # step s's gradient is GRADS[s % NGRADS] * (1 + s / 64): cheap and never the same


def tmpfs_root() -> str:
    """A directory on tmpfs for the state_dir, or skip."""
    for root in (os.environ.get("ZEROD_TEST_TMPFS", ""), "/dev/shm", os.environ.get(
            "XDG_RUNTIME_DIR", "")):
        if root and os.path.isdir(root) and os.access(root, os.W_OK):
            out = subprocess.run(["stat", "-f", "-c", "%T", root], capture_output=True, text=True)
            if out.stdout.strip() in ("tmpfs", "ramfs"):
                return root
    common.skip("no writable tmpfs (/dev/shm, $XDG_RUNTIME_DIR or $ZEROD_TEST_TMPFS)")
    return ""


def init_values() -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in PARAMS}


_POOL: List[Dict[str, np.ndarray]] = []
_POOL_LOCK = threading.Lock()  # ranks fill their gradients on threads of their own (on_all)


def step_grads(step: int) -> Dict[str, np.ndarray]:
    with _POOL_LOCK:
        if not _POOL:
            rng = np.random.default_rng(11)
            _POOL.extend({n: rng.standard_normal(s).astype(np.float32) for n, s in PARAMS}
                         for _ in range(NGRADS))
    f = np.float32(1 + step / 64)
    return {n: g * f for n, g in _POOL[step % NGRADS].items()}


class Reference:
    """torch.optim.AdamW(foreach=False) on the same gradients, uninterrupted; params after each
    step, computed on demand."""

    def __init__(self) -> None:
        self.params = [torch.tensor(v) for v in init_values().values()]
        self.opt = torch.optim.AdamW(self.params, foreach=False)
        self.seen = {0: self.snapshot()}

    def snapshot(self) -> Dict[str, np.ndarray]:
        return {n: p.detach().numpy().copy() for (n, _), p in zip(PARAMS, self.params)}

    def at(self, step: int) -> Dict[str, np.ndarray]:
        while max(self.seen) < step:
            s = max(self.seen) + 1
            g = step_grads(s)
            for (n, _), p in zip(PARAMS, self.params):
                p.grad = torch.tensor(g[n])
            self.opt.step()
            self.seen[s] = self.snapshot()
        return self.seen[step]


class Trainer:
    """A rank's client. At W > 1 rank 0 sends step s's gradient and the others zeros, summed
    (grad_mean off): the reduced gradient is step s's at every world size."""

    def __init__(self, d, init: Optional[Dict[str, np.ndarray]], rank: int = 0,
                 register: bool = True) -> None:
        self.rank = rank
        self.client = d.connect() if isinstance(d, zerod.testing.LocalZerod) else d.connect(rank)
        self.client.layout([(n, s) for n, s in PARAMS], grad_mean=False)
        params = np.frombuffer(self.client.param_buffer, dtype=np.float32)
        grads = np.frombuffer(self.client.grad_buffer, dtype=np.float32)
        self.p, self.g = {}, {}
        for i, (name, shape) in enumerate(PARAMS):
            info = self.client.param_info(i)
            self.p[name] = params[info.offset:info.offset + info.numel].reshape(shape)
            self.g[name] = grads[info.offset:info.offset + info.numel].reshape(shape)
            self.p[name][...] = init[name] if init is not None else -7.0
        self.info = self.client.register() if register else None

    def fill(self, s: int) -> None:
        g = step_grads(s)
        for name, _ in PARAMS:
            self.g[name][...] = g[name] if self.rank == 0 else 0.0

    def step(self, s: int) -> None:
        self.fill(s)
        self.client.step()

    def snapshot(self) -> Dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.p.items()}

    def close(self) -> None:
        try:
            self.client.close()
        except ZerodError:
            pass


class StateDirTest(unittest.TestCase):
    trials = 24
    seed = 1
    overlap = False
    ref: Optional[Reference] = None

    def setUp(self) -> None:
        self.state_dir = os.path.join(tempfile.mkdtemp(prefix="zerod-state-", dir=tmpfs_root()),
                                      "state")
        self.addCleanup(shutil.rmtree, os.path.dirname(self.state_dir), True)
        if StateDirTest.ref is None:
            StateDirTest.ref = Reference()

    def assert_same(self, got: Dict[str, np.ndarray], step: int, what: str) -> None:
        want = self.ref.at(step)
        for name, _ in PARAMS:
            g, w = got[name].view(np.uint32).ravel(), want[name].view(np.uint32).ravel()
            diff = np.flatnonzero(g != w)
            self.assertEqual(diff.size, 0, f"{what}: {name} differs from torch's step {step} at "
                             f"{diff.size} elements, first {diff[:5].tolist()}")

    def start(self, extra: List[str] = ()) -> zerod.testing.LocalZerod:
        overlap = ["--overlap_update", "1"] if self.overlap else []
        return zerod.testing.LocalZerod(["--state_dir", self.state_dir, "--bucket_elems", BUCKET]
                                        + overlap + list(extra), log_level="info")

    def test_sigkill_at_random_moments_loses_no_step(self) -> None:
        rnd = random.Random(self.seed)
        d = self.start()
        t = Trainer(d, init_values())
        self.assertFalse(t.info.resumed)
        step = 0
        for s in range(1, 4):
            t.step(s)
            step = s
        self.assert_same(t.snapshot(), step, "before the first kill")
        mid_step = ahead = 0
        for trial in range(self.trials):
            state = {"acked": step, "in_step": False, "error": None}

            def loop() -> None:
                s = state["acked"] + 1
                try:
                    while True:
                        t.fill(s)
                        state["in_step"] = True  # inside zd_step: scatter, update, gather
                        t.client.step()
                        state["in_step"] = False
                        state["acked"] = s
                        s += 1
                except ZerodError as e:
                    state["error"] = e
                except BaseException as e:  # noqa: BLE001  (reported below)
                    state["error"] = e

            th = threading.Thread(target=loop)
            th.start()
            time.sleep(rnd.uniform(0.005, 0.06))
            if trial % 2:  # every other kill aimed inside a step: once one began, 0-3 ms into it
                deadline = time.monotonic() + 10
                while not state["in_step"] and time.monotonic() < deadline:
                    time.sleep(0.0002)
                time.sleep(rnd.uniform(0, 0.003))
            in_step = state["in_step"]
            common.stop_zerod(d, signal.SIGKILL)
            th.join(60)
            self.assertFalse(th.is_alive(), f"trial {trial}: the trainer hangs after the kill")
            self.assertIsInstance(state["error"], ZerodError,
                                  f"trial {trial}: the trainer's step did not fail with "
                                  f"ZerodError: {state['error']!r}")
            mid_step += in_step
            t.close()
            acked = state["acked"]
            d = self.start()
            t = Trainer(d, None)  # junk initial values: everything must come from the file
            self.assertTrue(t.info.resumed, f"trial {trial}: not resumed; log:\n{d.log()[-2000:]}")
            self.assertIn(t.info.step, (acked, acked + 1),
                          f"trial {trial}: resumed step {t.info.step}, the trainer saw {acked} "
                          f"acknowledged")
            ahead += t.info.step == acked + 1
            step = t.info.step
            self.assert_same(t.snapshot(), step, f"trial {trial}: after the restart")
            self.assertIn("from its state file", d.log())
        for s in range(step + 1, step + 4):
            t.step(s)
        step += 3
        self.assert_same(t.snapshot(), step, "at the end")
        print(f"\n    {self.trials} kills, {mid_step} while the trainer was inside a step, "
              f"{ahead} after the commit of a step not yet acknowledged; {step} steps")
        # A kill that lands inside a step is the point: most of the loop's time is in steps.
        self.assertGreaterEqual(mid_step, self.trials // 3, "too few kills landed in a step")
        t.close()
        common.stop_zerod(d)

    def test_status_section(self) -> None:
        d = self.start()
        t = Trainer(d, init_values())
        for s in range(1, 3):
            t.step(s)
        sections = t.client.status_dict()
        self.assertIn("state_file", sections, f"no state_file section: {sorted(sections)}")
        st = sections["state_file"]
        self.assertEqual(st["state_dir"], self.state_dir)
        self.assertEqual(st["rank0_committed_step"], "2")
        [path] = self.files()
        self.assertEqual(st["rank0_path"], path)
        self.assertEqual(int(st["rank0_file_bytes"]), os.stat(path).st_size)
        t.close()
        common.stop_zerod(d)

    def test_recovery_in_status_zeroctl_and_metrics(self) -> None:
        """Item 6: where the rank's state lives, its committed step, how the last recovery was
        made and how long it took: the STATUS section, zeroctl status --json and its table,
        and the metrics."""
        import re
        import urllib.request
        d = self.start()
        t = Trainer(d, init_values())
        for s in range(1, 4):
            t.step(s)
        rank = t.client.status_dict()["rank 0"]
        self.assertNotIn("last_recovery", rank, "a first registration is no recovery")
        t.close()
        common.stop_zerod(d, signal.SIGKILL)
        d = self.start(["--metrics_address", "127.0.0.1:0"])
        t = Trainer(d, None)
        [path] = self.files()
        rank = t.client.status_dict()["rank 0"]
        self.assertEqual(rank["state_file"], path)
        self.assertEqual(rank["state_committed_step"], "3")
        self.assertEqual(rank["last_recovery"], "state_dir")
        self.assertEqual(rank["last_recovery_step"], "3")
        ms = int(rank["last_recovery_ms"])
        zeroctl = os.environ.get("ZEROCTL_BIN", os.path.join(common.ROOT, "build", "client",
                                                             "zeroctl"))
        out = subprocess.run([zeroctl, "--address", d.control_address, "status", "--json"],
                             capture_output=True, text=True, timeout=30)
        r0 = json.loads(out.stdout)["ranks"][0]
        self.assertEqual((r0["state_file"], r0["state_committed_step"], r0["last_recovery"],
                          r0["last_recovery_step"], r0["last_recovery_ms"]),
                         (path, 3, "state_dir", 3, ms), out.stdout)
        out = subprocess.run([zeroctl, "--address", d.control_address, "status"],
                             capture_output=True, text=True, timeout=30)
        self.assertIn(f"rank 0: {path}, committed step 3; last recovery state_dir at step 3 in "
                      f"{ms} ms", out.stdout)
        t.step(4)
        m = re.search(r"metrics on http://(127\.0\.0\.1:\d+)/metrics", d.log())
        self.assertIsNotNone(m, "zerod did not log its metrics address")
        text = urllib.request.urlopen(f"http://{m.group(1)}/metrics", timeout=10).read().decode()
        for want in (f'zerod_rank_state_file_info{{rank="0",local_rank="0",path="{path}"}} 1',
                     'zerod_rank_state_committed_step{rank="0",local_rank="0"} 4',
                     'zerod_rank_last_recovery_info{rank="0",local_rank="0",how="state_dir"} 1',
                     'zerod_rank_last_recovery_step{rank="0",local_rank="0"} 3',
                     f'zerod_rank_last_recovery_seconds{{rank="0",local_rank="0"}} {ms / 1000:g}'):
            self.assertIn(want, text)
        t.close()
        common.stop_zerod(d)

    def files(self) -> List[str]:
        return sorted(glob.glob(os.path.join(self.state_dir, "*.zdstate")))

    def test_newest_header_damaged_serves_the_previous_commit(self) -> None:
        d = self.start()
        t = Trainer(d, init_values())
        for s in range(1, 6):
            t.step(s)
        t.close()
        common.stop_zerod(d, signal.SIGKILL)
        [path] = self.files()
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
        self.assertEqual(os.stat(self.state_dir).st_mode & 0o777, 0o700)
        with open(path, "r+b") as f:  # step 5 was the 5th commit: sequence 5, slot 1
            f.seek(2048 + 40)
            b = f.read(1)
            f.seek(2048 + 40)
            f.write(bytes([b[0] ^ 0x10]))
        d = self.start()
        t = Trainer(d, None)
        self.assertTrue(t.info.resumed)
        self.assertEqual(t.info.step, 4, "the previous commit, whose set nothing wrote since")
        self.assert_same(t.snapshot(), 4, "after the newest header was damaged")
        t.step(5)
        self.assert_same(t.snapshot(), 5, "step 5 again")
        t.close()
        common.stop_zerod(d)

    def test_corrupt_headers_fall_back_to_the_checkpoint(self) -> None:
        ckpt = tempfile.mkdtemp(prefix="zerod-ckpt-")
        self.addCleanup(shutil.rmtree, ckpt, True)
        extra = ["--checkpoint_dir", ckpt, "--checkpoint_every_steps", "3", "--resume", "latest"]
        d = self.start(extra)
        t = Trainer(d, init_values())
        for s in range(1, 6):
            t.step(s)
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(ckpt, f"step-{3:012d}", "manifest.json")):
            self.assertLess(time.monotonic(), deadline, "checkpoint of step 3 not written")
            time.sleep(0.02)
        t.close()
        common.stop_zerod(d, signal.SIGKILL)
        [path] = self.files()
        with open(path, "r+b") as f:
            for off in (8, 2048 + 8):  # both slots' version fields
                f.seek(off)
                f.write(b"\xff")
        d = self.start(extra)
        t = Trainer(d, None)
        self.assertTrue(t.info.resumed)
        self.assertEqual(t.info.step, 3, "the newest checkpoint")
        self.assert_same(t.snapshot(), 3, "after the fallback")
        log = d.log()
        self.assertIn("no usable header", log)
        self.assertIn("renamed to", log)
        aside = glob.glob(path + ".bad-*")
        self.assertEqual(len(aside), 1, f"the damaged file is kept aside: {os.listdir(self.state_dir)}")
        for s in range(4, 7):
            t.step(s)
        self.assert_same(t.snapshot(), 6, "after the fallback, trained on")
        t.close()
        common.stop_zerod(d)

    def test_second_zerod_on_the_same_file_is_refused(self) -> None:
        first = self.start()
        t = Trainer(first, init_values())
        t.step(1)
        second = self.start()
        try:
            with self.assertRaises(ZerodError) as cm:
                Trainer(second, init_values())
            self.assertIn("in use by another process", str(cm.exception))
            t.step(2)  # the first one trains on, its file untouched
            self.assert_same(t.snapshot(), 2, "the first zerod, after the refusal")
        finally:
            t.close()
            common.stop_zerod(second)
            common.stop_zerod(first)

    def test_state_dir_others_may_enter_is_refused(self) -> None:
        os.makedirs(self.state_dir, mode=0o755)
        os.chmod(self.state_dir, 0o755)
        d = zerod.testing.LocalZerod(["--state_dir", self.state_dir], start=False)
        d.spawn()
        rc = d.process.wait(30)
        self.assertNotEqual(rc, 0)
        self.assertIn("other users may enter it", d.log())

    def refused_at_start(self, args: List[str]) -> str:
        """zerod's log, once it exited (not 0) at start with these args."""
        d = zerod.testing.LocalZerod(args, start=False)
        d.spawn()
        rc = d.process.wait(30)
        self.assertNotEqual(rc, 0, f"zerod started with {args}; log:\n{d.log()[-2000:]}")
        return d.log()

    def test_state_dir_on_a_disk_is_refused_without_any_fs(self) -> None:
        """Item 7: a state_dir that is not on a memory file system is refused, naming it and
        why, unless state_dir_any_fs = 1."""
        disk = ""
        for root in (tempfile.gettempdir(), os.path.join(common.ROOT, "build"), common.ROOT):
            out = subprocess.run(["stat", "-f", "-c", "%T", root], capture_output=True, text=True)
            if os.path.isdir(root) and out.stdout.strip() not in ("tmpfs", "ramfs", ""):
                disk = root
                break
        if not disk:
            self.skipTest("SKIP: no directory on a disk file system to try")
        top = tempfile.mkdtemp(prefix="zerod-disk-state-", dir=disk)
        self.addCleanup(shutil.rmtree, top, True)
        sd = os.path.join(top, "state")
        log = self.refused_at_start(["--state_dir", sd])
        self.assertIn(f"state_dir {sd} is not on a memory file system", log)
        self.assertIn("state_dir_any_fs = 1", log)
        d = zerod.testing.LocalZerod(["--state_dir", sd, "--state_dir_any_fs", "1"])
        t = Trainer(d, init_values())
        t.step(1)
        self.assert_same(t.snapshot(), 1, "state_dir on a disk, allowed")
        t.close()
        common.stop_zerod(d)

    def test_state_dir_owned_by_another_user_is_refused(self) -> None:
        if os.geteuid() != 0:
            self.skipTest("SKIP: needs root to give the state_dir to another user")
        os.makedirs(self.state_dir, mode=0o700)
        os.chown(self.state_dir, 65534, 65534)
        log = self.refused_at_start(["--state_dir", self.state_dir])
        self.assertIn(f"state_dir {self.state_dir} is owned by uid 65534, not zerod's user", log)

    def test_another_models_state_file_is_left_alone(self) -> None:
        """Item 7: another job's state file is never mapped over a new model's state: the files
        are named by the model (rank, world, layout hash), so the new model gets its own and the
        other one is left as it was; the new model starts from its trainer's values."""
        d = self.start()
        t = Trainer(d, init_values())
        for s in range(1, 3):
            t.step(s)
        t.close()
        common.stop_zerod(d, signal.SIGKILL)
        [path] = self.files()
        with open(path, "rb") as f:
            before = f.read()
        d = self.start()
        c = d.connect()
        other = [("other.w", (300, 7)), ("other.b", (11,))]
        c.layout(other, grad_mean=False)
        params = np.frombuffer(c.param_buffer, dtype=np.float32)
        params[...] = 0.25
        info = c.register()
        try:
            self.assertFalse(info.resumed, "another model's state was resumed")
            self.assertEqual(info.step, 0)
            self.assertTrue(np.all(params == np.float32(0.25)), "the trainer's values were lost")
            files = self.files()
            self.assertEqual(len(files), 2, f"a file of its own for the new model: {files}")
            self.assertIn(path, files)
            c.step()
            with open(path, "rb") as f:
                self.assertEqual(f.read(), before, "the other model's file was written")
        finally:
            c.close()
            common.stop_zerod(d)

    def test_full_state_dir_is_refused_with_a_message(self) -> None:
        """Item 7: ENOSPC at start (a 1 MiB tmpfs, mounted for the test): the registration is
        refused naming the file and the reason; zerod stays up and serves the next one."""
        if os.geteuid() != 0:
            self.skipTest("SKIP: needs root to mount a small tmpfs")
        mnt = tempfile.mkdtemp(prefix="zerod-small-tmpfs-")
        self.addCleanup(shutil.rmtree, mnt, True)
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", mnt],
                             capture_output=True, text=True)
        if out.returncode != 0:
            self.skipTest(f"SKIP: cannot mount a tmpfs here: {out.stderr.strip()}")
        self.addCleanup(subprocess.run, ["umount", "-l", mnt], capture_output=True)
        sd = os.path.join(mnt, "state")
        d = zerod.testing.LocalZerod(["--state_dir", sd, "--bucket_elems", BUCKET])
        try:
            with self.assertRaises(ZerodError) as cm:
                Trainer(d, init_values())
            self.assertIn("cannot reserve", str(cm.exception))
            self.assertIn("No space left on device", str(cm.exception))
            self.assertIn(sd, str(cm.exception))
            self.assertIsNone(d.process.poll(), "zerod died on a full state_dir")
            self.assertEqual(glob.glob(os.path.join(sd, "*.zdstate")), [], "a partial file left")
        finally:
            common.stop_zerod(d)


def on_all(fns: List) -> list:
    """Runs every fn at once (collectives need every rank); re-raises the first error."""
    out: list = [None] * len(fns)
    errors: list = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001  (re-raised below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


class WorldTest(StateDirTest):
    """W=2, a zerod per rank, one state_dir: the world goes on from the files, no rollback."""

    def world(self, checkpoints: bool = True) -> zerod.testing.LocalWorld:
        ckpt_args: List[str] = []
        if checkpoints:
            ckpt = tempfile.mkdtemp(prefix="zerod-ckpt-")
            self.addCleanup(shutil.rmtree, ckpt, True)
            ckpt_args = ["--checkpoint_dir", ckpt]
        overlap = ["--overlap_update", "1"] if self.overlap else []
        world = zerod.testing.LocalWorld(2, daemons=2, args=[
            "--state_dir", self.state_dir, "--bucket_elems", BUCKET, "--heartbeat_ms", "100",
            "--peer_timeout_ms", "1000", "--log_level", "info"] + ckpt_args + overlap)
        self.rendezvous = world.daemons[0].control_address  # rank 0's zerod serves the store
        return world

    def register(self, world, init) -> List[Trainer]:
        ts = on_all([lambda r=r: Trainer(world, init, r, register=False) for r in range(2)])
        infos = on_all([lambda t=t: t.client.register() for t in ts])
        for t, info in zip(ts, infos):
            t.info = info
        return ts

    def train(self, ts: List[Trainer], steps: range) -> None:
        for s in steps:
            on_all([lambda t=t: t.step(s) for t in ts])

    def kill_in_step(self, world, ts: List[Trainer], step: int, victims: List[int],
                     delay: float, stats: Optional[dict] = None) -> int:
        """Trains from step + 1 until the victims' zerods are SIGKILLed, delay seconds in; the
        last step every trainer saw acknowledged. Every acknowledged step's parameters are
        checked on every rank against torch's; stats (when given) counts the kills that came
        while the trainers were inside a step ("mid_step")."""
        state = {"acked": step, "in_step": False, "wrong": ""}

        def loop() -> None:
            s = state["acked"] + 1
            try:
                while True:
                    for t in ts:
                        t.fill(s)
                    state["in_step"] = True
                    on_all([lambda t=t: t.client.step() for t in ts])
                    state["in_step"] = False
                    state["acked"] = s
                    want = self.ref.at(s)
                    for t in ts:
                        for name, _ in PARAMS:
                            if not np.array_equal(t.p[name].view(np.uint32),
                                                  want[name].view(np.uint32)):
                                state["wrong"] += f"step {s} rank {t.rank} {name}; "
                    s += 1
            except ZerodError:
                pass

        th = threading.Thread(target=loop)
        th.start()
        time.sleep(delay)
        in_step = state["in_step"]
        for v in victims:
            common.stop_zerod(world.daemons[v], signal.SIGKILL)
        th.join(120)
        self.assertFalse(th.is_alive(), "a trainer hangs after the kill")
        self.assertEqual(state["wrong"], "", "steps whose parameters differ from torch's")
        if stats is not None:
            stats["mid_step"] = stats.get("mid_step", 0) + in_step
        for t in ts:
            t.close()
        return state["acked"]

    def wait_health(self, d, want: str, timeout: float = 30) -> None:
        """Until the zerod's rank says `want` (zeroctl status)."""
        zeroctl = os.environ.get("ZEROCTL_BIN", os.path.join(common.ROOT, "build", "client",
                                                             "zeroctl"))
        deadline, health, why = time.monotonic() + timeout, "", ""
        while health != want:
            self.assertLess(time.monotonic(), deadline,
                            f"the zerod stays {health} ({why}); log:\n{d.log()[-3000:]}")
            out = subprocess.run([zeroctl, "--address", d.control_address, "status", "--json"],
                                 capture_output=True, text=True, timeout=30)
            health = json.loads(out.stdout)["ranks"][0]["health"] if out.stdout else ""
            why = out.stderr.strip()
            time.sleep(0.02)

    def test_one_zerod_killed_at_random_moments_no_checkpoints(self) -> None:
        """The survivors keep their model: no checkpoint_dir, kills of either zerod (rank 0's
        serves the rendezvous store) at random moments; every acknowledged step is torch's, and
        each heal continues at the newest step both ranks hold (0 lost)."""
        rnd = random.Random(self.seed + 2)
        world = self.world(checkpoints=False)
        try:
            ts = self.register(world, init_values())
            self.train(ts, range(1, 3))
            step, stats, ahead = 2, {}, 0
            trials = max(4, self.trials // 3)
            for trial in range(trials):
                victim = rnd.randrange(2)
                survivor = world.daemons[1 - victim]
                kept = survivor.log().count("kept its model")
                acked = self.kill_in_step(world, ts, step, [victim], rnd.uniform(0.01, 0.08),
                                          stats)
                self.wait_health(survivor, "rejoining")  # as systemd would restart it
                self.restart(world, [victim])
                ts = self.register(world, None)
                what = f"trial {trial} (zerod {victim} killed)"
                new = self.check_resumed(world, ts, acked, what)
                self.assertGreaterEqual(new, acked, f"{what}: steps lost")
                ahead += new == acked + 1
                n = survivor.log().count("kept its model")
                self.assertEqual(n, kept + 1, f"{what}: the survivor did not keep its model; "
                                 f"log:\n{survivor.log()[-3000:]}")
                sections = ts[1 - victim].client.status_dict()
                rank = sections[f"rank {1 - victim}"]
                self.assertEqual(rank["last_recovery"], "state_dir (kept)", f"{what}: {rank}")
                self.assertEqual(rank["last_recovery_step"], str(new))
                rank = ts[victim].client.status_dict()[f"rank {victim}"]
                self.assertEqual(rank["last_recovery"], "state_dir", f"{what}: {rank}")
                step = new
            print(f"\n    W=2, no checkpoints: {trials} kills of one zerod, {stats['mid_step']} "
                  f"inside a step, {ahead} resumed the step in flight; 0 lost")
            self.assertGreaterEqual(stats["mid_step"], trials // 3, "too few kills in a step")
            self.train(ts, range(step + 1, step + 4))
            for t in ts:
                self.assert_same(t.snapshot(), step + 3, f"rank {t.rank} at the end")
            for t in ts:
                t.close()
            common.stop_world(world)
        finally:
            world.stop(signal.SIGKILL, check=False)

    def test_optimizer_loops_retry_the_lost_step_by_themselves(self) -> None:
        """Issue 29: plain ZeroOptimizer training loops (zero_grad, backward, step) that never
        register again themselves; either zerod SIGKILLed at random moments and restarted on
        the same socket with the same state_dir. step() registers the model again and retries
        the step in flight: no exception reaches the loops, every step's parameters on both
        ranks are torch's (none lost, none applied twice)."""
        from zerod.torch import ZeroOptimizer
        rnd = random.Random(self.seed + 3)
        world = self.world(checkpoints=False)
        lock = threading.Lock()
        names = [n for n, _ in PARAMS]
        state = {"progress": [0, 0], "in_step": [False, False], "stop_at": 10 ** 9,
                 "wrong": [], "error": [None, None]}
        opts = on_all([lambda r=r: ZeroOptimizer(
            [(n, torch.tensor(v, requires_grad=True)) for n, v in init_values().items()],
            client=world.connect(r), grad_mean=False, foreach=False) for r in range(2)])
        params = [[p for g in o.param_groups for p in g["params"]] for o in opts]

        def loop(r: int) -> None:
            opt, ps = opts[r], params[r]
            s = 1
            try:
                while s <= state["stop_at"]:
                    g = step_grads(s)
                    opt.zero_grad()
                    loss = sum((p * (torch.tensor(np.asarray(g[n])) if r == 0 else
                                     torch.zeros(p.shape))).sum() for n, p in zip(names, ps))
                    loss.backward()
                    state["in_step"][r] = True
                    opt.step()
                    state["in_step"][r] = False
                    with lock:
                        want = self.ref.at(s)
                    for n, p in zip(names, ps):
                        if not np.array_equal(p.detach().numpy().view(np.uint32),
                                              want[n].view(np.uint32)):
                            state["wrong"].append(f"step {s} rank {r} {n}")
                    state["progress"][r] = s
                    s += 1
            except BaseException as e:  # noqa: BLE001  (asserted below)
                state["error"][r] = e

        threads = [threading.Thread(target=loop, args=(r,)) for r in range(2)]
        quiet = warnings.catch_warnings()  # step()'s "registering the model again", expected
        quiet.__enter__()
        self.addCleanup(quiet.__exit__, None, None, None)
        warnings.simplefilter("ignore")
        for th in threads:
            th.start()
        trials = max(4, self.trials // 6)
        mid_step = 0
        try:
            for trial in range(trials):
                base = min(state["progress"])
                deadline = time.monotonic() + 120
                while min(state["progress"]) < base + 2:  # training again, both ranks
                    self.assertLess(time.monotonic(), deadline,
                                    f"trial {trial}: the loops do not train again "
                                    f"({state['progress']}, {state['error']}); logs:\n"
                                    + "\n".join(d.log()[-2000:] for d in world.daemons))
                    self.assertEqual(state["error"], [None, None])
                    time.sleep(0.005)
                time.sleep(rnd.uniform(0.0, 0.05))
                victim = rnd.randrange(2)
                mid_step += any(state["in_step"])
                common.stop_zerod(world.daemons[victim], signal.SIGKILL)
                self.wait_health(world.daemons[1 - victim], "rejoining")
                self.restart(world, [victim], same_socket=True)
            state["stop_at"] = max(state["progress"]) + 3
            for th in threads:
                th.join(180)
                self.assertFalse(th.is_alive(), "a training loop hangs")
            self.assertEqual(state["error"], [None, None], "an exception reached a loop")
            self.assertEqual(state["wrong"], [], "steps whose parameters differ from torch's")
            self.assertEqual(state["progress"], [state["stop_at"]] * 2)
            print(f"\n    W=2, ZeroOptimizer loops: {trials} kills, {mid_step} inside a step, "
                  f"{state['stop_at']} steps, every one torch's, 0 lost")
            for o in opts:
                o.close()
            common.stop_world(world)
        finally:
            state["stop_at"] = -1
            world.stop(signal.SIGKILL, check=False)

    def restart(self, world, victims: List[int], same_socket: bool = False) -> None:
        for v in victims:
            args = [a for a in world.daemons[v].args]
            if v == 0 and "--control_address" not in args:
                # it serves the rendezvous store, at the address the others were given
                path = self.rendezvous[len("unix:"):]
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self.addCleanup(shutil.rmtree, os.path.dirname(path), True)
                args += ["--control_address", self.rendezvous]
            if v == 0 and os.path.exists(self.rendezvous[len("unix:"):]):
                os.unlink(self.rendezvous[len("unix:"):])  # the killed one's socket
            d = zerod.testing.LocalZerod(args, log_level="info", start=False)
            if same_socket:  # where its trainer's library connects again (zd_rejoin)
                d.socket = world.daemons[v].socket
                if os.path.exists(d.socket):
                    os.unlink(d.socket)
            d.start()
            if v == 0:
                d.control_address = self.rendezvous  # the one its args name
            world.daemons[v] = d
            world._endpoints[v] = (d.socket, 0)

    def check_resumed(self, world, ts: List[Trainer], acked: int, what: str) -> int:
        steps = {t.info.step for t in ts}
        self.assertEqual(len(steps), 1, f"{what}: the ranks resumed different steps {steps}")
        step = steps.pop()
        for t in ts:
            self.assertTrue(t.info.resumed, f"{what}: rank {t.rank} did not resume")
            self.assert_same(t.snapshot(), step, f"{what}: rank {t.rank}'s parameters")
        self.assertIn(step, (acked, acked + 1), f"{what}: resumed {step}, {acked} acknowledged")
        for d in world.daemons:
            self.assertIn("from its state file", d.log(), f"{what}: not from the state file")
        return step

    def test_every_zerod_killed_in_a_step_loses_no_step(self) -> None:
        rnd = random.Random(self.seed)
        world = self.world()
        try:
            ts = self.register(world, init_values())
            self.train(ts, range(1, 4))
            step, back, ahead = 3, 0, 0
            trials = max(3, self.trials // 4)
            for trial in range(trials):
                acked = self.kill_in_step(world, ts, step, [0, 1], rnd.uniform(0.01, 0.08))
                self.restart(world, [0, 1])
                ts = self.register(world, None)
                step = self.check_resumed(world, ts, acked, f"trial {trial}")
                back += sum("its commit before the newest" in d.log() for d in world.daemons)
                ahead += step == acked + 1
            print(f"\n    W=2: {trials} kills of both zerods; {ahead} resumed the step in flight, "
                  f"{back} rank(s) went back one commit to meet the other")
            self.train(ts, range(step + 1, step + 4))
            for t in ts:
                self.assert_same(t.snapshot(), step + 3, f"rank {t.rank} at the end")
            for t in ts:
                t.close()
            common.stop_world(world)
        finally:
            world.stop(signal.SIGKILL, check=False)

    def test_one_zerod_killed_the_world_heals_without_rollback(self) -> None:
        rnd = random.Random(self.seed + 1)
        world = self.world()
        try:
            ts = self.register(world, init_values())
            self.train(ts, range(1, 4))
            acked = self.kill_in_step(world, ts, 3, [1], rnd.uniform(0.01, 0.08))
            # as systemd would, once the survivor is re-forming the world (test_checkpoint's heal)
            zeroctl = os.environ.get("ZEROCTL_BIN", os.path.join(common.ROOT, "build", "client",
                                                                 "zeroctl"))
            deadline, health = time.monotonic() + 30, ""
            while health != "rejoining":
                self.assertLess(time.monotonic(), deadline, f"the survivor stays {health}")
                out = subprocess.run([zeroctl, "--address", world.daemons[0].control_address,
                                      "status", "--json"], capture_output=True, text=True,
                                     timeout=30)
                health = json.loads(out.stdout)["ranks"][0]["health"] if out.stdout else ""
                time.sleep(0.02)
            self.restart(world, [1])
            ts = self.register(world, None)  # rank 0's zerod re-forms the world meanwhile
            step = self.check_resumed(world, ts, acked, "after the heal")
            self.assertGreater(step, 3, "no checkpoint was taken: a rollback would be to 0")
            self.train(ts, range(step + 1, step + 4))
            for t in ts:
                self.assert_same(t.snapshot(), step + 3, f"rank {t.rank} after the heal")
            for t in ts:
                t.close()
            common.stop_world(world)
        finally:
            world.stop(signal.SIGKILL, check=False)

    # The W=1 tests are StateDirTest's.
    test_sigkill_at_random_moments_loses_no_step = None
    test_status_section = None
    test_recovery_in_status_zeroctl_and_metrics = None
    test_newest_header_damaged_serves_the_previous_commit = None
    test_corrupt_headers_fall_back_to_the_checkpoint = None
    test_second_zerod_on_the_same_file_is_refused = None
    test_state_dir_others_may_enter_is_refused = None
    test_state_dir_on_a_disk_is_refused_without_any_fs = None
    test_state_dir_owned_by_another_user_is_refused = None
    test_full_state_dir_is_refused_with_a_message = None
    test_another_models_state_file_is_left_alone = None


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--seed", default=None)
    ap.add_argument("--overlap", action="store_true", help="zerod with overlap_update = 1")
    opts, rest = ap.parse_known_args()
    StateDirTest.trials = opts.trials
    StateDirTest.overlap = opts.overlap
    StateDirTest.seed = common.test_seed(opts.seed)
    print(f"seed {StateDirTest.seed}: {common.repeat_command(StateDirTest.seed)}", flush=True)
    sys.argv = [sys.argv[0]] + rest
    common.run(StateDirTest, WorldTest)
