"""Pieces: the boxes of a leaf stored in blobs, read strictly, and checked to tile their leaf.

Shared by every reader of pieces: the version 1 manifest (which lists them all),
version 2 index objects (each process's), ``verify`` (the whole tiling) and
restore (the coverage of each box it fills). No I/O.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, NamedTuple

from objckpt.core.strict import fields, is_int, need
from objckpt.errors import FormatError


class Piece(NamedTuple):
    """A box ``[start, stop)`` of one leaf, stored C-ordered at ``blob[offset:offset+length]``.

    A named tuple, not a dataclass: a restore at pod scale makes tens of thousands
    of them from index objects, and a tuple is several times cheaper to build.
    """

    start: tuple[int, ...]
    stop: tuple[int, ...]
    blob: str
    offset: int
    length: int
    crc32c: int
    sha256: str | None = None  # hex SHA-256 of the bytes, in checkpoints saved with Options.digest

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))


_PIECE_KEYS = frozenset({"start", "stop", "blob", "offset", "length", "crc32c"})


def fast_piece(raw: Any, shape: list[int], itemsize: int, blobs: dict[str, int]) -> Piece | None:
    """The piece if it passes every check of :func:`piece_from_json`, else None (which
    then names what is wrong).

    Why twice: building each check's message and field name up front costs more
    than the checks themselves, once per piece; this tests the same conditions
    and formats nothing. ``type(x) is int`` excludes booleans, as
    :func:`~objckpt.core.strict.is_int` does.
    """
    if type(raw) is not dict or raw.keys() != _PIECE_KEYS:
        return None
    start, stop, blob, offset, length, crc = (
        raw["start"],
        raw["stop"],
        raw["blob"],
        raw["offset"],
        raw["length"],
        raw["crc32c"],
    )
    if type(start) is not list or type(stop) is not list or len(start) != len(shape) or len(stop) != len(shape):
        return None
    expected = itemsize
    for a, b, n in zip(start, stop, shape):
        if type(a) is not int or type(b) is not int or not 0 <= a < b <= n:
            return None
        expected *= b - a
    size = blobs.get(blob) if type(blob) is str else None
    if (
        size is None
        or type(offset) is not int
        or type(length) is not int
        or type(crc) is not int
        or offset < 0
        or length != expected
        or offset + length > size
        or not 0 <= crc < 2**32
    ):
        return None
    return Piece(tuple(start), tuple(stop), blob, offset, length, crc)


def piece_from_json(raw: Any, where: str, shape: list[int], itemsize: int, blobs: dict[str, int]) -> Piece:
    """The piece ``raw`` of a leaf of ``shape``, checked field by field; FormatError naming ``where``."""
    fields(raw, where, {"start", "stop", "blob", "offset", "length", "crc32c"})
    start, stop = raw["start"], raw["stop"]
    for name, box in (("start", start), ("stop", stop)):
        need(
            isinstance(box, list) and len(box) == len(shape) and all(is_int(v) for v in box),
            f"{where}.{name}",
            f"must be {len(shape)} integers",
        )
    for d, (a, b, n) in enumerate(zip(start, stop, shape)):
        need(0 <= a < b <= n, f"{where}", f"box [{a}, {b}) outside dimension {d} of size {n}")
    blob = raw["blob"]
    need(isinstance(blob, str) and blob in blobs, f"{where}.blob", f"names no blob in 'blobs': {blob!r}")
    offset, length = raw["offset"], raw["length"]
    need(is_int(offset) and offset >= 0, f"{where}.offset", "must be a non-negative integer")
    expected = math.prod(b - a for a, b in zip(start, stop)) * itemsize
    need(is_int(length) and length == expected, f"{where}.length", f"must be {expected} (dtype × box)")
    need(offset + length <= blobs[blob], f"{where}", f"bytes [{offset}, {offset + length}) exceed blob {blob!r}")
    need(is_int(raw["crc32c"]) and 0 <= raw["crc32c"] < 2**32, f"{where}.crc32c", "must be a 32-bit integer")
    return Piece(tuple(start), tuple(stop), blob, offset, length, raw["crc32c"])


def check_tiling(
    pieces: tuple[Piece, ...] | list[Piece], shape: tuple[int, ...], where: str, doc: str = "manifest"
) -> None:
    """Pieces must cover ``[0, shape)`` exactly: volumes add up and no two overlap.

    Near-linear for the tilings saves make: a grid (every combination of disjoint
    intervals along each axis) is recognised in O(n log n); anything else is swept
    along the axis with the most distinct starts, comparing each piece only with
    the pieces still open there (a grid's cross-section, not all of them).
    """
    total = math.prod(shape)
    covered = sum(math.prod(p.shape) for p in pieces)
    if total == 0:
        need(not pieces, where, "an empty leaf has no pieces", doc)
        return
    need(covered == total, where, f"pieces cover {covered} elements of {total} (holes or overlaps)", doc)
    overlap = find_overlap(pieces)
    if overlap is not None:
        p, q = overlap
        raise FormatError(f"{doc} field {where}: boxes {p.start}-{p.stop} and {q.start}-{q.stop} overlap")


def find_overlap(boxes: tuple[Any, ...] | list[Any]) -> tuple[Any, Any] | None:
    """Two of ``boxes`` (anything with ``start`` and ``stop``) that overlap, or None."""
    if len(boxes) < 2:
        return None
    rank = len(boxes[0].start)
    if rank == 0:
        return boxes[0], boxes[1]  # two scalars are the same single point
    if _is_grid(boxes, rank):
        return None
    axis = max(range(rank), key=lambda d: len({b.start[d] for b in boxes}))
    order = sorted(boxes, key=lambda b: b.start[axis])
    open_: list[tuple[int, int, Any]] = []  # (stop along axis, tie-break, box), a heap
    for n, q in enumerate(order):
        while open_ and open_[0][0] <= q.start[axis]:
            heapq.heappop(open_)
        for _, _, p in open_:
            if all(qa < pb and pa < qb for pa, pb, qa, qb in zip(p.start, p.stop, q.start, q.stop)):
                return p, q
        heapq.heappush(open_, (q.stop[axis], n, q))
    return None


def _is_grid(boxes: tuple[Any, ...] | list[Any], rank: int) -> bool:
    """Whether the boxes are distinct and exactly every combination of disjoint intervals per axis."""
    count = 1
    for d in range(rank):
        intervals = sorted({(b.start[d], b.stop[d]) for b in boxes})
        if any(e > s for (_, e), (s, _) in zip(intervals, intervals[1:])):
            return False
        count *= len(intervals)
    return count == len(boxes) and len({(b.start, b.stop) for b in boxes}) == len(boxes)
