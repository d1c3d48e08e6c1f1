"""Planned reads → checked bytes in the leaves' host buffers: a restore's data path.

:func:`plan` turns the pieces each leaf's boxes meet into coalesced ranged reads;
:func:`fetch` runs them through a :class:`~objckpt.transfer.engine.TransferEngine`
as a sliding window under the memory budget. Each read either streams into its
boxes as it arrives (:mod:`objckpt.restoring.scatter`) or lands whole and is
scattered (:func:`land`), a piece whose bytes arrive aligned becoming its box's
buffer without a copy. Every piece is checked against its crc32c (and its
SHA-256, when the checkpoint has digests) before it counts; a mismatch is read
again, and with replicas, damage that persists is read at the next location.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from objckpt.core.boxes import box_to_slices
from objckpt.core.checksum import damage
from objckpt.core.format import Manifest, Piece
from objckpt.core.plan import ReadRequest, plan_reads
from objckpt.errors import ChecksumMismatchError, IntegrityError
from objckpt.options import Options
from objckpt.restoring.aligned_reads import ResponseAlignment, address, read_aligned
from objckpt.restoring.jobs import (
    LeafJob,
    allocate,
    complete,
    fault_in_fresh,
    finish,
    meets_of,
    plan_pieces,
    stays_on_host,
    wait_for_arena,
    whole_box,
)
from objckpt.restoring.locations import failover_of
from objckpt.restoring.scatter import stream_read
from objckpt.transfer.buffers import DEVICE_ALIGNMENT
from objckpt.transfer.engine import AsyncByteBudget, TransferEngine, TransferStats, reread_on_mismatch


def plan(manifest: Manifest, jobs: dict[int, LeafJob], options: Options, *, streamed: bool) -> list[ReadRequest]:
    """The coalesced reads for ``jobs``; ``streamed``: the store streams copied reads."""
    wanted: list[tuple[int, Piece]] = []
    for i, job in jobs.items():
        wanted.extend((i, p) for p in plan_pieces(job))
    layout = (piece for leaf in manifest.leaves for piece in leaf.pieces)
    return plan_reads(
        wanted,
        coalesce_gap=options.coalesce_gap,
        max_read_size=options.copied_read_limit(streamed=streamed),
        layout=layout,
        kept=lambda leaf, piece: whole_box(piece, jobs[leaf]),
        max_kept_read_size=options.read_chunk,
    )


async def fetch(
    store: Any, requests: list[ReadRequest], jobs: dict[int, LeafJob], options: Options, stats: TransferStats
) -> None:
    engine = TransferEngine.from_options(store, options, stats)
    for job in jobs.values():
        if job.remaining == 0:
            allocate(job)
            await asyncio.to_thread(finish, job)

    # Reads start early to land aligned only where an aligned piece can become a device
    # array without a copy: leaves placed on the CPU backend (restoring.jobs.stays_on_host).
    on_cpu = any(job.places_boxes and stays_on_host(job) for job in jobs.values())
    alignment = ResponseAlignment.of(store) if on_cpu else ResponseAlignment(None)
    lock = threading.Lock()
    copy_lock = threading.Lock()  # runs of small copies take turns (restoring.scatter.ScatterSink says why)
    # A read that will become its boxes' arrays is not memory above the restored
    # arrays (when the client fills its buffer in place), so only reads that are
    # copied count against the window; max_concurrency still bounds the requests
    # in flight. On a store that streams, copied reads are scattered as they
    # arrive (objckpt.restoring.scatter) and hold a few MiB each, not their length:
    # a window of their own bounds them (Options.streamed_window: enough bytes to
    # cover each read's wait for its first byte, few enough threads scattering at
    # once to keep them from contending for the GIL).
    in_place = store.reads_in_place
    streamed = store.streams_reads
    copied = {id(r) for r in requests if not (in_place and _may_adopt(r, jobs))}
    buffered = copied if not streamed else set()  # the reads that hold a buffer of their length
    window = min(options.read_window, options.memory_budget)
    streaming = AsyncByteBudget(options.streamed_window)

    def check_length(request: ReadRequest, got: int) -> None:
        if got != request.length:
            paths = sorted({jobs[p.leaf].entry.path for p in request.parts})
            raise IntegrityError(
                f"blob {store.url}/{request.blob} is truncated: asked bytes [{request.start}, {request.end}),"
                f" got {got} (leaves {', '.join(paths)})"
            )

    parallel = options.max_concurrency  # sub-range GETs of one long read at once

    async def read_streamed(request: ReadRequest) -> None:
        got = await stream_read(
            engine, request, jobs, store.url, lock, options.read_chunk, copy_lock, parallel=parallel
        )
        check_length(request, got)

    async def read_and_land(request: ReadRequest) -> None:
        data = await read_aligned(engine, request, options.read_chunk, alignment, parallel=parallel)
        check_length(request, len(data))
        await asyncio.to_thread(_land, request, data, jobs, store.url, lock)

    failover = failover_of(store)

    async def checked(read: Callable[[], Awaitable[None]]) -> None:
        # A checksum mismatch reads the request again (bits flipped in flight); both
        # ways of landing it rewrite the same bytes and count it done only once checked.
        # Damage that persists is at rest: with replicas, the next location reads it.
        async def here() -> None:
            await reread_on_mismatch(read, reads=options.retry.checksum_reads, stats=engine.stats)

        await (here() if failover is None else failover.elsewhere_if_damaged(here))

    async def one(request: ReadRequest) -> None:
        if streamed and id(request) in copied:
            held = await streaming.acquire(request.length)
            try:
                await checked(lambda: read_streamed(request))
            finally:
                await streaming.release(held)
            await asyncio.to_thread(complete, request, jobs, lock)
            return
        await checked(lambda: read_and_land(request))

    await engine.for_each(requests, one, window_bytes=window, size=lambda r: r.length if id(r) in buffered else 0)


def _may_adopt(request: ReadRequest, jobs: dict[int, LeafJob]) -> bool:
    """Whether every part of a planned read can be adopted if its bytes land aligned."""
    return request.length >= ResponseAlignment.LARGE and all(
        whole_box(part.piece, jobs[part.leaf]) for part in request.parts
    )


def _adoptable(request: ReadRequest, data: memoryview, jobs: dict[int, LeafJob]) -> set[int]:
    """The parts (by index) whose response bytes can become their box's host array as is.

    That takes a piece that is exactly one box of a leaf placed box by box (a
    read-only view is fine there: it goes straight to its devices), no cast, and
    bytes on the alignment boundary.
    """
    base = address(data)
    return {
        k
        for k, part in enumerate(request.parts)
        if (base + part.offset) % DEVICE_ALIGNMENT == 0
        and whole_box(part.piece, jobs[part.leaf])
        and (part.piece.start, part.piece.stop) not in jobs[part.leaf].buffers
    }


def _land(request: ReadRequest, data: memoryview, jobs: dict[int, LeafJob], url: str, lock: threading.Lock) -> None:
    """All one response does, in one trip off the loop thread (a trip costs more than placing a box).

    Allocate the boxes it copies into, check and scatter its pieces (or adopt
    them, see :func:`_adoptable`), then :func:`~objckpt.restoring.jobs.complete`
    them. The counters are shared with other responses' threads, hence ``lock``.
    """
    fresh: list[np.ndarray] = []
    for part in request.parts:
        wait_for_arena(jobs[part.leaf])
    with lock:
        adopted = _adoptable(request, data, jobs)
        for k, part in enumerate(request.parts):
            if k not in adopted:
                job = jobs[part.leaf]
                fresh += allocate(job, [box for box, _ in meets_of(job, part.piece)], for_pieces=True)
    fault_in_fresh(fresh)
    _scatter(request, data, jobs, url, adopted)
    complete(request, jobs, lock)


def _scatter(
    request: ReadRequest,
    data: memoryview,
    jobs: dict[int, LeafJob],
    url: str,
    adopted: set[int],
) -> None:
    """Check each piece of one response and copy it into the boxes that need it.

    An adopted part (see :func:`_adoptable`) becomes its box's buffer instead
    of being copied. Pieces never overlap, so threads scattering different
    responses into the same leaf write disjoint regions. On a mismatch the
    parts adopted so far are let go again, so the read can be landed anew.
    """
    for k, part in enumerate(request.parts):
        piece = part.piece
        job = jobs[part.leaf]
        raw = data[part.offset : part.offset + piece.length]
        wrong = damage(raw, piece.crc32c, piece.sha256)
        if wrong is not None:
            for j in adopted:
                if j < k:
                    taken = request.parts[j]
                    jobs[taken.leaf].buffers.pop((taken.piece.start, taken.piece.stop), None)
            raise ChecksumMismatchError(
                f"{wrong} mismatch in leaf {job.entry.path}: blob {url}/{piece.blob}"
                f" bytes [{piece.offset}, {piece.offset + piece.length})"
            )
        source = np.frombuffer(raw, dtype=job.dtype).reshape(piece.shape)
        if k in adopted:
            job.buffers[(piece.start, piece.stop)] = source
            continue
        for box, overlap in meets_of(job, piece):
            buffer = job.buffers[box]
            buffer[box_to_slices(*overlap, origin=box[0])] = source[box_to_slices(*overlap, origin=piece.start)]
