"""verify(read_data=False) / `objckpt verify --no-read`: blobs checked against the checksum the
store keeps (S3: sent with each upload; GCS: computed by the store), no blob read (issue 63)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from helpers import full_manifest, rewrite_as_v1

import objckpt
from backends.proxy import FaultProxy
from objckpt.core.checksum import blob_crc32c, crc32c
from objckpt.errors import ChecksumsUnavailableError, StoreError
from objckpt.storage import from_url
from objckpt.storage.checksums import parse_crc32c_header
from objckpt.transfer import runtime
from objckpt.transfer.engine import TransferEngine

SMALL_BLOBS = objckpt.Options(blob_size=256 * 1024)
_SCRIPT = Path(sys.executable).with_name("objckpt")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "objckpt.cli"]


def _tree(scale: int = 1) -> dict:
    rng = np.random.default_rng(7)
    return {
        "w": rng.standard_normal((256 * scale, 512), dtype=np.float32),  # several blobs of one leaf
        "b": np.arange(1000, dtype=np.int16),  # small leaves packed together, with gaps
        "mu": np.arange(3001, dtype=np.float64),
        "step": 3,
    }


def _port(endpoint_url: str) -> int:
    return int(endpoint_url.rsplit(":", 1)[1])


def _through(kind: str, service, proxy: FaultProxy) -> dict:
    """The service's storage options, every request through ``proxy``."""
    options = service.storage_options()
    if kind == "s3":
        return {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}}
    return {**options, "endpoint_url": proxy.endpoint_url}


@pytest.fixture
def counted(request, s3_service, gcs_service):
    """(kind, url, storage options, proxy): a fresh prefix on S3 or GCS reached through a byte-counting proxy."""
    kind = request.param
    service = s3_service if kind == "s3" else gcs_service
    with FaultProxy("127.0.0.1", _port(service.endpoint_url)) as proxy:
        yield kind, service.url(f"noread-{uuid.uuid4().hex[:12]}/ckpt"), _through(kind, service, proxy), proxy


def _blobs(url: str, options: dict) -> tuple[dict, dict]:
    """(size of each blob, pieces of each blob) from the whole manifest."""
    manifest = full_manifest(from_url(url, **options))
    pieces: dict[str, list] = {}
    for leaf in manifest.leaves:
        for piece in leaf.pieces:
            pieces.setdefault(piece.blob, []).append(piece)
    return {b.key: b.size for b in manifest.blobs}, pieces


# ------------------------------------------------------------------------------------- pure


def test_blob_crc32c_is_the_crc_of_the_blob_with_zero_gaps():
    rng = random.Random(5)
    for _ in range(40):
        size = rng.randint(0, 200_000)
        blob = bytearray(size)
        pieces, end = [], rng.choice([0, 64])
        while True:
            end += rng.choice([0, 64, rng.randint(1, 70_000)])  # gaps: none, alignment, a big spacer
            length = min(rng.randint(1, 50_000), size - end)
            if length <= 0:
                break
            blob[end : end + length] = rng.randbytes(length)
            pieces.append((end, length, crc32c(bytes(blob[end : end + length]))))
            end += length
        rng.shuffle(pieces)
        assert blob_crc32c(pieces, size) == crc32c(bytes(blob))
    with pytest.raises(ValueError, match="overlap"):
        blob_crc32c([(0, 10, 0), (5, 10, 0)], 20)


# ------------------------------------------------------------------------------------- save


@pytest.mark.s3
@pytest.mark.parametrize("save", ["sync", "async"])  # sent in place from the arrays, or staged
def test_save_sends_each_objects_crc32c_and_s3_keeps_it(save, s3_service):
    url = s3_service.url(f"noread-{uuid.uuid4().hex[:12]}/ckpt")
    options = s3_service.storage_options()
    small = objckpt.Options(blob_size=64 << 10)
    if save == "sync":
        objckpt.save(url, _tree(), storage_options=options, options=small)
    else:
        objckpt.save_async(url, _tree(), storage_options=options, options=small).result()
    sizes, _ = _blobs(url, options)
    manifest = full_manifest(from_url(url, **options))
    client, bucket, prefix = s3_service._boto_client(), s3_service.bucket, url.split("/", 3)[3]
    keys = [*sizes, *(ref.key for ref in manifest.indexes)]
    assert len(sizes) > 4
    store = from_url(url, **options)
    for key in keys:
        head = client.head_object(Bucket=bucket, Key=f"{prefix}/{key}", ChecksumMode="ENABLED")
        assert parse_crc32c_header(head.get("ChecksumCRC32C")) == crc32c(runtime.run_sync(store.get(key))), key


