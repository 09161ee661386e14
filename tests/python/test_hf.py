"""Hugging Face Trainer on zerod (zerod.hf.ZeroTrainer), bitwise against Trainer's own run.

A GPT-2 built from a config in code (2 layers, d_model 32, no dropout) trains on synthetic
tokens, with what a real run has: a warm-up and a linear schedule, gradient clipping that binds
(max_grad_norm 0.5), gradient accumulation (2 micro-batches), weight decay on Trainer's groups,
a checkpoint saved half-way. The reference is Trainer with its default optimizer
(adamw_torch_fused) run straight through; ZeroTrainer's run must end with every parameter
bitwise equal, and so must a ZeroTrainer run resumed (resume_from_checkpoint) from the middle
checkpoint by a fresh trainer against a fresh zerod started with --resume the zerod checkpoint
that the save recorded.

W=1 runs in this process. W=2 runs under torchrun (torch's own launcher from this interpreter,
two processes, DDP over Gloo) against one zerod of two local ranks; ZeroTrainer reduces the
gradients through zerod alone (zerod.ddp). At W=2 zerod clips by torch's fp32 total norm of the
averaged gradient, its parameters split across the two ranks' slices chained in torch's order
(kernels/grad_norm.h): both W=2 runs, max_grad_norm high enough not to bind (the clipping pass
still runs on both sides) and a binding one, must be bitwise equal.
Also: an optim zerod cannot reproduce is refused, naming the ones it can.

Needs transformers (and accelerate, which Trainer needs) in this interpreter: exits 77 (SKIP)
without them (the frameworks suite runs it under $ZEROD_TORCH2_PYTHON).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest
from typing import Any, Dict, List

import common

torch = common.require_torch()
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: configs built in code
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
try:
    import accelerate  # noqa: F401  (Trainer needs it)
    import transformers
except ImportError as e:
    common.skip(f"transformers/accelerate are not importable here ({e}): scripts/torch2_venv.sh "
                f"--frameworks installs them into the torch 2.x venv")

if not torch.cuda.is_available():
    # The torch2 venv's CUDA libraries are stand-ins (scripts/torch2_stubs.py) that answer "no
    # device"; torch.cuda.is_current_stream_capturing(), which transformers asks at every forward,
    # crashes on them instead of answering. Without a GPU nothing is being captured.
    torch.cuda.is_current_stream_capturing = lambda: False

import zerod.hf  # noqa: E402
import zerod.testing  # noqa: E402
from zerod.hf import ZeroTrainer, zero_optimizer  # noqa: E402

STEPS, SAVE_AT = 6, 3


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences (a fixed generator): nothing to download."""

    def __init__(self, n: int = 48, length: int = 16, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def make_model() -> Any:
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def make_args(out: str, max_grad_norm: float = 0.5, **kw: Any) -> Any:
    return transformers.TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=5e-3, warmup_steps=2,
        lr_scheduler_type="linear", weight_decay=0.1, max_grad_norm=max_grad_norm,
        save_strategy="steps", save_steps=SAVE_AT, logging_steps=1, report_to=[], seed=0,
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, **kw)


def params_of(model: Any) -> Dict[str, Any]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def diffs(got: Dict[str, Any], want: Dict[str, Any]) -> List[str]:
    return [common.first_difference(n, got[n], want[n]) for n in want
            if not torch.equal(got[n], want[n])]


def max_diff(got: Dict[str, Any], want: Dict[str, Any]) -> float:
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def reference(out: str, **kw: Any) -> Dict[str, Any]:
    """Trainer's own run, its default optimizer (asserted: adamw_torch_fused)."""
    model = make_model()
    args = make_args(out, **kw)
    assert str(getattr(args.optim, "value", args.optim)) == "adamw_torch_fused", args.optim
    transformers.Trainer(model=model, args=args, train_dataset=Tokens()).train()
    return params_of(model)


def zerod_run(out: str, resume: Any = None, **kw: Any) -> Dict[str, Any]:
    model = make_model()
    trainer = ZeroTrainer(model=model, args=make_args(out, **kw), train_dataset=Tokens(),
                          zerod_options={"replace": resume is None, "timeout_ms": 120000})
    trainer.train(resume_from_checkpoint=resume)
    got = params_of(model)
    zerod.hf._zero(trainer.optimizer).close()
    return got


def zerod_checkpoint_of(out: str) -> str:
    with open(os.path.join(out, f"checkpoint-{SAVE_AT}", "zerod.json")) as f:
        rec = json.load(f)
    assert rec["step"] == SAVE_AT, rec
    return str(rec["zerod_checkpoint"])


