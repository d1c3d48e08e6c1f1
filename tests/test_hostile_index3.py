"""Hostile version 3 index objects that are small but inflate to what a reader cannot hold (issue 66).

zlib shrinks rows that repeat about 1,000:1, so a few hundred kilobytes of index object are
tens of millions of rows. A reader bounds what an index object can make it decompress, hold
and do by what the checkpoint can hold (docs/FORMAT.md, "Index object, version 3"): the
frames of an object inflate to at most ``OBJECT_RAW_LIMIT`` (and ``RAW_PER_LEAF`` a leaf);
no two rows of a leaf name one box; the rows of a leaf cover no more than its elements, summed
from frame to frame; and an object has no more frames than its items and raw bytes allow.
Each crafted object is written as an attacker with write access would: over a real save's
index object, pinned again in the root. The large ones run restore, verify and cp in a child
process under an address-space cap, which must each end in an objckpt error within 5 CPU-s
and 1 GiB of resident memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assemble_index3

import objckpt
from objckpt.core.checksum import crc32c
from objckpt.core.format import MANIFEST_KEY
from objckpt.core.format import index3 as ix
from objckpt.core.format import index3_bounds as bounds
from objckpt.core.format.index import index_key
from objckpt.errors import FormatError
from objckpt.transfer import runtime

ROOT = str(Path(objckpt.__file__).resolve().parents[1])
SIZE = 64  # elements of the saved leaf
ROW = ix.ROW_FIXED + 16  # raw bytes of a rank-1 row
FULL = ix.FRAME_LIMIT // ROW  # rank-1 rows in a frame at the frame limit (466,033)
ROWS = bounds.ROW_FLOOR  # the rows a read of a one-leaf, one-process root takes in, past one per leaf and blob


def _planar(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a.view(np.uint8).reshape(len(a), a.itemsize).T).tobytes()


def _raw(starts: np.ndarray, stops: np.ndarray, leaf: np.ndarray | None = None, offset: Any = 0) -> bytes:
    """A frame's raw bytes: rank-1 rows of blob 0 at ``offset`` (0), crc32c 0, boxes ``starts..stops``."""
    n = len(starts)
    leaf = np.zeros(n, np.int64) if leaf is None else leaf
    delta = np.diff(leaf, prepend=leaf[0]).astype("<i4")
    coords = np.stack([starts.astype("<i8"), stops.astype("<i8")], 1).reshape(-1)
    zeros = np.zeros(n, "<u4")
    offsets = np.broadcast_to(np.asarray(offset, "<u8"), (n,)).copy()
    return _planar(delta) + _planar(zeros) + _planar(offsets) + zeros.tobytes() + _planar(coords)


def _assemble(doc: dict, frames: list[tuple[int, int, int, bytes]]) -> tuple[bytes, int]:
    """A version 3 object of ``frames`` (first leaf, last leaf, rows, raw bytes) with ``doc``'s
    save_id, process and blobs; its bytes and head length."""
    head_doc = {k: doc[k] for k in ("format", "version", "save_id", "process", "blobs")}
    return assemble_index3(head_doc, [(a, b, n, raw, len(raw)) for a, b, n, raw in frames], level=9)


def _root(store) -> dict:
    return json.loads(bytes(runtime.run_sync(store.get(MANIFEST_KEY))))


def _head(store) -> dict:
    ref = _root(store)["indexes"][0]
    return json.loads(bytes(runtime.run_sync(store.get(ref["key"])))[12 : ref["head"]])


