"""The :class:`~objckpt.storage.fsspec.store.FsspecStore` class that serves a filesystem.

The adapter's base class knows none of its subclasses; this module, which the
store factories call, picks one per filesystem, once, when the store is opened.
"""

from __future__ import annotations

import sys
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from objckpt.storage.fsspec.local import LocalFsspecStore
from objckpt.storage.fsspec.memory import MemoryFsspecStore
from objckpt.storage.fsspec.s3 import S3FsspecStore
from objckpt.storage.fsspec.store import FsspecStore


def store_class(fs: AbstractFileSystem) -> type[FsspecStore]:
    """The :class:`FsspecStore` class that serves ``fs``: its own, else the generic one."""
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None and isinstance(fs, s3fs.S3FileSystem):
        return S3FsspecStore
    gcsfs_core = sys.modules.get("gcsfs.core")
    if gcsfs_core is not None and isinstance(fs, gcsfs_core.GCSFileSystem):
        from objckpt.storage.fsspec.gcs import GcsFsspecStore  # its uploader imports aiohttp and google-auth

        return GcsFsspecStore
    if isinstance(fs, LocalFileSystem):
        return LocalFsspecStore
    if isinstance(fs, MemoryFileSystem):
        return MemoryFsspecStore
    return FsspecStore


def for_filesystem(fs: AbstractFileSystem, path: str, **kwargs: Any) -> FsspecStore:
    """A store rooted at ``path`` on ``fs``, of the class that serves ``fs``
    (:func:`store_class`); ``kwargs`` as for :class:`FsspecStore`."""
    return store_class(fs)(fs, path, **kwargs)
