"""objckpt.copy: any store to any store, checked on the way, committed last, resumable.

Also the library side of progress and stats: ``progress=True`` on save, restore
and copy, and the figures each returns and logs.
"""

from __future__ import annotations

import asyncio
import io
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_bit_exact, full_manifest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.core.plan import SPACER
from objckpt.transfer import runtime

SMALL_BLOBS = objckpt.Options(blob_size=64 * 1024)


def _tree(seed=0):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    w = jax.device_put(
        jnp.arange(256 * 128, dtype=jnp.float32).reshape(256, 128) + seed, NamedSharding(mesh, P("x", "y"))
    )
    return {
        "params": {"w": w, "b": jnp.linspace(0, 1, 1000, dtype=jnp.bfloat16)},
        "opt": {"mu": np.arange(20000, dtype=np.int32) * (seed + 1)},
        "step": 7 + seed,
        "lr": 0.25,
        "name": "run",
    }


def _manifest_bytes(target):
    return runtime.run_sync(target.open().get("manifest.json"))


def _blobs(target):
    return {b.key: b.size for b in full_manifest(target.open()).blobs}


def _index_bytes(target):
    """Bytes of the index objects (format v2: one per process) the root manifest lists."""
    return sum(ref.size for ref in full_manifest(target.open()).indexes)


@pytest.mark.parametrize(("src_kind", "dst_kind"), [("memory", "local"), ("local", "gcs"), ("s3", "local")])
def test_copy_between_stores_bit_exact(src_kind, dst_kind, store_target_factory):
    src, dst = store_target_factory(src_kind), store_target_factory(dst_kind)
    tree = _tree()
    objckpt.save(src.url, tree, storage_options=src.storage_options, options=SMALL_BLOBS)
    stats = objckpt.copy(
        src.url, dst.url, src_storage_options=src.storage_options, dst_storage_options=dst.storage_options
    )
    blobs, indexes = _blobs(src), _index_bytes(src)
    assert indexes > 0
    assert stats.blobs == stats.blobs_copied == len(blobs) and stats.blobs_skipped == 0
    assert stats.bytes_copied == stats.bytes_total == sum(blobs.values())
    assert stats.bytes_read == stats.bytes_copied + indexes  # the index objects cross the link too
    assert stats.bytes_written == stats.bytes_copied + indexes + len(_manifest_bytes(dst))
    assert _manifest_bytes(dst) == _manifest_bytes(src)
    for ref in full_manifest(src.open()).indexes:  # copied as they are (the root holds their crc32c)
        assert runtime.run_sync(dst.open().get(ref.key)) == runtime.run_sync(src.open().get(ref.key))
    assert objckpt.verify(dst.url, storage_options=dst.storage_options).ok
    assert_tree_bit_exact(tree, objckpt.restore(dst.url, tree, storage_options=dst.storage_options))
    assert all(secret not in stats.summary() for secret in src.secrets + dst.secrets)


def test_rerun_copies_only_what_is_missing_or_damaged(memory_store, local_store):
    objckpt.save(memory_store.url, _tree(), options=SMALL_BLOBS)
    objckpt.copy(memory_store.url, local_store.url)
    blobs = _blobs(memory_store)
    dst = local_store.open()
    # an interrupted copy: no manifest, some blobs never arrived, one arrived damaged
    runtime.run_sync(dst.delete("manifest.json"))
    missing = sorted(blobs)[:3]
    damaged = sorted(blobs)[3]
    for key in missing:
        runtime.run_sync(dst.delete(key))
    runtime.run_sync(dst.put(damaged, b"\0" * blobs[damaged]))  # right size, wrong bytes

    stats = objckpt.copy(memory_store.url, local_store.url)
    redone = [*missing, damaged]
    assert stats.blobs_copied == 4 and stats.bytes_copied == sum(blobs[k] for k in redone)
    assert stats.bytes_read == stats.bytes_copied + _index_bytes(memory_store)  # only those crossed from the source
    assert stats.blobs_skipped == len(blobs) - 4
    assert stats.bytes_skipped == stats.bytes_read_dst - blobs[damaged] == sum(blobs.values()) - stats.bytes_copied
    assert objckpt.verify(local_store.url).ok


