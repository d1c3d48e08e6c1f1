"""Errors that retries cannot fix: said at once, naming the URL and the cause (issue 51, items 18 and 20).

Against the real local servers (SeaweedFS for S3, fake-gcs-server for GCS), in a
clean cloud environment (``cloud_env``: no credentials, no profile files, metadata
services on a closed port unless a test points them at its own stand-in):

* no credentials with a custom endpoint, with an instance metadata stand-in that
  answers 403 (as a metadata address does where instance credentials are off) and
  with none: a :class:`StorePermissionError` listing the sources tried;
* a bucket that does not exist (S3 ``NoSuchBucket``, a GCS 404): :class:`BucketNotFoundError`;
* a wrong secret or access key: :class:`StorePermissionError` with the service's code;

each through the Python API (save, restore, the manager's listing) and ``objckpt ls``
(exit status 1), within seconds and with one request per call (no retries). Item 20:
the CA of an HTTPS S3 front given only through ``REQUESTS_CA_BUNDLE`` is trusted on
the obstore path as botocore trusts it on the s3fs path.
"""

from __future__ import annotations

import http.server
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import objckpt
from backends import GCSService, S3Service, TestCA, TlsFront
from objckpt.cli import main as cli_main
from objckpt.errors import BucketNotFoundError, StoreError, StorePermissionError, TransientStoreError
from objckpt.storage.auth import credentials
from objckpt.storage.errors import map_obstore_error
from objckpt.transfer import retries

#: What a user must never have to read: obstore's request internals and debug dump, raw XML.
INTERNALS = ("Debug source", "RetryError", "Error performing", "<?xml", "<Error>", "Generic S3 error")
#: Generous bound for "at once" (the aim is < 2 s; retries took 12-34 s).
AT_ONCE_S = 5.0
TREE = {"w": np.arange(8, dtype=np.float32)}
#: Retries that would show within the bound if the error were still taken for transient.
FAST_RETRY = objckpt.Options(retry=objckpt.RetryConfig(max_attempts=10, initial_backoff=0.05, max_backoff=0.2))


# ------------------------------------------------------------------ helpers


