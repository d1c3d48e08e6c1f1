"""JAX arrays ↔ boxes of host bytes.

Save side: decide which process writes which box of each ``jax.Array``. For a
``NamedSharding`` that cuts the array into equal cells (nearly always) the rule
is :mod:`objckpt.core.writer_rule`'s, applied to this process's own shards only: a
replicated cell is cut into slabs along its leading axis, one per replica down
to a minimum slab size, so under data parallelism every host uploads a share and
no byte is written twice across the job. Any other sharding falls back to
scanning every device's index (the same rule, computed globally). Restore
side: the boxes a target sharding needs on this process's devices.

:func:`needed_boxes` keeps its answers in a cache of at most 256 entries, each a
target sharding (and with it its mesh and devices) and its boxes here: objckpt
is a guest in the training process, so restore empties it when it ends
(:func:`forget_needed_boxes`) and keeps no user's mesh alive between calls.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from objckpt.core.device_reads import host_view
from objckpt.core.plan import Index, OwnedPiece
from objckpt.core.writer_rule import Box, Grid, Mesh, Spec, grid_fits


class MeshTable:
    """The meshes a save's leaves are sharded on, numbered in the order first met.

    Every process meets the leaves in the same order, so it numbers the meshes
    alike with no messaging. Each saved :class:`~objckpt.core.writer_rule.Mesh` is
    built once (its device ids and their processes: O(devices)) and shared by
    the leaves on it, with its cache of cell replicas.
    """

    def __init__(self, process_of: Callable[[Any], int] | None = None) -> None:
        self._index: dict[Any, int] = {}
        self.meshes: list[Mesh] = []
        # A device's process: its own process_index (planning benchmarks stand in for pods with another rule).
        self._process_of = process_of or (lambda device: int(device.process_index))

    def number(self, mesh: Any) -> int:
        """The number of ``mesh`` (a ``jax.sharding.Mesh``) in this save, adding it when new."""
        found = self._index.get(mesh)
        if found is None:
            devices = list(mesh.devices.flat)
            saved = Mesh(
                tuple((str(a), int(n)) for a, n in mesh.shape.items()),
                tuple(int(d.id) for d in devices),
                tuple(self._process_of(d) for d in devices),
            )
            found = self._index[mesh] = len(self.meshes)
            self.meshes.append(saved)
        return found


def named_spec(sharding: jax.sharding.NamedSharding, rank: int) -> Spec:
    """A NamedSharding's spec as per-dimension tuples of axis names, padded to ``rank``."""
    out: list[tuple[str, ...]] = []
    for entry in tuple(sharding.spec) + (None,) * (rank - len(sharding.spec)):
        if entry is None:
            out.append(())
        elif isinstance(entry, tuple):
            out.append(tuple(str(a) for a in entry))
        else:
            out.append((str(entry),))
    return tuple(out)


def grid_of(leaf: int, array: Any, meshes: MeshTable, *, slab_bytes: int) -> tuple[Grid, dict[str, Any]] | None:
    """The saved grid of ``array`` (a jax.Array, or anything with its shape, dtype and
    sharding) and its writers for the manifest (its ``layout`` key), or None when its sharding is not one."""
    sharding = array.sharding
    rank = len(array.shape)
    if not isinstance(sharding, jax.sharding.NamedSharding) or len(sharding.spec) > rank:
        return None
    if any(entry is not None and not isinstance(entry, (str, tuple)) for entry in sharding.spec):
        return None  # UNCONSTRAINED and the like
    spec = named_spec(sharding, rank)
    number = meshes.number(sharding.mesh)
    mesh = meshes.meshes[number]
    if not grid_fits(array.shape, spec, mesh):
        return None
    grid = Grid(mesh, spec, tuple(array.shape), np.dtype(array.dtype).itemsize, leaf, slab_bytes)
    return grid, {"mesh": number, "spec": [list(axes) for axes in spec]}


