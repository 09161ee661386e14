#!/usr/bin/env python3
"""Trains a GPT-2-style language model through zerod on synthetic tokens.

The model is a decoder-only transformer in plain torch, shaped like GPT-2: token and position
embeddings, pre-LayerNorm blocks of causal self-attention and a GELU MLP, a final LayerNorm and
an output head tied to the token embedding (--untied-head: a separate one). The script starts a
local zerod world (one daemon serving --world ranks), one trainer process per rank attached
through zerod.torch.ZeroOptimizer, and trains each rank on its own batches (data parallel: zerod
averages the ranks' gradients, then runs AdamW on its fp32 master shards). Rank 0 prints a
progress line every --log-every steps: the step, rank 0's mean loss since the previous line,
tokens/s over all ranks, and zerod's mean step time (at --world 2 and more it includes waiting
for the slowest rank); the script ends with a summary.

The tokens come from a fixed Markov source: each token is followed by one of 4 successors of its
own, with probabilities 0.5, 0.25, 0.15 and 0.1, so a model that learns the table reaches a loss
of 1.208 nats per token (the source's entropy), down from ln(vocab) at the start. Batches are a
function of (step, rank) only: any process can recompute any rank's batch.

Sizes (--size):
  tiny   4 layers, d_model 128, 4 heads, vocab 256, context 64, batch 8 (0.8M parameters): CI
         and laptops; 30 steps take about 1 s on one core with PyPI's torch 2.x, 12 s with
         Debian's torch 1.13 (its BLAS is slower), and 300 bring the loss near 1.3.
  small  GPT-2 small: 12 layers, d_model 768, 12 heads, vocab 50257, context 1024, batch 1
         (124M parameters); --context shortens the context (e.g. 256 on a CPU).

--compare trains a copy of the model with torch.optim.AdamW alongside, in rank 0's process, on
the same global batches (the mean of every rank's gradients, summed in rank order, as zerod
averages them) and prints the largest |difference| of the parameters at the end: 0.0 on CPU,
where zerod's update is bit-identical to the running torch's AdamW (README, "Which torch"). The
copy's work is not counted in the progress line's tokens/s, but it slows the run down.

--device cuda puts the model on the GPU of each rank (rank i: GPU i) and starts zerod with its
CUDA backend: the parameter and gradient buffers are device memory shared with zerod, and the
master weights and moments live on the GPU too. It exits with status 2 when torch sees no CUDA
GPU (or fewer than --world).

--offload keeps the model on the GPU (implies --device cuda) and starts zerod with its CPU
backend: the master weights and Adam moments live in host memory, in zerod (zerod.offload: each
bucket's gradients are copied to pinned host buffers as backward completes it, and the parameters
copied back after the step); the GPU holds the parameters and gradients only. Its update follows
torch's CPU AdamW formula; with --compare the reference steps with torch's CUDA single-tensor
AdamW on the GPU, so the difference is 0.0 only where that computes the CPU formula's bits
(scripts/gpu_check.sh's offload probe says whether it does).

Run from the repository root after a build (ninja -C build), with Debian's torch 1.13 or a
torch 2.x:

    /usr/bin/python3 examples/train_gpt2.py [--size tiny|small] [--steps N] [--world N]
        [--device cpu|cuda] [--offload] [--compare] [--context N] [--batch N] [--log-every N]

The zerod binary and libzerod come from ./build unless ZEROD_BIN / ZEROD_LIBRARY say otherwise.
Exit status: 0 trained, 1 a trainer or zerod failed, 2 cannot run here (no build, no GPU).
"""

from __future__ import annotations

import argparse
import copy
import math
import multiprocessing as mp
import os
import sys
import time
from queue import Empty
from typing import Any, Dict, List, Optional, Tuple

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

SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(layers=4, d_model=128, heads=4, vocab=256, context=64, batch=8, lr=3e-3),
    "small": dict(layers=12, d_model=768, heads=12, vocab=50257, context=1024, batch=1, lr=6e-4),
}
SUCCESSOR_PROBS = (0.5, 0.25, 0.15, 0.1)
SOURCE_ENTROPY = -sum(p * math.log(p) for p in SUCCESSOR_PROBS)  # nats per token
DATA_SEED, MODEL_SEED = 2024, 1234


# ---- the model -----------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(d, dim=-1))
        if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2.0: no t x t matrix kept
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch 1.13
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = att.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, layers: int, d_model: int, heads: int,
                 tied: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = None if tied else nn.Linear(d_model, vocab, bias=False)
        # GPT-2's initialisation: N(0, 0.02), the residual projections scaled by 1/sqrt(2 layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        x = self.ln_f(x)
        return self.head(x) if self.head is not None else F.linear(x, self.wte.weight)


