"""The cloud-path test servers: HTTPS with a test CA, a CONNECT proxy, emulated credential services.

Each test drives a real client (botocore, obstore, requests, google-auth)
through the server under test, so a break in the server shows as a client
failure, the way it would break objckpt's own tests built on them.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from backends import S3Service, start_s3
from backends.connect_proxy import ConnectProxy
from backends.identity import CredentialServer, make_aws_keys
from backends.proxy import FaultProxy
from backends.tls import TestCA, TlsFront

_BIG = os.urandom(32 << 20)
# google-auth warns that load_credentials_from_file does not validate the file: these files are ours.
pytestmark = pytest.mark.filterwarnings("ignore:The load_credentials_from_file method is deprecated:DeprecationWarning")
_GCS_SCOPES = ["https://www.googleapis.com/auth/devstorage.read_write"]


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
    return host, int(port)


def _s3_client(
    endpoint_url: str,
    key: str,
    secret: str,
    *,
    verify: bool | str | None = None,
    token: str | None = None,
    **config: Any,
) -> Any:
    """A botocore S3 client with explicit keys (``config``: more ``botocore.config.Config`` options)."""
    import botocore.session
    from botocore.config import Config

    return botocore.session.Session().create_client(
        "s3",
        endpoint_url=endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        aws_session_token=token,
        verify=verify,
        config=Config(
            s3={"addressing_style": "path"},
            connect_timeout=10,
            read_timeout=30,
            retries={"total_max_attempts": 1},
            **config,
        ),
    )


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA.create(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def rotating_keys() -> list[tuple[str, str]]:
    return make_aws_keys(3)


@pytest.fixture(scope="module")
def s3_rotating(rotating_keys: list[tuple[str, str]]) -> Iterator[S3Service]:
    """SeaweedFS that also accepts ``rotating_keys`` (its identities are fixed at start)."""
    service = start_s3(extra_credentials=rotating_keys)
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[dict[str, str]], None]:
    """No AWS_* or Google variables and an empty HOME; ``apply(env)`` sets the given ones."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "GOOGLE_", "GCE_", "CLOUDSDK_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    def apply(env: dict[str, str]) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return apply


# ---------------------------------------------------------------- HTTPS


def test_tls_front_serves_seaweedfs_to_clients_that_trust_the_ca(s3_service: S3Service, ca: TestCA) -> None:
    with TlsFront(*_host_port(s3_service.endpoint_url), ca) as front:
        assert front.endpoint_url == f"https://127.0.0.1:{front.port}"
        client = _s3_client(front.endpoint_url, s3_service.access_key, s3_service.secret_key, verify=str(ca.ca_file))
        client.put_object(Bucket=s3_service.bucket, Key="tls/big", Body=_BIG)
        got = client.get_object(Bucket=s3_service.bucket, Key="tls/big")["Body"].read()
        assert hashlib.sha256(got).digest() == hashlib.sha256(_BIG).digest()
        assert (
            client.get_object(Bucket=s3_service.bucket, Key="tls/big", Range="bytes=5-9")["Body"].read() == _BIG[5:10]
        )
        assert front.stats.connections >= 1

        untrusting = _s3_client(front.endpoint_url, s3_service.access_key, s3_service.secret_key, verify=True)
        import botocore.exceptions

        with pytest.raises(botocore.exceptions.SSLError):
            untrusting.head_object(Bucket=s3_service.bucket, Key="tls/big")
        with socket.create_connection(("127.0.0.1", front.port), timeout=10) as raw:
            with pytest.raises(ssl.SSLCertVerificationError):
                ssl.create_default_context().wrap_socket(raw, server_hostname="127.0.0.1")


