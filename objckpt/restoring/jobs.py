"""One leaf being restored: where its bytes go, and how it is finished.

Restore reads pieces in any order, on several threads; a leaf's state here
says which target boxes this process fills, which host buffers exist, how many
pieces each box still waits for, and turns its boxes into device arrays: a
large leaf box by box as soon as each is whole, so host memory follows
progress; a small one all at once when it is complete, because placing arrays
one at a time costs per array (a small model has ~2,400 of them).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from objckpt.core.boxes import Box, box_to_slices, index_to_box, needed_boxes
from objckpt.core.dtypes import dtype_from_name
from objckpt.core.format import LeafEntry, Piece
from objckpt.core.pieces import find_overlap
from objckpt.core.plan import BoxIndex, ReadRequest
from objckpt.errors import FormatError, TargetMismatchError
from objckpt.restoring.arena import AssemblyArena
from objckpt.restoring.casts import cast_values, check_cast
from objckpt.restoring.host_memory import refuse_over_limit
from objckpt.restoring.read_once import Designator
from objckpt.restoring.read_once import supported as read_once_supported
from objckpt.transfer.buffers import aligned_arrays, aligned_zeros, fault_in

#: A sharded leaf with more bytes than this on this process goes to its devices
#: box by box as boxes complete; a smaller one in one transfer when it is done,
#: since placing arrays one at a time costs per array. Holding a small leaf's
#: host buffers until it completes costs nothing on the CPU backend (the buffers
#: become the device arrays) and at most this much per leaf elsewhere.
WHOLE_LEAF_BYTES = 16 << 20


@dataclass
class LeafJob:
    """One leaf being restored: where its bytes go and how to finish it."""

    entry: LeafEntry
    dtype: np.dtype  # saved dtype
    out_dtype: np.dtype | None  # cast to this when it differs
    sharding: jax.sharding.Sharding | None  # None → host numpy
    devices_by_box: dict[Box, list[Any]]
    buffers: dict[Box, np.ndarray] = field(default_factory=dict)  # allocated when the first piece lands
    remaining: int = 0
    key_sharding: Any = None  # typed PRNG keys: where to put the wrapped keys
    designated: dict[Box, list[tuple[Box, Any]]] | None = (
        None  # read-once: each box's slabs and the device reading each
    )
    box_remaining: dict[Box, int] = field(default_factory=dict)  # pieces still to land, per box
    meets: dict[Box, list[tuple[Box, Box]]] = field(default_factory=dict)  # piece → (box, piece ∩ box) per box it meets
    placed: list[jax.Array] = field(default_factory=list)  # single-device arrays of finished boxes
    placed_boxes: set[Box] = field(default_factory=set)
    assembled: list[Box] = field(default_factory=list)  # boxes no single saved piece equals (never adopted)
    arena: AssemblyArena | None = None  # prefaulted memory for this small leaf's boxes (see reserve_assembled)
    arena_key: int = 0
    unsafe_cast: bool = False  # cast="unsafe": numpy's astype, values unchecked

    @property
    def places_boxes(self) -> bool:
        """Plain sharded leaves: each box's buffer becomes its devices' arrays (placed as it
        completes, or with the whole leaf, see :attr:`places_early`)."""
        return self.sharding is not None and self.designated is None

    @functools.cached_property
    def places_early(self) -> bool:
        """Whether complete boxes go to their devices before the leaf is done (see :data:`WHOLE_LEAF_BYTES`)."""
        local_bytes = sum(math.prod(b - a for a, b in zip(*box)) for box in self.read_boxes) * self.dtype.itemsize
        return self.places_boxes and local_bytes > WHOLE_LEAF_BYTES

    @property
    def read_boxes(self) -> list[Box]:
        """Boxes this process fetches: all it needs, or with read-once only the slabs designated to its devices."""
        if self.designated is None:
            return list(self.devices_by_box)
        return [
            slab
            for box, devices in self.devices_by_box.items()
            for slab, device in self.designated[box]
            if device in devices
        ]

    result: Any = None
    done: bool = field(default=False)


def make_job(
    entry: LeafEntry,
    target: Any,
    *,
    read_once: bool = False,
    unsafe_cast: bool = False,
    devices: frozenset[Any] | None = None,
    designator: Designator | None = None,
) -> LeafJob:
    """The job restoring ``entry`` onto ``target`` (see :func:`objckpt.restore` for the target forms).

    ``devices``: plan for these devices instead of this process's (planning benchmarks
    stand in for one host of a pod). ``designator``: with ``read_once``, the restore's
    (one for all its leaves, so the bytes each process reads balance across leaves).

    Raises:
        TargetMismatchError: the shape differs, the sharding does not fit, or
            (unless ``unsafe_cast``) the target dtype is a cast that loses values.
    """
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
        return LeafJob(entry, dtype, None, None, {full: []}, key_sharding=key_sharding)
    if isinstance(target, (jax.ShapeDtypeStruct, jax.Array)):
        if tuple(target.shape) != shape:
            raise TargetMismatchError(
                f"leaf {entry.path}: target shape {tuple(target.shape)} does not match saved shape {shape}"
            )
        if entry.kind in ("str", "bytes"):
            raise TargetMismatchError(f"leaf {entry.path}: saved a {entry.kind}, the target asks for an array")
        sharding = getattr(target, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        out_dtype = np.dtype(target.dtype)
        if not unsafe_cast:
            check_cast(entry.path, dtype, out_dtype)
        try:
            devices_by_box = needed_boxes(sharding, shape, devices)
        except Exception as e:
            raise TargetMismatchError(
                f"leaf {entry.path}: sharding {sharding} does not fit shape {shape}: {e}"
            ) from None
        if read_once and isinstance(sharding, NamedSharding) and read_once_supported(sharding, out_dtype):
            designated = (designator or Designator(1 << 20)).designate(sharding, shape, dtype.itemsize)
            return LeafJob(
                entry, dtype, out_dtype, sharding, devices_by_box, designated=designated, unsafe_cast=unsafe_cast
            )
    else:
        full = ((0,) * len(shape), shape)
        devices_by_box = {full: []}
    return LeafJob(entry, dtype, out_dtype, sharding, devices_by_box, unsafe_cast=unsafe_cast)


def physical_memory() -> int | None:
    """The machine's physical memory in bytes (``SC_PHYS_PAGES`` × ``SC_PAGE_SIZE``), None where
    the OS does not say. Not what is free now: a restore larger than the machine cannot succeed,
    while one larger than what is free may still fit once the page cache gives way."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def stays_on_host(job: LeafJob) -> bool:
    """Whether a leaf's restored boxes stay in host memory: a numpy result, or devices that
    are the host's (the CPU backend, where a device array is host memory).

    Only such leaves get restore's host-memory techniques (buffers in aligned private
    mappings, pages faulted in ahead, :mod:`objckpt.restoring.arena`): their buffers are the
    result, so how their pages are made and touched is what the restore pays for. A leaf
    bound for an accelerator gets plain numpy buffers, copied to its devices by DMA.
    """
    if job.sharding is None:
        return True
    return all(device.platform == "cpu" for devices in job.devices_by_box.values() for device in devices)


