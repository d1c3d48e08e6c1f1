"""Restoring from the nearest of several copies of one checkpoint, failing over mid-restore.

What a restore with replicas does is docs/REGIONS.md's ("Replicas kept by the manager",
**Restore**): :func:`choose_locations` reads every location's manifest at once, keeps those
holding the same committed checkpoint (``save_id``) as the first one that has it and orders
them by a timed ``HEAD``; :class:`FailoverStore` serves the reads from the nearest, leaves a
location that keeps failing, and reads again at the next one what stays damaged over its
re-reads (:meth:`FailoverStore.elsewhere_if_damaged`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from objckpt.core.format import MANIFEST_KEY, Manifest
from objckpt.errors import (
    CheckpointNotFoundError,
    FormatError,
    IntegrityError,
    ObjectNotFoundError,
    StoreError,
    StorePermissionError,
    TransientStoreError,
)
from objckpt.layouts.manifest_io import read_manifest
from objckpt.options import Options
from objckpt.storage.base import ObjectInfo, PutMode, Store
from objckpt.storage.streaming import ReadSink
from objckpt.storage.urls import scheme_of
from objckpt.transfer.handle import Handle, bulk_of
from objckpt.transfer.retries import RetryingStore, close_store, open_store
from objckpt.transfer.stats import TransferStats

log = logging.getLogger("objckpt")

T = TypeVar("T")

#: Seconds allowed for each request of a location's probe (its manifest, two HEADs).
PROBE_TIMEOUT_S = 10.0
#: Attempts per probe request: a location that does not answer twice is left out.
PROBE_ATTEMPTS = 2


@dataclass(frozen=True)
class Location:
    """One copy of a checkpoint or manager root: its URL and the storage options to reach it.

    Wherever objckpt takes replicas, a plain URL string stands for
    ``Location(url)`` with the storage options of the call it is passed to when it names
    the same kind of store (S3, GCS, local disk...), and with none otherwise.

    Attributes:
        url: the copy's URL.
        storage_options: the options to open its store with (credentials, endpoint...);
            None: as described above.
    """

    url: str
    storage_options: dict[str, Any] | None = field(default=None, compare=False)

    def child(self, name: str) -> Location:
        """The location ``<url>/<name>``, reached the same way."""
        return Location(f"{self.url.rstrip('/')}/{name}", self.storage_options)


def as_locations(
    items: Sequence[str | Location] | None, storage_options: dict[str, Any] | None, *, primary: str
) -> list[Location]:
    """``items`` as :class:`Location`\\ s; a plain URL of the same kind of store as ``primary``
    (S3, GCS, local disk...) takes ``storage_options``, one of another kind none (an S3 key
    means nothing to a ``file://`` replica, and is refused there as an unknown option)."""
    found = []
    for item in items or ():
        if isinstance(item, Location):
            found.append(item)
        elif isinstance(item, str):
            same_kind = _kind_of(item) == _kind_of(primary)
            found.append(Location(item, storage_options if same_kind else None))
        else:
            raise TypeError(f"a replica is a URL or an objckpt.Location, got {type(item).__name__}: {item!r}")
    return found


def _kind_of(url: str) -> str:
    """The kind of store a URL names, aliases folded (``s3a`` is ``s3``, a plain path ``file``)."""
    scheme = scheme_of(url) or "file"
    return {"s3a": "s3", "gcs": "gs"}.get(scheme, scheme)


@dataclass
class Probe:
    """What one location said when asked for the checkpoint."""

    store: RetryingStore
    manifest: Manifest | None = None
    latency_s: float = float("inf")
    error: str | None = None


def probing_store(store: RetryingStore, options: Options) -> RetryingStore:
    """``store`` asked with a probe's short budget (:data:`PROBE_ATTEMPTS` attempts, each within
    :data:`PROBE_TIMEOUT_S`): where another location can answer instead, a dead one costs seconds."""
    return store.with_policy(
        retry=replace(options.retry, max_attempts=PROBE_ATTEMPTS),
        request_timeout=min(options.request_timeout, PROBE_TIMEOUT_S),
    )


async def _probe(store: RetryingStore, options: Options) -> Probe:
    probing = probing_store(store, options)
    found = Probe(store)
    try:
        found.manifest = await read_manifest(probing, size_limit=options.manifest_size_limit)
        timings = []
        for _ in range(2):  # the first request opened the connection: time the next ones
            started = time.perf_counter()
            await probing.head(MANIFEST_KEY)
            timings.append(time.perf_counter() - started)
        found.latency_s = min(timings)
    except CheckpointNotFoundError:
        found.error = "no committed checkpoint there"
    except Exception as e:  # an unreachable or refusing location is left out, and said so
        found.manifest = None
        found.error = f"{type(e).__name__}: {e}"
    return found


async def choose_locations(stores: Sequence[RetryingStore], options: Options) -> tuple[Manifest, list[Probe]]:
    """The checkpoint's manifest and the locations holding it, nearest first.

    The checkpoint is the one committed at the first of ``stores`` that has one
    (the URL asked for, unless it is unreachable); locations holding another
    ``save_id`` are left out, as are those that did not answer, each logged.

    Raises:
        CheckpointNotFoundError: no location holds a committed checkpoint (each one's answer named).
    """
    probes = list(await asyncio.gather(*(_probe(s, options) for s in stores)))
    reference = next((p.manifest for p in probes if p.manifest is not None), None)
    if reference is None:
        said = "; ".join(f"{p.store.url}: {p.error}" for p in probes)
        raise CheckpointNotFoundError(f"no committed checkpoint at any location ({said})")
    usable = []
    for p in probes:
        if p.manifest is None:
            log.warning("objckpt restore leaves out %s: %s", p.store.url, p.error)
        elif p.manifest.save_id != reference.save_id:
            log.warning(
                "objckpt restore leaves out %s: it holds save %s, not %s (another checkpoint)",
                p.store.url,
                p.manifest.save_id,
                reference.save_id,
            )
        else:
            usable.append(p)
    usable.sort(key=lambda p: p.latency_s)
    log.info(
        "objckpt restore reads %s from %s",
        reference.save_id,
        ", then ".join(f"{p.store.url} ({p.latency_s * 1000:.1f} ms)" for p in usable),
    )
    return reference, usable


class FailoverStore(Store):
    """Reads from the first healthy of several stores holding the same objects.

    A location is left once it fails ``failures_to_leave`` requests in a row
    (transient failures and timeouts, which the caller's engine retries on the
    location then current) or at once when an object is missing there or access
    is refused: the request then goes on, within the same call, to the next
    location. Once every location has been left, the last error is raised. Each
    request to a location has ``request_timeout``, so a location that hangs is
    left too; the caller's own timeout per call must allow for one timeout per
    location. Only reads are served: a restore writes nothing.
    """

    def __init__(
        self,
        stores: Sequence[Store],
        *,
        request_timeout: float,
        failures_to_leave: int,
        stats: TransferStats | None = None,
    ) -> None:
        if not stores:
            raise ValueError("FailoverStore needs at least one store")
        self.stores = list(stores)
        self.url = self.stores[0].url
        self.stats = stats
        self._timeout = request_timeout
        self._limit = max(1, failures_to_leave)
        self._current = 0
        self._failures = 0
        # What a caller may rely on must hold wherever a read lands.
        self.supports_create = False
        self.reads_in_place = all(s.reads_in_place for s in self.stores)
        self.streams_reads = all(s.streams_reads for s in self.stores)
        self.puts_parts = False

    def response_phase(self) -> int | None:
        """Where large responses land (:class:`~objckpt.restoring.aligned_reads.AlignedResponses`):
        the locations' common answer, so reads through here land aligned as they would directly."""
        from objckpt.restoring.aligned_reads import AlignedResponses
        from objckpt.storage.phase import bytes_phase

        phases = {s.response_phase() if isinstance(s, AlignedResponses) else bytes_phase() for s in self.stores}
        return phases.pop() if len(phases) == 1 else None

    def _leave(self, index: int, error: BaseException) -> bool:
        """Leave location ``index`` (if still current); whether another one is left to try."""
        if index == self._current:
            self._current += 1
            self._failures = 0
            if self._current < len(self.stores):
                log.warning(
                    "objckpt restore leaves %s (%s: %s); reading the rest from %s",
                    self.stores[index].url,
                    type(error).__name__,
                    error,
                    self.stores[self._current].url,
                )
        return self._current < len(self.stores)

    async def _read(self, fn: Callable[[Store], Awaitable[T]], size: Callable[[T], int]) -> T:
        while True:
            index = self._current
            if index >= len(self.stores):
                raise StoreError(f"every location of {self.url} has failed")
            store = self.stores[index]
            try:
                result = await asyncio.wait_for(fn(store), self._timeout)
            except (ObjectNotFoundError, StorePermissionError) as e:
                if self._leave(index, e):
                    continue
                raise
            except (TransientStoreError, TimeoutError, ConnectionError, StoreError) as e:
                if index == self._current:
                    self._failures += 1
                    if self._failures >= self._limit and self._leave(index, e):
                        continue
                if index < self._current:  # left meanwhile by another request: go on at once
                    continue
                raise
            if index == self._current:
                self._failures = 0
            if self.stats is not None:
                self.stats.add_location_bytes(store.url, size(result))
            return result

    async def elsewhere_if_damaged(self, read: Callable[[], Awaitable[T]]) -> T:
        """Run ``read`` (reads through this store and the checks of their bytes); when it
        raises an :class:`~objckpt.errors.IntegrityError` or a
        :class:`~objckpt.errors.FormatError` (a blob's bytes, or an index object, damaged
        at rest: the damage persisted over the re-reads inside ``read``), leave the
        location it read from and run it again at the next one. The last location's
        error is raised as is.
        """
        while True:
            index = self._current
            try:
                return await read()
            except (IntegrityError, FormatError) as e:
                if index >= len(self.stores) or not self._leave(index, e):
                    raise

    async def get_range(self, key: str, *, start: int, end: int) -> bytes:
        return await self._read(lambda s: s.get_range(key, start=start, end=end), len)

    async def get_range_buffer(self, key: str, *, start: int, end: int) -> memoryview:
        return await self._read(lambda s: s.get_range_buffer(key, start=start, end=end), len)

    async def get_range_streamed(self, key: str, *, start: int, end: int, sink: ReadSink) -> int:
        return await self._read(lambda s: s.get_range_streamed(key, start=start, end=end, sink=sink), int)

    async def get(self, key: str) -> bytes:
        return await self._read(lambda s: s.get(key), len)

    async def head(self, key: str) -> ObjectInfo:
        return await self._read(lambda s: s.head(key), lambda _: 0)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self._read(lambda s: s.list(prefix), lambda _: 0)

    async def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        raise StoreError(f"{self.url}: a restore from replicas writes nothing (PUT {key})")

    async def delete(self, key: str) -> None:
        raise StoreError(f"{self.url}: a restore from replicas deletes nothing (DELETE {key})")

    def child(self, subpath: str) -> FailoverStore:
        return FailoverStore(
            [s.child(subpath) for s in self.stores[self._current :] or self.stores[-1:]],
            request_timeout=self._timeout,
            failures_to_leave=self._limit,
            stats=self.stats,
        )


def failover_of(store: Store) -> FailoverStore | None:
    """The :class:`FailoverStore` under ``store`` (itself, or the one a retrying store wraps), if any."""
    inner = bulk_of(store)
    return inner if isinstance(inner, FailoverStore) else None


def open_locations(locations: Sequence[Location], options: Options, stats: TransferStats) -> list[RetryingStore]:
    """A retrying store for each location (closed by the caller, even on error)."""
    opened: list[RetryingStore] = []
    try:
        for location in locations:
            opened.append(open_store(location.url, location.storage_options, options, stats))
    except BaseException:
        for store in opened:
            close_store(store)
        raise
    return opened


def failover_handle(probes: Sequence[Probe], options: Options, stats: TransferStats) -> Handle:
    """The handle a restore reads through: the usable locations nearest first, behind the usual
    retries.

    Requests to one location keep ``options.request_timeout``; the retrying layer and the
    engine above allow one timeout per location (and one more), so a failover within a call is
    not cut short.
    """
    stores = [bulk_of(p.store) for p in probes]
    failover = FailoverStore(
        stores, request_timeout=options.request_timeout, failures_to_leave=options.retry.max_attempts, stats=stats
    )
    return Handle.of(failover, replace(options, request_timeout=options.request_timeout * (len(stores) + 1)), stats)
