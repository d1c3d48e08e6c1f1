"""The fsspec store on local disk: atomic writes, and every path kept inside the root.

Each step that touches a file goes through :mod:`objckpt.storage.fsspec.posix`, run
on a worker thread: writes land through a temporary file and one atomic
rename or link, reads open only regular files, and a key whose path resolves
outside the store's root through a symbolic link is refused. Its refusals
become :class:`StorePermissionError` (outside the root) and
:class:`StoreError` (not a regular file, or a parent of the key is a file),
naming the key and the root. Listings go through fsspec's local filesystem
and hide in-flight temporary files.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from objckpt.errors import StoreError, StorePermissionError
from objckpt.storage.base import ObjectInfo, PutMode
from objckpt.storage.fsspec import posix as _local
from objckpt.storage.fsspec.posix import Body
from objckpt.storage.fsspec.store import FsspecStore

T = TypeVar("T")


class LocalFsspecStore(FsspecStore):
    """A :class:`FsspecStore` on fsspec's ``LocalFileSystem``, contained in its root."""

    puts_parts = True  # each part is written into the temporary file in turn, never joined
    writes_on_host = True

    async def put_parts(self, key: str, parts: Sequence[memoryview], *, mode: PutMode = "overwrite") -> None:
        await self._put(key, tuple(parts), mode)

    def _atomic_create(self, requested: bool | None) -> bool:
        return True  # os.link of a complete temporary file fails with EEXIST atomically

    def _hidden(self, rel: str) -> bool:
        return _local.is_temp_name(rel)

    async def _local(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """Run one of :mod:`objckpt.storage.fsspec.posix`'s functions on this store's root directory;
        its refusals (a path leading out of the root, a file that is not regular) name the
        key and the root."""
        try:
            return await self._in_thread(what, fn, self._root, *args)
        except _local.OutsideRootError as exc:
            raise StorePermissionError(f"{what}: {exc.strerror}") from exc
        except _local.NotRegularFileError as exc:
            raise StoreError(f"{what}: {exc.strerror}") from exc

    async def _stat(self, what: str, key: str) -> ObjectInfo | None:
        st = await self._local(what, _local.stat_regular, key)
        return ObjectInfo(key=key, size=st.st_size, last_modified=st.st_mtime)

    async def _read_whole(self, what: str, key: str) -> bytes:
        return await self._local(what, _local.read_range, key, 0, None)

    async def _read_range(self, what: str, key: str, start: int, end: int) -> bytes:
        return await self._local(what, _local.read_range, key, start, end)

    async def _write(self, what: str, key: str, data: Body, create: bool) -> None:
        try:
            await self._local(what, functools.partial(_local.write_inside, exclusive=create), key, data)
        except _local.ParentNotDirectoryError as exc:
            raise StoreError(f"{what} failed: a parent of the key exists as an object") from exc

    async def _remove(self, what: str, key: str) -> None:
        await self._local(what, _local.remove_inside, key)
