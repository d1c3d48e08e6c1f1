"""Several JAX processes save and restore together, on other topologies, and survive a dead peer."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import objckpt
from objckpt.transfer import runtime
from tests.helpers import rewrite_as_v1
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


# ----------------------------------------------------------------------------- pod scale (issue #40)


def _leaves(**leaves):
    """A job's own leaves, as JSON: name → [shape, dtype, spec]."""
    return {name: [list(shape), dtype, spec] for name, (shape, dtype, spec) in leaves.items()}


def test_a_finished_save_and_read_once_restore_leave_no_coordinator_keys(s3_store):
    job = _job("save", s3_store, [4, 4], ["data", "model"], probe_keys=True, restore_after=True, read_once=True)
    results = _ok(run_processes(4, job), 4)
    for p, r in enumerate(results):
        assert r["leftover_keys"] == [], f"process {p} after the save: {r['leftover_keys']}"
        assert r["restore"]["mismatches"] == [], r["restore"]["mismatches"]
        assert r["restore"]["leftover_keys"] == [], f"process {p} after the restore: {r['restore']['leftover_keys']}"


MANY_LEAVES = _leaves(
    **{
        f"l{i:03d}": ((8, 16), "float32", ["data", "model"]) if i % 2 else ((16,), "float32", [None])
        for i in range(200)
    }
)
COORDINATION_BYTES_PER_SAVE = 4096


def test_coordination_bytes_per_process_do_not_grow_with_the_tree(s3_store):
    # 200 leaves, 100 of them in 16 pieces (~450 pieces per process): an all-gather of every piece
    # would send tens of KB per process.
    job = _job("save", s3_store, [4, 4], ["data", "model"], leaves=MANY_LEAVES, extras=False, count_coordination=True)
    results = _ok(run_processes(4, job), 4)
    figures = [r["coordination"] for r in results]
    print(json.dumps(figures))
    for p, c in enumerate(figures):
        assert 0 < c["sent"] <= COORDINATION_BYTES_PER_SAVE, f"process {p} sent {c}"
        assert c["received"] <= COORDINATION_BYTES_PER_SAVE, f"process {p} received {c}"
    info = objckpt.inspect(s3_store.url, storage_options=s3_store.storage_options)
    assert info.num_processes == 4 and len(info.leaves) == 200


# (processes, mesh, axes, devices per process, remap): the save, the v2 restore, the v1 restore
BIT_EXACT_CASES = {
    "8to2-v1to4": (
        (8, [2, 4], ["data", "model"], 1, {}),
        (2, [4, 2], ["data", "model"], 4, {}),
        (4, [2, 4], ["x", "y"], 2, {"data": "y", "model": "x"}),
    ),
    "2to4-v1to4": (
        (2, [2, 4], ["data", "model"], 4, {}),
        (4, [4, 2], ["data", "model"], 2, {}),
        (4, [8, 1], ["data", "model"], 2, {}),
    ),
    "1to8-v1to2": (
        (1, [2, 4], ["data", "model"], 8, {}),
        (8, [4, 2], ["data", "model"], 1, {}),
        (2, [2, 4], ["fsdp", "tp"], 4, {"data": "fsdp", "model": "tp"}),
    ),
}


@pytest.mark.parametrize("case", list(BIT_EXACT_CASES))
def test_bit_exact_across_process_counts_in_format_v3_and_v1(s3_store, case):
    (n, mesh, axes, per, remap), as_v2, as_v1 = BIT_EXACT_CASES[case]
    _ok(run_processes(n, _job("save", s3_store, mesh, axes, remap=remap), devices_per_process=per), n)
    assert objckpt.inspect(s3_store.url, storage_options=s3_store.storage_options).format_version == 3
    _restore_everywhere(s3_store, [as_v2])
    store = s3_store.open()
    try:
        rewrite_as_v1(store)
    finally:
        runtime.run_sync(store.close())
    info = objckpt.inspect(s3_store.url, storage_options=s3_store.storage_options)
    assert info.format_version == 1 and info.num_processes == n
    _restore_everywhere(s3_store, [as_v1])


# Sharded along the process axis ("data": one mesh row per process), but for one small
# replicated norm, which one process writes.
PROCESS_SHARDED = _leaves(
    a=((512, 256), "float32", ["data", "model"]),
    b=((1024,), "float32", ["data"]),
    c=((256, 64), "bfloat16", ["data", None]),
    norm=((64,), "float32", [None]),
)


