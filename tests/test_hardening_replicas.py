"""Hardening of copies and replicas (issue 51, items 1, 11, 13, 14), against the local S3 and GCS servers.

* A blob size an index object declares is a claim: a server-side ``objckpt cp`` plans its copy
  only from the size the source's listing confirms, and a multipart copy's parts stay bounded.
* A damaged index object at the nearest replica fails over, as a damaged blob does.
* A replica copy abandoned mid-way (its step left the root by retention) leaves nothing behind.
* With the primary unreachable, a manager's listing answers from a replica, and says which.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_tree_bit_exact

import objckpt
from backends.proxy import FaultProxy
from objckpt.core.checksum import crc32c
from objckpt.storage import from_url
from objckpt.storage.copy import s3 as s3_copy
from objckpt.transfer import runtime

MiB = 1 << 20
DST_BUCKET = "objckpt-hardening-dst"
_SCRIPT = Path(sys.executable).with_name("objckpt")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "objckpt.cli"]


def _name() -> str:
    return f"hr-{uuid.uuid4().hex[:10]}"


def _port(endpoint_url: str) -> int:
    return int(endpoint_url.rsplit(":", 1)[1].rstrip("/"))


def _state(step: int, n: int = 64 * 1024) -> dict[str, Any]:
    import numpy as np

    return {"w": np.arange(n, dtype=np.float32) * (step + 1), "b": np.full(1000, step, np.int16), "step": step}


def _rewrite_index(store: Any, edit: Any) -> str:
    """Replace the first index object of the checkpoint at ``store`` with ``edit(doc)`` and pin
    the new bytes in the root (size, crc32c, blob count and bytes), as a hostile writer would.
    Returns the index object's key."""
    root = json.loads(runtime.run_sync(store.get("manifest.json")))
    ref = root["indexes"][0]
    doc = json.loads(runtime.run_sync(store.get(ref["key"])))
    edit(doc)
    data = json.dumps(doc).encode()
    runtime.run_sync(store.put(ref["key"], data))
    ref.update(size=len(data), crc32c=crc32c(data), blobs=len(doc["blobs"]))
    ref["blob_bytes"] = sum(size for _, size in doc["blobs"])
    runtime.run_sync(store.delete("manifest.json"))
    runtime.run_sync(store.put("manifest.json", json.dumps(root).encode(), mode="create"))
    return ref["key"]


# ------------------------------------------------------------------ 1. declared sizes in a server-side cp


def _capped(limit: int, argv: list[str]) -> list[str]:
    """``argv`` run with at most ``limit`` bytes of address space (set before it starts)."""
    start = "import os, resource, sys; resource.setrlimit(resource.RLIMIT_AS, (%d, %d)); os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", start % (limit, limit), *argv]


