"""Kill trials: zerod SIGKILLed at random moments while it writes checkpoints (suite kill_trials).

A crash must never leave a checkpoint that looks complete and is not, nor take away the previous
one. Each trial starts a real zerod (a world of two local ranks in one daemon; every fourth trial
world size 1) with checkpoint_every_steps small and checkpoint_throttle_bytes_per_s set so that a
rank file takes 0.2-0.5 s to write, trains deterministic steps until at least two checkpoints are
complete (every eighth trial: not even one), waits a random time and SIGKILLs zerod. The
gradients are those of test_checkpoint.py (step s's drawn from a generator seeded with s on rank
0, zeros elsewhere, summed), so the model after every step is known from one reference run at
world size 1. Then:
  - every directory with a manifest verifies (`zeroctl verify`), every directory without one is
    refused by it; at least two complete checkpoints remain (the newest and the one before it);
  - the master weights of the newest two (`zeroctl export`) equal the reference at their steps,
    bit for bit;
  - where the kill landed is read from the temporary files left behind: in a rank file (a partial
    rank-*.safetensors.tmp), in its commit (a whole .tmp: the throttle's last sleep, the fsync or
    the rename), in the manifest (manifest.json.tmp), or between writes;
  - every third trial (and every early one) restarts zerod with --resume latest: the registered
    step is the newest complete one (none: a fresh start), the parameters are its, and two more
    steps match the reference;
  - every fourth trial first flips a byte of, or truncates, a rank file of the newest complete
    checkpoint: verify names the file, and the resume falls back to the one before it and says so
    ("falling back to the previous").

    test_kill_trials.py [--trials N] [--seed S|random] [--min-mid-write M] [--max-trials N]
                        [--keep-failed]

The choices (world size, checkpoint period and keep, throttle, when to kill, which file to damage)
come from one seed: $ZEROD_TEST_SEED, else 1, unless --seed names one ("random" draws one). It
is printed with the command line that repeats the run. CI runs 12 trials with the fixed seed
(tests/python/meson.build); the long count is the same program with --trials 200 and --seed
random, and the table it prints ends the run.

Where a kill lands is a matter of timing, so that requirement is a count the run works towards:
at least --min-mid-write kills (default: more than half of --trials) must land while a file was
being written (its .tmp left behind), at least one of them in the middle of a rank file. When
--trials trials have not reached that, more trials follow, drawn from the same seed, up to
--max-trials (default: three times --trials); the run fails only if they do not reach it either,
which means the throttle does not hold the writer in its files. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

import common

import numpy as np

import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402

PARAMS = [("kt.w", (96, 80)), ("kt.b", (80,)), ("kt.v", (1500,)), ("kt.s", ())]
BUCKET = 1024  # parameters straddle buckets and rank slices
REF_STEPS = 400  # trials stop training here (they are killed long before)
ZEROCTL = os.environ.get("ZEROCTL_BIN") or os.path.join(common.ROOT, "build", "client", "zeroctl")


def numel() -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) for _, shape in PARAMS)


def step_grads(step: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in PARAMS}


class Trainer:
    """One rank's client with numpy views of each parameter in the shared buffers."""

    def __init__(self, world: zerod.testing.LocalWorld, rank: int, init: float) -> None:
        self.rank = rank
        self.client = world.connect(rank)
        self.client.layout([(n, s) for n, s in PARAMS], grad_mean=False)
        params = np.frombuffer(self.client.param_buffer, dtype=np.float32)
        grads = np.frombuffer(self.client.grad_buffer, dtype=np.float32)
        self.p: Dict[str, np.ndarray] = {}
        self.g: Dict[str, np.ndarray] = {}
        for i, (name, shape) in enumerate(PARAMS):
            info = self.client.param_info(i)
            self.p[name] = params[info.offset:info.offset + info.numel].reshape(shape)
            self.g[name] = grads[info.offset:info.offset + info.numel].reshape(shape)
            self.p[name][...] = init
        self.info = self.client.register()

    def snapshot(self) -> Dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.p.items()}

    def step(self, s: int, grads: Dict[str, np.ndarray]) -> None:
        for name, _ in PARAMS:
            self.g[name][...] = grads[name] if self.rank == 0 else 0.0
        self.client.step()

    def close(self) -> None:
        try:
            self.client.close()
        except ZerodError:
            pass  # its zerod is gone


