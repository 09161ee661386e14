"""Hugging Face Trainer on zerod: ZeroTrainer, and zero_optimizer() for a Trainer of your own.

``ZeroTrainer`` is ``transformers.Trainer`` with its optimizer's state in zerod::

    from zerod.hf import ZeroTrainer
    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=ds)
    trainer.train()                                   # or train(resume_from_checkpoint=...)

It differs from Trainer in four places, each needed for zerod's result to be bit for bit
Trainer's own:

- The optimizer is ``zero_optimizer(model, args)``: a ZeroOptimizer matching what
  ``args.optim`` would build (lr, betas, eps, Trainer's weight-decay groups; ``fused=True`` for
  ``adamw_torch_fused``, Trainer's default, torch's default formula for ``adamw_torch``); any
  other ``optim`` is refused with a message saying so (ValueError), since zerod computes AdamW
  only. The parameters go to zerod in the model's order (Trainer's groups split into runs of
  consecutive parameters), which is the order clip_grad_norm_ sums their norms in.
- Clipping is zerod's: ``args.max_grad_norm`` is passed to the ZeroOptimizer, which clips the
  reduced gradient inside the step (bit for bit torch's clip_grad_norm_ at world size 1 on CPU,
  within a few ULP of its coefficient at world size > 1, where zerod sums the squares of its
  shards in double), and Trainer's own clipping and gradient-norm pass are skipped (they would
  rewrite the gradients after backward had sent them, and under DDP they would see only this
  rank's gradients). The logged ``grad_norm`` is then absent.
- Under DistributedDataParallel (torchrun, world size > 1) the model's gradients are reduced
  by zerod only (zerod.ddp.register, on the first training step): no all-reduce. Gradient
  accumulation follows Trainer's own ``no_sync``.
- Checkpoints: each Trainer save has zerod write a checkpoint of the same step (its
  ``checkpoint_dir`` must be set) and records where in ``zerod.json`` inside the Trainer's
  checkpoint folder. To resume, start zerod with ``--resume`` that folder (or ``latest``) and
  call ``train(resume_from_checkpoint=...)``; a zerod that holds another step than the
  checkpoint's stops the first step with an error naming both (zerod's state is not the
  Trainer checkpoint's optimizer.pt, which holds only the hyperparameters).

``zerod_options`` (a dict) goes to ZeroOptimizer: socket, local_rank, replace, timeout_ms,
overlap, loss_scaler. Without a socket: $ZEROD_SOCKET; without a local rank: LOCAL_RANK.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional

import torch
import transformers
from torch.nn.parallel import DistributedDataParallel

from . import ddp as _ddp
from .client import ZerodError
from .torch import ZeroOptimizer

__all__ = ["ZeroTrainer", "zero_optimizer", "SUPPORTED_OPTIM"]

# args.optim -> ZeroOptimizer's implementation choice reproducing torch.optim.AdamW as Trainer
# builds it (transformers' _get_adamw_torch: AdamW(lr, betas, eps), fused=True for the fused one).
SUPPORTED_OPTIM = {"adamw_torch": {}, "adamw_torch_fused": {"fused": True}}


def _optim_name(args: Any) -> str:
    optim = getattr(args, "optim", "adamw_torch")
    return str(getattr(optim, "value", optim))


def _groups_in_model_order(model: torch.nn.Module, decay: List[str],
                           weight_decay: float) -> List[Dict[str, Any]]:
    """Trainer's two groups (decay / no decay, transformers' get_decay_parameter_names), as runs
    of consecutive parameters in the model's order."""
    groups: List[Dict[str, Any]] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        wd = weight_decay if name in decay else 0.0
        if groups and groups[-1]["weight_decay"] == wd:
            groups[-1]["params"].append((name, p))
        else:
            groups.append({"params": [(name, p)], "weight_decay": wd})
    return groups


def zero_optimizer(model: torch.nn.Module, args: Any, *, decay_parameters: Optional[List[str]] = None,
                   **options: Any) -> ZeroOptimizer:
    """A ZeroOptimizer that computes what Trainer's optimizer for `args`
    (transformers.TrainingArguments) would, for `model` (unwrapped): args.optim
    "adamw_torch_fused" (Trainer's default) or "adamw_torch", args.learning_rate,
    adam_beta1/2, adam_epsilon, weight_decay on the parameters Trainer decays
    (`decay_parameters`: default transformers' rule, Trainer.get_decay_parameter_names), and
    args.max_grad_norm (zerod clips; Trainer must not: ZeroTrainer). `options` go to
    ZeroOptimizer (socket, local_rank, replace, ...).

    Raises ValueError for an args.optim zerod cannot reproduce (every optimizer but torch's
    AdamW), naming the ones it can."""
    name = _optim_name(args)
    if name not in SUPPORTED_OPTIM:
        raise ValueError(f"TrainingArguments.optim is {name!r}, which zerod cannot reproduce: "
                         f"zerod computes torch's AdamW only, as optim "
                         f"{' or '.join(repr(k) for k in SUPPORTED_OPTIM)} (Trainer's default is "
                         f"'adamw_torch_fused'); set one of them, or train without zerod")
    if decay_parameters is None:
        decay_parameters = transformers.Trainer.get_decay_parameter_names(None, model)  # type: ignore[arg-type]
    kw: Dict[str, Any] = dict(SUPPORTED_OPTIM[name])
    kw.update(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
              eps=args.adam_epsilon, weight_decay=args.weight_decay,
              max_grad_norm=float(args.max_grad_norm or 0.0))
    kw.update(options)
    return ZeroOptimizer(_groups_in_model_order(model, decay_parameters, args.weight_decay), **kw)


