"""Every credential source, on every path: the rows of docs/CREDENTIALS.md.

Each row runs in the bare environment of a fresh cloud VM (``cloud_env``: no
``AWS_*`` or Google variables, an empty ``HOME``) plus what that source needs,
and drives every path a user has: ``objckpt.save``, a resharded (streamed)
``objckpt.restore``, a :class:`~objckpt.CheckpointManager`, and the command
line (``cp``, ``verify``, ``ls``) in a subprocess. The credentials come from
the emulated services in :mod:`backends.identity` (IMDSv2, ECS, STS, GCE
metadata, OAuth, Google STS) through their standard override variables.

Who signed is checked where a cloud store would check it: S3 requests pass
:class:`backends.proxy.FaultProxy`, which counts the access key of each
request, to a SeaweedFS that knows each row's key (and refuses any other);
GCS requests pass a proxy that refuses any bearer token the credential server
did not issue, or issued and saw expire. The last tests make credentials
expire every 2 s during a save and a restore, and revoke each key once it
has expired: the operations complete, signed by every key in turn.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
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
from backends import CredentialServer, S3Service, make_aws_keys, start_s3
from backends.proxy import FaultProxy
from objckpt.errors import StorePermissionError

pytestmark = [
    pytest.mark.s3,
    # google-auth warns that load_credentials_from_file does not validate the file: these files are ours.
    pytest.mark.filterwarnings("ignore:The load_credentials_from_file method is deprecated:DeprecationWarning"),
]

_SCRIPT = Path(sys.executable).with_name("objckpt")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "objckpt.cli"]
#: One access key per S3 row (SeaweedFS knows them all), so each row can tell its own apart.
KEYS = make_aws_keys(20)
OPTIONS = objckpt.Options(blob_size=128 << 10, read_chunk=64 << 10)
Env = Callable[..., dict[str, str]]


def _host_port(endpoint_url: str) -> tuple[str, int]:
    host, port = endpoint_url.rsplit("/", 1)[1].rsplit(":", 1)
    return host, int(port)


@pytest.fixture(scope="module")
def s3_ids() -> Iterator[S3Service]:
    """SeaweedFS that accepts :data:`KEYS` besides its own admin key."""
    service = start_s3(extra_credentials=KEYS)
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def s3_door(s3_ids: S3Service) -> Iterator[FaultProxy]:
    """The way in to ``s3_ids``: counts the access key of every request."""
    with FaultProxy(*_host_port(s3_ids.endpoint_url)) as proxy:
        yield proxy


@pytest.fixture
def signed_by(s3_door: FaultProxy) -> Callable[[], set[str]]:
    """``signed_by()``: the access keys that signed the requests made since the test began."""
    before = Counter(s3_door.stats.access_keys)

    def keys() -> set[str]:
        return {key for key, n in s3_door.stats.access_keys.items() if n > before[key]}

    return keys


def _s3_options(s3: S3Service, door: FaultProxy) -> dict[str, Any]:
    """Where the bucket is, and nothing about who is asking."""
    return {
        "client_kwargs": {"endpoint_url": door.endpoint_url, "region_name": s3.region},
        "config_kwargs": {"s3": {"addressing_style": "path"}},
    }


# ---------------------------------------------------------------------------- every path


def _tree(seed: int) -> dict[str, Any]:
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    return {
        "w": jax.device_put(random_array((512, 256), np.float32, seed), NamedSharding(mesh, P("x", "y"))),
        "b": np.arange(100, dtype=np.int32) * seed,
    }


def _cli(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(
        [*CLI, args[0], "--no-progress", *args[1:]], env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, f"objckpt {args[0]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _flags(options: dict[str, Any], flag: str = "-o") -> list[str]:
    """``options`` as the command line's ``KEY=JSON`` storage-option flags."""
    out: list[str] = []
    for key, value in options.items():
        out += [flag, f"{key}={json.dumps(value)}"]
    return out