def on_all(world_size: int, fn) -> list:
    """fn(rank) for every rank at once (registration and steps are collectives)."""
    out: list = [None] * world_size
    errors: list = []

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


def start(world_size: int, args: List[str], init: float):
    world = zerod.testing.LocalWorld(world_size, args=["--bucket_elems", str(BUCKET)] + args,
                                     keep_dir=True)  # stop() reads the log, then removes it
    try:
        trainers = on_all(world_size, lambda r: Trainer(world, r, init))
    except BaseException:
        world.stop(signal.SIGKILL, check=False)
        for d in world.daemons:
            shutil.rmtree(d.dir, ignore_errors=True)
        raise
    return world, trainers


def stop(world, trainers: List[Trainer], sig: int = signal.SIGTERM) -> Tuple[str, Optional[str]]:
    """Stops the daemons with sig (a SIGKILL sent before counts: see common.stop_zerod),
    returns their logs and, when one did not end as that stop should (exit 0 after SIGTERM,
    SIGKILL's death after SIGKILL), how; removes their directories."""
    for t in trainers:
        t.close()
    wrong = None
    try:
        common.stop_world(world, sig)
    except AssertionError as e:
        wrong = str(e).splitlines()[0]
    log = world.log()
    for d in world.daemons:
        shutil.rmtree(d.dir, ignore_errors=True)
    return log, wrong


def reference() -> Dict[int, Dict[str, np.ndarray]]:
    """The model after each step 0..REF_STEPS of an uninterrupted run at world size 1."""
    world, trainers = start(1, [], 0.25)
    ref = {0: trainers[0].snapshot()}
    try:
        for s in range(1, REF_STEPS + 1):
            trainers[0].step(s, step_grads(s))
            ref[s] = trainers[0].snapshot()
    finally:
        log, wrong = stop(world, trainers)
    if wrong:
        raise AssertionError(f"the reference run's {wrong}\n{log}")
    return ref


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
    """The F32 tensors of a safetensors file (8-byte header length, JSON header, data)."""
    with open(path, "rb") as f:
        blob = f.read()
    (hlen,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + hlen])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", f"{path}: {name} is {t['dtype']}"
        b, e = t["data_offsets"]
        out[name] = np.frombuffer(blob[8 + hlen + b:8 + hlen + e], dtype=np.float32).reshape(
            t["shape"])
    return out


