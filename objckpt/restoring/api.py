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

import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from objckpt.core.format import ARRAY_KINDS, Manifest
from objckpt.core.format.v2 import require_digest
from objckpt.core.plan import ReadRequest
from objckpt.core.tree import build, flatten_target, unflatten_target
from objckpt.errors import CoordinationError
from objckpt.layouts.native import NativeCheckpoint
from objckpt.layouts.registry import open_checkpoint
from objckpt.multihost import get_coordinator, operation_tag
from objckpt.options import Options
from objckpt.progress import ProgressArg, reporting
from objckpt.restoring.casts import CASTS
from objckpt.restoring.fetch import fetch, plan
from objckpt.restoring.indexes import check_coverage, read_needed_indexes
from objckpt.restoring.jobs import (
    LeafJob,
    check_host_memory,
    make_job,
    physical_memory,
    reserve_assembled,
)
from objckpt.restoring.locations import (
    Location,
    as_locations,
    choose_locations,
    failover_options,
    failover_store,
    open_locations,
)
from objckpt.restoring.read_once import Designator, share
from objckpt.restoring.selection import inline_value, select
from objckpt.restoring.target_shardings import on_saved_shardings
from objckpt.transfer import runtime
from objckpt.transfer.buffers import tune_malloc
from objckpt.transfer.engine import (
    RetryingStore,
    TransferStats,
    close_store,
    opened_store,
)

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

    An Orbax checkpoint (an item directory, or a ``CheckpointManager`` step with
    one item or a ``default`` one) restores the same way, read through
    tensorstore (``pip install 'objckpt[orbax]'``): the layouts registry
    (:func:`objckpt.layouts.registry.open_checkpoint`) opens it with Orbax's reader.

    Raises:
        CheckpointNotFoundError, FormatError, IntegrityError, TargetMismatchError
        (also for a cast refused under ``cast="checked"``: the leaf, both dtypes).
    """
    if cast not in CASTS:
        raise ValueError(f"cast must be one of {', '.join(map(repr, CASTS))}, got {cast!r}")
    options = options or Options()
    stats = stats if stats is not None else TransferStats()
    if options.tune_malloc:
        tune_malloc()
    if replicas:
        locations = [Location(str(url), storage_options), *as_locations(replicas, storage_options, primary=str(url))]
        return _restore_nearest(locations, target, partial, read_once, options, stats, progress, cast)
    with opened_store(url, storage_options, options, stats) as store, runtime.collection_paused(options.pause_gc):
        checkpoint = open_checkpoint(store, options=options, storage_options=storage_options, look_above=True)
        if not isinstance(checkpoint, NativeCheckpoint):  # another layout (Orbax): its reader restores itself
            return checkpoint.restore(target, partial=partial, options=options, stats=stats, cast=cast)
        return _restore(store, checkpoint.manifest, target, partial, read_once, options, stats, progress, cast)


def _restore_nearest(
    locations: list[Location],
    target: Any,
    partial: bool,
    read_once: bool,
    options: Options,
    stats: TransferStats,
    progress: ProgressArg,
    cast: str,
) -> Any:
    """:func:`restore` with replicas: the nearest location holding the checkpoint, then the next ones."""
    stores = open_locations(locations, options, stats)
    try:
        with runtime.collection_paused(options.pause_gc):
            manifest, usable = runtime.run_sync(choose_locations(stores, options))
            store = failover_store(usable, options, stats)
            engine_options = failover_options(options, len(usable))
            return _restore(store, manifest, target, partial, read_once, engine_options, stats, progress, cast)
    finally:
        for opened in stores:
            close_store(opened)


def _restore(
    store: RetryingStore,
    manifest: Manifest,
    target: Any,
    partial: bool,
    read_once: bool,
    options: Options,
    stats: TransferStats,
    progress: ProgressArg,
    cast: str,
) -> Any:
    """:func:`restore` from an open store (the arguments as there, defaults filled in)."""
    started = time.perf_counter()
    require_digest(manifest, options.digest, store.url)
    selection, subtrees = select(manifest, target, partial)
    selection = on_saved_shardings(manifest, selection)
    read_once = read_once and jax.process_count() > 1
    designator = Designator(options.split_replicas_above)
    jobs = {
        i: make_job(manifest.leaves[i], t, read_once=read_once, unsafe_cast=cast == "unsafe", designator=designator)
        for i, t in sorted(selection.items())
        if manifest.leaves[i].kind in ARRAY_KINDS
    }
    check_host_memory(jobs, physical_memory())  # before any read: sizes come from the manifest
    if manifest.version != 1:
        manifest = read_needed_indexes(store, manifest, jobs, options)
    reserve_assembled(jobs)  # maps memory on a thread while this one plans
    requests = plan(manifest, jobs, options, streamed=store.inner.streams_reads)
    if manifest.version != 1:
        requests = check_coverage(
            store,
            manifest,
            jobs,
            requests,
            options,
            lambda m, j: plan(m, j, options, streamed=store.inner.streams_reads),
        )
    base = stats.bytes_read
    total = sum(r.length for r in requests)
    with reporting(progress, "restore", store.url, total, lambda: stats.bytes_read - base, stats):
        if read_once:
            _fetch_then_share(store.inner, requests, jobs, options, stats)
        else:
            runtime.run_sync(fetch(store.inner, requests, jobs, options, stats))
    values = {i: (jobs[i].result if i in jobs else inline_value(manifest.leaves[i], t)) for i, t in selection.items()}
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


def _fetch_then_share(
    store: Any, requests: list[ReadRequest], jobs: dict[int, LeafJob], options: Options, stats: TransferStats
) -> None:
    """Read-once: fetch this process's share, agree that every process succeeded, then share.

    The status exchange (with a timeout) comes before the collective, which has
    none: a process that failed to read must not leave the others in a collective.
    """
    coordinator = get_coordinator()
    tag = operation_tag("restore", store.url)
    error: BaseException | None = None
    try:
        runtime.run_sync(fetch(store, requests, jobs, options, stats))
    except BaseException as e:
        error = e
    try:
        if error is not None:  # only failures are sent: nothing per process when all went well
            coordinator.publish(f"{tag}/failed", f"{type(error).__name__}: {error}"[:2000].encode())
        coordinator.barrier(f"{tag}/fetched", timeout=options.barrier_timeout)
        statuses = coordinator.collect(f"{tag}/failed")
    except CoordinationError:
        coordinator.forget(tag)
        raise
    coordinator.release(tag)
    if error is not None:
        raise error
    failed = [f"process {p}: {s.decode()}" for p, s in sorted(statuses.items())]
    if failed:
        raise CoordinationError(f"restore of {store.url} failed elsewhere: {'; '.join(failed)}")
    for i in sorted(jobs):  # same order on every process: the collectives must line up
        job = jobs[i]
        if job.designated is not None:
            assert isinstance(job.sharding, NamedSharding)
            job.result = share(job.result, job.sharding)
