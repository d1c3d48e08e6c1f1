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
import threading
import weakref
from types import SimpleNamespace
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
from objckpt.restoring.aligned_reads import address
from objckpt.saving import host_copies as host_copies_module
from objckpt.saving import upload as upload_module
from objckpt.saving.host_copies import HostCopies, wants_snapshot
from objckpt.saving.staging import StagingPool
from objckpt.storage.fsspec.local import LocalFsspecStore

KiB = 1 << 10
GiB = 1 << 30
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
    whole = getattr(ArrayImpl, "_to_np_array_did_copy", None)
    if whole is not None:  # what ``_value`` reads through in JAX 0.12 (before: the call above)

        def accelerator_value(self: Any) -> tuple[np.ndarray, bool]:
            if len(self.sharding.device_set) == 1:
                return accelerator_read(self)
            return whole(self)  # type: ignore[no-any-return]

        monkeypatch.setattr(ArrayImpl, "_to_np_array_did_copy", accelerator_value)
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


def _manager_local_save(url: str, state: Any) -> None:
    """A manager step due for the local tier only (its store save rule is not met)."""
    root = url.removeprefix("file://")
    with objckpt.CheckpointManager(
        url, local=f"{root}-local", save_rules=objckpt.SavePolicy(save_interval_steps=1000)
    ) as mgr:
        mgr.save(3, state, wait=True)


def _manager_both_save(url: str, state: Any) -> None:
    """A manager step due for both the local tier and the store: one host stage serves both."""
    root = url.removeprefix("file://")
    with objckpt.CheckpointManager(url, local=f"{root}-local") as mgr:
        mgr.save(3, state, wait=True)


@pytest.mark.parametrize(
    "save",
    [_save_sync, _save_async, _manager_save, _manager_local_save, _manager_both_save],
    ids=["save", "save_async", "manager", "manager_local", "manager_both"],
)
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
    if save in (_manager_local_save, _manager_both_save):
        with objckpt.CheckpointManager(tmp_path.as_uri(), local=f"{tmp_path}-local") as mgr:
            restored = mgr.restore(3, state)
            assert mgr.tier_status().last_restore.tier == "local"
        if save is _manager_both_save:  # the store's copy too, bit-exact
            assert_tree_bit_exact(objckpt.restore(f"{tmp_path.as_uri()}/step_0000000003", state), state)
    elif save is _manager_save:
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


# ----------------------------------------------------------------------------- no staging copy


def _record_host_copies(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[int, int]], list[Any]]:
    """Address ranges of the host bytes the save read off the devices, and weak references to them."""
    ranges: list[tuple[int, int]] = []
    refs: list[Any] = []
    real = host_copies_module.host_copy

    def recording(array: Any) -> tuple[np.ndarray, bool]:
        host, owned = real(array)
        ranges.append((host.ctypes.data, host.ctypes.data + host.nbytes))
        refs.append(weakref.ref(host))
        return host, owned

    monkeypatch.setattr(host_copies_module, "host_copy", recording)
    return ranges, refs


def _record_parts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Address ranges of the parts of every body the local store wrote (gaps of zeros left out)."""
    sent: list[tuple[int, int]] = []
    real = LocalFsspecStore.put_parts

    async def recording(self: Any, key: str, parts: Any, *, mode: str = "overwrite") -> None:
        sent.extend((address(p), address(p) + len(p)) for p in parts if len(p) >= 4 * KiB)
        await real(self, key, parts, mode=mode)

    monkeypatch.setattr(LocalFsspecStore, "put_parts", recording)
    return sent


def _record_pools(monkeypatch: pytest.MonkeyPatch) -> list[StagingPool]:
    pools: list[StagingPool] = []

    class RecordingPool(StagingPool):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(upload_module, "StagingPool", RecordingPool)
    return pools


def _within(part: tuple[int, int], ranges: list[tuple[int, int]]) -> bool:
    return any(lo <= part[0] and part[1] <= hi for lo, hi in ranges)


@pytest.mark.parametrize("save", [_save_async, _manager_save], ids=["save_async", "manager"])
def test_an_accelerators_host_copies_are_uploaded_without_a_second_copy(
    save: Any, events: list[Event], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off an accelerator, the bytes each shard's device→host copy landed in are the PUT bodies'
    parts: no staging buffer is taken, and no host copy outlives the save."""
    ranges, refs = _record_host_copies(monkeypatch)
    sent = _record_parts(monkeypatch)
    pools = _record_pools(monkeypatch)
    state = _state()
    save(tmp_path.as_uri(), state)
    assert pools and all(p.allocated == 0 for p in pools), "a blob was staged"
    assert len(ranges) == len(_buffers(state)), "each shard is read off its device once"
    assert sent and all(_within(p, ranges) for p in sent), "a PUT part is not the device→host copy itself"
    assert sum(hi - lo for lo, hi in sent) == sum(x.nbytes for x in state.values())
    gc.collect()
    assert all(ref() is None for ref in refs), "a host copy outlives the save"
    _check_no_host_copy_left(events, state)
    url = tmp_path.as_uri()
    restored = (
        objckpt.CheckpointManager(url).restore(3, state) if save is _manager_save else objckpt.restore(url, state)
    )
    assert_tree_bit_exact(restored, state)


