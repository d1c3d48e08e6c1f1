"""A :class:`Store` over any fsspec filesystem (s3fs, gcsfs, local, memory, ...).

Three things an fsspec filesystem does not give objckpt by itself, and this
adapter adds:

* **Concurrency without a thread per request.** Async filesystems (s3fs,
  gcsfs) run their coroutines on fsspec's own event-loop thread; we submit
  there with ``run_coroutine_threadsafe`` and await the result from the
  caller's loop, so hundreds of requests share one I/O thread. Sync
  filesystems go through ``asyncio.to_thread``. Every call has a timeout.
* **A real create-if-absent**, which the commit protocol depends on: S3
  ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, ``os.link`` on disk, a
  lock for the in-process memory filesystem. fsspec's generic
  ``pipe_file(mode="create")`` is check-then-write (racy), so unknown
  filesystems only get ``supports_create = True`` if they override it.
* **Errors by type and status code**, never by message text (see
  :mod:`objckpt.storage.errors`). Messages name the object's full URL
  (the root URL, credentials stripped, plus the key).
* **Local reads stay inside the root**: on a local filesystem every read,
  ``head``, write and delete goes through :mod:`objckpt.storage.fsspec.posix`, which
  refuses a key whose path resolves outside the store's root through a
  symbolic link (:class:`StorePermissionError`) and reads only regular files
  (a FIFO is a :class:`StoreError` at once, not a read that blocks).

:class:`FsspecStore` holds what every filesystem shares (validation, timeouts,
error mapping, the generic fsspec calls); one subclass per filesystem objckpt
knows overrides only the steps that differ: :class:`S3FsspecStore`,
:class:`MemoryFsspecStore` here, :class:`~objckpt.storage.fsspec.gcs.GcsFsspecStore`
and :class:`~objckpt.storage.fsspec.local.LocalFsspecStore`.
:func:`objckpt.storage.fsspec.factory.for_filesystem`
picks the class for a filesystem, once, when the store is opened.
"""

from __future__ import annotations

import asyncio
import builtins
import datetime as _dt
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fsspec import AbstractFileSystem
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.dirfs import DirFileSystem

from objckpt.errors import ObjectNotFoundError, StoreError, TransientStoreError
from objckpt.storage.base import DEFAULT_REQUEST_TIMEOUT_S, ObjectInfo, PutMode
from objckpt.storage.endpoint import ConfiguredEndpoint
from objckpt.storage.errors import PROGRAMMING_ERRORS as _PROGRAMMING_ERRORS
from objckpt.storage.errors import http_status as _http_status
from objckpt.storage.errors import map_error
from objckpt.storage.fsspec.posix import Body
from objckpt.storage.http.reader import HttpRangeReader, StreamingStore
from objckpt.storage.urls import check_relative as _check_relative
from objckpt.storage.urls import redact_url

T = TypeVar("T")

# The in-process memory filesystem is one dict per process; a check-then-write
# create is atomic only if every writer takes this lock.


