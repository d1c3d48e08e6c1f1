"""Server-side copy: bucket to bucket of one provider and account, the bytes never crossing the client.

Against the local servers: SeaweedFS (S3) behind one counting proxy that both
buckets are reached through, so the proxy's byte counts are the client's
traffic; fake-gcs-server (GCS) the same way. Elsewhere (S3 → GCS, a refusal,
``server_side=False``) the copy streams through the client and says so.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_bit_exact, full_manifest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from backends.proxy import FaultProxy
from objckpt.errors import StoreError, StorePermissionError
from objckpt.storage import from_url
from objckpt.storage.copy import s3 as s3_copy
from objckpt.storage.copy import server as server_copy
from objckpt.tools.copy import DestinationCommittedError, committed_save_id, copy_stores_async
from objckpt.transfer import runtime
from objckpt.transfer.retries import close_store, open_store

MiB = 1 << 20
BLOBS = objckpt.Options(blob_size=4 * MiB)
DST_BUCKET = "objckpt-copy-dst"


def _host_port(endpoint_url: str) -> tuple[str, int]:
    host, port = endpoint_url.rsplit("/", 1)[1].rsplit(":", 1)
    return host, int(port)


def _tree(seed: int = 0) -> dict:
    """About 24 MiB: a sharded jax array, a numpy array of random bits, a scalar."""
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    w = jnp.arange(1024 * 4096, dtype=jnp.float32).reshape(1024, 4096) + seed
    rng = np.random.default_rng(seed)
    return {
        "w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))),
        "opt": rng.integers(0, 2**31, size=2 * MiB, dtype=np.int32),
        "step": 3 + seed,
    }


def _name() -> str:
    return f"sc-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def s3_door(s3_service):
    """One proxy in front of the S3 server: every request of both buckets crosses it."""
    s3_service.make_bucket(DST_BUCKET)
    with FaultProxy(*_host_port(s3_service.endpoint_url)) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def gcs_door(gcs_service):
    gcs_service.make_bucket(DST_BUCKET)
    with FaultProxy(*_host_port(gcs_service.endpoint_url)) as proxy:
        yield proxy


def _s3_options(s3_service, door, **extra) -> dict:
    options = s3_service.storage_options()
    options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": door.endpoint_url}
    return {**options, **extra}


def _s3_pair(s3_service, door) -> tuple[str, str, dict]:
    """(source in the server's bucket, destination in another bucket, options for both)."""
    name = _name()
    return s3_service.url(f"{name}/ckpt"), f"s3://{DST_BUCKET}/{name}/copy", _s3_options(s3_service, door)


def _moved(door) -> int:
    return door.stats.bytes_up + door.stats.bytes_down


def _checked_copy(src, dst, so, tree, door, **kwargs) -> tuple[objckpt.CopyStats, int]:
    before = _moved(door)
    stats = objckpt.copy(src, dst, src_storage_options=so, dst_storage_options=so, **kwargs)
    moved = _moved(door) - before
    assert objckpt.verify(dst, storage_options=so).ok
    assert_tree_bit_exact(tree, objckpt.restore(dst, tree, storage_options=so))
    return stats, moved


# ------------------------------------------------------------------------------------------ S3


def test_s3_bucket_to_bucket_is_server_side_and_moves_under_one_percent(s3_service, s3_door):
    src, dst, so = _s3_pair(s3_service, s3_door)
    tree = _tree()
    objckpt.save(src, tree, storage_options=so, options=BLOBS)
    stats, moved = _checked_copy(src, dst, so, tree, s3_door)

    assert stats.bytes_total >= 20 * MiB and stats.blobs >= 5
    assert stats.method == "server-side" and stats.streamed_because == ""
    assert stats.blobs_server_side == stats.blobs_copied == stats.blobs
    assert stats.bytes_server_side == stats.bytes_copied == stats.bytes_total
    assert moved <= 0.01 * stats.bytes_total, f"{moved} bytes crossed the client's link"
    assert stats.client_bytes <= moved  # what the client counts: the index objects and the manifest
    summary = stats.summary()
    assert "server-side" in summary and "client bytes moved" in summary
    assert s3_service.secret_key not in summary
    assert runtime.run_sync(from_url(dst, **so).get("manifest.json")) == runtime.run_sync(
        from_url(src, **so).get("manifest.json")
    )


def test_server_side_false_streams_every_byte(s3_service, s3_door):
    src, dst, so = _s3_pair(s3_service, s3_door)
    tree = _tree(1)
    objckpt.save(src, tree, storage_options=so, options=BLOBS)
    stats, moved = _checked_copy(src, dst, so, tree, s3_door, server_side=False)
    assert stats.method == "streamed" and stats.streamed_because == "server_side=False"
    assert stats.blobs_server_side == 0 and stats.blobs_copied == stats.blobs
    assert stats.bytes_read >= stats.bytes_total and stats.bytes_written >= stats.bytes_total
    assert moved >= 2 * stats.bytes_total  # the proxy sees each byte go down and come back up
    assert "streamed (server_side=False)" in stats.summary()


def test_s3fs_destination_copies_server_side_too(s3_service, s3_door):
    """The s3fs store (the fallback client) copies with its own CopyObject."""
    src, dst, so = _s3_pair(s3_service, s3_door)
    tree = _tree(2)
    objckpt.save(src, tree, storage_options=so, options=BLOBS)
    before = _moved(s3_door)
    stats = objckpt.copy(src, dst, src_storage_options=so, dst_storage_options={**so, "objckpt_backend": "fsspec"})
    assert stats.method == "server-side" and stats.blobs_server_side == stats.blobs
    assert _moved(s3_door) - before <= 0.01 * stats.bytes_total
    assert_tree_bit_exact(tree, objckpt.restore(dst, tree, storage_options=so))


def test_multipart_server_side_copy(s3_service, s3_door, monkeypatch):
    """Blobs above the threshold are copied in parts (UploadPartCopy), which SeaweedFS supports."""
    src, dst, so = _s3_pair(s3_service, s3_door)
    tree = _tree(3)
    objckpt.save(src, tree, storage_options=so, options=objckpt.Options(blob_size=12 * MiB))
    monkeypatch.setattr(s3_copy, "MULTIPART_COPY_THRESHOLD", 6 * MiB)
    monkeypatch.setattr(s3_copy, "MULTIPART_COPY_PART_SIZE", 5 * MiB)
    calls: list[str] = []
    run = server_copy.S3Copier._run

    async def spy(self, what, method, **params):
        calls.append(method)
        return await run(self, what, method, **params)

    monkeypatch.setattr(server_copy.S3Copier, "_run", spy)
    stats, moved = _checked_copy(src, dst, so, tree, s3_door)
    big = [b for b in full_manifest(from_url(src, **so)).blobs if b.size > 6 * MiB]
    assert big and stats.method == "server-side"
    assert calls.count("complete_multipart_upload") == len(big)
    assert calls.count("upload_part_copy") == sum(-(-b.size // (5 * MiB)) for b in big)
    assert moved <= 0.01 * stats.bytes_total


def test_rerun_after_a_partial_copy_copies_only_what_is_missing_or_different(s3_service, s3_door):
    src, dst, so = _s3_pair(s3_service, s3_door)
    tree = _tree(4)
    objckpt.save(src, tree, storage_options=so, options=BLOBS)
    objckpt.copy(src, dst, src_storage_options=so, dst_storage_options=so)
    store = from_url(dst, **so)
    blobs = {b.key: b.size for b in full_manifest(store).blobs}
    # an interrupted copy: no manifest, two blobs never arrived, one arrived different (right size)
    runtime.run_sync(store.delete("manifest.json"))
    missing, damaged = sorted(blobs)[:2], sorted(blobs)[2]
    for key in missing:
        runtime.run_sync(store.delete(key))
    runtime.run_sync(store.put(damaged, b"\0" * blobs[damaged]))

    stats, moved = _checked_copy(src, dst, so, tree, s3_door)
    assert stats.method == "server-side"
    assert stats.blobs_copied == stats.blobs_server_side == 3  # the ETags tell the damaged blob
    assert stats.bytes_copied == sum(blobs[k] for k in [*missing, damaged])
    assert stats.blobs_skipped == len(blobs) - 3 and stats.bytes_read_dst == 0
    assert moved <= 0.01 * stats.bytes_total


def test_async_entry_point_and_a_committed_destination(s3_service, s3_door):
    src_url, dst_url, so = _s3_pair(s3_service, s3_door)
    objckpt.save(src_url, _tree(5), storage_options=so, options=BLOBS)
    options = objckpt.Options()
    src, dst = open_store(src_url, so, options), open_store(dst_url, so, options)
    try:
        assert runtime.run_sync(committed_save_id(dst, options)) is None
        stats = runtime.run_sync(copy_stores_async(src, dst, options))
        assert stats.method == "server-side"
        save_id = runtime.run_sync(committed_save_id(src, options))
        assert save_id and runtime.run_sync(committed_save_id(dst, options)) == save_id
        with pytest.raises(DestinationCommittedError, match="copied already") as info:
            runtime.run_sync(copy_stores_async(src, dst, options))
        assert isinstance(info.value, objckpt.CheckpointExistsError)
        assert info.value.same and info.value.save_id == save_id
    finally:
        close_store(src)
        close_store(dst)


def test_a_refusal_falls_back_to_streaming_once_and_says_why(s3_service, s3_door, monkeypatch, caplog):
    src, dst, so = _s3_pair(s3_service, s3_door)
    tree = _tree(6)
    objckpt.save(src, tree, storage_options=so, options=BLOBS)
    attempts: list[str] = []

    async def refused(self, source, key, size, call):
        attempts.append(key)
        raise StorePermissionError(f"copy {key} failed (HTTP 403): AccessDenied")

    monkeypatch.setattr(server_copy.S3Copier, "copy", refused)
    with caplog.at_level(logging.WARNING, logger="objckpt"):
        stats, moved = _checked_copy(src, dst, so, tree, s3_door)
    assert len(attempts) == 1  # the first copy alone is tried
    assert stats.method == "streamed" and "permission denied" in stats.streamed_because
    assert stats.blobs_copied == stats.blobs and stats.blobs_server_side == 0
    assert moved >= 2 * stats.bytes_total
    warnings = [r.getMessage() for r in caplog.records if "server-side copy refused" in r.getMessage()]
    assert len(warnings) == 1 and "AccessDenied" in warnings[0]


def test_a_failure_that_is_not_a_refusal_is_raised_and_commits_nothing(s3_service, s3_door, monkeypatch):
    src, dst, so = _s3_pair(s3_service, s3_door)
    objckpt.save(src, _tree(7), storage_options=so, options=BLOBS)

    async def broken(self, source, key, size, call):
        raise StoreError(f"copy {key} failed after 10 attempts: connection reset")

    monkeypatch.setattr(server_copy.S3Copier, "copy", broken)
    with pytest.raises(StoreError, match="after 10 attempts"):
        objckpt.copy(src, dst, src_storage_options=so, dst_storage_options=so)
    with pytest.raises(objckpt.CheckpointNotFoundError):
        objckpt.inspect(dst, storage_options=so)


def test_a_source_blob_of_the_wrong_size_is_an_integrity_error(s3_service, s3_door):
    """The server copies what is there; the size check after each copy catches a short source blob."""
    src, dst, so = _s3_pair(s3_service, s3_door)
    objckpt.save(src, _tree(8), storage_options=so, options=BLOBS)
    store = from_url(src, **so)
    key = sorted(b.key for b in full_manifest(store).blobs)[1]
    runtime.run_sync(store.put(key, runtime.run_sync(store.get(key))[:1000]))
    with pytest.raises(objckpt.IntegrityError, match=rf"server-side copy of .*{key} is 1000 bytes"):
        objckpt.copy(src, dst, src_storage_options=so, dst_storage_options=so)
    with pytest.raises(objckpt.CheckpointNotFoundError):
        objckpt.inspect(dst, storage_options=so)


def test_throttled_copies_are_retried(s3_service, s3_door):
    src, dst, so = _s3_pair(s3_service, s3_door)
    tree = _tree(9)
    objckpt.save(src, tree, storage_options=so, options=BLOBS)
    s3_door.set_faults(0.5, ["503"], only=f"PUT /{DST_BUCKET}/")
    try:
        stats = objckpt.copy(src, dst, src_storage_options=so, dst_storage_options=so)
    finally:
        s3_door.set_faults(0.0)
    assert stats.method == "server-side" and stats.retries > 0
    assert_tree_bit_exact(tree, objckpt.restore(dst, tree, storage_options=so))


def test_s3_over_https_trusts_the_stores_private_ca(store_target_factory, tmp_path, monkeypatch):
    """The copier's botocore client trusts the CA the store's options name (a file it removes after)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this process's CA files only, not other workers'
    src, dst = store_target_factory("s3-https"), store_target_factory("s3-https")
    tree = _tree(13)
    objckpt.save(src.url, tree, storage_options=src.storage_options, options=BLOBS)
    ca_files = set(Path(tempfile.gettempdir()).glob("objckpt-ca-*.pem"))
    stats = objckpt.copy(
        src.url, dst.url, src_storage_options=src.storage_options, dst_storage_options=dst.storage_options
    )
    assert stats.method == "server-side" and stats.blobs_server_side == stats.blobs
    assert set(Path(tempfile.gettempdir()).glob("objckpt-ca-*.pem")) == ca_files
    assert_tree_bit_exact(tree, objckpt.restore(dst.url, tree, storage_options=dst.storage_options))


def test_who_can_copy_server_side_is_decided_from_configuration(s3_service, s3_door, gcs_service):
    """Same endpoint and credential source, or no server-side copy (no request is made to decide)."""
    so = _s3_options(s3_service, s3_door)
    a = from_url(s3_service.url("x"), **so)

    def why(other: dict, url: str = f"s3://{DST_BUCKET}/y") -> str:
        copier, reason = server_copy.plan(a, from_url(url, **other), request_timeout=10, concurrency=2)
        if copier is not None:
            copier.close()
        return reason

    assert why(so) == ""
    assert why({**so, "key": "ANOTHERKEY"}).startswith("different credentials")
    assert why(s3_service.storage_options()).startswith("different endpoints")  # the server itself, not the proxy
    assert why(gcs_service.storage_options(), gcs_service.url("z")) == "different providers (s3 and gcs)"
    assert "cannot copy server-side" in why({}, "memory://objckpt-tests/z")
    account = server_copy.account_of(a)
    assert account is not None and s3_service.access_key not in repr(account)


# ----------------------------------------------------------------------------------------- GCS


def test_a_gcs_account_names_the_endpoint_the_store_was_configured_with(gcs_service, gcs_door, monkeypatch):
    """The endpoint comes from the store's configuration (``endpoint_url``, or the emulator variable),
    never from gcsfs's private attributes: a gcsfs without ``_location`` changes nothing."""
    import gcsfs.core

    direct = from_url(gcs_service.url("a"), **gcs_service.storage_options())
    proxied = from_url(gcs_service.url("b"), **{**gcs_service.storage_options(), "endpoint_url": gcs_door.endpoint_url})
    monkeypatch.delattr(gcsfs.core.GCSFileSystem, "_location")
    accounts = server_copy.account_of(direct), server_copy.account_of(proxied)
    assert [a.endpoint if a else None for a in accounts] == [
        gcs_service.endpoint_url.rstrip("/").lower(),
        gcs_door.endpoint_url.rstrip("/").lower(),
    ]
    assert direct.endpoint == gcs_service.endpoint_url.rstrip("/")
    assert proxied.child("c/d").endpoint == gcs_door.endpoint_url.rstrip("/")
    copier, reason = server_copy.plan(direct, proxied, request_timeout=10, concurrency=2)
    assert copier is None and reason.startswith("different endpoints")


def test_gcs_bucket_to_bucket_is_server_side(gcs_service, gcs_door):
    """fake-gcs-server supports rewriteTo, which gcsfs's copy uses."""
    so = {**gcs_service.storage_options(), "endpoint_url": gcs_door.endpoint_url}
    name = _name()
    src, dst = gcs_service.url(f"{name}/ckpt"), f"gs://{DST_BUCKET}/{name}/copy"
    tree = _tree(10)
    objckpt.save(src, tree, storage_options=so, options=BLOBS)
    stats, moved = _checked_copy(src, dst, so, tree, gcs_door)
    assert stats.method == "server-side" and stats.blobs_server_side == stats.blobs
    assert moved <= 0.01 * stats.bytes_total, f"{moved} bytes crossed the client's link"

    # a rerun after a partial copy: the crc32c the server keeps tells a damaged blob
    store = from_url(dst, **so)
    blobs = {b.key: b.size for b in full_manifest(store).blobs}
    runtime.run_sync(store.delete("manifest.json"))
    gone, damaged = sorted(blobs)[:2]
    runtime.run_sync(store.delete(gone))
    runtime.run_sync(store.put(damaged, b"\0" * blobs[damaged]))
    stats, moved = _checked_copy(src, dst, so, tree, gcs_door)
    assert stats.method == "server-side" and stats.blobs_copied == 2 and stats.blobs_skipped == len(blobs) - 2
    assert moved <= 0.01 * stats.bytes_total


def test_s3_to_gcs_streams_and_says_so(s3_service, s3_door, gcs_service):
    so = _s3_options(s3_service, s3_door)
    name = _name()
    src, dst = s3_service.url(f"{name}/ckpt"), gcs_service.url(f"{name}/copy")
    tree = _tree(11)
    objckpt.save(src, tree, storage_options=so, options=BLOBS)
    stats = objckpt.copy(src, dst, src_storage_options=so, dst_storage_options=gcs_service.storage_options())
    assert stats.method == "streamed" and stats.streamed_because == "different providers (s3 and gcs)"
    assert stats.bytes_read >= stats.bytes_total and stats.blobs_server_side == 0
    assert_tree_bit_exact(tree, objckpt.restore(dst, tree, storage_options=gcs_service.storage_options()))


# ----------------------------------------------------------------------------------------- CLI

_SCRIPT = Path(sys.executable).with_name("objckpt")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "objckpt.cli"]


def test_cli_cp_names_the_method_and_the_client_bytes(s3_service, gcs_service, tmp_path):
    s3_service.make_bucket(DST_BUCKET)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "OBJCKPT_"))}
    env.update(s3_service.env())
    env.update(gcs_service.env())
    env.update(JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore")
    name = _name()
    src = s3_service.url(f"{name}/ckpt")
    tree = _tree(12)
    objckpt.save(src, tree, storage_options=s3_service.storage_options(), options=BLOBS)

    def cli(*args: str) -> str:
        done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=180, check=False)
        assert done.returncode == 0, done
        return done.stdout

    out = cli("cp", src, f"s3://{DST_BUCKET}/{name}/copy")
    assert " server-side: " in out and "client bytes moved" in out, out
    doc = json.loads(cli("cp", src, f"s3://{DST_BUCKET}/{name}/copy2", "--json"))
    assert doc["method"] == "server-side" and doc["blobs_server_side"] == doc["blobs"] > 0
    assert doc["client_bytes"] < 0.01 * doc["bytes_total"]
    forced = json.loads(cli("cp", src, f"s3://{DST_BUCKET}/{name}/copy3", "--no-server-side", "--json"))
    assert forced["method"] == "streamed" and forced["client_bytes"] >= forced["bytes_total"]
    out = cli("cp", src, str(tmp_path / "local"))
    assert " streamed (" in out and "client bytes moved" in out, out
    assert_tree_bit_exact(tree, objckpt.restore(str(tmp_path / "local"), tree))
