"""Runs examples/train_torch.py (a short run) as a user would and checks what it prints: the
progress bar, the final loss next to the torch-only baseline, and parameters bitwise identical
to the baseline."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import common

common.require_torch()


def main() -> None:
    script = os.path.join(common.ROOT, "examples", "train_torch.py")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, script, "--steps", "60"], capture_output=True, text=True,
                       timeout=240, cwd=common.ROOT)
    out = r.stdout
    print(out, end="")
    print(r.stderr, end="", file=sys.stderr)
    print(f"example ran in {time.monotonic() - t0:.1f} s (exit status {r.returncode})")
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
    print("ok")


if __name__ == "__main__":
    main()
