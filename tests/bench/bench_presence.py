"""The cost of parameters without a gradient on a step (issue 31): one zerod (CPU backend, W=1),
one model of --params parameters of --elems elements each (AdamW), stepped through the client
API in one run, three phases of --steps steps each:

  none     every parameter has a gradient (the step carries no bitmap: the common case)
  half     every other parameter has none (StepRequest.absent: skipped, as torch skips them)
  lagging  every parameter has one again, but half of them lag the model's step (their own
           bias corrections: the update's segments rebuilt per parameter)

Prints the median of zerod's own step time (StepReply.duration_us) and of the client's wall time
per phase, and each phase's ratio to `none`. Run by hand (README "Benchmarks"):
  ZEROD_BIN=build/daemon/zerod ZEROD_LIBRARY=build/client/libzerod.so \\
  PYTHONPATH=client/python python3 tests/bench/bench_presence.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Optional, Tuple

import zerod.testing
from zerod.client import Client


def phase(c: Client, steps: int, absent: Optional[List[int]]) -> Tuple[float, float]:
    zd: List[float] = []
    wall: List[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        r = c.step(absent=absent)
        wall.append((time.perf_counter() - t0) * 1e6)
        zd.append(float(r.duration_us))
    return statistics.median(zd), statistics.median(wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=256)
    ap.add_argument("--elems", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=0, help="zerod's threads (0: its default)")
    a = ap.parse_args()
    args = ["--threads", str(a.threads)] if a.threads else []
    with zerod.testing.LocalZerod(args) as d:
        c = Client(d.socket)
        try:
            c.layout([(f"p{i}", (a.elems,)) for i in range(a.params)],
                     [{"lr": 1e-3, "weight_decay": 0.01}])
            c.register()
            phase(c, 3, None)  # warm-up
            rows: Dict[str, Tuple[float, float]] = {}
            rows["none"] = phase(c, a.steps, None)
            rows["half"] = phase(c, a.steps, list(range(0, a.params, 2)))
            rows["lagging"] = phase(c, a.steps, None)
        finally:
            c.close()
    total = a.params * a.elems
    print(f"{a.params} parameters x {a.elems} elements ({total / 1e6:.1f}M), W=1, CPU backend, "
          f"median of {a.steps} steps each, one run")
    print(f"{'phase':<9} {'zerod step us':>14} {'ratio':>6} {'client us':>10} {'ratio':>6}")
    base_zd, base_wall = rows["none"]
    for name, (zd, wall) in rows.items():
        print(f"{name:<9} {zd:>14.0f} {zd / base_zd:>6.2f} {wall:>10.0f} {wall / base_wall:>6.2f}")


if __name__ == "__main__":
    main()
