"""gc, rm and retention racing a save: a committed checkpoint never misses a blob.

A slow save (latency on every request, one request at a time) runs in a
thread while ``gc`` with a grace period of 0 runs in a loop beside it: the
save's live-save marker (objckpt/saving/live_markers.py) keeps gc off its step, and the commit
itself refuses to write a manifest that lists a blob no longer there.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import objckpt
from backends.proxy import FaultProxy
from objckpt.cli._main import main as cli_main
from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import IntegrityError, ObjectNotFoundError, SaveInProgressError, StoreError
from objckpt.roots.listing import group_checkpoints
from objckpt.saving.commit import Commit
from objckpt.storage import ObjectInfo
from objckpt.storage.fsspec.store import FsspecStore
from objckpt.transfer import runtime

# One request at a time, and several small blobs, so the save takes a few seconds.
SLOW = objckpt.Options(max_concurrency=1, adaptive_concurrency=False, blob_size=64 << 10)
LATENCY_MS = 250
STEP = "step_0000000001"


def _tree() -> dict[str, Any]:
    return {f"w{i}": np.arange(16384, dtype=np.float32) + i for i in range(6)}  # 6 blobs of 64 KiB


@contextlib.contextmanager
def _slow_save_options(kind: str, request: pytest.FixtureRequest, target: Any) -> Iterator[dict[str, Any]]:
    """Storage options through which every request of the save takes ``LATENCY_MS``."""
    if kind == "local":
        original = FsspecStore._put  # every write, of one buffer or of parts

        async def slow_put(self: FsspecStore, key: str, data: Any, mode: Any) -> None:
            if key.endswith(".blob"):
                await asyncio.sleep(LATENCY_MS / 1000)
            await original(self, key, data, mode)

        mp = pytest.MonkeyPatch()
        mp.setattr(FsspecStore, "_put", slow_put)
        try:
            yield dict(target.storage_options)
        finally:
            mp.undo()
        return
    service = request.getfixturevalue(f"{kind}_service")
    host, port = service.endpoint_url.rsplit("//", 1)[1].split(":")
    with FaultProxy(host, int(port), latency_ms=LATENCY_MS) as proxy:
        options = copy.deepcopy(target.storage_options)
        if kind == "s3":
            options["client_kwargs"]["endpoint_url"] = proxy.endpoint_url
        else:
            options["endpoint_url"] = proxy.endpoint_url
        yield options


@pytest.mark.parametrize(
    "kind", ["local", pytest.param("s3", marks=pytest.mark.s3), pytest.param("gcs", marks=pytest.mark.gcs)]
)
def test_gc_with_no_grace_beside_a_slow_save_never_breaks_its_commit(kind, request, store_target_factory):
    target = store_target_factory(kind)
    sweeper = objckpt.CheckpointManager(target.url, storage_options=target.storage_options)
    store = sweeper.store.child(STEP)
    with _slow_save_options(kind, request, target) as slow:
        saver = objckpt.CheckpointManager(target.url, storage_options=slow, options=SLOW)
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                saver.save(1, _tree(), wait=True)
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        deleted: list[str] = []
        passes = saw_blobs = 0
        while thread.is_alive():
            listed = [o.key for o in runtime.run_sync(store.list())]
            saw_blobs += any(k.endswith(".blob") for k in listed) and MANIFEST_KEY not in listed
            deleted += sweeper.gc(grace_seconds=0)
            passes += 1
            time.sleep(0.05)
        thread.join()
    assert saw_blobs >= 2 and passes >= 3, f"gc never ran beside the save ({passes} passes)"
    assert outcome == [None], f"the save failed: {outcome[0]!r}"
    assert not [k for k in deleted if k.endswith(".blob")], f"gc deleted blobs of a save in flight: {deleted}"
    report = objckpt.verify(f"{target.url}/{STEP}", storage_options=target.storage_options)
    assert report.ok and report.blobs == 6, str(report)
    assert not runtime.run_sync(store.list("_live/")), "the marker outlived the save"
    assert sweeper.gc(grace_seconds=0) == [] and sweeper.steps() == [1]


def _delete_a_blob_before_the_commit(monkeypatch: pytest.MonkeyPatch, *, truncate: bool = False) -> list[str]:
    """Make one blob vanish (or shrink) after every upload finished, right before the commit check.

    Format v2: each process HEADs its own blobs (``Commit._check_own_blobs``) right
    before it writes its index object; the tampering lands just before those HEADs.
    """
    victims: list[str] = []
    original = Commit._check_own_blobs

    async def tampered(self: Commit, blobs: dict[str, int]) -> None:
        key = sorted(blobs)[1]
        victims.append(key)
        if truncate:
            await self.store.put(key, b"short")
        else:
            await self.store.delete(key)
        await original(self, blobs)

    monkeypatch.setattr(Commit, "_check_own_blobs", tampered)
    return victims


def _assert_nothing_committed(keys: list[str]) -> None:
    """No manifest, and no index object either (the check runs before this process writes its index)."""
    assert MANIFEST_KEY not in keys and not [k for k in keys if k.endswith(".index")], keys


def test_commit_refuses_when_a_blob_vanished_after_its_upload(any_store, monkeypatch):
    victims = _delete_a_blob_before_the_commit(monkeypatch)
    with pytest.raises(ObjectNotFoundError) as caught:
        objckpt.save(any_store.url, _tree(), storage_options=any_store.storage_options, options=SLOW)
    assert victims and victims[0] in str(caught.value) and "not committed" in str(caught.value)
    assert "no manifest was written" in str(caught.value)
    store = any_store.open()
    keys = [o.key for o in runtime.run_sync(store.list())]
    _assert_nothing_committed(keys)
    assert not [k for k in keys if k.startswith("_live/")], keys
    with pytest.raises(objckpt.CheckpointNotFoundError):
        objckpt.restore(any_store.url, storage_options=any_store.storage_options)


@pytest.mark.parametrize("kind", ["memory", pytest.param("s3", marks=pytest.mark.s3)])
def test_commit_refuses_when_a_blob_shrank_after_its_upload(kind, store_target_factory, monkeypatch):
    target = store_target_factory(kind)
    victims = _delete_a_blob_before_the_commit(monkeypatch, truncate=True)
    with pytest.raises(IntegrityError) as caught:
        objckpt.save(target.url, _tree(), storage_options=target.storage_options, options=SLOW)
    assert victims and victims[0] in str(caught.value) and "5 bytes" in str(caught.value)
    assert "no manifest was written" in str(caught.value)
    _assert_nothing_committed([o.key for o in runtime.run_sync(target.open().list())])


def _crashed_save(mgr: objckpt.CheckpointManager, step: str = "step_0000000003") -> None:
    """What a save killed mid-way leaves: its marker, then a blob."""
    store = mgr.store.child(step)
    runtime.run_sync(store.put("_live/deadbeef-p0", b"{}"))
    runtime.run_sync(store.put("ab/deadbeef-p0-000000.blob", b"x" * 100))


@pytest.mark.parametrize(
    "kind", ["memory", "local", pytest.param("s3", marks=pytest.mark.s3), pytest.param("gcs", marks=pytest.mark.gcs)]
)
def test_a_live_marker_keeps_gc_off_its_step_whatever_the_grace(kind, store_target_factory):
    target = store_target_factory(kind)
    mgr = objckpt.CheckpointManager(target.url, storage_options=target.storage_options)
    mgr.save(1, {"x": np.arange(10)}, wait=True)
    _crashed_save(mgr)
    assert mgr.gc(grace_seconds=0) == []
    assert len(runtime.run_sync(mgr.store.list("step_0000000003/"))) == 2


@pytest.mark.parametrize(
    "kind", ["memory", "local", pytest.param("s3", marks=pytest.mark.s3), pytest.param("gcs", marks=pytest.mark.gcs)]
)
def test_a_marker_older_than_the_lease_protects_nothing(kind, store_target_factory):
    target = store_target_factory(kind)
    options = objckpt.Options(live_marker_lease=1.0)
    mgr = objckpt.CheckpointManager(target.url, storage_options=target.storage_options, options=options)
    mgr.save(1, {"x": np.arange(10)}, wait=True)
    _crashed_save(mgr)
    time.sleep(2.2)  # past the lease (stores that stamp whole seconds included)
    assert sorted(mgr.gc(grace_seconds=0)) == [
        "step_0000000003/_live/deadbeef-p0",
        "step_0000000003/ab/deadbeef-p0-000000.blob",
    ]
    assert mgr.steps() == [1] and mgr.restore(1)["x"].tolist() == list(range(10))


def test_retention_and_delete_leave_a_step_a_save_is_writing_into(local_store):
    mgr = objckpt.CheckpointManager(local_store.url, retention=objckpt.Retention(keep_last=1))
    mgr.save(1, {"x": np.arange(10)}, wait=True)
    runtime.run_sync(mgr.store.child(STEP).put("_live/0123abcd-p0", b"{}"))  # another writer's save, in flight
    mgr.save(2, {"x": np.arange(10) + 2}, wait=True)
    assert mgr.steps() == [1, 2], "retention deleted a step a save was writing into"
    with pytest.raises(SaveInProgressError, match="_live/0123abcd-p0"):
        mgr.delete(1)
    assert mgr.steps() == [1, 2] and mgr.restore(1)["x"].tolist() == list(range(10))


def test_rm_refuses_a_prefix_a_save_is_writing_to_unless_forced(local_store, capsys):
    objckpt.save(local_store.url, {"x": np.arange(10)})
    store = local_store.open()
    runtime.run_sync(store.put("_live/0123abcd-p0", b"{}"))
    assert cli_main(["rm", local_store.url]) == 1
    err = capsys.readouterr().err
    assert "a save is writing to" in err and "_live/0123abcd-p0" in err and "--force" in err, err
    assert MANIFEST_KEY in {o.key for o in runtime.run_sync(store.list())}
    assert cli_main(["rm", local_store.url, "--force"]) == 0
    assert runtime.run_sync(store.list()) == []


def test_readers_ignore_a_leftover_marker(local_store, memory_store):
    tree = {"x": np.arange(1000, dtype=np.int64)}
    objckpt.save(local_store.url, tree)
    runtime.run_sync(local_store.open().put("_live/4567cdef-p0", b"{}"))
    assert objckpt.verify(local_store.url).ok
    assert objckpt.inspect(local_store.url).num_blobs == 1
    assert objckpt.restore(local_store.url)["x"].tolist() == tree["x"].tolist()
    objckpt.copy(local_store.url, memory_store.url)
    assert not [o.key for o in runtime.run_sync(memory_store.open().list()) if "_live" in o.key]
    listed = [
        ObjectInfo("step_0000000001/manifest.json", 10, 1.0),
        ObjectInfo("step_0000000001/ab/x.blob", 5, 1.0),
        ObjectInfo("step_0000000001/_live/0a1b-p0", 2, 9.0),
        ObjectInfo("step_0000000002/_live/2c3d-p0", 2, 9.0),
    ]
    [entry] = group_checkpoints(listed)
    assert (entry.step, entry.committed, entry.objects, entry.nbytes) == (1, True, 2, 15)


def test_a_save_whose_marker_could_not_be_kept_fresh_does_not_commit(local_store, monkeypatch):
    original = FsspecStore._put  # every write, of one buffer (put) or of parts (put_parts)

    async def put(self: FsspecStore, key: str, data: Any, mode: Any) -> None:
        if "_live/" in key and getattr(self, "_marker_written", False):
            raise StoreError(f"put {key}: refused")  # every rewrite fails
        if "_live/" in key:
            self._marker_written = True  # type: ignore[attr-defined]
        if key.endswith(".blob"):
            await asyncio.sleep(0.4)
        await original(self, key, data, mode)

    monkeypatch.setattr(FsspecStore, "_put", put)
    options = objckpt.Options(max_concurrency=1, blob_size=64 << 10, live_marker_lease=1.0)
    with pytest.raises(StoreError, match="was not rewritten"):
        objckpt.save(local_store.url, _tree(), options=options)
    assert MANIFEST_KEY not in {o.key for o in runtime.run_sync(local_store.open().list())}
