"""save and save_async: snapshot → plan → upload → commit.

The caller's thread does only the blocking phase (:mod:`objckpt.saving.upload`): it
copies every owned piece off the devices into staging buffers that objckpt
owns, blob by blob, under a byte budget (when the model is larger than the
budget it streams: a buffer is reused once its blob is uploaded); a synchronous
save to a store that takes a body of parts sends contiguous host shards in place
instead. Uploads and the commit run on the I/O loop.

Commit (format version 2, :mod:`objckpt.saving.commit`): every process checks that its blobs are there at
their sizes, writes its own index object (its pieces) to the store, and sends
the coordinator one small message (the index object's key, size and crc32c, or
its error). After a barrier the primary reads those messages, writes the root
``manifest.json`` with create-if-absent, and publishes the outcome; each
process releases the save's coordinator keys once it has read it, the last one
deleting them. Nothing a process sends or reads grows with the size of the job
but the primary's O(processes) list. No manifest, no checkpoint: a crash at any
moment leaves at most orphaned blobs and index objects, which ``gc`` removes.

Deleters keep off a save in flight: each process writes a live-save marker
before its first blob and deletes it once the outcome is known
(:mod:`objckpt.saving.live_markers`), and before it writes its index object each
process checks its blobs (deleted by ``gc``, ``rm`` or retention anyway?) and
reports a missing or resized one instead, so no manifest is written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from objckpt import in_flight
from objckpt.core.boxes import MeshTable
from objckpt.core.codecs import CHUNK_BYTES
from objckpt.core.format import ITEM_KINDS, LeafEntry
from objckpt.core.metadata import to_json_value
from objckpt.core.plan import blob_key, packing_order, plan_blobs
from objckpt.core.tree import flatten
from objckpt.multihost import Coordinator, get_coordinator, operation_tag
from objckpt.options import Options
from objckpt.progress import ProgressArg, closing, finish_from_caller, start
from objckpt.saving import incremental, pipeline
from objckpt.saving.blob_sizing import save_blob_size, split_pieces
from objckpt.saving.classify import classify
from objckpt.saving.encode import coded_leaves
from objckpt.saving.incremental import base_name
from objckpt.transfer import runtime
from objckpt.transfer.buffers import release_freed_memory, tune_malloc
from objckpt.transfer.cpu_slots import save_threads_for
from objckpt.transfer.handle import Handle
from objckpt.transfer.stats import TransferStats

T = TypeVar("T")
log = logging.getLogger("objckpt")
_SLICE = 0.1  # seconds: how long a wait for a save runs between chances for a Ctrl-C
_ABORT_GRACE = 0.6  # seconds: how long an interrupted save may take to abort and delete what it wrote


class SaveHandle:
    """A save whose upload and commit may still be running.

    ``result()`` waits and re-raises any error; ``done()`` polls. The figures
    are this process's own.

    Attributes:
        url: the checkpoint being saved.
        stats: the save's :class:`~objckpt.transfer.stats.TransferStats`, counting while it runs.
        seconds_blocked: how long ``save_async`` held the caller (the device→host copy).
    """

    def __init__(
        self,
        future: concurrent.futures.Future[None],
        stats: TransferStats,
        seconds_blocked: float,
        url: str,
        transfer: Handle | None = None,
    ):
        self._future = future
        self._transfer = transfer
        self.stats = stats
        self.seconds_blocked = seconds_blocked
        self.url = url

    def result(self, timeout: float | None = None) -> None:
        """Wait for the commit (at most ``timeout`` seconds) and re-raise the save's error, if any.

        Raises:
            TimeoutError: the save is still running after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._future.done() and (deadline is None or time.monotonic() < deadline):
            concurrent.futures.wait([self._future], _SLICE)  # a Ctrl-C gets through between short waits
        self._future.result(0)

    def done(self) -> bool:
        """Whether the save has ended, committed or failed (``result()`` says which)."""
        return self._future.done()

    @property
    def bytes_written(self) -> int:
        """Bytes written to the store so far."""
        return self.stats.bytes_written

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"SaveHandle({self.url!r}, {state}, bytes_written={self.bytes_written})"