def host_bytes(job: LeafJob) -> int:
    """Host bytes a leaf needs at once on this process: every box it reads when they stay in
    host memory (:func:`stays_on_host`), else its largest box (boxes go to their devices, and
    their host buffers are freed, as they complete)."""
    sizes = [math.prod(b - a for a, b in zip(*box)) * job.dtype.itemsize for box in job.read_boxes]
    if not sizes:
        return 0
    return sum(sizes) if stays_on_host(job) else max(sizes)


def check_host_memory(jobs: dict[int, LeafJob], limit: int | None) -> None:
    """Refuse, before any read, a restore that needs more host memory than ``limit`` bytes.

    Each leaf's :func:`host_bytes` must fit, and so must the leaves that stay in
    host memory, together. Why before: the sizes come from the manifest, and a
    hostile (or mistaken) one declares a leaf of petabytes; failing at once, naming
    the leaf, beats failing an allocation (or the machine) midway.

    Raises:
        HostMemoryError: naming the leaf (or the largest leaves) and both sizes.
    """
    refuse_over_limit(
        (
            (job.entry.path, f"{job.entry.dtype}{list(job.entry.shape or ())}", host_bytes(job), stays_on_host(job))
            for job in jobs.values()
        ),
        limit,
    )


def whole_box(piece: Piece, job: LeafJob) -> bool:
    """A piece that is exactly one box of a leaf placed box by box, with no cast."""
    return (
        job.places_boxes
        and job.box_remaining.get((piece.start, piece.stop)) == 1
        and (job.out_dtype is None or job.out_dtype == job.dtype)
    )


