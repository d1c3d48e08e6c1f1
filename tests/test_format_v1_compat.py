"""Format version 1 checkpoints (a manifest that lists every piece and blob, no index
objects) still restore, inspect, verify, copy and gc now that saves write version 2.

Each test saves with this objckpt, turns the checkpoint into the version 1 one with
the same blobs (``helpers.rewrite_as_v1``) and runs one tool on it.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_bit_exact, count_reads, full_manifest, rewrite_as_v1
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.core.format import FORMAT_VERSION, MANIFEST_KEY
from objckpt.transfer import runtime

SMALL_BLOBS = objckpt.Options(blob_size=64 * 1024)


def _tree(seed=0):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    w = jax.device_put(
        jnp.arange(256 * 128, dtype=jnp.float32).reshape(256, 128) + seed, NamedSharding(mesh, P("x", "y"))
    )
    return {
        "params": {"w": w, "b": jnp.linspace(0, 1, 1000, dtype=jnp.bfloat16)},
        "opt": {"mu": np.arange(20000, dtype=np.int32) * (seed + 1)},
        "step": 7 + seed,
        "name": "run",
    }


def _keys(store) -> dict[str, int]:
    return {o.key: o.size for o in runtime.run_sync(store.list())}


def _save_as_v1(target, tree, **kwargs):
    """Save ``tree`` at ``target``, rewrite it as version 1; the v1 manifest (every piece and blob)."""
    objckpt.save(target.url, tree, storage_options=target.storage_options, options=SMALL_BLOBS, **kwargs)
    store = target.open()
    v2 = full_manifest(store)
    assert v2.version == FORMAT_VERSION and v2.indexes
    rewrite_as_v1(store)
    doc = json.loads(runtime.run_sync(store.get(MANIFEST_KEY)))
    assert doc["version"] == 1 and "indexes" not in doc and doc["blobs"]
    assert not [k for k in _keys(store) if k.endswith(".index")]
    manifest = full_manifest(store)
    assert manifest.version == 1 and {b.key: b.size for b in manifest.blobs} == {b.key: b.size for b in v2.blobs}
    return manifest


def test_a_v1_checkpoint_restores_whole_partly_and_resharded(any_store, monkeypatch):
    tree = _tree()
    manifest = _save_as_v1(any_store, tree)
    so = any_store.storage_options
    counting = count_reads(monkeypatch)
    out = objckpt.restore(any_store.url, tree, storage_options=so)
    assert_tree_bit_exact(tree, out)
    assert out["params"]["w"].sharding == tree["params"]["w"].sharding
    blobs = {b.key for b in manifest.blobs}
    assert {key for s in counting for key, _, _ in s.reads} <= blobs | {MANIFEST_KEY}  # no index object to read

    part = objckpt.restore(any_store.url, {"opt": {"mu": None}}, storage_options=so, partial=True)
    np.testing.assert_array_equal(part["opt"]["mu"], tree["opt"]["mu"])

    other = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("b", "a"))
    target = {**tree, "params": {**tree["params"], "w": jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=other)}}
    resharded = objckpt.restore(any_store.url, target, storage_options=so)
    assert resharded["params"]["w"].sharding == other
    np.testing.assert_array_equal(np.asarray(resharded["params"]["w"]), np.asarray(tree["params"]["w"]))


def test_a_v1_checkpoint_inspects(memory_store):
    manifest = _save_as_v1(memory_store, _tree(), metadata={"lr": 0.5})
    info = objckpt.inspect(memory_store.url)
    assert info.format_version == 1 and info.metadata == {"lr": 0.5}
    assert info.num_blobs == len(manifest.blobs) == len([k for k in _keys(memory_store.open()) if k.endswith(".blob")])
    assert info.total_bytes == manifest.total_bytes and info.leaves["['params']['w']"].shape == (256, 128)
    assert "format v1" in str(info)


@pytest.mark.parametrize("damage", [None, "checksum", "missing"])
def test_a_v1_checkpoint_verifies(memory_store, damage):
    manifest = _save_as_v1(memory_store, _tree())
    store = memory_store.open()
    blob = max(manifest.blobs, key=lambda b: (b.size, b.key))
    if damage == "checksum":
        data = bytearray(runtime.run_sync(store.get(blob.key)))
        piece = next(p for leaf in manifest.leaves for p in leaf.pieces if p.blob == blob.key)
        data[piece.offset] ^= 0x01
        runtime.run_sync(store.put(blob.key, bytes(data)))
    elif damage == "missing":
        runtime.run_sync(store.delete(blob.key))
    report = objckpt.verify(memory_store.url)
    assert report.blobs == len(manifest.blobs) > 3
    assert report.pieces == sum(len(leaf.pieces) for leaf in manifest.leaves)
    if damage is None:
        assert report.ok and report.bytes_read == sum(b.size for b in manifest.blobs), report
    else:
        assert not report.ok and [(p.kind, p.blob) for p in report.problems] == [(damage, blob.key)], report


def test_a_v1_checkpoint_copies_as_v1(memory_store, local_store):
    tree = _tree()
    manifest = _save_as_v1(memory_store, tree)
    stats = objckpt.copy(memory_store.url, local_store.url)
    assert stats.blobs_copied == len(manifest.blobs) and stats.bytes_read == stats.bytes_copied
    src, dst = memory_store.open(), local_store.open()
    assert runtime.run_sync(dst.get(MANIFEST_KEY)) == runtime.run_sync(src.get(MANIFEST_KEY))  # still v1
    assert set(_keys(dst)) == {b.key for b in manifest.blobs} | {MANIFEST_KEY}  # and no index objects
    assert objckpt.verify(local_store.url).ok
    assert_tree_bit_exact(tree, objckpt.restore(local_store.url, tree))


def test_gc_keeps_a_v1_step_beside_a_v2_one_and_removes_only_orphans(memory_store):
    mgr = objckpt.CheckpointManager(memory_store.url, options=SMALL_BLOBS)
    trees = {1: _tree(1), 2: _tree(2)}
    for step, tree in trees.items():
        mgr.save(step, tree, wait=True)
    one, two = mgr.store.child("step_0000000001"), mgr.store.child("step_0000000002")
    rewrite_as_v1(one)
    kept = {f"step_0000000001/{k}" for k in _keys(one)} | {f"step_0000000002/{k}" for k in _keys(two)}
    assert any(k.endswith(".index") for k in kept)  # step 2's, today's format
    # what a save that died after its uploads leaves beside each step: a blob and an index object
    orphans = {f"step_{s:010d}/{k}" for s in (1, 2) for k in ("ab/deadbeef-p0-000000.blob", "cd/deadbeef-p0.index")}
    for key in orphans:
        runtime.run_sync(mgr.store.put(key, b"x" * 100))
    assert sorted(mgr.gc(grace_seconds=0)) == sorted(orphans)
    assert set(_keys(mgr.store)) == kept and mgr.steps() == [1, 2]
    assert mgr.inspect(1).format_version == 1 and mgr.inspect(2).format_version == FORMAT_VERSION
    for step, tree in trees.items():
        assert_tree_bit_exact(tree, mgr.restore(step, tree))
    assert mgr.gc(grace_seconds=0) == []