def every_path(root: str, options: dict[str, Any], env: dict[str, str]) -> None:
    """Save, restore onto another mesh (streamed reads), a manager's save and restore, and
    the CLI's ``cp``, ``verify`` and ``ls`` in a subprocess with ``env``: all bit-exact."""
    seed = uuid.uuid4().int % 1000 + 1
    tree = _tree(seed)
    expected = np.asarray(tree["w"])
    url = f"{root}/ckpt"
    objckpt.save(url, tree, storage_options=options, options=OPTIONS)
    other = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))
    target = {"w": jax.ShapeDtypeStruct(expected.shape, expected.dtype, sharding=other), "b": None}
    out = objckpt.restore(url, target, storage_options=options, options=OPTIONS)
    assert np.asarray(out["w"]).tobytes() == expected.tobytes()
    assert np.array_equal(out["b"], tree["b"])

    manager = objckpt.CheckpointManager(
        f"{root}/run", storage_options=options, options=OPTIONS, retention=objckpt.Retention(keep_last=1)
    )
    try:
        manager.save(1, tree, wait=True)
        manager.save(2, tree, wait=True)
        assert manager.steps() == [2]
        again = manager.restore(2, target)
        assert np.asarray(again["w"]).tobytes() == expected.tobytes()
    finally:
        manager.close()

    _cli(["cp", url, f"{root}/copy", *_flags(options, "--src-option"), *_flags(options, "--dst-option")], env)
    _cli(["verify", f"{root}/copy", *_flags(options)], env)
    listing = _cli(["ls", f"{root}/run", "--json", *_flags(options)], env)
    assert [(e["step"], e["committed"]) for e in json.loads(listing)] == [(2, True)], listing


# ---------------------------------------------------------------------------- S3 rows


def _root(s3: S3Service) -> str:
    return s3.url(f"creds-{uuid.uuid4().hex[:10]}")


def test_s3_static_keys_in_storage_options(s3_ids, s3_door, signed_by, cloud_env: Env) -> None:
    env = cloud_env()
    key, secret = KEYS[0]
    every_path(_root(s3_ids), {**_s3_options(s3_ids, s3_door), "key": key, "secret": secret}, env)
    assert signed_by() == {key}


