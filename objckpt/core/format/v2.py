"""Format versions 2 and 3: a root manifest of O(leaves + processes) and one index object per process.

Version 3's root is version 2's with each index object's head length (its index objects:
:mod:`objckpt.core.format.index3`); this module reads and writes both.

The root (``manifest.json``, still the commit marker, written last with
create-if-absent) holds the tree, the leaf table, the meshes the leaves were
saved on (device ids and their processes, once per mesh), each leaf's writers
(its ``layout``: its mesh and partition spec when it is a regular grid, else the processes
that wrote it) and the key, size and crc32c of every process's index object.
An index object holds the pieces its process wrote and the blobs it put them
in; it is written by that process before the commit.

A reader computes from a leaf's writers which processes wrote the boxes it needs
(:mod:`objckpt.core.writer_rule`), reads those index objects only, and checks each
one's size and crc32c against the root before parsing it as strictly as the
root (:mod:`objckpt.core.format.index`). See
``docs/FORMAT.md``. No I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from objckpt.core.checksum import is_sha256_hex
from objckpt.core.dtypes import dtype_from_name
from objckpt.core.format.bases import bases_from_json, bases_to_json
from objckpt.core.format.schema import (
    ARRAY_KINDS,
    BLOB_KEY,
    FORMAT_NAME,
    IndexRef,
    LeafEntry,
    Manifest,
    check_blob_key,
    check_header,
    check_tree_leaves,
    leaf_to_json,
    parse_leaves,
)
from objckpt.core.strict import fields, is_int, need
from objckpt.core.writer_rule import Box, Grid, Mesh, grid_fits
from objckpt.errors import FormatError

_ALL_OR_NONE = "every index object has a sha256 or none does"
_AXIS_NAME_MAX = 256
_HEAD_MIN = 12  # a version 3 head's magic and length


# ----------------------------------------------------------------------------- root


def root_to_json(manifest: Manifest) -> bytes:
    leaves = []
    for leaf in manifest.leaves:
        doc = leaf_to_json(leaf)
        doc.pop("pieces", None)
        if leaf.writers is not None:
            doc["layout"] = leaf.writers
        leaves.append(doc)
    doc = {
        "format": FORMAT_NAME,
        "version": manifest.version,
        "save_id": manifest.save_id,
        **({"shared_save_id": True} if manifest.shared_save_id else {}),
        "created": manifest.created,
        "num_processes": manifest.num_processes,
        "metadata": manifest.metadata,
        "tree": manifest.tree,
        "slab_bytes": manifest.slab_bytes,
        "meshes": [m.to_json() for m in manifest.meshes],
        "indexes": [_ref_to_json(r, manifest.version) for r in manifest.indexes],
        "leaves": leaves,
    }
    if manifest.bases:
        doc["bases"] = bases_to_json(manifest.bases)  # type: ignore[arg-type]
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def require_digest(manifest: Manifest, digest: str | None, url: str) -> None:
    """With ``Options.digest`` set, refuse a checkpoint whose root does not pin its index objects by it.

    Why: whoever can rewrite a copy's root could otherwise drop the digests.
    """
    if digest is not None and (manifest.version < 2 or any(r.sha256 is None for r in manifest.indexes)):
        raise FormatError(f"checkpoint {url} has no {digest} digests; Options(digest={digest!r}) requires them")


def _ref_to_json(ref: IndexRef, version: int) -> dict[str, Any]:
    out = {"key": ref.key, "size": ref.size, "crc32c": ref.crc32c, "blobs": ref.blobs, "blob_bytes": ref.blob_bytes}
    if version >= 3:
        out["head"] = ref.head
    return out if ref.sha256 is None else {**out, "sha256": ref.sha256}


def root_from_doc(doc: dict[str, Any]) -> Manifest:
    """A version 2 or 3 root manifest (``format`` and ``version`` already checked).

    Version 3 is version 2 with each ``indexes`` entry's ``head`` (the byte length of its
    index object's head, which its ``crc32c`` and ``sha256`` cover) and ``shared_save_id``
    required."""
    version = doc["version"]
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
        {"shared_save_id", "bases"},
    )
    check_header(doc)
    need(version >= 3 or "bases" not in doc, "'bases'", "needs version 3")
    bases = bases_from_json(doc["bases"], doc["save_id"]) if "bases" in doc else ()
    need(doc.get("shared_save_id", True) is True, "'shared_save_id'", "must be true when present")
    need(version == 2 or "shared_save_id" in doc, "'shared_save_id'", "required in version 3")
    processes = doc["num_processes"]
    need(is_int(doc["slab_bytes"]) and doc["slab_bytes"] >= 0, "'slab_bytes'", "must be a non-negative integer")
    need(isinstance(doc["meshes"], list), "'meshes'", "must be a list")
    meshes = tuple(_mesh_from_json(m, f"'meshes[{i}]'", processes) for i, m in enumerate(doc["meshes"]))
    need(
        isinstance(doc["indexes"], list) and len(doc["indexes"]) == processes,
        "'indexes'",
        f"must list one index object per process ({processes})",
    )
    indexes: list[IndexRef] = _fast_refs(doc["indexes"], version) or []
    extra = {"head"} if version >= 3 else set()
    seen: set[str] = set()
    for p, raw in enumerate(() if indexes else doc["indexes"]):  # the checks again, naming what is wrong
        where = f"'indexes[{p}]'"
        fields(raw, where, {"key", "size", "crc32c", "blobs", "blob_bytes", *extra}, {"sha256"})
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
        head = raw.get("head", 0)
        need(
            not extra or (is_int(head) and _HEAD_MIN <= head <= raw["size"]),
            f"{where}.head",
            f"must be an integer from {_HEAD_MIN} to the object's size",
        )
        indexes.append(IndexRef(key, raw["size"], raw["crc32c"], raw["blobs"], raw["blob_bytes"], sha, head))
    leaves = parse_leaves(doc["leaves"], None, processes=processes if version >= 3 else None, codecs=version >= 4)
    _check_items(leaves, indexes)
    checked: set[str] = set()  # writers (with their shape) already found good: most leaves share a few
    for i, leaf in enumerate(leaves):
        if leaf.writers is not None:
            key = json.dumps([leaf.writers, leaf.shape])
            if key not in checked:
                _check_writers(leaf.writers, f"'leaves[{i}]'.layout", leaf.shape or (), meshes, processes)
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
        version=version,
        meshes=meshes,
        indexes=tuple(indexes),
        slab_bytes=doc["slab_bytes"],
        shared_save_id="shared_save_id" in doc,
        bases=bases,
    )


_REF_FIELDS = frozenset({"key", "size", "crc32c", "blobs", "blob_bytes"})
_REF_FIELDS_SHA = _REF_FIELDS | {"sha256"}


def _fast_refs(raws: list[Any], version: int) -> list[IndexRef] | None:
    """The root's ``indexes`` if every entry passes the checks of :func:`root_from_doc`, else None.

    Why twice (as :func:`_fast_row`): a root may list a million index objects, and
    formatting each check's message up front costs more than the checks.
    """
    if not raws:
        return None
    first = raws[0]
    expected = _REF_FIELDS_SHA if type(first) is dict and "sha256" in first else _REF_FIELDS
    if version >= 3:
        expected = expected | {"head"}
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
            or not BLOB_KEY.match(key)  # (no part can be "." or ".." then: check_blob_key's other rule)
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
        head = raw.get("head", 0)
        if version >= 3 and (type(head) is not int or not _HEAD_MIN <= head <= size):
            return None
        seen.add(key)
        out.append(IndexRef(key, size, crc, blobs, blob_bytes, sha, head))
    return out


def _check_items(leaves: list[LeafEntry], indexes: list[IndexRef]) -> None:
    """Each process's value of a ``per_process`` leaf lies within the bytes of the blobs that
    process wrote (its index object's ``blob_bytes``): a hostile root cannot point a read past them."""
    for i, leaf in enumerate(leaves):
        if leaf.kind != "per_process":
            continue
        for p, ref in enumerate(leaf.value):
            need(
                ref["length"] == 0 or ref["offset"] + ref["length"] <= indexes[p].blob_bytes,
                f"'leaves[{i}]'.processes[{p}]",
                f"leaf {leaf.path}: bytes [{ref.get('offset')}, {ref.get('offset', 0) + ref['length']}) lie outside"
                f" the {indexes[p].blob_bytes} bytes process {p} wrote",
            )


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


def _check_writers(doc: dict[str, Any], where: str, shape: tuple[int, ...], meshes: tuple[Mesh, ...], n: int) -> None:
    if "processes" in doc:
        fields(doc, where, {"processes"})
        owners = doc["processes"]
        need(
            isinstance(owners, list) and all(is_int(p) and 0 <= p < n for p in owners),
            f"{where}.processes",
            f"must be process indexes below {n}",
        )
        return
    fields(doc, where, {"mesh", "spec"})
    m, spec = doc["mesh"], doc["spec"]
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
    """The grid a version 2 leaf was saved as, or None when its writers are not one."""
    entry = manifest.leaves[leaf]
    writers = entry.writers
    if writers is None or "mesh" not in writers or entry.dtype is None:
        return None
    dtype = dtype_from_name(entry.dtype)
    assert dtype is not None
    return Grid(
        manifest.meshes[writers["mesh"]],
        _spec(writers["spec"]),
        entry.shape or (),
        dtype.itemsize,
        leaf,
        manifest.slab_bytes,
    )


def writers_of(manifest: Manifest, leaf: int, boxes: Iterable[Box]) -> set[int]:
    """The processes whose index objects hold the pieces of ``leaf`` that meet ``boxes``.

    All processes when the writers do not say (a reader then reads every index).
    """
    entry = manifest.leaves[leaf]
    if entry.kind not in ARRAY_KINDS or not math.prod(entry.shape or ()):
        return set()
    writers = entry.writers
    if writers is None:
        return set(range(manifest.num_processes))
    if "processes" in writers:
        return set(writers["processes"])
    grid = leaf_grid(manifest, leaf)
    assert grid is not None
    out: set[int] = set()
    for start, stop in boxes:
        out |= grid.processes_for(start, stop)
    return out


def leaves_by_writer(manifest: Manifest, boxes: Mapping[int, Iterable[Box]]) -> dict[int, set[int]]:
    """For the boxes a reader needs (by leaf), which leaves it needs from each process's index object."""
    out: dict[int, set[int]] = {}
    for leaf, wanted in boxes.items():
        for process in writers_of(manifest, leaf, wanted):
            out.setdefault(process, set()).add(leaf)
    return out