def index_to_box(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> Box:
    """A tuple of slices (as JAX's sharding maps give; None: the whole array) → an explicit ``(start, stop)`` box."""
    start, stop = [], []
    for s, n in zip(index if index is not None else (slice(None),) * len(shape), shape):
        a, b, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        start.append(a)
        stop.append(b)
    return tuple(start), tuple(stop)


def box_to_slices(start: Index, stop: Index, origin: Index | None = None) -> tuple[slice, ...]:
    """Slices selecting ``[start, stop)`` from an array whose first element sits at ``origin``.

    Built with ``map`` rather than a generator: restore calls this twice for
    every (piece, box) overlap it copies (a small model: ~5,000 calls).
    """
    if not origin:
        return tuple(map(slice, start, stop))
    return tuple(map(slice, map(operator.sub, start, origin), map(operator.sub, stop, origin)))


def _replica_slices(box: Box, replicas: int) -> list[Box]:
    """Cut a box into at most ``replicas`` slabs along one axis (the first long enough)."""
    start, stop = box
    extents = [b - a for a, b in zip(start, stop)]
    if not extents:
        return [box]
    axis = next((d for d, n in enumerate(extents) if n >= replicas), int(np.argmax(extents)))
    parts = min(replicas, extents[axis])
    out = []
    for k in range(parts):
        a = start[axis] + extents[axis] * k // parts
        b = start[axis] + extents[axis] * (k + 1) // parts
        out.append(((*start[:axis], a, *start[axis + 1 :]), (*stop[:axis], b, *stop[axis + 1 :])))
    return out


def local_shards(array: jax.Array) -> list[tuple[int, tuple[slice, ...], Any]]:
    """(device id, index, data) of each of ``array``'s shards on this process's devices."""
    return [(shard.device.id, shard.index, shard.data) for shard in array.addressable_shards]


def grid_pieces(leaf: int, grid: Grid, shards: list[tuple[int, tuple[slice, ...], Any]]) -> list[OwnedPiece]:
    """The boxes that this process's own ``shards`` (see :func:`local_shards`) write under ``grid``'s rule.

    Looks at this host's shards only: the cost follows its share, not the
    number of devices in the job.
    """
    if math.prod(grid.shape) == 0:
        return []
    out = []
    cell_shape = grid.cell_shape
    itemsize = grid.itemsize
    for device_id, index, data in shards:
        start, _ = index_to_box(index, grid.shape)
        cell = tuple(a // s if s else 0 for a, s in zip(start, cell_shape))
        origin = grid.cell_box(cell)[0]
        writers = grid.writers(cell)
        shared = len(grid.replicas(cell)) > 1
        for (a, b), device, _ in writers:
            if device == device_id:
                out.append(OwnedPiece(leaf, a, b, itemsize, source=(data, origin), device=device_id, shared=shared))
    return out


def owned_pieces(leaf: int, array: jax.Array, *, split_above: int) -> tuple[list[OwnedPiece], list[int]]:
    """The boxes of ``array`` that this process writes, each tied to a local shard, and
    the processes that write any box of it, for a sharding that is not a grid.

    Every process computes the same global assignment from the sharding alone
    (no messaging, but a scan of every device's index) and keeps the boxes owned
    by its addressable devices.
    """
    shape = tuple(array.shape)
    if math.prod(shape) == 0:
        return [], []
    itemsize = np.dtype(array.dtype).itemsize
    replicas: dict[Box, list[Any]] = defaultdict(list)
    for device, index in array.sharding.devices_indices_map(shape).items():
        replicas[index_to_box(index, shape)].append(device)
    local = {shard.device: shard for shard in array.addressable_shards}
    out = []
    writers: set[int] = set()
    for box, devices in replicas.items():
        devices.sort(key=lambda d: d.id)
        nbytes = math.prod(b - a for a, b in zip(*box)) * itemsize
        if len(devices) > 1 and nbytes >= split_above:
            assignment = list(zip(_replica_slices(box, len(devices)), devices))
        else:  # too small to split: rotate the owner by leaf so small leaves spread out
            assignment = [(box, devices[(leaf + sum(box[0])) % len(devices)])]
        for (start, stop), device in assignment:
            writers.add(device.process_index)
            shard = local.get(device)
            if shard is not None:
                out.append(OwnedPiece(leaf, start, stop, itemsize, source=(shard.data, box[0]), device=device.id))
    return out, sorted(writers)


def copy_piece_into(piece: OwnedPiece, dest: np.ndarray, host: np.ndarray | None = None) -> None:
    """Copy the bytes of ``piece`` from its source into ``dest`` (a view shaped like the piece).

    The destination is a staging buffer this module owns: the copy never keeps
    a view of device memory, which training may donate right after save returns.
    ``host``: the source's host bytes when the caller has read them already (through an
    alias, :mod:`objckpt.core.device_reads`); otherwise the source is read through
    :func:`~objckpt.core.device_reads.host_view`, which caches nothing in ``_npy_value``.
    """
    source, origin = piece.source
    if host is None:
        host = host_view(source)
    dest[...] = host[box_to_slices(piece.start, piece.stop, origin)]


def piece_bytes_of(piece: OwnedPiece, host: np.ndarray) -> memoryview | None:
    """The bytes of ``piece`` as they lie in ``host`` (its shard's host bytes), or None when they
    are not one contiguous run of it (a whole shard or a run of its leading rows are)."""
    _, origin = piece.source
    view = host[box_to_slices(piece.start, piece.stop, origin)]
    if not view.flags.c_contiguous:
        return None
    return view.reshape(-1).view(np.uint8).data


def needed_boxes(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...], devices: frozenset[Any] | None = None
) -> dict[Box, list[Any]]:
    """Unique boxes this process needs for ``sharding``, each with its local devices
    (``devices``: those devices instead of this process's; planning benchmarks stand in for one host of a pod).

    Computed once per (sharding, shape, devices): JAX's map of every device's index
    costs O(devices) (milliseconds at 4,096 devices), and the hundreds of leaves of
    a layer stack share their sharding and shape. Each call returns a new dict.
    """
    try:
        found = _needed_boxes(sharding, tuple(shape), devices)
    except TypeError:  # an unhashable sharding: nothing to share
        found = _boxes_of(sharding, tuple(shape), devices)
    return {box: list(boxed) for box, boxed in found}


def forget_needed_boxes() -> None:
    """Empty :func:`needed_boxes`'s cache (restore calls it when it ends: see the module's docstring)."""
    _needed_boxes.cache_clear()


@functools.lru_cache(maxsize=256)
def _needed_boxes(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...], devices: frozenset[Any] | None
) -> tuple[tuple[Box, tuple[Any, ...]], ...]:
    return _boxes_of(sharding, shape, devices)


