"""GcsFsspecStore: gcsfs, with create-if-absent by generation and bulk writes as media uploads."""

from __future__ import annotations

from typing import Any

from fsspec import AbstractFileSystem

from objckpt.storage.fsspec_store import FsspecStore
from objckpt.storage.gcs_upload import MediaUploader


class GcsFsspecStore(FsspecStore):
    """gcsfs: create-if-absent is ``ifGenerationMatch=0``; with an ``uploader``, bulk writes
    send the buffer as the body (:class:`~objckpt.storage.gcs_upload.MediaUploader`), else
    they go through gcsfs's ``pipe_file``; listings filter server-side.

    Args:
        uploader: Media uploads with the store's credential, shared by :meth:`child` stores
            and closed with the store; None when gcsfs alone serves the store.
        **kwargs: As for :class:`FsspecStore`.
    """

    _lists_by_prefix = True

    def __init__(
        self, fs: AbstractFileSystem, path: str, *, uploader: MediaUploader | None = None, **kwargs: Any
    ) -> None:
        super().__init__(fs, path, **kwargs)
        self._uploader = uploader

    def _atomic_create(self, requested: bool | None) -> bool:
        return True

    async def _write(self, what: str, key: str, data: bytes | memoryview, create: bool) -> None:
        path = self._path(key)
        uploader = self._uploader
        if create:  # small (a manifest): the emulator checks the precondition only here
            await self._fs(what, "pipe_file", path, data, mode="create")
            return
        if uploader is None:
            await super()._write(what, key, data, create)
            return
        bucket, _, name = path.partition("/")  # bulk data: the buffer is the body, no copy
        await self._run(what, lambda: self._on_fs_loop(uploader.upload(bucket, name, data, what)))
        self.fs.invalidate_cache(path)

    async def close(self) -> None:
        """Close the range reader's and the uploader's connections (see :meth:`FsspecStore.close`)."""
        await super().close()
        if self._uploader is not None:
            await self._uploader.close()
