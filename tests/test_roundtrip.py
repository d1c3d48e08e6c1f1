"""Save → restore round trips: every dtype × sharding pattern × store, bit-exact."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.core.dtypes import DTYPES
from objckpt.transfer import runtime
from tests.helpers import assert_tree_bit_exact, count_reads, full_manifest, random_array


class AdamState(NamedTuple):
    count: jax.Array
    mu: dict
    nu: dict


def _shardings():
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    return {
        "fully_sharded": NamedSharding(mesh, P("x", "y")),
        "partially_replicated": NamedSharding(mesh, P("x")),
        "fully_replicated": NamedSharding(mesh, P()),
        "single_device": SingleDeviceSharding(jax.devices()[3]),
    }


def _jax_dtypes() -> list[str]:
    """Every storable dtype that this JAX can put on a device (float6 and int2 may not be)."""
    names = []
    for name in sorted(DTYPES):
        try:
            jax.device_put(np.zeros(2, DTYPES[name]))
        except Exception:
            continue
        names.append(name)
    return names


def _tree():
    leaves = {}
    shardings = _shardings()
    for i, name in enumerate(_jax_dtypes()):
        for j, (pattern, sharding) in enumerate(shardings.items()):
            host = random_array((8, 4), DTYPES[name], seed=i * 10 + j)
            leaves.setdefault(name, {})[pattern] = jax.device_put(host, sharding)
    mesh_sharding = shardings["fully_sharded"]
    w = jax.device_put(random_array((64, 48), np.float32, seed=99), mesh_sharding)
    return {
        "arrays": leaves,
        "opt": AdamState(jnp.asarray(7), {"w": w}, {"w": w * 2}),
        "host": {"np": random_array((3, 5), np.int16, seed=1), "np_scalar": np.float32(2.5), "empty": np.zeros((0, 3))},
        "python": [1, 2.5, float("nan"), True, "naïve ✓", b"\x00\xff", None, 2**70],
        "empty_dict": {},
        "scalar_array": jax.device_put(jnp.float32(3.0), shardings["fully_replicated"]),
    }


def test_round_trip_every_dtype_and_sharding(any_store):
    tree = _tree()
    objckpt.save(any_store.url, tree, storage_options=any_store.storage_options)

    # Same tree as target: arrays come back on their own shardings, the rest as saved.
    restored = objckpt.restore(any_store.url, tree, storage_options=any_store.storage_options)
    expected = dict(tree, host=dict(tree["host"], np_scalar=np.asarray(tree["host"]["np_scalar"])))
    assert_tree_bit_exact(expected, restored)
    for a, b in zip(jax.tree_util.tree_leaves(tree["arrays"]), jax.tree_util.tree_leaves(restored["arrays"])):
        assert b.sharding == a.sharding

    # No target: plain containers, arrays as numpy, custom nodes as dicts.
    plain = objckpt.restore(any_store.url, storage_options=any_store.storage_options)
    assert isinstance(plain["arrays"]["bfloat16"]["fully_sharded"], np.ndarray)
    assert plain["python"] == [1, 2.5, plain["python"][2], True, "naïve ✓", b"\x00\xff", None, 2**70]
    assert set(plain["opt"]) == {"count", "mu", "nu"}
    assert plain["empty_dict"] == {}
    np.testing.assert_array_equal(plain["opt"]["mu"]["w"], np.asarray(tree["opt"].mu["w"]))


def test_inspect_lists_every_leaf_without_reading_data(any_store, monkeypatch):
    tree = {"params": {"w": jnp.ones((128, 64), jnp.bfloat16), "b": np.zeros(3, np.float32)}, "step": 3, "tag": "run-1"}
    objckpt.save(any_store.url, tree, storage_options=any_store.storage_options, metadata={"lr": 0.1})
    counting = count_reads(monkeypatch)
    info = objckpt.inspect(any_store.url, storage_options=any_store.storage_options)
    assert [key for store in counting for key, _, _ in store.reads] == ["manifest.json"]  # the root alone
    assert info.total_bytes == 128 * 64 * 2 + 12 + len("run-1")
    assert info.metadata == {"lr": 0.1}
    assert info.format_version == 3 and info.created
    blobs = [o.key for o in runtime.run_sync(any_store.open().list()) if o.key.endswith(".blob")]
    assert info.num_blobs == len(blobs) == len(full_manifest(any_store.open()).blobs) >= 1  # from the root alone
    assert info.tree["params"]["w"].shape == (128, 64)
    assert info.leaves["['params']['w']"].dtype == "bfloat16"
    text = str(info)
    for path in ("['params']['w']", "['params']['b']", "['step']", "['tag']"):
        assert path in text
    assert "bfloat16[128, 64]" in text