def plan_pieces(job: LeafJob) -> list[Piece]:
    """The saved pieces this process reads for a leaf, counting which boxes each one meets.

    The overlaps are kept (:attr:`LeafJob.meets`): landing, scattering and
    completing a piece look them up rather than intersecting it with every
    box again (a small model has ~1,300 pieces).
    """
    boxes = job.read_boxes
    index = BoxIndex(boxes)
    job.box_remaining = {box: 0 for box in boxes}
    job.meets = {}
    needed = []
    for piece in job.entry.pieces:
        meets = index.meeting(piece.start, piece.stop)
        if meets:
            job.meets[(piece.start, piece.stop)] = meets
            for box, _ in meets:
                job.box_remaining[box] += 1
            needed.append(piece)
    job.remaining = len(needed)
    exact = {(piece.start, piece.stop) for piece in needed}
    job.assembled = [box for box in boxes if box not in exact and job.box_remaining[box]]
    return needed


def uncovered(job: LeafJob) -> Box | None:
    """A box of ``job`` that its planned pieces do not cover exactly (holes or overlaps), or None.

    Run after :func:`plan_pieces`. A box is covered when the parts of the pieces
    that meet it add up to its volume and no two overlap: the exact-coverage
    check that stands in, per box read, for a check of the whole tiling (which
    would need every process's index object). Two pieces with the same box share
    one entry of :attr:`LeafJob.meets` but both count in ``box_remaining``: a
    duplicate is an overlap too.
    """
    parts: dict[Box, list[_Part]] = {box: [] for box in job.box_remaining}
    for meets in job.meets.values():
        for box, (start, stop) in meets:
            parts[box].append(_Part(start, stop))
    for box, found in parts.items():
        if len(found) != job.box_remaining[box]:
            return box
        if len(found) == 1 and (found[0].start, found[0].stop) == box:
            continue  # one piece, exactly the box
        volume = math.prod(b - a for a, b in zip(*box))
        if sum(math.prod(b - a for a, b in zip(p.start, p.stop)) for p in found) != volume:
            return box
        if find_overlap(found) is not None:
            return box
    return None


def overlapping(job: LeafJob, box: Box) -> tuple[Piece, Piece] | None:
    """Two planned pieces of ``job`` that overlap inside ``box`` (one box listed twice
    included), or None: what names the pieces when :func:`uncovered` finds a box."""
    meets = job.meets
    parts = [_Part(*cut, p) for p in job.entry.pieces for b, cut in meets.get((p.start, p.stop), ()) if b == box]
    pair = find_overlap(parts)
    return None if pair is None else (pair[0].piece, pair[1].piece)


@dataclass(frozen=True)
class _Part:
    start: tuple[int, ...]
    stop: tuple[int, ...]
    piece: Piece | None = None


def meets_of(job: LeafJob, piece: Piece) -> list[tuple[Box, Box]]:
    """(box, piece ∩ box) for each box of ``job`` that a planned piece meets."""
    return job.meets[(piece.start, piece.stop)]


