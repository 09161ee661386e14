"""ctypes bindings of libzerod (client/include/zerod/zerod.h).

This module finds and loads the shared library, mirrors the C structures of the public header and
declares every function with its argument and return types. Nothing else in the package calls
the library without going through the prototypes declared here. The structures mirror
zerod.h field for field; each one that may grow begins with its size, or travels with its element
size, which this package sets to its own sizeof, so that a newer libzerod reads them as an older
client's (docs/abi.md). zd_group_t takes its fields from the library itself (zd_group_fields, in
load()), so that a hyperparameter added to zerod's table needs no edit in this package.

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
import threading
from typing import Any, List, Optional

__all__ = ["GroupField", "group_fields", "lib", "load", "library_path"]

ZD_MAX_DIMS = 8
ZD_ALL_BUCKETS = -1
ZD_ANY_RANK = -1

ZD_F32 = 1
ZD_BF16 = 2
ZD_F16 = 3

ZD_ADAMW = 0
ZD_ADAM = 1

ZD_UPDATE_TORCH113 = 0
ZD_UPDATE_TORCH2 = 1

ZD_SQRT_EXACT = 0
ZD_SQRT_MKL_EX = 1

ZD_CLIP_NORM_DOUBLE = 0
ZD_CLIP_NORM_TORCH113 = 1
ZD_CLIP_NORM_TORCH26 = 2
ZD_CLIP_NORM_TORCH215 = 3

ZD_REGISTER_REPLACE = 0x1
ZD_STEP_NO_SCATTER = 0x1
ZD_STEP_NO_GATHER = 0x2

ZD_MEMORY_HOST = 0
ZD_MEMORY_CUDA = 1

ZD_GRAD_MEAN = 0
ZD_GRAD_SUM = 1

ZD_CHECKPOINT_NO_WAIT = 0x1

# zerod/errors.h: values are part of the wire protocol and never renumbered.
ZD_OK = 0
ZD_EPROTO = -4001
ZD_EVERSION = -4002
ZD_ETOOBIG = -4003
ZD_ETYPE = -4004
ZD_EORDER = -4005
ZD_EBUFFER = -4006
ZD_EDTYPE = -4007
ZD_EGROUP = -4008
ZD_EHPARAM = -4009
ZD_ELAYOUT = -4010
ZD_ERANK = -4011
ZD_EBUSY = -4012
ZD_ESTEP = -4013
ZD_EPEER = -4014
ZD_EDEGRADED = -4015
ZD_ESHUTDOWN = -4016
ZD_EDENIED = -4017
ZD_EBACKEND = -4018
ZD_ECLOSED = -4019
ZD_EINTERNAL = -4020
ZD_ECONFIG = -4021
ZD_EAPPLIED = -4022
ZD_EABORTED = -4023
ZD_ECHECKPOINT = -4024


# zd_field_kind_t
ZD_FIELD_DOUBLE = 0
ZD_FIELD_ENUM = 1
ZD_FIELD_BOOL = 2
_FIELD_CTYPES = {ZD_FIELD_DOUBLE: ctypes.c_double, ZD_FIELD_ENUM: ctypes.c_int,
                 ZD_FIELD_BOOL: ctypes.c_int}


class zd_group_field_t(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("kind", ctypes.c_int),  # zd_field_kind_t
        ("offset", ctypes.c_size_t),
        ("default_value", ctypes.c_double),
    ]


class zd_group_t(ctypes.Structure):
    """zd_group_t. Its _fields_ are set by load(), from libzerod's own description of the
    structure (zd_group_fields): usable once the library is loaded."""


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


class zd_param_t(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("ndim", ctypes.c_uint32),
        ("shape", ctypes.c_uint64 * ZD_MAX_DIMS),
        ("group", ctypes.c_uint32),
    ]


class _Sized(ctypes.Structure):
    """A structure of zerod.h that begins with its size: a new instance sets it, as the header's
    ZD_*_INIT initialisers do, so that libzerod knows which fields this package has."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.size = ctypes.sizeof(self)


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
        ("memory", ctypes.c_int),  # zd_memory_t: ZD_MEMORY_HOST or ZD_MEMORY_CUDA
        ("device", ctypes.c_int),  # CUDA ordinal of the buffers with ZD_MEMORY_CUDA
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

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None
_group_fields: List[GroupField] = []


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


