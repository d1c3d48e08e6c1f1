"""Deleting checkpoints under a manager root (one, or all of them), and gc: never a step a
save is writing into.

A checkpoint is deleted manifest first (it stops existing at once), then the rest;
gc (:func:`collect`) deletes objects under ``step_*/`` that no committed manifest
references once they are older than a grace period. Both look for live-save
markers (:mod:`objckpt.saving.live_markers`) in an order that keeps a save in
flight safe (see :func:`unreferenced_objects`). :func:`delete_root` keeps the same
order for every checkpoint under a root at once (``objckpt rm --recursive``). Used
by :class:`~objckpt.manager.checkpoint_manager.CheckpointManager`, its replicas,
``objckpt rm`` and ``objckpt gc``; no JAX.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Any

from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import SaveInProgressError
from objckpt.options import Options
from objckpt.roots.references import Unknown, may_be_a_base, referenced, referenced_by_others
from objckpt.roots.step_names import STEP_DIR
from objckpt.saving.live_markers import LIVE_DIR, committed_save_id, explain, is_live, is_marker, live_markers
from objckpt.storage import ObjectInfo, Store

log = logging.getLogger("objckpt")

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
    base = await may_be_a_base(store, Options.manifest_size_limit)
    await store.delete(MANIFEST_KEY)
    keys = [o.key for o in await store.list()]
    if not force:
        await _refuse_if_live(store, lease, f"deleted its {MANIFEST_KEY} only; gc collects the rest after the save")
    if MANIFEST_KEY in keys:  # a save committed since: its manifest goes first too
        await store.delete(MANIFEST_KEY)
    rest = [k for k in keys if k != MANIFEST_KEY]
    try:  # blobs that incremental checkpoints beside it reference stay, until gc finds none does
        kept = await referenced_by_others(store, rest, Options.manifest_size_limit) if base else set()
    except Unknown as e:
        log.warning("objckpt deleted %s/%s only; gc collects the rest: %s", store.url, MANIFEST_KEY, e)
        return [MANIFEST_KEY]
    doomed = [k for k in rest if k not in kept]
    await delete_objects(store, doomed)
    return doomed


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

    References are counted across every committed manifest of the root (an incremental
    step references blobs of earlier steps: :mod:`objckpt.roots.references`); when one
    cannot be read, nothing is collected. A step holding a live-save marker younger than
    ``lease`` is skipped whatever the grace period (an incremental save puts one in its
    base too). The order is what makes that safe: list the objects, then look for markers
    (a blob in the listing was written after its save's marker), then read the manifests
    again (a save that committed in between references its blobs, and deletes its marker
    only after that).
    """
    objects = await store.list("step_")
    by_step: dict[str, list[Any]] = defaultdict(list)
    for obj in objects:
        head, _, tail = obj.key.partition("/")
        if STEP_DIR.match(head) and tail:
            by_step[head].append(obj)
    now = time.time()
    # Never a manifest: gc deletes keys from a listing, and a later save may commit that key.
    old = [
        o
        for head, objs in by_step.items()
        for o in objs
        if o.key != f"{head}/{MANIFEST_KEY}"
        and (grace <= 0 or (o.last_modified is not None and now - o.last_modified >= grace))
    ]
    heads = [h for h, objs in by_step.items() if _listed(h, objs)]
    unreferenced: dict[str, list[ObjectInfo]] = defaultdict(list)
    for o in await _unreferenced(store, heads, old, manifest_size_limit):
        unreferenced[o.key.partition("/")[0]].append(o)
    candidates: list[ObjectInfo] = []
    for head, mine in sorted(unreferenced.items()):
        live = await live_markers(store.child(head), lease=lease)
        if live:
            listed = _listed(head, by_step[head])
            committed = await committed_save_id(store.child(head), size_limit=manifest_size_limit) if listed else None
            log.info(
                "objckpt gc skips %s", explain(f"{store.url}/{head}", live, lease=lease, committed_save_id=committed)
            )
            continue
        candidates.extend(mine)
    if not candidates:
        return []
    heads = sorted({o.key.partition("/")[0] for o in await store.list("step_") if o.key.endswith(f"/{MANIFEST_KEY}")})
    return await _unreferenced(store, heads, candidates, manifest_size_limit)


