"""``Options.save_threads`` bounds a save's CPU work: checksums and writes into a local file system.

On a TPU host a second save thread was what slowed the training step beside an async save's
upload (docs/PERFORMANCE.md, "The accelerator path"), so an async save runs that work on one
thread by default and a synchronous save on a quarter of the cores (at least two). These tests
count the writes and checksums that run at once in a real ``file://`` save.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from helpers import assert_tree_bit_exact

import objckpt
from objckpt.saving import upload as upload_module
from objckpt.storage.fsspec import posix
from objckpt.transfer.cpu_slots import default_save_threads, save_threads_for

MiB = 1 << 20


class _AtOnce:
    """Counts how many wrapped calls run at once (each made to last a little, so they overlap)."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self.calls = 0
        self._lock = threading.Lock()

    def wrap(self, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.now += 1
                self.calls += 1
                self.most = max(self.most, self.now)
            try:
                time.sleep(0.03)
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.now -= 1

        return counted


@pytest.fixture
def at_once(monkeypatch: pytest.MonkeyPatch) -> _AtOnce:
    counter = _AtOnce()
    monkeypatch.setattr(posix, "write_inside", counter.wrap(posix.write_inside))
    monkeypatch.setattr(upload_module, "_checksums", counter.wrap(upload_module._checksums))
    return counter


def _tree() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {f"w{i}": rng.standard_normal(MiB // 4).astype(np.float32) for i in range(12)}  # 12 blobs of 1 MiB


def _save(url: str, tree: Any, *, asynchronous: bool, threads: int | None) -> None:
    options = objckpt.Options(blob_size=MiB, save_threads=threads)
    if asynchronous:
        objckpt.save_async(url, tree, options=options).result(120)
    else:
        objckpt.save(url, tree, options=options)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_one_save_thread_runs_one_write_or_checksum_at_a_time(tmp_path, at_once, asynchronous):
    tree = _tree()
    url = (tmp_path / "ckpt").as_uri()
    _save(url, tree, asynchronous=asynchronous, threads=1)
    assert at_once.calls >= 24  # 12 blobs: a checksum and a write each
    assert at_once.most == 1
    assert_tree_bit_exact(tree, objckpt.restore(url, tree))


def test_more_save_threads_overlap_that_work(tmp_path, at_once):
    tree = _tree()
    url = (tmp_path / "ckpt").as_uri()
    _save(url, tree, asynchronous=False, threads=3)
    assert 2 <= at_once.most <= 3
    assert_tree_bit_exact(tree, objckpt.restore(url, tree))


def test_an_async_save_defaults_to_one_thread_and_a_synchronous_save_to_more(tmp_path, at_once):
    assert save_threads_for(hold_uploads=True) == 1
    assert save_threads_for(hold_uploads=False) == default_save_threads() >= 2
    tree = _tree()
    _save((tmp_path / "async").as_uri(), tree, asynchronous=True, threads=None)
    assert at_once.most == 1
    at_once.most = 0
    _save((tmp_path / "sync").as_uri(), tree, asynchronous=False, threads=None)
    assert at_once.most >= 2


def test_save_threads_must_be_positive():
    with pytest.raises(ValueError, match="save_threads"):
        objckpt.Options(save_threads=0)
