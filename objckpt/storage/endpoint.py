"""A configured endpoint that refuses connections: said at once, naming the endpoint and its setting.

A store pointed at an endpoint of its user's choosing (``endpoint_url``, the
``AWS_ENDPOINT_URL`` variables, ``STORAGE_EMULATOR_HOST``) where no server
listens would otherwise fail the way a flaky network does: each request
refused, retried by the clients (botocore retries a refused connection inside
one s3fs call) and by the transfer engine, for 10 to 25 seconds, ending in an
``error sending request`` that names neither the address nor where it came
from. A refusal is the one answer no retry cures while the address stays
wrong.

So before a store's first request, :meth:`ConfiguredEndpoint.check` connects
to the endpoint's host and port (at most :data:`PROBE_ATTEMPTS` connects,
:data:`PROBE_TIMEOUT_S` each, :data:`PROBE_PAUSE_S` apart). If every connect
is refused it raises :class:`~objckpt.errors.EndpointRefusedError` saying
"connection refused", the ``host:port``, and the setting; any other outcome
(it connects, times out, the name does not resolve) lets the request go
ahead as before. An endpoint that accepted a connection once in this process
is not probed again, so a server that restarts later is retried like any
transient fault. No probe is made where the store's client would go through a
proxy (``HTTPS_PROXY``/``HTTP_PROXY`` without a ``NO_PROXY`` match, matched as
that client matches it): a direct connection says nothing about the proxied route.
"""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from objckpt.errors import EndpointRefusedError
from objckpt.storage.http.network import in_networks

#: Connects tried before an endpoint is called refused, each within PROBE_TIMEOUT_S, PROBE_PAUSE_S apart.
PROBE_ATTEMPTS = 2
PROBE_TIMEOUT_S = 0.5
PROBE_PAUSE_S = 0.2

_answered: set[tuple[str, int]] = set()
_answered_lock = threading.Lock()


class ConfiguredEndpoint:
    """An endpoint a store was configured with, and the setting that named it.

    Args:
        url: The endpoint (``http://host:port``; a bare ``host:port`` is read as ``http``).
        setting: Where it came from, as the user wrote it (``"storage_options['endpoint_url']"``,
            ``"AWS_ENDPOINT_URL_S3"``, ...).
        networks: The store's client, as obstore's (not botocore's nor aiohttp's), lets ``NO_PROXY``
            addresses and networks bypass the proxy (:func:`~objckpt.storage.http.network.in_networks`).
    """

    def __init__(self, url: str, setting: str, *, networks: bool = False) -> None:
        self.url = url if "://" in url else f"http://{url}"
        self.setting = setting
        parts = urlsplit(self.url)
        self.scheme = parts.scheme.lower()
        self.host = parts.hostname or ""
        try:
            port = parts.port
        except ValueError:
            port = None
        self.port = port or (443 if self.scheme == "https" else 80)
        self._checked = not self.host or _proxied(self.url, networks=networks)

    def __repr__(self) -> str:
        return f"ConfiguredEndpoint({self.address!r} from {self.setting})"

    @property
    def address(self) -> str:
        """``host:port`` (IPv6 hosts bracketed)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def check(self, what: str) -> None:
        """Raise :class:`EndpointRefusedError` if the endpoint refuses every connect; once per
        endpoint per process when it answers (see the module docstring).

        Args:
            what: The operation about to run and its URL, for the message (``"list s3://b/x"``).
        """
        if self._checked:
            return
        key = (self.host, self.port)
        with _answered_lock:
            known = key in _answered
        if known:
            self._checked = True
            return
        outcome = await _probe(self.host, self.port)
        if outcome == "refused":
            raise EndpointRefusedError(
                f"{what} failed: connection refused by {self.address}, the endpoint set by {self.setting} "
                f"({self.url}): no server listens there; check {self.setting} (and that the server is running)"
            )
        self._checked = True
        if outcome == "open":
            with _answered_lock:
                _answered.add(key)


async def _probe(host: str, port: int) -> str:
    """``"open"`` if a connect succeeds, ``"refused"`` if every attempt is refused, else ``"unknown"``."""
    for attempt in range(PROBE_ATTEMPTS):
        if attempt:
            await asyncio.sleep(PROBE_PAUSE_S)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_TIMEOUT_S)
        except ConnectionRefusedError:
            continue
        except (OSError, TimeoutError):  # unresolvable, unreachable, filtered: not ours to judge
            return "unknown"
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
        return "open"
    return "refused"


def _proxied(url: str, *, networks: bool) -> bool:
    """Whether the store's client, reading the proxy variables, would reach ``url`` through a proxy."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    if not proxies.get(parts.scheme.lower()) and not proxies.get("all"):
        return False
    if networks and in_networks(parts.hostname or "", proxies.get("no", "")):
        return False
    return not urllib.request.proxy_bypass(parts.netloc or "")


def endpoint_of(store: Any) -> str:
    """Where ``store`` (or the store a retrying wrapper holds, its ``inner``) sends its requests,
    for messages: ``host:port (the setting that named it)``; ``""`` for a cloud's own endpoint."""
    configured = getattr(getattr(store, "inner", store), "configured_endpoint", None)
    return f"{configured.address} ({configured.setting})" if isinstance(configured, ConfiguredEndpoint) else ""


def s3_endpoint(options: Mapping[str, Any], environ: Mapping[str, str]) -> ConfiguredEndpoint | None:
    """The endpoint of an ``s3://`` store's options and environment, in botocore's precedence, or None (AWS's own)."""
    client = options.get("client_kwargs") or {}
    candidates = (
        (options.get("endpoint_url"), "storage_options['endpoint_url']"),
        (
            client.get("endpoint_url") if isinstance(client, Mapping) else None,
            "storage_options['client_kwargs']['endpoint_url']",
        ),
        (environ.get("AWS_ENDPOINT_URL_S3"), "AWS_ENDPOINT_URL_S3"),
        (environ.get("AWS_ENDPOINT_URL"), "AWS_ENDPOINT_URL"),
    )
    for value, setting in candidates:
        if value:
            return ConfiguredEndpoint(str(value).rstrip("/"), setting)
    return None


def gcs_endpoint(options: Mapping[str, Any], environ: Mapping[str, str]) -> ConfiguredEndpoint | None:
    """The endpoint of a ``gs://`` store (``endpoint_url``, else ``STORAGE_EMULATOR_HOST``), or None (Google's)."""
    if options.get("endpoint_url"):
        return ConfiguredEndpoint(str(options["endpoint_url"]).rstrip("/"), "storage_options['endpoint_url']")
    emulator = environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator and emulator != "default":
        return ConfiguredEndpoint(emulator.rstrip("/"), "STORAGE_EMULATOR_HOST")
    return None
