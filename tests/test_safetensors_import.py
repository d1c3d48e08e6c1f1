"""Safetensors files as a source of objckpt.restore, inspect and verify (the ``safetensors`` layout).

Files written by the ``safetensors`` library itself and by objckpt's export, in S3, GCS and on
disk, restored onto meshes of 8 CPU devices, one device and host numpy; each restore's bytes
read are compared with the bytes its target needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.errors import CheckpointNotFoundError, TargetMismatchError
from objckpt.safetensors import restore_safetensors
from objckpt.transfer import runtime

safetensors_numpy = pytest.importorskip(
    "safetensors.numpy", reason="the safetensors library (pyproject's dev extra) writes the files read here"
)

REPO = Path(__file__).resolve().parent.parent


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "model.embed": rng.standard_normal((64, 32)).astype(np.float32),
        "model.layers.0.w": rng.standard_normal((32, 16)).astype(ml_dtypes.bfloat16),
        "model.layers.0.b": rng.integers(-100, 100, (16,)).astype(np.int32),
        "model.layers.1.w": rng.standard_normal((8, 4, 6)).astype(np.float16),
        "model.norm": np.array(1.5, np.float32),
        "lm_head": rng.standard_normal((64, 32)).astype(np.float32),
    }


def _put_file(target: Any, key: str, blob: bytes) -> None:
    store = target.open()
    try:
        runtime.run_sync(store.put(key, blob))
    finally:
        runtime.run_sync(store.close())


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))


def _spec_target(tensors: dict[str, np.ndarray], spec: P) -> dict[str, Any]:
    """The tensors' tree (nested by name) with every leaf a ShapeDtypeStruct on ``spec`` where it fits."""
    mesh = _mesh()
    out: dict[str, Any] = {}
    for name, a in tensors.items():
        use = (
            spec
            if len(spec) <= a.ndim and all(ax is None or a.shape[i] % mesh.shape[ax] == 0 for i, ax in enumerate(spec))
            else P()
        )
        node = out
        *head, last = name.split(".")
        for key in head:
            node = node.setdefault(key, {})
        node[last] = jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, use))
    return out


