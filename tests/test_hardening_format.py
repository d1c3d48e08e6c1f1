"""Format v2 index objects under hostile inputs (issue 51, items 7-9), through what a user calls.

Saves here write version 2 (``Options(format_version=2)``); version 3's: test_format_v3.py.

Each test saves a real small checkpoint (on the S3 server and on ``file://``), then rewrites
its index objects or its root with the checksums the root pins recomputed, so that only the
rule under test is broken:

- a root listing 100,000 index objects whose first ones are missing ends with the right
  ``FormatError`` after a bounded number of reads, and none keeps running after it;
- one box listed twice (both crc-correct, different bytes) is an overlap for restore and
  ``cp``, as it is for ``verify``;
- an index object of another save is refused, although its ``save_id`` matches its own key.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.cli import main as cli_main
from objckpt.core.checksum import crc32c
from objckpt.core.format.index import index_key
from objckpt.errors import CheckpointNotFoundError, FormatError
from objckpt.layouts.manifest_io import INDEX_READS_AT_ONCE
from objckpt.options import Options
from objckpt.transfer import retries, runtime

KINDS = ["local", "s3"]


def _get(store, key: str) -> bytes:
    return bytes(runtime.run_sync(store.get(key)))


def _root(store) -> dict:
    return json.loads(_get(store, "manifest.json"))


def _write_root(store, doc: dict) -> None:
    runtime.run_sync(store.delete("manifest.json"))
    runtime.run_sync(store.put("manifest.json", json.dumps(doc).encode(), mode="create"))


def _pin(ref: dict, data: bytes, doc: dict) -> None:
    """Make the root's record ``ref`` describe the index object ``data`` (parsed: ``doc``)."""
    ref.update(size=len(data), crc32c=crc32c(data), blobs=len(doc["blobs"]))
    ref["blob_bytes"] = sum(size for _, size in doc["blobs"])


def _rewrite_index(store, edit, process: int = 0) -> None:
    """Replace index object ``process`` by ``edit(doc)``, and pin the result in the root."""
    root = _root(store)
    ref = root["indexes"][process]
    doc = edit(json.loads(_get(store, ref["key"])))
    data = json.dumps(doc).encode()
    runtime.run_sync(store.put(ref["key"], data))
    _pin(ref, data, doc)
    _write_root(store, root)


def _saved(target, tree) -> None:
    """A version 2 save: these tests rewrite its JSON index objects (version 3's: test_format_v3.py)."""
    objckpt.save(target.url, tree, storage_options=target.storage_options, options=Options(format_version=2))


def _restore(target, *args):
    return objckpt.restore(target.url, *args, storage_options=target.storage_options)


def _copy(src, dst):
    return objckpt.copy(
        src.url, dst.url, src_storage_options=src.storage_options, dst_storage_options=dst.storage_options
    )


def _cli_cp(src, dst, monkeypatch, s3_service, capsys) -> str:
    """``objckpt cp SRC DST`` in this process; its stderr (the exit status must be 1)."""
    if src.kind == "s3":
        for name, value in s3_service.env().items():
            monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli_main(["cp", src.url, dst.url]) == 1
    return capsys.readouterr().err


def _assert_nothing_committed(target) -> None:
    with pytest.raises(CheckpointNotFoundError):
        objckpt.inspect(target.url, storage_options=target.storage_options)


# ------------------------------------------------------------------ item 8: one box listed twice


def _list_a_box_twice(store, value_offset: float) -> tuple[list[int], list[int]]:
    """Add to index object 0 a second piece with the box of its first row, whose bytes (in a
    new blob, crc-correct) are the saved values plus ``value_offset``; that box."""
    root = _root(store)
    leaf = root["leaves"][0]
    rank = len(leaf["shape"])

    def edit(doc):
        row = doc["pieces"][0]
        start, stop = row[4 : 4 + rank], row[4 + rank :]
        blob_key = doc["blobs"][row[1]][0]
        length = int(np.prod([b - a for a, b in zip(start, stop)])) * 4
        saved = _get(store, blob_key)[row[2] : row[2] + length]
        evil = (np.frombuffer(saved, dtype=np.float32) + value_offset).tobytes()
        runtime.run_sync(store.put("ff/evil.blob", evil))
        doc["blobs"].append(["ff/evil.blob", len(evil)])
        doc["pieces"].append([row[0], len(doc["blobs"]) - 1, 0, crc32c(evil), *start, *stop])
        edit.box = (start, stop)
        return doc

    _rewrite_index(store, edit)
    return edit.box


