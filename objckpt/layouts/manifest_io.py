"""Reading a checkpoint's manifest, and (format version 2) the index objects it lists, from a store.

The I/O steps before any plan, behind :class:`~objckpt.layouts.native.NativeCheckpoint`.
A restore reads the root and the index objects of the processes that wrote what
it needs (:func:`read_indexes`); tools that look at a whole checkpoint
(``verify``, ``cp``, ``gc``) read them all (:func:`read_every_piece`,
:func:`read_checkpoint`); ``inspect`` and the manager's metrics read the root alone
(:func:`read_manifest`). Writing the root is here too, in one function for every writer
(:func:`commit_manifest`: a save's commit, a copy's), after the checks these readers make.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import numpy as np

from objckpt.core.format import ARRAY_KINDS, MANIFEST_KEY, Manifest, manifest_to_json, parse_manifest
from objckpt.core.format.index import IndexDoc, merge_indexes, parse_index
from objckpt.core.format.index3_bounds import ArrayBoxes, LeafTable, check_covered, check_rows_tiling
from objckpt.core.format.rows import LeafPieces, RowsBuilder
from objckpt.core.pieces import check_tiling
from objckpt.errors import BucketNotFoundError, CheckpointNotFoundError, FormatError, ObjectExistsError, StoreError
from objckpt.layouts.index3_io import read_index3
from objckpt.layouts.rereads import MANIFEST_READS, until_checked
from objckpt.storage import Store
from objckpt.transfer.engine import TransferEngine

#: Index objects read at once.
INDEX_READS_AT_ONCE = 16

T = TypeVar("T")
R = TypeVar("R")

# The first GET asks for this much. A shorter answer is the whole manifest, so
# a restore starts after one round trip instead of a HEAD and a GET (one RTT
# saved on every restore, which counts from another region). A longer manifest is sized with a HEAD,
# and refused if over the limit, before more than this is read.
FIRST_READ = 8 << 20


async def read_manifest(store: Store, *, size_limit: int, reads: int = MANIFEST_READS) -> Manifest:
    """Fetch, size-check and validate ``manifest.json``.

    A body that does not parse is fetched again, up to ``reads`` reads in all,
    before the manifest is called malformed: a byte flipped in flight spoils
    one read, not the next, and the first read that parses wins. Each re-read
    counts in the store's ``stats.checksum_retries`` (a
    :class:`~objckpt.transfer.retries.RetryingStore`'s).

    Raises:
        CheckpointNotFoundError: no manifest (a prefix holding only blobs included).
        FormatError: the manifest is malformed on every read, or too large.
    """
    for attempt in range(1, reads + 1):
        data = await _fetch(store, size_limit)  # a manifest over the limit is refused, not read again
        try:
            return parse_manifest(data, size_limit=size_limit)
        except FormatError as e:
            if attempt >= reads:
                raise FormatError(f"{e} (the same over {reads} reads)" if reads > 1 else str(e)) from None
            stats = getattr(store, "stats", None)
            if stats is not None:
                stats.add(checksum_retries=1)
    raise AssertionError("unreachable")  # reads >= 1


async def read_manifest_bytes(store: Store, *, size_limit: int) -> bytes:
    """``manifest.json``'s bytes as stored, unparsed, refused over ``size_limit`` (one read)."""
    return await _fetch(store, size_limit)


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
    columnar: bool = False,
    whole: bool = False,
) -> Manifest:
    """``manifest`` with the pieces of the index objects of ``processes`` (those not read yet).

    ``columnar``: every leaf's pieces as rows of one :class:`~objckpt.core.format.rows.Rows`
    (:class:`~objckpt.core.format.rows.LeafPieces`, what a restore plans from, of any version:
    version 1 and 2 pieces are turned into them) rather than as :class:`Piece` tuples (version 1
    and 2 only: version 3 and 4 frames always go into columns, with no object per piece).
    ``whole`` (version 3 and later): every row of every object, its boxes held as arrays
    (:class:`~objckpt.core.format.index3_bounds.ArrayBoxes`).

    ``leaves``: per process, keep only the pieces of these leaves (a restore needs
    a few leaves from most of the processes it reads: see
    :func:`objckpt.core.format.v2.parse_index`); None keeps every piece.

    Each is checked against the root's size and crc32c and parsed strictly; one
    that fails is read again (as :func:`read_manifest` does) before it is a
    :class:`FormatError` naming it. Version 3: only each one's head and the frames
    that hold the kept leaves are read (:func:`objckpt.layouts.index3_io.read_index3`).
    """
    wanted = sorted(set(processes) - manifest.loaded)
    if manifest.version == 1 or not wanted:
        return manifest.in_columns() if columnar else manifest
    if manifest.version >= 3:
        table = LeafTable(manifest)
        # Version 4 rows (leaves saved with a codec) carry their stored length; version 3's is their box's.
        digest = any(r.sha256 is not None for r in manifest.indexes)
        rows = RowsBuilder(digest, stored=manifest.version >= 4)
        if whole:
            rows.boxes = ArrayBoxes(table.kind_shape.shape[1])  # type: ignore[assignment]

        async def one3(process: int) -> IndexDoc:
            kept = None if leaves is None else leaves.get(process, set())
            return await read_index3(store, manifest, process, table, size_limit=size_limit, leaves=kept, rows=rows)

        docs = await each(wanted, one3, parallel=INDEX_READS_AT_ONCE)
        if whole:
            check_covered(table, manifest)  # before the rows are put in order
        blobs = {k: v for doc in docs for k, v in doc.blobs.items()}
        return manifest.with_rows(rows.build(), blobs, {doc.process for doc in docs}).in_columns()

    async def one(process: int) -> IndexDoc:
        ref = manifest.indexes[process]
        kept = None if leaves is None else leaves.get(process, set())

        async def read() -> IndexDoc:  # never more than the root says (and one byte to tell a longer object)
            data = await store.get_range(ref.key, start=0, end=min(ref.size, size_limit) + 1)
            return parse_index(data, manifest, process, size_limit=size_limit, leaves=kept)

        try:
            return await until_checked(read, store)
        except FileNotFoundError:
            raise FormatError(
                f"index object {ref.key} (process {process}) listed in the manifest of {store.url} is missing"
            ) from None

    docs = await each(wanted, one, parallel=INDEX_READS_AT_ONCE)
    merged = merge_indexes(manifest, sorted(docs, key=lambda d: d.process))
    return merged.in_columns() if columnar else merged


