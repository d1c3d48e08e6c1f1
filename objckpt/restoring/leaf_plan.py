"""What restore does for one leaf, decided before any byte moves: a frozen, pure plan.

A :class:`LeafPlan` says which target boxes this process fills, on which
devices, which saved pieces meet each box (and where), which boxes are
assembled from parts rather than equal to one saved piece, and how the leaf is
finished (box by box as boxes complete, or whole). It is built from the leaf's
manifest entry and its target alone (:func:`plan_leaf`): no I/O, no buffers,
and no device memory, so planning can be tested and benchmarked at pod scale.
Everything that changes while the bytes land lives in
:class:`objckpt.restoring.landing.Landing`.

Plans of leaves with the same boxes and piece geometry share their work
through two caches, bounded by entry counts (256 :class:`BoxIndex`, each with
its memo of the piece geometries it met, and 64 shared meetings, each holding
its pieces' geometry) and scoped to one restore: objckpt is a guest in the
training process, so :func:`clear_planning_caches` (which restore calls when it
ends, with :func:`objckpt.core.boxes.forget_needed_boxes`) empties them, and no
piece list, box index or target sharding outlives the call that planned it.
Planning called directly (benchmarks) keeps them up to those bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from objckpt.core.boxes import Box, forget_needed_boxes, needed_boxes
from objckpt.core.dtypes import dtype_from_name
from objckpt.core.format import LeafEntry, Piece
from objckpt.core.format.rows import LeafPieces
from objckpt.core.jax_compat import single_device_sharding
from objckpt.core.pieces import find_overlap
from objckpt.core.plan import BoxIndex
from objckpt.errors import TargetMismatchError
from objckpt.restoring.casts import check_cast
from objckpt.restoring.host_memory import refuse_over_limit
from objckpt.restoring.read_once import Designator
from objckpt.restoring.read_once import supported as read_once_supported

#: A sharded leaf with more bytes than this on this process goes to its devices
#: box by box as boxes complete; a smaller one in one transfer when it is done,
#: since placing arrays one at a time costs per array. Holding a small leaf's
#: host buffers until it completes costs nothing on the CPU backend (the buffers
#: become the device arrays) and at most this much per leaf elsewhere.
WHOLE_LEAF_BYTES = 16 << 20

#: (box, piece ∩ box) for each box a piece meets.
Meets = list[tuple[Box, Box]]


@dataclass(frozen=True)
class LeafPlan:
    """One leaf's restore, as planned: its boxes, the pieces it reads, how it is finished.

    The piece-side facts (:attr:`pieces`, :attr:`meets`, :attr:`box_pieces`,
    :attr:`assembled`) are computed from :attr:`entry` on first use and kept:
    restore starts mapping memory for assembled leaves before it works them out
    (:meth:`objckpt.restoring.landing.Landing.reserve_arena`), and a format-2
    restore learns a leaf's pieces only after reading index objects
    (:meth:`with_entry`).
    """

    entry: LeafEntry
    dtype: np.dtype  # saved dtype
    out_dtype: np.dtype | None  # cast to this when it differs
    sharding: jax.sharding.Sharding | None  # None → host numpy
    devices_by_box: Mapping[Box, list[Any]]
    key_sharding: Any = None  # typed PRNG keys: where to put the wrapped keys
    designated: Mapping[Box, list[tuple[Box, Any]]] | None = None  # read-once: each box's slabs and their reader
    unsafe_cast: bool = False  # cast="unsafe": numpy's astype, values unchecked
    whole_leaf_bytes: int = WHOLE_LEAF_BYTES
    # Whether the restored boxes stay in host memory (a numpy result, or CPU devices): only
    # then are the buffers the result (aligned private mappings, small ones from restoring.arena),
    # else they are borrowed and given back once copied to the devices (recycles_buffers).
    on_host: bool = True
    recycles: bool = False  # devices that copy a host buffer and let it go (see recycles_buffers)

    @property
    def recycles_buffers(self) -> bool:
        """Whether the host buffers the leaf's boxes land in are lent and taken back
        (:mod:`objckpt.restoring.recycled`): a leaf none of whose devices is the host's, placed
        in device memory. There ``device_put`` copies a buffer and lets it go once the copy
        ends; a CPU device may keep the buffer as its array, and pinned host memory is not
        known to copy."""
        return self.recycles and self.places_boxes

    @property
    def places_boxes(self) -> bool:
        """Plain sharded leaves: each box's buffer becomes its devices' arrays (placed as it
        completes, or with the whole leaf, see :attr:`places_early`)."""
        return self.sharding is not None and self.designated is None

    @functools.cached_property
    def places_early(self) -> bool:
        """Whether complete boxes go to their devices before the leaf is done (see :data:`WHOLE_LEAF_BYTES`)."""
        local_bytes = sum(math.prod(b - a for a, b in zip(*box)) for box in self.read_boxes) * self.dtype.itemsize
        return self.places_boxes and local_bytes > self.whole_leaf_bytes

    @functools.cached_property
    def casts(self) -> bool:
        """Whether the leaf's values are cast to another dtype once landed."""
        return self.out_dtype is not None and self.out_dtype != self.dtype

    @functools.cached_property
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

    @property
    def host_bytes(self) -> int:
        """Host bytes the leaf needs at once on this process: every box it reads when they stay
        in host memory (:attr:`on_host`), else its largest box (boxes go to their devices,
        and their host buffers are freed, as they complete)."""
        sizes = [math.prod(b - a for a, b in zip(*box)) * self.dtype.itemsize for box in self.read_boxes]
        if not sizes:
            return 0
        return sum(sizes) if self.on_host else max(sizes)

    @functools.cached_property
    def _meeting(self) -> _Meeting:
        return _meeting_of(tuple(self.read_boxes), _rows(self.entry))

    @functools.cached_property
    def pieces(self) -> Sequence[Piece]:
        """The saved pieces this process reads for the leaf (those meeting a box it reads)."""
        rows = _rows(self.entry)
        return () if rows is None else rows.take(self._meeting.position_array)

    @functools.cached_property
    def meets(self) -> dict[tuple[Any, Any], Meets]:
        """Per planned piece (by its (start, stop)): (box, piece ∩ box) for each box it meets.

        Landing, scattering and counting a piece look them up rather than
        intersecting it with every box again (a small model has ~1,300 pieces).
        """
        return self._meeting.meets

    @functools.cached_property
    def box_pieces(self) -> dict[Box, int]:
        """Per box read: how many planned pieces meet it (what landing counts down)."""
        return self._meeting.counts

    @functools.cached_property
    def assembled(self) -> list[Box]:
        """Boxes no single planned piece equals (filled from parts, never adopted)."""
        return list(self._meeting.assembled)

    @functools.cached_property
    def needs_assembly(self) -> bool:
        """Some box read is not exactly one saved piece (:meth:`Landing.reserve_arena` says why it matters).

        Looks at the entry's pieces only, not :attr:`pieces`: it is asked before planning them.
        """
        saved = set(_geometry(_rows(self.entry)))
        return any(box not in saved for box in self.read_boxes)

    def meets_of(self, piece: Piece) -> Meets:
        """(box, piece ∩ box) for each box that a planned piece meets."""
        return self.meets[(piece.start, piece.stop)]

    def whole_box(self, piece: Piece) -> bool:
        """A piece that is exactly one box of a leaf placed box by box, with no cast."""
        return self.places_boxes and self.box_pieces.get((piece.start, piece.stop)) == 1 and not self.casts

    def with_entry(self, entry: LeafEntry) -> LeafPlan:
        """The same plan for ``entry``'s pieces (a format-2 leaf, once its index rows are read)."""
        return dataclasses.replace(self, entry=entry)

    def uncovered(self) -> Box | None:
        """A box that the planned pieces do not cover exactly (holes or overlaps), or None.

        A box is covered when the parts of the pieces that meet it add up to its
        volume and no two overlap: the exact-coverage check that stands in, per
        box read, for a check of the whole tiling (which would need every
        process's index object). Two pieces with the same box share one entry of
        :attr:`meets` but both count in :attr:`box_pieces`: a duplicate is an
        overlap too.
        """
        return self._meeting.uncovered

    def overlapping(self, box: Box) -> tuple[Piece, Piece] | None:
        """Two planned pieces that overlap inside ``box`` (one box listed twice included), or
        None: what names the pieces when :meth:`uncovered` finds a box."""
        meets = self.meets
        parts = [_Part(*cut, p) for p in self.entry.pieces for b, cut in meets.get((p.start, p.stop), ()) if b == box]
        pair = find_overlap(parts)
        return None if pair is None else (pair[0].piece, pair[1].piece)


