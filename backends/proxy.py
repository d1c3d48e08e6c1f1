"""A TCP proxy that adds latency and injects HTTP faults in front of a storage server.

The kernel here has no ``netem``, so object-store latency is emulated in user
space: every chunk is held for half the round-trip time in each direction
(10 ms RTT ≈ same region, 40–100 ms ≈ another region) without limiting
bandwidth. On command it also injects faults, at a chosen rate, per request:

- ``"503"``, ``"429"``, ``"500"``: answer with that status (S3-style XML body,
  ``Connection: close``) instead of forwarding;
- ``"reset"``: forward, then reset the connection (TCP RST) midway through the response;
- ``"truncate"``: forward, then close cleanly midway through the response;
- ``"stall"``: forward, then send no bytes for ``stall_seconds`` midway through the response.

"Midway" is half of the response's first chunk, so even a body-less PUT reply is cut.

Three more stall kinds (``STALL_KINDS``, drawn only when named), each holding the
connection open for ``stall_seconds``: the stalls a watchdog must cut.

- ``"hang"``: accept the request (its body read and dropped) and never answer;
- ``"trickle"``: answer the response head, then its body a few bytes at a time
  (a body-less reply, a PUT's, is trickled head and all);
- ``"midbody"``: stop mid-body: a request with a body (a PUT, a part) has half of it
  read, then no more (nothing reaches the server); a response, its head and half of the
  body in its first chunk, then nothing.

``set_corruption(rate)`` flips one bit in the body of that fraction of successful
GET responses (the stored data stays intact, the length and headers are kept):
a checksum that fails in flight, not at rest (``stats.corrupted`` counts them).

``fail_after(n_bytes, kind)`` faults every request that begins once ``n_bytes``
have gone down to clients (``stats.bytes_down``), with one of the fault kinds:
a store (or region) that dies, or hangs with ``"stall"``, partway through a
restore. ``stats.bytes_up``/``bytes_down`` count what crossed the proxy each way.

``set_capacity(n)`` makes it behave like an overloaded store instead: a request
that arrives while ``n`` others are being served is answered 503 SlowDown
(``stats.throttled`` counts them), as S3 does when a client outruns a prefix.

Each request gets its own upstream connection (the proxy rewrites requests to
``Connection: close``), so a fault never leaks into the next request.

It also checks who is asking, per request head, as a cloud store would:
``stats.access_keys`` counts the AWS access key of each signed request (SigV4
or SigV2, header or presigned URL), ``stats.session_tokens`` those with a session
token and ``stats.payload_hashes`` how SigV4 requests sign their bodies (what
``X-Amz-Content-Sha256`` says: ``UNSIGNED-PAYLOAD`` or a digest); ``revoke_access_key(key)`` answers that key's requests 403
InvalidAccessKeyId (an expired or rotated key); ``require_bearer(check)``
answers 401 to a request whose ``Authorization: Bearer`` token ``check`` does
not accept (fake-gcs-server itself accepts anything). Refusals are counted in
``stats.refused`` and never reach the server.

``tls=TestCA`` (:mod:`backends.tls`) serves HTTPS instead of HTTP; the faults
behave the same, except that a ``"reset"`` under TLS may reach the client as a
plain close.

    proxy = FaultProxy("127.0.0.1", 9000, latency_ms=10)
    proxy.start(); proxy.endpoint_url  # http://127.0.0.1:PORT
    proxy.set_faults(0.05, ("503", "reset", "stall"))
    proxy.stop()

``python -m backends.proxy UPSTREAM_PORT --latency-ms 40`` runs one from a shell.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import socket
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlsplit

from backends.tls import stop_loop

if TYPE_CHECKING:
    from backends.tls import TestCA

FAULT_KINDS = ("503", "429", "500", "reset", "truncate", "stall")
STALL_KINDS = ("hang", "trickle", "midbody")
_TRICKLE = (16, 0.2)  # a trickled answer: this many bytes every this many seconds
_STATUS_TEXT = {"503": "Slow Down", "429": "Too Many Requests", "500": "Internal Server Error"}
_ERROR_CODE = {"503": "SlowDown", "429": "TooManyRequests", "500": "InternalError"}
_REVOKED_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code>'
    b"<Message>The AWS Access Key Id you provided does not exist in our records.</Message></Error>"
)
_UNAUTHENTICATED_BODY = (
    b'{"error": {"code": 401, "message": "Request is missing a valid OAuth 2 access token.", '
    b'"errors": [{"message": "Invalid Credentials", "domain": "global", "reason": "authError"}]}}'
)
_REFUSAL = {  # status: (reason phrase, content type)
    "403": ("Forbidden", "application/xml"),
    "401": ("Unauthorized", "application/json; charset=UTF-8"),
}


@dataclass
class ProxyStats:
    requests: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    throttled: int = 0  # requests refused over capacity (``set_capacity``)
    corrupted: int = 0  # response bodies with a bit flipped (``set_corruption``)
    access_keys: Counter[str] = field(default_factory=Counter)  # signed requests by access key id
    session_tokens: int = 0  # requests carrying X-Amz-Security-Token (header or query)
    bearer_tokens: Counter[str] = field(default_factory=Counter)  # accepted bearer tokens, by sha256[:12]
    refused: int = 0  # answered 403/401 by the identity checks, not forwarded
    # SigV4 requests by (method, X-Amz-Content-Sha256 kind): "UNSIGNED-PAYLOAD", "STREAMING-...", "sha256"
    payload_hashes: Counter[tuple[str, str]] = field(default_factory=Counter)
    bytes_up: int = 0  # bytes from clients to the server (request heads and bodies) that were forwarded
    bytes_down: int = 0  # bytes from the server to clients (response heads and bodies)

    @property
    def faulted(self) -> int:
        return sum(self.faults.values())


class FaultProxy:
    """Latency and fault injection between clients and ``upstream_host:upstream_port``."""

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        latency_ms: float = 0.0,
        fault_rate: float = 0.0,
        fault_kinds: Sequence[str] = FAULT_KINDS,
        stall_seconds: float = 30.0,
        seed: int | None = None,
        tls: TestCA | None = None,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.tls = tls
        self._revoked: set[str] = set()
        self._bearer_check: Callable[[str], bool] | None = None
        self.latency_ms = latency_ms
        self.stall_seconds = stall_seconds
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.set_faults(fault_rate, fault_kinds)
        self.set_corruption(0.0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._live: set[_ClientSide] = set()  # open connections, touched on the loop thread only
        self.capacity: int | None = None
        self._fail_after: tuple[int, str] | None = None
        self._cut_open = False
        self.serving = 0  # requests forwarded and not yet answered (loop thread only)
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"{'https' if self.tls is not None else 'http'}://127.0.0.1:{self.port}"

    def revoke_access_key(self, key: str) -> None:
        """Answer requests signed with ``key`` 403 InvalidAccessKeyId from now on, without forwarding them."""
        with self._lock:
            self._revoked.add(key)

    def require_bearer(self, check: Callable[[str], bool] | None) -> None:
        """Answer 401 to requests without an ``Authorization: Bearer`` token that ``check`` accepts.

        ``check`` runs on the proxy's loop thread, so it must be quick; None lifts the requirement.
        """
        with self._lock:
            self._bearer_check = check

    def _identity_refusal(self, head: bytes) -> tuple[str, bytes] | None:
        """Count who signed the request in ``head``; the status and body to answer it with if refused."""
        request = _RequestIdentity.parse(head)
        with self._lock:
            check = self._bearer_check
            if request.session_token:
                self.stats.session_tokens += 1
            if request.payload_hash is not None:
                self.stats.payload_hashes[(request.method, request.payload_hash)] += 1
            if request.access_key is not None:
                self.stats.access_keys[request.access_key] += 1
                if request.access_key in self._revoked:
                    self.stats.refused += 1
                    return "403", _REVOKED_BODY
        if check is None:
            return None
        if request.bearer is not None and check(request.bearer):
            with self._lock:
                self.stats.bearer_tokens[hashlib.sha256(request.bearer.encode()).hexdigest()[:12]] += 1
            return None
        with self._lock:
            self.stats.refused += 1
        return "401", _UNAUTHENTICATED_BODY

    def set_faults(
        self,
        rate: float,
        kinds: Sequence[str] = FAULT_KINDS,
        *,
        only: str | None = None,
        ranged: bool | None = None,
        times: int | None = None,
    ) -> None:
        """Fault ``rate`` (0..1) of the requests from now on, drawing kinds uniformly.

        ``only``: fault just the requests whose request line (``PUT /b/k?partNumber=2 HTTP/1.1``)
        contains this text, e.g. ``"partNumber="`` for the parts of multipart uploads.
        ``ranged``: just those with (True) or without (False) a ``Range`` header;
        ``times``: at most this many faults in all (1: a stall that happens once).
        """
        unknown = set(kinds) - set(FAULT_KINDS) - set(STALL_KINDS)
        if unknown or not 0.0 <= rate <= 1.0 or (rate > 0 and not kinds):
            raise ValueError(f"bad fault settings: rate={rate}, kinds={kinds}")
        with self._lock:
            self.fault_rate = rate
            self.fault_kinds = tuple(kinds)
            self.fault_only = only.encode() if only else None
            self.fault_ranged = ranged
            self.faults_left = times

    def set_corruption(
        self, rate: float, *, only: str | None = None, limit: int | None = None, position: int | None = None
    ) -> None:
        """Flip one bit in the body of ``rate`` (0..1) of the 2xx GET responses from now on.

        ``only``: just the GETs whose request line contains this text (e.g. ``".blob"``);
        ``limit``: at most this many bodies in all; ``position``: flip the body's byte at
        this offset (the last byte of a shorter body) rather than one drawn at random.
        Drawn with the proxy's seeded generator, like the faults.
        """
        if not 0.0 <= rate <= 1.0 or (limit is not None and limit < 0) or (position is not None and position < 0):
            raise ValueError(f"bad corruption settings: rate={rate}, limit={limit}, position={position}")
        with self._lock:
            self.corrupt_rate = rate
            self.corrupt_only = only.encode() if only else None
            self.corrupt_left = limit
            self.corrupt_position = position

    def _draw_corruption(self, request_line: bytes) -> bool:
        with self._lock:
            if not self.corrupt_rate or not request_line.startswith(b"GET "):
                return False
            if self.corrupt_only is not None and self.corrupt_only not in request_line:
                return False
            if self.corrupt_left == 0 or self._rng.random() >= self.corrupt_rate:
                return False
            if self.corrupt_left is not None:
                self.corrupt_left -= 1
            return True

    def _flip_at(self, length: int) -> int:
        """Which byte of a body of ``length`` bytes to flip (counted as done)."""
        with self._lock:
            self.stats.corrupted += 1
            if self.corrupt_position is not None:
                return min(self.corrupt_position, length - 1)
            return self._rng.randrange(length)

    def fail_after(self, n_bytes: int | None, kind: str = "500", *, cut_open: bool = False) -> None:
        """Fault every request that begins once ``n_bytes`` have gone down to clients (None: stop).

        ``cut_open``: also reset, at that moment, every connection then open: a store that
        dies mid-transfer, not only for the requests after.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}")
        with self._lock:
            self._fail_after = None if n_bytes is None else (n_bytes, kind)
            self._cut_open = cut_open and n_bytes is not None

    def _failing(self) -> str | None:
        with self._lock:
            if self._fail_after is not None and self.stats.bytes_down >= self._fail_after[0]:
                return self._fail_after[1]
        return None

    def _count(self, up: int = 0, down: int = 0) -> None:
        """Count bytes (on the loop thread); the moment ``fail_after(..., cut_open=True)`` comes due,
        reset every open connection."""
        with self._lock:
            self.stats.bytes_up += up
            self.stats.bytes_down += down
            due = self._cut_open and self._fail_after is not None and self.stats.bytes_down >= self._fail_after[0]
            if due:
                self._cut_open = False
        if due:
            for side in list(self._live):
                side.abort()

    def set_capacity(self, capacity: int | None) -> None:
        """Serve at most ``capacity`` requests at once and answer the rest 503 SlowDown (None: no limit)."""
        if capacity is not None and capacity < 1:
            raise ValueError(f"bad capacity: {capacity}")
        self.capacity = capacity

    def _draw(self, head: bytes) -> str | None:
        with self._lock:
            self.stats.requests += 1
            if self.fault_only is not None and self.fault_only not in head.split(b"\r\n", 1)[0]:
                return None
            if self.fault_ranged is not None and self.fault_ranged != (b"\r\nrange:" in head.lower()):
                return None
            if self.faults_left != 0 and self.fault_rate and self._rng.random() < self.fault_rate:
                if self.faults_left is not None:
                    self.faults_left -= 1
                kind = self._rng.choice(self.fault_kinds)
                self.stats.faults[kind] = self.stats.faults.get(kind, 0) + 1
                return kind
        return None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FaultProxy:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            context = self.tls.server_context() if self.tls is not None else None
            self._server = loop.run_until_complete(loop.create_server(self._connection, "127.0.0.1", 0, ssl=context))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        stop_loop(loop, self._server, self._live, self._thread)
        self._loop = None

    def __enter__(self) -> FaultProxy:
        return self.start() if self._loop is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ one connection

    def _connection(self) -> _ClientSide:
        return _ClientSide(self)