async def each(items: Iterable[T], fn: Callable[[T], Awaitable[R]], *, parallel: int) -> list[R]:
    """``fn`` over ``items``, at most ``parallel`` at once, started as others end; results in
    the order they end.

    Items are drawn lazily and the first error cancels what runs, waits for it and is
    raised: a root may list a million index objects, and a broken one ends the read
    after a window of reads, not a million tasks later.
    """
    source = iter(items)
    running: set[asyncio.Future[R]] = set()
    results: list[R] = []
    try:
        while True:
            for item in itertools.islice(source, parallel - len(running)):
                running.add(asyncio.ensure_future(fn(item)))
            if not running:
                return results
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            errors = [e for future in done if (e := future.exception()) is not None]  # each one retrieved
            if errors:
                raise errors[0]
            results.extend(future.result() for future in done)
    finally:
        for future in running:
            future.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)


async def read_checkpoint(store: Store, *, size_limit: int) -> Manifest:
    """The manifest with every piece and blob: the root and, for version 2, every index object.

    Version 2: the pieces of all index objects must tile each leaf exactly
    (:func:`check_whole_tiling`), so every reader of a whole checkpoint (``cp``,
    ``verify``, ``gc``) refuses what ``verify`` refuses, one box listed twice included.
    """
    return await read_every_piece(store, await read_manifest(store, size_limit=size_limit), size_limit=size_limit)


