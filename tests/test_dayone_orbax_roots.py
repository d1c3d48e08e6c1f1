"""A training job switching from Orbax keeps its root: objckpt's CheckpointManager continues it.

Each root here is written by orbax-checkpoint's own ``CheckpointManager`` (on local
disk, then uploaded byte for byte to the S3 server and the GCS emulator, as
``gsutil rsync`` would): objckpt lists its steps, restores them bit-exact onto
another mesh, reads Orbax's metrics, saves new steps beside them, and retention
leaves them alone unless ``Retention(delete_orbax_steps=True)``. ``objckpt verify`` reads
every chunk of an Orbax step and names the leaf whose chunk is damaged.
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
from objckpt.storage import from_url
from objckpt.transfer import runtime

ocp = pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tensorstore")


def _state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    return {
        "w": jax.device_put(rng.standard_normal((16, 8), dtype=np.float32), NamedSharding(mesh, P("x", "y"))),
        "b": jax.device_put(rng.integers(-9, 9, (8,)).astype(np.int32), NamedSharding(mesh, P())),
    }


def _target() -> dict[str, Any]:
    """The state's shapes on another mesh (2x4, axes swapped)."""
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    return {
        "w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=NamedSharding(mesh, P("b", "a"))),
        "b": jax.ShapeDtypeStruct((8,), np.int32, sharding=NamedSharding(mesh, P("b"))),
    }


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        a, b = np.asarray(got[name]), np.asarray(want[name])
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name


def _orbax_root(root: Path, steps: tuple[int, ...], **manager_kw: Any) -> dict[int, dict[str, Any]]:
    """Orbax's CheckpointManager saves ``steps`` under ``root`` with metrics (``best_fn`` makes it write them)."""
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    states = {}
    with ocp.CheckpointManager(root, options=options, **manager_kw) as manager:
        for step in steps:
            states[step] = _state(step)
            args = ocp.args.StandardSave(states[step])
            if "item_names" in manager_kw:
                args = ocp.args.Composite(state=args)
            manager.save(step, args=args, metrics={"loss": 1.0 / step, "acc": step / 10})
        manager.wait_until_finished()
    return states


def _files(directory: Path) -> list[Path]:
    """The files under ``directory`` (a local delete may leave empty directories behind)."""
    return [p for p in directory.rglob("*") if p.is_file()]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "objckpt.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)