class HFTrainerW1Test(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="zerod-hf-")
        self.ckpt = os.path.join(self.tmp, "zerod-ckpt")
        os.mkdir(self.ckpt)
        for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
            os.environ.pop(k, None)

    def tearDown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_bitwise_with_resume(self) -> None:
        want = reference(os.path.join(self.tmp, "ref"))
        out = os.path.join(self.tmp, "zerod")
        with zerod.testing.LocalZerod(["--checkpoint_dir", self.ckpt], log_level="info") as d:
            os.environ["ZEROD_SOCKET"] = d.socket
            got = zerod_run(out)
        self.assertEqual(diffs(got, want), [], "ZeroTrainer at W=1")
        zckpt = zerod_checkpoint_of(out)
        with zerod.testing.LocalZerod(["--checkpoint_dir", self.ckpt, "--resume", zckpt],
                                      log_level="info") as d:
            os.environ["ZEROD_SOCKET"] = d.socket
            got = zerod_run(out, resume=os.path.join(out, f"checkpoint-{SAVE_AT}"))
        self.assertEqual(diffs(got, want), [], "ZeroTrainer resumed from its checkpoint at W=1")

    def test_resume_against_wrong_step(self) -> None:
        out = os.path.join(self.tmp, "zerod")
        with zerod.testing.LocalZerod(["--checkpoint_dir", self.ckpt], log_level="info") as d:
            os.environ["ZEROD_SOCKET"] = d.socket
            zerod_run(out)
            # zerod still holds step 6: resuming the step-3 checkpoint against it is refused
            with self.assertRaisesRegex(RuntimeError, "zerod holds this model at step 6, but "
                                                      "the Trainer is at step 3"):
                zerod_run(out, resume=os.path.join(out, f"checkpoint-{SAVE_AT}"))

    def test_save_without_zerod_checkpoint_dir(self) -> None:
        with zerod.testing.LocalZerod(log_level="info") as d:
            os.environ["ZEROD_SOCKET"] = d.socket
            with self.assertRaisesRegex(RuntimeError, "Trainer saved a checkpoint at step 3, but "
                                                      "zerod could not write its own.*"
                                                      "--checkpoint_dir"):
                zerod_run(os.path.join(self.tmp, "zerod"))

    def test_unsupported_optim(self) -> None:
        args = make_args(self.tmp, optim="adafactor")
        with self.assertRaisesRegex(ValueError, "optim is 'adafactor', which zerod cannot "
                                                "reproduce.*'adamw_torch' or 'adamw_torch_fused'"):
            zero_optimizer(make_model(), args)


def worker(phase: str, out: str, max_grad_norm: float) -> None:
    """One torchrun worker: phase "train" runs the reference and ZeroTrainer; "resume" resumes
    ZeroTrainer from the middle checkpoint. Rank 0 keeps the reference's parameters in out."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    ref_file = os.path.join(out, "ref.pt")
    if phase == "train":
        want = reference(os.path.join(out, "ref"), max_grad_norm=max_grad_norm)
        if rank == 0:
            torch.save(want, ref_file)
        got = zerod_run(os.path.join(out, "zerod"), max_grad_norm=max_grad_norm)
    else:
        want = torch.load(ref_file)
        got = zerod_run(os.path.join(out, "zerod"), max_grad_norm=max_grad_norm,
                        resume=os.path.join(out, "zerod", f"checkpoint-{SAVE_AT}"))
    with open(os.path.join(out, f"result-{phase}-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "diffs": diffs(got, want)[:3], "max_diff": max_diff(got, want)},
                  f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HFTrainerW2Test(unittest.TestCase):
    def torchrun(self, phase: str, out: str, sock: str, max_grad_norm: float) -> List[Dict[str, Any]]:
        env = dict(os.environ, ZEROD_SOCKET=sock, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
               str(free_port()), __file__, "--worker", phase, out, str(max_grad_norm)]
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=400 * common.HANG_SCALE)
        self.assertEqual(p.returncode, 0, f"torchrun {phase}: {p.stdout[-4000:]}")
        res = []
        for r in range(2):
            with open(os.path.join(out, f"result-{phase}-{r}.json")) as f:
                res.append(json.load(f))
        return res

    def run_w2(self, max_grad_norm: float) -> List[List[Dict[str, Any]]]:
        tmp = tempfile.mkdtemp(prefix="zerod-hf2-")
        try:
            ckpt = os.path.join(tmp, "zerod-ckpt")
            os.mkdir(ckpt)
            with zerod.testing.LocalWorld(2, args=["--checkpoint_dir", ckpt],
                                          log_level="info") as w:
                trained = self.torchrun("train", tmp, w.endpoint(0)[0], max_grad_norm)
            zckpt = zerod_checkpoint_of(os.path.join(tmp, "zerod"))
            with zerod.testing.LocalWorld(2, args=["--checkpoint_dir", ckpt, "--resume", zckpt],
                                          log_level="info") as w:
                resumed = self.torchrun("resume", tmp, w.endpoint(0)[0], max_grad_norm)
            return [trained, resumed]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_bitwise_clip_not_binding(self) -> None:
        for what, results in zip(("trained", "resumed"), self.run_w2(1e4)):
            for res in results:
                print(f"W=2 max_grad_norm 1e4, {what}, rank {res['rank']}: max |diff| "
                      f"{res['max_diff']}")
                self.assertEqual(res["diffs"], [], f"W=2 {what} rank {res['rank']}")

    def test_binding_clip(self) -> None:
        for what, results in zip(("trained", "resumed"), self.run_w2(0.5)):
            for res in results:
                print(f"W=2 max_grad_norm 0.5 (binds), {what}, rank {res['rank']}: max |diff| "
                      f"{res['max_diff']}; {res['diffs'][:1]}")
                self.assertEqual(res["diffs"], [], f"W=2 {what} rank {res['rank']}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        sys.exit(0)
    common.run(HFTrainerW1Test, HFTrainerW2Test)
