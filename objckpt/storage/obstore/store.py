"""A :class:`Store` over obstore (Rust ``object_store``): the native fast path.

obstore's async functions run on its own Tokio runtime, so requests need
neither a Python thread each nor fsspec's event-loop thread; the caller's
loop only awaits them (``benchmarks/bench_stores.py`` compares it with the
fsspec stores).

Choices, and why:

* **Retries: obstore's are off** (``max_retries=0``). objckpt's transfer
  engine retries with backoff under a per-operation deadline and counts
  them; two retry layers would multiply attempts and hide stalls.
* **Timeouts, twice**: ``asyncio.wait_for(request_timeout)`` bounds the whole
  call here (a multipart upload or a listing is several requests) and cancels
  its requests in Rust; obstore's client ``timeout``, a second longer, bounds
  each HTTP request as a backstop.
* **Errors keep no response body**, their causes included
  (:func:`~objckpt.storage.errors.redacted_cause`): AWS echoes the session token in one.
* **No copy on put**: a ``bytes``/``bytearray``/``memoryview``/numpy buffer
  is handed to obstore through the buffer protocol (cast to unsigned bytes,
  never copied unless it is strided). ``get_range`` returns ``bytes`` as
  the contract says, one copy out of obstore's buffer (~0.4 CPU-s per GiB
  here); ``get_range_buffer`` returns a view of that buffer instead.
  ``put_parts`` hands obstore a list of buffers, which it sends as one body
  without joining them: a save uploads array bytes where they lie.
* **Streamed ranged reads** (``get_range_streamed``, S3): URLs presigned by
  obstore and sent by :mod:`objckpt.storage.http.s3`, so
  restore can scatter each few MiB of a read it copies out of while they
  are in cache (:mod:`objckpt.storage.streaming` says why).
* **Multipart only past S3's single-PUT limit** (> 5 GiB by default, 16 MiB
  parts): each blob stays one PUT (:mod:`objckpt.saving.blob_sizing` says why).
  Create-if-absent is always a single-request PUT: GCS ignores preconditions on XML multipart.
* **Checked uploads on S3** (``put_checked``): obstore cannot send an
  ``x-amz-checksum-crc32c``, so an upload that carries its CRC-32C goes through
  botocore (:mod:`objckpt.storage.obstore.s3_checksums`), as does the
  ``HeadObject(ChecksumMode=ENABLED)`` that reads it back (``head_checksum``).
* **Errors by class** (:func:`~objckpt.storage.errors.map_obstore_error`).
  A range starting at or past the end of an object is an error to obstore
  (an HTTP 416); here it reads as ``b""``, like every other store.
* **Keys**: one obstore store per bucket; :meth:`child` stores share it
  (and its connection pool), adding their prefix to each key.
"""

from __future__ import annotations

import asyncio
import builtins
import datetime as _dt
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import obstore as obs

from objckpt.errors import ObjectNotFoundError, ThrottledError, TransientStoreError
from objckpt.storage.base import DEFAULT_REQUEST_TIMEOUT_S, ObjectInfo, PutMode
from objckpt.storage.checksums import StoredChecksum
from objckpt.storage.endpoint import ConfiguredEndpoint
from objckpt.storage.errors import PROGRAMMING_ERRORS, map_obstore_error, redacted_cause
from objckpt.storage.http.reader import HttpRangeReader, StreamingStore
from objckpt.storage.http.s3 import S3RangeReader
from objckpt.storage.obstore.config import NativeSpec
from objckpt.storage.obstore.s3_checksums import S3Checksums
from objckpt.storage.obstore.tls import tls_of
from objckpt.storage.phase import malloc_phase
from objckpt.storage.urls import check_relative, redact_url

if TYPE_CHECKING:
    from obstore.store import ClientConfig, GCSConfig, RetryConfig, S3Config

T = TypeVar("T")

