"""Format version 2: a root manifest of O(leaves + processes) and one index object per process.

The root (``manifest.json``, still the commit marker, written last with
create-if-absent) holds the tree, the leaf table, the meshes the leaves were
saved on (device ids and their processes, once per mesh), each leaf's layout
(its mesh and partition spec when it is a regular grid, else the processes
that wrote it) and the key, size and crc32c of every process's index object.
An index object holds the pieces its process wrote and the blobs it put them
in; it is written by that process before the commit.

A reader computes from a leaf's layout which processes wrote the boxes it needs
(:mod:`objckpt.core.layout`), reads those index objects only, and checks each
one's size and crc32c against the root before parsing it as strictly as the
root. See ``docs/FORMAT.md``. No I/O.
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
from objckpt.core.format import (
    _BLOB_KEY,
    ARRAY_KINDS,
    FORMAT_NAME,
    IndexRef,
    Manifest,
    _leaf_to_json,
    check_blob_key,
    check_header,
    check_tree_leaves,
    parse_leaves,
)
from objckpt.core.layout import Box, Grid, Mesh, grid_fits
from objckpt.core.pieces import Piece
from objckpt.core.strict import fields, is_int, need, strict_json
from objckpt.errors import FormatError

INDEX_FORMAT = "objckpt-index"
_ALL_OR_NONE = "every index object has a sha256 or none does"
_AXIS_NAME_MAX = 256


def index_key(save_id: str, process: int) -> str:
    """An index object's key: hashed 2-hex-digit prefix, like blobs, to spread store partitions."""
    name = f"{save_id}-p{process}.index"
    return f"{zlib.crc32(name.encode()) & 0xFF:02x}/{name}"


# ----------------------------------------------------------------------------- root


