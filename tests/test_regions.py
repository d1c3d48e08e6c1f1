"""Regions: restores that read from the nearest copy of a checkpoint and fail over.

Three "regions" on the local servers: an S3 bucket reached through a proxy with
2 ms RTT (near), a second S3 bucket through a proxy with 40 ms RTT (far), and
the GCS emulator through a proxy with 20 ms RTT. The proxies count the bytes each location served.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_bit_exact
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from backends.proxy import FaultProxy
from objckpt.storage import from_url
from objckpt.transfer import runtime

SMALL = objckpt.Options(blob_size=256 * 1024)
FAR_BUCKET = "objckpt-region-far"


@dataclass
class Region:
    name: str
    url: str  # a fresh prefix in this region
    storage_options: dict[str, Any]
    proxy: FaultProxy | None = None

    def location(self, path: str = "") -> objckpt.Location:
        return objckpt.Location(f"{self.url}{path}", self.storage_options)

    @property
    def served(self) -> int:
        assert self.proxy is not None
        return self.proxy.stats.bytes_down


def _through(proxy: FaultProxy, options: dict[str, Any]) -> dict[str, Any]:
    client = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
    return {**options, "client_kwargs": client}


@pytest.fixture
def regions(s3_service, gcs_service):
    """near (S3, 2 ms), far (another S3 bucket, 40 ms), gcs (20 ms): fresh prefixes in each."""
    s3_service.make_bucket(FAR_BUCKET)
    name = uuid.uuid4().hex[:12]
    near_proxy = FaultProxy("127.0.0.1", _port(s3_service.endpoint_url), latency_ms=2, stall_seconds=60).start()
    far_proxy = FaultProxy("127.0.0.1", _port(s3_service.endpoint_url), latency_ms=40).start()
    gcs_proxy = FaultProxy("127.0.0.1", _port(gcs_service.endpoint_url), latency_ms=20).start()
    options = s3_service.storage_options()
    found = {
        "near": Region("near", s3_service.url(f"near-{name}"), _through(near_proxy, options), near_proxy),
        "far": Region("far", f"s3://{FAR_BUCKET}/far-{name}", _through(far_proxy, options), far_proxy),
        "gcs": Region(
            "gcs",
            gcs_service.url(f"gcs-{name}"),
            {**gcs_service.storage_options(), "endpoint_url": gcs_proxy.endpoint_url},
            gcs_proxy,
        ),
    }
    try:
        yield found
    finally:
        for proxy in (near_proxy, far_proxy, gcs_proxy):
            proxy.stop()


def _port(endpoint_url: str) -> int:
    return int(endpoint_url.rsplit(":", 1)[1].rstrip("/"))


def _tree(seed: int = 0) -> dict[str, Any]:
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    w = jnp.arange(1024 * 512, dtype=jnp.float32).reshape(1024, 512) * (seed + 1)
    return {
        "w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))),
        "b": np.arange(100_000, dtype=np.int32) + seed,
        "step": seed,
    }


def _target() -> dict[str, Any]:
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    return {
        "w": jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=NamedSharding(mesh, P("b", "a"))),
        "b": None,
        "step": None,
    }


def _replicated(regions: dict[str, Region], tree: Any) -> int:
    """Save ``tree`` at near, copy it to far and gcs; the checkpoint's blob bytes."""
    near = regions["near"]
    objckpt.save(near.url, tree, storage_options=near.storage_options, options=SMALL)
    for name in ("far", "gcs"):
        other = regions[name]
        stats = objckpt.copy(
            near.url, other.url, src_storage_options=near.storage_options, dst_storage_options=other.storage_options
        )
    return stats.bytes_total


