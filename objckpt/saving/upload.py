"""Save's blocking phase: each blob sent in place or staged, then handed to the I/O loop.

The device→host copies of the shards are all started before the first is read, as far
ahead as ``Options.memory_budget`` allows (:mod:`objckpt.saving.host_copies`). A blob whose
pieces lie contiguous in host bytes nobody else writes (copies off an accelerator) is sent
from there, as a body of parts, when the store takes one (``Store.put_parts``); so is any
contiguous blob of a synchronous save, which returns only after its uploads end. Everything
else is copied into staging buffers (:mod:`objckpt.saving.staging`) first. Each upload
checksums its pieces off the loop thread and PUTs with the transfer engine's retries; the
commit (:mod:`objckpt.saving.commit`) waits for their piece records.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from typing import Any

import numpy as np

from objckpt.core.boxes import copy_piece_into, piece_bytes_of
from objckpt.core.checksum import blob_crc32c, crc32c, sha256_hex
from objckpt.core.format import Piece
from objckpt.core.plan import BlobPlan
from objckpt.saving.blob_sizing import staging_limit
from objckpt.saving.encode import Spans, encode_blob
from objckpt.saving.host_copies import HostCopies, wants_snapshot
from objckpt.saving.staging import StagingPool
from objckpt.transfer import runtime
from objckpt.transfer.engine import TransferEngine
from objckpt.transfer.handle import Handle

PieceRecord = tuple[int, Piece]  # (leaf index, stored piece)


def snapshot_and_upload(
    blobs: list[BlobPlan], handle: Handle, *, hold_uploads: bool, coded: frozenset[int] = frozenset()
) -> list[concurrent.futures.Future[list[PieceRecord]]]:
    """The blocking phase: send each blob in place or fill its staging buffer, hand it to the uploader.

    With ``hold_uploads`` (async save) uploads wait until the copies off the devices finish (on
    2-core hosts the upload threads would otherwise slow the copy the caller waits for), or
    until the budget runs out, when the model is bigger than the budget and the phase has to
    stream. A synchronous save streams through a small pool of recycled buffers
    (``Options.staging_pool``; see :mod:`objckpt.saving.staging` for why), except for blobs it
    sends in place. Blobs whose shards were copied off an accelerator are sent from those host
    copies (no staging), when the store sends a body of parts. With ``Options.device_snapshot``
    the shards are first copied on their devices and everything after that runs on a thread of
    its own: the phase returns once those copies are dispatched. Stops early if an upload has
    already failed. ``coded``: the leaves whose pieces are compressed (``Options.compression``):
    every blob is then staged, and encoded by its upload (:mod:`objckpt.saving.encode`).
    """
    options = handle.options
    snapshot = hold_uploads and wants_snapshot(options.device_snapshot, blobs)
    fill = _Fill(blobs, handle, hold_uploads=hold_uploads, snapshot=snapshot, coded=coded)
    if not snapshot:
        fill.run()
        return fill.futures
    done: concurrent.futures.Future[list[PieceRecord]] = concurrent.futures.Future()
    threading.Thread(target=fill.run_then_gather, args=(done,), name="objckpt-save-snapshot", daemon=True).start()
    return [done]


class _Fill:
    """One save's blocking phase: each blob's bytes read off the devices (:class:`HostCopies`),
    then sent in place or staged, and handed to the uploader (``futures``, in blob order)."""

    def __init__(
        self, blobs: list[BlobPlan], handle: Handle, *, hold_uploads: bool, snapshot: bool, coded: frozenset[int]
    ) -> None:
        options = handle.options
        limit = staging_limit(options, hold_uploads=hold_uploads)
        self.blobs, self.engine, self.digest = blobs, handle.engine, options.digest
        self.hold_uploads = hold_uploads
        self.pool = StagingPool(limit, capacity=max((b.size for b in blobs), default=0))
        # Host copies of an accelerator's shards are held until sent: the budget bounds them.
        self.copies = HostCopies(blobs, options.memory_budget, snapshot=snapshot)
        self.failed = threading.Event()
        self.gate: concurrent.futures.Future[None] = concurrent.futures.Future()
        if not hold_uploads:
            self.open_gate()
        # A synchronous save may send array bytes straight from the arrays (it returns only after
        # its uploads end); any save, bytes copied off an accelerator; both when the store sends
        # a body of parts.
        self.puts_parts = handle.traits.puts_parts and not coded  # a compressed piece is never sent in place
        self.coded = coded
        self.slots = threading.Semaphore(options.max_concurrency)  # synchronous in-place uploads in flight
        self.futures: list[concurrent.futures.Future[list[PieceRecord]]] = []

    def open_gate(self) -> None:
        if not self.gate.done():
            self.gate.set_result(None)

    def run(self) -> None:
        try:
            for i, blob in enumerate(self.blobs):
                if not self.copies.before(i, self.failed, self.open_gate) or not self._send(i, blob):
                    break
        finally:
            self.open_gate()
            self.copies.close()  # what no upload holds goes now; no host copy outlives its upload

    def run_then_gather(self, done: concurrent.futures.Future[list[PieceRecord]]) -> None:
        """:meth:`run` on this thread, then ``done`` gets every blob's records (or the first error)."""
        try:
            self.run()
            records = [r for f in self.futures for r in f.result()]
        except BaseException as exc:  # noqa: BLE001 - handed to the commit, which reports it
            done.set_exception(exc)
        else:
            done.set_result(records)

    def _send(self, i: int, blob: BlobPlan) -> bool:
        """Hand blob ``i`` to the uploader; False once an upload has failed."""
        parts = self._parts(blob) if self.puts_parts else None
        if parts is not None:
            if not self.hold_uploads and not _take_slot(self.slots, self.failed):
                return False
            slot = None if self.hold_uploads else self.slots
            future = runtime.submit(_upload_parts(blob, parts, self.engine, self.gate, slot, self.digest))
            future.add_done_callback(functools.partial(self._release, i))
        else:
            buffer = self.pool.take(self.failed, self.open_gate)
            if buffer is None or self.failed.is_set():
                self.copies.release(i)
                return False
            staged = buffer[: blob.size]
            _zero_gaps(staged, blob)  # a recycled buffer still holds an earlier blob
            for placed in blob.pieces:
                piece = placed.piece
                view = staged[placed.offset : placed.offset + piece.nbytes].view(piece.source[0].dtype)
                copy_piece_into(piece, view.reshape(piece.shape), host=self.copies.host(piece.source[0])[0])
            self.copies.release(i)
            future = runtime.submit(_upload(blob, buffer, self.pool, self.engine, self.gate, self.digest, self.coded))
        future.add_done_callback(self._on_done)
        self.futures.append(future)
        return True

    def _release(self, i: int, _: concurrent.futures.Future[Any]) -> None:
        self.copies.release(i)

    def _on_done(self, f: concurrent.futures.Future[Any]) -> None:
        if f.cancelled() or f.exception() is not None:
            self.failed.set()

    def _parts(self, blob: BlobPlan) -> list[memoryview] | None:
        """The blob's body as parts: zeros for its gaps, each piece's bytes where they lie.

        None if any piece would need a copy: its bytes are not one contiguous run of its host
        bytes, or (an async save) those are not a copy of their own (CPU devices, numpy arrays,
        which the caller may change once the save returns).
        """
        parts: list[memoryview] = []
        end = 0
        for placed in blob.pieces:
            piece = placed.piece
            host, owned = self.copies.host(piece.source[0])
            if self.hold_uploads and not owned:
                return None
            data = piece_bytes_of(piece, host)
            if data is None:
                return None
            gap = placed.offset - end
            parts.append(_ZEROS[:gap] if gap <= len(_ZEROS) else memoryview(bytes(gap)))
            parts.append(data)
            end = placed.offset + piece.nbytes
        if blob.size > end:
            parts.append(memoryview(bytes(blob.size - end)))
        return parts


