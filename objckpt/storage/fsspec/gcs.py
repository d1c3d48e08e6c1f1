"""GcsFsspecStore: gcsfs, with create-if-absent by generation and bulk writes as media uploads."""

from __future__ import annotations

import builtins
from typing import Any

from fsspec import AbstractFileSystem

from objckpt.errors import BucketNotFoundError, ObjectNotFoundError
from objckpt.storage.base import ObjectInfo
from objckpt.storage.checksums import StoredChecksum, parse_crc32c_header
from objckpt.storage.errors import PROGRAMMING_ERRORS, map_error
from objckpt.storage.fsspec.posix import Body
from objckpt.storage.fsspec.store import FsspecStore
from objckpt.storage.http.gcs_upload import MediaUploader
from objckpt.storage.urls import check_relative


class GcsFsspecStore(FsspecStore):
    """gcsfs: create-if-absent is ``ifGenerationMatch=0``; with an ``uploader``, bulk writes
    send the buffer as the body (:class:`~objckpt.storage.http.gcs_upload.MediaUploader`), else
    they go through gcsfs's ``pipe_file``; listings filter server-side.

    gcsfs answers a listing of a bucket that does not exist as it answers an empty
    prefix (``FileNotFoundError``), and a read in it as a missing object, so the
    first empty listing or missing object read asks for the bucket itself (one
    request per store and its children, not repeated once the bucket answers): a
    404 is :class:`BucketNotFoundError`, anything else (an object-only role refused
    ``storage.buckets.get``) leaves the answer as it was and is not asked again.

    Args:
        uploader: Media uploads with the store's credential, shared by :meth:`child` stores
            and closed with the store; None when gcsfs alone serves the store.
        endpoint: The service URL the store was configured with (``endpoint_url``,
            ``STORAGE_EMULATOR_HOST`` or Google's default), as :attr:`endpoint`; None when unknown.
        **kwargs: As for :class:`FsspecStore`.
    """

    _lists_by_prefix = True
    #: :class:`~objckpt.storage.checksums.KeepsChecksums`: GCS computes a crc32c of every
    #: object and lists it, 1,000 objects a page.
    keeps_checksums = lists_checksums = True

    def __init__(
        self,
        fs: AbstractFileSystem,
        path: str,
        *,
        uploader: MediaUploader | None = None,
        endpoint: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(fs, path, **kwargs)
        self._uploader = uploader
        self.endpoint = endpoint
        self._bucket_known = [False]  # shared with child stores (``child`` copies the attribute)

    def _atomic_create(self, requested: bool | None) -> bool:
        return True

    async def _write(self, what: str, key: str, data: Body, create: bool) -> None:
        if isinstance(data, tuple):  # parts: this store takes one buffer
            data = b"".join(data)
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

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        found = await super().list(prefix)
        if not found:
            await self._check_bucket(f"list {self._url(prefix)}")
        return found

    async def list_checksums(self, prefix: str = "") -> builtins.list[StoredChecksum]:
        """Every object under ``prefix`` with its size and the crc32c GCS computed of it."""
        listed = await self._listed(prefix)
        if not listed:
            await self._check_bucket(f"list {self._url(prefix)}")
        return [
            StoredChecksum(rel, int(info.get("size") or 0), parse_crc32c_header(info.get("crc32c")))
            for rel, info in listed
        ]

    async def head_checksum(self, key: str) -> StoredChecksum:
        """One object's size and the crc32c GCS computed of it."""
        check_relative(key, "key", allow_empty=False, allow_partial=False)
        what = f"head {self._url(key)} (its crc32c)"
        try:
            info = await self._fs(what, "info", self._path(key))
        except PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            raise map_error(exc, what) from exc
        return StoredChecksum(key, int(info.get("size") or 0), parse_crc32c_header(info.get("crc32c")))

    async def get(self, key: str) -> bytes:
        try:
            return await super().get(key)
        except ObjectNotFoundError:
            await self._check_bucket(f"get {self._url(key)}")
            raise

    async def get_range(self, key: str, *, start: int, end: int) -> bytes:
        try:
            return await super().get_range(key, start=start, end=end)
        except ObjectNotFoundError:
            await self._check_bucket(f"get {self._url(key)}")
            raise

    async def _check_bucket(self, what: str) -> None:
        if self._bucket_known[0]:
            return
        bucket = self._root.split("/", 1)[0]
        try:
            await self._fs(what, "call", "GET", "b/{}", bucket, json_out=True)
        except FileNotFoundError:
            raise BucketNotFoundError(f"{what} failed: the bucket {bucket!r} does not exist (HTTP 404)") from None
        except PROGRAMMING_ERRORS:
            raise
        except Exception:  # noqa: BLE001 - refused (an object-only role) or unreachable: the answer stands
            pass
        self._bucket_known[0] = True  # asked once: what it said is not asked again

    async def close(self) -> None:
        """Close the range reader's and the uploader's connections (see :meth:`FsspecStore.close`)."""
        await super().close()
        if self._uploader is not None:
            await self._uploader.close()
