"""The transfer engine: runs store requests concurrently, bounded, with retries.

All callers (save, restore, copy, verify) go through one engine per operation
so that concurrency limits, per-request timeouts, retry policy and byte
counters live in one place. Retries are decided by exception *type* (the
stores map vendor errors to :class:`TransientStoreError` at their boundary),
with exponential backoff and full jitter, bounded by a per-request deadline.
How many requests are in flight follows the store's throttling answers
(:mod:`objckpt.transfer.throttle`), up to ``Options.max_concurrency``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from objckpt.errors import (
    BucketNotFoundError,
    ChecksumMismatchError,
    ObjectNotFoundError,
    StoreError,
    ThrottledError,
    TransientStoreError,
)
from objckpt.options import Options, RetryConfig
from objckpt.storage import from_url
from objckpt.storage.base import ObjectInfo, PutMode, Store
from objckpt.storage.checksums import checks_at_arrival
from objckpt.storage.streaming import ReadSink
from objckpt.transfer import runtime
from objckpt.transfer.throttle import AdaptiveLimit, Outcome

T = TypeVar("T")
Item = TypeVar("Item")


@dataclass
class TransferStats:
    """Counters of one operation, safe to read from any thread.

    Attributes:
        requests: store requests issued.
        retries: how many of them were retries.
        throttled: answers asking to slow down (429, 503 SlowDown), each retried.
        checksum_retries: re-reads after a checksum mismatch or a manifest that did not parse.
        bytes_written: bytes written to the store.
        bytes_read: bytes read from the store.
        objects_written: objects written to the store.
        device_bytes_moved: bytes a restore moved between devices, received by this process's
            devices: leaves read on the saved layout and resharded to their targets there.
        seconds: wall time of the whole operation, set when it ends.
        bytes_by_location: bytes read from each location, by URL, when a restore reads from
            several (replicas).
    """

    requests: int = 0
    retries: int = 0
    throttled: int = 0  # answers asking to slow down (429, 503 SlowDown), each retried
    checksum_retries: int = 0  # re-reads after a checksum mismatch or a manifest that did not parse
    bytes_written: int = 0
    bytes_read: int = 0
    objects_written: int = 0
    #: bytes a restore moved between devices, received by this process's devices: leaves read on the
    #: saved layout and resharded to their targets there (objckpt.restoring.reshard)
    device_bytes_moved: int = 0
    seconds: float = 0.0  # wall time of the whole operation, set when it ends
    #: bytes read from each location, by URL, when a restore reads from several (replicas)
    bytes_by_location: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _listeners: list[Callable[[], None]] = field(default_factory=list, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """Add to counters by name (``add(requests=1, bytes_read=n)``), then tell the watchers."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)
            listeners = tuple(self._listeners) if self._listeners else ()
        for listener in listeners:
            listener()

    def add_location_bytes(self, url: str, n: int) -> None:
        """Count ``n`` bytes read from the location ``url`` (``bytes_by_location``)."""
        with self._lock:
            self.bytes_by_location[url] = self.bytes_by_location.get(url, 0) + n

    def watch(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after each change of the counters, on the thread that made it and
        outside their lock: what feeds a progress reporter (:mod:`objckpt.progress`)."""
        with self._lock:
            self._listeners.append(listener)

    def unwatch(self, listener: Callable[[], None]) -> None:
        """Stop calling ``listener`` (one that is not watching is ignored)."""
        with self._lock, contextlib.suppress(ValueError):
            self._listeners.remove(listener)


class AsyncByteBudget:
    """An asyncio semaphore counted in bytes.

    A request larger than the whole budget is let through alone, so one huge
    item cannot deadlock the pipeline.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> int:
        n = min(n, self.limit)
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_use + n <= self.limit)
            self.in_use += n
        return n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.in_use -= n
            self._cond.notify_all()


