"""Issue 77 (hardening 5), items 4-7: the local tier against a roll-back of the store, a full or
unwritable local disk, another job on the same ``local=``, and where a restore came from.

The managers run in one process of 8 CPU devices against the local S3 server, as a training job
would; the local tier is a directory under ``tmp_path``.
"""

from __future__ import annotations

import errno
import json
import os
import re
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
from objckpt.locations import local_dirs
from objckpt.locations.agreement import Decision, Inventory, decide
from objckpt.roots.step_names import step_dir

ROOT = Path(__file__).resolve().parent.parent


def _tree(step: int, offset: float = 0.0) -> dict[str, Any]:
    v = np.arange(16, dtype=np.float32) * 10 + step + offset
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    return {
        "v": jax.make_array_from_callback(v.shape, NamedSharding(mesh, P(("a", "b"))), lambda i: v[i]),
        "n": step,
    }


def _target() -> dict[str, Any]:
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    return {"v": jax.ShapeDtypeStruct((16,), np.float32, sharding=NamedSharding(mesh, P())), "n": 0}


def _manager(
    s3_store: Any, local: Path, url: str | None = None, interval: int = 5, **kw: Any
) -> objckpt.CheckpointManager:
    local_copies = objckpt.LocalCopies(local, interval_steps=interval)
    return objckpt.CheckpointManager(
        url or s3_store.url, storage_options=s3_store.storage_options, local=local_copies, **kw
    )


def _check(out: dict[str, Any], step: int, offset: float = 0.0) -> None:
    assert out["n"] == step
    assert np.asarray(out["v"]).tobytes() == np.asarray(_tree(step, offset)["v"]).tobytes()


# ---------------------------------------------------------------- item 4: the current line of runs


@pytest.mark.parametrize("resume", ["manager", "objckpt.restore"])
def test_store_steps_deleted_and_a_resume_from_20_never_bring_the_deleted_branch_back(s3_store, tmp_path, resume):
    """Saves 0..50 (the store every 10 steps, local 45 and 50); the user deletes store steps 30-50
    with a manager that has no local tier (the local tier never sees it): the next manager's
    ``latest_step()`` is 20. It resumes from 20 to 27 (local 25); the restart takes the
    store-backed line: the resumed run's own step 25 from the local tier, never the deleted 50.
    Resumed through the manager (its restore retires the local steps above 20) or by a plain
    ``objckpt.restore`` of step 20 (the local save of 25 retires them; retention had deleted 25
    itself, the oldest by number)."""
    local = tmp_path / "local"
    mgr = _manager(s3_store, local, save_rules=objckpt.SavePolicy(save_interval_steps=10))
    for step in range(51):
        mgr.save(step, _tree(step))
    mgr.close()
    assert mgr.tier_status().local_steps == [45, 50]
    plain = objckpt.CheckpointManager(s3_store.url, storage_options=s3_store.storage_options)
    for step in (30, 40, 50):
        plain.delete(step)
    plain.close()

    mgr = _manager(s3_store, local, save_rules=objckpt.SavePolicy(save_interval_steps=10))
    assert mgr.latest_step() == 20  # 45 and 50 were saved after the store committed 30: a deleted line
    if resume == "manager":
        _check(mgr.restore(20, _target()), 20)
        assert mgr.tier_status().local_steps == []  # the job goes on from 20: 45 and 50 retired at once
    else:
        url = f"{s3_store.url}/{step_dir(20)}"
        _check(objckpt.restore(url, _target(), storage_options=s3_store.storage_options), 20)
    for step in range(21, 28):
        mgr.save(step, _tree(step, offset=0.5))
    mgr.close()

    mgr = _manager(s3_store, local, save_rules=objckpt.SavePolicy(save_interval_steps=10))
    assert mgr.latest_step() == 25
    _check(mgr.restore(None, _target()), 25, offset=0.5)
    status = mgr.tier_status()
    assert status.last_restore is not None and status.last_restore.tier == "local"
    assert (status.local_steps, status.store_steps) == ([25], [0, 10, 20])
    with pytest.raises(objckpt.CheckpointNotFoundError, match="step 50"):
        mgr.restore(50, _target())
    mgr.close()


