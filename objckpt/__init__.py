"""objckpt: an object-store-first checkpoint engine for JAX.

Save sharded pytrees straight to S3, GCS, local disk or any fsspec store, and
restore them onto any sharding::

    objckpt.save("s3://bucket/run/step_100", state)
    state = objckpt.restore("s3://bucket/run/step_100", abstract_state)
"""

from typing import TYPE_CHECKING, Any

from objckpt.errors import (
    BucketNotFoundError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ChecksumsUnavailableError,
    CoordinationError,
    DeletedArrayError,
    EndpointRefusedError,
    FormatError,
    HostMemoryError,
    IntegrityError,
    ObjckptError,
    ObjectExistsError,
    ObjectNotFoundError,
    PartialCopyError,
    PeerCopyUnavailableError,
    SaveInProgressError,
    StorageOptionError,
    StoreError,
    StoreNotAvailableError,
    StorePermissionError,
    TargetMismatchError,
    ThrottledError,
    TransientStoreError,
)

if TYPE_CHECKING:
    from objckpt.core.items import Json, PerProcess, Stateful
    from objckpt.manager.checkpoint_manager import CheckpointManager
    from objckpt.manager.retention import KeepBest, KeepEvery, KeepLast, RetentionPolicy
    from objckpt.manager.save_policy import SavePolicy
    from objckpt.manager.settings import LocalCopies, Replication, Retention
    from objckpt.options import Options, RetryConfig
    from objckpt.orbax.convert import ConvertStats, convert_orbax, convert_orbax_steps
    from objckpt.progress import Progress
    from objckpt.restoring.api import restore
    from objckpt.restoring.locations import Location
    from objckpt.safetensors.export import ExportStats, export_safetensors
    from objckpt.saving.api import SaveHandle, save, save_async
    from objckpt.tools.copy import CopyStats, copy
    from objckpt.tools.inspect import CheckpointInfo, LeafInfo, inspect
    from objckpt.tools.verify import VerifyProblem, VerifyReport, verify
    from objckpt.transfer.stats import TransferStats

#: Where each public name lives. They are imported on first use (PEP 562), so that
#: ``import objckpt`` — and with it the ``objckpt`` command, whose ``--help``, ``ls``,
#: ``rm``, ``gc``, ``cp`` and ``verify`` make no arrays — does not pay for importing JAX.
_LAZY = {
    "Json": "objckpt.core.items",
    "PerProcess": "objckpt.core.items",
    "Stateful": "objckpt.core.items",
    "CheckpointManager": "objckpt.manager.checkpoint_manager",
    "KeepBest": "objckpt.manager.retention",
    "KeepEvery": "objckpt.manager.retention",
    "KeepLast": "objckpt.manager.retention",
    "RetentionPolicy": "objckpt.manager.retention",
    "SavePolicy": "objckpt.manager.save_policy",
    "LocalCopies": "objckpt.manager.settings",
    "Replication": "objckpt.manager.settings",
    "Retention": "objckpt.manager.settings",
    "Options": "objckpt.options",
    "RetryConfig": "objckpt.options",
    "ConvertStats": "objckpt.orbax.convert",
    "convert_orbax": "objckpt.orbax.convert",
    "convert_orbax_steps": "objckpt.orbax.convert",
    "Progress": "objckpt.progress",
    "restore": "objckpt.restoring.api",
    "Location": "objckpt.restoring.locations",
    "ExportStats": "objckpt.safetensors.export",
    "export_safetensors": "objckpt.safetensors.export",
    "SaveHandle": "objckpt.saving.api",
    "save": "objckpt.saving.api",
    "save_async": "objckpt.saving.api",
    "CopyStats": "objckpt.tools.copy",
    "copy": "objckpt.tools.copy",
    "CheckpointInfo": "objckpt.tools.inspect",
    "LeafInfo": "objckpt.tools.inspect",
    "inspect": "objckpt.tools.inspect",
    "VerifyProblem": "objckpt.tools.verify",
    "VerifyReport": "objckpt.tools.verify",
    "verify": "objckpt.tools.verify",
    "TransferStats": "objckpt.transfer.engine",
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept in this module's namespace."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'objckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "ChecksumsUnavailableError",
    "ConvertStats",
    "CoordinationError",
    "CopyStats",
    "DeletedArrayError",
    "EndpointRefusedError",
    "ExportStats",
    "FormatError",
    "HostMemoryError",
    "IntegrityError",
    "Json",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "LeafInfo",
    "LocalCopies",
    "Location",
    "ObjckptError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "Options",
    "PartialCopyError",
    "PeerCopyUnavailableError",
    "PerProcess",
    "Progress",
    "Replication",
    "Retention",
    "RetentionPolicy",
    "RetryConfig",
    "SaveHandle",
    "SaveInProgressError",
    "SavePolicy",
    "Stateful",
    "StorageOptionError",
    "StoreError",
    "StoreNotAvailableError",
    "StorePermissionError",
    "TargetMismatchError",
    "ThrottledError",
    "TransferStats",
    "TransientStoreError",
    "VerifyProblem",
    "VerifyReport",
    "convert_orbax",
    "convert_orbax_steps",
    "copy",
    "export_safetensors",
    "inspect",
    "restore",
    "save",
    "save_async",
    "verify",
]
