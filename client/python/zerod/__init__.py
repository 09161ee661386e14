"""zerod: Python client of zerod, the per-node daemon that owns the optimizer side of ZeRO
data-parallel training (fp32 master weights and Adam moments, sharded over the ranks).

The core (`zerod.Client`, this module) is pure Python over libzerod through ctypes and needs
only the standard library. `zerod.torch` adds `ZeroOptimizer`, a torch.optim.Optimizer whose
parameters and gradients live in zerod's shared buffers; `zerod.ddp` hands a
DistributedDataParallel model's gradient reduction to zerod (no all-reduce); `zerod.hf` is
Hugging Face Trainer on zerod (`ZeroTrainer`, needs transformers); `zerod.testing` starts local
daemons for tests and examples. (`zerod.ddp` and `zerod.hf` are imported on demand: they need
torch, and transformers.)

libzerod is found through $ZEROD_LIBRARY, then next to this package, then the system library
path (see zerod._lib).
"""

from .client import (
    ALL_BUCKETS,
    ANY_RANK,
    BucketInfo,
    Client,
    DeviceArray,
    DType,
    Group,
    Info,
    LossScaler,
    Param,
    ParamInfo,
    Request,
    StepResult,
    ZerodError,
    connect,
    dtype_of,
    parse_status,
)
from ._lib import LibraryNotFoundError, library_path

__version__ = "0.1.0"

__all__ = [
    "ALL_BUCKETS",
    "ANY_RANK",
    "BucketInfo",
    "Client",
    "DeviceArray",
    "DType",
    "Group",
    "Info",
    "LibraryNotFoundError",
    "LossScaler",
    "Param",
    "ParamInfo",
    "Request",
    "StepResult",
    "ZerodError",
    "connect",
    "dtype_of",
    "library_path",
    "parse_status",
]