async def call_with_retries(
    what: str,
    fn: Callable[[], Awaitable[T]],
    *,
    retry: RetryConfig,
    request_timeout: float,
    stats: TransferStats | None = None,
) -> T:
    """Run ``fn()`` with a timeout per attempt, retrying transient failures
    (:func:`retry_attempts`, each attempt under ``asyncio.wait_for``)."""
    return await retry_attempts(
        what, lambda timeout: asyncio.wait_for(fn(), timeout), retry=retry, request_timeout=request_timeout, stats=stats
    )


async def retry_attempts(
    what: str,
    attempt: Callable[[float], Awaitable[T]],
    *,
    retry: RetryConfig,
    request_timeout: float,
    stats: TransferStats | None = None,
) -> T:
    """Run ``attempt(timeout)``, retrying transient failures; ``attempt`` applies its timeout
    itself, to the time its request is on the wire (not to a wait for a concurrency slot).

    Transient means :class:`TransientStoreError` (429/5xx, resets, mapped by the
    stores), a timeout or a connection error; anything else is raised at once.
    Backoff is exponential with full jitter, bounded by ``retry.deadline``.

    An attempt that times out gives the next one twice its time (within what is left of
    the deadline), as TCP backs off its retransmission timeout. A request that is slow
    but moving (its bytes share the link and the CPU with the operation's other
    requests, on a busy host) then ends within a few attempts, where the same timeout
    each time would cut it at the same point every time and fail it after
    ``max_attempts``; a stalled server still costs the first attempt only ``request_timeout``.
    """
    deadline = time.monotonic() + retry.deadline
    timeout = request_timeout
    attempts = 0
    while True:
        attempts += 1
        try:
            return await attempt(timeout)
        except (TransientStoreError, TimeoutError, ConnectionError) as e:
            if isinstance(e, StoreError) and not isinstance(e, TransientStoreError):
                raise  # a store's own verdict: not worth retrying (a refused endpoint is also a ConnectionError)
            backoff = random.uniform(0, min(retry.max_backoff, retry.initial_backoff * 2 ** (attempts - 1)))
            if attempts >= retry.max_attempts or time.monotonic() + backoff > deadline:
                kind = f"timed out (the last attempt given {timeout:g} s)" if isinstance(e, TimeoutError) else "failed"
                raise StoreError(f"{what} {kind} after {attempts} attempts: {e}") from e
            if isinstance(e, TimeoutError):
                timeout = max(timeout, min(2 * timeout, deadline - time.monotonic() - backoff))
            if stats is not None:
                stats.add(retries=1)
            await asyncio.sleep(backoff)


async def reread_on_mismatch(read: Callable[[], Awaitable[T]], *, reads: int, stats: TransferStats | None = None) -> T:
    """Run ``read()`` (a read and its checksum checks) again while it raises a
    :class:`ChecksumMismatchError`, up to ``reads`` times in all.

    A bit flipped in flight fails one read and not the next, so a mismatch is
    retried like any transient failure (each re-read counted in
    ``stats.checksum_retries``); one that persists over every read is corruption
    at rest, raised with how many reads saw it. ``read`` must be safe to run
    again after a mismatch (its consumers rewrite the same bytes).
    """
    for attempt in range(1, reads + 1):
        try:
            return await read()
        except ChecksumMismatchError as e:
            if attempt >= reads:
                raise ChecksumMismatchError(f"{e} (persisted over {reads} reads)") from None
            if stats is not None:
                stats.add(checksum_retries=1)
    raise AssertionError("unreachable")  # reads >= 1 (RetryConfig checks it)


