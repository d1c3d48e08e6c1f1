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

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from objckpt import _runtime
from objckpt._memory import DEVICE_ALIGNMENT, aligned_zeros
from objckpt.aligned_reads import ResponseAlignment, address, read_aligned, read_into
from objckpt.arrays import Box, box_to_slices, needed_boxes
from objckpt.checksum import crc32c
from objckpt.dtypes import dtype_from_name
from objckpt.errors import CoordinationError, IntegrityError, TargetMismatchError
from objckpt.format import ARRAY_KINDS, LeafEntry, Manifest, Piece
from objckpt.manifest_io import read_manifest
from objckpt.multihost import get_coordinator, operation_tag
from objckpt.options import Options
from objckpt.plan import ReadRequest, intersect, pieces_needed, plan_reads
from objckpt.progress import progress_bar
from objckpt.read_once import designate, share
from objckpt.read_once import supported as read_once_supported
from objckpt.read_pool import ReadBufferPool
from objckpt.transfer import TransferEngine, TransferStats, open_store
from objckpt.tree import build, flatten_target, unflatten_target

log = logging.getLogger("objckpt")


@dataclass
class _LeafJob:
    """One leaf being restored: where its bytes go and how to finish it."""

    entry: LeafEntry
    dtype: np.dtype  # saved dtype
    out_dtype: np.dtype | None  # cast to this when it differs
    sharding: jax.sharding.Sharding | None  # None → host numpy
    devices_by_box: dict[Box, list[Any]]
    buffers: dict[Box, np.ndarray] = field(default_factory=dict)  # allocated when the first piece lands
    remaining: int = 0
    key_sharding: Any = None  # typed PRNG keys: where to put the wrapped keys
    designated: dict[Box, Any] | None = None  # read-once: the device that reads each box
    box_remaining: dict[Box, int] = field(default_factory=dict)  # pieces still to land, per box
    placed: list[jax.Array] = field(default_factory=list)  # single-device arrays of finished boxes
    placed_boxes: set[Box] = field(default_factory=set)

    @property
    def places_boxes(self) -> bool:
        """Plain sharded leaves go to their devices box by box, freeing host memory early."""
        return self.sharding is not None and self.designated is None

    @property
    def read_boxes(self) -> list[Box]:
        """Boxes this process fetches: all it needs, or with read-once only its designated ones."""
        if self.designated is None:
            return list(self.devices_by_box)
        return [box for box, devices in self.devices_by_box.items() if self.designated[box] in devices]

    result: Any = None
    done: bool = field(default=False)


def restore(
    url: str,
    target: Any = None,
    *,
    storage_options: dict[str, Any] | None = None,
    partial: bool = False,
    read_once: bool = False,
    options: Options | None = None,
    stats: TransferStats | None = None,
    progress: bool = False,
) -> Any:
    """Restore a checkpoint, onto the target's shardings when it gives them.

    Args:
        url: the checkpoint's URL.
        target: a pytree like the saved one. A leaf that is a
            ``jax.ShapeDtypeStruct`` (with or without sharding) or a
            ``jax.Array`` is restored onto that sharding and dtype; ``None``
            restores a host numpy array; any other leaf is a placeholder for
            the saved value. ``target=None`` restores the whole tree, arrays as numpy.
        storage_options: passed to the store.
        partial: allow the target to name only some saved leaves; the others
            are not read at all.
        read_once: with several processes, read each unique byte from the store
            once (one process per replicated box) and hand it to the other
            replicas with a collective over the devices. For restores across
            regions, where every byte read costs egress. All processes must pass it.
        options: tuning (:class:`objckpt.Options`).
        stats: counters to fill (bytes read from the store, requests, retries, seconds).
        progress: draw a progress bar on stderr when it is a terminal.

    Raises:
        CheckpointNotFoundError, FormatError, IntegrityError, TargetMismatchError.
    """
    options = options or Options()
    stats = stats if stats is not None else TransferStats()
    store = open_store(url, storage_options, options, stats)
    started = time.perf_counter()
    manifest = _runtime.run_sync(read_manifest(store, size_limit=options.manifest_size_limit))
    selection = _select(manifest, target, partial)
    read_once = read_once and jax.process_count() > 1
    jobs = {
        i: _make_job(manifest.leaves[i], t, read_once=read_once)
        for i, t in selection.items()
        if manifest.leaves[i].kind in ARRAY_KINDS
    }
    requests = _plan(manifest, jobs, options, recycled=store.inner.reads_into)
    base = stats.bytes_read
    total = sum(r.length for r in requests)
    with progress_bar("restore", total, lambda: stats.bytes_read - base, enabled=progress):
        if read_once:
            _fetch_then_share(store.inner, requests, jobs, options, stats)
        else:
            _runtime.run_sync(_fetch(store.inner, requests, jobs, options, stats))
    values = {i: (jobs[i].result if i in jobs else _inline(manifest.leaves[i], t)) for i, t in selection.items()}
    seconds = time.perf_counter() - started
    stats.seconds = seconds
    log.info(
        "objckpt restored %s: %d leaves, %d bytes read in %d requests, %d retries, %.2f s, %.3f GiB/s",
        store.url,
        len(values),
        stats.bytes_read,
        stats.requests,
        stats.retries,
        seconds,
        stats.bytes_read / max(seconds, 1e-9) / 2**30,
    )
    if target is None:
        return build(manifest.tree, lambda i: values[i])
    flat, treedef = flatten_target(target)
    index = {leaf.path: i for i, leaf in enumerate(manifest.leaves)}
    return unflatten_target(treedef, [values[index[path]] for path, _ in flat])