def test_obstore_trusts_the_ca_through_ssl_cert_file(
    s3_service: S3Service, ca: TestCA, monkeypatch: pytest.MonkeyPatch
) -> None:
    from obstore.store import S3Store

    monkeypatch.setenv("SSL_CERT_FILE", str(ca.ca_file))  # read when the client is built
    with TlsFront(*_host_port(s3_service.endpoint_url), ca) as front:
        store = S3Store(
            s3_service.bucket,
            endpoint=front.endpoint_url,
            access_key_id=s3_service.access_key,
            secret_access_key=s3_service.secret_key,
            region=s3_service.region,
            virtual_hosted_style_request=False,
        )
        store.put("tls/obstore", _BIG)
        assert hashlib.sha256(bytes(store.get("tls/obstore").bytes())).digest() == hashlib.sha256(_BIG).digest()
        assert front.stats.connections >= 1


def test_fault_proxy_serves_tls_and_still_injects_faults(s3_service: S3Service, ca: TestCA) -> None:
    import botocore.exceptions

    with FaultProxy(*_host_port(s3_service.endpoint_url), tls=ca) as proxy:
        assert proxy.endpoint_url.startswith("https://127.0.0.1:")
        client = _s3_client(proxy.endpoint_url, s3_service.access_key, s3_service.secret_key, verify=str(ca.ca_file))
        client.put_object(Bucket=s3_service.bucket, Key="tls/fault", Body=b"x" * 100_000)
        assert client.get_object(Bucket=s3_service.bucket, Key="tls/fault")["Body"].read() == b"x" * 100_000
        proxy.set_faults(1.0, ("503",))
        with pytest.raises(botocore.exceptions.ClientError, match="SlowDown"):
            client.get_object(Bucket=s3_service.bucket, Key="tls/fault")
        proxy.set_faults(1.0, ("truncate",))
        with pytest.raises((botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)):
            client.get_object(Bucket=s3_service.bucket, Key="tls/fault")["Body"].read()
        assert proxy.stats.faults == {"503": 1, "truncate": 1}


