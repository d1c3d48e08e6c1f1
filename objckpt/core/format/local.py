"""The local tier's format: one process's own part of a step, in one data file and a manifest.

A local step lives in ``<local>/process_<p>/step_<N>/`` (:mod:`objckpt.locations.local_dirs`)
and holds two files:

- ``<save_id>.data``: the raw bytes of every box this process saved, back to back (each
  box C-ordered, 64-byte aligned);
- ``manifest.json``, written last (a temporary file renamed over it once the data file is
  synced), so a torn save is a directory without a manifest and is never read.

The manifest (``"format": "objckpt-local"``, version 2) names the manager root it belongs
to, the step, the save id every process of the save shares, this process's index and the
job's process count, the tree's
skeleton (:func:`objckpt.core.tree.flatten`), and per leaf: its kind (``array``, ``ndarray``,
``str``, ``bytes``, ``per_process``, ``json``, ``int``, ``float``, ``bool``, ``none``), dtype,
global shape, inline value (scalars, JSON documents, a per-process value's encoding), its
boxes: ``start``, ``shape``, ``offset``, ``length``, ``crc32c``, and for an array saved with a
``NamedSharding`` that sharding (``mesh`` shape, ``axes`` and their ``types``, the mesh's
``devices`` by id, the partition ``spec``), so a restart onto another sharding of the same
devices reads the saved boxes and reshards on the devices. A process holds every
box its devices hold, each once, so a restart on the same devices reads nothing else; a
leaf's boxes are disjoint (checked on every parse), so a box assembled from several is whole
exactly when their overlap with it adds up to its volume.

The file is the manifest's JSON sealed, ``{"crc32c":<n>,"mac":"<hex>","manifest":<json>}``,
both taken over the JSON's exact bytes: its crc32c, so a flipped bit anywhere in it is refused
(as a flipped bit in the data file is refused by the box's crc32c), and an HMAC-SHA256 under
the key of the manager run that saved it (:func:`authentic`). That key lives in the manager's
root (:mod:`objckpt.locations.run_keys`), never on the local disk: a manifest edited or made
by someone who can write the local tier but not read the root, or a step whose root no
longer holds its run's key (another job's, a root wiped and reused), is not authentic.

It is parsed as strictly as the object-store manifest (:mod:`objckpt.core.strict`): a
local disk can be damaged too. No I/O here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from objckpt.core.checksum import crc32c
from objckpt.core.dtypes import dtype_from_name
from objckpt.core.items import document_from_stored, stored_document
from objckpt.core.strict import fields, is_int, need, strict_json
from objckpt.errors import FormatError

FORMAT = "objckpt-local"
VERSION = 2
MANIFEST = "manifest.json"
ALIGN = 64
KINDS = ("array", "ndarray", "str", "bytes", "per_process", "json", "int", "float", "bool", "none")
_DOC = "local-tier manifest"
_SEALED = re.compile(rb'\A\{"crc32c":(\d{1,10}),"mac":"([0-9a-f]{64})","manifest":(.*)\}\Z', re.DOTALL)

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, shape)


@dataclass(frozen=True)
class LocalBox:
    """One saved box of a leaf: where it sits in the global array and in the data file."""

    start: tuple[int, ...]
    shape: tuple[int, ...]
    offset: int
    length: int
    crc32c: int = 0

    def contains(self, start: tuple[int, ...], shape: tuple[int, ...]) -> bool:
        return all(s0 <= s and s + n <= s0 + n0 for s0, n0, s, n in zip(self.start, self.shape, start, shape))


@dataclass(frozen=True)
class LocalLeaf:
    """One leaf of a local step: its kind, dtype and global shape, inline value, boxes."""

    path: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    value: Any = None
    boxes: tuple[LocalBox, ...] = ()
    prng_impl: str | None = None
    sharding: dict[str, Any] | None = None


@dataclass(frozen=True)
class LocalManifest:
    """A local step's manifest (see the module docstring)."""

    root: str
    step: int
    save_id: str
    process_index: int
    process_count: int
    data: str
    data_size: int
    tree: dict[str, Any]
    leaves: tuple[LocalLeaf, ...]
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self, key: bytes) -> bytes:
        """The manifest's file: its JSON sealed under ``key``, the key of the run that saved it."""
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "root": self.root,
            "step": self.step,
            "save_id": self.save_id,
            "process_index": self.process_index,
            "process_count": self.process_count,
            "data": self.data,
            "data_size": self.data_size,
            "tree": self.tree,
            "metadata": self.metadata,
            "leaves": [_leaf_json(leaf) for leaf in self.leaves],
        }
        return seal(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode(), key)


