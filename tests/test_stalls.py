"""Transfers that never hang (issue 80 item 2): stalls cut, retried, and named.

A stalling proxy (backends/proxy.py, ``STALL_KINDS``) stands in front of the local S3
(SeaweedFS) and GCS (fake-gcs-server) servers: a server that accepts a request and never
answers (``hang``), one that answers its head and trickles the body (``trickle``), and one
that stops mid-body (``midbody``: an upload read half-way, a response cut half-way). Each
kind on each kind of request (PUT, multipart part, GET, ranged GET; a GCS upload is a POST):
a stall that happens once is cut and retried and the operation ends bit-exact; one that
persists fails within the deadline, the error naming the process, the object (and range)
and what it waited for. The deadlines here are seconds (``FAST``); the defaults' bound is
checked by reading the configuration.
"""

from __future__ import annotations

import copy
import time
import uuid

import numpy as np
import pytest
from multiprocess import run_processes

import objckpt
from backends.proxy import STALL_KINDS, FaultProxy
from objckpt.storage import from_url
from objckpt.transfer import runtime
from objckpt.transfer.engine import TransferEngine

pytestmark = pytest.mark.slow

DEADLINE = 4.0
FAST = objckpt.Options(request_timeout=1, retry=objckpt.RetryConfig(deadline=DEADLINE, max_backoff=0.2))
BOUND = DEADLINE + 4  # the deadline, and a loaded 2-core machine's slack (opening, planning, the first size allowance)
TREE = {"w": np.arange(1 << 18, dtype=np.float32).reshape(512, 512), "b": np.arange(1000, dtype=np.int64)}

#: request kind: (request-line text, Range header) of the requests the proxy stalls: uploads (a
#: save's), a restore's GET of a whole object (its manifest: a first 8 MiB, as much as there is),
#: its ranged GETs of blobs
S3_REQUESTS = {"put": ("PUT ", None), "get": ("manifest.json", None), "ranged_get": (".blob", True)}
GCS_REQUESTS = {
    "upload": ("POST /upload", None),
    "get": ("manifest.json?alt=media", None),
    "ranged_get": (".blob", True),
}


def _proxied(endpoint_url: str) -> FaultProxy:
    host, port = endpoint_url.rsplit("//", 1)[1].split(":")
    return FaultProxy(host, int(port), stall_seconds=60, seed=3)


@pytest.fixture
def s3(s3_service):
    """(proxy, storage options through it, storage options direct, a fresh URL)."""
    with _proxied(s3_service.endpoint_url) as proxy:
        direct = copy.deepcopy(s3_service.storage_options())
        through = copy.deepcopy(direct)
        through["client_kwargs"]["endpoint_url"] = proxy.endpoint_url
        yield _warm(proxy, through, direct, s3_service.url(f"stalls/{uuid.uuid4().hex[:8]}"))


@pytest.fixture
def gcs(gcs_service):
    with _proxied(gcs_service.endpoint_url) as proxy:
        direct = gcs_service.storage_options()
        through = {**direct, "endpoint_url": proxy.endpoint_url}
        yield _warm(proxy, through, direct, gcs_service.url(f"stalls/{uuid.uuid4().hex[:8]}"))


def _warm(proxy: FaultProxy, through: dict, direct: dict, url: str) -> tuple:
    """The environment, once a save through the proxy has loaded what a first one loads (JAX, the
    store's client: seconds that are not the stall's)."""
    objckpt.save(url + "-warm", TREE, storage_options=through)
    return proxy, through, direct, url


def _same(restored: dict) -> None:
    for name, value in TREE.items():
        assert np.asarray(restored[name]).tobytes() == value.tobytes(), name


def _run(env, request: tuple[str, bool | None], kind: str, *, times: int | None) -> tuple[float, BaseException | None]:
    """Save (through the proxy when it stalls uploads, else direct), then restore through it;
    the stall set on ``request`` (``times``: how many). Seconds the stalled operation took, its error."""
    proxy, through, direct, url = env
    only, ranged = request
    uploads = only in ("PUT ", "POST /upload")
    if not uploads:
        objckpt.save(url, TREE, storage_options=direct)
    proxy.set_faults(1.0, (kind,), only=only, ranged=ranged, times=times)
    started = time.monotonic()
    try:
        if uploads:
            objckpt.save(url, TREE, storage_options=through, options=FAST)
        else:
            _same(objckpt.restore(url, storage_options=through, options=FAST))
    except objckpt.StoreError as e:
        return time.monotonic() - started, e
    finally:
        proxy.set_faults(0.0)
    elapsed = time.monotonic() - started
    if uploads:
        _same(objckpt.restore(url, storage_options=direct))
    return elapsed, None


