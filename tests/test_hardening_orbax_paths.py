"""Orbax checkpoints whose paths, sizes or counts are hostile (issue 66, items 10 and 11).

An Orbax checkpoint names paths in its own files (its step's items, its arrays'
parameter names) and, on local disk, may hold symbolic links; it also declares
sizes and counts. Each case here is a checkpoint Orbax wrote, or a hand-written
item directory like ``tests/test_hardening_orbax.py``'s, altered the way a
hostile one would be: every one ends in a :class:`~objckpt.errors.FormatError`
naming the path at fault, nothing outside the checkpoint is read, and files are
sized before they are read. The cases that could exhaust memory before the
fix run in a child process under an address-space limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import upload_dir

import objckpt
from objckpt.errors import FormatError

ocp = pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tensorstore")

HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
JSON_HANDLER = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
GRAIN_HANDLER = "grain._src.python.checkpoint_handlers.CheckpointHandler"
HEADER = {
    "chunks": [4],
    "compressor": None,
    "dimension_separator": ".",
    "dtype": "<f4",
    "fill_value": None,
    "filters": None,
    "order": "C",
    "shape": [4],
    "zarr_format": 2,
}


def _item(path: Path, key: str = "x", values: np.ndarray | None = None) -> Path:
    """An Orbax item (no OCDBT, zarr v2) with one leaf named ``key`` and, when given, its data in ``x/``."""
    path.mkdir(parents=True)
    entry = {"key_metadata": [{"key": key, "key_type": 2}], "value_metadata": {"value_type": "np.ndarray"}}
    meta = {"tree_metadata": {f"('{key}',)": entry}, "use_ocdbt": False, "use_zarr3": False}
    (path / "_METADATA").write_text(json.dumps(meta))
    if values is not None:
        _array(path / "x", values)
    return path


def _array(path: Path, values: np.ndarray) -> None:
    path.mkdir(parents=True)
    (path / ".zarray").write_text(json.dumps(HEADER))
    (path / "0").write_bytes(values.astype("<f4").tobytes())


def _step(path: Path, items: dict[str, str]) -> Path:
    """A manager step directory whose ``_CHECKPOINT_METADATA`` names ``items`` (name → handler)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "_CHECKPOINT_METADATA").write_text(json.dumps({"item_handlers": items}))
    return path


def _save_step(root: Path, values: np.ndarray, **items: Any) -> Path:
    """Step 1 of an Orbax ``CheckpointManager`` at ``root``: ``default`` (``values``), or a Composite of ``items``."""
    with ocp.CheckpointManager(root, item_names=tuple(items) or None) as manager:
        if items:
            manager.save(1, args=ocp.args.Composite(**items))
        else:
            manager.save(1, args=ocp.args.StandardSave({"w": values}))
        manager.wait_until_finished()
    return root / "1"


# ------------------------------------------------------------------ item 10: array names leading out


@pytest.mark.parametrize("name", ["../outside", "/ABS/outside", "a/../../outside", "..\\outside", "a//x", "."])
def test_an_array_name_leading_out_of_the_item_is_a_format_error(tmp_path: Path, name: str) -> None:
    """A parameter name that tensorstore would take as a path out of the item (before: its
    ``ValueError: Invalid file path``) is refused by restore, inspect and conversion (``cp``)."""
    name = name.replace("/ABS", str(tmp_path))
    _array(tmp_path / "outside", np.arange(4))
    path = _item(tmp_path / "ckpt", key=name)
    at_fault = rf"{path}/_METADATA: leaf .* names its array '.*', a path that leads out of the item"
    with pytest.raises(FormatError, match=at_fault):
        objckpt.restore(str(path))
    with pytest.raises(FormatError, match=at_fault):
        objckpt.inspect(str(path))
    with pytest.raises(FormatError, match=at_fault):
        objckpt.convert_orbax(str(path), str(tmp_path / "native"))
    assert not (tmp_path / "native").exists() or not any((tmp_path / "native").rglob("manifest*"))


