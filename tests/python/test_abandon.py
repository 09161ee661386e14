"""ZeroOptimizer when another trainer dies (docs/design.md, "When a trainer dies").

Two trainer processes train a small torch model through one zerod of two local ranks, with the
backward hooks scattering every bucket. Trainer 0 kills itself with SIGKILL after its backward
in step 3 (its scatters sent, its step not): trainer 1's step() gets ZD_EABORTED, warns and
retries by itself; a restarted trainer 0 reattaches alone (resumed, at step 3) and trains on.
After the last step both trainers' parameters are bitwise equal to those of the same run in
which nobody died. With abort_retries=0 the error comes out of step() instead, retryable, and a
second step() completes the step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import warnings

from common import require_torch

STEPS = 6
KILL_STEP = 3


def trainer(args: argparse.Namespace) -> None:
    torch = require_torch()
    import zerod
    from zerod.torch import ZeroOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    report = {"warnings": [], "errors": 0}
    opt = ZeroOptimizer(model.named_parameters(), lr=1e-2, socket=args.socket,
                        local_rank=args.rank, abort_retries=args.retries)
    report["resumed"], report["resume_step"] = opt.resumed, opt.step_count
    for step in range(opt.step_count, STEPS):
        g = torch.Generator().manual_seed(100 * step + args.rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == KILL_STEP and args.die:
            time.sleep(0.1)  # the hooks' scatters are sent; let zerod read them
            os.kill(os.getpid(), signal.SIGKILL)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt.step()
            except zerod.ZerodError as e:
                assert e.retryable, e
                report["errors"] += 1
                report["error"] = e.message
                opt.step()  # the gradients are still there
        report["warnings"] += [str(w.message) for w in caught]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    report["bits"] = flat.view(torch.int32).tolist()
    opt.close()
    with open(args.out, "w") as f:
        json.dump(report, f)


def run(world, tmp: str, name: str, die: bool, retries: int = 3) -> list:
    """Both trainers to the end; trainer 0 started again if it died. Their reports."""
    def spawn(rank: int, dies: bool) -> subprocess.Popen:
        sock, local = world.endpoint(rank)
        return subprocess.Popen([sys.executable, __file__, "--trainer", "--socket", sock,
                                 "--rank", str(local), "--retries", str(retries),
                                 "--out", os.path.join(tmp, f"{name}{rank}.json")]
                                + (["--die"] if dies else []))
    procs = [spawn(0, die), spawn(1, False)]
    if die:
        rc = procs[0].wait(timeout=120)
        assert rc == -signal.SIGKILL, f"trainer 0 exited with {rc}, expected SIGKILL"
        procs[0] = spawn(0, False)
    for r, p in enumerate(procs):
        rc = p.wait(timeout=120)
        assert rc == 0, f"{name}: trainer {r} exited with {rc}"
    out = []
    for r in range(2):
        with open(os.path.join(tmp, f"{name}{r}.json")) as f:
            out.append(json.load(f))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", action="store_true")
    parser.add_argument("--socket")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--die", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--overlap", action="store_true",
                        help="zerod with overlap_update = 1 (buckets updated as scattered)")
    args = parser.parse_args()
    if args.trainer:
        trainer(args)
        return
    require_torch()
    import tempfile

    from zerod.testing import LocalWorld

    settings = ["--bucket_elems", "64", "--collective_timeout_ms", "60000", "--threads", "1"]
    if args.overlap:
        settings += ["--overlap_update", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        with LocalWorld(2, args=settings, log_level="info") as world:
            ref = run(world, tmp, "ref", die=False)
        assert ref[0]["bits"] == ref[1]["bits"], "the reference's ranks differ"
        for retries in (3, 0):
            with LocalWorld(2, args=settings, log_level="info") as world:
                got = run(world, tmp, f"kill{retries}", die=True, retries=retries)
                log = world.log()
            assert got[0]["resumed"] and got[0]["resume_step"] == KILL_STEP, got[0]
            survivor = got[1]
            if retries:
                assert survivor["errors"] == 0, survivor
                assert len(survivor["warnings"]) == 1, survivor["warnings"]
                msg = survivor["warnings"][0]
                assert "retrying the step (1 of 3)" in msg, msg
            else:
                assert survivor["errors"] == 1 and not survivor["warnings"], survivor
                msg = survivor["error"]
            assert f"step {KILL_STEP + 1} abandoned: rank 0's trainer disconnected" in msg, msg
            assert "stood in for it" in log, log
            for r in range(2):
                assert got[r]["bits"] == ref[0]["bits"], f"rank {r} differs from the reference"
            print(f"abort_retries={retries}: trainer 0 killed after its backward; trainer 1: "
                  f"{msg}; trainer 0 resumed at step {KILL_STEP}; parameters of both ranks "
                  f"bitwise equal to the run without a failure", flush=True)
    print("test_abandon.py: ok")


if __name__ == "__main__":
    main()
