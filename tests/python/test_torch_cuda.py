"""ZeroOptimizer with the model on a GPU (suite `gpu`): device buffers shared with zerod's CUDA
backend through CUDA IPC, torch's streams ordered with zerod's by libzerod's IPC events.

The reference is the same training through a second ZeroOptimizer whose model is on the CPU, on a
zerod running its CPU backend, fed the very gradients the GPU model computed (copied to the host
after each backward). The CPU path is itself bitwise equal to torch.optim.AdamW on torch 1.13
(test_conformance); comparing against it rather than against torch's optimizer keeps this test
independent of the torch version a CUDA machine has (torch 2's AdamW rounds differently). Every
parameter must be bitwise equal after every step: fp32, and bf16 params with bf16 grads. Every
third step runs on a side stream (torch.cuda.stream): step()'s request then names the side
stream, while the hooks' scatters name the stream autograd accumulates on (that of the
AccumulateGrad nodes the optimizer keeps: the default stream it was built under). A spin kernel
ahead of backward and of step() keeps the GPU busy while the host sends the requests, so a
request that zerod ran without waiting for the stream, or parameters read before zerod's update,
fail the comparison instead of losing a race to the small MLP's microsecond kernels. Also: the
errors for a model on the wrong kind of memory, and a model that stays usable after close().

Skipped (77) where torch has no CUDA or no GPU is visible (Debian's python3-torch is CPU-only).
"""

from __future__ import annotations

import unittest
from typing import Any, List

import common

torch = common.require_torch()
if not torch.cuda.is_available():
    common.skip("torch sees no CUDA GPU (torch.cuda.is_available() is False; Debian's "
                "python3-torch is built without CUDA)")

import models  # noqa: E402
import zerod  # noqa: E402
import zerod.testing  # noqa: E402
from zerod.torch import ZeroOptimizer  # noqa: E402

STEPS = 60
LR = 3e-3
BUCKET_ELEMS = "2048"  # the MLP spans several buckets: per-bucket scatter from the hooks
SPIN_CYCLES = 20_000_000  # torch.cuda._sleep: about 10 ms at 2 GHz


def grads_of(opt: ZeroOptimizer) -> List[torch.Tensor]:
    """The optimizer's gradients as they stand in its grad buffer (views), in parameter order."""
    return list(opt._gviews)


class TorchCudaTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.gpu_daemon = zerod.testing.LocalZerod(["--backend", "cuda", "--bucket_elems",
                                                   BUCKET_ELEMS], log_level="info")
        cls.cpu_daemon = zerod.testing.LocalZerod(["--backend", "cpu", "--bucket_elems",
                                                   BUCKET_ELEMS], log_level="info")

    @classmethod
    def tearDownClass(cls) -> None:
        cls.gpu_daemon.stop()
        cls.cpu_daemon.stop()

    def train(self, dtype: torch.dtype) -> None:
        with zerod.Client(self.gpu_daemon.socket) as c:  # the rank's GPU, as we number it
            dev = torch.device("cuda", c.cuda_device())
        model = models.make_model("mlp").to(dtype)
        ref = models.make_model("mlp").to(dtype)
        model = model.to(dev)
        opt = ZeroOptimizer(models.param_groups(model, named=True), lr=LR,
                            socket=self.gpu_daemon.socket, replace=True)
        ref_opt = ZeroOptimizer(models.param_groups(ref, named=True), lr=LR,
                                socket=self.cpu_daemon.socket, replace=True)
        self.assertEqual(opt.info.backend, "cuda")
        sched_fn = models.lr_lambda(STEPS)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, sched_fn)
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, sched_fn)
        side = torch.cuda.Stream(dev)
        # The side stream's gradients are accumulated on the default stream, on purpose.
        if hasattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch"):
            torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
        try:
            for p in model.parameters():  # views of device buffers, on the model's GPU
                self.assertEqual(p.device, dev)
            for step in range(STEPS):
                # Every third step runs forward, backward and step on a side stream.
                stream = side if step % 3 == 2 else torch.cuda.current_stream(dev)
                with torch.cuda.stream(stream):
                    x, y = models.batch("mlp", step, 0, dtype)
                    opt.zero_grad()
                    loss = models.loss_fn(model, x.to(dev), y.to(dev))
                    torch.cuda._sleep(SPIN_CYCLES)  # backward's kernels wait; its hooks do not
                    loss.backward()
                    gpu_grads = [g.to("cpu") for g in grads_of(opt)]  # before the step
                    torch.cuda._sleep(SPIN_CYCLES)  # zerod's step waits for it, then we for zerod
                    opt.step()
                    sched.step()
                ref_opt.zero_grad()
                with torch.no_grad():
                    for g_ref, g in zip(grads_of(ref_opt), gpu_grads):
                        g_ref.copy_(g)
                ref_opt.step()
                ref_sched.step()
                torch.cuda.synchronize(dev)
                got = [(n, p.detach().to("cpu")) for n, p in model.named_parameters()]
                common.assert_params_equal(self, got, ref.named_parameters(),
                                           f"{dtype} step {step} (loss {float(loss):.6f})")
            self.assertEqual(opt.step_count, STEPS)
        finally:
            opt.close()
            ref_opt.close()
        # After close() the model holds private copies and still trains on the GPU.
        out = model(models.batch("mlp", 0, 0, dtype)[0].to(dev))
        self.assertTrue(bool(torch.isfinite(out.float()).all()))

    def test_fp32(self) -> None:
        self.train(torch.float32)

    def test_bf16(self) -> None:
        self.train(torch.bfloat16)

    def test_cuda_params_need_the_cuda_backend(self) -> None:
        model = models.make_model("mlp").cuda()
        with self.assertRaises(zerod.ZerodError) as cm:
            ZeroOptimizer(model.parameters(), lr=LR, socket=self.cpu_daemon.socket)
        self.assertEqual(cm.exception.name, "ZD_EBACKEND", str(cm.exception))

    def test_cpu_params_need_the_cpu_backend(self) -> None:
        model = models.make_model("mlp")
        with self.assertRaises(zerod.ZerodError) as cm:
            ZeroOptimizer(model.parameters(), lr=LR, socket=self.gpu_daemon.socket,
                          replace=True)
        self.assertEqual(cm.exception.name, "ZD_EBACKEND", str(cm.exception))


def main() -> Any:
    common.run(TorchCudaTest)


if __name__ == "__main__":
    main()
