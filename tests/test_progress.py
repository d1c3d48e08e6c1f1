"""``progress=``: a callback fed by the transfer counters, and the CLI's tqdm bar for ``True``.

A callback sees ``done_bytes`` grow to ``total_bytes`` on objckpt's I/O thread,
at most every ``INTERVAL`` seconds plus a final call; one that raises is logged
once and never fails the operation; ``True`` draws only on a terminal.
"""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import full_manifest

import objckpt
from objckpt import progress
from objckpt.progress import Progress, Reporter, TerminalBar, human_bytes
from objckpt.transfer import runtime

SMALL_BLOBS = objckpt.Options(blob_size=64 * 1024)


def _tree():
    return {"w": np.arange(256 * 128, dtype=np.float32).reshape(256, 128), "mu": np.arange(20000, dtype=np.int32)}


def _blob_bytes(target) -> int:
    return sum(b.size for b in full_manifest(target.open()).blobs)


class _Recorder:
    """A callback that keeps every call and the thread it came on."""

    def __init__(self) -> None:
        self.calls: list[tuple[Progress, int, str]] = []

    def __call__(self, p: Progress) -> None:
        thread = threading.current_thread()
        self.calls.append((p, thread.ident or 0, thread.name))

    @property
    def figures(self) -> list[Progress]:
        return [p for p, _, _ in self.calls]

    def check(self, operation: str, total: int) -> None:
        """Growing ``done_bytes``, one final call at ``total``, none on the caller's thread."""
        figures = self.figures
        assert len(figures) >= 3, figures  # per request here (INTERVAL 0), and the final call
        assert {p.operation for p in figures} == {operation} and len({p.url for p in figures}) == 1
        assert {p.total_bytes for p in figures} == {total}
        done = [p.done_bytes for p in figures]
        assert done == sorted(done) and done[0] > 0 and done[-1] == total
        assert [p.finished for p in figures] == [False] * (len(figures) - 1) + [True]
        caller = threading.get_ident()
        assert all(ident != caller and name == "objckpt-io" for _, ident, name in self.calls), self.calls


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_callback_follows_save_and_restore(kind, store_target_factory, monkeypatch):
    monkeypatch.setattr(progress, "INTERVAL", 0.0)  # a call per request, so the sequence shows
    target = store_target_factory(kind)
    tree = _tree()
    saved = _Recorder()
    objckpt.save(target.url, tree, storage_options=target.storage_options, options=SMALL_BLOBS, progress=saved)
    saved.check("save", _blob_bytes(target))

    restored = _Recorder()
    back = objckpt.restore(target.url, tree, storage_options=target.storage_options, progress=restored)
    assert all(np.array_equal(back[k], tree[k]) for k in tree)
    restored.check("restore", restored.figures[-1].total_bytes)
    assert restored.figures[-1].total_bytes >= sum(a.nbytes for a in tree.values())


def test_callback_follows_verify_copy_and_save_async(memory_store, local_store, monkeypatch):
    monkeypatch.setattr(progress, "INTERVAL", 0.0)
    tree = _tree()
    saved = _Recorder()
    handle = objckpt.save_async(memory_store.url, tree, options=SMALL_BLOBS, progress=saved)
    handle.result()
    saved.check("save", _blob_bytes(memory_store))  # the final call came before result() returned
    total = _blob_bytes(memory_store)
    for operation, run in [
        ("verify", lambda cb: objckpt.verify(memory_store.url, progress=cb)),
        ("cp", lambda cb: objckpt.copy(memory_store.url, local_store.url, progress=cb)),
    ]:
        recorder = _Recorder()
        run(recorder)
        recorder.check(operation, total)


def test_a_failed_restore_ends_with_a_final_call_short_of_the_total(memory_store):
    objckpt.save(memory_store.url, _tree(), options=SMALL_BLOBS)
    store = memory_store.open()
    manifest = full_manifest(store)
    runtime.run_sync(store.delete(manifest.blobs[-1].key))
    recorder = _Recorder()
    with pytest.raises(objckpt.StoreError, match="no such object"):
        objckpt.restore(memory_store.url, _tree(), progress=recorder)
    figures = recorder.figures
    assert [p.finished for p in figures].count(True) == 1 and figures[-1].finished
    assert figures[-1].done_bytes < figures[-1].total_bytes


