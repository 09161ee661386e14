"""Drop-in torch optimizers other than AdamW/Adam, stepped by zerod: each takes its torch.optim
class's arguments and shares ZeroOptimizer's machinery (buffers, hooks, scatter, step, checkpoints,
the dead-trainer retry; module zerod.torch). Exported from zerod.torch.

    opt = zerod.torch.ZeroSGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    opt = zerod.torch.ZeroAdagrad(model.parameters(), lr=0.01, lr_decay=1e-4)
    opt = zerod.torch.ZeroLion(model.parameters(), lr=1e-4, weight_decay=0.1)

Each is bit for bit its torch class's default implementation on CPU parameters, under torch 1.13
and 2.x (ZeroLion: the lion-pytorch package's Lion) (zerod's table of optimizers: kernels/optim.h;
formulas in their kernel files). CUDA parameters are refused: zerod's CUDA kernels for them
(kernels/optim.cu) compute torch's CPU formulas and have not yet been checked on a GPU against
torch's own CUDA implementations.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from . import client as _client
from . import _lib
from .torch import ZeroOptimizer, _torch_major

__all__ = ["ZeroAdagrad", "ZeroLion", "ZeroRMSprop", "ZeroSGD"]


class _Row:
    """The Python side of a row of zerod's table of optimizers (kernels/optim.h): how
    zerod.checkpoint moves the state of optimizer `kind` to and from its torch class.

    kind: the group's optimizer name (ZD_<KIND> in zerod.h). torch_class: a function returning
    the torch optimizer class (imported only when an export or import needs it). arrays: the
    per-parameter state arrays by torch's names, which are zerod's state arrays of the same names
    (common/state.h), each a name (every group keeps it) or a (name, key) pair: the groups whose
    torch hyperparameter `key` is true (not 0, not False) keep it, as the row's kernel writes it
    (zd__<k>_writes) and as torch creates it. step: whether torch's state holds a per-parameter
    "step" (without one, an import is written at the step save_torch_state is given, default 1
    once some parameter has state, else 0). fill: for a torch class that creates its state at
    construction (step 0), array -> the hyperparameter it starts at (Adagrad's sum starts at
    initial_accumulator_value), which a parameter zerod has not stepped yet is given."""

    def __init__(self, kind: str, torch_class: Any, arrays: Tuple[Any, ...], step: bool,
                 fill: Optional[Mapping[str, str]] = None) -> None:
        self.kind, self.torch_class, self.step = kind, torch_class, step
        self.arrays: Tuple[Tuple[str, Optional[str]], ...] = tuple(
            (a, None) if isinstance(a, str) else (a[0], a[1]) for a in arrays)
        self.fill: Dict[str, str] = dict(fill or {})

    def torch_class_name(self) -> str:
        """The torch class's name, or the row's kind where its package is not installed."""
        try:
            return str(self.torch_class().__name__)
        except ImportError:
            return self.kind

    def keeps(self, array: str, group: Mapping[str, Any]) -> bool:
        """Whether a torch param group keeps `array` (one of the row's)."""
        key = dict(self.arrays)[array]
        return key is None or bool(group.get(key))

    def model_arrays(self, groups: Iterable[Mapping[str, Any]]) -> List[str]:
        """The arrays a zerod model of these torch param groups holds, in the row's order:
        those some group keeps (zerod keeps an array for every parameter or none)."""
        groups = list(groups)
        return [a for a, _ in self.arrays if any(self.keeps(a, g) for g in groups)]


# kind -> _Row: every optimizer of zerod's table, from which zerod.checkpoint exports to and
# imports from its torch class (AdamW first: torch's AdamW may be a subclass of Adam).
TABLE: Dict[str, _Row] = {}


def _register(row: _Row) -> None:
    """Adds a row: the group field optimizer accepts its name (libzerod's ZD_<KIND>)."""
    _client._ENUMS["optimizer"].setdefault(row.kind, getattr(_lib, "ZD_" + row.kind.upper()))
    TABLE[row.kind] = row


def _refuse_cuda(cuda: bool, who: str) -> None:
    """The subclasses' refusal of CUDA parameters (stepped on the GPU; offload steps on the CPU)."""
    if cuda:
        raise ValueError(f"{who}: CUDA parameters are not supported yet (zerod's CUDA kernel for "
                         f"it is unverified against torch's CUDA implementation); train on CPU "
                         f"parameters")


def _torch_optim(name: str) -> Any:
    """torch.optim.<name>, as a row's torch_class."""

    def cls() -> Any:
        import torch

        return getattr(torch.optim, name)

    return cls


_ADAM_ARRAYS = ("exp_avg", "exp_avg_sq", ("max_exp_avg_sq", "amsgrad"))
_register(_Row("adamw", _torch_optim("AdamW"), _ADAM_ARRAYS, step=True))
_register(_Row("adam", _torch_optim("Adam"), _ADAM_ARRAYS, step=True))


class ZeroSGD(ZeroOptimizer):
    """torch.optim.SGD through zerod (kernels/sgd.c): lr, momentum, dampening, weight_decay,
    nesterov and maximize as torch takes them, per parameter group too; the momentum buffer is
    created from the first step's gradient as torch creates it (a clone, no dampening). The other
    keywords are ZeroOptimizer's (max_grad_norm, loss_scaler, grad_mean, overlap, socket, ...).
    foreach is accepted (on CPU torch's foreach path computes the same bits as its default);
    fused=True and differentiable=True are refused. A model with momentum keeps the
    momentum_buffer array from registration on: a group whose momentum was 0 at construction
    cannot turn it on later (zerod refuses the step)."""

    _FOREIGN = frozenset({"lr_decay", "initial_accumulator_value", "alpha", "centered"})

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
                 maximize: bool = False, foreach: Any = None, differentiable: bool = False,
                 fused: Any = None, **kwargs: Any) -> None:
        if fused:
            raise ValueError("ZeroSGD: fused=True is not supported (zerod reproduces torch's "
                             "default implementation); leave fused unset")
        super().__init__(params, lr=lr, weight_decay=weight_decay, optimizer="sgd",
                         momentum=momentum, dampening=dampening, nesterov=bool(nesterov),
                         maximize=maximize, foreach=foreach, differentiable=differentiable,
                         **kwargs)

    @staticmethod
    def _check_hparams(g: Mapping[str, Any], where: str) -> None:
        ZeroOptimizer._check_hparams(g, where)
        momentum, dampening = g.get("momentum", 0.0), g.get("dampening", 0.0)
        if not (math.isfinite(momentum) and momentum >= 0):
            raise ValueError(f"{where}: invalid momentum value: {momentum!r}")
        if not math.isfinite(dampening):
            raise ValueError(f"{where}: invalid dampening value: {dampening!r}")
        if g.get("nesterov") and (momentum <= 0 or dampening != 0):
            raise ValueError(f"{where}: Nesterov momentum requires a momentum and zero "
                             f"dampening")

    def _choose_formulas(self, cuda: bool) -> None:
        """SGD's formula is the same in torch 1.13 and 2.x (kernels/sgd.c): update and sqrt_mode
        are recorded for the bookkeeping only."""
        _refuse_cuda(cuda, "ZeroSGD")
        for g in self.param_groups:
            if g.get("update") is None:
                g["update"] = "torch2" if _torch_major() >= 2 else "torch113"
            if g.get("sqrt_mode") is None:
                g["sqrt_mode"] = "exact"


