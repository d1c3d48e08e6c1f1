"""objckpt.export_safetensors and ``objckpt export``: checkpoints written as Hugging Face safetensors.

Every export is loaded back with the ``safetensors`` library itself (``safe_open``, numpy and
flax frameworks) and compared bit for bit with the saved state; the files go to local disk,
S3 (SeaweedFS) and GCS (fake-gcs-server), read back through the store.
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.errors import FormatError, ObjectExistsError
from objckpt.transfer import runtime

safetensors = pytest.importorskip(
    "safetensors", reason="the safetensors library (pyproject's dev extra) checks what export writes"
)
from safetensors import safe_open  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))


def _state() -> dict[str, Any]:
    """Every dtype safetensors has, sharded and not, with values that exercise every bit pattern class."""
    rng = np.random.default_rng(7)
    mesh = _mesh()
    sharded = NamedSharding(mesh, P("x", "y"))
    f32 = rng.standard_normal((64, 48)).astype(np.float32)
    return {
        "params": {
            "embed": jax.device_put(jnp.asarray(f32, jnp.bfloat16), sharded),
            "layers": [
                {"w": jax.device_put(jnp.asarray(f32), NamedSharding(mesh, P(None, "x"))), "b": jnp.arange(48.0)},
                {"w": jnp.asarray(f32[:16, :16], jnp.float16), "b": np.linspace(-1, 1, 16)},
            ],
            "fp8": np.asarray(f32[:8], ml_dtypes.float8_e4m3fn),
            "fp8b": np.asarray(f32[:8], ml_dtypes.float8_e5m2),
        },
        "ints": {
            "i32": jax.device_put(jnp.arange(64 * 8, dtype=jnp.int32).reshape(64, 8), NamedSharding(mesh, P("x"))),
            "i8": np.array([-128, -1, 0, 127], np.int8),
            "u64": np.array([0, 2**64 - 1, 12345], np.uint64),
            "u16": np.array([1, 65535], np.uint16),
            "mask": np.array([[True, False], [False, True]]),
            "c64": np.array([1 + 2j, -3.5j], np.complex64),
            "scalar": np.array(3, np.int64),
        },
    }


def _flat(tree: Any) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        out[name] = np.asarray(leaf)
    return out


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


#: safetensors dtypes the library's numpy and flax frameworks cannot build (numpy has no float8):
#: safe_open checks their dtype and shape, and their bytes are compared as they lie in the file.
_RAW = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu}


def _raw_tensor(path: Path, key: str) -> np.ndarray:
    """A tensor's bytes at the offsets the file's own header gives (read here, not by objckpt)."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    entry = json.loads(blob[8 : 8 + n])[key]
    begin, end = entry["data_offsets"]
    return np.frombuffer(blob[8 + n + begin : 8 + n + end], _RAW[entry["dtype"]]).reshape(entry["shape"])


def _load_dir(directory: Path, framework: str = "numpy") -> dict[str, Any]:
    """Every tensor of an export, loaded with safe_open; the index checked to name each once."""
    files = sorted(p.name for p in directory.iterdir() if p.name.endswith(".safetensors"))
    out: dict[str, Any] = {}
    for name in files:
        with safe_open(str(directory / name), framework=framework) as f:
            for key in f.keys():
                assert key not in out, f"{key} in two files"
                sliced = f.get_slice(key)
                if sliced.get_dtype() in _RAW:
                    out[key] = _raw_tensor(directory / name, key)
                    assert list(out[key].shape) == sliced.get_shape()
                else:
                    out[key] = f.get_tensor(key)
    if (directory / "model.safetensors.index.json").exists():
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(out)
        assert set(index["weight_map"].values()) == set(files)
        assert framework != "numpy" or index["metadata"]["total_size"] == sum(
            np.asarray(v).nbytes for v in out.values()
        )
    else:
        assert files == ["model.safetensors"]
    return out


def _download(target: Any, dest: Path) -> Path:
    """An export in a bucket, fetched file by file through objckpt's store (what a loader would GET)."""
    store = target.open()
    dest.mkdir(parents=True, exist_ok=True)
    try:
        for info in runtime.run_sync(store.list("")):
            (dest / info.key).write_bytes(runtime.run_sync(store.get(info.key)))
    finally:
        runtime.run_sync(store.close())
    return dest


