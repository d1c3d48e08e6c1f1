"""Format version 3 index objects: a small head, then zlib frames of columnar rows, read in part.

A version 2 index object is one JSON document holding every row of every leaf,
so a reader that needs a few leaves of many processes (params only, onto one
inference host) downloads and parses all their rows. A version 3 index object
starts with a head (magic, length, strict JSON: its blobs and a table of frames)
that the root pins by its length and checksum; each frame holds the rows of a
run of leaves, compressed, and the head pins each frame by its checksum. A
reader fetches the head, then only the frames of the leaves it needs, checks
each frame's checksum before it decompresses it (to exactly its declared
length: no zip bombs) and validates every row with numpy before it builds a
:class:`Piece` for the wanted ones, holding the object to the bounds of
:mod:`objckpt.core.format.index3_bounds` (what it can make a reader inflate and
hold). This module reads the head; :mod:`objckpt.core.format.index3_frames` the frames.
See ``docs/FORMAT.md`` ("version 3"). No I/O. The writer is
:mod:`objckpt.core.format.index3_encode`.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from objckpt.core.checksum import crc32c, is_sha256_hex, sha256_hex
from objckpt.core.format.bases import check_ref_key, is_ref
from objckpt.core.format.index import INDEX_FORMAT, index_key
from objckpt.core.format.index3_bounds import (
    BYTES_LIMIT,
    OBJECT_RAW_LIMIT,
    RAW_PER_LEAF,
    LeafTable,
    check_frame_count,
)
from objckpt.core.format.schema import BLOB_KEY, Manifest, check_blob_key
from objckpt.core.strict import fields, is_int, need, strict_json
from objckpt.errors import FormatError

MAGIC = b"OBJCKIX3"
HEAD_PREFIX = len(MAGIC) + 4  # the magic, then the JSON's byte length (u32 little-endian)
#: The largest frame a reader decompresses (writers stay near ``index3_encode.FRAME_TARGET``).
FRAME_LIMIT = 16 << 20
ROW_FIXED = 20  # bytes per row before its coordinates: leaf u32, blob u32, offset u64, crc32c u32
ROW_SHA = 32  # a row's SHA-256 (Options.digest), after the coordinates
ROW_LENGTH = 8  # version 4: each row's stored byte length (u64, byte-planar, after the coordinates)


class Pinned(FormatError):
    """A check failed on bytes that matched the checksums that pin them (the root's, the head's):
    reading them again gives the same bytes, so a reader does not (its caller raises a plain
    :class:`FormatError` with this message)."""


class Frame(NamedTuple):
    """One frame as the head lists it: leaves ``first..last``, at ``offset`` in the object."""

    first: int
    last: int
    offset: int
    length: int
    raw_length: int
    rows: int
    crc32c: int
    sha256: str | None = None


@dataclass(frozen=True)
class Head:
    """An index object's head, read and checked against the root."""

    process: int
    keys: list[str]
    sizes: list[int]
    frames: list[Frame]

    @property
    def blobs(self) -> dict[str, int]:
        return dict(zip(self.keys, self.sizes))

    def frames_for(self, leaves: Collection[int] | np.ndarray | None) -> list[int]:
        """The positions of the frames holding rows of ``leaves`` (None: every frame)."""
        if leaves is None:
            return list(range(len(self.frames)))
        wanted = leaf_array(leaves)
        bounds = np.array([(f.first, f.last) for f in self.frames], dtype=np.int64).reshape(-1, 2)
        hits = np.searchsorted(wanted, bounds[:, 1], "right") - np.searchsorted(wanted, bounds[:, 0], "left")
        return np.flatnonzero(hits > 0).tolist()


def leaf_array(leaves: Collection[int] | np.ndarray) -> np.ndarray:
    """``leaves`` as a sorted int64 array of distinct leaves (what :meth:`Head.frames_for` and
    :func:`check_frame` take; a reader of many index objects converts its set once; an array
    is taken as such)."""
    if isinstance(leaves, np.ndarray):
        return leaves
    return np.unique(np.fromiter(leaves, dtype=np.int64, count=len(leaves)))


# ----------------------------------------------------------------------------- reading