_register(_Row("sgd", _torch_optim("SGD"), (("momentum_buffer", "momentum"),), step=False))


class ZeroAdagrad(ZeroOptimizer):
    """torch.optim.Adagrad through zerod (kernels/adagrad.c): lr, lr_decay, weight_decay,
    initial_accumulator_value, eps and maximize as torch takes them, per parameter group too
    except initial_accumulator_value, which (as in torch) is the constructor's for every group;
    the state `sum` starts there at the first step. The sqrt is torch.sqrt's
    as for AdamW (sqrt_mode, measured on this machine: module zerod.torch "Which torch"). The
    other keywords are ZeroOptimizer's. foreach is accepted (the same bits on CPU); fused=True and
    differentiable=True are refused."""

    _FOREIGN = frozenset({"momentum", "dampening", "nesterov", "alpha", "centered"})

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, lr_decay: float = 0.0,
                 weight_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10, foreach: Any = None, *, maximize: bool = False,
                 differentiable: bool = False, fused: Any = None, **kwargs: Any) -> None:
        if fused:
            raise ValueError("ZeroAdagrad: fused=True is not supported (zerod reproduces "
                             "torch's default implementation); leave fused unset")
        # torch fills every parameter's sum at construction from the constructor's
        # initial_accumulator_value, whatever its group says: so does zerod (each group's field
        # is set to it before registration).
        self._initial_accumulator_value = float(initial_accumulator_value)
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay,
                         optimizer="adagrad", lr_decay=lr_decay,
                         initial_accumulator_value=initial_accumulator_value, maximize=maximize,
                         foreach=foreach, differentiable=differentiable, **kwargs)

    @staticmethod
    def _check_hparams(g: Mapping[str, Any], where: str) -> None:
        ZeroOptimizer._check_hparams(g, where)
        for key in ("lr_decay", "initial_accumulator_value"):
            v = g.get(key, 0.0)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{where}: invalid {key} value: {v!r}")

    def _choose_formulas(self, cuda: bool) -> None:
        """torch.sqrt's mode as for AdamW; the update field is bookkeeping (one formula)."""
        _refuse_cuda(cuda, "ZeroAdagrad")
        for g in self.param_groups:
            g["initial_accumulator_value"] = self._initial_accumulator_value
        super()._choose_formulas(cuda)


