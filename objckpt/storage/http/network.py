"""Where a request goes and whom it trusts: proxies and CA bundles, from the standard places.

The stores' own clients (obstore, botocore, aiohttp under gcsfs) each read
these settings their own way; objckpt's streamed readers
(:mod:`objckpt.storage.http.reader`) and its GCS uploads read them here, the
same way curl, requests and the AWS and Google SDKs do, so one environment
configures every path:

* **Proxies**: ``HTTPS_PROXY``/``https_proxy`` for ``https://`` endpoints,
  ``HTTP_PROXY``/``http_proxy`` for ``http://`` ones, both skipped for hosts
  matched by ``NO_PROXY``/``no_proxy`` (the standard library's
  ``urllib.request`` rules, and for the reader beside obstore, addresses and
  networks such as ``127.0.0.0/8`` as obstore matches them). A proxy URL may
  carry ``user:password@``.
* **Trusted CAs**: an explicit CA bundle (a storage option, or
  ``AWS_CA_BUNDLE``, else ``REQUESTS_CA_BUNDLE``, for S3 as botocore reads
  them, and ``REQUESTS_CA_BUNDLE`` for GCS as Google's clients do) is trusted
  *instead of* the system roots, as botocore and requests do; without one,
  the system roots, which OpenSSL lets ``SSL_CERT_FILE``/``SSL_CERT_DIR`` replace.

Nothing here changes process-global state.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import ssl
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit


@dataclass(frozen=True)
class Proxy:
    """An HTTP proxy to tunnel through (``CONNECT``); the credentials never show in ``repr``."""

    host: str
    port: int
    authorization: str | None = field(default=None, repr=False)  # a ``Proxy-Authorization`` value


def proxy_for(url: str, environ: Mapping[str, str] | None = None, *, networks: bool = False) -> Proxy | None:
    """The proxy the environment names for ``url``, or None (none set, or ``NO_PROXY`` matches;
    with ``networks``, also by :func:`in_networks`, as the client beside this reader does).

    Raises:
        ValueError: the proxy variable is not an ``http://host[:port]`` URL.
    """
    env = os.environ if environ is None else environ
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    proxies = _proxies(tuple(sorted((k, v) for k, v in env.items() if k.lower().endswith("_proxy"))))
    proxy_url = proxies.get(scheme)
    if not proxy_url or not parts.hostname:
        return None
    host = parts.hostname + (f":{parts.port}" if parts.port else "")
    no_proxy = proxies.get("no")
    if no_proxy and (_bypassed(host, no_proxy) or (networks and in_networks(parts.hostname, no_proxy))):
        return None
    if "://" not in proxy_url:
        proxy_url = f"http://{proxy_url}"
    proxy = urlsplit(proxy_url)
    if proxy.scheme != "http" or not proxy.hostname:
        raise ValueError(f"{scheme.upper()}_PROXY must be an http://host[:port] URL, got a {proxy.scheme}:// one")
    authorization = None
    if proxy.username is not None:
        import base64

        pair = f"{unquote(proxy.username)}:{unquote(proxy.password or '')}".encode()
        authorization = "Basic " + base64.b64encode(pair).decode()
    return Proxy(proxy.hostname, proxy.port or 80, authorization)


def _proxies(items: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """``{scheme: proxy URL}`` from ``*_proxy`` variables, lower-case names winning (as ``urllib``)."""
    upper = {k[: -len("_proxy")].lower(): v for k, v in items if k.isupper() and v}
    lower = {k[: -len("_proxy")]: v for k, v in items if k.islower() and v}
    return {**upper, **lower}


def _bypassed(host: str, no_proxy: str) -> bool:
    """``urllib.request``'s ``NO_PROXY`` matching, given the value rather than the process environment."""
    return bool(urllib.request.proxy_bypass_environment(host, {"no": no_proxy}))  # type: ignore[attr-defined]


def in_networks(host: str, no_proxy: str) -> bool:
    """Whether ``host`` is an IP address inside a ``NO_PROXY`` entry written as an address or a
    network (``127.0.0.0/8``): the rule of obstore's client (reqwest), curl and requests, which
    urllib's, and so botocore's and aiohttp's, lacks."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    for entry in no_proxy.split(","):
        with contextlib.suppress(ValueError):
            if address in ipaddress.ip_network(entry.strip(), strict=False):
                return True
    return False


def ssl_context(ca_file: str | None = None, *, extra_ca: bytes | None = None, verify: bool = True) -> ssl.SSLContext:
    """A client TLS context.

    Args:
        ca_file: Trust only this CA bundle (a path), as botocore and requests
            do with theirs; None: the system roots.
        extra_ca: PEM certificates trusted besides those (obstore's
            ``root_certificate`` rule, so both clients of a store trust alike).
        verify: False accepts any certificate (only when a user asks).

    Raises:
        ValueError: a CA bundle cannot be read or parsed (named in the message).
    """
    return _context(ca_file, extra_ca, verify)


@functools.lru_cache(maxsize=8)
def _context(ca_file: str | None, extra_ca: bytes | None, verify: bool) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=ca_file)
        if extra_ca:
            context.load_verify_locations(cadata=extra_ca.decode("ascii", "replace"))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the CA bundle {ca_file or '(PEM given)'!r}: {exc}") from exc
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
