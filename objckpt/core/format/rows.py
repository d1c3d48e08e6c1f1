"""Pieces as columns: the rows a restore reads from version 3 index objects, with no object per piece.

A host that restores every parameter of a pod-scale checkpoint onto one
inference host reads millions of index rows (the 405B state saved from 4,096
devices: 3.65 million). As one :class:`~objckpt.core.pieces.Piece` each, they
took 11 CPU-s to build and over 1 GiB to hold before a byte was read. Here
they stay numpy columns (:class:`Rows`: blob, offset, crc32c, box id, digest;
a piece's length is its box's bytes, or a column of its own where pieces are stored
encoded), sorted by leaf; each leaf's pieces are a :class:`LeafPieces` view that
is a ``Sequence[Piece]`` to every reader of pieces, building a piece only when
one is asked for, while planning (:mod:`objckpt.restoring.leaf_plan`) and read
coalescing (:mod:`objckpt.core.plan_rows`) work on the columns. Boxes are
interned: the leaves of a layer stack repeat the same few thousand boxes, so a
row holds a 4-byte box id.

Every restore plans from rows: pieces listed as tuples (a version 1 manifest, version 2
index objects) are turned into rows once they are read (:func:`rows_from_pieces`), so
one planner serves every format version. No I/O.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from objckpt.core.pieces import Piece
from objckpt.core.writer_rule import Box
from objckpt.errors import FormatError

_NEW_PIECE = functools.partial(tuple.__new__, Piece)
#: Odd 64-bit multipliers, one per column: what :func:`distinct_rows` mixes rows with.
_MIX = np.random.default_rng(0x0B1C).integers(1 << 62, size=64, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def distinct_rows(keyed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of the int64 matrix ``keyed`` (at most 64 columns): each one's first row,
    and each row's position among them.

    Rows are told apart by a 64-bit mix of their values (one sort of integers, not of byte
    strings), checked exactly against each mix's first row: rows whose mixes collide (a crafted
    file can make them) are told apart by their bytes instead.
    """
    mixed = keyed[:, 0].view(np.uint64) * _MIX[0]
    for c in range(1, keyed.shape[1]):  # column by column: reducing a short axis is slow
        mixed += keyed[:, c].view(np.uint64) * _MIX[c]
    _, first, inverse = np.unique(mixed, return_index=True, return_inverse=True)
    inverse = inverse.ravel()
    if not (keyed == keyed[first][inverse]).all():
        void = np.dtype((np.void, 8 * keyed.shape[1]))
        _, first, inverse = np.unique(np.ascontiguousarray(keyed).view(void).ravel(), True, True)
        inverse = inverse.ravel()
    return first, inverse


class Boxes:
    """Interned boxes: one id per distinct (start, stop) and itemsize, shared by every row that
    names it; a row's byte length is its box's (:attr:`nbytes`), not a column of its own."""

    def __init__(self) -> None:
        self.boxes: list[Box] = []
        self._nbytes: list[int] = []
        self._ids: dict[bytes, int] = {}

    def intern_distinct(self, keyed: np.ndarray) -> np.ndarray:
        """Ids (int32) of the distinct boxes ``keyed`` (rows of starts, stops, itemsize; found by
        :func:`distinct_rows`)."""
        return np.array([self._id_of(row.tobytes(), v) for row, v in zip(keyed, keyed.tolist())], dtype=np.int32)

    def _id_of(self, key: bytes, v: list[int]) -> int:
        found = self._ids.get(key)
        if found is None:
            r = (len(v) - 1) // 2
            start, stop = tuple(v[:r]), tuple(v[r : 2 * r])
            found = self._ids[key] = len(self.boxes)
            self.boxes.append((start, stop))
            self._nbytes.append(math.prod(b - a for a, b in zip(start, stop)) * v[-1])
        return found

    def ids_of(self, boxes: Iterable[Box]) -> np.ndarray:
        """The ids of those of ``boxes`` that are interned, of any itemsize (int32)."""
        by_box = self._by_box
        return np.array([k for box in boxes for k in by_box.get(box, ())], dtype=np.int32)

    @functools.cached_property
    def _by_box(self) -> dict[Box, list[int]]:
        out: dict[Box, list[int]] = {}
        for k, box in enumerate(self.boxes):
            out.setdefault(box, []).append(k)
        return out

    @functools.cached_property
    def place_ids(self) -> np.ndarray:
        """Per box id, the first id of the same (start, stop): boxes of two itemsizes share it
        (asked once the rows are complete)."""
        by_box = self._by_box
        return np.array([by_box[box][0] for box in self.boxes], dtype=np.int32)

    @functools.cached_property
    def nbytes(self) -> np.ndarray:
        """Each box's bytes, by id (asked once the rows are complete)."""
        return np.array(self._nbytes, dtype=np.int64)