def test_trust_existing_skips_the_read_back(memory_store, local_store):
    objckpt.save(memory_store.url, _tree(), options=SMALL_BLOBS)
    objckpt.copy(memory_store.url, local_store.url)
    dst = local_store.open()
    runtime.run_sync(dst.delete("manifest.json"))
    gone = sorted(_blobs(memory_store))[0]
    runtime.run_sync(dst.delete(gone))
    stats = objckpt.copy(memory_store.url, local_store.url, verify_existing=False)
    assert stats.blobs_copied == 1 and stats.bytes_read_dst == 0


def test_copy_refuses_a_committed_destination(memory_store, local_store):
    objckpt.save(memory_store.url, _tree(), options=SMALL_BLOBS)
    objckpt.save(local_store.url, _tree(seed=1))
    before = _manifest_bytes(local_store)
    with pytest.raises(objckpt.CheckpointExistsError, match="already exists") as info:
        objckpt.copy(memory_store.url, local_store.url)
    assert isinstance(info.value, FileExistsError) and "same checkpoint" not in str(info.value)
    assert _manifest_bytes(local_store) == before
    other = local_store.url + "-copy"
    objckpt.copy(memory_store.url, other)
    with pytest.raises(objckpt.CheckpointExistsError, match="copied already"):
        objckpt.copy(memory_store.url, other)


def test_damaged_source_commits_nothing(memory_store, local_store):
    objckpt.save(memory_store.url, _tree(), options=SMALL_BLOBS)
    src = memory_store.open()
    key = sorted(_blobs(memory_store))[2]
    data = bytearray(runtime.run_sync(src.get(key)))
    data[SPACER] ^= 0x10  # the blob's first piece starts after its leading spacer
    runtime.run_sync(src.put(key, bytes(data)))
    with pytest.raises(objckpt.IntegrityError, match=rf"checksum mismatch in leaf \['.*blob .*bytes \[{SPACER}, "):
        objckpt.copy(memory_store.url, local_store.url)
    with pytest.raises(objckpt.CheckpointNotFoundError):
        objckpt.inspect(local_store.url)


@pytest.mark.parametrize("dst_kind", ["local", "s3"])
def test_a_copy_that_would_not_read_back_commits_nothing(memory_store, store_target_factory, dst_kind, monkeypatch):
    """An index object that reaches the destination changed (a store that alters what it is
    sent): the copy's manifest goes through the save's one manifest write, which reads the copy
    back as a restore would first, so nothing is committed and the error says why."""
    from objckpt.transfer.engine import TransferEngine

    dst = store_target_factory(dst_kind)
    objckpt.save(memory_store.url, _tree(), options=SMALL_BLOBS)
    put = TransferEngine.put

    async def altering(self, key, data, *args, **kwargs):
        if key.endswith(".index") and self.store.url.startswith(dst.url.rstrip("/")):
            body = bytearray(b"".join(bytes(p) for p in data) if isinstance(data, list) else bytes(data))
            body[-1] ^= 0x01
            data, kwargs = bytes(body), {k: v for k, v in kwargs.items() if k != "crc32c"}
        return await put(self, key, data, *args, **kwargs)

    monkeypatch.setattr(TransferEngine, "put", altering)
    with pytest.raises(objckpt.StoreError, match="would not read back"):
        objckpt.copy(memory_store.url, dst.url, dst_storage_options=dst.storage_options, server_side=False)
    with pytest.raises(objckpt.CheckpointNotFoundError):
        objckpt.inspect(dst.url, storage_options=dst.storage_options)


def test_copy_without_source_checkpoint(memory_store, local_store):
    with pytest.raises(objckpt.CheckpointNotFoundError):
        objckpt.copy(memory_store.url, local_store.url)


