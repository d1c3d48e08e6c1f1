"""One operation's access to one store: made once per save, restore, copy or verify, and passed down.

An operation makes two kinds of calls. Metadata calls (existence checks, manifests,
listings, markers, deletes) go through a :class:`~objckpt.transfer.retries.RetryingStore`,
which times and retries each one. Bulk transfers (blobs, index objects, the manifest's
create-if-absent write) go through a :class:`~objckpt.transfer.engine.TransferEngine`,
which does its own retries under a concurrency window, so it drives the store beneath
the retrying layer: one retry policy per request, never two stacked, and no layer per
request on the bytes path. A :class:`Handle` holds both, over the same store, with the
operation's options and counters, and the store's traits (:class:`StoreTraits`) read
once when it is made: a wrapper that does not repeat them (the retrying layer says
only ``supports_create``) cannot hide them from a caller further down.

This module and the engine are the only places that know how the layers wrap each
other; everything else asks the handle (``handle.store``, ``handle.engine``,
``handle.bulk``, ``handle.traits``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from objckpt.options import Options
from objckpt.storage.base import Store
from objckpt.transfer.engine import TransferEngine
from objckpt.transfer.retries import RetryingStore, close_store, open_store
from objckpt.transfer.stats import TransferStats


@dataclass(frozen=True)
class StoreTraits:
    """What a store declares it can do (:class:`~objckpt.storage.base.Store`'s class attributes),
    read once per operation."""

    #: writes create-if-absent atomically (a commit can never overwrite another's manifest)
    supports_create: bool
    #: ``get_range_buffer`` fills a buffer of its own that a read may keep (no copy)
    reads_in_place: bool
    #: ``get_range_streamed`` hands bytes over as they arrive
    streams_reads: bool
    #: ``put_parts`` sends a body of parts without joining them
    puts_parts: bool

    @classmethod
    def of(cls, store: Store) -> StoreTraits:
        """The traits ``store`` declares, each read once, here."""
        return cls(
            supports_create=bool(store.supports_create),
            reads_in_place=bool(store.reads_in_place),
            streams_reads=bool(store.streams_reads),
            puts_parts=bool(store.puts_parts),
        )

    @classmethod
    def beneath(cls, store: RetryingStore) -> StoreTraits:
        """The traits of the store beneath ``store``'s retrying layer: ``supports_create`` as
        that layer read it when it was made (it repeats that one), the others read here."""
        bulk = store.inner
        return cls(
            supports_create=bool(store.supports_create),
            reads_in_place=bool(bulk.reads_in_place),
            streams_reads=bool(bulk.streams_reads),
            puts_parts=bool(bulk.puts_parts),
        )


def bulk_of(store: Store) -> Store:
    """The store beneath ``store``'s retrying layer (``store`` itself when it has none): the one an
    engine drives, and the one whose traits count."""
    return store.inner if isinstance(store, RetryingStore) else store


class Handle:
    """One operation's store, engine, options and counters.

    Attributes:
        url: the store's URL.
        store: the retrying store, for metadata calls.
        bulk: the store beneath it, which ``engine`` drives.
        engine: the operation's one transfer engine (concurrency window, retries, byte counts).
        traits: ``bulk``'s traits, read once.
        options: the operation's options (its engine's concurrency, timeout and retries).
        stats: the operation's counters (the engine's; the retrying store's unless it has its own).
    """

    __slots__ = ("bulk", "engine", "options", "stats", "store", "traits", "url")

    def __init__(self, store: RetryingStore, options: Options, stats: TransferStats) -> None:
        self.store = store
        self.bulk = store.inner
        self.url = store.url
        self.options = options
        self.stats = stats
        self.traits = StoreTraits.beneath(store)
        # The engine's asyncio objects are made on first use, on the loop that uses them.
        self.engine = TransferEngine.from_options(self.bulk, options, stats)

    @classmethod
    def of(cls, store: Store, options: Options, stats: TransferStats | None = None) -> Handle:
        """The handle of an open store: a retrying one (from :func:`~objckpt.transfer.retries.open_store`)
        as it is, any other behind ``options``' retries. ``stats``: the store's own when not given."""
        if stats is None:
            stats = getattr(store, "stats", None) or TransferStats()
        if not isinstance(store, RetryingStore):
            store = RetryingStore(store, retry=options.retry, request_timeout=options.request_timeout, stats=stats)
        return cls(store, options, stats)

    @classmethod
    def open(
        cls, url: str, storage_options: dict[str, Any] | None, options: Options, stats: TransferStats | None = None
    ) -> Handle:
        """Open ``url`` for one operation (:meth:`close` it, or use :func:`opened`)."""
        stats = stats if stats is not None else TransferStats()
        return cls(open_store(url, storage_options, options, stats), options, stats)

    def close(self) -> None:
        """Close the store (its connections, its streamed reader's threads) from a caller's thread."""
        close_store(self.store)

    async def aclose(self) -> None:
        """:meth:`close`, on the I/O loop."""
        await self.store.close()

    def __repr__(self) -> str:
        return f"Handle({self.url!r}, {self.traits})"


@contextlib.contextmanager
def opened(
    url: str, storage_options: dict[str, Any] | None, options: Options, stats: TransferStats | None = None
) -> Iterator[Handle]:
    """:meth:`Handle.open` for one block: the store is closed when it ends."""
    handle = Handle.open(url, storage_options, options, stats)
    try:
        yield handle
    finally:
        handle.close()
