"""Format version 3: index objects a host reads in part (issue 54), through what a user calls.

A version 3 index object is a head (magic, length, strict JSON: blobs, a table of frames) that
the root pins by its length and checksum, then zlib frames of columnar rows. These tests save
real small checkpoints (on the local S3 server and in memory) and check: the round trip
through restore, verify, cp and gc; that a partial restore reads the head and only the frames
of the leaves it needs; that hostile bytes (a truncated head, a changed head or frame, a frame
that inflates past its declared length, rows outside their leaf or out of order, another
save's object) are each a ``FormatError`` naming the object; and that versions 1 and 2 still
restore, inspect, verify and copy.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import assemble_index3, count_reads, full_manifest

import objckpt
from objckpt.core.checksum import crc32c
from objckpt.core.format import MANIFEST_KEY
from objckpt.core.format import index3 as ix
from objckpt.core.format import index3_bounds as ix_bounds
from objckpt.core.format import index3_encode as ix_encode
from objckpt.errors import FormatError, IntegrityError
from objckpt.options import Options
from objckpt.transfer import runtime

SMALL_FRAMES = 2048  # raw bytes per frame in the partial-read tests: ~40 rows


def _small_frames(monkeypatch) -> None:
    """Writers cut frames of ``SMALL_FRAMES`` raw bytes, and readers allow that many frames."""
    monkeypatch.setattr(ix_encode, "FRAME_TARGET", SMALL_FRAMES)
    monkeypatch.setattr(ix_bounds, "FRAME_FLOOR", SMALL_FRAMES // 2)


def _tree(leaves: int = 40, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "opt": {f"m{i:03d}": rng.standard_normal((4, 8)).astype(np.float32) for i in range(leaves)},
        "params": {f"w{i:03d}": rng.standard_normal((4, 8)).astype(np.float32) for i in range(leaves)},
        "step": 3,
    }


def _get(store, key: str) -> bytes:
    return bytes(runtime.run_sync(store.get(key)))


def _root(store) -> dict:
    return json.loads(_get(store, MANIFEST_KEY))


def _put_root(store, doc: dict) -> None:
    runtime.run_sync(store.put(MANIFEST_KEY, json.dumps(doc).encode()))


def _save(target, tree, **options) -> None:
    objckpt.save(target.url, tree, storage_options=target.storage_options, options=Options(**options))


def _restore(target, *args, **kwargs):
    return objckpt.restore(target.url, *args, storage_options=target.storage_options, **kwargs)


def _equal(a, b) -> None:
    for key in ("opt", "params"):
        for name, value in a[key].items():
            np.testing.assert_array_equal(np.asarray(b[key][name]), value)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("digest", [None, "sha256"])
def test_a_v3_save_round_trips_through_restore_verify_cp_and_gc(store_target_factory, digest):
    src, dst = store_target_factory("s3"), store_target_factory("s3")
    tree = _tree()
    _save(src, tree, digest=digest)
    store = src.open()
    root = _root(store)
    assert root["version"] == 3 and root["shared_save_id"] is True
    ref = root["indexes"][0]
    data = _get(store, ref["key"])
    assert data[:8] == ix.MAGIC and len(data) == ref["size"] and crc32c(data[: ref["head"]]) == ref["crc32c"]
    assert ("sha256" in ref) == (digest is not None)
    _equal(tree, _restore(src, options=Options(digest=digest)))
    assert objckpt.verify(src.url, storage_options=src.storage_options).ok
    objckpt.copy(src.url, dst.url, src_storage_options=src.storage_options, dst_storage_options=dst.storage_options)
    assert _get(dst.open(), ref["key"]) == data  # byte for byte
    assert _root(dst.open())["version"] == 3
    _equal(tree, _restore(dst))
    assert objckpt.verify(dst.url, storage_options=dst.storage_options).ok


def test_gc_keeps_a_v3_step_and_removes_only_orphans(memory_store):
    mgr = objckpt.CheckpointManager(memory_store.url)
    trees = {1: _tree(4, 1), 2: _tree(4, 2)}
    for step, tree in trees.items():
        mgr.save(step, tree, wait=True)
    keys = {o.key for o in runtime.run_sync(mgr.store.list())}
    orphan = "step_0000000001/cd/deadbeef-p0.index"
    runtime.run_sync(mgr.store.put(orphan, b"x" * 100))
    assert mgr.gc(grace_seconds=0) == [orphan]
    assert {o.key for o in runtime.run_sync(mgr.store.list())} == keys
    assert mgr.inspect(2).format_version == 3
    for step, tree in trees.items():
        _equal(tree, mgr.restore(step, tree))


@pytest.mark.parametrize("version", [2, 3])
def test_older_and_newer_versions_restore_inspect_verify_and_copy(store_target_factory, version):
    src, dst = store_target_factory("memory"), store_target_factory("local")
    tree = _tree(6)
    _save(src, tree, format_version=version)
    assert objckpt.inspect(src.url).format_version == version
    assert objckpt.verify(src.url).ok
    objckpt.copy(src.url, dst.url)
    assert _root(dst.open())["version"] == version
    _equal(tree, _restore(dst))


def test_format_version_is_checked():
    for bad in (1, 4, "3", True):
        with pytest.raises(ValueError, match="Options.format_version"):
            Options(format_version=bad)


# ----------------------------------------------------------------------------- partial reads


def test_a_partial_restore_reads_the_head_and_only_the_frames_it_needs(store_target_factory, monkeypatch):
    _small_frames(monkeypatch)
    target = store_target_factory("s3")
    tree = _tree(300)
    _save(target, tree)
    store = target.open()
    ref = _root(store)["indexes"][0]
    head = json.loads(_get(store, ref["key"])[12 : ref["head"]])
    assert len(head["frames"]) >= 10
    monkeypatch.setattr("objckpt.layouts.index3_io.WHOLE_BELOW", 0)  # no small-object shortcut: count frames
    counting = count_reads(monkeypatch)
    out = _restore(target, {"params": {"w007": None}}, partial=True)
    np.testing.assert_array_equal(out["params"]["w007"], tree["params"]["w007"])
    index_reads = [(start, end) for s in counting for key, start, end in s.reads if key == ref["key"]]
    read = sum(end - start for start, end in index_reads)
    assert index_reads[0] == (0, ref["head"])  # the head first, exactly its length
    assert read <= ref["head"] + 2 * max(f[3] for f in head["frames"]), (read, ref["size"])
    assert read < ref["size"] / 4, (read, ref["size"])


def test_a_whole_restore_reads_every_frame(store_target_factory, monkeypatch):
    _small_frames(monkeypatch)
    target = store_target_factory("memory")
    tree = _tree(30)
    _save(target, tree)
    manifest = full_manifest(target.open())
    assert sum(len(leaf.pieces) for leaf in manifest.leaves) == 60
    _equal(tree, _restore(target))


def test_a_frame_changed_once_in_flight_is_read_again(store_target_factory, monkeypatch):
    """A frame that fails its crc32c on one read is read again (as a v2 object is), not refused."""
    target = store_target_factory("memory")
    tree = _tree(4)
    _save(target, tree)
    ref = _root(target.open())["indexes"][0]
    monkeypatch.setattr("objckpt.layouts.index3_io.WHOLE_BELOW", 0)
    from objckpt.transfer import retries

    real = retries.from_url
    spoiled = []

    class Flaky:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        async def get_range(self, key, *, start, end):
            data = await self.inner.get_range(key, start=start, end=end)
            if key == ref["key"] and start > 0 and not spoiled:
                spoiled.append(start)
                return bytes([data[0] ^ 1]) + bytes(data[1:])
            return data

    monkeypatch.setattr(retries, "from_url", lambda url, **o: Flaky(real(url, **o)))
    _equal(tree, _restore(target))
    assert spoiled


# ----------------------------------------------------------------------------- hostile inputs


def _assemble(save_id: str, process: int, blobs: list, frames: list[tuple[int, int, int, bytes, int]]) -> tuple:
    """A version 3 object from frames given as (first, last, rows, raw bytes, declared raw length);
    its bytes and head length (as ``index3_encode`` lays them out, but nothing checked)."""
    doc = {"format": "objckpt-index", "version": 3, "save_id": save_id, "process": process, "blobs": blobs}
    return assemble_index3(doc, frames)


def _replace_index(store, data: bytes, head: int) -> str:
    """Write ``data`` as index object 0 and pin it in the root (size, head, crc32c of the head); its key."""
    root = _root(store)
    ref = root["indexes"][0]
    runtime.run_sync(store.put(ref["key"], data))
    ref.update(size=len(data), head=head, crc32c=crc32c(data[:head]))
    _put_root(store, root)
    return ref["key"]


def _rows(store) -> tuple[dict, list, list]:
    """The saved index object 0's head document, and its rows as (leaf, piece), sorted by leaf."""
    root = _root(store)
    ref = root["indexes"][0]
    doc = json.loads(_get(store, ref["key"])[12 : ref["head"]])
    manifest = full_manifest(store)
    rows = sorted(((i, p) for i, leaf in enumerate(manifest.leaves) for p in leaf.pieces), key=lambda r: r[0])
    return doc, rows, [k for k, _ in doc["blobs"]]


