"""Issue 52, items 9-10: targets as a training job has them.

- A target from ``jax.eval_shape`` has no shardings (under an ``Auto`` mesh) or shardings on
  an abstract mesh (under an ``Explicit`` one). Where this job's devices are the saved ones
  (same count, ids and processes), its leaves restore onto the saved shardings, not all onto
  device 0; elsewhere a bare leaf keeps today's rule (the first local device), and says why.
- A dict target for a state saved as a dataclass (a linen ``TrainState``: attribute paths
  ``.params``) is refused with the nearest saved path: "did you mean .params".

The tests run on the 8 CPU devices ``tests/conftest.py`` asks for, against the local S3 and
GCS servers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.transfer import runtime
from tests.helpers import assert_tree_bit_exact


def _mesh(types: AxisType, devices: list[Any] | None = None) -> jax.sharding.Mesh:
    devices = devices if devices is not None else jax.devices()
    return jax.make_mesh((2, len(devices) // 2), ("x", "y"), axis_types=(types, types), devices=devices)


def _state(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """A small training state on ``mesh``: sharded, replicated and 0-d arrays, and a numpy leaf."""

    def put(shape: tuple[int, ...], dtype: Any, spec: P, seed: int) -> jax.Array:
        values = np.random.default_rng(seed).normal(size=shape).astype(dtype)  # finite: the jit below compares
        return jax.device_put(values, NamedSharding(mesh, spec))

    return {
        "params": {"w": put((16, 24), np.float32, P("x", "y"), 1), "b": put((24,), jnp.bfloat16, P("y"), 2)},
        "opt_state": {"mu": put((16, 24), np.float32, P(None, "y"), 3), "norm": put((8,), np.float32, P(), 4)},
        "step": jax.device_put(np.int32(7), NamedSharding(mesh, P())),
        "rng_counts": np.arange(5, dtype=np.int32),
    }


def _root(store_target) -> tuple[Any, dict[str, Any]]:
    store = store_target.open()
    return store, json.loads(bytes(runtime.run_sync(store.get("manifest.json"))))


def _write_root(store, doc: dict[str, Any]) -> None:
    runtime.run_sync(store.delete("manifest.json"))
    runtime.run_sync(store.put("manifest.json", json.dumps(doc).encode(), mode="create"))


def _train_step(state: dict[str, Any]) -> jax.Array:
    return (state["params"]["w"] * state["opt_state"]["mu"]).sum() + state["step"]


def test_eval_shape_target_restores_onto_the_saved_shardings(s3_store) -> None:
    """An ``Auto`` mesh (what ``jax.sharding.Mesh`` makes): ``eval_shape`` leaves have no sharding."""
    state = _state(_mesh(AxisType.Auto))
    so = s3_store.storage_options
    objckpt.save(s3_store.url, state, storage_options=so)
    abstract = jax.eval_shape(lambda: state)
    assert abstract["params"]["w"].sharding is None  # what the user had

    out = objckpt.restore(s3_store.url, abstract, storage_options=so)

    assert_tree_bit_exact(state, jax.tree.map(np.asarray, out))
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        where = jax.tree_util.keystr(path)
        restored = out
        for key in path:
            restored = restored[key.key]
        if isinstance(leaf, jax.Array):
            assert restored.sharding == leaf.sharding, where
            assert len(restored.sharding.device_set) == 8, where
        else:  # numpy leaves were not saved on a mesh: today's rule
            assert restored.sharding == SingleDeviceSharding(jax.local_devices()[0]), where
    # The restored state is usable as it is: one jit over all of it (no two device sets).
    assert float(_train_step(out)) == float(_train_step(state))


def test_explicit_mesh_eval_shape_target_restores_onto_the_saved_mesh(gcs_store) -> None:
    """``jax.make_mesh``'s default (``Explicit``): ``eval_shape`` leaves are on an abstract mesh,
    which cannot be placed; the saved mesh (same axes, same devices) stands in for it."""
    mesh = _mesh(AxisType.Explicit)
    state = _state(mesh)
    so = gcs_store.storage_options
    objckpt.save(gcs_store.url, state, storage_options=so)
    abstract = jax.eval_shape(lambda: state)
    assert isinstance(abstract["params"]["w"].sharding.mesh, jax.sharding.AbstractMesh)

    out = objckpt.restore(gcs_store.url, abstract, storage_options=so)

    assert_tree_bit_exact(state, jax.tree.map(np.asarray, out))
    for name in ("w", "b"):
        assert out["params"][name].sharding == state["params"][name].sharding
    assert out["opt_state"]["norm"].sharding.is_equivalent_to(state["opt_state"]["norm"].sharding, 1)
    assert out["params"]["w"].sharding.mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    # Restored and live arrays share one mesh (same axis types too), so they mix in one jit.
    product = jax.jit(lambda a, b: a * b)(out["params"]["w"], state["params"]["w"])
    assert product.sharding == state["params"]["w"].sharding
    assert np.array_equal(np.asarray(product), np.asarray(state["params"]["w"]) ** 2)
    # A bare ShapeDtypeStruct for a leaf saved on an Explicit mesh gets the saved axis types back
    # (from the leaf's sharding description): its sharding equals the saved one.
    bare = {"params": {"w": jax.ShapeDtypeStruct((16, 24), np.float32)}}
    w = objckpt.restore(gcs_store.url, bare, storage_options=so, partial=True)["params"]["w"]
    assert w.sharding == state["params"]["w"].sharding


def test_saved_mesh_of_other_devices_keeps_the_first_device_and_says_why(s3_store, caplog) -> None:
    """A checkpoint whose mesh names device ids that are not here (a save on another job)."""
    state = _state(_mesh(AxisType.Auto))
    so = s3_store.storage_options
    objckpt.save(s3_store.url, state, storage_options=so)
    store, doc = _root(s3_store)
    (mesh,) = doc["meshes"]
    mesh["devices"] = [100 + i for i in mesh["devices"]]
    _write_root(store, doc)
    abstract = jax.eval_shape(lambda: state)

    with caplog.at_level(logging.INFO, logger="objckpt"):
        out = objckpt.restore(s3_store.url, abstract, storage_options=so)

    assert_tree_bit_exact(state, jax.tree.map(np.asarray, out))
    first = SingleDeviceSharding(jax.local_devices()[0])
    assert all(leaf.sharding == first for leaf in jax.tree.leaves(out))
    assert any("first local device" in r.getMessage() and "not these 8" in r.getMessage() for r in caplog.records)

    # A sharding on an abstract mesh cannot go to one device silently: a clear error, naming the leaf.
    explicit = jax.eval_shape(lambda: _state(_mesh(AxisType.Explicit)))
    with pytest.raises(objckpt.TargetMismatchError, match=r"\['opt_state'\]\['mu'\].*abstract mesh"):
        objckpt.restore(s3_store.url, explicit, storage_options=so)


def test_save_on_part_of_the_devices_keeps_the_first_device(s3_store, caplog) -> None:
    """A save on 4 of this job's 8 devices: not the same device count, so today's rule."""
    state = _state(_mesh(AxisType.Auto, jax.devices()[:4]))
    so = s3_store.storage_options
    objckpt.save(s3_store.url, state, storage_options=so)
    with caplog.at_level(logging.INFO, logger="objckpt"):
        out = objckpt.restore(s3_store.url, jax.eval_shape(lambda: state), storage_options=so)
    assert_tree_bit_exact(state, jax.tree.map(np.asarray, out))
    first = SingleDeviceSharding(jax.local_devices()[0])
    assert all(leaf.sharding == first for leaf in jax.tree.leaves(out))
    assert any("meshes use 4 devices, not these 8" in r.getMessage() for r in caplog.records)


def test_orbax_checkpoint_eval_shape_target_restores_onto_the_saved_shardings(tmp_path, s3_service, caplog) -> None:
    """The same rule for an Orbax checkpoint (its ``_sharding`` file records the device ids)."""
    ocp = pytest.importorskip("orbax.checkpoint")
    pytest.importorskip("tensorstore")
    from objckpt.storage import from_url

    state = {k: v for k, v in _state(_mesh(AxisType.Auto)).items() if k != "rng_counts"}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    url, options = s3_service.url(f"orbax-{uuid.uuid4().hex[:8]}"), s3_service.storage_options()
    store = from_url(url, **options)
    for path in (tmp_path / "ckpt").rglob("*"):
        if path.is_file():
            runtime.run_sync(store.put(path.relative_to(tmp_path / "ckpt").as_posix(), path.read_bytes()))
    abstract = jax.eval_shape(lambda: state)

    out = objckpt.restore(url, abstract, storage_options=options)

    assert_tree_bit_exact(state, jax.tree.map(np.asarray, out))
    for group, name in (("params", "w"), ("params", "b"), ("opt_state", "mu"), ("opt_state", "norm")):
        assert out[group][name].sharding == state[group][name].sharding, name
    assert float(_train_step(out)) == float(_train_step(state))

    # The saved device ids are not these: every leaf keeps the first local device.
    raw = json.loads(bytes(runtime.run_sync(store.get("_sharding"))))
    for key, described in raw.items():
        doc = json.loads(described)
        doc["device_mesh"]["mesh"] = [[{"id": 100 + d["id"]} for d in row] for row in doc["device_mesh"]["mesh"]]
        raw[key] = json.dumps(doc)
    runtime.run_sync(store.put("_sharding", json.dumps(raw).encode()))
    with caplog.at_level(logging.INFO, logger="objckpt"):
        out = objckpt.restore(url, abstract, storage_options=options)
    runtime.run_sync(store.close())
    assert_tree_bit_exact(state, jax.tree.map(np.asarray, out))
    assert all(leaf.sharding.device_set == {jax.local_devices()[0]} for leaf in jax.tree.leaves(out))
    assert any("first local device" in r.getMessage() for r in caplog.records)


@dataclasses.dataclass
class TrainState:
    """Shaped like flax's linen ``TrainState``: a dataclass pytree, so saved paths are attributes."""

    step: jax.Array
    params: dict[str, Any]
    opt_state: dict[str, Any]