class _CountingStore:
    """Counts the calls objckpt makes on a store it opened (each retry is one more call)."""

    VERBS = ("head", "get", "get_range", "get_range_buffer", "get_range_streamed", "list", "put", "put_parts")

    def __init__(self, inner: Any, calls: Counter[str]) -> None:
        self._inner = inner
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name in self.VERBS:
            calls = self._calls

            async def counted(*args: Any, **kwargs: Any) -> Any:
                calls[name] += 1
                return await value(*args, **kwargs)

            return counted
        return value

    def child(self, subpath: str) -> _CountingStore:
        return _CountingStore(self._inner.child(subpath), self._calls)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every store objckpt opens counts its calls here."""
    counted: Counter[str] = Counter()
    opened = retries.from_url
    monkeypatch.setattr(retries, "from_url", lambda url, **options: _CountingStore(opened(url, **options), counted))
    return counted


class _Metadata(http.server.BaseHTTPRequestHandler):
    """An instance metadata stand-in that refuses everything with 403, counting requests."""

    requests: list[str]

    def _refuse(self) -> None:
        self.requests.append(f"{self.command} {self.path}")
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = _refuse  # noqa: N815

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def refusing_metadata(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[str]]]:
    """``(endpoint, requests)`` of an instance metadata stand-in answering 403."""
    requests: list[str] = []
    handler = type("Handler", (_Metadata,), {"requests": requests})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(credentials, "_ANSWERED", set())
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        thread.join(5)


def _timed(fn: Callable[[], Any]) -> tuple[BaseException | None, float]:
    started = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


def _steps(url: str, options: dict[str, Any]) -> None:
    manager = objckpt.CheckpointManager(url, storage_options=options, options=FAST_RETRY)
    try:
        manager.steps()
    finally:
        manager.close()


def _api_calls(url: str, options: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    return {
        "save": lambda: objckpt.save(url, TREE, storage_options=options, options=FAST_RETRY),
        "restore": lambda: objckpt.restore(url, storage_options=options, options=FAST_RETRY),
        "steps": lambda: _steps(url, options),
    }


def _ls(url: str, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str, float]:
    """``objckpt ls URL`` in this process: exit status, what it wrote to stderr, seconds."""
    capsys.readouterr()
    started = time.monotonic()
    status = cli_main(["ls", url, *flags])
    seconds = time.monotonic() - started
    return status, capsys.readouterr().err, seconds


def _assert_clean(message: str) -> None:
    for mark in INTERNALS:
        assert mark not in message, message


# ------------------------------------------------------------ no credentials


@pytest.mark.parametrize("endpoint_option", ["client_kwargs", "endpoint_url"])
def test_no_credentials_with_a_custom_endpoint(
    s3_service: S3Service,
    cloud_env: Callable[..., dict[str, str]],
    refusing_metadata: tuple[str, list[str]],
    capsys: pytest.CaptureFixture[str],
    endpoint_option: str,
) -> None:
    """The MinIO/R2/Ceph case with a metadata address answering 403, then with none: every
    call fails at once with the sources tried, the metadata service asked once per store
    (no retries of its 403)."""
    metadata, requests = refusing_metadata
    cloud_env(AWS_EC2_METADATA_SERVICE_ENDPOINT=metadata)
    endpoint = s3_service.endpoint_url
    options: dict[str, Any] = (
        {"client_kwargs": {"endpoint_url": endpoint}}
        if endpoint_option == "client_kwargs"
        else {"endpoint_url": endpoint}
    )
    url = s3_service.url(f"no-credentials-{uuid.uuid4().hex[:8]}")
    for name, call in _api_calls(url, options).items():
        before = len(requests)
        error, seconds = _timed(call)
        assert isinstance(error, StorePermissionError), (name, error)
        message = str(error)
        assert f"no credentials found for {url}" in message, message
        assert f"instance metadata at {metadata} (the token request was refused: HTTP 403)" in message
        assert "environment variables" in message and "web identity" in message
        _assert_clean(message)
        assert seconds < AT_ONCE_S, (name, seconds)
        assert len(requests) - before == 1, (name, requests)  # one token request, not 10 attempts

    status, err, seconds = _ls(url, capsys, "--endpoint-url", endpoint)
    assert status == 1 and f"no credentials found for {url}" in err and "HTTP 403" in err, err
    assert seconds < AT_ONCE_S

    # No metadata service at all (nothing listens): the same, saying so.
    cloud_env(AWS_EC2_METADATA_SERVICE_ENDPOINT="http://127.0.0.1:9")
    for name, call in _api_calls(url, options).items():
        error, seconds = _timed(call)
        assert isinstance(error, StorePermissionError), (name, error)
        assert f"no credentials found for {url}" in str(error)
        assert "instance metadata at http://127.0.0.1:9 (no answer within 1 s)" in str(error)
        assert seconds < AT_ONCE_S, (name, seconds)
    status, err, seconds = _ls(url, capsys, "--endpoint-url", endpoint)
    assert status == 1 and f"no credentials found for {url}" in err, err
    assert seconds < AT_ONCE_S


def test_a_metadata_refusal_met_by_obstore_itself_is_not_retried(
    s3_service: S3Service,
    cloud_env: Callable[..., dict[str, str]],
    refusing_metadata: tuple[str, list[str]],
    calls: Counter[str],
) -> None:
    """Should the 403 come after the pre-flight check (obstore asks the service itself), it is
    a permission error, said as such, after one request."""
    metadata, requests = refusing_metadata
    cloud_env()
    from objckpt.storage.obstore.config import NativeSpec
    from objckpt.storage.obstore.store import open_spec

    config = {"region": s3_service.region, "endpoint": s3_service.endpoint_url, "metadata_endpoint": metadata}
    config["virtual_hosted_style_request"] = False
    spec = NativeSpec("s3", s3_service.bucket, "imds", s3_service.endpoint_url, config)
    store = retries.RetryingStore(
        open_spec(spec, s3_service.url("imds")), retry=FAST_RETRY.retry, request_timeout=FAST_RETRY.request_timeout
    )
    from objckpt.transfer import runtime

    error, seconds = _timed(lambda: runtime.run_sync(store.list("step_")))
    assert isinstance(error, StorePermissionError), error
    message = str(error)
    assert "no credentials: the credential service refused PUT" in message and "HTTP 403" in message, message
    assert s3_service.url("imds") in message
    _assert_clean(message.replace("refused PUT", ""))
    assert requests == ["PUT /latest/api/token"], requests
    assert seconds < AT_ONCE_S


# ------------------------------------------------------------- missing bucket


@pytest.mark.parametrize("backend", ["obstore", "fsspec"])
def test_s3_bucket_that_does_not_exist(
    s3_service: S3Service, capsys: pytest.CaptureFixture[str], calls: Counter[str], backend: str
) -> None:
    """Read-only calls (SeaweedFS creates a bucket on the first write, as real S3 does not):
    NoSuchBucket is a BucketNotFoundError after one request, never "no checkpoints"."""
    bucket = f"objckpt-missing-{uuid.uuid4().hex[:8]}"
    url = f"s3://{bucket}/run"
    options = {**s3_service.storage_options(), "objckpt_backend": backend}
    for name in ("restore", "steps"):
        calls.clear()
        error, seconds = _timed(_api_calls(url, options)[name])
        assert isinstance(error, BucketNotFoundError) and isinstance(error, FileNotFoundError), (name, error)
        assert not isinstance(error, objckpt.CheckpointNotFoundError)
        message = str(error)
        assert url in message and f"the bucket {bucket!r} does not exist" in message and "NoSuchBucket" in message
        _assert_clean(message)
        assert seconds < AT_ONCE_S, (name, seconds)
        assert sum(calls.values()) == 1, (name, calls)  # the manifest GET, or the listing: no retry

    status, err, seconds = _ls(
        url, capsys, "--endpoint-url", s3_service.endpoint_url, "--region", s3_service.region, "-o",
        f'key="{s3_service.access_key}"', "-o", f'secret="{s3_service.secret_key}"', "-o", f"objckpt_backend={backend}",
    )  # fmt: skip
    assert status == 1, err
    assert f"s3://{bucket}" in err and "does not exist" in err and "NoSuchBucket" in err, err
    _assert_clean(err)
    assert seconds < AT_ONCE_S


def test_gcs_bucket_that_does_not_exist(
    gcs_service: GCSService, capsys: pytest.CaptureFixture[str], calls: Counter[str]
) -> None:
    """gcsfs says "not found" alike for a missing bucket and an empty prefix: the bucket is
    asked for once, and a 404 there is a BucketNotFoundError; ``objckpt ls`` exits 1."""
    bucket = f"objckpt-missing-{uuid.uuid4().hex[:8]}"
    url = f"gs://{bucket}/run"
    options = gcs_service.storage_options()
    for name, call in _api_calls(url, options).items():
        calls.clear()
        error, seconds = _timed(call)
        assert isinstance(error, BucketNotFoundError), (name, error)
        assert f"gs://{bucket}" in str(error) and "does not exist" in str(error), str(error)
        assert seconds < AT_ONCE_S, (name, seconds)
        assert calls["list"] + calls["get_range"] + calls["get"] <= 1, (name, calls)
    status, err, seconds = _ls(url, capsys, "--endpoint-url", gcs_service.endpoint_url, "--anon")
    assert status == 1, err
    assert f"gs://{bucket}" in err and "does not exist" in err, err
    assert seconds < AT_ONCE_S
    # An empty prefix of a bucket that exists is still no error.
    status, _, _ = _ls(gcs_service.url(f"empty-{uuid.uuid4().hex[:8]}"), capsys, "--endpoint-url",
                       gcs_service.endpoint_url, "--anon")  # fmt: skip
    assert status == 0


# ------------------------------------------------------------ wrong secret


@pytest.mark.parametrize("backend", ["obstore", "fsspec"])
@pytest.mark.parametrize(
    ("change", "code"),
    [({"secret": "wrong-secret-Zq9"}, "SignatureDoesNotMatch"), ({"key": "AKIAWRONG"}, "InvalidAccessKeyId")],
)
def test_wrong_secret_or_key_is_refused_at_once(
    s3_service: S3Service,
    capsys: pytest.CaptureFixture[str],
    calls: Counter[str],
    change: dict[str, str],
    code: str,
    backend: str,
) -> None:
    url = s3_service.url(f"refused-{uuid.uuid4().hex[:8]}")
    objckpt.save(url, TREE, storage_options=s3_service.storage_options())
    options = {**s3_service.storage_options(), **change, "objckpt_backend": backend}
    for name, call in _api_calls(url, options).items():
        calls.clear()
        error, seconds = _timed(call)
        assert isinstance(error, StorePermissionError), (name, error)
        message = str(error)
        assert url in message and "access denied (HTTP 403" in message, message
        if name != "save":  # a HEAD's 403 has no body
            assert code in message, message
        _assert_clean(message)
        assert "wrong-secret-Zq9" not in message
        assert seconds < AT_ONCE_S, (name, seconds)
        assert sum(calls.values()) == 1, (name, calls)

    flags = ["-o", f'key="{change.get("key", s3_service.access_key)}"']
    flags += ["-o", f'secret="{change.get("secret", s3_service.secret_key)}"', "-o", f"objckpt_backend={backend}"]
    status, err, seconds = _ls(url, capsys, "--endpoint-url", s3_service.endpoint_url, *flags)
    assert status == 1 and code in err and url in err, err
    _assert_clean(err)
    assert seconds < AT_ONCE_S


def test_obstore_refusals_are_mapped_by_status_and_service_code() -> None:
    """What the live tests meet, as obstore words it; a refusal that fresh credentials cure still retries."""
    import obstore.exceptions as oe

    def generic(status: int, code: str, uri: str = "http://h:1/b?list-type=2") -> Exception:
        body = f'<?xml version="1.0"?>\n<Error><Code>{code}</Code><Message>m</Message></Error>' if code else ""
        return oe.GenericError(
            f"Generic S3 error: Error performing list request: Error performing GET {uri} in 1ms - Server returned "
            f"non-2xx status code: {status} X: {body}\n\nDebug source:\nGeneric {{ inner: Status {{ status: {status}, "
        )

    what = "list s3://b/run"
    assert isinstance(map_obstore_error(generic(404, "NoSuchBucket"), what), BucketNotFoundError)
    for code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        mapped = map_obstore_error(generic(403, code), what)
        assert isinstance(mapped, StorePermissionError) and code in str(mapped), mapped
    imds = map_obstore_error(generic(403, "", "http://169.254.169.254/latest/api/token"), what)
    assert isinstance(imds, StorePermissionError) and "no credentials" in str(imds), imds
    assert isinstance(map_obstore_error(generic(403, "ExpiredToken"), what), TransientStoreError)
    assert isinstance(map_obstore_error(generic(503, "SlowDown"), what), TransientStoreError)
    assert type(map_obstore_error(oe.InvalidPathError("x"), what)) is StoreError


# ------------------------------------------------------- REQUESTS_CA_BUNDLE (item 20)


def test_requests_ca_bundle_is_trusted_on_the_obstore_path(
    s3_service: S3Service,
    s3_tls: TlsFront,
    test_ca: TestCA,
    cloud_env: Callable[..., dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Save and restore over HTTPS with the test CA given only in ``REQUESTS_CA_BUNDLE``, as
    botocore (the s3fs path) reads it when ``AWS_CA_BUNDLE`` is unset."""
    cloud_env()
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(test_ca.ca_file))
    values = np.arange(64 * 1024, dtype=np.float32)
    for client in ("obstore", "fsspec"):
        options = {
            **s3_service.storage_options(),
            "client_kwargs": {"endpoint_url": s3_tls.endpoint_url, "region_name": s3_service.region},
            "objckpt_backend": client,
        }
        url = s3_service.url(f"requests-ca-{client}-{uuid.uuid4().hex[:8]}")
        before = s3_tls.stats.connections
        objckpt.save(url, {"w": values}, storage_options=options)
        out = objckpt.restore(url, storage_options=options)
        assert np.asarray(out["w"]).tobytes() == values.tobytes()
        assert s3_tls.stats.connections > before  # it went over HTTPS, through the front


def test_a_metadata_service_without_an_instance_role_is_no_source(
    cloud_env: Callable[..., dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token but no role (an instance without an instance profile): no credentials, said at once,
    where obstore would have retried the role request's 404."""
    requests: list[str] = []

    class NoRole(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            requests.append(f"{self.command} {self.path}")
            body = b"a-token" if self.command == "PUT" else b""
            self.send_response(200 if self.command == "PUT" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = _answer  # noqa: N815

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoRole)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(credentials, "_ANSWERED", set())
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        environ = cloud_env(AWS_EC2_METADATA_SERVICE_ENDPOINT=endpoint)
        with pytest.raises(StorePermissionError) as info:
            credentials.resolve_s3_source("s3://bucket/run", {}, environ)
    finally:
        server.shutdown()
    assert "no credentials found for s3://bucket/run" in str(info.value)
    assert f"instance metadata at {endpoint} (no instance role: HTTP 404" in str(info.value)
    assert requests == ["PUT /latest/api/token", "GET /latest/meta-data/iam/security-credentials/"]