def _frame(rows, keys) -> tuple[int, int, int, bytes, int]:
    raw = ix_encode._columns(rows, {k: n for n, k in enumerate(keys)}, False)
    return rows[0][0], rows[-1][0], len(rows), raw, len(raw)


def _refused(target, pattern: str, key: str) -> None:
    with pytest.raises(FormatError, match=pattern) as caught:
        _restore(target)
    assert key in str(caught.value)
    with pytest.raises(FormatError, match=pattern):
        objckpt.verify(target.url, storage_options=target.storage_options)


@pytest.fixture
def saved(store_target_factory):
    target = store_target_factory("memory")
    _save(target, _tree(8))
    return target


def test_a_truncated_head_is_refused(saved):
    store = saved.open()
    ref = _root(store)["indexes"][0]
    runtime.run_sync(store.put(ref["key"], _get(store, ref["key"])[: ref["head"] - 5]))
    _refused(saved, r"is truncated: its head is \d+ bytes", ref["key"])


def test_a_changed_head_is_refused(saved):
    store = saved.open()
    ref = _root(store)["indexes"][0]
    data = bytearray(_get(store, ref["key"]))
    at = data.index(b'"process":0') + len(b'"process":')
    data[at : at + 1] = b"1"
    runtime.run_sync(store.put(ref["key"], bytes(data)))
    _refused(saved, "head does not match its crc32c in the manifest", ref["key"])


