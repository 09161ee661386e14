"""Parameters without a gradient: zerod.torch.ZeroOptimizer against torch.optim.AdamW
(foreach=False) or torch.optim.Adagrad, bit for bit, where some parameters have no gradient on
some steps (torch's `p.grad is None`), which torch's optimizers skip entirely: no weight decay, no
moment update, and their own state['step'] does not advance (the bias corrections of their later
steps use it).

Models (--model):
  head    an auxiliary head used on odd steps only; gradients cleared with
          Module.zero_grad(set_to_none=True), so the unused head's .grad is None at step().
  moe     a top-1 mixture of experts with hash routing (each token's expert given by the batch):
          on some steps some experts get no token on any rank, on others on one rank only (at
          W > 1 those are stepped with the reduced gradient, the other ranks' zeros in it, as
          DDP's), and on others every expert is used. ZeroOptimizer.zero_grad(set_to_none=True).
  freeze  a layer frozen (requires_grad_(False)) after step 5 and unfrozen after step 10.

`world` trainer processes (W=1: this process) each run the reference too: every rank's gradient
recomputed on a copy, per parameter the mean over the ranks where it has one counted as zeros
elsewhere (None where no rank has one), then torch's step. Every parameter is compared after
every step, and zerod's per-parameter step counts are checked through its status.
"""

from __future__ import annotations

import argparse
import os
import copy
import multiprocessing as mp
import queue as queue_mod
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import common

torch = common.require_torch()

import zerod  # noqa: E402
import zerod.testing  # noqa: E402
from zerod.torch import ZeroAdagrad, ZeroOptimizer  # noqa: E402

nn = torch.nn
F = torch.nn.functional


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.main = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = self.main(h)
        if step % 2 == 1:
            out = out + 0.5 * self.aux(h)
        return out


class MoE(nn.Module):
    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(8, experts)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(experts))
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), dim=-1)
        h = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = (route == e).nonzero().flatten()
            if sel.numel():
                y = expert(x[sel]) * gate[sel, e:e + 1]
                h = h.index_add(0, sel, y)
        return self.out(torch.relu(h) + x)


