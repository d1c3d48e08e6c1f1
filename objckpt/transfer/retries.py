"""Timed, retried store calls: the policy every store request follows.

:func:`retry_attempts` is the one retry loop: a transient failure (the stores map vendor
errors to :class:`TransientStoreError` at their boundary) is retried with exponential backoff
and full jitter, each attempt under its own timeout, within a per-request deadline. The
transfer engine runs its requests through it; :class:`RetryingStore` puts it around the calls
that do not go through an engine (existence checks, manifest reads, listings, deletes), so a
throttled bucket never fails a save or restore on its first 503.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from objckpt.errors import ChecksumMismatchError, StoreError, ThrottledError, TransientStoreError
from objckpt.options import Options, RetryConfig
from objckpt.storage import from_url
from objckpt.storage.base import ObjectInfo, PutMode, Store
from objckpt.storage.endpoint import endpoint_of
from objckpt.transfer import runtime
from objckpt.transfer.stats import TransferStats

T = TypeVar("T")
log = logging.getLogger(__name__)

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


async def retry_attempts(
    what: str,
    attempt: Callable[[float], Awaitable[T]],
    *,
    retry: RetryConfig,
    request_timeout: float,
    stats: TransferStats | None = None,
    endpoint: str = "",
) -> T:
    """Run ``attempt(timeout)``, retrying transient failures; ``attempt`` applies its timeout
    itself, to the time its request is on the wire (not to a wait for a concurrency slot).

    Transient means :class:`TransientStoreError` (429/5xx, resets, mapped by the
    stores), a timeout or a connection error; anything else is raised at once.
    Backoff is exponential with full jitter, bounded by ``retry.deadline``.

    An attempt that times out (its own timeout, or the store's: a :class:`TransientStoreError`
    caused by a ``TimeoutError``) gives the next one twice its time, as TCP backs off its
    retransmission timeout. A request that is slow but moving (its bytes share the link and
    the CPU with the operation's other requests, on a busy host) then ends within a few
    attempts, where the same timeout each time would cut it at the same point every time;
    a stalled server still costs the first attempt only ``request_timeout``. Each attempt
    is cut to what is left of ``retry.deadline``. The first that times out and is retried is logged, naming
    ``endpoint`` (once a minute per endpoint: a stall times out every request in flight). The error
    names this process and what the last attempt waited for (its ``TimeoutError``'s text, if any).
    """
    started = time.monotonic()
    deadline = started + retry.deadline
    timeout, attempts, silent = request_timeout, 0, 0.0  # silent: the longest attempt that timed out
    while True:
        attempts += 1
        given = min(timeout, deadline - time.monotonic())
        began = time.monotonic()
        try:
            return await attempt(given)
        except (TransientStoreError, TimeoutError, ConnectionError) as e:
            if isinstance(e, StoreError) and not isinstance(e, TransientStoreError):
                raise  # a store's own verdict: not worth retrying (a refused endpoint is also a ConnectionError)
            timed_out = isinstance(e, TimeoutError) or isinstance(e.__cause__, TimeoutError)
            waited = round(time.monotonic() - began, 1) if timed_out else 0.0
            server = f"the server at {endpoint}" if endpoint else "the server"
            stalled = f"{server}: {e}" if isinstance(e, TimeoutError) and str(e) else ""
            backoff = random.uniform(0, min(retry.max_backoff, retry.initial_backoff * 2 ** (attempts - 1)))
            if attempts >= retry.max_attempts or time.monotonic() + backoff >= deadline:
                if not timed_out:
                    raise StoreError(f"{what} from {process_name()} failed after {attempts} attempts: {e}") from e
                raise StoreError(
                    f"{what} from {process_name()} timed out (the last attempt given {given:.3g} s) after "
                    f"{attempts} attempts in {time.monotonic() - started:.3g} s: "
                    f"{stalled or f'{server} never answered within {max(silent, waited):g} s'}"
                ) from e
            if timed_out:
                if not silent:
                    _warn_silent(what, server, waited, deadline - time.monotonic())
                silent, timeout = max(silent, waited), 2 * given
            if stats is not None:
                stats.add(retries=1)
            await asyncio.sleep(backoff)


def process_name() -> str:
    """This process, as errors name it: ``process N``, its JAX process index (0 where JAX is not loaded)."""
    jax = sys.modules.get("jax")
    return f"process {jax.process_index() if jax is not None else 0}"


_warned: dict[str, float] = {}  # when each server was last warned about (time.monotonic())


def _warn_silent(what: str, server: str, waited: float, left: float) -> None:
    if time.monotonic() - _warned.get(server, -60.0) >= 60.0:
        _warned[server] = time.monotonic()
        log.warning(
            f"{what}: {server} did not answer within {waited:g} s; retrying, each attempt given twice the time, "
            f"for at most {left:.0f} s more (Options.request_timeout, RetryConfig.deadline)"
        )


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
        self.endpoint = endpoint_of(inner)  # named when it gives no answer

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        async def attempt(timeout: float) -> T:
            try:
                return await asyncio.wait_for(fn(), timeout)
            except ThrottledError:  # counted as the engine counts its own (TransferStats.throttled)
                if self.stats is not None:
                    self.stats.add(throttled=1)
                raise

        return await retry_attempts(
            what, attempt, retry=self._retry, request_timeout=self._timeout, stats=self.stats, endpoint=self.endpoint
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

    async def list_names(self, prefix: str = "") -> builtins.list[str]:
        return await self._call(f"LIST {self.url}/{prefix} (one level)", lambda: self.inner.list_names(prefix))

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
