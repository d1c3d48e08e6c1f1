"""A read-only store over byte buffers this process already holds.

A copy of a checkpoint that lies in this process's memory (a local-tier step's data
file mapped from its disk, or a step a peer has just sent back) is read by the same
restore as a bucket, through this store: ranged reads are views of the buffers, no
copy and no I/O. It accepts no writes: what it serves was checked and sealed by
whoever made it, and a restore never writes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from objckpt.errors import ObjectNotFoundError, StorePermissionError
from objckpt.storage.base import ObjectInfo, PutMode, Store


class BufferStore(Store):
    """Objects ``{key: bytes}`` held in memory, under the name ``url`` (for messages and logs)."""

    supports_create = False

    def __init__(self, url: str, objects: Mapping[str, np.ndarray]) -> None:
        self.url = url
        self._objects = {key: np.asarray(data, np.uint8).reshape(-1) for key, data in objects.items()}

    def _object(self, key: str) -> np.ndarray:
        found = self._objects.get(key)
        if found is None:
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist")
        return found

    async def get_range(self, key: str, *, start: int, end: int) -> bytes:
        return bytes(await self.get_range_buffer(key, start=start, end=end))

    async def get_range_buffer(self, key: str, *, start: int, end: int) -> memoryview:
        data = self._object(key)
        return memoryview(data[start:end].data).toreadonly()  # type: ignore[arg-type]

    async def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        raise StorePermissionError(f"{self.url} is read-only: cannot write {key}")

    async def delete(self, key: str) -> None:
        raise StorePermissionError(f"{self.url} is read-only: cannot delete {key}")

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return [
            ObjectInfo(key, int(data.size)) for key, data in sorted(self._objects.items()) if key.startswith(prefix)
        ]

    async def head(self, key: str) -> ObjectInfo:
        return ObjectInfo(key, int(self._object(key).size))

    def child(self, subpath: str) -> Store:
        prefix = subpath.strip("/") + "/"
        inner = {k[len(prefix) :]: v for k, v in self._objects.items() if k.startswith(prefix)}
        return BufferStore(f"{self.url}/{subpath.strip('/')}", inner)
