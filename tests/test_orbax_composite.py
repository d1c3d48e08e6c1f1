"""Orbax Composite checkpoints (issue 55), written by orbax-checkpoint and grain themselves, read by objckpt.

Each step here is what a training job gets from Orbax's ``CheckpointManager``
saving ``ocp.args.Composite``: a ``state`` PyTree (StandardSave of sharded arrays),
a ``config`` item (JsonSave) and a ``dataset`` item written by grain's own
``PyGrainCheckpointHandler`` (one ``process_<i>-of-<n>.json`` per process; the
2-process test runs 2 real JAX processes, each writing its own). objckpt restores
the step in a local directory and on the local S3 server (the directory uploaded as
it is), converts it into a native checkpoint, and names an item it cannot read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from helpers import upload_dir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.errors import FormatError, TargetMismatchError
from tests import multiprocess

ocp = pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tensorstore")
gp = pytest.importorskip("grain.python")

WORKER = Path(__file__).with_name("orbax_composite_worker.py")
CONFIG = {"lr": 3e-4, "layers": [4, 8], "name": "decoder", "warmup": None}


def _state() -> dict[str, Any]:
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 128), dtype=np.float32)
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))),
            "b": jax.device_put(rng.standard_normal(128).astype(jax.numpy.bfloat16), NamedSharding(mesh, P("y"))),
        },
        "step": 7,
    }


def _target(state: dict[str, Any]) -> dict[str, Any]:
    """The state's arrays on another mesh (2x4, other axes), the step as saved."""
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    return {
        "params": {
            "w": jax.ShapeDtypeStruct((256, 128), np.float32, sharding=NamedSharding(mesh, P("b", "a"))),
            "b": jax.ShapeDtypeStruct((128,), jax.numpy.bfloat16, sharding=NamedSharding(mesh, P("b"))),
        },
        "step": None,
    }


def _same_arrays(got: dict[str, Any], want: dict[str, Any]) -> None:
    for name in ("w", "b"):
        a, b = np.asarray(got["params"][name]), np.asarray(want["params"][name])
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    assert got["step"] == want["step"]


def _loader(seed: int = 0) -> Any:
    from items_worker import Source

    sampler = gp.IndexSampler(64, shard_options=gp.NoSharding(), shuffle=True, num_epochs=1, seed=seed)
    return gp.DataLoader(data_source=Source(64), sampler=sampler, operations=[gp.Batch(2)], worker_count=0)


def _save_composite(root: Path, state: dict[str, Any], iterator: Any, **extra: Any) -> None:
    names = ("state", "config", "dataset", *extra)
    with ocp.CheckpointManager(root, item_names=names) as manager:
        manager.save(
            3,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                config=ocp.args.JsonSave(CONFIG),
                dataset=gp.PyGrainCheckpointSave(iterator),
                **extra,
            ),
        )
        manager.wait_until_finished()


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    return _state()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_composite_step_restores_every_item(
    tmp_path: Path, state: dict[str, Any], where: str, request: pytest.FixtureRequest
) -> None:
    """Arrays bit-exact onto another mesh, the JSON document equal, grain's state as its file's
    bytes: a fresh iterator given them draws the batches the saved one draws next."""
    it = iter(_loader())
    for _ in range(5):
        next(it)
    _save_composite(tmp_path / "run", state, it)
    uninterrupted = [next(it)["x"].tolist() for _ in range(4)]
    grain_file = (tmp_path / "run" / "3" / "dataset" / "process_0-of-1.json").read_bytes()
    url, so = str(tmp_path / "run" / "3"), None
    if where == "s3":
        service = request.getfixturevalue("s3_service")
        so = service.storage_options()
        url = service.url(f"composite-{uuid.uuid4().hex[:8]}") + "/3"
        upload_dir(tmp_path / "run" / "3", url, so)

    target = {"state": _target(state), "config": objckpt.Json(), "dataset": objckpt.PerProcess()}
    out = objckpt.restore(url, target, storage_options=so)
    assert sorted(out) == ["config", "dataset", "state"]
    _same_arrays(out["state"], state)
    assert out["state"]["params"]["w"].sharding.mesh.axis_names == ("a", "b")
    assert out["config"] == CONFIG
    assert out["dataset"] == grain_file
    resumed = iter(_loader())
    resumed.set_state(out["dataset"])
    assert [next(resumed)["x"].tolist() for _ in range(4)] == uninterrupted

    whole = objckpt.restore(url, storage_options=so)  # no target: host values, every item
    _same_arrays(whole["state"], state)
    assert whole["config"] == CONFIG and whole["dataset"] == grain_file

    stats = objckpt.TransferStats()  # an item alone reads no array bytes
    alone = objckpt.restore(url, {"config": objckpt.Json()}, partial=True, storage_options=so, stats=stats)
    assert alone == {"config": CONFIG}
    assert stats.bytes_read < 256 * 128 * 4 // 4, stats
    every = objckpt.restore(url, {"dataset": objckpt.PerProcess(all=True)}, partial=True, storage_options=so)
    assert every == {"dataset": [grain_file]}

    info = objckpt.inspect(url, storage_options=so)
    assert info.format == "orbax"
    assert info.leaves["['config']"].kind == "json" and info.leaves["['config']"].value == CONFIG
    assert info.leaves["['dataset']"].kind == "per_process" and info.leaves["['dataset']"].value == [len(grain_file)]
    assert info.leaves["['state']['params']['w']"].shape == (256, 128)
    assert objckpt.verify(url, storage_options=so).ok