@dataclass(frozen=True)
class _Part:
    start: tuple[int, ...]
    stop: tuple[int, ...]
    piece: Piece | None = None


def _rows(entry: LeafEntry) -> LeafPieces | None:
    """The leaf's pieces, rows of its manifest's :class:`~objckpt.core.format.rows.Rows` (every
    version's, :meth:`Manifest.in_columns`); None before its index rows are read."""
    pieces = entry.pieces
    if not pieces:
        return None
    if not isinstance(pieces, LeafPieces):
        raise TypeError(f"leaf {entry.path}'s pieces are not rows (a restore plans from Manifest.in_columns)")
    return pieces


def _geometry(pieces: LeafPieces | None) -> tuple[Box, ...]:
    """Each piece's (start, stop), in order (from the rows' interned boxes)."""
    return () if pieces is None else pieces.geometry()


class _Meeting:
    """Which of a leaf's pieces meet which of its boxes, from their geometry alone.

    Shared by every leaf with the same boxes read and the same piece geometry
    (in order): a pod-scale state has hundreds of layers whose leaves share a
    sharding and shape, so the pieces are met with the boxes, and the coverage
    checked, once per kind of leaf rather than once per leaf. Read-only once built.
    """

    def __init__(self, boxes: tuple[Box, ...], geometry: tuple[Box, ...]) -> None:
        index = _box_index(boxes)
        counts = {box: 0 for box in boxes}
        meets: dict[tuple[Any, Any], Meets] = {}
        positions = []
        inside = _inside(index, geometry)
        for k, (start, stop) in enumerate(geometry):
            box = inside[k] if inside is not None else ()
            met = [(box, (start, stop))] if box else [] if box is None else index.meeting(start, stop)
            if met:
                meets[(start, stop)] = met
                for box, _ in met:
                    counts[box] += 1
                positions.append(k)
        self.boxes = boxes
        self.geometry = geometry
        self.positions: tuple[int, ...] = tuple(positions)
        self.meets = meets
        self.counts = counts

    @functools.cached_property
    def position_array(self) -> np.ndarray:
        """:attr:`positions` as an array (what :meth:`LeafPieces.take` takes)."""
        return np.asarray(self.positions, dtype=np.int64)

    @functools.cached_property
    def assembled(self) -> tuple[Box, ...]:
        """See :attr:`LeafPlan.assembled`."""
        exact = {self.geometry[k] for k in self.positions}
        return tuple(box for box in self.boxes if box not in exact and self.counts[box])

    @functools.cached_property
    def uncovered(self) -> Box | None:
        """See :meth:`LeafPlan.uncovered`."""
        counts = self.counts
        parts: dict[Box, list[_Part]] = {box: [] for box in counts}
        for meets in self.meets.values():
            for box, (start, stop) in meets:
                parts[box].append(_Part(start, stop))
        for box, found in parts.items():
            if len(found) != counts[box]:
                return box
            if len(found) == 1 and (found[0].start, found[0].stop) == box:
                continue  # one piece, exactly the box
            volume = math.prod(b - a for a, b in zip(*box))
            if sum(math.prod(b - a for a, b in zip(p.start, p.stop)) for p in found) != volume:
                return box
            if find_overlap(found) is not None:
                return box
        return None


