"""Options(compression="zstd"): byte planes, then zstd, per piece of at most 1 MiB (format version 4).

Stored bytes are counted by the transfer engine (what a save PUTs, what a restore GETs), on the
local S3 and GCS: bf16 weights drawn as trained ones (normal, σ = 0.02) at least 1.35× smaller,
f32 Adam second moments at least 1.10×; restores bit-exact; inspect, verify and cp on compressed
checkpoints; hostile compressed pieces refused as FormatError, in bounded memory.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import struct
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import zstandard
from helpers import assert_tree_bit_exact, full_manifest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.core import codecs
from objckpt.core.checksum import crc32c
from objckpt.core.format import parse_manifest
from objckpt.core.format.index3_encode import index3_encode
from objckpt.core.format.index3_frames import parse_index3
from objckpt.errors import FormatError

ZSTD = objckpt.Options(compression="zstd")


def _weights(shape, seed=0):
    """bf16 weights as training leaves them: normal, σ = 0.02."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)


def _second_moments(shape, seed=1):
    """f32 Adam second moments: squares of gradient noise, averaged (β2 = 0.999) over steps."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(-9.0, 1.5, size=(shape[0], 1))).astype(np.float32)  # per-row gradient scales
    g = rng.standard_normal(shape, dtype=np.float32) * scale
    return (0.001 * g * g + 0.999 * (g * g) * rng.uniform(0.5, 1.5, size=shape).astype(np.float32)).astype(np.float32)


def _sharded(value):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    return jax.device_put(jnp.asarray(value), NamedSharding(mesh, P("x", "y")))


# ------------------------------------------------------------------------------------- the codec


DTYPES = ["bfloat16", "float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool", "float8_e4m3fn"]


@pytest.mark.parametrize("name", DTYPES)
def test_every_dtype_round_trips_bit_exact_through_the_codec(name):
    dtype = np.dtype(getattr(ml_dtypes, name, None) or name)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=4096 * dtype.itemsize, dtype=np.uint8)
    raw[: 64 * dtype.itemsize] = 0  # runs too, and (floats) NaN payloads, infinities and -0.0 among the random bits
    for data in (raw, np.zeros(0, np.uint8), raw[: dtype.itemsize]):
        encoded = codecs.encode(data, dtype.itemsize)
        assert len(encoded) <= codecs.encoded_bound(len(data), dtype.itemsize)
        back = codecs.decode(encoded, dtype.itemsize, len(data), "test piece")
        assert back.tobytes() == data.tobytes()


def test_byte_planes_are_what_make_bf16_weights_small():
    w = _weights((1024, 512)).view(np.uint8).ravel()
    planar = len(codecs.encode(w, 2))
    interleaved = len(zstandard.ZstdCompressor(level=3).compress(w.tobytes()))
    assert w.nbytes / planar >= 1.35 and planar < interleaved / 1.1, (w.nbytes / planar, w.nbytes / interleaved)


def _patched_content_size(frame: bytes, size: int) -> bytes:
    """``frame`` with its header's content size set to ``size`` (same field width: 4 bytes here)."""
    fhd = frame[4]
    assert fhd >> 6 == 2 and fhd & 0x20  # a 4-byte content size, single segment (no window byte)
    return frame[:5] + struct.pack("<I", size) + frame[9:]


def _piece(planes: list[tuple[bytes, bool]]) -> bytes:
    words = b"".join(struct.pack("<I", len(body) | (1 << 31 if raw else 0)) for body, raw in planes)
    return words + b"".join(body for body, _ in planes)