def make_model(cfg: Dict[str, Any]) -> GPT:
    torch.manual_seed(MODEL_SEED)
    return GPT(cfg["vocab"], cfg["context"], cfg["layers"], cfg["d_model"], cfg["heads"],
               tied=not cfg["untied_head"])


def param_groups(model: nn.Module, named: bool) -> List[Dict[str, Any]]:
    """GPT-2's two groups, as nanoGPT makes them: weight decay on every tensor of 2+ dimensions
    (the embeddings included), none on biases and LayerNorms."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append((n, p) if named else p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(steps: int):
    warmup = max(1, steps // 10)

    def f(s: int) -> float:  # linear warmup, cosine down to 10%
        if s < warmup:
            return (s + 1) / warmup
        done = min(1.0, (s - warmup) / max(1, steps - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * done))
    return f


# ---- the data ------------------------------------------------------------------------------------

def successor_table(vocab: int) -> torch.Tensor:
    """Each token's 4 distinct successors: token + increasing offsets in (0, vocab)."""
    g = torch.Generator().manual_seed(DATA_SEED)
    offsets = torch.randint(1, max(2, vocab // len(SUCCESSOR_PROBS)),
                            (vocab, len(SUCCESSOR_PROBS)), generator=g).cumsum(dim=1)
    return (torch.arange(vocab).unsqueeze(1) + offsets) % vocab


def make_batch(table: torch.Tensor, step: int, rank: int, batch: int,
               context: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of step `step`: `batch` sequences of context + 1 tokens of the Markov
    source; inputs are the first `context` tokens, targets the last `context`."""
    g = torch.Generator().manual_seed(1_000_003 * step + 7_919 * rank + DATA_SEED)
    vocab = table.shape[0]
    seq = torch.empty(batch, context + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    choice = torch.multinomial(torch.tensor(SUCCESSOR_PROBS), batch * context, replacement=True,
                               generator=g).view(batch, context)
    for t in range(context):
        seq[:, t + 1] = table[seq[:, t], choice[:, t]]
    return seq[:, :-1], seq[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ---- a trainer -----------------------------------------------------------------------------------

class Reference:
    """torch.optim.AdamW on a copy of the model, stepped on the mean of every rank's gradients
    (summed in rank order, then scaled by 1/world, as zerod averages them)."""

    def __init__(self, model: nn.Module, cfg: Dict[str, Any], world: int) -> None:
        self.model = copy.deepcopy(model)
        self.cfg, self.world = cfg, world
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(param_groups(self.model, named=False), lr=cfg["lr"],
                                     betas=(0.9, 0.95), eps=1e-8, foreach=False)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg["steps"]))

    def step(self, table: torch.Tensor, step: int, device: torch.device) -> None:
        total: Optional[List[torch.Tensor]] = None
        for r in range(self.world):
            for p in self.params:
                p.grad = None
            x, y = make_batch(table, step, r, self.cfg["batch"], self.cfg["context"])
            loss_of(self.model, x.to(device), y.to(device)).backward()
            g = [p.grad for p in self.params]
            total = g if total is None else [a + b for a, b in zip(total, g)]
        assert total is not None
        for p, g in zip(self.params, total):
            p.grad = g * (1.0 / self.world) if self.world > 1 else g
        self.opt.step()
        self.sched.step()

    def max_diff(self, model: nn.Module) -> Tuple[float, bool]:
        """The largest |difference| over every parameter, and whether all are bitwise equal."""
        worst, same = 0.0, True
        with torch.no_grad():
            for a, b in zip(model.parameters(), self.params):
                worst = max(worst, float((a.double() - b.double()).abs().max()))
                same = same and torch.equal(a, b)
        return worst, same


def trainer(rank: int, world: int, endpoint: Tuple[str, int], cfg: Dict[str, Any],
            queue: Any) -> None:
    """One rank: trains through zerod; rank 0 prints the progress lines. Puts its result (or
    its error) on the queue."""
    try:
        torch.set_num_threads(cfg["threads"])
        client = zerod.Client(endpoint[0], endpoint[1])
        try:
            dev = torch.device("cpu")
            if cfg["offload"]:  # a CPU zerod gives the rank no GPU: rank i, GPU i
                dev = torch.device("cuda", rank)
                torch.cuda.set_device(dev)
            elif cfg["device"] == "cuda":
                dev = torch.device("cuda", client.cuda_device())  # the GPU zerod gives the rank
                torch.cuda.set_device(dev)
            model = make_model(cfg).to(dev)
            ref = Reference(model, cfg, world) if cfg["compare"] and rank == 0 else None
            # foreach=False: the formula of the reference's torch path (on CUDA torch's
            # single-tensor and foreach paths round differently; on CPU it is the default)
            opt = ZeroOptimizer(param_groups(model, named=True), lr=cfg["lr"], betas=(0.9, 0.95),
                                eps=1e-8, client=client, replace=True, foreach=False,
                                **({"offload": True} if cfg["offload"] else {}))
            result = train(rank, world, cfg, model, opt, ref, dev)
            opt.close()
        finally:
            client.close()
        queue.put((rank, result))
    except BaseException as e:  # report instead of hanging the parent
        import traceback
        queue.put((rank, {"error": f"{e}\n{traceback.format_exc()}"}))


def train(rank: int, world: int, cfg: Dict[str, Any], model: nn.Module, opt: ZeroOptimizer,
          ref: Optional[Reference], dev: torch.device) -> Dict[str, Any]:
    table = successor_table(cfg["vocab"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg["steps"]))
    steps, every = cfg["steps"], cfg["log_every"]
    tokens_per_step = cfg["batch"] * cfg["context"] * world
    losses: List[torch.Tensor] = []
    loss_values: List[float] = []
    zerod_us: List[int] = []
    train_s = 0.0  # time spent on zerod's model: data, forward, backward, step
    window_s, window_us, window_start = 0.0, 0, 0
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = make_batch(table, step, rank, cfg["batch"], cfg["context"])
        opt.zero_grad()
        loss = loss_of(model, x.to(dev), y.to(dev))
        loss.backward()  # the hooks scatter each bucket as soon as its gradients are final
        opt.step()
        sched.step()
        losses.append(loss.detach())
        assert opt.last_result is not None
        zerod_us.append(opt.last_result.duration_us)
        if step + 1 == steps or (step + 1) % every == 0:
            loss_values.extend(float(v) for v in torch.stack(losses).cpu())  # syncs a GPU
            losses.clear()
        dt = time.perf_counter() - t0
        train_s += dt
        window_s += dt
        window_us += zerod_us[-1]
        if ref is not None:
            ref.step(table, step, dev)
        if rank == 0 and (step + 1 == steps or (step + 1) % every == 0):
            n = step + 1 - window_start
            loss_mean = sum(loss_values[-n:]) / n
            line = (f"step {step + 1:>{len(str(steps))}}/{steps}  loss {loss_mean:.4f}  "
                    f"{n * tokens_per_step / window_s:>9,.0f} tokens/s  zerod step "
                    f"{window_us / n / 1000:.2f} ms  ({window_s / n * 1000:.0f} ms/step)")
            if ref is not None:
                line += f"  max |diff| {ref.max_diff(model)[0]:.3g}"
            print(line, flush=True)
            window_s, window_us, window_start = 0.0, 0, step + 1
    result: Dict[str, Any] = {"losses": loss_values, "zerod_us": zerod_us, "train_s": train_s,
                              "buckets": opt.info.nbuckets, "backend": opt.info.backend}
    if ref is not None:
        result["max_diff"], result["identical"] = ref.max_diff(model)
    return result


# ---- the parent ----------------------------------------------------------------------------------

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


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny",
                    help="tiny (0.9M parameters) or small (GPT-2 small, 124M); default tiny")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    ap.add_argument("--world", type=int, default=1,
                    help="ranks, one trainer process each (default 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model and zerod's state live (default cpu)")
    ap.add_argument("--offload", action="store_true",
                    help="the model on the GPU, its optimizer state in a CPU zerod (implies "
                         "--device cuda)")
    ap.add_argument("--compare", action="store_true",
                    help="train a copy with torch.optim.AdamW alongside and print the largest "
                    "parameter difference")
    ap.add_argument("--context", type=int, help="sequence length (default: the size's, at most "
                    "its context)")
    ap.add_argument("--batch", type=int, help="sequences per rank and step (default: the size's)")
    ap.add_argument("--untied-head", action="store_true",
                    help="an output head of its own instead of the token embedding's")
    ap.add_argument("--lr", type=float, help="peak learning rate (default: the size's)")
    ap.add_argument("--log-every", type=int,
                    help="a progress line every N steps (default: steps / 10)")
    ap.add_argument("--threads", type=int,
                    help="torch threads per trainer (default: torch's own default, at most "
                    "CPUs / world)")
    return ap.parse_args()


def main() -> int:
    a = parse_args()
    cfg = dict(SIZES[a.size])
    if a.context is not None:
        if not 1 <= a.context <= cfg["context"]:
            print(f"--context {a.context}: expected 1 to {cfg['context']} for --size {a.size}",
                  file=sys.stderr)
            return 2
        cfg["context"] = a.context
    for key, value in (("batch", a.batch), ("lr", a.lr)):
        if value is not None:
            cfg[key] = value
    if a.steps < 1 or a.world < 1 or cfg["batch"] < 1:
        print("--steps, --world and --batch must be at least 1", file=sys.stderr)
        return 2
    if a.offload:
        a.device = "cuda"
    cfg.update(steps=a.steps, device=a.device, compare=a.compare, untied_head=a.untied_head,
               offload=a.offload,
               log_every=max(1, a.log_every or a.steps // 10),
               threads=a.threads or max(1, min(torch.get_num_threads(),
                                               (os.cpu_count() or 1) // a.world)))

    for what, var in (("zerod", "ZEROD_BIN"), ("libzerod", "ZEROD_LIBRARY")):
        if not os.path.exists(os.environ[var]):
            print(f"{what} not found at {os.environ[var]}: build first (ninja -C build), or set "
                  f"{var}", file=sys.stderr)
            return 2
    if a.device == "cuda":
        if not torch.cuda.is_available():
            print(f"--device cuda: torch {torch.__version__} sees no CUDA GPU "
                  f"(torch.cuda.is_available() is False: a CPU-only build, such as Debian's "
                  f"python3-torch, or no GPU/driver); run with --device cpu", file=sys.stderr)
            return 2
        if torch.cuda.device_count() < a.world:
            print(f"--device cuda --world {a.world}: one GPU per rank is needed, torch sees "
                  f"{torch.cuda.device_count()}", file=sys.stderr)
            return 2

    nparams = sum(p.numel() for p in make_model(cfg).parameters())
    print(f"GPT-2 {a.size}: {cfg['layers']} layers, d_model {cfg['d_model']}, {cfg['heads']} "
          f"heads, vocab {cfg['vocab']}, context {cfg['context']}, "
          f"{'untied' if a.untied_head else 'tied'} head: {nparams:,} parameters", flush=True)
    print(f"zerod: {a.world} rank(s), {a.device}, batch {cfg['batch']} x {cfg['context']} tokens "
          f"per rank, {cfg['threads']} torch thread(s) per trainer, torch {torch.__version__}, "
          f"{zerod.library_path()}", flush=True)
    # Several buckets, so that the scatter of one overlaps the backward of the next.
    args = ["--bucket_elems", str(max(16384, nparams // 8))]
    if a.device == "cuda":
        args += ["--backend", "cpu" if a.offload else "cuda"]
    t0 = time.monotonic()
    with zerod.testing.LocalWorld(a.world, args=args, log_level="info") as w:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=trainer, args=(r, a.world, w.endpoint(r), cfg, queue))
                 for r in range(a.world)]
        for p in procs:
            p.start()
        results = collect(procs, queue)
    wall = time.monotonic() - t0
    failed = [f"rank {r}: {res['error']}" for r, res in sorted(results.items()) if "error" in res]
    if failed:
        print("\n".join(failed), file=sys.stderr)
        return 1

    steps = a.steps
    losses = [sum(results[r]["losses"][s] for r in range(a.world)) / a.world for s in range(steps)]
    tail = max(1, steps // 10)
    r0 = results[0]
    zerod_ms = sum(r0["zerod_us"]) / steps / 1000
    tokens = steps * cfg["batch"] * cfg["context"] * a.world
    print(f"\nsummary: {steps} steps, {tokens:,} tokens, {a.world} rank(s), zerod backend "
          f"{r0['backend']}, {r0['buckets']} buckets")
    print(f"  loss (mean over ranks): {losses[0]:.4f} at step 1 -> {sum(losses[-tail:]) / tail:.4f}"
          f" (mean of the last {tail} steps); the source's entropy is {SOURCE_ENTROPY:.4f}, "
          f"ln(vocab) {math.log(cfg['vocab']):.4f}")
    print(f"  throughput: {tokens / r0['train_s']:,.0f} tokens/s, zerod step {zerod_ms:.2f} ms "
          f"mean, {r0['train_s'] / steps * 1000:.0f} ms per step on rank 0 "
          f"({wall:.1f} s in all, start-up included)")
    if a.compare:
        print(f"  torch.optim.AdamW on a copy: max |diff| {r0['max_diff']!r} over {nparams:,} "
              f"parameters ({'bitwise identical' if r0['identical'] else 'NOT bitwise identical'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
