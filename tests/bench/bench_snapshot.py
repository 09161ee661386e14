#!/usr/bin/env python3
"""State snapshots (state_dir_mode = snapshot), measured in one run on this machine: what a
snapshot costs the step that takes it (the worker's wait for the backend's snapshot op: on the CPU
backend the copy itself, on CUDA only its queuing), the writer thread's time for the file, and the
step time with a snapshot every --every steps against snapshots off.

W=1, the CPU backend (ZEROD_BACKEND, default cpu), one zerod per setting, a model of 2^--log2
fp32 parameters (default 2^22: 48 MiB of master and moments per snapshot), a state_dir on tmpfs.
The two zerods step in turn (--rounds of --steps steps each, after --warmup), so that a drift of
the machine's load falls on both; the rows are the median client step time of each and the
slowdown, then the medians of the stall (last_stall_us) and the writer's time (last_write_ms)
read from the status after each snapshot.

Run by hand: ZEROD_BIN=build/daemon/zerod ZEROD_LIBRARY=build/client/libzerod.so \\
PYTHONPATH=client/python:tests/python python3 tests/bench/bench_snapshot.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import zerod.testing


def trainer(d, n: int):
    c = d.connect()
    c.layout([("w", (n,))], grad_mean=False)
    np.frombuffer(c.param_buffer, dtype=np.float32)[:] = 0.5
    np.frombuffer(c.grad_buffer, dtype=np.float32)[:] = 0.01
    c.register()
    return c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log2", type=int, default=22)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args()
    n = 1 << a.log2
    top = tempfile.mkdtemp(prefix="zerod-bench-snap-", dir=a.dir)
    backend = os.environ.get("ZEROD_BACKEND", "cpu")
    try:
        off = zerod.testing.LocalZerod(["--backend", backend])
        on = zerod.testing.LocalZerod(
            ["--backend", backend, "--state_dir", os.path.join(top, "state"), "--state_dir_mode",
             "snapshot", "--state_snapshot_every_steps", str(a.every)])
        co, cn = trainer(off, n), trainer(on, n)
        times = {"off": [], "on": []}
        stalls, writes = [], []
        for _ in range(a.warmup):
            co.step()
            cn.step()
        step = a.warmup
        for r in range(a.rounds):
            for name, c in (("off", co), ("on", cn)) if r % 2 == 0 else (("on", cn), ("off", co)):
                for _ in range(a.steps):
                    t0 = time.perf_counter()
                    c.step()
                    times[name].append(time.perf_counter() - t0)
            step += a.steps
            # the newest snapshot's figures (one per round: the writer is done by the next round)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                sn = cn.status_dict()["snapshot"]
                if sn.get("rank0_snapshot_step") == str(step - step % a.every):
                    break
                time.sleep(0.01)
            stalls.append(int(sn["rank0_last_stall_us"]))
            writes.append(int(sn["rank0_last_write_ms"]))
        mo, mn = statistics.median(times["off"]), statistics.median(times["on"])
        mean_o, mean_n = statistics.mean(times["off"]), statistics.mean(times["on"])
        print(f"2^{a.log2} fp32 parameters ({n * 12 / 2**20:.0f} MiB of master and moments), "
              f"{backend} backend, a snapshot every {a.every} steps, "
              f"{a.rounds} x {a.steps} steps each")
        print(f"  step time  off: median {mo * 1e3:.2f} ms, mean {mean_o * 1e3:.2f} ms")
        print(f"             on:  median {mn * 1e3:.2f} ms, mean {mean_n * 1e3:.2f} ms "
              f"({(mn / mo - 1) * 100:+.1f}% median, {(mean_n / mean_o - 1) * 100:+.1f}% mean)")
        print(f"  snapshot stall (the step's wait): median {statistics.median(stalls)} us "
              f"(samples {stalls})")
        print(f"  writer (fence, checksum, file):  median {statistics.median(writes)} ms "
              f"(samples {writes})")
        sn = cn.status_dict()["snapshot"]
        print(f"  snapshots {sn['rank0_snapshots']}, skipped {sn['rank0_skipped']}, "
              f"failures {sn['rank0_failures']}")
        co.close()
        cn.close()
        off.stop()
        on.stop()
    finally:
        shutil.rmtree(top, True)


if __name__ == "__main__":
    main()
