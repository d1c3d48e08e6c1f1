"""Server-side copies between two stores of one provider and account: the bytes stay in the cloud.

Copying a checkpoint from one bucket to another of the same provider need not
pull every byte down to the client and push it back up: S3 copies an object
with ``CopyObject`` (``UploadPartCopy`` parts above :data:`MULTIPART_COPY_THRESHOLD`;
one ``CopyObject`` takes at most 5 GiB), GCS with ``rewriteTo``. Only request
and response heads cross the client's link.

When: both stores are on one provider (``s3``/``s3a``, or ``gs``/``gcs``), at
one endpoint, with credentials from one source (:func:`account_of`, decided
from the stores' configuration, with no request to either store: static keys
compare by a hash of their key id, temporary ones by the source that issues
them, Google credentials by their kind and account). The destination's
credentials sign every copy, so they must be able to read the source; when
they cannot, the server refuses the first copy and the caller
(:mod:`objckpt.tools.copy`) copies through the client instead (:func:`refusal`
tells a refusal from a failure), so a wrong guess costs one request.

Who does the copy is the destination's client: for the native S3 store
(obstore, which copies only within one bucket) a botocore S3 client built
from the store's own configuration (:class:`S3Copier`: the same endpoint,
region, addressing, CA trust and credentials, refreshed through the store's
own credential provider); for s3fs and gcsfs stores their filesystem's
``cp_file`` (:class:`FsspecCopier`: s3fs's ``CopyObject``, gcsfs's rewrite
loop). Each request is one attempt under the caller's ``call`` (the transfer
engine: timeout, retries, concurrency); botocore's own retries are off.

The size a copy is given must be one the store confirmed (the caller takes it
from the source's listing, never from an index object's word alone), and a
multipart copy holds at most :data:`MULTIPART_COPY_CONCURRENCY` part requests
and S3's :data:`MAX_PARTS` part records at once, however large that size is.

Nothing here signs or builds a request by hand; the protocol is botocore's,
s3fs's and gcsfs's. Written here: the decision, and the multipart copy's
sequence of botocore calls (create, parts, complete, abort on failure).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from objckpt.errors import ObjectNotFoundError, StoreError, StorePermissionError
from objckpt.storage.base import Store
from objckpt.storage.error_map import PROGRAMMING_ERRORS, http_status, map_error

if TYPE_CHECKING:
    from objckpt.storage.obstore_config import NativeSpec

T = TypeVar("T")

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

#: HTTP statuses of a copy the server refuses to make for these stores (it will not
#: get better by retrying): a bad or unsupported request, or a method the server lacks.
_UNSUPPORTED_STATUS = frozenset({400, 405, 501})

#: ``call(what, make)``: runs ``make()`` (a fresh awaitable per attempt) as one request,
#: with a timeout and retries: :meth:`objckpt.transfer.engine.TransferEngine.call`.
Call = Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]]
#: ``(bucket, object name)``.
BucketKey = tuple[str, str]


class BucketObjects(Protocol):
    """A store whose keys are objects of one bucket (s3fs, gcsfs, obstore over S3)."""

    def bucket_object(self, key: str) -> BucketKey | None:
        """``(bucket, object name)`` of ``key``; None when the store has no buckets."""
        ...


@dataclass(frozen=True)
class CopyAccount:
    """Where a store lives and who it acts as; two stores with equal accounts can copy
    server-side. Never holds a secret: ``credentials`` names the source, or a short hash
    of an access key id.

    Attributes:
        family: ``"s3"`` or ``"gcs"``.
        endpoint: The service's URL (``""`` for AWS's own, any region).
        credentials: The credential source, as a comparable name.
    """

    family: str
    endpoint: str
    credentials: str


class Copier(Protocol):
    """A server-side copy into one destination store."""

    async def copy(self, source: BucketKey, key: str, size: int, call: Call) -> None:
        """Copy ``source`` (``size`` bytes) to ``key`` of the destination, on the server."""
        ...

    async def checksum(self, location: BucketKey, call: Call) -> str | None:
        """What the server says the object's bytes hash to (an S3 single-part ETag, a GCS
        crc32c), when it says one that two copies of the object share; else None."""
        ...

    def close(self) -> None:
        """Release the copier's clients and threads."""
        ...


# ------------------------------------------------------------------- the decision


def account_of(store: Store) -> CopyAccount | None:
    """The account a server-side copy would act as for ``store`` (or the store inside a
    ``RetryingStore``); None when the store cannot copy server-side."""
    store = getattr(store, "inner", store)
    obstore_store = sys.modules.get("objckpt.storage.obstore_store")
    if obstore_store is not None and isinstance(store, obstore_store.ObstoreStore):
        spec = store.native_spec
        if spec is None or spec.kind != "s3":
            return None  # local disk; obstore's GCS client (only on request) is not used to copy
        who = _spec_credentials(spec)
        return None if who is None else CopyAccount("s3", _endpoint(spec.endpoint), who)
    fsspec_store = sys.modules.get("objckpt.storage.fsspec_store")
    if fsspec_store is not None and isinstance(store, fsspec_store.S3FsspecStore):
        return _s3fs_account(store.fs)
    fsspec_gcs = sys.modules.get("objckpt.storage.fsspec_gcs")
    if fsspec_gcs is not None and isinstance(store, fsspec_gcs.GcsFsspecStore):
        return _gcsfs_account(store.fs)
    return None