_HEAD_LIMIT = 1 << 16  # a request head longer than this closes the connection
# Bytes per receive. asyncio's default, 256 KiB, makes 4x the callbacks per GiB
# (the proxy's CPU per GiB read at 40 ms: 0.85 s at 256 KiB, 0.70 s at 1 MiB).
_READ_SIZE = 1 << 20
_WRITE_HIGH = 4 << 20  # a transport holding this much unsent pauses whoever feeds it


class _Delayed:
    """One direction of a proxied connection: each chunk held ``delay`` seconds, then written, in order.

    Why not an asyncio stream and a queue read by a coroutine: that costs a few
    coroutine switches and a timer per 64 KiB, and at 40 ms the old stream-based
    proxy spent 1.3 CPU-s per GiB, more than the client it stood in front of, on
    a 2-core box where every CPU-second is taken from the client and the server.
    Here a chunk is one ``data_received`` call (up to ``_READ_SIZE``), a deque
    entry and at most one armed timer per direction; whatever is due is written
    when the timer fires. Measured at 40 ms RTT, reading 1 GiB (medium model)
    from the S3 server: 0.7 CPU-s in the proxy against 1.3, and the raw GETs
    1.45-1.57 s against 1.92-1.99 s.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float, on_eof: Callable[[], None]) -> None:
        self._loop = loop
        self._delay = delay
        self._on_eof = on_eof
        self._queue: deque[tuple[float, bytes | None]] = deque()  # None: the end of the stream
        self._timer: asyncio.TimerHandle | None = None
        self._dest: asyncio.Transport | None = None
        self._first: Callable[[asyncio.Transport, bytes], None] | None = None

    def attach(self, dest: asyncio.Transport) -> None:
        """Start writing to ``dest`` (chunks fed before this wait their turn)."""
        self._dest = dest
        self._arm()

    def on_first_chunk(self, hook: Callable[[asyncio.Transport, bytes], None]) -> None:
        """Hand the first due chunk to ``hook`` instead of writing it, and stop (a fault)."""
        self._first = hook

    def feed(self, data: bytes | None) -> None:
        """Queue ``data`` (``None``: the source has ended) to be written ``delay`` seconds from now."""
        self._queue.append((self._loop.time() + self._delay, data))
        self._arm()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._queue.clear()

    def _arm(self) -> None:
        if self._timer is None and self._dest is not None and self._queue:
            self._timer = self._loop.call_at(self._queue[0][0], self._write_due)

    def _write_due(self) -> None:
        self._timer = None
        dest = self._dest
        if dest is None or dest.is_closing():
            self._queue.clear()
            return
        now = self._loop.time()
        due: list[bytes] = []
        ended = False
        while self._queue and self._queue[0][0] <= now:
            data = self._queue.popleft()[1]
            if data is None:
                ended = True
                break
            due.append(data)
        if due and self._first is not None:
            hook, self._first = self._first, None
            self._queue.clear()
            hook(dest, due[0])
            return
        for data in due:  # one write each: writelines would join them first (a copy, on Python < 3.12)
            dest.write(data)
        if ended:
            self._queue.clear()
            self._on_eof()
            return
        self._arm()


class _ClientSide(asyncio.Protocol):
    """A client's connection: reads the request head, then pipes both ways through :class:`_Delayed`."""

    def __init__(self, proxy: FaultProxy) -> None:
        self._proxy = proxy
        self._loop = asyncio.get_running_loop()
        self._client: asyncio.Transport | None = None
        self._upstream: asyncio.Transport | None = None
        self._head: bytearray | None = bytearray()  # None once the request head has been read
        self._to_upstream: _Delayed | None = None
        self._to_client: _Delayed | None = None
        self._pending: list[asyncio.Handle | asyncio.Task[None]] = []  # timers and the connect, cancelled on close
        self._serving = False  # counted in the proxy's ``serving``
        self.flipper: _BodyFlipper | None = None  # set when this response's body gets a bit flipped
        self._upload_left: int | None = None  # a "midbody" stall: request body bytes still read

    # client transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._client = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH)
        if hasattr(transport, "max_size"):
            transport.max_size = _READ_SIZE
        self._proxy._live.add(self)

    def data_received(self, data: bytes) -> None:
        if self._head is None:  # the body: forwarded, or dropped under an injected status
            if self._upload_left is not None:  # a "midbody" stall: half of the body read, then no more
                self._upload_left -= min(len(data), self._upload_left)
                if not self._upload_left and self._client is not None:
                    self._client.pause_reading()
            if self._to_upstream is not None:
                self._proxy._count(up=len(data))
                self._to_upstream.feed(data)
            return
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > _HEAD_LIMIT:
                self.close()
            return
        head, rest = bytes(self._head[: end + 4]), bytes(self._head[end + 4 :])
        self._head = None
        self._begin(head, rest)

    def eof_received(self) -> bool:
        if self._to_upstream is not None:
            self._to_upstream.feed(None)
        # After the head, half-closed: the answer may still flow back (not under TLS, which ends on EOF).
        return self._head is None and self._client is not None and self._client.can_write_eof()

    def connection_lost(self, exc: Exception | None) -> None:
        self.close()

    def pause_writing(self) -> None:  # the client reads slower than the server sends
        if self._upstream is not None:
            self._upstream.pause_reading()

    def resume_writing(self) -> None:
        if self._upstream is not None and not self._upstream.is_closing():
            self._upstream.resume_reading()

    # the request
    def _begin(self, head: bytes, rest: bytes) -> None:
        proxy = self._proxy
        delay = proxy.latency_ms / 2000
        refusal = proxy._identity_refusal(head)
        if refusal is not None:
            with proxy._lock:
                proxy.stats.requests += 1
            self._pending.append(self._loop.call_later(delay, self._answer, *refusal))
            return
        fault = proxy._failing() or proxy._draw(head)
        if fault is None and proxy.capacity is not None and proxy.serving >= proxy.capacity:
            with proxy._lock:
                proxy.stats.throttled += 1
            fault = "503"
        if fault in _STATUS_TEXT:
            self._pending.append(self._loop.call_later(delay, self._answer_error, fault))
            return
        if fault is not None and fault in STALL_KINDS:
            self._pending.append(self._loop.call_later(proxy.stall_seconds, self.close))
            if fault == "midbody" and _content_length(head) > 0:
                self._upload_left = _content_length(head) // 2
                return self.data_received(rest)  # the server is not asked: none of it reaches one
            if fault == "hang":
                return  # the body is read and dropped (no upstream), nothing is answered
        proxy.serving += 1
        self._serving = True
        proxy._count(up=len(head) + len(rest))
        self._to_upstream = _Delayed(self._loop, delay, self._upstream_eof)
        self._to_upstream.feed(_force_close(head))
        if rest:
            self._to_upstream.feed(rest)
        self._to_client = _Delayed(self._loop, delay, self._response_ended)
        if fault is not None:
            self._to_client.on_first_chunk(lambda dest, chunk: self._apply(fault, dest, chunk))
        elif proxy._draw_corruption(head.split(b"\r\n", 1)[0]):
            self.flipper = _BodyFlipper(proxy._flip_at)
        self._pending.append(self._loop.create_task(self._connect()))

    async def _connect(self) -> None:
        try:
            transport, _ = await self._loop.create_connection(lambda: _UpstreamSide(self), *self._proxy.upstream)
        except OSError:
            self.close()
            return
        assert isinstance(transport, asyncio.Transport)
        if self._client is None or self._client.is_closing():
            transport.close()
            return
        self._upstream = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH)
        if hasattr(transport, "max_size"):
            transport.max_size = _READ_SIZE
        assert self._to_upstream is not None
        self._to_upstream.attach(transport)
        if self._to_client is not None:
            self._to_client.attach(self._client)

    def _upstream_eof(self) -> None:
        if self._upstream is not None and self._upstream.can_write_eof() and not self._upstream.is_closing():
            self._upstream.write_eof()

    def _response_ended(self) -> None:
        """The server's response has all been written back: the request is over (``Connection: close``)."""
        self.close()

    def _answer_error(self, status: str) -> None:
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{_ERROR_CODE[status]}</Code>'
            f"<Message>injected by the fault proxy</Message></Error>"
        ).encode()
        self._reply(status, _STATUS_TEXT[status], "application/xml", body)

    def _answer(self, status: str, body: bytes) -> None:
        """Refuse the request (identity checks) with ``body``."""
        reason, content_type = _REFUSAL[status]
        self._reply(status, reason, content_type, body)

    def _reply(self, status: str, reason: str, content_type: str, body: bytes) -> None:
        if self._client is not None and not self._client.is_closing():
            self._client.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
        self.close()

    def _apply(self, fault: str, client: asyncio.Transport, chunk: bytes) -> None:
        """Midway through the response: half of its first chunk, then the fault (a stall kind:
        the head and half of the body in it, or all of it trickled)."""
        body = chunk.find(b"\r\n\r\n") + 4 if fault in STALL_KINDS else 0
        body = body if body < len(chunk) else 0  # where its body starts (0: none in it)
        if fault == "trickle":
            self._trickle(client, chunk[body:], chunk[:body])
        else:
            client.write(chunk[: body + (len(chunk) - body) // 2])
        if self._upstream is not None:
            self._upstream.close()  # nothing more of this response will be forwarded
        if fault in ("stall", *STALL_KINDS):
            self._pending.append(self._loop.call_later(self._proxy.stall_seconds, self.close))
            return
        sock = client.get_extra_info("socket")
        if fault == "reset" and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close()

    def _trickle(self, client: asyncio.Transport, rest: bytes, now: bytes = b"") -> None:
        """Write ``now``, then ``rest`` a few bytes at a time (``_TRICKLE``)."""
        n, every = _TRICKLE
        if not client.is_closing():
            client.write(now + rest[:n])
            if rest[n:]:
                self._pending.append(self._loop.call_later(every, self._trickle, client, rest[n:]))

    def close(self) -> None:
        """End this connection both ways (what was already written to the client is flushed first)."""
        for handle in self._pending:
            handle.cancel()
        self._pending.clear()
        for pipe in (self._to_upstream, self._to_client):
            if pipe is not None:
                pipe.cancel()
        for transport in (self._client, self._upstream):
            if transport is not None and not transport.is_closing():
                transport.close()
        if self._serving:
            self._serving = False
            self._proxy.serving -= 1
        self._proxy._live.discard(self)

    def abort(self) -> None:
        """Drop the connection at once (the proxy is stopping)."""
        for transport in (self._client, self._upstream):
            if transport is not None:
                transport.abort()
        self.close()


class _UpstreamSide(asyncio.Protocol):
    """The connection to the server for one request: its bytes go back to the client, delayed."""

    def __init__(self, client_side: _ClientSide) -> None:
        self._side = client_side

    def data_received(self, data: bytes) -> None:
        if self._side.flipper is not None:
            data = self._side.flipper.feed(data)
        if self._side._to_client is not None and data:
            self._side._proxy._count(down=len(data))
            self._side._to_client.feed(data)

    def eof_received(self) -> bool:
        if self._side._to_client is not None:
            held = self._side.flipper.flush() if self._side.flipper is not None else b""
            if held:
                self._side._to_client.feed(held)
            self._side._to_client.feed(None)
        return True  # the client side closes both once the response has been written

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self._side.close()  # reset by the server: pass it on

    def pause_writing(self) -> None:  # the server reads slower than the client sends
        if self._side._client is not None:
            self._side._client.pause_reading()

    def resume_writing(self) -> None:
        client = self._side._client
        if client is not None and not client.is_closing():
            client.resume_reading()


class _BodyFlipper:
    """Flips one bit of a response's body on its way to the client.

    The response head is held back until it is whole (it is small), to read
    the status and ``Content-Length``; only a 2xx body with bytes gets a flip,
    at the byte ``choose(length)`` picks. Everything else passes as is.
    """

    def __init__(self, choose: Callable[[int], int]) -> None:
        self._choose = choose
        self._head: bytearray | None = bytearray()  # None once the head has passed
        self._at = -1  # the body byte to flip; -1: none (left)
        self._seen = 0  # body bytes passed so far

    def feed(self, data: bytes) -> bytes:
        """What to forward of ``data`` (the head is held back until it is whole)."""
        if self._head is None:
            return self._body(data)
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            return b"" if len(self._head) <= _HEAD_LIMIT else self.flush()
        head, body = bytes(self._head[: end + 4]), bytes(self._head[end + 4 :])
        self._head = None
        status = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
        length = _content_length(head)
        if status.startswith(b"2") and length:
            self._at = self._choose(length)
        return head + self._body(body)

    def flush(self) -> bytes:
        """The bytes held back (a head that never ended), passed on as they are."""
        held, self._head = bytes(self._head or b""), None
        return held

    def _body(self, data: bytes) -> bytes:
        at = self._at - self._seen
        self._seen += len(data)
        if not 0 <= at < len(data):
            return data
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        self._at = -1
        return bytes(flipped)


@dataclass(frozen=True)
class _RequestIdentity:
    """Who a request says it is: its AWS access key, whether it has a session token, its bearer token."""

    access_key: str | None = None
    session_token: bool = False
    bearer: str | None = field(default=None, repr=False)
    method: str = ""
    payload_hash: str | None = None  # the kind of X-Amz-Content-Sha256: a digest is "sha256"

    @classmethod
    def parse(cls, head: bytes) -> _RequestIdentity:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        query = dict(parse_qsl(urlsplit(parts[1]).query)) if len(parts) == 3 else {}
        # parse_qsl has decoded %2F; AWSAccessKeyId: a SigV2 presigned URL (botocore's default for path style)
        access_key = query.get("X-Amz-Credential", "").split("/", 1)[0] or query.get("AWSAccessKeyId") or None
        session_token = "X-Amz-Security-Token" in query
        bearer = None
        payload_hash = None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip()
            if name == "authorization":
                scheme, _, rest = value.partition(" ")
                if scheme == "AWS4-HMAC-SHA256" and "Credential=" in rest:
                    access_key = rest.split("Credential=", 1)[1].split("/", 1)[0].strip()
                elif scheme == "AWS" and ":" in rest:  # SigV2
                    access_key = rest.rsplit(":", 1)[0].strip()
                elif scheme.lower() == "bearer":
                    bearer = rest.strip()
            elif name == "x-amz-security-token":
                session_token = True
            elif name == "x-amz-content-sha256":
                payload_hash = "sha256" if len(value) == 64 and "-" not in value else value
        return cls(access_key, session_token, bearer, parts[0], payload_hash)


def _content_length(head: bytes) -> int:
    """The ``Content-Length`` of a response head (0 when it has none)."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return int(value.strip())
    return 0


def _force_close(head: bytes) -> bytes:
    """The request head with ``Connection: close``, so each request gets a fresh connection."""
    lines = head.split(b"\r\n")
    kept = [line for line in lines[1:] if line and not line.lower().startswith(b"connection:")]
    return b"\r\n".join([lines[0], *kept, b"Connection: close", b"", b""])


def main() -> None:
    parser = argparse.ArgumentParser(description="Latency and fault proxy for a local storage server.")
    parser.add_argument("upstream_port", type=int)
    parser.add_argument("--upstream-host", default="127.0.0.1")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--fault-rate", type=float, default=0.0)
    parser.add_argument("--faults", default=",".join(FAULT_KINDS))
    args = parser.parse_args()
    proxy = FaultProxy(
        args.upstream_host,
        args.upstream_port,
        latency_ms=args.latency_ms,
        fault_rate=args.fault_rate,
        fault_kinds=args.faults.split(","),
    ).start()
    print(proxy.endpoint_url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        proxy.stop()


if __name__ == "__main__":
    main()
