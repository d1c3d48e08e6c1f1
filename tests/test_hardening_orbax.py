"""Orbax reading and conversion under hostile or wrong inputs (issue 51, items 2-6 and 19).

The hostile checkpoints are hand-written Orbax item directories: a ``_METADATA``
naming one array leaf ``x`` and its zarr header (``x/.zarray``, or ``x/zarr.json``
for zarr3) declaring whatever shape and chunk grid the case needs, with no chunk
files unless the case writes some (a missing zarr chunk reads as the fill value,
as Orbax's own arrays do). They are read from local disk, and the ones that apply
from the S3 server too, after an upload byte for byte.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import upload_dir

import objckpt
from objckpt.errors import FormatError, HostMemoryError, StoreError

ocp = pytest.importorskip("orbax.checkpoint")
ts = pytest.importorskip("tensorstore")

LEAF = "['x']"


def _metadata(tree: dict[str, Any] | None = None, *, zarr3: bool = False) -> dict[str, Any]:
    entry = {"key_metadata": [{"key": "x", "key_type": 2}], "value_metadata": {"value_type": "np.ndarray"}}
    return {"tree_metadata": tree or {"('x',)": entry}, "use_ocdbt": False, "use_zarr3": zarr3}


def _item(path: Path, shape: list[int], chunks: list[int], dtype: str = "<f4") -> str:
    """An Orbax item (no OCDBT, zarr v2) whose one leaf ``x`` has this header and no chunk files."""
    (path / "x").mkdir(parents=True)
    (path / "_METADATA").write_text(json.dumps(_metadata()))
    header = {
        "chunks": chunks,
        "compressor": None,
        "dimension_separator": ".",
        "dtype": dtype,
        "fill_value": None,
        "filters": None,
        "order": "C",
        "shape": shape,
        "zarr_format": 2,
    }
    (path / "x" / ".zarray").write_text(json.dumps(header))
    return str(path)


# ------------------------------------------------------------------ item 5: hostile _METADATA


def test_hostile_metadata_is_a_format_error_naming_the_item(tmp_path: Path, s3_service: Any) -> None:
    """100k-deep nesting (RecursionError before), a sequence key of 10^10 (TypeError before),
    and key paths that clash (a list and a dict at one node): FormatErrors naming the item."""
    deep = tmp_path / "deep"
    _item(deep, [4], [4])
    (deep / "_METADATA").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FormatError, match=rf"{deep}/_METADATA nests too deeply"):
        objckpt.restore(str(deep))
    with pytest.raises(FormatError, match=rf"{deep}/_METADATA"):
        objckpt.inspect(str(deep))

    for key in ("10000000000", 10**10):
        huge = tmp_path / f"huge-{type(key).__name__}"
        _item(huge, [4], [4])
        entry = {
            "key_metadata": [{"key": "layers", "key_type": 2}, {"key": key, "key_type": 1}],
            "value_metadata": {"value_type": "np.ndarray"},
        }
        (huge / "_METADATA").write_text(json.dumps(_metadata({"('layers', 'big')": entry})))
        with pytest.raises(FormatError, match=rf"{huge}/_METADATA: sequence key .*10000000000.* under \['layers'\]"):
            objckpt.restore(str(huge))

    clash = tmp_path / "clash"
    _item(clash, [4], [4])
    as_list = {"key_metadata": [{"key": "a", "key_type": 2}, {"key": "0", "key_type": 1}]}
    as_dict = {"key_metadata": [{"key": "a", "key_type": 2}, {"key": "w", "key_type": 2}]}
    tree = {k: {**v, "value_metadata": {"value_type": "np.ndarray"}} for k, v in (("0", as_list), ("1", as_dict))}
    (clash / "_METADATA").write_text(json.dumps(_metadata(tree)))
    with pytest.raises(FormatError, match=rf"{clash}/_METADATA: leaf \['a'\]\['w'\] clashes"):
        objckpt.restore(str(clash))

    url = s3_service.url(f"hostile-orbax-{uuid.uuid4().hex[:8]}")
    options = s3_service.storage_options()
    upload_dir(deep, url, options)
    with pytest.raises(FormatError, match=rf"{url}/_METADATA nests too deeply"):
        objckpt.restore(url, storage_options=options)


def test_a_malformed_saved_sharding_only_loses_its_description(tmp_path: Path) -> None:
    """``_sharding`` is a description: one of the wrong shape is dropped, not a crash in inspect."""
    import base64

    path = tmp_path / "ckpt"
    _item(path, [8], [8])
    name = base64.urlsafe_b64encode(b"x").decode()
    bad = {"sharding_type": "NamedSharding", "shape": 4, "axis_names": "x", "partition_spec": 7}
    (path / "_sharding").write_text(json.dumps({name: json.dumps(bad)}))
    info = objckpt.inspect(str(path))
    assert info.leaves[LEAF].shape == (8,) and info.leaves[LEAF].sharding is None


# ------------------------------------------------------------------ items 3 and 4: sizes from headers


def test_orbax_restore_checks_host_memory_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_service: Any
) -> None:
    """A 160-byte header declaring 256 MiB on a machine said to have 128 MiB: HostMemoryError
    naming the leaf before a byte is allocated (it allocated and returned the array before); a
    header beyond any machine's memory is the same error, not numpy's bare MemoryError."""
    small = _item(tmp_path / "small", [64 << 20], [1 << 20])
    monkeypatch.setattr("objckpt.restoring.host_memory.physical_memory", lambda: 128 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(HostMemoryError, match=r"leaf \['x'\] \(float32\[67108864\]\) of the Orbax .* 256.0 MiB"):
            objckpt.restore(small)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak

    url = s3_service.url(f"orbax-memory-{uuid.uuid4().hex[:8]}")
    options = s3_service.storage_options()
    upload_dir(tmp_path / "small", url, options)
    with pytest.raises(HostMemoryError, match=r"leaf \['x'\]"):
        objckpt.restore(url, storage_options=options)
    monkeypatch.undo()

    vast = _item(tmp_path / "vast", [2**48, 1024], [2**16, 1024])
    with pytest.raises(HostMemoryError, match=r"leaf \['x'\] \(float32\[281474976710656, 1024\]\)"):
        objckpt.restore(vast)


def test_shapes_past_int64_are_format_errors_and_nothing_is_committed(tmp_path: Path) -> None:
    """Shape [2^32, 2^32]: 2^64 elements wrapped to 0 in int64. Restore raised a bare ValueError,
    and conversion committed a leaf with no pieces that verify refused. Now both refuse it,
    naming the leaf, and nothing is committed."""
    src = _item(tmp_path / "orbax", [2**32, 2**32], [2**16, 2**16])
    with pytest.raises(FormatError, match=r"leaf \['x'\] \(x, shape \[4294967296, 4294967296\]\).*any array"):
        objckpt.restore(src)
    dst = str(tmp_path / "native")
    with pytest.raises(FormatError, match=r"leaf \['x'\]"):
        objckpt.convert_orbax(src, dst)
    with pytest.raises(objckpt.CheckpointNotFoundError):
        objckpt.verify(dst)
    info = objckpt.inspect(src)  # headers only: the size is told exactly
    assert info.leaves[LEAF].nbytes == 2**64 * 4


# ------------------------------------------------------------------ item 2: lazy slabs


def test_conversion_generates_its_slabs_lazily(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A header of 2^34 one-byte rows under a 64 KiB budget is 2^20 slabs of 16 KiB: they were
    all built before the first read (hundreds of MB; [2^48, 1024] was 2^32 slabs and killed
    the process). Now the first group is read and uploaded with little Python memory held."""
    from objckpt.saving import writer

    src = _item(tmp_path / "orbax", [2**34, 1], [2**16, 1], dtype="|u1")
    first: list[Any] = []

    class Stop(Exception):
        pass

    def upload_once(save: Any, blobs: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        first.extend(blobs)
        raise Stop

    monkeypatch.setattr(writer, "_send", upload_once)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(Stop):
            objckpt.convert_orbax(src, str(tmp_path / "native"), options=objckpt.Options(memory_budget=64 << 10))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    seconds = time.perf_counter() - started
    pieces = [p.piece for blob in first for p in blob.pieces]
    assert [(p.start, p.stop) for p in pieces] == [((0, 0), (16 << 10, 1))], pieces
    assert peak < 32 << 20, peak
    assert seconds < 30, seconds
    assert not list((tmp_path / "native").rglob("manifest.json"))


def test_rows_larger_than_the_budget_are_cut_along_inner_dimensions(tmp_path: Path) -> None:
    """A leaf whose one row is over a quarter of the budget is read in boxes within it, and
    the converted checkpoint verifies and restores bit-exact."""
    path = tmp_path / "orbax"
    _item(path, [3, 50, 64], [1, 10, 64])
    data = np.random.default_rng(0).standard_normal((3, 50, 64)).astype(np.float32)
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": f"{path}/x/"}}
    ts.open(spec, open=True, write=True).result().write(data).result()
    stats = objckpt.convert_orbax(str(path), str(tmp_path / "native"), options=objckpt.Options(memory_budget=16 << 10))
    assert stats.bytes_read == data.nbytes
    report = objckpt.verify(str(tmp_path / "native"))
    assert report.ok and report.pieces >= 3 * 50 * 64 * 4 // (4 << 10), report
    assert np.asarray(objckpt.restore(str(tmp_path / "native"))["x"]).tobytes() == data.tobytes()


# ------------------------------------------------------------------ item 6: chunk grids


def test_chunk_grids_out_of_proportion_to_their_bytes_are_refused(tmp_path: Path, s3_service: Any) -> None:
    """256 Ki one-element chunks for 1 MiB (tensorstore: ~1.4 KB and ~13 µs per chunk a read
    touches): FormatError naming the leaf and the grid, before any read, for restore and
    conversion; the same grid on the S3 server too."""
    src = _item(tmp_path / "orbax", [256 << 10], [1])
    started = time.perf_counter()
    with pytest.raises(FormatError, match=r"leaf \['x'\].*262144 chunks of \[1\] for 1048576 bytes"):
        objckpt.restore(src)
    assert time.perf_counter() - started < 10
    with pytest.raises(FormatError, match=r"262144 chunks"):
        objckpt.convert_orbax(src, str(tmp_path / "native"))
    assert not (tmp_path / "native" / "manifest.json").exists()

    url = s3_service.url(f"orbax-grid-{uuid.uuid4().hex[:8]}")
    options = s3_service.storage_options()
    upload_dir(tmp_path / "orbax", url, options)
    with pytest.raises(FormatError, match=r"leaf \['x'\].*262144 chunks"):
        objckpt.restore(url, storage_options=options)


class _SpyTensorstore:
    """tensorstore, recording the chunk count of each read objckpt issues into its buffers."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.reads: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(ts, name)

    def array(self, *args: Any, **kwargs: Any) -> Any:
        spy, target = self, ts.array(*args, **kwargs)

        class Target:
            def write(self, source: Any, **kw: Any) -> Any:
                lo, hi = source.domain[0].inclusive_min, source.domain[0].exclusive_max
                spy.reads.append((hi - 1) // spy.chunk - lo // spy.chunk + 1)
                return target.write(source, **kw)

        return Target()


def test_one_tensorstore_read_touches_a_bounded_number_of_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grid of 64 Ki chunks of 4 floats (in one zarr3 shard, so one file): allowed, but one
    read of the whole leaf asked tensorstore for all 64 Ki chunks at once. Now every read
    touches at most 16,384 chunks (``tensorstore_io.READ_CHUNKS``), for restore and conversion,
    and the bytes are exact."""
    read_chunks = 1 << 14
    n = 4 << 16
    path = tmp_path / "orbax"
    (path / "x").mkdir(parents=True)
    (path / "_METADATA").write_text(json.dumps(_metadata(zarr3=True)))
    inner = {"name": "bytes", "configuration": {"endian": "little"}}
    shard = {"chunk_shape": [4], "codecs": [inner], "index_codecs": [inner, {"name": "crc32c"}]}
    metadata = {
        "shape": [n],
        "data_type": "float32",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [n]}},
        "codecs": [{"name": "sharding_indexed", "configuration": shard}],
    }
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/x/"}, "metadata": metadata}
    data = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    ts.open(spec, create=True).result().write(data).result()

    spy = _SpyTensorstore(4)
    monkeypatch.setattr("objckpt.orbax.restore.import_tensorstore", lambda: spy)
    monkeypatch.setattr("objckpt.orbax.convert.import_tensorstore", lambda: spy)
    out = objckpt.restore(str(path))
    assert np.asarray(out["x"]).tobytes() == data.tobytes()
    assert len(spy.reads) >= 4 and max(spy.reads) <= read_chunks, spy.reads
    spy.reads.clear()
    objckpt.convert_orbax(str(path), str(tmp_path / "native"))
    assert spy.reads and max(spy.reads) <= read_chunks, spy.reads
    assert np.asarray(objckpt.restore(str(tmp_path / "native"))["x"]).tobytes() == data.tobytes()


