"""The transfer engine: runs store requests concurrently, bounded, with retries.

All callers (save, restore, copy, verify) go through one engine per operation
so that concurrency limits, per-request timeouts, retry policy and byte
counters live in one place. Retries are decided by exception *type* (the
stores map vendor errors to :class:`TransientStoreError` at their boundary),
with exponential backoff and full jitter, bounded by a per-request deadline.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from objckpt.errors import StoreError, TransientStoreError
from objckpt.options import RetryConfig
from objckpt.storage.base import PutMode, Store

T = TypeVar("T")
Item = TypeVar("Item")


@dataclass
class TransferStats:
    """Counters of one operation, safe to read from any thread."""

    requests: int = 0
    retries: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    objects_written: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


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
    ) -> None:
        self.store = store
        self.request_timeout = request_timeout
        self.retry = retry
        self.stats = stats if stats is not None else TransferStats()
        self._slots = asyncio.Semaphore(max_concurrency)

    async def call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run one request with a timeout, retrying transient failures.

        Args:
            what: names the request in errors (e.g. ``GET s3://b/k [0, 10)``).
            fn: makes a fresh awaitable for each attempt.
        """
        deadline = time.monotonic() + self.retry.deadline
        attempt = 0
        while True:
            attempt += 1
            try:
                async with self._slots:
                    self.stats.add(requests=1)
                    return await asyncio.wait_for(fn(), self.request_timeout)
            except (TransientStoreError, TimeoutError, ConnectionError) as e:
                backoff = random.uniform(
                    0, min(self.retry.max_backoff, self.retry.initial_backoff * 2 ** (attempt - 1))
                )
                if attempt >= self.retry.max_attempts or time.monotonic() + backoff > deadline:
                    kind = "timed out" if isinstance(e, TimeoutError) else "failed"
                    raise StoreError(f"{what} {kind} after {attempt} attempts: {e}") from e
                self.stats.add(retries=1)
                await asyncio.sleep(backoff)

    async def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        await self.call(f"PUT {self.store.url}/{key}", lambda: self.store.put(key, data, mode=mode))
        self.stats.add(bytes_written=len(data), objects_written=1)

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        data = await self.call(
            f"GET {self.store.url}/{key} [{start}, {end})",
            lambda: self.store.get_range(key, start=start, end=end),
        )
        self.stats.add(bytes_read=len(data))
        return data

    async def get(self, key: str) -> bytes:
        data = await self.call(f"GET {self.store.url}/{key}", lambda: self.store.get(key))
        self.stats.add(bytes_read=len(data))
        return data

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
            raise _first_error(errors) from None


def _first_error(group: BaseExceptionGroup) -> BaseException:
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            return _first_error(error)
        if not isinstance(error, asyncio.CancelledError):
            return error
    return group.exceptions[0]
