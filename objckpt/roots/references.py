"""Which objects a root's committed checkpoints reference, across checkpoints (incremental saves).

An incremental checkpoint (``save(..., base=...)``) references blobs of earlier checkpoints beside
it (:mod:`objckpt.core.format.bases`), so an object under ``step_B/`` may be needed by the
manifest of ``step_C``. Deleters count references across the committed manifests under the
parent prefix: ``gc`` keeps every object any of them names, and deleting one checkpoint
(``rm``, ``CheckpointManager.delete``, retention) deletes its manifest but keeps the blobs that
other committed checkpoints reference (``gc`` collects them once no manifest names them).
An unreadable manifest makes the count unknown: nothing it could reference is deleted.

:func:`referenced` reads each committed root once; only one that holds an object asked about,
or names its directory as a base, is read further: its index objects' heads, which list its
blobs (never their frames). Plain JSON, not strict: a document a strict reader refuses is no
checkpoint whose blobs matter, and the strict parser's check of every object costs more than the read.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from typing import Any

from objckpt.core.checksum import crc32c
from objckpt.core.format import MANIFEST_KEY
from objckpt.core.format.bases import root_relative
from objckpt.core.format.index3 import MAGIC
from objckpt.errors import CheckpointNotFoundError, FormatError
from objckpt.layouts.manifest_io import each, read_checkpoint, read_manifest_bytes
from objckpt.layouts.rereads import until_checked
from objckpt.storage import Store

#: Roots (and index heads of each) read at once.
READS_AT_ONCE = 32
_NAMES_SCANNED = 64  # above this many directories asked about, every root is read further


class Unknown(Exception):
    """A committed manifest under the root could not be read: its references are unknown."""


async def referenced(root: Store, heads: Iterable[str], keys: Collection[str], size_limit: int) -> set[str]:
    """Those of ``keys`` (relative to ``root``) that the committed checkpoints ``heads`` under
    ``root`` reference; reading stops once every key is found referenced.

    Raises:
        Unknown: a manifest (or an index object) exists but cannot be read.
    """
    left = set(keys)
    dirs = {k.partition("/")[0] for k in left}

    async def one(head: str) -> None:
        store = root.child(head)
        try:
            data = await read_manifest_bytes(store, size_limit=size_limit) if left else b""
        except CheckpointNotFoundError:
            return  # deleted since the listing, or no checkpoint
        except Exception as e:
            raise Unknown(f"{store.url}: {e}") from e
        # A name is characters JSON never escapes: a root names it in its bytes, unless it escapes.
        if left and (
            head in dirs or b"\\" in data or len(dirs) > _NAMES_SCANNED or any(d.encode() in data for d in dirs)
        ):
            left.difference_update(await step_references(root, head, data, size_limit))

    await each(heads, one, parallel=READS_AT_ONCE)
    return set(keys) - left


async def step_references(root: Store, head: str, data: bytes, size_limit: int) -> set[str]:
    """Keys (relative to ``root``) the committed checkpoint ``head`` (its root's bytes: ``data``)
    references: its manifest, index objects and blobs, its bases' included.

    Raises:
        Unknown: the root or an index object cannot be read.
    """
    store = root.child(head)
    try:
        doc = json.loads(data)
        if doc["version"] in (3, 4):  # each index object's head lists its blobs
            indexes = [r["key"] for r in doc["indexes"]]
            listed = await each(doc["indexes"], lambda r: _head_blobs(store, r, size_limit), parallel=READS_AT_ONCE)
            blobs = [k for keys in listed for k in keys]
        else:  # one JSON index object a process, or none: read whole (an unknown version: refused)
            manifest = await read_checkpoint(store, size_limit=size_limit)
            indexes, blobs = [r.key for r in manifest.indexes], [b.key for b in manifest.blobs]
    except Exception as e:
        raise Unknown(f"{store.url}: {e}") from e
    return {f"{head}/{MANIFEST_KEY}", *(f"{head}/{k}" for k in indexes), *(root_relative(head, k) for k in blobs)}


async def _head_blobs(store: Store, ref: dict[str, Any], size_limit: int) -> list[str]:
    """The blob keys a version 3 index object's head lists (the magic, the JSON's length as 4
    bytes, the JSON: docs/FORMAT.md), checked against the crc32c the root pins; read again
    when it does not match (a byte flipped in flight)."""
    key, length = ref["key"], ref["head"]

    async def read() -> list[str]:
        head = await store.get_range(key, start=0, end=min(length, size_limit))
        if len(head) != length or not head.startswith(MAGIC) or crc32c(head) != ref["crc32c"]:
            raise FormatError(f"index object {store.url}/{key}: its head does not match the root's crc32c")
        return [blob[0] for blob in json.loads(head[len(MAGIC) + 4 :])["blobs"]]

    return await until_checked(read, store)


async def may_be_a_base(step: Store, size_limit: int) -> bool:
    """Could checkpoints beside ``step`` reference its blobs? Only one with SHA-256 digests can be
    a base; one without a readable manifest may have been (its objects are kept as if it were).
    Read before its manifest is deleted, so deleting a plain checkpoint lists nothing beside it."""
    try:  # the root document alone: parsing its leaves would load the dtype table (ml_dtypes)
        indexes = json.loads(await read_manifest_bytes(step, size_limit=size_limit)).get("indexes") or []
        return any(not isinstance(r, dict) or r.get("sha256") is not None for r in indexes)
    except Exception:
        return True


async def referenced_by_others(step: Store, keys: Collection[str], size_limit: int) -> set[str]:
    """Those of ``keys`` (relative to ``step``) that the other committed checkpoints beside it
    reference (found by listing the parent one level, not every object beneath it).

    Raises:
        Unknown: one of them cannot be read.
    """
    parent = step.parent()
    blobs = [k for k in keys if k.endswith(".blob")]  # a reference leads to a blob, nothing else
    if parent is None or not blobs:
        return set()
    name = step.url.rstrip("/").rpartition("/")[2]
    others = [n for n in await parent.list_names() if n != name]  # one level: what has no manifest is skipped
    found = await referenced(parent, others, {f"{name}/{k}" for k in blobs}, size_limit)
    return {k[len(name) + 1 :] for k in found}
