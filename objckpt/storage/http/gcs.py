"""Ranged GCS GETs streamed to a sink (:mod:`objckpt.storage.http.reader` says why).

Objects are read through the JSON API's media download
(``/download/storage/v1/b/BUCKET/o/OBJECT?alt=media`` with a ``Range``
header), the URL gcsfs itself reads from, so it works wherever gcsfs does
(GCS, its emulators). Requests carry the store's bearer token
(:class:`objckpt.storage.auth.gcs.GoogleToken`, the credential gcsfs shares)
or none for anonymous access. Only these GETs go this way; every other
request, including reads that become arrays, goes through the store's client.
Requester-pays buckets (whose billed project rides on every request) are not
read this way.
"""

from __future__ import annotations

import json
import ssl
from typing import Protocol
from urllib.parse import quote

from objckpt.storage.http.reader import HttpRangeReader

GCS_ENDPOINT = "https://storage.googleapis.com"


class BearerSource(Protocol):
    """Where a request's auth headers come from (:class:`~objckpt.storage.auth.gcs.GoogleToken`)."""

    def headers(self) -> dict[str, str]: ...


class GCSRangeReader(HttpRangeReader):
    """Ranged GETs of GCS objects, streamed to a sink.

    Args:
        endpoint: ``http(s)://host[:port]`` (GCS's by default; an emulator's).
        bucket: The bucket every path is in; None when a path's first segment
            names its bucket (gcsfs paths: ``bucket/object``).
        credentials: Gives each request's ``Authorization`` header, refreshing
            when due (it may block: requests run on worker threads); None sends
            anonymous requests (public buckets, emulators).
        timeout: Socket timeout, seconds (connect and each receive).
        ssl_context: Verifies an ``https://`` endpoint (a custom CA bundle's);
            the system roots by default.
    """

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        bucket: str | None = None,
        credentials: BearerSource | None = None,
        timeout: float = 60.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(endpoint=endpoint or GCS_ENDPOINT, service="GCS", timeout=timeout, ssl_context=ssl_context)
        self._bucket = bucket
        self._credentials = credentials

    def _request_path(self, path: str) -> str:
        if self._bucket is not None:
            bucket, name = self._bucket, path
        else:
            bucket, _, name = path.partition("/")
        # quoted as gcsfs quotes it ("/" kept), which GCS and its emulators both accept
        return f"{self._endpoint_path}/download/storage/v1/b/{quote(bucket, safe='')}/o/{quote(name)}?alt=media"

    def _authorize(self, request_path: str, headers: dict[str, str]) -> dict[str, str]:
        headers = super()._authorize(request_path, headers)
        if self._credentials is not None:
            headers.update(self._credentials.headers())
        return headers

    def _error_code(self, body: bytes) -> str:
        return error_reason(body)


def error_reason(body: bytes) -> str:
    """GCS's error ``reason`` (e.g. ``rateLimitExceeded``) from a JSON error body, or ``""``."""
    try:
        error = json.loads(body.decode("utf-8", "replace")).get("error", {})
        reasons = [e.get("reason", "") for e in error.get("errors", []) if isinstance(e, dict)]
        return str(next((r for r in reasons if r), error.get("status", "")))[:64]
    except (ValueError, AttributeError):
        return ""
