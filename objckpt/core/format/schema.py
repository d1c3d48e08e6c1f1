"""The manifest's schema, shared by every format version: the records and the strict field rules.

``manifest.json`` is written last, with create-if-absent, so its presence is the
commit. It holds the tree skeleton, every leaf's kind, dtype and shape, and for
every stored piece of a leaf its global index box, blob key, byte offset,
length and crc32c. See ``docs/FORMAT.md`` for the spec.

Reading is strict because a manifest may come from anyone: a size cap, exact
field sets and types, dtypes from a fixed table, boxes inside shapes, pieces
that tile each leaf exactly (no overlap, no hole), byte ranges inside their
blob, lengths equal to dtype × box, and blob keys that cannot leave the
checkpoint prefix. Any violation is a :class:`FormatError` naming the field.
The versions (:mod:`objckpt.core.format.v1`, :mod:`objckpt.core.format.v2`) build
on these rules; :mod:`objckpt.core.format.manifest` picks one by the ``version``
field. This module does no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from objckpt.core.checksum import is_sha256_hex
from objckpt.core.codecs import CODEC
from objckpt.core.dtypes import dtype_from_name
from objckpt.core.items import (
    ENCODINGS,
    JSON_MAX_BYTES,
    PER_PROCESS_MAX_BYTES,
    document_from_stored,
    stored_document,
    stored_size,
)
from objckpt.core.pieces import Piece, check_tiling, fast_piece, piece_from_json
from objckpt.core.strict import fields, is_int, need
from objckpt.core.writer_rule import Mesh
from objckpt.errors import FormatError

if TYPE_CHECKING:
    from objckpt.core.format.rows import Rows

FORMAT_NAME = "objckpt"
FORMAT_VERSION = 3  # what saves write (Options.format_version)
READ_VERSIONS = (1, 2, 3, 4)  # what readers take (4: version 3 with compressed leaves)
MANIFEST_KEY = "manifest.json"

ARRAY_KINDS = ("array", "ndarray", "str", "bytes")  # leaves whose data lives in blobs
INLINE_KINDS = ("int", "float", "bool", "none")  # leaves stored in the manifest itself
ITEM_KINDS = ("json", "per_process")  # version 3: named non-array items (objckpt.core.items)
BLOB_KEY = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]*(/[A-Za-z0-9_\-][A-Za-z0-9_.\-]*)*$")
_MAX_RANK = 64
Index = tuple[int, ...]
PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")  # typed PRNG keys, stored as their uint32 key data


@dataclass(frozen=True)
class LeafEntry:
    """One leaf of the saved tree.

    ``kind`` is ``array`` (a jax.Array), ``ndarray`` (numpy), ``str``/``bytes``
    (stored as uint8 data), an inline ``int``/``float``/``bool``/``none``, or (version 3)
    an item: ``json`` (``value`` the document) or ``per_process`` (``value`` each
    process's ``{"encoding", "length", "crc32c"[, "blob", "offset"]}``, in process order;
    while a save runs, this process's ``{"encoding", "length"}``).
    """

    path: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    # A tuple (as parsed), or (what a restore plans from, every version) rows read as a sequence: format.rows.LeafPieces.
    pieces: Sequence[Piece] = ()
    value: Any = None
    sharding: dict[str, Any] | None = None
    # version 2's "layout" key: who wrote it ({"mesh", "spec"} or {"processes"}); None: any process
    writers: dict[str, Any] | None = None
    codec: str | None = None  # version 4: how its pieces are encoded (objckpt.core.codecs.CODEC); None: raw

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


class IndexRef(NamedTuple):
    """Versions 2 and 3: one process's index object, as the root manifest lists it.

    A named tuple, not a dataclass (as :class:`Piece`): a root may list a million.
    """

    key: str
    size: int
    crc32c: int
    blobs: int = 0  # how many blobs the process wrote
    blob_bytes: int = 0  # and their bytes
    sha256: str | None = None  # hex SHA-256 of the index object (version 3: of its head) (Options.digest)
    head: int = 0  # version 3: the byte length of the index object's head (crc32c and sha256 cover it alone)


@dataclass(frozen=True)
class Manifest:
    save_id: str
    created: str
    tree: dict[str, Any]
    leaves: tuple[LeafEntry, ...]
    blobs: tuple[BlobEntry, ...]
    num_processes: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)
    version: int = 1
    # Version 2 (see objckpt.core.format.v2): the meshes leaves were saved on, each
    # process's index object (by process), the replica slab size the writers used,
    # and which processes' index objects have been read into ``leaves``/``blobs``.
    meshes: tuple[Mesh, ...] = ()
    indexes: tuple[IndexRef, ...] = ()
    slab_bytes: int = 0
    loaded: frozenset[int] = frozenset()
    # Version 2: every index object carries the root's save_id (a root written when each
    # process picked its own id has False, and its index objects are read by the key rule).
    shared_save_id: bool = False
    # Version 3, incremental (objckpt.core.format.bases): the earlier checkpoints, siblings of
    # this one, whose blobs its pieces point into, as (name, save_id); () for a whole checkpoint.
    bases: tuple[tuple[str, str], ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    @property
    def num_blobs(self) -> int:
        """Blobs in the checkpoint (from the root alone in version 2)."""
        return sum(r.blobs for r in self.indexes) if self.version >= 2 else len(self.blobs)

    def with_pieces(self, pieces: dict[int, list[Piece]], blobs: dict[str, int], processes: set[int]) -> Manifest:
        """This manifest with more pieces (by leaf) and blobs, read from the index objects of ``processes``."""
        leaves = tuple(
            replace(leaf, pieces=(*leaf.pieces, *pieces[i])) if i in pieces else leaf
            for i, leaf in enumerate(self.leaves)
        )
        known = {b.key: b.size for b in self.blobs}
        known.update(blobs)
        return replace(
            self,
            leaves=leaves,
            blobs=tuple(BlobEntry(k, s) for k, s in known.items()),
            loaded=self.loaded | frozenset(processes),
        )

    def with_rows(self, rows: Rows, blobs: dict[str, int], processes: set[int]) -> Manifest:
        """This manifest with the pieces of ``rows`` (columns, by leaf, see
        :mod:`objckpt.core.format.rows`) and blobs, read from the index objects of ``processes``.
        A leaf that already has pieces gets both as one tuple."""
        leaves = []
        for i, leaf in enumerate(self.leaves):
            if i in rows.bounds:
                found = rows.leaf(i)
                leaf = replace(leaf, pieces=(*leaf.pieces, *found) if leaf.pieces else found)
            leaves.append(leaf)
        known = {b.key: b.size for b in self.blobs}
        known.update(blobs)
        return replace(
            self,
            leaves=tuple(leaves),
            blobs=tuple(BlobEntry(k, s) for k, s in known.items()),
            loaded=self.loaded | frozenset(processes),
        )

    def in_columns(self) -> Manifest:
        """This manifest with every leaf's pieces as rows of one :class:`Rows` (what a restore
        plans from, whatever the version that listed them): itself when they already are."""
        from objckpt.core.format.rows import LeafPieces, rows_from_pieces  # numpy: not for `objckpt --help`

        held = {id(leaf.pieces.rows) for leaf in self.leaves if isinstance(leaf.pieces, LeafPieces)}
        tuples = any(leaf.pieces and not isinstance(leaf.pieces, LeafPieces) for leaf in self.leaves)
        if len(held) <= 1 and not tuples:
            return self
        rows = rows_from_pieces(
            (i, leaf.pieces, dtype.itemsize if (dtype := dtype_from_name(leaf.dtype or "")) else 0)
            for i, leaf in enumerate(self.leaves)
            if leaf.pieces
        )
        leaves = tuple(
            replace(leaf, pieces=rows.leaf(i)) if leaf.pieces else leaf for i, leaf in enumerate(self.leaves)
        )
        return replace(self, leaves=leaves)


def leaf_to_json(leaf: LeafEntry) -> dict[str, Any]:
    """One leaf as a manifest writes it (version 2 drops ``pieces`` and adds ``layout``)."""
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
        if leaf.codec is not None:
            out["codec"] = leaf.codec
    elif leaf.kind == "float":
        out["value"] = float(leaf.value).hex()
    elif leaf.kind == "per_process":
        out["processes"] = list(leaf.value)
    elif leaf.kind == "json":
        out["value"], floats = stored_document(leaf.value)
        if floats:  # NaN and infinities: stored as strings, listed here (rule 14)
            out["floats"] = floats
    elif leaf.kind != "none":
        out["value"] = leaf.value
    return out


# ----------------------------------------------------------------------------- reading


def check_header(doc: dict[str, Any]) -> None:
    """The fields every version shares (``format`` and ``version`` already checked)."""
    need(isinstance(doc["save_id"], str) and 0 < len(doc["save_id"]) <= 128, "'save_id'", "must be a short string")
    need(isinstance(doc["created"], str) and len(doc["created"]) <= 64, "'created'", "must be a short string")
    need(is_int(doc["num_processes"]) and doc["num_processes"] >= 1, "'num_processes'", "must be a positive integer")
    need(isinstance(doc["metadata"], dict), "'metadata'", "must be an object")
    need(isinstance(doc["tree"], dict), "'tree'", "must be an object")
    need(isinstance(doc["leaves"], list), "'leaves'", "must be a list")


def parse_leaves(
    raw_leaves: list[Any], blobs: dict[str, int] | None, *, processes: int | None = None, codecs: bool = False
) -> list[LeafEntry]:
    """The leaf table, paths unique, checked against the tree; ``blobs`` None: version 2 (no pieces).

    ``processes`` (version 3: the root's ``num_processes``) admits the item kinds; ``codecs``
    (version 4) an array leaf's ``codec``.
    """
    leaves = []
    seen_paths: set[str] = set()
    for i, raw in enumerate(raw_leaves):
        leaf = _leaf_from_json(raw, f"'leaves[{i}]'", blobs, processes, codecs)
        need(leaf.path not in seen_paths, f"'leaves[{i}]'.path", f"duplicate leaf path {leaf.path!r}")
        seen_paths.add(leaf.path)
        leaves.append(leaf)
    return leaves


def check_blob_key(key: str) -> bool:
    """True when ``key`` is a relative key that stays inside the checkpoint prefix."""
    if not key or len(key) > 1024 or not BLOB_KEY.match(key):
        return False
    return all(part not in (".", "..") for part in key.split("/"))


def _leaf_from_json(
    raw: Any, where: str, blobs: dict[str, int] | None, processes: int | None, codecs: bool = False
) -> LeafEntry:
    """One leaf; version 1 (``blobs`` given) lists its pieces, version 2 may give its ``layout``
    (checked by :mod:`objckpt.core.format.v2`, which knows the meshes); version 3
    (``processes`` given) may hold items."""
    need(isinstance(raw, dict), where, "must be an object")
    kind = raw.get("kind")
    known = ARRAY_KINDS + INLINE_KINDS + (ITEM_KINDS if processes is not None else ())
    need(kind in known, f"{where}.kind", f"unknown kind {kind!r}")
    if kind in ITEM_KINDS:
        assert processes is not None
        return _item_from_json(raw, where, kind, processes)
    if kind in ARRAY_KINDS and blobs is None:
        fields(
            raw,
            where,
            {"path", "kind", "dtype", "shape"},
            {"sharding", "layout", "codec"} if codecs else {"sharding", "layout"},
        )
    elif kind in ARRAY_KINDS:
        fields(raw, where, {"path", "kind", "dtype", "shape", "pieces"}, {"sharding"})
    elif kind == "none":
        fields(raw, where, {"path", "kind"})
    else:
        fields(raw, where, {"path", "kind", "value"})
    path = raw["path"]
    need(isinstance(path, str) and len(path) <= 4096, f"{where}.path", "must be a string")
    if kind == "none":
        return LeafEntry(path, kind)
    if kind == "int":
        need(is_int(raw["value"]), f"{where}.value", "must be an integer")
        return LeafEntry(path, kind, value=raw["value"])
    if kind == "bool":
        need(isinstance(raw["value"], bool), f"{where}.value", "must be a boolean")
        return LeafEntry(path, kind, value=raw["value"])
    if kind == "float":
        try:
            value = float.fromhex(raw["value"])
        except (TypeError, ValueError, OverflowError):
            raise FormatError(f"manifest field {where}.value: must be a float in hex notation") from None
        return LeafEntry(path, kind, value=value)

    dtype = dtype_from_name(raw["dtype"]) if isinstance(raw["dtype"], str) else None
    need(dtype is not None, f"{where}.dtype", f"unsupported dtype {raw['dtype']!r}")
    assert dtype is not None
    if kind in ("str", "bytes"):
        need(raw["dtype"] == "uint8", f"{where}.dtype", "str and bytes leaves are uint8")
    shape = raw["shape"]
    need(
        isinstance(shape, list) and len(shape) <= _MAX_RANK and all(is_int(d) and d >= 0 for d in shape),
        f"{where}.shape",
        "must be a list of non-negative integers",
    )
    if kind in ("str", "bytes"):
        need(len(shape) == 1, f"{where}.shape", "str and bytes leaves are 1-D")
    sharding = raw.get("sharding")
    need(sharding is None or isinstance(sharding, dict), f"{where}.sharding", "must be an object")
    if sharding is not None and "prng_impl" in sharding:
        need(sharding["prng_impl"] in PRNG_IMPLS, f"{where}.sharding.prng_impl", f"unknown {sharding['prng_impl']!r}")
    if blobs is None:
        layout = raw.get("layout")
        need(layout is None or isinstance(layout, dict), f"{where}.layout", "must be an object")
        codec = raw.get("codec")
        need(
            codec is None or codec == CODEC,
            f"{where}.codec",
            f"unknown codec {str(codec)[:100]!r} (this objckpt reads {CODEC!r})",
        )
        return LeafEntry(path, kind, raw["dtype"], tuple(shape), sharding=sharding, writers=layout, codec=codec)
    need(isinstance(raw["pieces"], list), f"{where}.pieces", "must be a list")
    pieces = tuple(
        fast_piece(p, shape, dtype.itemsize, blobs)
        or piece_from_json(p, f"{where}.pieces[{j}]", shape, dtype.itemsize, blobs)
        for j, p in enumerate(raw["pieces"])
    )
    check_tiling(pieces, tuple(shape), f"{where}.pieces")
    return LeafEntry(path, kind, raw["dtype"], tuple(shape), pieces, sharding=sharding)


def _item_from_json(raw: dict[str, Any], where: str, kind: str, processes: int) -> LeafEntry:
    """A ``json`` or ``per_process`` leaf (version 3), every error naming the leaf's path."""
    json_item = kind == "json"
    fields(raw, where, {"path", "kind", "value" if json_item else "processes"}, {"floats"} if json_item else set())
    path = raw["path"]
    need(isinstance(path, str) and len(path) <= 4096, f"{where}.path", "must be a string")
    if json_item:
        floats = raw.get("floats")
        size = stored_size(raw["value"], floats or [])
        need(
            size <= JSON_MAX_BYTES,
            f"{where}.value",
            f"leaf {path}: a JSON document of {size} bytes, over the {JSON_MAX_BYTES}-byte cap",
        )
        if floats is None:
            return LeafEntry(path, kind, value=raw["value"])
        try:
            return LeafEntry(path, kind, value=document_from_stored(raw["value"], floats))
        except ValueError as e:
            raise FormatError(f"manifest field {where}.floats: leaf {path}: {e}") from None
    values = raw["processes"]
    need(
        isinstance(values, list) and len(values) == processes,
        f"{where}.processes",
        f"leaf {path}: must list one value per process ({processes})",
    )
    for p, ref in enumerate(values):
        at = f"{where}.processes[{p}]"
        need(isinstance(ref, dict), at, f"leaf {path}: must be an object")
        stored = isinstance(ref.get("length"), int) and ref["length"] > 0
        fields(ref, at, {"encoding", "length", "crc32c", *(("blob", "offset") if stored else ())}, {"sha256"})
        need(stored or "sha256" not in ref, f"{at}.sha256", f"leaf {path}: an empty value has no sha256")
        need("sha256" not in ref or is_sha256_hex(ref["sha256"]), f"{at}.sha256", f"leaf {path}: not 64 lowercase hex")
        need(ref["encoding"] in ENCODINGS, f"{at}.encoding", f"leaf {path}: unknown encoding {ref['encoding']!r}")
        need(
            is_int(ref["length"]) and 0 <= ref["length"] <= PER_PROCESS_MAX_BYTES,
            f"{at}.length",
            f"leaf {path}: must be an integer from 0 to {PER_PROCESS_MAX_BYTES}",
        )
        need(is_int(ref["crc32c"]) and 0 <= ref["crc32c"] < 2**32, f"{at}.crc32c", f"leaf {path}: not a crc32c")
        need(stored or ref["crc32c"] == 0, f"{at}.crc32c", f"leaf {path}: an empty value's crc32c is 0")
        if stored:
            blob = ref["blob"]
            need(isinstance(blob, str) and check_blob_key(blob), f"{at}.blob", f"leaf {path}: unsafe key {blob!r}")
            need(
                is_int(ref["offset"]) and 0 <= ref["offset"] < 2**62,
                f"{at}.offset",
                f"leaf {path}: must be a non-negative integer",
            )
    return LeafEntry(path, kind, value=tuple(values))


def check_tree_leaves(tree: dict[str, Any], n_leaves: int) -> None:
    """Every leaf index in the tree exists and appears exactly once."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        need(depth <= 256 and isinstance(node, dict), "'tree'", "malformed or too deep")
        if node.get("t") == "leaf":
            i = node.get("i")
            need(is_int(i) and 0 <= i < n_leaves, "'tree'", f"leaf index {i!r} out of range")
            need(i not in seen, "'tree'", f"leaf index {i} appears twice")
            seen.add(i)
        else:
            children = node.get("c")
            need(isinstance(children, list), "'tree'", f"node {node.get('t')!r} without children")
            if node.get("t") in ("dict", "node"):
                _check_node_keys(node.get("k"), len(children))
            stack.extend((c, depth + 1) for c in children)
    need(len(seen) == n_leaves, "'tree'", f"references {len(seen)} of {n_leaves} leaves")


def _check_node_keys(keys: Any, n_children: int) -> None:
    """A dict or node names each child by its own key: as many keys as children, each a
    string or integer, none twice (a repeated key would drop the leaves under all but one)."""
    need(isinstance(keys, list) and len(keys) == n_children, "'tree'", "a node's keys do not match its children")
    for k in keys:
        need(is_int(k) or isinstance(k, str), "'tree'", f"bad key {k!r}")
    if len(set(keys)) != len(keys):
        seen: set[Any] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise FormatError(f"manifest field 'tree': key {dup!r} appears twice in one node")
