"""Reading ``manifest.json``: one GET for a usual manifest; a long one is sized before it is read."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import objckpt
from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import CheckpointNotFoundError, FormatError
from objckpt.layouts import manifest_io
from objckpt.layouts.manifest_io import read_manifest
from objckpt.transfer import runtime


class _Counting:
    """A store that records the requests made through it."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.url = store.url
        self.calls: list[tuple[Any, ...]] = []

    async def head(self, key: str) -> Any:
        self.calls.append(("head", key))
        return await self._store.head(key)

    async def get_range(self, key: str, *, start: int, end: int) -> bytes:
        data = await self._store.get_range(key, start=start, end=end)
        self.calls.append(("get", key, start, end, len(data)))
        return data


def _saved(target: Any) -> tuple[_Counting, int]:
    """A checkpoint with a few hundred leaves (a manifest of some KiB), and its manifest's size."""
    tree = {f"layer{i}": {"w": np.full((4, 3), i, np.float32), "b": np.arange(i, dtype=np.int32)} for i in range(60)}
    objckpt.save(target.url, tree, storage_options=target.storage_options)
    store = target.open()
    size = runtime.run_sync(store.head(MANIFEST_KEY)).size
    return _Counting(store), size


def test_a_usual_manifest_takes_one_get(any_store):
    store, size = _saved(any_store)
    manifest = runtime.run_sync(read_manifest(store, size_limit=1 << 30))
    assert store.calls == [("get", MANIFEST_KEY, 0, manifest_io.FIRST_READ, size)]
    assert len(manifest.leaves) == 120
    assert objckpt.restore(any_store.url, storage_options=any_store.storage_options)["layer7"]["b"].tolist() == list(
        range(7)
    )


def test_a_manifest_longer_than_the_first_read_is_sized_then_read_whole(any_store, monkeypatch):
    store, size = _saved(any_store)
    whole = runtime.run_sync(read_manifest(store, size_limit=1 << 30))
    monkeypatch.setattr(manifest_io, "FIRST_READ", 100)
    store.calls.clear()
    assert runtime.run_sync(read_manifest(store, size_limit=1 << 30)) == whole
    assert store.calls == [
        ("get", MANIFEST_KEY, 0, 100, 100),
        ("head", MANIFEST_KEY),
        ("get", MANIFEST_KEY, 100, size, size - 100),
    ]


@pytest.mark.parametrize("first_read", [100, 8 << 20], ids=["limit-above-first-read", "limit-below-first-read"])
def test_an_oversized_manifest_is_refused_before_it_is_read(memory_store, monkeypatch, first_read):
    store, size = _saved(memory_store)
    monkeypatch.setattr(manifest_io, "FIRST_READ", first_read)
    limit = size // 2
    with pytest.raises(FormatError, match=f"{size} bytes, over the limit of {limit}") as info:
        runtime.run_sync(read_manifest(store, size_limit=limit))
    assert store.url in str(info.value)
    assert sum(call[-1] for call in store.calls if call[0] == "get") <= min(first_read, limit + 1)
    with pytest.raises(FormatError, match="over the limit"):
        objckpt.restore(
            memory_store.url,
            storage_options=memory_store.storage_options,
            options=objckpt.Options(manifest_size_limit=limit),
        )


def test_no_manifest_is_no_checkpoint(any_store):
    store = _Counting(any_store.open())
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint") as info:
        runtime.run_sync(read_manifest(store, size_limit=1 << 30))
    assert store.url in str(info.value)
