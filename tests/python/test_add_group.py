"""add_param_group during training: zerod.torch.ZeroOptimizer against torch.optim.AdamW
(foreach=False), bit for bit, when a frozen backbone layer is unfrozen after 5 steps and added to
the optimizer as a new parameter group (progressive unfreezing), then 5 more steps.

torch's semantics: the parameters already in the optimizer keep their state (moments, their own
state['step']), and the new group's parameters start with none (their first step is their step
1, its bias corrections those of step 1). zerod registers the grown model again (ZD_REGISTER_GROW)
and carries the held state across the new layout; every parameter is compared after every step,
and zerod's per-parameter step counts through its status (the new ones lag 5 steps behind the
model's).

Modes:
  (default)      W=1 and, with --world 2, two trainer processes (one zerod each): every rank adds
                 the same group after step 5; the reference steps with the mean of every rank's
                 gradients. --optimizer picks a subclass (sgd, adagrad, rmsprop) against its torch
                 counterpart: their group defaults fill the new group (adagrad: torch 2.x only,
                 since torch 1.13's Adagrad raises KeyError at the step of a parameter added
                 later). --overlap: zerod's overlap_update (two sets of state arrays);
                 --state_dir: the state in a state_dir's file, made again for the grown model;
                 --one_daemon: the W ranks are local ranks of one zerod (else one zerod each).
  --checkpoint   a checkpoint taken after the add (step 8) at W=2, resumed by a world of one that
                 builds the grown optimizer directly, which continues to step 10 bit for bit.
  --refuse       W=2, the ranks add different groups: rank 1 another lr (ZD_EHPARAM naming the
                 field), then another layer (ZD_ELAYOUT naming the parameter); each rank's
                 add_param_group raises, and the optimizer goes on with the model it had.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import common

torch = common.require_torch()

import zerod  # noqa: E402
import zerod.testing  # noqa: E402
from zerod.torch import ZeroAdagrad, ZeroOptimizer, ZeroRMSprop, ZeroSGD  # noqa: E402

nn = torch.nn
F = torch.nn.functional

ADD_AFTER, STEPS, CKPT_AT = 5, 10, 8
ONE_DAEMON = False


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def make() -> Net:
    torch.manual_seed(2468)
    net = Net()
    for p in net.backbone.parameters():
        p.requires_grad_(False)
    return net


def unfreeze(net: Net) -> List[Tuple[str, torch.Tensor]]:
    """backbone.2 (the layer next to the head) unfrozen: what the new group holds."""
    for p in net.backbone[2].parameters():
        p.requires_grad_(True)
    return [("backbone.2." + n, p) for n, p in net.backbone[2].named_parameters()]


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(6, 8, generator=g)
    y = torch.randint(0, 4, (6,), generator=g)
    return F.cross_entropy(model(x), y)


# (zerod class, torch class, hyperparameters, the new group's own options)
OPTIMIZERS: Dict[str, Tuple[Any, Any, Dict[str, Any], Dict[str, Any]]] = {
    "adamw": (ZeroOptimizer, lambda ps, **kw: torch.optim.AdamW(ps, foreach=False, **kw),
              dict(lr=3e-2, weight_decay=0.1), dict(lr=1e-2)),
    "sgd": (ZeroSGD, lambda ps, **kw: torch.optim.SGD(ps, **kw),
            dict(lr=0.05, momentum=0.9, weight_decay=1e-3), dict(lr=0.02)),
    "adagrad": (ZeroAdagrad, lambda ps, **kw: torch.optim.Adagrad(ps, **kw),
                dict(lr=0.05, lr_decay=1e-3, weight_decay=0.01), dict(lr=0.02)),
    "rmsprop": (ZeroRMSprop, lambda ps, **kw: torch.optim.RMSprop(ps, **kw),
                dict(lr=1e-2, alpha=0.9, weight_decay=0.01), dict(lr=5e-3)),
}


def ref_step(ref: Net, opt: Any, step: int, world: int) -> None:
    """torch's step with the mean of every rank's gradients (what zerod reduces)."""
    params = [p for p in ref.parameters() if p.requires_grad]
    sums: List[Optional[torch.Tensor]] = [None] * len(params)
    for r in range(world):
        for p in params:
            p.grad = None
        loss_of(ref, step, r).backward()
        for i, p in enumerate(params):
            sums[i] = p.grad.clone() if sums[i] is None else sums[i] + p.grad
    for p, g in zip(params, sums):
        p.grad = g * (1.0 / world) if world > 1 else g
    opt.step()


def reference(kind: str, world: int) -> List[Dict[str, torch.Tensor]]:
    """Every parameter after every step of torch's run (index 0: the start)."""
    _, torch_cls, kw, new_kw = OPTIMIZERS[kind]
    ref = make()
    opt = torch_cls([p for p in ref.parameters() if p.requires_grad], **kw)
    snaps = [{n: p.detach().clone() for n, p in ref.named_parameters()}]
    for step in range(1, STEPS + 1):
        if step == ADD_AFTER + 1:
            opt.add_param_group(dict(params=[p for _, p in unfreeze(ref)], **new_kw))
        ref_step(ref, opt, step, world)
        snaps.append({n: p.detach().clone() for n, p in ref.named_parameters()})
    steps = {n: int(torch.as_tensor(opt.state[p]["step"]).item()) if "step" in opt.state[p]
             else None for n, p in ref.named_parameters() if p in opt.state}
    want = {n: STEPS - (ADD_AFTER if n.startswith("backbone.2") else 0) for n in steps}
    if kind in ("adamw", "adagrad", "rmsprop") and steps != want:
        raise AssertionError(f"torch's own steps are {steps}, expected {want}")
    return snaps


