"""The choice between reading a leaf directly and reading it on the saved grid, then resharding
(objckpt.restoring.read_sharding): pure, at 64-128 stand-in devices, checked against a brute-force
count of the saved pieces each host fetches."""

from __future__ import annotations

import itertools
import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from objckpt.core.writer_rule import Grid, Mesh
from objckpt.restoring import read_sharding
from objckpt.restoring.read_sharding import REPLICA_AXIS, RESHARD_MIN_SAVED, ReadPlanner, choose

SLAB = 1 << 10


@pytest.fixture(autouse=True)
def no_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leaves here are a few KiB: the cost model is checked without the floor, which its own tests set."""
    monkeypatch.setattr(read_sharding, "RESHARD_MIN_SAVED", 0)


def _mesh(axes, ids, per_host):
    ids = [int(i) for i in ids]
    return Mesh(tuple(axes), tuple(ids), tuple(i // per_host for i in ids))


def _grid(mesh, spec, shape, itemsize=4, leaf=0):
    return Grid(mesh, spec, shape, itemsize, leaf, SLAB)


def _boxes(mesh, spec, shape):
    """Each device's box, by device id, worked out one device at a time (the slow way)."""
    sizes = dict(mesh.axes)
    names = [a for a, _ in mesh.axes]
    out = {}
    for flat, device in enumerate(mesh.devices):
        coords = dict(zip(names, np.unravel_index(flat, mesh.shape)))
        start, stop = [], []
        for n, axes in zip(shape, spec):
            block, count = 0, 1
            for a in axes:
                block, count = block * sizes[a] + int(coords[a]), count * sizes[a]
            chunk = -(-n // count)
            start.append(min(block * chunk, n))
            stop.append(min(block * chunk + chunk, n))
        out[device] = (tuple(start), tuple(stop))
    return out


def _meets(a, b):
    return all(x0 < y1 and y0 < x1 for x0, x1, y0, y1 in zip(a[0], a[1], b[0], b[1]))


def _volume(box):
    return math.prod(b - a for a, b in zip(*box))


def _brute(grid, mesh, spec):
    """Per host: (bytes its devices' boxes need, bytes of the saved pieces meeting them)."""
    pieces = [box for cell in itertools.product(*map(range, grid.splits)) for box, _, _ in grid.writers(cell)]
    boxes = _boxes(mesh, spec, grid.shape)
    out = {}
    for host in sorted(set(mesh.processes)):
        mine = {boxes[d] for d, p in zip(mesh.devices, mesh.processes) if p == host}
        fetched = {piece for piece in pieces if any(_meets(piece, box) for box in mine)}
        cells = set()  # needed: the union of its boxes, element by element over a coarse grid of their bounds
        for box in mine:
            cells |= set(itertools.product(*(range(a, b) for a, b in zip(*box))))
        out[host] = (len(cells) * grid.itemsize, sum(map(_volume, fetched)) * grid.itemsize)
    return out


SAVED = _mesh([("fsdp", 16), ("tensor", 4)], range(64), per_host=4)
SHAPE = (64, 32)
LAYERS = (("fsdp",), ("tensor",))
SWAPPED = (("tensor",), ("fsdp",))


def _fsdp_minor(n_fsdp, n_tensor, per_host):
    ids = np.arange(n_fsdp * n_tensor).reshape(n_tensor, n_fsdp).T.ravel()
    return _mesh([("fsdp", n_fsdp), ("tensor", n_tensor)], ids, per_host)


CASES = {
    "swapped axes": (SAVED, SWAPPED),
    "fsdp minor, tensor=8": (_fsdp_minor(8, 8, 4), LAYERS),
    "P(None, 'tensor') on tensor=32": (_mesh([("fsdp", 2), ("tensor", 32)], range(64), 4), ((), ("tensor",))),
    "other device count": (_mesh([("tensor", 8), ("fsdp", 16)], range(128), 4), LAYERS),
}


@pytest.mark.parametrize("case", CASES)
def test_the_cost_model_counts_what_each_host_fetches_and_needs(case: str) -> None:
    mesh, spec = CASES[case]
    grid = _grid(SAVED, LAYERS, SHAPE)
    choice = choose(grid, mesh, spec, threshold=0.0)
    brute = _brute(grid, mesh, spec)
    assert choice.hosts == tuple(sorted(brute))
    assert choice.needed.tolist() == [brute[h][0] for h in choice.hosts]
    assert choice.fetched_direct.tolist() == [brute[h][1] for h in choice.hosts]


@pytest.mark.parametrize("case", ["swapped axes", "fsdp minor, tensor=8", "P(None, 'tensor') on tensor=32"])
def test_a_target_cutting_the_saved_pieces_is_read_on_the_saved_layout(case: str) -> None:
    mesh, spec = CASES[case]
    grid = _grid(SAVED, LAYERS, SHAPE)
    choice = choose(grid, mesh, spec)
    assert choice.direct_amplification > 1.5
    assert choice.reshard
    assert choice.amplification <= 1.5
    assert choice.read_amplification <= 1.0
    # Same devices as the save: the read sharding is the saved one rebuilt, processes as the target has them.
    assert choice.read_mesh is not None
    assert choice.read_mesh.devices == SAVED.devices and choice.read_spec == LAYERS
    # The read sharding's fetches, counted the slow way, agree.
    brute = _brute(grid, choice.read_mesh, choice.read_spec)
    assert choice.fetched_read.tolist() == [brute[h][1] for h in choice.hosts]
    assert 0 < choice.moved_worst_host <= choice.moved_bytes <= math.prod(SHAPE) * 4 * len(mesh.devices)


def test_the_bytes_moved_are_each_device_target_box_less_what_it_read() -> None:
    mesh, spec = CASES["swapped axes"]
    grid = _grid(SAVED, LAYERS, SHAPE)
    choice = choose(grid, mesh, spec)
    target, read = _boxes(mesh, spec, SHAPE), _boxes(choice.read_mesh, choice.read_spec, SHAPE)
    expected = {}
    for d, p in zip(mesh.devices, mesh.processes):
        (a0, a1), (b0, b1) = target[d], read[d]
        held = math.prod(max(0, min(y, v) - max(x, u)) for x, y, u, v in zip(a0, a1, b0, b1))
        expected[p] = expected.get(p, 0) + (_volume(target[d]) - held) * 4
    assert choice.moved.tolist() == [expected[h] for h in choice.hosts]
    assert choice.host_moved(3) == expected[3]
    host_3 = [d for d, p in zip(mesh.devices, mesh.processes) if p == 3]
    assert choice.moved_to(host_3) == expected[3] and choice.moved_to(mesh.devices) == choice.moved_bytes


def test_the_saved_sharding_itself_is_read_directly_at_one() -> None:
    choice = choose(_grid(SAVED, LAYERS, SHAPE), SAVED, LAYERS)
    assert not choice.reshard and choice.amplification == 1.0 and choice.moved_bytes == 0


def test_an_aligned_target_on_other_devices_stays_direct() -> None:
    # tensor minor, tensor=8 over 128 devices: each target box is inside one saved cell.
    mesh = _mesh([("fsdp", 16), ("tensor", 8)], range(128), 4)
    choice = choose(_grid(SAVED, LAYERS, SHAPE), mesh, LAYERS)
    assert not choice.reshard and choice.direct_amplification == 1.0


def test_other_devices_get_a_read_mesh_ordered_by_process_with_a_minor_replica_axis() -> None:
    # 128 target devices over hosts of 8 (not the saved 64 ids), axes swapped.
    mesh = _mesh([("fsdp", 16), ("tensor", 8)], np.arange(128)[::-1], 8)
    grid = _grid(SAVED, LAYERS, SHAPE)
    choice = choose(grid, mesh, (("tensor",), ("fsdp",)))
    assert choice.direct_amplification > 1.5 and choice.reshard and choice.read_amplification <= 1.0
    read = choice.read_mesh
    assert read is not None
    assert list(zip(read.processes, read.devices)) == sorted(zip(mesh.processes, mesh.devices))
    assert read.axes == (("read0", 16), ("read1", 4), (REPLICA_AXIS, 2))
    cells = _boxes(read, choice.read_spec, SHAPE)
    saved_cells = {grid.cell_box(c) for c in itertools.product(*map(range, grid.splits))}
    assert set(cells.values()) == saved_cells  # every read box is exactly one saved cell


def test_replicated_cells_in_slabs_count_their_slabs() -> None:
    # Saved replicated over fsdp (slabs along rows), restored split by rows on tensor with swapped order.
    grid = _grid(SAVED, ((), ("tensor",)), (256, 64), leaf=5)
    for mesh, spec in [(SAVED, (("tensor",), ())), (CASES["fsdp minor, tensor=8"][0], (("fsdp",), ("tensor",)))]:
        choice = choose(grid, mesh, spec, threshold=0.0)
        brute = _brute(grid, mesh, spec)
        assert choice.fetched_direct.tolist() == [brute[h][1] for h in choice.hosts]
        assert choice.needed.tolist() == [brute[h][0] for h in choice.hosts]
        if choice.reshard:
            assert choice.read_amplification <= 1.0


def test_the_choice_is_the_same_on_every_call_and_cached() -> None:
    devices = jax.devices()[:8]
    saved = Mesh((("fsdp", 4), ("tensor", 2)), tuple(d.id for d in devices), tuple(d.id // 2 for d in devices))
    grid = _grid(saved, LAYERS, (64, 32))
    planner = ReadPlanner(process_of=lambda d: d.id // 2)
    target = NamedSharding(jax.make_mesh((4, 2), ("fsdp", "tensor"), devices=devices), P("tensor", "fsdp"))
    first = planner.choose(grid, target)
    assert planner.choose(grid, target) is first
    again = ReadPlanner(process_of=lambda d: d.id // 2).choose(grid, target)
    for name in ("reshard", "direct_amplification", "read_amplification", "hosts"):
        assert getattr(again, name) == getattr(first, name)
    assert first.reshard and first.direct_amplification == 2.0 and first.read_amplification == 1.0
    read = planner.read_sharding(first, target)
    assert read.device_set == target.device_set
    assert read.spec == P("fsdp", "tensor")
    assert [d.id for d in read.mesh.devices.flat] == list(saved.devices)


@pytest.mark.parametrize("case", ["fsdp minor, tensor=8", "swapped axes"])
def test_a_leaf_is_resharded_only_when_it_saves_the_busiest_host_the_floor(case: str) -> None:
    mesh, spec = CASES[case]
    small = choose(
        _grid(SAVED, LAYERS, SHAPE), mesh, spec, min_saved=RESHARD_MIN_SAVED
    )  # 8 KiB: bytes saved < the 16 KiB floor
    assert small.direct_amplification > 1.5 and not small.reshard and small.amplification == small.direct_amplification
    assert small.moved_bytes == 0
    large = choose(_grid(SAVED, LAYERS, (4096, 2048)), mesh, spec, min_saved=RESHARD_MIN_SAVED)  # 32 MiB
    assert large.reshard and large.amplification <= 1.0
    assert int(large.fetched_direct.max()) - int(large.fetched_read.max()) >= RESHARD_MIN_SAVED


def test_a_small_leaf_read_many_times_over_is_resharded_anyway() -> None:
    # Thin row pieces (fsdp=32) with the axes swapped: each host needs 2 of 64 columns and reads all 64 (16x).
    saved = _mesh([("fsdp", 32), ("tensor", 2)], range(64), per_host=2)
    grid = _grid(saved, LAYERS, (64, 64))
    choice = choose(grid, saved, SWAPPED, min_saved=RESHARD_MIN_SAVED)
    assert choice.direct_amplification == 16.0 > read_sharding.RESHARD_ALWAYS_ABOVE
    assert choice.reshard and choice.read_amplification == 1.0
    assert not choose(grid, saved, SWAPPED, min_saved=RESHARD_MIN_SAVED, always_above=32.0).reshard


def test_the_floor_is_read_when_the_planner_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    # The module constant, read at call time: every process of a job sees the same one.
    devices = jax.devices()[:8]
    saved = Mesh((("fsdp", 4), ("tensor", 2)), tuple(d.id for d in devices), tuple(d.id // 2 for d in devices))
    target = NamedSharding(jax.make_mesh((4, 2), ("fsdp", "tensor"), devices=devices), P("tensor", "fsdp"))
    grid = _grid(saved, LAYERS, (64, 32))
    assert ReadPlanner(process_of=lambda d: d.id // 2).choose(grid, target).reshard
    monkeypatch.setattr(read_sharding, "RESHARD_MIN_SAVED", 1 << 20)
    assert not ReadPlanner(process_of=lambda d: d.id // 2).choose(grid, target).reshard
    assert ReadPlanner(process_of=lambda d: d.id // 2, min_saved=0).choose(grid, target).reshard
