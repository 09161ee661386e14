"""A restart after a live resize, against real zerod processes (README "Live resize",
docs/design.md "Live resize"; daemon/world/world_record.c).

A live resize changes the world's size in memory; a zerod that restarts reads its configured
world_size again. So every zerod writes a world size record ("world_size=2 from=4 step=4") into
its state_dir when a resize commits, and rank 0 into the rendezvous store; at start the newest
record replaces the configured size (world_size_record = use).

- A world of 4 (one state_dir) shrunk to 2; rank 1's zerod SIGKILLed and started again with its
  old command line (--world_size 4): it joins the world of 2 within seconds (it used to wait for
  a world of 4 for connect_timeout_ms), the trainers register again, resume from the state files
  and go on bitwise equal to torch; status says world_size 2 and configured_world_size 4. The
  record file is 0600.
- Rank 2's zerod (removed by the shrink) started again with its old command line stays out:
  degraded, its trainer refused with ZD_ERANK naming the resize.
- Grown back to 4: the record says 4 again, the new zerods join, training goes on bitwise.
- Buddy copies after a shrink go to a node of the new world and succeed.
- Rank 0's zerod restarted after a shrink (its built-in store empty) takes its state_dir's
  record and stores it again; on etcd, the record outlives every zerod.
- A peer lost while the world re-forms after a resize is named in the status and the log.
- world_size_record = ignore: the configured size, as before; a malformed record is refused at
  start with a message naming the file and the form expected.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import sys
import tempfile
import time
import unittest
from typing import List

import common  # sets up sys.path and the library first

import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402

torch = common.require_torch()

import test_resize as rz  # noqa: E402  (its trainers, reference, zeroctl and status)
import test_state_dir as sd  # noqa: E402

ZD_EPEER, ZD_ERANK = rz.ZD_EPEER, rz.ZD_ERANK
status, zeroctl, attempt = rz.status, rz.zeroctl, rz.attempt


class ResizeRestartTest(unittest.TestCase):
    ref: sd.Reference = None
    # test_resize's helpers (not its tests)
    assert_same = rz.ResizeTest.assert_same
    register = rz.ResizeTest.register
    train = rz.ResizeTest.train
    wait_world_size = rz.ResizeTest.wait_world_size

    def setUp(self) -> None:
        if ResizeRestartTest.ref is None:
            ResizeRestartTest.ref = sd.Reference()

    def state_dir(self) -> str:
        root = tempfile.mkdtemp(prefix="zerod-resize-restart-", dir=sd.tmpfs_root())
        self.addCleanup(shutil.rmtree, root, True)
        return os.path.join(root, "state")

    def restart(self, world, rank: int, extra: List[str] = ()) -> zerod.testing.LocalZerod:
        """rank's zerod again with its first command line (plus extra), not waited for."""
        d = zerod.testing.LocalZerod(list(world.daemons[rank].args) + list(extra),
                                     log_level="info", start=False, timeout=30.0)
        d.spawn()
        world.daemons[rank] = d
        world._endpoints[rank] = (d.socket, 0)
        return d

    def restart_at_its_address(self, world, rank: int) -> zerod.testing.LocalZerod:
        """rank's zerod (stopped) again with its first command line at its old control address,
        which the others' rendezvous_address names (rank 0's built-in store); not waited for."""
        old = world.daemons[rank]
        addr = old.control_address
        if os.path.exists(addr[len("unix:"):]):
            os.unlink(addr[len("unix:"):])
        d = zerod.testing.LocalZerod(old.args + ["--control_address", addr], log_level="info",
                                     start=False, timeout=30.0)
        d.control_address = addr
        d.spawn()
        world.daemons[rank] = d
        world._endpoints[rank] = (d.socket, 0)
        return d

    def wait_health(self, d, want: str, timeout: float = 20.0) -> dict:
        end = time.monotonic() + timeout
        while True:
            try:
                st = status(d)
                if st["ranks"] and st["ranks"][0]["health"] == want:
                    return st
            except ValueError:  # not serving yet
                st = None
            if time.monotonic() > end:
                self.fail(f"{d.control_address}: health never {want}: {st}\n{d.log()[-3000:]}")
            time.sleep(0.05)

    def assert_stays_out(self, d, world_size: int, configured: int, why: str) -> None:
        """d (a zerod started again as it was, beyond the recorded size) stays out: degraded,
        the recorded and the configured size in status, a registration refused with ZD_ERANK
        whose message contains why."""
        st = self.wait_health(d, "degraded")
        self.assertEqual(st["world_size"], world_size, st)
        self.assertEqual(st.get("configured_world_size"), configured, st)
        self.assertIn("outside the world", st["ranks"][0]["degraded_reason"])
        c = d.connect()
        c.layout([(n, s) for n, s in sd.PARAMS], grad_mean=False)
        with self.assertRaises(ZerodError) as cm:
            c.register()
        self.assertEqual(cm.exception.code, ZD_ERANK, cm.exception.message)
        self.assertIn(why, cm.exception.message)
        try:
            c.close()
        except ZerodError:
            pass

    def shrink(self, world, ts, step: int) -> None:
        """4 -> 2 riding step `step`; the trainers closed, the leavers (2, 3) stopped."""
        zeroctl("--address", world.daemons[1].control_address, "resize", "--world_size", "2")
        self.train(ts, range(step, step + 1))
        attempt([lambda t=t: t.step(step + 1) for t in ts])
        for t in ts:
            t.close()
        self.wait_world_size(world.daemons[0], 2)
        self.wait_world_size(world.daemons[1], 2)

    def test_restart_after_shrink_and_grow(self) -> None:
        state = self.state_dir()
        args = rz.ARGS + ["--state_dir", state]
        world = zerod.testing.LocalWorld(4, daemons=4, args=args, log_level="info")
        try:
            ts = self.register(world, [0, 1, 2, 3], first=True)
            self.train(ts, range(1, 4))
            self.shrink(world, ts, 4)
            rec = os.path.join(state, "world_size")
            with open(rec) as f:
                self.assertEqual(f.read(), "world_size=2 from=4 step=4\n")
            self.assertEqual(stat.S_IMODE(os.stat(rec).st_mode), 0o600)
            for r in (2, 3):
                world.daemons[r].stop()
            ts = self.register(world, [0, 1])
            self.train(ts, range(5, 7))
            self.assert_same(ts, 6, "W=2 after the shrink")

            # ---- rank 1's zerod SIGKILLed, started again with --world_size 4 ----
            world.daemons[1].stop(signal.SIGKILL, check=False)
            got = attempt([lambda: ts[0].step(7)])
            self.assertIsInstance(got[0], ZerodError, "rank 0's step 7 without rank 1")
            for t in ts:
                t.close()
            t0 = time.monotonic()
            d1 = self.restart(world, 1)
            st = self.wait_health(d1, "ok")
            took = time.monotonic() - t0
            print(f"\nrestarted staying zerod rejoined the world of 2 in {took:.2f} s",
                  file=sys.stderr)
            self.assertLess(took, 15.0, "rejoins at once, not after connect_timeout_ms")
            self.assertEqual(st["world_size"], 2, st)
            self.assertEqual(st.get("configured_world_size"), 4, st)
            self.assertIn("world size record (rendezvous store)", d1.log())  # rank 0's
            ts = self.register(world, [0, 1])
            for t in ts:
                self.assertTrue(t.info.resumed, f"rank {t.rank} resumed its state file")
            self.assert_same(ts, 6, "W=2 after the restart")
            self.train(ts, range(7, 9))
            self.assert_same(ts, 8, "W=2 trained after the restart")

            # ---- rank 2's zerod (removed by the shrink) started again: it stays out ----
            d2 = self.restart(world, 2)
            self.assert_stays_out(d2, 2, 4, "a live resize after step 4 made it 2 ranks (from 4)")
            d2.stop()
            self.train(ts, range(9, 10))  # the world of 2 did not notice
            self.assert_same(ts, 9, "W=2 beside the removed zerod")

            # ---- grow back to 4 ----
            zeroctl("--address", world.daemons[0].control_address, "resize", "--world_size", "4")
            self.train(ts, range(10, 11))
            attempt([lambda t=t: t.step(11) for t in ts])
            for t in ts:
                t.close()
            self.wait_world_size(world.daemons[0], 4)
            with open(rec) as f:
                self.assertEqual(f.read(), "world_size=4 from=2 step=10\n")
            time.sleep(0.5)  # rank 0 names the new world instance before the new zerods look
            for r in (2, 3):
                self.restart(world, r)
            for r in (2, 3):
                world.daemons[r].wait_ready()
            ts = self.register(world, [0, 1, 2, 3])
            self.assert_same(ts, 10, "W=4 right after the grow")
            self.train(ts, range(11, 13))
            self.assert_same(ts, 12, "W=4 after the grow")
            st = status(world.daemons[1])  # the restarted one: back at its configured size
            self.assertEqual(st["world_size"], 4)
            self.assertNotIn("configured_world_size", st)
            for t in ts:
                t.close()
        except BaseException:
            sys.stderr.write(world.log()[-20000:])
            raise
        finally:
            world.stop(check=False)

    def test_rank0_restart_after_shrink(self) -> None:
        """Rank 0's zerod SIGKILLed after a shrink and started again on its control address
        (its built-in store restarts empty): it takes its state_dir's record, the world of 2
        re-forms, training goes on bitwise, and it stores the record again: a zerod of removed
        rank 3 started without a state_dir learns from the store that it is out."""
        state = self.state_dir()
        world = zerod.testing.LocalWorld(4, daemons=4, args=rz.ARGS + ["--state_dir", state],
                                         log_level="info")
        try:
            ts = self.register(world, [0, 1, 2, 3], first=True)
            self.train(ts, range(1, 3))
            self.shrink(world, ts, 3)
            for r in (2, 3):
                world.daemons[r].stop()
            ts = self.register(world, [0, 1])
            self.train(ts, range(4, 6))
            old = world.daemons[0]
            old.stop(signal.SIGKILL, check=False)
            attempt([lambda: ts[1].step(6)])
            for t in ts:
                t.close()
            d0 = self.restart_at_its_address(world, 0)
            t0 = time.monotonic()
            st = self.wait_health(d0, "ok")
            self.wait_health(world.daemons[1], "ok")
            print(f"\nrestarted rank 0 and the survivor re-formed the world of 2 in "
                  f"{time.monotonic() - t0:.2f} s", file=sys.stderr)
            self.assertEqual(st["world_size"], 2, st)
            self.assertEqual(st.get("configured_world_size"), 4, st)
            self.assertIn("world size record (state_dir)", d0.log())  # its own store is empty
            ts = self.register(world, [0, 1])
            for t in ts:
                self.assertTrue(t.info.resumed, f"rank {t.rank} resumed its state file")
            self.assert_same(ts, 5, "W=2 after rank 0's restart")
            self.train(ts, range(6, 8))
            self.assert_same(ts, 7, "W=2 trained after rank 0's restart")
            # the record from the store: rank 3 without a state_dir
            d3 = zerod.testing.LocalZerod(
                ["--world_size", "4", "--first_rank", "3",
                 "--rendezvous_address", d0.control_address] + rz.ARGS, log_level="info")
            try:
                st = self.wait_health(d3, "degraded")
                self.assertEqual(st["world_size"], 2, st)
                self.assertIn("outside the world", st["ranks"][0]["degraded_reason"])
                self.assertIn("world size record (rendezvous store)", d3.log())
            finally:
                d3.stop()
            for t in ts:
                t.close()
        except BaseException:
            sys.stderr.write(world.log()[-20000:])
            raise
        finally:
            world.stop(check=False)

    def test_buddy_copies_after_shrink(self) -> None:
        """Copies after a shrink go to a node of the world of 2 (the registry still lists the
        removed nodes, stopped) and succeed."""
        args = rz.ARGS + ["--buddy_copy_every_steps", "1"]
        world = zerod.testing.LocalWorld(4, daemons=4, args=args, log_level="info")
        try:
            ts = self.register(world, [0, 1, 2, 3], first=True)
            self.train(ts, range(1, 3))
            self.shrink(world, ts, 3)
            for r in (2, 3):
                world.daemons[r].stop()
            ts = self.register(world, [0, 1])
            self.train(ts, range(4, 8))
            for r in (0, 1):
                end = time.monotonic() + 10
                while True:
                    js = status(world.daemons[r])["ranks"][0]
                    if js.get("buddy_copy_step", 0) >= 6 or time.monotonic() > end:
                        break
                    time.sleep(0.05)
                self.assertGreaterEqual(js.get("buddy_copy_step", 0), 6, js)
                self.assertEqual(js.get("buddy_copy_holder"),
                                 world.daemons[1 - r].control_address, js)
            self.assert_same(ts, 7, "W=2 with buddy copies after the shrink")
            for t in ts:
                t.close()
        except BaseException:
            sys.stderr.write(world.log()[-20000:])
            raise
        finally:
            world.stop(check=False)

    def test_peer_lost_while_the_world_reforms(self) -> None:
        """Grown 2 -> 4, ranks 0 and 1 wait for the new zerods; rank 1's zerod dies meanwhile:
        rank 0 says so in its status (rejoining, naming rank 1) and its log, within the peer
        timeout, rather than waiting silently."""
        world = zerod.testing.LocalWorld(2, daemons=2, args=rz.ARGS, log_level="info")
        try:
            ts = self.register(world, [0, 1], first=True)
            self.train(ts, range(1, 3))
            zeroctl("--address", world.daemons[0].control_address, "resize", "--world_size", "4")
            self.train(ts, range(3, 4))
            attempt([lambda t=t: t.step(4) for t in ts])
            for t in ts:
                t.close()
            self.wait_world_size(world.daemons[0], 4)
            world.daemons[1].stop(signal.SIGKILL, check=False)
            t0 = time.monotonic()
            end = t0 + 15
            while True:
                r0 = status(world.daemons[0])["ranks"][0]
                if "rank 1 was lost" in r0.get("degraded_reason", "") or time.monotonic() > end:
                    break
                time.sleep(0.05)
            print(f"\nrank 1's loss while re-forming reported in {time.monotonic() - t0:.2f} s",
                  file=sys.stderr)
            self.assertEqual(r0["health"], "rejoining", r0)
            self.assertIn("the zerod of rank 1 was lost", r0.get("degraded_reason", ""), r0)
            self.assertIn("re-forms after a live resize", r0["degraded_reason"])
            self.assertIn("WARN the zerod of rank 1 was lost", world.daemons[0].log())
        except BaseException:
            sys.stderr.write(world.log()[-20000:])
            raise
        finally:
            world.stop(check=False)

    def test_record_in_etcd(self) -> None:
        """The record in etcd (rendezvous = etcd://...), without state_dirs: a removed zerod and
        a restarted rank 0 (etcd outlives it) find it there. Skipped without etcd-server."""
        from test_etcd import ETCD, Etcd
        if ETCD is None:
            self.skipTest("etcd is not installed (Debian package etcd-server)")
        tmp = tempfile.mkdtemp(prefix="zerod-resize-etcd-")
        self.addCleanup(shutil.rmtree, tmp, True)
        etcd = Etcd(tmp)
        self.addCleanup(etcd.stop)
        args = rz.ARGS + ["--rendezvous", f"etcd://{etcd.endpoint}/rr"]
        world = zerod.testing.LocalWorld(4, daemons=4, args=args, log_level="info")
        try:
            ts = self.register(world, [0, 1, 2, 3], first=True)
            self.train(ts, range(1, 3))
            self.shrink(world, ts, 3)
            self.assertIn("/zerod/rr/zerod/world_size", etcd.keys("/zerod/rr/"))
            for r in (2, 3):
                world.daemons[r].stop()
            d3 = self.restart(world, 3)
            st = self.wait_health(d3, "degraded")
            self.assertEqual(st["world_size"], 2, st)
            self.assertIn("a live resize after step 3 made it 2 ranks (from 4)",
                          st["ranks"][0]["degraded_reason"])
            self.assertIn("world size record (rendezvous store)", d3.log())
            d3.stop()
            world.daemons[0].stop(signal.SIGKILL, check=False)
            d0 = self.restart(world, 0)
            d0.wait_ready()
            st = status(d0)
            self.assertEqual(st["world_size"], 2, st)
            self.assertEqual(st.get("configured_world_size"), 4, st)
            self.assertIn("world size record (rendezvous store)", d0.log())
        except BaseException:
            sys.stderr.write(world.log()[-20000:])
            raise
        finally:
            world.stop(check=False)


