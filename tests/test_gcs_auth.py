"""One refreshable Google credential per GCS store (``objckpt.storage.auth.gcs``).

Credentials come from google-auth's own loaders and refresh against a real
OAuth token endpoint (:class:`backends.identity.CredentialServer`); on the GCS
emulator behind :class:`backends.proxy.FaultProxy`, which refuses requests
whose bearer token the server did not issue or that has expired, gcsfs and
objckpt's fast paths share that credential and keep working across rotations.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import google.oauth2.credentials
import jax
import numpy as np
import pytest
from google.auth.credentials import AnonymousCredentials
from google.oauth2 import service_account
from helpers import random_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from backends.identity import CredentialServer
from backends.proxy import FaultProxy
from objckpt.errors import StorePermissionError, TransientStoreError
from objckpt.storage import from_url
from objckpt.storage.auth.gcs import SCOPE_PREFIX, GoogleToken, load_token
from objckpt.storage.http.gcs import GCSRangeReader
from objckpt.storage.http.gcs_upload import MediaUploader
from objckpt.transfer import runtime

URL = "gs://bkt/ckpt"


@pytest.fixture
def server():
    with CredentialServer() as creds:
        yield creds


def _user_credentials(server: CredentialServer, tmp_path) -> google.oauth2.credentials.Credentials:
    """Expired ``authorized_user`` credentials that refresh at ``server`` (google-auth's own refresh)."""
    path = server.write_authorized_user_json(tmp_path / "user.json")
    loaded = google.oauth2.credentials.Credentials.from_authorized_user_file(str(path))
    return loaded.with_token_uri(f"{server.url}/token")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ what the token option loads


def test_token_options_load_the_credentials_google_auth_would(server, tmp_path, monkeypatch):
    anon = load_token("anon", url=URL, timeout=5)
    assert anon is not None and anon.anonymous and anon.headers() == {}
    for gcsfs_only in ("browser", "cache", "ya29.a-raw-access-token", {"refresh_token": "r", "client_id": "c"}):
        assert load_token(gcsfs_only, url=URL, timeout=5) is None, gcsfs_only
    given = _user_credentials(server, tmp_path)
    assert load_token(given, url=URL, timeout=5).credentials is given  # type: ignore[union-attr]

    key_file = server.write_service_account_json(tmp_path / "sa.json")
    from_file = load_token(str(key_file), url=URL, timeout=5)
    assert from_file is not None and isinstance(from_file.credentials, service_account.Credentials)
    assert from_file.credentials.scopes == ["https://www.googleapis.com/auth/devstorage.full_control"]
    from_dict = load_token(json.loads(key_file.read_text()), url=URL, timeout=5, access="read_only")
    assert from_dict is not None and from_dict.credentials.scopes == [SCOPE_PREFIX + "read_only"]
    user_file = load_token(server.write_authorized_user_json(tmp_path / "user.json"), url=URL, timeout=5)
    assert user_file is not None and isinstance(user_file.credentials, google.oauth2.credentials.Credentials)
    with pytest.raises(StorePermissionError, match="service_account"):
        load_token({"type": "service_account", "client_email": "x"}, url=URL, timeout=5)

    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key_file))
    default = load_token(None, url=URL, timeout=5)
    assert default is not None and isinstance(default.credentials, service_account.Credentials)
    assert default.project == "objckpt-test"


def test_no_default_credentials_leaves_gcsfs_alone_unless_asked_for(tmp_path, monkeypatch):
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # no gcloud application-default file
    monkeypatch.setenv("GCE_METADATA_IP", f"127.0.0.1:{_closed_port()}")
    assert load_token(None, url=URL, timeout=5) is None
    with pytest.raises(StorePermissionError, match="gs://bkt/ckpt"):
        load_token("google_default", url=URL, timeout=5)


# ------------------------------------------------------------------ refreshing


def test_headers_refresh_once_when_due_and_never_show_the_token(server, tmp_path):
    token = load_token(_user_credentials(server, tmp_path), url="gs://bkt/ckpt?secret=x", timeout=5)
    assert token is not None and token.fresh_headers() is None  # no token yet: a refresh is due
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(token.headers()["authorization"])) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert server.fetches["oauth"] == 1 and len(set(results)) == 1  # one refresh, shared by every thread
    assert token.fresh_headers() == {"authorization": results[0]}
    assert results[0].removeprefix("Bearer ") not in repr(token) and "secret" not in repr(token)

    token.credentials.expiry = datetime.now(UTC).replace(tzinfo=None) + timedelta(seconds=30)  # inside the skew
    assert token.fresh_headers() is None
    token.headers()
    assert server.fetches["oauth"] == 2


