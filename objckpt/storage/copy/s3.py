"""S3 server-side copies for the native (obstore) store: botocore's ``CopyObject`` and
``UploadPartCopy``, as obstore copies only within one bucket.

:class:`S3Copier` builds a botocore client from the destination store's own
configuration and runs one request per call under the caller's ``call`` (the
transfer engine: timeout, retries, concurrency). A multipart copy holds at most
:data:`MULTIPART_COPY_CONCURRENCY` part requests and S3's :data:`MAX_PARTS` part
records at once, however large the size it is given. Nothing here signs a request:
the protocol is botocore's. Written here: the sequence of calls (create, parts,
complete, abort on failure). Whether to copy server-side at all is decided in
:mod:`objckpt.storage.copy.server`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from objckpt.errors import StoreError
from objckpt.storage.errors import PROGRAMMING_ERRORS, map_error
from objckpt.storage.obstore.botocore_s3 import botocore_s3_client

if TYPE_CHECKING:
    from objckpt.storage.obstore.config import NativeSpec

#: Objects larger than this are copied in parts (``UploadPartCopy``) by :class:`S3Copier`;
#: S3 copies at most 5 GiB in one ``CopyObject``.
MULTIPART_COPY_THRESHOLD = 1024 * 1024 * 1024
#: Part size of those copies (S3: 5 MiB to 5 GiB; every part but the last at least 5 MiB).
MULTIPART_COPY_PART_SIZE = 256 * 1024 * 1024
#: Parts of one object copied at once.
MULTIPART_COPY_CONCURRENCY = 4
#: S3's limits: parts of one multipart upload, bytes of one part, bytes of one object.
MAX_PARTS = 10_000
MAX_PART_SIZE = 5 * 2**30
MAX_OBJECT_SIZE = 5 * 2**40
#: Thread pool size of an :class:`S3Copier` (botocore is synchronous), at most.
MAX_COPY_THREADS = 32

#: ``call(what, make)``: runs ``make()`` (a fresh awaitable per attempt) as one request,
#: with a timeout and retries: :meth:`objckpt.transfer.engine.TransferEngine.call`.
Call = Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]]
#: ``(bucket, object name)``.
BucketKey = tuple[str, str]


def multipart_part_size(size: int, part_size: int) -> int | None:
    """The part size of a multipart copy of ``size`` bytes: ``part_size``, grown so the
    parts stay within S3's :data:`MAX_PARTS`; None when S3 holds no object that large."""
    if size > MAX_OBJECT_SIZE:
        return None
    grown = max(part_size, -(-size // MAX_PARTS))
    return grown if grown <= MAX_PART_SIZE else None


def single_part_etag(etag: Any) -> str | None:
    """An S3 ETag two copies of an object share: one of a single-part object (an MD5),
    not ``"<hash>-<parts>"``, which depends on how the object was uploaded."""
    if not etag:
        return None
    value = str(etag).strip('"')
    return None if "-" in value else f"etag {value}"


class S3Copier:
    """Server-side copies into an obstore S3 store, with botocore (obstore copies only
    within one bucket).

    The client is built from the store's :class:`~objckpt.storage.obstore.config.NativeSpec`:
    endpoint, region, path or virtual-host addressing, CA trust, requester-pays, and
    credentials from the same source (static keys; the store's credential provider,
    through botocore's refreshable credentials; instance metadata through botocore's
    chain; unsigned for anonymous access). Proxies come from the environment, as for
    every client. botocore is synchronous: calls run on a thread pool of this copier.

    Args:
        dst: The destination store (an ``ObstoreStore`` over S3).
        spec: Its configuration.
        request_timeout: Seconds for one request (botocore's connect and read timeouts).
        concurrency: Requests in flight at most (threads, pooled connections).
        multipart_threshold: Objects larger than this are copied in parts.
        part_size: Size of those parts.
    """

    def __init__(
        self,
        dst: Any,
        spec: NativeSpec,
        *,
        request_timeout: float,
        concurrency: int,
        multipart_threshold: int | None = None,
        part_size: int | None = None,
    ) -> None:
        self._dst = dst
        self._spec = spec
        self.multipart_threshold = MULTIPART_COPY_THRESHOLD if multipart_threshold is None else multipart_threshold
        self.part_size = MULTIPART_COPY_PART_SIZE if part_size is None else part_size
        if not 5 * 2**20 <= self.part_size <= 5 * 2**30:
            raise ValueError("the part size of a multipart copy must be 5 MiB to 5 GiB")
        threads = max(1, min(concurrency, MAX_COPY_THREADS))
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="objckpt-copy")
        self._ca_file: str | None = None
        self._extra = {"RequestPayer": "requester"} if spec.config.get("request_payer") else {}
        try:
            self._client = self._make_client(request_timeout, threads)
        except BaseException:
            self.close()
            raise

    def _make_client(self, request_timeout: float, connections: int) -> Any:
        client, self._ca_file = botocore_s3_client(self._spec, request_timeout=request_timeout, connections=connections)
        return client

    async def _run(self, what: str, method: str, **params: Any) -> Any:
        """One botocore call on the pool, its errors mapped to objckpt's."""
        fn = functools.partial(getattr(self._client, method), **params)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        except PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            raise map_error(exc, what) from exc

    async def copy(self, source: BucketKey, key: str, size: int, call: Call) -> None:
        target = self._dst.bucket_object(key)
        what = f"COPY s3://{'/'.join(source)} -> s3://{'/'.join(target)}"
        params = {"Bucket": target[0], "Key": target[1], **self._extra}
        copy_source = {"Bucket": source[0], "Key": source[1]}
        if size <= self.multipart_threshold:
            await call(what, lambda: self._run(what, "copy_object", CopySource=copy_source, **params))
            return
        part_size = multipart_part_size(size, self.part_size)
        if part_size is None:
            raise StoreError(
                f"{what}: {size} bytes is more than one S3 object holds ({MAX_OBJECT_SIZE} bytes); not copied"
            )
        upload = await call(f"{what} (start)", lambda: self._run(what, "create_multipart_upload", **params))
        upload_id = upload["UploadId"]
        try:
            parts = await self._copy_parts(what, copy_source, params, upload_id, size, part_size, call)
            await call(
                f"{what} (complete)",
                lambda: self._run(
                    what, "complete_multipart_upload", UploadId=upload_id, MultipartUpload={"Parts": parts}, **params
                ),
            )
        except BaseException:
            with contextlib.suppress(Exception):  # best effort: a lifecycle rule or gc cleans up the rest
                await self._run(f"{what} (abort)", "abort_multipart_upload", UploadId=upload_id, **params)
            raise

    async def _copy_parts(
        self,
        what: str,
        copy_source: dict[str, str],
        params: dict[str, Any],
        upload_id: str,
        size: int,
        part_size: int,
        call: Call,
    ) -> list[dict[str, Any]]:
        """The parts of one multipart copy, :data:`MULTIPART_COPY_CONCURRENCY` at a time.

        Part numbers are handed out one by one to a fixed set of workers, so what is held
        at once is bounded by the concurrency, whatever ``size`` is; the first failure
        ends the other workers.
        """
        numbers = iter(range(1, -(-size // part_size) + 1))
        done: dict[int, dict[str, Any]] = {}

        async def worker() -> None:
            for number in numbers:
                first = (number - 1) * part_size
                last = min(first + part_size, size) - 1
                request = functools.partial(
                    self._run,
                    what,
                    "upload_part_copy",
                    CopySource=copy_source,
                    CopySourceRange=f"bytes={first}-{last}",
                    PartNumber=number,
                    UploadId=upload_id,
                    **params,
                )
                answer = await call(f"{what} (part {number}, bytes {first}-{last})", request)
                done[number] = {"PartNumber": number, "ETag": answer["CopyPartResult"]["ETag"]}

        workers = [asyncio.ensure_future(worker()) for _ in range(MULTIPART_COPY_CONCURRENCY)]
        try:
            await asyncio.gather(*workers)
        except BaseException:  # the first failure ends the other parts before the abort
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        return [done[n] for n in sorted(done)]

    async def checksum(self, location: BucketKey, call: Call) -> str | None:
        what = f"HEAD s3://{'/'.join(location)}"
        head = await call(
            what, lambda: self._run(what, "head_object", Bucket=location[0], Key=location[1], **self._extra)
        )
        return single_part_etag(head.get("ETag"))

    def close(self) -> None:
        client = getattr(self, "_client", None)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        self._pool.shutdown(wait=False)
        if self._ca_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._ca_file)
            self._ca_file = None
