"""Ranged S3 GETs streamed to a sink (``objckpt.storage.http.s3``).

Each GET is presigned by obstore; the reader is checked against the real S3
server (SeaweedFS verifies every signature), and through the fault proxy for
throttling, stalls and late bytes after a caller gave up.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from obstore.store import S3Store

import objckpt
from backends.proxy import FaultProxy
from objckpt.errors import ObjectNotFoundError, StorePermissionError, TransientStoreError
from objckpt.storage import from_url
from objckpt.storage.http.s3 import S3RangeReader
from objckpt.transfer import runtime

PAYLOAD = bytes(np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8))


@pytest.mark.parametrize("key", ["ckpt/ab12/blob-0001.bin", "odd keys/with space+plus=eq~tilde"])
def test_reads_are_presigned_by_obstore_and_verified_by_the_server(s3_service, key):
    """Every streamed GET carries obstore's query-string signature (objckpt signs
    nothing itself); SeaweedFS checks it, odd characters in keys included."""
    store = _store(s3_service)
    runtime.run_sync(store.put(key, PAYLOAD))
    reader = store._range_reader
    target = reader._request_path(store._path(key))
    assert "X-Amz-Signature=" in target and f"X-Amz-Credential={s3_service.access_key}" in target
    assert "authorization" not in {k.lower() for k in reader._authorize(target, {})}
    assert _stream(store, key, 100, 200) == PAYLOAD[100:200]


def test_unsigned_reads_for_anonymous_stores(s3_service):
    store = _store(s3_service, anon=True)
    target = store._range_reader._request_path("some/key")
    assert "X-Amz-" not in target


def _store(s3_service, **options):
    merged = {**copy.deepcopy(s3_service.storage_options()), **options}
    store = from_url(s3_service.url(f"stream-{uuid.uuid4().hex[:8]}"), **merged)
    assert store.streams_reads, "the S3 store should stream ranged reads"
    return store


class Collect:
    """A sink that asks for pieces of ``size`` bytes and keeps what it is handed."""

    def __init__(self, size: int = 1000) -> None:
        self.size = size
        self.data = bytearray()
        self.begins = 0
        self.calls: list[float] = []

    def begin(self) -> None:
        self.begins += 1
        self.data = bytearray()

    def next_size(self, offset: int, limit: int) -> int:
        assert offset == len(self.data), "pieces must come in order"
        return min(self.size, limit)

    def receive(self, offset: int, data: memoryview) -> None:
        self.calls.append(time.monotonic())
        self.data += data


def _stream(store, key, start, end, size=1000):
    sink = Collect(size)
    n = runtime.run_sync(store.get_range_streamed(key, start=start, end=end, sink=sink))
    assert n == len(sink.data)
    return bytes(sink.data)


def test_streams_ranges_in_the_pieces_the_sink_asks_for(s3_service):
    store = _store(s3_service)
    runtime.run_sync(store.put("blob", PAYLOAD))
    sink = Collect(333_333)  # odd: pieces end mid-packet
    n = runtime.run_sync(store.get_range_streamed("blob", start=12345, end=12345 + (1 << 20), sink=sink))
    assert n == 1 << 20 and bytes(sink.data) == PAYLOAD[12345 : 12345 + (1 << 20)]
    assert len(sink.calls) == 4 and sink.begins == 1
    # the object ends first: only the whole pieces that arrived are handed over
    tail = len(PAYLOAD) - 1000
    assert _stream(store, "blob", tail, tail + 5000, size=100) == PAYLOAD[tail:]
    assert _stream(store, "blob", tail, tail + 5000, size=600) == PAYLOAD[tail : tail + 600]
    assert _stream(store, "blob", len(PAYLOAD) + 5, len(PAYLOAD) + 100) == b""
    # many reads in parallel over the kept connections agree with the payload
    starts = list(range(0, len(PAYLOAD) - 4096, 97_001))

    async def all_reads():
        sinks = [Collect(1024) for _ in starts]
        await asyncio.gather(
            *(store.get_range_streamed("blob", start=s, end=s + 4096, sink=k) for s, k in zip(starts, sinks))
        )
        return sinks

    for s, k in zip(starts, runtime.run_sync(all_reads())):
        assert bytes(k.data) == PAYLOAD[s : s + 4096]


def test_a_sink_that_raises_stops_the_read_with_its_error(s3_service):
    store = _store(s3_service)
    runtime.run_sync(store.put("blob", PAYLOAD))

    class Refuses(Collect):
        def receive(self, offset, data):
            if offset >= 2000:
                raise objckpt.IntegrityError("checksum mismatch in leaf w")
            super().receive(offset, data)

    sink = Refuses(1000)
    with pytest.raises(objckpt.IntegrityError, match="leaf w"):
        runtime.run_sync(store.get_range_streamed("blob", start=0, end=1 << 20, sink=sink))
    assert len(sink.data) == 2000
    assert _stream(store, "blob", 0, 3000) == PAYLOAD[:3000]  # the thread's next read is clean


def test_missing_objects_and_bad_credentials_are_named(s3_service):
    store = _store(s3_service)
    with pytest.raises(ObjectNotFoundError, match="nothing-here"):
        _stream(store, "nothing-here", 0, 16)
    runtime.run_sync(store.put("blob", PAYLOAD))
    wrong = _store(s3_service, secret="not-the-secret-key")
    with pytest.raises(StorePermissionError) as info:
        _stream(wrong, "blob", 0, 16)
    assert "not-the-secret-key" not in str(info.value) and s3_service.secret_key not in str(info.value)
    assert "s3://" in str(info.value)


@pytest.fixture
def proxy(s3_service):
    host, port = s3_service.endpoint_url.rsplit("//", 1)[1].split(":")
    with FaultProxy(host, int(port), stall_seconds=20, seed=3) as running:
        yield running


def _proxied(s3_service, proxy, **options):
    merged = copy.deepcopy(s3_service.storage_options())
    merged["client_kwargs"]["endpoint_url"] = proxy.endpoint_url
    return _store(s3_service, **{**merged, **options})


def test_throttling_is_transient_and_named(s3_service, proxy):
    store = _proxied(s3_service, proxy)
    runtime.run_sync(store.put("blob", PAYLOAD))
    proxy.set_faults(1.0, ("503",))
    with pytest.raises(TransientStoreError, match="SlowDown") as info:
        _stream(store, "blob", 0, 100)
    assert "blob" in str(info.value)
    proxy.set_faults(1.0, ("reset", "truncate"))
    with pytest.raises(TransientStoreError):
        _stream(store, "blob", 0, 1 << 20, size=1 << 16)
    proxy.set_faults(0.0)
    assert _stream(store, "blob", 7, 7 + (1 << 20), size=1 << 16) == PAYLOAD[7 : 7 + (1 << 20)]


def test_a_read_given_up_hands_nothing_over_after_it_returns(s3_service, proxy):
    """The answer arrives after the caller gave up (its socket timeout is longer):
    the socket is shut down and the sink is never called."""
    prefix = f"stream-{uuid.uuid4().hex[:8]}"
    runtime.run_sync(from_url(s3_service.url(prefix), **s3_service.storage_options()).put("blob", PAYLOAD))
    reader = S3RangeReader(
        endpoint=proxy.endpoint_url,
        bucket=s3_service.bucket,
        region=s3_service.region,
        signer=S3Store(
            s3_service.bucket,
            endpoint=proxy.endpoint_url,
            access_key_id=s3_service.access_key,
            secret_access_key=s3_service.secret_key,
            region=s3_service.region,
            virtual_hosted_style_request=False,
            client_options={"allow_http": True},
        ),
        timeout=30,
    )
    proxy.latency_ms = 2000  # the answer comes ~1.5 s after the caller gave up
    sink = Collect(1 << 16)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        runtime.run_sync(asyncio.wait_for(reader.read_streamed(f"{prefix}/blob", 0, 1 << 20, sink, "get blob"), 0.5))
    assert time.monotonic() - started < 1.5
    time.sleep(2.5)
    assert not sink.calls, "a read went on handing bytes over after it returned"
    proxy.latency_ms = 0
    assert runtime.run_sync(reader.read_streamed(f"{prefix}/blob", 0, 1 << 20, sink, "get blob")) == 1 << 20
    assert bytes(sink.data) == PAYLOAD[: 1 << 20]
    reader.close()


def test_stalled_reads_in_a_resharded_restore_are_retried_bit_exact(s3_service, proxy):
    """Restore onto another sharding streams its reads; a stall is abandoned and retried."""
    options = copy.deepcopy(s3_service.storage_options())
    options["client_kwargs"]["endpoint_url"] = proxy.endpoint_url
    url = s3_service.url(f"stream-stall/{uuid.uuid4().hex[:8]}")
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    values = np.random.default_rng(9).standard_normal((1024, 512)).astype(np.float32)
    objckpt.save(url, {"w": jax.device_put(values, NamedSharding(mesh, P("x", "y")))}, storage_options=options)
    other = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))
    proxy.set_faults(1.0, ("stall",), only="GET")

    def heal():
        time.sleep(3)
        proxy.set_faults(0.0)

    threading.Thread(target=heal, daemon=True).start()
    stats = objckpt.TransferStats()
    started = time.monotonic()
    out = objckpt.restore(
        url,
        {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=other)},
        storage_options=options,
        options=objckpt.Options(request_timeout=2),
        stats=stats,
    )
    np.testing.assert_array_equal(np.asarray(out["w"]), values)
    assert stats.retries >= 1 and time.monotonic() - started < 20


def test_reader_rejects_an_endpoint_that_is_not_http():
    with pytest.raises(ValueError, match="http"):
        S3RangeReader(endpoint="ftp://example.com", bucket="b", region="us-east-1", signer=None)


def test_a_kept_connection_the_server_closed_is_replaced_without_an_error():
    """Servers close idle kept-alive connections; the next read on one goes out again on a new one."""
    import http.server

    body = bytes(range(256)) * 16
    connections: list[int] = []

    class OneRequestPerConnection(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive by default: the client keeps the connection

        def setup(self):
            super().setup()
            connections.append(1)

        def do_GET(self):
            first, last = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
            self.send_response(206)
            self.send_header("Content-Length", str(last - first + 1))
            self.end_headers()
            self.wfile.write(body[first : last + 1])
            self.close_connection = True  # closed without saying so, like an idle timeout

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OneRequestPerConnection)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reader = S3RangeReader(
            endpoint=f"http://127.0.0.1:{server.server_port}", bucket="b", region="us-east-1", signer=None
        )
        reader._executor = ThreadPoolExecutor(1)  # one worker: one kept connection
        for start in (0, 100, 200):
            sink = Collect(20)
            assert runtime.run_sync(reader.read_streamed("k", start, 50, sink, "get k")) == 50
            assert bytes(sink.data) == body[start : start + 50] and len(sink.calls) == 3  # 20 + 20 + 10
            time.sleep(0.1)  # let the server's close arrive first
        assert len(connections) == 3
    finally:
        server.shutdown()
        server.server_close()
