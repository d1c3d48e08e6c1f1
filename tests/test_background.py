"""Work left running beside training runs on threads of objckpt's own that yield the CPU to it
(objckpt.transfer.background): their nice value raised, the caller's thread untouched."""

from __future__ import annotations

import os
import sys
import threading

import jax.numpy as jnp
import pytest

import objckpt
from objckpt.locations.local_dirs import LocalTier
from objckpt.transfer.background import NICEST, in_background, yield_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's nice value is Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_in_background_runs_on_a_thread_of_its_own_at_a_lower_priority() -> None:
    before = _nice()
    seen = in_background(lambda: (threading.current_thread().name, _nice()), name="objckpt-test", nice=3).result(10)
    assert seen == ("objckpt-test", min(NICEST, before + 3))
    assert _nice() == before  # the caller's thread is where it was


def test_threads_started_in_the_background_inherit_its_priority() -> None:
    def start_one() -> int:
        got: list[int] = []
        t = threading.Thread(target=lambda: got.append(_nice()))
        t.start()
        t.join()
        return got[0]

    assert in_background(start_one, name="objckpt-test", nice=4).result(10) == min(NICEST, _nice() + 4)


def test_an_error_reaches_whoever_waits_and_nice_0_changes_nothing() -> None:
    def fail() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        in_background(fail, name="objckpt-test", nice=2).result(10)
    assert in_background(_nice, name="objckpt-test", nice=0).result(10) == _nice()
    assert yield_cpu(0) is False


@pytest.mark.parametrize("bad", [-1, 20, 2.5, "10"])
def test_options_refuse_a_nice_increment_out_of_range(bad: object) -> None:
    with pytest.raises(ValueError, match="background_nice"):
        objckpt.Options(background_nice=bad)  # type: ignore[arg-type]


def test_a_local_save_writes_its_step_on_a_thread_that_yields(tmp_path, monkeypatch) -> None:
    """The step a CheckpointManager saves locally is written after save() returns, on a thread
    Options.background_nice below the caller's."""
    seen: list[tuple[str, int]] = []
    write = LocalTier.write

    def recorded(self, *args, **kwargs):
        seen.append((threading.current_thread().name, _nice()))
        return write(self, *args, **kwargs)

    monkeypatch.setattr(LocalTier, "write", recorded)
    mgr = objckpt.CheckpointManager(
        str(tmp_path / "root"),
        local=str(tmp_path / "local"),
        local_interval_steps=1,
        save_interval_steps=100,
        options=objckpt.Options(background_nice=6),
    )
    try:
        assert mgr.save(1, {"w": jnp.arange(8.0)})
        mgr.wait()
    finally:
        mgr.close()
    assert seen == [("objckpt-local-tier", min(NICEST, _nice() + 6))]
