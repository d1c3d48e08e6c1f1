"""copy: a committed checkpoint from any store to any other (S3 → GCS, region to region, disk).

For each blob of the source manifest, as a sliding window bounded in bytes
(``Options.memory_budget``): concurrent ranged reads from the source, every
piece's crc32c checked, then one PUT to the destination (stores split large
objects into multipart uploads themselves). The manifest goes last, with
create-if-absent, so a half-copied checkpoint never exists at the destination:
a copy killed at any moment leaves only unreferenced blobs there.

Resuming is rerunning: a blob already at the destination with the right size
is read back and checked piece by piece, and kept if intact, so a rerun moves
only what was missing (or damaged) across the slow link. ``CopyStats`` counts
both, so callers can see it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from objckpt.core.checksum import crc32c
from objckpt.core.format import MANIFEST_KEY, BlobEntry, Manifest, parse_manifest
from objckpt.errors import CheckpointExistsError, IntegrityError, ObjectExistsError, StoreError
from objckpt.options import Options
from objckpt.progress import ProgressArg, human_bytes, reporting
from objckpt.tools.verify import READ_CHUNK, check_blob, check_pieces, pieces_by_blob, read_blob
from objckpt.transfer import runtime
from objckpt.transfer.engine import TransferEngine, TransferStats, opened_store
from objckpt.transfer.manifest_io import read_checkpoint

log = logging.getLogger("objckpt")


@dataclass
class CopyStats:
    """The figures of one copy.

    Attributes:
        src, dst: the two checkpoints (credentials stripped).
        blobs, bytes_total: blobs in the checkpoint and their total size.
        blobs_copied, bytes_copied: blobs read from the source and written to the destination.
        blobs_skipped, bytes_skipped: blobs already at the destination, read back and found intact.
        bytes_read: bytes read from the source store (what crosses the link, what egress is billed on).
        bytes_written: bytes written to the destination, the manifest included.
        bytes_read_dst: bytes read back from the destination to check blobs already there.
        requests, retries: store requests on both sides, and how many were retries.
        seconds: wall time.
    """

    src: str
    dst: str
    blobs: int = 0
    bytes_total: int = 0
    blobs_copied: int = 0
    bytes_copied: int = 0
    blobs_skipped: int = 0
    bytes_skipped: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_read_dst: int = 0
    requests: int = 0
    retries: int = 0
    seconds: float = 0.0

    @property
    def gib_per_s(self) -> float:
        """Bytes copied per second, in GiB/s."""
        return self.bytes_copied / max(self.seconds, 1e-9) / 2**30

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gib_per_s": self.gib_per_s}

    def summary(self) -> str:
        return (
            f"copied {self.src} -> {self.dst}: {human_bytes(self.bytes_copied)} in {self.blobs_copied} blobs"
            f" ({self.blobs_skipped} already there and verified, {human_bytes(self.bytes_skipped)}),"
            f" {self.requests} requests, {self.retries} retries, {self.seconds:.2f} s, {self.gib_per_s:.3f} GiB/s,"
            f" {self.bytes_read} bytes read from the source"
        )


def copy(
    src_url: str,
    dst_url: str,
    *,
    src_storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    verify_existing: bool = True,
    progress: ProgressArg = False,
) -> CopyStats:
    """Copy the committed checkpoint at ``src_url`` to ``dst_url``.

    Args:
        src_url, dst_url: any two store URLs (``s3://``, ``gs://``, a local path...).
        src_storage_options, dst_storage_options: passed to each store.
        options: tuning: ``max_concurrency`` (requests in flight per side),
            ``memory_budget`` (bytes of blobs held at once), timeouts, retries.
        verify_existing: check blobs already at the destination before keeping
            them (False trusts any blob of the right size).
        progress: ``True`` draws a progress bar on stderr when it is a terminal
            (tqdm); a callable is called with a :class:`objckpt.Progress` at most
            every 0.1 s and once more at the end, on objckpt's I/O thread: it must
            be quick, and an exception it raises is logged once, never failing
            the copy. ``False``/``None``: nothing.

    Returns:
        The figures of the copy (:class:`CopyStats`).

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``src_url``.
        CheckpointExistsError: ``dst_url`` already holds a committed checkpoint (left intact).
        IntegrityError: a source blob is damaged (nothing is committed).
    """
    options = options or Options()
    src_stats, dst_stats = TransferStats(), TransferStats()
    with (
        opened_store(src_url, src_storage_options, options, src_stats) as src,
        opened_store(dst_url, dst_storage_options, options, dst_stats) as dst,
    ):
        return _copy_stores(src, dst, options, src_stats, dst_stats, verify_existing, progress)


def _copy_stores(
    src: Any,
    dst: Any,
    options: Options,
    src_stats: TransferStats,
    dst_stats: TransferStats,
    verify_existing: bool,
    progress: ProgressArg,
) -> CopyStats:
    """:func:`copy` between open stores (each closed by the caller)."""
    started = time.perf_counter()
    manifest = runtime.run_sync(read_checkpoint(src, size_limit=options.manifest_size_limit))
    stats = CopyStats(src.url, dst.url, blobs=len(manifest.blobs), bytes_total=sum(b.size for b in manifest.blobs))

    def done() -> int:  # half for the read, half for the write; checked blobs count whole
        moved = (src_stats.bytes_read + dst_stats.bytes_written) // 2 + dst_stats.bytes_read
        return min(moved, stats.bytes_total)

    try:
        with reporting(progress, "cp", dst.url, stats.bytes_total, done, src_stats, dst_stats):
            runtime.run_sync(_copy(src, dst, manifest, options, stats, src_stats, dst_stats, verify_existing))
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
    src: Any,
    dst: Any,
    manifest: Manifest,
    options: Options,
    stats: CopyStats,
    src_stats: TransferStats,
    dst_stats: TransferStats,
    verify_existing: bool,
) -> None:
    if not dst.supports_create:
        raise StoreError(f"{dst.url} cannot create-if-absent atomically, so a copy there could not commit safely")
    await _refuse_committed(dst, manifest, options)

    def engine(store: Any, counters: TransferStats) -> TransferEngine:
        return TransferEngine.from_options(store.inner, options, counters)

    source, target = engine(src, src_stats), engine(dst, dst_stats)
    present = {o.key: o.size for o in await dst.list()}
    by_blob = pieces_by_blob(manifest)
    chunk = min(READ_CHUNK, options.copied_read_limit(streamed=False))
    reads = options.retry.checksum_reads

    async def one(blob: BlobEntry) -> None:
        pieces = by_blob.get(blob.key, [])
        if present.get(blob.key) == blob.size:
            if not verify_existing:
                _count_skipped(stats, blob)
                return
            problems = await check_blob(target, blob, pieces, blob.size, chunk=chunk)  # a miss costs a copy
            if not problems:
                _count_skipped(stats, blob)
                return
            log.info("objckpt cp: replacing %s/%s: %s", dst.url, blob.key, problems[0])
        for attempt in range(1, reads + 1):  # a mismatch is read again: bits flip in flight too
            data = await read_blob(source, blob.key, blob.size, chunk=chunk)
            if len(data) != blob.size:
                raise IntegrityError(
                    f"short blob {src.url}/{blob.key}: {len(data)} bytes, the manifest says {blob.size}"
                )
            problems = await asyncio.to_thread(check_pieces, src.url, blob.key, data, pieces)
            if not problems:
                break
            if attempt == reads:
                more = f" (and {len(problems) - 1} more in this blob)" if len(problems) > 1 else ""
                persisted = f" (persisted over {reads} reads)" if reads > 1 else ""
                raise IntegrityError(f"{problems[0]}{more}{persisted}; nothing was committed at {dst.url}")
            src_stats.add(checksum_retries=1)
        await target.put(blob.key, data if isinstance(data, bytes) else memoryview(data))
        stats.blobs_copied += 1
        stats.bytes_copied += blob.size

    await source.for_each(manifest.blobs, one, window_bytes=options.memory_budget, size=lambda b: max(b.size, 1))
    await _copy_indexes(source, target, src, manifest)
    await _commit(target, dst, manifest, options)


async def _copy_indexes(source: TransferEngine, target: TransferEngine, src: Any, manifest: Manifest) -> None:
    """Format version 2: copy each process's index object as is (the root holds its crc32c)."""
    for ref in manifest.indexes:
        data = await source.get(ref.key)
        if len(data) != ref.size or crc32c(data) != ref.crc32c:
            raise IntegrityError(f"index object {src.url}/{ref.key} does not match the manifest; nothing was committed")
        await target.put(ref.key, data)


def _count_skipped(stats: CopyStats, blob: BlobEntry) -> None:
    stats.blobs_skipped += 1
    stats.bytes_skipped += blob.size


async def _existing_save_id(dst: Any, options: Options) -> str | None:
    """The save id of the checkpoint committed at ``dst``; None when there is none."""
    try:
        data = await dst.get(MANIFEST_KEY)
    except FileNotFoundError:
        return None
    try:
        return parse_manifest(data, size_limit=options.manifest_size_limit).save_id
    except Exception:
        return "(unreadable manifest)"


async def _refuse_committed(dst: Any, manifest: Manifest, options: Options) -> None:
    save_id = await _existing_save_id(dst, options)
    if save_id is None:
        return
    same = " (the same checkpoint: it was copied already)" if save_id == manifest.save_id else ""
    raise CheckpointExistsError(f"a committed checkpoint already exists at {dst.url}{same}; nothing was copied")


async def _commit(target: TransferEngine, dst: Any, manifest: Manifest, options: Options) -> None:
    """Write the manifest last, create-if-absent; a lost reply to our own write is success."""
    try:
        await target.put(MANIFEST_KEY, manifest.to_json(), mode="create")
    except ObjectExistsError:
        if await _existing_save_id(dst, options) != manifest.save_id:
            raise CheckpointExistsError(
                f"a committed checkpoint appeared at {dst.url} during the copy; it was left intact"
            ) from None