def test_every_process_leaves_out_a_deleted_line_whichever_process_recorded_it() -> None:
    """``decide`` is pure and the same on every process: a step is of a deleted line when any
    process's copy of it was saved after the store committed a step newer than the store's newest
    now; such a step is neither local nor peer, and the newest step of the line left is taken."""
    own = {45: ("run1", 2), 50: ("run1", 2), 25: ("run2", 2)}
    invs = {
        0: Inventory(0, own=dict(own), stored={45: 30, 50: 30, 25: -1}, store=[0, 10, 20]),
        1: Inventory(1, own=dict(own), stored={}),  # its manifests said nothing (an older manager)
    }
    invs = {p: Inventory.from_json(p, i.to_json()) for p, i in invs.items()}  # as the processes send them
    assert decide(invs, 2, want=None, keepers=[1, 0]) == Decision(25, ("local",), "run2")
    assert decide(invs, 2, want=50, keepers=[1, 0]) == Decision(50, ())
    invs[0] = Inventory(0, own=dict(own), stored={45: 30, 50: 30, 25: -1}, store=[0, 10, 20, 30])
    assert decide(invs, 2, want=None, keepers=None).step == 50  # the store still holds 30: not a roll-back


def test_deleting_the_newest_store_steps_through_the_manager_retires_their_local_copies(s3_store, tmp_path):
    """A roll-back through the manager itself (``delete`` of 30, 40, 50): the local copies above
    the newest step left (45, 50) are retired, so a restart restores 20 from the store; deleting
    an old step (housekeeping) leaves the local tier alone."""
    local = tmp_path / "local"
    mgr = _manager(s3_store, local, save_rules=objckpt.SavePolicy(save_interval_steps=10))
    for step in range(51):
        mgr.save(step, _tree(step))
    mgr.wait()
    mgr.delete(10)
    assert mgr.tier_status().local_steps == [45, 50]
    for step in (30, 40, 50):
        mgr.delete(step)
    assert mgr.tier_status().local_steps == []
    mgr.close()
    mgr = _manager(s3_store, local)
    assert mgr.latest_step() == 20
    _check(mgr.restore(None, _target()), 20)
    mgr.close()


# ---------------------------------------------------------------- item 5: a local disk that fails


def _store_steps(s3_store: Any) -> list[int]:
    plain = objckpt.CheckpointManager(s3_store.url, storage_options=s3_store.storage_options)
    try:
        return plain.steps()
    finally:
        plain.close()


def test_an_unwritable_local_directory_loses_no_store_save(s3_store, tmp_path, caplog):
    """``local=`` under a regular file (NotADirectoryError, a raw OSError; root bypasses chmod):
    every store save commits, each failed local save is a warning, and training goes on."""
    (tmp_path / "file").write_bytes(b"not a directory")
    mgr = _manager(s3_store, tmp_path / "file" / "local", interval=1)
    with caplog.at_level("WARNING", logger="objckpt"):
        for step in range(6):
            assert mgr.save(step, _tree(step))
        mgr.wait()
        mgr.close()
    assert _store_steps(s3_store) == list(range(6))
    assert caplog.text.count("not saved locally") >= 5 and "Not a directory" in caplog.text
    mgr = _manager(s3_store, tmp_path / "file" / "local")  # the restart: no local step, the store serves
    assert (mgr.latest_step(), mgr.tier_status().local_steps) == (5, [])
    _check(mgr.restore(None, _target()), 5)
    mgr.close()


def test_a_full_local_disk_loses_no_store_save(s3_store, tmp_path, caplog, monkeypatch):
    """The local disk full from step 3 on (every local write ends in ENOSPC): store steps 0..6 all
    commit, the local saves that fail are warnings, and the local steps written before stay."""
    real = local_dirs.save_part

    def filling(url: str, snap: Any, options: Any) -> None:
        real(url, snap, options)
        if snap.step >= 3:
            raise OSError(errno.ENOSPC, "No space left on device", url)

    monkeypatch.setattr(local_dirs, "save_part", filling)
    local = tmp_path / "local"
    mgr = _manager(s3_store, local, interval=1)
    with caplog.at_level("WARNING", logger="objckpt"):
        for step in range(7):
            assert mgr.save(step, _tree(step))
        mgr.wait()
    assert mgr.tier_status().local_steps == [1, 2]
    assert not [p for p in (local / "process_0").iterdir() if p.name.startswith(".tmp")]  # no torn write left
    mgr.close()
    assert _store_steps(s3_store) == list(range(7))
    assert caplog.text.count("not saved locally") == 4 and "No space left on device" in caplog.text


