"""Which objects a root's committed checkpoints reference, across checkpoints (incremental saves).

An incremental checkpoint (``save(..., base=...)``) references blobs of earlier checkpoints beside
it (:mod:`objckpt.core.format.bases`), so an object under ``step_B/`` may be needed by the
manifest of ``step_C``. Deleters count references across every committed manifest under the
parent prefix: ``gc`` keeps every object any of them names, and deleting one checkpoint
(``rm``, ``CheckpointManager.delete``, retention) deletes its manifest but keeps the blobs that
other committed checkpoints reference (``gc`` collects them once no manifest names them).
An unreadable manifest makes the count unknown: nothing it could reference is deleted.
"""

from __future__ import annotations

import logging

from objckpt.core.format import MANIFEST_KEY
from objckpt.core.format.bases import root_relative
from objckpt.core.strict import strict_json
from objckpt.errors import CheckpointNotFoundError
from objckpt.layouts.manifest_io import read_checkpoint, read_manifest, read_manifest_bytes
from objckpt.storage import Store

log = logging.getLogger("objckpt")


class Unknown(Exception):
    """A committed manifest under the root could not be read: its references are unknown."""


async def step_references(root: Store, head: str, size_limit: int, *, base_only: bool = False) -> set[str]:
    """Keys (relative to ``root``) the committed checkpoint ``head`` references, its own and
    its bases'; empty without a manifest. ``base_only``: only a checkpoint with bases is read whole
    (its root first), and only keys outside ``head`` are returned.

    Raises:
        Unknown: the manifest (or an index object) exists but cannot be read.
    """
    store = root.child(head)
    try:
        if base_only:
            root_doc = await read_manifest(store, size_limit=size_limit)
            if not root_doc.bases:
                return set()
        manifest = await read_checkpoint(store, size_limit=size_limit)
    except CheckpointNotFoundError:
        return set()
    except Exception as e:
        raise Unknown(f"{store.url}: {e}") from e
    keys = {root_relative(head, b.key) for b in manifest.blobs}
    if base_only:
        return {k for k in keys if not k.startswith(f"{head}/")}
    keys.update(f"{head}/{r.key}" for r in manifest.indexes)
    keys.add(f"{head}/{MANIFEST_KEY}")
    return keys


async def committed_heads(root: Store) -> list[str]:
    """The names of the checkpoints directly under ``root`` that have a manifest (one listing)."""
    suffix = f"/{MANIFEST_KEY}"
    return sorted(
        {o.key[: -len(suffix)] for o in await root.list() if o.key.endswith(suffix) and o.key.count("/") == 1}
    )


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


async def referenced_by_others(step: Store, size_limit: int) -> set[str]:
    """Keys (relative to ``step``) that the other committed checkpoints beside it reference.

    Raises:
        Unknown: one of them cannot be read.
    """
    parent = step.parent()
    if parent is None:
        return set()
    name = step.url.rstrip("/").rpartition("/")[2]
    out: set[str] = set()
    for head in await committed_heads(parent):
        if head != name:
            keys = await step_references(parent, head, size_limit, base_only=True)
            out.update(k[len(name) + 1 :] for k in keys if k.startswith(f"{name}/"))
    return out
