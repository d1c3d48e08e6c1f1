"""Shared helpers for the checkpoint tests."""

from __future__ import annotations

import faulthandler
import signal

import jax
import numpy as np
import pytest


def assert_tree_bit_exact(expected, actual) -> None:
    """Same structure, same leaf types, bytes and dtypes (jax arrays compared on the host)."""
    exp_leaves, exp_def = jax.tree_util.tree_flatten_with_path(expected, is_leaf=lambda x: x is None)
    act_leaves, act_def = jax.tree_util.tree_flatten_with_path(actual, is_leaf=lambda x: x is None)
    assert exp_def == act_def, f"structure differs: {exp_def} vs {act_def}"
    for (path, e), (_, a) in zip(exp_leaves, act_leaves):
        where = jax.tree_util.keystr(path)
        if isinstance(e, (jax.Array, np.ndarray, np.generic)):
            e_np, a_np = np.asarray(e), np.asarray(a)
            assert e_np.dtype == a_np.dtype, f"{where}: dtype {a_np.dtype} != {e_np.dtype}"
            assert e_np.shape == a_np.shape, f"{where}: shape {a_np.shape} != {e_np.shape}"
            assert e_np.tobytes() == a_np.tobytes(), f"{where}: bytes differ"
        else:
            assert type(e) is type(a), f"{where}: type {type(a)} != {type(e)}"
            if isinstance(e, float) and e != e:
                assert a != a, f"{where}: NaN lost"
            else:
                assert e == a, f"{where}: {a!r} != {e!r}"


