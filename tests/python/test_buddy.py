"""Buddy copies (buddy_copy_every_steps) against real zerod processes: a node that comes back empty
resumes from its buddy's copy.

W=2, a zerod per rank on loopback (unix: control addresses), one state_dir, no checkpoints, a copy
every 4 steps. The trainers step to 10; zerod 1 is SIGKILLed between steps, its state file is
deleted (the node came back empty) and it is started again as a new process. The world re-forms:
rank 1 reads its copy of step 8 from zerod 0 (its buddy), rank 0 goes back to its own snapshot of
step 8 (its state file holds only steps 9 and 10), and both registrations report step 8 with
parameters bitwise equal to torch's AdamW at step 8. The trainers then re-run steps 9.. (the test
drives that), each bitwise equal to the uninterrupted reference. Status (the buddy section, and
zeroctl status --json from the control service) shows each copy's step, age and holder, and the
recovery ("buddy copy").

Both copies gone: with checkpoints every 3 steps, both zerods are SIGKILLed, rank 1's state file
and the copy of it that zerod 0 kept in the state_dir are deleted: the world falls back to the
newest checkpoint, and rank 1's status says why (neither a state file nor a buddy copy).

The holder keeps the copies in its state_dir (0600 files, renamed into place once complete): both
zerods SIGKILLed, rank 1's state file deleted, the copies kept; restarted, zerod 0 serves rank 1's
copy from its file and zerod 1 rank 0's (rank 0's own file holds newer steps, so it reads its copy
too, in the agreement's second round), the world continues from step 8, bitwise; a ".part" left
by a copy in flight is deleted, a damaged copy file renamed aside.

Parameters without a gradient on some steps (absent, as zerod.torch sends p.grad None): "sd.b"
skips every third step, before the copy's step and after it; the ranks back from the buddy's copy,
their own snapshot and their state file restore its own step count of that commit (its lag), and
the steps after the recovery are torch's AdamW with None gradients, bitwise (the lags travel in
the copies; before they did, sd.b's next update differed at 383 of 384 elements).

Copies by time (buddy_copy_every_s): every rank copies the same step (the step's records carry
the request), and a node back empty resumes from it.

The reference is the running torch's AdamW: under torch 2.x (suite python-torch2) every layout
of this process takes its update ("torch2", the first moment by lerp, and torch.sqrt's rounding).

Also: W=3 with failure domains a, a, b (each copy leaves its node's domain), and the bandwidth cap
(a copy takes at least its bytes over the cap while the steps go on).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from typing import List

import common  # sets up sys.path and the library first

import zerod.testing  # noqa: E402

import test_state_dir  # noqa: E402
from test_state_dir import (BUCKET, PARAMS, Reference, init_values, on_all,  # noqa: E402
                            step_grads, tmpfs_root, torch)

import numpy as np  # noqa: E402

EVERY = 4


def _groups():
    """The update of the running torch (its AdamW is the reference): under torch 2.x the first
    moment by lerp and torch.sqrt's rounding as measured (zerod.torch's choice); under 1.13
    zerod's defaults."""
    if int(torch.__version__.split(".")[0]) < 2:
        return None
    from zerod.torch import _probe_sqrt
    return [{"update": "torch2", "sqrt_mode": _probe_sqrt()[0]}]


# Under torch 2.x every layout of this process takes the running torch's update (the trainers
# of test_state_dir.py call client.layout without groups).
_GROUPS = _groups()
if _GROUPS is not None:
    _layout = zerod.Client.layout

    def _layout_with_groups(client, params, groups=None, **kw):
        return _layout(client, params, groups if groups is not None else _GROUPS, **kw)
    zerod.Client.layout = _layout_with_groups
Trainer = test_state_dir.Trainer

# A parameter without a gradient on some steps (zd_step_opts_t.absent, as zerod.torch sends it
# where p.grad is None): "sd.b" on every third step. torch's AdamW skips it there, and its own
# step count (state['step']), which its bias corrections use, falls behind the others'.
LAGGING = 1  # PARAMS[1], "sd.b"


def absent_at(step: int) -> List[int]:
    return [LAGGING] if step % 3 == 0 else []


