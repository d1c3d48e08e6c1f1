"""Format version 3 index objects: the writer (:mod:`objckpt.core.format.index3` reads them).

A save's commit report holds each process's rows; this turns them into the object's bytes:
the rows sorted by leaf and cut into frames at leaf boundaries past :data:`FRAME_TARGET` raw
bytes, each frame's columns byte-planar and zlib-compressed, and a head (magic, length,
strict JSON) listing the blobs and every frame's leaves, offset, lengths and checksums.
No I/O.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from objckpt.core.checksum import crc32c, sha256_hex
from objckpt.core.format.index import INDEX_FORMAT
from objckpt.core.format.index3 import HEAD_PREFIX, MAGIC, ROW_FIXED, ROW_LENGTH, ROW_SHA
from objckpt.core.format.index3_bounds import item_starts
from objckpt.core.pieces import Piece

#: A frame's rows are cut at the first leaf boundary past this many uncompressed bytes (a leaf with
#: more rows than fit is cut between rows): ~2,500 rank-2 rows, ~16 KiB compressed (docs/PERFORMANCE.md
#: "Pod scale" compares frame sizes).
FRAME_TARGET = 128 << 10


@dataclass(frozen=True)
class Encoded:
    """A version 3 index object's bytes and its head's byte length (the root records both)."""

    data: bytes
    head: int


def index3_encode(
    save_id: str,
    process: int,
    records: Iterable[tuple[int, Piece]],
    blobs: dict[str, int],
    *,
    digest: bool = False,
    frame_target: int | None = None,
    breaks: Collection[int] = (),
    lengths: bool = False,
) -> Encoded:
    """A version 3 index object: ``records`` are (leaf, piece); ``blobs`` each blob's key and size.

    ``digest``: with each piece's SHA-256 (``Options.digest``), which every piece must have.
    ``frame_target``: the raw bytes a frame is cut past (:data:`FRAME_TARGET` when None).
    ``breaks``: leaves a frame always starts at (the first leaf of each item: a reader of
    one item, params onto an inference host, then decompresses no row of another).
    ``lengths``: a version 4 object, each row with its stored byte length (compressed leaves'
    pieces are not their box's bytes).
    """
    keys = sorted(blobs)
    position = {k: n for n, k in enumerate(keys)}
    rows = sorted(records, key=lambda r: r[0])
    if digest:
        missing = [p for _, p in rows if p.sha256 is None]
        if missing:
            raise ValueError(f"piece of blob {missing[0].blob} at byte {missing[0].offset} has no sha256")
    cuts = _cuts(rows, FRAME_TARGET if frame_target is None else frame_target, digest, frozenset(breaks), lengths)
    bodies: list[bytes] = []
    table: list[list[Any]] = []
    for a, b in zip(cuts, cuts[1:]):
        raw = _columns(rows[a:b], position, digest, lengths)
        body = zlib.compress(raw, 6)
        entry: list[Any] = [rows[a][0], rows[b - 1][0], 0, len(body), len(raw), b - a, crc32c(body)]
        if digest:
            entry.append(sha256_hex(body))
        bodies.append(body)
        table.append(entry)
    doc: dict[str, Any] = {
        "format": INDEX_FORMAT,
        "version": 4 if lengths else 3,
        "save_id": save_id,
        "process": process,
        "blobs": [[k, blobs[k]] for k in keys],
        "frames": table,
    }
    # Offsets are absolute: the head's length depends on their digits, so settle it first.
    head_len = 0
    while True:
        offset = head_len
        for entry, body in zip(table, bodies):
            entry[2] = offset
            offset += len(body)
        text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        if HEAD_PREFIX + len(text) == head_len:
            break
        head_len = HEAD_PREFIX + len(text)
    return Encoded(MAGIC + struct.pack("<I", len(text)) + text + b"".join(bodies), head_len)


def item_breaks(paths: Sequence[str]) -> list[int]:
    """The leaves (by position in ``paths``, a root's leaf paths in order) whose first path key
    differs from the leaf before's: where each item (params, each optimizer moment, ...) starts,
    the ``breaks`` a save gives :func:`index3_encode` (:func:`~objckpt.core.format.index3_bounds.item_starts`)."""
    return item_starts(paths)


def _cuts(
    rows: list[tuple[int, Piece]], target: int, digest: bool, breaks: frozenset[int], lengths: bool = False
) -> list[int]:
    """Where frames start: at each of ``breaks``, at leaf boundaries past ``target`` raw bytes, or
    between the rows of a long leaf."""
    cuts = [0]
    size = 0
    for n, (leaf, piece) in enumerate(rows):
        row = ROW_FIXED + 16 * len(piece.start) + (ROW_SHA if digest else 0) + (ROW_LENGTH if lengths else 0)
        new_leaf = n > 0 and rows[n - 1][0] != leaf
        if n > cuts[-1] and ((new_leaf and leaf in breaks) or (size + row > target and (new_leaf or size >= target))):
            cuts.append(n)
            size = 0
        size += row
    if rows:
        cuts.append(len(rows))
    return cuts


def _columns(rows: list[tuple[int, Piece]], position: dict[str, int], digest: bool, lengths: bool = False) -> bytes:
    """A frame's uncompressed bytes: the columns, byte-planar (all first bytes, then all second
    bytes...: the high bytes of small numbers line up as runs of zeros), leaves as deltas;
    version 4 (``lengths``): each row's stored length after the coordinates."""
    leaf = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
    delta = np.diff(leaf, prepend=leaf[0]).astype("<i4")
    blob = np.fromiter((position[r[1].blob] for r in rows), dtype="<u4", count=len(rows))
    offset = np.fromiter((r[1].offset for r in rows), dtype="<u8", count=len(rows))
    crc = np.fromiter((r[1].crc32c for r in rows), dtype="<u4", count=len(rows))
    coords = np.array([v for _, p in rows for v in (*p.start, *p.stop)], dtype="<i8")
    parts = [_planar(delta), _planar(blob), _planar(offset), crc.tobytes(), _planar(coords)]
    if lengths:
        parts.append(_planar(np.fromiter((r[1].length for r in rows), dtype="<u8", count=len(rows))))
    if digest:
        parts.append(b"".join(bytes.fromhex(p.sha256 or "") for _, p in rows))
    return b"".join(parts)


def _planar(a: np.ndarray) -> bytes:
    """``a``'s bytes, byte-planar: byte ``j`` of value ``i`` at ``j * len(a) + i``."""
    return np.ascontiguousarray(a.view(np.uint8).reshape(len(a), a.itemsize).T).tobytes()
