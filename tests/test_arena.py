"""Prefaulted memory for the small leaves a restore assembles (``objckpt.restoring.arena``).

End-to-end cases run restore's steps through their seams (:mod:`restore_seams`), the
arena's mapping and page-touching functions passed in, not patched.

Their boxes are cut from mappings made on a thread while restore plans, so the
copies into them take no page faults; leaves whose responses become the arrays
get none, and a mapping that fails leaves the leaves to buffers of their own.
"""

from __future__ import annotations

import resource
import threading

import jax
import numpy as np
import pytest
from helpers import assert_tree_bit_exact, random_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from restore_seams import paths, restore_with

import objckpt
from objckpt.restoring.arena import AssemblyArena
from objckpt.restoring.landing import HostMemory
from objckpt.storage import from_url
from objckpt.transfer.buffers import DEVICE_ALIGNMENT, fault_in, mapped_buffer, touch_pages


def _boxes(rows: int, cols: int, cut_rows: int, cut_cols: int):
    r, c = rows // cut_rows, cols // cut_cols
    return [((i * r, j * c), ((i + 1) * r, (j + 1) * c)) for i in range(cut_rows) for j in range(cut_cols)]


def _recording():
    """(the sizes of the mappings made, a ``mapped`` for an arena that records them)."""
    sizes: list[int] = []

    def recording(nbytes):
        sizes.append(nbytes)
        return mapped_buffer(nbytes)

    return sizes, recording


def _restored(url, storage_options, target, **kwargs):
    """``target``'s leaves restored from ``url`` through restore's seams (:func:`restore_with`)."""
    out = restore_with(from_url(url, **(storage_options or {})), paths(target), **kwargs)
    return {k: out[f"['{k}']"] for k in target}


def test_arena_arrays_are_aligned_disjoint_grouped_and_already_faulted(monkeypatch):
    sizes, recording = _recording()
    from objckpt.transfer import buffers as memory

    populated: list[int] = []
    monkeypatch.setattr(memory, "_populate", lambda b: populated.append(b.nbytes) or True)
    leaves = [(k, _boxes(256, 96 + 8 * k, 2, 4), np.dtype(np.float32)) for k in range(6)]  # ~100 KiB each... ×4
    leaves.append((9, _boxes(1024, 512, 1, 1), np.dtype(np.float32)))  # 2 MiB: a mapping of its own
    arena = AssemblyArena(leaves, group_bytes=1 << 20, mapped=recording)
    made = {key: arena.buffers(key) for key, _, _ in leaves}
    assert len(sizes) >= 2 and max(sizes) >= 2 << 20 and all(size <= 2 << 20 for size in sizes)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    value = 0
    for key, boxes, dtype in leaves:
        assert list(made[key]) == boxes
        for (start, stop), array in made[key].items():
            assert array.shape == tuple(b - a for a, b in zip(start, stop)) and array.dtype == dtype
            assert array.flags.c_contiguous and array.flags.writeable
            assert array.ctypes.data % DEVICE_ALIGNMENT == 0
            value += 1
            array[...] = value
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert faults < 64, f"{faults} page faults writing prefaulted arrays"
    assert not populated, "the arena used madvise (it holds the mmap lock that starting threads wait for)"
    value = 0
    for key, _, _ in leaves:
        for array in made[key].values():
            value += 1
            assert (array == value).all()  # no array overlaps another
    assert AssemblyArena([]).buffers(3) is None


def test_pages_go_in_by_writes_not_madvise(monkeypatch):
    """Every page of a fresh mapping is in (and zero) after ``touch_pages``, without
    ``madvise``, whose hold on the mmap lock stalls threads that are starting up."""
    from objckpt.transfer import buffers as memory

    populated: list[int] = []
    monkeypatch.setattr(memory, "_populate", lambda b: populated.append(b.nbytes) or True)
    nbytes = (10 << 20) + 12345
    buffer = memory.mapped_buffer(nbytes)
    memory.touch_pages(buffer)
    assert not populated
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    assert not buffer.any()
    buffer[...] = 7
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert faults < 64, f"{faults} page faults in a touched buffer of {nbytes} bytes"


def test_the_arrays_are_not_handed_out_while_pages_go_in_by_writes():
    """Writes of zeros would overwrite bytes already copied in: nobody may have the arrays yet."""
    touching = threading.Event()
    release = threading.Event()

    def slow_touch(buffer):
        touching.set()
        release.wait(30)

    arena = AssemblyArena([(1, _boxes(1024, 1024, 2, 4), np.dtype(np.float32))], touch=slow_touch)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(arena.buffers(1)))
    try:
        assert touching.wait(30)
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive() and not got, "arrays handed out while pages were still being written"
    finally:
        release.set()
    waiter.join(30)
    assert got and got[0] is not None