def reserve_assembled(jobs: dict[int, LeafJob]) -> None:
    """Start mapping prefaulted memory for every small leaf that will be assembled from parts.

    Called before planning, so the mapping overlaps it (:mod:`objckpt.restoring.arena`
    says why). A small leaf qualifies when some box it reads is not exactly one
    saved piece; all of its boxes get room, since a streamed read copies even
    the pieces that are whole boxes. Only leaves that stay in host memory
    (:func:`stays_on_host`) qualify.
    """
    chosen = []
    for key, job in jobs.items():
        if job.places_early or job.done or not stays_on_host(job):
            continue
        boxes = job.read_boxes
        saved = {(piece.start, piece.stop) for piece in job.entry.pieces}
        if any(box not in saved for box in boxes):
            job.arena_key = key
            chosen.append((key, boxes, job))
    arena = AssemblyArena((key, boxes, job.dtype) for key, boxes, job in chosen)
    for _, _, job in chosen:
        job.arena = arena


def allocate(job: LeafJob, boxes: list[Box] | None = None, *, for_pieces: bool = False) -> list[np.ndarray]:
    """Host buffers for ``boxes`` of a leaf (all it reads by default), made only when needed.

    Made when the first piece for a box lands and, for large sharded leaves, freed
    as soon as the box is complete, so host memory follows progress. With
    ``for_pieces`` the buffers are left uncleared: the saved pieces tile each leaf
    exactly (checked when the manifest is parsed), a box is placed only once
    every piece that meets it has landed, and a failed read fails the restore,
    so every byte is written before it can be read.

    Returns the buffers it made for pieces of a large leaf that stays in host
    memory, fresh memory whose pages none of the copies has faulted in yet: the
    caller passes them to :func:`fault_in_fresh` once it has let go of the lock
    it allocates under. A leaf bound for an accelerator gets plain numpy
    buffers (:func:`stays_on_host` says why).
    """
    if job.done:
        return []
    missing = [box for box in (job.read_boxes if boxes is None else boxes) if box not in job.buffers]
    if not missing:
        return []
    if for_pieces and not job.places_early:  # a small leaf: every box that pieces assemble, in one buffer
        missing += [box for box in job.assembled if box not in job.buffers and box not in missing]
    made = job.arena.buffers(job.arena_key) if for_pieces and job.arena is not None else None
    if made is not None:  # made ahead, in prefaulted memory (see reserve_assembled)
        job.buffers.update((box, made[box]) for box in missing)
        return []
    shapes = [tuple(b - a for a, b in zip(*box)) for box in missing]
    if not stays_on_host(job):
        new = np.empty if for_pieces else np.zeros
        job.buffers.update((box, new(shape, job.dtype)) for box, shape in zip(missing, shapes))
        return []
    if job.places_early:  # a buffer per box, each freed once its box is placed
        for box, shape in zip(missing, shapes):
            (job.buffers[box],) = aligned_arrays([shape], job.dtype, zeroed=not for_pieces)
        return [job.buffers[box] for box in missing] if for_pieces else []
    job.buffers.update(zip(missing, aligned_arrays(shapes, job.dtype, zeroed=not for_pieces)))
    return []


def wait_for_arena(job: LeafJob) -> None:
    """Wait until a small leaf's prefaulted memory is ready, if it has some.

    Called before taking the allocation lock: :func:`allocate` would otherwise
    wait there, holding every other thread's allocations (of leaves whose
    memory is ready) behind this one.
    """
    if job.arena is not None:
        job.arena.buffers(job.arena_key)


def fault_in_fresh(buffers: list[np.ndarray]) -> None:
    """Fault in the pages of buffers :func:`allocate` just made, before pieces are copied
    into them (cheaper than a fault per page inside the copies: :func:`objckpt.transfer.buffers.fault_in`).

    Called without the allocation lock held: other threads may already be
    copying into the same buffers, which is harmless (a page already in is left as is).
    """
    for buffer in buffers:
        fault_in(buffer)


def place_boxes(done: list[tuple[LeafJob, Box]]) -> None:
    """Put complete boxes on their devices in one batched transfer and free their host buffers.

    One ``jax.device_put`` of many arrays costs less than one call per array,
    and a small model's restore is mostly this placement.
    """
    hosts: list[np.ndarray] = []
    devices: list[Any] = []
    owners: list[LeafJob] = []
    for job, box in done:
        host = job.buffers.pop(box)
        if job.out_dtype is not None and job.out_dtype != job.dtype:
            host = cast_values(job.entry.path, host, job.out_dtype, unsafe=job.unsafe_cast)
        for device in job.devices_by_box[box]:
            hosts.append(host)
            devices.append(device)
            owners.append(job)
        job.placed_boxes.add(box)
    if not hosts:
        return
    for job, array in zip(owners, jax.device_put(hosts, devices)):
        job.placed.append(array)


