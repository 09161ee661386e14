"""Runs examples/train_torch.py (a short run) as a user would and checks what it prints: the
progress bar, the final loss next to the torch-only baseline, and parameters bitwise identical
to the baseline; then twice against a zerod started beforehand (--socket), as the README's first
steps do: the second run must start afresh, not resume the first one's model."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import common

common.require_torch()

from zerod.testing import LocalZerod  # noqa: E402 (after the path set-up in common)


SCRIPT = os.path.join(common.ROOT, "examples", "train_torch.py")


def run_example(*args: str) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, SCRIPT, "--steps", "60", *args], capture_output=True,
                       text=True, timeout=240, cwd=common.ROOT)
    print(r.stdout, end="")
    print(r.stderr, end="", file=sys.stderr)
    print(f"example {' '.join(args)} ran in {time.monotonic() - t0:.1f} s "
          f"(exit status {r.returncode})")
    return r


def check(r: subprocess.CompletedProcess) -> None:
    out = r.stdout
    checks = {
        "exit status 0": r.returncode == 0,
        "progress bar, labelled rank-0 loss": "step    60/60 rank-0 loss" in out,
        "final mean loss next to the baseline": "final mean loss: zerod" in out
        and "torch-only baseline" in out,
        "bitwise identical": "parameters bitwise identical to the baseline: yes" in out,
    }
    failed = [k for k, ok in checks.items() if not ok]
    if failed:
        print(f"FAIL: {', '.join(failed)}")
        sys.exit(1)


def main() -> None:
    check(run_example())
    with LocalZerod(["--local_ranks", "2"], log_level="info") as zd:
        for _ in range(2):
            check(run_example("--socket", zd.socket))
    print("ok")


if __name__ == "__main__":
    main()
