"""Check and scatter a streamed read into its target boxes while its bytes are in cache.

A restore onto another sharding copies every byte it reads: each saved piece
is cut into the target boxes it overlaps, in runs as short as a row of the
overlap. :class:`ScatterSink` takes the read's body a few MiB at a time
(``Store.get_range_streamed``), each time whole rows of one piece (a *slab*,
itself a box) or several whole small pieces, extends each piece's crc32c over
them and copies them into the boxes they meet. Why: see
:mod:`objckpt.storage.streaming`.

Bytes reach the target buffers before their piece's checksum is complete.
That is safe because a mismatch fails the whole restore (the buffers are
never handed out), and a retried read writes the same bytes again.

A long read goes out as parallel sub-range streams (*spans*) cut between
rows; the parts of a piece that spans share are checksummed apart and
combined (:func:`objckpt.core.checksum.crc32c_combine`) once every span is in.
A piece with a SHA-256 (``Options.digest``) is never cut: a digest has no
combine, so each such piece is hashed in order within one span.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from objckpt.core.boxes import Box
from objckpt.core.checksum import crc32c, crc32c_combine
from objckpt.core.plan import PACKING_SLACK, ReadPart, ReadRequest, intersect
from objckpt.errors import ChecksumMismatchError, IntegrityError
from objckpt.restoring.aligned_reads import address
from objckpt.restoring.landing import Landing
from objckpt.restoring.leaf_plan import LeafPlan
from objckpt.storage.streaming import STREAM_PIECE
from objckpt.transfer.engine import TransferEngine
from objckpt.transfer.ordered import run_in_order

Span = tuple[int, int]  # [first, last) bytes of a read's body

#: Pieces smaller than this are handed over several at a time (:meth:`ScatterSink.next_size`);
#: a larger one alone, as one place it can be read into.
GROUPED_BELOW = 256 << 10
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


async def stream_read(
    engine: TransferEngine, request: ReadRequest, landing: Landing, url: str, chunk: int, *, parallel: int
) -> int:
    """One copied read, streamed into its boxes in ``landing``; how many bytes arrived.

    A read longer than ``chunk`` plus ``PACKING_SLACK`` goes out as spans of
    about ``chunk`` bytes, at most ``parallel`` at once, cut as they are
    started (:func:`iter_spans`): a span that comes back short (the blob is
    shorter than the read) is the last one started. If one fails, the others
    are cancelled and waited for (a stream stops writing once its call
    returns). Fewer bytes only if the blob is shorter; then nothing was checked
    past the shortfall.
    """
    plans = landing.plans
    for part in request.parts:
        if part.piece.length == 0 and part.piece.crc32c != 0:  # in the manifest, not the blob: no re-read cures it
            raise IntegrityError(f"{_mismatch(part, plans, url)} (an empty piece with a non-zero crc32c)")
        if part.piece.length == 0 and part.piece.sha256 not in (None, _EMPTY_SHA256):
            raise IntegrityError(f"{_mismatch(part, plans, url, 'sha256')} (an empty piece with another sha256)")

    async def stream(sink: ScatterSink) -> int:
        first, last = sink.span
        return await engine.get_range_streamed(request.blob, request.start + first, request.start + last, sink)

    if request.length <= chunk + PACKING_SLACK:
        return await stream(ScatterSink(request, landing, url))
    sinks: list[ScatterSink] = []

    def started() -> Iterator[ScatterSink]:
        for span in iter_spans(request, plans, chunk):
            sinks.append(ScatterSink(request, landing, url, span))
            yield sinks[-1]

    def short(sink: ScatterSink, got: int) -> bool:
        return got < sink.span[1] - sink.span[0]

    results = await run_in_order(started(), stream, parallel=parallel, last=short)
    got = 0
    for sink, n in zip(sinks, results):
        got += n
        if short(sink, n):
            return got  # the blob ended inside this span
    _check_shared_parts(request, sinks, plans, url)
    return got


def iter_spans(request: ReadRequest, plans: Mapping[int, LeafPlan], chunk: int) -> Iterator[Span]:
    """Cut a read into spans of about ``chunk`` bytes, each cut between rows of a piece.

    A cut inside a piece is moved back to a multiple of the step along the
    piece's slab axis, so every span starts on a slab of its own; a cut inside
    a piece with a SHA-256 moves to its start (or its end, when the span
    would otherwise be empty), so one span hashes all of it. The spans are
    made as they are asked for, never all at once: the read's length comes from
    the manifest, which may declare far more bytes than the blob holds.
    """
    if request.length <= chunk + PACKING_SLACK:
        yield (0, request.length)
        return
    previous = 0
    for target in range(chunk, request.length, chunk):
        cut = target
        for part in request.parts:
            at = target - part.offset
            if 0 < at < part.piece.length:
                piece = part.piece
                if piece.sha256 is not None:
                    cut = part.offset if part.offset > previous else part.offset + piece.length
                    break
                itemsize = plans[part.leaf].dtype.itemsize
                step = _strides(piece.shape, itemsize)[_slab_axis(piece.shape, itemsize, STREAM_PIECE, 0)]
                cut = part.offset + at // step * step
                break
        if cut > previous:
            yield (previous, cut)
            previous = cut
    if previous < request.length:  # a piece with a digest may have taken the cut to the end
        yield (previous, request.length)


class ScatterSink:
    """Consumes one span of a planned read (a :class:`~objckpt.storage.streaming.ReadSink`).

    Runs on the store's receiving thread and writes through ``landing``
    (:meth:`~objckpt.restoring.landing.Landing.boxes_met`,
    :meth:`~objckpt.restoring.landing.Landing.copy`); counting the pieces
    (placing boxes, finishing leaves) is left to
    :meth:`~objckpt.restoring.landing.Landing.count` once the whole read has arrived. A piece wholly inside the span is checked here;
    the checksums of a piece cut by the span's ends are kept in ``shared``.

    A receive of whole small pieces holds the landing's ``copy_lock`` (shared
    by all the restore's sinks) while it copies them. Why: numpy lets go of the GIL for
    every strided copy of more than 500 elements, so two threads that each
    copy a few KiB at a time hand the GIL back and forth on every copy
    (three times the CPU of one thread: docs/PERFORMANCE.md). Slabs of large pieces copy MiBs at a time and go without it, so their
    copies run in parallel on machines with the cores for it.
    """

    def __init__(self, request: ReadRequest, landing: Landing, url: str, span: Span | None = None) -> None:
        self.request = request
        self.landing = landing
        self.plans = landing.plans
        self.url = url
        self.copy_lock = landing.copy_lock
        self.span = span or (0, request.length)
        first, last = self.span
        self._parts = sorted(
            (p for p in request.parts if p.piece.length and p.offset < last and p.offset + p.piece.length > first),
            key=lambda p: p.offset,
        )
        self.shared: dict[int, tuple[int, int, int]] = {}  # id(part) → (from, length, crc) in the piece
        self.begin()

    def begin(self) -> None:
        self._k = 0  # the part being received (or the next one, in a gap)
        self._crc = 0  # of the current part's bytes in this span so far
        self._hash: Any = None  # its SHA-256 so far, for a piece that has one
        self._planned: tuple[int, int, int] = (-1, 0, 0)  # (position, slab axis, length)
        self._in_place: tuple[int, int, int] | None = None  # (position, address, length) named by destination
        self.shared = {}

    def next_size(self, offset: int, limit: int) -> int:
        first, last = self.span
        position = first + offset
        limit = min(limit, last - position)
        part = self._current(position)
        if part is None or position < part.offset:  # after the last piece, or a gap before one
            return limit if part is None else min(part.offset - position, limit)
        at = position - part.offset
        if at == 0 and part.piece.length <= limit:
            return self._whole_pieces(position, limit)
        itemsize = self.plans[part.leaf].dtype.itemsize
        axis, length = _slab(part.piece.shape, itemsize, at, min(limit, part.piece.length - at))
        self._planned = (position, axis, length)
        return length

    def _whole_pieces(self, position: int, limit: int) -> int:
        """Bytes from ``position`` (where the current part starts) to the end of the last
        part after it that still fits in ``limit``: small pieces are handed over many at a
        time (one receive of 2 MiB instead of ~40 of 48 KiB, each a trip through the socket
        and the GIL). A large piece goes alone, so that a store can read it straight into its
        box (:meth:`destination`)."""
        end = position
        for k, part in enumerate(self._parts[self._k :]):
            part_end = part.offset + part.piece.length
            if part_end - position > limit or (k and part.piece.length >= GROUPED_BELOW):
                break
            end = part_end
            if part.piece.length >= GROUPED_BELOW:
                break
        return end - position

    def destination(self, offset: int, size: int) -> memoryview | None:
        """Where the ``size`` bytes at ``offset`` belong, when that is one contiguous run of one
        box's buffer (:func:`objckpt.storage.streaming.destination_of`); None otherwise.

        So it is for a slab (or a whole piece) lying inside a single box whose rows it spans
        whole, as a piece does on a target sharded like the saved one along its inner
        axes; a store that reads there hands the same view to :meth:`receive`, which
        checks the bytes without copying them.
        """
        position = self.span[0] + offset
        part = self._current(position)
        if part is None or position < part.offset or position + size > part.offset + part.piece.length:
            return None
        piece, plan = part.piece, self.plans[part.leaf]
        at = position - part.offset
        if at == 0 and size == piece.length:
            start, stop = piece.start, piece.stop
        else:
            axis, length = _slab(piece.shape, plan.dtype.itemsize, at, size)
            if length != size:
                return None
            start, stop = _slab_box(piece.start, piece.shape, plan.dtype.itemsize, at, axis, length)
        meets = self.landing.boxes_met(part.leaf, piece)
        slab = (tuple(start), tuple(stop))
        inside = [box for box, _ in meets if intersect(*slab, *box) == slab]
        if len(inside) != 1:
            return None
        place = self.landing.place_of(part.leaf, inside[0], *slab)
        if place is None:
            return None
        view = place.reshape(-1).view(np.uint8).data  # as bytes: a bfloat16 array exports no buffer format
        self._in_place = (position, address(view), size)
        return view

    def receive(self, offset: int, data: memoryview) -> None:
        position = self.span[0] + offset
        if self._in_place == (position, address(data), len(data)):
            self._in_place = None
            self._check_in_place(position, data)
            return
        part = self._current(position)
        if part is not None and part.offset >= position and part.offset + part.piece.length <= position + len(data):
            with self.copy_lock:  # starts with a whole piece: a run of small ones (see the class)
                self._receive(position, data)
        else:
            self._receive(position, data)

    def _check_in_place(self, position: int, data: memoryview) -> None:
        """Bytes a store read straight into their box (:meth:`destination`): check them only."""
        part = self._current(position)
        assert part is not None
        piece = part.piece
        self._crc = crc32c(data, self._crc)
        if piece.sha256 is not None:
            if self._hash is None:
                self._hash = hashlib.sha256()
            self._hash.update(data)
        if position + len(data) == min(part.offset + piece.length, self.span[1]):
            self._end_part(part)

    def _receive(self, base: int, data: memoryview) -> None:
        """``data``, which starts at byte ``base`` of the read's body."""
        position, end = base, base + len(data)
        while position < end:
            part = self._current(position)
            if part is None or part.offset >= end:
                return
            if position < part.offset:  # a gap before the part: bytes of no piece
                position = part.offset
                continue
            piece = part.piece
            if position == part.offset and piece.length <= end - position:
                self._receive_whole(part, data[position - base : position - base + piece.length])
                position += piece.length
                continue
            self._receive_slab(part, position, data[position - base :])
            return

    def _receive_whole(self, part: ReadPart, data: memoryview) -> None:
        """A whole piece in one go: check it and copy it into each box it meets."""
        piece = part.piece
        dtype = self.plans[part.leaf].dtype
        meets = self.landing.boxes_met(part.leaf, piece)
        self._crc = crc32c(data)
        self._hash = hashlib.sha256(data) if piece.sha256 is not None else None
        self.landing.copy(part.leaf, meets, np.frombuffer(data, dtype=dtype).reshape(piece.shape), piece.start)
        self._end_part(part)

    def _receive_slab(self, part: ReadPart, position: int, data: memoryview) -> None:
        """Whole rows of one piece (a slab along some axis), the rest of this receive."""
        piece = part.piece
        plan = self.plans[part.leaf]
        at = position - part.offset
        meets = self.landing.boxes_met(part.leaf, piece)
        self._crc = crc32c(data, self._crc)
        if piece.sha256 is not None:
            if self._hash is None:
                self._hash = hashlib.sha256()
            self._hash.update(data)
        planned_position, axis, length = self._planned
        if planned_position != position or length != len(data):
            axis, length = _slab(piece.shape, plan.dtype.itemsize, at, len(data))
            if length != len(data):
                raise ValueError(f"{len(data)} bytes at byte {at} of a piece of leaf {plan.entry.path} are not a slab")
        start, stop = _slab_box(piece.start, piece.shape, plan.dtype.itemsize, at, axis, length)
        source = np.frombuffer(data, dtype=plan.dtype).reshape(tuple(b - a for a, b in zip(start, stop)))
        overlaps = [(box, overlap) for box, in_piece in meets if (overlap := intersect(start, stop, *in_piece))]
        self.landing.copy(part.leaf, overlaps, source, start)
        if position + len(data) == min(part.offset + piece.length, self.span[1]):
            self._end_part(part)

    def _current(self, position: int) -> ReadPart | None:
        """The part that ``position`` falls in or precedes (None: past the last)."""
        while self._k < len(self._parts):
            part = self._parts[self._k]
            if position < part.offset + part.piece.length:
                return part
            self._k += 1
        return None

    def _end_part(self, part: ReadPart) -> None:
        first, last = self.span
        begins = max(part.offset, first) - part.offset
        ends = min(part.offset + part.piece.length, last) - part.offset
        if begins == 0 and ends == part.piece.length:
            if self._crc != part.piece.crc32c:
                raise _mismatch(part, self.plans, self.url)
            if part.piece.sha256 is not None and (self._hash is None or self._hash.hexdigest() != part.piece.sha256):
                raise _mismatch(part, self.plans, self.url, "sha256")
        else:
            self.shared[id(part)] = (begins, ends - begins, self._crc)
        self._k += 1
        self._crc = 0
        self._hash = None


