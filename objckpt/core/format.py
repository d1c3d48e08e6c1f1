"""The manifest: the one JSON document that makes a checkpoint exist.

``manifest.json`` is written last, with create-if-absent, so its presence is the
commit. It holds the tree skeleton, every leaf's kind, dtype and shape, and for
every stored piece of a leaf its global index box, blob key, byte offset,
length and crc32c. See ``docs/FORMAT.md`` for the spec.

Reading is strict because a manifest may come from anyone: a size cap, exact
field sets and types, dtypes from a fixed table, boxes inside shapes, pieces
that tile each leaf exactly (no overlap, no hole), byte ranges inside their
blob, lengths equal to dtype × box, and blob keys that cannot leave the
checkpoint prefix. Any violation is a :class:`FormatError` naming the field.
This module does no I/O.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from objckpt.core.dtypes import dtype_from_name
from objckpt.errors import FormatError

FORMAT_NAME = "objckpt"
FORMAT_VERSION = 1
MANIFEST_KEY = "manifest.json"

ARRAY_KINDS = ("array", "ndarray", "str", "bytes")  # leaves whose data lives in blobs
INLINE_KINDS = ("int", "float", "bool", "none")  # leaves stored in the manifest itself
_BLOB_KEY = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]*(/[A-Za-z0-9_\-][A-Za-z0-9_.\-]*)*$")
_MAX_RANK = 64
PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")  # typed PRNG keys, stored as their uint32 key data


@dataclass(frozen=True)
class Piece:
    """A box ``[start, stop)`` of one leaf, stored C-ordered at ``blob[offset:offset+length]``."""

    start: tuple[int, ...]
    stop: tuple[int, ...]
    blob: str
    offset: int
    length: int
    crc32c: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))


@dataclass(frozen=True)
class LeafEntry:
    """One leaf of the saved tree.

    ``kind`` is ``array`` (a jax.Array), ``ndarray`` (numpy), ``str``/``bytes``
    (stored as uint8 data), or an inline ``int``/``float``/``bool``/``none``.
    """

    path: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    pieces: tuple[Piece, ...] = ()
    value: Any = None
    sharding: dict[str, Any] | None = None

    @property
    def prng_impl(self) -> str | None:
        """For typed PRNG keys: the key implementation; the stored data is ``key_data``."""
        return (self.sharding or {}).get("prng_impl")

    @property
    def nbytes(self) -> int:
        if self.kind not in ARRAY_KINDS or self.shape is None or self.dtype is None:
            return 0
        itemsize = dtype_from_name(self.dtype).itemsize  # type: ignore[union-attr]
        return math.prod(self.shape) * itemsize


@dataclass(frozen=True)
class BlobEntry:
    key: str
    size: int


@dataclass(frozen=True)
class Manifest:
    save_id: str
    created: str
    tree: dict[str, Any]
    leaves: tuple[LeafEntry, ...]
    blobs: tuple[BlobEntry, ...]
    num_processes: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "version": self.version,
            "save_id": self.save_id,
            "created": self.created,
            "num_processes": self.num_processes,
            "metadata": self.metadata,
            "tree": self.tree,
            "blobs": [{"key": b.key, "size": b.size} for b in self.blobs],
            "leaves": [_leaf_to_json(leaf) for leaf in self.leaves],
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _leaf_to_json(leaf: LeafEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"path": leaf.path, "kind": leaf.kind}
    if leaf.kind in ARRAY_KINDS:
        out["dtype"] = leaf.dtype
        out["shape"] = list(leaf.shape or ())
        out["pieces"] = [
            {
                "start": list(p.start),
                "stop": list(p.stop),
                "blob": p.blob,
                "offset": p.offset,
                "length": p.length,
                "crc32c": p.crc32c,
            }
            for p in leaf.pieces
        ]
        if leaf.sharding is not None:
            out["sharding"] = leaf.sharding
    elif leaf.kind == "float":
        out["value"] = float(leaf.value).hex()
    elif leaf.kind != "none":
        out["value"] = leaf.value
    return out


# ----------------------------------------------------------------------------- reading


def parse_manifest(data: bytes, *, size_limit: int) -> Manifest:
    """Parse and validate manifest bytes.

    Raises:
        FormatError: naming the first field that is wrong.
    """
    if len(data) > size_limit:
        raise FormatError(f"manifest is {len(data)} bytes, over the limit of {size_limit}")
    return _manifest_from_doc(_strict_json(data))


def _strict_json(data: bytes) -> Any:
    """``data`` as JSON under the rules ``json.loads`` leaves loose (RFC 8259 §8.1, §6, §4):
    UTF-8 with no byte-order mark (``json.loads`` would take UTF-16/32 and a BOM), no
    ``NaN``/``Infinity`` and no number that overflows to infinity (``1e999``), and no object
    with the same key twice (where ``json.loads`` silently keeps the last one)."""
    if data[:3] == b"\xef\xbb\xbf":
        raise FormatError("manifest is not valid JSON: it starts with a UTF-8 byte-order mark")
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray | memoryview) else data
    except UnicodeDecodeError as e:
        raise FormatError(f"manifest is not valid JSON: not UTF-8 at byte {e.start} ({e.reason})") from None
    try:
        return json.loads(
            text, parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys
        )
    except (ValueError, RecursionError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"manifest is not valid JSON: {e}") from None


def _reject_constant(name: str) -> Any:
    raise FormatError(f"manifest contains the non-JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise FormatError(f"manifest contains the number {text[:40]}, which overflows a double")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise FormatError(f"manifest has an object with the key {dup[:100]!r} twice")
    return obj


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise FormatError(f"manifest field {where}: {what}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _fields(obj: Any, where: str, required: set[str], optional: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    _need(isinstance(obj, dict), where, "must be an object")
    keys = set(obj)
    _need(required <= keys, where, f"missing {sorted(required - keys)}")
    _need(keys <= required | optional, where, f"unknown {sorted(keys - required - optional)}")


def _manifest_from_doc(doc: Any) -> Manifest:
    _fields(
        doc,
        "(top level)",
        {"format", "version", "save_id", "created", "num_processes", "metadata", "tree", "blobs", "leaves"},
    )
    _need(doc["format"] == FORMAT_NAME, "'format'", f"must be {FORMAT_NAME!r}")
    _need(_is_int(doc["version"]), "'version'", "must be an integer")
    if doc["version"] != FORMAT_VERSION:
        raise FormatError(
            f"manifest field 'version': {doc['version']} is not supported (this objckpt reads {FORMAT_VERSION})"
        )
    _need(isinstance(doc["save_id"], str) and 0 < len(doc["save_id"]) <= 128, "'save_id'", "must be a short string")
    _need(isinstance(doc["created"], str) and len(doc["created"]) <= 64, "'created'", "must be a short string")
    _need(_is_int(doc["num_processes"]) and doc["num_processes"] >= 1, "'num_processes'", "must be a positive integer")
    _need(isinstance(doc["metadata"], dict), "'metadata'", "must be an object")
    _need(isinstance(doc["tree"], dict), "'tree'", "must be an object")
    _need(isinstance(doc["blobs"], list), "'blobs'", "must be a list")
    _need(isinstance(doc["leaves"], list), "'leaves'", "must be a list")

    blobs: dict[str, int] = {}
    for i, b in enumerate(doc["blobs"]):
        where = f"'blobs[{i}]'"
        _fields(b, where, {"key", "size"})
        _need(isinstance(b["key"], str) and check_blob_key(b["key"]), f"{where}.key", f"unsafe blob key {b['key']!r}")
        _need(_is_int(b["size"]) and b["size"] >= 0, f"{where}.size", "must be a non-negative integer")
        _need(b["key"] not in blobs, f"{where}.key", f"duplicate blob {b['key']!r}")
        blobs[b["key"]] = b["size"]

    leaves = []
    seen_paths: set[str] = set()
    for i, raw in enumerate(doc["leaves"]):
        leaf = _leaf_from_json(raw, f"'leaves[{i}]'", blobs)
        _need(leaf.path not in seen_paths, f"'leaves[{i}]'.path", f"duplicate leaf path {leaf.path!r}")
        seen_paths.add(leaf.path)
        leaves.append(leaf)
    _check_tree_leaves(doc["tree"], len(leaves))
    return Manifest(
        save_id=doc["save_id"],
        created=doc["created"],
        tree=doc["tree"],
        leaves=tuple(leaves),
        blobs=tuple(BlobEntry(k, s) for k, s in blobs.items()),
        num_processes=doc["num_processes"],
        metadata=doc["metadata"],
        version=doc["version"],
    )


def check_blob_key(key: str) -> bool:
    """True when ``key`` is a relative key that stays inside the checkpoint prefix."""
    if not key or len(key) > 1024 or not _BLOB_KEY.match(key):
        return False
    return all(part not in (".", "..") for part in key.split("/"))


def _leaf_from_json(raw: Any, where: str, blobs: dict[str, int]) -> LeafEntry:
    _need(isinstance(raw, dict), where, "must be an object")
    kind = raw.get("kind")
    _need(kind in ARRAY_KINDS + INLINE_KINDS, f"{where}.kind", f"unknown kind {kind!r}")
    if kind in ARRAY_KINDS:
        _fields(raw, where, {"path", "kind", "dtype", "shape", "pieces"}, {"sharding"})
    elif kind == "none":
        _fields(raw, where, {"path", "kind"})
    else:
        _fields(raw, where, {"path", "kind", "value"})
    path = raw["path"]
    _need(isinstance(path, str) and len(path) <= 4096, f"{where}.path", "must be a string")
    if kind == "none":
        return LeafEntry(path, kind)
    if kind == "int":
        _need(_is_int(raw["value"]), f"{where}.value", "must be an integer")
        return LeafEntry(path, kind, value=raw["value"])
    if kind == "bool":
        _need(isinstance(raw["value"], bool), f"{where}.value", "must be a boolean")
        return LeafEntry(path, kind, value=raw["value"])
    if kind == "float":
        try:
            value = float.fromhex(raw["value"])
        except (TypeError, ValueError, OverflowError):
            raise FormatError(f"manifest field {where}.value: must be a float in hex notation") from None
        return LeafEntry(path, kind, value=value)

    dtype = dtype_from_name(raw["dtype"]) if isinstance(raw["dtype"], str) else None
    _need(dtype is not None, f"{where}.dtype", f"unsupported dtype {raw['dtype']!r}")
    assert dtype is not None
    if kind in ("str", "bytes"):
        _need(raw["dtype"] == "uint8", f"{where}.dtype", "str and bytes leaves are uint8")
    shape = raw["shape"]
    _need(
        isinstance(shape, list) and len(shape) <= _MAX_RANK and all(_is_int(d) and d >= 0 for d in shape),
        f"{where}.shape",
        "must be a list of non-negative integers",
    )
    if kind in ("str", "bytes"):
        _need(len(shape) == 1, f"{where}.shape", "str and bytes leaves are 1-D")
    sharding = raw.get("sharding")
    _need(sharding is None or isinstance(sharding, dict), f"{where}.sharding", "must be an object")
    if sharding is not None and "prng_impl" in sharding:
        _need(sharding["prng_impl"] in PRNG_IMPLS, f"{where}.sharding.prng_impl", f"unknown {sharding['prng_impl']!r}")
    _need(isinstance(raw["pieces"], list), f"{where}.pieces", "must be a list")
    pieces = tuple(
        _fast_piece(p, shape, dtype.itemsize, blobs)
        or _piece_from_json(p, f"{where}.pieces[{j}]", shape, dtype.itemsize, blobs)
        for j, p in enumerate(raw["pieces"])
    )
    _check_tiling(pieces, tuple(shape), f"{where}.pieces")
    return LeafEntry(path, kind, raw["dtype"], tuple(shape), pieces, sharding=sharding)


_PIECE_KEYS = frozenset({"start", "stop", "blob", "offset", "length", "crc32c"})


def _fast_piece(raw: Any, shape: list[int], itemsize: int, blobs: dict[str, int]) -> Piece | None:
    """The piece if it passes every check of :func:`_piece_from_json`, else None (which
    then names what is wrong).

    Why twice: building each check's message and field name up front costs more
    than the checks themselves, once per piece; this tests the same conditions
    and formats nothing. ``type(x) is int`` excludes booleans, as
    :func:`_is_int` does.
    """
    if type(raw) is not dict or raw.keys() != _PIECE_KEYS:
        return None
    start, stop, blob, offset, length, crc = (
        raw["start"],
        raw["stop"],
        raw["blob"],
        raw["offset"],
        raw["length"],
        raw["crc32c"],
    )
    if type(start) is not list or type(stop) is not list or len(start) != len(shape) or len(stop) != len(shape):
        return None
    expected = itemsize
    for a, b, n in zip(start, stop, shape):
        if type(a) is not int or type(b) is not int or not 0 <= a < b <= n:
            return None
        expected *= b - a
    size = blobs.get(blob) if type(blob) is str else None
    if (
        size is None
        or type(offset) is not int
        or type(length) is not int
        or type(crc) is not int
        or offset < 0
        or length != expected
        or offset + length > size
        or not 0 <= crc < 2**32
    ):
        return None
    return Piece(tuple(start), tuple(stop), blob, offset, length, crc)


def _piece_from_json(raw: Any, where: str, shape: list[int], itemsize: int, blobs: dict[str, int]) -> Piece:
    _fields(raw, where, {"start", "stop", "blob", "offset", "length", "crc32c"})
    start, stop = raw["start"], raw["stop"]
    for name, box in (("start", start), ("stop", stop)):
        _need(
            isinstance(box, list) and len(box) == len(shape) and all(_is_int(v) for v in box),
            f"{where}.{name}",
            f"must be {len(shape)} integers",
        )
    for d, (a, b, n) in enumerate(zip(start, stop, shape)):
        _need(0 <= a < b <= n, f"{where}", f"box [{a}, {b}) outside dimension {d} of size {n}")
    blob = raw["blob"]
    _need(isinstance(blob, str) and blob in blobs, f"{where}.blob", f"names no blob in 'blobs': {blob!r}")
    offset, length = raw["offset"], raw["length"]
    _need(_is_int(offset) and offset >= 0, f"{where}.offset", "must be a non-negative integer")
    expected = math.prod(b - a for a, b in zip(start, stop)) * itemsize
    _need(_is_int(length) and length == expected, f"{where}.length", f"must be {expected} (dtype × box)")
    _need(offset + length <= blobs[blob], f"{where}", f"bytes [{offset}, {offset + length}) exceed blob {blob!r}")
    _need(_is_int(raw["crc32c"]) and 0 <= raw["crc32c"] < 2**32, f"{where}.crc32c", "must be a 32-bit integer")
    return Piece(tuple(start), tuple(stop), blob, offset, length, raw["crc32c"])


def _check_tiling(pieces: tuple[Piece, ...], shape: tuple[int, ...], where: str) -> None:
    """Pieces must cover the leaf exactly: volumes add up and no two overlap."""
    total = math.prod(shape)
    covered = sum(math.prod(p.shape) for p in pieces)
    if total == 0:
        _need(not pieces, where, "an empty leaf has no pieces")
        return
    _need(covered == total, where, f"pieces cover {covered} elements of {total} (holes or overlaps)")
    # Sweep on dimension 0 (or the single point of a scalar) to find overlaps.
    order = sorted(pieces, key=lambda p: p.start)
    for i, p in enumerate(order):
        for q in order[i + 1 :]:
            if shape and q.start[0] >= p.stop[0]:
                break
            if all(qa < pb and pa < qb for pa, pb, qa, qb in zip(p.start, p.stop, q.start, q.stop)):
                raise FormatError(f"manifest field {where}: boxes {p.start}-{p.stop} and {q.start}-{q.stop} overlap")


def _check_tree_leaves(tree: dict[str, Any], n_leaves: int) -> None:
    """Every leaf index in the tree exists and appears exactly once."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        _need(depth <= 256 and isinstance(node, dict), "'tree'", "malformed or too deep")
        if node.get("t") == "leaf":
            i = node.get("i")
            _need(_is_int(i) and 0 <= i < n_leaves, "'tree'", f"leaf index {i!r} out of range")
            _need(i not in seen, "'tree'", f"leaf index {i} appears twice")
            seen.add(i)
        else:
            children = node.get("c")
            _need(isinstance(children, list), "'tree'", f"node {node.get('t')!r} without children")
            if node.get("t") in ("dict", "node"):
                _check_node_keys(node.get("k"), len(children))
            stack.extend((c, depth + 1) for c in children)
    _need(len(seen) == n_leaves, "'tree'", f"references {len(seen)} of {n_leaves} leaves")


def _check_node_keys(keys: Any, n_children: int) -> None:
    """A dict or node names each child by its own key: as many keys as children, each a
    string or integer, none twice (a repeated key would drop the leaves under all but one)."""
    _need(isinstance(keys, list) and len(keys) == n_children, "'tree'", "a node's keys do not match its children")
    for k in keys:
        _need(_is_int(k) or isinstance(k, str), "'tree'", f"bad key {k!r}")
    if len(set(keys)) != len(keys):
        seen: set[Any] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise FormatError(f"manifest field 'tree': key {dup!r} appears twice in one node")