class LagTrainer(Trainer):
    """Trainer whose step names "sd.b" absent on absent_at's steps (its gradient zeroed)."""

    def step(self, s: int) -> None:
        self.fill(s)
        absent = absent_at(s)
        for i in absent:
            self.g[PARAMS[i][0]][...] = 0.0
        self.client.step(absent=absent)


class LagReference(Reference):
    """torch.optim.AdamW(foreach=False) on the same gradients, None where absent_at says."""

    def at(self, step: int):
        while max(self.seen) < step:
            s = max(self.seen) + 1
            g = step_grads(s)
            for i, ((n, _), p) in enumerate(zip(PARAMS, self.params)):
                p.grad = None if i in absent_at(s) else torch.tensor(g[n])
            self.opt.step()
            self.seen[s] = self.snapshot()
        return self.seen[step]


class World3:
    """Three zerods, one rank each, each with its own failure_domain (LocalWorld gives every
    daemon the same settings)."""

    def __init__(self, state_dir: str, domains: List[str]) -> None:
        self.world_size = len(domains)
        self.daemons: List[zerod.testing.LocalZerod] = []
        try:
            for r, dom in enumerate(domains):
                d = zerod.testing.LocalZerod([], log_level="info", start=False)
                first = self.daemons[0] if self.daemons else d
                d.args = ["--world_size", str(len(domains)), "--first_rank", str(r),
                          "--local_ranks", "1", "--rendezvous_address", first.control_address,
                          "--state_dir", state_dir, "--bucket_elems", BUCKET,
                          "--buddy_copy_every_steps", str(EVERY), "--failure_domain", dom,
                          "--heartbeat_ms", "100", "--peer_timeout_ms", "1000"]
                self.daemons.append(d)
            for d in self.daemons:
                d.spawn()
            for d in self.daemons:
                d.wait_ready()
        except BaseException:
            self.stop()
            raise

    def connect(self, rank: int):
        return zerod.Client(self.daemons[rank].socket, 0, 0)

    def stop(self) -> None:
        for d in self.daemons:
            if d.returncode is None:
                d.stop(signal.SIGKILL, check=False)


