"""bench_accelerator (issue 65's measurement) in its ``--quick`` mode on the CPU: a 64 MiB state
on ``file://``, floors, objckpt and Orbax each in a fresh process. Checks the structure of its
report and its invariants (every field, positive times, ratios and targets consistent with the
medians, every restore bit-exact), not its timings."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_accelerator import ORBAX_TARGETS, TARGETS

REPO = Path(__file__).resolve().parent.parent
FIELDS = (
    "name",
    "state_gib",
    "leaves",
    "blocked_s",
    "device_get_s",
    "orbax_blocked_s",
    "peak_host_ram_gib",
    "step_slowdown",
    "save_total_s",
    "orbax_save_total_s",
    "restore_s",
    "restore_floor_s",
    "orbax_restore_s",
)
TIMES = (
    "blocked_s",
    "device_get_s",
    "per_leaf_s",
    "async_batched_s",
    "device_put_s",
    "raw_write_s",
    "raw_read_s",
    "save_total_s",
    "restore_s",
    "step_alone_s",
    "step_during_s",
    "step_max_s",
)
ORBAX = importlib.util.find_spec("orbax.checkpoint") is not None


def _bench(*args: str) -> dict[str, Any]:
    """bench_accelerator --quick with ``args`` (which name ``--out``) in a fresh process: its report."""
    out = Path(args[args.index("--out") + 1])
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_accelerator.py", "--quick", "--timeout", "240", *args],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"wrote {out}" in done.stdout
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _bench("--out", str(tmp_path_factory.mktemp("bench_accelerator") / "accelerator.json"))


def test_one_cell_with_every_field_and_positive_times(report: dict[str, Any]) -> None:
    assert report["quick"] is True and report["repeats"] == 1
    assert report["platform"] == "cpu" and report["device_kind"]
    ours = ["floors", "objckpt", "objckpt_snapshot", "objckpt_local"]
    assert report["systems"] == (ours + ["orbax"] if ORBAX else ours)
    (cell,) = report["cells"]
    assert cell["name"] == "0.0625GiB-disk" and cell["state_gib"] == 0.0625 and cell["store"] == "disk"
    for field in FIELDS:
        assert field in cell, field
    assert 400 <= cell["leaves"] <= 600
    assert abs(cell["state_bytes"] / (1 << 30) - cell["state_gib"]) < 0.1 * cell["state_gib"]
    for key in TIMES:
        assert cell[key] > 0, key
        if ORBAX and key in ("blocked_s", "save_total_s", "restore_s"):
            assert cell[f"orbax_{key}"] > 0, key
    assert cell["exact"] is True
    for system, runs in cell["runs"].items():
        assert len(runs) == 1, system
        assert runs[0]["leaves"] == cell["leaves"] and runs[0]["platform"] == "cpu"
    # A save returns before it commits; the step ran at least once while it uploaded.
    assert cell["blocked_s"] <= cell["save_total_s"]
    assert cell["runs"]["objckpt"][0]["steps_during"] >= 1
    assert cell["step_max_s"] >= cell["step_during_s"]
    assert cell["lost_s"] >= cell["blocked_s"]
    # A manager step due for both the local tier and the store: the same figures, restored exactly.
    local = cell["runs"]["objckpt_local"][0]
    assert 0 < local["blocked_s"] <= local["save_total_s"] and local["exact"] is True
    assert cell["local_blocked_s"] == local["blocked_s"] and cell["local_host_copy_attached"] is False


def test_ratios_and_targets_follow_from_the_medians(report: dict[str, Any]) -> None:
    (cell,) = report["cells"]
    floors, ours = cell["runs"]["floors"], cell["runs"]["objckpt"]
    assert cell["device_get_s"] == statistics.median(r["device_get_s"] for r in floors)
    assert cell["blocked_s"] == statistics.median(r["blocked_s"] for r in ours)
    assert cell["restore_floor_s"] == pytest.approx(cell["raw_read_s"] + floors[0]["read_put_s"])
    assert cell["save_floor_s"] == pytest.approx(cell["device_get_s"] + cell["raw_write_s"])
    assert cell["step_slowdown"] == pytest.approx(cell["step_during_s"] / cell["step_alone_s"])
    assert cell["blocked_vs_device_get"] == pytest.approx(cell["blocked_s"] / cell["device_get_s"])
    targets = cell["targets"]
    assert set(targets) == (set(TARGETS) if ORBAX else set(TARGETS) - ORBAX_TARGETS)
    for name, target in targets.items():
        assert isinstance(target["ok"], bool), name
        assert target["limit"] == TARGETS[name][0], name
    assert targets["blocked_vs_device_get"]["value"] == pytest.approx(cell["blocked_vs_device_get"])
    assert targets["blocked_vs_device_get"]["ok"] == (cell["blocked_vs_device_get"] <= 1.2)
    assert targets["step_slowdown"]["ok"] == (cell["step_slowdown"] <= 1.25)
    assert targets["restore_vs_floor"]["value"] == pytest.approx(cell["restore_s"] / cell["restore_floor_s"])
    state_gib = cell["state_bytes"] / (1 << 30)
    assert targets["peak_host_ram"]["ok"] == (cell["peak_host_ram_gib"] <= 1.1 * state_gib + 0.25 + 1e-12)
    assert targets["no_host_copy_attached"]["ok"] == (not cell["host_copy_attached"])
    snapshot = statistics.median(r["blocked_s"] for r in cell["runs"]["objckpt_snapshot"])
    assert targets["snapshot_blocked_s"]["value"] == cell["snapshot_blocked_s"] == snapshot
    assert targets["device_peak_unchanged_gib"]["value"] == cell["device_peak_delta_gib"] == 0  # CPU: no stats
    assert targets["local_blocked_vs_device_get"]["value"] == pytest.approx(
        cell["local_blocked_s"] / cell["device_get_s"]
    )
    assert targets["local_step_slowdown"]["ok"] == (cell["local_step_during_s"] / cell["local_step_alone_s"] <= 1.25)
    if ORBAX:
        assert targets["blocked_vs_orbax"]["value"] == pytest.approx(cell["blocked_s"] / cell["orbax_blocked_s"])
        assert targets["restore_vs_orbax"]["ok"] == (cell["restore_s"] < cell["orbax_restore_s"])
        assert targets["save_total_vs_orbax"]["ok"] == (cell["save_total_s"] <= cell["orbax_save_total_s"])


def test_resume_goes_on_from_the_repeats_measured_at_the_same_commit_only(
    report: dict[str, Any], tmp_path: Path
) -> None:
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(report))
    (cell,) = report["cells"]
    systems = ["floors", "objckpt"]

    # Same commit, two repeats: the first of each system is kept as it was, the second measured.
    resumed = _bench(
        "--systems",
        *systems,
        "--repeats",
        "2",
        "--commit",
        report["commit"],
        "--resume",
        str(earlier),
        "--out",
        str(tmp_path / "resumed.json"),
    )
    (got,) = resumed["cells"]
    for system in systems:
        assert [r["repeat"] for r in got["runs"][system]] == [0, 1]
        assert got["runs"][system][0] == cell["runs"][system][0]
        assert got["runs"][system][1] != cell["runs"][system][0]
    assert got["blocked_s"] == statistics.median(r["blocked_s"] for r in got["runs"]["objckpt"])

    # Another commit: only the floors are kept (they time JAX and the store, not objckpt's code),
    # also when this call measures no floors; objckpt is measured anew.
    fresh = _bench(
        "--systems",
        "objckpt",
        "--repeats",
        "1",
        "--commit",
        "another",
        "--resume",
        str(earlier),
        "--out",
        str(tmp_path / "fresh.json"),
    )
    (got,) = fresh["cells"]
    assert got["commit"] == "another"
    assert got["runs"]["floors"] == [{**cell["runs"]["floors"][0], "commit": report["commit"]}]
    assert got["floors_commits"] == [report["commit"]]
    (ours,) = got["runs"]["objckpt"]
    assert ours != cell["runs"]["objckpt"][0] and ours["commit"] == "another"
    assert got["device_get_s"] == cell["device_get_s"]  # the targets are judged against the kept floors
    assert got["targets"]["blocked_vs_device_get"]["value"] == pytest.approx(ours["blocked_s"] / cell["device_get_s"])


def test_later_saves_in_one_process_are_reported_and_the_last_one_restores_exactly(
    report: dict[str, Any], tmp_path: Path
) -> None:
    # The module's report saved once per process: no later_* figures.
    assert report["saves"] == 1 and "later_save_total_s" not in report["cells"][0]
    systems = ["floors", "objckpt", "orbax"] if ORBAX else ["floors", "objckpt"]
    got = _bench("--systems", *systems, "--saves", "3", "--out", str(tmp_path / "saves.json"))
    assert got["saves"] == 3
    (cell,) = got["cells"]
    for system in systems[1:]:
        (run,) = cell["runs"][system]
        assert run["saves"] == 3
        # The restore read the third save of a state that moved on twice: bit-exact only if every
        # later save wrote the state as it was then, not the first one's bytes.
        assert run["exact"] is True, system
        assert 0 < run["later_blocked_s"] <= run["later_save_total_s"], system
        assert run["later_lost_s"] >= run["later_blocked_s"], system
        assert run["later_step_during_s"] > 0, system
    assert cell["later_save_total_s"] == cell["runs"]["objckpt"][0]["later_save_total_s"]
    if ORBAX:
        assert cell["orbax_later_save_total_s"] == cell["runs"]["orbax"][0]["later_save_total_s"]
    # Reported beside the targets, which stay the first save's.
    assert not any(name.startswith("later") for name in cell["targets"])
    assert cell["save_total_s"] == cell["runs"]["objckpt"][0]["save_total_s"]


def test_cells_from_another_device_are_refused_not_merged(report: dict[str, Any], tmp_path: Path) -> None:
    # An earlier file from a TPU, with a cell this run would not measure and one it would resume.
    tpu = json.loads(json.dumps(report))
    (cell,) = tpu["cells"]
    cell["device_kind"] = "TPU v5 lite"
    for runs in cell["runs"].values():
        for run in runs:
            run["device_kind"] = "TPU v5 lite"
    other = {**json.loads(json.dumps(cell)), "name": "8GiB-tmpfs"}
    tpu["cells"].append(other)
    earlier = tmp_path / "tpu.json"
    earlier.write_text(json.dumps(tpu))
    for flag in ("--merge", "--resume"):
        out = tmp_path / f"out{flag}.json"
        done = subprocess.run(
            [sys.executable, "benchmarks/bench_accelerator.py", "--quick", "--systems", "floors", "--repeats", "2"]
            + ["--commit", report["commit"], flag, str(earlier), "--out", str(out)],
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode != 0, flag
        assert "measured on TPU v5 lite, this run on cpu" in done.stderr, done.stderr[-2000:]
        assert not out.exists(), flag  # nothing written that mixes the two
