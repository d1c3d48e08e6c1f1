"""Deleting a manager's steps: the retention pass, one step's deletion, and gc of a root.

:class:`~objckpt.manager.checkpoint_manager.CheckpointManager` calls these with its store,
policies and options; they hold no state of their own, so the same code serves the root
and every replica. A step is deleted manifest first (it stops existing at once), then its
blobs; a step holding a live-save marker (:mod:`objckpt.saving.live_markers`) is left alone.
Nothing here imports JAX (``objckpt rm`` and ``gc`` run without it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import SaveInProgressError
from objckpt.manager.retention import KeepBest, RetentionPolicy, StepRecord, steps_to_delete
from objckpt.roots.listing import committed_steps
from objckpt.roots.orbax_steps import delete_orbax_step, is_orbax_step
from objckpt.roots.step_names import step_dir
from objckpt.roots.sweep import collect, delete_checkpoint
from objckpt.storage import Store

log = logging.getLogger("objckpt")


async def apply_retention(
    store: Store,
    policies: Sequence[RetentionPolicy],
    *,
    orbax: bool,
    known_metrics: dict[int, dict[str, Any]],
    metrics_of: Callable[[int], dict[str, Any]],
    delete: Callable[[int], Awaitable[None]],
) -> list[int]:
    """Delete the committed steps no policy keeps; the steps deleted.

    ``metrics_of`` (a blocking call, run in a thread) reads a step's metrics when a
    :class:`~objckpt.manager.retention.KeepBest` needs them; otherwise ``known_metrics``
    serves. A step a save is writing into is left for a later pass (or gc).
    """
    steps = await committed_steps(store, orbax=orbax)
    needs_metrics = any(isinstance(p, KeepBest) for p in policies)
    records = []
    for s in steps:
        metrics = (await asyncio.to_thread(metrics_of, s)) if needs_metrics else known_metrics.get(s, {})
        records.append(StepRecord(s, metrics))
    deleted = []
    for step in steps_to_delete(records, policies):
        try:
            await delete(step)
        except SaveInProgressError as e:  # a save's live marker in a committed step: gc's job later
            log.warning("objckpt retention left step %d: %s", step, e)
            continue
        deleted.append(step)
        log.info("objckpt retention deleted step %d under %s", step, store.url)
    return deleted


async def delete_step(store: Store, step: int, *, lease: float) -> None:
    """Manifest first (the step stops existing at once), then its blobs (an Orbax step: its commit files)."""
    if await is_orbax_step(store, step, f"{step_dir(step)}/{MANIFEST_KEY}"):
        await delete_orbax_step(store, step)
        return
    await delete_checkpoint(store.child(step_dir(step)), lease=lease)


async def gc_root(store: Store, grace: float, *, manifest_size_limit: int, lease: float) -> list[str]:
    """Delete the blobs under ``store`` no committed manifest references, once older than ``grace`` seconds."""
    found = await collect(store, grace=grace, manifest_size_limit=manifest_size_limit, lease=lease)
    doomed = [o.key for o in found]
    if doomed:
        log.info("objckpt gc deleted %d unreferenced objects under %s", len(doomed), store.url)
    return doomed


async def gc_roots(store: Store, replicator: Any, collect: Callable[[Store], Awaitable[list[str]]]) -> list[str]:
    """``collect`` (:func:`gc_root` with its settings) at the root, then at every replica of
    ``replicator`` (a :class:`~objckpt.manager.replication.Replicator`, or None): the root's
    keys as they are, the replicas' as URLs."""
    doomed = await collect(store)
    if replicator is not None:
        doomed += await replicator.gc(collect)
    return doomed
