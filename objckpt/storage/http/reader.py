"""Ranged GETs over plain HTTP, streamed to a sink a few MiB at a time.

Why it exists beside the stores' own clients: obstore and gcsfs hand back
each response whole, in a buffer they allocate. That is right when the
buffer becomes the restored array, but a restore onto another sharding
copies every byte it reads into target boxes, in runs as short as 1 KiB.
Out of a whole response those copies read cold memory, and every response
faults in fresh pages first. Here each thread receives a few MiB into one
buffer it reuses and hands them to restore's sink at once, while they are in
cache (docs/PERFORMANCE.md has the measurements).

How: ``http.client`` over one keep-alive connection per worker thread, the
body received with ``recv_into`` (no copy in user space). Subclasses say how
an object's path becomes a request and how it is authorized (S3: a URL
presigned by obstore, :mod:`objckpt.storage.http.s3`; GCS: a bearer token
from google-auth, :mod:`objckpt.storage.http.gcs`); nothing here signs.

TLS and proxies are the standard library's: an ``https://`` endpoint is
verified against the context given (a custom CA bundle) or the system roots,
and a proxy named by ``HTTPS_PROXY``/``HTTP_PROXY`` (unless ``NO_PROXY``
matches) is used as a ``CONNECT`` tunnel (:mod:`objckpt.storage.http.network`).

Timeouts and cancellation: the socket has the request timeout (a stalled
server fails the read), and a caller that gives up (its own deadline, or a
cancelled restore) shuts the socket down and waits for the thread to stop
before it returns, so the sink is never called after that. Credentials never
reach a message or a log.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import http.client
import socket
import ssl
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from objckpt.errors import ObjectNotFoundError, StoreError, StorePermissionError, TransientStoreError
from objckpt.storage.base import Store
from objckpt.storage.errors import TRANSIENT_STATUS, transient_error
from objckpt.storage.http.network import proxy_for
from objckpt.storage.streaming import STREAM_PIECE, ReadSink, piece_size
from objckpt.storage.urls import check_relative

ERROR_BODY_LIMIT = 2048  # bytes of an error response kept for its code (S3's XML <Code>, GCS's JSON reason)
_WORKERS = 64  # threads per reader; the transfer engine's slots bound requests in flight


class Attempt:
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


class HttpRangeReader:
    """Ranged GETs of one service's objects, streamed to a sink (see the module doc).

    Args:
        endpoint: ``http(s)://host[:port][/path]``.
        service: What the endpoint is, for messages (``S3``, ``GCS``).
        host: Connect to this host instead of the endpoint's (S3 virtual-hosted buckets).
        timeout: Socket timeout, seconds (connect and each receive).
        ssl_context: Verifies an ``https://`` endpoint (a custom CA bundle's,
            :func:`objckpt.storage.http.network.ssl_context`); the system roots by default.
    """

    #: ``NO_PROXY`` addresses and networks bypass the proxy, as for the client beside this reader
    no_proxy_networks = False

    def __init__(
        self,
        *,
        endpoint: str,
        service: str,
        host: str | None = None,
        timeout: float = 60.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{service} endpoint must be http(s)://host[:port], got {parts.scheme}://{parts.hostname}")
        self._https = parts.scheme == "https"
        self._port = parts.port or (443 if self._https else 80)
        self._connect_host = host or parts.hostname
        default_port = 443 if self._https else 80
        self._host_header = self._connect_host + (f":{parts.port}" if parts.port not in (None, default_port) else "")
        self._endpoint_path = parts.path.rstrip("/")
        self.timeout = float(timeout)
        self._ssl = (ssl_context or ssl.create_default_context()) if self._https else None
        self._proxy = proxy_for(f"{parts.scheme}://{self._host_header}/", networks=self.no_proxy_networks)
        self._local = threading.local()
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._connections: set[http.client.HTTPConnection] = set()  # every open one, for close()

    # ------------------------------------------------------------ for subclasses

    def _request_path(self, path: str) -> str:
        """The request target (URI-encoded path and query) that GETs object ``path``."""
        raise NotImplementedError

    def _authorize(self, request_path: str, headers: dict[str, str]) -> dict[str, str]:
        """The headers to send with a GET of ``request_path`` (``headers`` plus host and auth)."""
        return {**headers, "host": self._host_header}

    def _error_code(self, body: bytes) -> str:
        """The service's error code in an error response's body (e.g. ``SlowDown``), or ``""``."""
        return ""

    # ---------------------------------------------------------------- async side

    async def read_streamed(self, path: str, start: int, length: int, sink: ReadSink, what: str) -> int:
        """Hand bytes ``[start, start + length)`` of object ``path`` to ``sink`` as they arrive,
        each piece received into this thread's reused buffer (``Store.get_range_streamed``).

        Returns how many bytes were handed over: fewer only when the object ends
        first (0 when ``start`` is at or past its end). Raises :class:`ObjectNotFoundError`,
        :class:`StorePermissionError`, :class:`TransientStoreError` (timeouts,
        resets, 429/5xx, a body cut short), :class:`StoreError`, naming ``what``,
        or whatever the sink raises. Once it returns or raises, the sink is not
        called any more.
        """
        attempt = Attempt()
        future = self._pool().submit(self._read, path, start, length, sink, what, attempt)
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
        """Close every connection and let the worker threads go once idle.

        A read still in flight fails (its socket is closed). The reader stays
        usable: a later read starts new threads and connections.
        """
        with self._executor_lock:
            executor, self._executor = self._executor, None
            connections, self._connections = self._connections, set()
        if executor is not None:
            executor.shutdown(wait=False)
        for conn in connections:
            conn.close()

    # ---------------------------------------------------------- worker threads

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            proxy = self._proxy
            host, port = (proxy.host, proxy.port) if proxy is not None else (self._connect_host, self._port)
            if self._https:
                conn = http.client.HTTPSConnection(host, port, timeout=self.timeout, context=self._ssl)
            else:
                conn = http.client.HTTPConnection(host, port, timeout=self.timeout)
            if proxy is not None:  # TLS (if any) runs end to end inside the tunnel
                auth = {"Proxy-Authorization": proxy.authorization} if proxy.authorization else None
                conn.set_tunnel(self._connect_host, self._port, headers=auth)
            self._local.conn = conn
        with self._executor_lock:
            self._connections.add(conn)  # again after close(), which leaves the thread's conn closed
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._executor_lock:
                self._connections.discard(conn)
            conn.close()

    def _read(self, path: str, start: int, length: int, sink: ReadSink, what: str, attempt: Attempt) -> int:
        request_path = self._request_path(path)
        headers = self._authorize(request_path, {"range": f"bytes={start}-{start + length - 1}"})
        with self._failures(what, attempt):
            response = self._send(request_path, headers, attempt)
            if response.status == 200 and start != 0:
                self._drop_connection()
                raise StoreError(f"{what}: the server ignored the byte range (HTTP 200)")
            if response.status in (200, 206):
                return self._stream(response, length, sink, what)
            body = response.read(ERROR_BODY_LIMIT)
            self._drop_connection()
            if response.status == 416:  # the range starts at or past the end
                return 0
            raise status_error(response.status, self._error_code(body), what)

    @contextlib.contextmanager
    def _failures(self, what: str, attempt: Attempt) -> Iterator[None]:
        """Around one request on this thread's connection: a socket or protocol failure becomes
        a :class:`TransientStoreError` naming ``what``, and any failure but one of ours (an HTTP
        status, a short body) drops the connection, which may hold unread bytes."""
        try:
            yield
        except StoreError:
            raise  # already ours; also an OSError
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

    def _send(
        self,
        request_path: str,
        headers: dict[str, str],
        attempt: Attempt,
        method: str = "GET",
        body: Sequence[memoryview] = (),
    ) -> http.client.HTTPResponse:
        """Send the request (``body``: its parts, each handed to the socket as it lies; the
        headers say its length) and read the response head; once more on a new connection if
        a kept-alive one turns out closed by the server (an idle timeout, not a failure)."""
        while True:
            conn = self._connection()
            reused = conn.sock is not None
            try:
                if not reused:
                    conn.connect()
                attempt.attach(conn.sock)
                if body:
                    has_host = any(name.lower() == "host" for name in headers)
                    conn.putrequest(method, request_path, skip_host=has_host, skip_accept_encoding=True)
                    for name, value in headers.items():
                        conn.putheader(name, value)
                    conn.endheaders()
                    for part in body:
                        conn.sock.sendall(part)
                else:
                    conn.request(method, request_path, headers=headers)
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


def status_error(status: int, code: str, what: str) -> StoreError:
    """Our error for an HTTP error status (and the service's code for it, if any)."""
    message = f"{what} failed (HTTP {status}{', ' + code if code else ''})"
    if status == 404:
        return ObjectNotFoundError(f"{what}: no such object")
    if status in (401, 403):
        return StorePermissionError(message)
    if status in TRANSIENT_STATUS:
        return transient_error(status, message)
    return StoreError(message)


class StreamingStore(Store):
    """A store whose ranged reads stream through an :class:`HttpRangeReader` when it holds one.

    The one place a store's ``get_range_streamed`` chooses between its reader and the
    contract's fallback (read, then hand over), shared by the fsspec and obstore stores.
    Subclasses call :meth:`_use_range_reader` when they open, and say how a key becomes
    the reader's object path (``_path``) and a URL in messages (``_url``).
    """

    request_timeout: float
    _range_reader: HttpRangeReader | None = None

    def _use_range_reader(self, reader: HttpRangeReader | None) -> None:
        """Stream ranged reads through ``reader`` (None: the contract's fallback); its
        :meth:`~objckpt.storage.base.Store.child` stores share it."""
        self._range_reader = reader
        self.streams_reads = reader is not None

    @abc.abstractmethod
    def _path(self, key: str) -> str:
        """The object path of ``key`` that the reader requests."""

    @abc.abstractmethod
    def _url(self, key: str) -> str:
        """The URL of ``key`` that messages name (credentials stripped)."""

    async def get_range_streamed(self, key: str, *, start: int, end: int, sink: ReadSink) -> int:
        """Hand bytes ``[start, end)`` to ``sink`` as they arrive through the range reader
        when there is one (see :mod:`objckpt.storage.streaming`), under the store's request
        timeout (a :class:`TransientStoreError` past it); else read, then hand over."""
        reader = self._range_reader
        if reader is None or end <= start:
            return await super().get_range_streamed(key, start=start, end=end, sink=sink)
        check_relative(key, "key", allow_empty=False, allow_partial=False)
        url = self._url(key)
        if start < 0:
            raise ValueError(f"invalid byte range start {start} for {url}")
        what = f"get {url} bytes [{start}, {end})"
        timeout = self.request_timeout
        try:
            return await asyncio.wait_for(
                reader.read_streamed(self._path(key), start, end - start, sink, what), timeout
            )
        except TimeoutError as exc:
            raise TransientStoreError(f"{what} timed out after {timeout:g} s") from exc

    async def close(self) -> None:
        """Close the range reader's connections and let its threads go; the client's own
        connections are released when it is collected. A store (or a :meth:`child`, which
        shares the reader) used after this opens new ones."""
        if self._range_reader is not None:
            self._range_reader.close()
