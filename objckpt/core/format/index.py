"""Format version 2 index objects: one per process, the pieces it wrote and its blobs.

Written by each process before the commit (:func:`index_to_json`); read by
:func:`parse_index`, which first checks the object against the root's record of
it (size, crc32c, SHA-256 when pinned; the root's ``save_id``), then reads it as
strictly as the root (:mod:`objckpt.core.format.v2`). See ``docs/FORMAT.md``. No I/O.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from objckpt.core.checksum import crc32c, is_sha256_hex, sha256_hex
from objckpt.core.dtypes import dtype_from_name
from objckpt.core.format.schema import ARRAY_KINDS, IndexRef, Manifest, check_blob_key
from objckpt.core.pieces import Piece
from objckpt.core.strict import fields, is_int, need, strict_json
from objckpt.errors import FormatError

INDEX_FORMAT = "objckpt-index"


def index_key(save_id: str, process: int) -> str:
    """An index object's key: hashed 2-hex-digit prefix, like blobs, to spread store partitions."""
    name = f"{save_id}-p{process}.index"
    return f"{zlib.crc32(name.encode()) & 0xFF:02x}/{name}"


@dataclass(frozen=True)
class IndexDoc:
    """One process's index object, read: its blobs and, by leaf, its pieces."""

    process: int
    blobs: dict[str, int]
    pieces: dict[int, list[Piece]]


