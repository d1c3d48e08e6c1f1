"""Format version 3 index objects: the bounds a reader holds them to, whatever their bytes say.

zlib shrinks rows that repeat about 1,000:1, so a small index object can inflate to tens of
millions of rows, and a crafted one would make its reader decompress, hold and plan them
before any coverage check refused it. Its reader (:mod:`objckpt.core.format.index3`) bounds
that by what the checkpoint can hold: the frames of an object inflate to at most
:data:`OBJECT_RAW_LIMIT` (and :data:`RAW_PER_LEAF` more per leaf of the root); an object has at
most one frame per :data:`FRAME_FLOOR` raw bytes, per item it spans, and one; no two rows of a
leaf in a frame name one box; and the rows of a leaf cover no more than its elements, summed
from frame to frame (:class:`Tally`) and from object to object (:meth:`LeafTable.merge`); and
the heads of all the objects of a read list at most the rows its root allows (:meth:`LeafTable.draw`).
A frame's boxes are checked once per distinct (box, leaf kind) pair (:func:`distinct_boxes`):
each non-empty and inside its leaf, its bytes below :data:`BYTES_LIMIT`. Every check is a few numpy passes over a frame's columns. See ``docs/FORMAT.md`` ("Bounds").
No I/O.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from objckpt.core.dtypes import dtype_from_name
from objckpt.core.format.rows import distinct_rows
from objckpt.core.format.schema import ARRAY_KINDS, Manifest
from objckpt.errors import FormatError

#: Blob sizes and piece bytes stay below this, so every sum of two fits an int64.
BYTES_LIMIT = 1 << 62
#: The most bytes an index object's frames inflate to in all: this, and :data:`RAW_PER_LEAF`
#: more per leaf of the root (what a reader of the object may be made to decompress and hold).
OBJECT_RAW_LIMIT = 64 << 20
#: See :data:`OBJECT_RAW_LIMIT`: a process writes a few rows per leaf (~150 bytes a row at most).
RAW_PER_LEAF = 4 << 10
#: An index object has at most one frame per item its leaves span, one per this many raw bytes,
#: and one more (writers cut at each item and past ``index3_encode.FRAME_TARGET``, 128 KiB, or
#: 32 KiB in the first writers): each frame costs a reader a fixed amount of work, however small.
FRAME_FLOOR = 16 << 10
#: The rows all index objects of a read hold at most: this, one per leaf of stored data and device, one per
#: blob of the root and one per :data:`CUT_BYTES` of its blobs (a save writes at most one piece of a leaf per
#: device, and cuts one more at each blob and at each ``Options.blob_size`` inside a larger blob).
ROW_FLOOR = 1 << 15
#: See :data:`ROW_FLOOR`: a save's cuts inside a piece are at least half ``Options.blob_size`` (32 MiB).
CUT_BYTES = 1 << 20


class LeafTable:
    """Per leaf of a root, what row checks need, as arrays: its rank (-1: no stored data) and
    its kind (leaves of one shape and itemsize share one: a layer stack's leaves are a few
    kinds, so a frame's rows are checked per distinct (box, kind), not per row), with each
    kind's shape (padded), itemsize and element count. Built once per read, shared by every
    index object: it also sums, per leaf, the elements the rows of the objects read so far
    cover (:meth:`merge`), which the rows of a checkpoint never exceed (they tile the leaf)."""

    def __init__(self, manifest: Manifest) -> None:
        n = len(manifest.leaves)
        self._manifest = manifest
        #: Version 4: rows carry stored lengths; per leaf, whether its pieces are encoded, and its itemsize.
        self.lengths = manifest.version >= 4
        self.coded = np.zeros(n, dtype=bool)
        self.itemsize = np.zeros(n, dtype=np.int64)
        self.covered = np.zeros(n, dtype=np.float64)
        self.rank = np.full(n, -1, dtype=np.int64)
        self.kind = np.zeros(n, dtype=np.int64)
        kinds: dict[tuple[int, tuple[int, ...]], int] = {}
        for i, leaf in enumerate(manifest.leaves):
            if leaf.kind in ARRAY_KINDS and leaf.dtype is not None:
                dtype = dtype_from_name(leaf.dtype)
                assert dtype is not None
                shape = leaf.shape or ()
                if any(s >= BYTES_LIMIT for s in shape):
                    continue  # no box of it fits a blob (each extent below 2**62 keeps the sums in int64)
                self.rank[i] = len(shape)
                self.coded[i] = leaf.codec is not None
                self.itemsize[i] = dtype.itemsize
                self.kind[i] = kinds.setdefault((dtype.itemsize, tuple(shape)), len(kinds))
        kinds = kinds or {(0, ()): 0}  # no array leaf: one empty kind keeps every leaf's lookups in range
        width = max((len(shape) for _, shape in kinds), default=0)
        self.kind_shape = np.zeros((len(kinds), width), dtype=np.int64)
        self.kind_itemsize = np.zeros(len(kinds), dtype=np.int64)
        self.kind_elements = np.zeros(len(kinds), dtype=np.float64)
        for (itemsize, shape), k in kinds.items():
            self.kind_shape[k, : len(shape)] = shape
            self.kind_itemsize[k] = itemsize
            self.kind_elements[k] = element_count(shape)
        #: Per leaf, the most bytes its rows may cover (its elements × itemsize, as float64 sums allow).
        self.cover_limit = cover_limit(self.kind_elements * self.kind_itemsize)[self.kind]
        devices = max([manifest.num_processes, *(len(mesh.devices) for mesh in manifest.meshes)])
        stored = int((self.rank >= 0).sum())  # the leaves rows may name
        blobs = sum(ref.blobs + ref.blob_bytes // CUT_BYTES for ref in manifest.indexes)
        self.row_limit = ROW_FLOOR + devices * stored + blobs
        self.drawn: dict[int, int] = {}  # per process, the rows its head lists (a re-read draws them anew)
        self.rows = 0

    @functools.cached_property
    def item(self) -> np.ndarray:
        """Per leaf, the number of item starts (:func:`item_starts`) up to it: leaves ``a..b``
        span ``item[b] - item[a] + 1`` items. Asked only of an object with many small frames."""
        starts = np.zeros(len(self._manifest.leaves), dtype=np.int64)
        starts[item_starts([leaf.path for leaf in self._manifest.leaves])] = 1
        return np.cumsum(starts)

    def draw(self, process: int, rows: int, doc_name: str) -> None:
        """The ``rows`` process ``process``'s head lists, counted against the read's :attr:`row_limit`
        (:data:`ROW_FLOOR`) before any frame is inflated: no count of index objects costs more."""
        self.rows += rows - self.drawn.get(process, 0)
        self.drawn[process] = rows
        if self.rows > self.row_limit:
            raise FormatError(
                f"{doc_name}: its rows and those of the index objects read before it number {self.rows}"
                f", over the {self.row_limit} a checkpoint of its leaves, devices and blobs holds (one per leaf and "
                f"device, one per blob and MiB of blobs, and {ROW_FLOOR})"
            )

    def merge(self, tally: Tally, doc_name: str) -> None:
        """The bytes ``tally`` (an index object's checked rows) covers, added to those of the
        objects read before, per leaf (rows of a leaf share its itemsize: bytes count elements).

        Raises:
            FormatError: a leaf's rows of all the objects read cover more than its elements
                (a box two index objects both list, or boxes that overlap).
        """
        if not tally.leaves:
            return
        leaves, sums = np.concatenate(tally.leaves), np.concatenate(tally.sums)
        if len(leaves) > 1 and not (np.diff(leaves) > 0).all():  # a leaf that spans frames: one sum
            leaves, at = np.unique(leaves, return_inverse=True)
            sums = np.bincount(at.ravel(), weights=sums, minlength=len(leaves))
        total = self.covered[leaves] + sums
        over = total > self.cover_limit[leaves]
        if over.any():
            leaf = int(leaves[np.argmax(over)])
            elements = int(self.kind_elements[self.kind[leaf]])
            raise FormatError(
                f"{doc_name}: the rows of leaf {leaf} ({self._manifest.leaves[leaf].path}) in this and the index "
                f"objects read before it cover more than its {elements} elements (a box listed twice, or boxes "
                "that overlap)"
            )
        self.covered[leaves] = total


def element_count(shape: tuple[int, ...]) -> float:
    """A shape's element count as a float64 (exact below 2**53)."""
    out = 1.0
    for s in shape:
        out *= float(s)
    return out


def cover_limit(elements: np.ndarray) -> np.ndarray:
    """The most elements rows of leaves of ``elements`` may cover in float64 sums: exactly the
    count below 2**53 (where the sums of integer volumes are exact), a hair more above it."""
    return np.where(elements < 2.0**53, elements, elements * (1 + 2.0**-40))


_FIRST_KEY = re.compile(r"\[[^\]]*\]|\.[^.\[]*")


def item_starts(paths: Sequence[str]) -> list[int]:
    """The leaves (by position in ``paths``, a root's leaf paths in order) whose first path key
    differs from the leaf before's: where each item (params, each optimizer moment, ...) starts.
    Writers start a frame at each; a reader allows an index object one frame per item it spans
    beyond those :data:`FRAME_FLOOR` allows."""
    firsts = [m.group(0) if (m := _FIRST_KEY.match(path)) else path for path in paths]
    return [i for i, key in enumerate(firsts) if i == 0 or key != firsts[i - 1]]


class Tally:
    """What one index object's checked frames cover: per frame, its leaves and the bytes its
    rows cover in each (float64), and the last leaf's running sum (a leaf that spans frames is
    summed across them). A reader keeps one per read of an object, and merges it into its
    :class:`LeafTable` once the object has passed every check (:meth:`LeafTable.merge`)."""

    def __init__(self) -> None:
        self.leaves: list[np.ndarray] = []
        self.sums: list[np.ndarray] = []
        self.last_leaf = -1
        self.last_sum = 0.0


def check_frame_count(frames: Sequence[Any], table: LeafTable | None, manifest: Manifest, doc_name: str) -> None:
    """An object's ``frames`` (each with ``first``, ``last`` and ``raw_length``) number at most
    one per :data:`FRAME_FLOOR` raw bytes, one per item their leaves span after the first, and
    one. Items are counted (``table``'s, else ``manifest``'s leaves') only past the first bound.

    Raises:
        FormatError: naming the index object, the count and what it allows.
    """
    raw = sum(f.raw_length for f in frames)
    if len(frames) <= raw // FRAME_FLOOR + 1:
        return  # the usual case: no item counted
    items = (table or LeafTable(manifest)).item
    allowed = raw // FRAME_FLOOR + 1 + int(items[frames[-1].last] - items[frames[0].first])
    if len(frames) > allowed:
        raise FormatError(
            f"{doc_name} field 'frames': {len(frames)} frames of {raw} raw bytes in all, over the {allowed} "
            f"allowed (one per item its leaves span, one per {FRAME_FLOOR} raw bytes, and one)"
        )


def repeated(leaf: np.ndarray, leaves: int, pair: np.ndarray, pairs: int) -> tuple[int, int] | None:
    """Two rows (positions) of one leaf naming one pair (box), or None: ``leaf`` each row's leaf
    (``0 <= leaf < leaves``), ``pair`` its position among ``pairs`` distinct (box, kind) pairs,
    which rows of one leaf share only when they name one box. Counted in one pass where the
    (leaf, pair) keys are few (a frame's leaves repeat a few boxes), else sorted."""
    key = leaf * pairs + pair
    span = leaves * pairs
    if span <= 4 * len(key) + 4096:
        if np.bincount(key, minlength=span).max() <= 1:
            return None
    else:
        ordered = np.sort(key)
        if not (ordered[1:] == ordered[:-1]).any():
            return None
    _, first, counts = np.unique(key, return_index=True, return_counts=True)
    again = key[first[np.argmax(counts > 1)]]
    a, b = np.flatnonzero(key == again)[:2].tolist()
    return a, b


def cover(
    leaf: np.ndarray,
    delta: np.ndarray,
    length: np.ndarray,
    table: LeafTable,
    tally: Tally | None,
    bad: Callable[[str], FormatError],
) -> None:
    """The bytes a frame's rows (sorted by ``leaf``; ``delta``: each one's leaf minus the one
    before's; ``length``: each one's bytes, its box's volume × its leaf's itemsize) cover, summed
    per leaf as float64 (with the tally's sum of a leaf the frame continues), checked against
    each leaf's elements × itemsize, and added to ``tally``."""
    firsts = np.flatnonzero(delta)
    firsts = np.concatenate(([0], firsts)) if len(firsts) else np.zeros(1, dtype=np.int64)  # row 0 starts a leaf
    leaves = leaf[firsts]
    sums = np.add.reduceat(length, firsts, dtype=np.float64)
    carried = tally is not None and int(leaves[0]) == tally.last_leaf
    if carried:
        assert tally is not None
        sums[0] += tally.last_sum
    over = sums > table.cover_limit[leaves]
    if over.any():
        at = int(leaves[np.argmax(over)])
        elements = int(table.kind_elements[table.kind[at]])
        raise bad(
            f"the rows of leaf {at} cover more than its {elements} elements (a box listed twice, or boxes that overlap)"
        )
    if tally is not None:
        if carried:  # the leaf's sum so far replaces the frame before's last entry
            tally.sums[-1][-1] = 0.0
        tally.leaves.append(leaves)
        tally.sums.append(sums)
        tally.last_leaf, tally.last_sum = int(leaves[-1]), float(sums[-1])


def box_text(pair: np.ndarray, r: int) -> str:
    """A pair of :func:`distinct_boxes` as ``(starts)-(stops)``, for error messages."""
    return f"{tuple(pair[:r].tolist())}-{tuple(pair[r : 2 * r].tolist())}"


def distinct_boxes(
    grid: np.ndarray, kind: np.ndarray, r: int, table: LeafTable
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The distinct (box, leaf kind) pairs of rows ``grid`` (starts then stops, rank ``r``) of leaves
    of ``kind``: (starts, stops, itemsize) per pair, each row's pair, each pair's bytes (None when
    one is 2**62 or more), and which pairs are not a non-empty box inside their leaf (None: all are).

    Pairs are found by :func:`~objckpt.core.format.rows.distinct_rows`.
    """
    keyed = np.empty((len(grid), 2 * r + 1), dtype=np.int64)
    keyed[:, : 2 * r] = grid
    keyed[:, 2 * r] = kind
    first, inverse = distinct_rows(keyed)
    pairs = keyed[first]
    lo, hi, kinds = pairs[:, :r], pairs[:, r : 2 * r], pairs[:, 2 * r]
    ok = ((lo >= 0) & (lo < hi) & (hi <= table.kind_shape[kinds, :r])).all(axis=1)
    if not ok.all():
        return pairs, inverse, None, ~ok
    itemsize = table.kind_itemsize[kinds]
    extent = hi - lo
    if (np.prod(extent.astype(np.float64), axis=1) * itemsize >= BYTES_LIMIT).any():
        return pairs, inverse, None, None
    pairs[:, 2 * r] = itemsize
    return pairs, inverse, np.prod(extent, axis=1) * itemsize, None


class ArrayBoxes:
    """Boxes held as arrays, one per distinct box of a frame, for a reader of every row of a
    checkpoint (``verify``, ``cp``, ``gc``) in place of the interned
    :class:`~objckpt.core.format.rows.Boxes`: rows that never repeat a box (a crafted object's)
    cost their columns' bytes, not a tuple each. Box ``k`` is ``start[k, :rank[k]]`` to
    ``stop[k, :rank[k]]``, padded to ``width`` axes with ``[0, 1)``; it becomes a tuple only
    when a piece of it is built (``boxes[k]``, what :class:`~objckpt.core.format.rows.Rows` reads)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self._parts: list[np.ndarray] = []
        self._count = 0
        self.boxes = self  # what Rows reads boxes from, one tuple when a piece is built

    def intern_distinct(self, keyed: np.ndarray) -> np.ndarray:
        """Ids (int32) of the boxes ``keyed`` (rows of starts, stops, itemsize), new each."""
        r, w = (keyed.shape[1] - 1) // 2, self.width
        part = np.zeros((len(keyed), 2 * w + 2), dtype=np.int64)
        part[:, :r], part[:, w : w + r], part[:, w + r : 2 * w] = keyed[:, :r], keyed[:, r : 2 * r], 1
        part[:, 2 * w], part[:, 2 * w + 1] = keyed[:, 2 * r], r
        self._parts.append(part)
        self._count += len(keyed)
        return np.arange(self._count - len(keyed), self._count, dtype=np.int32)

    @functools.cached_property
    def table(self) -> np.ndarray:
        """Every box: starts, stops, itemsize, rank (asked once the rows are complete)."""
        w = self.width
        table = np.concatenate(self._parts) if self._parts else np.zeros((0, 2 * w + 2), dtype=np.int64)
        self._parts.clear()
        return table

    @functools.cached_property
    def nbytes(self) -> np.ndarray:
        """Each box's bytes, by id."""
        w = self.width
        return np.prod(self.table[:, w : 2 * w] - self.table[:, :w], axis=1) * self.table[:, 2 * w]

    def __getitem__(self, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        w, row = self.width, self.table[k].tolist()
        return tuple(row[: row[-1]]), tuple(row[w : w + row[-1]])


def check_covered(table: LeafTable, manifest: Manifest) -> None:
    """The rows of every index object (summed in ``table``) cover each leaf's elements exactly: a
    whole read's first tiling check, before its rows are put in order (:func:`check_rows_tiling`).

    Raises:
        FormatError: naming a leaf whose rows' volumes do not add up to its elements.
    """
    elements = table.kind_elements[table.kind]
    big = np.where(elements < 2.0**53, 0, elements * 2.0**-40)
    off = (table.rank >= 0) & (np.abs(table.covered - table.itemsize * elements) > table.itemsize * big)
    if off.any():
        i = int(np.argmax(off))
        raise FormatError(
            f"manifest field 'leaves[{i}]' ({manifest.leaves[i].path}): pieces of all index objects: pieces cover "
            f"{int(table.covered[i] // table.itemsize[i])} elements of {int(elements[i])} (holes or overlaps)"
        )


def check_rows_tiling(manifest: Manifest, leaf: np.ndarray, box: np.ndarray, boxes: ArrayBoxes) -> list[int]:
    """Rows (each one's ``leaf`` and ``box`` id in ``boxes``) of every index object, whose volumes
    add up to each leaf's elements (:func:`check_covered`), checked in columns to tile each leaf
    of ``manifest`` exactly: its boxes are a grid (distinct, every combination of disjoint
    intervals per axis), which leaves neither hole nor overlap. A few numpy passes, whatever the rows.

    Returns:
        The leaves whose rows are no grid, for a check piece by piece
        (:func:`objckpt.core.pieces.check_tiling`; saves write grids).
    """
    table, n, w = LeafTable(manifest), len(manifest.leaves), boxes.width
    start, stop = boxes.table[box, :w], boxes.table[box, w : 2 * w]
    rows, cells, bad = np.bincount(leaf, minlength=n), np.ones(n), np.zeros(n, dtype=bool)
    for d in range(w):
        order = np.lexsort((stop[:, d], start[:, d], leaf))
        at, a, b = leaf[order], start[order, d], stop[order, d]
        new = np.concatenate(([True], (at[1:] != at[:-1]) | (a[1:] != a[:-1]) | (b[1:] != b[:-1])))
        at, a, b = at[new], a[new], b[new]
        bad[at[1:][(at[1:] == at[:-1]) & (b[:-1] > a[1:])]] = True  # two intervals of an axis overlap
        cells *= np.bincount(at, minlength=n)
    first, _ = distinct_rows(np.column_stack((leaf.astype(np.int64), start, stop)))
    grid = ~bad & (cells == rows) & (np.bincount(leaf[first], minlength=n) == rows)
    return np.flatnonzero((table.rank < 0) | ((rows > 0) & ~grid)).tolist()


def check_blob_bytes(keys: Sequence[str], blob: np.ndarray, offset: np.ndarray, length: np.ndarray) -> None:
    """No two rows (each one's ``blob``, a position in ``keys``, ``offset`` and ``length``) share a
    byte of their blob: a save never writes two pieces over the same bytes.

    Raises:
        FormatError: naming the blob and both byte ranges.
    """
    order = np.lexsort((offset, blob))
    b, s = blob[order], offset[order].astype(np.int64)
    e = s + length[order]
    clash = (b[1:] == b[:-1]) & (s[1:] < e[:-1])
    if clash.any():
        k = int(np.argmax(clash))
        raise FormatError(
            f"blob {keys[int(b[k])]}: pieces at bytes [{s[k]}, {e[k]}) and [{s[k + 1]}, {e[k + 1]}) overlap "
            "(a save never writes two pieces over the same bytes)"
        )
