"""The writing corridor: every checkpoint objckpt writes goes through :func:`write`.

A *source* (:class:`Source`) says what to write: the leaf table and this process's pieces, in
batches (a tree's shards, a local part, Orbax slabs; a Composite's other processes' parts beside).
:func:`write` owns every step from there, once, in this order (docs/ARCHITECTURE.md, "The two
corridors"): **begin** (:func:`check_destination`; the live-save markers, in the base's prefix too,
before the first blob: :mod:`objckpt.saving.live_markers`) → **plan** (an incremental save's
references, :mod:`objckpt.saving.incremental`; blobs named by save id, process and sequence) →
**stage and upload** (:mod:`objckpt.saving.upload`: device→host copies through
:mod:`objckpt.core.device_reads`' aliases only; with ``resume``, a blob an earlier run left intact
is kept) → **index and commit** (on the I/O loop, :mod:`objckpt.saving.commit`, the manifest through
the one manifest write, :func:`objckpt.layouts.manifest_io.commit_manifest`) → **abandon on error**
(uploads stopped, what they wrote deleted, markers down). A copy (``cp``, replicas) moves objects a
save wrote and enters at the manifest write.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from objckpt import in_flight
from objckpt.core.boxes import copy_piece_into
from objckpt.core.checksum import crc32c, sha256_hex
from objckpt.core.format import MANIFEST_KEY, LeafEntry, Piece
from objckpt.core.plan import BlobPlan, OwnedPiece, blob_key, plan_blobs
from objckpt.core.writer_rule import Mesh
from objckpt.errors import CheckpointExistsError, ObjectNotFoundError, StoreError
from objckpt.multihost import Coordinator
from objckpt.progress import ProgressArg, closing, finish_from_caller, start
from objckpt.saving import incremental
from objckpt.saving.blob_sizing import save_blob_size
from objckpt.saving.commit import Commit, Save
from objckpt.saving.live_markers import LiveMarker, MarkerGroup, marker_key
from objckpt.saving.upload import PieceRecord, snapshot_and_upload
from objckpt.transfer import runtime
from objckpt.transfer.buffers import release_freed_memory
from objckpt.transfer.handle import Handle

#: How long an interrupted write may take to abort and delete what it wrote (seconds).
ABORT_GRACE = 0.6

Uploads = list[concurrent.futures.Future[list[PieceRecord]]]


@dataclass
class Source:
    """What :func:`write` writes: the checkpoint's leaf table and this process's pieces.

    ``batches`` are planned and uploaded in turn; with ``streamed``, a batch's uploads end before
    the next batch is asked for (a source that reads its pieces as it goes, within its memory).
    ``other_parts``: ``(process, entries, pieces)`` of processes this one writes for, the commit
    then listing ``processes`` of them. ``check`` sees every record before the commit (raising
    stops it); ``cancel`` stops the source's own work when the write fails. ``uploaded``: records of
    blobs written already, by tasks of a job on Dask (:func:`upload_batch`), iterated once the marker is up.
    """

    skeleton: dict[str, Any]
    entries: list[LeafEntry]
    batches: Iterable[list[OwnedPiece]]
    nbytes: int
    meshes: tuple[Mesh, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)
    coded: frozenset[int] = frozenset()  # leaves whose pieces are compressed (Options.compression)
    streamed: bool = False
    other_parts: Iterable[tuple[int, list[LeafEntry], list[OwnedPiece]]] = ()
    processes: int = 0  # 0: the job's
    check: Callable[[list[PieceRecord]], None] | None = None
    cancel: Callable[[], None] | None = None
    uploaded: Iterable[list[PieceRecord]] = ()


@dataclass
class Writing:
    """A write whose commit may still be running: its future (on the I/O loop), how long
    :func:`write` held its caller, and the blobs kept from an earlier run (``resume``)."""

    future: concurrent.futures.Future[None]
    seconds_blocked: float
    blobs_kept: int = 0


def check_destination(handle: Handle) -> None:
    """Refuse a store that cannot create-if-absent, or that already holds a committed checkpoint.

    Raises:
        StoreError: the store cannot create objects only-if-absent.
        CheckpointExistsError: a committed checkpoint is there (left intact).
    """
    if not handle.traits.supports_create:
        raise StoreError(
            f"{handle.url}: this store cannot create objects only-if-absent, so a commit could overwrite"
            " another writer's checkpoint; use a store that supports it (S3, GCS, local disk, memory)"
        )
    try:
        runtime.run_sync(handle.store.head(MANIFEST_KEY))  # the retrying store bounds it
    except FileNotFoundError:
        return
    raise CheckpointExistsError(f"a committed checkpoint already exists at {handle.url}")


def write(
    handle: Handle,
    source: Source,
    *,
    save_id: str,
    tag: str,
    coordinator: Coordinator,
    blob_size: int | None = None,
    hold_uploads: bool = False,
    base: str | None = None,
    resume: bool = False,
    progress: ProgressArg = False,
    verb: str = "save",
    entered: float | None = None,
    close: bool = False,
) -> Writing:
    """Write ``source`` as the checkpoint at ``handle`` (save ``save_id``, coordinated under ``tag``).

    Returns once every upload has started (``hold_uploads``: as in
    :func:`~objckpt.saving.upload.snapshot_and_upload`); the commit runs on the I/O loop, and
    ``close`` closes ``handle`` after it. ``blob_size``: by default from the source's bytes
    (:func:`~objckpt.saving.blob_sizing.save_blob_size`). ``base``: the name of the sibling
    checkpoint an incremental save references. ``resume``: keep the blobs an earlier run of the
    same save left intact. ``entered``: when the caller's operation began.
    """
    entered = time.perf_counter() if entered is None else entered
    options = handle.options
    bases = () if base is None else (incremental.base_store(handle.store, base),)
    key, lease = marker_key(save_id, coordinator.process_index), options.live_marker_lease
    own = LiveMarker(handle.store, key, lease=lease)
    marker = MarkerGroup([own, *(LiveMarker(b, key, lease=lease) for b in bases)]) if bases else own
    save = Save(handle=handle, coordinator=coordinator, tag=tag, save_id=save_id, marker=marker)
    begun = False
    try:
        check_destination(handle)
        begun = True
        runtime.run_sync(marker.begin())
    except BaseException as e:
        _tell_peers(save, e)
        if begun:
            runtime.run_sync(marker.end())
        raise
    if blob_size is None:
        blob_size = save_blob_size(
            options, source.nbytes, processes=coordinator.process_count, hold_uploads=hold_uploads
        )
    started, reporter, kept = time.perf_counter(), None, [0]
    uploads: Uploads = []
    reports: dict[int, bytes] = {}
    try:
        present = {o.key: o.size for o in runtime.run_sync(handle.store.list(""))} if resume else {}
        seq = 0
        for pieces in source.batches:
            if base is not None:  # the marker is in the base now: read it, then reference what is equal
                matched = incremental.against_base(handle, pieces, source.entries, base, source.coded)
                pieces = matched.upload
                save = dataclasses.replace(
                    save, refs=tuple(matched.refs), ref_blobs=matched.ref_blobs, bases=tuple(matched.bases)
                )
            key_of = functools.partial(_numbered, save_id, coordinator.process_index, seq)
            blobs = plan_blobs(pieces, blob_size=blob_size, key=key_of)
            seq += len(blobs)
            if reporter is None:  # a streamed source's bytes, or what one batch's blobs hold
                total = source.nbytes if source.streamed else sum(b.size for b in blobs)
                reporter = start(progress, verb, handle.url, total, lambda: handle.stats.bytes_written, handle.stats)
            sent = _send(handle, blobs, present, kept, hold_uploads=hold_uploads, coded=source.coded)
            uploads.extend(sent)
            if source.streamed:  # sent before the source reads on; a failed upload stops it now
                for upload in sent:
                    upload.result()
        uploads.extend(map(_done, source.uploaded))
        for process, entries, pieces in source.other_parts:
            blobs = plan_blobs(pieces, blob_size=blob_size, key=functools.partial(blob_key, save_id, process))
            records = [r for f in _send(handle, blobs, present, kept, hold_uploads=False) for r in f.result()]
            as_process = Commit(save, skeleton={}, entries=entries, meshes=(), metadata={})
            reports[process] = json.dumps(runtime.run_sync(as_process.index_report(records, process=process))).encode()
    except BaseException as e:
        finish_from_caller(reporter, complete=False)
        if source.cancel is not None:
            source.cancel()
        _tell_peers(save, e)
        if not resume:  # uploads already started: stopped, what they wrote deleted (a resumable one keeps it)
            with contextlib.suppress(Exception):
                runtime.run_sync(discard(handle))
        runtime.run_sync(save.marker.end())
        raise
    seconds_blocked = time.perf_counter() - entered
    commit = Commit(
        save,
        skeleton=source.skeleton,
        entries=source.entries,
        meshes=source.meshes,
        metadata=source.metadata,
        coded=source.coded,
        check=source.check,
        reports=reports,
        processes=source.processes,
    )
    future = runtime.submit(_then_close(closing(commit.run(uploads, started), reporter), handle if close else None))
    in_flight.track(handle.url, future)
    return Writing(future, seconds_blocked, kept[0])


def _tell_peers(save: Save, error: BaseException) -> None:
    """A failure before the commit (a stalled store's, say) reported as a commit reports one, so
    the other processes fail at once naming this one, not at the barrier timeout."""
    if isinstance(error, Exception) and save.coordinator.process_count > 1:
        with contextlib.suppress(Exception):
            runtime.run_sync(Commit(save, skeleton={}, entries=[], meshes=(), metadata={}).report_failure(error))


def _numbered(save_id: str, process: int, first: int, n: int) -> str:
    """Blob keys numbered on from ``first`` (the blobs of earlier batches)."""
    return blob_key(save_id, process, first + n)


def upload_batch(handle: Handle, pieces: list[OwnedPiece], *, save_id: str, first: int) -> list[PieceRecord]:
    """A batch uploaded by a task of a job on Dask: its blobs planned (``Options.blob_size``) and numbered on
    from ``first`` as :func:`write` numbers a batch, those an earlier run left intact kept; their records,
    which the job's process commits (:attr:`Source.uploaded`)."""
    blobs = plan_blobs(pieces, blob_size=handle.options.blob_size, key=functools.partial(_numbered, save_id, 0, first))
    present = runtime.run_sync(_sizes(handle, [b.key for b in blobs]))  # its own blobs, not a listing per task
    return [r for f in _send(handle, blobs, present, [0], hold_uploads=False) for r in f.result()]


async def _sizes(handle: Handle, keys: list[str]) -> dict[str, int]:
    """The sizes of those of ``keys`` the store holds (a HEAD each, in parallel)."""

    async def size(key: str) -> tuple[str, int | None]:
        try:
            return key, (await handle.store.head(key)).size
        except FileNotFoundError:
            return key, None

    return {k: n for k, n in await asyncio.gather(*map(size, keys)) if n is not None}


def _done(records: list[PieceRecord]) -> concurrent.futures.Future[list[PieceRecord]]:
    future: concurrent.futures.Future[list[PieceRecord]] = concurrent.futures.Future()
    future.set_result(records)
    return future


def _send(
    handle: Handle,
    blobs: list[BlobPlan],
    present: dict[str, int],
    kept: list[int],
    *,
    hold_uploads: bool,
    coded: frozenset[int] = frozenset(),
) -> Uploads:
    """Upload ``blobs``, except those an earlier run left intact in ``present`` (counted in ``kept``)."""
    done: list[PieceRecord] = []
    missing = []
    for blob in blobs:
        records = _kept(blob, handle) if present.get(blob.key) == blob.size else None
        if records is None:
            missing.append(blob)
        else:
            done.extend(records)
            kept[0] += 1
    futures = snapshot_and_upload(missing, handle, hold_uploads=hold_uploads, coded=coded) if missing else []
    return futures + [_done(done)] if done else futures


def _kept(blob: BlobPlan, handle: Handle) -> list[PieceRecord] | None:
    """The records of ``blob`` if the object already at its key holds exactly its bytes, else None
    (with each piece's SHA-256 under ``Options.digest``)."""
    staged = np.zeros(blob.size, dtype=np.uint8)
    for placed in blob.pieces:
        piece = placed.piece
        view = staged[placed.offset : placed.offset + piece.nbytes].view(piece.source[0].dtype).reshape(piece.shape)
        copy_piece_into(piece, view)
    try:
        existing = runtime.run_sync(handle.engine.get(blob.key))
    except (ObjectNotFoundError, StoreError):
        return None
    if bytes(existing) != staged.tobytes():
        return None
    data, digest = staged.data, handle.options.digest is not None
    out: list[PieceRecord] = []
    for p in blob.pieces:
        body = data[p.offset : p.offset + p.piece.nbytes]
        crc, sha = crc32c(body), sha256_hex(body) if digest else None
        out.append((p.piece.leaf, Piece(p.piece.start, p.piece.stop, blob.key, p.offset, p.piece.nbytes, crc, sha)))
    return out


async def _then_close(run: Any, handle: Handle | None) -> None:
    """Await ``run``, then close ``handle``'s store (if given) and give the freed host memory back."""
    try:
        await run
    finally:
        if handle is not None:
            await handle.aclose()
        await asyncio.to_thread(release_freed_memory)


async def discard(handle: Handle) -> None:
    """Abort a write's uploads and delete the objects they started writing, within
    :data:`ABORT_GRACE` seconds (best effort: nothing of it is committed, and ``objckpt rm --force``
    removes what is left)."""
    await handle.engine.abort(grace=ABORT_GRACE / 3)

    async def delete(key: str) -> None:
        with contextlib.suppress(Exception):
            await handle.store.delete(key)

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*map(delete, set(handle.engine.written))), ABORT_GRACE / 2)
