"""ctypes bindings of libzerod (client/include/zerod/zerod.h).

This module loads the shared library when it is imported, defines the headers' integer constants
(ZD_F32, ZD_EBUFFER, ZD_STEP_NO_GATHER, ...) as module-level names from the library's own table
(zd_constants), mirrors the C structures of the public header and declares every function with
its argument and return types. Nothing else in the package calls the library without going
through the prototypes declared here. The structures mirror zerod.h field for field; each one
that may grow begins with its size, or travels with its element size, which this package sets to
its own sizeof, so that a newer libzerod reads them as an older client's (docs/abi.md). zd_group_t
takes its fields from the library itself (zd_group_fields), so that a hyperparameter added to
zerod's table needs no edit in this package.

Where the library comes from, in order:
  1. ``$ZEROD_LIBRARY``: a path to libzerod.so (an error if it does not exist);
  2. a ``libzerod.so*`` next to this package: `pip install ./client/python` from a built checkout
     bundles the build tree's library (client/python/setup.py);
  3. the build tree, when this package is used from a checkout (PYTHONPATH=client/python):
     ``build/client/libzerod.so`` at the checkout's root;
  4. ``ctypes.util.find_library("zerod")``: the system's library path (``meson install``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from typing import Any, Dict, List, Tuple

__all__ = ["GroupField", "group_fields", "lib", "load", "library_path"]


class LibraryNotFoundError(OSError):
    """libzerod could not be found or loaded."""


def _candidates() -> list:
    env = os.environ.get("ZEROD_LIBRARY")
    if env:
        if not os.path.exists(env):
            raise LibraryNotFoundError(
                f"ZEROD_LIBRARY is {env!r}, which does not exist; point it at libzerod.so "
                f"(built as build/client/libzerod.so)")
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    bundled = sorted(glob.glob(os.path.join(here, "libzerod.so*")), key=len)
    if bundled:
        return bundled[:1]
    tree = os.path.join(here, "..", "..", "..", "build", "client", "libzerod.so")
    if os.path.exists(os.path.join(here, "..", "..", "include", "zerod", "zerod.h")) and \
            os.path.exists(tree):
        return [os.path.normpath(tree)]
    found = ctypes.util.find_library("zerod")
    return [found] if found else []


def _open() -> Tuple[ctypes.CDLL, str]:
    candidates = _candidates()
    if not candidates:
        raise LibraryNotFoundError(
            "libzerod not found: build it (ninja -C build) and install this package from the "
            "checkout (pip install ./client/python bundles build/client/libzerod.so), or "
            "install it with `meson install` so that ctypes.util.find_library('zerod') "
            "finds it, or set ZEROD_LIBRARY to the path of libzerod.so")
    try:
        return ctypes.CDLL(candidates[0]), candidates[0]
    except OSError as e:
        raise LibraryNotFoundError(f"cannot load libzerod from {candidates[0]}: {e}") from e


def _symbol(lib: ctypes.CDLL, path: str, name: str) -> Any:
    try:
        return getattr(lib, name)
    except AttributeError as e:
        raise LibraryNotFoundError(f"{path} has no symbol {name}: not a libzerod this package "
                                   f"supports") from e


class zd_constant_t(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_int64)]


def _table(lib: ctypes.CDLL, path: str, name: str, element: Any, *extra: Any) -> list:
    """The elements of a static array that libzerod returns with its element size (zd_constants,
    zd_group_fields), walked by that size: a newer library's elements may be larger."""
    fn = _symbol(lib, path, name)
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)] + \
        [ctypes.POINTER(ctypes.c_size_t)] * len(extra)
    base, stride = ctypes.c_void_p(), ctypes.c_size_t()
    n = fn(ctypes.byref(base), ctypes.byref(stride), *(ctypes.byref(x) for x in extra))
    if stride.value < ctypes.sizeof(element):
        raise LibraryNotFoundError(f"{path}: {name}() elements are {stride.value} bytes, fewer "
                                   f"than this package's {ctypes.sizeof(element)}: an older "
                                   f"libzerod than this package")
    return [element.from_address(base.value + i * stride.value) for i in range(n)]


