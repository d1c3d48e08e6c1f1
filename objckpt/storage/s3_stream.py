"""Ranged S3 GETs streamed to a sink a few MiB at a time (``Store.get_range_streamed``).

Why it exists beside obstore: obstore hands back each response whole, in a
buffer it allocates. That is right when the buffer becomes the restored
array, but a restore onto another sharding copies every byte it reads into
target boxes, in runs as short as 1 KiB. Out of a whole response those
copies read cold memory, and every response faults in fresh pages first
(perf, 1 GiB resharded restore on this project's VM: as much page clearing
in the response buffers as in the targets). Here each thread receives a few
MiB into one buffer it reuses and hands them to restore's sink at once,
while they are in cache (:mod:`objckpt.storage.streaming` has the numbers).

How: plain ``http.client`` over one keep-alive connection per worker thread,
the body received with ``recv_into`` (no copy in user space), requests signed
with AWS Signature Version 4 (:class:`SigV4Signer`). Only these GETs go this
way; every other request, including reads that become arrays, goes through obstore.

Timeouts and cancellation: the socket has the request timeout (a stalled
server fails the read), and a caller that gives up (its own deadline, or a
cancelled restore) shuts the socket down and waits for the thread to stop
before it returns, so the sink is never called after that.
Credentials live in the signer only; they never reach a message or a log.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

from objckpt.errors import ObjectNotFoundError, StoreError, StorePermissionError, TransientStoreError
from objckpt.storage.error_map import TRANSIENT_STATUS
from objckpt.storage.streaming import STREAM_PIECE, ReadSink, piece_size

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_ALGORITHM = "AWS4-HMAC-SHA256"
_ERROR_BODY_LIMIT = 2048  # bytes of an error response kept for the message (S3's XML <Code>)
_WORKERS = 64  # threads per reader; the transfer engine's slots bound requests in flight


@dataclass(frozen=True)
class S3Credentials:
    """Static AWS credentials (never shown: excluded from ``repr``)."""

    access_key: str = field(repr=False)
    secret_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


class SigV4Signer:
    """AWS Signature Version 4 header auth for body-less requests (GET).

    The payload hash is that of the empty body, which every S3-compatible
    server accepts for a GET. Signing keys are derived once per day.
    """

    def __init__(self, credentials: S3Credentials, region: str, service: str = "s3") -> None:
        self._credentials = credentials
        self.region = region
        self.service = service
        self._keys: dict[str, bytes] = {}

    def _signing_key(self, date: str) -> bytes:
        key = self._keys.get(date)
        if key is None:
            key = ("AWS4" + self._credentials.secret_key).encode()
            for part in (date, self.region, self.service, "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            self._keys = {date: key}
        return key

    def sign(
        self, method: str, host: str, path: str, headers: dict[str, str], when: float | None = None
    ) -> dict[str, str]:
        """The headers to send: ``headers`` plus host, date, payload hash, token and authorization.

        Args:
            path: The request path exactly as sent (already URI-encoded).
            headers: Extra headers to sign (e.g. ``range``), lower-case names.
            when: Seconds since the epoch (now by default).
        """
        amz_date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if when is None else when))
        date = amz_date[:8]
        signed = {**headers, "host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": amz_date}
        if self._credentials.session_token:
            signed["x-amz-security-token"] = self._credentials.session_token
        names = sorted(signed)
        canonical = "\n".join(
            [method, path, "", *(f"{n}:{signed[n].strip()}" for n in names), "", ";".join(names), EMPTY_SHA256]
        )
        scope = f"{date}/{self.region}/{self.service}/aws4_request"
        to_sign = f"{_ALGORITHM}\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._signing_key(date), to_sign.encode(), hashlib.sha256).hexdigest()
        signed["authorization"] = (
            f"{_ALGORITHM} Credential={self._credentials.access_key}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )
        return signed


class _Attempt:
    """One read in flight: lets the awaiting side shut its socket down from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.aborted = False

    def attach(self, sock: socket.socket | None) -> None:
        with self._lock:
            if self.aborted:
                raise TransientStoreError("read abandoned by its caller")
            self._sock = sock

    def detach(self) -> None:
        with self._lock:
            self._sock = None

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)


