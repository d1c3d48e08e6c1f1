"""Throttling, resets, stalls and truncation on the wire (through backends/proxy.py)."""

from __future__ import annotations

import asyncio
import copy
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ProgressWatchdog
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from backends.proxy import FAULT_KINDS, FaultProxy
from objckpt.storage import from_url
from objckpt.transfer import runtime

pytestmark = pytest.mark.slow


@pytest.fixture
def proxied_s3(s3_service):
    """The S3 server behind a fault proxy: (proxy, storage options through it)."""
    host_port = s3_service.endpoint_url.rsplit("//", 1)[1]
    host, port = host_port.split(":")
    with FaultProxy(host, int(port), stall_seconds=20, seed=7) as proxy:
        options = copy.deepcopy(s3_service.storage_options())
        options["client_kwargs"]["endpoint_url"] = proxy.endpoint_url
        yield proxy, options


def _tree(mib: int, seed: int) -> dict:
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    rows = mib * (1 << 20) // 4 // 1024 // 8
    sharding = NamedSharding(mesh, P("x", "y"))
    return {
        "params": {
            f"w{i}": jax.device_put(jax.random.normal(jax.random.key(seed * 10 + i), (rows, 1024)), sharding)
            for i in range(8)
        },
        "step": seed,
    }


def test_proxy_injects_every_kind(proxied_s3, s3_service):
    proxy, options = proxied_s3
    store = from_url(s3_service.url(f"probe-{uuid.uuid4().hex[:8]}"), **options)
    payload = bytes(range(256)) * 4096  # 1 MiB
    runtime.run_sync(store.put("probe", payload))
    for kind in FAULT_KINDS:
        if kind == "stall":
            continue  # covered with a short timeout below
        proxy.set_faults(1.0, (kind,))
        with pytest.raises(OSError):
            runtime.run_sync(store.get_range("probe", start=0, end=len(payload)))
    proxy.set_faults(0.0)
    assert runtime.run_sync(store.get_range("probe", start=0, end=len(payload))) == payload
    assert proxy.stats.faulted >= len(FAULT_KINDS) - 1


@pytest.mark.timeout(0)  # a budget per cycle instead (ProgressWatchdog): slow on a loaded machine is no hang
def test_twenty_cycles_with_five_percent_mixed_faults_are_bit_exact(proxied_s3, s3_service):
    proxy, storage_options = proxied_s3
    options = objckpt.Options(request_timeout=4, blob_size=16 << 20)
    proxy.set_faults(0.05, FAULT_KINDS)
    retries = 0
    with ProgressWatchdog(stall_seconds=120) as watchdog:
        for cycle in range(20):
            retries += _one_faulty_cycle(cycle, storage_options, s3_service, options)
            watchdog.tick(f"cycle {cycle}")
    assert proxy.stats.faulted > 0
    print(f"requests {proxy.stats.requests}, faults {proxy.stats.faults}, engine retries {retries}")


def _one_faulty_cycle(cycle, storage_options, s3_service, options) -> int:
    """Save and restore one tree through the faulty proxy, bit-exact; the retries it took."""
    url = s3_service.url(f"faults/{uuid.uuid4().hex[:8]}")
    tree = _tree(256, cycle)
    handle = objckpt.save_async(url, tree, storage_options=storage_options, options=options)
    handle.result()
    stats = objckpt.TransferStats()
    restored = objckpt.restore(url, tree, storage_options=storage_options, options=options, stats=stats)
    for name, array in tree["params"].items():
        assert np.asarray(restored["params"][name]).tobytes() == np.asarray(array).tobytes(), f"cycle {cycle} {name}"
    assert restored["step"] == cycle
    return handle.stats.retries + stats.retries


def test_all_requests_failing_gives_up_within_the_deadline_and_commits_nothing(proxied_s3, s3_service):
    proxy, storage_options = proxied_s3
    options = objckpt.Options(request_timeout=3, retry=objckpt.RetryConfig(deadline=10, max_backoff=1))
    url = s3_service.url(f"doomed/{uuid.uuid4().hex[:8]}")
    tree = {"w": jnp.ones((256, 256)), "step": 1}
    proxy.set_faults(1.0, ("503", "500", "reset", "truncate"))
    started = time.monotonic()
    with pytest.raises(objckpt.StoreError) as info:
        objckpt.save(url, tree, storage_options=storage_options, options=options)
    assert time.monotonic() - started < 60
    assert "s3://" in str(info.value)
    proxy.set_faults(0.0)
    with pytest.raises(objckpt.CheckpointNotFoundError):
        objckpt.restore(url, storage_options=storage_options)


def test_a_stalled_read_is_abandoned_and_retried(proxied_s3, s3_service):
    proxy, storage_options = proxied_s3
    url = s3_service.url(f"stall/{uuid.uuid4().hex[:8]}")
    tree = {"w": jnp.arange(1 << 20, dtype=jnp.float32)}
    objckpt.save(url, tree, storage_options=storage_options)
    proxy.set_faults(1.0, ("stall",))
    options = objckpt.Options(request_timeout=2)
    stats = objckpt.TransferStats()
    started = time.monotonic()

    def heal():
        time.sleep(3)
        proxy.set_faults(0.0)

    import threading

    threading.Thread(target=heal, daemon=True).start()
    out = objckpt.restore(url, storage_options=storage_options, options=options, stats=stats)
    assert np.asarray(out["w"]).tobytes() == np.asarray(tree["w"]).tobytes()
    assert stats.retries >= 1
    assert time.monotonic() - started < 20  # the 20 s stall was not waited out


