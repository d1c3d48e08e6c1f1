"""S3FsspecStore: s3fs, with create-if-absent by ``If-None-Match: *`` and checksums from HeadObject."""

from __future__ import annotations

import builtins

from objckpt.storage.checksums import StoredChecksum, parse_crc32c_header
from objckpt.storage.errors import PROGRAMMING_ERRORS, map_error
from objckpt.storage.fsspec.store import FsspecStore
from objckpt.storage.urls import check_relative


class S3FsspecStore(FsspecStore):
    """s3fs: create-if-absent is its ``If-None-Match: *`` PUT; listings filter server-side;
    stored checksums read back by ``HeadObject(ChecksumMode=ENABLED)``
    (:mod:`objckpt.storage.checksums`). Its uploads send no CRC-32C: given one in a header,
    botocore SHA-256-signs the body even over HTTPS, a pass over every byte the unsigned
    uploads skip; the native S3 store sends it (checked on arrival) without that pass."""

    _lists_by_prefix = True
    checks_at_arrival = False
    keeps_checksums = True
    lists_checksums = False  # S3 lists no checksums: one HEAD per object

    async def head_checksum(self, key: str) -> StoredChecksum:
        """The object's size and the CRC-32C S3 keeps of it."""
        check_relative(key, "key", allow_empty=False, allow_partial=False)
        what = f"head {self._url(key)} (its crc32c)"
        bucket, name = self.bucket_object(key)
        try:
            answer = await self._fs(what, "call_s3", "head_object", Bucket=bucket, Key=name, ChecksumMode="ENABLED")
        except PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            raise map_error(exc, what) from exc
        return StoredChecksum(key, int(answer["ContentLength"]), parse_crc32c_header(answer.get("ChecksumCRC32C")))

    async def list_checksums(self, prefix: str = "") -> builtins.list[StoredChecksum]:
        """Every object under ``prefix`` with its size; S3 lists no checksums (``crc32c`` None)."""
        return [StoredChecksum(o.key, o.size, None) for o in await self.list(prefix)]

    def _atomic_create(self, requested: bool | None) -> bool:
        return True

    async def _read_whole(self, what: str, key: str) -> bytes:
        # s3fs would HEAD first to decide on a chunked download; one GET is faster
        # for the small objects this is used for (the transfer engine splits big ones).
        return bytes(await self._fs(what, "cat_file", self._path(key), max_concurrency=1))
