"""The coalesced ranged reads of a restore, planned from pieces held as columns (:mod:`objckpt.core.format.rows`).

The rules: pieces of a blob closer than ``coalesce_gap``, or separated only by bytes
that belong to no piece (the spacing left for alignment), join one read up to
``max_read_size`` (a single larger piece gets its own); a read of only kept pieces
(the reader keeps the response as the arrays themselves, so it is not transient
memory) may grow to ``max_kept_read_size`` plus ``PACKING_SLACK`` (a whole packed
blob); each read records the free bytes just before it (its ``slack``). Every
version's pieces are rows by the time a restore plans (:meth:`Manifest.in_columns`),
so this is the one read planner. It works with numpy over every wanted row at once:
a host that restores every parameter of a pod-scale checkpoint wants millions of
pieces in tens of thousands of reads; the loop runs once per read, not once per
piece, and each read's parts (:class:`LazyParts`) are built only when the read
lands. No I/O. (tests/reference_planner.py plans the same reads piece by piece:
the check these are right.)
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from objckpt.core.format.rows import Rows
from objckpt.core.plan import ALIGN, PACKING_SLACK, SPACER, ReadPart, ReadRequest

_NEW_PART = functools.partial(tuple.__new__, ReadPart)


class LazyParts(Sequence[ReadPart]):
    """A read's parts: rows ``at`` of ``rows``, at their offsets less ``start``; a read-only
    sequence that builds its :class:`ReadPart` objects when asked."""

    __slots__ = ("rows", "at", "start")

    def __init__(self, rows: Rows, at: np.ndarray, start: int) -> None:
        self.rows = rows
        self.at = at
        self.start = start

    def __len__(self) -> int:
        return len(self.at)

    def _build(self, at: np.ndarray) -> list[ReadPart]:
        pieces = self.rows.pieces(at)
        offsets = (self.rows.offset[at] - self.start).tolist()
        return list(map(_NEW_PART, zip(self.rows.leaf_of(at).tolist(), pieces, offsets)))

    def __iter__(self) -> Iterator[ReadPart]:
        return iter(self._build(self.at))

    @overload
    def __getitem__(self, k: int) -> ReadPart: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[ReadPart]: ...
    def __getitem__(self, k: int | slice) -> ReadPart | Sequence[ReadPart]:
        if isinstance(k, slice):
            return self._build(self.at[k])
        if not -len(self.at) <= k < len(self.at):
            raise IndexError(k)
        return self._build(self.at[[k]])[0]

    def __repr__(self) -> str:
        return f"LazyParts({len(self)} parts)"


#: Wanted rows planned at once: what bounds the planner's temporary arrays (a few bytes a row each).
CHUNK_ROWS = 1 << 18


def plan_row_reads(
    rows: Rows,
    wanted: np.ndarray,
    *,
    coalesce_gap: int,
    max_read_size: int,
    kept: np.ndarray | None = None,
    max_kept_read_size: int = 0,
) -> list[ReadRequest]:
    """Coalesce the pieces of the rows ``wanted`` (a mask over ``rows``) into ranged reads.

    Every row of ``rows`` says which bytes of a blob belong to a piece; ``kept`` (a mask over
    ``rows``): the wanted rows whose bytes the reader keeps as the array itself (the module
    says each rule). The wanted rows are put in read order once (blob by blob, each by offset,
    the blobs leaf after leaf: :func:`_read_order`), then planned a chunk of whole blobs at a time.
    """
    if not wanted.any():
        return []
    kept_limit = max(max_read_size, max_kept_read_size + PACKING_SLACK)
    keep = kept if kept is not None and kept_limit > max_read_size else np.zeros(len(rows), dtype=bool)
    order = _read_order(rows)
    place = np.flatnonzero(wanted[order])  # where each wanted row sits in the read order
    if len(place) < 1 << 31:
        place = place.astype(np.int32)
    blobs = rows.blob[order[place]]
    requests: list[ReadRequest] = []
    lo = 0
    while lo < len(place):
        hi = min(lo + CHUNK_ROWS, len(place))
        if hi < len(place):  # end the chunk at a blob's end (a blob's rows are together in the read order)
            past = np.flatnonzero(blobs[hi:] != blobs[hi - 1])
            hi += int(past[0]) if len(past) else len(place) - hi
        _plan_chunk(rows, order, place[lo:hi], keep, coalesce_gap, max_read_size, kept_limit, requests)
        lo = hi
    return requests


def _plan_chunk(
    rows: Rows,
    order: np.ndarray,
    place: np.ndarray,
    keep: np.ndarray,
    coalesce_gap: int,
    max_read_size: int,
    kept_limit: int,
    requests: list[ReadRequest],
) -> None:
    """The reads of wanted rows at read-order positions ``place`` (whole blobs), appended to ``requests``."""
    at = order[place]
    blob = rows.blob[at]
    offset = rows.offset[at]
    end = offset + rows.length(at)
    gap = offset[1:] - end[:-1]
    adjacent = place[1:] == place[:-1] + 1  # no row between them: the gap is free bytes
    joins = (blob[1:] == blob[:-1]) & ((gap <= coalesce_gap) | ((gap <= SPACER + ALIGN) & adjacent))
    kept = keep[at]
    n = len(at)
    runs = np.flatnonzero(~joins) + 1
    run_end = np.append(runs, n)[np.searchsorted(runs, np.arange(n), "right")]
    jump = _jumps(blob, offset, end, kept, run_end, max_read_size, kept_limit)
    if jump is None:
        _plan_runs(rows, order, place, at, blob, offset, end, kept, runs, max_read_size, kept_limit, requests)
        return
    firsts = []  # the rows that start a read: one step per read, from Python (not a list of every row's jump)
    step = jump.item
    s = 0
    while s < n:
        firsts.append(s)
        s = step(s)
    first = np.array(firsts, dtype=np.int64)
    last = jump[first]
    slack = _slacks(rows, order, place[first], blob[first], offset[first])
    keys = rows.keys
    requests.extend(
        ReadRequest(keys[b], start, stop, LazyParts(rows, at[a:j], start), free)
        for a, j, b, start, stop, free in zip(
            firsts, last.tolist(), blob[first].tolist(), offset[first].tolist(), end[last - 1].tolist(), slack.tolist()
        )
    )


def _jumps(
    blob: np.ndarray,
    offset: np.ndarray,
    end: np.ndarray,
    kept: np.ndarray,
    run_end: np.ndarray,
    max_read_size: int,
    kept_limit: int,
) -> np.ndarray | None:
    """For every wanted row, where a read that starts at it ends (the first row it leaves out),
    by the module's rules, in a few numpy passes: None where the
    shortcut does not hold (pieces that overlap in a blob, or ends too large to combine), and
    :func:`_plan_runs` plans the chunk read by read.

    Reads are then walked from row 0, one step per read. Within a run of rows that may join,
    ends rise (pieces never overlap), so a read's end is its last piece's end and each limit
    is one binary search over (blob, end) combined into one sorted key.
    """
    n = len(end)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if int(end.max()) >= 1 << 40 or n >= 1 << 22:
        return None
    rank = np.concatenate(([0], np.cumsum(blob[1:] != blob[:-1])))  # blobs numbered in the chunk
    key = (rank << 41) | end
    if (key[1:] < key[:-1]).any():  # pieces that overlap: ends do not rise within a blob
        return None
    index = np.arange(n)

    def first_past(limit: int) -> np.ndarray:  # per row s: the first row whose end passes offset[s] + limit
        reach = np.minimum(offset + limit, (1 << 41) - 1)
        return np.searchsorted(key, (rank << 41) | reach, "right")

    by_size = np.minimum(np.maximum(first_past(max_read_size), index + 1), run_end)
    if kept_limit == max_read_size or not kept.any():
        return by_size
    unkept = np.flatnonzero(~kept)
    next_unkept = np.full(n, n)
    if len(unkept):
        after = np.searchsorted(unkept, index)
        inside = after < len(unkept)
        next_unkept[inside] = unkept[after[inside]]
    k = np.minimum(next_unkept, run_end)  # the first row from s on that is not kept (or the run's end)
    kept_end = np.minimum(first_past(kept_limit), k)
    fits = kept_end >= k  # every kept piece from s fits: then pieces of any kind up to max_read_size
    tail = np.minimum(np.maximum(first_past(max_read_size), k), run_end)
    return np.where(k > index, np.where(fits, tail, np.maximum(kept_end, index + 1)), by_size)


def _plan_runs(
    rows: Rows,
    order: np.ndarray,
    place: np.ndarray,
    at: np.ndarray,
    blob: np.ndarray,
    offset: np.ndarray,
    end: np.ndarray,
    kept: np.ndarray,
    runs: np.ndarray,
    max_read_size: int,
    kept_limit: int,
    requests: list[ReadRequest],
) -> None:
    """:func:`_plan_chunk` read by read, each limit a bisection of its run's ends so far (any order)."""
    unkept = np.flatnonzero(~kept).tolist()  # wanted rows not kept, ascending
    offsets, ends = offset.tolist(), end.tolist()
    keys, blob_of = rows.keys, blob.tolist()
    cuts = runs.tolist()
    for a, b in zip([0, *cuts], [*cuts, len(at)]):
        reach = list(itertools.accumulate(ends[a:b], max))  # a read's end so far
        s = a
        while s < b:
            start = offsets[s]
            k = bisect.bisect_left(unkept, s)
            k = min(unkept[k], b) if k < len(unkept) else b  # the first piece from s on that is not kept
            if k > s:  # kept pieces first: a whole packed blob at most
                j = a + bisect.bisect_right(reach, start + kept_limit, s - a, k - a)
                if j < k:
                    j = max(j, s + 1)
                else:  # every kept piece fits: then pieces of any kind up to max_read_size
                    j = a + bisect.bisect_right(reach, start + max_read_size, k - a)
            else:
                j = a + bisect.bisect_right(reach, start + max_read_size, s + 1 - a)
            requests.append(
                ReadRequest(
                    keys[blob_of[s]],
                    start,
                    reach[j - 1 - a],
                    LazyParts(rows, at[s:j], start),
                    _slack(rows, order, int(place[s]), blob_of[s], start),
                )
            )
            s = j


