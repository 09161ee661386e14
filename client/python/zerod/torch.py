"""ZeroOptimizer: a torch.optim.Optimizer whose optimizer state lives in zerod.

Moving a training script onto zerod is meant to be a one-line change::

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    opt = zerod.torch.ZeroOptimizer(model.parameters(), lr=3e-4, weight_decay=0.1)

How it works. At construction the optimizer registers the model's parameter list with a zerod
rank, which lays the parameters out in two flat shared-memory buffers (working params, grads).
Each parameter's ``.data`` becomes a view of the param buffer (its initial value is copied in
once) and its ``.grad`` a view of the grad buffer, as Megatron-LM's param and grad buffers are, so
nothing is copied per step: backward accumulates into the grad buffer, zerod reads it, runs
AdamW on its fp32 master shard and writes the updated parameters into the param buffer, which
the model reads directly.

Gradient accumulation into a preset ``.grad`` (checked on torch 1.13.1): when a leaf's ``.grad``
is defined, autograd's AccumulateGrad adds the new gradient into it in place
(``variable_grad += new_grad``; ``data_ptr()`` unchanged after every backward), for fp32 and bf16
alike. The cost is an elementwise add into the buffer per backward, as with torch's own
zero_grad(set_to_none=False), where set_to_none=True lets the first backward keep the new
gradient tensor instead; plus one memset of the whole buffer per zero_grad(). Measured on this
torch (CPU, 1 thread, 8.4M parameters): no slower than .grad=None, faster at small batches
because the buffer stays mapped and warm (backward 28 vs 36 ms at batch 1, 60 vs 65 ms at batch
4); the memset takes 1.5 ms. The exception
is ``backward(create_graph=True)``, where AccumulateGrad replaces ``.grad`` with a new tensor
out of place; a hook on each parameter's AccumulateGrad node (Megatron's
``param.expand_as(param).grad_fn.next_functions[0][0].register_hook``) notices that, copies the
result into the buffer and puts the view back, so the optimizer stays correct.

The same hooks drive communication: when every gradient of a bucket is final, the hook sends the
bucket's scatter (zd_scatter_start) without waiting, so zerod reduce-scatters bucket i while
backward still computes bucket i-1; step() waits for those and steps with ZD_STEP_NO_SCATTER.
Scatters always go out in descending bucket order (a bucket completed out of that order waits
for the buckets above it): zerod matches the collectives of different ranks by their order, so
every rank must send the same sequence even where autograd completes buckets in different
orders on different ranks. Parameters are registered in the order given (model order), so
backward normally completes the buckets in exactly that descending order.
Gradients changed between backward and step() (torch.nn.utils.clip_grad_norm_, unscaling, a
gradient set by hand) after the hooks sent their buckets are detected by the grad buffer's
version counter, which every in-place write through a ``.grad`` or ``main_grad`` view bumps:
step() then scatters every bucket again (a warning says so once), since at world size > 1 a
scatter reads the buffer when zerod runs it, during backward. Clip with ``max_grad_norm``
instead (zerod clips the reduced gradient by its global norm, inside the step), or pass
``overlap=False``. Every rank is expected to change its gradients alike (the same code on
every rank), so that every rank sends the same sequence of scatters.
Gradients accumulated over several micro-batches: run the backward of every micro-batch but the
last inside ``with opt.no_sync():`` (as with DistributedDataParallel), so buckets are scattered
only when the last micro-batch completes them. A DistributedDataParallel model joined to the
optimizer by zerod.ddp.register() needs only DDP's own ``model.no_sync()`` (what Trainer,
Accelerate and Lightning call): DDP then leaves the reduction to zerod (zerod.ddp).

When the gradient dtype differs from the parameter dtype (fp32 gradients for a bf16 model, or
fp16 gradients with loss scaling), ``.grad`` cannot be a view: torch requires ``.grad`` to have
its parameter's dtype. Then each parameter gets ``param.main_grad``, a view of the grad buffer,
and the hook adds ``.grad`` into it (converting) and sets ``.grad`` to None, as Megatron does with
``main_grad``.

What lives where. The fp32 master weights, Adam moments, step counter and loss scale live in
zerod and survive the trainer: a trainer that restarts and builds the same model and optimizer
again reattaches to the rank and continues from zerod's state (the param buffer is overwritten
with zerod's weights at registration; ``resumed`` is then True). ``state_dict()`` therefore holds
only the hyperparameters (for schedulers and bookkeeping) and zerod's step number, not the
moments.

Another trainer's death. At world size > 1 the trainers step together. When one of them dies
in the middle of a step, zerod abandons that step on every rank (nothing applied anywhere) and
the others get ZD_EABORTED; step() then retries it by itself, with the same gradients (a
warning says so), up to ``abort_retries`` times: the retry waits in zerod, up to its
``collective_timeout_ms``, for the dead trainer's replacement, which reattaches alone
(``resumed``, at ``step_count``: the steps applied) and steps from there. Past that many
retries step() raises the ZerodError (``retryable`` is true): calling step() again retries once
more.

A zerod's loss. With zerods whose state lives in a ``state_dir``, a zerod that is restarted
(its trainer's requests fail with ZD_ECLOSED) or a world that re-forms around a peer's restart
(ZD_EPEER: "register again") loses no step: step() registers the same model again on a new
connection to the same socket and local rank, with the same buffers (``Client.rejoin``), and
learns the step every rank holds. When it counts the step in flight, that step was applied on
every rank and the parameters are its result (``last_result`` then has NaN grad_norm and
clip_coef, which are lost); otherwise the step is sent again with the gradients still in the
grad buffer, every bucket scattered again. A warning says so; no exception reaches the training
loop. A scatter from backward's hooks that finds zerod gone is left for step(). The wait is
bounded by ``rejoin_timeout_s`` (default 120 s; 0 turns this off); past it, or when zerod came
back without the model's state (no state_dir) or at another step, step() raises ZerodError
naming the step lost and what it waited for. Host buffers only (not CUDA parameters or offload).

A live resize (``zeroctl resize --world_size N``). The ranks that stay answer ZD_EPEER too, but
the layout changes with the world size, so the same buffers cannot be registered again: step()
(or a scatter's or a lazy gather's error) sees the resize by the world size a new connection to
the same socket and local rank reports, lays the same model out on it for the new size, moves
``.data`` and ``.grad`` (``main_grad``) to the new buffers and registers; the step is then sent
again, or taken as applied, as above (``_follow_resize``). ``world_size`` says the world as it
is now (re-shard the data when it changes). A rank the resize left gets ZerodError ZD_ERANK
("left the world ... Stop this trainer"): its loop must stop. Needs an optimizer that opened its
own connection (no ``client`` passed).

CUDA. With the model on a GPU (every parameter on one device) the buffers are device memory that
libzerod allocates and shares with zerod's CUDA backend through CUDA IPC; the views are made
from them through ``__cuda_array_interface__``. Before each request the optimizer hands libzerod
torch's current stream (``zd_set_stream``): zerod's stream waits for what the trainer queued
before the request (the gradients), and the trainer's stream waits for zerod's results before
its later work, with no host synchronisation. Only that stream (the one current at step())
waits: work moved to another stream afterwards must be ordered by the trainer, as with torch's
own optimizers. The hooks keep each parameter's AccumulateGrad node alive, so autograd adds the
gradients on the stream current when the optimizer was built (after waiting for the stream that
produced them; the scatters name that stream): build it under the stream you train on, or
torch >= 2.10 warns once about the mismatch. The GPU must be the one zerod gives the rank
(``Client.cuda_device()``; the error says which); close() synchronises the device before it
copies the parameters out and before the buffers are freed. torch.as_tensor needs NumPy to
read ``__cuda_array_interface__``. CPU parameters need zerod's CPU backend. CUDA parameters
on a zerod running its CPU backend are offloaded (zerod.offload: the optimizer state in host
memory, the parameters and gradients on the GPU, copied per bucket through pinned host buffers;
the update follows torch's CPU formula, as for CPU parameters; the ``offload`` argument).

Which torch. zerod's update reproduces torch.optim.AdamW/Adam bit for bit as the running torch
computes it (docs/torch2/README.md): on CPU each group's ``update`` is "torch113" under torch 1.x
and "torch2" under torch 2.x (the first moment by lerp), and its ``sqrt_mode`` is what torch.sqrt
does on this machine, measured once per process on 65,536 probes against zerod's own
(zd_sqrt): "exact" (correctly rounded: Debian's torch, builds without MKL) or "mkl_ex" (MKL's
SSE4.2 kernel, which PyPI's wheels run on AMD and other non-Intel x86 CPUs); when torch matches
neither (MKL's kernels for Intel CPUs), a warning gives the measured mismatch and "exact" is
used. On CPU, foreach=True computes the same bits as torch's default (a warning says it changes
nothing); fused=True (torch 2.x) takes a correctly rounded sqrt ("exact"), and is refused with a
parameter smaller than one of its vectors, which its kernel computes by another formula. With
CUDA parameters (torch 2.x) each of torch's CUDA implementations has a formula of its own, and
``update`` follows the one torch would take: "torch2_cuda" for foreach=False (the single-tensor
path), "torch2_cuda_foreach" for foreach unset or True (torch's default on CUDA),
"torch2_cuda_fused" for fused=True; the sqrt is the GPU's ("exact"). Under torch 1.13 CUDA
parameters are refused unless a group names its update (1.13's CUDA kernels are not carried). A
group may name update and sqrt_mode itself. With max_grad_norm, the step clips by the running torch's fp32 total norm
(clip_grad_norm_ over the parameters in the optimizer's order, each of which has a gradient)
bit for bit under torch 1.13.x (Debian's build), 2.6.x and 2.15.x (PyPI's), on CPU at world
size 1 with f32 gradients and no loss scaler; other releases, CUDA, world size > 1, bf16/f16
gradients and loss scaling clip by zerod's double norm (a coefficient within a few ULP).
A pickled ZeroOptimizer (e.g. inside torch 1.13's scheduler state_dict) becomes a
PickledZeroOptimizer placeholder; one never closed is closed at interpreter exit.

Lazy gather. With ``gather="lazy"`` and ``module=model`` (host parameters, zerod's CPU
backend) step() sends the step without its gather (ZD_STEP_NO_GATHER) and returns at the step's
commit; it then sends the gathers of every bucket at once, in ascending order (up to 32
outstanding, the rest as the waits free slots). A forward pre-hook on each submodule that owns
parameters of the optimizer (``parameters(recurse=False)``; the root module for parameters no
submodule owns) waits for the gathers of the buckets up to its own highest before the submodule
runs: with a zerod running ``overlap_update``, zerod writes each bucket's working parameters
while the trainer's next forward runs, instead of inside step(). The hooks are made once (again
after add_param_group) and removed by close(). What else reads the parameters waits first:
step(), add_param_group(), reattach(), checkpoint(), state_dict() and load_state_dict() of the
optimizer, close() (which does not register again), the first scatter of the next backward (a
bucket no forward read), and ``module.state_dict()`` (a state_dict hook on the module, in
torch 1.13 and 2.x alike). zero_grad() does not wait: it writes only the grad buffer, which the
gathers do not touch. Anything else that reads or writes the parameters between step() and the
next forward (an evaluation that calls submodules' functions directly, an EMA of the weights,
``p.data`` read by hand, parameters shared with a module outside `module`) must call
``wait_params()`` (alias ``synchronize()``) first; it returns at once when nothing is pending.
Errors of the gathers surface at the wait: ZD_ECLOSED, ZD_EPEER and ZD_EAPPLIED register the
model again as step() does ("A zerod's loss"): at the step every rank holds the registration has
written the parameters and the forward goes on; where the step was applied nowhere it is sent
again (with its gather) from the gradients still in the grad buffer, and when they changed since
step() (zero_grad, a new backward) ZerodError (ZD_ESTEP) says the step is lost. The bits are
those of gather="step" (tests/python/test_lazy.py, test_conformance.py --lazy).

Groups added during training. add_param_group() between steps registers the grown model with
zerod again on a new connection to the same local rank (ZD_REGISTER_GROW): zerod carries the
state it holds across the new layout, so the parameters it held keep theirs bit for bit and the
new group's start afresh, as torch's add_param_group does (host buffers and the CPU backend; at
world size > 1 every rank adds the same group at the same step, or each raises naming the first
difference and goes on with the model it had).

Limits: parameters must all be on one device (the CPU, or the rank's GPU) and of one dtype,
float32 or bfloat16. A parameter without a gradient
in a step (its .grad set to None, or not reached by backward since zero_grad(set_to_none=True),
torch 2.x's default) is skipped by zerod's CPU backend as torch skips it: no decay, no state
update, its own step count kept (at world size > 1 only where no rank has a gradient for it, as
DDP); with zero_grad(set_to_none=False) it has a zero gradient, as in torch. Parameters with
requires_grad=False are kept in param_groups but not registered, and never change. A model
moved after the optimizer was built by a move that copies (``Module.to()`` onto
``torch.device("cpu", 0)`` copies every CPU tensor, as Accelerate's multi-process CPU runs do)
leaves zerod's buffers: step() then raises, and ``reattach()`` puts it back.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import torch

from . import _lib
from . import offload as _offload
from .client import ANY_RANK, Client, Group, Info, LossScaler, Request, StepResult, ZerodError

__all__ = ["PickledZeroOptimizer", "ZeroAdagrad", "ZeroOptimizer", "ZeroRMSprop", "ZeroSGD"]

# Options of torch.optim.AdamW/Adam, at the value that means "off". One that is also a field of
# zerod's groups (Group.names(): maximize) is passed to zerod like lr; the others are refused when
# turned on, since zerod cannot honour them. foreach and fused (torch's implementation choice) pick
# the formula zerod follows instead (_choose_formula).
_TORCH_OPTIONS = {"amsgrad": False, "maximize": False, "capturable": False,
                  "differentiable": False}
_IMPL_OPTIONS = ("foreach", "fused")
_MAX_INFLIGHT = 48  # below libzerod's 64 outstanding requests per client
_MAX_GATHERS = 32  # gather="lazy": gathers outstanding at once (scatters wait for them all)
_MAX_REJOINS = 3  # zerods lost within one step() before it raises (each rejoin is bounded too)

# Optimizers not closed yet. torch 2.15 (not 2.6) aborts the interpreter (c10::Error "use_count() == 1"
# in python_variable.cpp) when the reference cycle through the gradient hooks is collected during
# its shutdown with the parameters still views of zerod's buffers; closing them before shutdown
# begins (atexit handlers run first) breaks the cycle while torch is whole.
_open_optimizers: "weakref.WeakSet[ZeroOptimizer]" = weakref.WeakSet()


@atexit.register
def _close_open_optimizers() -> None:
    for opt in list(_open_optimizers):
        with contextlib.suppress(Exception):
            opt.close()


def _torch_major() -> int:
    return int(torch.__version__.split(".")[0])


# The torch builds whose clip_grad_norm_ fp32 total zerod reproduces (zd_clip_norm_t), by release.
_CLIP_NORM_BY_RELEASE = {(1, 13): "torch113", (2, 6): "torch26", (2, 15): "torch215"}


def _clip_norm_for_torch() -> str:
    """The clip norm order of the running torch, or "double" (zerod's) for another release."""
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return _CLIP_NORM_BY_RELEASE.get(release, "double")


_sqrt_probe: Optional[Tuple[str, str]] = None


def _probe_sqrt() -> Tuple[str, str]:
    """Which of zerod's sqrt modes torch.sqrt on CPU float32 tensors matches on this machine:
    ("exact" | "mkl_ex", "") when one matches every probe, else ("exact", what was measured).

    Measured, not assumed: PyPI's wheels compute Tensor.sqrt with MKL, whose kernel (and its
    rounding) depends on the CPU's vendor and model (docs/torch2/README.md); builds without MKL
    round correctly. The probes are 65,536 normal floats spread over the whole exponent range
    plus the inputs MKL handles apart (zeros, subnormals, the largest floats); zerod's own sqrt
    of each mode comes from libzerod (zd_sqrt), computed on this CPU as zerod computes it."""
    global _sqrt_probe
    if _sqrt_probe is not None:
        return _sqrt_probe
    bits = torch.arange(0x00800000, 0x7f7ff000, (0x7f7ff000 - 0x00800000) // 65536 + 1,
                        dtype=torch.int64)
    extra = torch.tensor([0, 1, 0x007fffff, 0x7f7ff000, 0x7f7ff001, 0x7f7fffff], dtype=torch.int64)
    x = torch.cat([bits, extra]).to(torch.int32).view(torch.float32).contiguous()
    want = torch.sqrt(x).view(torch.int32)
    lib = _lib.load()
    counts = {}
    for name, mode in (("exact", _lib.ZD_SQRT_EXACT), ("mkl_ex", _lib.ZD_SQRT_MKL_EX)):
        y = torch.empty_like(x)
        if lib.zd_sqrt(mode, x.data_ptr(), y.data_ptr(), x.numel()) != 0:
            raise RuntimeError(f"libzerod's zd_sqrt refused sqrt mode {name}")
        counts[name] = int((y.view(torch.int32) != want).sum())
        if counts[name] == 0:
            _sqrt_probe = (name, "")
            return _sqrt_probe
    _sqrt_probe = ("exact", f"torch.sqrt matches none of zerod's sqrt modes on this CPU: of "
                            f"{x.numel()} probes it differs from the correctly rounded sqrt in "
                            f"{counts['exact']} and from MKL's SSE4.2 kernel as zerod reproduces "
                            f"it in {counts['mkl_ex']} (1 ULP each, e.g. MKL's AVX2/AVX-512 "
                            f"kernels on an Intel CPU); zerod uses the exact sqrt, so about "
                            f"{100.0 * counts['exact'] / x.numel():.2g}% of torch's square "
                            f"roots differ from zerod's by 1 ULP and updates are not "
                            f"bit-identical to torch's (set MKL_CBWR=COMPATIBLE before torch "
                            f"starts, which makes MKL run its SSE4.2 kernel on any x86 CPU, or "
                            f"use fused=True)")
    return _sqrt_probe


def _choose_formula(g: Mapping[str, Any], cuda: bool, where: str) -> Tuple[str, str]:
    """The (update, sqrt_mode) of zerod's groups that reproduces what the running torch's
    AdamW/Adam would compute for group g, given its foreach/fused choice; ValueError for a choice
    zerod cannot reproduce.

    On CPU (measured, docs/torch2/README.md): torch 1.13 updates the first moment with a
    multiply-add, torch 2.x with lerp; foreach=True gives the same bits as the default on both
    (it batches the same per-element kernels); fused=True (torch >= 2.x) has a correctly rounded
    sqrt where the default takes torch.sqrt's, which the probe decides.

    On CUDA (torch 2.x, read from its CUDA kernels: kernels/adam.h) the three implementations
    round differently from each other and from the CPU path, and zerod carries each:
    foreach=False is the single-tensor path ("torch2_cuda"); foreach=None or True its foreach
    path ("torch2_cuda_foreach": torch's default for CUDA tensors); fused=True its fused kernel
    ("torch2_cuda_fused"); the sqrt is the GPU's, correctly rounded. torch 1.13's CUDA kernels
    round like 2.x's but update the first moment with a multiply-add, which zerod does not carry:
    a group left to choose its formula is refused there (a group that names update itself is
    not)."""
    foreach, fused = g.get("foreach"), g.get("fused")
    if foreach and fused:
        raise ValueError(f"{where}: foreach=True and fused=True together (torch refuses them "
                         f"too); set one")
    if cuda:
        if _torch_major() < 2:
            if g.get("update") is None:
                raise ValueError(
                    f"{where}: CUDA parameters need torch >= 2.0 (running {torch.__version__}): "
                    f"torch 1.13's CUDA AdamW/Adam rounds differently from its CPU formula "
                    f"('torch113': addcmul_ rounds g*g first, the single-tensor path divides by "
                    f"a reciprocal, addcdiv_ fuses its multiply-add) and zerod carries only "
                    f"torch 2.x's CUDA formulas; name update='torch113' in the group to train "
                    f"with the CPU formula, not bit-identical to torch 1.13 on CUDA")
            return "torch113", "exact"
        if fused:
            return "torch2_cuda_fused", "exact"
        if foreach is False:
            return "torch2_cuda", "exact"
        return "torch2_cuda_foreach", "exact"
    update = "torch2" if _torch_major() >= 2 else "torch113"
    if fused:
        if update == "torch113":
            raise ValueError(f"{where}: fused=True needs torch >= 2.0 (running "
                             f"{torch.__version__})")
        return update, "exact"
    return update, _probe_sqrt()[0]


def _launcher_rank() -> Tuple[int, Dict[str, int]]:
    """The local rank a launcher (torchrun, torch.distributed.launch --use_env, Accelerate,
    Lightning, Slurm wrappers that export torch's variables) gives this process through
    LOCAL_RANK, and the RANK and WORLD_SIZE it set, to check against zerod's world; ANY_RANK
    and {} when LOCAL_RANK is not set."""
    found: Dict[str, int] = {}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        text = os.environ.get(key, "").strip()
        if not text:
            continue
        try:
            found[key] = int(text)
        except ValueError:
            raise ValueError(f"{key} is {text!r} in the environment; expected an integer "
                             f"(as torchrun sets it)") from None
    if "LOCAL_RANK" not in found:
        return ANY_RANK, {}
    if found["LOCAL_RANK"] < 0:
        raise ValueError(f"LOCAL_RANK is {found['LOCAL_RANK']} in the environment; expected "
                         f"0 or more")
    return found.pop("LOCAL_RANK"), found


def _check_launcher_world(client: Client, local_rank: int, expect: Mapping[str, int],
                          where: Optional[str]) -> None:
    """ValueError when the RANK/WORLD_SIZE the launcher set disagree with the world zerod
    gives local rank `local_rank` (its hello: global rank = first_rank + local rank)."""
    info = client.info
    got = {"RANK": info.rank, "WORLD_SIZE": info.world_size}
    wrong = [k for k in ("RANK", "WORLD_SIZE") if k in expect and expect[k] != got[k]]
    if not wrong:
        return
    said = ", ".join(f"{k}={expect[k]}" for k in ("RANK", "WORLD_SIZE") if k in expect)
    raise ValueError(
        f"the launcher's environment (LOCAL_RANK={local_rank}, {said}) disagrees with zerod"
        f"{' at ' + where if where else ''}: its local rank {info.local_rank} is global rank "
        f"{info.rank} of a world of {info.world_size} (first_rank {info.rank - info.local_rank}"
        f" + local rank {info.local_rank}; world_size {info.world_size}); "
        + "; ".join(f"{k} is {expect[k]} here, {got[k]} in zerod" for k in wrong)
        + ". Start zerod with --world_size and --first_rank matching the launcher (first_rank "
          "= this node's RANK - LOCAL_RANK), or pass local_rank= explicitly (which skips this "
          "check)")


def _split_named(items: Iterable[Any]) -> Tuple[List[torch.Tensor], List[Optional[str]]]:
    tensors, names = [], []
    for it in items:
        if isinstance(it, tuple) and len(it) == 2 and isinstance(it[0], str):
            names.append(it[0])
            tensors.append(it[1])
        else:
            names.append(None)
            tensors.append(it)
    return tensors, names


class ZeroOptimizer(torch.optim.Optimizer):
    """AdamW/Adam through zerod, as a torch.optim.Optimizer (see the module docstring).

    Args:
        params: parameters or parameter groups, as for torch.optim.AdamW. (name, parameter)
            pairs (``model.named_parameters()``) are accepted too and name the parameters in
            zerod's layout and error messages; otherwise they are named "param<i>".
        lr, betas, eps, weight_decay: defaults of the groups, as torch.optim.AdamW.
        optimizer: "adamw" (decoupled weight decay) or "adam" (L2); a group may override it with
            an "optimizer" key.
        **hparams: defaults of the groups' other hyperparameters, by torch's names: every field
            of zerod's groups (zerod.Group.names(), e.g. maximize=True) is accepted, here or as a
            key of a parameter group, and passed to zerod (amsgrad too: zerod keeps
            max_exp_avg_sq for a model whose groups have it at construction). torch's capturable
            and differentiable are accepted only at their default (off). foreach and fused (torch's
            implementation) are accepted and choose, with the running torch's version, the
            formula zerod follows (groups' update and sqrt_mode; module docstring "Which
            torch"); a choice zerod cannot reproduce is refused.
        max_grad_norm: clip the gradient by its global L2 norm over all ranks (0: off); zerod
            applies it inside the step, as torch.nn.utils.clip_grad_norm_ would: bit for bit
            under torch 1.13, 2.6 and 2.15 on CPU at world size 1 with f32 gradients and no loss
            scaler (module docstring "Which torch"), within a few ULP of its coefficient
            elsewhere.
        loss_scaler: dynamic loss scaling (zerod.LossScaler, a dict of its fields, True for the
            defaults, None: off). Multiply the loss by ``opt.loss_scale`` (``opt.scale_loss()``)
            before backward; zerod unscales, skips steps that overflow and adapts the scale.
        grad_mean: average gradients over the ranks (True) or sum them.
        grad_dtype: dtype of the grad buffer (torch.float32, torch.bfloat16, torch.float16);
            default the parameters' dtype. Different from the parameters' dtype it switches to
            ``param.main_grad`` accumulation (module docstring).
        overlap: scatter each bucket from the backward hooks as soon as its gradients are final
            (default). False: the whole scatter is part of step().
        socket, local_rank, timeout_ms: where to attach (zerod.Client); ignored with `client`.
            With no local_rank, LOCAL_RANK from the environment (torchrun and the launchers
            that follow it set it) names the rank when set, and RANK and WORLD_SIZE, when set,
            must agree with zerod's world: global rank = zerod's first_rank + LOCAL_RANK, world
            size = its world_size (ValueError naming both otherwise). Without LOCAL_RANK: the
            first local rank no other client holds.
        client: an already connected zerod.Client with no model laid out (the optimizer then
            does not close it).
        replace: start afresh: discard any state zerod holds on this rank (for this model or
            another; at world size > 1 every rank must pass it). Without it, zerod resumes the
            state it holds for the same model, and refuses a different one.
        abort_retries: how many times step() retries a step that another rank's trainer
            abandoned by dying in it (ZD_EABORTED, module docstring); 0 raises at once.
        offload: a model on a GPU and a zerod running its CPU backend (zerod.offload): None
            (the default) offloads by itself in that case, True insists on it, False refuses
            it. "rehearsal": a test switch that runs the offload machinery with a model on the
            CPU (plain copies, no streams).
        gather: when the updated parameters are gathered into the model. "step" (the default):
            inside step(), which returns with every parameter updated. "lazy" (host
            parameters only; `module` required): step() returns at the step's commit, sent
            without its gather, and the gathers of every bucket are sent at once; a forward
            pre-hook on each submodule of `module` that owns parameters of a bucket waits for
            that bucket's gather before the submodule runs, so that zerod's write of the
            working parameters runs beside the next forward instead of inside step()
            (module docstring "Lazy gather"). Code that reads parameters outside the
            module's forward between step() and the next forward must call
            ``wait_params()`` first (``module.state_dict()`` waits by itself).
        module: the model whose submodules get the forward pre-hooks of gather="lazy" (the
            module holding the optimizer's parameters); ignored otherwise.

    Raises:
        zerod.ZerodError: from the daemon (no daemon, rank busy, layout mismatch, bad
            hyperparameter, ...), with its message.
        ValueError/TypeError: unsupported parameters or options; a launcher's RANK or
            WORLD_SIZE that disagree with zerod's world.
    """

    # Fields of zerod's groups that only other optimizers read (zerod.optim): refused as
    # keywords, as torch.optim.AdamW refuses them.
    _FOREIGN = frozenset({"momentum", "dampening", "nesterov", "lr_decay",
                          "initial_accumulator_value", "alpha", "centered"})

    #: How long step() waits, after a zerod was lost, for the model's registration again
    #: (zd_rejoin: the zerod's restart and the world's re-forming); 0: step() raises at once.
    rejoin_timeout_s: float = 120.0

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, optimizer: str = "adamw",
                 max_grad_norm: float = 0.0,
                 loss_scaler: Union[LossScaler, Mapping[str, Any], bool, None] = None,
                 grad_mean: bool = True, grad_dtype: Optional[torch.dtype] = None,
                 overlap: bool = True, socket: Optional[str] = None,
                 local_rank: int = ANY_RANK, timeout_ms: int = 0,
                 client: Optional[Client] = None, replace: bool = False,
                 abort_retries: int = 3, offload: Any = None, gather: str = "step",
                 module: Optional[torch.nn.Module] = None, **hparams: Any) -> None:
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors or dicts, not a tensor")
        defaults = Group().to_dict()  # every field of zerod's groups, as torch names it
        defaults.update(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        optimizer=optimizer)
        # The formula follows the running torch unless a group names one (_choose_formula).
        defaults.update(update=None, sqrt_mode=None, foreach=None, fused=None)
        for key, value in hparams.items():
            if (key not in defaults and key not in _TORCH_OPTIONS) or key in self._FOREIGN:
                raise TypeError(f"ZeroOptimizer got an unexpected keyword argument {key!r}")
            defaults[key] = value
        self._check_hparams(defaults, "defaults")

        # torch's Optimizer takes tensors; pull names out of (name, tensor) pairs first.
        groups_in = list(params)
        if not groups_in:
            raise ValueError("optimizer got an empty parameter list")
        names: List[Optional[str]] = []
        if isinstance(groups_in[0], dict):
            plain_groups = []
            for g in groups_in:
                g = dict(g)
                ps = g["params"]
                ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
                g["params"], n = _split_named(ps)
                names.extend(n)
                plain_groups.append(g)
        else:
            tensors, names = _split_named(groups_in)
            plain_groups = [{"params": tensors}]

        self._constructing = True
        super().__init__(plain_groups, defaults)
        self._constructing = False
        for i, g in enumerate(self.param_groups):
            self._check_hparams(g, f"param group {i}")
        self._cuda = any(p.device.type == "cuda" for g in self.param_groups for p in g["params"])
        # Offload (a GPU model on a CPU zerod) follows the CPU formula; whether it applies is
        # known once zerod says its backend, when offload is left automatic.
        self._offload: Optional[_offload.Offload] = None
        _offload.check_arg(offload, self._cuda)
        if not (self._cuda and offload is None):
            self._choose_formulas(self._cuda and not offload)

        # Which parameters zerod owns: every one that requires grad, in group order.
        self._params: List[torch.Tensor] = []
        specs = []
        index = 0
        seen_names = set()
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                name = names[index] if index < len(names) and names[index] else f"param{index}"
                index += 1
                if not p.requires_grad:
                    continue
                if name in seen_names:
                    raise ValueError(f"two parameters are named {name!r}")
                seen_names.add(name)
                self._validate_param(p, name)
                self._params.append(p)
                specs.append((name, tuple(p.shape), gi))
        if not self._params:
            raise ValueError("no parameter requires grad: nothing for zerod to optimize")
        devices = {p.device for p in self._params}
        if len(devices) != 1:
            raise ValueError(f"parameters are on several devices ({sorted(map(str, devices))}); "
                             f"zerod's buffers are on one: move the model to one device first")
        self.device: torch.device = devices.pop()
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters have several dtypes ({sorted(map(str, dtypes))}); "
                             f"zerod keeps one working dtype per model: cast the model first")
        self.param_dtype: torch.dtype = dtypes.pop()
        self.grad_dtype: torch.dtype = grad_dtype if grad_dtype is not None else self.param_dtype
        self._grad_views = self.grad_dtype == self.param_dtype  # False: main_grad mode
        self._overlap = overlap
        if abort_retries < 0:
            raise ValueError(f"abort_retries is {abort_retries}; expected 0 or more")
        self._abort_retries = int(abort_retries)
        self._names = [s[0] for s in specs]
        self._clip_norm = _clip_norm_for_torch() if max_grad_norm > 0 else "double"
        if gather not in ("step", "lazy"):
            raise ValueError(f"gather is {gather!r}; expected 'step' or 'lazy'")
        self._lazy = gather == "lazy"
        self._lazy_module: Optional[torch.nn.Module] = None
        if self._lazy:
            if not isinstance(module, torch.nn.Module):
                raise ValueError("gather='lazy' needs module=<the model>: its forward pre-hooks "
                                 "wait for each bucket's gather before the submodules that read "
                                 "it run")
            if self._cuda or offload:
                raise ValueError("gather='lazy' is for parameters in host memory on zerod's CPU "
                                 "backend (not CUDA parameters nor offload, whose gathers are "
                                 "copies to the device after step())")
            self._lazy_module = module
        self._lazy_handles: List[Any] = []
        self._lazy_gathers: List[Tuple[int, Request]] = []  # sent, not waited for: ascending
        self._lazy_next = 0  # the next bucket whose gather is to be sent
        self._lazy_done = 0  # buckets below it are gathered
        self._lazy_owed = False  # a step returned without its gather, which is not done yet
        self._lazy_step: Dict[str, Any] = {}  # what resending that step needs (_gather_failed)

        self._owns_client = client is None
        # What a registration of the grown model needs again (add_param_group, _grow).
        self._register_kw = {"max_grad_norm": max_grad_norm, "grad_mean": grad_mean,
                             "loss_scaler": loss_scaler, "offload": offload,
                             "timeout_ms": timeout_ms, "socket": socket}
        self._bind(specs, client, socket, local_rank, timeout_ms, offload, max_grad_norm,
                   grad_mean, loss_scaler, replace)

    def _bind(self, specs: List[Tuple[str, Tuple[int, ...], int]], client: Optional[Client],
              socket: Optional[str], local_rank: int, timeout_ms: int, offload: Any,
              max_grad_norm: float, grad_mean: bool, loss_scaler: Any, replace: bool,
              grow: bool = False) -> None:
        """Registers self._params (specs: their names, shapes and groups) with zerod on `client`
        (None: a new one) and makes them views of its buffers, with the hooks: the end of
        construction, and of add_param_group (grow: the model extends the one zerod holds)."""
        launcher: Dict[str, int] = {}
        if client is None and local_rank == ANY_RANK:
            local_rank, launcher = _launcher_rank()
        self.client: Client = client if client is not None else Client(socket, local_rank,
                                                                       timeout_ms)
        try:
            if launcher:
                _check_launcher_world(self.client, local_rank, launcher, socket)
            mode = _offload.decide(offload, self._cuda, self.client.info.backend)
            if self._cuda and offload is None:
                self._choose_formulas(mode is None)
            if mode is not None:  # the buffers are host memory: self._cuda means device buffers
                self._offload = _offload.Offload(self, mode)
                self._cuda = False
                self._offload.announce()
            if self._cuda:
                self._check_rank_gpu()
            self.client.layout(specs, [Group.coerce(g) for g in self.param_groups],
                               param_dtype=self.param_dtype, grad_dtype=self.grad_dtype,
                               max_grad_norm=max_grad_norm, grad_mean=grad_mean,
                               loss_scaler=loss_scaler, replace=replace,
                               **({"grow": True} if grow else {}),
                               memory="cuda" if self._cuda else (
                                   self._offload.memory if self._offload else "host"),
                               device=self.device.index if self._cuda else (
                                   self._offload.device_index if self._offload else None))
            self._pflat = self._flat_buffer("param", self.param_dtype)
            self._gflat = self._flat_buffer("grad", self.grad_dtype)
            self._pinfo = self.client.params_info()
            pviews, gviews = [], []
            for p, pi in zip(self._params, self._pinfo):
                pv = self._pflat[pi.offset:pi.offset + pi.numel].view(p.shape)
                gv = self._gflat[pi.offset:pi.offset + pi.numel].view(p.shape)
                pv.copy_(p.detach())
                pviews.append(pv)
                gviews.append(gv)
            if self._cuda:  # zerod reads the copies above after they ran on this stream
                self.client.set_stream(self._stream()["stream"])
            self.info = self.client.register()
        except BaseException:
            if self._cuda:  # the copies into the device buffers are done before they are freed
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(self.device)
            if self._owns_client:
                self.client.close()
            raise
        self.resumed: bool = self.info.resumed
        self.loss_scale: float = self.info.loss_scale
        self.last_result: Optional[StepResult] = None

        # The model now reads and writes zerod's buffers (offload: copies of them).
        self._gviews = gviews
        for p, pv, gv in zip(self._params, pviews, gviews) if self._offload is None else ():
            p.data = pv
            if self._grad_views:
                if p.grad is not None:
                    gv.copy_(p.grad)
                p.grad = gv
            else:
                if p.grad is not None:
                    gv.copy_(p.grad)
                    p.grad = None
                p.main_grad = gv

        # _check_attached: where each parameter's data must stay (offload: the model's own)
        self._pviews_ptr = [(p if self._offload is not None else pv).data_ptr()
                            for p, pv in zip(self._params, pviews)]

        # Buckets and hooks.
        self._nbuckets = self.info.nbuckets
        self._bucket_params: List[List[int]] = [[] for _ in range(self._nbuckets)]
        for i, pi in enumerate(self._pinfo):
            self._bucket_params[pi.bucket].append(i)
        self._bucket_size = [len(ps) for ps in self._bucket_params]
        self._bucket_left = list(self._bucket_size)
        self._param_ready = [False] * len(self._params)
        # Whether each parameter has a gradient (torch's `p.grad is not None`): cleared by
        # zero_grad(set_to_none=True), set by its backward hook (_absent_params).
        self._has_grad = [True] * len(self._params)
        self._scattered = [False] * self._nbuckets
        self._next_bucket = self._nbuckets - 1  # scatters go out in descending bucket order
        self._hparams_told = False  # this iteration's first scatter went out (_start_scatter)
        self._hook_version = self._gflat._version  # the grad buffer's, as the last hook saw it
        self._warned_changed = False
        self._inflight: List[Request] = []
        self._lost: Optional[ZerodError] = None  # _start_scatter: zerod lost during backward
        self._sync = True
        # False while a DistributedDataParallel model that zerod.ddp.register() joined to this
        # optimizer runs a forward under its no_sync(): the backward that follows only
        # accumulates, as DDP's does.
        self._ddp_sync = True
        self._warned_rescatter = False
        self._grad_accs = []
        self._hook_handles = []
        with torch.enable_grad():
            for i, p in enumerate(self._params):
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self._hook_handles.append(acc.register_hook(self._make_hook(i)))
                self._grad_accs.append(acc)  # the node lives only while someone holds it
        if self._lazy_module is not None:
            self._hook_module(self._lazy_module)
        self._sent_hparams = self._current_hparams()
        if self._offload is not None:
            self._offload.attach(pviews, gviews)
        self._built_as = id(self)  # __del__
        self._closed = False
        _open_optimizers.add(self)

    # ---- formula -------------------------------------------------------------------------------

    def _choose_formulas(self, cuda: bool) -> None:
        """Fills each group's update and sqrt_mode left unset (None) with what reproduces the
        running torch (_choose_formula) for CUDA parameters stepped on the GPU (cuda) or for
        parameters stepped on the CPU, and says once what foreach=True does on CPU."""
        told = set()
        for i, g in enumerate(self.param_groups):
            update, sqrt_mode = _choose_formula(g, cuda, f"param group {i}")
            if g.get("update") is None:
                g["update"] = update
            if g.get("sqrt_mode") is None:
                g["sqrt_mode"] = sqrt_mode
                note = _probe_sqrt()[1] if not cuda and not g.get("fused") else ""
                if note and "sqrt" not in told:
                    told.add("sqrt")
                    warnings.warn(note, stacklevel=3)
            if g.get("fused") and not cuda:
                self._check_fused_sizes(g, f"param group {i}")
            if g.get("foreach") and not cuda and "foreach" not in told:
                told.add("foreach")
                warnings.warn("foreach=True changes nothing here: on CPU torch's foreach "
                              "implementation computes the same bits as its default one (it "
                              "batches the same per-element kernels), and zerod reproduces "
                              "both", stacklevel=3)

    @staticmethod
    def _check_fused_sizes(g: Mapping[str, Any], where: str) -> None:
        """torch's fused CPU kernel computes a tensor smaller than one of its vectors with a scalar
        formula of its own (measured on 2.6 and 2.15: 7- and 15-element tensors up to 32 ULP
        apart after 20 steps with betas (0.5, 0.999), equal elsewhere), which zerod does not
        reproduce: such a parameter in a fused group is refused."""
        try:
            capability = torch.backends.cpu.get_cpu_capability()
        except AttributeError:
            capability = "AVX512"
        width = 16 if capability.startswith("AVX512") else 8
        for p in g["params"]:
            if p.requires_grad and p.numel() < width:
                raise ValueError(f"{where}: fused=True with a parameter of {p.numel()} elements "
                                 f"(shape {tuple(p.shape)}): torch's fused CPU kernel computes "
                                 f"tensors of fewer than {width} elements ({capability} build) "
                                 f"with a scalar formula zerod does not reproduce; leave fused "
                                 f"unset (torch's default implementation, which zerod "
                                 f"reproduces), or put such parameters in a group without it")

    # ---- validation ----------------------------------------------------------------------------

    @staticmethod
    def _check_hparams(g: Mapping[str, Any], where: str) -> None:
        # torch.optim.AdamW's own checks, which torch users expect at construction; zerod checks
        # every field again with its table's rules (ZD_EHPARAM).
        lr, eps, wd, betas = g["lr"], g["eps"], g["weight_decay"], tuple(g["betas"])
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            raise ValueError(f"{where}: invalid learning rate {lr!r}; expected a finite value >= 0")
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"{where}: invalid eps {eps!r}; expected a finite value > 0")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{where}: invalid betas {betas!r}; expected two values in [0, 1)")
        if not (math.isfinite(wd) and wd >= 0):
            raise ValueError(f"{where}: invalid weight_decay {wd!r}; expected a finite value >= 0")
        supported = Group.names()
        for key, off in _TORCH_OPTIONS.items():
            if key not in supported and g.get(key, off) not in (off, None):
                raise ValueError(f"{where}: {key}={g[key]!r} is not supported by zerod")
        for key in _IMPL_OPTIONS:
            if g.get(key) not in (None, True, False):
                raise ValueError(f"{where}: {key} is {g[key]!r}; expected True, False or None")
        try:
            # every field of zerod's groups it holds must convert; None: chosen later
            Group.coerce({k: v for k, v in g.items() if v is not None})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    @staticmethod
    def _validate_param(p: torch.Tensor, name: str) -> None:
        if not isinstance(p, torch.Tensor) or not p.is_leaf:
            raise ValueError(f"{name}: can only optimize leaf tensors")
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on {p.device}; zerod's buffers are host memory (CPU "
                             f"tensors) or CUDA device memory (CUDA tensors)")
        if p.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{name} has dtype {p.dtype}; zerod's working params are float32 "
                             f"or bfloat16")
        if p.is_sparse:
            raise ValueError(f"{name} is sparse; zerod needs dense parameters")

    # ---- buffers ------------------------------------------------------------------------------

    def _check_rank_gpu(self) -> None:
        """CUDA parameters must be on the GPU zerod gives this rank (its buffers are there)."""
        rank_gpu = self.client.cuda_device()
        if rank_gpu != self.device.index:
            raise ValueError(f"the model is on {self.device}, but zerod's rank "
                             f"{self.client.info.local_rank} (local) is on cuda:{rank_gpu} as "
                             f"this process numbers its GPUs; move the model to cuda:{rank_gpu}")

    def _flat_buffer(self, which: str, dtype: torch.dtype) -> torch.Tensor:
        """The whole param or grad buffer as one flat tensor, without a copy."""
        n = self.client.info.total_elems
        if not self._cuda:
            arr = self.client.param_array() if which == "param" else self.client.grad_array()
            return torch.frombuffer(arr, dtype=dtype, count=n)
        arr = (self.client.param_device_array() if which == "param"
               else self.client.grad_device_array())
        try:
            t = torch.as_tensor(arr, device=self.device)  # keeps arr, which keeps the client
        except RuntimeError as e:
            if "numpy" not in str(e).lower():
                raise
            # torch parses __cuda_array_interface__'s typestr with NumPy, which torch 2's
            # wheels do not install.
            raise RuntimeError(f"zerod's CUDA buffers need NumPy: torch.as_tensor reads "
                               f"__cuda_array_interface__ through it ({e}); pip install "
                               f"numpy") from e
        if t.data_ptr() != arr.address:  # a copy (device mismatch) would detach the model
            raise RuntimeError(f"torch.as_tensor copied zerod's {which} buffer (at "
                               f"0x{arr.address:x}) instead of wrapping it, on {t.device}")
        return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t

    def _stream(self) -> Dict[str, int]:
        """Device buffers: the keyword that hands torch's current stream to a request, which
        libzerod orders after the work queued on it so far (asked from the thread about to send
        it). backward's hooks run on autograd's device thread with the stream of the
        parameter's AccumulateGrad node current, the stream on which autograd added the
        gradient into the buffer (after making it wait for the stream that produced it): the
        one current when this optimizer was built, since it keeps those nodes alive. Host
        buffers: no keyword."""
        return {"stream": torch.cuda.current_stream(self.device).cuda_stream} if self._cuda else {}

    def _leave_buffers(self) -> Tuple[List[torch.Tensor], List[bool]]:
        """Detaches the model from this connection's buffers before a new layout is registered
        (a grown model, a resized world): each parameter gets a private copy of its values, the
        gradients are returned as copies with which parameters had one, the hooks are removed
        and the connection is closed."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles, self._grad_accs = [], []
        has_grad = list(self._has_grad)
        with torch.no_grad():
            grads = [gv.clone() for gv in self._gviews]
            for p in self._params:
                p.data = p.data.clone()
                if self._grad_views:
                    p.grad = None
                else:
                    del p.main_grad
        self._pflat = self._gflat = None  # type: ignore[assignment]
        self._gviews = []
        _open_optimizers.discard(self)
        self._closed = True
        self.client.close()
        return grads, has_grad

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Adds a parameter group, as torch's does: during construction, and after it between
        steps (progressive unfreezing: Lightning's BaseFinetuning, fastai's gradual unfreezing).
        After construction the grown model is registered with zerod again (ZD_REGISTER_GROW), on
        a new connection to the same local rank: the parameters it held keep their state bit
        for bit (master weights, moments, their own step counts) and the model its step and
        loss scale; the new group's parameters start afresh, their own step count 0, as torch
        starts a parameter's state at its first step. (name, parameter) pairs name the new
        parameters; otherwise they are "param<i>", i counting every parameter of the groups
        before. The group's missing options take the optimizer's defaults (each subclass its
        own). At world size > 1 every rank adds the same group at the same step, or every
        rank's add_param_group raises naming the first difference. zerod's CPU backend, host
        buffers (not CUDA parameters, not offload), and an optimizer that opened its own
        connection (no `client` passed)."""
        if getattr(self, "_constructing", False):
            super().add_param_group(param_group)
            return
        self._grow(param_group)

    def _grow(self, param_group: Dict[str, Any]) -> None:
        """add_param_group after construction (its docstring)."""
        self._check_open()
        self.wait_params()
        if self._offload is not None or self._cuda:
            raise RuntimeError("add_param_group after construction needs host buffers and "
                               "zerod's CPU backend (not CUDA parameters nor offload): pass "
                               "every group to the constructor")
        if not self._owns_client:
            raise RuntimeError("add_param_group after construction registers the grown model on "
                               "a new connection, which an optimizer given a `client` does not "
                               "own: let the optimizer connect (socket=, local_rank=)")
        if self._inflight or any(self._scattered):
            raise RuntimeError("add_param_group between backward and step(): backward's hooks "
                               "have sent gradients of this iteration to zerod; add the group "
                               "after step() (or before backward)")
        if not isinstance(param_group, dict):
            raise TypeError("param_group must be a dict")
        group = dict(param_group)
        ps = group["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        group["params"], names = _split_named(ps)
        first = sum(len(g["params"]) for g in self.param_groups)
        super().add_param_group(group)  # torch's checks and defaults
        gi = len(self.param_groups) - 1
        g = self.param_groups[gi]
        try:
            self._check_hparams(g, f"param group {gi}")
            self._choose_formulas(False)  # fills the new group's (the others have theirs)
            added = []
            for k, p in enumerate(g["params"]):
                name = names[k] or f"param{first + k}"
                if not p.requires_grad:
                    continue
                if name in self._names or name in (n for _, n in added):
                    raise ValueError(f"two parameters are named {name!r}")
                self._validate_param(p, name)
                if p.device != self.device or p.dtype != self.param_dtype:
                    raise ValueError(f"{name} is {p.dtype} on {p.device}; the model's "
                                     f"parameters are {self.param_dtype} on {self.device}")
                added.append((p, name))
        except BaseException:
            self.param_groups.pop()
            raise
        specs = [(n, tuple(p.shape), pi.group) for p, n, pi in
                 zip(self._params, self._names, self._pinfo)]
        specs += [(n, tuple(p.shape), gi) for p, n in added]
        kw = self._register_kw
        local_rank = self.client.info.local_rank
        self._wait_inflight()
        # Off the old buffers, as close() leaves the model: private copies of the values (and
        # gradients), which the new buffers take.
        grads, has_grad = self._leave_buffers()
        held = len(self._params)
        self._params += [p for p, _ in added]
        self._names += [n for _, n in added]
        new_grads = [p.grad for p, _ in added]
        try:
            self._bind(specs, None, kw["socket"], local_rank, kw["timeout_ms"], kw["offload"],
                       kw["max_grad_norm"], kw["grad_mean"], kw["loss_scaler"], False, grow=True)
        except BaseException:
            # zerod refused (on every rank at world size > 1) and still holds the model as it
            # was: the optimizer goes back to it, as it was, and the error is raised.
            self.param_groups.pop()
            del self._params[held:]
            del self._names[held:]
            self._bind(specs[:held], None, kw["socket"], local_rank, kw["timeout_ms"],
                       kw["offload"], kw["max_grad_norm"], kw["grad_mean"], kw["loss_scaler"],
                       False)
            added, new_grads = [], []
            raise
        finally:
            # The gradients as they were (a new parameter's: None unless it had one).
            with torch.no_grad():
                for gv, g in zip(self._gviews, grads):
                    gv.copy_(g)
            self._has_grad = has_grad + [g is not None for g in new_grads]

    # ---- hooks ----------------------------------------------------------------------------------

    def _make_hook(self, i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self._on_grad_ready(i)
        return hook

    def _restore_view(self, i: int) -> None:
        """Puts .grad back to the buffer view, keeping whatever autograd stored elsewhere."""
        p, gv = self._params[i], self._gviews[i]
        g = p.grad
        if g is None:
            return
        if g.data_ptr() != gv.data_ptr():
            with torch.no_grad():
                gv.copy_(g)
            p.grad = gv

    def _on_grad_ready(self, i: int) -> None:
        p = self._params[i]
        self._has_grad[i] = True
        if self._offload is not None:
            pass  # the gradient stays the model's, on its device, until its bucket is copied
        elif self._grad_views:
            self._restore_view(i)
        else:
            g = p.grad
            if g is not None:
                with torch.no_grad():
                    self._gviews[i].add_(g)
                p.grad = None
        # Every write into the grad buffer by backward is followed by this hook: a version of the
        # buffer different at step() means the gradients were changed after backward (step()).
        self._hook_version = self._gflat._version
        if not (self._sync and self._ddp_sync and self._overlap) or self._closed:
            return
        b = self._pinfo[i].bucket
        if self._param_ready[i]:
            if not self._scattered[b]:
                return  # a second gradient before the bucket was complete: nothing was sent
            # A gradient for a bucket that was scattered already: gradients accumulated over
            # backward passes without no_sync(), or reentrant checkpointing. The bucket counts
            # down again and is scattered again when complete (or by step()): correct, at the
            # price of the traffic.
            if not self._warned_rescatter:
                self._warned_rescatter = True
                warnings.warn(
                    f"gradient of {self._names[i]} accumulated after its bucket was scattered: "
                    f"the bucket is scattered again. When accumulating over micro-batches, run "
                    f"every backward but the last inside `with optimizer.no_sync():`",
                    stacklevel=2)
            self._scattered[b] = False
            for j in self._bucket_params[b]:
                self._param_ready[j] = False
            self._bucket_left[b] = self._bucket_size[b]
            self._next_bucket = max(self._next_bucket, b)
        self._param_ready[i] = True
        self._bucket_left[b] -= 1
        self._scatter_ready_buckets()

    def _scatter_ready_buckets(self) -> None:
        # Collectives of different ranks are matched by their order, not by bucket: every rank
        # must send its scatters in the same order even when autograd completes buckets in
        # different orders on different ranks (data-dependent graphs, unused parameters). The
        # order is descending, the order in which backward completes buckets of a model
        # registered in forward order; a bucket completed early waits for those above it.
        while self._next_bucket >= 0 and self._bucket_left[self._next_bucket] == 0:
            if not self._scattered[self._next_bucket]:
                self._start_scatter(self._next_bucket)
            self._next_bucket -= 1

    def _start_scatter(self, bucket: int) -> None:
        if self._offload is not None:  # copied to the host buffer first, then sent
            self._offload.start_scatter(bucket)  # (its sender thread sends no next groups)
            self._scattered[bucket] = True
            return
        if self._lost is not None:  # nothing more goes out before step() registers again
            self._scattered[bucket] = True
            return
        if self._lazy_owed:  # a bucket no forward read: its gather goes first, on every rank
            self.wait_params()
        if not self._hparams_told:
            self._hparams_told = True
            self._tell_hparams()
        try:
            while len(self._inflight) >= _MAX_INFLIGHT:
                self._inflight.pop(0).wait(**self._stream())
            self._inflight.append(self.client.scatter_start(bucket, **self._stream()))
        except ZerodError as e:
            if not self._can_rejoin(e):
                raise
            self._lost = e  # backward goes on; step() registers again and sends the step
        self._scattered[bucket] = True

    def _tell_hparams(self) -> None:
        """The step's groups as they are now, before its backward (schedulers set them after the
        last step), with its first scatter when they differ from those zerod has: a zerod running
        overlap_update then updates the buckets as they arrive with them (zd_set_next_groups).
        step() still sends its own; a change after this costs a second update, never the bits."""
        hp = self._current_hparams()
        if hp != self._sent_hparams:
            try:
                self.client.set_next_groups(hp)
            except ZerodError:
                pass  # only the speculation goes without them; step() reports a bad group

    def _detached(self) -> List[int]:
        """Parameters whose .data is no longer their view of zerod's param buffer."""
        return [i for i, p in enumerate(self._params) if p.data_ptr() != self._pviews_ptr[i]]

    def _check_attached(self) -> None:
        """RuntimeError when something moved parameters off zerod's buffers (zerod's updates
        would no longer reach the model: a silent wrong result otherwise)."""
        gone = self._detached()
        if gone:
            raise RuntimeError(
                f"{len(gone)} parameter(s) of the ZeroOptimizer (first {self._names[gone[0]]!r}) "
                f"are no longer views of zerod's param buffer: something copied the model after "
                f"the optimizer was built (Module.to() copies CPU tensors moved to "
                f"torch.device('cpu', 0), as Accelerate does in multi-process CPU runs), so "
                f"zerod's updates would not reach it. Build the optimizer after moving the model "
                f"(after accelerator.prepare(model)), or call reattach() after the move")

    def reattach(self) -> int:
        """Puts parameters (and their gradients) that something moved off zerod's buffers back
        onto them, keeping their current values (copied in); returns how many were moved. For a
        model moved or copied after the optimizer was built (module docstring, Limits)."""
        self._check_open()
        self.wait_params()
        gone = self._detached()
        if gone and self._offload is not None:
            raise RuntimeError("reattach() does not apply to an offloading ZeroOptimizer: build "
                               "it after moving the model to its device")
        with torch.no_grad():
            for i in gone:
                # The move rebound the old view tensors themselves (``.grad.data = copy``): new
                # views of the buffers.
                p, pi = self._params[i], self._pinfo[i]
                pv = self._pflat[pi.offset:pi.offset + pi.numel].view(p.shape)
                gv = self._gflat[pi.offset:pi.offset + pi.numel].view(p.shape)
                pv.copy_(p.detach())
                p.data = pv
                grad = p.grad if self._grad_views else getattr(p, "main_grad", None)
                if grad is not None:
                    gv.copy_(grad)
                self._gviews[i] = gv
                if self._grad_views:
                    p.grad = gv
                else:
                    p.main_grad = gv
        self._hook_version = self._gflat._version
        return len(gone)

    def _accept_grad_writes(self) -> None:
        """Takes the grad buffer as it is now for what the hooks scattered: for a writer known to
        leave every value as it was (torch 1.x DistributedDataParallel's copy of its unreduced
        buckets back into the gradients, zerod.ddp), whose writes must not look like a change
        made between backward and step() (_rescatter_if_changed)."""
        if self._gflat is not None:
            self._hook_version = self._gflat._version

    def _reset_iteration(self) -> None:
        self._hparams_told = False
        self._hook_version = self._gflat._version if self._gflat is not None else 0
        self._bucket_left = list(self._bucket_size)
        self._param_ready = [False] * len(self._params)
        self._scattered = [False] * self._nbuckets
        self._next_bucket = self._nbuckets - 1
        if self._offload is not None:
            self._offload.reset()

    def _wait_inflight(self) -> None:
        first: Optional[BaseException] = None
        stream = self._stream()  # the stream that reads zerod's results next
        while self._inflight:
            req = self._inflight.pop(0)
            try:
                req.wait(**stream)
            except Exception as e:  # wait for every request once, then raise the first error
                first = first or e
        if first is not None:
            raise first

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context only accumulate gradients; buckets are scattered
        when a backward outside it completes them (DistributedDataParallel.no_sync)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # ---- lazy gather ----------------------------------------------------------------------------

    def _hook_module(self, module: torch.nn.Module) -> None:
        """gather="lazy": a forward pre-hook on each submodule of `module` that owns parameters
        of the optimizer (``parameters(recurse=False)``), which waits for the gathers of the
        buckets up to the highest of them (gathers complete in ascending order, so the lower
        ones cost nothing more), and on the root module for parameters no submodule owns;
        a state_dict hook on the root. Made again by every registration (add_param_group
        renumbers the buckets)."""
        for h in self._lazy_handles:
            h.remove()
        self._lazy_handles = []
        index = {id(p): i for i, p in enumerate(self._params)}
        owned = set()
        tops: List[Tuple[torch.nn.Module, int]] = []
        for m in module.modules():
            bs = [self._pinfo[index[id(p)]].bucket for p in m.parameters(recurse=False)
                  if id(p) in index]
            owned.update(id(p) for p in m.parameters(recurse=False))
            if bs:
                tops.append((m, max(bs)))
        orphans = [self._pinfo[i].bucket for i, p in enumerate(self._params) if id(p) not in owned]
        if orphans:
            tops.append((module, max(orphans)))
        for m, top in tops:
            self._lazy_handles.append(m.register_forward_pre_hook(self._make_gather_hook(top)))

        def state_dict_hook(*_: Any) -> None:
            # The state dict holds views of the parameters: correct once their gathers are done.
            self.wait_params()

        self._lazy_handles.append(module._register_state_dict_hook(state_dict_hook))

    def _make_gather_hook(self, top: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if self._lazy_owed and self._lazy_done <= top:
                self._wait_gathers(top)
        return hook

    def wait_params(self) -> None:
        """Waits until every parameter holds the last step's result. With gather="lazy",
        step() returns before zerod has written the updated parameters into the model, and
        each submodule's forward waits for its own buckets; any other read of the parameters
        between step() and the next forward (an evaluation outside the module's forward, an
        EMA copy, ``torch.save`` of the parameters themselves, a write into them) must call
        this first; ``module.state_dict()`` calls it by itself. Raises the gathers' error
        (after registering the model again where step() would: module docstring "Lazy
        gather"). Returns at once when nothing is pending (and with gather="step")."""
        if self._lazy_owed:
            self._wait_gathers(self._nbuckets - 1)

    synchronize = wait_params

    def _start_gathers(self) -> None:
        """After a step sent without its gather: the gathers of every bucket, in ascending
        order on every rank (collectives are matched by their order), up to _MAX_GATHERS at once
        (the rest as the forward's waits free their slots)."""
        self._lazy_owed = True
        self._lazy_next = self._lazy_done = 0
        self._lazy_gathers = []
        self._wait_gathers(-1)

    def _wait_gathers(self, top: int, heal: bool = True) -> None:
        """Sends the gathers still to send and waits for those of buckets 0..top (-1: sends
        only). Errors: _gather_failed (heal=False: every request waited for, then raised)."""
        nb = self._nbuckets
        try:
            while self._lazy_next < nb:
                if len(self._lazy_gathers) >= _MAX_GATHERS:
                    if self._lazy_gathers[0][0] > top:
                        break
                    b, req = self._lazy_gathers.pop(0)
                    req.wait()
                    self._lazy_done = b + 1
                    continue
                self._lazy_gathers.append((self._lazy_next,
                                           self.client.gather_start(self._lazy_next)))
                self._lazy_next += 1
            while self._lazy_gathers and self._lazy_gathers[0][0] <= top:
                b, req = self._lazy_gathers.pop(0)
                req.wait()
                self._lazy_done = b + 1
        except ZerodError as e:
            self._gather_failed(e, heal)
            return
        if self._lazy_done >= nb:
            self._lazy_owed = False

    def _gather_failed(self, cause: ZerodError, heal: bool = True) -> None:
        """A gather after a lazy step failed: every request sent is waited for once; then, as
        step() does for the same errors, the model is registered again (zerod restarted with
        its state_dir, or the world re-formed): at the step every rank holds, the parameters
        are zerod's (registration writes them), which ends the wait; where the step was applied
        nowhere, it is sent again (with its gather) from the gradients still in the grad buffer,
        or, when they changed since step() (zero_grad, a new backward), ZerodError says the
        step is lost. Other errors are raised as they are."""
        for _, req in self._lazy_gathers:
            with contextlib.suppress(Exception):
                req.wait()
        self._lazy_gathers = []
        self._lazy_owed = False
        if not heal or not self._can_rejoin(cause):
            raise cause
        st = self._lazy_step
        before = st["before"]
        # asked before registering again: a resize moves the gradients to new buffers
        changed = self._gflat._version != st["grad_version"]
        after = self._rejoin(cause, before)
        self._sent_hparams = []  # zerod's groups are the registration's now
        if after == before + 1:  # applied: the registration wrote its parameters
            return
        if changed:
            raise ZerodError(_lib.ZD_ESTEP, "ZD_ESTEP",
                             f"step {before + 1} was lost with zerod ({cause.name}: "
                             f"{cause.message}) after step() had returned (gather='lazy'), and "
                             f"its gradients were changed since (zero_grad or a new backward): "
                             f"the training loop must redo step {before + 1} from zerod's "
                             f"step {before}", "zd_rejoin") from cause
        self._scattered = [False] * self._nbuckets  # every bucket scattered again
        result, _ = self._step_attempts(st["hp"], st["hp"], st["absent"], before, gather=True)
        self._sent_hparams = st["hp"]
        self.last_result = result
        self.loss_scale = result.loss_scale

    # ---- hyperparameters ------------------------------------------------------------------------

    def _current_hparams(self) -> List[Group]:
        return [Group.coerce(g) for g in self.param_groups]

    # ---- optimizer API -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimizer step through zerod; returns closure's loss (or None).

        Sends the groups' hyperparameters when they changed since the last step (schedulers),
        scatters the buckets the backward hooks did not scatter yet, waits for every scatter,
        and steps with ZD_STEP_NO_SCATTER (scatter + update + gather at world size > 1). The
        model's parameters are updated in place (they are views of the param buffer).
        `last_result` holds zerod's StepResult (applied, grad_norm, clip_coef, loss_scale);
        a step skipped because of an fp16 overflow leaves the parameters unchanged. A step
        another rank's trainer abandoned by dying in it (ZD_EABORTED) is sent again, up to
        `abort_retries` times (module docstring).
        """
        self._check_open()
        self.wait_params()  # gather="lazy": the last step's gathers (a forward waited for most)
        self._check_attached()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        absent = self._absent_params()
        self._rescatter_if_changed()
        hp = self._current_hparams()
        groups = None
        if hp != self._sent_hparams:
            self._check_all_groups()
            groups = hp
        before = self.client.info.step  # the steps applied before this one
        lazy = self._lazy and self._offload is None and not self._cuda
        grad_version = self._gflat._version
        result, sent = self._step_attempts(groups, hp, absent, before, gather=not lazy)
        if self._offload is not None:  # the gather, and the parameters back to the device
            self._offload.after_step()
        if groups is not None or not sent:
            self._sent_hparams = hp
        self.last_result = result
        self.loss_scale = result.loss_scale
        if lazy and sent:
            # What sending the step again needs should a gather find zerod gone
            # (_gather_failed); then the gathers, which the forward's hooks wait for.
            self._lazy_step = {"before": before, "hp": hp, "absent": absent,
                               "grad_version": grad_version}
            self._start_gathers()
        return loss

    def _step_attempts(self, groups: Optional[List[Group]], hp: List[Group],
                       absent: Optional[List[int]], before: int, gather: bool = True
                       ) -> Tuple[StepResult, bool]:
        """The step after zerod's step `before`, registering again after a zerod's loss (up to
        _MAX_REJOINS times); returns its result and whether this step's request was answered
        (False: the step had been applied everywhere before the loss, and the registration
        wrote its parameters). gather=False: sent without its gather (gather="lazy")."""
        for heal in range(_MAX_REJOINS + 1):
            try:
                result = self._send_with_retries(groups, absent, gather)
                if heal:
                    self._sent_hparams = hp  # sent with the step after the registration
                return result, True
            except ZerodError as e:
                if heal == _MAX_REJOINS or not self._can_rejoin(e):
                    raise
                after = self._rejoin(e, before)
                # zerod's groups are the registration's now: this step's (or the next) sends
                # the current ones
                self._sent_hparams = []
                groups = hp
                if after == before + 1:  # applied on every rank before the loss: done
                    return StepResult(after, True, math.nan, self.client.info.loss_scale,
                                      math.nan, 0), False
                # not applied anywhere: the same step again, with the gradients still in the
                # grad buffer, every bucket scattered again
        raise AssertionError("unreachable")

    def _send_with_retries(self, groups: Optional[List[Group]],
                           absent: Optional[List[int]], gather: bool = True) -> StepResult:
        """The step, sent again after ZD_EABORTED up to abort_retries times; its result."""
        for attempt in range(self._abort_retries + 1):
            try:
                step_req = self._send_step(groups, absent, gather)
                break
            except ZerodError as e:
                if not e.retryable or attempt == self._abort_retries:
                    raise
                # Nothing was applied on any rank and the gradients are still in the buffer:
                # the same step again, every bucket scattered again.
                warnings.warn(f"{e.message}; retrying the step "
                              f"({attempt + 1} of {self._abort_retries})", stacklevel=3)
        result = step_req.wait()  # already waited for: its stored result
        assert result is not None
        return result

    def _can_rejoin(self, e: ZerodError) -> bool:
        """Whether e is a zerod's loss that registering again may heal: this rank's zerod gone
        (ZD_ECLOSED), or the world broken or re-formed around a peer's restart (ZD_EPEER, and
        ZD_EAPPLIED: a step applied whose gather failed). Host buffers only (zd_rejoin)."""
        return (self.rejoin_timeout_s > 0 and self._offload is None and not self._cuda
                and e.code in (_lib.ZD_ECLOSED, _lib.ZD_EPEER, _lib.ZD_EAPPLIED))

    def _rejoin(self, cause: ZerodError, before: int) -> int:
        """Registers the model again (Client.rejoin) after `cause`, for the step after `before`
        that was in flight; returns the step every rank holds, which is before (the step was
        applied nowhere: send it again) or before + 1 (applied everywhere). Raises ZerodError
        when zerod came back without the model's state or at another step."""
        warnings.warn(f"{cause.message}; registering the model again and retrying step "
                      f"{before + 1} (up to {self.rejoin_timeout_s:g} s)", stacklevel=3)
        try:
            info = self._follow_resize(cause)
            if info is None:  # the same world size: the same layout, the same buffers
                info = self.client.rejoin(int(self.rejoin_timeout_s * 1000))
        except ZerodError as e:
            raise ZerodError(e.code, e.name, f"step {before + 1} was lost with zerod ("
                             f"{cause.name}: {cause.message}), and registering the model again "
                             f"failed: {e.message}", "zd_rejoin") from cause
        if not info.resumed or info.step not in (before, before + 1):
            how = (f"without this model's state (it took the trainer's parameters as a new "
                   f"model at step {info.step}: no state_dir?)" if not info.resumed
                   else f"at step {info.step} (a checkpoint's?)")
            raise ZerodError(_lib.ZD_ESTEP, "ZD_ESTEP", f"step {before + 1} was lost with zerod "
                             f"({cause.name}: {cause.message}), and zerod took the model again "
                             f"{how}, not at step {before} or {before + 1}: the training loop "
                             f"must restart from there", "zd_rejoin") from cause
        return info.step

    def _follow_resize(self, cause: ZerodError) -> Optional[Info]:
        """After ZD_EPEER: whether the world was resized (zeroctl resize), told by the world size
        a new connection to the same socket and local rank reports (zerod's hello), which
        differs from this connection's; None where it does not (or no new connection opens:
        Client.rejoin then decides). After a resize the model is laid out again for the new
        world size on that connection, as add_param_group does: the parameters and gradients
        move to the new buffers (the old ones are unmapped), .data, .grad (main_grad) and the
        hooks are bound to them, and the model is registered; zerod writes the parameters of
        the step the world holds. Returns the registration's Info. An optimizer given a
        `client` cannot open a connection of its own: ZerodError says so."""
        if cause.code != _lib.ZD_EPEER:
            return None
        kw = self._register_kw
        old = self.client.info
        try:
            probe = Client(kw["socket"], old.local_rank, kw["timeout_ms"])
        except ZerodError:
            return None
        if probe.info.world_size == old.world_size:
            probe.close()
            return None
        if not self._owns_client:
            probe.close()
            raise ZerodError(_lib.ZD_EPEER, "ZD_EPEER",
                             f"the world was resized from {old.world_size} to "
                             f"{probe.info.world_size} ranks, which lays the model out again on "
                             f"a new connection: an optimizer given a `client` cannot open one "
                             f"(let it connect: socket=, local_rank=)", "zd_register")
        warnings.warn(f"the world was resized from {old.world_size} to "
                      f"{probe.info.world_size} ranks: laying the model out again for the new "
                      f"world size", stacklevel=4)
        specs = [(n, tuple(p.shape), pi.group) for p, n, pi in
                 zip(self._params, self._names, self._pinfo)]
        # Off the old buffers, as _grow leaves them: private copies of the values and gradients.
        grads, has_grad = self._leave_buffers()
        self._bind(specs, probe, kw["socket"], old.local_rank, kw["timeout_ms"], kw["offload"],
                   kw["max_grad_norm"], kw["grad_mean"], kw["loss_scaler"], False)
        with torch.no_grad():  # the step in flight's gradients, for sending it again
            for gv, g in zip(self._gviews, grads):
                gv.copy_(g)
        self._has_grad = has_grad
        self._hook_version = self._gflat._version
        return self.info

    @property
    def world_size(self) -> int:
        """The world size of zerod's world now: it changes when the world is resized
        (zeroctl resize), which step() follows by itself; a training loop re-shards its data
        by it (README, "Live resize")."""
        return self.client.info.world_size

    @property
    def rank(self) -> int:
        """This trainer's rank in zerod's world."""
        return self.client.info.rank

    def _absent_params(self) -> List[int]:
        """The parameters without a gradient this step, torch's `p.grad is None`, their gradients
        zeroed in the grad buffer (zerod skips those absent on every rank; at world size > 1 a
        rank's zeros count where another rank has one, as DDP's): a .grad set to None (a
        Module.zero_grad() of torch 2.x), or none since zero_grad(set_to_none=True) (no backward
        reached it, and its buffer view is all zeros: a gradient written by hand counts). An
        offloading optimizer asks its model's own gradients (Offload.absent)."""
        if self._offload is not None:
            return self._offload.absent()
        absent = []
        version = self._gflat._version
        unscattered = True  # every zeroed view is in a bucket no hook has sent yet
        for i, p in enumerate(self._params):
            gv = self._gviews[i]
            if self._grad_views and p.grad is None:
                if bool(gv.any()):  # stale values of an earlier backward
                    gv.zero_()
                    unscattered = unscattered and not self._scattered[self._pinfo[i].bucket]
                p.grad = gv
                missing = True
            elif self._grad_views and p.grad.data_ptr() != gv.data_ptr():
                self._restore_view(i)  # a gradient set by hand
                missing = False
            else:
                missing = not self._has_grad[i] and not bool(gv.any())
            if missing:
                absent.append(i)
        if unscattered and self._hook_version == version:  # only zeros the step scatters
            self._hook_version = self._gflat._version
        return absent

    def _send_step(self, groups: Optional[List[Group]], absent: Optional[List[int]] = None,
                   gather: bool = True) -> Request:
        """The requests of one step attempt; returns the step's, waited for."""
        try:
            if self._lost is not None:  # a scatter from backward's hooks found zerod gone
                lost, self._lost = self._lost, None
                raise lost
            if not self._overlap and self._offload is None:
                # No hooks: one request whose scatter zerod runs (in descending bucket order,
                # like the hooks, so ranks configured differently still match).
                self._inflight.append(self.client.step_start(groups, gather=gather,
                                                             **self._clip_kw(),
                                                             **self._absent_kw(absent),
                                                             **self._stream()))
            else:
                # Whatever the hooks did not send, in their order: every rank's sequence of
                # scatters is then n-1, ..., 0, even where a bucket never completed on one rank
                # (a parameter unused by its batch).
                for b in reversed(range(self._nbuckets)):
                    if not self._scattered[b]:
                        self._start_scatter(b)
                if self._offload is not None:  # the scatters its sender thread has queued
                    self._offload.flush(self._inflight)
                no_gather = ({"gather": False} if self._offload is not None or not gather
                             else {})
                self._inflight.append(self.client.step_start(groups, scatter=False, **no_gather,
                                                             **self._clip_kw(),
                                                             **self._absent_kw(absent),
                                                             **self._stream()))
            step_req = self._inflight[-1]
            self._wait_inflight()  # every request once; raises the first error (a scatter's)
        finally:
            if self._offload is not None:  # only after a failure: what its sender still had
                self._offload.settle(self._inflight)
            for req in self._inflight:  # only after a failure: settle what was sent
                try:
                    req.wait()
                except Exception:
                    pass
            self._inflight.clear()
            self._reset_iteration()
        return step_req

    def _rescatter_if_changed(self) -> None:
        """Scatters every bucket again when the gradients changed after backward's hooks sent
        some of them: a scatter reads the grad buffer when zerod runs it (during backward at
        world size > 1), so a change made between backward and step() (clip_grad_norm_,
        unscaling, a gradient set by hand) would reach some ranks' shards and not others, and
        the step would silently use the gradients as backward left them. Detected by the grad
        buffer's version counter (every in-place write to .grad or .main_grad views bumps it),
        as recorded by the last hook; every rank running the same code scatters again alike."""
        changed = (self._offload.grads_changed() if self._offload is not None
                   else self._gflat._version != self._hook_version)
        if not any(self._scattered) or not changed:
            return
        if not self._warned_changed:
            self._warned_changed = True
            warnings.warn(
                "the gradients changed after backward had scattered them to zerod (e.g. "
                "torch.nn.utils.clip_grad_norm_ or unscaling between backward() and step()): "
                "every bucket is scattered again, which costs the overlap (and at world size "
                "> 1 twice the traffic). Clip with ZeroOptimizer(max_grad_norm=...) instead (zerod clips the "
                "reduced gradient by its global norm, as DistributedDataParallel users clip), "
                "or pass overlap=False", stacklevel=3)
        self._scattered = [False] * self._nbuckets

    @staticmethod
    def _absent_kw(absent: Optional[List[int]]) -> Dict[str, Any]:
        """step_start's absent: left out when every parameter has a gradient."""
        return {"absent": absent} if absent else {}

    def _clip_kw(self) -> Dict[str, Any]:
        """step_start's clip_norm: the running torch's order, left out for zerod's own."""
        return {} if self._clip_norm == "double" else {"clip_norm": self._clip_norm}

    def _check_all_groups(self) -> None:
        for i, g in enumerate(self.param_groups):
            self._check_hparams(g, f"param group {i}")

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Zeroes the whole grad buffer in place (one memset). The gradients stay views of the
        buffer (in main_grad mode ``.grad`` is None anyway and ``main_grad`` is zeroed).
        `set_to_none` (default: the running torch's, True from torch 2.0): every parameter counts
        as having no gradient until its backward reaches it (or a gradient is written into it),
        and zerod skips those without one in the next step as torch skips a .grad of None."""
        self._check_open()
        if self._offload is not None:  # the model's own gradients, on its device
            self._offload.zero_grad(bool(set_to_none))
            self._reset_iteration()
            return
        if set_to_none is None:
            set_to_none = _torch_major() >= 2
        if set_to_none:
            self._has_grad = [False] * len(self._params)
        with torch.no_grad():
            self._gflat.zero_()
        for i, p in enumerate(self._params):
            if self._grad_views:
                if p.grad is None or p.grad.data_ptr() != self._gviews[i].data_ptr():
                    p.grad = self._gviews[i]
            else:
                p.grad = None
        self._reset_iteration()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss multiplied by the current loss scale (1 without loss scaling)."""
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    @property
    def step_count(self) -> int:
        """Steps zerod has applied to this model (survives the trainer)."""
        return self.client.info.step

    def checkpoint(self, *, wait: bool = True) -> Tuple[int, str]:
        """Has zerod write a checkpoint of the master weights, moments and loss scaler as of
        the last step (its checkpoint_dir must be set). At world size > 1 every trainer calls it
        at the same step. Returns (step, checkpoint directory); with wait=False it returns once
        zerod has snapshotted the state, which it then writes in the background."""
        self._check_open()
        self.wait_params()
        return self.client.checkpoint(wait=wait)

    def state_dict(self) -> Dict[str, Any]:
        """torch's optimizer state_dict format, with what can honestly be provided: the groups'
        hyperparameters (and scheduler keys such as initial_lr), an empty per-parameter state,
        and under "zerod" the daemon's step, loss scale and layout hash.

        The master weights and Adam moments are not in it: they live in zerod and outlive the
        trainer. A restarted trainer resumes by building the same model and optimizer again,
        which reattaches to zerod's state; load_state_dict() then restores the hyperparameters.
        """
        self.wait_params()  # gather="lazy": the step is whole (or its error raised) first
        sd = super().state_dict()
        info = self.client.info
        sd["zerod"] = {"step": info.step, "loss_scale": self.loss_scale,
                       "layout_hash": info.layout_hash, "world_size": info.world_size,
                       "rank": info.rank, "param_dtype": str(self.param_dtype),
                       "grad_dtype": str(self.grad_dtype), "names": list(self._names)}
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores the groups' hyperparameters (sent to zerod at the next step). Warns when
        the saved step differs from zerod's: the master weights and moments are zerod's, at its
        own step, and are not rolled back."""
        self.wait_params()
        formulas = [(g["update"], g["sqrt_mode"]) for g in self.param_groups]
        super().load_state_dict(state_dict)
        for i, g in enumerate(self.param_groups):
            g["betas"] = tuple(g["betas"])
            # A state saved before zerod had formulas keeps the one chosen for this torch.
            if g.get("update") is None and i < len(formulas):
                g["update"] = formulas[i][0]
            if g.get("sqrt_mode") is None and i < len(formulas):
                g["sqrt_mode"] = formulas[i][1]
            self._check_hparams(g, f"param group {i} of the loaded state")
        self._sent_hparams = None  # send them at the next step
        z = state_dict.get("zerod")
        if z is not None:
            info = self.client.info
            if z.get("layout_hash") not in (None, info.layout_hash):
                raise ValueError(f"the state dict is of another model: layout hash "
                                 f"{z['layout_hash']:016x}, this one {info.layout_hash:016x}")
            if z.get("step") not in (None, info.step):
                warnings.warn(f"the state dict was saved at step {z['step']}, but zerod holds "
                              f"this model at step {info.step}: master weights and moments stay "
                              f"at zerod's step (they live in zerod, not in the state dict)",
                              stacklevel=2)

    # ---- lifetime ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if getattr(self, "_closed", True):
            raise RuntimeError("the ZeroOptimizer is closed")

    def close(self) -> None:
        """Detaches the model from zerod and closes the connection (if the optimizer opened it).

        The parameters get private copies of their current values (and gradients), so the model
        stays usable after the shared buffers are unmapped; the hooks are removed. zerod keeps
        the master weights and moments for a later optimizer. Closing twice is harmless."""
        if getattr(self, "_closed", True):
            return
        if self._lazy_owed:  # gather="lazy": the parameters the copies below take
            try:
                self._wait_gathers(self._nbuckets - 1, heal=False)
            except Exception:
                pass
        self._closed = True
        _open_optimizers.discard(self)
        try:
            self._wait_inflight()
        except Exception:
            pass
        for h in self._hook_handles + self._lazy_handles:
            h.remove()
        self._hook_handles, self._grad_accs, self._lazy_handles = [], [], []
        if self._cuda:
            # Only the stream current at the last request waited for zerod's results: the
            # copies below, on today's current stream, must not read the buffers before them.
            torch.cuda.synchronize(self.device)
        if self._offload is not None:  # the parameters are the model's own: nothing to copy
            self._offload.close()
        with torch.no_grad():
            for p, gv in zip(self._params, self._gviews) if self._offload is None else ():
                p.data = p.data.clone()
                if self._grad_views:
                    p.grad = gv.clone()
                else:
                    del p.main_grad
        if self._cuda:
            torch.cuda.synchronize(self.device)  # the clones ran before the buffers are freed
        self._pflat = self._gflat = None  # type: ignore[assignment]
        self._gviews = []
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> "ZeroOptimizer":
        return self

    def __del__(self) -> None:
        # An optimizer dropped without close(): give the model private copies and release the
        # rank (the hooks hold a reference cycle, so this runs when the cycle is collected).
        # Only the object that was built: Lightning's LightningOptimizer takes a copy of this
        # one's __dict__ under a subclass of its class, and that copy's collection must not
        # close the client and unmap the buffers the real optimizer still uses.
        if self.__dict__.get("_built_as") != id(self):
            return
        try:
            self.close()
        except Exception:
            pass

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce_ex__(self, protocol: Any) -> Tuple[Any, Tuple[str]]:
        # Pickled, an optimizer attached to a zerod rank becomes a PickledZeroOptimizer: torch
        # 1.13's schedulers keep bound methods in their state_dict, which pickle the scheduler
        # and, through it, its optimizer (torch.save(OneCycleLR(...).state_dict())).
        return (PickledZeroOptimizer, (self._describe(),))

    def __copy__(self) -> None:
        raise TypeError("a ZeroOptimizer is attached to a zerod rank and cannot be copied")

    def __deepcopy__(self, memo: Any) -> None:
        raise TypeError("a ZeroOptimizer is attached to a zerod rank and cannot be copied")

    def _describe(self) -> str:
        info = getattr(self, "info", None)
        where = f" of zerod rank {info.rank}/{info.world_size}" if info is not None else ""
        return f"a ZeroOptimizer{where} ({len(getattr(self, '_params', []))} parameters)"

    def __repr__(self) -> str:
        head = super().__repr__()
        return head.replace("ZeroOptimizer (", f"ZeroOptimizer (zerod rank "
                            f"{self.info.rank}/{self.info.world_size}, {self.param_dtype} params, "
                            f"{self.grad_dtype} grads, {self._nbuckets} buckets;", 1)


class PickledZeroOptimizer:
    """What a ZeroOptimizer becomes when pickled (e.g. inside a torch 1.13 scheduler's
    state_dict): a placeholder that says what it was. It holds no state and no connection; any
    attribute raises AttributeError saying so. Save and restore the optimizer itself with
    state_dict() / load_state_dict()."""

    def __init__(self, description: str) -> None:
        self._description = description

    def __reduce__(self) -> Tuple[Any, Tuple[str]]:
        return (PickledZeroOptimizer, (self._description,))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_description":
            raise AttributeError(name)
        raise AttributeError(f"{self._description} was pickled; the copy is a placeholder with "
                             f"no {name!r}: rebuild the optimizer and load its state_dict()")

    def __repr__(self) -> str:
        return f"PickledZeroOptimizer({self._description!r})"


# The other optimizers (zerod.optim), built on ZeroOptimizer above: every name it exports.
from . import optim as _optim  # noqa: E402
from .optim import *  # noqa: E402,F401,F403

__all__ += [name for name in _optim.__all__ if name not in __all__]