def _check_once(env, request, kind) -> None:
    elapsed, error = _run(env, request, kind, times=1)
    assert error is None, error
    assert env[0].stats.faults == {kind: 1}, env[0].stats.faults  # the stall happened, and was cut
    assert elapsed < BOUND, elapsed


def _check_persistent(env, request, kind) -> str:
    elapsed, error = _run(env, request, kind, times=None)
    assert error is not None, "a persistent stall did not fail the operation"
    text = str(error)
    assert elapsed < BOUND, f"{elapsed:.1f} s: {text}"
    assert "from process 0 timed out" in text and env[3] in text, text  # the process, the object
    waited = ("never answered within", "no response headers in", "body stalled at")
    assert any(w in text for w in waited), text
    return text


@pytest.mark.parametrize("kind", STALL_KINDS)
@pytest.mark.parametrize("request_kind", S3_REQUESTS)
def test_an_s3_stall_once_is_cut_and_retried(s3, request_kind, kind) -> None:
    _check_once(s3, S3_REQUESTS[request_kind], kind)


@pytest.mark.parametrize("kind", STALL_KINDS)
@pytest.mark.parametrize("request_kind", S3_REQUESTS)
def test_an_s3_stall_that_persists_fails_within_the_deadline_naming_it(s3, request_kind, kind) -> None:
    text = _check_persistent(s3, S3_REQUESTS[request_kind], kind)
    if request_kind == "ranged_get":  # a blob's read: the range, and how far the response came
        assert ".blob [" in text, text
        if kind == "hang":
            assert "no response headers in" in text or "never answered within" in text, text
        else:
            assert "body stalled at" in text, text


@pytest.mark.parametrize("kind", STALL_KINDS)
@pytest.mark.parametrize("request_kind", GCS_REQUESTS)
def test_a_gcs_stall_once_is_cut_and_retried(gcs, request_kind, kind) -> None:
    _check_once(gcs, GCS_REQUESTS[request_kind], kind)


@pytest.mark.parametrize("kind", STALL_KINDS)
@pytest.mark.parametrize("request_kind", GCS_REQUESTS)
def test_a_gcs_stall_that_persists_fails_within_the_deadline_naming_it(gcs, request_kind, kind) -> None:
    _check_persistent(gcs, GCS_REQUESTS[request_kind], kind)


@pytest.mark.parametrize("kind", STALL_KINDS)
def test_a_stalled_multipart_part_is_cut_at_twice_the_measured_time_and_retried(s3, kind) -> None:
    """An 11 MiB multipart upload (3 parts): one upload measures the throughput, then one part
    stalls: the upload is cut at twice its measured time (at least the 1 s floor), long before
    the 2 MiB/s first-request allowance (6.5 s), and sent again; then every part stalls and
    the PUT fails within the deadline, naming process and object."""
    proxy, through, direct, url = s3
    store = from_url(url, **through)
    store.multipart_threshold = 5 << 20  # type: ignore[attr-defined]  # obstore's S3 store
    payload = np.random.default_rng(5).integers(0, 256, 11 << 20, dtype=np.uint8).tobytes()

    async def engine() -> TransferEngine:
        return TransferEngine.from_options(store, FAST)

    try:
        eng = runtime.run_sync(engine())
        runtime.run_sync(eng.put("big", payload))
        assert eng.timeout_for(len(payload)) < 6.5 / 2, eng.timeout_for(len(payload))
        proxy.set_faults(1.0, (kind,), only="partNumber=", times=1)
        started = time.monotonic()
        runtime.run_sync(eng.put("big", payload))
        assert proxy.stats.faults == {kind: 1} and time.monotonic() - started < BOUND
        assert runtime.run_sync(from_url(url, **direct).get("big")) == payload
        proxy.set_faults(1.0, (kind,), only="partNumber=")
        started = time.monotonic()
        with pytest.raises(objckpt.StoreError) as caught:
            runtime.run_sync(eng.put("big", payload))
        assert time.monotonic() - started < BOUND
        assert f"PUT {url}/big from process 0 timed out" in str(caught.value), caught.value
    finally:
        proxy.set_faults(0.0)
        runtime.run_sync(store.close())