def tmp_file_bytes(path: str) -> Optional[int]:
    """The size a rank file being written will have, from its safetensors header (written
    first); None while not even the header is there."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None
        (hlen,) = struct.unpack("<Q", head)
        text = f.read(hlen)
    if len(text) < hlen:
        return None
    header = json.loads(text)
    return 8 + hlen + max(t["data_offsets"][1] for k, t in header.items() if k != "__metadata__")


def zeroctl(*args: str) -> Tuple[int, str]:
    p = subprocess.run([ZEROCTL, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=60)
    return p.returncode, p.stdout.strip()


def differs(got: Dict[str, np.ndarray], want: Dict[str, np.ndarray]) -> Optional[str]:
    """None when every parameter has the same bits, else what differs first."""
    for name, shape in PARAMS:
        if name not in got:
            return f"{name} is missing"
        g, w = got[name], want[name]
        if g.shape != tuple(shape):
            return f"{name} has shape {g.shape}, expected {shape}"
        diff = np.flatnonzero(g.view(np.uint32).ravel() != w.view(np.uint32).ravel())
        if diff.size:
            i = int(diff[0])
            return (f"{name} differs at {diff.size} elements, first [{i}]: "
                    f"{g.ravel()[i]!r} vs {w.ravel()[i]!r} in the reference")
    return None


def step_dirs(root: str) -> List[Tuple[int, str]]:
    out = []
    for e in os.listdir(root):
        if e.startswith("step-"):
            out.append((int(e[5:]), os.path.join(root, e)))
    return sorted(out)


class Counts:
    def __init__(self) -> None:
        self.trials = self.w1 = self.w2 = 0
        self.where: Dict[str, int] = {"mid-file": 0, "commit": 0, "manifest": 0, "between": 0}
        self.failures: List[str] = []
        self.corrupt_accepted = 0
        self.resumes = 0
        self.damaged = 0
        self.fallbacks = 0
        self.complete_seen = 0
        self.early = 0
        self.fresh_starts = 0
        self.incomplete_seen = 0


class Trial:
    """One trial: start, train, kill, check. Failures go to counts.failures, prefixed."""

    def __init__(self, index: int, rng: random.Random, ref: Dict[int, Dict[str, np.ndarray]],
                 counts: Counts, root: str) -> None:
        self.i = index
        self.rng = rng
        self.ref = ref
        self.counts = counts
        self.root = root
        self.world_size = 1 if index % 4 == 3 else 2
        # Every eighth trial kills early, perhaps before the first checkpoint is complete.
        self.early = index % 8 == 6
        self.every = rng.choice([1, 2, 3])
        self.keep = rng.choice([2, 3, 0])  # 0: all kept
        self.file_s = rng.uniform(0.2, 0.5)  # time to write one rank file
        shard_bytes = 3 * 4 * numel() // self.world_size
        self.throttle = max(int(shard_bytes / self.file_s), 1)
        self.ok = True

    def fail(self, msg: str) -> None:
        self.ok = False
        self.counts.failures.append(f"trial {self.i} (W={self.world_size}, every "
                                    f"{self.every}, keep {self.keep}): {msg}")

    def manifests(self) -> List[int]:
        return [s for s, d in step_dirs(self.root)
                if os.path.exists(os.path.join(d, "manifest.json"))]

    def train_and_kill(self) -> None:
        args = ["--checkpoint-dir", self.root, "--checkpoint-every-steps", str(self.every),
                "--checkpoint-keep", str(self.keep),
                "--checkpoint-throttle-bytes-per-s", str(self.throttle)]
        world, trainers = start(self.world_size, args, 0.25)
        stop_flag = threading.Event()
        errors: list = []

        def train() -> None:
            try:
                for s in range(1, REF_STEPS + 1):
                    if stop_flag.is_set():
                        return
                    grads = step_grads(s)
                    on_all(self.world_size, lambda r: trainers[r].step(s, grads))
            except ZerodError as e:
                if not stop_flag.is_set():
                    errors.append(e)

        t = threading.Thread(target=train)
        t.start()
        # Two complete checkpoints first (the newest and the one before it), then a random
        # moment within the next checkpoint or so: every rank file, then the manifest.
        deadline = time.monotonic() + 60
        while (not self.early and len(self.manifests()) < 2 and time.monotonic() < deadline
               and t.is_alive()):
            time.sleep(0.01)
        span = (2.5 if self.early else 1.3) * self.world_size * self.file_s
        time.sleep(self.rng.uniform(0.0, span))
        stop_flag.set()
        world.daemons[0].process.send_signal(signal.SIGKILL)
        t.join(60)
        log, wrong = stop(world, trainers, signal.SIGKILL)
        if wrong:
            self.fail(f"the killed {wrong}")
        if errors:
            self.fail(f"training failed before the kill: {errors[0]}\n{log}")
        if len(self.manifests()) < 2 and not errors and not self.early:
            self.fail(f"fewer than two complete checkpoints: {self.manifests()}\n{log}")

    def classify(self) -> None:
        """Where the kill landed, from the temporary files it left."""
        where = "between"
        for _, d in step_dirs(self.root):
            for e in os.listdir(d):
                if e == "manifest.json.tmp":
                    where = "manifest"
                elif e.endswith(".safetensors.tmp"):
                    path = os.path.join(d, e)
                    size, expected = os.path.getsize(path), tmp_file_bytes(path)
                    where = "commit" if size == expected else "mid-file"
        self.counts.where[where] += 1

    def check_dirs(self) -> List[int]:
        """Verifies every directory; returns the complete steps, oldest first."""
        complete = []
        for s, d in step_dirs(self.root):
            has_manifest = os.path.exists(os.path.join(d, "manifest.json"))
            rc, out = zeroctl("verify", d)
            if has_manifest:
                self.counts.complete_seen += 1
                if rc != 0:
                    self.fail(f"{d} has a manifest and does not verify: {out}")
                    continue
                complete.append(s)
            else:
                self.counts.incomplete_seen += 1
                if rc == 0:
                    self.counts.corrupt_accepted += 1
                    self.fail(f"{d} has no manifest and verifies: {out}")
        if len(complete) < 2 and not self.early:
            self.fail(f"complete checkpoints after the kill: {complete}; expected at least two")
        for s in complete[-2:]:
            d = os.path.join(self.root, f"step-{s:012d}")
            out_path = os.path.join(self.root, f"export-{s}.safetensors")
            rc, out = zeroctl("export", d, "--out", out_path)
            if rc != 0:
                self.fail(f"zeroctl export {d}: {out}")
                continue
            why = differs(read_safetensors(out_path), self.ref[s])
            os.unlink(out_path)
            if why:
                self.counts.corrupt_accepted += 1
                self.fail(f"{d} verifies but its master weights are not the reference's at "
                          f"step {s}: {why}")
        return complete

    def damage(self, complete: List[int]) -> Tuple[int, str]:
        """Flips a byte of or truncates a rank file of the newest complete checkpoint; returns
        the step the resume must fall back to and the damaged file's name."""
        d = os.path.join(self.root, f"step-{complete[-1]:012d}")
        files = sorted(e for e in os.listdir(d) if e.endswith(".safetensors"))
        name = self.rng.choice(files)
        path = os.path.join(d, name)
        size = os.path.getsize(path)
        if (self.i // 4) % 2 == 0:
            at = self.rng.randrange(size)
            with open(path, "r+b") as f:
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ (1 << self.rng.randrange(8))]))
        else:
            os.truncate(path, self.rng.randrange(size))
        self.counts.damaged += 1
        rc, out = zeroctl("verify", d)
        if rc == 0:
            self.counts.corrupt_accepted += 1
            self.fail(f"{path} damaged and {d} still verifies: {out}")
        elif name not in out:
            self.fail(f"zeroctl verify of the damaged {d} does not name {name}: {out}")
        return complete[-2], name

    def resume(self, want: Optional[int], damaged: Optional[str]) -> None:
        """Restarts zerod with --resume latest: it must register step `want` (None: nothing to
        resume, a fresh start) with the reference's parameters, then match two more steps."""
        world, trainers = start(self.world_size,
                                ["--checkpoint-dir", self.root, "--resume", "latest"], -7.0)
        log = ""
        try:
            self.counts.resumes += 1
            for t in trainers:
                if want is None and (t.info.resumed or t.info.step != 0):
                    self.counts.corrupt_accepted += 1  # no directory there is complete
                    self.fail(f"rank {t.rank} resumed={t.info.resumed} at step {t.info.step}; "
                              f"expected a fresh start: no checkpoint is complete")
                    return
                if want is None:
                    self.counts.fresh_starts += t.rank == 0
                    continue
                if not t.info.resumed or t.info.step != want:
                    if t.info.resumed and t.info.step > want:  # incomplete or damaged
                        self.counts.corrupt_accepted += 1
                    self.fail(f"rank {t.rank} resumed={t.info.resumed} at step {t.info.step}; "
                              f"expected the newest complete checkpoint that verifies, step "
                              f"{want}")
                    return
                why = differs(t.snapshot(), self.ref[want])
                if why:
                    self.counts.corrupt_accepted += 1
                    self.fail(f"rank {t.rank} resumed step {want} with other parameters: {why}")
                    return
            if want is None:
                return  # a fresh start from -7.0: not the reference's trajectory
            for s in (want + 1, want + 2):
                grads = step_grads(s)
                on_all(self.world_size, lambda r: trainers[r].step(s, grads))
                why = differs(trainers[0].snapshot(), self.ref[s])
                if why:
                    self.fail(f"step {s} after the resume differs from the reference: {why}")
                    return
        finally:
            log, wrong = stop(world, trainers)
        if wrong:
            self.fail(f"after the resume, {wrong}")
        if damaged is not None:
            if any("falling back to the previous" in l and damaged in l
                   for l in log.splitlines()):
                self.counts.fallbacks += 1
            else:
                self.fail(f"no 'falling back to the previous' line naming {damaged} in the log:"
                          f"\n{log}")

    def run(self) -> None:
        self.counts.trials += 1
        self.counts.early += self.early
        if self.world_size == 1:
            self.counts.w1 += 1
        else:
            self.counts.w2 += 1
        self.train_and_kill()
        if not self.ok:
            return
        self.classify()
        complete = self.check_dirs()
        if not self.ok:
            return
        if self.i % 4 == 1 and len(complete) >= 2:
            want, damaged = self.damage(complete)
            if self.ok:
                self.resume(want, damaged)
        elif self.i % 3 == 0 or self.early:
            self.resume(complete[-1] if complete else None, None)