class Rows:
    """A checkpoint's pieces as columns sorted by leaf (see the module).

    ``stored``: each row's stored byte length, where some differ from their box's bytes
    (leaves saved with a codec); None when every row's is its box's.
    """

    def __init__(
        self,
        keys: list[str],
        boxes: Boxes,
        leaf: np.ndarray,
        blob: np.ndarray,
        offset: np.ndarray,
        crc: np.ndarray,
        box: np.ndarray,
        sha: np.ndarray | None,
        stored: np.ndarray | None = None,
    ) -> None:
        """Columns already sorted by ``leaf`` (:meth:`RowsBuilder.build` sorts them)."""
        self.keys = keys
        self.stored = stored
        self.boxes = boxes
        self.blob = blob
        self.offset = offset
        self.crc = crc
        self.box = box
        self.sha = sha
        cuts = np.flatnonzero(np.diff(leaf)) + 1
        firsts = np.concatenate(([0], cuts)).astype(np.int64)
        ends = np.concatenate((cuts, [len(leaf)])).astype(np.int64)
        if len(leaf):
            self._firsts, self._leaves = firsts, leaf[firsts].astype(np.int64)
        else:
            self._firsts, self._leaves = np.zeros(0, np.int64), np.zeros(0, np.int64)
        self.bounds: dict[int, tuple[int, int]] = {
            i: (a, b) for i, a, b in zip(self._leaves.tolist(), firsts.tolist(), ends.tolist()) if b > a
        }

    def __len__(self) -> int:
        return len(self.blob)

    def leaf(self, i: int) -> LeafPieces:
        """Leaf ``i``'s pieces (none when no row names it)."""
        a, b = self.bounds.get(i, (0, 0))
        return LeafPieces(self, np.arange(a, b, dtype=np.int32 if b < 1 << 31 else np.int64))

    def length(self, at: np.ndarray) -> np.ndarray:
        """The stored byte length of each of rows ``at`` (its box's bytes, unless encoded)."""
        if self.stored is not None:
            return self.stored[at]
        return self.boxes.nbytes[self.box[at]]

    def leaf_of(self, at: np.ndarray) -> np.ndarray:
        """The leaf of each of rows ``at``."""
        return self._leaves[np.searchsorted(self._firsts, at, "right") - 1]

    def pieces(self, at: np.ndarray) -> list[Piece]:
        """The pieces of rows ``at``, built in one pass (tuple.__new__: no Python frame per piece)."""
        boxes = self.boxes.boxes
        geometry = list(map(boxes.__getitem__, self.box[at].tolist()))
        starts = [g[0] for g in geometry]
        stops = [g[1] for g in geometry]
        names = map(self.keys.__getitem__, self.blob[at].tolist())
        digests: Any = [None] * len(at) if self.sha is None else [bytes(d).hex() for d in self.sha[at]]
        rows = zip(
            starts, stops, names, self.offset[at].tolist(), self.length(at).tolist(), self.crc[at].tolist(), digests
        )
        return list(map(_NEW_PIECE, rows))


