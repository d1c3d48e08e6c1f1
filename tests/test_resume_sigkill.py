"""A training job SIGKILLed mid-run and restarted resumes bit-exact (issue 55), on 2 and 4 processes.

The job (tests/resume_worker.py, one JAX process each, jax.distributed on CPU, S3) trains
an MLP with optax AdamW, params and optimizer state sharded over every device, an RNG
key split in the jitted step, a grain ``DataLoader`` sharded over the processes (its
state saved as ``objckpt.PerProcess``) and an ``objckpt.Json`` config, under
``SavePolicy(save_interval_steps=3)``. Each process logs a digest of the batch it
drew and of its part of the state after every step.

Per process count: one uninterrupted run gives the reference digests; then the job is
started, every process SIGKILLed at once at a random point (after some step, or while a
save is in flight), and started again, five times in a chain (each restart is the next
run killed), and the last start runs to the end. Each start must restore exactly the
latest committed step (never one older than a commit some process saw, never a torn
one) and from there reproduce the reference bit for bit: restored state, every batch
drawn, every state after.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import objckpt
from tests.multiprocess import free_port, process_env

WORKER = Path(__file__).with_name("resume_worker.py")
STEPS = 32
SAVE_INTERVAL = 3
KILLS = 5  # per process count: 10 in all
LAUNCH_TIMEOUT = 180.0  # one start of the job, on a busy machine: past it, a hang

Event = tuple[str, ...]


class Launch:
    """One start of the job: ``n`` worker processes in one process group (one SIGKILL ends them all)."""

    def __init__(self, n: int, job: dict[str, Any], logs: Path, name: str) -> None:
        self.n = n
        self.name = name
        self.logs = [logs / f"{name}.p{p}.log" for p in range(n)]
        self.outputs = [logs / f"{name}.p{p}.out" for p in range(n)]
        port = free_port()
        job = {**job, "log": str(logs / f"{name}.p{{process}}.log")}
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for p in range(n):
                env = process_env(p, n, port, 2, OBJCKPT_RESUME_JOB=json.dumps(job))
                group = self.procs[0].pid if self.procs else 0  # process 0 leads a new group

                with open(self.outputs[p], "wb") as out:
                    self.procs.append(
                        subprocess.Popen(
                            [sys.executable, str(WORKER)],
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            env=env,
                            process_group=group,
                        )
                    )
        except BaseException:
            self.kill()
            raise
        self.deadline = time.monotonic() + LAUNCH_TIMEOUT

    def events(self, process: int) -> list[Event]:
        """The complete lines of ``process``'s log (a SIGKILL may leave the last one cut)."""
        try:
            text = self.logs[process].read_text()
        except FileNotFoundError:
            return []
        return [tuple(line.split()) for line in text.split("\n")[:-1]]

    def output(self) -> str:
        return "\n".join(
            f"--- {self.name} process {p}:\n{path.read_text()[-3000:]}" for p, path in enumerate(self.outputs)
        )

    def running(self) -> bool:
        return any(proc.poll() is None for proc in self.procs)

    def wait_for(self, found: Callable[[list[Event]], bool]) -> None:
        """Poll process 0's log until ``found`` says yes; fail if the job ends or times out first."""
        while not found(self.events(0)):
            if not self.running() or time.monotonic() > self.deadline:
                self.kill()
                pytest.fail(f"{self.name}: the job ended (or timed out) before the kill point\n{self.output()}")
            time.sleep(0.002)

    def kill(self) -> None:
        """SIGKILL every process (the whole group at once) and reap them."""
        if self.procs:
            try:
                os.killpg(self.procs[0].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def finish(self) -> list[int]:
        """Wait for every process to exit (kill them all past the deadline); their exit codes."""
        try:
            for proc in self.procs:
                proc.wait(timeout=max(0.1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.name}: timed out after {LAUNCH_TIMEOUT} s\n{self.output()}")
        return [proc.returncode for proc in self.procs]


def _digests(launch: Launch) -> list[dict[tuple[str, int], str]]:
    return [{(e[0], int(e[1])): e[2] for e in launch.events(p) if e[0] in ("batch", "state")} for p in range(launch.n)]


def _check_resumed(launch: Launch, start: int, reference: list[dict[tuple[str, int], str]]) -> int:
    """Every process started from ``start``, restored the reference's state of that step, then drew
    the reference's batches and reached its states, step after step; the last step it logged."""
    last = start
    for p in range(launch.n):
        events = launch.events(p)
        if not events:
            continue  # killed before it wrote a line (not process 0: the kill waited for it)
        assert events[0] == ("start", str(start)), f"{launch.name} process {p}: {events[0]}, latest committed {start}"
        expected_step = start + 1
        for event in events[1:]:
            kind = event[0]
            if kind == "restored":
                assert int(event[1]) == start and event[2] == reference[p][("state", start)], (
                    f"{launch.name} process {p}: the state restored from step {start} differs from the one saved"
                )
            elif kind in ("batch", "state"):
                step = int(event[1])
                assert step == expected_step, f"{launch.name} process {p}: step {step} after {expected_step - 1}"
                what = "the batch drawn" if kind == "batch" else "the state after it"
                assert event[2] == reference[p][(kind, step)], (
                    f"{launch.name} process {p} (resumed from {start}): at step {step} {what} differs from "
                    f"the uninterrupted run's"
                )
                if kind == "state":
                    expected_step += 1
                    last = max(last, step)
        if start >= 0 and len(events) > 1:
            assert events[1][:2] == ("restored", str(start)), f"{launch.name} process {p}: {events[:2]}"
    return last


def _committed_seen(launch: Launch) -> int:
    """The newest step some process of ``launch`` knew had committed (-1: none)."""
    seen = [int(e[1]) for p in range(launch.n) for e in launch.events(p) if e[0] == "committed"]
    return max(seen, default=-1)


def _latest(store: Any) -> int:
    mgr = objckpt.CheckpointManager(store.url, storage_options=store.storage_options)
    try:
        latest = mgr.latest_step()
    finally:
        mgr.close()
    return -1 if latest is None else latest


@pytest.mark.slow
@pytest.mark.timeout(900)  # seven starts of the job; each start has its own deadline (LAUNCH_TIMEOUT)
@pytest.mark.parametrize("processes", [2, 4])
def test_sigkill_at_random_points_resumes_bit_exact(processes, store_target_factory, tmp_path):
    rng = random.Random(55_000 + processes)
    job = {
        "storage_options": {},
        "steps": STEPS,
        "save_interval_steps": SAVE_INTERVAL,
        "seed": 7,
        "lr": 0.01,
        "batch_per_process": 4,
        "config": {"model": "mlp", "hidden": 64, "optimizer": {"name": "adamw", "lr": 0.01}, "seed": 7},
    }
    reference_store, store = store_target_factory("s3"), store_target_factory("s3")
    reference_job = {**job, "url": reference_store.url, "storage_options": reference_store.storage_options}
    job = {**job, "url": store.url, "storage_options": store.storage_options}

    uninterrupted = Launch(processes, reference_job, tmp_path, "reference")
    codes = uninterrupted.finish()
    assert codes == [0] * processes, uninterrupted.output()
    reference = _digests(uninterrupted)
    for p in range(processes):
        assert uninterrupted.events(p)[-1] == ("done",), uninterrupted.output()
        assert set(reference[p]) == {(kind, s) for kind in ("batch", "state") for s in range(STEPS)}
        assert len({reference[p][("batch", s)] for s in range(STEPS)}) == STEPS  # the data moves
    assert len({reference[p][("batch", 0)] for p in range(processes)}) == processes  # each process its own

    start = -1
    kills: list[str] = []
    cut: list[int] = []  # steps whose save a kill cut off
    modes = ["step", "step", "save", "save", "save at once"][:KILLS]
    rng.shuffle(modes)
    for i, mode in enumerate(modes):
        launch = Launch(processes, job, tmp_path, f"kill{i}")
        try:
            kill_at = min(start + rng.randint(2, 2 * SAVE_INTERVAL), STEPS - 2)
            if mode == "step":  # anywhere in the next step's work: the batch, the update, a save
                delay = rng.uniform(0, 0.05)
                launch.wait_for(lambda events, k=kill_at: ("state", str(k)) in {e[:2] for e in events})
            else:  # after a save started: its upload or commit in flight, or the steps after it
                delay = 0.0 if mode == "save at once" else rng.uniform(0, 0.3)
                launch.wait_for(lambda events, k=kill_at: any(e[0] == "save" and int(e[1]) >= k for e in events))
            time.sleep(delay)
        finally:
            launch.kill()
        assert all(proc.returncode == -signal.SIGKILL for proc in launch.procs), launch.output()
        last = _check_resumed(launch, start, reference)
        seen = _committed_seen(launch)
        latest = _latest(store)
        saves = [int(e[1]) for e in launch.events(0) if e[0] == "save"]
        cut += [s for s in saves if s > latest]  # started, never committed: the restart must not see it
        kills.append(
            f"{mode} after {kill_at} +{delay * 1000:.0f} ms: ran {start + 1}..{last}, saved {saves}, latest {latest}"
        )
        assert latest >= seen, f"kill {i}: step {seen} committed on some process but the latest listed is {latest}"
        assert latest <= max([start, *saves]), f"kill {i}: step {latest} listed, never saved"
        start = latest  # the next start must restore exactly this step
    summary = f"{processes} processes, kills:\n  " + "\n  ".join(kills)
    assert cut, f"no kill landed while a save was in flight\n{summary}"

    final = Launch(processes, job, tmp_path, "final")
    codes = final.finish()
    assert codes == [0] * processes, final.output()
    assert _check_resumed(final, start, reference) == STEPS - 1, f"{summary}\n{final.output()}"
    assert all(final.events(p)[-1] == ("done",) for p in range(processes))
    assert _latest(store) == STEPS - 1
    print(f"{summary}\n  cut saves: {cut}")
