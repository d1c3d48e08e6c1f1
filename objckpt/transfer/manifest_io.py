"""Reading a checkpoint's manifest, and (format version 2) the index objects it lists, from a store.

The I/O steps before any plan. A restore reads the root and the index objects
of the processes that wrote what it needs (:func:`read_indexes`); tools that
look at a whole checkpoint (``verify``, ``cp``, ``gc``, ``inspect``) read them
all (:func:`read_checkpoint`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from objckpt.core.format import MANIFEST_KEY, Manifest, parse_manifest
from objckpt.core.format_v2 import IndexDoc, merge_indexes, parse_index
from objckpt.errors import BucketNotFoundError, CheckpointNotFoundError, FormatError
from objckpt.storage import Store

#: Index objects read at once.
INDEX_READS_AT_ONCE = 16

# The first GET asks for this much. A shorter answer is the whole manifest, so
# a restore starts after one round trip instead of a HEAD and a GET (one RTT
# saved on every restore, which counts from another region). A longer manifest is sized with a HEAD,
# and refused if over the limit, before more than this is read.
FIRST_READ = 8 << 20


#: Reads of a manifest that does not parse, the first included, before it is called malformed.
MANIFEST_READS = 5


async def read_manifest(store: Store, *, size_limit: int, reads: int = MANIFEST_READS) -> Manifest:
    """Fetch, size-check and validate ``manifest.json``.

    A body that does not parse is fetched again, up to ``reads`` reads in all,
    before the manifest is called malformed: a byte flipped in flight spoils
    one read, not the next, and the first read that parses wins. Each re-read
    counts in the store's ``stats.checksum_retries`` (a
    :class:`~objckpt.transfer.engine.RetryingStore`'s).

    Raises:
        CheckpointNotFoundError: no manifest (a prefix holding only blobs included).
        FormatError: the manifest is malformed on every read, or too large.
    """
    for attempt in range(1, reads + 1):
        data = await _fetch(store, size_limit)
        try:
            return parse_manifest(data, size_limit=size_limit)
        except FormatError as e:
            if attempt >= reads:
                raise FormatError(f"{e} (the same over {reads} reads)" if reads > 1 else str(e)) from None
            stats = getattr(store, "stats", None)
            if stats is not None:
                stats.add(checksum_retries=1)
    raise AssertionError("unreachable")  # reads >= 1


async def _fetch(store: Store, size_limit: int) -> bytes:
    """The manifest's bytes, refused over ``size_limit`` (sized with a HEAD only when long)."""
    first = min(FIRST_READ, size_limit + 1)
    try:
        data = await store.get_range(MANIFEST_KEY, start=0, end=first)
        if len(data) == first:  # maybe more: size it before reading the rest
            info = await store.head(MANIFEST_KEY)
            if info.size > size_limit:
                raise FormatError(f"manifest at {store.url} is {info.size} bytes, over the limit of {size_limit}")
            if info.size > first:
                data += await store.get_range(MANIFEST_KEY, start=first, end=info.size)
    except BucketNotFoundError:
        raise  # a setting to fix, not "no checkpoint here"
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no committed checkpoint at {store.url} (no {MANIFEST_KEY})") from None
    return data


async def read_indexes(
    store: Store,
    manifest: Manifest,
    processes: Iterable[int],
    *,
    size_limit: int,
    leaves: dict[int, set[int]] | None = None,
) -> Manifest:
    """``manifest`` with the pieces of the index objects of ``processes`` (those not read yet).

    ``leaves``: per process, keep only the pieces of these leaves (a restore needs
    a few leaves from most of the processes it reads: see
    :func:`objckpt.core.format_v2.parse_index`); None keeps every piece.

    Each is checked against the root's size and crc32c and parsed strictly; one
    that fails is read again (as :func:`read_manifest` does) before it is a
    :class:`FormatError` naming it.
    """
    wanted = sorted(set(processes) - manifest.loaded)
    if manifest.version == 1 or not wanted:
        return manifest
    limit = asyncio.Semaphore(INDEX_READS_AT_ONCE)

    async def one(process: int) -> IndexDoc:
        ref = manifest.indexes[process]
        async with limit:
            for attempt in range(1, MANIFEST_READS + 1):
                try:  # never more than the root says (and one byte to tell a longer object)
                    data = await store.get_range(ref.key, start=0, end=min(ref.size, size_limit) + 1)
                except FileNotFoundError:
                    raise FormatError(
                        f"index object {ref.key} (process {process}) listed in the manifest of {store.url} is missing"
                    ) from None
                try:
                    kept = None if leaves is None else leaves.get(process, set())
                    return parse_index(data, manifest, process, size_limit=size_limit, leaves=kept)
                except FormatError as e:
                    if attempt >= MANIFEST_READS:
                        raise FormatError(f"{e} (the same over {MANIFEST_READS} reads)") from None
                    stats = getattr(store, "stats", None)
                    if stats is not None:
                        stats.add(checksum_retries=1)
        raise AssertionError("unreachable")

    docs = await asyncio.gather(*(one(p) for p in wanted))
    return merge_indexes(manifest, docs)


async def read_checkpoint(store: Store, *, size_limit: int) -> Manifest:
    """The manifest with every piece and blob: the root and, for version 2, every index object."""
    manifest = await read_manifest(store, size_limit=size_limit)
    return await read_indexes(store, manifest, range(len(manifest.indexes)), size_limit=size_limit)
