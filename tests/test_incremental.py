"""Incremental checkpoints: ``save(url, tree, base=...)`` and ``CheckpointManager(root, incremental=True)``.

Byte targets are counted in the transfer engine's figures (``bytes_written``) on the local S3
and GCS servers; deleters (retention, ``rm``, ``gc``) must keep every object a kept step
references; readers refuse references that lead anywhere but a blob of the base the root names.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import objckpt
from objckpt.core.format.bases import check_ref_key
from objckpt.errors import FormatError, SaveInProgressError
from objckpt.roots.sweep import delete_checkpoint
from objckpt.saving import incremental
from objckpt.transfer import runtime

LEAF = 64 << 10  # bytes per leaf
DIGEST = objckpt.Options(digest="sha256")


def _tree(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal(LEAF // 4).astype(np.float32) for i in range(8)}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), b[k]) for k in a)


def _root(target: Any) -> dict[str, Any]:
    return {"storage_options": target.storage_options}


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_one_leaf_of_eight_changed_uploads_that_leaf(kind: str, request: pytest.FixtureRequest) -> None:
    target = request.getfixturevalue(f"{kind}_store")
    so = target.storage_options
    tree = _tree()
    full = objckpt.save(f"{target.url}/step_1", tree, storage_options=so, options=DIGEST)
    assert full.bytes_written >= 8 * LEAF
    tree["w3"] = tree["w3"] + 1
    stats = objckpt.save(f"{target.url}/step_2", tree, storage_options=so, base=f"{target.url}/step_1")
    # The changed leaf's bytes, its blob's 64-byte lead, the index object and the manifest.
    assert LEAF <= stats.bytes_written <= 1.3 * LEAF + 8192, stats.bytes_written
    assert _equal(objckpt.restore(f"{target.url}/step_2", storage_options=so), tree)
    report = objckpt.verify(f"{target.url}/step_2", storage_options=so)
    assert report.ok, report.problems
    assert report.bytes_read >= 8 * LEAF  # the referenced bytes are read and checked too
    # A chain: step 3 references step 1's blobs directly (never through step 2's references).
    tree["w5"] = tree["w5"] * 2
    third = objckpt.save(f"{target.url}/step_3", tree, storage_options=so, base=f"{target.url}/step_2")
    assert third.bytes_written <= 1.3 * LEAF + 8192
    root = json.loads(runtime.run_sync(target.open().child("step_3").get("manifest.json")))
    assert sorted(b["name"] for b in root["bases"]) == ["step_1", "step_2"]
    assert _equal(objckpt.restore(f"{target.url}/step_3", storage_options=so), tree)


def test_base_without_digests_uploads_everything(local_store: Any) -> None:
    tree = _tree()
    objckpt.save(f"{local_store.url}/a", tree)
    stats = objckpt.save(f"{local_store.url}/b", tree, base=f"{local_store.url}/a")
    assert stats.bytes_written >= 8 * LEAF
    assert _equal(objckpt.restore(f"{local_store.url}/b"), tree)


def test_base_must_be_a_sibling(local_store: Any) -> None:
    objckpt.save(f"{local_store.url}/x/a", _tree(), options=DIGEST)
    with pytest.raises(ValueError, match="beside"):
        objckpt.save(f"{local_store.url}/y/b", _tree(), base=f"{local_store.url}/x/a")


def test_manager_retention_and_gc_keep_what_kept_steps_reference(s3_store: Any) -> None:
    so = s3_store.storage_options
    tree = _tree()
    with objckpt.CheckpointManager(
        s3_store.url, retention=objckpt.Retention(keep_last=1), storage_options=so, incremental=True
    ) as mgr:
        for step in (1, 2, 3):
            if step > 1:
                tree[f"w{step}"] = tree[f"w{step}"] - step
            mgr.save(step, tree, force=True, wait=True)
            mgr.gc(grace_seconds=0)
            assert mgr.steps() == [step]
            got = mgr.restore(step)
            assert _equal(got, tree)
            assert objckpt.verify(mgr.step_url(step), storage_options=so).ok
    keys = [o.key for o in runtime.run_sync(s3_store.open().list())]
    # Step 1's index object and manifest went; its blobs, which step 3 still references, stayed.
    assert any(k.startswith("step_0000000001/") and k.endswith(".blob") for k in keys)
    assert not any(k.startswith("step_0000000001/") and k.endswith(".index") for k in keys)
    assert not any(k.startswith("step_0000000002/") and k.endswith(".index") for k in keys)


def test_rm_of_the_base_keeps_referenced_blobs_until_gc_finds_none(s3_store: Any) -> None:
    so, url = s3_store.storage_options, s3_store.url
    one, two = "step_0000000001", "step_0000000002"
    tree = _tree()
    objckpt.save(f"{url}/{one}", tree, storage_options=so, options=DIGEST)
    tree["w0"] = tree["w0"] + 1
    objckpt.save(f"{url}/{two}", tree, storage_options=so, base=f"{url}/{one}")
    root = s3_store.open()
    runtime.run_sync(delete_checkpoint(root.child(one)))
    left = [o.key for o in runtime.run_sync(root.list(f"{one}/"))]
    assert left and all(k.endswith(".blob") for k in left)
    mgr = objckpt.CheckpointManager(url, storage_options=so)
    mgr.gc(grace_seconds=0)
    assert sorted(o.key for o in runtime.run_sync(root.list(f"{one}/"))) == sorted(left)
    assert _equal(objckpt.restore(f"{url}/{two}", storage_options=so), tree)
    assert objckpt.verify(f"{url}/{two}", storage_options=so).ok
    # Once no committed step references them, gc collects them.
    runtime.run_sync(delete_checkpoint(root.child(two)))
    mgr.gc(grace_seconds=0)
    mgr.close()
    assert not runtime.run_sync(root.list(f"{one}/"))


def test_a_save_in_flight_keeps_deleters_off_its_base(local_store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url = local_store.url
    tree = _tree()
    objckpt.save(f"{url}/step_0000000001", tree, options=DIGEST)
    real = incremental.read_base
    seen: list[BaseException] = []

    async def racing(store: Any, name: str, *, size_limit: int) -> Any:
        try:  # rm (or retention) of the base while the save has it open
            await delete_checkpoint(incremental.base_store(store, name))
        except SaveInProgressError as e:
            seen.append(e)
        return await real(store, name, size_limit=size_limit)

    monkeypatch.setattr(incremental, "read_base", racing)
    tree["w1"] = tree["w1"] + 1
    objckpt.save(f"{url}/step_0000000002", tree, base=f"{url}/step_0000000001")
    assert seen, "the base was deleted under a save that references it"
    assert _equal(objckpt.restore(f"{url}/step_0000000002"), tree)


def test_hostile_references_are_refused(local_store: Any) -> None:
    bases = {"step_1": "abc"}
    assert check_ref_key("../step_1/0a/abc-p0-000000.blob", bases)
    for bad in (
        "../step_1/0a/abd-p0-000000.blob",  # a blob of another save
        "../step_2/0a/abc-p0-000000.blob",  # a base the root does not name
        "../step_1/../../etc/abc-p0-000000.blob",
        "../../step_1/0a/abc-p0-000000.blob",
        "../step_1/0a/abc-p0-000000.index",
        "../step_1/manifest.json",
    ):
        assert not check_ref_key(bad, bases), bad
    url = local_store.url
    tree = _tree()
    objckpt.save(f"{url}/a", tree, options=DIGEST)
    tree["w2"] = tree["w2"] + 1
    objckpt.save(f"{url}/b", tree, base=f"{url}/a")
    path = f"{local_store.url.removeprefix('file://')}/b/manifest.json"
    root = json.loads(open(path).read())
    # The root names another save for the base: its references now lead to no blob of that save.
    root["bases"][0]["save_id"] = "0" * 32
    open(path, "w").write(json.dumps(root))
    with pytest.raises(FormatError, match="leads to no blob"):
        objckpt.restore(f"{url}/b")
    root["bases"][0]["name"] = ".."
    open(path, "w").write(json.dumps(root))
    with pytest.raises(FormatError, match="bases"):
        objckpt.restore(f"{url}/b")


def test_copy_stands_alone(s3_store: Any, gcs_store: Any) -> None:
    so, url = s3_store.storage_options, s3_store.url
    tree = _tree()
    objckpt.save(f"{url}/step_1", tree, storage_options=so, options=DIGEST)
    tree["w6"] = tree["w6"] + 1
    objckpt.save(f"{url}/step_2", tree, storage_options=so, base=f"{url}/step_1")
    dst = f"{gcs_store.url}/copied"
    objckpt.copy(f"{url}/step_2", dst, src_storage_options=so, dst_storage_options=gcs_store.storage_options)
    runtime.run_sync(delete_checkpoint(s3_store.open().child("step_2")))
    runtime.run_sync(delete_checkpoint(s3_store.open().child("step_1")))
    assert not runtime.run_sync(s3_store.open().list())  # the source is gone, bases and all
    got = objckpt.restore(dst, storage_options=gcs_store.storage_options)
    assert _equal(got, tree)
    report = objckpt.verify(dst, storage_options=gcs_store.storage_options, options=DIGEST)
    assert report.ok and report.bytes_read >= 8 * LEAF
    root = json.loads(runtime.run_sync(gcs_store.open().child("copied").get("manifest.json")))
    assert "bases" not in root


def test_inspect_says_which_bytes_come_from_which_step(local_store: Any) -> None:
    url = local_store.url
    tree = _tree()
    objckpt.save(f"{url}/step_1", tree, options=DIGEST)
    assert objckpt.inspect(f"{url}/step_1").bytes_from is None
    tree["w0"] = tree["w0"] + 1
    objckpt.save(f"{url}/step_2", tree, base=f"{url}/step_1")
    tree["w1"] = tree["w1"] + 1
    objckpt.save(f"{url}/step_3", tree, base=f"{url}/step_2")
    info = objckpt.inspect(f"{url}/step_3")
    assert info.bytes_from == {"": LEAF, "step_2": LEAF, "step_1": 6 * LEAF}
    assert "from step_1" in str(info)


def test_a_failed_incremental_save_leaves_only_what_gc_collects(s3_store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from objckpt.saving.commit import Commit

    so, url = s3_store.storage_options, s3_store.url
    one, two = "step_0000000001", "step_0000000002"
    tree = _tree()
    objckpt.save(f"{url}/{one}", tree, storage_options=so, options=DIGEST)
    before = sorted(o.key for o in runtime.run_sync(s3_store.open().list()))

    async def dies(self: Any, *args: Any) -> Any:
        raise OSError("killed before its index object")

    monkeypatch.setattr(Commit, "_write_index", dies)
    changed = {**tree, "w4": tree["w4"] + 1}
    with pytest.raises(OSError, match="killed"):
        objckpt.save(f"{url}/{two}", changed, storage_options=so, base=f"{url}/{one}")
    monkeypatch.undo()
    assert any(o.key.startswith(f"{two}/") for o in runtime.run_sync(s3_store.open().list()))
    with objckpt.CheckpointManager(url, storage_options=so) as mgr:
        mgr.gc(grace_seconds=0)
    assert sorted(o.key for o in runtime.run_sync(s3_store.open().list())) == before
    assert _equal(objckpt.restore(f"{url}/{one}", storage_options=so), tree)
