"""Models and data of the Python conformance tests and the example: a small MLP and a tiny
GPT-style transformer (token + position embedding, two pre-LayerNorm blocks of causal
self-attention and MLP, final LayerNorm, output head tied to the token embedding), with
deterministic synthetic batches per (step, rank) so that any process can recompute any rank's
batch."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, n_in: int = 32, hidden: int = 64, n_out: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_in, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                                 nn.GELU(), nn.Linear(hidden, n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2,
                 ctx: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return F.linear(self.ln_f(x), self.tok.weight)  # head tied to the embedding


def make_model(kind: str, seed: int = 1234) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP()
    if kind == "transformer":
        return TinyGPT()
    raise ValueError(f"unknown model {kind!r}; expected mlp or transformer")


def _gen(step: int, rank: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * step + 7_919 * rank + salt)


_TEACHER = torch.Generator().manual_seed(99)
TEACHER = torch.randn(32, 10, generator=_TEACHER)


def batch(kind: str, step: int, rank: int, dtype: torch.dtype = torch.float32,
          size: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of step `step` (the same in every process)."""
    if kind == "mlp":
        g = _gen(step, rank, 1)
        x = torch.randn(size or 64, 32, generator=g)
        y = (x @ TEACHER).argmax(dim=-1)
        return x.to(dtype), y
    g = _gen(step, rank, 2)
    n, t, vocab = size or 16, 17, 64
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(t)) % vocab
    return seq[:, :-1], seq[:, 1:]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def param_groups(model: nn.Module, named: bool, weight_decay: float = 0.1) -> List[Dict[str, Any]]:
    """GPT-style groups: matrices and embeddings decay, biases and LayerNorm weights do not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append((name, p) if named else p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(steps: int, warmup: int = 20):
    """Linear warm-up, then cosine decay to 10%."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, t)))
    return f
