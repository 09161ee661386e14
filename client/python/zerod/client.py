"""The core client: one connection to one rank of a zerod daemon.

`Client` wraps libzerod's C API (zerod/zerod.h) one to one, in Python types: connect, lay the
model out, register it, use the two shared buffers, step (or scatter, step, gather separately, and
pipelined), read the status, close. It needs nothing but the standard library; the PyTorch
optimizer in `zerod.torch` is built on it.

The buffers are host shared memory (zerod's CPU backend: `param_array()`, `param_buffer`) or,
with ``layout(..., memory="cuda")``, device memory on the rank's GPU shared with zerod through
CUDA IPC (zerod's CUDA backend): `param_device_array()` then describes it by
``__cuda_array_interface__`` for torch.as_tensor, CuPy or Numba, and `set_stream()` names the
CUDA stream on which the trainer writes gradients and reads parameters (libzerod orders it with
zerod's stream through IPC events, without host synchronisation).

Every failing call raises `ZerodError` with the library's error code, its symbolic name
("ZD_EBUFFER", "ECONNREFUSED") and the detailed message the daemon or the library formatted where
the error was found.

Threading: a Client may be used from several threads; calls are serialised by a lock (the C
client is not thread-safe). Blocking calls release the GIL while they wait for zerod.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _lib
from ._lib import (
    ZD_ALL_BUCKETS,
    ZD_ANY_RANK,
    ZD_MAX_DIMS,
    ZD_REGISTER_REPLACE,
    ZD_STEP_NO_GATHER,
    ZD_STEP_NO_SCATTER,
)

__all__ = [
    "ALL_BUCKETS",
    "ANY_RANK",
    "BucketInfo",
    "Client",
    "DType",
    "DeviceArray",
    "Group",
    "Info",
    "LossScaler",
    "Param",
    "ParamInfo",
    "Request",
    "StepResult",
    "ZerodError",
    "connect",
    "dtype_of",
    "parse_status",
]

ALL_BUCKETS = ZD_ALL_BUCKETS
ANY_RANK = ZD_ANY_RANK


class ZerodError(Exception):
    """A libzerod call failed.

    Attributes:
        code: the error code (negative: zerod's own codes are below -4000, system errors are
            negated errno values).
        name: its symbolic name, as zd_err_name() gives it ("ZD_EBUFFER", "ECONNREFUSED").
        message: the detailed message (zd_last_error()): what was wrong and what was expected.
        call: the C function that failed ("zd_register").
    """

    def __init__(self, code: int, name: str, message: str, call: str = "") -> None:
        self.code = code
        self.name = name
        self.message = message
        self.call = call
        where = f"{call}: " if call else ""
        super().__init__(f"{where}{name} ({code}): {message}")

    @property
    def description(self) -> str:
        """The generic description of the code (zd_strerror())."""
        return _lib.lib().zd_strerror(self.code).decode(errors="replace")

    @property
    def retryable(self) -> bool:
        """Whether the same call may simply be made again: ZD_EABORTED, a step that another
        rank's trainer left in the middle of. No rank applied it and the gradients are still in
        the grad buffer; scatter every bucket again and step (zerod.torch.ZeroOptimizer does)."""
        return self.code == _lib.ZD_EABORTED


def _error(code: int, call: str) -> ZerodError:
    lib = _lib.lib()
    name = lib.zd_err_name(code).decode(errors="replace")
    msg = (lib.zd_last_error() or b"").decode(errors="replace")
    if not msg:
        msg = lib.zd_strerror(code).decode(errors="replace")
    return ZerodError(code, name, msg, call)


def _check(code: int, call: str) -> None:
    if code != 0:
        raise _error(code, call)


class DType:
    """Element types of the shared buffers (zd_dtype_t)."""

    F32 = _lib.ZD_F32
    BF16 = _lib.ZD_BF16
    F16 = _lib.ZD_F16

    NAMES = {F32: "f32", BF16: "bf16", F16: "f16"}
    SIZES = {F32: 4, BF16: 2, F16: 2}
    # memoryview formats: bf16 has none and memoryview.cast() cannot make f16 ("e"), so 16-bit
    # elements show as uint16 bit patterns.
    FORMATS = {F32: "f", BF16: "H", F16: "H"}


_DTYPE_ALIASES = {
    "f32": DType.F32, "fp32": DType.F32, "float32": DType.F32, "float": DType.F32,
    "bf16": DType.BF16, "bfloat16": DType.BF16,
    "f16": DType.F16, "fp16": DType.F16, "float16": DType.F16, "half": DType.F16,
}


def dtype_of(value: Any) -> int:
    """Converts a dtype given as a DType value, a name ("f32", "bf16", "fp16", "float32") or a
    torch dtype (torch.float32, torch.bfloat16, torch.float16) to a zd_dtype_t value."""
    if isinstance(value, int) and value in DType.NAMES:
        return value
    text = str(value).lower()
    if text.startswith("torch."):
        text = text[len("torch."):]
    if text in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[text]
    raise ValueError(f"unsupported dtype {value!r}; expected f32, bf16 or f16")


# Where the Python spelling of a zd_group_t field differs from its C name: torch's pairs (betas
# for beta1 and beta2) and the names of enum values. Every other field is passed by its C name, as
# a float or, for a boolean field, a bool.
_PAIRS = {"betas": ("beta1", "beta2")}
_ENUMS = {"optimizer": {"adamw": _lib.ZD_ADAMW, "adam": _lib.ZD_ADAM, "sgd": _lib.ZD_SGD,
                        "adagrad": _lib.ZD_ADAGRAD, "rmsprop": _lib.ZD_RMSPROP},
          "update": {"torch113": _lib.ZD_UPDATE_TORCH113, "torch2": _lib.ZD_UPDATE_TORCH2,
                     "torch2_cuda": _lib.ZD_UPDATE_TORCH2_CUDA,
                     "torch2_cuda_foreach": _lib.ZD_UPDATE_TORCH2_CUDA_FOREACH,
                     "torch2_cuda_fused": _lib.ZD_UPDATE_TORCH2_CUDA_FUSED},
          "sqrt_mode": {"exact": _lib.ZD_SQRT_EXACT, "mkl_ex": _lib.ZD_SQRT_MKL_EX}}


# zd_clip_norm_t by name: the norm a step clips by (zerod's double norm, or a torch build's fp32 one).
CLIP_NORMS = {"double": _lib.ZD_CLIP_NORM_DOUBLE, "torch113": _lib.ZD_CLIP_NORM_TORCH113,
              "torch26": _lib.ZD_CLIP_NORM_TORCH26, "torch215": _lib.ZD_CLIP_NORM_TORCH215}


class Group:
    """Hyperparameters of one parameter group (zd_group_t).

    Its fields are zd_group_t's as libzerod describes them (zd_group_fields): lr, beta1, beta2,
    eps, weight_decay, optimizer, maximize, and whichever zerod adds later, with no change to this
    package. Keywords and attributes name them as torch.optim.AdamW does: ``betas=(beta1, beta2)``
    (beta1 and beta2 work too); optimizer is "adamw" (decoupled weight decay,
    torch.optim.AdamW) or "adam" (L2 penalty added to the gradient, torch.optim.Adam); a boolean
    field takes a bool. Fields not given keep zerod's defaults (zd_group_init():
    torch.optim.AdamW's).

    Raises:
        TypeError: a keyword that names no field of zd_group_t.
        ValueError: a value the field cannot take (an unknown optimizer, betas not a pair).
    """

    def __init__(self, **hparams: Any) -> None:
        fields = {f.name: f for f in _lib.group_fields()}
        object.__setattr__(self, "_fields", fields)
        object.__setattr__(self, "_values", {})
        for f in fields.values():  # zerod's defaults
            setattr(self, f.name, int(f.default) if f.kind != _lib.ZD_FIELD_DOUBLE else f.default)
        for key, value in hparams.items():
            setattr(self, key, value)

    @staticmethod
    def names() -> List[str]:
        """The keywords a Group takes, as torch spells them (betas for beta1 and beta2), in
        zd_group_t's order."""
        out: List[str] = []
        for f in _lib.group_fields():
            pair = next((p for p, members in _PAIRS.items() if f.name in members), None)
            if pair is None:
                out.append(f.name)
            elif pair not in out:
                out.append(pair)
        return out

    def __setattr__(self, key: str, value: Any) -> None:
        if key in _PAIRS:
            members = _PAIRS[key]
            value = tuple(value)
            if len(value) != len(members):
                raise ValueError(f"{key} is {value!r}; expected {len(members)} values")
            for name, v in zip(members, value):
                setattr(self, name, v)
            return
        f = self._fields.get(key)
        if f is None:
            raise TypeError(f"{key!r} is not a hyperparameter of zerod's groups; expected one of "
                            f"{', '.join(self.names())}")
        if f.kind == _lib.ZD_FIELD_DOUBLE:
            value = float(value)
        elif f.kind == _lib.ZD_FIELD_BOOL:
            if value not in (0, 1):
                raise ValueError(f"{key} is {value!r}; expected True or False")
            value = bool(value)
        elif key in _ENUMS:  # by name, or by value
            if isinstance(value, int):
                value = _enum_name(key, value)
            if str(value).lower() not in _ENUMS[key]:
                raise ValueError(f"{key} {value!r} is not supported; expected "
                                 f"{' or '.join(repr(n) for n in _ENUMS[key])}")
            value = str(value).lower()
        else:
            value = int(value)
        self._values[key] = value

    def __getattr__(self, key: str) -> Any:
        values = self.__dict__.get("_values")
        if values is not None:
            if key in _PAIRS:
                return tuple(values[name] for name in _PAIRS[key])
            if key in values:
                return values[key]
        raise AttributeError(f"'Group' object has no attribute {key!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Group) and other._values == self._values

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return "Group(" + ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items()) + ")"

    def to_dict(self) -> Dict[str, Any]:
        """The fields by the names of `names()`, as a torch parameter group holds them."""
        return {name: getattr(self, name) for name in self.names()}

    def _to_c(self, out: _lib.zd_group_t) -> None:
        for name, f in self._fields.items():
            value = self._values[name]
            if f.kind == _lib.ZD_FIELD_DOUBLE:
                setattr(out, name, value)
            elif f.kind == _lib.ZD_FIELD_BOOL:
                setattr(out, name, int(value))
            else:
                setattr(out, name, _ENUMS[name][value] if name in _ENUMS else int(value))

    @classmethod
    def coerce(cls, g: Union["Group", Mapping[str, Any]]) -> "Group":
        """A Group from a Group or a dict (a torch parameter group): every field of `names()`
        found in it by name (beta1/beta2 too); other keys are ignored."""
        if isinstance(g, Group):
            return g
        known = set(cls.names()) | {f.name for f in _lib.group_fields()}
        return cls(**{k: v for k, v in g.items() if k in known})


