"""Restore's metadata step where a checkpoint's pieces are read on demand (format version 2):
the index objects a host needs, and the check that they cover it.

The reader (:class:`~objckpt.layouts.native.NativeCheckpoint`) names from each
leaf's writers the processes that wrote the boxes a host reads and reads
only their index objects, keeping only the rows of those leaves. After planning,
every box must be covered exactly by the pieces found; when not, every index
object is read and the reads planned again before the checkpoint is called malformed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from objckpt.core.format import Manifest, Piece
from objckpt.core.plan import ReadRequest
from objckpt.errors import FormatError
from objckpt.layouts.native import NativeCheckpoint
from objckpt.restoring.leaf_plan import LeafPlan
from objckpt.restoring.locations import failover_of
from objckpt.transfer import runtime

log = logging.getLogger("objckpt")

Planner = Callable[[Manifest, dict[int, LeafPlan]], list[ReadRequest]]


def read_needed_indexes(checkpoint: NativeCheckpoint, plans: dict[int, LeafPlan]) -> Manifest:
    """Read the index objects of the processes that wrote the boxes ``plans`` read: the
    manifest with those leaves' pieces from them (each plan then takes its leaf's entry,
    :meth:`LeafPlan.with_entry`)."""
    boxes = {i: plan.read_boxes for i, plan in plans.items()}
    return _read_anywhere(checkpoint.store, lambda: checkpoint.read_needed(boxes))


def check_coverage(
    checkpoint: NativeCheckpoint, plans: dict[int, LeafPlan], requests: list[ReadRequest], plan: Planner
) -> tuple[dict[int, LeafPlan], list[ReadRequest]]:
    """Every box a plan fills is covered exactly by the pieces read for it, or the restore stops.

    Returns the plans and reads to use: those given, or after reading every index
    object, new ones.

    The index objects read were chosen by the writer rule's arithmetic; a box they do
    not cover (writers the saver described differently, or a reader bug) reads
    every other index object and plans again before calling the checkpoint
    malformed, so the choice costs speed, never data.
    """
    store, manifest = checkpoint.store, checkpoint.manifest
    gaps = {i: box for i, p in plans.items() if (box := p.uncovered()) is not None}
    if gaps:
        i, box = next(iter(gaps.items()))
        log.warning(
            "objckpt: the index objects chosen for %s do not cover leaf %s box %s; reading all %d",
            store.url,
            manifest.leaves[i].path,
            box,
            len(manifest.indexes),
        )
        manifest = _read_anywhere(store, checkpoint.read_every_index)
        plans = {i: p.with_entry(manifest.leaves[i]) for i, p in plans.items()}
        requests = plan(manifest, plans)
        gaps = {i: box for i, p in plans.items() if (box := p.uncovered()) is not None}
    if gaps:
        i, (start, stop) = next(iter(gaps.items()))
        pair = plans[i].overlapping((start, stop))
        why = "holes or overlaps" if pair is None else f"{_named(pair[0])} and {_named(pair[1])} overlap"
        raise FormatError(
            f"checkpoint {store.url} is malformed: the pieces of leaf {manifest.leaves[i].path} do not tile"
            f" its box {list(start)}-{list(stop)} exactly ({why})"
        )
    return plans, requests


def _named(piece: Piece) -> str:
    return f"piece {list(piece.start)}-{list(piece.stop)} (blob {piece.blob} bytes [{piece.offset}, {piece.offset + piece.length}))"


def _read_anywhere(store: Any, read: Callable[[], Coroutine[Any, Any, Manifest]]) -> Manifest:
    """``read()`` (index objects read through ``store``); with replicas, an index object damaged
    at rest at one location is read at the next (:meth:`FailoverStore.elsewhere_if_damaged`)."""
    failover = failover_of(store)
    return runtime.run_sync(read() if failover is None else failover.elsewhere_if_damaged(read))
