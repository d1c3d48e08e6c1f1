"""Ranged S3 GETs streamed to a sink (:mod:`objckpt.storage.http.reader` says why).

Each GET goes to a URL that obstore presigns (``obstore.sign``, AWS Signature
Version 4 in the query string) with the credentials its store resolved,
whatever their source: static keys, a profile, instance metadata, a
container endpoint or a web-identity token, refreshed by obstore as they
expire. objckpt signs nothing itself. Signing happens on the worker thread
that sends the request, right before it (a few microseconds; a credential
refresh, when one is due, waits there rather than on the caller's event loop).
Only these GETs go this way; every other request, including reads that
become arrays, goes through obstore itself.

Unsigned stores (``anon``) send plain GETs. Presigned URLs carry no
``x-amz-request-payer`` header, so requester-pays buckets do not stream.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any
from urllib.parse import quote, urlsplit

from objckpt.errors import StoreError
from objckpt.storage.errors import map_obstore_error, redacted_cause
from objckpt.storage.http.reader import HttpRangeReader

#: How long a presigned URL stays valid: it is used at once, so this only has
#: to outlast a slow connect; S3 caps it at the credentials' own expiry anyway.
PRESIGN_VALIDITY = _dt.timedelta(minutes=15)


class S3Endpoint(HttpRangeReader):
    """Requests to one bucket's objects: the endpoint (AWS's regional one by default) and how
    an object's key becomes a request path (path-style or virtual-hosted addressing).

    Args:
        endpoint: ``http(s)://host[:port]``; None for AWS's regional endpoint.
        bucket: The bucket every key lives in.
        region: The bucket's region (for AWS's default endpoint).
        virtual_hosted: Address the bucket as ``bucket.host`` rather than ``host/bucket``.
        timeout: Socket timeout, seconds (connect and each receive).
        **http: Passed to :class:`HttpRangeReader` (``ssl_context``).
    """

    def __init__(
        self,
        *,
        endpoint: str | None,
        bucket: str,
        region: str,
        virtual_hosted: bool = False,
        timeout: float = 60.0,
        **http: Any,
    ) -> None:
        endpoint = endpoint or f"https://s3.{region}.amazonaws.com"
        hostname = urlsplit(endpoint).hostname
        super().__init__(
            endpoint=endpoint,
            service="S3",
            host=f"{bucket}.{hostname}" if virtual_hosted and hostname else None,
            timeout=timeout,
            **http,
        )
        self._scheme = urlsplit(endpoint).scheme
        self._bucket_path = "" if virtual_hosted else f"/{quote(bucket, safe='')}"

    def _object_path(self, path: str) -> str:
        """The URI-encoded request path of object ``path``."""
        return f"{self._endpoint_path}{self._bucket_path}/{quote(path, safe='/-_.~')}"


class S3RangeReader(S3Endpoint):
    """Ranged GETs of one bucket's objects, streamed to a sink.

    Args:
        endpoint, bucket, region, virtual_hosted, timeout, **http: as for :class:`S3Endpoint`.
        signer: The obstore ``S3Store`` of this bucket, which presigns each
            GET; None sends unsigned requests (public buckets).
    """

    no_proxy_networks = True  # as obstore, beside which it reads

    def __init__(self, *, signer: Any | None, **endpoint: Any) -> None:
        super().__init__(**endpoint)
        self._signer = signer

    def _request_path(self, path: str) -> str:
        if self._signer is None:
            return self._object_path(path)
        import obstore

        try:
            signed = obstore.sign(self._signer, "GET", path, PRESIGN_VALIDITY)
        except Exception as exc:  # e.g. the credential source did not answer
            raise map_obstore_error(exc, f"sign a GET of {path!r}") from redacted_cause(exc)
        url = urlsplit(signed)
        if url.netloc != self._host_header:
            # never send a request somewhere other than the endpoint this reader connects to
            raise StoreError(f"S3 presigned a GET for host {url.netloc!r}, not the endpoint's {self._host_header!r}")
        return f"{url.path}?{url.query}"

    def _error_code(self, body: bytes) -> str:
        """S3's ``<Code>`` from an error body (e.g. ``SlowDown``), or ``""``."""
        text = body.decode("utf-8", "replace")
        head, sep, rest = text.partition("<Code>")
        return rest.partition("</Code>")[0].strip()[:64] if sep else ""
