"""Issue 77 ("Hardening 5"), items 8-11: incremental saves never commit a step no reader accepts.

Item 8: a manager continued on a copied root (``cp`` of an incremental step keeps the copied
base blobs under their base's save id) references only blobs the new root can name. Item 9:
a piece is referenced only where the base leaf's codec equals this save's, and a compressed
leaf is never hashed (its digests are of stored bytes). Item 10: a save reads its own root and
index objects back as a reader does before the manifest's create-if-absent write. Item 11: a
base that cannot serve (a blob deleted, an index object damaged) is logged, and the save
uploads what it would have referenced. Items 8 and 9 run with the item 10 check off too, so
each test fails before its own fix.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

import objckpt
from objckpt.errors import CheckpointNotFoundError, StoreError
from objckpt.layouts import manifest_io
from objckpt.saving import commit, incremental
from objckpt.transfer import runtime

LEAF = 64 << 10  # bytes per leaf


def _tree(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal(LEAF // 4).astype(np.float32) for i in range(8)}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), b[k]) for k in a)


async def _no_check(*args: Any, **kwargs: Any) -> None:
    """The item 10 check switched off: what a save commits rests on the cause's own fix."""


def _guard(on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not on:
        monkeypatch.setattr(manifest_io, "check_readable", _no_check)


def _manager(target: Any, root: str, **kw: Any) -> objckpt.CheckpointManager:
    return objckpt.CheckpointManager(
        f"{target.url}/{root}",
        storage_options=target.storage_options,
        retention=objckpt.Retention(keep_last=1),
        incremental=True,
        **kw,
    )


@pytest.mark.parametrize("guard", [True, False], ids=["checked", "unchecked"])
def test_a_manager_continued_on_a_copied_root_commits_readable_steps(
    guard: bool, s3_store: Any, gcs_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _guard(guard, monkeypatch)
    tree = _tree()
    with _manager(s3_store, "primary") as mgr:
        mgr.save(1, tree, force=True, wait=True)
        tree["w0"] = tree["w0"] + 1
        mgr.save(2, tree, force=True, wait=True)
        src = mgr.step_url(2)
    # Failover: the replica holds a standalone copy of step 2 (step 1's blobs under step 1's save id).
    dst = f"{gcs_store.url}/replica/step_0000000002"
    objckpt.copy(src, dst, src_storage_options=s3_store.storage_options, dst_storage_options=gcs_store.storage_options)
    with _manager(gcs_store, "replica") as mgr:
        tree["w1"] = tree["w1"] + 1
        mgr.save(3, tree, force=True, wait=True)
        assert mgr.steps() == [3]  # keep_last=1: the copied step is gone, step 3 is all there is
        assert _equal(mgr.restore(3), tree)
        assert objckpt.verify(mgr.step_url(3), storage_options=gcs_store.storage_options).ok
        # What the copy names as its own (w0, in step 2's blob) is still referenced; the rest is uploaded.
        frm = objckpt.inspect(mgr.step_url(3), storage_options=gcs_store.storage_options).bytes_from
        assert frm == {"": 7 * LEAF, "step_0000000002": LEAF}, frm


@pytest.mark.parametrize("guard", [True, False], ids=["checked", "unchecked"])
def test_compression_turned_on_over_a_raw_base_references_nothing(
    guard: bool, s3_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _guard(guard, monkeypatch)
    tree = _tree()
    with _manager(s3_store, "root") as mgr:
        mgr.save(1, tree, force=True, wait=True)
    with _manager(s3_store, "root", options=objckpt.Options(compression="zstd")) as mgr:
        mgr.save(2, tree, force=True, wait=True)  # the same bytes, now to be stored compressed
        assert mgr.steps() == [2]
        assert _equal(mgr.restore(2), tree)
        assert objckpt.verify(mgr.step_url(2), storage_options=s3_store.storage_options).ok
        assert objckpt.inspect(mgr.step_url(2), storage_options=s3_store.storage_options).bytes_from is None


def test_compressed_leaves_are_not_hashed_against_a_compressed_base(
    local_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed: list[int] = []
    real = incremental.sha256_hex
    monkeypatch.setattr(incremental, "sha256_hex", lambda data: hashed.append(len(data)) or real(data))
    tree = {**_tree(), "name": "run-7"}  # a str leaf stays raw, so it may still be referenced
    with _manager(local_store, "root", options=objckpt.Options(compression="zstd")) as mgr:
        mgr.save(1, tree, force=True, wait=True)
        mgr.save(2, tree, force=True, wait=True)
        assert _equal({k: v for k, v in mgr.restore(2).items() if k != "name"}, _tree())
        frm = objckpt.inspect(mgr.step_url(2)).bytes_from
    assert hashed == [len("run-7")], hashed  # the str leaf only: no compressed piece hashed
    assert frm is not None and frm.get("step_0000000001") == len("run-7"), frm


def test_a_save_that_would_not_read_back_commits_nothing(local_store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url = local_store.url
    tree = _tree()
    objckpt.save(f"{url}/a", tree, options=objckpt.Options(digest="sha256"))
    real = commit.Commit._manifest

    def without_bases(self: Any, entries: Any, indexes: Any, bases: Any = ()) -> Any:
        return real(self, entries, indexes, ())  # a root that names no base for the references

    monkeypatch.setattr(commit.Commit, "_manifest", without_bases)
    tree["w2"] = tree["w2"] + 1
    with pytest.raises(StoreError, match=r"not committed: .*would not read back.*leads to no blob"):
        objckpt.save(f"{url}/b", tree, base=f"{url}/a")
    with pytest.raises(CheckpointNotFoundError):
        objckpt.inspect(f"{url}/b")
    assert objckpt.verify(f"{url}/a").ok


def test_a_tree_without_arrays_commits_and_verifies(s3_store: Any) -> None:
    # The read-back check is a reader's: it met a reader that failed on a root with no array leaf.
    url, so = f"{s3_store.url}/state", s3_store.storage_options
    objckpt.save(url, {"loader": objckpt.PerProcess(b'{"seen": 10}'), "step": 3}, storage_options=so)
    assert objckpt.restore(url, storage_options=so) == {"loader": b'{"seen": 10}', "step": 3}
    assert objckpt.verify(url, storage_options=so).ok


def _damage_newest(target: Any, how: str) -> None:
    step = target.open().child("root").child("step_0000000002")
    keys = [o.key for o in runtime.run_sync(step.list()) if o.key.endswith(".blob" if how == "blob" else ".index")]
    assert len(keys) == 1, keys
    if how == "blob":
        runtime.run_sync(step.delete(keys[0]))
    else:
        data = runtime.run_sync(step.get(keys[0]))
        runtime.run_sync(step.put(keys[0], b"\0" * len(data)))


@pytest.mark.parametrize("how", ["blob", "index"])
def test_a_damaged_newest_step_does_not_stop_the_manager(
    how: str, s3_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    tree = _tree()
    with _manager(s3_store, "root") as mgr:
        mgr.save(1, tree, force=True, wait=True)
        tree["w0"] = tree["w0"] + 1
        mgr.save(2, tree, force=True, wait=True)  # its one blob holds w0; w1..w7 lie in step 1's
        _damage_newest(s3_store, how)
        with caplog.at_level(logging.WARNING, logger="objckpt"):
            mgr.save(3, tree, force=True, wait=True)
        assert "step_0000000002" in caplog.text and "cannot serve" in caplog.text, caplog.text
        assert mgr.steps() == [3]
        assert _equal(mgr.restore(3), tree)
        frm = objckpt.inspect(mgr.step_url(3), storage_options=s3_store.storage_options).bytes_from
        # A deleted blob: its piece is uploaded, the rest still referenced; a damaged index: no base.
        assert frm == ({"": LEAF, "step_0000000001": 7 * LEAF} if how == "blob" else None), frm
        tree["w4"] = tree["w4"] * 2
        mgr.save(4, tree, force=True, wait=True)  # and the next save references step 3 again
        assert _equal(mgr.restore(4), tree)
        frm = objckpt.inspect(mgr.step_url(4), storage_options=s3_store.storage_options).bytes_from
        assert frm is not None and frm[""] == LEAF, frm
