"""The peers benchmark's order of phases: neither of objckpt's restores (nor of the raw
ceiling's) is always the one right after its save, so a ratio between them is not the
order's doing."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_rivals


class _NoServers:
    """Just enough of ``LocalServers`` for :func:`bench_rivals.measure` (no phase really runs)."""

    def context(self, store: str, ms: int, **fields: Any) -> dict[str, Any]:
        return {"store": store, **fields}

    def proxy_requests(self, store: str, ms: int) -> None:
        return None

    def list_and_delete(self, store: str, prefix: str) -> tuple[int, int]:
        return 0, 0

    def compact(self) -> None:
        pass


@pytest.fixture
def phases_run(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    ran: list[str] = []
    monkeypatch.setattr(bench_rivals, "settle", lambda: None)
    monkeypatch.setattr(bench_rivals, "run_phase", lambda ctx, timeout, log_dir: ran.append(ctx["phase"]) or {})
    return ran


def _measure(system: str, rep: int) -> list[str]:
    args = argparse.Namespace(profile=False, profile_dir=Path("."), timeout=1.0, log_dir=Path("."))
    rows = bench_rivals.measure(_NoServers(), "s3", 0, "small", system, rep, args, "run")  # type: ignore[arg-type]
    return [row["phase"] for row in rows]


def test_objckpt_restores_swap_places_each_repeat(phases_run: list[str]) -> None:
    orders = [_measure("objckpt", rep) for rep in range(4)]
    assert orders[0] == ["save", "restore", "restore_resharded"]
    assert orders[1] == ["save", "restore_resharded", "restore"]
    assert orders[2] == orders[0] and orders[3] == orders[1]
    assert phases_run == [phase for order in orders for phase in order]


def test_raw_gets_that_drop_and_keep_swap_places_each_repeat(phases_run: list[str]) -> None:
    assert _measure("raw", 0) == ["save", "restore", "restore_kept"]
    assert _measure("raw", 1) == ["save", "restore_kept", "restore"]
    assert _measure("raw", -1) == ["save", "restore"]  # the untimed warm-up: one restore is enough


def test_peers_save_then_restore(phases_run: list[str]) -> None:
    assert _measure("orbax", 0) == _measure("dcp", 1) == _measure("naive", 2) == ["save", "restore"]