def _enum_name(field: str, value: int) -> Any:
    """The name of an enum field's value ("adamw"), or the value when it has none here."""
    for name, v in _ENUMS.get(field, {}).items():
        if v == value:
            return name
    return value


@dataclass
class Param:
    """One parameter of the model, in registration order (zd_param_t). name: unique, at most
    255 bytes; shape: at most 8 dimensions (() for a scalar); group: index into the groups."""

    name: str
    shape: Tuple[int, ...]
    group: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n


@dataclass
class LossScaler:
    """Dynamic loss scaling for fp16 gradients (zd_loss_scaler_t, Megatron/DeepSpeed semantics):
    the trainer multiplies its loss by the current scale; zerod unscales, skips the step on
    overflow and backs the scale off by backoff_factor once `hysteresis` overflows were seen (not
    below min_scale); after growth_interval clean steps in a row it grows by growth_factor."""

    initial_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0

    @classmethod
    def coerce(cls, s: Union["LossScaler", Mapping[str, Any], bool, None]) -> Optional["LossScaler"]:
        """None/False: disabled; True: the defaults; a dict: those fields."""
        if s is None or s is False:
            return None
        if s is True:
            return cls()
        if isinstance(s, LossScaler):
            return s
        return cls(**dict(s))


@dataclass
class Info:
    """What the daemon said at connect and register (zd_info_t)."""

    protocol_version: int
    world_size: int
    rank: int
    local_rank: int
    bucket_elems: int
    backend: str
    daemon_version: str
    step: int
    resumed: bool
    layout_hash: int
    total_elems: int
    nbuckets: int
    loss_scale: float