async def read_every_piece(store: Store, manifest: Manifest, *, size_limit: int) -> Manifest:
    """``manifest`` with the pieces of every index object not read yet, checked to tile
    each leaf exactly (:func:`check_whole_tiling`). Version 3 and later: as rows, checked in
    columns (no object per piece until one is asked for; no two rows of an index object share
    a blob's byte, :func:`objckpt.layouts.index3_io.read_index3`)."""
    every = range(len(manifest.indexes))
    if manifest.version < 3:
        manifest = await read_indexes(store, manifest, every, size_limit=size_limit)
        check_whole_tiling(manifest)
        return manifest
    manifest = await read_indexes(store, manifest, every, size_limit=size_limit, whole=True)
    held = next((leaf.pieces for leaf in manifest.leaves if isinstance(leaf.pieces, LeafPieces)), None)
    if held is None:
        check_whole_tiling(manifest)  # no row at all
        return manifest
    rows, boxes = held.rows, held.rows.boxes
    assert isinstance(boxes, ArrayBoxes)
    leaf = rows.leaf_of(np.arange(len(rows)))
    for i in check_rows_tiling(manifest, leaf, rows.box, boxes):
        entry = manifest.leaves[i]
        if entry.kind in ARRAY_KINDS and entry.shape is not None:
            check_tiling(tuple(entry.pieces), entry.shape, f"'leaves[{i}]' ({entry.path}): pieces of all index objects")
    return manifest


def check_whole_tiling(manifest: Manifest) -> None:
    """Version 2: the pieces of every process's index object together tile each leaf exactly.

    (Version 1 manifests are checked when they are parsed.) Raises FormatError naming the leaf.
    """
    if manifest.version == 1:
        return
    for i, leaf in enumerate(manifest.leaves):
        if leaf.kind in ARRAY_KINDS and leaf.shape is not None:
            check_tiling(tuple(leaf.pieces), leaf.shape, f"'leaves[{i}]' ({leaf.path}): pieces of all index objects")


async def check_readable(store: Store, root: bytes, *, size_limit: int) -> None:
    """A restore's checks of the root ``root`` and of every index object it lists in ``store``.

    Raises:
        FormatError: what a reader would raise (the index object, the field, why).
    """
    manifest = parse_manifest(root, size_limit=size_limit)
    await read_indexes(store, manifest, range(len(manifest.indexes)), size_limit=size_limit, columnar=True)


class Unreadable(StoreError):
    """A root :func:`commit_manifest` refused: the checkpoint would not read back."""


async def commit_manifest(engine: TransferEngine, manifest: Manifest, *, store: Store, size_limit: int) -> bool:
    """The one create-if-absent write of a checkpoint's root, a save's and a copy's alike.

    It runs once every earlier attempt of ``engine``'s writes has ended (:meth:`TransferEngine.put`
    settles them) and after a restore's checks of the root and of every index object it lists,
    read back from ``store`` (``engine``'s, with its retries): no checkpoint that no reader accepts is ever committed.
    Returns True once ``manifest`` is committed (our own earlier attempt whose reply was lost
    included), False when another checkpoint's root is there.

    Raises:
        Unreadable: what a reader would raise of it (the index object, the field, why); nothing
            is written.
    """
    data = manifest_to_json(manifest)
    try:
        await check_readable(store, data, size_limit=size_limit)
    except Exception as e:
        raise Unreadable(f"the checkpoint would not read back ({type(e).__name__}: {e})") from None
    try:
        await engine.put(MANIFEST_KEY, data, mode="create")
    except ObjectExistsError:
        try:
            return parse_manifest(await engine.get(MANIFEST_KEY), size_limit=size_limit).save_id == manifest.save_id
        except Exception:
            return False
    return True