jax.tree_util.register_dataclass(TrainState, data_fields=["step", "params", "opt_state"], meta_fields=[])


def test_dict_target_for_a_dataclass_state_names_the_saved_path(s3_store) -> None:
    state = TrainState(
        step=jnp.int32(3),
        params={"dense": {"kernel": jnp.ones((4, 4)), "bias": jnp.zeros(4)}},
        opt_state={"mu": {"dense": {"kernel": jnp.ones((4, 4)), "bias": jnp.zeros(4)}}},
    )
    so = s3_store.storage_options
    objckpt.save(s3_store.url, state, storage_options=so)
    assert ".params['dense']['kernel']" in objckpt.inspect(s3_store.url, storage_options=so).leaves

    with pytest.raises(objckpt.TargetMismatchError) as info:
        objckpt.restore(s3_store.url, {"params": state.params}, storage_options=so, partial=True)
    message = str(info.value)
    assert "['params']['dense']['kernel']" in message  # what the target named, as before
    assert "did you mean .params (the target's ['params'])?" in message

    # A None standing for the subtree, and a whole dict-shaped state: one hint per renamed key.
    with pytest.raises(objckpt.TargetMismatchError, match=r"did you mean \.params \(the target's \['params'\]\)\?"):
        objckpt.restore(s3_store.url, {"params": None}, storage_options=so, partial=True)
    as_dict = {"step": 0, "params": state.params, "opt_state": state.opt_state}
    with pytest.raises(objckpt.TargetMismatchError) as info:
        objckpt.restore(s3_store.url, as_dict, storage_options=so)
    assert "did you mean .opt_state (the target's ['opt_state']), .params (the target's ['params'])," in str(info.value)

    # A misspelt key: the closest saved path by spelling.
    with pytest.raises(objckpt.TargetMismatchError, match=r"did you mean \.params\['dense'\]\['kernel'\]"):
        objckpt.restore(s3_store.url, {"parmas": {"dense": {"kernel": None}}}, storage_options=so, partial=True)

    # The target of the saved type still restores, partially too (the hint changes nothing else).
    target = TrainState(step=None, params=state.params, opt_state=None)
    out = objckpt.restore(s3_store.url, target, storage_options=so, partial=True)
    assert np.asarray(out.params["dense"]["kernel"]).tolist() == np.ones((4, 4)).tolist()


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_python_numbers_restore_into_the_0d_arrays_eval_shape_makes_of_them(store_target_factory, kind) -> None:
    """``eval_shape`` turns a saved Python number into a 0-d ``ShapeDtypeStruct``: the number comes
    back as a 0-d array of that dtype; a None or a shaped array target is still refused."""
    target = store_target_factory(kind)
    so = target.storage_options
    state = {"step": 12, "lr": 0.5, "done": True, "w": np.arange(4, dtype=np.float32)}
    objckpt.save(target.url, state, storage_options=so)
    abstract = jax.eval_shape(lambda: state)

    out = objckpt.restore(target.url, abstract, storage_options=so)

    for name in ("step", "lr", "done"):
        assert isinstance(out[name], jax.Array) and out[name].shape == (), name
        assert out[name].dtype == abstract[name].dtype and out[name].item() == state[name], name
    np.testing.assert_array_equal(np.asarray(out["w"]), state["w"])
    with pytest.raises(objckpt.TargetMismatchError, match=r"leaf \['step'\]: saved a Python int.* \[2\]"):
        objckpt.restore(target.url, {**abstract, "step": jax.ShapeDtypeStruct((2,), jnp.int32)}, storage_options=so)
