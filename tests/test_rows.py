"""Pieces held as columns (objckpt.core.format.rows) and reads planned from them (core.plan_rows):
the same pieces as tuples, and the reads a plain piece-by-piece planner plans (tests/reference_planner.py),
with no object per piece until one is asked for."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from objckpt.core import plan_rows
from objckpt.core.format import LeafEntry, Manifest
from objckpt.core.format.rows import _MIX, LeafPieces, RowsBuilder, distinct_rows, rows_from_pieces
from objckpt.core.pieces import Piece
from objckpt.core.plan import ALIGN, SPACED_MIN, SPACER
from objckpt.core.plan_rows import LazyParts, plan_row_reads
from tests.reference_planner import reference_reads

pytestmark = pytest.mark.quick


def _layout(rng: random.Random, blobs: int, leaves: int) -> dict[int, list[Piece]]:
    """Random pieces of ``leaves`` rank-2 leaves packed into ``blobs`` blobs as saves pack them:
    aligned, a spacer before large ones, leaves interleaved in each blob."""
    out: dict[int, list[Piece]] = {i: [] for i in range(leaves)}
    for b in range(blobs):
        offset = SPACER
        for _ in range(rng.randint(1, 40)):
            leaf = rng.randrange(leaves)
            rows, cols = rng.choice([(1, 4), (16, 64), (256, 1024), (1024, 1024), (3, 5)])
            length = rows * cols * 4
            offset = -(-offset // ALIGN) * ALIGN + (SPACER if length >= SPACED_MIN else 0)
            offset += rng.choice([0, 0, 0, 64, 4096, 1 << 20])  # gaps of other writers' bytes
            r0 = rng.randrange(10_000) * rows
            out[leaf].append(
                Piece((r0, 0), (r0 + rows, cols), f"{b:02x}/blob-{b}", offset, length, rng.randrange(2**32))
            )
            offset += length
    return out


def _rows(pieces: dict[int, list[Piece]], digest: bool = False):
    keys = sorted({p.blob for found in pieces.values() for p in found})
    builder = RowsBuilder(digest=digest)
    base = builder.add_blobs(keys)
    position = {k: n for n, k in enumerate(keys)}
    for leaf, found in sorted(pieces.items(), reverse=True):  # rows arrive out of leaf order
        if not found:
            continue
        coords = np.array([(*p.start, *p.stop) for p in found], dtype=np.int64)
        sha = (
            np.frombuffer(b"".join(bytes.fromhex(p.sha256 or "") for p in found), np.uint8).reshape(-1, 32)
            if digest
            else None
        )
        itemsize = [p.length // math.prod(b - a for a, b in zip(p.start, p.stop)) for p in found]
        keyed = np.column_stack((coords, itemsize)).astype(np.int64)  # as index3.check_frame gives them
        first, inverse = distinct_rows(keyed)
        builder.add(
            base,
            np.full(len(found), leaf),
            keyed[first],
            inverse,
            np.array([position[p.blob] for p in found]),
            np.array([p.offset for p in found]),
            np.array([p.crc32c for p in found], dtype=np.uint32),
            sha,
        )
    return builder.build()


def test_leaf_pieces_are_the_pieces_added() -> None:
    pieces = _layout(random.Random(1), blobs=6, leaves=5)
    rows = _rows(pieces)
    for leaf, found in pieces.items():
        view = rows.leaf(leaf)
        assert isinstance(view, LeafPieces) and len(view) == len(found)
        assert list(view) == found  # order within a leaf is kept, every field equal
        if found:
            assert view[0] == found[0] and view[-1] == found[-1]
            assert list(view[1:3]) == found[1:3]
            assert view.geometry() == tuple((p.start, p.stop) for p in found)
    assert len(rows.boxes.boxes) == len({(p.start, p.stop) for f in pieces.values() for p in f})  # interned


def test_leaf_pieces_keep_digests() -> None:
    piece = Piece((0,), (4,), "aa/b", 64, 16, 7, "ab" * 32)
    rows = _rows({0: [piece]}, digest=True)
    assert list(rows.leaf(0)) == [piece]


def test_pieces_listed_as_tuples_become_the_same_rows() -> None:
    """What turns version 1 and 2 pieces into the rows a restore plans from: every field kept,
    ranks mixed, digests kept; a stored length other than the box's (a codec) is kept as a column."""
    pieces = _layout(random.Random(5), blobs=4, leaves=3)
    scalar = Piece((), (), "00/blob-0", 8, 4, 11)
    coded = [Piece((0,), (1000,), "07/c", 64, 123, 5), Piece((1000,), (2000,), "07/c", 192, 77, 6)]
    rows = rows_from_pieces([*((i, found, 4) for i, found in pieces.items()), (7, [scalar], 4)])
    assert rows.stored is None  # every length is its box's: no column
    for leaf, found in [*pieces.items(), (7, [scalar])]:
        assert list(rows.leaf(leaf)) == found
    coded_rows = rows_from_pieces([(0, pieces[0], 4), (1, coded, 4)])
    assert coded_rows.stored is not None and list(coded_rows.leaf(1)) == coded
    assert [p.length for p in coded_rows.leaf(1)] == [123, 77]
    digested = [p._replace(sha256=f"{k:064x}") for k, p in enumerate(pieces[1])]
    assert list(rows_from_pieces([(1, digested, 4)]).leaf(1)) == digested
    with pytest.raises(Exception, match="sha256"):
        rows_from_pieces([(1, digested, 4), (2, pieces[2], 4)])


