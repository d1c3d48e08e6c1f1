"""Commit semantics and integrity: no manifest → no checkpoint, checksums, no overwrite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_reads, full_manifest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.storage import from_url, register_store
from objckpt.transfer import runtime


def _store(handle):
    return from_url(handle.url, **(handle.storage_options or {}))


def _tree(seed=0):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    w = jax.device_put(
        jnp.arange(256 * 64, dtype=jnp.float32).reshape(256, 64) + seed, NamedSharding(mesh, P("x", "y"))
    )
    return {"params": {"w": w, "b": jnp.full((64,), seed, jnp.bfloat16)}, "step": seed}


def test_blobs_without_manifest_are_not_a_checkpoint(any_store):
    objckpt.save(any_store.url, _tree(), storage_options=any_store.storage_options)
    store = _store(any_store)
    runtime.run_sync(store.delete("manifest.json"))
    assert runtime.run_sync(store.list())  # blobs are still there
    with pytest.raises(objckpt.CheckpointNotFoundError) as info:
        objckpt.restore(any_store.url, storage_options=any_store.storage_options)
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(objckpt.CheckpointNotFoundError):
        objckpt.inspect(any_store.url, storage_options=any_store.storage_options)


def test_nothing_at_url_is_not_found(any_store):
    with pytest.raises(objckpt.CheckpointNotFoundError, match="no committed checkpoint"):
        objckpt.restore(any_store.url, storage_options=any_store.storage_options)


def test_flipped_byte_raises_integrity_error_naming_leaf_and_blob(any_store):
    objckpt.save(any_store.url, _tree(), storage_options=any_store.storage_options)
    store = _store(any_store)
    info = objckpt.inspect(any_store.url, storage_options=any_store.storage_options)
    assert info.num_blobs >= 1
    blobs = [o.key for o in runtime.run_sync(store.list()) if o.key.endswith(".blob")]
    key = sorted(blobs)[0]
    data = bytearray(runtime.run_sync(store.get(key)))
    data[len(data) // 2] ^= 0x01
    runtime.run_sync(store.put(key, bytes(data)))
    with pytest.raises(objckpt.IntegrityError) as err:
        objckpt.restore(any_store.url, storage_options=any_store.storage_options)
    message = str(err.value)
    assert key in message
    assert "['params']['w']" in message or "['params']['b']" in message


def test_truncated_blob_raises_integrity_error(memory_store):
    objckpt.save(memory_store.url, _tree(), storage_options=memory_store.storage_options)
    store = _store(memory_store)
    key = sorted(o.key for o in runtime.run_sync(store.list()) if o.key.endswith(".blob"))[0]
    data = runtime.run_sync(store.get(key))
    runtime.run_sync(store.put(key, data[: len(data) // 3]))
    with pytest.raises(objckpt.IntegrityError, match=key.replace(".", r"\.")):
        objckpt.restore(memory_store.url, storage_options=memory_store.storage_options)


def test_saving_over_a_committed_checkpoint_is_refused(any_store):
    so = any_store.storage_options
    objckpt.save(any_store.url, _tree(1), storage_options=so)
    with pytest.raises(objckpt.CheckpointExistsError) as info:
        objckpt.save(any_store.url, _tree(2), storage_options=so)
    assert isinstance(info.value, FileExistsError)
    restored = objckpt.restore(any_store.url, storage_options=so)
    assert restored["step"] == 1
    np.testing.assert_array_equal(restored["params"]["w"], np.asarray(_tree(1)["params"]["w"]))


def _blind_to_committed(store):
    """``store``, whose HEAD of the manifest always says "not found": a save's early existence
    check (``saving.pipeline.check_destination``) lets it through whatever is committed."""
    head = store.head

    async def blind_head(key):
        if key == "manifest.json":
            raise FileNotFoundError(key)
        return await head(key)

    store.head = blind_head
    return store


def test_racing_saves_commit_exactly_one(any_store):
    """Both get past the early existence check; create-if-absent on the manifest picks one."""
    so = any_store.storage_options
    register_store("racing", lambda url, **options: _blind_to_committed(from_url(any_store.url, **options)))
    first = objckpt.save_async("racing://either", _tree(1), storage_options=so)
    second = objckpt.save_async("racing://either", _tree(2), storage_options=so)
    outcomes = []
    for handle in (first, second):
        try:
            handle.result(timeout=120)
            outcomes.append("committed")
        except objckpt.CheckpointExistsError:
            outcomes.append("exists")
    assert sorted(outcomes) == ["committed", "exists"]
    winner = 1 if outcomes[0] == "committed" else 2
    restored = objckpt.restore(any_store.url, storage_options=so)
    assert restored["step"] == winner
    np.testing.assert_array_equal(restored["params"]["w"], np.asarray(_tree(winner)["params"]["w"]))


def test_partial_restore_reads_none_of_the_skipped_bytes(s3_store, monkeypatch):
    so = s3_store.storage_options
    tree = {
        "params": {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64), "b": jnp.ones(64)},
        "opt_state": {"mu": jnp.full((64, 64), 2.0), "nu": jnp.full((64, 64), 3.0)},
        "step": 7,
    }
    objckpt.save(s3_store.url, tree, storage_options=so)  # small leaves share one blob
    counting = count_reads(monkeypatch)
    out = objckpt.restore(s3_store.url, {"params": {"w": None, "b": None}}, storage_options=so, partial=True)
    np.testing.assert_array_equal(out["params"]["w"], np.asarray(tree["params"]["w"]))
    assert set(out) == {"params"}

    manifest = {leaf.path: leaf for leaf in objckpt.inspect(s3_store.url, storage_options=so).leaves.values()}
    assert manifest  # sanity
    from objckpt.core.format import MANIFEST_KEY

    full = full_manifest(_store(s3_store))
    leaves = {leaf.path: leaf for leaf in full.leaves}
    indexes = {ref.key: ref.size for ref in full.indexes}  # format v2: read once each, they hold the pieces
    skipped = [
        (p.blob, p.offset, p.offset + p.length)
        for path in ("['opt_state']['mu']", "['opt_state']['nu']")
        for p in leaves[path].pieces
    ]
    wanted = sum(p.length for path in ("['params']['w']", "['params']['b']") for p in leaves[path].pieces)
    index_reads = [r for store in counting for r in store.reads if r[0] in indexes]
    assert sorted(index_reads) == sorted((key, 0, size) for key, size in indexes.items())
    reads = [r for store in counting for r in store.reads if r[0] != MANIFEST_KEY and r[0] not in indexes]
    assert sum(end - start for _, start, end in reads) == wanted
    for key, start, end in reads:
        for blob, s_start, s_end in skipped:
            assert key != blob or end <= s_start or start >= s_end, "read bytes of a skipped leaf"


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_large_reads_split_into_sub_ranges_are_exact_and_checked(kind, store_target_factory):
    target = store_target_factory(kind)
    so = target.storage_options
    tree = _tree(3)
    objckpt.save(target.url, tree, storage_options=so)
    chunked = objckpt.Options(read_chunk=4000, read_window=64_000)  # odd sizes: parts cut through pieces
    stats = objckpt.TransferStats()
    out = objckpt.restore(target.url, tree, storage_options=so, options=chunked, stats=stats)
    assert np.asarray(out["params"]["w"]).tobytes() == np.asarray(tree["params"]["w"]).tobytes()
    assert stats.requests > 16  # 64 KiB of w alone needs many sub-range GETs
    store = _store(target)
    key = sorted(o.key for o in runtime.run_sync(store.list()) if o.key.endswith(".blob"))[0]
    data = runtime.run_sync(store.get(key))
    runtime.run_sync(store.put(key, data[: len(data) - 5000]))
    with pytest.raises(objckpt.IntegrityError, match="truncated"):
        objckpt.restore(target.url, storage_options=so, options=chunked)
