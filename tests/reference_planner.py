"""A reference read planner for tests: pieces one by one, as tuples, by the rules
:func:`objckpt.core.plan_rows.plan_row_reads` applies with numpy (which every restore uses).

Written plainly, piece after piece, so that the vectorised planner can be checked against it
on random layouts (tests/test_rows.py).
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Container, Iterable

from objckpt.core.pieces import Piece
from objckpt.core.plan import ALIGN, PACKING_SLACK, SPACER, ReadPart, ReadRequest


def reference_reads(
    wanted: Iterable[tuple[int, Piece]],
    *,
    coalesce_gap: int,
    max_read_size: int,
    layout: Iterable[Piece] = (),
    kept: Callable[[int, Piece], bool] | None = None,
    max_kept_read_size: int = 0,
) -> list[ReadRequest]:
    """Coalesce the wanted pieces into ranged reads, one blob at a time.

    Pieces of a blob closer than ``coalesce_gap`` bytes join one request as long
    as it stays within ``max_read_size`` (a single larger piece gets its own).
    ``layout``, every piece of the checkpoint, tells which bytes belong to no
    piece: a gap of only such bytes (the spacing left for alignment) joins
    pieces too, and each request records its ``slack``. Without it, the slack is 0.
    A request made only of ``kept`` pieces (the reader keeps the response as
    the arrays themselves, so it is not transient memory) may grow to
    ``max_kept_read_size`` plus ``PACKING_SLACK`` (a whole packed blob): fewer,
    larger GETs.
    """
    # Per blob, its pieces' leaves and the pieces, side by side: no pair is kept per piece
    # (a pod-scale restore plans hundreds of thousands; each kept object is more for the
    # garbage collector to walk).
    by_blob: dict[str, tuple[list[int], list[Piece]]] = {}
    for leaf, piece in wanted:
        found = by_blob.get(piece.blob)
        if found is None:
            found = by_blob[piece.blob] = ([], [])
        found[0].append(leaf)
        found[1].append(piece)
    free = _FreeSpace(layout, by_blob)
    kept_limit = max(max_read_size, max_kept_read_size + PACKING_SLACK)
    if kept_limit == max_read_size:
        kept = None  # a kept read may grow no larger than any other: no need to ask
    spaced = SPACER + ALIGN
    requests: list[ReadRequest] = []
    for blob, (leaves, pieces) in by_blob.items():
        offsets = list(map(_OFFSET, pieces))
        order: Iterable[int] = range(len(pieces))
        if any(map(operator.gt, offsets, offsets[1:])):
            order = sorted(order, key=offsets.__getitem__)  # stable, as sorting the pieces by offset
        group: list[int] = []
        start = end = 0
        group_kept = False
        for k in order:
            piece = pieces[k]
            offset = offsets[k]
            p_end = offset + piece.length
            gap = offset - end
            is_kept = kept is not None and kept(leaves[k], piece)
            if (
                group
                and (gap <= coalesce_gap or (gap <= spaced and free.between(blob, end, offset)))
                and (end if end > p_end else p_end) - start <= (kept_limit if group_kept and is_kept else max_read_size)
            ):
                group.append(k)
                if p_end > end:
                    end = p_end
                group_kept = group_kept and is_kept
                continue
            if group:
                parts = tuple([ReadPart(leaves[j], pieces[j], offsets[j] - start) for j in group])
                requests.append(ReadRequest(blob, start, end, parts, free.before(blob, start)))
            group, start, end, group_kept = [k], offset, p_end, is_kept
        if group:
            parts = tuple([ReadPart(leaves[j], pieces[j], offsets[j] - start) for j in group])
            requests.append(ReadRequest(blob, start, end, parts, free.before(blob, start)))
    return requests


_OFFSET = operator.attrgetter("offset")
_PLACE = operator.attrgetter("blob", "offset", "length")


class _FreeSpace:
    """Which bytes of each blob belong to no piece, from the checkpoint's layout.

    Only the blobs in ``blobs`` (those read) are indexed: a host that reads few
    blobs does not sort the pieces of every other.
    """

    def __init__(self, layout: Iterable[Piece], blobs: Container[str]) -> None:
        self._starts: dict[str, list[int]] = {}
        self._ends: dict[str, list[int]] = {}
        starts, ends = self._starts, self._ends
        for blob, offset, length in map(_PLACE, layout):
            if blob in blobs:
                found = starts.get(blob)
                if found is None:
                    found = starts[blob] = []
                    ends[blob] = []
                found.append(offset)
                ends[blob].append(offset + length)
        for blob, firsts in starts.items():
            if any(map(operator.ge, firsts, firsts[1:])):  # index objects list a blob's pieces in order, mostly
                pairs = sorted(zip(firsts, ends[blob]))  # pieces never overlap, so their ends are sorted too
                starts[blob] = [a for a, _ in pairs]
                ends[blob] = [b for _, b in pairs]

    def between(self, blob: str, a: int, b: int) -> bool:
        """True if no piece has a byte in ``[a, b)`` (False when the layout is unknown)."""
        if blob not in self._ends:
            return False
        i = bisect.bisect_right(self._ends[blob], a)  # the first piece ending after a
        return i == len(self._starts[blob]) or self._starts[blob][i] >= b

    def before(self, blob: str, offset: int) -> int:
        """Free bytes just before ``offset``, back to the previous piece (0 when unknown)."""
        if blob not in self._ends:
            return 0
        i = bisect.bisect_right(self._ends[blob], offset)
        return offset - (self._ends[blob][i - 1] if i else 0)
