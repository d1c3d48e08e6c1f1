"""Replicas and the root's retention, however the copies and the saves interleave (issue 66, item 7).

``CheckpointManager(root, retention=Retention(keep_last=2), replicas=[a, b])``, three saves, then the ``with`` block
ends: by the time ``close()`` returns every replica holds the steps the root keeps and nothing
else, retention applied there too, and a copy abandoned mid-way (its step left the root) has
left no object behind, even one whose write was still in flight when the copy stopped.

The bad interleavings are made to happen every run with a slow replica: a local directory whose
writes or deletes take a while on their worker thread (as a slow disk's do), or an S3 replica
behind a proxy that adds latency.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import objckpt
from backends.proxy import FaultProxy
from objckpt.storage import from_url
from objckpt.storage.fsspec import posix
from objckpt.transfer import runtime


def _state(step: int, n: int = 64 * 1024) -> dict[str, Any]:
    import numpy as np

    return {"w": np.arange(n, dtype=np.float32) * (step + 1), "b": np.full(1000, step, np.int16), "step": step}


def _keys(location: objckpt.Location | str) -> list[str]:
    if isinstance(location, str):
        location = objckpt.Location(location, None)
    store = from_url(location.url, **(location.storage_options or {}))
    return sorted(o.key for o in runtime.run_sync(store.list("")))


def _committed(keys: list[str]) -> list[int]:
    return sorted(int(k.split("/")[0].removeprefix("step_")) for k in keys if k.endswith("/manifest.json"))


def _assert_holds_only(location: objckpt.Location | str, steps: list[int]) -> None:
    """``location`` holds the committed ``steps`` and no object outside them."""
    keys = _keys(location)
    assert _committed(keys) == steps, keys
    stray = [k for k in keys if int(k.split("/")[0].removeprefix("step_")) not in steps]
    assert stray == [], stray


def _until(done: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _slow_disk(
    monkeypatch: pytest.MonkeyPatch,
    under: Path,
    *,
    writes: float = 0.0,
    removes: float = 0.0,
    gate: threading.Event | None = None,
) -> list[str]:
    """Writes and deletes of the local store rooted at ``under`` take this long on their worker
    thread, before they happen (as a slow disk's do); with ``gate``, the first write there waits
    for it (30 s at most) instead. Returns the keys of the writes held at the gate."""
    write, remove = posix.write_inside, posix.remove_inside
    prefix, held, lock = str(under), [], threading.Lock()

    def slow_write(root: str, key: str, data: Any, *, exclusive: bool) -> None:
        if root.startswith(prefix):
            with lock:
                first = gate is not None and not gate.is_set() and not held
                if first:
                    held.append(key)
            if first:
                assert gate is not None
                gate.wait(30)
            else:
                time.sleep(writes)
        write(root, key, data, exclusive=exclusive)

    def slow_remove(root: str, key: str) -> None:
        if root.startswith(prefix):
            time.sleep(removes)
        remove(root, key)

    monkeypatch.setattr(posix, "write_inside", slow_write)
    monkeypatch.setattr(posix, "remove_inside", slow_remove)
    return held


def test_retention_has_reached_every_replica_when_close_returns(tmp_path, monkeypatch):
    """Both replicas hold steps 1 and 2 when step 3 saves; the ``with`` block ends at once. The
    copy of step 3 commits, and retention's deletion of step 1 at the slow replica b takes a
    while: ``close()`` returns after it, not in the middle of it."""
    root, a, b = tmp_path / "root", tmp_path / "a", tmp_path / "b"
    _slow_disk(monkeypatch, b, removes=0.03)
    options = objckpt.Options(blob_size=16 * 1024)
    with objckpt.CheckpointManager(
        str(root), retention=objckpt.Retention(keep_last=2), replicas=[str(a), str(b)], options=options
    ) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step), wait=True)
            _until(lambda step=step: all(step in s.steps for s in mgr.replica_status()))
        mgr.save(3, _state(3), wait=True)
    for where in (root, a, b):
        _assert_holds_only(str(where), [2, 3])
    assert [s.steps for s in mgr.replica_status()] == [[2, 3], [2, 3]]


def test_a_copy_abandoned_with_a_write_in_flight_leaves_nothing_when_close_returns(tmp_path, monkeypatch, caplog):
    """Step 1 is being copied to b when the root's retention deletes it; one of the copy's writes
    there is held on its thread (a slow disk) until what the abandoned copy wrote has been
    deleted, and lands only then: it is deleted too, before ``close()`` returns."""
    root, a, b = tmp_path / "root", tmp_path / "a", tmp_path / "b"
    gate = threading.Event()
    held = _slow_disk(monkeypatch, b, writes=0.3, gate=gate)
    options = objckpt.Options(blob_size=16 * 1024, max_concurrency=4, read_window=64 * 1024)  # 4 blobs at once
    swept = lambda: any("abandoned copy of step 1" in r.getMessage() for r in caplog.records)  # noqa: E731
    try:
        with (
            caplog.at_level("INFO", logger="objckpt"),
            objckpt.CheckpointManager(
                str(root), retention=objckpt.Retention(keep_last=2), replicas=[str(a), str(b)], options=options
            ) as mgr,
        ):
            mgr.save(1, _state(1, n=96 * 1024), wait=True)  # 24 blobs: the copy to b takes seconds
            _until(lambda: bool(held) and any(k.startswith("step_0000000001/") for k in _keys(str(b))))
            mgr.save(2, _state(2), wait=True)
            mgr.save(3, _state(3), wait=True)  # the root deletes step 1: the copy stops
            _until(swept)  # what the copy wrote is deleted...
            gate.set()  # ...and only then does the held write land
    finally:
        gate.set()
    assert len(held) == 1, held  # a blob of step 1's copy, held until the copy stopped
    for where in (root, a, b):
        _assert_holds_only(str(where), [2, 3])
    assert [s.steps for s in mgr.replica_status()] == [[2, 3], [2, 3]]


def test_close_reports_a_replica_whose_retention_fails_and_returns(tmp_path, monkeypatch, caplog):
    """Every delete at replica b fails: ``close(timeout=2)`` returns within seconds all the same,
    and its warning names b, what it lacks and its last error; replica a is as the root."""
    root, a, b = tmp_path / "root", tmp_path / "a", tmp_path / "b"
    remove = posix.remove_inside

    def refused(at: str, key: str) -> None:  # a copy's own live-save marker still goes (else it holds retention off)
        if at.startswith(str(b)) and "/_live/" not in f"/{key}":
            raise PermissionError(13, "Permission denied", f"{at}/{key}")
        remove(at, key)

    monkeypatch.setattr(posix, "remove_inside", refused)
    mgr = objckpt.CheckpointManager(str(root), retention=objckpt.Retention(keep_last=2), replicas=[str(a), str(b)])
    for step in (1, 2, 3):
        mgr.save(step, _state(step), wait=True)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="objckpt"):
        mgr.close(timeout=2)
    assert time.monotonic() - started < 10
    said = [r.getMessage() for r in caplog.records if "stopped replicating" in r.getMessage()]
    assert len(said) == 1 and str(b) in said[0] and "retention not applied" in said[0], said
    assert "last error" in said[0] and "StorePermissionError" in said[0], said
    assert str(a) not in said[0].replace(str(b), ""), said
    _assert_holds_only(str(a), [2, 3])
    assert _committed(_keys(str(b))) == [1, 2, 3]


def _port(endpoint_url: str) -> int:
    return int(endpoint_url.rsplit(":", 1)[1].rstrip("/"))


@pytest.mark.parametrize("run", range(3))
def test_three_saves_then_close_leave_every_replica_as_the_root(run, s3_service, gcs_service):
    """Against the S3 and GCS servers, replica b behind 40 ms of latency, no waiting between the
    saves: whatever the interleaving, each replica holds steps 2 and 3 and nothing else."""
    so = s3_service.storage_options()
    name = f"rr-{uuid.uuid4().hex[:10]}"
    with FaultProxy("127.0.0.1", _port(s3_service.endpoint_url), latency_ms=40) as proxy:
        far = {**so, "client_kwargs": {**so["client_kwargs"], "endpoint_url": proxy.endpoint_url}}
        a = objckpt.Location(gcs_service.url(f"a-{name}"), gcs_service.storage_options())
        b = objckpt.Location(s3_service.url(f"b-{name}"), far)
        options = objckpt.Options(blob_size=32 * 1024, max_concurrency=4)
        root = s3_service.url(f"root-{name}")
        with objckpt.CheckpointManager(
            root, storage_options=so, retention=objckpt.Retention(keep_last=2), replicas=[a, b], options=options
        ) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, _state(step, n=128 * 1024))
        _assert_holds_only(objckpt.Location(root, so), [2, 3])
        _assert_holds_only(a, [2, 3])
        _assert_holds_only(objckpt.Location(b.url, so), [2, 3])
    assert [s.steps for s in mgr.replica_status()] == [[2, 3], [2, 3]]
