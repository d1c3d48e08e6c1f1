"""What a new Flax/optax user hits first: scalar metrics, lossy casts, ``None`` subtrees,
restoring a save still in flight, saving donated arrays."""

from __future__ import annotations

import asyncio
import math
import pathlib
import threading
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.manager.retention import KeepBest, StepRecord
from objckpt.storage import from_url, register_store

LOSSY = np.array([1e6, -3.7, 300.5, 3e38], np.float32)


def _target(shape: tuple[int, ...], dtype: Any, devices: int = 1) -> jax.ShapeDtypeStruct:
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("x")))


# ------------------------------------------------------------------ item 10: scalar metrics


def test_manager_metrics_take_jax_and_numpy_scalars_on_s3(s3_store):
    """What every training loop passes: a jitted step's 0-d loss, numpy scalars, nested metadata."""
    loss = jax.jit(lambda x: jnp.mean(x**2))(jnp.arange(4.0))  # a 0-d jax.Array
    options = s3_store.storage_options
    with objckpt.CheckpointManager(s3_store.url, storage_options=options) as mgr:
        mgr.save(
            1,
            {"w": jnp.ones(4)},
            metrics={"loss": loss, "acc": np.float32(0.25), "seen": np.int64(7), "ok": np.bool_(True)},
            metadata={"lr": np.float64(1e-3), "sched": {"warmup": [np.int32(10), (jnp.array(2.5),)]}},
            wait=True,
        )
    fresh = objckpt.CheckpointManager(s3_store.url, storage_options=options)
    metrics = fresh.metrics(1)
    assert metrics == {"loss": 3.5, "acc": 0.25, "seen": 7, "ok": True}
    assert type(metrics["seen"]) is int and type(metrics["ok"]) is bool
    assert fresh.inspect(1).metadata["sched"] == {"warmup": [10, [2.5]]}
    assert fresh.inspect(1).metadata["lr"] == 1e-3


def test_save_metadata_takes_numpy_scalars(local_store):
    objckpt.save(local_store.url, {"w": np.ones(3)}, metadata={"epoch": np.int16(3), "t": jnp.float32(0.5)})
    assert objckpt.inspect(local_store.url).metadata == {"epoch": 3, "t": 0.5}


def test_keep_best_ranks_jax_scalar_metrics(memory_store):
    with objckpt.CheckpointManager(
        memory_store.url, retention=objckpt.Retention(keep_best=1, best_metric="loss", best_mode="min")
    ) as mgr:
        for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0), (4, 5.0)):
            mgr.save(step, {"w": jnp.ones(2)}, metrics={"loss": jnp.float32(loss)})
    assert mgr.steps() == [2, 4]  # the best, and the latest (always kept)


def test_nan_and_inf_metrics_are_stored_as_strings(memory_store):
    with objckpt.CheckpointManager(memory_store.url) as mgr:
        mgr.save(1, {"w": jnp.ones(2)}, metrics={"loss": jnp.float32(2.0)})
        mgr.save(2, {"w": jnp.ones(2)}, metrics={"loss": jnp.array(jnp.nan), "gnorm": np.float32(np.inf)})
        mgr.save(3, {"w": jnp.ones(2)}, metrics={"loss": float("-inf")})
    fresh = objckpt.CheckpointManager(memory_store.url)
    assert fresh.metrics(2) == {"loss": "NaN", "gnorm": "Infinity"}
    assert fresh.metrics(3) == {"loss": "-Infinity"}
    assert math.isnan(float(fresh.metrics(2)["loss"])) and float(fresh.metrics(2)["gnorm"]) == math.inf
    records = [StepRecord(step, fresh.metrics(step)) for step in fresh.steps()]
    assert KeepBest(1, "loss", "min").keep(records) == {1}  # neither NaN nor -inf is ever "best"


def test_unserialisable_metric_names_its_key(memory_store):
    mgr = objckpt.CheckpointManager(memory_store.url)
    with pytest.raises(TypeError, match=r"metrics\['loss'\] is of type object"):
        mgr.save(1, {"w": jnp.ones(2)}, metrics={"loss": object()})
    with pytest.raises(TypeError, match=r"metadata\['cfg'\]\['opt'\]\[1\] is of type .*Path"):
        mgr.save(1, {"w": jnp.ones(2)}, metadata={"cfg": {"opt": ["adam", pathlib.Path("/x")]}})
    with pytest.raises(TypeError, match=r"metrics\['hist'\] is an array of shape \(3,\).*tolist"):
        mgr.save(1, {"w": jnp.ones(2)}, metrics={"hist": np.zeros(3)})
    with pytest.raises(TypeError, match=r"metadata\['z'\]"):
        objckpt.save(memory_store.url, {"w": np.ones(2)}, metadata={"z": 1j})
    mgr.close()
    assert mgr.steps() == []  # nothing was written