def test_the_manager_and_targets_of_the_wrong_kind(tmp_path: Path, state: dict[str, Any]) -> None:
    it = iter(_loader())
    next(it)
    _save_composite(tmp_path / "run", state, it)
    manager = objckpt.CheckpointManager(str(tmp_path / "run"))
    assert manager.steps() == [3]
    out = manager.restore(3, {"state": _target(state), "config": objckpt.Json(), "dataset": objckpt.PerProcess()})
    _same_arrays(out["state"], state)
    assert out["config"] == CONFIG

    url = str(tmp_path / "run" / "3")
    with pytest.raises(TargetMismatchError, match=r"\['dataset'\].*partial=True"):  # an item left out
        objckpt.restore(url, {"state": _target(state), "config": objckpt.Json()})
    with pytest.raises(TargetMismatchError, match=r"\['optimizer'\]"):  # an item the step lacks
        objckpt.restore(url, {"optimizer": None}, partial=True)
    with pytest.raises(TargetMismatchError, match="item 'state': saved a PyTree item, the target asks for Json"):
        objckpt.restore(url, {"state": objckpt.Json()}, partial=True)
    with pytest.raises(TargetMismatchError, match="item 'config': saved a JSON item, the target asks for a dict"):
        objckpt.restore(url, {"config": {"lr": None}}, partial=True)
    with pytest.raises(TargetMismatchError, match="item 'dataset': saved a per-process item"):
        objckpt.restore(url, {"dataset": objckpt.Json()}, partial=True)
    with pytest.raises(TargetMismatchError, match="dict keyed by item name"):
        objckpt.restore(url, [None, None, None])


def test_an_item_objckpt_cannot_read_is_named(tmp_path: Path, state: dict[str, Any]) -> None:
    """An ArrayCheckpointHandler item: restoring or converting the step names it and its handler;
    a partial restore of the other items still works."""
    _save_composite(tmp_path / "run", state, iter(_loader()), raw=ocp.args.ArraySave(np.arange(6)))
    url = str(tmp_path / "run" / "3")
    with pytest.raises(FormatError, match=r"run/3/raw was written by .*ArrayCheckpointHandler"):
        objckpt.restore(url)
    with pytest.raises(FormatError, match=r"run/3/raw was written by .*ArrayCheckpointHandler"):
        objckpt.restore(url, {"raw": None}, partial=True)
    with pytest.raises(FormatError, match=r"run/3/raw was written by .*ArrayCheckpointHandler"):
        objckpt.convert_orbax(url, str(tmp_path / "native"))
    out = objckpt.restore(url, {"config": objckpt.Json(), "state": None}, partial=True)
    assert out["config"] == CONFIG and out["state"]["step"] == 7
    assert objckpt.inspect(url).leaves["['raw']"].kind == "unreadable"
    report = objckpt.verify(url)
    assert not report.ok and "raw" in str(report)