def test_an_array_name_leading_out_is_refused_on_s3_and_cp(
    tmp_path: Path, s3_service: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same on S3 (a key is no path there, but the checkpoint is as hostile), and through ``objckpt cp``."""
    from objckpt.cli import main as cli_main

    local = _item(tmp_path / "ckpt", key="../x", values=np.arange(4))
    url = s3_service.url(f"orbax-paths-{uuid.uuid4().hex[:8]}")
    options = s3_service.storage_options()
    upload_dir(local, url, options)
    with pytest.raises(FormatError, match=rf"{url}/_METADATA: leaf \['../x'\] names its array '../x'"):
        objckpt.restore(url, storage_options=options)
    capsys.readouterr()
    assert cli_main(["cp", str(local), str(tmp_path / "native")]) == 1
    assert "names its array '../x', a path that leads out of the item" in capsys.readouterr().err


def test_names_that_stay_inside_are_read(tmp_path: Path) -> None:
    """A name with dots that is no ``..`` component (``a..b``, ``.hidden``) still reads."""
    for name in ("a..b", ".hidden"):
        path = _item(tmp_path / name, key=name)
        _array(path / name, np.arange(4) * 2)
        assert np.asarray(objckpt.restore(str(path))[name]).tolist() == [0, 2, 4, 6]


# ------------------------------------------------------------------ item 11: links leading out


def test_a_symlinked_item_directory_is_refused(tmp_path: Path) -> None:
    """A step whose ``default`` item is a link to another checkpoint's item (before: restored
    that checkpoint's arrays) is a FormatError naming the link; the item named directly still reads."""
    secret = _save_step(tmp_path / "secret", np.full(8, 7, np.float32))
    public = _save_step(tmp_path / "public", np.zeros(8, np.float32))
    os.rename(public / "default", tmp_path / "public-default")
    os.symlink(secret / "default", public / "default")
    at_fault = rf"Orbax item (file://)?{public}/default is a symbolic link to {secret}/default, outside the checkpoint"
    with pytest.raises(FormatError, match=at_fault):
        objckpt.restore(str(public))
    with pytest.raises(FormatError, match=at_fault):
        objckpt.inspect(f"file://{public}")
    with pytest.raises(FormatError, match=at_fault):
        objckpt.convert_orbax(str(public), str(tmp_path / "native"))
    # the user's own link (the URL itself) is what they named
    assert np.asarray(objckpt.restore(str(public / "default"))["w"]).tolist() == [7] * 8


def test_a_symlinked_composite_item_is_refused(tmp_path: Path) -> None:
    """One item of a Composite step linked out of the step: a FormatError naming it."""
    state = {"w": np.arange(8, dtype=np.float32)}
    other = _save_step(tmp_path / "other", np.zeros(1), a=ocp.args.StandardSave(state), b=ocp.args.JsonSave({}))
    step = _save_step(tmp_path / "run", np.zeros(1), a=ocp.args.StandardSave(state), b=ocp.args.JsonSave({"k": 1}))
    assert objckpt.restore(str(step))["b"] == {"k": 1}
    os.rename(step / "b", tmp_path / "b-moved")
    os.symlink(other / "b", step / "b")
    with pytest.raises(FormatError, match=rf"Orbax item {step}/b is a symbolic link to {other}/b, outside"):
        objckpt.restore(str(step))


def test_a_link_inside_an_item_leading_out_is_refused_before_tensorstore_opens_it(tmp_path: Path) -> None:
    """tensorstore opens the item's files itself: an array directory or chunk that links out
    (before: restored the linked file's values) is a FormatError naming the link; a link
    that stays inside the item reads."""
    _array(tmp_path / "secret", np.full(4, 9))
    path = _item(tmp_path / "ckpt")
    os.symlink(tmp_path / "secret", path / "x")
    at_fault = rf"Orbax checkpoint {path}: {path}/x is a symbolic link to {tmp_path}/secret, outside the checkpoint"
    for read in (objckpt.restore, objckpt.inspect, objckpt.verify):
        with pytest.raises(FormatError, match=at_fault):
            read(str(path))

    chunk = _item(tmp_path / "chunk")
    (chunk / "x").mkdir()
    (chunk / "x" / ".zarray").write_text(json.dumps(HEADER))
    os.symlink(tmp_path / "secret" / "0", chunk / "x" / "0")
    with pytest.raises(FormatError, match=rf"{chunk}/x/0 is a symbolic link to {tmp_path}/secret/0"):
        objckpt.restore(str(chunk))

    inside = _item(tmp_path / "inside")
    _array(inside / "data", np.arange(4))
    os.symlink(inside / "data", inside / "x")
    assert np.asarray(objckpt.restore(str(inside))["x"]).tolist() == [0, 1, 2, 3]


def test_a_fifo_in_an_item_is_refused(tmp_path: Path) -> None:
    """A FIFO where a chunk is (tensorstore's open would wait for a writer) is a FormatError naming it."""
    path = _item(tmp_path / "ckpt")
    (path / "x").mkdir()
    (path / "x" / ".zarray").write_text(json.dumps(HEADER))
    os.mkfifo(path / "x" / "0")
    with pytest.raises(FormatError, match=rf"{path}/x/0 is a FIFO, not a file"):
        objckpt.restore(str(path))


# ------------------------------------------------------------------ item 11: names, sizes, counts

CHILD = textwrap.dedent(
    """
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    import objckpt
    from objckpt.errors import FormatError
    started = time.perf_counter()
    try:
        objckpt.inspect(sys.argv[1])
    except FormatError as exc:
        print("FormatError", f"{time.perf_counter() - started:.2f}", exc)
    # the peak of this process's own memory (VmHWM): ru_maxrss would also count the test
    # process's pages, which a child started by vfork carries into its maximum until it execs
    print("maxrss_kib", next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")))
    """
)


def _inspect_in_child(url: str) -> tuple[str, int]:
    """``objckpt.inspect(url)`` in a child process under a 3 GiB address-space limit: (its
    output's first line, its peak RSS in KiB); a MemoryError or timeout fails the test."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, url], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    return lines[0], int(lines[-1].split()[1])


def test_metadata_files_are_sized_before_they_are_read(tmp_path: Path) -> None:
    """An 8 GiB sparse ``_CHECKPOINT_METADATA`` (before: read whole, a MemoryError under a 3 GiB
    cap) and a 600 MB JSON item are refused from their size, quickly, with little memory."""
    step = _step(tmp_path / "step", {"default": HANDLER})
    with open(step / "_CHECKPOINT_METADATA", "r+b") as f:
        f.truncate(8 << 30)
    first, rss = _inspect_in_child(str(step))
    assert first.startswith("FormatError") and float(first.split()[1]) < 5, first
    assert f"{step}/_CHECKPOINT_METADATA is 8589934592 bytes: over the 67108864-byte limit" in first
    assert rss < 1 << 20  # KiB: the file was never read

    composite = _step(tmp_path / "composite", {"state": HANDLER, "config": JSON_HANDLER})
    _item(composite / "state", values=np.arange(4))
    (composite / "config").mkdir()
    with open(composite / "config" / "metadata", "wb") as f:
        f.truncate(600 << 20)
    first, rss = _inspect_in_child(str(composite))
    assert f"{composite}/config/metadata is 629145600 bytes: over the 67108864-byte limit" in first, first
    assert rss < 1 << 20


def test_metadata_that_grows_after_its_head_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The read after the size check takes at most one byte past the size it found, so a file
    that grows in between is refused without being read whole."""
    from objckpt.storage.fsspec.local import LocalFsspecStore

    path = _item(tmp_path / "ckpt", values=np.arange(4))
    size = (path / "_METADATA").stat().st_size
    real_head = LocalFsspecStore.head
    asked: list[tuple[str, int]] = []

    async def head_then_grow(self: Any, key: str) -> Any:
        info = await real_head(self, key)
        if key == "_METADATA":
            (path / "_METADATA").write_bytes(b" " * (1 << 20))
        return info

    real_range = LocalFsspecStore.get_range

    async def get_range(self: Any, key: str, *, start: int, end: int) -> bytes:
        asked.append((key, end))
        return await real_range(self, key, start=start, end=end)

    monkeypatch.setattr(LocalFsspecStore, "head", head_then_grow)
    monkeypatch.setattr(LocalFsspecStore, "get_range", get_range)
    with pytest.raises(FormatError, match=rf"{path}/_METADATA changed size while it was read \(\d+ bytes, then"):
        objckpt.restore(str(path))
    assert [end for key, end in asked if key == "_METADATA"] == [size + 1]


def test_a_grain_file_claiming_a_billion_processes_is_refused_at_once(tmp_path: Path) -> None:
    """A 2-byte ``process_0-of-999999999.json`` (before: a loop over every claimed process, a
    MemoryError at 2.4 GiB) is refused from the files listed, naming what is missing."""
    step = _step(tmp_path / "step", {"state": HANDLER, "dataset": GRAIN_HANDLER})
    _item(step / "state", values=np.arange(4))
    (step / "dataset").mkdir()
    (step / "dataset" / "process_0-of-999999999.json").write_bytes(b"{}")
    started = time.perf_counter()
    with pytest.raises(FormatError, match=rf"{step}/dataset: grain's files of 999999999 processes lack process 1, "):
        objckpt.restore(str(step))
    assert time.perf_counter() - started < 5

    (step / "dataset" / "process_0-of-999999999.json").rename(step / "dataset" / "process_7-of-2.json")
    with pytest.raises(FormatError, match=rf"{step}/dataset/process_7-of-2.json: a process index out of range 0..1"):
        objckpt.restore(str(step))


@pytest.mark.parametrize("name", ["..", "../other", "/ABS", "a/b", "", "."])
def test_item_names_leading_out_of_the_step_are_format_errors(tmp_path: Path, name: str) -> None:
    """A step's ``_CHECKPOINT_METADATA`` naming an item ``..`` or an absolute path (before: a
    plain ``ValueError: invalid subpath``) is a FormatError naming the file and the name."""
    name = name.replace("/ABS", str(tmp_path / "other"))
    _item(tmp_path / "other", values=np.arange(4))
    at_fault = rf"{tmp_path}/step/_CHECKPOINT_METADATA names the item '.*': an item is one directory"
    single = _step(tmp_path / "step", {name: HANDLER})
    with pytest.raises(FormatError, match=at_fault):
        objckpt.restore(str(single))
    _step(tmp_path / "step", {name: HANDLER, "state": HANDLER})  # a Composite
    _item(single / "state", values=np.arange(4))
    with pytest.raises(FormatError, match=at_fault):
        objckpt.restore(str(single))


def test_an_item_name_leading_out_is_refused_on_s3(tmp_path: Path, s3_service: Any) -> None:
    step = _step(tmp_path / "step", {"../other": HANDLER, "state": HANDLER})
    _item(step / "state", values=np.arange(4))
    url = s3_service.url(f"orbax-items-{uuid.uuid4().hex[:8]}")
    options = s3_service.storage_options()
    upload_dir(step, url, options)
    with pytest.raises(FormatError, match=rf"{url}/_CHECKPOINT_METADATA names the item '../other'"):
        objckpt.restore(url, storage_options=options)
