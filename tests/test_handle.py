"""One handle per operation (:mod:`objckpt.transfer.handle`) and saving's seam (:mod:`objckpt.saving.writer`).

A store registered for a scheme of its own (the public ``register_store`` seam) counts how
often each capability flag is read and which objects are written; every operation opens one
such store and must read each flag once, however many blobs and requests it makes. A save
driven step by step through ``check_destination / begin / upload / commit``, with an engine
of the test's own on the handle, shows that every blob, index object and the root manifest go
through the handle's one engine; ``convert_orbax`` goes through the same seam.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

import objckpt
from objckpt.core.boxes import MeshTable
from objckpt.core.plan import blob_key, packing_order, plan_blobs
from objckpt.core.tree import flatten
from objckpt.multihost import get_coordinator, operation_tag
from objckpt.options import Options
from objckpt.saving.classify import classify
from objckpt.saving.live_markers import is_marker
from objckpt.saving.writer import Source, check_destination, write
from objckpt.storage import Store, from_url, register_store
from objckpt.transfer import runtime
from objckpt.transfer.engine import TransferEngine
from objckpt.transfer.handle import Handle, StoreTraits, bulk_of, opened
from objckpt.transfer.retries import RetryingStore
from objckpt.transfer.stats import TransferStats

FLAGS = ("supports_create", "reads_in_place", "streams_reads", "puts_parts")
_opened: list[FlagCountingStore] = []
_names = itertools.count()


class FlagCountingStore(Store):
    """``inner``, counting each read of its capability flags and recording the keys written."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.url = inner.url
        self.flag_reads: Counter[str] = Counter()
        self.written: list[str] = []

    def _flag(self, name: str) -> bool:
        self.flag_reads[name] += 1
        return bool(getattr(self._inner, name))

    supports_create = property(lambda self: self._flag("supports_create"))  # type: ignore[assignment]
    reads_in_place = property(lambda self: self._flag("reads_in_place"))  # type: ignore[assignment]
    streams_reads = property(lambda self: self._flag("streams_reads"))  # type: ignore[assignment]
    puts_parts = property(lambda self: self._flag("puts_parts"))  # type: ignore[assignment]

    async def get_range(self, key: str, *, start: int, end: int) -> bytes:
        return await self._inner.get_range(key, start=start, end=end)

    async def get(self, key: str) -> bytes:
        return await self._inner.get(key)

    async def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> None:
        self.written.append(key)
        await self._inner.put(key, data, mode=mode)

    async def delete(self, key: str) -> None:
        await self._inner.delete(key)

    async def list(self, prefix: str = "") -> list[Any]:
        return await self._inner.list(prefix)

    async def head(self, key: str) -> Any:
        return await self._inner.head(key)

    def child(self, subpath: str) -> Store:
        return FlagCountingStore(self._inner.child(subpath))


def _counting_store(url: str, **options: Any) -> FlagCountingStore:
    store = FlagCountingStore(from_url(url.replace("flagcount://", "memory://"), **options))
    _opened.append(store)
    return store


@pytest.fixture
def counted_url() -> str:
    register_store("flagcount", _counting_store)
    _opened.clear()
    return f"flagcount://objckpt-tests/handle-{next(_names)}-{time.time_ns()}"


def _tree() -> dict[str, Any]:
    return {f"w{i}": np.arange(i * 1000, (i + 1) * 1000 + 37 * i, dtype=np.float32) for i in range(6)} | {"step": 3}


def _assert_each_flag_read_at_most_once(stores: list[FlagCountingStore]) -> None:
    assert stores, "the operation opened no store"
    for store in stores:
        assert all(n <= 1 for n in store.flag_reads.values()), dict(store.flag_reads)


def test_traits_are_read_once_per_operation_however_many_blobs(counted_url: str) -> None:
    small = Options(blob_size=4096)  # many blobs, many requests
    tree = _tree()
    objckpt.save(counted_url, tree, options=small)
    saved = list(_opened)
    _assert_each_flag_read_at_most_once(saved)
    assert sum(k.endswith(".blob") for s in saved for k in s.written) > 6  # many blobs, one read of each flag

    _opened.clear()
    out = objckpt.restore(counted_url, options=small)
    _assert_each_flag_read_at_most_once(_opened)
    assert all(np.array_equal(out[k], v) for k, v in tree.items() if k != "step") and out["step"] == 3

    _opened.clear()
    assert objckpt.verify(counted_url, options=small).ok
    _assert_each_flag_read_at_most_once(_opened)


