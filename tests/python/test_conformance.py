"""Conformance: training through zerod with zerod.torch.ZeroOptimizer gives parameters bitwise
identical to the same training with torch.optim.AdamW(foreach=False) in one process; with
--optimizer sgd, zerod.torch.ZeroSGD against torch.optim.SGD (its default implementation; the
second group at half the momentum unless nesterov; --dampening, --nesterov, --maximize); with
--optimizer adagrad, ZeroAdagrad against torch.optim.Adagrad (the second group without lr_decay); with --optimizer
rmsprop, ZeroRMSprop against torch.optim.RMSprop (--momentum in the first group, --centered); with
--optimizer lion, ZeroLion against lion_pytorch.Lion (PyPI lion-pytorch; the second group with its
own betas; skipped where lion-pytorch is not installed).

For each model (a small MLP, a tiny transformer) and working dtype, `world` trainer processes
(W=1: this process) each attach to one rank of a real zerod world and train on their own batches
for --steps steps, with two parameter groups (decay / no decay) and a LambdaLR warm-up + cosine
schedule. Every trainer also runs the reference in its own process: it recomputes every rank's
gradient on a copy of the model, sums them in rank order (mean over ranks, as zerod's
grad_mean), and steps torch.optim.AdamW. After every step (--check-every) every parameter must be
torch.equal to the reference's, and the losses must be equal too.

  fp32: model and master in fp32.
  bf16: the model is bfloat16 (zerod's working params bf16, grads bf16); the reference is the
        usual mixed-precision recipe: fp32 master params stepped by torch.optim.AdamW with the
        gradients cast to fp32, and model params = master.to(bfloat16) after each step.

W > 1 needs zerod's multi-rank backend: while zerod refuses the world size, the test exits 77
(skipped) and says so. For W=2 the reference mean is (g0 + g1) * 0.5 in fp32, which is what a
reduce-scatter in fp32 followed by zerod's 1/W scaling gives (an exact power-of-two scaling; the
sum of two terms does not depend on their order). For bf16 grads at W=2 this assumes the
reduction adds the bf16 gradients in fp32.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import queue as queue_mod
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import common

torch = common.require_torch()

import models  # noqa: E402  (after the torch check)
import zerod  # noqa: E402
import zerod.testing  # noqa: E402
from zerod.torch import ZeroAdagrad, ZeroLion, ZeroOptimizer, ZeroRMSprop, ZeroSGD  # noqa: E402

BUCKET_ELEMS = {"mlp": 2048, "transformer": 4096}  # several buckets: per-bucket scatter is used
LR = 3e-3
SGD_LR = 0.2
ADAGRAD_LR = 0.03
RMSPROP_LR = 1e-3
LION_LR = 3e-4


def train_rank(cfg: Dict[str, Any], rank: int, world: int, endpoint: Tuple[str, int]) -> Dict[str, Any]:
    """Trains rank `rank` through zerod and the reference in this process; returns the loss
    curves or the first mismatch."""
    torch.set_num_threads(1)
    kind, steps, bf16 = cfg["model"], cfg["steps"], cfg["dtype"] == "bf16"
    dt = torch.bfloat16 if bf16 else torch.float32
    model = models.make_model(kind).to(dt)
    ref = copy.deepcopy(model)
    ref_params = list(ref.parameters())
    if bf16:  # fp32 master copies, stepped by torch.optim.AdamW
        masters = [p.detach().float().clone().requires_grad_(True) for p in ref_params]
        by_id = {id(p): m for p, m in zip(ref_params, masters)}
        groups = [{**g, "params": [by_id[id(p)] for p in g["params"]]}
                  for g in models.param_groups(ref, named=False)]
        targets = masters
    else:
        groups = models.param_groups(ref, named=False)
        targets = ref_params
    ams = cfg.get("amsgrad", False)
    zgroups = models.param_groups(model, named=True)
    # --lazy: step() returns at the commit, each submodule's forward waits for its buckets
    lazy_kw = {"gather": "lazy", "module": model} if cfg.get("lazy") else {}
    if cfg.get("optimizer", "adamw") == "sgd":
        # torch's default SGD (no foreach argument: its default implementation on CPU), with
        # the momentum options; the second group overrides momentum, as a torch group may.
        kw = dict(momentum=cfg["momentum"], dampening=cfg["dampening"],
                  nesterov=cfg["nesterov"], maximize=cfg["maximize"])
        if cfg["momentum"] and not cfg["nesterov"]:
            groups[1]["momentum"] = zgroups[1]["momentum"] = cfg["momentum"] / 2
        ref_opt = torch.optim.SGD(groups, lr=SGD_LR, **kw)
        opt = ZeroSGD(zgroups, lr=SGD_LR, socket=endpoint[0], local_rank=endpoint[1], **kw, **lazy_kw)
    elif cfg.get("optimizer") == "adagrad":
        # torch's default Adagrad; the second group with its own lr_decay (the accumulator starts
        # at the constructor's value in every group, as torch does).
        kw = dict(lr_decay=1e-3, initial_accumulator_value=0.1, eps=1e-10,
                  maximize=cfg["maximize"])
        groups[1].update(lr_decay=0.0)
        zgroups[1].update(lr_decay=0.0)
        ref_opt = torch.optim.Adagrad(groups, lr=ADAGRAD_LR, **kw)
        opt = ZeroAdagrad(zgroups, lr=ADAGRAD_LR, socket=endpoint[0], local_rank=endpoint[1],
                          **kw, **lazy_kw)
    elif cfg.get("optimizer") == "rmsprop":
        # torch's default RMSprop; the second group without momentum.
        kw = dict(alpha=0.9, eps=1e-8, momentum=cfg["momentum"], centered=cfg["centered"],
                  maximize=cfg["maximize"])
        groups[1].update(momentum=0.0)
        zgroups[1].update(momentum=0.0)
        ref_opt = torch.optim.RMSprop(groups, lr=RMSPROP_LR, **kw)
        opt = ZeroRMSprop(zgroups, lr=RMSPROP_LR, socket=endpoint[0], local_rank=endpoint[1],
                          **kw, **lazy_kw)
    elif cfg.get("optimizer") == "lion":
        # lion-pytorch's Lion (its default update); the first group with a weight decay Lion
        # users take (lr * wd about 1e-4), the second with betas of its own.
        from lion_pytorch import Lion

        groups[0].update(weight_decay=1.0)
        zgroups[0].update(weight_decay=1.0)
        groups[1].update(betas=(0.95, 0.98))
        zgroups[1].update(betas=(0.95, 0.98))
        ref_opt = Lion(groups, lr=LION_LR, betas=(0.9, 0.99))
        opt = ZeroLion(zgroups, lr=LION_LR, betas=(0.9, 0.99), socket=endpoint[0],
                       local_rank=endpoint[1], **lazy_kw)
    else:
        ref_opt = torch.optim.AdamW(groups, lr=LR, foreach=False, amsgrad=ams)
        opt = ZeroOptimizer(zgroups, lr=LR, socket=endpoint[0], local_rank=endpoint[1],
                            amsgrad=ams, **lazy_kw)
    sched_fn = models.lr_lambda(steps) if cfg.get("schedule", True) else (lambda s: 1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, sched_fn)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, sched_fn)
    names = [n for n, _ in model.named_parameters()]
    rows: List[tuple] = []
    t_zerod = t_ref = 0.0
    lazy_pending = 0  # steps that returned with gathers still to wait for (--lazy)
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            x, y = models.batch(kind, step, rank, dt)
            opt.zero_grad()
            loss = models.loss_fn(model, x, y)
            loss.backward()
            opt.step()
            lazy_pending += opt._lazy_owed
            sched.step()
            t1 = time.perf_counter()

            grads: Optional[List[torch.Tensor]] = None
            ref_loss = None
            for r in range(world):
                for p in ref_params:
                    p.grad = None
                xr, yr = models.batch(kind, step, r, dt)
                lr_ = models.loss_fn(ref, xr, yr)
                lr_.backward()
                if r == rank:
                    ref_loss = lr_
                g = [p.grad.float() if bf16 else p.grad for p in ref_params]
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            assert grads is not None and ref_loss is not None
            if world > 1:
                grads = [g * (1.0 / world) for g in grads]
            for t, g in zip(targets, grads):
                t.grad = g
            ref_opt.step()
            ref_sched.step()
            if bf16:
                with torch.no_grad():
                    for p, m in zip(ref_params, masters):
                        p.copy_(m.to(torch.bfloat16))
            t_ref += time.perf_counter() - t1
            t_zerod += t1 - t0

            rows.append((step + 1, loss.item(), ref_loss.item(), sched.get_last_lr()[0]))
            if not torch.equal(loss, ref_loss):
                return {"error": f"step {step + 1}: loss {loss.item()!r} through zerod, "
                                 f"{ref_loss.item()!r} in the reference (forward differs)",
                        "rows": rows}
            if (step + 1) % cfg["check_every"] == 0 or step + 1 == steps:
                if cfg.get("lazy"):  # read outside the forward: the gathers first
                    opt.wait_params()
                for n, a, b in zip(names, model.parameters(), ref_params):
                    if not torch.equal(a, b):
                        return {"error": f"after step {step + 1}: "
                                         f"{common.first_difference(n, a, b)}", "rows": rows}
        res = opt.last_result
        if cfg.get("lazy") and lazy_pending != steps:
            return {"error": f"gather='lazy': {steps - lazy_pending} of {steps} steps returned "
                             f"with their gathers done (step() gathered)", "rows": rows}
        status = opt.client.rank_status()
        if int(status["step"]) != steps:
            return {"error": f"zerod says step {status['step']}, expected {steps}", "rows": rows}
        return {"rows": rows, "t_zerod": t_zerod, "t_ref": t_ref, "nbuckets": opt.info.nbuckets,
                "scatters": int(status["scatters"]), "applied": res.applied if res else None,
                "spec": (int(status["overlap_buckets_committed"]),
                         int(status["overlap_buckets_recomputed"]))}
    finally:
        opt.close()


def _worker(cfg: Dict[str, Any], rank: int, world: int, endpoint: Tuple[str, int],
            queue: Any) -> None:
    try:
        queue.put((rank, train_rank(cfg, rank, world, endpoint)))
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))


def run_config(cfg: Dict[str, Any], world: int, daemons: int, spawn: bool) -> bool:
    kind, dtype = cfg["model"], cfg["dtype"]
    print(f"== {kind}, {dtype} working params, W={world}, {cfg['steps']} steps"
          f"{', overlap_update' if cfg.get('overlap') else ''}"
          f"{', gather=lazy' if cfg.get('lazy') else ''} ==", flush=True)
    t0 = time.monotonic()
    args = ["--bucket_elems", str(BUCKET_ELEMS[kind])]
    if cfg.get("overlap"):
        args += ["--overlap_update", "1"]
    try:
        world_procs = zerod.testing.LocalWorld(world, daemons=daemons, args=args,
                                               log_level="info")
    except zerod.testing.ZerodProcessError as e:
        if world > 1 and "multi-rank" in str(e):
            why = str(e).split("ERROR ", 1)[-1]
            common.skip(f"W={world} needs zerod's multi-rank backend, which this build does not "
                        f"have yet (zerod said: {why})")
        raise
    with world_procs as w:
        if world == 1 and not spawn:
            results = {0: train_rank(cfg, 0, 1, w.endpoint(0))}
        else:
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            procs = [ctx.Process(target=_worker, args=(cfg, r, world, w.endpoint(r), queue))
                     for r in range(world)]
            for p in procs:
                p.start()
            results = {}
            deadline = time.monotonic() + 600
            while len(results) < world and time.monotonic() < deadline:
                try:
                    r, res = queue.get(timeout=1.0)
                    results[r] = res
                except queue_mod.Empty:
                    for r, p in enumerate(procs):
                        if r not in results and p.exitcode is not None:
                            time.sleep(0.5)  # a result put just before exiting
                            if queue.empty():
                                results[r] = {"error": f"trainer exited with status {p.exitcode}"}
            for r in range(world):
                results.setdefault(r, {"error": "no result within 600 s"})
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
    ok = True
    for r in sorted(results):
        res = results[r]
        if "error" in res:
            print(f"FAIL rank {r}: {res['error']}", flush=True)
            ok = False
    if not ok:
        return False
    res0 = results[0]
    print(common.loss_table(res0["rows"], ("step", "loss zerod", "loss torch", "lr"),
                            every=max(1, cfg["steps"] // 8)))
    first, last = res0["rows"][0][1], res0["rows"][-1][1]
    # SGD, Adagrad and RMSprop learn the MLP's task slowly (a few percent in 200 steps): that
    # they learn is enough there.
    need = 0.99 if cfg.get("optimizer") in ("sgd", "adagrad", "rmsprop", "lion") else 0.7
    if not cfg.get("maximize") and not last < first * need:
        print(f"FAIL: the loss did not fall enough: {first:.4f} -> {last:.4f}")
        return False
    expected_scatters = res0["nbuckets"] * cfg["steps"]
    if res0["scatters"] != expected_scatters:
        print(f"FAIL: zerod counted {res0['scatters']} scatters; per-bucket scatter from the "
              f"backward hooks gives {res0['nbuckets']} buckets x {cfg['steps']} steps = "
              f"{expected_scatters}")
        return False
    if cfg.get("overlap"):
        committed, recomputed = res0["spec"]
        print(f"overlap_update: {committed} bucket updates committed as speculated, "
              f"{recomputed} recomputed at step time", flush=True)
        # The scheduler sets the lr after step(), before the next backward, whose first scatter
        # carries it: with or without a schedule every speculation is committed.
        if committed != expected_scatters:
            print(f"FAIL: with the lr set before backward every speculation must be committed: "
                  f"{committed} of {expected_scatters}")
            return False
    every = "step" if cfg["check_every"] == 1 else f"{cfg['check_every']} steps"
    ref_name = {"sgd": "torch.optim.SGD", "adagrad": "torch.optim.Adagrad",
                "rmsprop": "torch.optim.RMSprop",
                "lion": "lion_pytorch.Lion"}.get(cfg.get("optimizer"), "torch.optim.AdamW")
    print(f"ok: every parameter bitwise equal to {ref_name} after every {every} "
          f"on {len(results)} rank(s); {res0['nbuckets']} buckets scattered from hooks; "
          f"trainer {res0['t_zerod']:.2f} s through zerod, {res0['t_ref']:.2f} s reference; "
          f"{time.monotonic() - t0:.1f} s in all", flush=True)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="all", choices=["mlp", "transformer", "all"])
    ap.add_argument("--dtype", default="all", choices=["fp32", "bf16", "all"])
    ap.add_argument("--world", type=int, default=1, help="trainer processes (ranks)")
    ap.add_argument("--daemons", type=int, default=0,
                    help="zerod processes: 1, or the world size (default: one per rank)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--check-every", type=int, default=1)
    ap.add_argument("--amsgrad", action="store_true", help="AdamW(amsgrad=True) on both sides")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "adagrad", "rmsprop", "lion"],
                    help="sgd: zerod.torch.ZeroSGD against torch.optim.SGD; adagrad: "
                         "ZeroAdagrad against torch.optim.Adagrad")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum")
    ap.add_argument("--dampening", type=float, default=0.0, help="SGD's dampening")
    ap.add_argument("--nesterov", action="store_true", help="SGD's nesterov=True")
    ap.add_argument("--centered", action="store_true", help="RMSprop's centered=True")
    ap.add_argument("--maximize", action="store_true",
                    help="SGD's maximize=True (both sides; the loss check is skipped)")
    ap.add_argument("--overlap", action="store_true",
                    help="zerod with overlap_update = 1 (buckets updated as scattered)")
    ap.add_argument("--no-schedule", action="store_true",
                    help="a constant lr instead of the warm-up + cosine schedule")
    ap.add_argument("--lazy", action="store_true",
                    help="ZeroOptimizer(gather='lazy'): parameters gathered before each "
                         "submodule's forward; compared every --check-every steps after "
                         "wait_params(), the losses every step")
    ap.add_argument("--spawn", action="store_true",
                    help="run the trainers in their own processes even at W=1")
    a = ap.parse_args()
    if a.optimizer == "lion":
        try:
            import lion_pytorch  # noqa: F401
        except ImportError:
            common.skip("lion-pytorch is not installed for this python (scripts/torch2_venv.sh "
                        "installs it into the torch 2.x venv)")
    kinds = ["mlp", "transformer"] if a.model == "all" else [a.model]
    dtypes = ["fp32", "bf16"] if a.dtype == "all" else [a.dtype]
    daemons = a.daemons or a.world
    ok = True
    for kind in kinds:
        for dtype in dtypes:
            cfg = {"model": kind, "dtype": dtype, "steps": a.steps, "check_every": a.check_every,
                   "amsgrad": a.amsgrad, "overlap": a.overlap, "schedule": not a.no_schedule,
                   "optimizer": a.optimizer, "momentum": a.momentum, "dampening": a.dampening,
                   "nesterov": a.nesterov, "maximize": a.maximize, "centered": a.centered,
                   "lazy": a.lazy}
            ok = run_config(cfg, a.world, daemons, a.spawn or a.world > 1) and ok
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
