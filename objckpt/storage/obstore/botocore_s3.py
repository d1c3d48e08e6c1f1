"""A botocore S3 client built from an obstore store's configuration, for the calls obstore
does not make: server-side copies across buckets (:mod:`objckpt.storage.copy.s3`) and
uploads that carry their CRC-32C, with the checksums read back
(:mod:`objckpt.storage.obstore.s3_checksums`).

The client reaches the same endpoint with the same addressing, CA trust, requester-pays
and credentials (static keys; the store's credential provider, through botocore's
refreshable credentials; instance metadata through botocore's chain; unsigned for
anonymous access). Its own retries are off: the transfer engine is the one retry layer.
botocore signs; nothing here does.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from objckpt.storage.obstore.config import NativeSpec


def botocore_s3_client(spec: NativeSpec, *, request_timeout: float, connections: int) -> tuple[Any, str | None]:
    """A botocore S3 client for ``spec``, and the CA file it reads (None when none was
    written; the caller removes it when it closes the client).

    Neither botocore's default request checksums (a second pass over every body) nor
    a SHA-256 of signed payloads: a request's checksum is the one its caller gives.
    """
    import botocore
    from botocore.config import Config

    config = spec.config
    session = _session(spec)
    signing: dict[str, Any] = {}
    if config.get("skip_signature"):
        signing["signature_version"] = botocore.UNSIGNED
    verify: bool | str = True
    ca_file = None
    if spec.client.get("allow_invalid_certificates"):
        verify = False
    elif spec.client.get("root_certificate"):
        verify = ca_file = _pem_file(spec.client["root_certificate"])
    addressing = "virtual" if config.get("virtual_hosted_style_request") else "path"
    client = session.create_client(
        "s3",
        region_name=config.get("region"),
        endpoint_url=spec.endpoint,
        verify=verify,
        config=Config(
            connect_timeout=min(10.0, request_timeout),
            read_timeout=request_timeout,
            retries={"total_max_attempts": 1},  # the engine is the one retry layer
            max_pool_connections=connections,
            s3={"addressing_style": addressing, "payload_signing_enabled": False},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            **signing,
        ),
    )
    return client, ca_file


def botocore_credentials(spec: NativeSpec) -> Any | None:
    """The credentials botocore signs ``spec``'s requests with (refreshed by botocore as they
    expire), resolved as for :func:`botocore_s3_client`; None for an unsigned store."""
    if spec.config.get("skip_signature"):
        return None
    return _session(spec).get_credentials()


def _session(spec: NativeSpec) -> Any:
    """A botocore session holding ``spec``'s credentials: static keys, the store's credential
    provider, or (neither given) botocore's own chain, which finds what the store found."""
    import botocore.credentials
    import botocore.session

    config = spec.config
    session = botocore.session.Session()
    if config.get("skip_signature"):
        return session
    if config.get("access_key_id"):
        session.set_credentials(config["access_key_id"], config["secret_access_key"], config.get("session_token"))
    elif spec.credential_provider is not None:
        credentials = _refreshable(spec.credential_provider)
        session.register_component(
            "credential_provider", botocore.credentials.CredentialResolver([_Given(credentials)])
        )
    return session


def _pem_file(pem: bytes) -> str:
    """The store's trusted CA (obstore holds it as bytes) in a file, for botocore's ``verify``."""
    fd, path = tempfile.mkstemp(prefix="objckpt-ca-", suffix=".pem")
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return path


def _refreshable(provider: Callable[[], Any]) -> Any:
    """botocore credentials that ask the store's obstore ``credential_provider`` again when
    the answer it gave expires (``expires_at``), as obstore itself does."""
    import botocore.credentials

    def metadata() -> dict[str, Any]:
        answer = provider()
        expires = answer.get("expires_at")
        return {
            "access_key": answer["access_key_id"],
            "secret_key": answer["secret_access_key"],
            "token": answer.get("token") or answer.get("session_token"),
            "expiry_time": expires.isoformat() if expires is not None else None,
        }

    first = metadata()
    if first["expiry_time"] is None:  # static: never asked again
        return botocore.credentials.Credentials(first["access_key"], first["secret_key"], first["token"], "objckpt")
    return botocore.credentials.RefreshableCredentials.create_from_metadata(first, metadata, "objckpt")


class _Given:
    """A botocore credential provider that hands over credentials made already."""

    METHOD = "objckpt"

    def __init__(self, credentials: Any) -> None:
        self._credentials = credentials

    def load(self) -> Any:
        return self._credentials
