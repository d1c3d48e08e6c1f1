"""Orbax checkpoints, written by orbax-checkpoint itself, restored by objckpt onto other meshes.

Every checkpoint here is written by a current ``orbax-checkpoint`` (the
layouts users have: ``StandardCheckpointer``, ``PyTreeCheckpointer`` with
scalars and strings, zarr3, the older per-array layout without OCDBT, a
``CheckpointManager`` root with named items) into a local directory, and
read by objckpt from there, or from the S3 server and the GCS emulator after
the directory is uploaded as it is (as ``gsutil rsync`` would). Restores go
onto meshes other than the saved one, bit-exact.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import upload_dir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.errors import FormatError, TargetMismatchError

ocp = pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tensorstore")


def _state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    return {
        "params": {
            "w": jax.device_put(rng.standard_normal((64, 48), dtype=np.float32), NamedSharding(mesh, P("x", "y"))),
            "emb": jax.device_put(
                jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16), NamedSharding(mesh, P(None, "y"))
            ),
            "layers": [
                jax.device_put(rng.integers(-8, 8, (16,)).astype(jnp.int4), NamedSharding(mesh, P("x"))),
                jnp.asarray(rng.standard_normal(8), jnp.float8_e4m3fn),
            ],
        },
        "opt": {"count": jnp.asarray(7, jnp.int32), "mu": jnp.zeros((64, 48), jnp.float32)},
        "step": 1200,
        "lr": 3e-4,
    }


def _host(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)


def _assert_same(got: Any, want: Any) -> None:
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    want_leaves = jax.tree_util.tree_flatten_with_path(want)[0]
    assert [jax.tree_util.keystr(p) for p, _ in got_leaves] == [jax.tree_util.keystr(p) for p, _ in want_leaves]
    for (path, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
        if isinstance(b, (np.ndarray, jax.Array)):
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
            assert a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)
        else:
            assert a == b and type(a) is type(b), (jax.tree_util.keystr(path), a, b)


def _other_target(state: dict[str, Any]) -> Any:
    """The state's arrays as ShapeDtypeStructs on a 2x4 mesh (other axes), scalars as placeholders."""
    mesh = jax.make_mesh((2, 4), ("a", "b"))

    def leaf(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        spec = P("b", "a") if x.ndim == 2 and x.shape[0] % 4 == 0 and x.shape[1] % 2 == 0 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree.map(leaf, state)


def _save_standard(path: Path, state: Any) -> None:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    return _state()


@pytest.mark.parametrize(
    "layout",
    ["standard", "zarr3", "pytree-no-ocdbt"],
)
def test_orbax_layouts_restore_onto_another_mesh(tmp_path: Path, state: dict[str, Any], layout: str) -> None:
    path = tmp_path / "ckpt"
    if layout == "standard":
        _save_standard(path, state)
    elif layout == "zarr3":
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True)).save(path, state)
    else:
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(path, state)
    out = objckpt.restore(str(path), _other_target(state))
    _assert_same(out, state)
    assert out["params"]["w"].sharding.mesh.axis_names == ("a", "b")
    _assert_same(objckpt.restore(str(path)), _host(state))  # no target: numpy, as saved


def test_scalars_and_strings_and_partial_reads(tmp_path: Path, state: dict[str, Any]) -> None:
    tree = {**state, "name": "run-7", "tags": ["a", "b"]}
    ocp.PyTreeCheckpointer().save(tmp_path / "ckpt", tree)
    url = str(tmp_path / "ckpt")
    out = objckpt.restore(url)
    assert out["name"] == "run-7" and out["tags"] == ["a", "b"] and out["step"] == 1200 and out["lr"] == 3e-4
    stats = objckpt.TransferStats()
    part = objckpt.restore(url, {"params": {"w": None}}, partial=True, stats=stats)
    assert np.asarray(part["params"]["w"]).tobytes() == np.asarray(state["params"]["w"]).tobytes()
    assert stats.bytes_read == 64 * 48 * 4  # nothing else read
    with pytest.raises(TargetMismatchError, match=r"\['opt'\]\['mu'\]"):
        objckpt.restore(url, {"params": {"w": None}})