def save(
    url: str,
    tree: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    metadata: dict[str, Any] | None = None,
    progress: ProgressArg = False,
    base: str | None = None,
) -> TransferStats:
    """Save ``tree`` to ``url`` and return once the checkpoint is committed.

    Args:
        url: ``s3://bucket/prefix``, ``gs://...``, ``file:///abs/path``, an absolute
            path, ``memory://...`` or any URL of a registered store.
        tree: any pytree of jax.Arrays (any sharding), numpy arrays, int, float,
            bool, str, bytes and None, and items: ``objckpt.Json(doc)``,
            ``objckpt.PerProcess(value)`` (each process its own) and objects with
            ``state_dict()``/``load_state_dict()`` (:class:`objckpt.Stateful`).
        storage_options: passed to the store (fsspec-style: ``key``, ``secret``,
            ``endpoint_url``, ``client_kwargs``, ``token``, ...).
        options: tuning (:class:`objckpt.Options`).
        metadata: user metadata stored in the manifest: JSON values, numpy and jax
            scalars and 0-d arrays (stored as Python numbers); NaN and infinities
            are stored as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``
            (``float()`` reads them back).
        progress: ``True`` draws a progress bar on stderr when it is a terminal
            (tqdm); a callable is called with a :class:`objckpt.Progress` at most
            every 0.1 s and once more when the save ends (committed or failed),
            on objckpt's I/O thread: it must be quick, and an exception it raises
            is logged once, never failing the save. ``False``/``None``: nothing.
        base: an earlier committed checkpoint beside ``url`` (same parent prefix): each piece
            whose leaf path, dtype, box and SHA-256 equal the base's is recorded as a reference to
            the base's bytes instead of uploaded (an incremental checkpoint; docs/FORMAT.md,
            "Bases"). Implies ``Options(digest="sha256")``, and costs one SHA-256 pass over the
            pieces the base has (~1.8 GB/s per core) and a read of the base's index objects.

    Returns:
        This process's figures (bytes, objects, requests, retries, seconds).

    A Ctrl-C (KeyboardInterrupt) stops it within a second or so: its uploads are aborted and
    what they wrote is deleted, best effort; ``objckpt rm --force URL`` removes anything left.

    Raises:
        CheckpointExistsError: ``url`` already holds a committed checkpoint (left intact).
    """
    # The caller waits for the uploads anyway: let them start with the first
    # blob copied instead of after the last (save_async holds them back).
    handle = _start(url, tree, storage_options, options, metadata, progress, hold_uploads=False, base=base)
    try:
        handle.result()
    except KeyboardInterrupt:  # the commit then fails on its own, writing no manifest
        if handle._transfer is not None and not handle.done():
            with contextlib.suppress(TimeoutError):
                runtime.submit(_discard(handle._transfer)).result(_ABORT_GRACE)
        raise
    return handle.stats


def save_async(
    url: str,
    tree: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    metadata: dict[str, Any] | None = None,
    progress: ProgressArg = False,
    base: str | None = None,
) -> SaveHandle:
    """Copy ``tree`` off the devices, then upload and commit in the background.

    Returns after the blocking phase: the caller may update, donate or delete
    its arrays at once. Takes the same arguments as :func:`save`.
    """
    return _start(url, tree, storage_options, options, metadata, progress, hold_uploads=True, base=base)


def _start(
    url: str,
    tree: Any,
    storage_options: dict[str, Any] | None,
    options: Options | None,
    metadata: dict[str, Any] | None,
    progress: ProgressArg,
    *,
    hold_uploads: bool,
    base: str | None = None,
) -> SaveHandle:
    """Snapshot ``tree`` and start its uploads and commit; ``hold_uploads`` as in :func:`objckpt.saving.upload.snapshot_and_upload`."""
    entered = time.perf_counter()
    options = options or Options()
    name = None
    if base is not None:
        name = base_name(url, base)
        if options.format_version < 3:
            raise ValueError("save(base=...) needs Options(format_version=3)")
        options = dataclasses.replace(options, digest="sha256")  # so this checkpoint can be a base in turn
    if options.save_threads is None:
        options = dataclasses.replace(options, save_threads=save_threads_for(hold_uploads=hold_uploads))
    if options.tune_malloc:
        tune_malloc()
    handle = Handle.open(url, storage_options, options)
    try:
        return _begin(handle, tree, metadata, progress, entered, hold_uploads=hold_uploads, base=name)
    except BaseException:
        handle.close()
        raise


