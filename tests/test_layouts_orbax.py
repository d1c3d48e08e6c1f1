"""Orbax's layout as the layouts registry opens it (:mod:`objckpt.orbax.reader`).

``open_checkpoint`` decides what a prefix holds: an Orbax item directory, a step of
Orbax's ``CheckpointManager`` (its ``default`` item), or an Orbax step of a root that
objckpt's manager continued, are all Orbax's, read by an :class:`OrbaxReader` that
describes, verifies and restores them itself. The engine finds that reader by the
dotted path in the registry's built-in table: no engine package imports
``objckpt.orbax``, and an objckpt checkpoint's restore never loads it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.errors import CheckpointNotFoundError, FormatError
from objckpt.layouts import ForeignReader, NativeCheckpoint, OpenRequest, open_checkpoint
from objckpt.layouts.registry import BUILTIN_LAYOUTS, known_layouts
from objckpt.options import Options
from objckpt.storage import from_url
from objckpt.transfer import runtime
from objckpt.transfer.stats import TransferStats

ocp = pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tensorstore")

from objckpt.orbax.reader import OrbaxReader, open_orbax  # noqa: E402  (after the importorskip)
from objckpt.orbax.verify import CHECKS  # noqa: E402


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    return {
        "w": jax.device_put(rng.standard_normal((16, 8), dtype=np.float32), NamedSharding(mesh, P("x", "y"))),
        "b": jax.device_put(rng.integers(-9, 9, (8,)).astype(np.int32), NamedSharding(mesh, P())),
    }


def _target() -> dict[str, Any]:
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


def _open(url: str, **kw: Any) -> Any:
    store = from_url(url)
    try:
        return open_checkpoint(store, **kw)
    finally:
        runtime.run_sync(store.close())


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An Orbax item, an Orbax manager root (step 5, the ``default`` item; step 7 with a
    ``state`` and a JSON ``extra`` item), and that root continued by objckpt (step 9)."""
    base = tmp_path_factory.mktemp("orbax-layout")
    state = _state()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(base / "item", state)
    checkpointer.wait_until_finished()
    with ocp.CheckpointManager(base / "root") as manager:
        manager.save(5, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
    with ocp.CheckpointManager(base / "named", item_names=("state", "extra")) as manager:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave({"note": "x"}))
        manager.save(7, args=args)
        manager.wait_until_finished()
    with objckpt.CheckpointManager(str(base / "root")) as continued:
        continued.save(9, state, wait=True)
    return base


def test_open_checkpoint_says_orbax_for_an_item_a_step_and_a_continued_roots_step(run: Path) -> None:
    assert "orbax" in known_layouts()
    assert BUILTIN_LAYOUTS["orbax"] == "objckpt.orbax.reader:open_orbax"  # by dotted path: no static import

    item = _open(str(run / "item"))
    assert isinstance(item, OrbaxReader) and isinstance(item, ForeignReader)
    assert (item.format, item.version, item.url) == ("orbax", 0, str(run / "item"))

    step = _open(str(run / "root" / "5"))  # a manager's step: its `default` item
    assert step.format == "orbax" and step.url == str(run / "root" / "5" / "default")
    named = _open(str(run / "named" / "7" / "state"))
    assert named.format == "orbax" and named.url.endswith("/7/state")

    # The root objckpt's manager continued holds both layouts, one per step.
    ours = _open(str(run / "root" / "step_0000000009"))
    assert isinstance(ours, NativeCheckpoint) and ours.format == "objckpt"
    assert _open(str(run / "root" / "5")).format == "orbax"
    with pytest.raises(CheckpointNotFoundError, match="no manifest"):  # a root is no checkpoint
        _open(str(run / "root"))
    os.makedirs(run / "empty", exist_ok=True)
    with pytest.raises(CheckpointNotFoundError, match="no manifest"):
        _open(str(run / "empty"))