def test_a_manifest_in_columns_has_one_rows_for_every_leaf() -> None:
    """Pieces as tuples, or as rows of two Rows (index objects read in two rounds), become rows of
    one Rows: what the one read planner takes. A manifest already so is itself."""
    pieces = _layout(random.Random(6), blobs=3, leaves=3)
    leaf = lambda i, found: LeafEntry(f"l{i}", "array", "float32", (1 << 24, 1024), pieces=tuple(found))  # noqa: E731
    tuples = Manifest("s", "t", {}, tuple(leaf(i, found) for i, found in pieces.items()), ())
    columns = tuples.in_columns()
    held = {id(e.pieces.rows) for e in columns.leaves if e.pieces}
    assert len(held) == 1 and all(list(e.pieces) == pieces[i] for i, e in enumerate(columns.leaves))
    assert columns.in_columns() is columns
    two = Manifest(
        "s",
        "t",
        {},
        (leaf(0, ()), leaf(1, ()), leaf(2, ())),
        (),
    )
    two = two.with_rows(_rows({0: pieces[0]}), {}, {0}).with_rows(_rows({1: pieces[1], 2: pieces[2]}), {}, {1})
    joined = two.in_columns()
    assert len({id(e.pieces.rows) for e in joined.leaves if e.pieces}) == 1
    assert [list(e.pieces) for e in joined.leaves] == [pieces[0], pieces[1], pieces[2]]


def test_geometry_keys_equal_for_equal_boxes_only() -> None:
    a = [Piece((0, 0), (2, 4), "x/b", 64, 32, 1), Piece((2, 0), (4, 4), "x/b", 128, 32, 2)]
    b = [p._replace(offset=p.offset + 1000, crc32c=9) for p in a]  # another layer: same boxes
    c = [a[1], a[0]]  # the same boxes in another order
    d = [p._replace(length=p.length * 2) for p in a]  # another dtype (8-byte elements): same boxes
    e = a[:1]  # fewer pieces
    rows = _rows({0: a, 1: b, 2: c, 3: d, 4: e})
    assert rows.leaf(0).geometry_key() == rows.leaf(1).geometry_key() == rows.leaf(3).geometry_key()
    assert rows.leaf(0).geometry_key() != rows.leaf(2).geometry_key()
    assert rows.leaf(0).geometry_key() != rows.leaf(4).geometry_key()
    assert rows.leaf(3)[0].length == 64  # the dtype's bytes stay the row's own
    other = _rows({0: a})
    assert other.leaf(0).geometry_key() != rows.leaf(0).geometry_key()  # ids of another Rows


def _as_tuples(requests):
    return [(r.blob, r.start, r.end, r.slack, [tuple(part) for part in r.parts]) for r in requests]


