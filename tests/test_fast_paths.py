"""Fast paths that stand in for a library's slower default: each still used, still exact."""

from __future__ import annotations

import os

import gcsfs.core
import pytest

from objckpt.transfer import runtime


def test_gcs_overwrites_send_the_buffer_as_the_body(gcs_store, monkeypatch):
    """Blob writes use a media upload, not gcsfs's multipart body (a copy of every byte)."""

    def refuse(*args, **kwargs):
        raise AssertionError("gcsfs simple_upload (multipart body) used for an overwrite")

    monkeypatch.setattr(gcsfs.core, "simple_upload", refuse)
    store = gcs_store.open()
    data = os.urandom((3 << 20) + 5)
    runtime.run_sync(store.put("0a/blob", memoryview(data)))
    assert runtime.run_sync(store.get("0a/blob")) == data
    with pytest.raises(AssertionError, match="simple_upload"):  # create-if-absent stays on pipe_file
        runtime.run_sync(store.put("manifest.json", b"{}", mode="create"))


def test_gcs_uploads_write_the_body_in_slices(gcs_store, monkeypatch):
    """aiohttp gets the body slice by slice, so it never joins (copies) a whole blob before sending."""
    import aiohttp.http_writer

    from objckpt.storage.http.gcs_upload import SLICE

    written: list[int] = []
    original = aiohttp.http_writer.StreamWriter.write

    async def recording_write(self, chunk, *args, **kwargs):
        written.append(len(chunk))
        return await original(self, chunk, *args, **kwargs)

    monkeypatch.setattr(aiohttp.http_writer.StreamWriter, "write", recording_write)
    store = gcs_store.open()
    data = os.urandom(3 * SLICE + 5)
    runtime.run_sync(store.put("0b/blob", memoryview(data)))
    assert max(written) <= SLICE and sum(written) >= len(data)
    assert runtime.run_sync(store.get("0b/blob")) == data
