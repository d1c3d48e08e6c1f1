"""bench_continuous (issue 55's continuous-mode measurement) on a tiny state: the structure of its
report and the invariants of each mode, not its timings."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from backends.proxy import FaultProxy
from backends.s3 import S3Service
from benchmarks import bench_continuous as bench


@pytest.fixture(scope="module")
def report(s3_service: S3Service) -> Iterator[dict[str, Any]]:
    """The benchmark's measurement, one round, 8 MiB, through the latency proxy at 10 ms."""
    port = int(s3_service.endpoint_url.rsplit(":", 1)[1])
    so = s3_service.storage_options()
    with FaultProxy("127.0.0.1", port, latency_ms=10) as proxy:
        so = {**so, "client_kwargs": {**so["client_kwargs"], "endpoint_url": proxy.endpoint_url}}
        cfg = bench.Config(
            mib=8, leaves=4, steps=12, warmup=1, repeats=1, intervals=(3, 12), matmul=128, layers=1, bracket=2
        )
        roots = iter(range(100))
        yield bench.measure(
            cfg,
            lambda: s3_service.url(f"bench-continuous/{next(roots)}"),
            so,
            server_pid=s3_service.pid,
            log=lambda line: None,
        )


def test_every_mode_is_reported_with_its_figures(report: dict[str, Any]) -> None:
    assert set(report["modes"]) == {"none", "continuous", "every 3", "every 12"}
    assert report["state_bytes"] == 8 << 20
    assert report["modes"]["none"]["overhead_pct"] == 0.0 and report["modes"]["none"]["commits"] == 0
    for key in ("continuous", "every 3", "every 12"):
        cells = report["modes"][key]
        assert cells["commits"] > 0, key
        assert cells["blocked_per_save_s"] > 0, key
        assert cells["save_to_commit_s"] > 0, key
        assert cells["lost_per_save_s"] is not None and cells["server_cpu_per_save_s"] > 0, key
        lo, hi = cells["overhead_pct_range"]
        assert lo <= cells["overhead_pct"] <= hi
    assert "continuous_overhead_pct" in report["match"]
    assert bench.summarise(report["rounds"])["modes"] == report["modes"]  # what --report recomputes
    table = bench.table(report)
    assert table.count("\n| ") == 4 and "| continuous |" in table


def test_each_save_commits_before_the_next_and_a_fixed_interval_saves_its_multiples(report: dict[str, Any]) -> None:
    (records,) = report["rounds"]
    assert sorted(r["mode"] for r in records) == ["continuous", "interval", "interval"]
    for rec in records:
        assert len(rec["base_step_s"]) == 4  # the bracketing steps without checkpointing: the run's baseline
        saves, commits = rec["saves"], rec["commits"]
        assert [c["step"] for c in commits] == [s["step"] for s in saves], rec["mode"]
        for done, nxt in zip(commits, saves[1:]):
            assert done["t"] <= nxt["t"] + nxt["wait_s"] + 1e-6  # committed before the next began (or it waited)
        assert rec["steps_kept"] == [c["step"] for c in commits][-2:]  # keep_last=2 applied, then deleted
        if rec["mode"] == "interval":
            assert [s["step"] for s in saves] == list(range(0, rec["steps"], rec["interval"]))
            assert rec["steps"] % rec["interval"] == 0


def test_continuous_starts_the_next_save_on_the_step_the_previous_commit_is_seen(report: dict[str, Any]) -> None:
    """No step passes with no save in flight while the run still saves: denser than any fixed interval allows."""
    (records,) = report["rounds"]
    cont = next(r for r in records if r["mode"] == "continuous")
    assert len(cont["saves"]) >= 2
    for done, nxt in zip(cont["commits"], cont["saves"][1:]):
        assert nxt["step"] == done["seen_at"]
        assert nxt["wait_s"] == 0.0 or nxt["wait_s"] < 1e-3  # never waits: nothing is in flight
    large = next(r for r in records if r["interval"] == 12)
    assert len(cont["commits"]) >= len(large["commits"]) == 1
