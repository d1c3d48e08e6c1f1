"""S3 ``HeadObject(ChecksumMode=ENABLED)`` requests, signed by botocore and sent over plain HTTP.

``verify(read_data=False)`` asks S3 for each blob's kept CRC-32C: one HEAD per object,
about 43,000 for a 405B model saved from 1,024 hosts. Through a botocore client each
HEAD costs ~1.2 ms of client CPU (its event hooks, endpoint rules, parsers and
urllib3: ~5,000 Python calls a request), and the GIL makes that a serial 50 s. Here
botocore's own SigV4 signer (``S3SigV4Auth``) signs each HEAD, with the
``x-amz-checksum-mode`` header among the signed ones (S3 refuses unsigned ``x-amz-*``
headers), and :class:`~objckpt.storage.http.reader.HttpRangeReader`'s keep-alive
connections send it: ~0.3 ms of CPU a HEAD (docs/PERFORMANCE.md, "Verify from the
store's own checksums"). objckpt signs nothing itself: the signature, the credentials
(static, a session token, refreshed ones) and their refresh are botocore's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from objckpt.errors import StoreError, TransientStoreError
from objckpt.storage.checksums import StoredChecksum, parse_crc32c_header
from objckpt.storage.http.reader import _ERROR_BODY_LIMIT, _Attempt, status_error
from objckpt.storage.http.s3 import S3Endpoint


class S3ChecksumHeads(S3Endpoint):
    """HEADs of one bucket's objects that read back the CRC-32C S3 keeps of each.

    Args:
        endpoint, bucket, region, virtual_hosted, timeout, **http: as for :class:`S3Endpoint`.
        credentials: botocore credentials (refreshed by botocore when they expire);
            None sends unsigned requests (public buckets).
        request_payer: Send (and sign) ``x-amz-request-payer: requester``.
    """

    def __init__(self, *, credentials: Any | None, request_payer: bool = False, region: str, **endpoint: Any) -> None:
        super().__init__(region=region, **endpoint)
        self._region = region
        self._credentials = credentials
        self._payer = {"x-amz-request-payer": "requester"} if request_payer else {}

    def _request_path(self, path: str) -> str:
        return self._object_path(path)

    def _signed(self, method: str, request_path: str, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` with the host and, unless anonymous, botocore's SigV4 signature."""
        if self._credentials is None:
            return {**headers, "host": self._host_header}
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method=method, url=f"{self._scheme}://{self._host_header}{request_path}", headers=headers)
        try:
            frozen = self._credentials.get_frozen_credentials()  # refreshes expired ones
        except Exception as exc:  # the credential source did not answer
            raise TransientStoreError(f"S3 credentials for a HEAD: {type(exc).__name__}: {exc}") from exc
        S3SigV4Auth(frozen, "s3", self._region).add_auth(request)
        return dict(request.headers.items())

    async def head_checksum(self, path: str, key: str, what: str) -> StoredChecksum:
        """Object ``path``'s size and kept CRC-32C (None: S3 keeps none of it), as ``key``.

        Raises :class:`ObjectNotFoundError`, :class:`StorePermissionError`,
        :class:`TransientStoreError` (timeouts, resets, 429/5xx) or :class:`StoreError`, naming ``what``.
        """
        attempt = _Attempt()
        future = self._pool().submit(self._head, path, key, what, attempt)
        try:
            return await asyncio.wrap_future(future)
        except BaseException:
            attempt.abort()
            raise

    def _head(self, path: str, key: str, what: str, attempt: _Attempt) -> StoredChecksum:
        request_path = self._request_path(path)
        headers = self._signed("HEAD", request_path, {"x-amz-checksum-mode": "ENABLED", **self._payer})
        with self._failures(what, attempt):
            response = self._send(request_path, headers, attempt, method="HEAD")
            response.read(_ERROR_BODY_LIMIT)  # a HEAD's answer has no body: the connection stays usable
            if response.status != 200:
                raise status_error(response.status, response.getheader("x-amz-error-code", ""), what)
            length = response.getheader("content-length")
            if length is None or not length.isdigit():
                raise StoreError(f"{what}: the answer carries no Content-Length")
            return StoredChecksum(key, int(length), parse_crc32c_header(response.getheader("x-amz-checksum-crc32c")))