@pytest.mark.parametrize("seed", range(12))
def test_row_reads_are_the_reference_reads(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    monkeypatch.setattr(plan_rows, "CHUNK_ROWS", rng.choice([1, 5, 1 << 18]))  # planned in chunks of whole blobs
    if seed % 3 == 2:  # the read-by-read path, which plans chunks whose pieces overlap
        monkeypatch.setattr(plan_rows, "_jumps", lambda *args: None)
    pieces = _layout(rng, blobs=rng.randint(1, 12), leaves=rng.randint(1, 8))
    rows = _rows(pieces)
    wanted = {leaf: [p for p in found if rng.random() < 0.7] for leaf, found in pieces.items()}
    kept_leaves = {leaf for leaf in pieces if rng.random() < 0.5}
    gap = rng.choice([0, 4096, 1 << 20])
    limit = rng.choice([1 << 20, 8 << 20, 64 << 20])
    kept_size = rng.choice([0, 16 << 20, 256 << 20])

    def kept(leaf: int, piece: Piece) -> bool:
        return leaf in kept_leaves and piece.crc32c % 3 != 0

    expected = reference_reads(
        ((leaf, p) for leaf, found in wanted.items() for p in found),
        coalesce_gap=gap,
        max_read_size=limit,
        layout=(p for found in pieces.values() for p in found),
        kept=kept,
        max_kept_read_size=kept_size,
    )
    at, keep = [], []
    for leaf, found in wanted.items():
        view = rows.leaf(leaf)
        chosen = {(p.blob, p.offset) for p in found}
        picks = [k for k, p in enumerate(view) if (p.blob, p.offset) in chosen]
        at.append(view.at[picks])
        keep.append(np.array([kept(leaf, view[k]) for k in picks], dtype=bool))
    wanted_rows = np.zeros(len(rows), dtype=bool)
    wanted_rows[np.concatenate(at)] = True
    kept_rows = np.zeros(len(rows), dtype=bool)
    kept_rows[np.concatenate(at)[np.concatenate(keep)]] = True
    got = plan_row_reads(
        rows,
        wanted_rows,
        coalesce_gap=gap,
        max_read_size=limit,
        kept=kept_rows,
        max_kept_read_size=kept_size,
    )
    assert all(isinstance(r.parts, LazyParts) for r in got)
    assert sorted(_as_tuples(got)) == sorted(_as_tuples(expected))


def test_lazy_parts_index_like_a_tuple() -> None:
    pieces = _layout(random.Random(3), blobs=2, leaves=2)
    rows = _rows(pieces)
    (request, *_) = plan_row_reads(rows, np.ones(len(rows), dtype=bool), coalesce_gap=1 << 30, max_read_size=1 << 40)
    parts = list(request.parts)
    assert len(parts) == len(request.parts) > 1
    assert request.parts[0] == parts[0] and request.parts[-1] == parts[-1]
    assert list(request.parts[1:]) == parts[1:]
    assert parts[0].offset == 0 and all(p.offset == p.piece.offset - request.start for p in parts)
    with pytest.raises(IndexError):
        request.parts[len(parts)]


def test_distinct_rows_tells_apart_rows_whose_mixes_collide() -> None:
    """Rows (a, b) and (a + M1, b - M0) mix to the same 64-bit value (a crafted index can hold
    both): they are still two distinct rows, and equal rows are still one."""
    m0, m1 = (int(m) for m in _MIX[:2])
    wrap = lambda v: (v + (1 << 63)) % (1 << 64) - (1 << 63)  # noqa: E731 (as int64)
    keyed = np.array([[5, 7], [wrap(5 + m1), wrap(7 - m0)], [5, 7], [1, 2]], dtype=np.int64)
    mixed = [int((keyed[k].view(np.uint64) * _MIX[:2]).sum(dtype=np.uint64)) for k in range(2)]
    assert mixed[0] == mixed[1]  # the crafted pair collides
    first, inverse = distinct_rows(keyed)
    assert len(first) == 3
    assert (keyed[first][inverse] == keyed).all()
    assert inverse[0] == inverse[2] != inverse[1]