class S3RangeReader:
    """Ranged GETs of one bucket's objects, streamed to a sink (see the module doc).

    Args:
        endpoint: ``http(s)://host[:port]``; None for AWS's regional endpoint.
        bucket: The bucket every key lives in.
        region: Signing region.
        credentials: Static credentials; None sends unsigned requests (public buckets).
        virtual_hosted: Address the bucket as ``bucket.host`` rather than ``host/bucket``.
        timeout: Socket timeout, seconds (connect and each receive).
    """

    def __init__(
        self,
        *,
        endpoint: str | None,
        bucket: str,
        region: str,
        credentials: S3Credentials | None,
        virtual_hosted: bool = False,
        timeout: float = 60.0,
    ) -> None:
        parts = urlsplit(endpoint or f"https://s3.{region}.amazonaws.com")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"S3 endpoint must be http(s)://host[:port], got {parts.scheme}://{parts.hostname}")
        self._https = parts.scheme == "https"
        self._port = parts.port
        self._connect_host = f"{bucket}.{parts.hostname}" if virtual_hosted else parts.hostname
        default_port = 443 if self._https else 80
        self._host_header = self._connect_host + (f":{parts.port}" if parts.port not in (None, default_port) else "")
        self._base_path = parts.path.rstrip("/") + ("" if virtual_hosted else f"/{quote(bucket, safe='')}")
        self._signer = SigV4Signer(credentials, region) if credentials is not None else None
        self.timeout = float(timeout)
        self._ssl = ssl.create_default_context() if self._https else None
        self._local = threading.local()
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    # ---------------------------------------------------------------- async side

    async def read_streamed(self, path: str, start: int, length: int, sink: ReadSink, what: str) -> int:
        """Hand bytes ``[start, start + length)`` of ``path`` to ``sink`` as they arrive, each
        piece received into this thread's reused buffer (``Store.get_range_streamed``).

        Returns how many bytes were handed over: fewer only when the object ends
        first (0 when ``start`` is at or past its end). Raises :class:`ObjectNotFoundError`,
        :class:`StorePermissionError`, :class:`TransientStoreError` (timeouts,
        resets, 429/5xx, a body cut short), :class:`StoreError`, naming ``what``,
        or whatever the sink raises. Once it returns or raises, the sink is not
        called any more.
        """
        return await self._run(path, start, length, what, lambda response: self._stream(response, length, sink, what))

    async def _run(
        self, path: str, start: int, length: int, what: str, consume: Callable[[http.client.HTTPResponse], int]
    ) -> int:
        """One GET on a worker thread; abandoned safely (see the module doc) if the caller gives up."""
        attempt = _Attempt()
        future = self._pool().submit(self._read, path, start, length, what, attempt, consume)
        try:
            return await asyncio.wrap_future(future)
        except BaseException:
            attempt.abort()  # the thread's receive fails at once...
            if not future.done():  # ...and the buffer is not handed back while it still writes
                with contextlib.suppress(BaseException):
                    await asyncio.shield(asyncio.wrap_future(future))
            raise

    def _pool(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(_WORKERS, thread_name_prefix="objckpt-s3-read")
            return self._executor

    def close(self) -> None:
        """Let the worker threads (and their connections) go once idle."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)

    # ---------------------------------------------------------- worker threads

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            if self._https:
                conn = http.client.HTTPSConnection(
                    self._connect_host, self._port, timeout=self.timeout, context=self._ssl
                )
            else:
                conn = http.client.HTTPConnection(self._connect_host, self._port, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _read(
        self,
        path: str,
        start: int,
        length: int,
        what: str,
        attempt: _Attempt,
        consume: Callable[[http.client.HTTPResponse], int],
    ) -> int:
        request_path = f"{self._base_path}/{quote(path, safe='/-_.~')}"
        headers = {"range": f"bytes={start}-{start + length - 1}"}
        if self._signer is not None:
            headers = self._signer.sign("GET", self._host_header, request_path, headers)
        else:
            headers["host"] = self._host_header
        try:
            response = self._send(request_path, headers, attempt)
            if response.status == 200 and start != 0:
                self._drop_connection()
                raise StoreError(f"{what}: the server ignored the byte range (HTTP 200)")
            if response.status in (200, 206):
                return consume(response)
            body = response.read(_ERROR_BODY_LIMIT)
            self._drop_connection()
            if response.status == 416:  # the range starts at or past the end
                return 0
            raise _status_error(response.status, body, what)
        except StoreError:
            raise  # already ours (an HTTP status, a short body); also an OSError
        except (OSError, http.client.HTTPException) as exc:
            self._drop_connection()
            if attempt.aborted:
                raise TransientStoreError(f"{what}: abandoned (timeout or cancelled)") from exc
            raise TransientStoreError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            self._drop_connection()
            raise
        finally:
            attempt.detach()

    def _send(self, request_path: str, headers: dict[str, str], attempt: _Attempt) -> http.client.HTTPResponse:
        """Send the GET and read the response head; once more on a new connection if a
        kept-alive one turns out closed by the server (an idle timeout, not a failure)."""
        while True:
            conn = self._connection()
            reused = conn.sock is not None
            try:
                if not reused:
                    conn.connect()
                attempt.attach(conn.sock)
                conn.request("GET", request_path, headers=headers)
                return conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._drop_connection()
                if not reused or attempt.aborted:
                    raise

    def _stream(self, response: http.client.HTTPResponse, length: int, sink: ReadSink, what: str) -> int:
        """Receive the body piece by piece into this thread's buffer, handing each to ``sink``."""
        piece = getattr(self._local, "piece", None)
        if piece is None:
            piece = self._local.piece = memoryview(bytearray(STREAM_PIECE))
        expected = response.length  # None when the body is chunked
        want = length if expected is None else min(expected, length)
        sink.begin()
        handed = 0
        while handed < want:
            n = piece_size(sink, handed, min(len(piece), length - handed))
            if n > want - handed:
                break  # the object ends inside this piece: the caller sees the read short
            filled = 0
            while filled < n:
                got = response.readinto(piece[filled:n])
                if not got:
                    break
                filled += got
            if filled < n:
                self._drop_connection()
                if expected is not None:
                    raise TransientStoreError(f"{what}: body cut short ({handed + filled} of {want} bytes)")
                return handed  # a chunked body that ended early: the caller sees it short
            sink.receive(handed, piece[:n])
            handed += n
        if expected is None or handed < expected:
            self._drop_connection()  # bytes may be left unread: the connection cannot be reused
        return handed


def _status_error(status: int, body: bytes, what: str) -> StoreError:
    code = _xml_code(body)
    message = f"{what} failed (HTTP {status}{', ' + code if code else ''})"
    if status == 404:
        return ObjectNotFoundError(f"{what}: no such object")
    if status in (401, 403):
        return StorePermissionError(message)
    if status in TRANSIENT_STATUS:
        return TransientStoreError(message)
    return StoreError(message)


def _xml_code(body: bytes) -> str:
    """S3's ``<Code>`` from an error body (e.g. ``SlowDown``), or ``""``."""
    text = body.decode("utf-8", "replace")
    head, sep, rest = text.partition("<Code>")
    return rest.partition("</Code>")[0].strip()[:64] if sep else ""