def test_a_changed_frame_is_refused(saved):
    store = saved.open()
    ref = _root(store)["indexes"][0]
    last = len(_rows(store)[0]["frames"]) - 1
    data = bytearray(_get(store, ref["key"]))
    data[-3] ^= 0x40  # a byte of the last frame
    runtime.run_sync(store.put(ref["key"], bytes(data)))
    _refused(saved, rf"frame {last} \(bytes .*\): does not match its crc32c in the head", ref["key"])


def test_cp_refuses_a_changed_frame_and_commits_nothing(store_target_factory, saved):
    store = saved.open()
    ref = _root(store)["indexes"][0]
    dst = store_target_factory("memory")
    data = _get(store, ref["key"])
    full = full_manifest(store)
    last = len(_rows(store)[0]["frames"]) - 1
    runtime.run_sync(store.put(ref["key"], data[:-3] + bytes([data[-3] ^ 0x40]) + data[-2:]))
    from objckpt.tools.copy import _copy_indexes

    with pytest.raises(IntegrityError, match=f"{ref['key']}.*frame {last}.*crc32c"):
        runtime.run_sync(_copy_indexes(_Engine(store), _Engine(dst.open()), saved, full))
    assert not runtime.run_sync(dst.open().list())


class _Engine:
    """Just what ``_copy_indexes`` calls of a transfer engine."""

    def __init__(self, store):
        self.store = store

    async def get(self, key):
        return await self.store.get(key)

    async def put(self, key, data):
        return await self.store.put(key, data)


def test_a_frame_that_inflates_past_its_length_is_refused(saved):
    store = saved.open()
    doc, rows, keys = _rows(store)
    first, last, n, raw, _ = _frame(rows, keys)
    data, head = _assemble(doc["save_id"], 0, doc["blobs"], [(first, last, n, raw + b"\0" * 4096, len(raw))])
    key = _replace_index(store, data, head)
    _refused(saved, f"index object {key} frame 0 .* does not decompress to exactly {len(raw)} bytes", key)


