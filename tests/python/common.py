"""Shared helpers of the Python tests (suite `python`).

Each test file is a separate process run by `meson test` with ZEROD_BIN, ZEROD_LIBRARY and
PYTHONPATH set (tests/python/meson.build); run by hand from the repository root after a build,
they find ./build and client/python themselves. Exit status: 0 passed, 1 failed, 77 skipped
(meson's SKIP), never 0 for a test that did not run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import unittest
from typing import Any, Iterable, List, Optional

SKIP = 77
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# Running by hand from a source tree: the package and the build's binaries.
_pkg = os.path.join(ROOT, "client", "python")
if _pkg not in sys.path:
    sys.path.insert(0, _pkg)
if _pkg not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # for child processes
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_pkg, os.environ.get("PYTHONPATH", "")) if p)
os.environ.setdefault("ZEROD_BIN", os.path.join(ROOT, "build", "daemon", "zerod"))
os.environ.setdefault("ZEROD_LIBRARY", os.path.join(ROOT, "build", "client", "libzerod.so"))


def sanitized() -> bool:
    """Whether zerod runs under a sanitizer (scripts/sanitize.sh sets ZEROD_TEST_SANITIZER=1):
    2-15x slower on a loaded machine, so waits that catch a hang are longer there (HANG_SCALE)
    and nothing may bound how fast it is."""
    return os.environ.get("ZEROD_TEST_SANITIZER", "") not in ("", "0")


# The factor for waits that only catch a hang (start-up, shutdown, a step): 10 under a sanitizer.
HANG_SCALE = 10 if sanitized() else 1


def describe_exit(rc: Optional[int]) -> str:
    """A Popen return code in words: "exit 0", "signal 11 (SIGSEGV)", "still running"."""
    if rc is None:
        return "still running"
    if rc >= 0:
        return f"exit {rc}"
    try:
        return f"signal {-rc} ({signal.Signals(-rc).name})"
    except ValueError:
        return f"signal {-rc}"


def clean_end(sig: int) -> int:
    """How a zerod stopped by sig ends when nothing is wrong: killed by SIGKILL, else exit 0."""
    return -signal.SIGKILL if sig == signal.SIGKILL else 0


def stop_zerod(d: Any, sig: int = signal.SIGTERM, expect: Optional[int] = None,
               timeout: float = 20.0) -> None:
    """Stops a zerod.testing.LocalZerod with sig and fails, with its log, unless it ended as
    `expect` says: a Popen return code (0, or -N for death by signal N), by default
    clean_end(sig). A test that kills a zerod on purpose says so with sig (and expect, for any
    other end); a zerod that ended before, by itself, is only reaped and checked."""
    want = clean_end(sig) if expect is None else expect
    rc = d.stop(sig, timeout=timeout * HANG_SCALE, check=False)
    if rc != want:
        raise AssertionError(f"zerod (pid {d.pid}) ended with {describe_exit(rc)} after "
                             f"{signal.Signals(sig).name}, expected {describe_exit(want)}; its "
                             f"log ({d.log_path}) ends:\n{d.log()[-3000:]}")


def stop_world(world: Any, sig: int = signal.SIGTERM, expect: Optional[int] = None) -> None:
    """stop_zerod for every daemon of a zerod.testing.LocalWorld not stopped yet (a daemon the
    test stopped itself, through stop_zerod, keeps the end checked there); every daemon is
    stopped before the first failure is raised."""
    failures = []
    for i, d in enumerate(world.daemons):
        if d.returncode is not None:
            continue
        try:
            stop_zerod(d, sig, expect)
        except AssertionError as e:
            failures.append(f"zerod {i}: {e}")
    if failures:
        raise AssertionError("\n".join(failures))


def test_seed(arg: Optional[str] = None) -> int:
    """The seed of a test with random choices: arg (an integer, or "random"), else
    $ZEROD_TEST_SEED (the same), else 1. CI runs the fixed default, so that a failure
    reproduces; long runs pass random. Print it, with repeat_command()."""
    value = arg if arg is not None else os.environ.get("ZEROD_TEST_SEED", "") or "1"
    if value == "random":
        return random.SystemRandom().randrange(1 << 30)
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"seed '{value}': expected an integer or 'random'")


def repeat_command(seed: int) -> str:
    """This program's command line with --seed set to seed: what repeats the run."""
    args, skip_next = [], False
    for a in sys.argv[1:]:
        if skip_next:
            skip_next = False
        elif a == "--seed":
            skip_next = True
        elif not a.startswith("--seed="):
            args.append(a)
    return " ".join([os.path.relpath(sys.argv[0], ROOT)] + args + ["--seed", str(seed)])


def skip(reason: str) -> None:
    """Ends the test as skipped (exit 77) with the reason."""
    print(f"SKIP: {reason}", flush=True)
    sys.exit(SKIP)