@pytest.mark.s3
def test_s3_refuses_an_upload_whose_bytes_are_not_its_crc32c(s3_service):
    url = s3_service.url(f"noread-{uuid.uuid4().hex[:12]}")
    store = from_url(url, **s3_service.storage_options())
    engine = TransferEngine.from_options(store, objckpt.Options())
    data = os.urandom(100_000)
    with pytest.raises(StoreError, match="bad-blob"):
        runtime.run_sync(engine.put("bad-blob", memoryview(data), crc32c=crc32c(data) ^ 1))
    assert not runtime.run_sync(store.list())  # nothing kept
    parts = [memoryview(data[:10]), memoryview(bytes(54)), memoryview(data[10:])]
    runtime.run_sync(engine.put("good-blob", parts, crc32c=crc32c(b"".join(parts))))
    assert runtime.run_sync(store.get("good-blob")) == b"".join(parts)


# ----------------------------------------------------------------------------------- verify


@pytest.mark.s3
@pytest.mark.gcs
@pytest.mark.parametrize("counted", ["s3", "gcs"], indirect=True)
def test_no_read_verify_downloads_under_5_percent_of_the_checkpoint(counted):
    kind, url, options, proxy = counted
    objckpt.save(url, _tree(scale=16), storage_options=options, options=objckpt.Options(blob_size=2 << 20))
    sizes, _ = _blobs(url, options)
    total = sum(sizes.values())
    assert total > 8 << 20 and len(sizes) >= 4

    before = proxy.stats.bytes_down
    report = objckpt.verify(url, read_data=False, storage_options=options)
    downloaded = proxy.stats.bytes_down - before
    assert report.ok, report
    assert report.blobs == len(sizes) and "no blob read" in str(report)
    assert downloaded <= 0.05 * total, (downloaded, total)
    # the same proxy sees the full read: it counts every byte a blob costs
    before = proxy.stats.bytes_down
    assert objckpt.verify(url, storage_options=options).ok
    assert proxy.stats.bytes_down - before >= total


def _write_as_a_stranger(kind: str, service, url: str, key: str, data: bytes) -> None:
    """Write ``data`` at ``key`` as another program would: its own client, no crc32c sent."""
    if kind == "s3":
        prefix = url.split("/", 3)[3]
        service._boto_client().put_object(Bucket=service.bucket, Key=f"{prefix}/{key}", Body=data)
    else:
        import gcsfs

        fs = gcsfs.GCSFileSystem(endpoint_url=service.endpoint_url, token="anon")
        fs.pipe_file(f"{url.removeprefix('gs://')}/{key}", data)


@pytest.mark.s3
@pytest.mark.gcs
@pytest.mark.parametrize("counted", ["s3", "gcs"], indirect=True)
def test_no_read_verify_names_every_missing_resized_and_replaced_blob(counted, s3_service, gcs_service):
    kind, url, options, proxy = counted
    service = s3_service if kind == "s3" else gcs_service
    objckpt.save(url, _tree(scale=4), storage_options=options, options=SMALL_BLOBS)
    sizes, pieces = _blobs(url, options)
    replaced, short, gone, longer = sorted(sizes, key=lambda k: (-sizes[k], k))[:4]
    store = from_url(url, **service.storage_options())
    original = runtime.run_sync(store.get(replaced))
    _write_as_a_stranger(kind, service, url, replaced, os.urandom(len(original)))  # same size, other bytes
    runtime.run_sync(store.put(short, runtime.run_sync(store.get(short))[:100]))
    runtime.run_sync(store.delete(gone))
    runtime.run_sync(store.put(longer, runtime.run_sync(store.get(longer)) + b"x"))

    before = proxy.stats.bytes_down
    report = objckpt.verify(url, read_data=False, storage_options=options)
    assert proxy.stats.bytes_down - before < sum(sizes.values()) // 20
    kinds = {p.blob: p.kind for p in report.problems}
    # S3 keeps no crc32c of an object uploaded without one; GCS computes one, which differs
    stranger = "unchecked" if kind == "s3" else "checksum"
    assert kinds == {replaced: stranger, short: "short", gone: "missing", longer: "size"}, report
    for problem in report.problems:
        assert f"{url}/{problem.blob}" in str(problem)
    assert not report.ok


@pytest.mark.s3
def test_no_read_verify_on_s3_names_a_blob_rewritten_with_its_own_crc32c(s3_service):
    url = s3_service.url(f"noread-{uuid.uuid4().hex[:12]}/ckpt")
    options = s3_service.storage_options()
    objckpt.save(url, _tree(), storage_options=options, options=SMALL_BLOBS)
    sizes, pieces = _blobs(url, options)
    blob = max(sizes, key=lambda k: (sizes[k], k))
    store = from_url(url, **options)
    data = bytearray(runtime.run_sync(store.get(blob)))
    data[pieces[blob][0].offset] ^= 1  # one bit of a piece, stored with the crc32c of the new bytes
    engine = TransferEngine.from_options(store, objckpt.Options())
    runtime.run_sync(engine.put(blob, memoryview(bytes(data)), crc32c=crc32c(bytes(data))))

    report = objckpt.verify(url, read_data=False, storage_options=options)
    assert [(p.kind, p.blob) for p in report.problems] == [("checksum", blob)], report
    assert f"changed blob {url}/{blob}" in str(report.problems[0])


