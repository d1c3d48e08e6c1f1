"""The latency proxy itself (backends/proxy.py): bytes intact and in order both ways, latency added.

Against a plain HTTP server here, so a break shows as the proxy's and not a
storage client's; tests/test_faults.py drives its faults against the real S3 server.
"""

from __future__ import annotations

import hashlib
import http.client
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from backends.proxy import FaultProxy

_BODY = np.random.default_rng(5).integers(0, 256, 24 << 20, dtype=np.uint8).tobytes()


class _Handler(BaseHTTPRequestHandler):
    """GET /N: the first N bytes of ``_BODY``; PUT: the body's sha256 and length. Each
    answer says what ``Connection`` header its request came with."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        n = int(self.path.strip("/"))
        self.send_response(200)
        self.send_header("X-Request-Connection", self.headers.get("Connection", ""))
        self.send_header("Content-Length", str(n))
        self.end_headers()
        view = memoryview(_BODY)[:n]
        for at in range(0, n, 1 << 16):  # in pieces, as a server streams a large object
            self.wfile.write(view[at : at + (1 << 16)])

    def do_PUT(self) -> None:
        length = int(self.headers["Content-Length"])
        digest = hashlib.sha256()
        left = length
        while left:
            chunk = self.rfile.read(min(left, 1 << 20))
            digest.update(chunk)
            left -= len(chunk)
        answer = f"{digest.hexdigest()} {length}".encode()
        self.send_response(200)
        self.send_header("X-Request-Connection", self.headers.get("Connection", ""))
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def _request(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes, str | None]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        return response.status, response.read(), response.getheader("X-Request-Connection")
    finally:
        conn.close()


@pytest.mark.parametrize("latency_ms", [0, 20])
def test_bytes_pass_intact_and_in_order_both_ways(upstream, latency_ms):
    with FaultProxy("127.0.0.1", upstream, latency_ms=latency_ms) as proxy:
        sizes = [0, 1, 65_537, 3 << 20, len(_BODY)]
        with ThreadPoolExecutor(len(sizes)) as pool:  # at once: connections must not mix
            got = list(pool.map(lambda n: _request(proxy.port, "GET", f"/{n}"), sizes))
        for n, (status, body, _) in zip(sizes, got):
            assert status == 200 and len(body) == n and body == _BODY[:n], f"GET of {n} bytes"
        status, answer, connection = _request(proxy.port, "PUT", "/blob", _BODY)
        assert status == 200
        assert answer.decode() == f"{hashlib.sha256(_BODY).hexdigest()} {len(_BODY)}"
        assert connection == "close"  # rewritten: each request gets its own upstream connection
        assert proxy.stats.requests == len(sizes) + 1


def test_each_round_trip_takes_the_latency(upstream):
    with FaultProxy("127.0.0.1", upstream, latency_ms=150) as proxy:
        started = time.monotonic()
        assert _request(proxy.port, "GET", "/100")[1] == _BODY[:100]
        took = time.monotonic() - started
        proxy.latency_ms = 0  # applies from the next request on
        started = time.monotonic()
        assert _request(proxy.port, "GET", "/100")[1] == _BODY[:100]
        quick = time.monotonic() - started
    assert 0.15 <= took < 1.5
    assert quick < 0.1


def test_an_injected_status_never_reaches_the_server(upstream):
    with FaultProxy("127.0.0.1", upstream, latency_ms=10) as proxy:
        proxy.set_faults(1.0, ("503",))
        status, body, _ = _request(proxy.port, "PUT", "/blob", b"x" * 1000)
        assert status == 503 and b"<Code>SlowDown</Code>" in body
        proxy.set_faults(0.0)
        assert _request(proxy.port, "GET", "/10")[1] == _BODY[:10]
        assert proxy.stats.faults == {"503": 1}


def test_stop_ends_open_connections(upstream):
    proxy = FaultProxy("127.0.0.1", upstream, stall_seconds=60).start()
    proxy.set_faults(1.0, ("stall",))
    outcome: list[BaseException | tuple] = []

    def stalled() -> None:
        try:
            outcome.append(_request(proxy.port, "GET", f"/{1 << 20}"))
        except BaseException as exc:  # the point: it ends, one way or the other
            outcome.append(exc)

    thread = threading.Thread(target=stalled)
    thread.start()
    time.sleep(0.5)
    started = time.monotonic()
    proxy.stop()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 10
    ended = outcome[0]  # a reset, or a connection closed before the body (http.client takes that as b"")
    assert isinstance(ended, (OSError, http.client.HTTPException)) or len(ended[1]) < 1 << 20, ended


def test_over_capacity_requests_are_told_to_slow_down(upstream):
    with FaultProxy("127.0.0.1", upstream) as proxy:
        proxy.set_capacity(1)
        body = b"y" * 1000
        held = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
        try:  # a PUT whose body is half sent: the one request being served
            held.sendall(b"PUT /held HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + body[:500])
            deadline = time.monotonic() + 10
            while proxy.serving < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            status, answer, _ = _request(proxy.port, "GET", "/10")
            assert status == 503 and b"<Code>SlowDown</Code>" in answer
            held.sendall(body[500:])
            reply = held.makefile("rb").read()
            assert reply.startswith(b"HTTP/1.1 200") and hashlib.sha256(body).hexdigest().encode() in reply
        finally:
            held.close()
        deadline = time.monotonic() + 10
        while proxy.serving and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _request(proxy.port, "GET", "/10")[1] == _BODY[:10]  # room again
        assert proxy.stats.throttled == 1 and proxy.stats.faults == {}
        with pytest.raises(ValueError, match="capacity"):
            proxy.set_capacity(0)
