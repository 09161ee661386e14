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

And against torch itself (test_against_torch_adamw_on_cpu): zerod's CUDA update compared with
torch.optim.AdamW stepping a CPU copy of the model with the same gradients, bit for bit after
every step, plain, with amsgrad, with maximize and with clipping. zerod's CUDA kernel computes
torch's single-tensor formula of the running torch with a correctly rounded sqrt (README, "Which
torch it matches"); on CPU torch computes that formula by default where its sqrt is correctly
rounded (Debian's 1.13, builds without MKL), and with fused=True on 2.x (correctly rounded, the
same formula for tensors of 16 elements or more) where its sqrt is MKL's (PyPI's wheels). Clipping
on CUDA uses zerod's double norm: its coefficient must be within 4 ULP of the one
clip_grad_norm_ computes (COEF_ULPS), and the update bitwise given it. The same steps run first
against zerod's CPU backend told to follow the CUDA formula (sqrt_mode exact), on every machine.

The GPU tests are skipped where torch has no CUDA or no GPU is visible (Debian's python3-torch is
CPU-only): the file then exits 77 after the CPU run, or 1 if that failed.
"""

from __future__ import annotations

import copy
import struct
import unittest
from typing import Any, Dict, List

import common

torch = common.require_torch()
NO_GPU = None if torch.cuda.is_available() else (
    "torch sees no CUDA GPU (torch.cuda.is_available() is False; Debian's python3-torch is "
    "built without CUDA)")

import models  # noqa: E402
import zerod  # noqa: E402
import zerod.testing  # noqa: E402
from zerod.torch import ZeroOptimizer  # noqa: E402

STEPS = 60
LR = 3e-3
BUCKET_ELEMS = "2048"  # the MLP spans several buckets: per-bucket scatter from the hooks
SPIN_CYCLES = 20_000_000  # torch.cuda._sleep: about 10 ms at 2 GHz
# zerod's double clip norm against clip_grad_norm_'s fp32 one: the coefficients at most this many
# fp32 ULP apart (the documented maximum; test_optimizer.DOUBLE_NORM_ULPS says why)
COEF_ULPS = 4


def f32_bits(x: float) -> int:
    """x rounded to fp32, as its bits read as a signed integer (ordered like the floats >= 0)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def grads_of(opt: ZeroOptimizer) -> List[torch.Tensor]:
    """The optimizer's gradients as they stand in its grad buffer (views), in parameter order."""
    return list(opt._gviews)


def reference_impl(tc: unittest.TestCase) -> Dict[str, Any]:
    """torch.optim.AdamW's implementation choice that computes zerod's CUDA formula on CPU
    tensors here (module docstring); skips the test where none does."""
    import zerod.torch as zt

    sqrt_mode, why = zt._probe_sqrt()
    if sqrt_mode == "exact" and not why:
        return {"foreach": False}  # torch's default formula, and its sqrt is exact here
    if int(torch.__version__.split(".")[0]) >= 2:
        return {"fused": True}  # the same formula with a correctly rounded sqrt
    tc.skipTest(f"torch {torch.__version__} on this CPU takes its sqrt from MKL ({sqrt_mode}"
                f"{': ' + why if why else ''}) and has no fused=True: no CPU AdamW computes "
                f"zerod's CUDA formula here")
    return {}


def against_torch(tc: unittest.TestCase, daemon: Any, dev: torch.device) -> None:
    """Plain, amsgrad, maximize and clipped runs of steps_against_torch."""
    impl = reference_impl(tc)
    configs = [("plain", {}, 0.0), ("amsgrad", {"amsgrad": True}, 0.0),
               ("maximize", {"maximize": True}, 0.0), ("clipped", {}, 0.05)]
    for name, hp, max_norm in configs:
        with tc.subTest(config=name):
            steps_against_torch(tc, daemon, dev, name, hp, max_norm, impl)


def steps_against_torch(tc: unittest.TestCase, daemon: Any, dev: torch.device, name: str,
                        hp: Dict[str, Any], max_norm: float, impl: Dict[str, Any]) -> None:
    """6 steps of zerod (the model on dev, on daemon) against torch.optim.AdamW(**hp, **impl) on
    a CPU copy fed the same gradients: every parameter bitwise equal after every step. zerod
    follows its CUDA formula (sqrt_mode exact, the double clip norm) on either backend."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(),
                                torch.nn.Linear(48, 16))  # every tensor 16+ elements
    ref = copy.deepcopy(model)  # stays on the CPU
    model = model.to(dev)
    named = [(f"{name}.{n}", p) for n, p in model.named_parameters()]
    opt = ZeroOptimizer(named, lr=1e-2, weight_decay=0.1, max_grad_norm=max_norm,
                        socket=daemon.socket, replace=True, sqrt_mode="exact", **hp)
    opt._clip_norm = "double"  # the CUDA backend's norm, whatever order the package names
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, **hp, **impl)
    try:
        tc.assertEqual(opt.info.backend, dev.type)
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(32, 24, generator=g), torch.randn(32, 16, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev))
            if hp.get("amsgrad"):
                loss = loss * 0.5 ** step  # shrinking: the max stays above exp_avg_sq
            loss.backward()
            grads = [gr.to("cpu") for gr in grads_of(opt)]  # before the step
            for p, gr in zip(ref.parameters(), grads):
                p.grad = gr.clone()
            opt.step()
            where = f"{name}, step {step + 1}"
            if max_norm:
                r = opt.last_result
                total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
                coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
                tc.assertLess(coef, 1.0, f"{where}: max_norm {max_norm} should clip")
                ulps = abs(f32_bits(r.clip_coef) - f32_bits(coef))
                tc.assertLessEqual(ulps, COEF_ULPS, f"{where}: zerod's coefficient "
                                   f"{r.clip_coef!r}, clip_grad_norm_'s {coef!r}")
                with torch.no_grad():  # the update given zerod's coefficient
                    for p, gr in zip(ref.parameters(), grads):
                        p.grad.copy_(gr).mul_(r.clip_coef)
            ropt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            got = [(n, p.detach().to("cpu")) for n, p in model.named_parameters()]
            common.assert_params_equal(tc, got, list(ref.named_parameters()),
                                       f"{where} against torch.optim.AdamW({impl}) on CPU")
    finally:
        opt.close()


class AgainstTorchOnCpuTest(unittest.TestCase):
    """test_against_torch_adamw_on_cpu's logic with zerod's CPU backend following the CUDA
    formula: it runs on every machine, so that the GPU test's own checks are known to pass
    where the formula is right (and to fail where it is not) before a GPU runs them."""

    def test_against_torch_adamw_on_cpu(self) -> None:
        with zerod.testing.LocalZerod(["--backend", "cpu"], log_level="info") as d:
            against_torch(self, d, torch.device("cpu"))


class TorchCudaTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        if NO_GPU:
            raise unittest.SkipTest(NO_GPU)
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

    def test_against_torch_adamw_on_cpu(self) -> None:
        with zerod.Client(self.gpu_daemon.socket) as c:
            dev = torch.device("cuda", c.cuda_device())
        against_torch(self, self.gpu_daemon, dev)

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
    common.run(AgainstTorchOnCpuTest, TorchCudaTest)


if __name__ == "__main__":
    main()
