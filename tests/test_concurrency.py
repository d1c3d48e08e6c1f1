"""Concurrent writers and readers: one commit wins, nothing committed is ever touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import objckpt

CHILD = Path(__file__).with_name("save_child.py")


@pytest.mark.parametrize("kind", ["s3", "gcs", "local"])
def test_two_processes_saving_to_one_url_commit_exactly_once(kind, store_target_factory):
    target = store_target_factory(kind)
    start_at = time.time() + 4  # both import JAX first, then start together
    env = dict(
        os.environ, OBJCKPT_TEST_STORAGE_OPTIONS=json.dumps(target.storage_options), PYTHONPATH=str(CHILD.parents[1])
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(CHILD), target.url, str(v), str(start_at)], stdout=subprocess.PIPE, text=True, env=env
        )
        for v in (1.0, 2.0)
    ]
    try:
        outcomes = [p.communicate(timeout=120)[0].strip() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert sorted(outcomes) == ["committed", "exists"], outcomes
    winner = 1.0 if outcomes[0] == "committed" else 2.0
    restored = objckpt.restore(target.url, storage_options=target.storage_options)
    assert restored["writer"] == winner
    np.testing.assert_array_equal(restored["w"], np.full((512, 512), winner, np.float32))


def test_restore_and_gc_while_a_save_is_in_flight(s3_store):
    so = s3_store.storage_options
    mgr = objckpt.CheckpointManager(s3_store.url, storage_options=so)
    mgr.save(1, {"w": jnp.full((256, 256), 1.0)}, wait=True)
    big = {f"w{i}": jnp.full((1024, 1024), float(i)) for i in range(16)}  # 64 MiB: the upload takes a while
    assert mgr.save(2, big)
    deleted = mgr.gc()  # default grace period: the in-flight blobs are too young to touch
    restored = mgr.restore(1)
    assert deleted == []
    np.testing.assert_array_equal(restored["w"], np.full((256, 256), 1.0, np.float32))
    assert mgr.is_saving_in_progress() or mgr.steps() == [1, 2]
    mgr.wait()
    assert mgr.steps() == [1, 2]
    out = mgr.restore(2)
    for i in range(16):
        assert float(out[f"w{i}"][0, 0]) == float(i)
