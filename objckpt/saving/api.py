"""save and save_async: snapshot → plan → upload → commit.

The caller's thread does only the blocking phase (:mod:`objckpt.saving.upload`): it
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

Deleters keep off a save in flight: each process writes a live-save marker
before its first blob and deletes it once the outcome is known
(:mod:`objckpt.saving.live_markers`), and right before it writes the manifest the primary
lists the prefix and refuses to commit if any blob the manifest lists is
missing or of the wrong size (deleted by ``gc``, ``rm`` or retention anyway).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import json
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable
from typing import Any, TypeVar

from objckpt.core.format import MANIFEST_KEY, BlobEntry, LeafEntry, Manifest, Piece, parse_manifest
from objckpt.core.metadata import to_json_value
from objckpt.core.plan import blob_key, plan_blobs
from objckpt.core.tree import flatten
from objckpt.errors import CheckpointExistsError, IntegrityError, ObjectExistsError, ObjectNotFoundError, StoreError
from objckpt.multihost import Coordinator, get_coordinator, operation_tag
from objckpt.options import Options
from objckpt.progress import ProgressArg, closing, finish_from_caller, start
from objckpt.saving.classify import classify
from objckpt.saving.live_markers import LiveMarker, marker_key
from objckpt.saving.upload import PieceRecord, snapshot_and_upload
from objckpt.storage import Store
from objckpt.transfer import runtime
from objckpt.transfer.buffers import tune_malloc
from objckpt.transfer.engine import RetryingStore, TransferEngine, TransferStats, close_store, open_store

T = TypeVar("T")
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
    progress: ProgressArg = False,
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
        metadata: user metadata stored in the manifest: JSON values, numpy and jax
            scalars and 0-d arrays (stored as Python numbers); NaN and infinities
            are stored as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``
            (``float()`` reads them back).
        progress: ``True`` draws a progress bar on stderr when it is a terminal
            (tqdm); a callable is called with a :class:`objckpt.Progress` at most
            every 0.1 s and once more when the save ends (committed or failed),
            on objckpt's I/O thread: it must be quick, and an exception it raises
            is logged once, never failing the save. ``False``/``None``: nothing.

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
    progress: ProgressArg = False,
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
    progress: ProgressArg,
    *,
    hold_uploads: bool,
) -> SaveHandle:
    """Snapshot ``tree`` and start its uploads and commit; ``hold_uploads`` as in :func:`objckpt.saving.upload.snapshot_and_upload`."""
    entered = time.perf_counter()
    options = options or Options()
    if options.tune_malloc:
        tune_malloc()
    stats = TransferStats()
    store = open_store(url, storage_options, options, stats)
    try:
        return _begin(store, tree, options, stats, metadata, progress, entered, hold_uploads=hold_uploads)
    except BaseException:
        close_store(store)
        raise


def _begin(
    store: RetryingStore,
    tree: Any,
    options: Options,
    stats: TransferStats,
    metadata: dict[str, Any] | None,
    progress: ProgressArg,
    entered: float,
    *,
    hold_uploads: bool,
) -> SaveHandle:
    """:func:`_start` on an open store, which the commit closes once it ends (``entered``: when the call began)."""
    if not store.supports_create:
        raise StoreError(
            f"{store.url}: this store cannot create objects only-if-absent, so a commit could overwrite"
            " another writer's checkpoint; use a store that supports it (S3, GCS, local disk, memory)"
        )
    coordinator = get_coordinator()
    tag = operation_tag("save", store.url)
    metadata = to_json_value(dict(metadata or {}), "metadata")
    if runtime.run_sync(_exists(store)):  # the retrying store bounds it
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

    engine = runtime.run_sync(_make_engine(store.inner, options, stats))
    marker = LiveMarker(store, marker_key(save_id, coordinator.process_index), lease=options.live_marker_lease)
    runtime.run_sync(marker.begin())  # before the first blob, so deleters see it first
    started = time.perf_counter()
    reporter = None
    try:
        total = sum(b.size for b in blobs)
        reporter = start(progress, "save", store.url, total, lambda: stats.bytes_written, stats)
        uploads = snapshot_and_upload(blobs, engine, options, hold_uploads=hold_uploads)
    except BaseException:
        finish_from_caller(reporter, complete=False)
        runtime.run_sync(marker.end())
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
        marker=marker,
    )
    future = runtime.submit(_then_close(closing(commit.run(uploads, started), reporter), store))
    _track_in_flight(store.url, future)
    return SaveHandle(future, stats, seconds_blocked, store.url)


async def _then_close(run: Awaitable[T], store: Store) -> T:
    """Await ``run``, then close ``store``, however ``run`` ends."""
    try:
        return await run
    finally:
        await store.close()


# Saves of this process whose commit has not ended, by URL (see save_in_flight).
_in_flight: dict[str, int] = {}
_in_flight_lock = threading.Lock()


def _url_key(url: str) -> str:
    """One spelling per location: ``file:///a/b/`` and ``/a/b`` are the same checkpoint."""
    url = url.rstrip("/") or url
    return url.removeprefix("file://") if url.startswith("file:///") else url


