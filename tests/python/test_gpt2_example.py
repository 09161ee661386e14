"""Runs examples/train_gpt2.py (--size tiny, 30 steps) as a user would and checks what it prints:
a progress line every 3 steps (step, loss, tokens/s, zerod's step time), a summary whose loss
fell well below ln(vocab), and with --compare a largest parameter difference of 0.0 against
torch.optim.AdamW on a copy; once with one trainer, once with two (--world 2, untied head).
Batches and contexts are shortened to keep the test near 30 s on a 2-core machine. Then
--device cuda: trains on the GPU where torch has CUDA (the difference is printed, not required
to be 0: zerod's CUDA update is not bit-identical to any torch CUDA AdamW), else must exit with
status 2 and say why."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from typing import Dict, List

import common

torch = common.require_torch()

SCRIPT = os.path.join(common.ROOT, "examples", "train_gpt2.py")
STEPS = 30
PROGRESS = re.compile(r"^step +(\d+)/(\d+)  loss (\d+\.\d+) +([\d,]+) tokens/s  zerod step "
                      r"(\d+\.\d+) ms", re.M)
LOSS = re.compile(r"loss \(mean over ranks\): (\d+\.\d+) at step 1 -> (\d+\.\d+)")
THROUGHPUT = re.compile(r"throughput: ([\d,]+) tokens/s, zerod step (\d+\.\d+) ms mean")
DIFF = re.compile(r"torch\.optim\.AdamW on a copy: max \|diff\| (\S+) over")


def run_example(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, SCRIPT, "--size", "tiny", "--steps", str(STEPS), "--threads", "1",
           *args]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=common.ROOT)
    print(f"$ {' '.join(cmd[1:])}")
    print(r.stdout, end="")
    print(r.stderr, end="", file=sys.stderr)
    print(f"ran in {time.monotonic() - t0:.1f} s (exit status {r.returncode})\n", flush=True)
    return r


def check_training(r: subprocess.CompletedProcess, exact: bool) -> List[str]:
    """What is wrong with a training run's output (empty: nothing)."""
    out = r.stdout
    if r.returncode != 0:
        return [f"exit status {r.returncode}, expected 0"]
    failed = []
    steps = [int(m.group(1)) for m in PROGRESS.finditer(out)]
    if steps != list(range(3, STEPS + 1, 3)):
        failed.append(f"progress lines at steps {steps}, expected every 3rd step up to {STEPS}")
    loss = LOSS.search(out)
    if not loss:
        failed.append("no summary loss line")
    else:
        first, last = float(loss.group(1)), float(loss.group(2))
        # Random init starts near ln(256) = 5.545; 30 steps bring it at least 0.5 lower.
        if not (abs(first - math.log(256)) < 0.3 and last < first - 0.5):
            failed.append(f"loss {first} at step 1 -> {last} at the end: expected it to start "
                          f"near ln(256) = {math.log(256):.3f} and fall by 0.5 or more")
    tp = THROUGHPUT.search(out)
    if not tp or float(tp.group(1).replace(",", "")) <= 0 or float(tp.group(2)) <= 0:
        failed.append("no summary throughput line with tokens/s and zerod's step time above 0")
    diff = DIFF.search(out)
    if not diff:
        failed.append("no --compare line")
    elif exact and diff.group(1) != "0.0":
        failed.append(f"max |diff| against torch.optim.AdamW is {diff.group(1)}, expected 0.0 "
                      f"(bitwise identical on CPU)")
    return failed


def main() -> None:
    failures: Dict[str, List[str]] = {}
    runs = {
        "W=1": ["--compare", "--batch", "4", "--context", "32"],
        "W=2": ["--world", "2", "--compare", "--batch", "2", "--context", "32", "--untied-head"],
    }
    for name, args in runs.items():
        failures[name] = check_training(run_example(*args), exact=True)
    if torch.cuda.is_available():
        failures["cuda"] = check_training(run_example("--device", "cuda", "--compare"),
                                          exact=False)
    else:
        r = run_example("--device", "cuda")
        if r.returncode != 2 or "--device cuda: torch" not in r.stderr \
                or "sees no CUDA GPU" not in r.stderr:
            failures["cuda unavailable"] = [f"exit status {r.returncode} (expected 2) and stderr "
                                            f"{r.stderr.strip()!r} (expected it to say torch "
                                            f"sees no CUDA GPU)"]
    bad = {k: v for k, v in failures.items() if v}
    for name, problems in bad.items():
        print(f"FAIL {name}: {'; '.join(problems)}")
    if bad:
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
