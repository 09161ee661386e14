"""state_dir_mode = snapshot (issue 29, item 3: the CUDA backend's way to outlive zerod, tested here
on the CPU backend, which takes the same path): every N steps each rank's state is snapshotted
asynchronously into "<state_dir>/snapshot-rank<R>-of-<W>.zdbuddy" (0600), and a zerod SIGKILLed
mid-training and started again goes back to the newest snapshot every rank holds, bitwise
torch.optim.AdamW's from that step on, against real zerod processes.

- W=1: SIGKILL during training, restart: the rank resumes the snapshot's step (a multiple of N,
  at most the last acknowledged), the parameters are torch's at that step, and
  training continues bitwise; the status (snapshot section, rank fields, last_recovery: snapshot),
  the metrics and the file's mode 0600.
- W=2 (a zerod per rank, no checkpoint_dir): one zerod SIGKILLed mid-training, restarted; the
  survivor, whose state is newer, rolls back with it to the agreed snapshot step; bitwise on.
- Bad files: the newest snapshot's data damaged is set aside (renamed .bad-<ms>, a log line naming
  the file and the reason) and the one before it serves; a file of another format version, and one
  of another model, set aside too, and the rank falls back to the newest checkpoint.
- A survivor that rolls back deletes its snapshots of later steps (kept, a second loss could leave
  the ranks no step in common, or a step of two histories).
- A snapshot due while the previous one is being written is skipped and counted, never queued.
- state_snapshot_every_s alone: the first step a second after the last snapshot is taken.
- Settings refused with clear messages.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import re
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import unittest
import urllib.request
from typing import List

import common  # sets up sys.path and the library first

import numpy as np

import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402

import test_state_dir as T  # noqa: E402

EVERY = 4


def _groups():
    """The update of the running torch (its AdamW is the reference): under torch 2.x the first
    moment by lerp and torch.sqrt's rounding as measured (zerod.torch's choice); under 1.13
    zerod's defaults (as test_buddy.py)."""
    if int(T.torch.__version__.split(".")[0]) < 2:
        return None
    from zerod.torch import _probe_sqrt
    return [{"update": "torch2", "sqrt_mode": _probe_sqrt()[0]}]


# Under torch 2.x every layout of this process takes the running torch's update (the trainers of
# test_state_dir.py call client.layout without groups).
_GROUPS = _groups()
if _GROUPS is not None:
    _layout = zerod.Client.layout

    def _layout_with_groups(client, params, groups=None, **kw):
        return _layout(client, params, groups if groups is not None else _GROUPS, **kw)
    zerod.Client.layout = _layout_with_groups


def snap_path(state_dir: str, rank: int = 0, world: int = 1) -> str:
    return os.path.join(state_dir, f"snapshot-rank{rank}-of-{world}.zdbuddy")