@dataclass
class ParamInfo:
    """Where a parameter lives in the flat buffers (element offsets)."""

    index: int
    name: str
    offset: int
    numel: int
    bucket: int
    group: int


@dataclass
class BucketInfo:
    """Element range of a bucket in the flat buffers and this rank's slice of it."""

    index: int
    offset: int
    elems: int
    shard_offset: int
    shard_elems: int


@dataclass
class StepResult:
    """Outcome of a step (zd_step_result_t)."""

    step: int  # steps applied after this one
    applied: bool  # False when skipped because of an overflow (loss scaling)
    grad_norm: float  # global L2 norm of the unscaled, reduced gradient (nan if not computed)
    loss_scale: float  # scale for the next step's loss
    clip_coef: float  # factor clipping applied to the gradient (1.0: none)
    duration_us: int  # time zerod spent on the step

    @classmethod
    def _from_c(cls, r: _lib.zd_step_result_t) -> "StepResult":
        return cls(int(r.step), bool(r.applied), float(r.grad_norm), float(r.loss_scale),
                   float(r.clip_coef), int(r.duration_us))


class Request:
    """A pipelined request (scatter_start, gather_start, step_start). Wait for it exactly once,
    with `wait()` or `Client.wait()`; requests run in the order they were sent."""

    __slots__ = ("_client", "id", "kind", "_done", "_result", "_error")

    def __init__(self, client: "Client", req_id: int, kind: str) -> None:
        self._client = client
        self.id = req_id
        self.kind = kind  # "scatter", "gather" or "step"
        self._done = False
        self._result: Optional[StepResult] = None
        self._error: Optional[BaseException] = None

    @property
    def done(self) -> bool:
        """Whether the request was waited for."""
        return self._done

    def wait(self, *, stream: Optional[int] = None) -> Optional[StepResult]:
        """Blocks until zerod answered; returns the StepResult of a step request, None for the
        others; raises ZerodError with the request's own error. stream: as Client.wait()."""
        return self._client.wait(self, stream=stream)

    def __repr__(self) -> str:
        return f"<zerod.Request {self.kind} id={self.id}{' done' if self._done else ''}>"


def _shared_array(address: int, nbytes: int, owner: "Client") -> ctypes.Array:
    """A ctypes char array over shared memory that holds its Client: a view made from it
    (memoryview, torch.frombuffer, numpy) keeps the Client, and thus the mapping, from being
    garbage-collected while the view is alive."""
    cls = type("zerod_buffer", (ctypes.c_char * nbytes,), {})  # a subclass has a __dict__
    arr = cls.from_address(address)
    arr._zerod_client = owner
    return arr


class DeviceArray:
    """One of a Client's device buffers, described by ``__cuda_array_interface__`` (version 2),
    so that ``torch.as_tensor(arr, device="cuda:N")``, ``cupy.asarray(arr)`` or Numba wrap it
    without a copy. It holds its Client: a tensor made from it (torch keeps the object) keeps the
    Client, and thus the allocation, alive. bf16 has no array-interface type string: its elements
    are described as int16 (``typestr "<i2"``); view the result as bfloat16.
    """

    TYPESTRS = {DType.F32: "<f4", DType.BF16: "<i2", DType.F16: "<f2"}

    def __init__(self, address: int, count: int, dtype: int, owner: "Client") -> None:
        self.address = address
        self.count = count
        self.dtype = dtype
        self._zerod_client = owner
        self.__cuda_array_interface__ = {
            "shape": (count,),
            "typestr": self.TYPESTRS[dtype],
            "data": (address, False),
            "strides": None,
            "version": 2,
        }

    def __repr__(self) -> str:
        return (f"<zerod.DeviceArray {DType.NAMES[self.dtype]}[{self.count}] "
                f"at 0x{self.address:x}>")