class LeafPieces(Sequence[Piece]):
    """One leaf's pieces: rows ``at`` of a :class:`Rows`, a read-only sequence of :class:`Piece`
    that builds each piece when asked (planning reads the columns instead)."""

    __slots__ = ("rows", "at")

    def __init__(self, rows: Rows, at: np.ndarray) -> None:
        self.rows = rows
        self.at = at

    def __len__(self) -> int:
        return len(self.at)

    @overload
    def __getitem__(self, k: int) -> Piece: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[Piece]: ...
    def __getitem__(self, k: int | slice) -> Piece | Sequence[Piece]:
        if isinstance(k, slice):
            return LeafPieces(self.rows, self.at[k])
        return self.rows.pieces(self.at[[k]])[0]

    def __iter__(self) -> Iterator[Piece]:
        return iter(self.rows.pieces(self.at))

    def __add__(self, other: Sequence[Piece]) -> tuple[Piece, ...]:
        return (*self, *other)

    def __radd__(self, other: Sequence[Piece]) -> tuple[Piece, ...]:
        return (*other, *self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, list, LeafPieces)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LeafPieces({len(self)} rows)"

    def take(self, positions: np.ndarray) -> LeafPieces:
        """The pieces at ``positions`` of this sequence (the same object when that is all of them)."""
        if len(positions) == len(self.at):
            return self
        return LeafPieces(self.rows, self.at[positions])

    @property
    def box_ids(self) -> np.ndarray:
        return self.rows.box[self.at]

    def geometry_key(self) -> tuple[Boxes, bytes]:
        """What identifies the pieces' boxes in order (equal for two leaves of a layer stack, of
        any dtype): their :class:`Boxes` (held, so compared by identity) and the bytes of each
        piece's :attr:`Boxes.place_ids` (4 a piece, not its coordinates' 16 a dimension)."""
        boxes = self.rows.boxes
        return boxes, boxes.place_ids[self.box_ids].tobytes()

    def geometry(self) -> tuple[Box, ...]:
        """Each piece's (start, stop), in order."""
        return tuple(map(self.rows.boxes.boxes.__getitem__, self.box_ids.tolist()))


