"""Whether a leaf is read onto its target sharding directly, or onto the saved grid and resharded.

A restore reads whole saved pieces that meet its boxes. Where the target's
boxes cut the saved pieces (a layer matrix with its two mesh axes swapped, or a
mesh whose minor device axis is another one), each host fetches whole pieces to
use slivers of them: up to one byte in sixty-four is used. No choice of reads is
both exact and few there, so such a leaf is read instead onto a *read sharding*:
a sharding on the target's own devices whose boxes are whole saved cells (each
host reads whole pieces of its own share, nothing more), and then moved to the
target sharding on the devices (:mod:`objckpt.restoring.reshard`), which is far
faster than the object store.

The read sharding is

* the saved mesh rebuilt on these devices with the saved spec, when the target's
  devices are the saved mesh's (the same ids);
* else a mesh over the target's devices ordered by (process, id), each dimension
  split by a factor of its saved split count (so each device's box is whole
  saved cells), the devices left over a minor replication axis.

The choice is a cost model, per leaf: the worst host's bytes fetched ÷ bytes its
devices need, reading directly and reading the read sharding, with a floor: a
leaf is resharded only when that saves the host that fetches most at least
:data:`RESHARD_MIN_SAVED` bytes (or reading it directly fetches more than
:data:`RESHARD_ALWAYS_ABOVE` times what is needed). It is computed by
arithmetic from global facts only (the saved grid, the target sharding, each
device's process), so every process makes the same choice with no messaging,
per dimension and with numpy over hosts rather than per device box in Python;
answers are cached per (saved grid, target sharding), which hundreds of leaves
share, in a :class:`ReadPlanner` that lives for one restore call (nothing here is
kept between restores: the planner, and with it the meshes and shardings it
built, goes when the call ends). Pure: no I/O and no device memory.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from objckpt.core.boxes import named_spec, saved_jax_mesh
from objckpt.core.format import ARRAY_KINDS, Manifest
from objckpt.core.format.v2 import leaf_grid
from objckpt.core.writer_rule import Grid, Mesh, Spec, leading_slabs, slab_count

#: Read directly while the worst host fetches at most this many times the bytes it needs.
RESHARD_ABOVE = 1.1

#: Reshard a leaf only when it saves the host that fetches most at least this many bytes. A
#: reshard is a collective (one ``jax.device_put`` every process joins, and a round of device
#: traffic); for a leaf of a few KiB that costs more than the bytes it saves, which on a
#: store are one round trip's worth at most. Not more than that: a layer stack saved unstacked
#: from a pod gives each host tens of KiB per leaf, and read directly such leaves cost a GET
#: for every sliver of every piece they cut (docs/PERFORMANCE.md "Pod scale"). Read at call
#: time (tests lower it).
RESHARD_MIN_SAVED = 16 << 10

#: ... unless reading directly fetches more than this many times the bytes needed: then the
#: waste adds up over many small leaves (a layer stack's biases), so they are resharded anyway.
RESHARD_ALWAYS_ABOVE = 8.0

#: Axis names of a read sharding built over the target's devices (dimension k splits on ``read<k>``).
READ_AXIS = "read"
REPLICA_AXIS = "read_replica"

#: Cells of the coverage grid worked out at once (hosts are taken in chunks below it).
_CHUNK_CELLS = 1 << 22


@dataclass(frozen=True, eq=False)
class ReadChoice:
    """How one leaf is read, and what each way costs (per host: by process, in ``hosts`` order).

    ``read_mesh`` and ``read_spec`` describe the read sharding (device ids and processes in
    mesh order; axes per dimension); ``None`` when no read sharding lines up with the saved
    cells. Amplifications are the worst host's bytes fetched ÷ bytes its devices' target
    boxes need. ``moved_bytes``: bytes that reach a device's target box from another device
    in the reshard (each device's target box less what its read box already holds), summed
    over the hosts; ``moved_worst_host`` the most any host's devices receive.
    """

    reshard: bool
    direct_amplification: float
    read_amplification: float
    read_mesh: Mesh | None = None
    read_spec: Spec | None = None
    hosts: tuple[int, ...] = ()
    needed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # bytes per host
    fetched_direct: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    fetched_read: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    moved: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # bytes received per host
    device_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # the target's, in mesh order
    device_moved: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # bytes received per device

    @property
    def amplification(self) -> float:
        """The worst host's fetched ÷ needed bytes for the way chosen."""
        return self.read_amplification if self.reshard else self.direct_amplification

    @property
    def moved_bytes(self) -> int:
        return int(self.moved.sum()) if self.reshard else 0

    @property
    def moved_worst_host(self) -> int:
        return int(self.moved.max(initial=0)) if self.reshard else 0

    def host_moved(self, process: int) -> int:
        """Bytes the reshard brings to ``process``'s devices (0 when read directly)."""
        if not self.reshard or process not in self.hosts:
            return 0
        return int(self.moved[self.hosts.index(process)])

    def moved_to(self, devices: Iterable[int]) -> int:
        """Bytes the reshard brings to the devices with these ids (0 when read directly)."""
        if not self.reshard:
            return 0
        return int(self.device_moved[np.isin(self.device_ids, np.fromiter(devices, np.int64))].sum())


DIRECT = ReadChoice(False, 1.0, 1.0)


@dataclass(frozen=True)
class Resharded:
    """A leaf read onto ``read`` (on the target's devices), then moved to ``target``."""

    read: NamedSharding
    target: NamedSharding
    choice: ReadChoice

    def read_target(self, target: Any) -> jax.ShapeDtypeStruct:
        """The target leaf as restore plans it: the same shape and dtype, on the read sharding."""
        return jax.ShapeDtypeStruct(target.shape, target.dtype, sharding=self.read)


def choose(
    grid: Grid,
    target: Mesh,
    spec: Spec,
    *,
    threshold: float = RESHARD_ABOVE,
    min_saved: int | None = None,
    always_above: float | None = None,
    prefer_saved: bool = False,
) -> ReadChoice:
    """The choice for a leaf saved as ``grid``, restored split by ``spec`` on ``target`` (pure).

    ``target``: the target mesh as a :class:`~objckpt.core.writer_rule.Mesh` (device ids in mesh
    order and each one's process). Reshards when the direct worst host exceeds ``threshold``,
    the read sharding's worst host is lower, and the most any host fetches falls by at least
    ``min_saved`` bytes (default :data:`RESHARD_MIN_SAVED`) or the direct worst host exceeds
    ``always_above`` (default :data:`RESHARD_ALWAYS_ABOVE`). ``prefer_saved``: reshard whenever a
    read sharding exists and the target is not the saved sharding (a copy of one process's part
    holds that process's saved boxes only). Global facts only: every process gets the same answer.
    """
    min_saved = RESHARD_MIN_SAVED if min_saved is None else min_saved
    always_above = RESHARD_ALWAYS_ABOVE if always_above is None else always_above
    shape = grid.shape
    if not shape or math.prod(shape) == 0 or len(spec) != len(shape):
        return DIRECT
    if target.axes == grid.mesh.axes and target.devices == grid.mesh.devices and spec == grid.spec:
        return DIRECT  # the saved sharding itself: whole pieces, each read once
    cuts = _piece_cuts(grid)
    lo, hi = _device_boxes(target, spec, shape)
    hosts, members = _hosts(np.asarray(target.processes))
    needed = _union_volume(lo, hi, members, shape) * grid.itemsize
    fetched = _union_volume(*_expand(lo, hi, cuts), members, shape) * grid.itemsize
    direct = _worst(fetched, needed)
    read = _read_grid(grid, target)
    if prefer_saved and read is not None:
        threshold, min_saved, always_above = -math.inf, 0, -math.inf
    if read is None or direct <= threshold:
        return ReadChoice(False, direct, math.inf, hosts=hosts, needed=needed, fetched_direct=fetched)
    read_mesh, read_spec = read
    rlo, rhi = _device_boxes(read_mesh, read_spec, shape)
    order = _positions_of(read_mesh.devices, target.devices)  # read box of each target device
    rlo, rhi = rlo[order], rhi[order]
    fetched_read = _union_volume(*_expand(rlo, rhi, cuts), members, shape) * grid.itemsize
    held = np.prod(np.clip(np.minimum(hi, rhi) - np.maximum(lo, rlo), 0, None), axis=1)
    moved_device = (np.prod(hi - lo, axis=1) - held) * grid.itemsize
    moved = np.zeros(len(hosts), np.int64)
    np.add.at(moved, np.searchsorted(np.asarray(hosts), np.asarray(target.processes)), moved_device)
    via_read = _worst(fetched_read, needed)
    saved = int(fetched.max(initial=0)) - int(fetched_read.max(initial=0))  # on the host that fetches most
    worth = saved >= min_saved or direct > always_above
    return ReadChoice(
        (via_read < direct or prefer_saved) and worth,
        direct,
        via_read,
        read_mesh,
        read_spec,
        hosts,
        needed,
        fetched,
        fetched_read,
        moved,
        np.asarray(target.devices, np.int64),
        moved_device,
    )


class ReadPlanner:
    """Chooses, for a restore's leaves, which are read onto a read sharding and resharded.

    ``process_of``: a device's process (default its ``process_index``; planning benchmarks
    with forced CPU devices in one process stand in for many hosts with another rule, as
    :class:`objckpt.core.boxes.MeshTable` takes). ``threshold``, ``min_saved``,
    ``always_above`` and ``prefer_saved``: see :func:`choose`. Meshes and answers are cached: the leaves of a
    model share a few (saved grid, target sharding) pairs. The caches hold one entry per
    distinct pair (and per distinct mesh), grow only while the planner lives, and keep
    the target shardings' meshes alive with it: make one per restore.
    """

    def __init__(
        self,
        process_of: Callable[[Any], int] | None = None,
        *,
        threshold: float = RESHARD_ABOVE,
        min_saved: int | None = None,
        always_above: float | None = None,
        prefer_saved: bool = False,
    ) -> None:
        self._process_of = process_of or (lambda device: int(device.process_index))
        self._choose = functools.partial(
            choose, threshold=threshold, min_saved=min_saved, always_above=always_above, prefer_saved=prefer_saved
        )
        self._meshes: dict[Any, Mesh] = {}
        self._choices: dict[tuple[Any, ...], ReadChoice] = {}
        self._shardings: dict[tuple[Any, ...], NamedSharding] = {}

    def choose(self, grid: Grid, sharding: NamedSharding) -> ReadChoice:
        """The choice for a leaf saved as ``grid`` restored onto ``sharding``."""
        key = (grid.mesh, grid.spec, grid.shape, grid.itemsize, grid.slab_bytes, sharding)
        found = self._choices.get(key)
        if found is None:
            spec = named_spec(sharding, len(grid.shape))
            mesh = sharding.mesh
            assert isinstance(mesh, jax.sharding.Mesh)  # plan_read_shardings passes concrete meshes only
            found = self._choices[key] = self._choose(grid, self.mesh(mesh), spec)
        return found

    def mesh(self, mesh: jax.sharding.Mesh) -> Mesh:
        """``mesh`` as a saved-style description: axes, device ids and processes in mesh order."""
        found = self._meshes.get(mesh)
        if found is None:
            devices = list(mesh.devices.flat)
            found = self._meshes[mesh] = Mesh(
                tuple((str(a), int(n)) for a, n in mesh.shape.items()),
                tuple(int(d.id) for d in devices),
                tuple(self._process_of(d) for d in devices),
            )
        return found

    def read_sharding(self, choice: ReadChoice, sharding: NamedSharding) -> NamedSharding:
        """The read sharding of ``choice`` on ``sharding``'s own devices."""
        assert choice.read_mesh is not None and choice.read_spec is not None
        key = (choice.read_mesh, choice.read_spec)
        found = self._shardings.get(key)
        if found is None:
            devices = {int(d.id): d for d in sharding.mesh.devices.flat}
            mesh = saved_jax_mesh(choice.read_mesh.axes, choice.read_mesh.devices, devices)
            entries = [None if not axes else axes[0] if len(axes) == 1 else axes for axes in choice.read_spec]
            found = self._shardings[key] = NamedSharding(mesh, PartitionSpec(*entries))
        return found


def plan_read_shardings(
    manifest: Manifest, selection: Mapping[int, Any], *, planner: ReadPlanner | None = None
) -> dict[int, Resharded]:
    """The leaves of ``selection`` (saved leaf → target leaf) read onto a read sharding and resharded.

    Only leaves saved as a grid (format version 2, from a ``NamedSharding``) restored onto a
    ``NamedSharding`` on a concrete mesh qualify; PRNG keys, host numpy targets and every
    other leaf are read directly. Every process gets the same answer. ``planner``: a new
    :class:`ReadPlanner` (its caches go with this call) unless given.
    """
    planner = planner or ReadPlanner()
    out: dict[int, Resharded] = {}
    for i, target in sorted(selection.items()):
        entry = manifest.leaves[i]
        sharding = getattr(target, "sharding", None) if isinstance(target, (jax.ShapeDtypeStruct, jax.Array)) else None
        if entry.kind not in ARRAY_KINDS or entry.prng_impl is not None or not isinstance(sharding, NamedSharding):
            continue
        if not isinstance(sharding.mesh, jax.sharding.Mesh) or getattr(sharding.spec, "unreduced", None):
            continue
        if tuple(target.shape) != tuple(entry.shape or ()) or len(sharding.spec) > len(target.shape):
            continue
        if any(e is not None and not isinstance(e, (str, tuple)) for e in sharding.spec):
            continue
        grid = leaf_grid(manifest, i) if getattr(manifest, "meshes", None) else None
        if grid is None:
            continue
        choice = planner.choose(grid, sharding)
        if choice.reshard:
            out[i] = Resharded(planner.read_sharding(choice, sharding), sharding, choice)
    return out


def _read_grid(grid: Grid, target: Mesh) -> tuple[Mesh, Spec] | None:
    """The read sharding's mesh and spec on ``target``'s devices, or None when none lines up."""
    if sorted(target.devices) == sorted(grid.mesh.devices):
        process = dict(zip(target.devices, target.processes))
        return Mesh(grid.mesh.axes, grid.mesh.devices, tuple(process[d] for d in grid.mesh.devices)), grid.spec
    order = sorted(zip(target.processes, target.devices))
    left = len(order)
    factors = []
    for split in grid.splits:
        factors.append(math.gcd(split, left))
        left //= factors[-1]
    if math.prod(factors) == 1:
        return None  # nothing to split along the saved cells: every device would read everything
    axes = tuple((f"{READ_AXIS}{k}", f) for k, f in enumerate(factors)) + ((REPLICA_AXIS, left),)
    spec = tuple((f"{READ_AXIS}{k}",) if f > 1 else () for k, f in enumerate(factors))
    return Mesh(axes, tuple(d for _, d in order), tuple(p for p, _ in order)), spec


def _piece_cuts(grid: Grid) -> list[np.ndarray]:
    """Per dimension, the sorted boundaries of the saved pieces (cells, and the slabs of
    replicated cells along the leading axis: every cell of a grid is cut alike)."""
    cuts = [np.arange(k + 1, dtype=np.int64) * c for k, c in zip(grid.splits, grid.cell_shape)]
    sizes = dict(grid.mesh.axes)
    used = {a for axes in grid.spec for a in axes}
    replicas = math.prod(n for a, n in sizes.items() if a not in used)
    if replicas > 1:
        box = grid.cell_box((0,) * len(grid.shape))
        parts = slab_count(box, grid.itemsize, replicas, grid.slab_bytes)
        if parts > 1:
            rows = np.asarray([start[0] for start, _ in leading_slabs(box, parts)], np.int64)
            starts = (np.arange(grid.splits[0], dtype=np.int64) * grid.cell_shape[0])[:, None] + rows[None, :]
            cuts[0] = np.append(starts.ravel(), grid.shape[0])
    return cuts


def _device_boxes(mesh: Mesh, spec: Spec, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(start, stop) of each device's box in mesh order, as (devices, dims) arrays: JAX's
    chunks (the last one short when a split does not divide its dimension)."""
    sizes = mesh.shape
    coords = np.unravel_index(np.arange(len(mesh.devices)), sizes) if sizes else ()
    index = mesh.axis_index
    lo = np.zeros((len(mesh.devices), len(shape)), np.int64)
    hi = np.empty_like(lo)
    for d, (n, axes) in enumerate(zip(shape, spec)):
        block = np.zeros(len(mesh.devices), np.int64)
        count = 1
        for a in axes:  # the first axis major
            k = index[a]
            block = block * sizes[k] + coords[k]
            count *= sizes[k]
        chunk = -(-n // count)
        lo[:, d] = np.minimum(block * chunk, n)
        hi[:, d] = np.minimum(lo[:, d] + chunk, n)
    return lo, hi


def _expand(lo: np.ndarray, hi: np.ndarray, cuts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Boxes widened to the saved pieces they meet (empty boxes stay empty)."""
    elo, ehi = lo.copy(), hi.copy()
    for d, cut in enumerate(cuts):
        empty = hi[:, d] <= lo[:, d]
        elo[:, d] = np.where(empty, lo[:, d], cut[np.searchsorted(cut, lo[:, d], side="right") - 1])
        ehi[:, d] = np.where(
            empty, hi[:, d], cut[np.minimum(np.searchsorted(cut, hi[:, d], side="left"), len(cut) - 1)]
        )
    return elo, ehi


def _hosts(processes: np.ndarray) -> tuple[tuple[int, ...], np.ndarray]:
    """The processes, sorted, and per process the positions of its devices as a padded
    (hosts, most devices) array (a short row repeats its first device: a box counted twice
    in a union counts once)."""
    order = np.argsort(processes, kind="stable")
    hosts, starts, counts = np.unique(processes[order], return_index=True, return_counts=True)
    width = int(counts.max())
    offsets = np.minimum(np.arange(width)[None, :], counts[:, None] - 1)
    return tuple(int(h) for h in hosts), order[starts[:, None] + offsets]


def _union_volume(lo: np.ndarray, hi: np.ndarray, members: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Per host, the volume (elements) of the union of its devices' boxes.

    Dimensions that no box cuts multiply the volume; over the others, each host's boxes are
    compressed onto the grid of their own boundaries and the covered cells summed.
    """
    active = [d for d in range(lo.shape[1]) if (lo[:, d] != 0).any() or (hi[:, d] != shape[d]).any()]
    whole = math.prod(shape[d] for d in range(len(shape)) if d not in active)
    hosts, k = members.shape
    if not active:
        return np.full(hosts, whole, np.int64)
    blo, bhi = lo[members][:, :, active], hi[members][:, :, active]  # (hosts, k, dims)
    cells = (2 * k - 1) ** len(active) * k
    step = max(1, _CHUNK_CELLS // cells)
    out = np.empty(hosts, np.int64)
    for s in range(0, hosts, step):
        out[s : s + step] = _compressed_union(blo[s : s + step], bhi[s : s + step])
    return out * whole


def _compressed_union(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Union volume of each row's boxes ((hosts, k, dims) starts and stops)."""
    hosts, _, dims = lo.shape
    covered: np.ndarray | None = None
    volume: np.ndarray | None = None
    for d in range(dims):
        bounds = np.sort(np.concatenate([lo[:, :, d], hi[:, :, d]], axis=1), axis=1)  # (hosts, 2k)
        inside = (lo[:, :, d, None] <= bounds[:, None, :-1]) & (bounds[:, None, 1:] <= hi[:, :, d, None])
        length = np.diff(bounds, axis=1)  # (hosts, 2k - 1)
        view = (hosts, lo.shape[1]) + (1,) * d + (length.shape[1],) + (1,) * (dims - d - 1)
        part = inside.reshape(view)
        covered = part if covered is None else covered & part
        lview = (hosts,) + (1,) * d + (length.shape[1],) + (1,) * (dims - d - 1)
        volume = length.reshape(lview) if volume is None else volume * length.reshape(lview)
    assert covered is not None and volume is not None
    return (covered.any(axis=1) * volume).reshape(hosts, -1).sum(axis=1)


def _worst(fetched: np.ndarray, needed: np.ndarray) -> float:
    """The largest fetched ÷ needed over hosts that need bytes."""
    mask = needed > 0
    return float((fetched[mask] / needed[mask]).max()) if mask.any() else 1.0


def _positions_of(order: tuple[int, ...], devices: tuple[int, ...]) -> np.ndarray:
    """For each id in ``devices``, its position in ``order`` (the same ids, another order)."""
    ids = np.asarray(order)
    sort = np.argsort(ids)
    return sort[np.searchsorted(ids, np.asarray(devices), sorter=sort)]
