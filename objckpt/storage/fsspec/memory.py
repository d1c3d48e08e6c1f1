"""MemoryFsspecStore: fsspec's in-process memory filesystem, create-if-absent under one lock."""

from __future__ import annotations

import threading

from fsspec import AbstractFileSystem

from objckpt.storage.fsspec.posix import Body
from objckpt.storage.fsspec.store import FsspecStore

_MEMORY_LOCK = threading.Lock()


class MemoryFsspecStore(FsspecStore):
    """fsspec's in-process memory filesystem: create-if-absent is check-then-write
    under one process-wide lock, which every writer through objckpt takes."""

    def _atomic_create(self, requested: bool | None) -> bool:
        return True

    async def _write(self, what: str, key: str, data: Body, create: bool) -> None:
        await self._in_thread(what, _memory_put, self.fs, self._path(key), data, create)


def _memory_put(fs: AbstractFileSystem, path: str, data: Body, create: bool) -> None:
    with _MEMORY_LOCK:
        if create and fs.exists(path):
            raise FileExistsError(path)
        fs.pipe_file(path, b"".join(data) if isinstance(data, tuple) else bytes(data))
