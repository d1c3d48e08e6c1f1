"""Copy a whole small leaf from its saved pieces into its target boxes in one numpy call.

A restore onto another sharding cuts every saved piece into the target boxes it
meets: on a small model (~300 leaves, 1,326 pieces, each meeting two boxes)
that is ~2,600 numpy assignments of a few KiB, each with its slice tuples, and
the Python around them, which is most of what it spends beyond a same-sharding
restore. But a leaf saved over a mesh is a regular grid of equal pieces, laid
one after another at a fixed spacing in its blob, and its target boxes are a
regular grid of equal buffers, cut one after another from one allocation.
Both are then strided views of the same logical array, and a single
``np.copyto`` between them moves the whole leaf.

How: along each axis the saved and the target grids cut the axis into ``s``
and ``t`` equal parts. When one count divides the other, the axis is split
into three: ``min(s, t)`` blocks, ``max(s, t) / min(s, t)`` parts of each, and
the elements of a part. Each grid places each of those at a fixed byte
stride, so both sides are plain strided arrays of the same shape. Anything
else (uneven parts, counts that do not divide, pieces out of order in the
blob, buffers not evenly spaced) is left to the piece-by-piece path.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from objckpt.arrays import Box


@dataclass(frozen=True)
class Grid:
    """A leaf cut into equal boxes, ``splits[d]`` of them along axis ``d``."""

    splits: tuple[int, ...]
    cell: tuple[int, ...]  # the shape of every box
    boxes: tuple[Box, ...]  # in C order of their grid position


def grid_of(shape: tuple[int, ...], boxes: list[Box]) -> Grid | None:
    """The regular grid ``boxes`` form over an array of ``shape``; None if they do not
    tile it as one (unequal or missing boxes, or boxes with no elements)."""
    if not boxes or not shape or 0 in shape:
        return None
    first_start, first_stop = boxes[0]
    cell = tuple(b - a for a, b in zip(first_start, first_stop))
    if 0 in cell or any(n % c for n, c in zip(shape, cell)):
        return None
    splits = tuple(n // c for n, c in zip(shape, cell))
    if len(boxes) != math.prod(splits):
        return None
    ordered = sorted(boxes)
    expected = itertools.product(*(range(0, n, c) for n, c in zip(shape, cell)))
    for (start, stop), corner in zip(ordered, expected):
        if start != corner or any(b - a != c for a, b, c in zip(start, stop, cell)):
            return None
    return Grid(splits, cell, tuple(ordered))


@dataclass(frozen=True)
class LeafCopy:
    """The strided views that move a whole leaf from its pieces to its boxes in one copy.

    Built once per leaf (:func:`plan_copy`). The target side is fixed (the
    boxes' buffers); the source side depends on where a read put the pieces,
    so each of its strides is kept as so many pieces' spacings plus so many
    elements.
    """

    pieces: Grid  # the saved grid, in the order the pieces must lie in the blob
    shape: tuple[int, ...]  # of both views: three axes per axis of the leaf
    in_pieces: tuple[int, ...]  # per view axis: pieces' spacings in its stride
    in_elements: tuple[int, ...]  # per view axis: elements in its stride
    target: np.ndarray  # the boxes' buffers seen as one array of ``shape``

    def copy(self, data: np.ndarray, piece_step: int) -> None:
        """Copy the leaf out of ``data`` (a 1-D array of the leaf's dtype starting at the
        first piece's first element, each next piece ``piece_step`` bytes further on)."""
        itemsize = data.itemsize
        strides = tuple(p * piece_step + e * itemsize for p, e in zip(self.in_pieces, self.in_elements))
        np.copyto(self.target, np.lib.stride_tricks.as_strided(data, self.shape, strides, writeable=False))


def plan_copy(shape: tuple[int, ...], pieces: Grid, boxes: Grid, buffers: dict[Box, np.ndarray]) -> LeafCopy | None:
    """A :class:`LeafCopy` into ``buffers`` (one per box of ``boxes``), or None when
    the two grids or the buffers' layout do not allow one strided copy."""
    first = buffers[boxes.boxes[0]]
    itemsize = first.itemsize
    if any(not buffers[box].flags.c_contiguous for box in boxes.boxes):
        return None
    addresses = [buffers[box].ctypes.data for box in boxes.boxes]
    box_step = addresses[1] - addresses[0] if len(addresses) > 1 else 0
    if any(a != addresses[0] + k * box_step for k, a in enumerate(addresses)):
        return None
    view_shape: list[int] = []
    in_pieces: list[int] = []
    in_elements: list[int] = []
    target: list[int] = []
    for d, n in enumerate(shape):
        s, t = pieces.splits[d], boxes.splits[d]
        if max(s, t) % min(s, t):
            return None
        blocks, parts = min(s, t), max(s, t) // min(s, t)
        elements = n // (blocks * parts)
        piece_next = math.prod(pieces.splits[d + 1 :])  # pieces from one to the next along d
        piece_row = math.prod(pieces.cell[d + 1 :])  # elements from one to the next inside a piece
        box_next = math.prod(boxes.splits[d + 1 :]) * box_step
        box_row = math.prod(boxes.cell[d + 1 :]) * itemsize
        view_shape += [blocks, parts, elements]
        if s >= t:  # each part is a piece of its own
            in_pieces += [parts * piece_next, piece_next, 0]
            in_elements += [0, 0, piece_row]
        else:  # a piece holds ``parts`` parts
            in_pieces += [piece_next, 0, 0]
            in_elements += [0, elements * piece_row, piece_row]
        target += [parts * box_next, box_next, box_row] if t >= s else [box_next, elements * box_row, box_row]
    view = np.lib.stride_tricks.as_strided(first, tuple(view_shape), tuple(target))
    return LeafCopy(pieces, tuple(view_shape), tuple(in_pieces), tuple(in_elements), view)