def test_a_manager_continues_an_orbax_root_on_local_disk(tmp_path: Path) -> None:
    root = tmp_path / "run"
    states = _orbax_root(root, (10, 20))
    manager = objckpt.CheckpointManager(str(root), retention=objckpt.Retention(keep_last=1))
    assert manager.steps() == [10, 20] and manager.latest_step() == 20
    _same(manager.restore(manager.latest_step(), _target()), states[20])
    _same(manager.restore(10), jax.tree.map(np.asarray, states[10]))
    assert manager.metrics(20) == {"loss": 1.0 / 20, "acc": 2.0}
    assert manager.inspect(20).format == "orbax"

    with pytest.raises(objckpt.CheckpointExistsError, match="Orbax step"):
        manager.save(20, _state(99))
    manager.save(30, _state(30), metrics={"loss": 0.01}, wait=True)
    manager.save(40, _state(40), metrics={"loss": 0.02}, wait=True)
    # keep_last=1 deleted objckpt's step 30, never Orbax's
    assert manager.steps() == [10, 20, 40] and manager.latest_step() == 40
    assert (root / "10" / "default" / "_METADATA").is_file() and not _files(root / "step_0000000030")
    _same(manager.restore(40, _target()), _state(40))
    listed = _cli("ls", str(root), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [(r["step"], r["format"], r["committed"]) for r in json.loads(listed.stdout)]
    assert rows == [(10, "orbax", True), (20, "orbax", True), (40, "objckpt", True)], rows
    assert manager.metrics(40) == {"loss": 0.02}
    manager.close()

    # A root with named items (and Orbax's metrics item beside them) restores its one state item.
    named = tmp_path / "named"
    named_states = _orbax_root(named, (5,), item_names=("state",))
    with objckpt.CheckpointManager(str(named)) as other:
        assert other.latest_step() == 5 and other.metrics(5)["loss"] == 0.2
        _same(other.restore(5, _target()), named_states[5])

    # Asked explicitly, retention ranks and deletes Orbax steps too.
    with objckpt.CheckpointManager(
        str(root), retention=objckpt.Retention(keep_last=1, delete_orbax_steps=True)
    ) as pruning:
        pruning.save(50, _state(50), wait=True)
        assert pruning.steps() == [50]
    assert not _files(root / "10") and not _files(root / "20") and _files(root / "step_0000000050")
    _same(objckpt.CheckpointManager(str(root)).restore(None, _target()), _state(50))


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_manager_continues_an_orbax_root_in_a_bucket(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = _orbax_root(tmp_path / "run", (1, 2))
    service = request.getfixturevalue(f"{kind}_service")
    url, options = service.url(f"orbax-root-{uuid.uuid4().hex[:8]}"), service.storage_options()
    upload_dir(tmp_path / "run", url, options)
    # a crashed Orbax save in a bucket: its step metadata without commit_success.txt
    crashed = tmp_path / "run" / "2"
    upload_dir(crashed, f"{url}/3", options)
    runtime.run_sync(from_url(f"{url}/3", **options).delete("commit_success.txt"))
    if kind == "gcs":  # how tensorstore reaches a GCS emulator
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", service.endpoint_url)
        monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")

    manager = objckpt.CheckpointManager(url, storage_options=options, retention=objckpt.Retention(keep_last=1))
    assert manager.steps() == [1, 2] and manager.latest_step() == 2  # step 3 never committed
    listed = _cli("ls", url, "--json", env=service.env())
    assert listed.returncode == 0, listed.stderr
    rows = [(r["step"], r["format"], r["committed"]) for r in json.loads(listed.stdout)]
    assert rows == [(1, "orbax", True), (2, "orbax", True), (3, "orbax", False)], rows
    _same(manager.restore(2, _target()), states[2])
    assert manager.metrics(1) == {"loss": 1.0, "acc": 0.1}
    manager.save(4, _state(4), wait=True)
    manager.save(5, _state(5), wait=True)
    assert manager.steps() == [1, 2, 5]
    _same(manager.restore(None, _target()), _state(5))
    manager.close()


def test_verify_reads_every_chunk_of_an_orbax_step_and_names_a_damaged_leaf(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _orbax_root(root, (1,))
    ok = _cli("verify", str(root / "1"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK" in ok.stdout and "Orbax checkpoint, 2 arrays" in ok.stdout and "decoded" in ok.stdout, ok.stdout
    report = objckpt.verify(str(root / "1"))
    assert report.ok and report.format == "orbax" and report.bytes_read == 16 * 8 * 4 + 8 * 4

    # The per-array layout (one file per chunk) lets one leaf's chunk be damaged alone.
    plain = tmp_path / "plain"
    with ocp.CheckpointManager(plain, item_handlers=ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as manager:
        manager.save(7, args=ocp.args.PyTreeSave(_state(7)))
        manager.wait_until_finished()
    chunks = sorted(p for p in (plain / "7" / "default" / "w").glob("*.*") if not p.name.startswith("."))
    assert chunks, sorted(p.name for p in (plain / "7" / "default").iterdir())
    chunks[0].write_bytes(b"\x00not zstd" * 16)
    bad = _cli("verify", str(plain / "7"), "--json")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    doc = json.loads(bad.stdout)
    assert not doc["ok"] and doc["format"] == "orbax"
    assert [(p["kind"], p["leaf"]) for p in doc["problems"]] == [("unreadable", "['w']")], doc
    assert "['w']" in doc["problems"][0]["message"] and "chunks" in doc["problems"][0]["message"]