def test_a_composite_step_converts_into_a_native_checkpoint(
    tmp_path: Path, state: dict[str, Any], s3_service: Any
) -> None:
    """``objckpt cp`` of a manager root on S3: the step's items become a native ``json`` leaf and
    ``per_process`` leaf beside the arrays; the result verifies and restores bit-exact."""
    it = iter(_loader())
    next(it)
    _save_composite(tmp_path / "run", state, it)
    grain_file = (tmp_path / "run" / "3" / "dataset" / "process_0-of-1.json").read_bytes()
    dst = s3_service.url(f"converted-{uuid.uuid4().hex[:8]}")
    env = {**os.environ, **s3_service.env(), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "objckpt.cli", "cp", str(tmp_path / "run"), f"{dst}/run", "--steps", "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    so = s3_service.storage_options()
    manager = objckpt.CheckpointManager(f"{dst}/run", storage_options=so)
    assert manager.steps() == [3]
    url = manager.step_url(3)
    info = objckpt.inspect(url, storage_options=so)
    assert info.format == "objckpt" and info.metadata["converted_from"] == str(tmp_path / "run" / "3")
    assert info.leaves["['config']"].kind == "json" and info.leaves["['config']"].value == CONFIG
    assert info.leaves["['dataset']"].kind == "per_process" and info.leaves["['dataset']"].value == [len(grain_file)]
    assert objckpt.verify(url, storage_options=so).ok
    out = manager.restore(3, {"state": _target(state), "config": objckpt.Json(), "dataset": objckpt.PerProcess()})
    _same_arrays(out["state"], state)
    assert out["config"] == CONFIG and out["dataset"] == grain_file


def test_grain_items_of_two_processes(tmp_path: Path, s3_service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two JAX processes save a Composite step with Orbax (grain's handler writes each process's
    file); objckpt restores it on both, each process its own iterator state (its next batches
    are the uninterrupted ones); one process gets a TargetMismatchError naming the item and both
    counts, or every value with ``PerProcess(all=True)``; the conversion keeps both values."""
    monkeypatch.setattr(multiprocess, "WORKER", WORKER)
    root = tmp_path / "run"
    job = {"kind": "orbax_composite", "root": str(root), "seed": 11, "config": CONFIG}
    errors: list[str] = []
    results = multiprocess.run_processes(2, job, stderr=errors, timeout=300)
    assert all(r is not None for r in results), "\n".join(e[-3000:] for e in errors)
    files = [(root / "3" / "dataset" / f"process_{p}-of-2.json").read_text() for p in range(2)]
    for p, result in enumerate(results):
        assert result is not None
        assert result["resumed"] == result["uninterrupted"], p  # resumed where this process left off
        assert result["dataset"] == files[p] and result["config"] == CONFIG and result["step"] == 3
        assert result["w_exact"], p
    assert files[0] != files[1]  # each process its own shard, so its own state

    url = str(root / "3")
    with pytest.raises(TargetMismatchError, match=r"'dataset'.*saved by 2 processes, restored on 1"):
        objckpt.restore(url, {"dataset": objckpt.PerProcess()}, partial=True)
    every = objckpt.restore(url, {"dataset": objckpt.PerProcess(all=True)}, partial=True)
    assert every["dataset"] == [f.encode() for f in files]

    so = s3_service.storage_options()
    dst = s3_service.url(f"converted-{uuid.uuid4().hex[:8]}")
    objckpt.convert_orbax(url, dst, dst_storage_options=so)
    assert objckpt.verify(dst, storage_options=so).ok
    info = objckpt.inspect(dst, storage_options=so)
    assert info.num_processes == 2 and info.leaves["['dataset']"].value == [len(f) for f in files]
    with pytest.raises(TargetMismatchError, match=r"\['dataset'\].*saved by 2 processes, restored on 1"):
        objckpt.restore(dst, {"dataset": objckpt.PerProcess()}, partial=True, storage_options=so)
    native = multiprocess.run_processes(
        2, {"kind": "native_items", "url": dst, "storage_options": so}, stderr=errors, timeout=240
    )
    assert [r and r["dataset"] for r in native] == files, errors
    assert all(r is not None and r["w_exact"] and r["config"] == CONFIG for r in native)


def test_the_grain_files_are_checked(tmp_path: Path, state: dict[str, Any]) -> None:
    """A process's file missing (a step copied in part) is a FormatError naming the item and the process."""
    _save_composite(tmp_path / "run", state, iter(_loader()))
    item = tmp_path / "run" / "3" / "dataset"
    (item / "process_0-of-1.json").rename(item / "process_1-of-2.json")
    with pytest.raises(FormatError, match=r"run/3/dataset: grain's files of 2 processes lack process 0"):
        objckpt.restore(str(tmp_path / "run" / "3"))
    assert json.loads((tmp_path / "run" / "3" / "config" / "metadata").read_text()) == CONFIG