def index_to_json(
    save_id: str, process: int, records: Iterable[tuple[int, Piece]], blobs: dict[str, int], *, digest: bool = False
) -> bytes:
    """An index object: ``records`` are (leaf, piece); ``blobs`` each blob's key and size.

    ``digest``: with each piece's SHA-256 (``Options.digest``), which every piece must have.
    """
    keys = sorted(blobs)
    position = {k: n for n, k in enumerate(keys)}
    records = list(records)
    rows = [[leaf, position[p.blob], p.offset, p.crc32c, *p.start, *p.stop] for leaf, p in records]
    doc: dict[str, Any] = {
        "format": INDEX_FORMAT,
        "version": 2,
        "save_id": save_id,
        "process": process,
        "blobs": [[k, blobs[k]] for k in keys],
        "pieces": rows,
    }
    if digest:
        missing = [p for _, p in records if p.sha256 is None]
        if missing:
            raise ValueError(f"piece of blob {missing[0].blob} at byte {missing[0].offset} has no sha256")
        doc["sha256"] = [p.sha256 for _, p in records]
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def parse_index(
    data: bytes, manifest: Manifest, process: int, *, size_limit: int, leaves: set[int] | None = None
) -> IndexDoc:
    """Check an index object against the root's record of it, then read it strictly.

    ``leaves``: keep only the pieces of these leaves (a restore reads a process's
    index for some leaves only, such as the small replicated ones it wrote); every
    other row must still be a list that names a leaf by an integer, and is skipped.

    Raises:
        FormatError: naming the index object and the field (size, checksum, a
            piece outside its leaf or blob, an unsafe blob key, ...).
    """
    ref = manifest.indexes[process]
    doc_name = f"index object {ref.key}"
    if len(data) != ref.size:
        raise FormatError(f"{doc_name} is {len(data)} bytes, the manifest says {ref.size}")
    if len(data) > size_limit:
        raise FormatError(f"{doc_name} is {len(data)} bytes, over the limit of {size_limit}")
    if crc32c(data) != ref.crc32c:
        raise FormatError(f"{doc_name} does not match its crc32c in the manifest")
    if ref.sha256 is not None and sha256_hex(data) != ref.sha256:
        raise FormatError(f"{doc_name} does not match its sha256 in the manifest (its crc32c does: changed on purpose)")
    doc = strict_json(data, doc_name)
    fields(doc, "(top level)", {"format", "version", "save_id", "process", "blobs", "pieces"}, {"sha256"}, doc_name)
    need(doc["format"] == INDEX_FORMAT, "'format'", f"must be {INDEX_FORMAT!r}", doc_name)
    need(doc["version"] == 2 and is_int(doc["version"]), "'version'", "must be 2", doc_name)
    if manifest.shared_save_id:
        need(
            doc["save_id"] == manifest.save_id,
            "'save_id'",
            f"{str(doc['save_id'])[:200]!r} is not the manifest's {manifest.save_id!r} (an index object of another save)",
            doc_name,
        )
        need(index_key(manifest.save_id, process) == ref.key, "'save_id'", "does not name this index object", doc_name)
    else:  # a root from before one save_id was shared: each process named its index object by its own id
        saved_by = doc["save_id"]
        need(
            isinstance(saved_by, str) and index_key(saved_by, process) == ref.key,
            "'save_id'",
            "does not name this index object",
            doc_name,
        )
    need(doc["process"] == process and is_int(doc["process"]), "'process'", f"must be {process}", doc_name)
    need(isinstance(doc["blobs"], list), "'blobs'", "must be a list", doc_name)
    keys: list[str] = []
    blobs: dict[str, int] = {}
    for n, b in enumerate(doc["blobs"]):
        where = f"'blobs[{n}]'"
        need(isinstance(b, list) and len(b) == 2, where, "must be [key, size]", doc_name)
        key, size = b
        need(isinstance(key, str) and check_blob_key(key), where, f"unsafe blob key {key!r}", doc_name)
        need(is_int(size) and size >= 0, where, "size must be a non-negative integer", doc_name)
        need(key not in blobs, where, f"duplicate blob {key!r}", doc_name)
        keys.append(key)
        blobs[key] = size
    need(
        len(blobs) == ref.blobs and sum(blobs.values()) == ref.blob_bytes,
        "'blobs'",
        f"{len(blobs)} blobs of {sum(blobs.values())} bytes, the manifest says {ref.blobs} of {ref.blob_bytes}",
        doc_name,
    )
    need(isinstance(doc["pieces"], list), "'pieces'", "must be a list", doc_name)
    digests = _digests(doc, ref, doc_name)
    shapes = _leaf_shapes(manifest)
    pieces: dict[int, list[Piece]] = {}
    sizes = [blobs[k] for k in keys]
    for n, row in enumerate(doc["pieces"]):
        if leaves is not None:
            if not (type(row) is list and row and type(row[0]) is int):  # a bool is not a leaf either
                raise FormatError(f"{doc_name} field 'pieces[{n}]': must start with a leaf")
            if row[0] not in leaves:
                continue
        leaf, piece = _fast_row(row, shapes, keys, sizes) or _row(row, f"'pieces[{n}]'", shapes, keys, sizes, doc_name)
        if digests is not None:
            piece = piece._replace(sha256=digests[n])
        pieces.setdefault(leaf, []).append(piece)
    return IndexDoc(process, blobs, pieces)


def _digests(doc: dict[str, Any], ref: IndexRef, doc_name: str) -> list[str] | None:
    """The index object's ``sha256`` list (one per row of ``pieces``), there iff the root pins it by one."""
    need(
        ("sha256" in doc) == (ref.sha256 is not None),
        "'sha256'",
        "present without a sha256 in the manifest" if "sha256" in doc else "missing (the manifest has a sha256)",
        doc_name,
    )
    if "sha256" not in doc:
        return None
    digests = doc["sha256"]
    need(
        isinstance(digests, list) and len(digests) == len(doc["pieces"]),
        "'sha256'",
        "must list one digest per row of 'pieces'",
        doc_name,
    )
    for n, d in enumerate(digests):
        need(is_sha256_hex(d), f"'sha256[{n}]'", "must be 64 lowercase hex digits", doc_name)
    return list(digests)


def _leaf_shapes(manifest: Manifest) -> list[tuple[tuple[int, ...], int] | None]:
    """Per leaf: (shape, itemsize) for array leaves, else None."""
    out: list[tuple[tuple[int, ...], int] | None] = []
    for leaf in manifest.leaves:
        if leaf.kind in ARRAY_KINDS and leaf.dtype is not None:
            dtype = dtype_from_name(leaf.dtype)
            assert dtype is not None
            out.append((leaf.shape or (), dtype.itemsize))
        else:
            out.append(None)
    return out