def _inside(index: BoxIndex, geometry: tuple[Box, ...]) -> list[Any] | None:
    """Per piece, the one box of a grid (:attr:`BoxIndex.grid`) that holds it whole, None where it
    meets none, () where it meets several or part of one; in numpy, for all at once (an inference
    host of a 1T pod meets ~16,000 pieces a leaf). None: not a grid, or too few pieces to gain."""
    grid = index.grid
    if grid is None or len(geometry) < 64 or not geometry[0][0]:
        return None
    corners = np.array(geometry, dtype=np.int64)  # pieces × (start, stop) × axes
    cell = np.zeros(len(geometry), dtype=np.int64)
    met, whole = np.ones(len(geometry), dtype=bool), np.ones(len(geometry), dtype=bool)
    for d, (starts, stops) in enumerate(np.array(axis, dtype=np.int64) for axis in grid[0]):
        first = np.searchsorted(stops, corners[:, 0, d], "right")  # the first interval that ends past start
        last = np.searchsorted(starts, corners[:, 1, d], "left")  # past the intervals that start before stop
        met &= last > first
        k = np.minimum(first, len(starts) - 1)
        whole &= (last == first + 1) & (starts[k] <= corners[:, 0, d]) & (corners[:, 1, d] <= stops[k])
        cell = cell * len(starts) + k
    return [grid[1][c] if w else () if m else None for c, w, m in zip(cell.tolist(), whole.tolist(), met.tolist())]