def test_launcher_serves_https_with_tls(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    import requests

    repo = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-m", "backends.launcher", "--no-s3", "--tls", "--data-dir", str(tmp_path)]
    proc = subprocess.Popen(argv, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        url = out["gcs"]["tls_endpoint_url"]
        assert url.startswith("https://127.0.0.1:") and out["ca_env"]["AWS_CA_BUNDLE"] == out["ca_file"]
        answer = requests.get(f"{url}/storage/v1/b", verify=out["ca_file"], timeout=10)
        assert answer.status_code == 200 and answer.json()["items"][0]["name"] == "objckpt-test"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


# ---------------------------------------------------------------- CONNECT proxy


def test_connect_proxy_tunnels_https_clients(s3_service: S3Service, ca: TestCA) -> None:
    import requests

    with TlsFront(*_host_port(s3_service.endpoint_url), ca) as front, ConnectProxy() as proxy:
        target = f"127.0.0.1:{front.port}"
        client = _s3_client(
            front.endpoint_url,
            s3_service.access_key,
            s3_service.secret_key,
            verify=str(ca.ca_file),
            proxies={"https": proxy.url},
        )
        client.put_object(Bucket=s3_service.bucket, Key="proxied/k", Body=b"through the tunnel")
        assert client.get_object(Bucket=s3_service.bucket, Key="proxied/k")["Body"].read() == b"through the tunnel"
        assert proxy.stats.tunnels[target] >= 1
        tunnels = proxy.stats.tunnels[target]

        answer = requests.get(
            front.endpoint_url + "/", proxies={"https": proxy.url}, verify=str(ca.ca_file), timeout=10
        )
        assert answer.status_code == 403 and b"AccessDenied" in answer.content  # SeaweedFS, unsigned
        assert proxy.stats.tunnels[target] == tunnels + 1

        plain = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        plain.request("GET", f"http://{target}/")
        response = plain.getresponse()
        assert response.status == 405 and response.getheader("Allow") == "CONNECT" and response.read()
        plain.close()


def test_connect_proxy_asks_for_credentials(ca: TestCA, s3_service: S3Service) -> None:
    import requests

    with TlsFront(*_host_port(s3_service.endpoint_url), ca) as front:
        with ConnectProxy(require_auth=("user", "pass word")) as proxy:
            assert "pass word" not in repr(proxy)
            with pytest.raises(requests.exceptions.ProxyError, match="407"):
                requests.get(front.endpoint_url, proxies={"https": proxy.url}, verify=str(ca.ca_file), timeout=10)
            authed = proxy.url.replace("http://", "http://user:pass%20word@")
            answer = requests.get(front.endpoint_url, proxies={"https": authed}, verify=str(ca.ca_file), timeout=10)
            assert answer.status_code == 403  # SeaweedFS's answer: the tunnel held
            assert sum(proxy.stats.tunnels.values()) == 1 and proxy.stats.refused == 1


# ---------------------------------------------------------------- AWS credential chains


_METHODS = {  # source: (botocore's name for the provider, the server's name for the fetch)
    "imds": ("iam-role", "imds"),
    "ecs": ("container-role", "ecs"),
    "web_identity": ("assume-role-with-web-identity", "sts-web-identity"),
    "profile": ("assume-role", "sts-assume-role"),
}


def _chain_env(server: CredentialServer, source: str, tmp_path: Path) -> dict[str, str]:
    if source == "imds":
        return server.imds_env()
    if source == "ecs":
        return server.ecs_env()
    if source == "web_identity":
        return server.web_identity_env(tmp_path / "web-identity-token")
    return server.write_aws_profile(tmp_path / "aws", "objckpt", source_key="OBJCKPTSOURCE0000000", source_secret="s")


@pytest.mark.parametrize("source", list(_METHODS))
def test_botocore_default_chain_resolves_served_keys_and_rotates(
    source: str,
    clean_env: Callable[[dict[str, str]], None],
    tmp_path: Path,
    s3_rotating: S3Service,
    rotating_keys: list[tuple[str, str]],
) -> None:
    import botocore.session

    lifetime = 1.5
    with CredentialServer(aws_keys=rotating_keys, lifetime_s=lifetime, container_auth_token="ecs-secret") as server:
        clean_env(_chain_env(server, source, tmp_path))
        session = botocore.session.Session()
        credentials = session.get_credentials()
        method, fetch = _METHODS[source]
        assert credentials is not None and credentials.method == method
        first = credentials.get_frozen_credentials()
        assert server.issued[-1] == (fetch, first.access_key) and first.token == ""

        client = _s3_client(s3_rotating.endpoint_url, first.access_key, first.secret_key)
        client.put_object(Bucket=s3_rotating.bucket, Key=f"chain/{source}", Body=b"signed with served keys")

        # A third into the next generation: both fetches below see the same, unexpired keys
        # (at a boundary, keys fetched just before it lapse before botocore looks at them).
        time.sleep(server.seconds_to_rotation() + lifetime / 3)
        if source == "imds":
            # botocore stretches a short IMDS expiry by 12-20 min (static stability), so the
            # same credentials object may not refresh yet: a new session resolves afresh.
            credentials = botocore.session.Session().get_credentials()
        second = credentials.get_frozen_credentials()
        assert second.access_key != first.access_key
        assert second.access_key == server.current_aws_key() and first.access_key in server.expired_access_keys()
        rotated = _s3_client(s3_rotating.endpoint_url, second.access_key, second.secret_key)
        assert rotated.get_object(Bucket=s3_rotating.bucket, Key=f"chain/{source}")["Body"].read()


def test_credential_services_refuse_bad_callers(clean_env: Callable[[dict[str, str]], None], tmp_path: Path) -> None:
    import urllib.error
    import urllib.request

    keys = make_aws_keys(1)
    with CredentialServer(aws_keys=keys, container_auth_token="right") as server:
        role = urllib.request.Request(f"{server.url}/latest/meta-data/iam/security-credentials/")
        with pytest.raises(urllib.error.HTTPError, match="401"):  # IMDSv1: no session token
            urllib.request.urlopen(role, timeout=10)
        wrong = urllib.request.Request(f"{server.url}/ecs/credentials", headers={"Authorization": "wrong"})
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(wrong, timeout=10)
        flavorless = urllib.request.Request(f"{server.url}/computeMetadata/v1/project/project-id")
        with pytest.raises(urllib.error.HTTPError, match="403"):
            urllib.request.urlopen(flavorless, timeout=10)

        import botocore.exceptions
        import botocore.session

        env = server.web_identity_env(tmp_path / "token")
        (tmp_path / "token").write_text("not the token")
        clean_env(env)
        with pytest.raises(botocore.exceptions.ClientError, match="AccessDenied"):
            botocore.session.Session().get_credentials().get_frozen_credentials()
        assert server.issued == []
        assert keys[0][1] not in repr(server)


# ---------------------------------------------------------------- Google credentials


@pytest.fixture
def google_request() -> Any:
    import google.auth.transport.requests

    return google.auth.transport.requests.Request()


def test_google_default_finds_the_gce_metadata_server(
    clean_env: Callable[[dict[str, str]], None], monkeypatch: pytest.MonkeyPatch, google_request: Any
) -> None:
    import google.auth
    import google.auth.compute_engine
    from google.auth.compute_engine import _metadata

    with CredentialServer(lifetime_s=3600) as server:
        clean_env(server.gce_env())
        monkeypatch.setattr(_metadata, "_GCE_METADATA_HOST", server.host)  # read at import
        credentials, project = google.auth.default(scopes=_GCS_SCOPES)
        assert isinstance(credentials, google.auth.compute_engine.Credentials) and project == "objckpt-test"
        credentials.refresh(google_request)
        assert server.valid_bearer(credentials.token) and server.fetches["gce"] == 1
        assert credentials.service_account_email == "objckpt-test@project.iam.gserviceaccount.com"
        assert not server.valid_bearer("ya29.forged")


@pytest.mark.parametrize("kind", ["service_account", "authorized_user", "external_account"])
def test_google_credential_files_refresh_at_the_emulated_endpoints(
    kind: str, clean_env: Callable[[dict[str, str]], None], tmp_path: Path, google_request: Any
) -> None:
    import google.auth

    with CredentialServer() as server:
        clean_env({})
        path = tmp_path / f"{kind}.json"
        if kind == "service_account":
            server.write_service_account_json(path)
        elif kind == "authorized_user":
            server.write_authorized_user_json(path)
        else:
            server.write_external_account_json(path, tmp_path / "subject-token")
        # An external account loaded with scopes looks its project up at cloudresourcemanager.googleapis.com.
        scopes = None if kind == "external_account" else _GCS_SCOPES
        credentials, _ = google.auth.load_credentials_from_file(str(path), scopes=scopes)
        if kind == "authorized_user":
            credentials = credentials.with_token_uri(f"{server.url}/token")  # the file's token_uri is ignored
        if kind == "external_account":
            credentials = credentials.with_scopes(_GCS_SCOPES)
        credentials.refresh(google_request)
        assert server.valid_bearer(credentials.token)
        assert server.fetches == {"external_account": {"sts-exchange": 1}}.get(kind, {"oauth": 1})
        assert json.loads(path.read_text())["type"] == kind


def test_oauth_endpoint_rejects_a_foreign_service_account_key(tmp_path: Path, google_request: Any) -> None:
    import google.auth
    import google.auth.exceptions

    with CredentialServer() as issuer, CredentialServer() as other:
        issuer.write_service_account_json(tmp_path / "sa.json")
        info = json.loads((tmp_path / "sa.json").read_text())
        info["token_uri"] = f"{other.url}/token"
        (tmp_path / "sa.json").write_text(json.dumps(info))
        credentials, _ = google.auth.load_credentials_from_file(str(tmp_path / "sa.json"), scopes=_GCS_SCOPES)
        with pytest.raises(google.auth.exceptions.RefreshError, match="invalid_grant"):
            credentials.refresh(google_request)
        assert other.issued == []


# ---------------------------------------------------------------- identity checks in the fault proxy


def test_fault_proxy_refuses_revoked_keys_and_counts_who_signed(
    s3_rotating: S3Service, rotating_keys: list[tuple[str, str]]
) -> None:
    import botocore.exceptions
    import requests

    (old_key, old_secret), (new_key, new_secret), _ = rotating_keys
    with FaultProxy(*_host_port(s3_rotating.endpoint_url)) as proxy:
        old = _s3_client(proxy.endpoint_url, old_key, old_secret)
        new = _s3_client(proxy.endpoint_url, new_key, new_secret)
        old.put_object(Bucket=s3_rotating.bucket, Key="revoke/k", Body=b"before")
        proxy.revoke_access_key(old_key)
        with pytest.raises(botocore.exceptions.ClientError, match="InvalidAccessKeyId"):
            old.get_object(Bucket=s3_rotating.bucket, Key="revoke/k")
        assert new.get_object(Bucket=s3_rotating.bucket, Key="revoke/k")["Body"].read() == b"before"

        params = {"Bucket": s3_rotating.bucket, "Key": "revoke/k"}
        v4 = _s3_client(proxy.endpoint_url, new_key, new_secret, signature_version="s3v4")
        url = v4.generate_presigned_url("get_object", Params=params)
        assert "X-Amz-Credential=" in url and requests.get(url, timeout=10).content == b"before"
        stale = old.generate_presigned_url("get_object", Params=params)  # SigV2: AWSAccessKeyId=
        answer = requests.get(stale, timeout=10)
        assert answer.status_code == 403 and b"<Code>InvalidAccessKeyId</Code>" in answer.content

        with_token = _s3_client(proxy.endpoint_url, old_key, old_secret, token="session-token")
        with pytest.raises(botocore.exceptions.ClientError, match="InvalidAccessKeyId"):
            with_token.get_object(Bucket=s3_rotating.bucket, Key="revoke/k")

        assert proxy.stats.access_keys == {old_key: 4, new_key: 2}
        assert proxy.stats.refused == 3 and proxy.stats.session_tokens == 1


def test_fault_proxy_requires_a_valid_bearer_token_before_gcs(
    gcs_service: Any, google_request: Any, tmp_path: Path
) -> None:
    import google.auth
    import google.auth.transport.requests
    import requests

    with CredentialServer() as server, FaultProxy(*_host_port(gcs_service.endpoint_url)) as proxy:
        proxy.require_bearer(server.valid_bearer)
        listing = f"{proxy.endpoint_url}/storage/v1/b/{gcs_service.bucket}/o"
        anonymous = requests.get(listing, timeout=10)
        assert anonymous.status_code == 401 and anonymous.json()["error"]["errors"][0]["reason"] == "authError"
        forged = requests.get(listing, headers={"Authorization": "Bearer ya29.forged"}, timeout=10)
        assert forged.status_code == 401

        server.write_service_account_json(tmp_path / "sa.json")
        credentials, _ = google.auth.load_credentials_from_file(str(tmp_path / "sa.json"), scopes=_GCS_SCOPES)
        session = google.auth.transport.requests.AuthorizedSession(credentials)  # refreshes on first use
        answer = session.get(listing, timeout=10)
        assert answer.status_code == 200 and answer.json()["kind"] == "storage#objects"
        assert proxy.stats.bearer_tokens == {hashlib.sha256(credentials.token.encode()).hexdigest()[:12]: 1}
        assert proxy.stats.refused == 2 and server.fetches == {"oauth": 1}