def parse_status(text: str) -> Dict[str, Dict[str, str]]:
    """Parses zerod's status text ("# Section" lines, then "key:value" lines) into
    {section: {key: value}}. Values stay strings; keys carry their units (step_latency_us)."""
    out: Dict[str, Dict[str, str]] = {}
    section: Optional[Dict[str, str]] = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            section = out.setdefault(line[1:].strip(), {})
            continue
        key, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"status line {line!r} is neither '# Section' nor 'key:value'")
        if section is None:
            section = out.setdefault("", {})
        section[key.strip()] = value
    return out


ParamSpec = Union[Param, Tuple[str, Sequence[int]], Tuple[str, Sequence[int], int]]


class Client:
    """A connection to one rank of a zerod daemon (zd_client_t).

    Typical use::

        with zerod.Client(socket="/run/zerod/zerod.sock") as c:
            c.layout([("w", (256, 128)), ("b", (256,))], groups=[zerod.Group(lr=1e-3)])
            # write initial values into c.param_buffer, then:
            c.register()
            for batch in data:
                # write gradients into c.grad_buffer
                result = c.step()          # scatter + AdamW + gather

    Args:
        socket: the daemon's Unix socket; None for the default ($ZEROD_SOCKET, else
            $XDG_RUNTIME_DIR/zerod.sock, else /run/zerod/zerod.sock).
        local_rank: the rank within that daemon, or -1 for the first one with no client.
        timeout_ms: how long to wait for the daemon's hello (0: 30 s), and for a free
            connection while zerod is at max_clients (tried again with a short backoff; then
            ZD_EBUSY saying how long it waited).

    Raises:
        ZerodError: ECONNREFUSED/ENOENT (no daemon), ZD_EVERSION, ZD_EBUSY (rank taken),
            ZD_ERANK, ZD_EDENIED; ZD_EBUSY also when zerod stayed at max_clients for the whole
            timeout.
    """

    def __init__(self, socket: Optional[str] = None, local_rank: int = ANY_RANK,
                 timeout_ms: int = 0) -> None:
        self._lib = _lib.lib()
        self._lock = threading.RLock()
        self._handle: Optional[int] = None
        self._views: Dict[Tuple[str, bool], memoryview] = {}  # one view per buffer and kind
        self._params: List[Param] = []
        self._param_dtype = DType.F32
        self._grad_dtype = DType.F32
        self._registered = False
        self._memory = "host"
        handle = _lib.zd_client_p()
        path = socket.encode() if socket else None
        with self._lock:
            rc = self._lib.zd_connect(path, int(local_rank), int(timeout_ms), ctypes.byref(handle))
            if rc != 0:
                raise _error(rc, "zd_connect")
        self._handle = handle.value

    @classmethod
    def connect(cls, socket: Optional[str] = None, local_rank: int = ANY_RANK,
                timeout_ms: int = 0) -> "Client":
        """Same as Client(socket, local_rank, timeout_ms)."""
        return cls(socket, local_rank, timeout_ms)

    # ---- lifetime ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._handle is None

    def _h(self) -> int:
        if self._handle is None:
            raise ZerodError(_lib.ZD_ECLOSED, "ZD_ECLOSED", "the client is closed")
        return self._handle

    def close(self) -> None:
        """Says bye and closes the connection; zerod keeps the rank's state for a later client.

        The shared buffers are unmapped: memoryviews returned by this client are released, and
        any other view of the buffers (numpy arrays, torch tensors) must not be used afterwards.
        Device buffers are freed: work on the trainer's streams that uses them must be complete
        (synchronize first). Closing twice is harmless.
        """
        with self._lock:
            if self._handle is None:
                return
            self._release_views()
            handle, self._handle = self._handle, None
            self._lib.zd_close(handle)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- layout and registration -------------------------------------------------------------

    def layout(self, params: Iterable[ParamSpec],
               groups: Optional[Sequence[Union[Group, Mapping[str, Any]]]] = None, *,
               param_dtype: Any = "f32", grad_dtype: Any = None, max_grad_norm: float = 0.0,
               grad_mean: bool = True,
               loss_scaler: Union[LossScaler, Mapping[str, Any], bool, None] = None,
               replace: bool = False, memory: str = "host",
               device: Optional[int] = None, grow: bool = False) -> None:
        """Computes the layout of the model and creates zeroed shared buffers (zd_layout).

        Args:
            params: the parameters in registration order: Param objects or (name, shape) /
                (name, shape, group) tuples.
            groups: hyperparameters per group (Group objects or dicts); default one Group().
            param_dtype: working parameters: "f32" or "bf16" (or a torch dtype).
            grad_dtype: gradients: "f32", "bf16" or "f16"; default param_dtype.
            max_grad_norm: clip by global L2 norm; 0 disables clipping.
            grad_mean: average gradients over ranks (True) or sum them (False).
            loss_scaler: dynamic loss scaling for fp16 gradients (LossScaler, dict, True for the
                defaults, None to disable).
            replace: start afresh: discard any state zerod holds on this rank (for this model or
                another; at world size > 1 every rank must pass it).
            memory: "host" (shared memory, for zerod's CPU backend), "cuda" (device memory on
                the rank's GPU, shared through CUDA IPC, for zerod's CUDA backend) or
                "host_pinned" (host shared memory page-locked for CUDA by libzerod, for a model
                on a GPU trained by zerod's CPU backend: ZD_MEMORY_HOST_PINNED; host views as
                with "host").
            device: with memory "cuda", this process's CUDA ordinal of that GPU; default
                `cuda_device()`, the rank's GPU as this process numbers it. With
                "host_pinned": the ordinal of the model's GPU (default 0).
            grow: the model extends the one this rank holds (ZD_REGISTER_GROW: torch's
                add_param_group): the held parameters, the first ones of `params`, keep their
                state and the model its step; the new ones start afresh. Not with replace.

        After it, write the initial parameter values into `param_buffer` (device buffers:
        `param_device_array()`, on the stream given to `set_stream()`) at the offsets
        `param_info()` gives, then call `register()`.
        """
        if memory not in ("host", "cuda", "host_pinned"):
            raise ValueError(f"memory is {memory!r}; expected 'host', 'cuda' or 'host_pinned'")
        specs: List[Param] = []
        for p in params:
            if isinstance(p, Param):
                specs.append(p)
            else:
                specs.append(Param(str(p[0]), tuple(int(d) for d in p[1]),
                                   int(p[2]) if len(p) > 2 else 0))
        gs = [Group.coerce(g) for g in (groups if groups is not None else [Group()])]
        pdt, gdt = dtype_of(param_dtype), dtype_of(grad_dtype if grad_dtype is not None
                                                   else param_dtype)
        scaler = LossScaler.coerce(loss_scaler)

        c_params = (_lib.zd_param_t * max(len(specs), 1))()
        names = []  # keep the encoded names alive for the call
        for i, p in enumerate(specs):
            if len(p.shape) > ZD_MAX_DIMS:
                raise ValueError(f"parameter {p.name!r} has {len(p.shape)} dimensions; at most "
                                 f"{ZD_MAX_DIMS} are supported")
            names.append(p.name.encode())
            c_params[i].name = names[-1]
            c_params[i].ndim = len(p.shape)
            for d, n in enumerate(p.shape):
                c_params[i].shape[d] = n
            c_params[i].group = p.group
        c_groups = (_lib.zd_group_t * max(len(gs), 1))()
        for i, g in enumerate(gs):
            g._to_c(c_groups[i])
        desc = _lib.zd_model_desc_t()
        desc.params = c_params
        desc.nparams = len(specs)
        desc.groups = c_groups
        desc.ngroups = len(gs)
        desc.param_dtype = pdt
        desc.grad_dtype = gdt
        desc.max_grad_norm = float(max_grad_norm)
        desc.grad_reduce = _lib.ZD_GRAD_MEAN if grad_mean else _lib.ZD_GRAD_SUM
        c_scaler = _lib.zd_loss_scaler_t()  # kept alive for the call
        if scaler is not None:
            c_scaler.enabled = 1
            c_scaler.initial_scale = float(scaler.initial_scale)
            c_scaler.growth_factor = float(scaler.growth_factor)
            c_scaler.backoff_factor = float(scaler.backoff_factor)
            c_scaler.growth_interval = int(scaler.growth_interval)
            c_scaler.hysteresis = int(scaler.hysteresis)
            c_scaler.min_scale = float(scaler.min_scale)
            desc.loss_scaler = ctypes.pointer(c_scaler)
        desc.flags = ZD_REGISTER_REPLACE if replace else 0
        if grow:
            desc.flags |= _lib.ZD_REGISTER_GROW
        if memory == "cuda":
            desc.memory = _lib.ZD_MEMORY_CUDA
            desc.device = self.cuda_device() if device is None else int(device)
        elif memory == "host_pinned":
            desc.memory = _lib.ZD_MEMORY_HOST_PINNED
            desc.device = 0 if device is None else int(device)
        with self._lock:
            h = self._h()
            self._release_views()  # zd_layout() remaps the buffers: the old views would dangle
            _check(self._lib.zd_layout(h, ctypes.byref(desc)), "zd_layout")
            self._params = specs
            self._param_dtype, self._grad_dtype = pdt, gdt
            self._memory = memory

    def register(self) -> Info:
        """Sends the model and its buffers to zerod (zd_register) and returns the new Info.

        zerod takes the param buffer's contents as the initial weights of a new model, or, when
        it already holds this model (same layout hash: a trainer that reattaches), overwrites
        the buffer with its master weights and continues at its step (info.resumed is True).
        At world size > 1 this is collective: it returns when every rank has registered.
        """
        with self._lock:
            _check(self._lib.zd_register(self._h()), "zd_register")
            self._registered = True
        return self.info

    def rejoin(self, timeout_ms: int = 0) -> Info:
        """Registers the same model again with the same buffers on a new connection to the same
        socket and local rank (zd_rejoin): after this rank's zerod was restarted, or after the
        world re-formed around a peer's restart, with the state in a state_dir. Returns the new
        Info: ``info.step`` is the step every rank holds, and the param buffer holds its
        parameters. Tries again until zerod takes the model and every rank registered it, up to
        timeout_ms (0: 120 s), then raises ZerodError (ETIMEDOUT) naming what it waited for."""
        with self._lock:
            _check(self._lib.zd_rejoin(self._h(), int(timeout_ms)), "zd_rejoin")
        return self.info

    # ---- buffers -----------------------------------------------------------------------------

    def _buffer(self, which: str) -> Tuple[int, int]:
        size = ctypes.c_size_t()
        with self._lock:
            fn = self._lib.zd_param_buffer if which == "param" else self._lib.zd_grad_buffer
            addr = fn(self._h(), ctypes.byref(size))
        if not addr:
            raise ZerodError(_lib.ZD_EORDER, "ZD_EORDER",
                             f"no {which} buffer: call layout() first", f"zd_{which}_buffer")
        return int(addr), int(size.value)

    @property
    def param_dtype(self) -> int:
        """zd_dtype_t of the param buffer."""
        return self._param_dtype

    @property
    def grad_dtype(self) -> int:
        """zd_dtype_t of the grad buffer."""
        return self._grad_dtype

    @property
    def param_address(self) -> int:
        """Address of the shared param buffer in this process."""
        return self._buffer("param")[0]

    @property
    def grad_address(self) -> int:
        """Address of the shared grad buffer in this process."""
        return self._buffer("grad")[0]

    @property
    def memory(self) -> str:
        """Where the buffers are: "host", "cuda" or "host_pinned" (as given to layout())."""
        return self._memory

    def _host_buffer(self, which: str) -> Tuple[int, int]:
        if self._memory == "cuda":
            raise ValueError(f"the {which} buffer is device memory: use "
                             f"{which}_device_array() (host views need memory='host')")
        return self._buffer(which)

    def param_array(self) -> ctypes.Array:
        """The param buffer as a ctypes char array over the shared memory (zero-copy). Views
        made from it (torch.frombuffer, numpy.frombuffer, memoryview) keep this Client alive.
        Host buffers only."""
        return _shared_array(*self._host_buffer("param"), self)

    def grad_array(self) -> ctypes.Array:
        """The grad buffer as a ctypes char array over the shared memory (zero-copy). Host
        buffers only."""
        return _shared_array(*self._host_buffer("grad"), self)

    def _device_array(self, which: str) -> DeviceArray:
        if self._memory != "cuda":
            raise ValueError(f"the {which} buffer is host memory: use {which}_array() (device "
                             f"arrays need memory='cuda')")
        address, _ = self._buffer(which)
        dt = self._param_dtype if which == "param" else self._grad_dtype
        return DeviceArray(address, self.info.total_elems, dt, self)

    def param_device_array(self) -> DeviceArray:
        """The param buffer (device memory) as a DeviceArray (``__cuda_array_interface__``) of
        info.total_elems elements. Device buffers only."""
        return self._device_array("param")

    def grad_device_array(self) -> DeviceArray:
        """The grad buffer (device memory) as a DeviceArray. Device buffers only."""
        return self._device_array("grad")

    def set_stream(self, stream: Optional[int]) -> None:
        """Device buffers: the CUDA stream (a cudaStream_t as an int, e.g. torch's
        ``torch.cuda.current_stream().cuda_stream``; None or 0: the legacy default stream) on
        which the trainer writes gradients and reads parameters. Work queued on it before a
        request is seen by zerod; work queued after the request's reply sees zerod's results
        (zd_set_stream). It may change between requests."""
        with self._lock:
            self._set_stream_locked(stream)

    def cuda_device(self) -> int:
        """This process's CUDA ordinal of the GPU of this client's rank (zd_cuda_device).
        Raises ZerodError: ZD_EBACKEND (zerod runs its CPU backend, or CUDA is unusable here),
        -ENODEV (this process does not see that GPU)."""
        out = ctypes.c_int(-1)
        with self._lock:
            _check(self._lib.zd_cuda_device(self._h(), ctypes.byref(out)), "zd_cuda_device")
        return int(out.value)

    def _view(self, which: str, typed: bool) -> memoryview:
        mv = self._views.get((which, typed))
        if mv is not None:
            return mv
        arr = self.param_array() if which == "param" else self.grad_array()
        mv = memoryview(arr).cast("B")
        if typed:
            dt = self._param_dtype if which == "param" else self._grad_dtype
            mv = mv.cast(DType.FORMATS[dt])
        self._views[(which, typed)] = mv
        return mv

    def _release_views(self) -> None:
        for mv in self._views.values():
            try:
                mv.release()
            except BufferError:
                pass  # something still exports it; the mapping goes away regardless
        self._views.clear()

    @property
    def param_buffer(self) -> memoryview:
        """The param buffer as a writable memoryview of its elements (format 'f' for f32, 'H'
        (the bit pattern) for bf16), zero-copy. Released by close()."""
        return self._view("param", True)

    @property
    def grad_buffer(self) -> memoryview:
        """The grad buffer as a writable memoryview of its elements (format 'f' for f32, 'H'
        (the bit pattern) for bf16 and f16), zero-copy. Released by close()."""
        return self._view("grad", True)

    # ---- layout queries ----------------------------------------------------------------------

    def param_info(self, index: int) -> ParamInfo:
        """Where parameter `index` lives in the flat buffers (valid after layout())."""
        out = _lib.zd_param_info_t()
        with self._lock:
            _check(self._lib.zd_param_info(self._h(), int(index), ctypes.byref(out)),
                   "zd_param_info")
            name = out.name.decode()
        return ParamInfo(int(index), name, int(out.offset), int(out.numel), int(out.bucket),
                         int(out.group))

    def params_info(self) -> List[ParamInfo]:
        """param_info() of every parameter, in registration order."""
        return [self.param_info(i) for i in range(len(self._params))]

    def bucket_info(self, index: int) -> BucketInfo:
        """Element range of bucket `index` and this rank's slice of it."""
        out = _lib.zd_bucket_info_t()
        with self._lock:
            _check(self._lib.zd_bucket_info(self._h(), int(index), ctypes.byref(out)),
                   "zd_bucket_info")
        return BucketInfo(int(index), int(out.offset), int(out.elems), int(out.shard_offset),
                          int(out.shard_elems))

    def buckets_info(self) -> List[BucketInfo]:
        """bucket_info() of every bucket."""
        return [self.bucket_info(i) for i in range(self.info.nbuckets)]

    @property
    def info(self) -> Info:
        """What the daemon said at connect and register, and the layout (zd_get_info)."""
        out = _lib.zd_info_t()
        with self._lock:
            _check(self._lib.zd_get_info(self._h(), ctypes.byref(out)), "zd_get_info")
        return Info(int(out.protocol_version), int(out.world_size), int(out.rank),
                    int(out.local_rank), int(out.bucket_elems),
                    out.backend.decode(errors="replace"),
                    out.daemon_version.decode(errors="replace"), int(out.step),
                    bool(out.resumed), int(out.layout_hash), int(out.total_elems),
                    int(out.nbuckets), float(out.loss_scale))

    # ---- requests ----------------------------------------------------------------------------

    @staticmethod
    def _step_opts(groups: Optional[Sequence[Union[Group, Mapping[str, Any]]]], scatter: bool,
                   gather: bool, clip_norm: Union[str, int] = "double",
                   absent: Optional[Sequence[int]] = None, nparams: int = 0
                   ) -> Tuple[_lib.zd_step_opts_t, Any]:
        opts = _lib.zd_step_opts_t()
        if isinstance(clip_norm, str):
            if clip_norm not in CLIP_NORMS:
                raise ValueError(f"clip_norm is {clip_norm!r}; expected one of "
                                 f"{', '.join(CLIP_NORMS)}")
            clip_norm = CLIP_NORMS[clip_norm]
        opts.clip_norm = int(clip_norm)
        keep = None
        if groups is not None:
            gs = [Group.coerce(g) for g in groups]
            keep = (_lib.zd_group_t * max(len(gs), 1))()
            for i, g in enumerate(gs):
                g._to_c(keep[i])
            opts.groups = keep
            opts.ngroups = len(gs)
        opts.flags = (0 if scatter else ZD_STEP_NO_SCATTER) | (0 if gather else ZD_STEP_NO_GATHER)
        if absent:  # zd_step_opts_t.absent: one bit per parameter, least significant first
            bits = bytearray((nparams + 7) // 8)
            for i in absent:
                if not 0 <= i < nparams:
                    raise ValueError(f"absent parameter {i} does not exist; the model has "
                                     f"{nparams} parameters")
                bits[i // 8] |= 1 << (i % 8)
            buf = (ctypes.c_uint8 * len(bits)).from_buffer_copy(bytes(bits))
            opts.absent = ctypes.cast(buf, ctypes.c_void_p)
            keep = (keep, buf)
        return opts, keep

    def step(self, groups: Optional[Sequence[Union[Group, Mapping[str, Any]]]] = None, *,
             scatter: bool = True, gather: bool = True,
             clip_norm: Union[str, int] = "double",
             absent: Optional[Sequence[int]] = None) -> StepResult:
        """One optimizer step (zd_step): scatter + step + gather unless told otherwise.

        Args:
            groups: hyperparameters of every group for this and later steps (schedulers); None
                keeps the current ones. Must list every registered group.
            scatter: False when every bucket was scattered already (scatter()/scatter_start()).
            gather: False when parameters are gathered later with gather().
            clip_norm: the norm clipping uses in this step (zd_clip_norm_t): "double" (zerod's),
                or "torch113", "torch26", "torch215": that torch build's fp32 clip_grad_norm_
                total, bit for bit, where it applies (CPU backend, world size 1, f32 gradients,
                no loss scaler, max_grad_norm > 0; elsewhere "double").
            absent: indices (registration order) of the parameters without a gradient this step
                (zd_step_opts_t.absent), whose gradients the caller zeroed; None or empty: all
                have one. zerod (CPU backend) skips those absent on every rank, as torch skips
                a parameter whose .grad is None.

        At world size > 1 every rank must call it. Raises ZerodError: ZD_EORDER (not registered,
        or a bucket not scattered with scatter=False), ZD_EHPARAM, ZD_ESTEP, ZD_EPEER, ...
        """
        opts, _keep = self._step_opts(groups, scatter, gather, clip_norm, absent,
                                      len(self._params))
        res = _lib.zd_step_result_t()
        with self._lock:
            _check(self._lib.zd_step(self._h(), ctypes.byref(opts), ctypes.byref(res)), "zd_step")
        return StepResult._from_c(res)

    def scatter(self, bucket: int = ALL_BUCKETS) -> None:
        """Reduce-scatter of one bucket (or all) of the grad buffer into this rank's shard."""
        with self._lock:
            _check(self._lib.zd_scatter(self._h(), int(bucket)), "zd_scatter")

    def set_next_groups(self, groups: Optional[Sequence[Union[Group, Mapping[str, Any]]]]
                        ) -> None:
        """The hyperparameters the next step will apply, as they are before backward (schedulers
        set them there), sent with the next scatter to a zerod running overlap_update, whose
        speculative updates then use them (zd_set_next_groups); the step still applies the
        groups given to step(). None drops groups not sent yet. Nothing is sent here."""
        with self._lock:
            if groups is None:
                _check(self._lib.zd_set_next_groups(self._h(), None, 0,
                                                    ctypes.sizeof(_lib.zd_group_t)),
                       "zd_set_next_groups")
                return
            gs = [Group.coerce(g) for g in groups]
            arr = (_lib.zd_group_t * max(len(gs), 1))()
            for i, g in enumerate(gs):
                g._to_c(arr[i])
            _check(self._lib.zd_set_next_groups(self._h(), arr, len(gs),
                                                ctypes.sizeof(_lib.zd_group_t)),
                   "zd_set_next_groups")

    def gather(self, bucket: int = ALL_BUCKETS) -> None:
        """All-gather of one bucket (or all) of updated parameters into the param buffer."""
        with self._lock:
            _check(self._lib.zd_gather(self._h(), int(bucket)), "zd_gather")

    def checkpoint(self, *, wait: bool = True) -> Tuple[int, str]:
        """A checkpoint of this rank's state as of the last step, written by zerod under its
        checkpoint_dir; every trainer of the world calls it between the same two steps. wait:
        return once written (else once snapshotted). Returns (step, directory)."""
        step = ctypes.c_uint64(0)
        path = ctypes.create_string_buffer(512)
        with self._lock:
            flags = 0 if wait else _lib.ZD_CHECKPOINT_NO_WAIT
            _check(self._lib.zd_checkpoint(self._h(), flags, ctypes.byref(step), path, len(path)),
                   "zd_checkpoint")
        return step.value, path.value.decode()

    def _set_stream_locked(self, stream: Optional[int]) -> None:
        _check(self._lib.zd_set_stream(self._h(), ctypes.c_void_p(stream or None)),
               "zd_set_stream")

    def scatter_start(self, bucket: int = ALL_BUCKETS, *, stream: Optional[int] = None) -> Request:
        """Sends a scatter request and returns at once; wait() for it later. Raises ZerodError
        (EBUSY) when 64 requests are outstanding already. stream (device buffers): set_stream()
        first, under the same lock (another thread cannot change the stream in between)."""
        req = _lib.zd_request_t()
        with self._lock:
            if stream is not None:
                self._set_stream_locked(stream)
            _check(self._lib.zd_scatter_start(self._h(), int(bucket), ctypes.byref(req)),
                   "zd_scatter_start")
        return Request(self, int(req.value), "scatter")

    def gather_start(self, bucket: int = ALL_BUCKETS) -> Request:
        """Sends a gather request and returns at once; wait() for it later."""
        req = _lib.zd_request_t()
        with self._lock:
            _check(self._lib.zd_gather_start(self._h(), int(bucket), ctypes.byref(req)),
                   "zd_gather_start")
        return Request(self, int(req.value), "gather")

    def step_start(self, groups: Optional[Sequence[Union[Group, Mapping[str, Any]]]] = None, *,
                   scatter: bool = True, gather: bool = True,
                   stream: Optional[int] = None,
                   clip_norm: Union[str, int] = "double",
                   absent: Optional[Sequence[int]] = None) -> Request:
        """Sends a step request (as step()) and returns at once; wait() returns its
        StepResult. stream: as for scatter_start(). absent: as for step()."""
        opts, _keep = self._step_opts(groups, scatter, gather, clip_norm, absent,
                                      len(self._params))
        req = _lib.zd_request_t()
        with self._lock:
            if stream is not None:
                self._set_stream_locked(stream)
            _check(self._lib.zd_step_start(self._h(), ctypes.byref(opts), ctypes.byref(req)),
                   "zd_step_start")
        return Request(self, int(req.value), "step")

    def wait(self, request: Request, *, stream: Optional[int] = None) -> Optional[StepResult]:
        """Waits for a request sent with a *_start method (zd_wait); returns its StepResult for
        a step, None otherwise; raises ZerodError with the request's own error. Each request is
        waited for once. stream (device buffers): the stream that is to wait for the request's
        results, set under the same lock as the wait (as for scatter_start()); None keeps the
        client's stream."""
        if request._client is not self:
            raise ValueError("the request belongs to another client")
        if request._done:
            if request._error is not None:
                raise request._error
            return request._result
        res = _lib.zd_step_result_t()
        with self._lock:
            if stream is not None:
                self._set_stream_locked(stream)
            rc = self._lib.zd_wait(self._h(), request.id, ctypes.byref(res))
            request._done = True
            if rc != 0:
                request._error = _error(rc, f"zd_wait({request.kind})")
                raise request._error
        if request.kind == "step":
            request._result = StepResult._from_c(res)
        return request._result

    # ---- status ------------------------------------------------------------------------------

    def status(self) -> str:
        """The daemon's status as text: "# Section" lines followed by "key:value" lines."""
        text = ctypes.c_void_p()
        with self._lock:
            _check(self._lib.zd_status(self._h(), ctypes.byref(text)), "zd_status")
        try:
            return ctypes.string_at(text.value).decode(errors="replace")
        finally:
            _lib.free(text.value)

    def status_dict(self) -> Dict[str, Dict[str, str]]:
        """status() parsed by parse_status(): {section: {key: value}}."""
        return parse_status(self.status())

    def rank_status(self) -> Dict[str, str]:
        """The status section of this client's rank ("rank N")."""
        sections = self.status_dict()
        name = f"rank {self.info.rank}"
        if name not in sections:
            raise KeyError(f"status has no section {name!r}; sections: {list(sections)}")
        return sections[name]

    def __repr__(self) -> str:
        if self._handle is None:
            return "<zerod.Client closed>"
        i = self.info
        return (f"<zerod.Client rank {i.rank}/{i.world_size} local_rank {i.local_rank} "
                f"backend {i.backend} step {i.step}>")


def connect(socket: Optional[str] = None, local_rank: int = ANY_RANK,
            timeout_ms: int = 0) -> Client:
    """Connects to zerod and attaches to a local rank: Client(socket, local_rank, timeout_ms)."""
    return Client(socket, local_rank, timeout_ms)
