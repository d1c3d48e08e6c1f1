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

Each request gets its own upstream connection (the proxy rewrites requests to
``Connection: close``), so a fault never leaks into the next request.

    proxy = FaultProxy("127.0.0.1", 9000, latency_ms=10)
    proxy.start(); proxy.endpoint_url  # http://127.0.0.1:PORT
    proxy.set_faults(0.05, ("503", "reset", "stall"))
    proxy.stop()

``python -m backends.proxy UPSTREAM_PORT --latency-ms 40`` runs one from a shell.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

FAULT_KINDS = ("503", "429", "500", "reset", "truncate", "stall")
_STATUS_TEXT = {"503": "Slow Down", "429": "Too Many Requests", "500": "Internal Server Error"}
_ERROR_CODE = {"503": "SlowDown", "429": "TooManyRequests", "500": "InternalError"}


@dataclass
class ProxyStats:
    requests: int = 0
    faults: dict[str, int] = field(default_factory=dict)

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
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.latency_ms = latency_ms
        self.stall_seconds = stall_seconds
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.set_faults(fault_rate, fault_kinds)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_faults(self, rate: float, kinds: Sequence[str] = FAULT_KINDS, *, only: str | None = None) -> None:
        """Fault ``rate`` (0..1) of the requests from now on, drawing kinds uniformly.

        ``only``: fault just the requests whose request line (``PUT /b/k?partNumber=2 HTTP/1.1``)
        contains this text, e.g. ``"partNumber="`` for the parts of multipart uploads.
        """
        unknown = set(kinds) - set(FAULT_KINDS)
        if unknown or not 0.0 <= rate <= 1.0 or (rate > 0 and not kinds):
            raise ValueError(f"bad fault settings: rate={rate}, kinds={kinds}")
        with self._lock:
            self.fault_rate = rate
            self.fault_kinds = tuple(kinds)
            self.fault_only = only.encode() if only else None

    def _draw(self, request_line: bytes) -> str | None:
        with self._lock:
            self.stats.requests += 1
            if self.fault_only is not None and self.fault_only not in request_line:
                return None
            if self.fault_rate and self._rng.random() < self.fault_rate:
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
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
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

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        loop.call_soon_threadsafe(lambda: loop.create_task(shutdown()))
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None

    def __enter__(self) -> FaultProxy:
        return self.start() if self._loop is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ one connection

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream_w: asyncio.StreamWriter | None = None
        try:
            head = await client_r.readuntil(b"\r\n\r\n")
            fault = self._draw(head.split(b"\r\n", 1)[0])
            await self._delay()
            if fault in _STATUS_TEXT:
                await self._answer_error(client_w, fault)
                return
            upstream_r, upstream_w = await asyncio.open_connection(*self.upstream)
            upstream_w.write(_force_close(head))
            await asyncio.gather(
                self._pipe(client_r, upstream_w, None),
                self._pipe(upstream_r, client_w, fault),
            )
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            raise
        finally:
            for w in (client_w, upstream_w):
                if w is not None and not w.is_closing():
                    w.close()

    async def _delay(self) -> None:
        if self.latency_ms:
            await asyncio.sleep(self.latency_ms / 2000)

    async def _answer_error(self, w: asyncio.StreamWriter, status: str) -> None:
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{_ERROR_CODE[status]}</Code>'
            f"<Message>injected by the fault proxy</Message></Error>"
        ).encode()
        w.write(
            f"HTTP/1.1 {status} {_STATUS_TEXT[status]}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await w.drain()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, fault: str | None) -> None:
        """Copy ``r`` to ``w`` with one-way latency; apply a response fault past the first chunk."""
        sent = 0
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        delay = self.latency_ms / 2000

        async def writer() -> None:
            nonlocal sent
            while True:
                due, chunk = await queue.get()
                if not chunk:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if fault is not None:  # midway through the response: half of its first chunk, then the fault
                    w.write(chunk[: len(chunk) // 2])
                    await w.drain()
                    await self._apply(fault, w)
                    return
                w.write(chunk)
                await w.drain()
                sent += len(chunk)
            if w.can_write_eof():
                w.write_eof()

        task = asyncio.ensure_future(writer())
        try:
            while not task.done():
                chunk = await r.read(1 << 16)
                await queue.put((time.monotonic() + delay, chunk))
                if not chunk:
                    break
            await task
        finally:
            task.cancel()

    async def _apply(self, fault: str, w: asyncio.StreamWriter) -> None:
        if fault == "stall":
            await asyncio.sleep(self.stall_seconds)
        sock = w.get_extra_info("socket")
        if fault == "reset" and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        w.close()
        raise ConnectionResetError(f"injected {fault}")


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