class RetryingStore(Store):
    """A store whose every call has a timeout and retries transient failures.

    For the calls that do not go through a :class:`TransferEngine` (existence
    checks, manifest reads, listings, deletes), so that a throttled bucket
    never fails a save or restore on its first 503.
    """

    def __init__(
        self, inner: Store, *, retry: RetryConfig, request_timeout: float, stats: TransferStats | None = None
    ) -> None:
        self.inner = inner
        self.stats = stats
        self.url = inner.url
        self.supports_create = inner.supports_create
        self._retry = retry
        self._timeout = request_timeout

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        async def attempt() -> T:
            try:
                return await fn()
            except ThrottledError:  # counted as the engine counts its own (TransferStats.throttled)
                if self.stats is not None:
                    self.stats.add(throttled=1)
                raise

        return await call_with_retries(
            what, attempt, retry=self._retry, request_timeout=self._timeout, stats=self.stats
        )

    async def get_range(self, key: str, *, start: int, end: int) -> bytes:
        return await self._call(
            f"GET {self.url}/{key}",
            lambda: self._read_at(key)[0].get_range(self._read_at(key)[1], start=start, end=end),
        )

    async def get_range_buffer(self, key: str, *, start: int, end: int) -> memoryview:
        return await self._call(
            f"GET {self.url}/{key}",
            lambda: self._read_at(key)[0].get_range_buffer(self._read_at(key)[1], start=start, end=end),
        )

    async def get(self, key: str) -> bytes:
        return await self._call(f"GET {self.url}/{key}", lambda: self._read_at(key)[0].get(self._read_at(key)[1]))

    async def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        await self._call(f"PUT {self.url}/{key}", lambda: self.inner.put(key, data, mode=mode))

    async def delete(self, key: str) -> None:
        await self._call(f"DELETE {self.url}/{key}", lambda: self.inner.delete(key))

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self._call(f"LIST {self.url}/{prefix}", lambda: self.inner.list(prefix))

    async def head(self, key: str) -> ObjectInfo:
        return await self._call(f"HEAD {self.url}/{key}", lambda: self._read_at(key)[0].head(self._read_at(key)[1]))

    def _read_at(self, key: str) -> tuple[Store, str]:
        """Where a read of ``key`` goes: a reference key into a base through the parent store
        (:meth:`TransferEngine._at`); writes and deletes never follow one."""
        if not key.startswith(REF_UP):
            return self.inner, key
        return parent_of(self.inner), key[len(REF_UP) :]

    def child(self, subpath: str) -> RetryingStore:
        return RetryingStore(
            self.inner.child(subpath), retry=self._retry, request_timeout=self._timeout, stats=self.stats
        )

    def parent(self) -> RetryingStore | None:
        up = self.inner.parent()
        return (
            None
            if up is None
            else RetryingStore(up, retry=self._retry, request_timeout=self._timeout, stats=self.stats)
        )

    def with_policy(self, *, retry: RetryConfig, request_timeout: float) -> RetryingStore:
        """The same store (and counters) under another retry policy and timeout."""
        return RetryingStore(self.inner, retry=retry, request_timeout=request_timeout, stats=self.stats)

    async def close(self) -> None:
        await self.inner.close()


def open_store(
    url: str, storage_options: dict[str, Any] | None, options: Options, stats: TransferStats | None = None
) -> RetryingStore:
    """``from_url`` wrapped with the retry policy and timeout of ``options`` (retries counted in ``stats``)."""
    store = from_url(url, **(storage_options or {}))
    return RetryingStore(store, retry=options.retry, request_timeout=options.request_timeout, stats=stats)


@contextlib.contextmanager
def opened_store(
    url: str, storage_options: dict[str, Any] | None, options: Options, stats: TransferStats | None = None
) -> Iterator[RetryingStore]:
    """:func:`open_store` for one operation: the store (and what it opened) is closed when the block ends."""
    store = open_store(url, storage_options, options, stats)
    try:
        yield store
    finally:
        close_store(store)


def close_store(store: Store) -> None:
    """Close ``store`` from a caller's thread (its connections, its streamed reader's threads)."""
    runtime.run_sync(store.close())


#: How a key leads one level up: an incremental checkpoint's reference into a base
#: (:mod:`objckpt.core.format.bases`); only the format's readers make such keys.
REF_UP = "../"


