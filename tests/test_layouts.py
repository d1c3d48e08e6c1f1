"""objckpt.layouts: one place decides what a prefix holds, and every operation opens it once.

``open_checkpoint`` on objckpt v1 and v2 (by the root's version), Orbax (its
registered layout), an empty prefix, a hostile root; a third-party layout found by
dotted path and by entry point; restore, inspect and verify read the root manifest once.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import rewrite_as_v1

import objckpt
from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import CheckpointNotFoundError, FormatError
from objckpt.layouts import (
    CheckpointInfo,
    NativeCheckpoint,
    OpenRequest,
    VerifyReport,
    open_checkpoint,
    register_layout,
    registry,
)
from objckpt.options import Options
from objckpt.storage import from_url, register_store
from objckpt.transfer import runtime

TREE = {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "b": np.ones(3, np.int16), "step": 7}


def _open(url: str) -> Any:
    return open_checkpoint(from_url(url), options=Options())


@pytest.mark.parametrize("version", [1, 2, 3])
def test_open_checkpoint_reads_objckpt_by_the_root_version(memory_store: Any, version: int) -> None:
    objckpt.save(memory_store.url, TREE, options=Options(format_version=max(2, version)))
    if version == 1:
        rewrite_as_v1(from_url(memory_store.url))
    reader = _open(memory_store.url)
    assert isinstance(reader, NativeCheckpoint)
    assert (reader.format, reader.version) == ("objckpt", version)
    info = reader.info()
    assert isinstance(info, CheckpointInfo)
    assert info.format_version == version and info.leaves["['w']"].shape == (4, 6)
    whole = runtime.run_sync(reader.read_whole())
    assert sum(len(leaf.pieces) for leaf in whole.leaves) >= 2  # every array leaf's pieces, read
    assert {b.key for b in whole.blobs}


def test_an_empty_prefix_is_not_found_and_says_why(memory_store: Any) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint at .* \(no manifest.json\)"):
        _open(memory_store.url)


def test_a_save_still_running_here_is_named_in_not_found(memory_store: Any) -> None:
    import concurrent.futures

    from objckpt import in_flight

    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    in_flight.track(memory_store.url, future)
    try:
        with pytest.raises(CheckpointNotFoundError, match="save_async to this URL is still running"):
            _open(memory_store.url)
    finally:
        future.set_result(None)
    with pytest.raises(CheckpointNotFoundError) as e:
        _open(memory_store.url)
    assert "still running" not in str(e.value)


def test_a_hostile_root_is_a_format_error_and_no_other_layout_is_asked(memory_store: Any) -> None:
    asked: list[str] = []

    def opener(store: Any, request: OpenRequest) -> None:
        asked.append(request.url)

    register_layout("b1-never-asked", opener)
    try:
        store = from_url(memory_store.url)
        doc = {"format": "objckpt", "version": 2, "leaves": [{"path": "../../etc", "kind": "array"}]}
        runtime.run_sync(store.put(MANIFEST_KEY, json.dumps(doc).encode()))
        with pytest.raises(FormatError, match="manifest"):
            open_checkpoint(store, options=Options())
        runtime.run_sync(store.put(MANIFEST_KEY, b"\x00" * 64, mode="overwrite"))
        with pytest.raises(FormatError):
            open_checkpoint(store, options=Options())
        runtime.run_sync(store.put(MANIFEST_KEY, json.dumps({**doc, "version": 99}).encode(), mode="overwrite"))
        with pytest.raises(FormatError, match="version': 99 is not supported"):
            open_checkpoint(store, options=Options())
    finally:
        registry._registered.pop("b1-never-asked", None)
    assert asked == []


# ----------------------------------------------------------------------------- third-party layouts

_FAKE_LAYOUT = """
from objckpt.layouts.base import CheckpointInfo, VerifyReport

MARK = "fake.layout"