def _track_in_flight(url: str, future: concurrent.futures.Future[None]) -> None:
    """Count a save to ``url`` as running until ``future`` ends (however it ends)."""
    key = _url_key(url)
    with _in_flight_lock:
        _in_flight[key] = _in_flight.get(key, 0) + 1

    def ended(_: concurrent.futures.Future[None]) -> None:
        with _in_flight_lock:
            left = _in_flight.pop(key, 1) - 1
            if left:
                _in_flight[key] = left

    future.add_done_callback(ended)


def save_in_flight(url: str) -> bool:
    """Whether a save to ``url`` started in this process has not committed (or failed) yet.

    Restore asks when it finds no manifest, so that reading back a
    ``save_async`` before its ``result()`` says so instead of only "no checkpoint".
    """
    with _in_flight_lock:
        return _url_key(url) in _in_flight


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
        marker: LiveMarker,
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
        self.marker = marker

    async def run(self, uploads: list[concurrent.futures.Future[list[PieceRecord]]], started: float) -> None:
        """Wait for the uploads, commit or abort, then delete this process's live-save marker."""
        try:
            await self._run(uploads, started)
        finally:
            await self.marker.end()

    async def _run(self, uploads: list[concurrent.futures.Future[list[PieceRecord]]], started: float) -> None:
        local_error: BaseException | None = None
        records: list[PieceRecord] = []
        try:
            for result in await asyncio.gather(*(asyncio.wrap_future(f) for f in uploads)):
                records.extend(result)
            if self.marker.lapsed():
                raise StoreError(f"save to {self.store.url} was not committed: {self.marker.lapse_error()}")
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
        if status["status"] == "missing":
            raise ObjectNotFoundError(f"save to {self.store.url} was not committed: {status['why']}")
        if status["status"] == "wrong_size":
            raise IntegrityError(f"save to {self.store.url} was not committed: {status['why']}")
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
        if self.marker.lapsed():
            return json.dumps({"status": "aborted", "why": self.marker.lapse_error()}).encode()
        try:
            problem = await self._check_blobs(manifest)
        except BaseException as e:
            return json.dumps({"status": "aborted", "why": f"listing the blobs before the commit failed: {e}"}).encode()
        if problem is not None:
            return json.dumps(problem).encode()
        try:
            await self.engine.put(MANIFEST_KEY, manifest.to_json(), mode="create")
        except ObjectExistsError:
            if not await self._is_ours():
                return json.dumps({"status": "exists"}).encode()
        except BaseException as e:
            return json.dumps({"status": "aborted", "why": f"manifest write failed: {e}"}).encode()
        return json.dumps({"status": "committed"}).encode()

    async def _check_blobs(self, manifest: Manifest) -> dict[str, str] | None:
        """One listing of the prefix: is every blob the manifest lists there, at its size?

        Returns the outcome to broadcast instead of committing, or None when all are.
        """
        present = {o.key: o.size for o in await self.store.list()}
        missing = [b.key for b in manifest.blobs if b.key not in present]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            why = (
                f"blob {missing[0]}{more} is missing (deleted while the save ran, by gc, rm or"
                " retention?); no manifest was written"
            )
            return {"status": "missing", "why": why}
        for b in manifest.blobs:
            if present[b.key] != b.size:
                why = f"blob {b.key} is {present[b.key]} bytes, {b.size} were written; no manifest was written"
                return {"status": "wrong_size", "why": why}
        return None

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