def test_a_copy_and_a_verify_end_within_the_deadline_on_a_stalled_store(s3) -> None:
    """Every blob read stalls: the copy fails and the verify reports each blob unreadable, both
    within the deadline, naming process and object."""
    proxy, through, direct, url = s3
    objckpt.save(url, TREE, storage_options=direct)
    proxy.set_faults(1.0, ("hang",), only=".blob", ranged=True)
    started = time.monotonic()
    report = objckpt.verify(url, storage_options=through, options=FAST)
    assert time.monotonic() - started < BOUND
    assert report.problems and all(p.kind == "unreadable" for p in report.problems), report.problems
    assert all("from process 0 timed out" in p.message and url in p.message for p in report.problems)
    started = time.monotonic()
    with pytest.raises(objckpt.StoreError) as caught:
        objckpt.copy(url, url + "-copy", src_storage_options=through, dst_storage_options=direct, options=FAST)
    assert time.monotonic() - started < BOUND
    assert "from process 0 timed out" in str(caught.value) and url in str(caught.value), caught.value


def test_by_default_an_operation_on_a_stalled_store_fails_within_60_s() -> None:
    """Read from the configuration, not waited for: every request's attempts end within the
    deadline, and a first attempt leaves room for a retry."""
    options = objckpt.Options()
    assert options.retry.deadline <= 60
    assert options.request_timeout <= options.retry.deadline / 4


@pytest.mark.parametrize("stalled", [".blob", None], ids=["blob_puts", "every_request"])
def test_a_stalled_process_is_named_by_the_other_not_a_barrier_timeout(s3_service, stalled) -> None:
    """Two processes save; process 1's store stalls its blob uploads, or every request from the
    first (the check for a committed checkpoint, before any commit): both fail within the
    deadline, process 0 naming process 1 (its commit report carries the error), long before
    the barrier timeout (300 s by default, 120 s here)."""
    with _proxied(s3_service.endpoint_url) as proxy:
        direct = copy.deepcopy(s3_service.storage_options())
        through = copy.deepcopy(direct)
        through["client_kwargs"]["endpoint_url"] = proxy.endpoint_url
        proxy.set_faults(1.0, ("hang",), only=stalled)
        job = {
            "kind": "save",
            "report_errors": True,
            "url": s3_service.url(f"stalls/mp-{uuid.uuid4().hex[:8]}"),
            "mesh": [2, 4],
            "axes": ["data", "model"],
            "storage_options": direct,
            "storage_options_of": {"1": through},
            "options": {"request_timeout": 1, "barrier_timeout": 120, "retry": {"deadline": DEADLINE}},
        }
        results = run_processes(2, job, timeout=150)
    assert all(r is not None and r.get("error") for r in results), results
    assert all(r["seconds"] < 30 for r in results), results  # type: ignore[index]
    mine, other = results[1]["error"], results[0]["error"]  # type: ignore[index]
    assert "from process 1 timed out" in mine, mine
    assert "process 1" in other and "barrier" not in other.lower(), other


def test_a_restore_whose_one_process_stalls_ends_within_the_deadline_on_both(s3_service) -> None:
    """Two processes restore; process 1's blob reads stall: it fails within the deadline naming
    itself and the blob, and process 0 is not held (it ends, or fails naming process 1)."""
    url = s3_service.url(f"stalls/mp-restore-{uuid.uuid4().hex[:8]}")
    job = {"kind": "save", "url": url, "mesh": [2, 4], "axes": ["data", "model"]}
    job["storage_options"] = s3_service.storage_options()
    assert all(r is not None for r in run_processes(2, job, timeout=150))
    with _proxied(s3_service.endpoint_url) as proxy:
        through = copy.deepcopy(s3_service.storage_options())
        through["client_kwargs"]["endpoint_url"] = proxy.endpoint_url
        proxy.set_faults(1.0, ("hang",), only=".blob")
        options = {"request_timeout": 1, "barrier_timeout": 120, "retry": {"deadline": DEADLINE}}
        restore = {**job, "kind": "restore", "report_errors": True, "storage_options_of": {"1": through}}
        results = run_processes(2, {**restore, "options": options}, timeout=150)
    assert all(r is not None for r in results), results
    print(results)
    mine, other = results[1], results[0]  # type: ignore[index]
    assert "from process 1 timed out" in mine.get("error", "") and ".blob [" in mine["error"], mine
    assert mine["seconds"] < 30, mine
    assert not other.get("error") or ("process 1" in other["error"] and other["seconds"] < 30), other
