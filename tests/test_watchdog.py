"""The progress watchdog that long multi-cycle tests run under (tests/helpers.py): a cycle
that stops fails the test within its budget; many slow cycles that keep going do not."""

from __future__ import annotations

import time

import pytest
from helpers import ProgressWatchdog


@pytest.mark.timeout(0)
def test_a_stalled_cycle_fails_within_its_budget_naming_the_last_progress():
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"no progress for 1.0 s after 2 steps \(last: cycle 1\)"):
        with ProgressWatchdog(stall_seconds=1.0) as watchdog:
            for cycle in range(2):
                watchdog.tick(f"cycle {cycle}")
            time.sleep(30)  # the hang
    assert time.monotonic() - started < 10


@pytest.mark.timeout(0)
def test_slow_cycles_that_keep_progressing_outlast_the_budget_without_failing():
    started = time.monotonic()
    with ProgressWatchdog(stall_seconds=1.0) as watchdog:
        for cycle in range(5):
            time.sleep(0.5)
            watchdog.tick(f"cycle {cycle}")
    assert time.monotonic() - started > 2.0  # twice the budget in all, never one budget without progress
    time.sleep(1.5)  # and once left, it is off
