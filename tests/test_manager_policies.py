"""CheckpointManager's save policies: interval, chosen and final steps, time, continuous, preemption."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jax.numpy as jnp
import pytest

import objckpt
from objckpt.manager import save_schedule
from objckpt.manager.save_policy import SavePolicy
from tests.multiprocess import run_processes

WORKER = Path(__file__).with_name("preempt_worker.py")


def _tree(step):
    return {"w": jnp.full((16, 8), step, jnp.float32), "step": step}


class _Clock:
    """A clock the test moves by hand (min_interval_seconds without sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(save_schedule, "_now", fake)
    return fake


@pytest.fixture
def held_uploads(monkeypatch):
    """Uploads wait for the returned event: a save stays in flight until the test sets it."""
    from objckpt.saving import upload as upload_module

    release = threading.Event()
    original = upload_module._upload

    async def held(*args, **kwargs):
        await asyncio.to_thread(release.wait, 60)
        return await original(*args, **kwargs)

    monkeypatch.setattr(upload_module, "_upload", held)
    yield release
    release.set()


# ------------------------------------------------------------------ the pure policy


def test_policy_step_rules():
    every = SavePolicy()
    assert every.save_interval_steps == 1 and all(every.by_step(s) for s in range(5))
    rules = SavePolicy(save_interval_steps=4, save_on_steps=frozenset({5}), final_step=10)
    assert [s for s in range(12) if rules.by_step(s)] == [0, 4, 5, 8, 10]
    assert not rules.is_dynamic
    final_only = SavePolicy(final_step=7)
    assert [s for s in range(10) if final_only.by_step(s)] == [7]
    with pytest.raises(ValueError, match="save_interval_steps"):
        SavePolicy(save_interval_steps=0)
    with pytest.raises(ValueError, match="min_interval_seconds"):
        SavePolicy(min_interval_seconds=-1)


def test_policy_time_and_continuous_rules():
    timed = SavePolicy(min_interval_seconds=10)
    assert timed.is_dynamic and not any(timed.by_step(s) for s in range(20))
    assert not timed.dynamic(now=109.9, last_save_started=100, saving=False)
    assert timed.dynamic(now=110, last_save_started=100, saving=True)  # save() then waits for the one in flight
    continuous = SavePolicy(continuous=True)
    assert continuous.dynamic(now=0, last_save_started=0, saving=False)
    assert not continuous.dynamic(now=1e9, last_save_started=0, saving=True)
    floored = SavePolicy(continuous=True, min_interval_seconds=5)
    assert not floored.dynamic(now=104, last_save_started=100, saving=False)
    assert floored.dynamic(now=105, last_save_started=100, saving=False)


# ------------------------------------------------------------------ the manager


def test_default_saves_every_step_and_returns_true(memory_store):
    with objckpt.CheckpointManager(memory_store.url) as mgr:
        assert [mgr.save(s, _tree(s)) for s in range(3)] == [True, True, True]
        mgr.wait()
        assert mgr.steps() == [0, 1, 2]


def test_interval_final_step_and_force(memory_store):
    mgr = objckpt.CheckpointManager(
        memory_store.url, save_rules=objckpt.SavePolicy(save_interval_steps=4, save_on_steps=[6], final_step=9)
    )
    saved = [s for s in range(10) if mgr.save(s, _tree(s))]
    assert saved == [0, 4, 6, 8, 9]
    assert [mgr.should_save(s) for s in (1, 2, 3, 12)] == [False, False, False, True]
    assert mgr.save(3, _tree(3), force=True) is True  # whatever the interval says
    mgr.close()
    assert mgr.steps() == [0, 3, 4, 6, 8, 9]
    assert float(mgr.restore(9)["w"][0, 0]) == 9


def test_skipped_step_waits_for_nothing(memory_store, held_uploads):
    mgr = objckpt.CheckpointManager(memory_store.url, save_rules=objckpt.SavePolicy(save_interval_steps=5))
    assert mgr.save(0, _tree(0))
    assert mgr.is_saving_in_progress()
    for step in range(1, 5):  # would hang on the held upload if a skipped step waited for it
        assert mgr.save(step, _tree(step)) is False
    assert mgr.is_saving_in_progress()
    held_uploads.set()
    mgr.close()
    assert mgr.steps() == [0]


def test_min_interval_seconds_with_an_injected_clock(memory_store, clock):
    mgr = objckpt.CheckpointManager(memory_store.url, save_rules=objckpt.SavePolicy(min_interval_seconds=30))
    saved = []
    for step in range(20):
        clock.now += 10  # each step takes 10 s
        if mgr.save(step, _tree(step)):
            saved.append(step)
    mgr.close()
    # 30 s after the manager was made (step 2), then 30 s after each save started
    assert saved == [2, 5, 8, 11, 14, 17]
    assert mgr.steps() == saved


def test_min_interval_combines_with_the_step_interval(memory_store, clock):
    mgr = objckpt.CheckpointManager(
        memory_store.url, save_rules=objckpt.SavePolicy(save_interval_steps=7, min_interval_seconds=25)
    )
    saved = []
    for step in range(15):
        clock.now += 10
        if mgr.save(step, _tree(step)):
            saved.append(step)
    mgr.close()
    # step 0 (interval) restarts the clock: 25 s later is step 3, then 6; 7 and 14 by the interval; 10 by time
    assert saved == [0, 3, 6, 7, 10, 13, 14]


def test_continuous_saves_as_soon_as_the_previous_one_committed(memory_store, held_uploads):
    mgr = objckpt.CheckpointManager(memory_store.url, save_rules=objckpt.SavePolicy(continuous=True))
    assert mgr.should_save(0) and mgr.save(0, _tree(0)) is True
    for step in range(1, 6):  # step 0's upload is held: nothing else starts, nothing waits
        assert mgr.should_save(step) is False
        assert mgr.save(step, _tree(step)) is False
    held_uploads.set()
    mgr.wait()  # step 0 committed (what a running loop sees a few steps later)
    assert mgr.should_save(6) is True
    assert mgr.save(6, _tree(6)) is True
    mgr.close()
    assert mgr.steps()[:2] == [0, 6]


def test_continuous_respects_its_time_floor(memory_store, clock):
    mgr = objckpt.CheckpointManager(
        memory_store.url, save_rules=objckpt.SavePolicy(continuous=True, min_interval_seconds=20)
    )
    saved = []
    for step in range(10):
        clock.now += 10
        mgr.wait()  # every save commits within a step: only the floor holds the next one back
        if mgr.save(step, _tree(step)):
            saved.append(step)
    mgr.close()
    assert saved == [1, 3, 5, 7, 9]


def test_sigterm_is_caught_only_when_asked_and_the_handler_is_restored(memory_store):
    before = signal.getsignal(signal.SIGTERM)
    plain = objckpt.CheckpointManager(memory_store.url, save_rules=objckpt.SavePolicy(save_interval_steps=100))
    assert signal.getsignal(signal.SIGTERM) is before  # no handler unless asked
    plain.close()

    def mine(signum, frame):
        raise AssertionError("the manager's handler should have run")

    signal.signal(signal.SIGTERM, mine)
    try:
        mgr = objckpt.CheckpointManager(
            memory_store.url, save_rules=objckpt.SavePolicy(save_interval_steps=100), catch_sigterm=True
        )
        assert signal.getsignal(signal.SIGTERM) is not mine
        assert mgr.save(0, _tree(0)) and not mgr.reached_preemption(0)
        assert mgr.save(1, _tree(1)) is False
        os.kill(os.getpid(), signal.SIGTERM)  # the manager's handler records the notice
        assert not mgr.reached_preemption(1)  # decided for step 1 before the notice
        assert mgr.should_save(2) and mgr.reached_preemption(2)
        assert mgr.save(2, _tree(2)) is True
        assert not mgr.is_saving_in_progress()  # the preemption save waited for its commit
        assert mgr.steps() == [0, 2]
        assert not mgr.reached_preemption(3)
        mgr.close()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sigterm_to_a_single_process_loop_saves_that_step_and_exits_0(s3_store):
    """A training loop (its own process, S3) gets SIGTERM from outside: it saves, commits, exits 0."""
    job = {
        "url": s3_store.url,
        "storage_options": s3_store.storage_options,
        "steps": 10_000,
        "save_interval_steps": 100_000,  # only step 0 by the interval, however slow the machine
        "catch_sigterm": True,
        "step_seconds": 0.01,
        "print_steps": True,
    }
    env = dict(os.environ, PYTHONPATH=str(WORKER.parents[1]))
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps(job)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("STEP 5"):
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "previous handler ran" not in out
    result = json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][len("RESULT ") :])
    preempted = result["preempted"]
    assert preempted is not None and 5 <= preempted < 9_999
    assert result["saved"] == [0, preempted] and result["last"] == preempted
    assert result["catching_sigterm"] and result["handler_restored"]
    assert result["committed"] == [0, preempted]
    mgr = objckpt.CheckpointManager(s3_store.url, storage_options=s3_store.storage_options)
    assert mgr.latest_step() == preempted and float(mgr.restore()["w"][0, 0]) == preempted + 1
    mgr.close()


