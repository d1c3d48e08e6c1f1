"""restore: manifest + target → ranged reads → arrays on the target sharding.

For each leaf the target names, this process computes the boxes its own
devices need under the *target* sharding (whatever the saved one was),
intersects them with the saved pieces, and reads just those pieces (coalesced
per blob, in parallel, as a sliding window). Each piece's crc32c is checked
before its bytes are copied straight into the destination host buffers; a
leaf is put on its devices as soon as its last piece lands, so host memory
holds little more than the leaves in flight.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding

from objckpt.core.format import ARRAY_KINDS, Manifest
from objckpt.core.format.v2 import require_digest
from objckpt.core.plan import ReadRequest
from objckpt.core.tree import build, flatten_target, unflatten_target
from objckpt.errors import CheckpointNotFoundError, PartialCopyError
from objckpt.layouts.native import NativeCheckpoint
from objckpt.layouts.registry import open_checkpoint
from objckpt.options import Options
from objckpt.progress import ProgressArg, reporting
from objckpt.restoring.casts import CASTS
from objckpt.restoring.fetch import fetch, plan
from objckpt.restoring.host_memory import physical_memory
from objckpt.restoring.indexes import check_coverage, read_needed_indexes
from objckpt.restoring.items import finish_items
from objckpt.restoring.landing import Landing
from objckpt.restoring.leaf_plan import check_host_memory, clear_planning_caches, plan_leaf
from objckpt.restoring.locations import (
    Location,
    as_locations,
    choose_locations,
    failover_handle,
    open_locations,
)
from objckpt.restoring.read_once import Designator, share
from objckpt.restoring.read_sharding import ReadPlanner, plan_read_shardings
from objckpt.restoring.reshard import devices_can_reshard, fetch_agreed, reshard
from objckpt.restoring.selection import inline_value, select
from objckpt.restoring.target_shardings import on_saved_shardings
from objckpt.transfer import runtime
from objckpt.transfer.buffers import release_freed_memory, tune_malloc
from objckpt.transfer.handle import Handle, opened
from objckpt.transfer.retries import close_store
from objckpt.transfer.stats import TransferStats

log = logging.getLogger("objckpt")


def restore(
    url: str,
    target: Any = None,
    *,
    storage_options: dict[str, Any] | None = None,
    partial: bool = False,
    read_once: bool = False,
    replicas: Sequence[str | Location] | None = None,
    options: Options | None = None,
    stats: TransferStats | None = None,
    progress: ProgressArg = False,
    cast: str = "checked",
) -> Any:
    """Restore a checkpoint, onto the target's shardings when it gives them.

    Args:
        url: the checkpoint's URL.
        target: a pytree like the saved one. A leaf that is a
            ``jax.ShapeDtypeStruct`` (with or without sharding) or a
            ``jax.Array`` is restored onto that sharding and dtype (see ``cast``).
            Without a sharding (``jax.eval_shape``'s targets under an ``Auto``
            mesh) a leaf saved on a mesh goes onto its saved sharding where this
            job's devices are the saved ones (same count, ids and processes), else
            onto the first local device; a sharding on an abstract mesh (under an
            ``Explicit`` one) gets the saved mesh there, or the one set with
            ``jax.set_mesh`` (:mod:`objckpt.restoring.target_shardings`).
            ``None`` restores a host numpy array, or where the checkpoint has a
            subtree, that subtree (arrays as numpy, containers as plain dicts,
            lists and tuples); any other leaf is a placeholder for the saved
            value. ``target=None`` restores the whole tree, arrays as numpy.
        storage_options: passed to the store.
        partial: allow the target to name only some saved leaves; the others
            are not read at all.
        read_once: with several processes, read each unique byte from the store
            once (one process per replicated box) and hand it to the other
            replicas with a collective over the devices. For restores across
            regions, where every byte read costs egress. All processes must pass it.
        replicas: other copies of the same checkpoint (URLs, or
            :class:`objckpt.Location` with their own storage options). The
            locations holding the same committed checkpoint as ``url`` (same
            ``save_id``) are timed with a small request and read nearest
            first; a location that fails mid-restore (after its retries) is
            left and the remaining reads go to the next one
            (:mod:`objckpt.restoring.locations`). ``stats.bytes_by_location``
            says how many bytes came from each. Composes with ``read_once``.
        options: tuning (:class:`objckpt.Options`).
        stats: counters to fill (bytes read from the store, requests, retries, seconds).
        progress: ``True`` draws a progress bar on stderr when it is a terminal
            (tqdm); a callable is called with a :class:`objckpt.Progress` at most
            every 0.1 s and once more when the reads end, on objckpt's I/O thread:
            it must be quick, and an exception it raises is logged once, never
            failing the restore. ``False``/``None``: nothing.
        cast: how a target dtype that differs from the saved one is reached.
            ``"checked"`` (the default) allows casts that keep every value:
            widening ones (int8 → int32, float16 → float32, int → float) and
            float precision downcasts (float32 → bfloat16, float16, float8),
            where a finite value that overflows to inf or NaN fails the restore.
            Casts that change a value's kind or range (float → int, signed →
            unsigned, int narrowing, complex → real, to bool) are refused before
            anything is read. ``"unsafe"`` applies numpy's ``astype`` as is.
            ``None`` and numpy targets restore the saved dtype (no cast).

    A leaf saved from a ``NamedSharding`` whose target boxes cut the saved pieces (the
    mesh axes swapped, another device order, fewer or more devices on an axis) is read
    on a sharding of the target's devices that lines up with the saved pieces, where that
    makes the worst host fetch fewer bytes per byte it needs (and the busiest host at
    least 1 MiB fewer, unless direct reads fetch over 8 times what is needed), then moved
    to the target sharding on the devices with ``jax.device_put``, leaf by leaf
    (:mod:`objckpt.restoring.read_sharding`, :mod:`objckpt.restoring.reshard`);
    ``stats.device_bytes_moved`` counts the bytes this process's devices receive. With
    several CPU processes this needs JAX's CPU collectives (on by default); with them
    turned off, or ``Options(reshard=False)`` (the same on every process), such leaves
    are read directly.

    An Orbax checkpoint (an item directory, or a ``CheckpointManager`` step with
    one item or a ``default`` one) restores the same way, read through
    tensorstore (``pip install 'objckpt[orbax]'``): the layouts registry
    (:func:`objckpt.layouts.registry.open_checkpoint`) opens it with Orbax's reader.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``url`` (nor at any replica).
        FormatError: the manifest or an index is malformed, hostile, or of an unknown version.
        IntegrityError: bytes read back do not match their crc32c on every read.
        TargetMismatchError: the target does not match the checkpoint (leaves, shapes), or
            a cast is refused under ``cast="checked"`` (the leaf, both dtypes named).
    """
    asked = _Asked(target, partial, read_once, progress, cast)
    options = options or Options()
    stats = stats if stats is not None else TransferStats()
    if options.tune_malloc:
        tune_malloc()
    if replicas:
        locations = [Location(str(url), storage_options), *as_locations(replicas, storage_options, primary=str(url))]
        try:
            return _restore_nearest(locations, asked, options, stats)
        except CheckpointNotFoundError as e:
            with opened(url, storage_options, options) as handle:
                raise _explained(e, handle, storage_options) from None
    with opened(url, storage_options, options, stats) as handle, runtime.collection_paused(options.pause_gc):
        try:
            checkpoint = open_checkpoint(
                handle.store, options=options, storage_options=storage_options, look_above=True
            )
        except CheckpointNotFoundError as e:
            raise _explained(e, handle, storage_options) from None
        if not isinstance(checkpoint, NativeCheckpoint):  # another layout (Orbax): its reader restores itself
            return checkpoint.restore(target, partial=partial, options=options, stats=stats, cast=cast)
        return _restore(handle, checkpoint, asked)


def _explained(error: CheckpointNotFoundError, handle: Handle, storage_options: dict[str, Any] | None) -> Exception:
    """``error`` with what the URL is near (a manager root's steps beside it): the hint of
    :mod:`objckpt.roots.hints`, a layer above this one, found by name as the layouts registry
    finds its readers."""
    hints = importlib.import_module("objckpt.roots.hints")
    return hints.explained(error, handle.store, storage_options, handle.options)


def restore_copy(
    checkpoint: NativeCheckpoint,
    target: Any,
    *,
    partial: bool = False,
    options: Options | None = None,
    stats: TransferStats | None = None,
    cast: str = "checked",
) -> Any:
    """:func:`restore` from a checkpoint already opened (a local-tier step or a peer copy,
    :func:`objckpt.layouts.process_copy.open_part`): the same plan, checks and landing.

    Raises:
        PartialCopyError: the copy holds one process's part and not what this target needs here.
        As :func:`restore` otherwise.
    """
    asked = _Asked(target, partial, False, False, cast)
    options = options or Options()
    handle = Handle.of(checkpoint.store, options, stats)
    try:
        with runtime.collection_paused(options.pause_gc):
            return _restore(handle, checkpoint, asked)
    finally:
        handle.close()


@dataclass(frozen=True)
class _Asked:
    """What a :func:`restore` call asks for, whichever locations serve it."""

    target: Any
    partial: bool
    read_once: bool
    progress: ProgressArg
    cast: str

    def __post_init__(self) -> None:
        if self.cast not in CASTS:
            raise ValueError(f"cast must be one of {', '.join(map(repr, CASTS))}, got {self.cast!r}")


def _restore_nearest(locations: list[Location], asked: _Asked, options: Options, stats: TransferStats) -> Any:
    """:func:`restore` with replicas: the nearest location holding the checkpoint, then the next ones."""
    stores = open_locations(locations, options, stats)
    try:
        with runtime.collection_paused(options.pause_gc):
            manifest, usable = runtime.run_sync(choose_locations(stores, options))
            handle = failover_handle(usable, options, stats)
            checkpoint = NativeCheckpoint(handle.store, manifest, size_limit=options.manifest_size_limit)
            return _restore(handle, checkpoint, asked)
    finally:
        for opened in stores:
            close_store(opened)


def _restore(handle: Handle, checkpoint: NativeCheckpoint, asked: _Asked) -> Any:
    """:func:`restore` through an open store's handle (its options and counters the restore's)
    and the checkpoint opened there.

    The caches planning shares between leaves are emptied when it ends, whatever the outcome,
    and the heap's freed pages go back to the system: objckpt is a guest in the training
    process (:mod:`objckpt.restoring.leaf_plan`, :func:`objckpt.transfer.buffers.release_freed_memory`).
    """
    try:
        return _restore_leaves(handle, checkpoint, asked)
    finally:
        clear_planning_caches()
        release_freed_memory()


def _restore_leaves(handle: Handle, checkpoint: NativeCheckpoint, asked: _Asked) -> Any:
    """:func:`_restore`'s work."""
    store, options, stats = handle.store, handle.options, handle.stats
    target, partial, cast = asked.target, asked.partial, asked.cast
    started = time.perf_counter()
    manifest = checkpoint.manifest
    require_digest(manifest, options.digest, store.url)
    selection, subtrees = select(manifest, target, partial)
    selection = on_saved_shardings(manifest, selection)
    read_once = asked.read_once and jax.process_count() > 1
    designator = Designator(options.split_replicas_above)
    # Leaves whose target boxes cut the saved pieces are read on the saved grid, then resharded.
    # A copy of one process's part is read on the saved grid whenever the target differs:
    # there, this process's own boxes cover what its devices need.
    copy = checkpoint.holds_process is not None
    resharding = options.reshard and not read_once and devices_can_reshard()
    shaping = {"planner": ReadPlanner(prefer_saved=True)} if copy else {}
    reads = plan_read_shardings(manifest, selection, **shaping) if resharding else {}
    planned = {i: reads[i].read_target(t) if i in reads else t for i, t in selection.items()}
    collective = "restore" if read_once else "reshard"  # what follows the reads, on every process
    try:
        manifest, landing, requests = _plan_reads(handle, checkpoint, planned, read_once, cast, designator)
    except BaseException as e:
        if reads or read_once:  # the other processes wait for this one before their collective: tell them
            fetch_agreed(_raise(e), handle.url, options.barrier_timeout, operation=collective)
        raise
    base = stats.bytes_read
    total = sum(r.length for r in requests)
    with reporting(asked.progress, "restore", store.url, total, lambda: stats.bytes_read - base, stats):
        fetched = lambda: runtime.run_sync(fetch(handle, requests, landing))  # noqa: E731
        if reads or read_once:  # a collective follows (a reshard, read-once's sharing): all must have read first
            fetch_agreed(fetched, handle.url, options.barrier_timeout, operation=collective)
        else:
            fetched()
        results = _share(dict(landing.results()), landing) if read_once else dict(landing.results())
    if reads:
        results = reshard(results, reads, stats)
    values = {i: (results[i] if i in results else inline_value(manifest.leaves[i], t)) for i, t in selection.items()}
    values = finish_items(handle, manifest, selection, values)  # PerProcess values, stateful objects
    seconds = time.perf_counter() - started
    stats.seconds = seconds
    log.info(
        "objckpt restored %s: %d leaves, %d bytes read in %d requests, %d retries (%d throttled),"
        " %d checksum re-reads, %.2f s, %.3f GiB/s",
        store.url,
        len(values),
        stats.bytes_read,
        stats.requests,
        stats.retries,
        stats.throttled,
        stats.checksum_retries,
        seconds,
        stats.bytes_read / max(seconds, 1e-9) / 2**30,
    )
    if target is None:
        return build(manifest.tree, lambda i: values[i])
    flat, treedef = flatten_target(target)
    index = {leaf.path: i for i, leaf in enumerate(manifest.leaves)}
    return unflatten_target(
        treedef,
        [build(subtrees[path], lambda i: values[i]) if path in subtrees else values[index[path]] for path, _ in flat],
    )


