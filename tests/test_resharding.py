"""Restore onto shardings other than the saved one, and target mismatches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import objckpt
from tests.helpers import random_array


def _mesh(shape, names):
    return jax.make_mesh(shape, names)


CASES = {
    # name: (shape, saved sharding factory, target sharding factory)
    "(4,2)->(2,4)": (
        (16, 24),
        lambda: NamedSharding(_mesh((4, 2), ("x", "y")), P("x", "y")),
        lambda: NamedSharding(_mesh((2, 4), ("a", "b")), P("a", "b")),
    ),
    "transposed_axes": (
        (16, 24),
        lambda: NamedSharding(_mesh((4, 2), ("x", "y")), P("x", "y")),
        lambda: NamedSharding(_mesh((4, 2), ("x", "y")), P("y", "x")),
    ),
    "sharded->replicated": (
        (16, 24),
        lambda: NamedSharding(_mesh((4, 2), ("x", "y")), P("x", "y")),
        lambda: NamedSharding(_mesh((8,), ("d",)), P()),
    ),
    "sharded->single_device": (
        (16, 24),
        lambda: NamedSharding(_mesh((4, 2), ("x", "y")), P("x", "y")),
        lambda: SingleDeviceSharding(jax.devices()[5]),
    ),
    "replicated->sharded": (
        (16, 24),
        lambda: NamedSharding(_mesh((8,), ("d",)), P()),
        lambda: NamedSharding(_mesh((2, 4), ("a", "b")), P("b", "a")),
    ),
    "single_device->sharded": (
        (16, 24),
        lambda: SingleDeviceSharding(jax.devices()[0]),
        lambda: NamedSharding(_mesh((8,), ("d",)), P(None, "d")),
    ),
    "uneven_dims": (
        (12, 6),
        lambda: NamedSharding(_mesh((4, 2), ("x", "y")), P("x", "y")),
        lambda: NamedSharding(_mesh((2, 4), ("a", "b")), P("a", None)),
    ),
    "odd_dims_to_other_partition": (
        (10, 7, 3),
        lambda: NamedSharding(_mesh((2, 4), ("x", "y")), P("x")),
        lambda: NamedSharding(_mesh((8,), ("d",)), P(None, None, None)),
    ),
    "other_partition_same_axis": (
        (32, 8),
        lambda: NamedSharding(_mesh((8,), ("d",)), P("d")),
        lambda: NamedSharding(_mesh((2, 4), ("a", "b")), P(("a", "b"))),
    ),
    "3d_mesh": (
        (16, 8, 4),
        lambda: NamedSharding(_mesh((2, 2, 2), ("a", "b", "c")), P("a", "b", "c")),
        lambda: NamedSharding(_mesh((4, 2), ("x", "y")), P("y", None, "x")),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resharding_matrix(memory_store, case):
    shape, saved, target = CASES[case]
    host = random_array(shape, jnp.bfloat16, seed=len(case))
    array = jax.device_put(host, saved())
    objckpt.save(memory_store.url, {"w": array}, storage_options=memory_store.storage_options)
    sharding = target()
    restored = objckpt.restore(
        memory_store.url,
        {"w": jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)},
        storage_options=memory_store.storage_options,
    )["w"]
    assert restored.sharding == sharding
    assert np.asarray(restored).tobytes() == host.tobytes()
    for shard in restored.addressable_shards:  # every device holds exactly its slice
        assert np.asarray(shard.data).tobytes() == host[shard.index].tobytes()


def test_resharding_on_s3_and_dtype_cast(s3_store):
    host = np.random.default_rng(3).normal(size=(64, 32)).astype(np.float32)  # finite, so the cast is comparable
    mesh = _mesh((4, 2), ("x", "y"))
    objckpt.save(
        s3_store.url,
        {"w": jax.device_put(host, NamedSharding(mesh, P("x", "y")))},
        storage_options=s3_store.storage_options,
    )
    target_sharding = NamedSharding(_mesh((2, 4), ("a", "b")), P("b", "a"))
    out = objckpt.restore(
        s3_store.url,
        {"w": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16, sharding=target_sharding)},
        storage_options=s3_store.storage_options,
    )["w"]
    assert out.dtype == jnp.bfloat16 and out.sharding == target_sharding
    np.testing.assert_array_equal(np.asarray(out), host.astype(jnp.bfloat16))
    # A concrete jax.Array target lends its sharding, shape and dtype.
    like = jax.device_put(np.zeros((64, 32), np.float32), NamedSharding(mesh, P(None, "x")))
    out2 = objckpt.restore(s3_store.url, {"w": like}, storage_options=s3_store.storage_options)["w"]
    assert out2.sharding == like.sharding
    assert np.asarray(out2).tobytes() == host.tobytes()
    # A ShapeDtypeStruct without sharding lands on the saved sharding: these are the saved devices
    # (elsewhere, on the first local device: tests/test_dayone_targets.py).
    out3 = objckpt.restore(
        s3_store.url, {"w": jax.ShapeDtypeStruct((64, 32), np.float32)}, storage_options=s3_store.storage_options
    )["w"]
    assert out3.sharding == NamedSharding(mesh, P("x", "y"))


def test_target_mismatch_names_leaves_and_shapes(memory_store):
    tree = {"params": {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}, "opt_state": {"mu": jnp.ones(4)}, "step": 1}
    objckpt.save(memory_store.url, tree, storage_options=memory_store.storage_options)
    so = memory_store.storage_options
    with pytest.raises(objckpt.TargetMismatchError) as info:
        objckpt.restore(memory_store.url, {"params": tree["params"], "extra": None}, storage_options=so)
    message = str(info.value)
    assert "['extra']" in message and "['opt_state']['mu']" in message and "['step']" in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(objckpt.TargetMismatchError, match=r"\['extra'\]"):
        objckpt.restore(memory_store.url, {"params": tree["params"], "extra": None}, storage_options=so, partial=True)
    bad_shape = dict(tree, params={"w": jax.ShapeDtypeStruct((4, 5), jnp.float32), "b": None})
    with pytest.raises(objckpt.TargetMismatchError, match=r"\['params'\]\['w'\].*\(4, 5\).*\(4, 4\)"):
        objckpt.restore(memory_store.url, bad_shape, storage_options=so)


def test_sharding_that_does_not_fit_shape_is_a_clear_error(memory_store):
    objckpt.save(memory_store.url, {"w": jnp.ones((6, 4))}, storage_options=memory_store.storage_options)
    bad = NamedSharding(_mesh((4, 2), ("x", "y")), P("x"))  # 6 rows over 4 devices
    with pytest.raises((objckpt.TargetMismatchError, ValueError), match=r"\['w'\]"):
        objckpt.restore(
            memory_store.url,
            {"w": jax.ShapeDtypeStruct((6, 4), jnp.float32, sharding=bad)},
            storage_options=memory_store.storage_options,
        )
