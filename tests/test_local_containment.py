"""A local checkpoint never reads, writes or deletes outside its directory, and reads only regular files.

A symbolic link inside a checkpoint directory (``ck/zz -> /elsewhere``) must not let a
manifest that names ``zz/secret.blob`` read an outside file, even one whose crc32c is
right; a FIFO where a blob should be must fail the read at once, not block ``open()``.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import full_manifest

import objckpt
from objckpt.core.checksum import crc32c
from objckpt.errors import StoreError, StorePermissionError
from objckpt.storage import from_url
from objckpt.transfer import runtime

SECRET_KEY = "zz/secret.blob"  # not a hex prefix: never the folder of a saved blob or index object


def _save_one_blob(root: Path) -> tuple[str, np.ndarray]:
    """Save a one-leaf checkpoint at ``root``; its one blob's key."""
    value = np.arange(1024, dtype=np.float32)
    objckpt.save(str(root), {"w": value}, options=objckpt.Options(format_version=2))  # its JSON index is rewritten
    (blob,) = full_manifest(from_url(str(root))).blobs
    return blob.key, value


def _rename_blob_in_manifest(root: Path, old: str, new: str) -> None:
    """Rename a blob where the checkpoint lists it: in format v2, its process's index object,
    whose new size and crc32c go into the root manifest (as a forger would do)."""
    path = root / "manifest.json"
    doc = json.loads(path.read_text())
    assert doc["version"] == 2
    for ref in doc["indexes"]:
        index = root / ref["key"]
        data = index.read_bytes().replace(json.dumps(old).encode(), json.dumps(new).encode())
        index.write_bytes(data)
        ref["size"], ref["crc32c"] = len(data), crc32c(data)
    path.write_text(json.dumps(doc))


def _in_thread(call: Callable[[], Any], wait_s: float) -> tuple[Any, float, bool]:
    """Run ``call`` in a thread; (what it returned or raised, seconds taken, whether it
    finished within ``wait_s``). A call blocked in ``open()`` cannot hang the test."""
    outcome: list[Any] = []

    def work() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001  (handed to the test)
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(wait_s)
    return (outcome[0] if outcome else None), time.monotonic() - started, not thread.is_alive()


