"""Live-save markers under hostile or unlucky conditions (issue 51, items 15-17).

A marker dated far in the future, a stray object under ``_live/``, and the marker a
save killed right after its commit leaves behind: the first two must protect nothing,
the last must be named for what it is. On S3 (the store sets the timestamps) and on
``file://`` (where ``os.utime`` can date a marker anywhere).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import objckpt
from objckpt.cli._main import main as cli_main
from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import SaveInProgressError
from objckpt.roots.sweep import delete_checkpoint, unreferenced_objects
from objckpt.saving import live_markers
from objckpt.saving.live_markers import REFRESHES_PER_LEASE, LiveMarker
from objckpt.storage import from_url
from objckpt.transfer import runtime

STEP = "step_0000000001"
LEASE = objckpt.Options().live_marker_lease
YEAR_2036 = 2_082_758_400.0  # 2036-01-01, what `touch -d 2036` stamps
FOREIGN = "_live/0123abcd-p0"  # a marker of some other save


def _file_url(target: Any) -> str:
    return f"file://{target.url}"


def _date(url: str, key: str, when: float) -> None:
    path = Path(url.removeprefix("file://")) / key
    os.utime(path, (when, when))


class _ClockAhead:
    """A store whose listings date every object ``ahead`` seconds in the future (a store
    whose clock runs ahead; S3 sets ``last_modified`` itself, so a test cannot)."""

    def __init__(self, store: Any, ahead: float) -> None:
        self._store = store
        self._ahead = ahead

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def child(self, prefix: str) -> _ClockAhead:
        return _ClockAhead(self._store.child(prefix), self._ahead)

    async def list(self, prefix: str = "") -> list:
        found = await self._store.list(prefix)
        return [dataclasses.replace(o, last_modified=(o.last_modified or time.time()) + self._ahead) for o in found]


@pytest.fixture
def s3_env(request: pytest.FixtureRequest) -> Any:
    """``s3_env(monkeypatch)`` points the CLI's environment at the local S3 server."""

    def apply(monkeypatch: pytest.MonkeyPatch) -> None:
        s3_service = request.getfixturevalue("s3_service")
        for name in [k for k in os.environ if k.startswith("AWS_")]:
            monkeypatch.delenv(name)
        for name, value in s3_service.env().items():
            monkeypatch.setenv(name, value)

    return apply


# ---------------------------------------------------------------- 15: markers dated in the future


def test_a_marker_dated_years_ahead_keeps_neither_retention_nor_rm_nor_gc_off(local_store, tmp_path):
    url = _file_url(local_store)
    mgr = objckpt.CheckpointManager(url, retention=objckpt.Retention(keep_last=1))
    mgr.save(1, {"x": np.arange(10)}, wait=True)
    store = mgr.store.child(STEP)
    runtime.run_sync(store.put(FOREIGN, b"{}"))
    _date(url, f"{STEP}/{FOREIGN}", YEAR_2036)
    mgr.save(2, {"x": np.arange(10) + 2}, wait=True)
    assert mgr.steps() == [2], "a marker dated 2036 kept retention off step 1"

    single = f"file://{tmp_path}/single"
    objckpt.save(single, {"x": np.arange(10)})
    runtime.run_sync(from_url(single).put(FOREIGN, b"{}"))
    _date(single, FOREIGN, YEAR_2036)
    assert cli_main(["rm", single]) == 0, "a marker dated 2036 made rm refuse"
    assert runtime.run_sync(from_url(single).list()) == []

    orphan = mgr.store.child("step_0000000003")
    runtime.run_sync(orphan.put(FOREIGN, b"{}"))
    runtime.run_sync(orphan.put("ab/0123abcd-p0-000000.blob", b"x" * 100))
    _date(url, f"step_0000000003/{FOREIGN}", YEAR_2036)
    assert sorted(mgr.gc(grace_seconds=0)) == [
        f"step_0000000003/{FOREIGN}",
        "step_0000000003/ab/0123abcd-p0-000000.blob",
    ]


