"""Fault trials: a trainer or a zerod of a W=2 world SIGKILLed at a random moment, then recovery
as a launcher and an operator would do it, and the result checked bit for bit (suite
fault_trials).

Each trial starts a world of two zerods of one rank each (zerod 0 holds global rank 0 and the
rendezvous store) with checkpoints every few steps, heartbeat_ms 100 and peer_timeout_ms 1000,
and two trainer processes (this file run with --driver: the Client API, no torch) that train
the deterministic steps of test_checkpoint.py: rank 0 sends step s's gradient, drawn from a
generator seeded with s, rank 1 zeros, summed (grad_mean=False), so the full model after every
step is known from one reference run at world size 1. At a random moment (during start-up and
registration, or after a random step plus a few milliseconds) one of trainer 0, trainer 1,
zerod 0 or zerod 1 (in turn) is SIGKILLed, and the trial recovers:
  - a killed trainer is started again: it reattaches to its rank and resumes at the step the
    rank holds; the other trainer retries a step that comes back ZD_EABORTED;
  - a killed zerod is started again at once (after a random delay of up to a second, as systemd
    would) with --resume latest, on the same socket and control address; the surviving zerod
    re-forms the world by itself; both trainers are stopped and started again (torchrun-style)
    and resume at the step their registration reports.
Both trainers then train to the last step and their parameters are compared with the reference
bit for bit. Counted per kill target: hangs (no trainer output and no exit for --bound seconds:
everything is killed and the next trial runs), wrong results (the parameters at a resume or at
the end differ from the reference), lost state (a zerod kill resumed below the newest complete
checkpoint, or at step 0 with one there; a trainer kill resumed below the last step it saw
complete), unrecovered (the trainers fail more than 3 times after the recovery: a launcher
would restart them forever), stalled checkpoints (the last checkpoint due is not complete 10 s after the end:
durability lost after the recovery), other failures (a trainer error that the recovery does not
explain, a zerod that does not exit cleanly within 12 s of SIGTERM at the end), and the recovery
time: from the kill to the first step trained after it, less the restart delay the trial chose.

A trial is effective when its kill landed while the run was in progress (from the start-up to
the last step): the killed trainer had not reported the last step, or, for a zerod, neither
trainer had, and the recovery had steps left to train. Otherwise (the trainers finished first,
or the kill landed after the last step) it is missed: it still fails on anything above, but a
run whose recoveries recovered nothing proves nothing, so the run fails when fewer than
--min-effective trials were effective (default: three quarters of them, rounded up).

    fault_trials.py [--trials N] [--seed S|random] [--only I] [--steps N] [--bound S]
                    [--min-effective N] [--zerod-restart-delay LO,HI] [--keep-failed]

The seed is $ZEROD_TEST_SEED, else 1, unless --seed names one; "random" draws one. It is
printed with the command line that repeats the run. CI runs 8 trials with the fixed seed
(tests/python/meson.build) and a zerod restarted only after its peers have declared it dead
(--zerod-restart-delay 1.5,2), which keeps the suite's outcome independent of timing. A zerod
restarted sooner (systemd's default RestartSec is 100 ms) recovers too (240 trials of seeds 42
and 44 at the default delays: 0 hangs, wrong results or lost state), except that a trainer
restarted while its zerod still ends the registration the killed trainer left in flight is
refused once with ZD_EBUSY (counted as "other"; its next start trains on). The long count is the
same program with --trials 100 or more, --seed random and the default delays (0..1 s), and the
table it prints ends the run. --only I runs trial I of the seed alone (the same choices), to
reproduce one. Exit status 1 when any trial failed or too few were effective.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

import common  # noqa: F401  (sets up sys.path and the library)

import numpy as np

import zerod.testing  # noqa: E402
from zerod import Client, ZerodError  # noqa: E402

PARAMS = [("ft.w", (37, 29)), ("ft.b", (29,)), ("ft.v", (300,)), ("ft.s", ())]
BUCKET = "512"  # several buckets: parameters straddle buckets and rank slices
INIT = 0.25
EVERY = 7  # checkpoint_every_steps
ZEROCTL = os.environ.get("ZEROCTL_BIN") or os.path.join(common.ROOT, "build", "client", "zeroctl")
TARGETS = ["trainer 0", "trainer 1", "zerod 0", "zerod 1"]
ZEROD_ARGS = ["--bucket_elems", BUCKET, "--checkpoint_every_steps", str(EVERY),
              "--checkpoint_keep", "3", "--heartbeat_ms", "100", "--peer_timeout_ms", "1000"]


def step_grads(step: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in PARAMS}


def digest(params: Dict[str, np.ndarray]) -> str:
    h = hashlib.sha1()
    for name, _ in PARAMS:
        h.update(np.ascontiguousarray(params[name]).tobytes())
    return h.hexdigest()


class Model:
    """One rank's client with numpy views of each parameter in the shared buffers."""

    def __init__(self, socket: str, local_rank: int, rank: int) -> None:
        self.rank = rank
        self.client = Client(socket, local_rank)
        self.client.layout([(n, s) for n, s in PARAMS], grad_mean=False)
        params = np.frombuffer(self.client.param_buffer, dtype=np.float32)
        grads = np.frombuffer(self.client.grad_buffer, dtype=np.float32)
        self.p: Dict[str, np.ndarray] = {}
        self.g: Dict[str, np.ndarray] = {}
        for i, (name, shape) in enumerate(PARAMS):
            info = self.client.param_info(i)
            self.p[name] = params[info.offset:info.offset + info.numel].reshape(shape)
            self.g[name] = grads[info.offset:info.offset + info.numel].reshape(shape)
            self.p[name][...] = INIT
        self.info = self.client.register()

    def snapshot(self) -> Dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.p.items()}

    def set_grads(self, s: int) -> None:
        grads = step_grads(s) if self.rank == 0 else None
        for name, _ in PARAMS:
            self.g[name][...] = grads[name] if grads is not None else 0.0


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def driver(args: argparse.Namespace) -> None:
    """A trainer process: register (fresh or resumed), step to --steps, retrying a step that
    another trainer's death aborted; every event one JSON line on stdout; the final parameters
    in --out. Exit 3 on any other error (the launcher decides what to do)."""
    try:
        m = Model(args.socket, 0, args.rank)
        emit(ev="registered", step=m.info.step, resumed=m.info.resumed,
             digest=digest(m.snapshot()))
        for s in range(m.info.step + 1, args.steps + 1):
            retries = 0
            while True:
                m.set_grads(s)
                try:
                    m.client.step()
                    break
                except ZerodError as e:
                    if not e.retryable or retries >= 20:
                        raise
                    retries += 1
                    emit(ev="retry", step=s, message=e.message)
            emit(ev="step", step=s, digest=digest(m.snapshot()))
        np.savez(args.out, **m.snapshot())
        m.client.close()
        emit(ev="done")
    except ZerodError as e:
        emit(ev="error", code=e.name, message=e.message)
        sys.exit(3)