@pytest.mark.parametrize("kind", KINDS)
def test_a_box_listed_twice_is_refused_by_restore_cp_and_verify(
    store_target_factory, kind, monkeypatch, s3_service, capsys
):
    src = store_target_factory(kind)
    _saved(src, {"w": np.arange(64, dtype=np.float32).reshape(8, 8)})
    start, stop = _list_a_box_twice(src.open(), 1000.0)

    with pytest.raises(FormatError, match=r"leaf \['w'\] do not tile its box .* overlap") as info:
        _restore(src)
    assert "ff/evil.blob" in str(info.value) and src.url in str(info.value)
    assert f"{start}-{stop}" in str(info.value)

    dst = store_target_factory(kind)
    with pytest.raises(FormatError, match=r"\['w'\].*overlaps"):
        _copy(src, dst)
    _assert_nothing_committed(dst)
    err = _cli_cp(src, dst, monkeypatch, s3_service, capsys)
    assert "['w']" in err and "overlaps" in err
    _assert_nothing_committed(dst)

    with pytest.raises(FormatError, match=r"\['w'\].*overlaps"):
        objckpt.verify(src.url, storage_options=src.storage_options)


def test_a_device_box_listed_twice_is_refused_on_restore_onto_the_saved_sharding(local_store):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    sharding = NamedSharding(mesh, P("x", "y"))
    w = jax.device_put(np.arange(32 * 16, dtype=np.float32).reshape(32, 16), sharding)
    _saved(local_store, {"w": w})
    _list_a_box_twice(local_store.open(), 1000.0)
    target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding)}
    with pytest.raises(FormatError, match=r"leaf \['w'\] do not tile its box .*ff/evil.blob.* overlap"):
        _restore(local_store, target)


# ------------------------------------------------------------------ item 9: another save's index object


@pytest.mark.parametrize("kind", KINDS)
def test_an_index_object_of_another_save_is_refused(store_target_factory, kind, monkeypatch, s3_service, capsys):
    ours, theirs = store_target_factory(kind), store_target_factory(kind)
    _saved(ours, {"w": np.zeros((8, 8), dtype=np.float32)})
    _saved(theirs, {"w": np.ones((8, 8), dtype=np.float32)})
    store, other = ours.open(), theirs.open()
    adopted = _root(other)["indexes"][0]
    # Their index object and blobs, left in our prefix (as a save that lost the commit race
    # leaves them), and our root pointing at that index object with its true size and crc32c.
    for key, _ in json.loads(_get(other, adopted["key"]))["blobs"]:
        runtime.run_sync(store.put(key, _get(other, key)))
    runtime.run_sync(store.put(adopted["key"], _get(other, adopted["key"])))
    root = _root(store)
    root["indexes"][0] = adopted
    _write_root(store, root)

    message = rf"index object {adopted['key']} field 'save_id': .* not the manifest's '{root['save_id']}'"
    with pytest.raises(FormatError, match=message):
        _restore(ours)
    dst = store_target_factory(kind)
    with pytest.raises(FormatError, match=message):
        _copy(ours, dst)
    _assert_nothing_committed(dst)
    err = _cli_cp(ours, dst, monkeypatch, s3_service, capsys)
    assert adopted["key"] in err and "another save" in err
    _assert_nothing_committed(dst)