def test_the_store_save_starts_before_the_local_one(s3_store, tmp_path, monkeypatch):
    """A local save that raises in the caller's thread (its snapshot: host memory exhausted) comes
    after the store's save of the step has started: the step commits in the store all the same."""
    import objckpt.manager.tiers as manager_tiers

    real = manager_tiers.snapshot

    def short_of_memory(tree: Any, **kw: Any) -> Any:
        if kw["step"] == 3:
            raise MemoryError("no host memory for the local snapshot")
        return real(tree, **kw)

    monkeypatch.setattr(manager_tiers, "snapshot", short_of_memory)
    mgr = _manager(s3_store, tmp_path / "local", interval=1)
    for step in range(3):
        mgr.save(step, _tree(step))
    with pytest.raises(MemoryError):
        mgr.save(3, _tree(3))
    mgr.save(4, _tree(4))
    mgr.close()
    assert _store_steps(s3_store) == list(range(5))


# ---------------------------------------------------------------- item 6: two jobs, one local=


def test_another_job_on_the_same_local_directory_never_replaces_this_jobs_steps(s3_store, tmp_path, caplog):
    """Jobs A and B (two roots) share ``local=``: B reaching A's step numbers skips its local save
    with a warning instead of removing A's step, and its retention leaves A's write in flight
    alone; A's restart restores its own step 10, bit for bit, from the local tier."""
    local = tmp_path / "local"
    other = f"{s3_store.url}-other"
    a = _manager(s3_store, local)
    for step in range(11):
        a.save(step, _tree(step))
    a.close()
    in_flight = local_dirs.tmp_dir(local / "process_0" / step_dir(15), s3_store.url)  # A's next write, under way
    b = _manager(s3_store, local, url=other)
    with caplog.at_level("WARNING", logger="objckpt"):
        for step in range(11):
            b.save(step, _tree(step, offset=1000.0))
        b.wait()
    assert b.tier_status().local_steps == [0]  # where A holds no step (retention removed A's 0)
    b.close()
    assert caplog.text.count("another job's step, left as it is") == 2  # steps 5 and 10
    assert in_flight.is_dir()  # B's retention leaves A's write in flight alone
    a = _manager(s3_store, local)
    assert a.tier_status().local_steps == [5, 10]
    _check(a.restore(None, _target()), 10)
    assert a.tier_status().last_restore.tier == "local"  # type: ignore[union-attr]
    a.close()


# ---------------------------------------------------------------- item 7: where a restore came from

_RESTART = """
import json, os, sys
import numpy as np
import objckpt
url, local, opts = sys.argv[1], sys.argv[2], json.loads(os.environ["OBJCKPT_TEST_OPTS"])
mgr = objckpt.CheckpointManager(url, storage_options=opts, local=local)
mgr.save(0, {"w": np.arange(4.0)})
mgr.close()
mgr = objckpt.CheckpointManager(url, storage_options=opts, local=local)
assert mgr.restore(None, {"w": np.zeros(4)})["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
mgr.close()
"""


def test_a_restore_says_which_tier_it_came_from_without_logging_configured(s3_store, tmp_path):
    """A process that configured no logging still sees one line per restore naming the step,
    the tier and the seconds (on stderr)."""
    env = {**os.environ, "OBJCKPT_TEST_OPTS": json.dumps(s3_store.storage_options), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _RESTART, s3_store.url, str(tmp_path / "local")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "restored step" in line]
    assert len(lines) == 1 and re.fullmatch(
        r"objckpt: process 0 restored step 0 from the local tier in [\d.]+ s", lines[0]
    )


def test_the_docs_give_the_one_local_tier_speed_up_the_benchmark_measured() -> None:
    measured = json.loads((ROOT / "benchmarks" / "results" / "tiers.json").read_text())["local_vs_store"]
    pattern = re.compile(r"restart from the local tier\s+([\d.]+)×\s+faster")
    figures = {doc: pattern.findall((ROOT / doc).read_text()) for doc in ("README.md", "docs/TIERS.md")}
    assert figures == {"README.md": [f"{measured:.1f}"], "docs/TIERS.md": [f"{measured:.1f}"]}
