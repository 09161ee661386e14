"""Buddy copies with the world's store on a real etcd (`rendezvous = etcd://...`, Debian's
etcd-server), against real zerod processes (test_buddy.py's harness, W=2, one state_dir, a copy
every 4 steps, "sd.b" without a gradient on every third step, so that the per-parameter step
lags travel too).

  1. A node lost with its memory: zerod 1 SIGKILLed, its state file deleted, started again; the
     world re-forms through etcd, rank 1 reads its copy of step 8 from zerod 0 and rank 0 goes
     back to its own snapshot; every parameter equals torch's AdamW (None gradients where absent)
     bitwise at step 8 and on the steps after.
  2. Every node lost at once: both zerods SIGKILLed and the state_dir emptied (state files and
     the copies held). etcd outlives them and records each rank's newest complete copy, so the
     new zerods tell this from a first start: the world falls back to the newest checkpoint (step
     6), and status says why: the rank's last_recovery_note names the loss of every node, and
     the buddy section the copy's step that was lost (8) and the step the world continued from.
  3. A store that stalls while the copies are recorded: etcd stopped (SIGSTOP) while both copies
     of step 4 are on their way (throttled), so each sender's record of its copy waits for etcd;
     meanwhile each zerod's status answers at once and the steps go on, and the records land once
     etcd continues. (The record once held the sender's lock, which status on the loop thread and
     the step take: with the record in rank 0's own control service, the loop waited for itself
     and the heartbeats stopped with it until the call's deadline, 5 s.)

Exit 77 (skip) when etcd is not installed or no tmpfs is writable. About 15 s.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time

import common  # sets up sys.path and the library first

import test_buddy  # noqa: E402
from test_buddy import EVERY, LagReference, init_values  # noqa: E402
from test_etcd import ETCD, Etcd  # noqa: E402


class BuddyEtcdTest(test_buddy.BuddyTest):
    etcd = None
    tmp = ""

    @classmethod
    def setUpClass(cls) -> None:
        if ETCD is None:
            common.skip("etcd is not installed (Debian package etcd-server)")
        cls.tmp = tempfile.mkdtemp(prefix="zerod-buddy-etcd-")
        cls.etcd = Etcd(cls.tmp)

    @classmethod
    def tearDownClass(cls) -> None:
        if cls.etcd is not None:
            cls.etcd.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def etcd_world(self, job: str, extra=()):
        return self.world(["--rendezvous", f"etcd://{self.etcd.endpoint}/{job}"] + list(extra))

    def test_node_lost_with_its_memory_comes_back_from_its_buddy(self) -> None:
        ref = LagReference()
        world = self.etcd_world("buddy1")
        ts = self.register_lagging(world, init_values())
        self.train(ts, range(1, 2 * EVERY + 1), ref=ref)
        self.wait_copies(ts, 2 * EVERY)
        self.assertTrue(any(k.endswith("/buddy/copied/1") for k in self.etcd.keys("/zerod/")),
                        "the store does not record rank 1's copy")
        self.train(ts, range(2 * EVERY + 1, 2 * EVERY + 3), ref=ref)
        self.kill(world, [1], ts)
        self.wait_health(world.daemons[0], "rejoining")
        self.wipe(1)
        self.restart(world, [1])
        ts = self.register_lagging(world, None)
        for t in ts:
            self.assertEqual(t.info.step, 2 * EVERY, f"rank {t.rank} resumed step {t.info.step}")
            self.assert_same(t.snapshot(), 2 * EVERY, f"rank {t.rank} after the recovery", ref)
            rank = t.client.rank_status()
            self.assertEqual(rank["last_recovery"], "buddy copy", rank)
        self.assertIn("from its buddy's copy", world.daemons[1].log())
        self.assertIn("from its own snapshot", world.daemons[0].log())
        self.train(ts, range(2 * EVERY + 1, 3 * EVERY + 1), ref=ref, check=True)
        for t in ts:
            t.close()
        common.stop_world(world)

    def test_every_node_lost_at_once_is_in_status(self) -> None:
        ckpt = tempfile.mkdtemp(prefix="zerod-ckpt-")
        self.addCleanup(shutil.rmtree, ckpt, True)
        ref = LagReference()
        world = self.etcd_world("buddy2", ["--checkpoint_dir", ckpt,
                                           "--checkpoint_every_steps", "3", "--resume", "latest"])
        ts = self.register_lagging(world, init_values())
        self.train(ts, range(1, 2 * EVERY + 1), ref=ref)
        self.wait_copies(ts, 2 * EVERY)
        self.kill(world, [0, 1], ts)
        for f in os.listdir(self.state_dir):  # every node's memory: files and held copies
            os.unlink(os.path.join(self.state_dir, f))
        self.restart(world, [0, 1])
        ts = self.register_lagging(world, None)
        for t in ts:
            self.assertTrue(t.info.resumed)
            self.assertEqual(t.info.step, 6, "not the newest checkpoint (step 6)")
            self.assert_same(t.snapshot(), 6, f"rank {t.rank} from the checkpoint", ref)
            rank = t.client.rank_status()
            self.assertEqual(rank["last_recovery"], "checkpoint", rank)
            self.assertEqual(rank["last_recovery_step"], "6", rank)
            self.assertIn("every node was lost at once", rank.get("last_recovery_note", ""), rank)
            self.assertIn(f"rank {t.rank}'s copy of step {2 * EVERY}", rank["last_recovery_note"])
            buddy = t.client.status_dict()["buddy"]
            self.assertEqual(buddy.get("all_lost_copy_step"), str(2 * EVERY), buddy)
            self.assertIn("every node lost at once", buddy.get("all_lost", ""), buddy)
        self.train(ts, range(7, 10), ref=ref, check=True)
        for t in ts:
            buddy = t.client.status_dict()["buddy"]
            self.assertEqual(buddy.get("all_lost_continued_from"), "6", buddy)
        for t in ts:
            t.close()
        common.stop_world(world)

    def test_a_stalled_store_stalls_neither_status_nor_steps(self) -> None:
        world = self.etcd_world("buddy3", ["--buddy_bandwidth_bytes_per_s", "700000"])
        ts = self.register(world, init_values())
        self.train(ts, range(1, EVERY + 1))
        # Both copies of step EVERY under way: each holder has begun its file, so each sender has
        # chosen its holder (in etcd); at this cap it records its copy (1.6 MB) about 2.3 s later.
        parts = [os.path.join(self.state_dir, f"buddy-rank{r}-of-2.zdbuddy.part") for r in (0, 1)]
        deadline = time.monotonic() + 20
        while not all(os.path.exists(p) for p in parts):
            self.assertLess(time.monotonic(), deadline, f"no copy under way: {parts}")
            time.sleep(0.01)
        self.etcd.proc.send_signal(signal.SIGSTOP)
        self.addCleanup(self.etcd.proc.send_signal, signal.SIGCONT)  # before tearDownClass's stop
        stopped_until = time.monotonic() + 4.5  # the records wait for etcd for 2 s or more of it
        slowest, step = (0.0, ""), EVERY

        def timed(what, fn):
            nonlocal slowest
            t0 = time.monotonic()
            fn()
            took = time.monotonic() - t0
            if took > slowest[0]:
                slowest = (took, what)

        while time.monotonic() < stopped_until:
            for t in ts:
                timed(f"rank {t.rank}'s status", t.client.status_dict)
            if step < 2 * EVERY - 1:  # not the next copy's step: its sender would need etcd
                step += 1
                timed(f"step {step}", lambda s=step: self.train(ts, range(s, s + 1)))
            time.sleep(0.1)
        self.etcd.proc.send_signal(signal.SIGCONT)
        # A record waiting for etcd holds nothing that status or a step needs: each takes ms.
        self.assertLess(slowest[0], 1.0, f"{slowest[1]} took {slowest[0]:.2f} s while etcd was "
                        "stopped")
        self.wait_copies(ts, EVERY)  # recorded: the sender's status says the copy is done
        keys = self.etcd.keys("/zerod/")
        for r in (0, 1):
            self.assertTrue(any(k.endswith(f"/buddy/copied/{r}") for k in keys), keys)
        self.train(ts, range(2 * EVERY, 2 * EVERY + 1), check=True)  # the world held together
        for t in ts:
            t.close()
        common.stop_world(world)


# Only this file's tests: test_buddy.py's run there, on the built-in store.
for _name in dir(test_buddy.BuddyTest):
    if _name.startswith("test_") and _name not in BuddyEtcdTest.__dict__:
        setattr(BuddyEtcdTest, _name, None)


if __name__ == "__main__":
    sys.argv = sys.argv[:1]
    common.run(BuddyEtcdTest)