def test_one_frame_across_items_still_restores(store_target_factory):
    """Saves before frames were cut at items wrote one frame across opt and params: such an
    object restores whole and in part."""
    target = store_target_factory("memory")
    tree = _tree(8)
    _save(target, tree)
    store = target.open()
    doc, rows, keys = _rows(store)
    data, head = _assemble(doc["save_id"], 0, doc["blobs"], [_frame(rows, keys)])
    _replace_index(store, data, head)
    assert len(_rows(store)[0]["frames"]) == 1
    _equal(tree, _restore(target))
    out = _restore(target, {"params": {"w003": None}}, partial=True)
    np.testing.assert_array_equal(out["params"]["w003"], tree["params"]["w003"])


@pytest.mark.parametrize("row", [0, 5])
def test_rows_outside_their_leaf_are_refused(saved, row):
    """Rows are checked per distinct box (every good row here names the same one): the error
    still names the row that is wrong."""
    store = saved.open()
    doc, rows, keys = _rows(store)
    leaf, piece = rows[row]
    rows[row] = (leaf, piece._replace(stop=(piece.stop[0] + 1, *piece.stop[1:])))
    data, head = _assemble(doc["save_id"], 0, doc["blobs"], [_frame(rows, keys)])
    key = _replace_index(store, data, head)
    _refused(saved, rf"index object {key} frame 0 .*: row {row}: box outside leaf {leaf}'s shape", key)


def test_each_item_starts_a_frame(saved):
    """Frames are cut where an item starts (opt, params; the step is inline in the root), however
    small: a reader of one item decompresses no row of another."""
    doc, rows, _ = _rows(saved.open())
    assert [(f[0], f[1]) for f in doc["frames"]] == [(0, 7), (8, 15)]


def test_rows_past_their_blob_are_refused(saved):
    store = saved.open()
    doc, rows, keys = _rows(store)
    leaf, piece = rows[-1]
    rows[-1] = (leaf, piece._replace(offset=dict(doc["blobs"])[piece.blob]))
    data, head = _assemble(doc["save_id"], 0, doc["blobs"], [_frame(rows, keys)])
    key = _replace_index(store, data, head)
    _refused(saved, rf"index object {key} frame 0 .*: row {len(rows) - 1}: bytes beyond blob", key)


def test_rows_out_of_leaf_order_are_refused(saved):
    store = saved.open()
    doc, rows, keys = _rows(store)
    rows[0], rows[-1] = rows[-1], rows[0]
    first, last, n, raw, length = _frame(rows, keys)
    data, head = _assemble(doc["save_id"], 0, doc["blobs"], [(min(first, last), max(first, last), n, raw, length)])
    key = _replace_index(store, data, head)
    _refused(saved, rf"index object {key} frame 0 .*: rows must .*sorted by leaf", key)


def test_frames_that_do_not_cover_the_object_are_refused(saved):
    store = saved.open()
    doc, rows, keys = _rows(store)
    data, head = _assemble(doc["save_id"], 0, doc["blobs"], [_frame(rows, keys)])
    key = _replace_index(store, data + b"\0" * 10, head)
    _refused(saved, rf"index object {key} field 'frames': end at byte {len(data)}", key)


def test_an_index_object_of_another_save_is_refused(store_target_factory):
    ours, theirs = store_target_factory("memory"), store_target_factory("memory")
    _save(ours, _tree(4, 1))
    _save(theirs, _tree(4, 2))
    store, other = ours.open(), theirs.open()
    adopted = _root(other)["indexes"][0]
    for key, _ in json.loads(_get(other, adopted["key"])[12 : adopted["head"]])["blobs"]:
        runtime.run_sync(store.put(key, _get(other, key)))
    runtime.run_sync(store.put(adopted["key"], _get(other, adopted["key"])))
    root = _root(store)
    root["indexes"][0] = adopted
    _put_root(store, root)
    _refused(
        ours,
        rf"field 'save_id': .* not the manifest's '{root['save_id']}' \(an index object of another save\)",
        adopted["key"],
    )


def test_a_v3_root_without_head_lengths_is_refused(saved):
    store = saved.open()
    root = _root(store)
    del root["indexes"][0]["head"]
    _put_root(store, root)
    with pytest.raises(FormatError, match=r"'indexes\[0\]'"):
        _restore(saved)