def test_restore_reads_from_the_nearest_copy(regions):
    tree = _tree()
    size = _replicated(regions, tree)
    near, far = regions["near"], regions["far"]
    near_before, far_before = near.served, far.served
    stats = objckpt.TransferStats()
    # Asked for the far copy, told of the others: the near one serves the bytes.
    restored = objckpt.restore(
        far.url,
        _target(),
        storage_options=far.storage_options,
        replicas=[near.location(), regions["gcs"].location()],
        stats=stats,
    )
    assert_tree_bit_exact(tree, restored)
    from_near, from_far = near.served - near_before, far.served - far_before
    assert from_near >= size * 0.9, (from_near, size)
    assert from_far < size * 0.05, (from_far, size)  # its manifest and a probe, no blob
    assert stats.bytes_by_location.get(near.url, 0) >= size * 0.9
    assert stats.bytes_by_location.get(far.url, 0) == 0


@pytest.mark.parametrize("failure", ["500", "stall", "killed"])
def test_a_location_failing_mid_restore_is_left_for_the_next(regions, failure):
    tree = _tree(1)
    size = _replicated(regions, tree)
    near, far = regions["near"], regions["far"]
    assert near.proxy is not None
    options = objckpt.Options(
        max_concurrency=2, request_timeout=3.0, retry=objckpt.RetryConfig(max_attempts=3, max_backoff=0.2)
    )
    start = near.served
    if failure == "killed":  # the location dies at once: connections open then are reset too
        near.proxy.fail_after(start + size // 2, "reset", cut_open=True)
    else:
        near.proxy.fail_after(start + size // 2, failure)
    stats = objckpt.TransferStats()
    restored = objckpt.restore(
        near.url,
        _target(),
        storage_options=near.storage_options,
        replicas=[far.location()],
        options=options,
        stats=stats,
    )
    assert_tree_bit_exact(tree, restored)
    by = stats.bytes_by_location
    assert by.get(near.url, 0) > 0 and by.get(far.url, 0) > 0, by
    assert by[near.url] + by[far.url] >= size * 0.9


def test_a_copy_with_another_save_id_is_never_mixed_in(regions):
    ours, theirs = _tree(2), _tree(3)
    near, far = regions["near"], regions["far"]
    objckpt.save(far.url, ours, storage_options=far.storage_options, options=SMALL)
    objckpt.save(near.url, theirs, storage_options=near.storage_options, options=SMALL)  # same path, other save
    before = near.served
    stats = objckpt.TransferStats()
    restored = objckpt.restore(
        far.url, _target(), storage_options=far.storage_options, replicas=[near.location()], stats=stats
    )
    assert_tree_bit_exact(ours, restored)
    assert near.served - before < 64 * 1024  # its manifest only: no blob of another save
    assert set(stats.bytes_by_location) == {far.url}


def test_no_location_holding_the_checkpoint_names_each(regions):
    near, gcs = regions["near"], regions["gcs"]
    with pytest.raises(objckpt.CheckpointNotFoundError) as caught:
        objckpt.restore(near.url, None, storage_options=near.storage_options, replicas=[gcs.location()])
    assert near.url in str(caught.value) and gcs.url in str(caught.value)


def test_replicas_compose_with_a_lost_primary(regions):
    """The URL asked for is unreachable: the replicas still serve the checkpoint."""
    tree = _tree(4)
    _replicated(regions, tree)
    near, far = regions["near"], regions["far"]
    assert near.proxy is not None
    near.proxy.fail_after(0, "500")
    options = objckpt.Options(request_timeout=3.0, retry=objckpt.RetryConfig(max_attempts=2, max_backoff=0.1))
    restored = objckpt.restore(
        near.url, _target(), storage_options=near.storage_options, replicas=[far.location()], options=options
    )
    assert_tree_bit_exact(tree, restored)


def test_a_blob_damaged_at_rest_at_one_location_is_read_from_the_next(regions):
    """Bit rot at the near copy: the damaged reads persist over their re-reads there,
    then come from the far copy; every byte still checked, the restore bit-exact."""
    tree = _tree(5)
    _replicated(regions, tree)
    near, far = regions["near"], regions["far"]
    store = from_url(near.url, **near.storage_options)
    blobs = sorted(o.key for o in runtime.run_sync(store.list()) if o.key.endswith(".blob"))
    damaged = blobs[len(blobs) // 2]
    data = bytearray(runtime.run_sync(store.get(damaged)))
    data[len(data) // 2] ^= 0x10
    runtime.run_sync(store.put(damaged, bytes(data)))

    stats = objckpt.TransferStats()
    restored = objckpt.restore(
        near.url, _target(), storage_options=near.storage_options, replicas=[far.location()], stats=stats
    )
    assert_tree_bit_exact(tree, restored)
    assert stats.checksum_retries == objckpt.RetryConfig().checksum_reads - 1  # persisted at near, then left
    assert stats.bytes_by_location.get(far.url, 0) > 0, stats.bytes_by_location

    # Without another copy the damage is an error that names the blob, as before.
    with pytest.raises(objckpt.ChecksumMismatchError, match=damaged):
        objckpt.restore(near.url, _target(), storage_options=near.storage_options)


# ------------------------------------------------------------------ replicas kept by the manager


def _step_state(step: int) -> dict[str, Any]:
    return {"w": np.arange(64 * 1024, dtype=np.float32) * (step + 1), "b": np.full(1000, step, np.int16), "step": step}


def _save_ids(root: str, storage_options: dict[str, Any]) -> dict[int, str]:
    mgr = objckpt.CheckpointManager(root, storage_options=storage_options)
    try:
        return {step: mgr.inspect(step).save_id for step in mgr.steps()}
    finally:
        mgr.close()


def test_manager_replicas_hold_the_roots_steps_after_close(regions):
    near, far, gcs = regions["near"], regions["far"], regions["gcs"]
    mgr = objckpt.CheckpointManager(
        near.url,
        storage_options=near.storage_options,
        retention=objckpt.Retention(keep_last=3, keep_every=5),
        replicas=[far.location(), gcs.location()],
        options=objckpt.Options(blob_size=64 * 1024),
    )
    for step in range(20):
        mgr.save(step, _step_state(step))
    mgr.close()
    root_ids = _save_ids(near.url, near.storage_options)
    assert sorted(root_ids) == [0, 5, 10, 15, 17, 18, 19]
    for region in (far, gcs):
        assert _save_ids(region.url, region.storage_options) == root_ids, region.name
        replica = objckpt.CheckpointManager(region.url, storage_options=region.storage_options)
        for step in root_ids:
            assert_tree_bit_exact(_step_state(step), replica.restore(step))
        replica.close()
    statuses = {s.url: s for s in mgr.replica_status()}
    assert set(statuses) == {far.url, gcs.url}
    for status in statuses.values():
        assert status.steps == sorted(root_ids) and status.last_step == 19
        assert status.pending == [] and status.errors == 0 and status.bytes_copied > 0


def test_an_unreachable_replica_never_blocks_training(regions):
    near, far = regions["near"], regions["far"]
    assert far.proxy is not None
    far.proxy.fail_after(0, "500")  # the far region is down for the whole run
    options = objckpt.Options(blob_size=64 * 1024, retry=objckpt.RetryConfig(max_attempts=2, max_backoff=0.05))
    mgr = objckpt.CheckpointManager(
        near.url, storage_options=near.storage_options, replicas=[far.location()], options=options
    )
    for step in range(3):
        mgr.save(step, _step_state(step), wait=True)
    assert mgr.steps() == [0, 1, 2]
    mgr.close(timeout=1.0)
    status = mgr.replica_status()[0]
    assert status.errors >= 1 and status.last_error, status
    assert status.steps == [] and status.pending == [2, 1, 0], status
    # Back up: the next manager on the same roots catches up.
    far.proxy.fail_after(None)
    again = objckpt.CheckpointManager(
        near.url, storage_options=near.storage_options, replicas=[far.location()], options=options
    )
    again.close(timeout=60)
    assert sorted(_save_ids(far.url, far.storage_options)) == [0, 1, 2]


def test_killed_mid_replication_leaves_no_partial_step_and_the_next_run_catches_up(regions):
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    near, far = regions["near"], regions["far"]
    child = Path(__file__).with_name("replica_child.py")
    env = dict(
        os.environ,
        OBJCKPT_TEST_STORAGE_OPTIONS=json.dumps(near.storage_options),
        OBJCKPT_TEST_REPLICAS=json.dumps([[far.url, far.storage_options]]),
        PYTHONPATH=str(child.parents[1]),
    )
    proc = subprocess.Popen(
        [sys.executable, str(child), near.url, "0", "3"], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("replicating"), line
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    root_ids = _save_ids(near.url, near.storage_options)
    assert sorted(root_ids) == [0, 1, 2, 3]
    seen = _save_ids(far.url, far.storage_options)
    assert len(seen) < 4  # killed before the replica had every step
    for step, save_id in seen.items():  # what is visible there is whole
        assert save_id == root_ids[step]
        assert objckpt.verify(f"{far.url}/step_{step:010d}", storage_options=far.storage_options).ok
    mgr = objckpt.CheckpointManager(near.url, storage_options=near.storage_options, replicas=[far.location()])
    mgr.close(timeout=120)
    assert _save_ids(far.url, far.storage_options) == root_ids
    replica = objckpt.CheckpointManager(far.url, storage_options=far.storage_options)
    assert float(replica.restore(3)["w"][5]) == 5.0 + 3
    replica.close()


def test_manager_restore_reads_from_the_nearest_replica(regions):
    near, far = regions["near"], regions["far"]
    mgr = objckpt.CheckpointManager(
        far.url, storage_options=far.storage_options, replicas=[near.location()], options=SMALL
    )
    tree = _step_state(7)
    mgr.save(7, tree, wait=True)
    mgr.close()
    mgr = objckpt.CheckpointManager(far.url, storage_options=far.storage_options, replicas=[near.location()])
    near_before, far_before = near.served, far.served
    assert_tree_bit_exact(tree, mgr.restore(7))
    assert near.served - near_before > far.served - far_before + 200_000
    mgr.close()


def test_cli_ls_replicas_shows_which_steps_exist_where(s3_service, gcs_service):
    """Root and a replica in two S3 buckets, another in GCS: one step everywhere, one only at the
    root, one whose GCS copy is another save, one copy cut off (objects, no manifest)."""
    import json
    import os
    import subprocess
    import sys

    from objckpt.transfer import runtime

    s3_service.make_bucket(FAR_BUCKET)
    name = uuid.uuid4().hex[:12]
    root, s3_replica, gcs_replica = (
        s3_service.url(f"cli-{name}"),
        f"s3://{FAR_BUCKET}/cli-{name}",
        gcs_service.url(f"cli-{name}"),
    )
    s3o, gcso = s3_service.storage_options(), gcs_service.storage_options()
    mgr = objckpt.CheckpointManager(
        root, storage_options=s3o, replicas=[s3_replica, objckpt.Location(gcs_replica, gcso)], options=SMALL
    )
    mgr.save(1, _step_state(1), wait=True)
    mgr.close()
    objckpt.save(f"{root}/step_{2:010d}", _step_state(2), storage_options=s3o)  # at the root only
    objckpt.save(f"{root}/step_{3:010d}", _step_state(3), storage_options=s3o)
    objckpt.copy(
        f"{root}/step_{3:010d}", f"{s3_replica}/step_{3:010d}", src_storage_options=s3o, dst_storage_options=s3o
    )
    objckpt.save(f"{gcs_replica}/step_{3:010d}", _step_state(30), storage_options=gcso)  # another save
    cut = objckpt.CheckpointManager(gcs_replica, storage_options=gcso).store.child(f"step_{2:010d}")
    runtime.run_sync(cut.put("ab/some.blob", b"x" * 100))  # a copy cut off: a blob, no manifest

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "OBJCKPT_"))}
    env.update(s3_service.env())
    env.update(gcs_service.env())
    env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, "-m", "objckpt.cli", "ls", root, "--replicas", s3_replica, gcs_replica]
    done = subprocess.run([*command, "--json"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    doc = {row["step"]: list(row["locations"].values()) for row in json.loads(done.stdout)}
    assert doc == {
        1: ["yes", "yes", "yes"],
        2: ["yes", "-", "partial"],
        3: ["yes", "yes", "other save"],
    }
    table = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert table.returncode == 0 and "other save" in table.stdout and gcs_replica in table.stdout


def test_read_once_composes_with_replicas_across_processes(regions):
    """Two processes restore read-once with a far copy as replica: every unique byte read once,
    from the near location, and the arrays are bit-exact on every process."""
    from multiprocess import run_processes

    near, far = regions["near"], regions["far"]
    job = {
        "url": near.url,
        "storage_options": near.storage_options,
        "mesh": [2, 4],
        "axes": ["data", "model"],
        "options": {"blob_size": 1 << 20, "split_replicas_above": 1 << 14, "barrier_timeout": 60},
    }
    saved = run_processes(2, {**job, "kind": "save"})
    assert all(r is not None for r in saved), saved
    objckpt.copy(near.url, far.url, src_storage_options=near.storage_options, dst_storage_options=far.storage_options)
    info = objckpt.inspect(near.url, storage_options=near.storage_options)
    unique = sum(leaf.nbytes for leaf in info.leaves.values())
    results = run_processes(
        2, {**job, "kind": "restore", "read_once": True, "replicas": [[far.url, far.storage_options]]}
    )
    assert all(r is not None for r in results), results
    for r in results:
        assert r["mismatches"] == []
        assert set(r["bytes_by_location"]) <= {near.url}, r["bytes_by_location"]
    from_near = sum(r["bytes_by_location"].get(near.url, 0) for r in results)
    assert abs(from_near - unique) <= 0.01 * unique, (from_near, unique)


def test_manager_replicates_server_side_within_one_account(regions, s3_service):
    """Root and replica in two buckets behind one endpoint: steps are copied inside the store."""
    near, far = regions["near"], regions["far"]
    replica = objckpt.Location(far.url, near.storage_options)  # the far bucket, through the near endpoint
    mgr = objckpt.CheckpointManager(
        near.url, storage_options=near.storage_options, replicas=[replica], options=objckpt.Options(blob_size=64 * 1024)
    )
    for step in range(3):
        mgr.save(step, _step_state(step))
    mgr.close()
    status = mgr.replica_status()[0]
    assert status.steps == [0, 1, 2] and status.errors == 0, status
    assert set(status.methods.values()) == {"server-side"}, status.methods
    assert status.client_bytes <= 0.01 * status.bytes_copied, (status.client_bytes, status.bytes_copied)
    check = objckpt.CheckpointManager(far.url, storage_options=far.storage_options)
    assert_tree_bit_exact(_step_state(2), check.restore(2))
    check.close()


def test_gc_sweeps_every_replica(regions):
    near, gcs = regions["near"], regions["gcs"]
    mgr = objckpt.CheckpointManager(
        near.url, storage_options=near.storage_options, replicas=[gcs.location()], options=SMALL
    )
    mgr.save(1, _step_state(1), wait=True)
    assert mgr._replicator is not None and mgr._replicator.wait(60)
    from objckpt.transfer import runtime

    stray = objckpt.CheckpointManager(gcs.url, storage_options=gcs.storage_options)
    runtime.run_sync(stray.store.child(f"step_{1:010d}").put("zz/crashed-save.blob", b"x" * 10))
    stray.close()
    deleted = mgr.gc(grace_seconds=0)
    assert f"{gcs.url}/step_{1:010d}/zz/crashed-save.blob" in deleted, deleted
    mgr.close()
    check = objckpt.CheckpointManager(gcs.url, storage_options=gcs.storage_options)
    assert_tree_bit_exact(_step_state(1), check.restore(1))  # the committed step is untouched
    check.close()
