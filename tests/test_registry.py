"""Choosing the adapter for a URL, translating options for obstore, mapping its errors.

No servers: the translation is pure, and a store is only built, never asked
anything, except on local disk.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from objckpt.errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
    StoreNotAvailableError,
    StorePermissionError,
    TransientStoreError,
)
from objckpt.storage import from_url
from objckpt.storage.errors import map_obstore_error
from objckpt.storage.fsspec.gcs import GcsFsspecStore
from objckpt.storage.fsspec.local import LocalFsspecStore
from objckpt.storage.fsspec.memory import MemoryFsspecStore
from objckpt.storage.fsspec.s3 import S3FsspecStore
from objckpt.storage.fsspec.store import FsspecStore
from objckpt.storage.obstore.config import NotTranslatable, translate_gcs, translate_s3
from objckpt.storage.obstore.store import ObstoreStore
from objckpt.storage.opening import BACKEND_ENV

pytest.importorskip("obstore")

ENDPOINT = "http://127.0.0.1:9000"
S3FS_STYLE = {  # what tests/conftest.py and most users pass for an S3-compatible server
    "key": "AKIDEXAMPLE",
    "secret": "wJalrXUtnFEMI",
    "client_kwargs": {"endpoint_url": ENDPOINT, "region_name": "us-east-1"},
    "config_kwargs": {"s3": {"addressing_style": "path"}},
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (
        BACKEND_ENV,
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_PROFILE",
        "STORAGE_EMULATOR_HOST",
        "GOOGLE_APPLICATION_CREDENTIALS",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws files


# ------------------------------------------------------------ translation


def test_translate_s3fs_options() -> None:
    spec = translate_s3("s3://bucket/ckpts/run1/", S3FS_STYLE, {})
    assert (spec.kind, spec.bucket, spec.prefix, spec.endpoint) == ("s3", "bucket", "ckpts/run1", ENDPOINT)
    assert spec.config == {
        "access_key_id": "AKIDEXAMPLE",
        "secret_access_key": "wJalrXUtnFEMI",
        "endpoint": ENDPOINT,
        "region": "us-east-1",
        "virtual_hosted_style_request": False,
        "unsigned_payload": False,  # plain HTTP: sign the payload, as botocore does
    }
    assert "wJalrXUtnFEMI" not in repr(spec)


def test_translate_s3_top_level_names_and_token() -> None:
    spec = translate_s3(
        "s3a://b",
        {"key": "a", "secret": "s", "token": "t", "endpoint_url": "https://minio:9000", "requester_pays": True},
        {},
    )
    assert spec.config["session_token"] == "t"
    assert spec.config["endpoint"] == "https://minio:9000"
    assert spec.config["region"] == "us-east-1"  # a custom endpoint needs no real region
    assert spec.config["unsigned_payload"] is True  # HTTPS: TLS guards the body
    assert spec.config["request_payer"] is True
    assert spec.prefix == ""


def test_translate_s3_environment() -> None:
    env = {
        "AWS_ACCESS_KEY_ID": "envkey",
        "AWS_SECRET_ACCESS_KEY": "envsecret",
        "AWS_SESSION_TOKEN": "envtoken",
        "AWS_ENDPOINT_URL": ENDPOINT,
        "AWS_DEFAULT_REGION": "eu-west-1",
    }
    spec = translate_s3("s3://b/p", {}, env)
    assert spec.config["access_key_id"] == "envkey"
    assert spec.config["session_token"] == "envtoken"
    assert spec.config["endpoint"] == ENDPOINT
    assert spec.config["region"] == "eu-west-1"
    # Options win over the environment.
    assert translate_s3("s3://b", {"key": "k", "secret": "s"}, env).config["access_key_id"] == "k"
    assert translate_s3("s3://b", {}, {**env, "AWS_ENDPOINT_URL_S3": "http://s3only"}).endpoint == "http://s3only"


def test_translate_s3_anonymous() -> None:
    spec = translate_s3("s3://public/x", {"anon": True}, {"AWS_REGION": "us-west-2"})
    assert spec.config["skip_signature"] is True
    assert "access_key_id" not in spec.config
    assert spec.config["region"] == "us-west-2"


@pytest.mark.parametrize(
    ("options", "environ", "why"),
    [
        ({"s3_additional_kwargs": {"ACL": "private"}}, {"AWS_REGION": "us-east-1"}, "s3_additional_kwargs"),
        ({"profile": "dev"}, {"AWS_REGION": "us-east-1"}, "profile"),
        ({"version_aware": True}, {"AWS_REGION": "us-east-1"}, "version_aware"),
        ({"config_kwargs": {"signature_version": "s3"}}, {"AWS_REGION": "us-east-1"}, "signature_version"),
        ({"key": "only-a-key"}, {"AWS_REGION": "us-east-1"}, "secret"),
        ({}, {}, "region"),  # AWS proper with no region: s3fs finds the bucket's region
        ({}, {"AWS_PROFILE": "dev", "AWS_REGION": "us-east-1"}, "profile"),
        (
            {"endpoint_url": ENDPOINT, "config_kwargs": {"s3": {"addressing_style": "virtual"}}},
            {},
            "virtual",
        ),
    ],
)
def test_translate_s3_refuses_what_it_cannot_honour(options: dict[str, Any], environ: dict[str, str], why: str) -> None:
    with pytest.raises(NotTranslatable, match=why):
        translate_s3("s3://bucket/x", options, environ)


def test_translate_s3_shared_credentials_file_means_fsspec(tmp_path: Path) -> None:
    credentials = tmp_path / "credentials"
    credentials.write_text("[default]\naws_access_key_id = x\naws_secret_access_key = y\n")
    env = {"AWS_SHARED_CREDENTIALS_FILE": str(credentials), "AWS_REGION": "us-east-1"}
    with pytest.raises(NotTranslatable, match="profile"):
        translate_s3("s3://b", {}, env)
    # Web-identity credentials come before the shared files, and obstore reads them.
    translate_s3("s3://b", {}, {**env, "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/token"})


def test_profile_files_are_read_through_botocore_for_obstore(tmp_path: Path) -> None:
    """A shared credentials file (any botocore source obstore cannot read) reaches obstore
    as a credential provider; the environment's web identity goes to obstore natively."""
    from objckpt.storage.auth.credentials import BotocoreCredentials, resolve_s3_source

    credentials = tmp_path / "credentials"
    credentials.write_text("[dev]\naws_access_key_id = filekey\naws_secret_access_key = filesecret\n")
    config = tmp_path / "config"
    config.write_text("[profile dev]\nregion = eu-north-1\n")
    env = {"AWS_SHARED_CREDENTIALS_FILE": str(credentials), "AWS_CONFIG_FILE": str(config), "AWS_PROFILE": "dev"}
    with pytest.MonkeyPatch.context() as mp:
        for name in [k for k in os.environ if k.startswith("AWS_")]:
            mp.delenv(name)
        for name, value in env.items():
            mp.setenv(name, value)
        source = resolve_s3_source("s3://b", {}, os.environ)
        spec = translate_s3("s3://b", {}, os.environ, source)
    assert source.method == "shared-credentials-file"
    assert isinstance(spec.credential_provider, BotocoreCredentials)
    assert spec.credential_provider()["access_key_id"] == "filekey"
    assert spec.credential_provider()["expires_at"] is None  # static keys never lapse
    assert spec.config["region"] == "eu-north-1" and "access_key_id" not in spec.config
    assert "filesecret" not in repr(spec) + repr(source) + repr(spec.credential_provider)