def _check_shared_parts(
    request: ReadRequest, sinks: list[ScatterSink], plans: Mapping[int, LeafPlan], url: str
) -> None:
    """Combine, in order, the checksums of each piece that several spans received."""
    for part in request.parts:
        runs = sorted(s.shared[id(part)] for s in sinks if id(part) in s.shared)
        if not runs:
            continue
        if part.piece.sha256 is not None:  # iter_spans never cuts such a piece
            raise IntegrityError(f"{_mismatch(part, plans, url, 'sha256')} (cut between spans: cannot be hashed)")
        crc, covered = 0, 0
        for begins, length, run_crc in runs:
            if begins != covered:
                raise _mismatch(part, plans, url)  # cannot happen unless a span lost bytes
            crc = crc32c_combine(crc, run_crc, length)
            covered += length
        if covered != part.piece.length or crc != part.piece.crc32c:
            raise _mismatch(part, plans, url)


def _mismatch(part: ReadPart, plans: Mapping[int, LeafPlan], url: str, what: str = "checksum") -> ChecksumMismatchError:
    piece = part.piece
    return ChecksumMismatchError(
        f"{what} mismatch in leaf {plans[part.leaf].entry.path}: blob {url}/{piece.blob}"
        f" bytes [{piece.offset}, {piece.offset + piece.length})"
    )


