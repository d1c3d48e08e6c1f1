"""A compressed save's blobs: staged raw bytes → the blob's encoded body (``Options.compression``).

A compressed piece's stored bytes differ from its host bytes, so it is never sent in place:
the blocking phase stages it raw as any other (only a copy: the caller waits for no codec),
and the upload encodes the staged blob off the I/O loop thread, on as many threads as there
are uploads in flight (zstd releases the GIL), before it checksums and PUTs it. Encoded
pieces lie back to back in the body, so a piece's offset and length are known only once its
blob is encoded; the index object records them (format version 4). No I/O here.
"""

from __future__ import annotations

from collections.abc import Collection

from objckpt.core.codecs import encode
from objckpt.core.plan import BlobPlan

#: (offset, length) of each piece in an encoded blob's body, in the blob's piece order.
Spans = list[tuple[int, int]]


def coded_leaves(kinds: list[str], compression: str | None) -> frozenset[int]:
    """The leaves (by position) whose pieces a save with ``compression`` encodes: its arrays.

    ``str``/``bytes`` leaves and items stay raw (small, and read whole as they are).
    """
    if compression is None:
        return frozenset()
    return frozenset(i for i, kind in enumerate(kinds) if kind in ("array", "ndarray"))


def encode_blob(blob: BlobPlan, staged: memoryview, coded: Collection[int]) -> tuple[bytes, Spans]:
    """The body of ``blob`` from its staged raw bytes: the pieces of ``coded`` leaves encoded
    (:func:`objckpt.core.codecs.encode`), the others as they are, back to back; and each
    piece's span in it."""
    parts: list[bytes | memoryview] = []
    spans: Spans = []
    at = 0
    for placed in blob.pieces:
        piece = placed.piece
        raw = staged[placed.offset : placed.offset + piece.nbytes]
        body = encode(raw, piece.itemsize) if piece.leaf in coded else raw
        parts.append(body)
        spans.append((at, len(body)))
        at += len(body)
    return b"".join(parts), spans
