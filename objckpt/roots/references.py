"""Which objects a root's committed checkpoints reference, across checkpoints (incremental saves).

An incremental checkpoint (``save(..., base=...)``) references blobs of earlier checkpoints beside
it (:mod:`objckpt.core.format.bases`), so an object under ``step_B/`` may be needed by the
manifest of ``step_C``. Deleters count references across the committed manifests under the
parent prefix: ``gc`` keeps every object any of them names, and deleting one checkpoint
(``rm``, ``CheckpointManager.delete``, retention) deletes its manifest but keeps the blobs that
other committed checkpoints reference (``gc`` collects them once no manifest names them).
An unreadable manifest makes the count unknown: nothing it could reference is deleted.

What is read (:func:`referenced`): each committed root once, :data:`READS_AT_ONCE` reads at a
time; a checkpoint references objects of its own and blobs of the bases its root names, so only
a root that holds one of the objects asked about, or names the directory of one, is read
further, and then only its index objects' heads, which list its blobs (never their frames).
Both are parsed as plain JSON, not strictly: a document a strict reader refuses is no checkpoint
whose blobs matter, and the strict parser's check of every object costs more than the read.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Any, TypeVar

from objckpt.core.checksum import crc32c
from objckpt.core.format import MANIFEST_KEY
from objckpt.core.format.bases import root_relative
from objckpt.core.format.index3 import MAGIC
from objckpt.core.strict import strict_json
from objckpt.errors import CheckpointNotFoundError, FormatError
from objckpt.layouts.manifest_io import read_checkpoint, read_manifest_bytes
from objckpt.layouts.rereads import until_checked
from objckpt.storage import Store

log = logging.getLogger("objckpt")

#: Format versions whose index objects start with a head that lists their blobs.
HEADED = (3, 4)
#: Reads (roots, index heads) in flight at once.
READS_AT_ONCE = 32
#: Above this many directories asked about, a root is read further without looking for their names.
_NAMES_SCANNED = 64
T = TypeVar("T")


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
    slots = asyncio.Semaphore(READS_AT_ONCE)

    async def one(head: str) -> None:
        store = root.child(head)
        try:
            async with slots:
                if not left:
                    return
                data = await read_manifest_bytes(store, size_limit=size_limit)
        except CheckpointNotFoundError:
            return  # deleted since the listing, or no checkpoint
        except Exception as e:
            raise Unknown(f"{store.url}: {e}") from e
        if left and (head in dirs or _may_name(data, dirs)):
            left.difference_update(await step_references(root, head, data, size_limit, slots))

    await _each(heads, one)
    return set(keys) - left


def _may_name(data: bytes, names: Collection[str]) -> bool:
    """Could the root ``data`` name one of ``names`` (as a base)? A name is characters JSON never
    escapes, so it is in the bytes as is, unless the document spells it with escapes."""
    return b"\\" in data or len(names) > _NAMES_SCANNED or any(n.encode() in data for n in names)


async def step_references(
    root: Store, head: str, data: bytes, size_limit: int, slots: asyncio.Semaphore | None = None
) -> set[str]:
    """Keys (relative to ``root``) the committed checkpoint ``head`` (its root's bytes: ``data``)
    references: its manifest, index objects and blobs, its bases' included.

    Raises:
        Unknown: the root or an index object cannot be read.
    """
    store = root.child(head)
    slots = slots or asyncio.Semaphore(READS_AT_ONCE)
    try:
        doc = json.loads(data)
        if doc["version"] in HEADED:
            indexes = [r["key"] for r in doc["indexes"]]
            heads = await _each(doc["indexes"], lambda ref: _head_blobs(store, ref, size_limit, slots))
            blobs = [k for keys in heads for k in keys]
        else:  # one JSON index object a process, or none: read whole (an unknown version: refused)
            manifest = await read_checkpoint(store, size_limit=size_limit)
            indexes, blobs = [r.key for r in manifest.indexes], [b.key for b in manifest.blobs]
    except Exception as e:
        raise Unknown(f"{store.url}: {e}") from e
    return {f"{head}/{MANIFEST_KEY}", *(f"{head}/{k}" for k in indexes), *(root_relative(head, k) for k in blobs)}


async def _head_blobs(store: Store, ref: dict[str, Any], size_limit: int, slots: asyncio.Semaphore) -> list[str]:
    """The blob keys a version 3 index object's head lists (the magic, the JSON's length as 4
    bytes, the JSON: docs/FORMAT.md), checked against the crc32c the root pins; read again
    when it does not match (a byte flipped in flight)."""
    key, length = ref["key"], ref["head"]
    if not 0 < length <= size_limit:
        raise FormatError(f"index object {store.url}/{key}: a head of {length} bytes")

    async def read() -> list[str]:
        async with slots:
            head = await store.get_range(key, start=0, end=length)
        if len(head) != length or not head.startswith(MAGIC) or crc32c(head) != ref["crc32c"]:
            raise FormatError(f"index object {store.url}/{key}: its head does not match the root's crc32c")
        try:
            return [blob[0] for blob in json.loads(head[len(MAGIC) + 4 :])["blobs"]]
        except ValueError as e:
            raise FormatError(f"index object {store.url}/{key}: its head is not JSON ({e})") from None

    return await until_checked(read, store)


async def _each(items: Iterable[Any], fn: Callable[[Any], Awaitable[T]]) -> list[T]:
    """``fn`` over ``items``, at most :data:`READS_AT_ONCE` at once, each drawn as another ends
    (so that a reading that can stop early stops); the first error cancels the rest and is raised."""
    source, running, out = iter(items), set[asyncio.Future[T]](), list[T]()
    try:
        while True:
            running.update(asyncio.ensure_future(fn(i)) for i in itertools.islice(source, READS_AT_ONCE - len(running)))
            if not running:
                return out
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            out.extend(future.result() for future in done)
    finally:
        for future in running:
            future.cancel()


async def may_be_a_base(step: Store, size_limit: int) -> bool:
    """Could checkpoints beside ``step`` reference its blobs? Only one with SHA-256 digests can be
    a base; one without a readable manifest may have been (its objects are kept as if it were).
    Read before its manifest is deleted, so deleting a plain checkpoint lists nothing beside it."""
    try:  # the root document alone: parsing its leaves would load the dtype table (ml_dtypes)
        doc = strict_json(await read_manifest_bytes(step, size_limit=size_limit))
        indexes = doc.get("indexes") or []
    except Exception:
        return True
    if not isinstance(indexes, list):
        return True
    return any(not isinstance(r, dict) or r.get("sha256") is not None for r in indexes)


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
