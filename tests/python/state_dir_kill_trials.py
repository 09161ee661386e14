"""Kill trials for state_dir (issue 29): a zerod SIGKILLed at random moments under plain
ZeroOptimizer training loops that never register again themselves, restarted on the same
socket with the same state_dir, every step checked bit for bit against torch.

One world per world size (W=1: one zerod; W=2: a zerod per rank, rank 0's serving the
rendezvous store, checkpoints every 4 steps so that kills also land in checkpoints) trains the
deterministic steps of test_state_dir.py (rank 0 sends step s's gradient, the others zeros,
summed) in one thread per rank: zero_grad, backward of sum(p * g), step. Each trial waits until
every rank has trained two steps since the last recovery, waits a random 0-50 ms (most of a
loop's time is inside step(): updates, commits, gathers, checkpoints), SIGKILLs a random zerod
(every other trial aims inside a step: once a rank entered step(), 0-1 ms into it) and, as
systemd would, restarts it once the survivor is re-forming the world (W=2) or at once (W=1).
Every fifth trial kills the restarted zerod again 0-30 ms after it accepts connections (the
trainers' registrations, the state file's mapping and check), and restarts it again. The
loops' step() registers the model again and retries the step in flight (zd_rejoin); the
trial then waits for every rank to train past the step it had in flight.

Counted: trials, kills that landed while a rank was inside step(), lost steps (a rank whose
parameters after step s are torch's after an earlier step: a rollback), wrong results (any other
difference from torch), exceptions that reached a loop, hangs (no rank trains again within
--bound s: the world is replaced and the run goes on), heals that never started (the survivor
did not say "rejoining" within 30 s of its peer's SIGKILL), and the time from the SIGKILL to
every rank having trained a step after it (median, p95; it includes zerod's start and, at W=2,
the wait for the survivor to notice), and the memory of the state_dir (its files' allocated
bytes) next to the model's optimizer state.

    state_dir_kill_trials.py [--trials N] [--world 1,2] [--seed S|random] [--bound S]
                             [--min-mid-step M] [--signal KILL|TERM] [--logs DIR]

--signal TERM stops the zerods as `systemctl restart` does (planned restarts: each must exit 0)
instead of SIGKILLing them. --logs DIR keeps, for each trial that hung or raised, the zerods'
logs (the live ones and the last ones killed) and the last trials' events with their times.

The trials are split between the world sizes. How many kills land inside a step depends on the
machine's speed, so a world runs more trials (up to 4x its share) until its share of
--min-mid-step did. Exit status 1 when any trial lost a step, was wrong, raised, hung, or fewer
than --min-mid-step kills landed inside a step.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Dict, List

import common  # sets up sys.path and the library first

import numpy as np

import zerod.testing  # noqa: E402

import test_state_dir as T  # noqa: E402  (the model, its gradients and torch's reference)

torch = T.torch


class Run:
    """One world of `w` ranks training in threads until stopped."""

    def __init__(self, w: int, stats: dict, bound: float, logs: str = "",
                 sig: int = signal.SIGKILL) -> None:
        self.w, self.ref, self.stats, self.bound = w, T.Reference(), stats, bound
        self.sig = sig  # SIGKILL: a crash; SIGTERM: a planned stop (systemctl restart)
        self.logs = logs  # where a hung trial's zerod logs go ("": nowhere)
        self.gone: List[str] = []  # the logs of the zerods killed in the last trials
        self.events: List[str] = []  # what the last trials did, with the wall-clock time
        self.top = tempfile.mkdtemp(prefix="zerod-killtrials-", dir=T.tmpfs_root())
        self.state_dir = os.path.join(self.top, "state")
        args = ["--state_dir", self.state_dir, "--bucket_elems", T.BUCKET, "--log_level", "info"]
        if w == 1:
            self.daemons = [zerod.testing.LocalZerod(args, log_level="info")]
            self.world = None
        else:
            self.ckpt = tempfile.mkdtemp(prefix="zerod-killtrials-ckpt-")
            args += ["--heartbeat_ms", "100", "--peer_timeout_ms", "1000", "--checkpoint_dir",
                     self.ckpt, "--checkpoint_every_steps", "4"]
            self.world = zerod.testing.LocalWorld(2, daemons=2, args=args)
            self.daemons = self.world.daemons
            self.rendezvous = self.daemons[0].control_address
        self.lock = threading.Lock()
        self.progress = [0] * w
        self.in_step = [False] * w
        self.stop_at = 10 ** 9
        self.errors: List[BaseException] = []
        names = [n for n, _ in T.PARAMS]
        from zerod.torch import ZeroOptimizer

        def make(r: int):
            client = self.daemons[0].connect() if w == 1 else self.world.connect(r)
            return ZeroOptimizer([(n, torch.tensor(v, requires_grad=True))
                                  for n, v in T.init_values().items()], client=client,
                                 grad_mean=False, foreach=False)
        self.opts = T.on_all([lambda r=r: make(r) for r in range(w)])
        self.names = names
        self.threads = [threading.Thread(target=self.loop, args=(r,), daemon=True)
                        for r in range(w)]
        for th in self.threads:
            th.start()

    def loop(self, r: int) -> None:
        opt = self.opts[r]
        ps = [p for g in opt.param_groups for p in g["params"]]
        s = 1
        try:
            while s <= self.stop_at:
                g = T.step_grads(s)
                opt.zero_grad()
                loss = sum((p * (torch.tensor(np.asarray(g[n])) if r == 0 else
                                 torch.zeros(p.shape))).sum() for n, p in zip(self.names, ps))
                loss.backward()
                self.in_step[r] = True
                opt.step()
                self.in_step[r] = False
                with self.lock:
                    want = self.ref.at(s)
                    before = self.ref.at(s - 1)
                got = {n: p.detach().numpy() for n, p in zip(self.names, ps)}
                if any(not np.array_equal(got[n].view(np.uint32), want[n].view(np.uint32))
                       for n in self.names):
                    lost = all(np.array_equal(got[n].view(np.uint32),
                                              before[n].view(np.uint32)) for n in self.names)
                    self.stats["lost" if lost else "wrong"] += 1
                    self.stats["notes"].append(f"W={self.w} rank {r} step {s}: "
                                               f"{'lost' if lost else 'wrong'}")
                self.progress[r] = s
                s += 1
        except BaseException as e:  # noqa: BLE001  (counted)
            self.errors.append(e)
            self.event(f"rank {r} raised at step {s}: " +
                       "".join(traceback.format_exception(type(e), e, e.__traceback__)))

    def restart(self, v: int) -> None:
        old = self.daemons[v]
        args = list(old.args)
        if self.w == 2 and v == 0 and "--control_address" not in args:
            args += ["--control_address", self.rendezvous]
        if self.w == 2 and v == 0 and os.path.exists(self.rendezvous[len("unix:"):]):
            os.unlink(self.rendezvous[len("unix:"):])
        d = zerod.testing.LocalZerod(args, log_level="info", start=False)
        d.socket = old.socket
        if os.path.exists(d.socket):
            os.unlink(d.socket)
        d.start()
        if self.w == 2 and v == 0:
            d.control_address = self.rendezvous
        self.daemons[v] = d
        if self.world is not None:
            self.world._endpoints[v] = (d.socket, 0)
        keep = {os.path.dirname(d.socket)}
        if self.w == 2:
            keep.add(os.path.dirname(self.rendezvous[len("unix:"):]))
        if self.logs:
            self.gone = (self.gone + [f"---- killed zerod {v} (pid {old.pid}) ----\n{old.log()}"])[-4:]
        self.event(f"restarted zerod {v}: pid {d.pid}")
        if old.dir not in keep:  # the killed one's log and control socket
            shutil.rmtree(old.dir, True)

    def event(self, what: str) -> None:
        if self.logs:
            now = time.time()
            self.events = (self.events + [time.strftime("%H:%M:%S", time.gmtime(now)) +
                                          f".{int(now * 1000) % 1000:03d} {what}"])[-40:]

    def keep_logs(self, trial: int) -> str:
        """Writes the zerods' logs (the live ones and the last ones killed) and the last trials'
        events to a file under --logs; returns its path."""
        os.makedirs(self.logs, exist_ok=True)
        kind = "raised" if self.errors else "hang"
        path = os.path.join(self.logs, f"{kind}-W{self.w}-trial{trial}-{os.getpid()}.log")
        with open(path, "w") as f:
            f.write("---- events (UTC) ----\n" + "\n".join(self.events) + "\n")
            f.write(f"progress {self.progress}, in_step {self.in_step}\n")
            for t in self.gone:
                f.write(t)
            for i, d in enumerate(self.daemons):
                f.write(f"---- zerod {i} (pid {d.pid}) ----\n{d.log()}")
        return path

    def trial(self, rnd: random.Random) -> bool:
        """One kill and its recovery; False when the run hung (it is then replaced)."""
        base = min(self.progress)
        deadline = time.monotonic() + self.bound
        while min(self.progress) < base + 2:
            if self.errors or time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        time.sleep(rnd.uniform(0.0, 0.05))
        if rnd.random() < 0.5:  # aimed inside a step: once one began, 0-1 ms into it
            until = time.monotonic() + 10
            while not any(self.in_step) and time.monotonic() < until:
                time.sleep(0.0002)
            time.sleep(rnd.uniform(0.0, 0.001))
        v = rnd.randrange(self.w)
        mid = any(self.in_step)
        at_kill = max(self.progress)
        t0 = time.monotonic()
        self.event(f"trial: {self.sig.name} zerod {v} (pid {self.daemons[v].pid}), mid-step "
                   f"{mid}, progress {self.progress}")
        self.daemons[v].keep_dir = True  # a clean exit would remove it: restart() decides
        common.stop_zerod(self.daemons[v], self.sig)
        self.stats["trials"] += 1
        self.stats["mid_step"] += mid
        if self.w == 2:
            survivor = self.daemons[1 - v]
            until = time.monotonic() + 30
            while common.rank_health(survivor.control_address) != "rejoining":
                if time.monotonic() > until:
                    self.stats["heal_not_started"] += 1
                    h = common.rank_health(survivor.control_address)
                    self.stats["notes"].append(f"W=2: survivor {1 - v} stayed {h!r} 30 s after "
                                               f"the kill; log tail: {survivor.log()[-600:]!r}")
                    break
                time.sleep(0.01)
        self.restart(v)
        if rnd.random() < 0.2:  # again, at start: registrations, the file's mapping and check
            time.sleep(rnd.uniform(0.0, 0.03))
            self.event(f"{self.sig.name} at start zerod {v} (pid {self.daemons[v].pid})")
            self.daemons[v].keep_dir = True
            common.stop_zerod(self.daemons[v], self.sig)
            self.stats["kills_at_start"] += 1
            if self.w == 2:
                time.sleep(1.5)  # the survivor notices again
            self.restart(v)
        deadline = time.monotonic() + self.bound
        while min(self.progress) <= at_kill:
            if self.errors or time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        self.stats["recovery_s"].append(time.monotonic() - t0)
        self.event(f"recovered in {time.monotonic() - t0:.3f} s, progress {self.progress}")
        with self.lock:  # torch's steps that no rank asks for again
            low = min(self.progress) - 1
            for k in [k for k in self.ref.seen if k < low and k != max(self.ref.seen)]:
                del self.ref.seen[k]
        return True

    def state_bytes(self) -> int:
        """The allocated bytes of the state files (not those renamed aside)."""
        total = 0
        for root, _, files in os.walk(self.state_dir):
            for f in files:
                if f.endswith(".zdstate"):
                    total += os.stat(os.path.join(root, f)).st_blocks * 512
        return total

    def close(self, clean: bool) -> None:
        self.stop_at = -1 if not clean else max(self.progress) + 2
        for th in self.threads:
            th.join(self.bound if clean else 5)
        if clean:
            for o in self.opts:
                o.close()
        for d in self.daemons:
            d.stop(signal.SIGKILL, check=False)
        shutil.rmtree(self.top, True)
        if self.w == 2:
            shutil.rmtree(self.ckpt, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--world", default="1,2")
    ap.add_argument("--seed", default=None)
    ap.add_argument("--bound", type=float, default=60.0)
    ap.add_argument("--min-mid-step", type=int, default=0)
    ap.add_argument("--signal", default="KILL", choices=["KILL", "TERM"],
                    help="KILL: crashes (default); TERM: planned stops, as systemctl restart "
                    "and a Kubernetes rolling restart send")
    ap.add_argument("--logs", default="",
                    help="a directory where each hung trial's zerod logs are written")
    opts = ap.parse_args()
    seed = common.test_seed(opts.seed)
    print(f"seed {seed}: {common.repeat_command(seed)}", flush=True)
    rnd = random.Random(seed)
    warnings.simplefilter("ignore")  # step()'s "registering the model again", expected
    worlds = [int(w) for w in opts.world.split(",")]
    state_bytes = {}
    model_bytes = sum(int(np.prod(s)) for _, s in T.PARAMS) * 4 * 3  # master, m, v
    table = []
    failed, mid_total = False, 0
    for i, w in enumerate(worlds):
        n = opts.trials // len(worlds) + (i < opts.trials % len(worlds))
        # how often a kill lands inside a step depends on the machine's speed: a world runs
        # more trials (up to 4x) until its share of --min-mid-step kills landed inside a step
        want_mid = -(-opts.min_mid_step * n // max(opts.trials, 1))
        stats: Dict = {"trials": 0, "mid_step": 0, "lost": 0, "wrong": 0, "raised": 0,
                       "hangs": 0, "heal_not_started": 0, "kills_at_start": 0,
                       "recovery_s": [], "notes": []}
        t_start = time.monotonic()
        sig = signal.Signals["SIG" + opts.signal]
        run = Run(w, stats, opts.bound, opts.logs, sig)
        done = 0
        while done < n or (stats["mid_step"] < want_mid and done < 4 * n):
            ok = run.trial(rnd)
            done += 1
            if not ok:
                stats["raised" if run.errors else "hangs"] += 1
                if run.errors and opts.logs:
                    run.keep_logs(done)
                stats["notes"].append(f"W={w} trial {done}: " + (
                    repr(run.errors[0]) if run.errors else
                    f"no rank trained again within {opts.bound:g} s ({run.progress})" +
                    (f"; logs in {run.keep_logs(done)}" if opts.logs else "")))
                run.close(False)
                run = Run(w, stats, opts.bound, opts.logs, sig)  # a new world, from step 0
        state_bytes[w] = run.state_bytes()
        run.close(True)
        if run.errors:
            stats["raised"] += 1
            stats["notes"].append(f"W={w} at the end: {run.errors[0]!r}")
        rec = stats["recovery_s"]
        table.append((w, stats, time.monotonic() - t_start))
        for note in stats["notes"][:20]:
            print("   ", note)
        print(f"W={w}: {stats['trials']} trials ({time.monotonic() - t_start:.0f} s), "
              f"{stats['mid_step']} kills inside a step, {stats['kills_at_start']} again at "
              f"start; lost steps {stats['lost']}, wrong {stats['wrong']}, raised "
              f"{stats['raised']}, hangs {stats['hangs']}, heals not started "
              f"{stats['heal_not_started']}; {sig.name} to every rank training again: median "
              f"{statistics.median(rec) if rec else float('nan'):.3f} s, p95 "
              f"{common.percentile(rec, 0.95):.3f} s, "
              f"max {max(rec) if rec else float('nan'):.3f} s; "
              f"state_dir {state_bytes[w] / 2**20:.2f} MiB for {model_bytes / 2**20:.2f} MiB of "
              f"optimizer state per rank x {w} rank(s)", flush=True)
        failed |= any(stats[k] for k in ("lost", "wrong", "raised", "hangs"))
        mid_total += stats["mid_step"]
    if mid_total < opts.min_mid_step:
        print(f"only {mid_total} kills landed inside a step; at least {opts.min_mid_step} wanted")
        failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