def _select(manifest: Manifest, target: Any, partial: bool) -> dict[int, Any]:
    """Which saved leaves to restore, each with its target leaf."""
    if target is None:
        return {i: None for i in range(len(manifest.leaves))}
    flat, _ = flatten_target(target)
    index = {leaf.path: i for i, leaf in enumerate(manifest.leaves)}
    named = {path for path, _ in flat}
    missing = [path for path, _ in flat if path not in index]
    unnamed = [leaf.path for leaf in manifest.leaves if leaf.path not in named]
    if missing or (unnamed and not partial):
        parts = []
        if missing:
            parts.append(f"target leaves not in the checkpoint: {', '.join(missing)}")
        if unnamed and not partial:
            parts.append(
                f"checkpoint leaves the target does not name: {', '.join(unnamed)} (pass partial=True to skip them)"
            )
        raise TargetMismatchError("target does not match the checkpoint; " + "; ".join(parts))
    return {index[path]: value for path, value in flat}


def _fetch_then_share(
    store: Any, requests: list[ReadRequest], jobs: dict[int, _LeafJob], options: Options, stats: TransferStats
) -> None:
    """Read-once: fetch this process's share, agree that every process succeeded, then share.

    The status exchange (with a timeout) comes before the collective, which has
    none: a process that failed to read must not leave the others in a collective.
    """
    coordinator = get_coordinator()
    tag = operation_tag("restore", store.url)
    error: BaseException | None = None
    try:
        _runtime.run_sync(_fetch(store, requests, jobs, options, stats))
    except BaseException as e:
        error = e
    status = f"error: {type(error).__name__}: {error}" if error is not None else "ok"
    statuses = coordinator.all_gather(f"{tag}/status", status.encode(), timeout=options.barrier_timeout)
    if error is not None:
        raise error
    failed = [f"process {p}: {s.decode()}" for p, s in enumerate(statuses) if s != b"ok"]
    if failed:
        raise CoordinationError(f"restore of {store.url} failed elsewhere: {'; '.join(failed)}")
    for i in sorted(jobs):  # same order on every process: the collectives must line up
        job = jobs[i]
        if job.designated is not None:
            assert isinstance(job.sharding, NamedSharding)
            job.result = share(job.result, job.sharding)