@pytest.mark.slow
def test_sigterm_to_one_of_four_processes_saves_the_same_step_everywhere(s3_store):
    """JAX's preemption service: the notice reaches every process, all save the sync step, exit 0, resume."""
    job = {
        "kind": "training_loop",
        "url": s3_store.url,
        "storage_options": s3_store.storage_options,
        "steps": 4_000,
        "save_interval_steps": 100_000,  # only step 0 by the interval, however slow the machine
        "sigterm_at": 20,
        "victim": 2,
        "catch_sigterm": True,  # one loop for both modes: with JAX's service the manager installs nothing
        "step_seconds": 0.01,
    }
    codes: list[int] = []
    results = run_processes(4, job, timeout=240, devices_per_process=2, returncodes=codes)
    assert codes == [0, 0, 0, 0]
    assert all(r is not None for r in results)
    preempted = {r["preempted"] for r in results}
    assert len(preempted) == 1 and None not in preempted
    step = preempted.pop()
    assert 20 < step < 3_999
    assert all(r["saved"] == [0, step] and r["last"] == step for r in results)
    assert all(r["committed"] == [0, step] and not r["catching_sigterm"] for r in results)
    resumed = run_processes(4, {**job, "steps": step + 5, "sigterm_at": None}, timeout=240, devices_per_process=2)
    assert all(r is not None and r["start"] == step and r["restored_ok"] for r in resumed)
    assert all(r["saved"] == [step + 4] and r["value"] == step + 5 for r in resumed)  # the final step saves


