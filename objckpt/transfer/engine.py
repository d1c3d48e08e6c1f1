"""The transfer engine: runs store requests concurrently, bounded, with retries.

All callers (save, restore, copy, verify) go through one engine per operation
so that concurrency limits, per-request timeouts, retry policy and byte
counters live in one place. Each request goes through :mod:`objckpt.transfer.retries`'
one retry loop. How many requests are in flight follows the store's throttling answers
(:mod:`objckpt.transfer.throttle`), up to ``Options.max_concurrency``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from objckpt.errors import BucketNotFoundError, ObjectNotFoundError, StoreError, ThrottledError
from objckpt.options import Options, RetryConfig
from objckpt.storage.base import ObjectInfo, PutMode, Store
from objckpt.storage.checksums import checks_at_arrival
from objckpt.storage.endpoint import endpoint_of
from objckpt.storage.streaming import ReadSink
from objckpt.transfer import runtime
from objckpt.transfer.cpu_slots import CpuSlots, default_save_threads
from objckpt.transfer.retries import REF_UP, parent_of, retry_attempts
from objckpt.transfer.stats import TransferStats
from objckpt.transfer.throttle import AdaptiveLimit, Outcome

T = TypeVar("T")
Item = TypeVar("Item")

FIRST_RATE = 2 << 20  #: bytes/s a request is granted before the operation has measured any (a slow link's)
ROUND_TRIPS = 2.0  #: seconds granted on top, once it has, to a request whose time is round trips


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
        cpu_threads: int | None = None,
    ) -> None:
        self.store = store
        #: the operation's CPU-heavy work, at most ``cpu_threads`` threads at once (:mod:`~objckpt.transfer.cpu_slots`)
        self.cpu = CpuSlots(cpu_threads or default_save_threads())
        #: the least first-attempt timeout of requests that start now: ``request_timeout``, raised to the
        #: longest timeout one of this operation's requests needed to end (:meth:`call`)
        self.attempt_timeout = request_timeout
        self._moved, self._busy = 0.0, 0.0  # bytes and seconds of recent requests: their throughput
        self.retry = retry
        self.stats = stats if stats is not None else TransferStats()
        self.limit = AdaptiveLimit(max_concurrency, name=store.url, adaptive=adaptive)
        self._parent: Store | None = None  # reads of incremental checkpoints' bases go through it
        #: the keys this engine has started writing: what an aborted save deletes (:meth:`abort`)
        self.written: list[str] = []
        self._attempts: set[asyncio.Future[Any]] = set()
        self._threads: set[concurrent.futures.Future[Any]] = set()  # the attempts' worker threads, until they return
        self._aborted = False

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
            cpu_threads=options.save_threads,
        )

    def timeout_for(self, size: int) -> float:
        """The first attempt's timeout for a request that moves ``size`` bytes: twice the time it
        should take at the throughput this operation's requests have measured (recent ones weigh
        most), at least ``attempt_timeout`` (from the first measurement on, at most
        :data:`ROUND_TRIPS` unless a request needed more); before any, ``attempt_timeout`` plus
        ``size`` at :data:`FIRST_RATE`. A stalled transfer is cut at twice its time."""
        if not self._busy:
            return self.attempt_timeout + size / FIRST_RATE
        return max(self.attempt_timeout, 2 * size * self._busy / self._moved)

    async def call(
        self, what: str, fn: Callable[[], Awaitable[T]], *, size: int = 0, watch: WatchedSink | None = None
    ) -> T:
        """Run one request, holding a concurrency slot per attempt, retrying transient failures.

        Each attempt's timeout starts once it holds its slot: the time it waits behind the
        operation's other requests is the client's, not a stalled server's. An attempt that
        took longer than its request's first timeout and ended on a longer one (a retry's, see
        :func:`retry_attempts`) raises ``attempt_timeout``, the least first timeout of the
        requests that start after it, to that: on a host where the operation's requests take
        that long, the next ones need not each time out first. A retry that ends quickly
        after a stall teaches nothing.
        Each attempt's outcome paces the next ones (:class:`~objckpt.transfer.throttle.AdaptiveLimit`).

        Args:
            what: names the request in errors (e.g. ``GET s3://b/k [0, 10)``).
            fn: makes a fresh awaitable for each attempt.
            size: the bytes it moves: its first timeout (:meth:`timeout_for`), and the throughput.
            watch: a streamed read's sink: a timed-out attempt says how far its response came.
        """

        async def attempt(timeout: float) -> T:
            ticket = await self.limit.acquire()
            outcome: Outcome = "other"
            try:
                if self._aborted:
                    raise StoreError(f"{what}: not sent, the operation was aborted")
                self.stats.add(requests=1)
                started = time.monotonic()
                if watch is not None:
                    watch.begun, watch.received, watch.last = False, 0, started
                with runtime.threads_joining(self._threads):
                    running = asyncio.ensure_future(fn())
                self._attempts.add(running)
                running.add_done_callback(self._attempts.discard)
                try:
                    result = await asyncio.wait_for(running, timeout)
                except TimeoutError:
                    raise TimeoutError(self._waited_for(size, watch, time.monotonic() - started)) from None
                outcome = "ok"
                took = time.monotonic() - started
                if size and not self._busy:  # the throughput carries transfers now: the floor is round trips
                    self.attempt_timeout = min(self.attempt_timeout, ROUND_TRIPS)
                if took > first:  # it needed the longer timeout
                    self.attempt_timeout = max(self.attempt_timeout, timeout)
                if size:
                    self._moved, self._busy = 0.9 * self._moved + size, 0.9 * self._busy + took
                return result
            except ThrottledError:
                outcome = "throttled"
                self.stats.add(throttled=1)
                raise
            finally:
                self.limit.release(ticket, outcome)

        first = self.timeout_for(size)
        return await retry_attempts(
            what,
            attempt,
            retry=self.retry,
            request_timeout=first,
            stats=self.stats,
            endpoint=endpoint_of(self.store),
        )

    def _waited_for(self, size: int, watch: WatchedSink | None, waited: float) -> str:
        """What a timed-out attempt waited for ("": no more than an answer), where a streamed read says."""
        if watch is None or not self.store.streams_reads:
            return ""
        if not watch.begun:
            return f"no response headers in {waited:.3g} s"
        return f"body stalled at {watch.received} of {size} bytes for {time.monotonic() - watch.last:.3g} s"

    async def abort(self, grace: float) -> None:
        """Refuse every request from now on and cancel the attempts in flight, waiting up to
        ``grace`` seconds for them to end (an interrupted save: :func:`objckpt.save`)."""
        self._aborted = True
        for running in list(self._attempts):
            running.cancel()
        await self.settle(grace)

    async def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds until no attempt of this engine runs, its worker threads
        included (a timed-out or cancelled attempt's write to a local disk runs on to its end)."""
        running = [*self._attempts, *map(asyncio.wrap_future, list(self._threads))]
        if running:
            await asyncio.wait(running, timeout=timeout)

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
        size = sum(len(p) for p in data) if isinstance(data, list) else len(data)

        def once() -> Awaitable[None]:
            nonlocal attempts
            attempts += 1
            self.written.append(key)
            if checked is not None and crc32c is not None:
                return checked.put_checked(key, data, crc32c=crc32c, mode=mode)
            if isinstance(data, list):
                return self.store.put_parts(key, data, mode=mode)
            return self.store.put(key, data, mode=mode)

        if mode == "create":  # a commit: once every earlier attempt has ended (the deadline bounds each)
            await self.settle(self.retry.deadline)
        try:
            request = self.call(f"PUT {self.store.url}/{key}", once, size=size)
            # A write into this host's file system is a memcpy per byte: it waits for a CPU slot
            # before its timeout starts.
            await (self.cpu.hold(request) if self.store.writes_on_host else request)
        except ObjectNotFoundError as e:
            raise missing_bucket(self.store.url, key, e) from e
        self.stats.add(bytes_written=size, objects_written=1)
        return attempts

    async def get_range(self, key: str, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` as a read-only buffer (the store's own, when it can lend it: no copy)."""
        data = await self.call(
            f"GET {self.store.url}/{key} [{start}, {end})",
            lambda: self._at(key)[0].get_range_buffer(self._at(key)[1], start=start, end=end),
            size=end - start,
        )
        self.stats.add(bytes_read=len(data))
        return data

    async def get_range_streamed(self, key: str, start: int, end: int, sink: ReadSink) -> int:
        """Bytes ``[start, end)`` handed to ``sink`` as they arrive (``Store.get_range_streamed``);
        a retry starts the sink over. How many bytes were handed over."""
        watch = WatchedSink(sink)
        n = await self.call(
            f"GET {self.store.url}/{key} [{start}, {end})",
            lambda: self._at(key)[0].get_range_streamed(self._at(key)[1], start=start, end=end, sink=watch),
            size=end - start,
            watch=watch,
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


class WatchedSink:
    """A streamed read's sink, passed through, noting how far the response has come: whether
    its head arrived (the store begins the sink then) and the body's bytes, and when last."""

    def __init__(self, sink: ReadSink) -> None:
        self.sink, self.begun, self.received, self.last = sink, False, 0, 0.0

    def begin(self) -> None:
        self.begun, self.received, self.last = True, 0, time.monotonic()
        self.sink.begin()

    def next_size(self, offset: int, limit: int) -> int:
        return self.sink.next_size(offset, limit)

    def receive(self, offset: int, data: memoryview) -> None:
        self.sink.receive(offset, data)
        self.received, self.last = offset + len(data), time.monotonic()

    def __getattr__(self, name: str) -> Any:  # the sink's optional methods (``destination``)
        return getattr(self.sink, name)


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first real error in a task group's exceptions (callers expect it, not the group)."""
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            return first_error(error)
        if not isinstance(error, asyncio.CancelledError):
            return error
    return group.exceptions[0]
