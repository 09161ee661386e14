"""Moving optimizer state between zerod and plain torch: out of a checkpoint into a
``torch.optim.AdamW`` state_dict, and from a torch optimizer into a checkpoint zerod resumes.

Out::

    state = zerod.checkpoint.torch_state_dict(ckpt_dir, model.named_parameters())
    state.load_params(model.named_parameters())       # the fp32 master weights
    opt = torch.optim.AdamW(groups_as_registered, ...)  # same groups, same order
    opt.load_state_dict(state.state_dict)

In::

    zerod.checkpoint.save_torch_state(opt, model.named_parameters(), "state.safetensors")
    ckpt = zerod.checkpoint.import_checkpoint("state.safetensors", "/ckpt")  # zeroctl import
    # zerod --resume <ckpt>; the trainer builds its ZeroOptimizer with the same groups and
    # names, registers, and continues at the torch optimizer's step.

Both directions go through one file format, safetensors by its definition (an 8-byte
little-endian header length, a JSON header, raw little-endian data): an F32 tensor per parameter
name holding its master weights and "<name>.<array>" for each state array the model's optimizer
keeps (zerod's state arrays by torch's names, common/state.h, for every parameter or none: AdamW's
"exp_avg" and "exp_avg_sq", and "max_exp_avg_sq" with amsgrad; SGD's "momentum_buffer" with
momentum, none without; Adagrad's "sum"; ...: the rows of zerod.optim.TABLE), and metadata strings: zerod_format ("zerod-export" from ``zeroctl export``, "zerod-torch-state" from
save_torch_state), zerod_version "1", step, the groups (JSON, zerod's fields by their C names),
each parameter's group and, in save_torch_state's files, the parameter names in registration
order. Any safetensors reader opens these files; this module reads and writes them with the
standard library and torch (or NumPy) only.

A checkpoint directory is turned into such a file by ``zeroctl export --moments`` ($ZEROCTL_BIN,
else zeroctl on PATH) in a temporary directory, rather than by reading the rank files here: where
each element of a parameter lies in the rank files follows the layout rule (buckets, padding,
each rank's slice of every bucket) at the world and bucket size the checkpoint was written with,
and zeroctl applies it with the code zerod resumes with, after checking every file's checksum. A
second implementation here could drift from it without any test noticing until a resharded
checkpoint came out wrong. The cost is a temporary file of 4 bytes per parameter element and state
array (12 for AdamW).

What carries over, for every optimizer of zerod.optim.TABLE (its row names the torch class, the
state arrays by torch's names and which groups keep each, whether torch counts steps): the step
(torch's per-parameter ``step``, stored as the running torch stores it: a float tensor in 1.12
and later; torch's SGD and lion-pytorch's Lion count none: save_torch_state takes the step), the
state arrays, the master weights and the groups' hyperparameters. Bitwise continuation
needs the same update formula on both sides: zerod's default is torch 1.13's. Parameters at
different steps (one that got no gradient for a while, which torch skips) carry over: the file's
step is the largest, and its metadata "steps_behind" lists each parameter's steps behind it (a
parameter never stepped has no state in torch's state_dict, unless its class creates the state at
construction: Adagrad's sum = initial_accumulator_value, the row's fill). Refused: torch
optimizers without a row (torch.optim.Adam is zerod's "adam": L2 weight decay).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple, Union

__all__ = ["Export", "TorchState", "import_checkpoint", "load_export", "save_torch_state",
           "torch_state_dict"]

EXPORT_FORMAT = "zerod-export"
TORCH_STATE_FORMAT = "zerod-torch-state"
_MAX_HEADER = 1 << 31

NamedParams = Union[Mapping[str, Any], Iterable[Tuple[str, Any]]]


@dataclass
class Export:
    """A zerod state file, read (load_export).

    step: the Adam steps applied. names: the parameters in zerod's registration order.
    param_groups: each parameter's group (index into groups), in that order. groups: zerod's
    groups, each a dict of zd_group_t's fields by their C names (lr, beta1, beta2, eps,
    weight_decay, optimizer as zerod's enum value, maximize as a bool, ...). master, exp_avg,
    exp_avg_sq: the tensors by parameter name (NumPy arrays or torch tensors, per
    load_export's framework); the moments are empty for an export written without --moments.
    state: every state array the file holds by torch's name (exp_avg, momentum_buffer, sum, ...),
    each by parameter name; the fields of the same names (exp_avg, exp_avg_sq, max_exp_avg_sq,
    momentum_buffer, sum, square_avg, grad_avg) are the same dicts, empty for an array the file
    lacks. metadata: the file's metadata strings as they are.
    """

    step: int
    steps_skipped: int
    names: List[str]
    param_groups: List[int]
    groups: List[Dict[str, Any]]
    master: Dict[str, Any]
    exp_avg: Dict[str, Any] = field(default_factory=dict)
    exp_avg_sq: Dict[str, Any] = field(default_factory=dict)
    max_exp_avg_sq: Dict[str, Any] = field(default_factory=dict)  # amsgrad's; empty without
    momentum_buffer: Dict[str, Any] = field(default_factory=dict)  # SGD's; empty without
    sum: Dict[str, Any] = field(default_factory=dict)  # Adagrad's; empty without
    square_avg: Dict[str, Any] = field(default_factory=dict)  # RMSprop's; empty without
    grad_avg: Dict[str, Any] = field(default_factory=dict)  # RMSprop's centered; empty without
    metadata: Dict[str, str] = field(default_factory=dict)
    state: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    # Per parameter name, the steps that skipped it (it had no gradient: torch's .grad of None),
    # so that its own step count (torch's state['step']) is step - steps_behind; empty: every
    # parameter at step (the file's optional "steps_behind").
    steps_behind: Dict[str, int] = field(default_factory=dict)

    def param_step(self, name: str) -> int:
        """The steps applied to parameter `name`: torch's per-parameter state['step']."""
        return self.step - self.steps_behind.get(name, 0)

    @property
    def has_moments(self) -> bool:
        """Whether the file holds the optimizer's state: its arrays, or none because the model
        kept none (an SGD without momentum), which the metadata "moments" says."""
        return bool(self.state) or self.metadata.get("moments") == "1"


class TorchState(NamedTuple):
    """What torch_state_dict returns.

    state_dict: for ``optimizer_class(...).load_state_dict``: per parameter ``step``,
    ``exp_avg`` and ``exp_avg_sq``, and ``max_exp_avg_sq`` when the checkpoint has it (no
    state at all at step 0, as torch before its first step), and param_groups with the
    checkpoint's hyperparameters (amsgrad included) and the running torch's defaults for the
    rest (foreach, capturable, ...). Parameters are numbered group by group,
    each group's in zerod's registration order: build the torch optimizer with the groups the
    ZeroOptimizer had, in the same order.
    master: each parameter's fp32 master weights by name (load_params copies them into a model).
    step: the steps applied. optimizer_class: torch.optim.AdamW, torch.optim.Adam for zerod's
    "adam" groups, torch.optim.SGD for its "sgd" groups (state: momentum_buffer for the
    parameters of groups with momentum; for the others what this torch's SGD keeps).
    """

    state_dict: Dict[str, Any]
    master: Dict[str, Any]
    step: int
    optimizer_class: type

    def load_params(self, params: NamedParams) -> None:
        """Copies the master weights into the model's parameters of the same names (cast to
        each parameter's dtype and device). Raises ValueError for a name the checkpoint lacks
        or a shape that differs; parameters that do not require grad are left alone when the
        checkpoint does not hold them (zerod never held them)."""
        import torch

        with torch.no_grad():
            for name, p in _named(params):
                w = self.master.get(name)
                if w is None:
                    if p.requires_grad:
                        raise ValueError(f"parameter {name!r} is not in the checkpoint")
                    continue
                if tuple(w.shape) != tuple(p.shape):
                    raise ValueError(f"parameter {name!r}: shape {tuple(p.shape)} in the model, "
                                     f"{tuple(w.shape)} in the checkpoint")
                p.copy_(w)


def _named(params: NamedParams) -> List[Tuple[str, Any]]:
    if isinstance(params, Mapping):
        return list(params.items())
    out = []
    for item in params:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError("expected (name, parameter) pairs, as model.named_parameters() "
                            "yields, or a mapping of names to parameters")
        out.append(item)
    return out


def _check_host() -> None:
    if sys.byteorder != "little":  # the files hold little-endian floats, as zerod writes them
        raise RuntimeError("zerod state files are little-endian; this host is not")


# ---- reading ---------------------------------------------------------------------------------


def _json_meta(path: str, meta: Mapping[str, str], key: str) -> Any:
    try:
        return json.loads(meta[key])
    except KeyError:
        raise ValueError(f"{path}: metadata {key!r} is missing") from None
    except ValueError as e:
        raise ValueError(f"{path}: metadata {key!r} is not JSON: {e}") from None


def _int_meta(path: str, meta: Mapping[str, str], key: str, default: Optional[int] = None) -> int:
    v = meta.get(key)
    if v is None and default is not None:
        return default
    if v is None or not v.isdigit():
        raise ValueError(f"{path}: metadata {key!r} is {v!r}; expected a decimal integer")
    return int(v)


def load_export(path: str, *, framework: str = "np") -> Export:
    """Reads a zerod state file: ``zeroctl export`` output (with or without --moments) or
    save_torch_state's. framework "np" gives NumPy arrays, "pt" torch tensors (CPU, float32);
    either way each tensor is its own copy of the file's bytes.

    Raises ValueError naming the file and what is wrong (not safetensors, not a zerod state
    file, a tensor that is not F32 or lies outside the data, a parameter without its tensors)."""
    if framework not in ("np", "pt"):
        raise ValueError(f"framework {framework!r}; expected 'np' (NumPy) or 'pt' (torch)")
    _check_host()
    if framework == "np":
        import numpy as np
    else:
        import torch
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: the safetensors header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: the safetensors header is not a JSON object")
        meta = header.pop("__metadata__", None)
        if not isinstance(meta, dict):
            raise ValueError(f"{path}: no __metadata__: not a zerod state file")
        fmt = meta.get("zerod_format")
        if fmt not in (EXPORT_FORMAT, TORCH_STATE_FORMAT):
            raise ValueError(f"{path}: zerod_format is {fmt!r}; expected {EXPORT_FORMAT!r} or "
                             f"{TORCH_STATE_FORMAT!r}")
        if meta.get("zerod_version") != "1":
            raise ValueError(f"{path}: zerod_version {meta.get('zerod_version')!r}; this "
                             f"package reads '1'")
        data_start, data_bytes = 8 + n, size - 8 - n
        entries = []  # (begin, header order, name, shape, end)
        for k, (name, t) in enumerate(header.items()):
            shape, offs = t.get("shape"), t.get("data_offsets")
            ok = (t.get("dtype") == "F32" and isinstance(shape, list)
                  and all(isinstance(d, int) and d >= 0 for d in shape)
                  and isinstance(offs, list) and len(offs) == 2
                  and all(isinstance(o, int) for o in offs) and 0 <= offs[0] <= offs[1] <= data_bytes
                  and offs[1] - offs[0] == 4 * math.prod(shape))
            if not ok:
                raise ValueError(f"{path}: tensor {name!r} is not F32 within the "
                                 f"{data_bytes} bytes of data ({t!r})")
            entries.append((offs[0], k, name, tuple(shape), offs[1]))

        param_groups = _json_meta(path, meta, "param_groups")
        groups = _json_meta(path, meta, "groups")
        nparams = len(param_groups)
        if "params" in meta:
            names = _json_meta(path, meta, "params")
        else:  # an export: its master tensors come first in the data, in registration order
            names = [e[2] for e in sorted(entries)[:nparams]]
        if len(names) != nparams or len(set(names)) != nparams:
            raise ValueError(f"{path}: metadata 'params' does not name {nparams} distinct "
                             f"parameters")
        by_name = {e[2]: e for e in entries}
        # The state arrays: each other tensor is "<param>.<array>" (the longest parameter name
        # it extends), every parameter with the same arrays, in the order of the file's data.
        name_set, arrays = set(names), []
        for e in sorted(entries):
            t = e[2]
            if t in name_set:
                continue
            dots = [k for k, ch in enumerate(t) if ch == "."]
            owner = next((k for k in reversed(dots) if t[:k] in name_set), None)
            if owner is None:
                raise ValueError(f"{path}: tensor {t!r} is neither a parameter nor "
                                 f"'<parameter>.<state array>'")
            if t[owner + 1:] not in arrays:
                arrays.append(t[owner + 1:])
        if len(entries) != (1 + len(arrays)) * nparams:
            raise ValueError(f"{path}: {len(entries)} tensors for {nparams} parameters; expected "
                             f"1 per parameter and one more for each state array the file has "
                             f"({', '.join(arrays) or 'none'}), for every parameter")

        def read(name: str) -> Any:
            e = by_name.get(name)
            if e is None:
                raise ValueError(f"{path}: no tensor {name!r}")
            begin, _, _, shape, end = e
            buf = bytearray(end - begin)
            f.seek(data_start + begin)
            if f.readinto(buf) != len(buf):
                raise ValueError(f"{path}: ends inside tensor {name!r}")
            if framework == "np":
                return np.frombuffer(buf, dtype="<f4").reshape(shape)
            if not buf:  # torch.frombuffer refuses an empty buffer
                return torch.zeros(shape, dtype=torch.float32)
            return torch.frombuffer(buf, dtype=torch.float32).reshape(shape)

        out = Export(step=_int_meta(path, meta, "step"),
                     steps_skipped=_int_meta(path, meta, "steps_skipped", 0), names=list(names),
                     param_groups=[int(g) for g in param_groups], groups=groups,
                     master={name: read(name) for name in names}, metadata=dict(meta))
        if "steps_behind" in meta:
            behind = _json_meta(path, meta, "steps_behind")
            if (not isinstance(behind, list) or len(behind) != nparams
                    or not all(isinstance(b, int) and 0 <= b <= out.step for b in behind)):
                raise ValueError(f"{path}: metadata 'steps_behind' is not one count in "
                                 f"[0, {out.step}] per parameter")
            out.steps_behind = {n: int(b) for n, b in zip(names, behind) if b}
        for array in arrays:
            out.state[array] = {name: read(name + "." + array) for name in names}
            if array in _ARRAY_FIELDS:
                setattr(out, array, out.state[array])
            for name in names:
                if tuple(out.state[array][name].shape) != tuple(out.master[name].shape):
                    raise ValueError(f"{path}: the moments of {name!r} are not of its shape")
    return out


# The Export fields that name state arrays (Export.state holds every array by name).
_ARRAY_FIELDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum",
                 "square_avg", "grad_avg")