def require_torch() -> Any:
    """Imports torch (1 thread, deterministic) or skips the whole test."""
    try:
        import torch
    except ImportError as e:
        skip(f"torch is not importable ({e}); install Debian's python3-torch for "
             f"/usr/bin/python3")
    torch.set_num_threads(1)
    return torch


class TimedResult(unittest.TextTestResult):
    def startTest(self, test: unittest.TestCase) -> None:
        self._t0 = time.monotonic()
        super().startTest(test)

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self.stream.write(f"    ({time.monotonic() - self._t0:.2f} s)\n")


def run(*cases: type) -> None:
    """Runs the TestCase classes verbosely and exits: 1 if anything failed, 77 if anything was
    skipped (a skip is never reported as a pass), else 0."""
    suite = unittest.TestSuite()
    loader = unittest.TestLoader()
    for c in cases:
        suite.addTests(loader.loadTestsFromTestCase(c))
    t0 = time.monotonic()
    result = unittest.TextTestRunner(verbosity=2, resultclass=TimedResult,
                                     stream=sys.stdout).run(suite)
    print(f"{result.testsRun} tests in {time.monotonic() - t0:.1f} s", flush=True)
    if not result.wasSuccessful():
        sys.exit(1)
    if result.skipped:
        print(f"SKIP: {len(result.skipped)} test(s) skipped", flush=True)
        sys.exit(SKIP)
    sys.exit(0)


def first_difference(name: str, got: Any, want: Any) -> str:
    """A message naming the first differing element of two tensors, with both values and bit
    patterns, and how many elements differ."""
    import torch

    g, w = got.detach().reshape(-1), want.detach().reshape(-1)
    if g.shape != w.shape or g.dtype != w.dtype:
        return f"{name}: shape/dtype {tuple(got.shape)}/{got.dtype} vs {tuple(want.shape)}/{want.dtype}"
    diff = (g != w) & ~(torch.isnan(g) & torch.isnan(w))
    idx = torch.nonzero(diff).reshape(-1)
    if idx.numel() == 0:
        return f"{name}: equal"
    i = int(idx[0])
    view = torch.int16 if g.dtype in (torch.bfloat16, torch.float16) else torch.int32
    gb = int(g[i:i + 1].view(view)[0]) & (0xFFFF if view == torch.int16 else 0xFFFFFFFF)
    wb = int(w[i:i + 1].view(view)[0]) & (0xFFFF if view == torch.int16 else 0xFFFFFFFF)
    maxdiff = float((g.float() - w.float()).abs().max())
    return (f"{name}[{i}] is {float(g[i])!r} (0x{gb:x}) through zerod, {float(w[i])!r} (0x{wb:x}) "
            f"in the reference; {idx.numel()} of {g.numel()} elements differ, max |diff| "
            f"{maxdiff:.3g}")


def assert_params_equal(tc: Optional[unittest.TestCase], named_got: Iterable, named_want: Iterable,
                        where: str) -> None:
    """The same parameters, in the same order, each torch.equal (shape, dtype and every bit);
    fails naming the first difference. Two lists of (name, tensor): their lengths and names
    must match, and an empty list is not a model."""
    import torch

    got, want = list(named_got), list(named_want)
    msg = None
    if not want:
        msg = f"{where}: the reference has no parameters to compare"
    elif len(got) != len(want):
        msg = (f"{where}: {len(got)} parameters through zerod, {len(want)} in the reference "
               f"({[n for n, _ in got]} vs {[n for n, _ in want]})")
    else:
        for (name, a), (wname, b) in zip(got, want):
            if name != wname:
                msg = f"{where}: parameter '{name}' through zerod where the reference has '{wname}'"
            elif not torch.equal(a, b):
                msg = f"{where}: {first_difference(name, a, b)}"
            if msg:
                break
    if msg is None:
        return
    if tc is not None:
        tc.fail(msg)
    raise AssertionError(msg)


def loss_table(rows: List[tuple], header: tuple, every: int) -> str:
    """Loss curves side by side: the first row, every `every`-th, and the last."""
    out = ["  ".join(f"{h:>14}" for h in header)]
    for k, row in enumerate(rows):
        if k == 0 or (k + 1) % every == 0 or k == len(rows) - 1:
            out.append("  ".join(f"{v:>14}" if isinstance(v, (int, str)) else f"{v:>14.6f}"
                                 for v in row))
    return "\n".join(out)


ZEROCTL = os.environ.get("ZEROCTL_BIN", os.path.join(ROOT, "build", "client", "zeroctl"))


def rank_health(control_address: str) -> str:
    """The first rank's health in the status of the zerod at control_address ("" when it does
    not answer): the trial programs' way to see a survivor re-forming the world."""
    out = subprocess.run([ZEROCTL, "--address", control_address, "status", "--json"],
                         capture_output=True, text=True, timeout=30)
    try:
        return json.loads(out.stdout)["ranks"][0]["health"]
    except (ValueError, KeyError, IndexError):
        return ""


def percentile(xs: List[float], q: float) -> float:
    """The q-quantile (0..1) of xs by rank, nan when empty: the trial programs' tables."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