def parse_head(data: bytes, manifest: Manifest, process: int, table: LeafTable | None = None) -> Head:
    """The head of ``process``'s index object (``data``: at least its first ``head`` bytes),
    checked against the root: length, crc32c (and SHA-256), save_id, process, blobs, and a
    frame table that covers the rest of the object exactly, within the bounds a reader holds
    it to (raw bytes and frames: :mod:`objckpt.core.format.index3_bounds`; ``table``: the
    read's, which knows where items start, else they are found in ``manifest`` when asked).

    Raises:
        FormatError: naming the index object and the field.
    """
    ref = manifest.indexes[process]
    doc_name = f"index object {ref.key}"
    head = data[: ref.head]
    if len(head) != ref.head or ref.head < HEAD_PREFIX:
        raise FormatError(f"{doc_name} is truncated: its head is {ref.head} bytes, {len(head)} were read")
    if head[: len(MAGIC)] != MAGIC:
        raise FormatError(f"{doc_name} does not start with the version 3 magic {MAGIC!r}")
    if crc32c(head) != ref.crc32c:
        raise FormatError(f"{doc_name} head does not match its crc32c in the manifest")
    if ref.sha256 is not None and sha256_hex(head) != ref.sha256:
        raise FormatError(f"{doc_name} head does not match its sha256 in the manifest (its crc32c does)")
    try:
        return _pinned_head(head, manifest, process, table, doc_name)
    except Pinned:
        raise
    except FormatError as e:
        raise Pinned(str(e)) from None


def _pinned_head(head: bytes, manifest: Manifest, process: int, table: LeafTable | None, doc_name: str) -> Head:
    """:func:`parse_head` of a head that matched its checksums."""
    ref = manifest.indexes[process]
    (length,) = struct.unpack_from("<I", head, len(MAGIC))
    need(HEAD_PREFIX + length == ref.head, "(head)", f"JSON of {length} bytes in a head of {ref.head}", doc_name)
    doc = strict_json(head[HEAD_PREFIX:], doc_name)
    fields(doc, "(top level)", {"format", "version", "save_id", "process", "blobs", "frames"}, set(), doc_name)
    need(doc["format"] == INDEX_FORMAT, "'format'", f"must be {INDEX_FORMAT!r}", doc_name)
    version = 4 if manifest.version >= 4 else 3  # version 4 objects belong to version 4 roots
    need(doc["version"] == version and is_int(doc["version"]), "'version'", f"must be {version}", doc_name)
    need(
        doc["save_id"] == manifest.save_id,
        "'save_id'",
        f"{str(doc['save_id'])[:200]!r} is not the manifest's {manifest.save_id!r} (an index object of another save)",
        doc_name,
    )
    need(index_key(manifest.save_id, process) == ref.key, "'save_id'", "does not name this index object", doc_name)
    need(doc["process"] == process and is_int(doc["process"]), "'process'", f"must be {process}", doc_name)
    keys, sizes = _blobs(doc["blobs"], doc_name, dict(manifest.bases))
    need(
        len(keys) == ref.blobs and sum(sizes) == ref.blob_bytes,
        "'blobs'",
        f"{len(keys)} blobs of {sum(sizes)} bytes, the manifest says {ref.blobs} of {ref.blob_bytes}",
        doc_name,
    )
    frames = _frames(doc["frames"], ref.head, ref.size, len(manifest.leaves), ref.sha256 is not None, doc_name)
    check_frame_count(frames, table, manifest, doc_name)
    if table is not None:
        table.draw(process, sum(f.rows for f in frames), doc_name)
    return Head(process, keys, sizes, frames)


#: Blob keys, each followed by a newline (no key holds one): what :func:`check_blob_key` checks, of all at once.
_KEYS = re.compile(f"(?:{BLOB_KEY.pattern[1:-1]}\n)*")


