"""HTTPS with a private CA, an HTTP CONNECT proxy, and unsigned payloads: the network of a real deployment.

The local S3 and GCS servers sit behind :class:`backends.tls.TlsFront` (a
certificate from a test CA no system trusts) and, when a test asks, behind
:class:`backends.connect_proxy.ConnectProxy`. Clients learn to trust the CA
the way users tell them to, through the standard variables (``AWS_CA_BUNDLE``,
``REQUESTS_CA_BUNDLE``, ``SSL_CERT_FILE``), and reach the proxy through
``HTTPS_PROXY``, which ``NO_PROXY`` overrides. Every S3 path of objckpt is
covered through both clients (obstore, s3fs), and the command line too.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from helpers import random_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from backends import ConnectProxy, GCSService, S3Service, TestCA, TlsFront
from backends.proxy import FaultProxy
from objckpt.storage.opening import BACKEND_OPTION

_SCRIPT = Path(sys.executable).with_name("objckpt")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "objckpt.cli"]
OPTIONS = objckpt.Options(blob_size=256 << 10, read_chunk=128 << 10)
Env = Callable[..., dict[str, str]]
#: S3 through each client, and GCS: (store kind, forced S3 client or None).
PATHS = {"s3-obstore": ("s3", "obstore"), "s3-fsspec": ("s3", "fsspec"), "gcs": ("gcs", None)}


def _host_port(endpoint_url: str) -> tuple[str, int]:
    host, port = endpoint_url.rsplit("/", 1)[1].rsplit(":", 1)
    return host, int(port)


@pytest.fixture
def connect_proxy() -> Iterator[ConnectProxy]:
    with ConnectProxy() as proxy:
        yield proxy


def _target(
    path: str, request: pytest.FixtureRequest, test_ca: TestCA, cloud_env: Env, **env: str
) -> tuple[str, dict[str, Any], dict[str, str], TlsFront]:
    """A fresh URL on the HTTPS front for ``path``, its storage options (no CA in them: the
    CA is trusted through the standard variable for the client), and the environment."""
    kind, client = PATHS[path]
    if kind == "s3":
        s3: S3Service = request.getfixturevalue("s3_service")
        front: TlsFront = request.getfixturevalue("s3_tls")
        options: dict[str, Any] = {
            "key": s3.access_key,
            "secret": s3.secret_key,
            "client_kwargs": {"endpoint_url": front.endpoint_url, "region_name": s3.region},
            "config_kwargs": {"s3": {"addressing_style": "path"}},
            BACKEND_OPTION: client,
        }
        environ = cloud_env(AWS_CA_BUNDLE=str(test_ca.ca_file), **env)
        return s3.url(f"net-{uuid.uuid4().hex[:10]}"), options, environ, front
    gcs: GCSService = request.getfixturevalue("gcs_service")
    front = request.getfixturevalue("gcs_tls")
    options = {"endpoint_url": front.endpoint_url, "token": "anon", "project": "test"}
    environ = cloud_env(REQUESTS_CA_BUNDLE=str(test_ca.ca_file), **env)
    return gcs.url(f"net-{uuid.uuid4().hex[:10]}"), options, environ, front


def _save_and_restore(url: str, options: dict[str, Any], seed: int) -> None:
    """Save, then restore onto another mesh (streamed ranged reads): bit-exact."""
    values = random_array((512, 512), np.float32, seed)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    objckpt.save(
        url, {"w": jax.device_put(values, NamedSharding(mesh, P("x", "y")))}, storage_options=options, options=OPTIONS
    )
    other = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))
    target = {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=other)}
    out = objckpt.restore(url, target, storage_options=options, options=OPTIONS)
    assert np.asarray(out["w"]).tobytes() == values.tobytes()


def _cli_verify(url: str, options: dict[str, Any], env: dict[str, str]) -> None:
    import json

    flags = [arg for key, value in options.items() for arg in ("-o", f"{key}={json.dumps(value)}")]
    done = subprocess.run(
        [*CLI, "verify", url, "--no-progress", *flags], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("path", list(PATHS))
def test_https_trusting_the_ca_through_the_standard_variables(
    path: str, request: pytest.FixtureRequest, test_ca: TestCA, cloud_env: Env
) -> None:
    url, options, env, front = _target(path, request, test_ca, cloud_env)
    before = front.stats.connections
    _save_and_restore(url, options, seed=1)
    _cli_verify(url, options, env)
    assert front.stats.connections > before


@pytest.mark.parametrize("path", list(PATHS))
def test_https_through_a_connect_proxy_and_around_it(
    path: str, request: pytest.FixtureRequest, test_ca: TestCA, cloud_env: Env, connect_proxy: ConnectProxy
) -> None:
    url, options, env, front = _target(path, request, test_ca, cloud_env, HTTPS_PROXY=connect_proxy.url)
    tunnel = f"127.0.0.1:{front.port}"
    _save_and_restore(url, options, seed=2)
    through_library = connect_proxy.stats.tunnels[tunnel]
    assert through_library >= 1, connect_proxy.stats.tunnels
    _cli_verify(url, options, env)
    assert connect_proxy.stats.tunnels[tunnel] > through_library  # the command line takes it too

    env = cloud_env(HTTPS_PROXY=connect_proxy.url, NO_PROXY="127.0.0.1", **_ca_variable(path, test_ca))
    before, tunnels = front.stats.connections, dict(connect_proxy.stats.tunnels)
    _save_and_restore(f"{url}-direct", options, seed=3)
    _cli_verify(f"{url}-direct", options, env)
    assert connect_proxy.stats.tunnels == tunnels and front.stats.connections > before


def _ca_variable(path: str, test_ca: TestCA) -> dict[str, str]:
    return {("AWS_CA_BUNDLE" if path.startswith("s3") else "REQUESTS_CA_BUNDLE"): str(test_ca.ca_file)}


@pytest.mark.parametrize("client", ["obstore", "fsspec"])
def test_a_ca_nobody_was_told_to_trust_is_refused(
    s3_service: S3Service, s3_tls: TlsFront, cloud_env: Env, client: str
) -> None:
    """Without the CA, the store refuses to talk, at once (no retries): the error names the
    URL, says the certificate is not trusted and how to trust it."""
    cloud_env()
    options = {
        "key": s3_service.access_key,
        "secret": s3_service.secret_key,
        "client_kwargs": {"endpoint_url": s3_tls.endpoint_url, "region_name": s3_service.region},
        "config_kwargs": {"s3": {"addressing_style": "path"}},
        BACKEND_OPTION: client,
    }
    url = s3_service.url(f"untrusted-{uuid.uuid4().hex[:8]}")
    with pytest.raises(objckpt.StoreError, match=f"(?s){url}.*certificate is not trusted.*AWS_CA_BUNDLE") as info:
        objckpt.save(url, {"w": np.arange(10)}, storage_options=options, options=OPTIONS)
    assert not isinstance(info.value, objckpt.errors.TransientStoreError) and "attempts" not in str(info.value)


@pytest.mark.parametrize("client", ["obstore", "fsspec"])
def test_s3_bodies_go_unsigned_over_https(s3_service: S3Service, test_ca: TestCA, cloud_env: Env, client: str) -> None:
    """What the README says: over HTTPS, TLS protects the body and SigV4 does not hash it
    (``X-Amz-Content-Sha256: UNSIGNED-PAYLOAD``), so uploads cost no SHA-256 pass."""
    cloud_env(AWS_CA_BUNDLE=str(test_ca.ca_file))
    with FaultProxy(*_host_port(s3_service.endpoint_url), tls=test_ca) as proxy:
        options = {
            "key": s3_service.access_key,
            "secret": s3_service.secret_key,
            "client_kwargs": {"endpoint_url": proxy.endpoint_url, "region_name": s3_service.region},
            "config_kwargs": {"s3": {"addressing_style": "path"}},
            BACKEND_OPTION: client,
        }
        _save_and_restore(s3_service.url(f"unsigned-{uuid.uuid4().hex[:8]}"), options, seed=4)
        puts = {kind: n for (method, kind), n in proxy.stats.payload_hashes.items() if method == "PUT"}
        assert sum(puts.values()) >= 4, proxy.stats.payload_hashes
        assert set(puts) <= {"UNSIGNED-PAYLOAD", "STREAMING-UNSIGNED-PAYLOAD-TRAILER"}, puts