def test_export_loads_bit_exact_with_safe_open_numpy_and_flax(tmp_path: Path) -> None:
    state = _state()
    objckpt.save(str(tmp_path / "ckpt"), state)
    stats = objckpt.export_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "out"), max_shard_bytes=8 * 1024)
    want = _flat(state)
    assert stats.tensors == len(want) and stats.tensor_bytes == sum(a.nbytes for a in want.values())
    assert len(stats.files) > 2 and stats.files[-1] == "model.safetensors.index.json"
    assert all(
        f.startswith("model-") and f.endswith(f"-of-{len(stats.files) - 1:05d}.safetensors") for f in stats.files[:-1]
    )
    loaded = _load_dir(tmp_path / "out")
    assert sorted(loaded) == sorted(want)
    for name, array in want.items():
        assert loaded[name].dtype == array.dtype, name
        assert loaded[name].shape == array.shape, name
        assert _bits(loaded[name]) == _bits(array), name
    flax = _load_dir(tmp_path / "out", framework="flax")
    for name, array in want.items():
        if array.dtype.itemsize == 8 and array.dtype.kind != "c":
            continue  # JAX without x64 makes 64-bit tensors 32-bit: safetensors' flax loader is not bit-exact there
        assert isinstance(flax[name], jax.Array) or array.dtype.name.startswith("float8")
        assert _bits(np.asarray(flax[name])) == _bits(array), name


def test_export_fitting_one_shard_is_model_safetensors_without_index(tmp_path: Path) -> None:
    state = {"a": np.arange(10, dtype=np.float32), "b": {"c": np.ones((3, 3), np.int32)}}
    objckpt.save(str(tmp_path / "ckpt"), state)
    stats = objckpt.export_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert stats.files == ["model.safetensors"]
    loaded = _load_dir(tmp_path / "out")
    assert sorted(loaded) == ["a", "b.c"]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_export_to_a_bucket_from_a_bucket(kind: str, store_target_factory: Any, tmp_path: Path) -> None:
    src, dst = store_target_factory(kind), store_target_factory(kind)
    state = _state()
    objckpt.save(src.url, state, storage_options=src.storage_options)
    reports: list[objckpt.Progress] = []
    stats = objckpt.export_safetensors(
        src.url, dst.url, max_shard_bytes=16 * 1024, src_storage_options=src.storage_options, progress=reports.append
    )
    assert reports and reports[-1].finished and reports[-1].done_bytes == reports[-1].total_bytes == stats.tensor_bytes
    assert reports[-1].operation == "export"
    loaded = _load_dir(_download(dst, tmp_path / "got"))
    for name, array in _flat(state).items():
        assert _bits(loaded[name]) == _bits(array), name


def test_subtree_names_and_dtype(tmp_path: Path) -> None:
    state = _state()
    objckpt.save(str(tmp_path / "ckpt"), state)
    objckpt.export_safetensors(
        str(tmp_path / "ckpt"),
        str(tmp_path / "sub"),
        subtree="params",
        names=lambda n: None if n.startswith("fp8") else "model." + n,
        dtype="bfloat16",
    )
    loaded = _load_dir(tmp_path / "sub")
    want = {k: v for k, v in _flat(state["params"]).items() if not k.startswith("fp8")}
    assert sorted(loaded) == sorted("model." + k for k in want)
    for name, array in want.items():
        got = loaded["model." + name]
        assert got.dtype == ml_dtypes.bfloat16
        assert _bits(got) == _bits(np.asarray(array).astype(ml_dtypes.bfloat16)), name
    objckpt.export_safetensors(
        str(tmp_path / "ckpt"), str(tmp_path / "mapped"), subtree="ints", names={"i32": "transformer.h.0.w"}
    )
    assert "transformer.h.0.w" in _load_dir(tmp_path / "mapped")
    with pytest.raises(FormatError, match="nope"):
        objckpt.export_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "x"), subtree="ints", names={"nope": "a"})


@pytest.mark.parametrize(
    ("leaf", "said"),
    [
        (np.zeros(4, ml_dtypes.int4), "int4"),
        (np.zeros(2, ml_dtypes.float8_e4m3fnuz), "float8_e4m3fnuz"),
        (np.zeros(2, np.complex128), "complex128"),
        ("some text", "not an array"),
        (7, "not an array"),
    ],
)
def test_a_leaf_safetensors_cannot_hold_is_refused_by_name(tmp_path: Path, leaf: Any, said: str) -> None:
    objckpt.save(str(tmp_path / "ckpt"), {"ok": np.ones(3, np.float32), "odd": {"leaf": leaf}})
    with pytest.raises(FormatError, match=r"\['odd'\]\['leaf'\].*" + said):
        objckpt.export_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    objckpt.export_safetensors(
        str(tmp_path / "ckpt"), str(tmp_path / "out"), names=lambda n: None if n == "odd.leaf" else n
    )
    assert list(_load_dir(tmp_path / "out")) == ["ok"]