class Freeze(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def make(kind: str) -> nn.Module:
    torch.manual_seed(4321)
    return {"head": Head, "moe": MoE, "freeze": Freeze}[kind]()


def routes(step: int, rank: int, world: int) -> List[int]:
    """Experts of the batch's 6 tokens: step % 3 == 0 experts 0 and 1 only, on every rank;
    == 1 rank r uses experts r and r + 2 only (at W=1: 0 and 2); == 2 every expert."""
    if step % 3 == 0:
        return [0, 1, 0, 1, 1, 0]
    if step % 3 == 1:
        r = rank % 2
        return [r, r + 2, r, r + 2, r, r]
    return [0, 1, 2, 3, 0, 2]


def batch(kind: str, step: int, rank: int, world: int) -> Tuple[Any, ...]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(6, 8, generator=g)
    y = torch.randint(0, 4, (6,), generator=g)
    extra: Any = torch.tensor(routes(step, rank, world)) if kind == "moe" else step
    return x, y, extra


def loss_of(model: nn.Module, kind: str, step: int, rank: int, world: int) -> torch.Tensor:
    x, y, extra = batch(kind, step, rank, world)
    return F.cross_entropy(model(x, extra), y)


def set_frozen(model: nn.Module, kind: str, step: int) -> None:
    """freeze: layer b frozen for steps 6..10, trainable before and after."""
    if kind == "freeze":
        for p in model.b.parameters():
            p.requires_grad_(not 6 <= step <= 10)


def train_rank(cfg: Dict[str, Any], rank: int, world: int, endpoint: Tuple[str, int]
               ) -> Dict[str, Any]:
    torch.set_num_threads(1)
    kind, steps = cfg["model"], cfg["steps"]
    model = make(kind)
    ref = make(kind)
    ref.load_state_dict(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    ref_params = list(ref.parameters())
    if cfg["optimizer"] == "adagrad":
        kw: Dict[str, Any] = dict(lr=0.05, lr_decay=1e-3, weight_decay=0.01)
        ref_opt = torch.optim.Adagrad(ref.parameters(), **kw)
        opt = ZeroAdagrad(model.named_parameters(), socket=endpoint[0], local_rank=endpoint[1],
                          **kw)
    else:
        kw = dict(lr=3e-2, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **kw)
        opt = ZeroOptimizer(model.named_parameters(), socket=endpoint[0], local_rank=endpoint[1],
                            overlap=cfg["hooks"], **kw)
    skipped = {n: 0 for n in names}  # steps each parameter was skipped (the reference's view)
    partial = 0
    try:
        for step in range(1, steps + 1):
            set_frozen(model, kind, step)
            set_frozen(ref, kind, step)
            if kind == "head":
                model.zero_grad(set_to_none=True)
            else:
                opt.zero_grad(set_to_none=True)
            loss_of(model, kind, step, rank, world).backward()
            opt.step()

            # The reference: every rank's gradients, combined as DDP does.
            sums: List[Optional[torch.Tensor]] = [None] * len(ref_params)
            for r in range(world):
                for p in ref_params:
                    p.grad = None
                loss_of(ref, kind, step, r, world).backward()
                for i, p in enumerate(ref_params):
                    if p.grad is not None:
                        sums[i] = p.grad.clone() if sums[i] is None else sums[i] + p.grad
            present_on = [0] * len(ref_params)
            for r in range(world):
                for p in ref_params:
                    p.grad = None
                loss_of(ref, kind, step, r, world).backward()
                for i, p in enumerate(ref_params):
                    present_on[i] += p.grad is not None
            for i, p in enumerate(ref_params):
                g = sums[i]
                if g is not None and world > 1:
                    g = g * (1.0 / world)
                p.grad = g
                if g is None:
                    skipped[names[i]] += 1
                elif present_on[i] < world:
                    partial += 1
            ref_opt.step()
            for n, a, b in zip(names, model.parameters(), ref_params):
                if not torch.equal(a, b):
                    return {"error": f"after step {step}: {common.first_difference(n, a, b)}"}
        # torch's own per-parameter step counts: zerod's must be the same.
        want = {n: steps - skipped[n] for n in names}
        for n, p in zip(names, ref_params):
            st = ref_opt.state[p].get("step", 0) if p in ref_opt.state else 0
            got = int(st.item() if isinstance(st, torch.Tensor) else st)
            if got != want[n]:
                return {"error": f"the reference's step of {n} is {got}, expected {want[n]}"}
        status = opt.client.rank_status()
        if int(status["step"]) != steps:
            return {"error": f"zerod says step {status['step']}, expected {steps}"}
        lagging = int(status.get("params_lagging", -1))
        want_lagging = sum(1 for n in names if skipped[n])
        if lagging != want_lagging:
            return {"error": f"zerod says {lagging} parameters lag behind the model's step, "
                             f"expected {want_lagging}"}
        return {"skipped": sum(1 for v in skipped.values() if v), "partial": partial,
                "lagging": lagging}
    finally:
        opt.close()


def _worker(cfg: Dict[str, Any], rank: int, world: int, endpoint: Tuple[str, int],
            queue: Any) -> None:
    try:
        queue.put((rank, train_rank(cfg, rank, world, endpoint)))
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))


def run_config(cfg: Dict[str, Any], world: int) -> bool:
    print(f"== {cfg['model']}, {cfg['optimizer']}, W={world}, {cfg['steps']} steps"
          f"{', overlap_update' if cfg['overlap'] else ''}"
          f"{', scatters from hooks' if cfg['hooks'] else ''} ==", flush=True)
    t0 = time.monotonic()
    args = ["--bucket_elems", "256"]
    if cfg["overlap"]:
        args += ["--overlap_update", "1"]
    with zerod.testing.LocalWorld(world, daemons=world, args=args, log_level="info") as w:
        if world == 1:
            results = {0: train_rank(cfg, 0, 1, w.endpoint(0))}
        else:
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            procs = [ctx.Process(target=_worker, args=(cfg, r, world, w.endpoint(r), queue))
                     for r in range(world)]
            for p in procs:
                p.start()
            results = {}
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
    ok = True
    for r in sorted(results):
        if "error" in results[r]:
            print(f"FAIL rank {r}: {results[r]['error']}", flush=True)
            ok = False
    if not ok:
        return False
    res = results[0]
    if not res["skipped"]:
        print("FAIL: no parameter was ever skipped: the test does not test what it says")
        return False
    if world > 1 and cfg["model"] == "moe" and not res["partial"]:
        print("FAIL: no expert was used on one rank only")
        return False
    print(f"ok: bitwise equal to torch after every step on {world} rank(s); {res['skipped']} "
          f"parameters skipped on some steps, {res['partial']} (parameter, step) pairs with a "
          f"gradient on some ranks only; {res['lagging']} lag behind the model's step; "
          f"{time.monotonic() - t0:.1f} s", flush=True)
    return True