def _plan_reads(
    handle: Handle,
    checkpoint: NativeCheckpoint,
    planned: dict[int, Any],
    read_once: bool,
    cast: str,
    designator: Designator,
) -> tuple[Manifest, Landing, list[ReadRequest]]:
    """The reads of the array leaves ``planned`` (leaf → the target it is read onto): the manifest
    with the pieces they need, where each lands, and the requests that fetch them.

    Raises:
        HostMemoryError: the leaves need more host memory than the machine has.
        FormatError: the pieces do not tile a box (a whole checkpoint).
        PartialCopyError: a copy of one process's part does not hold a box.
    """
    options = handle.options
    manifest = checkpoint.manifest
    plans = {
        i: plan_leaf(manifest.leaves[i], t, read_once=read_once, unsafe_cast=cast == "unsafe", designator=designator)
        for i, t in sorted(planned.items())
        if manifest.leaves[i].kind in ARRAY_KINDS
    }
    check_host_memory(plans, physical_memory())  # before any read: sizes come from the manifest
    manifest = read_needed_indexes(checkpoint, plans)  # the pieces, as rows, of every version
    plans = {i: p.with_entry(manifest.leaves[i]) for i, p in plans.items()}
    if checkpoint.holds_process is not None:
        for i, p in plans.items():
            if (box := p.uncovered()) is not None:
                why = "its pieces there overlap" if p.overlapping(box) is not None else "it lacks pieces of it"
                raise PartialCopyError(
                    f"{handle.url} (process {checkpoint.holds_process}'s part) does not hold leaf"
                    f" {manifest.leaves[i].path}'s box {list(box[0])}-{list(box[1])}: {why}"
                )
    landing = Landing(plans)
    landing.reserve_arena()  # maps memory on a thread while this one plans
    requests = plan(manifest, plans, options, streamed=handle.traits.streams_reads)
    if checkpoint.pieces_on_demand:
        plans, requests = check_coverage(
            checkpoint, plans, requests, lambda m, p: plan(m, p, options, streamed=handle.traits.streams_reads)
        )
        landing = landing if plans is landing.plans else landing.replanned(plans)
    return manifest, landing, requests


def _raise(error: BaseException) -> Callable[[], None]:
    def run() -> None:
        raise error

    return run


def _share(results: dict[int, Any], landing: Landing) -> dict[int, Any]:
    """Read-once: each designated leaf's value handed to its other replicas by a collective over
    the devices, once every process has read its share (:func:`fetch_agreed`: a collective has no
    timeout, so a process that failed to read must not leave the others in one)."""
    for i in sorted(landing.plans):  # same order on every process: the collectives must line up
        leaf = landing.plans[i]
        if leaf.designated is not None:
            assert isinstance(leaf.sharding, NamedSharding)
            results[i] = share(results[i], leaf.sharding)
    return results