def test_prng_keys_and_clashing_names_are_refused(tmp_path: Path) -> None:
    objckpt.save(str(tmp_path / "k"), {"key": jax.random.key(0), "w": np.ones(2)})
    with pytest.raises(FormatError, match=r"\['key'\].*PRNG"):
        objckpt.export_safetensors(str(tmp_path / "k"), str(tmp_path / "out"))
    objckpt.save(str(tmp_path / "c"), {"a": np.ones(2), "b": np.zeros(2)})
    with pytest.raises(FormatError, match=r"\['a'\] and \['b'\] are both named 'w'"):
        objckpt.export_safetensors(str(tmp_path / "c"), str(tmp_path / "out"), names=lambda n: "w")


def test_an_existing_export_is_left_intact(tmp_path: Path) -> None:
    objckpt.save(str(tmp_path / "ckpt"), {"w": np.arange(4.0)})
    objckpt.export_safetensors(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    before = (tmp_path / "out" / "model.safetensors").read_bytes()
    objckpt.save(str(tmp_path / "other"), {"w": np.zeros(4)})
    with pytest.raises(ObjectExistsError, match="model.safetensors"):
        objckpt.export_safetensors(str(tmp_path / "other"), str(tmp_path / "out"))
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before
    objckpt.export_safetensors(str(tmp_path / "other"), str(tmp_path / "out"), overwrite=True)
    assert _bits(_load_dir(tmp_path / "out")["w"]) == _bits(np.zeros(4))


def test_parts_write_disjoint_files_that_make_one_export(tmp_path: Path) -> None:
    state = {f"w{i}": np.full((256,), i, np.float32) for i in range(6)}
    objckpt.save(str(tmp_path / "ckpt"), state)
    written = []
    for k in (1, 2, 0):  # the process writing the index goes last
        stats = objckpt.export_safetensors(
            str(tmp_path / "ckpt"), str(tmp_path / "out"), max_shard_bytes=2048, part=(k, 3)
        )
        written.append(set(stats.files))
    assert [len(w) for w in written] == [1, 1, 2] and len(set().union(*written)) == 4  # 3 files, the index
    loaded = _load_dir(tmp_path / "out")
    assert {k: _bits(v) for k, v in loaded.items()} == {k: _bits(v) for k, v in state.items()}


_PEAK_CHILD = """
import resource, sys, numpy as np, objckpt
src, dest = sys.argv[1], sys.argv[2]
objckpt.save(dest + "/warm", {"w": np.ones(4, np.float32)})
objckpt.export_safetensors(dest + "/warm", dest + "/warm-out")  # every import and first-use cost paid
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
objckpt.export_safetensors(src, dest + "/out", max_shard_bytes=8 * 2**20)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_export_holds_one_shard_in_memory(tmp_path: Path) -> None:
    """A fresh process's peak RSS grows by about one file's tensors, not the checkpoint's 96 MiB."""
    objckpt.save(str(tmp_path / "ckpt"), {f"w{i}": np.full((1024, 1024), i, np.float32) for i in range(24)})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    run = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, str(tmp_path / "ckpt"), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    grown = int(run.stdout.split()[-1])
    assert len(list((tmp_path / "out").iterdir())) == 13  # 12 files of 8 MiB and the index
    assert grown < 48 * 2**20, f"peak RSS grew {grown / 2**20:.0f} MiB exporting 96 MiB in 8 MiB files"


def test_cli_export(tmp_path: Path) -> None:
    objckpt.save(str(tmp_path / "ckpt"), {"params": {"w": np.arange(6, dtype=np.int32)}, "step": np.array(3)})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    run = subprocess.run(
        [sys.executable, "-m", "objckpt.cli", "export", str(tmp_path / "ckpt"), str(tmp_path / "out"),
         "--format", "safetensors", "--subtree", "params", "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["files"] == ["model.safetensors"]
    assert _bits(_load_dir(tmp_path / "out")["w"]) == _bits(np.arange(6, dtype=np.int32))
    bad = subprocess.run(
        [sys.executable, "-m", "objckpt.cli", "export", str(tmp_path / "nothing"), str(tmp_path / "o2")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 1 and "nothing" in bad.stderr