def reference(steps: int) -> Dict[int, Dict[str, np.ndarray]]:
    """The model after each step 0..steps of an uninterrupted run at world size 1."""
    with zerod.testing.LocalZerod(["--bucket_elems", BUCKET], log_level="warn") as d:
        m = Model(d.socket, 0, 0)
        ref = {0: m.snapshot()}
        for s in range(1, steps + 1):
            m.set_grads(s)
            m.client.step()
            ref[s] = m.snapshot()
        m.client.close()
    return ref


def complete_checkpoints(root: str) -> List[int]:
    out = []
    for d in os.listdir(root):
        if d.startswith("step-") and os.path.exists(os.path.join(root, d, "manifest.json")):
            out.append(int(d[5:]))
    return sorted(out)


class Hang(Exception):
    pass


class Unrecovered(Exception):
    pass


class Trial:
    def __init__(self, i: int, seed: int, ref: Dict[int, Dict[str, np.ndarray]],
                 ref_digest: Dict[int, str], steps: int, bound: float, tmp: str,
                 zerod_delay: tuple) -> None:
        self.i = i
        self.rng = random.Random(seed * 1000003 + i)
        self.ref, self.ref_digest, self.steps, self.bound = ref, ref_digest, steps, bound
        self.tmp = tmp
        self.ckpt = os.path.join(tmp, "ckpt")
        os.mkdir(self.ckpt)
        self.target = TARGETS[i % len(TARGETS)]
        # when: during start-up (1 in 8), else after a random step plus up to 5 ms
        if self.rng.random() < 0.125:
            self.kill_step, self.kill_delay = 0, self.rng.uniform(0.0, 1.5)
        else:
            self.kill_step = self.rng.randint(1, int(steps * 0.7))
            self.kill_delay = self.rng.uniform(0.0, 0.005)
        self.restart_delay = (self.rng.uniform(*zerod_delay) if self.target.startswith("zerod")
                              else self.rng.uniform(0.0, 0.3))
        self.outcome = "ok"  # ok | hang | wrong | lost | unrecovered | stalled | other
        self.effective = True  # the kill landed while the run was in progress (missed: False)
        self.notes: List[str] = []
        self.recovery_s: Optional[float] = None
        self.world: Optional[zerod.testing.LocalWorld] = None
        self.procs: List[Optional[subprocess.Popen]] = [None, None]
        self.gen = [0, 0]
        self.exited: set = set()  # (trainer, run) whose exit was seen
        self.last_error = ["", ""]  # each trainer's last error event
        self.events: "queue.Queue[tuple]" = queue.Queue()
        self.last_step = [0, 0]  # the last step each trainer reported complete
        self.finished: set = set()  # (trainer, run) that reported the last step or done
        self.done: set = set()  # (trainer, run) that reported done
        self.restarts = 0
        self.zerod_restarts = 0

    # ---- outcomes ------------------------------------------------------------------------------

    def fail(self, outcome: str, note: str) -> None:
        rank = ["ok", "other", "stalled", "unrecovered", "lost", "wrong", "hang"]
        if rank.index(outcome) > rank.index(self.outcome):
            self.outcome = outcome
        self.notes.append(f"{outcome}: {note}")

    def missed(self, why: str) -> None:
        """The kill landed when the run was over: the trial is not effective."""
        if self.effective:
            self.effective = False
            self.notes.append(f"missed: {why}")

    # ---- trainers ------------------------------------------------------------------------------

    def spawn(self, r: int) -> None:
        assert self.world is not None
        sock, _ = self.world.endpoint(r)
        self.gen[r] += 1
        gen = self.gen[r]
        err = open(os.path.join(self.tmp, f"trainer{r}.{gen}.err"), "wb")
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--driver", "--socket",
                              sock, "--rank", str(r), "--steps", str(self.steps), "--out",
                              os.path.join(self.tmp, f"final{r}.npz")],
                             stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                             text=True)
        err.close()
        self.procs[r] = p

        def read() -> None:
            assert p.stdout is not None
            for line in p.stdout:
                try:
                    self.events.put((time.monotonic(), r, gen, json.loads(line)))
                except ValueError:
                    self.events.put((time.monotonic(), r, gen, {"ev": "junk", "line": line}))
            self.events.put((time.monotonic(), r, gen, {"ev": "exit", "rc": p.wait()}))

        threading.Thread(target=read, daemon=True).start()

    def next_event(self) -> tuple:
        """The next trainer event; Hang when there is none for --bound seconds."""
        try:
            return self.events.get(timeout=self.bound)
        except queue.Empty:
            raise Hang(f"no trainer event for {self.bound:.0f} s (last steps "
                       f"{self.last_step}, {self.target} killed after step {self.kill_step})")

    def kill_trainer(self, r: int) -> None:
        p = self.procs[r]
        if p is not None and p.poll() is None:
            p.kill()

    def wait_exit(self, r: int) -> None:
        """Consumes events up to the exit of trainer r's current generation."""
        while True:
            _, rr, gen, ev = self.next_event()
            self.note_event(rr, gen, ev)
            if (r, self.gen[r]) in self.exited:
                return

    def note_event(self, r: int, gen: int, ev: dict) -> None:
        if ev["ev"] == "exit":
            self.exited.add((r, gen))
        if ev["ev"] == "error":
            self.last_error[r] = f"{ev['code']}: {ev['message']}"
        if gen != self.gen[r]:
            return
        if ev["ev"] == "done":
            self.done.add((r, gen))
        if ev["ev"] == "done" or (ev["ev"] == "step" and ev["step"] == self.steps):
            self.finished.add((r, gen))
        if ev["ev"] == "step":
            self.last_step[r] = ev["step"]
            if ev["digest"] != self.ref_digest[ev["step"]]:
                self.fail("wrong", f"trainer {r} (run {gen}): the model after step {ev['step']} "
                          f"differs from the reference")
                self.ref_digest[ev["step"]] = ev["digest"]  # report each step once

    # ---- zerods --------------------------------------------------------------------------------

    def restart_zerod(self, i: int) -> None:
        """The killed zerod i again, with --resume latest, on its socket and control address
        (the other zerod's rendezvous address and the trainers' endpoints stay valid)."""
        assert self.world is not None
        old = self.world.daemons[i]
        self.zerod_restarts += 1
        new = zerod.testing.LocalZerod(old.args + ["--resume", "latest"], log_level="info",
                                       start=False, timeout=30.0, keep_dir=True)
        shutil.rmtree(new.dir, ignore_errors=True)
        new.dir, new.socket, new.control_address = old.dir, old.socket, old.control_address
        new.log_path = os.path.join(old.dir, f"zerod.restart{self.zerod_restarts}.log")
        self.world.daemons[i] = new
        new.start()

    # ---- one trial -----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self.world = zerod.testing.LocalWorld(
                2, daemons=2, args=ZEROD_ARGS + ["--checkpoint_dir", self.ckpt],
                log_level="info", timeout=30.0, keep_dir=True)
            for r in range(2):
                self.spawn(r)
            if self.train_until_kill() and self.recover():
                self.finish()
        except Hang as e:
            self.fail("hang", str(e))
        except Unrecovered as e:
            self.fail("unrecovered", str(e))
        except Exception as e:  # a launcher step that failed: a zerod that did not start ...
            self.fail("other", f"{type(e).__name__}: {e}")
        finally:
            self.stop()

    def train_until_kill(self) -> bool:
        """Trains until the kill and kills; False when the trainers finished first (missed)."""
        t0 = time.monotonic()
        while True:
            if self.kill_step == 0:
                left = t0 + self.kill_delay - time.monotonic()
                if left <= 0:
                    break
                try:
                    _, r, gen, ev = self.events.get(timeout=left)
                except queue.Empty:
                    break
            else:
                _, r, gen, ev = self.next_event()
            self.note_event(r, gen, ev)
            if ev["ev"] == "exit":
                if ev["rc"] == 0:
                    self.missed("the trainers finished before the kill")
                    return False
                raise RuntimeError(f"trainer {r} exited with {ev['rc']} before any kill: "
                                   f"{self.last_error[r] or self.err(r)}")
            if self.kill_step and ev["ev"] == "step" and ev["step"] >= self.kill_step:
                time.sleep(self.kill_delay)
                break
        self.kill_at_step = max(self.last_step)
        self.complete_at_kill = complete_checkpoints(self.ckpt)
        self.t_kill = time.monotonic()
        self.killed_gen = list(self.gen)
        assert self.world is not None
        if self.target.startswith("trainer"):
            r = int(self.target[-1])
            if self.procs[r].poll() is not None:
                self.missed(f"trainer {r} had exited before the kill")
                return False
            self.kill_trainer(r)
        else:
            i = int(self.target[-1])
            try:  # SIGKILL on purpose: any other end (it crashed before) is a failure
                common.stop_zerod(self.world.daemons[i], signal.SIGKILL)
            except AssertionError as e:
                self.fail("other", f"zerod {i}: {str(e).splitlines()[0]}")
        return True

    def err(self, r: int) -> str:
        path = os.path.join(self.tmp, f"trainer{r}.{self.gen[r]}.err")
        try:
            with open(path, errors="replace") as f:
                lines = [l for l in f.read().splitlines() if l.strip()]
            return lines[-1] if lines else "(no stderr)"
        except OSError:
            return "(no stderr)"

    def recover(self) -> bool:
        """Restarts what was killed as a launcher would; False when there is nothing to recover
        (a trainer killed after the run's last step: its peer has left, and a restarted
        trainer's registration would wait for it forever)."""
        if self.target.startswith("trainer"):
            r = int(self.target[-1])
            self.wait_exit(r)
            if any((q, self.killed_gen[q]) in self.finished for q in range(2)):
                self.missed(f"the last step was reported when the kill of trainer {r} landed")
                return False
            time.sleep(self.restart_delay)
            self.victim_saw = self.last_step[r]
            self.spawn(r)
            self.restarted = [r]
        else:
            i = int(self.target[-1])
            time.sleep(self.restart_delay)  # systemd's RestartSec
            self.restart_zerod(i)
            # the launcher sees a trainer fail, stops the other, starts both again
            while not self.exited:
                self.note_event(*self.next_event()[1:])
            for r in range(2):
                self.kill_trainer(r)
            for r in range(2):
                if (r, self.gen[r]) not in self.exited:
                    self.wait_exit(r)
            if any((r, self.killed_gen[r]) in self.finished for r in range(2)):
                self.missed("a trainer had reported the last step when the kill landed")
            self.complete_at_restart = complete_checkpoints(self.ckpt)
            for r in range(2):
                self.spawn(r)
            self.restarted = [0, 1]
        return True

    def finish(self) -> None:
        """Events until both trainers are done: the resume checked, the recovery timed, a
        trainer that fails again started again (other) up to 3 times."""
        # a survivor may have finished already (a kill that landed after the last step)
        done = [(r, self.gen[r]) in self.done for r in range(2)]
        registered: Dict[int, dict] = {}
        while not all(done):
            t, r, gen, ev = self.next_event()
            self.note_event(r, gen, ev)
            if gen != self.gen[r]:
                continue
            kind = ev["ev"]
            if kind == "registered" and r in self.restarted and r not in registered:
                registered[r] = ev
                self.check_resume(r, ev)
            elif kind == "step" and self.recovery_s is None and r in self.restarted:
                self.recovery_s = t - self.t_kill - self.restart_delay
            elif kind == "done":
                done[r] = True
            elif kind == "error":
                self.fail("other", f"trainer {r} (run {gen}) after the recovery: {ev['code']}: "
                          f"{ev['message']}")
            elif kind == "exit" and ev["rc"] != 0:
                if ev["rc"] != 3:
                    self.fail("other", f"trainer {r} (run {gen}) exited with {ev['rc']}: "
                              f"{self.err(r)}")
                self.restarts += 1
                if self.restarts > 3:
                    raise Unrecovered("the trainers keep failing after the recovery")
                self.spawn(r)
        # checkpoints go on after the recovery: the last one due is complete soon after the end
        due = self.steps // EVERY * EVERY
        deadline = time.monotonic() + 10.0 * common.HANG_SCALE
        while max(complete_checkpoints(self.ckpt), default=0) < due:
            if time.monotonic() > deadline:
                self.fail("stalled", f"no checkpoint completes after the recovery: the newest "
                          f"complete one is step {max(complete_checkpoints(self.ckpt), default=0)}"
                          f", step {due} was due")
                break
            time.sleep(0.05)
        for r in range(2):
            got = dict(np.load(os.path.join(self.tmp, f"final{r}.npz")))
            for name, _ in PARAMS:
                g = got[name].view(np.uint32).ravel()
                w = self.ref[self.steps][name].view(np.uint32).ravel()
                diff = np.flatnonzero(g != w)
                if diff.size:
                    self.fail("wrong", f"trainer {r}: {name} differs from the reference at step "
                              f"{self.steps} in {diff.size} elements (first {diff[:4].tolist()})")
                    break

    def check_resume(self, r: int, ev: dict) -> None:
        step = ev["step"]
        if step == self.steps:
            self.missed(f"trainer {r} resumed at the last step: the recovery had nothing to train")
        if ev["digest"] != self.ref_digest[step]:
            self.fail("wrong", f"trainer {r} resumed at step {step} with parameters that differ "
                      f"from the reference's at that step")
        if self.target.startswith("trainer"):
            # the rank holds the step in flight applied or not: never less than the last seen
            if step < self.victim_saw or (self.victim_saw > 0 and not ev["resumed"]):
                self.fail("lost", f"trainer {r} resumed at step {step} (resumed={ev['resumed']})"
                          f" after it had seen step {self.victim_saw} complete")
        else:
            newest = max(self.complete_at_kill, default=0)
            newest_now = max(self.complete_at_restart, default=0)
            if step < newest or (newest and not ev["resumed"]):
                self.fail("lost", f"trainer {r} resumed at step {step} (resumed={ev['resumed']}); "
                          f"the newest complete checkpoint at the kill was step {newest}")
            elif step != newest_now:
                self.fail("other", f"trainer {r} resumed at step {step}, not at the newest "
                          f"complete checkpoint (step {newest_now})")
        self.resume_step = step

    def stop(self) -> None:
        for r in range(2):
            self.kill_trainer(r)
        for p in self.procs:
            if p is not None:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        if self.world is None:
            return
        if self.outcome in ("hang",):
            for i, d in enumerate(self.world.daemons):  # what each rank waits for, for the report
                try:
                    out = subprocess.run([ZEROCTL, "--address", d.control_address, "status"],
                                         capture_output=True, text=True, timeout=10)
                    text = out.stdout + out.stderr
                except (OSError, subprocess.TimeoutExpired) as e:
                    text = str(e)
                with open(os.path.join(self.tmp, f"zeroctl{i}.err"), "w") as f:
                    f.write(text)
            self.world.stop(signal.SIGKILL, check=False)
        else:
            for i, d in enumerate(self.world.daemons):
                try:  # exit 0, whatever the trial's outcome
                    common.stop_zerod(d, signal.SIGTERM, timeout=12.0)
                except (AssertionError, zerod.testing.ZerodProcessError) as e:
                    self.fail("other", f"zerod {i} at the end: {str(e).splitlines()[0]}: "
                              f"{d.last_log_line()}")

    def keep_logs(self, where: str) -> None:
        """The daemons' logs and the trainers' stderr into `where`."""
        os.makedirs(where, exist_ok=True)
        if self.world is not None:
            for i, d in enumerate(self.world.daemons):
                for f in os.listdir(d.dir) if os.path.isdir(d.dir) else []:
                    if f.endswith(".log"):
                        shutil.copy(os.path.join(d.dir, f), os.path.join(where, f"zerod{i}.{f}"))
        for f in os.listdir(self.tmp):
            if f.endswith(".err"):
                shutil.copy(os.path.join(self.tmp, f), where)

    def cleanup(self) -> None:
        if self.world is not None:
            for d in self.world.daemons:
                shutil.rmtree(d.dir, ignore_errors=True)

    def line(self) -> str:
        when = (f"after step {self.kill_step} + {self.kill_delay * 1000:.1f} ms"
                if self.kill_step else f"{self.kill_delay:.2f} s after the start")
        at = getattr(self, "kill_at_step", None)
        rec = f"{self.recovery_s:.2f} s" if self.recovery_s is not None else "-"
        resume = getattr(self, "resume_step", None)
        return (f"trial {self.i:4d}: kill {self.target} {when} (steps seen {at}), resumed at "
                f"{resume}, recovery {rec}: {self.outcome}"
                f"{'' if self.effective else ' (missed)'}")


