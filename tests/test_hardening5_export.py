"""Issue 77 (hardening 5), items 1, 2, 3 and 28: safetensors exports over earlier exports.

An overwrite leaves no file of the old export a loader could take (objckpt's restore reads the
index first; Hugging Face loaders take ``model.safetensors`` first, see :func:`_hf_load`); an
overwrite cut off midway leaves nothing any reader accepts; every ``part=(k, n)`` refuses an
existing export without ``overwrite=True``; the source's and the destination's store options
have one spelling (``src_storage_options`` / ``dst_storage_options``) and the source's reach only
a destination of the same kind of store. Exports go to local disk and to S3 (SeaweedFS).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import objckpt
from objckpt.errors import ObjectExistsError, StorageOptionError
from objckpt.transfer import runtime
from objckpt.transfer.engine import TransferEngine

safetensors_numpy = pytest.importorskip(
    "safetensors.numpy", reason="the safetensors library (pyproject's dev extra) reads what export writes"
)

#: Six float32 tensors of 1 KiB: max_shard_bytes 1024 → 6 files, 2048 → 3, 4096 → 2, default → 1.
NAMES = [f"w{i}" for i in range(6)]


def _state(fill: float) -> dict[str, np.ndarray]:
    return {name: np.full((256,), fill + i, np.float32) for i, name in enumerate(NAMES)}


def _files(target: Any) -> dict[str, bytes]:
    """Every object under the export's root, by key, read through objckpt's store."""
    store = target.open()
    try:
        return {info.key: runtime.run_sync(store.get(info.key)) for info in runtime.run_sync(store.list(""))}
    finally:
        runtime.run_sync(store.close())


def _hf_load(files: dict[str, bytes]) -> dict[str, np.ndarray]:
    """What a Hugging Face loader takes from a directory: ``model.safetensors`` when it is there,
    else the files the index names; nothing else is an export."""
    if "model.safetensors" in files:
        return dict(safetensors_numpy.load(files["model.safetensors"]))
    if "model.safetensors.index.json" not in files:
        raise FileNotFoundError("neither model.safetensors nor model.safetensors.index.json")
    weight_map = json.loads(files["model.safetensors.index.json"])["weight_map"]
    out: dict[str, np.ndarray] = {}
    for name in sorted(set(weight_map.values())):
        out.update(safetensors_numpy.load(files[name]))
    assert sorted(out) == sorted(weight_map)
    return out


def _same(got: dict[str, Any], want: dict[str, np.ndarray]) -> bool:
    return sorted(got) == sorted(want) and all(np.array_equal(np.asarray(got[k]), want[k]) for k in want)


def _export(src: Any, dst: Any, **kwargs: Any) -> objckpt.ExportStats:
    return objckpt.export_safetensors(
        src.url, dst.url, src_storage_options=src.storage_options, dst_storage_options=dst.storage_options, **kwargs
    )


@pytest.fixture(params=["local", "s3"])
def stores(request: pytest.FixtureRequest, store_target_factory: Any) -> tuple[Any, Any, Any]:
    """Checkpoints A and B (same names, dtypes, shapes; other values) and an empty destination."""
    a, b, dst = (store_target_factory(request.param) for _ in range(3))
    objckpt.save(a.url, _state(0.0), storage_options=a.storage_options)
    objckpt.save(b.url, _state(100.0), storage_options=b.storage_options)
    return a, b, dst


@pytest.mark.parametrize(
    ("old_max", "new_max", "new_files"),
    [
        (2048, None, ["model.safetensors"]),  # sharded → one file
        (None, 2048, [*(f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)), "model.safetensors.index.json"]),
        (1024, 4096, [*(f"model-0000{k}-of-00002.safetensors" for k in (1, 2)), "model.safetensors.index.json"]),
    ],
    ids=["sharded-to-single", "single-to-sharded", "6-files-to-2"],
)
def test_an_overwrite_leaves_only_the_new_exports_files(
    stores: tuple[Any, Any, Any], old_max: int | None, new_max: int | None, new_files: list[str]
) -> None:
    """Item 1: after ``overwrite=True`` the destination holds the new export's files and no
    other, so objckpt's restore and a Hugging Face loader both get the new weights."""
    a, b, dst = stores
    _export(a, dst, **({"max_shard_bytes": old_max} if old_max else {}))
    stats = _export(b, dst, overwrite=True, **({"max_shard_bytes": new_max} if new_max else {}))
    files = _files(dst)
    assert sorted(files) == sorted(new_files) == sorted(stats.files)
    assert _same(_hf_load(files), _state(100.0))
    assert _same(objckpt.restore(dst.url, storage_options=dst.storage_options), _state(100.0))


def test_overwriting_parts_make_one_clean_export(stores: tuple[Any, Any, Any]) -> None:
    """Item 1 with ``part=``: every part clears the old export's entry points before it writes;
    the part writing the index removes the old files the new export does not name."""
    a, b, dst = stores
    _export(a, dst, max_shard_bytes=1024)  # 6 files
    for k in (1, 0):  # the part writing the index goes last
        _export(b, dst, max_shard_bytes=2048, overwrite=True, part=(k, 2))
    files = _files(dst)
    assert sorted(files) == [
        *(f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)),
        "model.safetensors.index.json",
    ]
    assert _same(_hf_load(files), _state(100.0))
    assert _same(objckpt.restore(dst.url, storage_options=dst.storage_options), _state(100.0))


