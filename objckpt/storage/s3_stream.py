"""Ranged S3 GETs streamed to a sink (:mod:`objckpt.storage.http_stream` says why).

Requests are signed with AWS Signature Version 4 (:class:`SigV4Signer`, hmac
and hashlib). Only these GETs go this way; every other request, including
reads that become arrays, goes through obstore. Credentials live in the
signer only; they never reach a message or a log.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

from objckpt.storage.http_stream import HttpRangeReader

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_ALGORITHM = "AWS4-HMAC-SHA256"


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


class S3RangeReader(HttpRangeReader):
    """Ranged GETs of one bucket's objects, streamed to a sink.

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
        endpoint = endpoint or f"https://s3.{region}.amazonaws.com"
        hostname = urlsplit(endpoint).hostname
        super().__init__(
            endpoint=endpoint,
            service="S3",
            host=f"{bucket}.{hostname}" if virtual_hosted and hostname else None,
            timeout=timeout,
        )
        self._bucket_path = "" if virtual_hosted else f"/{quote(bucket, safe='')}"
        self._signer = SigV4Signer(credentials, region) if credentials is not None else None

    def _request_path(self, path: str) -> str:
        return f"{self._endpoint_path}{self._bucket_path}/{quote(path, safe='/-_.~')}"

    def _authorize(self, request_path: str, headers: dict[str, str]) -> dict[str, str]:
        if self._signer is None:
            return super()._authorize(request_path, headers)
        return self._signer.sign("GET", self._host_header, request_path, headers)

    def _error_code(self, body: bytes) -> str:
        """S3's ``<Code>`` from an error body (e.g. ``SlowDown``), or ``""``."""
        text = body.decode("utf-8", "replace")
        head, sep, rest = text.partition("<Code>")
        return rest.partition("</Code>")[0].strip()[:64] if sep else ""
