"""How restore issues one planned read whose bytes may become arrays as they land.

A piece whose bytes sit on a 64-byte boundary inside a response can become its
box's host array without a copy (and on the CPU backend the device array
itself). :func:`read_aligned` predicts where responses land and starts reads
early to match, and joins the sub-ranges of a huge read into aligned memory.
Reads restore copies out of go another way on stores that stream
(:mod:`objckpt.restoring.scatter`).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from objckpt.core.plan import PACKING_SLACK, ReadRequest
from objckpt.storage.phase import bytes_phase
from objckpt.transfer.buffers import DEVICE_ALIGNMENT, aligned_zeros
from objckpt.transfer.engine import TransferEngine
from objckpt.transfer.ordered import run_in_order


@runtime_checkable
class AlignedResponses(Protocol):
    """A store that can say where its large responses land in memory (optional).

    Not part of the :class:`~objckpt.storage.Store` contract: a hint about the
    store's client's allocator, which only stores with their own response
    buffers give (:class:`~objckpt.storage.obstore.store.ObstoreStore`).
    Restore starts large reads early by it so their bytes land aligned, and
    checks every response. A store without it is taken to return ``bytes``
    objects, what the default ``Store.get_range_buffer`` wraps.
    """

    def response_phase(self) -> int | None:
        """Where a large ``get_range_buffer`` result's bytes start past a 64-byte
        boundary, when the allocator makes that predictable (else None)."""
        ...


class ResponseAlignment:
    """Where the store's response buffers start, so reads can be nudged to land aligned.

    A piece whose bytes sit on a 64-byte boundary in the response buffer can
    become its box's host array as is, and on the CPU backend the device array
    itself (:func:`objckpt.transfer.buffers.aligned_zeros` says why): no copy at all.
    Large responses start at a fixed phase past a page boundary (16 bytes for a
    glibc ``malloc``, 48 for a ``bytes`` object on top of it), so starting the
    read that many bytes short of 64 early (blobs keep free bytes before large
    pieces) puts the piece on the boundary. The store gives the phase it
    expects; each large response corrects it, and a miss only costs the copy.
    What a store's responses taught is kept for the next restore from the same
    kind of store (``learned``), so a wrong first guess costs one read's
    copies once per process, not every restore's first reads.
    """

    LARGE = 1 << 20  # smaller responses come from the heap, at no fixed phase
    learned: ClassVar[dict[type, int]] = {}  # per store class: the phase its last large response had

    def __init__(self, phase: int | None, kind: type | None = None) -> None:
        self.kind = kind
        # address % DEVICE_ALIGNMENT of large responses; None: unknown
        self.phase = self.learned.get(kind, phase) if kind is not None else phase

    @classmethod
    def of(cls, store: Any) -> ResponseAlignment:
        """The alignment to start with for ``store``: what its kind taught, else its hint
        (:class:`AlignedResponses`), else where a large ``bytes`` object's data starts."""
        phase = store.response_phase() if isinstance(store, AlignedResponses) else bytes_phase()
        return cls(phase, type(store))

    def pad(self, request: ReadRequest) -> int:
        """Bytes to read before the request's start (0 unless it has that much slack)."""
        if self.phase is None or request.length < self.LARGE:
            return 0
        pad = -self.phase % DEVICE_ALIGNMENT
        return pad if pad <= request.slack else 0

    def observe(self, response: memoryview) -> None:
        """Learn the phase from a whole response as the store returned it."""
        if len(response) >= self.LARGE:
            self.phase = address(response) % DEVICE_ALIGNMENT
            if self.kind is not None:
                self.learned[self.kind] = self.phase


def address(data: memoryview | np.ndarray) -> int:
    """Where a buffer's first byte sits in memory (0 for an empty one)."""
    return int(np.frombuffer(data, dtype=np.uint8).ctypes.data) if len(data) else 0


async def read_aligned(
    engine: TransferEngine, request: ReadRequest, chunk: int, alignment: ResponseAlignment, *, parallel: int
) -> memoryview:
    """One coalesced read; a large one as parallel sub-range GETs joined into aligned memory.

    A read of up to ``chunk`` bytes plus ``PACKING_SLACK`` (a whole packed
    blob) is a single GET, started a few bytes early when that lands the bytes
    aligned (:class:`ResponseAlignment`). A longer one goes out as :func:`read_parts`,
    joined before any checksum is checked, since a piece's crc32c covers the whole
    piece. Returns the bytes from ``request.start`` on: fewer only if the blob is shorter.
    """
    if request.length <= chunk + PACKING_SLACK:
        pad = alignment.pad(request)
        response = await engine.get_range(request.blob, request.start - pad, request.end)
        alignment.observe(response)
        return memoryview(response)[pad:]
    parts = await read_parts(engine, request.blob, request.start, request.end, chunk, parallel=parallel)
    return await asyncio.to_thread(_join, parts, request.length)


async def read_parts(
    engine: TransferEngine, key: str, start: int, end: int, chunk: int, *, parallel: int
) -> list[memoryview]:
    """Bytes ``[start, end)`` of ``key`` as sub-range GETs of ``chunk`` bytes, at most ``parallel`` at
    once, each started only when there is room (:func:`objckpt.transfer.ordered.run_in_order`). The
    first that comes back short (the object ends there) is the last returned, so a manifest that
    declares more bytes than a blob holds costs only the bytes there are."""

    async def part(at: int) -> memoryview:
        return await engine.get_range(key, at, min(at + chunk, end))

    def short(at: int, data: memoryview) -> bool:
        return len(data) < min(chunk, end - at)

    parts = await run_in_order(range(start, end, chunk), part, parallel=parallel, last=short)
    cut = next((k for k, data in enumerate(parts) if len(data) < chunk), len(parts) - 1)
    return parts[: cut + 1]


def _join(kept: list[memoryview], length: int) -> memoryview:
    """Concatenate sub-range parts (off the loop thread, into aligned memory of the bytes that
    came, not of the length asked for)."""
    filled = min(length, sum(len(part) for part in kept))
    if filled == 0:
        return memoryview(b"")
    joined = aligned_zeros((filled,), np.dtype(np.uint8))
    at = 0
    for part in kept:
        joined[at : at + len(part)] = np.frombuffer(part, dtype=np.uint8)
        at += len(part)
    return joined.data[:filled]