def test_s3_environment_keys(s3_ids, s3_door, signed_by, cloud_env: Env) -> None:
    key, secret = KEYS[1]
    env = cloud_env(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    every_path(_root(s3_ids), _s3_options(s3_ids, s3_door), env)
    assert signed_by() == {key}


def test_s3_session_token_reaches_every_request(s3_ids, s3_door, signed_by, cloud_env: Env) -> None:
    """SeaweedFS accepts only session tokens its own STS issued, so a token from elsewhere
    is refused: what is checked is that every request, of every path, carries it, and the
    refusal names the URL."""
    key, secret = KEYS[2]
    root = _root(s3_ids)
    options = _s3_options(s3_ids, s3_door)
    cloud_env(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    objckpt.save(f"{root}/ckpt", _tree(3), storage_options=options, options=OPTIONS)  # no token: accepted

    env = cloud_env(AWS_SESSION_TOKEN="FwoGZXIvYXdzEBYaDOBJCKPTTESTTOKEN")
    before_tokens, before_keys = s3_door.stats.session_tokens, sum(s3_door.stats.access_keys.values())
    with pytest.raises(StorePermissionError, match=f"{root}/again"):
        objckpt.save(f"{root}/again", _tree(3), storage_options=options, options=OPTIONS)
    with pytest.raises(StorePermissionError, match=f"{root}/ckpt"):
        objckpt.restore(f"{root}/ckpt", storage_options=options, options=OPTIONS)
    done = subprocess.run(
        [*CLI, "verify", f"{root}/ckpt", *_flags(options)], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode != 0 and f"{root}/ckpt" in done.stderr, done.stderr[-2000:]
    requests = sum(s3_door.stats.access_keys.values()) - before_keys
    assert requests >= 3 and s3_door.stats.session_tokens - before_tokens == requests
    assert signed_by() == {key}


def test_s3_shared_credentials_file_and_profile(s3_ids, s3_door, signed_by, cloud_env: Env, tmp_path: Path) -> None:
    key, secret = KEYS[3]
    aws = tmp_path / "home" / ".aws"
    aws.mkdir(parents=True)
    (aws / "credentials").write_text(
        f"[default]\naws_access_key_id = {KEYS[9][0]}x\naws_secret_access_key = wrong\n\n"
        f"[training]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n"
    )
    env = cloud_env(AWS_PROFILE="training")
    every_path(_root(s3_ids), _s3_options(s3_ids, s3_door), env)
    assert signed_by() == {key}


def test_s3_assume_role_profile(s3_ids, s3_door, signed_by, cloud_env: Env, tmp_path: Path) -> None:
    """A profile that assumes a role from source keys the S3 server does not know: only the
    role's keys (from STS) can work."""
    key, _ = KEYS[4]
    source_key, source_secret = make_aws_keys(1)[0]
    with CredentialServer(aws_keys=[KEYS[4]]) as sts:
        env = cloud_env(
            **sts.write_aws_profile(tmp_path / "aws", "role", source_key=source_key, source_secret=source_secret)
        )
        every_path(_root(s3_ids), _s3_options(s3_ids, s3_door), env)
        assert sts.fetches["sts-assume-role"] >= 1
    assert signed_by() == {key}


def test_s3_instance_metadata_imdsv2(s3_ids, s3_door, signed_by, cloud_env: Env) -> None:
    key, _ = KEYS[5]
    with CredentialServer(aws_keys=[KEYS[5]]) as imds:
        env = cloud_env(**imds.imds_env())
        every_path(_root(s3_ids), _s3_options(s3_ids, s3_door), env)
        assert imds.fetches["imds"] >= 1
    assert signed_by() == {key}


@pytest.mark.parametrize("auth", [None, "ecs-auth-token"], ids=["ecs", "eks-auth-token"])
def test_s3_container_credentials(s3_ids, s3_door, signed_by, cloud_env: Env, auth: str | None) -> None:
    key, _ = KEYS[6]
    with CredentialServer(aws_keys=[KEYS[6]], container_auth_token=auth) as ecs:
        env = cloud_env(**ecs.ecs_env())
        every_path(_root(s3_ids), _s3_options(s3_ids, s3_door), env)
        assert ecs.fetches["ecs"] >= 1
    assert signed_by() == {key}


def test_s3_web_identity(s3_ids, s3_door, signed_by, cloud_env: Env, tmp_path: Path) -> None:
    key, _ = KEYS[7]
    with CredentialServer(aws_keys=[KEYS[7]]) as sts:
        env = cloud_env(**sts.web_identity_env(tmp_path / "web-identity-token"))
        every_path(_root(s3_ids), _s3_options(s3_ids, s3_door), env)
        assert sts.fetches["sts-web-identity"] >= 1
    assert signed_by() == {key}


def test_s3_refuses_an_identity_it_does_not_know(s3_ids, s3_door, cloud_env: Env) -> None:
    """The S3 server checks who signs: instance metadata serving an unknown key is refused, by URL."""
    stranger = make_aws_keys(1)
    with CredentialServer(aws_keys=stranger) as imds:
        cloud_env(**imds.imds_env())
        root = _root(s3_ids)
        with pytest.raises(StorePermissionError, match=root):
            objckpt.save(f"{root}/ckpt", _tree(1), storage_options=_s3_options(s3_ids, s3_door), options=OPTIONS)
    assert s3_door.stats.access_keys[stranger[0][0]] >= 1


# ---------------------------------------------------------------------------- GCS rows


@pytest.fixture
def gcs_door(gcs_bearer_proxy: FaultProxy) -> Callable[[], tuple[int, int]]:
    """``seen()``: (requests with a bearer token the server issued, requests refused) since the test began."""
    before = (sum(gcs_bearer_proxy.stats.bearer_tokens.values()), gcs_bearer_proxy.stats.refused)

    def seen() -> tuple[int, int]:
        stats = gcs_bearer_proxy.stats
        return sum(stats.bearer_tokens.values()) - before[0], stats.refused - before[1]

    return seen


def _gcs(gcs_service: Any, proxy: FaultProxy) -> tuple[str, dict[str, Any]]:
    return gcs_service.url(f"creds-{uuid.uuid4().hex[:10]}"), {"endpoint_url": proxy.endpoint_url, "project": "test"}


@pytest.mark.gcs
def test_gcs_service_account_json(gcs_service, gcs_bearer_proxy, gcs_door, gce_metadata, cloud_env, tmp_path) -> None:
    key_file = gce_metadata.write_service_account_json(tmp_path / "sa.json")
    env = cloud_env()
    fetched = gce_metadata.fetches["oauth"]
    root, options = _gcs(gcs_service, gcs_bearer_proxy)
    every_path(root, {**options, "token": str(key_file)}, env)
    granted, refused = gcs_door()
    assert granted > 0 and refused == 0 and gce_metadata.fetches["oauth"] > fetched


@pytest.mark.gcs
@pytest.mark.parametrize("where", ["GOOGLE_APPLICATION_CREDENTIALS", "gcloud-well-known-file"])
def test_gcs_application_default_credentials(
    gcs_service, gcs_bearer_proxy, gcs_door, gce_metadata, cloud_env, tmp_path, where
) -> None:
    if where == "GOOGLE_APPLICATION_CREDENTIALS":
        env = cloud_env(
            GOOGLE_APPLICATION_CREDENTIALS=str(gce_metadata.write_service_account_json(tmp_path / "sa.json"))
        )
    else:  # what `gcloud auth application-default login` leaves (here a service-account key)
        gcloud = tmp_path / "home" / ".config" / "gcloud"
        gcloud.mkdir(parents=True)
        gce_metadata.write_service_account_json(gcloud / "application_default_credentials.json")
        env = cloud_env()
    fetched = gce_metadata.fetches["oauth"]
    every_path(*_gcs(gcs_service, gcs_bearer_proxy), env)  # no token option: Google's default chain
    granted, refused = gcs_door()
    assert granted > 0 and refused == 0 and gce_metadata.fetches["oauth"] > fetched


@pytest.mark.gcs
def test_gcs_metadata_server(gcs_service, gcs_bearer_proxy, gcs_door, gce_metadata, cloud_env) -> None:
    """A TPU VM: no files, no variables but the metadata server's address."""
    env = cloud_env(**gce_metadata.gce_env())
    fetched = gce_metadata.fetches["gce"]
    every_path(*_gcs(gcs_service, gcs_bearer_proxy), env)
    granted, refused = gcs_door()
    assert granted > 0 and refused == 0 and gce_metadata.fetches["gce"] > fetched


@pytest.mark.gcs
def test_gcs_workload_identity_federation(
    gcs_service, gcs_bearer_proxy, gcs_door, gce_metadata, cloud_env, tmp_path
) -> None:
    config = gce_metadata.write_external_account_json(tmp_path / "wif.json", tmp_path / "subject-token")
    env = cloud_env(GOOGLE_APPLICATION_CREDENTIALS=str(config))
    fetched = gce_metadata.fetches["sts-exchange"]
    every_path(*_gcs(gcs_service, gcs_bearer_proxy), env)
    granted, refused = gcs_door()
    assert granted > 0 and refused == 0 and gce_metadata.fetches["sts-exchange"] > fetched


# ---------------------------------------------------------------------------- refreshed mid-operation


class _Revoker:
    """Revokes at ``proxy`` each key ``server`` stopped serving, ``grace`` seconds after it lapsed
    (requests signed just before a rotation may still be in flight)."""

    def __init__(self, server: CredentialServer, proxy: FaultProxy, grace: float = 1.0) -> None:
        self._server, self._proxy, self._grace = server, proxy, grace
        self._lapsed: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Revoker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            now = time.monotonic()
            for key in self._server.expired_access_keys():
                if now - self._lapsed.setdefault(key, now) >= self._grace:
                    self._proxy.revoke_access_key(key)


def _long_save_and_restore(root: str, options: dict[str, Any]) -> float:
    """A 4 MiB save and a resharded restore, two requests at a time through a slow link: seconds taken."""
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    values = random_array((1024, 1024), np.float32, 11)
    slow = objckpt.Options(blob_size=256 << 10, read_chunk=256 << 10, max_concurrency=2, adaptive_concurrency=False)
    started = time.monotonic()
    objckpt.save(
        root, {"w": jax.device_put(values, NamedSharding(mesh, P("x", "y")))}, storage_options=options, options=slow
    )
    other = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))
    target = {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=other)}
    out = objckpt.restore(root, target, storage_options=options, options=slow)
    assert np.asarray(out["w"]).tobytes() == values.tobytes()
    return time.monotonic() - started


