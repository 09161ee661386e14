#!/usr/bin/env python3
"""Buddy copies (buddy_copy_every_steps), measured in one run on this machine: the training
slowdown of a copy every 100 steps against copies off (mean and median step time, worlds
alternating so that a drift of the machine's load falls on both), and the time from a node's loss to the
world training again from its buddy's copy.

W=2, a zerod per rank on loopback, both with a state_dir on tmpfs (the buddy path's setting), a
model of --params fp32 parameters (default 4M: a 2M-element shard per rank, 24 MB of master and
moments per copy). Worlds alternate off, on, off, on (--rounds pairs), each with --warmup steps
and then --steps timed steps of both trainers (threads, one per rank): the rows are the mean step
time of each setting over its rounds and the slowdown. Then, in a last world with copies on, zerod
1 is SIGKILLed after a copy, its state file deleted, and it is started again: the time from the
kill to the survivor seeing the loss (its heartbeat, peer_timeout_ms = 1000), to the restarted
zerod serving again from its buddy's copy (both registrations answered), and the copy's read as
the log reports it.

Run by hand: ZEROD_BIN=build/daemon/zerod ZEROD_LIBRARY=build/client/libzerod.so \\
PYTHONPATH=client/python:tests/python python3 tests/bench/bench_buddy.py
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import common  # noqa: E402  (sets up sys.path and the library)

import numpy as np  # noqa: E402

import zerod.testing  # noqa: E402


def tmpfs() -> str:
    for root in ("/dev/shm", os.environ.get("XDG_RUNTIME_DIR", "")):
        if root and os.path.isdir(root) and os.access(root, os.W_OK):
            return root
    common.skip("no writable tmpfs")
    return ""


class Trainer:
    def __init__(self, world, rank: int, n: int) -> None:
        self.client = world.connect(rank)
        self.client.layout([("w", (n,))], grad_mean=False)
        info = self.client.param_info(0)
        p = np.frombuffer(self.client.param_buffer, dtype=np.float32)[info.offset:][:n]
        g = np.frombuffer(self.client.grad_buffer, dtype=np.float32)[info.offset:][:n]
        p[:] = np.random.default_rng(1).standard_normal(n).astype(np.float32)
        g[:] = np.float32(1e-3) if rank == 0 else np.float32(0)
        self.info = None

    def register(self) -> None:
        self.info = self.client.register()

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass


def on_both(fns) -> None:
    errs = []

    def run(f):
        try:
            f()
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=run, args=(f,)) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]


def start(state_dir: str, every: int) -> zerod.testing.LocalWorld:
    return zerod.testing.LocalWorld(2, daemons=2, args=[
        "--state_dir", state_dir, "--heartbeat_ms", "100", "--peer_timeout_ms", "1000",
        "--log_level", "info", "--buddy_copy_every_steps", str(every)], log_level="info")


def register(world, n: int):
    ts = [Trainer(world, r, n) for r in range(2)]
    on_both([t.register for t in ts])
    return ts


def train(ts, steps: int, each=None) -> float:
    """Seconds for `steps` steps of both trainers; each (a list): every step's seconds."""
    t0 = time.perf_counter()
    for _ in range(steps):
        t1 = time.perf_counter()
        on_both([t.client.step for t in ts])
        if each is not None:
            each.append(time.perf_counter() - t1)
    return time.perf_counter() - t0


def health(d) -> str:
    zeroctl = os.environ.get("ZEROCTL_BIN", os.path.join(common.ROOT, "build", "client",
                                                         "zeroctl"))
    out = subprocess.run([zeroctl, "--address", d.control_address, "status", "--json"],
                         capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout)["ranks"][0]["health"] if out.stdout else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=4 << 20)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--every", type=int, default=100)
    opts = ap.parse_args()
    root = tempfile.mkdtemp(prefix="zerod-bench-buddy-", dir=tmpfs())
    times = {0: [], opts.every: []}
    steps = {0: [], opts.every: []}
    try:
        for rnd in range(opts.rounds):
            for every in (0, opts.every):
                sd = os.path.join(root, f"s{rnd}-{every}")
                world = start(sd, every)
                ts = register(world, opts.params)
                train(ts, opts.warmup)
                times[every].append(train(ts, opts.steps, steps[every]) / opts.steps)
                for t in ts:
                    t.close()
                common.stop_world(world)
        off = sum(times[0]) / len(times[0])
        on = sum(times[opts.every]) / len(times[opts.every])
        print(f"W=2, {opts.params} parameters ({opts.params // 2} per rank, "
              f"{opts.params // 2 * 12} bytes per copy), {opts.steps} timed steps x "
              f"{opts.rounds} rounds each")
        print(f"  copies off:              {off * 1e3:8.2f} ms/step  "
              f"(rounds: {', '.join(f'{x * 1e3:.2f}' for x in times[0])})")
        print(f"  a copy every {opts.every:4d} steps: {on * 1e3:8.2f} ms/step  "
              f"(rounds: {', '.join(f'{x * 1e3:.2f}' for x in times[opts.every])})")
        print(f"  slowdown: {(on / off - 1) * 100:+.1f}% of the mean step")
        med_off, med_on = statistics.median(steps[0]), statistics.median(steps[opts.every])
        print(f"  median step: off {med_off * 1e3:.2f} ms, on {med_on * 1e3:.2f} ms "
              f"({(med_on / med_off - 1) * 100:+.1f}%)")

        sd = os.path.join(root, "recovery")
        world = start(sd, opts.every)
        ts = register(world, opts.params)
        train(ts, opts.every)
        deadline = time.monotonic() + 60
        while ts[1].client.status_dict().get("buddy", {}).get("rank1_copy_step") != \
                str(opts.every):
            assert time.monotonic() < deadline, "no copy"
            time.sleep(0.01)
        snap_us = ts[0].client.status_dict()["buddy"].get("rank0_last_snapshot_us", "?")
        send_ms = ts[0].client.status_dict()["buddy"].get("rank0_last_send_ms", "?")
        train(ts, 5)
        t0 = time.monotonic()
        common.stop_zerod(world.daemons[1], signal.SIGKILL)
        for t in ts:
            t.close()
        for f in glob.glob(os.path.join(sd, "rank1-of-2-*")):
            os.unlink(f)
        while health(world.daemons[0]) != "rejoining":
            time.sleep(0.005)
        t_seen = time.monotonic() - t0
        args = list(world.daemons[1].args)
        d = zerod.testing.LocalZerod(args, log_level="info")
        world.daemons[1] = d
        world._endpoints[1] = (d.socket, 0)
        ts = register(world, opts.params)
        t_back = time.monotonic() - t0
        assert all(t.info.step == opts.every for t in ts), [t.info.step for t in ts]
        m = re.search(r"read its buddy copy of step \d+ \((\d+) bytes\) from \S+ in (\d+) ms",
                      d.log())
        train(ts, 3)
        print(f"  snapshot on the worker: {snap_us} us; copy sent in {send_ms} ms (no throttle)")
        print(f"  node loss -> survivor sees it: {t_seen:.2f} s (peer_timeout_ms 1000, "
              f"heartbeat 100 ms)")
        print(f"  node loss -> training again from the buddy copy: {t_back:.2f} s "
              f"(restart of zerod 1 included; copy read: "
              f"{m.group(1) + ' bytes in ' + m.group(2) + ' ms' if m else '?'})")
        for t in ts:
            t.close()
        common.stop_world(world)
    finally:
        shutil.rmtree(root, True)


if __name__ == "__main__":
    main()