# ---- a checkpoint with lagging steps ----------------------------------------------------------

K, M, N = 7, 4, 3  # steps at W=2, then at W=1 after the resume, then in torch after the export


def ref_grads(ref: nn.Module, step: int, world: int) -> List[Optional[torch.Tensor]]:
    """Every rank's gradients of `step`, combined as DDP does (None: no rank has one)."""
    params = list(ref.parameters())
    sums: List[Optional[torch.Tensor]] = [None] * len(params)
    for r in range(world):
        for p in params:
            p.grad = None
        loss_of(ref, "head", step, r, world).backward()
        for i, p in enumerate(params):
            if p.grad is not None:
                sums[i] = p.grad.clone() if sums[i] is None else sums[i] + p.grad
    return [g * (1.0 / world) if g is not None and world > 1 else g for g in sums]


def ref_step(ref: nn.Module, opt: Any, step: int, world: int) -> None:
    for p, g in zip(ref.parameters(), ref_grads(ref, step, world)):
        p.grad = g
    opt.step()


def ckpt_rank(snaps: List[Dict[str, torch.Tensor]], rank: int, endpoint: Tuple[str, int],
              queue: Any) -> None:
    """Phase 1 on one of two ranks: steps 1..K, compared, then a checkpoint."""
    try:
        torch.set_num_threads(1)
        model = make("head")
        opt = ZeroOptimizer(model.named_parameters(), lr=3e-2, weight_decay=0.1,
                            socket=endpoint[0], local_rank=endpoint[1])
        try:
            for step in range(1, K + 1):
                model.zero_grad(set_to_none=True)
                loss_of(model, "head", step, rank, 2).backward()
                opt.step()
                for n, p in model.named_parameters():
                    if not torch.equal(p, snaps[step][n]):
                        raise AssertionError(f"W=2 after step {step}: "
                                             f"{common.first_difference(n, p, snaps[step][n])}")
            lag = int(opt.client.rank_status()["params_lagging"])
            step, _ = opt.checkpoint()
            queue.put((rank, {"step": step, "lagging": lag}))
        finally:
            opt.close()
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))


def check_same(model: nn.Module, snap: Dict[str, torch.Tensor], where: str) -> None:
    for n, p in model.named_parameters():
        if not torch.equal(p.detach(), snap[n]):
            raise AssertionError(f"{where}: {common.first_difference(n, p.detach(), snap[n])}")