def test_cpu_devices_are_staged_by_an_async_save(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU device's host view is its own memory, which training may donate once save_async
    returns: an async save copies it into staging buffers instead of sending it in place."""
    sent = _record_parts(monkeypatch)
    pools = _record_pools(monkeypatch)
    state = _state()
    objckpt.save_async(tmp_path.as_uri(), state).result()
    assert not sent and pools[0].allocated > 0
    assert_tree_bit_exact(objckpt.restore(tmp_path.as_uri(), state), state)


def test_a_sync_save_to_local_disk_sends_array_bytes_in_place(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local store takes a body of parts: a synchronous save writes the shards from where they lie."""
    sent = _record_parts(monkeypatch)
    pools = _record_pools(monkeypatch)
    state = _state()
    objckpt.save(tmp_path.as_uri(), state)
    assert pools[0].allocated == 0
    shards = [(s.data.unsafe_buffer_pointer(), s.data.nbytes) for x in state.values() for s in x.addressable_shards]
    assert all(_within((p, p + n), sent) for p, n in shards), "a shard's bytes were copied before upload"
    assert_tree_bit_exact(objckpt.restore(tmp_path.as_uri(), state), state)


def test_host_copies_held_stay_within_the_memory_budget(
    events: list[Event], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a budget of a fraction of the state, the host copies held (read and not yet sent) stay
    within it plus one blob's shards, and the save still writes every byte."""
    made: list[HostCopies] = []

    class Recording(HostCopies):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(upload_module, "HostCopies", Recording)
    state = _state()
    budget = 512 * KiB  # the state is 4 MiB; its shards 32 KiB, its blobs 64 KiB
    options = objckpt.Options(blob_size=64 * KiB, max_blob_size=64 * KiB, memory_budget=budget)
    objckpt.save_async(tmp_path.as_uri(), state, options=options).result()
    (copies,) = made
    assert 0 < copies.peak_held <= budget + 64 * KiB
    assert copies.peak_held < sum(x.nbytes for x in state.values()) / 2
    _check_no_host_copy_left(events, state)
    assert_tree_bit_exact(objckpt.restore(tmp_path.as_uri(), state), state)


# ----------------------------------------------------------------------------- on-device snapshot


def _as_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Treat CPU shards as an accelerator's, so the snapshot path runs (its device copies are real)."""
    monkeypatch.setattr(host_copies_module, "_on_accelerator", lambda source: isinstance(source, jax.Array))


def _held_reads(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Device→host reads (of JAX arrays) wait until the returned event is set (a slow copy off the chip)."""
    go = threading.Event()
    real = host_copies_module.host_copy

    def slow(array: Any) -> tuple[np.ndarray, bool]:
        if isinstance(array, jax.Array):
            assert go.wait(60), "reads were never let go"
        return real(array)

    monkeypatch.setattr(host_copies_module, "host_copy", slow)
    return go


def test_with_a_device_snapshot_save_async_returns_before_any_copy_off_the_device(
    events: list[Event], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _as_accelerator(monkeypatch)
    go = _held_reads(monkeypatch)
    state = _state()
    try:
        handle = objckpt.save_async(tmp_path.as_uri(), state, options=objckpt.Options(device_snapshot="on"))
        assert not handle.done()
    finally:
        go.set()
    handle.result()
    copied = {b for kind, b, *_ in events}
    assert copied and not copied & _buffers(state), "a host copy was made from the user's buffers, not a snapshot"
    _check_no_host_copy_left(events, state)
    assert_tree_bit_exact(objckpt.restore(tmp_path.as_uri(), state), state)


def test_without_a_snapshot_save_async_waits_for_the_copies_off_the_device(
    events: list[Event], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of the test above: the snapshot is what lets the save return early."""
    _as_accelerator(monkeypatch)
    go = _held_reads(monkeypatch)
    state = _state()
    returned = threading.Event()
    saving = threading.Thread(target=lambda: (objckpt.save_async(tmp_path.as_uri(), state).result(), returned.set()))
    saving.start()
    try:
        assert not returned.wait(0.5), "save_async returned before its shards left the devices"
    finally:
        go.set()
        saving.join(60)
    assert returned.is_set()
    assert {b for kind, b, *_ in events} == _buffers(state)  # no snapshot: the user's buffers, through aliases


class _Device:
    def __init__(self, stats: dict[str, int] | None) -> None:
        self.stats = stats

    def memory_stats(self) -> dict[str, int] | None:
        return self.stats


class _Shard:
    def __init__(self, device: _Device, nbytes: int) -> None:
        self.device, self.nbytes = device, nbytes

    def devices(self) -> set[_Device]:
        return {self.device}


def _blobs(*shards: _Shard) -> list[Any]:
    pieces = [SimpleNamespace(piece=SimpleNamespace(source=(s, ()))) for s in shards]
    return [SimpleNamespace(pieces=pieces)]


@pytest.mark.parametrize(
    ("setting", "stats", "expected"),
    [
        ("off", {"bytes_limit": 100 * GiB, "peak_bytes_in_use": 0}, False),
        ("on", None, True),
        ("auto", {"bytes_limit": 16 * GiB, "peak_bytes_in_use": 6 * GiB, "bytes_in_use": 5 * GiB}, True),
        ("auto", {"bytes_limit": 16 * GiB, "peak_bytes_in_use": 11 * GiB, "bytes_in_use": 5 * GiB}, False),
        ("auto", {"bytes_limit": 16 * GiB, "peak_bytes_in_use": 5 * GiB, "bytes_in_use": 5 * GiB}, True),
        ("auto", None, False),
    ],
)
def test_device_snapshot_auto_needs_room_beyond_the_peak(
    setting: str, stats: dict[str, int] | None, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` snapshots 4 GiB on a 16 GiB device only when its peak use so far leaves 4 GiB plus
    a tenth of the device free; without memory statistics it does not."""
    monkeypatch.setattr(host_copies_module, "_on_accelerator", lambda source: True)
    device = _Device(stats)
    blobs = _blobs(_Shard(device, 3 * GiB), _Shard(device, 1 * GiB))
    assert wants_snapshot(setting, blobs) is expected


def test_device_snapshot_names_a_bad_setting() -> None:
    with pytest.raises(ValueError, match="device_snapshot"):
        objckpt.Options(device_snapshot="yes")


def test_a_snapshot_save_copies_host_leaves_before_it_returns(
    events: list[Event], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the snapshot the save returns before it reads anything off the devices; a numpy leaf
    beside the device arrays, changed by its owner right after, is still saved as it was."""
    _as_accelerator(monkeypatch)
    monkeypatch.setattr(
        host_copies_module, "_on_accelerator", lambda source: isinstance(source, jax.Array) and source.ndim == 2
    )
    go = _held_reads(monkeypatch)
    state: dict[str, Any] = {**_state(4), "host": np.arange(64 * KiB, dtype=np.float32)}
    kept = state["host"].copy()
    try:
        handle = objckpt.save_async(tmp_path.as_uri(), state, options=objckpt.Options(device_snapshot="on"))
        state["host"][:] = -1  # the owner reuses its buffer
    finally:
        go.set()
    handle.result()
    restored = objckpt.restore(tmp_path.as_uri())
    np.testing.assert_array_equal(restored["host"], kept)


def test_a_snapshot_copies_every_shard_on_its_device_in_one_batched_call(
    events: list[Event], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot dispatches all its device copies in one ``jax.device_put`` of a list (a
    call per shard costs a quarter of a millisecond each, most of the blocked time of a model of
    ~450 leaves), every one a copy (``may_alias=False``), and the save stays exact."""
    _as_accelerator(monkeypatch)
    calls: list[tuple[int, Any]] = []
    real = jax.device_put

    def counting(x: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((len(x) if isinstance(x, list) else 1, kwargs.get("may_alias")))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(host_copies_module.jax, "device_put", counting)
    state = _state(6)
    objckpt.save_async(tmp_path.as_uri(), state, options=objckpt.Options(device_snapshot="on")).result()
    monkeypatch.undo()
    shards = sum(len(x.addressable_shards) for x in state.values())
    assert [n for n, may_alias in calls if may_alias is False] == [shards]
    assert_tree_bit_exact(objckpt.restore(tmp_path.as_uri(), state), state)


# ----------------------------------------------------------------------------- memory handed back


def test_a_save_and_a_restore_hand_the_freed_heap_back_once_each_ends(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device runtime allocates a save's host copies from glibc's heap, which keeps freed
    blocks in the process's RSS (+3.3 GiB after a 4 GiB save on a TPU v5e): a save hands them back
    once it has committed and closed its store, a restore once it ends, failed or not."""
    from objckpt.restoring import api as restore_api
    from objckpt.saving import writer as save_api

    calls: list[str] = []
    monkeypatch.setattr(save_api, "release_freed_memory", lambda: calls.append("save"))
    monkeypatch.setattr(restore_api, "release_freed_memory", lambda: calls.append("restore"))
    state = _state(4)
    handle = objckpt.save_async(tmp_path.as_uri(), state)
    handle.result()
    for _ in range(100):  # the store closes, then the memory goes, after the result is set
        if calls:
            break
        threading.Event().wait(0.02)
    assert calls == ["save"]
    assert_tree_bit_exact(objckpt.restore(tmp_path.as_uri(), state), state)
    assert calls == ["save", "restore"]
    with pytest.raises(objckpt.TargetMismatchError):
        objckpt.restore(tmp_path.as_uri(), {"other": jax.ShapeDtypeStruct((3,), jnp.float32)})
    assert calls == ["save", "restore", "restore"]