def plan(src: Store, dst: Store, *, request_timeout: float, concurrency: int) -> tuple[Copier | None, str]:
    """A copier into ``dst`` that copies ``src``'s objects server-side, or None and why not.

    Blocking (it may build a botocore client and ask a credential provider for its key
    id): call it off the event loop. The caller closes the copier.
    """
    src, dst = getattr(src, "inner", src), getattr(dst, "inner", dst)
    a, b = account_of(src), account_of(dst)
    if a is None or b is None:
        side = src.url if a is None else dst.url
        return None, f"{side} cannot copy server-side (not an S3 or GCS bucket, or no known credential source)"
    if a.family != b.family:
        return None, f"different providers ({a.family} and {b.family})"
    if a.endpoint != b.endpoint:
        return None, f"different endpoints ({a.endpoint or 'AWS'} and {b.endpoint or 'AWS'})"
    if a.credentials != b.credentials:
        return None, "different credentials (the destination's must be able to read the source)"
    spec = getattr(dst, "native_spec", None)
    if spec is None:
        return FsspecCopier(dst), ""
    try:
        return S3Copier(dst, spec, request_timeout=request_timeout, concurrency=concurrency), ""
    except ImportError as exc:
        return None, f"botocore is needed to copy server-side into {dst.url} ({exc})"


def refusal(error: BaseException) -> str | None:
    """Why the server would not copy for these stores, if ``error`` says so; else None.

    A refusal (no permission, the source not visible with the destination's
    credentials, a request the server does not support) means: copy through the
    client instead. Anything else (a timeout, retries exhausted, a data error) is a
    failure to report, never a reason to change method.
    """
    if isinstance(error, StorePermissionError):
        return f"permission denied: {error}"
    if isinstance(error, ObjectNotFoundError):
        return f"the source is not visible with the destination's credentials: {error}"
    if isinstance(error, StoreError) and http_status(error) in _UNSUPPORTED_STATUS:
        return f"not supported by the server: {error}"
    return None


def source_location(store: Store, key: str) -> BucketKey:
    """``(bucket, object name)`` of ``key`` in ``store`` (one :func:`account_of` accepts)."""
    inner: Any = getattr(store, "inner", store)
    location = inner.bucket_object(key)
    if location is None:
        raise StoreError(f"{store.url} has no buckets to copy from")
    return location


