"""Pure planning: which bytes go where. No I/O, no JAX, no defaults.

Save: owned pieces of leaves → blobs of about ``blob_size`` bytes (small pieces
packed together, large ones split along their leading axes so every piece stays
a C-ordered box). Restore: the boxes a host needs → the saved pieces that
intersect them (:class:`BoxIndex`); the coalesced ranged reads per blob are
planned from the pieces' rows (:mod:`objckpt.core.plan_rows`).

Tuning values are required keyword arguments; :mod:`objckpt.options` owns the
defaults. Keeping this pure lets it be tested exhaustively and benchmarked at
pod scale with no data.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import operator
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from objckpt.core.format import Piece

Index = tuple[int, ...]
ALIGN = 64  # piece offsets inside a blob are aligned for fast copies
# Every blob starts with SPACER bytes that belong to no piece, and so does the
# gap before a piece of at least SPACED_MIN bytes, so a reader may start its
# ranged read a little early and have the piece land aligned in the response
# buffer (see aligned_reads.ResponseAlignment).
SPACER = ALIGN
SPACED_MIN = 1 << 20
# A blob may run this many bytes past ``blob_size`` to hold its spacers and
# alignment: four 8 MiB boxes then fill one 32 MiB blob (32 MiB + 320 bytes)
# instead of three per blob and a quarter more objects. Readers allow the same
# slack on their read limits, so a whole blob is still one GET.
PACKING_SLACK = 4096


@dataclass(frozen=True)
class OwnedPiece:
    """A box of one leaf that this process will write.

    ``source`` is opaque to the planner: whatever the snapshot needs to find the
    bytes (a device shard and its global offset, a numpy array, ...).
    """

    leaf: int
    start: Index
    stop: Index
    itemsize: int
    source: Any = None
    device: int = -1  # the device whose shard it comes from (-1: host data); saves pack a device's pieces together
    shared: bool = False  # part of a box every replica needs (a replicated cell): saves pack these first
    sha256: str | None = None  # its bytes' SHA-256 when an incremental save has hashed them already

    @property
    def shape(self) -> Index:
        return tuple(map(operator.sub, self.stop, self.start))

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of the box (cached: packing asks for it once per open blob it tries)."""
        return math.prod(map(operator.sub, self.stop, self.start)) * self.itemsize


def packing_order(piece: OwnedPiece) -> tuple[bool, int]:
    """The order a save packs its pieces in: pieces of replicated boxes (norms, biases: every
    host reads them) together first, then each device's pieces, leaf after leaf, so a restore
    onto the same mesh, or any mesh whose boxes gather whole saved shards, reads long runs."""
    return not piece.shared, piece.device


@dataclass(frozen=True)
class PlacedPiece:
    piece: OwnedPiece
    offset: int


@dataclass(frozen=True)
class BlobPlan:
    key: str
    pieces: tuple[PlacedPiece, ...]
    size: int