def _fast_row(
    row: Any, shapes: list[tuple[tuple[int, ...], int] | None], keys: list[str], sizes: list[int]
) -> tuple[int, Piece] | None:
    """The row if it passes every check of :func:`_row`, else None (which names what is wrong).

    Why twice: formatting each check's message up front costs more than the
    checks, once per piece. ``type(x) is int`` excludes booleans.
    """
    if type(row) is not list or len(row) < 4:
        return None
    leaf, blob, offset, crc = row[0], row[1], row[2], row[3]
    if type(leaf) is not int or not 0 <= leaf < len(shapes) or type(blob) is not int or not 0 <= blob < len(keys):
        return None
    found = shapes[leaf]
    if found is None:
        return None
    shape, itemsize = found
    rank = len(shape)
    if len(row) != 4 + 2 * rank:
        return None
    start, stop = row[4 : 4 + rank], row[4 + rank :]
    length = itemsize
    for a, b, n in zip(start, stop, shape):
        if type(a) is not int or type(b) is not int or not 0 <= a < b <= n:
            return None
        length *= b - a
    if type(offset) is not int or type(crc) is not int or offset < 0 or offset + length > sizes[blob]:
        return None
    if not 0 <= crc < 2**32:
        return None
    return leaf, Piece(tuple(start), tuple(stop), keys[blob], offset, length, crc)


def _row(
    row: Any, where: str, shapes: list[tuple[tuple[int, ...], int] | None], keys: list[str], sizes: list[int], doc: str
) -> tuple[int, Piece]:
    need(isinstance(row, list) and len(row) >= 4, where, "must be [leaf, blob, offset, crc32c, *start, *stop]", doc)
    leaf, blob, offset, crc = row[:4]
    need(is_int(leaf) and 0 <= leaf < len(shapes), where, f"leaf {leaf!r} is not in the manifest", doc)
    found = shapes[leaf]
    need(found is not None, where, f"leaf {leaf} has no stored data", doc)
    assert found is not None
    shape, itemsize = found
    need(len(row) == 4 + 2 * len(shape), where, f"a box of leaf {leaf} needs {2 * len(shape)} integers", doc)
    start, stop = row[4 : 4 + len(shape)], row[4 + len(shape) :]
    need(all(is_int(v) for v in start + stop), where, "box bounds must be integers", doc)
    for d, (a, b, n) in enumerate(zip(start, stop, shape)):
        need(0 <= a < b <= n, where, f"box [{a}, {b}) outside dimension {d} of size {n}", doc)
    need(is_int(blob) and 0 <= blob < len(keys), where, f"blob {blob!r} is not in 'blobs'", doc)
    length = math.prod(b - a for a, b in zip(start, stop)) * itemsize
    need(is_int(offset) and offset >= 0, where, "offset must be a non-negative integer", doc)
    need(offset + length <= sizes[blob], where, f"bytes [{offset}, {offset + length}) exceed blob {keys[blob]!r}", doc)
    need(is_int(crc) and 0 <= crc < 2**32, where, "crc32c must be a 32-bit integer", doc)
    raise FormatError(f"{doc} field {where}: malformed")  # pragma: no cover (the fast path takes every valid row)


def merge_indexes(manifest: Manifest, docs: Iterable[IndexDoc]) -> Manifest:
    """``manifest`` with the pieces and blobs of the index objects ``docs``."""
    pieces: dict[int, list[Piece]] = {}
    blobs: dict[str, int] = {}
    processes: set[int] = set()
    for doc in docs:
        processes.add(doc.process)
        blobs.update(doc.blobs)
        for leaf, found in doc.pieces.items():
            pieces.setdefault(leaf, []).extend(found)
    return manifest.with_pieces(pieces, blobs, processes)