def test_copy_logs_one_summary_line(memory_store, local_store, caplog):
    objckpt.save(memory_store.url, _tree(), options=SMALL_BLOBS)
    with caplog.at_level(logging.INFO, logger="objckpt"):
        stats = objckpt.copy(memory_store.url, local_store.url)
    (line,) = [r.getMessage() for r in caplog.records if "copied" in r.getMessage()]
    assert line == f"objckpt {stats.summary()}"
    for figure in ("blobs", "requests", "retries", " s,", "GiB/s", f"{stats.bytes_read} bytes read from the source"):
        assert figure in line
    assert stats.to_dict()["gib_per_s"] == stats.gib_per_s > 0


# ------------------------------------------------------------------ progress and stats (library)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_only_on_a_terminal(memory_store, local_store, monkeypatch, capsys):
    tree = _tree()
    url = memory_store.url
    objckpt.save(url + "/a", tree, options=SMALL_BLOBS, progress=True)
    objckpt.restore(url + "/a", tree, progress=True)
    objckpt.copy(url + "/a", local_store.url + "/a", progress=True)
    assert capsys.readouterr().err == ""

    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    objckpt.save(url + "/b", tree, options=SMALL_BLOBS, progress=True)
    objckpt.restore(url + "/b", tree, progress=True)
    objckpt.copy(url + "/b", local_store.url + "/b", progress=True)
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in terminal.getvalue().split("\n")[:-1]]
    assert [line.split(":", 1)[0] for line in lines] == ["save", "restore", "cp"]  # tqdm's "label: 100%|..."
    assert all("100%" in line and "B/s" in line and "[00:0" in line for line in lines), lines


def test_save_and_restore_return_their_figures(memory_store, caplog):
    tree = _tree()
    with caplog.at_level(logging.INFO, logger="objckpt"):
        saved = objckpt.save(memory_store.url, tree, options=SMALL_BLOBS)
        counters = objckpt.TransferStats()
        objckpt.restore(memory_store.url, tree, stats=counters)
    blobs = _blobs(memory_store)
    manifest = len(_manifest_bytes(memory_store)) + _index_bytes(memory_store)  # the root and its one index object
    assert saved.bytes_written == sum(blobs.values()) + manifest and saved.objects_written == len(blobs) + 2
    assert saved.seconds > 0 and saved.requests >= len(blobs)
    assert counters.bytes_read > 0 and counters.seconds > 0 and counters.requests > 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"objckpt saved {memory_store.url}") and "GiB/s" in m for m in messages)
    assert any(m.startswith(f"objckpt restored {memory_store.url}") and f"{counters.bytes_read} bytes read" in m
               for m in messages)  # fmt: skip


def test_gc_at_the_destination_keeps_off_a_copy_in_flight(memory_store, s3_store, monkeypatch):
    """A copy writes its live-save marker at the destination before its first object, as a save
    does: a ``gc`` of the destination's root with no grace, run while the copy's blobs are there
    and its manifest is not, leaves them alone, and the copy commits whole. (Without the marker
    gc deleted the blobs and the copy committed a root whose blobs were gone.)"""
    import threading

    from objckpt.tools import copy as copy_module

    tree = _tree()
    objckpt.save(memory_store.url, tree, options=SMALL_BLOBS)
    reached, release = threading.Event(), threading.Event()
    original = copy_module._copy_indexes

    async def paused(*args, **kwargs):
        reached.set()
        await asyncio.to_thread(release.wait, 60)
        return await original(*args, **kwargs)

    monkeypatch.setattr(copy_module, "_copy_indexes", paused)
    step, so = f"{s3_store.url}/step_0000000001", s3_store.storage_options
    errors = []
    copying = threading.Thread(
        target=lambda: _run_catching(errors, objckpt.copy, memory_store.url, step, dst_storage_options=so)
    )
    copying.start()
    try:
        assert reached.wait(60)
        with objckpt.CheckpointManager(s3_store.url, storage_options=so) as mgr:
            deleted = mgr.gc(grace_seconds=0)
    finally:
        release.set()
        copying.join(60)
    assert errors == [] and not [k for k in deleted if k.startswith("step_0000000001/")], deleted
    assert_tree_bit_exact(tree, objckpt.restore(step, tree, storage_options=so))


def _run_catching(errors, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test reports it
        errors.append(e)