def test_a_step_with_several_items_and_an_item_that_is_no_pytree(run: Path) -> None:
    step = _open(str(run / "named" / "7"))  # a Composite step: read item by item (tests/test_orbax_composite.py)
    assert step.format == "orbax" and sorted(step.composite.items) == ["extra", "state"]
    # Only when asked to look above (restore does) is a JSON item named as such; else it is
    # not a checkpoint at all.
    with pytest.raises(FormatError, match="JsonCheckpointHandler"):
        _open(str(run / "named" / "7" / "extra"), look_above=True)
    with pytest.raises(CheckpointNotFoundError):
        _open(str(run / "named" / "7" / "extra"))
    store = from_url(str(run / "empty"))
    try:
        assert open_orbax(store, OpenRequest(store.url, None, Options(), look_above=True)) is None
    finally:
        runtime.run_sync(store.close())


def test_the_reader_restores_inspects_and_verifies(run: Path) -> None:
    reader = _open(str(run / "root" / "5"))
    stats = TransferStats()
    out = reader.restore(_target(), partial=False, options=Options(), stats=stats, cast="checked")
    _same(out, _state())
    assert out["w"].sharding == _target()["w"].sharding
    assert stats.bytes_read == 16 * 8 * 4 + 8 * 4
    part = reader.restore({"b": None}, partial=True, options=Options(), stats=TransferStats(), cast="checked")
    assert sorted(part) == ["b"] and np.asarray(part["b"]).tobytes() == np.asarray(_state()["b"]).tobytes()

    info = reader.info()
    assert (info.format, info.url) == ("orbax", reader.url)
    assert (info.leaves["['w']"].shape, info.leaves["['w']"].dtype) == ((16, 8), "float32")
    assert info.leaves["['w']"].sharding == {"type": "NamedSharding", "mesh": {"x": 4, "y": 2}, "spec": ["x", "y"]}
    assert "Orbax checkpoint" in str(info)

    report = reader.verify(Options(), TransferStats(), False)
    assert report.ok and report.format == "orbax" and report.arrays == 2
    assert report.checks == CHECKS and CHECKS in report.summary()
    assert report.bytes_read == 16 * 8 * 4 + 8 * 4

    # The public calls go the same way.
    _same(objckpt.restore(str(run / "root" / "5"), _target()), _state())
    assert objckpt.inspect(str(run / "item")).format == "orbax"
    assert objckpt.verify(str(run / "item")).checks == CHECKS


def test_an_objckpt_checkpoint_is_read_without_importing_objckpt_orbax(run: Path) -> None:
    """The registry imports Orbax's reader only for a prefix with no objckpt manifest."""
    code = (
        "import sys, objckpt\n"
        f"objckpt.restore({str(run / 'root' / 'step_0000000009')!r})\n"
        f"objckpt.inspect({str(run / 'root' / 'step_0000000009')!r})\n"
        f"objckpt.verify({str(run / 'root' / 'step_0000000009')!r})\n"
        "print(sorted(m for m in sys.modules if m.startswith('objckpt.orbax')))\n"
        f"objckpt.inspect({str(run / 'item')!r})\n"
        "print('objckpt.orbax.reader' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]", "True"], done.stdout


def test_no_engine_package_imports_objckpt_orbax() -> None:
    """Orbax plugs in beside the engine: the packages that restore, inspect, verify, copy
    and manage checkpoints never name it (the CLI's Orbax conversion and the public API may)."""
    from test_architecture import _graph

    engine = ("core", "storage", "transfer", "layouts", "saving", "restoring", "roots", "tools", "manager")
    graph = _graph()
    assert "objckpt.orbax.layout" in graph["objckpt.orbax.reader"]  # the graph sees Orbax's own imports
    offenders = [
        f"{src} -> {dst}"
        for src, targets in graph.items()
        for dst in targets
        if dst.startswith("objckpt.orbax") and src.split(".")[1:2] and src.split(".")[1] in engine
    ]
    assert not offenders, offenders
