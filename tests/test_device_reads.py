"""A save's device→host copies (issue 65): every copy is started before the first is read, as
far ahead as the staging memory allows, and no host copy is left on the user's arrays.

CPU devices need neither (a CPU array's host view is its own memory), so these tests watch the
two JAX calls an accelerator pays for: ``copy_to_host_async`` (a copy started) and
``_single_device_array_to_np_array_did_copy`` (a shard's bytes read), recorded on the array
type with the device buffer they touch and the array object they were called on. On an
accelerator jaxlib keeps the host copy on that object (its C++ host value; and ``_npy_value``
when read through ``_value``), so neither may be the user's array, and every such object must
be gone once the save returns. The recorded read returns a fresh copy and says it copied, as on
a TPU or GPU.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_bit_exact
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.core.device_reads import host_view

KiB = 1 << 10
ArrayImpl = type(jnp.zeros(1))


Event = tuple[str, int, int, Any]


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    """("start" | "read", the device buffer, its bytes, a weak reference to the array object
    called), in call order, with reads that copy."""
    log: list[Event] = []
    start = ArrayImpl.copy_to_host_async
    read = ArrayImpl._single_device_array_to_np_array_did_copy

    def recording_start(self: Any) -> None:
        log.append(("start", self.unsafe_buffer_pointer(), self.nbytes, weakref.ref(self)))
        start(self)

    def accelerator_read(self: Any) -> tuple[np.ndarray, bool]:
        log.append(("read", self.unsafe_buffer_pointer(), self.nbytes, weakref.ref(self)))
        host, _ = read(self)
        copy = np.array(host)
        copy.flags.writeable = False
        return copy, True

    monkeypatch.setattr(ArrayImpl, "copy_to_host_async", recording_start)
    monkeypatch.setattr(ArrayImpl, "_single_device_array_to_np_array_did_copy", accelerator_read)
    return log


def _state(leaves: int = 16) -> dict[str, jax.Array]:
    mesh = jax.make_mesh((8,), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    return {
        f"w{i:02d}": jax.device_put(jnp.arange(128 * 512, dtype=jnp.float32).reshape(128, 512) + i, sharding)
        for i in range(leaves)
    }


def _buffers(state: dict[str, jax.Array]) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for x in state.values() for s in x.addressable_shards}


def _users(state: dict[str, jax.Array]) -> set[int]:
    """id() of the user's arrays and of their shards' arrays."""
    return {id(x) for x in state.values()} | {id(s.data) for x in state.values() for s in x.addressable_shards}


def _check_no_host_copy_left(events: list[Event], state: dict[str, jax.Array]) -> None:
    """No copy or read ran on the user's arrays, and every array object one ran on is gone."""
    users = _users(state)
    called = [ref for *_, ref in events]
    assert all(ref() is None or id(ref()) not in users for ref in called), "a host copy on the user's arrays"
    gc.collect()
    assert all(ref() is None for ref in called), "an array holding a host copy outlives the save"
    assert _cached(state) == []


def _cached(state: dict[str, jax.Array]) -> list[str]:
    out = []
    for name, x in state.items():
        if getattr(x, "_npy_value", None) is not None:
            out.append(name)
        out += [f"{name} shard {i}" for i, s in enumerate(x.addressable_shards) if s.data._npy_value is not None]
    return out


def test_the_simulated_accelerator_read_would_cache_through_value(events: list[Event]) -> None:
    """The simulation bites: reading a shard through ``_value`` (``np.asarray`` on an accelerator)
    caches the copy on the array; :func:`host_view` reads the same bytes and caches nothing."""
    x = _state(1)["w00"]
    shard = x.addressable_shards[0].data
    np.testing.assert_array_equal(host_view(shard), np.asarray(x)[:16])
    assert shard._npy_value is None
    shard._value  # noqa: B018
    assert shard._npy_value is not None


def _save_sync(url: str, state: Any) -> None:
    objckpt.save(url, state)


def _save_async(url: str, state: Any) -> None:
    objckpt.save_async(url, state).result()


def _manager_save(url: str, state: Any) -> None:
    with objckpt.CheckpointManager(url) as mgr:
        mgr.save(3, state, wait=True)


@pytest.mark.parametrize("save", [_save_sync, _save_async, _manager_save], ids=["save", "save_async", "manager"])
def test_every_copy_starts_before_the_first_read_and_none_is_cached(
    save: Any, events: list[Event], tmp_path: Any
) -> None:
    state = _state()
    shards = _buffers(state)
    save(tmp_path.as_uri(), state)
    starts = [b for kind, b, *_ in events if kind == "start"]
    reads = [b for kind, b, *_ in events if kind == "read"]
    assert set(starts) == shards and len(starts) == len(shards), "each shard's copy is started once"
    assert set(reads) == shards, "every shard is read through the reader that caches nothing"
    first_read = next(n for n, (kind, *_) in enumerate(events) if kind == "read")
    assert all(kind == "start" for kind, *_ in events[:first_read])
    assert first_read == len(shards), "every copy is under way before the first read"
    _check_no_host_copy_left(events, state)
    if save is _manager_save:
        restored = objckpt.CheckpointManager(tmp_path.as_uri()).restore(3, state)
    else:
        restored = objckpt.restore(tmp_path.as_uri(), state)
    assert_tree_bit_exact(restored, state)


def test_copies_started_ahead_stay_within_the_staging_memory(events: list[tuple[str, int, int]], tmp_path: Any) -> None:
    """With a budget of a fraction of the state, copies are started a window ahead, not all at once,
    and every shard's copy is still started before it is read."""
    state = _state()
    budget = 512 * KiB  # the state is 4 MiB; its blobs 64 KiB
    options = objckpt.Options(blob_size=64 * KiB, max_blob_size=64 * KiB, memory_budget=budget)
    objckpt.save_async(tmp_path.as_uri(), state, options=options).result()
    started: set[int] = set()
    read: set[int] = set()
    held_max = 0
    for kind, i, *_ in events:
        if kind == "start":
            started.add(i)
            held_max = max(held_max, _held(events, started, read))
        else:
            assert i in started, "a shard is read before its copy was started"
            read.add(i)
    assert started == read == _buffers(state)
    shard_bytes = 128 * 512 * 4 // 8
    assert held_max <= budget + 64 * KiB + shard_bytes
    assert held_max < sum(x.nbytes for x in state.values()) / 2
    _check_no_host_copy_left(events, state)
    assert_tree_bit_exact(objckpt.restore(tmp_path.as_uri(), state), state)


def _held(events: list[Event], started: set[int], read: set[int]) -> int:
    sizes = {b: n for _, b, n, _ in events}
    return sum(sizes[i] for i in started - read)