_ZEROS = memoryview(bytes(4096))  # the bytes of a blob outside its pieces, sent in place


def _take_slot(slots: threading.Semaphore, failed: threading.Event) -> bool:
    """Wait for an upload slot; False once an upload has failed."""
    while not slots.acquire(timeout=0.1):
        if failed.is_set():
            return False
    return not failed.is_set()


async def _upload_parts(
    blob: BlobPlan,
    parts: list[memoryview],
    engine: TransferEngine,
    gate: concurrent.futures.Future[None],
    slots: threading.Semaphore | None,
    digest: str | None,
) -> list[PieceRecord]:
    """Once the gate opens, checksum each piece (off the loop thread) and PUT the blob from its
    parts, with retries; then free its slot (``slots``: a synchronous save's in-place uploads)."""
    try:
        await asyncio.wrap_future(gate)
        crcs = await engine.cpu.run(_checksums, parts[1::2], digest, blob)  # parts: gap, piece, gap, piece, ...
        await engine.put(
            blob.key, parts, crc32c=_blob_crc32c([(p.offset, p.piece.nbytes) for p in blob.pieces], crcs, blob.size)
        )
    finally:
        if slots is not None:
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
    coded: frozenset[int] = frozenset(),
) -> list[PieceRecord]:
    """Checksum each piece (off the loop thread) and PUT the blob with retries, once the gate opens.

    The buffer goes back to the pool afterwards, for reuse only if one attempt sent it. A
    compressed save's blob (``coded``) is encoded first, off the loop thread, into a body of
    its own, and the buffer goes back as soon as it is.
    """
    attempts = 0
    held = True
    spans = None
    try:
        await asyncio.wrap_future(gate)
        data: Any = buffer.data[: blob.size]
        if coded:
            data, spans = await engine.cpu.run(encode_blob, blob, data, coded)
            held = False
            pool.give(buffer, reusable=True)
        view = memoryview(data).toreadonly()
        if spans is None:
            pieces = [view[p.offset : p.offset + p.piece.nbytes] for p in blob.pieces]
        else:
            pieces = [view[at : at + n] for at, n in spans]
        crcs = await engine.cpu.run(_checksums, pieces, digest, None if coded else blob)
        placed = spans if spans is not None else [(p.offset, p.piece.nbytes) for p in blob.pieces]
        attempts = await engine.put(blob.key, data, crc32c=_blob_crc32c(placed, crcs, len(view)))
    finally:
        if held:
            pool.give(buffer, reusable=attempts == 1)
    return _records(blob, crcs, spans)