def _listed(head: str, objs: list[ObjectInfo]) -> bool:
    return f"{head}/{MANIFEST_KEY}" in {o.key for o in objs}


async def collect(
    store: Store, *, grace: float, manifest_size_limit: int, lease: float = LEASE, dry_run: bool = False
) -> list[ObjectInfo]:
    """gc of the manager root ``store``: the :func:`unreferenced_objects`, deleted (unless
    ``dry_run``); returns them."""
    found = await unreferenced_objects(store, grace=grace, manifest_size_limit=manifest_size_limit, lease=lease)
    if not dry_run:
        await delete_objects(store, [o.key for o in found])
    return found


async def _unreferenced(
    store: Store, heads: list[str], objects: list[ObjectInfo], manifest_size_limit: int
) -> list[ObjectInfo]:
    """Those of ``objects`` that the manifests of steps ``heads`` do not reference (their bases'
    references included); none when one is unreadable (gc then collects nothing, and says so)."""
    try:
        found = await referenced(store, heads, {o.key for o in objects}, manifest_size_limit)
    except Unknown as e:
        log.warning("objckpt gc collects nothing under %s: a manifest cannot be read (%s)", store.url, e)
        return []
    return [o for o in objects if o.key not in found]


async def delete_objects(store: Store, keys: list[str]) -> None:
    """Delete ``keys`` concurrently (a bounded number at once); missing keys are fine."""
    slots = asyncio.Semaphore(_DELETE_CONCURRENCY)

    async def one(key: str) -> None:
        async with slots:
            await store.delete(key)

    await asyncio.gather(*(one(k) for k in keys))


async def delete_root(
    store: Store, objects: list[ObjectInfo], *, lease: float = LEASE, force: bool = False
) -> list[str]:
    """Delete every object under ``store`` (listed as ``objects``): every checkpoint's manifest
    first, then the rest. Returns the manifests' keys.

    The order is :func:`delete_checkpoint`'s, applied to all of them: unless ``force``,
    look for live-save markers under any checkpoint (a save in flight keeps the whole
    root untouched), delete every manifest (each checkpoint stops existing at once),
    look for markers again (a save that started meanwhile keeps its objects), then
    delete every other object of ``objects``.

    Raises:
        SaveInProgressError: a save is writing under ``store``; it says whether nothing,
            or only the manifests, went.
    """
    keys = [o.key for o in objects]
    manifests = [k for k in keys if k == MANIFEST_KEY or k.endswith("/" + MANIFEST_KEY)]
    if not force:
        await _refuse_if_any_live(store, objects, lease, "nothing removed")
    await delete_objects(store, manifests)
    if not force:
        await _refuse_if_any_live(
            store,
            await store.list(),
            lease,
            f"deleted the {len(manifests)} manifest(s) only; gc collects the rest after the save",
        )
    chosen = set(manifests)
    await delete_objects(store, [k for k in keys if k not in chosen])
    return manifests


async def _refuse_if_any_live(store: Store, objects: list[ObjectInfo], lease: float, what: str) -> None:
    """Raise naming the first checkpoint under ``store`` that a live-save marker holds."""
    now = time.time()
    live = [o for o in objects if is_marker(o.key) and is_live(o, lease=lease, now=now)]
    if not live:
        return
    prefix = live[0].key.rpartition(f"{LIVE_DIR}/")[0].rstrip("/")
    held = [m for m in live if m.key.rpartition(f"{LIVE_DIR}/")[0].rstrip("/") == prefix]
    where: Any = store.child(prefix) if prefix else store
    markers = [ObjectInfo(m.key[len(prefix) + 1 :] if prefix else m.key, m.size, m.last_modified) for m in held]
    committed = await committed_save_id(where, size_limit=Options.manifest_size_limit)
    more = len(live) - len(held)
    others = f" (and {more} more live marker(s) elsewhere under {store.url})" if more else ""
    raise SaveInProgressError(
        f"{explain(where.url, markers, lease=lease, committed_save_id=committed)}{others}: {what}."
        " Pass --force to remove it anyway (a save still writing then fails at its commit)"
    )