# ------------------------------------------------------------------ item 11: lossy casts


@pytest.mark.parametrize("form", ["sharded", "array"])
def test_cast_that_changes_kind_is_refused_before_reading(local_store, form):
    objckpt.save(local_store.url, {"x": LOSSY, "i": np.arange(4, dtype=np.int32)})
    for leaf, dtype, saved in (("x", jnp.int8, "float32"), ("i", jnp.uint32, "int32"), ("i", jnp.int16, "int32")):
        target = _target((4,), dtype, 2) if form == "sharded" else jnp.zeros(4, dtype)
        stats = objckpt.TransferStats()
        with pytest.raises(objckpt.TargetMismatchError) as info:
            objckpt.restore(local_store.url, {leaf: target}, partial=True, stats=stats)
        message = str(info.value)
        assert f"['{leaf}']" in message and saved in message and np.dtype(dtype).name in message
        assert 'cast="unsafe"' in message
        assert stats.bytes_read == 0  # decided from the dtypes alone


def test_float_downcast_that_overflows_is_refused(local_store):
    objckpt.save(local_store.url, {"x": LOSSY})
    with pytest.raises(objckpt.TargetMismatchError, match=r"\['x'\].*float32.*1000000\.0.*float16.*inf"):
        objckpt.restore(local_store.url, {"x": _target((4,), jnp.float16, 2)})


def test_float_downcast_overflow_in_a_large_leaf_placed_box_by_box(local_store):
    """A leaf over 16 MiB goes to its devices box by box; the check covers that path too."""
    big = np.zeros(5 << 20, np.float32)
    big[-1] = 1e6
    objckpt.save(local_store.url, {"x": big})
    with pytest.raises(objckpt.TargetMismatchError, match=r"\['x'\].*float16"):
        objckpt.restore(local_store.url, {"x": _target(big.shape, jnp.float16, 4)})
    out = objckpt.restore(local_store.url, {"x": _target(big.shape, jnp.bfloat16, 4)})["x"]
    assert out.dtype == jnp.bfloat16 and float(out[-1]) == pytest.approx(1e6, rel=1e-2)