def root_to_json(manifest: Manifest) -> bytes:
    leaves = []
    for leaf in manifest.leaves:
        doc = _leaf_to_json(leaf)
        doc.pop("pieces", None)
        if leaf.layout is not None:
            doc["layout"] = leaf.layout
        leaves.append(doc)
    doc = {
        "format": FORMAT_NAME,
        "version": 2,
        "save_id": manifest.save_id,
        "created": manifest.created,
        "num_processes": manifest.num_processes,
        "metadata": manifest.metadata,
        "tree": manifest.tree,
        "slab_bytes": manifest.slab_bytes,
        "meshes": [m.to_json() for m in manifest.meshes],
        "indexes": [_ref_to_json(r) for r in manifest.indexes],
        "leaves": leaves,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def require_digest(manifest: Manifest, digest: str | None, url: str) -> None:
    """With ``Options.digest`` set, refuse a checkpoint whose root does not pin its index objects by it.

    Why: whoever can rewrite a copy's root could otherwise drop the digests.
    """
    if digest is not None and (manifest.version != 2 or any(r.sha256 is None for r in manifest.indexes)):
        raise FormatError(f"checkpoint {url} has no {digest} digests; Options(digest={digest!r}) requires them")


def _ref_to_json(ref: IndexRef) -> dict[str, Any]:
    out = {"key": ref.key, "size": ref.size, "crc32c": ref.crc32c, "blobs": ref.blobs, "blob_bytes": ref.blob_bytes}
    return out if ref.sha256 is None else {**out, "sha256": ref.sha256}


def root_from_doc(doc: dict[str, Any]) -> Manifest:
    """A version 2 root manifest (``format`` and ``version`` already checked)."""
    fields(
        doc,
        "(top level)",
        {
            "format",
            "version",
            "save_id",
            "created",
            "num_processes",
            "metadata",
            "tree",
            "slab_bytes",
            "meshes",
            "indexes",
            "leaves",
        },
    )
    check_header(doc)
    processes = doc["num_processes"]
    need(is_int(doc["slab_bytes"]) and doc["slab_bytes"] >= 0, "'slab_bytes'", "must be a non-negative integer")
    need(isinstance(doc["meshes"], list), "'meshes'", "must be a list")
    meshes = tuple(_mesh_from_json(m, f"'meshes[{i}]'", processes) for i, m in enumerate(doc["meshes"]))
    need(
        isinstance(doc["indexes"], list) and len(doc["indexes"]) == processes,
        "'indexes'",
        f"must list one index object per process ({processes})",
    )
    indexes: list[IndexRef] = _fast_refs(doc["indexes"]) or []
    seen: set[str] = set()
    for p, raw in enumerate(() if indexes else doc["indexes"]):  # the checks again, naming what is wrong
        where = f"'indexes[{p}]'"
        fields(raw, where, {"key", "size", "crc32c", "blobs", "blob_bytes"}, {"sha256"})
        key = raw["key"]
        need(isinstance(key, str) and check_blob_key(key), f"{where}.key", f"unsafe key {key!r}")
        need(key not in seen, f"{where}.key", f"index object {key!r} listed twice")
        seen.add(key)
        need(is_int(raw["size"]) and raw["size"] >= 0, f"{where}.size", "must be a non-negative integer")
        need(is_int(raw["crc32c"]) and 0 <= raw["crc32c"] < 2**32, f"{where}.crc32c", "must be a 32-bit integer")
        for name in ("blobs", "blob_bytes"):
            need(is_int(raw[name]) and raw[name] >= 0, f"{where}.{name}", "must be a non-negative integer")
        sha = raw.get("sha256")
        need(sha is None or is_sha256_hex(sha), f"{where}.sha256", "must be 64 lowercase hex digits")
        need(not indexes or (sha is None) == (indexes[0].sha256 is None), f"{where}.sha256", _ALL_OR_NONE)
        indexes.append(IndexRef(key, raw["size"], raw["crc32c"], raw["blobs"], raw["blob_bytes"], sha))
    leaves = parse_leaves(doc["leaves"], None)
    checked: set[str] = set()  # layouts (with their shape) already found good: most leaves share a few
    for i, leaf in enumerate(leaves):
        if leaf.layout is not None:
            key = json.dumps([leaf.layout, leaf.shape])
            if key not in checked:
                _check_layout(leaf.layout, f"'leaves[{i}]'.layout", leaf.shape or (), meshes, processes)
                checked.add(key)
    check_tree_leaves(doc["tree"], len(leaves))
    return Manifest(
        save_id=doc["save_id"],
        created=doc["created"],
        tree=doc["tree"],
        leaves=tuple(leaves),
        blobs=(),
        num_processes=processes,
        metadata=doc["metadata"],
        version=2,
        meshes=meshes,
        indexes=tuple(indexes),
        slab_bytes=doc["slab_bytes"],
    )


_REF_FIELDS = frozenset({"key", "size", "crc32c", "blobs", "blob_bytes"})
_REF_FIELDS_SHA = _REF_FIELDS | {"sha256"}


def _fast_refs(raws: list[Any]) -> list[IndexRef] | None:
    """The root's ``indexes`` if every entry passes the checks of :func:`root_from_doc`, else None.

    Why twice (as :func:`_fast_row`): a root may list a million index objects, and
    formatting each check's message up front costs more than the checks.
    """
    if not raws:
        return None
    first = raws[0]
    expected = _REF_FIELDS_SHA if type(first) is dict and "sha256" in first else _REF_FIELDS
    seen: set[str] = set()
    out: list[IndexRef] = []
    for raw in raws:
        if type(raw) is not dict or raw.keys() != expected:
            return None
        key, size, crc, blobs, blob_bytes = raw["key"], raw["size"], raw["crc32c"], raw["blobs"], raw["blob_bytes"]
        if (
            type(key) is not str
            or key in seen
            or len(key) > 1024
            or not _BLOB_KEY.match(key)  # (no part can be "." or ".." then: check_blob_key's other rule)
            or type(size) is not int
            or type(crc) is not int
            or type(blobs) is not int
            or type(blob_bytes) is not int
            or size < 0
            or blobs < 0
            or blob_bytes < 0
            or not 0 <= crc < 2**32
        ):
            return None
        sha = raw.get("sha256")
        if sha is not None and not is_sha256_hex(sha):
            return None
        seen.add(key)
        out.append(IndexRef(key, size, crc, blobs, blob_bytes, sha))
    return out


def _mesh_from_json(raw: Any, where: str, processes: int) -> Mesh:
    fields(raw, where, {"axes", "devices", "processes"})
    axes = raw["axes"]
    need(
        isinstance(axes, list)
        and all(
            isinstance(a, list)
            and len(a) == 2
            and isinstance(a[0], str)
            and 0 < len(a[0]) <= _AXIS_NAME_MAX
            and is_int(a[1])
            and a[1] >= 1
            for a in axes
        ),
        f"{where}.axes",
        "must be a list of [name, size] pairs",
    )
    need(len({a[0] for a in axes}) == len(axes), f"{where}.axes", "axis names must be unique")
    count = math.prod(a[1] for a in axes)
    devices, owners = raw["devices"], raw["processes"]
    need(
        isinstance(devices, list) and len(devices) == count and all(is_int(d) and d >= 0 for d in devices),
        f"{where}.devices",
        f"must be {count} device ids",
    )
    need(len(set(devices)) == count, f"{where}.devices", "device ids must be unique")
    need(
        isinstance(owners, list) and len(owners) == count and all(is_int(p) and 0 <= p < processes for p in owners),
        f"{where}.processes",
        f"must be {count} process indexes below {processes}",
    )
    return Mesh(tuple((a[0], a[1]) for a in axes), tuple(devices), tuple(owners))


def _check_layout(layout: dict[str, Any], where: str, shape: tuple[int, ...], meshes: tuple[Mesh, ...], n: int) -> None:
    if "processes" in layout:
        fields(layout, where, {"processes"})
        owners = layout["processes"]
        need(
            isinstance(owners, list) and all(is_int(p) and 0 <= p < n for p in owners),
            f"{where}.processes",
            f"must be process indexes below {n}",
        )
        return
    fields(layout, where, {"mesh", "spec"})
    m, spec = layout["mesh"], layout["spec"]
    need(is_int(m) and 0 <= m < len(meshes), f"{where}.mesh", "names no mesh in 'meshes'")
    need(
        isinstance(spec, list) and all(isinstance(e, list) and all(isinstance(a, str) for a in e) for e in spec),
        f"{where}.spec",
        "must be a list of lists of axis names",
    )
    need(
        grid_fits(shape, _spec(spec), meshes[m]),
        f"{where}.spec",
        f"{spec} does not cut shape {list(shape)} into equal cells on mesh {m}",
    )


def _spec(raw: list[list[str]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(e) for e in raw)


def leaf_grid(manifest: Manifest, leaf: int) -> Grid | None:
    """The grid a version 2 leaf was saved as, or None when its layout is not one."""
    entry = manifest.leaves[leaf]
    layout = entry.layout
    if layout is None or "mesh" not in layout or entry.dtype is None:
        return None
    dtype = dtype_from_name(entry.dtype)
    assert dtype is not None
    return Grid(
        manifest.meshes[layout["mesh"]],
        _spec(layout["spec"]),
        entry.shape or (),
        dtype.itemsize,
        leaf,
        manifest.slab_bytes,
    )


def writers_of(manifest: Manifest, leaf: int, boxes: Iterable[Box]) -> set[int]:
    """The processes whose index objects hold the pieces of ``leaf`` that meet ``boxes``.

    All processes when the layout does not say (a reader then reads every index).
    """
    entry = manifest.leaves[leaf]
    if entry.kind not in ARRAY_KINDS or not math.prod(entry.shape or ()):
        return set()
    layout = entry.layout
    if layout is None:
        return set(range(manifest.num_processes))
    if "processes" in layout:
        return set(layout["processes"])
    grid = leaf_grid(manifest, leaf)
    assert grid is not None
    out: set[int] = set()
    for start, stop in boxes:
        out |= grid.processes_for(start, stop)
    return out


def leaves_by_writer(manifest: Manifest, boxes: dict[int, Iterable[Box]]) -> dict[int, set[int]]:
    """For the boxes a reader needs (by leaf), which leaves it needs from each process's index object."""
    out: dict[int, set[int]] = {}
    for leaf, wanted in boxes.items():
        for process in writers_of(manifest, leaf, wanted):
            out.setdefault(process, set()).add(leaf)
    return out


# ----------------------------------------------------------------------------- index objects


@dataclass(frozen=True)
class IndexDoc:
    """One process's index object, read: its blobs and, by leaf, its pieces."""

    process: int
    blobs: dict[str, int]
    pieces: dict[int, list[Piece]]


def index_to_json(
    save_id: str,
    process: int,
    records: Iterable[tuple[int, Piece]],
    blobs: dict[str, int],
    *,
    digest: bool = False,
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
    need(
        doc["save_id"] == manifest.save_id,
        "'save_id'",
        f"{str(doc['save_id'])[:200]!r} is not the manifest's {manifest.save_id!r} (an index object of another save)",
        doc_name,
    )
    need(index_key(manifest.save_id, process) == ref.key, "'save_id'", "does not name this index object", doc_name)
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
    row: Any,
    where: str,
    shapes: list[tuple[tuple[int, ...], int] | None],
    keys: list[str],
    sizes: list[int],
    doc: str,
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
    need(
        offset + length <= sizes[blob],
        where,
        f"bytes [{offset}, {offset + length}) exceed blob {keys[blob]!r}",
        doc,
    )
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