def check_same(model: nn.Module, snap: Dict[str, torch.Tensor], where: str) -> None:
    for n, p in model.named_parameters():
        if not torch.equal(p.detach(), snap[n]):
            raise AssertionError(f"{where}: {common.first_difference(n, p.detach(), snap[n])}")


def train_rank(cfg: Dict[str, Any], rank: int, world: int, endpoint: Tuple[str, int],
               snaps: List[Dict[str, torch.Tensor]]) -> Dict[str, Any]:
    torch.set_num_threads(1)
    zcls, _, kw, new_kw = OPTIMIZERS[cfg["optimizer"]]
    model = make()
    opt = zcls([(n, p) for n, p in model.named_parameters() if p.requires_grad],
               socket=endpoint[0], local_rank=endpoint[1], **kw)
    out: Dict[str, Any] = {}
    try:
        for step in range(1, STEPS + 1):
            if step == ADD_AFTER + 1:
                opt.add_param_group(dict(params=unfreeze(model), **new_kw))
                if not opt.resumed or opt.step_count != ADD_AFTER:
                    raise AssertionError(f"after add_param_group: resumed {opt.resumed}, step "
                                         f"{opt.step_count}; expected True, {ADD_AFTER}")
                check_same(model, snaps[ADD_AFTER], "after add_param_group")
            model.zero_grad(set_to_none=True)
            loss_of(model, step, rank).backward()
            opt.step()
            check_same(model, snaps[step], f"after step {step}")
            if step == CKPT_AT and cfg["checkpoint"]:
                out["ckpt_step"], _ = opt.checkpoint()
        status = opt.client.rank_status()
        if int(status["step"]) != STEPS:
            raise AssertionError(f"zerod says step {status['step']}, expected {STEPS}")
        lagging = int(status.get("params_lagging", -1))
        if lagging != 2:
            raise AssertionError(f"zerod says {lagging} parameters lag behind the model's step; "
                                 f"expected 2 (the new group's, {ADD_AFTER} steps behind)")
        return out
    finally:
        opt.close()


def refuse_rank(rank: int, endpoint: Tuple[str, int]) -> Dict[str, Any]:
    """Rank 1 adds a group that differs from rank 0's: first its lr, then its layer."""
    torch.set_num_threads(1)
    model = make()
    opt = ZeroOptimizer([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                        socket=endpoint[0], local_rank=endpoint[1], lr=3e-2, weight_decay=0.1)
    errors = []
    try:
        for step in range(1, ADD_AFTER + 1):
            model.zero_grad(set_to_none=True)
            loss_of(model, step, rank).backward()
            opt.step()
        for attempt in ("lr", "layer"):
            if attempt == "layer" and rank == 1:
                layer = model.backbone[0]
                for p in layer.parameters():
                    p.requires_grad_(True)
                params = [("backbone.0." + n, p) for n, p in layer.named_parameters()]
            else:
                params = unfreeze(model)
            lr = 2e-2 if attempt == "lr" and rank == 1 else 1e-2
            try:
                opt.add_param_group({"params": params, "lr": lr})
            except zerod.ZerodError as e:
                errors.append((e.name, str(e)))
            else:
                raise AssertionError(f"rank {rank}: add_param_group with a different {attempt} "
                                     f"than the other rank's was accepted")
            for _, p in params:
                p.requires_grad_(False)
            if len(opt.param_groups) != 1 or opt.step_count != ADD_AFTER:
                raise AssertionError(f"after the refusal: {len(opt.param_groups)} groups, step "
                                     f"{opt.step_count}")
        # The optimizer goes on with the model it had.
        model.zero_grad(set_to_none=True)
        loss_of(model, ADD_AFTER + 1, rank).backward()
        opt.step()
        if opt.step_count != ADD_AFTER + 1:
            raise AssertionError(f"the step after the refusals: step {opt.step_count}")
        return {"errors": errors}
    finally:
        opt.close()


def _worker(target: Any, args: Tuple[Any, ...], rank: int, queue: Any) -> None:
    try:
        queue.put((rank, target(*args)))
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))


