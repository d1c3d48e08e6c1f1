"""Restores that read a leaf on the saved grid and reshard it on the devices (objckpt.restoring.reshard),
in one process on 8 CPU devices through the local S3 server. Stand-in hosts (2 devices each, by device id)
make the cost model see the cuts a pod would; the reads and the reshard are real."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.core import boxes
from objckpt.restoring import api, leaf_plan, read_sharding

SHAPE = (64, 32)


def _saved_mesh() -> Mesh:
    return jax.make_mesh((4, 2), ("fsdp", "tensor"), devices=jax.devices()[:8])


def _fsdp_minor() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4).T, ("fsdp", "tensor"))


TARGETS = {
    # name: (target sharding, resharded with hosts of 2 devices)
    "swapped axes": (lambda: NamedSharding(_saved_mesh(), P("tensor", "fsdp")), True),
    "fsdp minor device order": (lambda: NamedSharding(_fsdp_minor(), P("fsdp", "tensor")), False),
    "P(None, 'tensor') on tensor=8": (
        lambda: NamedSharding(jax.make_mesh((8,), ("tensor",), devices=jax.devices()[:8]), P(None, "tensor")),
        True,
    ),
}


@pytest.fixture
def stand_in_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Restore's read-sharding choice sees hosts of 2 devices (device id // 2), as 4 processes would,
    and no floor (the leaves here are a few KiB)."""
    planner = functools.partial(
        read_sharding.plan_read_shardings,
        planner=read_sharding.ReadPlanner(process_of=lambda d: d.id // 2, min_saved=0),
    )
    monkeypatch.setattr(api, "plan_read_shardings", planner)


def _save(s3_store, host: np.ndarray) -> None:
    array = jax.device_put(host, NamedSharding(_saved_mesh(), P("fsdp", "tensor")))
    objckpt.save(s3_store.url, {"w": array, "b": jnp.arange(8.0)}, storage_options=s3_store.storage_options)


@pytest.mark.s3
@pytest.mark.parametrize("name", list(TARGETS))
def test_a_restore_onto_a_cutting_target_reads_on_the_saved_layout_and_is_bit_exact(
    s3_store, stand_in_hosts, name: str
) -> None:
    host = (np.arange(np.prod(SHAPE), dtype=np.float32) * 0.37 % 251).reshape(SHAPE)
    _save(s3_store, host)
    make, resharded = TARGETS[name]
    sharding = make()
    stats = objckpt.TransferStats()
    out = objckpt.restore(
        s3_store.url,
        {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding), "b": None},
        storage_options=s3_store.storage_options,
        stats=stats,
    )
    w = out["w"]
    assert w.sharding == sharding
    for shard in w.addressable_shards:
        assert np.asarray(shard.data).tobytes() == host[shard.index].tobytes()
    assert (stats.device_bytes_moved > 0) == resharded
    needed = host.nbytes + 8 * 4  # one process: its devices need every byte
    assert stats.bytes_read <= 1.5 * needed


@pytest.mark.s3
def test_the_read_sharding_keeps_the_target_dtype(s3_store, stand_in_hosts) -> None:
    host = np.random.default_rng(0).normal(size=SHAPE).astype(np.float32)
    _save(s3_store, host)
    sharding = NamedSharding(_saved_mesh(), P("tensor", "fsdp"))
    stats = objckpt.TransferStats()
    w = objckpt.restore(
        s3_store.url,
        {"w": jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16, sharding=sharding)},
        storage_options=s3_store.storage_options,
        stats=stats,
        partial=True,
    )["w"]
    assert w.dtype == jnp.bfloat16 and w.sharding == sharding and stats.device_bytes_moved > 0
    np.testing.assert_array_equal(np.asarray(w), host.astype(jnp.bfloat16))


@pytest.mark.s3
def test_one_process_reads_directly(s3_store) -> None:
    # One host holds every device: reading the target's boxes fetches nothing it does not need.
    host = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    _save(s3_store, host)
    sharding = NamedSharding(_saved_mesh(), P("tensor", "fsdp"))
    stats = objckpt.TransferStats()
    w = objckpt.restore(
        s3_store.url,
        {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)},
        storage_options=s3_store.storage_options,
        stats=stats,
        partial=True,
    )["w"]
    assert stats.device_bytes_moved == 0
    assert np.asarray(w).tobytes() == host.tobytes()


