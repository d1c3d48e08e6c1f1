"""Coalesced reads planned from pieces held as columns (:mod:`objckpt.core.format.rows`).

The same reads :func:`objckpt.core.plan.plan_reads` plans, by the same rules
(pieces of a blob closer than ``coalesce_gap``, or separated only by bytes that
belong to no piece, join one read up to ``max_read_size``; a read of only kept
pieces may grow to a whole packed blob; each read records the free bytes just
before it), computed with numpy over every wanted row at once. A host that
restores every parameter of a pod-scale checkpoint wants millions of pieces in
tens of thousands of reads: the loop runs once per read, not once per piece,
and each read's parts (:class:`LazyParts`) are built only when the read lands. No I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from objckpt.core.format.rows import Rows
from objckpt.core.plan import ALIGN, PACKING_SLACK, SPACER, ReadPart, ReadRequest

_NEW_PART = functools.partial(tuple.__new__, ReadPart)


class LazyParts(Sequence[ReadPart]):
    """A read's parts: rows ``at`` of ``rows`` (of leaves ``leaves``), at their offsets less
    ``start``; a read-only sequence that builds its :class:`ReadPart` objects when asked."""

    __slots__ = ("rows", "at", "leaves", "start")

    def __init__(self, rows: Rows, at: np.ndarray, leaves: np.ndarray, start: int) -> None:
        self.rows = rows
        self.at = at
        self.leaves = leaves
        self.start = start

    def __len__(self) -> int:
        return len(self.at)

    def _build(self, at: np.ndarray, leaves: np.ndarray) -> list[ReadPart]:
        pieces = self.rows.pieces(at)
        offsets = (self.rows.offset[at] - self.start).tolist()
        return list(map(_NEW_PART, zip(leaves.tolist(), pieces, offsets)))

    def __iter__(self) -> Iterator[ReadPart]:
        return iter(self._build(self.at, self.leaves))

    @overload
    def __getitem__(self, k: int) -> ReadPart: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[ReadPart]: ...
    def __getitem__(self, k: int | slice) -> ReadPart | Sequence[ReadPart]:
        if isinstance(k, slice):
            return self._build(self.at[k], self.leaves[k])
        if not -len(self.at) <= k < len(self.at):
            raise IndexError(k)
        return self._build(self.at[[k]], self.leaves[[k]])[0]

    def __repr__(self) -> str:
        return f"LazyParts({len(self)} parts)"


def plan_row_reads(
    rows: Rows,
    at: np.ndarray,
    leaves: np.ndarray,
    *,
    coalesce_gap: int,
    max_read_size: int,
    kept: np.ndarray | None = None,
    max_kept_read_size: int = 0,
) -> list[ReadRequest]:
    """Coalesce the pieces at rows ``at`` (of leaves ``leaves``, row by row) into ranged reads.

    Every row of ``rows`` is the layout (which bytes belong to a piece); ``kept``: per wanted
    row, whether the reader keeps its bytes as the array itself (see
    :func:`objckpt.core.plan.plan_reads` for each rule).
    """
    if not len(at):
        return []
    kept_limit = max(max_read_size, max_kept_read_size + PACKING_SLACK)
    if kept is None or kept_limit == max_read_size:
        kept = np.zeros(len(at), dtype=bool)
    layout = _layout_order(rows)
    place = np.empty(len(rows), dtype=np.int64)
    place[layout] = np.arange(len(rows), dtype=np.int64)
    where = place[at]
    order = np.argsort(where, kind="stable")
    at, leaves, kept, where = at[order], leaves[order], kept[order], where[order]
    del order, place
    blob = rows.blob[at]
    offset = rows.offset[at]
    end = offset + rows.length[at]
    # Free bytes before each wanted piece: back to the end of the piece before it in its blob.
    before = layout[np.maximum(where - 1, 0)]
    has_before = (where > 0) & (rows.blob[before] == blob)
    slack = offset - np.where(has_before, rows.offset[before] + rows.length[before], 0)
    del before, has_before
    gap = offset[1:] - end[:-1]
    adjacent = where[1:] == where[:-1] + 1  # nothing of the layout between them: the gap is free bytes
    joins = (blob[1:] == blob[:-1]) & ((gap <= coalesce_gap) | ((gap <= SPACER + ALIGN) & adjacent))
    del gap, adjacent, where
    runs = np.flatnonzero(~joins) + 1
    firsts = [0, *runs.tolist()]
    lasts = [*runs.tolist(), len(at)]
    # Per wanted row: the first row at or after it that is not kept (len(at): none).
    unkept = np.flatnonzero(~kept)
    next_unkept: np.ndarray | None = None
    if len(unkept):
        first = np.searchsorted(unkept, np.arange(len(at)))
        next_unkept = np.where(first < len(unkept), unkept[np.minimum(first, len(unkept) - 1)], len(at))
    keys = rows.keys
    requests: list[ReadRequest] = []
    for a, b in zip(firsts, lasts):
        reach = np.maximum.accumulate(end[a:b])  # a read's end so far (pieces never overlap: their ends)
        s = a
        while s < b:
            start = int(offset[s])
            k = b if next_unkept is None else min(int(next_unkept[s]), b)
            if k > s:  # kept pieces first: a whole packed blob at most
                j = s + int(np.searchsorted(reach[s - a : k - a], start + kept_limit, "right"))
                if j < k:
                    j = max(j, s + 1)
                else:  # every kept piece fits: then pieces of any kind up to max_read_size
                    j = k + int(np.searchsorted(reach[k - a :], start + max_read_size, "right"))
            else:
                j = s + 1 + int(np.searchsorted(reach[s + 1 - a :], start + max_read_size, "right"))
            stop = int(reach[j - 1 - a])
            parts = LazyParts(rows, at[s:j], leaves[s:j], start)
            requests.append(ReadRequest(keys[int(blob[s])], start, stop, parts, int(slack[s])))
            s = j
    return requests


def _layout_order(rows: Rows) -> np.ndarray:
    """The rows in (blob, offset) order: one sort of a combined key where both fit it."""
    if not len(rows):
        return np.zeros(0, dtype=np.int64)
    if int(rows.offset.max()) < 1 << 40 and len(rows.keys) < 1 << 22:
        return np.argsort((rows.blob.astype(np.int64) << 40) | rows.offset, kind="stable")
    return np.lexsort((rows.offset, rows.blob))