def clear_planning_caches() -> None:
    """Empty the caches restore planning shares between leaves (see the module's docstring).

    Safe at any time: a plan already made keeps what it uses; the next plan builds afresh.
    """
    _box_index.cache_clear()
    _MEETINGS.clear()
    forget_needed_boxes()


@functools.lru_cache(maxsize=256)
def _box_index(boxes: tuple[Box, ...]) -> BoxIndex:
    """One :class:`BoxIndex` per set of boxes (its answers are memoized, see :meth:`BoxIndex.meeting`)."""
    return BoxIndex(boxes)


#: Shared meetings, least recently used first (see the module's docstring for the bound).
_MEETINGS: OrderedDict[tuple[tuple[Box, ...], Hashable], _Meeting] = OrderedDict()
_MEETINGS_KEPT = 64


def _meeting_of(boxes: tuple[Box, ...], pieces: LeafPieces | None) -> _Meeting:
    """The :class:`_Meeting` of these boxes and the pieces' geometry, built once while it is in use.

    Keyed by the geometry's content: their interned boxes' ids
    (:meth:`LeafPieces.geometry_key`, no tuple per piece).
    """
    shape: Hashable = () if pieces is None else pieces.geometry_key()
    key = (boxes, shape)
    found = _MEETINGS.get(key)
    if found is not None:
        _MEETINGS.move_to_end(key)
        return found
    found = _MEETINGS[key] = _Meeting(boxes, _geometry(pieces))
    if len(_MEETINGS) > _MEETINGS_KEPT:
        _MEETINGS.popitem(last=False)
    return found