class _InnerTimeout(Exception):
    """Carries a filesystem's own TimeoutError past ``asyncio.wait_for``."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original


#: Filesystems whose ``pipe_file`` takes ``mode`` but ignores "create".
_MODE_IGNORED = frozenset(
    {
        "fsspec.implementations.http.HTTPFileSystem",
        "fsspec.implementations.reference.ReferenceFileSystem",
    }
)


def _uses_async(fs: AbstractFileSystem) -> bool:
    """Whether to drive ``fs`` through its coroutines.

    ``DirFileSystem`` claims ``async_impl`` even when it wraps a sync
    filesystem, whose coroutine methods then do not exist.
    """
    if isinstance(fs, DirFileSystem):
        return bool(fs.fs.async_impl)
    return bool(fs.async_impl)


def _overrides_create(fs: AbstractFileSystem) -> bool:
    """Whether ``fs`` implements its own ``pipe_file(..., mode=...)``.

    The base classes' version is exists-then-write, which two racing writers
    can both pass; only an override can be a real conditional write. This
    trusts an override that accepts ``mode``, except for known filesystems
    that accept and ignore it; pass ``atomic_create`` to overrule.
    """
    cls = type(fs)
    if any(f"{c.__module__}.{c.__qualname__}" in _MODE_IGNORED for c in cls.__mro__):
        return False
    if _uses_async(fs):
        method, base = getattr(cls, "_pipe_file", None), AsyncFileSystem._pipe_file
    else:
        method, base = getattr(cls, "pipe_file", None), AbstractFileSystem.pipe_file
    if method is None or method is base:
        return False
    try:
        return "mode" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def _epoch(info: dict[str, Any]) -> float | None:
    """Modification time in seconds since the epoch from an fsspec info dict."""
    for field in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(field)
        if value is None:
            continue
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, _dt.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=_dt.UTC)
            return value.timestamp()
        if isinstance(value, str):
            try:
                parsed = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=_dt.UTC)
            return parsed.timestamp()
    return None


class FsspecStore(StreamingStore):
    """A :class:`Store` rooted at ``path`` on the fsspec filesystem ``fs``.

    This class is the generic strategy, for filesystems objckpt has no
    subclass for; :func:`objckpt.storage.fsspec.factory.for_filesystem` builds the right class for ``fs``.

    Args:
        fs: Any fsspec filesystem instance; shared by :meth:`child` stores.
        path: The root as ``fs`` spells paths (``fs._strip_protocol(url)``),
            e.g. ``"bucket/ckpts"`` for s3fs or ``"/data/ckpts"`` locally.
        url: The root URL shown in messages; credentials are stripped.
            Defaults to ``fs.unstrip_protocol(path)``.
        request_timeout: Seconds allowed per call; exceeding it raises
            :class:`TransientStoreError`.
        atomic_create: Overrule the detection of whether ``fs`` can
            create-if-absent atomically (only for the generic strategy, which
            then uses ``pipe_file(mode="create")``; the subclasses always can).
        range_reader: Streams ranged reads (:meth:`get_range_streamed`) over
            plain HTTP, for a filesystem whose paths it knows (gcsfs's:
            :class:`objckpt.storage.http.gcs.GCSRangeReader`); shared by
            :meth:`child` stores.
        configured_endpoint: The endpoint the user configured, checked before the first
            request (:mod:`objckpt.storage.endpoint`: a refusal is said at once); shared by
            :meth:`child` stores.
    """

    def __init__(
        self,
        fs: AbstractFileSystem,
        path: str,
        *,
        url: str | None = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        atomic_create: bool | None = None,
        range_reader: HttpRangeReader | None = None,
        configured_endpoint: ConfiguredEndpoint | None = None,
    ) -> None:
        if request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {request_timeout}")
        self.fs = fs
        self.configured_endpoint = configured_endpoint
        self._root = path.rstrip("/")  # "" for a filesystem root; keys join as "/key"
        raw_url = url if url is not None else fs.unstrip_protocol(path)
        self.url = redact_url(raw_url)
        self.request_timeout = float(request_timeout)
        self._async = _uses_async(fs)
        self.supports_create = self._atomic_create(atomic_create)
        self._use_range_reader(range_reader)

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}"

    def _url(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    async def _run(self, what: str, make: Callable[[], Awaitable[T]]) -> T:
        """Await ``make()`` under the request timeout.

        A timeout *we* impose becomes :class:`TransientStoreError` here; a
        ``TimeoutError`` raised by the filesystem itself passes through (it
        is wrapped on the way so the two cannot be confused) and is mapped
        by the caller like any other error.
        """

        async def guarded() -> T:
            try:
                return await make()
            except TimeoutError as exc:  # asyncio.TimeoutError is TimeoutError since 3.11
                raise _InnerTimeout(exc) from exc

        if self.configured_endpoint is not None:
            await self.configured_endpoint.check(what)
        try:
            return await asyncio.wait_for(guarded(), self.request_timeout)
        except _InnerTimeout as wrapped:
            # Re-raise the filesystem's own error; its __cause__ carries the HTTP status.
            raise wrapped.original from wrapped.original.__cause__
        except TimeoutError as exc:
            raise TransientStoreError(f"{what} timed out after {self.request_timeout:g} s") from exc

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        """Start fs method ``name`` the way this filesystem needs it run."""
        fs = self.fs
        if self._async:
            return self._on_fs_loop(getattr(fs, f"_{name}")(*args, **kwargs))
        return asyncio.to_thread(getattr(fs, name), *args, **kwargs)

    def _on_fs_loop(self, coro: Awaitable[T]) -> Awaitable[T]:
        """Run a coroutine of an async filesystem on the loop that filesystem lives on."""
        fs = self.fs
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - always called from a coroutine
            running = None
        if fs.asynchronous or running is fs.loop:
            return coro  # already bound to the caller's loop
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, fs.loop))  # type: ignore[arg-type]

    async def _fs(self, what: str, name: str, *args: Any, **kwargs: Any) -> Any:
        return await self._run(what, lambda: self._call(name, *args, **kwargs))

    async def _in_thread(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        return await self._run(what, lambda: asyncio.to_thread(fn, *args))

    async def fs_call(self, what: str, name: str, *args: Any) -> Any:
        """The filesystem's method ``name`` on paths as it spells them, under the request
        timeout, errors mapped: for verbs the store does not wrap (``cp_file``, ``info``), which
        server-side copies use (:mod:`objckpt.storage.copy.server`)."""
        try:
            return await self._fs(what, name, *args)
        except _PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            raise map_error(exc, what) from exc

    def bucket_object(self, key: str) -> tuple[str, str]:
        """``(bucket, object name)`` of ``key`` on a filesystem of buckets (s3fs, gcsfs)."""
        bucket, _, name = self._path(key).partition("/")
        return bucket, name

    # --------------------------------------------- steps a filesystem's subclass overrides

    def _atomic_create(self, requested: bool | None) -> bool:
        """Whether ``put(mode="create")`` is atomic here: ``requested`` when given,
        else whether the filesystem's own ``pipe_file`` takes ``mode``."""
        return requested if requested is not None else _overrides_create(self.fs)

    #: Whether ``find`` filters by a name prefix server-side (``prefix=``).
    _lists_by_prefix = False

    def _hidden(self, rel: str) -> bool:
        """Whether a listed name is the filesystem's own bookkeeping, never an object."""
        return False

    async def _stat(self, what: str, key: str) -> ObjectInfo | None:
        """Size and time of ``key``; None when it names a directory (a prefix of objects)."""
        info = await self._fs(what, "info", self._path(key))
        if info.get("type") == "directory":
            return None
        return ObjectInfo(key=key, size=int(info.get("size") or 0), last_modified=_epoch(info))

    async def _read_whole(self, what: str, key: str) -> bytes:
        return bytes(await self._fs(what, "cat_file", self._path(key)))

    async def _read_range(self, what: str, key: str, start: int, end: int) -> bytes:
        # By keyword: s3fs's cat_file takes version_id second.
        return bytes(await self._fs(what, "cat_file", self._path(key), start=start, end=end))

    async def _write(self, what: str, key: str, data: Body, create: bool) -> None:
        """Write one whole object; ``create``: atomically, only if absent."""
        # botocore and most clients want bytes
        body = b"".join(data) if isinstance(data, tuple) else bytes(data) if isinstance(data, memoryview) else data
        if create:
            await self._fs(what, "pipe_file", self._path(key), body, mode="create")
        else:
            await self._fs(what, "pipe_file", self._path(key), body)

    async def _remove(self, what: str, key: str) -> None:
        await self._fs(what, "rm_file", self._path(key))

    async def head(self, key: str) -> ObjectInfo:
        _check_relative(key, "key", allow_empty=False, allow_partial=False)
        what = f"head {self._url(key)}"
        try:
            info = await self._stat(what, key)
        except _PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            raise map_error(exc, what) from exc
        if info is None:
            raise ObjectNotFoundError(f"{what}: no such object (a prefix of other objects)")
        return info

    async def get(self, key: str) -> bytes:
        """The whole object in one request (no ``head`` first)."""
        _check_relative(key, "key", allow_empty=False, allow_partial=False)
        what = f"get {self._url(key)}"
        try:
            return await self._read_whole(what, key)
        except _PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            raise map_error(exc, what) from exc

    async def get_range(self, key: str, *, start: int, end: int) -> bytes:
        _check_relative(key, "key", allow_empty=False, allow_partial=False)
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end}) for {self._url(key)}")
        if end == start:
            await self.head(key)  # an empty range still requires the object
            return b""
        what = f"get {self._url(key)} bytes [{start}, {end})"
        try:
            return await self._read_range(what, key, start, end)
        except _PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            if _http_status(exc) == 416:
                return b""  # the range starts at or past the end (e.g. an empty object)
            raise map_error(exc, what) from exc

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return [
            ObjectInfo(key=rel, size=int(info.get("size") or 0), last_modified=_epoch(info))
            for rel, info in await self._listed(prefix)
        ]

    async def list_names(self, prefix: str = "") -> builtins.list[str]:
        _check_relative(prefix, "prefix", allow_empty=True, allow_partial=True)
        what = f"list {self._url(prefix)} (one level)"
        found = await self._listing(what, "ls", self._path(prefix.rstrip("/")) if prefix else self._root or "/")
        names = {(e["name"] if isinstance(e, dict) else str(e)).rstrip("/").rpartition("/")[2] for e in found}
        return sorted(n for n in names if n and not self._hidden(n))

    async def _listing(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """The filesystem's ``method`` listing, or ``[]`` where the directory is not there."""
        try:
            return await self._fs(what, method, *args, **kwargs)
        except _PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            mapped = map_error(exc, what)
            if isinstance(mapped, ObjectNotFoundError):
                return []
            raise mapped from exc

    async def _listed(self, prefix: str) -> builtins.list[tuple[str, dict[str, Any]]]:
        """Every object under ``prefix`` as ``(key, the filesystem's info)``, sorted by key."""
        _check_relative(prefix, "prefix", allow_empty=True, allow_partial=True)
        directory, _, stem = prefix.rpartition("/")
        base = self._path(directory) if directory else (self._root or "/")
        what = f"list {self._url(prefix)}"
        kwargs: dict[str, Any] = {"detail": True}
        if self._lists_by_prefix and stem:
            kwargs["prefix"] = stem  # filtered server-side
        entries = await self._listing(what, "find", base, **kwargs) or {}
        root_slash = f"{self._root.rstrip('/')}/"
        out: builtins.list[tuple[str, dict[str, Any]]] = []
        for name, info in entries.items():
            if info.get("type") == "directory":
                continue
            if not name.startswith(root_slash):
                continue
            rel = name[len(root_slash) :]
            if not rel or not rel.startswith(prefix) or rel.endswith("/"):
                continue
            if self._hidden(rel):
                continue
            out.append((rel, info))
        out.sort(key=lambda o: o[0])
        return out

    async def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        await self._put(key, data, mode)

    async def _put(self, key: str, data: Body, mode: PutMode) -> None:
        """:meth:`put` of one buffer, or of parts where the subclass's ``_write`` takes them."""
        _check_relative(key, "key", allow_empty=False, allow_partial=False)
        if mode not in ("overwrite", "create"):
            raise ValueError(f"mode must be 'overwrite' or 'create', got {mode!r}")
        create = mode == "create"
        what = f"put {self._url(key)}" + (" (create-if-absent)" if create else "")
        if create and not self.supports_create:
            raise StoreError(f"{what}: {type(self.fs).__name__} cannot create-if-absent atomically")
        try:
            await self._write(what, key, data, create)
        except _PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            raise map_error(exc, what, create=create) from exc

    async def delete(self, key: str) -> None:
        _check_relative(key, "key", allow_empty=False, allow_partial=False)
        what = f"delete {self._url(key)}"
        try:
            await self._remove(what, key)
        except _PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            mapped = map_error(exc, what)
            if isinstance(mapped, ObjectNotFoundError):
                return
            raise mapped from exc

    def child(self, subpath: str) -> FsspecStore:
        _check_relative(subpath.rstrip("/"), "subpath", allow_empty=False, allow_partial=False)
        sub = subpath.rstrip("/")
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._root = self._path(sub)
        clone.url = self._url(sub)
        return clone

    def parent(self) -> FsspecStore | None:
        head = self._root.rpartition("/")[0]
        if not head.strip("/"):
            return None
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._root = head
        clone.url = self.url.rstrip("/").rpartition("/")[0]
        return clone