def test_cp_between_s3_locations_refuses_a_declared_blob_size_the_store_does_not_confirm(s3_service):
    """A blob declared 2^62 bytes: ``objckpt cp`` (server-side) names the blob and fails at once,
    in a process capped at 3 GiB of address space (the part list alone used to need 2^34 tuples)."""
    s3_service.make_bucket(DST_BUCKET)
    src = s3_service.url(f"{_name()}/ckpt")
    so = s3_service.storage_options()
    objckpt.save(src, _state(1), storage_options=so, options=objckpt.Options(format_version=2))  # JSON index
    store = from_url(src, **so)
    declared: dict[str, Any] = {}

    def huge(doc: dict[str, Any]) -> None:
        declared["key"], real = doc["blobs"][0]
        doc["blobs"][0][1] = 2**62
        declared["real"] = real

    _rewrite_index(store, huge)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "OBJCKPT_"))}
    env.update(s3_service.env(), JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore")
    done = subprocess.run(
        _capped(3 << 30, [*CLI, "cp", src, f"s3://{DST_BUCKET}/{_name()}/copy"]),
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    assert "MemoryError" not in said, said
    assert declared["key"] in said and str(2**62) in said and f"is {declared['real']} bytes" in said, said
    assert "nothing was committed" in said, said


def test_a_multipart_copy_holds_a_bounded_number_of_parts(monkeypatch):
    """However large the size it is given, a multipart copy keeps S3's 10,000 parts, starts its
    part requests a few at a time, and refuses what no S3 object can be without a request."""
    assert s3_copy.multipart_part_size(2**62, 256 * MiB) is None
    assert s3_copy.multipart_part_size(5 * 2**40, 256 * MiB) == -(-(5 * 2**40) // 10_000)
    assert s3_copy.multipart_part_size(2 * 2**30, 256 * MiB) == 256 * MiB

    copier = object.__new__(s3_copy.S3Copier)
    copier.multipart_threshold, copier.part_size, copier._extra = 1, 5 * MiB, {}
    calls: list[str] = []
    in_flight = [0, 0]  # now, most

    class Target:
        url = "s3://dst"

        def bucket_object(self, key: str) -> tuple[str, str]:
            return ("dst", key)

    copier._dst = Target()

    async def run(what: str, method: str, **params: Any) -> Any:
        calls.append(method)
        if method == "create_multipart_upload":
            return {"UploadId": "u"}
        if method == "upload_part_copy":
            in_flight[0] += 1
            in_flight[1] = max(in_flight)
            import asyncio

            await asyncio.sleep(0)
            in_flight[0] -= 1
            return {"CopyPartResult": {"ETag": str(params["PartNumber"])}}
        return {}

    async def call(what: str, make: Any) -> Any:
        return await make()

    monkeypatch.setattr(copier, "_run", run)
    with pytest.raises(objckpt.StoreError, match="more than one S3 object holds"):
        runtime.run_sync(copier.copy(("src", "k"), "k", 2**62, call))
    assert calls == []
    runtime.run_sync(copier.copy(("src", "k"), "k", 60 * 10_000 * MiB, call))  # 586 GiB: parts grow
    assert calls.count("upload_part_copy") == 10_000 and calls[-1] == "complete_multipart_upload"
    assert in_flight[1] <= s3_copy.MULTIPART_COPY_CONCURRENCY


# ------------------------------------------------------------------ 11. damaged index objects fail over


@pytest.fixture
def two_regions(s3_service):
    """(near, far): two prefixes on the S3 server, far behind a proxy with 30 ms RTT."""
    options = s3_service.storage_options()
    with FaultProxy("127.0.0.1", _port(s3_service.endpoint_url), latency_ms=30) as proxy:
        far_options = {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}}
        name = _name()
        near = objckpt.Location(s3_service.url(f"near-{name}"), options)
        far = objckpt.Location(s3_service.url(f"far-{name}"), far_options)
        yield near, far, proxy


def test_an_index_object_damaged_at_the_nearest_replica_is_read_at_the_next(two_regions, caplog):
    near, far, _ = two_regions
    tree = _state(11)
    objckpt.save(near.url, tree, storage_options=near.storage_options)
    objckpt.copy(near.url, far.url, src_storage_options=near.storage_options, dst_storage_options=far.storage_options)
    store = from_url(near.url, **near.storage_options)
    key = json.loads(runtime.run_sync(store.get("manifest.json")))["indexes"][0]["key"]
    data = bytearray(runtime.run_sync(store.get(key)))
    data[len(data) // 2] ^= 0x01  # bit rot at rest: the root's crc32c no longer matches
    runtime.run_sync(store.put(key, bytes(data)))

    stats = objckpt.TransferStats()
    with caplog.at_level("WARNING", logger="objckpt"):
        restored = objckpt.restore(near.url, None, storage_options=near.storage_options, replicas=[far], stats=stats)
    assert_tree_bit_exact(tree, restored)
    assert stats.bytes_by_location.get(far.url, 0) > 0, stats.bytes_by_location
    left = [r.getMessage() for r in caplog.records if "leaves" in r.getMessage()]
    assert any(near.url in m and "FormatError" in m and key in m for m in left), left

    # Without another copy the damage is a FormatError naming the index object, as before.
    with pytest.raises(objckpt.FormatError, match=key):
        objckpt.restore(near.url, None, storage_options=near.storage_options)


# ------------------------------------------------------------------ 13. abandoned replica copies


def _keys(location: objckpt.Location, prefix: str = "") -> list[str]:
    store = from_url(location.url, **(location.storage_options or {}))
    return sorted(o.key for o in runtime.run_sync(store.list(prefix)))


def test_a_replica_copy_abandoned_by_retention_leaves_nothing_behind(two_regions):
    """Step 0 is being copied to a slow replica when the root's retention deletes it: the copy
    stops, and what it wrote at the replica is deleted; step 1 is replicated whole."""
    near, far, proxy = two_regions
    proxy.latency_ms = 150  # the copy of step 0 takes seconds; saving step 1 at the root does not
    options = objckpt.Options(blob_size=64 * 1024, max_concurrency=2)
    mgr = objckpt.CheckpointManager(
        near.url,
        storage_options=near.storage_options,
        retention=objckpt.Retention(keep_last=1),
        replicas=[far],
        options=options,
    )
    try:
        mgr.save(0, _state(0, n=512 * 1024), wait=True)  # 2 MiB in 32 blobs: seconds at the far replica
        direct = objckpt.Location(far.url, near.storage_options)  # the far bucket, seen without the delay
        deadline = time.monotonic() + 60
        while not _keys(direct, "step_0000000000/") and time.monotonic() < deadline:
            time.sleep(0.05)  # until the copy of step 0 has written something there
        assert _keys(direct, "step_0000000000/")
        mgr.save(1, _state(1, n=512 * 1024), wait=True)  # the root keeps step 1 only
    finally:
        mgr.close(timeout=120)
    status = mgr.replica_status()[0]
    assert status.skipped == [0], status  # the copy of step 0 was abandoned mid-way
    assert status.steps == [1], status
    assert {k.split("/")[0] for k in _keys(near)} == {"step_0000000001"}
    assert _keys(far, "step_0000000000") == []
    assert "step_0000000001/manifest.json" in _keys(far)


# ------------------------------------------------------------------ 14. listing falls over to the replicas


def test_with_the_primary_unreachable_the_steps_are_listed_from_a_replica(s3_service, caplog):
    """A resume script's ``latest_step()`` with the root down: a replica answers, quickly, and
    a warning says which; with no replica answering either, a StoreError names every location."""
    options = s3_service.storage_options()
    name = _name()
    with FaultProxy("127.0.0.1", _port(s3_service.endpoint_url)) as door:
        through = {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": door.endpoint_url}}
        root = s3_service.url(f"root-{name}")
        replica = objckpt.Location(s3_service.url(f"replica-{name}"), options)
        mgr = objckpt.CheckpointManager(root, storage_options=through, replicas=[replica])
        for step in range(3):
            mgr.save(step, _state(step), wait=True)
        mgr.close(timeout=120)
        assert _keys(replica, "step_0000000002/manifest.json")

        door.fail_after(0, "500")  # the primary's region is down
        resumed = objckpt.CheckpointManager(root, storage_options=through, replicas=[replica])
        try:
            started = time.monotonic()
            with caplog.at_level("WARNING", logger="objckpt"):
                latest = resumed.latest_step()
                steps = resumed.steps()
            elapsed = time.monotonic() - started
            assert latest == 2 and steps == [0, 1, 2]
            assert elapsed < 20.0, f"{elapsed:.1f} s"  # two short probes of the root per call, not 10 retries
            said = [r.getMessage() for r in caplog.records if "steps" in r.getMessage()]
            assert any(root in m and replica.url in m for m in said), said
            assert_tree_bit_exact(_state(2), resumed.restore(latest))

            unreachable = objckpt.CheckpointManager(
                root, storage_options=through, replicas=[objckpt.Location(replica.url, through)]
            )
            try:
                with pytest.raises(objckpt.StoreError) as caught:
                    unreachable.steps()
                assert root in str(caught.value) and replica.url in str(caught.value)
            finally:
                unreachable.close(timeout=0)
        finally:
            resumed.close(timeout=0)
            door.fail_after(None)


def test_cli_ls_replicas_lists_the_replicas_when_the_root_is_down(s3_service, gcs_service):
    name = _name()
    root, replica = s3_service.url(f"cli-{name}"), gcs_service.url(f"cli-{name}")
    mgr = objckpt.CheckpointManager(
        root,
        storage_options=s3_service.storage_options(),
        replicas=[objckpt.Location(replica, gcs_service.storage_options())],
    )
    for step in (4, 5):
        mgr.save(step, _state(step), wait=True)
    mgr.close(timeout=120)
    with FaultProxy("127.0.0.1", _port(s3_service.endpoint_url)) as door:
        door.fail_after(0, "500")  # the root's region is down
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "OBJCKPT_"))}
        env.update(gcs_service.env())
        env.update(s3_service.env(), JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore")
        env["AWS_ENDPOINT_URL"] = door.endpoint_url
        done = subprocess.run(
            [*CLI, "ls", root, "--replicas", replica, "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    rows = {row["step"]: row["locations"] for row in json.loads(done.stdout)}
    assert rows == {4: {root: "unreachable", replica: "yes"}, 5: {root: "unreachable", replica: "yes"}}, rows
    assert f"{root} did not answer" in done.stderr, done.stderr


def test_a_plain_replica_url_takes_the_calls_options_only_for_the_same_kind_of_store():
    """An S3 primary's keys go to S3 replicas, not to a ``file://`` one (where they are unknown
    options, refused); a Location keeps its own."""
    from objckpt.restoring.locations import Location, as_locations

    given = {"key": "k", "secret": "s"}
    urls = ["s3://b/x", "s3a://b/y", "file:///tmp/z", "/tmp/w", Location("gs://b/q", {"token": "anon"})]
    found = as_locations(urls, given, primary="s3://a/r")
    assert [loc.storage_options for loc in found] == [given, given, None, None, {"token": "anon"}]
    assert [loc.storage_options for loc in as_locations(["/tmp/a", "gs://b"], given, primary="/tmp/r")] == [
        given,
        None,
    ]
