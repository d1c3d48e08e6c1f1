"""Ranged GCS GETs streamed to a sink (``objckpt.storage.http.gcs``), on the GCS emulator.

``gs://`` opens with gcsfs by default; its stores stream copied reads with
the endpoint and the credential the store resolved when it opened, touching
no gcsfs internals.
"""

from __future__ import annotations

import sys
import uuid

import gcsfs.core
import jax
import numpy as np
import pytest
from helpers import random_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.errors import ObjectNotFoundError
from objckpt.storage import from_url
from objckpt.storage.fsspec.store import FsspecStore
from objckpt.storage.http.gcs import GCSRangeReader
from objckpt.storage.http.gcs_upload import MediaUploader
from objckpt.transfer import runtime

PAYLOAD = bytes(np.random.default_rng(6).integers(0, 256, 3 << 20, dtype=np.uint8))


class Collect:
    """A sink that asks for pieces of ``size`` bytes and keeps what it is handed."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.data = bytearray()

    def begin(self) -> None:
        self.data = bytearray()

    def next_size(self, offset: int, limit: int) -> int:
        return min(self.size, limit)

    def receive(self, offset: int, data: memoryview) -> None:
        assert offset == len(self.data)
        self.data += data


def test_gcs_stores_stream_ranges_and_name_missing_objects(gcs_service):
    store = from_url(gcs_service.url(f"stream-{uuid.uuid4().hex[:8]}"), **gcs_service.storage_options())
    assert store.streams_reads, "the GCS store should stream ranged reads"
    key = "dir/with space/blob+1"  # quoted in the request path
    runtime.run_sync(store.put(key, PAYLOAD))
    sink = Collect(300_001)
    n = runtime.run_sync(store.get_range_streamed(key, start=777, end=777 + (2 << 20), sink=sink))
    assert n == 2 << 20 and bytes(sink.data) == PAYLOAD[777 : 777 + (2 << 20)]
    tail = len(PAYLOAD) - 10
    sink = Collect(5)
    assert runtime.run_sync(store.get_range_streamed(key, start=tail, end=tail + 100, sink=sink)) == 10
    assert bytes(sink.data) == PAYLOAD[tail:]
    with pytest.raises(ObjectNotFoundError, match="nothing-here"):
        runtime.run_sync(store.get_range_streamed("nothing-here", start=0, end=10, sink=Collect(10)))


def test_resharded_restore_from_gcs_streams_bit_exact(gcs_store, monkeypatch):
    streamed: list[int] = []
    real = FsspecStore.get_range_streamed

    async def recording(self, key, *, start, end, sink):
        n = await real(self, key, start=start, end=end, sink=sink)
        streamed.append(n)
        return n

    monkeypatch.setattr(FsspecStore, "get_range_streamed", recording)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    values = random_array((512, 768), np.float32, 4)
    so = gcs_store.storage_options
    objckpt.save(gcs_store.url, {"w": jax.device_put(values, NamedSharding(mesh, P("x", "y")))}, storage_options=so)
    other = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))
    target = {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=other)}
    out = objckpt.restore(gcs_store.url, target, storage_options=so)
    assert np.asarray(out["w"]).tobytes() == values.tobytes()
    assert sum(streamed) >= values.nbytes


def test_requester_pays_keeps_gcsfs_reads_and_writes(gcs_service):
    url = gcs_service.url(f"pays-{uuid.uuid4().hex[:8]}")
    assert from_url(url, **gcs_service.storage_options()).streams_reads
    paying = from_url(url, **gcs_service.storage_options(), requester_pays="my-project")
    assert not paying.streams_reads and paying._uploader is None  # the billed project rides on gcsfs's requests


#: gcsfs internals the fast paths once read: objckpt code must not touch them.
_GCSFS_INTERNALS = frozenset({"_call", "_location", "credentials", "_get_headers", "session", "_session", "_parent"})


class _SealedGCSFileSystem(gcsfs.core.GCSFileSystem):
    """gcsfs whose internals raise AttributeError when objckpt's code reads them (gcsfs's own code still can)."""

    def __getattribute__(self, name: str):
        if name in _GCSFS_INTERNALS and sys._getframe(1).f_globals.get("__name__", "").startswith("objckpt"):
            raise AttributeError(f"objckpt read gcsfs's internal {name!r}")
        return super().__getattribute__(name)


def test_fast_paths_use_no_gcsfs_internals(gcs_store, monkeypatch):
    """A save and a resharded restore through gcsfs that hides its internals from objckpt:
    every blob is a media upload and every copied read streams."""
    monkeypatch.setattr(gcsfs.core, "GCSFileSystem", _SealedGCSFileSystem)
    uploads: list[int] = []
    streamed: list[int] = []
    real_upload, real_read = MediaUploader.upload, GCSRangeReader.read_streamed

    async def upload(self, bucket, name, data, what):
        uploads.append(memoryview(data).nbytes)
        await real_upload(self, bucket, name, data, what)

    async def read_streamed(self, path, start, length, sink, what):
        streamed.append(n := await real_read(self, path, start, length, sink, what))
        return n

    monkeypatch.setattr(MediaUploader, "upload", upload)
    monkeypatch.setattr(GCSRangeReader, "read_streamed", read_streamed)
    assert isinstance(gcs_store.open().fs, _SealedGCSFileSystem)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    values = random_array((512, 512), np.float32, 8)
    so = gcs_store.storage_options
    objckpt.save(gcs_store.url, {"w": jax.device_put(values, NamedSharding(mesh, P("x", "y")))}, storage_options=so)
    other = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))
    target = {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=other)}
    out = objckpt.restore(gcs_store.url, target, storage_options=so)
    assert np.asarray(out["w"]).tobytes() == values.tobytes()
    assert sum(uploads) >= values.nbytes and sum(streamed) >= values.nbytes


def test_gcs_error_reasons_and_request_paths():
    reader = GCSRangeReader(endpoint="http://127.0.0.1:4443", bucket=None)
    body = b'{"error": {"code": 429, "message": "slow down", "errors": [{"reason": "rateLimitExceeded"}]}}'
    assert reader._error_code(body) == "rateLimitExceeded"
    assert reader._error_code(b"<html>oops</html>") == ""
    assert reader._request_path("bkt/a b/c?d") == "/download/storage/v1/b/bkt/o/a%20b/c%3Fd?alt=media"
    asked: list[int] = []

    class Token:
        def headers(self) -> dict[str, str]:
            asked.append(1)
            return {"authorization": "Bearer not-a-real-token"}

    signed = GCSRangeReader(endpoint="https://storage.googleapis.com", bucket="b", credentials=Token())
    headers = signed._authorize("/download/storage/v1/b/b/o/x?alt=media", {"range": "bytes=0-9"})
    assert headers["authorization"] == "Bearer not-a-real-token" and headers["host"] == "storage.googleapis.com"
    assert headers["range"] == "bytes=0-9" and asked == [1]  # asked on every request: it refreshes when due
    assert "not-a-real-token" not in repr(signed)