def _as_before_shared_save_ids(store, own_id: str) -> str:
    """Rewrite a checkpoint to the shape saves had before one ``save_id`` was shared: process
    0's index object carrying its own id under the key that id names, and a root without
    ``shared_save_id``; the index object's new key."""
    root = _root(store)
    ref = root["indexes"][0]
    doc = json.loads(_get(store, ref["key"]))
    doc["save_id"] = own_id
    data = json.dumps(doc).encode()
    key = index_key(own_id, 0)
    runtime.run_sync(store.put(key, data))
    ref["key"] = key
    _pin(ref, data, doc)
    root.pop("shared_save_id")
    _write_root(store, root)
    return key


@pytest.mark.parametrize("kind", KINDS)
def test_roots_from_before_one_save_id_was_shared_still_restore(store_target_factory, kind):
    """Multi-process saves once gave each process its own id: those checkpoints stay readable,
    and only a root that says its index objects share its id is held to that."""
    target = store_target_factory(kind)
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    _saved(target, {"w": value})
    store = target.open()
    assert _root(store)["shared_save_id"] is True
    key = _as_before_shared_save_ids(store, "0" * 31 + "1")
    np.testing.assert_array_equal(_restore(target)["w"], value)
    assert objckpt.verify(target.url, storage_options=target.storage_options).ok

    root = _root(store)
    root["shared_save_id"] = True
    _write_root(store, root)
    with pytest.raises(FormatError, match=rf"index object {key} field 'save_id': .* not the manifest's"):
        _restore(target)
    root["shared_save_id"] = False
    _write_root(store, root)
    with pytest.raises(FormatError, match="shared_save_id"):
        _restore(target)


# ------------------------------------------------------------------ item 7: a million index objects

MANY = 100_000


class _IndexReadCounter:
    """A store that counts the index-object reads started through it, and the most at once."""

    def __init__(self, inner):
        self.inner = inner
        self.started = 0
        self.running = 0
        self.most = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def get_range(self, key, *, start, end):
        if not key.endswith(".index"):
            return await self.inner.get_range(key, start=start, end=end)
        self.started += 1
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            return await self.inner.get_range(key, start=start, end=end)
        finally:
            self.running -= 1


def _count_index_reads(monkeypatch) -> list[_IndexReadCounter]:
    made: list[_IndexReadCounter] = []
    real = retries.from_url

    def wrapped(url, **options):
        store = _IndexReadCounter(real(url, **options))
        made.append(store)
        return store

    monkeypatch.setattr(retries, "from_url", wrapped)
    return made


def _list_many_missing_indexes(store) -> None:
    """The root lists ``MANY`` index objects: process 0's real one, then ones that are missing;
    no leaf says who wrote it, so a restore needs every one."""
    root = _root(store)
    save_id = root["save_id"]
    root["num_processes"] = MANY
    root["indexes"] += [
        {"key": f"{p % 256:02x}/{save_id}-p{p}.index", "size": 1000, "crc32c": 0, "blobs": 1, "blob_bytes": 1000}
        for p in range(1, MANY)
    ]
    for leaf in root["leaves"]:
        leaf.pop("layout", None)
    _write_root(store, root)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("call", ["restore", "copy"])
def test_a_root_listing_many_index_objects_fails_after_a_bounded_number_of_reads(
    store_target_factory, kind, call, monkeypatch
):
    src = store_target_factory(kind)
    _saved(src, {"w": np.arange(64, dtype=np.float32)})
    _list_many_missing_indexes(src.open())
    counters = _count_index_reads(monkeypatch)

    started = time.perf_counter()
    with pytest.raises(FormatError, match=r"index object \w\w/\S+-p\d+\.index \(process \d+\) .* is missing"):
        if call == "restore":
            _restore(src)
        else:
            _copy(src, store_target_factory(kind))
    seconds = time.perf_counter() - started
    reads = sum(c.started for c in counters)
    time.sleep(1.0)  # reads left running after the error would go on being started
    assert sum(c.started for c in counters) == reads
    assert sum(c.running for c in counters) == 0
    assert 2 <= reads <= 4 * INDEX_READS_AT_ONCE, reads
    assert max(c.most for c in counters) <= INDEX_READS_AT_ONCE
    assert seconds < 20, seconds  # about 2 s here; before: every read started, ~6 s at 10^5, 80 CPU-s at 10^6
