"""S3 uploads that carry their CRC-32C, and the CRC-32C read back, through botocore.

obstore sends no ``x-amz-checksum-crc32c`` (its S3 checksums are SHA-256 or CRC64NVME,
computed in a second pass over the body), so an obstore S3 store sends its checked
uploads through botocore's ``PutObject(ChecksumCRC32C=...)``: S3 checks the bytes on
arrival, refuses a mismatch (``BadDigest``) and keeps the value, which
``HeadObject(ChecksumMode="ENABLED")`` returns (signed by botocore, sent by
:mod:`objckpt.storage.http.s3_heads`). botocore is synchronous: calls run on
a thread pool of their own, sized like the engine's window. A body of several parts
is read from the parts in place (:class:`PartsReader`): no join into one buffer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import io
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from objckpt.storage.checksums import StoredChecksum, crc32c_header
from objckpt.storage.errors import PROGRAMMING_ERRORS, map_error
from objckpt.storage.http.network import ssl_context
from objckpt.storage.http.s3_heads import S3ChecksumHeads
from objckpt.storage.obstore.botocore_s3 import botocore_credentials, botocore_s3_client

if TYPE_CHECKING:
    from objckpt.storage.obstore.config import NativeSpec

#: Threads (and pooled connections) of one store's checked uploads and checksum reads, at most.
MAX_THREADS = 64


class PartsReader(io.RawIOBase):
    """A seekable, readable file over buffers sent in order as one body (botocore takes
    ``bytes`` or a file; a ``memoryview`` it refuses). Reads copy only what they return."""

    def __init__(self, parts: Sequence[memoryview]) -> None:
        super().__init__()
        self._parts = [memoryview(p).cast("B") for p in parts if len(p)]
        self._starts: list[int] = []
        total = 0
        for part in self._parts:
            self._starts.append(total)
            total += len(part)
        self._size = total
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out) and self._pos < self._size:
            index = _part_at(self._starts, self._pos)
            part, start = self._parts[index], self._starts[index]
            chunk = part[self._pos - start : self._pos - start + len(out) - done]
            out[done : done + len(chunk)] = chunk
            done += len(chunk)
            self._pos += len(chunk)
        return done


def _part_at(starts: list[int], position: int) -> int:
    """The index of the part holding byte ``position`` (binary search over part starts)."""
    low, high = 0, len(starts) - 1
    while low < high:
        middle = (low + high + 1) // 2
        if starts[middle] <= position:
            low = middle
        else:
            high = middle - 1
    return low


class S3Checksums:
    """Checked uploads and checksum reads of one S3 bucket, shared by a store and its children.

    The botocore client is made at the first call (a save to a store that sends no checked
    upload never makes one) and closed with :meth:`close`.

    Args:
        spec: the store's configuration (endpoint, credentials, CA trust).
        request_timeout: seconds for one request (botocore's connect and read timeouts).
        threads: calls in flight at most.
    """

    def __init__(self, spec: NativeSpec, *, request_timeout: float, threads: int = MAX_THREADS) -> None:
        self._spec = spec
        self._timeout = request_timeout
        self._threads = max(1, min(threads, MAX_THREADS))
        self._extra = {"RequestPayer": "requester"} if spec.config.get("request_payer") else {}
        self._lock = threading.Lock()
        self._client: Any = None
        self._ca_file: str | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._heads: S3ChecksumHeads | None = None

    def _ready(self) -> tuple[Any, concurrent.futures.ThreadPoolExecutor]:
        with self._lock:
            if self._client is None or self._pool is None:
                self._client, self._ca_file = botocore_s3_client(
                    self._spec, request_timeout=self._timeout, connections=self._threads
                )
                self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="objckpt-s3crc")
            return self._client, self._pool

    async def _run(self, what: str, method: str, **params: Any) -> Any:
        client, pool = self._ready()
        fn = functools.partial(getattr(client, method), **params)
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn)
        except PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            raise map_error(exc, what, create="IfNoneMatch" in params) from exc

    async def put(
        self, what: str, bucket: str, name: str, body: Sequence[memoryview], *, crc32c: int, create: bool
    ) -> None:
        """``PutObject`` of ``body`` (parts, in order) with its CRC-32C; ``create``: if absent."""
        extra = {"IfNoneMatch": "*"} if create else {}
        await self._run(
            what,
            "put_object",
            Bucket=bucket,
            Key=name,
            Body=PartsReader(body),
            ChecksumCRC32C=crc32c_header(crc32c),
            **extra,
            **self._extra,
        )

    async def head(self, what: str, bucket: str, name: str, key: str) -> StoredChecksum:
        """The object's size and the CRC-32C S3 keeps of it (None: it keeps none): a
        ``HeadObject(ChecksumMode=ENABLED)`` signed by botocore and sent over a kept-alive
        connection (:mod:`objckpt.storage.http.s3_heads`), a quarter of a botocore call's CPU."""
        return await self._heads_ready().head_checksum(name, key, what)

    def _heads_ready(self) -> S3ChecksumHeads:
        with self._lock:
            if self._heads is None:
                spec, config = self._spec, self._spec.config
                self._heads = S3ChecksumHeads(
                    endpoint=spec.endpoint,
                    bucket=spec.bucket,
                    region=config["region"],
                    credentials=botocore_credentials(spec),
                    virtual_hosted=bool(config.get("virtual_hosted_style_request")),
                    request_payer=bool(config.get("request_payer")),
                    timeout=self._timeout,
                    ssl_context=ssl_context(
                        extra_ca=spec.client.get("root_certificate"),
                        verify=not spec.client.get("allow_invalid_certificates"),
                    ),
                )
            return self._heads

    def close(self) -> None:
        """Close the client and its threads (a later call makes new ones)."""
        with self._lock:
            client, self._client = self._client, None
            pool, self._pool = self._pool, None
            ca_file, self._ca_file = self._ca_file, None
            heads, self._heads = self._heads, None
        if heads is not None:
            heads.close()
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        if pool is not None:
            pool.shutdown(wait=False)
        if ca_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(ca_file)
