#!/usr/bin/env python3
"""What the optimizer update adds to a real torch trainer's iteration on CPU: forward + backward
alone, ZeroOptimizer's default gather (inside step()) and gather="lazy" (each bucket gathered
just before its layers' forward), both on a zerod with overlap_update = 1, at world size 1.

The model is an MLP (--width square layers, no bias; --layers of them) on the CPU, torch on one
thread; the trainer runs on the first CPU of this process's affinity mask, every zerod on the
last (--threads 1), as tests/bench/bench_overlap does. Per batch size (--batch; a list), one
iteration is zero_grad, forward, an MSE loss, backward (whose hooks scatter each bucket as it is
complete) and step(); for the lazy kind the next forward's waits count in the next iteration, so
each timed iteration follows an untimed one back to back (no pause hides the parameters' writes).
The kinds alternate within each round (--rounds); a row gives each kind's median:

  update_ms  the update alone: step() of a third zerod (overlap_update = 0, gather inside) after
             the scatters of a backward without hooks (overlap=False scatters inside step(): at
             W=1 zerod reads the gradients in place, so step() is the update and the write)
  fb_ms      forward + backward alone (a plain copy of the model, no optimizer, .grad set to
             None before each backward: torch 2.x's zero_grad default)
  fbz_ms     the same with the gradients kept and zeroed in place (torch's
             zero_grad(set_to_none=False)): what ZeroOptimizer's grad buffer does by design (a
             memset, then backward adds into it), so fbz_ms - fb_ms is the trainer-side cost of
             the buffer, not of the update
  step_ms / lazy_ms   the whole iteration with each kind
  +step, +lazy        what the update adds to forward + backward (over fb_ms)
  +lz/z      what lazy adds over fbz_ms (the update's share alone)
  bwd/up     backward's share of fb_ms (measured as fb_ms minus a forward alone) over update_ms;
             the issue's target (+<= 10%) applies where it is above 1

The load average before and after the run is printed: the VM is shared, and the figures move
with it.

Run by hand: ZEROD_BIN=build/daemon/zerod ZEROD_LIBRARY=build/client/libzerod.so \\
PYTHONPATH=client/python python3 tests/bench/bench_lazy.py [--width 1024 --layers 6]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

SKIP = 77


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", default="48,96", help="batch sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--bucket_elems", type=int, default=0,
                    help="zerod's bucket size (default: one layer per bucket)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 2 rounds")
    a = ap.parse_args()
    if a.smoke:
        a.width, a.layers, a.batch, a.rounds = 64, 3, "8", 2
    try:
        import torch
    except ImportError as e:
        print(f"SKIP: torch is not importable ({e})")
        sys.exit(SKIP)
    import zerod.testing
    from zerod.torch import ZeroOptimizer

    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    first, last = cpus[0], cpus[-1]
    bucket = a.bucket_elems or a.width * a.width
    load_before = os.getloadavg()

    def model_() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width, bias=False)
                                     for _ in range(a.layers)])

    # zerods inherit the last CPU; the trainer then moves to the first.
    os.sched_setaffinity(0, {last})
    common = ["--threads", "1", "--log_level", "warn", "--bucket_elems", str(bucket)]
    daemons = [zerod.testing.LocalZerod(common + ["--overlap_update", "1"]),
               zerod.testing.LocalZerod(common + ["--overlap_update", "1"]),
               zerod.testing.LocalZerod(common)]
    os.sched_setaffinity(0, {first})
    try:
        plain, kept = model_(), model_()
        for p in kept.parameters():
            p.grad = torch.zeros_like(p)
        m_step, m_lazy, m_up = model_(), model_(), model_()
        o_step = ZeroOptimizer(m_step.parameters(), lr=1e-4, socket=daemons[0].socket)
        o_lazy = ZeroOptimizer(m_lazy.parameters(), lr=1e-4, socket=daemons[1].socket,
                               gather="lazy", module=m_lazy)
        o_up = ZeroOptimizer(m_up.parameters(), lr=1e-4, socket=daemons[2].socket,
                             overlap=False)
        n = sum(p.numel() for p in plain.parameters())
        print(f"MLP {a.layers} x {a.width}x{a.width}: {n} parameters (2^{n.bit_length() - 1:d}"
              f"..2^{n.bit_length()}), {o_step.info.nbuckets} buckets; trainer on CPU {first}, "
              f"zerods on CPU {last}; load average {load_before[0]:.2f} {load_before[1]:.2f} "
              f"{load_before[2]:.2f}", flush=True)
        print(f"{'batch':>6} {'update_ms':>9} {'fwd_ms':>7} {'fb_ms':>7} {'fbz_ms':>7} "
              f"{'step_ms':>8} {'lazy_ms':>8} {'+step':>7} {'+lazy':>7} {'+lz/z':>7} "
              f"{'bwd/up':>7} {'tgt_lazy':>8}", flush=True)
        for batch in [int(b) for b in a.batch.split(",")]:
            x = torch.randn(batch, a.width)
            y = torch.randn(batch, a.width)

            def fb(m: torch.nn.Module) -> None:
                torch.nn.functional.mse_loss(m(x), y).backward()

            def it_plain() -> None:
                for p in plain.parameters():
                    p.grad = None
                fb(plain)

            def it_kept() -> None:
                for p in kept.parameters():
                    p.grad.zero_()
                fb(kept)

            def it_fwd() -> None:
                with torch.no_grad():
                    plain(x)

            def it_opt(m: torch.nn.Module, o: Any) -> Callable[[], None]:
                def it() -> None:
                    o.zero_grad()
                    fb(m)
                    o.step()
                return it

            def it_update() -> float:
                o_up.zero_grad()
                fb(m_up)
                t0 = time.perf_counter()
                o_up.step()
                return time.perf_counter() - t0

            kinds: Dict[str, Callable[[], None]] = {
                "fwd": it_fwd, "fb": it_plain, "fbz": it_kept, "step": it_opt(m_step, o_step),
                "lazy": it_opt(m_lazy, o_lazy)}
            times: Dict[str, List[float]] = {k: [] for k in list(kinds) + ["update"]}
            for k in kinds.values():  # warm-up
                k()
                k()
            it_update()
            for _ in range(a.rounds):
                for name, it in kinds.items():
                    it()  # back to back: the timed one starts where the last one left zerod
                    t0 = time.perf_counter()
                    it()
                    times[name].append(time.perf_counter() - t0)
                times["update"].append(it_update())
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            fbm = med["fb"]
            add_step = (med["step"] - fbm) / fbm * 100
            add_lazy = (med["lazy"] - fbm) / fbm * 100
            lz_z = (med["lazy"] - med["fbz"]) / med["fbz"] * 100
            ratio = (fbm - med["fwd"]) / med["update"]
            target = "n/a" if ratio <= 1 else ("met" if add_lazy <= 10 else "missed")
            print(f"{batch:>6} {med['update']:>9.2f} {med['fwd']:>7.2f} {fbm:>7.2f} "
                  f"{med['fbz']:>7.2f} {med['step']:>8.2f} {med['lazy']:>8.2f} "
                  f"{add_step:>6.1f}% {add_lazy:>6.1f}% {lz_z:>6.1f}% {ratio:>7.2f} "
                  f"{target:>8}", flush=True)
        o_lazy.wait_params()
        # The lazy model is the default one's, bit for bit: both saw the same steps.
        same = all(torch.equal(p, q) for p, q in zip(m_step.parameters(), m_lazy.parameters()))
        for o in (o_step, o_lazy, o_up):
            o.close()
    finally:
        for d in daemons:
            d.stop()
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; "
          f"lazy and default parameters {'bitwise equal' if same else 'DIFFER'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
