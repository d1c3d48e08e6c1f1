"""bench_tiers (issue 56's measurement) in its ``--quick`` mode: 4 JAX processes, the 64 MiB
``small`` state, S3 through the 10 ms proxy. Checks the structure of its report and its
invariants (every restore bit-exact and served by the tier its path names), not its timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench_tiers") / "tiers.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_tiers", "--quick", "--out", str(out), "--timeout", "240"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "restart from the local tier" in done.stdout
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_each_restart_path_is_served_by_its_tier_bit_exact(report: dict[str, Any]) -> None:
    assert report["quick"] is True and report["processes"] == 4 and report["devices_per_process"] == 2
    assert report["rtt_ms"] == 10 and report["workload"] == "small"
    assert set(report["restore"]) == {"local", "peer", "store"}
    for path, cell in report["restore"].items():
        assert len(cell["runs"]) == report["repeats"] == 1
        for run in cell["runs"]:
            assert run["exact"], path
            assert run["step"] == 0, path
            assert run["tiers"] == [path], path  # every process reported this path's tier
            assert run["seconds"] > 0
        assert cell["median_s"] == sorted(r["seconds"] for r in cell["runs"])[0]
    store = report["restore"]["store"]["median_s"]
    assert report["local_vs_store"] == pytest.approx(store / report["restore"]["local"]["median_s"])
    assert report["peer_vs_store"] == pytest.approx(store / report["restore"]["peer"]["median_s"])


def test_save_overheads_and_targets_are_reported(report: dict[str, Any]) -> None:
    blocking = report["blocking"]
    assert blocking["save_async_blocked_s"] > 0 and blocking["local_blocked_s"] > 0
    assert blocking["local_no_peer_blocked_s"] > 0 and blocking["local_write_after_s"] >= 0
    steps = report["steps"]
    assert steps["interval"] == 3 and set(steps["runs"]) == {"plain", "local", "local_no_peer"}
    assert all(len(runs) == 1 for runs in steps["runs"].values())
    assert steps["plain_segment_s"] >= steps["interval"] * steps["step_sleep_s"]
    for mode in ("local", "local_no_peer"):
        cell = steps[mode]
        assert cell["overhead"] == pytest.approx(
            (cell["segment_s"] - steps["plain_segment_s"]) / steps["plain_segment_s"]
        )
        assert cell["save_call_s"] is not None  # a local save happened in the measured segment
        assert cell["interval_for_5pct"] >= 1
    assert set(report["targets"]) == {"local_vs_store", "peer_vs_store", "local_blocks_no_longer", "step_overhead"}
    assert all(isinstance(v, bool) for v in report["targets"].values())
    assert report["targets"]["local_vs_store"] == (report["local_vs_store"] >= 5)
    assert len(report["per_process"]) == 4


@pytest.mark.slow
def test_the_grid_restarts_from_each_tier_bit_exact(tmp_path: Path) -> None:
    """``--grid --quick`` (issue 79's grid, 1 and 2 processes at 64 MiB, one round): every restart a
    fresh job, bit-exact and served by its path's tier; the time before the first read and the
    coordinator calls recorded; ``--table`` prints docs/TIERS.md's table from the result file."""
    out = tmp_path / "tiers.json"
    out.write_text(json.dumps({"kept": 1}))
    run = [sys.executable, "benchmarks/bench_tiers.py", "--grid", "--quick", "--out", str(out), "--timeout", "240"]
    done = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["kept"] == 1  # the grid is one key of the result file
    cells = report["grid"]["cells"]
    assert [(c["processes"], c["mib"]) for c in cells] == [(1, 64), (2, 64)]
    for cell in cells:
        assert set(cell) >= {"local", "store"} and ("peer" in cell) == (cell["processes"] > 1)
        for path in ("local", "peer", "store"):
            for run_ in cell.get(path, {}).get("runs", []):
                assert run_["exact"] and run_["tiers"] == [path], (cell["processes"], path, run_)
                assert 0 < run_["before_first_read_s"] <= run_["seconds"]
                assert len(run_["per_process"]) == cell["processes"]
    local_2 = cells[1]["local"]["runs"][0]["coordination"]
    assert local_2["barrier"] == 3, local_2  # agree on the step and tier, then on opening and restoring
    table = subprocess.run([*run[:2], "--table", "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    assert table.stdout.count("| 2 | 64 MiB |") == 1