#: Puts larger than this use a multipart upload (never for create-if-absent): S3's largest single PUT.
DEFAULT_MULTIPART_THRESHOLD = 5 * 1024 * 1024 * 1024
#: Part size of a multipart upload (S3 allows 5 MiB to 5 GiB).
DEFAULT_MULTIPART_CHUNK_SIZE = 16 * 1024 * 1024
#: Parts of one multipart upload in flight at once.
DEFAULT_MULTIPART_CONCURRENCY = 4
#: Objects per page when listing (S3 returns at most 1,000 per request).
_LIST_CHUNK = 1000


def _as_buffer(data: bytes | bytearray | memoryview | Any) -> bytes | memoryview:
    """``data`` as a 1-D unsigned-byte buffer obstore accepts, copying only if strided."""
    if isinstance(data, bytes):
        return data
    view = memoryview(data)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    if not view.c_contiguous:
        return view.tobytes()  # a strided view cannot be sent without gathering it
    return view.cast("B")


def _epoch(value: Any) -> float | None:
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.UTC)
        return value.timestamp()
    return None


class ObstoreStore(StreamingStore):
    """A :class:`Store` rooted at ``prefix`` inside one obstore store.

    Args:
        store: An obstore ``S3Store``, ``GCSStore`` or ``LocalStore`` (no
            prefix of its own needed); shared by :meth:`child` stores.
        url: The root URL shown in messages; credentials are stripped.
        prefix: Key prefix of the root inside ``store`` (``""`` or ``"a/b"``).
        request_timeout: Seconds allowed per call; exceeding it raises
            :class:`TransientStoreError` (caused by a ``TimeoutError``).
        multipart_threshold: Overwrite puts larger than this many bytes use
            a multipart upload.
        multipart_chunk_size: Part size of those uploads.
        multipart_concurrency: Parts in flight per upload.
        range_reader: Streams ranged GETs (:meth:`get_range_streamed`; see
            :func:`range_reader`), shared by :meth:`child` stores.
        native_spec: The configuration ``store`` was built from (:func:`open_spec`), which
            server-side copies read (:mod:`objckpt.storage.copy.server`); None for a local store.
        checksums: Checked uploads and checksum reads (S3 only; shared by :meth:`child`
            stores); None where the store keeps no CRC-32C objckpt can send or read.
    """

    reads_in_place = True  # object_store sizes one buffer from Content-Length and fills it
    puts_parts = True  # a list of buffers is one body, each segment held, not joined

    def __init__(
        self,
        store: Any,
        *,
        url: str,
        prefix: str = "",
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        multipart_chunk_size: int = DEFAULT_MULTIPART_CHUNK_SIZE,
        multipart_concurrency: int = DEFAULT_MULTIPART_CONCURRENCY,
        range_reader: HttpRangeReader | None = None,
        native_spec: NativeSpec | None = None,
        configured_endpoint: ConfiguredEndpoint | None = None,
        checksums: S3Checksums | None = None,
    ) -> None:
        if request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {request_timeout}")
        if multipart_chunk_size < 5 * 1024 * 1024:
            raise ValueError("multipart_chunk_size must be at least 5 MiB (the S3 minimum part size)")
        prefix = prefix.strip("/")
        if prefix:
            check_relative(prefix, "prefix", allow_empty=False, allow_partial=False)
        self._store = store
        self._prefix = f"{prefix}/" if prefix else ""
        self.url = redact_url(url)
        self.request_timeout = float(request_timeout)
        self.multipart_threshold = int(multipart_threshold)
        self.multipart_chunk_size = int(multipart_chunk_size)
        self.multipart_concurrency = int(multipart_concurrency)
        self._use_range_reader(range_reader)
        self.native_spec = native_spec
        self.configured_endpoint = configured_endpoint
        self._checksums = checksums
        #: :class:`~objckpt.storage.checksums.ChecksAtArrival` and ``KeepsChecksums`` (S3)
        self.checks_at_arrival = self.keeps_checksums = checksums is not None
        self.lists_checksums = False  # S3 lists no checksums: one HEAD per object

    def _path(self, key: str) -> str:
        return f"{self._prefix}{key}"

    def bucket_object(self, key: str) -> tuple[str, str] | None:
        """``(bucket, object name)`` of ``key``, for server-side copies
        (:func:`objckpt.storage.copy.server.source_location`); None for a local store."""
        spec = self.native_spec
        return None if spec is None else (spec.bucket, self._path(key))

    def _url(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    async def _call(self, what: str, make: Callable[[], Awaitable[T]], *, create: bool = False) -> T:
        """Await ``make()`` under the request timeout, mapping obstore's errors; the store's
        configured endpoint is checked first (:mod:`objckpt.storage.endpoint`)."""
        if self.configured_endpoint is not None:
            await self.configured_endpoint.check(what)
        try:
            return await asyncio.wait_for(make(), self.request_timeout)
        except TimeoutError as exc:  # ours (the client's own, a little later, would say "error sending request")
            raise TransientStoreError(f"{what} timed out after {self.request_timeout:g} s") from exc
        except PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            error = map_obstore_error(exc, what, create=create)
            if error is exc:
                raise
            cause = redacted_cause(exc)  # obstore's text holds the service's whole answer
        raise error from cause

    async def head(self, key: str) -> ObjectInfo:
        check_relative(key, "key", allow_empty=False, allow_partial=False)
        meta = await self._call(f"head {self._url(key)}", lambda: obs.head_async(self._store, self._path(key)))
        return ObjectInfo(key=key, size=int(meta["size"]), last_modified=_epoch(meta.get("last_modified")))

    async def get(self, key: str) -> bytes:
        """The whole object in one request (no ``head`` first)."""
        check_relative(key, "key", allow_empty=False, allow_partial=False)

        async def fetch() -> bytes:
            result = await obs.get_async(self._store, self._path(key))
            return bytes(await result.bytes_async())

        return await self._call(f"get {self._url(key)}", fetch)

    async def get_range(self, key: str, *, start: int, end: int) -> bytes:
        return bytes(await self.get_range_buffer(key, start=start, end=end))

    async def get_range_buffer(self, key: str, *, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` as a read-only view of obstore's buffer (no copy)."""
        check_relative(key, "key", allow_empty=False, allow_partial=False)
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end}) for {self._url(key)}")
        if end == start:
            await self.head(key)  # an empty range still requires the object
            return memoryview(b"")
        what = f"get {self._url(key)} bytes [{start}, {end})"
        try:
            data = await self._call(
                what, lambda: obs.get_range_async(self._store, self._path(key), start=start, end=end)
            )
        except TransientStoreError as exc:
            if isinstance(exc, ThrottledError) or isinstance(exc.__cause__, TimeoutError):
                raise  # a 429/503 or our own timeout: nothing to learn from the object's size
            # A range starting at or past the end is an error (HTTP 416) that
            # obstore reports without a status; the object's size tells.
            info = await self.head(key)  # raises ObjectNotFoundError if it is gone
            if start >= info.size:
                return memoryview(b"")
            raise
        return memoryview(data)

    def response_phase(self) -> int | None:
        """Where large responses start past a 64-byte boundary
        (:class:`objckpt.restoring.aligned_reads.AlignedResponses`): obstore's buffers come
        from the Rust (system) allocator, not from Python's ``bytes``."""
        return malloc_phase()

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_relative(prefix, "prefix", allow_empty=True, allow_partial=True)
        # obstore matches whole path segments ("b" lists "b/c" but not "bc"):
        # list the enclosing "directory" and filter by the string prefix here.
        directory = prefix.rpartition("/")[0]
        base = self._path(directory).rstrip("/") if directory else self._prefix.rstrip("/")
        root = self._prefix

        async def collect() -> list[ObjectInfo]:
            out: list[ObjectInfo] = []
            stream = obs.list(self._store, base or None, chunk_size=_LIST_CHUNK)
            async for chunk in stream:
                for meta in chunk:
                    path = meta["path"]
                    if not path.startswith(root):
                        continue
                    rel = path[len(root) :]
                    if rel and rel.startswith(prefix):
                        out.append(
                            ObjectInfo(key=rel, size=int(meta["size"]), last_modified=_epoch(meta.get("last_modified")))
                        )
            return out

        try:
            out = await self._call(f"list {self._url(prefix)}", collect)
        except ObjectNotFoundError:
            return []  # a local root that does not exist yet
        out.sort(key=lambda o: o.key)
        return out

    async def list_names(self, prefix: str = "") -> builtins.list[str]:
        check_relative(prefix, "prefix", allow_empty=True, allow_partial=True)
        base = self._path(prefix.rstrip("/")) if prefix else self._prefix.rstrip("/")
        what = f"list {self._url(prefix)} (one level)"
        try:
            found = await self._call(what, lambda: obs.list_with_delimiter_async(self._store, base or None))
        except ObjectNotFoundError:
            return []
        paths = [*found["common_prefixes"], *(meta["path"] for meta in found["objects"])]
        return sorted({p.rstrip("/").rpartition("/")[2] for p in paths})

    async def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        await self._put(key, _as_buffer(data), mode)

    async def put_parts(self, key: str, parts: Sequence[memoryview], *, mode: PutMode = "overwrite") -> None:
        """One object from several buffers, sent as they are: obstore takes a list of
        buffers as one body without joining them (each is held, not copied)."""
        bodies = [b for b in map(_as_buffer, parts) if len(b)]
        await self._put(key, bodies if len(bodies) > 1 else (bodies[0] if bodies else b""), mode)

    async def _put(self, key: str, body: bytes | memoryview | Sequence[bytes | memoryview], mode: PutMode) -> None:
        check_relative(key, "key", allow_empty=False, allow_partial=False)
        if mode not in ("overwrite", "create"):
            raise ValueError(f"mode must be 'overwrite' or 'create', got {mode!r}")
        create = mode == "create"
        what = f"put {self._url(key)}" + (" (create-if-absent)" if create else "")
        size = sum(len(b) for b in body) if isinstance(body, list) else len(body)
        multipart = not create and size > self.multipart_threshold
        await self._call(
            what,
            lambda: obs.put_async(
                self._store,
                self._path(key),
                body,
                mode=mode,
                use_multipart=multipart,
                chunk_size=self.multipart_chunk_size,
                max_concurrency=self.multipart_concurrency,
            ),
            create=create,
        )

    async def put_checked(
        self, key: str, data: bytes | memoryview | Sequence[memoryview], *, crc32c: int, mode: PutMode = "overwrite"
    ) -> None:
        """Write an object with its CRC-32C, which S3 checks on arrival and keeps (through botocore)."""
        check_relative(key, "key", allow_empty=False, allow_partial=False)
        checksums, spec = self._checksums, self.native_spec
        if checksums is None or spec is None:
            raise TypeError(f"{self.url} keeps no checksums: use put")
        parts = [memoryview(data)] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        create = mode == "create"
        what = f"put {self._url(key)} (with its crc32c)" + (" (create-if-absent)" if create else "")
        name = self._path(key)
        await self._call(what, lambda: checksums.put(what, spec.bucket, name, parts, crc32c=crc32c, create=create))

    async def head_checksum(self, key: str) -> StoredChecksum:
        """The object's size and the CRC-32C S3 keeps of it (``HeadObject(ChecksumMode=ENABLED)``)."""
        check_relative(key, "key", allow_empty=False, allow_partial=False)
        checksums, spec = self._checksums, self.native_spec
        if checksums is None or spec is None:
            raise TypeError(f"{self.url} keeps no checksums")
        what = f"head {self._url(key)} (its crc32c)"
        name = self._path(key)
        return await self._call(what, lambda: checksums.head(what, spec.bucket, name, key))

    async def list_checksums(self, prefix: str = "") -> builtins.list[StoredChecksum]:
        """Every object under ``prefix`` with its size; S3 lists no checksums (``crc32c`` None)."""
        return [StoredChecksum(o.key, o.size, None) for o in await self.list(prefix)]

    async def close(self) -> None:
        """Close the range reader (:meth:`StreamingStore.close`) and the checksum client's threads."""
        await super().close()
        if self._checksums is not None:
            self._checksums.close()

    async def delete(self, key: str) -> None:
        check_relative(key, "key", allow_empty=False, allow_partial=False)
        try:
            await self._call(f"delete {self._url(key)}", lambda: obs.delete_async(self._store, self._path(key)))
        except ObjectNotFoundError:
            return  # S3 says nothing; GCS and local disk say 404

    def child(self, subpath: str) -> ObstoreStore:
        sub = subpath.rstrip("/")
        check_relative(sub, "subpath", allow_empty=False, allow_partial=False)
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._prefix = f"{self._prefix}{sub}/"
        clone.url = self._url(sub)
        return clone

    def parent(self) -> ObstoreStore | None:
        if not self._prefix.strip("/"):
            return None
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        head = self._prefix.rstrip("/").rpartition("/")[0]
        clone._prefix = f"{head}/" if head else ""
        clone.url = self.url.rstrip("/").rpartition("/")[0]
        return clone


def client_options(*, request_timeout: float, allow_http: bool, extra: dict[str, Any] | None = None) -> ClientConfig:
    """obstore ``ClientConfig``: the per-request timeout, plain HTTP only when asked, plus
    ``extra`` (a trusted CA, from :class:`NativeSpec`); the timeout is a second past the call's own."""
    options: dict[str, Any] = {
        "timeout": _dt.timedelta(seconds=request_timeout + 1),
        "connect_timeout": _dt.timedelta(seconds=min(10.0, request_timeout)),
        "allow_http": allow_http,
        **(extra or {}),
    }
    return cast("ClientConfig", options)


#: obstore's own retries are off: the transfer engine owns the retry policy.
RETRY_CONFIG: RetryConfig = {"max_retries": 0}


def open_spec(
    spec: NativeSpec,
    url: str,
    *,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
    configured_endpoint: ConfiguredEndpoint | None = None,
) -> ObstoreStore:
    """Build the obstore store a translated :class:`NativeSpec` describes (``configured_endpoint``:
    where ``spec.endpoint`` came from, checked before the first request)."""
    from obstore.store import GCSStore, S3Store

    http = bool(spec.endpoint and spec.endpoint.startswith("http://"))
    options = client_options(request_timeout=request_timeout, allow_http=http, extra=spec.client)
    store: Any
    if spec.kind == "s3":
        store = S3Store(
            spec.bucket,
            config=cast("S3Config", spec.config),
            client_options=options,
            retry_config=RETRY_CONFIG,
            credential_provider=spec.credential_provider,
        )
    elif spec.kind == "gcs":
        store = GCSStore(
            spec.bucket,
            config=cast("GCSConfig", spec.config),
            client_options=options,
            retry_config=RETRY_CONFIG,
            credential_provider=spec.credential_provider,
        )
    else:
        raise ValueError(f"unknown native store kind {spec.kind!r}")
    return ObstoreStore(
        store,
        url=url,
        prefix=spec.prefix,
        request_timeout=request_timeout,
        range_reader=range_reader(spec, store, request_timeout),
        native_spec=spec,
        configured_endpoint=configured_endpoint,
        checksums=S3Checksums(spec, request_timeout=request_timeout) if spec.kind == "s3" else None,
    )


def range_reader(spec: NativeSpec, store: Any, request_timeout: float) -> HttpRangeReader | None:
    """A reader that streams ranged GETs of an S3 ``spec``'s bucket, each presigned by ``store``
    with whatever credentials it resolved (:mod:`objckpt.storage.http.s3`).

    None for requester-pays buckets (a presigned URL carries no
    ``x-amz-request-payer``) and for other kinds. (``gs://`` opens with gcsfs by
    default, which streams through :mod:`objckpt.storage.http.gcs`.)
    """
    config = spec.config
    if spec.kind != "s3" or config.get("request_payer"):
        return None
    return S3RangeReader(
        endpoint=spec.endpoint,
        bucket=spec.bucket,
        region=config["region"],
        signer=None if config.get("skip_signature") else store,
        virtual_hosted=bool(config.get("virtual_hosted_style_request")),
        timeout=request_timeout,
        ssl_context=tls_of(spec),
    )


def open_local_path(path: str, url: str, *, request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S) -> ObstoreStore:
    """obstore's ``LocalStore`` rooted at the absolute directory ``path`` (made if missing)."""
    from obstore.store import LocalStore

    store = LocalStore(prefix=path, mkdir=True)
    return ObstoreStore(store, url=url, request_timeout=request_timeout)