def test_a_marker_ahead_by_less_than_one_refresh_interval_still_protects(local_store, capsys):
    url = _file_url(local_store)
    objckpt.save(url, {"x": np.arange(10)})
    runtime.run_sync(from_url(url).put(FOREIGN, b"{}"))
    ahead = LEASE / REFRESHES_PER_LEASE / 2  # clock skew the lease allows
    _date(url, FOREIGN, time.time() + ahead)
    assert cli_main(["rm", url]) == 1
    err = capsys.readouterr().err
    assert FOREIGN in err and "ahead of this clock" in err and "written 0 s ago" not in err, err
    _date(url, FOREIGN, time.time() + 2 * LEASE / REFRESHES_PER_LEASE)
    assert cli_main(["rm", url]) == 0


@pytest.mark.s3
def test_on_s3_a_store_clock_far_ahead_makes_markers_expired_not_eternal(s3_store):
    objckpt.save(s3_store.url, {"x": np.arange(10)}, storage_options=s3_store.storage_options)
    raw = s3_store.open()
    runtime.run_sync(raw.put(FOREIGN, b"{}"))
    assert runtime.run_sync(live_markers.live_markers(raw, lease=LEASE)), "a fresh marker must protect"
    ahead = _ClockAhead(raw, 10 * 365 * 86400.0)
    assert runtime.run_sync(live_markers.live_markers(ahead, lease=LEASE)) == []
    runtime.run_sync(delete_checkpoint(ahead, lease=LEASE))
    assert runtime.run_sync(raw.list()) == []


@pytest.mark.s3
def test_on_s3_gc_collects_a_step_whose_marker_is_dated_far_ahead(s3_store):
    mgr = objckpt.CheckpointManager(s3_store.url, storage_options=s3_store.storage_options)
    mgr.save(1, {"x": np.arange(10)}, wait=True)
    step = mgr.store.child("step_0000000003")
    runtime.run_sync(step.put(FOREIGN, b"{}"))
    runtime.run_sync(step.put("ab/0123abcd-p0-000000.blob", b"x" * 100))
    found = runtime.run_sync(unreferenced_objects(mgr.store, grace=0, manifest_size_limit=1 << 20, lease=LEASE))
    assert found == [], "a fresh marker protects its step"
    found = runtime.run_sync(
        unreferenced_objects(
            _ClockAhead(mgr.store, 10 * 365 * 86400.0), grace=0, manifest_size_limit=1 << 20, lease=LEASE
        )
    )
    assert sorted(o.key for o in found) == [
        f"step_0000000003/{FOREIGN}",
        "step_0000000003/ab/0123abcd-p0-000000.blob",
    ]


# ---------------------------------------------------------------- 16: only marker names count

STRAYS = ["_live/README.txt", "_live/notes/0123abcd-p0", "_live/0123abcd-p0.bak", "_live/0123ABCD-p0"]


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_objects_under_live_that_are_not_markers_protect_nothing(kind, store_target_factory, monkeypatch, s3_env):
    target = store_target_factory(kind)
    if kind == "s3":
        s3_env(monkeypatch)
    url = target.url
    objckpt.save(url, {"x": np.arange(10)}, storage_options=target.storage_options)
    store = target.open()
    for key in STRAYS:
        runtime.run_sync(store.put(key, b"not a marker"))
    assert runtime.run_sync(live_markers.live_markers(store, lease=LEASE)) == []
    assert cli_main(["rm", url]) == 0, "a stray object under _live/ made rm refuse"
    assert runtime.run_sync(store.list()) == []


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_retention_and_gc_ignore_objects_under_live_that_are_not_markers(kind, store_target_factory):
    target = store_target_factory(kind)
    mgr = objckpt.CheckpointManager(
        target.url, storage_options=target.storage_options, retention=objckpt.Retention(keep_last=1)
    )
    mgr.save(1, {"x": np.arange(10)}, wait=True)
    runtime.run_sync(mgr.store.child(STEP).put("_live/README.txt", b"hello"))
    mgr.save(2, {"x": np.arange(10) + 2}, wait=True)
    assert mgr.steps() == [2], "retention left a step holding only _live/README.txt"
    stray = mgr.store.child("step_0000000003")
    runtime.run_sync(stray.put("_live/README.txt", b"hello"))
    runtime.run_sync(stray.put("ab/0123abcd-p0-000000.blob", b"x" * 100))
    assert sorted(mgr.gc(grace_seconds=0)) == [
        "step_0000000003/_live/README.txt",
        "step_0000000003/ab/0123abcd-p0-000000.blob",
    ]


# ---------------------------------------------------------------- 17: a killed save's own marker

