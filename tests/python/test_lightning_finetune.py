"""Lightning's BaseFinetuning with a ZeroOptimizer, bitwise against the same run with torch's AdamW.

A backbone frozen before training (freeze_before_training) and, at the start of epoch 1 (after 5
steps), unfrozen and added to the optimizer as a new parameter group with the callback's
unfreeze_and_add_param_group (lr: the first group's divided by initial_denom_lr), as Lightning's
finetuning example does; 2 epochs of 5 steps at W=1 on CPU. ZeroOptimizer.add_param_group grows
the model zerod holds (the head keeps its moments and step counts, the backbone starts afresh), so
every parameter must end bitwise equal to torch.optim.AdamW's run through the same Trainer.

Needs lightning in this interpreter: exits 77 (SKIP) without it.
"""

from __future__ import annotations

import sys
import unittest
from typing import Any, Dict, Optional

import common

torch = common.require_torch()
try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BaseFinetuning
except ImportError as e:
    common.skip(f"lightning is not importable here ({e}): scripts/torch2_venv.sh --frameworks "
                f"installs it into the torch 2.x venv")
import torch.nn as nn  # noqa: E402

import zerod.testing  # noqa: E402
from zerod.torch import ZeroOptimizer  # noqa: E402

BATCHES, EPOCHS = 5, 2


def loader() -> Any:
    g = torch.Generator().manual_seed(11)
    n = BATCHES * 8
    ds = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g),
                                        torch.randn(n, 4, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


class Module(pl.LightningModule):
    """What a Lightning user writes for finetuning: the optimizer over what is trainable."""

    def __init__(self, socket: Optional[str] = None) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)
        self.socket = socket

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        params = filter(lambda p: p.requires_grad, self.parameters())
        if self.socket is None:
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        return ZeroOptimizer(params, lr=1e-2, weight_decay=0.1, socket=self.socket)


class Unfreeze(BaseFinetuning):
    def __init__(self) -> None:
        super().__init__()
        self.groups_after: Dict[int, int] = {}

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, train_bn=True)
        self.groups_after[epoch] = len(optimizer.param_groups)


def fit(module: pl.LightningModule) -> Unfreeze:
    cb = Unfreeze()
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=EPOCHS, callbacks=[cb], logger=False,
               enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(module, loader())
    return cb


class LightningFinetuneTest(unittest.TestCase):
    def test_unfreeze_and_add_param_group(self) -> None:
        torch.set_num_threads(1)
        ref = Module()
        ref_cb = fit(ref)
        self.assertEqual(ref_cb.groups_after, {0: 1, 1: 2})
        want = {n: p.detach().clone() for n, p in ref.named_parameters()}
        with zerod.testing.LocalZerod(log_level="info") as d:
            mod = Module(d.socket)
            cb = fit(mod)
            opt = mod.trainer.optimizers[0]
            try:
                self.assertEqual(cb.groups_after, {0: 1, 1: 2})
                self.assertEqual(opt.step_count, BATCHES * EPOCHS)
                status = opt.client.rank_status()
                # the backbone's 4 tensors joined after the first epoch: their own steps lag
                self.assertEqual(int(status["params_lagging"]), 4)
                self.assertEqual(opt.param_groups[1]["lr"], 1e-3)
            finally:
                opt.close()
        got = {n: p.detach().clone() for n, p in mod.named_parameters()}
        diffs = [common.first_difference(n, got[n], want[n]) for n in want
                 if not torch.equal(got[n], want[n])]
        print(f"lightning {pl.__version__}: {len(want)} parameters after {EPOCHS} epochs, the "
              f"backbone added after epoch 0; differences: {diffs[:2]}")
        self.assertEqual(diffs, [])
        # the backbone did train after its group was added
        self.assertFalse(torch.equal(got["backbone.0.weight"], Module().backbone[0].weight))


if __name__ == "__main__":
    common.run(LightningFinetuneTest)