def multipart_part_size(size: int, part_size: int) -> int | None:
    """The part size of a multipart copy of ``size`` bytes: ``part_size``, grown so the
    parts stay within S3's :data:`MAX_PARTS`; None when S3 holds no object that large."""
    if size > MAX_OBJECT_SIZE:
        return None
    grown = max(part_size, -(-size // MAX_PARTS))
    return grown if grown <= MAX_PART_SIZE else None


def _endpoint(url: str | None) -> str:
    return (url or "").strip().rstrip("/").lower()


def _key_id(access_key_id: str) -> str:
    """An access key id as a comparable name that shows nothing of it."""
    return "access key " + hashlib.sha256(access_key_id.encode()).hexdigest()[:16]


def _spec_credentials(spec: NativeSpec) -> str | None:
    """The credential source of an obstore S3 configuration
    (:func:`objckpt.storage.credentials.resolve_s3_source` decided it)."""
    config = spec.config
    if config.get("skip_signature"):
        return "anonymous"
    if config.get("access_key_id"):
        return _key_id(str(config["access_key_id"]))
    provider = spec.credential_provider
    if provider is not None:
        try:
            answer = provider()
        except Exception:  # a source that cannot answer now: no server-side copy
            return None
        if not isinstance(answer, Mapping):  # an async provider: not asked from here
            with contextlib.suppress(Exception):
                answer.close()
            return None
        if answer.get("expires_at") is not None:  # temporary keys differ per session of one source
            return f"temporary credentials from {provider!r}"
        key = answer.get("access_key_id")
        return _key_id(str(key)) if key else None
    if config.get("metadata_endpoint"):
        return f"instance metadata at {config['metadata_endpoint']}"
    return None


def _s3fs_account(fs: Any) -> CopyAccount:
    client = dict(getattr(fs, "client_kwargs", None) or {})
    endpoint = _endpoint(getattr(fs, "endpoint_url", None) or client.get("endpoint_url"))
    if getattr(fs, "anon", False):
        return CopyAccount("s3", endpoint, "anonymous")
    key = getattr(fs, "key", None) or client.get("aws_access_key_id")
    profile = (getattr(fs, "kwargs", None) or {}).get("profile")
    if not key and not profile:
        key = os.environ.get("AWS_ACCESS_KEY_ID")  # first in botocore's chain
    if key:
        return CopyAccount("s3", endpoint, _key_id(str(key)))
    return CopyAccount("s3", endpoint, f"botocore's chain, profile {profile or os.environ.get('AWS_PROFILE') or ''}")


def _gcsfs_account(fs: Any) -> CopyAccount | None:
    try:
        endpoint = _endpoint(fs._location)  # gcsfs's endpoint, its default resolved
    except Exception:
        return None
    holder = getattr(fs, "credentials", None)
    credentials = getattr(holder, "credentials", None)
    if getattr(holder, "method", None) == "anon" or credentials is None:
        return CopyAccount("gcs", endpoint, "anonymous")
    names = ("service_account_email", "signer_email", "client_id", "audience")
    who = next((str(v) for v in (getattr(credentials, n, None) for n in names) if v), "")
    return CopyAccount("gcs", endpoint, f"{type(credentials).__name__} {who}")


# ------------------------------------------------------------------------ copiers


class FsspecCopier:
    """Server-side copies through the destination filesystem's ``cp_file`` (s3fs, gcsfs)."""

    def __init__(self, dst: Any) -> None:
        self._dst = dst

    async def copy(self, source: BucketKey, key: str, size: int, call: Call) -> None:
        path, target = "/".join(source), "/".join(self._dst.bucket_object(key))
        what = f"COPY {path} -> {self._dst.url}/{key}"
        await call(what, lambda: self._dst.fs_call(what, "cp_file", path, target))

    async def checksum(self, location: BucketKey, call: Call) -> str | None:
        path = "/".join(location)
        what = f"HEAD {path}"
        info = await call(what, lambda: self._dst.fs_call(what, "info", path))
        crc = info.get("crc32c")  # GCS: every object has one
        if crc:
            return f"crc32c {crc}"
        return _single_part_etag(info.get("ETag") or info.get("etag"))

    def close(self) -> None:  # the destination store owns the filesystem
        return None


def _single_part_etag(etag: Any) -> str | None:
    """An S3 ETag two copies of an object share: one of a single-part object (an MD5),
    not ``"<hash>-<parts>"``, which depends on how the object was uploaded."""
    if not etag:
        return None
    value = str(etag).strip('"')
    return None if "-" in value else f"etag {value}"


class S3Copier:
    """Server-side copies into an obstore S3 store, with botocore (obstore copies only
    within one bucket).

    The client is built from the store's :class:`~objckpt.storage.obstore_config.NativeSpec`:
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
        import botocore
        import botocore.credentials
        import botocore.session
        from botocore.config import Config

        spec, config = self._spec, self._spec.config
        session = botocore.session.Session()
        signing: dict[str, Any] = {}
        if config.get("skip_signature"):
            signing["signature_version"] = botocore.UNSIGNED
        elif config.get("access_key_id"):
            session.set_credentials(config["access_key_id"], config["secret_access_key"], config.get("session_token"))
        elif spec.credential_provider is not None:
            credentials = _refreshable(spec.credential_provider)
            session.register_component(
                "credential_provider", botocore.credentials.CredentialResolver([_Given(credentials)])
            )
        # else instance metadata: botocore's own chain finds it, as it did for the store
        verify: bool | str = True
        if spec.client.get("allow_invalid_certificates"):
            verify = False
        elif spec.client.get("root_certificate"):
            verify = self._ca_file = _pem_file(spec.client["root_certificate"])
        addressing = "virtual" if config.get("virtual_hosted_style_request") else "path"
        return session.create_client(
            "s3",
            region_name=config.get("region"),
            endpoint_url=spec.endpoint,
            verify=verify,
            config=Config(
                connect_timeout=min(10.0, request_timeout),
                read_timeout=request_timeout,
                retries={"total_max_attempts": 1},  # the engine is the one retry layer
                max_pool_connections=connections,
                s3={"addressing_style": addressing},
                **signing,
            ),
        )

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
        return _single_part_etag(head.get("ETag"))

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


def _pem_file(pem: bytes) -> str:
    """The store's trusted CA (obstore holds it as bytes) in a file, for botocore's ``verify``."""
    fd, path = tempfile.mkstemp(prefix="objckpt-ca-", suffix=".pem")
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return path


def _refreshable(provider: Callable[[], Any]) -> Any:
    """botocore credentials that ask the store's obstore ``credential_provider`` again when
    the answer it gave expires (``expires_at``), as obstore itself does."""
    import botocore.credentials

    def metadata() -> dict[str, Any]:
        answer = provider()
        expires = answer.get("expires_at")
        return {
            "access_key": answer["access_key_id"],
            "secret_key": answer["secret_access_key"],
            "token": answer.get("token") or answer.get("session_token"),
            "expiry_time": expires.isoformat() if expires is not None else None,
        }

    first = metadata()
    if first["expiry_time"] is None:  # static: never asked again
        return botocore.credentials.Credentials(first["access_key"], first["secret_key"], first["token"], "objckpt")
    return botocore.credentials.RefreshableCredentials.create_from_metadata(first, metadata, "objckpt")


class _Given:
    """A botocore credential provider that hands over credentials made already."""

    METHOD = "objckpt"

    def __init__(self, credentials: Any) -> None:
        self._credentials = credentials

    def load(self) -> Any:
        return self._credentials
