"""An HTTP CONNECT proxy on loopback, as corporate and cluster egress proxies are.

Clients configured with ``HTTPS_PROXY`` (or botocore's ``proxies``, obstore's
``proxy_url``) open a tunnel with ``CONNECT host:port`` and run TLS through it;
this proxy answers ``200 Connection established`` and then splices the two
connections byte for byte (:class:`backends.tls.SpliceEnd`, the same splice as
the TLS front), keep-alive included. Any other method gets ``405``. With
``require_auth=(user, password)`` a tunnel needs ``Proxy-Authorization: Basic``
with those, else ``407``. ``stats.tunnels`` counts tunnels by ``host:port``,
so a test can tell that its client really went through the proxy.

Only the CONNECT request head is parsed here (the one part no library does
for a server this small); what flows through the tunnel is never looked at.

    with ConnectProxy() as proxy:
        env = {"HTTPS_PROXY": proxy.url}
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
from collections import Counter
from dataclasses import dataclass, field

from backends.tls import LoopServer, SpliceEnd, open_end

_HEAD_LIMIT = 1 << 14  # a CONNECT head longer than this is refused
_HEAD_TIMEOUT_S = 10.0  # a client that sends no whole head in this time is dropped


@dataclass
class ConnectProxyStats:
    tunnels: Counter[str] = field(default_factory=Counter)  # opened, by "host:port"
    refused: int = 0  # not CONNECT (405), bad credentials (407), unreachable target (502)


class ConnectProxy(LoopServer):
    """An HTTP proxy that serves ``CONNECT`` tunnels only."""

    _thread_name = "connect-proxy"

    def __init__(self, *, require_auth: tuple[str, str] | None = None) -> None:
        super().__init__()
        self._auth = None
        if require_auth is not None:
            self._auth = "Basic " + base64.b64encode(f"{require_auth[0]}:{require_auth[1]}".encode()).decode()
        self.stats = ConnectProxyStats()

    def __repr__(self) -> str:  # the credentials stay out
        return f"ConnectProxy(url={self.url!r}, auth={self._auth is not None})"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _protocol(self) -> asyncio.BaseProtocol:
        return _TunnelEnd(self)

    def _authorized(self, header: str | None) -> bool:
        if self._auth is None:
            return True
        if header is None:
            return False
        try:  # normalise the encoding before comparing
            scheme, _, value = header.strip().partition(" ")
            decoded = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            return False
        offered = f"{scheme.capitalize()} {base64.b64encode(decoded).decode()}"
        return hmac.compare_digest(offered.encode(), self._auth.encode())


class _TunnelEnd(SpliceEnd):
    """A client's connection: reads the CONNECT head, then is spliced to the target."""

    def __init__(self, proxy: ConnectProxy) -> None:
        super().__init__(proxy._forget)
        self._proxy = proxy
        self._head: bytearray | None = bytearray()  # None once the head has been read
        self._tasks: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        self.transport.resume_reading()  # the head is read before any join
        self._proxy._track(self)
        self._timer = asyncio.get_running_loop().call_later(_HEAD_TIMEOUT_S, self.abort)

    def data_received(self, data: bytes) -> None:
        if self._head is None:
            super().data_received(data)
            return
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > _HEAD_LIMIT:
                self._refuse("431 Request Header Fields Too Large")
            return
        head, rest = bytes(self._head[: end + 4]), bytes(self._head[end + 4 :])
        self._head = None
        if self._timer is not None:
            self._timer.cancel()
        assert self.transport is not None
        self.transport.pause_reading()  # until the target is joined
        if rest:
            self._held.append(rest)  # a client that did not wait for the 200 (TLS hello)
        self._begin(head)

    def _begin(self, head: bytes) -> None:
        request_line, *lines = head.decode("latin-1").split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or parts[0] != "CONNECT":
            self._refuse("405 Method Not Allowed", "this proxy serves CONNECT tunnels only\n", allow=True)
            return
        headers = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if not self._proxy._authorized(headers.get("proxy-authorization")):
            self._refuse("407 Proxy Authentication Required", "proxy credentials needed\n", challenge=True)
            return
        host, sep, port = parts[1].rpartition(":")
        if not sep or not port.isdigit():
            self._refuse("400 Bad Request", "CONNECT needs host:port\n")
            return
        task = asyncio.get_running_loop().create_task(self._open(host.strip("[]"), int(port), parts[1]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open(self, host: str, port: int, target: str) -> None:
        far = await open_end(host, port)
        if far is None:
            self._refuse("502 Bad Gateway", f"cannot reach {target}\n")
            return
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 200 Connection established\r\n\r\n")  # before any byte of the target's
            self._proxy.stats.tunnels[target] += 1
        self.join(far)

    def _refuse(self, status: str, text: str = "", *, allow: bool = False, challenge: bool = False) -> None:
        self._proxy.stats.refused += 1
        body = text.encode()
        extra = ("Allow: CONNECT\r\n" if allow else "") + (
            'Proxy-Authenticate: Basic realm="objckpt-test"\r\n' if challenge else ""
        )
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(
                f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                f"{extra}Connection: close\r\n\r\n".encode()
                + body
            )
        self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        super().connection_lost(exc)