class FakeReader:
    format = "{name}"
    version = 3

    def __init__(self, url):
        self.url = url

    def info(self):
        return CheckpointInfo(self.url, {{}}, {{}}, 0, 0, 0, "then", "", 1, {{}}, format=self.format)

    def restore(self, target, *, partial, options, stats, cast):
        return {{"restored_by": self.format}}

    def verify(self, options, stats, progress):
        return VerifyReport(self.url, format=self.format, arrays=1, checks="looked at it")


def open_fake(store, request):
    from objckpt.transfer import runtime

    try:
        runtime.run_sync(store.head(MARK))
    except FileNotFoundError:
        return None
    return FakeReader(request.url)
"""


def _fake_package(tmp_path: Path, module: str, name: str) -> Path:
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(_FAKE_LAYOUT.format(name=name)))
    return tmp_path


def _marked(memory_store: Any) -> Any:
    store = from_url(memory_store.url)
    runtime.run_sync(store.put("fake.layout", b"x"))
    return store


def test_a_layout_registered_by_dotted_path_is_found_and_imported_only_when_asked(
    memory_store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.syspath_prepend(str(_fake_package(tmp_path, "b1_fake_layout", "fakefmt")))
    register_layout("fakefmt", "b1_fake_layout:open_fake")
    try:
        assert "b1_fake_layout" not in sys.modules  # registered, not imported
        with pytest.raises(ValueError, match="already registered"):
            register_layout("fakefmt", "b1_fake_layout:open_fake")
        with pytest.raises(ValueError, match="package.module:attr"):
            register_layout("other", "no_colon_here")
        store = _marked(memory_store)
        reader = open_checkpoint(store, options=Options())
        assert "b1_fake_layout" in sys.modules
        assert (reader.format, reader.version, reader.url) == ("fakefmt", 3, store.url)
        # and the public operations go through it
        assert objckpt.restore(memory_store.url) == {"restored_by": "fakefmt"}
        report = objckpt.verify(memory_store.url)
        assert isinstance(report, VerifyReport) and report.ok
        assert "Fakefmt checkpoint, 1 arrays (looked at it)" in report.summary()
        assert "Fakefmt checkpoint" in str(objckpt.inspect(memory_store.url))
    finally:
        registry._registered.pop("fakefmt", None)
        registry._loaded.pop("fakefmt", None)


def test_a_layout_from_an_entry_point_is_found(
    memory_store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = _fake_package(tmp_path, "b1_ep_layout", "epfmt")
    dist = site / "b1_ep_layout-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: b1-ep-layout\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[objckpt.layouts]\nepfmt = b1_ep_layout:open_fake\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        assert "epfmt" in registry.known_layouts()
        reader = open_checkpoint(_marked(memory_store), options=Options())
        assert reader.format == "epfmt"
    finally:
        registry._loaded.pop("epfmt", None)


def test_a_layout_whose_module_is_missing_is_skipped(memory_store: Any, caplog: pytest.LogCaptureFixture) -> None:
    register_layout("gone", "b1_no_such_module_anywhere:open")
    try:
        for _ in range(2):
            with pytest.raises(CheckpointNotFoundError):
                _open(memory_store.url)
        assert caplog.text.count("layout 'gone' is not available") == 1
    finally:
        registry._registered.pop("gone", None)


# ----------------------------------------------------------------------------- decided once


class _RootReads:
    """A store scheme (through ``register_store``, the public seam) that counts reads of the root manifest."""

    count = 0

    @classmethod
    def factory(cls, url: str, **options: Any) -> Any:
        store = from_url(url.replace("b1count://", "memory://"), **options)
        get_range = store.get_range

        async def counted(key: str, *, start: int, end: int) -> bytes:
            if key == MANIFEST_KEY:
                cls.count += 1
            return await get_range(key, start=start, end=end)

        store.get_range = counted
        return store


@pytest.mark.parametrize("version", [1, 2])
def test_restore_inspect_and_verify_read_the_root_once(memory_store: Any, version: int) -> None:
    objckpt.save(memory_store.url, TREE)
    if version == 1:
        rewrite_as_v1(from_url(memory_store.url))
    register_store("b1count", _RootReads.factory)
    url = memory_store.url.replace("memory://", "b1count://")
    for operation in (objckpt.restore, objckpt.inspect, objckpt.verify):
        _RootReads.count = 0
        result = operation(url)
        assert _RootReads.count == 1, (operation.__name__, _RootReads.count)
        if operation is objckpt.restore:
            np.testing.assert_array_equal(result["w"], TREE["w"])


# ----------------------------------------------------------------------------- pieces read on demand


def _split_across_two_index_objects(url: str) -> None:
    """Rewrite a one-process v2 or v3 checkpoint as two index objects, leaf ``b``'s pieces in the second,
    while every leaf's layout says process 0 wrote it: the reader's choice of index objects misses ``b``."""
    import dataclasses

    from helpers import full_manifest

    from objckpt.core.checksum import crc32c
    from objckpt.core.format import ARRAY_KINDS, IndexRef, manifest_to_json
    from objckpt.core.format.index import index_key, index_to_json
    from objckpt.core.format.index3_encode import index3_encode

    store = from_url(url)
    whole = full_manifest(store)
    b = next(i for i, leaf in enumerate(whole.leaves) if leaf.path == "['b']")
    sizes = {blob.key: blob.size for blob in whole.blobs}
    split = [
        [(i, p) for i, leaf in enumerate(whole.leaves) if i != b for p in leaf.pieces],
        [(b, p) for p in whole.leaves[b].pieces],
    ]
    refs = []
    for process, records in enumerate(split):
        blobs = {p.blob: sizes[p.blob] for _, p in records}
        key = index_key(whole.save_id, process)
        if whole.version >= 3:
            encoded = index3_encode(whole.save_id, process, records, blobs)
            data, head = encoded.data, encoded.head
        else:
            data, head = index_to_json(whole.save_id, process, records, blobs), 0
        runtime.run_sync(store.put(key, data, mode="overwrite"))
        pinned = data[:head] if head else data
        refs.append(IndexRef(key, len(data), crc32c(pinned), len(blobs), sum(blobs.values()), None, head))
    leaves = tuple(
        dataclasses.replace(leaf, pieces=(), writers={"processes": [0]} if leaf.kind in ARRAY_KINDS else None)
        for leaf in whole.leaves
    )
    root = dataclasses.replace(whole, leaves=leaves, blobs=(), num_processes=2, indexes=tuple(refs), loaded=frozenset())
    runtime.run_sync(store.put(MANIFEST_KEY, manifest_to_json(root), mode="overwrite"))


@pytest.mark.parametrize("version", [2, 3])
def test_pieces_the_chosen_index_objects_miss_are_read_from_every_index_object(
    memory_store: Any, caplog: pytest.LogCaptureFixture, version: int
) -> None:
    objckpt.save(memory_store.url, TREE, options=Options(format_version=version))
    _split_across_two_index_objects(memory_store.url)
    reader = _open(memory_store.url)
    assert isinstance(reader, NativeCheckpoint) and reader.pieces_on_demand
    index = {leaf.path: i for i, leaf in enumerate(reader.manifest.leaves)}
    boxes = {index["['b']"]: [((0,), (3,))], index["['w']"]: [((0, 0), (4, 6))]}
    needed = runtime.run_sync(reader.read_needed(boxes))
    assert needed.loaded == {0}  # the layouts name process 0 only
    assert not needed.leaves[index["['b']"]].pieces and needed.leaves[index["['w']"]].pieces
    every = runtime.run_sync(reader.read_every_index())
    assert every.loaded == {0, 1} and all(leaf.pieces for leaf in every.leaves if leaf.shape)

    restored = objckpt.restore(memory_store.url)  # reads process 0's, finds ['b'] uncovered, reads all
    assert "do not cover leaf ['b']" in caplog.text
    np.testing.assert_array_equal(restored["b"], TREE["b"])
    np.testing.assert_array_equal(restored["w"], TREE["w"])
    assert objckpt.verify(memory_store.url).ok  # the whole read takes both index objects
