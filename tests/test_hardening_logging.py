"""No credential reaches a log line: every source of docs/CREDENTIALS.md under DEBUG logging.

Each row serves one credential source (the emulated services of
:mod:`backends.identity`, in the bare environment of ``cloud_env``) and runs,
in subprocesses whose every byte of output is captured:

* the command line with ``--debug`` (``verify`` and ``ls``), and
* a library user's script that calls ``logging.basicConfig(level=DEBUG)``
  and then saves and restores with objckpt,

then looks for the secrets the source handed out: secret access keys,
session tokens, the web identity token, the container authorization token,
Google access tokens, private-key material and any JWT. The operations must
still succeed (rows with session tokens, which SeaweedFS refuses, must fail
with the store's refusal: the secrets were fetched and used all the same),
and the library user's logging must stay theirs: levels, handlers and
records untouched but for the secret values in them.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from backends import CredentialServer, S3Service, make_aws_keys, start_s3

pytestmark = [pytest.mark.s3]

_SCRIPT = Path(sys.executable).with_name("objckpt")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "objckpt.cli"]
KEYS = make_aws_keys(12)
Env = Callable[..., dict[str, str]]

#: Any JWT (service-account assertions, web identity tokens), Google access tokens the
#: emulated services issue, and PEM private keys: none may appear in any output.
_SECRET_SHAPES = [
    re.compile(r"eyJ[\w-]{4,}\.[\w-]{4,}\.[\w-]{4,}"),
    re.compile(r"ya29\.objckpt-[\w-]{4,}"),
    re.compile(r"PRIVATE KEY-----(\\n|\n)[A-Za-z0-9+/]{8,}"),
]

#: A library user's process: DEBUG logging for everything, then a save and a restore.
_LIBRARY_USER = """
import json, logging, sys
logging.basicConfig(level=logging.DEBUG, format="%(name)s %(levelname)s %(message)s")
import numpy as np
import objckpt
from objckpt.errors import StorePermissionError

url, options = sys.argv[1], json.loads(sys.argv[2])
names = ["", "botocore", "botocore.endpoint", "urllib3", "google.auth", "s3fs", "gcsfs"]
before = [(logging.getLogger(n).level, logging.getLogger(n).propagate) for n in names]
handlers = list(logging.getLogger().handlers)
tree = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.arange(10)}
try:
    objckpt.save(url, tree, storage_options=options)
    out = objckpt.restore(url, storage_options=options)
    assert np.array_equal(out["w"], tree["w"]) and np.array_equal(out["b"], tree["b"])
    outcome = "saved and restored"
except StorePermissionError as error:
    outcome = "refused"
    print(f"REFUSED {error}", flush=True)