def test_a_digest_save_pins_every_frame(store_target_factory):
    target = store_target_factory("memory")
    _save(target, _tree(4), digest="sha256")
    store = target.open()
    ref = _root(store)["indexes"][0]
    doc = json.loads(_get(store, ref["key"])[12 : ref["head"]])
    assert all(len(f) == 8 and len(f[7]) == 64 for f in doc["frames"])
    assert all(p.sha256 for leaf in full_manifest(store).leaves for p in leaf.pieces)


@pytest.mark.parametrize("whole_below", [0, 1 << 20])
def test_an_object_longer_than_the_root_says_is_refused(saved, monkeypatch, whole_below):
    """Bytes after the last frame: read one byte past the declared size, with the last frame or whole."""
    monkeypatch.setattr("objckpt.layouts.index3_io.WHOLE_BELOW", whole_below)
    store = saved.open()
    ref = _root(store)["indexes"][0]
    runtime.run_sync(store.put(ref["key"], _get(store, ref["key"]) + b"\0"))
    _refused(saved, f"index object {ref['key']} is longer than the {ref['size']} bytes the manifest says", ref["key"])


# ----------------------------------------------------------------------------- the codec alone


def _codec_manifest(data: bytes, head: int, leaves, digest: str | None = None):
    from objckpt.core.format import IndexRef, LeafEntry, Manifest
    from objckpt.core.format.index import index_key

    save_id = "5" * 32
    sha = None if digest is None else __import__("hashlib").sha256(data[:head]).hexdigest()
    ref = IndexRef(index_key(save_id, 0), len(data), crc32c(data[:head]), 2, 2 << 20, sha, head)
    entries = tuple(LeafEntry(f"['l{i}']", "array", "float32", shape) for i, shape in enumerate(leaves))
    tree = {"t": "list", "c": [{"t": "leaf", "i": i} for i in range(len(leaves))]}
    return Manifest(save_id, "now", tree, entries, (), version=3, indexes=(ref,), shared_save_id=True)


@pytest.mark.parametrize("digest", [None, "sha256"])
def test_rows_of_every_rank_round_trip_and_a_long_leaf_spans_frames(digest, monkeypatch):
    from objckpt.core.format.index3 import parse_head
    from objckpt.core.format.index3_encode import index3_encode
    from objckpt.core.format.index3_frames import parse_index3
    from objckpt.core.pieces import Piece

    shapes = [(), (64,), (600, 4, 2), (8, 8)]
    blobs = {"aa/x-p0-000000.blob": 1 << 20, "bb/x-p0-000001.blob": 1 << 20}
    sha = "ab" * 32 if digest else None
    records = [(0, Piece((), (), "aa/x-p0-000000.blob", 0, 4, 7, sha))]
    records += [(1, Piece((i * 8,), (i * 8 + 8,), "bb/x-p0-000001.blob", 64 * i, 32, i, sha)) for i in range(8)]
    records += [
        (2, Piece((i, 0, 0), (i + 1, 4, 2), "aa/x-p0-000000.blob", 64 + 64 * i, 32, i, sha)) for i in range(600)
    ]
    records += [(3, Piece((0, 0), (8, 8), "bb/x-p0-000001.blob", 4096, 256, 9, sha))]
    encoded = index3_encode("5" * 32, 0, records[::-1], blobs, digest=digest is not None, frame_target=4096)
    monkeypatch.setattr(ix_bounds, "FRAME_FLOOR", 2048)  # readers allow frames of 4 KiB
    manifest = _codec_manifest(encoded.data, encoded.head, shapes, digest)
    head = parse_head(encoded.data, manifest, 0)
    assert len(head.frames) >= 5 and [f for f in head.frames if f.first == f.last == 2][1:]  # leaf 2 spans frames
    assert head.frames_for([0]) == [0] and head.frames_for([3]) == [len(head.frames) - 1]
    assert len(head.frames_for([2])) >= 3
    doc = parse_index3(encoded.data, manifest, 0)
    assert {leaf: sorted(ps) for leaf, ps in doc.pieces.items()} == {
        leaf: sorted(p for i, p in records if i == leaf) for leaf in range(4)
    }
    part = parse_index3(encoded.data, manifest, 0, leaves={1, 3})
    assert sorted(part.pieces) == [1, 3] and len(part.pieces[1]) == 8
    assert head.frames[0].first == 0 and head.frames[0].last == 2  # a list that repeats a leaf: still that leaf
    assert sorted(parse_index3(encoded.data, manifest, 0, leaves=[0, 0, 0]).pieces) == [0]
