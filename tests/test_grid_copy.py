"""A small leaf copied from its saved pieces into its target boxes in one go (``objckpt.grid_copy``).

Unit tests build pieces laid out as a blob holds them (in grid order, at a
padded spacing) and boxes cut from one buffer, and compare with numpy slicing;
the restore tests check that a restore onto another sharding takes this path
for every small leaf, from the real S3 server and from a streamed memory store.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from helpers import assert_tree_bit_exact, random_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_stream_scatter import streamed_stores

import objckpt
import objckpt.grid_copy as grid_copy
from objckpt._memory import aligned_arrays
from objckpt.grid_copy import grid_of, plan_copy


def _grid_boxes(shape, splits):
    cell = [n // s for n, s in zip(shape, splits)]
    boxes = []
    for index in itertools.product(*(range(s) for s in splits)):
        start = tuple(i * c for i, c in zip(index, cell))
        boxes.append((start, tuple(a + c for a, c in zip(start, cell))))
    return boxes


def _slices(box):
    return tuple(slice(a, b) for a, b in zip(*box))


def _blob(full, pieces, pad):
    """The pieces' bytes one after another, ``pad`` bytes apart, as a 1-D array of full's dtype."""
    itemsize = full.dtype.itemsize
    step = full[_slices(pieces.boxes[0])].nbytes + pad
    blob = np.zeros((step * len(pieces.boxes)) // itemsize + 1, full.dtype)
    for k, box in enumerate(pieces.boxes):
        flat = full[_slices(box)].ravel()
        blob[k * step // itemsize : k * step // itemsize + flat.size] = flat
    return blob, step


@pytest.mark.parametrize(
    "shape, saved, target",
    [
        ((160, 480), (4, 2), (2, 4)),  # the benchmark's small model: each piece meets two boxes
        ((8, 12, 6), (2, 3, 1), (4, 1, 2)),  # finer, coarser and equal along different axes
        ((16,), (4,), (2,)),
        ((16,), (2,), (8,)),
        ((6, 4), (1, 1), (3, 2)),  # one piece into several boxes
        ((6, 4), (3, 2), (1, 1)),  # several pieces into one box (a host numpy array)
        ((12, 10), (2, 2), (2, 2)),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.float64])
def test_one_strided_copy_matches_slicing(shape, saved, target, dtype):
    full = random_array(shape, dtype, 7)
    pieces = grid_of(shape, _grid_boxes(shape, saved)[::-1])  # in any order: the grid sorts them
    boxes = grid_of(shape, _grid_boxes(shape, target))
    assert pieces is not None and boxes is not None
    shapes = [tuple(b - a for a, b in zip(*box)) for box in boxes.boxes]
    buffers = dict(zip(boxes.boxes, aligned_arrays(shapes, np.dtype(dtype))))
    copy = plan_copy(shape, pieces, boxes, buffers)
    assert copy is not None
    blob, step = _blob(full, pieces, pad=24 * np.dtype(dtype).itemsize)
    copy.copy(blob, step)
    for box in boxes.boxes:
        np.testing.assert_array_equal(buffers[box], full[_slices(box)])


def test_boxes_that_do_not_tile_a_grid_have_none():
    assert grid_of((8, 8), [((0, 0), (4, 8)), ((4, 0), (8, 8))]) is not None
    assert grid_of((8, 8), [((0, 0), (3, 8)), ((3, 0), (8, 8))]) is None  # unequal
    assert grid_of((8, 8), [((0, 0), (4, 8))]) is None  # half the leaf (another process has the rest)
    assert grid_of((8, 8), [((0, 0), (4, 8)), ((0, 0), (4, 8))]) is None  # the same box twice
    assert grid_of((0, 8), [((0, 0), (0, 8))]) is None  # no elements
    assert grid_of((9,), _grid_boxes((9,), (3,))) is not None


def test_counts_that_do_not_divide_or_buffers_unevenly_spaced_have_no_plan():
    shape = (12, 8)
    pieces = grid_of(shape, _grid_boxes(shape, (3, 1)))
    boxes = grid_of(shape, _grid_boxes(shape, (2, 1)))
    buffers = dict(zip(boxes.boxes, aligned_arrays([(6, 8)] * 2, np.dtype(np.float32))))
    assert plan_copy(shape, pieces, boxes, buffers) is None  # 3 and 2 parts
    pieces = grid_of(shape, _grid_boxes(shape, (4, 1)))
    assert plan_copy(shape, pieces, boxes, buffers) is not None
    boxes = grid_of(shape, _grid_boxes(shape, (4, 1)))
    memory = np.zeros(1024, np.uint8)
    even = {
        box: memory[at : at + 96].view(np.float32).reshape(3, 8) for box, at in zip(boxes.boxes, (0, 128, 256, 384))
    }
    assert plan_copy(shape, pieces, boxes, even) is not None
    uneven = {
        box: memory[at : at + 96].view(np.float32).reshape(3, 8) for box, at in zip(boxes.boxes, (0, 128, 320, 448))
    }
    assert plan_copy(shape, pieces, boxes, uneven) is None


def _small_leaves():
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    tree = {
        f"w{i:02d}": jax.device_put(
            random_array((8 * (1 + i % 3), 48), np.float32, 40 + i), NamedSharding(mesh, P("x", "y"))
        )
        for i in range(12)
    }
    tree["bias"] = jax.device_put(random_array((48,), np.float32, 9), NamedSharding(mesh, P()))
    return tree


def _counting(monkeypatch) -> list[int]:
    copies: list[int] = []
    real = grid_copy.LeafCopy.copy

    def counting(self, data, piece_step):
        copies.append(piece_step)
        return real(self, data, piece_step)

    monkeypatch.setattr(grid_copy.LeafCopy, "copy", counting)
    return copies


@pytest.mark.parametrize("where", ["s3", "memory"])
def test_a_resharded_restore_copies_each_small_leaf_once(where, s3_store, memory_store, monkeypatch):
    """Every 2-D leaf goes onto the (2, 4) mesh in one copy, bit-exact; a host numpy
    restore (every piece into one box) the same way."""
    if where == "memory":
        streamed_stores(monkeypatch)
    url = s3_store.url if where == "s3" else memory_store.url
    options = s3_store.storage_options if where == "s3" else None
    tree = _small_leaves()
    objckpt.save(url, tree, storage_options=options)
    copies = _counting(monkeypatch)
    other = jax.make_mesh((2, 4), ("a", "b"))
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(other, P("a", "b") if v.ndim == 2 else P()))
        for k, v in tree.items()
    }
    out = objckpt.restore(url, target, storage_options=options)
    assert_tree_bit_exact(tree, out)
    assert len(copies) == 12, f"{len(copies)} of 12 leaves copied whole"
    assert all(step % 64 == 0 for step in copies)  # pieces start on the blob's alignment
    copies.clear()
    host = objckpt.restore(url, storage_options=options)
    for k, v in tree.items():
        np.testing.assert_array_equal(host[k], np.asarray(v))
    if where == "s3":  # a buffered memory store reads whole pieces that are whole boxes as they are
        assert len(copies) == 12