def test_a_leaf_is_handed_out_once_its_own_mapping_is_in_not_the_whole_arena():
    """The first reads need the first leaves: they must not wait for every later mapping's pages."""
    touches: list[int] = []  # mappings are touched one after another, on the arena's thread
    second_started = threading.Event()
    release = threading.Event()

    def second_waits(buffer):
        touches.append(buffer.nbytes)
        if len(touches) == 2:
            second_started.set()
            release.wait(30)
        touch_pages(buffer)

    first = (1, _boxes(512, 512, 2, 2), np.dtype(np.float32))  # 1 MiB each: a mapping of its own
    later = (2, _boxes(512, 512, 2, 2), np.dtype(np.float32))
    arena = AssemblyArena([first, later], group_bytes=1 << 20, touch=second_waits)
    early: list = []
    late: list = []
    reader = threading.Thread(target=lambda: early.append(arena.buffers(1)))
    waiter = threading.Thread(target=lambda: late.append(arena.buffers(2)))
    try:
        reader.start()
        waiter.start()
        reader.join(10)
        assert early and early[0] is not None, "the first leaf waited for a later mapping's pages"
        assert list(early[0]) == first[1]
        assert second_started.wait(10)
        waiter.join(0.2)
        assert not late, "the later leaf was handed out before its pages were in"
    finally:
        release.set()
    waiter.join(30)
    assert late and late[0] is not None and list(late[0]) == later[1]


def _small_tree():
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    tree = {
        f"w{i}": jax.device_put(random_array((64, 48 + 8 * i), np.float32, i), NamedSharding(mesh, P("x", "y")))
        for i in range(5)
    }
    tree["bias"] = jax.device_put(random_array((48,), np.float32, 9), NamedSharding(mesh, P()))
    return tree


def _target(tree, spec):
    other = jax.make_mesh((2, 4), ("a", "b"))
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(other, spec if v.ndim == 2 else P()))
        for k, v in tree.items()
    }


@pytest.mark.parametrize("where", ["s3", "memory"])
def test_only_assembled_leaves_get_prefaulted_memory_and_become_it(where, s3_store):
    """Onto another sharding the small leaves' device arrays are the prefaulted memory
    itself (CPU backend); onto boxes equal to the saved pieces nothing is mapped."""
    mappings: list[np.ndarray] = []

    def keeping(nbytes):
        mappings.append(mapped_buffer(nbytes))
        return mappings[-1]

    memory = HostMemory(arena=lambda leaves: AssemblyArena(leaves, mapped=keeping))
    tree = _small_tree()
    url = s3_store.url if where == "s3" else "memory://prefault/small"
    options = s3_store.storage_options if where == "s3" else None
    objckpt.save(url, tree, storage_options=options)
    same = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    assert_tree_bit_exact(tree, _restored(url, options, same, memory=memory))
    assert not mappings
    out = _restored(url, options, _target(tree, P("a", "b")), memory=memory)
    assert_tree_bit_exact(tree, out)
    assert len(mappings) == 1
    low = mappings[0].ctypes.data
    high = low + mappings[0].nbytes
    for k in (k for k in tree if k.startswith("w")):
        for shard in out[k].addressable_shards:
            assert low <= shard.data.unsafe_buffer_pointer() < high, f"{k} was not restored into the mapping"


def test_a_failed_mapping_leaves_the_leaves_buffers_of_their_own(memory_store):
    def failing(nbytes, **kwargs):
        raise MemoryError(f"cannot map {nbytes} bytes")

    memory = HostMemory(arena=lambda leaves: AssemblyArena(leaves, mapped=failing))
    tree = _small_tree()
    objckpt.save(memory_store.url, tree)
    assert_tree_bit_exact(tree, _restored(memory_store.url, None, _target(tree, P("b", "a")), memory=memory))


def test_fault_in_takes_a_fresh_mapping_4_mib_at_a_time_and_leaves_heap_buffers(monkeypatch):
    from objckpt.transfer import buffers as memory

    populated: list[int] = []
    real_populate = memory._populate
    monkeypatch.setattr(memory, "_populate", lambda b: populated.append(b.nbytes) or real_populate(b))
    nbytes = (9 << 20) + 4096 * 3
    buffer = memory.aligned_arrays([(nbytes // 4,)], np.dtype(np.float32), zeroed=False)[0]
    assert memory.fault_in(buffer)
    assert populated == [4 << 20, 4 << 20, (1 << 20) + 4096 * 3]
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    assert not buffer.any()
    buffer[...] = 7
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert faults < 64, f"{faults} page faults writing a faulted-in buffer of {nbytes} bytes"
    populated.clear()
    assert not memory.fault_in(np.zeros(1000, np.float32)) and not populated  # from the heap: left alone


@pytest.mark.parametrize("where", ["s3", "memory"])
def test_large_leaf_boxes_are_faulted_in_before_pieces_are_copied_into_them(where, s3_store):
    """Onto another sharding, every box buffer of a leaf placed box by box is faulted in once,
    whether the read is streamed (S3) or lands whole (memory), and becomes the device array."""
    faulted: list[tuple[int, int]] = []

    def recording(buffer):
        faulted.append((buffer.ctypes.data, buffer.nbytes))
        return fault_in(buffer)

    mesh = jax.make_mesh((4, 2), ("x", "y"))
    tree = {"w": jax.device_put(random_array((1024, 1024), np.float32, 3), NamedSharding(mesh, P("x", "y")))}
    url = s3_store.url if where == "s3" else "memory://prefault/large"
    options = s3_store.storage_options if where == "s3" else None
    objckpt.save(url, tree, storage_options=options)
    out = _restored(  # 8 boxes of 512 x 256; a 4 MiB leaf goes box by box over 1 MiB
        url, options, _target(tree, P("a", "b")), memory=HostMemory(fault_in=recording), whole_leaf_bytes=1 << 20
    )
    assert_tree_bit_exact(tree, out)
    shards = sorted((s.data.unsafe_buffer_pointer(), 512 * 256 * 4) for s in out["w"].addressable_shards)
    assert sorted(faulted) == shards