def test_a_failed_multipart_upload_is_aborted_and_leaves_nothing(proxied_s3, s3_service):
    """Fail the parts (never the create or the abort): the upload must be aborted, not left behind."""
    import botocore.session

    proxy, storage_options = proxied_s3
    store = from_url(s3_service.url(f"multipart-{uuid.uuid4().hex[:8]}"), **storage_options)
    big = bytes(range(256)) * (80 << 12)  # 80 MiB: above the multipart threshold set here
    if hasattr(store, "multipart_threshold"):
        store.multipart_threshold = 64 << 20  # the default is S3's single-PUT limit, 5 GiB
    if getattr(store, "multipart_threshold", len(big)) >= len(big):
        pytest.skip("this store does not use multipart uploads for 80 MiB")
    proxy.set_faults(1.0, ("503", "reset"), only="partNumber=")
    with pytest.raises(objckpt.StoreError):
        runtime.run_sync(store.put("big.blob", big))
    proxy.set_faults(0.0)
    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=s3_service.endpoint_url,
        aws_access_key_id=s3_service.access_key,
        aws_secret_access_key=s3_service.secret_key,
        region_name="us-east-1",
    )
    uploads = client.list_multipart_uploads(Bucket=s3_service.bucket).get("Uploads", [])
    assert [u["Key"] for u in uploads if "multipart-" in u["Key"]] == []
    assert runtime.run_sync(store.list()) == []


def _engine(storage_options, s3_service, *, max_concurrency: int, request_timeout: float, max_attempts: int):
    """A store through the proxy and, built on the I/O loop that runs it, an engine over it."""
    from objckpt.transfer.engine import TransferEngine

    store = from_url(s3_service.url(f"engine-{uuid.uuid4().hex[:8]}"), **storage_options)
    retry = objckpt.RetryConfig(max_attempts=max_attempts, max_backoff=0.2)

    async def make() -> TransferEngine:
        return TransferEngine(
            store, max_concurrency=max_concurrency, request_timeout=request_timeout, retry=retry, adaptive=False
        )

    return store, runtime.run_sync(make())


def test_a_request_waiting_for_a_slot_is_not_timed_out(proxied_s3, s3_service):
    """Eight PUTs of ~0.6 s each through one slot: the last waits ~4 s behind the others, longer
    than its 2.5 s timeout, which counts only its own time on the wire."""
    proxy, storage_options = proxied_s3
    proxy.latency_ms = 600  # each PUT: 0.3 s up, 0.3 s back, at least
    store, engine = _engine(storage_options, s3_service, max_concurrency=1, request_timeout=2.5, max_attempts=1)

    async def put_all() -> None:
        await asyncio.gather(*(engine.put(f"k{i}", b"x" * 1024) for i in range(8)))

    started = time.monotonic()
    runtime.run_sync(put_all())  # before: "PUT ... timed out after 1 attempts"
    assert time.monotonic() - started > 2.5 * 1.5  # the queue really was longer than one timeout
    assert engine.stats.retries == 0 and engine.stats.requests == 8
    assert sorted(o.key for o in runtime.run_sync(store.list())) == [f"k{i}" for i in range(8)]


def test_a_request_slower_than_its_timeout_but_moving_ends_on_a_retry(proxied_s3, s3_service):
    """A PUT that takes ~3 s every time (as each of 16 PUTs sharing a busy host's link and CPU
    did) against a 2 s timeout: each retry after a timeout gets twice the time, so the second
    or third attempt ends, where the same 2 s each time cut every attempt and failed it; the
    engine's next PUT starts with the time that one needed."""
    proxy, storage_options = proxied_s3
    proxy.latency_ms = 3000  # 1.5 s each way
    store, engine = _engine(storage_options, s3_service, max_concurrency=4, request_timeout=2, max_attempts=3)
    payload = bytes(range(256)) * 64
    runtime.run_sync(engine.put("slow", payload))  # before: "PUT ... timed out after 3 attempts"
    assert 1 <= engine.stats.retries <= 2
    assert 4 <= engine.attempt_timeout <= 8.1  # 4 or 8 s, and the 16 KiB at the first requests' 2 MiB/s
    retries = engine.stats.retries
    runtime.run_sync(engine.put("slow-too", payload))  # starts with the timeout the first one needed
    assert engine.stats.retries == retries
    proxy.latency_ms = 0
    assert runtime.run_sync(store.get("slow")) == payload


def test_a_stalled_request_still_times_out_and_fails_within_its_attempts(proxied_s3, s3_service):
    """Growing timeouts still end: every attempt stalls (20 s), 1 + 2 + 4 s are waited, then the PUT fails."""
    proxy, storage_options = proxied_s3
    store, engine = _engine(storage_options, s3_service, max_concurrency=4, request_timeout=1, max_attempts=3)
    proxy.set_faults(1.0, ("stall",))
    started = time.monotonic()
    with pytest.raises(objckpt.StoreError, match=r"timed out \(the last attempt given 4 s\) after 3 attempts"):
        runtime.run_sync(engine.put("stalled", b"x" * 1024))
    assert 7 <= time.monotonic() - started < 15
