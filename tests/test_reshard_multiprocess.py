"""Four real processes x 2 CPU devices on the local S3: a (4, 2) mesh's checkpoint restored onto targets
that cut its pieces. Each process downloads at most 1.5x the bytes its target boxes need (leaves read on
the saved grid are resharded on the devices through JAX's CPU collectives, on by default in JAX 0.10), and
every restored shard is bit-exact. With the collectives off, restore reads directly (and reads twice what
it needs where the target cuts the pieces)."""

from __future__ import annotations

import pytest

from tests.multiprocess import run_processes

pytestmark = [pytest.mark.slow, pytest.mark.s3]

LEAVES = {
    "w": ((64, 32), "float32", ["fsdp", "tensor"]),
    "emb": ((128, 16), "bfloat16", ["fsdp", "tensor"]),
    "norm": ((256,), "float32", [None]),
}
OPTIONS = {"blob_size": 1 << 20, "split_replicas_above": 1 << 14, "barrier_timeout": 60}
FLOOR = {"reshard_min_saved": 0}  # the leaves are a few KiB: resharded without the 1 MiB floor

TARGETS = {
    # name: (mesh, axes, extra job fields, resharded)
    "axes swapped": ([4, 2], ["fsdp", "tensor"], {"remap": {"fsdp": "tensor", "tensor": "fsdp"}}, True),
    "other device order": ([4, 2], ["fsdp", "tensor"], {"minor_first": True}, None),
    "P(None, 'tensor') on tensor=8": ([8], ["tensor"], {}, True),
}


def _job(kind, store, mesh, axes, **extra):
    return {
        "kind": kind,
        "url": store.url,
        "storage_options": store.storage_options,
        "mesh": mesh,
        "axes": axes,
        "leaves": LEAVES,
        "extras": False,
        "options": OPTIONS,
        **FLOOR,
        **extra,
    }


def _ok(results, n):
    assert len(results) == n and all(r is not None for r in results), f"a process failed: {results}"
    return results


def test_targets_that_cut_the_saved_pieces_read_at_most_one_and_a_half_times_what_each_process_needs(s3_store):
    _ok(run_processes(4, _job("save", s3_store, [4, 2], ["fsdp", "tensor"]), devices_per_process=2), 4)
    for name, (mesh, axes, extra, resharded) in TARGETS.items():
        job = _job("restore", s3_store, mesh, axes, count_needed=True, **extra)
        results = _ok(run_processes(4, job, devices_per_process=2), 4)
        for p, r in enumerate(results):
            assert r["mismatches"] == [], f"{name}, process {p}: {r['mismatches']}"
            assert r["bytes_read"] <= 1.5 * r["needed_bytes"], f"{name}, process {p}: {r}"
            if resharded is not None:
                assert (r["device_bytes_moved"] > 0) == resharded, f"{name}, process {p}: {r}"


def test_without_cpu_collectives_restore_reads_directly(s3_store):
    _ok(run_processes(4, _job("save", s3_store, [4, 2], ["fsdp", "tensor"]), devices_per_process=2), 4)
    mesh, axes, extra, _ = TARGETS["axes swapped"]
    job = _job("restore", s3_store, mesh, axes, count_needed=True, cpu_collectives=None, **extra)
    for p, r in enumerate(_ok(run_processes(4, job, devices_per_process=2), 4)):
        assert r["mismatches"] == [], f"process {p}: {r['mismatches']}"
        assert r["device_bytes_moved"] == 0
        assert r["bytes_read"] > 1.5 * r["needed_bytes"], f"process {p}: {r}"  # whole pieces, half of each used


def test_a_process_whose_reads_fail_never_leaves_the_others_in_the_reshard(s3_store):
    _ok(run_processes(4, _job("save", s3_store, [4, 2], ["fsdp", "tensor"]), devices_per_process=2), 4)
    mesh, axes, extra, _ = TARGETS["axes swapped"]
    job = _job("restore", s3_store, mesh, axes, fail_fetch=1, report_errors=True, **extra)
    results = _ok(run_processes(4, job, devices_per_process=2, timeout=120), 4)  # none hung until the deadline
    assert results[1]["error"] == "OSError: injected fetch failure"
    for p in (0, 2, 3):
        assert results[p]["error"].startswith("CoordinationError: restore of"), results[p]
        assert results[p]["error"].endswith("failed elsewhere: process 1: OSError: injected fetch failure")


def test_a_target_on_other_devices_reads_on_a_mesh_over_them_and_reshard_off_reads_directly(s3_store):
    # Saved on a (4, 2) mesh of all 8 devices; restored onto tensor=4 over each process's first device, the
    # processes in reverse order: not the saved mesh's devices, so the read sharding is a mesh built over the
    # target's (axes read0, read1, read_replica), each process reading whole saved rows of pieces.
    _ok(run_processes(4, _job("save", s3_store, [4, 2], ["fsdp", "tensor"]), devices_per_process=2), 4)
    other = {"devices": [[3, 0], [2, 0], [1, 0], [0, 0]], "count_needed": True}
    job = _job("restore", s3_store, [4], ["tensor"], **other)
    for p, r in enumerate(_ok(run_processes(4, job, devices_per_process=2), 4)):
        assert r["mismatches"] == [], f"process {p}: {r['mismatches']}"
        assert r["read_axes"] == [["read0", "read1", "read_replica"]] * 2, f"process {p}: {r}"  # w and emb
        assert r["device_bytes_moved"] > 0
        assert r["bytes_read"] <= 1.5 * r["needed_bytes"], f"process {p}: {r}"
    job = _job("restore", s3_store, [4], ["tensor"], **other, options={**OPTIONS, "reshard": False})
    for p, r in enumerate(_ok(run_processes(4, job, devices_per_process=2), 4)):
        assert r["mismatches"] == [], f"process {p}: {r['mismatches']}"
        assert r["read_axes"] == [] and r["device_bytes_moved"] == 0
        assert r["bytes_read"] > 1.5 * r["needed_bytes"], f"process {p}: {r}"  # whole pieces, half of each used
