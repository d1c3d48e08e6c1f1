"""HTTPS in front of the local servers: a throwaway certificate authority and a TLS front.

SeaweedFS and fake-gcs-server speak plain HTTP here, but the clients objckpt
ships with meet HTTPS in every real deployment, and certificate trust
(``AWS_CA_BUNDLE``, ``SSL_CERT_FILE``) is a path of its own. :class:`TestCA`
(``trustme`` makes the certificates) writes a CA file the clients are told to
trust; :class:`TlsFront` terminates TLS with a certificate for ``127.0.0.1``
and pipes the decrypted bytes to the plain server, one upstream connection per
client connection, so keep-alive behaves as it would against the real store.

The front does not parse HTTP: it is a byte splice, the one written here by
hand (:class:`SpliceEnd`, shared with :mod:`backends.connect_proxy`). It costs
little CPU because it is made of ``asyncio.Protocol`` callbacks, 1 MiB reads on
the plain side and transport flow control, with no streams or coroutines per
chunk: it stands in HTTPS-versus-HTTP throughput benchmarks.

    ca = TestCA.create()
    with TlsFront("127.0.0.1", 9000, ca) as front:
        front.endpoint_url  # https://127.0.0.1:PORT, trusted through ca.env()
"""

from __future__ import annotations

import asyncio
import ssl
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    import trustme

_HOSTS = ("127.0.0.1", "localhost", "::1")
# Bytes per receive on plain sockets (asyncio's default, 256 KiB, means 4x the callbacks per GiB).
_READ_SIZE = 1 << 20
_WRITE_HIGH = 4 << 20  # a transport holding this much unsent pauses whoever feeds it
_CONNECT_TIMEOUT_S = 10.0
_HANDSHAKE_TIMEOUT_S = 10.0


@dataclass
class TestCA:
    """A certificate authority made for one test session; nothing outside it trusts it.

    ``ca_file`` is the CA certificate in PEM, for ``AWS_CA_BUNDLE``, ``SSL_CERT_FILE``
    and ``REQUESTS_CA_BUNDLE`` (:meth:`env`); the private keys stay in memory.
    """

    __test__ = False  # not a pytest test class, whatever its name says

    ca: trustme.CA = field(repr=False)
    ca_file: Path
    _server_context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)

    @classmethod
    def create(cls, directory: Path | None = None) -> TestCA:
        """A new CA, its certificate written to ``directory/ca.pem`` (a fresh temp dir by default)."""
        directory = Path(tempfile.mkdtemp(prefix="objckpt-ca-")) if directory is None else Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        import trustme  # a dev dependency: imported when a CA is made, not with the package

        ca = trustme.CA()
        ca_file = directory / "ca.pem"
        ca.cert_pem.write_to_path(str(ca_file))
        return cls(ca=ca, ca_file=ca_file)

    @property
    def ca_pem(self) -> bytes:
        return self.ca.cert_pem.bytes()

    def server_context(self) -> ssl.SSLContext:
        """A server context with a certificate for 127.0.0.1, localhost and ::1 (made once)."""
        if self._server_context is None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self.ca.issue_cert(*_HOSTS).configure_cert(context)
            self._server_context = context
        return self._server_context

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts this CA and nothing else."""
        return ssl.create_default_context(cadata=self.ca_pem.decode())  # with cadata, no system roots

    def env(self) -> dict[str, str]:
        """The variables that make botocore, requests and OpenSSL-based clients trust this CA."""
        path = str(self.ca_file)
        return {"AWS_CA_BUNDLE": path, "SSL_CERT_FILE": path, "REQUESTS_CA_BUNDLE": path}


# ---------------------------------------------------------------------- the splice


class SpliceEnd(asyncio.Protocol):
    """One end of two spliced connections: what it reads, the other end's transport writes.

    Bytes that arrive before the other end is joined are held (and reading
    paused). Writing back-pressure pauses the reader on the other side. An EOF
    is passed on as a half-close where both transports can carry one (plain
    TCP), else as a close once the buffer is flushed (TLS ends a connection at
    EOF); a reset is passed on as an abort. ``on_closed`` runs once, when this
    end's connection is gone.
    """

    def __init__(self, on_closed: Callable[[SpliceEnd], None] | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.other: SpliceEnd | None = None
        self.eof = False
        self._held: list[bytes] = []
        self._on_closed = on_closed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH)
        if hasattr(transport, "max_size"):  # plain selector transports only
            transport.max_size = _READ_SIZE
        if self.other is None:
            transport.pause_reading()

    def join(self, other: SpliceEnd) -> None:
        """Splice this end to ``other`` (both connected): held bytes go first, then reading resumes.

        If this end's connection is already closing, ``other`` is closed instead.
        """
        if self.transport is None or self.transport.is_closing():
            other.close()
            return
        self.other, other.other = other, self
        for end in (self, other):
            held, end._held = end._held, []
            for data in held:
                end.data_received(data)
            if end.transport is not None and not end.transport.is_closing():
                end.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        other = self.other
        if other is None or other.transport is None:
            self._held.append(data)
            return
        other.transport.write(data)

    def eof_received(self) -> bool:
        self.eof = True
        other = self.other.transport if self.other is not None else None
        if other is None or other.is_closing():
            return False
        mine = self.transport
        if self.other is not None and not self.other.eof and other.can_write_eof() and mine and mine.can_write_eof():
            other.write_eof()
            return True  # half-closed (plain TCP both ways): the other direction still flows
        other.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        other = self.other.transport if self.other is not None else None
        if other is not None and not other.is_closing():
            if exc is None:
                other.close()  # after what it holds is flushed
            else:
                other.abort()
        if self._on_closed is not None:
            callback, self._on_closed = self._on_closed, None
            callback(self)

    def pause_writing(self) -> None:  # the far side reads slower than this end is fed
        other = self.other.transport if self.other is not None else None
        if other is not None:
            other.pause_reading()

    def resume_writing(self) -> None:
        other = self.other.transport if self.other is not None else None
        if other is not None and not other.is_closing():
            other.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        """Drop both connections at once."""
        for end in (self, self.other):
            if end is not None and end.transport is not None:
                end.transport.abort()


async def open_end(host: str, port: int) -> SpliceEnd | None:
    """A connection to ``host:port`` as an unjoined :class:`SpliceEnd` (reading paused); None if it fails."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(_CONNECT_TIMEOUT_S):
            _, far = await loop.create_connection(SpliceEnd, host, port)
    except (OSError, TimeoutError):
        return None
    return far


