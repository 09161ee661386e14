"""Kill trials for state_dir_mode = snapshot (issue 29, item 3): a zerod SIGKILLed at random
moments while its ranks snapshot their state every N steps, restarted on the same socket with the
same state_dir; the world goes back to the newest snapshot every rank holds, and every resumed
and every later step is checked bit for bit against torch.

One world per world size (W=1: one zerod; W=2: a zerod per rank, rank 0's serving the
rendezvous store, one state_dir, no checkpoint_dir: the snapshots are all there is) trains the
deterministic steps of test_state_dir.py (rank 0 sends step s's gradient, the others zeros,
summed) with the numpy trainers of test_state_dir.py, one thread per rank: fill the gradient,
client.step(). A kill rolls the world back, which ZeroOptimizer refuses (ZD_ESTEP), so a loop
that sees a ZerodError fills its param buffer with junk, calls client.rejoin() (the same model
and buffers registered again, retried until every rank registered) and goes on from info.step:
the step zerod resumed.

Each trial waits until every rank has trained two steps since its last recovery (and, so that
nothing is lost before the first snapshot, until every rank's snapshot file exists: a new world
trains to its first snapshot before its first trial; resuming step 0 is counted as a rollback
beyond the bound), waits a random 0-50 ms, SIGKILLs a random zerod and, as systemd would,
restarts it once the survivor is re-forming the world (W=2) or at once (W=1). Every other trial
aims inside a step (once a rank entered step(), 0-1 ms into it); of the others, every second
aims at a snapshot's write (0-2 ms after a rank finished a step that is a multiple of N: the
snapshot is copied and written after the step's reply). Every fifth trial kills the restarted
zerod again 0-30 ms after it accepts connections (the registrations, the files' read and the
agreement), and restarts it again. The trial ends when every rank has finished a step that it
began after the last kill.

Counted, per world size:
- wrong: the parameters after a resume at step s are not torch's at step s, bit for bit, or any
  later step's are not (torch.optim.AdamW(foreach=False) replaying the same gradients: the
  steps since the oldest a rank may go back to are kept);
- beyond: a resumed step s that is not a snapshot's (0, not a multiple of N, info.resumed
  false), or s < c - N - slack, c being the last step every rank had finished before the kill
  (before the second kill, when every rank had registered again in between), N the steps since
  the newest snapshot and slack (2N by default) the snapshot being written at the kill, lost,
  and one skipped because the previous one was still being written; or s > c' + 1, c' the
  newest step any rank had finished (a step from the future);
- split: ranks that resumed different steps, or a rank that trained on without registering again;
- mixed (W=2): the ranks' snapshots of the resumed step were taken on both sides of an earlier
  recovery that went back below that step: one rank's is of the run that recovery abandoned (a
  survivor that kept its newer files when it rolled back: fixed, such files are now deleted),
  the other's of the run after it. The
  gradients here do not depend on the run, so the parameters cannot show it; the snapshot files'
  headers (taken_unix_ms) and the kills' times do;
- raised: an exception that reached a loop (client.rejoin gives up after 2 x --bound s);
- hangs: no rank trains past the kill within --bound s (the note lists each rank's snapshot files
  and their steps; the world is replaced: a new world, from step 0, trained to its first
  snapshot; the run goes on);
- set aside: snapshot files renamed .bad-<ms> (a SIGKILL must leave whole files only);
- not failures, but counted: unexpected (a loop that had to register again while no kill was
  pending) and heals not started (the survivor not "rejoining" 30 s after its peer's SIGKILL);
- the steps lost (c - s: median, max) and the time from the SIGKILL to every rank having
  finished a step after it (median, p95, max; it includes zerod's start and, at W=2, the wait
  for the survivor to notice), the snapshots skipped (rank 0's log lines), the kills that
  landed inside a step and while a snapshot file was being written (a .part written in the last
  20 ms), and the state_dir's allocated bytes (every rank's files) next to the model's
  optimizer state.

    snapshot_kill_trials.py [--trials N] [--world 1,2] [--seed S|random] [--bound S]
                            [--min-mid-step M] [--every N] [--slack K] [--logs DIR]

--logs DIR keeps, for each trial that hung, raised, was wrong, beyond, split or mixed, the
zerods' logs (the live ones and the last ones killed), the last trials' events with their times
and each rank's snapshot files with their steps.

The trials are split between the world sizes. How many kills land inside a step depends on the
machine's speed, so a world runs more trials (up to 4x its share) until its share of
--min-mid-step did. Exit status 1 when any trial was wrong, beyond, split, mixed, raised, hung,
or set a file aside, or fewer than --min-mid-step kills landed inside a step.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import struct
import sys
import tempfile
import threading
import time
import traceback
from typing import Dict, List

import common  # sets up sys.path and the library first

import numpy as np

import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402

import test_state_dir as T  # noqa: E402  (the model, its gradients and torch's reference)
import test_state_snapshot as S  # noqa: E402  (snap_path; under torch 2.x, its update)

SKIP_LINE = "skipped on every rank"  # snapshot.c's warning for a snapshot due while one is written
FAILURES = ("wrong", "beyond", "split", "mixed", "raised", "hangs", "set_aside")


def header(path: str) -> tuple:
    """(step, taken_unix_ms) of the snapshot file at path (its header, snapfile.h: bytes 32 and
    88), or (-1, 0)."""
    try:
        with open(path, "rb") as f:
            head = f.read(96)
    except OSError:
        return -1, 0
    if len(head) < 96:
        return -1, 0
    return struct.unpack_from("<Q", head, 32)[0], struct.unpack_from("<Q", head, 88)[0]


def taken(path: str, step: int) -> int:
    """When the snapshot file at path was taken (unix ms) if it is of `step`, else 0."""
    at, ms = header(path)
    return ms if at == step else 0


def differs(got: Dict[str, np.ndarray], want: Dict[str, np.ndarray]) -> str:
    """Empty when every parameter is bitwise the same, else the first that is not and how."""
    for name, _ in T.PARAMS:
        g, w = got[name].view(np.uint32).ravel(), want[name].view(np.uint32).ravel()
        diff = np.flatnonzero(g != w)
        if diff.size:
            i = int(diff[0])
            return (f"{name} differs at {diff.size} elements, first [{i}]: "
                    f"{got[name].ravel()[i]!r} vs torch's {want[name].ravel()[i]!r}")
    return ""


class Run:
    """One world of `w` ranks training in threads until stopped, snapshotting every N steps."""

    def __init__(self, w: int, every: int, stats: dict, bound: float, logs: str = "") -> None:
        self.w, self.every, self.stats, self.bound = w, every, stats, bound
        self.ref = T.Reference()
        self.logs = logs  # where a failed trial's zerod logs go ("": nowhere)
        self.gone: List[str] = []  # the logs of the zerods killed in the last trials
        self.events: List[str] = []  # what the last trials did, with the wall-clock time
        self.top = tempfile.mkdtemp(prefix="zerod-snapkill-", dir=T.tmpfs_root())
        self.state_dir = os.path.join(self.top, "state")
        args = ["--state_dir", self.state_dir, "--bucket_elems", T.BUCKET, "--log_level", "info",
                "--state_dir_mode", "snapshot", "--state_snapshot_every_steps", str(every)]
        if w == 1:
            self.daemons = [zerod.testing.LocalZerod(args, log_level="info")]
            self.world = None
        else:
            args += ["--heartbeat_ms", "100", "--peer_timeout_ms", "1000"]
            self.world = zerod.testing.LocalWorld(2, daemons=2, args=args, log_level="info")
            self.daemons = self.world.daemons
            self.rendezvous = self.daemons[0].control_address
        self.lock = threading.Lock()  # the reference, the notes
        self.progress = [0] * w  # the last step each rank finished (it goes back at a resume)
        self.peak = 0  # the newest step any rank finished since the trial began
        self.since = [0] * w  # the steps each rank finished since it last registered
        self.in_step = [False] * w
        self.began = [0.0] * w  # when the step in flight began (monotonic)
        self.done_began = [0.0] * w  # when the last step finished began
        self.rejoined = [0.0] * w  # when each rank last registered again
        self.resumed = [0] * w  # the step each rank's last registration resumed
        self.pending = False  # a kill whose recovery is not complete
        self.rollbacks: List[tuple] = []  # (unix ms of a trial's first kill, the step resumed)
        self.skipped_gone = 0  # SKIP_LINE in rank 0's killed zerods' logs
        self.stop_at = 10 ** 9
        self.errors: List[BaseException] = []
        if w == 1:
            self.ts = [T.Trainer(self.daemons[0], T.init_values())]
        else:
            self.ts = T.on_all([lambda r=r: T.Trainer(self.world, T.init_values(), r,
                                                      register=False) for r in range(w)])
            infos = T.on_all([lambda t=t: t.client.register() for t in self.ts])
            for t, info in zip(self.ts, infos):
                t.info = info
        self.threads = [threading.Thread(target=self.loop, args=(r,), daemon=True)
                        for r in range(w)]
        for th in self.threads:
            th.start()

    def ref_at(self, s: int) -> Dict[str, np.ndarray]:
        """torch's parameters after step s (replayed from step 0 when the cache no longer has
        it: a resume further back than any allowed)."""
        with self.lock:
            if s >= min(self.ref.seen):
                return self.ref.at(s)
        return T.Reference().at(s)

    def note(self, kind: str, what: str) -> None:
        with self.lock:
            self.stats[kind] += 1
            self.stats["notes"].append(f"W={self.w} {kind}: {what}")
        self.event(f"{kind}: {what}")

    def loop(self, r: int) -> None:
        t = self.ts[r]
        s = 1
        try:
            while s <= self.stop_at:
                t.fill(s)
                self.began[r] = time.monotonic()
                self.in_step[r] = True
                try:
                    t.client.step()
                except ZerodError as e:
                    self.in_step[r] = False
                    s = self.rejoin(r, e) + 1
                    continue
                self.in_step[r] = False
                why = differs(t.p, self.ref_at(s))
                if why:
                    self.note("wrong", f"rank {r} step {s} (resumed {self.resumed[r]}): {why}")
                self.progress[r] = s
                self.peak = max(self.peak, s)
                self.since[r] += 1
                self.done_began[r] = self.began[r]
                s += 1
        except BaseException as e:  # noqa: BLE001  (counted)
            self.errors.append(e)
            self.event(f"rank {r} raised at step {s}: " +
                       "".join(traceback.format_exception(type(e), e, e.__traceback__)))

    def rejoin(self, r: int, e: ZerodError) -> int:
        """Registers rank r's model again after e; the step it resumed, checked."""
        if not self.pending:
            self.note("unexpected", f"rank {r} registers again with no kill pending after {e}")
        t = self.ts[r]
        for a in t.p.values():
            a[...] = -7.0  # junk: everything must come from zerod
        info = t.client.rejoin(int(self.bound * 2000))
        s = info.step
        self.resumed[r], self.progress[r], self.since[r] = s, s, 0
        self.rejoined[r] = time.monotonic()
        self.event(f"rank {r} resumed step {s} (resumed {info.resumed}) after {e.name}")
        if not info.resumed or s == 0 or s % self.every:
            self.note("beyond", f"rank {r} resumed step {s} (info.resumed {info.resumed}): not "
                      f"a snapshot's (every {self.every} steps)")
        why = differs(t.p, self.ref_at(s))
        if why:
            self.note("wrong", f"rank {r} resumed step {s}: {why}")
        return s

    def snapshots_written(self) -> bool:
        return all(os.path.exists(S.snap_path(self.state_dir, r, self.w)) for r in range(self.w))

    def writing(self) -> bool:
        """Whether some rank's snapshot file is being written: its .part exists and was written
        in the last 20 ms (a killed writer's .part stays until the next write)."""
        for r in range(self.w):
            try:
                st = os.stat(S.snap_path(self.state_dir, r, self.w) + ".part")
            except OSError:
                continue
            if time.time() - st.st_mtime < 0.02:
                return True
        return False

    def files(self) -> str:
        """Each rank's snapshot files and the steps they hold: "rank 0 {8, .prev 4}; ..."."""
        out = []
        for r in range(self.w):
            path = S.snap_path(self.state_dir, r, self.w)
            have = [f"{name}{header(path + sfx)[0]}"
                    for sfx, name in (("", ""), (".prev", ".prev ")) if os.path.exists(path + sfx)]
            if os.path.exists(path + ".part"):
                have.append(".part")
            out.append(f"rank {r} {{{', '.join(have)}}}")
        return "; ".join(out)

    def kill(self, v: int) -> None:
        self.daemons[v].keep_dir = True  # restart() decides
        common.stop_zerod(self.daemons[v], signal.SIGKILL)

    def restart(self, v: int) -> None:
        old = self.daemons[v]
        args = list(old.args)
        if self.w == 2 and v == 0 and "--control_address" not in args:
            args += ["--control_address", self.rendezvous]
        if self.w == 2 and v == 0 and os.path.exists(self.rendezvous[len("unix:"):]):
            os.unlink(self.rendezvous[len("unix:"):])
        d = zerod.testing.LocalZerod(args, log_level="info", start=False)
        d.socket = old.socket  # where the trainer's library connects again (zd_rejoin)
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
        log = old.log()
        if v == 0:
            self.skipped_gone += log.count(SKIP_LINE)
        if self.logs:
            self.gone = (self.gone + [f"---- killed zerod {v} (pid {old.pid}) ----\n{log}"])[-4:]
        self.event(f"restarted zerod {v}: pid {d.pid}")
        if old.dir not in keep:  # the killed one's log and control socket
            shutil.rmtree(old.dir, True)

    def event(self, what: str) -> None:
        if self.logs:
            now = time.time()
            line = time.strftime("%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d} "
            with self.lock:
                self.events = (self.events + [line + what])[-60:]

    def keep_logs(self, trial: int, kind: str) -> str:
        """Writes the zerods' logs (the live ones and the last ones killed) and the last trials'
        events to a file under --logs; returns its path."""
        os.makedirs(self.logs, exist_ok=True)
        path = os.path.join(self.logs, f"{kind}-W{self.w}-trial{trial}-{os.getpid()}.log")
        with open(path, "w") as f:
            f.write("---- events (UTC) ----\n" + "\n".join(self.events) + "\n")
            f.write(f"progress {self.progress}, since {self.since}, resumed {self.resumed}, "
                    f"in_step {self.in_step}\nsnapshot files (steps): {self.files()}; state_dir: "
                    f"{sorted(os.listdir(self.state_dir))}\n")
            for t in self.gone:
                f.write(t)
            for i, d in enumerate(self.daemons):
                f.write(f"---- zerod {i} (pid {d.pid}) ----\n{d.log()}")
        return path

    def wait(self, until, deadline: float) -> bool:
        while not until():
            if self.errors or time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def trial(self, rnd: random.Random, index: int) -> str:
        """Trial `index` (from 1): one kill and its recovery; "" when it recovered, else "hang" or
        "raised" (the run is then replaced)."""
        self.peak = max(self.progress)
        if not self.wait(lambda: min(self.since) >= 2 and self.snapshots_written(),
                         time.monotonic() + self.bound):
            return "raised" if self.errors else "hang"
        time.sleep(rnd.uniform(0.0, 0.05))
        if index % 2 == 0:  # aimed inside a step: once one began, 0-1 ms into it
            until = time.monotonic() + 10
            while not any(self.in_step) and time.monotonic() < until:
                time.sleep(0.0002)
            time.sleep(rnd.uniform(0.0, 0.001))
        elif index % 4 == 3:  # aimed at a snapshot's write: 0-2 ms after a step k*N finished
            until, base = time.monotonic() + 10, max(self.progress)
            while time.monotonic() < until and not (
                    max(self.progress) > base and max(self.progress) % self.every == 0):
                time.sleep(0.0002)
            time.sleep(rnd.uniform(0.0, 0.002))
        v = rnd.randrange(self.w)
        mid, writing = any(self.in_step), self.writing()
        low = min(self.progress)
        self.pending = True
        t0, k0 = time.monotonic(), int(time.time() * 1000)
        self.event(f"trial {index}: SIGKILL zerod {v} (pid {self.daemons[v].pid}), mid-step "
                   f"{mid}, writing {writing}, progress {self.progress}")
        self.kill(v)
        last = time.monotonic()  # the killed zerod is reaped: a step begun later is another's
        self.stats["trials"] += 1
        self.stats["mid_step"] += mid
        self.stats["in_write"] += writing
        if self.w == 2:
            survivor = self.daemons[1 - v]
            until = time.monotonic() + 30
            while common.rank_health(survivor.control_address) != "rejoining":
                if time.monotonic() > until:
                    h = common.rank_health(survivor.control_address)
                    self.note("heal_not_started", f"survivor {1 - v} stayed {h!r} 30 s after the "
                              f"kill; log tail: {survivor.log()[-600:]!r}")
                    break
                time.sleep(0.01)
        self.restart(v)
        if index % 5 == 0:  # again, at start: registrations, the files' read, the agreement
            time.sleep(rnd.uniform(0.0, 0.03))
            # the world may have resumed and trained on meanwhile: the last step every rank
            # finished since it registered again, if every rank did
            low = max(low, min(self.progress[r] if self.rejoined[r] > last else low
                               for r in range(self.w)))
            self.event(f"SIGKILL at start zerod {v} (pid {self.daemons[v].pid})")
            self.kill(v)
            last = time.monotonic()
            self.stats["kills_at_start"] += 1
            if self.w == 2:
                time.sleep(1.5)  # the survivor notices again
            self.restart(v)
        high = self.peak  # a step no rank finished before the last kill: the one in flight
        if not self.wait(lambda: all(b > last for b in self.done_began),
                         time.monotonic() + self.bound):
            return "raised" if self.errors else "hang"
        took = time.monotonic() - t0
        self.pending = False
        self.stats["recovery_s"].append(took)
        steps = set(self.resumed)
        stale = [r for r in range(self.w) if self.rejoined[r] < t0]
        self.event(f"recovered in {took:.3f} s at step(s) {sorted(steps)}, progress "
                   f"{self.progress}")
        if len(steps) > 1 or stale:
            self.note("split", f"trial {index}: the ranks resumed steps {self.resumed}" +
                      (f"; rank(s) {stale} trained on without registering again" if stale
                       else ""))
        s = min(steps)
        self.stats["lost"].append(low - s)
        self.check_timeline(index, s)
        self.rollbacks.append((k0, s))
        if s < low - self.every - self.stats["slack"]:
            self.note("beyond", f"trial {index}: resumed step {s}, {low - s} steps back from "
                      f"step {low} (every rank had finished it), more than "
                      f"{self.every} + {self.stats['slack']}")
        if s > high + 1:
            self.note("beyond", f"trial {index}: resumed step {s}, but no rank had finished a "
                      f"step after {high}")
        with self.lock:  # torch's steps that no rank may go back to
            keep = min(self.progress) - self.every - self.stats["slack"] - 1
            for k in [k for k in self.ref.seen if k < keep and k != max(self.ref.seen)]:
                del self.ref.seen[k]
        return ""

    def check_timeline(self, index: int, s: int) -> None:
        """Whether the ranks' snapshots of the resumed step s are of one timeline: no earlier
        recovery that went back below s came between the times they were taken. (The gradients
        here are the same on every timeline, so a mix is not seen in the parameters; a trainer
        whose batches after a rollback differ would get a model whose shards are of two runs.)"""
        if self.w == 1:
            return
        times = []
        for r in range(self.w):
            path = S.snap_path(self.state_dir, r, self.w)
            t = taken(path, s) or taken(path + ".prev", s)
            if not t:
                return  # rewritten since (the world trained on): not known
            times.append(t)
        lo, hi = min(times), max(times)
        between = [(k, r) for k, r in self.rollbacks if r < s and lo < k < hi]
        if between:
            self.note("mixed", f"trial {index}: resumed step {s} from snapshots taken at "
                      f"{times} (unix ms) on ranks 0..{self.w - 1}, with a rollback to step "
                      f"{between[0][1]} (kill at {between[0][0]}) between them")

    def state_bytes(self) -> int:
        """The allocated bytes of the snapshot files."""
        total = 0
        for f in os.listdir(self.state_dir):
            total += os.stat(os.path.join(self.state_dir, f)).st_blocks * 512
        return total

    def set_aside(self) -> List[str]:
        return sorted(f for f in os.listdir(self.state_dir) if ".bad-" in f)

    def skipped(self) -> int:
        return self.skipped_gone + self.daemons[0].log().count(SKIP_LINE)

    def close(self, clean: bool) -> None:
        self.pending = True  # a rejoin now is the stop's
        self.stop_at = -1 if not clean else max(self.progress) + 2
        for th in self.threads:
            th.join(self.bound if clean else 5)
        for t in self.ts:
            t.close()
        for d in self.daemons:
            d.stop(signal.SIGKILL, check=False)
        shutil.rmtree(self.top, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--world", default="1,2")
    ap.add_argument("--seed", default=None)
    ap.add_argument("--bound", type=float, default=60.0)
    ap.add_argument("--min-mid-step", type=int, default=0)
    ap.add_argument("--every", type=int, default=4, help="state_snapshot_every_steps (N)")
    ap.add_argument("--slack", type=int, default=None,
                    help="steps a resume may lose beyond N (default 2N: the snapshot being "
                    "written at the kill, and one skipped)")
    ap.add_argument("--logs", default="",
                    help="a directory where each failed trial's zerod logs are written")
    opts = ap.parse_args()
    seed = common.test_seed(opts.seed)
    print(f"seed {seed}: {common.repeat_command(seed)}", flush=True)
    rnd = random.Random(seed)
    slack = 2 * opts.every if opts.slack is None else opts.slack
    worlds = [int(w) for w in opts.world.split(",")]
    model_bytes = sum(int(np.prod(s)) for _, s in T.PARAMS) * 4 * 3  # master, m, v
    table = []
    failed, mid_total = False, 0
    for i, w in enumerate(worlds):
        n = opts.trials // len(worlds) + (i < opts.trials % len(worlds))
        # how often a kill lands inside a step depends on the machine's speed: a world runs
        # more trials (up to 4x) until its share of --min-mid-step kills landed inside a step
        want_mid = -(-opts.min_mid_step * n // max(opts.trials, 1))
        stats: Dict = {"trials": 0, "mid_step": 0, "in_write": 0, "kills_at_start": 0,
                       "wrong": 0, "beyond": 0, "split": 0, "mixed": 0, "raised": 0, "hangs": 0,
                       "unexpected": 0, "heal_not_started": 0, "set_aside": 0, "skipped": 0,
                       "slack": slack, "recovery_s": [], "lost": [], "notes": []}
        t_start = time.monotonic()
        run = Run(w, opts.every, stats, opts.bound, opts.logs)
        done = 0
        while done < n or (stats["mid_step"] < want_mid and done < 4 * n):
            before = {k: stats[k] for k in FAILURES}
            done += 1
            end = run.trial(rnd, done)
            new = [k for k in FAILURES if stats[k] > before[k]]
            if opts.logs and (end or new):
                path = run.keep_logs(done, end or new[0])
                stats["notes"].append(f"W={w} trial {done}: logs in {path}")
            if end:
                stats["raised" if end == "raised" else "hangs"] += 1
                stats["notes"].append(f"W={w} trial {done}: " + (
                    repr(run.errors[0]) if run.errors else
                    f"no rank trained again within {opts.bound:g} s ({run.progress})") +
                    f"; snapshot files (steps): {run.files()}")
                stats["skipped"] += run.skipped()
                stats["set_aside"] += len(run.set_aside())
                run.close(False)
                run = Run(w, opts.every, stats, opts.bound, opts.logs)  # from step 0
        state_bytes = run.state_bytes()
        aside = run.set_aside()
        stats["set_aside"] += len(aside)
        if aside:
            stats["notes"].append(f"W={w}: snapshot files set aside: {aside}")
        run.close(True)
        stats["skipped"] += run.skipped()
        if run.errors:
            stats["raised"] += 1
            stats["notes"].append(f"W={w} at the end: {run.errors[0]!r}")
        rec, lost = stats["recovery_s"], stats["lost"]
        wall = time.monotonic() - t_start
        table.append((w, stats, wall, state_bytes))
        for note in stats["notes"][:20]:
            print("   ", note)
        print(f"W={w}: {stats['trials']} trials ({wall:.0f} s), {stats['mid_step']} kills inside "
              f"a step, {stats['in_write']} while a snapshot was written, "
              f"{stats['kills_at_start']} again at start; wrong {stats['wrong']}, beyond "
              f"{stats['beyond']}, split {stats['split']}, mixed {stats['mixed']}, raised "
              f"{stats['raised']}, hangs {stats['hangs']}, unexpected {stats['unexpected']}, "
              f"heals not started {stats['heal_not_started']}, set aside {stats['set_aside']}; "
              f"steps lost median "
              f"{statistics.median(lost) if lost else float('nan'):g}, max "
              f"{max(lost) if lost else float('nan')} (bound {opts.every + slack}); "
              f"{stats['skipped']} snapshots skipped; SIGKILL to every rank training again: "
              f"median {statistics.median(rec) if rec else float('nan'):.3f} s, p95 "
              f"{common.percentile(rec, 0.95):.3f} s, "
              f"max {max(rec) if rec else float('nan'):.3f} s; "
              f"state_dir {state_bytes / 2**20:.2f} MiB (every rank's files) for "
              f"{model_bytes / 2**20:.2f} MiB of optimizer state (the model's, split across "
              f"{w} rank(s))", flush=True)
        failed |= any(stats[k] for k in FAILURES)
        mid_total += stats["mid_step"]
    print(f"\nstate_dir_mode = snapshot, every {opts.every} steps, seed {seed}; steps lost "
          f"allowed: {opts.every + slack}; rec: SIGKILL to every rank training again (s); MiB: the "
          f"state_dir (every rank's files) for {model_bytes / 2**20:.2f} MiB of optimizer state")
    head = ("W", "trials", "mid-step", "in-write", "again", "wrong", "beyond", "split", "mixed",
            "raised",
            "hangs", "aside", "lost-med", "lost-max", "skipped", "rec-med", "rec-p95", "rec-max",
            "MiB", "time-s")
    print("".join(f"{h:>9}" for h in head))
    for w, st, wall, sb in table:
        rec, lost = st["recovery_s"], st["lost"]
        row = (w, st["trials"], st["mid_step"], st["in_write"], st["kills_at_start"], st["wrong"],
               st["beyond"], st["split"], st["mixed"], st["raised"], st["hangs"], st["set_aside"],
               f"{statistics.median(lost):g}" if lost else "-", max(lost) if lost else "-",
               st["skipped"], f"{statistics.median(rec):.3f}" if rec else "-",
               f"{common.percentile(rec, 0.95):.3f}", f"{max(rec):.3f}" if rec else "-",
               f"{sb / 2**20:.2f}", f"{wall:.0f}")
        print("".join(f"{c:>9}" for c in row))
    if mid_total < opts.min_mid_step:
        print(f"only {mid_total} kills landed inside a step; at least {opts.min_mid_step} wanted")
        failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