def _replace(
    store, frames: list[tuple[int, int, int, bytes]], shape: list[int] | None = None, blob_size: int | None = None
) -> str:
    """Index object 0 replaced by ``frames`` and pinned in the root (and leaf 0's shape set to
    ``shape``, its blob's size declared ``blob_size``), as an attacker who can write the checkpoint
    would. Its key."""
    root = _root(store)
    ref = root["indexes"][0]
    doc = _head(store)
    if blob_size is not None:
        doc["blobs"][0][1] = ref["blob_bytes"] = blob_size
    data, head = _assemble(doc, frames)
    runtime.run_sync(store.put(ref["key"], data))
    ref.update(size=len(data), head=head, crc32c=crc32c(data[:head]))
    if shape is not None:
        root["leaves"][0]["shape"] = shape
    runtime.run_sync(store.delete(MANIFEST_KEY))
    runtime.run_sync(store.put(MANIFEST_KEY, json.dumps(root).encode(), mode="create"))
    return ref["key"]


def _save(target, tree: dict) -> None:
    objckpt.save(target.url, tree, storage_options=target.storage_options)


# ----------------------------------------------------------------------------- in a capped child

_CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import objckpt
src, dst, so, which = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4].split(",")
runs = {
    "restore": lambda: objckpt.restore(src, storage_options=so),
    "verify": lambda: objckpt.verify(src, storage_options=so),
    "cp": lambda: objckpt.copy(src, dst, src_storage_options=so, dst_storage_options=so),
}
out = {}
for name in which:
    run = runs[name]
    started = time.process_time()
    try:
        run()
        error = "none"
    except BaseException as e:
        error = f"{type(e).__module__}.{type(e).__name__}: {e}"[:600]
    out[name] = [error, time.process_time() - started]
