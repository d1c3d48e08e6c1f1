"""Hostile sizes on the read path: a tiny manifest that declares huge leaves, pieces or blobs.

A self-consistent manifest passes every rule of the reader while its blob holds
320 bytes. Restore and verify must end (FormatError, IntegrityError or
HostMemoryError naming what is wrong) within seconds, their planning costing
the bytes actually there, not the bytes declared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import objckpt
from objckpt.core.format import MANIFEST_KEY, BlobEntry, LeafEntry, Manifest, Piece, manifest_to_json
from objckpt.transfer import runtime

BLOB = "0a/s-p0-000000.blob"
REAL = 320  # bytes the blob really holds
BOUND = 20.0  # seconds any of these may take, generously
GROWTH = 300 << 20  # resident memory any of these may add

# The command of the objckpt this test imported (not whichever one is installed).
CLI = [sys.executable, "-m", "objckpt.cli"]
ROOT = str(Path(objckpt.__file__).resolve().parents[1])


def _write_hostile(target: Any, elements: int) -> None:
    """One float32 leaf of ``elements`` elements: one piece of 4 × ``elements`` bytes at
    offset 64 of a blob declared 64 bytes longer, which really holds ``REAL`` bytes."""
    length = 4 * elements
    piece = Piece((0,), (elements,), BLOB, 64, length, 0)
    manifest = Manifest(
        save_id="hostile",
        created="2026-01-01T00:00:00Z",
        tree={"t": "dict", "k": ["w"], "c": [{"t": "leaf", "i": 0}]},
        leaves=(LeafEntry("['w']", "array", "float32", (elements,), (piece,)),),
        blobs=(BlobEntry(BLOB, length + 64),),
    )
    store = target.open()
    runtime.run_sync(store.put(BLOB, bytes(range(256)) + bytes(REAL - 256)))
    runtime.run_sync(store.put(MANIFEST_KEY, manifest_to_json(manifest)))


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def _bounded() -> Iterator[None]:
    """Assert the block ends within ``BOUND`` seconds and its resident memory never grows by ``GROWTH``."""
    before, peak, stop = _resident(), [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], _resident())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    try:
        yield
    finally:
        stop.set()
        sampler.join()
    elapsed = time.monotonic() - started
    assert elapsed < BOUND, f"took {elapsed:.1f} s"
    assert peak[0] - before < GROWTH, f"resident memory grew by {(peak[0] - before) >> 20} MiB"


def _raises(kind: type[BaseException], call: Callable[[], Any]) -> str:
    with _bounded(), pytest.raises(kind) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("kind", ["local", "s3"])
@pytest.mark.parametrize("elements", [10**15, 2**40])
def test_a_leaf_larger_than_the_machine_is_refused_at_once_naming_it(kind, elements, store_target_factory):
    target = store_target_factory(kind)
    _write_hostile(target, elements)
    message = _raises(
        objckpt.HostMemoryError, lambda: objckpt.restore(target.url, storage_options=target.storage_options)
    )
    assert "['w']" in message and "physical memory" in message, message


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_piece_declared_longer_than_its_blob_ends_promptly_without_planning_every_span(kind, store_target_factory):
    """1 GiB declared, 320 bytes there: the lazy sub-range path (a small read_chunk makes the
    declared length 262,144 spans) must stop at the first short one, on both the streamed
    (S3) and the joined (local) read."""
    target = store_target_factory(kind)
    _write_hostile(target, 2**28)
    options = objckpt.Options(read_chunk=4096)
    stats = objckpt.TransferStats()
    message = _raises(
        objckpt.IntegrityError,
        lambda: objckpt.restore(target.url, storage_options=target.storage_options, options=options, stats=stats),
    )
    assert BLOB in message and "truncated" in message and "['w']" in message, message
    assert stats.requests < 100, stats  # sub-ranges past the first short one are never asked for


@pytest.mark.parametrize("kind", ["local", "s3"])
@pytest.mark.parametrize("elements", [10**15, 2**28])
def test_verify_reports_a_blob_declared_larger_than_it_is(kind, elements, store_target_factory):
    target = store_target_factory(kind)
    _write_hostile(target, elements)
    with _bounded():
        report = objckpt.verify(target.url, storage_options=target.storage_options)
    assert [p.kind for p in report.problems] == ["short"], report
    assert BLOB in str(report.problems[0]) and str(REAL) in str(report.problems[0])
    assert report.bytes_read <= REAL


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_cli_verify_reports_a_blob_declared_larger_than_it_is(kind, store_target_factory, request):
    target = store_target_factory(kind)
    _write_hostile(target, 10**15)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "OBJCKPT_"))}
    if kind == "s3":
        env.update(request.getfixturevalue("s3_service").env())
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT
    started = time.monotonic()
    done = subprocess.run(
        [*CLI, "verify", target.url], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert time.monotonic() - started < 2 * BOUND  # a fresh interpreter imports jax first
    assert done.returncode == 1, done
    assert "PROBLEM short" in done.stdout and BLOB in done.stdout, done