def complete(request: ReadRequest, jobs: dict[int, LeafJob], lock: threading.Lock) -> None:
    """Count a read's pieces as landed: put each box of a large leaf it completes on
    its devices, then finish each leaf it completes (a small leaf goes whole then).

    ``lock`` guards the counters, which responses on other threads share; a
    part is counted done only after its boxes are placed, so a leaf is never
    finished while another thread still places one of its boxes.
    """
    done: list[tuple[LeafJob, Box]] = []
    with lock:
        for part in request.parts:
            job = jobs[part.leaf]
            if job.places_early:
                for box, _ in meets_of(job, part.piece):
                    job.box_remaining[box] -= 1
                    if job.box_remaining[box] == 0:
                        done.append((job, box))
    place_boxes(done)
    finished: list[LeafJob] = []
    with lock:
        for part in request.parts:
            job = jobs[part.leaf]
            job.remaining -= 1
            if job.remaining == 0:
                finished.append(job)
    for job in finished:
        finish(job)


def finish(job: LeafJob) -> None:
    """Turn a leaf's filled buffers into its final value and free them."""
    entry = job.entry
    if job.places_boxes:  # a box that no piece fills (it has no elements) starts as zeros
        allocate(job, [box for box in job.devices_by_box if box not in job.buffers and box not in job.placed_boxes])
    buffers = job.buffers
    if job.out_dtype is not None and job.out_dtype != job.dtype:
        buffers = {box: cast_values(entry.path, b, job.out_dtype, unsafe=job.unsafe_cast) for box, b in buffers.items()}
    if job.designated is not None:  # replicas other than the designated one start as zeros
        assert job.sharding is not None
        out_dtype = job.out_dtype if job.out_dtype is not None else job.dtype
        singles = []
        for box, devices in job.devices_by_box.items():
            for device in devices:
                mine = [slab for slab, reader in job.designated[box] if reader == device]
                if mine == [box]:
                    host = buffers[box]
                else:  # zeros but for the slabs this device read
                    host = aligned_zeros(tuple(b - a for a, b in zip(*box)), out_dtype)
                    for slab in mine:
                        host[box_to_slices(*slab, origin=box[0])] = buffers[slab]
                singles.append(jax.device_put(host, device))
        job.result = jax.make_array_from_single_device_arrays(entry.shape or (), job.sharding, singles)
    elif job.places_early:
        assert job.sharding is not None
        place_boxes([(job, box) for box in list(job.buffers)])  # the boxes with no elements
        job.result = jax.make_array_from_single_device_arrays(entry.shape or (), job.sharding, job.placed)
        job.placed = []
    elif job.sharding is not None:  # one transfer for the whole leaf
        shape = entry.shape or ()
        job.result = jax.make_array_from_callback(
            shape, job.sharding, lambda index: buffers[index_to_box(index, shape)]
        )
    else:
        (value,) = buffers.values()
        if entry.prng_impl is not None:
            keys = jax.random.wrap_key_data(jax.numpy.asarray(value), impl=entry.prng_impl)
            job.result = jax.device_put(keys, job.key_sharding) if job.key_sharding is not None else keys
        elif entry.kind == "str":
            job.result = _decode_str(entry, value.tobytes())
        elif entry.kind == "bytes":
            job.result = value.tobytes()
        else:
            job.result = value
    job.buffers = {}
    job.done = True


def _decode_str(entry: LeafEntry, data: bytes) -> str:
    """A ``str`` leaf's bytes as text; the format stores them as UTF-8, so anything else
    is a malformed checkpoint (its crc32c matched: the writer put these bytes there)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"leaf {entry.path}: a str leaf whose bytes are not UTF-8 (at byte {e.start})") from None
