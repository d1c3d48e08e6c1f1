"""Restore planning is paid once per kind of leaf, not once per leaf (issue 54: pod-scale parse + plan).

A layer stack's leaves share their sharding, shape and pieces' geometry; only
their blobs and offsets differ. These tests count (never time) the work that
must not repeat across such leaves: JAX's device map per sharding, meeting a
piece with the boxes, the coverage check, and the writers of a box under a grid.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from objckpt.core import boxes as boxes_module
from objckpt.core.format import LeafEntry
from objckpt.core.format.rows import Rows, rows_from_pieces
from objckpt.core.pieces import Piece
from objckpt.core.plan import BoxIndex
from objckpt.core.writer_rule import Grid, Mesh
from objckpt.restoring import leaf_plan
from objckpt.restoring.leaf_plan import LeafPlan

F32 = np.dtype(np.float32)
BOXES = {((0, 0), (4, 6)): ["dev0"], ((4, 0), (8, 6)): ["dev1"]}


def _cells(k: int, hole: bool) -> tuple[Piece, ...]:
    cells = [((r, c), (r + 4, c + 3)) for r in (0, 4) for c in (0, 3)]
    if hole:
        cells.pop()
    return tuple(Piece(a, b, f"b{k}", 64 + 64 * n, 48, n + k) for n, (a, b) in enumerate(cells))


@functools.cache
def _stack() -> Rows:
    """The pieces of 50 leaves of a stack, and of the same leaves with a hole (leaf 100 + k), as
    the rows of one checkpoint (what a restore plans from)."""
    return rows_from_pieces(
        [(k, _cells(k, False), 4) for k in range(50)] + [(100 + k, _cells(k, True), 4) for k in range(50)]
    )


def _layer(k: int, *, hole: bool = False) -> LeafEntry:
    """Leaf ``k`` of a stack: 2 × 2 cells of (4, 3) in blob ``b{k}`` (``hole``: its last cell missing)."""
    return LeafEntry(f"['layers'][{k}]", "array", "float32", (8, 6), _stack().leaf(100 + k if hole else k))


def test_leaves_sharing_boxes_and_piece_geometry_meet_them_once(monkeypatch):
    calls = []
    meeting = BoxIndex._meeting

    def counted(self, start, stop):
        calls.append((start, stop))
        return meeting(self, start, stop)

    monkeypatch.setattr(BoxIndex, "_meeting", counted)
    leaf_plan._box_index.cache_clear()  # other tests plan the same boxes
    leaf_plan.clear_planning_caches()
    plans = [LeafPlan(_layer(k), F32, F32, "a sharding", BOXES) for k in range(50)]
    for k, plan in enumerate(plans):
        assert [p.blob for p in plan.pieces] == [f"b{k}"] * 4  # each leaf keeps its own pieces
        assert plan.box_pieces == {box: 2 for box in BOXES}
        assert plan.uncovered() is None
    assert len(calls) == 4  # once per piece geometry, not once per leaf (200)
    assert plans[0].meets is plans[49].meets
    assert plans[0].assembled == plans[49].assembled == list(BOXES)  # each box from two pieces


def test_a_shared_answer_still_tells_leaves_with_other_geometry_apart():
    whole = LeafPlan(_layer(0), F32, F32, "a sharding", BOXES)
    holed = LeafPlan(_layer(1, hole=True), F32, F32, "a sharding", BOXES)
    assert whole.uncovered() is None
    assert holed.uncovered() == ((4, 0), (8, 6))
    assert holed.box_pieces == {((0, 0), (4, 6)): 2, ((4, 0), (8, 6)): 1}


def test_needed_boxes_maps_a_sharding_once(monkeypatch):
    calls = []
    real = boxes_module._boxes_of

    def counted(sharding, shape, devices):
        calls.append(shape)
        return real(sharding, shape, devices)

    monkeypatch.setattr(boxes_module, "_boxes_of", counted)
    boxes_module._needed_boxes.cache_clear()
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices).reshape(len(devices), 1), ("x", "y"))
    sharding = NamedSharding(mesh, P("x"))
    mine = frozenset(devices[:1])
    first = boxes_module.needed_boxes(sharding, (8 * len(devices), 4), mine)
    for _ in range(20):
        again = boxes_module.needed_boxes(sharding, (8 * len(devices), 4), mine)
        assert again == first and again is not first  # a new dict each call: callers own it
    assert len(calls) == 1
    boxes_module.needed_boxes(sharding, (16 * len(devices), 4), mine)  # another shape: mapped again
    assert len(calls) == 2


def test_grid_writers_of_a_box_are_found_once_per_geometry_unless_replicated(monkeypatch):
    mesh = Mesh((("fsdp", 4), ("tensor", 2)), tuple(range(8)), (0, 0, 1, 1, 2, 2, 3, 3))
    calls = []
    writers = Grid.writers

    def counted(self, cell):
        calls.append(cell)
        return writers(self, cell)

    monkeypatch.setattr(Grid, "writers", counted)
    sharded = [Grid(mesh, (("fsdp",), ("tensor",)), (8, 4), 4, leaf, 1 << 20) for leaf in range(30)]
    found = [g.processes_for((2, 0), (6, 4)) for g in sharded]
    assert found == [{1, 2}] * 30
    assert len(calls) == 4  # the 2 × 2 cells met, for the first leaf only
    calls.clear()
    replicated = [Grid(mesh, ((), ()), (8, 4), 4, leaf, 1 << 20) for leaf in range(30)]
    found = [g.processes_for((0, 0), (8, 4)) for g in replicated]
    assert len(calls) == 30  # a replicated cell's writer rotates with the leaf: asked each time
    assert len({frozenset(f) for f in found}) > 1