def run_checkpoint() -> bool:
    """The head model's aux layer lags (skipped on even steps): a checkpoint at step K of a W=2
    world, resumed at W=1, trained M steps, checkpointed again, exported to a torch state_dict
    that a fresh torch AdamW loads and continues N steps with; then that torch state back into
    zerod (save_torch_state, zeroctl import, --resume). Bitwise against one torch run."""
    import tempfile

    import zerod.checkpoint as zc

    print(f"== checkpoint with lagging per-parameter steps: W=2 for {K} steps, resumed at W=1 "
          f"for {M}, exported to torch for {N}, imported back for 1 ==", flush=True)
    torch.set_num_threads(1)
    ref = make("head")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-2, weight_decay=0.1, foreach=False)
    snaps: List[Dict[str, torch.Tensor]] = [{}]
    plan = [2] * K + [1] * (M + N + 1)
    for step, world in enumerate(plan, start=1):
        ref_step(ref, ref_opt, step, world)
        snaps.append({n: p.detach().clone() for n, p in ref.named_parameters()})
        if step == K + M + N:
            ref_state = copy.deepcopy(ref_opt.state_dict())
    aux_steps = sum(1 for s in range(1, K + M + N + 1) if s % 2 == 1)
    with tempfile.TemporaryDirectory(prefix="zerod-presence-") as tmp:
        root = tmp + "/ckpt"
        os.makedirs(root)
        args = ["--bucket_elems", "256", "--checkpoint_dir", root]
        with zerod.testing.LocalWorld(2, daemons=2, args=args, log_level="info") as w:
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            procs = [ctx.Process(target=ckpt_rank, args=(snaps, r, w.endpoint(r), queue))
                     for r in range(2)]
            for p in procs:
                p.start()
            results = dict(queue.get(timeout=300) for _ in range(2))
            for p in procs:
                p.join(60)
        for r in range(2):
            if "error" in results[r]:
                print(f"FAIL rank {r}: {results[r]['error']}")
                return False
        if results[0]["lagging"] != 2:
            print(f"FAIL: {results[0]['lagging']} parameters lag at step {K}; expected 2")
            return False

        # Phase 2: the same checkpoint resumed by a world of one (resharded).
        model = make("head")
        with zerod.testing.LocalZerod(args + ["--resume", "latest"], log_level="info") as d:
            opt = ZeroOptimizer(model.named_parameters(), lr=3e-2, weight_decay=0.1,
                                socket=d.socket)
            try:
                if not opt.resumed or opt.step_count != K:
                    print(f"FAIL: resumed {opt.resumed} at step {opt.step_count}; expected {K}")
                    return False
                if int(opt.client.rank_status()["params_lagging"]) != 2:
                    print("FAIL: the resume lost the per-parameter steps")
                    return False
                check_same(model, snaps[K], "resumed at W=1")
                for step in range(K + 1, K + M + 1):
                    model.zero_grad(set_to_none=True)
                    loss_of(model, "head", step, 0, 1).backward()
                    opt.step()
                    check_same(model, snaps[step], f"W=1 after step {step}")
                _, out_ckpt = opt.checkpoint()
            finally:
                opt.close()

        # Phase 3: exported to torch's AdamW, which continues.
        model = make("head")
        state = zc.torch_state_dict(out_ckpt, model.named_parameters())
        state.load_params(model.named_parameters())
        check_same(model, snaps[K + M], "loaded into torch")
        names = [n for n, _ in model.named_parameters()]
        for i, n in enumerate(names):
            st = state.state_dict["state"][i]["step"]
            got = int(st.item() if isinstance(st, torch.Tensor) else st)
            want = (sum(1 for s in range(1, K + M + 1) if s % 2 == 1) if n.startswith("aux")
                    else K + M)
            if got != want:
                print(f"FAIL: the exported state['step'] of {n} is {got}; torch's is {want}")
                return False
        topt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1, foreach=False)
        topt.load_state_dict(copy.deepcopy(state.state_dict))
        for step in range(K + M + 1, K + M + N + 1):
            ref_step(model, topt, step, 1)
            check_same(model, snaps[step], f"in torch after step {step}")
        st = topt.state_dict()["state"]
        for i in st:
            if not torch.equal(torch.as_tensor(st[i]["step"]),
                               torch.as_tensor(ref_state["state"][i]["step"])):
                print(f"FAIL: torch's step of parameter {i} after the export differs")
                return False

        # Phase 4: torch's state, its steps lagging, back into zerod for one step.
        path = tmp + "/torch.safetensors"
        zc.save_torch_state(topt, model.named_parameters(), path)
        back = zc.import_checkpoint(path, tmp + "/imported")
        model = make("head")
        with zerod.testing.LocalZerod(["--bucket_elems", "256", "--resume", back],
                                      log_level="info") as d:
            opt = ZeroOptimizer(model.named_parameters(), lr=3e-2, weight_decay=0.1,
                                socket=d.socket)
            try:
                check_same(model, snaps[K + M + N], "imported into zerod")
                step = K + M + N + 1
                model.zero_grad(set_to_none=True)
                loss_of(model, "head", step, 0, 1).backward()
                opt.step()
                check_same(model, snaps[step], f"imported, after step {step}")
            finally:
                opt.close()
    print(f"ok: bitwise equal to torch through W=2, a resume at W=1, torch and back; aux at "
          f"its own step ({aux_steps} of {K + M + N})", flush=True)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="all", choices=["head", "moe", "freeze", "all"])
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adagrad"])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--overlap", action="store_true", help="zerod with overlap_update = 1")
    ap.add_argument("--hooks", action="store_true",
                    help="ZeroOptimizer(overlap=True): buckets scattered from backward's hooks")
    ap.add_argument("--checkpoint", action="store_true",
                    help="the checkpoint with lagging steps (run_checkpoint) instead")
    a = ap.parse_args()
    if a.checkpoint:
        sys.exit(0 if run_checkpoint() else 1)
    kinds = ["head", "moe", "freeze"] if a.model == "all" else [a.model]
    ok = True
    for kind in kinds:
        cfg = {"model": kind, "steps": a.steps, "optimizer": a.optimizer, "overlap": a.overlap,
               "hooks": a.hooks}
        ok = run_config(cfg, a.world) and ok
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
