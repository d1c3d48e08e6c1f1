"""objckpt.verify: every blob read, every checksum checked, every problem reported."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_manifest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.transfer import runtime

SMALL_BLOBS = objckpt.Options(blob_size=64 * 1024)


def _tree():
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    w = jax.device_put(jnp.arange(256 * 128, dtype=jnp.float32).reshape(256, 128), NamedSharding(mesh, P("x", "y")))
    return {
        "params": {"w": w, "b": jnp.linspace(0, 1, 1000, dtype=jnp.bfloat16)},
        "opt": {"mu": np.arange(20000, dtype=np.int32)},
        "step": 7,
        "name": "run",
    }


def _manifest(target):
    """The saved checkpoint's manifest with every piece and blob (the root and its index objects)."""
    store = target.open()
    return full_manifest(store), store


def test_verify_intact_checkpoint(any_store):
    objckpt.save(any_store.url, _tree(), storage_options=any_store.storage_options, options=SMALL_BLOBS)
    report = objckpt.verify(any_store.url, storage_options=any_store.storage_options)
    manifest, _ = _manifest(any_store)
    assert report.ok and report.problems == []
    assert report.blobs == len(manifest.blobs) > 3
    assert report.pieces == sum(len(leaf.pieces) for leaf in manifest.leaves)
    assert report.bytes_read == sum(b.size for b in manifest.blobs)
    assert report.requests >= report.blobs and report.seconds > 0
    assert str(report).startswith(f"verify {report.url}: OK")
    assert report.to_dict()["ok"] is True


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_verify_reports_every_problem(kind, store_target_factory):
    target = store_target_factory(kind)
    objckpt.save(target.url, _tree(), storage_options=target.storage_options, options=SMALL_BLOBS)
    manifest, store = _manifest(target)
    sizes = {b.key: b.size for b in manifest.blobs}
    by_blob = {}
    for leaf in manifest.leaves:
        for piece in leaf.pieces:
            by_blob.setdefault(piece.blob, []).append((leaf.path, piece))
    flipped, short, gone, longer = sorted(sizes, key=lambda k: (-sizes[k], k))[:4]  # the big blobs

    data = bytearray(runtime.run_sync(store.get(flipped)))
    leaf_path, piece = by_blob[flipped][-1]
    data[piece.offset + piece.length - 1] ^= 0xFF  # last byte of the blob's last piece
    runtime.run_sync(store.put(flipped, bytes(data)))
    runtime.run_sync(store.put(short, runtime.run_sync(store.get(short))[:100]))
    runtime.run_sync(store.delete(gone))
    runtime.run_sync(store.put(longer, runtime.run_sync(store.get(longer)) + b"extra"))

    report = objckpt.verify(target.url, storage_options=target.storage_options)
    assert not report.ok
    kinds = {p.blob: p.kind for p in report.problems}
    assert kinds == {flipped: "checksum", short: "short", gone: "missing", longer: "size"}, report
    mismatch = next(p for p in report.problems if p.kind == "checksum")
    assert mismatch.leaf == leaf_path
    assert (mismatch.start, mismatch.end) == (piece.offset, piece.offset + piece.length)
    assert leaf_path in str(mismatch) and flipped in str(mismatch)
    assert f"[{piece.offset}, {piece.offset + piece.length})" in str(mismatch)
    text = str(report)
    assert "FAILED, 4 problem(s)" in text and all(k in text for k in (flipped, short, gone, longer))
    assert all(secret not in text for secret in target.secrets)
    # every intact blob was still read: only the missing one and the cut-off tail were not;
    # the mismatched piece was read again (four times) before it was reported
    assert "persisted over 5 reads" in str(mismatch) and report.checksum_retries == 4
    rereads = 4 * piece.length
    assert report.bytes_read == sum(sizes.values()) - sizes[gone] - (sizes[short] - 100) + rereads


def test_verify_checks_pieces_in_a_short_blob(memory_store):
    """A truncated blob: the pieces before the cut are still checked and can still fail."""
    objckpt.save(memory_store.url, {"a": np.arange(1000, dtype=np.int64), "b": np.ones(10, np.uint8)},
                 storage_options=memory_store.storage_options)  # fmt: skip
    manifest, store = _manifest(memory_store)
    (blob,) = manifest.blobs
    data = bytearray(runtime.run_sync(store.get(blob.key)))
    first = min(p.offset for leaf in manifest.leaves for p in leaf.pieces)
    data[first] ^= 1  # inside the first piece (leaf a)
    runtime.run_sync(store.put(blob.key, bytes(data[: blob.size - 5])))
    report = objckpt.verify(memory_store.url)
    assert sorted(p.kind for p in report.problems) == ["checksum", "short"]
    assert next(p for p in report.problems if p.kind == "checksum").leaf == "['a']"


def test_verify_without_checkpoint(memory_store):
    with pytest.raises(objckpt.CheckpointNotFoundError):
        objckpt.verify(memory_store.url)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_verify_progress_only_on_a_terminal(memory_store, monkeypatch, capsys):
    objckpt.save(memory_store.url, _tree(), options=SMALL_BLOBS)
    assert objckpt.verify(memory_store.url, progress=True).ok
    assert capsys.readouterr().err == ""  # pytest's stderr is no terminal
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert objckpt.verify(memory_store.url, progress=True).ok
    text = terminal.getvalue()
    assert text.startswith("\rverify:") and "100%" in text and "B/s" in text and text.endswith("\n")  # tqdm's bar
