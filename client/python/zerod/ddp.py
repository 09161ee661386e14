"""Gradients reduced once under DistributedDataParallel: DDP hands them to zerod.

Hugging Face Trainer, Accelerate and Lightning wrap the model in
torch.nn.parallel.DistributedDataParallel whenever the world size is above 1. Left as it is, DDP
all-reduces every gradient and zerod then reduce-scatters it again: twice the traffic for the
same mean. ``register(ddp_model, optimizer)`` makes DDP leave the reduction to zerod::

    model = DistributedDataParallel(model)              # or what the framework built
    opt = zerod.torch.ZeroOptimizer(model.parameters(), lr=3e-4, max_grad_norm=1.0)
    zerod.ddp.register(model, opt)

What it does. It registers a DDP communication hook (``register_comm_hook``) that reduces
nothing: each DDP bucket's future is completed at once with the bucket as it is, so no gradient
goes through DDP's process group, while ZeroOptimizer's own backward hooks reduce-scatter the
gradients through zerod as they become final (zerod averages over its ranks: grad_mean). It
tells DDP's reducer that the gradients are consumed elsewhere (torch >= 2's
``_set_optimizer_in_backward``, the mode of DDP's optimizer-in-backward), so DDP does not copy its
buckets back into ``.grad`` at the end of backward; under torch 1.x, which has no such mode, DDP
copies them back (the same values: nothing was reduced) and the optimizer is told that this
write changed nothing. And it follows DDP's ``no_sync()``: a forward run under it is followed by
a backward that only accumulates, in DDP and in zerod alike, so gradient accumulation needs
nothing but the framework's own ``model.no_sync()``; the last micro-batch's backward scatters.

What ``.grad`` holds. Between backward and step() each rank's ``.grad`` is its **local**
gradient (summed over its micro-batches), not the mean DDP would have left there: the mean
exists only in zerod, inside the step. So anything that reads or changes ``.grad`` between
backward and step() must move into zerod: clip with ``ZeroOptimizer(max_grad_norm=...)`` (zerod
clips the reduced gradient by its global norm, inside the step) and turn the framework's own
clipping off (zerod.hf does both for Trainer); a gradient norm logged from ``.grad`` is the local
one (``opt.last_result.grad_norm`` is zerod's, of the reduced gradient, when max_grad_norm is
set). A framework that clips ``.grad`` anyway gets a local clip on every rank, which is wrong.

Requirements, checked by register(): every parameter DDP reduces must be one the optimizer owns
(a gradient of any other would now be reduced by no one); DDP's ``gradient_as_bucket_view`` off
(its default: with it DDP would point ``.grad`` at its own buckets, away from zerod's buffer);
and DDP's process group of the same size as zerod's world, this process at zerod's rank.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .torch import ZeroOptimizer

__all__ = ["register"]


class _HookState:
    """What the communication hook needs: the optimizer (weakly; DDP keeps the state alive)
    and, under torch 1.x, whether this backward's copy-back is already accounted for."""

    def __init__(self, optimizer: ZeroOptimizer, copies_back: bool) -> None:
        self.optimizer = weakref.ref(optimizer)
        self.copies_back = copies_back
        self.callback_queued = False


def _accept_copy_back(state: _HookState) -> None:
    """torch 1.x: queued from the hook, this runs among the engine's final callbacks, before
    DDP's finalize_backward (queued when its last bucket is ready, after the hook ran); it queues
    the real work behind it: by then DDP has copied its buckets back into .grad."""
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]

    def after_ddp() -> None:
        state.callback_queued = False
        opt = state.optimizer()
        if opt is not None and not getattr(opt, "_closed", True):
            opt._accept_grad_writes()

    engine.queue_callback(after_ddp)


def _leave_to_zerod(state, bucket):  # type: ignore[no-untyped-def]
    """DDP communication hook: the bucket's reduction is complete at once, unreduced; zerod
    reduce-scatters the same gradients from its grad buffer (ZeroOptimizer's hooks). (No
    annotations: DDP compares them with dist.GradBucket and Future[Tensor], and this module's
    are strings.)"""
    if state.copies_back and not state.callback_queued:
        state.callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
            lambda: _accept_copy_back(state))
    fut = torch.futures.Future()  # type: ignore[var-annotated]
    fut.set_result(bucket.buffer())
    return fut


def register(model: DistributedDataParallel, optimizer: ZeroOptimizer) -> None:
    """Makes `model` (DistributedDataParallel) leave its gradients' reduction to `optimizer`
    (a ZeroOptimizer over the same parameters): no all-reduce through DDP's process group, one
    reduce-scatter through zerod (module docstring). Call it once, after both exist and before
    the first backward; DDP accepts one communication hook per model.

    Raises:
        TypeError: model is not a DistributedDataParallel or optimizer not a ZeroOptimizer.
        ValueError: a parameter DDP reduces is not the optimizer's; gradient_as_bucket_view;
            DDP's process group disagrees with zerod's world (size or this process's rank).
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"zerod.ddp.register needs a DistributedDataParallel model, got "
                        f"{type(model).__name__}")
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"zerod.ddp.register needs a zerod.torch.ZeroOptimizer, got "
                        f"{type(optimizer).__name__}")
    optimizer._check_open()
    if getattr(model, "gradient_as_bucket_view", False):
        raise ValueError("DistributedDataParallel(gradient_as_bucket_view=True) points each .grad "
                         "at DDP's own buckets, away from zerod's grad buffer: build the model "
                         "with gradient_as_bucket_view=False (DDP's default)")
    owned = {id(p) for p in optimizer._params}
    missing: List[str] = [name for name, p in model.module.named_parameters()
                          if p.requires_grad and id(p) not in owned
                          and name not in getattr(model, "parameters_to_ignore", ())]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                          else "")
        raise ValueError(f"DDP reduces {len(missing)} parameter(s) the ZeroOptimizer does not own "
                         f"({shown}): with zerod's hook no one would reduce their gradients; give "
                         f"the optimizer every trainable parameter of the model")
    group = getattr(model, "process_group", None)
    if group is not None and dist.is_initialized():
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        info = optimizer.info
        if (size, rank) != (info.world_size, info.rank):
            raise ValueError(f"DDP's process group has {size} ranks with this process at rank "
                             f"{rank}, but zerod's world has {info.world_size} with this trainer "
                             f"at rank {info.rank}: start zerod with --world_size and "
                             f"--first_rank matching the launcher")
    reducer = model.reducer
    copies_back = not hasattr(reducer, "_set_optimizer_in_backward")
    state = _HookState(optimizer, copies_back)
    model.register_comm_hook(state, _leave_to_zerod)
    if not copies_back:
        reducer._set_optimizer_in_backward()  # .grad stays zerod's buffer, unreduced

    opt_ref = weakref.ref(optimizer)

    def follow_no_sync(module: DistributedDataParallel, _inputs: Any) -> None:
        opt: Optional[ZeroOptimizer] = opt_ref()
        if opt is not None:
            # DDP decides at forward time whether the next backward reduces (its forward
            # prepares the reducer only when require_backward_grad_sync); so does zerod.
            opt._ddp_sync = bool(module.require_backward_grad_sync)

    model.register_forward_pre_hook(follow_no_sync)
