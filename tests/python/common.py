"""Shared helpers of the Python tests (suite `python`).

Each test file is a separate process run by `meson test` with ZEROD_BIN, ZEROD_LIBRARY and
PYTHONPATH set (tests/python/meson.build); run by hand from the repository root after a build,
they find ./build and client/python themselves. Exit status: 0 passed, 1 failed, 77 skipped
(meson's SKIP), never 0 for a test that did not run.
"""

from __future__ import annotations

import os
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
    """torch.equal on every parameter; fails naming the first difference."""
    import torch

    for (name, a), (_, b) in zip(named_got, named_want):
        if not torch.equal(a, b):
            msg = f"{where}: {first_difference(name, a, b)}"
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