def test_a_handle_reads_the_traits_beneath_its_retrying_layer() -> None:
    bare = from_url("memory://objckpt-tests/handle-traits")
    retrying = RetryingStore(bare, retry=Options().retry, request_timeout=5.0)
    handle = Handle.of(retrying, Options())
    assert handle.bulk is bare and handle.store is retrying and bulk_of(retrying) is bare
    assert handle.engine.store is bare  # the engine retries itself: no retrying layer under it
    assert handle.traits == StoreTraits.of(bare)
    # the retrying layer repeats only supports_create; the traits are the store's own
    assert isinstance(handle.traits, StoreTraits) and handle.traits.supports_create
    plain = Handle.of(bare, Options())  # any store gets the options' retries for its metadata calls
    assert isinstance(plain.store, RetryingStore) and plain.bulk is bare
    assert plain.engine.stats is plain.stats and plain.store.stats is plain.stats


class _RecordingEngine(TransferEngine):
    """An engine that records the keys it writes and HEADs."""

    def __init__(self, store: Store, options: Options, stats: TransferStats) -> None:
        super().__init__(
            store,
            max_concurrency=options.max_concurrency,
            request_timeout=options.request_timeout,
            retry=options.retry,
            stats=stats,
        )
        self.put_keys: list[str] = []
        self.head_keys: list[str] = []

    async def put(self, key: str, data: Any, *, mode: Any = "overwrite", crc32c: int | None = None) -> int:
        self.put_keys.append(key)
        return await super().put(key, data, mode=mode, crc32c=crc32c)

    async def head(self, key: str) -> Any:
        self.head_keys.append(key)
        return await super().head(key)


def test_a_save_through_the_seam_writes_everything_with_the_handles_one_engine(counted_url: str) -> None:
    options = Options(blob_size=4096)
    handle = Handle.open(counted_url, None, options)
    engine = _RecordingEngine(handle.bulk, options, handle.stats)
    handle.engine = engine
    tree = _tree()
    try:
        coordinator = get_coordinator()
        leaves, skeleton = flatten(tree)
        meshes = MeshTable()
        entries, owned = [], []
        for i, leaf in enumerate(leaves):
            entry, pieces = classify(i, leaf, is_primary=True, split_above=options.split_replicas_above, meshes=meshes)
            entries.append(entry)
            owned.extend(pieces)
        owned.sort(key=packing_order)
        save_id = "0" * 31 + "1"
        blobs = plan_blobs(owned, blob_size=options.blob_size, key=lambda n: blob_key(save_id, 0, n))
        assert len(blobs) > 3
        source = Source(skeleton, entries, [owned], sum(p.nbytes for p in owned), meshes=tuple(meshes.meshes))
        tag = operation_tag("save", handle.url)
        writing = write(handle, source, save_id=save_id, tag=tag, coordinator=coordinator, blob_size=options.blob_size)
        writing.future.result()
    finally:
        handle.close()
    (store,) = _opened
    data_keys = [k for k in store.written if not is_marker(k)]  # the live marker goes through the store
    assert sorted(engine.put_keys) == sorted(data_keys)
    assert {b.key for b in blobs} <= set(engine.put_keys) and engine.put_keys[-1] == "manifest.json"
    assert sorted(engine.head_keys) == sorted(b.key for b in blobs)  # the commit's blob check, in the window
    assert handle.stats.objects_written == len(engine.put_keys)
    out = objckpt.restore(counted_url)
    assert all(np.array_equal(out[k], v) for k, v in tree.items() if k != "step") and out["step"] == 3
    with opened(counted_url, None, Options()) as again, pytest.raises(objckpt.CheckpointExistsError):
        check_destination(again)


def test_convert_goes_through_the_seam(tmp_path: Any, counted_url: str) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    state = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(7, np.int32)}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "orbax", state)
    checkpointer.wait_until_finished()
    objckpt.convert_orbax(str(tmp_path / "orbax"), counted_url, options=Options(blob_size=4096))
    converted = [s for s in _opened if s.written]
    _assert_each_flag_read_at_most_once(_opened)
    assert len(converted) == 1 and converted[0].written[-1] == "manifest.json"
    left = runtime.run_sync(from_url(counted_url.replace("flagcount://", "memory://")).list())
    assert not [o.key for o in left if is_marker(o.key)]  # the commit took the live marker down
    out = objckpt.restore(counted_url)
    assert np.array_equal(out["w"], state["w"]) and np.array_equal(out["b"], state["b"])
    _opened.clear()
    with pytest.raises(objckpt.CheckpointExistsError):  # writer.check_destination, before anything is written
        objckpt.convert_orbax(str(tmp_path / "orbax"), counted_url)
    assert not [k for s in _opened for k in s.written]