def _make_job(entry: LeafEntry, target: Any, *, read_once: bool = False) -> _LeafJob:
    dtype = dtype_from_name(entry.dtype or "")
    assert dtype is not None and entry.shape is not None  # validated by the reader
    shape = entry.shape
    sharding = None
    out_dtype = None
    if entry.prng_impl is not None:  # keys are tiny: rebuild on the host, then place them
        key_sharding = (
            getattr(target, "sharding", None) if isinstance(target, (jax.ShapeDtypeStruct, jax.Array)) else None
        )
        full = ((0,) * len(shape), shape)
        return _LeafJob(entry, dtype, None, None, {full: []}, key_sharding=key_sharding)
    if isinstance(target, (jax.ShapeDtypeStruct, jax.Array)):
        if tuple(target.shape) != shape:
            raise TargetMismatchError(
                f"leaf {entry.path}: target shape {tuple(target.shape)} does not match saved shape {shape}"
            )
        if entry.kind in ("str", "bytes"):
            raise TargetMismatchError(f"leaf {entry.path}: saved a {entry.kind}, the target asks for an array")
        sharding = getattr(target, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        out_dtype = np.dtype(target.dtype)
        try:
            devices_by_box = needed_boxes(sharding, shape)
        except Exception as e:
            raise TargetMismatchError(
                f"leaf {entry.path}: sharding {sharding} does not fit shape {shape}: {e}"
            ) from None
        if read_once and isinstance(sharding, NamedSharding) and read_once_supported(sharding, out_dtype):
            designated = designate(sharding, shape, dtype.itemsize)
            return _LeafJob(entry, dtype, out_dtype, sharding, devices_by_box, designated=designated)
    else:
        full = ((0,) * len(shape), shape)
        devices_by_box = {full: []}
    return _LeafJob(entry, dtype, out_dtype, sharding, devices_by_box)


def _inline(entry: LeafEntry, target: Any) -> Any:
    if isinstance(target, (jax.ShapeDtypeStruct, jax.Array)):
        raise TargetMismatchError(f"leaf {entry.path}: saved a Python {entry.kind}, the target asks for an array")
    return entry.value


def _plan(manifest: Manifest, jobs: dict[int, _LeafJob], options: Options, *, recycled: bool) -> list[ReadRequest]:
    """The coalesced reads for ``jobs``; ``recycled``: copied reads land in recycled buffers."""
    wanted: list[tuple[int, Piece]] = []
    for i, job in jobs.items():
        boxes = job.read_boxes
        pieces = pieces_needed(job.entry.pieces, boxes)
        job.remaining = len(pieces)
        job.box_remaining = {box: 0 for box in boxes}
        for p in pieces:
            for box in _boxes_of(p, boxes):
                job.box_remaining[box] += 1
        wanted.extend((i, p) for p in pieces)
    layout = (piece for leaf in manifest.leaves for piece in leaf.pieces)
    return plan_reads(
        wanted,
        coalesce_gap=options.coalesce_gap,
        max_read_size=options.copied_read_limit(recycled=recycled),
        layout=layout,
        kept=lambda leaf, piece: _whole_box(piece, jobs[leaf]),
        max_kept_read_size=options.read_chunk,
    )


async def _fetch(
    store: Any, requests: list[ReadRequest], jobs: dict[int, _LeafJob], options: Options, stats: TransferStats
) -> None:
    engine = TransferEngine(
        store,
        max_concurrency=options.max_concurrency,
        request_timeout=options.request_timeout,
        retry=options.retry,
        stats=stats,
    )
    for job in jobs.values():
        if job.remaining == 0:
            _allocate(job)
            await asyncio.to_thread(_finish, job)

    alignment = ResponseAlignment(store.response_phase())
    lock = threading.Lock()
    # A read that will become its boxes' arrays is not memory above the restored
    # arrays (when the client fills its buffer in place), so only reads that are
    # copied, then freed, count against the window; max_concurrency still bounds
    # the requests in flight. Copied reads land in recycled buffers when the
    # store can receive into them (objckpt.read_pool says why).
    in_place = store.reads_in_place
    copied = {id(r) for r in requests if not (in_place and _may_adopt(r, jobs))}
    window = min(options.read_window, options.memory_budget)
    pool = ReadBufferPool(window, sum(r.length for r in requests if id(r) in copied)) if store.reads_into else None

    def check_length(request: ReadRequest, got: int) -> None:
        if got != request.length:
            paths = sorted({jobs[p.leaf].entry.path for p in request.parts})
            raise IntegrityError(
                f"blob {store.url}/{request.blob} is truncated: asked bytes [{request.start}, {request.end}),"
                f" got {got} (leaves {', '.join(paths)})"
            )

    async def one(request: ReadRequest) -> None:
        if pool is not None and id(request) in copied:
            buffer = pool.take(request.length)
            try:
                got = await read_into(engine, request, options.read_chunk, buffer.data)
                check_length(request, got)
                await asyncio.to_thread(_land, request, buffer.data[:got], jobs, store.url, lock, adopt=False)
            finally:
                pool.give(buffer)  # _land copied every byte out; the read has stopped writing
            return
        data = await read_aligned(engine, request, options.read_chunk, alignment)
        check_length(request, len(data))
        await asyncio.to_thread(_land, request, data, jobs, store.url, lock)

    await engine.for_each(requests, one, window_bytes=window, size=lambda r: r.length if id(r) in copied else 0)


def _may_adopt(request: ReadRequest, jobs: dict[int, _LeafJob]) -> bool:
    """Whether every part of a planned read can be adopted if its bytes land aligned."""
    return request.length >= ResponseAlignment.LARGE and all(
        _whole_box(part.piece, jobs[part.leaf]) for part in request.parts
    )


def _whole_box(piece: Piece, job: _LeafJob) -> bool:
    """A piece that is exactly one box of a leaf placed box by box, with no cast."""
    return (
        job.places_boxes
        and job.box_remaining.get((piece.start, piece.stop)) == 1
        and (job.out_dtype is None or job.out_dtype == job.dtype)
    )


def _adoptable(request: ReadRequest, data: memoryview, jobs: dict[int, _LeafJob]) -> set[int]:
    """The parts (by index) whose response bytes can become their box's host array as is.

    That takes a piece that is exactly one box of a leaf placed box by box (a
    read-only view is fine there: it goes straight to its devices), no cast, and
    bytes on the alignment boundary.
    """
    base = address(data)
    return {
        k
        for k, part in enumerate(request.parts)
        if (base + part.offset) % DEVICE_ALIGNMENT == 0
        and _whole_box(part.piece, jobs[part.leaf])
        and (part.piece.start, part.piece.stop) not in jobs[part.leaf].buffers
    }


def _boxes_of(piece: Piece, boxes: Any) -> list[Box]:
    """The boxes (of an iterable of boxes) that a saved piece intersects."""
    return [box for box in boxes if intersect(piece.start, piece.stop, *box) is not None]


def _allocate(job: _LeafJob, boxes: list[Box] | None = None) -> None:
    """Host buffers for ``boxes`` of a leaf (all it reads by default), made only when needed.

    Made when the first piece for a box lands and, for plain sharded leaves, freed
    as soon as the box is complete, so host memory follows progress.
    """
    if job.done:
        return
    for box in job.read_boxes if boxes is None else boxes:
        if box not in job.buffers:
            job.buffers[box] = aligned_zeros(tuple(b - a for a, b in zip(*box)), job.dtype)


def _place_box(job: _LeafJob, box: Box) -> None:
    """Put one complete box on each of its devices and free its host buffer."""
    host = job.buffers.pop(box)
    if job.out_dtype is not None and job.out_dtype != job.dtype:
        host = host.astype(job.out_dtype)
    job.placed.extend(jax.device_put(host, device) for device in job.devices_by_box[box])
    job.placed_boxes.add(box)


def _land(
    request: ReadRequest,
    data: memoryview,
    jobs: dict[int, _LeafJob],
    url: str,
    lock: threading.Lock,
    *,
    adopt: bool = True,
) -> None:
    """All one response does, in one trip off the loop thread (a trip costs more than placing a box).

    Allocate the boxes it copies into, check and scatter its pieces, put each
    box it completes on its devices, then finish each leaf it completes. The
    counters are shared with other responses' threads, hence ``lock``; a
    part is counted done only after its boxes are placed, so a leaf is never
    finished while another thread still places one of its boxes. ``adopt=False``
    copies every part (``data`` is a recycled buffer).
    """
    with lock:
        adopted = _adoptable(request, data, jobs) if adopt else set()
        for k, part in enumerate(request.parts):
            if k not in adopted:
                _allocate(jobs[part.leaf], _boxes_of(part.piece, jobs[part.leaf].box_remaining))
    _scatter(request, data, jobs, url, adopted)
    complete: list[tuple[_LeafJob, Box]] = []
    with lock:
        for part in request.parts:
            job = jobs[part.leaf]
            if job.places_boxes:
                for box in _boxes_of(part.piece, job.box_remaining):
                    job.box_remaining[box] -= 1
                    if job.box_remaining[box] == 0:
                        complete.append((job, box))
    for job, box in complete:
        _place_box(job, box)
    finished: list[_LeafJob] = []
    with lock:
        for part in request.parts:
            job = jobs[part.leaf]
            job.remaining -= 1
            if job.remaining == 0:
                finished.append(job)
    for job in finished:
        _finish(job)


def _scatter(
    request: ReadRequest,
    data: memoryview,
    jobs: dict[int, _LeafJob],
    url: str,
    adopted: set[int],
) -> None:
    """Check each piece of one response and copy it into the boxes that need it.

    An adopted part (see :func:`_adoptable`) becomes its box's buffer instead
    of being copied. Pieces never overlap, so threads scattering different
    responses into the same leaf write disjoint regions.
    """
    for k, part in enumerate(request.parts):
        piece = part.piece
        job = jobs[part.leaf]
        raw = data[part.offset : part.offset + piece.length]
        if crc32c(raw) != piece.crc32c:
            raise IntegrityError(
                f"checksum mismatch in leaf {job.entry.path}: blob {url}/{piece.blob}"
                f" bytes [{piece.offset}, {piece.offset + piece.length})"
            )
        source = np.frombuffer(raw, dtype=job.dtype).reshape(piece.shape)
        if k in adopted:
            job.buffers[(piece.start, piece.stop)] = source
            continue
        for box in job.box_remaining:  # fixed after planning, unlike job.buffers, which other threads change
            overlap = intersect(piece.start, piece.stop, *box)
            if overlap is not None:
                buffer = job.buffers[box]
                buffer[box_to_slices(*overlap, origin=box[0])] = source[box_to_slices(*overlap, origin=piece.start)]


def _finish(job: _LeafJob) -> None:
    """Turn a leaf's filled buffers into its final value and free them."""
    entry = job.entry
    buffers = job.buffers
    if job.out_dtype is not None and job.out_dtype != job.dtype:
        buffers = {box: b.astype(job.out_dtype) for box, b in buffers.items()}
    if job.designated is not None:  # replicas other than the designated one start as zeros
        assert job.sharding is not None
        out_dtype = job.out_dtype if job.out_dtype is not None else job.dtype
        singles = []
        for box, devices in job.devices_by_box.items():
            for device in devices:
                if job.designated[box] == device:
                    host = buffers[box]
                else:
                    host = aligned_zeros(tuple(b - a for a, b in zip(*box)), out_dtype)
                singles.append(jax.device_put(host, device))
        job.result = jax.make_array_from_single_device_arrays(entry.shape or (), job.sharding, singles)
    elif job.sharding is not None:
        for box in job.devices_by_box:  # boxes not placed yet (empty ones)
            if box not in job.placed_boxes:
                _allocate(job, [box])
                _place_box(job, box)
        job.result = jax.make_array_from_single_device_arrays(entry.shape or (), job.sharding, job.placed)
        job.placed = []
    else:
        (value,) = buffers.values()
        if entry.prng_impl is not None:
            keys = jax.random.wrap_key_data(jax.numpy.asarray(value), impl=entry.prng_impl)
            job.result = jax.device_put(keys, job.key_sharding) if job.key_sharding is not None else keys
        elif entry.kind == "str":
            job.result = value.tobytes().decode()
        elif entry.kind == "bytes":
            job.result = value.tobytes()
        else:
            job.result = value
    job.buffers = {}
    job.done = True