@pytest.mark.parametrize("source", ["web-identity", "assume-role", "imds"])
def test_s3_credentials_that_expire_mid_operation_are_refreshed(
    s3_ids, cloud_env: Env, tmp_path: Path, source: str
) -> None:
    lifetime = 2.0
    rotating = KEYS  # served in turn, never twice within the test (revoked keys stay revoked)
    with (
        # botocore's sources report a longer life (see CredentialServer); obstore's own metadata client, the true one
        CredentialServer(
            aws_keys=rotating, lifetime_s=lifetime, aws_expiry_padding_s=0 if source == "imds" else 630
        ) as server,
        FaultProxy(*_host_port(s3_ids.endpoint_url), latency_ms=100) as proxy,
    ):
        if source == "web-identity":
            cloud_env(**server.web_identity_env(tmp_path / "token"))
        elif source == "assume-role":
            source_key, source_secret = make_aws_keys(1)[0]
            cloud_env(
                **server.write_aws_profile(tmp_path / "aws", "role", source_key=source_key, source_secret=source_secret)
            )
        else:
            cloud_env(**server.imds_env())
        with _Revoker(server, proxy):
            took = _long_save_and_restore(s3_ids.url(f"expiring-{uuid.uuid4().hex[:8]}"), _s3_options(s3_ids, proxy))
        # Signed by two keys or more: the operation outlived its first credentials (the number of
        # keys bounds it from above: none is served twice, so a revoked key never comes back).
        assert lifetime < took < len(rotating) * lifetime, f"{took:.1f} s: not {lifetime:g} s x 1..{len(rotating)}"
        used = [key for key, _ in rotating if proxy.stats.access_keys[key]]
        assert len(used) >= 2, proxy.stats.access_keys  # every lapsed key was revoked, yet all went through
        assert proxy.stats.refused == 0


@pytest.mark.gcs
def test_gcs_metadata_tokens_that_expire_mid_operation_are_refreshed(gcs_service, cloud_env: Env) -> None:
    lifetime = 2.0
    with (
        CredentialServer(lifetime_s=lifetime) as server,
        FaultProxy(*_host_port(gcs_service.endpoint_url), latency_ms=100) as proxy,
    ):
        proxy.require_bearer(lambda token: server.valid_bearer(token, grace_s=1.0))  # expired tokens are refused
        cloud_env(**server.gce_env())
        url = gcs_service.url(f"expiring-{uuid.uuid4().hex[:8]}")
        took = _long_save_and_restore(url, {"endpoint_url": proxy.endpoint_url, "project": "test"})
        assert took > lifetime, f"too quick to outlive its token: {took:.1f} s"  # and >= 2 tokens, below
        assert proxy.stats.refused == 0 and len(proxy.stats.bearer_tokens) >= 2
