"""Deleting checkpoints under a manager root, and finding what gc may delete: never a step
a save is writing into.

A checkpoint is deleted manifest first (it stops existing at once), then the rest;
gc deletes objects under ``step_*/`` that no committed manifest references once
they are older than a grace period. Both look for live-save markers
(:mod:`objckpt.saving.live_markers`) in an order that keeps a save in flight safe
(see :func:`unreferenced_objects`). Used by :class:`~objckpt.manager.CheckpointManager`,
its replicas, ``objckpt rm`` and ``objckpt gc``; no JAX.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import defaultdict
from typing import Any

from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import CheckpointNotFoundError, SaveInProgressError
from objckpt.options import Options
from objckpt.saving.live_markers import committed_save_id, explain, live_markers
from objckpt.storage import ObjectInfo, Store
from objckpt.layouts.manifest_io import read_checkpoint

log = logging.getLogger("objckpt")

STEP_DIR = re.compile(r"^step_(\d{10,})$")
_DELETE_CONCURRENCY = 32
#: The live-save marker lease deleters assume when not told (``Options.live_marker_lease``).
LEASE: float = Options.live_marker_lease


async def delete_checkpoint(store: Store, *, lease: float = LEASE, force: bool = False) -> list[str]:
    """Delete the checkpoint rooted at ``store``: manifest first (it stops existing at once), then the rest.

    Unless ``force``, a live-save marker younger than ``lease`` stops it: looked
    for before anything is deleted, and again after the listing, so a save that
    started meanwhile keeps its blobs (their marker came before them).

    Returns the keys deleted after the manifest.

    Raises:
        SaveInProgressError: a save is writing under ``store``.
    """
    if not force:
        await _refuse_if_live(store, lease, "not deleting anything", manifest=True)
    await store.delete(MANIFEST_KEY)
    keys = [o.key for o in await store.list()]
    if not force:
        await _refuse_if_live(store, lease, f"deleted its {MANIFEST_KEY} only; gc collects the rest after the save")
    if MANIFEST_KEY in keys:  # a save committed since: its manifest goes first too
        await store.delete(MANIFEST_KEY)
    await delete_objects(store, [k for k in keys if k != MANIFEST_KEY])
    return keys


async def _refuse_if_live(store: Store, lease: float, what: str, *, manifest: bool = False) -> None:
    """Raise if a live marker holds ``store``; with ``manifest``, name a marker its committed save left."""
    live = await live_markers(store, lease=lease)
    if live:
        committed = await committed_save_id(store, size_limit=Options.manifest_size_limit) if manifest else None
        raise SaveInProgressError(f"{explain(store.url, live, lease=lease, committed_save_id=committed)}: {what}")


async def unreferenced_objects(
    store: Store, *, grace: float, manifest_size_limit: int, lease: float = LEASE
) -> list[ObjectInfo]:
    """Objects under ``step_*/`` of a manager root that no committed manifest references,
    older than ``grace`` seconds (all of them when ``grace <= 0``). Deletes nothing.

    A step holding a live-save marker younger than ``lease`` is skipped whatever
    the grace period. The order is what makes that safe: list the objects, then
    look for markers (a blob in the listing was written after its save's marker),
    then read the manifest again (a save that committed in between references
    its blobs, and deletes its marker only after that).
    """
    objects = await store.list("step_")
    by_step: dict[str, list[Any]] = defaultdict(list)
    for obj in objects:
        head, _, tail = obj.key.partition("/")
        if STEP_DIR.match(head) and tail:
            by_step[head].append(obj)
    now = time.time()
    doomed: list[ObjectInfo] = []
    for head, objs in by_step.items():
        listed = f"{head}/{MANIFEST_KEY}" in {o.key for o in objs}
        referenced = await _referenced(store, head, manifest_size_limit) if listed else set()
        if referenced is None:
            continue
        old = [o for o in objs if grace <= 0 or (o.last_modified is not None and now - o.last_modified >= grace)]
        # Never the manifest: gc deletes keys from a listing, and a later save may commit that key.
        candidates = [o for o in old if o.key not in referenced and o.key != f"{head}/{MANIFEST_KEY}"]
        if not candidates:
            continue
        live = await live_markers(store.child(head), lease=lease)
        if live:
            committed = await committed_save_id(store.child(head), size_limit=manifest_size_limit) if listed else None
            log.info(
                "objckpt gc skips %s", explain(f"{store.url}/{head}", live, lease=lease, committed_save_id=committed)
            )
            continue
        referenced = await _referenced(store, head, manifest_size_limit)
        if referenced is None:
            continue
        doomed.extend(o for o in candidates if o.key not in referenced)
    return doomed


async def _referenced(store: Store, head: str, manifest_size_limit: int) -> set[str] | None:
    """Keys (relative to the root) the manifest of step ``head`` references; empty without
    one; None when it is unreadable (gc then leaves the step alone, and says so)."""
    try:
        manifest = await read_checkpoint(store.child(head), size_limit=manifest_size_limit)
    except CheckpointNotFoundError:
        return set()
    except Exception as e:
        log.warning("objckpt gc skips %s/%s: %s", store.url, head, e)
        return None
    keys = [b.key for b in manifest.blobs] + [r.key for r in manifest.indexes] + [MANIFEST_KEY]
    return {f"{head}/{key}" for key in keys}


async def delete_objects(store: Store, keys: list[str]) -> None:
    """Delete ``keys`` concurrently (a bounded number at once); missing keys are fine."""
    slots = asyncio.Semaphore(_DELETE_CONCURRENCY)

    async def one(key: str) -> None:
        async with slots:
            await store.delete(key)

    await asyncio.gather(*(one(k) for k in keys))
