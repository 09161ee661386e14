"""state_dir across planned restarts and with per-parameter step counts (issue 29 item 4, and the
lags of issue 31), against real zerod processes, every step bitwise torch.optim.AdamW's.

- Planned restarts: plain ZeroOptimizer loops (zero_grad, backward, step) at W=1 and at W=2 (a
  zerod per rank, rank 0's serving the rendezvous store), a random zerod stopped with SIGTERM at
  random moments (as `systemctl restart` or a Kubernetes rolling restart stops it: it exits 0)
  and started again, same binary, on the same socket with the same state_dir
  (state_dir_kill_trials.Run with SIGTERM). step() registers again and retries the step in flight
  (zd_rejoin): no exception reaches a loop, no step is lost or applied twice.
- A planned stop whose step cannot finish: W=2, the stopped zerod's trainer is inside a step that
  waits for the other rank, whose trainer stalls past shutdown_timeout_ms. The step is aborted
  with ZD_ECLOSED and a message that says zerod stopped and its state_dir kept the state (without
  a state_dir it stays -ECANCELED, "zerod is shutting down": nothing to come back to), and step()
  continues after the restart.
- Lags: a parameter with no gradient on odd steps (torch skips it: its own state['step'] lags the
  model's), zerod SIGKILLed at random moments and restarted from the state_dir: the lags come
  back from the state file (format version 2), so the skipped parameter's bias corrections stay
  torch's.
- A file of format version 1 (what an older zerod left) is set aside with a message naming both
  versions, and the rank resumes the newest checkpoint.

Options: --seed S (default 1; "random"), --trials N (default 12: the planned restarts per world
size; the lag test makes N // 2 kills).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import unittest
import warnings
from typing import Dict

import common  # sets up sys.path and the library first

import numpy as np

import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402

import state_dir_kill_trials as K  # noqa: E402
import test_state_dir as T  # noqa: E402

torch = T.torch
NAMES = [n for n, _ in T.PARAMS]
LAGGING = "sd.b"  # no gradient on odd steps


def restart_same_socket(old: zerod.testing.LocalZerod) -> zerod.testing.LocalZerod:
    """A new zerod with old's command line, on old's socket (where the trainers' library connects
    again)."""
    d = zerod.testing.LocalZerod(list(old.args), log_level="info", start=False)
    d.socket = old.socket
    if os.path.exists(d.socket):
        os.unlink(d.socket)
    d.start()
    return d


class LagReference:
    """torch.optim.AdamW(foreach=False) on test_state_dir's gradients, LAGGING's .grad None on odd
    steps; parameters after each step, computed on demand."""

    def __init__(self) -> None:
        self.params = [torch.tensor(v) for v in T.init_values().values()]
        self.opt = torch.optim.AdamW(self.params, foreach=False)
        self.seen = {0: self.snapshot()}

    def snapshot(self) -> Dict[str, np.ndarray]:
        return {n: p.detach().numpy().copy() for n, p in zip(NAMES, self.params)}

    def at(self, step: int) -> Dict[str, np.ndarray]:
        while max(self.seen) < step:
            s = max(self.seen) + 1
            g = T.step_grads(s)
            for n, p in zip(NAMES, self.params):
                p.grad = None if n == LAGGING and s % 2 else torch.tensor(g[n])
            self.opt.step()
            self.seen[s] = self.snapshot()
        return self.seen[step]


class RestartTest(unittest.TestCase):
    seed = 1
    trials = 12

    def setUp(self) -> None:
        self.top = tempfile.mkdtemp(prefix="zerod-restart-", dir=T.tmpfs_root())
        self.addCleanup(shutil.rmtree, self.top, True)
        self.state_dir = os.path.join(self.top, "state")
        quiet = warnings.catch_warnings()  # step()'s "registering the model again", expected
        quiet.__enter__()
        self.addCleanup(quiet.__exit__, None, None, None)
        warnings.simplefilter("ignore")

    def planned_restarts(self, w: int) -> None:
        stats = {"trials": 0, "mid_step": 0, "lost": 0, "wrong": 0, "raised": 0, "hangs": 0,
                 "heal_not_started": 0, "kills_at_start": 0, "recovery_s": [], "notes": []}
        rnd = random.Random(self.seed + w)
        run = K.Run(w, stats, 60.0, "", signal.SIGTERM)
        try:
            for trial in range(self.trials):
                ok = run.trial(rnd)  # every zerod stopped must exit 0 (common.stop_zerod)
                self.assertTrue(ok, f"W={w} trial {trial}: " + (
                    repr(run.errors[0]) if run.errors else
                    f"no rank trained again within 60 s ({run.progress}); logs:\n" +
                    "\n".join(d.log()[-3000:] for d in run.daemons)))
            last = max(run.progress)
            run.close(True)
            self.assertEqual(run.errors, [], f"W={w}: an exception reached a loop")
            self.assertEqual(run.progress, [last + 2] * w, f"W={w}: the loops did not finish")
        finally:
            if run.threads[0].is_alive():
                run.close(False)
        self.assertEqual((stats["lost"], stats["wrong"]), (0, 0), f"W={w}: {stats['notes']}")
        print(f"\n    W={w}: {stats['trials']} SIGTERMs ({stats['mid_step']} inside a step, "
              f"{stats['kills_at_start']} again at start), every step torch's; SIGTERM to "
              f"every rank training again: median {np.median(stats['recovery_s']):.3f} s")

    def test_planned_restarts_w1(self) -> None:
        self.planned_restarts(1)

    def test_planned_restarts_w2(self) -> None:
        self.planned_restarts(2)

    def stalled_peer(self, state_dir: bool) -> tuple:
        """W=2: zerod 1 stopped (SIGTERM) while its trainer waits in step 4 for rank 0, whose
        trainer stalls past shutdown_timeout_ms; zerod 1 started again at once. Returns the
        warnings step() gave and the loops' exceptions; with a state_dir the loops' results are
        checked here."""
        from zerod.torch import ZeroOptimizer
        args = ["--bucket_elems", T.BUCKET, "--heartbeat_ms", "100", "--peer_timeout_ms", "1000",
                "--shutdown_timeout_ms", "300", "--log_level", "info"]
        if state_dir:
            args += ["--state_dir", self.state_dir]
        world = zerod.testing.LocalWorld(2, daemons=2, args=args)
        ref, lock = T.Reference(), threading.Lock()
        state = {"progress": [0, 0], "in_step": [False, False], "error": [None, None],
                 "wrong": []}
        try:
            opts = T.on_all([lambda r=r: ZeroOptimizer(
                [(n, torch.tensor(v, requires_grad=True)) for n, v in T.init_values().items()],
                client=world.connect(r), grad_mean=False, foreach=False) for r in range(2)])

            def loop(r: int) -> None:
                opt = opts[r]
                ps = [p for g in opt.param_groups for p in g["params"]]
                try:
                    for s in range(1, 8):
                        g = T.step_grads(s)
                        opt.zero_grad()
                        loss = sum((p * (torch.tensor(np.asarray(g[n])) if r == 0 else
                                         torch.zeros(p.shape))).sum() for n, p in zip(NAMES, ps))
                        loss.backward()
                        if r == 0 and s == 4:
                            time.sleep(2.0)  # evaluating, say: rank 1 waits in step 4
                        state["in_step"][r] = True
                        opt.step()
                        state["in_step"][r] = False
                        with lock:
                            want = ref.at(s)
                        for n, p in zip(NAMES, ps):
                            if not np.array_equal(p.detach().numpy().view(np.uint32),
                                                  want[n].view(np.uint32)):
                                state["wrong"].append(f"step {s} rank {r} {n}")
                        state["progress"][r] = s
                except BaseException as e:  # noqa: BLE001  (asserted by the caller)
                    state["error"][r] = e

            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                threads = [threading.Thread(target=loop, args=(r,)) for r in range(2)]
                for th in threads:
                    th.start()
                deadline = time.monotonic() + 60
                while not (state["progress"][1] == 3 and state["in_step"][1]):
                    self.assertLess(time.monotonic(), deadline, f"no step 4 ({state})")
                    time.sleep(0.002)
                time.sleep(0.2)  # rank 1's step 4 waits for rank 0 in its collectives
                world.daemons[1].keep_dir = True
                common.stop_zerod(world.daemons[1], signal.SIGTERM)  # exit 0, within 300 ms
                world.daemons[1] = restart_same_socket(world.daemons[1])
                world._endpoints[1] = (world.daemons[1].socket, 0)
                for th in threads:
                    th.join(120)
                    self.assertFalse(th.is_alive(), "a training loop hangs")
            self.assertEqual(state["wrong"], [], "steps whose parameters differ from torch's")
            if state_dir:
                self.assertEqual(state["error"], [None, None], "an exception reached a loop")
                self.assertEqual(state["progress"], [7, 7])
                for o in opts:
                    o.close()
            common.stop_world(world)
            return [str(w.message) for w in seen], state["error"]
        finally:
            world.stop(signal.SIGKILL, check=False)

    def test_planned_stop_with_a_step_waiting_for_a_stalled_peer(self) -> None:
        said, _ = self.stalled_peer(state_dir=True)
        self.assertTrue(any("zerod is stopping (a planned stop); its state_dir keeps the "
                            "committed state" in m for m in said),
                        f"step() did not say why it registered again: {said}")

    def test_planned_stop_without_state_dir_still_cancels(self) -> None:
        """Without a state_dir nothing keeps the state for the next zerod: the step fails as
        before, with -ECANCELED, and step() raises it."""
        _, errors = self.stalled_peer(state_dir=False)
        e = errors[1]
        self.assertIsInstance(e, ZerodError, f"rank 1's loop: {e!r}")
        self.assertEqual(e.code, -errno.ECANCELED, f"rank 1's loop: {e!r}")
        self.assertIn("zerod is shutting down", e.message)

    def test_lags_survive_a_restart(self) -> None:
        """LAGGING has no gradient on odd steps (ZeroOptimizer.zero_grad(set_to_none=True), left
        out of the loss); zerod SIGKILLed at random moments and started again: every step
        bitwise torch's, whose LAGGING's own step count lags the model's."""
        from zerod.torch import ZeroOptimizer
        rnd = random.Random(self.seed + 7)
        d = zerod.testing.LocalZerod(["--state_dir", self.state_dir, "--bucket_elems", T.BUCKET],
                                     log_level="info")
        ref = LagReference()
        opt = ZeroOptimizer([(n, torch.tensor(v, requires_grad=True))
                             for n, v in T.init_values().items()], client=d.connect(),
                            grad_mean=False, foreach=False)
        ps = [p for g in opt.param_groups for p in g["params"]]
        state = {"progress": 0, "in_step": False, "stop_at": 10 ** 9, "wrong": [],
                 "error": None}

        def loop() -> None:
            s = 1
            try:
                while s <= state["stop_at"]:
                    g = T.step_grads(s)
                    opt.zero_grad(set_to_none=True)
                    loss = sum((p * torch.tensor(np.asarray(g[n]))).sum()
                               for n, p in zip(NAMES, ps) if not (n == LAGGING and s % 2))
                    loss.backward()
                    state["in_step"] = True
                    opt.step()
                    state["in_step"] = False
                    want = ref.at(s)
                    for n, p in zip(NAMES, ps):
                        if not np.array_equal(p.detach().numpy().view(np.uint32),
                                              want[n].view(np.uint32)):
                            state["wrong"].append(f"step {s} {n}")
                    state["progress"] = s
                    s += 1
            except BaseException as e:  # noqa: BLE001  (asserted below)
                state["error"] = e

        th = threading.Thread(target=loop)
        th.start()
        kills = max(3, self.trials // 2)
        try:
            for trial in range(kills):
                base = state["progress"]
                deadline = time.monotonic() + 60
                while state["progress"] < base + 3:
                    self.assertLess(time.monotonic(), deadline, f"trial {trial}: no progress")
                    self.assertIsNone(state["error"])
                    time.sleep(0.002)
                time.sleep(rnd.uniform(0.0, 0.03))
                common.stop_zerod(d, signal.SIGKILL)
                d = restart_same_socket(d)
            state["stop_at"] = state["progress"] + 4
            th.join(120)
            self.assertFalse(th.is_alive(), "the training loop hangs")
            self.assertIsNone(state["error"], "an exception reached the loop")
            self.assertEqual(state["wrong"], [], "steps whose parameters differ from torch's")
            self.assertEqual(state["progress"], state["stop_at"])
            self.assertIn("from its state file", d.log())
            lag = opt.client.status_dict()["rank 0"]
            print(f"\n    {kills} SIGKILLs, {state['progress']} steps, {LAGGING} skipped on odd "
                  f"steps: every step torch's ({lag.get('params_lagging', '?')} lagging)")
            opt.close()
            common.stop_zerod(d)
        finally:
            state["stop_at"] = -1
            th.join(10)
            d.stop(signal.SIGKILL, check=False)


    def test_older_format_version_is_set_aside(self) -> None:
        """A state file of format version 1 (no lags; checksums right: a file an older zerod
        left) is not mapped: set aside with a message naming both versions, and the rank resumes
        the newest checkpoint, as README's upgrade across a format change says."""
        try:
            xxh = ctypes.CDLL("libxxhash.so.0")
        except OSError:
            self.skipTest("no libxxhash.so.0 to write a version 1 header's checksum")
        xxh.XXH3_64bits.restype = ctypes.c_uint64
        xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        ckpt = tempfile.mkdtemp(prefix="zerod-ckpt-")
        self.addCleanup(shutil.rmtree, ckpt, True)
        args = ["--state_dir", self.state_dir, "--bucket_elems", T.BUCKET, "--checkpoint_dir",
                ckpt, "--checkpoint_every_steps", "3", "--resume", "latest"]
        d = zerod.testing.LocalZerod(args, log_level="info")
        t = T.Trainer(d, T.init_values())
        for s in range(1, 6):
            t.step(s)
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(ckpt, f"step-{3:012d}", "manifest.json")):
            self.assertLess(time.monotonic(), deadline, "checkpoint of step 3 not written")
            time.sleep(0.02)
        t.close()
        common.stop_zerod(d, signal.SIGKILL)
        [path] = [os.path.join(self.state_dir, f) for f in os.listdir(self.state_dir)]
        with open(path, "r+b") as f:  # both slots as version 1 wrote them
            for off in (0, 2048):
                f.seek(off)
                slot = bytearray(f.read(128))
                if slot[:8] != b"ZDSTATE\n":
                    continue
                slot[8:12] = struct.pack("<I", 1)
                slot[120:128] = struct.pack("<Q", xxh.XXH3_64bits(bytes(slot[:120]), 120))
                f.seek(off)
                f.write(slot)
        d = zerod.testing.LocalZerod(args, log_level="info")
        t = T.Trainer(d, None)
        self.assertEqual(t.info.step, 3, "the newest checkpoint")
        log = d.log()
        self.assertIn("is of state file format version 1; this zerod reads version 2 only", log)
        self.assertTrue(os.path.exists(path), "a new file for the running state")
        self.assertEqual(len([f for f in os.listdir(self.state_dir) if ".bad-" in f]), 1,
                         "the old file is kept aside")
        t.close()
        common.stop_zerod(d)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--seed", default=None)
    opts, rest = ap.parse_known_args()
    RestartTest.trials = opts.trials
    RestartTest.seed = common.test_seed(opts.seed)
    print(f"seed {RestartTest.seed}: {common.repeat_command(RestartTest.seed)}", flush=True)
    sys.argv = [sys.argv[0]] + rest
    common.run(RestartTest)