_register(_Row("adagrad", _torch_optim("Adagrad"), ("sum",), step=True,
               fill={"sum": "initial_accumulator_value"}))


class ZeroRMSprop(ZeroOptimizer):
    """torch.optim.RMSprop through zerod (kernels/rmsprop.c): lr, alpha, eps, weight_decay,
    momentum, centered and maximize as torch takes them, per parameter group too. The centered
    average follows the running torch (1.13: multiply-add; 2.x: lerp), the sqrt torch.sqrt's
    (sqrt_mode, as for AdamW). A model keeps momentum_buffer and grad_avg when a group has
    momentum or centered at construction (turning them on later is refused, as torch, whose state
    lacks them, fails). The other keywords are ZeroOptimizer's; foreach is accepted (the same bits
    on CPU); capturable and differentiable are refused."""

    _FOREIGN = frozenset({"dampening", "nesterov", "lr_decay", "initial_accumulator_value"})

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, alpha: float = 0.99,
                 eps: float = 1e-8, weight_decay: float = 0.0, momentum: float = 0.0,
                 centered: bool = False, capturable: bool = False, foreach: Any = None,
                 maximize: bool = False, differentiable: bool = False, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay,
                         optimizer="rmsprop", alpha=alpha, momentum=momentum,
                         centered=bool(centered), maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, **kwargs)

    @staticmethod
    def _check_hparams(g: Mapping[str, Any], where: str) -> None:
        ZeroOptimizer._check_hparams(g, where)
        for key in ("alpha", "momentum"):
            v = g.get(key, 0.0)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{where}: invalid {key} value: {v!r}")

    def _choose_formulas(self, cuda: bool) -> None:
        _refuse_cuda(cuda, "ZeroRMSprop")
        super()._choose_formulas(cuda)


_register(_Row("rmsprop", _torch_optim("RMSprop"),
               ("square_avg", ("momentum_buffer", "momentum"), ("grad_avg", "centered")),
               step=True))


def _lion_class() -> Any:
    from lion_pytorch import Lion  # PyPI lion-pytorch (needed for export and import only)

    return Lion


class ZeroLion(ZeroOptimizer):
    """lion_pytorch.Lion (PyPI lion-pytorch) through zerod (kernels/lion.c): lr, betas and
    weight_decay as its constructor takes them, per parameter group too; the state exp_avg,
    created zeroed at the first step as Lion creates it. Bit for bit Lion's default update (not
    the triton one, use_triton=True is refused, as is decoupled_weight_decay=True). The other
    keywords are ZeroOptimizer's (max_grad_norm, loss_scaler, grad_mean, overlap, socket, ...);
    Lion has no maximize, eps, amsgrad or foreach. lion-pytorch itself is needed only to export
    to or import from a Lion (zerod.checkpoint)."""

    _FOREIGN = ZeroOptimizer._FOREIGN | {"amsgrad", "maximize", "foreach", "fused",
                                         "capturable", "differentiable"}

    def __init__(self, params: Iterable[Any], lr: float = 1e-4,
                 betas: Tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                 use_triton: bool = False, decoupled_weight_decay: bool = False,
                 **kwargs: Any) -> None:
        if use_triton:
            raise ValueError("ZeroLion: use_triton=True is not supported (zerod reproduces "
                             "lion-pytorch's default update); leave it unset")
        if decoupled_weight_decay:
            raise ValueError("ZeroLion: decoupled_weight_decay=True is not supported yet; "
                             "divide weight_decay by lr yourself")
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay,
                         optimizer="lion", **kwargs)

    def _choose_formulas(self, cuda: bool) -> None:
        """Lion's formula is one (kernels/lion.c): update and sqrt_mode are bookkeeping."""
        _refuse_cuda(cuda, "ZeroLion")
        for g in self.param_groups:
            if g.get("update") is None:
                g["update"] = "torch2" if _torch_major() >= 2 else "torch113"
            if g.get("sqrt_mode") is None:
                g["sqrt_mode"] = "exact"


_register(_Row("lion", _lion_class, ("exp_avg",), step=False))
