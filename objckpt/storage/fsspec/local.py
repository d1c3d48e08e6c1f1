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
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from objckpt.errors import StoreError, StorePermissionError
from objckpt.storage.base import ObjectInfo, PutMode
from objckpt.storage.errors import PROGRAMMING_ERRORS as _PROGRAMMING_ERRORS
from objckpt.storage.errors import map_error
from objckpt.storage.fsspec import posix as _local
from objckpt.storage.fsspec.posix import Body
from objckpt.storage.fsspec.store import FsspecStore
from objckpt.storage.http.reader import HttpRangeReader
from objckpt.storage.streaming import STREAM_PIECE, ReadSink
from objckpt.storage.urls import check_relative

T = TypeVar("T")


class LocalFsspecStore(FsspecStore):
    """A :class:`FsspecStore` on fsspec's ``LocalFileSystem``, contained in its root."""

    puts_parts = True  # each part is written into the temporary file in turn, never joined
    streams_reads = True  # read piece by piece into the sink's own memory (get_range_streamed)
    writes_on_host = True

    async def put_parts(self, key: str, parts: Sequence[memoryview], *, mode: PutMode = "overwrite") -> None:
        await self._put(key, tuple(parts), mode)

    def _atomic_create(self, requested: bool | None) -> bool:
        return True  # os.link of a complete temporary file fails with EEXIST atomically

    def _use_range_reader(self, reader: HttpRangeReader | None) -> None:
        super()._use_range_reader(reader)
        self.streams_reads = True  # the file itself streams (get_range_streamed), no HTTP reader

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

    async def get_range_streamed(self, key: str, *, start: int, end: int, sink: ReadSink) -> int:
        """Bytes ``[start, end)`` handed to ``sink`` as they are read, each piece read straight
        into the place the sink names for it where it names one (:func:`objckpt.storage.fsspec.posix.stream_range`).

        The file's errors are mapped as :meth:`get_range` maps them; the sink's own pass
        through as they are. Under the request timeout; a read abandoned there stops calling
        the sink before its next piece.
        """
        check_relative(key, "key", allow_empty=False, allow_partial=False)
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end}) for {self._url(key)}")
        what = f"get {self._url(key)} bytes [{start}, {end})"
        stopped = threading.Event()
        read = functools.partial(_local.stream_range, piece=STREAM_PIECE, stopped=stopped)
        try:
            return await self._local(what, read, key, start, end, sink)
        except _local.SinkRaised as raised:
            raise raised.error from None
        except _PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            raise map_error(exc, what) from exc
        finally:
            stopped.set()

    async def _write(self, what: str, key: str, data: Body, create: bool) -> None:
        try:
            await self._local(what, functools.partial(_local.write_inside, exclusive=create), key, data)
        except _local.ParentNotDirectoryError as exc:
            raise StoreError(f"{what} failed: a parent of the key exists as an object") from exc

    async def _remove(self, what: str, key: str) -> None:
        await self._local(what, _local.remove_inside, key)
