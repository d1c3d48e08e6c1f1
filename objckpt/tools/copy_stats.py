"""The figures of one copy (:func:`objckpt.tools.copy.copy`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from objckpt.progress import human_bytes

SERVER_SIDE, STREAMED, MIXED = "server-side", "streamed", "mixed"


@dataclass
class CopyStats:
    """The figures of one copy.

    Attributes:
        src: the source checkpoint (credentials stripped).
        dst: the destination checkpoint (credentials stripped).
        blobs: blobs in the checkpoint.
        bytes_total: their total size.
        blobs_copied: blobs copied to the destination, either way.
        bytes_copied: their bytes.
        blobs_skipped: blobs already at the destination, checked and kept.
        bytes_skipped: their bytes.
        bytes_read: bytes the client read from the source store (what crosses its link,
            and what egress is billed on when the copy is streamed).
        bytes_written: bytes the client wrote to the destination, the manifest included.
        bytes_read_dst: bytes read back from the destination to check blobs already there.
        requests: store requests on both sides.
        retries: how many of them were retries.
        seconds: wall time.
        method: how blobs were copied: ``"server-side"``, ``"streamed"``, or ``"mixed"``.
        blobs_server_side: blobs the destination's server copied (their bytes never crossed
            the client's link).
        bytes_server_side: their bytes.
        streamed_because: why the copy was not server-side (``""`` when it was).
    """

    src: str
    dst: str
    blobs: int = 0
    bytes_total: int = 0
    blobs_copied: int = 0
    bytes_copied: int = 0
    blobs_skipped: int = 0
    bytes_skipped: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_read_dst: int = 0
    requests: int = 0
    retries: int = 0
    seconds: float = 0.0
    method: str = STREAMED
    blobs_server_side: int = 0
    bytes_server_side: int = 0
    streamed_because: str = ""

    @property
    def gib_per_s(self) -> float:
        """Bytes copied per second, in GiB/s."""
        return self.bytes_copied / max(self.seconds, 1e-9) / 2**30

    @property
    def client_bytes(self) -> int:
        """Bytes that crossed the client's link, both ways (request heads aside)."""
        return self.bytes_read + self.bytes_written + self.bytes_read_dst

    def to_dict(self) -> dict[str, Any]:
        """The figures as JSON-ready values, ``gib_per_s`` and ``client_bytes`` included."""
        return {**asdict(self), "gib_per_s": self.gib_per_s, "client_bytes": self.client_bytes}

    def summary(self) -> str:
        """One line: what was copied how, blobs and bytes, requests, time and throughput."""
        how = f"{self.method} ({self.streamed_because})" if self.streamed_because else self.method
        return (
            f"copied {self.src} -> {self.dst} {how}: {human_bytes(self.bytes_copied)} in {self.blobs_copied} blobs"
            f" ({self.blobs_skipped} already there and checked, {human_bytes(self.bytes_skipped)}),"
            f" {self.requests} requests, {self.retries} retries, {self.seconds:.2f} s, {self.gib_per_s:.3f} GiB/s,"
            f" client bytes moved {human_bytes(self.client_bytes)}: {self.bytes_read} bytes read from the source,"
            f" {self.bytes_written} written to the destination, {self.bytes_read_dst} read back"
        )