class BuddyTest(unittest.TestCase):
    ref = None

    def setUp(self) -> None:
        self.state_dir = os.path.join(tempfile.mkdtemp(prefix="zerod-buddy-", dir=tmpfs_root()),
                                      "state")
        self.addCleanup(shutil.rmtree, os.path.dirname(self.state_dir), True)
        if BuddyTest.ref is None:
            BuddyTest.ref = Reference()

    def assert_same(self, got, step: int, what: str, ref=None) -> None:
        want = (ref or self.ref).at(step)
        for name, _ in PARAMS:
            g, w = got[name].view(np.uint32).ravel(), want[name].view(np.uint32).ravel()
            diff = np.flatnonzero(g != w)
            self.assertEqual(diff.size, 0, f"{what}: {name} differs from torch's step {step} at "
                             f"{diff.size} elements, first {diff[:5].tolist()}")

    def world(self, extra: List[str] = (), every: int = EVERY,
              state_dir: bool = True) -> zerod.testing.LocalWorld:
        world = zerod.testing.LocalWorld(2, daemons=2, args=(
            ["--state_dir", self.state_dir] if state_dir else []) + [
            "--bucket_elems", BUCKET, "--heartbeat_ms", "100",
            "--peer_timeout_ms", "1000", "--log_level", "info",
            "--buddy_copy_every_steps", str(every)] + list(extra))
        self.addCleanup(lambda: world.stop(signal.SIGKILL, check=False))
        return world

    def register_n(self, world, n: int) -> List[Trainer]:
        ts = on_all([lambda r=r: Trainer(world, init_values(), r, register=False)
                     for r in range(n)])
        infos = on_all([lambda t=t: t.client.register() for t in ts])
        for t, info in zip(ts, infos):
            t.info = info
        return ts

    def register(self, world, init) -> List[Trainer]:
        ts = on_all([lambda r=r: Trainer(world, init, r, register=False) for r in range(2)])
        infos = on_all([lambda t=t: t.client.register() for t in ts])
        for t, info in zip(ts, infos):
            t.info = info
        return ts

    def register_lagging(self, world, init) -> List[Trainer]:
        ts = on_all([lambda r=r: LagTrainer(world, init, r, register=False) for r in range(2)])
        infos = on_all([lambda t=t: t.client.register() for t in ts])
        for t, info in zip(ts, infos):
            t.info = info
        return ts

    def train(self, ts: List[Trainer], steps: range, check: bool = False, ref=None) -> None:
        for s in steps:
            on_all([lambda t=t: t.step(s) for t in ts])
            if check:
                for t in ts:
                    self.assert_same(t.snapshot(), s, f"rank {t.rank} at step {s}", ref)

    def wait_copies(self, ts: List[Trainer], step: int, timeout: float = 20) -> None:
        """Until each rank's copy of `step` is complete at its buddy (the copy is asynchronous)."""
        deadline = time.monotonic() + timeout
        for t in ts:
            key = f"rank{t.rank}_copy_step"
            while True:
                buddy = t.client.status_dict().get("buddy", {})
                if buddy.get(key) == str(step):
                    break
                self.assertLess(time.monotonic(), deadline, f"no copy of step {step}: {buddy}")
                time.sleep(0.02)

    def wipe(self, rank: int, held: bool = False) -> None:
        """Deletes rank's state file; held: also the copy of it its buddy keeps in the
        state_dir (both zerods share one state_dir here)."""
        files = glob.glob(os.path.join(self.state_dir, f"rank{rank}-of-2-*"))
        self.assertTrue(files, f"rank {rank} has no state file to delete")
        if held:
            copies = glob.glob(os.path.join(self.state_dir, f"buddy-rank{rank}-of-2.zdbuddy*"))
            self.assertTrue(copies, f"no copy of rank {rank} in the state_dir")
            files += copies
        for f in files:
            os.unlink(f)

    def kill(self, world, victims: List[int], ts: List[Trainer]) -> None:
        for v in victims:
            common.stop_zerod(world.daemons[v], signal.SIGKILL)
        for t in ts:
            t.close()

    def restart(self, world, victims: List[int]) -> None:
        for v in victims:
            args = list(world.daemons[v].args)
            addr = world.daemons[0].control_address
            if v == 0:  # it serves the rendezvous store, at the address the others were given
                if "--control_address" not in args:
                    args += ["--control_address", addr]
                if os.path.exists(addr[len("unix:"):]):
                    os.unlink(addr[len("unix:"):])
            d = zerod.testing.LocalZerod(args, log_level="info")
            if v == 0:
                d.control_address = addr
            world.daemons[v] = d
            world._endpoints[v] = (d.socket, 0)

    def zeroctl_json(self, d) -> dict:
        zeroctl = os.environ.get("ZEROCTL_BIN", os.path.join(common.ROOT, "build", "client",
                                                             "zeroctl"))
        out = subprocess.run([zeroctl, "--address", d.control_address, "status", "--json"],
                             capture_output=True, text=True, timeout=30)
        self.assertEqual(out.returncode, 0, out.stderr)
        return json.loads(out.stdout)

    def wait_health(self, d, want: str, timeout: float = 30) -> None:
        """Until the zerod's rank says `want` (zeroctl status)."""
        zeroctl = os.environ.get("ZEROCTL_BIN", os.path.join(common.ROOT, "build", "client",
                                                             "zeroctl"))
        deadline, health = time.monotonic() + timeout, ""
        while health != want:
            self.assertLess(time.monotonic(), deadline,
                            f"the zerod stays {health}; log:\n{d.log()[-3000:]}")
            out = subprocess.run([zeroctl, "--address", d.control_address, "status", "--json"],
                                 capture_output=True, text=True, timeout=30)
            health = json.loads(out.stdout)["ranks"][0]["health"] if out.stdout else ""
            time.sleep(0.02)

    def test_node_back_empty_resumes_from_its_buddy(self) -> None:
        world = self.world()
        ts = self.register(world, init_values())
        self.train(ts, range(1, 2 * EVERY + 1))
        self.wait_copies(ts, 2 * EVERY)
        st0 = ts[0].client.status_dict()["buddy"]
        st1 = ts[1].client.status_dict()["buddy"]
        # each copy's step, age and holder: rank 0's copy is in zerod 1, rank 1's in zerod 0
        self.assertEqual(st0["rank0_copy_holder"], world.daemons[1].control_address, st0)
        self.assertEqual(st1["rank1_copy_holder"], world.daemons[0].control_address, st1)
        self.assertLess(int(st0["rank0_copy_age_ms"]), 60000)
        self.assertEqual(st0["held_rank1_step"], str(2 * EVERY), st0)
        self.assertEqual(st1["held_rank0_step"], str(2 * EVERY), st1)
        rank0 = ts[0].client.status_dict()["rank 0"]
        self.assertNotIn("last_recovery", rank0)
        # the control service's Status has them too (zeroctl status --json)
        for r, d in enumerate(world.daemons):
            js = self.zeroctl_json(d)["ranks"][0]
            self.assertEqual(js.get("buddy_copy_step"), 2 * EVERY, js)
            self.assertEqual(js.get("buddy_copy_holder"), world.daemons[1 - r].control_address)
            self.assertLess(js["buddy_copy_age_ms"], 60000)
        self.train(ts, range(2 * EVERY + 1, 2 * EVERY + 3))  # steps 9, 10: lost with zerod 1
        lost_at = 2 * EVERY + 2

        t0 = time.monotonic()
        self.kill(world, [1], ts)
        self.wait_health(world.daemons[0], "rejoining")  # as systemd would restart it
        self.wipe(1)  # the node comes back empty
        self.restart(world, [1])
        ts = self.register(world, None)
        recovered_s = time.monotonic() - t0
        for t in ts:
            self.assertTrue(t.info.resumed, f"rank {t.rank} did not resume")
            self.assertEqual(t.info.step, 2 * EVERY, f"rank {t.rank} resumed step {t.info.step}")
            self.assert_same(t.snapshot(), 2 * EVERY, f"rank {t.rank} after the recovery")
        self.assertIn("from its buddy's copy", world.daemons[1].log())
        self.assertIn("from its own snapshot", world.daemons[0].log())
        for t in ts:
            rank = t.client.status_dict()[f"rank {t.rank}"]
            self.assertEqual(rank["last_recovery"], "buddy copy", rank)
            self.assertEqual(rank["last_recovery_step"], str(2 * EVERY))
        # The trainers re-run the lost steps 9 and 10, then go on: each bitwise torch's.
        self.train(ts, range(2 * EVERY + 1, lost_at + EVERY + 1), check=True)
        self.wait_copies(ts, 3 * EVERY)
        print(f"\n    node loss to training again from the buddy copy: {recovered_s:.2f} s "
              f"(kill, restart, re-form, read the copy, register)", flush=True)
        for t in ts:
            t.close()
        common.stop_world(world)

    def test_lagging_parameter_resumes_with_its_own_step(self) -> None:
        """A parameter without a gradient on some steps before the copy's step and after it:
        the ranks that come back from a buddy copy, their own snapshot or their state file keep
        each parameter's own step count (zd__model_t.lag) of that commit, so that the steps
        after the recovery are torch's, bit for bit (its bias corrections use the parameter's
        own state['step'])."""
        ref = LagReference()
        world = self.world()
        ts = self.register_lagging(world, init_values())
        self.train(ts, range(1, 2 * EVERY + 1), ref=ref, check=True)  # steps 3, 6 skip sd.b
        self.wait_copies(ts, 2 * EVERY)
        self.assertEqual(ts[0].client.rank_status()["params_lagging"], "1")
        self.train(ts, range(2 * EVERY + 1, 2 * EVERY + 3), ref=ref)  # step 9 skips it too

        # Node 1 back empty: rank 1 from its buddy's copy of step 8, rank 0 from its own
        # snapshot (its state file holds steps 9 and 10, where sd.b lags one step more).
        self.kill(world, [1], ts)
        self.wait_health(world.daemons[0], "rejoining")
        self.wipe(1)
        self.restart(world, [1])
        ts = self.register_lagging(world, None)
        for t in ts:
            self.assertEqual(t.info.step, 2 * EVERY, f"rank {t.rank} resumed step {t.info.step}")
            self.assert_same(t.snapshot(), 2 * EVERY, f"rank {t.rank} after the recovery", ref)
            self.assertEqual(t.client.rank_status()["params_lagging"], "1",
                             f"rank {t.rank}: sd.b's own step count was not restored")
        self.assertIn("from its buddy's copy", world.daemons[1].log())
        self.assertIn("from its own snapshot", world.daemons[0].log())
        self.train(ts, range(2 * EVERY + 1, 3 * EVERY + 1), ref=ref, check=True)
        self.wait_copies(ts, 3 * EVERY)

        # Again at the copy's step: rank 0's state file holds step 12 (zd__model_take_record).
        seen = len(world.daemons[0].log())
        self.kill(world, [1], ts)
        self.wait_health(world.daemons[0], "rejoining")
        self.wipe(1)
        self.restart(world, [1])
        ts = self.register_lagging(world, None)
        for t in ts:
            self.assertEqual(t.info.step, 3 * EVERY, f"rank {t.rank} resumed step {t.info.step}")
            self.assert_same(t.snapshot(), 3 * EVERY, f"rank {t.rank} after the recovery", ref)
        self.assertIn("from its state file", world.daemons[0].log()[seen:])
        self.train(ts, range(3 * EVERY + 1, 3 * EVERY + 4), ref=ref, check=True)
        for t in ts:
            t.close()
        common.stop_world(world)

    def test_lagging_parameter_without_state_dir(self) -> None:
        """As above with checkpoints and no state_dir: the world drops its models when it
        re-forms, the survivor's new model goes back to its own snapshot and the node back
        empty (a new zerod's memory) reads its copy from its buddy's memory; no checkpoint is
        taken before the loss, so the lags can come from nothing else."""
        ckpt = tempfile.mkdtemp(prefix="zerod-ckpt-")
        self.addCleanup(shutil.rmtree, ckpt, True)
        ref = LagReference()
        world = self.world(["--checkpoint_dir", ckpt, "--resume", "latest"], state_dir=False)
        ts = self.register_lagging(world, init_values())
        self.train(ts, range(1, 2 * EVERY + 1), ref=ref)
        self.wait_copies(ts, 2 * EVERY)
        self.train(ts, range(2 * EVERY + 1, 2 * EVERY + 3), ref=ref)
        self.kill(world, [1], ts)
        self.wait_health(world.daemons[0], "rejoining")
        self.restart(world, [1])
        ts = self.register_lagging(world, None)
        for t in ts:
            self.assertEqual(t.info.step, 2 * EVERY, f"rank {t.rank} resumed step {t.info.step}")
            self.assertEqual(t.client.rank_status()["params_lagging"], "1",
                             f"rank {t.rank}: sd.b's own step count was not restored")
            rank = t.client.rank_status()
            self.assertEqual(rank["last_recovery"], "buddy copy", rank)
        self.assertIn("from its buddy's copy", world.daemons[1].log())
        self.assertIn("from its own snapshot", world.daemons[0].log())
        self.assertEqual(os.listdir(ckpt), [], "a checkpoint was taken")
        self.train(ts, range(2 * EVERY + 1, 3 * EVERY + 1), ref=ref, check=True)
        for t in ts:
            t.close()
        common.stop_world(world)

    def test_buddy_leaves_the_failure_domain(self) -> None:
        """W=3, domains a, a, b: rank 0's copy skips rank 1's node (its own domain) for rank 2's,
        rank 1's goes to rank 2's, rank 2's to rank 0's (the next node in rank order, of
        another domain). Then zerod 1 comes back empty and reads its copy from zerod 2, while
        ranks 0 and 2 go back to their own snapshots."""
        domains = ["a", "a", "b"]
        world = World3(self.state_dir, domains)
        self.addCleanup(lambda: world.stop())
        ts = self.register_n(world, 3)
        self.train(ts, range(1, EVERY + 1))
        self.wait_copies(ts, EVERY)
        want = {0: 2, 1: 2, 2: 0}
        for t in ts:
            buddy = t.client.status_dict()["buddy"]
            self.assertEqual(buddy["failure_domain"], domains[t.rank])
            self.assertEqual(buddy[f"rank{t.rank}_copy_holder"],
                             world.daemons[want[t.rank]].control_address, buddy)
        # zerod 1 back empty: its copy is in zerod 2; ranks 0 and 2 go back to their snapshots
        self.train(ts, range(EVERY + 1, EVERY + 3))
        common.stop_zerod(world.daemons[1], signal.SIGKILL)
        for t in ts:
            t.close()
        for v in (0, 2):
            self.wait_health(world.daemons[v], "rejoining")
        for f in glob.glob(os.path.join(self.state_dir, "rank1-of-3-*")):
            os.unlink(f)
        d = zerod.testing.LocalZerod(list(world.daemons[1].args), log_level="info")
        world.daemons[1] = d
        ts = on_all([lambda r=r: Trainer(world, None, r, register=False) for r in range(3)])
        infos = on_all([lambda t=t: t.client.register() for t in ts])
        for t, info in zip(ts, infos):
            t.info = info
            self.assertEqual(info.step, EVERY, f"rank {t.rank}")
            self.assert_same(t.snapshot(), EVERY, f"rank {t.rank} after the recovery")
        self.assertIn("at " + world.daemons[2].control_address, d.log())
        self.train(ts, range(EVERY + 1, EVERY + 4), check=True)
        for t in ts:
            t.close()
        common.stop_world(world)

    def test_copies_are_throttled(self) -> None:
        """buddy_bandwidth_bytes_per_s: a copy takes at least its bytes over the cap, while the
        steps go on (the trainers do not wait for it)."""
        cap = 2 << 20
        world = self.world(["--buddy_bandwidth_bytes_per_s", str(cap)])
        ts = self.register(world, init_values())
        self.train(ts, range(1, EVERY + 1))
        t0 = time.monotonic()
        self.train(ts, range(EVERY + 1, EVERY + 3))
        stepped = time.monotonic() - t0
        self.wait_copies(ts, EVERY)
        held = ts[1].client.status_dict()["buddy"]
        nbytes = int(held["held_rank0_bytes"])
        sent_ms = int(ts[0].client.status_dict()["buddy"]["rank0_last_send_ms"])
        self.assertGreaterEqual(sent_ms, 1000 * nbytes / cap * 0.9, f"{held}")
        self.assertLess(stepped, sent_ms / 1000, "the steps waited for the copy")
        for t in ts:
            t.close()
        common.stop_world(world)

    def test_both_copies_gone_falls_back_to_the_checkpoint(self) -> None:
        ckpt = tempfile.mkdtemp(prefix="zerod-ckpt-")
        self.addCleanup(shutil.rmtree, ckpt, True)
        world = self.world(["--checkpoint_dir", ckpt, "--checkpoint_every_steps", "3",
                            "--resume", "latest"])
        ts = self.register(world, init_values())
        self.train(ts, range(1, 2 * EVERY + 1))
        self.wait_copies(ts, 2 * EVERY)
        # zerod 0 kept rank 1's copy in the state_dir: deleted with rank 1's state file
        self.kill(world, [0, 1], ts)
        self.wipe(1, held=True)
        self.restart(world, [0, 1])
        ts = self.register(world, None)
        for t in ts:
            self.assertTrue(t.info.resumed)
            self.assertEqual(t.info.step, 6, "not the newest checkpoint (step 6)")
            self.assert_same(t.snapshot(), 6, f"rank {t.rank} from the checkpoint")
        rank = ts[1].client.status_dict()["rank 1"]
        self.assertEqual(rank["last_recovery"], "checkpoint", rank)
        self.assertIn("neither a state file nor a buddy copy", rank.get("last_recovery_note", ""),
                      rank)
        self.train(ts, range(7, 10), check=True)
        for t in ts:
            t.close()
        common.stop_world(world)

    def test_holder_keeps_copies_in_its_state_dir(self) -> None:
        world = self.world()
        ts = self.register(world, init_values())
        self.train(ts, range(1, 2 * EVERY + 1))
        self.wait_copies(ts, 2 * EVERY)
        held = ts[0].client.status_dict()["buddy"]
        self.assertEqual(held["held_in"], self.state_dir, held)
        for r in range(2):
            path = os.path.join(self.state_dir, f"buddy-rank{r}-of-2.zdbuddy")
            self.assertTrue(os.path.exists(path), os.listdir(self.state_dir))
            self.assertEqual(os.stat(path).st_mode & 0o777, 0o600, path)
        self.train(ts, range(2 * EVERY + 1, 2 * EVERY + 3))  # steps 9, 10
        self.kill(world, [0, 1], ts)
        self.wipe(1)  # rank 1's state file; both copies stay in the state_dir
        # a copy in flight when its holder died, and a damaged copy of another world
        part = os.path.join(self.state_dir, "buddy-rank0-of-2.zdbuddy.part")
        bad = os.path.join(self.state_dir, "buddy-rank3-of-4.zdbuddy")
        for path in (part, bad):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as fh:
                fh.write(b"\x01" * 8192)
        # a copy of format version 1 (before the per-parameter lags): set aside, both versions
        # named
        old = os.path.join(self.state_dir, "buddy-rank2-of-4.zdbuddy")
        with open(os.open(old, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as fh:
            fh.write(b"XDBUDDY1" + (1).to_bytes(4, "little") + b"\0" * 8180)
        self.restart(world, [0, 1])
        ts = self.register(world, None)
        for t in ts:
            self.assertTrue(t.info.resumed, f"rank {t.rank} did not resume")
            self.assertEqual(t.info.step, 2 * EVERY, f"rank {t.rank} resumed step {t.info.step}")
            self.assert_same(t.snapshot(), 2 * EVERY, f"rank {t.rank} after the recovery")
        for d in world.daemons:
            self.assertIn("from its state_dir", d.log())
            self.assertIn("from its buddy's copy", d.log())
        self.assertFalse(os.path.exists(part), "the copy in flight was not deleted")
        self.assertFalse(os.path.exists(bad), "the damaged copy was not renamed aside")
        self.assertTrue(glob.glob(bad + ".bad-*"), os.listdir(self.state_dir))
        self.assertTrue(glob.glob(old + ".bad-*"), os.listdir(self.state_dir))
        self.assertTrue(any("of format version 1; this zerod reads version 2" in d.log()
                            for d in world.daemons), "the old copy's versions are not named")
        self.train(ts, range(2 * EVERY + 1, 3 * EVERY + 2), check=True)
        for t in ts:
            t.close()
        common.stop_world(world)

    def test_copies_every_seconds(self) -> None:
        """buddy_copy_every_s alone: the first step after the interval is copied on every rank
        (the same step), and a node back empty resumes from it."""
        world = self.world(["--buddy_copy_every_s", "1"], every=0)
        ts = self.register(world, init_values())
        self.train(ts, range(1, 3))
        time.sleep(1.2)
        self.train(ts, range(3, 5))  # step 3, at the latest, is due on every rank
        deadline = time.monotonic() + 20
        while True:
            steps = [t.client.status_dict()["buddy"].get(f"rank{t.rank}_copy_step") for t in ts]
            if steps[0] == steps[1] and steps[0] not in (None, "none"):
                break
            self.assertLess(time.monotonic(), deadline, f"no copy of one step: {steps}")
            time.sleep(0.05)
        copied = int(steps[0])
        self.assertGreaterEqual(copied, 3, steps)
        st = ts[0].client.status_dict()["buddy"]
        self.assertEqual(st["every_s"], "1", st)
        self.assertEqual(st["every_steps"], "0", st)
        self.kill(world, [1], ts)
        self.wait_health(world.daemons[0], "rejoining")
        self.wipe(1)
        self.restart(world, [1])
        ts = self.register(world, None)
        for t in ts:
            self.assertTrue(t.info.resumed, f"rank {t.rank} did not resume")
            self.assertEqual(t.info.step, copied, f"rank {t.rank} resumed step {t.info.step}")
            self.assert_same(t.snapshot(), copied, f"rank {t.rank} after the recovery")
        self.train(ts, range(copied + 1, copied + 3), check=True)
        for t in ts:
            t.close()
        common.stop_world(world)


if __name__ == "__main__":
    sys.argv = sys.argv[:1]
    common.run(BuddyTest)