def _strides(shape: tuple[int, ...], itemsize: int) -> list[int]:
    """Bytes per step along each axis of a C-ordered box."""
    return [math.prod(shape[d + 1 :]) * itemsize for d in range(len(shape))]


def _slab_axis(shape: tuple[int, ...], itemsize: int, limit: int, at: int) -> int:
    """The outermost axis whose step fits in ``limit`` bytes and divides ``at``."""
    strides = _strides(shape, itemsize)
    return next(d for d, s in enumerate(strides) if s <= limit and at % s == 0)


def _slab(shape: tuple[int, ...], itemsize: int, at: int, limit: int) -> tuple[int, int]:
    """(axis, bytes) of the next slab at byte ``at`` of a piece: whole steps along that
    axis, as many as fit in ``limit`` without passing the end of the axis."""
    if not shape:
        return 0, itemsize
    axis = _slab_axis(shape, itemsize, max(limit, itemsize), at)
    stride = _strides(shape, itemsize)[axis]
    index = at // stride % shape[axis]
    return axis, max(1, min(limit // stride, shape[axis] - index)) * stride


def _slab_box(origin: tuple[int, ...], shape: tuple[int, ...], itemsize: int, at: int, axis: int, length: int) -> Box:
    """The box (global coordinates) of the slab of ``length`` bytes along ``axis`` at byte
    ``at`` of a piece whose first element sits at ``origin``."""
    if not shape:
        return origin, origin
    strides = _strides(shape, itemsize)
    start = [a + at // s % n for a, s, n in zip(origin, strides, shape)]
    stop = [i + 1 for i in start]
    stop[axis] = start[axis] + length // strides[axis]
    for d in range(axis + 1, len(shape)):
        start[d], stop[d] = origin[d], origin[d] + shape[d]
    return tuple(start), tuple(stop)
