"""S3 uploads that carry their CRC-32C, and the CRC-32C read back, for an obstore S3 store.

obstore sends no ``x-amz-checksum-crc32c`` (its S3 checksums are SHA-256 or CRC64NVME,
computed in a second pass over the body), so an obstore S3 store sends its checked
uploads as ``PutObject`` requests with the CRC-32C header, signed by botocore's SigV4 signer
and sent by :mod:`objckpt.storage.http.s3_signed` (each part of the body handed to the socket
as it lies): S3 checks the bytes on arrival, refuses a mismatch (``BadDigest``) and keeps
the value, which ``HeadObject(ChecksumMode=ENABLED)`` returns, sent the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from objckpt.storage.checksums import StoredChecksum
from objckpt.storage.http.s3_signed import S3SignedRequests
from objckpt.storage.obstore.botocore_s3 import botocore_credentials
from objckpt.storage.obstore.tls import tls_of

if TYPE_CHECKING:
    from objckpt.storage.obstore.config import NativeSpec


class S3Checksums:
    """Checked uploads and checksum reads of one S3 bucket, shared by a store and its children.

    The signed requests' connections are made at the first call and closed with :meth:`close`.

    Args:
        spec: the store's configuration (endpoint, credentials, CA trust).
        request_timeout: seconds for one request (connect, and each send or receive).
    """

    def __init__(self, spec: NativeSpec, *, request_timeout: float) -> None:
        self._spec = spec
        self._timeout = request_timeout
        self._lock = threading.Lock()
        self._signed: S3SignedRequests | None = None

    async def put(
        self, what: str, bucket: str, name: str, body: Sequence[memoryview], *, crc32c: int, create: bool
    ) -> None:
        """``PutObject`` of ``body`` (parts, in order, sent as they lie) with its CRC-32C; ``create``:
        if absent. Signed by botocore, sent over a kept-alive connection (:mod:`objckpt.storage.http.s3_signed`)."""
        await self._requests().put_checked(name, body, crc32c=crc32c, create=create, what=what)

    async def head(self, what: str, bucket: str, name: str, key: str) -> StoredChecksum:
        """The object's size and the CRC-32C S3 keeps of it (None: it keeps none): a
        ``HeadObject(ChecksumMode=ENABLED)`` signed by botocore and sent over a kept-alive
        connection (:mod:`objckpt.storage.http.s3_signed`), a quarter of a botocore call's CPU."""
        return await self._requests().head_checksum(name, key, what)

    def _requests(self) -> S3SignedRequests:
        with self._lock:
            if self._signed is None:
                spec, config = self._spec, self._spec.config
                self._signed = S3SignedRequests(
                    endpoint=spec.endpoint,
                    bucket=spec.bucket,
                    region=config["region"],
                    credentials=botocore_credentials(spec),
                    virtual_hosted=bool(config.get("virtual_hosted_style_request")),
                    request_payer=bool(config.get("request_payer")),
                    timeout=self._timeout,
                    ssl_context=tls_of(spec),
                )
            return self._signed

    def close(self) -> None:
        """Close the connections (a later call makes new ones)."""
        with self._lock:
            signed, self._signed = self._signed, None
        if signed is not None:
            signed.close()