class RowsBuilder:
    """Collects checked rows (of version 3 frames, of many index objects), then makes :class:`Rows`.

    Each index object's blobs are added once (:meth:`add_blobs`, which gives the base its
    rows' blob positions are offset by); :meth:`add` takes one frame's wanted rows.
    ``stored``: rows carry their stored length (version 4: leaves saved with a codec).
    """

    def __init__(self, digest: bool, *, stored: bool = False) -> None:
        self.keys: list[str] = []
        self.boxes = Boxes()
        self.digest = digest
        self.stored = stored
        self._columns: list[list[np.ndarray]] = [[] for _ in range(7)]

    def add_blobs(self, keys: list[str]) -> int:
        base = len(self.keys)
        self.keys.extend(keys)
        return base

    def add(
        self,
        base: int,
        leaf: np.ndarray,
        distinct: np.ndarray,
        inverse: np.ndarray,
        blob: np.ndarray,
        offset: np.ndarray,
        crc: np.ndarray,
        sha: np.ndarray | None,
        length: np.ndarray | None = None,
    ) -> None:
        """Rows of one rank: leaves, their boxes given once each (``distinct``: starts, stops,
        itemsize per box, checked) and each row's position in it (``inverse``), blob positions in
        their index object's list, offsets, crc32c (and digests, and stored lengths)."""
        box = self.boxes.intern_distinct(distinct)[inverse]
        parts: tuple[np.ndarray, ...] = (
            leaf.astype(np.int32),
            blob.astype(np.int32) + np.int32(base),
            offset.astype(np.int64),
            crc.astype(np.uint32),
            box,
        )
        for column, part in zip(self._columns, parts):
            column.append(part)
        if self.digest:
            if sha is None:  # the root gives some index objects digests and not others
                raise FormatError("index objects of one checkpoint disagree on whether pieces have a sha256")
            self._columns[5].append(np.ascontiguousarray(sha))
        if self.stored:
            if length is None:
                raise FormatError("rows of a checkpoint with encoded leaves lack their stored lengths")
            self._columns[6].append(length.astype(np.int64))

    def build(self) -> Rows:
        """The rows collected, sorted by leaf: each column joined, then put in leaf order, one at a
        time (its parts, then its unsorted whole, let go before the next: a few columns' bytes at once)."""
        dtypes = (np.int32, np.int32, np.int64, np.uint32, np.int32)
        columns: list[np.ndarray | None] = []
        for parts, dtype in zip(self._columns[:5], dtypes):
            columns.append(np.concatenate(parts) if parts else np.zeros(0, dtype=dtype))
            parts.clear()
        if self.digest:
            parts = self._columns[5]
            columns.append(np.concatenate(parts) if parts else np.zeros((0, 32), dtype=np.uint8))
            parts.clear()
        else:
            columns.append(None)
        if self.stored:
            parts = self._columns[6]
            columns.append(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
            parts.clear()
        else:
            columns.append(None)
        leaf = columns[0]
        assert leaf is not None
        # Stable, and a radix sort where leaf numbers fit 16 bits (5x faster on millions of rows).
        order = np.argsort(leaf.astype(np.uint16) if len(leaf) and leaf.max() < 1 << 16 else leaf, kind="stable")
        if len(order) < 1 << 31:
            order = order.astype(np.int32)
        for k, column in enumerate(columns):
            if column is not None:
                columns[k] = None
                columns[k] = column[order]
                del column
        del order
        leaf, blob, offset, crc, box, sha, stored = columns
        assert leaf is not None and blob is not None and offset is not None and crc is not None and box is not None
        return Rows(self.keys, self.boxes, leaf, blob, offset, crc, box, sha, stored)


def rows_from_pieces(leaves: Iterable[tuple[int, Sequence[Piece], int]]) -> Rows:
    """Pieces held as tuples (leaf index, its pieces, its itemsize) as one :class:`Rows`.

    What turns a version 1 manifest's pieces and version 2 index objects' into the columns
    every restore plans from. Pieces are grouped by rank (a row's box has its leaf's rank); a
    stored-length column is kept only where some piece's length is not its box's bytes.
    """
    by_rank: dict[int, list[tuple[int, Piece, int]]] = {}
    for i, pieces, itemsize in leaves:
        for p in pieces:
            by_rank.setdefault(len(p.start), []).append((i, p, itemsize))
    rows = [row for group in by_rank.values() for row in group]
    digest = any(p.sha256 is not None for _, p, _ in rows)
    if digest and not all(p.sha256 is not None for _, p, _ in rows):
        raise FormatError("pieces of one checkpoint disagree on whether they have a sha256")
    blobs: dict[str, int] = {}
    for _, p, _ in rows:
        blobs.setdefault(p.blob, len(blobs))
    keyed_groups = []
    stored = False
    for rank, group in by_rank.items():
        keyed = np.array([(*p.start, *p.stop, size) for _, p, size in group], dtype=np.int64).reshape(len(group), -1)
        lengths = np.array([p.length for _, p, _ in group], dtype=np.int64)
        extent = np.prod(keyed[:, rank : 2 * rank] - keyed[:, :rank], axis=1) * keyed[:, -1]
        stored = stored or bool((extent != lengths).any())
        keyed_groups.append((group, keyed, lengths))
    builder = RowsBuilder(digest, stored=stored)
    base = builder.add_blobs(list(blobs))
    for group, keyed, lengths in keyed_groups:
        first, inverse = distinct_rows(keyed)
        builder.add(
            base,
            np.array([i for i, _, _ in group], dtype=np.int32),
            keyed[first],
            inverse,
            np.array([blobs[p.blob] for _, p, _ in group], dtype=np.int32),
            np.array([p.offset for _, p, _ in group], dtype=np.int64),
            np.array([p.crc32c for _, p, _ in group], dtype=np.uint32),
            _digests([p.sha256 or "" for _, p, _ in group]) if digest else None,
            lengths,
        )
    return builder.build()


def _digests(hexes: list[str]) -> np.ndarray:
    """Hex SHA-256 digests as rows of 32 bytes."""
    return np.frombuffer(b"".join(map(bytes.fromhex, hexes)), np.uint8).reshape(len(hexes), 32).copy()
