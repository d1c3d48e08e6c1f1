"""The pure planner: blob packing, splitting and read coalescing."""

from __future__ import annotations

import itertools
import math

import numpy as np

from objckpt.core import plan as plan_module
from objckpt.core.format import Piece
from objckpt.core.format.rows import rows_from_pieces
from objckpt.core.plan import (
    ALIGN,
    PACKING_SLACK,
    SPACED_MIN,
    SPACER,
    BoxIndex,
    OwnedPiece,
    blob_key,
    intersect,
    plan_blobs,
    split_box,
)
from objckpt.core.plan_rows import plan_row_reads


def plan_reads(wanted, *, layout=None, kept=None, **limits):
    """The reads of ``wanted`` (leaf, piece) pairs as a restore plans them: every piece of
    ``layout`` (by default the wanted ones) as rows, those wanted and kept as masks."""
    wanted = list(wanted)
    layout = [p for _, p in wanted] if layout is None else list(layout)
    leaf_of = {(p.blob, p.offset): leaf for leaf, p in wanted}
    by_leaf = {}
    for p in layout:
        by_leaf.setdefault(leaf_of.get((p.blob, p.offset), -1), []).append(p)
    rows = rows_from_pieces((leaf, found, 1) for leaf, found in by_leaf.items())
    got = rows.pieces(np.arange(len(rows)))
    leaves = rows.leaf_of(np.arange(len(rows))).tolist()
    mask = np.array([leaf != -1 for leaf in leaves])
    kept_mask = np.array([leaf != -1 and kept is not None and kept(leaf, p) for leaf, p in zip(leaves, got)])
    return plan_row_reads(rows, mask, kept=kept_mask, **limits)


def _volume(start, stop):
    return math.prod(b - a for a, b in zip(start, stop))


def test_split_box_covers_exactly_and_respects_limit():
    for shape, itemsize, limit in [((100, 30), 4, 1000), ((7, 5, 300), 2, 512), ((3, 10000), 8, 4096), ((), 4, 1)]:
        start, stop = (0,) * len(shape), shape
        parts = split_box(start, stop, itemsize, max_bytes=limit)
        covered = np.zeros(shape, dtype=int)
        for a, b in parts:
            assert _volume(a, b) * itemsize <= max(limit, itemsize)
            covered[tuple(slice(x, y) for x, y in zip(a, b))] += 1
        assert (covered == 1).all()


def test_split_box_parts_are_contiguous_runs_of_the_c_ordered_box():
    shape = (6, 4, 9)
    full = np.arange(math.prod(shape)).reshape(shape)
    flat_seen = []
    for a, b in split_box((0, 0, 0), shape, 4, max_bytes=4 * 7):
        block = full[tuple(slice(x, y) for x, y in zip(a, b))].ravel()
        assert (np.diff(block) == 1).all()  # contiguous in the C order of the box
        flat_seen.extend(block.tolist())
    assert flat_seen == list(range(full.size))


def test_plan_blobs_packs_small_and_splits_large():
    small = [OwnedPiece(i, (0,), (10,), 4) for i in range(100)]  # 40 bytes each
    large = OwnedPiece(100, (0, 0), (100, 100), 4)  # 40,000 bytes
    blobs = plan_blobs([*small, large], blob_size=4096, key=lambda s: f"b{s}")
    assert all(b.size <= 4096 + PACKING_SLACK for b in blobs)
    assert all(sum(p.piece.nbytes for p in b.pieces) <= 4096 for b in blobs)
    assert len({b.key for b in blobs}) == len(blobs)
    small_blobs = {b.key for b in blobs for p in b.pieces if p.piece.leaf < 100}
    assert len(small_blobs) <= 2  # 100 small pieces share one or two blobs
    total_large = sum(p.piece.nbytes for b in blobs for p in b.pieces if p.piece.leaf == 100)
    assert total_large == 40_000
    for b in blobs:  # no two pieces overlap inside a blob
        spans = sorted((p.offset, p.offset + p.piece.nbytes) for p in b.pieces)
        assert all(x[1] <= y[0] for x, y in itertools.pairwise(spans))


def test_spacers_do_not_cost_a_blob():
    """Four 8 MiB boxes fill one 32 MiB blob although their spacers add a few bytes."""
    boxes = [OwnedPiece(0, (i * 512, 0), ((i + 1) * 512, 4096), 4) for i in range(8)]  # 8 MiB each
    blobs = plan_blobs(boxes, blob_size=32 << 20, key=lambda s: f"b{s}")
    assert [len(b.pieces) for b in blobs] == [4, 4]
    assert all(32 << 20 < b.size <= (32 << 20) + PACKING_SLACK for b in blobs)
    # the whole blob's pieces are one read when they are kept (they become the arrays)
    pieces = [
        (0, Piece(p.piece.start, p.piece.stop, b.key, p.offset, p.piece.nbytes, 0)) for b in blobs for p in b.pieces
    ]
    reads = plan_reads(
        pieces,
        coalesce_gap=0,
        max_read_size=8 << 20,
        layout=[p for _, p in pieces],
        kept=lambda leaf, piece: True,
        max_kept_read_size=32 << 20,
    )
    assert len(reads) == 2