@pytest.mark.parametrize(("old_max", "new_max"), [(2048, 2048), (2048, 1024), (None, 2048)])
def test_an_overwrite_cut_off_midway_leaves_nothing_a_reader_accepts(
    stores: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch, old_max: int | None, new_max: int
) -> None:
    """Item 2: the second file's write fails (a killed or failed exporter); the destination then
    holds one new file beside old ones of the same tensors, dtypes and shapes, and neither
    objckpt's restore nor a Hugging Face loader takes them for an export. A rerun completes it."""
    a, b, dst = stores
    _export(a, dst, **({"max_shard_bytes": old_max} if old_max else {}))
    real_put, puts = TransferEngine.put, []

    async def failing_put(self: TransferEngine, key: str, *args: Any, **kwargs: Any) -> int:
        puts.append(key)
        if len(puts) == 2:
            raise OSError(f"killed while writing {key}")
        return await real_put(self, key, *args, **kwargs)

    monkeypatch.setattr(TransferEngine, "put", failing_put)
    with pytest.raises(OSError, match="killed while writing"):
        _export(b, dst, overwrite=True, max_shard_bytes=new_max)
    monkeypatch.setattr(TransferEngine, "put", real_put)
    files = _files(dst)
    assert "model-00001-of-" + puts[0].split("-of-")[1] in files  # the new export's first file landed
    with pytest.raises(FileNotFoundError):
        _hf_load(files)
    with pytest.raises(FileNotFoundError):  # CheckpointNotFoundError: no index, no single file
        objckpt.restore(dst.url, storage_options=dst.storage_options)
    _export(b, dst, overwrite=True, max_shard_bytes=new_max)
    assert _same(objckpt.restore(dst.url, storage_options=dst.storage_options), _state(100.0))
    assert _same(_hf_load(_files(dst)), _state(100.0))


@pytest.mark.parametrize("k", [1, 2])
def test_every_part_refuses_an_existing_export(stores: tuple[Any, Any, Any], k: int) -> None:
    """Item 3: ``part=(k, n)`` with k != 0 checks the destination too, before it writes."""
    a, b, dst = stores
    _export(a, dst, max_shard_bytes=2048)
    before = _files(dst)
    with pytest.raises(ObjectExistsError, match="model.safetensors.index.json"):
        _export(b, dst, max_shard_bytes=2048, part=(k, 3))
    assert _files(dst) == before


def test_every_part_refuses_its_own_first_file(store_target_factory: Any) -> None:
    """Item 3: leftovers of an export that never wrote its index: each part refuses a file it would replace."""
    a, b, dst = (store_target_factory("s3") for _ in range(3))
    objckpt.save(a.url, _state(0.0), storage_options=a.storage_options)
    objckpt.save(b.url, _state(100.0), storage_options=b.storage_options)
    _export(a, dst, max_shard_bytes=2048, part=(2, 3))  # file 3 alone, no index
    with pytest.raises(ObjectExistsError, match="model-00003-of-00003"):
        _export(b, dst, max_shard_bytes=2048, part=(2, 3))
    _export(b, dst, max_shard_bytes=2048, part=(1, 3))  # file 2 is not there: this part writes


def test_source_options_reach_only_a_destination_of_the_same_kind(store_target_factory: Any) -> None:
    """Item 28: S3 options given for an S3 source do not reach a local destination (they would
    be refused there as unknown options); a destination in the same store kind takes them."""
    src, local, bucket = store_target_factory("s3"), store_target_factory("local"), store_target_factory("s3")
    objckpt.save(src.url, _state(0.0), storage_options=src.storage_options)
    objckpt.export_safetensors(src.url, local.url, src_storage_options=src.storage_options)
    assert _same(_hf_load(_files(local)), _state(0.0))
    objckpt.export_safetensors(src.url, bucket.url, src_storage_options=src.storage_options)
    assert _same(_hf_load(_files(bucket)), _state(0.0))
    with pytest.raises(StorageOptionError):  # options the caller gives for the destination are its own
        objckpt.export_safetensors(
            src.url, local.url, src_storage_options=src.storage_options,
            dst_storage_options=src.storage_options, overwrite=True,
        )  # fmt: skip


def test_the_old_spelling_warns_naming_the_new_one(store_target_factory: Any) -> None:
    """Item 28: ``storage_options=`` and ``dest_storage_options=`` work one more release, with a
    DeprecationWarning naming ``src_storage_options`` / ``dst_storage_options``, and the source's
    options no longer reach a local destination; both spellings at once is an error."""
    src, local, gcs = store_target_factory("s3"), store_target_factory("local"), store_target_factory("gcs")
    objckpt.save(src.url, _state(0.0), storage_options=src.storage_options)
    with pytest.warns(DeprecationWarning, match="src_storage_options"):
        objckpt.export_safetensors(src.url, local.url, storage_options=src.storage_options)
    assert _same(_hf_load(_files(local)), _state(0.0))
    with pytest.warns(DeprecationWarning, match="dst_storage_options"):
        objckpt.export_safetensors(
            src.url, gcs.url, src_storage_options=src.storage_options, dest_storage_options=gcs.storage_options
        )
    assert _same(_hf_load(_files(gcs)), _state(0.0))
    with pytest.raises(TypeError, match="src_storage_options"):
        objckpt.export_safetensors(
            src.url, gcs.url, storage_options=src.storage_options, src_storage_options=src.storage_options
        )
