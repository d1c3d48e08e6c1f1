"""CheckpointManager: steps, retention, async saves, gc."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import objckpt
from objckpt.transfer import runtime


def _state(step):
    return {
        "params": {"w": jnp.full((32, 16), step, jnp.float32)},
        "step": step,
        "data": {"epoch": step // 3, "pos": step * 7},
        "cfg": {"name": "run"},
    }


def test_steps_latest_restore_inspect(any_store):
    with objckpt.CheckpointManager(any_store.url, storage_options=any_store.storage_options) as mgr:
        assert mgr.steps() == [] and mgr.latest_step() is None
        for step in (1, 2, 10):
            mgr.save(step, _state(step), metrics={"loss": 1.0 / step})
        mgr.wait()
        assert mgr.steps() == [1, 2, 10]
        assert mgr.latest_step() == 10
        latest = mgr.restore()
        assert latest["step"] == 10 and latest["data"] == {"epoch": 3, "pos": 70} and latest["cfg"] == {"name": "run"}
        np.testing.assert_array_equal(latest["params"]["w"], np.full((32, 16), 10, np.float32))
        assert mgr.restore(2, {"params": {"w": None}}, partial=True)["params"]["w"][0, 0] == 2
        assert mgr.inspect(1).metadata["objckpt.manager"]["metrics"] == {"loss": 1.0}
        with pytest.raises(objckpt.CheckpointExistsError):
            mgr.save(10, _state(10), wait=True)


def test_no_retention_keeps_everything_and_listing_reads_no_blobs(memory_store, monkeypatch):
    mgr = objckpt.CheckpointManager(memory_store.url)
    for step in range(6):
        mgr.save(step, _state(step))
    mgr.close()
    assert mgr.steps() == list(range(6))
    calls = []
    store = mgr.store
    original = type(store).get_range

    async def spy(self, key, *, start, end):
        calls.append(key)
        return await original(self, key, start=start, end=end)

    monkeypatch.setattr(type(store), "get_range", spy)
    assert mgr.steps() == list(range(6)) and mgr.latest_step() == 5
    assert calls == []


def test_retention_policies_combine(memory_store):
    mgr = objckpt.CheckpointManager(
        memory_store.url,
        retention=objckpt.Retention(keep_last=2, keep_every=4, keep_best=1, best_metric="acc", best_mode="max"),
    )
    acc = {1: 0.5, 2: 0.9, 3: 0.1, 4: 0.2, 5: 0.3, 6: 0.4, 7: 0.0, 8: 0.1, 9: 0.2}
    for step in range(1, 10):
        mgr.save(step, _state(step), metrics={"acc": acc[step]})
    mgr.close()
    # last two (8, 9), multiples of 4 (4, 8), best acc (2)
    assert mgr.steps() == [2, 4, 8, 9]
    # deleted steps leave nothing behind (manifest and blobs both gone)
    keys = {o.key.split("/")[0] for o in runtime.run_sync(mgr.store.list())}
    assert keys == {"step_0000000002", "step_0000000004", "step_0000000008", "step_0000000009"}


def test_keep_best_reads_metrics_of_earlier_runs(memory_store):
    first = objckpt.CheckpointManager(memory_store.url)
    for step, loss in ((1, 0.1), (2, 0.5), (3, 0.7)):
        first.save(step, _state(step), metrics={"loss": loss})
    first.close()
    second = objckpt.CheckpointManager(
        memory_store.url, retention=objckpt.Retention(keep_best=1, best_metric="loss", best_mode="min")
    )
    second.save(4, _state(4), metrics={"loss": 0.9}, wait=True)
    assert second.steps() == [1, 4]  # best (1) and latest (4)


def test_error_of_a_background_save_is_raised_by_the_next_call(memory_store, monkeypatch):
    from objckpt.saving import upload as upload_module

    async def broken_upload(blob, buffer, pool, engine, gate, *rest):
        raise OSError("disk on fire")

    mgr = objckpt.CheckpointManager(memory_store.url)
    monkeypatch.setattr(upload_module, "_upload", broken_upload)
    assert mgr.save(1, _state(1)) is True
    with pytest.raises(OSError, match="disk on fire"):
        mgr.save(2, _state(2))
    monkeypatch.undo()
    mgr.save(3, _state(3), wait=True)
    assert mgr.steps() == [3]  # step 1 never committed


def test_gc_removes_orphans_but_nothing_committed(any_store):
    mgr = objckpt.CheckpointManager(
        any_store.url, storage_options=any_store.storage_options, retention=objckpt.Retention(gc_grace_seconds=3600)
    )
    mgr.save(1, _state(1), wait=True)
    mgr.save(2, _state(2), wait=True)
    # a crashed save: blobs of step 3 without a manifest, and a stray blob in step 1
    step3 = mgr.store.child("step_0000000003")
    runtime.run_sync(step3.put("ab/crashed-p0-000000.blob", b"x" * 100))
    runtime.run_sync(mgr.store.child("step_0000000001").put("cd/loser-p0-000000.blob", b"y" * 10))
    assert mgr.gc() == []  # too young for the default grace period
    deleted = sorted(mgr.gc(grace_seconds=0))
    assert deleted == ["step_0000000001/cd/loser-p0-000000.blob", "step_0000000003/ab/crashed-p0-000000.blob"]
    assert mgr.steps() == [1, 2]
    for step in (1, 2):
        assert mgr.restore(step)["step"] == step


def test_save_async_returns_after_copy_and_caller_may_overwrite(memory_store):
    x = jnp.arange(1 << 20, dtype=jnp.float32)
    host = np.arange(1 << 18, dtype=np.int32)
    handle = objckpt.save_async(memory_store.url, {"x": x, "h": host})
    host[:] = -1  # the caller reuses its buffer at once
    del x
    handle.result()
    assert handle.done() and handle.bytes_written >= (1 << 22) + (1 << 20)
    assert handle.seconds_blocked >= 0
    out = objckpt.restore(memory_store.url)
    np.testing.assert_array_equal(out["h"], np.arange(1 << 18, dtype=np.int32))
    np.testing.assert_array_equal(out["x"], np.arange(1 << 20, dtype=np.float32))


def test_memory_budget_smaller_than_model_streams(memory_store):
    options = objckpt.Options(blob_size=1 << 20, memory_budget=2 << 20)
    tree = {f"w{i}": jnp.full((256, 1024), i, jnp.float32) for i in range(8)}  # 8 MiB, budget 2 MiB
    objckpt.save(memory_store.url, tree, options=options)
    out = objckpt.restore(memory_store.url)
    for i in range(8):
        assert (out[f"w{i}"] == i).all()


def test_rng_keys_and_iterator_state_round_trip(memory_store):
    import jax

    keys = jax.random.split(jax.random.key(42), 4)
    legacy = jax.random.PRNGKey(7)
    state = {"rng": keys, "legacy_rng": legacy, "iterator": {"shard": 3, "offset": 1 << 40, "seed": b"\x01\x02"}}
    mgr = objckpt.CheckpointManager(memory_store.url)
    mgr.save(5, state, wait=True)
    out = mgr.restore(target=state)
    assert out["rng"].dtype == keys.dtype
    np.testing.assert_array_equal(jax.random.key_data(out["rng"]), jax.random.key_data(keys))
    np.testing.assert_array_equal(
        np.asarray(jax.random.normal(out["rng"][1], (3,))), np.asarray(jax.random.normal(keys[1], (3,)))
    )
    np.testing.assert_array_equal(out["legacy_rng"], legacy)
    assert out["iterator"] == state["iterator"]
    plain = mgr.restore()
    assert plain["rng"].dtype == keys.dtype