def _unblock_fifo(path: Path) -> None:
    """Give a reader blocked in ``open()`` on the FIFO its EOF (the original code blocks there)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # no reader: nothing blocked
            raise
        return
    os.close(fd)


# ----------------------------------------------------------------- links leading out


def test_a_linked_directory_leading_out_is_refused_naming_key_and_root(tmp_path):
    ck, outside = tmp_path / "ck", tmp_path / "elsewhere"
    key, _ = _save_one_blob(ck)
    outside.mkdir()
    # The outside file holds the real blob's bytes: its crc32c is right, only its place is wrong.
    os.replace(ck / key, outside / "secret.blob")
    os.symlink(outside, ck / "zz")
    _rename_blob_in_manifest(ck, key, SECRET_KEY)
    with pytest.raises(StorePermissionError) as err:
        objckpt.restore(str(ck))
    message = str(err.value)
    assert isinstance(err.value, PermissionError)
    assert SECRET_KEY in message and str(ck) in message and "outside" in message


def test_an_index_object_behind_a_link_leading_out_is_refused(tmp_path):
    """Format v2: the index objects are read through the same containment as the blobs."""
    ck, outside = tmp_path / "ck", tmp_path / "elsewhere"
    _save_one_blob(ck)
    (ref,) = json.loads((ck / "manifest.json").read_text())["indexes"]
    folder, name = ref["key"].split("/")
    os.replace(ck / folder, outside)  # the real bytes, so size and crc32c match: only the place is wrong
    os.symlink(outside, ck / folder)
    assert (ck / ref["key"]).read_bytes()  # the link itself works
    with pytest.raises(StorePermissionError) as err:
        objckpt.restore(str(ck))
    assert ref["key"] in str(err.value) and "outside" in str(err.value)
    with pytest.raises(StorePermissionError):
        objckpt.verify(str(ck))


def test_a_linked_blob_file_leading_out_is_refused(tmp_path):
    ck, outside = tmp_path / "ck", tmp_path / "elsewhere"
    key, _ = _save_one_blob(ck)
    outside.mkdir()
    os.replace(ck / key, outside / "secret.blob")
    os.symlink(outside / "secret.blob", ck / key)
    with pytest.raises(StorePermissionError, match="outside") as err:
        objckpt.restore(f"file://{ck}")
    assert key in str(err.value)
    store = from_url(str(ck))
    with pytest.raises(StorePermissionError):
        runtime.run_sync(store.head(key))
    with pytest.raises(StorePermissionError):
        runtime.run_sync(store.get(key))


def test_writes_and_deletes_through_a_link_leading_out_are_refused(tmp_path):
    ck, outside = tmp_path / "ck", tmp_path / "elsewhere"
    ck.mkdir()
    outside.mkdir()
    (outside / "secret.blob").write_bytes(b"keep me")
    os.symlink(outside, ck / "zz")
    store = from_url(str(ck))
    with pytest.raises(StorePermissionError, match="outside"):
        runtime.run_sync(store.delete(SECRET_KEY))
    with pytest.raises(StorePermissionError, match="outside"):
        runtime.run_sync(store.put("zz/new.blob", b"x"))
    with pytest.raises(StorePermissionError, match="outside"):
        runtime.run_sync(store.put("zz/sub/new.blob", b"x", mode="create"))
    assert sorted(p.name for p in outside.iterdir()) == ["secret.blob"]
    assert (outside / "secret.blob").read_bytes() == b"keep me"


def test_links_that_stay_inside_and_a_linked_root_still_work(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    linked_root = tmp_path / "linked"
    os.symlink(real, linked_root)  # the root itself may be a link (/tmp on macOS)
    key, value = _save_one_blob(linked_root / "ck")
    np.testing.assert_array_equal(np.asarray(objckpt.restore(str(linked_root / "ck"))["w"]), value)
    store = from_url(str(linked_root / "ck"))
    os.symlink(real / "ck" / key, real / "ck" / "alias.blob")  # a link to an object inside the root
    assert runtime.run_sync(store.get("alias.blob")) == (real / "ck" / key).read_bytes()
    runtime.run_sync(store.delete("alias.blob"))  # removes the link, not its target
    assert (real / "ck" / key).exists() and not (real / "ck" / "alias.blob").exists()


# ----------------------------------------------------------------- non-regular files


def _blob_replaced_by_a_fifo(ck: Path) -> str:
    """Save a one-blob checkpoint at ``ck``, then put a FIFO where its blob was; the blob's key."""
    key, _ = _save_one_blob(ck)
    os.unlink(ck / key)
    os.mkfifo(ck / key)
    return key


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_as_a_blob_fails_restore_at_once_naming_the_blob(tmp_path):
    ck = tmp_path / "ck"
    key = _blob_replaced_by_a_fifo(ck)
    try:
        error, seconds, finished = _in_thread(lambda: objckpt.restore(str(ck)), wait_s=30)
    finally:
        _unblock_fifo(ck / key)
    assert finished, "restore blocked on the FIFO"
    assert isinstance(error, StoreError) and not isinstance(error, objckpt.errors.TransientStoreError)
    assert key in str(error) and "not a regular file" in str(error)
    assert seconds < 20
    store = from_url(str(ck))
    with pytest.raises(StoreError, match="FIFO"):
        runtime.run_sync(store.head(key))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_verify_and_the_cli_do_not_hang_on_a_fifo(tmp_path):
    ck = tmp_path / "ck"
    key = _blob_replaced_by_a_fifo(ck)
    try:
        report, _, finished = _in_thread(lambda: objckpt.verify(str(ck)), wait_s=30)
        assert finished, "verify blocked on the FIFO"
        assert not report.ok
        assert any(p.blob == key and "not a regular file" in str(p) for p in report.problems), report.problems
        done = subprocess.run(
            [sys.executable, "-m", "objckpt.cli", "verify", str(ck)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        _unblock_fifo(ck / key)
    assert done.returncode == 1
    assert key in done.stdout + done.stderr
