"""Several JAX processes save and restore together, on other topologies, and survive a dead peer."""

from __future__ import annotations

import json

import numpy as np
import pytest

import objckpt
from tests.mp_worker import LEAVES
from tests.multiprocess import run_processes

pytestmark = pytest.mark.slow

UNIQUE_ARRAY_BYTES = sum(
    int(np.prod(shape)) * np.dtype(dt if dt != "bfloat16" else "float16").itemsize for shape, dt, _ in LEAVES.values()
)
SMALL_BLOBS = {"blob_size": 1 << 20, "split_replicas_above": 1 << 14, "barrier_timeout": 60}


def _job(kind, store, mesh, axes, **extra):
    return {
        "kind": kind,
        "url": store.url,
        "storage_options": store.storage_options,
        "mesh": mesh,
        "axes": axes,
        "options": SMALL_BLOBS,
        **extra,
    }


def _ok(results, n):
    assert len(results) == n and all(r is not None for r in results), f"a process failed: {results}"
    return results


def _restore_everywhere(store, topologies):
    for n, mesh, axes, per_process, remap in topologies:
        results = _ok(
            run_processes(n, _job("restore", store, mesh, axes, remap=remap), devices_per_process=per_process), n
        )
        for r in results:
            assert r["mismatches"] == [], f"{n} processes, mesh {mesh}: {r['mismatches']}"


def test_four_processes_save_then_restore_on_other_topologies(s3_store):
    results = _ok(run_processes(4, _job("save", s3_store, [4, 4], ["data", "model"])), 4)
    written = [r["bytes_written"] for r in results]
    assert min(written) > 0
    info = objckpt.inspect(s3_store.url, storage_options=s3_store.storage_options)
    assert info.num_processes == 4
    _restore_everywhere(
        s3_store,
        [
            (2, [2, 4], ["data", "model"], 4, {}),
            (1, [2, 4], ["fsdp", "tp"], 8, {"data": "fsdp", "model": "tp"}),
            (4, [8, 2], ["data", "model"], 4, {}),
            (4, [4, 4], ["x", "y"], 4, {"data": "y", "model": "x"}),
        ],
    )


def test_two_processes_save_then_restore_on_more_and_fewer(s3_store):
    _ok(run_processes(2, _job("save", s3_store, [2, 4], ["data", "model"])), 2)
    _restore_everywhere(
        s3_store,
        [
            (4, [4, 4], ["data", "model"], 4, {}),
            (1, [8], ["model"], 8, {}),
        ],
    )


@pytest.mark.parametrize("n", [2, 4])
def test_replica_parallel_save_balances_bytes_and_writes_each_once(s3_store, n):
    # Data parallel over processes: "w", "emb", "bias" and "scale" are replicated on every process.
    results = _ok(run_processes(n, _job("save", s3_store, [n, 4], ["data", "model"])), n)
    written = [r["bytes_written"] for r in results]
    assert max(written) / min(written) <= 1.5, written
    info = objckpt.inspect(s3_store.url, storage_options=s3_store.storage_options)
    array_bytes = sum(leaf.nbytes for leaf in info.leaves.values())
    assert array_bytes >= UNIQUE_ARRAY_BYTES
    assert array_bytes <= sum(written) <= array_bytes * 1.01, (sum(written), array_bytes)


def test_read_once_reads_each_unique_byte_once(s3_store):
    _ok(run_processes(2, _job("save", s3_store, [2, 4], ["data", "model"])), 2)
    info = objckpt.inspect(s3_store.url, storage_options=s3_store.storage_options)
    unique = sum(leaf.nbytes for leaf in info.leaves.values())
    plain = _ok(run_processes(2, _job("restore", s3_store, [2, 4], ["data", "model"])), 2)
    once = _ok(run_processes(2, _job("restore", s3_store, [2, 4], ["data", "model"], read_once=True)), 2)
    for r in plain + once:
        assert r["mismatches"] == []
    plain_bytes = sum(r["bytes_read"] for r in plain)
    once_bytes = sum(r["bytes_read"] for r in once)
    manifest_reads = 0  # bytes_read counts blob data only; the manifest is read outside the engine
    assert abs(once_bytes - manifest_reads - unique) <= 0.01 * unique, (once_bytes, unique)
    assert plain_bytes > 1.5 * unique, (plain_bytes, unique)  # replicated leaves read by both processes
    print(json.dumps({"unique": unique, "plain": plain_bytes, "read_once": once_bytes}))


def test_dead_process_during_save_fails_the_others_and_commits_nothing(s3_store):
    job = _job("save_with_victim", s3_store, [2, 4], ["data", "model"], victim=1)
    job["options"] = dict(SMALL_BLOBS, barrier_timeout=8)
    results = run_processes(2, job, timeout=120)
    survivor, victim = results
    assert victim is None  # it SIGKILLed itself
    assert survivor is not None and survivor["error"] is not None
    assert "did not arrive: 1" in survivor["error"], survivor["error"]
    assert survivor["seconds"] < 60
    mgr = objckpt.CheckpointManager(s3_store.url, storage_options=s3_store.storage_options)
    assert mgr.steps() == [1]  # no manifest for step 2; step 1 still the latest
    restored = mgr.restore(1, {"params": {name: None for name in LEAVES}}, partial=True)
    assert restored["params"]["w"].shape == LEAVES["w"][0]
