"""The TLS context of an S3 store's own HTTP requests (streamed reads, signed uploads and HEADs)."""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING

from objckpt.storage.http.network import ssl_context

if TYPE_CHECKING:
    from objckpt.storage.obstore.config import NativeSpec


def tls_of(spec: NativeSpec) -> ssl.SSLContext | None:
    """The TLS context of an S3 ``spec``'s endpoint (its CA trust, as obstore's); None for a plain
    ``http://`` one, which never loads the system's CA roots (tens of milliseconds)."""
    if (spec.endpoint or "").startswith("http://"):
        return None
    client = spec.client
    return ssl_context(extra_ca=client.get("root_certificate"), verify=not client.get("allow_invalid_certificates"))