def _zeroctl(zeroctl: Optional[str]) -> str:
    path = zeroctl or os.environ.get("ZEROCTL_BIN") or shutil.which("zeroctl")
    if not path:
        raise FileNotFoundError("zeroctl not found: set $ZEROCTL_BIN or put zeroctl on PATH "
                                "(it ships with zerod)")
    return path


def _run_zeroctl(zeroctl: Optional[str], args: List[str]) -> str:
    exe = _zeroctl(zeroctl)
    proc = subprocess.run([exe] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{os.path.basename(exe)} {' '.join(args[:1])} failed "
                           f"(exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _step_as(sample: Any, step: int) -> Any:
    """`step` in the type of `sample` (_torch_step's): a parameter's own state['step']."""
    import torch

    if isinstance(sample, torch.Tensor):
        return torch.full_like(sample, float(step))
    return type(sample)(step)


def _torch_step(cls: type, step: int) -> Any:
    """The per-parameter step as this torch's optimizer stores it: the type (a tensor since
    1.12, an int before) taken from a throwaway step of a one-element optimizer, not from a
    version table."""
    import torch

    p = torch.zeros(1, requires_grad=True)
    opt = cls([p])
    p.grad = torch.zeros(1)
    opt.step()
    sample = opt.state[p]["step"]
    if isinstance(sample, torch.Tensor):
        return torch.full_like(sample, float(step))
    return type(sample)(step)


def _torch_empty_state(cls: type) -> Dict[str, Any]:
    """What this torch's optimizer keeps after a step for a parameter whose group keeps none of
    its arrays (SGD without momentum: 1.13 {"momentum_buffer": None}, 2.x nothing): the entries
    of None of a throwaway step at the class's defaults, not a version table."""
    import torch

    p = torch.zeros(1, requires_grad=True)
    opt = cls([p], lr=0.1)
    p.grad = torch.zeros(1)
    opt.step()
    return {k: v for k, v in opt.state.get(p, {}).items() if v is None}


def torch_state_dict(source: str, params: Optional[NamedParams] = None, *,
                     zeroctl: Optional[str] = None) -> TorchState:
    """A plain torch.optim.AdamW (or Adam) state_dict and the master weights, from a zerod
    checkpoint directory (exported through ``zeroctl export --moments``, module docstring) or
    from a file of load_export's formats holding the moments.

    params: the model's named parameters (model.named_parameters(), or a mapping), or None.
    When given, every parameter of the checkpoint must be there with its shape (ValueError
    otherwise): the check that the state is put back into the model it belongs to.

    Raises RuntimeError when zeroctl fails (an incomplete or corrupt checkpoint: its message
    says which file), ValueError for a file without moments, groups that mix "adamw" and "adam",
    or a zerod hyperparameter torch has no place for that is not at its default.
    """
    import torch

    from .client import Group

    if os.path.isdir(source):
        with tempfile.TemporaryDirectory(prefix="zerod-export-") as tmp:
            out = os.path.join(tmp, "export.safetensors")
            _run_zeroctl(zeroctl, ["export", source, "--out", out, "--moments"])
            exp = load_export(out, framework="pt")
    else:
        exp = load_export(source, framework="pt")
    if not exp.has_moments:
        raise ValueError(f"{source}: no moments (export with zeroctl export --moments)")
    if params is not None:
        model = {name: p for name, p in _named(params)}
        for name in exp.names:
            p = model.get(name)
            if p is None:
                raise ValueError(f"{source}: parameter {name!r} is not in the model")
            if tuple(p.shape) != tuple(exp.master[name].shape):
                raise ValueError(f"{source}: parameter {name!r} has shape "
                                 f"{tuple(exp.master[name].shape)}; the model's is "
                                 f"{tuple(p.shape)}")

    zgroups = [Group(**g) for g in exp.groups]
    kinds = {g.optimizer for g in zgroups}
    if len(kinds) != 1:
        raise ValueError(f"{source}: groups of both {sorted(kinds)}: one torch optimizer "
                         f"cannot hold them")
    kind = kinds.pop()
    row = _optim_rows().get(kind)
    if row is None:
        raise ValueError(f"{source}: optimizer {kind!r} has no row in zerod.optim.TABLE")
    cls = row.torch_class()
    defaults = cls([torch.zeros(1, requires_grad=True)], lr=1e-3).defaults  # 1.13 SGD needs lr
    zdefaults = Group().to_dict()
    param_groups = []
    for gi, g in enumerate(zgroups):
        pg = dict(defaults)
        for key, value in g.to_dict().items():
            # update and sqrt_mode say which torch's arithmetic zerod followed; the state they
            # leave means the same to every torch, which then steps with its own arithmetic.
            if key in ("optimizer", "update", "sqrt_mode"):
                continue
            if key in pg:
                pg[key] = tuple(value) if key == "betas" else value
            elif value != zdefaults[key]:
                raise ValueError(f"{source}: group {gi} has {key}={value!r}, which "
                                 f"torch.optim.{cls.__name__} has no place for")
        pg["params"] = []
        param_groups.append(pg)
    order = []  # parameter names, group by group: torch numbers them so
    for gi, pg in enumerate(param_groups):
        for name, g in zip(exp.names, exp.param_groups):
            if g == gi:
                pg["params"].append(len(order))
                order.append(name)
    # The row's arrays by torch's names, for the parameters of the groups that keep each, and
    # its step if torch counts one; torch has no state for a parameter before its first step
    # unless its class creates the state at construction (the row's fill).
    state: Dict[int, Dict[str, Any]] = {}
    step = _torch_step(cls, exp.step) if row.step and (exp.step > 0 or row.fill) else None
    empty = None  # what this torch keeps for a parameter none of whose arrays its group keeps
    for gi, pg in enumerate(param_groups):
        for i in pg["params"]:
            name = order[i]
            n = exp.param_step(name) if row.step else exp.step
            if n == 0 and not row.fill:
                continue
            st: Dict[str, Any] = {} if step is None else {"step": _step_as(step, n)}
            for array, _ in row.arrays:
                if not row.keeps(array, pg):
                    continue
                if n == 0:  # a row with fill: the state torch made at construction
                    if array in row.fill:
                        st[array] = torch.full_like(exp.master[name], pg[row.fill[array]])
                elif array in exp.state:
                    st[array] = exp.state[array][name]
            if not st:
                empty = _torch_empty_state(cls) if empty is None else empty
                st = dict(empty)
            if st:
                state[i] = st
    return TorchState(state_dict={"state": state, "param_groups": param_groups},
                      master=dict(exp.master), step=exp.step, optimizer_class=cls)


# ---- writing ---------------------------------------------------------------------------------


def _optim_rows() -> Dict[str, Any]:
    """zerod.optim's table (kind -> row): the optimizers whose export and import are their row."""
    from . import torch as _zerod_torch  # noqa: F401  (first: it imports zerod.optim at its end)
    from . import optim

    return optim.TABLE


def _optim_row_of(optimizer: Any) -> Any:
    """The row whose torch class `optimizer` is an instance of, or None."""
    for row in _optim_rows().values():
        try:
            cls = row.torch_class()
        except ImportError:  # its package is not installed: optimizer is not one of its
            continue
        if isinstance(optimizer, cls):
            return row
    return None


def _c_group(group: Any) -> Dict[str, Any]:
    """A Group's fields by their C names and JSON kinds, as zerod's manifest writes them."""
    from . import _lib

    c = _lib.zd_group_t()
    group._to_c(c)  # the package's one conversion from torch names to zd_group_t
    out: Dict[str, Any] = {}
    for f in _lib.group_fields():
        v = getattr(c, f.name)
        out[f.name] = (float(v) if f.kind == _lib.ZD_FIELD_DOUBLE
                       else bool(v) if f.kind == _lib.ZD_FIELD_BOOL else int(v))
    return out


def _tensor_bytes(t: Any) -> bytes:
    import ctypes

    import torch

    t = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
    n = t.numel() * 4
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def save_torch_state(optimizer: Any, named_params: Optional[NamedParams], path: str, *,
                     step: Optional[int] = None) -> None:
    """Writes a torch optimizer's state, with its parameters as the master weights, to `path`
    for ``zeroctl import`` (module docstring: the format).

    optimizer: an instance of a torch class of zerod.optim.TABLE. named_params: the names of
    its parameters (model.named_parameters(), or a mapping), which zerod's registration must
    use too; None names them "param<i>", as ZeroOptimizer does for unnamed parameters.
    Parameters are taken group by group in the optimizer's order, skipping those that do not
    require grad: the order and groups in which a ZeroOptimizer built with the same groups
    registers them. Values are converted to float32 (exact from bfloat16 and float16).
    The file is written under a temporary name and renamed into place.

    With amsgrad in some group, every parameter's max_exp_avg_sq is written too (zeros for a
    parameter whose state lacks it, as torch starts it), so that zerod's model, which keeps the
    array for all parameters, resumes from it.

    torch.optim.SGD keeps no step count: its state is written at `step` (default: 1 when some
    parameter has a momentum buffer, else 0), which only has to be above 0 where buffers exist
    (zerod creates the buffer from the gradient at its step 1, as torch does when it has none);
    zeros stand for a missing buffer in a group with momentum. Only the arrays the zerod model
    will hold are written (the row's, for the groups that keep them): none for an SGD without
    momentum.

    Parameters at different steps (torch skips one without a gradient) are written with the
    largest step and each one's steps behind it (metadata "steps_behind").

    Raises TypeError for another optimizer, ValueError for an unnamed parameter or a
    hyperparameter zerod does not take.
    """
    import torch

    from .client import Group

    row = _optim_row_of(optimizer)
    if row is None:
        raise TypeError(f"{type(optimizer).__name__}: zerod imports the state of the torch "
                        f"optimizers of its table ("
                        f"{', '.join(r.torch_class_name() for r in _optim_rows().values())}; a "
                        f"ZeroOptimizer's state is in zerod already: use its checkpoint())")
    kind = row.kind
    _check_host()
    names_by_id = None
    if named_params is not None:
        names_by_id = {id(p): name for name, p in _named(named_params)}
    names: List[str] = []
    pgroups: List[int] = []
    groups: List[Dict[str, Any]] = []
    arrays = row.model_arrays(optimizer.param_groups)  # what the zerod model will hold
    tensors: List[List[Any]] = [[] for _ in range(1 + len(arrays))]  # master, then each array
    steps = {}
    has_state = False
    index = 0
    for gi, g in enumerate(optimizer.param_groups):
        hp = {k: v for k, v in g.items() if k != "params"}
        # torch >= 2.7's Adam(decoupled_weight_decay=True) is AdamW.
        hp["optimizer"] = "adamw" if kind == "adam" and g.get("decoupled_weight_decay") else kind
        try:
            groups.append(_c_group(Group.coerce(hp)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"param group {gi}: {e}") from None
        for p in g["params"]:
            i, index = index, index + 1
            if not p.requires_grad:
                continue
            name = f"param{i}" if names_by_id is None else names_by_id.get(id(p))
            if name is None:
                raise ValueError(f"param group {gi}: parameter {i} (shape {tuple(p.shape)}) is "
                                 f"not among named_params")
            st = optimizer.state.get(p, {})
            if row.step:
                s = st.get("step", 0)
                steps[name] = int(s.item() if isinstance(s, torch.Tensor) else s)
            has_state = has_state or any(st.get(a) is not None for a in arrays)
            # zeros for an array the parameter's state lacks: torch starts every array but
            # Adagrad's sum (in its state from construction) at zeros
            zeros = torch.zeros_like(p, dtype=torch.float32)
            moments = [zeros if st.get(a) is None else st[a] for a in arrays]
            if any(tuple(m.shape) != tuple(p.shape) for m in moments):
                raise ValueError(f"the moments of {name!r} are not of its shape")
            names.append(name)
            pgroups.append(gi)
            for t, v in enumerate([p] + moments):
                tensors[t].append(v)
    if not names:
        raise ValueError("the optimizer holds no parameter that requires grad")
    if len(set(names)) != len(names):
        raise ValueError("two parameters have the same name")
    if not row.step:
        steps = {name: (1 if has_state else 0) if step is None else int(step) for name in names}
    # Parameters at different steps (some got no gradient in some steps, which torch skips):
    # the model's step is the largest, and each parameter's own is carried as its steps behind.
    step = max(steps.values())
    behind = [step - steps[name] for name in names]

    header: Dict[str, Any] = {"__metadata__": {
        "format": "pt", "zerod_format": TORCH_STATE_FORMAT, "zerod_version": "1",
        "step": str(step), "steps_skipped": "0", "moments": "1",
        "params": json.dumps(names), "param_groups": json.dumps(pgroups),
        "groups": json.dumps(groups), "optimizer": type(optimizer).__name__,
        "torch_version": str(torch.__version__)}}
    if any(behind):
        header["__metadata__"]["steps_behind"] = json.dumps(behind)
    off = 0
    suffixes = [""] + ["." + a for a in arrays]
    for t, suffix in enumerate(suffixes):
        for name, v in zip(names, tensors[t]):
            nbytes = 4 * v.numel()
            header[name + suffix] = {"dtype": "F32", "shape": list(v.shape),
                                     "data_offsets": [off, off + nbytes]}
            off += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for t in range(len(suffixes)):
                for v in tensors[t]:
                    f.write(_tensor_bytes(v))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def import_checkpoint(path: str, root: str, *, zeroctl: Optional[str] = None) -> str:
    """Runs ``zeroctl import path --out root``: the file (save_torch_state's, or an export with
    moments) becomes a complete checkpoint under root, of world size 1, which a zerod of any
    world size resumes (``zerod --resume DIR``). Returns its directory. Raises RuntimeError with
    zeroctl's message when the import fails."""
    out = _run_zeroctl(zeroctl, ["import", path, "--out", root])
    prefix = "resume it with: zerod --resume "
    for line in out.splitlines():
        if line.startswith(prefix):
            return line[len(prefix):]
    raise RuntimeError(f"zeroctl import printed no directory: {out.strip()}")
