#!/usr/bin/env python3
"""Live resize (zeroctl resize) against a checkpoint-and-resume, measured in one run on this
machine: a world W=4 -> 2 -> 4 of a zerod per rank on loopback (unix sockets), a model of --params
fp32 parameters (default 4M: master, exp_avg and exp_avg_sq, 48 MB in all), trainers on threads.

Live: `zeroctl resize --world_size 2` during training; the time from the step that finds the
resize (the trainers' next step, answered ZD_EPEER/ZD_ERANK) to every trainer of the new world
registered again and served its state (shrink), counted from the step the resize rides, and for the grow the same plus starting the two
new zerods. Checkpoint-and-resume: the same model in a world with a checkpoint_dir (tmpfs when
there is one, as the fastest storage here): `zeroctl checkpoint --wait` after a step, every zerod
stopped, the new world's zerods started (counted from the step the checkpoint rides) with the same checkpoint_dir, every trainer registered
(resumed from the checkpoint at the new size). Both end at the same point: the new world's
trainers hold the model at its step. Each row is the median of --rounds rounds.

Run by hand: ZEROD_BIN=build/daemon/zerod ZEROD_LIBRARY=build/client/libzerod.so \\
ZEROCTL_BIN=build/client/zeroctl PYTHONPATH=client/python:tests/python \\
python3 tests/bench/bench_resize.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
from zerod import ZerodError  # noqa: E402

LIVE_INNER: list = []  # per live round: zerod's own time of the shrink and of the grow (ms)
ARGS = ["--heartbeat_ms", "100", "--peer_timeout_ms", "1000", "--log_level", "info"]


def zeroctl(*args: str) -> str:
    exe = os.environ.get("ZEROCTL_BIN", os.path.join(common.ROOT, "build", "client", "zeroctl"))
    out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise RuntimeError(f"zeroctl {' '.join(args)}: {out.stderr}")
    return out.stdout


def resize_ms(d) -> float:
    """The zerod's own time of its last resize (image, re-forming), from status."""
    exe = os.environ.get("ZEROCTL_BIN", os.path.join(common.ROOT, "build", "client", "zeroctl"))
    out = subprocess.run([exe, "--address", d.control_address, "status", "--json"],
                         capture_output=True, text=True, timeout=30)
    last = json.loads(out.stdout)["ranks"][0].get("last_resize", "")
    return float(last.split(" in ")[1].split(" ms")[0]) if " in " in last else float("nan")


def world_size(d) -> int:
    exe = os.environ.get("ZEROCTL_BIN", os.path.join(common.ROOT, "build", "client", "zeroctl"))
    out = subprocess.run([exe, "--address", d.control_address, "status", "--json"],
                         capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout)["world_size"] if out.stdout else 0


class Trainer:
    def __init__(self, world, rank: int, n: int) -> None:
        self.client = world.connect(rank)
        self.client.layout([("w", (n,))], grad_mean=False)
        info = self.client.param_info(0)
        self.p = np.frombuffer(self.client.param_buffer, dtype=np.float32)[info.offset:][:n]
        g = np.frombuffer(self.client.grad_buffer, dtype=np.float32)[info.offset:][:n]
        self.p[:] = np.random.default_rng(1).standard_normal(n).astype(np.float32)
        g[:] = np.float32(1e-3) if rank == 0 else np.float32(0)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass


def on_all(fns) -> list:
    out, errs = [None] * len(fns), []

    def run(i):
        try:
            out[i] = fns[i]()
        except ZerodError as e:
            out[i] = e
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]
    return out


def register(world, ranks, n: int):
    ts = [Trainer(world, r, n) for r in ranks]
    for r in on_all([t.client.register for t in ts]):
        if isinstance(r, ZerodError):
            raise r
    return ts


def steps(ts, k: int) -> None:
    for _ in range(k):
        for r in on_all([t.client.step for t in ts]):
            if isinstance(r, ZerodError):
                raise r


def add_zerod(world, rank: int, size: int, extra=()) -> None:
    d = zerod.testing.LocalZerod([], log_level="info", start=False, timeout=60.0)
    d.args = ["--world_size", str(size), "--first_rank", str(rank), "--local_ranks", "1",
              "--rendezvous_address", world.daemons[0].control_address] + ARGS + list(extra)
    d.spawn()
    world.daemons[rank] = d
    world._endpoints[rank] = (d.socket, 0)