def test_manager_root_steps_and_named_items(tmp_path: Path, state: dict[str, Any]) -> None:
    root = tmp_path / "run"
    with ocp.CheckpointManager(root, item_names=("state", "extra")) as manager:
        for step in (10, 20):
            manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave({"step": step, "note": "x"})
                ),
            )
        manager.wait_until_finished()
    out = objckpt.restore(f"{root}/20/state", _other_target(state))
    _assert_same(out, state)
    with pytest.raises(FormatError, match="extra"):  # a JSON item is not a pytree of arrays
        objckpt.restore(f"{root}/20/extra")
    whole = objckpt.restore(f"{root}/20")  # a Composite step: every item by name (tests/test_orbax_composite.py)
    assert whole["extra"] == {"step": 20, "note": "x"}
    _assert_same(whole["state"], _host(state))

    default_root = tmp_path / "default-run"
    with ocp.CheckpointManager(default_root) as manager:
        manager.save(5, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
    _assert_same(objckpt.restore(f"{default_root}/5", _other_target(state)), state)  # the `default` item


def test_a_target_that_does_not_fit_is_refused_before_reading(tmp_path: Path, state: dict[str, Any]) -> None:
    _save_standard(tmp_path / "ckpt", state)
    target = _other_target(state)
    target["params"]["w"] = jax.ShapeDtypeStruct((64, 47), np.float32)
    with pytest.raises(TargetMismatchError, match=r"\['params'\]\['w'\].*\(64, 48\)"):
        objckpt.restore(str(tmp_path / "ckpt"), target)
    target["params"]["w"] = jax.ShapeDtypeStruct((64, 48), np.int32)
    with pytest.raises(TargetMismatchError, match="float32 to target dtype int32"):
        objckpt.restore(str(tmp_path / "ckpt"), target)


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_orbax_checkpoints_in_buckets(
    tmp_path: Path, state: dict[str, Any], kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save_standard(tmp_path / "ckpt", state)
    service = request.getfixturevalue(f"{kind}_service")
    url = service.url(f"orbax-{uuid.uuid4().hex[:8]}")
    options = service.storage_options()
    upload_dir(tmp_path / "ckpt", url, options)
    if kind == "gcs":  # how tensorstore reaches a GCS emulator
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", service.endpoint_url)
        monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    stats = objckpt.TransferStats()
    out = objckpt.restore(url, _other_target(state), storage_options=options, stats=stats)
    _assert_same(out, state)
    assert stats.bytes_read >= sum(np.asarray(x).nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array))


def test_no_tensorstore_names_the_extra(tmp_path: Path, state: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    _save_standard(tmp_path / "ckpt", state)
    monkeypatch.setitem(sys.modules, "tensorstore", None)
    with pytest.raises(objckpt.errors.StoreNotAvailableError, match=r"objckpt\[orbax\]"):
        objckpt.restore(str(tmp_path / "ckpt"))


def test_nothing_there_is_still_not_found(tmp_path: Path) -> None:
    os.makedirs(tmp_path / "empty")
    with pytest.raises(objckpt.CheckpointNotFoundError):
        objckpt.restore(str(tmp_path / "empty"))


def test_inspect_and_the_command_line_describe_orbax_checkpoints(tmp_path: Path, state: dict[str, Any]) -> None:
    import json
    import subprocess
    import sys

    root = tmp_path / "run"
    with ocp.CheckpointManager(root) as manager:
        for step in (100, 200):
            manager.save(step, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
    info = objckpt.inspect(f"{root}/200")
    assert info.format == "orbax" and info.url.endswith("/200/default")
    w = info.leaves["['params']['w']"]
    assert (w.dtype, w.shape, w.nbytes) == ("float32", (64, 48), 64 * 48 * 4)
    assert w.sharding == {"type": "NamedSharding", "mesh": {"x": 4, "y": 2}, "spec": ["x", "y"]}
    assert info.leaves["['params']['layers'][0]"].dtype == "int4"
    assert info.leaves["['params']['emb']"].dtype == "bfloat16"
    assert info.total_bytes >= 2 * 64 * 48 * 4

    cli = [sys.executable, "-m", "objckpt.cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    listing = subprocess.run([*cli, "ls", str(root), "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert listing.returncode == 0, listing.stderr
    rows = json.loads(listing.stdout)
    assert [(r["step"], r["format"], r["committed"]) for r in rows] == [(100, "orbax", True), (200, "orbax", True)]
    table = subprocess.run([*cli, "ls", str(root)], capture_output=True, text=True, env=env, timeout=120)
    assert "FORMAT" in table.stdout and table.stdout.count("orbax") == 2, table.stdout
    shown = subprocess.run([*cli, "inspect", f"{root}/200"], capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0 and "Orbax checkpoint" in shown.stdout and "mesh(x=4,y=2)" in shown.stdout, (
        shown.stdout
    )


def test_a_multi_process_orbax_save_restores_in_any_number_of_processes(tmp_path: Path) -> None:
    """Two JAX processes save with Orbax (one ``ocdbt.process_N`` each); two processes restore
    onto another mesh, and one process onto all 8 devices here, bit-exact."""
    import mp_worker
    from multiprocess import run_processes

    path = str(tmp_path / "ckpt")
    job = {"kind": "orbax_save", "path": path, "mesh": [2, 4], "axes": ["data", "model"], "extras": False}
    errors: list[str] = []
    saved = run_processes(2, job, stderr=errors, timeout=240)
    assert saved == [{"saved": path}] * 2, errors
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} >= {"ocdbt.process_0", "ocdbt.process_1"}
    assert objckpt.inspect(path).num_processes == 2

    restore = {"kind": "restore", "url": path, "mesh": [4, 2], "axes": ["data", "model"], "extras": False}
    restored = run_processes(2, restore, stderr=errors, timeout=240)
    assert all(r is not None and r["mismatches"] == [] for r in restored), (restored, errors)

    mesh = jax.make_mesh((8,), ("all",))
    target = {
        "params": {
            name: jax.ShapeDtypeStruct(mp_worker.shape_of(name), jnp.dtype(dtype), sharding=NamedSharding(mesh, P()))
            for name, (_, dtype, _) in mp_worker.LEAVES.items()
        }
    }
    out = objckpt.restore(path, target)
    for name in mp_worker.LEAVES:
        assert np.asarray(out["params"][name]).tobytes() == mp_worker.global_value(name).tobytes(), name


def test_a_chunk_that_does_not_decode_is_an_error_naming_the_leaf(tmp_path: Path, state: dict[str, Any]) -> None:
    """Never wrong data: a damaged chunk (here of the per-array layout, one file per chunk) fails
    the restore with the leaf's name, rather than restoring something else."""
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(tmp_path / "ckpt", state)
    chunk = tmp_path / "ckpt" / "params.w" / "0.0"
    assert chunk.is_file(), sorted(p.name for p in (tmp_path / "ckpt" / "params.w").iterdir())
    chunk.write_bytes(b"\x00not zstd" * 64)
    with pytest.raises(objckpt.StoreError, match=r"\['params'\]\['w'\].*params\.w"):
        objckpt.restore(str(tmp_path / "ckpt"), _other_target(state))


# ------------------------------------------------------------------ conversion


def test_conversion_round_trips_within_a_small_memory_budget(tmp_path: Path, state: dict[str, Any]) -> None:
    """A budget far below the checkpoint: many slab groups, the big leaf cut into slabs. The
    result verifies and restores to the bits the Orbax original restores to, onto any mesh."""
    tree = {**state, "name": "run-7"}
    ocp.PyTreeCheckpointer().save(tmp_path / "orbax", tree)
    small = objckpt.Options(memory_budget=16 << 10, blob_size=8 << 10)
    stats = objckpt.convert_orbax(str(tmp_path / "orbax"), str(tmp_path / "native"), options=small)
    arrays = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
    assert stats.bytes_read == arrays and stats.leaves == len(jax.tree.leaves(tree))
    report = objckpt.verify(str(tmp_path / "native"))
    array_leaves = len([x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)])
    assert report.ok and report.blobs >= 3 and report.pieces > array_leaves + 1, report  # big leaves went in slabs
    info = objckpt.inspect(str(tmp_path / "native"))
    assert info.format == "objckpt" and info.metadata["converted_from"] == str(tmp_path / "orbax")
    _assert_same(objckpt.restore(str(tmp_path / "native")), objckpt.restore(str(tmp_path / "orbax")))
    _assert_same(objckpt.restore(str(tmp_path / "native"), _other_target(tree)), {**state, "name": "run-7"})
    with pytest.raises(objckpt.CheckpointExistsError):  # committed once, never overwritten
        objckpt.convert_orbax(str(tmp_path / "orbax"), str(tmp_path / "native"))


def test_cp_converts_an_orbax_checkpoint_and_a_manager_root_step_by_step(
    tmp_path: Path, state: dict[str, Any], s3_service: Any
) -> None:
    import json
    import subprocess
    import sys

    root = tmp_path / "run"
    with ocp.CheckpointManager(root) as manager:
        for step in (1, 2, 3):
            manager.save(step, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
    env = {**os.environ, **s3_service.env(), "PYTHONPATH": os.pathsep.join(sys.path)}
    cli = [sys.executable, "-m", "objckpt.cli"]
    dst = s3_service.url(f"converted-{uuid.uuid4().hex[:8]}")

    one = subprocess.run(
        [*cli, "cp", f"{root}/2", f"{dst}/single", "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert one.returncode == 0 and "converted the Orbax checkpoint" in one.stdout, one.stderr[-2000:]
    options = s3_service.storage_options()
    _assert_same(objckpt.restore(f"{dst}/single", _other_target(state), storage_options=options), state)

    first = subprocess.run(
        [*cli, "cp", str(root), f"{dst}/run", "--steps", "1,2", "--json", "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert len(json.loads(first.stdout)) == 2
    again = subprocess.run(
        [*cli, "cp", str(root), f"{dst}/run", "--steps", "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("already converted") == 2 and again.stdout.count("converted the Orbax") == 1, again.stdout
    manager = objckpt.CheckpointManager(f"{dst}/run", storage_options=options)
    assert manager.steps() == [1, 2, 3]
    _assert_same(manager.restore(3, _other_target(state)), state)
    verified = subprocess.run(
        [*cli, "verify", f"{dst}/run/{manager.step_url(3).rsplit('/', 1)[1]}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert verified.returncode == 0, verified.stderr[-2000:]


def test_a_conversion_resumes_by_rerunning(tmp_path: Path, state: dict[str, Any]) -> None:
    """A conversion killed before its commit leaves blobs: the rerun reads them back, keeps the
    intact ones, uploads the damaged one again, and commits a checkpoint that verifies."""
    _save_standard(tmp_path / "orbax", state)
    small = objckpt.Options(memory_budget=32 << 10, blob_size=8 << 10)
    src, dst = str(tmp_path / "orbax"), tmp_path / "native"
    first = objckpt.convert_orbax(src, str(dst), options=small)
    blobs = sorted(dst.rglob("*.blob"))
    assert len(blobs) >= 3 and first.blobs_kept == 0
    for path in dst.rglob("*"):  # as if killed before the commit: only the blobs are there
        if path.is_file() and path.suffix != ".blob":
            path.unlink()
    blobs[1].write_bytes(b"\xff" * blobs[1].stat().st_size)  # one of them damaged
    again = objckpt.convert_orbax(src, str(dst), options=small)
    assert again.blobs_kept == len(blobs) - 1, again
    assert objckpt.verify(str(dst)).ok
    _assert_same(objckpt.restore(str(dst), _other_target(state)), state)
