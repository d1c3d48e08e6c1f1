"""Save's blocking phase: each blob sent in place or staged, then handed to the I/O loop.

A synchronous save to a store that sends a body of parts (``Store.put_parts``)
uploads contiguous host shards where they lie; everything else is copied off the
devices into staging buffers (:mod:`objckpt.saving.staging`) first. The device→host
copies of the shards are all started before the first is read, as far ahead as the
staging memory allows (:class:`CopiesAhead`, :mod:`objckpt.core.device_reads`). Each upload
checksums its pieces off the loop thread and PUTs with the transfer engine's
retries; the commit (:mod:`objckpt.saving.commit`) waits for their piece records.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from objckpt.core.boxes import copy_piece_into, piece_bytes_in_place
from objckpt.core.checksum import crc32c, sha256_hex
from objckpt.core.device_reads import host_alias, host_view, start_host_copy
from objckpt.core.format import Piece
from objckpt.core.plan import BlobPlan
from objckpt.options import Options
from objckpt.saving.blob_sizing import staging_limit
from objckpt.saving.staging import StagingPool
from objckpt.transfer import runtime
from objckpt.transfer.engine import TransferEngine
from objckpt.transfer.handle import Handle

PieceRecord = tuple[int, Piece]  # (leaf index, stored piece)


def snapshot_and_upload(
    blobs: list[BlobPlan], handle: Handle, *, hold_uploads: bool
) -> list[concurrent.futures.Future[list[PieceRecord]]]:
    """The blocking phase: send each blob in place or fill its staging buffer, hand it to the uploader.

    With ``hold_uploads`` (async save) uploads wait until the copies finish (on
    2-core hosts the upload threads would otherwise slow the copy the caller
    waits for), or until the budget runs out, when the model is bigger than the
    budget and the phase has to stream. A synchronous save streams through a
    small pool of recycled buffers (``Options.staging_pool``; see
    :mod:`objckpt.saving.staging` for why), except for blobs it sends in place.
    Stops early if an upload has already failed.
    """
    engine, options = handle.engine, handle.options
    limit = staging_limit(options, hold_uploads=hold_uploads)
    pool = StagingPool(limit, capacity=max((b.size for b in blobs), default=0))
    failed = threading.Event()
    gate: concurrent.futures.Future[None] = concurrent.futures.Future()

    def open_gate() -> None:
        if not gate.done():
            gate.set_result(None)

    if not hold_uploads:
        open_gate()
    # A synchronous save may send array bytes straight from the arrays (it
    # returns only after its uploads end), when the store sends a body of parts.
    in_place = not hold_uploads and handle.traits.puts_parts
    futures: list[concurrent.futures.Future[list[PieceRecord]]] = []
    try:
        _fill_blobs(
            blobs, engine, pool, failed, gate, open_gate, futures, in_place=in_place, options=options, window=limit
        )
    finally:
        open_gate()
    return futures


def _fill_blobs(
    blobs: list[BlobPlan],
    engine: TransferEngine,
    pool: StagingPool,
    failed: threading.Event,
    gate: concurrent.futures.Future[None],
    open_gate: Callable[[], None],
    futures: list[concurrent.futures.Future[list[PieceRecord]]],
    *,
    in_place: bool,
    options: Options,
    window: int,
) -> None:
    """Stage each blob and hand it to the uploader, or with ``in_place`` send its
    pieces from the arrays themselves where they are contiguous host memory; the
    device→host copies of up to ``window`` bytes of shards are started ahead."""
    slots = threading.Semaphore(options.max_concurrency)  # in-place uploads started and not done
    ahead = CopiesAhead(blobs, window)
    try:
        for i, blob in enumerate(blobs):
            ahead.before(i)
            parts = _parts_in_place(blob) if in_place else None
            if parts is not None:
                if not _take_slot(slots, failed):
                    break
                future = runtime.submit(_upload_in_place(blob, parts, engine, slots, options.digest))
            else:
                buffer = pool.take(failed, open_gate)
                if buffer is None or failed.is_set():
                    break
                staged = buffer[: blob.size]
                _zero_gaps(staged, blob)  # a recycled buffer still holds an earlier blob
                for placed in blob.pieces:
                    piece = placed.piece
                    dtype = placed.piece.source[0].dtype
                    view = staged[placed.offset : placed.offset + piece.nbytes].view(dtype).reshape(piece.shape)
                    copy_piece_into(piece, view, host=ahead.host(piece.source[0]))
                future = runtime.submit(_upload(blob, buffer, pool, engine, gate, options.digest))

            def _done(f: concurrent.futures.Future[Any]) -> None:
                if f.cancelled() or f.exception() is not None:
                    failed.set()

            future.add_done_callback(_done)
            futures.append(future)
    finally:
        ahead.close()  # the host copies go with their aliases


class CopiesAhead:
    """Starts the device→host copies of the blobs' shards ahead of their staging, each through an
    alias of the shard (:func:`~objckpt.core.device_reads.host_alias`) that holds its host copy.

    Before blob ``i`` is staged, :meth:`before` drops the aliases no blob from ``i`` on reads
    (their host copies go with them) and starts the copies of the shards of blobs ``i``,
    ``i + 1``, … while the host copies alive stay within ``window`` bytes (blob ``i``'s own
    always start): with a budget that holds the state, every copy is under way before the
    first is read, and the transfers overlap instead of running one after another.
    :meth:`host` reads a shard's bytes through its alias; :meth:`close` drops every alias, so
    after the save no host copy is left on the user's arrays or anywhere else.
    """

    def __init__(self, blobs: list[BlobPlan], window: int) -> None:
        self._blobs, self._window = blobs, window
        self._next = 0  # the first blob whose shards are not all started
        self._last: dict[int, int] = {}  # id() of each shard -> the last blob that reads it
        for j, blob in enumerate(blobs):
            for placed in blob.pieces:
                self._last[id(placed.piece.source[0])] = j
        self._aliases: dict[int, tuple[Any, int]] = {}  # id() of a shard -> (its alias, bytes)

    def before(self, i: int) -> None:
        """Start the copies blob ``i`` needs, and those of the blobs after it that fit the window."""
        for key in [k for k in self._aliases if self._last[k] < i]:
            del self._aliases[key]
        held = sum(n for _, n in self._aliases.values())
        while self._next < len(self._blobs):
            sources = {
                id(p.piece.source[0]): p.piece.source[0]
                for p in self._blobs[self._next].pieces
                if id(p.piece.source[0]) not in self._aliases
            }
            size = sum(int(s.nbytes) for s in sources.values())
            if self._next > i and held + size > self._window:
                return
            for key, source in sources.items():
                alias = host_alias(source)
                start_host_copy(alias)
                self._aliases[key] = (alias, int(source.nbytes))
            held += size
            self._next += 1

    def host(self, source: Any) -> np.ndarray:
        """The host bytes of ``source``, read through its alias when one was started."""
        alias = self._aliases.get(id(source))
        return host_view(source if alias is None else alias[0])

    def close(self) -> None:
        self._aliases.clear()


_ZEROS = memoryview(bytes(4096))  # the bytes of a blob outside its pieces, sent in place


def _parts_in_place(blob: BlobPlan) -> list[memoryview] | None:
    """The blob's body as parts: zeros for its gaps, each piece's bytes where they lie.

    None if any piece would need a copy (see :func:`objckpt.core.boxes.piece_bytes_in_place`).
    """
    parts: list[memoryview] = []
    end = 0
    for placed in blob.pieces:
        data = piece_bytes_in_place(placed.piece)
        if data is None:
            return None
        gap = placed.offset - end
        parts.append(_ZEROS[:gap] if gap <= len(_ZEROS) else memoryview(bytes(gap)))
        parts.append(data)
        end = placed.offset + placed.piece.nbytes
    if blob.size > end:
        parts.append(memoryview(bytes(blob.size - end)))
    return parts


def _take_slot(slots: threading.Semaphore, failed: threading.Event) -> bool:
    """Wait for an upload slot; False once an upload has failed."""
    while not slots.acquire(timeout=0.1):
        if failed.is_set():
            return False
    return not failed.is_set()


async def _upload_in_place(
    blob: BlobPlan, parts: list[memoryview], engine: TransferEngine, slots: threading.Semaphore, digest: str | None
) -> list[PieceRecord]:
    """Checksum each piece (off the loop thread) and PUT the blob from its parts, with retries."""
    try:
        crcs = await asyncio.to_thread(_checksums, parts[1::2], digest)  # parts: gap, piece, gap, piece, ...
        await engine.put(blob.key, parts)
    finally:
        slots.release()
    return _records(blob, crcs)


def _zero_gaps(staged: np.ndarray, blob: BlobPlan) -> None:
    """Zero the bytes of a blob that belong to no piece (its spacers and alignment padding)."""
    end = 0
    for placed in blob.pieces:
        staged[end : placed.offset] = 0
        end = placed.offset + placed.piece.nbytes
    staged[end:] = 0


async def _upload(
    blob: BlobPlan,
    buffer: np.ndarray,
    pool: StagingPool,
    engine: TransferEngine,
    gate: concurrent.futures.Future[None],
    digest: str | None,
) -> list[PieceRecord]:
    """Checksum each piece (off the loop thread) and PUT the blob with retries, once the gate opens.

    The buffer goes back to the pool afterwards, for reuse only if one attempt sent it.
    """
    attempts = 0
    try:
        await asyncio.wrap_future(gate)
        data = buffer.data[: blob.size]
        view = data.toreadonly()
        pieces = [view[p.offset : p.offset + p.piece.nbytes] for p in blob.pieces]
        crcs = await asyncio.to_thread(_checksums, pieces, digest)
        attempts = await engine.put(blob.key, data)
    finally:
        pool.give(buffer, reusable=attempts == 1)
    return _records(blob, crcs)


def _checksums(pieces: list[memoryview], digest: str | None) -> list[tuple[int, str | None]]:
    """Each piece's crc32c, and its SHA-256 when ``digest`` asks for it (``Options.digest``)."""
    return [(crc32c(p), sha256_hex(p) if digest else None) for p in pieces]


def _records(blob: BlobPlan, crcs: list[tuple[int, str | None]]) -> list[PieceRecord]:
    """The manifest's record of each piece of an uploaded blob."""
    return [
        (p.piece.leaf, Piece(p.piece.start, p.piece.stop, blob.key, p.offset, p.piece.nbytes, crc, sha))
        for p, (crc, sha) in zip(blob.pieces, crcs)
    ]