def test_blob_keys_are_hashed_and_unique():
    keys = {blob_key("abc", p, s) for p in range(4) for s in range(50)}
    assert len(keys) == 200
    assert len({k.split("/")[0] for k in keys}) > 50  # spread over many prefixes


def test_intersect():
    assert intersect((0, 0), (4, 4), (2, 2), (6, 6)) == ((2, 2), (4, 4))
    assert intersect((0, 0), (4, 4), (4, 0), (6, 4)) is None
    assert intersect((), (), (), ()) == ((), ())


def _piece(blob, offset, length):
    return Piece((0,), (length,), blob, offset, length, 0)


def _grid(shape, cuts):
    """Every box of ``shape`` cut at ``cuts`` (sorted inner cut points per axis)."""
    edges = [[0, *c, n] for c, n in zip(cuts, shape)]
    return [
        (tuple(e[k] for e, k in zip(edges, ks)), tuple(e[k + 1] for e, k in zip(edges, ks)))
        for ks in itertools.product(*(range(len(e) - 1) for e in edges))
    ]


def _brute_force(boxes, start, stop):
    return sorted((box, o) for box in boxes if (o := intersect(start, stop, *box)) is not None)


def test_box_index_finds_exactly_the_boxes_a_box_meets():
    """Against testing every box: grids (bisected) and boxes that are no grid (tested one by one)."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        ndim = int(rng.integers(0, 4))
        shape = tuple(int(n) for n in rng.integers(1, 12, ndim))
        cuts = [sorted({int(c) for c in rng.integers(1, n, rng.integers(0, 3))}) if n > 1 else [] for n in shape]
        boxes = _grid(shape, cuts)
        rng.shuffle(boxes)
        if rng.random() < 0.3 and len(boxes) > 1:
            boxes = boxes[: len(boxes) // 2]  # a subset, as read-once leaves: no longer a grid
        index = BoxIndex([tuple(map(tuple, b)) for b in boxes])
        for _ in range(10):
            a = tuple(int(rng.integers(0, n)) for n in shape)
            b = tuple(int(rng.integers(x + 1, n + 1)) for x, n in zip(a, shape))
            assert sorted(index.meeting(a, b)) == _brute_force(boxes, a, b)


def test_box_index_bisects_a_grid_and_tests_others_one_by_one():
    grid = _grid((8, 6), [[2, 4, 6], [3]])
    assert BoxIndex(grid)._axes == [([0, 2, 4, 6], [2, 4, 6, 8]), ([0, 3], [3, 6])]
    assert BoxIndex(grid).meeting((1, 2), (3, 4)) == [
        (((0, 0), (2, 3)), ((1, 2), (2, 3))),
        (((0, 3), (2, 6)), ((1, 3), (2, 4))),
        (((2, 0), (4, 3)), ((2, 2), (3, 3))),
        (((2, 3), (4, 6)), ((2, 3), (3, 4))),
    ]
    assert BoxIndex(grid[:-1])._axes is None  # a combination missing
    assert BoxIndex([((0,), (4,)), ((2,), (6,))])._axes is None  # overlapping intervals
    assert BoxIndex([((), ())]).meeting((), ()) == [(((), ()), ((), ()))]  # a scalar's one box
    assert BoxIndex([]).meeting((0,), (1,)) == []


def test_plan_reads_coalesces_adjacent_only_by_default():
    # a gap of 280 bytes: more than a spacer and its alignment, so not free bytes of the layout
    wanted = [(0, _piece("a", 0, 10)), (1, _piece("a", 10, 10)), (2, _piece("a", 300, 5)), (3, _piece("b", 0, 7))]
    reqs = plan_reads(wanted, coalesce_gap=0, max_read_size=1 << 20)
    spans = sorted((r.blob, r.start, r.end) for r in reqs)
    assert spans == [("a", 0, 20), ("a", 300, 305), ("b", 0, 7)]
    merged = plan_reads(wanted, coalesce_gap=280, max_read_size=1 << 20)
    assert sorted((r.blob, r.start, r.end) for r in merged) == [("a", 0, 305), ("b", 0, 7)]
    capped = plan_reads(wanted, coalesce_gap=280, max_read_size=15)
    assert all(r.length <= 15 for r in capped)
    for r in merged:
        for part in r.parts:
            assert r.start + part.offset == part.piece.offset


def test_large_pieces_are_saved_behind_a_spacer_small_ones_packed():
    small = [OwnedPiece(i, (0,), (10,), 4) for i in range(3)]
    large = [OwnedPiece(3 + i, (0,), (SPACED_MIN // 4 + i,), 4) for i in range(3)]
    blobs = plan_blobs([*small, *large], blob_size=64 << 20, key=lambda s: f"b{s}")
    placed = sorted(((p.offset, p.piece) for b in blobs for p in b.pieces), key=lambda x: x[0])
    assert all(offset % ALIGN == 0 for offset, _ in placed)
    previous_end = 0
    for offset, piece in placed:
        gap = offset - previous_end
        if previous_end == 0 or piece.nbytes >= SPACED_MIN:  # a blob's start, or a large piece
            assert gap >= SPACER  # room to start a read early without touching another piece
        else:
            assert gap < ALIGN  # small pieces stay packed
        previous_end = offset + piece.nbytes


def test_plan_reads_knows_free_bytes_from_the_layout():
    # blob "a": free [0, 64), p1 [64, 164), free, p2 [256, 356), foreign [356, 420), free, p3 [448, 548)
    p1, p2, foreign, p3 = _piece("a", 64, 100), _piece("a", 256, 100), _piece("a", 356, 64), _piece("a", 448, 100)
    layout = [p1, p2, foreign, p3]
    wanted = [(0, p1), (1, p2), (2, p3)]
    reqs = sorted(plan_reads(wanted, coalesce_gap=0, max_read_size=1 << 20, layout=layout), key=lambda r: r.start)
    # the free gap joins p1 and p2; the foreign piece (not wanted) keeps p3 apart
    assert [(r.start, r.end) for r in reqs] == [(64, 356), (448, 548)]
    assert [r.slack for r in reqs] == [64, 28]  # free bytes back to the blob start / the foreign piece's end


def test_reads_of_kept_pieces_grow_to_their_own_limit():
    """Pieces whose response becomes the arrays coalesce into larger reads; a copied piece caps its read."""
    wanted = [(leaf, _piece("a", 10 * leaf, 10)) for leaf in range(6)]
    kept = {0, 1, 2, 4, 5}  # leaf 3 is copied
    reqs = plan_reads(
        wanted, coalesce_gap=0, max_read_size=20, kept=lambda leaf, piece: leaf in kept, max_kept_read_size=30
    )
    spans = sorted((r.start, r.end) for r in reqs)
    # 0-2 kept: one 30-byte read; 3 (copied) may join only a read within 20 bytes; 4-5 kept again
    assert spans == [(0, 30), (30, 50), (50, 60)]
    assert sorted((r.start, r.end) for r in plan_reads(wanted, coalesce_gap=0, max_read_size=20)) == [
        (0, 20),
        (20, 40),
        (40, 60),
    ]


def test_room_left_by_large_pieces_is_filled_by_later_small_ones():
    """Shards a little over half a blob each (the medium model's embedding) leave room
    that the smaller pieces after them fill: 8 blobs, not 8 + 4 (next-fit)."""
    large = [OwnedPiece(0, (i * 4608, 0), ((i + 1) * 4608, 1024), 4) for i in range(8)]  # 18 MiB each
    small = [OwnedPiece(1 + i // 8, (i * 512, 0), ((i + 1) * 512, 1024), 4) for i in range(56)]  # 2 MiB each
    blobs = plan_blobs([*large, *small], blob_size=32 << 20, key=lambda s: f"b{s}")
    assert len(blobs) == 8
    assert all(sum(p.piece.nbytes for p in b.pieces) <= 32 << 20 for b in blobs)
    assert all(b.size <= (32 << 20) + PACKING_SLACK for b in blobs)
    placed = [(p.piece.leaf, p.piece.start) for b in blobs for p in b.pieces]
    assert sorted(placed) == sorted((p.leaf, p.start) for p in [*large, *small])  # each piece once
    for b in blobs:  # in a blob, pieces lie in the order they came, without overlap
        spans = [(p.offset, p.offset + p.piece.nbytes) for p in b.pieces]
        assert all(x[1] <= y[0] for x, y in itertools.pairwise(spans))


def test_only_the_last_open_blobs_take_pieces(monkeypatch):
    """A piece never goes back further than OPEN_BLOBS blobs (planning stays linear and a
    leaf's pieces stay near each other); with one open blob it is next-fit."""
    monkeypatch.setattr(plan_module, "OPEN_BLOBS", 1)
    large = [OwnedPiece(0, (i * 4608, 0), ((i + 1) * 4608, 1024), 4) for i in range(8)]
    small = [OwnedPiece(1, (i * 512, 0), ((i + 1) * 512, 1024), 4) for i in range(56)]
    blobs = plan_blobs([*large, *small], blob_size=32 << 20, key=lambda s: f"b{s}")
    assert len(blobs) == 12
    assert [len(b.pieces) for b in blobs[:7]] == [1] * 7
