"""zeroctl drain --leave against real zerod processes: a node leaves the world without storage.

A world of 2 zerods (one rank each, CPU backend, unix sockets) with a checkpoint_dir trains;
`zeroctl drain --leave` on rank 1's node asks for a live resize to the world without it (docs/
design.md, "Live resize"), which rides the next step. Rank 1's trainer then gets ZD_ERANK ("left
the world"), rank 0's ZD_EPEER ("register again"); zeroctl prints that the node left after that
step and that the world goes on at 1 rank, and that zerod exits 0; the node left the node
registry (zeroctl status --world lists rank 0 alone and exits 0). Rank 0's trainer registers
again in the world of one rank and trains on, bitwise equal to an uninterrupted
torch.optim.AdamW(foreach=False) run (test_state_dir's reference: rank 0 sends step s's gradient,
the others zeros, summed with grad_mean off, so the reduced gradient is the same at every world
size), and the checkpoint_dir stays empty: no checkpoint file was written. The time from the
request to the survivor's first step in the new world is printed (the drain-leave's time).

Refusals, each leaving zerod serving and not draining: a zerod that holds every rank (no world to
leave); the node of rank 0 in a world of 2 (not the highest ranks: the staying ranks would have
to be renumbered); a node without a registered model (nothing for the leave to ride); --leave
outside drain (usage). A peer SIGKILLed during the leave: the drain ends with exit 1 naming the
failed resize, the leaving zerod goes on serving (draining false, last_resize says why), no hang;
killed before any step carried the leave: the drain ends as the rank degrades, naming why. A
leave that is late (no trainer stepping): given up after --wait, the request withdrawn (the world
stays at 2); with --force zerod stops anyway (exit 1). A leave that a step carried but whose
trainers pause past --wait: zeroctl exits 1 saying it can no longer be withdrawn, and zerod
shuts down once its ranks left at the trainers' next request.
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
from typing import List

import common  # sets up sys.path and the library first

import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402

torch = common.require_torch()

import test_resize as rz  # noqa: E402  (its zeroctl, status, attempt, ARGS and layout groups)
import test_resize_restart as rr  # noqa: E402  (restarting a zerod as it was; waiting for health)
import test_state_dir as sd  # noqa: E402  (its PARAMS, gradients, reference and Trainer)

ZD_EPEER, ZD_ERANK = rz.ZD_EPEER, rz.ZD_ERANK


class DrainLeaveTest(unittest.TestCase):
    ref: sd.Reference = None

    def setUp(self) -> None:
        if DrainLeaveTest.ref is None:
            DrainLeaveTest.ref = sd.Reference()

    # test_resize's helpers, on this test's reference
    assert_same = rz.ResizeTest.assert_same
    register = rz.ResizeTest.register
    train = rz.ResizeTest.train
    wait_world_size = rz.ResizeTest.wait_world_size
    restart = rr.ResizeRestartTest.restart
    wait_health = rr.ResizeRestartTest.wait_health
    assert_stays_out = rr.ResizeRestartTest.assert_stays_out

    def drain_async(self, d, *args: str) -> dict:
        """zeroctl drain on d in a thread: it is answered once the drain ends."""
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=rz.zeroctl(
            "--address", d.control_address, "drain", *args, check=False)))
        t.start()
        out["thread"] = t
        return out

    @staticmethod
    def draining(d) -> bool:
        return rz.status(d)["nodes"][0]["draining"]

    def wait_draining(self, d, timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        while not self.draining(d):
            if time.monotonic() > end:
                self.fail(f"{d.control_address}: not draining after {timeout} s")
            time.sleep(0.02)

    def world_status_ok(self, d, timeout: float = 30.0):
        """zeroctl status --world once it exits 0 (every rank ok: re-forming is done)."""
        end = time.monotonic() + timeout
        while True:
            out = rz.zeroctl("--address", d.control_address, "status", "--world", "--json",
                             check=False)
            if out.returncode == 0:
                return out
            if time.monotonic() > end:
                self.fail(f"status --world: exit {out.returncode}: {out.stdout}{out.stderr}")
            time.sleep(0.05)

    def test_leave_bitwise_no_checkpoint(self) -> None:
        ckpt = tempfile.mkdtemp(prefix="zerod-leave-ckpt-")
        self.addCleanup(shutil.rmtree, ckpt, True)
        world = zerod.testing.LocalWorld(2, daemons=2, args=rz.ARGS + ["--checkpoint_dir", ckpt],
                                         log_level="info")
        try:
            ts = self.register(world, [0, 1], first=True)
            self.train(ts, range(1, 4))
            self.assert_same(ts, 3, "W=2 before the leave")

            t0 = time.monotonic()
            asked = self.drain_async(world.daemons[1], "--leave", "--wait", "60")
            self.wait_draining(world.daemons[1])
            self.train(ts, range(4, 5))  # the step the leave rides
            self.assert_same(ts, 4, "the step the leave rode")
            got = rz.attempt([lambda t=t: t.step(5) for t in ts])
            e0, e1 = got
            self.assertIsInstance(e0, ZerodError, "rank 0: step 5 after the leave")
            self.assertEqual(e0.code, ZD_EPEER, e0.message)
            self.assertIn("resized from 2 to 1 ranks after step 4", e0.message)
            self.assertIn("register again", e0.message)
            self.assertIsInstance(e1, ZerodError, "rank 1: step 5 after the leave")
            self.assertEqual(e1.code, ZD_ERANK, e1.message)
            self.assertIn("left the world", e1.message)
            asked["thread"].join(60)
            r = asked["r"]
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("left the world after step 4, which goes on at 1 rank without a "
                          "checkpoint", r.stdout)
            for t in ts:
                t.close()
            # the drained zerod shuts down by itself, with status 0
            world.daemons[1].process.wait(30)
            self.assertEqual(world.daemons[1].process.returncode, 0, world.daemons[1].log())
            self.assertIn("drain --leave: rank 1 left the world after step 4",
                          world.daemons[1].log())

            self.wait_world_size(world.daemons[0], 1)
            # The node left the registry too: the world's status lists rank 0 alone, exit 0.
            out = self.world_status_ok(world.daemons[0])
            self.assertEqual(json.loads(out.stdout)["world_size"], 1)
            self.assertEqual(len(json.loads(out.stdout)["nodes"]), 1, out.stdout)
            ts = self.register(world, [0])
            self.assertTrue(ts[0].info.resumed, "the registration after the leave resumes")
            self.assert_same(ts, 4, "W=1 right after the leave")
            self.train(ts, range(5, 6))
            took = time.monotonic() - t0
            self.assert_same(ts, 5, "W=1, the first step after the leave")
            self.train(ts, range(6, 9))
            self.assert_same(ts, 8, "W=1 after the leave")
            st = rz.status(world.daemons[0])
            self.assertEqual(st["ranks"][0]["health"], "ok", st)
            self.assertIn("step 4: 2 -> 1 ranks in", st["ranks"][0]["last_resize"])
            self.assertEqual(os.listdir(ckpt), [], "the leave wrote no checkpoint")
            print(f"drain --leave: request to the survivor training again at W=1: {took:.3f} s "
                  f"(includes the trainers' steps 4 and 5 and the re-registration)",
                  file=sys.stderr)

            # The drained zerod started again as it was (--world_size 2, rank 1): rank 0's
            # store holds the world size record of the leave, so it stays out, and the world
            # of one rank trains on without noticing.
            d1 = self.restart(world, 1)
            self.assert_stays_out(d1, 1, 2, "made it 1 ranks (from 2)")
            self.train(ts, range(9, 10))
            self.assert_same(ts, 9, "W=1 beside the drained zerod started again")
            for t in ts:
                t.close()
        except BaseException:
            sys.stderr.write(world.log())
            raise
        finally:
            world.stop(check=False)

    def test_leave_two_local_ranks(self) -> None:
        """W=4 on two zerods of two local ranks each: the node of ranks 2 and 3 leaves, the ranks
        of the other re-form a world of 2 through the rendezvous and train on bitwise."""
        class Pair:  # the trainers' endpoints: global rank r is local rank r % 2 of zerod r // 2
            def __init__(self) -> None:
                self.daemons: List[zerod.testing.LocalZerod] = []

            def connect(self, rank: int):
                return self.daemons[rank // 2].connect(rank % 2)

        world = Pair()
        try:
            for first in (0, 2):
                d = zerod.testing.LocalZerod([], log_level="info", start=False, timeout=30.0)
                d.args = ["--world_size", "4", "--first_rank", str(first), "--local_ranks", "2"]
                if first:
                    d.args += ["--rendezvous_address", world.daemons[0].control_address]
                d.args += rz.ARGS
                d.spawn()
                world.daemons.append(d)
            for d in world.daemons:
                d.wait_ready()
            ts = self.register(world, [0, 1, 2, 3], first=True)
            self.train(ts, range(1, 3))
            asked = self.drain_async(world.daemons[1], "--leave", "--wait", "60")
            self.wait_draining(world.daemons[1])
            self.train(ts, range(3, 4))  # the leave rides step 3
            got = rz.attempt([lambda t=t: t.step(4) for t in ts])
            for t, e in zip(ts, got):
                self.assertIsInstance(e, ZerodError, f"rank {t.rank}: step 4 after the leave")
                self.assertEqual(e.code, ZD_EPEER if t.rank < 2 else ZD_ERANK, e.message)
            asked["thread"].join(60)
            r = asked["r"]
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("left the world after step 3, which goes on at 2 ranks", r.stdout)
            for t in ts:
                t.close()
            world.daemons[1].process.wait(30)
            self.assertEqual(world.daemons[1].process.returncode, 0, world.daemons[1].log())
            self.assertIn("drain --leave: ranks 2..3 left the world after step 3",
                          world.daemons[1].log())
            self.wait_world_size(world.daemons[0], 2)
            out = self.world_status_ok(world.daemons[0])
            self.assertEqual(len(json.loads(out.stdout)["nodes"]), 1, out.stdout)
            ts = self.register(world, [0, 1])
            self.assert_same(ts, 3, "W=2 right after the leave")
            self.train(ts, range(4, 7))
            self.assert_same(ts, 6, "W=2 after the leave")
            st = rz.status(world.daemons[0])
            for rank in st["ranks"]:
                self.assertEqual(rank["health"], "ok", st)
                self.assertIn("step 3: 4 -> 2 ranks in", rank["last_resize"])
            for t in ts:
                t.close()
        except BaseException:
            for d in world.daemons:
                sys.stderr.write(d.log())
            raise
        finally:
            for d in world.daemons:
                d.stop(check=False)

    def test_zero_optimizer_follows(self) -> None:
        """Plain ZeroOptimizer loops (test_resize_torch's) at W=2: rank 1's node drained with
        leave in the middle of training; rank 0's step() follows the resize to a world of one rank
        by itself (opt.world_size 1, opt.rank 0), rank 1's raises ZD_ERANK; bitwise throughout."""
        import warnings
        import test_resize_torch as rt
        world = zerod.testing.LocalWorld(2, daemons=2, args=rz.ARGS, log_level="info")
        loops: List = []
        try:
            with warnings.catch_warnings():  # step()'s "resized ... laying the model out again"
                warnings.simplefilter("ignore")
                loops = sd.on_all([lambda r=r: rt.Loop(world.daemons[r], r) for r in range(2)])
                same = rt.ResizeTorchTest.assert_same
                for s in range(1, 3):
                    sd.on_all([lambda t=t: t.step(s) for t in loops])
                    same(self, loops, s, f"W=2 step {s}")
                asked = self.drain_async(world.daemons[1], "--leave", "--wait", "60")
                self.wait_draining(world.daemons[1])
                sd.on_all([lambda t=t: t.step(3) for t in loops])  # the leave rides step 3
                got = rz.attempt([lambda t=t: t.step(4) for t in loops])
                self.assertIsNone(got[0], f"rank 0: step 4 across the leave: {got[0]!r}")
                self.assertIsInstance(got[1], ZerodError, "rank 1: step 4")
                self.assertEqual(got[1].code, ZD_ERANK, got[1].message)
                asked["thread"].join(60)
                self.assertEqual(asked["r"].returncode, 0, asked["r"].stderr)
                loops[1].opt.close()
                loops = loops[:1]
                self.assertEqual((loops[0].opt.world_size, loops[0].opt.rank), (1, 0))
                same(self, loops, 4, "step 4, sent again at W=1")
                for s in range(5, 7):
                    loops[0].step(s)
                    same(self, loops, s, f"W=1 step {s}")
        except BaseException:
            sys.stderr.write(world.log())
            raise
        finally:
            for t in loops:
                t.opt.close()
            world.stop(check=False)

    def test_refusals(self) -> None:
        out = rz.zeroctl("resize", "--world_size", "2", "--leave", check=False)
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("--leave is an option of drain", out.stderr)
        out = rz.zeroctl("--help")
        self.assertIn("drain [--leave] [--wait SECONDS] [--force]", out.stdout)
        self.assertIn("Only the node of the highest ranks may", out.stdout)

        # A zerod that holds every rank: no world to leave.
        d = zerod.testing.LocalZerod(rz.ARGS, log_level="info")
        try:
            t = sd.Trainer(d, sd.init_values())
            out = rz.zeroctl("--address", d.control_address, "drain", "--leave", "--wait", "5",
                             check=False)
            self.assertEqual(out.returncode, 1, out.stderr)
            self.assertIn("there is no world to leave", out.stderr)
            self.assertIn("holds every rank of the world (1 of 1)", out.stderr)
            self.assertFalse(self.draining(d))
            t.step(1)  # still serving
            t.close()
        finally:
            d.stop()

        with zerod.testing.LocalWorld(2, daemons=2, args=rz.ARGS, log_level="info") as world:
            # No model yet: nothing for the leave to ride.
            out = rz.zeroctl("--address", world.daemons[1].control_address, "drain", "--leave",
                             "--wait", "5", check=False)
            self.assertEqual(out.returncode, 1, out.stderr)
            self.assertIn("no model is registered", out.stderr)
            self.assertIn("--leave --force", out.stderr)
            ts = self.register(world, [0, 1], first=True)
            self.train(ts, range(1, 2))
            # The node of rank 0 is not the node of the highest ranks.
            out = rz.zeroctl("--address", world.daemons[0].control_address, "drain", "--leave",
                             "--wait", "5", check=False)
            self.assertEqual(out.returncode, 1, out.stderr)
            self.assertIn("holds rank 0 of a world of 2", out.stderr)
            self.assertIn("only the highest ranks (rank 1 here)", out.stderr)
            self.assertIn("renumbered", out.stderr)
            for d in world.daemons:
                self.assertFalse(self.draining(d))
            self.train(ts, range(2, 3))  # the world trains on at 2
            self.assert_same(ts, 2, "W=2 after the refusals")
            for t in ts:
                t.close()

    def test_peer_killed_during_leave(self) -> None:
        world = zerod.testing.LocalWorld(2, daemons=2, args=rz.ARGS, log_level="info")
        try:
            ts = self.register(world, [0, 1], first=True)
            self.train(ts, range(1, 3))
            asked = self.drain_async(world.daemons[1], "--leave", "--wait", "60")
            self.wait_draining(world.daemons[1])
            self.train(ts, range(3, 4))  # the leave rides step 3
            world.daemons[0].stop(signal.SIGKILL, check=False)
            t0 = time.monotonic()
            got = rz.attempt([lambda: ts[1].step(4)])
            self.assertIsInstance(got[0], ZerodError, "rank 1: step 4")
            asked["thread"].join(90)
            self.assertLess(time.monotonic() - t0, 60, "no hang")
            r = asked["r"]
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertIn("did not leave the world: step 3: 2 -> 1 ranks failed", r.stderr)
            self.assertIn("this zerod goes on serving", r.stderr)
            self.assertNotIn("cannot reach", r.stderr)
            d = world.daemons[1]
            self.assertIsNone(d.process.poll(), "the leaving zerod goes on serving")
            st = rz.status(d)
            self.assertFalse(st["nodes"][0]["draining"])
            self.assertIn("2 -> 1 ranks failed", st["ranks"][0].get("last_resize", ""), st)
            self.assertIn("given up, zerod goes on serving", d.log())
            for t in ts:
                t.close()
        except BaseException:
            sys.stderr.write(world.log())
            raise
        finally:
            world.stop(check=False)

    def test_late_leave_force(self) -> None:
        """No trainer steps, so the leave is late: without --force the drain gives up after
        --wait (zerod serving, not draining); with --force zerod stops anyway, exit 1, saying the
        others lose the node."""
        world = zerod.testing.LocalWorld(2, daemons=2, args=rz.ARGS, log_level="info")
        try:
            ts = self.register(world, [0, 1], first=True)
            self.train(ts, range(1, 2))
            d = world.daemons[1]
            out = rz.zeroctl("--address", d.control_address, "drain", "--leave", "--wait", "1",
                             check=False)
            self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
            self.assertIn("had not left the world within 1000 ms", out.stderr)
            self.assertIn("this zerod goes on serving", out.stderr)
            self.assertFalse(self.draining(d))
            self.train(ts, range(2, 3))  # the withdrawn request rides no step: still W=2
            self.assert_same(ts, 2, "W=2 after the late leave")
            self.assertEqual(rz.status(world.daemons[0])["world_size"], 2)
            out = rz.zeroctl("--address", d.control_address, "drain", "--leave", "--wait", "1",
                             "--force", check=False)
            self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
            self.assertIn("drained without leaving the world (--force)", out.stdout)
            self.assertIn("not left: this node's ranks had not left the world within 1000 ms",
                          out.stderr)
            self.assertIn("the other nodes lose this node's ranks as in a crash", out.stderr)
            d.process.wait(30)
            for t in ts:
                t.close()
        except BaseException:
            sys.stderr.write(world.log())
            raise
        finally:
            world.stop(check=False)

    def test_drained_node_stays_out_after_rank0_restart(self) -> None:
        """After a leave to a world of one, rank 0's zerod restarted (it takes the world of one
        from its state_dir's record and no world forms: it stores the record again itself), then
        the drained zerod started as it was but without a state_dir: it finds the record in rank
        0's store and stays out instead of waiting for a world of 2."""
        root = tempfile.mkdtemp(prefix="zerod-leave-state-", dir=sd.tmpfs_root())
        self.addCleanup(shutil.rmtree, root, True)
        state = os.path.join(root, "state")
        world = zerod.testing.LocalWorld(2, daemons=2, args=rz.ARGS + ["--state_dir", state],
                                         log_level="info")
        try:
            ts = self.register(world, [0, 1], first=True)
            self.train(ts, range(1, 3))
            asked = self.drain_async(world.daemons[1], "--leave", "--wait", "60")
            self.wait_draining(world.daemons[1])
            self.train(ts, range(3, 4))  # carries the leave
            rz.attempt([lambda t=t: t.step(4) for t in ts])
            for t in ts:
                t.close()
            asked["thread"].join(60)
            self.assertEqual(asked["r"].returncode, 0, asked["r"].stderr)
            world.daemons[1].process.wait(30)
            self.wait_world_size(world.daemons[0], 1)
            ts = self.register(world, [0])
            self.train(ts, range(4, 5))  # the state file of the world of one
            for t in ts:
                t.close()

            world.daemons[0].stop(signal.SIGKILL, check=False)
            rr.ResizeRestartTest.restart_at_its_address(self, world, 0).wait_ready()
            ts = self.register(world, [0])
            self.assertTrue(ts[0].info.resumed, "rank 0 resumed its state file")
            self.assert_same(ts, 4, "W=1 after rank 0's restart")
            args = list(world.daemons[1].args)
            i = args.index("--state_dir")
            del args[i:i + 2]
            d1 = zerod.testing.LocalZerod(args, log_level="info", start=False, timeout=30.0)
            d1.spawn()
            world.daemons[1] = d1
            self.assert_stays_out(d1, 1, 2, "made it 1 ranks (from 2)")
            self.assertIn("world size record (rendezvous store)", d1.log())
            self.train(ts, range(5, 6))
            self.assert_same(ts, 5, "W=1 beside the drained zerod")
            for t in ts:
                t.close()
        except BaseException:
            sys.stderr.write(world.log()[-20000:])
            raise
        finally:
            world.stop(check=False)

    def test_agreed_leave_late(self) -> None:
        """A step carried the leave, then the trainers pause past --wait: the resize can no longer
        be withdrawn, so zeroctl exits 1 saying so, and zerod stays draining until its ranks leave
        at their trainers' next request; then it shuts down (exit 0) and the world goes on at 1
        rank, bitwise."""
        world = zerod.testing.LocalWorld(2, daemons=2, args=rz.ARGS, log_level="info")
        try:
            ts = self.register(world, [0, 1], first=True)
            self.train(ts, range(1, 2))
            d = world.daemons[1]
            asked = self.drain_async(d, "--leave", "--wait", "1")
            self.wait_draining(d)
            self.train(ts, range(2, 3))  # carries the leave: agreed on every rank
            asked["thread"].join(60)
            r = asked["r"]
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertIn("can no longer be withdrawn", r.stderr)
            self.assertIn("shuts down once they have left", r.stderr)
            self.assertIsNone(d.process.poll(), "zerod waits for its ranks to leave")
            self.assertTrue(self.draining(d), "still draining: the leave is under way")
            e0, e1 = rz.attempt([lambda t=t: t.step(3) for t in ts])
            self.assertIsInstance(e0, ZerodError, "rank 0: step 3 after the leave")
            self.assertEqual(e0.code, ZD_EPEER, e0.message)
            self.assertIsInstance(e1, ZerodError, "rank 1: step 3 after the leave")
            self.assertEqual(e1.code, ZD_ERANK, e1.message)
            for t in ts:
                t.close()
            d.process.wait(30)
            self.assertEqual(d.process.returncode, 0, d.log())
            self.assertIn("drain --leave: rank 1 left the world after step 2", d.log())
            self.wait_world_size(world.daemons[0], 1)
            ts = self.register(world, [0])
            self.assert_same(ts, 2, "W=1 right after the late leave")
            self.train(ts, range(3, 5))
            self.assert_same(ts, 4, "W=1 after the late leave")
            for t in ts:
                t.close()
        except BaseException:
            sys.stderr.write(world.log())
            raise
        finally:
            world.stop(check=False)

    def test_peer_killed_before_the_step(self) -> None:
        """The peer SIGKILLed after the leave was asked for, before any step could carry it: the
        heartbeat finds it gone, the rank degrades, and the drain ends at once (not after --wait)
        naming why; the zerod goes on serving, not draining."""
        world = zerod.testing.LocalWorld(2, daemons=2, args=rz.ARGS, log_level="info")
        try:
            ts = self.register(world, [0, 1], first=True)
            self.train(ts, range(1, 2))
            asked = self.drain_async(world.daemons[1], "--leave", "--wait", "120")
            self.wait_draining(world.daemons[1])
            t0 = time.monotonic()
            world.daemons[0].stop(signal.SIGKILL, check=False)
            asked["thread"].join(90)
            self.assertLess(time.monotonic() - t0, 30, "ended by the world's breaking, not --wait")
            r = asked["r"]
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertIn("did not leave the world: rank 1 is degraded", r.stderr)
            d = world.daemons[1]
            self.assertIsNone(d.process.poll(), "the leaving zerod goes on serving")
            self.assertFalse(self.draining(d))
            for t in ts:
                t.close()
        except BaseException:
            sys.stderr.write(world.log())
            raise
        finally:
            world.stop(check=False)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:])