# the peak of this process's own memory (VmHWM): ru_maxrss would also count the test process's
# pages, which a child started by vfork carries into its maximum until it execs
out["rss"] = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) * 1024
print(json.dumps(out))
"""


def _in_capped_child(src, dst, runs: str = "restore,verify,cp") -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "OBJCKPT_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore", PYTHONPATH=ROOT)
    argv = [sys.executable, "-c", _CHILD, src.url, dst.url, json.dumps(src.storage_options), runs]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_bounded(result: dict[str, Any], key: str, pattern: str, runs: str = "restore,verify,cp") -> None:
    """Restore, verify and cp (``runs``) each ended in an objckpt error naming ``key`` and matching
    ``pattern``, within 5 CPU-s; the child stayed under 1 GiB resident."""
    import re

    for name in runs.split(","):
        error, cpu = result[name]
        assert error.startswith("objckpt.errors."), (name, error)
        assert key in error and re.search(pattern, error), (name, error)
        assert cpu < 5.0, (name, cpu, error)
    assert result["rss"] < 1 << 30, result


@pytest.mark.parametrize(
    ("frames", "pattern"),
    [
        # the objects: a few hundred kilobytes of identical rows at the frame limit
        (20, r"'frames\[4\]': the frames up to this one inflate to \d+ bytes, over the \d+"),
        (100, r"'frames\[4\]': the frames up to this one inflate to \d+ bytes, over the \d+"),
        # within that bound: refused at its head, whose 1.4 million rows are past what the root allows
        (3, rf"its rows and those of the index objects read before it number 1398099, over the {ROWS + 2}"),
    ],
)
def test_a_small_object_of_repeated_rows_ends_in_an_error_within_bounds(store_target_factory, frames, pattern):
    src, dst = store_target_factory("s3"), store_target_factory("s3")
    _save(src, {"w": np.arange(SIZE, dtype=np.float32)})
    raw = _raw(np.zeros(FULL, np.int64), np.full(FULL, SIZE, np.int64))
    key = _replace(src.open(), [(0, 0, FULL, raw)] * frames)
    _assert_bounded(_in_capped_child(src, dst), key, pattern)
    assert not runtime.run_sync(dst.open().list())


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        # one element a row, every other element: the rows cover half the leaf
        (
            "holes",
            rf"\['w'\]\)?:? (pieces of all index objects: pieces cover {ROWS // 2} elements of {ROWS}|do not tile .*) \(holes",
        ),
        # one element a row, the whole leaf, every row on the blob's first 4 bytes
        ("shared bytes", r"-p0-000000\.blob: pieces at bytes \[0, 4\) and \[0, 4\) overlap"),
        # one element a row, the whole leaf, in a blob declared 128 KB that holds 256 bytes: cp builds
        # no piece of a blob its source does not hold (streamed: read short; server-side: listed short)
        ("short blob", rf"(short blob \S+: 256 bytes, the manifest says|its index object declares) {4 * ROWS}"),
    ],
)
def test_verify_and_cp_of_an_object_of_distinct_rows_end_in_an_error_within_bounds(store_target_factory, case, pattern):
    """Issue 77 item 17: 32,768 distinct rows (the most a read of a leaf saved by one process takes
    in, past the root's allowance) are read as columns (boxes as arrays): verify and cp check the
    tiling in columns and the blob bytes per index object, and build pieces blob by blob."""
    src, dst = store_target_factory("s3"), store_target_factory("s3")
    _save(src, {"w": np.arange(SIZE, dtype=np.float32)})
    step, n = (2, ROWS // 2) if case == "holes" else (1, ROWS)
    rows = np.arange(n)
    frame = _raw(rows * step, rows * step + 1, offset=0 if case == "shared bytes" else 4 * rows)
    key = _replace(src.open(), [(0, 0, n, frame)], shape=[ROWS], blob_size=4 * ROWS)
    runs = {"holes": "restore,verify,cp", "shared bytes": "verify,cp", "short blob": "cp"}[case]
    named = {"holes": "['w']", "shared bytes": key, "short blob": str(4 * ROWS)}[case]
    _assert_bounded(_in_capped_child(src, dst, runs), named, pattern, runs)
    assert not runtime.run_sync(dst.open().list())


@pytest.mark.parametrize(("objects", "leaves", "frames"), [(1, 1, 4), (6, 1, 4), (1, 64_000, 16)])
def test_index_objects_of_more_rows_than_the_root_allows_end_in_an_error_within_bounds(
    store_target_factory, objects, leaves, frames
):
    """Issue 77 item 17: each object ~100 KB of distinct one-element rows (466,033 a frame) of leaf 0,
    together tiling it, in blobs declared to hold them; with 64,000 declared leaves one object may
    inflate to 256 MiB more (7.46 million rows in ~450 KB). A read draws every head's row count from
    one budget (one row per leaf and device, one per blob and MiB of blobs, and 32,768) before it inflates a frame:
    restore, verify and cp end at the first head past it, whatever the number of objects."""
    src, dst = store_target_factory("s3"), store_target_factory("s3")
    _save(src, {"w": np.arange(SIZE, dtype=np.float32)})
    store, root, head = src.open(), _root(src.open()), _head(src.open())
    per, refs = frames * FULL, []
    for p in range(objects):
        rows = [np.arange(FULL) + k * FULL for k in range(frames)]
        blob = head["blobs"][0][0].replace("-p0-", f"-p{p}-")
        doc = {**head, "process": p, "blobs": [[blob, 4 * per]]}
        data, length = _assemble(doc, [(0, 0, FULL, _raw(r + p * per, r + p * per + 1, offset=4 * r)) for r in rows])
        key = index_key(root["save_id"], p)
        runtime.run_sync(store.put(key, data))
        refs.append(
            {
                **root["indexes"][0],
                "key": key,
                "size": len(data),
                "head": length,
                "crc32c": crc32c(data[:length]),
                "blob_bytes": 4 * per,
            }
        )
    root["leaves"][0].pop("layout", None)
    root["leaves"][0]["shape"] = [objects * per]
    root["leaves"] += [{**root["leaves"][0], "path": f"['x{i}']", "shape": [4]} for i in range(1, leaves)]
    root["tree"] = {
        "t": "dict",
        "k": [f"x{i}" for i in range(leaves)],
        "c": [{"t": "leaf", "i": i} for i in range(leaves)],
    }
    root.update(indexes=refs, num_processes=objects)
    runtime.run_sync(store.delete(MANIFEST_KEY))
    runtime.run_sync(store.put(MANIFEST_KEY, json.dumps(root).encode(), mode="create"))
    limit = leaves * objects + objects * (1 + 4 * per // bounds.CUT_BYTES) + ROWS
    pattern = rf"-p\d+\.index: its rows and those of the index objects read before it number \d+, over the {limit}"
    _assert_bounded(_in_capped_child(src, dst), ".index", pattern)
    assert not runtime.run_sync(dst.open().list())


# ----------------------------------------------------------------------------- each bound


@pytest.fixture
def saved(store_target_factory):
    target = store_target_factory("memory")
    _save(target, {"w": np.arange(SIZE, dtype=np.float32)})
    return target


def _refused(target, pattern: str) -> None:
    with pytest.raises(FormatError, match=pattern):
        objckpt.restore(target.url)
    with pytest.raises(FormatError, match=pattern):
        objckpt.verify(target.url)


def test_two_rows_of_a_frame_naming_one_box_are_refused_at_that_frame(saved):
    """Rows 3 and 7 name one box of a leaf of 64 elements whose other boxes leave room: the
    frame names both rows, before any row is planned."""
    starts = np.array([0, 8, 16, 24, 32, 40, 48, 24])
    key = _replace(saved.open(), [(0, 0, 8, _raw(starts, starts + 8))])
    _refused(saved, rf"{key} frame 0 .*: rows 3 and 7 both name leaf 0's box \(24,\)-\(32,\)")


def test_a_leaf_covered_twice_across_frames_is_refused_at_the_frame_that_repeats(saved):
    """Each frame alone tiles a leaf of 4,096 elements, one row an element; the second one's
    rows take the leaf past its elements."""
    starts = np.arange(4096)
    frame = (0, 0, len(starts), _raw(starts, starts + 1))
    key = _replace(saved.open(), [frame, frame, frame], shape=[4096])
    _refused(saved, rf"{key} frame 1 .*: the rows of leaf 0 cover more than its 4096 elements")


def test_many_small_frames_of_one_item_are_refused_at_the_head(saved):
    """One row a frame, 4,000 frames of one leaf (a valid tiling): far more frames than one item
    and 140 KiB of rows allow."""
    n = 4000
    frames = [(0, 0, 1, _raw(np.array([i]), np.array([i + 1]))) for i in range(n)]
    key = _replace(saved.open(), frames, shape=[n])
    _refused(saved, rf"{key} field 'frames': {n} frames of {n * ROW} raw bytes in all, over the \d+ allowed")


def test_small_frames_one_per_item_still_restore(store_target_factory):
    """Writers cut a frame at each item: a flat tree of many small leaves is as many frames,
    which a reader allows (one per item)."""
    target = store_target_factory("memory")
    tree = {f"x{i:03d}": np.full(4, i, np.int32) for i in range(300)}
    _save(target, tree)
    assert len(_head(target.open())["frames"]) == 300
    out = objckpt.restore(target.url)
    for name, value in tree.items():
        np.testing.assert_array_equal(np.asarray(out[name]), value)
    assert objckpt.verify(target.url).ok


def test_a_crafted_frame_is_refused_on_its_first_read(saved):
    """Its bytes match the checksums the head pins, so a second read would find the same bytes:
    the crafted frame is refused once, not re-read as a frame changed in flight is."""
    starts = np.array([0, 0])
    key = _replace(saved.open(), [(0, 0, 2, _raw(starts, starts + SIZE))])
    stats = objckpt.TransferStats()
    with pytest.raises(FormatError, match=rf"{key} frame 0 .*: rows 0 and 1 both name leaf 0's box") as caught:
        objckpt.restore(saved.url, stats=stats)
    assert stats.checksum_retries == 0 and "the same over" not in str(caught.value)


def test_a_leaf_two_index_objects_both_tile_is_refused_when_the_second_is_read(saved):
    """A second process's index object lists the whole leaf again (its own copy of the blob):
    the leaf's rows of the two objects cover twice its elements, refused as the second object's
    rows are added, before any piece is planned."""
    from objckpt.core.format.index import index_key

    store = saved.open()
    root, head = _root(store), _head(store)
    ref = root["indexes"][0]
    data = bytes(runtime.run_sync(store.get(ref["key"])))
    raw = zlib.decompress(data[ref["head"] :])
    ((blob, size),) = head["blobs"]
    copy = blob.replace("-p0-", "-p1-")
    runtime.run_sync(store.put(copy, bytes(runtime.run_sync(store.get(blob)))))
    second, length = _assemble({**head, "process": 1, "blobs": [[copy, size]]}, [(0, 0, 1, raw)])
    key = index_key(root["save_id"], 1)
    runtime.run_sync(store.put(key, second))
    entry = {"key": key, "size": len(second), "crc32c": crc32c(second[:length]), "blobs": 1, "blob_bytes": size}
    root["indexes"].append({**entry, "head": length})
    root["num_processes"] = 2
    root["leaves"][0]["layout"] = {"processes": [0, 1]}
    runtime.run_sync(store.delete(MANIFEST_KEY))
    runtime.run_sync(store.put(MANIFEST_KEY, json.dumps(root).encode(), mode="create"))
    _refused(
        saved,
        r"index object \S+-p[01]\.index: the rows of leaf 0 \(\['w'\]\) in this and the index objects read "
        rf"before it cover more than its {SIZE} elements",
    )


def test_rows_that_add_up_but_overlap_are_refused_by_verify_and_cp(saved, store_target_factory):
    """Boxes [0, 40) and [30, 54) of a leaf of 64 elements: their volumes add up to its elements
    and their bytes share none of the blob's, but they overlap (and leave [54, 64) a hole): the
    columnar grid test finds the leaf, and the piece-by-piece check names both boxes."""
    starts, stops = np.array([0, 30]), np.array([40, 54])
    _replace(saved.open(), [(0, 0, 2, _raw(starts, stops, offset=np.array([0, 160])))])
    pattern = r"\['w'\]\): pieces of all index objects: boxes \(0,\)-\(40,\) and \(30,\)-\(54,\) overlap"
    with pytest.raises(FormatError, match=pattern):
        objckpt.verify(saved.url)
    with pytest.raises(FormatError, match=pattern):
        objckpt.copy(saved.url, store_target_factory("memory").url)


def test_verify_of_a_short_blob_builds_no_piece_past_its_end(store_target_factory, monkeypatch):
    """Issue 77 item 17: a blob declared 8 MB holds 320, and 32,768 distinct rows of one element
    lie in it: verify reports it short with every cut-off piece counted and named by leaf, and builds
    pieces only for the rows inside the bytes the store lists (two here)."""
    from objckpt.core.format.rows import Rows

    src = store_target_factory("s3")
    _save(src, {"w": np.arange(SIZE, dtype=np.float32)})
    rows = np.arange(ROWS)
    _replace(src.open(), [(0, 0, ROWS, _raw(rows, rows + 1, offset=256 * rows))], shape=[ROWS], blob_size=256 * ROWS)
    built = []
    pieces = Rows.pieces
    monkeypatch.setattr(Rows, "pieces", lambda self, at: built.append(len(at)) or pieces(self, at))
    problems = objckpt.verify(src.url, storage_options=src.storage_options).problems
    (short,) = [p for p in problems if p.kind == "short"]  # the two rows inside its 320 bytes: checksums
    assert f"320 bytes, the manifest says {256 * ROWS} ({ROWS - 2} piece(s) of ['w'] cut off)" in short.message
    assert sum(built) == 2, built