def _boxes_of(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...], devices: frozenset[Any] | None
) -> tuple[tuple[Box, tuple[Any, ...]], ...]:
    boxes: dict[Box, list[Any]] = defaultdict(list)
    if devices is None:
        found = sharding.addressable_devices_indices_map(shape)
    else:
        every = sharding.devices_indices_map(shape)
        found = {d: every[d] for d in sorted(devices, key=lambda d: d.id) if d in every}
    for device, index in found.items():
        boxes[index_to_box(index, shape)].append(device)
    return tuple((box, tuple(boxed)) for box, boxed in boxes.items())


def describe_sharding(sharding: jax.sharding.Sharding) -> dict[str, Any]:
    """A small JSON description of a sharding, for ``inspect``; restore reads only its
    ``axis_types`` (:func:`axis_type_names`), which the saved mesh does not record."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        described = {
            "type": "NamedSharding",
            "mesh": {str(k): int(v) for k, v in sharding.mesh.shape.items()},
            "spec": [None if p is None else (list(p) if isinstance(p, tuple) else str(p)) for p in sharding.spec],
        }
        types = getattr(sharding.mesh, "axis_types", None)
        if types:
            described["axis_types"] = [getattr(t, "name", str(t)) for t in types]
        return described
    return {"type": type(sharding).__name__, "devices": len(sharding.device_set)}


def axis_type_names(raw: Any, count: int) -> tuple[str, ...] | None:
    """``count`` axis types as saved (``"Explicit"``, or Orbax's ``"AxisType.Explicit"``) as
    names of ``jax.sharding.AxisType``, or None when ``raw`` is not that (descriptions are
    informational: what does not fit is ignored)."""
    known = getattr(jax.sharding, "AxisType", None)
    if known is None or not isinstance(raw, list) or len(raw) != count:
        return None
    names = tuple(t.removeprefix("AxisType.") if isinstance(t, str) else "" for t in raw)
    return names if all(name in known.__members__ for name in names) else None


def saved_jax_mesh(
    axes: tuple[tuple[str, int], ...],
    ids: tuple[int, ...],
    devices: dict[int, Any],
    axis_types: tuple[str, ...] | None = None,
) -> jax.sharding.Mesh:
    """A saved mesh (axis names and sizes, device ids in C order) rebuilt on ``devices``
    (this job's, by id), axis types as given (names of ``jax.sharding.AxisType``), else
    JAX's ``Mesh`` default. Every id must be in ``devices``."""
    grid = np.empty(len(ids), dtype=object)
    grid[:] = [devices[i] for i in ids]
    names = tuple(name for name, _ in axes)
    shape = tuple(size for _, size in axes)
    if axis_types is None:
        return jax.sharding.Mesh(grid.reshape(shape), names)
    kinds = tuple(jax.sharding.AxisType[t] for t in axis_types)
    return jax.sharding.Mesh(grid.reshape(shape), names, axis_types=kinds)


def saved_partition_spec(spec: list[list[str]]) -> jax.sharding.PartitionSpec:
    """A saved spec (axis names per dimension) as a ``PartitionSpec``, without trailing
    unsplit dimensions (as specs are usually written: ``P("x")``, ``P()``)."""
    entries = [None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return jax.sharding.PartitionSpec(*entries)
