"""Server-side copies between two stores of one provider and account: the bytes stay in the cloud.

Copying a checkpoint from one bucket to another of the same provider need not
pull every byte down to the client and push it back up: S3 copies an object
with ``CopyObject`` (``UploadPartCopy`` parts above :data:`~objckpt.storage.copy.s3.MULTIPART_COPY_THRESHOLD`;
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
own credential provider, in :mod:`objckpt.storage.copy.s3`); for s3fs and
gcsfs stores their filesystem's ``cp_file`` (:class:`FsspecCopier`: s3fs's ``CopyObject``, gcsfs's rewrite
loop). Each request is one attempt under the caller's ``call`` (the transfer
engine: timeout, retries, concurrency); botocore's own retries are off.

The size a copy is given must be one the store confirmed (the caller takes it
from the source's listing, never from an index object's word alone), and a
multipart copy holds a bounded number of part requests and records at once,
however large that size is.

Nothing here signs or builds a request by hand; the protocol is botocore's,
s3fs's and gcsfs's. Written here: the decision.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from objckpt.errors import ObjectNotFoundError, StoreError, StorePermissionError
from objckpt.storage.base import Store
from objckpt.storage.copy.s3 import BucketKey, Call, S3Copier, single_part_etag
from objckpt.storage.errors import http_status

if TYPE_CHECKING:
    from objckpt.storage.obstore.config import NativeSpec

#: HTTP statuses of a copy the server refuses to make for these stores (it will not
#: get better by retrying): a bad or unsupported request, or a method the server lacks.
_UNSUPPORTED_STATUS = frozenset({400, 405, 501})


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


def account_of(store: Store) -> CopyAccount | None:
    """The account a server-side copy would act as for ``store`` (a store itself, not a retrying
    layer around one: an operation's handle gives its ``bulk`` store); None when it cannot copy server-side."""
    obstore_store = sys.modules.get("objckpt.storage.obstore.store")
    if obstore_store is not None and isinstance(store, obstore_store.ObstoreStore):
        spec = store.native_spec
        if spec is None or spec.kind != "s3":
            return None  # local disk; obstore's GCS client (only on request) is not used to copy
        who = _spec_credentials(spec)
        return None if who is None else CopyAccount("s3", _endpoint(spec.endpoint), who)
    fsspec_s3 = sys.modules.get("objckpt.storage.fsspec.s3")
    if fsspec_s3 is not None and isinstance(store, fsspec_s3.S3FsspecStore):
        return _s3fs_account(store.fs)
    fsspec_gcs = sys.modules.get("objckpt.storage.fsspec.gcs")
    if fsspec_gcs is not None and isinstance(store, fsspec_gcs.GcsFsspecStore):
        return _gcsfs_account(store)
    return None


def plan(src: Store, dst: Store, *, request_timeout: float, concurrency: int) -> tuple[Copier | None, str]:
    """A copier into ``dst`` that copies ``src``'s objects server-side, or None and why not.

    Blocking (it may build a botocore client and ask a credential provider for its key
    id): call it off the event loop. The caller closes the copier.
    """
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
    copier_of: Any = store  # an S3 or GCS store (bucket_object is theirs, not the contract's)
    location = copier_of.bucket_object(key)
    if location is None:
        raise StoreError(f"{store.url} has no buckets to copy from")
    return location


def _endpoint(url: str | None) -> str:
    return (url or "").strip().rstrip("/").lower()


def _key_id(access_key_id: str) -> str:
    """An access key id as a comparable name that shows nothing of it."""
    return "access key " + hashlib.sha256(access_key_id.encode()).hexdigest()[:16]


def _spec_credentials(spec: NativeSpec) -> str | None:
    """The credential source of an obstore S3 configuration
    (:func:`objckpt.storage.auth.credentials.resolve_s3_source` decided it)."""
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


def _gcsfs_account(store: Any) -> CopyAccount | None:
    """The account of a gcsfs store: the endpoint it was configured with, and its credential."""
    if not store.endpoint:  # a store made without objckpt's opener: no endpoint to compare
        return None
    endpoint = _endpoint(store.endpoint)
    fs = store.fs
    holder = getattr(fs, "credentials", None)
    credentials = getattr(holder, "credentials", None)
    if getattr(holder, "method", None) == "anon" or credentials is None:
        return CopyAccount("gcs", endpoint, "anonymous")
    names = ("service_account_email", "signer_email", "client_id", "audience")
    who = next((str(v) for v in (getattr(credentials, n, None) for n in names) if v), "")
    return CopyAccount("gcs", endpoint, f"{type(credentials).__name__} {who}")


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
        return single_part_etag(info.get("ETag") or info.get("etag"))

    def close(self) -> None:  # the destination store owns the filesystem
        return None