def test_refusals_are_permission_errors_and_outages_transient(server, tmp_path):
    creds = _user_credentials(server, tmp_path)
    unknown = google.oauth2.credentials.Credentials(
        None, refresh_token="1//revoked", client_id="c", client_secret="s", token_uri=f"{server.url}/token"
    )
    with pytest.raises(StorePermissionError, match=r"gs://bkt/ckpt.*invalid_grant") as info:
        GoogleToken(unknown, url=URL, timeout=5).headers()
    assert "1//revoked" not in str(info.value)

    down = GoogleToken(creds.with_token_uri(f"http://127.0.0.1:{_closed_port()}/token"), url=URL, timeout=5)
    with pytest.raises(TransientStoreError, match="gs://bkt/ckpt"):
        down.headers()


def test_every_refresh_request_has_a_timeout(tmp_path):
    """A token endpoint that accepts the connection and never answers fails the refresh in time."""

    class Silent(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            time.sleep(5)

        def log_message(self, *args: object) -> None:
            pass

    silent = ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    silent.daemon_threads = True
    threading.Thread(target=silent.serve_forever, daemon=True).start()
    try:
        creds = google.oauth2.credentials.Credentials(
            None,
            refresh_token="r",
            client_id="c",
            client_secret="s",
            token_uri=f"http://127.0.0.1:{silent.server_address[1]}/token",
        )
        token = GoogleToken(creds, url=URL, timeout=0.5)
        started = time.monotonic()
        with pytest.raises(TransientStoreError):
            token.headers()
        assert time.monotonic() - started < 4.5  # google-auth retries a timeout, each try under 0.5 s
    finally:
        silent.shutdown()
        silent.server_close()


# ------------------------------------------------------------------ shared by gcsfs and the fast paths


def test_gcsfs_and_the_fast_paths_share_one_credential(gcs_service, server, tmp_path):
    creds = _user_credentials(server, tmp_path)
    options = {**gcs_service.storage_options(), "token": creds}
    store = from_url(gcs_service.url(f"shared-{uuid.uuid4().hex[:8]}"), **options)
    assert isinstance(store._range_reader, GCSRangeReader) and isinstance(store._uploader, MediaUploader)
    data = bytes(range(256)) * 4096
    runtime.run_sync(store.put("blob", data))  # a media upload: refreshes
    runtime.run_sync(store.put("manifest.json", b"{}", mode="create"))  # gcsfs: the token is fresh
    assert runtime.run_sync(store.get_range("blob", start=5, end=9)) == data[5:9]  # gcsfs
    assert runtime.run_sync(store.head("blob")).size == len(data)
    assert server.fetches["oauth"] == 1  # gcsfs refreshed nothing of its own: the credential is shared
    runtime.run_sync(store.close())


def test_a_rotating_token_serves_a_long_save_and_restore(gcs_service, tmp_path):
    """Tokens live 2 s; the save and restore take longer; every request must carry a live one."""
    host, port = gcs_service.endpoint_url.rsplit("//", 1)[1].split(":")
    with CredentialServer(lifetime_s=2) as creds, FaultProxy(host, int(port), latency_ms=500) as proxy:
        # A token is issued for the rest of its 2 s generation, so one fetched just before the
        # rotation may reach the proxy just after it: live when sent is what a client can do.
        proxy.require_bearer(lambda token: creds.valid_bearer(token, grace_s=1.0))
        options = {"endpoint_url": proxy.endpoint_url, "project": "test", "token": _user_credentials(creds, tmp_path)}
        url = gcs_service.url(f"rotate-{uuid.uuid4().hex[:8]}")
        mesh = jax.make_mesh((4, 2), ("x", "y"))
        values = random_array((1024, 1024), np.float32, 9)  # 4 MiB
        opts = objckpt.Options(blob_size=256 << 10, read_chunk=256 << 10)
        started = time.monotonic()
        tree = {"w": jax.device_put(values, NamedSharding(mesh, P("x", "y")))}
        objckpt.save(url, tree, storage_options=options, options=opts)
        other = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))  # streamed, resharded reads
        target = {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=other)}
        out = objckpt.restore(url, target, storage_options=options, options=opts)
        assert np.asarray(out["w"]).tobytes() == values.tobytes()
        assert time.monotonic() - started > 2
        assert proxy.stats.refused == 0
        assert len(proxy.stats.bearer_tokens) >= 2, proxy.stats.bearer_tokens


def test_anonymous_credentials_send_no_authorization():
    token = GoogleToken(AnonymousCredentials(), url=URL, timeout=5)
    assert token.anonymous and token.fresh_headers() == {} and token.headers() == {}