def random_array(shape, dtype, seed=0) -> np.ndarray:
    """Random bits of any dtype (bfloat16, float8, int4 …), NaN patterns included."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.name in ("int4", "uint4", "int2", "uint2", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"):
        bits = {
            "int4": 4,
            "uint4": 4,
            "int2": 2,
            "uint2": 2,
            "float4_e2m1fn": 4,
            "float6_e2m3fn": 6,
            "float6_e3m2fn": 6,
        }[dtype.name]
        # sub-byte types: draw valid values through float conversion
        values = rng.integers(0, 2**bits, size=shape).astype(np.uint8)
        if dtype.name.startswith("int"):
            return (values.astype(np.int8) - 2 ** (bits - 1)).astype(dtype)
        if dtype.name.startswith("uint"):
            return values.astype(dtype)
        return rng.normal(size=shape).astype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


class CountingStore:
    """Wraps a store and records every byte range read."""

    def __init__(self, inner):
        self.inner = inner
        self.reads: list[tuple[str, int, int]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def get_range(self, key, *, start, end):
        data = await self.inner.get_range(key, start=start, end=end)
        self.reads.append((key, start, start + len(data)))
        return data

    async def get_range_buffer(self, key, *, start, end):
        data = await self.inner.get_range_buffer(key, start=start, end=end)
        self.reads.append((key, start, start + len(data)))
        return data

    async def get_range_streamed(self, key, *, start, end, sink):
        n = await self.inner.get_range_streamed(key, start=start, end=end, sink=sink)
        self.reads.append((key, start, start + n))
        return n


def count_reads(monkeypatch) -> list[CountingStore]:
    """Make every store objckpt opens count its reads; returns the list the stores land in."""

    from objckpt.storage import from_url
    from objckpt.transfer import retries

    counting: list[CountingStore] = []

    def wrapped_from_url(url, **options):
        store = CountingStore(from_url(url, **options))
        counting.append(store)
        return store

    monkeypatch.setattr(retries, "from_url", wrapped_from_url)
    return counting


class ProgressWatchdog:
    """Fails a long multi-cycle test when it stops making progress, not when it is slow.

    pytest-timeout's one budget per test cannot tell a hang from a loaded machine (a test of
    twenty save/restore cycles takes 2 minutes idle and over 5 at a load of 12). A test marked
    ``@pytest.mark.timeout(0)`` (pytest-timeout off: both use SIGALRM) runs inside
    ``with ProgressWatchdog(stall_seconds) as dog:`` and calls ``dog.tick(what)`` after each
    cycle; a cycle that takes longer than ``stall_seconds`` fails the test, naming the last
    progress and printing every thread's stack.
    """

    def __init__(self, stall_seconds: float) -> None:
        self.stall_seconds = stall_seconds
        self.last = "nothing yet"
        self.ticks = 0

    def tick(self, what: str) -> None:
        """Record progress and give the next cycle a fresh ``stall_seconds``."""
        self.last, self.ticks = what, self.ticks + 1
        signal.setitimer(signal.ITIMER_REAL, self.stall_seconds)

    def _expired(self, signum, frame) -> None:
        faulthandler.dump_traceback(all_threads=True)
        pytest.fail(
            f"no progress for {self.stall_seconds} s after {self.ticks} steps (last: {self.last})", pytrace=False
        )

    def __enter__(self) -> ProgressWatchdog:
        self._previous = signal.signal(signal.SIGALRM, self._expired)
        signal.setitimer(signal.ITIMER_REAL, self.stall_seconds)
        return self

    def __exit__(self, *exc) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._previous)


def full_manifest(store, *, size_limit: int = 1 << 30):
    """A checkpoint's manifest with every piece and blob (format v2: the root plus every index object).

    ``store``: an open store (``objckpt.storage.from_url``) at the checkpoint's prefix.
    """
    from objckpt.layouts.manifest_io import read_checkpoint
    from objckpt.transfer import runtime

    return runtime.run_sync(read_checkpoint(store, size_limit=size_limit))


def rewrite_as_v1(store, *, size_limit: int = 1 << 30) -> None:
    """Turn a committed format v2 checkpoint into the format v1 one with the same blobs:
    the manifest lists every piece, and the index objects are deleted (v1 has none)."""
    import dataclasses

    from objckpt.core.format import MANIFEST_KEY, manifest_to_json
    from objckpt.transfer import runtime

    manifest = full_manifest(store, size_limit=size_limit)
    v1 = dataclasses.replace(manifest, version=1, meshes=(), indexes=(), slab_bytes=0, loaded=frozenset())
    runtime.run_sync(store.put(MANIFEST_KEY, manifest_to_json(v1)))
    for ref in manifest.indexes:
        runtime.run_sync(store.delete(ref.key))


def upload_dir(local, url: str, options: dict) -> None:
    """The directory tree at ``local`` (a Path), byte for byte, under ``url`` (as ``gsutil rsync`` would)."""
    from objckpt.storage import from_url
    from objckpt.transfer import runtime

    store = from_url(url, **options)
    for path in local.rglob("*"):
        if path.is_file():
            runtime.run_sync(store.put(path.relative_to(local).as_posix(), path.read_bytes()))
    runtime.run_sync(store.close())


def assemble_index3(head_doc: dict, frames: list, *, level: int = 6) -> tuple[bytes, int]:
    """A version 3 index object laid out as ``index3_encode`` lays one out, but nothing checked:
    ``head_doc`` (format, version, save_id, process, blobs) and ``frames`` given as (first leaf,
    last leaf, rows, raw bytes, declared raw length), each compressed at zlib ``level``.
    Returns its bytes and head length."""
    import json
    import struct
    import zlib

    from objckpt.core.checksum import crc32c
    from objckpt.core.format import index3

    bodies = [zlib.compress(raw, level) for *_, raw, _ in frames]
    table = [[a, b, 0, len(body), declared, n, crc32c(body)] for (a, b, n, _, declared), body in zip(frames, bodies)]
    head = 0
    while True:  # the frames' offsets count the head, whose length counts the offsets' digits
        offset = head
        for entry, body in zip(table, bodies):
            entry[2], offset = offset, offset + len(body)
        text = json.dumps({**head_doc, "frames": table}, separators=(",", ":")).encode()
        if 12 + len(text) == head:
            return index3.MAGIC + struct.pack("<I", len(text)) + text + b"".join(bodies), head
        head = 12 + len(text)
