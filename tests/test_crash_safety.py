"""SIGKILL a saving training loop at random moments; the latest step must always be whole."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ProgressWatchdog

import objckpt
from objckpt.core.format import MANIFEST_KEY
from objckpt.layouts.manifest_io import read_checkpoint, read_manifest
from objckpt.transfer import runtime

CHILD = Path(__file__).with_name("crash_child.py")
TRIALS = int(os.environ.get("OBJCKPT_CRASH_TRIALS", "30"))


def _start(root: str, start_step: int, storage_options: dict) -> subprocess.Popen:
    env = dict(os.environ, OBJCKPT_TEST_STORAGE_OPTIONS=json.dumps(storage_options), PYTHONPATH=str(CHILD.parents[1]))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    return subprocess.Popen(
        [sys.executable, str(CHILD), root, str(start_step)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )


def _wait_ready(proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if line.startswith("ready"):
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"child exited with {proc.returncode} before saving")
    raise AssertionError("child never got ready")


def _check_listed_steps_are_whole(mgr: objckpt.CheckpointManager) -> None:
    for step in mgr.steps():
        store = mgr.store.child(f"step_{step:010d}")
        root = runtime.run_sync(read_manifest(store, size_limit=1 << 30))
        present = {o.key: o.size for o in runtime.run_sync(store.list())}
        assert MANIFEST_KEY in present
        for ref in root.indexes:  # format v2: each process's index object, then the blobs they list
            assert present.get(ref.key) == ref.size, f"step {step} listed but index {ref.key} is missing or short"
        manifest = runtime.run_sync(read_checkpoint(store, size_limit=1 << 30))
        assert manifest.blobs, f"step {step} lists no blob"
        for blob in manifest.blobs:
            assert present.get(blob.key) == blob.size, f"step {step} listed but blob {blob.key} is missing or short"


@pytest.mark.slow
@pytest.mark.timeout(0)  # a budget per trial instead (ProgressWatchdog): slow on a loaded machine is no hang
def test_sigkill_at_random_moments_never_loses_the_latest_step(s3_store):
    sys.path.insert(0, str(CHILD.parent))
    from crash_child import state_for

    rng = random.Random(1234)
    so = s3_store.storage_options
    mgr = objckpt.CheckpointManager(s3_store.url, storage_options=so)
    next_step = 0
    killed_after_commits = []
    with ProgressWatchdog(stall_seconds=120) as watchdog:
        for trial in range(TRIALS):
            proc = _start(s3_store.url, next_step, so)
            try:
                _wait_ready(proc)
                time.sleep(rng.uniform(0.0, 1.2))  # lands in copy, upload, commit or retention delete
            finally:
                os.kill(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate(timeout=30)
            killed_after_commits.append(out.count("committed"))

            _check_listed_steps_are_whole(mgr)
            latest = mgr.latest_step()
            if latest is not None:
                restored = mgr.restore()
                expected = state_for(latest)
                for name, array in expected["params"].items():
                    assert np.asarray(restored["params"][name]).tobytes() == np.asarray(array).tobytes(), (
                        f"trial {trial}"
                    )
                assert np.asarray(restored["opt"]["mu"]).tobytes() == np.asarray(expected["opt"]["mu"]).tobytes()
                assert restored["step"] == latest and restored["iterator"] == expected["iterator"]
                next_step = latest + 1
            watchdog.tick(f"trial {trial}")
    assert mgr.latest_step() is not None, "no trial ever committed a step"
    assert sum(1 for c in killed_after_commits if c == 0) < TRIALS  # some kills landed after commits
    print(f"commits per trial before SIGKILL: {killed_after_commits}")

    committed = mgr.steps()
    # SIGKILL ran no cleanup: the killed saves' live markers stay until their lease
    # ends, and only then do their orphans go (a 1 s lease here, past by now).
    time.sleep(2.2)
    sweeper = objckpt.CheckpointManager(s3_store.url, storage_options=so, options=objckpt.Options(live_marker_lease=1))
    sweeper.gc(grace_seconds=0)
    assert mgr.steps() == committed
    _check_listed_steps_are_whole(mgr)
    referenced = set()
    for step in committed:
        manifest = runtime.run_sync(read_checkpoint(mgr.store.child(f"step_{step:010d}"), size_limit=1 << 30))
        keys = [b.key for b in manifest.blobs] + [r.key for r in manifest.indexes] + [MANIFEST_KEY]
        referenced |= {f"step_{step:010d}/{key}" for key in keys}
    leftovers = {o.key for o in runtime.run_sync(mgr.store.list())}
    assert leftovers == referenced, f"orphans survived gc: {sorted(leftovers - referenced)[:5]}"
    for step in committed:
        assert mgr.restore(step)["step"] == step