def table(c: Counts, seconds: float) -> str:
    rows = [
        ("trials", c.trials),
        ("  at W=2 (one daemon, two local ranks)", c.w2),
        ("  at W=1", c.w1),
        ("  killed early (perhaps no checkpoint complete)", c.early),
        ("killed while a file was written (a .tmp left)", c.trials - c.where["between"]),
        ("  in the middle of a rank file (partial .tmp)", c.where["mid-file"]),
        ("  in a rank file's commit (whole .tmp)", c.where["commit"]),
        ("  in the manifest's write (manifest.json.tmp)", c.where["manifest"]),
        ("killed between writes (no .tmp)", c.where["between"]),
        ("complete checkpoints checked", c.complete_seen),
        ("incomplete directories refused", c.incomplete_seen),
        ("resumes checked", c.resumes),
        ("  of which fresh starts (nothing complete)", c.fresh_starts),
        ("files damaged", c.damaged),
        ("fallbacks seen", c.fallbacks),
        ("corrupt loads accepted", c.corrupt_accepted),
        ("failures", len(c.failures)),
        ("seconds", f"{seconds:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v:>8}" for k, v in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--seed", default=None,
                    help="an integer, or random; default $ZEROD_TEST_SEED, else 1 (printed)")
    ap.add_argument("--min-mid-write", type=int, default=None,
                    help="kills that must land while a file is written (default: more than "
                         "half of --trials)")
    ap.add_argument("--max-trials", type=int, default=None,
                    help="trials at most to reach --min-mid-write (default: 3 x --trials)")
    ap.add_argument("--keep-failed", action="store_true",
                    help="keep the checkpoint directory of a failed trial (path printed)")
    args = ap.parse_args()
    if not os.access(ZEROCTL, os.X_OK):
        common.skip(f"zeroctl not found at {ZEROCTL}: set ZEROCTL_BIN")
    seed = common.test_seed(args.seed)
    min_mid = args.min_mid_write if args.min_mid_write is not None else args.trials // 2 + 1
    max_trials = args.max_trials if args.max_trials is not None else 3 * args.trials
    print(f"kill trials: {args.trials} trials (up to {max_trials} until {min_mid} kills land "
          f"while a file is written), seed {seed}; repeat with: {common.repeat_command(seed)}",
          flush=True)
    rng = random.Random(seed)
    t0 = time.monotonic()
    ref = reference()
    counts = Counts()

    def mid_write() -> int:
        return counts.trials - counts.where["between"]

    i = 0
    while i < args.trials or (
            i < max_trials and (mid_write() < min_mid or counts.where["mid-file"] == 0)):
        root = tempfile.mkdtemp(prefix="zerod-kill-")
        trial = Trial(i, rng, ref, counts, root)
        trial.run()
        if trial.ok or not args.keep_failed:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"trial {i}: kept {root}", flush=True)
        print(f"trial {i:4d}: W={trial.world_size} every {trial.every} keep {trial.keep} "
              f"{trial.file_s:.2f} s/file: {'ok' if trial.ok else 'FAILED'}", flush=True)
        i += 1
    print(table(counts, time.monotonic() - t0), flush=True)
    print(f"{counts.trials} trials: {mid_write()} kills while a file was written (at least "
          f"{min_mid} needed), {counts.where['mid-file']} in the middle of a rank file (at least "
          f"1), {len(counts.failures)} failures; seed {seed}", flush=True)
    for f in counts.failures:
        print(f"FAIL {f}", flush=True)
    if counts.failures:
        sys.exit(1)
    if counts.where["mid-file"] == 0 or mid_write() < min_mid:
        print(f"FAIL {mid_write()} of {counts.trials} kills landed while a file was written, "
              f"{counts.where['mid-file']} in the middle of a rank file: the throttle does not "
              f"hold the writer in its files", flush=True)
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
