"""copy: a committed checkpoint from any store to any other (S3 → GCS, region to region, disk).

Two ways to move a blob, chosen once per copy:

* **server-side**, when both stores are on one provider and account (two S3
  buckets of one endpoint and credential source, two GCS buckets):
  the destination's server copies each blob (S3 ``CopyObject``, GCS rewrite;
  :mod:`objckpt.storage.copy.server`) and only request heads cross the
  client's link. A blob is copied only once the source's listing holds it at
  the size its index object declares (a size is a claim until the store confirms
  it: a mismatch is an ``IntegrityError`` naming the blob, before any request
  is built from it). Each copied blob is then HEADed and its size compared with
  the manifest's. Its pieces' crc32c are not read (that would move the bytes
  this avoids): restore and verify check them, as for every checkpoint.
  The first blob is copied alone; if the server refuses it (no permission,
  the source not visible with the destination's credentials, unsupported),
  the whole checkpoint is copied the other way, and one warning says why.
* **streamed** everywhere else: for each blob, as a sliding window bounded
  in bytes (``Options.memory_budget``), concurrent ranged reads from the
  source, every piece's crc32c checked, then one PUT to the destination
  (stores split large objects into multipart uploads themselves).

Either way the index objects are read, checked against the root's crc32c
and written through the client (they are small), and the manifest goes
last, with create-if-absent, so a half-copied checkpoint never exists at the
destination: a copy killed at any moment leaves only unreferenced blobs there.

Resuming is rerunning: a blob already at the destination with the right size
is checked and kept if intact, so a rerun moves only what was missing or
damaged. Streamed, checking means reading it back, piece by piece; server-side,
comparing what the server says the two objects' bytes hash to (a GCS crc32c, an
S3 single-part ETag), and trusting the size where it says nothing comparable
(an S3 multipart ETag). ``CopyStats`` counts it all; its ``bytes_read`` and
``bytes_written`` are always bytes that crossed the client's link.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from objckpt.core.checksum import crc32c, sha256_hex
from objckpt.core.format import MANIFEST_KEY, BlobEntry, IndexRef, Manifest, parse_manifest
from objckpt.core.format.bases import is_ref
from objckpt.core.format.index3 import parse_head
from objckpt.core.format.standalone import local_key, standalone_index, standalone_root
from objckpt.errors import CheckpointExistsError, FormatError, IntegrityError, StoreError
from objckpt.layouts.manifest_io import commit_manifest, read_checkpoint
from objckpt.options import Options
from objckpt.progress import ProgressArg, closing
from objckpt.progress import start as start_progress
from objckpt.saving.live_markers import LiveMarker, marker_key
from objckpt.storage.base import Store
from objckpt.storage.copy import server as server_copy
from objckpt.tools.copy_stats import MIXED, SERVER_SIDE, STREAMED, CopyStats
from objckpt.tools.server_side import ServerSide
from objckpt.tools.verify import READ_CHUNK, check_blob, check_pieces, pieces_by_blob, read_blob
from objckpt.tools.verify_stored import expected_crc32c
from objckpt.transfer import dask_jobs, runtime
from objckpt.transfer.engine import TransferEngine
from objckpt.transfer.handle import Handle, opened
from objckpt.transfer.stats import TransferStats

log = logging.getLogger("objckpt")

#: What :func:`committed_save_id` says of a manifest that is there but cannot be parsed.
UNREADABLE_MANIFEST = "(unreadable manifest)"

#: A copy on Dask: a task's blobs (it copies them only), or the caller's fan-out of every blob.
Job = set[str] | Callable[["Manifest", "CopyStats"], None] | None


class DestinationCommittedError(CheckpointExistsError):
    """The destination already holds a committed checkpoint; it was left intact.

    Attributes:
        save_id: the ``save_id`` of the checkpoint there (:data:`UNREADABLE_MANIFEST` when
            its manifest does not parse).
        same: whether it is the checkpoint being copied (copied already, perhaps by a run cut
            off after its commit).
    """

    def __init__(self, message: str, *, save_id: str, same: bool) -> None:
        super().__init__(message)
        self.save_id = save_id
        self.same = same


def copy(
    src_url: str,
    dst_url: str,
    *,
    src_storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    verify_existing: bool = True,
    server_side: bool = True,
    progress: ProgressArg = False,
    client: Any = None,
    blobs: set[str] | None = None,
) -> CopyStats:
    """Copy the committed checkpoint at ``src_url`` to ``dst_url``.

    Args:
        src_url: the checkpoint to copy: any store URL (``s3://``, ``gs://``, a local path...).
        dst_url: where to copy it: any store URL, on the same store or another.
        src_storage_options: passed to the source's store.
        dst_storage_options: passed to the destination's store.
        options: tuning: ``max_concurrency`` (requests in flight per side),
            ``memory_budget`` (bytes of blobs held at once), timeouts, retries.
        verify_existing: check blobs already at the destination before keeping
            them (False trusts any blob of the right size).
        server_side: let the destination's server copy the blobs when both stores
            are on one provider and account (see the module doc); False always
            streams them through this client.
        progress: ``True`` draws a progress bar on stderr when it is a terminal
            (tqdm); a callable is called with a :class:`objckpt.Progress` at most
            every 0.1 s and once more at the end, on objckpt's I/O thread: it must
            be quick, and an exception it raises is logged once, never failing
            the copy. ``False``/``None``: nothing.
        client: a ``distributed.Client``: the blobs are copied by tasks on its Dask cluster, split by
            bytes (:mod:`objckpt.transfer.dask_jobs`); this process marks, copies the indexes, commits.
        blobs: copy only these blobs, and neither mark, index nor commit (a task of a copy on Dask).

    Returns:
        The figures of the copy (:class:`CopyStats`), saying which way it copied.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``src_url``.
        CheckpointExistsError: ``dst_url`` already holds a committed checkpoint (left
            intact): a :class:`DestinationCommittedError` naming its ``save_id``.
        IntegrityError: a source blob is damaged, or a server-side copy is not the size
            the manifest says (nothing is committed).
    """
    options = options or Options()
    src_stats, dst_stats = TransferStats(), TransferStats()
    with (
        opened(src_url, src_storage_options, options, src_stats) as src,
        opened(dst_url, dst_storage_options, options, dst_stats) as dst,
    ):
        kw = {"src_url": src_url, "dst_url": dst_url, "options": options, "verify_existing": verify_existing}
        kw |= {"src_storage_options": src_storage_options, "dst_storage_options": dst_storage_options}
        fan = None if client is None else lambda m, s: _on_dask(client, m, s, src, dst, server_side=server_side, **kw)
        return runtime.run_sync(_copy_stores(src, dst, verify_existing, server_side, progress, None, fan or blobs))


def _on_dask(client: Any, manifest: Manifest, stats: CopyStats, src: Handle, dst: Handle, **kw: Any) -> None:
    """The blobs copied by tasks on ``client``'s cluster, their figures added to ``stats`` and the handles'."""
    job, blobs = f"cp {src.url} {dst.url} {manifest.save_id}", [(b.key, b.size) for b in manifest.blobs]
    for r in dask_jobs.fan_out(client, job, _copy_task, blobs, **kw):
        for name in ("blobs_copied", "bytes_copied", "blobs_skipped", "bytes_skipped", "bytes_server_side"):
            setattr(stats, name, getattr(stats, name) + getattr(r, name))
        stats.blobs_server_side += r.blobs_server_side
        src.stats.add(bytes_read=r.bytes_read, requests=r.requests, retries=r.retries)
        dst.stats.add(bytes_written=r.bytes_written, bytes_read=r.bytes_read_dst)


def _copy_task(blobs: list[str], src_url: str, dst_url: str, **kw: Any) -> CopyStats:
    return copy(src_url, dst_url, blobs=set(blobs), **kw)


async def copy_stores_async(
    src: Store,
    dst: Store,
    options: Options,
    *,
    verify_existing: bool = True,
    server_side: bool = True,
    writes: set[str] | None = None,
) -> CopyStats:
    """:func:`copy` between two open stores, on objckpt's I/O loop (the caller closes them).

    Args:
        src, dst: open stores (:func:`objckpt.transfer.retries.open_store`'s, or any other,
            which gets ``options``' retries); each is one :class:`~objckpt.transfer.handle.Handle`
            of the copy, whose engine does the bulk requests.
        options, verify_existing, server_side: as for :func:`copy`.
        writes: filled, once the source's checkpoint is read and before anything is
            written, with the keys of the objects the copy writes at the destination
            before its manifest (blobs, index objects, its live-save marker): what a caller
            that abandons the copy mid-way deletes there.

    Raises:
        As :func:`copy`; a destination that holds a committed checkpoint raises
        :class:`DestinationCommittedError`, whose ``same`` says whether it is this one.
    """
    source, target = Handle.of(src, options, TransferStats()), Handle.of(dst, options, TransferStats())
    return await _copy_stores(source, target, verify_existing, server_side, None, writes)


async def committed_save_id(store: Store, options: Options) -> str | None:
    """The ``save_id`` of the checkpoint committed at ``store``: None when there is none,
    :data:`UNREADABLE_MANIFEST` when its manifest does not parse."""
    try:
        data = await store.get(MANIFEST_KEY)
    except FileNotFoundError:
        return None
    try:
        return parse_manifest(data, size_limit=options.manifest_size_limit).save_id
    except Exception:
        return UNREADABLE_MANIFEST


async def _copy_stores(
    src: Handle,
    dst: Handle,
    verify_existing: bool,
    server_side: bool,
    progress: ProgressArg,
    writes: set[str] | None = None,
    job: Job = None,
) -> CopyStats:
    """The copy between open stores, with its figures, on the I/O loop (the options: the source's)."""
    started = time.perf_counter()
    options, src_stats, dst_stats = src.options, src.stats, dst.stats
    manifest = await read_checkpoint(src.store, size_limit=options.manifest_size_limit)
    if writes is not None:
        writes.update(b.key for b in manifest.blobs)
        writes.update(r.key for r in manifest.indexes)
        writes.add(marker_key(manifest.save_id, 0))  # its live-save marker, gone with the rest if abandoned
    stats = CopyStats(src.url, dst.url, blobs=len(manifest.blobs), bytes_total=sum(b.size for b in manifest.blobs))

    def done() -> int:  # streamed: half for the read, half for the write; checked and server-copied blobs count whole
        moved = (src_stats.bytes_read + dst_stats.bytes_written) // 2 + dst_stats.bytes_read + stats.bytes_server_side
        return min(moved, stats.bytes_total)

    reporter = start_progress(progress, "cp", dst.url, stats.bytes_total, done, src_stats, dst_stats)
    copying = _copy(src, dst, manifest, stats, verify_existing, server_side, job)
    try:
        await closing(copying, reporter)
    finally:
        stats.bytes_read = src_stats.bytes_read
        stats.bytes_written = dst_stats.bytes_written
        stats.bytes_read_dst = dst_stats.bytes_read
        stats.requests = src_stats.requests + dst_stats.requests
        stats.retries = src_stats.retries + dst_stats.retries
        stats.seconds = time.perf_counter() - started
    log.info("objckpt %s", stats.summary())
    return stats


async def _copy(
    src: Handle,
    dst: Handle,
    manifest: Manifest,
    stats: CopyStats,
    verify_existing: bool,
    server_side: bool,
    job: Job = None,
) -> None:
    if isinstance(job, set):  # a task of a copy on Dask: the caller's process marks, indexes and commits
        return await _copy_objects(src, dst, manifest, stats, verify_existing, server_side, job)
    if not dst.traits.supports_create:
        raise StoreError(f"{dst.url} cannot create-if-absent atomically, so a copy there could not commit safely")
    await _refuse_committed(dst.store, manifest, src.options)
    # The copy's marker, as a save's (the writing corridor's first step): gc, rm and retention at
    # the destination keep off the objects it writes until its manifest is committed.
    marker = LiveMarker(dst.store, marker_key(manifest.save_id, 0), lease=src.options.live_marker_lease)
    await marker.begin()
    try:
        await _copy_objects(src, dst, manifest, stats, verify_existing, server_side, job)
    finally:
        await marker.end()


async def _copy_objects(
    src: Handle, dst: Handle, manifest: Manifest, stats: CopyStats, verify_existing: bool, server_side: bool, job: Job
) -> None:
    options, src_stats, dst_stats = src.options, src.stats, dst.stats
    source, target = src.engine, dst.engine
    present = {o.key: o.size for o in await dst.store.list()}
    by_blob = pieces_by_blob(manifest)
    unused = next((b.key for b in manifest.blobs if is_ref(b.key) and b.key not in by_blob), None)
    if unused:  # a crafted head: the copy would carry bytes of the base that no piece is
        raise FormatError(
            f"{src.url}: an index object lists the base's blob {unused}, which no row uses (the copy would carry"
            f" bytes that are no piece of it); nothing was copied to {dst.url}"
        )
    chunk = min(READ_CHUNK, options.copied_read_limit(streamed=False))
    reads = options.retry.checksum_reads
    if server_side:
        copier, why_not = await asyncio.to_thread(
            server_copy.plan,
            src.bulk,
            dst.bulk,
            request_timeout=options.request_timeout,
            concurrency=options.max_concurrency,
        )
    else:
        copier, why_not = None, "server_side=False"
    # The sizes the source's store confirms; a server-side copy is planned only from these.
    source_sizes = {o.key: o.size for o in await src.store.list()} if copier is not None else {}
    server = ServerSide(copier, why_not, src, dst, target, source_sizes)

    def copied(blob: BlobEntry, on_server: bool) -> None:
        stats.blobs_copied += 1
        stats.bytes_copied += blob.size
        if on_server:
            stats.blobs_server_side += 1
            stats.bytes_server_side += blob.size
            dst_stats.add(objects_written=1)  # wakes a progress reporter: these bytes never pass the counters

    async def one(blob: BlobEntry) -> None:  # pieces built once the blob's bytes are there to check
        if is_ref(blob.key):  # a base's blob: copied into the copy, which then stands alone
            await _copy_referenced(blob)
            return
        if present.get(blob.key) == blob.size:
            if not verify_existing:
                _count_skipped(stats, blob)
                return
            if server.active:
                same = await server.same_object(blob.key)
                if server.active and same is not False:
                    _count_skipped(stats, blob)
                    return
                if same is False:
                    log.info("objckpt cp: replacing %s/%s: the server says its bytes differ", dst.url, blob.key)
            if not server.active:
                problems = await check_blob(target, blob, by_blob.get(blob.key, []), blob.size, chunk=chunk)
                if not problems:
                    _count_skipped(stats, blob)
                    return
                log.info("objckpt cp: replacing %s/%s: %s", dst.url, blob.key, problems[0])
        if server.active and await server.copy(blob):
            copied(blob, on_server=True)
            return
        pieces: list[Any] = []
        for attempt in range(1, reads + 1):  # a mismatch is read again: bits flip in flight too
            data = await read_blob(source, blob.key, blob.size, chunk=chunk)
            if len(data) != blob.size:
                raise IntegrityError(
                    f"short blob {src.url}/{blob.key}: {len(data)} bytes, the manifest says {blob.size}"
                )
            if attempt == 1:
                pieces = by_blob.get(blob.key, [])
            problems = await asyncio.to_thread(check_pieces, src.url, blob.key, data, pieces)
            if not problems:
                break
            if attempt == reads:
                more = f" (and {len(problems) - 1} more in this blob)" if len(problems) > 1 else ""
                persisted = f" (persisted over {reads} reads)" if reads > 1 else ""
                raise IntegrityError(f"{problems[0]}{more}{persisted}; nothing was committed at {dst.url}")
            src_stats.add(checksum_retries=1)
        body = data if isinstance(data, bytes) else memoryview(data)
        await target.put(blob.key, body, crc32c=expected_crc32c(blob, pieces))  # checked and kept by S3
        copied(blob, on_server=False)

    async def _copy_referenced(blob: BlobEntry) -> None:
        key = local_key(blob.key)
        if present.get(key) == blob.size and not verify_existing:
            _count_skipped(stats, blob)
            return
        data = await read_blob(source, blob.key, blob.size, chunk=chunk)
        problems = (
            []
            if len(data) != blob.size
            else await asyncio.to_thread(check_pieces, src.url, blob.key, data, by_blob.get(blob.key, []))
        )
        if len(data) != blob.size or problems:
            why = problems[0] if problems else f"short blob {src.url}/{blob.key}"
            raise IntegrityError(f"{why}; nothing was committed at {dst.url}")
        await target.put(key, data if isinstance(data, bytes) else memoryview(data))
        copied(blob, on_server=False)

    todo = [b for b in manifest.blobs if not isinstance(job, set) or b.key in job]
    try:
        if callable(job):
            await asyncio.to_thread(job, manifest, stats)
        else:
            await source.for_each(todo, one, window_bytes=options.memory_budget, size=lambda b: max(b.size, 1))
    finally:
        server.close()
        stats.method, stats.streamed_because = _method(stats, server)
    if isinstance(job, set):
        return
    manifest = await _copy_indexes(source, target, src, manifest)
    await _commit(target, dst.store, manifest, options)


def _method(stats: CopyStats, server: ServerSide) -> tuple[str, str]:
    """How the copy went, and why not server-side where it was not."""
    streamed = stats.blobs_copied - stats.blobs_server_side
    if stats.blobs_server_side and streamed:
        return MIXED, server.why_not
    if stats.blobs_server_side or (server.active and not streamed):
        return SERVER_SIDE, ""
    return STREAMED, server.why_not


async def _copy_indexes(source: TransferEngine, target: TransferEngine, src: Any, manifest: Manifest) -> Manifest:
    """Formats 2 and 3: copy each process's index object as is (the root holds its crc32c, and SHA-256 if
    any; version 3: of its head, which pins every frame, each checked and decoded before the copy); the
    manifest to commit. An incremental checkpoint's index objects name their references as blobs of their
    own (:mod:`objckpt.core.format.standalone`), and its copy's root has no ``bases``."""
    rewritten: list[IndexRef] = []
    for process, ref in enumerate(manifest.indexes):
        data = await source.get(ref.key)
        if manifest.version >= 3:
            try:
                _check_pinned(data, manifest, process)
            except FormatError as e:
                raise IntegrityError(f"{e} (copying from {src.url}); nothing was committed") from None
        elif len(data) != ref.size or crc32c(data) != ref.crc32c or ref.sha256 not in (None, sha256_hex(data)):
            raise IntegrityError(f"index object {src.url}/{ref.key} does not match the manifest; nothing was committed")
        if manifest.bases:
            data, ref = standalone_index(data, ref)
        rewritten.append(ref)
        await target.put(ref.key, data)
    return standalone_root(manifest, rewritten) if manifest.bases else manifest


def _check_pinned(data: bytes, manifest: Manifest, process: int) -> None:
    """A version 3 index object read again for its copy holds the bytes its rows were checked
    in (when the checkpoint was read): its head matches the root's checksums, each frame its
    head's; the rows are not decoded again.

    Raises:
        FormatError: naming the index object and what differs.
    """
    ref = manifest.indexes[process]
    if len(data) != ref.size:
        raise FormatError(f"index object {ref.key} is {len(data)} bytes, the manifest says {ref.size}")
    for k, f in enumerate(parse_head(data, manifest, process).frames):
        body = data[f.offset : f.offset + f.length]
        wrong = "crc32c" if crc32c(body) != f.crc32c else "sha256" if f.sha256 not in (None, sha256_hex(body)) else ""
        if wrong:
            raise FormatError(f"index object {ref.key} frame {k} does not match its {wrong} in the head")


def _count_skipped(stats: CopyStats, blob: BlobEntry) -> None:
    stats.blobs_skipped += 1
    stats.bytes_skipped += blob.size


async def _refuse_committed(dst: Any, manifest: Manifest, options: Options) -> None:
    save_id = await committed_save_id(dst, options)
    if save_id is None:
        return
    same = save_id == manifest.save_id
    already = " (the same checkpoint: it was copied already)" if same else ""
    raise DestinationCommittedError(
        f"a committed checkpoint already exists at {dst.url}{already}; nothing was copied", save_id=save_id, same=same
    )


async def _commit(target: TransferEngine, dst: Any, manifest: Manifest, options: Options) -> None:
    """Write the manifest last, through the save's one manifest write (:func:`commit_manifest`:
    the copy read back as a reader reads it first); a lost reply to our own write is success."""
    if not await commit_manifest(target, manifest, store=dst, size_limit=options.manifest_size_limit):
        save_id = await committed_save_id(dst, options)
        if save_id != manifest.save_id:
            raise DestinationCommittedError(
                f"a committed checkpoint appeared at {dst.url} during the copy; it was left intact",
                save_id=save_id or UNREADABLE_MANIFEST,
                same=False,
            ) from None