def split_box(start: Index, stop: Index, itemsize: int, *, max_bytes: int) -> list[tuple[Index, Index]]:
    """Split a box into C-contiguous sub-boxes of at most ``max_bytes`` each.

    Cuts along axis 0 in runs of whole rows; when a single row is too big it
    recurses into the next axis, so every sub-box stays a contiguous byte run
    of the original C-ordered box.
    """
    shape = tuple(b - a for a, b in zip(start, stop))
    if math.prod(shape) * itemsize <= max_bytes or not shape:
        return [(start, stop)]
    out: list[tuple[Index, Index]] = []
    row_bytes = math.prod(shape[1:]) * itemsize
    if row_bytes <= max_bytes:
        step = max(1, max_bytes // row_bytes)
        for a in range(start[0], stop[0], step):
            b = min(a + step, stop[0])
            out.append(((a, *start[1:]), (b, *stop[1:])))
        return out
    for a in range(start[0], stop[0]):
        for sub_start, sub_stop in split_box(start[1:], stop[1:], itemsize, max_bytes=max_bytes):
            out.append(((a, *sub_start), (a + 1, *sub_stop)))
    return out


def blob_key(save_id: str, process_index: int, seq: int) -> str:
    """A blob's key: a hashed 2-hex-digit prefix spreads load over store partitions."""
    name = f"{save_id}-p{process_index}-{seq:06d}.blob"
    return f"{zlib.crc32(name.encode()) & 0xFF:02x}/{name}"


# Blobs that still take pieces while a save is planned: a piece goes into the
# first of them with room, so the room a large piece leaves is filled by the
# small ones after it (next-fit left it empty: the medium model's 18.6 MiB
# embedding shards made 42 blobs of 1 GiB, now 33: a fifth fewer PUTs and GETs,
# each a request a cloud store bills and rate-limits). Bounded so that
# planning stays linear, and so that a leaf's pieces stay near each other
# (a partial restore reads fewer, longer ranges).
OPEN_BLOBS = 16


class _OpenBlob:
    """A blob being filled: its pieces, the end of the last one, and its bytes of pieces."""

    def __init__(self) -> None:
        self.pieces: list[PlacedPiece] = []
        self.size = SPACER
        self.payload = 0

    def offset_for(self, part: OwnedPiece, blob_size: int) -> int | None:
        """Where ``part`` would go in this blob, or None when it does not fit."""
        spacer = SPACER if part.nbytes >= SPACED_MIN else 0
        offset = -(-self.size // ALIGN) * ALIGN + spacer
        if self.pieces and (self.payload + part.nbytes > blob_size or offset + part.nbytes > blob_size + PACKING_SLACK):
            return None
        return offset

    def add(self, part: OwnedPiece, offset: int) -> None:
        self.pieces.append(PlacedPiece(part, offset))
        self.size = offset + part.nbytes
        self.payload += part.nbytes


def plan_blobs(pieces: Iterable[OwnedPiece], *, blob_size: int, key: Callable[[int], str]) -> list[BlobPlan]:
    """Pack pieces into blobs of about ``blob_size`` bytes, each into the first of the
    last ``OPEN_BLOBS`` blobs with room for it (a new blob when none has).

    A piece larger than ``blob_size`` is split first; small pieces share a blob.
    A blob holds at most ``blob_size`` bytes of pieces; its spacing may take it
    past ``blob_size`` by at most ``PACKING_SLACK`` bytes. Within a blob, pieces
    lie in the order they came. ``key(seq)`` names the ``seq``-th blob opened.
    """
    blobs: list[_OpenBlob] = []
    open_blobs: list[_OpenBlob] = []
    for piece in pieces:
        for start, stop in split_box(piece.start, piece.stop, piece.itemsize, max_bytes=blob_size):
            part = OwnedPiece(piece.leaf, start, stop, piece.itemsize, piece.source, piece.device, piece.shared)
            for blob in open_blobs:
                offset = blob.offset_for(part, blob_size)
                if offset is not None:
                    break
            else:
                blob = _OpenBlob()
                blobs.append(blob)
                open_blobs.append(blob)
                if len(open_blobs) > OPEN_BLOBS:
                    open_blobs.pop(0)
                offset = blob.offset_for(part, blob_size)
                assert offset is not None  # an empty blob takes any piece
            blob.add(part, offset)
    return [BlobPlan(key(seq), tuple(blob.pieces), blob.size) for seq, blob in enumerate(blobs)]


def intersect(a_start: Index, a_stop: Index, b_start: Index, b_stop: Index) -> tuple[Index, Index] | None:
    """The intersection of two boxes, or None when they do not meet.

    A plain loop that stops at the first axis with no overlap: restore calls
    this for every slab it scatters, and generator expressions made it 7.6 µs a call.
    """
    start = []
    stop = []
    for x0, x1, y0, y1 in zip(a_start, a_stop, b_start, b_stop):
        lo = x0 if x0 > y0 else y0
        hi = x1 if x1 < y1 else y1
        if lo >= hi:
            return None
        start.append(lo)
        stop.append(hi)
    return tuple(start), tuple(stop)


class BoxIndex:
    """The boxes of one leaf, indexed to find those a given box meets without testing every one.

    Why: restore meets every saved piece of a leaf with the boxes the target
    sharding gives this process; a small model has over a thousand of each, so
    testing every pair is quadratic. A sharding's boxes form a grid
    (each axis cut into disjoint intervals, every combination present), so a
    bisect per axis finds the intervals a box spans and only those boxes are
    looked at. Boxes that are not a grid (a read-once subset, say) are tested
    one by one. Its memo of answers (:meth:`meeting`) grows with the distinct
    pieces asked about and lives as long as the index: restore keeps its indexes
    in a cache it empties when it ends (:mod:`objckpt.restoring.leaf_plan`).
    """

    def __init__(self, boxes: Iterable[tuple[Index, Index]]) -> None:
        self.boxes = list(dict.fromkeys(boxes))
        self._axes = _grid_axes(self.boxes)
        self._met: dict[tuple[Index, Index], list[tuple[tuple[Index, Index], tuple[Index, Index]]]] = {}

    @functools.cached_property
    def grid(self) -> tuple[list[tuple[list[int], list[int]]], list[tuple[Index, Index]]] | None:
        """Per axis the sorted starts and stops of its intervals, and the boxes in grid order (the
        last axis fastest: sorted by start), when the boxes form a grid; else None."""
        return None if self._axes is None else (self._axes, sorted(self.boxes))

    def meeting(self, start: Index, stop: Index) -> list[tuple[tuple[Index, Index], tuple[Index, Index]]]:
        """(box, box ∩ [start, stop)) for each box that meets ``[start, stop)``, in grid order.

        Memoized per ``(start, stop)``: the leaves of a layer stack share their boxes
        and their pieces' geometry, so one index answers the same question once per
        piece shape and place, not once per leaf. The list returned is shared: read it only.
        """
        key = (start, stop)
        found = self._met.get(key)
        if found is None:
            found = self._met[key] = self._meeting(start, stop)
        return found

    def _meeting(self, start: Index, stop: Index) -> list[tuple[tuple[Index, Index], tuple[Index, Index]]]:
        if self._axes is None:
            return [(box, overlap) for box in self.boxes if (overlap := intersect(start, stop, *box)) is not None]
        combos: list[tuple[tuple[Index, Index], tuple[Index, Index]]] = [(((), ()), ((), ()))]
        for (starts, stops), a, b in zip(self._axes, start, stop):
            first = bisect.bisect_right(stops, a)  # the first interval that ends past a
            last = bisect.bisect_left(starts, b)  # intervals that start before b
            if first >= last:
                return []
            along = [((starts[k], stops[k]), (max(a, starts[k]), min(b, stops[k]))) for k in range(first, last)]
            combos = [
                ((box_start + (s,), box_stop + (e,)), (lo + (o0,), hi + (o1,)))
                for (box_start, box_stop), (lo, hi) in combos
                for (s, e), (o0, o1) in along
            ]
        return combos


def _grid_axes(boxes: list[tuple[Index, Index]]) -> list[tuple[list[int], list[int]]] | None:
    """Per axis, the sorted starts and stops of its intervals, when ``boxes`` (distinct)
    are exactly every combination of disjoint intervals along each axis; else None."""
    if not boxes:
        return None
    axes = []
    count = 1
    for d in range(len(boxes[0][0])):
        intervals = sorted({(start[d], stop[d]) for start, stop in boxes})
        if any(e > s for (_, e), (s, _) in zip(intervals, intervals[1:])):
            return None  # intervals along this axis overlap
        axes.append(([s for s, _ in intervals], [e for _, e in intervals]))
        count *= len(intervals)
    return axes if count == len(boxes) else None


class ReadPart(NamedTuple):
    """One piece inside a ranged read, at ``offset`` bytes into the response.

    A named tuple, like :class:`~objckpt.core.pieces.Piece`: a pod-scale restore
    plans one per piece it reads (hundreds of thousands for an inference host),
    and a tuple is several times cheaper to build than a frozen dataclass.
    """

    leaf: int
    piece: Piece
    offset: int


@dataclass(frozen=True)
class ReadRequest:
    blob: str
    start: int
    end: int
    parts: Sequence[ReadPart]  # a tuple, or parts built when asked (plan_rows.LazyParts)
    slack: int = 0  # bytes just before ``start`` that belong to no piece: free to read too

    @property
    def length(self) -> int:
        return self.end - self.start

    def built(self) -> ReadRequest:
        """This read with its parts as a tuple, built once: the read's parts are told apart by
        identity while it lands (a lazily built part is a new object each time it is asked for)."""
        return self if isinstance(self.parts, tuple) else dataclasses.replace(self, parts=tuple(self.parts))
