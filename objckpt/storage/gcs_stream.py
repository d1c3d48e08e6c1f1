"""Ranged GCS GETs streamed to a sink (:mod:`objckpt.storage.http_stream` says why).

Objects are read through the JSON API's media download
(``/download/storage/v1/b/BUCKET/o/OBJECT?alt=media`` with a ``Range``
header), the URL gcsfs itself reads from, so it works wherever gcsfs does
(GCS, its emulators). Requests carry gcsfs's own credentials (a bearer token
it refreshes when due) or none for anonymous access. Only these GETs go this
way; every other request, including reads that become arrays, goes through
the store's client.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Protocol
from urllib.parse import quote

from objckpt.storage.http_stream import HttpRangeReader

GCS_ENDPOINT = "https://storage.googleapis.com"


class Credentials(Protocol):
    """What gcsfs's ``GoogleCredentials`` offers: add the auth headers, refreshing when due."""

    def apply(self, out: dict[str, str]) -> None: ...


class GCSRangeReader(HttpRangeReader):
    """Ranged GETs of GCS objects, streamed to a sink.

    Args:
        endpoint: ``http(s)://host[:port]`` (GCS's by default; an emulator's).
        bucket: The bucket every path is in; None when a path's first segment
            names its bucket (gcsfs paths: ``bucket/object``).
        credentials: Adds the ``Authorization`` header (gcsfs's credentials);
            None sends anonymous requests (public buckets, emulators).
        timeout: Socket timeout, seconds (connect and each receive).
    """

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        bucket: str | None = None,
        credentials: Credentials | None = None,
        timeout: float = 60.0,
    ) -> None:
        super().__init__(endpoint=endpoint or GCS_ENDPOINT, service="GCS", timeout=timeout)
        self._bucket = bucket
        self._credentials = credentials
        self._credentials_lock = threading.Lock()  # one token refresh at a time

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
            with self._credentials_lock:
                self._credentials.apply(headers)
        return headers

    def _error_code(self, body: bytes) -> str:
        """GCS's error ``reason`` (e.g. ``rateLimitExceeded``) from a JSON error body, or ``""``."""
        try:
            error = json.loads(body.decode("utf-8", "replace")).get("error", {})
            reasons = [e.get("reason", "") for e in error.get("errors", []) if isinstance(e, dict)]
            return str(next((r for r in reasons if r), error.get("status", "")))[:64]
        except (ValueError, AttributeError):
            return ""


def gcsfs_range_reader(fs: Any, timeout: float) -> GCSRangeReader | None:
    """A reader for a gcsfs filesystem (its endpoint and credentials), or None.

    None for requester-pays buckets (the billed project rides on every request,
    which this reader does not send) and for a filesystem that is not gcsfs's.
    """
    if getattr(fs, "requester_pays", False):
        return None
    location = getattr(fs, "_location", None)
    if not isinstance(location, str) or "://" not in location or not hasattr(fs, "credentials"):
        return None
    return GCSRangeReader(endpoint=location, credentials=fs.credentials, timeout=timeout)
