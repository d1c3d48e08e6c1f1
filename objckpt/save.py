"""save and save_async: snapshot → plan → upload → commit.

The caller's thread does only the blocking phase (:mod:`objckpt.upload`): it
copies every owned piece off the devices into staging buffers that objckpt
owns, blob by blob, under a byte budget (when the model is larger than the
budget it streams: a buffer is reused once its blob is uploaded); a synchronous
save to a store that takes a body of parts sends contiguous host shards in place
instead. Uploads and the commit run on the I/O loop.

Commit: every process publishes its piece index through the coordinator
(JAX's key-value store, never a bucket listing), the primary merges them and
writes ``manifest.json`` with create-if-absent, and every process learns the
outcome before its save returns. No manifest, no checkpoint: a crash at any
moment leaves at most orphaned blobs, which ``gc`` removes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import json
import logging
import time
import uuid
from collections import defaultdict
from typing import Any

from objckpt import _runtime
from objckpt.errors import CheckpointExistsError, ObjectExistsError, StoreError
from objckpt.format import MANIFEST_KEY, BlobEntry, LeafEntry, Manifest, Piece, parse_manifest
from objckpt.leaves import classify
from objckpt.multihost import Coordinator, get_coordinator, operation_tag
from objckpt.options import Options
from objckpt.plan import blob_key, plan_blobs
from objckpt.progress import closing, progress_bar
from objckpt.storage import Store
from objckpt.transfer import TransferEngine, TransferStats, open_store
from objckpt.tree import flatten
from objckpt.upload import PieceRecord, snapshot_and_upload

log = logging.getLogger("objckpt")


class SaveHandle:
    """A save whose upload and commit may still be running.

    ``result()`` waits and re-raises any error; ``done()`` polls. The figures
    are this process's own.
    """

    def __init__(self, future: concurrent.futures.Future[None], stats: TransferStats, seconds_blocked: float, url: str):
        self._future = future
        self.stats = stats
        self.seconds_blocked = seconds_blocked
        self.url = url

    def result(self, timeout: float | None = None) -> None:
        self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    @property
    def bytes_written(self) -> int:
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
    progress: bool = False,
) -> TransferStats:
    """Save ``tree`` to ``url`` and return once the checkpoint is committed.

    Args:
        url: ``s3://bucket/prefix``, ``gs://...``, ``file:///abs/path``, an absolute
            path, ``memory://...`` or any URL of a registered store.
        tree: any pytree of jax.Arrays (any sharding), numpy arrays, int, float,
            bool, str, bytes and None.
        storage_options: passed to the store (fsspec-style: ``key``, ``secret``,
            ``endpoint_url``, ``client_kwargs``, ``token``, ...).
        options: tuning (:class:`objckpt.Options`).
        metadata: JSON-serialisable user metadata stored in the manifest.
        progress: draw a progress bar on stderr when it is a terminal.

    Returns:
        This process's figures (bytes, objects, requests, retries, seconds).

    Raises:
        CheckpointExistsError: ``url`` already holds a committed checkpoint (left intact).
    """
    # The caller waits for the uploads anyway: let them start with the first
    # blob copied instead of after the last (save_async holds them back).
    handle = _start(url, tree, storage_options, options, metadata, progress, hold_uploads=False)
    handle.result()
    return handle.stats


def save_async(
    url: str,
    tree: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    metadata: dict[str, Any] | None = None,
    progress: bool = False,
) -> SaveHandle:
    """Copy ``tree`` off the devices, then upload and commit in the background.

    Returns after the blocking phase: the caller may update, donate or delete
    its arrays at once. Takes the same arguments as :func:`save`.
    """
    return _start(url, tree, storage_options, options, metadata, progress, hold_uploads=True)


def _start(
    url: str,
    tree: Any,
    storage_options: dict[str, Any] | None,
    options: Options | None,
    metadata: dict[str, Any] | None,
    progress: bool,
    *,
    hold_uploads: bool,
) -> SaveHandle:
    """Snapshot ``tree`` and start its uploads and commit; ``hold_uploads`` as in :func:`objckpt.upload.snapshot_and_upload`."""
    entered = time.perf_counter()
    options = options or Options()
    stats = TransferStats()
    store = open_store(url, storage_options, options, stats)
    if not store.supports_create:
        raise StoreError(
            f"{store.url}: this store cannot create objects only-if-absent, so a commit could overwrite"
            " another writer's checkpoint; use a store that supports it (S3, GCS, local disk, memory)"
        )
    coordinator = get_coordinator()
    tag = operation_tag("save", store.url)
    metadata = dict(metadata or {})
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"save metadata must be JSON-serialisable: {e}") from None
    if _runtime.run_sync(_exists(store)):  # the retrying store bounds it
        raise CheckpointExistsError(f"a committed checkpoint already exists at {store.url}")

    leaves, skeleton = flatten(tree)
    entries: list[LeafEntry] = []
    owned = []
    for i, leaf in enumerate(leaves):
        entry, pieces = classify(i, leaf, is_primary=coordinator.is_primary, split_above=options.split_replicas_above)
        entries.append(entry)
        owned.extend(pieces)
    save_id = uuid.uuid4().hex
    blobs = plan_blobs(
        owned,
        blob_size=options.blob_size,
        key=lambda seq: blob_key(save_id, coordinator.process_index, seq),
    )

    engine = _runtime.run_sync(_make_engine(store.inner, options, stats))
    started = time.perf_counter()
    bar = progress_bar("save", sum(b.size for b in blobs), lambda: stats.bytes_written, enabled=progress)
    try:
        uploads = snapshot_and_upload(blobs, engine, options, hold_uploads=hold_uploads)
    except BaseException:
        bar.close()
        raise
    seconds_blocked = time.perf_counter() - entered
    commit = _Commit(
        store=store,
        engine=engine,
        coordinator=coordinator,
        tag=tag,
        save_id=save_id,
        skeleton=skeleton,
        entries=entries,
        metadata=metadata,
        options=options,
    )
    future = _runtime.submit(closing(commit.run(uploads, started), bar))
    return SaveHandle(future, stats, seconds_blocked, store.url)


async def _exists(store: Store) -> bool:
    try:
        await store.head(MANIFEST_KEY)
    except FileNotFoundError:
        return False
    return True


async def _make_engine(store: Store, options: Options, stats: TransferStats) -> TransferEngine:
    # Built on the I/O loop so its semaphore belongs to that loop.
    return TransferEngine.from_options(store, options, stats)


class _Commit:
    """The background half of a save: wait for uploads, exchange indexes, commit."""

    def __init__(
        self,
        *,
        store: Store,
        engine: TransferEngine,
        coordinator: Coordinator,
        tag: str,
        save_id: str,
        skeleton: dict[str, Any],
        entries: list[LeafEntry],
        metadata: dict[str, Any],
        options: Options,
    ) -> None:
        self.store = store
        self.engine = engine
        self.coordinator = coordinator
        self.tag = tag
        self.save_id = save_id
        self.skeleton = skeleton
        self.entries = entries
        self.metadata = metadata
        self.options = options

    async def run(self, uploads: list[concurrent.futures.Future[list[PieceRecord]]], started: float) -> None:
        local_error: BaseException | None = None
        records: list[PieceRecord] = []
        try:
            for result in await asyncio.gather(*(asyncio.wrap_future(f) for f in uploads)):
                records.extend(result)
        except BaseException as e:  # report to peers before raising, so nobody waits for us
            local_error = e
        index = self._encode_index(records, local_error)
        timeout = self.options.barrier_timeout
        gathered = await asyncio.to_thread(self.coordinator.all_gather, f"{self.tag}/index", index, timeout=timeout)
        outcome: bytes | None = None
        if self.coordinator.is_primary:
            outcome = await self._commit_or_abort(gathered)
        outcome = await asyncio.to_thread(self.coordinator.broadcast, f"{self.tag}/outcome", outcome, timeout=timeout)
        if local_error is not None:
            raise local_error
        status = json.loads(outcome)
        if status["status"] == "exists":
            await self._delete_own_blobs(records)
            raise CheckpointExistsError(f"a committed checkpoint already exists at {self.store.url}")
        if status["status"] != "committed":
            raise StoreError(f"save to {self.store.url} was not committed: {status['why']}")
        seconds = time.perf_counter() - started
        stats = self.engine.stats
        stats.seconds = seconds
        log.info(
            "objckpt saved %s: %d bytes in %d objects, %d requests, %d retries (%d throttled), %.2f s, %.3f GiB/s (this process)",
            self.store.url,
            stats.bytes_written,
            stats.objects_written,
            stats.requests,
            stats.retries,
            stats.throttled,
            seconds,
            stats.bytes_written / max(seconds, 1e-9) / 2**30,
        )

    def _encode_index(self, records: list[PieceRecord], error: BaseException | None) -> bytes:
        if error is not None:
            return json.dumps({"error": f"{type(error).__name__}: {error}"}).encode()
        pieces: dict[str, list[Any]] = defaultdict(list)
        blobs: dict[str, int] = {}
        for leaf, p in records:
            pieces[str(leaf)].append([list(p.start), list(p.stop), p.blob, p.offset, p.length, p.crc32c])
            blobs[p.blob] = max(blobs.get(p.blob, 0), p.offset + p.length)
        return json.dumps({"pieces": pieces, "blobs": blobs}).encode()

    async def _commit_or_abort(self, gathered: list[bytes]) -> bytes:
        docs = [json.loads(g) for g in gathered]
        errors = [f"process {i}: {d['error']}" for i, d in enumerate(docs) if "error" in d]
        if errors:
            return json.dumps({"status": "aborted", "why": "; ".join(errors)}).encode()
        manifest = self._manifest(docs)
        try:
            await self.engine.put(MANIFEST_KEY, manifest.to_json(), mode="create")
        except ObjectExistsError:
            if not await self._is_ours():
                return json.dumps({"status": "exists"}).encode()
        except BaseException as e:
            return json.dumps({"status": "aborted", "why": f"manifest write failed: {e}"}).encode()
        return json.dumps({"status": "committed"}).encode()

    async def _is_ours(self) -> bool:
        """After "already exists": did our own earlier attempt land (its reply lost)?"""
        try:
            data = await self.engine.get(MANIFEST_KEY)
            return parse_manifest(data, size_limit=self.options.manifest_size_limit).save_id == self.save_id
        except Exception:
            return False

    def _manifest(self, docs: list[dict[str, Any]]) -> Manifest:
        pieces: dict[int, list[Piece]] = defaultdict(list)
        blobs: dict[str, int] = {}
        for doc in docs:
            blobs.update(doc["blobs"])
            for leaf, rows in doc["pieces"].items():
                pieces[int(leaf)].extend(Piece(tuple(a), tuple(b), k, o, n, c) for a, b, k, o, n, c in rows)
        leaves = tuple(
            LeafEntry(
                e.path,
                e.kind,
                e.dtype,
                e.shape,
                tuple(sorted(pieces.get(i, ()), key=lambda p: p.start)),
                e.value,
                e.sharding,
            )
            for i, e in enumerate(self.entries)
        )
        return Manifest(
            save_id=self.save_id,
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
            tree=self.skeleton,
            leaves=leaves,
            blobs=tuple(BlobEntry(k, s) for k, s in sorted(blobs.items())),
            num_processes=self.coordinator.process_count,
            metadata=self.metadata,
        )

    async def _delete_own_blobs(self, records: list[PieceRecord]) -> None:
        """Best effort: blobs of a save that lost the commit race are never referenced."""
        for key in {p.blob for _, p in records}:
            try:
                await self.store.delete(key)
            except Exception:  # gc removes whatever remains
                pass
