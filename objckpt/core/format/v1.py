"""Format version 1: one manifest that lists every piece of every leaf, and every blob.

Still read (checkpoints written before version 2); written only where a caller
builds a version 1 :class:`~objckpt.core.format.schema.Manifest` (tests, tools).
See ``docs/FORMAT.md``. No I/O.
"""

from __future__ import annotations

import json
from typing import Any

from objckpt.core.format.schema import (
    FORMAT_NAME,
    BlobEntry,
    Manifest,
    check_blob_key,
    check_header,
    check_tree_leaves,
    leaf_to_json,
    parse_leaves,
)
from objckpt.core.strict import fields, is_int, need


def root_to_json(manifest: Manifest) -> bytes:
    """A version 1 manifest's bytes (every piece inline)."""
    doc = {
        "format": FORMAT_NAME,
        "version": manifest.version,
        "save_id": manifest.save_id,
        "created": manifest.created,
        "num_processes": manifest.num_processes,
        "metadata": manifest.metadata,
        "tree": manifest.tree,
        "blobs": [{"key": b.key, "size": b.size} for b in manifest.blobs],
        "leaves": [leaf_to_json(leaf) for leaf in manifest.leaves],
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def root_from_doc(doc: dict[str, Any]) -> Manifest:
    """A version 1 manifest (``format`` and ``version`` already checked): pieces tile each leaf."""
    fields(
        doc,
        "(top level)",
        {"format", "version", "save_id", "created", "num_processes", "metadata", "tree", "blobs", "leaves"},
    )
    check_header(doc)
    need(isinstance(doc["blobs"], list), "'blobs'", "must be a list")

    blobs: dict[str, int] = {}
    for i, b in enumerate(doc["blobs"]):
        where = f"'blobs[{i}]'"
        fields(b, where, {"key", "size"})
        need(isinstance(b["key"], str) and check_blob_key(b["key"]), f"{where}.key", f"unsafe blob key {b['key']!r}")
        need(is_int(b["size"]) and b["size"] >= 0, f"{where}.size", "must be a non-negative integer")
        need(b["key"] not in blobs, f"{where}.key", f"duplicate blob {b['key']!r}")
        blobs[b["key"]] = b["size"]

    leaves = parse_leaves(doc["leaves"], blobs)
    check_tree_leaves(doc["tree"], len(leaves))
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