# Loaded at import: the ZD_* names below come from the library.
_lib, _path = _open()

# Every integer constant of zerod.h and zerod/errors.h (ZD_F32, ZD_EBUFFER, ZD_STEP_NO_GATHER,
# ...), as module-level names with the library's values (zd_constants): never copied by hand.
CONSTANTS: Dict[str, int] = {c.name.decode(): int(c.value)
                             for c in _table(_lib, _path, "zd_constants", zd_constant_t)}
globals().update(CONSTANTS)


def __getattr__(name: str) -> int:
    """Declares the ZD_* names set from the library above to type checkers; any other name is an
    AttributeError."""
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}" +
                         ("; libzerod defines no such constant" if name.startswith("ZD_") else ""))


def _const(name: str) -> int:
    return CONSTANTS[name]


_FIELD_CTYPES = {_const("ZD_FIELD_DOUBLE"): ctypes.c_double, _const("ZD_FIELD_ENUM"): ctypes.c_int,
                 _const("ZD_FIELD_BOOL"): ctypes.c_int}


class _Sized(ctypes.Structure):
    """A structure of zerod.h that begins with its size: a new instance sets it, as the header's
    ZD_*_INIT initialisers do, so that libzerod knows which fields this package has."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.size = ctypes.sizeof(self)


class zd_group_field_t(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("kind", ctypes.c_int),  # zd_field_kind_t
        ("offset", ctypes.c_size_t),
        ("default_value", ctypes.c_double),
    ]


class zd_group_t(ctypes.Structure):
    """zd_group_t, with the fields libzerod describes (zd_group_fields), in its order: a
    hyperparameter added to zerod's table needs no edit in this package."""


class GroupField:
    """One field of zd_group_t as libzerod describes it: its C name, kind (ZD_FIELD_*) and
    default (its value after zd_group_init())."""

    __slots__ = ("name", "kind", "default")

    def __init__(self, name: str, kind: int, default: float) -> None:
        self.name = name
        self.kind = kind
        self.default = default

    def __repr__(self) -> str:
        return f"GroupField({self.name!r}, kind={self.kind}, default={self.default!r})"


def _define_group() -> List[GroupField]:
    """Gives zd_group_t the fields the library describes, in its order, checks that ctypes lays
    them out where the C compiler did, and returns their descriptions."""
    size = ctypes.c_size_t()
    fields = _table(_lib, _path, "zd_group_fields", zd_group_field_t, size)
    if any(f.kind not in _FIELD_CTYPES for f in fields):
        raise LibraryNotFoundError(f"{_path} describes a zd_group_t field of an unknown kind: a "
                                   f"newer libzerod than this package")
    layout = [(f.name.decode(), _FIELD_CTYPES[f.kind]) for f in fields]
    zd_group_t._fields_ = layout
    placed = [(name, getattr(zd_group_t, name).offset) for name, _ in layout]
    if placed != [(f.name.decode(), f.offset) for f in fields] or \
            ctypes.sizeof(zd_group_t) != size.value:
        raise LibraryNotFoundError(f"{_path}: zd_group_t does not lay out as described")
    return [GroupField(f.name.decode(), f.kind, f.default_value) for f in fields]


_group_fields = _define_group()


class zd_param_t(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("ndim", ctypes.c_uint32),
        ("shape", ctypes.c_uint64 * _const("ZD_MAX_DIMS")),
        ("group", ctypes.c_uint32),
    ]


class zd_loss_scaler_t(_Sized):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("enabled", ctypes.c_int),
        ("initial_scale", ctypes.c_double),
        ("growth_factor", ctypes.c_double),
        ("backoff_factor", ctypes.c_double),
        ("growth_interval", ctypes.c_uint32),
        ("hysteresis", ctypes.c_uint32),
        ("min_scale", ctypes.c_double),
    ]