def _checksums(pieces: list[memoryview], digest: str | None, blob: BlobPlan | None) -> list[tuple[int, str | None]]:
    """Each piece's crc32c, and its SHA-256 when ``digest`` asks for it (``Options.digest``; one an
    incremental save computed already of these very bytes, ``blob``'s, is not computed again)."""
    known = [placed.piece.sha256 for placed in blob.pieces] if blob is not None else [None] * len(pieces)
    return [(crc32c(p), (sha or sha256_hex(p)) if digest else None) for p, sha in zip(pieces, known)]


def _blob_crc32c(spans: Spans, crcs: list[tuple[int, str | None]], size: int) -> int:
    """The whole blob's CRC-32C, combined from its pieces' at their ``spans`` (no second pass),
    sent with its upload."""
    return blob_crc32c(((at, n, crc) for (at, n), (crc, _) in zip(spans, crcs)), size)


def _records(blob: BlobPlan, crcs: list[tuple[int, str | None]], spans: Spans | None = None) -> list[PieceRecord]:
    """The manifest's record of each piece of an uploaded blob (``spans``: where an encoded
    blob's pieces lie, :func:`objckpt.saving.encode.encode_blob`)."""
    if spans is None:
        spans = [(p.offset, p.piece.nbytes) for p in blob.pieces]
    return [
        (p.piece.leaf, Piece(p.piece.start, p.piece.stop, blob.key, at, n, crc, sha))
        for p, (at, n), (crc, sha) in zip(blob.pieces, spans, crcs)
    ]