HOSTILE = {
    "header cut short": lambda n, c: b"\x01\x00",
    "a frame that declares more": lambda n, c: _piece([(c.compress(bytes(2 * n)), False), (bytes(n), True)]),
    "a frame that declares no size": lambda n, c: _piece(
        [(zstandard.ZstdCompressor(write_content_size=False).compress(bytes(n)), False), (bytes(n), True)]
    ),
    "a frame that inflates past its declared size": lambda n, c: _piece(
        [(_patched_content_size(c.compress(bytes(4 * n)), n), False), (bytes(n), True)]
    ),
    "bytes after the frame": lambda n, c: _piece([(c.compress(bytes(n)) + b"\0", False), (bytes(n), True)]),
    "a raw plane of the wrong size": lambda n, c: _piece([(bytes(n), True), (bytes(n - 1), True)]),
    "a plane past the piece's end": lambda n, c: _piece([(bytes(n), True), (bytes(n), True)])[:-5],
    "bytes after the last plane": lambda n, c: _piece([(bytes(n), True), (bytes(n), True)]) + b"x",
    "not a zstd frame": lambda n, c: _piece([(b"\x00" * 16, False), (bytes(n), True)]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_compressed_piece_is_a_format_error_naming_it(case):
    n = 70_000  # bf16 values: planes of 70,000 bytes (content sizes take 4 bytes)
    data = HOSTILE[case](n, zstandard.ZstdCompressor())
    with pytest.raises(FormatError, match="leaf w: blob b"):
        codecs.decode(data, 2, 2 * n, "leaf w: blob b bytes [0, 9)")


def test_options_refuse_an_unknown_codec_and_name_the_extra_when_zstandard_is_missing(monkeypatch):
    with pytest.raises(ValueError, match="compression must be None or 'zstd'"):
        objckpt.Options(compression="lz4")
    with pytest.raises(ValueError, match="format_version=3"):
        objckpt.Options(compression="zstd", format_version=2)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "zstandard" else real(n, *a))
    with pytest.raises(ImportError, match=r"objckpt\[compression\]"):
        objckpt.Options(compression="zstd")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    monkeypatch.setattr(codecs, "_local", type(codecs._local)())
    with pytest.raises(ImportError, match=r"objckpt\[compression\]"):
        codecs.encode(np.zeros(8, np.uint8), 2)


# ------------------------------------------------------------------------------------- the format


def test_older_versions_refuse_a_codec_and_version_4_refuses_an_unknown_one(memory_store):
    objckpt.save(memory_store.url, {"w": _weights((64, 64))}, options=ZSTD)
    store = memory_store.open()
    from objckpt.transfer import runtime

    doc = json.loads(runtime.run_sync(store.get("manifest.json")))
    assert doc["version"] == 4 and doc["leaves"][0]["codec"] == "shuffle-zstd"
    as_v3 = json.dumps({**doc, "version": 3}).encode()
    with pytest.raises(FormatError, match=r"leaves\[0\].*codec"):
        parse_manifest(as_v3, size_limit=1 << 20)
    doc["leaves"][0]["codec"] = "shuffle-lz4"
    with pytest.raises(FormatError, match="unknown codec 'shuffle-lz4'"):
        parse_manifest(json.dumps(doc).encode(), size_limit=1 << 20)


def test_version_4_index_rows_hold_stored_lengths_within_the_codec_bound(memory_store):
    objckpt.save(memory_store.url, {"w": _weights((64, 64)), "n": "raw bytes"}, options=ZSTD)
    manifest = full_manifest(memory_store.open())
    w, n = (next(leaf for leaf in manifest.leaves if leaf.path == p) for p in ("['w']", "['n']"))
    assert w.codec == "shuffle-zstd" and all(p.length < 64 * 64 * 2 for p in w.pieces)
    assert n.codec is None  # a str leaf stays raw
    blobs = {b.key: b.size for b in manifest.blobs}

    def root_for(encoded):
        ref = manifest.indexes[0]._replace(
            size=len(encoded.data), head=encoded.head, crc32c=crc32c(encoded.data[: encoded.head])
        )
        return dataclasses.replace(manifest, indexes=(ref,))

    def refused(records, what):
        encoded = index3_encode(manifest.save_id, 0, records, blobs, lengths=True)
        with pytest.raises(FormatError, match=what):
            parse_index3(encoded.data, root_for(encoded), 0)

    leaf_of = {leaf.path: i for i, leaf in enumerate(manifest.leaves)}
    records = [(leaf_of["['n']"], p) for p in n.pieces] + [(leaf_of["['w']"], p) for p in w.pieces]
    encoded = index3_encode(manifest.save_id, 0, records, blobs, lengths=True)
    assert parse_index3(encoded.data, root_for(encoded), 0).pieces[leaf_of["['w']"]] == list(w.pieces)
    first = records[-1]
    for bad in (first[1]._replace(length=64 * 64 * 2 + 9), first[1]._replace(length=0)):
        refused([*records[:-1], (first[0], bad)], "its codec's bound")
    (raw,) = n.pieces
    refused([(records[0][0], raw._replace(length=15)), *records[1:]], r"must be 9 \(dtype × box\)")


# ------------------------------------------------------------------------------------- on the stores


@pytest.mark.parametrize(
    "name,make,target", [("bf16 weights", _weights, 1.35), ("f32 Adam moments", _second_moments, 1.10)]
)
def test_compressed_saves_put_fewer_bytes_on_s3_and_restore_bit_exact(s3_store, name, make, target):
    tree = {"x": _sharded(make((2048, 1024)))}
    plain = objckpt.save(f"{s3_store.url}/plain", tree, storage_options=s3_store.storage_options)
    packed = objckpt.save(f"{s3_store.url}/zstd", tree, storage_options=s3_store.storage_options, options=ZSTD)
    assert plain.bytes_written / packed.bytes_written >= target, (name, plain.bytes_written / packed.bytes_written)
    read = objckpt.TransferStats()
    restored = objckpt.restore(
        f"{s3_store.url}/zstd", jax.eval_shape(lambda: tree), storage_options=s3_store.storage_options, stats=read
    )
    assert_tree_bit_exact(tree, restored)
    assert read.bytes_read <= packed.bytes_written  # the compressed bytes, not the logical ones
    info = objckpt.inspect(f"{s3_store.url}/zstd", storage_options=s3_store.storage_options)
    assert info.format_version == 4 and info.leaves["['x']"].codec == "shuffle-zstd"
    assert info.total_bytes == tree["x"].nbytes and info.total_bytes / info.stored_bytes >= target
    assert "stored as" in str(info)


def test_compressed_pieces_are_at_most_a_chunk_so_reads_of_part_of_a_shard_fetch_only_its_chunks(s3_store):
    value = _weights((4096, 1024))  # 8 MiB: one shard on one device
    objckpt.save(s3_store.url, {"w": value}, storage_options=s3_store.storage_options, options=ZSTD)
    (leaf,) = full_manifest(s3_store.open()).leaves
    assert len(leaf.pieces) == 8 and all((p.stop[0] - p.start[0]) * 1024 * 2 <= codecs.CHUNK_BYTES for p in leaf.pieces)


def test_gcs_round_trip_verify_and_cp_of_a_compressed_checkpoint(gcs_store, s3_store):
    tree = {"w": _sharded(_weights((512, 256))), "v": _second_moments((300, 100)), "step": 3, "name": "run"}
    objckpt.save(gcs_store.url, tree, storage_options=gcs_store.storage_options, options=ZSTD)
    assert_tree_bit_exact(tree, objckpt.restore(gcs_store.url, storage_options=gcs_store.storage_options))
    report = objckpt.verify(gcs_store.url, storage_options=gcs_store.storage_options)
    assert report.ok, report
    objckpt.copy(
        gcs_store.url,
        s3_store.url,
        src_storage_options=gcs_store.storage_options,
        dst_storage_options=s3_store.storage_options,
    )
    assert objckpt.verify(s3_store.url, storage_options=s3_store.storage_options).ok
    assert_tree_bit_exact(tree, objckpt.restore(s3_store.url, storage_options=s3_store.storage_options))


def test_a_piece_written_wrong_is_a_codec_problem_for_verify_and_a_format_error_for_restore(s3_store, monkeypatch):
    from objckpt.saving import encode

    monkeypatch.setattr(encode, "encode", lambda raw, itemsize: codecs.encode(raw, itemsize) + b"\0")
    tree = {"w": _weights((256, 256))}
    objckpt.save(s3_store.url, tree, storage_options=s3_store.storage_options, options=ZSTD)
    monkeypatch.undo()
    report = objckpt.verify(s3_store.url, storage_options=s3_store.storage_options)
    assert not report.ok and {p.kind for p in report.problems} == {"codec"}, report
    assert "bytes past the piece's last plane" in str(report.problems[0]) and "['w']" in str(report.problems[0])
    with pytest.raises(FormatError, match=r"leaf \['w'\]: blob .*past the piece's last plane"):
        objckpt.restore(s3_store.url, storage_options=s3_store.storage_options)


# ------------------------------------------------------------------------------------- onto another mesh


def _stored_bytes_needed(manifest, boxes: dict[str, list]) -> float:
    """The compressed bytes ``boxes`` need: each saved piece's stored bytes, in proportion to how
    much of the piece lies inside them (a piece's bytes are its chunk's, not divisible further)."""
    total = 0.0
    for leaf in manifest.leaves:
        name = leaf.path[2:-2].split("']['")[-1]
        for start, stop in boxes.get(name, []):
            for p in leaf.pieces:
                overlap = np.prod([max(0, min(b, d) - max(a, c)) for a, b, c, d in zip(p.start, p.stop, start, stop)])
                total += p.length * overlap / np.prod(p.shape)
    return total


@pytest.mark.slow
def test_restores_onto_meshes_that_cut_the_saved_pieces_fetch_at_most_one_and_a_half_times_the_compressed_bytes_needed(
    s3_store,
):
    from multiprocess import run_processes
    from test_reshard_multiprocess import FLOOR, LEAVES, OPTIONS, TARGETS

    options = {**OPTIONS, "compression": "zstd"}
    job = {"url": s3_store.url, "storage_options": s3_store.storage_options, "leaves": LEAVES, "extras": False}
    job.update(options=options, scale=32, **FLOOR)
    saved = run_processes(4, {**job, "kind": "save", "mesh": [4, 2], "axes": ["fsdp", "tensor"]}, devices_per_process=2)
    assert all(r is not None for r in saved), saved
    manifest = full_manifest(s3_store.open())
    assert all(leaf.codec == "shuffle-zstd" for leaf in manifest.leaves if leaf.path.startswith("['params']"))
    for name, (mesh, axes, extra, _) in TARGETS.items():
        restore = {**job, "kind": "restore", "mesh": mesh, "axes": axes, "count_needed": True, **extra}
        results = run_processes(4, restore, devices_per_process=2)
        assert all(r is not None for r in results), f"{name}: {results}"
        for p, r in enumerate(results):
            assert r["mismatches"] == [], f"{name}, process {p}: {r['mismatches']}"
            needed = _stored_bytes_needed(manifest, r["boxes"])
            assert needed < 0.9 * r["needed_bytes"]  # compressed: fewer bytes than the boxes' raw ones
            assert r["bytes_read"] <= 1.5 * needed, f"{name}, process {p}: read {r['bytes_read']}, needed {needed:.0f}"


def test_an_async_compressed_save_encodes_in_its_uploads_and_restores_bit_exact(s3_store):
    tree = {"w": _sharded(_weights((1024, 512))), "v": _second_moments((256, 256))}
    handle = objckpt.save_async(s3_store.url, tree, storage_options=s3_store.storage_options, options=ZSTD)
    handle.result(timeout=120)
    assert handle.stats.bytes_written < 0.8 * sum(np.asarray(v).nbytes for v in tree.values())
    assert_tree_bit_exact(tree, objckpt.restore(s3_store.url, storage_options=s3_store.storage_options))