def plan_leaf(
    entry: LeafEntry,
    target: Any,
    *,
    read_once: bool = False,
    unsafe_cast: bool = False,
    devices: frozenset[Any] | None = None,
    designator: Designator | None = None,
    whole_leaf_bytes: int = WHOLE_LEAF_BYTES,
) -> LeafPlan:
    """The plan restoring ``entry`` onto ``target`` (see :func:`objckpt.restore` for the target forms).

    ``devices``: plan for these devices instead of this process's (planning benchmarks
    stand in for one host of a pod). ``designator``: with ``read_once``, the restore's
    (one for all its leaves, so the bytes each process reads balance across leaves).
    ``whole_leaf_bytes``: see :data:`WHOLE_LEAF_BYTES`.

    Raises:
        TargetMismatchError: the shape differs, the sharding does not fit, or
            (unless ``unsafe_cast``) the target dtype is a cast that loses values.
    """
    dtype = dtype_from_name(entry.dtype or "")
    assert dtype is not None and entry.shape is not None  # validated by the reader
    shape = entry.shape
    full = ((0,) * len(shape), shape)
    if entry.prng_impl is not None:  # keys are tiny: rebuild on the host, then place them
        return LeafPlan(entry, dtype, None, None, {full: []}, key_sharding=_key_sharding(entry, dtype, target))
    if not isinstance(target, (jax.ShapeDtypeStruct, jax.Array)):
        return LeafPlan(entry, dtype, None, None, {full: []}, unsafe_cast=unsafe_cast)
    if tuple(target.shape) != shape:
        raise TargetMismatchError(
            f"leaf {entry.path}: target shape {tuple(target.shape)} does not match saved shape {shape}"
        )
    if entry.kind in ("str", "bytes"):
        raise TargetMismatchError(f"leaf {entry.path}: saved a {entry.kind}, the target asks for an array")
    sharding = getattr(target, "sharding", None) or single_device_sharding(jax.local_devices()[0])
    out_dtype = np.dtype(target.dtype)
    if not unsafe_cast:
        check_cast(entry.path, dtype, out_dtype)
    try:
        devices_by_box = needed_boxes(sharding, shape, devices)
    except Exception as e:
        raise TargetMismatchError(f"leaf {entry.path}: sharding {sharding} does not fit shape {shape}: {e}") from None
    on_host = all(device.platform == "cpu" for boxed in devices_by_box.values() for device in boxed)
    recycles = getattr(sharding, "memory_kind", None) in (None, "device") and not any(
        device.platform == "cpu" for boxed in devices_by_box.values() for device in boxed
    )
    designated = None
    if read_once and isinstance(sharding, NamedSharding) and read_once_supported(sharding, out_dtype):
        designated = (designator or Designator(1 << 20)).designate(sharding, shape, dtype.itemsize)
    return LeafPlan(
        entry,
        dtype,
        out_dtype,
        sharding,
        devices_by_box,
        designated=designated,
        unsafe_cast=unsafe_cast,
        whole_leaf_bytes=whole_leaf_bytes,
        on_host=on_host,
        recycles=recycles,
    )


def _key_sharding(entry: LeafEntry, dtype: np.dtype, target: Any) -> jax.sharding.Sharding | None:
    """Where a typed PRNG key leaf's restored keys go: the target's sharding (None: JAX's default device).

    The saved array is the keys' data (``jax.random.key_data``: trailing dimensions
    of the implementation's), so the keys' own shape, which an array or abstract
    target must have, comes from the implementation.

    Raises:
        TargetMismatchError: the target's shape is not the saved keys', or its sharding
            does not fit that shape.
    """
    if not isinstance(target, (jax.ShapeDtypeStruct, jax.Array)):
        return None
    assert entry.prng_impl is not None and entry.shape is not None
    shape = _key_shape(entry.prng_impl, entry.shape, dtype.name)
    if tuple(target.shape) != shape:
        raise TargetMismatchError(
            f"leaf {entry.path}: target shape {tuple(target.shape)} does not match the saved"
            f" {entry.prng_impl} keys' shape {shape}"
        )
    sharding = getattr(target, "sharding", None)
    if sharding is not None:
        try:
            sharding.shard_shape(shape)
        except Exception as e:
            raise TargetMismatchError(
                f"leaf {entry.path}: sharding {sharding} does not fit the saved keys' shape {shape}: {e}"
            ) from None
    return sharding


@functools.lru_cache(maxsize=64)
def _key_shape(impl: str, data_shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """The shape of the keys whose ``key_data`` has ``data_shape`` (worked out abstractly: no device work)."""
    wrap = functools.partial(jax.random.wrap_key_data, impl=impl)
    return tuple(jax.eval_shape(wrap, jax.ShapeDtypeStruct(data_shape, np.dtype(dtype))).shape)


def check_host_memory(plans: Mapping[int, LeafPlan], limit: int | None) -> None:
    """Refuse, before any read (:mod:`objckpt.restoring.host_memory` says why), a restore that needs
    more host memory than ``limit`` bytes: each leaf's :attr:`LeafPlan.host_bytes`, and the leaves
    that stay in host memory together.

    Raises:
        HostMemoryError: naming the leaf (or the largest leaves) and both sizes.
    """
    refuse_over_limit(
        (
            (plan.entry.path, f"{plan.entry.dtype}{list(plan.entry.shape or ())}", plan.host_bytes, plan.on_host)
            for plan in plans.values()
        ),
        limit,
    )