class SnapshotTest(unittest.TestCase):
    ref = None

    setUp = T.StateDirTest.setUp
    assert_same = T.StateDirTest.assert_same
    refused_at_start = T.StateDirTest.refused_at_start

    def start(self, extra: List[str] = ()) -> zerod.testing.LocalZerod:
        return zerod.testing.LocalZerod(
            ["--state_dir", self.state_dir, "--bucket_elems", T.BUCKET, "--state_dir_mode",
             "snapshot", "--state_snapshot_every_steps", str(EVERY)] + list(extra),
            log_level="info")

    def wait_snapshot(self, client, rank: int, step: int, timeout: float = 30) -> dict:
        """Until rank's newest snapshot written is of `step`; its status section."""
        deadline = time.monotonic() + timeout
        while True:
            r = client.status_dict()[f"rank {rank}"]
            if r.get("snapshot_step") == str(step):
                return r
            self.assertLess(time.monotonic(), deadline, f"no snapshot of step {step}: {r}")
            time.sleep(0.01)

    def train_until_killed(self, ts: List[T.Trainer], first: int, kill) -> int:
        """Trains from step `first` until kill() (after a few steps) stops it; the last step every
        trainer saw acknowledged, each checked against torch's."""
        state = {"acked": first - 1, "wrong": ""}

        def loop() -> None:
            s = first
            try:
                while True:
                    for t in ts:
                        t.fill(s)
                    T.on_all([lambda t=t: t.client.step() for t in ts])
                    state["acked"] = s
                    want = self.ref.at(s)
                    for t in ts:
                        for name, _ in T.PARAMS:
                            if not np.array_equal(t.p[name].view(np.uint32),
                                                  want[name].view(np.uint32)):
                                state["wrong"] += f"step {s} rank {t.rank} {name}; "
                    s += 1
            except ZerodError:
                pass

        th = threading.Thread(target=loop)
        th.start()
        deadline = time.monotonic() + 60
        while state["acked"] < first + 2 * EVERY + 1:
            self.assertLess(time.monotonic(), deadline, "no progress")
            time.sleep(0.002)
        kill()
        th.join(120)
        self.assertFalse(th.is_alive(), "a trainer hangs after the kill")
        self.assertEqual(state["wrong"], "", "steps whose parameters differ from torch's")
        for t in ts:
            t.close()
        return state["acked"]

    # ---- W=1 --------------------------------------------------------------------------------

    def test_sigkill_w1_resumes_the_snapshot(self) -> None:
        d = self.start()
        t = T.Trainer(d, T.init_values())
        acked = self.train_until_killed([t], 1, lambda: common.stop_zerod(d, signal.SIGKILL))
        path = snap_path(self.state_dir)
        self.assertTrue(os.path.exists(path), os.listdir(self.state_dir))
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600, "the snapshot's mode")
        d = self.start(["--metrics_address", "127.0.0.1:0"])
        t = T.Trainer(d, None)
        step = t.info.step
        self.assertTrue(t.info.resumed, "the rank did not resume")
        self.assertEqual(step % EVERY, 0, f"resumed step {step}: not a snapshot's")
        # a snapshot due while the previous one is written is skipped: older ones may serve
        self.assertTrue(EVERY <= step <= acked, f"resumed {step}, acked {acked}")
        self.assert_same(t.snapshot(), step, "the snapshot's parameters")
        self.assertIn(f"resumed step {step} from its state snapshot", d.log())
        for s in range(step + 1, step + 2 * EVERY + 1):
            t.step(s)
            self.assert_same(t.snapshot(), s, f"step {s} after the restart")
            if s % EVERY == 0:  # written before the next is due (else that one is skipped)
                rank = self.wait_snapshot(t.client, 0, s)
        sections = t.client.status_dict()
        self.assertEqual((rank["last_recovery"], rank["last_recovery_step"]),
                         ("snapshot", str(step)), rank)
        self.assertEqual(int(rank["snapshot_bytes"]) + 4096, os.stat(path).st_size)
        self.assertLess(int(rank["snapshot_age_ms"]), 60000)
        sn = t.client.status_dict()["snapshot"]
        self.assertEqual((sn["state_dir_mode"], sn["every_steps"], sn["rank0_snapshot_step"]),
                         ("snapshot", str(EVERY), str(step + 2 * EVERY)), sn)
        self.assertEqual(sn["rank0_failures"], "0", sn)
        self.assertNotIn("state_file", sections, "no mapped state files in snapshot mode")
        self.assertEqual(glob.glob(os.path.join(self.state_dir, "*.zdstate")), [])
        zeroctl = os.environ.get("ZEROCTL_BIN", os.path.join(common.ROOT, "build", "client",
                                                             "zeroctl"))
        out = subprocess.run([zeroctl, "--address", d.control_address, "status", "--json"],
                             capture_output=True, text=True, timeout=30)
        r0 = json.loads(out.stdout)["ranks"][0]
        self.assertEqual((r0["snapshot_step"], r0["snapshot_bytes"], r0["last_recovery"],
                          r0["last_recovery_step"]),
                         (step + 2 * EVERY, int(rank["snapshot_bytes"]), "snapshot", step),
                         out.stdout)
        out = subprocess.run([zeroctl, "--address", d.control_address, "status"],
                             capture_output=True, text=True, timeout=30)
        self.assertRegex(out.stdout, rf"state snapshots:\n  rank 0: step {step + 2 * EVERY}, "
                         rf"\d+ ms old, {rank['snapshot_bytes']} bytes")
        self.assertIn(f"last recovery snapshot at step {step}", out.stdout)
        m = re.search(r"metrics on http://(127\.0\.0\.1:\d+)/metrics", d.log())
        self.assertIsNotNone(m, "zerod did not log its metrics address")
        text = urllib.request.urlopen(f"http://{m.group(1)}/metrics", timeout=10).read().decode()
        for want in (f'zerod_rank_snapshot_step{{rank="0",local_rank="0"}} {step + 2 * EVERY}',
                     'zerod_rank_last_recovery_info{rank="0",local_rank="0",how="snapshot"} 1',
                     f'zerod_rank_snapshot_bytes{{rank="0",local_rank="0"}} {rank["snapshot_bytes"]}'):
            self.assertIn(want, text)
        self.assertIn('zerod_rank_snapshot_age_seconds{rank="0",local_rank="0"}', text)
        t.close()
        common.stop_zerod(d)
        print(f"\n    W=1: SIGKILL at step {acked}, resumed the snapshot of step {step}, "
              f"bitwise torch's on")

    def test_every_s_takes_the_first_step_after_the_period(self) -> None:
        """state_snapshot_every_s alone: no snapshot by steps; the first step that ends a second
        after the last snapshot (or the start) is snapshotted, and restored after a SIGKILL."""
        d = zerod.testing.LocalZerod(
            ["--state_dir", self.state_dir, "--bucket_elems", T.BUCKET, "--state_dir_mode",
             "snapshot", "--state_snapshot_every_s", "1"], log_level="info")
        t = T.Trainer(d, T.init_values())
        t.step(1)
        time.sleep(1.2)
        t.step(2)
        t2 = time.monotonic()
        self.wait_snapshot(t.client, 0, 2)
        sn = t.client.status_dict()["snapshot"]
        self.assertEqual((sn["every_steps"], sn["every_s"]), ("0", "1"), sn)
        t.step(3)
        if time.monotonic() - t2 < 0.8:  # within the second after the snapshot of step 2: none
            time.sleep(0.2)
            self.assertEqual(t.client.status_dict()["rank 0"]["snapshot_step"], "2")
        t.close()
        common.stop_zerod(d, signal.SIGKILL)
        d = zerod.testing.LocalZerod(list(d.args), log_level="info")
        t = T.Trainer(d, None)
        self.assertEqual(t.info.step, 2)
        self.assert_same(t.snapshot(), 2, "the snapshot's parameters")
        t.close()
        common.stop_zerod(d)

    def test_a_snapshot_due_while_one_is_written_is_skipped_not_queued(self) -> None:
        """A snapshot every step: those due while the previous one is still being written are
        skipped and counted, none queued: snapshots + skipped = the steps, and the newest file is
        of the step its status says."""
        d = zerod.testing.LocalZerod(
            ["--state_dir", self.state_dir, "--bucket_elems", T.BUCKET, "--state_dir_mode",
             "snapshot", "--state_snapshot_every_steps", "1"], log_level="info")
        t = T.Trainer(d, T.init_values())
        steps = 16
        for s in range(1, steps + 1):
            t.step(s)
        deadline = time.monotonic() + 30
        while True:  # until the last write is done: every due step counted one way or the other
            sn = t.client.status_dict()["snapshot"]
            done = int(sn["rank0_snapshots"]) + int(sn["rank0_skipped"])
            if done == steps:
                break
            self.assertLess(time.monotonic(), deadline, f"{done} of {steps} counted: {sn}")
            time.sleep(0.01)
        self.assertGreater(int(sn["rank0_snapshots"]), 0, sn)
        self.assertEqual(sn["rank0_failures"], "0", sn)
        newest = int(sn["rank0_snapshot_step"])
        with open(snap_path(self.state_dir), "rb") as f:
            self.assertEqual(struct.unpack("<Q", f.read(40)[32:40])[0], newest, "the file's step")
        print(f"\n    a snapshot due every step: {sn['rank0_snapshots']} written, "
              f"{sn['rank0_skipped']} skipped of {steps}")
        t.close()
        common.stop_zerod(d)

    # ---- bad files ----------------------------------------------------------------------------

    def two_snapshots(self, extra: List[str] = (), ckpt: str = "") -> None:
        """Steps 1..2*EVERY+1 (snapshots of EVERY and 2*EVERY; with ckpt its checkpoint of step
        6 written), then SIGKILL."""
        d = self.start(extra)
        t = T.Trainer(d, T.init_values())
        for s in range(1, 2 * EVERY + 2):
            t.step(s)
            if s == EVERY:  # written before the next is due (else that one would be skipped)
                self.wait_snapshot(t.client, 0, EVERY)
        self.wait_snapshot(t.client, 0, 2 * EVERY)
        deadline = time.monotonic() + 30
        while ckpt and not os.path.exists(os.path.join(ckpt, f"step-{6:012d}", "manifest.json")):
            self.assertLess(time.monotonic(), deadline, "checkpoint of step 6 not written")
            time.sleep(0.02)
        t.close()
        common.stop_zerod(d, signal.SIGKILL)

    def aside(self) -> List[str]:
        return sorted(f for f in os.listdir(self.state_dir) if ".bad-" in f)

    def test_damaged_newest_is_set_aside_and_the_one_before_serves(self) -> None:
        self.two_snapshots()
        path = snap_path(self.state_dir)
        with open(path, "r+b") as f:  # one bit of the data: its checksum fails
            f.seek(4096 + 1000)
            b = f.read(1)
            f.seek(4096 + 1000)
            f.write(bytes([b[0] ^ 1]))
        d = self.start()
        t = T.Trainer(d, None)
        self.assertEqual(t.info.step, EVERY, "the snapshot before the damaged one")
        self.assert_same(t.snapshot(), EVERY, "the previous snapshot's parameters")
        log = d.log()
        self.assertRegex(log, rf"state snapshot file {re.escape(path)}: its data fails its "
                         rf"checksum \(step {2 * EVERY}\); renamed to {re.escape(path)}\.bad-\d+")
        self.assertEqual(len(self.aside()), 1, os.listdir(self.state_dir))
        t.step(EVERY + 1)
        self.assert_same(t.snapshot(), EVERY + 1, "the step after")
        t.close()
        common.stop_zerod(d)

    def test_other_version_and_other_model_fall_back_to_the_checkpoint(self) -> None:
        ckpt = os.path.join(os.path.dirname(self.state_dir), "ckpt")
        os.makedirs(ckpt)
        args = ["--checkpoint_dir", ckpt, "--checkpoint_every_steps", "3", "--resume", "latest"]
        try:
            xxh = ctypes.CDLL("libxxhash.so.0")
        except OSError:
            self.skipTest("no libxxhash.so.0 to write a header's checksum")
        xxh.XXH3_64bits.restype = ctypes.c_uint64
        xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self.two_snapshots(args, ckpt)
        path, prev = snap_path(self.state_dir), snap_path(self.state_dir) + ".prev"

        def rewrite(p: str, off: int, value: bytes) -> None:
            """value at off in p's header, the header's checksum (at 368) made right again."""
            with open(p, "r+b") as f:
                hdr = bytearray(f.read(376))
                hdr[off:off + len(value)] = value
                hdr[368:376] = struct.pack("<Q", xxh.XXH3_64bits(bytes(hdr[:368]), 368))
                f.seek(0)
                f.write(hdr)

        rewrite(path, 8, struct.pack("<I", 3))  # version 3: what a newer zerod would write
        rewrite(prev, 24, struct.pack("<Q", 0x1234))  # another layout hash: another job's model
        d = self.start(args)
        t = T.Trainer(d, None)
        newest = max(int(f[len("step-"):]) for f in os.listdir(ckpt)
                     if os.path.exists(os.path.join(ckpt, f, "manifest.json")))
        self.assertEqual(t.info.step, newest, "the newest checkpoint")
        self.assert_same(t.snapshot(), newest, "the checkpoint's parameters")
        log = d.log()
        self.assertIn(f"state snapshot file {path}: of format version 3; this zerod reads "
                      "version 2", log)
        self.assertIn(f"state snapshot file {prev}: of another model (layout hash "
                      "0000000000001234", log)
        self.assertEqual(len(self.aside()), 2, os.listdir(self.state_dir))
        rank = t.client.status_dict()["rank 0"]
        self.assertEqual(rank["last_recovery"], "checkpoint", rank)
        t.close()
        common.stop_zerod(d)

    def test_settings_refused_with_a_message(self) -> None:
        base = ["--state_dir", self.state_dir]
        log = self.refused_at_start(base + ["--state_dir_mode", "snapshot"])
        self.assertIn("state_dir_mode = snapshot needs state_snapshot_every_steps > 0 or "
                      "state_snapshot_every_s > 0", log)
        log = self.refused_at_start(base + ["--state_snapshot_every_steps", "10"])
        self.assertIn("state_snapshot_every_steps=10 / state_snapshot_every_s=0 need "
                      "state_dir_mode = snapshot", log)
        log = self.refused_at_start(["--state_dir_mode", "snapshot",
                                     "--state_snapshot_every_steps", "10"])
        self.assertIn("state_dir_mode = snapshot (", log)
        self.assertIn("needs state_dir", log)
        log = self.refused_at_start(base + ["--state_dir_mode", "mirrored"])
        self.assertIn("state_dir_mode must be one of auto, mapped, snapshot", log)

    # ---- W=2 ----------------------------------------------------------------------------------

    def test_sigkill_w2_survivor_rolls_back_to_the_agreed_snapshot(self) -> None:
        world = zerod.testing.LocalWorld(2, daemons=2, args=[
            "--state_dir", self.state_dir, "--bucket_elems", T.BUCKET, "--heartbeat_ms", "100",
            "--peer_timeout_ms", "1000", "--log_level", "info", "--state_dir_mode", "snapshot",
            "--state_snapshot_every_steps", str(EVERY)])
        self.rendezvous = world.daemons[0].control_address
        try:
            ts = T.WorldTest.register(self, world, T.init_values())
            victim = 1
            survivor = world.daemons[0]
            acked = self.train_until_killed(
                ts, 1, lambda: common.stop_zerod(world.daemons[victim], signal.SIGKILL))
            T.WorldTest.wait_health(self, survivor, "rejoining")
            T.WorldTest.restart(self, world, [victim])
            ts = T.WorldTest.register(self, world, None)
            steps = {t.info.step for t in ts}
            self.assertEqual(len(steps), 1, f"the ranks resumed different steps {steps}")
            step = steps.pop()
            self.assertEqual(step % EVERY, 0, f"resumed step {step}: not a snapshot's")
            # a snapshot due while the previous one is written is skipped: older ones may serve
            self.assertTrue(EVERY <= step <= acked, f"resumed {step}, acked {acked}")
            for t in ts:
                self.assertTrue(t.info.resumed, f"rank {t.rank} did not resume")
                self.assert_same(t.snapshot(), step, f"rank {t.rank} at the snapshot")
            for d in world.daemons:
                self.assertIn(f"resumed step {step} from its state snapshot", d.log())
            for s in range(step + 1, step + EVERY + 2):
                T.on_all([lambda t=t: t.step(s) for t in ts])
                for t in ts:
                    self.assert_same(t.snapshot(), s, f"rank {t.rank} at step {s}")
            for t in ts:
                r = t.client.status_dict()[f"rank {t.rank}"]
                self.assertEqual((r["last_recovery"], r["last_recovery_step"]),
                                 ("snapshot", str(step)), r)
                p = snap_path(self.state_dir, t.rank, 2)
                self.assertEqual(stat.S_IMODE(os.stat(p).st_mode), 0o600, p)
            for t in ts:
                t.close()
            print(f"\n    W=2: zerod 1 SIGKILLed at step {acked}; both ranks went back to the "
                  f"snapshot of step {step} (the survivor rolled back), bitwise torch's on")
        finally:
            world.stop()


    def test_w2_rollback_drops_the_survivors_newer_snapshot(self) -> None:
        """A survivor that rolls back keeps no snapshot of a later step: kept, its next write of
        that step rotated the stale file into .prev (its older common step gone), and a second
        loss of the other rank's newest file left the ranks no step in common, the registration
        refused for ever (found by snapshot_kill_trials.py: 6 hangs in 500 W=2 trials). The file
        states are the ones a SIGKILL between write_file()'s two renames leaves (newest gone,
        .prev the one before), made here by unlinking rank 1's newest after its SIGKILL."""
        world = zerod.testing.LocalWorld(2, daemons=2, args=[
            "--state_dir", self.state_dir, "--bucket_elems", T.BUCKET, "--heartbeat_ms", "100",
            "--peer_timeout_ms", "1000", "--log_level", "info", "--state_dir_mode", "snapshot",
            "--state_snapshot_every_steps", str(EVERY)])
        self.rendezvous = world.daemons[0].control_address
        last = 4 * EVERY  # the newest snapshot of each run; rank 1 loses it
        p0, p1 = snap_path(self.state_dir, 0, 2), snap_path(self.state_dir, 1, 2)

        def run(ts, first: int) -> None:
            for s in range(first, last + 2):
                T.on_all([lambda t=t: t.step(s) for t in ts])
                if s % EVERY == 0:  # written on both before the next is due
                    for t in ts:
                        self.wait_snapshot(t.client, t.rank, s)
            for t in ts:
                t.close()

        def lose_rank1_newest() -> List[T.Trainer]:
            common.stop_zerod(world.daemons[1], signal.SIGKILL)
            os.unlink(p1)
            T.WorldTest.wait_health(self, world.daemons[0], "rejoining")
            T.WorldTest.restart(self, world, [1])
            ts = T.WorldTest.register(self, world, None)
            self.assertEqual([t.info.step for t in ts], [last - EVERY] * 2,
                             "both ranks resume the step before the lost one")
            for t in ts:
                self.assert_same(t.snapshot(), last - EVERY, f"rank {t.rank} rolled back")
            return ts

        try:
            run(T.WorldTest.register(self, world, T.init_values()), 1)
            ts = lose_rank1_newest()
            self.assertFalse(os.path.exists(p0), "rank 0 kept its snapshot of a step the world "
                                                 "left")
            self.assertIn(f"(step {last}) deleted: of a history the world left at step "
                          f"{last - EVERY}", world.daemons[0].log())
            run(ts, last - EVERY + 1)
            ts = lose_rank1_newest()  # refused for ever before
            for s in range(last - EVERY + 1, last + 2):
                T.on_all([lambda t=t: t.step(s) for t in ts])
            for t in ts:
                self.assert_same(t.snapshot(), last + 1, f"rank {t.rank} trained on")
                t.close()
        except BaseException:
            sys.stderr.write(world.log()[-20000:])
            raise
        finally:
            world.stop()

    def test_w2_lost_before_the_first_snapshot_says_why(self) -> None:
        """No checkpoint_dir and a zerod SIGKILLed before the first snapshot: nothing can serve the
        re-formed world, and the registration fails with a message that says so (it does not
        silently start from the trainers' values)."""
        world = zerod.testing.LocalWorld(2, daemons=2, args=[
            "--state_dir", self.state_dir, "--bucket_elems", T.BUCKET, "--heartbeat_ms", "100",
            "--peer_timeout_ms", "1000", "--log_level", "info", "--state_dir_mode", "snapshot",
            "--state_snapshot_every_steps", "100"])
        self.rendezvous = world.daemons[0].control_address
        try:
            ts = T.WorldTest.register(self, world, T.init_values())
            T.WorldTest.train(self, ts, range(1, 4))
            for t in ts:
                t.close()
            common.stop_zerod(world.daemons[1], signal.SIGKILL)
            T.WorldTest.wait_health(self, world.daemons[0], "rejoining")
            T.WorldTest.restart(self, world, [1])
            with self.assertRaises(ZerodError) as cm:
                T.WorldTest.register(self, world, None)
            self.assertIn("no checkpoint_dir (nothing else serves: no rank holds a state snapshot "
                          "yet)", str(cm.exception))
        finally:
            world.stop(check=False)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    opts, rest = ap.parse_known_args()
    SnapshotTest.ref = T.StateDirTest.ref = T.Reference()
    sys.argv = [sys.argv[0]] + rest
    common.run(SnapshotTest)