def parent_of(store: Store) -> Store:
    """``store``'s parent store, for keys that lead into a base.

    Raises:
        StoreError: the store has none (a bucket's root, or a store that cannot reach one).
    """
    up = store.parent()
    if up is None:
        raise StoreError(
            f"{store.url}: cannot reach the checkpoints beside it, which an incremental checkpoint's bases are"
        )
    return up


def missing_bucket(url: str, key: str, error: ObjectNotFoundError) -> BucketNotFoundError:
    """The error for a write that found no object to write to: a write can only miss its bucket."""
    return BucketNotFoundError(f"cannot write {url}/{key}: the bucket (or container) does not exist ({error})")


class TransferEngine:
    """Concurrent, retried, timed store requests for one operation."""

    def __init__(
        self,
        store: Store,
        *,
        max_concurrency: int,
        request_timeout: float,
        retry: RetryConfig,
        stats: TransferStats | None = None,
        adaptive: bool = True,
    ) -> None:
        self.store = store
        self.request_timeout = request_timeout
        #: the first attempt's timeout for requests that start now: ``request_timeout``, raised to the
        #: longest timeout one of this operation's requests needed to end (:meth:`call`)
        self.attempt_timeout = request_timeout
        self.retry = retry
        self.stats = stats if stats is not None else TransferStats()
        self.limit = AdaptiveLimit(max_concurrency, name=store.url, adaptive=adaptive)
        self._parent: Store | None = None  # reads of incremental checkpoints' bases go through it

    @classmethod
    def from_options(cls, store: Store, options: Options, stats: TransferStats | None = None) -> TransferEngine:
        """An engine with ``options``' concurrency, timeout and retry policy (build it on the loop it runs on)."""
        return cls(
            store,
            max_concurrency=options.max_concurrency,
            request_timeout=options.request_timeout,
            retry=options.retry,
            stats=stats,
            adaptive=options.adaptive_concurrency,
        )

    async def call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run one request, holding a concurrency slot per attempt, retrying transient failures.

        Each attempt's timeout starts once it holds its slot: the time it waits behind the
        operation's other requests is the client's, not a stalled server's. An attempt that
        took longer than ``attempt_timeout`` and ended on a longer timeout (a retry's, see
        :func:`retry_attempts`) raises ``attempt_timeout``, the first attempt's timeout of the
        requests that start after it, to that: on a host where the operation's requests take
        that long, the next ones need not each time out first. A retry that ends quickly
        after a stall teaches nothing.
        Each attempt's outcome paces the next ones (:class:`~objckpt.transfer.throttle.AdaptiveLimit`).

        Args:
            what: names the request in errors (e.g. ``GET s3://b/k [0, 10)``).
            fn: makes a fresh awaitable for each attempt.
        """

        async def attempt(timeout: float) -> T:
            ticket = await self.limit.acquire()
            outcome: Outcome = "other"
            try:
                self.stats.add(requests=1)
                started = time.monotonic()
                result = await asyncio.wait_for(fn(), timeout)
                outcome = "ok"
                if time.monotonic() - started > self.attempt_timeout:  # it needed the longer timeout
                    self.attempt_timeout = timeout
                return result
            except ThrottledError:
                outcome = "throttled"
                self.stats.add(throttled=1)
                raise
            finally:
                self.limit.release(ticket, outcome)

        return await retry_attempts(
            what, attempt, retry=self.retry, request_timeout=self.attempt_timeout, stats=self.stats
        )

    async def put(
        self,
        key: str,
        data: bytes | memoryview | list[memoryview],
        *,
        mode: PutMode = "overwrite",
        crc32c: int | None = None,
    ) -> int:
        """Write one object, from one buffer or a list of parts (``Store.put_parts``).

        ``crc32c``: the object's CRC-32C, sent with it where the store checks uploads on
        arrival and keeps the value (:class:`~objckpt.storage.checksums.ChecksAtArrival`, S3),
        so that ``verify(read_data=False)`` can compare it later; other stores ignore it.

        Returns how many attempts it took. After more than one, an attempt
        abandoned on timeout may still be reading ``data`` inside the store
        client, so the caller must not reuse it.
        """
        attempts = 0
        checked = checks_at_arrival(self.store) if crc32c is not None else None

        def once() -> Awaitable[None]:
            nonlocal attempts
            attempts += 1
            if checked is not None and crc32c is not None:
                return checked.put_checked(key, data, crc32c=crc32c, mode=mode)
            if isinstance(data, list):
                return self.store.put_parts(key, data, mode=mode)
            return self.store.put(key, data, mode=mode)

        try:
            await self.call(f"PUT {self.store.url}/{key}", once)
        except ObjectNotFoundError as e:
            raise missing_bucket(self.store.url, key, e) from e
        size = sum(len(p) for p in data) if isinstance(data, list) else len(data)
        self.stats.add(bytes_written=size, objects_written=1)
        return attempts

    async def get_range(self, key: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` as a read-only buffer (the store's own, when it can lend it: no copy)."""
        data = await self.call(
            f"GET {self.store.url}/{key} [{start}, {end})",
            lambda: self._at(key)[0].get_range_buffer(self._at(key)[1], start=start, end=end),
        )
        self.stats.add(bytes_read=len(data))
        return data

    async def get_range_streamed(self, key: str, start: int, end: int, sink: ReadSink) -> int:
        """Bytes ``[start, end)`` handed to ``sink`` as they arrive (``Store.get_range_streamed``);
        a retry starts the sink over. How many bytes were handed over."""
        n = await self.call(
            f"GET {self.store.url}/{key} [{start}, {end})",
            lambda: self._at(key)[0].get_range_streamed(self._at(key)[1], start=start, end=end, sink=sink),
        )
        self.stats.add(bytes_read=n)
        return n

    async def get(self, key: str) -> bytes:
        data = await self.call(f"GET {self.store.url}/{key}", lambda: self._at(key)[0].get(self._at(key)[1]))
        self.stats.add(bytes_read=len(data))
        return data

    async def head(self, key: str) -> ObjectInfo:
        """One object's size and metadata, in the operation's window (a HEAD counts as a request)."""
        return await self.call(f"HEAD {self.store.url}/{key}", lambda: self._at(key)[0].head(self._at(key)[1]))

    def _at(self, key: str) -> tuple[Store, str]:
        """The store and key that hold ``key``: a reference key (``../<base>/...``, checked by the
        format's readers before it gets here) through the store one level up."""
        if not key.startswith(REF_UP):
            return self.store, key
        if self._parent is None:
            self._parent = parent_of(self.store)
        return self._parent, key[len(REF_UP) :]

    async def for_each(
        self,
        items: Iterable[Item],
        fn: Callable[[Item], Awaitable[None]],
        *,
        window_bytes: int,
        size: Callable[[Item], int],
    ) -> None:
        """Run ``fn`` over ``items`` as a sliding window bounded in bytes.

        Unlike batches awaited together, a slow request never stalls the rest;
        the first failure cancels everything still running and is raised.
        """
        budget = AsyncByteBudget(window_bytes)

        async def run(item: Item, held: int) -> None:
            try:
                await fn(item)
            finally:
                await budget.release(held)

        try:
            async with asyncio.TaskGroup() as group:
                for item in items:
                    held = await budget.acquire(size(item))
                    group.create_task(run(item, held))
        except BaseExceptionGroup as errors:  # callers expect the error itself, not a group
            raise first_error(errors) from None


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first real error in a task group's exceptions (callers expect it, not the group)."""
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            return first_error(error)
        if not isinstance(error, asyncio.CancelledError):
            return error
    return group.exceptions[0]