@pytest.mark.s3
def test_no_read_heads_are_signed_and_trust_the_stores_private_ca(store_target_factory, monkeypatch):
    """The HEADs go over HTTPS to a store with a private CA, signed by botocore: unsigned, S3 refuses them."""
    from objckpt.storage.http import s3_signed

    target = store_target_factory("s3-https")
    objckpt.save(target.url, _tree(), storage_options=target.storage_options, options=SMALL_BLOBS)
    report = objckpt.verify(target.url, read_data=False, storage_options=target.storage_options)
    assert report.ok and report.blobs > 2 and report.bytes_read < 64 * 1024, report

    signed = s3_signed.S3SignedRequests._signed

    def unsigned(self, method, request_path, headers):
        return {k: v for k, v in signed(self, method, request_path, headers).items() if k.lower() != "authorization"}

    monkeypatch.setattr(s3_signed.S3SignedRequests, "_signed", unsigned)
    refused = objckpt.verify(target.url, read_data=False, storage_options=target.storage_options)
    assert not refused.ok and len(refused.problems) == report.blobs, refused
    assert all("(its crc32c) failed (HTTP 403" in str(p) and p.blob.endswith(".blob") for p in refused.problems), (
        refused
    )


@pytest.mark.s3
@pytest.mark.gcs
@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_every_format_version_verifies_without_reading(version, kind, s3_service, gcs_service):
    service = s3_service if kind == "s3" else gcs_service
    url, options = service.url(f"noread-{uuid.uuid4().hex[:12]}/v{version}"), service.storage_options()
    tree = {k: v for k, v in _tree().items() if k != "step"} if version < 3 else _tree()
    saved = objckpt.Options(blob_size=64 << 10, format_version=max(version, 2))
    objckpt.save(url, tree, storage_options=options, options=saved)
    if version == 1:
        rewrite_as_v1(from_url(url, **options))
    report = objckpt.verify(url, read_data=False, storage_options=options)
    assert report.ok and report.blobs > 2, report
    assert objckpt.verify(url, storage_options=options).ok  # the full read stays the default


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_stores_without_checksums_refuse_no_read_by_name(kind, store_target_factory):
    target = store_target_factory(kind)
    objckpt.save(target.url, _tree(), storage_options=target.storage_options, options=SMALL_BLOBS)
    with pytest.raises(ChecksumsUnavailableError, match="keeps no checksum") as caught:
        objckpt.verify(target.url, read_data=False, storage_options=target.storage_options)
    assert target.url.rstrip("/").split("://")[-1] in str(caught.value) and "without --no-read" in str(caught.value)
    assert objckpt.verify(target.url, storage_options=target.storage_options).ok  # the full read, when asked


# -------------------------------------------------------------------------------------- CLI


@pytest.mark.s3
def test_cli_no_read(s3_service, tmp_path):
    url = s3_service.url(f"noread-{uuid.uuid4().hex[:12]}/ckpt")
    options = s3_service.storage_options()
    objckpt.save(url, _tree(), storage_options=options, options=SMALL_BLOBS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "OBJCKPT_"))}
    env.update(s3_service.env(), JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=120, check=False)

    run = cli("verify", "--no-read", url)
    assert run.returncode == 0, run
    assert run.stdout.startswith(f"verify {url}: OK;") and "no blob read" in run.stdout, run
    sizes, _ = _blobs(url, options)
    gone = max(sizes, key=lambda k: (sizes[k], k))
    runtime.run_sync(from_url(url, **options).delete(gone))
    run = cli("verify", "--no-read", url)
    assert run.returncode == 1, run
    assert f"PROBLEM missing: missing blob {url}/{gone}" in run.stdout
    local = tmp_path / "ckpt"
    objckpt.save(str(local), _tree())
    run = cli("verify", "--no-read", str(local))
    assert run.returncode == 1 and run.stderr.startswith("objckpt: error: ") and "keeps no checksum" in run.stderr


@pytest.mark.s3
@pytest.mark.gcs
def test_a_streamed_copy_to_s3_sends_each_blobs_crc32c(s3_service, gcs_service):
    src = gcs_service.url(f"noread-{uuid.uuid4().hex[:12]}/ckpt")
    dst = s3_service.url(f"noread-{uuid.uuid4().hex[:12]}/copy")
    objckpt.save(src, _tree(), storage_options=gcs_service.storage_options(), options=SMALL_BLOBS)
    objckpt.copy(
        src, dst, src_storage_options=gcs_service.storage_options(), dst_storage_options=s3_service.storage_options()
    )
    report = objckpt.verify(dst, read_data=False, storage_options=s3_service.storage_options())
    assert report.ok and report.blobs > 2, report