def load() -> ctypes.CDLL:
    """Loads libzerod once (thread-safe) and returns it with every prototype declared."""
    global _lib, _path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        candidates = _candidates()
        if not candidates:
            raise LibraryNotFoundError(
                "libzerod not found: build it (ninja -C build) and install this package from the "
                "checkout (pip install ./client/python bundles build/client/libzerod.so), or "
                "install it with `meson install` so that ctypes.util.find_library('zerod') "
                "finds it, or set ZEROD_LIBRARY to the path of libzerod.so")
        try:
            lib = ctypes.CDLL(candidates[0])
        except OSError as e:
            raise LibraryNotFoundError(f"cannot load libzerod from {candidates[0]}: {e}") from e
        _define_group(lib, candidates[0])
        for name, (restype, argtypes) in _PROTOTYPES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as e:
                raise LibraryNotFoundError(
                    f"{candidates[0]} has no symbol {name}: not a libzerod this package "
                    f"supports") from e
            fn.restype = restype
            fn.argtypes = argtypes
        _path = candidates[0]
        _lib = lib
        return lib


def _define_group(lib: ctypes.CDLL, path: str) -> None:
    """Gives zd_group_t the fields the library describes, in its order, and checks that ctypes
    lays them out where the C compiler did."""
    try:
        describe = lib.zd_group_fields
    except AttributeError as e:
        raise LibraryNotFoundError(f"{path} has no symbol zd_group_fields: not a libzerod this "
                                   f"package supports") from e
    describe.restype = ctypes.c_size_t
    describe.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
                         ctypes.POINTER(ctypes.c_size_t)]
    table, stride, size = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
    n = describe(ctypes.byref(table), ctypes.byref(stride), ctypes.byref(size))
    if stride.value < ctypes.sizeof(zd_group_field_t):
        raise LibraryNotFoundError(f"{path}: zd_group_fields() elements are {stride.value} bytes, "
                                   f"fewer than this package's: an older libzerod than this "
                                   f"package")
    # walked by the library's element size: a newer library's elements may be larger
    fields = [zd_group_field_t.from_address(table.value + i * stride.value) for i in range(n)]
    if any(f.kind not in _FIELD_CTYPES for f in fields):
        raise LibraryNotFoundError(f"{path} describes a zd_group_t field of an unknown kind: a "
                                   f"newer libzerod than this package")
    layout = [(f.name.decode(), _FIELD_CTYPES[f.kind]) for f in fields]
    if "_fields_" not in zd_group_t.__dict__:  # set once: ctypes refuses to change it
        zd_group_t._fields_ = layout
    placed = [(name, getattr(zd_group_t, name).offset) for name, _ in layout]
    if placed != [(f.name.decode(), f.offset) for f in fields] or \
            ctypes.sizeof(zd_group_t) != size.value:
        raise LibraryNotFoundError(f"{path}: zd_group_t does not lay out as described")
    _group_fields[:] = [GroupField(f.name.decode(), f.kind, f.default_value) for f in fields]


def group_fields() -> List[GroupField]:
    """The fields of zd_group_t in declaration order (loading the library on first use)."""
    load()
    return _group_fields


def lib() -> ctypes.CDLL:
    """The loaded library (loading it on first use)."""
    return _lib if _lib is not None else load()


def library_path() -> str:
    """Path of the loaded libzerod."""
    load()
    assert _path is not None
    return _path


def free(ptr: int) -> None:
    """Releases memory the library allocated (zd_status's text), with the library's own free:
    a libc looked up here may not be the allocator libzerod used (an ASan runtime preloaded)."""
    load().zd_free(ptr)
