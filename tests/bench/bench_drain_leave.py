#!/usr/bin/env python3
"""zeroctl drain --leave, timed: from the request to the survivors training again.

A world of --world zerods (one rank each, CPU backend, unix sockets on loopback) trains a model of
--params fp32 parameters (default 1M: master, exp_avg and exp_avg_sq, 12 MB in all), a trainer
per rank on a thread stepping in a loop. `zeroctl drain --leave` on the node of the highest rank
is sent while they step: the resize rides the next step, the leaving rank's trainer gets ZD_ERANK
and stops, the others get ZD_EPEER, lay the model out for the smaller world on a new connection,
register again (zerod hands them their new shards) and step on. Timed: the request to every
survivor's first step answered in the new world, and zeroctl's own call (until the node's rank has
left). Also the survivors' own part, from status ("step S: W -> W-1 ranks in N ms": the image
all-gathered, the world re-formed). Median of --rounds rounds.

Run by hand: ZEROD_BIN=build/daemon/zerod ZEROD_LIBRARY=build/client/libzerod.so \\
ZEROCTL_BIN=build/client/zeroctl PYTHONPATH=client/python:tests/python \\
python3 tests/bench/bench_drain_leave.py [--world 2] [--params 1048576] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import common  # noqa: E402  (sets up sys.path and the library)

import numpy as np  # noqa: E402

import zerod.testing  # noqa: E402
from zerod import ZerodError  # noqa: E402

ARGS = ["--heartbeat_ms", "100", "--peer_timeout_ms", "1000", "--log_level", "info"]
ZD_EPEER, ZD_ERANK = -4014, -4011


def zeroctl_exe() -> str:
    return os.environ.get("ZEROCTL_BIN", os.path.join(common.ROOT, "build", "client", "zeroctl"))


def own_ms(d) -> float:
    out = subprocess.run([zeroctl_exe(), "--address", d.control_address, "status", "--json"],
                         capture_output=True, text=True, timeout=30)
    last = json.loads(out.stdout)["ranks"][0].get("last_resize", "")
    return float(last.split(" in ")[1].split(" ms")[0]) if " in " in last else float("nan")


class Loop(threading.Thread):
    """One rank's trainer: steps until it leaves (ZD_ERANK) or the round ends; on ZD_EPEER
    registers again on a new connection (the layout of the new world size)."""

    def __init__(self, world, rank: int, n: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.world, self.rank, self.n, self.stop = world, rank, n, stop
        self.steps = 0
        self.first_after: float = 0.0  # when the first step in the new world was answered
        self.error: BaseException = None
        self.open()  # registered in run(): a registration waits for every rank's

    def open(self) -> None:
        self.client = self.world.connect(self.rank)
        self.client.layout([("w", (self.n,))], grad_mean=False)
        info = self.client.param_info(0)
        p = np.frombuffer(self.client.param_buffer, dtype=np.float32)[info.offset:][:self.n]
        g = np.frombuffer(self.client.grad_buffer, dtype=np.float32)[info.offset:][:self.n]
        p[:] = 0.5
        g[:] = np.float32(1e-3) if self.rank == 0 else np.float32(0)

    def run(self) -> None:
        resized = False
        try:
            self.client.register()
            while not self.stop.is_set():
                try:
                    self.client.step()
                except ZerodError as e:
                    if e.code == ZD_ERANK:
                        return  # this rank left
                    if e.code != ZD_EPEER or resized:
                        raise
                    resized = True
                    self.client.close()
                    self.open()
                    self.client.register()
                    continue
                self.steps += 1
                if resized and not self.first_after:
                    self.first_after = time.perf_counter()
        except BaseException as e:  # noqa: BLE001  (reported by the round)
            self.error = e
        finally:
            try:
                self.client.close()
            except ZerodError:
                pass


def round_(w: int, n: int) -> tuple:
    world = zerod.testing.LocalWorld(w, daemons=w, args=ARGS, log_level="info", timeout=60.0)
    stop = threading.Event()
    loops = []
    try:
        loops = [Loop(world, r, n, stop) for r in range(w)]
        for t in loops:
            t.start()
        while min(t.steps for t in loops) < 3:
            time.sleep(0.01)
        t0 = time.perf_counter()
        out = subprocess.run([zeroctl_exe(), "--address", world.daemons[w - 1].control_address,
                              "drain", "--leave", "--wait", "120"],
                             capture_output=True, text=True, timeout=180)
        t_ctl = time.perf_counter() - t0
        if out.returncode:
            raise RuntimeError(f"drain --leave: {out.stderr}")
        while any(not t.first_after and t.error is None for t in loops[:-1]):
            time.sleep(0.005)
        for t in loops:
            if t.error:
                raise t.error
        t_all = max(t.first_after for t in loops[:-1]) - t0
        inner = own_ms(world.daemons[0])
        stop.set()
        for t in loops:
            t.join(30)
        world.daemons[w - 1].process.wait(30)
        return t_all * 1e3, t_ctl * 1e3, inner
    finally:
        stop.set()
        world.stop(check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--params", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rows = [round_(a.world, a.params) for _ in range(a.rounds)]
    med = [statistics.median(r[i] for r in rows) for i in range(3)]
    print(f"drain --leave W={a.world} -> {a.world - 1}, {a.params} fp32 parameters, median of "
          f"{a.rounds}:")
    print(f"  request -> every survivor's first step in the new world: {med[0]:7.1f} ms")
    print(f"  zeroctl drain --leave answered (the node's rank left):    {med[1]:7.1f} ms")
    print(f"  survivors' own part (status: image, re-forming):          {med[2]:7.1f} ms")
    print("  rounds: " + "; ".join(f"{r[0]:.0f}/{r[1]:.0f}/{r[2]:.0f}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
