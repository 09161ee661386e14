"""Fault trials for buddy copies (issue 30 item 4): nodes lost with their memory at W=2, every
recovery checked bit for bit against torch.

Two zerods on this machine, one rank each, each its own state_dir (its "node's memory", on tmpfs)
and failure domain (a, b), buddy copies every --every steps, throttled so that a copy is in
flight for a while (--bandwidth), checkpoints every --checkpoint-every steps (0: none). The
trainers (this process, a thread per rank) step the deterministic gradients of test_state_dir.py;
each trial trains 1..2N steps, waits a random moment (up to a copy's time: copies in flight are
hit) and then, by turns:

  node      a random zerod is SIGKILLed, its state_dir wiped (the node lost with its memory) and
            it is started again, empty, once the survivor is re-forming the world. Wanted: both
            ranks resume from the buddy copies (status last_recovery "buddy copy", no storage
            read) at a copied step bitwise equal to torch's at that step, no older than the lost
            rank's last copy complete before the kill; steps lost = the step in flight at the
            kill minus the resumed step.
  mid_copy  the buddy of a random rank is SIGKILLed (state_dir kept: a zerod death) while copies
            are in flight, and restarted: the world continues from the state files at the step
            it had (no rollback), and the copy it holds in its state_dir is a complete one (its
            header's step a copied step, its data's XXH3 the header's, no ".part" left). Then the
            other node is lost with its memory, before any new copy: it resumes from the copy the
            restarted buddy serves from its state_dir only where the buddy's own state can go
            back to that step, else (the buddy restarted: its snapshots are gone) the world says
            why and falls back: never a partial copy taken as complete.
  both      both zerods SIGKILLed and both state_dirs wiped (two nodes lost at once, both copies
            gone): the world falls back to the newest checkpoint, bitwise, with the reason in
            status (last_recovery_note: "neither a state file nor a buddy copy"); without
            checkpoints the registrations resume nothing and the note says so (the world is then
            started afresh).

Counted: trials per case, recovered (from the buddy copies), fallbacks (checkpoint, or nothing,
with the reason), wrong (any parameter not torch's at the step the registration reports, a
damaged copy served or kept, a rollback where none was due), hangs (no registration within
--bound s: the world is replaced), steps lost per node loss (max, and against the copy
interval), kills that landed while a copy was in flight, and the time from the SIGKILL to both
registrations done (median, p95; it includes zerod's start and the survivor's peer timeout).

    buddy_fault_trials.py [--trials N] [--seed S|random] [--every N] [--bandwidth B]
                          [--checkpoint-every C] [--bound S] [--min-cases K]

Exit status 1 when any trial was wrong or hung, a node trial fell back, or fewer than --min-cases
trials of each case ran.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
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
from typing import Dict, List, Optional

import common  # sets up sys.path and the library first

import numpy as np

import zerod  # noqa: E402
import zerod.testing  # noqa: E402

import test_state_dir as T  # noqa: E402  (the model, its gradients and torch's reference)

CASES = ["node", "mid_copy", "node", "both"]

try:
    _XXH = ctypes.CDLL("libxxhash.so.0")
    _XXH.XXH3_64bits.restype = ctypes.c_uint64
    _XXH.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
except OSError:  # the data's checksum is then not checked here (zerod's reader checks it)
    _XXH = None

# daemon/step/buddy.c's file_hdr_t: magic, version, rank, world_size, states, layout_hash, step,
# steps_skipped, shard_elems, bytes, scaler_enabled, growth, hysteresis, pad, scale,
# taken_unix_ms, checksum, complete_unix_ms, from[256], hdr_sum
HDR = struct.Struct("<QIIIIQQQQQIIIIdQQQ256sQ")
HDR_BYTES = 4096


def run_all(fns: List, bound: float):
    """Runs every fn at once; (results, first error or None, hung)."""
    out: list = [None] * len(fns)
    errors: list = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001  (returned)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + bound
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = any(t.is_alive() for t in threads)
    return out, (errors[0] if errors else None), hung


def held_copy(state_dir: str, rank: int) -> Optional[dict]:
    """The copy of `rank` kept in state_dir (its header), checked: None when there is none;
    raises AssertionError when it is damaged."""
    path = os.path.join(state_dir, f"buddy-rank{rank}-of-2.zdbuddy")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as fh:
        raw = fh.read()
    f = HDR.unpack_from(raw, 0)
    hdr = {"magic": f[0], "version": f[1], "rank": f[2], "step": f[6], "bytes": f[9],
           "checksum": f[16]}
    assert hdr["magic"] == 0x3159444455424458, f"{path}: magic {hdr['magic']:#x}"
    assert len(raw) == HDR_BYTES + hdr["bytes"], f"{path}: {len(raw)} bytes for {hdr['bytes']}"
    assert os.stat(path).st_mode & 0o777 == 0o600, f"{path}: mode {os.stat(path).st_mode:o}"
    if _XXH is not None:
        got = _XXH.XXH3_64bits(raw[HDR_BYTES:], hdr["bytes"])
        assert got == hdr["checksum"], f"{path}: data XXH3 {got:#x}, header {hdr['checksum']:#x}"
    return hdr


class World:
    """Two zerods, each with its own state_dir and failure domain, at fixed addresses (a zerod
    started again takes its predecessor's), and a trainer per rank."""

    def __init__(self, top: str, opts) -> None:
        self.top, self.opts = top, opts
        self.nodes = [os.path.join(top, f"n{r}") for r in range(2)]
        for n in self.nodes:
            os.makedirs(n, 0o700, exist_ok=True)
        self.ckpt = os.path.join(top, "ckpt")
        os.makedirs(self.ckpt, 0o700, exist_ok=True)
        self.daemons: List[Optional[zerod.testing.LocalZerod]] = [None, None]
        self.rendezvous = "unix:" + os.path.join(self.nodes[0], "control.sock")
        self.ts: List = []
        self.step = 0
        for r in range(2):
            self.spawn(r)
        for r in range(2):
            self.daemons[r].wait_ready()

    def state_dir(self, r: int) -> str:
        return os.path.join(self.nodes[r], "state")

    def args(self, r: int) -> List[str]:
        a = ["--world_size", "2", "--first_rank", str(r), "--local_ranks", "1",
             "--rendezvous_address", self.rendezvous,
             "--control_address", "unix:" + os.path.join(self.nodes[r], "control.sock"),
             "--state_dir", self.state_dir(r), "--bucket_elems", T.BUCKET,
             "--buddy_copy_every_steps", str(self.opts.every), "--failure_domain", "ab"[r],
             "--buddy_bandwidth_bytes_per_s", str(self.opts.bandwidth),
             "--heartbeat_ms", "100", "--peer_timeout_ms", "1000"]
        if self.opts.checkpoint_every:
            a += ["--checkpoint_dir", self.ckpt, "--checkpoint_every_steps",
                  str(self.opts.checkpoint_every), "--checkpoint_keep", "3", "--resume",
                  "latest"]
        return a

    def spawn(self, r: int) -> None:
        old = self.daemons[r]
        d = zerod.testing.LocalZerod(self.args(r), log_level="info", start=False)
        d.socket = os.path.join(self.nodes[r], "zerod.sock")
        d.control_address = "unix:" + os.path.join(self.nodes[r], "control.sock")
        for p in (d.socket, d.control_address[len("unix:"):]):
            if os.path.exists(p):
                os.unlink(p)
        d.spawn()
        self.daemons[r] = d
        if old is not None:
            shutil.rmtree(old.dir, True)  # its log

    def connect(self, rank: int):
        return zerod.Client(self.daemons[rank].socket, 0, 0)

    def kill(self, r: int) -> None:
        common.stop_zerod(self.daemons[r], signal.SIGKILL)

    def wipe(self, r: int) -> None:
        shutil.rmtree(self.state_dir(r), True)

    def close_trainers(self) -> None:
        for t in self.ts:
            t.close()
        self.ts = []

    def register(self, init, bound: float):
        """Both trainers register; (infos, error, hung)."""
        ts, err, hung = run_all([lambda r=r: T.Trainer(self, init, r, register=False)
                                 for r in range(2)], bound)
        if err or hung:
            return None, err, hung
        self.ts = ts
        infos, err, hung = run_all([lambda t=t: t.client.register() for t in ts], bound)
        if infos and not (err or hung):
            for t, info in zip(ts, infos):
                t.info = info
        return infos, err, hung

    def status(self, r: int) -> dict:
        return self.ts[r].client.status_dict()

    def stop(self) -> None:
        for d in self.daemons:  # first: a registration that hung then ends, and its client closes
            if d is not None:
                d.stop(signal.SIGKILL, check=False)
                shutil.rmtree(d.dir, True)
        for t in self.ts:
            try:
                t.close()
            except Exception:  # noqa: BLE001  (a dead zerod's client)
                pass
        self.ts = []


class Trials:
    def __init__(self, opts, rnd: random.Random) -> None:
        self.opts, self.rnd = opts, rnd
        self.ref = T.Reference()
        self.stats: Dict = {"trials": {c: 0 for c in set(CASES)}, "recovered": 0, "fallback": 0,
                            "nothing": 0, "wrong": 0, "hangs": 0, "in_flight": 0,
                            "continued": 0, "outcomes": {}, "lost": [], "lost_settled": 0, "heal_not_started": 0, "recovery_s": [], "notes": []}
        self.top = tempfile.mkdtemp(prefix="zerod-buddy-trials-", dir=T.tmpfs_root())
        self.world: Optional[World] = None

    # ---- helpers ---------------------------------------------------------------------------

    def note(self, what: str) -> None:
        self.stats["notes"].append(what)

    def outcome(self, case: str, what: str) -> None:
        key = f"{case} {what}"
        self.stats["outcomes"][key] = self.stats["outcomes"].get(key, 0) + 1

    def same(self, step: int) -> Optional[str]:
        """None when both trainers' parameters are torch's after `step`, else what differs."""
        want = self.ref.at(step)
        for t in self.world.ts:
            got = t.snapshot()
            for n, _ in T.PARAMS:
                if not np.array_equal(got[n].view(np.uint32), want[n].view(np.uint32)):
                    return f"rank {t.rank}'s {n} is not torch's at step {step}"
        return None

    def fresh(self) -> None:
        """A new world from step 0 (the first, and after a hang or an unrecoverable loss)."""
        if self.world is not None:
            self.world.stop()
        shutil.rmtree(self.top, True)
        os.makedirs(self.top, 0o700)
        self.world = World(self.top, self.opts)
        infos, err, hung = self.world.register(T.init_values(), self.opts.bound)
        if err or hung:
            raise RuntimeError(f"a fresh world does not register: {err!r} hung={hung}")
        self.world.step = 0
        if not self.settle():
            raise RuntimeError("a fresh world does not train or copy")

    def settle(self) -> bool:
        """Trains to the next copy step and waits for its copies (after a fresh start or a
        fallback, whose zerods hold no copies): a node loss then has a copy to come back to."""
        k = self.opts.every
        if not self.train(k - self.world.step % k):
            return False
        deadline = time.monotonic() + self.opts.bound
        while min(self.copy_step(r) for r in range(2)) < self.world.step:
            if time.monotonic() > deadline:
                self.stats["hangs"] += 1
                self.note(f"the copies of step {self.world.step} do not complete")
                return False
            time.sleep(0.01)
        return True

    def train(self, n: int) -> bool:
        """n steps on both ranks; False on an error or a hang (counted)."""
        w = self.world
        for _ in range(n):
            s = w.step + 1
            _, err, hung = run_all([lambda t=t: t.step(s) for t in w.ts], self.opts.bound)
            if err or hung:
                self.stats["hangs" if hung else "wrong"] += 1
                self.note(f"step {s}: {'hung' if hung else repr(err)}")
                return False
            w.step = s
        return True

    def copy_step(self, r: int) -> int:
        v = self.world.status(r)["buddy"].get(f"rank{r}_copy_step", "none")
        return int(v) if v != "none" else 0

    def wait_rejoining(self, r: int) -> None:
        """Until zerod r says "rejoining" (its peer's death noticed), as systemd would wait
        before restarting the other; at most 10 s (counted: heals not started)."""
        addr = self.world.daemons[r].control_address
        until = time.monotonic() + 10
        while common.rank_health(addr) != "rejoining":
            if time.monotonic() > until:
                self.stats["heal_not_started"] += 1
                self.note(f"zerod {r} did not notice its peer's death within 10 s")
                return
            time.sleep(0.01)

    def after_recovery(self, infos, what: str, t0: float) -> Optional[int]:
        """The step both registrations report, checked; None (counted) when wrong."""
        steps = {i.step for i in infos}
        if len(steps) != 1:
            self.stats["wrong"] += 1
            self.note(f"{what}: the ranks resumed different steps {sorted(steps)}")
            return None
        step = steps.pop()
        bad = self.same(step)
        if bad:
            self.stats["wrong"] += 1
            self.note(f"{what}: {bad}")
            return None
        self.stats["recovery_s"].append(time.monotonic() - t0)
        return step

    # ---- the cases -------------------------------------------------------------------------

    def case_node(self, i: int) -> bool:
        w, rnd = self.world, self.rnd
        v = rnd.randrange(2)
        known = self.copy_step(v)  # complete at its buddy: the recovery is at least this step
        at_kill = w.step
        in_flight = known < at_kill - at_kill % self.opts.every
        w.close_trainers()
        t0 = time.monotonic()
        w.kill(v)
        self.wait_rejoining(1 - v)
        w.wipe(v)
        w.spawn(v)
        w.daemons[v].wait_ready()
        infos, err, hung = w.register(None, self.opts.bound)
        if err and not hung and not self.opts.checkpoint_every:
            return self.nothing(i, infos, v, err)
        if err or hung:
            self.stats["hangs" if hung else "wrong"] += 1
            self.note(f"trial {i} node {v}: {'hung' if hung else repr(err)}")
            return False
        if not infos[0].resumed and not self.opts.checkpoint_every:
            self.note(f"trial {i} node {v} at step {at_kill} (copy {known}): fell back to "
                      f"nothing")
            return self.nothing(i, infos, v)
        step = self.after_recovery(infos, f"trial {i} node {v}", t0)
        if step is None:
            return False
        rec = [w.status(r)[f"rank {r}"] for r in range(2)]
        if all(x.get("last_recovery") == "buddy copy" for x in rec):
            self.stats["recovered"] += 1
            self.outcome("node", "recovered from the buddy copies")
            self.stats["in_flight"] += in_flight
            self.stats["lost"].append(at_kill - step)
            self.stats["lost_settled"] += not in_flight and at_kill - step > self.opts.every
            if step < known or step % self.opts.every:
                self.stats["wrong"] += 1
                self.note(f"trial {i} node {v}: resumed step {step}, the copy complete before "
                          f"the kill was of step {known}")
        else:
            self.stats["fallback"] += 1
            self.outcome("node", "fell back (no copy of the lost rank complete since the last "
                         "loss)" if not known else "fell back")
            self.note(f"trial {i} node {v} at step {at_kill} (copy {known}): fell back to "
                      f"{rec[v].get('last_recovery')} step {step}: "
                      f"{rec[v].get('last_recovery_note', '')}")
        w.step = step
        return True

    def case_mid_copy(self, i: int) -> bool:
        w, rnd, k = self.world, self.rnd, self.opts.every
        h = rnd.randrange(2)  # the buddy killed; ward 1 - h
        ward = 1 - h
        if not self.train(k - w.step % k):  # a copy step: its copies start now
            return False
        time.sleep(rnd.uniform(0.0, self.copy_s))
        at_kill = w.step
        w.close_trainers()
        t0 = time.monotonic()
        w.kill(h)
        self.wait_rejoining(ward)
        try:
            before = held_copy(w.state_dir(h), ward)
        except AssertionError as e:
            self.stats["wrong"] += 1
            self.note(f"trial {i} mid_copy: a damaged copy kept: {e}")
            return False
        w.spawn(h)
        w.daemons[h].wait_ready()
        infos, err, hung = w.register(None, self.opts.bound)
        if err or hung:
            self.stats["hangs" if hung else "wrong"] += 1
            self.note(f"trial {i} mid_copy {h}: {'hung' if hung else repr(err)}")
            return False
        step = self.after_recovery(infos, f"trial {i} mid_copy {h}", t0)
        if step is None:
            return False
        if step != at_kill:
            self.stats["wrong"] += 1
            self.note(f"trial {i} mid_copy: the world went back from {at_kill} to {step}")
            return False
        self.stats["continued"] += 1
        held = w.status(h)["buddy"].get(f"held_rank{ward}_step")
        parts = glob.glob(os.path.join(w.state_dir(h), "*.part"))
        if parts:
            self.stats["wrong"] += 1
            self.note(f"trial {i} mid_copy: {parts} left after the restart")
        # No complete copy held at the kill (the holder was wiped by the last node loss and its
        # first copy since was the one in flight): the restarted holder must serve none either.
        if (before is None) != (held is None) or (
                before is not None and (int(held) != before["step"] or before["step"] % k)):
            self.stats["wrong"] += 1
            self.note(f"trial {i} mid_copy: the file held step "
                      f"{before and before['step']}, the restarted holder serves {held}")
        self.stats["in_flight"] += before is not None and before["step"] < at_kill
        self.outcome("mid_copy", "world continued from the state files, held copy complete"
                     if before is not None else "world continued from the state files, no copy "
                     "held yet (the holder's first since its loss was in flight)")
        # the ward lost with its memory before any new copy. Not within the restarted zerod's
        # first heartbeat: a zerod learns its peers from the node registry (rank 0's zerod), and
        # a peer that dies before its first look is not watched (its death goes unnoticed until
        # it comes back): a gap of the heartbeat, not of the copies.
        time.sleep(0.3)
        w.close_trainers()
        t0 = time.monotonic()
        w.kill(ward)
        self.wait_rejoining(h)
        w.wipe(ward)
        w.spawn(ward)
        w.daemons[ward].wait_ready()
        infos, err, hung = w.register(None, self.opts.bound)
        if err and not hung and not self.opts.checkpoint_every:
            return self.nothing(i, infos, ward, err)
        if err or hung:
            self.stats["hangs" if hung else "wrong"] += 1
            self.note(f"trial {i} mid_copy, then node {ward}: {'hung' if hung else repr(err)}")
            return False
        if not infos[0].resumed and not self.opts.checkpoint_every:
            return self.nothing(i, infos, ward)
        step = self.after_recovery(infos, f"trial {i} mid_copy, then node {ward}", t0)
        if step is None:
            return False
        rec = w.status(ward)[f"rank {ward}"]
        if rec.get("last_recovery") == "buddy copy":
            self.stats["recovered"] += 1
            self.outcome("mid_copy", "then the ward lost: recovered from the held copy")
            if before is None or step != before["step"]:
                self.stats["wrong"] += 1
                self.note(f"trial {i}: resumed {step} from a copy; the held one was of "
                          f"{before and before['step']}")
        else:
            self.stats["fallback"] += 1
            self.outcome("mid_copy", "then the ward lost: fell back (copy in flight at the kill)"
                         if before is None or before["step"] < at_kill else
                         "then the ward lost: fell back")
            if "buddy" not in rec.get("last_recovery_note", "") and \
                    "step in common" not in rec.get("last_recovery_note", ""):
                self.stats["wrong"] += 1
                self.note(f"trial {i}: fell back without a reason: {rec}")
            w.step = step
            return self.settle()
        w.step = step
        return True

    def nothing(self, i: int, infos, lost: int, err=None) -> bool:
        """No checkpoints and no copy: the registrations resume nothing and say why (status,
        the log), or fail naming the missing checkpoint_dir."""
        if err is not None:
            note, resumed = str(err), []
            said = ("no checkpoint_dir",)
        else:
            note = self.world.status(lost)[f"rank {lost}"].get("last_recovery_note", "") + \
                self.world.daemons[lost].log()
            resumed = [x.resumed for x in infos]
            said = ("neither a state file nor a buddy copy", "no step in common",
                    "nothing to recover from memory")
        if any(resumed) or not any(w in note for w in said):
            self.stats["wrong"] += 1
            self.note(f"trial {i}: nothing to recover, yet resumed {resumed}, said "
                      f"{note[-300:]!r}")
        else:
            self.stats["nothing"] += 1
            self.outcome("any", "nothing to recover, said so (no checkpoint_dir)")
        self.fresh()
        return True

    def case_both(self, i: int) -> bool:
        w = self.world
        at_kill = w.step
        w.close_trainers()
        t0 = time.monotonic()
        for r in range(2):
            w.kill(r)
        for r in range(2):
            w.wipe(r)
            w.spawn(r)
        for r in range(2):
            w.daemons[r].wait_ready()
        infos, err, hung = w.register(None, self.opts.bound)
        if err or hung:
            self.stats["hangs" if hung else "wrong"] += 1
            self.note(f"trial {i} both: {'hung' if hung else repr(err)}")
            return False
        if not self.opts.checkpoint_every:
            return self.nothing(i, infos, 1)
        step = self.after_recovery(infos, f"trial {i} both", t0)
        if step is None:
            return False
        rec = [w.status(r)[f"rank {r}"] for r in range(2)]
        notes = " ".join(x.get("last_recovery_note", "") for x in rec)
        # both zerods new and empty: to them a first start; the state files' agreement names the
        # ranks without a file and the world takes the newest checkpoint (one of a step after
        # at_kill too, left by a timeline an earlier fallback rolled back: the gradients are the
        # step's, so it is torch's step, which after_recovery checked)
        if step % self.opts.checkpoint_every or any(x.get("last_recovery") != "checkpoint" for x in rec) or \
                "no usable state file" not in notes:
            self.stats["wrong"] += 1
            self.note(f"trial {i} both: step {step} of {at_kill}, "
                      f"{[(x.get('last_recovery'), x.get('last_recovery_note')) for x in rec]}")
        self.stats["fallback"] += 1
        self.outcome("both", "fell back to the checkpoint")
        w.step = step
        return self.settle()

    # ---- the run ---------------------------------------------------------------------------

    def run(self) -> None:
        shard = sum(int(np.prod(s)) for _, s in T.PARAMS) // 2 * 12
        self.copy_s = shard / self.opts.bandwidth if self.opts.bandwidth else 0.01
        self.fresh()
        for i in range(self.opts.trials):
            case = CASES[i % len(CASES)]
            self.stats["trials"][case] += 1
            if self.opts.verbose:
                print(f"trial {i} {case} at step {self.world.step}", flush=True)
            ok = self.train(self.rnd.randint(1, 2 * self.opts.every))
            if ok:
                time.sleep(self.rnd.uniform(0.0, self.copy_s))
                ok = {"node": self.case_node, "mid_copy": self.case_mid_copy,
                      "both": self.case_both}[case](i)
            if ok:
                ok = self.train(2)  # training goes on, every step checked
                bad = self.same(self.world.step) if ok else None
                if bad:
                    self.stats["wrong"] += 1
                    self.note(f"trial {i} ({case}), after: {bad}")
            if not ok:
                for r, d in enumerate(self.world.daemons):
                    self.note(f"  zerod {r} log tail: {d.log()[-800:]!r}")
                self.fresh()
            low = self.world.step - 3 * self.opts.every - 4
            for s in [s for s in self.ref.seen if 0 < s < low]:
                del self.ref.seen[s]
        self.world.stop()
        shutil.rmtree(self.top, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", default=None)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--bandwidth", type=int, default=16 << 20)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--bound", type=float, default=60.0)
    ap.add_argument("--min-cases", type=int, default=0)
    ap.add_argument("--verbose", action="store_true")
    opts = ap.parse_args()
    seed = common.test_seed(opts.seed)
    print(f"seed {seed}: {common.repeat_command(seed)}", flush=True)
    t_start = time.monotonic()
    tr = Trials(opts, random.Random(seed))
    tr.run()
    st = tr.stats
    for n in st["notes"][:30]:
        print("   ", n)
    for k, v in sorted(st["outcomes"].items()):
        print(f"  {k}: {v}")
    rec, lost = st["recovery_s"], st["lost"]
    print(f"{sum(st['trials'].values())} trials ({time.monotonic() - t_start:.0f} s; "
          f"{', '.join(f'{k} {v}' for k, v in sorted(st['trials'].items()))}), copies every "
          f"{opts.every} steps at {opts.bandwidth / 2**20:g} MiB/s, checkpoints every "
          f"{opts.checkpoint_every or 'never'}: recovered from buddy copies {st['recovered']}, "
          f"fallbacks {st['fallback']} (+{st['nothing']} nothing to recover, said so), worlds "
          f"continued after their buddy's death {st['continued']}, wrong {st['wrong']}, hangs "
          f"{st['hangs']}, heals not started {st['heal_not_started']}; kills with a copy in flight {st['in_flight']}; steps lost per node "
          f"loss: max {max(lost) if lost else 0}, mean "
          f"{statistics.mean(lost) if lost else 0:.1f}, over {opts.every} "
          f"{sum(x > opts.every for x in lost)} (with no copy in flight: "
          f"{st['lost_settled']}); SIGKILL to both registered: median "
          f"{statistics.median(rec) if rec else float('nan'):.3f} s, "
          f"p95 {common.percentile(rec, 0.95):.3f} s",
          flush=True)
    failed = bool(st["wrong"] or st["hangs"] or st["lost_settled"])
    node_fallbacks = [n for n in st["notes"] if " node " in n and "fell back" in n and
                      "(copy 0)" not in n]
    if node_fallbacks:
        failed = True
    if min(st["trials"].values()) < opts.min_cases:
        print(f"fewer than {opts.min_cases} trials of a case")
        failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