def test_failing_callback_is_logged_once_and_the_save_commits(memory_store, monkeypatch, caplog):
    monkeypatch.setattr(progress, "INTERVAL", 0.0)
    calls = []

    def broken(p: Progress) -> None:
        calls.append(p)
        raise RuntimeError("the UI went away")

    tree = _tree()
    with caplog.at_level(logging.WARNING, logger="objckpt"):
        objckpt.save(memory_store.url, tree, options=SMALL_BLOBS, progress=broken)
        back = objckpt.restore(memory_store.url, tree, progress=broken)
    assert all(np.array_equal(back[k], tree[k]) for k in tree)
    assert len(calls) > 4 and calls[-1].finished  # still called after it failed
    failures = [r for r in caplog.records if "progress callback failed" in r.getMessage()]
    assert len(failures) == 2, failures  # once for the save, once for the restore
    assert failures[0].exc_info and "the UI went away" in str(failures[0].exc_info[1])


def test_a_progress_that_is_no_callback_is_refused_before_anything_is_written(memory_store):
    with pytest.raises(TypeError, match="progress must be"):
        objckpt.save(memory_store.url, _tree(), options=SMALL_BLOBS, progress="yes")  # type: ignore[arg-type]
    assert runtime.run_sync(memory_store.open().list()) == []


def test_calls_are_rate_limited():
    calls: list[float] = []
    counter = [0]
    reporter = Reporter("save", "memory://x", 1 << 30, lambda: counter[0], lambda p: calls.append(time.monotonic()))
    ends = time.monotonic() + 0.35
    while time.monotonic() < ends:  # a counter that moves all the time
        counter[0] += 1
        reporter.update()
    reporter.finish(complete=True)
    assert 2 <= len(calls) <= 6, len(calls)  # a call per 0.1 s, and the final one
    gaps = [b - a for a, b in zip(calls[:-2], calls[1:-1], strict=True)]
    assert all(gap >= 0.09 for gap in gaps), gaps


def test_true_draws_nothing_off_a_terminal(memory_store, monkeypatch):
    pipe = io.StringIO()  # not a terminal
    monkeypatch.setattr("sys.stderr", pipe)
    objckpt.save(memory_store.url, _tree(), options=SMALL_BLOBS, progress=True)
    objckpt.save_async(memory_store.url + "/b", _tree(), options=SMALL_BLOBS, progress=True).result()
    objckpt.restore(memory_store.url, _tree(), progress=True)
    objckpt.verify(memory_store.url, progress=True)
    assert pipe.getvalue() == ""
    assert progress.callback_for(True) is None and progress.callback_for(None) is None


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_bar_draws_with_tqdm():
    terminal = _Terminal()
    bar = TerminalBar(terminal)
    for done in (0, 25 * 2**20, 60 * 2**20):
        bar(Progress("cp", "memory://x", done, 100 * 2**20))
    bar(Progress("cp", "memory://x", 100 * 2**20, 100 * 2**20, finished=True))
    text = terminal.getvalue()
    assert text.startswith("\rcp:") and text.endswith("\n") and text.count("\n") == 1
    last = text.rsplit("\r", 1)[-1]
    assert "100%" in last and "100M/100M" in last and "B/s" in last, last
    assert human_bytes(1023) == "1023 B" and human_bytes(1536) == "1.5 KiB" and human_bytes(3 * 2**40) == "3.0 TiB"


def test_tqdm_loads_only_when_a_bar_is_drawn():
    """The library and the command line import progress; only a bar on a terminal brings tqdm."""
    code = (
        "import io, sys; from objckpt import progress;"
        " assert progress.callback_for(True, io.StringIO()) is None;"
        " print('tqdm' in sys.modules, end=' ');"
        " t = io.StringIO(); t.isatty = lambda: True;"
        " progress.callback_for(True, t)(progress.Progress('cp', 'u', 1, 2, finished=True));"
        " print('tqdm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"], out
