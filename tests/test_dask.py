"""Offline jobs on Dask (objckpt.transfer.dask_jobs): verify, cp and export fanned out on 2 local
workers against the local S3, the result identical to the one-process run, a killed worker's
task run again."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import sys
import time
import urllib.parse

import numpy as np
import pytest
from helpers import full_manifest, upload_dir

import objckpt
from backends.proxy import FaultProxy
from objckpt.transfer import runtime

distributed = pytest.importorskip("distributed")

SMALL_BLOBS = objckpt.Options(blob_size=64 * 1024)


def _tree(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "params": {f"w{i}": rng.standard_normal((64, 96 + i), dtype=np.float32) for i in range(6)},
        "opt": {"mu": np.arange(40000, dtype=np.int32) * (seed + 1)},
        "step": 7,
    }


@pytest.fixture(scope="module")
def client():
    """2 workers in this process (threads): fast, and enough to split every job."""
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as lc,
        distributed.Client(lc) as c,
    ):
        yield c


def _saved(target, seed=0):
    objckpt.save(target.url, _tree(seed), storage_options=target.storage_options, options=SMALL_BLOBS)
    return target


def _damage(target):
    """Flip a byte in the middle of the largest blob; its key."""
    store = target.open()
    sizes = {b.key: b.size for b in full_manifest(store).blobs}
    key = max(sizes, key=lambda k: (sizes[k], k))
    data = bytearray(runtime.run_sync(store.get(key)))
    data[len(data) // 2] ^= 0xFF
    runtime.run_sync(store.put(key, bytes(data)))
    return key


def _objects(target):
    """Every object's bytes; the manifest's ``created`` time left out (it differs between any two runs)."""
    store = target.open()
    out = {o.key: bytes(runtime.run_sync(store.get(o.key))) for o in runtime.run_sync(store.list())}
    if "manifest.json" in out:
        out["manifest.json"] = re.sub(rb'"created":"[^"]*"', b"", out["manifest.json"])
    return out


def test_verify_on_dask_reports_what_one_process_does(s3_store, client):
    _saved(s3_store)
    so = s3_store.storage_options
    assert objckpt.verify(s3_store.url, storage_options=so, client=client).ok
    key = _damage(s3_store)
    alone = objckpt.verify(s3_store.url, storage_options=so)
    fanned = objckpt.verify(s3_store.url, storage_options=so, client=client)
    assert not fanned.ok and fanned.problems == alone.problems and key in str(fanned.problems[0])
    assert (fanned.blobs, fanned.pieces, fanned.bytes_read) == (alone.blobs, alone.pieces, alone.bytes_read)


def test_cp_on_dask_writes_what_one_process_does(s3_store, store_target_factory, client):
    src = _saved(s3_store)
    alone, fanned = store_target_factory("s3"), store_target_factory("s3")
    kw = {"src_storage_options": src.storage_options, "server_side": False}
    objckpt.copy(src.url, alone.url, dst_storage_options=alone.storage_options, **kw)
    stats = objckpt.copy(src.url, fanned.url, dst_storage_options=fanned.storage_options, client=client, **kw)
    assert stats.blobs_copied == stats.blobs > 2 and stats.bytes_read >= stats.bytes_total
    assert _objects(fanned) == _objects(alone)
    assert objckpt.verify(fanned.url, storage_options=fanned.storage_options).ok


def test_export_on_dask_writes_what_one_process_does(s3_store, store_target_factory, client):
    src = _saved(s3_store)
    alone, fanned = store_target_factory("s3"), store_target_factory("s3")
    kw = {"src_storage_options": src.storage_options, "max_shard_bytes": 40_000, "subtree": "params"}
    objckpt.export_safetensors(src.url, alone.url, dst_storage_options=alone.storage_options, **kw)
    stats = objckpt.export_safetensors(
        src.url, fanned.url, dst_storage_options=fanned.storage_options, client=client, **kw
    )
    assert len(stats.files) > 3 and stats.files[-1] == "model.safetensors.index.json" and stats.bytes_read > 0
    assert _objects(fanned) == _objects(alone)


def test_convert_on_dask_writes_what_one_process_does(tmp_path, s3_store, store_target_factory, client):
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = {**_tree(), "name": "run-7", "lr": 3e-4}
    ocp.PyTreeCheckpointer().save(tmp_path / "orbax", tree)
    upload_dir(tmp_path / "orbax", s3_store.url, s3_store.storage_options)
    alone, fanned = store_target_factory("s3"), store_target_factory("s3")
    kw = {
        "src_storage_options": s3_store.storage_options,
        "options": objckpt.Options(memory_budget=64 << 10, blob_size=8 << 10),
    }
    want = objckpt.convert_orbax(s3_store.url, alone.url, dst_storage_options=alone.storage_options, **kw)
    got = objckpt.convert_orbax(
        s3_store.url, fanned.url, dst_storage_options=fanned.storage_options, client=client, **kw
    )
    assert got.bytes_read == want.bytes_read > 0 and got.leaves == want.leaves
    objects = _objects(fanned)
    assert len(objects) > 10 and objects == _objects(alone)


def test_a_worker_killed_mid_copy_has_its_task_run_again(s3_store, store_target_factory):
    """Worker processes behind a 60 ms store: one is SIGKILLed while it copies; Dask runs its task
    again elsewhere (same key, same blobs) and the copy equals the one-process run's."""
    src = _saved(s3_store)
    host, port = urllib.parse.urlsplit(s3_store.storage_options["client_kwargs"]["endpoint_url"]).netloc.split(":")
    alone, fanned = store_target_factory("s3"), store_target_factory("s3")
    objckpt.copy(src.url, alone.url, src_storage_options=src.storage_options, dst_storage_options=alone.storage_options)
    with (
        FaultProxy(host, int(port), latency_ms=60) as proxy,
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as lc,
        distributed.Client(lc) as client,
    ):
        slow = {
            **src.storage_options,
            "client_kwargs": {**src.storage_options["client_kwargs"], "endpoint_url": proxy.endpoint_url},
        }
        pids = client.run(os.getpid)
        kw = {
            "src_storage_options": slow,
            "dst_storage_options": fanned.storage_options,
            "options": objckpt.Options(max_concurrency=1),
        }
        copying = concurrent.futures.ThreadPoolExecutor(1).submit(
            objckpt.copy, src.url, fanned.url, client=client, **kw
        )
        deadline = time.monotonic() + 60
        while not any(client.processing().values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # into the task's reads
        busy = next(addr for addr, keys in client.processing().items() if keys)
        os.kill(pids[busy], signal.SIGKILL)
        stats = copying.result(timeout=120)
        assert busy not in client.run(os.getpid) or client.run(os.getpid)[busy] != pids[busy]  # it died
    assert stats.blobs_copied + stats.blobs_skipped == stats.blobs
    assert _objects(fanned) == _objects(alone)


def test_the_command_line_runs_on_a_cluster_and_names_the_extra_when_missing(
    s3_service, s3_store, client, monkeypatch, capsys
):
    from objckpt.cli import main
    from objckpt.transfer.dask_jobs import cluster

    _saved(s3_store)
    for name, value in s3_service.env().items():
        monkeypatch.setenv(name, value)
    scheduler = client.scheduler.address
    assert main(["verify", s3_store.url, "--scheduler", scheduler, "--memory-per-worker", "8MiB", "--json"]) == 0
    assert '"problems": []' in capsys.readouterr().out.replace("\n", "").replace("  ", "")
    monkeypatch.setitem(sys.modules, "distributed", None)  # not installed
    with pytest.raises(objckpt.ObjckptError, match=r"objckpt\[dask\]"), cluster(2, None):
        pass
