#!/usr/bin/env python3
"""Trains a small PyTorch model through zerod and compares it with torch alone.

The script starts a local zerod world (one daemon serving `--world-size` ranks), starts one
trainer process per rank, each attached to its rank through zerod.torch.ZeroOptimizer, and
trains a small MLP classifier, each rank on its own batches (data parallel: zerod averages the
ranks' gradients). Then it trains the same model with torch.optim.AdamW in this process on the
same global batches and prints the final loss of both, and whether the parameters are identical.

Run from the repository root after a build (ninja -C build):

    /usr/bin/python3 examples/train_torch.py [--world-size N] [--steps N]

With --socket PATH it starts no zerod and trains against the one listening there instead (it must
serve --world-size local ranks, e.g. `zerod --local_ranks 2`); the model's state there is
replaced at the start, so every run begins afresh.

The zerod binary and libzerod come from ./build unless ZEROD_BIN / ZEROD_LIBRARY say otherwise.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from queue import Empty
from typing import Any, Dict, List, Tuple

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
if os.path.isdir(os.path.join(ROOT, "client", "python", "zerod")):
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))  # the tree's package first
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(ROOT, "client", "python"), os.environ.get("PYTHONPATH")) if p)
os.environ.setdefault("ZEROD_BIN", os.path.join(ROOT, "build", "daemon", "zerod"))
os.environ.setdefault("ZEROD_LIBRARY", os.path.join(ROOT, "build", "client", "libzerod.so"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zerod  # noqa: E402
import zerod.testing  # noqa: E402
from zerod.torch import ZeroOptimizer  # noqa: E402

N_IN, HIDDEN, N_CLASSES, BATCH = 64, 256, 16, 128


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N_IN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN),
                         nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, N_CLASSES))


def make_batch(step: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of step `step`: points labelled by a fixed random teacher."""
    teacher = torch.randn(N_IN, N_CLASSES, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(100_003 * step + rank)
    x = torch.randn(BATCH, N_IN, generator=g)
    return x, (x @ teacher).argmax(dim=-1)


def make_optimizer_args(steps: int) -> Dict[str, Any]:
    return dict(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.05)


def schedule(steps: int):
    warmup = max(1, steps // 10)
    return lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1.0 - s / steps)


class Progress:
    """A plain-text progress bar (carriage returns on a terminal, a line per 10% otherwise)."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width, self.t0 = total, width, time.monotonic()
        self.tty = sys.stdout.isatty()
        self.next_line = 0

    def update(self, done: int, loss: float) -> None:
        rate = done / max(1e-9, time.monotonic() - self.t0)
        fill = int(self.width * done / self.total)
        text = (f"[{'#' * fill}{'.' * (self.width - fill)}] step {done:>5}/{self.total} "
                f"rank-0 loss {loss:.4f}  {rate:6.1f} steps/s")
        if self.tty:
            sys.stdout.write("\r" + text + ("\n" if done == self.total else ""))
            sys.stdout.flush()
        elif done >= self.next_line or done == self.total:
            print(text, flush=True)
            self.next_line = done + max(1, self.total // 10)


def trainer(rank: int, world: int, endpoint: Tuple[str, int], steps: int, queue: Any,
            replace: bool) -> None:
    """One rank: train through zerod, report losses and (rank 0) the final parameters."""
    try:
        torch.set_num_threads(1)
        model = make_model()
        opt = ZeroOptimizer(model.named_parameters(), socket=endpoint[0],
                            local_rank=endpoint[1], replace=replace,
                            **make_optimizer_args(steps))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(steps))
        if opt.resumed:  # a rerun against a daemon that still holds this model
            print(f"rank {rank}: resumed at step {opt.step_count}", flush=True)
        bar = Progress(steps) if rank == 0 else None
        losses = []
        for step in range(steps):
            x, y = make_batch(step, rank)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # the hooks scatter each bucket as soon as its gradients are final
            opt.step()
            sched.step()
            losses.append(loss.item())
            if bar:
                bar.update(step + 1, loss.item())
        status = opt.client.rank_status()
        result = {"losses": losses, "step_us": int(status["mean_step_us"]),
                  "buckets": opt.info.nbuckets}
        if rank == 0:
            # numpy arrays travel by value (torch tensors would be shared through file
            # descriptors that die with this process)
            result["params"] = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        opt.close()
        queue.put((rank, result))
    except BaseException as e:  # report instead of hanging the parent
        import traceback
        queue.put((rank, {"error": f"{e}\n{traceback.format_exc()}"}))


def baseline(world: int, steps: int) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """The same training with torch.optim.AdamW in this process: the mean of the ranks'
    gradients (summed in rank order) each step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **make_optimizer_args(steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(steps))
    params = list(model.parameters())
    losses = []
    for step in range(steps):
        total = None
        step_losses = []
        for r in range(world):
            for p in params:
                p.grad = None
            x, y = make_batch(step, r)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            step_losses.append(loss.item())
            g = [p.grad for p in params]
            total = g if total is None else [a + b for a, b in zip(total, g)]
        for p, g in zip(params, total):
            p.grad = g * (1.0 / world) if world > 1 else g
        opt.step()
        sched.step()
        losses.append(sum(step_losses) / world)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def collect(procs: List[Any], queue: Any) -> Dict[int, Dict[str, Any]]:
    """Each trainer's result; a trainer that died without one becomes an error."""
    results: Dict[int, Dict[str, Any]] = {}
    while len(results) < len(procs):
        try:
            r, res = queue.get(timeout=1.0)
            results[r] = res
        except Empty:
            for r, p in enumerate(procs):
                if r not in results and p.exitcode is not None:
                    time.sleep(0.5)  # a result it put just before exiting may still be in flight
                    if queue.empty():
                        results[r] = {"error": f"trainer exited with status {p.exitcode}"}
    for p in procs:
        p.join()
    return results


class RunningZerod:
    """A zerod started by someone else: trainer r attaches to its local rank r."""

    def __init__(self, socket: str) -> None:
        self.socket = socket

    def __enter__(self) -> "RunningZerod":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def endpoint(self, rank: int) -> Tuple[str, int]:
        return self.socket, rank


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2,
                    help="ranks, one trainer process each (default 2)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--socket", help="train against the zerod listening on this socket (serving "
                    "--world-size local ranks) instead of starting one")
    a = ap.parse_args()
    torch.set_num_threads(1)

    for what, path in (("zerod", os.environ["ZEROD_BIN"]), ("libzerod", os.environ["ZEROD_LIBRARY"])):
        if what == "zerod" and a.socket:
            continue
        if not os.path.exists(path):
            print(f"{what} not found at {path}: build first (ninja -C build), or set "
                  f"{'ZEROD_BIN' if what == 'zerod' else 'ZEROD_LIBRARY'}", file=sys.stderr)
            return 2
    world = a.world_size
    if a.socket:
        world_procs = RunningZerod(a.socket)
        print(f"zerod at {a.socket}: {world} local rank(s), {zerod.library_path()}", flush=True)
    else:
        # a few buckets, so that the scatter of one overlaps the backward of the next
        world_procs = zerod.testing.LocalWorld(world, args=["--bucket_elems", "16384"],
                                               log_level="info")
        print(f"zerod: {world} rank(s), {zerod.library_path()}", flush=True)
    t0 = time.monotonic()
    with world_procs as w:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=trainer,
                             args=(r, world, w.endpoint(r), a.steps, queue, bool(a.socket)))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = collect(procs, queue)
    t_zerod = time.monotonic() - t0
    failed = [f"rank {r}: {res['error']}" for r, res in sorted(results.items()) if "error" in res]
    if failed:
        print("\n".join(failed), file=sys.stderr)
        return 1

    t1 = time.monotonic()
    ref_losses, ref_params = baseline(world, a.steps)
    t_ref = time.monotonic() - t1
    losses = [sum(results[r]["losses"][s] for r in range(world)) / world for s in range(a.steps)]
    same = all(torch.equal(torch.from_numpy(results[0]["params"][n]), p)
               for n, p in ref_params.items())
    print(f"\nmean loss over the {world} ranks' batches:")
    print(f"{'step':>6} {'zerod':>12} {'torch-only':>12}")
    for s in sorted({0, a.steps // 4, a.steps // 2, 3 * a.steps // 4, a.steps - 1}):
        print(f"{s + 1:>6} {losses[s]:>12.6f} {ref_losses[s]:>12.6f}")
    print(f"\nfinal mean loss: zerod {losses[-1]:.6f}   torch-only baseline {ref_losses[-1]:.6f}")
    print(f"parameters bitwise identical to the baseline: {'yes' if same else 'NO'}")
    print(f"time: {t_zerod:.1f} s through zerod ({world} trainer process(es), zerod step "
          f"{results[0]['step_us']} us mean, {results[0]['buckets']} buckets), "
          f"{t_ref:.1f} s baseline")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