class WorldRecordStartTest(unittest.TestCase):
    """One zerod started on a state_dir that holds a record (no world around it)."""

    def setUp(self) -> None:
        root = tempfile.mkdtemp(prefix="zerod-record-", dir=sd.tmpfs_root())
        self.addCleanup(shutil.rmtree, root, True)
        self.state = os.path.join(root, "state")
        os.makedirs(self.state, mode=0o700)

    def write(self, text: str) -> None:
        with open(os.path.join(self.state, "world_size"), "w") as f:
            f.write(text)

    def args(self, *extra: str) -> List[str]:
        # rank 3 of 4; the rendezvous store is nowhere (the record comes from state_dir)
        return ["--state_dir", self.state, "--world_size", "4", "--first_rank", "3",
                "--rendezvous_address", "unix:" + os.path.join(self.state, "no-store"),
                *extra]

    def test_record_keeps_a_removed_rank_out(self) -> None:
        self.write("world_size=2 from=4 step=7\n")
        d = zerod.testing.LocalZerod(self.args(), log_level="info")
        try:
            st = status(d)
            self.assertEqual(st["world_size"], 2, st)
            self.assertEqual(st.get("configured_world_size"), 4, st)
            self.assertEqual(st["ranks"][0]["health"], "degraded")
            self.assertIn("a live resize after step 7 made it 2 ranks (from 4)",
                          st["ranks"][0]["degraded_reason"])
        finally:
            d.stop()

    def test_ignore_keeps_the_configured_size(self) -> None:
        self.write("world_size=2 from=4 step=7\n")
        d = zerod.testing.LocalZerod(self.args("--world_size_record", "ignore"), log_level="info")
        try:
            st = status(d)
            self.assertEqual(st["world_size"], 4, st)
            self.assertNotIn("configured_world_size", st)
            self.assertNotEqual(st["ranks"][0]["health"], "degraded", st)  # joining a world of 4
        finally:
            d.stop(check=False)

    def test_malformed_record_is_refused(self) -> None:
        self.write("world_size=two from=4 step=7\n")
        d = zerod.testing.LocalZerod(self.args(), start=False)
        d.spawn()
        rc = d.process.wait(30)
        log = d.log()
        self.assertNotEqual(rc, 0, log[-2000:])
        self.assertIn(os.path.join(self.state, "world_size"), log)
        self.assertIn("world_size is not a number from 1 to 65535", log)
        self.assertIn("world_size=N from=W step=S", log)
        self.assertIn("world_size_record = ignore", log)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:])