# ------------------------------------------------------------------ item 19: reads that go nowhere


def _state() -> dict[str, Any]:
    return {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.ones(8, np.float32)}


def _save_orbax(path: Path) -> None:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, _state())
    checkpointer.wait_until_finished()


def test_a_tensorstore_read_that_gets_no_answer_times_out_naming_it(
    tmp_path: Path, s3_service: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The S3 server behind a proxy that stalls every response for the OCDBT files (only
    tensorstore reads them; objckpt's own metadata reads pass): with a 3 s request timeout,
    the restore fails within seconds with a StoreError naming the leaf, the checkpoint and
    where the requests go, after a warning saying what it waits for. Before, it waited out
    each stall (then tensorstore's retries) with nothing said."""
    from backends.proxy import FaultProxy

    _save_orbax(tmp_path / "ckpt")
    name = f"orbax-stall-{uuid.uuid4().hex[:8]}"
    upload_dir(tmp_path / "ckpt", s3_service.url(name), s3_service.storage_options())
    host, port = s3_service.endpoint_url.rsplit("//", 1)[1].split(":")
    with FaultProxy(host, int(port), stall_seconds=40) as proxy:
        proxy.set_faults(1.0, ("stall",), only="ocdbt")
        options = s3_service.storage_options()
        options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
        started = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="objckpt"):
            with pytest.raises(StoreError, match=rf"no answer in \d+ s .* leaf \['[bw]'\] .* {proxy.endpoint_url}"):
                objckpt.restore(
                    s3_service.url(name), storage_options=options, options=objckpt.Options(request_timeout=3)
                )
        seconds = time.perf_counter() - started
    assert seconds < 20, seconds
    assert any("still waiting for tensorstore" in r.getMessage() for r in caplog.records), caplog.text


def test_a_gcs_emulator_tensorstore_cannot_reach_times_out(
    tmp_path: Path, gcs_service: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: objckpt reads the metadata from the GCS emulator, but tensorstore's
    requests go to an address that accepts connections and never answers. The conversion
    (``objckpt cp``'s path) fails at the request timeout naming what it waited for."""
    _save_orbax(tmp_path / "ckpt")
    url = gcs_service.url(f"orbax-nowhere-{uuid.uuid4().hex[:8]}")
    upload_dir(tmp_path / "ckpt", url, gcs_service.storage_options())
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # accepts (the kernel completes handshakes), never reads or answers
    try:
        for key, value in gcs_service.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
        options = {k: v for k, v in gcs_service.storage_options().items() if k != "endpoint_url"}
        started = time.perf_counter()
        with pytest.raises(StoreError, match=r"tensorstore gave no answer .* \(TENSORSTORE_GCS_HTTP_URL\)"):
            objckpt.convert_orbax(
                url, str(tmp_path / "native"), src_storage_options=options, options=objckpt.Options(request_timeout=3)
            )
        seconds = time.perf_counter() - started
    finally:
        silent.close()
    assert seconds < 20, seconds
    assert not (tmp_path / "native" / "manifest.json").exists()


def test_a_slow_read_beside_reads_that_complete_is_not_a_timeout() -> None:
    """The timeout counts time with no read completing, not one read's duration: a read slower
    than the timeout, while the reads beside it keep completing (a slow link shared by many),
    is waited for; once nothing completes for the timeout, the wait fails naming its read."""
    import threading

    from objckpt.orbax.tensorstore_io import Waiter

    slow_promise, slow = ts.Promise.new()
    others = [ts.Promise.new() for _ in range(8)]
    waiter = Waiter(0.6, "the test's store", lambda: [future for _, future in others])

    def complete() -> None:
        for promise, _ in others:
            time.sleep(0.2)
            promise.set_result(None)
        slow_promise.set_result("landed")

    threading.Thread(target=complete, daemon=True).start()
    started = time.perf_counter()
    assert waiter.wait(slow, "reading the slow box") == "landed"
    assert time.perf_counter() - started > 1.2  # twice the timeout: kept alive by the others

    _, stuck = ts.Promise.new()
    with pytest.raises(StoreError, match=r"no answer in \d+ s .* while reading the stuck box: .* the test's store"):
        waiter.wait(stuck, "reading the stuck box")
    assert stuck.cancelled()