@pytest.mark.slow
def test_continuous_saves_the_same_steps_on_every_process(s3_store):
    """The primary decides whether a save is in flight and tells the others: no process saves alone."""
    job = {
        "kind": "training_loop",
        "url": s3_store.url,
        "storage_options": s3_store.storage_options,
        "steps": 40,
        "continuous": True,
        "step_seconds": 0.01,
    }
    codes: list[int] = []
    results = run_processes(2, job, timeout=240, devices_per_process=2, returncodes=codes)
    assert codes == [0, 0] and all(r is not None for r in results)
    saved = results[0]["saved"]
    assert all(r["saved"] == saved and r["committed"] == saved for r in results)
    assert saved[0] == 0 and saved[-1] == 39 and len(saved) >= 2


@pytest.mark.parametrize("asked", [1, None])
def test_restore_of_the_step_being_saved_waits_for_its_commit(memory_store, held_uploads, asked):
    """restore(step) / inspect(step) of the step this manager is still saving (or of the latest,
    which it becomes) returns it once committed, not CheckpointNotFoundError."""
    mgr = objckpt.CheckpointManager(memory_store.url)
    assert mgr.save(0, _tree(0), wait=True)
    assert mgr.save(1, _tree(1))
    assert mgr.is_saving_in_progress() and mgr.steps() == [0]
    threading.Timer(0.3, held_uploads.set).start()
    assert float(mgr.restore(asked)["w"][0, 0]) == 1
    assert not mgr.is_saving_in_progress()
    assert mgr.inspect(asked).leaves
    mgr.close()


def test_restore_of_another_step_does_not_wait_for_the_save_in_flight(memory_store, held_uploads):
    mgr = objckpt.CheckpointManager(memory_store.url)
    assert mgr.save(0, _tree(0), wait=True)
    assert mgr.save(1, _tree(1))
    assert float(mgr.restore(0)["w"][0, 0]) == 0
    assert mgr.is_saving_in_progress()  # step 0 was read beside the held save
    held_uploads.set()
    mgr.close()
