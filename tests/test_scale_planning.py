"""Planning at pod scale, checked small (issue 80 item 1): what a 1T-class state's save writes,
a restore and a verify read back."""

from __future__ import annotations

import numpy as np
import pytest

import objckpt
from objckpt.core.format import index3_bounds
from objckpt.options import Options

MiB = 1 << 20


@pytest.mark.s3
def test_pieces_cut_inside_a_larger_blob_stay_within_the_row_budget(s3_store, monkeypatch):
    """A save cuts pieces at ``blob_size`` inside blobs up to ``max_blob_size`` (a 1T-class state's
    shards of a layer stack are several cuts in one blob): a restore and a verify read them back.
    With no floor (``ROW_FLOOR`` 0), one 4 MiB leaf on one device is 4 rows in one blob, over one
    per leaf and device and one per blob; the budget's row per MiB of blobs takes them."""
    monkeypatch.setattr(index3_bounds, "ROW_FLOOR", 0)
    url = f"{s3_store.url}/cut"
    tree = {"w": np.arange(MiB, dtype=np.float32).reshape(1024, 1024)}
    options = Options(blob_size=MiB, max_blob_size=8 * MiB, blobs_per_save=1)
    objckpt.save(url, tree, storage_options=s3_store.storage_options, options=options)
    restored = objckpt.restore(url, storage_options=s3_store.storage_options)
    np.testing.assert_array_equal(restored["w"], tree["w"])
    assert objckpt.verify(url, storage_options=s3_store.storage_options).ok


def _cuts(size: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, size)) for a in range(0, size, step)]


@pytest.mark.parametrize(
    ("saved", "target", "keep"),
    [
        ((8, 64), (64, 64), lambda r, c: r % 2 == 0),  # every piece inside one box, boxes with gaps
        ((8, 64), (128, 32), lambda r, c: r in (0, 2) and c in (0, 2)),  # pieces cut by boxes, gaps
        ((48, 20), (64, 64), lambda r, c: True),  # uneven cuts: pieces inside, across and past boxes
        ((8, 256), (64, 64), lambda r, c: r < 2),  # each piece across 4 boxes
    ],
)
def test_pieces_met_at_once_with_a_grid_of_boxes_as_one_by_one(monkeypatch, saved, target, keep):
    """A pod's inference host meets ~16,000 pieces a leaf with its boxes in numpy
    (``leaf_plan._inside``); the meeting equals the one found piece by piece (BoxIndex.meeting)."""
    from objckpt.restoring import leaf_plan

    shape = (512, 256)
    pieces = [((r0, c0), (r1, c1)) for r0, r1 in _cuts(shape[0], saved[0]) for c0, c1 in _cuts(shape[1], saved[1])]
    pieces += pieces[:3]  # a box listed twice: an overlap that coverage must find either way
    rows, cols = _cuts(shape[0], target[0]), _cuts(shape[1], target[1])
    boxes = tuple(
        ((r0, c0), (r1, c1)) for i, (r0, r1) in enumerate(rows) for j, (c0, c1) in enumerate(cols) if keep(i, j)
    )
    at_once = leaf_plan._Meeting(boxes, tuple(pieces))
    monkeypatch.setattr(leaf_plan, "_inside", lambda index, geometry: None)
    one_by_one = leaf_plan._Meeting(boxes, tuple(pieces))
    assert len(pieces) >= 64 and at_once.positions
    assert at_once.positions == one_by_one.positions
    assert at_once.meets == one_by_one.meets
    assert at_once.counts == one_by_one.counts
    assert at_once.uncovered == one_by_one.uncovered is not None
    assert at_once.assembled == one_by_one.assembled
    unique = leaf_plan._Meeting(boxes, tuple(pieces[:-3]))
    assert unique.uncovered is None and unique.meets == at_once.meets