def _leaves(tree: Any) -> dict[str, Any]:
    return {
        ".".join(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


@pytest.mark.parametrize("spec", [P("x", "y"), P("y", "x"), P(None, "x"), P(), P("x")], ids=str)
def test_library_file_in_s3_onto_a_4x2_mesh_reads_each_byte_once(s3_store: Any, spec: P) -> None:
    tensors = _tensors()
    _put_file(s3_store, "model.safetensors", safetensors_numpy.save(tensors))
    stats = objckpt.TransferStats()
    got = objckpt.restore(
        s3_store.url, _spec_target(tensors, spec), storage_options=s3_store.storage_options, stats=stats
    )
    for name, leaf in _leaves(got).items():
        assert isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(
            _leaves(_spec_target(tensors, spec))[name].sharding, leaf.ndim
        )
        assert np.asarray(leaf).tobytes() == tensors[name].tobytes(), name
    needed = sum(a.nbytes for a in tensors.values())  # one process holds every row
    assert needed <= stats.bytes_read <= 1.1 * needed


def test_boxes_cut_across_columns_are_filled_as_rows_stream_in(s3_store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Onto P("x", "y"), each box's array takes its columns straight from the stream (no whole-
    tensor buffer); a row longer than a streamed piece, or a cast, lands whole instead. Both exact."""
    from objckpt.safetensors import restore as restore_module
    from objckpt.storage.streaming import STREAM_PIECE

    wide = np.arange(8 * (STREAM_PIECE // 4 + 2), dtype=np.float32).reshape(8, -1)  # a row > one piece
    tensors = {**_tensors(), "wide": wide}
    _put_file(s3_store, "model.safetensors", safetensors_numpy.save(tensors))
    scattered: list[str] = []
    real = restore_module._ScatterRows

    def counting(leaf: Any, row0: int) -> Any:
        scattered.append(leaf.name)
        return real(leaf, row0)

    monkeypatch.setattr(restore_module, "_ScatterRows", counting)
    target = _spec_target(tensors, P("x", "y"))
    target["model"]["layers"]["0"]["w"] = jax.ShapeDtypeStruct(  # a cast: bf16 → f32
        (32, 16), np.float32, sharding=NamedSharding(_mesh(), P("x", "y"))
    )
    got = _leaves(objckpt.restore(s3_store.url, target, storage_options=s3_store.storage_options))
    assert {"model.embed", "lm_head"} <= set(scattered)
    assert "wide" not in scattered and "model.layers.0.w" not in scattered
    for name, leaf in got.items():
        want = tensors[name].astype(np.float32) if name == "model.layers.0.w" else tensors[name]
        assert np.asarray(leaf).tobytes() == want.tobytes(), name


def test_single_device_numpy_and_subtrees(gcs_store: Any) -> None:
    tensors = _tensors()
    _put_file(gcs_store, "model.safetensors", safetensors_numpy.save(tensors))
    device = jax.devices()[3]
    target = {
        "model": {
            "embed": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=SingleDeviceSharding(device)),
            "layers": None,  # the subtree, as host numpy
            "norm": jax.ShapeDtypeStruct((), np.float32),
        },
        "lm_head": np.zeros((64, 32), np.float32),  # a placeholder: host numpy
    }
    got = objckpt.restore(gcs_store.url, target, storage_options=gcs_store.storage_options)
    assert got["model"]["embed"].devices() == {device}
    assert np.asarray(got["model"]["embed"]).tobytes() == tensors["model.embed"].tobytes()
    assert float(got["model"]["norm"]) == 1.5
    assert got["model"]["layers"]["0"]["w"].dtype == ml_dtypes.bfloat16
    assert got["model"]["layers"]["1"]["w"].tobytes() == tensors["model.layers.1.w"].tobytes()
    assert isinstance(got["lm_head"], np.ndarray) and got["lm_head"].tobytes() == tensors["lm_head"].tobytes()
    whole = objckpt.restore(gcs_store.url, storage_options=gcs_store.storage_options)
    assert whole["model"]["layers"]["0"]["b"].tolist() == tensors["model.layers.0.b"].tolist()


def test_partial_reads_only_the_tensors_named(tmp_path: Path) -> None:
    tensors = _tensors()
    safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    stats = objckpt.TransferStats()
    got = objckpt.restore(str(tmp_path), {"lm_head": None}, partial=True, stats=stats)
    assert got["lm_head"].tobytes() == tensors["lm_head"].tobytes()
    assert stats.bytes_read == tensors["lm_head"].nbytes
    with pytest.raises(TargetMismatchError, match="model.embed"):
        objckpt.restore(str(tmp_path), {"lm_head": None})
    with pytest.raises(TargetMismatchError, match="not in the checkpoint: lm_hed"):
        objckpt.restore(str(tmp_path), {"lm_hed": None}, partial=True)
    with pytest.raises(TargetMismatchError, match="lm_head.*shape"):
        objckpt.restore(str(tmp_path), {"lm_head": jax.ShapeDtypeStruct((32, 64), np.float32)}, partial=True)
    with pytest.raises(TargetMismatchError, match="model.layers.0.b"):  # int32 → int8 loses values
        objckpt.restore(
            str(tmp_path), {"model": {"layers": [{"b": jax.ShapeDtypeStruct((16,), np.int8)}]}}, partial=True
        )


def test_names_map_a_model_familys_tensors_onto_a_tree(tmp_path: Path) -> None:
    tensors = _tensors()
    safetensors_numpy.save_file(tensors, str(tmp_path / "weights.safetensors"))
    target = {"params": {"head": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)}}
    got = restore_safetensors(
        str(tmp_path / "weights.safetensors"), target, names={"params.head": "lm_head"}, partial=True
    )
    assert np.asarray(got["params"]["head"]).tobytes() == tensors["lm_head"].astype(ml_dtypes.bfloat16).tobytes()
    with pytest.raises(CheckpointNotFoundError):
        restore_safetensors(str(tmp_path / "none"))


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_an_export_round_trips_onto_other_shardings(kind: str, store_target_factory: Any) -> None:
    """objckpt → safetensors (sharded, in a bucket) → objckpt.restore onto another mesh: bit-exact."""
    src, dst = store_target_factory(kind), store_target_factory(kind)
    mesh = _mesh()
    rng = np.random.default_rng(1)
    state = {
        "params": {
            "w": jax.device_put(jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16), NamedSharding(mesh, P("x", "y"))),
            "ids": jnp.arange(40, dtype=jnp.int32).reshape(8, 5),
            "mask": np.array([True, False, True]),
        }
    }  # fmt: skip
    objckpt.save(src.url, state, storage_options=src.storage_options)
    stats = objckpt.export_safetensors(src.url, dst.url, max_shard_bytes=1024, src_storage_options=src.storage_options)
    assert stats.files == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    target = {
        "params": {
            "w": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16, sharding=NamedSharding(mesh, P("y", "x"))),
            "ids": jax.ShapeDtypeStruct((8, 5), jnp.int32, sharding=NamedSharding(mesh, P("y"))),
            "mask": None,
        }
    }
    got = objckpt.restore(dst.url, target, storage_options=dst.storage_options)
    assert got["params"]["w"].sharding.spec == P("y", "x")
    for name in ("w", "ids", "mask"):
        assert np.asarray(got["params"][name]).tobytes() == np.asarray(state["params"][name]).tobytes(), name
    one = objckpt.restore(dst.url + "/" + stats.files[1], storage_options=dst.storage_options)
    assert list(_leaves(one)) == ["params.w"]


def test_inspect_and_verify(tmp_path: Path) -> None:
    tensors = _tensors()
    objckpt.save(str(tmp_path / "ckpt"), tensors)  # flat names with dots: exported as they are
    objckpt.export_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "out"), max_shard_bytes=4096)
    info = objckpt.inspect(str(tmp_path / "out"))
    assert info.format == "safetensors" and info.num_blobs == len(list((tmp_path / "out").glob("*.safetensors")))
    assert {p: (leaf.dtype, leaf.shape) for p, leaf in info.leaves.items()} == {
        n: (a.dtype.name, a.shape) for n, a in tensors.items()
    }
    assert info.total_bytes == sum(a.nbytes for a in tensors.values())
    report = objckpt.verify(str(tmp_path / "out"))
    assert report.ok and report.format == "safetensors" and report.arrays == len(tensors)
    assert report.bytes_read == sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    shown = subprocess.run(
        [sys.executable, "-m", "objckpt.cli", "inspect", str(tmp_path / "out"), "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "lm_head" in json.dumps(json.loads(shown.stdout))
    first = sorted((tmp_path / "out").glob("model-*.safetensors"))[0]
    first.write_bytes(first.read_bytes()[:-4])  # cut: verify names it
    checked = subprocess.run(
        [sys.executable, "-m", "objckpt.cli", "verify", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert checked.returncode == 1 and first.name in checked.stdout + checked.stderr