@pytest.mark.s3
def test_other_devices_read_on_a_mesh_of_their_own_lined_up_with_the_saved_cells(s3_store, stand_in_hosts) -> None:
    # Saved on devices 0-3, restored onto devices 4-7 in an order that gives each stand-in host every
    # other column block (whole saved pieces: 2x its need): the read mesh is built over 4-7.
    host = (np.arange(np.prod(SHAPE), dtype=np.float32) * 0.37 % 251).reshape(SHAPE)
    saved = jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=jax.devices()[:4])
    objckpt.save(
        s3_store.url,
        {"w": jax.device_put(host, NamedSharding(saved, P("fsdp", "tensor")))},
        storage_options=s3_store.storage_options,
    )
    devices = jax.devices()
    sharding = NamedSharding(Mesh(np.array([devices[k] for k in (4, 6, 5, 7)]), ("x",)), P(None, "x"))
    stats = objckpt.TransferStats()
    w = objckpt.restore(
        s3_store.url,
        {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)},
        storage_options=s3_store.storage_options,
        stats=stats,
    )["w"]
    assert w.sharding == sharding and stats.device_bytes_moved > 0
    for shard in w.addressable_shards:
        assert np.asarray(shard.data).tobytes() == host[shard.index].tobytes()


@pytest.mark.s3
def test_reshard_off_reads_every_leaf_directly(s3_store, stand_in_hosts, monkeypatch) -> None:
    host = (np.arange(np.prod(SHAPE), dtype=np.float32) * 0.37 % 251).reshape(SHAPE)
    _save(s3_store, host)
    sharding = NamedSharding(_saved_mesh(), P("tensor", "fsdp"))
    target = {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)}
    planned = []
    plan = api.plan_read_shardings
    monkeypatch.setattr(api, "plan_read_shardings", lambda *a, **k: planned.append(plan(*a, **k)) or planned[-1])
    for reshard in (True, False):
        stats = objckpt.TransferStats()
        w = objckpt.restore(
            s3_store.url,
            target,
            storage_options=s3_store.storage_options,
            stats=stats,
            partial=True,
            options=objckpt.Options(reshard=reshard),
        )["w"]
        assert w.sharding == sharding and np.asarray(w).tobytes() == host.tobytes()
        assert (stats.device_bytes_moved > 0) == reshard
    assert len(planned) == 1 and list(planned[0]) == [1]  # off: not even planned


@pytest.mark.s3
def test_planning_caches_are_empty_once_a_restore_ends(s3_store, stand_in_hosts, monkeypatch) -> None:
    # objckpt is a guest in the training process: no box index, piece geometry or target sharding
    # (with its mesh) stays cached after the restore that used it.
    host = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    _save(s3_store, host)

    def sizes() -> list[int]:
        lru = (leaf_plan._box_index, boxes._needed_boxes)
        return [*(c.cache_info().currsize for c in lru), len(leaf_plan._MEETINGS)]

    held = []
    clear = api.clear_planning_caches
    monkeypatch.setattr(api, "clear_planning_caches", lambda: held.append(sizes()) or clear())
    target = {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=NamedSharding(_saved_mesh(), P("tensor", "fsdp")))}
    target["b"] = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(_saved_mesh(), P()))
    objckpt.restore(s3_store.url, target, storage_options=s3_store.storage_options)
    assert len(held) == 1 and all(n > 0 for n in held[0]), held  # used while it planned
    assert sizes() == [0, 0, 0]
    with pytest.raises(objckpt.TargetMismatchError):  # emptied on failure too
        objckpt.restore(
            s3_store.url,
            {"w": jax.ShapeDtypeStruct((64, 31), jnp.float32, sharding=target["w"].sharding), "b": target["b"]},
            storage_options=s3_store.storage_options,
        )
    assert len(held) == 2 and sizes() == [0, 0, 0]