class zd_model_desc_t(_Sized):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("params", ctypes.POINTER(zd_param_t)),
        ("nparams", ctypes.c_size_t),
        ("param_size", ctypes.c_size_t),
        ("groups", ctypes.POINTER(zd_group_t)),
        ("ngroups", ctypes.c_size_t),
        ("group_size", ctypes.c_size_t),
        ("param_dtype", ctypes.c_int),
        ("grad_dtype", ctypes.c_int),
        ("max_grad_norm", ctypes.c_double),
        ("grad_reduce", ctypes.c_int),  # zd_grad_reduce_t: ZD_GRAD_MEAN (0) or ZD_GRAD_SUM
        ("flags", ctypes.c_uint),
        ("loss_scaler", ctypes.POINTER(zd_loss_scaler_t)),  # NULL: no loss scaling
        ("memory", ctypes.c_int),  # zd_memory_t: ZD_MEMORY_HOST, _CUDA or _HOST_PINNED
        ("device", ctypes.c_int),  # CUDA ordinal (ZD_MEMORY_CUDA: the buffers; _PINNED: the model)
    ]

    def __init__(self) -> None:
        super().__init__()
        self.param_size = ctypes.sizeof(zd_param_t)
        self.group_size = ctypes.sizeof(zd_group_t)


class zd_info_t(_Sized):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("protocol_version", ctypes.c_uint32),
        ("world_size", ctypes.c_uint32),
        ("rank", ctypes.c_uint32),
        ("local_rank", ctypes.c_uint32),
        ("bucket_elems", ctypes.c_uint64),
        ("backend", ctypes.c_char * 16),
        ("daemon_version", ctypes.c_char * 32),
        ("step", ctypes.c_uint64),
        ("resumed", ctypes.c_int),
        ("layout_hash", ctypes.c_uint64),
        ("total_elems", ctypes.c_uint64),
        ("nbuckets", ctypes.c_uint32),
        ("loss_scale", ctypes.c_double),
    ]


class zd_param_info_t(_Sized):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("name", ctypes.c_char_p),
        ("offset", ctypes.c_uint64),
        ("numel", ctypes.c_uint64),
        ("bucket", ctypes.c_uint32),
        ("group", ctypes.c_uint32),
    ]


class zd_bucket_info_t(_Sized):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("offset", ctypes.c_uint64),
        ("elems", ctypes.c_uint64),
        ("shard_offset", ctypes.c_uint64),
        ("shard_elems", ctypes.c_uint64),
    ]


class zd_step_opts_t(_Sized):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("groups", ctypes.POINTER(zd_group_t)),
        ("ngroups", ctypes.c_size_t),
        ("group_size", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("clip_norm", ctypes.c_int),
        ("absent", ctypes.c_void_p),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.group_size = ctypes.sizeof(zd_group_t)


class zd_step_result_t(_Sized):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("step", ctypes.c_uint64),
        ("applied", ctypes.c_int),
        ("grad_norm", ctypes.c_double),
        ("loss_scale", ctypes.c_double),
        ("clip_coef", ctypes.c_double),
        ("duration_us", ctypes.c_uint64),
    ]


zd_client_p = ctypes.c_void_p  # opaque zd_client_t *
zd_request_t = ctypes.c_uint64