def run_world(world: int, target: Any, make_args: Any, args: List[str]) -> Dict[int, Any]:
    daemons = 1 if ONE_DAEMON else world  # --one_daemon: the ranks are local ranks of one zerod
    with zerod.testing.LocalWorld(world, daemons=daemons, args=args, log_level="info") as w:
        if world == 1:
            try:
                return {0: target(*make_args(0, w.endpoint(0)))}
            except BaseException:
                return {0: {"error": traceback.format_exc()}}
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(target, make_args(r, w.endpoint(r)), r, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        results: Dict[int, Any] = {}
        deadline = time.monotonic() + 300
        while len(results) < world and time.monotonic() < deadline:
            try:
                r, res = queue.get(timeout=1.0)
                results[r] = res
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode is not None:
                        time.sleep(0.5)
                        if queue.empty():
                            results[r] = {"error": f"trainer exited with status {p.exitcode}"}
        for r in range(world):
            results.setdefault(r, {"error": "no result within 300 s"})
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        return results


def failed(results: Dict[int, Any]) -> bool:
    bad = False
    for r in sorted(results):
        if "error" in results[r]:
            print(f"FAIL rank {r}: {results[r]['error']}", flush=True)
            bad = True
    return bad


def run_train(kind: str, world: int, overlap: bool, state_dir: bool) -> bool:
    print(f"== {kind}: group added after step {ADD_AFTER}, W={world}, {STEPS} steps"
          f"{', overlap_update' if overlap else ''}{', state_dir' if state_dir else ''} ==",
          flush=True)
    if kind == "adagrad" and int(torch.__version__.split(".")[0]) < 2:
        common.skip("torch 1.13's Adagrad creates its state at construction only: its step "
                    "raises KeyError for a parameter added by add_param_group (torch 2.x "
                    "creates it at the parameter's first step, which ZeroAdagrad follows)")
    t0 = time.monotonic()
    snaps = reference(kind, world)
    cfg = {"optimizer": kind, "checkpoint": False}
    args = ["--bucket_elems", "256"] + (["--overlap_update", "1"] if overlap else [])
    with tempfile.TemporaryDirectory(prefix="zerod-add-group-", dir="/dev/shm") as tmp:
        if state_dir:  # the state in a file (two sets): the grown model's starts afresh
            args += ["--state_dir", tmp]
        results = run_world(world, train_rank, lambda r, ep: (cfg, r, world, ep, snaps), args)
    if failed(results):
        return False
    print(f"ok: bitwise equal to torch after every step on {world} rank(s), before and after "
          f"the add; 2 parameters 5 steps behind; {time.monotonic() - t0:.1f} s", flush=True)
    return True


def run_checkpoint() -> bool:
    print(f"== checkpoint after the add (step {CKPT_AT}) at W=2, resumed at W=1 ==", flush=True)
    snaps = reference("adamw", 2)
    with tempfile.TemporaryDirectory(prefix="zerod-add-group-") as tmp:
        root = os.path.join(tmp, "ckpt")
        os.makedirs(root)
        args = ["--bucket_elems", "256", "--checkpoint_dir", root]
        cfg = {"optimizer": "adamw", "checkpoint": True}
        results = run_world(2, train_rank, lambda r, ep: (cfg, r, 2, ep, snaps), args)
        if failed(results):
            return False
        if results[0].get("ckpt_step") != CKPT_AT:
            print(f"FAIL: the checkpoint is of step {results[0].get('ckpt_step')}")
            return False
        # The reference from the checkpoint on, at W=1: torch resumed from step CKPT_AT.
        torch.set_num_threads(1)
        ref = make()
        named = unfreeze(ref)
        ref_opt = torch.optim.AdamW([{"params": [ref.head.weight, ref.head.bias]},
                                     {"params": [p for _, p in named], "lr": 1e-2}],
                                    lr=3e-2, weight_decay=0.1, foreach=False)
        model = make()
        new = unfreeze(model)
        with zerod.testing.LocalZerod(args + ["--resume", "latest"], log_level="info") as d:
            opt = ZeroOptimizer([{"params": [(n, p) for n, p in model.named_parameters()
                                             if n.startswith("head")]},
                                 {"params": new, "lr": 1e-2}],
                                lr=3e-2, weight_decay=0.1, socket=d.socket)
            try:
                if not opt.resumed or opt.step_count != CKPT_AT:
                    print(f"FAIL: resumed {opt.resumed} at step {opt.step_count}; expected "
                          f"{CKPT_AT}")
                    return False
                lagging = int(opt.client.rank_status()["params_lagging"])
                if lagging != 2:
                    print(f"FAIL: {lagging} parameters lag after the resume; expected 2")
                    return False
                check_same(model, snaps[CKPT_AT], "resumed at W=1")
                # torch's own continuation: its state at CKPT_AT, one rank from there.
                ref.load_state_dict(model.state_dict())
                tref = reference_state_at(CKPT_AT)
                ref_opt.load_state_dict(tref)
                for step in range(CKPT_AT + 1, STEPS + 1):
                    model.zero_grad(set_to_none=True)
                    loss_of(model, step, 0).backward()
                    opt.step()
                    ref_step(ref, ref_opt, step, 1)
                    check_same(model, {n: p.detach() for n, p in ref.named_parameters()},
                               f"W=1 after step {step}")
            finally:
                opt.close()
    print(f"ok: the checkpoint of step {CKPT_AT} (after the add) resumed at W=1 with the new "
          f"parameters' own steps, bitwise equal to torch resumed from its state", flush=True)
    return True


def reference_state_at(stop: int) -> Dict[str, Any]:
    """torch's optimizer state_dict after step `stop` of the W=2 run."""
    _, torch_cls, kw, new_kw = OPTIMIZERS["adamw"]
    ref = make()
    opt = torch_cls([p for p in ref.parameters() if p.requires_grad], **kw)
    for step in range(1, stop + 1):
        if step == ADD_AFTER + 1:
            opt.add_param_group(dict(params=[p for _, p in unfreeze(ref)], **new_kw))
        ref_step(ref, opt, step, 2)
    return opt.state_dict()


def run_refuse() -> bool:
    print("== W=2, the ranks add different groups: refused on both, naming the difference ==",
          flush=True)
    results = run_world(2, refuse_rank, lambda r, ep: (r, ep), ["--bucket_elems", "256"])
    if failed(results):
        return False
    for r in range(2):
        (lr_name, lr_msg), (layer_name, layer_msg) = results[r]["errors"]
        print(f"rank {r}: {lr_name}: {lr_msg}\nrank {r}: {layer_name}: {layer_msg}", flush=True)
        if lr_name != "ZD_EHPARAM" or "lr" not in lr_msg or "rank 1" not in lr_msg:
            print(f"FAIL rank {r}: the lr difference is not named: {lr_name}: {lr_msg}")
            return False
        if (layer_name != "ZD_ELAYOUT" or "backbone.0.weight" not in layer_msg
                or "backbone.2.weight" not in layer_msg):
            print(f"FAIL rank {r}: the layer difference is not named: {layer_name}: {layer_msg}")
            return False
    print("ok: both refusals named the difference on both ranks, and training went on",
          flush=True)
    return True


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--refuse", action="store_true")
    ap.add_argument("--overlap", action="store_true", help="zerod's overlap_update (two sets)")
    ap.add_argument("--state_dir", action="store_true", help="zerod's state in a state_dir")
    ap.add_argument("--one_daemon", action="store_true", help="W ranks of one zerod")
    a = ap.parse_args()
    global ONE_DAEMON
    ONE_DAEMON = a.one_daemon
    if a.checkpoint:
        ok = run_checkpoint()
    elif a.refuse:
        ok = run_refuse()
    else:
        ok = run_train(a.optimizer, a.world, a.overlap, a.state_dir)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
