"""Ranged GCS GETs streamed to a sink (``objckpt.storage.gcs_stream``), on the GCS emulator.

``gs://`` opens with gcsfs by default; its stores stream copied reads with
gcsfs's endpoint and credentials.
"""

from __future__ import annotations

import uuid

import jax
import numpy as np
import pytest
from helpers import random_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.errors import ObjectNotFoundError
from objckpt.storage import from_url
from objckpt.storage.fsspec_store import FsspecStore
from objckpt.storage.gcs_stream import GCSRangeReader, gcsfs_range_reader
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


def test_requester_pays_keeps_gcsfs_reads():
    class FakeGcsfs:
        _location = "https://storage.googleapis.com"
        credentials = None
        requester_pays = False

    assert isinstance(gcsfs_range_reader(FakeGcsfs(), 5), GCSRangeReader)
    paying = FakeGcsfs()
    paying.requester_pays = "my-project"
    assert gcsfs_range_reader(paying, 5) is None


def test_gcs_error_reasons_and_request_paths():
    reader = GCSRangeReader(endpoint="http://127.0.0.1:4443", bucket=None)
    body = b'{"error": {"code": 429, "message": "slow down", "errors": [{"reason": "rateLimitExceeded"}]}}'
    assert reader._error_code(body) == "rateLimitExceeded"
    assert reader._error_code(b"<html>oops</html>") == ""
    assert reader._request_path("bkt/a b/c?d") == "/download/storage/v1/b/bkt/o/a%20b/c%3Fd?alt=media"
    applied: list[dict[str, str]] = []

    class Token:
        def apply(self, out):
            out["authorization"] = "Bearer not-a-real-token"
            applied.append(out)

    signed = GCSRangeReader(endpoint="https://storage.googleapis.com", bucket="b", credentials=Token())
    headers = signed._authorize("/download/storage/v1/b/b/o/x?alt=media", {"range": "bytes=0-9"})
    assert headers["authorization"].startswith("Bearer ") and headers["host"] == "storage.googleapis.com"
    assert "not-a-real-token" not in repr(signed)
