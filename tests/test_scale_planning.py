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