def test_a_same_mesh_restore_reads_only_the_index_objects_it_needs(s3_store):
    leaves = {"leaves": PROCESS_SHARDED, "extras": False}
    _ok(run_processes(4, _job("save", s3_store, [4, 4], ["data", "model"], **leaves)), 4)
    same = _ok(run_processes(4, _job("restore", s3_store, [4, 4], ["data", "model"], count_indexes=True, **leaves)), 4)
    # Swapped axes, read directly (JAX's CPU collectives off: no reshard on the saved grid): every
    # process's rows now come from every writer (the count is not vacuous).
    swapped = _ok(
        run_processes(
            4,
            _job(
                "restore",
                s3_store,
                [4, 4],
                ["x", "y"],
                remap={"data": "y", "model": "x"},
                count_indexes=True,
                cpu_collectives=None,
                **leaves,
            ),
        ),
        4,
    )
    print(json.dumps({"same_mesh": [r["indexes_read"] for r in same], "swapped": [r["indexes_read"] for r in swapped]}))
    for r in same + swapped:
        assert r["mismatches"] == [], r["mismatches"]
        assert len(r["indexes_read"]) == len(set(r["indexes_read"])), f"an index object read twice: {r}"
    others = set()
    for p, r in enumerate(same):
        read = set(r["indexes_read"])
        assert p in read, (p, read)
        assert len(read) <= 2 < 4, (
            f"process {p} read the index objects of {sorted(read)}: its own and the norm's writer"
        )
        others |= read - {p}
    assert len(others) <= 1, f"the norm has one writer, yet processes read the index objects of {sorted(others)}"
    for r in swapped:
        assert set(r["indexes_read"]) == {0, 1, 2, 3}


JAX_ABORT = "Terminating process because the JAX distributed service detected fatal errors"


def test_killing_a_process_mid_save_names_it_in_every_survivor(s3_store):
    barrier_timeout = 8
    # JAX's heartbeat would abort the survivors once it declares the victim dead: well after the barrier.
    job = _job("save_with_victim", s3_store, [4, 4], ["data", "model"], victim=2, heartbeat_timeout=120)
    job["options"] = dict(SMALL_BLOBS, barrier_timeout=barrier_timeout)
    stderr: list[str] = []
    results = run_processes(4, job, timeout=150, stderr=stderr)
    assert results[2] is None  # it SIGKILLed itself
    survivors = {p: r for p, r in enumerate(results) if p != 2}
    print(json.dumps(survivors))
    # The one tolerated way for a survivor to print no result: JAX itself aborted it.
    for p, r in survivors.items():
        assert r is not None or JAX_ABORT in stderr[p], f"process {p} printed no result; stderr:\n{stderr[p][-3000:]}"
    reported = {p: r for p, r in survivors.items() if r is not None}
    assert reported, "every survivor was aborted by JAX before the barrier timed out"
    for p, r in reported.items():
        error = r["error"]
        assert error is not None, f"process {p} committed step 2 without the victim"
        assert "none named" not in error, f"process {p}: {error}"
        named = re.search(r"did not arrive: ([\d, ]+) \(", error)
        assert named and named.group(1) == "2", f"process {p}: {error}"
        assert r["seconds"] < barrier_timeout + 25, f"process {p} took {r['seconds']:.1f} s"
    mgr = objckpt.CheckpointManager(s3_store.url, storage_options=s3_store.storage_options)
    assert mgr.steps() == [1]  # no manifest for step 2


DATA_PARALLEL = _leaves(
    big=((1024, 256), "float32", [None, "model"]),
    big_bf16=((512, 384), "bfloat16", [None, None]),
    mid=((96, 128), "float32", [None, "model"]),
    **{f"norm{i}": ((64 * (i + 1),), "float32", [None]) for i in range(6)},
    table=((32, 32), "int8", [None, None]),
)


def test_read_once_balances_the_bytes_each_process_reads(s3_store):
    leaves = {"leaves": DATA_PARALLEL, "extras": False}
    _ok(run_processes(4, _job("save", s3_store, [4, 4], ["data", "model"], **leaves)), 4)
    info = objckpt.inspect(s3_store.url, storage_options=s3_store.storage_options)
    unique = sum(leaf.nbytes for leaf in info.leaves.values())
    results = _ok(run_processes(4, _job("restore", s3_store, [4, 4], ["data", "model"], read_once=True, **leaves)), 4)
    read = [r["bytes_read"] for r in results]
    print(json.dumps({"unique": unique, "per_process": read}))
    for r in results:
        assert r["mismatches"] == [], r["mismatches"]
    assert min(read) > 0 and max(read) / min(read) <= 1.25, read
    assert abs(sum(read) - unique) <= 0.01 * unique, (sum(read), unique)