def _zero(opt: Any) -> Optional[ZeroOptimizer]:
    """The ZeroOptimizer inside Trainer's optimizer (Accelerate wraps it), or None."""
    while opt is not None and not isinstance(opt, ZeroOptimizer):
        opt = getattr(opt, "optimizer", None)
    return opt


class _ZerodCheckpoints(transformers.TrainerCallback):
    """zerod's checkpoint beside each Trainer checkpoint, and the step check on resume."""

    def __init__(self, trainer: "ZeroTrainer") -> None:
        self.trainer = trainer
        self.checked = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.checked = False

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.checked:
            return
        self.checked = True
        opt = _zero(self.trainer.optimizer)
        if opt is not None and opt.step_count != state.global_step:
            raise RuntimeError(
                f"zerod holds this model at step {opt.step_count}, but the Trainer is at step "
                f"{state.global_step}: the master weights and moments live in zerod, not in the "
                f"Trainer's checkpoint. Resuming from a checkpoint: start zerod with --resume "
                f"the zerod checkpoint recorded in that folder's zerod.json (or --resume latest); "
                f"starting afresh: pass zerod_options={{'replace': True}}")

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        opt = _zero(self.trainer.optimizer)
        if opt is None:
            return
        try:
            step, path = opt.checkpoint()
        except ZerodError as e:
            raise RuntimeError(
                f"Trainer saved a checkpoint at step {state.global_step}, but zerod could not "
                f"write its own ({e}): the master weights and moments live in zerod, so a "
                f"Trainer checkpoint without one cannot be resumed. Start zerod with "
                f"--checkpoint_dir, or set save_strategy='no'") from e
        folder = os.path.join(args.output_dir,
                              f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(folder):
            with open(os.path.join(folder, "zerod.json"), "w") as f:
                json.dump({"step": step, "zerod_checkpoint": path}, f)


class ZeroTrainer(transformers.Trainer):
    """transformers.Trainer whose optimizer is a ZeroOptimizer (module docstring): built by
    zero_optimizer(model, args, **zerod_options) unless `optimizers` brings one (then it must
    have been built with args.max_grad_norm), clipped by zerod, reduced by zerod alone under
    DDP, checkpointed by zerod at every save."""

    def __init__(self, *args: Any, zerod_options: Optional[Mapping[str, Any]] = None,
                 **kwargs: Any) -> None:
        self.zerod_options = dict(zerod_options or {})
        super().__init__(*args, **kwargs)
        self._zerod_ddp: Optional[DistributedDataParallel] = None
        self.add_callback(_ZerodCheckpoints(self))

    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            target = self.model if model is None else model
            target = getattr(target, "module", target)
            self.optimizer = zero_optimizer(target, self.args,
                                            decay_parameters=self.get_decay_parameter_names(target),
                                            **self.zerod_options)
        return self.optimizer

    def training_step(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The model Trainer trains is DDP-wrapped only once Accelerate prepared it: hand its
        # gradients to zerod before its first forward.
        if not isinstance(model, DistributedDataParallel) and model is not self._zerod_ddp:
            opt = _zero(self.optimizer)
            if opt is not None:
                opt.reattach()
            self._zerod_ddp = model
        elif isinstance(model, DistributedDataParallel) and model is not self._zerod_ddp:
            opt = _zero(self.optimizer)
            if opt is None:
                raise RuntimeError("ZeroTrainer's optimizer is not a ZeroOptimizer")
            # Accelerate's prepare() moved the model to its device, which for a multi-process
            # CPU run is torch.device("cpu", <rank>): a copy, off zerod's buffers.
            opt.reattach()
            _ddp.register(model, opt)
            self._zerod_ddp = model
        opt = _zero(self.optimizer)
        if (opt is not None and not isinstance(model, DistributedDataParallel)
                and not self.accelerator.sync_gradients):
            # A micro-batch of gradient accumulation without DDP: scatter only after the last.
            with opt.no_sync():
                return super().training_step(model, *args, **kwargs)
        return super().training_step(model, *args, **kwargs)

    # Trainer's clipping and its gradient-norm pass (transformers 5.x's private hooks): zerod
    # clips the reduced gradient inside the step; here nothing touches the gradients.
    def _clip_grad_norm(self, model: torch.nn.Module) -> None:  # type: ignore[override]
        return None

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> None:  # type: ignore[override]
        return None
