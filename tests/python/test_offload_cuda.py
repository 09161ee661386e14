"""The offload path with the model on a GPU (suite gpu): ZeroOptimizer with CUDA parameters on a
zerod running its CPU backend, against torch.optim.AdamW stepping a CPU fp32 copy with the same
gradients, bit for bit after every step: fp32, bf16, clipping, gradients changed after backward,
and a trainer that crashes and is replaced (test_offload_cpu.py's OffloadCase, which the python
suite runs as the CPU rehearsal). Also: libzerod's buffers are pinned (ZD_MEMORY_HOST_PINNED, as
torch sees them), and a probe that answers whether torch's CUDA single-tensor AdamW
(foreach=False, fused=False) computes the bits of its CPU formula, which offload follows: reported
(printed with the prefix "offload probe: ", and appended to $ZEROD_OFFLOAD_REPORT when set), not
asserted. Exits 77 where torch has no CUDA or sees no GPU.
"""

from __future__ import annotations

import os
import sys
import unittest

# The reference is torch's CPU AdamW, whose sqrt on PyPI's wheels is MKL's kernel for the CPU at
# hand: COMPATIBLE makes it the SSE4.2 one, which zerod reproduces (as run_torch2.sh does).
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import common  # noqa: E402

torch = common.require_torch()
if not torch.cuda.is_available():
    common.skip(f"torch {torch.__version__} sees no CUDA GPU (CUDA build: "
                f"{torch.version.cuda}); the offload path needs one")

import zerod.testing  # noqa: E402
from test_offload_cpu import (LR, STEPS, WD, OffloadCase, loss_of, make_model,  # noqa: E402
                              named)
from zerod.torch import ZeroOptimizer  # noqa: E402


def ulps(a, b) -> int:
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    return int((ia - ib).abs().max())


class OffloadCudaTest(OffloadCase, unittest.TestCase):
    DEVICE = "cuda"

    @classmethod
    def setUpClass(cls) -> None:
        cls.daemon = zerod.testing.LocalZerod(["--bucket_elems", "256", "--backend", "cpu"],
                                              log_level="info")

    @classmethod
    def tearDownClass(cls) -> None:
        cls.daemon.stop()

    def test_buffers_pinned(self) -> None:
        model = make_model(1).cuda()
        opt = ZeroOptimizer(named(model, "pinned"), socket=self.daemon.socket, replace=True)
        try:
            self.assertIsNotNone(opt._offload, "CUDA parameters on a CPU zerod did not offload")
            self.assertEqual(opt.client.memory, "host_pinned")
            self.assertTrue(opt._pflat.is_pinned(), "the param buffer is not pinned for CUDA")
            self.assertTrue(opt._gflat.is_pinned(), "the grad buffer is not pinned for CUDA")
        finally:
            opt.close()

    def test_probe_cuda_single_tensor(self) -> None:
        """torch's CUDA AdamW (foreach=False, fused=False) against its CPU AdamW, same gradients:
        reported. The offloaded model follows the CPU formula whatever this says."""
        torch.manual_seed(5)
        cpu = make_model(1)
        gpu = make_model(1).cuda()
        ocpu = torch.optim.AdamW(cpu.parameters(), lr=LR, weight_decay=WD, foreach=False)
        ogpu = torch.optim.AdamW(gpu.parameters(), lr=LR, weight_decay=WD, foreach=False,
                                 fused=False)
        first, worst, n = None, 0, 0
        for step in range(STEPS * 3):
            ocpu.zero_grad()
            loss_of(cpu, step, "cpu", torch.float32).backward()
            for p, q in zip(gpu.parameters(), cpu.parameters()):
                p.grad = q.grad.detach().cuda()
            ocpu.step()
            ogpu.step()
            for p, q in zip(gpu.parameters(), cpu.parameters()):
                n += p.numel()
                d = ulps(p.detach().cpu(), q.detach())
                worst = max(worst, d)
                if d and first is None:
                    first = step + 1
        verdict = ("bitwise" if first is None else
                   f"differs from step {first} (at most {worst} ULP over {STEPS * 3} steps)")
        line = (f"offload probe: torch {torch.__version__} CUDA single-tensor AdamW "
                f"(foreach=False, fused=False) vs its CPU AdamW on the same gradients: {verdict}; "
                f"offload follows the CPU formula")
        print("\n" + line, flush=True)
        report = os.environ.get("ZEROD_OFFLOAD_REPORT")
        if report:
            with open(report, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        from test_offload_cpu import child
        child(*sys.argv[2:6])
    common.run(OffloadCudaTest)
