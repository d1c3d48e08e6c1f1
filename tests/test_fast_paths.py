"""Fast paths that stand in for a library's slower default: each still used, still exact."""

from __future__ import annotations

import os

import gcsfs.core
import pytest

from objckpt import _runtime


def test_gcs_overwrites_send_the_buffer_as_the_body(gcs_store, monkeypatch):
    """Blob writes use a media upload, not gcsfs's multipart body (a copy of every byte)."""

    def refuse(*args, **kwargs):
        raise AssertionError("gcsfs simple_upload (multipart body) used for an overwrite")

    monkeypatch.setattr(gcsfs.core, "simple_upload", refuse)
    store = gcs_store.open()
    data = os.urandom((3 << 20) + 5)
    _runtime.run_sync(store.put("0a/blob", memoryview(data)))
    assert _runtime.run_sync(store.get("0a/blob")) == data
    with pytest.raises(AssertionError, match="simple_upload"):  # create-if-absent stays on pipe_file
        _runtime.run_sync(store.put("manifest.json", b"{}", mode="create"))
