"""objckpt: an object-store-first checkpoint engine for JAX.

Save sharded pytrees straight to S3, GCS, local disk or any fsspec store, and
restore them onto any sharding::

    objckpt.save("s3://bucket/run/step_100", state)
    state = objckpt.restore("s3://bucket/run/step_100", abstract_state)
"""

from objckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CoordinationError,
    DeletedArrayError,
    FormatError,
    HostMemoryError,
    IntegrityError,
    ObjckptError,
    SaveInProgressError,
    StoreError,
    StoreNotAvailableError,
    TargetMismatchError,
)
from objckpt.manager.checkpoint_manager import CheckpointManager
from objckpt.manager.retention import KeepBest, KeepEvery, KeepLast, RetentionPolicy
from objckpt.options import Options, RetryConfig
from objckpt.orbax.convert import ConvertStats, convert_orbax, convert_orbax_steps
from objckpt.progress import Progress
from objckpt.restoring.api import restore
from objckpt.restoring.locations import Location
from objckpt.saving.api import SaveHandle, save, save_async
from objckpt.tools.copy import CopyStats, copy
from objckpt.tools.inspect import CheckpointInfo, LeafInfo, inspect
from objckpt.tools.verify import VerifyProblem, VerifyReport, verify
from objckpt.transfer.engine import TransferStats

__version__ = "0.1.0"

__all__ = [
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "ConvertStats",
    "CoordinationError",
    "CopyStats",
    "DeletedArrayError",
    "FormatError",
    "HostMemoryError",
    "IntegrityError",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "LeafInfo",
    "Location",
    "ObjckptError",
    "Options",
    "Progress",
    "RetentionPolicy",
    "RetryConfig",
    "SaveHandle",
    "SaveInProgressError",
    "StoreError",
    "StoreNotAvailableError",
    "TargetMismatchError",
    "TransferStats",
    "VerifyProblem",
    "VerifyReport",
    "convert_orbax",
    "convert_orbax_steps",
    "copy",
    "inspect",
    "restore",
    "save",
    "save_async",
    "verify",
]
