"""The checksums a store keeps of its objects: what a save sends, what ``verify`` compares.

Both clouds keep a CRC-32C per object. S3 keeps the one an upload sends
(``x-amz-checksum-crc32c``), refuses an upload whose bytes do not match it
(``BadDigest``), and returns it on ``HeadObject(ChecksumMode=ENABLED)``; an
object written without one has none (or another algorithm's). GCS computes
one for every object and returns it in listings, 1,000 objects a page. Local
disk and memory keep none.

These are optional protocols a store implements beside
:class:`~objckpt.storage.base.Store` (checked where they are used, as
:class:`~objckpt.restoring.aligned_reads.AlignedResponses` is): a plugin
without them keeps working, and ``verify(read_data=False)`` says its store
keeps no checksums.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from objckpt.storage.base import PutMode


@dataclass(frozen=True)
class StoredChecksum:
    """What a store says of one object without reading it.

    Attributes:
        key: the object's key, relative to the store's root.
        size: its size in bytes.
        crc32c: the CRC-32C the store keeps of it; None when it keeps none for
            this object (an S3 upload that sent none, or another algorithm's).
    """

    key: str
    size: int
    crc32c: int | None


@runtime_checkable
class ChecksAtArrival(Protocol):
    """A store that checks an upload against the CRC-32C sent with it, and keeps it."""

    #: False where the store's backend cannot send the checksum (then plain ``put`` is used).
    checks_at_arrival: bool

    async def put_checked(
        self, key: str, data: bytes | memoryview | Sequence[memoryview], *, crc32c: int, mode: PutMode = "overwrite"
    ) -> None:
        """Write an object (one buffer, or parts sent in order) with its CRC-32C; the store
        refuses it if the bytes that arrive differ (a :class:`~objckpt.errors.StoreError`)."""
        ...


@runtime_checkable
class KeepsChecksums(Protocol):
    """A store that keeps a CRC-32C per object and tells it without a read of the data."""

    #: False where this store's backend keeps none (a local root; obstore's GCS).
    keeps_checksums: bool
    #: True when a listing carries every object's checksum (GCS: one request per 1,000
    #: objects); False when each object takes a HEAD (S3).
    lists_checksums: bool

    async def list_checksums(self, prefix: str = "") -> list[StoredChecksum]:
        """Every object under ``prefix`` with its size and, where :attr:`lists_checksums`,
        its checksum (else ``crc32c`` is None: ask :meth:`head_checksum`)."""
        ...

    async def head_checksum(self, key: str) -> StoredChecksum:
        """One object's size and checksum (``ObjectNotFoundError`` when it is missing)."""
        ...


def checks_at_arrival(store: Any) -> ChecksAtArrival | None:
    """``store`` where it checks uploads against a sent CRC-32C, else None."""
    return store if isinstance(store, ChecksAtArrival) and store.checks_at_arrival else None


def keeps_checksums(store: Any) -> KeepsChecksums | None:
    """``store`` where it keeps a CRC-32C per object that can be asked for, else None."""
    return store if isinstance(store, KeepsChecksums) and store.keeps_checksums else None


def crc32c_header(value: int) -> str:
    """A CRC-32C as S3 and GCS spell it: the big-endian 4 bytes, base64."""
    return base64.b64encode(struct.pack(">I", value)).decode("ascii")


def parse_crc32c_header(text: Any) -> int | None:
    """The CRC-32C a store sent as :func:`crc32c_header` spells it; None when absent or malformed."""
    if not isinstance(text, str) or not text:
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return struct.unpack(">I", raw)[0] if len(raw) == 4 else None