def test_translate_s3_trust_settings(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    env = {"AWS_REGION": "us-east-1"}
    assert translate_s3("s3://b", {"client_kwargs": {"verify": str(ca)}}, env).client == {
        "root_certificate": ca.read_bytes()
    }
    assert translate_s3("s3://b", {}, {**env, "AWS_CA_BUNDLE": str(ca)}).client["root_certificate"] == ca.read_bytes()
    assert translate_s3("s3://b", {"client_kwargs": {"verify": False}}, env).client == {
        "allow_invalid_certificates": True
    }
    with pytest.raises(ValueError, match="missing.pem"):
        translate_s3("s3://b", {}, {**env, "AWS_CA_BUNDLE": str(tmp_path / "missing.pem")})


def test_translate_s3_payload_signing_override() -> None:
    signing = {"config_kwargs": {"s3": {"payload_signing_enabled": True}}}
    spec = translate_s3("s3://b", {**signing, "anon": True}, {"AWS_REGION": "us-east-1"})
    assert spec.config["unsigned_payload"] is False


def test_translate_gcs(tmp_path: Path) -> None:
    spec = translate_gcs(
        "gs://bucket/p", {"endpoint_url": "http://127.0.0.1:4443", "token": "anon", "project": "t"}, {}
    )
    assert spec.config == {"base_url": "http://127.0.0.1:4443", "skip_signature": True}
    key_file = tmp_path / "sa.json"
    key_file.write_text("{}")
    assert translate_gcs("gs://b", {"token": str(key_file)}, {}).config == {"service_account": str(key_file)}
    env = {"GOOGLE_APPLICATION_CREDENTIALS": "/etc/adc.json"}
    assert translate_gcs("gs://b", {}, env).config == {"application_credentials": "/etc/adc.json"}
    emulated = translate_gcs("gs://b", {}, {"STORAGE_EMULATOR_HOST": "127.0.0.1:4443"})
    assert emulated.config == {"base_url": "http://127.0.0.1:4443", "skip_signature": True}
    with pytest.raises(NotTranslatable):
        translate_gcs("gs://b", {"token": {"client_email": "x"}}, {})
    with pytest.raises(NotTranslatable):
        translate_gcs("gs://b", {"consistency": "md5"}, {})


# --------------------------------------------------------- adapter choice


def test_s3_defaults_to_obstore_when_options_translate() -> None:
    store = from_url("s3://bucket/run", **S3FS_STYLE)
    assert isinstance(store, ObstoreStore)
    assert store.url == "s3://bucket/run"
    assert S3FS_STYLE["secret"] not in repr(store)


def test_untranslatable_options_fall_back_to_fsspec() -> None:
    pytest.importorskip("s3fs")
    store = from_url("s3://bucket/run", **S3FS_STYLE, s3_additional_kwargs={"ACL": "private"})
    assert isinstance(store, FsspecStore)


def test_backend_option_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("s3fs")
    assert isinstance(from_url("s3://b/x", **S3FS_STYLE, objckpt_backend="fsspec"), FsspecStore)
    monkeypatch.setenv(BACKEND_ENV, "fsspec")
    assert isinstance(from_url("s3://b/x", **S3FS_STYLE), FsspecStore)
    assert isinstance(from_url("s3://b/x", **S3FS_STYLE, objckpt_backend="obstore"), ObstoreStore)  # option wins
    monkeypatch.setenv(BACKEND_ENV, "nonsense")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        from_url("s3://b/x", **S3FS_STYLE)
    with pytest.raises(ValueError, match="objckpt_backend"):
        from_url("s3://b/x", **S3FS_STYLE, objckpt_backend="boto")


def test_forcing_obstore_never_falls_back_silently(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="s3_additional_kwargs"):
        from_url("s3://b/x", **S3FS_STYLE, s3_additional_kwargs={}, objckpt_backend="obstore")
    with pytest.raises(ValueError, match="no native store"):
        from_url("memory://x", objckpt_backend="obstore")
    monkeypatch.setitem(sys.modules, "obstore", None)
    with pytest.raises(StoreNotAvailableError, match="pip install obstore"):
        from_url("s3://b/x", **S3FS_STYLE, objckpt_backend="obstore")


def test_environment_only_steers_schemes_with_a_native_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(BACKEND_ENV, "obstore")
    assert isinstance(from_url("memory://steer/x"), FsspecStore)
    assert isinstance(from_url(str(tmp_path / "d")), ObstoreStore)
    monkeypatch.delenv(BACKEND_ENV)
    assert isinstance(from_url(str(tmp_path / "d")), FsspecStore)  # local disk: fsspec by default


def test_each_filesystem_gets_its_own_fsspec_store_class(tmp_path: Path) -> None:
    """The class is chosen once, by filesystem, when the store is opened; child stores keep it."""
    pytest.importorskip("s3fs")
    pytest.importorskip("gcsfs")
    gcs = {"endpoint_url": "http://127.0.0.1:1", "token": "anon"}
    opened = {
        LocalFsspecStore: from_url(str(tmp_path / "d")),
        MemoryFsspecStore: from_url("memory://classes/x"),
        S3FsspecStore: from_url("s3://b/x", **S3FS_STYLE, objckpt_backend="fsspec"),
        GcsFsspecStore: from_url("gs://b/x", **gcs),
        FsspecStore: from_url("simplecache::memory://classes/y"),  # no class of its own: the generic one
    }
    for cls, store in opened.items():
        assert type(store) is cls
        assert type(store.child("c")) is cls
    assert not opened[FsspecStore].supports_create
    assert all(store.supports_create for cls, store in opened.items() if cls is not FsspecStore)


def test_gcs_stays_on_gcsfs_unless_asked() -> None:
    pytest.importorskip("gcsfs")
    options = {"endpoint_url": "http://127.0.0.1:1", "token": "anon"}
    assert isinstance(from_url("gs://b/x", **options), FsspecStore)
    assert isinstance(from_url("gs://b/x", **options, objckpt_backend="obstore"), ObstoreStore)


# ---------------------------------------------------------- obstore errors


def test_obstore_errors_map_by_class() -> None:
    import obstore.exceptions as oe

    what = "put s3://b/k"
    assert isinstance(map_obstore_error(oe.AlreadyExistsError("x"), what, create=True), ObjectExistsError)
    assert isinstance(map_obstore_error(oe.PreconditionError("x"), what, create=True), ObjectExistsError)
    assert isinstance(map_obstore_error(oe.AlreadyExistsError("x"), what), TransientStoreError)  # 409 on a PUT
    assert type(map_obstore_error(oe.PreconditionError("x"), what)) is StoreError
    assert isinstance(map_obstore_error(FileNotFoundError("x"), what), ObjectNotFoundError)
    assert isinstance(map_obstore_error(oe.NotFoundError("x"), what), ObjectNotFoundError)
    assert isinstance(map_obstore_error(oe.PermissionDeniedError("x"), what), StorePermissionError)
    assert isinstance(map_obstore_error(oe.UnauthenticatedError("x"), what), StorePermissionError)
    assert isinstance(map_obstore_error(oe.GenericError("503 Slow Down"), what), TransientStoreError)
    assert type(map_obstore_error(oe.InvalidPathError("x"), what)) is StoreError
    assert type(map_obstore_error(oe.NotSupportedError("x"), what)) is StoreError
    assert isinstance(map_obstore_error(ConnectionResetError(), what), TransientStoreError)
    message = str(map_obstore_error(oe.GenericError("GET http://h/b/k?X-Amz-Signature=abc failed\n\ndebug"), what))
    assert "abc" not in message and "debug" not in message