_KILLED_AFTER_COMMIT = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np
    import objckpt
    from objckpt.saving.live_markers import LiveMarker

    async def killed(self):  # SIGKILL where the save deletes its marker: just after its commit
        os.kill(os.getpid(), signal.SIGKILL)

    LiveMarker.end = killed
    mgr = objckpt.CheckpointManager(sys.argv[1], storage_options=json.loads(sys.argv[2]))
    mgr.save(1, {"x": np.arange(10)}, wait=True)
    print("not killed", flush=True)
    """
)


def _save_killed_after_commit(url: str, storage_options: dict) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_AFTER_COMMIT, url, json.dumps(storage_options)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -9 and "not killed" not in out, (proc.returncode, out, err[-2000:])


def _retention_warning(caplog: pytest.LogCaptureFixture) -> str:
    [line] = [r.getMessage() for r in caplog.records if "retention left step" in r.getMessage()]
    return line


@pytest.mark.s3
def test_a_save_killed_after_its_commit_is_named_as_such_by_retention_delete_and_rm(
    s3_store, caplog, capsys, monkeypatch, s3_env
):
    _save_killed_after_commit(s3_store.url, s3_store.storage_options)
    mgr = objckpt.CheckpointManager(
        s3_store.url, storage_options=s3_store.storage_options, retention=objckpt.Retention(keep_last=1)
    )
    assert mgr.steps() == [1]
    step = mgr.store.child(STEP)
    [marker] = [o.key for o in runtime.run_sync(step.list("_live/"))]
    save_id = json.loads(runtime.run_sync(step.get(MANIFEST_KEY)))["save_id"]
    assert marker == f"_live/{save_id}-p0"  # the killed save's own marker, left behind

    with caplog.at_level(logging.WARNING, logger="objckpt"):
        mgr.save(2, {"x": np.arange(10) + 2}, wait=True)
    assert mgr.steps() == [1, 2]  # still protected for the lease: that save may be retrying its commit
    warning = _retention_warning(caplog)
    assert "another writer" not in warning and "a save is writing" not in warning, warning
    assert f"the save that committed {mgr.store.url}/{STEP} (save_id {save_id})" in warning, warning
    assert "interrupted after its commit" in warning and marker in warning, warning
    assert "s ago" in warning and f"lease ({LEASE:g} s)" in warning, warning

    with pytest.raises(SaveInProgressError, match="interrupted after its commit") as caught:
        mgr.delete(1)
    assert "a save is writing" not in str(caught.value)

    s3_env(monkeypatch)
    assert cli_main(["rm", f"{s3_store.url}/{STEP}"]) == 1
    err = capsys.readouterr().err
    assert "interrupted after its commit" in err and marker in err and "a save is writing" not in err, err


def test_a_marker_left_by_its_committed_save_long_ago_says_it_was_not_rewritten(local_store, caplog, monkeypatch):
    url = _file_url(local_store)

    async def end_without_delete(self: LiveMarker) -> None:  # what a SIGKILL after the commit leaves
        if self._stop is not None and self._task is not None:
            self._stop.set()
            await asyncio.gather(self._task, return_exceptions=True)

    mgr = objckpt.CheckpointManager(url, retention=objckpt.Retention(keep_last=1))
    with monkeypatch.context() as patch:
        patch.setattr(LiveMarker, "end", end_without_delete)
        mgr.save(1, {"x": np.arange(10)}, wait=True)
    [marker] = [o.key for o in runtime.run_sync(mgr.store.child(STEP).list("_live/"))]
    _date(url, f"{STEP}/{marker}", time.time() - 200)  # more than two refresh intervals, less than the lease

    with caplog.at_level(logging.WARNING, logger="objckpt"):
        mgr.save(2, {"x": np.arange(10) + 2}, wait=True)
    assert mgr.steps() == [1, 2]
    warning = _retention_warning(caplog)
    assert "another writer" not in warning and "a save is writing" not in warning, warning
    assert f"was interrupted after its commit and left its live-save marker {marker}" in warning, warning
    assert "(200 s old, not rewritten since)" in warning, warning

    _date(url, f"{STEP}/{marker}", time.time() - LEASE - 1)  # past the lease: it protects nothing
    mgr.save(3, {"x": np.arange(10) + 3}, wait=True)
    assert mgr.steps() == [3]
