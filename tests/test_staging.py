"""Save's staging pool: buffers are recycled blob to blob, and recycling never leaks or corrupts bytes.

A recycled buffer still holds the previous blob, so every byte a blob sends
that belongs to no piece must be zeroed again; and a buffer whose upload took
more than one attempt is never reused (an abandoned attempt may still read it).
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from helpers import assert_tree_bit_exact, full_manifest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.errors import TransientStoreError
from objckpt.options import RetryConfig
from objckpt.restoring.aligned_reads import address
from objckpt.saving import upload as upload_module
from objckpt.saving.staging import StagingPool
from objckpt.storage import from_url
from objckpt.storage.obstore.store import ObstoreStore
from objckpt.transfer import runtime
from objckpt.transfer.engine import TransferEngine


def test_pool_recycles_and_bounds_buffers():
    pool = StagingPool(limit=3 << 20, capacity=1 << 20)
    never = threading.Event()
    a, b, c = (pool.take(never, lambda: None) for _ in range(3))
    assert a is not None and b is not None and c is not None
    assert len({a.ctypes.data, b.ctypes.data, c.ctypes.data}) == 3 and a.nbytes == 1 << 20

    pool.give(b, reusable=True)
    again = pool.take(never, lambda: None)
    assert again is b and pool.reused == 1

    pool.give(c, reusable=False)  # dropped: its slot frees up for a fresh buffer
    fresh = pool.take(never, lambda: None)
    assert fresh is not None and fresh is not c and pool.allocated == 3


def test_pool_waits_for_a_buffer_and_gives_up_on_abort():
    pool = StagingPool(limit=1 << 20, capacity=1 << 20)
    never, abort = threading.Event(), threading.Event()
    first = pool.take(never, lambda: None)
    waited = []
    threading.Timer(0.2, lambda: pool.give(first, reusable=True)).start()
    assert pool.take(never, lambda: waited.append(1)) is first and waited == [1]

    threading.Timer(0.2, abort.set).start()
    assert pool.take(abort, lambda: None) is None


def _odd_tree():
    """Many small leaves of odd sizes and a few 1 MiB shards: blobs full of gaps."""
    rng = np.random.default_rng(3)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharded = {
        f"w{i}": jax.device_put(
            rng.standard_normal((512, 1024), dtype=np.float32), NamedSharding(mesh, P("data", "model"))
        )
        for i in range(4)
    }
    small = {f"s{i}": rng.integers(0, 255, size=(37 * i + 5,), dtype=np.uint8) for i in range(60)}
    return {"sharded": sharded, "small": small}


def _record_pools(monkeypatch) -> list[StagingPool]:
    """Make save record every staging pool it creates; returns the list they land in."""
    pools: list[StagingPool] = []

    class RecordingPool(StagingPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(upload_module, "StagingPool", RecordingPool)
    return pools


def _assert_restores_exactly(target, tree):
    restored = objckpt.restore(target.url, storage_options=target.storage_options)
    assert_tree_bit_exact(jax.tree.map(np.asarray, tree), restored)


def _assert_gaps_zero(target):
    """Every blob byte outside a piece is zero (never stale bytes of another blob)."""
    store = target.open()
    manifest = full_manifest(store)
    assert manifest.blobs, "no blob listed"
    covered: dict[str, np.ndarray] = {}
    for blob in manifest.blobs:
        covered[blob.key] = np.zeros(blob.size, dtype=bool)
    for leaf in manifest.leaves:
        for piece in leaf.pieces:
            covered[piece.blob][piece.offset : piece.offset + piece.length] = True
    for key, mask in covered.items():
        data = np.frombuffer(runtime.run_sync(store.get(key)), dtype=np.uint8)
        assert len(data) == len(mask)
        assert not data[~mask].any(), f"blob {key} sends stale bytes outside its pieces"


@pytest.mark.s3
def test_recycled_buffers_send_zeroed_gaps_and_exact_pieces(s3_store, monkeypatch):
    monkeypatch.setattr(upload_module, "piece_bytes_of", lambda piece, host: None)  # stage every blob
    pools = _record_pools(monkeypatch)
    tree = _odd_tree()
    options = objckpt.Options(blob_size=1 << 20, staging_pool=3 << 20)
    objckpt.save(s3_store.url, tree, storage_options=s3_store.storage_options, options=options)

    (pool,) = pools
    assert pool.allocated <= 3 and pool.reused > 0  # the save streamed through three buffers

    _assert_restores_exactly(s3_store, tree)
    _assert_gaps_zero(s3_store)


@pytest.mark.s3
def test_sync_save_to_s3_sends_array_bytes_in_place(s3_store, monkeypatch):
    """No staging copy: the PUT bodies' piece parts are the device buffers' own memory."""
    pools = _record_pools(monkeypatch)
    sent: list[int] = []  # addresses of the parts every blob PUT carried
    real_put_checked = ObstoreStore.put_checked  # blobs go with their crc32c, as parts

    async def recording_put_checked(self, key, parts, *, crc32c, mode="overwrite"):
        if key.endswith(".blob"):
            assert isinstance(parts, list), "a blob sent in place goes as its parts"
            sent.extend(address(p) for p in parts if len(p) >= 4096)
        await real_put_checked(self, key, parts, crc32c=crc32c, mode=mode)

    monkeypatch.setattr(ObstoreStore, "put_checked", recording_put_checked)
    tree = _odd_tree()
    objckpt.save(
        s3_store.url, tree, storage_options=s3_store.storage_options, options=objckpt.Options(blob_size=1 << 20)
    )

    (pool,) = pools
    assert pool.allocated == 0  # nothing was staged
    shards = {s.data.unsafe_buffer_pointer() for leaf in tree["sharded"].values() for s in leaf.addressable_shards}
    assert shards and shards <= set(sent), "a shard's bytes were copied before upload"
    _assert_restores_exactly(s3_store, tree)
    _assert_gaps_zero(s3_store)


@pytest.mark.s3
def test_async_save_never_sends_in_place(s3_store, monkeypatch):
    """save_async returns before its uploads end, so the arrays may change: it always stages."""
    asked: list[object] = []
    monkeypatch.setattr(upload_module, "piece_bytes_of", lambda piece, host: asked.append(piece))
    tree = _odd_tree()
    objckpt.save_async(s3_store.url, tree, storage_options=s3_store.storage_options).result()
    assert not asked
    _assert_restores_exactly(s3_store, tree)


class _FailsFirstPut:
    """A memory store whose first PUT of each key fails as if throttled."""

    def __init__(self, inner):
        self.inner = inner
        self.seen: set[str] = set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def put(self, key, data, *, mode="overwrite"):
        if key.endswith(".blob") and key not in self.seen:
            self.seen.add(key)
            raise TransientStoreError(f"503 SlowDown for {key}")
        await self.inner.put(key, data, mode=mode)


def test_engine_put_reports_its_attempts(memory_store):
    store = _FailsFirstPut(memory_store.open())

    async def run():
        engine = TransferEngine(store, max_concurrency=2, request_timeout=5, retry=RetryConfig(initial_backoff=0.001))
        return await engine.put("a.blob", b"x"), await engine.put("b.json", b"y")

    assert runtime.run_sync(run()) == (2, 1)


def test_a_buffer_sent_twice_is_never_reused(memory_store, monkeypatch):
    from objckpt.transfer import retries as transfer

    monkeypatch.setattr(transfer, "from_url", lambda url, **kw: _FailsFirstPut(from_url(url, **kw)))
    given: list[bool] = []
    original_give = StagingPool.give

    def recording_give(self, buffer, *, reusable):
        given.append(reusable)
        original_give(self, buffer, reusable=reusable)

    monkeypatch.setattr(StagingPool, "give", recording_give)
    tree = _odd_tree()
    options = objckpt.Options(blob_size=1 << 20, staging_pool=2 << 20, retry=RetryConfig(initial_backoff=0.001))
    objckpt.save(memory_store.url, tree, options=options)

    assert given and not any(given)  # every blob needed a retry, so no buffer was recycled
    assert_tree_bit_exact(jax.tree.map(np.asarray, tree), objckpt.restore(memory_store.url))
