"""verify: read every blob of a checkpoint and check every piece's crc32c (and SHA-256, if saved).

Unlike a restore, which stops at the first bad byte, verify keeps going and
reports *every* problem it finds: a blob that is missing, shorter (or longer)
than the manifest says, a piece whose checksum does not match (naming the
leaf, the blob and the byte range), a blob the store will not return. Blobs
are read whole, with parallel ranged reads through the transfer engine, under
the same byte window as a restore.

The blob reader and the piece check live here because ``objckpt cp`` uses them
too: a copy checks each blob on the way, and checks blobs already at the
destination before it trusts them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from objckpt.core.checksum import damage
from objckpt.core.codecs import decode
from objckpt.core.dtypes import dtype_from_name
from objckpt.core.format import BlobEntry, Manifest, Piece
from objckpt.core.format.bases import is_ref
from objckpt.core.format.v2 import require_digest
from objckpt.errors import CheckpointNotFoundError, ChecksumsUnavailableError, FormatError, StoreError
from objckpt.layouts.base import VerifyProblem, VerifyReport
from objckpt.layouts.native import NativeCheckpoint
from objckpt.layouts.registry import open_checkpoint
from objckpt.options import MiB, Options
from objckpt.progress import ProgressArg, reporting
from objckpt.restoring.aligned_reads import read_parts
from objckpt.roots.hints import explained
from objckpt.tools.blob_pieces import PieceRef, pieces_by_blob, pieces_up_to
from objckpt.tools.verify_stored import stored_checksums, verify_stored
from objckpt.transfer import dask_jobs, runtime
from objckpt.transfer.engine import TransferEngine
from objckpt.transfer.handle import Handle, opened
from objckpt.transfer.stats import TransferStats

log = logging.getLogger("objckpt")

#: Largest single ranged GET when reading a whole blob: a 32 MiB blob is read
#: as 4 concurrent requests, which is what keeps a few large blobs fast across
#: a high-latency link (one connection carries ~100 MB/s at best).
READ_CHUNK = 8 * MiB

#: ``VerifyReport.checks`` of ``verify(read_data=False)``.
STORE_CHECKS = "each blob's size and the store's crc32c; no blob read"

__all__ = [
    "READ_CHUNK",
    "VerifyProblem",
    "VerifyReport",
    "check_blob",
    "check_pieces",
    "pieces_by_blob",
    "read_blob",
    "recheck",
    "verify",
]


def verify(
    url: str,
    *,
    read_data: bool = True,
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    progress: ProgressArg = False,
    client: Any = None,
    blobs: Collection[str] | None = None,
) -> VerifyReport:
    """Read every blob of the checkpoint at ``url`` and check every piece's crc32c.

    Args:
        url: the checkpoint.
        read_data: ``False`` reads no blob: each one's size and the CRC-32C its store keeps
            (S3: sent by the save; GCS: computed by the store) are compared with what the
            manifest and index objects record, the pieces' CRCs combined
            (:mod:`objckpt.tools.verify_stored`). Every missing, resized or changed blob is
            reported by name, and every blob whose store keeps no CRC-32C (``unchecked``).
            Only the manifest and index objects are read.
        storage_options: passed to the store.
        options: tuning (concurrency, byte window, timeouts, retries); with
            ``digest`` set, a checkpoint saved without digests is refused.
        progress: ``True`` draws a progress bar on stderr when it is a terminal
            (tqdm); a callable is called with a :class:`objckpt.Progress` at most
            every 0.1 s and once more at the end, on objckpt's I/O thread: it must
            be quick, and an exception it raises is logged once, never failing
            the verification. ``False``/``None``: nothing.
        client: a ``distributed.Client``: the blobs are read by tasks on its Dask cluster, a few
            per worker, split by bytes (:mod:`objckpt.transfer.dask_jobs`); the report is the same.
        blobs: read only these blobs (a task of a verify on Dask); the others are not reported on.

    Another layout's checkpoint (an Orbax item, or a step of Orbax's ``CheckpointManager``)
    is verified by its reader as far as it can be (Orbax's: every chunk of every array
    read and decoded; Orbax stores no checksums): ``report.checks`` says what was checked.

    Returns:
        A :class:`VerifyReport` listing every problem (``report.ok`` when none).

    Raises:
        CheckpointNotFoundError: no committed checkpoint (objckpt's or Orbax's) at ``url``.
        FormatError: the manifest itself is malformed (nothing else can be checked),
            an index object does not match the root's record of it, or the
            checkpoint has no digests and ``options.digest`` asks for them.
        ChecksumsUnavailableError: ``read_data=False`` on a store that keeps no checksum of
            its own (``file://``, ``memory://``), or on another layout's checkpoint.
    """
    options = options or Options()
    stats = TransferStats()
    started = time.perf_counter()
    with opened(url, storage_options, options, stats) as handle:
        store = handle.store
        kept = None if read_data else stored_checksums(handle)  # before any read: a store that keeps none
        try:
            checkpoint = open_checkpoint(store, options=options, storage_options=storage_options)
        except CheckpointNotFoundError as e:  # a manager root, a step its root lacks: said so
            raise explained(e, store, storage_options, options) from None
        if not isinstance(checkpoint, NativeCheckpoint):  # another layout (Orbax): its reader checks what it can
            if kept is not None:
                raise ChecksumsUnavailableError(
                    f"verify {store.url} without reading data: the checkpoint there is another layout's"
                    f" ({type(checkpoint).__name__}), which records no checksums to compare with the store's;"
                    " read every byte instead (without --no-read)"
                )
            report = checkpoint.verify(options, stats, progress)
            log.info("objckpt %s", report.summary())
            return report
        manifest = runtime.run_sync(checkpoint.read_whole())  # which checks the whole tiling
        require_digest(manifest, options.digest, store.url)
        if kept is not None:
            problems = runtime.run_sync(verify_stored(handle, kept, manifest))
        else:
            total, base = sum(b.size for b in manifest.blobs), stats.bytes_read
            with reporting(progress, "verify", store.url, total, lambda: stats.bytes_read - base, stats):
                if client is None:
                    problems = runtime.run_sync(_verify(handle, manifest, blobs))
                else:
                    problems = _on_dask(client, store.url, storage_options, options, manifest, stats)
    report = VerifyReport(
        url=store.url,
        problems=problems,
        blobs=len(manifest.blobs),
        pieces=sum(len(leaf.pieces) for leaf in manifest.leaves),
        bytes_read=stats.bytes_read,
        requests=stats.requests,
        retries=stats.retries,
        checksum_retries=stats.checksum_retries,
        seconds=time.perf_counter() - started,
        checks="" if read_data else STORE_CHECKS,
    )
    log.info("objckpt %s", report.summary())
    return report


def _on_dask(client: Any, url: str, so: Any, options: Options, manifest: Manifest, stats: TransferStats) -> Any:
    """The blobs verified by tasks on ``client``'s cluster: the problems merged, their figures added to ``stats``."""
    blobs, kw = [(b.key, b.size) for b in manifest.blobs], {"url": url, "storage_options": so, "options": options}
    reports = dask_jobs.fan_out(client, f"verify {url} {manifest.save_id}", _verify_task, blobs, **kw)
    for r in reports:
        stats.add(bytes_read=r.bytes_read, requests=r.requests, retries=r.retries, checksum_retries=r.checksum_retries)
    return sorted((p for r in reports for p in r.problems), key=lambda p: (p.blob, p.start or 0, p.kind))


def _verify_task(blobs: list[str], url: str, storage_options: Any, options: Options) -> VerifyReport:
    return verify(url, storage_options=storage_options, options=options, blobs=set(blobs))


async def _verify(handle: Handle, manifest: Manifest, only: Collection[str] | None = None) -> list[VerifyProblem]:
    engine, options = handle.engine, handle.options
    present = {o.key: o.size for o in await handle.store.list()}
    by_blob = pieces_by_blob(manifest)
    chunk = min(READ_CHUNK, options.copied_read_limit(streamed=False))
    problems: list[VerifyProblem] = []
    coded = coded_leaves(manifest)

    reads = options.retry.checksum_reads

    async def one(blob: BlobEntry) -> None:
        listed = await _base_size(engine, blob.key) if is_ref(blob.key) else present.get(blob.key)
        pieces, *cut = pieces_up_to(by_blob, blob.key, min(blob.size, listed or 0))  # none past the listed end
        problems.extend(await check_blob(engine, blob, pieces, listed, chunk=chunk, reads=reads, coded=coded, cut=cut))

    window = min(options.read_window, options.memory_budget)
    todo = [b for b in manifest.blobs if only is None or b.key in only]
    await engine.for_each(todo, one, window_bytes=window, size=lambda b: max(b.size, 1))
    problems.sort(key=lambda p: (p.blob, p.start or 0, p.kind))
    return problems


async def _base_size(engine: TransferEngine, key: str) -> int | None:
    """The size of a base's blob an incremental checkpoint references (a HEAD: it is not under
    the checkpoint's prefix, so its listing does not show it); None when it is missing."""
    try:
        return (await engine.head(key)).size
    except FileNotFoundError:
        return None


#: Sub-range GETs of one blob in flight at once (``READ_CHUNK`` each).
READ_PARALLEL = 4


async def read_blob(engine: TransferEngine, key: str, size: int, *, chunk: int) -> memoryview | bytearray:
    """The first ``size`` bytes of blob ``key`` by concurrent ranged reads
    (:func:`~objckpt.restoring.aligned_reads.read_parts`): fewer only if the object is shorter.
    Raises what the store raises (``ObjectNotFoundError`` for a missing blob)."""
    if size <= chunk:
        return await engine.get_range(key, 0, size)
    return bytearray().join(await read_parts(engine, key, 0, size, chunk, parallel=READ_PARALLEL))


def check_pieces(
    url: str, key: str, data: bytes | bytearray | memoryview, pieces: list[PieceRef]
) -> list[VerifyProblem]:
    """Checksum every piece that lies inside ``data`` (the blob's bytes)."""
    problems = []
    view = memoryview(data)
    for path, p in pieces:
        end = p.offset + p.length
        if end > len(view):
            continue  # reported once per blob as "short"
        wrong = damage(view[p.offset : end], p.crc32c, p.sha256)
        if wrong is not None:
            message = f"{wrong} mismatch in leaf {path}: blob {url}/{key} bytes [{p.offset}, {end})"
            problems.append(VerifyProblem(wrong, key, message, leaf=path, start=p.offset, end=end))
    return problems


async def check_blob(
    engine: TransferEngine,
    blob: BlobEntry,
    pieces: list[PieceRef],
    listed_size: int | None,
    *,
    chunk: int,
    reads: int = 1,
    coded: Mapping[str, int] | None = None,
    cut: Sequence[Any] = (0, ()),
) -> list[VerifyProblem]:
    """Read one blob and return everything wrong with it (nothing: it is intact).

    The manifest's size is checked against the store's before anything is read,
    and no more than the smaller of the two is read: a blob declared larger than
    it is costs the bytes it has, not the bytes it claims.

    Args:
        listed_size: the size a listing of the store showed, or None when the
            listing did not show the blob (it is then reported missing, unread).
        reads: reads of a piece whose checksum does not match, the first
            included, before it is reported (:func:`recheck`).
        coded: the compressed leaves (path → itemsize, :func:`coded_leaves`): each of their
            pieces whose checksum matches is decoded too (:func:`check_decoding`).
        cut: the count and leaves of the blob's pieces left out of ``pieces`` (past its listed end).
    """
    url = engine.store.url
    leaves = sorted({path for path, _ in pieces} | set(cut[1]))
    what = f"{len(pieces) + cut[0]} piece(s) of {', '.join(leaves) if leaves else 'no leaf'}"
    missing = [VerifyProblem("missing", blob.key, f"missing blob {url}/{blob.key} ({blob.size} bytes; {what})")]
    if listed_size is None:
        return missing
    try:
        data = await read_blob(engine, blob.key, min(blob.size, listed_size), chunk=chunk)
    except FileNotFoundError:
        return missing
    except StoreError as e:
        return [VerifyProblem("unreadable", blob.key, f"unreadable blob {url}/{blob.key}: {e}")]
    problems = []
    if len(data) < blob.size:
        short = [p for p in pieces if p[1].offset + p[1].length > len(data)]
        cut_leaves = ", ".join(sorted({path for path, _ in short} | set(cut[1])))
        message = (
            f"short blob {url}/{blob.key}: {len(data)} bytes, the manifest says {blob.size}"
            f" ({len(short) + cut[0]} piece(s) of {cut_leaves or 'no leaf'} cut off)"
        )
        problems.append(VerifyProblem("short", blob.key, message, start=len(data), end=blob.size))
    elif listed_size > blob.size:
        message = f"blob {url}/{blob.key} is {listed_size} bytes, the manifest says {blob.size}"
        problems.append(VerifyProblem("size", blob.key, message, start=blob.size, end=listed_size))
    mismatches = await asyncio.to_thread(check_pieces, url, blob.key, data, pieces)
    if coded:
        damaged = {m.start for m in mismatches}
        intact = [p for p in pieces if p[0] in coded and p[1].offset not in damaged]
        problems.extend(await asyncio.to_thread(check_decoding, url, blob.key, data, intact, coded))
    del data
    problems.extend(await recheck(engine, blob.key, mismatches, pieces, reads=reads))
    return problems


def coded_leaves(manifest: Manifest) -> dict[str, int]:
    """The compressed leaves of ``manifest`` (format version 4), path → itemsize."""
    coded = {leaf.path: dtype_from_name(leaf.dtype) for leaf in manifest.leaves if leaf.codec and leaf.dtype}
    return {path: dtype.itemsize for path, dtype in coded.items() if dtype is not None}


def check_decoding(
    url: str, key: str, data: bytes | bytearray | memoryview, pieces: list[PieceRef], coded: Mapping[str, int]
) -> list[VerifyProblem]:
    """Decode each compressed piece inside ``data`` (the blob's bytes; checksums already
    matched): one that does not give exactly its box's bytes is a ``codec`` problem. Reading
    it again would give the same bytes, so it is not read again."""
    problems = []
    view = memoryview(data)
    for path, p in pieces:
        end = p.offset + p.length
        if end > len(view):
            continue  # reported once per blob as "short"
        itemsize = coded[path]
        where = f"leaf {path}: blob {url}/{key} bytes [{p.offset}, {end})"
        try:
            decode(view[p.offset : end], itemsize, math.prod(p.shape) * itemsize, where)
        except FormatError as e:
            problems.append(VerifyProblem("codec", key, str(e), leaf=path, start=p.offset, end=end))
    return problems


async def recheck(
    engine: TransferEngine, key: str, mismatches: list[VerifyProblem], pieces: list[PieceRef], *, reads: int
) -> list[VerifyProblem]:
    """The mismatches that persist when their pieces are read again, up to ``reads`` reads in all.

    A bit flipped in flight fails one read, not the next, so only a mismatch
    every read sees is corruption at rest; its message says over how many
    reads. Each piece read again counts in ``engine.stats.checksum_retries``.
    """
    by_range = {(p.offset, p.offset + p.length): p for _, p in pieces}
    persisted = []
    for problem in mismatches:
        assert problem.start is not None and problem.end is not None
        if await _cured(engine, key, by_range[(problem.start, problem.end)], reads - 1):
            continue
        if reads > 1:
            problem = replace(problem, message=f"{problem.message} (persisted over {reads} reads)")
        persisted.append(problem)
    return persisted


async def _cured(engine: TransferEngine, key: str, piece: Piece, rereads: int) -> bool:
    """Whether one of up to ``rereads`` more reads of a mismatched piece matches its crc32c (and SHA-256)
    (a re-read the store refuses leaves the mismatch standing)."""
    for _ in range(rereads):
        engine.stats.add(checksum_retries=1)
        try:
            data = await engine.get_range(key, piece.offset, piece.offset + piece.length)
        except StoreError:
            return False
        if len(data) == piece.length and await asyncio.to_thread(damage, data, piece.crc32c, piece.sha256) is None:
            return True
    return False