def _blobs(raw: Any, doc_name: str, bases: dict[str, str]) -> tuple[list[str], list[int]]:
    """The head's blob keys and sizes; a reference key only to a blob of a save the root names in ``bases``."""
    need(isinstance(raw, list) and len(raw) < 2**32, "'blobs'", "must be a list", doc_name)
    if raw and set(map(type, raw)) == {list} and set(map(len, raw)) == {2}:  # a pod's ~60,000 blobs, checked at once
        keys, sizes = map(list, zip(*raw))
        if (
            set(map(type, keys)) == {str}
            and set(map(type, sizes)) == {int}
            and 0 <= min(sizes) <= max(sizes) < BYTES_LIMIT
            and len(set(keys)) == len(keys)
            and max(map(len, keys)) <= 1024
            and (joined := "\n".join(keys) + "\n").count("\n") == len(keys)
            and _KEYS.fullmatch(joined)
        ):
            return keys, sizes
    keys = []
    sizes = []
    seen: set[str] = set()
    for n, b in enumerate(raw):
        # The checks below, with no message built for a good row (a pod's restore reads ~45,000).
        if type(b) is list and len(b) == 2 and type(b[0]) is str and type(b[1]) is int:
            key, size = b
            if 0 <= size < BYTES_LIMIT and key not in seen and check_blob_key(key):
                seen.add(key)
                keys.append(key)
                sizes.append(size)
                continue
        where = f"'blobs[{n}]'"
        need(isinstance(b, list) and len(b) == 2, where, "must be [key, size]", doc_name)
        key, size = b
        if isinstance(key, str) and is_ref(key):
            need(
                check_ref_key(key, bases),
                where,
                f"reference {key[:300]!r} leads to no blob of a base the manifest's 'bases' names",
                doc_name,
            )
        else:
            need(isinstance(key, str) and check_blob_key(key), where, f"unsafe blob key {key!r}", doc_name)
        need(is_int(size) and 0 <= size < BYTES_LIMIT, where, "size must be an integer in [0, 2**62)", doc_name)
        need(key not in seen, where, f"duplicate blob {key!r}", doc_name)
        seen.add(key)
        keys.append(key)
        sizes.append(size)
    return keys, sizes


def _frames(raw: Any, head: int, size: int, leaves: int, digest: bool, doc_name: str) -> list[Frame]:
    need(isinstance(raw, list), "'frames'", "must be a list", doc_name)
    width = 8 if digest else 7
    out: list[Frame] = []
    offset, last, inflated = head, 0, 0
    inflate_limit = OBJECT_RAW_LIMIT + RAW_PER_LEAF * leaves
    for n, f in enumerate(raw):
        where = f"'frames[{n}]'"
        need(
            isinstance(f, list) and len(f) == width and all(is_int(v) and v >= 0 for v in f[:7]),
            where,
            f"must be {width} fields: first_leaf, last_leaf, offset, length, raw_length, rows, crc32c"
            + (", sha256" if digest else ""),
            doc_name,
        )
        frame = Frame(*f)
        need(
            frame.first <= frame.last < leaves,
            where,
            f"leaves {frame.first}..{frame.last} not in the manifest",
            doc_name,
        )
        need(
            frame.first >= last, where, f"leaf {frame.first} after leaf {last}: frames must be in leaf order", doc_name
        )
        need(frame.offset == offset, where, f"offset {frame.offset}, the previous frame ends at {offset}", doc_name)
        need(frame.length >= 1 and offset + frame.length <= size, where, "bytes beyond the object", doc_name)
        need(1 <= frame.rows and frame.rows * ROW_FIXED <= frame.raw_length <= FRAME_LIMIT, where, "bad size", doc_name)
        need(frame.crc32c < 2**32, where, "crc32c must be a 32-bit integer", doc_name)
        need(not digest or is_sha256_hex(frame.sha256), where, "sha256 must be 64 lowercase hex digits", doc_name)
        inflated += frame.raw_length
        if inflated > inflate_limit:
            raise FormatError(
                f"{doc_name} field {where}: the frames up to this one inflate to {inflated} bytes, over the "
                f"{inflate_limit} an index object of a root of {leaves} leaves may ({OBJECT_RAW_LIMIT}, and "
                f"{RAW_PER_LEAF} a leaf)"
            )
        out.append(frame)
        offset, last = offset + frame.length, frame.last
    need(offset == size, "'frames'", f"end at byte {offset}, the object is {size} bytes", doc_name)
    return out
