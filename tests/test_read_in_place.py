"""Local files read straight into their boxes (``ReadSink.destination``, ``posix.stream_range``).

A ``file://`` restore streams each read piece by piece; where a piece's bytes lie in
one contiguous run of one box's buffer (a target sharded like the saved one along
its inner axes), the store reads them there and the sink only checks them: one host
copy of each byte instead of two (on a TPU host the second copy, into freshly
faulted memory, held the restore above its floor). These tests pin that the bytes
land in place, that a target that cuts pieces still copies and comes out right,
that a flipped byte is still caught, and the store's side of the contract.
"""

from __future__ import annotations

import asyncio
import dataclasses

import jax
import numpy as np
import pytest
from helpers import random_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from restore_seams import paths, restore_with

import objckpt
from objckpt.errors import ChecksumMismatchError
from objckpt.restoring.landing import Landing
from objckpt.storage import from_url
from objckpt.storage.streaming import STREAM_PIECE


def _state():
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    return {
        "rows": jax.device_put(random_array((2048, 1024), np.float32, 1), NamedSharding(mesh, P("x"))),  # 8 MiB
        "half": jax.device_put(random_array((4096, 512), jax.numpy.bfloat16, 2), NamedSharding(mesh, P())),
        "small": jax.device_put(random_array((100,), np.float32, 3), NamedSharding(mesh, P())),
    }


def _target(state, specs=None):
    if specs is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k])) for k, v in state.items()}


def _copies(monkeypatch):
    """Bytes Landing.copy moves during a restore, per leaf path (copies, not reads in place)."""
    moved: dict[str, int] = {}
    real = Landing.copy

    def counting(self, i, overlaps, source, origin):
        path = self.plans[i].entry.path
        moved[path] = moved.get(path, 0) + source.nbytes
        return real(self, i, overlaps, source, origin)

    monkeypatch.setattr(Landing, "copy", counting)
    return moved


def test_a_restore_onto_the_saved_sharding_reads_large_leaves_in_place(tmp_path, monkeypatch):
    state = _state()
    url = f"file://{tmp_path}/ck"
    objckpt.save(url, state)
    moved = _copies(monkeypatch)
    got = objckpt.restore(url, _target(state))
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v), err_msg=k)
    assert moved.get("['rows']", 0) == 0, moved  # every byte of it was read into its box
    assert moved.get("['half']", 0) == 0, moved


def test_leaves_bound_for_an_accelerator_are_read_into_the_buffers_device_put_takes(tmp_path, monkeypatch):
    """The accelerator's case (a leaf's host buffer exists only until device_put has copied it):
    the bytes are read into that buffer, with no response buffer and no copy between."""
    state = _state()
    url = f"file://{tmp_path}/ck"
    objckpt.save(url, state)
    moved = _copies(monkeypatch)
    target = _target(state)
    out = restore_with(from_url(url), paths(target), replan=lambda plan: dataclasses.replace(plan, on_host=False))
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(out[f"['{k}']"]), np.asarray(v), err_msg=k)
    assert moved.get("['rows']", 0) == moved.get("['half']", 0) == 0, moved


def test_a_target_that_cuts_pieces_still_copies_and_restores_exactly(tmp_path, monkeypatch):
    state = _state()
    url = f"file://{tmp_path}/ck"
    objckpt.save(url, state)
    moved = _copies(monkeypatch)
    got = objckpt.restore(url, _target(state, {"rows": P(None, "b"), "half": P("b", "a"), "small": P("a")}))
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v), err_msg=k)
    assert moved.get("['rows']", 0) > 0  # columns cut every row: no single run to read into


def test_a_flipped_byte_read_in_place_fails_the_restore_naming_the_leaf(tmp_path):
    state = {"rows": _state()["rows"]}
    url = f"file://{tmp_path}/ck"
    objckpt.save(url, state)
    blobs = [p for p in (tmp_path / "ck").rglob("*") if p.is_file() and p.stat().st_size > 4 << 20]
    assert blobs, "no blob of the leaf found"
    data = bytearray(blobs[0].read_bytes())
    data[len(data) // 2] ^= 0x10
    blobs[0].write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match=r"leaf \['rows'\]"):
        objckpt.restore(url, _target(state))


class _PlacingSink:
    """A sink that names its own buffer as the destination of every piece."""

    def __init__(self, size: int, *, readonly: bool = False) -> None:
        self.buffer = np.zeros(size, np.uint8)
        self.readonly = readonly
        self.in_place = 0
        self.named: set[int] = set()

    def begin(self) -> None:
        self.in_place = 0

    def next_size(self, offset: int, limit: int) -> int:
        return min(limit, 3001)

    def destination(self, offset: int, size: int) -> memoryview:
        view = self.buffer[offset : offset + size].data
        self.named.add(offset)
        return view.toreadonly() if self.readonly else view

    def receive(self, offset: int, data: memoryview) -> None:
        target = self.buffer[offset : offset + len(data)]
        assert np.frombuffer(data, np.uint8).ctypes.data == target.ctypes.data  # the very place it named
        self.in_place += len(data)


def test_the_file_store_reads_into_the_place_a_sink_names(tmp_path):
    payload = np.random.default_rng(4).integers(0, 256, 3 * STREAM_PIECE + 77, dtype=np.uint8).tobytes()

    async def go():
        store = from_url(f"file://{tmp_path}")
        try:
            await store.put("blob", payload)
            sink = _PlacingSink(len(payload) - 10)
            got = await store.get_range_streamed("blob", start=10, end=len(payload), sink=sink)
            assert got == len(payload) - 10 == sink.in_place
            assert sink.buffer.tobytes() == payload[10:]
            with pytest.raises(ValueError, match="destination unfit"):
                await store.get_range_streamed("blob", start=0, end=100, sink=_PlacingSink(100, readonly=True))
        finally:
            await store.close()

    asyncio.run(go())