def _slack(rows: Rows, order: np.ndarray, place: int, blob: int, offset: int) -> int:
    """Free bytes just before the piece at read-order position ``place``: back to the end of the
    piece before it in its blob (or the blob's start)."""
    return int(_slacks(rows, order, np.array([place]), np.array([blob]), np.array([offset]))[0])


def _slacks(rows: Rows, order: np.ndarray, place: np.ndarray, blob: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """:func:`_slack` of many pieces at once."""
    before = order[np.maximum(place - 1, 0)]
    after_one = (place > 0) & (rows.blob[before] == blob)
    return offset - np.where(after_one, rows.offset[before] + rows.length(before), 0)


def _read_order(rows: Rows) -> np.ndarray:
    """The rows blob by blob, each blob's by offset, the blobs in the order of the first leaf
    each holds (:func:`_blob_order`): one sort of a combined key where both fit it."""
    if not len(rows):
        return np.zeros(0, dtype=np.int32)
    blob = _blob_order(rows)[rows.blob]
    if int(rows.offset.max()) < 1 << 40 and len(rows.keys) < 1 << 22:
        key = blob  # built in place: one temporary of 8 bytes a row
        key <<= 40
        key |= rows.offset
        order = np.argsort(key)
        del key
    else:
        order = np.lexsort((rows.offset, blob))
    return order.astype(np.int32) if len(order) < 1 << 31 else order


def _blob_order(rows: Rows) -> np.ndarray:
    """Per blob (by its number in ``rows.keys``), its place in the read order: blobs ordered by
    the first row in them (rows are in leaf order), so reads go leaf after leaf, as the save packed them.

    Not by key: a blob's key starts with a hash (:func:`objckpt.core.plan.blob_key`), and an
    index lists its blobs by key. Read in that order, a leaf whose pieces span several blobs
    has its first piece read long before its last, and restore holds a leaf's host buffer
    from the first to the last (docs/PERFORMANCE.md counts them); leaf after leaf, a few are open.
    """
    first = np.full(len(rows.keys), len(rows), dtype=np.int64)  # a blob with no row: after every other
    np.minimum.at(first, rows.blob, np.arange(len(rows), dtype=np.int64))
    order = np.empty(len(rows.keys), dtype=np.int64)
    order[np.argsort(first, kind="stable")] = np.arange(len(rows.keys))
    return order