after = [(logging.getLogger(n).level, logging.getLogger(n).propagate) for n in names]
same = after == before and logging.getLogger().handlers == handlers
print(f"OUTCOME {outcome}", flush=True)
print(f"LOGGING {'unchanged' if same else f'changed: {before} -> {after}'}", flush=True)
logging.getLogger("botocore.endpoint").debug("user record survives: %s", "yes")
"""


@dataclass
class Source:
    """One credential source as a test sets it up: the environment, options and what must stay secret."""

    env: dict[str, str]
    options: dict[str, Any] = field(default_factory=dict)
    secrets: list[str] = field(default_factory=list)
    refused: bool = False  # the store refuses the credentials (session tokens SeaweedFS did not issue)


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


def _served(server: CredentialServer, auth: str | None = None) -> list[str]:
    """The AWS secret key and session token ``server`` serves now (its ECS endpoint answers for every kind)."""
    request = urllib.request.Request(f"{server.url}/ecs/credentials")
    if auth:
        request.add_header("Authorization", auth)
    with urllib.request.urlopen(request, timeout=10) as answer:
        body = json.loads(answer.read())
    return [value for value in (body["SecretAccessKey"], body.get("Token")) if value]


def _leaks(output: str, secrets: list[str]) -> list[str]:
    """What of ``secrets`` and :data:`_SECRET_SHAPES` is in ``output`` (shown by their first characters)."""
    found = [f"{secret[:4]}..." for secret in secrets if secret in output]
    found += [f"{m.group(0)[:14]}..." for shape in _SECRET_SHAPES if (m := shape.search(output))]
    return found


def _run(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, check=False)
    return done.returncode, done.stdout + done.stderr


def _library_user(url: str, source: Source) -> str:
    rc, output = _run([sys.executable, "-c", _LIBRARY_USER, url, json.dumps(source.options)], source.env)
    assert rc == 0, output[-3000:]
    assert f"OUTCOME {'refused' if source.refused else 'saved and restored'}" in output, output[-3000:]
    if source.refused:
        assert f"REFUSED {url}" in output or url in output.split("REFUSED", 1)[1][:400], output[-2000:]
    assert "LOGGING unchanged" in output, output[-2000:]
    assert "user record survives: yes" in output  # the user's records still reach the user's handlers
    return output


def _cli(url: str, source: Source) -> str:
    flags: list[str] = []
    for key, value in source.options.items():
        flags += ["-o", f"{key}={json.dumps(value)}"]
    rc, verify = _run([*CLI, "verify", url, "--debug", "--no-progress", *flags], source.env)
    if source.refused:
        # --debug raises: the traceback's last line names the URL, and no secret
        assert rc == 1 and "StorePermissionError" in verify and url in verify, verify[-2000:]
        return verify
    assert rc == 0, verify[-3000:]
    parent = url.rsplit("/", 1)[0]
    rc, listing = _run([*CLI, "ls", parent, "--debug", "--no-progress", "--json", *flags], source.env)
    assert rc == 0 and url.rsplit("/", 1)[1] in listing, listing[-3000:]
    return verify + listing


def _check_every_path(url: str, source: Source) -> None:
    """The library user's process and the CLI with ``--debug``: it works, DEBUG logs flow, no secret shows."""
    assert all(source.secrets)
    library = _library_user(url, source)
    assert re.search(r"^(botocore|urllib3|google\.auth|gcsfs|s3fs)[.\w]* DEBUG ", library, re.M), library[-2000:]
    cli = _cli(url, source)
    assert re.search(r"^(objckpt|botocore|urllib3|google\.auth|gcsfs|s3fs)[.\w]*: ", cli, re.M), cli[-2000:]
    leaks = {"library user's process (basicConfig DEBUG)": _leaks(library, source.secrets)}
    leaks["objckpt --debug"] = _leaks(cli, source.secrets)
    assert leaks == {name: [] for name in leaks}, f"credentials in the output: {leaks}"


# ---------------------------------------------------------------------------- S3 rows


def _s3(s3: S3Service, env: dict[str, str], **more: Any) -> Source:
    options = {
        "client_kwargs": {"endpoint_url": s3.endpoint_url, "region_name": s3.region},
        "config_kwargs": {"s3": {"addressing_style": "path"}},
    }
    return Source(env=env, options=options, **more)


def _url(s3: S3Service) -> str:
    return s3.url(f"debuglog-{uuid.uuid4().hex[:10]}/ckpt")


def _web_identity_token() -> str:
    """A token shaped like a Kubernetes projected service-account token (a JWT), unique to the test."""
    return f"eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ{uuid.uuid4().hex}.{uuid.uuid4().hex}{uuid.uuid4().hex}"


def test_s3_static_keys_in_options_stay_out_of_debug_logs(s3_ids, cloud_env: Env) -> None:
    key, secret = KEYS[0]
    source = _s3(s3_ids, cloud_env(), secrets=[secret])
    source.options.update(key=key, secret=secret)
    _check_every_path(_url(s3_ids), source)