def stop_loop(
    loop: asyncio.AbstractEventLoop,
    server: asyncio.base_events.Server | None,
    connections: set[Any],
    thread: threading.Thread | None,
) -> None:
    """Stop a server's event loop running in ``thread``, from another thread: close the
    server, abort every connection (each has ``abort()``), cancel what is left, join."""

    async def shutdown() -> None:
        if server is not None:
            server.close()
        for connection in list(connections):
            connection.abort()
        for _ in range(2):  # the transports close their sockets in callbacks of their own
            await asyncio.sleep(0)
        tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        loop.stop()

    loop.call_soon_threadsafe(lambda: loop.create_task(shutdown()))
    if thread is not None:
        thread.join(10)


class LoopServer:
    """An asyncio server on 127.0.0.1:0 in a daemon thread of its own, and every connection it holds.

    Subclasses give :meth:`_protocol` (built on the loop thread for each
    accepted connection) and may give an SSL context; the connections they
    :meth:`_track` are aborted by :meth:`stop`.
    """

    _thread_name = "loop-server"

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl = ssl_context
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._live: set[SpliceEnd] = set()  # open ends, touched on the loop thread only
        self.port = 0

    def _protocol(self) -> asyncio.BaseProtocol:
        raise NotImplementedError

    def _track(self, end: SpliceEnd) -> None:
        self._live.add(end)

    def _forget(self, end: SpliceEnd) -> None:
        self._live.discard(end)

    def start(self) -> Self:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                timeout = _HANDSHAKE_TIMEOUT_S if self._ssl is not None else None
                self._server = loop.run_until_complete(
                    loop.create_server(self._protocol, "127.0.0.1", 0, ssl=self._ssl, ssl_handshake_timeout=timeout)
                )
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name=self._thread_name, daemon=True)
        self._thread.start()
        if not ready.wait(10) or failure:
            self._loop = None
            raise RuntimeError(f"{type(self).__name__} did not start") from (failure[0] if failure else None)
        return self

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            stop_loop(loop, self._server, self._live, self._thread)

    def __enter__(self) -> Self:
        return self.start() if self._loop is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------- the TLS front


@dataclass
class TlsFrontStats:
    connections: int = 0  # TLS connections accepted (handshake done)


class TlsFront(LoopServer):
    """TLS on 127.0.0.1 in front of a plain server: each connection piped byte for byte."""

    _thread_name = "tls-front"

    def __init__(self, upstream_host: str, upstream_port: int, ca: TestCA) -> None:
        super().__init__(ca.server_context())
        self.upstream = (upstream_host, upstream_port)
        self.ca = ca
        self.stats = TlsFrontStats()

    @property
    def endpoint_url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _protocol(self) -> asyncio.BaseProtocol:
        return _FrontEnd(self)


class _FrontEnd(SpliceEnd):
    """A client's TLS connection: on arrival, its upstream connection is opened and joined."""

    def __init__(self, front: TlsFront) -> None:
        super().__init__(front._forget)
        self._front = front
        self._connecting: asyncio.Task[None] | None = None  # held: the loop keeps only weak references

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # reading stays paused until upstream is joined
        front = self._front
        front.stats.connections += 1
        front._track(self)
        self._connecting = asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        far = await open_end(*self._front.upstream)
        if far is None:
            self.close()
        else:
            self.join(far)
