"""Hostile safetensors files and indexes: each is a FormatError naming what is wrong, within seconds.

Files are built byte by byte here (no library that might refuse to write them), put in a
bucket or on disk, and opened the ways a user would: ``objckpt.restore``, ``inspect``,
``verify``. A header that announces more than the limit is refused from its first 8 bytes,
before anything else is read.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import objckpt
from objckpt.errors import FormatError
from objckpt.safetensors.header import MAX_HEADER_BYTES, parse_header
from objckpt.transfer import runtime


def _file(header: Any, data: bytes, *, raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _good() -> tuple[dict[str, Any], bytes]:
    header = {
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "I32", "shape": [3], "data_offsets": [16, 28]},
    }
    return header, np.arange(4, dtype=np.float32).tobytes() + np.arange(3, dtype=np.int32).tobytes()


def _with(**changes: Any) -> tuple[dict[str, Any], bytes]:
    header, data = _good()
    for name, entry in changes.items():
        header[name] = {**header.get(name, {}), **entry}
    return header, data


# A duplicate name needs raw text (a dict cannot hold one key twice).
_ENTRY = b'{"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}'
_DUP = b'{"a": ' + _ENTRY + b', "a": ' + _ENTRY + b"}"

CASES: list[tuple[str, bytes, str]] = [
    ("good control", _file(*_good()), ""),
    ("overlap", _file(_with(b={"data_offsets": [12, 24]})[0], bytes(24)), "overlap"),
    ("outside", _file(*_with(b={"data_offsets": [16, 40], "shape": [6]})), "past the end"),
    ("hole", _file(_with(b={"data_offsets": [20, 32]})[0], bytes(32)), "hole"),
    ("trailing bytes", _file(_good()[0], _good()[1] + b"xx"), "after the last tensor"),
    ("dtype/shape mismatch", _file(*_with(a={"shape": [2, 3]})), "needs 24"),
    ("dtype/shape mismatch by dtype", _file(*_with(a={"dtype": "F64"})), "needs 32"),
    ("unknown dtype", _file(*_with(a={"dtype": "F4"})), "dtype 'F4'"),
    ("negative dim", _file(*_with(a={"shape": [-2, -2]})), "non-negative"),
    ("bool dim", _file(*_with(a={"shape": [True, 2]})), "non-negative"),
    ("end before begin", _file(*_with(a={"data_offsets": [16, 0]})), "end before"),
    ("extra key", _file(*_with(a={"extra": 1})), "exactly dtype"),
    ("overflowing shape", _file(*_with(a={"shape": [2**62, 2**62, 2**62]})), "needs"),
    ("duplicate names", _file(None, bytes(16), raw_header=_DUP), "'a' twice"),
    ("non-UTF-8", _file(None, _good()[1], raw_header=b'{"a\xff": 1}'), "not UTF-8"),
    ("not an object", _file(None, b"", raw_header=b"[1, 2]  "), "'{'"),
    ("not JSON", _file(None, b"", raw_header=b"{nope}"), "not valid JSON"),
    ("NaN", _file(None, b"", raw_header=b'{"a": NaN}'), "not JSON"),
    ("metadata not strings", _file({"__metadata__": {"k": 1}}, b""), "__metadata__"),
    ("huge int", _file(None, b"", raw_header=b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b"]}}"), "not valid"),
    ("deep nesting", _file(None, b"", raw_header=b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "not valid"),
    ("length past the file", struct.pack("<Q", 1000) + b"{}", "past the end"),
    ("oversized header", struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}" + bytes(64), "exceeds the limit"),
    ("2^64-1 header", struct.pack("<Q", 2**64 - 1) + bytes(16), "exceeds the limit"),
    ("too short", b"\x01\x00", "too short"),
]


@pytest.mark.parametrize(("case", "blob", "said"), CASES, ids=[c[0] for c in CASES])
def test_hostile_file_is_a_format_error_naming_it(tmp_path: Path, case: str, blob: bytes, said: str) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    started = time.monotonic()
    if not said:  # the control: the same bytes, well formed, restore
        got = objckpt.restore(str(tmp_path))
        assert got["a"].tolist() == [[0, 1], [2, 3]] and got["b"].tolist() == [0, 1, 2]
        return
    with pytest.raises(FormatError, match=said) as raised:
        objckpt.restore(str(tmp_path))
    assert "model.safetensors" in str(raised.value)
    with pytest.raises(FormatError, match=said):
        objckpt.inspect(str(path))
    assert time.monotonic() - started < 10


def _many(count: int) -> bytes:
    return json.dumps({f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]} for i in range(count)}).encode()


def test_parser_on_a_large_header_takes_bounded_time() -> None:
    """200,000 tensors (14 MiB of header), all at one offset: parsed and refused at the first
    overlap within seconds (on 2 busy cores)."""
    raw = _many(200_000)
    started = time.monotonic()
    with pytest.raises(FormatError, match="overlap"):
        parse_header(raw, where="big", file_size=8 + len(raw) + 1)
    assert time.monotonic() - started < 30


def test_parser_holds_a_few_times_the_header() -> None:
    import tracemalloc

    raw = _many(20_000)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="overlap"):
            parse_header(raw, where="big", file_size=8 + len(raw) + 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 * len(raw), f"{peak / 2**20:.0f} MiB for a {len(raw) / 2**20:.1f} MiB header"


def test_hostile_file_in_a_bucket(s3_store: Any) -> None:
    """The oversized header is refused from the first ranged read: the body is never fetched."""
    store = s3_store.open()
    try:
        runtime.run_sync(store.put("model.safetensors", struct.pack("<Q", 2**40) + bytes(1 << 20)))
    finally:
        runtime.run_sync(store.close())
    stats = objckpt.TransferStats()
    with pytest.raises(FormatError, match="exceeds the limit"):
        objckpt.restore(s3_store.url, storage_options=s3_store.storage_options, stats=stats)
    with pytest.raises(FormatError, match="exceeds the limit"):
        objckpt.verify(s3_store.url, storage_options=s3_store.storage_options)


def _sharded(tmp_path: Path, index: Any, files: dict[str, bytes]) -> Path:
    for name, blob in files.items():
        (tmp_path / name).write_bytes(blob)
    (tmp_path / "model.safetensors.index.json").write_bytes(
        index if isinstance(index, bytes) else json.dumps(index).encode()
    )
    return tmp_path


@pytest.mark.parametrize(
    ("index", "said"),
    [
        ({"weight_map": {"a": "../escape.safetensors"}}, "not a .safetensors file beside the index"),
        ({"weight_map": {"a": "sub/x.safetensors"}}, "beside the index"),
        ({"weight_map": {"a": "f1.safetensors", "b": "f1.safetensors"}}, "maps to 'f2.safetensors'|'b'"),
        ({"weight_map": {"a": "f1.safetensors", "b": "f2.safetensors", "c": "f2.safetensors"}}, "'c'"),
        ({"weight_map": {"a": "f1.safetensors", "b": "f2.safetensors"}, "metadata": {"total_size": -1}}, "total_size"),
        ({"weights": {}}, "weight_map"),
        (b"\xff\xfe", "UTF-8"),
    ],
)
def test_hostile_index(tmp_path: Path, index: Any, said: str) -> None:
    a = _file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4))
    b = _file({"b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4))
    _sharded(tmp_path, index, {"f1.safetensors": a, "f2.safetensors": b})
    with pytest.raises(FormatError, match=said):
        objckpt.restore(str(tmp_path))


def test_a_tensor_in_two_files(tmp_path: Path) -> None:
    a = _file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4))
    _sharded(tmp_path, {"weight_map": {"a": "f1.safetensors"}}, {"f1.safetensors": a, "f2.safetensors": a})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "f1.safetensors", "x": "f2.safetensors"}})
    )
    with pytest.raises(FormatError, match="f2.safetensors holds tensor 'a', which .* maps to 'f1.safetensors'"):
        objckpt.restore(str(tmp_path))


def test_a_file_shorter_than_its_header_says(tmp_path: Path) -> None:
    """A file cut after its header was read: the short read is named, nothing is returned."""
    header, data = _good()
    path = tmp_path / "model.safetensors"
    path.write_bytes(_file(header, data))
    reader_url = str(tmp_path)
    from objckpt.layouts.registry import open_checkpoint
    from objckpt.transfer.retries import opened_store

    options = objckpt.Options()
    with opened_store(reader_url, None, options) as store:
        reader = open_checkpoint(store, options=options)
        path.write_bytes(_file(header, data)[:-8])
        with pytest.raises(FormatError, match="shorter than its header"):
            reader.restore(None, partial=False, options=options, stats=objckpt.TransferStats(), cast="checked")
        report = reader.verify(options, objckpt.TransferStats(), False)
    assert not report.ok and "model.safetensors" in str(report)