def test_s3_environment_keys_stay_out_of_debug_logs(s3_ids, cloud_env: Env) -> None:
    key, secret = KEYS[1]
    env = cloud_env(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    _check_every_path(_url(s3_ids), _s3(s3_ids, env, secrets=[secret]))


def test_s3_session_token_stays_out_of_debug_logs(s3_ids, cloud_env: Env) -> None:
    key, secret = KEYS[2]
    token = "FwoGZXIvYXdzEBYaD" + uuid.uuid4().hex
    env = cloud_env(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret, AWS_SESSION_TOKEN=token)
    _check_every_path(_url(s3_ids), _s3(s3_ids, env, secrets=[secret, token], refused=True))


def test_s3_shared_credentials_file_stays_out_of_debug_logs(s3_ids, cloud_env: Env, tmp_path: Path) -> None:
    key, secret = KEYS[3]
    aws = tmp_path / "home" / ".aws"
    aws.mkdir(parents=True)
    (aws / "credentials").write_text(f"[training]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
    env = cloud_env(AWS_PROFILE="training")
    _check_every_path(_url(s3_ids), _s3(s3_ids, env, secrets=[secret]))


@pytest.mark.parametrize("tokens", [False, True], ids=["keys", "session-tokens"])
def test_s3_assume_role_profile_stays_out_of_debug_logs(s3_ids, cloud_env: Env, tmp_path: Path, tokens: bool) -> None:
    source_key, source_secret = make_aws_keys(1)[0]
    with CredentialServer(aws_keys=[KEYS[4]], session_tokens=tokens) as sts:
        env = cloud_env(
            **sts.write_aws_profile(tmp_path / "aws", "role", source_key=source_key, source_secret=source_secret)
        )
        source = _s3(s3_ids, env, secrets=[source_secret, *_served(sts)], refused=tokens)
        _check_every_path(_url(s3_ids), source)
        assert sts.fetches["sts-assume-role"] >= 1


@pytest.mark.parametrize("tokens", [False, True], ids=["keys", "session-tokens"])
def test_s3_instance_metadata_stays_out_of_debug_logs(s3_ids, cloud_env: Env, tokens: bool) -> None:
    with CredentialServer(aws_keys=[KEYS[5]], session_tokens=tokens) as imds:
        source = _s3(s3_ids, cloud_env(**imds.imds_env()), secrets=_served(imds), refused=tokens)
        _check_every_path(_url(s3_ids), source)
        assert imds.fetches["imds"] >= 1


@pytest.mark.parametrize("tokens", [False, True], ids=["keys", "session-tokens"])
def test_s3_container_credentials_stay_out_of_debug_logs(s3_ids, cloud_env: Env, tokens: bool) -> None:
    auth = "ecs-auth-" + uuid.uuid4().hex
    with CredentialServer(aws_keys=[KEYS[6]], session_tokens=tokens, container_auth_token=auth) as ecs:
        source = _s3(s3_ids, cloud_env(**ecs.ecs_env()), secrets=[auth, *_served(ecs, auth)], refused=tokens)
        _check_every_path(_url(s3_ids), source)
        assert ecs.fetches["ecs"] >= 1


@pytest.mark.parametrize("backend", ["obstore", "fsspec"])
@pytest.mark.parametrize("tokens", [False, True], ids=["keys", "session-tokens"])
def test_s3_web_identity_stays_out_of_debug_logs(
    s3_ids, cloud_env: Env, tmp_path: Path, tokens: bool, backend: str
) -> None:
    """EKS IRSA: the web identity token, and the role's secret key and session token from STS; through
    obstore (botocore fetches the credentials) and s3fs (aiobotocore signs every request with them too)."""
    web_token = _web_identity_token()
    with CredentialServer(aws_keys=[KEYS[7]], session_tokens=tokens, web_identity_token=web_token) as sts:
        env = cloud_env(**sts.web_identity_env(tmp_path / "web-identity-token"))
        source = _s3(s3_ids, env, secrets=[web_token, *_served(sts)], refused=tokens)
        source.options["objckpt_backend"] = backend
        _check_every_path(_url(s3_ids), source)
        assert sts.fetches["sts-web-identity"] >= 1


# ---------------------------------------------------------------------------- GCS rows


def _gcs(gcs_service: Any, proxy: Any, env: dict[str, str], **more: Any) -> tuple[str, Source]:
    url = gcs_service.url(f"debuglog-{uuid.uuid4().hex[:10]}/ckpt")
    return url, Source(env=env, options={"endpoint_url": proxy.endpoint_url, "project": "test"}, **more)


def _private_key_lines(key_file: Path) -> list[str]:
    pem = json.loads(key_file.read_text())["private_key"]
    return [line for line in pem.splitlines() if line and "-----" not in line][:3]


@pytest.mark.gcs
def test_gcs_service_account_json_stays_out_of_debug_logs(
    gcs_service, gcs_bearer_proxy, gce_metadata, cloud_env, tmp_path
) -> None:
    key_file = gce_metadata.write_service_account_json(tmp_path / "sa.json")
    url, source = _gcs(gcs_service, gcs_bearer_proxy, cloud_env(), secrets=_private_key_lines(key_file))
    source.options["token"] = str(key_file)
    _check_every_path(url, source)


@pytest.mark.gcs
@pytest.mark.parametrize("where", ["GOOGLE_APPLICATION_CREDENTIALS", "gcloud-well-known-file"])
def test_gcs_application_default_credentials_stay_out_of_debug_logs(
    gcs_service, gcs_bearer_proxy, gce_metadata, cloud_env, tmp_path, where
) -> None:
    if where == "GOOGLE_APPLICATION_CREDENTIALS":
        key_file = gce_metadata.write_service_account_json(tmp_path / "sa.json")
        env = cloud_env(GOOGLE_APPLICATION_CREDENTIALS=str(key_file))
    else:
        gcloud = tmp_path / "home" / ".config" / "gcloud"
        gcloud.mkdir(parents=True)
        key_file = gce_metadata.write_service_account_json(gcloud / "application_default_credentials.json")
        env = cloud_env()
    _check_every_path(*_gcs(gcs_service, gcs_bearer_proxy, env, secrets=_private_key_lines(key_file)))


@pytest.mark.gcs
def test_gcs_metadata_server_tokens_stay_out_of_debug_logs(
    gcs_service, gcs_bearer_proxy, gce_metadata, cloud_env
) -> None:
    fetched = gce_metadata.fetches["gce"]
    _check_every_path(*_gcs(gcs_service, gcs_bearer_proxy, cloud_env(**gce_metadata.gce_env())))
    assert gce_metadata.fetches["gce"] > fetched


@pytest.mark.gcs
def test_gcs_workload_identity_federation_stays_out_of_debug_logs(
    gcs_service, gcs_bearer_proxy, gce_metadata, cloud_env, tmp_path
) -> None:
    """The subject token (the same web identity token every CredentialServer accepts) and the exchanged tokens."""
    config = gce_metadata.write_external_account_json(tmp_path / "wif.json", tmp_path / "subject-token")
    subject = (tmp_path / "subject-token").read_text()
    env = cloud_env(GOOGLE_APPLICATION_CREDENTIALS=str(config))
    fetched = gce_metadata.fetches["sts-exchange"]
    _check_every_path(*_gcs(gcs_service, gcs_bearer_proxy, env, secrets=[subject]))
    assert gce_metadata.fetches["sts-exchange"] > fetched


# ---------------------------------------------------------------------------- gcsfs: no public single attempt


@pytest.mark.gcs
def test_gcsfs_public_knobs_do_not_make_one_attempt(gcs_service) -> None:
    """Why ``gcs_open._one_attempt_per_request`` uses gcsfs's ``_request.__wrapped__`` (docs/ARCHITECTURE.md).

    gcsfs's public knobs leave its retries on: the ``retries`` attribute is read
    once, when ``retry_request(retries=retries)`` decorates the class, so setting it
    on an instance (or passing it) changes nothing, and ``requests_timeout`` bounds
    one attempt, not the attempts. A throttled read made with both is retried by
    gcsfs, unseen by objckpt's engine. If a gcsfs release honours them, this test
    fails: switch ``_one_attempt_per_request`` to the public way then.
    """
    import fsspec.asyn
    import gcsfs.core

    from backends.proxy import FaultProxy

    with FaultProxy(*_host_port(gcs_service.endpoint_url)) as proxy:
        fs = gcsfs.core.GCSFileSystem(
            endpoint_url=proxy.endpoint_url, token="anon", project="test", requests_timeout=2, retries=1,
            skip_instance_cache=True,
        )  # fmt: skip
        fs.retries = 1
        key = f"{gcs_service.bucket}/knobs-{uuid.uuid4().hex[:8]}"
        fs.pipe_file(key, b"z" * 10)
        before = proxy.stats.requests
        proxy.set_faults(1.0, ("429",))
        with pytest.raises(fsspec.asyn.FSTimeoutError):  # still retrying (1-2 s apart) after 4 s
            fsspec.asyn.sync(fs.loop, fs._cat_file, key, timeout=4)
        assert proxy.stats.requests - before >= 2, "gcsfs made one attempt: use its public switch"
        proxy.set_faults(0.0)


# ---------------------------------------------------------------------------- the filter, in process

#: What botocore, google-auth and urllib3 log at DEBUG, in their shapes, with made-up secrets.
_CLIENT_RECORDS = [
    ("botocore.endpoint", "Making request with params: %s", {"body": {"WebIdentityToken": "wit-SECRET-1"}}),
    ("botocore.parsers", "Response body:\n%s", b"<SecretAccessKey>sak/SECRET+2</SecretAccessKey>"
     b"<SessionToken>st-SECRET-3</SessionToken>"),
    ("botocore.auth", "CanonicalRequest:\nGET\n/\n\nx-amz-security-token:%s\n", "xst-SECRET-4"),
    ("botocore.endpoint", "headers: %s", {"Authorization": b"AWS4-HMAC-SHA256 Credential=AK, Signature=SECRET5"}),
    ("botocore.utils", "%s", '{"AccessKeyId":"AKID","SecretAccessKey":"ecs-SECRET-6","Token":"tok-SECRET-7"}'),
    ("urllib3.connectionpool", '"GET /k?X-Amz-Signature=%s&X-Amz-Security-Token=%s HTTP/1.1" 200', ("SECRET8", "S9")),
    ("google.auth.transport.requests", "Authorization: Bearer %s", "gat-SECRET-10"),
    ("google.oauth2._client", "body: grant_type=jwt-bearer&assertion=%s", "eyJhbGc.eyJpc3MiOi.c2lnbmF0dXJl"),
    ("google.auth._default", "%s", {"private_key": "-----BEGIN PRIVATE KEY-----\nMIIEvSECRET11\n-----END PRIVATE KEY-----\n"}),
    ("gcsfs.credentials", "token %s", {"access_token": "ya29.SECRET-12", "refresh_token": "1//0gSECRET13xyzxyz"}),
]  # fmt: skip
_CLIENT_SECRETS = ["wit-SECRET-1", "sak/SECRET+2", "st-SECRET-3", "xst-SECRET-4", "SECRET5", "ecs-SECRET-6",
                   "tok-SECRET-7", "SECRET8", "S9", "gat-SECRET-10", "eyJhbGc.eyJpc3MiOi", "SECRET11", "SECRET-12",
                   "SECRET13"]  # fmt: skip


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name} {record.levelname} {record.getMessage()}")


@pytest.fixture
def user_logging() -> Iterator[_Collect]:
    """A library user's DEBUG logging: a handler on the root logger, as ``basicConfig`` adds."""
    root = logging.getLogger()
    handler, level = _Collect(), root.level
    # Other libraries loaded in this process (earlier tests) may have re-levelled, muted or
    # detached the clients' loggers; a user who asks for DEBUG gets their records.
    names = {name for name, _, _ in _CLIENT_RECORDS} | {"botocore.hooks"}
    chains = {".".join(name.split(".")[:n]) for name in names for n in range(1, name.count(".") + 2)}
    clients = [logging.getLogger(name) for name in sorted(chains)]
    saved = [(c, c.level, c.propagate, c.disabled) for c in clients]
    for c in clients:
        c.setLevel(logging.DEBUG)
        c.propagate, c.disabled = True, False
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        for c, lvl, propagate, disabled in saved:
            c.setLevel(lvl)
            c.propagate, c.disabled = propagate, disabled


def _log_client_records() -> None:
    for name, message, args in _CLIENT_RECORDS:
        logging.getLogger(name).debug(message, *(args if isinstance(args, tuple) else (args,)))
    logging.getLogger("botocore.hooks").debug("Event %s: calling handler %s", "before-sign.s3", "sign")


def test_opening_a_store_redacts_client_records_and_keeps_them_all(user_logging, tmp_path) -> None:
    """Every client record still reaches the user's handler, at its level, with its secrets masked;
    no level, handler or propagation of any logger changes."""
    from objckpt import logs
    from objckpt.storage.registry import from_url

    names = ["", *{name for name, _, _ in _CLIENT_RECORDS}]
    before = {name: (logging.getLogger(name).level, logging.getLogger(name).propagate) for name in names}
    handlers = list(logging.getLogger().handlers)
    try:
        from_url("s3://bucket/prefix", key="AKIDEXAMPLE", secret="not-used-here", objckpt_backend="fsspec")
        _log_client_records()
    finally:
        logs.redact_client_logs(True)
    assert {name: (logging.getLogger(name).level, logging.getLogger(name).propagate) for name in names} == before
    assert logging.getLogger().handlers == handlers
    lines = [line for line in user_logging.lines if not line.startswith(("objckpt", "botocore.credentials"))]
    assert len([line for line in lines if " DEBUG " in line]) >= len(_CLIENT_RECORDS) + 1
    text = "\n".join(lines)
    assert [secret for secret in _CLIENT_SECRETS if secret in text] == [], text
    assert "Event before-sign.s3: calling handler sign" in text  # records without secrets: untouched
    assert "'WebIdentityToken': '***'" in text and "<SessionToken>***</SessionToken>" in text


def test_redaction_can_be_turned_off(user_logging) -> None:
    """``redact_client_logs(False)``: the clients' records exactly as logged; on again, masked again."""
    from objckpt import logs

    logs.guard_client_loggers()
    try:
        logs.redact_client_logs(False)
        logs.guard_client_loggers()  # opening a store adds nothing while off
        _log_client_records()
        assert "wit-SECRET-1" in "\n".join(user_logging.lines)
    finally:
        logs.redact_client_logs(True)
    user_logging.lines.clear()
    _log_client_records()
    assert "wit-SECRET-1" not in "\n".join(user_logging.lines)


def test_local_stores_leave_client_loggers_alone(tmp_path, monkeypatch) -> None:
    """A ``file://`` store makes no client: objckpt adds no filter to anyone's logger."""
    from objckpt import logs
    from objckpt.storage.registry import from_url

    logs.redact_client_logs(False)
    monkeypatch.setattr(logs, "_enabled", True)  # on, with no filter added yet
    try:
        from_url(str(tmp_path))
        from_url(f"file://{tmp_path}/other")
        assert not any(logging.getLogger(name).filters for name in logs.CLIENT_LOGGERS)
    finally:
        logs.redact_client_logs(True)


def test_the_cli_run_in_process_takes_back_its_log_handler_and_levels(tmp_path: Path) -> None:
    """``main`` run inside another program (tests, a notebook) leaves the root logger as it found it."""
    from objckpt.cli import main

    root, ours = logging.getLogger(), logging.getLogger("objckpt")
    handlers, levels = list(root.handlers), (root.level, ours.level)
    assert main(["ls", str(tmp_path), "--debug"]) in (0, 1)
    assert main(["ls", str(tmp_path / "missing"), "-v"]) in (0, 1)
    assert root.handlers == handlers
    assert (root.level, ours.level) == levels


@pytest.mark.parametrize("backend", ["obstore", "fsspec"])
def test_s3_web_identity_token_of_any_shape_stays_out_of_debug_logs(
    s3_ids, cloud_env: Env, tmp_path: Path, backend: str
) -> None:
    """A web identity token no shape knows (opaque, with a quote, so a pattern stops halfway): the
    token file's contents are redacted by value, whole, in the CLI's ``--debug`` output and under
    ``basicConfig(level=DEBUG)``."""
    web_token = f"opaque-{uuid.uuid4().hex}'{uuid.uuid4().hex}"
    with CredentialServer(aws_keys=[KEYS[8]], session_tokens=False, web_identity_token=web_token) as sts:
        env = cloud_env(**sts.web_identity_env(tmp_path / "web-identity-token"))
        source = _s3(s3_ids, env, secrets=[web_token, *web_token.split("'"), *_served(sts)])
        source.options["objckpt_backend"] = backend
        _check_every_path(_url(s3_ids), source)
        assert sts.fetches["sts-web-identity"] >= 1


def test_what_credential_sources_hold_is_redacted_by_value_in_any_record(user_logging, cloud_env, tmp_path) -> None:
    """Opening a store reads what its credential sources hold (the web identity token file, profile
    and SSO cache files, service-account, authorized-user and external-account files) and masks those
    values in any client record, in any shape: bare, quoted, escaped, inside a logged exception."""
    from objckpt.storage.registry import from_url

    web_token = f"opaque-{uuid.uuid4().hex}'{uuid.uuid4().hex}"
    (tmp_path / "wit").write_text(web_token + "\n")
    home = tmp_path / "home"
    profile_secret, sso_token = f"profile-{uuid.uuid4().hex}", f"sso-{uuid.uuid4().hex}"
    (home / ".aws" / "sso" / "cache").mkdir(parents=True)
    (home / ".aws" / "config").write_text(f"[profile other]\naws_secret_access_key = {profile_secret}\n")
    (home / ".aws" / "sso" / "cache" / "x.json").write_text(json.dumps({"accessToken": sso_token}))
    with CredentialServer(aws_keys=[KEYS[9]]) as google:
        key_file = google.write_service_account_json(tmp_path / "sa.json")
        user = json.loads(google.write_authorized_user_json(tmp_path / "user.json").read_text())
        wif = google.write_external_account_json(tmp_path / "wif.json", tmp_path / "subject")
    subject = (tmp_path / "subject").read_text()
    key_line = _private_key_lines(key_file)[1]
    cloud_env(
        AWS_WEB_IDENTITY_TOKEN_FILE=str(tmp_path / "wit"),
        AWS_ROLE_ARN="arn:aws:iam::123456789012:role/objckpt-test",
        AWS_REGION="us-east-1",
        GOOGLE_APPLICATION_CREDENTIALS=str(wif),
    )
    from_url("s3://bucket/prefix", objckpt_backend="fsspec")
    from_url("gs://bucket/prefix", token=str(key_file), endpoint_url="http://127.0.0.1:9")
    from_url("gs://bucket/prefix", token=user, endpoint_url="http://127.0.0.1:9")

    secrets = [web_token, *web_token.split("'"), profile_secret, sso_token, key_line, user["refresh_token"],
               user["client_secret"], subject]  # fmt: skip
    rendered: list[str] = []

    class Render(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            rendered.append(logging.Formatter("%(name)s %(message)s").format(record))

    root, handler = logging.getLogger(), Render(logging.DEBUG)
    root.addHandler(handler)
    try:
        for name in ("botocore.credentials", "botocore.endpoint", "google.auth._default", "urllib3.connectionpool"):
            log = logging.getLogger(name)
            log.debug("read %s", web_token)
            log.debug("params %r", {"token": web_token, "other": [profile_secret, sso_token]})
            log.debug("%s %s %s %s", key_line, user["refresh_token"], user["client_secret"], subject)
            try:
                raise ValueError(f"the token file held {web_token!r}")
            except ValueError:
                log.debug("failed", exc_info=True)
    finally:
        root.removeHandler(handler)
    text = "\n".join(rendered + user_logging.lines)
    assert "the token file held" in text and text.count("***") >= 4 * 4
    assert [secret[:10] for secret in secrets if secret in text] == [], text[-3000:]