def _mac(body: bytes, key: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode()


def seal(body: bytes, key: bytes) -> bytes:
    """A manifest's JSON as its file: ``{"crc32c":<n>,"mac":"<HMAC-SHA256 under key>","manifest":<body>}``."""
    return b'{"crc32c":%d,"mac":"%s","manifest":%s}' % (crc32c(body), _mac(body, key), body)


def _match(data: bytes) -> re.Match[bytes]:
    match = _SEALED.match(data)
    if match is None:
        raise FormatError(f'{_DOC}: not {{"crc32c":<n>,"mac":"<hex>","manifest":<json>}}')
    if crc32c(match.group(3)) != int(match.group(1)):
        raise FormatError(f"{_DOC}: its bytes fail their crc32c (a damaged or edited manifest)")
    return match


def unseal(data: bytes) -> bytes:
    """The manifest's JSON from its file, its crc32c checked (its MAC: :func:`authentic`).

    Raises:
        FormatError: not a sealed manifest, or its bytes fail their crc32c.
    """
    return _match(data).group(3)


def authentic(data: bytes, key: bytes) -> bool:
    """Whether the sealed manifest ``data`` carries the MAC of its JSON under ``key`` (its run's key)."""
    match = _match(data)
    return hmac.compare_digest(match.group(2), _mac(match.group(3), key))


def _leaf_json(leaf: LocalLeaf) -> dict[str, Any]:
    out: dict[str, Any] = {"path": leaf.path, "kind": leaf.kind}
    if leaf.dtype is not None:
        out["dtype"] = leaf.dtype
        out["shape"] = list(leaf.shape)
    if leaf.kind == "json":
        out["value"], floats = stored_document(leaf.value)
        if floats:  # NaN and infinities, stored as strings (objckpt.core.items.stored_document)
            out["floats"] = floats
    elif leaf.value is not None:
        out["value"] = leaf.value
    if leaf.prng_impl is not None:
        out["prng_impl"] = leaf.prng_impl
    if leaf.sharding is not None:
        out["sharding"] = leaf.sharding
    if leaf.boxes:
        out["boxes"] = [[list(b.start), list(b.shape), b.offset, b.length, b.crc32c] for b in leaf.boxes]
    return out


def parse_local_manifest(data: bytes) -> LocalManifest:
    """A local step's manifest from its file's bytes (sealed, :func:`seal`), every field checked.

    Raises:
        FormatError: not a sealed local-tier manifest or its crc32c fails, another version, or
            a field out of place (a box outside the data file, a length that does not match its
            shape and dtype, two boxes of a leaf that overlap).
    """
    doc = strict_json(unseal(data), _DOC)
    fields(
        doc,
        "(root)",
        {
            "format",
            "version",
            "root",
            "step",
            "save_id",
            "process_index",
            "process_count",
            "data",
            "data_size",
            "tree",
            "leaves",
        },
        {"metadata"},
        doc=_DOC,
    )
    need(doc["format"] == FORMAT, "format", f"not {FORMAT!r}", _DOC)
    need(doc["version"] == VERSION, "version", f"version {doc['version']!r} is not {VERSION}", _DOC)
    for name in ("step", "process_index", "process_count", "data_size"):
        need(is_int(doc[name]) and doc[name] >= 0, name, "not a non-negative integer", _DOC)
    need(isinstance(doc["root"], str) and doc["root"] != "", "root", "not a URL", _DOC)
    need(doc["process_index"] < doc["process_count"], "process_index", "not below process_count", _DOC)
    need(isinstance(doc["save_id"], str) and doc["save_id"].isalnum(), "save_id", "not an alphanumeric id", _DOC)
    need(doc["data"] == f"{doc['save_id']}.data", "data", "not '<save_id>.data'", _DOC)
    need(isinstance(doc["tree"], dict), "tree", "not an object", _DOC)
    need(isinstance(doc["leaves"], list), "leaves", "not a list", _DOC)
    metadata = doc.get("metadata", {})
    need(isinstance(metadata, dict), "metadata", "not an object", _DOC)
    leaves = tuple(_parse_leaf(raw, i, doc["data_size"]) for i, raw in enumerate(doc["leaves"]))
    return LocalManifest(
        root=doc["root"],
        step=doc["step"],
        save_id=doc["save_id"],
        process_index=doc["process_index"],
        process_count=doc["process_count"],
        data=doc["data"],
        data_size=doc["data_size"],
        tree=doc["tree"],
        leaves=leaves,
        metadata=metadata,
    )


def _parse_leaf(raw: Any, i: int, data_size: int) -> LocalLeaf:
    where = f"leaves[{i}]"
    fields(
        raw, where, {"path", "kind"}, {"dtype", "shape", "value", "floats", "boxes", "prng_impl", "sharding"}, doc=_DOC
    )
    need(isinstance(raw["path"], str), f"{where}.path", "not a string", _DOC)
    kind = raw["kind"]
    need(kind in KINDS, f"{where}.kind", f"{kind!r} is not one of {KINDS}", _DOC)
    need(isinstance(raw.get("shape", []), list), f"{where}.shape", "not a list", _DOC)
    need(isinstance(raw.get("boxes", []), list), f"{where}.boxes", "not a list", _DOC)
    dtype, shape = raw.get("dtype"), tuple(raw.get("shape", ()))
    itemsize = 0
    if dtype is not None:
        found = dtype_from_name(dtype) if isinstance(dtype, str) else None
        need(found is not None, f"{where}.dtype", f"unknown dtype {dtype!r}", _DOC)
        assert found is not None
        itemsize = found.itemsize
        need(all(is_int(n) and n >= 0 for n in shape), f"{where}.shape", "not a list of sizes", _DOC)
    prng = raw.get("prng_impl")
    need(prng is None or isinstance(prng, str), f"{where}.prng_impl", "not a string", _DOC)
    boxes = []
    for j, box in enumerate(raw.get("boxes", [])):
        at = f"{where}.boxes[{j}]"
        need(isinstance(box, list) and len(box) == 5, at, "not [start, shape, offset, length, crc32c]", _DOC)
        start, bshape, offset, length, crc = box
        ok = isinstance(start, list) and isinstance(bshape, list) and len(start) == len(bshape) == len(shape)
        ok = ok and all(is_int(v) and v >= 0 for v in (*start, *bshape, offset, length, crc))
        need(ok, at, "malformed box", _DOC)
        need(all(s + n <= d for s, n, d in zip(start, bshape, shape)), at, "outside the leaf's shape", _DOC)
        need(length == math.prod(bshape) * itemsize, at, "length does not match its shape and dtype", _DOC)
        need(offset + length <= data_size, at, "past the end of the data file", _DOC)
        boxes.append(LocalBox(tuple(start), tuple(bshape), offset, length, crc))
    _check_disjoint(boxes, where)
    if kind == "per_process":
        value = raw.get("value")
        need(isinstance(value, dict) and value.get("encoding") in ("bytes", "str", "json"), where, "bad value", _DOC)
        need(len(boxes) <= 1 and dtype == "uint8", where, "a per-process value is one uint8 box", _DOC)
    value = raw.get("value")
    if "floats" in raw:
        need(kind == "json", f"{where}.floats", "only a json leaf lists floats", _DOC)
        try:
            value = document_from_stored(value, raw["floats"])
        except ValueError as e:
            raise FormatError(f"{_DOC} field {where}.floats: {e}") from None
    sharding = raw.get("sharding")
    if sharding is not None:
        need(kind == "array" and prng is None, f"{where}.sharding", "only an array leaf records a sharding", _DOC)
        _check_sharding(sharding, len(shape), f"{where}.sharding")
    return LocalLeaf(raw["path"], kind, dtype, shape, value, tuple(boxes), prng, sharding)


def _check_sharding(raw: Any, ndim: int, where: str) -> None:
    """A recorded NamedSharding: ``mesh`` sizes, ``axes`` names and ``types``, ``devices`` ids, ``spec``."""
    fields(raw, where, {"mesh", "axes", "types", "devices", "spec"}, set(), doc=_DOC)
    mesh, axes, types, devices, spec = (raw[k] for k in ("mesh", "axes", "types", "devices", "spec"))
    ok = isinstance(mesh, list) and all(is_int(n) and n > 0 for n in mesh)
    ok = ok and isinstance(axes, list) and len(axes) == len(mesh) and all(isinstance(a, str) for a in axes)
    ok = ok and len(set(axes)) == len(axes) and isinstance(types, list) and len(types) == len(mesh)
    ok = ok and all(t in ("Auto", "Explicit", "Manual") for t in types)
    need(ok, where, "not a mesh (sizes, distinct axis names, axis types)", _DOC)
    ok = isinstance(devices, list) and len(devices) == math.prod(mesh) and all(is_int(d) and d >= 0 for d in devices)
    need(ok and len(set(devices)) == len(devices), f"{where}.devices", "not one distinct id per mesh place", _DOC)
    need(isinstance(spec, list) and len(spec) <= ndim, f"{where}.spec", "not a spec of the leaf's rank", _DOC)
    used: list[str] = []
    for entry in spec:
        names = [] if entry is None else [entry] if isinstance(entry, str) else entry
        need(isinstance(names, list) and all(n in axes for n in names), f"{where}.spec", "names no mesh axis", _DOC)
        used.extend(names)
    need(len(set(used)) == len(used), f"{where}.spec", "uses an axis twice", _DOC)


def _check_disjoint(boxes: list[LocalBox], where: str) -> None:
    """Refuse two boxes of one leaf that share an element (a damaged or forged manifest): a
    restore adds up covered volume, which overlapping boxes would fake."""
    ordered = sorted(boxes, key=lambda b: b.start)
    for i, a in enumerate(ordered):
        if not all(ordered[i].shape):
            continue
        for b in ordered[i + 1 :]:
            if b.start and b.start[0] >= a.start[0] + a.shape[0]:
                break
            if all(b.shape) and all(
                s0 < t0 + n1 and t0 < s0 + n0 for s0, n0, t0, n1 in zip(a.start, a.shape, b.start, b.shape)
            ):
                raise FormatError(f"{_DOC} field {where}.boxes: boxes at {list(a.start)} and {list(b.start)} overlap")


def aligned(offset: int) -> int:
    """``offset`` rounded up to the data file's box alignment."""
    return -(-offset // ALIGN) * ALIGN


def check_whole(manifest: LocalManifest) -> None:
    """Refuse a manifest whose leaves' boxes overlap in the data file (a damaged or forged one)."""
    spans = sorted((b.offset, b.offset + b.length) for leaf in manifest.leaves for b in leaf.boxes)
    for (_, a1), (b0, _) in zip(spans, spans[1:]):
        if b0 < a1:
            raise FormatError(f"{_DOC} of step {manifest.step}: boxes overlap in {manifest.data} at byte {b0}")