# name: (restype, argtypes)
_PROTOTYPES = {
    "zd_strerror": (ctypes.c_char_p, [ctypes.c_int]),
    "zd_err_name": (ctypes.c_char_p, [ctypes.c_int]),
    "zd_group_init": (ctypes.c_int, [ctypes.POINTER(zd_group_t), ctypes.c_size_t,
                                     ctypes.c_size_t]),
    "zd_connect": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.c_int,
                                  ctypes.POINTER(zd_client_p)]),
    "zd_layout": (ctypes.c_int, [zd_client_p, ctypes.POINTER(zd_model_desc_t)]),
    "zd_register": (ctypes.c_int, [zd_client_p]),
    "zd_rejoin": (ctypes.c_int, [zd_client_p, ctypes.c_int]),
    "zd_param_buffer": (ctypes.c_void_p, [zd_client_p, ctypes.POINTER(ctypes.c_size_t)]),
    "zd_grad_buffer": (ctypes.c_void_p, [zd_client_p, ctypes.POINTER(ctypes.c_size_t)]),
    "zd_param_info": (ctypes.c_int, [zd_client_p, ctypes.c_size_t,
                                     ctypes.POINTER(zd_param_info_t)]),
    "zd_bucket_info": (ctypes.c_int, [zd_client_p, ctypes.c_size_t,
                                      ctypes.POINTER(zd_bucket_info_t)]),
    "zd_get_info": (ctypes.c_int, [zd_client_p, ctypes.POINTER(zd_info_t)]),
    "zd_set_stream": (ctypes.c_int, [zd_client_p, ctypes.c_void_p]),
    "zd_cuda_device": (ctypes.c_int, [zd_client_p, ctypes.POINTER(ctypes.c_int)]),
    "zd_step": (ctypes.c_int, [zd_client_p, ctypes.POINTER(zd_step_opts_t),
                               ctypes.POINTER(zd_step_result_t)]),
    "zd_scatter": (ctypes.c_int, [zd_client_p, ctypes.c_int]),
    "zd_gather": (ctypes.c_int, [zd_client_p, ctypes.c_int]),
    "zd_checkpoint": (ctypes.c_int, [zd_client_p, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64),
                                     ctypes.c_char_p, ctypes.c_size_t]),
    "zd_scatter_start": (ctypes.c_int, [zd_client_p, ctypes.c_int, ctypes.POINTER(zd_request_t)]),
    "zd_set_next_groups": (ctypes.c_int, [zd_client_p, ctypes.POINTER(zd_group_t), ctypes.c_size_t,
                                          ctypes.c_size_t]),
    "zd_gather_start": (ctypes.c_int, [zd_client_p, ctypes.c_int, ctypes.POINTER(zd_request_t)]),
    "zd_step_start": (ctypes.c_int, [zd_client_p, ctypes.POINTER(zd_step_opts_t),
                                     ctypes.POINTER(zd_request_t)]),
    "zd_wait": (ctypes.c_int, [zd_client_p, zd_request_t, ctypes.POINTER(zd_step_result_t)]),
    "zd_status": (ctypes.c_int, [zd_client_p, ctypes.POINTER(ctypes.c_void_p)]),
    "zd_free": (None, [ctypes.c_void_p]),
    "zd_close": (None, [zd_client_p]),
    "zd_last_error": (ctypes.c_char_p, []),
    "zd_dtype_size": (ctypes.c_size_t, [ctypes.c_int]),
    "zd_dtype_name": (ctypes.c_char_p, [ctypes.c_int]),
    "zd_sqrt": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
}

for _name, (_restype, _argtypes) in _PROTOTYPES.items():
    _fn = _symbol(_lib, _path, _name)
    _fn.restype = _restype
    _fn.argtypes = _argtypes


def load() -> ctypes.CDLL:
    """The library, with every prototype declared (it is loaded when this module is imported)."""
    return _lib


def group_fields() -> List[GroupField]:
    """The fields of zd_group_t in declaration order."""
    return _group_fields


def lib() -> ctypes.CDLL:
    """The loaded library."""
    return _lib


def library_path() -> str:
    """Path of the loaded libzerod."""
    return _path


def free(ptr: int) -> None:
    """Releases memory the library allocated (zd_status's text), with the library's own free:
    a libc looked up here may not be the allocator libzerod used (an ASan runtime preloaded)."""
    _lib.zd_free(ptr)