def live(n: int):
    world = zerod.testing.LocalWorld(4, daemons=4, args=ARGS, log_level="info", timeout=60.0)
    try:
        ts = register(world, range(4), n)
        steps(ts, 2)
        zeroctl("--address", world.daemons[0].control_address, "resize", "--world_size", "2")
        t0 = time.perf_counter()  # from the step the resize rides
        steps(ts, 1)
        on_all([t.client.step for t in ts])  # answered: the resize happened first
        for t in ts:
            t.close()
        ts = register(world, range(2), n)
        shrink = time.perf_counter() - t0
        inner = [resize_ms(world.daemons[0])]
        for r in (2, 3):
            world.daemons[r].stop(check=False)
        steps(ts, 1)
        zeroctl("--address", world.daemons[0].control_address, "resize", "--world_size", "4")
        t0 = time.perf_counter()
        steps(ts, 1)
        on_all([t.client.step for t in ts])
        for t in ts:
            t.close()
        while world_size(world.daemons[0]) != 4:
            time.sleep(0.01)
        for r in (2, 3):
            add_zerod(world, r, 4)
        for r in (2, 3):
            world.daemons[r].wait_ready()
        ts = register(world, range(4), n)
        grow = time.perf_counter() - t0
        inner.append(resize_ms(world.daemons[0]))
        steps(ts, 1)
        for t in ts:
            t.close()
        LIVE_INNER.append(inner)
        return shrink, grow
    finally:
        world.stop(check=False)


def ckpt_world(size: int, ckpt: str) -> zerod.testing.LocalWorld:
    return zerod.testing.LocalWorld(size, daemons=size, args=ARGS + ["--checkpoint_dir", ckpt],
                                    log_level="info", timeout=60.0)


def checkpointed(n: int, root: str):
    ckpt = tempfile.mkdtemp(prefix="zerod-bench-ckpt-", dir=root)
    times = []
    world = ckpt_world(4, ckpt)
    try:
        ts = register(world, range(4), n)
        steps(ts, 3)
        for size in (2, 4):
            # Asked before the step it rides, as the resize is; the clock starts at that step.
            asked = threading.Thread(target=zeroctl, args=(
                "--address", world.daemons[0].control_address, "checkpoint", "--wait", "600"))
            asked.start()
            time.sleep(0.5)
            t0 = time.perf_counter()
            steps(ts, 1)
            asked.join()
            for t in ts:
                t.close()
            world.stop(check=False)
            world = ckpt_world(size, ckpt)
            ts = register(world, range(size), n)
            times.append(time.perf_counter() - t0)
            steps(ts, 1)
        for t in ts:
            t.close()
        return times[0], times[1]
    finally:
        world.stop(check=False)
        shutil.rmtree(ckpt, True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=4 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    rows = {"live": ([], []), "checkpoint": ([], [])}
    for _ in range(a.rounds):
        for name, fn in (("live", lambda: live(a.params)),
                         ("checkpoint", lambda: checkpointed(a.params, root))):
            s, g = fn()
            rows[name][0].append(s)
            rows[name][1].append(g)
    mb = a.params * 4 * 3 / 1e6
    print(f"model: {a.params} fp32 parameters ({mb:.0f} MB of master + Adam moments); "
          f"checkpoint_dir on {root}; median of {a.rounds} rounds")
    print(f"{'':34} {'W=4 -> 2':>10} {'W=2 -> 4':>10}")
    for name, label in (("live", "live resize (zeroctl resize)"),
                        ("checkpoint", "checkpoint + stop + resume")):
        s, g = rows[name]
        print(f"{label:34} {statistics.median(s) * 1e3:8.0f} ms {statistics.median(g) * 1e3:8.0f} ms")
    print(f"{'  of which zerod (status)':34} "
          f"{statistics.median(i[0] for i in LIVE_INNER):8.0f} ms "
          f"{statistics.median(i[1] for i in LIVE_INNER):8.0f} ms")
    print("(zerod's part: the image taken over the old world and the new world formed; the grow's\n"
          " includes the wait for the new zerods to start; the rest is the trainers' steps and\n"
          " registrations, whose state transfer or checkpoint read are inside them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
