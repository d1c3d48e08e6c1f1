"""Pieces as columns: the rows a restore reads from version 3 index objects, with no object per piece.

A host that restores every parameter of a pod-scale checkpoint onto one
inference host reads millions of index rows (the 405B state saved from 4,096
devices: 3.65 million). As one :class:`~objckpt.core.pieces.Piece` each, they
took 11 CPU-s to build and over 1 GiB to hold before a byte was read. Here
they stay numpy columns (:class:`Rows`: blob, offset, length, crc32c, box id,
digest), sorted by leaf; each leaf's pieces are a :class:`LeafPieces` view that
is a ``Sequence[Piece]`` to every reader of pieces, building a piece only when
one is asked for, while planning (:mod:`objckpt.restoring.leaf_plan`) and read
coalescing (:mod:`objckpt.core.plan_rows`) work on the columns. Boxes are
interned: the leaves of a layer stack repeat the same few thousand boxes, so a
row holds a 4-byte box id. No I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from objckpt.core.pieces import Piece
from objckpt.errors import FormatError

Box = tuple[tuple[int, ...], tuple[int, ...]]

_NEW_PIECE = functools.partial(tuple.__new__, Piece)


class Boxes:
    """Interned boxes: one id per distinct (start, stop), shared by every row that names it."""

    def __init__(self) -> None:
        self.boxes: list[Box] = []
        self._ids: dict[bytes, int] = {}
        self._coords: dict[int, list[np.ndarray]] = {}  # per rank: each id's coordinates, as added

    def intern(self, coords: np.ndarray) -> np.ndarray:
        """Ids (int32) of the boxes in ``coords`` (rows of starts then stops, one rank)."""
        n, width = coords.shape
        if width == 0:
            return np.full(n, self._id_of(b"", (), ()), dtype=np.int32)
        keys = np.ascontiguousarray(coords, dtype=np.int64).view(np.dtype((np.void, 8 * width))).ravel()
        distinct, inverse = np.unique(keys, return_inverse=True)
        r = width // 2
        rows = distinct.view(np.int64).reshape(-1, width)
        ids = np.empty(len(distinct), dtype=np.int32)
        for k, (key, row) in enumerate(zip(distinct.tolist(), rows.tolist())):
            ids[k] = self._id_of(bytes(key), tuple(row[:r]), tuple(row[r:]))
        return ids[inverse.ravel()]

    def _id_of(self, key: bytes, start: tuple[int, ...], stop: tuple[int, ...]) -> int:
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self.boxes)
            self.boxes.append((start, stop))
        return found

    def ids_of(self, boxes: Iterable[Box]) -> np.ndarray:
        """The ids of those of ``boxes`` that are interned (int32; a box no row names has none)."""
        by_box = self._by_box
        return np.array([k for box in boxes if (k := by_box.get(box)) is not None], dtype=np.int32)

    @functools.cached_property
    def _by_box(self) -> dict[Box, int]:
        return {box: k for k, box in enumerate(self.boxes)}

    @functools.cached_property
    def coordinates(self) -> np.ndarray:
        """Every box's starts then stops, padded with zeros to the largest rank (for geometry keys);
        asked once the rows are complete."""
        width = max((len(s) for s, _ in self.boxes), default=0)
        out = np.zeros((len(self.boxes), 2 * width), dtype=np.int64)
        for k, (start, stop) in enumerate(self.boxes):
            out[k, : len(start)] = start
            out[k, width : width + len(stop)] = stop
        return out


class Rows:
    """The pieces read from version 3 index objects, as columns sorted by leaf (see the module)."""

    def __init__(
        self,
        keys: list[str],
        boxes: Boxes,
        leaf: np.ndarray,
        blob: np.ndarray,
        offset: np.ndarray,
        length: np.ndarray,
        crc: np.ndarray,
        box: np.ndarray,
        sha: np.ndarray | None,
    ) -> None:
        """Columns already sorted by ``leaf`` (:meth:`RowsBuilder.build` sorts them)."""
        self.keys = keys
        self.boxes = boxes
        self.blob = blob
        self.offset = offset
        self.length = length
        self.crc = crc
        self.box = box
        self.sha = sha
        cuts = np.flatnonzero(np.diff(leaf)) + 1
        firsts = np.concatenate(([0], cuts)).astype(np.int64).tolist()
        ends = np.concatenate((cuts, [len(leaf)])).astype(np.int64).tolist()
        self.bounds: dict[int, tuple[int, int]] = {int(leaf[a]): (a, b) for a, b in zip(firsts, ends) if b > a}

    def __len__(self) -> int:
        return len(self.blob)

    def leaf(self, i: int) -> LeafPieces:
        """Leaf ``i``'s pieces (none when no row names it)."""
        a, b = self.bounds.get(i, (0, 0))
        return LeafPieces(self, np.arange(a, b, dtype=np.int64))

    def pieces(self, at: np.ndarray) -> list[Piece]:
        """The pieces of rows ``at``, built in one pass (tuple.__new__: no Python frame per piece)."""
        boxes = self.boxes.boxes
        geometry = list(map(boxes.__getitem__, self.box[at].tolist()))
        starts = [g[0] for g in geometry]
        stops = [g[1] for g in geometry]
        names = map(self.keys.__getitem__, self.blob[at].tolist())
        digests: Any = [None] * len(at) if self.sha is None else [bytes(d).hex() for d in self.sha[at]]
        rows = zip(
            starts, stops, names, self.offset[at].tolist(), self.length[at].tolist(), self.crc[at].tolist(), digests
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

    def geometry_key(self) -> tuple[int, bytes]:
        """What identifies the pieces' boxes in order, by content (equal for two leaves of a
        layer stack): their count and coordinates' bytes."""
        return len(self.at), self.rows.boxes.coordinates[self.box_ids].tobytes()

    def geometry(self) -> tuple[Box, ...]:
        """Each piece's (start, stop), in order."""
        return tuple(map(self.rows.boxes.boxes.__getitem__, self.box_ids.tolist()))


class RowsBuilder:
    """Collects the checked rows of version 3 frames (of many index objects), then makes :class:`Rows`.

    Each index object's blobs are added once (:meth:`add_blobs`, which gives the base its
    rows' blob positions are offset by); :meth:`add` takes one frame's wanted rows.
    """

    def __init__(self, digest: bool) -> None:
        self.keys: list[str] = []
        self.boxes = Boxes()
        self.digest = digest
        self._columns: list[list[np.ndarray]] = [[] for _ in range(7)]

    def add_blobs(self, keys: list[str]) -> int:
        base = len(self.keys)
        self.keys.extend(keys)
        return base

    def add(
        self,
        base: int,
        leaf: np.ndarray,
        coords: np.ndarray,
        blob: np.ndarray,
        offset: np.ndarray,
        length: np.ndarray,
        crc: np.ndarray,
        sha: np.ndarray | None,
    ) -> None:
        """Rows of one rank: leaves, boxes (starts then stops), blob positions in their index
        object's list, offsets, lengths, crc32c (and digests)."""
        box = self.boxes.intern(coords)
        parts = (
            leaf.astype(np.int32),
            blob.astype(np.int32) + np.int32(base),
            offset.astype(np.int64),
            length.astype(np.int64),
            crc.astype(np.uint32),
            box,
        )
        for column, part in zip(self._columns, parts):
            column.append(part)
        if self.digest:
            if sha is None:  # the root gives some index objects digests and not others
                raise FormatError("index objects of one checkpoint disagree on whether pieces have a sha256")
            self._columns[6].append(np.ascontiguousarray(sha))

    def build(self) -> Rows:
        """The rows collected, sorted by leaf: each column joined, then put in leaf order, one at a
        time (its parts, then its unsorted whole, let go before the next: a few columns' bytes at once)."""
        dtypes = (np.int32, np.int32, np.int64, np.int64, np.uint32, np.int32)
        columns: list[np.ndarray | None] = []
        for parts, dtype in zip(self._columns[:6], dtypes):
            columns.append(np.concatenate(parts) if parts else np.zeros(0, dtype=dtype))
            parts.clear()
        if self.digest:
            parts = self._columns[6]
            columns.append(np.concatenate(parts) if parts else np.zeros((0, 32), dtype=np.uint8))
            parts.clear()
        else:
            columns.append(None)
        leaf = columns[0]
        assert leaf is not None
        order = np.argsort(leaf, kind="stable")
        for k, column in enumerate(columns):
            if column is not None:
                columns[k] = None
                columns[k] = column[order]
                del column
        leaf, blob, offset, length, crc, box, sha = columns
        assert leaf is not None and blob is not None and offset is not None and length is not None
        assert crc is not None and box is not None
        return Rows(self.keys, self.boxes, leaf, blob, offset, length, crc, box, sha)
