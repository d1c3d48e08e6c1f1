"""Who writes which box of a leaf, by arithmetic: the rule save and restore share.

A leaf saved from a ``NamedSharding`` is described in the root manifest by its
mesh (device ids in mesh order, each with its process) and its partition spec.
From those alone, with no list of pieces, anyone computes the grid of cells
(each dimension cut into equal chunks by the mesh axes the spec names), the
devices that hold each cell (its replicas, sorted by device id), and which
replica writes which part of it:

* a cell held by one device is written whole by that device;
* a replicated cell of at least ``2 × slab_bytes`` is cut along its leading
  axis into contiguous slabs of at least ``slab_bytes`` (at most one per replica),
  slab ``k`` written by replica ``((leaf + cell) × parts + k) mod R``, so that
  consecutive leaves use different replicas;
* a smaller replicated cell is written whole by one of the first
  ``SMALL_OWNERS`` processes among its replicas, rotating with the leaf, so
  small replicated leaves (norms, biases) spread over a few processes without
  making every reader fetch every process's index.

The saver uses it to pick the pieces its own devices write (never scanning all
devices); the restorer uses it to name the processes whose index objects hold
the pieces a target box needs. Pure: no JAX, no I/O.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

Index = tuple[int, ...]
#: A box of a leaf: its ``(start, stop)`` corners, ``stop`` exclusive.
Box = tuple[Index, Index]

#: A small replicated cell is written by one of the first this-many processes holding it.
SMALL_OWNERS = 8


@dataclass(frozen=True, eq=False)
class Mesh:
    """A device mesh as saved: axis names and sizes, and each device's id and process in mesh (C) order.

    Compared and hashed by identity: a manifest's leaves share their mesh
    object, which caches the replicas of each cell it was asked about (a
    replicated norm on 4,096 devices has 4,096 of them, and hundreds of leaves
    share that answer) and :meth:`Grid.processes_for`'s answers. Both caches hold
    one entry per distinct question (cell, or geometry and box) and live as long
    as the mesh, that is as the manifest read for one restore or save: nothing is
    kept between calls.
    """

    axes: tuple[tuple[str, int], ...]
    devices: tuple[int, ...]
    processes: tuple[int, ...]

    @cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.axes)

    @cached_property
    def axis_index(self) -> dict[str, int]:
        return {name: k for k, (name, _) in enumerate(self.axes)}

    @cached_property
    def _replica_cache(self) -> dict[tuple[Spec, Index], list[tuple[int, int]]]:
        return {}

    @cached_property
    def writer_cache(self) -> dict[tuple[object, ...], frozenset[int]]:
        """:meth:`Grid.processes_for`'s answers that hold for any leaf (no replicated cell
        met), by grid geometry and box: the leaves of a layer stack ask the same question."""
        return {}

    def replicas(self, spec: Spec, cell: Index) -> list[tuple[int, int]]:
        """(device id, process) of every device holding ``cell`` of a leaf split by ``spec``, by device id."""
        key = (spec, cell)
        found = self._replica_cache.get(key)
        if found is None:
            found = self._replica_cache[key] = self._find_replicas(spec, cell)
        return found

    def _find_replicas(self, spec: Spec, cell: Index) -> list[tuple[int, int]]:
        sizes = self.shape
        index = self.axis_index
        fixed = [0] * len(sizes)
        for axes, c in zip(spec, cell):
            for a in reversed(axes):  # mixed radix, the last axis minor
                k = index[a]
                fixed[k] = c % sizes[k]
                c //= sizes[k]
        used = {a for axes in spec for a in axes}
        free = [k for k, (name, _) in enumerate(self.axes) if name not in used]
        out = []
        for combo in _positions([sizes[k] for k in free]):
            position = list(fixed)
            for k, v in zip(free, combo):
                position[k] = v
            flat = _flat(position, sizes)
            out.append((self.devices[flat], self.processes[flat]))
        out.sort()
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "axes": [[a, n] for a, n in self.axes],
            "devices": list(self.devices),
            "processes": list(self.processes),
        }


Spec = tuple[tuple[str, ...], ...]  # per dimension, the mesh axes that split it (major first); () = whole


@dataclass(frozen=True)
class Grid:
    """One leaf's saved grid: the cells of ``shape`` under ``spec`` on ``mesh``, and their writers."""

    mesh: Mesh
    spec: Spec
    shape: Index
    itemsize: int
    leaf: int
    slab_bytes: int

    @cached_property
    def splits(self) -> tuple[int, ...]:
        """How many cells each dimension is cut into."""
        sizes = dict(self.mesh.axes)
        return tuple(math.prod(sizes[a] for a in axes) for axes in self.spec)

    @cached_property
    def cell_shape(self) -> Index:
        return tuple(n // k for n, k in zip(self.shape, self.splits))

    def cell_box(self, cell: Index) -> Box:
        shape = self.cell_shape
        start = tuple(map(operator.mul, cell, shape))
        return start, tuple(map(operator.add, start, shape))

    def replicas(self, cell: Index) -> list[tuple[int, int]]:
        """(device id, process) of every device holding ``cell``, sorted by device id."""
        return self.mesh.replicas(self.spec, cell)

    def cell_number(self, cell: Index) -> int:
        return _flat(cell, self.splits)

    def writers(self, cell: Index) -> list[tuple[Box, int, int]]:
        """(box, device id, process) for each part of ``cell`` and the replica that writes it."""
        box = self.cell_box(cell)
        replicas = self.replicas(cell)
        count = len(replicas)
        if count == 1:
            device, process = replicas[0]
            return [(box, device, process)]
        turn = self.leaf + self.cell_number(cell)
        parts = slab_count(box, self.itemsize, count, self.slab_bytes)
        if parts == 1:
            owners = _first_processes(replicas, SMALL_OWNERS)
            device, process = owners[turn % len(owners)]
            return [(box, device, process)]
        return [
            (slab, *replicas[(turn * parts + k) % count])  # type: ignore[misc]
            for k, slab in enumerate(leading_slabs(box, parts))
        ]

    def cells_meeting(self, start: Index, stop: Index) -> Iterable[Index]:
        """Every cell that meets the box ``[start, stop)``."""
        ranges = [
            range(a // s, min(-(-b // s), k)) if s else range(0)
            for a, b, s, k in zip(start, stop, self.cell_shape, self.splits)
        ]
        return _product(ranges)

    def processes_for(self, start: Index, stop: Index) -> set[int]:
        """The processes that wrote any part of ``[start, stop)``.

        Where no cell the box meets is replicated, the answer does not depend on
        the leaf (only replicated cells rotate their writers with it): it is kept
        on the mesh for every leaf of the same shape, spec and itemsize.
        """
        key = (self.spec, self.shape, self.itemsize, self.slab_bytes, start, stop)
        cache = self.mesh.writer_cache
        found = cache.get(key)
        if found is not None:
            return set(found)
        out: set[int] = set()
        any_leaf = True
        for cell in self.cells_meeting(start, stop):
            if any_leaf and len(self.replicas(cell)) > 1:
                any_leaf = False
            for (a, b), _, process in self.writers(cell):
                if all(x0 < y1 and y0 < x1 for x0, x1, y0, y1 in zip(a, b, start, stop)):
                    out.add(process)
        if any_leaf:
            cache[key] = frozenset(out)
        return out


def slab_count(box: Box, itemsize: int, replicas: int, slab_bytes: int) -> int:
    """Slabs a replicated box is cut into: one per replica at most, each at least
    ``slab_bytes`` and at least one row of its leading axis."""
    start, stop = box
    if not start:
        return 1
    nbytes = math.prod(b - a for a, b in zip(start, stop)) * itemsize
    return max(1, min(replicas, stop[0] - start[0], nbytes // max(slab_bytes, 1)))


def leading_slabs(box: Box, parts: int) -> list[Box]:
    """``box`` cut into ``parts`` contiguous runs of rows along its leading axis."""
    start, stop = box
    rows = stop[0] - start[0]
    return [
        ((start[0] + rows * k // parts, *start[1:]), (start[0] + rows * (k + 1) // parts, *stop[1:]))
        for k in range(parts)
    ]


def grid_fits(shape: Sequence[int], spec: Spec, mesh: Mesh) -> bool:
    """Whether ``spec`` cuts every dimension of ``shape`` into equal cells on ``mesh``."""
    sizes = dict(mesh.axes)
    if len(spec) != len(shape):
        return False
    seen: set[str] = set()
    for n, axes in zip(shape, spec):
        for a in axes:
            if a not in sizes or a in seen:
                return False
            seen.add(a)
        if n % math.prod(sizes[a] for a in axes):
            return False
    return True


def _first_processes(replicas: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """The first replica of each of the first ``count`` processes, in device-id order."""
    out: list[tuple[int, int]] = []
    seen: set[int] = set()
    for device, process in replicas:
        if process not in seen:
            seen.add(process)
            out.append((device, process))
            if len(out) == count:
                break
    return out


def _flat(position: Sequence[int], sizes: Sequence[int]) -> int:
    flat = 0
    for p, n in zip(position, sizes):
        flat = flat * n + p
    return flat


def _positions(sizes: Sequence[int]) -> Iterable[tuple[int, ...]]:
    return _product([range(n) for n in sizes])


def _product(ranges: Sequence[range]) -> Iterable[tuple[int, ...]]:
    combos: list[tuple[int, ...]] = [()]
    for r in ranges:
        combos = [c + (v,) for c in combos for v in r]
    return combos