def table(trials: List[Trial]) -> str:
    head = ("target", "trials", "effective", "missed", "hangs", "wrong", "lost", "unrecovered",
            "ckpt stalled", "other", "ok", "recovery median s", "max s")
    rows = []
    for target in TARGETS + ["all"]:
        ts = [t for t in trials if target in ("all", t.target)]
        rec = [t.recovery_s for t in ts
               if t.recovery_s is not None and t.outcome == "ok" and t.effective]
        count = lambda o: sum(1 for t in ts if t.outcome == o)  # noqa: E731
        effective = sum(1 for t in ts if t.effective)
        rows.append((target, len(ts), effective, len(ts) - effective, count("hang"),
                     count("wrong"), count("lost"), count("unrecovered"), count("stalled"),
                     count("other"), count("ok"),
                     f"{statistics.median(rec):.2f}" if rec else "-",
                     f"{max(rec):.2f}" if rec else "-"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda row: "  ".join(f"{str(x):>{w}}" if k else f"{str(x):<{w}}"  # noqa: E731
                                for k, (x, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(head)] + [fmt(r) for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--seed", default=None,
                    help="an integer, or random; default $ZEROD_TEST_SEED, else 1 (printed)")
    ap.add_argument("--min-effective", type=int, default=None,
                    help="fail when fewer trials were effective (default: 3/4 of them)")
    ap.add_argument("--only", type=int, default=None, help="run trial I of the seed alone")
    ap.add_argument("--steps", type=int, default=100, help="the last step of every trial")
    ap.add_argument("--bound", type=float, default=60.0,
                    help="seconds without any trainer event that count as a hang")
    ap.add_argument("--zerod-restart-delay", default="0,1", metavar="LO,HI",
                    help="a killed zerod is restarted after a delay drawn from LO..HI seconds")
    ap.add_argument("--keep-failed", action="store_true",
                    help="keep the logs of a failed trial (path printed)")
    # the trainer process
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.driver:
        driver(args)
        return
    seed = common.test_seed(args.seed)
    zerod_delay = tuple(float(x) for x in args.zerod_restart_delay.split(","))
    which = [args.only] if args.only is not None else list(range(args.trials))
    min_effective = (args.min_effective if args.min_effective is not None
                     else (3 * len(which) + 3) // 4)
    print(f"fault trials: {len(which)} trials of {args.steps} steps, seed {seed}, at least "
          f"{min_effective} effective; repeat with: {common.repeat_command(seed)}", flush=True)
    t0 = time.monotonic()
    ref = reference(args.steps)
    trials: List[Trial] = []
    for i in which:
        tmp = tempfile.mkdtemp(prefix="zerod-fault-")
        ref_digest = {s: digest(p) for s, p in ref.items()}
        trial = Trial(i, seed, ref, ref_digest, args.steps, args.bound, tmp, zerod_delay)
        trial.run()
        trials.append(trial)
        print(trial.line(), flush=True)
        for n in trial.notes:
            print(f"    {n}", flush=True)
        if trial.outcome not in ("ok", "missed") and args.keep_failed:
            trial.keep_logs(os.path.join(tmp, "logs"))
            print(f"    kept {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        trial.cleanup()
    print(table(trials), flush=True)
    print(f"{time.monotonic() - t0:.1f} s", flush=True)
    failed = sum(1 for t in trials if t.outcome != "ok")
    effective = sum(1 for t in trials if t.effective)
    print(f"{len(trials)} trials: {effective} effective (at least {min_effective} needed), "
          f"{len(trials) - effective} missed, {failed} failed; seed {seed}", flush=True)
    if effective < min_effective:
        print(f"FAIL: only {effective} of {len(trials)} kills landed while the run was in "
              f"progress; the minimum is {min_effective}", flush=True)
    sys.exit(0 if failed == 0 and effective >= min_effective else 1)


if __name__ == "__main__":
    main()