def _begin(
    handle: Handle,
    tree: Any,
    metadata: dict[str, Any] | None,
    progress: ProgressArg,
    entered: float,
    *,
    hold_uploads: bool,
    base: str | None = None,
) -> SaveHandle:
    """:func:`_start` on an open store, which the commit closes once it ends (``entered``: when the call began);
    ``base``: the name of the sibling checkpoint an incremental save references."""
    options, stats = handle.options, handle.stats
    coordinator = get_coordinator()
    tag = operation_tag("save", handle.url)
    metadata = to_json_value(dict(metadata or {}), "metadata")
    pipeline.check_destination(handle)

    leaves, skeleton = flatten(tree)
    entries: list[LeafEntry] = []
    owned = []
    meshes = MeshTable()
    for i, leaf in enumerate(leaves):
        entry, pieces = classify(
            i, leaf, is_primary=coordinator.is_primary, split_above=options.split_replicas_above, meshes=meshes
        )
        entries.append(entry)
        owned.extend(pieces)
    items = [e.path for e in entries if e.kind in ITEM_KINDS]
    if items and options.format_version < 3:
        raise ValueError(f"leaf {items[0]}: Json, PerProcess and stateful items need Options(format_version=3)")
    owned.sort(key=packing_order)
    save_id = _shared_save_id(coordinator, tag, options.barrier_timeout)
    # Pieces stay at most options.blob_size, whatever the blob size: restores read pieces.
    # Compressed pieces stay at most CHUNK_BYTES: a read that needs part of a shard fetches only
    # the chunks its box meets (docs/PERFORMANCE.md "Compression").
    chunk = options.blob_size if options.compression is None else min(options.blob_size, CHUNK_BYTES)
    owned = split_pieces(owned, max_bytes=chunk)
    coded = coded_leaves([e.kind for e in entries], options.compression)
    blob_size = save_blob_size(
        options, sum(p.nbytes for p in owned), processes=coordinator.process_count, hold_uploads=hold_uploads
    )

    bases = () if base is None else (incremental.base_store(handle.store, base),)
    save = pipeline.begin(handle, coordinator=coordinator, tag=tag, save_id=save_id, bases=bases)
    started = time.perf_counter()
    reporter = None
    try:
        if base is not None:  # the marker is in the base now: read it, then reference what is equal
            matched = incremental.against_base(handle, owned, entries, base, coded)
            owned = matched.upload
            save = dataclasses.replace(
                save, refs=tuple(matched.refs), ref_blobs=matched.ref_blobs, bases=tuple(matched.bases)
            )
        blobs = plan_blobs(
            owned,
            blob_size=blob_size,
            key=lambda seq: blob_key(save_id, coordinator.process_index, seq),
        )
        total = sum(b.size for b in blobs)
        reporter = start(progress, "save", handle.url, total, lambda: stats.bytes_written, stats)
        uploads = pipeline.upload(save, blobs, hold_uploads=hold_uploads, coded=coded)
    except BaseException:
        finish_from_caller(reporter, complete=False)
        with contextlib.suppress(Exception):  # uploads already started: stopped, what they wrote deleted
            runtime.run_sync(_discard(handle))
        pipeline.abandon(save)
        raise
    seconds_blocked = time.perf_counter() - entered
    commit = pipeline.commit(
        save,
        uploads,
        skeleton=skeleton,
        entries=entries,
        meshes=tuple(meshes.meshes),
        metadata=metadata,
        started=started,
        coded=coded,
    )
    future = runtime.submit(_then_close(closing(commit, reporter), handle))
    in_flight.track(handle.url, future)
    return SaveHandle(future, stats, seconds_blocked, handle.url, handle)


async def _then_close(run: Awaitable[T], handle: Handle) -> T:
    """Await ``run``, then close ``handle``'s store and give the freed host memory back, however
    ``run`` ends."""
    try:
        return await run
    finally:
        await handle.aclose()
        await asyncio.to_thread(release_freed_memory)


async def _discard(handle: Handle) -> None:
    """Abort a save's uploads and delete the objects they started writing, within
    :data:`_ABORT_GRACE` seconds (best effort: nothing of the save is committed, and
    ``objckpt rm --force`` removes what is left)."""
    await handle.engine.abort(grace=_ABORT_GRACE / 3)

    async def delete(key: str) -> None:
        with contextlib.suppress(Exception):
            await handle.store.delete(key)

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*map(delete, set(handle.engine.written))), _ABORT_GRACE / 2)


def _shared_save_id(coordinator: Coordinator, tag: str, timeout: float) -> str:
    """The save's id, one for all its processes: the primary's, sent through the coordinator.

    The root and every index object carry it, so a reader refuses a root that lists an
    index object of another save left in the same prefix (docs/FORMAT.md). One small
    value, no barrier: the primary sets it and goes on; the others wait for it only if
    they reach this point first.
    """
    mine = uuid.uuid4().hex.encode() if coordinator.is_primary else None
    return coordinator.broadcast(f"{tag}/save_id", mine, timeout=timeout).decode()
