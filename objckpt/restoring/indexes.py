"""Restore's metadata step in format version 2: the index objects a host needs, and the check that they cover it.

From each leaf's saved layout a host names the processes that wrote the boxes it
reads (:func:`objckpt.core.format.v2.leaves_by_writer`) and reads only their
index objects, keeping only the rows of those leaves. After planning, every
box must be covered exactly by the pieces found; when not, every index object
is read and the reads planned again before the checkpoint is called malformed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from objckpt.core.format import LeafEntry, Manifest, Piece
from objckpt.core.format.v2 import leaves_by_writer
from objckpt.core.plan import ReadRequest
from objckpt.errors import FormatError
from objckpt.options import Options
from objckpt.restoring.jobs import LeafJob, overlapping, uncovered
from objckpt.restoring.locations import failover_of
from objckpt.transfer import runtime
from objckpt.layouts.manifest_io import read_indexes

log = logging.getLogger("objckpt")

Planner = Callable[[Manifest, dict[int, LeafJob]], list[ReadRequest]]


def read_needed_indexes(store: Any, manifest: Manifest, jobs: dict[int, LeafJob], options: Options) -> Manifest:
    """Read the index objects of the processes that wrote the boxes ``jobs`` read, and
    give each job its leaf's pieces from them (format version 2)."""
    leaves = leaves_by_writer(manifest, {i: job.read_boxes for i, job in jobs.items()})
    manifest = _read_anywhere(
        store, lambda: read_indexes(store, manifest, leaves, size_limit=options.manifest_size_limit, leaves=leaves)
    )
    for i, job in jobs.items():
        job.entry = manifest.leaves[i]
    return manifest


def check_coverage(
    store: Any,
    manifest: Manifest,
    jobs: dict[int, LeafJob],
    requests: list[ReadRequest],
    options: Options,
    plan: Planner,
) -> list[ReadRequest]:
    """Every box a job fills is covered exactly by the pieces read for it, or the restore stops.

    The index objects read were chosen by the layout's arithmetic; a box they do
    not cover (a layout the writer described differently, or a reader bug) reads
    every other index object and plans again before calling the checkpoint
    malformed, so the choice costs speed, never data.
    """
    gaps = {i: box for i, job in jobs.items() if (box := uncovered(job)) is not None}
    if gaps:
        i, box = next(iter(gaps.items()))
        log.warning(
            "objckpt: the index objects chosen for %s do not cover leaf %s box %s; reading all %d",
            store.url,
            manifest.leaves[i].path,
            box,
            len(manifest.indexes),
        )
        root = dataclasses.replace(manifest, leaves=_without_pieces(manifest.leaves), blobs=(), loaded=frozenset())
        every = range(len(manifest.indexes))
        manifest = _read_anywhere(
            store, lambda: read_indexes(store, root, every, size_limit=options.manifest_size_limit)
        )
        for i, job in jobs.items():
            job.entry = manifest.leaves[i]
        requests = plan(manifest, jobs)
        gaps = {i: box for i, job in jobs.items() if (box := uncovered(job)) is not None}
    if gaps:
        i, (start, stop) = next(iter(gaps.items()))
        pair = overlapping(jobs[i], (start, stop))
        why = "holes or overlaps" if pair is None else f"{_named(pair[0])} and {_named(pair[1])} overlap"
        raise FormatError(
            f"checkpoint {store.url} is malformed: the pieces of leaf {manifest.leaves[i].path} do not tile"
            f" its box {list(start)}-{list(stop)} exactly ({why})"
        )
    return requests


def _named(piece: Piece) -> str:
    return f"piece {list(piece.start)}-{list(piece.stop)} (blob {piece.blob} bytes [{piece.offset}, {piece.offset + piece.length}))"


def _read_anywhere(store: Any, read: Callable[[], Coroutine[Any, Any, Manifest]]) -> Manifest:
    """``read()`` (index objects read through ``store``); with replicas, an index object damaged
    at rest at one location is read at the next (:meth:`FailoverStore.elsewhere_if_damaged`)."""
    failover = failover_of(store)
    return runtime.run_sync(read() if failover is None else failover.elsewhere_if_damaged(read))


def _without_pieces(leaves: tuple[LeafEntry, ...]) -> tuple[LeafEntry, ...]:
    return tuple(dataclasses.replace(leaf, pieces=()) for leaf in leaves)