def test_value_preserving_casts_stay_allowed(memory_store):
    saved = {
        "f32": LOSSY,
        "i32": np.array([1, -2, 3, 2**20], np.int32),
        "i8": np.array([-128, 127], np.int8),
        "u8": np.array([0, 255], np.uint8),
        "f16": np.array([1.5, -2.0], np.float16),
    }
    objckpt.save(memory_store.url, saved)
    wanted = {
        "f32": _target((4,), jnp.bfloat16, 2),  # precision only: what inference restores do
        "i32": _target((4,), jnp.float32, 2),  # int → float: numpy's same kind
        "i8": _target((2,), jnp.int32, 2),
        "u8": _target((2,), jnp.int16, 2),  # every uint8 fits in int16
        "f16": _target((2,), jnp.float32, 2),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = objckpt.restore(memory_store.url, wanted)
    np.testing.assert_allclose(np.asarray(out["f32"], np.float32), LOSSY.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(out["i32"], saved["i32"].astype(np.float32))
    np.testing.assert_array_equal(out["i8"], [-128, 127])
    np.testing.assert_array_equal(out["u8"], [0, 255])
    assert out["u8"].dtype == jnp.int16
    np.testing.assert_array_equal(out["f16"], [1.5, -2.0])


def test_cast_unsafe_applies_numpy_without_warnings(memory_store):
    objckpt.save(memory_store.url, {"x": LOSSY})
    with np.errstate(all="ignore"):
        as_int8, as_f16 = LOSSY.astype(np.int8), LOSSY.astype(np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's RuntimeWarning must not leak
        got = objckpt.restore(memory_store.url, {"x": _target((4,), jnp.int8, 2)}, cast="unsafe")["x"]
        np.testing.assert_array_equal(got, as_int8)
        got = objckpt.restore(memory_store.url, {"x": _target((4,), jnp.float16)}, cast="unsafe")["x"]
        np.testing.assert_array_equal(got, as_f16)
    with pytest.raises(ValueError, match="cast must be one of"):
        objckpt.restore(memory_store.url, {"x": _target((4,), jnp.int8)}, cast="yes")


def test_manager_restore_passes_cast(memory_store):
    with objckpt.CheckpointManager(memory_store.url) as mgr:
        mgr.save(1, {"x": LOSSY}, wait=True)
        with pytest.raises(objckpt.TargetMismatchError, match=r"\['x'\]"):
            mgr.restore(1, {"x": _target((4,), jnp.int8)})
        assert mgr.restore(1, {"x": _target((4,), jnp.int8)}, cast="unsafe")["x"].dtype == jnp.int8


# ------------------------------------------------------------------ item 12: None for a subtree


class AdamState(NamedTuple):  # how optax's states look to a pytree walk
    count: Any
    mu: Any


def _train_state() -> dict[str, Any]:
    return {
        "params": {"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}},
        "opt": AdamState(count=jnp.array(4), mu={"dense": {"kernel": jnp.full((2, 3), 0.5)}}),
        "step": 5,
    }


def test_none_target_restores_a_saved_subtree(memory_store):
    objckpt.save(memory_store.url, _train_state())
    got = objckpt.restore(memory_store.url, {"params": None}, partial=True)
    assert set(got) == {"params"} and set(got["params"]["dense"]) == {"kernel", "bias"}
    kernel = got["params"]["dense"]["kernel"]
    assert isinstance(kernel, np.ndarray) and kernel.shape == (2, 3) and (kernel == 1).all()
    # without partial=True when the Nones cover everything; a custom node comes back as a dict
    whole = objckpt.restore(memory_store.url, {"params": None, "opt": None, "step": None})
    assert whole["step"] == 5 and int(whole["opt"]["count"]) == 4
    assert (whole["opt"]["mu"]["dense"]["kernel"] == 0.5).all()
    # None under an attribute of the target's own node type
    got = objckpt.restore(memory_store.url, {"opt": AdamState(count=None, mu=None)}, partial=True)
    assert isinstance(got["opt"], AdamState) and set(got["opt"].mu) == {"dense"}


def test_none_subtree_without_partial_still_names_the_skipped_leaves(local_store):
    objckpt.save(local_store.url, _train_state())
    with pytest.raises(objckpt.TargetMismatchError, match=r"\['opt'\]\.count.*partial=True") as info:
        objckpt.restore(local_store.url, {"params": None})
    assert "['params']" not in str(info.value)
    with pytest.raises(objckpt.TargetMismatchError, match=r"not in the checkpoint: \['param'\]"):
        objckpt.restore(local_store.url, {"param": None}, partial=True)


# ------------------------------------------------------------------ item 14: in-flight save, donated arrays

_release = threading.Event()


def _held_store(url: str, **options: Any) -> Any:
    """A memory store whose manifest write waits for ``_release``: a save_async kept in flight."""
    store = from_url(url.replace("heldsave://", "memory://"), **options)
    put = store.put

    async def held_put(key: str, data: Any, *, mode: str = "overwrite") -> None:
        if key.endswith("manifest.json"):
            await asyncio.to_thread(_release.wait, 30)
        await put(key, data, mode=mode)

    store.put = held_put
    return store


def test_restore_of_a_save_still_in_flight_says_so(store_target_factory):
    register_store("heldsave", _held_store)
    url = store_target_factory("memory").url.replace("memory://", "heldsave://")
    _release.clear()
    handle = objckpt.save_async(url, {"w": jnp.ones(4)})
    try:
        for where in (url, url.replace("heldsave://", "memory://") + "/"):
            with pytest.raises(objckpt.CheckpointNotFoundError, match="save_async to this URL is still running"):
                objckpt.restore(where)
    finally:
        _release.set()
    handle.result(timeout=30)
    assert (objckpt.restore(url)["w"] == 1).all()
    with pytest.raises(objckpt.CheckpointNotFoundError) as info:
        objckpt.restore(url + "-other")
    assert "still running" not in str(info.value)


def test_saving_a_donated_array_names_the_leaf(local_store):
    donated = jnp.ones((4, 4))
    donated.delete()  # what donate_argnums does to the step's input
    tree = {"params": {"w": donated, "b": jnp.zeros(4)}}
    for save in (objckpt.save, objckpt.save_async):
        with pytest.raises(objckpt.DeletedArrayError, match=r"\['params'\]\['w'\].*donated") as info:
            save(local_store.url, tree)
        assert isinstance(info.value, ValueError)
    with pytest.raises(objckpt.CheckpointNotFoundError):
        objckpt.restore(local_store.url)  # nothing committed
