"""save and save_async: a tree classified into a source and written by the writing corridor
(:mod:`objckpt.saving.writer`). The caller's thread does only the blocking phase (the device→host
copies, staged under a byte budget: :mod:`objckpt.saving.upload`); uploads and the commit
(:mod:`objckpt.saving.commit`) run on the I/O loop. No manifest, no checkpoint: a crash at any
moment leaves at most orphaned blobs and index objects, which ``gc`` removes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
import uuid
from typing import Any

from objckpt.core.boxes import MeshTable
from objckpt.core.codecs import CHUNK_BYTES
from objckpt.core.format import ITEM_KINDS, LeafEntry
from objckpt.core.metadata import to_json_value
from objckpt.core.plan import packing_order
from objckpt.core.tree import flatten
from objckpt.multihost import Coordinator, get_coordinator, operation_tag
from objckpt.options import Options
from objckpt.progress import ProgressArg
from objckpt.saving.blob_sizing import split_pieces
from objckpt.saving.classify import classify
from objckpt.saving.encode import coded_leaves
from objckpt.saving.incremental import base_name
from objckpt.saving.local_snapshot import Snapshot
from objckpt.saving.writer import ABORT_GRACE, Source, discard, write
from objckpt.transfer import runtime
from objckpt.transfer.buffers import tune_malloc
from objckpt.transfer.cpu_slots import save_threads_for
from objckpt.transfer.handle import Handle
from objckpt.transfer.stats import TransferStats

log = logging.getLogger("objckpt")
_SLICE = 0.1  # seconds: how long a wait for a save runs between chances for a Ctrl-C


class SaveHandle:
    """A save whose upload and commit may still be running.

    ``result()`` waits and re-raises any error; ``done()`` polls. The figures
    are this process's own.

    Attributes:
        url: the checkpoint being saved.
        stats: the save's :class:`~objckpt.transfer.stats.TransferStats`, counting while it runs.
        seconds_blocked: how long ``save_async`` held the caller (the device→host copy).
        future: the commit's ``concurrent.futures.Future`` (what ``result`` waits for).
    """

    def __init__(
        self,
        future: concurrent.futures.Future[None],
        stats: TransferStats,
        seconds_blocked: float,
        url: str,
        transfer: Handle | None = None,
    ):
        self.future = future
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
        while not self.future.done() and (deadline is None or time.monotonic() < deadline):
            concurrent.futures.wait([self.future], _SLICE)  # a Ctrl-C gets through between short waits
        self.future.result(0)

    def done(self) -> bool:
        """Whether the save has ended, committed or failed (``result()`` says which)."""
        return self.future.done()

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
                runtime.submit(discard(handle._transfer)).result(ABORT_GRACE)
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
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    metadata: dict[str, Any] | None = None,
    progress: ProgressArg = False,
    *,
    hold_uploads: bool,
    base: str | None = None,
    stage: Snapshot | None = None,
) -> SaveHandle:
    """Classify ``tree`` into the source the writing corridor writes (:mod:`objckpt.saving.writer`)
    and start it; ``hold_uploads`` as in :func:`objckpt.saving.upload.snapshot_and_upload`;
    ``stage``: see :func:`start_save`."""
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
        coordinator = get_coordinator()
        source = tree_source(tree, options, coordinator, to_json_value(dict(metadata or {}), "metadata"), stage)
        tag = operation_tag("save", handle.url)
        save_id = _shared_save_id(coordinator, tag, options.barrier_timeout)
        writing = write(
            handle,
            source,
            save_id=save_id,
            tag=tag,
            coordinator=coordinator,
            hold_uploads=hold_uploads,
            base=name,
            progress=progress,
            entered=entered,
            close=True,
        )
    except BaseException:
        handle.close()
        raise
    return SaveHandle(writing.future, handle.stats, writing.seconds_blocked, handle.url, handle)


def start_save(url: str, tree: Any, stage: Snapshot, **kwargs: Any) -> SaveHandle:
    """:func:`save_async` whose pieces take their bytes from ``stage``, a local snapshot of the same
    ``tree`` (the host stage a manager step due for both the local tier and the store shares: each
    box copied off the devices once); a piece the snapshot lacks is read from its device."""
    return _start(url, tree, hold_uploads=True, stage=stage, **kwargs)


def tree_source(
    tree: Any, options: Options, coordinator: Coordinator, metadata: dict[str, Any], stage: Snapshot | None = None
) -> Source:
    """What a save of ``tree`` writes: each leaf classified in the save's scope (the boxes this
    process owns by the grid rule), its pieces cut to at most ``Options.blob_size`` (a compressed
    leaf's to the codec's chunk: a read that needs part of a shard fetches only the chunks its
    box meets, docs/PERFORMANCE.md "Compression"), read from ``stage`` where it holds them."""
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
    chunk = options.blob_size if options.compression is None else min(options.blob_size, CHUNK_BYTES)
    owned = split_pieces(owned if stage is None else stage.serve(owned), max_bytes=chunk)
    return Source(
        skeleton,
        entries,
        [owned],
        sum(p.nbytes for p in owned),
        meshes=tuple(meshes.meshes),
        metadata=metadata,
        coded=coded_leaves([e.kind for e in entries], options.compression),
    )


def _shared_save_id(coordinator: Coordinator, tag: str, timeout: float) -> str:
    """The save's id, one for all its processes: the primary's, sent through the coordinator.

    The root and every index object carry it, so a reader refuses a root that lists an
    index object of another save left in the same prefix (docs/FORMAT.md). One small
    value, no barrier: the primary sets it and goes on; the others wait for it only if
    they reach this point first.
    """
    mine = uuid.uuid4().hex.encode() if coordinator.is_primary else None
    return coordinator.broadcast(f"{tag}/save_id", mine, timeout=timeout).decode()
