"""S3 requests signed by botocore and sent over plain HTTP: checked uploads and checksum HEADs.

A save sends each blob with its CRC-32C (``PutObject`` with ``x-amz-checksum-crc32c``,
and ``If-None-Match: *`` for a create-if-absent): S3 checks the bytes on arrival and keeps
the value. Through a botocore client a 32 MiB body goes through urllib3 in 16 KiB reads of a
file object (~9 CPU-s per GiB on 2 cores, and a new client per store: 0.06-0.2 s) and took
twice a raw PUT's time; here each part of the body is handed to the socket as it lies
(``sendall`` of the caller's buffers: no copy, no join) on a kept-alive connection.
The payload is sent unsigned (``UNSIGNED-PAYLOAD``): the CRC-32C, which S3 checks, covers it.

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
from collections.abc import Sequence
from typing import Any

from objckpt.errors import ObjectExistsError, StoreError, TransientStoreError
from objckpt.storage.checksums import StoredChecksum, crc32c_header, parse_crc32c_header
from objckpt.storage.http.reader import ERROR_BODY_LIMIT, Attempt, status_error
from objckpt.storage.http.s3 import S3Endpoint


class _UnsignedPayload:
    """What botocore's S3 signer reads of a client's configuration: payloads are not hashed."""

    s3 = {"payload_signing_enabled": False}


_UNSIGNED_PAYLOAD = _UnsignedPayload()


class S3SignedRequests(S3Endpoint):
    """Checked uploads to one bucket, and HEADs that read back the CRC-32C S3 keeps of each object.

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
        """``headers`` with the host and, unless anonymous, botocore's SigV4 signature (the
        payload unsigned: a PUT's body is covered by the CRC-32C S3 checks)."""
        if self._credentials is None:
            return {**headers, "host": self._host_header}
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method=method, url=f"{self._scheme}://{self._host_header}{request_path}", headers=headers)
        request.context["client_config"] = _UNSIGNED_PAYLOAD
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
        attempt = Attempt()
        future = self._pool().submit(self._head, path, key, what, attempt)
        try:
            return await asyncio.wrap_future(future)
        except BaseException:
            attempt.abort()
            raise

    def _head(self, path: str, key: str, what: str, attempt: Attempt) -> StoredChecksum:
        request_path = self._request_path(path)
        headers = self._signed("HEAD", request_path, {"x-amz-checksum-mode": "ENABLED", **self._payer})
        with self._failures(what, attempt):
            response = self._send(request_path, headers, attempt, method="HEAD")
            response.read(ERROR_BODY_LIMIT)  # a HEAD's answer has no body: the connection stays usable
            if response.status != 200:
                raise status_error(response.status, response.getheader("x-amz-error-code", ""), what)
            length = response.getheader("content-length")
            if length is None or not length.isdigit():
                raise StoreError(f"{what}: the answer carries no Content-Length")
            return StoredChecksum(key, int(length), parse_crc32c_header(response.getheader("x-amz-checksum-crc32c")))

    async def put_checked(
        self, path: str, parts: Sequence[memoryview], *, crc32c: int, create: bool, what: str
    ) -> None:
        """``PutObject`` of ``parts`` (in order, sent as they lie) with their CRC-32C; ``create``:
        only if absent.

        Raises :class:`ObjectExistsError` (``create`` and the object exists), and otherwise as
        :meth:`head_checksum` (``BadDigest``, bytes that do not match the CRC-32C: a
        :class:`StoreError` naming it).
        """
        attempt = Attempt()
        future = self._pool().submit(self._put, path, parts, crc32c, create, what, attempt)
        try:
            await asyncio.wrap_future(future)
        except BaseException:
            attempt.abort()
            raise

    def _put(self, path: str, parts: Sequence[memoryview], crc: int, create: bool, what: str, attempt: Attempt) -> None:
        request_path = self._request_path(path)
        body = [memoryview(p).cast("B") for p in parts if len(p)]
        headers = {"content-length": str(sum(len(p) for p in body)), "x-amz-checksum-crc32c": crc32c_header(crc)}
        if create:
            headers["if-none-match"] = "*"
        headers = self._signed("PUT", request_path, {**headers, **self._payer})
        with self._failures(what, attempt):
            response = self._send(request_path, headers, attempt, method="PUT", body=body)
            answer = response.read(ERROR_BODY_LIMIT)
            if not response.isclosed():
                self._drop_connection()  # more left unread than an error body holds
            if response.status == 200:
                return
            code = self._error_code(answer)
            if create and response.status == 412:
                raise ObjectExistsError(f"{what}: object already exists")
            if create and response.status == 409:  # another conditional write of the key in flight
                raise TransientStoreError(f"{what} failed (HTTP 409{', ' + code if code else ''})")
            raise status_error(response.status, code, what)
