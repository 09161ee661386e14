#!/usr/bin/env python3
"""Offload on a GPU (zerod.offload): the step time of a model on the GPU whose optimizer state is
in a CPU zerod, next to torch's fused AdamW on the GPU, next to the device-to-host and
host-to-device copies of the same bytes, and the GPU's idle share. GPU only: exits 77 where torch
sees no GPU.

Sizes (--size): "small", GPT-2 small's shape (124M parameters: 12 layers, width 768, 50,257-token
vocabulary, tied head, 1,024 positions); "large", 4.6B parameters (28 layers, width 3,584), sized
for an 80 GB H100: torch's AdamW keeps 16 bytes per fp32 parameter on the GPU (parameter,
gradient, two moments: 74 GB, and activations on top), which does not fit, while offload keeps 8
(37 GB) and puts zerod's 12 bytes per parameter (master, moments: 55 GB) plus the 8 of the pinned
buffers (37 GB) in host memory (so the host needs about 100 GB free); the torch row then says it
did not fit. "check" (scripts/gpu_check.sh): GPT-2 small's width and vocabulary with 6 layers
(81M), few steps, about 30 s.

Rows (medians over the timed steps, after warm-up steps): forward + backward alone (the floor);
torch.optim.AdamW(fused=True) on the GPU, whole step; offload, whole step (forward, backward with
its per-bucket copies and scatters, zerod's step, the gathers and the copies back); the D2H copy
of the gradient bytes into pinned memory and the H2D copy of the parameter bytes from it (one
copy each, alone); the GPU's idle share in an offload step: 1 - (forward + backward GPU time) /
(offload step time), the share of the step in which the trainer's stream waits for the host.

Run by hand: ZEROD_BIN=build/daemon/zerod ZEROD_LIBRARY=build/client/libzerod.so \\
PYTHONPATH=client/python python3 tests/bench/bench_offload.py --size small
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

SKIP = 77

SIZES = {  # layers, width, heads, vocabulary, sequence, batch, warm-up steps, timed steps
    "check": (6, 768, 12, 50257, 256, 4, 2, 4),
    "small": (12, 768, 12, 50257, 1024, 8, 3, 10),
    "large": (28, 3584, 28, 50257, 512, 1, 2, 5),
    "smoke": (2, 64, 4, 512, 32, 2, 1, 2),  # --smoke: the script's own check on the CPU
}


def build(torch, layers: int, width: int, heads: int, vocab: int, seq: int):
    nn = torch.nn

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, width)
            self.pos = nn.Embedding(1024, width)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
                for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.mask = None

        def forward(self, x):
            t = x.shape[1]
            if self.mask is None or self.mask.shape[0] != t:
                self.mask = torch.nn.Transformer.generate_square_subsequent_mask(t).to(x.device)
            h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
            for b in self.blocks:
                h = b(h, src_mask=self.mask)
            return self.norm(h) @ self.tok.weight.t()  # tied head

    return GPT()


def median_ms(xs):
    return statistics.median(xs) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--zerod", default=os.environ.get("ZEROD_BIN"), help="the zerod binary")
    ap.add_argument("--skip-torch", action="store_true", help="no torch AdamW row")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model on the CPU through the offload rehearsal: checks this "
                         "script without a GPU (its figures mean nothing)")
    args = ap.parse_args()
    # torch's CPU sqrt as one zerod reproduces (no warning about it; the figures do not care)
    os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
    try:
        import torch
    except ImportError:
        print("SKIP: torch is not importable")
        return SKIP
    smoke = args.smoke
    if smoke:
        args.size = "smoke"
    elif not torch.cuda.is_available():
        print(f"SKIP: torch {torch.__version__} sees no CUDA GPU")
        return SKIP
    import zerod.testing
    from zerod.torch import ZeroOptimizer
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    layers, width, heads, vocab, seq, bs, warm, timed = SIZES[args.size]
    dev = torch.device("cpu" if smoke else "cuda")

    class Timer:  # CUDA events, or the host clock for the smoke run
        def __init__(self) -> None:
            if smoke:
                self.t = [0.0, 0.0]
            else:
                self.e = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

        def mark(self, i: int) -> None:
            if smoke:
                self.t[i] = time.perf_counter()
            else:
                self.e[i].record()

        def seconds(self) -> float:
            if smoke:
                return self.t[1] - self.t[0]
            self.e[1].synchronize()
            return self.e[0].elapsed_time(self.e[1]) / 1e3

    def sync() -> None:
        if not smoke:
            torch.cuda.synchronize()
    torch.manual_seed(0)
    data = torch.randint(0, vocab, (bs, seq + 1), device=dev)
    x, y = data[:, :-1], data[:, 1:]

    def loss_of(model):
        out = model(x)
        return torch.nn.functional.cross_entropy(out.reshape(-1, vocab).float(), y.reshape(-1))

    rows = []
    nparams = 0

    # forward + backward alone, and torch's fused AdamW on the GPU
    model = build(torch, layers, width, heads, vocab, seq).to(dev)
    nparams = sum(p.numel() for p in model.parameters())
    where = "the CPU (smoke)" if smoke else torch.cuda.get_device_name()
    print(f"# bench_offload --size {args.size}: {nparams / 1e6:.0f}M parameters, batch {bs} x "
          f"{seq} tokens, {where}, torch {torch.__version__}", flush=True)
    fb, fb_gpu = [], []
    for i in range(warm + timed):
        sync()
        t0 = time.perf_counter()
        tm = Timer()
        tm.mark(0)
        for p in model.parameters():
            p.grad = None
        loss_of(model).backward()
        tm.mark(1)
        sync()
        if i >= warm:
            fb.append(time.perf_counter() - t0)
            fb_gpu.append(tm.seconds())
    rows.append(("forward + backward alone", median_ms(fb), ""))
    if not args.skip_torch:
        try:
            topt = torch.optim.AdamW(model.parameters(), lr=1e-4,
                                     **({} if smoke else {"fused": True}))
            ts = []
            for i in range(warm + timed):
                sync()
                t0 = time.perf_counter()
                topt.zero_grad(set_to_none=True)
                loss_of(model).backward()
                topt.step()
                sync()
                if i >= warm:
                    ts.append(time.perf_counter() - t0)
            mem = 0.0 if smoke else torch.cuda.max_memory_allocated() / 2**30
            rows.append(("torch AdamW(fused=True) on the GPU", median_ms(ts),
                         f"peak GPU memory {mem:.1f} GiB"))
            del topt
        except torch.cuda.OutOfMemoryError:  # type: ignore[misc]
            rows.append(("torch AdamW(fused=True) on the GPU", float("nan"),
                         "out of GPU memory: does not fit"))
    # the copies of the same bytes, alone
    pbytes = nparams * 4
    dsrc = torch.empty(nparams, dtype=torch.float32, device=dev)
    host = torch.empty(nparams, dtype=torch.float32, pin_memory=not smoke)
    for name, fn in (("D2H copy of the gradient bytes (pinned)", lambda: host.copy_(dsrc, non_blocking=True)),
                     ("H2D copy of the parameter bytes (pinned)", lambda: dsrc.copy_(host, non_blocking=True))):
        ts = []
        for i in range(2 + 5):
            tm = Timer()
            tm.mark(0)
            fn()
            tm.mark(1)
            if i >= 2:
                ts.append(tm.seconds())
        gbs = pbytes / statistics.median(ts) / 1e9
        rows.append((name, median_ms(ts), f"{pbytes / 2**20:.0f} MiB, {gbs:.1f} GB/s"))
    del dsrc, host, model
    if not smoke:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    # offload through a CPU zerod
    daemon = zerod.testing.LocalZerod(["--backend", "cpu"], binary=args.zerod, log_level="warn")
    try:
        model = build(torch, layers, width, heads, vocab, seq).to(dev)
        opt = ZeroOptimizer(model.named_parameters(), lr=1e-4, socket=daemon.socket,
                            replace=True, **({"offload": "rehearsal"} if smoke else {}))
        assert opt._offload is not None, "the optimizer did not offload"
        ts = []
        for i in range(warm + timed):
            sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_of(model).backward()
            opt.step()
            sync()
            if i >= warm:
                ts.append(time.perf_counter() - t0)
        mem = 0.0 if smoke else torch.cuda.max_memory_allocated() / 2**30
        step = median_ms(ts)
        rows.append(("offload through a CPU zerod", step,
                     f"peak GPU memory {mem:.1f} GiB, {opt.client.info.nbuckets} buckets"))
        idle = max(0.0, 1.0 - median_ms(fb_gpu) / step)
        opt.close()
    finally:
        daemon.stop()
    print(f"{'':<44} {'median ms':>10}")
    for name, ms, note in rows:
        print(f"{name:<44} {ms:>10.1f}  {note}")
    fwd = rows[0][1]
    print(f"offload step / forward+backward: {step / fwd:.2f}x; GPU idle share in an offload "
          f"step: {100 * idle:.0f}% (1 - forward+backward GPU time / step time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
